//! The drain loop's batch: what one poll fills and the handler empties,
//! first in, first out.
//!
//! The poll appends at the back; delivery takes from the front, so each
//! completion is moved once into its slot and once out of it, in poll
//! order. A stack (`heapless::Vec`) had to be reversed before it could be
//! popped in poll order — a swap of two ~90-byte completions per pair,
//! every poll — and `heapless::Deque` pays for its wrap-around on every
//! take and walks its slots when dropped. This batch never wraps: it is
//! filled from empty, then emptied, by the one drain loop that owns it.

// UNSAFETY: slots are `MaybeUninit`; `start..end` are exactly the
// initialised ones, read out once each.
#![expect(unsafe_code, reason = "a fixed array of MaybeUninit slots")]

use core::fmt;
use core::mem::MaybeUninit;

use super::POLL_BATCH;

/// What one poll fills: up to [`POLL_BATCH`] completions, taken out in
/// the order they were put in (see the `drain::batch` module docs).
///
/// # Invariants
///
/// `start <= end <= POLL_BATCH`; the slots `start..end` are initialised and
/// owned by the batch, the others are not (moved out, or never written).
pub struct PollBatch<C> {
    slots: [MaybeUninit<C>; POLL_BATCH],
    /// The oldest completion not yet taken.
    start: usize,
    /// One past the newest completion.
    end: usize,
}

impl<C> PollBatch<C> {
    /// An empty batch.
    pub fn new() -> Self {
        PollBatch {
            slots: [const { MaybeUninit::uninit() }; POLL_BATCH],
            start: 0,
            end: 0,
        }
    }

    /// Appends a completion; gives it back if the batch is full.
    ///
    /// A batch refills from its first slot once everything put in has
    /// been taken out; until then it holds at most [`POLL_BATCH`] in all.
    #[inline]
    pub fn push(&mut self, completion: C) -> Result<(), C> {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
        match self.slots.get_mut(self.end) {
            Some(slot) => {
                slot.write(completion);
                self.end += 1;
                Ok(())
            }
            None => Err(completion),
        }
    }

    /// Whether no completion can be appended (see [`Self::push`]).
    #[inline]
    pub fn is_full(&self) -> bool {
        self.end == POLL_BATCH && self.start != self.end
    }

    /// How many completions [`Self::push`] accepts from now on: all of
    /// [`POLL_BATCH`] when the batch is empty (it refills from its first
    /// slot), else the slots after the newest; 0 exactly when
    /// [`Self::is_full`]. A poll reads it once and counts down, instead of
    /// asking `is_full` before every completion.
    #[inline]
    pub fn room(&self) -> usize {
        if self.start == self.end {
            POLL_BATCH
        } else {
            POLL_BATCH.saturating_sub(self.end)
        }
    }

    /// Completions in the batch.
    #[inline]
    pub fn len(&self) -> usize {
        self.end - self.start
    }

    /// Whether the batch is empty.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.start == self.end
    }

    /// Takes the oldest completion out.
    #[inline]
    pub fn take(&mut self) -> Option<C> {
        if self.start == self.end {
            return None;
        }
        let slot = self.slots.get(self.start)?;
        self.start += 1;
        // SAFETY: `start < end`, so the slot is initialised and owned by the
        // batch (type invariant); advancing `start` first hands that
        // ownership to the caller: the slot is never read or dropped again.
        Some(unsafe { slot.assume_init_read() })
    }
}

impl<C> Default for PollBatch<C> {
    fn default() -> Self {
        Self::new()
    }
}

impl<C> PollBatch<C> {
    /// Drops the completions not taken. Out of line and cold: a drain pass
    /// empties its batch before it ends, so only a handler that unwound
    /// mid-batch (a test; in the kernel a panic is a bugcheck) leaves any.
    #[cold]
    #[inline(never)]
    fn drop_untaken(&mut self) {
        while self.take().is_some() {}
    }
}

impl<C> Drop for PollBatch<C> {
    /// One compare when empty, as every drain pass leaves it (once per DPC
    /// round, which a QD 1 read pays twice); whatever is left is still
    /// dropped, never leaked.
    #[inline]
    fn drop(&mut self) {
        if self.start != self.end {
            self.drop_untaken();
        }
    }
}

impl<C> fmt::Debug for PollBatch<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PollBatch")
            .field("len", &self.len())
            .finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use alloc::sync::Arc;
    use alloc::vec::Vec;

    #[test]
    fn first_in_first_out_and_full_at_poll_batch() {
        let mut b = PollBatch::new();
        assert!(b.is_empty());
        for i in 0..POLL_BATCH {
            assert!(!b.is_full());
            assert_eq!(b.room(), POLL_BATCH - i);
            assert_eq!(b.push(i), Ok(()));
        }
        assert!(b.is_full());
        assert_eq!(b.room(), 0);
        assert_eq!(b.len(), POLL_BATCH);
        assert_eq!(b.push(99), Err(99));
        assert_eq!(b.take(), Some(0));
        assert_eq!(b.take(), Some(1));
        // Not empty yet: still no room (no wrap-around).
        assert!(b.is_full());
        assert_eq!(b.room(), 0);
        assert_eq!(b.push(98), Err(98));
        let rest: Vec<usize> = core::iter::from_fn(|| b.take()).collect();
        assert_eq!(rest, (2..POLL_BATCH).collect::<Vec<_>>());
        assert_eq!(b.take(), None);
        // Emptied: refills from the first slot.
        assert!(!b.is_full());
        assert_eq!(b.room(), POLL_BATCH);
        assert_eq!(b.push(7), Ok(()));
        assert_eq!(b.room(), POLL_BATCH - 1);
        assert_eq!(b.push(8), Ok(()));
        // One taken, one left: room only after the newest.
        assert_eq!(b.take(), Some(7));
        assert_eq!(b.room(), POLL_BATCH - 2);
        assert_eq!(b.push(6), Ok(()));
        assert_eq!(
            (b.len(), b.take(), b.take(), b.take()),
            (2, Some(8), Some(6), None)
        );
    }

    #[test]
    fn every_completion_is_dropped_exactly_once() {
        let tracker = Arc::new(());
        {
            let mut b = PollBatch::new();
            for _ in 0..5 {
                assert!(b.push(Arc::clone(&tracker)).is_ok());
            }
            let taken = b.take();
            assert_eq!(Arc::strong_count(&tracker), 6);
            drop(taken);
            assert_eq!(Arc::strong_count(&tracker), 5);
            // Four left in the batch: its drop releases them.
        }
        assert_eq!(Arc::strong_count(&tracker), 1);
        let mut b = PollBatch::new();
        assert!(b.push(Arc::clone(&tracker)).is_ok());
        assert!(b.take().is_some());
        drop(b);
        assert_eq!(Arc::strong_count(&tracker), 1);
    }
}
