//! A software QP: the requester (send queue → packets, ACK/NAK handling,
//! retransmission, completions) and the responder (packets → memory and
//! receive completions, ACK/NAK generation, RDMA READ responses).

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use heapless::Vec as HVec;

use crate::cqe::{CqeOpcode, CqeRepr, Syndrome};
use crate::device::{
    AccessFlags, AsyncEvent, AsyncEventHandler, GSI_QKEY, Gid, QpAttr, QpState, QpType,
    ack_timeout_ns, rnr_timer_ns,
};
use crate::doorbell::{DoorbellRegister, QpDoorbellRecord};
use crate::recv::RecvWqe;
use crate::ring::{RecvRing, SendRing};
use crate::wire::{
    AethRepr, AethSyndrome, BthRepr, CreditCount, DethRepr, IbPacketRepr, IethRepr, ImmDtRepr, Msn,
    NakCode, Opcode, Operation, Psn, Qpn, RethRepr, RnrTimer, Transport,
};
use crate::wqe::{
    CtrlFlags, CtrlSeg, DataSegRepr, Gather, MAX_SEND_SGE, MAX_SEND_WQE_BYTES, PageList,
    SendOpcode, SendWqe, WQEBB_SIZE,
};

use super::link::{roce_udp_src_port, rxe_udp_src_port};
use super::mem::{DeviceMem, PhysMemory};
use super::payload::{Payload, Source, pinned, recycle_pinned};
use super::resources::{Cq, KeyError, Mr, WriteTarget, check_key, mr_pin, mr_read, mr_write};
use super::world::{Event, Outbox, Route, Shared, SharedPayload};

/// Request packets after which AckReq is set even mid-message (as rxe).
const ACK_EVERY: u32 = 64;
/// Read-response packets a responder emits per QP per engine pass.
const RESP_BURST: u32 = 64;
/// Bytes of the GRH slot at the start of a UD receive buffer.
pub const GRH_LEN: usize = 40;

/// What the SQ doorbell register shares with the device.
pub(crate) struct QpDoorbellShared {
    pub qpn: u32,
    pub rang: AtomicBool,
    pub last_value: AtomicU64,
}

/// The SQ doorbell register.
pub(crate) struct SqDoorbell {
    pub qp: Arc<QpDoorbellShared>,
    pub shared: std::sync::Weak<Shared>,
}

impl DoorbellRegister for SqDoorbell {
    fn write64(&self, value: u64) {
        // The value carries the QPN in bits 31..8 (`qpn_ds`).
        if ((value as u32) >> 8) != self.qp.qpn {
            if let Some(s) = self.shared.upgrade() {
                s.bad_doorbells.fetch_add(1, Ordering::Relaxed);
            }
            return;
        }
        self.qp.last_value.store(value, Ordering::Relaxed);
        self.qp.rang.store(true, Ordering::Release);
        if let Some(s) = self.shared.upgrade() {
            s.kick();
        }
    }
}

/// Everything of the HCA a QP touches while it runs.
pub(crate) struct Ctx<'a> {
    pub mem: &'a PhysMemory,
    pub mrs: &'a mut BTreeMap<u32, Mr>,
    pub cqs: &'a mut BTreeMap<u32, Cq>,
    pub async_handler: &'a Option<Arc<dyn AsyncEventHandler>>,
    pub out: &'a mut Outbox,
    pub now: u64,
    pub local_gid: Gid,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum OpStatus {
    InFlight,
    Done,
    Failed(Syndrome),
}

struct SendOp {
    counter: u16,
    opcode: SendOpcode,
    signaled: bool,
    solicited: bool,
    imm: u32,
    /// The data of a SEND or WRITE, shared with the frames that carry it
    /// by reference (see [`super::world::DirectFrame`]): on RC the source
    /// memory, pinned when the WQE is fetched (its keys checked then) and
    /// read when a frame is placed (see [`super::payload`]); inline data
    /// and UD sends gathered then, into `payload_len` bytes at the start
    /// of a buffer that may be longer (a recycled one; see
    /// [`payload_buffer`]).
    payload: Option<Source>,
    payload_len: usize,
    read_sges: HVec<DataSegRepr, MAX_SEND_SGE>,
    raddr: u64,
    rkey: u32,
    len: u32,
    first_psn: Psn,
    npkts: u32,
    /// READ: response packets received so far.
    rx_pkts: u32,
    status: OpStatus,
}

impl Drop for SendOp {
    fn drop(&mut self) {
        self.revoke();
        match self.payload.take() {
            Some(Source::Bytes(b)) => recycle_payload(b),
            Some(Source::Pinned(p)) => recycle_pinned(p),
            None => {}
        }
    }
}

/// Most spare payload buffers a thread keeps, and the largest it keeps
/// (together at most 8 MiB per thread).
const PAYLOAD_POOL_MAX: usize = 32;
const PAYLOAD_POOL_MAX_BYTES: usize = 256 * 1024;
/// Payloads up to this size (SRP responses, inline data) are allocated
/// fresh and not pooled: they are cheap, and a pool full of them had no
/// room left for the large buffers it is for.
const PAYLOAD_POOL_MIN_BYTES: usize = 1024;

thread_local! {
    /// Gather buffers of finished send operations, reused by the next ones
    /// this thread gathers: a fresh zero-filled 128 KiB buffer per RDMA
    /// WRITE cost a memset and a page-faulting allocation for bytes the
    /// gather overwrites at once.
    static PAYLOAD_POOL: std::cell::RefCell<Vec<Arc<Vec<u8>>>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// A buffer of at least `len` bytes for a gather that writes the first
/// `len` of them; the rest, and what the gather does not reach, are stale
/// bytes of earlier payloads. Buffers are never shortened, so a 128 KiB
/// one that carried a 36-byte SRP response is still 128 KiB long for the
/// next WRITE, and a gather takes a spare buffer that is long enough when
/// there is one: only growing past a buffer's length zero-fills.
///
/// The buffer is not shared (the pool keeps only buffers no one else
/// holds), so filling it through [`Arc::make_mut`] does not copy it.
fn payload_buffer(len: usize) -> Arc<Vec<u8>> {
    if len <= PAYLOAD_POOL_MIN_BYTES {
        return Arc::new(vec![0; len]);
    }
    // The newest spare buffer long enough, else the newest one (grown).
    let mut buf = PAYLOAD_POOL
        .with(|p| {
            let mut p = p.borrow_mut();
            match p.iter().rposition(|b| b.len() >= len) {
                Some(i) => Some(p.swap_remove(i)),
                None => p.pop(),
            }
        })
        .unwrap_or_default();
    if buf.len() < len {
        Arc::make_mut(&mut buf).resize(len, 0);
    }
    buf
}

/// Returns a gather buffer to this thread's pool, if `buf` was its last
/// holder (the send operation and the frames carrying it by reference each
/// call this when they are done with it).
pub(crate) fn recycle_payload(mut buf: Arc<Vec<u8>>) {
    let Some(v) = Arc::get_mut(&mut buf) else {
        return;
    };
    if v.len() <= PAYLOAD_POOL_MIN_BYTES || v.capacity() > PAYLOAD_POOL_MAX_BYTES {
        return;
    }
    PAYLOAD_POOL.with(|p| {
        let mut p = p.borrow_mut();
        if p.len() < PAYLOAD_POOL_MAX {
            p.push(buf);
        }
    });
}

impl SendOp {
    /// Bytes `range` of the data, by reference.
    fn shared_payload(&self, range: core::ops::Range<usize>) -> SharedPayload {
        let src = match &self.payload {
            Some(Source::Bytes(b)) => Source::Bytes(b.clone()),
            Some(Source::Pinned(p)) => Source::Pinned(p.clone()),
            None => Source::Bytes(Arc::default()),
        };
        SharedPayload {
            src,
            range: range.start.min(self.payload_len)..range.end.min(self.payload_len),
        }
    }

    /// The operation is over (completed, or gone): frames still on the wire
    /// may no longer read its source memory (see [`super::payload`]).
    fn revoke(&self) {
        if let Some(Source::Pinned(p)) = &self.payload {
            p.revoke();
        }
    }

    fn is_remote_rc(&self) -> bool {
        self.npkts > 0
    }
    fn last_psn(&self) -> Psn {
        self.first_psn.wrapping_add(self.npkts.saturating_sub(1))
    }
    fn contains(&self, psn: Psn) -> bool {
        self.npkts > 0 && psn.distance_from(self.first_psn) < self.npkts
    }
}

struct InRecv {
    counter: u32,
    wqe: RecvWqe,
    offset: u64,
}

struct InWrite {
    rkey: u32,
    va: u64,
    remaining: u64,
    total: u32,
    /// The message's memory, resolved at its first packet (multi-packet
    /// messages; see [`WriteTarget`]).
    target: Option<WriteTarget>,
}

enum RespItem {
    Ack {
        psn: Psn,
        syndrome: AethSyndrome,
    },
    Read {
        first_psn: Psn,
        rkey: u32,
        va: u64,
        len: u32,
        next_pkt: u32,
        npkts: u32,
        /// Re-executes a duplicate request: answers a read the requester
        /// already counts, so it holds no responder resource.
        replay: bool,
    },
}

/// Counters kept per QP (read by tests through `SoftHca::qp_stats`).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct QpStats {
    /// Request packets transmitted (first transmissions and retries).
    pub packets_sent: u64,
    /// Packets retransmitted.
    pub retransmits: u64,
    /// ACK timeouts.
    pub timeouts: u64,
    /// RNR NAKs received.
    pub rnr_naks_received: u64,
    /// PSN-sequence NAKs received.
    pub seq_naks_received: u64,
    /// RNR NAKs sent as responder.
    pub rnr_naks_sent: u64,
    /// PSN-sequence NAKs sent as responder.
    pub seq_naks_sent: u64,
    /// Duplicate requests seen as responder.
    pub duplicates: u64,
    /// Most RDMA READs this QP had outstanding as requester.
    pub max_reads_outstanding: u32,
    /// Datagrams dropped (bad Q_Key, no receive posted).
    pub ud_dropped: u64,
}

