//! The CM protocol engine: every connection's state machine, the listener
//! table and the MAD agent logic, with no I/O of its own.
//!
//! The engine is driven by events — a MAD received ([`CmEngine::on_mad`]),
//! time passing ([`CmEngine::on_timeout`]), a QP modification finished
//! ([`CmEngine::on_qp_modified`]), the first packet on a QP in RTR
//! ([`CmEngine::on_comm_established`]), a consumer call (`connect`,
//! `listen`, `accept`, `reject`, `disconnect`) — and answers with effects
//! through [`CmEffects`]: send this MAD, modify this QP, deliver this event,
//! report this dropped MAD. Time is a nanosecond count the caller passes
//! in; the engine keeps one deadline per connection and says when the next
//! one is due ([`CmEngine::next_deadline`]).
//!
//! # Memory and IRQL
//!
//! [`CmEngine::new`] allocates every table once (`PASSIVE_LEVEL`). After
//! that no method allocates, blocks or loops beyond the table sizes, so all
//! of them may run at `DISPATCH_LEVEL`. Each connection slot keeps the last
//! MAD it sent (for retransmission and for answering duplicates) and a
//! private-data buffer (for events that wait on a QP modification).
//!
//! # The consumer's view
//!
//! Per connection, the callback sees at most one `Established`, then
//! exactly one terminal event (`Rejected`, `Unreachable`, `Disconnected`).
//! A terminal event is delivered only when no QP modification the CM asked
//! for is in flight and, if the CM had moved the QP past INIT, after it has
//! moved it to ERR: from then on the CM never touches the QP. The slot may
//! live on for the protocol's sake (DREQ retries, timewait), invisibly.
//!
//! Linux behaviour is followed where it is observable on the wire (see the
//! comments at each decision).

use alloc::boxed::Box;
use alloc::vec::Vec;

use hca_lowlevel::device::AddressVector;
use hca_lowlevel::wire::{Eecn, Gid, Psn, Qpn};

use super::agent::{CmStats, DropReason, DroppedMad, IdSource};
use super::qp::{QpModify, RtrAttrs, RtsAttrs};
use super::rdma_cm;
use super::types::{
    AcceptRequest, CmError, CmEvent, CmId, ConnParams, ConnectRequest, DisconnectCause,
    IncomingRequest, ListenEvent, ListenerId, MadAddress, UnreachableCause, WithdrawnCause,
};
use crate::wire::{
    CmDrepRepr, CmDreqRepr, CmMadRepr, CmMessage, CmMessageKind, CmMraRepr, CmPathRepr, CmRejRepr,
    CmRepRepr, CmReqRepr, CmRtuRepr, IbTimeout, MAD_LEN, MadHeader, PathMtu, RejectReason,
    ServiceId, TransportServiceType, attribute,
};

/// Private data limits per message (IBA table 103).
pub mod limits {
    /// REQ private data.
    pub const REQ: usize = 92;
    /// REP private data.
    pub const REP: usize = 196;
    /// REJ private data.
    pub const REJ: usize = 148;
    /// DREQ private data.
    pub const DREQ: usize = 220;
    /// The largest private data any message the engine keeps carries (RTU,
    /// DREP).
    pub const MAX: usize = 224;
}

/// The P_Key of the default partition (full member), what RoCE uses.
pub const DEFAULT_PKEY: u16 = 0xffff;

/// What the engine asks its environment to do. Called synchronously from
/// inside engine methods; an implementation must not call back into the
/// engine and must not block (it may run at `DISPATCH_LEVEL`).
pub trait CmEffects {
    /// Send `mad` to `to` (a UD send on QP1 with the GSI Q_Key).
    fn send_mad(&mut self, to: &MadAddress, mad: &[u8; MAD_LEN]);

    /// Modify the QP `qpn` of connection `id`; report the result with
    /// [`CmEngine::on_qp_modified`]. At most one is outstanding per
    /// connection.
    fn modify_qp(&mut self, id: CmId, qpn: Qpn, modify: &QpModify);

    /// Deliver `event` to connection `id`'s consumer.
    fn event(&mut self, id: CmId, event: CmEvent<'_>);

    /// Deliver `event` to a listener's consumer.
    fn listener_event(&mut self, listener: ListenerId, event: ListenEvent<'_>);

    /// A received MAD was dropped (the trace hook).
    fn dropped(&mut self, drop: &DroppedMad);

    /// Whether the free slot `slot` may take a new connection now. An
    /// environment that delivers events later (from a per-slot mailbox)
    /// says no while the slot's events from its previous connection are
    /// still undelivered, so a slot never carries two connections' events.
    fn slot_reusable(&self, slot: usize) -> bool {
        let _ = slot;
        true
    }
}

/// The engine's configuration: the port it serves and the CM timing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CmConfig {
    /// This port's GID (RoCE: its IPv4-mapped address).
    pub local_gid: Gid,
    /// This CA's GUID (REQ/REP "local CA GUID", REJ Timeout ARI).
    pub local_ca_guid: u64,
    /// The port's active MTU: REQs asking for more are rejected (26).
    pub port_mtu: PathMtu,
    /// The packet lifetime of the fabric (Linux RoCE:
    /// `CMA_IBOE_PACKET_LIFETIME` 18, ≈ 1.07 s). Every CM timeout adds it
    /// twice.
    pub packet_lifetime: IbTimeout,
    /// How long this side takes to answer a CM message, as advertised in
    /// its REQ, and how long it waits for the peer (Linux
    /// `CMA_CM_RESPONSE_TIMEOUT` 20, ≈ 4.3 s).
    pub cm_response_timeout: IbTimeout,
    /// Retransmissions before giving up (Linux `CMA_MAX_CM_RETRIES` 15).
    pub max_cm_retries: u8,
    /// The service timeout this side's MRAs announce.
    pub mra_service_timeout: IbTimeout,
    /// How long a connection stays in timewait.
    pub timewait: IbTimeout,
    /// The REP target ACK delay.
    pub target_ack_delay: IbTimeout,
    /// Connection slots (timewait included); at most 65535.
    pub connections: usize,
    /// Listener slots; at most 65535.
    pub listeners: usize,
    /// Seed of the communication ID salt, transaction IDs and random PSNs.
    pub seed: u64,
}

impl CmConfig {
    /// A configuration with Linux RDMA/CM's timing.
    ///
    /// # IRQL
    ///
    /// Any (pure computation).
    pub const fn new(local_gid: Gid, local_ca_guid: u64) -> CmConfig {
        CmConfig {
            local_gid,
            local_ca_guid,
            port_mtu: PathMtu::Mtu1024,
            packet_lifetime: IbTimeout::CMA_IBOE_PACKET_LIFETIME,
            cm_response_timeout: IbTimeout::CMA_CM_RESPONSE,
            max_cm_retries: 15,
            mra_service_timeout: IbTimeout::from_low_bits(21),
            timewait: rdma_cm::ack_timeout_for(IbTimeout::CMA_IBOE_PACKET_LIFETIME),
            target_ack_delay: IbTimeout::from_low_bits(15),
            connections: 64,
            listeners: 8,
            seed: 0,
        }
    }

    /// A CM timeout: `cm_timeout` plus twice the packet lifetime (Linux
    /// `cm_convert_to_ms(packet_life_time) * 2 + cm_convert_to_ms(timeout)`).
    ///
    /// # IRQL
    ///
    /// Any (pure computation).
    pub const fn response_timeout_ns(&self, cm_timeout: IbTimeout) -> u64 {
        cm_timeout
            .as_nanos()
            .saturating_add(self.packet_lifetime.as_nanos().saturating_mul(2))
    }
}

/// A connection's protocol state (IBA 12.9, Linux `ib_cm_state` names).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum CmState {
    /// Active: REQ sent, waiting for REP.
    ReqSent,
    /// Active: the peer acknowledged the REQ with MRA; waiting longer.
    MraReqRcvd,
    /// Active: REP accepted; the QP is going to RTR and RTS, then RTU.
    RepRcvd,
    /// Passive: REQ delivered to the listener; waiting for accept/reject.
    ReqRcvd,
    /// Passive: a duplicate REQ came while the consumer thinks; MRA sent.
    MraReqSent,
    /// Passive: accepted; the QP is going to RTR, then REP.
    Accepting,
    /// Passive: REP sent, waiting for RTU.
    RepSent,
    /// Passive: the peer acknowledged the REP with MRA; waiting longer.
    MraRepRcvd,
    /// Passive: RTU (or the first packet) came; the QP is going to RTS.
    RtuRcvd,
    /// Connected.
    Established,
    /// DREQ sent, waiting for DREP.
    DreqSent,
    /// Disconnected; remembering the peer's IDs for stale detection.
    TimeWait,
    /// Ended. A passive side that rejected lingers here to repeat its REJ
    /// to duplicate REQs.
    Closed,
}

