//! A channel's send-queue budget, lock-free.
//!
//! Every command reserves, at prepare, the send-queue room it can ever need
//! (its REG_MRs, the SEND, the LOCAL_INVs to come) and gives it back when
//! it completes. The room a command needs is known only once its slot is
//! set up (the registration plan decides it), so under the channel lock
//! the reservation cost a second round trip per I/O. It lives here instead,
//! in one atomic word tagged with the connection epoch it counts for:
//!
//! ```text
//!  63 .. 32 | 31   | 30 .. 0
//!  epoch    | open | free WQEBBs
//! ```
//!
//! * [`SqBudget::open`] (a connection went live, under the channel lock)
//!   sets the epoch and the room; [`SqBudget::close`] (it was detached or
//!   replaced) clears `open`, so nothing can be reserved or given back.
//! * [`SqBudget::reserve`] succeeds only for the open epoch and only if the
//!   room is there; [`SqBudget::give_back`] adds only to the open epoch, so
//!   a late return of a dead connection never inflates a new one's room
//!   (as the channel lock's epoch check did before).
//!
//! # IRQL
//! Any (atomic operations only).

#![forbid(unsafe_code)]

use core::sync::atomic::{AtomicU64, Ordering};

const OPEN: u64 = 1 << 31;
const FREE_MASK: u64 = OPEN - 1;

/// Why a reservation was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SqRefused {
    /// The epoch is not the open one (the connection ended or changed).
    Closed,
    /// Not enough room now.
    Full,
}

/// One channel's send-queue room (see the [module docs](self)).
#[derive(Debug, Default)]
pub(crate) struct SqBudget {
    word: AtomicU64,
}

const fn pack(epoch: u32, open: bool, free: u32) -> u64 {
    ((epoch as u64) << 32) | if open { OPEN } else { 0 } | (free as u64 & FREE_MASK)
}

const fn is_open_for(word: u64, epoch: u32) -> bool {
    word & OPEN != 0 && (word >> 32) as u32 == epoch
}

impl SqBudget {
    /// Closed, no room.
    pub(crate) const fn new() -> Self {
        SqBudget {
            word: AtomicU64::new(0),
        }
    }

    /// Epoch `epoch` is live with `free` WQEBBs of room (saturated at
    /// 2^31 - 1, far beyond any send queue).
    pub(crate) fn open(&self, epoch: u32, free: u32) {
        let free = free.min(FREE_MASK as u32);
        self.word.store(pack(epoch, true, free), Ordering::Release);
    }

    /// No epoch is live: reservations and returns are refused until the
    /// next [`Self::open`].
    pub(crate) fn close(&self) {
        self.word.fetch_and(!(OPEN | FREE_MASK), Ordering::AcqRel);
    }

    /// Takes `n` WQEBBs of room for epoch `epoch`.
    ///
    /// Inlined, as [`Self::give_back`]: once per command, a load and a
    /// compare-and-swap (out of line the call cost a third of it).
    #[inline]
    pub(crate) fn reserve(&self, epoch: u32, n: u32) -> Result<(), SqRefused> {
        let mut word = self.word.load(Ordering::Acquire);
        loop {
            if !is_open_for(word, epoch) {
                return Err(SqRefused::Closed);
            }
            let free = word & FREE_MASK;
            if free < u64::from(n) {
                return Err(SqRefused::Full);
            }
            match self.word.compare_exchange_weak(
                word,
                word - u64::from(n),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Ok(()),
                Err(now) => word = now,
            }
        }
    }

    /// Returns `n` WQEBBs reserved under `epoch`; dropped if that epoch is
    /// no longer the open one.
    #[inline]
    pub(crate) fn give_back(&self, epoch: u32, n: u32) {
        let mut word = self.word.load(Ordering::Acquire);
        loop {
            if !is_open_for(word, epoch) {
                return;
            }
            let free = ((word & FREE_MASK) + u64::from(n)).min(FREE_MASK);
            let next = (word & !FREE_MASK) | free;
            match self
                .word
                .compare_exchange_weak(word, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return,
                Err(now) => word = now,
            }
        }
    }

    /// The room left for `epoch` (0 if it is not the open one).
    #[cfg(test)]
    pub(crate) fn available(&self, epoch: u32) -> u32 {
        let word = self.word.load(Ordering::Acquire);
        if is_open_for(word, epoch) {
            (word & FREE_MASK) as u32
        } else {
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_closed_budget_refuses_and_drops_returns() {
        let b = SqBudget::new();
        assert_eq!(b.reserve(0, 1), Err(SqRefused::Closed));
        b.give_back(0, 5);
        assert_eq!(b.available(0), 0);
        b.open(7, 10);
        assert_eq!(b.reserve(7, 4), Ok(()));
        b.close();
        assert_eq!(b.reserve(7, 1), Err(SqRefused::Closed));
        b.give_back(7, 4);
        assert_eq!(b.available(7), 0);
    }

    #[test]
    fn reservations_stop_at_the_room_and_returns_refill_it() {
        let b = SqBudget::new();
        b.open(3, 5);
        assert_eq!(b.reserve(3, 3), Ok(()));
        assert_eq!(b.reserve(3, 3), Err(SqRefused::Full));
        assert_eq!(b.reserve(3, 2), Ok(()));
        assert_eq!(b.available(3), 0);
        assert_eq!(b.reserve(3, 1), Err(SqRefused::Full));
        b.give_back(3, 3);
        assert_eq!(b.available(3), 3);
        assert_eq!(b.reserve(3, 0), Ok(()));
    }

    #[test]
    fn another_epochs_reservations_and_returns_do_not_count() {
        let b = SqBudget::new();
        b.open(1, 8);
        assert_eq!(b.reserve(1, 8), Ok(()));
        // The connection is replaced: the old epoch's returns are void.
        b.open(2, 8);
        b.give_back(1, 8);
        assert_eq!(b.available(2), 8);
        assert_eq!(b.reserve(1, 1), Err(SqRefused::Closed));
        // Epochs that differ only above the low bits are still different.
        b.open(u32::MAX, 4);
        assert_eq!(b.reserve(u32::MAX >> 1, 1), Err(SqRefused::Closed));
        assert_eq!(b.reserve(u32::MAX, 4), Ok(()));
    }

    #[test]
    fn the_room_saturates_instead_of_spilling_into_the_flags() {
        let b = SqBudget::new();
        b.open(9, u32::MAX);
        assert_eq!(b.available(9), FREE_MASK as u32);
        b.give_back(9, u32::MAX);
        assert_eq!(b.available(9), FREE_MASK as u32);
        assert_eq!(b.reserve(9, FREE_MASK as u32), Ok(()));
        assert_eq!(b.available(9), 0);
    }

    #[test]
    fn concurrent_reservations_never_overdraw() {
        use std::sync::Arc;
        let b = Arc::new(SqBudget::new());
        b.open(5, 1000);
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let b = Arc::clone(&b);
                std::thread::spawn(move || {
                    let mut held = 0u32;
                    for i in 0..2000u32 {
                        let n = 1 + i % 7;
                        if b.reserve(5, n).is_ok() {
                            held += n;
                        }
                        if i % 3 == 0 && held > 0 {
                            b.give_back(5, held);
                            held = 0;
                        }
                    }
                    held
                })
            })
            .collect();
        let held: u32 = threads.into_iter().map(|t| t.join().unwrap()).sum();
        assert_eq!(b.available(5) + held, 1000);
    }
}
