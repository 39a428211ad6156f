//! The request tracker: a fixed table of slots, one per request the core
//! holds, addressed in O(1) by [`Tag`].
//!
//! # Exactly once, by construction
//! A request handle is move-only and completing it consumes it. While the
//! transport has a command, the handle lives *in* its slot
//! ([`SlotState::Active`]); the only ways out are [`Tracker::take`] (the
//! completion upcall) and [`Tracker::unpark`] (a refused post), both of
//! which empty the slot and bump nothing else. A second upcall for the same
//! tag finds the slot empty — or reused under a new generation, which the
//! tag's generation bits do not match — and gets `None`. So whatever a
//! transport does, a request is handed out of the tracker at most once, and
//! whoever receives it must complete it (the handle cannot be dropped
//! silently without the port noticing).
//!
//! # States
//! ```text
//!          reserve            park (no disposition)
//!   Free ─────────► Reserved ────────────────────► Active ──take/unpark──► Free
//!     ▲                │ release (after a refused park: the
//!     └────────────────┘ disposition is returned)
//! ```
//! *Reserved*: the tag is handed out, the request is still in the caller's
//! hands (scatter/gather build, `prepare`). An abort or reset that finds a
//! request here cannot reach the transport; it records a
//! [`Disposition`] instead, and the owner completes the request with it
//! when it tries to park.
//!
//! # One lock per transition
//! Each transition holds only its slot's lock: the free slots are a
//! lock-free stack ([`FreeStack`]) beside the slots, popped before the
//! slot is locked (`reserve`) and pushed after it is unlocked (`take`,
//! `release`). A slot index is in the stack only while its slot is
//! `Free`, and only its single owner moves it in or out, so the stack
//! never hands one index out twice.
//!
//! # IRQL
//! Everything here runs at <= `DISPATCH_LEVEL`, never blocks and never
//! allocates; the table is allocated once, at `PASSIVE_LEVEL`.

#![forbid(unsafe_code)]

use alloc::boxed::Box;
use alloc::vec::Vec;
use core::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use kverbs::irql::{LeDispatch, Passive};
use kverbs::platform::Platform;
use kverbs::sync::SpinLock;

use super::status::TmfKind;
use super::transport::Tag;
use crate::storport::{Address, SrbIdentity};

/// Bits of a [`Tag`] that index the slot.
const INDEX_BITS: u32 = 16;
/// Largest table the tag format allows.
pub const MAX_SLOTS: usize = 1 << INDEX_BITS;

/// What a slot holds a request for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    /// A SCSI command of `requested` bytes.
    Command {
        /// `DataTransferLength` when it started.
        requested: u32,
        /// Whether the request holds a scatter/gather list to release.
        has_sg: bool,
    },
    /// A task management function.
    Tmf(TmfKind),
}

/// What an abort or reset decided for a request it could not reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// Nothing: proceed.
    Proceed,
    /// An ABORT_COMMAND named it: complete `SRB_STATUS_ABORTED`.
    Aborted,
    /// A bus or LUN reset covered it: complete `SRB_STATUS_BUS_RESET`.
    Reset,
}

/// The facts about a tracked request the core needs without touching the
/// request itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Meta {
    /// Command or TMF.
    pub kind: EntryKind,
    /// Where it is addressed.
    pub address: Address,
    /// Who it is to StorPort.
    pub identity: SrbIdentity,
    /// See [`Disposition`].
    pub disposition: Disposition,
}

/// A slot's state.
#[derive(Debug)]
pub enum SlotState<R> {
    /// Unused.
    Free,
    /// Tag handed out; the request is with its owner.
    Reserved(Meta),
    /// The request is parked here; the transport has (or is being given)
    /// the command.
    Active(Meta, R),
}

struct Slot<R> {
    generation: u16,
    state: SlotState<R>,
}