/// How a listener reads REQ private data.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum ListenKind {
    /// Plain IB CM: the consumer gets all 92 bytes.
    IbCm,
    /// RDMA/CM: the 36-byte header is checked and stripped.
    RdmaCm,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Role {
    Active,
    Passive,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Consumer {
    /// Passive, not yet accepted: the listener speaks for it.
    Listener(ListenerId),
    /// Events go to the connection's consumer.
    Attached,
    /// The terminal event has been delivered.
    Detached,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Terminal {
    Rejected(RejectReason),
    Unreachable(UnreachableCause),
    Disconnected(DisconnectCause),
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum QpOp {
    RtrRts,
    Rtr,
    Rts,
    Error,
}

/// Private data kept for an event that waits on the QP.
#[derive(Clone, Copy)]
struct Stash {
    len: usize,
    bytes: [u8; limits::MAX],
}

impl Stash {
    const EMPTY: Stash = Stash {
        len: 0,
        bytes: [0; limits::MAX],
    };

    fn set(&mut self, data: &[u8]) {
        let n = data.len().min(limits::MAX);
        if let (Some(dst), Some(src)) = (self.bytes.get_mut(..n), data.get(..n)) {
            dst.copy_from_slice(src);
        }
        self.len = n;
    }

    fn clear(&mut self) {
        self.len = 0;
    }

    fn as_slice(&self) -> &[u8] {
        self.bytes.get(..self.len).unwrap_or(&[])
    }
}

/// The last MAD a connection sent.
#[derive(Clone, Copy)]
struct SentMad {
    valid: bool,
    to: MadAddress,
    bytes: [u8; MAD_LEN],
}

impl SentMad {
    const EMPTY: SentMad = SentMad {
        valid: false,
        to: MadAddress::cm(Gid::ZERO),
        bytes: [0; MAD_LEN],
    };
}

const EMPTY_PATH: CmPathRepr = CmPathRepr {
    local_lid: 0,
    remote_lid: 0,
    local_gid: Gid::ZERO,
    remote_gid: Gid::ZERO,
    flow_label: 0,
    packet_rate: 0,
    traffic_class: 0,
    hop_limit: 0,
    sl: 0,
    subnet_local: false,
    local_ack_timeout: IbTimeout::from_low_bits(0),
};

/// One connection.
struct Slot {
    index: u16,
    generation: u16,
    in_use: bool,
    state: CmState,
    role: Role,
    consumer: Consumer,
    peer: MadAddress,
    service_id: ServiceId,
    local_comm_id: u32,
    /// The peer's comm ID, CA GUID, QPN and PSN are known (REQ or REP seen).
    remote_known: bool,
    remote_comm_id: u32,
    remote_ca_guid: u64,
    local_qpn: Qpn,
    remote_qpn: Qpn,
    /// The starting PSN this side advertised (REQ or REP): as Linux's CM
    /// uses it, the PSN this side's receive queue expects first.
    local_psn: Psn,
    /// The starting PSN the peer advertised: where this side's send queue
    /// starts.
    remote_psn: Psn,
    /// The TID of the REQ; REP, RTU, MRA and REJ of the setup reuse it.
    req_tid: u64,
    /// The TID of this side's DREQ (its DREP echoes it).
    dreq_tid: u64,
    /// The TID of the peer's DREQ (this side's DREP echoes it).
    peer_dreq_tid: u64,
    /// The primary path seen from this side (local = this port).
    path: CmPathRepr,
    path_mtu: PathMtu,
    /// This side's parameters (responder resources and initiator depth
    /// final once negotiated).
    params: ConnParams,
    peer_responder_resources: u8,
    peer_initiator_depth: u8,
    /// The RNR retry count the peer advertised: this side's RTS value.
    peer_rnr_retry: u8,
    /// The transport retry count both sides use (the REQ's).
    retry_count: u8,
    response_timeout_ns: u64,
    max_retries: u8,
    retries_left: u8,
    deadline: Option<u64>,
    qp_op: Option<QpOp>,
    qp_error_pending: bool,
    qp_in_error: bool,
    terminal: Option<Terminal>,
    stash: Stash,
    last_sent: SentMad,
}

impl Slot {
    fn empty(index: u16) -> Slot {
        Slot {
            index,
            generation: 1,
            in_use: false,
            state: CmState::Closed,
            role: Role::Active,
            consumer: Consumer::Detached,
            peer: MadAddress::cm(Gid::ZERO),
            service_id: ServiceId(0),
            local_comm_id: 0,
            remote_known: false,
            remote_comm_id: 0,
            remote_ca_guid: 0,
            local_qpn: Qpn::from_low_bits(0),
            remote_qpn: Qpn::from_low_bits(0),
            local_psn: Psn::from_low_bits(0),
            remote_psn: Psn::from_low_bits(0),
            req_tid: 0,
            dreq_tid: 0,
            peer_dreq_tid: 0,
            path: EMPTY_PATH,
            path_mtu: PathMtu::Mtu1024,
            params: ConnParams::SRP,
            peer_responder_resources: 0,
            peer_initiator_depth: 0,
            peer_rnr_retry: 0,
            retry_count: 0,
            response_timeout_ns: 0,
            max_retries: 0,
            retries_left: 0,
            deadline: None,
            qp_op: None,
            qp_error_pending: false,
            qp_in_error: false,
            terminal: None,
            stash: Stash::EMPTY,
            last_sent: SentMad::EMPTY,
        }
    }

    fn id(&self) -> CmId {
        CmId::new(self.index, self.generation)
    }

    /// Takes the slot for a new connection and gives it its local comm ID
    /// (slot index and generation, salted).
    fn open(&mut self, role: Role, consumer: Consumer, salt: u32) {
        let index = self.index;
        let generation = self.generation;
        *self = Slot::empty(index);
        self.generation = generation;
        self.in_use = true;
        self.role = role;
        self.consumer = consumer;
        self.local_comm_id = ((u32::from(generation) << 16) | u32::from(index)) ^ salt;
    }

    fn release(&mut self) {
        self.in_use = false;
        self.generation = self.generation.wrapping_add(1).max(1);
        self.last_sent.valid = false;
        self.deadline = None;
    }

    /// Nothing left to do: no protocol activity, no QP work, no event owed.
    fn is_finished(&self) -> bool {
        self.in_use
            && self.state == CmState::Closed
            && self.deadline.is_none()
            && self.qp_op.is_none()
            && !self.qp_error_pending
            && self.terminal.is_none()
            && self.consumer != Consumer::Attached
    }

    /// The connection is a request its listener has not answered yet
    /// (what `accept` and `reject` need).
    fn check_unanswered(&self) -> Result<(), CmError> {
        match self.consumer {
            // Its consumer has had its last event (or rejected it).
            Consumer::Detached => Err(CmError::UnknownId),
            Consumer::Attached => Err(CmError::WrongState),
            Consumer::Listener(_)
                if matches!(self.state, CmState::ReqRcvd | CmState::MraReqSent) =>
            {
                Ok(())
            }
            Consumer::Listener(_) => Err(CmError::WrongState),
        }
    }

    fn consumer_active(&self) -> bool {
        self.consumer == Consumer::Attached && self.terminal.is_none()
    }

    fn remote_comm_id_or_zero(&self) -> u32 {
        if self.remote_known {
            self.remote_comm_id
        } else {
            0
        }
    }

    fn arm<F: CmEffects + ?Sized>(&mut self, cx: &Cx<'_, F>, after_ns: u64) {
        self.deadline = Some(cx.now.saturating_add(after_ns));
    }

    fn enter_timewait<F: CmEffects + ?Sized>(&mut self, cx: &Cx<'_, F>) {
        self.state = CmState::TimeWait;
        self.arm(cx, cx.cfg.timewait.as_nanos());
    }

    /// Ends the protocol; `linger` keeps the slot (and its last MAD, a
    /// REJ) for a timewait to answer duplicate REQs.
    fn enter_closed<F: CmEffects + ?Sized>(&mut self, cx: &Cx<'_, F>, linger: bool) {
        self.state = CmState::Closed;
        if linger {
            self.arm(cx, cx.cfg.timewait.as_nanos());
        } else {
            self.deadline = None;
        }
    }

    // ---- sending ----------------------------------------------------------

    fn resend_last<F: CmEffects + ?Sized>(&mut self, cx: &mut Cx<'_, F>) {
        if self.last_sent.valid {
            cx.fx.send_mad(&self.last_sent.to, &self.last_sent.bytes);
            cx.stats.sent += 1;
        }
    }

    fn send_rej<F: CmEffects + ?Sized>(
        &mut self,
        cx: &mut Cx<'_, F>,
        reason: RejectReason,
        kind: CmMessageKind,
        reveal_local_id: bool,
        data: &[u8],
        store: bool,
    ) {
        let guid = cx.cfg.local_ca_guid.to_be_bytes();
        let ari: &[u8] = if reason == RejectReason::Timeout {
            &guid
        } else {
            &[]
        };
        let rej = CmRejRepr {
            local_comm_id: if reveal_local_id {
                self.local_comm_id
            } else {
                0
            },
            remote_comm_id: self.remote_comm_id_or_zero(),
            message_rejected: kind,
            reason,
            ari,
            private_data: data,
        };
        let store = if store {
            Some(&mut self.last_sent)
        } else {
            None
        };
        cx.send(&self.peer, self.req_tid, CmMessage::Rej(rej), store);
        cx.stats.rejects_sent += 1;
    }

    fn send_mra<F: CmEffects + ?Sized>(&mut self, cx: &mut Cx<'_, F>, kind: CmMessageKind) {
        let mra = CmMraRepr {
            local_comm_id: self.local_comm_id,
            remote_comm_id: self.remote_comm_id_or_zero(),
            message_mraed: kind,
            service_timeout: cx.cfg.mra_service_timeout,
            private_data: &[],
        };
        cx.send(&self.peer, self.req_tid, CmMessage::Mra(mra), None);
        cx.stats.mras_sent += 1;
    }

    fn send_rep<F: CmEffects + ?Sized>(&mut self, cx: &mut Cx<'_, F>) {
        let rep = CmRepRepr {
            local_comm_id: self.local_comm_id,
            remote_comm_id: self.remote_comm_id,
            local_qkey: 0,
            local_qpn: self.local_qpn,
            vendor_id: 0,
            local_eecn: Eecn::from_low_bits(0),
            starting_psn: self.local_psn,
            responder_resources: self.params.responder_resources,
            initiator_depth: self.params.initiator_depth,
            target_ack_delay: cx.cfg.target_ack_delay,
            failover_accepted: 0,
            end_to_end_flow_control: self.params.flow_control,
            rnr_retry_count: self.params.rnr_retry_count,
            srq: self.params.srq,
            local_ca_guid: cx.cfg.local_ca_guid,
            private_data: self.stash.as_slice(),
        };
        cx.send(
            &self.peer,
            self.req_tid,
            CmMessage::Rep(rep),
            Some(&mut self.last_sent),
        );
        self.stash.clear();
    }

    fn send_rtu<F: CmEffects + ?Sized>(&mut self, cx: &mut Cx<'_, F>) {
        let rtu = CmRtuRepr {
            local_comm_id: self.local_comm_id,
            remote_comm_id: self.remote_comm_id,
            private_data: &[],
        };
        cx.send(
            &self.peer,
            self.req_tid,
            CmMessage::Rtu(rtu),
            Some(&mut self.last_sent),
        );
    }

    fn send_dreq<F: CmEffects + ?Sized>(&mut self, cx: &mut Cx<'_, F>, data: &[u8]) {
        self.dreq_tid = cx.ids.next_tid();
        let dreq = CmDreqRepr {
            local_comm_id: self.local_comm_id,
            remote_comm_id: self.remote_comm_id,
            remote_qpn: self.remote_qpn,
            private_data: data,
        };
        cx.send(
            &self.peer,
            self.dreq_tid,
            CmMessage::Dreq(dreq),
            Some(&mut self.last_sent),
        );
        self.state = CmState::DreqSent;
        self.retries_left = self.max_retries;
        self.arm(cx, self.response_timeout_ns);
    }

    fn send_drep<F: CmEffects + ?Sized>(&mut self, cx: &mut Cx<'_, F>, tid: u64) {
        let drep = CmDrepRepr {
            local_comm_id: self.local_comm_id,
            remote_comm_id: self.remote_comm_id,
            private_data: &[],
        };
        cx.send(&self.peer, tid, CmMessage::Drep(drep), None);
    }

    // ---- the QP and the consumer ------------------------------------------

    fn rtr_attrs(&self) -> RtrAttrs {
        RtrAttrs {
            dest_qpn: self.remote_qpn,
            // Linux's CM (ib_send_cm_req / cm_req_handler / cm_rep_handler)
            // advertises in REQ and REP the PSN each side *expects*; the peer
            // sends from it. rxe treats anything else as duplicates.
            rq_psn: self.local_psn,
            path_mtu: self.path_mtu,
            max_dest_rd_atomic: self.params.responder_resources,
            min_rnr_timer: self.params.min_rnr_timer,
            av: AddressVector {
                dgid: self.path.remote_gid,
                sgid_index: 0,
                hop_limit: self.path.hop_limit,
                traffic_class: self.path.traffic_class,
                flow_label: self.path.flow_label,
                sl: self.path.sl,
            },
        }
    }

    fn rts_attrs(&self) -> RtsAttrs {
        RtsAttrs {
            sq_psn: self.remote_psn,
            timeout: self.path.local_ack_timeout,
            retry_cnt: self.retry_count,
            rnr_retry: self.peer_rnr_retry,
            max_rd_atomic: self.params.initiator_depth,
        }
    }

    fn start_qp<F: CmEffects + ?Sized>(&mut self, cx: &mut Cx<'_, F>, op: QpOp) {
        let modify = match op {
            QpOp::Rtr => QpModify::ToRtr(self.rtr_attrs()),
            QpOp::Rts => QpModify::ToRts(self.rts_attrs()),
            QpOp::RtrRts => QpModify::ToRtrAndRts(self.rtr_attrs(), self.rts_attrs()),
            QpOp::Error => QpModify::ToError,
        };
        self.qp_op = Some(op);
        cx.fx.modify_qp(self.id(), self.local_qpn, &modify);
    }

    /// Records the connection's end for its consumer: the event goes out
    /// once the QP is quiet (and in ERR if `qp_error`).
    fn conclude<F: CmEffects + ?Sized>(
        &mut self,
        cx: &mut Cx<'_, F>,
        terminal: Terminal,
        data: &[u8],
        qp_error: bool,
    ) {
        if !self.consumer_active() {
            return;
        }
        if qp_error && !self.qp_in_error {
            self.qp_error_pending = true;
        }
        self.stash.set(data);
        self.terminal = Some(terminal);
        self.pump(cx);
    }

    /// Moves pending QP and consumer work forward.
    fn pump<F: CmEffects + ?Sized>(&mut self, cx: &mut Cx<'_, F>) {
        if self.qp_op.is_some() {
            return;
        }
        if self.qp_error_pending {
            self.qp_error_pending = false;
            self.start_qp(cx, QpOp::Error);
            return;
        }
        if let Some(terminal) = self.terminal.take() {
            self.consumer = Consumer::Detached;
            let private_data = self.stash.as_slice();
            let event = match terminal {
                Terminal::Rejected(reason) => CmEvent::Rejected {
                    reason,
                    private_data,
                },
                Terminal::Unreachable(cause) => CmEvent::Unreachable { cause },
                Terminal::Disconnected(cause) => CmEvent::Disconnected {
                    cause,
                    private_data,
                },
            };
            cx.fx.event(self.id(), event);
        }
    }

    fn deliver_established<F: CmEffects + ?Sized>(&mut self, cx: &mut Cx<'_, F>) {
        self.state = CmState::Established;
        if self.consumer_active() {
            cx.fx.event(
                self.id(),
                CmEvent::Established {
                    private_data: self.stash.as_slice(),
                },
            );
        }
        self.stash.clear();
    }

    fn listener_withdrawn<F: CmEffects + ?Sized>(
        &mut self,
        cx: &mut Cx<'_, F>,
        cause: WithdrawnCause,
    ) {
        if let Consumer::Listener(listener) = self.consumer {
            cx.fx.listener_event(
                listener,
                ListenEvent::Withdrawn {
                    id: self.id(),
                    cause,
                },
            );
        }
    }

    // ---- received messages ------------------------------------------------

    fn on_dup_req<F: CmEffects + ?Sized>(&mut self, cx: &mut Cx<'_, F>) -> Handled {
        match self.state {
            // The consumer is still thinking: tell the peer to wait (Linux
            // sends MRA only when asked; an automatic one saves the peer a
            // retry cycle and costs nothing).
            CmState::ReqRcvd | CmState::MraReqSent => {
                self.send_mra(cx, CmMessageKind::Req);
                self.state = CmState::MraReqSent;
                let extended = cx
                    .now
                    .saturating_add(cx.cfg.response_timeout_ns(cx.cfg.mra_service_timeout));
                self.deadline = Some(self.deadline.map_or(extended, |d| d.max(extended)));
                Ok(())
            }
            CmState::Accepting => {
                self.send_mra(cx, CmMessageKind::Req);
                Ok(())
            }
            // The REP (or the REJ) was lost: repeat it now rather than at
            // the next retry.
            CmState::RepSent | CmState::MraRepRcvd | CmState::Closed => {
                if self.role == Role::Passive && self.last_sent.valid {
                    self.resend_last(cx);
                    Ok(())
                } else {
                    Err(DropReason::Duplicate)
                }
            }
            // Linux `cm_dup_req_handler`: a REQ for a connection in
            // timewait is answered with REJ(stale connection).
            CmState::TimeWait => {
                self.send_rej(
                    cx,
                    RejectReason::StaleConn,
                    CmMessageKind::Req,
                    true,
                    &[],
                    false,
                );
                Ok(())
            }
            _ => Err(DropReason::Duplicate),
        }
    }

    fn on_rep<F: CmEffects + ?Sized>(
        &mut self,
        cx: &mut Cx<'_, F>,
        rep: &CmRepRepr<'_>,
    ) -> Handled {
        match self.state {
            CmState::ReqSent | CmState::MraReqRcvd => {
                self.remote_known = true;
                self.remote_comm_id = rep.local_comm_id;
                self.remote_ca_guid = rep.local_ca_guid;
                self.remote_qpn = rep.local_qpn;
                self.remote_psn = rep.starting_psn;
                self.peer_rnr_retry = rep.rnr_retry_count;
                // The CM swaps the two sides' RDMA READ limits; never
                // exceed what this side advertised.
                self.params.initiator_depth =
                    self.params.initiator_depth.min(rep.responder_resources);
                self.params.responder_resources =
                    self.params.responder_resources.min(rep.initiator_depth);
                self.stash.set(rep.private_data);
                self.deadline = None;
                self.state = CmState::RepRcvd;
                self.start_qp(cx, QpOp::RtrRts);
                Ok(())
            }
            // The QP is still being set up: ask the peer to wait for RTU.
            CmState::RepRcvd => {
                self.send_mra(cx, CmMessageKind::Rep);
                Ok(())
            }
            // Linux `cm_dup_rep_handler`: the RTU was lost, repeat it.
            CmState::Established => {
                self.resend_last(cx);
                Ok(())
            }
            _ => Err(DropReason::UnexpectedInState),
        }
    }

    fn on_rtu<F: CmEffects + ?Sized>(
        &mut self,
        cx: &mut Cx<'_, F>,
        rtu: &CmRtuRepr<'_>,
    ) -> Handled {
        match self.state {
            CmState::RepSent | CmState::MraRepRcvd => {
                self.deadline = None;
                self.stash.set(rtu.private_data);
                self.state = CmState::RtuRcvd;
                self.start_qp(cx, QpOp::Rts);
                Ok(())
            }
            CmState::RtuRcvd | CmState::Established => Err(DropReason::Duplicate),
            _ => Err(DropReason::UnexpectedInState),
        }
    }

    fn on_comm_established<F: CmEffects + ?Sized>(&mut self, cx: &mut Cx<'_, F>) {
        // The RTU was lost (or is late) but the peer is sending: that is
        // as good as an RTU (IBA 12.9.7.2; Linux `ib_cm_notify`).
        self.deadline = None;
        self.stash.clear();
        self.state = CmState::RtuRcvd;
        self.start_qp(cx, QpOp::Rts);
    }

    fn on_mra<F: CmEffects + ?Sized>(
        &mut self,
        cx: &mut Cx<'_, F>,
        mra: &CmMraRepr<'_>,
    ) -> Handled {
        let extended = cx.cfg.response_timeout_ns(mra.service_timeout);
        match (self.state, mra.message_mraed) {
            (CmState::ReqSent | CmState::MraReqRcvd, CmMessageKind::Req) => {
                self.state = CmState::MraReqRcvd;
                self.arm(cx, extended);
                Ok(())
            }
            (CmState::RepSent | CmState::MraRepRcvd, CmMessageKind::Rep) => {
                self.state = CmState::MraRepRcvd;
                self.arm(cx, extended);
                Ok(())
            }
            _ => Err(DropReason::UnexpectedInState),
        }
    }

    fn on_rej<F: CmEffects + ?Sized>(
        &mut self,
        cx: &mut Cx<'_, F>,
        rej: &CmRejRepr<'_>,
    ) -> Handled {
        let terminal = Terminal::Rejected(rej.reason);
        match self.state {
            // Linux `cm_rej_handler`: a stale-connection REJ puts the id in
            // timewait, any other resets it.
            CmState::ReqSent | CmState::MraReqRcvd => {
                if rej.reason == RejectReason::StaleConn {
                    self.enter_timewait(cx);
                } else {
                    self.enter_closed(cx, false);
                }
                self.conclude(cx, terminal, rej.private_data, false);
                Ok(())
            }
            CmState::ReqRcvd | CmState::MraReqSent => {
                self.listener_withdrawn(cx, WithdrawnCause::Rejected(rej.reason));
                self.enter_closed(cx, false);
                Ok(())
            }
            CmState::RepRcvd
            | CmState::Accepting
            | CmState::RepSent
            | CmState::MraRepRcvd
            | CmState::RtuRcvd => {
                self.enter_timewait(cx);
                self.conclude(cx, terminal, rej.private_data, true);
                Ok(())
            }
            CmState::Established => {
                self.enter_timewait(cx);
                self.conclude(
                    cx,
                    Terminal::Disconnected(DisconnectCause::Remote),
                    rej.private_data,
                    true,
                );
                Ok(())
            }
            CmState::DreqSent => {
                self.enter_timewait(cx);
                Ok(())
            }
            CmState::TimeWait | CmState::Closed => Err(DropReason::UnexpectedInState),
        }
    }

    fn on_dreq<F: CmEffects + ?Sized>(
        &mut self,
        cx: &mut Cx<'_, F>,
        tid: u64,
        dreq: &CmDreqRepr<'_>,
    ) -> Handled {
        match self.state {
            // The RTU may have been lost with the peer already established
            // and now leaving (Linux accepts DREQ in REP_SENT too).
            CmState::Established | CmState::RtuRcvd | CmState::RepSent | CmState::MraRepRcvd => {
                self.peer_dreq_tid = tid;
                self.send_drep(cx, tid);
                self.enter_timewait(cx);
                self.conclude(
                    cx,
                    Terminal::Disconnected(DisconnectCause::Remote),
                    dreq.private_data,
                    true,
                );
                Ok(())
            }
            // Both sides disconnect at once: answer and wait out timewait.
            CmState::DreqSent => {
                self.peer_dreq_tid = tid;
                self.send_drep(cx, tid);
                self.enter_timewait(cx);
                Ok(())
            }
            // Our DREP was lost: repeat it.
            CmState::TimeWait => {
                self.send_drep(cx, tid);
                Ok(())
            }
            _ => Err(DropReason::UnexpectedInState),
        }
    }

    fn on_drep<F: CmEffects + ?Sized>(&mut self, cx: &mut Cx<'_, F>) -> Handled {
        match self.state {
            CmState::DreqSent => {
                self.enter_timewait(cx);
                Ok(())
            }
            CmState::TimeWait => Err(DropReason::Duplicate),
            _ => Err(DropReason::UnexpectedInState),
        }
    }

    fn on_deadline<F: CmEffects + ?Sized>(&mut self, cx: &mut Cx<'_, F>) {
        self.deadline = None;
        match self.state {
            CmState::ReqSent | CmState::MraReqRcvd => {
                if self.retries_left > 0 {
                    self.retries_left -= 1;
                    self.resend_last(cx);
                    cx.stats.retransmissions += 1;
                    self.state = CmState::ReqSent;
                    self.arm(cx, self.response_timeout_ns);
                } else {
                    cx.stats.timeouts += 1;
                    // Tell a peer that did get the REQ to let go too.
                    self.send_rej(
                        cx,
                        RejectReason::Timeout,
                        CmMessageKind::Other,
                        true,
                        &[],
                        false,
                    );
                    self.enter_closed(cx, false);
                    self.conclude(
                        cx,
                        Terminal::Unreachable(UnreachableCause::Timeout),
                        &[],
                        false,
                    );
                }
            }
            CmState::ReqRcvd | CmState::MraReqSent => {
                cx.stats.timeouts += 1;
                self.send_rej(
                    cx,
                    RejectReason::Timeout,
                    CmMessageKind::Req,
                    true,
                    &[],
                    true,
                );
                self.enter_closed(cx, true);
                self.listener_withdrawn(cx, WithdrawnCause::TimedOut);
            }
            CmState::RepSent | CmState::MraRepRcvd => {
                if self.retries_left > 0 {
                    self.retries_left -= 1;
                    self.resend_last(cx);
                    cx.stats.retransmissions += 1;
                    self.state = CmState::RepSent;
                    self.arm(cx, self.response_timeout_ns);
                } else {
                    cx.stats.timeouts += 1;
                    self.send_rej(
                        cx,
                        RejectReason::Timeout,
                        CmMessageKind::Other,
                        true,
                        &[],
                        false,
                    );
                    self.enter_timewait(cx);
                    self.conclude(
                        cx,
                        Terminal::Unreachable(UnreachableCause::Timeout),
                        &[],
                        true,
                    );
                }
            }
            CmState::DreqSent => {
                if self.retries_left > 0 {
                    self.retries_left -= 1;
                    self.resend_last(cx);
                    cx.stats.retransmissions += 1;
                    self.arm(cx, self.response_timeout_ns);
                } else {
                    // Linux: DREQ timeout → timewait, as if answered.
                    cx.stats.timeouts += 1;
                    self.enter_timewait(cx);
                }
            }
            CmState::TimeWait | CmState::Closed => self.enter_closed(cx, false),
            CmState::RepRcvd | CmState::Accepting | CmState::RtuRcvd | CmState::Established => {}
        }
    }

    fn on_qp_modified<F: CmEffects + ?Sized>(&mut self, cx: &mut Cx<'_, F>, op: QpOp, ok: bool) {
        match (op, self.state) {
            (QpOp::Error, _) => self.qp_in_error = true,
            (QpOp::RtrRts, CmState::RepRcvd) => {
                if ok {
                    self.send_rtu(cx);
                    self.deliver_established(cx);
                } else {
                    // Linux `cma_rep_recv` failure: REJ, consumer defined.
                    self.send_rej(
                        cx,
                        RejectReason::ConsumerDefined,
                        CmMessageKind::Rep,
                        true,
                        &[],
                        false,
                    );
                    self.enter_timewait(cx);
                    self.conclude(
                        cx,
                        Terminal::Unreachable(UnreachableCause::QpTransitionFailed),
                        &[],
                        true,
                    );
                }
            }
            (QpOp::Rtr, CmState::Accepting) => {
                if ok {
                    self.send_rep(cx);
                    self.state = CmState::RepSent;
                    self.retries_left = self.max_retries;
                    self.arm(cx, self.response_timeout_ns);
                } else {
                    self.send_rej(
                        cx,
                        RejectReason::ConsumerDefined,
                        CmMessageKind::Req,
                        true,
                        &[],
                        true,
                    );
                    self.enter_closed(cx, true);
                    self.conclude(
                        cx,
                        Terminal::Unreachable(UnreachableCause::QpTransitionFailed),
                        &[],
                        true,
                    );
                }
            }
            (QpOp::Rts, CmState::RtuRcvd) => {
                if ok {
                    self.deliver_established(cx);
                } else {
                    // The peer thinks it is connected: take it down cleanly.
                    self.send_dreq(cx, &[]);
                    self.conclude(
                        cx,
                        Terminal::Unreachable(UnreachableCause::QpTransitionFailed),
                        &[],
                        true,
                    );
                }
            }
            // The connection moved on while the QP was busy (a REJ, DREQ or
            // disconnect came); `pump` finishes what that started.
            _ => {}
        }
        self.pump(cx);
    }

    fn disconnect<F: CmEffects + ?Sized>(&mut self, cx: &mut Cx<'_, F>, data: &[u8]) {
        let local = Terminal::Disconnected(DisconnectCause::Local);
        match self.state {
            // Linux `cm_destroy_id` in REQ_SENT: REJ(timeout) with the CA
            // GUID as ARI.
            CmState::ReqSent | CmState::MraReqRcvd => {
                self.send_rej(
                    cx,
                    RejectReason::Timeout,
                    CmMessageKind::Other,
                    true,
                    &[],
                    false,
                );
                self.enter_closed(cx, false);
                self.conclude(cx, local, &[], false);
            }
            CmState::RepRcvd => {
                self.send_rej(
                    cx,
                    RejectReason::ConsumerDefined,
                    CmMessageKind::Rep,
                    true,
                    &[],
                    false,
                );
                self.enter_timewait(cx);
                self.conclude(cx, local, &[], true);
            }
            CmState::Accepting => {
                self.send_rej(
                    cx,
                    RejectReason::ConsumerDefined,
                    CmMessageKind::Req,
                    true,
                    &[],
                    true,
                );
                self.enter_closed(cx, true);
                self.conclude(cx, local, &[], true);
            }
            CmState::RepSent | CmState::MraRepRcvd => {
                self.send_rej(
                    cx,
                    RejectReason::ConsumerDefined,
                    CmMessageKind::Other,
                    true,
                    &[],
                    false,
                );
                self.enter_timewait(cx);
                self.conclude(cx, local, &[], true);
            }
            CmState::RtuRcvd | CmState::Established => {
                self.send_dreq(cx, data);
                self.conclude(cx, local, &[], true);
            }
            // Not reachable with the consumer attached: those states follow
            // a terminal event.
            CmState::ReqRcvd
            | CmState::MraReqSent
            | CmState::DreqSent
            | CmState::TimeWait
            | CmState::Closed => {}
        }
    }

    /// The peer reconnected with this connection's QP: it is gone.
    fn disconnect_stale<F: CmEffects + ?Sized>(&mut self, cx: &mut Cx<'_, F>) {
        if self.state == CmState::Established {
            // Linux sends DREQ to the old connection (`cm_req_handler`).
            self.send_dreq(cx, &[]);
            self.conclude(
                cx,
                Terminal::Disconnected(DisconnectCause::Stale),
                &[],
                true,
            );
        }
    }
}

/// `Ok`: the message drove the connection (or was answered); `Err`: it was
/// dropped for this reason.
type Handled = Result<(), DropReason>;

/// The parts of the engine a connection's handlers use besides itself.
struct Cx<'a, F: CmEffects + ?Sized> {
    cfg: &'a CmConfig,
    stats: &'a mut CmStats,
    ids: &'a mut IdSource,
    fx: &'a mut F,
    now: u64,
}

impl<F: CmEffects + ?Sized> Cx<'_, F> {
    /// Emits and sends one CM MAD; keeps a copy in `store` if given.
    fn send(
        &mut self,
        to: &MadAddress,
        transaction_id: u64,
        message: CmMessage<'_>,
        store: Option<&mut SentMad>,
    ) {
        let mut buf = [0u8; MAD_LEN];
        let repr = CmMadRepr {
            transaction_id,
            attribute_modifier: 0,
            message,
        };
        match repr.emit(&mut buf) {
            Ok(_) => {
                self.fx.send_mad(to, &buf);
                self.stats.sent += 1;
                if let Some(stored) = store {
                    stored.valid = true;
                    stored.to = *to;
                    stored.bytes = buf;
                }
            }
            Err(_) => self.stats.emit_failures += 1,
        }
    }

    /// Sends a REJ for a message no connection owns (Linux `cm_issue_rej`):
    /// the REJ's IDs mirror the message's.
    fn reject_unmatched(
        &mut self,
        to: &MadAddress,
        tid: u64,
        local_comm_id: u32,
        remote_comm_id: u32,
        kind: CmMessageKind,
        reason: RejectReason,
    ) {
        let rej = CmRejRepr {
            local_comm_id,
            remote_comm_id,
            message_rejected: kind,
            reason,
            ari: &[],
            private_data: &[],
        };
        self.send(to, tid, CmMessage::Rej(rej), None);
        self.stats.rejects_sent += 1;
    }

    fn drop_mad(
        &mut self,
        reason: DropReason,
        from: &MadAddress,
        mad: &[u8],
        local_comm_id: Option<u32>,
    ) {
        self.stats.count_drop(reason);
        let header = MadHeader::new_checked(mad).ok();
        self.fx.dropped(&DroppedMad {
            reason,
            from: *from,
            attribute_id: header.as_ref().map_or(0, MadHeader::attribute_id),
            transaction_id: header.as_ref().map_or(0, MadHeader::transaction_id),
            local_comm_id,
        });
    }
}

#[derive(Clone, Copy)]
struct ListenerSlot {
    generation: u16,
    in_use: bool,
    service_id: ServiceId,
    kind: ListenKind,
}

/// The CM protocol engine for one port (see the [module docs](self)).
pub struct CmEngine {
    cfg: CmConfig,
    slots: Box<[Slot]>,
    listeners: Box<[ListenerSlot]>,
    stats: CmStats,
    ids: IdSource,
}

impl core::fmt::Debug for CmEngine {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("CmEngine")
            .field("local_gid", &self.cfg.local_gid)
            .field("connections", &self.slots.len())
            .field("in_use", &self.connections_in_use())
            .finish_non_exhaustive()
    }
}

