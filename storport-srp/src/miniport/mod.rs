//! The miniport core: StorPort requests in, transport commands out.
//!
//! [`Adapter`] implements [`HwMiniport`] for any [`StorPort`] and drives any
//! [`Transport`] (the SRP and iSER engines). It owns:
//!
//! * the **target map**: StorPort bus 0, target `t` ↔ the transport's
//!   attached target `t`, StorPort LUN `l` ↔ the SAM LUN `l` (single
//!   level, peripheral addressing: [`Lun::from_index`]), with each target's connection state
//!   as the transport reports it;
//! * the **request tracker** ([`tracker`]): every request the core holds
//!   sits in a slot addressed by its [`Tag`], written into the request's
//!   `SrbExtension` so an ABORT_COMMAND finds its victim in O(1). Double
//!   completion is impossible by construction (see [`tracker`]);
//! * the **status mapping** ([`status`]): one function from a transport
//!   result to `SrbStatus`, `ScsiStatus`, `DataTransferLength` and sense;
//! * **flow control** driven by the transport, with no private queue: a
//!   request the transport cannot take now (no credit, connection
//!   recovering) is answered `SRB_STATUS_BUSY` — it never left the
//!   initiator — and its LUN is held back by StorPort, in a way that always
//!   ends: `StorPortDeviceBusy(lun, 1)` when a posted command on that LUN
//!   will complete (and so release it; a command that never completes times
//!   out and is reset), `StorPortPauseDevice(lun, 1 s)` otherwise. Both are
//!   released early when the transport reports credit or a state change —
//!   also when that report raced the refusal and came before the hold (a
//!   per-target release count, read before the attempt, tells);
//! * **task management** that reaches the target: ABORT_COMMAND → ABORT
//!   TASK, RESET_LOGICAL_UNIT and RESET_DEVICE → LOGICAL UNIT RESET (SRP has
//!   no target reset), each completed when the target answers;
//! * **bus reset** (HwResetBus and SRB_FUNCTION_RESET_BUS): the transport
//!   terminates everything it holds, requests not yet posted are claimed and
//!   completed `SRB_STATUS_BUS_RESET` by their owners;
//! * **adapter stop/restart** at device IRQL: only a flag and a DPC; the
//!   DPC queues the transport's `stop`/`start` to the kverbs passive worker.
//!
//! # Posting, and the reset gate
//! A command is prepared (borrowing the request), parked in its slot, and
//! posted. Parking and posting happen inside the *post gate*, an atomic
//! counter a reset closes and drains before it claims reserved requests and
//! resets the transport: so every request is either claimed by the reset,
//! or posted before the transport resets (and terminated by it), or refused
//! at the gate and answered `SRB_STATUS_BUSY`. None slips past a reset.
//! The wait ends because a post is bounded and never waits for anything;
//! the one assumption is that a reset is never entered from *inside* a
//! post on the same processor — StorPort calling `HwResetBus`, or
//! `HwStartIo` with a RESET_BUS request, from within the miniport's own
//! `RequestComplete` notification. The host model never does.
//!
//! # IRQL
//! Everything reachable from `HwStartIo`, the ExecutionRoutine, the DPC,
//! `HwResetBus` and the transport upcalls runs at <= `DISPATCH_LEVEL`,
//! takes only spin locks (never across a post) or lock-free atomics (the
//! tracker) and never allocates: the
//! tracker, the target and LUN tables, the worker and its request slots are
//! all allocated in `find_adapter`, at `PASSIVE_LEVEL`. The device-IRQL
//! routines (`initialize`, `stop_adapter`, `restart_adapter`) touch atomics
//! and queue a DPC, nothing else.

// Safe code throughout, except the tracker's per-slot request hand-off
// (`tracker::Slot`), which states its own.
#![deny(unsafe_code)]

pub mod status;
pub mod tracker;
pub mod transport;

use alloc::boxed::Box;
use alloc::sync::Arc;
use alloc::vec::Vec;
use core::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, Ordering};

use kverbs::irql::{AnyIrql, Dispatch, LeDispatch, Passive};
use kverbs::platform::AllocError;
use kverbs::rundown::Rundown;
use kverbs::sync::{PassiveMutex, with_dispatch};
use kverbs::worker::{CompleteAt, Outcome, RequestQueue, WorkHandler, Worker};

use crate::storport::{
    AdapterLimits, Address, BuildIo, DataAccessError, DataDirection, Dirql, DpcId,
    FindAdapterError, HwMiniport, LogEvent, LogKind, PnpAction, Srb, SrbFunction, SrbStatus,
    StorPort, SupportedControls, TimerId,
};
use crate::wire::Lun;
use status::{SrbOutcome, TmfKind, failure_status, map_command, map_tmf};
use tracker::{Disposition, EntryKind, Meta, ParkRefused, Tracker, VictimState};
use transport::{
    CommandResult, ImmediateData, PostFailed, PrepareError, ScsiCommand, StartFailed, Tag,
    TargetState, TmfRefused, TmfResponse, Transport, TransportEvents, Upcalls,
};

/// The DPC that carries adapter-control requests from device IRQL to the
/// passive worker.
pub const ADAPTER_CONTROL_DPC: DpcId = DpcId(0);

/// Seconds a pause lasts when nothing else will release a held LUN or
/// adapter: short, because it is only a backstop for the transport's
/// credit and state upcalls.
pub const HOLD_SECS: u32 = 1;

/// Task management slots added to the tracker beyond `max_io` (StorPort
/// does not count aborts and resets against its queue depth).
pub const TMF_SLOTS: u32 = 16;

/// Marks the extension word as holding a tag the core wrote.
const EXTENSION_TAG_VALID: u64 = 1 << 63;
/// In the extension word: the command's data moves out (else in), as
/// `start_scsi` resolved it, so the ExecutionRoutine need not resolve it
/// again.
const EXTENSION_DATA_OUT: u64 = 1 << 62;

/// The adapter's shape, fixed at `find_adapter`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdapterConfig {
    /// Attached targets (StorPort target ids `0..targets` on bus 0).
    pub targets: u8,
    /// LUNs per target StorPort may address.
    pub luns_per_target: u8,
    /// Outstanding SCSI commands per adapter (StorPort's `MaxNumberOfIO`).
    pub max_io: u32,
    /// Outstanding commands per LUN.
    pub max_io_per_lun: u32,
    /// Largest transfer, bytes.
    pub max_transfer_bytes: u32,
    /// Largest scatter/gather list, elements minus one.
    pub physical_breaks: u32,
}