/// Where an ABORT_COMMAND's victim is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VictimState {
    /// Not (or no longer) tracked: nothing to abort.
    NotFound,
    /// Still with its owner; it has been marked [`Disposition::Aborted`].
    MarkedAborted,
    /// Posted to the transport: abort it there.
    Posted(Address),
}

/// Why [`Tracker::park`] did not park the request; it is handed back.
#[derive(Debug)]
pub enum ParkRefused<R> {
    /// An abort or reset claimed it first: complete it with this.
    Disposed(R, Disposition),
    /// The tag is not a reservation this caller holds (a core bug; the
    /// request is handed back so it can still be completed once).
    NotReserved(R),
}

/// The slot table.
pub struct Tracker<R, P: Platform> {
    slots: Box<[SpinLock<Slot<R>, P>]>,
    free: FreeStack,
}

/// The free slot indices: a lock-free (Treiber) stack.
///
/// `head` packs the top entry (index + 1; 0 = empty) in bits 0..17, the
/// number of entries in bits 17..34 and a change count in bits 34..64.
/// `below[i]` is the entry under index `i` while `i` is in the stack. A pop
/// reads `below[top]` and then swings `head` with a compare-and-swap; if
/// `top` was popped and pushed back meanwhile (its `below` changed), the
/// change count has moved on and the swap fails (no ABA). It could only
/// wrap after 2^30 pushes and pops between one pop's load and its swap.
struct FreeStack {
    head: AtomicU64,
    below: Box<[AtomicU32]>,
}

impl FreeStack {
    const TOP_BITS: u32 = 17;
    const LEN_SHIFT: u32 = 17;
    const LEN_BITS: u32 = 17;
    const COUNT_SHIFT: u32 = 34;
    const FIELD_MASK: u64 = (1 << 17) - 1;

    /// Every index of `0..capacity`, 0 on top.
    fn full(capacity: usize) -> Self {
        // Index i rests on i + 1 (stored + 1), the last on the bottom (0).
        let below: Box<[AtomicU32]> = (0..capacity)
            .map(|i| {
                let under = if i + 1 < capacity { i + 2 } else { 0 };
                AtomicU32::new(u32::try_from(under).unwrap_or(0))
            })
            .collect();
        let top = u64::from(capacity > 0);
        Self {
            head: AtomicU64::new(Self::pack(0, capacity as u64, top)),
            below,
        }
    }

    const fn pack(count: u64, len: u64, top: u64) -> u64 {
        (count << Self::COUNT_SHIFT)
            | ((len & Self::FIELD_MASK) << Self::LEN_SHIFT)
            | (top & Self::FIELD_MASK)
    }

    const fn unpack(head: u64) -> (u64, u64, u64) {
        (
            head >> Self::COUNT_SHIFT,
            (head >> Self::LEN_SHIFT) & ((1 << Self::LEN_BITS) - 1),
            head & ((1 << Self::TOP_BITS) - 1),
        )
    }

    /// Takes the top index, `None` when empty.
    fn pop(&self) -> Option<usize> {
        let mut head = self.head.load(Ordering::Acquire);
        loop {
            let (count, len, top) = Self::unpack(head);
            let index = usize::try_from(top.checked_sub(1)?).ok()?;
            let under = u64::from(self.below.get(index)?.load(Ordering::Relaxed));
            let new = Self::pack(count.wrapping_add(1), len.saturating_sub(1), under);
            match self
                .head
                .compare_exchange_weak(head, new, Ordering::Acquire, Ordering::Acquire)
            {
                Ok(_) => return Some(index),
                Err(seen) => head = seen,
            }
        }
    }

    /// Puts `index` (not in the stack: its owner frees it) on top.
    fn push(&self, index: usize) {
        let (Some(cell), Ok(entry)) = (self.below.get(index), u64::try_from(index + 1)) else {
            return;
        };
        let mut head = self.head.load(Ordering::Relaxed);
        loop {
            let (count, len, top) = Self::unpack(head);
            cell.store(u32::try_from(top).unwrap_or(0), Ordering::Relaxed);
            let new = Self::pack(count.wrapping_add(1), len + 1, entry);
            match self
                .head
                .compare_exchange_weak(head, new, Ordering::Release, Ordering::Relaxed)
            {
                Ok(_) => return,
                Err(seen) => head = seen,
            }
        }
    }

