//! The request tracker: a fixed table of slots, one per request the core
//! holds, addressed in O(1) by [`Tag`].
//!
//! # Exactly once, by construction
//! A request handle is move-only and completing it consumes it. While the
//! transport has a command, the handle lives *in* its slot
//! (phase `Active`); the only ways out are [`Tracker::take`] (the
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
//! # No locks: one state word per slot
//! Each slot's state is one atomic word, generation (the tag's) and phase
//! together, and every transition is a compare-and-swap of the whole word
//! — so a stale tag never moves a reused slot, and of two racing
//! transitions (a completion and an abort's claim, say) exactly one wins.
//! A disposition is a phase (`Reserved` marked aborted or reset), not a
//! field, so a claim is a single swap too. The request's facts an abort
//! or reset matches on are kept in atomics beside the word and validated
//! against it after the read (see `Slot`); the request itself sits in a
//! cell only the thread that won the way in (park) or out (take) touches.
//! An I/O's reserve, park and take are three swaps and two stores here
//! (plus the free stack's two), where they were three spin lock
//! acquisitions.
//!
//! The free slots are a lock-free stack (`FreeStack`) beside the slots,
//! popped before the slot is reserved and pushed after it is freed. A slot
//! index is in the stack only while its slot is `Free`, and only its
//! single owner moves it in or out, so the stack never hands one index out
//! twice.
//!
//! # IRQL
//! Everything here runs at <= `DISPATCH_LEVEL`, never blocks and never
//! allocates; the table is allocated once, at `PASSIVE_LEVEL`.

// UNSAFETY: a parked request lives in an `UnsafeCell` handed between the
// parking and the taking thread by the slot's state word (see `Slot`).
#![expect(unsafe_code, reason = "per-slot request hand-off over UnsafeCell")]

use alloc::boxed::Box;
use alloc::vec::Vec;

#[cfg(not(loom))]
use core::sync::atomic::fence;
use kverbs::irql::{LeDispatch, Passive};
use kverbs::sync::atomic::{AtomicU32, AtomicU64, Ordering};
#[cfg(loom)]
use loom::sync::atomic::fence;

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

/// A slot's phase: the low bits of its state word.
mod phase {
    /// Unused; its index is in the free stack (or about to be).
    pub const FREE: u32 = 0;
    /// Tag handed out, the request with its owner, nothing decided.
    pub const RESERVED: u32 = 1;
    /// Reserved, and an ABORT_COMMAND claimed it.
    pub const RESERVED_ABORTED: u32 = 2;
    /// Reserved, and a bus or LUN reset claimed it.
    pub const RESERVED_RESET: u32 = 3;
    /// The owner won the park and is moving the request in.
    pub const PARKING: u32 = 4;
    /// The request is in the slot; the transport has (or is being given)
    /// the command.
    pub const ACTIVE: u32 = 5;
    /// Bits of the state word that hold the phase.
    pub const MASK: u32 = 0xffff;
}

/// A slot's state word: generation in the high 16 bits (the tag's), phase
/// in the low 16.
const fn state(generation: u16, phase: u32) -> u32 {
    ((generation as u32) << INDEX_BITS) | phase
}

const fn phase_of(state: u32) -> u32 {
    state & phase::MASK
}

/// [`Meta`] without its disposition (which lives in the phase), as two
/// atomic words: read by aborts and resets while the owner may be freeing
/// the slot, so a read may see a later reservation's words — which the
/// state word's generation then exposes (see [`Slot::read_key`]).
///
/// `address_kind` packs path (bits 0..8), target (8..16), LUN (16..24),
/// the kind (24..26: 0 command, 1 ABORT TASK, 2 LUN RESET), `has_sg`
/// (bit 26) and `requested` (32..64).
struct Key {
    identity: AtomicU64,
    address_kind: AtomicU64,
}

impl Key {
    fn pack(meta: &Meta) -> (u64, u64) {
        let a = meta.address;
        let (kind, has_sg, requested) = match meta.kind {
            EntryKind::Command { requested, has_sg } => (0, has_sg, requested),
            EntryKind::Tmf(TmfKind::AbortTask) => (1, false, 0),
            EntryKind::Tmf(TmfKind::LunReset) => (2, false, 0),
        };
        let word = u64::from(a.path)
            | u64::from(a.target) << 8
            | u64::from(a.lun) << 16
            | kind << 24
            | u64::from(has_sg) << 26
            | u64::from(requested) << 32;
        (meta.identity.0, word)
    }