pub(crate) struct Qp {
    pub qpn: u32,
    pub qp_type: QpType,
    pub pd: u32,
    pub send_cq: u32,
    pub recv_cq: u32,
    pub sq_sig_all: bool,
    pub state: QpState,
    pub attr: QpAttr,
    pub sq: SendRing<DeviceMem>,
    pub rq: RecvRing<DeviceMem>,
    pub dbr: QpDoorbellRecord<DeviceMem>,
    pub doorbell: Arc<QpDoorbellShared>,
    pub stats: QpStats,
    // Requester.
    sq_fetch: u32,
    sq_limit: u16,
    ops: VecDeque<SendOp>,
    next_psn: Psn,
    send_psn: Psn,
    fetch_blocked: bool,
    reads_outstanding: u32,
    retry_left: u8,
    rnr_left: u8,
    timer: Option<u64>,
    rnr_until: Option<u64>,
    read_retry_at: Option<Psn>,
    /// PSN a sequence NAK already made us retry from (since the last progress).
    nak_retry_at: Option<Psn>,
    /// Highest PSN the responder is known to have received.
    acked_through: Psn,
    sqd_notified: bool,
    // Responder.
    epsn: Psn,
    msn: u32,
    nak_sent: bool,
    rq_next: u32,
    recv: Option<InRecv>,
    write: Option<InWrite>,
    resp_out: VecDeque<RespItem>,
    comm_est: bool,
    last_wqe_sent: bool,
    /// A responder error is pending: drain `resp_out`, then enter ERR.
    resp_error: bool,
}

#[expect(
    clippy::panic,
    reason = "only evaluated in const items, where it is a compile-time error"
)]
const fn must(o: Option<Opcode>) -> Opcode {
    match o {
        Some(x) => x,
        None => panic!("opcode not defined by the IBA"),
    }
}

const ACK_OPCODE: Opcode = must(Opcode::new(Transport::Rc, Operation::Acknowledge));
const UD_SEND_ONLY: Opcode = must(Opcode::new(Transport::Ud, Operation::SendOnly));

/// The opcode for `operation` on `transport` (every pair used here exists).
fn op_(operation: Operation, transport: Transport) -> Opcode {
    let fallback = if transport == Transport::Ud {
        UD_SEND_ONLY
    } else {
        ACK_OPCODE
    };
    Opcode::new(transport, operation).unwrap_or(fallback)
}

fn key_syndrome(e: KeyError) -> Syndrome {
    match e {
        KeyError::Unmapped => Syndrome::LocalAccess,
        _ => Syndrome::LocalProt,
    }
}

impl Qp {
    #[expect(clippy::too_many_arguments, reason = "one call site, the control path")]
    pub fn new(
        qpn: u32,
        qp_type: QpType,
        pd: u32,
        send_cq: u32,
        recv_cq: u32,
        sq_sig_all: bool,
        sq: SendRing<DeviceMem>,
        rq: RecvRing<DeviceMem>,
        dbr: QpDoorbellRecord<DeviceMem>,
        doorbell: Arc<QpDoorbellShared>,
        port: u8,
    ) -> Self {
        Self {
            qpn,
            qp_type,
            pd,
            send_cq,
            recv_cq,
            sq_sig_all,
            state: QpState::Reset,
            attr: QpAttr {
                port,
                ..QpAttr::default()
            },
            sq,
            rq,
            dbr,
            doorbell,
            stats: QpStats::default(),
            sq_fetch: 0,
            sq_limit: 0,
            ops: VecDeque::new(),
            next_psn: Psn::default(),
            send_psn: Psn::default(),
            fetch_blocked: false,
            reads_outstanding: 0,
            retry_left: 0,
            rnr_left: 0,
            timer: None,
            rnr_until: None,
            read_retry_at: None,
            nak_retry_at: None,
            acked_through: Psn::default(),
            sqd_notified: false,
            epsn: Psn::default(),
            msn: 0,
            nak_sent: false,
            rq_next: 0,
            recv: None,
            write: None,
            resp_out: VecDeque::new(),
            comm_est: false,
            last_wqe_sent: false,
            resp_error: false,
        }
    }

    fn mtu(&self) -> u32 {
        self.attr.path_mtu.bytes()
    }

    /// The UDP source port of this QP's packets, by rxe's rules: a
    /// connected QP uses the flow label of its path (or the one computed
    /// from both QPNs), a datagram QP the hash of its QPN.
    fn udp_src_port(&self) -> u16 {
        if self.qp_type == QpType::Rc {
            roce_udp_src_port(self.attr.av.flow_label, self.qpn, self.attr.dest_qpn)
        } else {
            rxe_udp_src_port(self.qpn)
        }
    }

    /// The route of this connected QP's packets from `local_gid`: its
    /// path's GID, traffic class and hop limit (0 taken as 64).
    fn route(&self, local_gid: Gid) -> Route {
        let av = &self.attr.av;
        let ttl = if av.hop_limit == 0 { 64 } else { av.hop_limit };
        Route::new(
            local_gid,
            av.dgid,
            av.traffic_class,
            ttl,
            self.udp_src_port(),
        )
    }

    fn event(&self, ctx: &mut Ctx<'_>, ev: AsyncEvent) {
        if let Some(h) = ctx.async_handler {
            ctx.out.events.push(Event::Async(h.clone(), ev));
        }
    }

    /// Empties all queues and counters (modify to RESET). The device also
    /// zeroes the doorbell record, so the driver restarts at counter 0.
    pub fn reset(&mut self) {
        self.dbr.set_rq_head(0);
        self.dbr.set_sq_head(0);
        self.doorbell.rang.store(false, Ordering::Relaxed);
        self.sq_fetch = 0;
        self.sq_limit = 0;
        self.ops.clear();
        self.fetch_blocked = false;
        self.reads_outstanding = 0;
        self.timer = None;
        self.rnr_until = None;
        self.read_retry_at = None;
        self.sqd_notified = false;
        self.msn = 0;
        self.nak_sent = false;
        self.rq_next = 0;
        self.recv = None;
        self.write = None;
        self.resp_out.clear();
        self.comm_est = false;
        self.last_wqe_sent = false;
        self.resp_error = false;
    }

    /// Applies the side effects of a successful modify into `new`.
    pub fn enter_state(&mut self, new: QpState, ctx: &mut Ctx<'_>) {
        let old = self.state;
        self.state = new;
        match new {
            QpState::Reset => self.reset(),
            QpState::Rtr if old != QpState::Rtr => {
                self.epsn = Psn::from_low_bits(self.attr.rq_psn);
            }
            QpState::Rts if old == QpState::Rtr => {
                self.next_psn = Psn::from_low_bits(self.attr.sq_psn);
                self.send_psn = self.next_psn;
                self.acked_through = self.next_psn.wrapping_sub(1);
                self.nak_retry_at = None;
                self.retry_left = self.attr.retry_cnt;
                self.rnr_left = self.attr.rnr_retry;
            }
            QpState::Rts if old == QpState::Sqe => {
                self.fetch_blocked = false;
            }
            QpState::Sqd => self.sqd_notified = false,
            QpState::Err => self.enter_error(ctx, false),
            _ => {}
        }
    }

    fn push_cqe(&mut self, ctx: &mut Ctx<'_>, send: bool, repr: &CqeRepr) -> bool {
        let cqn = if send { self.send_cq } else { self.recv_cq };
        let ok = match ctx.cqs.get_mut(&cqn) {
            Some(cq) => cq.push(repr, ctx.async_handler, ctx.out).is_ok(),
            None => false,
        };
        if !ok && self.state != QpState::Err {
            self.event(ctx, AsyncEvent::QpFatal { qpn: self.qpn });
            self.enter_error(ctx, true);
        }
        ok
    }

    fn cqe(&self, opcode: CqeOpcode, wqe_opcode: u8, counter: u16) -> CqeRepr {
        CqeRepr {
            opcode,
            solicited: false,
            wqe_opcode,
            qpn: self.qpn,
            wqe_counter: counter,
            byte_cnt: 0,
            imm_inval_pkey: 0,
            src_qpn: 0,
            grh: false,
            syndrome: 0,
            vendor_syndrome: 0,
        }
    }

    /// Enters the error state: every outstanding send WQE and every posted
    /// receive WQE completes with a flush error.
    pub fn enter_error(&mut self, ctx: &mut Ctx<'_>, cq_broken: bool) {
        self.state = QpState::Err;
        self.timer = None;
        self.rnr_until = None;
        for op in &mut self.ops {
            if op.status == OpStatus::InFlight {
                op.status = OpStatus::Failed(Syndrome::WrFlush);
            }
        }
        self.reads_outstanding = 0;
        self.resp_out.clear();
        if let Some(r) = self.recv.take() {
            let mut c = self.cqe(CqeOpcode::RespErr, 0, r.counter as u16);
            c.syndrome = Syndrome::WrFlush as u8;
            if !cq_broken {
                let _ = self.push_cqe(ctx, false, &c);
            }
        }
        self.write = None;
        if !cq_broken {
            self.complete(ctx);
            self.flush_rq(ctx);
        }
    }