    /// Entries now (a snapshot).
    fn len(&self) -> usize {
        Self::unpack(self.head.load(Ordering::Relaxed)).1 as usize
    }
}

impl<R, P: Platform> Tracker<R, P> {
    /// A table of `capacity` slots (clamped to `1..=MAX_SLOTS`).
    ///
    /// # IRQL
    /// `PASSIVE_LEVEL` (it allocates).
    #[must_use]
    pub fn new(capacity: usize, _irql: &Passive<'_>) -> Self {
        let capacity = capacity.clamp(1, MAX_SLOTS);
        let slots: Vec<SpinLock<Slot<R>, P>> = (0..capacity)
            .map(|_| {
                SpinLock::new(Slot {
                    generation: 0,
                    state: SlotState::Free,
                })
            })
            .collect();
        Self {
            slots: slots.into_boxed_slice(),
            // Pop order: slot 0 first.
            free: FreeStack::full(capacity),
        }
    }

    /// Slots in the table.
    #[must_use]
    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    fn split(tag: Tag) -> (usize, u16) {
        let index = (tag.0 & ((1 << INDEX_BITS) - 1)) as usize;
        let generation = u16::try_from(tag.0 >> INDEX_BITS).unwrap_or(0);
        (index, generation)
    }

    fn make_tag(index: usize, generation: u16) -> Tag {
        Tag((u32::from(generation) << INDEX_BITS) | (index as u32 & ((1 << INDEX_BITS) - 1)))
    }

    /// Hands out a tag for a request described by `meta`; `None` when every
    /// slot is in use.
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    pub fn reserve(&self, meta: Meta, irql: &impl LeDispatch) -> Option<Tag> {
        let index = self.free.pop()?;
        let slot = self.slots.get(index)?;
        let mut slot = slot.lock(irql);
        slot.generation = slot.generation.wrapping_add(1);
        slot.state = SlotState::Reserved(meta);
        Some(Self::make_tag(index, slot.generation))
    }

    /// Returns a slot its owner has just set `Free` (and unlocked).
    fn push_free(&self, index: usize, _irql: &impl LeDispatch) {
        self.free.push(index);
    }

    /// Gives a reservation back without parking (the request was completed
    /// by its owner before reaching the transport). Returns the
    /// disposition an abort or reset left on it.
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    pub fn release(&self, tag: Tag, irql: &impl LeDispatch) -> Option<Disposition> {
        let (index, generation) = Self::split(tag);
        let disposition = {
            let mut slot = self.slots.get(index)?.lock(irql);
            if slot.generation != generation {
                return None;
            }
            match core::mem::replace(&mut slot.state, SlotState::Free) {
                SlotState::Reserved(meta) => meta.disposition,
                other => {
                    // Not a reservation: put it back untouched.
                    slot.state = other;
                    return None;
                }
            }
        };
        self.push_free(index, irql);
        Some(disposition)
    }

    /// Parks `request` under its reservation: from now on a completion for
    /// `tag` finds it. Refused, with the request handed back, when an abort
    /// or reset claimed the reservation first; the reservation then stays
    /// until the caller [`Self::release`]s it — after giving back whatever
    /// it prepared under the tag, so the tag is not reused while the
    /// transport still holds it.
    ///
    /// # Errors
    /// [`ParkRefused`].
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    pub fn park(&self, tag: Tag, request: R, irql: &impl LeDispatch) -> Result<(), ParkRefused<R>> {
        let (index, generation) = Self::split(tag);
        let Some(slot) = self.slots.get(index) else {
            return Err(ParkRefused::NotReserved(request));
        };
        let mut slot = slot.lock(irql);
        if slot.generation != generation {
            return Err(ParkRefused::NotReserved(request));
        }
        match core::mem::replace(&mut slot.state, SlotState::Free) {
            SlotState::Reserved(meta) if meta.disposition == Disposition::Proceed => {
                slot.state = SlotState::Active(meta, request);
                Ok(())
            }
            SlotState::Reserved(meta) => {
                slot.state = SlotState::Reserved(meta);
                Err(ParkRefused::Disposed(request, meta.disposition))
            }
            other => {
                slot.state = other;
                Err(ParkRefused::NotReserved(request))
            }
        }
    }