    fn unpack(identity: u64, word: u64, disposition: Disposition) -> Meta {
        let byte = |shift: u32| (word >> shift) as u8;
        let kind = match (word >> 24) & 3 {
            1 => EntryKind::Tmf(TmfKind::AbortTask),
            2 => EntryKind::Tmf(TmfKind::LunReset),
            _ => EntryKind::Command {
                requested: (word >> 32) as u32,
                has_sg: word & (1 << 26) != 0,
            },
        };
        Meta {
            kind,
            address: Address::new(byte(0), byte(8), byte(16)),
            identity: SrbIdentity(identity),
            disposition,
        }
    }
}

/// The request a slot holds while `ACTIVE`: `core`'s `UnsafeCell`
/// normally, loom's under `cfg(loom)` so the model checks every access.
struct Payload<R> {
    #[cfg(not(loom))]
    inner: core::cell::UnsafeCell<Option<R>>,
    #[cfg(loom)]
    inner: loom::cell::UnsafeCell<Option<R>>,
}

impl<R> Payload<R> {
    fn new() -> Self {
        Payload {
            #[cfg(not(loom))]
            inner: core::cell::UnsafeCell::new(None),
            #[cfg(loom)]
            inner: loom::cell::UnsafeCell::new(None),
        }
    }

    /// Replaces the request, returning the old one.
    ///
    /// # Safety
    /// The caller owns the slot: it won the transition into `PARKING`
    /// (and has not yet published `ACTIVE`) or out of `ACTIVE`.
    unsafe fn replace(&self, request: Option<R>) -> Option<R> {
        #[cfg(not(loom))]
        {
            // SAFETY: the caller owns the slot (above), so no other thread
            // touches the cell now.
            unsafe { core::mem::replace(&mut *self.inner.get(), request) }
        }
        #[cfg(loom)]
        {
            // SAFETY: as above; loom checks it.
            self.inner
                .with_mut(|cell| unsafe { core::mem::replace(&mut *cell, request) })
        }
    }
}

/// One tracked request: its state word, its key and, while parked, the
/// request itself.
///
/// # Ownership
/// Every transition is a compare-and-swap (or, from a phase only the
/// owner may leave, a store) of `state`, and the whole word — generation
/// included — must match, so a stale tag never moves a reused slot:
/// * `FREE -> RESERVED` (new generation): the thread that popped the
///   index; it writes the key first.
/// * `RESERVED -> RESERVED_ABORTED | RESERVED_RESET`: an abort or reset
///   whose key check the swap validates.
/// * `RESERVED* -> FREE` (`release`) and `RESERVED -> PARKING`: whoever
///   wins the swap; `PARKING -> ACTIVE` after the request is in.
/// * `ACTIVE -> FREE` (`take`): the winner moves the request out and
///   only then pushes the index back to the free stack.
///
/// So `payload` is touched only by the thread that won the way into
/// `PARKING` or out of `ACTIVE`, never by two at once.
struct Slot<R> {
    state: AtomicU32,
    key: Key,
    payload: Payload<R>,
}

impl<R> Slot<R> {
    fn new() -> Self {
        Slot {
            state: AtomicU32::new(state(0, phase::FREE)),
            key: Key {
                identity: AtomicU64::new(0),
                address_kind: AtomicU64::new(0),
            },
            payload: Payload::new(),
        }
    }

    /// The key, as read now — possibly a later reservation's. The trailing
    /// Acquire fence pairs with the Release fence in `reserve` ahead of the
    /// key stores: if a load saw a later reservation's key, the state load
    /// or swap after this call sees that the slot moved on (a seqlock).
    fn read_key(&self) -> (u64, u64) {
        let identity = self.key.identity.load(Ordering::Relaxed);
        let word = self.key.address_kind.load(Ordering::Relaxed);
        fence(Ordering::Acquire);
        (identity, word)
    }

    /// Whether the state word is still `seen` (after [`Self::read_key`]:
    /// the key read belongs to `seen`).
    fn still(&self, seen: u32) -> bool {
        self.state.load(Ordering::Relaxed) == seen
    }
}

/// The slot table.
pub struct Tracker<R> {
    slots: Box<[Slot<R>]>,
    free: FreeStack,
}

