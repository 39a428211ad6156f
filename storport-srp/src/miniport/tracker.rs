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
//! # IRQL
//! Everything here runs at <= `DISPATCH_LEVEL`, never blocks and never
//! allocates; the table is allocated once, at `PASSIVE_LEVEL`.

#![forbid(unsafe_code)]

use alloc::boxed::Box;
use alloc::vec::Vec;

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
    free: SpinLock<FreeList, P>,
}

struct FreeList {
    stack: Box<[u16]>,
    len: usize,
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
        // Pop order: slot 0 first.
        let stack: Box<[u16]> = (0..capacity)
            .rev()
            .map(|i| u16::try_from(i).unwrap_or(u16::MAX))
            .collect();
        Self {
            slots: slots.into_boxed_slice(),
            free: SpinLock::new(FreeList {
                stack,
                len: capacity,
            }),
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
        let index = {
            let mut free = self.free.lock(irql);
            let len = free.len.checked_sub(1)?;
            let index = *free.stack.get(len)?;
            free.len = len;
            usize::from(index)
        };
        let slot = self.slots.get(index)?;
        let mut slot = slot.lock(irql);
        slot.generation = slot.generation.wrapping_add(1);
        slot.state = SlotState::Reserved(meta);
        Some(Self::make_tag(index, slot.generation))
    }

    fn push_free(&self, index: usize, irql: &impl LeDispatch) {
        let mut free = self.free.lock(irql);
        let len = free.len;
        if let (Some(entry), Ok(value)) = (free.stack.get_mut(len), u16::try_from(index)) {
            *entry = value;
            free.len = len + 1;
        }
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
        self.slots.len() - self.free.lock(irql).len
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
