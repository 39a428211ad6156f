//! The CQ's table of attached QPs: read by every poll, written only at
//! attach and detach.
//!
//! A poll resolves each CQE's QP number to its QP through this table. It
//! used to be a list under a spin lock, which every poll took although the
//! list changes only when a QP is created or destroyed. Here the table is a
//! fixed array of pointer slots, each owning one `Arc` (from
//! [`Arc::into_raw`]); the poll reads the slots with plain loads under the
//! CQ's poll claim — the flag the poll and the arm already take, one
//! read-modify-write per poll — and takes no lock.
//!
//! # Why a reader never sees a freed QP
//!
//! A remover empties its slot (a compare-exchange, so exactly one remover
//! gets the `Arc`), then compare-exchanges the claim flag from clear to
//! clear, retrying while the flag is set. The successful compare-exchange
//! is a read-modify-write, so it reads the latest value of the flag:
//!
//! * a poll that claims after it reads its write (or a later one that came
//!   from it through acquire/release steps), so the emptied slot happens
//!   before the poll's scan and the poll finds the slot empty;
//! * a poll that claimed before it has released the claim (the flag it
//!   read was clear), and that release happens before the remover drops
//!   the `Arc`, so everything the poll did with the QP came first.
//!
//! The wait is bounded by one poll (at most a batch of CQEs, no callback:
//! the poll only resolves CQEs to work requests) and never waits for a
//! thread that waits for it: a poll takes no lock a remover holds. A
//! remover must not hold the claim itself (the CQ never detaches from
//! inside a poll or an arm).
//!
//! Slots are never compacted: moving a live entry from one slot to another
//! could make a scan that passes both miss it (and drop its CQE as stray).
//! The scan covers the slots up to the highest one ever filled.
//!
//! `loom` checks the protocol (`loom_tests::loom_cq_attached_table_*`).

// UNSAFETY: the slots hold `Arc::into_raw` pointers; a reader turns one
// into a reference for as long as it holds the claim, and a remover turns
// the pointer it took out of its slot back into the `Arc`.
#![expect(unsafe_code, reason = "Arc::into_raw slots read without a lock")]

use alloc::sync::Arc;
use core::marker::PhantomData;
use core::ptr;

use crate::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

#[cfg(loom)]
use loom::sync::atomic::AtomicPtr;

#[cfg(not(loom))]
use core::sync::atomic::AtomicPtr;

/// Up to `N` shared objects, looked up without a lock by the single holder
/// of the read claim (see the [module docs](self)).
///
/// # Invariants
///
/// Every non-null slot holds a pointer from [`Arc::into_raw`] whose
/// reference is owned by the table. A slot's pointer is turned back into
/// its `Arc` only by the one remover whose compare-exchange emptied it
/// (then after the wait on `reading`), or by `Drop`.
pub(crate) struct AttachedTable<T, const N: usize> {
    slots: [AtomicPtr<T>; N],
    /// One past the highest slot ever filled (only grows).
    used: AtomicUsize,
    /// The read claim (the CQ's poll/arm claim): set while one poll or arm
    /// runs.
    reading: AtomicBool,
    /// Owns `Arc<T>`s: `Send`/`Sync` only if `Arc<T>` is.
    owns: PhantomData<Arc<T>>,
}

/// The read claim (see [`AttachedTable::claim`]); releases on drop.
pub(crate) struct ReadClaim<'a, T, const N: usize> {
    table: &'a AttachedTable<T, N>,
}

impl<T, const N: usize> AttachedTable<T, N> {
    /// An empty table.
    pub(crate) fn new() -> Self {
        AttachedTable {
            slots: core::array::from_fn(|_| AtomicPtr::new(ptr::null_mut())),
            used: AtomicUsize::new(0),
            reading: AtomicBool::new(false),
            owns: PhantomData,
        }
    }

