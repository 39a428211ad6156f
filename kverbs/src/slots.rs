//! The per-queue work-request table: a single-producer, single-consumer
//! hand-off of one value per queue slot, indexed by the queue's free-running
//! counter (the WQE counter a CQE names), so a completion finds its work
//! request in O(1) with no search and no allocation.
//!
//! The poster (the producer) writes a slot, then *publishes* everything
//! below a counter; the completion side (the consumer) takes the values of
//! published slots in counter order, then *reclaims* everything below a
//! counter, giving those slots back to the producer. This is also the send
//! queue's accounting: `published - reclaimed` is what the device holds, so
//! the producer never writes more than the ring's capacity ahead of the
//! consumer, and a WQEBB of an unsignalled WQE is reclaimed exactly when a
//! later completion's counter moves `reclaimed` past it.
//!
//! # Ownership protocol
//!
//! | slot index `i` | owner |
//! |---|---|
//! | `reclaimed <= i < published` | consumer (device holds the WQE) |
//! | `published <= i < reclaimed + capacity` | producer |
//!
//! (wrapping arithmetic on `u32`). The producer publishes with Release
//! after writing its slots; the consumer reads `published` with Acquire
//! before taking them; symmetrically for `reclaimed`. Each side holds a
//! claim ([`SlotRing::producer`], [`SlotRing::consumer`]) so that even a
//! misuse of the API cannot create two producers or two consumers at once.
//! Every index a caller passes is checked against the protocol, so a bogus
//! counter — say, from a CQE a faulty device wrote — is refused, never a
//! data race.

// UNSAFETY: the slots are `UnsafeCell`s handed between one producer and one
// consumer under the counter protocol above; each block states which side
// owns the slot it touches.
#![expect(unsafe_code, reason = "SPSC slot hand-off over UnsafeCell")]

use alloc::boxed::Box;
use core::fmt;

use crate::sync::atomic::{AtomicBool, AtomicU32, Ordering};

/// The slot cell: `core`'s `UnsafeCell` normally, loom's under `cfg(loom)`
/// so the model checks every access against the hand-off protocol.
struct Cell<T> {
    #[cfg(not(loom))]
    inner: core::cell::UnsafeCell<T>,
    #[cfg(loom)]
    inner: loom::cell::UnsafeCell<T>,
}

impl<T> Cell<T> {
    fn new(value: T) -> Self {
        Cell {
            #[cfg(not(loom))]
            inner: core::cell::UnsafeCell::new(value),
            #[cfg(loom)]
            inner: loom::cell::UnsafeCell::new(value),
        }
    }

    /// Runs `f` on the cell's pointer; the caller must own the cell.
    fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        #[cfg(not(loom))]
        {
            f(self.inner.get())
        }
        #[cfg(loom)]
        {
            self.inner.with_mut(f)
        }
    }
}

/// A counter the caller passed lies outside the region its side owns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutOfWindow;

/// The slot table (see the [module docs](self)).
///
/// # Invariants
///
/// `cells.len() == mask + 1` is a power of two; `published - reclaimed <=
/// capacity`; a cell is accessed only by the side that owns its index under
/// the protocol, while that side holds its claim.
pub struct SlotRing<T> {
    cells: Box<[Cell<Option<T>>]>,
    mask: u32,
    published: AtomicU32,
    reclaimed: AtomicU32,
    producer_claimed: AtomicBool,
    consumer_claimed: AtomicBool,
}

// SAFETY: a value of `T` moves from the producer's thread to the consumer's
// (so `T: Send`); no cell is ever accessed from two threads at once (the
// protocol and the claims), so sharing the ring needs nothing more.
unsafe impl<T: Send> Sync for SlotRing<T> {}
// SAFETY: moving the ring moves the values it holds.
unsafe impl<T: Send> Send for SlotRing<T> {}

impl<T> fmt::Debug for SlotRing<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlotRing")
            .field("capacity", &self.capacity())
            .field("published", &self.published.load(Ordering::Relaxed))
            .field("reclaimed", &self.reclaimed.load(Ordering::Relaxed))
            .finish()
    }
}