    /// Takes a parked request out (its completion). `None` if `tag` is not
    /// parked now — a stale or duplicate completion — or is parked for a
    /// different kind of entry than `want` accepts.
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    pub fn take(
        &self,
        tag: Tag,
        want: impl Fn(&EntryKind) -> bool,
        irql: &impl LeDispatch,
    ) -> Option<(R, Meta)> {
        let (index, generation) = Self::split(tag);
        let taken = {
            let mut slot = self.slots.get(index)?.lock(irql);
            if slot.generation != generation {
                return None;
            }
            match &slot.state {
                SlotState::Active(meta, _) if want(&meta.kind) => {}
                _ => return None,
            }
            match core::mem::replace(&mut slot.state, SlotState::Free) {
                SlotState::Active(meta, request) => (request, meta),
                // Unreachable: matched `Active` just above under the lock.
                other => {
                    slot.state = other;
                    return None;
                }
            }
        };
        self.push_free(index, irql);
        Some(taken)
    }

    /// Takes a parked request back after the transport refused to post it.
    /// Same as [`Self::take`] for any kind.
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    pub fn unpark(&self, tag: Tag, irql: &impl LeDispatch) -> Option<(R, Meta)> {
        self.take(tag, |_| true, irql)
    }

    /// Finds an ABORT_COMMAND's victim by the tag its extension holds and
    /// checks it is the same request (`identity`). A reserved victim is
    /// marked [`Disposition::Aborted`].
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    pub fn claim_victim(
        &self,
        tag: Tag,
        identity: SrbIdentity,
        irql: &impl LeDispatch,
    ) -> VictimState {
        let (index, generation) = Self::split(tag);
        let Some(slot) = self.slots.get(index) else {
            return VictimState::NotFound;
        };
        let mut slot = slot.lock(irql);
        if slot.generation != generation {
            return VictimState::NotFound;
        }
        match &mut slot.state {
            SlotState::Reserved(meta)
                if meta.identity == identity && matches!(meta.kind, EntryKind::Command { .. }) =>
            {
                if meta.disposition == Disposition::Proceed {
                    meta.disposition = Disposition::Aborted;
                }
                VictimState::MarkedAborted
            }
            SlotState::Active(meta, _)
                if meta.identity == identity && matches!(meta.kind, EntryKind::Command { .. }) =>
            {
                VictimState::Posted(meta.address)
            }
            _ => VictimState::NotFound,
        }
    }

    /// Marks every reserved command that `covers` matches
    /// [`Disposition::Reset`]; returns how many. Parked requests are the
    /// transport's to terminate.
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    pub fn mark_reserved_reset(
        &self,
        covers: impl Fn(&Address) -> bool,
        irql: &impl LeDispatch,
    ) -> usize {
        let mut marked = 0;
        for slot in &*self.slots {
            let mut slot = slot.lock(irql);
            if let SlotState::Reserved(meta) = &mut slot.state {
                if matches!(meta.kind, EntryKind::Command { .. })
                    && covers(&meta.address)
                    && meta.disposition == Disposition::Proceed
                {
                    meta.disposition = Disposition::Reset;
                    marked += 1;
                }
            }
        }
        marked
    }

    /// Slots not free now (a snapshot).
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    pub fn in_use(&self, irql: &impl LeDispatch) -> usize {
        let _ = irql;
        self.slots.len().saturating_sub(self.free.len())
    }
}

