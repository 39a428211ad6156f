//! The host platform: std threads standing in for the NT kernel, and a
//! verifier standing in for Driver Verifier.
//!
//! # What runs where
//!
//! * DPCs run on one thread per simulated processor (`kverbs-dpc-N`) at
//!   `DISPATCH_LEVEL`; a DPC targeted at processor *n* always runs on thread
//!   *n*, so two DPCs on different processors really run concurrently.
//! * Work items run at `PASSIVE_LEVEL` on a pool of worker threads.
//! * Timers are kept by a timer thread that queues their DPC on expiry.
//! * In [`HostMode::Manual`] no thread is started: queued DPCs, work items
//!   and expired timers wait until the test runs them with
//!   [`HostPlatform::run_one`], choosing the order itself (seeded random
//!   schedules that replay exactly).
//!
//! # The verifier
//!
//! Every thread has an IRQL, a stack of raises and a stack of held spin
//! locks (thread-locals). The backend's primitives update them and record a
//! [`Violation`] when the NT contract is broken:
//!
//! * blocking at `DISPATCH_LEVEL`: waiting on an event, sleeping, taking a
//!   passive-only mutex ([`ViolationKind::BlockedAtDispatch`]);
//! * allocating at `DISPATCH_LEVEL`: through [`Platform::alloc_nonpaged`] or
//!   through the global allocator, when the test binary installs
//!   [`VerifierAllocator`] ([`ViolationKind::AllocatedAtDispatch`]);
//! * releasing spin locks out of order ([`ViolationKind::LockReleasedOutOfOrder`]);
//! * lowering the IRQL below the level it was raised from
//!   ([`ViolationKind::IrqlLoweredBelowRaise`]), or "lowering" above the
//!   current level;
//! * a DPC that runs longer than its budget ([`ViolationKind::DpcOverBudget`]),
//!   counted in its thread's CPU time (a DPC is not preempted on NT; a host
//!   thread is, and time spent descheduled on a busy machine is not the
//!   DPC's doing; the thread CPU clock is read only when the wall clock
//!   says the budget may be exceeded, see `BudgetClock`);
//! * a routine that returns with a lock held or the IRQL changed.
//!
//! Violations are recorded against the platform instance the thread belongs
//! to (its DPC and worker threads, and any thread inside
//! [`HostPlatform::run_passive`] / [`HostPlatform::run_at_dispatch`]), so
//! tests running in parallel do not see each other's. A test ends with
//! [`HostPlatform::finish`], which waits for queued work, stops the threads
//! and fails the test if anything was recorded; negative tests read the log
//! with [`HostPlatform::take_violations`].

// UNSAFETY: implements the unsafe `Platform`/`RawSpinLock`/`RawMutex`
// contracts and `GlobalAlloc`; each block states its argument.
#![expect(
    unsafe_code,
    reason = "platform trait implementations and the global allocator"
)]
#![expect(
    clippy::panic,
    reason = "the verifier fails a test by panicking at its end, as a test assertion does"
)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::VecDeque;
use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError, Weak};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use hca_lowlevel::doorbell::DoorbellRegister;

use crate::irql::{Dispatch, Irql, LeDispatch, Passive};
use crate::platform::{
    AllocError, DpcRoutine, DpcTarget, EventKind, Platform, RandomUnavailable, RawDpc, RawEvent,
    RawMutex, RawSpinLock, RawTimer, RawWorkItem, Ticks, WorkRoutine,
};

// ---------------------------------------------------------------------------
// Violations and the per-instance log
// ---------------------------------------------------------------------------

/// Which blocking operation ran at `DISPATCH_LEVEL`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockingOp {
    /// `KeWaitForSingleObject` on an event.
    Wait,
    /// `KeDelayExecutionThread`.
    Sleep,
    /// Acquiring a passive-only mutex (`FAST_MUTEX`).
    PassiveLock,
}

/// Which kind of routine broke its exit contract.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RoutineKind {
    /// A DPC or timer routine.
    Dpc,
    /// A work-item routine.
    WorkItem,
    /// A closure run by `run_passive` / `run_at_dispatch`.
    Scope,
}

/// One broken rule of the NT execution contract.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ViolationKind {
    /// A blocking call at `DISPATCH_LEVEL` or above.
    BlockedAtDispatch {
        /// What blocked.
        op: BlockingOp,
    },
    /// A memory allocation at `DISPATCH_LEVEL` or above.
    AllocatedAtDispatch {
        /// Bytes requested.
        size: usize,
    },
    /// A spin lock released while a lock acquired after it is still held.
    LockReleasedOutOfOrder,
    /// `KeLowerIrql` to a level below the one the matching raise came from.
    IrqlLoweredBelowRaise {
        /// The level lowered to.
        to: Irql,
        /// The level the innermost outstanding raise saved.
        raised_from: Irql,
    },
    /// `KeLowerIrql` to a level above the current one, or with no raise
    /// outstanding.
    IrqlLowerWithoutRaise {
        /// The level "lowered" to.
        to: Irql,
    },
    /// `KeRaiseIrql`/`KeAcquireSpinLock` called above `DISPATCH_LEVEL`, or an
    /// `AtDpcLevel` acquisition (or a raise-free
    /// [`Platform::enter_at_dispatch`]) below it.
    WrongIrqlForLock {
        /// The level at the call.
        at: Irql,
    },
    /// A DPC routine ran longer than the DPC budget (thread CPU time;
    /// `elapsed_us` is an upper bound on it, see the module docs).
    DpcOverBudget {
        /// How long it ran (CPU time of its thread), in microseconds.
        elapsed_us: u64,
        /// The budget, in microseconds.
        budget_us: u64,
    },
    /// A routine returned with spin locks held or the IRQL changed.
    RoutineLeakedState {
        /// Which routine.
        routine: RoutineKind,
        /// The IRQL it returned at.
        irql: Irql,
        /// Spin locks still held.
        locks_held: usize,
    },
}

/// A recorded violation: what, at which level, on which thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Violation {
    /// The broken rule.
    pub kind: ViolationKind,
    /// The IRQL of the offending thread at the time.
    pub irql: Irql,
    /// The offending thread's role.
    pub thread: ThreadRole,
}

/// What a thread is to the host platform.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ThreadRole {
    /// A test thread (or any thread the platform did not start).
    Test,
    /// The DPC thread of a simulated processor.
    Dpc(u32),
    /// A system worker thread.
    Worker(u32),
    /// The timer thread.
    Timer,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?} at {:?} on {:?}", self.kind, self.irql, self.thread)
    }
}

/// How many violations a log keeps in detail (the count is exact).
const LOG_CAPACITY: usize = 64;

/// The per-instance violation log. Recording never allocates (it runs inside
/// the global allocator).
struct VerifierState {
    log: Mutex<[Option<Violation>; LOG_CAPACITY]>,
    count: AtomicUsize,
    allocations_at_dispatch: AtomicUsize,
}

impl VerifierState {
    const fn new() -> Self {
        VerifierState {
            log: Mutex::new([None; LOG_CAPACITY]),
            count: AtomicUsize::new(0),
            allocations_at_dispatch: AtomicUsize::new(0),
        }
    }

    fn record(&self, v: Violation) {
        let index = self.count.fetch_add(1, Ordering::Relaxed);
        if let Some(slot) = lock(&self.log).get_mut(index) {
            *slot = Some(v);
        }
    }

    fn take(&self) -> Vec<Violation> {
        let mut log = lock(&self.log);
        let taken = log.iter_mut().filter_map(Option::take).collect();
        self.count.store(0, Ordering::Relaxed);
        taken
    }
}

/// Where violations of threads that belong to no platform go.
static ORPHAN_VERIFIER: VerifierState = VerifierState::new();

/// Locks a std mutex, ignoring poisoning (a panicking test must not hide the
/// verifier's report behind a second panic).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

// ---------------------------------------------------------------------------
// Per-thread state
// ---------------------------------------------------------------------------

/// Depth of the per-thread raise and held-lock stacks.
const STACK_DEPTH: usize = 32;

struct ThreadState {
    irql: Cell<u8>,
    verifier: Cell<Option<&'static VerifierState>>,
    role: Cell<ThreadRole>,
    cpu: Cell<Option<u32>>,
    /// Saved IRQLs of outstanding raises, innermost last.
    raises: [Cell<u8>; STACK_DEPTH],
    raise_depth: Cell<usize>,
    /// Ids of held spin locks, innermost last.
    held: [Cell<usize>; STACK_DEPTH],
    held_depth: Cell<usize>,
    /// True while the thread runs the device model (see [`as_device`]).
    in_device: Cell<bool>,
}

