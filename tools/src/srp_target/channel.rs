//! One RDMA channel: its QP, CQ, receive ring and response buffers, and the
//! thread that serves it at `PASSIVE_LEVEL`, doing what `ib_srpt` does.
//!
//! # Life
//!
//! Accepted (QP in INIT with every receive posted) → the CM says the
//! connection is established → the zero-length RDMA WRITE is posted →
//! when it completes the channel is live and serves the IUs that came
//! early → … → a terminal CM event (or a decision to disconnect, which
//! leads to one) → the QP is destroyed (flushing every work request) → the
//! CQ → the memory → done.
//!
//! # A command
//!
//! `SRP_CMD` arrives → descriptors parsed (direction from the nibbles:
//! DATA-IN if the low nibble says so, else DATA-OUT; direct, indirect with
//! the inline list only, or immediate at the negotiated offset) →
//! staging memory → for DATA-OUT, RDMA READs (at most the negotiated
//! initiator depth outstanding) → the SCSI target executes it (data-in is
//! written straight into the staging buffer; a WRITE's data-out is copied
//! once, from the staging buffer straight into the store's chunks, with no
//! intermediate buffer) → RDMA WRITEs of the data-in
//! and the `SRP_RSP` SEND, in one batch when the send queue has room →
//! the SEND completes → the memory goes back.
//!
//! A READ takes no staging memory when the target's RAM disks are
//! registered with its PD (`SrpTargetConfig::zero_copy_reads`, the
//! default): the SCSI target hands its data out as extents of the store's
//! own chunks (see [`crate::scsi_target::store`]), the WRITEs gather from
//! them, and the chunks stay pinned until the command is removed — its
//! SEND completed or was flushed, or it was aborted and quiesced. A write
//! racing such a READ copies the chunk instead of waiting, so the READ
//! sends the blocks whole, as they were before the write.
//!
//! Every `SRP_RSP` returns one credit plus whatever accumulated (commands
//! aborted without a response). The misbehaviour switches hook in where
//! the behaviour they change happens.
//!
//! While the channel is live, the common commands never reach this thread:
//! the DPC lane ([`super::lane`]) serves them in the CQ's DPC and only
//! leaves the rest here. The thread shares the credit account and the
//! delivered-buffer history with it, counts its commands as outstanding,
//! leaves its share of the send queue alone, and turns it off while
//! credits are withheld, after a logout and when the channel goes down.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hca_lowlevel::cqe::Syndrome;
use hca_lowlevel::device::AsyncEvent;
use kverbs::cq::Cq;
use kverbs::irql::Passive;
use kverbs::mr::Mr;
use kverbs::platform::host::HostPlatform;
use kverbs::qp::{Qp, QueueKind};
use kverbs::wr::{Completion, Payload, ReadWr, SendFlags, SendWr, Signal, WcStatus, WriteWr};
use storport_srp::scsi::{AdditionalSense, SenseKey, SenseRepr, Status};
use storport_srp::wire::Residual;
use storport_srp::wire::srp::{
    AerReq, AerReqRepr, AerRsp, AerRspRepr, Cmd, CmdRepr, CredReq, CredReqRepr, CredRsp,
    CredRspRepr, DataIn, DataOut, DirectDesc, Opcode, Rsp, RspRepr, SolNot, TLogout, TLogoutRepr,
    TaskMgmtFunction, TmResponse, TskMgmt, TskMgmtRepr,
};
use storport_srp::wire::{Lun, srp};

use super::TargetShared;
use super::counters::Counters;
use super::lane::LanePlan;
use super::misbehave::{Fate, HostileAttempt, HostileOutcome, HostileReport, RspCorruption};
use super::shared::{
    ChannelShared, ChannelState, CmdRef, DisconnectWhy, Note, Request, SendWhat, SrpSink, Terminal,
    WrCtx, write_response,
};
use super::staging::{Piece, Staging, StagingError, StagingPool, for_each_gather_piece, pieces};
use crate::scsi_target::{DataOut as ScsiDataOut, Extent, Request as ScsiRequest};

type Hp = HostPlatform;

/// Receive slots beyond `rq_size`: responses to target requests
/// (`SRP_CRED_RSP`, `SRP_AER_RSP`) and `SRP_I_LOGOUT` use no credit.
pub(crate) const RECV_EXTRA: u32 = 8;
/// Send slots beyond `rq_size`: task management responses and target
/// requests.
pub(crate) const SEND_EXTRA: u32 = 16;
/// The hostile scratch buffer (source of hostile writes, sink of reads).
pub(crate) const SCRATCH_LEN: usize = 64 << 10;
/// The byte hostile writes carry.
pub(crate) const HOSTILE_BYTE: u8 = 0xEE;
/// Longest sleep of an idle channel thread.
const IDLE_WAIT: Duration = Duration::from_millis(50);
/// How long ago a buffer's response must have been delivered for the
/// stale-rkey switch to use it.
const STALE_AGE: Duration = Duration::from_millis(20);
/// Tags of target-initiated requests (distinct from anything an initiator
/// would expect back from a command).
const TARGET_TAG_BASE: u64 = 0x5352_5054_0000_0000;

/// What was negotiated at login.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Negotiated {
    pub(crate) max_ti_iu_len: u32,
    pub(crate) imm_data_offset: Option<u16>,
    pub(crate) read_depth: u32,
}