impl Default for AdapterConfig {
    fn default() -> Self {
        Self {
            targets: 1,
            luns_per_target: 8,
            max_io: 256,
            max_io_per_lun: 64,
            max_transfer_bytes: 1 << 20,
            physical_breaks: 256,
        }
    }
}

impl AdapterConfig {
    fn check(&self) -> Result<(), FindAdapterError> {
        let tracker_slots = u64::from(self.max_io) + u64::from(TMF_SLOTS);
        if self.targets == 0
            || self.luns_per_target == 0
            || self.max_io == 0
            || self.max_io_per_lun == 0
            || tracker_slots > tracker::MAX_SLOTS as u64
        {
            return Err(FindAdapterError::BadConfig);
        }
        Ok(())
    }

    fn limits(&self) -> AdapterLimits {
        AdapterLimits {
            buses: 1,
            targets_per_bus: self.targets,
            luns_per_target: self.luns_per_target,
            max_transfer_bytes: self.max_transfer_bytes,
            physical_breaks: self.physical_breaks,
            max_io: self.max_io,
            max_io_per_lun: self.max_io_per_lun,
        }
    }
}

/// Creates the transport at `find_adapter`, handing it the core's upcalls.
pub type TransportFactory<T> =
    Box<dyn Fn(Upcalls, &Passive<'_>) -> Result<T, AllocError> + Send + Sync>;

/// What the driver passes to `find_adapter` (StorPort's `HwContext`).
pub struct CoreContext<T> {
    /// The adapter's shape.
    pub config: AdapterConfig,
    /// Makes the transport.
    pub make_transport: TransportFactory<T>,
}

/// Where the adapter is in its stop/restart cycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdapterState {
    /// The transport is being started (first start, or a restart).
    Starting,
    /// The transport runs.
    Running,
    /// A stop was requested; teardown is queued or running.
    Stopping,
    /// Stopped.
    Stopped,
}

impl AdapterState {
    const fn code(self) -> u8 {
        match self {
            Self::Starting => 0,
            Self::Running => 1,
            Self::Stopping => 2,
            Self::Stopped => 3,
        }
    }

    const fn from_code(code: u8) -> Self {
        match code {
            1 => Self::Running,
            2 => Self::Stopping,
            3 => Self::Stopped,
            _ => Self::Starting,
        }
    }
}

/// Counters the tests and the trace read (snapshots).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CoreStats {
    /// Completions for tags that were not outstanding (ignored).
    pub stale_completions: u64,
    /// Transport contract breaches survived.
    pub contract_violations: u64,
    /// Requests answered `SRB_STATUS_BUSY` for lack of credit.
    pub busy_no_credit: u64,
    /// Requests answered `SRB_STATUS_BUSY` because the target was
    /// reconnecting, the adapter was not running, or a reset was under way.
    pub busy_not_ready: u64,
    /// Bus resets performed.
    pub bus_resets: u64,
    /// Task management functions sent.
    pub tmfs_sent: u64,
}

#[derive(Default)]
struct Counters {
    stale_completions: AtomicU64,
    contract_violations: AtomicU64,
    busy_no_credit: AtomicU64,
    busy_not_ready: AtomicU64,
    bus_resets: AtomicU64,
    tmfs_sent: AtomicU64,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// Hold bits of a LUN: which StorPort holds the core has put on it.
const HELD_BUSY: u8 = 1;
const HELD_PAUSED: u8 = 2;

struct LunEntry {
    /// Commands posted to the transport and not yet completed.
    posted: AtomicU32,
    /// `HELD_*` bits.
    held: AtomicU8,
}

/// The post gate: bits 0..24 count posters inside, bits 24.. count resets
/// that closed it.
const GATE_CLOSER: u32 = 1 << 24;
const GATE_POSTERS: u32 = GATE_CLOSER - 1;

/// The part of the adapter the transport's upcalls reach: everything except
/// the transport itself (so the transport can hold it without a cycle).
pub struct Core<S: StorPort> {
    port: S,
    config: AdapterConfig,
    tracker: Tracker<S::Srb>,
    /// `TargetState` codes, one per target.
    targets: Box<[AtomicU8]>,
    /// `targets * luns_per_target` entries.
    luns: Box<[LunEntry]>,
    /// Per target, how many times its holds were released: a request
    /// refused for a reason that went away before its LUN was held sees
    /// the count move, and releases the hold it just took (otherwise the
    /// release found nothing to release and the LUN would sit paused
    /// until StorPort's timer ends the pause).
    wakes: Box<[AtomicU32]>,
    gate: AtomicU32,
    state: AtomicU8,
    /// Whether the transport should run (the worker reconciles toward it).
    want_running: AtomicBool,
    adapter_held: AtomicBool,
    counters: Counters,
}

impl<S: StorPort> Core<S> {
    fn new(port: S, config: AdapterConfig, irql: &Passive<'_>) -> Self {
        let slots = (config.max_io + TMF_SLOTS) as usize;
        let luns = usize::from(config.targets) * usize::from(config.luns_per_target);
        Self {
            port,
            config,
            tracker: Tracker::new(slots, irql),
            targets: (0..config.targets)
                .map(|_| AtomicU8::new(TargetState::Connecting.code() as u8))
                .collect::<Vec<_>>()
                .into_boxed_slice(),
            wakes: (0..config.targets)
                .map(|_| AtomicU32::new(0))
                .collect::<Vec<_>>()
                .into_boxed_slice(),
            luns: (0..luns)
                .map(|_| LunEntry {
                    posted: AtomicU32::new(0),
                    held: AtomicU8::new(0),
                })
                .collect::<Vec<_>>()
                .into_boxed_slice(),
            gate: AtomicU32::new(0),
            state: AtomicU8::new(AdapterState::Starting.code()),
            want_running: AtomicBool::new(false),
            adapter_held: AtomicBool::new(false),
            counters: Counters::default(),
        }
    }

    /// The port this adapter was found on.
    pub fn port(&self) -> &S {
        &self.port
    }

    /// The adapter's stop/restart state.
    pub fn state(&self) -> AdapterState {
        AdapterState::from_code(self.state.load(Ordering::Acquire))
    }

