//! A platform for `loom` models (`--cfg loom`): spin locks on loom atomics,
//! and DPCs and work items that run only when a model thread calls
//! [`LoomPlatform::run_dpcs`] / [`LoomPlatform::run_work_items`], so loom
//! explores their interleavings with everything else.
//!
//! It does not track IRQL (the host verifier does that); it exists so the
//! worker queue, the drain loop and run-down run unchanged under loom.

// UNSAFETY: implements the unsafe `Platform`/`RawSpinLock`/`RawMutex`
// contracts; no unsafe blocks.
#![expect(unsafe_code, reason = "platform trait implementations")]

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::VecDeque;
use std::ptr::NonNull;
use std::sync::{Arc, Weak};
use std::time::Duration;

use loom::sync::atomic::{AtomicBool, Ordering};
use loom::sync::{Condvar, Mutex};

use crate::irql::{Dispatch, Irql, LeDispatch, Passive};
use crate::platform::{
    AllocError, DpcRoutine, DpcTarget, EventKind, Platform, RandomUnavailable, RawDpc, RawEvent,
    RawMutex, RawSpinLock, RawTimer, RawWorkItem, Ticks, WorkRoutine,
};

struct Inner {
    dpcs: Mutex<VecDeque<Arc<Routine<DpcRoutine>>>>,
    work: Mutex<VecDeque<Arc<Routine<WorkRoutine>>>>,
}

struct Routine<F> {
    routine: F,
    queued: AtomicBool,
    platform: Weak<Inner>,
}

/// The loom platform (clones share one instance).
#[derive(Clone)]
pub struct LoomPlatform {
    inner: Arc<Inner>,
}

impl LoomPlatform {
    /// A platform with empty queues; create it inside `loom::model`.
    pub fn new() -> Self {
        LoomPlatform {
            inner: Arc::new(Inner {
                dpcs: Mutex::new(VecDeque::new()),
                work: Mutex::new(VecDeque::new()),
            }),
        }
    }

    /// Runs queued DPCs (at "DISPATCH_LEVEL") until none is queued; returns
    /// how many ran.
    pub fn run_dpcs(&self) -> usize {
        let mut ran = 0;
        loop {
            let next = lock(&self.inner.dpcs).pop_front();
            let Some(dpc) = next else { return ran };
            dpc.queued.store(false, Ordering::Release);
            // SAFETY: a DPC routine is entered at DISPATCH_LEVEL; the model
            // stands for that contract.
            let token = unsafe { Dispatch::assume_unchecked() };
            (dpc.routine)(&token);
            ran += 1;
        }
    }

    /// Runs queued work items (at "PASSIVE_LEVEL") until none is queued;
    /// returns how many ran.
    pub fn run_work_items(&self) -> usize {
        let mut ran = 0;
        loop {
            let next = lock(&self.inner.work).pop_front();
            let Some(item) = next else { return ran };
            item.queued.store(false, Ordering::Release);
            // SAFETY: a work item is entered at PASSIVE_LEVEL; the model
            // stands for that contract.
            let token = unsafe { Passive::assume_unchecked() };
            (item.routine)(&token);
            ran += 1;
        }
    }

    /// Runs DPCs and work items until both queues are empty.
    pub fn run_until_idle(&self) {
        while self.run_dpcs() + self.run_work_items() > 0 {}
    }
}

impl Default for LoomPlatform {
    fn default() -> Self {
        Self::new()
    }
}

fn lock<T>(m: &Mutex<T>) -> loom::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The model's `KSPIN_LOCK`: a lock flag under a loom mutex with a condition
/// variable. A real spin loop would make loom explore every spin iteration
/// ("maximum number of branches"); blocking until release is equivalent for
/// exclusion and ordering, and keeps the models small.
pub struct LoomSpinLock {
    locked: Mutex<bool>,
    released: Condvar,
}