impl CmEngine {
    /// An engine for the port `config` describes, with all its tables.
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL` (it allocates).
    pub fn new(config: CmConfig) -> CmEngine {
        let connections = config.connections.clamp(1, usize::from(u16::MAX));
        let listeners = config.listeners.clamp(1, usize::from(u16::MAX));
        let slots = (0..connections)
            .map(|i| Slot::empty(u16::try_from(i).unwrap_or(u16::MAX)))
            .collect::<Vec<_>>()
            .into_boxed_slice();
        let listeners = (0..listeners)
            .map(|_| ListenerSlot {
                generation: 1,
                in_use: false,
                service_id: ServiceId(0),
                kind: ListenKind::IbCm,
            })
            .collect::<Vec<_>>()
            .into_boxed_slice();
        CmEngine {
            cfg: config,
            slots,
            listeners,
            stats: CmStats::default(),
            ids: IdSource::new(config.seed),
        }
    }

    /// The configuration.
    ///
    /// # IRQL
    ///
    /// Any.
    pub fn config(&self) -> &CmConfig {
        &self.cfg
    }

    /// The counters.
    ///
    /// # IRQL
    ///
    /// Any.
    pub fn stats(&self) -> &CmStats {
        &self.stats
    }

    /// Connection slots in use (timewait and lingering ones included).
    ///
    /// # IRQL
    ///
    /// Any (a scan of the table, no lock).
    pub fn connections_in_use(&self) -> usize {
        self.slots.iter().filter(|s| s.in_use).count()
    }

    /// Listeners in use.
    ///
    /// # IRQL
    ///
    /// Any.
    pub fn listeners_in_use(&self) -> usize {
        self.listeners.iter().filter(|l| l.in_use).count()
    }

    /// The state of connection `id`, or `None` if the handle is stale.
    ///
    /// # IRQL
    ///
    /// Any.
    pub fn state(&self, id: CmId) -> Option<CmState> {
        self.slot(id).map(|s| s.state)
    }

    /// The local communication ID of connection `id`.
    ///
    /// # IRQL
    ///
    /// Any.
    pub fn local_comm_id(&self, id: CmId) -> Option<u32> {
        self.slot(id).map(|s| s.local_comm_id)
    }

    /// The listener at table index `index`, if one listens there.
    ///
    /// # IRQL
    ///
    /// Any.
    pub fn listener_id(&self, index: usize) -> Option<ListenerId> {
        self.listeners
            .get(index)
            .filter(|l| l.in_use)
            .map(|l| ListenerId::new(u16::try_from(index).unwrap_or(u16::MAX), l.generation))
    }

    /// The connection in slot `slot`, if the slot is in use.
    ///
    /// # IRQL
    ///
    /// Any.
    pub fn id_of_slot(&self, slot: usize) -> Option<CmId> {
        self.slots.get(slot).filter(|s| s.in_use).map(Slot::id)
    }

    /// The earliest deadline of any connection: call
    /// [`CmEngine::on_timeout`] then.
    ///
    /// # IRQL
    ///
    /// Any (a scan of the table, no lock).
    pub fn next_deadline(&self) -> Option<u64> {
        self.slots
            .iter()
            .filter(|s| s.in_use)
            .filter_map(|s| s.deadline)
            .min()
    }

    fn slot(&self, id: CmId) -> Option<&Slot> {
        self.slots
            .get(id.slot())
            .filter(|s| s.in_use && s.generation == id.generation())
    }

    fn slot_index(&self, id: CmId) -> Option<usize> {
        self.slot(id).map(|_| id.slot())
    }

    /// Splits the engine into one slot and the context its handlers use.
    fn with_slot<'a, F: CmEffects + ?Sized, R>(
        &'a mut self,
        index: usize,
        now: u64,
        fx: &'a mut F,
        f: impl FnOnce(&mut Slot, &mut Cx<'a, F>) -> R,
    ) -> Option<R> {
        let CmEngine {
            cfg,
            slots,
            stats,
            ids,
            ..
        } = self;
        let slot = slots.get_mut(index)?;
        let mut cx = Cx {
            cfg,
            stats,
            ids,
            fx,
            now,
        };
        let result = f(slot, &mut cx);
        if slot.is_finished() {
            slot.release();
        }
        Some(result)
    }

    fn free_slot<F: CmEffects + ?Sized>(&self, fx: &F) -> Option<usize> {
        self.slots
            .iter()
            .enumerate()
            .position(|(i, s)| !s.in_use && fx.slot_reusable(i))
    }

    /// The slot whose local communication ID is `comm_id`.
    fn find_local(&self, comm_id: u32) -> Option<usize> {
        let plain = comm_id ^ self.ids.comm_id_salt;
        let index = usize::from(u16::try_from(plain & 0xffff).unwrap_or(u16::MAX));
        self.slots
            .get(index)
            .filter(|s| s.in_use && s.local_comm_id == comm_id)
            .map(|_| index)
    }

    /// The slot that already knows this peer communication (duplicates).
    fn find_remote(&self, remote_comm_id: u32, remote_ca_guid: u64) -> Option<usize> {
        self.slots.iter().position(|s| {
            s.in_use
                && s.remote_known
                && s.remote_comm_id == remote_comm_id
                && s.remote_ca_guid == remote_ca_guid
        })
    }

    /// A live slot bound to the peer's QP `qpn` on CA `guid` (stale
    /// detection, Linux `cm_insert_remote_qpn`).
    fn find_remote_qp(&self, qpn: Qpn, guid: u64, except: Option<usize>) -> Option<usize> {
        self.slots.iter().enumerate().position(|(i, s)| {
            Some(i) != except
                && s.in_use
                && s.remote_known
                && s.state != CmState::Closed
                && s.remote_qpn == qpn
                && s.remote_ca_guid == guid
        })
    }

    // ---- consumer calls ---------------------------------------------------

    /// Starts an active connection: sends the REQ and returns at once. The
    /// outcome arrives as events for the returned id.
    ///
    /// # Errors
    ///
    /// [`CmError::PrivateDataTooLong`] (above 92 bytes),
    /// [`CmError::InvalidParameter`], [`CmError::NoFreeSlot`].
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL` (no allocation).
    pub fn connect<F: CmEffects + ?Sized>(
        &mut self,
        now: u64,
        request: &ConnectRequest<'_>,
        fx: &mut F,
    ) -> Result<CmId, CmError> {
        if request.private_data.len() > limits::REQ {
            return Err(CmError::PrivateDataTooLong(limits::REQ));
        }
        request.params.check()?;
        request
            .path
            .check()
            .map_err(|_| CmError::InvalidParameter("path field out of range"))?;
        let index = self.free_slot(fx).ok_or(CmError::NoFreeSlot)?;
        let salt = self.ids.comm_id_salt;
        let id = self.with_slot(index, now, fx, |slot, cx| {
            slot.open(Role::Active, Consumer::Attached, salt);
            slot.peer = request.peer;
            slot.service_id = request.service_id;
            slot.local_qpn = request.qp.qpn;
            slot.local_psn = request.qp.starting_psn.unwrap_or_else(|| cx.ids.next_psn());
            slot.req_tid = cx.ids.next_tid();
            slot.path = request.path;
            slot.path_mtu = request.path_mtu.min(cx.cfg.port_mtu);
            slot.params = request.params;
            slot.retry_count = request.params.retry_count;
            slot.response_timeout_ns = cx.cfg.response_timeout_ns(cx.cfg.cm_response_timeout);
            slot.max_retries = cx.cfg.max_cm_retries.min(15);
            slot.retries_left = slot.max_retries;
            let req = CmReqRepr {
                local_comm_id: slot.local_comm_id,
                vendor_id: 0,
                service_id: request.service_id,
                local_ca_guid: cx.cfg.local_ca_guid,
                local_qkey: 0,
                local_qpn: request.qp.qpn,
                responder_resources: request.params.responder_resources,
                local_eecn: Eecn::from_low_bits(0),
                initiator_depth: request.params.initiator_depth,
                remote_eecn: Eecn::from_low_bits(0),
                remote_cm_response_timeout: cx.cfg.cm_response_timeout,
                transport_service_type: TransportServiceType::Rc,
                end_to_end_flow_control: request.params.flow_control,
                starting_psn: slot.local_psn,
                local_cm_response_timeout: cx.cfg.cm_response_timeout,
                retry_count: request.params.retry_count,
                pkey: DEFAULT_PKEY,
                path_mtu: slot.path_mtu,
                rdc_exists: false,
                rnr_retry_count: request.params.rnr_retry_count,
                max_cm_retries: slot.max_retries,
                srq: request.params.srq,
                extended_transport_type: 0,
                primary_path: request.path,
                alternate_path: None,
                sap_supported: false,
                private_data: request.private_data,
            };
            cx.send(
                &request.peer,
                slot.req_tid,
                CmMessage::Req(req),
                Some(&mut slot.last_sent),
            );
            slot.state = CmState::ReqSent;
            slot.arm(cx, slot.response_timeout_ns);
            slot.id()
        });
        id.ok_or(CmError::NoFreeSlot)
    }

