//! Which StatSNs of a connection have arrived, and so what ExpStatSN
//! acknowledges.
//!
//! A target numbers its responses when it builds them, and it may build
//! them on several threads: Linux's LIO numbers a SCSI Response on the
//! thread that completed the command and a NOP-In, TMF or Logout Response
//! on its transmit thread, then posts each when it is built. Two responses
//! built close together can therefore reach the wire in the opposite order
//! of their StatSNs, even over a reliable connection. RFC 7143 §4.2.2.2
//! only asks an initiator to act when the distance between StatSN and
//! ExpStatSN grows beyond a bound; open-iscsi takes every StatSN it sees.
//!
//! The tracker keeps ExpStatSN at the oldest status not yet received, so
//! the number the initiator acknowledges never covers a status it has not
//! seen, and remembers which later ones already came in a bitmap ring.
//! A number already received is taken as a repeat: LIO increments its
//! StatSN counter without a lock, so two threads can stamp the same
//! number, and the PDU's ITT check, not the StatSN, decides whether the
//! response itself is a duplicate. A status further from ExpStatSN, in
//! either direction, than the session can have outstanding is a protocol
//! breach: a lost status, or a target that numbers at random.

use alloc::boxed::Box;
use alloc::vec::Vec;

use crate::wire::iscsi::SerialNumber;

/// The tracker could not allocate its ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingAllocError;

/// How a StatSN arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arrival {
    /// The oldest one missing: ExpStatSN moves past it (and past any
    /// later ones already here).
    InOrder,
    /// Ahead of an older one still missing.
    Ahead,
    /// A number already received.
    Repeat,
}

/// Why a StatSN is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatSnRefused {
    /// Further behind ExpStatSN than the ring remembers.
    TooFarBehind,
    /// Further ahead of ExpStatSN than the session can have statuses
    /// outstanding.
    TooFarAhead,
}

/// The StatSNs received on one connection.
#[derive(Debug)]
pub struct StatSnTracker {
    /// The oldest status not yet received: what ExpStatSN carries.
    expected: SerialNumber,
    /// Received statuses ahead of `expected`, one bit per StatSN modulo
    /// the ring's size (a power of two, so the index survives wrapping).
    seen: Box<[u64]>,
}

impl StatSnTracker {
    /// A tracker whose next status is `expected`, accepting statuses up to
    /// `ahead` numbers past the oldest missing one (rounded up to a power of
    /// two, at least 64).
    ///
    /// # Errors
    ///
    /// [`RingAllocError`]: the ring could not be allocated.
    ///
    /// # IRQL
    ///
    /// PASSIVE_LEVEL (allocates).
    pub fn new(expected: SerialNumber, ahead: u32) -> Result<Self, RingAllocError> {
        let bits = ahead.clamp(64, 1 << 20).next_power_of_two();
        let words = usize::try_from(bits / 64).map_err(|_| RingAllocError)?;
        let mut seen = Vec::new();
        seen.try_reserve_exact(words).map_err(|_| RingAllocError)?;
        seen.resize(words, 0);
        Ok(Self {
            expected,
            seen: seen.into_boxed_slice(),
        })
    }

    /// The ExpStatSN to send: every status before it has been received.
    #[must_use]
    pub const fn expected(&self) -> SerialNumber {
        self.expected
    }

    fn ring_bits(&self) -> u32 {
        u32::try_from(self.seen.len().saturating_mul(64)).unwrap_or(u32::MAX)
    }

    fn bit(&self, sn: SerialNumber) -> (usize, u64) {
        let index = sn.0 & self.ring_bits().wrapping_sub(1);
        let word = usize::try_from(index / 64).unwrap_or(usize::MAX);
        (word, 1u64 << (index % 64))
    }

    /// Records the arrival of status `sn`.
    ///
    /// # Errors
    ///
    /// [`StatSnRefused`]: `sn` was already received or is beyond the ring;
    /// the tracker is unchanged.
    ///
    /// # IRQL
    ///
    /// <= DISPATCH_LEVEL; never blocks, never allocates.
    pub fn receive(&mut self, sn: SerialNumber) -> Result<Arrival, StatSnRefused> {
        let ahead = sn.0.wrapping_sub(self.expected.0);
        let behind = self.expected.0.wrapping_sub(sn.0);
        if behind > 0 && behind <= self.ring_bits() {
            return Ok(Arrival::Repeat);
        }
        if ahead >= self.ring_bits() {
            return Err(if ahead >= 1 << 31 {
                StatSnRefused::TooFarBehind
            } else {
                StatSnRefused::TooFarAhead
            });
        }
        if ahead > 0 {
            let (word, mask) = self.bit(sn);
            let Some(w) = self.seen.get_mut(word) else {
                return Err(StatSnRefused::TooFarAhead);
            };
            if *w & mask != 0 {
                return Ok(Arrival::Repeat);
            }
            *w |= mask;
            return Ok(Arrival::Ahead);
        }
        // The oldest missing one arrived: slide past it and past every
        // later one already here.
        self.expected = self.expected.next();
        loop {
            let (word, mask) = self.bit(self.expected);
            match self.seen.get_mut(word) {
                Some(w) if *w & mask != 0 => {
                    *w &= !mask;
                    self.expected = self.expected.next();
                }
                _ => return Ok(Arrival::InOrder),
            }
        }
    }

