//! The `Platform` trait: the kernel primitives kverbs is built on.
//!
//! Each item maps 1:1 onto one NT primitive so the NT backend is a thin
//! mapping and the host backend ([`host`]) can check the same contract:
//!
//! | here | NT |
//! |---|---|
//! | [`RawSpinLock::acquire`] / [`RawSpinLock::release`] | `KeAcquireSpinLock` / `KeReleaseSpinLock` |
//! | [`RawSpinLock::acquire_at_dpc_level`] | `KeAcquireSpinLockAtDpcLevel` |
//! | [`RawSpinLock::acquire_in_stack_queued`] | `KeAcquireInStackQueuedSpinLock(AtDpcLevel)` |
//! | [`Platform::current_irql`] | `KeGetCurrentIrql` |
//! | [`Platform::raise_to_dispatch`] / [`Platform::lower_irql`] | `KeRaiseIrql` / `KeLowerIrql` |
//! | [`Platform::new_dpc`] + [`RawDpc::queue`] | `KeInitializeDpc` (+ `KeSetTargetProcessorDpcEx`) + `KeInsertQueueDpc` |
//! | [`Platform::new_work_item`] + [`RawWorkItem::queue`] | `IoAllocateWorkItem` + `IoQueueWorkItem(DelayedWorkQueue)` |
//! | [`Platform::new_timer`] + [`RawTimer::set`] | `KeInitializeTimerEx` + `KeInitializeDpc` + `KeSetTimer` (relative) / `KeCancelTimer` |
//! | [`Platform::alloc_nonpaged`] | `ExAllocatePool2(POOL_FLAG_NON_PAGED)` / `ExFreePoolWithTag` |
//! | [`Platform::now`] | `KeQueryPerformanceCounter` |
//! | [`RawEvent`] | `KEVENT`: `KeInitializeEvent`, `KeSetEvent`, `KeWaitForSingleObject` |
//! | [`RawMutex`] | `FAST_MUTEX`: `ExAcquireFastMutex` / `ExReleaseFastMutex` |
//! | [`Platform::delay`] | `KeDelayExecutionThread` |
//! | [`Platform::stall`] | `KeStallExecutionProcessor` |
//! | [`Platform::fill_random`] | `BCryptGenRandom(BCRYPT_USE_SYSTEM_PREFERRED_RNG)` (cng.sys) |
//!
//! # Why a value with associated types
//!
//! The platform is a value (`P: Platform`, cheap to clone) rather than a set
//! of free functions: the host backend keeps per-instance state (its DPC
//! threads, worker pool and the verifier's violation log), so tests running in
//! parallel in one binary each get their own verifier. The NT backend
//! (`nt::NtPlatform`, feature `nt`) carries only the device object its work
//! items are queued against. Functions that need no
//! instance on either backend (`current_irql`, `now`) are associated
//! functions, so [`crate::irql`] can check tokens without a platform value.
//!
//! # Routines and lifetime
//!
//! DPC, work-item and timer routines are boxed closures created at
//! `PASSIVE_LEVEL`. They usually capture a `Weak` reference to their owner:
//! a queued or running DPC keeps its own storage alive (the backends reference
//! count it), but never the owner, so an object can be freed with a DPC still
//! queued; the routine then finds the `Weak` dead and does nothing.

// UNSAFETY: declares the unsafe `Platform`/`RawSpinLock` contracts; no unsafe blocks.
#![expect(unsafe_code, reason = "unsafe trait and fn declarations")]

use alloc::boxed::Box;
use core::alloc::Layout;
use core::fmt;
use core::ptr::NonNull;
use core::time::Duration;

use hca_lowlevel::doorbell::DoorbellRegister;

use crate::irql::{Dispatch, Irql, LeDispatch, Passive};

#[cfg(all(feature = "host", not(loom)))]
pub mod host;

#[cfg(all(loom, feature = "std"))]
pub mod loom;

#[cfg(all(feature = "nt", not(loom)))]
pub mod nt;

/// A DPC or timer routine: runs at `DISPATCH_LEVEL` with a [`Dispatch`] token.
pub type DpcRoutine = Box<dyn for<'a> Fn(&Dispatch<'a>) + Send + Sync>;

/// A work-item routine: runs at `PASSIVE_LEVEL` on a system worker thread.
pub type WorkRoutine = Box<dyn for<'a> Fn(&Passive<'a>) + Send + Sync>;

/// Where a DPC runs (`KeSetTargetProcessorDpcEx`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DpcTarget {
    /// The processor that queues it (the NT default).
    Current,
    /// A fixed processor, by index (`0..processor_count()`); out-of-range
    /// indices wrap.
    Processor(u32),
}

/// `KEVENT` flavour.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// `NotificationEvent`: stays signalled until cleared; wakes all waiters.
    Notification,
    /// `SynchronizationEvent`: a satisfied wait clears it; wakes one waiter.
    Synchronization,
}

