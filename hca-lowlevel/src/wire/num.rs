//! 24-bit wire quantities: queue pair and EE context numbers, and the
//! packet and message sequence numbers with their modulo-2^24 arithmetic.
//!
//! The IBA packs these into three bytes. A newtype per quantity keeps a
//! 32-bit value with stray high bits from ever reaching a header, and keeps
//! a PSN from being compared with `<` (which is wrong across the wrap).

use core::cmp::Ordering;
use core::fmt;

/// The mask of a 24-bit field.
const MASK24: u32 = 0x00ff_ffff;

macro_rules! u24_newtype {
    ($(#[$meta:meta])* $name:ident) => {
        $(#[$meta])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
        pub struct $name(u32);

        impl $name {
            /// The largest value (2^24 - 1).
            pub const MAX: Self = Self(MASK24);

            /// The value, or `None` when it does not fit in 24 bits.
            #[inline]
            pub const fn new(value: u32) -> Option<Self> {
                if value <= MASK24 { Some(Self(value)) } else { None }
            }

            /// The low 24 bits of `value` (what the wire field can hold).
            #[inline]
            pub const fn from_low_bits(value: u32) -> Self {
                Self(value & MASK24)
            }

            /// The value as a `u32` (always below 2^24).
            #[inline]
            pub const fn get(self) -> u32 {
                self.0
            }
        }

        impl From<$name> for u32 {
            #[inline]
            fn from(value: $name) -> u32 {
                value.0
            }
        }

        impl TryFrom<u32> for $name {
            type Error = u32;

            /// Fails (returning the value) when it does not fit in 24 bits.
            #[inline]
            fn try_from(value: u32) -> core::result::Result<Self, u32> {
                Self::new(value).ok_or(value)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!(stringify!($name), "({:#08x})"), self.0)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }
    };
}

macro_rules! serial_arithmetic {
    ($name:ident) => {
        impl $name {
            /// `self + n` modulo 2^24.
            #[inline]
            #[must_use]
            pub const fn wrapping_add(self, n: u32) -> Self {
                Self(self.0.wrapping_add(n) & MASK24)
            }

            /// `self - n` modulo 2^24.
            #[inline]
            #[must_use]
            pub const fn wrapping_sub(self, n: u32) -> Self {
                Self(self.0.wrapping_sub(n) & MASK24)
            }

            /// The successor modulo 2^24.
            #[inline]
            #[must_use]
            pub const fn next(self) -> Self {
                self.wrapping_add(1)
            }

            /// How far ahead of `from` this value is, going forward modulo 2^24
            /// (`0..2^24`): the number of increments that lead from `from` to `self`.
            #[inline]
            pub const fn distance_from(self, from: Self) -> u32 {
                self.0.wrapping_sub(from.0) & MASK24
            }

            /// The signed difference `self - other` in `-2^23..2^23`.
            ///
            /// This is the IBA/rxe `psn_compare` rule: the 24-bit difference
            /// shifted into the top of an `i32`. A difference of exactly 2^23
            /// counts as negative (`self` is before `other`).
            #[inline]
            pub const fn diff(self, other: Self) -> i32 {
                // CAST: reinterpreting the shifted 32-bit difference as signed is
                // the point; the arithmetic shift restores the magnitude.
                ((self.0.wrapping_sub(other.0) << 8) as i32) >> 8
            }

            /// Modulo-2^24 order of `self` relative to `other` (see [`Self::diff`]).
            ///
            /// Not an `Ord` impl: serial order is not transitive over the
            /// whole space, only within a window of 2^23.
            #[inline]
            pub const fn serial_cmp(self, other: Self) -> Ordering {
                let d = self.diff(other);
                if d < 0 {
                    Ordering::Less
                } else if d > 0 {
                    Ordering::Greater
                } else {
                    Ordering::Equal
                }
            }

            /// `self` comes strictly before `other` modulo 2^24.
            #[inline]
            pub const fn is_before(self, other: Self) -> bool {
                self.diff(other) < 0
            }

            /// `self` comes strictly after `other` modulo 2^24.
            #[inline]
            pub const fn is_after(self, other: Self) -> bool {
                self.diff(other) > 0
            }
        }
    };
}

u24_newtype! {
    /// A queue pair number (BTH DestQP, DETH SrcQP, CM local QPN).
    Qpn
}

impl Qpn {
    /// QP1, the general services (GSI) QP that carries MADs such as the CM's.
    pub const GSI: Self = Self(1);
}

u24_newtype! {
    /// An end-to-end context number (RD transport: RDETH, CM REQ/REP EECN).
    Eecn
}

u24_newtype! {
    /// A packet sequence number: 24 bits, compared modulo 2^24.
    Psn
}
serial_arithmetic!(Psn);

u24_newtype! {
    /// A message sequence number (AETH MSN): 24 bits, counted modulo 2^24.
    Msn
}
serial_arithmetic!(Msn);

#[cfg(test)]
mod tests {
    use super::*;

    fn psn(v: u32) -> Psn {
        Psn::new(v).unwrap()
    }

    #[test]
    fn construction_checks_24_bits() {
        assert_eq!(Psn::new(0xff_ffff), Some(Psn::MAX));
        assert_eq!(Psn::new(0x100_0000), None);
        assert_eq!(Qpn::try_from(0x100_0000), Err(0x100_0000));
        assert_eq!(Qpn::from_low_bits(0x1234_5678).get(), 0x34_5678);
        assert_eq!(u32::from(Eecn::from_low_bits(7)), 7);
    }

    #[test]
    fn add_wraps_modulo_2_24() {
        assert_eq!(psn(0xff_fffe).wrapping_add(3), psn(1));
        assert_eq!(psn(0xff_ffff).next(), psn(0));
        assert_eq!(psn(2).wrapping_sub(3), psn(0xff_ffff));
        assert_eq!(psn(5).wrapping_add(u32::MAX), psn(4));
    }

    #[test]
    fn diff_and_order_follow_psn_compare() {
        assert_eq!(psn(10).diff(psn(3)), 7);
        assert_eq!(psn(3).diff(psn(10)), -7);
        // Across the wrap: 1 is after 0xfffffe.
        assert_eq!(psn(1).diff(psn(0xff_fffe)), 3);
        assert!(psn(1).is_after(psn(0xff_fffe)));
        assert!(psn(0xff_fffe).is_before(psn(1)));
        assert_eq!(psn(7).serial_cmp(psn(7)), Ordering::Equal);
        // Exactly half the space apart counts as "before" in both directions,
        // as rxe's signed shift does.
        assert_eq!(psn(0x80_0000).diff(psn(0)), -0x80_0000);
        assert_eq!(psn(0).diff(psn(0x80_0000)), -0x80_0000);
        // Just under half: forward.
        assert_eq!(psn(0x7f_ffff).diff(psn(0)), 0x7f_ffff);
    }

    #[test]
    fn distance_is_forward_modulo() {
        assert_eq!(psn(5).distance_from(psn(5)), 0);
        assert_eq!(psn(2).distance_from(psn(0xff_ffff)), 3);
        assert_eq!(psn(0xff_ffff).distance_from(psn(2)), 0xff_fffd);
    }

    #[test]
    fn msn_shares_the_arithmetic() {
        let m = Msn::new(0xff_ffff).unwrap();
        assert_eq!(m.next(), Msn::new(0).unwrap());
        assert!(m.next().is_after(m));
    }

    #[test]
    fn debug_and_display() {
        extern crate std;
        use std::format;
        assert_eq!(format!("{:?}", Qpn::GSI), "Qpn(0x000001)");
        assert_eq!(format!("{}", psn(256)), "256");
    }
}