    /// A target's connection state (`Lost` for an unknown target).
    pub fn target_state_of(&self, target: u8) -> TargetState {
        self.targets
            .get(usize::from(target))
            .map_or(TargetState::Lost, |s| {
                TargetState::from_code(s.load(Ordering::Acquire))
            })
    }

    /// Counter snapshot.
    pub fn stats(&self) -> CoreStats {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        CoreStats {
            stale_completions: get(&c.stale_completions),
            contract_violations: get(&c.contract_violations),
            busy_no_credit: get(&c.busy_no_credit),
            busy_not_ready: get(&c.busy_not_ready),
            bus_resets: get(&c.bus_resets),
            tmfs_sent: get(&c.tmfs_sent),
        }
    }

    fn lun(&self, address: Address) -> Option<&LunEntry> {
        let index = usize::from(address.target) * usize::from(self.config.luns_per_target)
            + usize::from(address.lun);
        if address.target >= self.config.targets || address.lun >= self.config.luns_per_target {
            return None;
        }
        self.luns.get(index)
    }

    fn log(&self, kind: LogKind, address: Option<Address>, detail: u64, irql: &impl LeDispatch) {
        self.port.log(
            LogEvent {
                kind,
                address,
                detail,
            },
            irql,
        );
    }

    /// Checks bus, target and LUN against the configured map.
    fn check_address(&self, address: Address) -> Result<(), SrbStatus> {
        if address.path != 0 {
            Err(SrbStatus::INVALID_PATH_ID)
        } else if address.target >= self.config.targets {
            Err(SrbStatus::INVALID_TARGET_ID)
        } else if address.lun >= self.config.luns_per_target {
            Err(SrbStatus::INVALID_LUN)
        } else {
            Ok(())
        }
    }

    // -- completing ---------------------------------------------------------

    /// Completes a request the core decided alone. `SRB_STATUS_BUSY`
    /// leaves the request otherwise untouched (StorPort reissues it as is).
    fn complete_local(&self, mut srb: S::Srb, status: SrbStatus, irql: &impl LeDispatch) {
        if status.base() != SrbStatus::BUSY && srb.function() == SrbFunction::ExecuteScsi {
            srb.set_data_transfer_length(0);
            srb.set_scsi_status(0);
        }
        srb.set_srb_status(status);
        self.port.complete_request(srb, irql);
    }

    /// Releases the request's scatter/gather list (if it has one) and
    /// completes it with `outcome`, copying `sense`.
    fn finish(
        &self,
        mut srb: S::Srb,
        outcome: &SrbOutcome,
        sense: &[u8],
        has_sg: bool,
        irql: &impl LeDispatch,
    ) {
        if has_sg {
            self.put_sg(&mut srb, irql);
        }
        if outcome.srb_status.base() == SrbStatus::BUSY {
            srb.set_srb_status(outcome.srb_status);
            self.port.complete_request(srb, irql);
            return;
        }
        srb.set_data_transfer_length(outcome.data_transfer_length);
        srb.set_scsi_status(outcome.scsi_status);
        if outcome.srb_status.autosense_valid() {
            let buffer = srb.sense_buffer();
            let n = usize::from(outcome.sense_len)
                .min(buffer.len())
                .min(sense.len());
            if let (Some(dst), Some(src)) = (buffer.get_mut(..n), sense.get(..n)) {
                dst.copy_from_slice(src);
            }
            srb.set_sense_length(u8::try_from(n).unwrap_or(u8::MAX));
        }
        srb.set_srb_status(outcome.srb_status);
        self.port.complete_request(srb, irql);
    }

    fn finish_local(&self, srb: S::Srb, status: SrbStatus, has_sg: bool, irql: &impl LeDispatch) {
        self.finish(srb, &SrbOutcome::local(status), &[], has_sg, irql);
    }

    fn put_sg(&self, srb: &mut S::Srb, irql: &impl LeDispatch) {
        with_dispatch::<S::Platform, _, _>(irql, |d| self.port.put_scatter_gather_list(srb, d));
    }

    // -- holds --------------------------------------------------------------

    /// The release count of `target`'s holds, read before an attempt that
    /// may end in a hold (see [`Self::hold_lun`]).
    fn wake_epoch(&self, target: u8) -> u32 {
        self.wakes
            .get(usize::from(target))
            .map_or(0, |w| w.load(Ordering::SeqCst))
    }

    /// Holds a LUN back after a `SRB_STATUS_BUSY` answer, in a way that
    /// always ends (see the module docs). The port is asked to hold before
    /// the bit is set, so a release that sees the bit comes after the hold
    /// it ends. Call [`Self::end_hold_if_woken`] once the request is
    /// completed BUSY.
    fn hold_lun(&self, address: Address, irql: &impl LeDispatch) {
        let Some(lun) = self.lun(address) else { return };
        if lun.posted.load(Ordering::Acquire) > 0 {
            self.port.device_busy(address, 1, irql);
            lun.held.fetch_or(HELD_BUSY, Ordering::SeqCst);
        } else {
            self.port.pause_device(address, HOLD_SECS, irql);
            lun.held.fetch_or(HELD_PAUSED, Ordering::SeqCst);
        }
    }

    /// After a hold and the BUSY completion it goes with: `since` is the
    /// target's [`Self::wake_epoch`] from before the attempt that was
    /// refused. If a release ran in between (credit came back, the target
    /// went live), it found no hold to end, or ended this one before
    /// StorPort had requeued the request — either way nothing would retry
    /// it until StorPort's timer did. So the holds are ended now and the
    /// LUN is declared ready, after the requeue, an event StorPort retries
    /// the request on.
    fn end_hold_if_woken(&self, address: Address, since: u32, irql: &impl LeDispatch) {
        if self.wake_epoch(address.target) != since {
            self.release_target(address.target, irql);
            self.port.device_ready(address, irql);
        }
    }

    /// Releases every hold the core put on `target`'s LUNs.
    fn release_target(&self, target: u8, irql: &impl LeDispatch) {
        if let Some(w) = self.wakes.get(usize::from(target)) {
            w.fetch_add(1, Ordering::SeqCst);
        }
        for lun in 0..self.config.luns_per_target {
            let address = Address::new(0, target, lun);
            let Some(entry) = self.lun(address) else {
                continue;
            };
            let held = entry.held.swap(0, Ordering::SeqCst);
            if held & HELD_BUSY != 0 {
                self.port.device_ready(address, irql);
            }
            if held & HELD_PAUSED != 0 {
                self.port.resume_device(address, irql);
            }
        }
    }

