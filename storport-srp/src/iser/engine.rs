//! The engine: targets, their connection, the fast path and recovery (see
//! the [module docs](super)).

#![allow(
    clippy::type_complexity,
    clippy::collapsible_match,
    clippy::collapsible_if,
    clippy::large_enum_variant,
    reason = "completion dispatch reads best as written; the command item is moved once per completion"
)]

use alloc::boxed::Box;
use alloc::collections::VecDeque;
use alloc::sync::{Arc, Weak};
use alloc::vec::Vec;
use core::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use core::time::Duration;

use hca_lowlevel::device::{AccessFlags, AsyncEvent, QpType};
use hca_lowlevel::dma::PhysAddr;
use hca_lowlevel::wire::{Gid, Ipv4Address, Psn};
use kverbs::cm::qp::init_attrs;
use kverbs::cm::rdma_cm::RdmaCmEndpoints;
use kverbs::cm::{CmEvent, CmHandler, CmId, CmPort, CmQp, ConnParams};
use kverbs::cq::{Cq, CqConfig, CqHandler};
use kverbs::device::Device;
use kverbs::error::VerbsError;
use kverbs::irql::{AnyIrql, Dispatch, LeDispatch, Passive};
use kverbs::mr::{FrMr, FrPool, Mr};
use kverbs::pd::Pd;
use kverbs::platform::{AllocError, DpcTarget, Platform, RawTimer};
use kverbs::qp::{Qp, QpConfig, QpHandler};
use kverbs::rundown::Rundown;
use kverbs::sync::{SpinLock, with_dispatch};
use kverbs::wire::PortSpace;
use kverbs::worker::{CompleteAt, Outcome, RequestQueue, WorkHandler, Worker};
use kverbs::wr::{Completion, FastReg, Payload, SendWr, Sge, Signal, WcStatus};

use crate::drop_teardown::{DropTeardown, TearDown, TornDownOnDrop};
use crate::gather::{IMM_DATA_SGES, gather_prefix, send_wqebbs};
use crate::iscsi::Millis;
use crate::iscsi::description::{Portal, TargetDescription};
use crate::iscsi::login::{Disposition, Login, LoginStart, LoginStep, Negotiated};
use crate::iscsi::recovery::{Recovery, RecoveryStep};
use crate::iscsi::session::{
    CommandSpec, PreparedCommand, Session, SessionEvents, SessionFailure, SessionState, task_attr,
};
use crate::miniport::transport::{
    CommandOutcome, CommandResult, EngineProbe, FailureKind, PostFailed, PrepareError, Residual,
    ScsiCommand, StartFailed, Tag, TargetState, TmfRefused, TmfResponse, Transport, Upcalls,
    wait_bounded,
};
use crate::srp::mapping::{self, PAGE_SHIFT, Run};
use crate::storport::DataDirection;
use crate::wire::Lun;
use crate::wire::iscsi::{BHS_LEN, SerialNumber};
use crate::wire::iser::{
    CM_HEADER_LEN, HEADER_LEN, IserCmFlags, IserCmHeader, IserCmRepr, IserCtrlRepr, IserHeader,
    RdmaBuf,
};

/// Largest sense data kept per command (SPC: 252).
const SENSE_MAX: usize = 252;
/// Control PDU send buffers (login requests, NOP-Out, TMF, logout, text).
const CTL_BUFS: u8 = 8;
/// Bytes of one control buffer: iSER header and the longest login request.
const CTL_STRIDE: u32 = 2176;
/// Receive buffers beyond the command window: NOP-In, Async, Reject,
/// TMF/logout/text responses (`isert`: `ISERT_MAX_TX_MISC_PDUS` and more).
const RX_MISC: u32 = 16;
/// Login responses carry at most 8192 bytes of text per PDU.
const LOGIN_DATA_MAX: u32 = 8192;
/// Cap on FirstBurstLength the engine offers: unsolicited Data-Out PDUs
/// (and immediate data whose buffer needs more gather entries than a SEND
/// has) are copied into the command's send buffer; the rest is fetched by
/// RDMA READ.
pub const UNSOLICITED_MAX: u32 = 16 * 1024;
/// Largest page list one MR maps (Linux iSER: 512 KiB I/O plus an offset).
const MAX_PAGES_PER_MR: u32 = 512;
/// Receives that may arrive between the last login response and the
/// session's creation on the worker.
const EARLY_MAX: usize = 16;
/// Base of the I/O virtual addresses buffers are registered at.
const IOVA_BASE: u64 = 0x0300_0000_0000_0000;
/// No slot.
const NONE: u16 = u16::MAX;
/// How long `stop` waits for a graceful logout.
const LOGOUT_WAIT: Duration = Duration::from_secs(3);
/// How long `stop` waits for connections to end.
const STOP_WAIT: Duration = Duration::from_secs(60);

/// Engine-wide settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IserConfig {
    /// The HCA port.
    pub port: u8,
    /// Accept remote invalidation (SEND with invalidate) from targets that
    /// offer it (Linux: `!iser_always_reg` says the opposite flag).
    pub accept_remote_invalidate: bool,
    /// Send immediate write data from the request's own buffer, gathered by
    /// the HCA (the default), rather than copied into the send buffer. The
    /// copy remains the path for buffers with more segments than a SEND
    /// gathers; turning this off forces it (to compare the two).
    pub gather_immediate: bool,
}

impl Default for IserConfig {
    fn default() -> Self {
        Self {
            port: 1,
            accept_remote_invalidate: true,
            gather_immediate: true,
        }
    }
}

/// Why the engine could not be created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IserError {
    /// Memory, a timer or the worker could not be allocated.
    Alloc,
    /// The configuration does not fit the device (named).
    Config(&'static str),
    /// More than 255 targets.
    TooManyTargets,
}

impl From<AllocError> for IserError {
    fn from(_: AllocError) -> Self {
        IserError::Alloc
    }
}

/// Counters of one target.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IserStats {
    /// Recovery state.
    pub state: Option<TargetState>,
    /// Connection attempts.
    pub connect_attempts: u64,
    /// Successful logins (sessions created).
    pub logins: u64,
    /// Failed attempts (CM reject, login error).
    pub login_failures: u64,
    /// Connections of live sessions that failed.
    pub transport_failures: u64,
    /// Why the engine last ended a connection (see `Why` codes: `1`
    /// work completion error, `2` QP event, `3` peer disconnect, `4`
    /// protocol, `5` bogus remote invalidation, `6` session failure, `7`
    /// post failure, `8` reset, `9` stop, `10` logged out), or why an
    /// attempt could not start (`13`: no random bytes for the mutual-CHAP
    /// challenge).
    pub last_failure: u32,
    /// The session failure behind the last `6`/`4` above, for diagnosis.
    pub last_session_failure: Option<SessionFailure>,
    /// Responses that arrived ahead of an older StatSN or repeated one
    /// (the target built them on different threads); taken, and
    /// acknowledged in order.
    pub statuses_out_of_order: u64,
    /// Whether the current connection's target invalidates remotely.
    pub remote_invalidate: bool,
    /// Commands fenced by a validated remote invalidation.
    pub remote_invalidations: u64,
    /// Commands fenced by LOCAL_INV.
    pub local_invalidations: u64,
    /// Commands fenced by a QP flush.
    pub fenced_by_flush: u64,
    /// Commands completed to the core.
    pub completed: u64,
    /// `prepare` refusals (window, slots, MRs).
    pub busy: u64,
    /// Writes that carried immediate data.
    pub immediate_writes: u64,
    /// Of those, the ones whose data the HCA gathered from the request's
    /// buffer (the rest were copied into the send buffer).
    pub immediate_gathered: u64,
    /// Unsolicited Data-Out PDUs sent.
    pub data_out_pdus: u64,
    /// Control PDUs sent (NOP-Out, TMF, logout, text).
    pub control_pdus: u64,
    /// Of those, the NOP-Outs that answered the target's own pings (an
    /// unsolicited NOP-In with a target transfer tag).
    pub target_pings_answered: u64,
    /// Task management functions accepted.
    pub tmfs: u64,
    /// Commands refused: the buffer needs more than one MR.
    pub unmappable: u64,
}

#[derive(Default)]
struct Counters {
    connect_attempts: AtomicU64,
    logins: AtomicU64,
    login_failures: AtomicU64,
    transport_failures: AtomicU64,
    last_failure: AtomicU32,
    statuses_out_of_order: AtomicU64,
    remote_invalidate: AtomicBool,
    remote_invalidations: AtomicU64,
    local_invalidations: AtomicU64,
    fenced_by_flush: AtomicU64,
    completed: AtomicU64,
    busy: AtomicU64,
    immediate_writes: AtomicU64,
    immediate_gathered: AtomicU64,
    data_out_pdus: AtomicU64,
    control_pdus: AtomicU64,
    target_pings_answered: AtomicU64,
    tmfs: AtomicU64,
    unmappable: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// The portal of a redirect's `TargetAddress` (`address[:port][,tpgt]`,
/// RFC 7143 §13.8); `None` when it names none the engine can reach.
fn redirect_portal(target_address: &str) -> Option<Portal> {
    let address = target_address.split(',').next().unwrap_or("");
    Portal::parse(address).ok()
}

/// Why the engine ends a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Why {
    WcError,
    QpEvent,
    PeerDisconnect,
    Protocol,
    BogusInvalidate,
    Session,
    Post,
    Reset,
    Stop,
    LoggedOut,
    Login(Disposition),
    Unreachable,
    /// Mutual CHAP is configured and the platform's random generator
    /// failed: no login is attempted with a guessable challenge.
    NoEntropy,
}

impl Why {
    const fn code(self) -> u32 {
        match self {
            Why::WcError => 1,
            Why::QpEvent => 2,
            Why::PeerDisconnect => 3,
            Why::Protocol => 4,
            Why::BogusInvalidate => 5,
            Why::Session => 6,
            Why::Post => 7,
            Why::Reset => 8,
            Why::Stop => 9,
            Why::LoggedOut => 10,
            Why::Login(_) => 11,
            Why::Unreachable => 12,
            Why::NoEntropy => 13,
        }
    }
}

/// Nanoseconds, then milliseconds, on the platform clock.
fn now_ms<P: Platform>() -> Millis {
    let ticks = u128::from(P::now().0);
    let tps = u128::from(P::ticks_per_second().max(1));
    Millis(u64::try_from(ticks * 1000 / tps).unwrap_or(u64::MAX))
}

// ---- connection objects ---------------------------------------------------

/// What a work request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WrCtx {
    Recv(u16),
    /// The last SEND of a command (its PDU and Data-Outs).
    CmdSend {
        slot: u16,
        generation: u32,
    },
    /// A command's LOCAL_INV.
    Inv {
        slot: u16,
        generation: u32,
    },
    /// A control PDU's SEND from control buffer `n`.
    Ctl(u8),
}

/// Byte layout of a connection's buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Layout {
    cmd_stride: u32,
    cmd_count: u32,
    ctl_base: u64,
    tx_len: u64,
    rx_stride: u32,
    rx_count: u32,
}

impl Layout {
    fn cmd_offset(&self, slot: u16) -> u64 {
        u64::from(self.cmd_stride) * u64::from(slot)
    }
    fn ctl_offset(&self, n: u8) -> u64 {
        self.ctl_base + u64::from(CTL_STRIDE) * u64::from(n)
    }
}

/// A connection's life (under its own small lock).
#[derive(Debug, Default)]
struct Life {
    cm_id: Option<CmId>,
    cm_issued: bool,
    cm_terminal: bool,
    disconnect_requested: bool,
    destroy_issued: bool,
    retiring: bool,
}

/// One connection epoch of a target: a new PD, CQ, QP, buffers and MR
/// pool per login, so nothing of an earlier connection (an rkey, a
/// completion) can reach the next.
struct Conn<P: Platform> {
    target: u8,
    epoch: u32,
    layout: Layout,
    pd: Pd<P>,
    cq: Cq<P, WrCtx>,
    qp: Qp<P, WrCtx>,
    cm_qp: Arc<dyn CmQp>,
    tx: Mr<P>,
    rx: Mr<P>,
    pool: FrPool<P>,
    /// The device's reserved lkey: immediate data is gathered from the
    /// request's bus addresses under it.
    reserved_lkey: u32,
    life: SpinLock<Life, P>,
    handler: Arc<Handler<P>>,
}

impl<P: Platform> Conn<P> {
    fn post_recv(&self, index: u16, irql: &impl LeDispatch) -> bool {
        let stride = u64::from(self.layout.rx_stride);
        let Some(sge) = self
            .rx
            .sge(stride * u64::from(index), self.layout.rx_stride)
        else {
            return false;
        };
        let Ok(mut batch) = self.qp.begin_recv(irql) else {
            return false;
        };
        if batch.recv(&[sge], WrCtx::Recv(index)).is_err() {
            return false;
        }
        batch.commit() == 1
    }

