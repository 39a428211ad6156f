//! The host StorPort model: the tests' "Windows".
//!
//! [`StorPortModel`] calls a [`HwMiniport`] exactly the way StorPort does —
//! `HwFindAdapter` and `HwInitialize` (device IRQL), the passive
//! initialisation routine, `HwBuildIo` without locks, `HwStartIo` under the
//! chosen [`StartIoLocking`], the ExecutionRoutine at `DISPATCH_LEVEL`
//! (inline or from a DPC), `HwResetBus` when a request times out,
//! `HwAdapterControl` with Stop and Restart at device IRQL, the miniport's
//! DPCs and timers, `HwFreeAdapterResources` — and implements the
//! [`StorPort`] services the miniport calls back ([`HostPort`]), with data
//! buffers in simulated physical memory ([`PhysMemory`]) laid out in the
//! scatter/gather shape each request asks for ([`SgShape`]).
//!
//! It checks rather than trusts. Every breach is recorded as a
//! [`ModelViolation`] and fails the test at [`StorPortModel::finish`]:
//!
//! * every request StorPort issued completes **exactly once** (a second
//!   completion, a completion of an unknown request, a dropped handle, a
//!   request never completed);
//! * completions happen at a legal IRQL (<= `DISPATCH_LEVEL`, never inside
//!   a device-IRQL routine), with a real status, with the scatter/gather
//!   list released;
//! * services are called at their documented IRQL; nothing but
//!   [`StorPort::issue_dpc`] from a device-IRQL routine; a device-IRQL
//!   routine that runs longer than its budget (it blocked, or tore down
//!   inline) is flagged, and the kverbs verifier flags any blocking or
//!   allocation at raised IRQL in every callback;
//! * after a bus reset, every request the miniport held (whose StartIo had
//!   returned) completes within the reset grace period;
//! * busy/ready is honoured — requests are held back while the adapter or
//!   a device is busy or paused, `SRB_STATUS_BUSY` requeues the request and
//!   reruns BuildIo/StartIo with the extension's contents lost (poisoned) —
//!   and an adapter that makes no progress for longer than the budget while
//!   requests wait is **busy forever**.
//!
//! # Time
//! StorPort's clock (request timeouts, pauses, the miniport's timers) is
//! virtual: it moves only in [`StorPortModel::advance`], so timeout tests
//! are deterministic. DPCs, the deferred ExecutionRoutine and the queue
//! restart run through the kverbs host platform: on its threads, or — in
//! manual mode — when the test runs them, in the order it picks.
//!
//! # Choices where StorPort's documentation is silent
//! * `StorPortBusy(n)`/`StorPortDeviceBusy(n)`: requests answered
//!   `SRB_STATUS_BUSY` are requeued, not completed, so they do not count
//!   toward `n`; the hold also ends when nothing is outstanding in its scope
//!   ("more than outstanding: until all outstanding have completed").
//! * A request answered `SRB_STATUS_BUSY` is retried on the next event
//!   that may have changed the answer — a real completion, a ready or
//!   resume call, the end of a reset, a tick of StorPort's clock — not at
//!   once (which would spin).
//! * `TimeOutValue` 0 means the request never times out.
//! * A virtual miniport's StartIo trampoline runs BuildIo then StartIo,
//!   as the NT shim does (`crate::nt::miniport::hw_start_io`).

// UNSAFETY: mints the `Dirql` token where the model enters a device-IRQL
// routine; one block, with its argument.
#![deny(unsafe_code)]
#![expect(
    clippy::panic,
    reason = "the model fails a test by panicking in `finish`, as a test assertion does"
)]

mod check;
mod srb;

pub use check::{Checker, ModelViolation, in_device_irql};
pub use srb::{HostSrb, RequestSpec, SgShape};

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, Weak};
use std::time::{Duration, Instant};

use hca_lowlevel::dma::DmaError;
use hca_lowlevel::sim::PhysMemory;
use kverbs::irql::{AnyIrql, Dispatch, Irql, LeDispatch, Passive};
use kverbs::platform::host::{HostDpc, HostPlatform};
use kverbs::platform::{DpcTarget, Platform, RawDpc};
use kverbs::sync::{SpinLock, with_dispatch};

use self::check::DeviceIrqlScope;
use self::srb::{SgState, SrbBody};
use super::{
    AdapterLimits, Address, BuildIo, DataDirection, Dirql, DpcId, FindAdapterError, HwMiniport,
    LogEvent, SgListRefused, SrbStatus, StorPort, SupportedControls, TimerId,
};

/// StorPort's StartIo synchronisation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartIoLocking {
    /// A virtual miniport: StartIo at any IRQL <= `DISPATCH_LEVEL`, no
    /// StorPort lock, many processors at once (and HwResetBus does not wait
    /// for them).
    Virtual,
    /// A physical full-duplex miniport: StartIo at `DISPATCH_LEVEL` under
    /// the StartIo spin lock, which HwResetBus also holds.
    FullDuplex,
    /// Concurrent channels: StartIo at `DISPATCH_LEVEL`, several callers at
    /// once, none during HwResetBus.
    ConcurrentChannels,
}

/// The IRQL a virtual miniport's StartIo runs at when the caller is at
/// `PASSIVE_LEVEL`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartIoIrql {
    /// Raised to `DISPATCH_LEVEL`.
    Dispatch,
    /// Left at `PASSIVE_LEVEL`.
    Passive,
    /// Alternately one and the other.
    Alternate,
}

/// When the ExecutionRoutine runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SgDelivery {
    /// Inside `get_scatter_gather_list`, before it returns.
    Inline,
    /// Later, from a DPC.
    Deferred,
    /// Alternately one and the other.
    Alternate,
}

/// How the model behaves.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    /// StartIo synchronisation.
    pub locking: StartIoLocking,
    /// StartIo's IRQL for a virtual miniport called from `PASSIVE_LEVEL`.
    pub start_io_irql: StartIoIrql,
    /// When the ExecutionRoutine runs.
    pub sg_delivery: SgDelivery,
    /// Requests a model can create over its life.
    pub max_requests: usize,
    /// Simulated physical memory for data buffers, bytes.
    pub memory_limit: usize,
    /// How long after a bus reset the requests the miniport held must be
    /// completed (virtual time; zero: before time moves on).
    pub reset_grace: Duration,
    /// Virtual time without progress, while requests wait, that counts as
    /// busy forever.
    pub busy_forever_budget: Duration,
    /// Wall time a device-IRQL routine may take.
    pub device_irql_budget: Duration,
    /// Requests dispatched per queue-restart DPC run before it requeues
    /// itself (bounds the DPC's duration).
    pub pump_batch: usize,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            locking: StartIoLocking::Virtual,
            start_io_irql: StartIoIrql::Alternate,
            sg_delivery: SgDelivery::Alternate,
            max_requests: 4096,
            memory_limit: 256 << 20,
            reset_grace: Duration::ZERO,
            busy_forever_budget: Duration::from_secs(60),
            device_irql_budget: Duration::from_millis(250),
            pump_batch: 64,
        }
    }
}

/// Why the model could not create a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelError {
    /// `ModelConfig::max_requests` reached.
    TableFull,
    /// Simulated physical memory exhausted.
    Memory(DmaError),
    /// No such request, or it is with the miniport now.
    NotAvailable,
}

/// Where a request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestState {
    /// Created, not issued.
    Created,
    /// In StorPort's queue (new, held back, or requeued after BUSY).
    Queued,
    /// With the miniport.
    InMiniport,
    /// With the port, building its scatter/gather list.
    InSgBuild,
    /// Completed.
    Completed,
    /// The miniport dropped its handle without completing it.
    Dropped,
}