/// The objects of a channel, created at login.
pub(crate) struct Objects {
    pub(crate) qp: Qp<Hp, WrCtx>,
    pub(crate) cq: Cq<Hp, WrCtx>,
    pub(crate) recv_mr: Mr<Hp>,
    pub(crate) send_mr: Mr<Hp>,
    pub(crate) scratch_mr: Mr<Hp>,
    pub(crate) send_slots: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Phase {
    /// Waiting for the CM's established event.
    Accepting,
    /// The zero-length WRITE is posted.
    Starting,
    Live,
    /// Disconnect requested; waiting for the CM's terminal event.
    Disconnecting,
    /// The QP is being destroyed.
    DestroyingQp,
    /// The CQ is being destroyed.
    DestroyingCq,
    Done,
}

/// Where a command's data comes from or goes to.
#[derive(Debug, Clone)]
enum Transfer {
    None,
    In(Vec<DirectDesc>),
    Out(Vec<DirectDesc>),
    Immediate(Vec<u8>),
}

impl Transfer {
    fn first_desc(&self) -> Option<DirectDesc> {
        match self {
            Self::In(d) | Self::Out(d) => d.iter().copied().find(|d| d.len > 0),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Waiting for staging memory.
    WaitStaging,
    /// RDMA READs queued or outstanding.
    Reading,
    /// Executed; response held back until the instant.
    Delayed,
    /// Executed; queued for its WRITEs and SEND.
    Queued,
    /// Some WRITEs posted, the SEND not yet.
    Writing,
    /// The SEND is posted.
    Sent,
    /// The response is dropped; waiting for task management.
    Dropped,
}

/// The response, kept until its SEND is built (the credit delta is decided
/// then).
#[derive(Debug, Clone)]
struct Answer {
    status: Status,
    sense: Option<Vec<u8>>,
    data_in_residual: Residual,
    data_out_residual: Residual,
    solicited: bool,
}

#[derive(Debug)]
struct Command {
    tag: u64,
    lun: Lun,
    cdb: Vec<u8>,
    sol_not: SolNot,
    transfer: Transfer,
    total: u32,
    staging: Option<Staging>,
    stage: Stage,
    /// Signalled work requests outstanding (READs, the last WRITE of a
    /// batch without the SEND).
    inflight: u32,
    reads_left: u32,
    writes: Vec<Piece>,
    /// For a READ served from the store: each WRITE's local source
    /// (lkey, address), beside `writes` (whose `local_off` is then 0).
    write_src: Vec<(u32, u64)>,
    /// A READ served from the store's chunks, not from staging.
    zero_copy: bool,
    /// The store extents the WRITEs gather from, pinned until the command
    /// is removed (its SEND completed or flushed, or it was aborted and
    /// quiesced): dropping them unpins.
    extents: Vec<Extent>,
    writes_posted: usize,
    answer: Option<Answer>,
    fate: Fate,
    aborted: bool,
    hostile_after: Option<Duration>,
}

impl Command {
    fn abortable(&self) -> bool {
        !matches!(self.stage, Stage::Sent) && !self.aborted
    }
}

/// A task management function waiting for the commands it aborted to
/// quiesce.
#[derive(Debug)]
struct PendingTm {
    tag: u64,
    code: TmResponse,
    waiting: Vec<CmdRef>,
}

/// Credits held back by the withholding switch.
#[derive(Debug)]
struct Withhold {
    remaining: u32,
    withheld: i32,
    idle_release: Duration,
}

/// A hostile write to do later.
#[derive(Debug, Clone, Copy)]
struct LaterHostile {
    at: Instant,
    report: usize,
}

/// One operation of a send-queue batch.
#[derive(Debug, Clone, Copy)]
enum Op {
    Read {
        piece: Piece,
        lkey: u32,
        base: u64,
        ctx: WrCtx,
    },
    Write {
        piece: Piece,
        lkey: u32,
        base: u64,
        ctx: Option<WrCtx>,
    },
    Send {
        slot: u32,
        len: u32,
        solicited: bool,
        what: SendWhat,
    },
    ZeroLength,
}

/// The channel, owned by its thread.
pub(crate) struct Channel {
    shared: Arc<ChannelShared>,
    target: Arc<TargetShared>,
    objects: Objects,
    neg: Negotiated,
    phase: Phase,
    staging: StagingPool,
    req_size: usize,
    rsp_size: usize,
    early: VecDeque<Vec<u8>>,
    iu: Vec<u8>,
    data_out: Vec<u8>,
    notes: Vec<Note>,
    free_send: Vec<u32>,
    cmds: Vec<Option<Command>>,
    generations: Vec<u32>,
    free_cmds: Vec<u32>,
    wait_staging: VecDeque<CmdRef>,
    reads: VecDeque<(CmdRef, Piece)>,
    reads_inflight: u32,
    out: VecDeque<CmdRef>,
    delayed: Vec<(Instant, CmdRef)>,
    tms: Vec<PendingTm>,
    /// Built IUs waiting for a send slot (bytes, what).
    pending_ius: VecDeque<(Vec<u8>, SendWhat)>,
    withhold: Option<Withhold>,
    idle_since: Instant,
    outstanding_requests: Vec<(u64, Opcode)>,
    next_request_tag: u64,
    /// The send-queue share left to the DPC lane.
    lane_wrs: u32,
    later: Vec<LaterHostile>,
    logout: bool,
    zero_length_posted: bool,
}

impl Channel {
    pub(crate) fn new(
        shared: Arc<ChannelShared>,
        target: Arc<TargetShared>,
        objects: Objects,
        neg: Negotiated,
    ) -> Self {
        let config = &target.config;
        let staging = StagingPool::new(target.pd.clone(), config.staging_bytes);
        let req_size = config.srp_max_req_size as usize;
        let rsp_size = config.srp_max_rsp_size as usize;
        let free_send = (0..objects.send_slots).rev().collect();
        let lane_wrs = LanePlan::for_config(config).wr_budget;
        Self {
            shared,
            target,
            objects,
            neg,
            phase: Phase::Accepting,
            staging,
            req_size,
            rsp_size,
            early: VecDeque::new(),
            iu: Vec::with_capacity(req_size),
            data_out: Vec::new(),
            notes: Vec::with_capacity(256),
            free_send,
            cmds: Vec::new(),
            generations: Vec::new(),
            free_cmds: Vec::new(),
            wait_staging: VecDeque::new(),
            reads: VecDeque::new(),
            reads_inflight: 0,
            out: VecDeque::new(),
            delayed: Vec::new(),
            tms: Vec::new(),
            pending_ius: VecDeque::new(),
            withhold: None,
            idle_since: Instant::now(),
            outstanding_requests: Vec::new(),
            next_request_tag: TARGET_TAG_BASE,
            lane_wrs,
            later: Vec::new(),
            logout: false,
            zero_length_posted: false,
        }
    }

    pub(crate) fn shared(&self) -> &Arc<ChannelShared> {
        &self.shared
    }

    fn counters(&self) -> &Counters {
        &self.target.counters
    }

    /// The thread's body.
    pub(crate) fn run(mut self, p: &Passive<'_>) {
        self.shared.lane.lock(p).negotiated(self.neg);
        while self.phase != Phase::Done {
            while let Some(request) = self.shared.take_request() {
                self.on_request(request, p);
            }
            let mut notes = std::mem::take(&mut self.notes);
            self.shared.take_notes(p, &mut notes);
            for note in notes.drain(..) {
                self.on_note(note, p);
            }
            self.notes = notes;
            if self.shared.lost.load(std::sync::atomic::Ordering::Acquire) > 0 {
                // A note was lost: nothing here can be trusted any more.
                self.disconnect(p);
            }
            self.on_time(p);
            self.progress(p);
            self.sync_lane(p);
            if self.phase != Phase::Done {
                let wait = self.next_wake();
                self.shared.wait(wait, p);
            }
        }
        self.release(p);
    }

    /// Lets the DPC lane serve while the channel is live and nothing the
    /// lane does not do is under way (credits withheld, logout).
    fn sync_lane(&self, p: &Passive<'_>) {
        let serving = self.phase == Phase::Live && self.withhold.is_none() && !self.logout;
        self.shared.credits.set_hold(self.withhold.is_some());
        let mut lane = self.shared.lane.lock(p);
        if lane.serving != serving {
            lane.serving = serving;
        }
    }

    fn next_wake(&self) -> Duration {
        let now = Instant::now();
        let mut until = now + IDLE_WAIT;
        for (at, _) in &self.delayed {
            until = until.min(*at);
        }
        for l in &self.later {
            until = until.min(l.at);
        }
        if let Some(w) = &self.withhold {
            if w.withheld > 0 {
                until = until.min(self.idle_since + w.idle_release);
            }
        }
        until.saturating_duration_since(now)
    }

    // ---- requests from the target --------------------------------------

    fn on_request(&mut self, request: Request, p: &Passive<'_>) {
        match request {
            Request::Disconnect(why) => {
                if why == DisconnectWhy::Relogin {
                    Counters::add(&self.counters().channels_terminated_by_relogin, 1);
                }
                self.disconnect(p);
            }
            Request::Abandon => {
                if self.phase < Phase::DestroyingQp {
                    self.destroy_qp(p);
                }
            }
            Request::CredReq { delta } if self.phase == Phase::Live => {
                let delta = delta.saturating_add(self.shared.credits.take_pending());
                self.queue_cred_req(delta);
            }
            Request::AerReq { lun, sense, delta } if self.phase == Phase::Live => {
                self.queue_aer_req(lun, &sense, delta);
            }
            Request::TLogout { reason } if self.phase == Phase::Live => {
                let tag = self.new_request_tag();
                let repr = TLogoutRepr {
                    solicited: false,
                    reason,
                    tag,
                };
                let mut buf = vec![0u8; repr.buffer_len()];
                let _ = repr.emit(&mut TLogout::new_unchecked(&mut buf[..]));
                Counters::add(&self.counters().t_logout_sent, 1);
                self.pending_ius.push_back((buf, SendWhat::TLogout));
            }
            Request::CredReq { .. } | Request::AerReq { .. } | Request::TLogout { .. } => {}
        }
    }

    fn new_request_tag(&mut self) -> u64 {
        let tag = self.next_request_tag;
        self.next_request_tag = self.next_request_tag.wrapping_add(1);
        tag
    }

    fn queue_cred_req(&mut self, delta: i32) {
        let tag = self.new_request_tag();
        let repr = CredReqRepr {
            solicited: false,
            req_lim_delta: delta,
            tag,
        };
        let mut buf = vec![0u8; repr.buffer_len()];
        let _ = repr.emit(&mut CredReq::new_unchecked(&mut buf[..]));
        self.grant(delta);
        Counters::add(&self.counters().cred_req_sent, 1);
        self.outstanding_requests.push((tag, Opcode::CredReq));
        self.pending_ius.push_back((buf, SendWhat::Plain));
    }

    fn queue_aer_req(&mut self, lun: u16, sense: &SenseRepr, delta: i32) {
        let tag = self.new_request_tag();
        let mut sense_buf = [0u8; 252];
        let sense_len = sense.emit(&mut sense_buf).unwrap_or(0);
        let max_sense = self
            .max_rsp_len()
            .saturating_sub(srp::aer::REQ_LEN)
            .min(sense_len);
        let repr = AerReqRepr {
            solicited: false,
            req_lim_delta: delta,
            tag,
            lun: Lun::from_index(lun).unwrap_or_default(),
            sense: sense_buf.get(..max_sense).unwrap_or(&[]),
        };
        let mut buf = vec![0u8; repr.buffer_len()];
        let _ = repr.emit(&mut AerReq::new_unchecked(&mut buf[..]));
        self.grant(delta);
        Counters::add(&self.counters().aer_req_sent, 1);
        self.outstanding_requests.push((tag, Opcode::AerReq));
        self.pending_ius.push_back((buf, SendWhat::Plain));
    }

    /// Longest IU this channel sends: the response buffer, and what the
    /// initiator said it takes.
    fn max_rsp_len(&self) -> usize {
        self.rsp_size.min(self.neg.max_ti_iu_len as usize)
    }

    /// Records credits given to the initiator.
    fn grant(&mut self, delta: i32) {
        self.shared.credits.grant(delta, &self.target.counters);
    }

    // ---- notes from DISPATCH_LEVEL ---------------------------------------

    fn on_note(&mut self, note: Note, p: &Passive<'_>) {
        match note {
            Note::Wc(c) => self.on_completion(c, p),
            Note::Established => match self.phase {
                Phase::Accepting => {
                    self.phase = Phase::Starting;
                    self.zero_length_posted = false;
                }
                // Told to go while the accept was still on its way (a
                // SINGLE re-login racing this one): the disconnect asked
                // then found nothing to end; end it now.
                Phase::Disconnecting => {
                    let _ = self.target.port.disconnect(self.shared.cm_id, &[], p);
                }
                _ => {}
            },
            Note::Terminal(t) => {
                let _ = t == Terminal::Disconnected;
                if self.phase < Phase::DestroyingQp {
                    self.destroy_qp(p);
                }
            }
            Note::QpDestroyed => {
                if self.phase == Phase::DestroyingQp {
                    self.phase = Phase::DestroyingCq;
                    if self.objects.cq.destroy(p).is_err() {
                        // Still attached (cannot happen after the QP's
                        // destroy callback) or destroyed already.
                        self.phase = Phase::Done;
                    }
                }
            }
            Note::CqDestroyed => {
                if self.phase == Phase::DestroyingCq {
                    self.phase = Phase::Done;
                }
            }
            Note::LanePostFailed => self.disconnect(p),
            Note::LaneIdle => self.idle_since = Instant::now(),
            Note::QpEvent(event) => {
                if matches!(
                    event,
                    AsyncEvent::QpFatal { .. }
                        | AsyncEvent::QpAccessError { .. }
                        | AsyncEvent::QpRequestError { .. }
                ) {
                    self.disconnect(p);
                }
            }
        }
    }

    fn on_completion(&mut self, c: Completion<WrCtx>, p: &Passive<'_>) {
        let failed = match c.status {
            WcStatus::Success => false,
            WcStatus::Flushed => true,
            WcStatus::Error(syndrome) => {
                Counters::add(&self.counters().wr_errors, 1);
                if matches!(
                    syndrome,
                    Some(Syndrome::RemoteAccess | Syndrome::LocalProt | Syndrome::LocalAccess)
                ) {
                    Counters::add(&self.counters().protection_errors, 1);
                }
                // The QP is in error now: take the connection down.
                self.disconnect(p);
                true
            }
        };
        let Some(ctx) = c.context else {
            return;
        };
        match ctx {
            WrCtx::Recv(slot) => {
                if !failed {
                    self.on_recv(slot, c.byte_len, p);
                }
            }
            // The lane accounted for its own SEND in the DPC.
            WrCtx::Send {
                what: SendWhat::Served,
                ..
            } => {}
            WrCtx::Send { slot, what } => {
                self.free_send.push(slot);
                match what {
                    SendWhat::Served => {}
                    SendWhat::Response(r) => self.on_response_sent(r, !failed, p),
                    SendWhat::Plain => {}
                    SendWhat::TLogout => self.disconnect(p),
                }
            }
            WrCtx::Read(r) => {
                self.reads_inflight = self.reads_inflight.saturating_sub(1);
                self.on_transfer_done(r, failed, p);
            }
            WrCtx::Write(r) => self.on_transfer_done(r, failed, p),
            WrCtx::ZeroLength => {
                if !failed && self.phase == Phase::Starting {
                    Counters::add(&self.counters().zero_length_writes, 1);
                    Counters::add(&self.counters().channels_live, 1);
                    self.phase = Phase::Live;
                    self.shared.set_state(ChannelState::Live);
                    while let Some(iu) = self.early.pop_front() {
                        self.handle_iu(&iu, p);
                    }
                }
            }
            WrCtx::Hostile(index) => {
                let outcome = match c.status {
                    WcStatus::Success => HostileOutcome::Succeeded,
                    WcStatus::Flushed => HostileOutcome::Flushed,
                    WcStatus::Error(s) => HostileOutcome::Refused(s),
                };
                self.target.set_hostile_outcome(index, outcome);
            }
        }
    }

    // ---- receiving --------------------------------------------------------

    fn on_recv(&mut self, slot: u32, len: u32, p: &Passive<'_>) {
        let mut iu = std::mem::take(&mut self.iu);
        let len = (len as usize).min(self.req_size);
        iu.clear();
        iu.resize(len, 0);
        let at = slot as usize * self.req_size;
        let _ = self.objects.recv_mr.mem().read(at, &mut iu);
        // The IU is copied out: the slot can take the next one at once.
        self.post_recv(slot, p);
        match self.phase {
            Phase::Accepting | Phase::Starting => self.early.push_back(iu.clone()),
            Phase::Live => self.handle_iu(&iu, p),
            _ => {}
        }
        self.iu = iu;
    }

    pub(crate) fn post_recv(&self, slot: u32, p: &Passive<'_>) -> bool {
        let Some(sge) = self
            .objects
            .recv_mr
            .sge(slot as u64 * self.req_size as u64, self.req_size as u32)
        else {
            return false;
        };
        let Ok(mut batch) = self.objects.qp.begin_recv(p) else {
            return false;
        };
        if batch.recv(&[sge], WrCtx::Recv(slot)).is_err() {
            return false;
        }
        batch.commit();
        true
    }

    fn handle_iu(&mut self, iu: &[u8], p: &Passive<'_>) {
        let Some(&byte) = iu.first() else {
            Counters::add(&self.counters().malformed_ius, 1);
            return;
        };
        match Opcode::from_u8(byte) {
            Some(Opcode::Cmd) => self.on_cmd(iu, p),
            Some(Opcode::TskMgmt) => self.on_tm(iu),
            Some(Opcode::ILogout) => {
                Counters::add(&self.counters().srp_i_logout, 1);
                self.logout = true;
            }
            Some(Opcode::CredRsp) => {
                Counters::add(&self.counters().srp_cred_rsp, 1);
                let tag = CredRsp::new_checked(iu)
                    .ok()
                    .and_then(|v| CredRspRepr::parse(&v).ok())
                    .map(|r| r.tag);
                self.match_request(tag, Opcode::CredReq);
            }
            Some(Opcode::AerRsp) => {
                Counters::add(&self.counters().srp_aer_rsp, 1);
                let tag = AerRsp::new_checked(iu)
                    .ok()
                    .and_then(|v| AerRspRepr::parse(&v).ok())
                    .map(|r| r.tag);
                self.match_request(tag, Opcode::AerReq);
            }
            _ => Counters::add(&self.counters().malformed_ius, 1),
        }
    }

    fn match_request(&mut self, tag: Option<u64>, kind: Opcode) {
        let at = tag.and_then(|tag| {
            self.outstanding_requests
                .iter()
                .position(|&(t, k)| t == tag && k == kind)
        });
        match at {
            Some(i) => {
                self.outstanding_requests.swap_remove(i);
            }
            None => Counters::add(&self.counters().unmatched_target_responses, 1),
        }
    }

    fn use_credit(&mut self) {
        self.shared.credits.use_credit(&self.target.counters);
    }

    // ---- commands ---------------------------------------------------------

    fn on_cmd(&mut self, iu: &[u8], p: &Passive<'_>) {
        Counters::add(&self.counters().srp_cmd, 1);
        self.use_credit();
        if self.target.switches.command_disconnects() {
            Counters::add(&self.counters().forced_disconnects, 1);
            self.disconnect(p);
            return;
        }
        let view = Cmd::new_unchecked(iu);
        if iu.len() < 16 {
            Counters::add(&self.counters().malformed_ius, 1);
            return;
        }
        let tag = view.tag();
        let lun = view.lun();
        let parsed = Cmd::new_checked(iu)
            .and_then(|v| CmdRepr::parse(&v, self.neg.imm_data_offset))
            .ok()
            .and_then(|repr| transfer_of(&repr).map(|t| (repr, t)));
        let Some((repr, transfer)) = parsed else {
            Counters::add(&self.counters().bad_descriptors, 1);
            self.answer_now(tag, lun, view.sol_not(), invalid_field_in_cdb());
            return;
        };
        if let Some(&op) = repr.cdb.first() {
            self.counters().scsi_ops.count(op);
        }
        let total = match &transfer {
            Transfer::None => Some(0),
            Transfer::In(d) | Transfer::Out(d) => {
                d.iter().try_fold(0u32, |acc, d| acc.checked_add(d.len))
            }
            Transfer::Immediate(data) => u32::try_from(data.len()).ok(),
        };
        // A READ's data can go out straight from the store's chunks.
        let zero_copy = matches!(transfer, Transfer::In(_))
            && self.target.store_key.is_some()
            && is_read(repr.cdb);
        let needs_staging = matches!(transfer, Transfer::In(_) | Transfer::Out(_)) && !zero_copy;
        let fits = total.is_some_and(|t| !needs_staging || self.staging.fits(t as usize));
        let reads_possible = !matches!(transfer, Transfer::Out(_)) || self.neg.read_depth > 0;
        let Some(total) = total.filter(|_| fits && reads_possible) else {
            Counters::add(&self.counters().bad_descriptors, 1);
            self.answer_now(tag, lun, repr.sol_not, invalid_field_in_cdb());
            return;
        };
        if let Transfer::Immediate(data) = &transfer {
            Counters::add(&self.counters().bytes_immediate, data.len() as u64);
        }
        let hostile_after = self.hostile_on_command(tag, &transfer, p);
        let command = Command {
            tag,
            lun,
            cdb: repr.cdb.to_vec(),
            sol_not: repr.sol_not,
            transfer,
            total,
            staging: None,
            stage: Stage::WaitStaging,
            inflight: 0,
            reads_left: 0,
            writes: Vec::new(),
            write_src: Vec::new(),
            zero_copy: false,
            extents: Vec::new(),
            writes_posted: 0,
            answer: None,
            fate: Fate::Send,
            aborted: false,
            hostile_after,
        };
        let mut command = command;
        command.zero_copy = zero_copy;
        let r = self.insert(command);
        if needs_staging {
            self.wait_staging.push_back(r);
            self.feed_staging(p);
        } else {
            self.execute(r);
        }
    }

    fn insert(&mut self, command: Command) -> CmdRef {
        let slot = match self.free_cmds.pop() {
            Some(slot) => slot,
            None => {
                self.cmds.push(None);
                self.generations.push(0);
                u32::try_from(self.cmds.len() - 1).unwrap_or(u32::MAX)
            }
        };
        let generation = self.generations.get(slot as usize).copied().unwrap_or(0);
        if let Some(entry) = self.cmds.get_mut(slot as usize) {
            *entry = Some(command);
        }
        CmdRef { slot, generation }
    }

    fn cmd(&mut self, r: CmdRef) -> Option<&mut Command> {
        slot_mut(&mut self.cmds, &self.generations, r)
    }

    /// Removes a command, giving its memory back.
    fn remove(&mut self, r: CmdRef) -> Option<Command> {
        if self.generations.get(r.slot as usize) != Some(&r.generation) {
            return None;
        }
        let mut cmd = self.cmds.get_mut(r.slot as usize)?.take()?;
        if let Some(g) = self.generations.get_mut(r.slot as usize) {
            *g = g.wrapping_add(1);
        }
        self.free_cmds.push(r.slot);
        if let Some(buf) = cmd.staging.take() {
            self.staging.put(buf);
        }
        Some(cmd)
    }

    /// Gives staging memory to waiting commands, in order.
    fn feed_staging(&mut self, p: &Passive<'_>) {
        while let Some(&r) = self.wait_staging.front() {
            let Some(total) = self.cmd(r).map(|c| c.total) else {
                self.wait_staging.pop_front();
                continue;
            };
            match self.staging.get(total as usize, p) {
                Ok(buf) => {
                    self.wait_staging.pop_front();
                    self.staged(r, buf);
                }
                Err(StagingError::Busy) => {
                    Counters::add(&self.counters().staging_waits, 1);
                    break;
                }
                Err(StagingError::TooLarge | StagingError::Failed(_)) => {
                    // Nothing to wait for: the target is out of memory.
                    self.wait_staging.pop_front();
                    if let Some(cmd) = self.remove(r) {
                        let answer = busy_answer();
                        self.answer_now(cmd.tag, cmd.lun, cmd.sol_not, answer);
                    }
                }
            }
        }
    }

    /// A command got its staging buffer: fetch data-out, or execute.
    fn staged(&mut self, r: CmdRef, buf: Staging) {
        let max = self.target.config.max_rdma_size;
        let Some(cmd) = self.cmd(r) else {
            return;
        };
        cmd.staging = Some(buf);
        match &cmd.transfer {
            Transfer::Out(descs) => {
                let list = pieces(descs, cmd.total, max);
                cmd.stage = Stage::Reading;
                cmd.reads_left = u32::try_from(list.len()).unwrap_or(u32::MAX);
                if list.is_empty() {
                    self.execute(r);
                } else {
                    self.reads.extend(list.into_iter().map(|piece| (r, piece)));
                }
            }
            _ => self.execute(r),
        }
    }

    /// A READ or a signalled WRITE of `r` completed.
    fn on_transfer_done(&mut self, r: CmdRef, failed: bool, p: &Passive<'_>) {
        let Some(cmd) = self.cmd(r) else {
            return;
        };
        cmd.inflight = cmd.inflight.saturating_sub(1);
        let quiet = cmd.inflight == 0;
        if cmd.aborted {
            if quiet {
                self.finish_aborted(r);
            }
            return;
        }
        if failed {
            // The channel is going down; the command goes with it.
            return;
        }
        match cmd.stage {
            Stage::Reading => {
                cmd.reads_left = cmd.reads_left.saturating_sub(1);
                if cmd.reads_left == 0 && quiet {
                    self.execute(r);
                }
            }
            Stage::Dropped if quiet && cmd.writes_posted == cmd.writes.len() => {
                // The data is delivered and the response will never be:
                // the buffer and the chunk pins go back; the command
                // waits for an abort.
                cmd.extents.clear();
                if let Some(buf) = cmd.staging.take() {
                    self.staging.put(buf);
                    self.feed_staging(p);
                }
            }
            _ => {}
        }
    }

    /// Runs the command through the SCSI target.
    fn execute(&mut self, r: CmdRef) {
        let mut data_out = std::mem::take(&mut self.data_out);
        let target = Arc::clone(&self.target);
        let max_rsp = self.max_rsp_len();
        let max_rdma = self.target.config.max_rdma_size;
        let Some(cmd) = self.cmd(r) else {
            self.data_out = data_out;
            return;
        };
        let (out, capacity): (Option<ScsiDataOut<'_>>, u32) = match &cmd.transfer {
            Transfer::None => (None, 0),
            Transfer::In(_) => (None, cmd.total),
            Transfer::Out(_) => {
                // The SCSI target takes the data-out from the staging
                // buffer the RDMA READs landed in: a WRITE copies it once,
                // straight into the store. Without a buffer that holds it
                // (never expected) the data-out is zeros, never an earlier
                // command's bytes.
                let total = cmd.total as usize;
                let staged = cmd
                    .staging
                    .as_ref()
                    .and_then(|buf| ScsiDataOut::dma(buf.mr.mem(), total));
                let out = staged.unwrap_or_else(|| {
                    data_out.clear();
                    data_out.resize(total, 0);
                    ScsiDataOut::Bytes(&data_out[..])
                });
                (Some(out), 0)
            }
            Transfer::Immediate(data) => (Some(ScsiDataOut::Bytes(&data[..])), 0),
        };
        let request = ScsiRequest {
            lun: cmd.lun,
            cdb: &cmd.cdb,
            data_out: out,
            data_in_capacity: capacity,
        };
        let mut sink = SrpSink {
            staging: cmd.staging.as_ref().map(|s| &s.mr),
            written: 0,
            store_key: target.store_key.filter(|_| cmd.zero_copy),
            extents: &mut cmd.extents,
            max_extents: usize::MAX,
        };
        let Some(response) = target.scsi.execute_declinable(&request, &mut sink) else {
            // A chunk of the range is not registered (its registration
            // failed): this READ copies through staging after all.
            cmd.extents.clear();
            cmd.zero_copy = false;
            cmd.stage = Stage::WaitStaging;
            self.data_out = data_out;
            self.wait_staging.push_back(r);
            return;
        };
        if let Transfer::Out(_) = cmd.transfer {
            Counters::add(&target.counters.bytes_data_out, u64::from(cmd.total));
        }
        let sense = response.sense_bytes().map(|s| {
            let keep = s.len().min(max_rsp.saturating_sub(srp::rsp::LEN));
            s.get(..keep).unwrap_or(&[]).to_vec()
        });
        let good = response.status == Status::GOOD;
        let solicited = if good {
            cmd.sol_not.contains(SolNot::SUCCESSFUL)
        } else {
            cmd.sol_not.contains(SolNot::UNSUCCESSFUL)
        };
        cmd.answer = Some(Answer {
            status: response.status,
            sense,
            data_in_residual: response.data_in_residual,
            data_out_residual: response.data_out_residual,
            solicited,
        });
        if let Transfer::In(descs) = &cmd.transfer {
            if cmd.zero_copy {
                let (writes, src) = (&mut cmd.writes, &mut cmd.write_src);
                let complete = for_each_gather_piece(
                    descs,
                    &cmd.extents,
                    response.data_in_len,
                    max_rdma,
                    |remote_addr, rkey, len, lkey, local| {
                        writes.push(Piece {
                            remote_addr,
                            rkey,
                            local_off: 0,
                            len,
                        });
                        src.push((lkey, local));
                    },
                );
                if !complete {
                    // The store described fewer bytes than the READ sent
                    // (a bug): no data, and the initiator hears BUSY.
                    writes.clear();
                    src.clear();
                    cmd.answer = Some(busy_answer());
                }
                Counters::add(&target.counters.zero_copy_reads, 1);
            } else {
                cmd.writes = pieces(descs, response.data_in_len, max_rdma);
            }
        }
        self.data_out = data_out;
        let fate = self.target.switches.response_fate();
        let Some(cmd) = self.cmd(r) else {
            return;
        };
        cmd.fate = fate;
        match fate {
            Fate::Delay(d) => {
                Counters::add(&target.counters.responses_delayed, 1);
                cmd.stage = Stage::Delayed;
                self.delayed.push((Instant::now() + d, r));
            }
            Fate::Drop => {
                Counters::add(&target.counters.responses_dropped, 1);
                cmd.stage = Stage::Queued;
                self.out.push_back(r);
            }
            Fate::Corrupt(_) => {
                Counters::add(&target.counters.responses_corrupted, 1);
                cmd.stage = Stage::Queued;
                self.out.push_back(r);
            }
            Fate::Send => {
                cmd.stage = Stage::Queued;
                self.out.push_back(r);
            }
        }
    }

    /// Answers a command that never got a table entry (bad descriptors,
    /// no memory): CHECK CONDITION or BUSY, no data.
    fn answer_now(&mut self, tag: u64, lun: Lun, sol_not: SolNot, answer: Answer) {
        let mut answer = answer;
        answer.solicited = sol_not.contains(SolNot::UNSUCCESSFUL);
        let command = Command {
            tag,
            lun,
            cdb: Vec::new(),
            sol_not,
            transfer: Transfer::None,
            total: 0,
            staging: None,
            stage: Stage::Queued,
            inflight: 0,
            reads_left: 0,
            writes: Vec::new(),
            write_src: Vec::new(),
            zero_copy: false,
            extents: Vec::new(),
            writes_posted: 0,
            answer: Some(answer),
            fate: Fate::Send,
            aborted: false,
            hostile_after: None,
        };
        let r = self.insert(command);
        self.out.push_back(r);
    }

    fn on_response_sent(&mut self, r: CmdRef, delivered: bool, p: &Passive<'_>) {
        let Some(cmd) = self.remove(r) else {
            return;
        };
        if delivered {
            if let Some(desc) = cmd.transfer.first_desc() {
                self.shared.lane.lock(p).remember(cmd.tag, desc);
                if let (Some(delay), Transfer::In(_)) = (cmd.hostile_after, &cmd.transfer) {
                    let report = self.target.add_hostile(HostileReport {
                        attempt: HostileAttempt::AfterResponse { delay },
                        channel: self.shared.id,
                        tag: cmd.tag,
                        remote_addr: desc.va,
                        rkey: desc.rkey,
                        len: desc.len.min(512),
                        outcome: HostileOutcome::Pending,
                    });
                    self.later.push(LaterHostile {
                        at: Instant::now() + delay,
                        report,
                    });
                }
            }
        }
        self.idle_since = Instant::now();
    }

    // ---- task management --------------------------------------------------

    fn on_tm(&mut self, iu: &[u8]) {
        Counters::add(&self.counters().srp_tsk_mgmt, 1);
        self.use_credit();
        if iu.len() < 16 {
            Counters::add(&self.counters().malformed_ius, 1);
            return;
        }
        let tag = TskMgmt::new_unchecked(iu).tag();
        let Some(tm) = TskMgmt::new_checked(iu)
            .ok()
            .and_then(|v| TskMgmtRepr::parse(&v).ok())
        else {
            Counters::add(&self.counters().malformed_ius, 1);
            self.tms.push(PendingTm {
                tag,
                code: TmResponse::Failed,
                waiting: Vec::new(),
            });
            return;
        };
        let (code, waiting) = match tm.function {
            TaskMgmtFunction::AbortTask => {
                Counters::add(&self.counters().tm_abort_task, 1);
                let found = self.find(|c| c.tag == tm.task_tag && c.abortable());
                match found.first() {
                    Some(&r) => (TmResponse::Complete, self.abort(&[r])),
                    None => (TmResponse::Failed, Vec::new()),
                }
            }
            TaskMgmtFunction::LunReset => {
                Counters::add(&self.counters().tm_lun_reset, 1);
                let exists = tm
                    .lun
                    .index()
                    .is_some_and(|i| self.target.scsi.lun(i).is_some());
                if exists {
                    let hit = self.find(|c| c.lun == tm.lun && c.abortable());
                    (TmResponse::Complete, self.abort(&hit))
                } else {
                    (TmResponse::Failed, Vec::new())
                }
            }
            _ => {
                Counters::add(&self.counters().tm_unsupported, 1);
                (TmResponse::NotSupported, Vec::new())
            }
        };
        self.tms.push(PendingTm {
            tag: tm.tag,
            code,
            waiting,
        });
    }

    fn find(&self, want: impl Fn(&Command) -> bool) -> Vec<CmdRef> {
        self.cmds
            .iter()
            .enumerate()
            .filter_map(|(slot, c)| {
                let c = c.as_ref()?;
                if !want(c) {
                    return None;
                }
                let slot = u32::try_from(slot).ok()?;
                Some(CmdRef {
                    slot,
                    generation: *self.generations.get(slot as usize)?,
                })
            })
            .collect()
    }

    /// Aborts commands; returns those with work still in flight.
    fn abort(&mut self, victims: &[CmdRef]) -> Vec<CmdRef> {
        let mut waiting = Vec::new();
        for &r in victims {
            self.wait_staging.retain(|&w| w != r);
            self.reads.retain(|&(w, _)| w != r);
            self.out.retain(|&w| w != r);
            self.delayed.retain(|&(_, w)| w != r);
            let Some(cmd) = self.cmd(r) else {
                continue;
            };
            cmd.aborted = true;
            let busy = cmd.inflight > 0;
            Counters::add(&self.target.counters.tasks_aborted, 1);
            if busy {
                waiting.push(r);
            } else {
                self.finish_aborted(r);
            }
        }
        waiting
    }

    /// An aborted command is quiet: it goes, and its credit comes back with
    /// the next response.
    fn finish_aborted(&mut self, r: CmdRef) {
        if self.remove(r).is_some() {
            self.shared.credits.owe_one();
        }
        for tm in &mut self.tms {
            tm.waiting.retain(|&w| w != r);
        }
        self.idle_since = Instant::now();
    }

    /// Task management functions whose aborted commands are quiet answer.
    fn answer_tms(&mut self) {
        let mut i = 0;
        while i < self.tms.len() {
            if self.tms.get(i).is_some_and(|t| t.waiting.is_empty()) {
                let tm = self.tms.remove(i);
                let delta = self.next_delta();
                let data = tm.code.response_data();
                let repr = RspRepr {
                    solicited: false,
                    req_lim_delta: delta,
                    tag: tm.tag,
                    status: Status::GOOD.0,
                    data_out_residual: Residual::None,
                    data_in_residual: Residual::None,
                    response_data: Some(&data),
                    sense: None,
                };
                let mut buf = vec![0u8; repr.buffer_len()];
                let _ = repr.emit(&mut Rsp::new_unchecked(&mut buf[..]));
                self.grant(delta);
                Counters::add(&self.counters().responses_sent, 1);
                self.pending_ius.push_back((buf, SendWhat::Plain));
            } else {
                i += 1;
            }
        }
    }

    // ---- credits ----------------------------------------------------------

    /// The `req_lim_delta` of the next response: one, plus what
    /// accumulated — or nothing while credits are withheld.
    fn next_delta(&mut self) -> i32 {
        if self.withhold.is_none() && !self.target.switches.idle() {
            // The lane stops before the switch is consumed (it serves only
            // while no switch is armed and no hold is set).
            self.shared.credits.set_hold(true);
            if let Some((responses, idle_release)) = self.target.switches.take_withhold() {
                self.withhold = Some(Withhold {
                    remaining: responses,
                    withheld: 0,
                    idle_release,
                });
            } else {
                self.shared.credits.set_hold(false);
            }
        }
        if let Some(w) = self.withhold.as_mut() {
            if w.remaining > 0 {
                w.remaining -= 1;
                w.withheld = w.withheld.saturating_add(1);
                Counters::add(&self.target.counters.credits_withheld_responses, 1);
                if w.remaining == 0 {
                    self.release_withheld();
                }
                return 0;
            }
        }
        1 + self.shared.credits.take_pending()
    }

    /// Gives the withheld credits back in one `SRP_CRED_REQ`.
    fn release_withheld(&mut self) {
        if let Some(w) = self.withhold.take() {
            let delta = w
                .withheld
                .saturating_add(self.shared.credits.take_pending());
            if delta > 0 {
                self.queue_cred_req(delta);
            }
        }
    }

    /// Commands the initiator is waiting on.
    fn outstanding(&self) -> usize {
        let lane = self.shared.credits.lane_inflight() as usize;
        self.cmds
            .iter()
            .flatten()
            .filter(|c| c.stage != Stage::Dropped)
            .count()
            + lane
    }

    // ---- time -------------------------------------------------------------

    fn on_time(&mut self, p: &Passive<'_>) {
        let now = Instant::now();
        let mut i = 0;
        while i < self.delayed.len() {
            match self.delayed.get(i) {
                Some(&(at, r)) if at <= now => {
                    self.delayed.swap_remove(i);
                    if let Some(cmd) = self.cmd(r) {
                        cmd.stage = Stage::Queued;
                        self.out.push_back(r);
                    }
                }
                _ => i += 1,
            }
        }
        if self.withhold.as_ref().is_some_and(|w| {
            w.withheld > 0 && self.outstanding() == 0 && now >= self.idle_since + w.idle_release
        }) {
            self.release_withheld();
        }
        let due: Vec<LaterHostile> = self.later.iter().copied().filter(|l| l.at <= now).collect();
        self.later.retain(|l| l.at > now);
        for l in due {
            if let Some(report) = self.target.hostile_report(l.report) {
                let piece = Piece {
                    remote_addr: report.remote_addr,
                    rkey: report.rkey,
                    local_off: 0,
                    len: report.len,
                };
                self.post_hostile_write(piece, l.report, p);
            }
        }
        // After SRP_I_LOGOUT: once every command the initiator still
        // waits for is answered (dropped responses never will be), the
        // target ends the channel.
        if self.logout
            && self.phase == Phase::Live
            && self.outstanding() == 0
            && self.tms.is_empty()
            && self.pending_ius.is_empty()
        {
            self.disconnect(p);
        }
    }

    // ---- hostile attempts -------------------------------------------------

    /// Fires an armed hostile attempt that applies to this command;
    /// returns the delay of an after-response attempt to arm on it.
    fn hostile_on_command(
        &mut self,
        tag: u64,
        transfer: &Transfer,
        p: &Passive<'_>,
    ) -> Option<Duration> {
        let data_in = match transfer {
            Transfer::In(_) => transfer.first_desc(),
            _ => None,
        };
        let data_out = match transfer {
            Transfer::Out(_) => transfer.first_desc(),
            _ => None,
        };
        // The newest buffer whose response was delivered long enough ago
        // for the initiator to have completed the command (with many
        // commands in flight, the last response may still be in its hands).
        let settled = Instant::now().checked_sub(STALE_AGE);
        let stale = self
            .shared
            .lane
            .lock(p)
            .done
            .iter()
            .rev()
            .find(|(at, _, _)| settled.is_some_and(|s| *at <= s))
            .map(|&(_, tag, d)| (tag, d));
        let attempt = self.target.switches.take_hostile(|h| match h {
            HostileAttempt::StaleRkey => stale.is_some(),
            HostileAttempt::BeyondBuffer { .. }
            | HostileAttempt::ReadFromWriteOnly
            | HostileAttempt::AfterResponse { .. } => data_in.is_some(),
            HostileAttempt::WriteToReadOnly => data_out.is_some(),
        })?;
        let channel = self.shared.id;
        let report = |tag: u64, remote_addr: u64, rkey: u32, len: u32| HostileReport {
            attempt,
            channel,
            tag,
            remote_addr,
            rkey,
            len,
            outcome: HostileOutcome::Pending,
        };
        match attempt {
            HostileAttempt::StaleRkey => {
                let (old_tag, d) = stale?;
                let len = d.len.min(512);
                let index = self.target.add_hostile(report(old_tag, d.va, d.rkey, len));
                self.post_hostile_write(
                    Piece {
                        remote_addr: d.va,
                        rkey: d.rkey,
                        local_off: 0,
                        len,
                    },
                    index,
                    p,
                );
                None
            }
            HostileAttempt::BeyondBuffer { past_end } => {
                let d = data_in?;
                let inside = d.len.min(64);
                let len = inside.saturating_add(past_end).min(SCRATCH_LEN as u32);
                let addr = d.va.wrapping_add(u64::from(d.len - inside));
                let index = self.target.add_hostile(report(tag, addr, d.rkey, len));
                self.post_hostile_write(
                    Piece {
                        remote_addr: addr,
                        rkey: d.rkey,
                        local_off: 0,
                        len,
                    },
                    index,
                    p,
                );
                None
            }
            HostileAttempt::ReadFromWriteOnly => {
                let d = data_in?;
                let len = d.len.min(512);
                let index = self.target.add_hostile(report(tag, d.va, d.rkey, len));
                let piece = Piece {
                    remote_addr: d.va,
                    rkey: d.rkey,
                    local_off: 0,
                    len,
                };
                let lkey = self.objects.scratch_mr.lkey();
                let base = self.objects.scratch_mr.iova();
                self.post_or_report(
                    &[Op::Read {
                        piece,
                        lkey,
                        base,
                        ctx: WrCtx::Hostile(index),
                    }],
                    index,
                    p,
                );
                None
            }
            HostileAttempt::WriteToReadOnly => {
                let d = data_out?;
                let len = d.len.min(512);
                let index = self.target.add_hostile(report(tag, d.va, d.rkey, len));
                self.post_hostile_write(
                    Piece {
                        remote_addr: d.va,
                        rkey: d.rkey,
                        local_off: 0,
                        len,
                    },
                    index,
                    p,
                );
                None
            }
            HostileAttempt::AfterResponse { delay } => Some(delay),
        }
    }

    fn post_hostile_write(&mut self, piece: Piece, index: usize, p: &Passive<'_>) {
        let lkey = self.objects.scratch_mr.lkey();
        let base = self.objects.scratch_mr.iova();
        self.post_or_report(
            &[Op::Write {
                piece,
                lkey,
                base,
                ctx: Some(WrCtx::Hostile(index)),
            }],
            index,
            p,
        );
    }

    fn post_or_report(&mut self, ops: &[Op], index: usize, p: &Passive<'_>) {
        Counters::add(&self.counters().hostile_attempts, 1);
        if self.phase != Phase::Live || !self.post(ops, p) {
            self.target
                .set_hostile_outcome(index, HostileOutcome::NotPosted);
        }
    }

    // ---- the send queue ---------------------------------------------------

    /// Posts what can be posted now, in one batch: queued IUs, RDMA READs
    /// within the initiator depth, commands' WRITEs and responses.
    fn progress(&mut self, p: &Passive<'_>) {
        self.answer_tms();
        if self.phase == Phase::Starting && !self.zero_length_posted {
            self.zero_length_posted = true;
            Counters::add(&self.counters().rdma_writes, 1);
            if !self.post(&[Op::ZeroLength], p) {
                self.disconnect(p);
            }
            return;
        }
        if self.phase != Phase::Live {
            return;
        }
        let qp = &self.objects.qp;
        // The lane's share stays free: it posts without asking the thread.
        let mut room = qp
            .send_capacity()
            .saturating_sub(self.lane_wrs)
            .saturating_sub(qp.outstanding(QueueKind::Send));
        let mut ops: Vec<Op> = Vec::new();
        // Queued IUs first (task management answers, target requests).
        while room > 0 && !self.pending_ius.is_empty() {
            let Some(slot) = self.free_send.pop() else {
                break;
            };
            let Some((bytes, what)) = self.pending_ius.pop_front() else {
                self.free_send.push(slot);
                break;
            };
            let len = bytes.len().min(self.rsp_size);
            let _ = self.objects.send_mr.mem().write(
                slot as usize * self.rsp_size,
                bytes.get(..len).unwrap_or(&[]),
            );
            ops.push(Op::Send {
                slot,
                len: len as u32,
                solicited: false,
                what,
            });
            room -= 1;
        }
        // RDMA READs, within the initiator depth.
        let target = Arc::clone(&self.target);
        let counters = &target.counters;
        let lkey_base = |c: &Command| c.staging.as_ref().map(|s| (s.mr.lkey(), s.mr.iova()));
        while room > 0 && self.reads_inflight < self.neg.read_depth {
            let Some((r, piece)) = self.reads.pop_front() else {
                break;
            };
            let Some(cmd) = slot_mut(&mut self.cmds, &self.generations, r) else {
                continue;
            };
            let Some((lkey, base)) = lkey_base(cmd) else {
                continue;
            };
            cmd.inflight += 1;
            ops.push(Op::Read {
                piece,
                lkey,
                base,
                ctx: WrCtx::Read(r),
            });
            self.reads_inflight += 1;
            room -= 1;
            Counters::add(&counters.rdma_reads, 1);
            Counters::raise(
                &counters.max_reads_outstanding,
                u64::from(self.reads_inflight),
            );
        }
        // Commands' data-in and responses, in order.
        while room > 0 {
            let Some(&r) = self.out.front() else {
                break;
            };
            let Some(cmd) = slot_mut(&mut self.cmds, &self.generations, r) else {
                self.out.pop_front();
                continue;
            };
            let staged = lkey_base(cmd);
            let left = cmd.writes.len() - cmd.writes_posted;
            let wants_send = cmd.fate != Fate::Drop;
            let mut n = left.min(room as usize);
            let slot = if wants_send && n == left && room as usize > n {
                self.free_send.pop()
            } else {
                None
            };
            let send_now = slot.is_some();
            let zero_copy = cmd.zero_copy;
            match staged.or(zero_copy.then_some((0, 0))) {
                Some((staged_lkey, staged_base)) => {
                    for i in 0..n {
                        let at = cmd.writes_posted + i;
                        let Some(&piece) = cmd.writes.get(at) else {
                            n = i;
                            break;
                        };
                        let source = if zero_copy {
                            cmd.write_src.get(at).copied()
                        } else {
                            Some((staged_lkey, staged_base))
                        };
                        let Some((lkey, base)) = source else {
                            n = i;
                            break;
                        };
                        let ctx = (i + 1 == n && !send_now).then_some(WrCtx::Write(r));
                        if ctx.is_some() {
                            cmd.inflight += 1;
                        }
                        ops.push(Op::Write {
                            piece,
                            lkey,
                            base,
                            ctx,
                        });
                        Counters::add(&counters.rdma_writes, 1);
                        Counters::add(&counters.bytes_data_in, u64::from(piece.len));
                    }
                }
                None => n = 0,
            }
            cmd.writes_posted += n;
            room -= n as u32;
            if cmd.writes_posted < cmd.writes.len() {
                cmd.stage = Stage::Writing;
                if let Some(slot) = slot {
                    self.free_send.push(slot);
                }
                break;
            }
            if !wants_send {
                cmd.stage = Stage::Dropped;
                let buf = if cmd.inflight == 0 {
                    cmd.extents.clear();
                    cmd.staging.take()
                } else {
                    None
                };
                self.out.pop_front();
                if let Some(buf) = buf {
                    self.staging.put(buf);
                }
                continue;
            }
            let Some(slot) = slot else {
                cmd.stage = Stage::Writing;
                break;
            };
            cmd.stage = Stage::Sent;
            let tag = cmd.tag;
            let answer = cmd.answer.clone();
            let fate = cmd.fate;
            self.out.pop_front();
            let delta = self.next_delta();
            let mut len = self.emit_response(slot, tag, delta, answer.as_ref());
            if let Fate::Corrupt(how) = fate {
                len = self.corrupt_response(slot, len, how);
            }
            self.grant(delta);
            Counters::add(&counters.responses_sent, 1);
            ops.push(Op::Send {
                slot,
                len,
                solicited: answer.is_some_and(|a| a.solicited),
                what: SendWhat::Response(r),
            });
            room -= 1;
        }
        if !ops.is_empty() && !self.post(&ops, p) {
            self.disconnect(p);
        }
        self.feed_staging(p);
    }

    /// Writes an `SRP_RSP` into send slot `slot`; returns its length.
    fn emit_response(&self, slot: u32, tag: u64, delta: i32, answer: Option<&Answer>) -> u32 {
        let (status, sense, din, dout) = match answer {
            Some(a) => (
                a.status,
                a.sense.as_deref(),
                a.data_in_residual,
                a.data_out_residual,
            ),
            None => (Status::GOOD, None, Residual::None, Residual::None),
        };
        let repr = RspRepr {
            solicited: answer.is_some_and(|a| a.solicited),
            req_lim_delta: delta,
            tag,
            status: status.0,
            data_out_residual: dout,
            data_in_residual: din,
            response_data: None,
            sense,
        };
        // Sense was cut to fit the response buffer, which is at most
        // MAX_MAX_RSP_SIZE bytes.
        write_response(&self.objects.send_mr, self.rsp_size, slot, &repr)
    }

    /// Makes the `SRP_RSP` in send slot `slot` (`len` bytes) malformed as
    /// `how` says; returns the length to send.
    fn corrupt_response(&self, slot: u32, len: u32, how: RspCorruption) -> u32 {
        let at = slot as usize * self.rsp_size;
        let mem = self.objects.send_mr.mem();
        match how {
            // Shorter than an SRP_RSP's fixed part (36 bytes).
            RspCorruption::Truncated => len.min(20),
            RspCorruption::SenseBeyondIu => {
                let mut head = [0u8; srp::rsp::LEN];
                if mem.read(at, &mut head).is_ok() {
                    let mut rsp = Rsp::new_unchecked(&mut head[..]);
                    // SNSVALID (flag bit 1), with a sense length far past
                    // the IU's end.
                    rsp.set_flags(rsp.flags() | 0x02);
                    rsp.set_sense_data_len(0x0001_0000);
                    let _ = mem.write(at, &head);
                }
                len
            }
        }
    }

    /// Posts `ops` as one batch (one doorbell); `false` if the QP refused
    /// (it is going away) — nothing was posted then.
    fn post(&self, ops: &[Op], p: &Passive<'_>) -> bool {
        let Ok(mut batch) = self.objects.qp.begin_send(p) else {
            return false;
        };
        for op in ops {
            let ok = match *op {
                Op::Read {
                    piece,
                    lkey,
                    base,
                    ctx,
                } => {
                    let sge = kverbs::wr::Sge {
                        addr: base + u64::from(piece.local_off),
                        len: piece.len,
                        lkey,
                    };
                    batch
                        .rdma_read(
                            &ReadWr {
                                local: &[sge],
                                remote_addr: piece.remote_addr,
                                rkey: piece.rkey,
                                flags: SendFlags::default(),
                            },
                            Signal::Signalled(ctx),
                        )
                        .is_ok()
                }
                Op::Write {
                    piece,
                    lkey,
                    base,
                    ctx,
                } => {
                    let sge = kverbs::wr::Sge {
                        addr: base + u64::from(piece.local_off),
                        len: piece.len,
                        lkey,
                    };
                    let signal = match ctx {
                        Some(ctx) => Signal::Signalled(ctx),
                        None => Signal::Unsignalled,
                    };
                    batch
                        .rdma_write(
                            &WriteWr {
                                payload: Payload::Sges(&[sge]),
                                remote_addr: piece.remote_addr,
                                rkey: piece.rkey,
                                imm: None,
                                flags: SendFlags::default(),
                            },
                            signal,
                        )
                        .is_ok()
                }
                Op::Send {
                    slot,
                    len,
                    solicited,
                    what,
                } => {
                    let Some(sge) = self
                        .objects
                        .send_mr
                        .sge(slot as u64 * self.rsp_size as u64, len)
                    else {
                        return false;
                    };
                    let sges = [sge];
                    let mut wr = SendWr::new(Payload::Sges(&sges));
                    wr.flags.solicited = solicited;
                    batch
                        .send(&wr, Signal::Signalled(WrCtx::Send { slot, what }))
                        .is_ok()
                }
                Op::ZeroLength => batch
                    .rdma_write(
                        &WriteWr {
                            payload: Payload::Sges(&[]),
                            remote_addr: 0,
                            rkey: 0,
                            imm: None,
                            flags: SendFlags::default(),
                        },
                        Signal::Signalled(WrCtx::ZeroLength),
                    )
                    .is_ok(),
            };
            if !ok {
                // Dropping the batch posts nothing.
                return false;
            }
        }
        batch.commit();
        true
    }

    // ---- going down -------------------------------------------------------

    /// Asks the CM to disconnect (DREQ); the terminal event follows.
    pub(crate) fn disconnect(&mut self, p: &Passive<'_>) {
        if self.phase >= Phase::Disconnecting {
            return;
        }
        self.shared.set_state(ChannelState::Closing);
        self.shared.lane.lock(p).serving = false;
        // An error means the terminal event is already on its way.
        let _ = self.target.port.disconnect(self.shared.cm_id, &[], p);
        self.phase = Phase::Disconnecting;
    }

    fn destroy_qp(&mut self, p: &Passive<'_>) {
        self.shared.set_state(ChannelState::Closing);
        self.shared.lane.lock(p).serving = false;
        self.phase = Phase::DestroyingQp;
        if self.objects.qp.destroy(p).is_err() {
            // Destroy already under way: its callback still comes.
        }
    }

    /// Everything is destroyed: give the memory back.
    fn release(mut self, p: &Passive<'_>) {
        for slot in 0..self.cmds.len() {
            let r = CmdRef {
                slot: u32::try_from(slot).unwrap_or(u32::MAX),
                generation: self.generations.get(slot).copied().unwrap_or(0),
            };
            let _ = self.remove(r);
        }
        self.staging.release(p);
        let lane = self.shared.lane.lock(p).take_io();
        if let Some(lane) = lane {
            lane.release(p);
        }
        let _ = self.objects.recv_mr.dereg(p);
        let _ = self.objects.send_mr.dereg(p);
        let _ = self.objects.scratch_mr.dereg(p);
        debug_assert_eq!(self.staging.in_use(), 0);
        Counters::add(&self.target.counters.channels_closed, 1);
        self.shared.set_state(ChannelState::Closed);
        self.shared
            .finished
            .store(true, std::sync::atomic::Ordering::Release);
        self.target.wake_control(p);
    }
}

/// The live command `r` names, if any.
fn slot_mut<'a>(
    cmds: &'a mut [Option<Command>],
    generations: &[u32],
    r: CmdRef,
) -> Option<&'a mut Command> {
    if generations.get(r.slot as usize) != Some(&r.generation) {
        return None;
    }
    cmds.get_mut(r.slot as usize)?.as_mut()
}

/// The transfer a parsed command asks for, `ib_srpt`'s way: DATA-IN if the
/// DATA-IN nibble names a buffer, else DATA-OUT. `None` for descriptors the
/// target cannot use (an address range that wraps).
fn transfer_of(repr: &CmdRepr<'_>) -> Option<Transfer> {
    let wraps = |d: &DirectDesc| d.va.checked_add(u64::from(d.len)).is_none();
    let list = |descs: Vec<DirectDesc>| (!descs.iter().any(wraps)).then_some(descs);
    match (repr.data_in, repr.data_out) {
        (DataIn::Direct(d), _) => list(vec![d]).map(Transfer::In),
        (DataIn::Indirect(ind), _) => list(ind.descs.iter().collect()).map(Transfer::In),
        (DataIn::None, DataOut::Direct(d)) => list(vec![d]).map(Transfer::Out),
        (DataIn::None, DataOut::Indirect(ind)) => {
            list(ind.descs.iter().collect()).map(Transfer::Out)
        }
        (DataIn::None, DataOut::Immediate { data, .. }) => Some(Transfer::Immediate(data.to_vec())),
        (DataIn::None, DataOut::ImmediateExternal { .. }) => None,
        (DataIn::None, DataOut::None) => Some(Transfer::None),
    }
}

/// CHECK CONDITION, ILLEGAL REQUEST, INVALID FIELD IN CDB: what `ib_srpt`
/// (up to 4.x, and SCST's) answers a command whose descriptors it cannot
/// parse.
fn invalid_field_in_cdb() -> Answer {
    let sense = SenseRepr::new(
        SenseKey::IllegalRequest,
        AdditionalSense::INVALID_FIELD_IN_CDB,
    );
    let mut buf = [0u8; 64];
    let len = sense.emit(&mut buf).unwrap_or(0);
    Answer {
        status: Status::CHECK_CONDITION,
        sense: Some(buf.get(..len).unwrap_or(&[]).to_vec()),
        data_in_residual: Residual::None,
        data_out_residual: Residual::None,
        solicited: false,
    }
}

/// BUSY: the target has no memory for the command now.
fn busy_answer() -> Answer {
    Answer {
        status: Status::BUSY,
        sense: None,
        data_in_residual: Residual::None,
        data_out_residual: Residual::None,
        solicited: false,
    }
}

/// Whether a CDB is a READ(6/10/12/16): the commands whose data-in comes
/// from the store (and can go out from its chunks).
pub(crate) fn is_read(cdb: &[u8]) -> bool {
    use storport_srp::scsi::Opcode as Op;
    matches!(
        cdb.first().copied().map(Op),
        Some(Op::READ_6 | Op::READ_10 | Op::READ_12 | Op::READ_16)
    )
}