    fn flush_rq(&mut self, ctx: &mut Ctx<'_>) -> bool {
        if !self.dbr.mem().alive() {
            return false;
        }
        let head = self.dbr.rq_head();
        let mut progress = false;
        while (self.rq_next as u16) != head && self.state == QpState::Err {
            let mut c = self.cqe(CqeOpcode::RespErr, 0, self.rq_next as u16);
            c.syndrome = Syndrome::WrFlush as u8;
            self.rq_next = self.rq_next.wrapping_add(1);
            progress = true;
            if !self.push_cqe(ctx, false, &c) {
                break;
            }
        }
        if self.state == QpState::Err && !self.last_wqe_sent && self.recv.is_none() {
            self.last_wqe_sent = true;
            self.event(ctx, AsyncEvent::QpLastWqeReached { qpn: self.qpn });
        }
        progress
    }

    // ---------------------------------------------------------------- requester

    /// Fetches newly posted WQEs (after a doorbell), executes local ones,
    /// assigns PSNs, then transmits, completes and flushes. Returns progress.
    pub fn run_send_side(&mut self, ctx: &mut Ctx<'_>) -> bool {
        let mut progress = false;
        if !self.sq.mem().alive() || !self.dbr.mem().alive() {
            if !matches!(self.state, QpState::Err | QpState::Reset) {
                self.event(ctx, AsyncEvent::QpFatal { qpn: self.qpn });
                self.enter_error(ctx, true);
                return true;
            }
            return false;
        }
        if self.doorbell.rang.swap(false, Ordering::Acquire) {
            let head = self.dbr.sq_head();
            if (head.wrapping_sub(self.sq_fetch as u16) as u32) > self.sq.wqebb_count() {
                // A producer counter beyond the ring: the driver overran it.
                self.event(ctx, AsyncEvent::QpFatal { qpn: self.qpn });
                self.enter_error(ctx, false);
                return true;
            }
            self.sq_limit = head;
        }
        progress |= self.fetch(ctx);
        progress |= self.transmit(ctx);
        progress |= self.complete(ctx);
        if self.state == QpState::Err {
            progress |= self.flush_rq(ctx);
        }
        if self.state == QpState::Sqd && !self.sqd_notified && self.ops.is_empty() {
            self.sqd_notified = true;
            if self.attr.en_sqd_async_notify {
                self.event(ctx, AsyncEvent::SqDrained { qpn: self.qpn });
            }
        }
        progress
    }

    fn fetch(&mut self, ctx: &mut Ctx<'_>) -> bool {
        let mut progress = false;
        loop {
            if (self.sq_fetch as u16) == self.sq_limit {
                break;
            }
            let flushing = matches!(self.state, QpState::Err | QpState::Sqe);
            if !flushing && (self.state != QpState::Rts || self.fetch_blocked) {
                break;
            }
            let mut ctrl = [0u8; 16];
            if self.sq.read_wqe(self.sq_fetch, &mut ctrl).is_err() {
                break;
            }
            let c = CtrlSeg::new_unchecked(&ctrl[..]);
            let ds = usize::from(c.ds()).clamp(1, MAX_SEND_WQE_BYTES / 16);
            let bbs = (ds * 16).div_ceil(WQEBB_SIZE) as u32;
            let counter = self.sq_fetch as u16;
            // Zeroed per WQE, not per call: most calls (one per QP per
            // engine pass) find nothing to fetch.
            let mut buf = [0u8; MAX_SEND_WQE_BYTES.next_multiple_of(WQEBB_SIZE)];
            let wqe_bytes = buf.get_mut(..bbs as usize * WQEBB_SIZE).unwrap_or(&mut []);
            if self.sq.read_wqe(self.sq_fetch, wqe_bytes).is_err() {
                break;
            }
            let parsed = SendWqe::parse(wqe_bytes, self.qp_type.is_datagram());
            let mut op = SendOp {
                counter,
                opcode: SendOpcode::Nop,
                signaled: self.sq_sig_all,
                solicited: false,
                imm: 0,
                payload: None,
                payload_len: 0,
                read_sges: HVec::new(),
                raddr: 0,
                rkey: 0,
                len: 0,
                first_psn: self.next_psn,
                npkts: 0,
                rx_pkts: 0,
                status: OpStatus::Done,
            };
            if flushing {
                op.status = OpStatus::Failed(Syndrome::WrFlush);
                if let Ok(w) = &parsed {
                    op.opcode = w.ctrl.opcode;
                }
            } else {
                match parsed {
                    Err(_) => op.status = OpStatus::Failed(Syndrome::LocalQpOp),
                    Ok(w) => {
                        if w.ctrl.qpn != self.qpn || w.ctrl.wqe_index != counter {
                            op.status = OpStatus::Failed(Syndrome::LocalQpOp);
                        } else {
                            let fenced = w
                                .ctrl
                                .flags
                                .intersects(CtrlFlags::FENCE | CtrlFlags::SMALL_FENCE);
                            if fenced && self.reads_outstanding > 0 {
                                break;
                            }
                            if w.ctrl.opcode == SendOpcode::RdmaRead {
                                if self.attr.max_rd_atomic == 0 {
                                    op.status = OpStatus::Failed(Syndrome::LocalQpOp);
                                } else if self.reads_outstanding
                                    >= u32::from(self.attr.max_rd_atomic)
                                {
                                    break;
                                }
                            }
                            if op.status == OpStatus::Done {
                                self.prepare(ctx, &w, &mut op);
                            }
                        }
                    }
                }
            }
            if let OpStatus::Failed(s) = op.status {
                if s != Syndrome::WrFlush {
                    self.fetch_blocked = true;
                }
            }
            self.sq_fetch = self.sq_fetch.wrapping_add(bbs);
            progress = true;
            let is_read = op.opcode == SendOpcode::RdmaRead && op.status == OpStatus::InFlight;
            if is_read {
                self.reads_outstanding += 1;
                self.stats.max_reads_outstanding =
                    self.stats.max_reads_outstanding.max(self.reads_outstanding);
            }
            self.ops.push_back(op);
        }
        progress
    }

    /// Validates and executes (local ops) or prepares (remote ops) one WQE.
    fn prepare(&mut self, ctx: &mut Ctx<'_>, w: &SendWqe<'_>, op: &mut SendOp) {
        let ctrl = w.ctrl;
        op.opcode = ctrl.opcode;
        op.signaled = self.sq_sig_all || ctrl.flags.contains(CtrlFlags::CQ_UPDATE);
        op.solicited = ctrl.flags.contains(CtrlFlags::SOLICITED);
        op.imm = ctrl.imm;
        let fail = |op: &mut SendOp, s: Syndrome| op.status = OpStatus::Failed(s);
        match ctrl.opcode {
            SendOpcode::Nop => {}
            SendOpcode::LocalInval => {
                if let Err(s) = invalidate(ctx.mrs, ctrl.imm, self.pd) {
                    fail(op, s);
                }
            }
            SendOpcode::RegMr => {
                if let Err(s) = fast_register(ctx, self.pd, w) {
                    fail(op, s);
                }
            }
            SendOpcode::RdmaRead => {
                let Some(r) = w.raddr else {
                    return fail(op, Syndrome::LocalQpOp);
                };
                let Gather::Sges(sges) = &w.gather else {
                    return fail(op, Syndrome::LocalQpOp);
                };
                let mut total = 0u64;
                for s in sges {
                    if s.byte_count == 0 {
                        continue;
                    }
                    if let Err(e) = check_key(
                        ctx.mrs,
                        s.lkey,
                        self.pd,
                        AccessFlags::LOCAL_WRITE,
                        s.addr,
                        u64::from(s.byte_count),
                        false,
                    ) {
                        return fail(op, key_syndrome(e));
                    }
                    total += u64::from(s.byte_count);
                    let _ = op.read_sges.push(*s);
                }
                let Ok(len) = u32::try_from(total) else {
                    return fail(op, Syndrome::LocalLength);
                };
                if len > 1 << 31 {
                    return fail(op, Syndrome::LocalLength);
                }
                op.raddr = r.raddr;
                op.rkey = r.rkey;
                op.len = len;
                self.assign_psns(op);
            }
            SendOpcode::Send
            | SendOpcode::SendImm
            | SendOpcode::SendInval
            | SendOpcode::RdmaWrite
            | SendOpcode::RdmaWriteImm => {
                // UD sends complete as they are sent, before the receiver
                // places them: their data cannot be read later.
                let res = if self.qp_type.is_datagram() {
                    gather(ctx, self.pd, &w.gather)
                } else {
                    pin(ctx, self.pd, &w.gather)
                };
                match res {
                    Ok((p, n)) => {
                        op.payload = Some(p);
                        op.payload_len = n;
                    }
                    Err(s) => return fail(op, s),
                }
                let Ok(len) = u32::try_from(op.payload_len) else {
                    return fail(op, Syndrome::LocalLength);
                };
                if len > 1 << 31 {
                    return fail(op, Syndrome::LocalLength);
                }
                op.len = len;
                if let Some(r) = w.raddr {
                    op.raddr = r.raddr;
                    op.rkey = r.rkey;
                }
                if self.qp_type.is_datagram() {
                    self.send_datagram(ctx, w, op);
                } else {
                    self.assign_psns(op);
                }
            }
        }
    }

    fn assign_psns(&mut self, op: &mut SendOp) {
        op.npkts = op.len.div_ceil(self.mtu()).max(1);
        op.first_psn = self.next_psn;
        self.next_psn = self.next_psn.wrapping_add(op.npkts);
        op.status = OpStatus::InFlight;
    }

