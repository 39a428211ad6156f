//! The engine: targets, their channels, recovery, and the [`Transport`]
//! the miniport core drives.
//!
//! [`SrpTransport`] is created at `find_adapter` (passive) with the
//! device, the port's connection manager and the attached targets
//! ([`TargetParams`], parsed from the registry). Everything it will ever
//! need on the I/O path — slots, page arrays, free lists, timers — is
//! allocated then; connections (QP, CQ, IU buffers, MR pool) are created
//! per login on the engine's own passive worker.
//!
//! # Locks
//! Per target: `ctl` (the recovery machine and the connection attempt).
//! Per channel: `state` (connection, credits, send-queue budget, free
//! slots — one lock, so credit and connection state change together).
//! Per command or TMF slot: the slot's own lock. The order is
//! slot → kverbs' send-queue lock → kverbs' MR-pool lock; the target and
//! channel locks are leaves (nothing is taken while they are held, and no
//! verbs call is made under them). No lock is held across an upcall.
//!
//! # IRQL
//! `new`, `start` and `stop` run at `PASSIVE_LEVEL`; everything else at
//! <= `DISPATCH_LEVEL`, without allocation. Dropping a started handle
//! queues `stop` on the engine's worker (see [`SrpTransport`]).

use alloc::boxed::Box;
use alloc::sync::{Arc, Weak};
use alloc::vec::Vec;
use core::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, Ordering};
use core::time::Duration;

use hca_lowlevel::wire::{Gid, Ipv4Address, Psn};
use kverbs::cm::rdma_cm::RdmaCmEndpoints;
use kverbs::cm::{CmHandler, CmPort, ConnParams, ConnectRequest, LocalQp, MadAddress};
use kverbs::cq::Cq;
use kverbs::device::Device;
use kverbs::irql::{AnyIrql, Dispatch, LeDispatch, Passive};
use kverbs::pd::Pd;
use kverbs::platform::{AllocError, DpcTarget, Platform, RawTimer};
use kverbs::qp::Qp;
use kverbs::rundown::Rundown;
use kverbs::sync::{SpinLock, with_dispatch};
use kverbs::wire::{CmPathRepr, IbTimeout, PortSpace, ServiceId, cm::PERMISSIVE_LID};
use kverbs::worker::{CompleteAt, Outcome, RequestQueue, WorkHandler, Worker};

use super::channel::Channel;
use super::conn::{Conn, ConnLink, ConnShape, IuLayout, RX_REPOST_HELD, WrCtx};
use super::login::{self, DEFAULT_MAX_IMM_DATA, LoginFailure, LoginForm, LoginPlan, login_request};
use super::mapping::PAGE;
use super::params::{Addressing, TargetParams, Timeouts};
use super::recovery::{Actions, Cause, Recovery};
use crate::drop_teardown::{DropTeardown, TearDown, TornDownOnDrop};
use crate::miniport::transport::{
    EngineProbe, FailureKind, PostFailed, PrepareError, ScsiCommand, StartFailed, Tag, TargetState,
    TmfRefused, Transport, Upcalls, wait_bounded,
};
use crate::wire::Lun;
use crate::wire::srp::MultiChannelAction;

/// TMF slots per channel.
pub const TMF_SLOTS: u32 = 4;
/// Response IUs per channel (`SRP_CRED_RSP`, `SRP_AER_RSP`).
pub const RSP_IUS: u32 = 4;
/// Receive buffers beyond the command and TMF slots, for target requests.
pub const UNSOLICITED_RECVS: u32 = 8;
/// Largest page list one MR maps (Linux: `SRP_MAX_PAGES_PER_MR` 512).
pub const MAX_PAGES_PER_MR: u32 = 512;
/// Linux's `SRP_ABORT_TIMEOUT_MS`.
pub const DEFAULT_TMF_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest sense data kept per command (SPC: 252).
pub const SENSE_MAX: usize = 252;
/// Longest a stop waits for connections to end before giving up on them.
const STOP_WAIT: Duration = Duration::from_secs(60);

/// Engine-wide settings (the adapter's registry tunables).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SrpConfig {
    /// The HCA port to use.
    pub port: u8,
    /// `reconnect_delay`, `fast_io_fail_tmo`, `dev_loss_tmo`.
    pub timeouts: Timeouts,
    /// Ask targets for immediate data (`use_imm_data`).
    pub use_imm_data: bool,
    /// Longest immediate data (`max_imm_data`).
    pub max_imm_data: u32,
    /// Channels per target when its `add_target` has no `ch_count`.
    pub default_ch_count: u32,
    /// How long a task management function may take (Linux: 5 s).
    pub tmf_timeout: Duration,
    /// The local ACK timeout exponent of IB CM paths (RDMA/CM derives its
    /// own from the port's packet lifetime).
    pub ib_ack_timeout: u8,
}

impl Default for SrpConfig {
    fn default() -> Self {
        SrpConfig {
            port: 1,
            timeouts: Timeouts::default(),
            use_imm_data: true,
            max_imm_data: DEFAULT_MAX_IMM_DATA,
            default_ch_count: 1,
            tmf_timeout: DEFAULT_TMF_TIMEOUT,
            ib_ack_timeout: 19,
        }
    }
}

/// Why the engine could not be created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SrpError {
    /// Memory, a DPC, a timer or the worker could not be allocated.
    Alloc,
    /// The configuration does not fit the device (named).
    Config(&'static str),
    /// More than 255 targets.
    TooManyTargets,
}

impl From<AllocError> for SrpError {
    fn from(_: AllocError) -> Self {
        SrpError::Alloc
    }
}

/// Per-target sizes, fixed at creation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Sizing {
    pub queue_size: u32,
    pub max_transfer: u32,
    pub max_pages_per_mr: u32,
    pub max_runs: u32,
    pub max_pages: u32,
    pub pool_size: u32,
    pub it_iu_len: u32,
    pub send_wqebbs: u32,
    pub scratch_len: u32,
    pub channels: u32,
}

impl Sizing {
    fn new(params: &TargetParams, config: &SrpConfig, dev_pages: u32, dev_wr: u32) -> Self {
        let max_transfer = params.max_transfer_bytes();
        let max_pages_per_mr = MAX_PAGES_PER_MR.min(dev_pages).max(1);
        let mr_bytes = u64::from(max_pages_per_mr) * PAGE;
        // A buffer not starting on a page takes one page more.
        let mr_per_cmd =
            u32::try_from((u64::from(max_transfer) + PAGE).div_ceil(mr_bytes)).unwrap_or(1);
        let max_runs = u32::from(params.cmd_sg_entries);
        let max_pages = max_transfer
            .div_ceil(4096)
            .saturating_add(params.sg_tablesize.saturating_mul(2))
            .saturating_add(1);
        let queue_size = params.queue_size;
        let it_iu_len = login::max_it_iu_len(
            params.cmd_sg_entries,
            config.use_imm_data,
            config.max_imm_data,
            params.max_it_iu_size,
        );
        let per_cmd = 1 + 4 * mr_per_cmd;
        let largest = 1 + 4 * max_runs;
        let send_wqebbs = queue_size
            .saturating_mul(per_cmd)
            .saturating_add(largest)
            .saturating_add(TMF_SLOTS + RSP_IUS + 4)
            .min(dev_wr.saturating_sub(8).max(64));
        Sizing {
            queue_size,
            max_transfer,
            max_pages_per_mr,
            max_runs,
            max_pages,
            pool_size: queue_size
                .saturating_mul(mr_per_cmd)
                .saturating_add(max_runs),
            it_iu_len,
            send_wqebbs,
            scratch_len: it_iu_len.max(u32::from(login::IMM_DATA_OFFSET)),
            channels: params
                .ch_count
                .unwrap_or(config.default_ch_count)
                .clamp(1, super::params::MAX_CH_COUNT),
        }
    }