impl LoomSpinLock {
    fn spin(&self) {
        let mut locked = lock(&self.locked);
        while *locked {
            locked = self
                .released
                .wait(locked)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        *locked = true;
    }

    fn unlock(&self) {
        *lock(&self.locked) = false;
        self.released.notify_one();
    }
}

// SAFETY: `spin` returns only after flipping the flag from false to true
// under the loom mutex, `unlock` flips it back under it (which also orders
// memory); IRQL is not modelled.
unsafe impl RawSpinLock for LoomSpinLock {
    type QueueHandle = ();

    fn new() -> Self {
        LoomSpinLock {
            locked: Mutex::new(false),
            released: Condvar::new(),
        }
    }

    fn acquire(&self) -> Irql {
        self.spin();
        Irql::PASSIVE
    }

    unsafe fn release(&self, _old: Irql) {
        self.unlock();
    }

    fn acquire_at_dpc_level(&self) {
        self.spin();
    }

    unsafe fn release_from_dpc_level(&self) {
        self.unlock();
    }

    unsafe fn acquire_in_stack_queued(&self, _handle: *mut ()) {
        self.spin();
    }

    unsafe fn release_in_stack_queued(&self, _handle: *mut ()) {
        self.unlock();
    }

    unsafe fn acquire_in_stack_queued_at_dpc_level(&self, _handle: *mut ()) {
        self.spin();
    }

    unsafe fn release_in_stack_queued_from_dpc_level(&self, _handle: *mut ()) {
        self.unlock();
    }
}

/// An event on a loom mutex and condition variable.
pub struct LoomEvent {
    kind: EventKind,
    signalled: Mutex<bool>,
    changed: Condvar,
}

impl RawEvent for LoomEvent {
    fn new(kind: EventKind, signalled: bool) -> Self {
        LoomEvent {
            kind,
            signalled: Mutex::new(signalled),
            changed: Condvar::new(),
        }
    }

    fn set(&self, _irql: &impl LeDispatch) {
        *lock(&self.signalled) = true;
        self.changed.notify_all();
    }

    fn clear(&self, _irql: &impl LeDispatch) {
        *lock(&self.signalled) = false;
    }

    fn wait(&self, _irql: &Passive<'_>) {
        let mut signalled = lock(&self.signalled);
        while !*signalled {
            signalled = self
                .changed
                .wait(signalled)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        if self.kind == EventKind::Synchronization {
            *signalled = false;
        }
    }

    fn wait_timeout(&self, _timeout: Duration, irql: &Passive<'_>) -> bool {
        // Loom has no time: a timed wait is a wait.
        self.wait(irql);
        true
    }
}

/// A blocking mutex (the same lock as [`LoomSpinLock`]).
pub struct LoomMutex {
    lock: LoomSpinLock,
}

// SAFETY: exclusion comes from the underlying spin lock.
unsafe impl RawMutex for LoomMutex {
    fn new() -> Self {
        LoomMutex {
            lock: LoomSpinLock::new(),
        }
    }

    fn lock(&self, _irql: &Passive<'_>) {
        self.lock.spin();
    }

    unsafe fn unlock(&self) {
        self.lock.unlock();
    }
}

/// A DPC whose routine runs from [`LoomPlatform::run_dpcs`].
pub struct LoomDpc {
    inner: Arc<Routine<DpcRoutine>>,
}

impl RawDpc for LoomDpc {
    fn queue(&self) -> bool {
        let Some(platform) = self.inner.platform.upgrade() else {
            return false;
        };
        if self.inner.queued.swap(true, Ordering::AcqRel) {
            return false;
        }
        lock(&platform.dpcs).push_back(Arc::clone(&self.inner));
        true
    }