// SAFETY: a request moves from the parking thread to the taking thread (so
// `R: Send`); no payload is touched by two threads at once (see `Slot`'s
// ownership rules); everything else is atomics.
unsafe impl<R: Send> Sync for Tracker<R> {}
// SAFETY: moving the table moves the requests it holds.
unsafe impl<R: Send> Send for Tracker<R> {}

/// The free slot indices: a lock-free (Treiber) stack.
///
/// `head` packs the top entry (index + 1; 0 = empty) in its low 32 bits
/// and a change count in its high 32 bits, so a pop or push is one add,
/// one mask and one or, not a field-by-field repack. `below[i]` is the
/// entry under index `i` while `i` is in the stack. A pop reads
/// `below[top]` and then swings `head` with a compare-and-swap; if `top`
/// was popped and pushed back meanwhile (its `below` changed), the change
/// count has moved on and the swap fails (no ABA). It could only wrap
/// after 2^32 pushes and pops between one pop's load and its swap. The
/// stack keeps no length: [`Tracker::in_use`] counts the slots instead.
struct FreeStack {
    head: AtomicU64,
    below: Box<[AtomicU32]>,
}

impl FreeStack {
    /// The top entry's bits of `head`.
    const TOP_MASK: u64 = u64::MAX >> 32;
    /// One change of the count in the high half of `head`.
    const ONE_CHANGE: u64 = 1 << 32;

    /// Every index of `0..capacity`, 0 on top.
    fn full(capacity: usize) -> Self {
        // Index i rests on i + 1 (stored + 1), the last on the bottom (0).
        let below: Box<[AtomicU32]> = (0..capacity)
            .map(|i| {
                let under = if i + 1 < capacity { i + 2 } else { 0 };
                AtomicU32::new(u32::try_from(under).unwrap_or(0))
            })
            .collect();
        Self {
            head: AtomicU64::new(u64::from(capacity > 0)),
            below,
        }
    }

    /// `head` with its count moved on and `top` on top.
    const fn next(head: u64, top: u64) -> u64 {
        (head & !Self::TOP_MASK).wrapping_add(Self::ONE_CHANGE) | top
    }

    /// Takes the top index, `None` when empty.
    ///
    /// Inlined, as [`Self::push`]: once per request each, a load and a
    /// compare-and-swap.
    #[inline]
    fn pop(&self) -> Option<usize> {
        let mut head = self.head.load(Ordering::Acquire);
        loop {
            let index = usize::try_from((head & Self::TOP_MASK).checked_sub(1)?).ok()?;
            let under = u64::from(self.below.get(index)?.load(Ordering::Relaxed));
            match self.head.compare_exchange_weak(
                head,
                Self::next(head, under),
                Ordering::Acquire,
                Ordering::Acquire,
            ) {
                Ok(_) => return Some(index),
                Err(seen) => head = seen,
            }
        }
    }

    /// Puts `index` (not in the stack: its owner frees it) on top.
    #[inline]
    fn push(&self, index: usize) {
        let (Some(cell), Ok(entry)) = (self.below.get(index), u32::try_from(index + 1)) else {
            return;
        };
        let mut head = self.head.load(Ordering::Relaxed);
        loop {
            // The low half of `head` is the top entry: the cast keeps it.
            cell.store(head as u32, Ordering::Relaxed);
            match self.head.compare_exchange_weak(
                head,
                Self::next(head, u64::from(entry)),
                Ordering::Release,
                Ordering::Relaxed,
            ) {
                Ok(_) => return,
                Err(seen) => head = seen,
            }
        }
    }

    /// Entries now, walked from the top (tests only: not a snapshot under
    /// concurrent pops and pushes).
    #[cfg(test)]
    fn len(&self) -> usize {
        let mut entry = self.head.load(Ordering::Relaxed) & Self::TOP_MASK;
        let mut len = 0;
        while let Some(cell) = entry
            .checked_sub(1)
            .and_then(|i| self.below.get(i as usize))
        {
            entry = u64::from(cell.load(Ordering::Relaxed));
            len += 1;
        }
        len
    }
}