    /// Receive buffer length: the IU length the login asks for, which is
    /// what `ib_srpt` echoes as its `max_ti_iu_len`.
    pub(crate) fn rx_len(&self) -> u32 {
        self.it_iu_len.max(login::MIN_USABLE_TI_IU_LEN)
    }

    /// Receive buffers: one per command, TMF and unsolicited target
    /// request, and the ones a connection may hold back from reposting
    /// ([`RX_REPOST_HELD`]: they are never counted on).
    pub(crate) fn rx_count(&self) -> u32 {
        self.queue_size + TMF_SLOTS + UNSOLICITED_RECVS + RX_REPOST_HELD
    }
}

/// Counters of one target (snapshots from [`SrpTransport::target_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TargetStats {
    /// Recovery state.
    pub state: Option<TargetState>,
    /// Channels in use (reduced when an extra channel failed to log in).
    pub channels: u8,
    /// Channels logged in now.
    pub live_channels: u8,
    /// The smallest request limit over live channels (`req_lim`).
    pub req_lim: i32,
    /// Commands and TMFs refused for lack of credit (`zero_req_lim`).
    pub zero_req_lim: u64,
    /// Successful channel logins.
    pub logins: u64,
    /// Failed channel logins.
    pub login_failures: u64,
    /// The last login failure's code ([`LoginFailure::code`]).
    pub last_login_failure: u32,
    /// Logins retried with direct descriptors only.
    pub direct_only_retries: u64,
    /// Connection attempts (first login and reconnects).
    pub connect_attempts: u64,
    /// Transport failures of live channels.
    pub transport_failures: u64,
    /// Why the engine last ended a connection: `0x1_oo_ss` a work
    /// completion error (opcode `oo` as kverbs numbers them, syndrome
    /// `ss`), `0x2_000k` a fatal QP event (k: 1 fatal, 2 request error,
    /// 3 access error), `0x3_0000` the peer's DREQ,
    /// `0x4_0000` a protocol violation, `0x5_0000` a target logout,
    /// `0x6_0000` a receive repost failure, `0x7_0000` a send batch that
    /// could not be built.
    pub last_transport_failure: u32,
    /// `SRP_CRED_REQ` received.
    pub cred_reqs: u64,
    /// `SRP_AER_REQ` received.
    pub aer_reqs: u64,
    /// `SRP_T_LOGOUT` received.
    pub t_logouts: u64,
    /// IUs from the target the protocol does not allow (each ends the
    /// connection).
    pub protocol_errors: u64,
    /// Responses for tags not outstanding (late, duplicate or forged).
    pub stale_responses: u64,
    /// Responses owed to target requests that found no IU (dropped).
    pub dropped_responses: u64,
    /// Task management IUs sent (a LUN reset sends one per live channel).
    pub tmfs_sent: u64,
    /// Task management functions that timed out.
    pub tmf_timeouts: u64,
    /// Writes sent with immediate data.
    pub immediate_writes: u64,
    /// Commands with one direct descriptor.
    pub direct_commands: u64,
    /// Commands with an indirect descriptor list.
    pub indirect_commands: u64,
    /// `prepare` refusals: no credit.
    pub busy_credit: u64,
    /// `prepare` refusals: no slot, MR or send-queue room.
    pub busy_resources: u64,
    /// Commands completed.
    pub completed: u64,
    /// Commands completed by a connection flush (fenced by the QP).
    pub fenced_by_flush: u64,
    /// Ended connections whose objects (CQ, MR pool, IU MRs, PD) were
    /// released.
    pub released_conns: u64,
    /// Of those, connections whose MR pool could not be destroyed because
    /// MRs never came back to it (its mkeys stay allocated: a leak).
    pub leaked_mr_pools: u64,
}

#[derive(Default)]
pub(crate) struct Counters {
    pub logins: AtomicU64,
    pub login_failures: AtomicU64,
    pub last_login_failure: AtomicU32,
    pub direct_only_retries: AtomicU64,
    pub connect_attempts: AtomicU64,
    pub transport_failures: AtomicU64,
    pub last_transport_failure: AtomicU32,
    pub cred_reqs: AtomicU64,
    pub aer_reqs: AtomicU64,
    pub t_logouts: AtomicU64,
    pub protocol_errors: AtomicU64,
    pub stale_responses: AtomicU64,
    pub dropped_responses: AtomicU64,
    pub tmfs_sent: AtomicU64,
    pub tmf_timeouts: AtomicU64,
    pub immediate_writes: AtomicU64,
    pub direct_commands: AtomicU64,
    pub indirect_commands: AtomicU64,
    pub busy_credit: AtomicU64,
    pub busy_resources: AtomicU64,
    pub completed: AtomicU64,
    pub fenced_by_flush: AtomicU64,
    pub released_conns: AtomicU64,
    pub leaked_mr_pools: AtomicU64,
}

pub(crate) fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// Why a connection was ended by the engine (for the counters).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Why {
    /// A work completion with an error: the raw syndrome and the opcode.
    WcError(u8, u8),
    /// A fatal asynchronous QP event: 1 fatal, 2 request error, 3 access
    /// error.
    QpEvent(u8),
    /// The peer ended the connection (DREQ).
    PeerDisconnect,
    /// An IU the protocol does not allow.
    Protocol,
    /// `SRP_T_LOGOUT`.
    TargetLogout,
    /// A receive could not be reposted.
    Repost,
    /// A send batch could not be built as planned.
    Batch,
}

impl Why {
    /// The code [`TargetStats::last_transport_failure`] reports:
    /// `0x1000 | opcode << 8 | syndrome`... see the variants.
    pub(crate) const fn code(self) -> u32 {
        match self {
            Why::WcError(syndrome, opcode) => 0x1_0000 | ((opcode as u32) << 8) | syndrome as u32,
            Why::QpEvent(kind) => 0x2_0000 | kind as u32,
            Why::PeerDisconnect => 0x3_0000,
            Why::Protocol => 0x4_0000,
            Why::TargetLogout => 0x5_0000,
            Why::Repost => 0x6_0000,
            Why::Batch => 0x7_0000,
        }
    }
}

/// The connection attempt of a target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Attempt {
    channel: u8,
    epoch: u32,
}

struct TargetCtl {
    recovery: Recovery,
    attempt: Option<Attempt>,
    next_epoch: u32,
    running: bool,
}