    fn hold_adapter(&self, irql: &impl LeDispatch) {
        self.adapter_held.store(true, Ordering::Release);
        self.port.pause(HOLD_SECS, irql);
    }

    fn release_adapter(&self, irql: &impl LeDispatch) {
        if self.adapter_held.swap(false, Ordering::AcqRel) {
            self.port.resume(irql);
        }
    }

    fn posted_delta(&self, address: Address, up: bool) {
        if let Some(lun) = self.lun(address) {
            if up {
                lun.posted.fetch_add(1, Ordering::AcqRel);
            } else {
                lun.posted.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }

    // -- the post gate ------------------------------------------------------

    /// Enters the gate unless a reset holds it closed.
    fn gate_enter(&self) -> bool {
        let mut current = self.gate.load(Ordering::Acquire);
        loop {
            if current >= GATE_CLOSER || current & GATE_POSTERS == GATE_POSTERS {
                return false;
            }
            match self.gate.compare_exchange_weak(
                current,
                current + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return true,
                Err(actual) => current = actual,
            }
        }
    }

    fn gate_exit(&self) {
        self.gate.fetch_sub(1, Ordering::AcqRel);
    }

    /// Closes the gate and waits for the posters inside to leave (each is
    /// in a bounded, non-blocking `post`).
    fn gate_close(&self) {
        self.gate.fetch_add(GATE_CLOSER, Ordering::AcqRel);
        while self.gate.load(Ordering::Acquire) & GATE_POSTERS != 0 {
            core::hint::spin_loop();
        }
    }

    fn gate_open(&self) {
        self.gate.fetch_sub(GATE_CLOSER, Ordering::AcqRel);
    }
}

fn disposition_status(disposition: Disposition) -> SrbStatus {
    match disposition {
        Disposition::Proceed => SrbStatus::INTERNAL_ERROR,
        Disposition::Aborted => SrbStatus::ABORTED,
        Disposition::Reset => SrbStatus::BUS_RESET,
    }
}

impl<S: StorPort> TransportEvents for Core<S> {
    fn command_done(&self, tag: Tag, result: &CommandResult<'_>, irql: &Dispatch<'_>) {
        let taken = self
            .tracker
            .take(tag, |k| matches!(k, EntryKind::Command { .. }), irql);
        let Some((srb, meta)) = taken else {
            bump(&self.counters.stale_completions);
            self.log(LogKind::StaleCompletion, None, u64::from(tag.raw()), irql);
            return;
        };
        let EntryKind::Command { requested, has_sg } = meta.kind else {
            // Unreachable: `take` filtered on the kind.
            self.finish_local(srb, SrbStatus::INTERNAL_ERROR, false, irql);
            return;
        };
        self.posted_delta(meta.address, false);
        let mut srb = srb;
        let capacity = srb.sense_buffer().len();
        let outcome = map_command(requested, result, capacity);
        self.finish(srb, &outcome, result.sense, has_sg, irql);
    }

    fn tmf_done(&self, tag: Tag, response: TmfResponse, irql: &Dispatch<'_>) {
        let taken = self
            .tracker
            .take(tag, |k| matches!(k, EntryKind::Tmf(_)), irql);
        let Some((srb, meta)) = taken else {
            bump(&self.counters.stale_completions);
            self.log(LogKind::StaleCompletion, None, u64::from(tag.raw()), irql);
            return;
        };
        let EntryKind::Tmf(kind) = meta.kind else {
            self.complete_local(srb, SrbStatus::INTERNAL_ERROR, irql);
            return;
        };
        self.complete_local(srb, map_tmf(kind, response), irql);
    }

    fn target_state(&self, target: u8, state: TargetState, irql: &Dispatch<'_>) {
        let Some(entry) = self.targets.get(usize::from(target)) else {
            bump(&self.counters.contract_violations);
            self.log(LogKind::TransportContract, None, u64::from(target), irql);
            return;
        };
        let old = TargetState::from_code(entry.swap(state.code() as u8, Ordering::AcqRel));
        if old == state {
            return;
        }
        self.log(
            LogKind::TargetState,
            Some(Address::new(0, target, 0)),
            state.code(),
            irql,
        );
        if !matches!(state, TargetState::Blocked | TargetState::Connecting) {
            self.release_target(target, irql);
        }
        let visible = |s: TargetState| {
            matches!(
                s,
                TargetState::Live | TargetState::Blocked | TargetState::FailFast
            )
        };
        if visible(old) != visible(state) {
            self.port.notify_bus_change(0, irql);
        }
    }

    fn credits_available(&self, target: u8, irql: &Dispatch<'_>) {
        self.release_target(target, irql);
    }
}

/// A request's data as the CPU sees it, for immediate data.
struct SrbData<'a, R>(&'a R);

impl<R: Srb> ImmediateData for SrbData<'_, R> {
    fn read(&self, offset: u32, out: &mut [u8]) -> Result<(), DataAccessError> {
        self.0.read_data(offset, out)
    }
}

/// The direction a command's data moves, or why it cannot be carried.
/// Inlined (always: a plain hint left it a call): once per request, a
/// few loads of the SRB.
#[inline(always)]
fn resolve_direction(srb: &impl Srb) -> Result<DataDirection, SrbStatus> {
    let length = srb.data_transfer_length();
    let direction = match srb.direction() {
        DataDirection::Unspecified => cdb_direction(srb.cdb()).ok_or(SrbStatus::INVALID_REQUEST)?,
        other => other,
    };
    Ok(if length == 0 {
        DataDirection::None
    } else {
        direction
    })
}

/// The data direction a CDB implies, for requests that leave it
/// unspecified: the decoded command's, or the opcode's fixed one.
fn cdb_direction(cdb: &[u8]) -> Option<DataDirection> {
    let direction = crate::scsi::Cdb::new_unchecked(cdb).data_direction()?;
    Some(match direction {
        crate::scsi::DataDirection::None => DataDirection::None,
        crate::scsi::DataDirection::In => DataDirection::In,
        crate::scsi::DataDirection::Out => DataDirection::Out,
    })
}

/// The wire LUN of a StorPort LUN number (peripheral addressing; a `u8`
/// always fits).
fn wire_lun(lun: u8) -> Lun {
    Lun::from_index(u16::from(lun)).unwrap_or(Lun([0, lun, 0, 0, 0, 0, 0, 0]))
}

/// The passive worker's side of stop/restart: brings the transport to the
/// state the core wants.
struct Control<S: StorPort, T: Transport> {
    core: Arc<Core<S>>,
    transport: Arc<T>,
    run: PassiveMutex<RunState, S::Platform>,
}

#[derive(Default)]
struct RunState {
    started: bool,
    freed: bool,
}

/// What a reconcile pass reached.
enum Reached {
    Running,
    Stopped,
    StartFailed(StartFailed),
    Freed,
}

impl<S: StorPort, T: Transport> WorkHandler for Control<S, T> {
    type Request = ();
    type Output = Reached;