    /// Listens on `service_id`: REQs naming it go to the listener's
    /// consumer as [`ListenEvent::Request`].
    ///
    /// # Errors
    ///
    /// [`CmError::AlreadyListening`], [`CmError::NoFreeListener`].
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    pub fn listen(
        &mut self,
        service_id: ServiceId,
        kind: ListenKind,
    ) -> Result<ListenerId, CmError> {
        if self
            .listeners
            .iter()
            .any(|l| l.in_use && l.service_id == service_id)
        {
            return Err(CmError::AlreadyListening);
        }
        let (index, entry) = self
            .listeners
            .iter_mut()
            .enumerate()
            .find(|(_, l)| !l.in_use)
            .ok_or(CmError::NoFreeListener)?;
        entry.in_use = true;
        entry.service_id = service_id;
        entry.kind = kind;
        Ok(ListenerId::new(
            u16::try_from(index).unwrap_or(u16::MAX),
            entry.generation,
        ))
    }

    /// Stops listening. Requests the consumer has not answered are
    /// rejected (reason 8, invalid service ID); no listener event follows.
    ///
    /// # Errors
    ///
    /// [`CmError::UnknownId`].
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    pub fn unlisten<F: CmEffects + ?Sized>(
        &mut self,
        now: u64,
        listener: ListenerId,
        fx: &mut F,
    ) -> Result<(), CmError> {
        let entry = self
            .listeners
            .get_mut(listener.index())
            .filter(|l| l.in_use && l.generation == listener.generation())
            .ok_or(CmError::UnknownId)?;
        entry.in_use = false;
        entry.generation = entry.generation.wrapping_add(1).max(1);
        for index in 0..self.slots.len() {
            self.with_slot(index, now, fx, |slot, cx| {
                if slot.in_use
                    && slot.consumer == Consumer::Listener(listener)
                    && matches!(slot.state, CmState::ReqRcvd | CmState::MraReqSent)
                {
                    let reveal = slot.state == CmState::MraReqSent;
                    slot.send_rej(
                        cx,
                        RejectReason::InvalidServiceId,
                        CmMessageKind::Req,
                        reveal,
                        &[],
                        true,
                    );
                    slot.consumer = Consumer::Detached;
                    slot.enter_closed(cx, true);
                }
            });
        }
        Ok(())
    }