/// How a request ended, as StorPort saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestOutcome {
    /// Where it is.
    pub state: RequestState,
    /// `SrbStatus` at completion.
    pub status: SrbStatus,
    /// `ScsiStatus`.
    pub scsi_status: u8,
    /// `DataTransferLength`.
    pub data_transfer_length: u32,
    /// The valid sense bytes (`SenseInfoBufferLength` of them).
    pub sense: Vec<u8>,
    /// Completions other than BUSY requeues (exactly one when completed).
    pub completions: u32,
    /// Times it came back `SRB_STATUS_BUSY` and was requeued.
    pub busy_requeues: u32,
}

/// Counters of what the model did and was asked.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ModelStats {
    /// Requests handed to the miniport (including reissues).
    pub dispatched: u64,
    /// Requests completed (not counting BUSY requeues).
    pub completed: u64,
    /// BUSY requeues.
    pub busy_requeues: u64,
    /// Bus resets StorPort performed (timeouts, `reset_bus`).
    pub bus_resets: u64,
    /// Requests that timed out.
    pub timeouts: u64,
    /// `StorPortBusy` calls.
    pub adapter_busy_calls: u64,
    /// `StorPortDeviceBusy` calls.
    pub device_busy_calls: u64,
    /// `StorPortDeviceReady` / `StorPortReady` calls.
    pub ready_calls: u64,
    /// `StorPortPause` / `StorPortPauseDevice` calls.
    pub pause_calls: u64,
    /// `StorPortResume` / `StorPortResumeDevice` calls.
    pub resume_calls: u64,
    /// Scatter/gather lists built.
    pub sg_built: u64,
    /// Bus change notifications.
    pub bus_changes: u64,
    /// Log entries.
    pub log_events: u64,
    /// Miniport timer expiries delivered.
    pub timer_calls: u64,
    /// Miniport DPCs issued.
    pub dpc_calls: u64,
}

#[derive(Default)]
struct Counters {
    dispatched: AtomicU64,
    completed: AtomicU64,
    busy_requeues: AtomicU64,
    bus_resets: AtomicU64,
    timeouts: AtomicU64,
    adapter_busy_calls: AtomicU64,
    device_busy_calls: AtomicU64,
    ready_calls: AtomicU64,
    pause_calls: AtomicU64,
    resume_calls: AtomicU64,
    sg_built: AtomicU64,
    bus_changes: AtomicU64,
    log_events: AtomicU64,
    timer_calls: AtomicU64,
    dpc_calls: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

const NS_PER_SEC: u64 = 1_000_000_000;
/// What StorPort leaves in an extension: the core must not rely on it.
const EXTENSION_POISON: u64 = 0xA5A5_A5A5_A5A5_A5A5;
/// Log entries kept.
const LOG_CAPACITY: usize = 256;

fn ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

struct Done {
    status: SrbStatus,
    scsi_status: u8,
    data_transfer_length: u32,
}

struct RecordInner {
    state: RequestState,
    generation: u32,
    body: Option<Box<SrbBody>>,
    device: Option<usize>,
    issued_at: u64,
    /// StartIo (BuildIo + StartIo) for this issue has returned: the
    /// miniport has "received" the request in HwResetBus's sense.
    handed: bool,
    timeout_secs: u32,
    timed_out: bool,
    reset_deadline: Option<u64>,
    completions: u32,
    busy_requeues: u32,
    done: Option<Done>,
}

struct Record {
    inner: Mutex<RecordInner>,
    extension: Box<[AtomicU64]>,
}

/// One scope StorPort can hold back: the adapter or a device.
#[derive(Default, Clone, Copy)]
struct Hold {
    outstanding: u32,
    busy_remaining: Option<u32>,
    paused_until: Option<u64>,
}

impl Hold {
    fn held(&self, now: u64) -> bool {
        self.busy_remaining.is_some() || self.paused_until.is_some_and(|t| t > now)
    }

    fn busy(&mut self, n: u32) {
        self.busy_remaining = if self.outstanding == 0 || n == 0 {
            None
        } else {
            Some(n.min(self.outstanding))
        };
    }