impl<R> Tracker<R> {
    /// A table of `capacity` slots (clamped to `1..=MAX_SLOTS`).
    ///
    /// # IRQL
    /// `PASSIVE_LEVEL` (it allocates).
    #[must_use]
    pub fn new(capacity: usize, _irql: &Passive<'_>) -> Self {
        let capacity = capacity.clamp(1, MAX_SLOTS);
        let slots: Vec<Slot<R>> = (0..capacity).map(|_| Slot::new()).collect();
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

    /// The slot `tag` indexes and the generation it names.
    fn slot(&self, tag: Tag) -> Option<(usize, &Slot<R>, u16)> {
        let (index, generation) = Self::split(tag);
        Some((index, self.slots.get(index)?, generation))
    }

    /// Hands out a tag for a request described by `meta`; `None` when every
    /// slot is in use.
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    pub fn reserve(&self, meta: Meta, _irql: &impl LeDispatch) -> Option<Tag> {
        let index = self.free.pop()?;
        let Some(slot) = self.slots.get(index) else {
            self.free.push(index);
            return None;
        };
        // The popped index is ours alone: nobody else moves a FREE slot.
        let old = slot.state.load(Ordering::Relaxed);
        let generation = ((old >> INDEX_BITS) as u16).wrapping_add(1);
        let (identity, word) = Key::pack(&meta);
        // Orders the key stores after everything that freed the slot (see
        // `Slot::read_key`).
        fence(Ordering::Release);
        slot.key.identity.store(identity, Ordering::Relaxed);
        slot.key.address_kind.store(word, Ordering::Relaxed);
        let phase = match meta.disposition {
            Disposition::Proceed => phase::RESERVED,
            Disposition::Aborted => phase::RESERVED_ABORTED,
            Disposition::Reset => phase::RESERVED_RESET,
        };
        slot.state
            .store(state(generation, phase), Ordering::Release);
        Some(Self::make_tag(index, generation))
    }

    /// Gives a reservation back without parking (the request was completed
    /// by its owner before reaching the transport). Returns the
    /// disposition an abort or reset left on it.
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    pub fn release(&self, tag: Tag, _irql: &impl LeDispatch) -> Option<Disposition> {
        let (index, slot, generation) = self.slot(tag)?;
        let mut seen = slot.state.load(Ordering::Relaxed);
        loop {
            if seen >> INDEX_BITS != u32::from(generation) {
                return None;
            }
            let disposition = match phase_of(seen) {
                phase::RESERVED => Disposition::Proceed,
                phase::RESERVED_ABORTED => Disposition::Aborted,
                phase::RESERVED_RESET => Disposition::Reset,
                _ => return None,
            };
            match slot.state.compare_exchange(
                seen,
                state(generation, phase::FREE),
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => {
                    self.free.push(index);
                    return Some(disposition);
                }
                // An abort or reset marked it meanwhile: read it again.
                Err(now) => seen = now,
            }
        }
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
    pub fn park(
        &self,
        tag: Tag,
        request: R,
        _irql: &impl LeDispatch,
    ) -> Result<(), ParkRefused<R>> {
        let Some((_, slot, generation)) = self.slot(tag) else {
            return Err(ParkRefused::NotReserved(request));
        };
        match slot.state.compare_exchange(
            state(generation, phase::RESERVED),
            state(generation, phase::PARKING),
            Ordering::Acquire,
            Ordering::Relaxed,
        ) {
            Ok(_) => {}
            Err(now) if now == state(generation, phase::RESERVED_ABORTED) => {
                return Err(ParkRefused::Disposed(request, Disposition::Aborted));
            }
            Err(now) if now == state(generation, phase::RESERVED_RESET) => {
                return Err(ParkRefused::Disposed(request, Disposition::Reset));
            }
            Err(_) => return Err(ParkRefused::NotReserved(request)),
        }
        // SAFETY: this thread won RESERVED -> PARKING; nobody else touches
        // the payload until it publishes ACTIVE below.
        let _empty = unsafe { slot.payload.replace(Some(request)) };
        slot.state
            .store(state(generation, phase::ACTIVE), Ordering::Release);
        Ok(())
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
        _irql: &impl LeDispatch,
    ) -> Option<(R, Meta)> {
        let (index, slot, generation) = self.slot(tag)?;
        let active = state(generation, phase::ACTIVE);
        if slot.state.load(Ordering::Acquire) != active {
            return None;
        }
        let (identity, word) = slot.read_key();
        let meta = Key::unpack(identity, word, Disposition::Proceed);
        if !want(&meta.kind) {
            return None;
        }
        // Success also proves the key read belongs to this generation.
        slot.state
            .compare_exchange(
                active,
                state(generation, phase::FREE),
                Ordering::Acquire,
                Ordering::Relaxed,
            )
            .ok()?;
        // SAFETY: this thread won ACTIVE -> FREE and has not yet pushed the
        // index back, so nobody else touches the payload.
        let request = unsafe { slot.payload.replace(None) };
        self.free.push(index);
        // `None` only if PARKING -> ACTIVE was published without a request,
        // which `park` never does.
        Some((request?, meta))
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
        _irql: &impl LeDispatch,
    ) -> VictimState {
        let Some((_, slot, generation)) = self.slot(tag) else {
            return VictimState::NotFound;
        };
        let mut seen = slot.state.load(Ordering::Acquire);
        loop {
            if seen >> INDEX_BITS != u32::from(generation) {
                return VictimState::NotFound;
            }
            let (key_identity, word) = slot.read_key();
            let meta = Key::unpack(key_identity, word, Disposition::Proceed);
            let matches =
                meta.identity == identity && matches!(meta.kind, EntryKind::Command { .. });
            let verdict = match phase_of(seen) {
                phase::RESERVED if matches => {
                    match slot.state.compare_exchange(
                        seen,
                        state(generation, phase::RESERVED_ABORTED),
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    ) {
                        Ok(_) => return VictimState::MarkedAborted,
                        Err(now) => {
                            seen = now;
                            continue;
                        }
                    }
                }
                phase::RESERVED_ABORTED | phase::RESERVED_RESET if matches => {
                    VictimState::MarkedAborted
                }
                phase::PARKING | phase::ACTIVE if matches => VictimState::Posted(meta.address),
                _ => VictimState::NotFound,
            };
            // The verdict holds if the key read was this state's.
            if slot.still(seen) {
                return verdict;
            }
            seen = slot.state.load(Ordering::Acquire);
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
        _irql: &impl LeDispatch,
    ) -> usize {
        let mut marked = 0;
        for slot in &*self.slots {
            let mut seen = slot.state.load(Ordering::Acquire);
            while phase_of(seen) == phase::RESERVED {
                let (identity, word) = slot.read_key();
                let meta = Key::unpack(identity, word, Disposition::Proceed);
                if !matches!(meta.kind, EntryKind::Command { .. }) || !covers(&meta.address) {
                    // Not covered — or a later reservation's key, which a
                    // scan a moment later would have read anyway.
                    break;
                }
                match slot.state.compare_exchange(
                    seen,
                    (seen & !phase::MASK) | phase::RESERVED_RESET,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                ) {
                    Ok(_) => {
                        marked += 1;
                        break;
                    }
                    Err(now) => seen = now,
                }
            }
        }
        marked
    }

    /// Slots not free now (a snapshot; walks the table, off the I/O path).
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    pub fn in_use(&self, irql: &impl LeDispatch) -> usize {
        let _ = irql;
        self.slots
            .iter()
            .filter(|slot| phase_of(slot.state.load(Ordering::Relaxed)) != phase::FREE)
            .count()
    }
}

#[cfg(all(test, feature = "host"))]
mod tests {
    use super::*;
    use crate::storport::SrbIdentity;
    use kverbs::platform::host::HostPlatform;

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

    /// Rounds per thread of the stress tests: `TRACKER_STRESS_ROUNDS`
    /// (default 20,000).
    fn stress_rounds() -> u32 {
        std::env::var("TRACKER_STRESS_ROUNDS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(20_000)
    }

    /// Threads popping and pushing at once never hold one index together,
    /// and every index comes back. `TRACKER_STRESS_ROUNDS` per thread
    /// (default 20,000).
    #[test]
    fn free_stack_hands_each_index_to_one_owner_at_a_time() {
        use std::sync::Arc;
        use std::sync::atomic::AtomicBool;
        let rounds = stress_rounds() as usize;
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
        let platform = HostPlatform::manual();
        platform.run_passive(|p| {
            let t: Tracker<Req> = Tracker::new(4, p);
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
        let platform = HostPlatform::manual();
        platform.run_passive(|p| {
            let t: Tracker<Req> = Tracker::new(1, p);
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

    /// Every transition checks the whole state word, generation included:
    /// a tag from the slot's previous use moves nothing, whatever phase the
    /// reused slot is in. Fails if any transition compares the phase only.
    #[test]
    fn every_transition_checks_the_generation() {
        let platform = HostPlatform::manual();
        platform.run_passive(|p| {
            let t: Tracker<Req> = Tracker::new(1, p);
            let old = t.reserve(meta(1), p).unwrap();
            assert_eq!(t.release(old, p), Some(Disposition::Proceed));
            // Reused, reserved: the old tag may not park, release or claim it.
            let new = t.reserve(meta(1), p).unwrap();
            assert!(matches!(
                t.park(old, Req(1), p),
                Err(ParkRefused::NotReserved(Req(1)))
            ));
            assert_eq!(t.release(old, p), None);
            assert_eq!(
                t.claim_victim(old, SrbIdentity(1), p),
                VictimState::NotFound
            );
            // Reused, parked: the old tag may not take, unpark or claim it.
            t.park(new, Req(2), p).unwrap();
            assert!(t.take(old, |_| true, p).is_none());
            assert!(t.unpark(old, p).is_none());
            assert_eq!(
                t.claim_victim(old, SrbIdentity(1), p),
                VictimState::NotFound
            );
            assert_eq!(t.take(new, |_| true, p).map(|x| x.0), Some(Req(2)));
            // A tag naming a slot past the table is refused too.
            let beyond = Tag(5);
            assert!(t.take(beyond, |_| true, p).is_none());
            assert!(matches!(
                t.park(beyond, Req(3), p),
                Err(ParkRefused::NotReserved(Req(3)))
            ));
        });
        platform.finish();
    }

    /// The key keeps every field of [`Meta`] (the disposition lives in the
    /// phase).
    #[test]
    fn meta_survives_the_key() {
        let metas = [
            Meta {
                kind: EntryKind::Command {
                    requested: u32::MAX,
                    has_sg: true,
                },
                address: Address::new(255, 254, 253),
                identity: SrbIdentity(u64::MAX),
                disposition: Disposition::Proceed,
            },
            Meta {
                kind: EntryKind::Command {
                    requested: 0,
                    has_sg: false,
                },
                address: Address::new(0, 0, 0),
                identity: SrbIdentity(0),
                disposition: Disposition::Proceed,
            },
            Meta {
                kind: EntryKind::Tmf(TmfKind::AbortTask),
                address: Address::new(1, 2, 3),
                identity: SrbIdentity(42),
                disposition: Disposition::Proceed,
            },
            Meta {
                kind: EntryKind::Tmf(TmfKind::LunReset),
                address: Address::new(3, 2, 1),
                identity: SrbIdentity(1 << 63),
                disposition: Disposition::Proceed,
            },
        ];
        for m in metas {
            let (identity, word) = Key::pack(&m);
            assert_eq!(Key::unpack(identity, word, Disposition::Proceed), m);
        }
    }

    /// Completions race aborts and resets on real threads: every request
    /// either parks and comes out exactly once, by its completion, or is
    /// claimed first, refused at park with the claim's disposition and
    /// released; the table ends empty. `TRACKER_STRESS_ROUNDS` per thread
    /// (default 20,000).
    #[test]
    fn completions_race_aborts_and_resets() {
        use std::sync::Arc;
        use std::sync::atomic::AtomicUsize;
        let rounds = u64::from(stress_rounds());
        let platform = HostPlatform::manual();
        let t: Arc<Tracker<Req>> = Arc::new(platform.run_passive(|p| Tracker::new(4, p)));
        // The latest (identity << 32 | tag) each owner handed out.
        let latest: Arc<Vec<AtomicU64>> = Arc::new((0..2).map(|_| AtomicU64::new(0)).collect());
        let refused = Arc::new(AtomicUsize::new(0));
        let owners: Vec<_> = (0..2u64)
            .map(|o| {
                let (t, latest, refused) =
                    (Arc::clone(&t), Arc::clone(&latest), Arc::clone(&refused));
                let platform = platform.clone();
                std::thread::spawn(move || {
                    platform.run_passive(|p| {
                        for i in 0..rounds {
                            let id = 1 + o * rounds + i;
                            let tag = t.reserve(meta(id), p).unwrap();
                            latest[o as usize]
                                .store(id << 32 | u64::from(tag.raw()), Ordering::Release);
                            if i % 4 == 0 {
                                // Widen the window a claim can land in.
                                std::thread::yield_now();
                            }
                            match t.park(tag, Req(id), p) {
                                Ok(()) => {
                                    let (req, m) = t.take(tag, |_| true, p).unwrap();
                                    assert_eq!((req, m.identity), (Req(id), SrbIdentity(id)));
                                    assert_eq!(m.disposition, Disposition::Proceed);
                                    assert!(t.take(tag, |_| true, p).is_none(), "twice");
                                }
                                Err(ParkRefused::Disposed(req, d)) => {
                                    assert_eq!(req, Req(id));
                                    assert_ne!(d, Disposition::Proceed);
                                    assert_eq!(t.release(tag, p), Some(d));
                                    refused.fetch_add(1, Ordering::Relaxed);
                                }
                                Err(ParkRefused::NotReserved(_)) => panic!("own tag refused"),
                            }
                        }
                    });
                })
            })
            .collect();
        let claimer = {
            let (t, latest) = (Arc::clone(&t), Arc::clone(&latest));
            let platform = platform.clone();
            std::thread::spawn(move || {
                platform.run_passive(|p| {
                    // Claims of distinct requests (a reserved request
                    // claimed again is reported again).
                    let mut marked = 0;
                    let mut reported = [0u64; 2];
                    for i in 0..rounds {
                        let owner = (i % 2) as usize;
                        let word = latest[owner].load(Ordering::Acquire);
                        let tag = Tag(word as u32);
                        if i % 8 == 0 {
                            marked += t.mark_reserved_reset(|_| true, p);
                        } else if t.claim_victim(tag, SrbIdentity(word >> 32), p)
                            == VictimState::MarkedAborted
                            && reported[owner] != word
                        {
                            reported[owner] = word;
                            marked += 1;
                        }
                    }
                    marked
                })
            })
        };
        for h in owners {
            h.join().unwrap();
        }
        let marked = claimer.join().unwrap();
        platform.run_passive(|p| assert_eq!(t.in_use(p), 0));
        // Each claim refuses one park (a reset may also have marked a
        // request the abort then reports).
        assert!(refused.load(Ordering::Relaxed) <= marked);
        platform.finish();
    }

    #[test]
    fn full_table_refuses_and_release_returns_the_slot() {
        let platform = HostPlatform::manual();
        platform.run_passive(|p| {
            let t: Tracker<Req> = Tracker::new(2, p);
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
        let platform = HostPlatform::manual();
        platform.run_passive(|p| {
            let t: Tracker<Req> = Tracker::new(4, p);
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
        let platform = HostPlatform::manual();
        platform.run_passive(|p| {
            let t: Tracker<Req> = Tracker::new(2, p);
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

/// `loom` models of the slot transitions: a completion racing an
/// ABORT_COMMAND's claim, and a reset scan racing a slot's reuse (the
/// key read a later reservation may have overwritten).
///
/// Run with `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=3 cargo test -p
/// storport-srp --lib --release loom` (see `.ci/steps/51-loom-kverbs.sh`).
#[cfg(all(test, loom))]
mod loom_tests {
    // UNSAFETY: mints passive tokens for model threads, which stand for
    // passive-level system threads.
    #![expect(unsafe_code, reason = "token minting for model threads")]

    use super::*;
    use kverbs::platform::loom::LoomPlatform;
    use loom::sync::Arc;
    use loom::thread;

    fn passive() -> Passive<'static> {
        // SAFETY: model threads stand for passive-level threads.
        unsafe { Passive::assume::<LoomPlatform>() }
    }

    fn meta(id: u64, lun: u8) -> Meta {
        Meta {
            kind: EntryKind::Command {
                requested: 512,
                has_sg: true,
            },
            address: Address::new(0, 0, lun),
            identity: SrbIdentity(id),
            disposition: Disposition::Proceed,
        }
    }

    #[derive(Debug, PartialEq, Eq)]
    struct Req(u64);

    /// The owner parks and its completion takes, while an abort claims
    /// the same request: either the claim finds it reserved and the park
    /// is refused with `Aborted`, or the claim finds it posted (or gone)
    /// and the completion takes it — exactly once either way.
    #[test]
    fn loom_complete_races_abort_claim() {
        loom::model(|| {
            let p = passive();
            let t = Arc::new(Tracker::<Req>::new(1, &p));
            let tag = t.reserve(meta(1, 0), &p).unwrap();
            let claimer = {
                let t = Arc::clone(&t);
                thread::spawn(move || t.claim_victim(tag, SrbIdentity(1), &passive()))
            };
            let refused = match t.park(tag, Req(1), &p) {
                Ok(()) => {
                    let (req, m) = t.take(tag, |_| true, &p).unwrap();
                    assert_eq!((req, m.identity), (Req(1), SrbIdentity(1)));
                    assert!(t.take(tag, |_| true, &p).is_none());
                    false
                }
                Err(ParkRefused::Disposed(Req(1), Disposition::Aborted)) => {
                    assert_eq!(t.release(tag, &p), Some(Disposition::Aborted));
                    true
                }
                Err(other) => panic!("{other:?}"),
            };
            let claim = claimer.join().unwrap();
            assert_eq!(claim == VictimState::MarkedAborted, refused, "{claim:?}");
            assert_eq!(t.in_use(&p), 0);
        });
    }

    /// The free stack's ABA case: one thread pops both entries of a
    /// two-entry stack and pushes the first back (the top returns with a
    /// new entry under it) while another pops and pushes. No index
    /// is held by both at once and both come back exactly once. Fails if a
    /// pop's swap succeeds on a head whose top was popped and pushed back
    /// under it (a change count that does not move).
    #[test]
    fn loom_free_stack_pop_push_race() {
        use loom::sync::atomic::AtomicBool;
        loom::model(|| {
            let stack = Arc::new(FreeStack::full(2));
            let owned: Arc<[AtomicBool; 2]> =
                Arc::new([AtomicBool::new(false), AtomicBool::new(false)]);
            let take = |stack: &FreeStack, owned: &[AtomicBool; 2]| {
                let index = stack.pop()?;
                assert!(!owned[index].swap(true, Ordering::AcqRel), "{index} twice");
                Some(index)
            };
            let give = |stack: &FreeStack, owned: &[AtomicBool; 2], index: usize| {
                owned[index].store(false, Ordering::Release);
                stack.push(index);
            };
            let other = {
                let (stack, owned) = (Arc::clone(&stack), Arc::clone(&owned));
                thread::spawn(move || {
                    if let Some(index) = take(&stack, &owned) {
                        give(&stack, &owned, index);
                    }
                })
            };
            let first = take(&stack, &owned);
            let second = take(&stack, &owned);
            for index in [first, second].into_iter().flatten() {
                give(&stack, &owned, index);
            }
            other.join().unwrap();
            let mut seen = [stack.pop(), stack.pop(), stack.pop()];
            seen.sort();
            assert_eq!(seen, [None, Some(0), Some(1)]);
        });
    }

    /// A reset scan for LUN 0 races the owner finishing a LUN 0 request
    /// and reusing its slot for a LUN 1 request. The scan may read the
    /// second request's key against the first one's state word; it must
    /// never mark the LUN 1 request, and a mark it counts refuses exactly
    /// the LUN 0 park. Fails if a claim compares the phase without the
    /// generation, or reads the key without validating it.
    #[test]
    fn loom_reset_scan_races_slot_reuse() {
        loom::model(|| {
            let p = passive();
            let t = Arc::new(Tracker::<Req>::new(1, &p));
            let first = t.reserve(meta(1, 0), &p).unwrap();
            let scanner = {
                let t = Arc::clone(&t);
                thread::spawn(move || t.mark_reserved_reset(|a| a.lun == 0, &passive()))
            };
            let first_refused = match t.park(first, Req(1), &p) {
                Ok(()) => {
                    assert_eq!(t.take(first, |_| true, &p).map(|x| x.0), Some(Req(1)));
                    false
                }
                Err(ParkRefused::Disposed(Req(1), Disposition::Reset)) => {
                    assert_eq!(t.release(first, &p), Some(Disposition::Reset));
                    true
                }
                Err(other) => panic!("{other:?}"),
            };
            let second = t.reserve(meta(2, 1), &p).unwrap();
            assert_ne!(first, second);
            t.park(second, Req(2), &p).unwrap();
            let (req, m) = t.take(second, |_| true, &p).unwrap();
            assert_eq!((req, m.address.lun), (Req(2), 1));
            let marked = scanner.join().unwrap();
            assert_eq!(marked == 1, first_refused);
            assert!(marked <= 1);
            assert_eq!(t.in_use(&p), 0);
        });
    }
}