    /// Accepts a request: the QP goes to RTR, then the REP goes out. The
    /// outcome arrives as events for `id`.
    ///
    /// # Errors
    ///
    /// [`CmError::UnknownId`] (stale handle, withdrawn request),
    /// [`CmError::WrongState`] (not an unanswered request),
    /// [`CmError::PrivateDataTooLong`] (above 196 bytes),
    /// [`CmError::InvalidParameter`].
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    pub fn accept<F: CmEffects + ?Sized>(
        &mut self,
        now: u64,
        id: CmId,
        accept: &AcceptRequest<'_>,
        fx: &mut F,
    ) -> Result<(), CmError> {
        let index = self.slot_index(id).ok_or(CmError::UnknownId)?;
        if accept.private_data.len() > limits::REP {
            return Err(CmError::PrivateDataTooLong(limits::REP));
        }
        accept.params.check()?;
        self.with_slot(index, now, fx, |slot, cx| {
            slot.check_unanswered()?;
            slot.consumer = Consumer::Attached;
            slot.local_qpn = accept.qp.qpn;
            slot.local_psn = accept.qp.starting_psn.unwrap_or_else(|| cx.ids.next_psn());
            slot.params = ConnParams {
                responder_resources: accept
                    .params
                    .responder_resources
                    .min(slot.peer_initiator_depth),
                initiator_depth: accept
                    .params
                    .initiator_depth
                    .min(slot.peer_responder_resources),
                ..accept.params
            };
            slot.stash.set(accept.private_data);
            slot.deadline = None;
            slot.state = CmState::Accepting;
            slot.start_qp(cx, QpOp::Rtr);
            Ok(())
        })
        .unwrap_or(Err(CmError::UnknownId))
    }