    /// A request in this scope left the miniport; `counts` if it was a
    /// real completion (not a BUSY requeue).
    fn left(&mut self, counts: bool) {
        self.outstanding = self.outstanding.saturating_sub(1);
        if counts {
            self.busy_remaining = self
                .busy_remaining
                .and_then(|n| n.checked_sub(1))
                .filter(|n| *n > 0);
        }
        if self.outstanding == 0 {
            self.busy_remaining = None;
        }
    }
}

struct Queue {
    pending: VecDeque<(u32, Option<usize>)>,
    /// Requests answered `SRB_STATUS_BUSY`, waiting for a reason to retry
    /// (a real completion, ready/resume, StorPort's clock).
    retry: VecDeque<(u32, Option<usize>)>,
    adapter: Hold,
    devices: Vec<Hold>,
    /// Resets (and stops) in progress: nothing is dispatched.
    blocked: u32,
    stopped: bool,
    last_progress: u64,
    stall_reported: bool,
}

struct LogRing {
    entries: Box<[Option<LogEvent>]>,
    next: usize,
}

/// The model's callbacks into the installed miniport, type-erased so the
/// port and the DPCs need not know `M`.
trait MiniportCalls: Send + Sync {
    fn dispatch(&self, srb: HostSrb, irql: AnyIrql<'_, '_>);
    fn execution_routine(&self, srb: HostSrb, irql: &Dispatch<'_>);
    fn dpc(&self, dpc: DpcId, irql: &Dispatch<'_>);
    fn timer(&self, timer: TimerId, irql: &Dispatch<'_>);
    fn reset_bus(&self, path: u8, irql: &Dispatch<'_>) -> bool;
}

struct ModelDpcs {
    restart: HostDpc,
    sg: HostDpc,
    miniport: Vec<HostDpc>,
    timers: Vec<HostDpc>,
}

/// The model's shared state (what [`HostPort`] and [`HostSrb`] reach).
pub struct ModelShared {
    platform: HostPlatform,
    config: ModelConfig,
    memory: Arc<PhysMemory>,
    pub(crate) checker: Checker,
    clock: AtomicU64,
    records: Box<[Record]>,
    next_record: AtomicUsize,
    queue: Mutex<Queue>,
    limits: OnceLock<AdapterLimits>,
    startio_lock: SpinLock<(), HostPlatform>,
    interrupt_lock: SpinLock<(), HostPlatform>,
    in_start_io: AtomicUsize,
    calls: Mutex<Option<Arc<dyn MiniportCalls>>>,
    dpcs: OnceLock<ModelDpcs>,
    sg_pending: Mutex<VecDeque<HostSrb>>,
    sg_refusals: AtomicU64,
    timers_due: Box<[AtomicU64]>,
    alternate: AtomicU64,
    counters: Counters,
    log: Mutex<LogRing>,
    /// Told the index of every request that completes (see
    /// [`StorPortModel::on_complete`]).
    completion_hook: OnceLock<CompletionHook>,
}

/// What [`StorPortModel::on_complete`] installs.
type CompletionHook = Box<dyn Fn(u32) + Send + Sync>;

impl ModelShared {
    pub(crate) fn extension(&self, index: u32) -> Option<&[AtomicU64]> {
        self.records.get(index as usize).map(|r| &*r.extension)
    }

    fn now(&self) -> u64 {
        self.clock.load(Ordering::Acquire)
    }

    fn calls(&self) -> Option<Arc<dyn MiniportCalls>> {
        lock(&self.calls).clone()
    }

    fn kick(&self) {
        if let Some(d) = self.dpcs.get() {
            d.restart.queue();
        }
    }

    /// Something happened that may let BUSY-answered requests through:
    /// requeue them and restart the queue.
    fn wake(&self) {
        {
            let mut q = lock(&self.queue);
            while let Some(entry) = q.retry.pop_front() {
                q.pending.push_back(entry);
            }
        }
        self.kick();
    }

    fn device_index(&self, address: Address) -> Option<usize> {
        let l = self.limits.get()?;
        (address.path < l.buses
            && address.target < l.targets_per_bus
            && address.lun < l.luns_per_target)
            .then(|| {
                (usize::from(address.path) * usize::from(l.targets_per_bus)
                    + usize::from(address.target))
                    * usize::from(l.luns_per_target)
                    + usize::from(address.lun)
            })
    }

    fn alternate(&self) -> bool {
        self.alternate.fetch_add(1, Ordering::Relaxed) % 2 == 1
    }

    /// A handle the miniport dropped: its contents go back to the table.
    pub(crate) fn park_dropped(&self, index: u32, body: Box<SrbBody>) {
        if let Some(record) = self.records.get(index as usize) {
            let mut inner = lock(&record.inner);
            inner.state = RequestState::Dropped;
            inner.body = Some(body);
        }
        let mut q = lock(&self.queue);
        q.adapter.left(false);
    }

    /// Takes the next request that may be dispatched now and hands it out.
    fn next_dispatchable(self: &Arc<Self>) -> Option<HostSrb> {
        let now = self.now();
        let (index, device) = {
            let mut q = lock(&self.queue);
            if q.blocked > 0 || q.stopped || q.adapter.held(now) {
                return None;
            }
            let limits = self.limits.get()?;
            if q.adapter.outstanding >= limits.max_io {
                return None;
            }
            let pos = {
                let q = &*q;
                q.pending.iter().position(|&(_, device)| match device {
                    None => true,
                    Some(d) => q
                        .devices
                        .get(d)
                        .is_none_or(|h| !h.held(now) && h.outstanding < limits.max_io_per_lun),
                })
            }?;
            let (index, device) = q.pending.remove(pos)?;
            q.adapter.outstanding += 1;
            if let Some(h) = device.and_then(|d| q.devices.get_mut(d)) {
                h.outstanding += 1;
            }
            (index, device)
        };
        let _ = device;
        let record = self.records.get(index as usize)?;
        for word in &*record.extension {
            word.store(EXTENSION_POISON, Ordering::Relaxed);
        }
        let mut inner = lock(&record.inner);
        inner.state = RequestState::InMiniport;
        inner.generation = inner.generation.wrapping_add(1);
        inner.issued_at = now;
        inner.handed = false;
        inner.reset_deadline = None;
        inner.timed_out = false;
        let body = inner.body.take();
        let generation = inner.generation;
        drop(inner);
        bump(&self.counters.dispatched);
        Some(HostSrb {
            shared: self.clone(),
            index,
            generation,
            body,
        })
    }

    fn pump_passive(self: &Arc<Self>, irql: &Passive<'_>) {
        let Some(calls) = self.calls() else { return };
        for _ in 0..self.config.pump_batch.max(1) {
            let Some(srb) = self.next_dispatchable() else {
                return;
            };
            let (index, generation) = (srb.index, srb.generation);
            calls.dispatch(srb, AnyIrql::Passive(irql));
            self.handed(index, generation);
        }
        self.kick();
    }

    fn pump_dispatch(self: &Arc<Self>, irql: &Dispatch<'_>) {
        let Some(calls) = self.calls() else { return };
        for _ in 0..self.config.pump_batch.max(1) {
            let Some(srb) = self.next_dispatchable() else {
                return;
            };
            let (index, generation) = (srb.index, srb.generation);
            calls.dispatch(srb, AnyIrql::Dispatch(irql));
            self.handed(index, generation);
        }
        self.kick();
    }

    /// StartIo for this issue of `index` returned.
    fn handed(&self, index: u32, generation: u32) {
        if let Some(record) = self.records.get(index as usize) {
            let mut inner = lock(&record.inner);
            if inner.generation == generation {
                inner.handed = true;
            }
        }
    }

    /// `StorPortNotification(RequestComplete)`, checked.
    fn complete(self: &Arc<Self>, mut srb: HostSrb) {
        let irql = HostPlatform::current_irql();
        let device_irql = in_device_irql();
        if device_irql || irql > Irql::DISPATCH {
            self.checker.record(ModelViolation::CompletionAtBadIrql {
                request: srb.index,
                irql,
                device_irql,
            });
        }
        let index = srb.index;
        let Some(record) = self.records.get(index as usize) else {
            self.checker
                .record(ModelViolation::UnknownRequest { request: index });
            return;
        };
        let Some(mut body) = srb.body.take() else {
            // A handle without contents: a duplicate or a forgery.
            let issued = lock(&record.inner).generation > 0;
            self.checker.record(if issued {
                ModelViolation::DoubleCompletion { request: index }
            } else {
                ModelViolation::UnknownRequest { request: index }
            });
            return;
        };
        let mut inner = lock(&record.inner);
        if inner.generation != srb.generation || inner.state != RequestState::InMiniport {
            self.checker
                .record(ModelViolation::DoubleCompletion { request: index });
            if inner.body.is_none() {
                inner.body = Some(body);
            }
            return;
        }
        if body.sg_state == SgState::Held {
            self.checker
                .record(ModelViolation::SgListNotReleased { request: index });
        }
        if body.srb_status.is_pending() {
            self.checker
                .record(ModelViolation::CompletedPending { request: index });
        }
        body.sg_state = SgState::NotBuilt;
        let busy = body.srb_status.base() == SrbStatus::BUSY;
        let device = inner.device;
        // Either way the miniport has given the request back: a reset's
        // claim on this issue is met.
        inner.reset_deadline = None;
        if busy {
            inner.state = RequestState::Queued;
            inner.busy_requeues += 1;
            body.srb_status = SrbStatus::PENDING;
        } else {
            inner.state = RequestState::Completed;
            inner.completions += 1;
            inner.reset_deadline = None;
            inner.done = Some(Done {
                status: body.srb_status,
                scsi_status: body.scsi_status,
                data_transfer_length: body.data_transfer_length,
            });
        }
        inner.body = Some(body);
        drop(inner);
        {
            let mut q = lock(&self.queue);
            q.adapter.left(!busy);
            if let Some(h) = device.and_then(|d| q.devices.get_mut(d)) {
                h.left(!busy);
            }
            if busy {
                q.retry.push_back((index, device));
            } else {
                q.last_progress = self.now();
                q.stall_reported = false;
            }
        }
        if busy {
            bump(&self.counters.busy_requeues);
            self.kick();
        } else {
            bump(&self.counters.completed);
            self.wake();
            if let Some(hook) = self.completion_hook.get() {
                hook(index);
            }
        }
    }

    /// Delivers deferred ExecutionRoutines (the scatter/gather DPC).
    fn deliver_sg(self: &Arc<Self>, irql: &Dispatch<'_>) {
        let Some(calls) = self.calls() else { return };
        loop {
            let next = lock(&self.sg_pending).pop_front();
            let Some(srb) = next else { return };
            self.sg_ready(&srb);
            calls.execution_routine(srb, irql);
        }
    }

    fn sg_ready(&self, srb: &HostSrb) {
        if let Some(record) = self.records.get(srb.index as usize) {
            let mut inner = lock(&record.inner);
            if inner.generation == srb.generation && inner.state == RequestState::InSgBuild {
                inner.state = RequestState::InMiniport;
            }
        }
    }

    fn with_hold(&self, address: Option<Address>, f: impl FnOnce(&mut Hold, u64)) -> bool {
        let now = self.now();
        let mut q = lock(&self.queue);
        match address {
            None => {
                f(&mut q.adapter, now);
                true
            }
            Some(a) => match self.device_index(a).and_then(|d| q.devices.get_mut(d)) {
                Some(h) => {
                    f(h, now);
                    true
                }
                None => false,
            },
        }
    }

    /// Runs `f` as a routine StorPort calls at device IRQL: raised, with
    /// the interrupt lock held, inside the device-IRQL context, timed.
    fn at_device_irql<R>(
        &self,
        routine: &'static str,
        irql: &Passive<'_>,
        f: impl FnOnce(&Dirql<'_>) -> R,
    ) -> R {
        with_dispatch::<HostPlatform, _, _>(irql, |d| {
            let _interrupt_lock = self.interrupt_lock.lock_at_dpc_level(d);
            let _scope = DeviceIrqlScope::enter();
            let start = Instant::now();
            #[expect(unsafe_code, reason = "minting the device-IRQL token")]
            // SAFETY: the thread is raised and inside the model's
            // device-IRQL scope for the token's lifetime (this closure).
            let token = unsafe { Dirql::assume() };
            let result = f(&token);
            let elapsed = start.elapsed();
            if elapsed > self.config.device_irql_budget {
                self.checker.record(ModelViolation::DeviceIrqlOverBudget {
                    routine,
                    elapsed_us: u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX),
                });
            }
            result
        })
    }

    /// StorPort's bus reset: hold the queues, note what the miniport holds,
    /// call HwResetBus (under the StartIo lock where there is one).
    fn reset_bus(self: &Arc<Self>, irql: &Passive<'_>) {
        let Some(calls) = self.calls() else { return };
        lock(&self.queue).blocked += 1;
        let now = self.now();
        let deadline = now.saturating_add(ns(self.config.reset_grace));
        for record in &*self.records {
            let mut inner = lock(&record.inner);
            // Requests whose StartIo is still running (a virtual miniport's
            // StartIo is not excluded from a reset) are not yet received.
            if inner.handed
                && matches!(
                    inner.state,
                    RequestState::InMiniport | RequestState::InSgBuild
                )
            {
                inner.reset_deadline = Some(deadline);
            }
        }
        bump(&self.counters.bus_resets);
        with_dispatch::<HostPlatform, _, _>(irql, |d| match self.config.locking {
            StartIoLocking::Virtual => {
                calls.reset_bus(0, d);
            }
            StartIoLocking::FullDuplex => {
                let guard = self.startio_lock.lock(d);
                calls.reset_bus(0, guard.irql());
            }
            StartIoLocking::ConcurrentChannels => {
                while self.in_start_io.load(Ordering::Acquire) > 0 {
                    std::hint::spin_loop();
                }
                calls.reset_bus(0, d);
            }
        });
        lock(&self.queue).blocked -= 1;
        self.wake();
    }
}

/// The model's [`StorPort`]: what the miniport holds of its port.
#[derive(Clone)]
pub struct HostPort {
    shared: Weak<ModelShared>,
    platform: HostPlatform,
    checker: Checker,
}

impl core::fmt::Debug for HostPort {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("HostPort")
    }
}

impl HostPort {
    fn shared(&self) -> Option<Arc<ModelShared>> {
        self.shared.upgrade()
    }

    fn service(&self, what: &'static str) -> Option<Arc<ModelShared>> {
        self.checker.require_irql(what, Irql::DISPATCH);
        self.shared()
    }

    /// A handle for request `index` that StorPort never gave out, for
    /// negative tests of the model.
    #[must_use]
    pub fn forged_srb(&self, index: u32) -> Option<HostSrb> {
        Some(HostSrb {
            shared: self.shared()?,
            index,
            generation: 0,
            body: None,
        })
    }
}

impl StorPort for HostPort {
    type Platform = HostPlatform;
    type Srb = HostSrb;

    fn platform(&self) -> &HostPlatform {
        &self.platform
    }

    fn complete_request(&self, srb: HostSrb, _irql: &impl LeDispatch) {
        let shared = srb.shared.clone();
        shared.complete(srb);
    }

    fn busy(&self, requests_to_complete: u32, _irql: &impl LeDispatch) -> bool {
        let Some(s) = self.service("StorPortBusy") else {
            return false;
        };
        bump(&s.counters.adapter_busy_calls);
        s.with_hold(None, |h, _| h.busy(requests_to_complete))
    }

    fn ready(&self, _irql: &impl LeDispatch) -> bool {
        let Some(s) = self.service("StorPortReady") else {
            return false;
        };
        bump(&s.counters.ready_calls);
        let ok = s.with_hold(None, |h, _| h.busy_remaining = None);
        s.wake();
        ok
    }

    fn device_busy(
        &self,
        address: Address,
        requests_to_complete: u32,
        _irql: &impl LeDispatch,
    ) -> bool {
        let Some(s) = self.service("StorPortDeviceBusy") else {
            return false;
        };
        bump(&s.counters.device_busy_calls);
        s.with_hold(Some(address), |h, _| h.busy(requests_to_complete))
    }

    fn device_ready(&self, address: Address, _irql: &impl LeDispatch) -> bool {
        let Some(s) = self.service("StorPortDeviceReady") else {
            return false;
        };
        bump(&s.counters.ready_calls);
        let ok = s.with_hold(Some(address), |h, _| h.busy_remaining = None);
        s.wake();
        ok
    }

    fn pause(&self, timeout_secs: u32, _irql: &impl LeDispatch) -> bool {
        let Some(s) = self.service("StorPortPause") else {
            return false;
        };
        bump(&s.counters.pause_calls);
        s.with_hold(None, |h, now| {
            h.paused_until = Some(now.saturating_add(u64::from(timeout_secs) * NS_PER_SEC));
        })
    }

    fn resume(&self, _irql: &impl LeDispatch) -> bool {
        let Some(s) = self.service("StorPortResume") else {
            return false;
        };
        bump(&s.counters.resume_calls);
        let ok = s.with_hold(None, |h, _| h.paused_until = None);
        s.wake();
        ok
    }

    fn pause_device(&self, address: Address, timeout_secs: u32, _irql: &impl LeDispatch) -> bool {
        let Some(s) = self.service("StorPortPauseDevice") else {
            return false;
        };
        bump(&s.counters.pause_calls);
        s.with_hold(Some(address), |h, now| {
            h.paused_until = Some(now.saturating_add(u64::from(timeout_secs) * NS_PER_SEC));
        })
    }

    fn resume_device(&self, address: Address, _irql: &impl LeDispatch) -> bool {
        let Some(s) = self.service("StorPortResumeDevice") else {
            return false;
        };
        bump(&s.counters.resume_calls);
        let ok = s.with_hold(Some(address), |h, _| h.paused_until = None);
        s.wake();
        ok
    }

    fn get_scatter_gather_list(
        &self,
        mut srb: HostSrb,
        irql: &Dispatch<'_>,
    ) -> Result<(), SgListRefused<HostSrb>> {
        self.checker.require_dispatch("GetScatterGatherList");
        let shared = srb.shared.clone();
        let refuse = shared
            .sg_refusals
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok();
        let Some(body) = srb.body.as_mut() else {
            return Err(SgListRefused { srb });
        };
        if refuse || body.sg_state != SgState::NotBuilt {
            return Err(SgListRefused { srb });
        }
        body.sg_state = SgState::Held;
        bump(&shared.counters.sg_built);
        if let Some(record) = shared.records.get(srb.index as usize) {
            let mut inner = lock(&record.inner);
            if inner.generation == srb.generation && inner.state == RequestState::InMiniport {
                inner.state = RequestState::InSgBuild;
            }
        }
        let inline = match shared.config.sg_delivery {
            SgDelivery::Inline => true,
            SgDelivery::Deferred => false,
            SgDelivery::Alternate => shared.alternate(),
        };
        if inline {
            shared.sg_ready(&srb);
            match shared.calls() {
                Some(calls) => calls.execution_routine(srb, irql),
                None => drop(srb),
            }
        } else {
            lock(&shared.sg_pending).push_back(srb);
            if let Some(d) = shared.dpcs.get() {
                d.sg.queue();
            }
        }
        Ok(())
    }

    fn put_scatter_gather_list(&self, srb: &mut HostSrb, _irql: &Dispatch<'_>) {
        self.checker.require_dispatch("PutScatterGatherList");
        if let Some(body) = srb.body.as_mut() {
            if body.sg_state == SgState::Held {
                body.sg_state = SgState::Released;
            }
        }
    }

    fn request_timer(&self, timer: TimerId, due: Duration, _irql: &impl LeDispatch) -> bool {
        let Some(s) = self.service("StorPortRequestTimer") else {
            return false;
        };
        let Some(slot) = s.timers_due.get(usize::from(timer.0)) else {
            return false;
        };
        slot.store(s.now().saturating_add(ns(due)).max(1), Ordering::Release);
        true
    }

    fn cancel_timer(&self, timer: TimerId, _irql: &impl LeDispatch) -> bool {
        let Some(s) = self.service("StorPortRequestTimer(cancel)") else {
            return false;
        };
        s.timers_due
            .get(usize::from(timer.0))
            .is_some_and(|t| t.swap(0, Ordering::AcqRel) != 0)
    }

    fn issue_dpc(&self, dpc: DpcId) -> bool {
        // Allowed at any IRQL, device IRQL included.
        let Some(s) = self.shared() else {
            return false;
        };
        bump(&s.counters.dpc_calls);
        s.dpcs
            .get()
            .and_then(|d| d.miniport.get(usize::from(dpc.0)))
            .is_some_and(RawDpc::queue)
    }

    fn log(&self, event: LogEvent, _irql: &impl LeDispatch) {
        let Some(s) = self.service("StorPortLogError") else {
            return;
        };
        bump(&s.counters.log_events);
        let mut ring = lock(&s.log);
        let len = ring.entries.len();
        let next = ring.next;
        if let Some(slot) = ring.entries.get_mut(next % len.max(1)) {
            *slot = Some(event);
        }
        ring.next = next.wrapping_add(1);
    }

    fn notify_bus_change(&self, _path: u8, _irql: &impl LeDispatch) -> bool {
        let Some(s) = self.service("StorPortNotification(BusChangeDetected)") else {
            return false;
        };
        bump(&s.counters.bus_changes);
        true
    }
}

/// The miniport, installed in the model.
struct Installed<M> {
    miniport: M,
    shared: Weak<ModelShared>,
}

impl<M: HwMiniport<HostPort>> Installed<M> {
    fn build_and_start<I: LeDispatch>(&self, mut srb: HostSrb, irql: &I) {
        match self.miniport.build_io(&mut srb, irql) {
            BuildIo::Proceed => self.miniport.start_io(srb, irql),
            BuildIo::Complete => {
                let shared = srb.shared.clone();
                shared.complete(srb);
            }
        }
    }

    /// Physical modes: BuildIo at `DISPATCH_LEVEL` without locks, then
    /// StartIo (under the StartIo lock for full duplex).
    fn physical(&self, mut srb: HostSrb, shared: &ModelShared, irql: &Dispatch<'_>) {
        if self.miniport.build_io(&mut srb, irql) == BuildIo::Complete {
            let shared = srb.shared.clone();
            shared.complete(srb);
            return;
        }
        if shared.config.locking == StartIoLocking::FullDuplex {
            let guard = shared.startio_lock.lock(irql);
            self.miniport.start_io(srb, guard.irql());
        } else {
            self.miniport.start_io(srb, irql);
        }
    }
}

impl<M: HwMiniport<HostPort>> MiniportCalls for Installed<M> {
    fn dispatch(&self, srb: HostSrb, irql: AnyIrql<'_, '_>) {
        let Some(shared) = self.shared.upgrade() else {
            return;
        };
        shared.in_start_io.fetch_add(1, Ordering::AcqRel);
        match (shared.config.locking, irql) {
            (StartIoLocking::Virtual, AnyIrql::Passive(p)) => {
                let passive = match shared.config.start_io_irql {
                    StartIoIrql::Passive => true,
                    StartIoIrql::Dispatch => false,
                    StartIoIrql::Alternate => shared.alternate(),
                };
                if passive {
                    self.build_and_start(srb, p);
                } else {
                    with_dispatch::<HostPlatform, _, _>(p, |d| self.build_and_start(srb, d));
                }
            }
            (StartIoLocking::Virtual, AnyIrql::Dispatch(d)) => self.build_and_start(srb, d),
            (_, AnyIrql::Passive(p)) => {
                with_dispatch::<HostPlatform, _, _>(p, |d| self.physical(srb, &shared, d));
            }
            (_, AnyIrql::Dispatch(d)) => self.physical(srb, &shared, d),
        }
        shared.in_start_io.fetch_sub(1, Ordering::AcqRel);
    }

    fn execution_routine(&self, srb: HostSrb, irql: &Dispatch<'_>) {
        self.miniport.execution_routine(srb, irql);
    }

    fn dpc(&self, dpc: DpcId, irql: &Dispatch<'_>) {
        self.miniport.dpc(dpc, irql);
    }

    fn timer(&self, timer: TimerId, irql: &Dispatch<'_>) {
        self.miniport.timer(timer, irql);
    }

    fn reset_bus(&self, path: u8, irql: &Dispatch<'_>) -> bool {
        self.miniport.reset_bus(path, irql)
    }
}

/// StorPort, modelled, with one miniport `M` on one adapter.
pub struct StorPortModel<M: HwMiniport<HostPort>> {
    shared: Arc<ModelShared>,
    installed: Option<Arc<Installed<M>>>,
    freed: AtomicBool,
}

impl<M: HwMiniport<HostPort>> core::fmt::Debug for StorPortModel<M> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("StorPortModel")
            .field("config", &self.shared.config)
            .finish_non_exhaustive()
    }
}

fn make_dpc(
    platform: &HostPlatform,
    weak: &Weak<ModelShared>,
    irql: &Passive<'_>,
    f: impl Fn(&Arc<ModelShared>, &Dispatch<'_>) + Send + Sync + 'static,
) -> HostDpc {
    let weak = weak.clone();
    let routine = Box::new(move |d: &Dispatch<'_>| {
        if let Some(shared) = weak.upgrade() {
            f(&shared, d);
        }
    });
    match platform.new_dpc(routine, DpcTarget::Current, irql) {
        Ok(dpc) => dpc,
        Err(_) => panic!("the host platform could not create a DPC"),
    }
}

impl<M: HwMiniport<HostPort>> StorPortModel<M> {
    /// A model on `platform`, before `HwFindAdapter`.
    ///
    /// # IRQL
    /// `PASSIVE_LEVEL` (it allocates the request table and its DPCs).
    #[must_use]
    pub fn new(platform: &HostPlatform, config: ModelConfig, irql: &Passive<'_>) -> Self {
        let memory = PhysMemory::new(config.memory_limit);
        Self::with_memory(platform, config, memory, irql)
    }