impl<T> SlotRing<T> {
    /// A table of `capacity` empty slots (rounded up to a power of two,
    /// at least 1). Both counters start at 0.
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL` (it allocates).
    pub fn new(capacity: u32) -> Self {
        let n = capacity.max(1).next_power_of_two();
        SlotRing {
            cells: (0..n).map(|_| Cell::new(None)).collect(),
            mask: n - 1,
            published: AtomicU32::new(0),
            reclaimed: AtomicU32::new(0),
            producer_claimed: AtomicBool::new(false),
            consumer_claimed: AtomicBool::new(false),
        }
    }

    /// Number of slots.
    pub fn capacity(&self) -> u32 {
        self.mask + 1
    }

    /// Slots the device holds now (`published - reclaimed`, a snapshot).
    pub fn outstanding(&self) -> u32 {
        self.published
            .load(Ordering::Acquire)
            .wrapping_sub(self.reclaimed.load(Ordering::Acquire))
    }

    /// Claims the producer side; `None` if it is claimed already.
    ///
    /// # IRQL
    ///
    /// Any.
    pub fn producer(&self) -> Option<Producer<'_, T>> {
        if self.producer_claimed.swap(true, Ordering::Acquire) {
            return None;
        }
        Some(Producer {
            ring: self,
            published: self.published.load(Ordering::Relaxed),
        })
    }

    /// Claims the consumer side; `None` if it is claimed already.
    ///
    /// # IRQL
    ///
    /// Any.
    pub fn consumer(&self) -> Option<Consumer<'_, T>> {
        if self.consumer_claimed.swap(true, Ordering::Acquire) {
            return None;
        }
        Some(Consumer {
            ring: self,
            reclaimed: self.reclaimed.load(Ordering::Relaxed),
        })
    }

    /// Empties every slot and restarts both counters at 0 (a QP moved to
    /// RESET). `&mut self` proves no side is active.
    pub fn reset(&mut self) -> usize {
        let mut dropped = 0;
        for cell in self.cells.iter() {
            // SAFETY: `&mut self`: no side is active, every cell is ours.
            if cell.with_mut(|p| unsafe { (*p).take() }).is_some() {
                dropped += 1;
            }
        }
        self.published.store(0, Ordering::Relaxed);
        self.reclaimed.store(0, Ordering::Relaxed);
        dropped
    }

    fn cell(&self, index: u32) -> Option<&Cell<Option<T>>> {
        self.cells.get((index & self.mask) as usize)
    }
}

/// The claimed producer side.
pub struct Producer<'a, T> {
    ring: &'a SlotRing<T>,
    /// The producer's own copy of `published` (only it writes the counter).
    published: u32,
}

impl<T> Producer<'_, T> {
    /// The first unpublished counter.
    pub fn published(&self) -> u32 {
        self.published
    }

    /// Counters the producer may still use beyond `published`: the free
    /// slots (conservative: the consumer may have reclaimed more since).
    pub fn free(&self) -> u32 {
        let reclaimed = self.ring.reclaimed.load(Ordering::Acquire);
        self.ring
            .capacity()
            .saturating_sub(self.published.wrapping_sub(reclaimed))
    }

    /// Whether `index` lies in the producer's region.
    fn owns(&self, index: u32) -> bool {
        index.wrapping_sub(self.published) < self.free()
    }

    /// Stores `value` at `index` (which must be unpublished and free);
    /// returns what the slot held (normally nothing).
    ///
    /// # Errors
    ///
    /// [`OutOfWindow`] (the value is dropped with the error's caller: it is
    /// handed back in `Err`).
    pub fn put(&mut self, index: u32, value: T) -> Result<Option<T>, (OutOfWindow, T)> {
        if !self.owns(index) {
            return Err((OutOfWindow, value));
        }
        let Some(cell) = self.ring.cell(index) else {
            return Err((OutOfWindow, value));
        };
        // SAFETY: `index` is in the producer's region (checked above) and
        // this is the only producer (the claim), so nobody else touches
        // the cell until it is published.
        Ok(cell.with_mut(|p| unsafe { (*p).replace(value) }))
    }

    /// Takes back the value at an unpublished `index` (an aborted batch).
    ///
    /// # Errors
    ///
    /// [`OutOfWindow`].
    pub fn take_unpublished(&mut self, index: u32) -> Result<Option<T>, OutOfWindow> {
        if !self.owns(index) {
            return Err(OutOfWindow);
        }
        let cell = self.ring.cell(index).ok_or(OutOfWindow)?;
        // SAFETY: as in `put`: the producer owns the unpublished region.
        Ok(cell.with_mut(|p| unsafe { (*p).take() }))
    }

    /// Hands every slot below `to` to the consumer (Release).
    ///
    /// # Errors
    ///
    /// [`OutOfWindow`] if `to` is before `published` or beyond the free
    /// region.
    pub fn publish(&mut self, to: u32) -> Result<(), OutOfWindow> {
        let advance = to.wrapping_sub(self.published);
        if advance > self.free() {
            return Err(OutOfWindow);
        }
        self.published = to;
        self.ring.published.store(to, Ordering::Release);
        Ok(())
    }
}

impl<T> Drop for Producer<'_, T> {
    fn drop(&mut self) {
        self.ring.producer_claimed.store(false, Ordering::Release);
    }
}

/// The claimed consumer side.
pub struct Consumer<'a, T> {
    ring: &'a SlotRing<T>,
    /// The consumer's own copy of `reclaimed` (only it writes the counter).
    reclaimed: u32,
}

impl<T> Consumer<'_, T> {
    /// The first counter not yet reclaimed.
    pub fn reclaimed(&self) -> u32 {
        self.reclaimed
    }

    /// The published counter (Acquire: the slots below it are readable).
    pub fn published(&self) -> u32 {
        self.ring.published.load(Ordering::Acquire)
    }

    /// The full counter whose low 16 bits are `low` and which lies in the
    /// consumer's region, if any (CQEs carry 16-bit counters).
    pub fn widen(&self, low: u16) -> Option<u32> {
        let full = self
            .reclaimed
            .wrapping_add(u32::from(low.wrapping_sub(self.reclaimed as u16)));
        self.owns(full, self.published()).then_some(full)
    }

    fn owns(&self, index: u32, published: u32) -> bool {
        index.wrapping_sub(self.reclaimed) < published.wrapping_sub(self.reclaimed)
    }

    /// Takes the value at a published, unreclaimed `index`.
    ///
    /// # Errors
    ///
    /// [`OutOfWindow`].
    pub fn take(&mut self, index: u32) -> Result<Option<T>, OutOfWindow> {
        if !self.owns(index, self.published()) {
            return Err(OutOfWindow);
        }
        let cell = self.ring.cell(index).ok_or(OutOfWindow)?;
        // SAFETY: `index` is published (Acquire above pairs with the
        // producer's Release) and not reclaimed, so the consumer owns the
        // cell; this is the only consumer (the claim).
        Ok(cell.with_mut(|p| unsafe { (*p).take() }))
    }

    /// Gives every slot below `to` back to the producer (Release).
    ///
    /// # Errors
    ///
    /// [`OutOfWindow`] if `to` is before `reclaimed` or beyond `published`.
    pub fn reclaim(&mut self, to: u32) -> Result<(), OutOfWindow> {
        let published = self.published();
        if to.wrapping_sub(self.reclaimed) > published.wrapping_sub(self.reclaimed) {
            return Err(OutOfWindow);
        }
        self.reclaimed = to;
        self.ring.reclaimed.store(to, Ordering::Release);
        Ok(())
    }
}

impl<T> Drop for Consumer<'_, T> {
    fn drop(&mut self) {
        self.ring.consumer_claimed.store(false, Ordering::Release);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn handoff_in_order_with_wraparound() {
        let ring: SlotRing<u32> = SlotRing::new(4);
        for lap in 0..10u32 {
            let mut p = ring.producer().unwrap();
            assert!(ring.producer().is_none(), "one producer at a time");
            let base = p.published();
            assert_eq!(p.free(), 4);
            for i in 0..4 {
                assert_eq!(p.put(base + i, lap * 10 + i).unwrap(), None);
            }
            assert_eq!(p.put(base + 4, 99).unwrap_err().1, 99, "ring full");
            p.publish(base + 4).unwrap();
            assert_eq!(p.free(), 0);
            drop(p);
            let mut c = ring.consumer().unwrap();
            assert_eq!(c.widen((base + 2) as u16), Some(base + 2));
            assert_eq!(c.widen((base + 4) as u16), None, "not published");
            for i in 0..4 {
                assert_eq!(c.take(base + i).unwrap(), Some(lap * 10 + i));
            }
            c.reclaim(base + 4).unwrap();
            assert!(c.take(base).is_err(), "reclaimed slots are the producer's");
        }
    }

    #[test]
    fn windows_are_enforced() {
        let ring: SlotRing<u8> = SlotRing::new(8);
        let mut p = ring.producer().unwrap();
        let mut c = ring.consumer().unwrap();
        assert!(c.take(0).is_err(), "nothing published");
        assert!(c.reclaim(1).is_err());
        p.put(0, 1).unwrap();
        p.put(3, 2).unwrap();
        assert_eq!(p.take_unpublished(3).unwrap(), Some(2));
        p.publish(2).unwrap();
        assert!(p.put(1, 5).is_err(), "published slots are the consumer's");
        assert!(p.publish(1).is_err(), "publish never goes back");
        assert!(p.publish(11).is_err(), "beyond capacity");
        assert_eq!(c.take(0).unwrap(), Some(1));
        assert_eq!(c.take(1).unwrap(), None);
        assert!(c.take(2).is_err());
        c.reclaim(2).unwrap();
        assert!(c.reclaim(1).is_err(), "reclaim never goes back");
        assert_eq!(p.free(), 8);
    }

    #[test]
    fn widen_handles_sixteen_bit_wrap() {
        let ring: SlotRing<()> = SlotRing::new(8);
        let mut p = ring.producer().unwrap();
        let mut c = ring.consumer().unwrap();
        // Walk the counters to just below 2^16 + 2^16.
        let start = 0x1_fffc_u32;
        let mut at = 0u32;
        while at != start {
            let step = p.free().min(start - at);
            p.publish(at + step).unwrap();
            c.reclaim(at + step).unwrap();
            at += step;
        }
        p.publish(start + 6).unwrap();
        assert_eq!(c.widen(0xfffe), Some(0x1_fffe));
        assert_eq!(c.widen(0x0001), Some(0x2_0001));
        assert_eq!(c.widen(0x0002), None);
    }
}