    /// Rejects a request with `reason` (SRP/iSER: 28, consumer defined)
    /// and REJ private data (SRP: `SRP_LOGIN_REJ`). No event follows.
    ///
    /// # Errors
    ///
    /// [`CmError::UnknownId`], [`CmError::WrongState`],
    /// [`CmError::PrivateDataTooLong`] (above 148 bytes).
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    pub fn reject<F: CmEffects + ?Sized>(
        &mut self,
        now: u64,
        id: CmId,
        reason: RejectReason,
        private_data: &[u8],
        fx: &mut F,
    ) -> Result<(), CmError> {
        let index = self.slot_index(id).ok_or(CmError::UnknownId)?;
        if private_data.len() > limits::REJ {
            return Err(CmError::PrivateDataTooLong(limits::REJ));
        }
        self.with_slot(index, now, fx, |slot, cx| {
            slot.check_unanswered()?;
            // Linux `cm_format_rej`: the local ID stays hidden (0) unless an
            // MRA has already revealed it.
            let reveal = slot.state == CmState::MraReqSent;
            slot.send_rej(cx, reason, CmMessageKind::Req, reveal, private_data, true);
            slot.consumer = Consumer::Detached;
            slot.enter_closed(cx, true);
            Ok(())
        })
        .unwrap_or(Err(CmError::UnknownId))
    }

    /// Ends a connection, or abandons its setup. Returns at once; the
    /// terminal event ([`CmEvent::Disconnected`] with
    /// [`DisconnectCause::Local`]) follows once the QP is in ERR — without
    /// waiting for the peer's DREP or for timewait.
    ///
    /// # Errors
    ///
    /// [`CmError::UnknownId`], [`CmError::WrongState`] (a request not yet
    /// accepted: use `reject`), [`CmError::Closing`] (the terminal event is
    /// already on its way), [`CmError::PrivateDataTooLong`] (above 220).
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    pub fn disconnect<F: CmEffects + ?Sized>(
        &mut self,
        now: u64,
        id: CmId,
        private_data: &[u8],
        fx: &mut F,
    ) -> Result<(), CmError> {
        let index = self.slot_index(id).ok_or(CmError::UnknownId)?;
        if private_data.len() > limits::DREQ {
            return Err(CmError::PrivateDataTooLong(limits::DREQ));
        }
        self.with_slot(index, now, fx, |slot, cx| match slot.consumer {
            Consumer::Listener(_) => Err(CmError::WrongState),
            Consumer::Detached => Err(CmError::UnknownId),
            Consumer::Attached if slot.terminal.is_some() => Err(CmError::Closing),
            Consumer::Attached => {
                slot.disconnect(cx, private_data);
                Ok(())
            }
        })
        .unwrap_or(Err(CmError::UnknownId))
    }

