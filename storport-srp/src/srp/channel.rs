//! One RC channel of a target: its command and TMF slots, credits, the
//! fast path, and everything that completes on its CQ.
//!
//! # The life of a command (the data path of one SRP READ)
//! 1. **prepare** (`HwStartIo`, `DISPATCH_LEVEL`): under the channel lock
//!    take a credit and a slot (O(1)); under the slot's lock plan the
//!    registration ([`super::mapping`]), take one fast-registration MR per
//!    run from the connection's pool, or — a small write when the target
//!    granted it — copy the data into the IU as immediate data; reserve
//!    the send-queue room the command can ever need (REG_MRs, the SEND,
//!    the LOCAL_INVs to come). Any shortage is "busy", never a teardown.
//! 2. **post**: in one batch (one doorbell) every REG_MR — a new key byte,
//!    exactly the access it needs: remote write for a READ, remote read
//!    for a WRITE — then the `SRP_CMD` SEND with the direct descriptor, or
//!    the indirect one with its list inline.
//! 3. **`SRP_RSP`**: the tag finds the slot in O(1) (index and generation
//!    are in it); the credits of `req_lim_delta` are applied under the
//!    channel lock; status, residuals and sense are kept in the slot; a
//!    LOCAL_INV is posted for every MR (the last one signalled) and the
//!    MRs go back to the pool; the receive buffer goes back (held, and
//!    reposted four at a time: `Conn::repost_recv`).
//! 4. **complete**: only when the SEND is complete *and* the
//!    invalidation has completed (nvme-rdma's rule: the target can no
//!    longer reach the buffer, and the HCA no longer reads the IU), the
//!    slot is freed and the core hears the result. A command with MRs
//!    posts its SEND unsignalled: its signalled LOCAL_INV follows it on
//!    the same send queue, whose completions are in order, so that one
//!    completion proves both (iSER's selective signalling; a read
//!    completes on two events, the `SRP_RSP` and the invalidation).
//!
//! A connection that ends fences everything still open on it: once its QP
//! is flushed (`on_flushed`) every command is completed — with its real
//! status if the response was already in, otherwise with the failure the
//! target's state says (connection reset, fail-fast, device lost, bus
//! reset).
//!
//! # Target requests
//! `SRP_CRED_REQ` and `SRP_AER_REQ` add their credits and are answered
//! with `SRP_CRED_RSP` / `SRP_AER_RSP` from a few response IUs whose
//! send-queue room is reserved (responses spend no credit); when all are
//! in flight the answer waits in a short queue. `SRP_T_LOGOUT`, and any IU
//! the protocol does not allow, ends the connection (recovery follows).
//!
//! # Task management
//! ABORT TASK and LOGICAL UNIT RESET go out with any credit, the reserved
//! one included. ABORT TASK goes on its victim's channel; a LUN reset on
//! every live channel (RC orders it only behind its own QP's commands;
//! see `reset_group`). On success the victims are marked aborted (or reset),
//! their MRs invalidated, and the TMF is reported only after every victim
//! has completed. A TMF unanswered after [`super::SrpConfig::tmf_timeout`]
//! is reported as a transport timeout by the target's timer; a late
//! answer finds its slot's generation moved on.
//!
//! # IRQL
//! Everything here runs at <= `DISPATCH_LEVEL` and never allocates; the
//! slot arrays were allocated with the engine.

use alloc::boxed::Box;
use alloc::sync::Arc;
use alloc::vec;
use core::sync::atomic::{AtomicU64, Ordering};

use hca_lowlevel::device::AccessFlags;
use hca_lowlevel::dma::PhysAddr;
use kverbs::cm::CmEvent;
use kverbs::irql::{Dispatch, LeDispatch};
use kverbs::mr::FrMr;
use kverbs::platform::Platform;
use kverbs::sync::{SpinLock, with_dispatch};
use kverbs::wr::{Completion, FastReg, Payload, SendWr, Sge, Signal, WcStatus};

use super::conn::{Conn, Phase, WrCtx};
use super::credits::Credits;
use super::engine::{Engine, RSP_IUS, SENSE_MAX, Sizing, TMF_SLOTS, Target, Why, bump, now_ns};
use super::iu::{self, CommandHeader};
use super::login::{self, LoginFailure, Negotiated};
use super::mapping::{self, PAGE_SHIFT, Plan, Run};
use super::params::MAX_CH_COUNT;
use super::recovery::Cause;
use super::sq_budget::{SqBudget, SqRefused};
use super::tags::{FreeSlots, TagKind, WireTag, next_generation};
use crate::gather::{IMM_DATA_SGES, gather_prefix, send_wqebbs};
use crate::miniport::transport::{
    CommandOutcome, CommandResult, FailureKind, PostFailed, PrepareError, Residual, ScsiCommand,
    Tag, TargetState, TmfRefused, TmfResponse,
};
use crate::storport::{DataDirection, QueueAction};
use crate::wire::Lun;
use crate::wire::srp::{
    AerRsp, AerRspRepr, BufFormats, CredRsp, CredRspRepr, DirectDesc, Opcode, Rsp, RspRepr, SolNot,
    SrpIu, TaskAttr, TaskMgmtFunction, TmResponse, TskMgmt, TskMgmtRepr, cmd,
};

/// Longest IU from the target the engine parses (an `SRP_RSP` with 252
/// bytes of sense is 292; nothing SRP defines needs more).
const RX_PARSE_MAX: usize = 1024;
/// Receives up to this long (an `SRP_RSP` without sense or response data
/// is 36 bytes) are parsed from a buffer this small: less stack to clear
/// per response.
const RX_PARSE_SMALL: usize = 64;
/// Target requests whose answer may wait for a response IU.
const OWED: usize = 16;
/// Bytes copied per step when filling immediate data (only when the
/// data's scatter/gather list does not fit the SEND's gather entries).
const COPY_CHUNK: usize = 256;
/// A finished command's sense bytes on its completer's stack (no bytes
/// initialised or copied but the sense's own).
type SenseBuf = heapless::Vec<u8, SENSE_MAX>;

/// Base of the I/O virtual addresses the engine registers buffers at.
const IOVA_BASE: u64 = 0x0200_0000_0000_0000;

/// A prepared command (what the core holds between `prepare` and `post`).
#[derive(Debug)]
pub struct SrpPrepared {
    target: u8,
    channel: u8,
    slot: u16,
    generation: u16,
}

/// A TMF slot and credit reserved on a channel (a LUN reset's member),
/// with the epoch of the connection they were taken on.
#[derive(Debug, Clone, Copy)]
struct TmfReservation {
    channel: u8,
    slot: u16,
    epoch: u32,
}

/// A TMF a command slot reports to when it completes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TmfRef {
    channel: u8,
    slot: u16,
    generation: u16,
}

/// A channel's connection state, credits and free lists (one lock).
pub(crate) struct ChanState<P: Platform> {
    conn: Option<Arc<Conn<P>>>,
    /// The epoch a login is under way for.
    pub pending: Option<u32>,
    pub live: bool,
    pub credits: Credits,
    neg: Option<Negotiated>,
    free: FreeSlots,
    tmf_free: FreeSlots,
    rsp_free: u8,
    owed: heapless::Deque<(u8, u64), OWED>,
}

impl<P: Platform> ChanState<P> {
    /// Makes `conn` the channel's connection (login under way); `sq`, the
    /// channel's send-queue budget, stays closed until it goes live.
    pub(crate) fn attach(&mut self, conn: Arc<Conn<P>>, sq: &SqBudget) {
        sq.close();
        self.conn = Some(conn);
        self.live = false;
        self.credits.clear();
        self.neg = None;
        self.owed.clear();
    }

    /// Takes the connection away (it is ending): no credit, no send-queue
    /// room (`sq` closes), nothing new.
    pub(crate) fn detach(&mut self, sq: &SqBudget) -> Option<Arc<Conn<P>>> {
        sq.close();
        self.live = false;
        self.credits.clear();
        self.neg = None;
        self.owed.clear();
        self.rsp_free = 0;
        self.conn.take()
    }

    pub(crate) fn is_current(&self, conn: &Arc<Conn<P>>) -> bool {
        self.conn.as_ref().is_some_and(|c| Arc::ptr_eq(c, conn))
    }

    pub(crate) fn current(&self) -> Option<Arc<Conn<P>>> {
        self.conn.clone()
    }

    pub(crate) fn conn_of(&self, epoch: u32) -> Option<Arc<Conn<P>>> {
        self.conn.as_ref().filter(|c| c.epoch == epoch).cloned()
    }

    fn epoch_is(&self, epoch: u32) -> bool {
        self.conn.as_ref().is_some_and(|c| c.epoch == epoch)
    }

    /// The current connection went live; `sq` (the channel's send-queue
    /// budget) opens for its epoch.
    fn go_live(&mut self, neg: &Negotiated, send_capacity: u32, sq: &SqBudget) {
        self.live = true;
        self.pending = None;
        self.credits.reset(neg.req_lim);
        self.neg = Some(*neg);
        if let Some(conn) = &self.conn {
            sq.open(
                conn.epoch,
                send_capacity.saturating_sub(TMF_SLOTS + RSP_IUS),
            );
        }
        self.rsp_free = u8::try_from((1u32 << RSP_IUS) - 1).unwrap_or(u8::MAX);
        self.owed.clear();
    }

    fn take_rsp_iu(&mut self) -> Option<u8> {
        if self.rsp_free == 0 {
            return None;
        }
        let index = self.rsp_free.trailing_zeros() as u8;
        self.rsp_free &= !(1 << index);
        Some(index)
    }