/// A platform object could not be created (pool exhausted).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllocError;

impl fmt::Display for AllocError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("non-paged pool allocation failed")
    }
}

/// The platform's cryptographic random source could not fill a buffer.
///
/// Callers that need unpredictable bytes (a CHAP challenge) fail rather than
/// fall back to something guessable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RandomUnavailable;

impl fmt::Display for RandomUnavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the system random number generator failed")
    }
}

/// A monotonic time stamp in platform ticks (`KeQueryPerformanceCounter`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Ticks(pub u64);

impl Ticks {
    /// Ticks elapsed from `earlier` to `self` (zero if `earlier` is later).
    pub fn since(self, earlier: Ticks) -> u64 {
        self.0.saturating_sub(earlier.0)
    }
}

/// Converts a duration to platform ticks at `ticks_per_second`, saturating.
pub fn duration_to_ticks(d: Duration, ticks_per_second: u64) -> u64 {
    let ticks = d.as_nanos().saturating_mul(u128::from(ticks_per_second)) / 1_000_000_000;
    u64::try_from(ticks).unwrap_or(u64::MAX)
}

/// The kernel primitives kverbs needs. See the [module docs](self) for the NT
/// mapping of each item.
///
/// # Implementation safety
///
/// kverbs relies on these guarantees for memory safety and for the truth of
/// its IRQL tokens; an implementation must provide all of them:
///
/// * [`Platform::current_irql`] reports the real level of the calling thread.
/// * DPC and timer routines run at `DISPATCH_LEVEL` and receive a
///   [`Dispatch`] token only for the duration of the call; work-item routines
///   run at `PASSIVE_LEVEL` in a system thread and receive a [`Passive`]
///   token likewise.
/// * A DPC object is queued at most once at a time: `queue` returns `false`
///   when it is already queued, and a queued or running routine keeps the
///   object's own storage alive (so dropping the handle at any time is safe).
///   The same holds for work items and timers.
/// * [`Platform::alloc_nonpaged`] returns memory valid for `layout` until it
///   is passed to [`Platform::free_nonpaged`].
pub unsafe trait Platform: Clone + Send + Sync + 'static {
    /// `KSPIN_LOCK`.
    type SpinLock: RawSpinLock;
    /// `KEVENT`.
    type Event: RawEvent;
    /// `FAST_MUTEX`: a lock only `PASSIVE_LEVEL` may take (it blocks).
    type Mutex: RawMutex;
    /// `KDPC` with its routine.
    type Dpc: RawDpc;
    /// `IO_WORKITEM` with its routine.
    type WorkItem: RawWorkItem;
    /// `KTIMER` with its DPC.
    type Timer: RawTimer;

    /// The IRQL of the calling thread (`KeGetCurrentIrql`).
    ///
    /// # IRQL
    ///
    /// Any.
    fn current_irql() -> Irql;

    /// A monotonic time stamp (`KeQueryPerformanceCounter`).
    ///
    /// # IRQL
    ///
    /// Any.
    fn now() -> Ticks;

    /// The frequency of [`Platform::now`] in ticks per second.
    fn ticks_per_second() -> u64;

    /// Number of processors DPCs can target (`KeQueryActiveProcessorCountEx`).
    fn processor_count(&self) -> u32;

    /// Busy-waits for `d` without lowering the IRQL
    /// (`KeStallExecutionProcessor`); for short device waits only.
    ///
    /// # IRQL
    ///
    /// Any.
    fn stall(&self, d: Duration);

    /// Puts the calling thread to sleep (`KeDelayExecutionThread`).
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL` only: it blocks.
    fn delay(&self, d: Duration, irql: &Passive<'_>);

    /// Raises the IRQL to `DISPATCH_LEVEL` and returns the previous level
    /// (`KeRaiseIrql`). Prefer a spin-lock guard or
    /// [`crate::sync::with_dispatch`].
    ///
    /// # Safety
    ///
    /// The caller must restore the returned level with
    /// [`Platform::lower_irql`], in LIFO order with every other raise.
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    unsafe fn raise_to_dispatch() -> Irql;

    /// Notes that a caller holding a [`Dispatch`] token runs `DISPATCH_LEVEL`
    /// code without raising ([`crate::sync::with_dispatch`] on a `Dispatch`
    /// token): the raise-free analogue of [`Platform::raise_to_dispatch`],
    /// as `KeAcquireSpinLockAtDpcLevel` is of `KeAcquireSpinLock`.
    ///
    /// Nothing to do on hardware (the token is the proof); the host verifier
    /// checks the level here, as it does for an `AtDpcLevel` lock
    /// acquisition.
    ///
    /// # IRQL
    ///
    /// `DISPATCH_LEVEL` only (that is what the host checks).
    #[inline]
    fn enter_at_dispatch() {}

    /// Writes `value` to a device doorbell register (the MMIO store to a UAR
    /// page). kverbs rings every doorbell through here.
    ///
    /// On hardware this is the register write and nothing else. The host
    /// runs it as the device (`host::as_device`): a stepped software HCA
    /// executes posted work inline in the write — allocating and locking as
    /// silicon would — and that is not the driver's doing. Entering the
    /// scope here, in the ringing function's own frame, costs the host one
    /// thread-local flag either side of the one indirect call; a wrapper
    /// register around the device's (the former `hostdev::DeviceDoorbell`)
    /// cost a second indirect call and a frame, per ring.
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    #[inline]
    fn write_doorbell(register: &dyn DoorbellRegister, value: u64) {
        register.write64(value);
    }

    /// Lowers the IRQL back to `old` (`KeLowerIrql`).
    ///
    /// # Safety
    ///
    /// `old` must be the value returned by the matching
    /// [`Platform::raise_to_dispatch`] (or saved by the matching lock
    /// acquisition), and every raise made after it must already be undone.
    ///
    /// # IRQL
    ///
    /// The raised level.
    unsafe fn lower_irql(old: Irql);

    /// Creates a DPC whose routine runs at `DISPATCH_LEVEL` on `target`.
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL` (it allocates).
    fn new_dpc(
        &self,
        routine: DpcRoutine,
        target: DpcTarget,
        irql: &Passive<'_>,
    ) -> Result<Self::Dpc, AllocError>;

    /// Creates a work item whose routine runs at `PASSIVE_LEVEL` on a system
    /// worker thread.
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL` (it allocates).
    fn new_work_item(
        &self,
        routine: WorkRoutine,
        irql: &Passive<'_>,
    ) -> Result<Self::WorkItem, AllocError>;

    /// Creates a one-shot timer whose expiry runs `routine` as a DPC.
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL` (it allocates).
    fn new_timer(&self, routine: DpcRoutine, irql: &Passive<'_>)
    -> Result<Self::Timer, AllocError>;

    /// Allocates non-paged memory (`ExAllocatePool2(POOL_FLAG_NON_PAGED)`).
    ///
    /// Explicit and fallible, and only at `PASSIVE_LEVEL`: kverbs never
    /// allocates at `DISPATCH_LEVEL`.
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL`.
    fn alloc_nonpaged(&self, layout: Layout, irql: &Passive<'_>)
    -> Result<NonNull<u8>, AllocError>;

    /// Frees memory from [`Platform::alloc_nonpaged`] (`ExFreePoolWithTag`).
    ///
    /// # Safety
    ///
    /// `ptr` must come from `alloc_nonpaged` on this platform with the same
    /// `layout`, and must not be used afterwards.
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    unsafe fn free_nonpaged(&self, ptr: NonNull<u8>, layout: Layout);

    /// Fills `buf` from the system's cryptographically secure random number
    /// generator (`BCryptGenRandom` with `BCRYPT_USE_SYSTEM_PREFERRED_RNG`).
    ///
    /// For values a peer must not predict, such as an iSCSI mutual-CHAP
    /// challenge. There is no weaker fallback: on error the caller must not
    /// use `buf`.
    ///
    /// # Errors
    ///
    /// [`RandomUnavailable`] when the generator fails.
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL` (the system-preferred generator is supported only
    /// there).
    fn fill_random(&self, buf: &mut [u8], irql: &Passive<'_>) -> Result<(), RandomUnavailable>;
}

/// A spin lock (`KSPIN_LOCK`). Use it through [`crate::sync::SpinLock`],
/// which pairs every acquire with its release.
///
/// # Implementation safety
///
/// Between an `acquire*` and the matching `release*`, no other acquisition
/// of the same lock may succeed (mutual exclusion, with acquire/release
/// memory ordering). `acquire` and `acquire_in_stack_queued` must leave the
/// processor at `DISPATCH_LEVEL`; the `release` calls must restore the level
/// the caller passes.
pub unsafe trait RawSpinLock: Send + Sync {
    /// The per-acquisition state of the in-stack queued variant
    /// (`KLOCK_QUEUE_HANDLE`): lives on the acquirer's stack and must not
    /// move while the lock is held.
    type QueueHandle: Default;

    /// An unlocked lock (`KeInitializeSpinLock`).
    fn new() -> Self;

    /// Raises to `DISPATCH_LEVEL`, acquires, returns the previous level.
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    fn acquire(&self) -> Irql;

    /// Releases and lowers to `old`.
    ///
    /// # Safety
    ///
    /// The caller holds the lock (from [`RawSpinLock::acquire`] on this
    /// thread) and `old` is what that acquisition returned.
    unsafe fn release(&self, old: Irql);

    /// Acquires without changing the IRQL.
    ///
    /// # IRQL
    ///
    /// `DISPATCH_LEVEL` (the caller proves it with a token).
    fn acquire_at_dpc_level(&self);

    /// Releases without changing the IRQL.
    ///
    /// # Safety
    ///
    /// The caller holds the lock from [`RawSpinLock::acquire_at_dpc_level`].
    unsafe fn release_from_dpc_level(&self);

    /// Raises to `DISPATCH_LEVEL` and acquires in FIFO order, recording the
    /// saved level in `handle` (`KeAcquireInStackQueuedSpinLock`).
    ///
    /// # Safety
    ///
    /// `handle` must stay at the same address and be passed to
    /// [`RawSpinLock::release_in_stack_queued`] before it is reused or moved.
    unsafe fn acquire_in_stack_queued(&self, handle: *mut Self::QueueHandle);

    /// Releases a queued acquisition and restores the saved level.
    ///
    /// # Safety
    ///
    /// `handle` is the one passed to the matching acquisition, unmoved.
    unsafe fn release_in_stack_queued(&self, handle: *mut Self::QueueHandle);

    /// Queued acquisition without raising
    /// (`KeAcquireInStackQueuedSpinLockAtDpcLevel`).
    ///
    /// # Safety
    ///
    /// As [`RawSpinLock::acquire_in_stack_queued`]; the caller is at
    /// `DISPATCH_LEVEL`.
    unsafe fn acquire_in_stack_queued_at_dpc_level(&self, handle: *mut Self::QueueHandle);

    /// Releases a queued acquisition without lowering.
    ///
    /// # Safety
    ///
    /// As [`RawSpinLock::release_in_stack_queued`].
    unsafe fn release_in_stack_queued_from_dpc_level(&self, handle: *mut Self::QueueHandle);
}

/// A kernel event (`KEVENT`). Only `PASSIVE_LEVEL` may wait on it.
pub trait RawEvent: Send + Sync {
    /// `KeInitializeEvent`.
    fn new(kind: EventKind, signalled: bool) -> Self;

    /// Signals the event (`KeSetEvent`, wait = FALSE).
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    fn set(&self, irql: &impl LeDispatch);

    /// Resets the event (`KeClearEvent`).
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    fn clear(&self, irql: &impl LeDispatch);

    /// Waits until signalled (`KeWaitForSingleObject`, no timeout).
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL` only: it blocks.
    fn wait(&self, irql: &Passive<'_>);

    /// Waits at most `timeout`; `true` if the event was signalled.
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL` only: it blocks.
    fn wait_timeout(&self, timeout: Duration, irql: &Passive<'_>) -> bool;
}

/// A blocking mutual-exclusion lock (`FAST_MUTEX`). Use it through
/// [`crate::sync::PassiveMutex`].
///
/// # Implementation safety
///
/// Between `lock` and the matching `unlock`, no other `lock` may return
/// (mutual exclusion, with acquire/release memory ordering).
pub unsafe trait RawMutex: Send + Sync {
    /// An unlocked mutex (`ExInitializeFastMutex`).
    fn new() -> Self;

    /// Acquires, blocking while another thread holds it.
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL` only: it blocks.
    fn lock(&self, irql: &Passive<'_>);

    /// Releases.
    ///
    /// # Safety
    ///
    /// The calling thread holds the mutex from [`RawMutex::lock`].
    unsafe fn unlock(&self);
}

/// A DPC object with its routine.
pub trait RawDpc: Send + Sync {
    /// Queues the DPC (`KeInsertQueueDpc`); `false` if it was already queued.
    ///
    /// # IRQL
    ///
    /// Any (callable from an ISR), hence no token.
    fn queue(&self) -> bool;

    /// Removes a queued DPC (`KeRemoveQueueDpc`); `true` if it was queued.
    /// A routine that is already running is not affected.
    ///
    /// # IRQL
    ///
    /// Any.
    fn cancel(&self) -> bool;
}

/// A work item with its routine.
pub trait RawWorkItem: Send + Sync {
    /// Queues the work item (`IoQueueWorkItem`); `false` if it is already
    /// queued and has not started (NT would corrupt its list; backends
    /// refuse instead).
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    fn queue(&self, irql: &impl LeDispatch) -> bool;
}

/// A one-shot timer with its DPC.
pub trait RawTimer: Send + Sync {
    /// Arms the timer to expire `due` from now (`KeSetTimer`, relative);
    /// `true` if it was already armed (the old expiry is replaced).
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    fn set(&self, due: Duration, irql: &impl LeDispatch) -> bool;

    /// Disarms the timer (`KeCancelTimer`); `true` if it was armed. A DPC
    /// already queued by an expiry still runs.
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    fn cancel(&self, irql: &impl LeDispatch) -> bool;
}