    /// Starts ending the connection (idempotent).
    fn retire(&self, cm: &CmPort<P>, irql: &impl LeDispatch) {
        let disconnect = {
            let mut life = self.life.lock(irql);
            if life.retiring {
                return;
            }
            life.retiring = true;
            if life.cm_terminal || life.disconnect_requested {
                None
            } else if let Some(id) = life.cm_id {
                life.disconnect_requested = true;
                Some(id)
            } else {
                None
            }
        };
        if let Some(id) = disconnect {
            match cm.disconnect(id, &[], irql) {
                Ok(()) | Err(kverbs::cm::CmError::Closing) => {}
                Err(_) => self.life.lock(irql).cm_terminal = true,
            }
        }
        let ended = {
            let life = self.life.lock(irql);
            life.cm_terminal || (life.cm_issued && life.cm_id.is_none())
        };
        if ended {
            self.cm_ended(irql);
        }
    }

    fn connect_issued(&self, cm: &CmPort<P>, id: Option<CmId>, irql: &impl LeDispatch) {
        let (disconnect, ended) = {
            let mut life = self.life.lock(irql);
            life.cm_issued = true;
            if life.cm_id.is_none() {
                life.cm_id = id;
            }
            let disconnect = match life.cm_id {
                Some(id) if life.retiring && !life.cm_terminal && !life.disconnect_requested => {
                    life.disconnect_requested = true;
                    Some(id)
                }
                _ => None,
            };
            (
                disconnect,
                id.is_none() || (life.retiring && life.cm_terminal),
            )
        };
        if let Some(id) = disconnect {
            let _ = cm.disconnect(id, &[], irql);
        }
        if ended {
            self.cm_ended(irql);
        }
    }

    /// The CM is done with the QP: flush and destroy it (once).
    fn cm_ended(&self, irql: &impl LeDispatch) {
        let destroy = {
            let mut life = self.life.lock(irql);
            life.cm_terminal = true;
            life.retiring = true;
            !core::mem::replace(&mut life.destroy_issued, true)
        };
        if destroy {
            let _ = self.qp.destroy(irql);
        }
    }
}

/// The handler of one connection's CQ, QP and CM events.
struct Handler<P: Platform> {
    engine: Weak<Engine<P>>,
    /// The connection, kept alive until its objects are released (the
    /// cycle is broken there).
    conn: SpinLock<Option<Arc<Conn<P>>>, P>,
}

impl<P: Platform> Handler<P> {
    fn get(&self, irql: &impl LeDispatch) -> Option<(Arc<Engine<P>>, Arc<Conn<P>>)> {
        let engine = self.engine.upgrade()?;
        let conn = self.conn.lock(irql).clone()?;
        Some((engine, conn))
    }
}

impl<P: Platform> CqHandler<WrCtx> for Handler<P> {
    fn on_completion(&self, completion: Completion<WrCtx>, irql: &Dispatch<'_>) {
        if let Some((engine, conn)) = self.get(irql) {
            engine.on_completion(&conn, &completion, irql);
        }
    }
}

impl<P: Platform> QpHandler for Handler<P> {
    fn on_async_event(&self, event: AsyncEvent, irql: &Dispatch<'_>) {
        if matches!(
            event,
            AsyncEvent::QpFatal { .. }
                | AsyncEvent::QpRequestError { .. }
                | AsyncEvent::QpAccessError { .. }
        ) {
            if let Some((engine, conn)) = self.get(irql) {
                engine.fail(&conn, Why::QpEvent, irql);
            }
        }
    }

    fn on_flushed(&self, _result: Result<(), VerbsError>, irql: &Dispatch<'_>) {
        if let Some((engine, conn)) = self.get(irql) {
            engine.on_flushed(&conn, irql);
        }
    }

    fn on_destroyed(&self, irql: &Dispatch<'_>) {
        if let Some((engine, conn)) = self.get(irql) {
            engine.on_qp_destroyed(&conn, irql);
        }
    }
}

impl<P: Platform> CmHandler for Handler<P> {
    fn on_event(&self, id: CmId, event: CmEvent<'_>, irql: &Dispatch<'_>) {
        let Some((engine, conn)) = self.get(irql) else {
            return;
        };
        {
            let mut life = conn.life.lock(irql);
            if life.cm_id.is_none() {
                life.cm_id = Some(id);
            }
        }
        engine.on_cm_event(&conn, event, irql);
    }
}

// ---- per-target state -----------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotPhase {
    Free,
    /// Prepared, not posted.
    Prepared,
    /// Posted; waiting for its SEND, response and fence.
    Posted,
}

/// A command's result, kept until it is fenced.
#[derive(Clone, Copy)]
struct Stored {
    outcome: CommandOutcome,
    residual: Residual,
    sense_len: u8,
    sense: [u8; SENSE_MAX],
}

/// One command the engine holds (indexed by its own slot number; the
/// session's ITT slot is reused as soon as the session completes a task,
/// while the engine may still be fencing its buffer).
struct IoSlot<P: Platform> {
    phase: SlotPhase,
    generation: u32,
    tag: Tag,
    epoch: u32,
    session_epoch: u32,
    mr: Option<FrMr<P>>,
    /// The key the target was given (0: none).
    rkey: u32,
    send_done: bool,
    fenced: bool,
    inv_posted: bool,
    result: Option<Stored>,
    finish_seq: u64,
    /// Bytes of the command PDU (iSER header included) in the send buffer:
    /// without its immediate data when that is gathered.
    pdu_len: u32,
    /// The immediate data's gather entries in the request's buffer (sent
    /// behind the `pdu_len` bytes); none when it was copied or there is
    /// none.
    imm_sges: [Sge; IMM_DATA_SGES],
    imm_sge_count: u8,
    /// Unsolicited Data-Out PDUs built after it: count and total bytes.
    data_outs: u16,
    data_out_bytes: u32,
    direction: DataDirection,
    transfer_length: u32,
    unsolicited_len: u32,
    pages: u32,
    first_offset: u32,
    /// The buffer's pages (filled at prepare, registered at post).
    page_list: Box<[PhysAddr]>,
}

impl<P: Platform> IoSlot<P> {
    fn new(max_pages: u32) -> Self {
        Self {
            phase: SlotPhase::Free,
            generation: 0,
            tag: Tag(0),
            epoch: 0,
            session_epoch: 0,
            mr: None,
            rkey: 0,
            send_done: false,
            fenced: false,
            inv_posted: false,
            result: None,
            finish_seq: 0,
            pdu_len: 0,
            imm_sges: [Sge::default(); IMM_DATA_SGES],
            imm_sge_count: 0,
            data_outs: 0,
            data_out_bytes: 0,
            direction: DataDirection::None,
            transfer_length: 0,
            unsolicited_len: 0,
            pages: 0,
            first_offset: 0,
            page_list: alloc::vec![PhysAddr(0); max_pages as usize + 1].into_boxed_slice(),
        }
    }

    fn ready(&self) -> bool {
        self.phase == SlotPhase::Posted && self.result.is_some() && self.send_done && self.fenced
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// No connection.
    Down,
    /// The connection is being built or set up by the CM.
    Connecting,
    /// Login PDUs are being exchanged.
    Login,
    /// Login complete; the session is being created on the worker.
    Creating,
    /// Full feature phase.
    Full,
    /// The connection is ending (flush pending).
    Ending,
}

struct TState<P: Platform> {
    running: bool,
    /// `stop` has sent (or is about to send) its logout: the connection
    /// that ends after it is neither a transport failure nor a reason to
    /// connect again, even before `running` is cleared.
    stopping: bool,
    recovery: Recovery,
    phase: Phase,
    epoch: u32,
    conn: Option<Arc<Conn<P>>>,
    login: Option<Login<'static>>,
    session: Option<Session>,
    session_epoch: u32,
    /// Why the current connection is ending.
    why: Option<Why>,
    /// What the session last failed of (with `Why::Session`/`Protocol`).
    last_session_failure: Option<SessionFailure>,
    time2wait: u16,
    /// The connection reached the full feature phase.
    was_full: bool,
    snd_w_inv: bool,
    reset_pending: bool,
    busy_reported: bool,
    slots: Box<[IoSlot<P>]>,
    free: Vec<u16>,
    core_map: Box<[u16]>,
    finishing: Vec<u16>,
    done: VecDeque<u16>,
    tmf_done: VecDeque<(Tag, TmfResponse, u64)>,
    finish_seq: u64,
    ctl_free: u8,
    rx_scratch: Box<[u8]>,
    tx_scratch: Box<[u8]>,
    early: heapless::Vec<(u16, u32, Option<u32>), EARLY_MAX>,
    window_opened: bool,
    /// The mutual-CHAP challenge of the current attempt: drawn from the
    /// platform's CSPRNG at PASSIVE_LEVEL when the attempt connects, used
    /// by its login, and never reused.
    mutual_challenge: Option<[u8; 16]>,
    /// The portal a login redirect named: the next connection attempt
    /// goes there (once; a failure there falls back to the configured
    /// portal, as `iscsid` does).
    redirect: Option<Portal>,
}

/// Sizes fixed at creation.
#[derive(Debug, Clone, Copy)]
struct Sizing {
    cmds_max: u16,
    slots: u16,
    cmd_stride: u32,
    rx_stride: u32,
    rx_count: u32,
    send_wqebbs: u32,
    max_pages: u32,
    max_transfer: u32,
}

impl Sizing {
    fn new(desc: &TargetDescription, dev_pages: u32, dev_wr: u32) -> Self {
        let p = &desc.params;
        let cmds_max = desc.cmds_max.clamp(1, 1024);
        let seg = p.target_recv_data_segment_length.max(512);
        let unsol = p.first_burst_length.min(UNSOLICITED_MAX);
        let pdus = unsol.div_ceil(seg).max(1);
        // Command PDU: iSER header, BHS, extended-CDB AHS, immediate data;
        // then each Data-Out PDU with its own headers.
        let cmd_len = (HEADER_LEN + BHS_LEN + 264) as u32
            + seg.min(unsol)
            + pdus * (HEADER_LEN + BHS_LEN) as u32
            + unsol;
        let rx_data = p.initiator_recv_data_segment_length.max(LOGIN_DATA_MAX);
        let max_pages = MAX_PAGES_PER_MR.min(dev_pages).max(2);
        let rx_count = u32::from(cmds_max) + RX_MISC;
        // Per command: LOCAL_INV + REG_MR (2 WQEBBs inline) + SENDs (the
        // command's two WQEBBs when it gathers its immediate data) + the
        // LOCAL_INV after it; control PDUs besides.
        let per_cmd = 4 + send_wqebbs(1 + IMM_DATA_SGES) + pdus;
        let send_wqebbs = (u32::from(cmds_max) * 2 * per_cmd + u32::from(CTL_BUFS) + 16)
            .min(dev_wr.saturating_sub(8).max(64));
        Sizing {
            cmds_max,
            slots: cmds_max.saturating_mul(2),
            cmd_stride: cmd_len.div_ceil(64) * 64,
            rx_stride: ((HEADER_LEN + BHS_LEN) as u32 + rx_data).div_ceil(64) * 64,
            rx_count,
            send_wqebbs,
            max_pages,
            max_transfer: ((max_pages - 1) << PAGE_SHIFT).min(1 << 20),
        }
    }
}

/// One attached target.
struct Target<P: Platform> {
    index: u8,
    desc: &'static TargetDescription,
    sizing: Sizing,
    st: SpinLock<TState<P>, P>,
    timer: P::Timer,
    counters: Counters,
    state: AtomicU8,
    reported: AtomicU8,
    reporting: AtomicBool,
    report_pending: AtomicBool,
}

/// What the session's upcalls leave (no upcall is made under the lock).
struct Events<'a, P: Platform> {
    slots: &'a mut [IoSlot<P>],
    core_map: &'a [u16],
    finishing: &'a mut Vec<u16>,
    tmf_done: &'a mut VecDeque<(Tag, TmfResponse, u64)>,
    finish_seq: &'a mut u64,
    window_opened: &'a mut bool,
}

impl<P: Platform> SessionEvents for Events<'_, P> {
    fn command_done(&mut self, tag: Tag, result: &CommandResult<'_>) {
        let index = self
            .core_map
            .get((tag.0 & 0xFFFF) as usize)
            .copied()
            .unwrap_or(NONE);
        let Some(s) = self.slots.get_mut(usize::from(index)) else {
            return;
        };
        if s.phase != SlotPhase::Posted || s.tag != tag || s.result.is_some() {
            return;
        }
        let mut sense = [0u8; SENSE_MAX];
        let n = result.sense.len().min(SENSE_MAX);
        if let (Some(d), Some(src)) = (sense.get_mut(..n), result.sense.get(..n)) {
            d.copy_from_slice(src);
        }
        *self.finish_seq += 1;
        s.finish_seq = *self.finish_seq;
        s.result = Some(Stored {
            outcome: result.outcome,
            residual: result.residual,
            sense_len: u8::try_from(n).unwrap_or(0),
            sense,
        });
        if self.finishing.len() < self.finishing.capacity() {
            self.finishing.push(index);
        }
    }

    fn tmf_done(&mut self, tag: Tag, response: TmfResponse) {
        if self.tmf_done.len() < self.tmf_done.capacity() {
            self.tmf_done.push_back((tag, response, *self.finish_seq));
        }
    }

    fn window_open(&mut self) {
        *self.window_opened = true;
    }
}