    fn cancel(&self) -> bool {
        let Some(platform) = self.inner.platform.upgrade() else {
            return false;
        };
        let mut dpcs = lock(&platform.dpcs);
        match dpcs.iter().position(|d| Arc::ptr_eq(d, &self.inner)) {
            Some(i) => {
                dpcs.remove(i);
                self.inner.queued.store(false, Ordering::Release);
                true
            }
            None => false,
        }
    }
}

/// A work item whose routine runs from [`LoomPlatform::run_work_items`].
pub struct LoomWorkItem {
    inner: Arc<Routine<WorkRoutine>>,
}

impl RawWorkItem for LoomWorkItem {
    fn queue(&self, _irql: &impl LeDispatch) -> bool {
        let Some(platform) = self.inner.platform.upgrade() else {
            return false;
        };
        if self.inner.queued.swap(true, Ordering::AcqRel) {
            return false;
        }
        lock(&platform.work).push_back(Arc::clone(&self.inner));
        true
    }
}

/// Timers are not modelled: they never fire.
pub struct LoomTimer;

impl RawTimer for LoomTimer {
    fn set(&self, _due: Duration, _irql: &impl LeDispatch) -> bool {
        false
    }

    fn cancel(&self, _irql: &impl LeDispatch) -> bool {
        false
    }
}

// SAFETY: routines get tokens only from `run_dpcs`/`run_work_items`, which
// stand for the DPC and work-item contracts; each object is queued at most
// once (`queued`) and the queues hold `Arc`s to the routine storage.
unsafe impl Platform for LoomPlatform {
    type SpinLock = LoomSpinLock;
    type Event = LoomEvent;
    type Mutex = LoomMutex;
    type Dpc = LoomDpc;
    type WorkItem = LoomWorkItem;
    type Timer = LoomTimer;

    fn current_irql() -> Irql {
        Irql::PASSIVE
    }

    fn now() -> Ticks {
        Ticks(0)
    }

    fn ticks_per_second() -> u64 {
        1_000_000_000
    }

    fn processor_count(&self) -> u32 {
        1
    }

    fn stall(&self, _d: Duration) {}

    fn delay(&self, _d: Duration, _irql: &Passive<'_>) {
        loom::thread::yield_now();
    }

    unsafe fn raise_to_dispatch() -> Irql {
        Irql::PASSIVE
    }

    unsafe fn lower_irql(_old: Irql) {}

    fn new_dpc(
        &self,
        routine: DpcRoutine,
        _target: DpcTarget,
        _irql: &Passive<'_>,
    ) -> Result<LoomDpc, AllocError> {
        Ok(LoomDpc {
            inner: Arc::new(Routine {
                routine,
                queued: AtomicBool::new(false),
                platform: Arc::downgrade(&self.inner),
            }),
        })
    }

    fn new_work_item(
        &self,
        routine: WorkRoutine,
        _irql: &Passive<'_>,
    ) -> Result<LoomWorkItem, AllocError> {
        Ok(LoomWorkItem {
            inner: Arc::new(Routine {
                routine,
                queued: AtomicBool::new(false),
                platform: Arc::downgrade(&self.inner),
            }),
        })
    }

    fn new_timer(
        &self,
        _routine: DpcRoutine,
        _irql: &Passive<'_>,
    ) -> Result<LoomTimer, AllocError> {
        Ok(LoomTimer)
    }

    fn alloc_nonpaged(
        &self,
        layout: Layout,
        _irql: &Passive<'_>,
    ) -> Result<NonNull<u8>, AllocError> {
        if layout.size() == 0 {
            return Err(AllocError);
        }
        // SAFETY: `layout` has a non-zero size (checked above).
        NonNull::new(unsafe { System.alloc(layout) }).ok_or(AllocError)
    }

    unsafe fn free_nonpaged(&self, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: the caller passes a pointer from `alloc_nonpaged` with its
        // layout.
        unsafe { System.dealloc(ptr.as_ptr(), layout) };
    }

    /// The model has no entropy source, so it reports none rather than
    /// handing out bytes a caller would take for random.
    fn fill_random(&self, _buf: &mut [u8], _irql: &Passive<'_>) -> Result<(), RandomUnavailable> {
        Err(RandomUnavailable)
    }
}