impl ThreadState {
    /// A thread's state before it does anything: PASSIVE_LEVEL, no
    /// verifier, nothing raised or held.
    const fn new() -> Self {
        ThreadState {
            irql: Cell::new(0),
            verifier: Cell::new(None),
            role: Cell::new(ThreadRole::Test),
            cpu: Cell::new(None),
            raises: [const { Cell::new(0) }; STACK_DEPTH],
            raise_depth: Cell::new(0),
            held: [const { Cell::new(0) }; STACK_DEPTH],
            held_depth: Cell::new(0),
            in_device: Cell::new(false),
        }
    }
}

thread_local! {
    static THREAD: ThreadState = const { ThreadState::new() };
}

/// Runs `f` on this thread's state; `None` while the thread is being torn
/// down (then nothing is checked).
fn with_thread<R>(f: impl FnOnce(&ThreadState) -> R) -> Option<R> {
    THREAD.try_with(f).ok()
}

#[inline]
fn current_irql_raw() -> Irql {
    with_thread(|t| Irql::from_raw(t.irql.get())).unwrap_or(Irql::PASSIVE)
}

/// Records a violation of the calling thread (only ever on a broken rule:
/// cold, out of line).
#[cold]
#[inline(never)]
fn record(kind: ViolationKind) {
    let _ = with_thread(|t| {
        if t.in_device.get() {
            // The device model is hardware: its work is not driver CPU time
            // and follows no IRQL contract.
            return;
        }
        let v = Violation {
            kind,
            irql: Irql::from_raw(t.irql.get()),
            thread: t.role.get(),
        };
        t.verifier.get().unwrap_or(&ORPHAN_VERIFIER).record(v);
    });
}

fn check_may_block(op: BlockingOp) {
    if !current_irql_raw().may_block() {
        record(ViolationKind::BlockedAtDispatch { op });
    }
}

fn check_may_allocate(size: usize) {
    let _ = with_thread(|t| {
        if !t.in_device.get() && !Irql::from_raw(t.irql.get()).may_block() {
            if let Some(v) = t.verifier.get() {
                v.allocations_at_dispatch.fetch_add(1, Ordering::Relaxed);
            }
            record(ViolationKind::AllocatedAtDispatch { size });
        }
    });
}

/// Runs `f` as the device model — the hardware — rather than as driver
/// code: nothing it does is checked against the IRQL contract.
///
/// A software HCA executes posted work inside the doorbell write when it
/// runs inline, on whatever thread rang it (possibly at `DISPATCH_LEVEL`
/// in a DPC); its allocations and locks stand for silicon, not for the
/// driver. kverbs rings every doorbell in this scope
/// ([`Platform::write_doorbell`]), and its host adapter for the software HCA
/// ([`crate::hostdev`]) wraps every driver handler the device calls back in
/// [`as_driver`], so the
/// driver's own code stays fully checked even when it runs inside a
/// doorbell write.
///
/// # IRQL
///
/// Any; the thread's IRQL is unchanged.
pub fn as_device<R>(f: impl FnOnce() -> R) -> R {
    let previous = with_thread(|t| t.in_device.replace(true)).unwrap_or(false);
    let result = f();
    let _ = with_thread(|t| t.in_device.set(previous));
    result
}

/// Records a [`ViolationKind::BlockedAtDispatch`] if the calling thread is
/// at `DISPATCH_LEVEL` or above: for device-model entry points that stand
/// for blocking firmware commands, so a driver that issues one from a DPC
/// is caught even though the model itself never waits on a kernel object.
///
/// # IRQL
///
/// Any (that is what it checks).
pub fn check_blocking_call() {
    check_may_block(BlockingOp::Wait);
}

/// Inside [`as_device`], runs `f` as driver code again (a device model
/// calling a driver's event handler): the checks apply.
///
/// # IRQL
///
/// Any; the thread's IRQL is unchanged.
pub fn as_driver<R>(f: impl FnOnce() -> R) -> R {
    let previous = with_thread(|t| t.in_device.replace(false)).unwrap_or(false);
    let result = f();
    let _ = with_thread(|t| t.in_device.set(previous));
    result
}

/// `KeRaiseIrql(DISPATCH_LEVEL)` on the thread model.
#[inline]
fn raise_to_dispatch_raw() -> Irql {
    with_thread(raise_on).unwrap_or(Irql::PASSIVE)
}

/// [`raise_to_dispatch_raw`] on an already-visited thread state (the spin
/// locks raise and push the held lock in one visit).
#[inline]
fn raise_on(t: &ThreadState) -> Irql {
    let old = t.irql.get();
    if old > Irql::DISPATCH.raw() {
        record_wrong_irql_for_lock(old);
    }
    let depth = t.raise_depth.get();
    if let Some(slot) = t.raises.get(depth) {
        slot.set(old);
    }
    t.raise_depth.set(depth.saturating_add(1));
    t.irql.set(old.max(Irql::DISPATCH.raw()));
    Irql::from_raw(old)
}

/// Records a spin lock taken at the wrong IRQL (`at`, raw): out of line,
/// so the lock's fast path builds no violation on its stack.
#[cold]
#[inline(never)]
fn record_wrong_irql_for_lock(at: u8) {
    record(ViolationKind::WrongIrqlForLock {
        at: Irql::from_raw(at),
    });
}

/// `KeLowerIrql(to)` on the thread model, checking it undoes the innermost
/// raise.
#[inline]
fn lower_irql_raw(to: Irql) {
    let _ = with_thread(|t| lower_on(t, to));
}

/// [`lower_irql_raw`] on an already-visited thread state.
#[inline]
fn lower_on(t: &ThreadState, to: Irql) {
    let depth = t.raise_depth.get();
    let current = t.irql.get();
    if depth == 0 || to.raw() > current {
        record(ViolationKind::IrqlLowerWithoutRaise { to });
    } else {
        let top = depth - 1;
        let raised_from = t.raises.get(top).map_or(0, Cell::get);
        if to.raw() < raised_from {
            record(ViolationKind::IrqlLoweredBelowRaise {
                to,
                raised_from: Irql::from_raw(raised_from),
            });
        }
        t.raise_depth.set(top);
    }
    t.irql.set(to.raw());
}

/// Pushes spin lock `id` on the thread's held-lock stack.
#[inline]
fn push_held_on(t: &ThreadState, id: usize) {
    let depth = t.held_depth.get();
    if let Some(slot) = t.held.get(depth) {
        slot.set(id);
    }
    t.held_depth.set(depth.saturating_add(1));
}

/// Pops spin lock `id` off the thread's held-lock stack, recording a
/// release that is not the innermost (or of a lock not held).
#[inline]
fn pop_held_on(t: &ThreadState, id: usize) {
    let depth = t.held_depth.get();
    // The common case: the innermost lock is released (LIFO). An empty
    // stack (`depth - 1` wraps) or one deeper than recorded finds no slot
    // and takes the slow path, which clamps the depth.
    if t.held.get(depth.wrapping_sub(1)).map(Cell::get) == Some(id) {
        t.held_depth.set(depth.wrapping_sub(1));
        return;
    }
    pop_held_out_of_order(t, id, depth);
}

#[cold]
fn pop_held_out_of_order(t: &ThreadState, id: usize, depth: usize) {
    let depth = depth.min(STACK_DEPTH);
    // Deeper than the stack records: its top slot may still be the lock.
    if depth > 0 && t.held.get(depth - 1).map(Cell::get) == Some(id) {
        t.held_depth.set(depth - 1);
        return;
    }
    let position = (0..depth)
        .rev()
        .find(|&i| t.held.get(i).map(Cell::get) == Some(id));
    match position {
        Some(i) => {
            record(ViolationKind::LockReleasedOutOfOrder);
            for j in i..depth.saturating_sub(1) {
                let next = t.held.get(j + 1).map_or(0, Cell::get);
                if let Some(slot) = t.held.get(j) {
                    slot.set(next);
                }
            }
            t.held_depth.set(depth - 1);
        }
        None => record(ViolationKind::LockReleasedOutOfOrder),
    }
}

/// A snapshot of the thread model, to check a routine left it as it found it.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Frame {
    irql: u8,
    raise_depth: usize,
    held_depth: usize,
}

fn frame() -> Frame {
    with_thread(|t| Frame {
        irql: t.irql.get(),
        raise_depth: t.raise_depth.get(),
        held_depth: t.held_depth.get(),
    })
    .unwrap_or(Frame {
        irql: 0,
        raise_depth: 0,
        held_depth: 0,
    })
}