// ---- the worker -------------------------------------------------------------

enum SlowRequest<P: Platform> {
    Connect {
        target: u8,
        epoch: u32,
    },
    CreateSession {
        target: u8,
        epoch: u32,
        neg: Negotiated,
    },
    Release(Arc<Conn<P>>),
}

struct Back<P: Platform> {
    engine: SpinLock<Weak<Engine<P>>, P>,
}

impl<P: Platform> Back<P> {
    fn get(&self, irql: &impl LeDispatch) -> Option<Arc<Engine<P>>> {
        self.engine.lock(irql).upgrade()
    }
}

struct SlowPath<P: Platform> {
    back: Arc<Back<P>>,
}

impl<P: Platform> WorkHandler for SlowPath<P> {
    type Request = SlowRequest<P>;
    type Output = Option<(u8, u32, bool)>;

    fn execute(&self, request: SlowRequest<P>, irql: &Passive<'_>) -> Option<(u8, u32, bool)> {
        let engine = self.back.get(irql)?;
        match request {
            SlowRequest::Connect { target, epoch } => {
                let ok = engine.connect(target, epoch, irql);
                Some((target, epoch, ok))
            }
            SlowRequest::CreateSession { target, epoch, neg } => {
                engine.create_session(target, epoch, &neg, irql);
                None
            }
            SlowRequest::Release(conn) => {
                engine.release_conn(&conn, irql);
                None
            }
        }
    }

    fn complete(
        &self,
        outcome: Outcome<SlowRequest<P>, Option<(u8, u32, bool)>>,
        irql: AnyIrql<'_, '_>,
    ) {
        let run = |d: &Dispatch<'_>| {
            let Some(engine) = self.back.get(d) else {
                return;
            };
            match outcome {
                Outcome::Done(Some((target, epoch, false)))
                | Outcome::Cancelled(SlowRequest::Connect { target, epoch }) => {
                    engine.connect_failed(target, epoch, d);
                }
                Outcome::Cancelled(SlowRequest::CreateSession { target, epoch, .. }) => {
                    engine.fail_epoch(target, epoch, Why::Post, d);
                }
                Outcome::Cancelled(SlowRequest::Release(conn)) => {
                    let own = conn.handler.conn.lock(d).take();
                    drop(own);
                    engine.conns_alive.fetch_sub(1, Ordering::AcqRel);
                }
                Outcome::Done(_) => {}
            }
        };
        match irql {
            AnyIrql::Dispatch(d) => run(d),
            AnyIrql::Passive(p) => with_dispatch::<P, _, _>(p, run),
        }
    }
}

// ---- the engine -------------------------------------------------------------

/// The engine (shared by the transport handle, handlers and timers).
struct Engine<P: Platform> {
    upcalls: Upcalls,
    device: Device<P>,
    cm: CmPort<P>,
    config: IserConfig,
    port_gid: Gid,
    targets: Box<[Target<P>]>,
    slow: Option<RequestQueue<P, SlowPath<P>>>,
    _worker: Worker<P>,
    _back: Arc<Back<P>>,
    conns_alive: AtomicUsize,
    running: AtomicBool,
    src_port: AtomicU32,
}

/// The iSER transport (see the [module docs](super)).
///
/// Dropping a started handle without [`Transport::stop`] stops it anyway,
/// asynchronously: the drop (at any IRQL <= `DISPATCH_LEVEL`; it neither
/// blocks nor allocates) moves the engine to its passive worker, into a
/// request slot reserved for it at creation (`TornDownOnDrop`). Until
/// that has run, the connections still exist; then each live session has
/// been offered a logout (bounded wait), every connection has ended, every
/// command and TMF in flight at the drop has completed once (failed, as
/// `stop()` completes them), and no upcall follows; the engine is freed
/// there, at `PASSIVE_LEVEL`.
///
/// The handle is the engine's only lasting strong owner (connection
/// handlers, timers and the slow path hold it weakly), so the teardown
/// owns it until the stop has run: a plain drop would free the engine at
/// once and orphan its connections, whose commands would never complete
/// (`tests/tests/iser_teardown.rs`).
pub struct IserTransport<P: Platform> {
    kept: TornDownOnDrop<P, Kept<P>>,
}

/// What an [`IserTransport`] owns: the engine. If the handle is dropped
/// while the engine runs, the teardown owns it instead, until the stop it
/// runs has ended every connection.
struct Kept<P: Platform> {
    engine: Arc<Engine<P>>,
}

impl<P: Platform> TearDown for Kept<P> {
    fn needs_tear_down(&self) -> bool {
        self.engine.running.load(Ordering::Acquire)
    }

    fn tear_down(self, irql: &Passive<'_>) {
        let Kept { engine } = self;
        // As `stop()`: logout, disconnect, flush, release (waits,
        // bounded), completing whatever was in flight. No upcall follows.
        engine.shut_down(irql);
        // Moved here from the handle, not cloned: its only reference, so
        // the engine is freed here, at PASSIVE_LEVEL.
        drop(engine);
    }
}

impl<P: Platform> core::fmt::Debug for IserTransport<P> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("IserTransport")
            .field("targets", &self.kept.engine.targets.len())
            .finish()
    }
}

/// A prepared command (what the core holds between `prepare` and `post`).
#[derive(Debug)]
pub struct IserPrepared {
    target: u8,
    slot: u16,
    generation: u32,
    session_epoch: u32,
    command: PreparedCommand,
}

const fn state_code(s: TargetState) -> u8 {
    s.code() as u8
}

impl<P: Platform> Engine<P> {
    fn target(&self, index: u8) -> Option<&Target<P>> {
        self.targets.get(usize::from(index))
    }

    fn next_src_port(&self) -> u16 {
        let n = self.src_port.fetch_add(1, Ordering::Relaxed);
        49152 + u16::try_from(n % 16384).unwrap_or(0)
    }

    // -- state reports and timers ------------------------------------------

    fn mirror(t: &Target<P>, st: &TState<P>) {
        t.state
            .store(state_code(st.recovery.state()), Ordering::Release);
    }

    /// Tells the core the target's state, one reporter at a time.
    fn report_state(&self, t: &Target<P>, irql: &impl LeDispatch) {
        t.report_pending.store(true, Ordering::Release);
        loop {
            if t.reporting.swap(true, Ordering::AcqRel) {
                return;
            }
            while t.report_pending.swap(false, Ordering::AcqRel) {
                let code = t.state.load(Ordering::Acquire);
                if t.reported.swap(code, Ordering::AcqRel) != code {
                    let state = TargetState::from_code(code);
                    with_dispatch::<P, _, _>(irql, |d| {
                        self.upcalls.target_state(t.index, state, d);
                        if state == TargetState::Live {
                            self.upcalls.credits_available(t.index, d);
                        }
                    });
                }
            }
            t.reporting.store(false, Ordering::Release);
            if !t.report_pending.load(Ordering::Acquire) {
                return;
            }
        }
    }

    fn arm_timer(&self, t: &Target<P>, irql: &impl LeDispatch) {
        let now = now_ms::<P>();
        let due = {
            let st = t.st.lock(irql);
            if !st.running {
                return;
            }
            let mut due = st.recovery.poll_at();
            if let Some(l) = &st.login {
                due = crate::iscsi::earliest(due, l.poll_at());
            }
            if let Some(s) = &st.session {
                due = crate::iscsi::earliest(due, s.poll_at());
            }
            due
        };
        if let Some(due) = due {
            let ms = due.since(now).0.max(1);
            t.timer.set(Duration::from_millis(ms), irql);
        }
    }

    /// After a recovery step (no lock held): report, connect, rearm.
    fn apply(&self, t: &Target<P>, step: RecoveryStep, irql: &impl LeDispatch) {
        if step.state_changed.is_some() {
            self.report_state(t, irql);
        }
        if step.connect {
            self.begin_attempt(t, irql);
        }
        self.arm_timer(t, irql);
    }

    fn on_timer(&self, index: u8, irql: &Dispatch<'_>) {
        let Some(t) = self.target(index) else {
            return;
        };
        let now = now_ms::<P>();
        let mut fail = None;
        let step = {
            let mut st = t.st.lock(irql);
            if !st.running {
                return;
            }
            if let Some(l) = st.login.as_mut() {
                if l.handle_timeout(now).is_err() {
                    fail = Some(Why::Login(Disposition::Retry));
                }
            }
            if let Some(s) = st.session.as_mut() {
                if let Err(f) = s.handle_timeout(now) {
                    if let SessionFailure::TargetDropping { time2wait } = f {
                        st.time2wait = time2wait;
                    }
                    st.last_session_failure = Some(f);
                    fail = Some(Why::Session);
                }
            }
            if fail.is_none() && st.phase == Phase::Full {
                self.transmit_control(t, &mut st, irql);
            }
            let step = st.recovery.handle_timeout(now);
            Self::mirror(t, &st);
            step
        };
        if let Some(why) = fail {
            self.fail_current(t, why, irql);
        }
        self.fail_commands_if_down(t, irql);
        self.apply(t, step, irql);
    }

    // -- connecting ----------------------------------------------------------

    fn begin_attempt(&self, t: &Target<P>, irql: &impl LeDispatch) {
        bump(&t.counters.connect_attempts);
        let epoch = {
            let mut st = t.st.lock(irql);
            if !st.running || st.stopping || st.phase != Phase::Down {
                return;
            }
            st.epoch = st.epoch.wrapping_add(1);
            st.phase = Phase::Connecting;
            st.why = None;
            st.time2wait = 0;
            st.was_full = false;
            st.epoch
        };
        let submitted = self.slow.as_ref().is_some_and(|q| {
            q.submit(
                SlowRequest::Connect {
                    target: t.index,
                    epoch,
                },
                CompleteAt::Dispatch,
                irql,
            )
            .is_ok()
        });
        if !submitted {
            with_dispatch::<P, _, _>(irql, |d| self.connect_failed(t.index, epoch, d));
        }
    }

    /// A connection attempt ended before a connection existed.
    fn connect_failed(&self, index: u8, epoch: u32, irql: &Dispatch<'_>) {
        let Some(t) = self.target(index) else {
            return;
        };
        let step = {
            let mut st = t.st.lock(irql);
            if st.epoch != epoch || st.phase != Phase::Connecting || st.conn.is_some() {
                return;
            }
            st.phase = Phase::Down;
            bump(&t.counters.login_failures);
            let step = st
                .recovery
                .attempt_failed(now_ms::<P>(), Disposition::Retry);
            Self::mirror(t, &st);
            step
        };
        self.fail_commands_if_down(t, irql);
        self.apply(t, step, irql);
    }