#[cfg(all(test, feature = "host"))]
mod tests {
    use super::*;
    use crate::storport::SrbIdentity;
    use kverbs::platform::host::{HostConfig, HostMode, HostPlatform};

    fn manual() -> HostPlatform {
        HostPlatform::with_config(HostConfig {
            mode: HostMode::Manual,
            ..HostConfig::default()
        })
    }

    fn meta(id: u64) -> Meta {
        Meta {
            kind: EntryKind::Command {
                requested: 512,
                has_sg: true,
            },
            address: Address::new(0, 1, 2),
            identity: SrbIdentity(id),
            disposition: Disposition::Proceed,
        }
    }

    /// A move-only stand-in for a request handle.
    #[derive(Debug, PartialEq, Eq)]
    struct Req(u64);

    #[test]
    fn free_stack_is_lifo_and_counts() {
        let f = FreeStack::full(3);
        assert_eq!(f.len(), 3);
        assert_eq!((f.pop(), f.pop()), (Some(0), Some(1)));
        f.push(0);
        assert_eq!(f.len(), 2);
        assert_eq!((f.pop(), f.pop(), f.pop()), (Some(0), Some(2), None));
        assert_eq!(f.len(), 0);
        f.push(2);
        f.push(1);
        assert_eq!((f.pop(), f.pop(), f.pop()), (Some(1), Some(2), None));
        let empty = FreeStack::full(0);
        assert_eq!(empty.pop(), None);
        let big = FreeStack::full(MAX_SLOTS);
        assert_eq!(big.len(), MAX_SLOTS);
        assert_eq!(big.pop(), Some(0));
        big.push(0);
        assert_eq!(big.len(), MAX_SLOTS);
    }