    /// A model whose data buffers live in `memory` — for a transport that
    /// moves data by DMA, the memory its (software) HCA reaches, as the
    /// host's physical memory is on Windows. `config.memory_limit` is
    /// ignored (the memory has its own).
    ///
    /// # IRQL
    /// `PASSIVE_LEVEL`.
    #[must_use]
    pub fn with_memory(
        platform: &HostPlatform,
        config: ModelConfig,
        memory: Arc<PhysMemory>,
        irql: &Passive<'_>,
    ) -> Self {
        let capacity = config.max_requests.max(1);
        let words = M::SRB_EXTENSION_WORDS;
        let shared = Arc::new_cyclic(|weak: &Weak<ModelShared>| {
            let dpcs = ModelDpcs {
                restart: make_dpc(platform, weak, irql, |s, d| s.pump_dispatch(d)),
                sg: make_dpc(platform, weak, irql, |s, d| s.deliver_sg(d)),
                miniport: (0..M::DPC_COUNT)
                    .map(|i| {
                        make_dpc(platform, weak, irql, move |s, d| {
                            if let Some(calls) = s.calls() {
                                calls.dpc(DpcId(i), d);
                            }
                        })
                    })
                    .collect(),
                timers: (0..M::TIMER_COUNT)
                    .map(|i| {
                        make_dpc(platform, weak, irql, move |s, d| {
                            if let Some(calls) = s.calls() {
                                bump(&s.counters.timer_calls);
                                calls.timer(TimerId(i), d);
                            }
                        })
                    })
                    .collect(),
            };
            let dpc_cell = OnceLock::new();
            let _ = dpc_cell.set(dpcs);
            ModelShared {
                platform: platform.clone(),
                memory,
                checker: Checker::new(),
                clock: AtomicU64::new(0),
                records: (0..capacity)
                    .map(|_| Record {
                        inner: Mutex::new(RecordInner {
                            state: RequestState::Created,
                            generation: 0,
                            body: None,
                            device: None,
                            issued_at: 0,
                            handed: false,
                            timeout_secs: 0,
                            timed_out: false,
                            reset_deadline: None,
                            completions: 0,
                            busy_requeues: 0,
                            done: None,
                        }),
                        extension: (0..words)
                            .map(|_| AtomicU64::new(EXTENSION_POISON))
                            .collect(),
                    })
                    .collect(),
                next_record: AtomicUsize::new(0),
                queue: Mutex::new(Queue {
                    pending: VecDeque::with_capacity(capacity),
                    retry: VecDeque::with_capacity(capacity),
                    adapter: Hold::default(),
                    devices: Vec::new(),
                    blocked: 0,
                    stopped: false,
                    last_progress: 0,
                    stall_reported: false,
                }),
                limits: OnceLock::new(),
                startio_lock: SpinLock::new(()),
                interrupt_lock: SpinLock::new(()),
                in_start_io: AtomicUsize::new(0),
                calls: Mutex::new(None),
                dpcs: dpc_cell,
                sg_pending: Mutex::new(VecDeque::with_capacity(capacity)),
                sg_refusals: AtomicU64::new(0),
                timers_due: (0..M::TIMER_COUNT).map(|_| AtomicU64::new(0)).collect(),
                alternate: AtomicU64::new(0),
                counters: Counters::default(),
                log: Mutex::new(LogRing {
                    entries: vec![None; LOG_CAPACITY].into_boxed_slice(),
                    next: 0,
                }),
                completion_hook: OnceLock::new(),
                config,
            }
        });
        Self {
            shared,
            installed: None,
            freed: AtomicBool::new(false),
        }
    }