    pub(crate) fn reset_after_stop(&mut self, sq: &SqBudget) {
        self.pending = None;
        self.detach(sq);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotPhase {
    Free,
    Prepared,
    Posted,
}

/// One command slot.
pub(crate) struct CmdSlot<P: Platform> {
    generation: u16,
    phase: SlotPhase,
    conn: Option<Arc<Conn<P>>>,
    epoch: u32,
    /// The send-queue position of the batch that posted the command: a
    /// LUN reset covers it only if its TMF went out later on the same QP.
    sq_pos: u32,
    core: Tag,
    lun: Lun,
    cdb: [u8; 32],
    cdb_len: usize,
    task_attr: TaskAttr,
    direction: DataDirection,
    access: AccessFlags,
    immediate: bool,
    /// The SEND's gather list, ready to post: entry 0 is the IU's
    /// `tx_len` bytes in `tx`; with immediate data sent from the request's
    /// own buffer, up to [`IMM_DATA_SGES`] entries of it follow (reserved
    /// lkey, physical addresses). Built when the IU is (at prepare for
    /// immediate data, else at post), so the post passes a slice.
    send_sges: [Sge; 1 + IMM_DATA_SGES],
    send_sge_count: usize,
    /// Bytes of the IU in `tx` (without gathered immediate data).
    tx_len: u32,
    /// The command's MRs, one per run. Entry 0 outlives the command: the
    /// slot keeps it as a spare for its next command (the pool's lock
    /// twice less per command). A spare is unregistered (its LOCAL_INV
    /// was posted, and a reuse posts after it on the same send queue; a
    /// stale one is invalidated first by `reg_mr`), reused only if it is
    /// from the current connection's pool, and dropped when its
    /// connection is flushed, so the pool can be destroyed. One per slot:
    /// an idle slot holds no more than the one MR per command the pool
    /// was sized for.
    mrs: Box<[Option<FrMr<P>>]>,
    runs: Box<[Run]>,
    pages: Box<[PhysAddr]>,
    descs: Box<[DirectDesc]>,
    plan: Plan,
    formats: BufFormats,
    budget: u32,
    /// The HCA is done with the SEND (its own completion, or — sent
    /// unsignalled — the completion of the LOCAL_INV after it).
    send_done: bool,
    response: Option<(CommandOutcome, Residual)>,
    fenced: bool,
    sense: [u8; SENSE_MAX],
    sense_len: usize,
    invalidating: bool,
    inv_done: bool,
    waiter: Option<TmfRef>,
    lost: bool,
    scratch: Box<[u8]>,
}

/// What a finished command leaves for its upcall (the slot is free by
/// then). Its sense bytes go to a [`SenseBuf`] of the caller's: only the
/// bytes there are, usually none, are copied, and `Finished` stays small
/// enough to move in registers.
struct Finished {
    slot: u16,
    core: Tag,
    outcome: CommandOutcome,
    residual: Residual,
    budget: u32,
    epoch: u32,
    waiter: Option<TmfRef>,
    fenced: bool,
}

impl<P: Platform> CmdSlot<P> {
    fn new(sizing: &Sizing) -> Self {
        let runs = sizing.max_runs as usize;
        CmdSlot {
            generation: 0,
            phase: SlotPhase::Free,
            conn: None,
            epoch: 0,
            sq_pos: 0,
            core: Tag(0),
            lun: Lun([0; 8]),
            cdb: [0; 32],
            cdb_len: 0,
            task_attr: TaskAttr::Simple,
            direction: DataDirection::None,
            access: AccessFlags::empty(),
            immediate: false,
            send_sges: [Sge::default(); 1 + IMM_DATA_SGES],
            send_sge_count: 0,
            tx_len: 0,
            mrs: (0..runs).map(|_| None).collect(),
            runs: vec![Run::default(); runs].into_boxed_slice(),
            pages: vec![PhysAddr(0); sizing.max_pages as usize].into_boxed_slice(),
            descs: vec![
                DirectDesc {
                    va: 0,
                    rkey: 0,
                    len: 0
                };
                runs
            ]
            .into_boxed_slice(),
            plan: Plan::default(),
            formats: BufFormats::empty(),
            budget: 0,
            send_done: false,
            response: None,
            fenced: false,
            sense: [0; SENSE_MAX],
            sense_len: 0,
            invalidating: false,
            inv_done: false,
            waiter: None,
            lost: false,
            scratch: vec![0u8; sizing.scratch_len as usize].into_boxed_slice(),
        }
    }

    fn matches(&self, conn: &Arc<Conn<P>>, generation: u16) -> bool {
        self.generation == generation && self.conn.as_ref().is_some_and(|c| Arc::ptr_eq(c, conn))
    }

    fn mr_count(&self) -> usize {
        self.plan.runs
    }

    /// The CDB as the short `SRP_CMD`'s 16-byte field holds it (only for
    /// a CDB of up to 16 bytes: [`store_cdb`] zero-pads those).
    fn cdb_field(&self) -> &[u8; cmd::CDB_LEN] {
        self.cdb.first_chunk().unwrap_or(&[0; cmd::CDB_LEN])
    }

    /// The command's fixed parts under wire tag `tag`, its first `runs`
    /// descriptors and the scratch buffer the general emitters write
    /// into: disjoint borrows of the slot, so one `CommandHeader` literal
    /// serves both general forms (the short forms need no header).
    fn command_parts(
        &mut self,
        tag: u64,
        runs: usize,
    ) -> (CommandHeader<'_>, &[DirectDesc], &mut [u8]) {
        let CmdSlot {
            lun,
            cdb,
            cdb_len,
            task_attr,
            direction,
            descs,
            scratch,
            ..
        } = self;
        let header = CommandHeader {
            tag,
            lun: *lun,
            task_attr: *task_attr,
            cdb: cdb.get(..*cdb_len).unwrap_or(&[]),
            direction: *direction,
        };
        (header, descs.get(..runs).unwrap_or(&[]), scratch)
    }

    /// Drops the MRs back into their pool, the spare too. Only the
    /// plan's first `runs` entries ever hold one, and entry 0 (the spare)
    /// beyond them (`setup_slot` takes one per run after setting the
    /// plan; the plan is reset only after this).
    fn drop_mrs(&mut self) {
        if let Some(spare) = self.mrs.first_mut() {
            *spare = None;
        }
        self.drop_mrs_but_spare();
    }

    /// Drops every MR but entry 0, which stays as the slot's spare.
    ///
    /// Inlined (always: a plain hint left it a call after the
    /// LOCAL_INVs): for the usual one-run command it is one compare.
    #[inline(always)]
    fn drop_mrs_but_spare(&mut self) {
        if self.plan.runs > 1 {
            let end = self.plan.runs.min(self.mrs.len());
            for mr in self.mrs.get_mut(1..end).unwrap_or(&mut []) {
                *mr = None;
            }
        }
    }

    /// Back to free, with a new generation (the spare MR stays).
    ///
    /// Inlined (always: a plain hint left it a call from the completion
    /// that finishes the command, which passes here once per command).
    #[inline(always)]
    fn clear(&mut self) {
        self.drop_mrs_but_spare();
        self.phase = SlotPhase::Free;
        self.generation = next_generation(self.generation);
        self.conn = None;
        self.plan = Plan::default();
        self.response = None;
        self.waiter = None;
        self.lost = false;
        self.fenced = false;
        self.send_done = false;
        self.invalidating = false;
        self.inv_done = false;
        self.immediate = false;
        self.send_sge_count = 0;
        self.sense_len = 0;
    }

    /// If the command is done (response in, SEND complete, MRs
    /// invalidated), frees the slot and returns what the upcall needs, its
    /// sense bytes copied into `sense`.
    ///
    /// Inlined: each command passes here once, from the completion that
    /// finishes it; out of line its call and frame cost ~30 instructions.
    #[inline(always)]
    fn take_finished(&mut self, slot: u16, sense: &mut SenseBuf) -> Option<Finished> {
        if self.phase != SlotPhase::Posted || !self.send_done || !self.inv_done {
            return None;
        }
        let (outcome, residual) = self.response?;
        let done = Finished {
            slot,
            core: self.core,
            outcome,
            residual,
            budget: self.budget,
            epoch: self.epoch,
            waiter: self.waiter,
            fenced: self.fenced,
        };
        sense.clear();
        if self.sense_len != 0 {
            // SENSE_MAX bytes at most on both sides: cannot fail.
            let _ = sense.extend_from_slice(self.sense.get(..self.sense_len).unwrap_or(&[]));
        }
        self.clear();
        Some(done)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TmfPhase {
    Free,
    Sent,
    /// Reported (timed out) but its SEND has not completed yet.
    Abandoned,
}

/// What a TMF IU says, and whose it is.
#[derive(Clone, Copy)]
struct TmfIu {
    function: TaskMgmtFunction,
    lun: Lun,
    /// ABORT TASK: the victim's wire tag.
    task_tag: u64,
    /// ABORT TASK: the victim's (channel, slot, generation).
    victim: Option<(u8, u16, u16)>,
    /// The core's tag for the request.
    core: Tag,
}

/// One task management slot.
pub(crate) struct TmfSlot<P: Platform> {
    generation: u16,
    phase: TmfPhase,
    conn: Option<Arc<Conn<P>>>,
    epoch: u32,
    core: Tag,
    function: TaskMgmtFunction,
    lun: Lun,
    victim: Option<(u8, u16, u16)>,
    /// Where the TMF went out in its QP's send queue (see `CmdSlot::sq_pos`).
    sq_pos: u32,
    deadline: u64,
    send_done: bool,
    response: Option<TmfResponse>,
    marking_done: bool,
    waiting: i32,
}

impl<P: Platform> TmfSlot<P> {
    fn new() -> Self {
        TmfSlot {
            generation: 0,
            phase: TmfPhase::Free,
            conn: None,
            epoch: 0,
            core: Tag(0),
            function: TaskMgmtFunction::AbortTask,
            lun: Lun([0; 8]),
            victim: None,
            sq_pos: 0,
            deadline: 0,
            send_done: false,
            response: None,
            marking_done: false,
            waiting: 0,
        }
    }

    fn clear(&mut self) {
        self.phase = TmfPhase::Free;
        self.generation = next_generation(self.generation);
        self.conn = None;
        self.victim = None;
        self.response = None;
        self.send_done = false;
        self.marking_done = false;
        self.waiting = 0;
    }

    /// If the TMF is done, frees the slot and returns the core's tag and
    /// the response.
    fn take_finished(&mut self) -> Option<(Tag, TmfResponse)> {
        if self.phase != TmfPhase::Sent || !self.send_done || !self.marking_done || self.waiting > 0
        {
            return None;
        }
        let response = self.response?;
        let core = self.core;
        self.clear();
        Some((core, response))
    }
}

/// One channel.
pub(crate) struct Channel<P: Platform> {
    pub index: u8,
    pub state: SpinLock<ChanState<P>, P>,
    /// The send-queue room of the live connection: reserved and given back
    /// without the channel lock (opened and closed under it).
    pub sq: SqBudget,
    slots: Box<[SpinLock<CmdSlot<P>, P>]>,
    tmfs: Box<[SpinLock<TmfSlot<P>, P>]>,
    /// The core tag of each busy command slot (bit 32 set), for finding an
    /// abort's victim without taking every slot lock.
    core_tags: Box<[AtomicU64]>,
}

const CORE_TAG_VALID: u64 = 1 << 32;

impl<P: Platform> Channel<P> {
    /// A channel with every slot allocated.
    ///
    /// # IRQL
    /// `PASSIVE_LEVEL` (allocates).
    pub(crate) fn new(index: u8, sizing: &Sizing) -> Self {
        let slots = sizing.queue_size as usize;
        Channel {
            index,
            state: SpinLock::new(ChanState {
                conn: None,
                pending: None,
                live: false,
                credits: Credits::new(),
                neg: None,
                free: FreeSlots::new(slots),
                tmf_free: FreeSlots::new(TMF_SLOTS as usize),
                rsp_free: 0,
                owed: heapless::Deque::new(),
            }),
            sq: SqBudget::new(),
            slots: (0..slots)
                .map(|_| SpinLock::new(CmdSlot::new(sizing)))
                .collect(),
            tmfs: (0..TMF_SLOTS)
                .map(|_| SpinLock::new(TmfSlot::new()))
                .collect(),
            core_tags: (0..slots).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// The earliest deadline of a TMF waiting for its answer.
    pub(crate) fn tmf_deadline(&self, irql: &impl LeDispatch) -> Option<u64> {
        self.tmfs
            .iter()
            .filter_map(|t| {
                let t = t.lock(irql);
                (t.phase == TmfPhase::Sent && t.response.is_none()).then_some(t.deadline)
            })
            .min()
    }

    /// Nothing outstanding (every slot free).
    pub(crate) fn is_idle(&self, irql: &impl LeDispatch) -> bool {
        let st = self.state.lock(irql);
        st.free.available() == st.free.capacity()
            && st.tmf_free.available() == st.tmf_free.capacity()
    }

    fn find_core(&self, core: Tag) -> Option<usize> {
        let want = CORE_TAG_VALID | u64::from(core.raw());
        self.core_tags
            .iter()
            .position(|t| t.load(Ordering::Acquire) == want)
    }
}

fn task_attr(q: QueueAction) -> TaskAttr {
    match q {
        QueueAction::Simple => TaskAttr::Simple,
        QueueAction::HeadOfQueue => TaskAttr::HeadOfQueue,
        QueueAction::Ordered => TaskAttr::Ordered,
    }
}

fn residual(r: crate::wire::Residual) -> Residual {
    match r {
        crate::wire::Residual::None => Residual::None,
        crate::wire::Residual::Underflow(n) => Residual::Underrun(n),
        crate::wire::Residual::Overflow(n) => Residual::Overrun(n),
    }
}

fn tmf_response(code: Option<TmResponse>) -> TmfResponse {
    match code {
        Some(TmResponse::Complete) => TmfResponse::Complete,
        Some(TmResponse::NotSupported) => TmfResponse::NotSupported,
        Some(TmResponse::Failed) | None => TmfResponse::Failed,
        // SAM-5 service response codes a target may use.
        Some(TmResponse::Other(0x08)) => TmfResponse::Succeeded,
        Some(TmResponse::Other(0x09)) => TmfResponse::IncorrectLun,
        Some(TmResponse::Other(_)) => TmfResponse::Failed,
    }
}

/// The short `SRP_CMD` form of a command, when it has one: a CDB without
/// additional bytes and no descriptor, or one direct descriptor the
/// target accepts (what [`iu::emit_command`] would choose for it).
fn short_data(
    cdb: &[u8],
    descs: &[DirectDesc],
    direction: DataDirection,
    formats: BufFormats,
) -> Option<cmd::ShortData> {
    if cdb.len() > cmd::CDB_LEN {
        return None;
    }
    match (descs, direction) {
        ([], _) => Some(cmd::ShortData::None),
        ([d], DataDirection::In) if formats.contains(BufFormats::DIRECT) => {
            Some(cmd::ShortData::In(*d))
        }
        ([d], DataDirection::Out) if formats.contains(BufFormats::DIRECT) => {
            Some(cmd::ShortData::Out(*d))
        }
        _ => None,
    }
}

/// Keeps `cdb` in a slot's CDB buffer, the 16-byte field the short
/// `SRP_CMD` copies whole ([`CmdSlot::cdb_field`]) zeroed first: a CDB of
/// up to 16 bytes is left zero-padded in it.
#[inline(always)]
fn store_cdb(dst: &mut [u8; 32], cdb: &[u8]) {
    if let Some(field) = dst.first_chunk_mut::<{ cmd::CDB_LEN }>() {
        *field = [0; cmd::CDB_LEN];
    }
    if let Some(to) = dst.get_mut(..cdb.len()) {
        to.copy_from_slice(cdb);
    }
}

/// The I/O virtual address of run `run` of slot `slot` (page aligned).
fn iova_base(slot: u16, run: usize) -> u64 {
    IOVA_BASE | (u64::from(slot) << 32) | ((run as u64) << 21)
}

/// Why a channel could not take a command.
enum Refusal {
    Down,
    Busy,
    Failed(FailureKind),
}

/// The channel a command tries first: its tag's low 16 bits modulo the
/// `active` channels (at least 1), so commands spread over the channels.
/// A power-of-two count (one channel, the usual case) takes a mask; only
/// other counts pay for a division.
fn first_channel(tag: u32, active: usize) -> usize {
    let low = (tag & 0xffff) as usize;
    match active {
        0 | 1 => 0,
        n if n.is_power_of_two() => low & (n - 1),
        n => low % n,
    }
}

impl<P: Platform> Engine<P> {
    // -- prepare / post / discard -------------------------------------------

    pub(crate) fn prepare(
        &self,
        command: &ScsiCommand<'_>,
        irql: &impl LeDispatch,
    ) -> Result<SrpPrepared, PrepareError> {
        let t = self
            .target(command.target)
            .ok_or(PrepareError::Failed(FailureKind::DeviceLost))?;
        match t.state() {
            TargetState::Live => {}
            TargetState::Connecting | TargetState::Blocked => return Err(PrepareError::Blocked),
            TargetState::FailFast => return Err(PrepareError::Failed(FailureKind::FailFast)),
            TargetState::Lost => return Err(PrepareError::Failed(FailureKind::DeviceLost)),
        }
        if command.cdb.is_empty()
            || command.cdb.len() > cmd::CDB_LEN + login::MAX_ADD_CDB_LEN as usize
            || command.transfer_length > t.sizing.max_transfer
        {
            return Err(PrepareError::Failed(FailureKind::Unsupported));
        }
        let active = usize::from(t.active.load(Ordering::Acquire)).clamp(1, t.channels.len());
        let mut at = first_channel(command.tag.raw(), active);
        let mut busy = false;
        for _ in 0..active {
            let this = at;
            // Compare-and-subtract: `at` stays below `active`.
            at += 1;
            if at == active {
                at = 0;
            }
            let Some(ch) = t.channels.get(this) else {
                continue;
            };
            match self.prepare_on(t, ch, command, irql) {
                Ok(p) => return Ok(p),
                Err(Refusal::Busy) => busy = true,
                Err(Refusal::Down) => {}
                Err(Refusal::Failed(kind)) => return Err(PrepareError::Failed(kind)),
            }
        }
        Err(if busy {
            PrepareError::Busy
        } else {
            PrepareError::Blocked
        })
    }

    fn prepare_on(
        &self,
        t: &Target<P>,
        ch: &Channel<P>,
        command: &ScsiCommand<'_>,
        irql: &impl LeDispatch,
    ) -> Result<SrpPrepared, Refusal> {
        let (index, conn, neg) = {
            let mut st = ch.state.lock(irql);
            if !st.live {
                return Err(Refusal::Down);
            }
            let (Some(conn), Some(neg)) = (st.current(), st.neg) else {
                return Err(Refusal::Down);
            };
            if !st.credits.take_command() {
                bump(&t.counters.busy_credit);
                return Err(Refusal::Busy);
            }
            let Some(index) = st.free.pop() else {
                st.credits.give_back();
                st.credits.note_starved();
                bump(&t.counters.busy_resources);
                return Err(Refusal::Busy);
            };
            (index, conn, neg)
        };
        // The slot keeps the one reference taken above; from here the
        // connection is named by its epoch (unique per channel, as in
        // `return_reservation`).
        let epoch = conn.epoch;
        let Some(slot_lock) = ch.slots.get(usize::from(index)) else {
            return Err(Refusal::Failed(FailureKind::Unsupported));
        };
        let setup = {
            let mut s = slot_lock.lock(irql);
            let r = self.setup_slot(t, &mut s, index, &conn, &neg, command, irql);
            match r {
                Ok(()) => {
                    s.conn = Some(conn);
                    Ok((s.generation, s.budget))
                }
                Err(e) => {
                    s.clear();
                    Err(e)
                }
            }
        };
        let undo = |refusal: Refusal| {
            let mut st = ch.state.lock(irql);
            let _ = st.free.push(index);
            if st.epoch_is(epoch) {
                st.credits.give_back();
                if matches!(refusal, Refusal::Busy) {
                    st.credits.note_starved();
                }
            }
            refusal
        };
        let (generation, budget) = match setup {
            Ok(v) => v,
            Err(e) => return Err(undo(e)),
        };
        // The room is known only now; it is reserved without the channel
        // lock (`SqBudget` is tagged with the epoch it counts for).
        if let Err(refused) = ch.sq.reserve(epoch, budget) {
            let e = match refused {
                SqRefused::Closed => Refusal::Down,
                SqRefused::Full => {
                    bump(&t.counters.busy_resources);
                    Refusal::Busy
                }
            };
            slot_lock.lock(irql).clear();
            return Err(undo(e));
        }
        if let Some(tag) = ch.core_tags.get(usize::from(index)) {
            tag.store(
                CORE_TAG_VALID | u64::from(command.tag.raw()),
                Ordering::Release,
            );
        }
        Ok(SrpPrepared {
            target: t.index,
            channel: ch.index,
            slot: index,
            generation,
        })
    }

    /// Fills a slot for `command` (under the slot's lock). The caller
    /// then moves its reference to `conn` into the slot (one count per
    /// command, not two).
    #[expect(clippy::too_many_arguments, reason = "the parts of a command")]
    fn setup_slot(
        &self,
        t: &Target<P>,
        s: &mut CmdSlot<P>,
        index: u16,
        conn: &Arc<Conn<P>>,
        neg: &Negotiated,
        command: &ScsiCommand<'_>,
        irql: &impl LeDispatch,
    ) -> Result<(), Refusal> {
        s.phase = SlotPhase::Prepared;
        s.epoch = conn.epoch;
        s.core = command.tag;
        s.lun = command.lun;
        s.cdb_len = command.cdb.len();
        store_cdb(&mut s.cdb, command.cdb);
        s.task_attr = task_attr(command.task_attribute);
        s.formats = neg.formats;
        s.plan = Plan::default();
        let len = command.transfer_length;
        s.direction = if len == 0 {
            DataDirection::None
        } else {
            command.direction
        };
        s.access = match s.direction {
            DataDirection::In => AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
            DataDirection::Out => AccessFlags::REMOTE_READ,
            DataDirection::None | DataDirection::Unspecified => AccessFlags::empty(),
        };
        if s.direction == DataDirection::Unspecified {
            return Err(Refusal::Failed(FailureKind::Unsupported));
        }
        let offset = conn.layout.cmd_offset(index);
        let imm_offset = neg.immediate.filter(|_| {
            s.direction == DataDirection::Out
                && self.config.use_imm_data
                && len <= self.config.max_imm_data
        });
        if let Some(imm) = imm_offset.filter(|o| u32::from(*o) + len <= neg.max_it_iu_len) {
            // Immediate data: the whole IU is built now; post only sends.
            s.immediate = true;
            let tag = self.cmd_tag(s, index);
            let cdb = s.cdb.get(..s.cdb_len).unwrap_or(&[]);
            // The usual header (a CDB of up to 16 bytes, the usual offset)
            // in its fixed-size form; otherwise the general emitter.
            let mut short_iu = [0u8; cmd::SHORT_MAX];
            let short = cdb.len() <= cmd::CDB_LEN && usize::from(imm) <= cmd::SHORT_MAX;
            let header = if short {
                let data = cmd::ShortData::ImmediateExternal { offset: imm, len };
                cmd::emit_short_field(tag, s.lun, s.task_attr, s.cdb_field(), data, &mut short_iu)
            } else {
                let (header, _, scratch) = s.command_parts(tag, 0);
                iu::emit_immediate_header(&header, imm, len, scratch)
            }
            .map_err(|_| Refusal::Failed(FailureKind::Unsupported))?;
            let head = if short {
                short_iu.get(..header)
            } else {
                s.scratch.get(..header)
            }
            .unwrap_or(&[]);
            conn.tx
                .mem()
                .write(usize::try_from(offset).unwrap_or(usize::MAX), head)
                .map_err(|_| Refusal::Failed(FailureKind::Unsupported))?;
            // The data goes from the request's buffer itself when its
            // segments fit the SEND: the HCA gathers it (the buffer stays
            // the request's until the SEND completes, which completion
            // waits for), the CPU copies nothing.
            let room = (conn.qp.caps().max_send_sge as usize)
                .saturating_sub(1)
                .min(IMM_DATA_SGES);
            let gathered = s
                .send_sges
                .get_mut(1..1 + room)
                .and_then(|out| gather_prefix(command.sg_list, len, conn.reserved_lkey, out));
            if let Some(n) = gathered {
                // The IU in `tx` is the header alone.
                s.tx_len = u32::from(imm);
                let (Some(sge), Some(first)) =
                    (conn.tx_sge(offset, s.tx_len), s.send_sges.first_mut())
                else {
                    return Err(Refusal::Failed(FailureKind::Unsupported));
                };
                *first = sge;
                s.send_sge_count = 1 + n;
                s.budget = send_wqebbs(1 + n);
                bump(&t.counters.immediate_writes);
                return Ok(());
            }
            s.tx_len = u32::from(imm) + len;
            let (Some(sge), Some(first)) = (conn.tx_sge(offset, s.tx_len), s.send_sges.first_mut())
            else {
                return Err(Refusal::Failed(FailureKind::Unsupported));
            };
            *first = sge;
            s.send_sge_count = 1;
            let mut chunk = [0u8; COPY_CHUNK];
            let mut done = 0u32;
            while done < len {
                let n = (len - done).min(COPY_CHUNK as u32);
                let buf = chunk.get_mut(..n as usize).unwrap_or(&mut []);
                command
                    .immediate
                    .read(done, buf)
                    .map_err(|_| Refusal::Failed(FailureKind::Unsupported))?;
                let at = offset + u64::from(imm) + u64::from(done);
                conn.tx
                    .mem()
                    .write(usize::try_from(at).unwrap_or(usize::MAX), buf)
                    .map_err(|_| Refusal::Failed(FailureKind::Unsupported))?;
                done += n;
            }
            s.budget = 1;
            bump(&t.counters.immediate_writes);
            return Ok(());
        }
        s.immediate = false;
        if s.direction == DataDirection::None {
            s.budget = 1;
            return Ok(());
        }
        s.plan = mapping::plan(
            command.sg_list,
            len,
            t.sizing.max_pages_per_mr,
            &mut s.pages,
            &mut s.runs,
        )
        .map_err(|e| match e {
            mapping::MapError::ListTooShort | mapping::MapError::AddressOverflow => {
                Refusal::Failed(FailureKind::Protocol)
            }
            _ => Refusal::Failed(FailureKind::Unsupported),
        })?;
        let n = s.plan.runs;
        if n == 0 {
            return Err(Refusal::Failed(FailureKind::Unsupported));
        }
        // The descriptors must fit the IU the target accepts, and the
        // formats it supports.
        let direct_ok = n == 1 && neg.formats.contains(BufFormats::DIRECT);
        if !direct_ok && !neg.formats.contains(BufFormats::INDIRECT) {
            return Err(Refusal::Failed(FailureKind::Unsupported));
        }
        let iu_len = iu::command_len(command.cdb.len(), n, neg.formats);
        if iu_len > neg.max_it_iu_len as usize || iu_len > s.scratch.len() {
            return Err(Refusal::Failed(FailureKind::Unsupported));
        }
        for i in 0..n {
            let Some(entry) = s.mrs.get_mut(i) else {
                return Err(Refusal::Failed(FailureKind::Unsupported));
            };
            if entry.as_ref().is_some_and(|mr| conn.pool.owns(mr)) {
                // The slot's spare, of this connection.
                continue;
            }
            match conn.pool.get(irql) {
                Some(mr) => *entry = Some(mr),
                None => {
                    s.drop_mrs();
                    return Err(if n > t.sizing.pool_size as usize {
                        Refusal::Failed(FailureKind::Unsupported)
                    } else {
                        Refusal::Busy
                    });
                }
            }
        }
        s.budget = s.plan.send_queue_cost();
        Ok(())
    }

    fn cmd_tag(&self, s: &CmdSlot<P>, index: u16) -> u64 {
        WireTag {
            kind: TagKind::Command,
            generation: s.generation,
            slot: index,
            core: s.core.raw(),
        }
        .encode()
    }

    pub(crate) fn post(
        &self,
        prepared: SrpPrepared,
        irql: &impl LeDispatch,
    ) -> Result<(), PostFailed> {
        let t = self
            .target(prepared.target)
            .ok_or(PostFailed(FailureKind::DeviceLost))?;
        let ch = t
            .channels
            .get(usize::from(prepared.channel))
            .ok_or(PostFailed(FailureKind::Protocol))?;
        let slot_lock = ch
            .slots
            .get(usize::from(prepared.slot))
            .ok_or(PostFailed(FailureKind::Protocol))?;
        let result = {
            let mut s = slot_lock.lock(irql);
            if s.generation != prepared.generation || s.phase != SlotPhase::Prepared {
                // Not a command this engine prepared (a contract breach).
                return Err(PostFailed(FailureKind::Protocol));
            }
            let r = if s.lost {
                Err((t.failure_kind(), false))
            } else if let Some(conn) = s.conn.take() {
                // The slot's reference is lent to the post (no count taken
                // for it) and put back before the lock is let go.
                let r = self.post_locked(t, &mut s, &conn, prepared.slot, irql);
                s.conn = Some(conn);
                r
            } else {
                Err((FailureKind::ConnectionReset, false))
            };
            match r {
                Ok(()) => Ok(()),
                Err(e) => {
                    let undo = (s.epoch, s.budget, s.conn.take());
                    s.clear();
                    Err((e, undo))
                }
            }
        };
        match result {
            Ok(()) => Ok(()),
            Err(((kind, broken), (epoch, budget, conn))) => {
                self.return_reservation(ch, prepared.slot, epoch, budget, irql);
                if broken {
                    if let Some(conn) = conn {
                        with_dispatch::<P, _, _>(irql, |d| {
                            self.conn_failed(&conn, Cause::Transport, Why::Batch, d);
                        });
                    }
                }
                Err(PostFailed(kind))
            }
        }
    }

    /// Posts a prepared slot on `conn` (the slot's own connection, lent
    /// by the caller); `Err((kind, broken))` with nothing sent — `broken`
    /// when the connection must end (a half-built batch).
    fn post_locked(
        &self,
        t: &Target<P>,
        s: &mut CmdSlot<P>,
        conn: &Arc<Conn<P>>,
        index: u16,
        irql: &impl LeDispatch,
    ) -> Result<(), (FailureKind, bool)> {
        let Ok(mut batch) = conn.qp.begin_send(irql) else {
            return Err((t.failure_kind(), false));
        };
        s.sq_pos = batch.position();
        let n = s.mr_count();
        // Immediate data's gather list is built already; otherwise the
        // SEND is the IU alone.
        let gather_count = if s.immediate { s.send_sge_count } else { 1 };
        let need = send_wqebbs(gather_count).saturating_add(s.plan.reg_wqebbs);
        if batch.free_wqebbs() < need {
            return Err((FailureKind::ConnectionReset, true));
        }
        let generation = s.generation;
        for i in 0..n {
            let CmdSlot {
                mrs,
                runs,
                pages,
                descs,
                access,
                ..
            } = &mut *s;
            let (Some(run), Some(Some(mr)), Some(d)) =
                (runs.get(i), mrs.get_mut(i), descs.get_mut(i))
            else {
                return Err((FailureKind::ConnectionReset, true));
            };
            let first = run.first_page as usize;
            let page_list = pages.get(first..first + run.pages as usize).unwrap_or(&[]);
            let iova = iova_base(index, i) + u64::from(run.offset);
            let reg = FastReg {
                pages: page_list,
                page_shift: PAGE_SHIFT,
                iova,
                length: u64::from(run.len),
                access: *access,
            };
            match batch.reg_mr(mr, &reg, Signal::Unsignalled) {
                Ok(key) => {
                    *d = DirectDesc {
                        va: iova,
                        rkey: key,
                        len: run.len,
                    };
                }
                Err(_) => {
                    drop(batch);
                    for mr in s.mrs.iter_mut().flatten() {
                        mr.abandon_registration();
                    }
                    return Err((FailureKind::ConnectionReset, true));
                }
            }
        }
        let offset = conn.layout.cmd_offset(index);
        if !s.immediate {
            let tag = self.cmd_tag(s, index);
            let cdb = s.cdb.get(..s.cdb_len).unwrap_or(&[]);
            let descs = s.descs.get(..n).unwrap_or(&[]);
            // The usual command (a CDB of up to 16 bytes, no data or one
            // direct descriptor) is written in its fixed-size form; the
            // rest goes through the general emitter.
            let mut short_iu = [0u8; cmd::SHORT_MAX];
            let short = short_data(cdb, descs, s.direction, s.formats);
            let len = match short {
                Some(data) => cmd::emit_short_field(
                    tag,
                    s.lun,
                    s.task_attr,
                    s.cdb_field(),
                    data,
                    &mut short_iu,
                ),
                None => {
                    let formats = s.formats;
                    let (header, descs, scratch) = s.command_parts(tag, n);
                    let iu_va = conn.tx.iova() + offset;
                    iu::emit_command(&header, descs, formats, iu_va, scratch)
                }
            }
            .map_err(|_| (FailureKind::Unsupported, true))?;
            let bytes = match short {
                Some(_) => short_iu.get(..len),
                None => s.scratch.get(..len),
            }
            .unwrap_or(&[]);
            conn.tx
                .mem()
                .write(usize::try_from(offset).unwrap_or(usize::MAX), bytes)
                .map_err(|_| (FailureKind::ConnectionReset, true))?;
            s.tx_len = u32::try_from(len).unwrap_or(u32::MAX);
            let (Some(sge), Some(first)) = (conn.tx_sge(offset, s.tx_len), s.send_sges.first_mut())
            else {
                return Err((FailureKind::ConnectionReset, true));
            };
            *first = sge;
            s.send_sge_count = 1;
            if n == 1 && s.formats.contains(BufFormats::DIRECT) {
                bump(&t.counters.direct_commands);
            } else if n > 0 {
                bump(&t.counters.indirect_commands);
            }
        }
        let Some(gather) = s
            .send_sges
            .get(..s.send_sge_count)
            .filter(|g| !g.is_empty())
        else {
            return Err((FailureKind::ConnectionReset, true));
        };
        // With MRs to invalidate, the SEND goes unsignalled: the signalled
        // LOCAL_INV posted after it on this send queue completes only after
        // it (completions of a send queue are in order), so the
        // invalidation's completion proves the HCA no longer reads the IU
        // — one completion fewer per command. Without MRs nothing follows
        // it, and its own completion is what the slot waits for.
        let signal = if n > 0 {
            Signal::Unsignalled
        } else {
            Signal::Signalled(WrCtx::Send {
                slot: index,
                generation,
            })
        };
        let send = batch.send(&SendWr::new(Payload::Sges(gather)), signal);
        if send.is_err() {
            drop(batch);
            for mr in s.mrs.iter_mut().flatten() {
                mr.abandon_registration();
            }
            return Err((FailureKind::ConnectionReset, true));
        }
        // Visible to completions from here: they wait for this lock. The
        // completion state is as `clear` (or `new`) left it: nothing but a
        // posted slot's completions changes it.
        debug_assert!(!s.send_done && s.response.is_none() && !s.inv_done && !s.invalidating);
        s.phase = SlotPhase::Posted;
        batch.commit();
        Ok(())
    }

    pub(crate) fn discard(&self, prepared: SrpPrepared, irql: &impl LeDispatch) {
        let Some(t) = self.target(prepared.target) else {
            return;
        };
        let Some(ch) = t.channels.get(usize::from(prepared.channel)) else {
            return;
        };
        let Some(slot_lock) = ch.slots.get(usize::from(prepared.slot)) else {
            return;
        };
        let returned = {
            let mut s = slot_lock.lock(irql);
            if s.generation != prepared.generation || s.phase != SlotPhase::Prepared {
                return;
            }
            let r = (s.epoch, s.budget);
            s.clear();
            r
        };
        self.return_reservation(ch, prepared.slot, returned.0, returned.1, irql);
    }

    /// Returns a prepared slot's slot, credit and budget (same epoch only).
    fn return_reservation(
        &self,
        ch: &Channel<P>,
        index: u16,
        epoch: u32,
        budget: u32,
        irql: &impl LeDispatch,
    ) {
        if let Some(tag) = ch.core_tags.get(usize::from(index)) {
            tag.store(0, Ordering::Release);
        }
        let notify = {
            ch.sq.give_back(epoch, budget);
            let mut st = ch.state.lock(irql);
            let _ = st.free.push(index);
            if st.epoch_is(epoch) && st.live {
                st.credits.give_back();
            }
            st.credits.take_starved()
        };
        if notify {
            self.notify_credits(ch, irql);
        }
    }

    fn notify_credits(&self, ch: &Channel<P>, irql: &impl LeDispatch) {
        let target = self
            .targets
            .iter()
            .find(|t| t.channels.iter().any(|c| core::ptr::eq(c, ch)))
            .map(|t| t.index);
        if let Some(target) = target {
            with_dispatch::<P, _, _>(irql, |d| self.upcalls().credits_available(target, d));
        }
    }

    // -- completions ----------------------------------------------------------

    pub(crate) fn on_completion(
        &self,
        conn: &Arc<Conn<P>>,
        completion: Completion<WrCtx>,
        irql: &Dispatch<'_>,
    ) {
        if matches!(completion.status, WcStatus::Error(_)) {
            let why = Why::WcError(completion.raw_syndrome, completion.opcode as u8);
            self.conn_failed(conn, Cause::Transport, why, irql);
        }
        let Some(ctx) = completion.context else {
            // An unsignalled REG_MR or LOCAL_INV failed or was flushed: the
            // QP is in error; the flush fences everything.
            return;
        };
        let Some((t, ch)) = self.locate(conn) else {
            return;
        };
        match ctx {
            WrCtx::Recv(index) => {
                if completion.is_success() {
                    self.on_recv(t, ch, conn, index, completion.byte_len, irql);
                }
            }
            WrCtx::Send { slot, generation } => {
                self.command_progress(t, ch, conn, slot, generation, |s| s.send_done = true, irql);
            }
            WrCtx::Inv { slot, generation } => {
                if completion.is_success() {
                    // The SEND before it on this send queue is complete
                    // too (it went unsignalled; see `post_locked`).
                    self.command_progress(
                        t,
                        ch,
                        conn,
                        slot,
                        generation,
                        |s| {
                            s.inv_done = true;
                            s.send_done = true;
                        },
                        irql,
                    );
                }
            }
            WrCtx::TmfSend { slot, generation } => {
                self.tmf_send_done(t, ch, conn, slot, generation, irql);
            }
            WrCtx::RspSend(index) => self.rsp_send_done(t, ch, conn, index, irql),
        }
    }

    fn locate(&self, conn: &Arc<Conn<P>>) -> Option<(&Target<P>, &Channel<P>)> {
        let t = self.target(conn.target)?;
        let ch = t.channels.get(usize::from(conn.channel))?;
        Some((t, ch))
    }

    #[expect(clippy::too_many_arguments, reason = "the parts of a completion")]
    fn command_progress(
        &self,
        t: &Target<P>,
        ch: &Channel<P>,
        conn: &Arc<Conn<P>>,
        slot: u16,
        generation: u16,
        step: impl FnOnce(&mut CmdSlot<P>),
        irql: &Dispatch<'_>,
    ) {
        let Some(slot_lock) = ch.slots.get(usize::from(slot)) else {
            return;
        };
        let mut sense = SenseBuf::new();
        let done = {
            let mut s = slot_lock.lock(irql);
            if !s.matches(conn, generation) || s.phase != SlotPhase::Posted {
                return;
            }
            step(&mut s);
            s.take_finished(slot, &mut sense)
        };
        if let Some(done) = done {
            self.finish_command(t, ch, done, &sense, irql);
        }
    }

    fn finish_command(
        &self,
        t: &Target<P>,
        ch: &Channel<P>,
        done: Finished,
        sense: &SenseBuf,
        irql: &Dispatch<'_>,
    ) {
        if let Some(tag) = ch.core_tags.get(usize::from(done.slot)) {
            tag.store(0, Ordering::Release);
        }
        ch.sq.give_back(done.epoch, done.budget);
        let notify = {
            let mut st = ch.state.lock(irql);
            let _ = st.free.push(done.slot);
            st.credits.take_starved()
        };
        bump(&t.counters.completed);
        if done.fenced {
            bump(&t.counters.fenced_by_flush);
        }
        let result = CommandResult {
            outcome: done.outcome,
            sense,
            residual: done.residual,
        };
        self.upcalls().command_done(done.core, &result, irql);
        if let Some(w) = done.waiter {
            self.tmf_victim_done(t, w, irql);
        }
        if notify {
            self.upcalls().credits_available(t.index, irql);
        }
    }

    /// Posts the LOCAL_INVs of a slot's MRs (the last one signalled) and
    /// returns them to the pool. `false`: the batch could not be built and
    /// the connection must end (the flush then fences the command).
    fn start_invalidation(
        &self,
        s: &mut CmdSlot<P>,
        conn: &Arc<Conn<P>>,
        slot: u16,
        irql: &impl LeDispatch,
    ) -> bool {
        if s.invalidating || s.inv_done {
            return true;
        }
        let n = s.mr_count();
        if n == 0 {
            s.inv_done = true;
            return true;
        }
        s.invalidating = true;
        let Ok(mut batch) = conn.qp.begin_send(irql) else {
            // Flushing already: the flush is the fence.
            return true;
        };
        if batch.free_wqebbs() < n as u32 {
            return false;
        }
        let generation = s.generation;
        for i in 0..n {
            let signal = if i + 1 == n {
                Signal::Signalled(WrCtx::Inv { slot, generation })
            } else {
                Signal::Unsignalled
            };
            let Some(Some(mr)) = s.mrs.get_mut(i) else {
                return false;
            };
            if batch.local_inv(mr, signal).is_err() {
                return false;
            }
        }
        batch.commit();
        // Invalid on the device once the LOCAL_INVs run, and any reuse is
        // posted after them on this send queue: the first stays as the
        // slot's spare, the others go back to the pool.
        s.drop_mrs_but_spare();
        true
    }

    // -- receives -------------------------------------------------------------

    fn on_recv(
        &self,
        t: &Target<P>,
        ch: &Channel<P>,
        conn: &Arc<Conn<P>>,
        index: u16,
        len: u32,
        irql: &Dispatch<'_>,
    ) {
        if len as usize <= RX_PARSE_SMALL {
            let mut buf = [0u8; RX_PARSE_SMALL];
            self.on_recv_into(t, ch, conn, index, len, &mut buf, irql);
        } else {
            let mut buf = [0u8; RX_PARSE_MAX];
            self.on_recv_into(t, ch, conn, index, len, &mut buf, irql);
        }
    }

    /// [`Self::on_recv`] with `buf` to copy the IU into (too short: the IU
    /// is not parsed, and the connection ends as for a malformed one).
    #[expect(clippy::too_many_arguments, reason = "the parts of a receive")]
    fn on_recv_into(
        &self,
        t: &Target<P>,
        ch: &Channel<P>,
        conn: &Arc<Conn<P>>,
        index: u16,
        len: u32,
        buf: &mut [u8],
        irql: &Dispatch<'_>,
    ) {
        let n = len as usize;
        let at = u64::from(conn.layout.rx_stride) * u64::from(index);
        let copied = n <= buf.len()
            && buf.get_mut(..n).is_some_and(|b| {
                conn.rx
                    .mem()
                    .read(usize::try_from(at).unwrap_or(usize::MAX), b)
                    .is_ok()
            });
        // The bytes are ours now: the buffer goes back (held, then
        // reposted with the next few in one batch).
        let reposted = conn.repost_recv(index, irql);
        if !reposted && conn.life.lock(irql).phase == Phase::Live {
            self.conn_failed(conn, Cause::Transport, Why::Repost, irql);
            return;
        }
        let bytes = if copied { buf.get(..n) } else { None };
        // Nearly every receive is an SRP_RSP: it is parsed as one at once
        // (the checks `SrpIu::parse` makes for it, without building and
        // moving the general IU value).
        if let Some(bytes) = bytes.filter(|b| b.first() == Some(&Opcode::Rsp.to_u8())) {
            match Rsp::new_checked(bytes).and_then(|view| RspRepr::parse(&view)) {
                Ok(rsp) => self.on_rsp(t, ch, conn, &rsp, irql),
                Err(_) => {
                    bump(&t.counters.protocol_errors);
                    self.conn_failed(conn, Cause::Transport, Why::Protocol, irql);
                }
            }
            return;
        }
        let iu = bytes.and_then(|b| SrpIu::parse(b, None).ok());
        match iu {
            Some(SrpIu::Rsp(rsp)) => self.on_rsp(t, ch, conn, &rsp, irql),
            Some(SrpIu::CredReq(req)) => {
                bump(&t.counters.cred_reqs);
                self.add_credits(t, ch, conn, req.req_lim_delta, irql);
                self.respond(t, ch, conn, Opcode::CredRsp, req.tag, irql);
            }
            Some(SrpIu::AerReq(req)) => {
                bump(&t.counters.aer_reqs);
                self.add_credits(t, ch, conn, req.req_lim_delta, irql);
                self.respond(t, ch, conn, Opcode::AerRsp, req.tag, irql);
            }
            Some(SrpIu::TLogout(_)) => {
                bump(&t.counters.t_logouts);
                self.conn_failed(conn, Cause::Transport, Why::TargetLogout, irql);
            }
            _ => {
                // Malformed, or an IU a target may not send.
                bump(&t.counters.protocol_errors);
                self.conn_failed(conn, Cause::Transport, Why::Protocol, irql);
            }
        }
    }

    fn add_credits(
        &self,
        t: &Target<P>,
        ch: &Channel<P>,
        conn: &Arc<Conn<P>>,
        delta: i32,
        irql: &Dispatch<'_>,
    ) {
        let notify = {
            let mut st = ch.state.lock(irql);
            st.is_current(conn) && st.credits.add(delta)
        };
        if notify {
            self.upcalls().credits_available(t.index, irql);
        }
    }

    fn on_rsp(
        &self,
        t: &Target<P>,
        ch: &Channel<P>,
        conn: &Arc<Conn<P>>,
        rsp: &RspRepr<'_>,
        irql: &Dispatch<'_>,
    ) {
        // Credits first, for any tag (Linux applies them even for a tag it
        // does not know).
        self.add_credits(t, ch, conn, rsp.req_lim_delta, irql);
        match WireTag::decode(rsp.tag) {
            Some(tag) if tag.kind == TagKind::Command => {
                self.command_response(t, ch, conn, tag, rsp, irql);
            }
            Some(tag) => self.tmf_response(t, ch, conn, tag, rsp, irql),
            None => bump(&t.counters.stale_responses),
        }
    }

    fn command_response(
        &self,
        t: &Target<P>,
        ch: &Channel<P>,
        conn: &Arc<Conn<P>>,
        tag: WireTag,
        rsp: &RspRepr<'_>,
        irql: &Dispatch<'_>,
    ) {
        let Some(slot_lock) = ch.slots.get(usize::from(tag.slot)) else {
            bump(&t.counters.stale_responses);
            return;
        };
        let mut sense = SenseBuf::new();
        let (done, broken) = {
            let mut s = slot_lock.lock(irql);
            if !s.matches(conn, tag.generation)
                || s.phase != SlotPhase::Posted
                || s.core.raw() != tag.core
                || s.response.is_some()
            {
                drop(s);
                bump(&t.counters.stale_responses);
                return;
            }
            let res = match s.direction {
                DataDirection::In => residual(rsp.data_in_residual),
                DataDirection::Out => residual(rsp.data_out_residual),
                _ => Residual::None,
            };
            s.response = Some((CommandOutcome::Scsi(rsp.status), res));
            // Nearly every response has no sense: no copy (a `memcpy` call
            // of nothing) then.
            let rsp_sense = rsp.sense.unwrap_or(&[]);
            let n = rsp_sense.len().min(SENSE_MAX);
            if n != 0 {
                if let (Some(dst), Some(src)) = (s.sense.get_mut(..n), rsp_sense.get(..n)) {
                    dst.copy_from_slice(src);
                }
            }
            s.sense_len = n;
            let ok = self.start_invalidation(&mut s, conn, tag.slot, irql);
            (s.take_finished(tag.slot, &mut sense), !ok)
        };
        if broken {
            self.conn_failed(conn, Cause::Transport, Why::Batch, irql);
        }
        if let Some(done) = done {
            self.finish_command(t, ch, done, &sense, irql);
        }
    }

    // -- responses to target requests ----------------------------------------

    fn respond(
        &self,
        t: &Target<P>,
        ch: &Channel<P>,
        conn: &Arc<Conn<P>>,
        opcode: Opcode,
        tag: u64,
        irql: &Dispatch<'_>,
    ) {
        let index = {
            let mut st = ch.state.lock(irql);
            if !st.is_current(conn) {
                return;
            }
            match st.take_rsp_iu() {
                Some(index) => index,
                None => {
                    if st.owed.push_back((opcode.to_u8(), tag)).is_err() {
                        drop(st);
                        bump(&t.counters.dropped_responses);
                    }
                    return;
                }
            }
        };
        self.send_response(t, ch, conn, index, opcode, tag, irql);
    }

    #[expect(clippy::too_many_arguments, reason = "the parts of a response")]
    fn send_response(
        &self,
        t: &Target<P>,
        ch: &Channel<P>,
        conn: &Arc<Conn<P>>,
        index: u8,
        opcode: Opcode,
        tag: u64,
        irql: &Dispatch<'_>,
    ) {
        let mut buf = [0u8; 16];
        let emitted = match opcode {
            Opcode::AerRsp => AerRspRepr { tag }.emit(&mut AerRsp::new_unchecked(&mut buf[..])),
            _ => CredRspRepr { tag }.emit(&mut CredRsp::new_unchecked(&mut buf[..])),
        };
        let offset = conn.layout.rsp_offset(index);
        let sent = emitted.is_ok()
            && conn.send_iu(
                offset,
                buf.get(..16).unwrap_or(&[]),
                WrCtx::RspSend(index),
                irql,
            );
        if !sent {
            bump(&t.counters.dropped_responses);
            let mut st = ch.state.lock(irql);
            if st.is_current(conn) {
                st.rsp_free |= 1 << index;
            }
        }
    }

    fn rsp_send_done(
        &self,
        t: &Target<P>,
        ch: &Channel<P>,
        conn: &Arc<Conn<P>>,
        index: u8,
        irql: &Dispatch<'_>,
    ) {
        let next = {
            let mut st = ch.state.lock(irql);
            if !st.is_current(conn) {
                return;
            }
            match st.owed.pop_front() {
                Some(owed) => Some(owed),
                None => {
                    st.rsp_free |= 1 << index;
                    None
                }
            }
        };
        if let Some((op, tag)) = next {
            let opcode = Opcode::from_u8(op).unwrap_or(Opcode::CredRsp);
            self.send_response(t, ch, conn, index, opcode, tag, irql);
        }
    }

    // -- task management ------------------------------------------------------

    pub(crate) fn abort_task(
        &self,
        target: u8,
        lun: Lun,
        victim: Tag,
        tmf: Tag,
        irql: &impl LeDispatch,
    ) -> Result<(), TmfRefused> {
        let t = self.target(target).ok_or(TmfRefused::NotConnected)?;
        let mut found = None;
        for ch in t.channels.iter() {
            let Some(i) = ch.find_core(victim) else {
                continue;
            };
            let Some(slot_lock) = ch.slots.get(i) else {
                continue;
            };
            let s = slot_lock.lock(irql);
            if s.phase == SlotPhase::Posted && s.core == victim {
                let index = u16::try_from(i).unwrap_or(u16::MAX);
                found = Some((ch.index, index, s.generation));
                break;
            }
        }
        let (channel, slot, generation) = found.ok_or(TmfRefused::UnknownTask)?;
        let task_tag = WireTag {
            kind: TagKind::Command,
            generation,
            slot,
            core: victim.raw(),
        }
        .encode();
        self.send_tmf(
            t,
            channel,
            TmfIu {
                function: TaskMgmtFunction::AbortTask,
                lun,
                task_tag,
                victim: Some((channel, slot, generation)),
                core: tmf,
            },
            irql,
        )
    }

    /// A LOGICAL UNIT RESET, sent on every live channel. RC orders a TMF
    /// only behind the commands of its own QP: a reset sent on one channel
    /// can overtake commands still in flight on another, which the target
    /// then runs after the initiator has already fenced their memory (the
    /// target's RDMA hits an invalidated key and the connection dies).
    /// Each channel's reset therefore covers the commands posted on that
    /// channel before it (by send-queue position: later ones are new tasks
    /// to the target), and the core hears once, when every channel has
    /// answered.
    pub(crate) fn reset_lun(
        &self,
        target: u8,
        lun: Lun,
        tmf: Tag,
        irql: &impl LeDispatch,
    ) -> Result<(), TmfRefused> {
        let t = self.target(target).ok_or(TmfRefused::NotConnected)?;
        // Reserve a slot and a credit on every live channel first, so the
        // reset is all or nothing: a channel left out would keep commands
        // the target may abort without a word. A reservation is (channel,
        // TMF slot, epoch of the connection it was taken on): 8 bytes, not
        // a connection reference, on this DISPATCH_LEVEL stack.
        let mut reserved: heapless::Vec<TmfReservation, { MAX_CH_COUNT as usize }> =
            heapless::Vec::new();
        let mut refused = None;
        for ch in t.channels.iter() {
            match self.reserve_tmf(ch, irql) {
                Ok((index, conn)) => {
                    let r = TmfReservation {
                        channel: ch.index,
                        slot: index,
                        epoch: conn.epoch,
                    };
                    drop(conn);
                    if reserved.push(r).is_err() {
                        if let Some(ch) = t.channels.get(usize::from(r.channel)) {
                            self.unreserve_tmf_of(ch, r.slot, r.epoch, irql);
                        }
                        refused = Some(TmfRefused::Busy);
                        break;
                    }
                }
                Err(TmfRefused::NotConnected) => {}
                Err(e) => {
                    refused = Some(e);
                    break;
                }
            }
        }
        let refused = match refused {
            Some(e) => Some(e),
            None if reserved.is_empty() => Some(TmfRefused::NotConnected),
            None => None,
        };
        if let Some(e) = refused {
            for r in reserved {
                if let Some(ch) = t.channels.get(usize::from(r.channel)) {
                    self.unreserve_tmf_of(ch, r.slot, r.epoch, irql);
                }
            }
            return Err(e);
        }
        // The group holds one extra count until every TMF is posted, so an
        // answer arriving meanwhile cannot finish it early.
        let count = u8::try_from(reserved.len()).unwrap_or(u8::MAX);
        if !self.lun_resets.open(tmf, count.saturating_add(1), irql) {
            for r in reserved {
                if let Some(ch) = t.channels.get(usize::from(r.channel)) {
                    self.unreserve_tmf_of(ch, r.slot, r.epoch, irql);
                }
            }
            return Err(TmfRefused::Busy);
        }
        for r in reserved {
            let Some(ch) = t.channels.get(usize::from(r.channel)) else {
                continue;
            };
            let index = r.slot;
            let iu = TmfIu {
                function: TaskMgmtFunction::LunReset,
                lun,
                task_tag: 0,
                victim: None,
                core: tmf,
            };
            // The connection the reservation was taken on, if it is still
            // the channel's (else it ended meanwhile: not sent).
            let conn = ch.state.lock(irql).conn_of(r.epoch);
            let sent = conn
                .as_ref()
                .is_some_and(|conn| self.post_tmf(ch, index, conn, iu, irql));
            if !sent {
                // This channel's connection is failing: its flush fences
                // its commands. Count it as answered by the transport.
                self.unreserve_tmf_of(ch, index, r.epoch, irql);
                self.group_member_done(
                    tmf,
                    TmfResponse::Transport(FailureKind::ConnectionReset),
                    irql,
                );
            } else {
                bump(&t.counters.tmfs_sent);
            }
        }
        self.rearm(t, irql);
        with_dispatch::<P, _, _>(irql, |d| {
            self.group_member_done(tmf, TmfResponse::Complete, d);
        });
        Ok(())
    }

    /// One member of a LUN reset group answered (or the sender released
    /// its hold); the last one tells the core.
    fn group_member_done(&self, core: Tag, response: TmfResponse, irql: &impl LeDispatch) {
        if let Some(response) = self.lun_resets.member_done(core, response, irql) {
            with_dispatch::<P, _, _>(irql, |d| self.upcalls().tmf_done(core, response, d));
        }
    }

    /// A free TMF slot and a credit on `ch`, if it is live.
    fn reserve_tmf(
        &self,
        ch: &Channel<P>,
        irql: &impl LeDispatch,
    ) -> Result<(u16, Arc<Conn<P>>), TmfRefused> {
        let mut st = ch.state.lock(irql);
        if !st.live {
            return Err(TmfRefused::NotConnected);
        }
        let conn = st.current().ok_or(TmfRefused::NotConnected)?;
        let Some(index) = st.tmf_free.pop() else {
            return Err(TmfRefused::Busy);
        };
        if !st.credits.take_tmf() {
            let _ = st.tmf_free.push(index);
            return Err(TmfRefused::Busy);
        }
        Ok((index, conn))
    }

    /// Returns a reservation that was never sent.
    fn unreserve_tmf(
        &self,
        ch: &Channel<P>,
        index: u16,
        conn: &Arc<Conn<P>>,
        irql: &impl LeDispatch,
    ) {
        self.unreserve_tmf_of(ch, index, conn.epoch, irql);
    }

    /// [`Self::unreserve_tmf`] by the epoch of the connection the
    /// reservation was taken on: its credit goes back only to that
    /// connection.
    fn unreserve_tmf_of(&self, ch: &Channel<P>, index: u16, epoch: u32, irql: &impl LeDispatch) {
        let mut st = ch.state.lock(irql);
        let _ = st.tmf_free.push(index);
        if st.epoch_is(epoch) {
            st.credits.give_back();
        }
    }

    fn send_tmf(
        &self,
        t: &Target<P>,
        channel: u8,
        iu: TmfIu,
        irql: &impl LeDispatch,
    ) -> Result<(), TmfRefused> {
        let ch = t
            .channels
            .get(usize::from(channel))
            .ok_or(TmfRefused::NotConnected)?;
        let (index, conn) = self.reserve_tmf(ch, irql)?;
        if !self.post_tmf(ch, index, &conn, iu, irql) {
            self.unreserve_tmf(ch, index, &conn, irql);
            return Err(TmfRefused::NotConnected);
        }
        bump(&t.counters.tmfs_sent);
        self.rearm(t, irql);
        Ok(())
    }

    /// Fills the reserved TMF slot `index` of `ch` and posts its IU;
    /// `false` if it could not be posted (the slot is cleared, the
    /// reservation still held).
    fn post_tmf(
        &self,
        ch: &Channel<P>,
        index: u16,
        conn: &Arc<Conn<P>>,
        iu: TmfIu,
        irql: &impl LeDispatch,
    ) -> bool {
        let TmfIu {
            function,
            lun,
            task_tag,
            victim,
            core: tmf,
        } = iu;
        let Some(slot_lock) = ch.tmfs.get(usize::from(index)) else {
            return false;
        };
        let mut s = slot_lock.lock(irql);
        s.phase = TmfPhase::Sent;
        s.conn = Some(Arc::clone(conn));
        s.epoch = conn.epoch;
        s.core = tmf;
        s.function = function;
        s.lun = lun;
        s.victim = victim;
        s.deadline = now_ns::<P>()
            .saturating_add(u64::try_from(self.config.tmf_timeout.as_nanos()).unwrap_or(u64::MAX));
        s.send_done = false;
        s.response = None;
        s.marking_done = false;
        s.waiting = 0;
        let repr = TskMgmtRepr {
            sol_not: SolNot::empty(),
            tag: WireTag {
                kind: TagKind::Tmf,
                generation: s.generation,
                slot: index,
                core: tmf.raw(),
            }
            .encode(),
            lun,
            function,
            task_tag,
        };
        let mut buf = [0u8; 48];
        let offset = conn.layout.tmf_offset(index);
        let generation = s.generation;
        let at = if repr.emit(&mut TskMgmt::new_unchecked(&mut buf[..])).is_ok() {
            conn.send_iu_at(
                offset,
                &buf,
                WrCtx::TmfSend {
                    slot: index,
                    generation,
                },
                irql,
            )
        } else {
            None
        };
        let ok = at.is_some();
        match at {
            Some(at) => s.sq_pos = at,
            None => s.clear(),
        }
        ok
    }

    fn tmf_response(
        &self,
        t: &Target<P>,
        ch: &Channel<P>,
        conn: &Arc<Conn<P>>,
        tag: WireTag,
        rsp: &RspRepr<'_>,
        irql: &Dispatch<'_>,
    ) {
        let Some(slot_lock) = ch.tmfs.get(usize::from(tag.slot)) else {
            bump(&t.counters.stale_responses);
            return;
        };
        let response = tmf_response(rsp.tm_response());
        let (function, lun, victim, tmf_pos, me) = {
            let mut s = slot_lock.lock(irql);
            let ours = s.generation == tag.generation
                && s.phase == TmfPhase::Sent
                && s.core.raw() == tag.core
                && s.conn.as_ref().is_some_and(|c| Arc::ptr_eq(c, conn))
                && s.response.is_none();
            if !ours {
                drop(s);
                bump(&t.counters.stale_responses);
                return;
            }
            s.response = Some(response);
            (
                s.function,
                s.lun,
                s.victim,
                s.sq_pos,
                TmfRef {
                    channel: ch.index,
                    slot: tag.slot,
                    generation: tag.generation,
                },
            )
        };
        let mut count = 0i32;
        if matches!(response, TmfResponse::Complete | TmfResponse::Succeeded) {
            let (outcome, only) = match function {
                TaskMgmtFunction::AbortTask => (CommandOutcome::Aborted, victim),
                _ => (CommandOutcome::Reset, None),
            };
            for vch in t.channels.iter() {
                for (i, vslot) in vch.slots.iter().enumerate() {
                    let index = u16::try_from(i).unwrap_or(u16::MAX);
                    if let Some((c, s, _)) = only {
                        if c != vch.index || s != index {
                            continue;
                        }
                    } else if function != TaskMgmtFunction::LunReset || vch.index != ch.index {
                        // A LUN reset covers the commands of its own
                        // channel (see `reset_lun`).
                        continue;
                    }
                    let mut sense = SenseBuf::new();
                    let (marked, done, broken) = {
                        let mut v = vslot.lock(irql);
                        // A LUN reset covers what its channel carried
                        // before the TMF: a command posted after it is a
                        // new task to the target, which will run it.
                        let selected = v.phase == SlotPhase::Posted
                            && match only {
                                Some((_, _, generation)) => v.generation == generation,
                                None => {
                                    v.lun == lun
                                        && v.conn.as_ref().is_some_and(|c| Arc::ptr_eq(c, conn))
                                        && posted_before(v.sq_pos, tmf_pos)
                                }
                            };
                        if !selected || v.waiter.is_some() {
                            // Another TMF already waits for this command;
                            // it completes anyway, and this one need not
                            // wait for it to answer.
                            (false, None, false)
                        } else {
                            v.waiter = Some(me);
                            if v.response.is_none() {
                                v.response = Some((outcome, Residual::None));
                                v.sense_len = 0;
                            }
                            let vconn = v.conn.clone();
                            let ok = match &vconn {
                                Some(c) => self.start_invalidation(&mut v, c, index, irql),
                                None => true,
                            };
                            (true, v.take_finished(index, &mut sense), !ok)
                        }
                    };
                    if marked {
                        count += 1;
                    }
                    if broken {
                        self.target_failed(t, irql);
                    }
                    if let Some(done) = done {
                        self.finish_command(t, vch, done, &sense, irql);
                    }
                }
            }
        }
        let done = {
            let mut s = slot_lock.lock(irql);
            if s.generation != me.generation {
                return;
            }
            s.marking_done = true;
            s.waiting += count;
            s.take_finished()
        };
        if let Some((core, response)) = done {
            self.finish_tmf(ch, me.slot, core, response, irql);
        }
    }

    fn tmf_victim_done(&self, t: &Target<P>, w: TmfRef, irql: &Dispatch<'_>) {
        let Some(ch) = t.channels.get(usize::from(w.channel)) else {
            return;
        };
        let Some(slot_lock) = ch.tmfs.get(usize::from(w.slot)) else {
            return;
        };
        let done = {
            let mut s = slot_lock.lock(irql);
            if s.generation != w.generation {
                return;
            }
            s.waiting -= 1;
            s.take_finished()
        };
        if let Some((core, response)) = done {
            self.finish_tmf(ch, w.slot, core, response, irql);
        }
    }

    fn tmf_send_done(
        &self,
        _t: &Target<P>,
        ch: &Channel<P>,
        conn: &Arc<Conn<P>>,
        slot: u16,
        generation: u16,
        irql: &Dispatch<'_>,
    ) {
        let Some(slot_lock) = ch.tmfs.get(usize::from(slot)) else {
            return;
        };
        enum After {
            Nothing,
            Free,
            Done(Tag, TmfResponse),
        }
        let after = {
            let mut s = slot_lock.lock(irql);
            if s.generation != generation || !s.conn.as_ref().is_some_and(|c| Arc::ptr_eq(c, conn))
            {
                return;
            }
            s.send_done = true;
            if s.phase == TmfPhase::Abandoned {
                s.clear();
                After::Free
            } else {
                match s.take_finished() {
                    Some((core, response)) => After::Done(core, response),
                    None => After::Nothing,
                }
            }
        };
        match after {
            After::Nothing => {}
            After::Free => {
                let _ = ch.state.lock(irql).tmf_free.push(slot);
            }
            After::Done(core, response) => self.finish_tmf(ch, slot, core, response, irql),
        }
    }

    fn finish_tmf(
        &self,
        ch: &Channel<P>,
        slot: u16,
        core: Tag,
        response: TmfResponse,
        irql: &Dispatch<'_>,
    ) {
        let _ = ch.state.lock(irql).tmf_free.push(slot);
        self.tmf_answered(core, response, irql);
    }

    /// A TMF on one channel is over: a LUN reset group member, or a TMF
    /// of its own.
    fn tmf_answered(&self, core: Tag, response: TmfResponse, irql: &Dispatch<'_>) {
        if self.lun_resets.contains(core, irql) {
            self.group_member_done(core, response, irql);
        } else {
            self.upcalls().tmf_done(core, response, irql);
        }
    }

    /// Reports every TMF of `ch` unanswered past its deadline.
    pub(crate) fn expire_tmfs(
        &self,
        t: &Target<P>,
        ch: &Channel<P>,
        now: u64,
        irql: &Dispatch<'_>,
    ) {
        for (i, slot_lock) in ch.tmfs.iter().enumerate() {
            let index = u16::try_from(i).unwrap_or(u16::MAX);
            let expired = {
                let mut s = slot_lock.lock(irql);
                if s.phase != TmfPhase::Sent || s.response.is_some() || s.deadline > now {
                    continue;
                }
                let core = s.core;
                let free = s.send_done;
                if free {
                    s.clear();
                } else {
                    // Its SEND may still complete: keep the IU until then.
                    s.phase = TmfPhase::Abandoned;
                }
                (core, free)
            };
            bump(&t.counters.tmf_timeouts);
            if expired.1 {
                let _ = ch.state.lock(irql).tmf_free.push(index);
            }
            self.tmf_answered(
                expired.0,
                TmfResponse::Transport(FailureKind::Timeout),
                irql,
            );
        }
    }

    // -- the end of a connection ----------------------------------------------

    /// The outcome of a command the end of `conn` fenced.
    fn fence_outcome(
        &self,
        t: &Target<P>,
        conn: &Arc<Conn<P>>,
        irql: &Dispatch<'_>,
    ) -> CommandOutcome {
        match t.state() {
            TargetState::FailFast => CommandOutcome::Failed(FailureKind::FailFast),
            TargetState::Lost => CommandOutcome::Failed(FailureKind::DeviceLost),
            _ => match conn.cause(irql) {
                Cause::Reset => CommandOutcome::Reset,
                Cause::DeviceLost => CommandOutcome::Failed(FailureKind::DeviceLost),
                Cause::Transport | Cause::Stop => {
                    CommandOutcome::Failed(FailureKind::ConnectionReset)
                }
            },
        }
    }

    /// The QP of `conn` is flushed: everything still open on it is fenced
    /// and completes now.
    pub(crate) fn on_flushed(&self, conn: &Arc<Conn<P>>, irql: &Dispatch<'_>) {
        let Some((t, ch)) = self.locate(conn) else {
            return;
        };
        let outcome = self.fence_outcome(t, conn, irql);
        let mut sense = SenseBuf::new();
        for (i, slot_lock) in ch.slots.iter().enumerate() {
            let index = u16::try_from(i).unwrap_or(u16::MAX);
            let done = {
                let mut s = slot_lock.lock(irql);
                // A spare of this connection's pool goes back to it, in
                // any slot: the pool is destroyed after this.
                if let Some(spare) = s.mrs.first_mut() {
                    if spare.as_ref().is_some_and(|mr| conn.pool.owns(mr)) {
                        *spare = None;
                    }
                }
                if !s.conn.as_ref().is_some_and(|c| Arc::ptr_eq(c, conn)) {
                    continue;
                }
                match s.phase {
                    SlotPhase::Free => None,
                    SlotPhase::Prepared => {
                        // Its post will fail; its MRs go back now so the
                        // pool can be destroyed.
                        s.drop_mrs();
                        s.lost = true;
                        None
                    }
                    SlotPhase::Posted => {
                        if s.response.is_none() {
                            s.response = Some((outcome, Residual::None));
                            s.sense_len = 0;
                            s.fenced = true;
                        }
                        s.send_done = true;
                        s.inv_done = true;
                        s.drop_mrs();
                        s.take_finished(index, &mut sense)
                    }
                }
            };
            if let Some(done) = done {
                self.finish_command(t, ch, done, &sense, irql);
            }
        }
        let kind = match outcome {
            CommandOutcome::Failed(kind) => kind,
            _ => FailureKind::ConnectionReset,
        };
        for (i, slot_lock) in ch.tmfs.iter().enumerate() {
            let index = u16::try_from(i).unwrap_or(u16::MAX);
            enum After {
                Nothing,
                Free,
                Done(Tag, TmfResponse),
            }
            let after = {
                let mut s = slot_lock.lock(irql);
                if !s.conn.as_ref().is_some_and(|c| Arc::ptr_eq(c, conn)) {
                    continue;
                }
                match s.phase {
                    TmfPhase::Free => After::Nothing,
                    TmfPhase::Abandoned => {
                        s.clear();
                        After::Free
                    }
                    TmfPhase::Sent => {
                        if s.response.is_none() {
                            s.response = Some(TmfResponse::Transport(kind));
                            s.marking_done = true;
                        }
                        s.send_done = true;
                        match s.take_finished() {
                            Some((core, r)) => After::Done(core, r),
                            None => After::Nothing,
                        }
                    }
                }
            };
            match after {
                After::Nothing => {}
                After::Free => {
                    let _ = ch.state.lock(irql).tmf_free.push(index);
                }
                After::Done(core, r) => self.finish_tmf(ch, index, core, r, irql),
            }
        }
    }

    /// A CM event of `conn`.
    pub(crate) fn on_cm_event(&self, conn: &Arc<Conn<P>>, event: CmEvent<'_>, irql: &Dispatch<'_>) {
        let Some((t, ch)) = self.locate(conn) else {
            return;
        };
        match event {
            CmEvent::Established { private_data } => {
                let rx_len = conn.layout.rx_stride;
                match login::accept_login_response(private_data, &conn.login, rx_len) {
                    Ok(neg) => {
                        let live = {
                            let mut life = conn.life.lock(irql);
                            life.negotiated = Some(neg);
                            if life.phase == Phase::Connecting {
                                life.phase = Phase::Live;
                                true
                            } else {
                                false
                            }
                        };
                        let attached = live && {
                            let mut st = ch.state.lock(irql);
                            if st.is_current(conn) && st.pending == Some(conn.epoch) {
                                st.go_live(&neg, conn.qp.send_capacity(), &ch.sq);
                                true
                            } else {
                                false
                            }
                        };
                        if attached {
                            self.channel_logged_in(conn.target, conn.channel, conn.epoch, irql);
                        } else {
                            self.retire_conn(t, ch, conn, Cause::Stop, irql);
                        }
                    }
                    Err(e) => {
                        conn.life.lock(irql).failure = Some(LoginFailure::BadResponse(e));
                        self.retire_conn(t, ch, conn, Cause::Transport, irql);
                        self.channel_login_failed(
                            conn.target,
                            conn.channel,
                            conn.epoch,
                            LoginFailure::BadResponse(e),
                            irql,
                        );
                    }
                }
            }
            CmEvent::Rejected {
                reason,
                private_data,
            } => {
                let failure = login::interpret_reject(reason, private_data);
                self.cm_terminal(t, ch, conn, irql);
                self.channel_login_failed(conn.target, conn.channel, conn.epoch, failure, irql);
            }
            CmEvent::Unreachable { .. } => {
                self.cm_terminal(t, ch, conn, irql);
                self.channel_login_failed(
                    conn.target,
                    conn.channel,
                    conn.epoch,
                    LoginFailure::Unreachable,
                    irql,
                );
            }
            CmEvent::Disconnected { cause, .. } => {
                let was_live = {
                    let st = ch.state.lock(irql);
                    st.is_current(conn) && st.live
                };
                if was_live && cause != kverbs::cm::DisconnectCause::Local {
                    t.counters
                        .last_transport_failure
                        .store(Why::PeerDisconnect.code(), Ordering::Relaxed);
                }
                let phase = conn.life.lock(irql).phase;
                self.cm_terminal(t, ch, conn, irql);
                if was_live {
                    self.target_failed(t, irql);
                } else if phase == Phase::Connecting {
                    self.channel_login_failed(
                        conn.target,
                        conn.channel,
                        conn.epoch,
                        LoginFailure::Disconnected,
                        irql,
                    );
                }
            }
        }
    }

    /// The CM ended `conn` on its own: the connection ends too.
    fn cm_terminal(
        &self,
        t: &Target<P>,
        ch: &Channel<P>,
        conn: &Arc<Conn<P>>,
        irql: &Dispatch<'_>,
    ) {
        conn.life.lock(irql).cm_terminal = true;
        self.retire_conn(t, ch, conn, Cause::Transport, irql);
        conn.cm_ended(irql);
    }
}

/// Whether send-queue position `a` comes before `b` (serial order: the
/// WQEBB counter wraps).
fn posted_before(a: u32, b: u32) -> bool {
    b.wrapping_sub(a).wrapping_sub(1) < 1 << 31
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stored_cdb_is_its_bytes_and_a_short_one_is_zero_padded_to_the_field() {
        for n in 0..=32usize {
            let cdb: Vec<u8> = (0..n).map(|i| 0xA0 | (i as u8 & 0x1F)).collect();
            // A previous, longer command's bytes are still there.
            let mut dst = [0xEEu8; 32];
            store_cdb(&mut dst, &cdb);
            assert_eq!(&dst[..n], &cdb[..], "length {n}");
            if n <= cmd::CDB_LEN {
                assert!(dst[n..cmd::CDB_LEN].iter().all(|&b| b == 0), "length {n}");
            }
        }
    }

    #[test]
    fn send_queue_positions_compare_in_serial_order() {
        assert!(posted_before(10, 11));
        assert!(!posted_before(11, 10));
        assert!(!posted_before(10, 10));
        assert!(posted_before(u32::MAX - 2, 3), "across the wrap");
        assert!(!posted_before(3, u32::MAX - 2));
    }

    #[test]
    fn first_channel_is_the_tag_modulo_the_active_channels() {
        for active in 1..=9usize {
            for tag in [0u32, 1, 2, 3, 7, 8, 9, 0xffff, 0x1_0005, u32::MAX] {
                let want = (tag & 0xffff) as usize % active;
                assert_eq!(first_channel(tag, active), want, "tag {tag:#x} of {active}");
            }
        }
        assert_eq!(
            first_channel(5, 0),
            0,
            "no active channel clamps to the first"
        );
    }

    #[test]
    fn a_gathering_send_fits_a_commands_sizing_share() {
        assert!(
            send_wqebbs(1 + IMM_DATA_SGES) <= 1 + 4,
            "fits a command's sizing share"
        );
    }
}