/// One attached target.
pub(crate) struct Target<P: Platform> {
    pub index: u8,
    pub params: TargetParams,
    pub sizing: Sizing,
    pub channels: Box<[Channel<P>]>,
    /// Channels in use.
    pub active: AtomicU8,
    /// `TargetState` code of the recovery machine, mirrored (under `ctl`)
    /// for the I/O path.
    state: AtomicU8,
    /// The state last reported to the core.
    reported: AtomicU8,
    reporting: AtomicBool,
    report_pending: AtomicBool,
    direct_only: AtomicBool,
    ctl: SpinLock<TargetCtl, P>,
    timer: P::Timer,
    pub counters: Counters,
}

impl<P: Platform> Target<P> {
    /// Mirrors the recovery machine's state (called with `ctl` held).
    fn mirror(&self, recovery: &Recovery) {
        self.state
            .store(state_code(recovery.state()), Ordering::Release);
    }

    pub(crate) fn state(&self) -> TargetState {
        state_from_code(self.state.load(Ordering::Acquire))
    }

    /// The failure a command that cannot be carried now gets.
    pub(crate) fn failure_kind(&self) -> FailureKind {
        match self.state() {
            TargetState::FailFast => FailureKind::FailFast,
            TargetState::Lost => FailureKind::DeviceLost,
            _ => FailureKind::ConnectionReset,
        }
    }
}

const fn state_code(s: TargetState) -> u8 {
    match s {
        TargetState::Connecting => 0,
        TargetState::Live => 1,
        TargetState::Blocked => 2,
        TargetState::FailFast => 3,
        TargetState::Lost => 4,
    }
}

const fn state_from_code(c: u8) -> TargetState {
    match c {
        1 => TargetState::Live,
        2 => TargetState::Blocked,
        3 => TargetState::FailFast,
        4 => TargetState::Lost,
        _ => TargetState::Connecting,
    }
}

/// Nanoseconds on the platform clock.
pub(crate) fn now_ns<P: Platform>() -> u64 {
    let ticks = u128::from(P::now().0);
    let tps = u128::from(P::ticks_per_second().max(1));
    u64::try_from(ticks * 1_000_000_000 / tps).unwrap_or(u64::MAX)
}

/// Slow-path requests (run on the engine's passive worker).
pub(crate) enum SlowRequest<P: Platform> {
    /// Build a connection and send its login.
    Connect {
        target: u8,
        channel: u8,
        epoch: u32,
        plan: LoginPlan,
    },
    /// Free a destroyed connection's objects.
    Release(Arc<Conn<P>>),
}

pub(crate) enum SlowOutput {
    Connect {
        target: u8,
        channel: u8,
        epoch: u32,
        ok: bool,
    },
    Released,
}

/// Where the timers and the worker find the engine (set once it exists,
/// so they can be created before it).
pub(crate) struct Back<P: Platform> {
    engine: SpinLock<Weak<Engine<P>>, P>,
}

impl<P: Platform> Back<P> {
    fn get(&self, irql: &impl LeDispatch) -> Option<Arc<Engine<P>>> {
        self.engine.lock(irql).upgrade()
    }
}

pub(crate) struct SlowPath<P: Platform> {
    back: Arc<Back<P>>,
}

impl<P: Platform> WorkHandler for SlowPath<P> {
    type Request = SlowRequest<P>;
    type Output = SlowOutput;

    fn execute(&self, request: SlowRequest<P>, irql: &Passive<'_>) -> SlowOutput {
        let engine = self.back.get(irql);
        match request {
            SlowRequest::Connect {
                target,
                channel,
                epoch,
                plan,
            } => {
                let ok = engine
                    .as_ref()
                    .is_some_and(|e| e.connect_channel(target, channel, epoch, plan, irql));
                SlowOutput::Connect {
                    target,
                    channel,
                    epoch,
                    ok,
                }
            }
            SlowRequest::Release(conn) => {
                if let Some(e) = &engine {
                    e.release_conn(&conn, irql);
                }
                SlowOutput::Released
            }
        }
    }

    fn complete(&self, outcome: Outcome<SlowRequest<P>, SlowOutput>, irql: AnyIrql<'_, '_>) {
        let run = |d: &Dispatch<'_>| {
            let Some(engine) = self.back.get(d) else {
                return;
            };
            match outcome {
                Outcome::Done(SlowOutput::Connect {
                    target,
                    channel,
                    epoch,
                    ok,
                }) => {
                    if !ok {
                        engine.channel_login_failed(
                            target,
                            channel,
                            epoch,
                            LoginFailure::Resources,
                            d,
                        );
                    }
                }
                Outcome::Cancelled(SlowRequest::Connect {
                    target,
                    channel,
                    epoch,
                    ..
                }) => {
                    engine.channel_login_failed(target, channel, epoch, LoginFailure::Resources, d);
                }
                Outcome::Cancelled(SlowRequest::Release(conn)) => {
                    // The worker is shutting down (stop): release inline is not
                    // possible here; the connection is forgotten (the device
                    // reclaims its objects when it closes).
                    engine.forget_conn(&conn, d);
                }
                Outcome::Done(SlowOutput::Released) => {}
            }
        };
        match irql {
            AnyIrql::Dispatch(d) => run(d),
            AnyIrql::Passive(p) => with_dispatch::<P, _, _>(p, run),
        }
    }
}

/// The engine (shared by the transport handle, the handlers, the timers).
pub(crate) struct Engine<P: Platform> {
    upcalls: Upcalls,
    device: Device<P>,
    cm: CmPort<P>,
    pub config: SrpConfig,
    port_gid: Gid,
    pub targets: Box<[Target<P>]>,
    slow: Option<RequestQueue<P, SlowPath<P>>>,
    _worker: Worker<P>,
    _back: Arc<Back<P>>,
    /// Every connection built and not yet released: owned by the
    /// transport handle, not by the engine (see [`ConnRegistry`]).
    conns: Weak<ConnRegistry<P>>,
    /// LUN resets waiting for their channels' answers.
    pub(crate) lun_resets: super::reset_group::ResetGroups<P>,
    running: AtomicBool,
    src_port: AtomicU32,
}

impl<P: Platform> Engine<P> {
    pub(crate) fn device(&self) -> &Device<P> {
        &self.device
    }

    pub(crate) fn cm(&self) -> &CmPort<P> {
        &self.cm
    }

    pub(crate) fn upcalls(&self) -> &Upcalls {
        &self.upcalls
    }

    pub(crate) fn target(&self, index: u8) -> Option<&Target<P>> {
        self.targets.get(usize::from(index))
    }

    // -- target control ---------------------------------------------------

    /// Applies a recovery machine's actions (no lock held).
    fn apply(&self, t: &Target<P>, actions: Actions, irql: &impl LeDispatch) {
        if let Some(cause) = actions.teardown {
            for ch in t.channels.iter() {
                self.retire_channel(t, ch, cause, irql);
            }
        }
        if actions.state.is_some() {
            self.report_state(t, irql);
        }
        if actions.connect {
            self.begin_attempt(t, irql);
        }
        self.arm_timer(t, irql);
    }