    /// Passive: builds the connection's objects and connects.
    fn connect(self: &Arc<Self>, index: u8, epoch: u32, irql: &Passive<'_>) -> bool {
        let Some(t) = self.target(index) else {
            return false;
        };
        {
            let st = t.st.lock(irql);
            if !st.running || st.epoch != epoch || st.phase != Phase::Connecting {
                return false;
            }
        }
        // A fresh, unpredictable challenge per attempt (RFC 7143 §12.1.3:
        // a challenge an attacker can foresee lets it replay a recorded
        // response); BCryptGenRandom's system generator wants PASSIVE_LEVEL,
        // which is why it is drawn here and not in the login.
        let mut challenge = None;
        if t.desc.auth.mutual.is_some() {
            let mut c = [0u8; 16];
            if self.device.platform().fill_random(&mut c, irql).is_err() {
                t.counters
                    .last_failure
                    .store(Why::NoEntropy.code(), Ordering::Relaxed);
                return false;
            }
            challenge = Some(c);
        }
        {
            let mut st = t.st.lock(irql);
            if st.epoch != epoch {
                return false;
            }
            st.mutual_challenge = challenge;
        }
        let Ok(conn) = self.build_conn(t, epoch, irql) else {
            return false;
        };
        let portal;
        {
            let mut st = t.st.lock(irql);
            if !st.running || st.epoch != epoch || st.phase != Phase::Connecting {
                drop(st);
                conn.retire(&self.cm, irql);
                return false;
            }
            st.conn = Some(Arc::clone(&conn));
            portal = st.redirect.take().unwrap_or(t.desc.portal);
        }
        // One receive buffer during login, as isert.
        if !conn.post_recv(0, irql) {
            self.fail(&conn, Why::Post, irql);
            return true;
        }
        let mut flags = IserCmFlags::ZBVA_NOT_SUPPORTED;
        if !self.config.accept_remote_invalidate {
            flags |= IserCmFlags::SEND_WITH_INVALIDATE_NOT_SUPPORTED;
        }
        let mut data = [0u8; CM_HEADER_LEN];
        let _ = IserCmRepr { flags }.emit(&mut IserCmHeader::new_unchecked(&mut data[..]));
        let handler: Arc<dyn CmHandler> = conn.handler.clone();
        let dst = match portal.address {
            core::net::IpAddr::V4(a) => a.octets(),
            core::net::IpAddr::V6(_) => {
                conn.connect_issued(&self.cm, None, irql);
                return true;
            }
        };
        let endpoints = RdmaCmEndpoints {
            port_space: PortSpace::Tcp,
            src: self.port_gid.to_ipv4().unwrap_or(Ipv4Address([0; 4])),
            src_port: self.next_src_port(),
            dst: Ipv4Address(dst),
            dst_port: portal.port,
        };
        let params = ConnParams {
            responder_resources: 4,
            initiator_depth: 1,
            retry_count: 7,
            rnr_retry_count: 6,
            ..ConnParams::SRP
        };
        let result = self.cm.connect_rdma_cm(
            &endpoints,
            &data,
            params,
            None::<Psn>,
            &conn.cm_qp,
            &handler,
            irql,
        );
        match result {
            Ok(id) => conn.connect_issued(&self.cm, Some(id), irql),
            Err(_) => {
                with_dispatch::<P, _, _>(irql, |d| {
                    let mut st = t.st.lock(d);
                    if st.epoch == epoch && st.why.is_none() {
                        st.why = Some(Why::Unreachable);
                    }
                });
                conn.connect_issued(&self.cm, None, irql);
            }
        }
        true
    }

    fn build_conn(
        self: &Arc<Self>,
        t: &Target<P>,
        epoch: u32,
        irql: &Passive<'_>,
    ) -> Result<Arc<Conn<P>>, VerbsError> {
        let sz = &t.sizing;
        let handler = Arc::new(Handler {
            engine: Arc::downgrade(self),
            conn: SpinLock::new(None),
        });
        let pd = self.device.alloc_pd(irql)?;
        let pow2 = |n: u32| {
            n.saturating_add(1)
                .checked_next_power_of_two()
                .unwrap_or(u32::MAX)
        };
        let cq = match Cq::create(
            &self.device,
            CqConfig {
                dpc_target: DpcTarget::Current,
                ..CqConfig::new(pow2(sz.send_wqebbs).saturating_add(pow2(sz.rx_count)))
            },
            handler.clone(),
            irql,
        ) {
            Ok(cq) => cq,
            Err(e) => {
                let _ = pd.dealloc(irql);
                return Err(e);
            }
        };
        let qp = match Qp::create(
            &pd,
            &QpConfig {
                qp_type: QpType::Rc,
                send_cq: cq.clone(),
                recv_cq: cq.clone(),
                send_wqebbs: sz.send_wqebbs,
                recv_slots: sz.rx_count,
                max_recv_sge: 1,
                port: self.config.port,
            },
            self.cm.qp_events(handler.clone(), irql),
            irql,
        ) {
            Ok(qp) => qp,
            Err(e) => {
                let _ = cq.destroy(irql);
                let _ = pd.dealloc(irql);
                return Err(e);
            }
        };
        let layout = Layout {
            cmd_stride: sz.cmd_stride,
            cmd_count: u32::from(sz.slots),
            ctl_base: u64::from(sz.cmd_stride) * u64::from(sz.slots),
            tx_len: u64::from(sz.cmd_stride) * u64::from(sz.slots)
                + u64::from(CTL_STRIDE) * u64::from(CTL_BUFS),
            rx_stride: sz.rx_stride,
            rx_count: sz.rx_count,
        };
        let built = (|| -> Result<(Mr<P>, Mr<P>, FrPool<P>), VerbsError> {
            let (attr, mask) = init_attrs(
                self.config.port,
                AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE,
            );
            qp.modify(&attr, mask, irql)?;
            let tx_len = usize::try_from(layout.tx_len).map_err(|_| VerbsError::InvalidArgument)?;
            let rx_len = usize::try_from(u64::from(layout.rx_stride) * u64::from(layout.rx_count))
                .map_err(|_| VerbsError::InvalidArgument)?;
            let tx = Mr::alloc(&pd, tx_len, AccessFlags::LOCAL_WRITE, irql)?;
            let rx = match Mr::alloc(&pd, rx_len, AccessFlags::LOCAL_WRITE, irql) {
                Ok(rx) => rx,
                Err(e) => {
                    let _ = tx.dereg(irql);
                    return Err(e);
                }
            };
            let pool = match FrPool::new(&pd, usize::from(sz.slots), sz.max_pages, irql) {
                Ok(pool) => pool,
                Err(e) => {
                    let _ = tx.dereg(irql);
                    let _ = rx.dereg(irql);
                    return Err(e);
                }
            };
            Ok((tx, rx, pool))
        })();
        let (tx, rx, pool) = match built {
            Ok(parts) => parts,
            Err(e) => {
                let _ = qp.destroy(irql);
                for _ in 0..10_000 {
                    match cq.destroy(irql) {
                        Err(VerbsError::InUse) => {
                            self.device.platform().delay(Duration::from_millis(1), irql);
                        }
                        _ => break,
                    }
                }
                let _ = pd.dealloc(irql);
                return Err(e);
            }
        };
        let cm_qp: Arc<dyn CmQp> = Arc::new(qp.clone());
        let conn = Arc::new(Conn {
            target: t.index,
            epoch,
            layout,
            pd,
            cq,
            qp,
            cm_qp,
            tx,
            rx,
            pool,
            reserved_lkey: self.device.attr().reserved_lkey,
            life: SpinLock::new(Life::default()),
            handler: handler.clone(),
        });
        *handler.conn.lock(irql) = Some(Arc::clone(&conn));
        self.conns_alive.fetch_add(1, Ordering::AcqRel);
        Ok(conn)
    }

    fn on_cm_event(&self, conn: &Arc<Conn<P>>, event: CmEvent<'_>, irql: &Dispatch<'_>) {
        let Some(t) = self.target(conn.target) else {
            return;
        };
        match event {
            CmEvent::Established { private_data } => {
                // The target's REP flags: no 0x40 means it will send with
                // invalidate (isert: snd_w_inv).
                let target_inv = private_data
                    .get(..CM_HEADER_LEN)
                    .and_then(|d| IserCmRepr::parse(&IserCmHeader::new_unchecked(d)).ok())
                    .is_some_and(|r| {
                        !r.flags
                            .contains(IserCmFlags::SEND_WITH_INVALIDATE_NOT_SUPPORTED)
                    });
                let ok = {
                    let mut st = t.st.lock(irql);
                    if !Self::is_current(&st, conn) || st.phase != Phase::Connecting {
                        return;
                    }
                    st.snd_w_inv = self.config.accept_remote_invalidate && target_inv;
                    t.counters
                        .remote_invalidate
                        .store(st.snd_w_inv, Ordering::Relaxed);
                    self.start_login(t, &mut st, conn, irql)
                };
                if !ok {
                    self.fail(conn, Why::Post, irql);
                }
            }
            CmEvent::Rejected { .. } | CmEvent::Unreachable { .. } => {
                {
                    let mut st = t.st.lock(irql);
                    if Self::is_current(&st, conn) && st.why.is_none() {
                        st.why = Some(Why::Unreachable);
                    }
                }
                conn.cm_ended(irql);
            }
            CmEvent::Disconnected { .. } => {
                {
                    let mut st = t.st.lock(irql);
                    if Self::is_current(&st, conn) && st.why.is_none() {
                        st.why = Some(
                            if matches!(
                                st.session.as_ref().map(Session::state),
                                Some(SessionState::LoggedOut { .. })
                            ) {
                                Why::LoggedOut
                            } else {
                                Why::PeerDisconnect
                            },
                        );
                    }
                }
                conn.cm_ended(irql);
            }
        }
    }

    fn is_current(st: &TState<P>, conn: &Arc<Conn<P>>) -> bool {
        st.conn.as_ref().is_some_and(|c| Arc::ptr_eq(c, conn))
    }

    fn start_login(
        &self,
        t: &Target<P>,
        st: &mut TState<P>,
        conn: &Arc<Conn<P>>,
        irql: &impl LeDispatch,
    ) -> bool {
        // Taken, so that no second login of this attempt reuses it.
        let mutual_challenge = match (&t.desc.auth.mutual, st.mutual_challenge.take()) {
            (Some(_), Some(c)) => Some((u8::try_from(st.epoch & 0xFF).unwrap_or(1), c)),
            // `connect` draws one whenever mutual CHAP is configured.
            (Some(_), None) => return false,
            (None, _) => None,
        };
        let start = LoginStart {
            tsih: 0,
            cid: 0,
            itt: st.epoch & 0x00FF_FFFF,
            cmd_sn: SerialNumber(1),
            mutual_challenge,
        };
        st.login = Some(Login::new(t.desc, start, now_ms::<P>()));
        st.phase = Phase::Login;
        st.ctl_free = u8::MAX >> (8 - CTL_BUFS);
        self.send_login(st, conn, irql)
    }

    /// Builds and sends the next login request.
    fn send_login(&self, st: &mut TState<P>, conn: &Arc<Conn<P>>, irql: &impl LeDispatch) -> bool {
        let Some(n) = take_ctl(&mut st.ctl_free) else {
            return false;
        };
        let TState {
            login, tx_scratch, ..
        } = st;
        let Some(login) = login.as_mut() else {
            return false;
        };
        let Some(buf) = tx_scratch.get_mut(HEADER_LEN..CTL_STRIDE as usize) else {
            return false;
        };
        let Ok(len) = login.build_request(buf) else {
            return false;
        };
        self.send_ctl(st, conn, n, len, irql)
    }

    /// Sends `len` bytes of PDU from the transmit scratch (after an iSER
    /// header without STags) from control buffer `n`.
    fn send_ctl(
        &self,
        st: &mut TState<P>,
        conn: &Arc<Conn<P>>,
        n: u8,
        len: usize,
        irql: &impl LeDispatch,
    ) -> bool {
        let total = HEADER_LEN + len;
        let Some(out) = st.tx_scratch.get_mut(..total) else {
            return false;
        };
        if IserCtrlRepr::default()
            .emit(&mut IserHeader::new_unchecked(&mut *out))
            .is_err()
        {
            return false;
        }
        let offset = conn.layout.ctl_offset(n);
        if conn
            .tx
            .mem()
            .write(usize::try_from(offset).unwrap_or(usize::MAX), out)
            .is_err()
        {
            return false;
        }
        let Some(sge) = conn.tx.sge(offset, u32::try_from(total).unwrap_or(0)) else {
            return false;
        };
        let Ok(mut batch) = conn.qp.begin_send(irql) else {
            return false;
        };
        if batch
            .send(
                &SendWr::new(Payload::Sges(&[sge])),
                Signal::Signalled(WrCtx::Ctl(n)),
            )
            .is_err()
        {
            return false;
        }
        batch.commit() == 1
    }

    /// Passive: the login completed; create the session and go live.
    fn create_session(&self, index: u8, epoch: u32, neg: &Negotiated, irql: &Passive<'_>) {
        let Some(t) = self.target(index) else {
            return;
        };
        let session = Session::new(
            neg,
            &t.desc.timeouts,
            t.sizing.cmds_max,
            0,
            now_ms::<P>(),
            irql,
        );
        let Ok(session) = session else {
            with_dispatch::<P, _, _>(irql, |d| self.fail_epoch(index, epoch, Why::Post, d));
            return;
        };
        with_dispatch::<P, _, _>(irql, |d| {
            let (step, conn) = {
                let mut st = t.st.lock(d);
                if st.epoch != epoch || st.phase != Phase::Creating {
                    return;
                }
                let Some(conn) = st.conn.clone() else {
                    return;
                };
                st.session = Some(session);
                st.session_epoch = st.session_epoch.wrapping_add(1);
                st.phase = Phase::Full;
                st.was_full = true;
                st.login = None;
                bump(&t.counters.logins);
                let step = st.recovery.connected();
                Self::mirror(t, &st);
                (step, conn)
            };
            // PDUs that came while the session was being created.
            loop {
                let next = {
                    let mut st = t.st.lock(d);
                    if st.early.is_empty() {
                        None
                    } else {
                        Some(st.early.remove(0))
                    }
                };
                let Some((rx, len, inv)) = next else { break };
                self.on_recv(t, &conn, rx, len, inv, d);
            }
            self.apply(t, step, d);
        });
    }