    // ---- events from below ------------------------------------------------

    /// A QP modification asked for with [`CmEffects::modify_qp`] finished.
    /// Returns `false` if connection `id` had none outstanding (ignored).
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    pub fn on_qp_modified<F: CmEffects + ?Sized>(
        &mut self,
        now: u64,
        id: CmId,
        ok: bool,
        fx: &mut F,
    ) -> bool {
        let Some(index) = self.slot_index(id) else {
            return false;
        };
        self.with_slot(index, now, fx, |slot, cx| match slot.qp_op.take() {
            Some(op) => {
                slot.on_qp_modified(cx, op, ok);
                true
            }
            None => false,
        })
        .unwrap_or(false)
    }

    /// The QP `qpn` received its first packet in RTR ("communication
    /// established"): a passive connection still waiting for its RTU takes
    /// it as the RTU. Returns whether a connection took it.
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    pub fn on_comm_established<F: CmEffects + ?Sized>(
        &mut self,
        now: u64,
        qpn: Qpn,
        fx: &mut F,
    ) -> bool {
        let found = self.slots.iter().position(|s| {
            s.in_use
                && s.role == Role::Passive
                && s.local_qpn == qpn
                && s.qp_op.is_none()
                && matches!(s.state, CmState::RepSent | CmState::MraRepRcvd)
        });
        match found {
            Some(index) => self
                .with_slot(index, now, fx, |slot, cx| slot.on_comm_established(cx))
                .is_some(),
            None => false,
        }
    }

    /// Cuts the DREQ retries short: every connection waiting for a DREP
    /// enters timewait at once, as Linux's `cm_destroy_id` does for a
    /// connection in DREQ_SENT. For a port that is closing: its consumers
    /// had their terminal events when they disconnected, and a peer that
    /// never answers a DREQ (LIO's isert, for a connection whose login the
    /// initiator refused) would otherwise hold the slot for the whole retry
    /// budget (`max_cm_retries` CM timeouts, ~100 s with Linux's timing).
    /// Returns how many it cut short.
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    pub fn end_disconnect_retries<F: CmEffects + ?Sized>(&mut self, now: u64, fx: &mut F) -> usize {
        let mut ended = 0;
        for index in 0..self.slots.len() {
            let waiting = self
                .slots
                .get(index)
                .is_some_and(|s| s.in_use && s.state == CmState::DreqSent);
            if waiting {
                self.with_slot(index, now, fx, |slot, cx| slot.enter_timewait(cx));
                ended += 1;
            }
        }
        ended
    }

    /// Handles every deadline that is due at `now` (retransmissions, final
    /// timeouts, the end of timewait).
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    pub fn on_timeout<F: CmEffects + ?Sized>(&mut self, now: u64, fx: &mut F) {
        for index in 0..self.slots.len() {
            let due = self
                .slots
                .get(index)
                .is_some_and(|s| s.in_use && s.deadline.is_some_and(|d| d <= now));
            if due {
                self.with_slot(index, now, fx, |slot, cx| slot.on_deadline(cx));
            }
        }
    }

    /// Handles one received MAD from `from` (the sender's GID and source
    /// QP). Every MAD ends up driving a connection, answered, or dropped
    /// with a reason ([`CmEffects::dropped`]).
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    pub fn on_mad<F: CmEffects + ?Sized>(
        &mut self,
        now: u64,
        from: &MadAddress,
        mad: &[u8],
        fx: &mut F,
    ) {
        self.stats.received += 1;
        let parsed = match CmMadRepr::parse(mad) {
            Ok(parsed) => parsed,
            Err(error) => {
                self.on_unparsable(now, from, mad, error, fx);
                return;
            }
        };
        let tid = parsed.transaction_id;
        let outcome = match parsed.message {
            CmMessage::Req(req) => self.on_req(now, from, tid, &req, fx),
            CmMessage::Rep(rep) => self.on_rep(now, from, tid, &rep, fx),
            CmMessage::Rtu(rtu) => self.dispatch(
                now,
                from,
                rtu.remote_comm_id,
                Match {
                    sender: Some(rtu.local_comm_id),
                    role: Some(Role::Passive),
                    tid: Some(MatchTid::Req(tid)),
                },
                fx,
                |slot, cx| slot.on_rtu(cx, &rtu),
            ),
            CmMessage::Mra(mra) => {
                let role = match mra.message_mraed {
                    CmMessageKind::Req => Some(Role::Active),
                    CmMessageKind::Rep => Some(Role::Passive),
                    CmMessageKind::Other => None,
                };
                match role {
                    Some(role) => self.dispatch(
                        now,
                        from,
                        mra.remote_comm_id,
                        Match {
                            sender: Some(mra.local_comm_id),
                            role: Some(role),
                            tid: Some(MatchTid::Req(tid)),
                        },
                        fx,
                        |slot, cx| slot.on_mra(cx, &mra),
                    ),
                    // LAP is not supported, so an MRA of "other" answers
                    // nothing this CM sent.
                    None => Err((DropReason::UnexpectedInState, None)),
                }
            }
            CmMessage::Rej(rej) => self.on_rej(now, from, &rej, fx),
            CmMessage::Dreq(dreq) => self.on_dreq(now, from, tid, &dreq, fx),
            CmMessage::Drep(drep) => self.dispatch(
                now,
                from,
                drep.remote_comm_id,
                Match {
                    sender: Some(drep.local_comm_id),
                    role: None,
                    tid: Some(MatchTid::Dreq(tid)),
                },
                fx,
                |slot, cx| slot.on_drep(cx),
            ),
        };
        if let Err((reason, local)) = outcome {
            let mut cx = self.cx(now, fx);
            cx.drop_mad(reason, from, mad, local);
        }
    }

    fn cx<'a, F: CmEffects + ?Sized>(&'a mut self, now: u64, fx: &'a mut F) -> Cx<'a, F> {
        Cx {
            cfg: &self.cfg,
            stats: &mut self.stats,
            ids: &mut self.ids,
            fx,
            now,
        }
    }

    fn on_unparsable<F: CmEffects + ?Sized>(
        &mut self,
        now: u64,
        from: &MadAddress,
        mad: &[u8],
        error: crate::wire::Error,
        fx: &mut F,
    ) {
        let mut cx = self.cx(now, fx);
        // A REQ with a reserved path MTU is still readable enough to
        // answer: REJ(invalid MTU) rather than leave the peer retrying.
        if let (crate::wire::Error::BadPathMtu(_), Some(header)) =
            (error, MadHeader::new_checked(mad).ok())
        {
            if header.attribute_id() == attribute::REQ {
                let body = header.data();
                let req = crate::wire::CmReq::new_unchecked(body);
                cx.reject_unmatched(
                    from,
                    header.transaction_id(),
                    0,
                    req.local_comm_id(),
                    CmMessageKind::Req,
                    RejectReason::InvalidMtu,
                );
            }
        }
        cx.drop_mad(DropReason::from_wire(error), from, mad, None);
    }