    /// Tells the core the target's state, serialised per target without a
    /// lock held across the upcall: one reporter at a time loops until the
    /// state it last reported is the latest; others only leave a note.
    fn report_state(&self, t: &Target<P>, irql: &impl LeDispatch) {
        t.report_pending.store(true, Ordering::Release);
        loop {
            if t.reporting.swap(true, Ordering::AcqRel) {
                // The reporter sees the note.
                return;
            }
            while t.report_pending.swap(false, Ordering::AcqRel) {
                let state = t.state.load(Ordering::Acquire);
                if t.reported.swap(state, Ordering::AcqRel) != state {
                    let state = state_from_code(state);
                    with_dispatch::<P, _, _>(irql, |d| {
                        self.upcalls.target_state(t.index, state, d);
                        if state == TargetState::Live {
                            // Requests held back while it was down may go.
                            self.upcalls.credits_available(t.index, d);
                        }
                    });
                }
            }
            t.reporting.store(false, Ordering::Release);
            // A note left after the last look and before the release.
            if !t.report_pending.load(Ordering::Acquire) {
                return;
            }
        }
    }

    /// Starts a connection attempt: channel 0 first (`SINGLE`).
    fn begin_attempt(&self, t: &Target<P>, irql: &impl LeDispatch) {
        bump(&t.counters.connect_attempts);
        let epoch = {
            let mut ctl = t.ctl.lock(irql);
            if !ctl.running {
                return;
            }
            ctl.next_epoch = ctl.next_epoch.wrapping_add(1);
            let epoch = ctl.next_epoch;
            ctl.attempt = Some(Attempt { channel: 0, epoch });
            epoch
        };
        self.submit_connect(t, 0, epoch, irql);
    }

    fn plan_for(&self, t: &Target<P>, channel: u8) -> LoginPlan {
        LoginPlan {
            multichannel: if channel == 0 {
                MultiChannelAction::Single
            } else {
                MultiChannelAction::Multi
            },
            direct_only: t.direct_only.load(Ordering::Acquire),
            immediate: self.config.use_imm_data,
            max_imm_data: self.config.max_imm_data,
        }
    }

    fn submit_connect(&self, t: &Target<P>, channel: u8, epoch: u32, irql: &impl LeDispatch) {
        let plan = self.plan_for(t, channel);
        if let Some(ch) = t.channels.get(usize::from(channel)) {
            ch.state.lock(irql).pending = Some(epoch);
        }
        let request = SlowRequest::Connect {
            target: t.index,
            channel,
            epoch,
            plan,
        };
        let submitted = self
            .slow
            .as_ref()
            .is_some_and(|q| q.submit(request, CompleteAt::Dispatch, irql).is_ok());
        if !submitted {
            with_dispatch::<P, _, _>(irql, |d| {
                self.channel_login_failed(t.index, channel, epoch, LoginFailure::Resources, d);
            });
        }
    }

    /// Passive: builds a channel's connection and sends its login.
    fn connect_channel(
        self: &Arc<Self>,
        target: u8,
        channel: u8,
        epoch: u32,
        plan: LoginPlan,
        irql: &Passive<'_>,
    ) -> bool {
        let Some(t) = self.target(target) else {
            return false;
        };
        let Some(ch) = t.channels.get(usize::from(channel)) else {
            return false;
        };
        if !self.running.load(Ordering::Acquire) || ch.state.lock(irql).pending != Some(epoch) {
            return false;
        }
        let sizing = &t.sizing;
        let login = login_request(&t.params, self.port_gid.interface_id(), &plan);
        let shape = ConnShape {
            layout: IuLayout::new(
                sizing.queue_size,
                sizing.it_iu_len,
                TMF_SLOTS,
                RSP_IUS,
                sizing.rx_count(),
                sizing.rx_len(),
            ),
            send_wqebbs: sizing.send_wqebbs,
            pool_size: sizing.pool_size,
            max_pages_per_mr: sizing.max_pages_per_mr,
            dpc_target: DpcTarget::Processor(t.params.comp_vector.wrapping_add(u32::from(channel))),
            port: self.config.port,
        };
        let conn = match Conn::build(self, &self.cm, target, channel, epoch, login, &shape, irql) {
            Ok(conn) => conn,
            Err(_) => return false,
        };
        {
            let mut st = ch.state.lock(irql);
            if st.pending != Some(epoch) || !self.running.load(Ordering::Acquire) {
                drop(st);
                conn.retire(Cause::Stop, irql);
                return false;
            }
            st.attach(Arc::clone(&conn), &ch.sq);
        }
        let mut buf = [0u8; 64];
        let form = match t.params.addressing {
            Addressing::IbCm { .. } => LoginForm::IbCm,
            Addressing::RdmaCm { .. } => LoginForm::RdmaCm,
        };
        let Ok(data) = login::private_data(&conn.login, form, &mut buf) else {
            conn.retire(Cause::Transport, irql);
            return false;
        };
        let handler: Arc<dyn CmHandler> = conn.handler.clone();
        let params = ConnParams {
            retry_count: t.params.tl_retry_count,
            ..ConnParams::SRP
        };
        let result = match t.params.addressing {
            Addressing::RdmaCm { src, dest, port } => {
                let src = src.map_or_else(
                    || self.port_gid.to_ipv4().unwrap_or(Ipv4Address([0; 4])),
                    Ipv4Address,
                );
                let endpoints = RdmaCmEndpoints {
                    port_space: PortSpace::Tcp,
                    src,
                    src_port: self.next_src_port(),
                    dst: Ipv4Address(dest),
                    dst_port: port,
                };
                self.cm.connect_rdma_cm(
                    &endpoints,
                    data,
                    params,
                    None::<Psn>,
                    &conn.cm_qp,
                    &handler,
                    irql,
                )
            }
            Addressing::IbCm {
                dgid,
                pkey,
                service_id,
            } => {
                if pkey & 0x7fff != 0x7fff {
                    // Only the default partition exists on this port.
                    Err(kverbs::cm::CmError::InvalidParameter(
                        "pkey not in the port's table",
                    ))
                } else {
                    let remote = Gid(dgid);
                    let request = ConnectRequest {
                        service_id: ServiceId(service_id),
                        peer: MadAddress::cm(remote),
                        path: CmPathRepr {
                            local_lid: PERMISSIVE_LID,
                            remote_lid: PERMISSIVE_LID,
                            local_gid: self.port_gid,
                            remote_gid: remote,
                            flow_label: 0,
                            packet_rate: 0,
                            traffic_class: 0,
                            hop_limit: 64,
                            sl: 0,
                            subnet_local: false,
                            local_ack_timeout: IbTimeout::from_low_bits(self.config.ib_ack_timeout),
                        },
                        path_mtu: self.cm.port_mtu(),
                        qp: LocalQp {
                            qpn: hca_lowlevel::wire::Qpn::from_low_bits(conn.qp.qpn()),
                            starting_psn: None,
                        },
                        params,
                        private_data: data,
                    };
                    self.cm.connect(&request, &conn.cm_qp, &handler, irql)
                }
            }
        };
        match result {
            Ok(id) => {
                conn.connect_issued(Some(id), irql);
                true
            }
            Err(_) => {
                conn.retire(Cause::Transport, irql);
                conn.connect_issued(None, irql);
                false
            }
        }
    }