    fn send_datagram(&mut self, ctx: &mut Ctx<'_>, w: &SendWqe<'_>, op: &mut SendOp) {
        let Some(av) = w.datagram else {
            op.status = OpStatus::Failed(Syndrome::LocalQpOp);
            return;
        };
        // UD messages are one packet: at most the port MTU (4096 here).
        if op.len > crate::device::Mtu::Mtu4096.bytes() {
            op.status = OpStatus::Failed(Syndrome::LocalLength);
            return;
        }
        let qkey = if self.qp_type == QpType::Gsi {
            GSI_QKEY
        } else if av.qkey & 0x8000_0000 != 0 {
            self.attr.qkey
        } else {
            av.qkey
        };
        let operation = if op.opcode == SendOpcode::SendImm {
            Operation::SendOnlyWithImmediate
        } else {
            Operation::SendOnly
        };
        let mut pkt = IbPacketRepr::new(
            BthRepr {
                opcode: op_(operation, Transport::Ud),
                solicited: op.solicited,
                mig_req: false,
                pkey: 0xffff,
                fecn: false,
                becn: false,
                dest_qp: Qpn::from_low_bits(av.dqpn),
                ack_req: false,
                psn: self.next_psn,
            },
            &[],
        );
        pkt.deth = Some(DethRepr {
            qkey,
            src_qp: Qpn::from_low_bits(self.qpn),
        });
        if op.opcode == SendOpcode::SendImm {
            pkt.immdt = Some(ImmDtRepr { data: op.imm });
        }
        self.next_psn = self.next_psn.next();
        self.stats.packets_sent += 1;
        let route = Route::new(
            ctx.local_gid,
            Gid(av.rgid),
            av.tclass,
            av.hop_limit,
            self.udp_src_port(),
        );
        ctx.out
            .send_shared(route, &pkt, op.shared_payload(0..op.payload_len));
        op.status = OpStatus::Done;
    }

    fn transmit(&mut self, ctx: &mut Ctx<'_>) -> bool {
        if self.qp_type != QpType::Rc || !matches!(self.state, QpState::Rts | QpState::Sqd) {
            return false;
        }
        if let Some(t) = self.rnr_until {
            if ctx.now < t {
                return false;
            }
            self.rnr_until = None;
        }
        let mut progress = false;
        while self.send_psn != self.next_psn {
            let sp = self.send_psn;
            let Some(i) = self
                .ops
                .iter()
                .position(|o| o.status == OpStatus::InFlight && o.contains(sp))
            else {
                // Nothing in flight covers it (completed or flushed): skip to
                // the next op that starts later.
                match self.ops.iter().find(|o| {
                    o.status == OpStatus::InFlight && o.is_remote_rc() && o.first_psn.is_after(sp)
                }) {
                    Some(o) => self.send_psn = o.first_psn,
                    None => self.send_psn = self.next_psn,
                }
                continue;
            };
            let end = self.emit_op(ctx, i, sp);
            self.send_psn = end;
            progress = true;
        }
        if progress && self.timer.is_none() {
            self.arm_timer(ctx.now);
        }
        progress
    }

    fn arm_timer(&mut self, now: u64) {
        self.timer = ack_timeout_ns(self.attr.timeout).map(|t| now.saturating_add(t));
    }

    /// Emits the packets of op `i` from `from` to its end; returns the PSN after it.
    fn emit_op(&mut self, ctx: &mut Ctx<'_>, i: usize, from: Psn) -> Psn {
        let mtu = self.mtu();
        let route = self.route(ctx.local_gid);
        let dest_qp = Qpn::from_low_bits(self.attr.dest_qpn);
        let Some(op) = self.ops.get(i) else {
            return from;
        };
        let k0 = from.distance_from(op.first_psn);
        let end = op.first_psn.wrapping_add(op.npkts);
        let mut bth = BthRepr {
            opcode: ACK_OPCODE,
            solicited: false,
            mig_req: false,
            pkey: 0xffff,
            fecn: false,
            becn: false,
            dest_qp,
            ack_req: true,
            psn: from,
        };
        let mut sent = 0u64;
        if op.opcode == SendOpcode::RdmaRead {
            let off = u64::from(k0) * u64::from(mtu);
            bth.opcode = op_(Operation::RdmaReadRequest, Transport::Rc);
            let mut pkt = IbPacketRepr::new(bth, &[]);
            pkt.reth = Some(RethRepr {
                va: op.raddr.wrapping_add(off),
                rkey: op.rkey,
                dma_len: op
                    .len
                    .saturating_sub(u32::try_from(off).unwrap_or(u32::MAX)),
            });
            ctx.out.send(route, &pkt);
            sent += 1;
        } else {
            for k in k0..op.npkts {
                let lo = (k as usize) * mtu as usize;
                let hi = (lo + mtu as usize).min(op.payload_len);
                let only = op.npkts == 1;
                let first = k == 0;
                let last = k + 1 == op.npkts;
                use Operation as O;
                let operation = match (op.opcode, only, first, last) {
                    (SendOpcode::Send, true, _, _) => O::SendOnly,
                    (SendOpcode::SendImm, true, _, _) => O::SendOnlyWithImmediate,
                    (SendOpcode::SendInval, true, _, _) => O::SendOnlyWithInvalidate,
                    (SendOpcode::RdmaWrite, true, _, _) => O::RdmaWriteOnly,
                    (SendOpcode::RdmaWriteImm, true, _, _) => O::RdmaWriteOnlyWithImmediate,
                    (o, false, true, _) if o.is_send() => O::SendFirst,
                    (_, false, true, _) => O::RdmaWriteFirst,
                    (SendOpcode::Send, false, false, true) => O::SendLast,
                    (SendOpcode::SendImm, false, false, true) => O::SendLastWithImmediate,
                    (SendOpcode::SendInval, false, false, true) => O::SendLastWithInvalidate,
                    (SendOpcode::RdmaWriteImm, false, false, true) => O::RdmaWriteLastWithImmediate,
                    (_, false, false, true) => O::RdmaWriteLast,
                    (o, _, _, _) if o.is_send() => O::SendMiddle,
                    _ => O::RdmaWriteMiddle,
                };
                bth.opcode = op_(operation, Transport::Rc);
                bth.psn = op.first_psn.wrapping_add(k);
                bth.ack_req = last || (k + 1) % ACK_EVERY == 0;
                bth.solicited = last && op.solicited;
                // The payload goes by reference (`send_shared`).
                let mut pkt = IbPacketRepr::new(bth, &[]);
                let h = bth.opcode.headers();
                if h.contains(crate::wire::HeaderSet::RETH) {
                    pkt.reth = Some(RethRepr {
                        va: op.raddr,
                        rkey: op.rkey,
                        dma_len: op.len,
                    });
                }
                if h.contains(crate::wire::HeaderSet::IMMDT) {
                    pkt.immdt = Some(ImmDtRepr { data: op.imm });
                }
                if h.contains(crate::wire::HeaderSet::IETH) {
                    pkt.ieth = Some(IethRepr { rkey: op.imm });
                }
                ctx.out.send_shared(route, &pkt, op.shared_payload(lo..hi));
                sent += 1;
            }
        }
        self.stats.packets_sent += sent;
        end
    }

    /// Retransmits from `psn` (go-back-N).
    fn retransmit_from(&mut self, psn: Psn) {
        let outstanding = self.next_psn.distance_from(psn);
        let sent = self.send_psn.distance_from(psn);
        if sent > outstanding {
            return;
        }
        self.stats.retransmits += u64::from(sent.min(1));
        self.send_psn = psn;
    }

    fn oldest_unacked(&self) -> Option<Psn> {
        self.ops
            .iter()
            .find(|o| o.status == OpStatus::InFlight && o.is_remote_rc())
            .map(|o| o.first_psn.wrapping_add(o.rx_pkts))
    }

    /// Marks every SEND/WRITE ending at or before `psn` done; returns the
    /// first PSN of a READ that an ACK beyond it shows was lost, if any.
    fn ack_through(&mut self, psn: Psn) -> (bool, Option<Psn>) {
        let mut progress = false;
        for o in &mut self.ops {
            if o.status != OpStatus::InFlight || !o.is_remote_rc() {
                continue;
            }
            if o.opcode == SendOpcode::RdmaRead {
                if !o.first_psn.is_after(psn) {
                    return (progress, Some(o.first_psn.wrapping_add(o.rx_pkts)));
                }
                break;
            }
            if o.last_psn().is_after(psn) {
                break;
            }
            o.status = OpStatus::Done;
            progress = true;
        }
        (progress, None)
    }

    /// The responder has everything through `psn`: if that is news, the
    /// connection made progress (retry counters start over).
    fn note_acked(&mut self, psn: Psn, now: u64) {
        let outstanding = self.next_psn.distance_from(self.acked_through);
        if psn.is_after(self.acked_through) && psn.distance_from(self.acked_through) < outstanding {
            self.acked_through = psn;
            self.made_progress(now);
        }
    }

    fn made_progress(&mut self, now: u64) {
        self.nak_retry_at = None;
        self.retry_left = self.attr.retry_cnt;
        self.rnr_left = self.attr.rnr_retry;
        self.read_retry_at = None;
        if self
            .ops
            .iter()
            .any(|o| o.status == OpStatus::InFlight && o.is_remote_rc())
        {
            self.arm_timer(now);
        } else {
            self.timer = None;
        }
    }

    /// A retry counter ran out: the oldest unacknowledged request fails
    /// (the counter is about it), and the error state flushes the rest.
    fn fail_head(&mut self, s: Syndrome) {
        if let Some(o) = self
            .ops
            .iter_mut()
            .find(|o| o.status == OpStatus::InFlight && o.is_remote_rc())
        {
            o.status = OpStatus::Failed(s);
        }
    }

    fn fail_at(&mut self, psn: Psn, s: Syndrome) {
        if let Some(o) = self
            .ops
            .iter_mut()
            .find(|o| o.status == OpStatus::InFlight && o.contains(psn))
        {
            o.status = OpStatus::Failed(s);
        } else if let Some(o) = self
            .ops
            .iter_mut()
            .find(|o| o.status == OpStatus::InFlight && o.is_remote_rc())
        {
            o.status = OpStatus::Failed(s);
        }
    }