    /// Finds the connection a message names by `local_comm_id` (the
    /// receiver's ID in the message) and checks the sender before handing
    /// it the message.
    fn dispatch<F: CmEffects + ?Sized>(
        &mut self,
        now: u64,
        from: &MadAddress,
        local_comm_id: u32,
        rules: Match,
        fx: &mut F,
        handle: impl FnOnce(&mut Slot, &mut Cx<'_, F>) -> Handled,
    ) -> Result<(), (DropReason, Option<u32>)> {
        let index = self
            .find_local(local_comm_id)
            .ok_or((DropReason::UnknownConnection, None))?;
        self.dispatch_to(now, from, index, rules, fx, handle)
    }

    fn dispatch_to<F: CmEffects + ?Sized>(
        &mut self,
        now: u64,
        from: &MadAddress,
        index: usize,
        rules: Match,
        fx: &mut F,
        handle: impl FnOnce(&mut Slot, &mut Cx<'_, F>) -> Handled,
    ) -> Result<(), (DropReason, Option<u32>)> {
        self.with_slot(index, now, fx, |slot, cx| {
            let local = Some(slot.local_comm_id);
            rules.check(slot, from).map_err(|reason| (reason, local))?;
            handle(slot, cx).map_err(|reason| (reason, local))
        })
        .unwrap_or(Err((DropReason::UnknownConnection, None)))
    }

    fn on_req<F: CmEffects + ?Sized>(
        &mut self,
        now: u64,
        from: &MadAddress,
        tid: u64,
        req: &CmReqRepr<'_>,
        fx: &mut F,
    ) -> Result<(), (DropReason, Option<u32>)> {
        // 1. A duplicate of a REQ already known (Linux cm_insert_remote_id).
        if let Some(index) = self.find_remote(req.local_comm_id, req.local_ca_guid) {
            return self.dispatch_to(now, from, index, Match::default(), fx, |slot, cx| {
                slot.on_dup_req(cx)
            });
        }
        // 2. The peer's QP is still bound to a connection here: stale
        //    (Linux cm_insert_remote_qpn): REJ, and DREQ to the old one.
        if let Some(old) = self.find_remote_qp(req.local_qpn, req.local_ca_guid, None) {
            let mut cx = self.cx(now, fx);
            cx.reject_unmatched(
                from,
                tid,
                0,
                req.local_comm_id,
                CmMessageKind::Req,
                RejectReason::StaleConn,
            );
            self.with_slot(old, now, fx, |slot, cx| slot.disconnect_stale(cx));
            return Ok(());
        }
        // 3. Someone must listen.
        let listener = self
            .listeners
            .iter()
            .enumerate()
            .find(|(_, l)| l.in_use && l.service_id == req.service_id)
            .map(|(i, l)| {
                (
                    ListenerId::new(u16::try_from(i).unwrap_or(u16::MAX), l.generation),
                    l.kind,
                )
            });
        let cfg = self.cfg;
        let mut cx = self.cx(now, fx);
        let refuse = |cx: &mut Cx<'_, F>, reason| {
            cx.reject_unmatched(from, tid, 0, req.local_comm_id, CmMessageKind::Req, reason);
            Ok(())
        };
        let Some((listener, kind)) = listener else {
            return refuse(&mut cx, RejectReason::InvalidServiceId);
        };
        // 4. What this port cannot do.
        if req.transport_service_type != TransportServiceType::Rc {
            return refuse(&mut cx, RejectReason::InvalidTransportType);
        }
        if req.path_mtu > cfg.port_mtu {
            return refuse(&mut cx, RejectReason::InvalidMtu);
        }
        if req.primary_path.remote_gid != cfg.local_gid {
            return refuse(&mut cx, RejectReason::InvalidGid);
        }
        let (rdma_cm, user_data) = match kind {
            ListenKind::IbCm => (None, req.private_data),
            ListenKind::RdmaCm => match rdma_cm::check_incoming(req.private_data, cfg.local_gid) {
                Ok((header, user)) => (Some(header), user),
                // Linux: the RDMA/CM handler fails, the CM rejects with
                // reason 28 and no data.
                Err(_) => return refuse(&mut cx, RejectReason::ConsumerDefined),
            },
        };
        let Some(index) = self.free_slot(fx) else {
            let mut cx = self.cx(now, fx);
            return refuse(&mut cx, RejectReason::NoResources);
        };
        let salt = self.ids.comm_id_salt;
        self.with_slot(index, now, fx, |slot, cx| {
            slot.open(Role::Passive, Consumer::Listener(listener), salt);
            slot.peer = *from;
            slot.service_id = req.service_id;
            slot.remote_known = true;
            slot.remote_comm_id = req.local_comm_id;
            slot.remote_ca_guid = req.local_ca_guid;
            slot.remote_qpn = req.local_qpn;
            slot.remote_psn = req.starting_psn;
            slot.req_tid = tid;
            slot.path = CmPathRepr {
                local_lid: req.primary_path.remote_lid,
                remote_lid: req.primary_path.local_lid,
                local_gid: req.primary_path.remote_gid,
                remote_gid: req.primary_path.local_gid,
                ..req.primary_path
            };
            slot.path_mtu = req.path_mtu;
            slot.peer_responder_resources = req.responder_resources;
            slot.peer_initiator_depth = req.initiator_depth;
            slot.peer_rnr_retry = req.rnr_retry_count;
            slot.retry_count = req.retry_count;
            // How long the active side takes to answer our REP/DREQ.
            slot.response_timeout_ns = cx.cfg.response_timeout_ns(req.local_cm_response_timeout);
            slot.max_retries = req.max_cm_retries;
            slot.state = CmState::ReqRcvd;
            // The consumer must answer within the peer's patience.
            let patience = cx
                .cfg
                .response_timeout_ns(req.remote_cm_response_timeout)
                .saturating_mul(u64::from(req.max_cm_retries) + 1);
            slot.arm(cx, patience);
            let request = IncomingRequest {
                id: slot.id(),
                service_id: req.service_id,
                peer: *from,
                remote_qpn: req.local_qpn,
                remote_ca_guid: req.local_ca_guid,
                path_mtu: req.path_mtu,
                responder_resources: req.responder_resources,
                initiator_depth: req.initiator_depth,
                rdma_cm,
                private_data: user_data,
            };
            cx.fx
                .listener_event(listener, ListenEvent::Request(request));
        });
        Ok(())
    }

    fn on_rep<F: CmEffects + ?Sized>(
        &mut self,
        now: u64,
        from: &MadAddress,
        tid: u64,
        rep: &CmRepRepr<'_>,
        fx: &mut F,
    ) -> Result<(), (DropReason, Option<u32>)> {
        let Some(index) = self.find_local(rep.remote_comm_id) else {
            // Linux answers a REP it cannot place with REJ(invalid comm ID)
            // so the peer stops waiting for an RTU.
            let mut cx = self.cx(now, fx);
            cx.reject_unmatched(
                from,
                tid,
                rep.remote_comm_id,
                rep.local_comm_id,
                CmMessageKind::Rep,
                RejectReason::InvalidCommId,
            );
            return Err((DropReason::UnknownConnection, None));
        };
        let first = self
            .slots
            .get(index)
            .is_some_and(|s| matches!(s.state, CmState::ReqSent | CmState::MraReqRcvd));
        // Stale: the peer's QP is bound to another connection here.
        let stale = if first {
            self.find_remote_qp(rep.local_qpn, rep.local_ca_guid, Some(index))
        } else {
            None
        };
        let result = self.dispatch_to(
            now,
            from,
            index,
            Match {
                sender: Some(rep.local_comm_id),
                role: Some(Role::Active),
                tid: Some(MatchTid::Req(tid)),
            },
            fx,
            |slot, cx| match stale {
                None => slot.on_rep(cx, rep),
                Some(_) => {
                    cx.reject_unmatched(
                        from,
                        tid,
                        slot.local_comm_id,
                        rep.local_comm_id,
                        CmMessageKind::Rep,
                        RejectReason::StaleConn,
                    );
                    slot.enter_closed(cx, false);
                    slot.conclude(
                        cx,
                        Terminal::Unreachable(UnreachableCause::StaleConnection),
                        &[],
                        false,
                    );
                    Ok(())
                }
            },
        );
        if let (Ok(()), Some(old)) = (result, stale) {
            self.with_slot(old, now, fx, |slot, cx| slot.disconnect_stale(cx));
        }
        result
    }

    fn on_rej<F: CmEffects + ?Sized>(
        &mut self,
        now: u64,
        from: &MadAddress,
        rej: &CmRejRepr<'_>,
        fx: &mut F,
    ) -> Result<(), (DropReason, Option<u32>)> {
        // Linux `cm_acquire_rejected_id`: a Timeout REJ names the sender
        // by its CA GUID (the ARI) and its own comm ID.
        let by_guid = match (rej.reason, rej.ari.get(..8)) {
            (RejectReason::Timeout, Some(ari)) => {
                let mut guid = [0u8; 8];
                guid.copy_from_slice(ari);
                self.find_remote(rej.local_comm_id, u64::from_be_bytes(guid))
            }
            _ => None,
        };
        let index = by_guid
            .or_else(|| self.find_local(rej.remote_comm_id))
            .ok_or((DropReason::UnknownConnection, None))?;
        let rules = Match {
            sender: Some(rej.local_comm_id),
            ..Match::default()
        };
        self.dispatch_to(now, from, index, rules, fx, |slot, cx| slot.on_rej(cx, rej))
    }

    fn on_dreq<F: CmEffects + ?Sized>(
        &mut self,
        now: u64,
        from: &MadAddress,
        tid: u64,
        dreq: &CmDreqRepr<'_>,
        fx: &mut F,
    ) -> Result<(), (DropReason, Option<u32>)> {
        let Some(index) = self.find_local(dreq.remote_comm_id) else {
            // Linux `cm_issue_drep`: let the peer finish its disconnect.
            let drep = CmDrepRepr {
                local_comm_id: dreq.remote_comm_id,
                remote_comm_id: dreq.local_comm_id,
                private_data: &[],
            };
            let mut cx = self.cx(now, fx);
            cx.send(from, tid, CmMessage::Drep(drep), None);
            return Err((DropReason::UnknownConnection, None));
        };
        let rules = Match {
            sender: Some(dreq.local_comm_id),
            ..Match::default()
        };
        self.dispatch_to(now, from, index, rules, fx, |slot, cx| {
            if dreq.remote_qpn != slot.local_qpn {
                return Err(DropReason::QpnMismatch);
            }
            slot.on_dreq(cx, tid, dreq)
        })
    }
}

/// Which transaction ID a message must carry.
#[derive(Clone, Copy, Debug)]
enum MatchTid {
    /// The REQ's (REP, RTU, MRA).
    Req(u64),
    /// This side's DREQ's (DREP).
    Dreq(u64),
}

/// What a message must agree with before its connection sees it.
#[derive(Clone, Copy, Debug, Default)]
struct Match {
    /// The sender's comm ID (checked once the peer's is known; 0 = unset).
    sender: Option<u32>,
    /// Only this side of a connection receives it.
    role: Option<Role>,
    /// The transaction it answers.
    tid: Option<MatchTid>,
}

impl Match {
    fn check(&self, slot: &Slot, from: &MadAddress) -> Result<(), DropReason> {
        if from.gid != slot.peer.gid {
            return Err(DropReason::WrongPeer);
        }
        if let Some(sender) = self.sender {
            if slot.remote_known && sender != 0 && sender != slot.remote_comm_id {
                return Err(DropReason::CommIdMismatch);
            }
        }
        if let Some(role) = self.role {
            if slot.role != role {
                return Err(DropReason::UnexpectedInState);
            }
        }
        let tid_ok = match self.tid {
            None => true,
            Some(MatchTid::Req(tid)) => tid == slot.req_tid,
            Some(MatchTid::Dreq(tid)) => tid == slot.dreq_tid,
        };
        if tid_ok {
            Ok(())
        } else {
            Err(DropReason::TidMismatch)
        }
    }
}