    /// The simulated physical memory data buffers live in (for transports
    /// that move data by physical address, as an HCA does).
    #[must_use]
    pub fn memory(&self) -> Arc<PhysMemory> {
        self.shared.memory.clone()
    }

    /// The model's violation log (for transports under test to report
    /// their entry points' IRQL through [`Checker::require_irql`]).
    #[must_use]
    pub fn checker(&self) -> Checker {
        self.shared.checker
    }

    /// The platform the model runs on.
    #[must_use]
    pub fn platform(&self) -> &HostPlatform {
        &self.shared.platform
    }

    /// The installed miniport.
    ///
    /// # Panics
    /// Before a successful [`Self::find_adapter`].
    #[must_use]
    pub fn miniport(&self) -> &M {
        match &self.installed {
            Some(i) => &i.miniport,
            None => panic!("no adapter: call find_adapter first"),
        }
    }

    /// `HwFindAdapter` with `context` (StorPort's `HwContext`) and
    /// `argument` (the `DriverParameter` string).
    ///
    /// # Errors
    /// What the miniport's `find_adapter` returned.
    ///
    /// # IRQL
    /// `PASSIVE_LEVEL`.
    pub fn find_adapter(
        &mut self,
        context: &M::Context,
        argument: Option<&[u8]>,
        irql: &Passive<'_>,
    ) -> Result<AdapterLimits, FindAdapterError> {
        let port = HostPort {
            shared: Arc::downgrade(&self.shared),
            platform: self.shared.platform.clone(),
            checker: self.shared.checker,
        };
        let (miniport, limits) = M::find_adapter(port, context, argument, irql)?;
        if limits.buses == 0
            || limits.targets_per_bus == 0
            || limits.luns_per_target == 0
            || limits.max_io == 0
            || limits.max_io_per_lun == 0
        {
            self.shared
                .checker
                .record(ModelViolation::BadCallbackResult {
                    routine: "HwFindAdapter",
                });
        }
        let devices = usize::from(limits.buses)
            * usize::from(limits.targets_per_bus)
            * usize::from(limits.luns_per_target);
        lock(&self.shared.queue).devices = vec![Hold::default(); devices];
        let _ = self.shared.limits.set(limits);
        let installed = Arc::new(Installed {
            miniport,
            shared: Arc::downgrade(&self.shared),
        });
        let calls: Arc<dyn MiniportCalls> = installed.clone();
        *lock(&self.shared.calls) = Some(calls);
        self.installed = Some(installed);
        Ok(limits)
    }