    /// A response (ACK, NAK, READ response) arrived.
    fn on_response(&mut self, ctx: &mut Ctx<'_>, pkt: &IbPacketRepr<'_>, payload: Payload<'_>) {
        if !matches!(self.state, QpState::Rts | QpState::Sqd) {
            return;
        }
        let psn = pkt.bth.psn;
        let operation = pkt.bth.opcode.operation();
        if operation == Operation::Acknowledge {
            let Some(aeth) = pkt.aeth else { return };
            // A NAK (of any kind) for a PSN the responder has since been
            // shown to have received is stale: a delayed or duplicated frame.
            let stale = !psn.is_after(self.acked_through);
            if stale && !matches!(aeth.syndrome, AethSyndrome::Ack(_)) {
                return;
            }
            match aeth.syndrome {
                AethSyndrome::Ack(_) => {
                    self.note_acked(psn, ctx.now);
                    let (p, lost_read) = self.ack_through(psn);
                    if p {
                        self.made_progress(ctx.now);
                    }
                    if let Some(r) = lost_read {
                        if self.read_retry_at != Some(r) {
                            self.read_retry_at = Some(r);
                            self.retransmit_from(r);
                        }
                    }
                }
                AethSyndrome::RnrNak(t) => {
                    self.stats.rnr_naks_received += 1;
                    self.note_acked(psn.wrapping_sub(1), ctx.now);
                    let (p, _) = self.ack_through(psn.wrapping_sub(1));
                    if p {
                        self.made_progress(ctx.now);
                    }
                    if self.attr.rnr_retry != 7 {
                        if self.rnr_left == 0 {
                            self.fail_head(Syndrome::RnrRetryExceeded);
                            return;
                        }
                        self.rnr_left -= 1;
                    }
                    self.rnr_until = Some(ctx.now.saturating_add(rnr_timer_ns(t.get())));
                    self.retransmit_from(psn);
                    self.arm_timer(ctx.now.saturating_add(rnr_timer_ns(t.get())));
                }
                AethSyndrome::Nak(code) => {
                    self.note_acked(psn.wrapping_sub(1), ctx.now);
                    let (p, _) = self.ack_through(psn.wrapping_sub(1));
                    if p {
                        self.made_progress(ctx.now);
                    }
                    if code == NakCode::PSN_SEQUENCE_ERROR {
                        self.stats.seq_naks_received += 1;
                        // A duplicated or stale NAK for a gap we are already
                        // retrying costs no second retry.
                        if self.nak_retry_at == Some(psn) {
                            return;
                        }
                        self.nak_retry_at = Some(psn);
                        if self.retry_left == 0 {
                            self.fail_head(Syndrome::TransportRetryExceeded);
                            return;
                        }
                        self.retry_left -= 1;
                        self.retransmit_from(psn);
                        self.arm_timer(ctx.now);
                    } else {
                        let s = match code {
                            NakCode::INVALID_REQUEST => Syndrome::RemoteInvalRequest,
                            NakCode::REMOTE_ACCESS_ERROR => Syndrome::RemoteAccess,
                            _ => Syndrome::RemoteOp,
                        };
                        self.fail_at(psn, s);
                    }
                }
            }
            return;
        }
        if !pkt.bth.opcode.is_read_response() {
            return;
        }
        // The oldest outstanding READ.
        let mtu = self.mtu();
        let Some(idx) = self
            .ops
            .iter()
            .position(|o| o.status == OpStatus::InFlight && o.opcode == SendOpcode::RdmaRead)
        else {
            return;
        };
        let Some(o) = self.ops.get(idx) else { return };
        let got = o.rx_pkts;
        let expect = o.first_psn.wrapping_add(got);
        if psn != expect {
            // A response from later in this READ: an earlier one was lost.
            // (Anything else — a duplicate, or a response to a retried
            // earlier READ — is ignored.)
            if psn.is_after(expect) && o.contains(psn) && self.read_retry_at != Some(expect) {
                self.read_retry_at = Some(expect);
                self.retransmit_from(expect);
            }
            return;
        }
        // A genuine response to this READ: the responder has executed
        // everything before it, so every earlier SEND/WRITE is acknowledged.
        self.note_acked(psn, ctx.now);
        for o in self.ops.iter_mut().take(idx) {
            if o.status == OpStatus::InFlight && o.is_remote_rc() {
                o.status = OpStatus::Done;
            }
        }
        let Some(o) = self.ops.get(idx) else { return };
        let k = got;
        let last_pkt = k + 1 == o.npkts;
        let n = payload.len() as u32;
        let ok_len = if o.npkts == 1 {
            n == o.len
        } else if last_pkt {
            n == o.len - k * mtu
        } else {
            n == mtu
        };
        // A retried READ (re-requested from packet k) is answered by a new
        // response stream that starts with FIRST (or ONLY) at packet k.
        let pos_ok = match operation {
            Operation::RdmaReadResponseOnly => last_pkt,
            Operation::RdmaReadResponseFirst => !last_pkt,
            Operation::RdmaReadResponseMiddle => k > 0 && !last_pkt,
            Operation::RdmaReadResponseLast => k > 0 && last_pkt,
            _ => false,
        };
        if !ok_len || !pos_ok {
            self.fail_at(o.first_psn, Syndrome::BadResp);
            return;
        }
        let sges = o.read_sges.clone();
        let offset = u64::from(k) * u64::from(mtu);
        let res = scatter(ctx, self.pd, &sges, offset, payload);
        let Some(o) = self.ops.get_mut(idx) else {
            return;
        };
        match res {
            Ok(()) => {
                o.rx_pkts += 1;
                if last_pkt {
                    o.status = OpStatus::Done;
                    self.reads_outstanding = self.reads_outstanding.saturating_sub(1);
                }
                self.made_progress(ctx.now);
            }
            Err(s) => {
                o.status = OpStatus::Failed(s);
                self.reads_outstanding = self.reads_outstanding.saturating_sub(1);
            }
        }
    }

    /// Emits completions in WQE order; enters error on the first failure.
    fn complete(&mut self, ctx: &mut Ctx<'_>) -> bool {
        let mut progress = false;
        while let Some(front) = self.ops.front() {
            let status = front.status;
            if status == OpStatus::InFlight {
                break;
            }
            let Some(o) = self.ops.pop_front() else { break };
            // Before the completion can be seen: no frame of the operation
            // still on the wire reads its memory after it.
            o.revoke();
            progress = true;
            match status {
                OpStatus::Done => {
                    if o.signaled {
                        let mut c = self.cqe(CqeOpcode::Req, o.opcode as u8, o.counter);
                        c.byte_cnt = o.len;
                        if !self.push_cqe(ctx, true, &c) {
                            return true;
                        }
                    }
                }
                OpStatus::Failed(s) => {
                    let mut c = self.cqe(CqeOpcode::ReqErr, o.opcode as u8, o.counter);
                    c.syndrome = s as u8;
                    if !self.push_cqe(ctx, true, &c) {
                        return true;
                    }
                    if s != Syndrome::WrFlush {
                        if self.qp_type == QpType::Rc {
                            self.enter_error(ctx, false);
                        } else if self.state != QpState::Err {
                            self.state = QpState::Sqe;
                            for op in &mut self.ops {
                                op.status = OpStatus::Failed(Syndrome::WrFlush);
                            }
                        }
                    }
                }
                OpStatus::InFlight => {}
            }
        }
        if self
            .ops
            .iter()
            .all(|o| o.status != OpStatus::InFlight || !o.is_remote_rc())
        {
            self.timer = None;
        }
        progress
    }