/// Checks that a routine returned with the thread model as it was at entry;
/// records and repairs it otherwise (so one bug is reported once).
fn check_frame(entry: Frame, routine: RoutineKind) {
    let now = frame();
    if now != entry {
        record(ViolationKind::RoutineLeakedState {
            routine,
            irql: Irql::from_raw(now.irql),
            locks_held: now.held_depth.saturating_sub(entry.held_depth),
        });
        let _ = with_thread(|t| {
            t.irql.set(entry.irql);
            t.raise_depth.set(entry.raise_depth);
            t.held_depth.set(entry.held_depth);
        });
    }
}

/// Attaches the current thread to a verifier for a scope.
struct Attach {
    previous: Option<&'static VerifierState>,
}

impl Attach {
    fn new(verifier: &'static VerifierState) -> Self {
        let previous = with_thread(|t| t.verifier.replace(Some(verifier))).flatten();
        Attach { previous }
    }
}

impl Drop for Attach {
    fn drop(&mut self) {
        let _ = with_thread(|t| t.verifier.set(self.previous));
    }
}

// ---------------------------------------------------------------------------
// The global allocator
// ---------------------------------------------------------------------------

static TOTAL_ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

/// A global allocator that records allocations at `DISPATCH_LEVEL` as
/// violations (the "no allocation at DISPATCH" rule, checked). Test binaries
/// install it:
///
/// ```
/// #[global_allocator]
/// static ALLOCATOR: kverbs::platform::host::VerifierAllocator =
///     kverbs::platform::host::VerifierAllocator;
/// # fn main() {}
/// ```
pub struct VerifierAllocator;

impl VerifierAllocator {
    /// Allocations made through this allocator since the process started.
    pub fn total_allocations() -> u64 {
        TOTAL_ALLOCATIONS.load(Ordering::Relaxed)
    }
}

// SAFETY: every method forwards to `System` with the caller's arguments
// unchanged; the bookkeeping around it touches only thread-locals and
// pre-existing statics and never allocates.
unsafe impl GlobalAlloc for VerifierAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        TOTAL_ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        check_may_allocate(layout.size());
        // SAFETY: the caller's `GlobalAlloc::alloc` contract, forwarded.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        TOTAL_ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        check_may_allocate(layout.size());
        // SAFETY: the caller's `GlobalAlloc::alloc_zeroed` contract, forwarded.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // Freeing non-paged pool is legal up to DISPATCH_LEVEL on NT.
        // SAFETY: the caller's `GlobalAlloc::dealloc` contract, forwarded.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        TOTAL_ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        check_may_allocate(new_size);
        // SAFETY: the caller's `GlobalAlloc::realloc` contract, forwarded.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

// ---------------------------------------------------------------------------
// Locks and events
// ---------------------------------------------------------------------------

/// The host `KSPIN_LOCK`: a test-and-test-and-set lock that keeps the
/// thread's IRQL and held-lock stack.
pub struct HostSpinLock {
    locked: AtomicBool,
}

impl HostSpinLock {
    fn id(&self) -> usize {
        core::ptr::from_ref(self).addr()
    }

    /// Takes the lock word (test-and-test-and-set), no bookkeeping. The
    /// uncontended case is one compare-exchange inline; spinning is out of
    /// line, so the callers' fast path carries no spill for it.
    #[inline]
    fn spin_acquire_word(&self) {
        if self
            .locked
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            self.spin_acquire_contended();
        }
    }

    #[cold]
    #[inline(never)]
    fn spin_acquire_contended(&self) {
        loop {
            while self.locked.load(Ordering::Relaxed) {
                std::hint::spin_loop();
                // The holder may be descheduled on a loaded host; let it run.
                thread::yield_now();
            }
            if self
                .locked
                .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                break;
            }
        }
    }

    /// Takes the lock and pushes it on the thread's held-lock stack.
    fn spin_acquire(&self) {
        self.spin_acquire_word();
        let _ = with_thread(|t| push_held_on(t, self.id()));
    }

    /// Pops the lock off the thread's held-lock stack and releases it.
    #[inline]
    fn spin_release(&self) {
        let _ = with_thread(|t| pop_held_on(t, self.id()));
        self.locked.store(false, Ordering::Release);
    }
}

/// The host `KLOCK_QUEUE_HANDLE`: the saved IRQL, and the handle's address at
/// acquisition so a moved handle is caught.
#[derive(Default)]
pub struct HostQueueHandle {
    saved: u8,
    address: usize,
}

// SAFETY: `spin_acquire` gives mutual exclusion with acquire ordering and
// `spin_release` publishes with release ordering; `acquire` raises to
// DISPATCH_LEVEL and `release` lowers to the caller's level.
unsafe impl RawSpinLock for HostSpinLock {
    type QueueHandle = HostQueueHandle;

    fn new() -> Self {
        HostSpinLock {
            locked: AtomicBool::new(false),
        }
    }

    #[inline]
    fn acquire(&self) -> Irql {
        // The raise and the held-lock push in one visit to the thread
        // model (the raise is bookkeeping on the host: whether it is
        // noted before or after the lock word is taken is invisible).
        self.spin_acquire_word();
        with_thread(|t| {
            let old = raise_on(t);
            push_held_on(t, self.id());
            old
        })
        .unwrap_or(Irql::PASSIVE)
    }

    #[inline]
    unsafe fn release(&self, old: Irql) {
        let _ = with_thread(|t| {
            pop_held_on(t, self.id());
            lower_on(t, old);
        });
        self.locked.store(false, Ordering::Release);
    }

    #[inline]
    fn acquire_at_dpc_level(&self) {
        self.spin_acquire_word();
        let _ = with_thread(|t| {
            let at = t.irql.get();
            if at != Irql::DISPATCH.raw() {
                record_wrong_irql_for_lock(at);
            }
            push_held_on(t, self.id());
        });
    }

    #[inline]
    unsafe fn release_from_dpc_level(&self) {
        self.spin_release();
    }

    unsafe fn acquire_in_stack_queued(&self, handle: *mut HostQueueHandle) {
        let old = raise_to_dispatch_raw();
        self.spin_acquire();
        let address = handle.addr();
        // SAFETY: the caller passes a valid, unaliased handle.
        let handle = unsafe { &mut *handle };
        handle.saved = old.raw();
        handle.address = address;
    }

    unsafe fn release_in_stack_queued(&self, handle: *mut HostQueueHandle) {
        let address = handle.addr();
        // SAFETY: the caller passes the handle of the matching acquisition.
        let handle = unsafe { &*handle };
        assert_eq!(
            handle.address, address,
            "KLOCK_QUEUE_HANDLE moved while the lock was held"
        );
        self.spin_release();
        lower_irql_raw(Irql::from_raw(handle.saved));
    }

    unsafe fn acquire_in_stack_queued_at_dpc_level(&self, handle: *mut HostQueueHandle) {
        self.acquire_at_dpc_level();
        let address = handle.addr();
        // SAFETY: the caller passes a valid, unaliased handle.
        let handle = unsafe { &mut *handle };
        handle.address = address;
    }

    unsafe fn release_in_stack_queued_from_dpc_level(&self, handle: *mut HostQueueHandle) {
        let address = handle.addr();
        // SAFETY: the caller passes the handle of the matching acquisition.
        let handle = unsafe { &*handle };
        assert_eq!(
            handle.address, address,
            "KLOCK_QUEUE_HANDLE moved while the lock was held"
        );
        self.spin_release();
    }
}

/// The host `KEVENT`.
pub struct HostEvent {
    kind: EventKind,
    signalled: Mutex<bool>,
    changed: Condvar,
}

impl RawEvent for HostEvent {
    fn new(kind: EventKind, signalled: bool) -> Self {
        HostEvent {
            kind,
            signalled: Mutex::new(signalled),
            changed: Condvar::new(),
        }
    }

    fn set(&self, _irql: &impl LeDispatch) {
        *lock(&self.signalled) = true;
        match self.kind {
            EventKind::Notification => self.changed.notify_all(),
            EventKind::Synchronization => self.changed.notify_one(),
        }
    }

    fn clear(&self, _irql: &impl LeDispatch) {
        *lock(&self.signalled) = false;
    }

    fn wait(&self, _irql: &Passive<'_>) {
        check_may_block(BlockingOp::Wait);
        let mut signalled = lock(&self.signalled);
        while !*signalled {
            signalled = self
                .changed
                .wait(signalled)
                .unwrap_or_else(PoisonError::into_inner);
        }
        if self.kind == EventKind::Synchronization {
            *signalled = false;
        }
    }