    fn execute(&self, (): (), irql: &Passive<'_>) -> Reached {
        let mut run = self.run.lock(irql);
        loop {
            if run.freed {
                return Reached::Freed;
            }
            let want = self.core.want_running.load(Ordering::Acquire);
            match (want, run.started) {
                (true, true) => return Reached::Running,
                (false, false) => return Reached::Stopped,
                (true, false) => match self.transport.start(irql) {
                    Ok(()) => run.started = true,
                    Err(e) => return Reached::StartFailed(e),
                },
                (false, true) => {
                    self.transport.stop(irql);
                    run.started = false;
                }
            }
        }
    }

    fn complete(&self, outcome: Outcome<(), Reached>, irql: AnyIrql<'_, '_>) {
        let Outcome::Done(reached) = outcome else {
            return;
        };
        match irql {
            AnyIrql::Passive(p) => self.reached(reached, p),
            AnyIrql::Dispatch(d) => self.reached(reached, d),
        }
    }
}

impl<S: StorPort, T: Transport> Control<S, T> {
    fn reached(&self, reached: Reached, irql: &impl LeDispatch) {
        let core = &self.core;
        match reached {
            Reached::Running => {
                // A stop requested meanwhile has queued its own pass.
                if core.want_running.load(Ordering::Acquire) {
                    core.state
                        .store(AdapterState::Running.code(), Ordering::Release);
                    core.release_adapter(irql);
                    core.log(LogKind::AdapterRestarted, None, 0, irql);
                }
            }
            Reached::Stopped => {
                if !core.want_running.load(Ordering::Acquire) {
                    core.state
                        .store(AdapterState::Stopped.code(), Ordering::Release);
                    core.log(LogKind::AdapterStopped, None, 0, irql);
                }
            }
            Reached::StartFailed(e) => {
                core.state
                    .store(AdapterState::Stopped.code(), Ordering::Release);
                core.release_adapter(irql);
                core.log(LogKind::TransportStartFailed, None, u64::from(e.code), irql);
            }
            Reached::Freed => {}
        }
    }
}

/// The miniport: the core plus the transport it drives.
pub struct Adapter<S: StorPort, T: Transport> {
    core: Arc<Core<S>>,
    transport: Arc<T>,
    control: RequestQueue<S::Platform, Control<S, T>>,
    rundown: Arc<Rundown<S::Platform>>,
    _worker: Worker<S::Platform>,
}

impl<S: StorPort, T: Transport> Adapter<S, T> {
    /// The core (state, statistics, the port).
    pub fn core(&self) -> &Core<S> {
        &self.core
    }

    /// The transport.
    pub fn transport(&self) -> &T {
        &self.transport
    }

    /// Asks the passive worker to bring the transport to the wanted state.
    fn reconcile(&self, irql: &impl LeDispatch) {
        // `Full` means a pass is queued that has not started: it will see
        // the current wish. `Closed` means the adapter is being freed.
        let _ = self.control.submit((), CompleteAt::Passive, irql);
    }

    // -- EXECUTE_SCSI -------------------------------------------------------

    fn start_scsi<I: LeDispatch>(&self, srb: S::Srb, irql: &I) {
        let core = &*self.core;
        let address = srb.address();
        if let Err(status) = core.check_address(address) {
            core.complete_local(srb, status, irql);
            return;
        }
        let since = core.wake_epoch(address.target);
        if core.state() != AdapterState::Running {
            bump(&core.counters.busy_not_ready);
            core.hold_adapter(irql);
            core.complete_local(srb, SrbStatus::BUSY, irql);
            return;
        }
        match core.target_state_of(address.target) {
            TargetState::Live => {}
            TargetState::Blocked => {
                bump(&core.counters.busy_not_ready);
                core.hold_lun(address, irql);
                core.complete_local(srb, SrbStatus::BUSY, irql);
                core.end_hold_if_woken(address, since, irql);
                return;
            }
            TargetState::Connecting | TargetState::FailFast => {
                core.complete_local(srb, SrbStatus::SELECTION_TIMEOUT, irql);
                return;
            }
            TargetState::Lost => {
                core.complete_local(srb, SrbStatus::NO_DEVICE, irql);
                return;
            }
        }
        let direction = match resolve_direction(&srb) {
            Ok(d) => d,
            Err(status) => {
                core.complete_local(srb, status, irql);
                return;
            }
        };
        if srb.cdb().is_empty() {
            core.complete_local(srb, SrbStatus::INVALID_REQUEST, irql);
            return;
        }
        let has_sg = direction != DataDirection::None;
        let meta = Meta {
            kind: EntryKind::Command {
                requested: if has_sg {
                    srb.data_transfer_length()
                } else {
                    0
                },
                has_sg,
            },
            address,
            identity: srb.identity(),
            disposition: Disposition::Proceed,
        };
        let Some(tag) = core.tracker.reserve(meta, irql) else {
            // More requests than StorPort was told to send: hold the
            // adapter until one completes.
            bump(&core.counters.busy_not_ready);
            core.port.busy(1, irql);
            core.complete_local(srb, SrbStatus::BUSY, irql);
            return;
        };
        if let Some(word) = srb.extension().first() {
            let out = if direction == DataDirection::Out {
                EXTENSION_DATA_OUT
            } else {
                0
            };
            word.store(
                EXTENSION_TAG_VALID | out | u64::from(tag.raw()),
                Ordering::Release,
            );
        }
        if has_sg {
            with_dispatch::<S::Platform, _, _>(irql, |d| {
                if let Err(refused) = core.port.get_scatter_gather_list(srb, d) {
                    // No map registers now: not started, so BUSY.
                    let busy = SrbStatus::BUSY;
                    self.abandon(refused.srb, tag, address, false, busy, Some(since), d);
                }
            });
        } else {
            self.submit(srb, tag, meta, direction, irql);
        }
    }