    /// `HwInitialize` (device IRQL), then the passive initialisation
    /// routine; `false` if either failed.
    ///
    /// # IRQL
    /// `PASSIVE_LEVEL`.
    pub fn initialize(&self, irql: &Passive<'_>) -> bool {
        let Some(installed) = &self.installed else {
            return false;
        };
        let ok = self
            .shared
            .at_device_irql("HwInitialize", irql, |d| installed.miniport.initialize(d));
        ok && installed.miniport.passive_initialize(irql)
    }

    /// `find_adapter` and `initialize` in one.
    ///
    /// # Errors
    /// [`FindAdapterError`]; `BadConfig` if initialisation failed.
    ///
    /// # IRQL
    /// `PASSIVE_LEVEL`.
    pub fn start(
        &mut self,
        context: &M::Context,
        irql: &Passive<'_>,
    ) -> Result<AdapterLimits, FindAdapterError> {
        let limits = self.find_adapter(context, None, irql)?;
        if self.initialize(irql) {
            Ok(limits)
        } else {
            Err(FindAdapterError::BadConfig)
        }
    }

    /// Creates a request (allocating its buffers); it is not issued yet.
    ///
    /// # Errors
    /// [`ModelError::TableFull`], [`ModelError::Memory`].
    ///
    /// # IRQL
    /// `PASSIVE_LEVEL`.
    pub fn create(&self, spec: &RequestSpec, _irql: &Passive<'_>) -> Result<u32, ModelError> {
        let s = &self.shared;
        let index = s.next_record.fetch_add(1, Ordering::AcqRel);
        let record = s.records.get(index).ok_or(ModelError::TableFull)?;
        let body = SrbBody::new(spec, &s.memory).map_err(ModelError::Memory)?;
        let mut inner = lock(&record.inner);
        inner.state = RequestState::Created;
        inner.device = s.device_index(spec.address);
        inner.timeout_secs = spec.timeout_secs;
        inner.body = Some(Box::new(body));
        u32::try_from(index).map_err(|_| ModelError::TableFull)
    }