    /// Next time this QP needs the engine (ACK timeout or RNR wait).
    pub fn next_deadline(&self) -> Option<u64> {
        match (self.timer, self.rnr_until) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Handles an expired ACK timer.
    pub fn on_timer(&mut self, ctx: &mut Ctx<'_>) -> bool {
        let Some(t) = self.timer else { return false };
        if ctx.now < t || self.rnr_until.is_some_and(|r| ctx.now < r) {
            return false;
        }
        self.stats.timeouts += 1;
        let Some(psn) = self.oldest_unacked() else {
            self.timer = None;
            return false;
        };
        if self.retry_left == 0 {
            self.fail_head(Syndrome::TransportRetryExceeded);
            self.timer = None;
            return true;
        }
        self.retry_left -= 1;
        self.retransmit_from(psn);
        self.read_retry_at = None;
        self.arm_timer(ctx.now);
        true
    }

    // ---------------------------------------------------------------- responder

    /// A packet for this QP arrived (addressing already checked).
    pub fn receive(
        &mut self,
        ctx: &mut Ctx<'_>,
        src_gid: Gid,
        dst_gid: Gid,
        pkt: &IbPacketRepr<'_>,
        payload: Payload<'_>,
    ) {
        let transport = pkt.bth.opcode.transport();
        if self.qp_type.is_datagram() {
            if transport == Transport::Ud {
                self.receive_datagram(ctx, src_gid, dst_gid, pkt, payload);
            }
            return;
        }
        if transport != Transport::Rc {
            return;
        }
        // RC address check: the packet must come from the QP's peer.
        if src_gid != self.attr.av.dgid || pkt.bth.pkey != 0xffff {
            return;
        }
        if pkt.bth.opcode.is_request() {
            if self.resp_error || !matches!(self.state, QpState::Rtr | QpState::Rts | QpState::Sqd)
            {
                return;
            }
            if self.state == QpState::Rtr && !self.comm_est {
                self.comm_est = true;
                self.event(ctx, AsyncEvent::CommEstablished { qpn: self.qpn });
            }
            self.on_request(ctx, pkt, payload);
        } else {
            self.on_response(ctx, pkt, payload);
        }
    }

    fn queue_ack(&mut self, psn: Psn, syndrome: AethSyndrome) {
        self.resp_out.push_back(RespItem::Ack { psn, syndrome });
    }

    /// A class C error at the responder: the NAK goes out after the
    /// responses already queued (they answer earlier, valid requests), no
    /// further request is accepted, and the QP enters the error state once
    /// the queue has drained.
    fn nak_and_error(&mut self, ctx: &mut Ctx<'_>, psn: Psn, code: NakCode, ev: AsyncEvent) {
        self.queue_ack(psn, AethSyndrome::Nak(code));
        self.resp_error = true;
        self.event(ctx, ev);
        self.emit_responses(ctx);
    }

    fn on_request(&mut self, ctx: &mut Ctx<'_>, pkt: &IbPacketRepr<'_>, payload: Payload<'_>) {
        let psn = pkt.bth.psn;
        let d = psn.diff(self.epsn);
        let operation = pkt.bth.opcode.operation();
        if d > 0 {
            if !self.nak_sent {
                self.nak_sent = true;
                self.stats.seq_naks_sent += 1;
                let e = self.epsn;
                self.queue_ack(e, AethSyndrome::Nak(NakCode::PSN_SEQUENCE_ERROR));
            }
            return;
        }
        if d < 0 {
            self.stats.duplicates += 1;
            if operation == Operation::RdmaReadRequest {
                if let Some(reth) = pkt.reth {
                    // Re-execute the read for the requested range.
                    let _ = self.queue_read(ctx, psn, reth, true);
                }
            } else if pkt.bth.ack_req {
                let e = self.epsn.wrapping_sub(1);
                self.queue_ack(e, AethSyndrome::Ack(CreditCount::INVALID));
            }
            return;
        }
        self.nak_sent = false;
        let mtu = self.mtu() as usize;
        let n = payload.len();
        let opc = pkt.bth.opcode;
        // Packet length rules (rxe_resp_check_length).
        let len_ok = if opc.is_first() || opc.is_middle() {
            n == mtu
        } else if opc.is_last() {
            (1..=mtu).contains(&n)
        } else {
            n <= mtu
        };
        if opc.has_payload() && !len_ok {
            return self.nak_and_error(
                ctx,
                psn,
                NakCode::INVALID_REQUEST,
                AsyncEvent::QpRequestError { qpn: self.qpn },
            );
        }
        if opc.is_send() {
            self.on_send(ctx, pkt, payload);
        } else if opc.is_rdma_write() {
            self.on_write(ctx, pkt, payload);
        } else if operation == Operation::RdmaReadRequest {
            let Some(reth) = pkt.reth else { return };
            if self.recv.is_some() || self.write.is_some() {
                return self.nak_and_error(
                    ctx,
                    psn,
                    NakCode::INVALID_REQUEST,
                    AsyncEvent::QpRequestError { qpn: self.qpn },
                );
            }
            match self.queue_read(ctx, psn, reth, false) {
                Ok(npkts) => {
                    self.epsn = self.epsn.wrapping_add(npkts);
                    self.msn = self.msn.wrapping_add(1);
                }
                Err((code, ev)) => self.nak_and_error(ctx, psn, code, ev),
            }
        } else {
            // Atomics, FLUSH, ATOMIC WRITE: not supported by this device.
            self.nak_and_error(
                ctx,
                psn,
                NakCode::INVALID_REQUEST,
                AsyncEvent::QpRequestError { qpn: self.qpn },
            );
        }
    }

    fn take_recv(&mut self) -> Result<Option<InRecv>, ()> {
        if !self.dbr.mem().alive() {
            return Err(());
        }
        let head = self.dbr.rq_head();
        let avail = head.wrapping_sub(self.rq_next as u16);
        if u32::from(avail) > self.rq.entries() {
            return Err(());
        }
        if avail == 0 {
            return Ok(None);
        }
        let wqe = self.rq.read_wqe(self.rq_next).map_err(|_| ())?;
        let r = InRecv {
            counter: self.rq_next,
            wqe,
            offset: 0,
        };
        self.rq_next = self.rq_next.wrapping_add(1);
        Ok(Some(r))
    }

    fn rnr(&mut self, psn: Psn) {
        self.stats.rnr_naks_sent += 1;
        let t = RnrTimer::from_low_bits(self.attr.min_rnr_timer);
        self.queue_ack(psn, AethSyndrome::RnrNak(t));
    }

    fn on_send(&mut self, ctx: &mut Ctx<'_>, pkt: &IbPacketRepr<'_>, payload: Payload<'_>) {
        let psn = pkt.bth.psn;
        let opc = pkt.bth.opcode;
        if opc.starts_message() {
            if self.recv.is_some() || self.write.is_some() {
                return self.nak_and_error(
                    ctx,
                    psn,
                    NakCode::INVALID_REQUEST,
                    AsyncEvent::QpRequestError { qpn: self.qpn },
                );
            }
            match self.take_recv() {
                Ok(Some(r)) => self.recv = Some(r),
                Ok(None) => return self.rnr(psn),
                Err(()) => {
                    return self.nak_and_error(
                        ctx,
                        psn,
                        NakCode::REMOTE_OPERATIONAL_ERROR,
                        AsyncEvent::QpFatal { qpn: self.qpn },
                    );
                }
            }
        } else if self.recv.is_none() {
            return self.nak_and_error(
                ctx,
                psn,
                NakCode::INVALID_REQUEST,
                AsyncEvent::QpRequestError { qpn: self.qpn },
            );
        }
        let Some(mut r) = self.recv.take() else {
            return;
        };
        if let Err(s) = scatter(ctx, self.pd, &r.wqe.sges, r.offset, payload) {
            let mut c = self.cqe(CqeOpcode::RespErr, 0, r.counter as u16);
            c.syndrome = s as u8;
            let _ = self.push_cqe(ctx, false, &c);
            let code = if s == Syndrome::LocalLength {
                NakCode::INVALID_REQUEST
            } else {
                NakCode::REMOTE_OPERATIONAL_ERROR
            };
            return self.nak_and_error(
                ctx,
                psn,
                code,
                AsyncEvent::QpRequestError { qpn: self.qpn },
            );
        }
        r.offset += payload.len() as u64;
        self.epsn = self.epsn.next();
        if !opc.ends_message() {
            self.recv = Some(r);
            if pkt.bth.ack_req {
                self.queue_ack(psn, AethSyndrome::Ack(CreditCount::INVALID));
            }
            return;
        }
        let mut c = self.cqe(CqeOpcode::RespSend, 0, r.counter as u16);
        c.byte_cnt = u32::try_from(r.offset).unwrap_or(u32::MAX);
        c.solicited = pkt.bth.solicited;
        if let Some(imm) = pkt.immdt {
            c.opcode = CqeOpcode::RespSendImm;
            c.imm_inval_pkey = imm.data;
        }
        if let Some(ieth) = pkt.ieth {
            if invalidate(ctx.mrs, ieth.rkey, self.pd).is_err() {
                let mut e = self.cqe(CqeOpcode::RespErr, 0, r.counter as u16);
                e.syndrome = Syndrome::RemoteInvalRequest as u8;
                let _ = self.push_cqe(ctx, false, &e);
                return self.nak_and_error(
                    ctx,
                    psn,
                    NakCode::INVALID_REQUEST,
                    AsyncEvent::QpRequestError { qpn: self.qpn },
                );
            }
            c.opcode = CqeOpcode::RespSendInv;
            c.imm_inval_pkey = ieth.rkey;
        }
        self.msn = self.msn.wrapping_add(1);
        if !self.push_cqe(ctx, false, &c) {
            return;
        }
        if pkt.bth.ack_req {
            self.queue_ack(psn, AethSyndrome::Ack(CreditCount::INVALID));
        }
    }

    fn on_write(&mut self, ctx: &mut Ctx<'_>, pkt: &IbPacketRepr<'_>, payload: Payload<'_>) {
        let psn = pkt.bth.psn;
        let opc = pkt.bth.opcode;
        let req_err = AsyncEvent::QpRequestError { qpn: self.qpn };
        let acc_err = AsyncEvent::QpAccessError { qpn: self.qpn };
        if opc.starts_message() {
            if self.recv.is_some() || self.write.is_some() {
                return self.nak_and_error(ctx, psn, NakCode::INVALID_REQUEST, req_err);
            }
            let Some(reth) = pkt.reth else { return };
            if !self.attr.access.contains(AccessFlags::REMOTE_WRITE) {
                return self.nak_and_error(ctx, psn, NakCode::INVALID_REQUEST, req_err);
            }
            let len = u64::from(reth.dma_len);
            let mut target = None;
            if len > 0 {
                match check_key(
                    ctx.mrs,
                    reth.rkey,
                    self.pd,
                    AccessFlags::REMOTE_WRITE,
                    reth.va,
                    len,
                    true,
                ) {
                    Err(_e) => {
                        return self.nak_and_error(ctx, psn, NakCode::REMOTE_ACCESS_ERROR, acc_err);
                    }
                    Ok(Some(mr)) if !opc.is_only() => {
                        target = WriteTarget::resolve(ctx.mem, mr, reth.va, len);
                    }
                    Ok(_) => {}
                }
            }
            let fits = if opc.is_only() {
                payload.len() as u64 == len
            } else {
                len > payload.len() as u64
            };
            if !fits {
                return self.nak_and_error(ctx, psn, NakCode::INVALID_REQUEST, req_err);
            }
            self.write = Some(InWrite {
                rkey: reth.rkey,
                va: reth.va,
                remaining: len,
                total: reth.dma_len,
                target,
            });
        } else if self.write.is_none() {
            return self.nak_and_error(ctx, psn, NakCode::INVALID_REQUEST, req_err);
        }
        // A WRITE with immediate consumes a receive WQE: check before writing.
        let mut recv = None;
        if opc.consumes_receive_wqe() {
            match self.take_recv() {
                Ok(Some(r)) => recv = Some(r),
                Ok(None) => {
                    if opc.is_only() {
                        self.write = None;
                    }
                    return self.rnr(psn);
                }
                Err(()) => {
                    return self.nak_and_error(
                        ctx,
                        psn,
                        NakCode::REMOTE_OPERATIONAL_ERROR,
                        AsyncEvent::QpFatal { qpn: self.qpn },
                    );
                }
            }
        }
        // The message state is updated where it is (moved out and back in
        // per packet, it cost ~40 instructions per packet); every way out
        // but "more to come" ends it.
        let Some(w) = self.write.as_mut() else {
            return;
        };
        let n = payload.len() as u64;
        if n > w.remaining || (opc.ends_message() && n != w.remaining) {
            self.write = None;
            return self.nak_and_error(ctx, psn, NakCode::INVALID_REQUEST, req_err);
        }
        if n > 0 {
            let placed = w.target.as_mut().and_then(|t| t.place(payload));
            let res = placed.unwrap_or_else(|| {
                // No target, or it no longer holds: the full check.
                w.target = None;
                check_key(
                    ctx.mrs,
                    w.rkey,
                    self.pd,
                    AccessFlags::REMOTE_WRITE,
                    w.va,
                    n,
                    true,
                )
                .and_then(|mr| mr_write(ctx.mem, mr, w.va, payload))
            });
            if res.is_err() {
                self.write = None;
                return self.nak_and_error(ctx, psn, NakCode::REMOTE_ACCESS_ERROR, acc_err);
            }
        }
        w.va = w.va.wrapping_add(n);
        w.remaining -= n;
        let total = w.total;
        self.epsn = self.epsn.next();
        if opc.ends_message() {
            self.write = None;
            self.msn = self.msn.wrapping_add(1);
            if let (Some(r), Some(imm)) = (recv, pkt.immdt) {
                let mut c = self.cqe(CqeOpcode::RespWrImm, 0, r.counter as u16);
                c.byte_cnt = total;
                c.imm_inval_pkey = imm.data;
                c.solicited = pkt.bth.solicited;
                if !self.push_cqe(ctx, false, &c) {
                    return;
                }
            }
        }
        if pkt.bth.ack_req {
            self.queue_ack(psn, AethSyndrome::Ack(CreditCount::INVALID));
        }
    }

    fn queue_read(
        &mut self,
        ctx: &mut Ctx<'_>,
        psn: Psn,
        reth: RethRepr,
        duplicate: bool,
    ) -> Result<u32, (NakCode, AsyncEvent)> {
        let req_err = (
            NakCode::INVALID_REQUEST,
            AsyncEvent::QpRequestError { qpn: self.qpn },
        );
        if !self.attr.access.contains(AccessFlags::REMOTE_READ) {
            return Err(req_err);
        }
        if duplicate {
            // A retried request for a read still being answered restarts it
            // (the requester may have lost its first packets) rather than
            // queueing a second copy.
            for item in &mut self.resp_out {
                if let RespItem::Read {
                    first_psn,
                    next_pkt,
                    ..
                } = item
                {
                    if *first_psn == psn {
                        *next_pkt = 0;
                        return Ok(0);
                    }
                }
            }
        }
        let in_queue = self
            .resp_out
            .iter()
            .filter(|i| matches!(i, RespItem::Read { replay: false, .. }))
            .count() as u32;
        if !duplicate && in_queue >= u32::from(self.attr.max_dest_rd_atomic) {
            return Err(req_err);
        }
        if reth.dma_len > 1 << 31 {
            return Err(req_err);
        }
        if reth.dma_len > 0
            && check_key(
                ctx.mrs,
                reth.rkey,
                self.pd,
                AccessFlags::REMOTE_READ,
                reth.va,
                u64::from(reth.dma_len),
                true,
            )
            .is_err()
        {
            return Err((
                NakCode::REMOTE_ACCESS_ERROR,
                AsyncEvent::QpAccessError { qpn: self.qpn },
            ));
        }
        let npkts = reth.dma_len.div_ceil(self.mtu()).max(1);
        self.resp_out.push_back(RespItem::Read {
            first_psn: psn,
            rkey: reth.rkey,
            va: reth.va,
            len: reth.dma_len,
            next_pkt: 0,
            npkts,
            replay: duplicate,
        });
        Ok(npkts)
    }

    fn emit_ack(&mut self, ctx: &mut Ctx<'_>, psn: Psn, syndrome: AethSyndrome) {
        let bth = BthRepr {
            opcode: ACK_OPCODE,
            solicited: false,
            mig_req: false,
            pkey: 0xffff,
            fecn: false,
            becn: false,
            dest_qp: Qpn::from_low_bits(self.attr.dest_qpn),
            ack_req: false,
            psn,
        };
        let mut pkt = IbPacketRepr::new(bth, &[]);
        pkt.aeth = Some(AethRepr {
            syndrome,
            msn: Msn::from_low_bits(self.msn),
        });
        ctx.out.send(self.route(ctx.local_gid), &pkt);
    }

    /// Emits queued ACKs/NAKs and up to a burst of READ response packets.
    pub fn emit_responses(&mut self, ctx: &mut Ctx<'_>) -> bool {
        if self.qp_type != QpType::Rc {
            return false;
        }
        if self.resp_out.is_empty() {
            if self.resp_error && self.state != QpState::Err {
                self.resp_error = false;
                self.enter_error(ctx, false);
                return true;
            }
            return false;
        }
        let mut budget = RESP_BURST;
        let mtu = self.mtu();
        // One route for the burst (its GIDs converted once, not per packet):
        // nothing in the loop changes the path; an error ends the burst.
        let route = self.route(ctx.local_gid);
        while budget > 0 {
            let Some(item) = self.resp_out.front_mut() else {
                break;
            };
            match item {
                RespItem::Ack { psn, syndrome } => {
                    let (p, s) = (*psn, *syndrome);
                    self.resp_out.pop_front();
                    self.emit_ack(ctx, p, s);
                    budget -= 1;
                }
                RespItem::Read {
                    first_psn,
                    rkey,
                    va,
                    len,
                    next_pkt,
                    npkts,
                    ..
                } => {
                    let k = *next_pkt;
                    let off = u64::from(k) * u64::from(mtu);
                    let n =
                        (u64::from(*len) - off.min(u64::from(*len))).min(u64::from(mtu)) as usize;
                    let (rk, v, fp, np) = (*rkey, *va, *first_psn, *npkts);
                    // The data by reference: the memory behind the key,
                    // checked now, read when the requester places it (see
                    // `super::payload`).
                    let data = read_response_data(ctx, self.pd, rk, v + off, n);
                    let read_ok = data.is_ok();
                    *next_pkt += 1;
                    let done = *next_pkt >= np;
                    if done {
                        self.resp_out.pop_front();
                    }
                    if !read_ok {
                        // The region changed under an accepted READ.
                        self.resp_out.clear();
                        let ev = AsyncEvent::QpAccessError { qpn: self.qpn };
                        self.nak_and_error(
                            ctx,
                            fp.wrapping_add(k),
                            NakCode::REMOTE_ACCESS_ERROR,
                            ev,
                        );
                        return true;
                    }
                    use Operation as O;
                    let operation = if np == 1 {
                        O::RdmaReadResponseOnly
                    } else if k == 0 {
                        O::RdmaReadResponseFirst
                    } else if k + 1 == np {
                        O::RdmaReadResponseLast
                    } else {
                        O::RdmaReadResponseMiddle
                    };
                    let opcode = op_(operation, Transport::Rc);
                    let bth = BthRepr {
                        opcode,
                        solicited: false,
                        mig_req: false,
                        pkey: 0xffff,
                        fecn: false,
                        becn: false,
                        dest_qp: Qpn::from_low_bits(self.attr.dest_qpn),
                        ack_req: false,
                        psn: fp.wrapping_add(k),
                    };
                    let mut pkt = IbPacketRepr::new(bth, &[]);
                    if opcode.has_aeth() {
                        pkt.aeth = Some(AethRepr {
                            syndrome: AethSyndrome::Ack(CreditCount::INVALID),
                            msn: Msn::from_low_bits(self.msn),
                        });
                    }
                    let payload = SharedPayload {
                        src: data.unwrap_or_else(|()| Source::Bytes(Arc::default())),
                        range: 0..n,
                    };
                    ctx.out.send_shared(route, &pkt, payload);
                    budget -= 1;
                }
            }
        }
        true
    }

    fn receive_datagram(
        &mut self,
        ctx: &mut Ctx<'_>,
        src_gid: Gid,
        dst_gid: Gid,
        pkt: &IbPacketRepr<'_>,
        payload: Payload<'_>,
    ) {
        if !matches!(
            self.state,
            QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe
        ) {
            return;
        }
        let Some(deth) = pkt.deth else { return };
        let want = if self.qp_type == QpType::Gsi {
            GSI_QKEY
        } else {
            self.attr.qkey
        };
        if deth.qkey != want {
            self.stats.ud_dropped += 1;
            return;
        }
        let r = match self.take_recv() {
            Ok(Some(r)) => r,
            Ok(None) => {
                self.stats.ud_dropped += 1;
                return;
            }
            Err(()) => {
                self.event(ctx, AsyncEvent::QpFatal { qpn: self.qpn });
                self.enter_error(ctx, false);
                return;
            }
        };
        let mut grh = [0u8; GRH_LEN];
        grh[0] = 0x60;
        grh[4..6].copy_from_slice(&(payload.len() as u16).to_be_bytes());
        grh[6] = 0x1b;
        grh[7] = 64;
        grh[8..24].copy_from_slice(&src_gid.0);
        grh[24..40].copy_from_slice(&dst_gid.0);
        let total = (GRH_LEN + payload.len()) as u64;
        let res = if total > r.wqe.capacity() {
            Err(Syndrome::LocalLength)
        } else {
            scatter(ctx, self.pd, &r.wqe.sges, 0, Payload::Bytes(&grh))
                .and_then(|()| scatter(ctx, self.pd, &r.wqe.sges, GRH_LEN as u64, payload))
        };
        match res {
            Ok(()) => {
                let mut c = self.cqe(CqeOpcode::RespSend, 0, r.counter as u16);
                c.byte_cnt = total as u32;
                c.src_qpn = deth.src_qp.get();
                c.grh = true;
                c.solicited = pkt.bth.solicited;
                if let Some(imm) = pkt.immdt {
                    c.opcode = CqeOpcode::RespSendImm;
                    c.imm_inval_pkey = imm.data;
                }
                let _ = self.push_cqe(ctx, false, &c);
            }
            Err(s) => {
                // A datagram error completes the WQE; the QP stays usable.
                let mut c = self.cqe(CqeOpcode::RespErr, 0, r.counter as u16);
                c.syndrome = s as u8;
                let _ = self.push_cqe(ctx, false, &c);
            }
        }
    }
}

/// Calls `f` with the checked MR, address and length of each non-empty SGE
/// of a send WQE, in order: every lkey is checked (local access, this PD)
/// before its bytes are touched, and the first failure ends the walk.
fn for_each_checked_sge(
    ctx: &Ctx<'_>,
    pd: u32,
    sges: &[DataSegRepr],
    mut f: impl FnMut(Option<&Mr>, u64, usize) -> Result<(), Syndrome>,
) -> Result<(), Syndrome> {
    for s in sges.iter().filter(|s| s.byte_count != 0) {
        let n = s.byte_count as usize;
        let mr = check_key(
            ctx.mrs,
            s.lkey,
            pd,
            AccessFlags::empty(),
            s.addr,
            n as u64,
            false,
        )
        .map_err(key_syndrome)?;
        f(mr, s.addr, n)?;
    }
    Ok(())
}

/// Gathers a send WQE's data into one buffer, checking every lkey; returns
/// the buffer and how many bytes at its start are the data.
fn gather(ctx: &Ctx<'_>, pd: u32, g: &Gather<'_>) -> Result<(Source, usize), Syndrome> {
    match g {
        Gather::Inline(b) => Ok((Source::Bytes(Arc::new(b.to_vec())), b.len())),
        Gather::Sges(sges) => {
            let total: u64 = sges.iter().map(|s| u64::from(s.byte_count)).sum();
            if total > 1 << 31 {
                return Err(Syndrome::LocalLength);
            }
            // Every byte of `..total` is written below (the byte counts sum
            // to `total`), or the buffer is dropped with the error.
            let mut shared = payload_buffer(total as usize);
            let out = Arc::make_mut(&mut shared);
            let mut at = 0usize;
            for_each_checked_sge(ctx, pd, sges, |mr, addr, n| {
                let dst = out.get_mut(at..at + n).ok_or(Syndrome::LocalLength)?;
                mr_read(ctx.mem, mr, addr, dst).map_err(key_syndrome)?;
                at += n;
                Ok(())
            })?;
            Ok((Source::Bytes(shared), at))
        }
    }
}

/// The data of one RDMA READ response packet, `len` bytes at `va` under the
/// responder's `rkey` (checked now), by reference: the memory pinned, and
/// valid only while the key's MR is unchanged (see [`super::payload`]).
fn read_response_data(
    ctx: &Ctx<'_>,
    pd: u32,
    rkey: u32,
    va: u64,
    len: usize,
) -> Result<Source, ()> {
    if len == 0 {
        return Ok(Source::Bytes(Arc::default()));
    }
    let mr = check_key(
        ctx.mrs,
        rkey,
        pd,
        AccessFlags::REMOTE_READ,
        va,
        len as u64,
        true,
    )
    .map_err(drop)?;
    let mut shared = pinned();
    let p = Arc::get_mut(&mut shared).ok_or(())?;
    mr_pin(ctx.mem, mr, va, len, p).map_err(drop)?;
    if let Some(mr) = mr {
        p.guarded(&mr.generation);
    }
    Ok(Source::Pinned(shared))
}

/// Pins a send WQE's source memory, checking every lkey (exactly as
/// [`gather`] does, now): the data by reference, read when it is placed
/// (see [`super::payload`]). Inline data is gathered (it is in the WQE).
/// Returns the source and its length.
fn pin(ctx: &Ctx<'_>, pd: u32, g: &Gather<'_>) -> Result<(Source, usize), Syndrome> {
    let Gather::Sges(sges) = g else {
        return gather(ctx, pd, g);
    };
    let total: u64 = sges.iter().map(|s| u64::from(s.byte_count)).sum();
    if total > 1 << 31 {
        return Err(Syndrome::LocalLength);
    }
    let mut shared = pinned();
    let Some(p) = Arc::get_mut(&mut shared) else {
        return gather(ctx, pd, g);
    };
    for_each_checked_sge(ctx, pd, sges, |mr, addr, n| {
        mr_pin(ctx.mem, mr, addr, n, p).map_err(key_syndrome)
    })?;
    let len = p.len();
    Ok((Source::Pinned(shared), len))
}

/// Writes `data` at byte `offset` of the scatter list, checking every lkey.
fn scatter(
    ctx: &Ctx<'_>,
    pd: u32,
    sges: &[DataSegRepr],
    offset: u64,
    data: Payload<'_>,
) -> Result<(), Syndrome> {
    let cap: u64 = sges.iter().map(|s| u64::from(s.byte_count)).sum();
    if offset + data.len() as u64 > cap {
        return Err(Syndrome::LocalLength);
    }
    let mut skip = offset;
    let mut done = 0usize;
    for s in sges {
        if done == data.len() {
            break;
        }
        let bc = u64::from(s.byte_count);
        if skip >= bc {
            skip -= bc;
            continue;
        }
        let n = ((bc - skip) as usize).min(data.len() - done);
        let va = s.addr + skip;
        let mr = check_key(
            ctx.mrs,
            s.lkey,
            pd,
            AccessFlags::LOCAL_WRITE,
            va,
            n as u64,
            false,
        )
        .map_err(key_syndrome)?;
        let src = data.sub(done, n).ok_or(Syndrome::LocalLength)?;
        mr_write(ctx.mem, mr, va, src).map_err(key_syndrome)?;
        done += n;
        skip = 0;
    }
    Ok(())
}

/// LOCAL_INVAL / SEND with invalidate: a valid fast-registration mkey of
/// this PD, with the exact current key, becomes free.
fn invalidate(mrs: &mut BTreeMap<u32, Mr>, key: u32, pd: u32) -> Result<(), Syndrome> {
    let mr = mrs.get_mut(&(key >> 8)).ok_or(Syndrome::LocalProt)?;
    if mr.fast_reg.is_none() || !mr.valid || mr.pd != pd || u32::from(mr.key) != key & 0xff {
        return Err(Syndrome::LocalProt);
    }
    mr.valid = false;
    mr.retire();
    Ok(())
}

/// REG_MR by work request.
fn fast_register(ctx: &mut Ctx<'_>, pd: u32, w: &SendWqe<'_>) -> Result<(), Syndrome> {
    let reg = w.reg_mr.ok_or(Syndrome::LocalQpOp)?;
    if !reg.access.is_valid_for_mr() {
        return Err(Syndrome::LocalProt);
    }
    let n = reg.npages as usize;
    let mut pages = Vec::with_capacity(n);
    match w.page_list {
        Some(PageList::Inline(_)) => {
            let list = w.page_list.ok_or(Syndrome::LocalQpOp)?;
            for i in 0..n {
                pages.push(list.inline_page(i).ok_or(Syndrome::LocalQpOp)?.get());
            }
        }
        Some(PageList::Indirect(d)) => {
            let mr = check_key(
                ctx.mrs,
                d.lkey,
                pd,
                AccessFlags::empty(),
                d.addr,
                u64::from(d.byte_count),
                false,
            )
            .map_err(key_syndrome)?;
            let mut raw = vec![0u8; n * 8];
            mr_read(ctx.mem, mr, d.addr, &mut raw).map_err(key_syndrome)?;
            for c in raw.chunks_exact(8) {
                let mut b = [0u8; 8];
                b.copy_from_slice(c);
                pages.push(u64::from_be_bytes(b));
            }
        }
        None => return Err(Syndrome::LocalQpOp),
    }
    let mask = (1u64 << reg.page_shift) - 1;
    if pages.iter().any(|p| p & mask != 0) {
        return Err(Syndrome::LocalProt);
    }
    let mr = ctx
        .mrs
        .get_mut(&(reg.mkey >> 8))
        .ok_or(Syndrome::LocalProt)?;
    let max = mr.fast_reg.ok_or(Syndrome::LocalProt)?;
    if mr.valid || mr.pd != pd || reg.npages > max {
        return Err(Syndrome::LocalProt);
    }
    mr.retire();
    mr.key = (reg.mkey & 0xff) as u8;
    mr.valid = true;
    mr.iova = reg.iova;
    mr.length = reg.length;
    mr.page_shift = reg.page_shift;
    mr.pages = pages;
    mr.access = reg.access;
    Ok(())
}