    /// Gives the reservation back and completes the request with `status`
    /// — or with what an abort or reset decided for it meanwhile. A BUSY
    /// answer holds the LUN; `since` is the target's release count from
    /// before the refused attempt (`None`: read now).
    #[expect(
        clippy::too_many_arguments,
        reason = "a request's parts, its status and the release count the BUSY hold checks"
    )]
    fn abandon(
        &self,
        srb: S::Srb,
        tag: Tag,
        address: Address,
        has_sg: bool,
        status: SrbStatus,
        since: Option<u32>,
        irql: &impl LeDispatch,
    ) {
        let core = &*self.core;
        let status = match core.tracker.release(tag, irql) {
            Some(Disposition::Proceed) | None => status,
            Some(other) => disposition_status(other),
        };
        if status.base() == SrbStatus::BUSY {
            let since = since.unwrap_or_else(|| core.wake_epoch(address.target));
            core.hold_lun(address, irql);
            core.finish_local(srb, status, has_sg, irql);
            core.end_hold_if_woken(address, since, irql);
            return;
        }
        core.finish_local(srb, status, has_sg, irql);
    }

    /// Prepares, parks and posts a reserved command moving its data
    /// `direction` (resolved once, by `start_scsi`).
    fn submit<I: LeDispatch>(
        &self,
        srb: S::Srb,
        tag: Tag,
        meta: Meta,
        direction: DataDirection,
        irql: &I,
    ) {
        let core = &*self.core;
        let since = Some(core.wake_epoch(meta.address.target));
        let EntryKind::Command { requested, has_sg } = meta.kind else {
            self.abandon(
                srb,
                tag,
                meta.address,
                false,
                SrbStatus::INTERNAL_ERROR,
                None,
                irql,
            );
            return;
        };
        let address = meta.address;
        let prepared = {
            let sg_list = if has_sg {
                srb.scatter_gather()
            } else {
                Some(&[][..])
            };
            match sg_list {
                None => Err(None),
                Some(sg_list) => {
                    let command = ScsiCommand {
                        tag,
                        target: address.target,
                        lun: wire_lun(address.lun),
                        cdb: srb.cdb(),
                        direction,
                        transfer_length: requested,
                        task_attribute: srb.queue_action(),
                        sg_list,
                        immediate: &SrbData(&srb),
                    };
                    self.transport.prepare(&command, irql).map_err(Some)
                }
            }
        };
        let prepared = match prepared {
            Ok(p) => p,
            Err(None) => {
                // The port gave no list for a data transfer.
                self.abandon(
                    srb,
                    tag,
                    address,
                    has_sg,
                    SrbStatus::INTERNAL_ERROR,
                    None,
                    irql,
                );
                return;
            }
            Err(Some(PrepareError::Busy)) => {
                bump(&core.counters.busy_no_credit);
                let posted = core
                    .lun(address)
                    .map_or(0, |l| l.posted.load(Ordering::Relaxed));
                core.log(
                    LogKind::CreditStarvation,
                    Some(address),
                    u64::from(posted),
                    irql,
                );
                self.abandon(srb, tag, address, has_sg, SrbStatus::BUSY, since, irql);
                return;
            }
            Err(Some(PrepareError::Blocked)) => {
                bump(&core.counters.busy_not_ready);
                self.abandon(srb, tag, address, has_sg, SrbStatus::BUSY, since, irql);
                return;
            }
            Err(Some(PrepareError::Failed(kind))) => {
                self.abandon(srb, tag, address, has_sg, failure_status(kind), None, irql);
                return;
            }
        };
        if !core.gate_enter() {
            // A reset is under way: the request never left; requeue it.
            self.transport.discard(prepared, irql);
            bump(&core.counters.busy_not_ready);
            self.abandon(srb, tag, address, has_sg, SrbStatus::BUSY, since, irql);
            return;
        }
        match core.tracker.park(tag, srb, irql) {
            Ok(()) => {
                core.posted_delta(address, true);
                if let Err(PostFailed(kind)) = self.transport.post(prepared, irql) {
                    if let Some((srb, _)) = core.tracker.unpark(tag, irql) {
                        core.posted_delta(address, false);
                        core.finish_local(srb, failure_status(kind), has_sg, irql);
                    } else {
                        // Completed although refused: already handed back.
                        bump(&core.counters.contract_violations);
                        core.log(
                            LogKind::TransportContract,
                            Some(address),
                            u64::from(tag.raw()),
                            irql,
                        );
                    }
                }
            }
            Err(ParkRefused::Disposed(srb, disposition)) => {
                // The transport lets go of the tag before the tracker
                // may hand it out again.
                self.transport.discard(prepared, irql);
                self.abandon(
                    srb,
                    tag,
                    address,
                    has_sg,
                    disposition_status(disposition),
                    None,
                    irql,
                );
            }
            Err(ParkRefused::NotReserved(srb)) => {
                self.transport.discard(prepared, irql);
                core.finish_local(srb, SrbStatus::INTERNAL_ERROR, has_sg, irql);
            }
        }
        core.gate_exit();
    }

    // -- task management ----------------------------------------------------

    fn start_abort<I: LeDispatch>(&self, srb: S::Srb, irql: &I) {
        let core = &*self.core;
        let victim = srb.abort_target().map(|v| {
            let word = v.extension.first().map_or(0, |w| w.load(Ordering::Acquire));
            (v.identity, word)
        });
        let Some((identity, word)) = victim else {
            core.complete_local(srb, SrbStatus::ABORT_FAILED, irql);
            return;
        };
        if word & EXTENSION_TAG_VALID == 0 {
            core.complete_local(srb, SrbStatus::ABORT_FAILED, irql);
            return;
        }
        let victim_tag = Tag(u32::try_from(word & u64::from(u32::MAX)).unwrap_or(0));
        match core.tracker.claim_victim(victim_tag, identity, irql) {
            VictimState::NotFound => core.complete_local(srb, SrbStatus::ABORT_FAILED, irql),
            // Its owner completes it ABORTED when it tries to park it.
            VictimState::MarkedAborted => core.complete_local(srb, SrbStatus::SUCCESS, irql),
            VictimState::Posted(address) => {
                self.send_tmf(srb, TmfKind::AbortTask, address, Some(victim_tag), irql);
            }
        }
    }

    fn start_lun_reset<I: LeDispatch>(&self, srb: S::Srb, irql: &I) {
        let core = &*self.core;
        let address = srb.address();
        if let Err(status) = core.check_address(address) {
            core.complete_local(srb, status, irql);
            return;
        }
        let since = core.wake_epoch(address.target);
        match core.target_state_of(address.target) {
            TargetState::Live => self.send_tmf(srb, TmfKind::LunReset, address, None, irql),
            TargetState::Blocked => {
                bump(&core.counters.busy_not_ready);
                core.hold_lun(address, irql);
                core.complete_local(srb, SrbStatus::BUSY, irql);
                core.end_hold_if_woken(address, since, irql);
            }
            TargetState::Connecting | TargetState::FailFast => {
                core.complete_local(srb, SrbStatus::SELECTION_TIMEOUT, irql);
            }
            TargetState::Lost => core.complete_local(srb, SrbStatus::NO_DEVICE, irql),
        }
    }

    fn send_tmf<I: LeDispatch>(
        &self,
        srb: S::Srb,
        kind: TmfKind,
        address: Address,
        victim: Option<Tag>,
        irql: &I,
    ) {
        let core = &*self.core;
        let since = core.wake_epoch(address.target);
        let meta = Meta {
            kind: EntryKind::Tmf(kind),
            address,
            identity: srb.identity(),
            disposition: Disposition::Proceed,
        };
        let Some(tag) = core.tracker.reserve(meta, irql) else {
            bump(&core.counters.busy_not_ready);
            core.hold_adapter(irql);
            core.complete_local(srb, SrbStatus::BUSY, irql);
            return;
        };
        if kind == TmfKind::LunReset {
            // Requests for this LUN not yet posted would go out after the
            // reset: they are covered by it instead.
            core.tracker.mark_reserved_reset(|a| *a == address, irql);
        }
        if !core.gate_enter() {
            let _ = core.tracker.release(tag, irql);
            bump(&core.counters.busy_not_ready);
            core.complete_local(srb, SrbStatus::BUSY, irql);
            return;
        }
        match core.tracker.park(tag, srb, irql) {
            Ok(()) => {
                bump(&core.counters.tmfs_sent);
                core.log(
                    LogKind::TaskManagement,
                    Some(address),
                    u64::from(tag.raw()),
                    irql,
                );
                let lun = wire_lun(address.lun);
                let sent = match (kind, victim) {
                    (TmfKind::AbortTask, Some(victim)) => {
                        self.transport
                            .abort_task(address.target, lun, victim, tag, irql)
                    }
                    (TmfKind::AbortTask, None) => Err(TmfRefused::UnknownTask),
                    (TmfKind::LunReset, _) => {
                        self.transport.reset_lun(address.target, lun, tag, irql)
                    }
                };
                if let Err(refused) = sent {
                    if let Some((srb, _)) = core.tracker.unpark(tag, irql) {
                        let status = match (refused, kind) {
                            (TmfRefused::Busy, _) => SrbStatus::BUSY,
                            (TmfRefused::NotConnected, TmfKind::LunReset) => {
                                SrbStatus::SELECTION_TIMEOUT
                            }
                            (_, TmfKind::AbortTask) | (TmfRefused::UnknownTask, _) => {
                                SrbStatus::ABORT_FAILED
                            }
                        };
                        if status == SrbStatus::BUSY {
                            core.hold_lun(address, irql);
                        }
                        core.complete_local(srb, status, irql);
                        if status == SrbStatus::BUSY {
                            core.end_hold_if_woken(address, since, irql);
                        }
                    } else {
                        bump(&core.counters.contract_violations);
                    }
                }
            }
            Err(ParkRefused::Disposed(srb, _)) => {
                // Unreachable: aborts and resets claim commands only.
                let _ = core.tracker.release(tag, irql);
                core.complete_local(srb, SrbStatus::INTERNAL_ERROR, irql);
            }
            Err(ParkRefused::NotReserved(srb)) => {
                core.complete_local(srb, SrbStatus::INTERNAL_ERROR, irql);
            }
        }
        core.gate_exit();
    }

    // -- bus reset ----------------------------------------------------------

    fn reset_bus_now(&self, path: u8, irql: &Dispatch<'_>) -> bool {
        let core = &*self.core;
        if path != 0 {
            return false;
        }
        bump(&core.counters.bus_resets);
        core.gate_close();
        let claimed = core.tracker.mark_reserved_reset(|a| a.path == path, irql);
        self.transport.reset(irql);
        core.gate_open();
        core.log(LogKind::BusReset, None, claimed as u64, irql);
        true
    }

    /// Checks what `build_io` can check without resources.
    fn classify(&self, srb: &S::Srb) -> Result<(), SrbStatus> {
        let core = &*self.core;
        match srb.function() {
            SrbFunction::ExecuteScsi
            | SrbFunction::ResetDevice
            | SrbFunction::ResetLogicalUnit
            | SrbFunction::Pnp => core.check_address(srb.address()),
            SrbFunction::ResetBus => {
                if srb.address().path == 0 {
                    Ok(())
                } else {
                    Err(SrbStatus::INVALID_PATH_ID)
                }
            }
            SrbFunction::AbortCommand
            | SrbFunction::Flush
            | SrbFunction::Shutdown
            | SrbFunction::Power => Ok(()),
            SrbFunction::IoControl | SrbFunction::Wmi | SrbFunction::Other(_) => {
                Err(SrbStatus::INVALID_REQUEST)
            }
        }
    }
}