    /// Puts a created request in StorPort's queue and restarts the queue
    /// (from its DPC).
    ///
    /// # Errors
    /// [`ModelError::NotAvailable`] if it is not a created request.
    pub fn issue(&self, request: u32) -> Result<(), ModelError> {
        let s = &self.shared;
        let record = s
            .records
            .get(request as usize)
            .ok_or(ModelError::NotAvailable)?;
        let device = {
            let mut inner = lock(&record.inner);
            if inner.state != RequestState::Created || inner.body.is_none() {
                return Err(ModelError::NotAvailable);
            }
            inner.state = RequestState::Queued;
            inner.device
        };
        lock(&s.queue).pending.push_back((request, device));
        s.kick();
        Ok(())
    }

    /// Dispatches what StorPort may dispatch now, on the calling thread
    /// (as an I/O request arriving in StorPort's dispatch routine does).
    ///
    /// # IRQL
    /// `PASSIVE_LEVEL`.
    pub fn pump(&self, irql: &Passive<'_>) {
        self.shared.pump_passive(irql);
    }

    /// Creates, issues and pumps a request.
    ///
    /// # Errors
    /// As [`Self::create`].
    ///
    /// # IRQL
    /// `PASSIVE_LEVEL`.
    pub fn submit(&self, spec: &RequestSpec, irql: &Passive<'_>) -> Result<u32, ModelError> {
        let id = self.create(spec, irql)?;
        self.issue(id)?;
        self.pump(irql);
        Ok(id)
    }

    /// Issues a completed request again — its data buffer (same size,
    /// same physical layout) to `address` with a new CDB and direction,
    /// after writing
    /// `data` (if given) at the start of the buffer. A benchmark keeps one
    /// request per outstanding I/O this way, as it keeps one buffer per
    /// outstanding I/O on Windows, instead of filling the model's table.
    /// Everything StorPort and the miniport set at the last completion
    /// (status, sense, transfer length) is reset.
    ///
    /// # Errors
    /// [`ModelError::NotAvailable`] if the request is not completed, or
    /// `data` does not fit its buffer.
    pub fn reissue(
        &self,
        request: u32,
        address: Address,
        cdb: &[u8],
        direction: DataDirection,
        data: Option<&[u8]>,
    ) -> Result<(), ModelError> {
        let s = &self.shared;
        let record = s
            .records
            .get(request as usize)
            .ok_or(ModelError::NotAvailable)?;
        let device = {
            let mut inner = lock(&record.inner);
            if inner.state != RequestState::Completed {
                return Err(ModelError::NotAvailable);
            }
            let body = inner.body.as_mut().ok_or(ModelError::NotAvailable)?;
            if let Some(data) = data {
                body.write(0, data).map_err(|_| ModelError::NotAvailable)?;
            }
            body.rearm(address, cdb, direction);
            inner.device = s.device_index(address);
            inner.state = RequestState::Queued;
            inner.done = None;
            inner.completions = 0;
            inner.busy_requeues = 0;
            inner.timed_out = false;
            inner.reset_deadline = None;
            inner.device
        };
        lock(&s.queue).pending.push_back((request, device));
        s.kick();
        Ok(())
    }

    /// Calls `hook` with the index of every request that completes (not
    /// for `SRB_STATUS_BUSY` requeues), once its [outcome](Self::outcome)
    /// is final — so a benchmark learns of completions without polling.
    /// The hook runs wherever the miniport completes requests (a DPC, at
    /// `DISPATCH_LEVEL`): it must not block or allocate. Only the first
    /// hook installed is kept; `false` if one was already there.
    pub fn on_complete(&self, hook: Box<dyn Fn(u32) + Send + Sync>) -> bool {
        self.shared.completion_hook.set(hook).is_ok()
    }

    /// Makes StorPort refuse the next `n` scatter/gather list requests (no
    /// map registers).
    pub fn refuse_sg_lists(&self, n: u64) {
        self.shared.sg_refusals.store(n, Ordering::Release);
    }

    /// Runs queued DPCs and work items until none is left (manual mode:
    /// `choose` picks among the runnable; threaded mode: waits).
    ///
    /// # Panics
    /// If the system does not settle (a routine keeps requeueing itself
    /// for 200 000 steps, or threaded work runs over 30 s).
    pub fn settle_with(&self, choose: &mut dyn FnMut(usize) -> usize) {
        let platform = &self.shared.platform;
        match platform.config().mode {
            kverbs::platform::host::HostMode::Manual => {
                let ran = platform.run_until_idle(choose, 200_000);
                assert!(ran < 200_000, "the model did not settle");
            }
            kverbs::platform::host::HostMode::Threaded => {
                assert!(
                    platform.quiesce(Duration::from_secs(30)),
                    "the model did not settle"
                );
            }
        }
    }

    /// [`Self::settle_with`] in FIFO order.
    pub fn settle(&self) {
        self.settle_with(&mut |_| 0);
    }