    fn fail_epoch(&self, index: u8, epoch: u32, why: Why, irql: &Dispatch<'_>) {
        let Some(t) = self.target(index) else {
            return;
        };
        let conn = {
            let st = t.st.lock(irql);
            if st.epoch != epoch {
                return;
            }
            st.conn.clone()
        };
        if let Some(conn) = conn {
            self.fail(&conn, why, irql);
        }
    }

    // -- completions -----------------------------------------------------------

    fn on_completion(&self, conn: &Arc<Conn<P>>, c: &Completion<WrCtx>, irql: &Dispatch<'_>) {
        let Some(t) = self.target(conn.target) else {
            return;
        };
        if let WcStatus::Error(_) = c.status {
            self.fail(conn, Why::WcError, irql);
        }
        let ok = c.status == WcStatus::Success;
        match c.context {
            Some(WrCtx::Recv(index)) => {
                if ok {
                    self.on_recv(t, conn, index, c.byte_len, c.invalidated_rkey, irql);
                }
            }
            Some(WrCtx::Ctl(n)) => {
                let mut st = t.st.lock(irql);
                if Self::is_current(&st, conn) {
                    st.ctl_free |= 1 << n;
                    if st.phase == Phase::Full {
                        self.transmit_control(t, &mut st, irql);
                    }
                }
            }
            Some(WrCtx::CmdSend { slot, generation }) => {
                if ok {
                    {
                        let mut st = t.st.lock(irql);
                        if let Some(s) = st.slots.get_mut(usize::from(slot)) {
                            if s.generation == generation && s.phase == SlotPhase::Posted {
                                s.send_done = true;
                                if s.ready() {
                                    st.done.push_back(slot);
                                }
                            }
                        }
                    }
                    self.deliver(t, irql);
                }
            }
            Some(WrCtx::Inv { slot, generation }) => {
                if ok {
                    {
                        let mut st = t.st.lock(irql);
                        if let Some(s) = st.slots.get_mut(usize::from(slot)) {
                            if s.generation == generation && s.phase == SlotPhase::Posted {
                                s.fenced = true;
                                bump(&t.counters.local_invalidations);
                                if s.ready() {
                                    st.done.push_back(slot);
                                }
                            }
                        }
                    }
                    self.deliver(t, irql);
                }
            }
            None => {}
        }
    }

    /// A receive completed.
    fn on_recv(
        &self,
        t: &Target<P>,
        conn: &Arc<Conn<P>>,
        index: u16,
        len: u32,
        invalidated: Option<u32>,
        irql: &Dispatch<'_>,
    ) {
        let mut why = None;
        {
            let mut guard = t.st.lock(irql);
            let st = &mut *guard;
            if !Self::is_current(st, conn) {
                return;
            }
            let len = (len as usize).min(st.rx_scratch.len());
            let offset = u64::from(conn.layout.rx_stride) * u64::from(index);
            match st.phase {
                Phase::Login => {
                    if invalidated.is_some() {
                        why = Some(Why::BogusInvalidate);
                    } else {
                        why = self.login_response(t, st, conn, index, offset, len, irql);
                    }
                }
                Phase::Creating => {
                    if st.early.push((index, len as u32, invalidated)).is_err() {
                        why = Some(Why::Post);
                    }
                }
                Phase::Full => {
                    why = self.full_pdu(t, st, conn, offset, len, invalidated, irql);
                    if why.is_none() && !conn.post_recv(index, irql) {
                        why = Some(Why::Post);
                    }
                    if why.is_none() {
                        self.transmit_control(t, st, irql);
                    }
                }
                _ => {}
            }
        }
        if let Some(why) = why {
            self.fail(conn, why, irql);
        }
        self.deliver(t, irql);
        self.arm_timer(t, irql);
    }

    #[expect(clippy::too_many_arguments, reason = "one receive's parts")]
    fn login_response(
        &self,
        t: &Target<P>,
        st: &mut TState<P>,
        conn: &Arc<Conn<P>>,
        index: u16,
        offset: u64,
        len: usize,
        irql: &Dispatch<'_>,
    ) -> Option<Why> {
        let TState {
            login,
            rx_scratch,
            redirect,
            ..
        } = st;
        let buf = rx_scratch.get_mut(..len)?;
        if conn
            .rx
            .mem()
            .read(usize::try_from(offset).unwrap_or(usize::MAX), buf)
            .is_err()
        {
            return Some(Why::Protocol);
        }
        let pdu = buf.get(HEADER_LEN..).unwrap_or(&[]);
        let login = login.as_mut()?;
        match login.handle_response(pdu) {
            Ok(LoginStep::Send) => {
                if !conn.post_recv(index, irql) {
                    return Some(Why::Post);
                }
                if !self.send_login(st, conn, irql) {
                    return Some(Why::Post);
                }
                None
            }
            Ok(LoginStep::Complete(neg)) => {
                // The full ring: every buffer (the login one included).
                for i in 0..conn.layout.rx_count {
                    let Ok(i) = u16::try_from(i) else { break };
                    if !conn.post_recv(i, irql) {
                        return Some(Why::Post);
                    }
                }
                st.phase = Phase::Creating;
                let submitted = self.slow.as_ref().is_some_and(|q| {
                    q.submit(
                        SlowRequest::CreateSession {
                            target: t.index,
                            epoch: st.epoch,
                            neg,
                        },
                        CompleteAt::Dispatch,
                        irql,
                    )
                    .is_ok()
                });
                (!submitted).then_some(Why::Post)
            }
            Err(e) => {
                let disposition = e.disposition();
                if disposition == Disposition::Redirect {
                    *redirect = redirect_portal(login.redirect_address());
                }
                Some(Why::Login(disposition))
            }
        }
    }

    /// A full-feature PDU: remote invalidation checked, then the session.
    #[expect(clippy::too_many_arguments, reason = "one receive's parts")]
    fn full_pdu(
        &self,
        t: &Target<P>,
        st: &mut TState<P>,
        conn: &Arc<Conn<P>>,
        offset: u64,
        len: usize,
        invalidated: Option<u32>,
        irql: &Dispatch<'_>,
    ) -> Option<Why> {
        let TState {
            session,
            rx_scratch,
            slots,
            core_map,
            finishing,
            tmf_done,
            finish_seq,
            window_opened,
            snd_w_inv,
            time2wait,
            last_session_failure,
            ..
        } = st;
        let buf = rx_scratch.get_mut(..len)?;
        if conn
            .rx
            .mem()
            .read(usize::try_from(offset).unwrap_or(usize::MAX), buf)
            .is_err()
            || buf.len() < HEADER_LEN + BHS_LEN
        {
            return Some(Why::Protocol);
        }
        let pdu = buf.get(HEADER_LEN..).unwrap_or(&[]);
        if let Some(rkey) = invalidated {
            // Only an announced invalidation, only in a SCSI Response, only
            // of the key that command's buffer was registered with.
            if !*snd_w_inv || pdu.first().map(|b| b & 0x3F) != Some(0x21) {
                return Some(Why::BogusInvalidate);
            }
            let itt_ok = self.validate_invalidate(session.as_ref(), slots, core_map, pdu, rkey);
            if !itt_ok {
                return Some(Why::BogusInvalidate);
            }
            bump(&t.counters.remote_invalidations);
        }
        let session = session.as_mut()?;
        let mut events = Events {
            slots,
            core_map,
            finishing,
            tmf_done,
            finish_seq,
            window_opened,
        };
        let now = now_ms::<P>();
        let crossed = session.statuses_out_of_order();
        let handled = session.handle_pdu(now, pdu, &mut events);
        if session.statuses_out_of_order() != crossed {
            bump(&t.counters.statuses_out_of_order);
        }
        if let Err(f) = handled {
            if let SessionFailure::TargetDropping { time2wait: w } = f {
                *time2wait = w;
            }
            *last_session_failure = Some(f);
            return Some(if matches!(f, SessionFailure::Protocol(_)) {
                Why::Protocol
            } else {
                Why::Session
            });
        }
        if let SessionState::LoggedOut { time2wait: w } = session.state() {
            *time2wait = w;
            return Some(Why::LoggedOut);
        }
        self.fence_finishing(t, st, conn, irql);
        None
    }

    /// Whether `rkey` is the registered key of the command the SCSI
    /// Response `pdu` answers (then its MR is marked invalid).
    fn validate_invalidate(
        &self,
        session: Option<&Session>,
        slots: &mut [IoSlot<P>],
        _core_map: &[u16],
        pdu: &[u8],
        rkey: u32,
    ) -> bool {
        let _ = session;
        // The response's ITT names the session's task; the engine finds
        // the command by the key itself (each live key belongs to one
        // posted command of this connection).
        let Some(itt) = pdu
            .get(16..20)
            .and_then(|b| <[u8; 4]>::try_from(b).ok())
            .map(u32::from_be_bytes)
        else {
            return false;
        };
        let _ = itt;
        for s in slots.iter_mut() {
            if s.phase == SlotPhase::Posted && s.rkey == rkey && s.result.is_none() && !s.fenced {
                if let Some(mr) = s.mr.as_mut() {
                    if mr.remote_invalidated(rkey) {
                        s.fenced = true;
                        s.mr = None;
                        return true;
                    }
                }
            }
        }
        false
    }

    /// Commands the session just completed: fence (LOCAL_INV) or queue.
    fn fence_finishing(
        &self,
        t: &Target<P>,
        st: &mut TState<P>,
        conn: &Arc<Conn<P>>,
        irql: &impl LeDispatch,
    ) {
        while let Some(index) = st.finishing.pop() {
            let Some(s) = st.slots.get_mut(usize::from(index)) else {
                continue;
            };
            if !s.fenced && !s.inv_posted {
                match s.mr.as_mut() {
                    Some(mr) if mr.is_registered() && s.epoch == conn.epoch => {
                        s.inv_posted = true;
                        let generation = s.generation;
                        let posted = conn.qp.begin_send(irql).ok().is_some_and(|mut batch| {
                            let ok = batch
                                .local_inv(
                                    mr,
                                    Signal::Signalled(WrCtx::Inv {
                                        slot: index,
                                        generation,
                                    }),
                                )
                                .is_ok();
                            ok && batch.commit() == 1
                        });
                        if posted {
                            // Invalid once the LOCAL_INV runs; a reuse is
                            // posted after it on this send queue.
                            s.mr = None;
                        }
                        // If it could not be posted the QP is failing:
                        // the flush fences.
                    }
                    _ => {
                        s.fenced = true;
                        s.mr = None;
                    }
                }
            }
            if s.ready() {
                st.done.push_back(index);
            }
        }
        let _ = t;
    }

    /// Sends queued control PDUs while control buffers are free.
    fn transmit_control(&self, t: &Target<P>, st: &mut TState<P>, irql: &impl LeDispatch) {
        let Some(conn) = st.conn.clone() else {
            return;
        };
        let now = now_ms::<P>();
        loop {
            if st.ctl_free == 0 || !st.session.as_ref().is_some_and(Session::has_control) {
                return;
            }
            let Some(n) = take_ctl(&mut st.ctl_free) else {
                return;
            };
            let TState {
                session,
                tx_scratch,
                ..
            } = &mut *st;
            let Some(session) = session.as_mut() else {
                return;
            };
            let Some(buf) = tx_scratch.get_mut(HEADER_LEN..CTL_STRIDE as usize) else {
                return;
            };
            let answered = session.pings_answered();
            let Some(len) = session.poll_transmit(now, buf) else {
                st.ctl_free |= 1 << n;
                return;
            };
            let answers_a_ping = session.pings_answered() != answered;
            if !self.send_ctl(st, &conn, n, len, irql) {
                // The QP is going: the session fails with it.
                return;
            }
            bump(&t.counters.control_pdus);
            if answers_a_ping {
                bump(&t.counters.target_pings_answered);
            }
        }
    }

    // -- delivering ---------------------------------------------------------