    fn next_src_port(&self) -> u16 {
        // Ephemeral ports for the RDMA/CM header (informational to the
        // target).
        let n = self.src_port.fetch_add(1, Ordering::Relaxed);
        0xC000 | (n as u16 & 0x3FFF)
    }

    /// A channel logged in.
    pub(crate) fn channel_logged_in(
        &self,
        target: u8,
        channel: u8,
        epoch: u32,
        irql: &Dispatch<'_>,
    ) {
        let Some(t) = self.target(target) else {
            return;
        };
        bump(&t.counters.logins);
        let next = {
            let mut ctl = t.ctl.lock(irql);
            match ctl.attempt {
                Some(a) if a.channel == channel && a.epoch == epoch => {
                    let next = channel.saturating_add(1);
                    if next < t.active.load(Ordering::Acquire) {
                        ctl.next_epoch = ctl.next_epoch.wrapping_add(1);
                        let epoch = ctl.next_epoch;
                        ctl.attempt = Some(Attempt {
                            channel: next,
                            epoch,
                        });
                        Some(Some((next, epoch)))
                    } else {
                        ctl.attempt = None;
                        Some(None)
                    }
                }
                _ => None,
            }
        };
        match next {
            Some(Some((next, epoch))) => self.submit_connect(t, next, epoch, irql),
            Some(None) => {
                let actions = {
                    let mut ctl = t.ctl.lock(irql);
                    let a = ctl.recovery.connect_finished(now_ns::<P>(), true);
                    t.mirror(&ctl.recovery);
                    a
                };
                self.apply(t, actions, irql);
            }
            None => {
                // Not the attempt's channel: a stale login; end it.
                if let Some(ch) = t.channels.get(usize::from(channel)) {
                    let conn = ch.state.lock(irql).conn_of(epoch);
                    if let Some(conn) = conn {
                        self.retire_conn(t, ch, &conn, Cause::Stop, irql);
                    }
                }
            }
        }
    }

    /// A channel's login failed (or its connection could not be built).
    pub(crate) fn channel_login_failed(
        &self,
        target: u8,
        channel: u8,
        epoch: u32,
        failure: LoginFailure,
        irql: &Dispatch<'_>,
    ) {
        let Some(t) = self.target(target) else {
            return;
        };
        if let Some(ch) = t.channels.get(usize::from(channel)) {
            let mut st = ch.state.lock(irql);
            if st.pending == Some(epoch) {
                st.pending = None;
            }
        }
        let is_attempt = {
            let ctl = t.ctl.lock(irql);
            ctl.attempt
                .is_some_and(|a| a.channel == channel && a.epoch == epoch)
        };
        if !is_attempt {
            return;
        }
        bump(&t.counters.login_failures);
        t.counters
            .last_login_failure
            .store(failure.code(), Ordering::Relaxed);
        let direct_only = t.direct_only.load(Ordering::Acquire);
        if failure.retry_direct_only(direct_only) {
            // The target refused indirect descriptors: offer direct only,
            // now and from now on.
            t.direct_only.store(true, Ordering::Release);
            bump(&t.counters.direct_only_retries);
            let epoch = {
                let mut ctl = t.ctl.lock(irql);
                ctl.next_epoch = ctl.next_epoch.wrapping_add(1);
                let epoch = ctl.next_epoch;
                ctl.attempt = Some(Attempt { channel, epoch });
                epoch
            };
            self.submit_connect(t, channel, epoch, irql);
            return;
        }
        if channel > 0 {
            // An extra channel failed: use fewer (Linux reduces ch_count).
            t.active.fetch_min(channel, Ordering::AcqRel);
            let actions = {
                let mut ctl = t.ctl.lock(irql);
                ctl.attempt = None;
                let a = ctl.recovery.connect_finished(now_ns::<P>(), true);
                t.mirror(&ctl.recovery);
                a
            };
            self.apply(t, actions, irql);
            return;
        }
        let actions = {
            let mut ctl = t.ctl.lock(irql);
            ctl.attempt = None;
            let mut a = ctl.recovery.connect_finished(now_ns::<P>(), false);
            t.mirror(&ctl.recovery);
            // Whatever of the attempt exists goes.
            a.teardown = a.teardown.or(Some(Cause::Transport));
            a
        };
        self.apply(t, actions, irql);
    }

    /// A live channel of `t` failed: the target recovers.
    pub(crate) fn target_failed(&self, t: &Target<P>, irql: &impl LeDispatch) {
        bump(&t.counters.transport_failures);
        let actions = {
            let mut ctl = t.ctl.lock(irql);
            if !ctl.running {
                return;
            }
            let a = ctl.recovery.transport_failed(now_ns::<P>());
            t.mirror(&ctl.recovery);
            if a.teardown.is_some() {
                ctl.attempt = None;
            }
            a
        };
        self.apply(t, actions, irql);
    }

    /// Tears a channel down (its current connection, and any pending
    /// attempt on it).
    fn retire_channel(&self, t: &Target<P>, ch: &Channel<P>, cause: Cause, irql: &impl LeDispatch) {
        let conn = {
            let mut st = ch.state.lock(irql);
            st.pending = None;
            st.detach(&ch.sq)
        };
        if let Some(conn) = conn {
            self.retire_conn(t, ch, &conn, cause, irql);
        }
    }

    pub(crate) fn retire_conn(
        &self,
        _t: &Target<P>,
        ch: &Channel<P>,
        conn: &Arc<Conn<P>>,
        cause: Cause,
        irql: &impl LeDispatch,
    ) {
        {
            let mut st = ch.state.lock(irql);
            if st.is_current(conn) {
                st.detach(&ch.sq);
            }
        }
        conn.retire(cause, irql);
    }

    /// A connection failed on its own (QP error, bad completion, protocol
    /// violation, DREQ).
    pub(crate) fn conn_failed(
        &self,
        conn: &Arc<Conn<P>>,
        cause: Cause,
        why: Why,
        irql: &Dispatch<'_>,
    ) {
        let Some(t) = self.target(conn.target) else {
            return;
        };
        if conn.life.lock(irql).phase != super::conn::Phase::Retiring {
            t.counters
                .last_transport_failure
                .store(why.code(), Ordering::Relaxed);
        }
        let Some(ch) = t.channels.get(usize::from(conn.channel)) else {
            return;
        };
        let was_live = {
            let st = ch.state.lock(irql);
            st.is_current(conn) && st.live
        };
        let phase = conn.life.lock(irql).phase;
        self.retire_conn(t, ch, conn, cause, irql);
        if was_live {
            self.target_failed(t, irql);
        } else if phase == super::conn::Phase::Connecting {
            self.channel_login_failed(
                conn.target,
                conn.channel,
                conn.epoch,
                LoginFailure::Disconnected,
                irql,
            );
        }
    }

    // -- timers -------------------------------------------------------------

    fn arm_timer(&self, t: &Target<P>, irql: &impl LeDispatch) {
        let now = now_ns::<P>();
        let recovery = t.ctl.lock(irql).recovery.next_deadline();
        let tmf = t
            .channels
            .iter()
            .filter_map(|ch| ch.tmf_deadline(irql))
            .min();
        let due = match (recovery, tmf) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        if let Some(due) = due {
            t.timer
                .set(Duration::from_nanos(due.saturating_sub(now)), irql);
        }
    }