    /// Threads popping and pushing at once never hold one index together,
    /// and every index comes back. `TRACKER_STRESS_ROUNDS` per thread
    /// (default 20,000).
    #[test]
    fn free_stack_hands_each_index_to_one_owner_at_a_time() {
        use std::sync::Arc;
        use std::sync::atomic::AtomicBool;
        let rounds: usize = std::env::var("TRACKER_STRESS_ROUNDS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(20_000);
        const SLOTS: usize = 8;
        let stack = Arc::new(FreeStack::full(SLOTS));
        let owned: Arc<Vec<AtomicBool>> =
            Arc::new((0..SLOTS).map(|_| AtomicBool::new(false)).collect());
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let (stack, owned) = (Arc::clone(&stack), Arc::clone(&owned));
                std::thread::spawn(move || {
                    let mut held = Vec::new();
                    for i in 0..rounds {
                        // Each thread holds up to three at once.
                        if held.len() < 1 + (i + t) % 3 {
                            if let Some(index) = stack.pop() {
                                assert!(
                                    !owned[index].swap(true, Ordering::AcqRel),
                                    "{index} twice"
                                );
                                held.push(index);
                            }
                        } else if let Some(index) = held.pop() {
                            owned[index].store(false, Ordering::Release);
                            stack.push(index);
                        }
                    }
                    for index in held {
                        owned[index].store(false, Ordering::Release);
                        stack.push(index);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(stack.len(), SLOTS);
        let mut all: Vec<usize> = (0..SLOTS).map(|_| stack.pop().unwrap()).collect();
        all.sort_unstable();
        assert_eq!(all, (0..SLOTS).collect::<Vec<_>>());
        assert_eq!(stack.pop(), None);
    }

    #[test]
    fn a_parked_request_comes_out_once() {
        let platform = manual();
        platform.run_passive(|p| {
            let t: Tracker<Req, HostPlatform> = Tracker::new(4, p);
            let tag = t.reserve(meta(7), p).unwrap();
            t.park(tag, Req(7), p).unwrap();
            let (req, m) = t.take(tag, |_| true, p).unwrap();
            assert_eq!((req, m.identity), (Req(7), SrbIdentity(7)));
            assert!(t.take(tag, |_| true, p).is_none(), "second completion");
            assert!(t.unpark(tag, p).is_none());
            assert_eq!(t.in_use(p), 0);
        });
        platform.finish();
    }

    #[test]
    fn a_stale_tag_does_not_reach_the_reused_slot() {
        let platform = manual();
        platform.run_passive(|p| {
            let t: Tracker<Req, HostPlatform> = Tracker::new(1, p);
            let old = t.reserve(meta(1), p).unwrap();
            t.park(old, Req(1), p).unwrap();
            assert!(t.take(old, |_| true, p).is_some());
            let new = t.reserve(meta(2), p).unwrap();
            assert_ne!(old, new);
            t.park(new, Req(2), p).unwrap();
            assert!(t.take(old, |_| true, p).is_none(), "late completion");
            assert_eq!(t.take(new, |_| true, p).map(|x| x.0), Some(Req(2)));
        });
        platform.finish();
    }

    #[test]
    fn full_table_refuses_and_release_returns_the_slot() {
        let platform = manual();
        platform.run_passive(|p| {
            let t: Tracker<Req, HostPlatform> = Tracker::new(2, p);
            let a = t.reserve(meta(1), p).unwrap();
            let _b = t.reserve(meta(2), p).unwrap();
            assert!(t.reserve(meta(3), p).is_none());
            assert_eq!(t.release(a, p), Some(Disposition::Proceed));
            assert_eq!(t.release(a, p), None, "released twice");
            assert!(t.reserve(meta(3), p).is_some());
        });
        platform.finish();
    }

    #[test]
    fn abort_and_reset_claim_reserved_requests() {
        let platform = manual();
        platform.run_passive(|p| {
            let t: Tracker<Req, HostPlatform> = Tracker::new(4, p);
            let a = t.reserve(meta(1), p).unwrap();
            let b = t.reserve(meta(2), p).unwrap();
            let c = t.reserve(meta(3), p).unwrap();
            t.park(c, Req(3), p).unwrap();
            assert_eq!(
                t.claim_victim(a, SrbIdentity(1), p),
                VictimState::MarkedAborted
            );
            assert_eq!(t.claim_victim(a, SrbIdentity(9), p), VictimState::NotFound);
            assert_eq!(
                t.claim_victim(c, SrbIdentity(3), p),
                VictimState::Posted(Address::new(0, 1, 2))
            );
            assert_eq!(t.mark_reserved_reset(|_| true, p), 1, "only b");
            match t.park(a, Req(1), p) {
                Err(ParkRefused::Disposed(Req(1), Disposition::Aborted)) => {}
                other => panic!("{other:?}"),
            }
            match t.park(b, Req(2), p) {
                Err(ParkRefused::Disposed(Req(2), Disposition::Reset)) => {}
                other => panic!("{other:?}"),
            }
            // Refused reservations stay until released, so their tags are
            // not reused before the caller has given back what it prepared.
            assert_eq!(t.in_use(p), 3);
            assert_eq!(t.release(a, p), Some(Disposition::Aborted));
            assert_eq!(t.release(b, p), Some(Disposition::Reset));
            assert_eq!(t.in_use(p), 1);
        });
        platform.finish();
    }

    #[test]
    fn take_filters_by_kind() {
        let platform = manual();
        platform.run_passive(|p| {
            let t: Tracker<Req, HostPlatform> = Tracker::new(2, p);
            let mut m = meta(1);
            m.kind = EntryKind::Tmf(TmfKind::LunReset);
            let tag = t.reserve(m, p).unwrap();
            t.park(tag, Req(1), p).unwrap();
            assert!(
                t.take(tag, |k| matches!(k, EntryKind::Command { .. }), p)
                    .is_none()
            );
            assert!(t.take(tag, |k| matches!(k, EntryKind::Tmf(_)), p).is_some());
        });
        platform.finish();
    }
}