    /// Hands finished commands and TMFs to the core, one at a time with no
    /// lock held.
    fn deliver(&self, t: &Target<P>, irql: &impl LeDispatch) {
        loop {
            let next = {
                let mut guard = t.st.lock(irql);
                let st = &mut *guard;
                if let Some(index) = st.done.pop_front() {
                    let tag_and_result = st.slots.get_mut(usize::from(index)).and_then(|s| {
                        if !s.ready() {
                            return None;
                        }
                        let r = s.result.take()?;
                        let tag = s.tag;
                        s.phase = SlotPhase::Free;
                        s.generation = s.generation.wrapping_add(1);
                        s.mr = None;
                        s.rkey = 0;
                        Some((tag, r))
                    });
                    if let Some((tag, _)) = tag_and_result {
                        if let Some(m) = st.core_map.get_mut((tag.0 & 0xFFFF) as usize) {
                            if *m == index {
                                *m = NONE;
                            }
                        }
                        if st.free.len() < st.free.capacity() {
                            st.free.push(index);
                        }
                    }
                    Some(tag_and_result.map(|(tag, r)| Item::Command(tag, r)))
                } else {
                    // TMFs whose victims are all delivered.
                    let pending_min = st
                        .slots
                        .iter()
                        .filter(|s| s.phase == SlotPhase::Posted && s.result.is_some())
                        .map(|s| s.finish_seq)
                        .min();
                    match st.tmf_done.front() {
                        Some(&(tag, response, barrier))
                            if pending_min.is_none_or(|m| m > barrier) =>
                        {
                            let _ = st.tmf_done.pop_front();
                            Some(Some(Item::Tmf(tag, response)))
                        }
                        _ => {
                            let open = core::mem::take(&mut st.window_opened)
                                || (st.busy_reported && !st.free.is_empty());
                            if open {
                                st.busy_reported = false;
                                Some(Some(Item::Credits))
                            } else {
                                None
                            }
                        }
                    }
                }
            };
            match next {
                None => return,
                Some(None) => {}
                Some(Some(Item::Command(tag, r))) => {
                    bump(&t.counters.completed);
                    let result = CommandResult {
                        outcome: r.outcome,
                        sense: r.sense.get(..usize::from(r.sense_len)).unwrap_or(&[]),
                        residual: r.residual,
                    };
                    with_dispatch::<P, _, _>(irql, |d| {
                        self.upcalls.command_done(tag, &result, d);
                    });
                }
                Some(Some(Item::Tmf(tag, response))) => {
                    with_dispatch::<P, _, _>(irql, |d| self.upcalls.tmf_done(tag, response, d));
                }
                Some(Some(Item::Credits)) => {
                    with_dispatch::<P, _, _>(irql, |d| {
                        self.upcalls.credits_available(t.index, d);
                    });
                }
            }
        }
    }

    // -- failure and teardown ------------------------------------------------

    /// Ends `conn` if it is the target's current connection.
    fn fail(&self, conn: &Arc<Conn<P>>, why: Why, irql: &impl LeDispatch) {
        if let Some(t) = self.target(conn.target) {
            let mut st = t.st.lock(irql);
            if Self::is_current(&st, conn) {
                if st.why.is_none() {
                    st.why = Some(why);
                }
                if st.phase != Phase::Ending {
                    st.phase = Phase::Ending;
                }
            }
        }
        conn.retire(&self.cm, irql);
    }

    fn fail_current(&self, t: &Target<P>, why: Why, irql: &impl LeDispatch) {
        let conn = t.st.lock(irql).conn.clone();
        if let Some(conn) = conn {
            self.fail(&conn, why, irql);
        }
    }

    /// The QP is flushed: nothing of this connection can reach a buffer
    /// any more. Every command and TMF of it completes.
    fn on_flushed(&self, conn: &Arc<Conn<P>>, irql: &Dispatch<'_>) {
        let Some(t) = self.target(conn.target) else {
            return;
        };
        let step = {
            let mut guard = t.st.lock(irql);
            let st = &mut *guard;
            if !Self::is_current(st, conn) {
                return;
            }
            let why = st.why.unwrap_or(Why::PeerDisconnect);
            t.counters.last_failure.store(why.code(), Ordering::Relaxed);
            let (outcome, tmf_kind) = if st.reset_pending {
                (CommandOutcome::Reset, FailureKind::ConnectionReset)
            } else {
                let k = st.recovery.outstanding_failure();
                (CommandOutcome::Failed(k), k)
            };
            st.reset_pending = false;
            if let Some(session) = st.session.as_mut() {
                let mut events = Events {
                    slots: &mut st.slots,
                    core_map: &st.core_map,
                    finishing: &mut st.finishing,
                    tmf_done: &mut st.tmf_done,
                    finish_seq: &mut st.finish_seq,
                    window_opened: &mut st.window_opened,
                };
                session.terminate_all(outcome, tmf_kind, &mut events);
            }
            st.finishing.clear();
            // The flush fenced everything of this connection.
            for (i, s) in st.slots.iter_mut().enumerate() {
                if s.phase == SlotPhase::Posted && s.epoch == conn.epoch {
                    if !s.fenced {
                        bump(&t.counters.fenced_by_flush);
                    }
                    s.fenced = true;
                    s.send_done = true;
                    s.mr = None;
                    if s.result.is_none() {
                        s.result = Some(Stored {
                            outcome,
                            residual: Residual::None,
                            sense_len: 0,
                            sense: [0; SENSE_MAX],
                        });
                        st.finish_seq += 1;
                        s.finish_seq = st.finish_seq;
                    }
                    if let Ok(i) = u16::try_from(i) {
                        if !st.done.contains(&i) {
                            st.done.push_back(i);
                        }
                    }
                }
            }
            st.session = None;
            st.login = None;
            st.conn = None;
            st.early.clear();
            st.phase = Phase::Down;
            st.busy_reported = true;
            let now = now_ms::<P>();
            let step = if !st.running || st.stopping {
                RecoveryStep::default()
            } else if st.was_full {
                bump(&t.counters.transport_failures);
                st.recovery.connection_lost(now, st.time2wait)
            } else {
                bump(&t.counters.login_failures);
                let disposition = match why {
                    Why::Login(d) => d,
                    _ => Disposition::Retry,
                };
                st.recovery.attempt_failed(now, disposition)
            };
            Self::mirror(t, st);
            step
        };
        self.deliver(t, irql);
        self.fail_commands_if_down(t, irql);
        self.apply(t, step, irql);
    }

    /// Nothing to do: commands are only ever held by a live session.
    fn fail_commands_if_down(&self, _t: &Target<P>, _irql: &impl LeDispatch) {}

    fn on_qp_destroyed(&self, conn: &Arc<Conn<P>>, irql: &Dispatch<'_>) {
        let submitted = self.slow.as_ref().is_some_and(|q| {
            q.submit(
                SlowRequest::Release(Arc::clone(conn)),
                CompleteAt::Dispatch,
                irql,
            )
            .is_ok()
        });
        if !submitted {
            let own = conn.handler.conn.lock(irql).take();
            drop(own);
            self.conns_alive.fetch_sub(1, Ordering::AcqRel);
        }
    }

    fn release_conn(&self, conn: &Arc<Conn<P>>, irql: &Passive<'_>) {
        for _ in 0..10_000 {
            match conn.cq.destroy(irql) {
                Err(VerbsError::InUse) => {
                    self.device.platform().delay(Duration::from_millis(1), irql);
                }
                _ => break,
            }
        }
        // MRs still out belong to prepared commands about to be posted or
        // discarded (they fail: their session is gone); wait, bounded.
        for _ in 0..2000 {
            match conn.pool.destroy(irql) {
                Err(VerbsError::InUse) => {
                    self.device.platform().delay(Duration::from_millis(1), irql);
                }
                _ => break,
            }
        }
        let _ = conn.tx.dereg(irql);
        let _ = conn.rx.dereg(irql);
        let _ = conn.pd.dealloc(irql);
        let own = conn.handler.conn.lock(irql).take();
        drop(own);
        self.conns_alive.fetch_sub(1, Ordering::AcqRel);
    }

    // -- the fast path -------------------------------------------------------

    fn prepare(
        &self,
        cmd: &ScsiCommand<'_>,
        irql: &impl LeDispatch,
    ) -> Result<IserPrepared, PrepareError> {
        let t = self
            .target(cmd.target)
            .ok_or(PrepareError::Failed(FailureKind::DeviceLost))?;
        let mut guard = t.st.lock(irql);
        let st = &mut *guard;
        st.recovery.admit()?;
        if st.phase != Phase::Full {
            return Err(PrepareError::Blocked);
        }
        let conn = st.conn.clone().ok_or(PrepareError::Blocked)?;
        if cmd.transfer_length > t.sizing.max_transfer {
            return Err(PrepareError::Failed(FailureKind::Unsupported));
        }
        let busy = |st: &mut TState<P>| {
            st.busy_reported = true;
            bump(&t.counters.busy);
            PrepareError::Busy
        };
        let Some(index) = st.free.pop() else {
            return Err(busy(st));
        };
        let result = self.prepare_in(t, st, &conn, index, cmd, irql);
        match result {
            Ok(p) => Ok(p),
            Err(e) => {
                if let Some(s) = st.slots.get_mut(usize::from(index)) {
                    s.phase = SlotPhase::Free;
                    s.mr = None;
                }
                st.free.push(index);
                if e == PrepareError::Busy {
                    return Err(busy(st));
                }
                Err(e)
            }
        }
    }

    fn prepare_in(
        &self,
        t: &Target<P>,
        st: &mut TState<P>,
        conn: &Arc<Conn<P>>,
        index: u16,
        cmd: &ScsiCommand<'_>,
        irql: &impl LeDispatch,
    ) -> Result<IserPrepared, PrepareError> {
        let unsupported = PrepareError::Failed(FailureKind::Unsupported);
        let has_data = cmd.direction != DataDirection::None && cmd.transfer_length > 0;
        let mut run = Run::default();
        let mut mr = None;
        if has_data {
            let mut runs = [Run::default(); 1];
            let pages = st
                .slots
                .get_mut(usize::from(index))
                .map(|s| &mut s.page_list[..])
                .ok_or(unsupported)?;
            let plan = mapping::plan(
                cmd.sg_list,
                cmd.transfer_length,
                t.sizing.max_pages,
                pages,
                &mut runs,
            );
            match plan {
                Ok(p) if p.runs == 1 => run = runs[0],
                Ok(_) => return Err(unsupported),
                Err(_) => {
                    bump(&t.counters.unmappable);
                    return Err(unsupported);
                }
            }
            mr = Some(conn.pool.get(irql).ok_or(PrepareError::Busy)?);
        }
        let spec = CommandSpec {
            tag: cmd.tag,
            lun: cmd.lun,
            cdb: cmd.cdb,
            direction: if has_data {
                cmd.direction
            } else {
                DataDirection::None
            },
            transfer_length: if has_data { cmd.transfer_length } else { 0 },
            attr: task_attr(cmd.task_attribute),
            immediate_delivery: false,
        };
        let now = now_ms::<P>();
        let TState {
            session,
            tx_scratch,
            slots,
            ..
        } = &mut *st;
        let session = session.as_mut().ok_or(PrepareError::Blocked)?;
        let slot = slots.get_mut(usize::from(index)).ok_or(unsupported)?;
        let buf = tx_scratch.get_mut(HEADER_LEN..).ok_or(unsupported)?;
        let prepared = session.prepare_command_header(now, &spec, buf)?;
        // Immediate data goes from the request's buffer itself when its
        // segments fit the SEND: the HCA gathers it (the buffer stays the
        // request's until the SEND completes, which completion waits for).
        // Otherwise it is copied behind the header.
        let room = if self.config.gather_immediate {
            (conn.qp.caps().max_send_sge as usize)
                .saturating_sub(1)
                .min(IMM_DATA_SGES)
        } else {
            0
        };
        let gathered = match prepared.immediate_len() {
            0 => Some(0),
            len => slot
                .imm_sges
                .get_mut(..room)
                .and_then(|out| gather_prefix(cmd.sg_list, len, conn.reserved_lkey, out)),
        };
        let mut copied = gathered.is_none();
        if copied {
            copied = buf
                .get_mut(prepared.header_len()..prepared.pdu_len())
                .is_some_and(|dst| cmd.immediate.read(0, dst).is_ok());
            if !copied {
                session.discard_command(prepared);
                return Err(unsupported);
            }
        }
        let pdu_len = HEADER_LEN
            + if copied {
                prepared.pdu_len()
            } else {
                prepared.header_len()
            };
        let cmd_offset = conn.layout.cmd_offset(index);
        let write = |off: u64, bytes: &[u8]| {
            conn.tx
                .mem()
                .write(usize::try_from(off).unwrap_or(usize::MAX), bytes)
                .is_ok()
        };
        // The command PDU (its iSER header is written at post, with the
        // key the registration produces).
        let mut ok = tx_scratch
            .get(HEADER_LEN..pdu_len)
            .is_some_and(|b| write(cmd_offset + HEADER_LEN as u64, b));
        // Unsolicited Data-Out PDUs, each behind its own iSER header.
        let mut data_outs = 0u16;
        let mut at = pdu_len as u64;
        let limit = u64::from(conn.layout.cmd_stride);
        while ok {
            let Some(out) = tx_scratch.get_mut(..) else {
                break;
            };
            let (hdr, body) = out.split_at_mut(HEADER_LEN);
            let built = session.build_data_out(
                &prepared,
                cmd.lun,
                u32::from(data_outs),
                cmd.immediate,
                body,
            );
            match built {
                Ok(Some(len)) => {
                    let total = (HEADER_LEN + len) as u64;
                    if at + total > limit {
                        ok = false;
                        break;
                    }
                    ok = IserCtrlRepr::default()
                        .emit(&mut IserHeader::new_unchecked(&mut *hdr))
                        .is_ok()
                        && out
                            .get(..HEADER_LEN + len)
                            .is_some_and(|b| write(cmd_offset + at, b));
                    at += total;
                    data_outs += 1;
                }
                Ok(None) => break,
                Err(_) => ok = false,
            }
        }
        if !ok {
            session.discard_command(prepared);
            return Err(unsupported);
        }
        let s = st.slots.get_mut(usize::from(index)).ok_or(unsupported)?;
        s.phase = SlotPhase::Prepared;
        s.generation = s.generation.wrapping_add(1);
        s.tag = cmd.tag;
        s.epoch = conn.epoch;
        s.session_epoch = st.session_epoch;
        s.mr = mr;
        s.rkey = 0;
        s.send_done = false;
        s.fenced = false;
        s.inv_posted = false;
        s.result = None;
        s.pdu_len = u32::try_from(pdu_len).unwrap_or(0);
        s.imm_sge_count = gathered.and_then(|n| u8::try_from(n).ok()).unwrap_or(0);
        s.data_outs = data_outs;
        s.data_out_bytes = u32::try_from(at - pdu_len as u64).unwrap_or(0);
        s.direction = spec.direction;
        s.transfer_length = spec.transfer_length;
        s.unsolicited_len = prepared.unsolicited_len();
        s.pages = run.pages;
        s.first_offset = run.offset;
        if prepared.immediate_len() > 0 {
            bump(&t.counters.immediate_writes);
            if !copied {
                bump(&t.counters.immediate_gathered);
            }
        }
        let generation = s.generation;
        if let Some(m) = st.core_map.get_mut((cmd.tag.0 & 0xFFFF) as usize) {
            *m = index;
        }
        Ok(IserPrepared {
            target: t.index,
            slot: index,
            generation,
            session_epoch: st.session_epoch,
            command: prepared,
        })
    }