    pub(crate) fn rearm(&self, t: &Target<P>, irql: &impl LeDispatch) {
        self.arm_timer(t, irql);
    }

    fn on_timer(&self, target: u8, irql: &Dispatch<'_>) {
        let Some(t) = self.target(target) else {
            return;
        };
        let now = now_ns::<P>();
        let actions = {
            let mut ctl = t.ctl.lock(irql);
            if !ctl.running {
                return;
            }
            let a = ctl.recovery.timer(now);
            t.mirror(&ctl.recovery);
            if a.teardown.is_some() {
                ctl.attempt = None;
            }
            a
        };
        for ch in t.channels.iter() {
            self.expire_tmfs(t, ch, now, irql);
        }
        self.apply(t, actions, irql);
    }

    // -- connection teardown ------------------------------------------------

    /// The QP is gone: release the connection's objects on the worker.
    pub(crate) fn on_qp_destroyed(&self, conn: &Arc<Conn<P>>, irql: &Dispatch<'_>) {
        let submitted = self.slow.as_ref().is_some_and(|q| {
            q.submit(
                SlowRequest::Release(Arc::clone(conn)),
                CompleteAt::Dispatch,
                irql,
            )
            .is_ok()
        });
        if !submitted {
            self.forget_conn(conn, irql);
        }
    }

    /// Passive: frees a destroyed connection's CQ, pool, MRs and PD.
    fn release_conn(&self, conn: &Arc<Conn<P>>, irql: &Passive<'_>) {
        let _ = conn.cq.destroy(irql);
        // MRs still out belong to requests completing right now; give
        // them a moment (bounded).
        let mut leaked = true;
        for _ in 0..1000 {
            match conn.pool.destroy(irql) {
                Err(kverbs::error::VerbsError::InUse) => {
                    self.device.platform().delay(Duration::from_millis(1), irql);
                }
                _ => {
                    leaked = false;
                    break;
                }
            }
        }
        if let Some(t) = self.target(conn.target) {
            bump(&t.counters.released_conns);
            if leaked {
                bump(&t.counters.leaked_mr_pools);
            }
        }
        let _ = conn.tx.dereg(irql);
        let _ = conn.rx.dereg(irql);
        // The PD outlives its QP only briefly; dealloc may report objects
        // still tied to it if the pool could not be destroyed.
        let _ = conn.pd.dealloc(irql);
        self.forget_conn_at(conn, irql);
    }

    /// Keeps `link` (a connection and this engine) until the connection's
    /// objects are released. Once the transport handle is gone the link is
    /// dropped at once: nothing of the engine is reachable through it.
    ///
    /// # IRQL
    /// `PASSIVE_LEVEL` (the registry may grow).
    pub(crate) fn register_conn(&self, link: Arc<ConnLink<P>>, irql: &Passive<'_>) {
        let Some(registry) = self.conns.upgrade() else {
            return;
        };
        let conns = &registry.links;
        loop {
            let need = {
                let mut conns = conns.lock(irql);
                if conns.len() < conns.capacity() {
                    // Within capacity: no allocation under the lock.
                    conns.push(link);
                    return;
                }
                conns.capacity().saturating_mul(2).saturating_add(8)
            };
            // Grow at PASSIVE_LEVEL, outside the lock; move over under it.
            let mut bigger = Vec::with_capacity(need);
            {
                let mut conns = conns.lock(irql);
                if conns.capacity() < need && conns.len() <= need {
                    bigger.extend(conns.drain(..));
                    core::mem::swap(&mut *conns, &mut bigger);
                }
            }
            drop(bigger);
        }
    }

    fn forget_conn(&self, conn: &Arc<Conn<P>>, irql: &Dispatch<'_>) {
        self.forget_conn_at(conn, irql);
    }

    fn forget_conn_at(&self, conn: &Arc<Conn<P>>, irql: &impl LeDispatch) {
        let Some(registry) = self.conns.upgrade() else {
            return;
        };
        let removed = {
            let mut conns = registry.links.lock(irql);
            conns
                .iter()
                .position(|link| Arc::ptr_eq(&link.conn, conn))
                .map(|i| conns.swap_remove(i))
        };
        // The last reference may drop here, outside the lock.
        drop(removed);
    }

    /// Passive: cleans up after a build that failed once the QP existed.
    pub(crate) fn release_partial(
        &self,
        qp: Qp<P, WrCtx>,
        cq: Cq<P, WrCtx>,
        pd: Pd<P>,
        irql: &Passive<'_>,
    ) {
        let _ = qp.destroy(irql);
        // Destroy is asynchronous; the CQ refuses while the QP is attached.
        for _ in 0..10_000 {
            match cq.destroy(irql) {
                Err(kverbs::error::VerbsError::InUse) => {
                    self.device.platform().delay(Duration::from_millis(1), irql);
                }
                _ => break,
            }
        }
        let _ = pd.dealloc(irql);
    }

    fn conns_alive(&self, irql: &impl LeDispatch) -> usize {
        self.conns
            .upgrade()
            .map_or(0, |registry| registry.links.lock(irql).len())
    }

    /// Stops every target: disconnects and flushes its channels, waits
    /// (bounded) for the connections to be released and the slow path to
    /// go quiet, and resets the channels, which completes every command
    /// and TMF still outstanding. [`Transport::stop`], and the teardown of
    /// a started handle dropped without it ([`SrpTransport`]'s `Drop`).
    ///
    /// # IRQL
    /// `PASSIVE_LEVEL`: waits, bounded (`STOP_WAIT`).
    fn shut_down(&self, irql: &Passive<'_>) {
        for t in self.targets.iter() {
            let actions = {
                let mut ctl = t.ctl.lock(irql);
                ctl.running = false;
                ctl.attempt = None;
                let a = ctl.recovery.stop();
                t.mirror(&ctl.recovery);
                a
            };
            t.timer.cancel(irql);
            self.apply(t, actions, irql);
            t.timer.cancel(irql);
        }
        self.running.store(false, Ordering::Release);
        // Bounded wait: every teardown step is bounded (CM disconnect does
        // not wait for the peer; flush and destroy are local).
        wait_bounded(self.device.platform(), STOP_WAIT, irql, || {
            self.conns_alive(irql) == 0
                && self.slow.as_ref().is_none_or(|q| q.in_use(irql) == 0)
                && self
                    .targets
                    .iter()
                    .all(|t| t.channels.iter().all(|c| c.is_idle(irql)))
        });
        for t in self.targets.iter() {
            t.timer.cancel(irql);
            for ch in t.channels.iter() {
                ch.state.lock(irql).reset_after_stop(&ch.sq);
            }
        }
    }
}