    /// Whether statuses after ExpStatSN arrived while an older one is
    /// still missing.
    #[must_use]
    pub fn has_gap(&self) -> bool {
        self.seen.iter().any(|w| *w != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sn(n: u32) -> SerialNumber {
        SerialNumber(n)
    }

    #[test]
    fn in_order_advances_one_by_one() {
        let mut t = StatSnTracker::new(sn(10), 8).unwrap();
        for n in 10..20 {
            assert_eq!(t.receive(sn(n)), Ok(Arrival::InOrder));
            assert_eq!(t.expected(), sn(n + 1));
        }
        assert!(!t.has_gap());
    }

    #[test]
    fn a_swapped_pair_is_acknowledged_only_when_both_arrived() {
        let mut t = StatSnTracker::new(sn(5), 8).unwrap();
        assert_eq!(t.receive(sn(6)), Ok(Arrival::Ahead));
        assert_eq!(t.expected(), sn(5), "6 arrived, 5 is still missing");
        assert!(t.has_gap());
        assert_eq!(t.receive(sn(5)), Ok(Arrival::InOrder));
        assert_eq!(t.expected(), sn(7));
        assert!(!t.has_gap());
    }

    #[test]
    fn repeats_are_taken_and_far_statuses_refused_without_change() {
        let mut t = StatSnTracker::new(sn(100), 64).unwrap();
        assert_eq!(t.receive(sn(100)), Ok(Arrival::InOrder));
        // A number stamped twice (LIO's unlocked counter), behind or ahead.
        assert_eq!(t.receive(sn(100)), Ok(Arrival::Repeat));
        assert_eq!(t.receive(sn(103)), Ok(Arrival::Ahead));
        assert_eq!(t.receive(sn(103)), Ok(Arrival::Repeat));
        assert_eq!(t.receive(sn(101 - 64)), Ok(Arrival::Repeat));
        assert_eq!(t.receive(sn(101 - 65)), Err(StatSnRefused::TooFarBehind));
        assert_eq!(t.receive(sn(101 + 64)), Err(StatSnRefused::TooFarAhead));
        assert_eq!(t.receive(sn(101 + 63)), Ok(Arrival::Ahead));
        assert_eq!(t.expected(), sn(101));
        assert_eq!(t.receive(sn(101)), Ok(Arrival::InOrder));
        assert_eq!(t.expected(), sn(102), "103 and 164 wait for 102");
    }

    #[test]
    fn the_ring_wraps_with_the_serial_numbers() {
        let mut t = StatSnTracker::new(sn(u32::MAX - 2), 64).unwrap();
        assert_eq!(t.receive(sn(1)), Ok(Arrival::Ahead));
        assert_eq!(t.receive(sn(u32::MAX)), Ok(Arrival::Ahead));
        assert_eq!(t.receive(sn(0)), Ok(Arrival::Ahead));
        assert_eq!(t.receive(sn(u32::MAX - 1)), Ok(Arrival::Ahead));
        assert_eq!(
            t.expected(),
            sn(u32::MAX - 2),
            "the oldest is still missing"
        );
        assert_eq!(t.receive(sn(u32::MAX - 2)), Ok(Arrival::InOrder));
        assert_eq!(t.expected(), sn(2));
        assert!(!t.has_gap());
    }

    proptest! {
        /// Any arrival order of a run of statuses whose reordering stays
        /// within the ring ends with all acknowledged, and ExpStatSN never
        /// passes a status that has not arrived.
        #[test]
        fn any_bounded_reordering_is_acknowledged_exactly(
            start in any::<u32>(),
            order in Just((0u32..48).collect::<Vec<_>>()).prop_shuffle(),
        ) {
            let mut t = StatSnTracker::new(sn(start), 48).unwrap();
            let mut arrived = [false; 48];
            for &k in &order {
                let acked = t.expected().0.wrapping_sub(start);
                let want = if k == acked { Arrival::InOrder } else { Arrival::Ahead };
                prop_assert_eq!(t.receive(sn(start.wrapping_add(k))), Ok(want));
                arrived[k as usize] = true;
                let acked = t.expected().0.wrapping_sub(start) as usize;
                prop_assert!(arrived[..acked].iter().all(|a| *a));
                prop_assert!(acked == 48 || !arrived[acked]);
            }
            prop_assert_eq!(t.expected(), sn(start.wrapping_add(48)));
            prop_assert!(!t.has_gap());
        }
    }
}