    fn release_prepared(st: &mut TState<P>, slot: u16, generation: u32) {
        if let Some(s) = st.slots.get_mut(usize::from(slot)) {
            if s.generation == generation && s.phase == SlotPhase::Prepared {
                s.phase = SlotPhase::Free;
                s.generation = s.generation.wrapping_add(1);
                s.mr = None;
                if let Some(m) = st.core_map.get_mut((s.tag.0 & 0xFFFF) as usize) {
                    if *m == slot {
                        *m = NONE;
                    }
                }
                if st.free.len() < st.free.capacity() {
                    st.free.push(slot);
                }
            }
        }
    }

    fn discard(&self, p: IserPrepared, irql: &impl LeDispatch) {
        let Some(t) = self.target(p.target) else {
            return;
        };
        {
            let mut st = t.st.lock(irql);
            Self::release_prepared(&mut st, p.slot, p.generation);
            if st.session_epoch == p.session_epoch {
                if let Some(s) = st.session.as_mut() {
                    s.discard_command(p.command);
                }
            }
        }
        self.deliver(t, irql);
    }

    fn post(&self, p: IserPrepared, irql: &impl LeDispatch) -> Result<(), PostFailed> {
        let t = self
            .target(p.target)
            .ok_or(PostFailed(FailureKind::DeviceLost))?;
        let mut why = None;
        let result = {
            let mut guard = t.st.lock(irql);
            let st = &mut *guard;
            let conn = st.conn.clone();
            let live = st.phase == Phase::Full && st.session_epoch == p.session_epoch;
            match conn {
                Some(conn) if live => self.post_in(t, st, &conn, p, irql, &mut why),
                _ => {
                    let kind = st.recovery.outstanding_failure();
                    Self::release_prepared(st, p.slot, p.generation);
                    Err(PostFailed(kind))
                }
            }
        };
        if let Some(why) = why {
            self.fail_current(t, why, irql);
        }
        self.deliver(t, irql);
        result
    }

    fn post_in(
        &self,
        t: &Target<P>,
        st: &mut TState<P>,
        conn: &Arc<Conn<P>>,
        p: IserPrepared,
        irql: &impl LeDispatch,
        why: &mut Option<Why>,
    ) -> Result<(), PostFailed> {
        let reset = PostFailed(FailureKind::ConnectionReset);
        let (slot, generation) = (p.slot, p.generation);
        match self.post_batch(t, st, conn, p, irql, why) {
            Ok(()) => Ok(()),
            Err(unsent) => {
                if let (Some(cmd), Some(session)) = (unsent, st.session.as_mut()) {
                    session.discard_command(cmd);
                }
                Self::release_prepared(st, slot, generation);
                Err(reset)
            }
        }
    }

    /// Registers, assigns the CmdSN and posts; `Err` with the command if
    /// it was not handed to the session as sent (the caller discards it).
    fn post_batch(
        &self,
        t: &Target<P>,
        st: &mut TState<P>,
        conn: &Arc<Conn<P>>,
        p: IserPrepared,
        irql: &impl LeDispatch,
        why: &mut Option<Why>,
    ) -> Result<(), Option<PreparedCommand>> {
        let index = p.slot;
        let TState { slots, session, .. } = &mut *st;
        let (Some(s), Some(session)) = (slots.get_mut(usize::from(index)), session.as_mut()) else {
            return Err(Some(p.command));
        };
        if s.generation != p.generation || s.phase != SlotPhase::Prepared {
            return Err(Some(p.command));
        }
        let cmd_offset = conn.layout.cmd_offset(index);
        let Ok(mut batch) = conn.qp.begin_send(irql) else {
            return Err(Some(p.command));
        };
        // The registration: one MR over the whole buffer, a new key, only
        // the access the direction needs.
        let mut header = IserCtrlRepr::default();
        if let Some(mr) = s.mr.as_mut() {
            let read = s.direction == DataDirection::In;
            let remaining = s.transfer_length.saturating_sub(s.unsolicited_len);
            if read || remaining > 0 {
                let access = if read {
                    AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE
                } else {
                    AccessFlags::REMOTE_READ
                };
                let iova = IOVA_BASE | (u64::from(index) << 32) | u64::from(s.first_offset);
                let page_list = s.page_list.get(..s.pages as usize).unwrap_or(&[]);
                let reg = FastReg {
                    pages: page_list,
                    page_shift: PAGE_SHIFT,
                    iova,
                    length: u64::from(s.transfer_length),
                    access,
                };
                match batch.reg_mr(mr, &reg, Signal::Unsignalled) {
                    Ok(key) => {
                        s.rkey = key;
                        if read {
                            header.read = Some(RdmaBuf {
                                stag: key,
                                va: iova,
                            });
                        } else {
                            // isert reads from here without adding what
                            // was sent already.
                            header.write = Some(RdmaBuf {
                                stag: key,
                                va: iova + u64::from(s.unsolicited_len),
                            });
                        }
                    }
                    Err(_) => {
                        drop(batch);
                        return Err(Some(p.command));
                    }
                }
            }
        }
        // Assign CmdSN/ExpStatSN into the BHS at the moment of sending.
        let mut bhs = [0u8; BHS_LEN];
        let off_bhs = usize::try_from(cmd_offset).unwrap_or(usize::MAX) + HEADER_LEN;
        if conn.tx.mem().read(off_bhs, &mut bhs).is_err() {
            if let Some(mr) = s.mr.as_mut() {
                mr.abandon_registration();
            }
            drop(batch);
            return Err(Some(p.command));
        }
        if session
            .post_command(now_ms::<P>(), p.command, &mut bhs)
            .is_err()
        {
            if let Some(mr) = s.mr.as_mut() {
                mr.abandon_registration();
            }
            drop(batch);
            // The session released the command itself.
            return Err(None);
        }
        // From here the session counts the command as sent: any failure is
        // a connection failure, and the command completes with the flush.
        s.phase = SlotPhase::Posted;
        let mut hdr = [0u8; HEADER_LEN];
        let _ = header.emit(&mut IserHeader::new_unchecked(&mut hdr[..]));
        let off = usize::try_from(cmd_offset).unwrap_or(usize::MAX);
        let wrote =
            conn.tx.mem().write(off, &hdr).is_ok() && conn.tx.mem().write(off_bhs, &bhs).is_ok();
        let generation = s.generation;
        let mut sges = [Sge::default(); 1 + IMM_DATA_SGES];
        let n = usize::from(s.data_outs);
        let mut ok = wrote;
        let mut at = u64::from(s.pdu_len);
        for i in 0..=n {
            if !ok {
                break;
            }
            let len = if i == 0 {
                s.pdu_len
            } else {
                // Data-Out PDU i-1: its length is in its BHS.
                let mut b = [0u8; 8];
                let o = usize::try_from(cmd_offset + at).unwrap_or(usize::MAX) + HEADER_LEN;
                if conn.tx.mem().read(o, &mut b).is_err() {
                    ok = false;
                    break;
                }
                let dsl = u32::from_be_bytes([0, b[5], b[6], b[7]]);
                (HEADER_LEN + BHS_LEN) as u32 + dsl
            };
            let start = if i == 0 { cmd_offset } else { cmd_offset + at };
            let Some(sge) = conn.tx.sge(start, len) else {
                ok = false;
                break;
            };
            sges[0] = sge;
            // The command PDU's gathered immediate data follows its header.
            let gathered = if i == 0 {
                usize::from(s.imm_sge_count)
            } else {
                0
            };
            if let (Some(dst), Some(src)) =
                (sges.get_mut(1..1 + gathered), s.imm_sges.get(..gathered))
            {
                dst.copy_from_slice(src);
            }
            let sges = sges.get(..1 + gathered).unwrap_or(&[]);
            let signal = if i == n {
                Signal::Signalled(WrCtx::CmdSend {
                    slot: index,
                    generation,
                })
            } else {
                Signal::Unsignalled
            };
            ok = batch
                .send(&SendWr::new(Payload::Sges(sges)), signal)
                .is_ok();
            if i > 0 {
                at += u64::from(len);
                bump(&t.counters.data_out_pdus);
            }
        }
        if ok {
            batch.commit();
        } else {
            if let Some(mr) = s.mr.as_mut() {
                mr.abandon_registration();
            }
            drop(batch);
            *why = Some(Why::Post);
        }
        Ok(())
    }

    // -- task management -------------------------------------------------------

    fn tmf(
        &self,
        target: u8,
        irql: &impl LeDispatch,
        f: impl FnOnce(&mut Session, Millis) -> Result<(), TmfRefused>,
    ) -> Result<(), TmfRefused> {
        let t = self.target(target).ok_or(TmfRefused::NotConnected)?;
        {
            let mut st = t.st.lock(irql);
            if st.phase != Phase::Full {
                return Err(TmfRefused::NotConnected);
            }
            let session = st.session.as_mut().ok_or(TmfRefused::NotConnected)?;
            f(session, now_ms::<P>())?;
            bump(&t.counters.tmfs);
            self.transmit_control(t, &mut st, irql);
        }
        self.arm_timer(t, irql);
        Ok(())
    }

    /// Stops every target: a graceful logout where a session is live
    /// (bounded), then every connection ends (disconnect, flush, release;
    /// waits, bounded), which completes every command and TMF still
    /// outstanding. [`Transport::stop`], and the teardown of a started
    /// handle dropped without it ([`IserTransport`]'s `Drop`).
    ///
    /// # IRQL
    /// `PASSIVE_LEVEL`: waits, bounded (`LOGOUT_WAIT`, `STOP_WAIT`).
    fn shut_down(&self, irql: &Passive<'_>) {
        // A graceful logout where a session is live (bounded).
        for t in self.targets.iter() {
            let mut st = t.st.lock(irql);
            // Set first: the target may end the connection as soon as it
            // has answered the logout, before the wait below notices.
            st.stopping = true;
            if st.phase == Phase::Full {
                if let Some(s) = st.session.as_mut() {
                    s.logout(now_ms::<P>());
                }
                self.transmit_control(t, &mut st, irql);
            }
        }
        wait_bounded(self.device.platform(), LOGOUT_WAIT, irql, || {
            self.targets.iter().all(|t| {
                let st = t.st.lock(irql);
                st.phase != Phase::Full
                    || matches!(
                        st.session.as_ref().map(Session::state),
                        Some(SessionState::LoggedOut { .. }) | None
                    )
            })
        });
        for t in self.targets.iter() {
            let conn = {
                let mut st = t.st.lock(irql);
                st.running = false;
                let _ = st.recovery.remove();
                Engine::mirror(t, &st);
                st.conn.clone()
            };
            t.timer.cancel(irql);
            if let Some(conn) = conn {
                self.fail(&conn, Why::Stop, irql);
            }
            self.report_state(t, irql);
        }
        self.running.store(false, Ordering::Release);
        wait_bounded(self.device.platform(), STOP_WAIT, irql, || {
            self.conns_alive.load(Ordering::Acquire) == 0
                && self.slow.as_ref().is_none_or(|q| q.in_use(irql) == 0)
                && self.targets.iter().all(|t| t.st.lock(irql).conn.is_none())
        });
        for t in self.targets.iter() {
            t.timer.cancel(irql);
            let mut st = t.st.lock(irql);
            st.phase = Phase::Down;
        }
    }