    fn wait_timeout(&self, timeout: Duration, _irql: &Passive<'_>) -> bool {
        check_may_block(BlockingOp::Wait);
        let deadline = Instant::now() + timeout;
        let mut signalled = lock(&self.signalled);
        while !*signalled {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            signalled = self
                .changed
                .wait_timeout(signalled, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        if self.kind == EventKind::Synchronization {
            *signalled = false;
        }
        true
    }
}

/// The host `FAST_MUTEX`.
pub struct HostMutex {
    locked: Mutex<bool>,
    released: Condvar,
}

// SAFETY: `lock` returns only after flipping `locked` from false to true
// under the std mutex, and `unlock` flips it back under the same mutex,
// which also provides the memory ordering.
unsafe impl RawMutex for HostMutex {
    fn new() -> Self {
        HostMutex {
            locked: Mutex::new(false),
            released: Condvar::new(),
        }
    }

    fn lock(&self, _irql: &Passive<'_>) {
        check_may_block(BlockingOp::PassiveLock);
        let mut locked = lock(&self.locked);
        while *locked {
            locked = self
                .released
                .wait(locked)
                .unwrap_or_else(PoisonError::into_inner);
        }
        *locked = true;
    }

    unsafe fn unlock(&self) {
        *lock(&self.locked) = false;
        self.released.notify_one();
    }
}

// ---------------------------------------------------------------------------
// The platform
// ---------------------------------------------------------------------------

/// How the host platform runs DPCs, work items and timers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostMode {
    /// On real threads (DPC threads per processor, a worker pool, a timer
    /// thread): concurrency bugs can show.
    Threaded,
    /// Nowhere until the test calls [`HostPlatform::run_one`]: the test picks
    /// the order, so a seeded schedule replays exactly.
    Manual,
}

/// Where a `DpcTarget::Current` DPC queued by a thread that is no DPC
/// thread (a benchmark's submitter, a test, a system worker) runs.
///
/// On NT such a DPC runs on whatever processor the queuing thread is on, so
/// either choice is faithful; they differ only in cost on the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ForeignDpcPlacement {
    /// Processors in turn, asleep or not: about half the DPCs wake a
    /// sleeping DPC thread (a futex wake and its scheduling latency).
    RoundRobin,
    /// The first processor, from the round-robin position, whose DPC thread
    /// is awake (it drains its queue anyway, no wake-up); round robin if all
    /// sleep. Cuts wake-ups and futex calls per I/O (128 KiB read: ~0.9 ->
    /// ~0.7 wake-ups), but piles the foreign DPCs, and so the 128 KiB
    /// copies they lead to, on one DPC thread: on a loaded 2-CPU host the
    /// 128 KiB read was not faster (19 pairs), the 4 KiB read was (9 of 12).
    /// Not the default until that is settled.
    AwakeThread,
}

/// Host platform configuration.
#[derive(Clone, Debug)]
pub struct HostConfig {
    /// Simulated processors (one DPC thread each).
    pub processors: u32,
    /// System worker threads.
    pub worker_threads: u32,
    /// Longest a single DPC routine may run, in its thread's CPU time,
    /// before the verifier records [`ViolationKind::DpcOverBudget`].
    /// Generous by default (debug builds, sanitizers); tests of the budget
    /// lower it.
    pub dpc_budget: Duration,
    /// Threaded or manual scheduling.
    pub mode: HostMode,
    /// Where a non-DPC thread's `DpcTarget::Current` DPC goes.
    pub foreign_dpc_placement: ForeignDpcPlacement,
}

impl Default for HostConfig {
    fn default() -> Self {
        HostConfig {
            processors: 2,
            worker_threads: 2,
            dpc_budget: Duration::from_millis(500),
            mode: HostMode::Threaded,
            foreign_dpc_placement: ForeignDpcPlacement::RoundRobin,
        }
    }
}

struct HostDpcInner {
    routine: DpcRoutine,
    target: DpcTarget,
    queued: AtomicBool,
    shared: Weak<Shared>,
}

struct HostWorkInner {
    routine: WorkRoutine,
    queued: AtomicBool,
    shared: Weak<Shared>,
}

struct HostTimerInner {
    /// Expiry in nanoseconds since the epoch; 0 when disarmed.
    due_ns: AtomicU64,
    dpc: Arc<HostDpcInner>,
    shared: Weak<Shared>,
}

/// A DPC or work-item queue and the threads that sleep on it.
///
/// A push wakes a thread only if one sleeps on the queue and no earlier push
/// has already been owed its wake-up: a condvar notify is a futex syscall
/// even with no waiter (on every DPC queued before, over half the process's
/// futex wakes in a 128 KiB read). A thread says it sleeps under the queue's
/// lock right after finding the queue empty, so a push either sees it
/// counted or happens before that check; no queued routine is left behind.
struct Queue<T> {
    state: Mutex<QueueState<T>>,
    ready: Condvar,
    /// A lock-free copy of `QueueState::sleeping`, read as a hint by
    /// [`queue_dpc`] to find a DPC thread that is awake (never for
    /// correctness: `push` decides on the wake-up under the lock).
    sleepers: AtomicUsize,
}

struct QueueState<T> {
    items: VecDeque<T>,
    /// Threads that went to sleep on `ready` and were not notified since.
    /// Never below the number of threads actually waiting (a spurious
    /// wake-up leaves it high, which only costs a needless notify).
    sleeping: usize,
}

impl<T> Queue<T> {
    fn new() -> Self {
        Queue {
            state: Mutex::new(QueueState {
                items: VecDeque::new(),
                sleeping: 0,
            }),
            ready: Condvar::new(),
            sleepers: AtomicUsize::new(0),
        }
    }

    /// True if every thread of the queue is (as far as a racy read can
    /// tell) asleep and not yet owed a wake-up.
    fn looks_idle(&self) -> bool {
        self.sleepers.load(Ordering::Relaxed) > 0
    }

    /// The queued items (locked).
    fn items(&self) -> MappedItems<'_, T> {
        MappedItems(lock(&self.state))
    }

    /// Makes room for `registered` entries so pushes never allocate.
    fn reserve_for(&self, registered: usize) {
        let mut items = self.items();
        let need = registered.saturating_sub(items.len());
        items.reserve(need);
    }

    /// Queues `item`; wakes one sleeping thread if one is not already woken.
    fn push(&self, item: T) {
        let mut state = lock(&self.state);
        state.items.push_back(item);
        let wake = state.sleeping > 0;
        if wake {
            state.sleeping -= 1;
            self.sleepers.store(state.sleeping, Ordering::Relaxed);
        }
        drop(state);
        if wake {
            self.ready.notify_one();
        }
    }

    /// Takes the next item, sleeping while there is none; `None` once
    /// `stopping` is set and the queue is empty.
    fn pop_or_wait(&self, stopping: &AtomicBool) -> Option<T> {
        let mut state = lock(&self.state);
        loop {
            if let Some(item) = state.items.pop_front() {
                return Some(item);
            }
            if stopping.load(Ordering::Acquire) {
                return None;
            }
            state.sleeping += 1;
            self.sleepers.store(state.sleeping, Ordering::Relaxed);
            state = self
                .ready
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Wakes every sleeping thread (stop).
    fn wake_all(&self) {
        let mut state = lock(&self.state);
        state.sleeping = 0;
        self.sleepers.store(0, Ordering::Relaxed);
        self.ready.notify_all();
    }
}

/// A locked queue, seen as its items.
struct MappedItems<'a, T>(MutexGuard<'a, QueueState<T>>);

impl<T> std::ops::Deref for MappedItems<'_, T> {
    type Target = VecDeque<T>;
    fn deref(&self) -> &VecDeque<T> {
        &self.0.items
    }
}

impl<T> std::ops::DerefMut for MappedItems<'_, T> {
    fn deref_mut(&mut self) -> &mut VecDeque<T> {
        &mut self.0.items
    }
}

struct Shared {
    config: HostConfig,
    verifier: &'static VerifierState,
    dpc_queues: Vec<Queue<Arc<HostDpcInner>>>,
    work_queue: Queue<Arc<HostWorkInner>>,
    timers: Mutex<Vec<Weak<HostTimerInner>>>,
    timer_changed: Condvar,
    registered_dpcs: AtomicUsize,
    registered_work_items: AtomicUsize,
    /// Queued plus running routines.
    pending: AtomicUsize,
    next_processor: AtomicU32,
    stopping: AtomicBool,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// Test switch: [`Platform::fill_random`] fails.
    random_unavailable: AtomicBool,
}