/// The connections an engine built and has not released yet, each as a
/// [`ConnLink`] (the connection and the engine, held strongly).
///
/// # Ownership
/// The transport handle ([`SrpTransport`]) owns the registry; the engine
/// refers to it weakly. A link's strong engine reference therefore makes
/// no cycle the handle cannot end: the engine lives while the handle does
/// (as before) or a link is in use. A handle dropped stopped (or never
/// started) drops the registry and every link still in it with it — an
/// ordinary drop of the vector, with no lock and no IRQL to take — which
/// lets the engine go too. A handle dropped started moves its registry
/// and engine to the teardown ([`TornDownOnDrop`]), which holds both until
/// the stop it runs has released every connection, then drops them on the
/// worker. A connection leaves the registry when its objects are released
/// (`release_conn`) or forgotten (`forget_conn`); from then on no handler
/// of it reaches the engine.
pub(crate) struct ConnRegistry<P: Platform> {
    links: SpinLock<Vec<Arc<ConnLink<P>>>, P>,
}

/// What an [`SrpTransport`] owns: the engine and its connections. If the
/// handle is dropped while the engine runs, the teardown owns them
/// instead, until the stop it runs has released them.
pub(crate) struct Kept<P: Platform> {
    engine: Arc<Engine<P>>,
    /// The engine's live connections (see [`ConnRegistry`]).
    conns: Arc<ConnRegistry<P>>,
}

impl<P: Platform> TearDown for Kept<P> {
    fn needs_tear_down(&self) -> bool {
        self.engine.running.load(Ordering::Acquire)
    }

    fn tear_down(self, irql: &Passive<'_>) {
        let Kept { engine, conns } = self;
        // As `stop()`: disconnect, flush, release (waits, bounded), and
        // complete whatever was in flight. No upcall follows it.
        engine.shut_down(irql);
        // Links still registered after the bounded wait go first. Moved
        // here from the handle, not cloned: these are the handle's only
        // references, let go here, at PASSIVE_LEVEL.
        drop(conns);
        drop(engine);
    }
}

/// The SRP initiator engine: a [`Transport`] for the miniport core.
///
/// Dropping a started handle without [`Transport::stop`] stops it anyway,
/// asynchronously: the drop (at any IRQL <= `DISPATCH_LEVEL`; it neither
/// blocks nor allocates) moves the engine and its connections to the
/// engine's passive worker, into a request slot reserved for it at
/// creation (`TornDownOnDrop`). Until that has run, the connections
/// still exist; then every channel has been disconnected, every command
/// and TMF in flight at the drop has completed once (as `stop()`
/// completes them), no upcall follows, and the handle's references to
/// the engine go there, at `PASSIVE_LEVEL`.
pub struct SrpTransport<P: Platform> {
    kept: TornDownOnDrop<P, Kept<P>>,
}

impl<P: Platform> core::fmt::Debug for SrpTransport<P> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("SrpTransport")
            .field("targets", &self.kept.engine.targets.len())
            .finish()
    }
}

/// What the adapter must tell StorPort for these targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdapterShape {
    /// Largest transfer every target takes.
    pub max_transfer_bytes: u32,
    /// Largest scatter/gather list every target takes, minus one.
    pub physical_breaks: u32,
    /// Commands every channel of every target can hold at once.
    pub max_io: u32,
    /// Commands per LUN (the smallest `max_cmd_per_lun`).
    pub max_io_per_lun: u32,
}

impl<P: Platform> SrpTransport<P> {
    /// The StorPort limits for `targets` under `config` (for the core's
    /// `AdapterConfig`).
    #[must_use]
    pub fn adapter_shape(targets: &[TargetParams], config: &SrpConfig) -> AdapterShape {
        let mut shape = AdapterShape {
            max_transfer_bytes: u32::MAX,
            physical_breaks: u32::MAX,
            max_io: 0,
            max_io_per_lun: u32::MAX,
        };
        for p in targets {
            let channels = p.ch_count.unwrap_or(config.default_ch_count).max(1);
            shape.max_transfer_bytes = shape.max_transfer_bytes.min(p.max_transfer_bytes());
            shape.physical_breaks = shape.physical_breaks.min(p.sg_tablesize.saturating_sub(1));
            let per_target = p.queue_size.saturating_mul(channels);
            let per_target = p.target_can_queue.map_or(per_target, |c| c.min(per_target));
            shape.max_io = shape.max_io.saturating_add(per_target);
            shape.max_io_per_lun = shape.max_io_per_lun.min(p.max_cmd_per_lun);
        }
        if targets.is_empty() {
            shape = AdapterShape {
                max_transfer_bytes: 0,
                physical_breaks: 0,
                max_io: 1,
                max_io_per_lun: 1,
            };
        }
        shape
    }

    /// Creates the engine for `targets` on `device`'s port
    /// `config.port`, logging in through `cm` (that port's connection
    /// manager). Nothing connects until [`Transport::start`].
    ///
    /// # Errors
    /// [`SrpError`].
    ///
    /// # IRQL
    /// `PASSIVE_LEVEL` (allocates everything the engine will use).
    pub fn new(
        device: &Device<P>,
        cm: &CmPort<P>,
        config: SrpConfig,
        targets: &[TargetParams],
        upcalls: Upcalls,
        irql: &Passive<'_>,
    ) -> Result<Self, SrpError> {
        if targets.len() > usize::from(u8::MAX) {
            return Err(SrpError::TooManyTargets);
        }
        config
            .timeouts
            .validate()
            .map_err(|_| SrpError::Config("timeouts"))?;
        let port_gid = device
            .ports()
            .iter()
            .find(|p| p.port == config.port)
            .map(|p| p.gid)
            .ok_or(SrpError::Config("port"))?;
        let attr = *device.attr();
        let platform = device.platform().clone();
        // Two work items: the slow path, and the teardown of a handle
        // dropped started, which waits for the slow path's releases.
        let worker = Worker::new(&platform, 2, irql)?;
        let back = Arc::new(Back {
            engine: SpinLock::new(Weak::new()),
        });
        let mut built_targets = Vec::with_capacity(targets.len());
        let mut queue_slots = 8usize;
        for (i, params) in targets.iter().enumerate() {
            let index = u8::try_from(i).map_err(|_| SrpError::TooManyTargets)?;
            let sizing = Sizing::new(
                params,
                &config,
                attr.max_fast_reg_page_list_len,
                attr.max_qp_wr,
            );
            if sizing.send_wqebbs < 1 + 4 * sizing.max_runs + TMF_SLOTS + RSP_IUS {
                return Err(SrpError::Config("send queue too small for cmd_sg_entries"));
            }
            let channels: Box<[Channel<P>]> = (0..sizing.channels)
                .map(|c| Channel::new(u8::try_from(c).unwrap_or(u8::MAX), &sizing))
                .collect();
            queue_slots += channels.len() * 4;
            let timer = {
                let back = Arc::clone(&back);
                platform.new_timer(
                    Box::new(move |d: &Dispatch<'_>| {
                        if let Some(e) = back.get(d) {
                            e.on_timer(index, d);
                        }
                    }),
                    irql,
                )?
            };
            built_targets.push(Target {
                index,
                params: *params,
                sizing,
                active: AtomicU8::new(u8::try_from(sizing.channels).unwrap_or(u8::MAX)),
                channels,
                state: AtomicU8::new(state_code(TargetState::Connecting)),
                reported: AtomicU8::new(state_code(TargetState::Connecting)),
                reporting: AtomicBool::new(false),
                report_pending: AtomicBool::new(false),
                direct_only: AtomicBool::new(false),
                ctl: SpinLock::new(TargetCtl {
                    recovery: Recovery::new(config.timeouts),
                    attempt: None,
                    next_epoch: 0,
                    running: false,
                }),
                timer,
                counters: Counters::default(),
            });
        }
        let rundown = Rundown::new(&platform, |_: &Dispatch<'_>| {}, irql)?;
        let slow = RequestQueue::new(
            &worker,
            SlowPath {
                back: Arc::clone(&back),
            },
            queue_slots,
            rundown,
            irql,
        )?;
        let conns = Arc::new(ConnRegistry {
            links: SpinLock::new(Vec::with_capacity(queue_slots)),
        });
        let drop_teardown = DropTeardown::new(&worker, irql)?;
        let engine = Arc::new(Engine {
            upcalls,
            device: device.clone(),
            cm: cm.clone(),
            config,
            port_gid,
            targets: built_targets.into_boxed_slice(),
            slow: Some(slow),
            _worker: worker,
            _back: Arc::clone(&back),
            conns: Arc::downgrade(&conns),
            lun_resets: super::reset_group::ResetGroups::new(),
            running: AtomicBool::new(false),
            src_port: AtomicU32::new(0),
        });
        *back.engine.lock(irql) = Arc::downgrade(&engine);
        Ok(SrpTransport {
            kept: TornDownOnDrop::new(Kept { engine, conns }, drop_teardown),
        })
    }