    fn reset(&self, irql: &impl LeDispatch) {
        for t in self.targets.iter() {
            let conn = {
                let mut st = t.st.lock(irql);
                match st.conn.clone() {
                    Some(c) if st.was_full || st.phase == Phase::Full => {
                        st.reset_pending = true;
                        Some(c)
                    }
                    _ => None,
                }
            };
            if let Some(conn) = conn {
                self.fail(&conn, Why::Reset, irql);
            }
        }
    }
}

enum Item {
    Command(Tag, Stored),
    Tmf(Tag, TmfResponse),
    Credits,
}

/// Takes a free control buffer.
fn take_ctl(free: &mut u8) -> Option<u8> {
    if *free == 0 {
        return None;
    }
    let n = u8::try_from(free.trailing_zeros()).ok()?;
    *free &= !(1 << n);
    Some(n)
}

impl<P: Platform> IserTransport<P> {
    /// The StorPort limits for `targets`: (max transfer bytes, physical
    /// breaks, max I/O, max I/O per LUN).
    #[must_use]
    pub fn adapter_shape(
        targets: &[TargetDescription],
        dev_pages: u32,
    ) -> crate::srp::AdapterShape {
        let max_pages = MAX_PAGES_PER_MR.min(dev_pages).max(2);
        let max_transfer = ((max_pages - 1) << PAGE_SHIFT).min(1 << 20);
        let mut shape = crate::srp::AdapterShape {
            max_transfer_bytes: max_transfer,
            physical_breaks: max_pages - 1,
            max_io: 0,
            max_io_per_lun: u32::MAX,
        };
        for d in targets {
            shape.max_io = shape
                .max_io
                .saturating_add(u32::from(d.cmds_max.clamp(1, 1024)));
            shape.max_io_per_lun = shape.max_io_per_lun.min(u32::from(d.queue_depth.max(1)));
        }
        if targets.is_empty() {
            shape.max_io = 1;
            shape.max_io_per_lun = 1;
        }
        shape
    }

    /// Creates the engine for `targets` on `device`'s port `config.port`,
    /// connecting through `cm`. Nothing connects until [`Transport::start`].
    ///
    /// The descriptions are kept for the life of the driver (the login
    /// machine borrows its target's description).
    ///
    /// # Errors
    /// [`IserError`].
    ///
    /// # IRQL
    /// `PASSIVE_LEVEL` (allocates everything the engine will use).
    pub fn new(
        device: &Device<P>,
        cm: &CmPort<P>,
        config: IserConfig,
        targets: &[TargetDescription],
        upcalls: Upcalls,
        irql: &Passive<'_>,
    ) -> Result<Self, IserError> {
        if targets.len() > usize::from(u8::MAX) {
            return Err(IserError::TooManyTargets);
        }
        let port_gid = device
            .ports()
            .iter()
            .find(|p| p.port == config.port)
            .map(|p| p.gid)
            .ok_or(IserError::Config("port"))?;
        let attr = *device.attr();
        let platform = device.platform().clone();
        // Two work items: the slow path, and the teardown of a handle
        // dropped started, which waits for the slow path's releases.
        let worker = Worker::new(&platform, 2, irql)?;
        let back = Arc::new(Back {
            engine: SpinLock::new(Weak::new()),
        });
        let mut built = Vec::new();
        built
            .try_reserve_exact(targets.len())
            .map_err(|_| IserError::Alloc)?;
        for (i, desc) in targets.iter().enumerate() {
            let index = u8::try_from(i).map_err(|_| IserError::TooManyTargets)?;
            let mut desc = desc.clone();
            // Unsolicited data is copied into the command's send buffer;
            // the rest moves by RDMA READ.
            desc.params.first_burst_length = desc.params.first_burst_length.min(UNSOLICITED_MAX);
            let desc: &'static TargetDescription = Box::leak(Box::new(desc));
            let sizing = Sizing::new(desc, attr.max_fast_reg_page_list_len, attr.max_qp_wr);
            let slots = usize::from(sizing.slots);
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
            let rx_len = sizing.rx_stride as usize;
            let tx_len = (sizing.cmd_stride.max(CTL_STRIDE) as usize).max(HEADER_LEN + 8192);
            let st = TState {
                redirect: None,
                running: false,
                stopping: false,
                recovery: Recovery::new(&desc.timeouts, now_ms::<P>()),
                phase: Phase::Down,
                epoch: 0,
                conn: None,
                login: None,
                session: None,
                session_epoch: 0,
                why: None,
                last_session_failure: None,
                time2wait: 0,
                was_full: false,
                snd_w_inv: false,
                reset_pending: false,
                busy_reported: false,
                slots: (0..slots).map(|_| IoSlot::new(sizing.max_pages)).collect(),
                free: (0..sizing.slots).rev().collect(),
                core_map: alloc::vec![NONE; 1 << 16].into_boxed_slice(),
                finishing: Vec::with_capacity(slots),
                done: VecDeque::with_capacity(slots),
                tmf_done: VecDeque::with_capacity(32),
                finish_seq: 0,
                ctl_free: 0,
                rx_scratch: alloc::vec![0u8; rx_len].into_boxed_slice(),
                tx_scratch: alloc::vec![0u8; tx_len].into_boxed_slice(),
                early: heapless::Vec::new(),
                window_opened: false,
                mutual_challenge: None,
            };
            built.push(Target {
                index,
                desc,
                sizing,
                st: SpinLock::new(st),
                timer,
                counters: Counters::default(),
                state: AtomicU8::new(state_code(TargetState::Connecting)),
                reported: AtomicU8::new(state_code(TargetState::Connecting)),
                reporting: AtomicBool::new(false),
                report_pending: AtomicBool::new(false),
            });
        }
        let rundown = Rundown::new(&platform, |_: &Dispatch<'_>| {}, irql)?;
        let slow = RequestQueue::new(
            &worker,
            SlowPath {
                back: Arc::clone(&back),
            },
            8 + targets.len() * 8,
            rundown,
            irql,
        )?;
        let drop_teardown = DropTeardown::new(&worker, irql)?;
        let engine = Arc::new(Engine {
            upcalls,
            device: device.clone(),
            cm: cm.clone(),
            config,
            port_gid,
            targets: built.into_boxed_slice(),
            slow: Some(slow),
            _worker: worker,
            _back: Arc::clone(&back),
            conns_alive: AtomicUsize::new(0),
            running: AtomicBool::new(false),
            src_port: AtomicU32::new(0),
        });
        *back.engine.lock(irql) = Arc::downgrade(&engine);
        Ok(IserTransport {
            kept: TornDownOnDrop::new(Kept { engine }, drop_teardown),
        })
    }

    /// A weak view of the engine, for teardown tests: whether anything
    /// still keeps it alive once the handle is gone.
    #[must_use]
    pub fn engine_probe(&self) -> EngineProbe {
        EngineProbe::new(&self.kept.engine)
    }

    /// A target's counters.
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    pub fn target_stats(&self, target: u8, irql: &impl LeDispatch) -> Option<IserStats> {
        let t = self.kept.engine.target(target)?;
        let last_session_failure = t.st.lock(irql).last_session_failure;
        let c = &t.counters;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Some(IserStats {
            state: Some(TargetState::from_code(t.state.load(Ordering::Acquire))),
            connect_attempts: g(&c.connect_attempts),
            logins: g(&c.logins),
            login_failures: g(&c.login_failures),
            transport_failures: g(&c.transport_failures),
            last_failure: c.last_failure.load(Ordering::Relaxed),
            last_session_failure,
            statuses_out_of_order: g(&c.statuses_out_of_order),
            remote_invalidate: c.remote_invalidate.load(Ordering::Relaxed),
            remote_invalidations: g(&c.remote_invalidations),
            local_invalidations: g(&c.local_invalidations),
            fenced_by_flush: g(&c.fenced_by_flush),
            completed: g(&c.completed),
            busy: g(&c.busy),
            immediate_writes: g(&c.immediate_writes),
            immediate_gathered: g(&c.immediate_gathered),
            data_out_pdus: g(&c.data_out_pdus),
            control_pdus: g(&c.control_pdus),
            target_pings_answered: g(&c.target_pings_answered),
            tmfs: g(&c.tmfs),
            unmappable: g(&c.unmappable),
        })
    }

    /// The negotiated parameters of a target's live session.
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    pub fn negotiated(&self, target: u8, irql: &impl LeDispatch) -> Option<Negotiated> {
        let t = self.kept.engine.target(target)?;
        let st = t.st.lock(irql);
        st.session.as_ref().map(|s| *s.negotiated())
    }

    /// The QP number of a target's current connection (tests).
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    pub fn qpn(&self, target: u8, irql: &impl LeDispatch) -> Option<u32> {
        let t = self.kept.engine.target(target)?;
        let st = t.st.lock(irql);
        st.conn.as_ref().map(|c| c.qp.qpn())
    }

    /// Connections built and not yet released.
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    pub fn open_connections(&self, _irql: &impl LeDispatch) -> usize {
        self.kept.engine.conns_alive.load(Ordering::Acquire)
    }

    /// Drops a target's connection as a transport failure would (tests,
    /// diagnostics): the session is reinstated.
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    pub fn drop_connection(&self, target: u8, irql: &impl LeDispatch) {
        if let Some(t) = self.kept.engine.target(target) {
            self.kept.engine.fail_current(t, Why::PeerDisconnect, irql);
        }
    }
}

impl<P: Platform> Transport for IserTransport<P> {
    type Prepared = IserPrepared;

    fn prepare(
        &self,
        command: &ScsiCommand<'_>,
        irql: &impl LeDispatch,
    ) -> Result<IserPrepared, PrepareError> {
        self.kept.engine.prepare(command, irql)
    }

    fn post(&self, prepared: IserPrepared, irql: &impl LeDispatch) -> Result<(), PostFailed> {
        self.kept.engine.post(prepared, irql)
    }

    fn discard(&self, prepared: IserPrepared, irql: &impl LeDispatch) {
        self.kept.engine.discard(prepared, irql);
    }

    fn abort_task(
        &self,
        target: u8,
        _lun: Lun,
        victim: Tag,
        tmf: Tag,
        irql: &impl LeDispatch,
    ) -> Result<(), TmfRefused> {
        self.kept
            .engine
            .tmf(target, irql, |s, now| s.abort_task(now, tmf, victim))
    }

    fn reset_lun(
        &self,
        target: u8,
        lun: Lun,
        tmf: Tag,
        irql: &impl LeDispatch,
    ) -> Result<(), TmfRefused> {
        self.kept
            .engine
            .tmf(target, irql, |s, now| s.reset_lun(now, tmf, lun))
    }

    fn reset(&self, irql: &impl LeDispatch) {
        self.kept.engine.reset(irql);
    }

    fn start(&self, irql: &Passive<'_>) -> Result<(), StartFailed> {
        let e = &self.kept.engine;
        e.running.store(true, Ordering::Release);
        for t in e.targets.iter() {
            let step = {
                let mut st = t.st.lock(irql);
                st.running = true;
                st.stopping = false;
                st.recovery = Recovery::new(&t.desc.timeouts, now_ms::<P>());
                let step = st.recovery.handle_timeout(now_ms::<P>());
                Engine::mirror(t, &st);
                step
            };
            e.apply(t, step, irql);
        }
        Ok(())
    }

    fn stop(&self, irql: &Passive<'_>) {
        self.kept.engine.shut_down(irql);
    }
}

#[cfg(test)]
mod tests {
    use super::redirect_portal;
    use core::net::{IpAddr, Ipv4Addr, Ipv6Addr};

    #[test]
    fn redirect_target_address_forms() {
        let p = redirect_portal("10.0.1.3:3261,2").unwrap();
        assert_eq!(p.address, IpAddr::V4(Ipv4Addr::new(10, 0, 1, 3)));
        assert_eq!(p.port, 3261);
        let p = redirect_portal("10.0.1.3").unwrap();
        assert_eq!(p.port, 3260, "the default port");
        let p = redirect_portal("[fe80::1]:3260,1").unwrap();
        assert_eq!(
            p.address,
            IpAddr::V6(Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1))
        );
        for bad in [
            "",
            ",1",
            "target.example.com:3260,1",
            "10.0.1.3:0,1",
            "10.0.1.3:x",
        ] {
            assert_eq!(redirect_portal(bad), None, "{bad:?}");
        }
    }
}