/// The host platform (cheap to clone; all clones share one instance).
#[derive(Clone)]
pub struct HostPlatform {
    shared: Arc<Shared>,
}

impl fmt::Debug for HostPlatform {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostPlatform")
            .field("config", &self.shared.config)
            .finish_non_exhaustive()
    }
}

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn now_ns() -> u64 {
    u64::try_from(epoch().elapsed().as_nanos()).unwrap_or(u64::MAX)
}

impl HostPlatform {
    /// A threaded platform with the default configuration.
    pub fn new() -> Self {
        Self::with_config(HostConfig::default())
    }

    /// A manual-mode platform with the default configuration otherwise:
    /// queued routines run only when the caller steps them (tests and
    /// stepped benchmarks).
    #[must_use]
    pub fn manual() -> Self {
        Self::with_config(HostConfig {
            mode: HostMode::Manual,
            ..HostConfig::default()
        })
    }

    /// A platform with `config`; starts its threads in threaded mode.
    pub fn with_config(config: HostConfig) -> Self {
        let processors = config.processors.max(1);
        let verifier: &'static VerifierState = Box::leak(Box::new(VerifierState::new()));
        let shared = Arc::new(Shared {
            dpc_queues: (0..processors).map(|_| Queue::new()).collect(),
            work_queue: Queue::new(),
            timers: Mutex::new(Vec::new()),
            timer_changed: Condvar::new(),
            registered_dpcs: AtomicUsize::new(0),
            registered_work_items: AtomicUsize::new(0),
            pending: AtomicUsize::new(0),
            next_processor: AtomicU32::new(0),
            stopping: AtomicBool::new(false),
            threads: Mutex::new(Vec::new()),
            random_unavailable: AtomicBool::new(false),
            verifier,
            config: HostConfig {
                processors,
                ..config
            },
        });
        let _ = epoch();
        if shared.config.mode == HostMode::Threaded {
            let mut threads = Vec::new();
            for cpu in 0..processors {
                let s = Arc::clone(&shared);
                threads.push(spawn(format!("kverbs-dpc-{cpu}"), move || {
                    dpc_thread(&s, cpu);
                }));
            }
            for n in 0..shared.config.worker_threads.max(1) {
                let s = Arc::clone(&shared);
                threads.push(spawn(format!("kverbs-worker-{n}"), move || {
                    worker_thread(&s, n);
                }));
            }
            let s = Arc::clone(&shared);
            threads.push(spawn("kverbs-timer".into(), move || timer_thread(&s)));
            *lock(&shared.threads) = threads;
        }
        HostPlatform { shared }
    }

    /// The configuration in force.
    pub fn config(&self) -> &HostConfig {
        &self.shared.config
    }

    /// Makes [`Platform::fill_random`] fail from now on (or work again), so
    /// tests can check that a caller refuses to go on without entropy.
    pub fn set_random_unavailable(&self, unavailable: bool) {
        self.shared
            .random_unavailable
            .store(unavailable, Ordering::Relaxed);
    }

    /// Runs `f` on the current thread at `PASSIVE_LEVEL` with a token,
    /// attached to this platform's verifier.
    ///
    /// # Panics
    ///
    /// If the current thread is not at `PASSIVE_LEVEL` (a test bug).
    pub fn run_passive<R>(&self, f: impl for<'a> FnOnce(&Passive<'a>) -> R) -> R {
        assert_eq!(
            current_irql_raw(),
            Irql::PASSIVE,
            "run_passive above PASSIVE_LEVEL"
        );
        let _attach = Attach::new(self.shared.verifier);
        let entry = frame();
        // SAFETY: checked above: this thread is at PASSIVE_LEVEL, and the
        // thread model keeps it there for the call except inside nested
        // raises (which the verifier checks).
        let token = unsafe { Passive::assume_unchecked() };
        let result = f(&token);
        check_frame(entry, RoutineKind::Scope);
        result
    }

    /// Runs `f` on the current thread raised to `DISPATCH_LEVEL` (as
    /// `KeRaiseIrql` would), attached to this platform's verifier.
    pub fn run_at_dispatch<R>(&self, f: impl for<'a> FnOnce(&Dispatch<'a>) -> R) -> R {
        let _attach = Attach::new(self.shared.verifier);
        let old = raise_to_dispatch_raw();
        let entry = frame();
        // SAFETY: the raise above put the thread model at DISPATCH_LEVEL
        // until the lower below.
        let token = unsafe { Dispatch::assume_unchecked() };
        let result = f(&token);
        check_frame(entry, RoutineKind::Scope);
        lower_irql_raw(old);
        result
    }

    /// Runs `f` as a DPC (on a DPC thread, at `DISPATCH_LEVEL`) and returns
    /// its result; blocks the caller until it has run.
    pub fn run_as_dpc<R: Send + 'static>(
        &self,
        irql: &Passive<'_>,
        f: impl for<'a> FnOnce(&Dispatch<'a>) -> R + Send + 'static,
    ) -> R {
        let slot: OneShot<DispatchOnce<R>, R> = Arc::new(Mutex::new((Some(Box::new(f)), None)));
        let done = Arc::new(HostEvent::new(EventKind::Notification, false));
        let (s, d) = (Arc::clone(&slot), Arc::clone(&done));
        let dpc = self
            .new_dpc(
                Box::new(move |irql: &Dispatch<'_>| {
                    let f = lock(&s).0.take();
                    if let Some(f) = f {
                        let r = f(irql);
                        lock(&s).1 = Some(r);
                        d.set(irql);
                    }
                }),
                DpcTarget::Current,
                irql,
            )
            .unwrap_or_else(|_| panic!("DPC allocation failed"));
        dpc.queue();
        self.wait_for(&done, irql);
        let result = lock(&slot).1.take();
        result.unwrap_or_else(|| panic!("run_as_dpc: the DPC did not produce a result"))
    }

    /// Runs `f` as a work item (on a worker thread, at `PASSIVE_LEVEL`) and
    /// returns its result; blocks the caller until it has run.
    pub fn run_as_work_item<R: Send + 'static>(
        &self,
        irql: &Passive<'_>,
        f: impl for<'a> FnOnce(&Passive<'a>) -> R + Send + 'static,
    ) -> R {
        let slot: OneShot<PassiveOnce<R>, R> = Arc::new(Mutex::new((Some(Box::new(f)), None)));
        let done = Arc::new(HostEvent::new(EventKind::Notification, false));
        let (s, d) = (Arc::clone(&slot), Arc::clone(&done));
        let item = self
            .new_work_item(
                Box::new(move |irql: &Passive<'_>| {
                    let f = lock(&s).0.take();
                    if let Some(f) = f {
                        let r = f(irql);
                        lock(&s).1 = Some(r);
                        d.set(irql);
                    }
                }),
                irql,
            )
            .unwrap_or_else(|_| panic!("work item allocation failed"));
        item.queue(irql);
        self.wait_for(&done, irql);
        let result = lock(&slot).1.take();
        result.unwrap_or_else(|| panic!("run_as_work_item: the work item did not run"))
    }

    /// Waits for `event`; in manual mode runs queued routines meanwhile.
    fn wait_for(&self, event: &HostEvent, irql: &Passive<'_>) {
        match self.shared.config.mode {
            HostMode::Threaded => event.wait(irql),
            HostMode::Manual => {
                while !event.wait_timeout(Duration::ZERO, irql) {
                    if !self.run_one(&mut |_| 0) {
                        panic!("manual mode: waiting for a routine that is not queued");
                    }
                }
            }
        }
    }

    /// Manual mode: runs one queued routine (a DPC from some processor's
    /// queue, a work item, or the DPC of an expired timer), letting `choose`
    /// pick among the `n` runnable candidates (`choose(n)` returns an index
    /// below `n`; out-of-range wraps). Returns `false` if nothing was
    /// runnable. DPCs run in FIFO order per processor, as on NT.
    ///
    /// Must be called from a thread at `PASSIVE_LEVEL` (the routine's level
    /// is set for it).
    pub fn run_one(&self, choose: &mut dyn FnMut(usize) -> usize) -> bool {
        let shared = &self.shared;
        expire_timers(shared);
        let mut candidates: Vec<Candidate> = Vec::new();
        for (cpu, q) in shared.dpc_queues.iter().enumerate() {
            if !q.items().is_empty() {
                candidates.push(Candidate::Dpc(cpu));
            }
        }
        let work = shared.work_queue.items().len();
        let parallel = usize::try_from(shared.config.worker_threads.max(1)).unwrap_or(1);
        for i in 0..work.min(parallel) {
            candidates.push(Candidate::Work(i));
        }
        if candidates.is_empty() {
            return false;
        }
        let pick = choose(candidates.len()) % candidates.len();
        let _attach = Attach::new(shared.verifier);
        match candidates.get(pick) {
            Some(&Candidate::Dpc(cpu)) => {
                let dpc = shared
                    .dpc_queues
                    .get(cpu)
                    .and_then(|q| q.items().pop_front());
                if let Some(dpc) = dpc {
                    let previous = with_thread(|t| t.cpu.replace(u32::try_from(cpu).ok()));
                    let old = raise_to_dispatch_raw();
                    run_dpc(shared, &dpc);
                    lower_irql_raw(old);
                    let _ = with_thread(|t| t.cpu.set(previous.flatten()));
                }
            }
            Some(&Candidate::Work(i)) => {
                let item = shared.work_queue.items().remove(i);
                if let Some(item) = item {
                    run_work_item(shared, &item);
                }
            }
            None => {}
        }
        true
    }

    /// Manual mode: runs queued routines, chosen by `choose`, until none is
    /// runnable or `limit` have run; returns how many ran.
    pub fn run_until_idle(&self, choose: &mut dyn FnMut(usize) -> usize, limit: usize) -> usize {
        let mut ran = 0;
        while ran < limit && self.run_one(choose) {
            ran += 1;
        }
        ran
    }

    /// Queued plus running routines.
    pub fn pending(&self) -> usize {
        self.shared.pending.load(Ordering::Acquire)
    }

    /// Waits (threaded mode) until no routine is queued or running, or
    /// `timeout` passes; `true` if quiet.
    pub fn quiesce(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if self.pending() == 0 {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            thread::sleep(Duration::from_micros(200));
        }
    }

    /// Takes the recorded violations (the log is emptied). In threaded mode
    /// it first waits (up to 30 s) for queued and running routines, so the
    /// checks made when a routine returns (lock state, DPC budget) are in.
    pub fn take_violations(&self) -> Vec<Violation> {
        if self.shared.config.mode == HostMode::Threaded {
            self.quiesce(Duration::from_secs(30));
        }
        self.shared.verifier.take()
    }

    /// Allocations recorded at `DISPATCH_LEVEL` by this instance so far.
    pub fn allocations_at_dispatch(&self) -> usize {
        self.shared
            .verifier
            .allocations_at_dispatch
            .load(Ordering::Relaxed)
    }

    /// Ends a test: waits for queued work (in manual mode, runs it), stops
    /// the threads, and panics listing every violation recorded.
    ///
    /// # Panics
    ///
    /// If a violation was recorded or queued work did not finish in 30 s.
    pub fn finish(self) {
        let quiet = match self.shared.config.mode {
            HostMode::Threaded => self.quiesce(Duration::from_secs(30)),
            HostMode::Manual => {
                self.run_until_idle(&mut |_| 0, 1_000_000);
                self.pending() == 0
            }
        };
        self.stop();
        let violations = self.take_violations();
        assert!(
            violations.is_empty(),
            "the host verifier recorded {} violation(s):\n{}",
            violations.len(),
            violations
                .iter()
                .map(|v| format!("  {v}"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        assert!(quiet, "queued DPCs or work items did not finish");
    }

    /// Stops and joins the platform threads (idempotent).
    pub fn stop(&self) {
        let shared = &self.shared;
        shared.stopping.store(true, Ordering::Release);
        for q in &shared.dpc_queues {
            q.wake_all();
        }
        shared.work_queue.wake_all();
        {
            let _guard = lock(&shared.timers);
            shared.timer_changed.notify_all();
        }
        let threads = std::mem::take(&mut *lock(&shared.threads));
        for t in threads {
            let _ = t.join();
        }
    }
}

impl Default for HostPlatform {
    fn default() -> Self {
        Self::new()
    }
}

/// A closure to run once and the slot for its result.
type OneShot<F, R> = Arc<Mutex<(Option<F>, Option<R>)>>;
/// A boxed closure run once at `DISPATCH_LEVEL`.
type DispatchOnce<R> = Box<dyn for<'a> FnOnce(&Dispatch<'a>) -> R + Send>;
/// A boxed closure run once at `PASSIVE_LEVEL`.
type PassiveOnce<R> = Box<dyn for<'a> FnOnce(&Passive<'a>) -> R + Send>;