impl<S: StorPort, T: Transport> HwMiniport<S> for Adapter<S, T> {
    type Context = CoreContext<T>;

    const SRB_EXTENSION_WORDS: usize = 1;
    const DPC_COUNT: u8 = 1;
    const TIMER_COUNT: u8 = 0;

    fn find_adapter(
        port: S,
        context: &CoreContext<T>,
        _argument: Option<&[u8]>,
        irql: &Passive<'_>,
    ) -> Result<(Self, AdapterLimits), FindAdapterError> {
        let config = context.config;
        config.check()?;
        let platform = port.platform().clone();
        let core = Arc::new(Core::new(port, config, irql));
        let upcalls = Upcalls::new(core.clone());
        let transport = Arc::new(
            (context.make_transport)(upcalls, irql).map_err(|_| FindAdapterError::Resources)?,
        );
        let worker = Worker::new(&platform, 1, irql).map_err(|_| FindAdapterError::Resources)?;
        let rundown = Rundown::new(&platform, |_: &Dispatch<'_>| {}, irql)
            .map_err(|_| FindAdapterError::Resources)?;
        let control = Control {
            core: core.clone(),
            transport: transport.clone(),
            run: PassiveMutex::new(RunState::default()),
        };
        let control = RequestQueue::new(&worker, control, 2, rundown.clone(), irql)
            .map_err(|_| FindAdapterError::Resources)?;
        Ok((
            Self {
                core,
                transport,
                control,
                rundown,
                _worker: worker,
            },
            config.limits(),
        ))
    }

    fn initialize(&self, _irql: &Dirql<'_>) -> bool {
        true
    }

    fn passive_initialize(&self, irql: &Passive<'_>) -> bool {
        // Connecting may take a while: the worker does it, and targets
        // appear through bus change notifications as they log in.
        self.core.want_running.store(true, Ordering::Release);
        self.reconcile(irql);
        true
    }

    fn build_io<I: LeDispatch>(&self, srb: &mut S::Srb, _irql: &I) -> BuildIo {
        match self.classify(srb) {
            Ok(()) => BuildIo::Proceed,
            Err(status) => {
                if srb.function() == SrbFunction::ExecuteScsi {
                    // As `complete_local`: nothing moved, no target status.
                    srb.set_data_transfer_length(0);
                    srb.set_scsi_status(0);
                }
                srb.set_srb_status(status);
                BuildIo::Complete
            }
        }
    }

    fn start_io<I: LeDispatch>(&self, srb: S::Srb, irql: &I) {
        let core = &*self.core;
        // `build_io` classified this request just before (both trampolines
        // run it first, and again after a BUSY requeue); the arms below
        // check what they index by themselves.
        match srb.function() {
            SrbFunction::ExecuteScsi => self.start_scsi(srb, irql),
            SrbFunction::AbortCommand => self.start_abort(srb, irql),
            SrbFunction::ResetDevice | SrbFunction::ResetLogicalUnit => {
                self.start_lun_reset(srb, irql);
            }
            SrbFunction::ResetBus => {
                let path = srb.address().path;
                let ok = with_dispatch::<S::Platform, _, _>(irql, |d| self.reset_bus_now(path, d));
                let status = if ok {
                    SrbStatus::SUCCESS
                } else {
                    SrbStatus::INVALID_PATH_ID
                };
                core.complete_local(srb, status, irql);
            }
            // The initiator caches nothing: the target's cache is flushed by
            // the class driver's SYNCHRONIZE CACHE, an EXECUTE_SCSI.
            SrbFunction::Flush | SrbFunction::Shutdown | SrbFunction::Power => {
                core.complete_local(srb, SrbStatus::SUCCESS, irql);
            }
            SrbFunction::Pnp => {
                if let Err(status) = core.check_address(srb.address()) {
                    core.complete_local(srb, status, irql);
                    return;
                }
                let status = match srb.pnp_action() {
                    Some(
                        PnpAction::StartDevice
                        | PnpAction::StopDevice
                        | PnpAction::RemoveDevice
                        | PnpAction::SurpriseRemoval,
                    ) => SrbStatus::SUCCESS,
                    // No capabilities to report: say so rather than return
                    // an unfilled structure as success.
                    _ => SrbStatus::INVALID_REQUEST,
                };
                core.complete_local(srb, status, irql);
            }
            SrbFunction::IoControl | SrbFunction::Wmi | SrbFunction::Other(_) => {
                core.complete_local(srb, SrbStatus::INVALID_REQUEST, irql);
            }
        }
    }

    fn execution_routine(&self, srb: S::Srb, irql: &Dispatch<'_>) {
        let core = &*self.core;
        let word = srb
            .extension()
            .first()
            .map_or(0, |w| w.load(Ordering::Acquire));
        let tag = Tag(u32::try_from(word & u64::from(u32::MAX)).unwrap_or(0));
        let meta = Meta {
            kind: EntryKind::Command {
                requested: srb.data_transfer_length(),
                has_sg: true,
            },
            address: srb.address(),
            identity: srb.identity(),
            disposition: Disposition::Proceed,
        };
        if word & EXTENSION_TAG_VALID == 0 {
            // Not a request this core sent for its list.
            bump(&core.counters.contract_violations);
            core.finish_local(srb, SrbStatus::INTERNAL_ERROR, true, irql);
            return;
        }
        // Only data transfers ask for a list.
        let direction = if word & EXTENSION_DATA_OUT == 0 {
            DataDirection::In
        } else {
            DataDirection::Out
        };
        self.submit(srb, tag, meta, direction, irql);
    }

    fn reset_bus(&self, path: u8, irql: &Dispatch<'_>) -> bool {
        self.reset_bus_now(path, irql)
    }

    fn supported_controls(&self) -> SupportedControls {
        SupportedControls {
            stop: true,
            restart: true,
        }
    }

    fn stop_adapter(&self, _irql: &Dirql<'_>) -> bool {
        let core = &*self.core;
        core.want_running.store(false, Ordering::Release);
        core.state
            .store(AdapterState::Stopping.code(), Ordering::Release);
        core.port.issue_dpc(ADAPTER_CONTROL_DPC);
        true
    }

    fn restart_adapter(&self, _irql: &Dirql<'_>) -> bool {
        let core = &*self.core;
        core.want_running.store(true, Ordering::Release);
        core.state
            .store(AdapterState::Starting.code(), Ordering::Release);
        core.port.issue_dpc(ADAPTER_CONTROL_DPC);
        true
    }

    fn dpc(&self, dpc: DpcId, irql: &Dispatch<'_>) {
        if dpc == ADAPTER_CONTROL_DPC {
            self.reconcile(irql);
        }
    }

    fn timer(&self, _timer: TimerId, _irql: &Dispatch<'_>) {}

    fn free_adapter_resources(&self, irql: &Passive<'_>) {
        let core = &*self.core;
        core.want_running.store(false, Ordering::Release);
        self.control.shutdown(irql);
        {
            let mut run = self.control.handler().run.lock(irql);
            if run.started {
                self.transport.stop(irql);
                run.started = false;
            }
            run.freed = true;
        }
        core.state
            .store(AdapterState::Stopped.code(), Ordering::Release);
        let _ = self.rundown.destroy();
    }
}