    /// A weak view of the engine, for teardown tests: whether anything
    /// (a connection's handler, a registry entry) still keeps it alive
    /// once the handle is gone.
    #[must_use]
    pub fn engine_probe(&self) -> EngineProbe {
        EngineProbe::new(&self.kept.engine)
    }

    /// A target's counters.
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    pub fn target_stats(&self, target: u8, irql: &impl LeDispatch) -> Option<TargetStats> {
        let t = self.kept.engine.target(target)?;
        let c = &t.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut stats = TargetStats {
            state: Some(t.state()),
            channels: t.active.load(Ordering::Acquire),
            logins: get(&c.logins),
            login_failures: get(&c.login_failures),
            last_login_failure: c.last_login_failure.load(Ordering::Relaxed),
            direct_only_retries: get(&c.direct_only_retries),
            connect_attempts: get(&c.connect_attempts),
            transport_failures: get(&c.transport_failures),
            last_transport_failure: c.last_transport_failure.load(Ordering::Relaxed),
            cred_reqs: get(&c.cred_reqs),
            aer_reqs: get(&c.aer_reqs),
            t_logouts: get(&c.t_logouts),
            protocol_errors: get(&c.protocol_errors),
            stale_responses: get(&c.stale_responses),
            dropped_responses: get(&c.dropped_responses),
            tmfs_sent: get(&c.tmfs_sent),
            tmf_timeouts: get(&c.tmf_timeouts),
            immediate_writes: get(&c.immediate_writes),
            direct_commands: get(&c.direct_commands),
            indirect_commands: get(&c.indirect_commands),
            busy_credit: get(&c.busy_credit),
            busy_resources: get(&c.busy_resources),
            completed: get(&c.completed),
            fenced_by_flush: get(&c.fenced_by_flush),
            released_conns: get(&c.released_conns),
            leaked_mr_pools: get(&c.leaked_mr_pools),
            req_lim: i32::MAX,
            ..TargetStats::default()
        };
        for ch in t.channels.iter() {
            let st = ch.state.lock(irql);
            stats.zero_req_lim += st.credits.zero_req_lim();
            if st.live {
                stats.live_channels += 1;
                stats.req_lim = stats.req_lim.min(st.credits.req_lim());
            }
        }
        if stats.live_channels == 0 {
            stats.req_lim = 0;
        }
        Some(stats)
    }

    /// Connections built and not yet released (zero once a stop returned).
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    pub fn open_connections(&self, irql: &impl LeDispatch) -> usize {
        self.kept.engine.conns_alive(irql)
    }

    /// The current login's negotiated limits of one channel (tests and
    /// diagnostics).
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    pub fn negotiated(
        &self,
        target: u8,
        channel: u8,
        irql: &impl LeDispatch,
    ) -> Option<super::login::Negotiated> {
        let t = self.kept.engine.target(target)?;
        let ch = t.channels.get(usize::from(channel))?;
        let conn = ch.state.lock(irql).current()?;
        conn.negotiated(irql)
    }

    /// The QP number of a channel's current connection (tests use it to
    /// inject faults).
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    pub fn channel_qpn(&self, target: u8, channel: u8, irql: &impl LeDispatch) -> Option<u32> {
        let t = self.kept.engine.target(target)?;
        let ch = t.channels.get(usize::from(channel))?;
        let conn = ch.state.lock(irql).current()?;
        Some(conn.qp.qpn())
    }
}

impl<P: Platform> Transport for SrpTransport<P> {
    type Prepared = super::channel::SrpPrepared;

    fn prepare(
        &self,
        command: &ScsiCommand<'_>,
        irql: &impl LeDispatch,
    ) -> Result<Self::Prepared, PrepareError> {
        self.kept.engine.prepare(command, irql)
    }

    fn post(&self, prepared: Self::Prepared, irql: &impl LeDispatch) -> Result<(), PostFailed> {
        self.kept.engine.post(prepared, irql)
    }

    fn discard(&self, prepared: Self::Prepared, irql: &impl LeDispatch) {
        self.kept.engine.discard(prepared, irql);
    }

    fn abort_task(
        &self,
        target: u8,
        lun: Lun,
        victim: Tag,
        tmf: Tag,
        irql: &impl LeDispatch,
    ) -> Result<(), TmfRefused> {
        self.kept.engine.abort_task(target, lun, victim, tmf, irql)
    }

    fn reset_lun(
        &self,
        target: u8,
        lun: Lun,
        tmf: Tag,
        irql: &impl LeDispatch,
    ) -> Result<(), TmfRefused> {
        self.kept.engine.reset_lun(target, lun, tmf, irql)
    }

    fn reset(&self, irql: &impl LeDispatch) {
        let e = &self.kept.engine;
        for t in e.targets.iter() {
            let actions = {
                let mut ctl = t.ctl.lock(irql);
                if !ctl.running {
                    continue;
                }
                let a = ctl.recovery.reset(now_ns::<P>());
                t.mirror(&ctl.recovery);
                if a.teardown.is_some() {
                    ctl.attempt = None;
                }
                a
            };
            e.apply(t, actions, irql);
        }
    }

    fn start(&self, irql: &Passive<'_>) -> Result<(), StartFailed> {
        let e = &self.kept.engine;
        e.running.store(true, Ordering::Release);
        for t in e.targets.iter() {
            let actions = {
                let mut ctl = t.ctl.lock(irql);
                ctl.running = true;
                ctl.attempt = None;
                let a = ctl.recovery.start(now_ns::<P>());
                t.mirror(&ctl.recovery);
                a
            };
            e.apply(t, actions, irql);
        }
        Ok(())
    }

    fn stop(&self, irql: &Passive<'_>) {
        self.kept.engine.shut_down(irql);
    }
}