enum Candidate {
    Dpc(usize),
    Work(usize),
}

fn spawn(name: String, f: impl FnOnce() + Send + 'static) -> JoinHandle<()> {
    thread::Builder::new()
        .name(name)
        .spawn(f)
        .unwrap_or_else(|e| panic!("cannot start a host platform thread: {e}"))
}

fn run_dpc(shared: &Shared, dpc: &HostDpcInner) {
    dpc.queued.store(false, Ordering::Release);
    let entry = frame();
    // SAFETY: the caller raised the thread model to DISPATCH_LEVEL for the
    // routine's duration.
    let token = unsafe { Dispatch::assume_unchecked() };
    let budget = shared.config.dpc_budget;
    let start = BudgetClock::start(budget);
    (dpc.routine)(&token);
    let over = start.over_budget(budget);
    check_frame(entry, RoutineKind::Dpc);
    if let Some(elapsed) = over {
        record(ViolationKind::DpcOverBudget {
            elapsed_us: u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX),
            budget_us: u64::try_from(budget.as_micros()).unwrap_or(u64::MAX),
        });
    }
    shared.pending.fetch_sub(1, Ordering::AcqRel);
}

thread_local! {
    /// The thread's last CPU-time reading and the wall-clock reading taken
    /// just before it: the baseline [`BudgetClock`] bounds a DPC's CPU time
    /// from.
    static CPU_BASELINE: Cell<Option<(Instant, Duration)>> = const { Cell::new(None) };
}

/// A DPC's budget check without a thread-CPU-clock syscall per DPC.
///
/// The thread CPU clock is a real syscall (not vDSO) on Linux; two per DPC
/// were 2.5 % of a 128 KiB read's CPU samples. The wall clock is vDSO, and
/// a thread's CPU time over an interval never exceeds the interval, so:
///
/// * a DPC whose wall time is within budget is within budget (no syscall);
/// * otherwise its CPU time is at most `now_cpu - baseline_cpu`, where the
///   baseline is a CPU reading taken before the DPC started. Flagging when
///   that bound is over budget never misses a real overrun. The bound also
///   counts the CPU the thread used between the baseline and the DPC's
///   start, at most the wall time between them, which [`BudgetClock::start`]
///   keeps under [`BudgetClock::slack`]: only a DPC already within that
///   slack of its budget can be flagged without being over it.
///
/// The baseline is refreshed (one syscall) when it is older than the slack,
/// and for free after any over-wall-budget DPC.
struct BudgetClock {
    wall: Instant,
}

impl BudgetClock {
    /// How old the CPU baseline may be: 1/16 of the budget.
    fn slack(budget: Duration) -> Duration {
        budget / 16
    }

    /// Called just before a DPC routine runs.
    fn start(budget: Duration) -> Self {
        let wall = Instant::now();
        let fresh = CPU_BASELINE.with(|b| {
            b.get()
                .is_some_and(|(at, _)| wall.saturating_duration_since(at) <= Self::slack(budget))
        });
        if !fresh {
            // Wall first, then CPU: the CPU used since `wall` is at most
            // the wall time since it.
            CPU_BASELINE.with(|b| b.set(Some((wall, thread_cpu_time()))));
        }
        BudgetClock { wall }
    }

    /// Called just after the routine returned: `Some(bound on its CPU
    /// time)` if that may exceed `budget`.
    fn over_budget(self, budget: Duration) -> Option<Duration> {
        let now = Instant::now();
        if now.saturating_duration_since(self.wall) <= budget {
            return None;
        }
        let cpu = thread_cpu_time();
        let base = CPU_BASELINE.with(|b| b.replace(Some((now, cpu))));
        // No baseline cannot happen after `start`; count it as a full
        // overrun rather than miss one.
        let bound = base.map_or(cpu, |(_, base_cpu)| cpu.saturating_sub(base_cpu));
        (bound > budget).then_some(bound)
    }
}

/// CPU time the calling thread has used: what a DPC's budget is measured
/// in (a host thread may be descheduled mid-DPC; an NT DPC is not).
#[cfg(all(unix, not(miri)))]
fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_THREAD_CPUTIME_ID
    // is supported on every Unix this backend runs on. On failure `ts`
    // stays zero, which only makes the check more lenient.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &raw mut ts) };
    if rc != 0 {
        return Duration::ZERO;
    }
    let secs = u64::try_from(ts.tv_sec).unwrap_or(0);
    let nanos = u32::try_from(ts.tv_nsec).unwrap_or(0);
    Duration::new(secs, nanos)
}

