//! A DMA buffer whose words are looked up once, when its CQ or QP is
//! created.
//!
//! [`DmaBuffer`]'s [`SharedWords::words`] is a dynamic call into the
//! allocator's backing object. The CQ ring and its doorbell record are
//! touched in every drain round — the poll reads the ring and writes the
//! record, the arm writes the record and reads the ring again — and a QP's
//! rings and doorbell record in every post (a WQE written, the record
//! updated at commit): a lookup costs a dynamic call (~11–14
//! instructions) each time, for an answer that never changes:
//! [`hca_lowlevel::dma::DmaBacking`] requires `words()` to return the same
//! memory for the whole life of the object. [`PinnedWords`] asks once and
//! keeps the answer next to the buffer that owns the memory.

// UNSAFETY: the cached slice pointer is turned back into a reference bounded
// by a borrow of the buffer that keeps the memory alive.
#![expect(unsafe_code, reason = "a DMA buffer's word slice cached beside it")]

use core::fmt;
use core::ptr::NonNull;

use hca_lowlevel::dma::{DmaBuffer, SharedWords};
use hca_lowlevel::sync::atomic::AtomicU64;

/// A [`DmaBuffer`] with its words looked up once.
///
/// # Invariants
///
/// `words` is the slice `buffer.words()` returned at construction. The
/// backing object behind `buffer` lives (an `Arc` the buffer holds, on the
/// heap, never moved) until `buffer` is dropped, and by the
/// [`hca_lowlevel::dma::DmaBacking`] contract its `words()` is that same
/// memory for its whole life; so `words` is valid for as long as `self` is.
pub(crate) struct PinnedWords {
    words: NonNull<[AtomicU64]>,
    /// Owns the memory `words` points into; dropped with `self` (which
    /// unmaps it from the device).
    buffer: DmaBuffer,
}

// SAFETY: `words` points into memory owned by `buffer` (type invariant),
// which is `Send`; a slice of atomics is `Send` and `Sync`.
unsafe impl Send for PinnedWords {}
// SAFETY: as for `Send`: shared access hands out `&[AtomicU64]` only, which
// is `Sync`, and `DmaBuffer` is `Sync`.
unsafe impl Sync for PinnedWords {}

impl PinnedWords {
    /// Looks up `buffer`'s words once.
    ///
    /// # IRQL
    ///
    /// Any (never blocks); called at `PASSIVE_LEVEL` when a CQ or QP is
    /// created.
    pub(crate) fn new(buffer: DmaBuffer) -> Self {
        let words = NonNull::from(buffer.words());
        PinnedWords { words, buffer }
    }

    /// The buffer.
    #[cfg(test)]
    pub(crate) fn buffer(&self) -> &DmaBuffer {
        &self.buffer
    }
}

impl SharedWords for PinnedWords {
    #[inline]
    fn words(&self) -> &[AtomicU64] {
        // SAFETY: `words` is what `self.buffer.words()` returned, valid and
        // unchanged while `self.buffer` lives (type invariant); the
        // reference is bounded by this borrow of `self`, which owns the
        // buffer. Only shared references are ever made from it.
        unsafe { self.words.as_ref() }
    }
}

impl fmt::Debug for PinnedWords {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedWords")
            .field("buffer", &self.buffer)
            .field("words", &self.words.len())
            .finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use alloc::boxed::Box;
    use alloc::sync::Arc;
    use hca_lowlevel::dma::{DmaBacking, PhysAddr};
    use hca_lowlevel::sync::atomic::Ordering;

    /// Heap words, as an allocator's backing object.
    struct HeapWords(Box<[AtomicU64]>);

    impl DmaBacking for HeapWords {
        fn words(&self) -> &[AtomicU64] {
            &self.0
        }
        fn phys_addr(&self) -> PhysAddr {
            PhysAddr(0x1000)
        }
        fn len(&self) -> usize {
            self.0.len() * 8
        }
        fn release(&self) {}
    }

    #[test]
    fn pinned_words_are_the_buffers_words() {
        let backing = HeapWords((0..8).map(|_| AtomicU64::new(0)).collect());
        let pinned = PinnedWords::new(DmaBuffer::from_backing(Arc::new(backing)));
        // Same memory: a store through one is seen through the other, at
        // the same address and length.
        let direct = pinned.buffer().words();
        assert!(core::ptr::eq(pinned.words(), direct));
        assert_eq!(pinned.words().len(), 8);
        pinned.words()[3].store(0xfeed, Ordering::Relaxed);
        assert_eq!(direct[3].load(Ordering::Relaxed), 0xfeed);
        // Moving the owner moves no memory.
        let moved = pinned;
        assert!(core::ptr::eq(moved.words(), moved.buffer().words()));
        assert_eq!(moved.words()[3].load(Ordering::Relaxed), 0xfeed);
    }
}