    /// Claims the read side; `None` if a poll or arm holds it.
    ///
    /// # IRQL
    ///
    /// Any (never blocks).
    pub(crate) fn claim(&self) -> Option<ReadClaim<'_, T, N>> {
        (!self.reading.swap(true, Ordering::Acquire)).then_some(ReadClaim { table: self })
    }

    /// Adds `item`; gives it back if every slot is taken.
    ///
    /// # IRQL
    ///
    /// Any (never blocks).
    pub(crate) fn insert(&self, item: Arc<T>) -> Result<(), Arc<T>> {
        let raw = Arc::into_raw(item).cast_mut();
        for (at, slot) in self.slots.iter().enumerate() {
            if slot
                .compare_exchange(ptr::null_mut(), raw, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                self.used.fetch_max(at + 1, Ordering::AcqRel);
                return Ok(());
            }
        }
        // SAFETY: `raw` came from `Arc::into_raw` above and was stored in no
        // slot, so this is the only owner of that reference.
        Err(unsafe { Arc::from_raw(raw) })
    }

    /// Removes the entry that is `item` (compared by address, never read),
    /// waiting out a poll that may be reading it; returns its `Arc`.
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`; spins for at most one poll (see the
    /// [module docs](self)). The caller must not hold the read claim.
    pub(crate) fn remove(&self, item: *const T) -> Option<Arc<T>> {
        let target = item.cast_mut();
        if target.is_null() {
            return None;
        }
        let emptied = self.slots.iter().any(|slot| {
            slot.compare_exchange(target, ptr::null_mut(), Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        });
        if !emptied {
            return None;
        }
        // Order the emptied slot against the claim of every poll (see the
        // module docs): a compare-exchange from clear to clear succeeds only
        // as a read-modify-write of the latest value, with no claim held; a
        // poll claimed after it finds the slot empty, one claimed before has
        // released. A failed one writes nothing (and may have read a stale
        // claim), so it is simply tried again. A cold path: detach only.
        while self
            .reading
            .compare_exchange(false, false, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            spin_wait();
        }
        // SAFETY: the compare-exchange above took `target` out of its slot,
        // so this remover alone owns the reference the slot held (type
        // invariant); no poll can still be using it (the wait above).
        Some(unsafe { Arc::from_raw(target) })
    }

    /// Whether no entry is attached (a snapshot).
    pub(crate) fn is_empty(&self) -> bool {
        self.slots
            .iter()
            .all(|slot| slot.load(Ordering::Acquire).is_null())
    }
}

impl<T, const N: usize> ReadClaim<'_, T, N> {
    /// The first entry `matches` accepts.
    ///
    /// # IRQL
    ///
    /// Any (never blocks).
    pub(crate) fn find(&self, mut matches: impl FnMut(&T) -> bool) -> Option<&T> {
        let table = self.table;
        let used = table.used.load(Ordering::Acquire);
        table.slots.iter().take(used).find_map(|slot| {
            let raw = slot.load(Ordering::Acquire);
            // SAFETY: a non-null slot holds an `Arc::into_raw` pointer the
            // table owns (type invariant), and no remover drops it while this
            // claim is held (`AttachedTable::remove` waits for its release),
            // so the reference is valid while this claim is borrowed.
            let entry = unsafe { raw.cast_const().as_ref() }?;
            matches(entry).then_some(entry)
        })
    }
}

impl<T, const N: usize> Drop for ReadClaim<'_, T, N> {
    fn drop(&mut self) {
        self.table.reading.store(false, Ordering::Release);
    }
}

impl<T, const N: usize> Drop for AttachedTable<T, N> {
    fn drop(&mut self) {
        for slot in &self.slots {
            let raw = slot.swap(ptr::null_mut(), Ordering::AcqRel);
            if !raw.is_null() {
                // SAFETY: `&mut self`: no reader or remover exists; the
                // table owns the reference the slot held (type invariant).
                drop(unsafe { Arc::from_raw(raw) });
            }
        }
    }
}

/// One step of a bounded spin.
fn spin_wait() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    core::hint::spin_loop();
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize as StdCounter;

    struct Entry {
        key: u32,
        drops: Arc<StdCounter>,
    }

    impl Drop for Entry {
        fn drop(&mut self) {
            self.drops.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn entry(key: u32, drops: &Arc<StdCounter>) -> Arc<Entry> {
        Arc::new(Entry {
            key,
            drops: Arc::clone(drops),
        })
    }

    #[test]
    fn insert_find_remove_and_refill() {
        let drops = Arc::new(StdCounter::new(0));
        let table: AttachedTable<Entry, 2> = AttachedTable::new();
        assert!(table.is_empty());
        let (a, b, c) = (entry(1, &drops), entry(2, &drops), entry(3, &drops));
        assert!(table.insert(Arc::clone(&a)).is_ok());
        assert!(table.insert(Arc::clone(&b)).is_ok());
        let refused = table.insert(Arc::clone(&c));
        assert!(refused.is_err_and(|back| Arc::ptr_eq(&back, &c)), "full");
        {
            let claim = table.claim().unwrap();
            assert!(table.claim().is_none(), "one claim at a time");
            assert_eq!(claim.find(|e| e.key == 2).map(|e| e.key), Some(2));
            assert!(claim.find(|e| e.key == 3).is_none());
        }
        // Removing compares addresses: an equal key at another address is
        // not the entry.
        let twin = entry(1, &drops);
        assert!(table.remove(Arc::as_ptr(&twin)).is_none());
        let removed = table.remove(Arc::as_ptr(&a)).unwrap();
        assert!(Arc::ptr_eq(&removed, &a));
        assert!(table.remove(Arc::as_ptr(&a)).is_none(), "removed once");
        assert!(table.remove(ptr::null()).is_none());
        // The freed slot (the first) is filled again; the second stays.
        assert!(table.insert(Arc::clone(&c)).is_ok());
        let claim = table.claim().unwrap();
        assert_eq!(claim.find(|e| e.key == 3).map(|e| e.key), Some(3));
        assert_eq!(claim.find(|e| e.key == 2).map(|e| e.key), Some(2));
        assert!(claim.find(|e| e.key == 1).is_none());
        drop(claim);
        assert!(!table.is_empty());
        drop((removed, twin));
        assert_eq!(drops.load(Ordering::Relaxed), 1, "only the twin is gone");
        drop(table);
        drop((a, b, c));
        assert_eq!(
            drops.load(Ordering::Relaxed),
            4,
            "the table dropped its Arcs"
        );
    }

    #[test]
    fn remove_waits_for_the_reader_and_a_later_reader_misses_the_entry() {
        let drops = Arc::new(StdCounter::new(0));
        let table: Arc<AttachedTable<Entry, 4>> = Arc::new(AttachedTable::new());
        let a = entry(7, &drops);
        assert!(table.insert(Arc::clone(&a)).is_ok());
        let claim = table.claim().unwrap();
        let found = claim.find(|e| e.key == 7).unwrap();
        let remover = {
            let table = Arc::clone(&table);
            // The remover names the entry by its own reference (dropped when
            // the thread ends).
            std::thread::spawn(move || table.remove(Arc::as_ptr(&a)).map(|a| a.key))
        };
        // The remover cannot finish while the claim is held: the entry
        // stays readable.
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(!remover.is_finished());
        assert_eq!(found.key, 7);
        assert_eq!(drops.load(Ordering::Relaxed), 0);
        drop(claim);
        assert_eq!(remover.join().unwrap(), Some(7));
        assert_eq!(drops.load(Ordering::Relaxed), 1);
        assert!(table.claim().unwrap().find(|_| true).is_none());
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::atomic::AtomicBool as LoomBool;
    use loom::thread;

    struct Tracked {
        key: u32,
        dropped: Arc<LoomBool>,
    }

    impl Drop for Tracked {
        fn drop(&mut self) {
            self.dropped.store(true, Ordering::Release);
        }
    }

    /// A poll reading the table races a detach: the poll never uses an
    /// entry after it was dropped, and a poll that claims after the detach
    /// finishes never finds it.
    #[test]
    fn loom_cq_attached_table_remove_races_a_poll() {
        loom::model(|| {
            let table: Arc<AttachedTable<Tracked, 2>> = Arc::new(AttachedTable::new());
            let dropped = Arc::new(LoomBool::new(false));
            let entry = Arc::new(Tracked {
                key: 1,
                dropped: Arc::clone(&dropped),
            });
            let key = Arc::as_ptr(&entry) as usize;
            assert!(table.insert(entry).is_ok());
            let removed = Arc::new(LoomBool::new(false));
            let poller = {
                let (table, dropped, removed) = (
                    Arc::clone(&table),
                    Arc::clone(&dropped),
                    Arc::clone(&removed),
                );
                thread::spawn(move || {
                    let Some(claim) = table.claim() else { return };
                    let was_removed = removed.load(Ordering::Acquire);
                    if let Some(found) = claim.find(|e| e.key == 1) {
                        assert!(!dropped.load(Ordering::Acquire), "entry used after drop");
                        assert!(!was_removed, "found after the remove returned");
                        assert_eq!(found.key, 1);
                    }
                })
            };
            let taken = table.remove(key as *const Tracked);
            removed.store(true, Ordering::Release);
            assert!(taken.is_some());
            drop(taken);
            poller.join().unwrap();
            assert!(dropped.load(Ordering::Acquire));
        });
    }

    /// An attach racing a poll and a detach of another entry: the poll
    /// finds each entry either absent or intact, and the table ends with
    /// exactly the attached entry.
    #[test]
    fn loom_cq_attached_table_insert_and_remove_race_a_poll() {
        loom::model(|| {
            let table: Arc<AttachedTable<Tracked, 2>> = Arc::new(AttachedTable::new());
            let (gone, kept) = (
                Arc::new(LoomBool::new(false)),
                Arc::new(LoomBool::new(false)),
            );
            let first = Arc::new(Tracked {
                key: 1,
                dropped: Arc::clone(&gone),
            });
            let first_key = Arc::as_ptr(&first) as usize;
            assert!(table.insert(first).is_ok());
            let attacher = {
                let (table, kept) = (Arc::clone(&table), Arc::clone(&kept));
                thread::spawn(move || {
                    let second = Arc::new(Tracked {
                        key: 2,
                        dropped: kept,
                    });
                    assert!(table.insert(second).is_ok());
                })
            };
            let poller = {
                let (table, gone) = (Arc::clone(&table), Arc::clone(&gone));
                thread::spawn(move || {
                    let Some(claim) = table.claim() else { return };
                    if let Some(found) = claim.find(|e| e.key == 1) {
                        assert!(!gone.load(Ordering::Acquire), "entry used after drop");
                        assert_eq!(found.key, 1);
                    }
                    if let Some(found) = claim.find(|e| e.key == 2) {
                        assert_eq!(found.key, 2);
                    }
                })
            };
            drop(table.remove(first_key as *const Tracked));
            attacher.join().unwrap();
            poller.join().unwrap();
            assert!(gone.load(Ordering::Acquire));
            assert!(!kept.load(Ordering::Acquire));
            let claim = table.claim().unwrap();
            assert!(claim.find(|e| e.key == 1).is_none());
            assert_eq!(claim.find(|e| e.key == 2).map(|e| e.key), Some(2));
        });
    }
}