/// Elsewhere (and under Miri): wall time since the first call
/// (preemption counts).
#[cfg(not(all(unix, not(miri))))]
fn thread_cpu_time() -> Duration {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed()
}

fn run_work_item(shared: &Shared, item: &HostWorkInner) {
    item.queued.store(false, Ordering::Release);
    let entry = frame();
    // SAFETY: work items run at PASSIVE_LEVEL: the worker thread (or the
    // manual-mode caller) is at PASSIVE_LEVEL here.
    let token = unsafe { Passive::assume_unchecked() };
    (item.routine)(&token);
    check_frame(entry, RoutineKind::WorkItem);
    shared.pending.fetch_sub(1, Ordering::AcqRel);
}

fn dpc_thread(shared: &Arc<Shared>, cpu: u32) {
    let _attach = Attach::new(shared.verifier);
    let _ = with_thread(|t| {
        t.role.set(ThreadRole::Dpc(cpu));
        t.cpu.set(Some(cpu));
    });
    let Some(queue) = shared.dpc_queues.get(cpu as usize) else {
        return;
    };
    loop {
        let dpc = queue.pop_or_wait(&shared.stopping);
        let Some(dpc) = dpc else { return };
        let old = raise_to_dispatch_raw();
        run_dpc(shared, &dpc);
        lower_irql_raw(old);
    }
}

fn worker_thread(shared: &Arc<Shared>, n: u32) {
    let _attach = Attach::new(shared.verifier);
    let _ = with_thread(|t| t.role.set(ThreadRole::Worker(n)));
    loop {
        let item = shared.work_queue.pop_or_wait(&shared.stopping);
        let Some(item) = item else { return };
        run_work_item(shared, &item);
    }
}

/// Queues the DPC of every expired timer; returns the time until the next
/// expiry.
fn expire_timers(shared: &Shared) -> Option<Duration> {
    let now = now_ns();
    let mut next: Option<u64> = None;
    let mut expired = Vec::new();
    {
        let timers = lock(&shared.timers);
        for t in timers.iter().filter_map(Weak::upgrade) {
            let due = t.due_ns.load(Ordering::Acquire);
            if due == 0 {
                continue;
            }
            if due <= now {
                if t.due_ns
                    .compare_exchange(due, 0, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    expired.push(t);
                }
            } else {
                next = Some(next.map_or(due, |n| n.min(due)));
            }
        }
    }
    for t in expired {
        queue_dpc(&t.dpc);
    }
    next.map(|due| Duration::from_nanos(due.saturating_sub(now)))
}

fn timer_thread(shared: &Arc<Shared>) {
    let _attach = Attach::new(shared.verifier);
    let _ = with_thread(|t| t.role.set(ThreadRole::Timer));
    loop {
        if shared.stopping.load(Ordering::Acquire) {
            return;
        }
        let wait = expire_timers(shared).unwrap_or(Duration::from_millis(50));
        let timers = lock(&shared.timers);
        if shared.stopping.load(Ordering::Acquire) {
            return;
        }
        let _ = shared
            .timer_changed
            .wait_timeout(timers, wait.min(Duration::from_millis(50)))
            .unwrap_or_else(PoisonError::into_inner);
    }
}

/// The processor a `DpcTarget::Current` DPC queued by a thread that is not
/// a DPC thread (a test, a worker, the benchmark's submitter) runs on.
///
/// On NT it is whatever processor that thread happens to run on; any
/// choice is faithful. Round robin spreads the DPCs but, when the chosen
/// DPC thread sleeps, costs a futex wake-up and a sleeping thread's
/// scheduling latency (on a VM, an idle vCPU's); a DPC thread that is awake
/// drains its queue anyway. So, with [`ForeignDpcPlacement::AwakeThread`]:
/// the first processor, from the round-robin position, whose DPC thread
/// looks awake; round robin if all sleep. One processor has no choice (the
/// single-processor callgrind bench pays no scan).
fn processor_for_foreign_thread(shared: &Shared, count: u32) -> u32 {
    let start = shared.next_processor.fetch_add(1, Ordering::Relaxed);
    if count <= 1 || shared.config.foreign_dpc_placement == ForeignDpcPlacement::RoundRobin {
        return start;
    }
    (0..count)
        .map(|i| start.wrapping_add(i) % count)
        .find(|&cpu| {
            shared
                .dpc_queues
                .get(cpu as usize)
                .is_some_and(|q| !q.looks_idle())
        })
        .unwrap_or(start)
}

fn queue_dpc(dpc: &Arc<HostDpcInner>) -> bool {
    let Some(shared) = dpc.shared.upgrade() else {
        return false;
    };
    if dpc.queued.swap(true, Ordering::AcqRel) {
        return false;
    }
    let count = u32::try_from(shared.dpc_queues.len()).unwrap_or(1).max(1);
    let cpu = match dpc.target {
        DpcTarget::Processor(n) => n % count,
        DpcTarget::Current => {
            with_thread(|t| t.cpu.get())
                .flatten()
                .unwrap_or_else(|| processor_for_foreign_thread(&shared, count))
                % count
        }
    };
    let Some(queue) = shared.dpc_queues.get(cpu as usize) else {
        dpc.queued.store(false, Ordering::Release);
        return false;
    };
    shared.pending.fetch_add(1, Ordering::AcqRel);
    queue.push(Arc::clone(dpc));
    true
}

/// The host `KDPC`.
pub struct HostDpc {
    inner: Arc<HostDpcInner>,
}

impl RawDpc for HostDpc {
    fn queue(&self) -> bool {
        queue_dpc(&self.inner)
    }

    fn cancel(&self) -> bool {
        let Some(shared) = self.inner.shared.upgrade() else {
            return false;
        };
        for q in &shared.dpc_queues {
            let mut items = q.items();
            if let Some(i) = items.iter().position(|d| Arc::ptr_eq(d, &self.inner)) {
                items.remove(i);
                self.inner.queued.store(false, Ordering::Release);
                shared.pending.fetch_sub(1, Ordering::AcqRel);
                return true;
            }
        }
        false
    }
}

/// The host `IO_WORKITEM`.
pub struct HostWorkItem {
    inner: Arc<HostWorkInner>,
}

impl RawWorkItem for HostWorkItem {
    fn queue(&self, _irql: &impl LeDispatch) -> bool {
        let Some(shared) = self.inner.shared.upgrade() else {
            return false;
        };
        if self.inner.queued.swap(true, Ordering::AcqRel) {
            return false;
        }
        shared.pending.fetch_add(1, Ordering::AcqRel);
        shared.work_queue.push(Arc::clone(&self.inner));
        true
    }
}

/// The host `KTIMER` with its DPC.
pub struct HostTimer {
    inner: Arc<HostTimerInner>,
}

impl RawTimer for HostTimer {
    fn set(&self, due: Duration, _irql: &impl LeDispatch) -> bool {
        let due_ns = now_ns()
            .saturating_add(u64::try_from(due.as_nanos()).unwrap_or(u64::MAX))
            .max(1);
        let was = self.inner.due_ns.swap(due_ns, Ordering::AcqRel);
        if let Some(shared) = self.inner.shared.upgrade() {
            let _guard = lock(&shared.timers);
            shared.timer_changed.notify_all();
        }
        was != 0
    }

    fn cancel(&self, _irql: &impl LeDispatch) -> bool {
        self.inner.due_ns.swap(0, Ordering::AcqRel) != 0
    }
}

impl Drop for HostTimer {
    fn drop(&mut self) {
        self.inner.due_ns.store(0, Ordering::Release);
    }
}

// SAFETY: the thread model reports the real (simulated) level of the calling
// thread; routines get tokens only while their thread is at the level; DPCs
// and work items are queued at most once (`queued` flags) and the queues hold
// `Arc`s to the routine's storage; `alloc_nonpaged` forwards to `System`.
unsafe impl Platform for HostPlatform {
    type SpinLock = HostSpinLock;
    type Event = HostEvent;
    type Mutex = HostMutex;
    type Dpc = HostDpc;
    type WorkItem = HostWorkItem;
    type Timer = HostTimer;

    #[inline]
    fn current_irql() -> Irql {
        current_irql_raw()
    }

    fn now() -> Ticks {
        Ticks(now_ns())
    }

    fn ticks_per_second() -> u64 {
        1_000_000_000
    }