    /// Moves StorPort's clock: checks reset deadlines and progress, ends
    /// expired pauses, fires due timers (their DPCs), and resets the bus if
    /// a request the miniport holds timed out.
    ///
    /// # IRQL
    /// `PASSIVE_LEVEL`.
    pub fn advance(&self, by: Duration, irql: &Passive<'_>) {
        let s = &self.shared;
        if s.platform.config().mode == kverbs::platform::host::HostMode::Threaded {
            s.platform.quiesce(Duration::from_secs(30));
        }
        let now = s.now().saturating_add(ns(by));
        s.clock.store(now, Ordering::Release);
        // A reset's grace is judged only once the DPCs and work items
        // queued meanwhile have run: on a real system they run at once,
        // whatever the clock; in manual mode only when the test says.
        let quiet = s.platform.pending() == 0;
        let mut timed_out = false;
        for (index, record) in s.records.iter().enumerate() {
            let mut inner = lock(&record.inner);
            let held = matches!(
                inner.state,
                RequestState::InMiniport | RequestState::InSgBuild
            );
            if let Some(deadline) = inner.reset_deadline {
                if held && quiet && now > deadline {
                    s.checker.record(ModelViolation::ResetLeftOutstanding {
                        request: u32::try_from(index).unwrap_or(u32::MAX),
                    });
                    inner.reset_deadline = None;
                }
            }
            let limit = inner
                .issued_at
                .saturating_add(u64::from(inner.timeout_secs) * NS_PER_SEC);
            if held && inner.timeout_secs > 0 && !inner.timed_out && now >= limit {
                inner.timed_out = true;
                timed_out = true;
                bump(&s.counters.timeouts);
            }
        }
        {
            let mut q = lock(&s.queue);
            let waiting = q.pending.len() + q.retry.len();
            if waiting == 0 && q.adapter.outstanding == 0 {
                q.last_progress = now;
            } else if waiting > 0
                && !q.stall_reported
                && now.saturating_sub(q.last_progress) > ns(s.config.busy_forever_budget)
            {
                q.stall_reported = true;
                s.checker.record(ModelViolation::BusyForever {
                    stalled_ms: now.saturating_sub(q.last_progress) / 1_000_000,
                    waiting: u32::try_from(waiting).unwrap_or(u32::MAX),
                });
            }
            if q.adapter.paused_until.is_some_and(|t| t <= now) {
                q.adapter.paused_until = None;
            }
            for h in &mut q.devices {
                if h.paused_until.is_some_and(|t| t <= now) {
                    h.paused_until = None;
                }
            }
        }
        if let Some(dpcs) = s.dpcs.get() {
            for (timer, dpc) in s.timers_due.iter().zip(&dpcs.timers) {
                let due = timer.load(Ordering::Acquire);
                if due != 0
                    && due <= now
                    && timer
                        .compare_exchange(due, 0, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
                {
                    dpc.queue();
                }
            }
        }
        if timed_out {
            s.reset_bus(irql);
        }
        s.wake();
    }

    /// The current virtual time.
    #[must_use]
    pub fn now(&self) -> Duration {
        Duration::from_nanos(self.shared.now())
    }

    /// StorPort resets the bus (as after a timeout).
    ///
    /// # IRQL
    /// `PASSIVE_LEVEL`.
    pub fn reset_bus(&self, irql: &Passive<'_>) {
        self.shared.reset_bus(irql);
    }

    /// `ScsiQuerySupportedControlTypes`.
    ///
    /// # IRQL
    /// `PASSIVE_LEVEL`.
    #[must_use]
    pub fn supported_controls(&self, _irql: &Passive<'_>) -> SupportedControls {
        self.installed
            .as_ref()
            .map_or_else(SupportedControls::default, |i| {
                i.miniport.supported_controls()
            })
    }

    /// `ScsiStopAdapter` at device IRQL; StorPort stops dispatching first.
    ///
    /// # IRQL
    /// `PASSIVE_LEVEL` (the model raises).
    pub fn stop_adapter(&self, irql: &Passive<'_>) -> bool {
        let Some(installed) = &self.installed else {
            return false;
        };
        lock(&self.shared.queue).stopped = true;
        self.shared.at_device_irql("ScsiStopAdapter", irql, |d| {
            installed.miniport.stop_adapter(d)
        })
    }

    /// `ScsiRestartAdapter` at device IRQL; StorPort dispatches again after.
    ///
    /// # IRQL
    /// `PASSIVE_LEVEL` (the model raises).
    pub fn restart_adapter(&self, irql: &Passive<'_>) -> bool {
        let Some(installed) = &self.installed else {
            return false;
        };
        let ok = self.shared.at_device_irql("ScsiRestartAdapter", irql, |d| {
            installed.miniport.restart_adapter(d)
        });
        lock(&self.shared.queue).stopped = false;
        self.shared.wake();
        ok
    }

    /// `HwFreeAdapterResources`, then the adapter is gone (idempotent).
    ///
    /// # IRQL
    /// `PASSIVE_LEVEL`.
    pub fn free_adapter(&mut self, irql: &Passive<'_>) {
        if self.freed.swap(true, Ordering::AcqRel) {
            return;
        }
        if let Some(installed) = &self.installed {
            installed.miniport.free_adapter_resources(irql);
        }
        *lock(&self.shared.calls) = None;
        self.installed = None;
    }

    /// Where request `id` is and how it ended.
    #[must_use]
    pub fn outcome(&self, id: u32) -> Option<RequestOutcome> {
        let record = self.shared.records.get(id as usize)?;
        let inner = lock(&record.inner);
        let (status, scsi_status, data_transfer_length) =
            inner.done.as_ref().map_or((SrbStatus::PENDING, 0, 0), |d| {
                (d.status, d.scsi_status, d.data_transfer_length)
            });
        let sense = match (&inner.body, inner.done.is_some()) {
            (Some(body), true) if status.autosense_valid() => body
                .sense
                .get(..usize::from(body.sense_len))
                .unwrap_or(&[])
                .to_vec(),
            _ => Vec::new(),
        };
        Some(RequestOutcome {
            state: inner.state,
            status,
            scsi_status,
            data_transfer_length,
            sense,
            completions: inner.completions,
            busy_requeues: inner.busy_requeues,
        })
    }

    /// Request `id`'s data buffer as the CPU sees it (while StorPort, not
    /// the miniport, holds the request).
    ///
    /// # Errors
    /// [`ModelError::NotAvailable`].
    pub fn data(&self, id: u32) -> Result<Vec<u8>, ModelError> {
        let record = self
            .shared
            .records
            .get(id as usize)
            .ok_or(ModelError::NotAvailable)?;
        let inner = lock(&record.inner);
        let body = inner.body.as_ref().ok_or(ModelError::NotAvailable)?;
        let len = usize::try_from(body.buffer_len()).map_err(|_| ModelError::NotAvailable)?;
        let mut out = vec![0u8; len];
        body.read(0, &mut out)
            .map_err(|_| ModelError::NotAvailable)?;
        Ok(out)
    }

    /// Frees a completed request's buffers, as StorPort frees an SRB the
    /// class driver is done with, so a long run (the interop test's
    /// thousands of I/Os up to 1 MiB) does not hold every buffer it ever
    /// used. The record stays: its outcome (without sense) can still be
    /// read, and a late second completion is still caught.
    ///
    /// # Errors
    /// [`ModelError::NotAvailable`] unless the request has completed.
    pub fn release(&self, id: u32) -> Result<(), ModelError> {
        let record = self
            .shared
            .records
            .get(id as usize)
            .ok_or(ModelError::NotAvailable)?;
        let mut inner = lock(&record.inner);
        if inner.state != RequestState::Completed {
            return Err(ModelError::NotAvailable);
        }
        inner.body = None;
        Ok(())
    }

    /// Counters.
    #[must_use]
    pub fn stats(&self) -> ModelStats {
        let c = &self.shared.counters;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ModelStats {
            dispatched: g(&c.dispatched),
            completed: g(&c.completed),
            busy_requeues: g(&c.busy_requeues),
            bus_resets: g(&c.bus_resets),
            timeouts: g(&c.timeouts),
            adapter_busy_calls: g(&c.adapter_busy_calls),
            device_busy_calls: g(&c.device_busy_calls),
            ready_calls: g(&c.ready_calls),
            pause_calls: g(&c.pause_calls),
            resume_calls: g(&c.resume_calls),
            sg_built: g(&c.sg_built),
            bus_changes: g(&c.bus_changes),
            log_events: g(&c.log_events),
            timer_calls: g(&c.timer_calls),
            dpc_calls: g(&c.dpc_calls),
        }
    }

    /// The most recent log entries, oldest first.
    #[must_use]
    pub fn log_events(&self) -> Vec<LogEvent> {
        let ring = lock(&self.shared.log);
        let len = ring.entries.len();
        (0..len)
            .filter_map(|i| {
                ring.entries
                    .get((ring.next + i) % len.max(1))
                    .copied()
                    .flatten()
            })
            .collect()
    }

    /// Requests created so far.
    #[must_use]
    pub fn created(&self) -> u32 {
        let n = self.shared.next_record.load(Ordering::Acquire);
        u32::try_from(n.min(self.shared.records.len())).unwrap_or(u32::MAX)
    }

    /// Requests waiting in StorPort's queue and requests with the miniport.
    #[must_use]
    pub fn in_flight(&self) -> (usize, u32) {
        let q = lock(&self.shared.queue);
        (q.pending.len() + q.retry.len(), q.adapter.outstanding)
    }

    /// Takes the violations recorded so far (for negative tests).
    pub fn take_violations(&self) -> Vec<ModelViolation> {
        self.shared.checker.take()
    }

    /// Records [`ModelViolation::NeverCompleted`] for every issued request
    /// that has not completed.
    pub fn check_all_completed(&self) {
        for (index, record) in self.shared.records.iter().enumerate() {
            let state = lock(&record.inner).state;
            if matches!(
                state,
                RequestState::Queued | RequestState::InMiniport | RequestState::InSgBuild
            ) {
                self.shared.checker.record(ModelViolation::NeverCompleted {
                    request: u32::try_from(index).unwrap_or(u32::MAX),
                });
            }
        }
    }

    /// Ends a test: settles, frees the adapter, settles again, checks that
    /// every issued request completed, and fails the test listing every
    /// model violation — then ends the platform (which fails the test on
    /// any kverbs verifier violation).
    ///
    /// # Panics
    /// On any recorded violation.
    pub fn finish(mut self) {
        self.settle();
        let platform = self.shared.platform.clone();
        platform.run_passive(|p| self.free_adapter(p));
        self.settle();
        self.check_all_completed();
        let violations = self.take_violations();
        drop(self);
        assert!(
            violations.is_empty(),
            "the StorPort model recorded {} violation(s):\n{}",
            violations.len(),
            violations
                .iter()
                .map(|v| format!("  {v}"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        platform.finish();
    }
}
