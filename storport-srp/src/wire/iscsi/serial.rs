//! 32-bit serial number arithmetic (RFC 1982) for CmdSN, StatSN, ExpCmdSN,
//! MaxCmdSN, DataSN and R2TSN.
//!
//! Sequence numbers wrap, so they are compared by distance: `a < b` when
//! `b` is less than 2^31 steps ahead of `a`. Two numbers exactly 2^31 apart
//! are *not comparable*, which is why [`SerialNumber`] is `PartialOrd` and
//! not `Ord`.

use core::cmp::Ordering;

/// Half the serial number space: the comparison horizon.
const HALF: u32 = 1 << 31;

/// A 32-bit iSCSI sequence number with RFC 1982 ordering.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct SerialNumber(pub u32);

impl SerialNumber {
    /// The next number (wrapping).
    #[must_use]
    pub const fn next(self) -> Self {
        Self(self.0.wrapping_add(1))
    }

    /// The previous number (wrapping).
    #[must_use]
    pub const fn prev(self) -> Self {
        Self(self.0.wrapping_sub(1))
    }

    /// `self + n`, for `n` below 2^31 (RFC 1982 defines addition only for
    /// such `n`); `None` otherwise.
    #[must_use]
    pub const fn add(self, n: u32) -> Option<Self> {
        if n < HALF {
            Some(Self(self.0.wrapping_add(n)))
        } else {
            None
        }
    }

    /// How many steps `later` is ahead of `self`, if it is not behind.
    pub fn steps_to(self, later: Self) -> Option<u32> {
        match self.partial_cmp(&later) {
            Some(Ordering::Less | Ordering::Equal) => Some(later.0.wrapping_sub(self.0)),
            _ => None,
        }
    }
}

impl PartialOrd for SerialNumber {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        let ahead = other.0.wrapping_sub(self.0);
        match ahead {
            0 => Some(Ordering::Equal),
            HALF => None,
            d if d < HALF => Some(Ordering::Less),
            _ => Some(Ordering::Greater),
        }
    }
}

impl From<u32> for SerialNumber {
    fn from(value: u32) -> Self {
        Self(value)
    }
}

/// The number of commands the target's window admits, from the ExpCmdSN
/// and MaxCmdSN of a target PDU: `MaxCmdSN - ExpCmdSN + 1`, zero when
/// `MaxCmdSN == ExpCmdSN - 1` (window closed).
///
/// Returns `None` when `MaxCmdSN < ExpCmdSN - 1` in serial arithmetic: RFC
/// 7143 says the initiator must then ignore both values.
pub fn command_window(exp_cmd_sn: SerialNumber, max_cmd_sn: SerialNumber) -> Option<u32> {
    exp_cmd_sn.prev().steps_to(max_cmd_sn)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn rfc1982_examples() {
        let a = SerialNumber(0xFFFF_FFFF);
        assert!(a < SerialNumber(0));
        assert!(SerialNumber(0) > a);
        assert!(SerialNumber(5) < SerialNumber(0x7FFF_FFFF));
        assert!(SerialNumber(5) > SerialNumber(0x8000_0006));
        assert_eq!(SerialNumber(0).partial_cmp(&SerialNumber(HALF)), None);
        assert_eq!(
            SerialNumber(7).partial_cmp(&SerialNumber(7)),
            Some(Ordering::Equal)
        );
        assert_eq!(a.next(), SerialNumber(0));
        assert_eq!(SerialNumber(0).prev(), a);
        assert_eq!(a.add(2), Some(SerialNumber(1)));
        assert_eq!(a.add(HALF), None);
        assert_eq!(a.steps_to(SerialNumber(3)), Some(4));
        assert_eq!(SerialNumber(3).steps_to(a), None);
    }

    #[test]
    fn command_window_examples() {
        let sn = SerialNumber;
        assert_eq!(command_window(sn(10), sn(10)), Some(1));
        assert_eq!(command_window(sn(10), sn(41)), Some(32));
        assert_eq!(command_window(sn(10), sn(9)), Some(0), "closed window");
        assert_eq!(command_window(sn(10), sn(8)), None, "invalid: ignore");
        assert_eq!(command_window(sn(0), sn(0xFFFF_FFFF)), Some(0));
        assert_eq!(command_window(sn(0xFFFF_FFF0), sn(0x0F)), Some(32));
    }

    proptest! {
        #[test]
        fn ordering_is_antisymmetric_and_matches_distance(a: u32, d in 1u32..HALF) {
            let x = SerialNumber(a);
            let y = SerialNumber(a.wrapping_add(d));
            prop_assert!(x < y);
            prop_assert!(y > x);
            prop_assert_eq!(x.steps_to(y), Some(d));
            prop_assert_eq!(x.add(d), Some(y));
        }

        #[test]
        fn half_apart_is_incomparable(a: u32) {
            let x = SerialNumber(a);
            let y = SerialNumber(a.wrapping_add(HALF));
            prop_assert_eq!(x.partial_cmp(&y), None);
            prop_assert_eq!(y.partial_cmp(&x), None);
        }
    }
}