    fn processor_count(&self) -> u32 {
        self.shared.config.processors
    }

    fn stall(&self, d: Duration) {
        let start = Instant::now();
        while start.elapsed() < d {
            std::hint::spin_loop();
        }
    }

    fn delay(&self, d: Duration, _irql: &Passive<'_>) {
        check_may_block(BlockingOp::Sleep);
        thread::sleep(d);
    }

    #[inline]
    unsafe fn raise_to_dispatch() -> Irql {
        raise_to_dispatch_raw()
    }

    #[inline]
    fn write_doorbell(register: &dyn DoorbellRegister, value: u64) {
        as_device(|| register.write64(value));
    }

    #[inline]
    fn enter_at_dispatch() {
        let _ = with_thread(|t| {
            let at = t.irql.get();
            if at != Irql::DISPATCH.raw() {
                record_wrong_irql_for_lock(at);
            }
        });
    }

    #[inline]
    unsafe fn lower_irql(old: Irql) {
        lower_irql_raw(old);
    }

    fn new_dpc(
        &self,
        routine: DpcRoutine,
        target: DpcTarget,
        _irql: &Passive<'_>,
    ) -> Result<HostDpc, AllocError> {
        let registered = self.shared.registered_dpcs.fetch_add(1, Ordering::AcqRel) + 1;
        for q in &self.shared.dpc_queues {
            q.reserve_for(registered);
        }
        Ok(HostDpc {
            inner: Arc::new(HostDpcInner {
                routine,
                target,
                queued: AtomicBool::new(false),
                shared: Arc::downgrade(&self.shared),
            }),
        })
    }

    fn new_work_item(
        &self,
        routine: WorkRoutine,
        _irql: &Passive<'_>,
    ) -> Result<HostWorkItem, AllocError> {
        let registered = self
            .shared
            .registered_work_items
            .fetch_add(1, Ordering::AcqRel)
            + 1;
        self.shared.work_queue.reserve_for(registered);
        Ok(HostWorkItem {
            inner: Arc::new(HostWorkInner {
                routine,
                queued: AtomicBool::new(false),
                shared: Arc::downgrade(&self.shared),
            }),
        })
    }

    fn new_timer(&self, routine: DpcRoutine, irql: &Passive<'_>) -> Result<HostTimer, AllocError> {
        let dpc = self.new_dpc(routine, DpcTarget::Current, irql)?;
        let inner = Arc::new(HostTimerInner {
            due_ns: AtomicU64::new(0),
            dpc: dpc.inner,
            shared: Arc::downgrade(&self.shared),
        });
        let mut timers = lock(&self.shared.timers);
        timers.retain(|t| t.strong_count() > 0);
        timers.push(Arc::downgrade(&inner));
        Ok(HostTimer { inner })
    }

    fn alloc_nonpaged(
        &self,
        layout: Layout,
        _irql: &Passive<'_>,
    ) -> Result<NonNull<u8>, AllocError> {
        check_may_allocate(layout.size());
        if layout.size() == 0 {
            return Ok(NonNull::<u8>::dangling()
                .with_addr(std::num::NonZeroUsize::new(layout.align()).ok_or(AllocError)?));
        }
        // SAFETY: `layout` has a non-zero size (checked above).
        NonNull::new(unsafe { System.alloc(layout) }).ok_or(AllocError)
    }

    unsafe fn free_nonpaged(&self, ptr: NonNull<u8>, layout: Layout) {
        if layout.size() != 0 {
            // SAFETY: the caller passes a pointer from `alloc_nonpaged` with
            // its layout, which came from `System.alloc`.
            unsafe { System.dealloc(ptr.as_ptr(), layout) };
        }
    }

    fn fill_random(&self, buf: &mut [u8], _irql: &Passive<'_>) -> Result<(), RandomUnavailable> {
        if self.shared.random_unavailable.load(Ordering::Relaxed) {
            return Err(RandomUnavailable);
        }
        // getrandom(2) from the kernel's CSPRNG; it may return fewer bytes
        // than asked or be interrupted, so loop until the buffer is full.
        let mut filled = 0;
        while let Some(rest) = buf.get_mut(filled..).filter(|r| !r.is_empty()) {
            // SAFETY: `rest` is a live, writable slice of `rest.len()` bytes.
            let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
            match usize::try_from(n) {
                Ok(0) => return Err(RandomUnavailable),
                Ok(n) => filled += n,
                Err(_)
                    if std::io::Error::last_os_error().kind()
                        == std::io::ErrorKind::Interrupted => {}
                Err(_) => return Err(RandomUnavailable),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manual(processors: u32) -> HostPlatform {
        HostPlatform::with_config(HostConfig {
            processors,
            mode: HostMode::Manual,
            foreign_dpc_placement: ForeignDpcPlacement::AwakeThread,
            ..HostConfig::default()
        })
    }

    /// The held-lock stack through its fast (innermost) and slow pops:
    /// out of order, on an empty stack, and deeper than it records.
    #[test]
    fn held_lock_stack_pops() {
        let t = ThreadState::new();
        for id in [1, 2, 3] {
            push_held_on(&t, id);
        }
        pop_held_on(&t, 3);
        assert_eq!(t.held_depth.get(), 2);
        pop_held_on(&t, 1); // Out of order: 2 moves down.
        assert_eq!(t.held_depth.get(), 1);
        assert_eq!(t.held[0].get(), 2);
        pop_held_on(&t, 2);
        assert_eq!(t.held_depth.get(), 0);
        pop_held_on(&t, 2); // Not held: the depth stays 0.
        assert_eq!(t.held_depth.get(), 0);
        for id in 1..=STACK_DEPTH + 2 {
            push_held_on(&t, id);
        }
        assert_eq!(t.held_depth.get(), STACK_DEPTH + 2);
        // Past the recorded stack: its top slot still matches.
        pop_held_on(&t, STACK_DEPTH);
        assert_eq!(t.held_depth.get(), STACK_DEPTH - 1);
        pop_held_on(&t, STACK_DEPTH - 1);
        assert_eq!(t.held_depth.get(), STACK_DEPTH - 2);
    }

    /// Marks processor `cpu`'s DPC thread asleep (or awake) as
    /// `pop_or_wait` / `push` would.
    fn set_asleep(p: &HostPlatform, cpu: usize, asleep: bool) {
        if let Some(q) = p.shared.dpc_queues.get(cpu) {
            q.sleepers.store(usize::from(asleep), Ordering::Relaxed);
        }
    }

    #[test]
    fn foreign_current_dpc_goes_to_an_awake_dpc_thread() {
        let p = manual(4);
        for cpu in [0, 1, 3] {
            set_asleep(&p, cpu, true);
        }
        let picks: Vec<u32> = (0..8)
            .map(|_| processor_for_foreign_thread(&p.shared, 4) % 4)
            .collect();
        assert_eq!(picks, vec![2; 8]);
    }

    #[test]
    fn foreign_current_dpc_round_robins_when_all_sleep_or_all_wake() {
        let p = manual(3);
        let awake: Vec<u32> = (0..6)
            .map(|_| processor_for_foreign_thread(&p.shared, 3) % 3)
            .collect();
        assert_eq!(awake, vec![0, 1, 2, 0, 1, 2]);
        for cpu in 0..3 {
            set_asleep(&p, cpu, true);
        }
        let asleep: Vec<u32> = (0..3)
            .map(|_| processor_for_foreign_thread(&p.shared, 3) % 3)
            .collect();
        assert_eq!(asleep, vec![0, 1, 2]);
    }

    #[test]
    fn round_robin_placement_ignores_which_dpc_threads_sleep() {
        let p = HostPlatform::with_config(HostConfig {
            processors: 3,
            mode: HostMode::Manual,
            foreign_dpc_placement: ForeignDpcPlacement::RoundRobin,
            ..HostConfig::default()
        });
        for cpu in [0, 2] {
            set_asleep(&p, cpu, true);
        }
        let picks: Vec<u32> = (0..6)
            .map(|_| processor_for_foreign_thread(&p.shared, 3) % 3)
            .collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
    }

    #[test]
    fn push_and_wait_keep_the_sleeper_hint_in_step() {
        let q: Queue<u32> = Queue::new();
        lock(&q.state).sleeping = 2;
        q.sleepers.store(2, Ordering::Relaxed);
        q.push(7);
        assert_eq!(q.sleepers.load(Ordering::Relaxed), 1);
        assert_eq!(lock(&q.state).sleeping, 1);
        assert!(q.looks_idle());
        q.wake_all();
        assert!(!q.looks_idle());
    }
}
