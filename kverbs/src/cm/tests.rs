//! Unit tests of the CM engine: scenarios over a virtual wire between two
//! engines, every message in every state against a scripted peer, golden
//! bytes of the REQ/REP/RTU exchange, malformed MADs, and a seeded
//! loss/duplication/reordering property.

use alloc::collections::VecDeque;
use alloc::string::{String, ToString};
use alloc::vec;
use alloc::vec::Vec;
use std::collections::BTreeMap;
use std::format;

use hca_lowlevel::wire::{Eecn, Gid, Ipv4Address, Psn, Qpn};

use super::rdma_cm::{RdmaCmEndpoints, ack_timeout_for};
use super::*;
use crate::wire::{
    CmDrepRepr, CmDreqRepr, CmMadRepr, CmMessage, CmMessageKind, CmMraRepr, CmPathRepr, CmRejRepr,
    CmRepRepr, CmReqRepr, CmRtuRepr, CmaHeaderRepr, IbTimeout, MAD_LEN, PathMtu, PortSpace,
    RejectReason, ServiceId, TransportServiceType, attribute,
};

mod golden;
mod malformed;
mod property;
mod table;

// ---- recording effects ------------------------------------------------------

/// A consumer event, owned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Ev {
    Established(Vec<u8>),
    Rejected(RejectReason, Vec<u8>),
    Unreachable(UnreachableCause),
    Disconnected(DisconnectCause, Vec<u8>),
}

impl Ev {
    fn is_terminal(&self) -> bool {
        !matches!(self, Ev::Established(_))
    }

    pub(super) fn name(&self) -> String {
        match self {
            Ev::Established(_) => "Established".into(),
            Ev::Rejected(r, _) => format!("Rejected({})", r.code()),
            Ev::Unreachable(c) => format!("Unreachable({c:?})"),
            Ev::Disconnected(c, _) => format!("Disconnected({c:?})"),
        }
    }
}

/// A listener event, owned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum LEv {
    Request {
        id: CmId,
        private_data: Vec<u8>,
        rdma_cm: Option<CmaHeaderRepr>,
        remote_qpn: Qpn,
        responder_resources: u8,
        initiator_depth: u8,
    },
    Withdrawn(CmId, WithdrawnCause),
}

#[derive(Default)]
pub(super) struct Rec {
    pub sent: Vec<(MadAddress, Vec<u8>)>,
    pub pending_qp: VecDeque<(CmId, Qpn, QpModify)>,
    pub qp_log: Vec<(CmId, Qpn, QpModify)>,
    pub events: Vec<(CmId, Ev)>,
    pub lev: Vec<(ListenerId, LEv)>,
    pub drops: Vec<DroppedMad>,
}

impl CmEffects for Rec {
    fn send_mad(&mut self, to: &MadAddress, mad: &[u8; MAD_LEN]) {
        self.sent.push((*to, mad.to_vec()));
    }

    fn modify_qp(&mut self, id: CmId, qpn: Qpn, modify: &QpModify) {
        assert!(
            !self.events.iter().any(|(i, e)| *i == id && e.is_terminal()),
            "QP modify for {id:?} after its terminal event"
        );
        assert!(
            !self.pending_qp.iter().any(|(i, _, _)| *i == id),
            "two QP modifies outstanding on {id:?}"
        );
        self.pending_qp.push_back((id, qpn, *modify));
        self.qp_log.push((id, qpn, *modify));
    }

    fn event(&mut self, id: CmId, event: CmEvent<'_>) {
        let ev = match event {
            CmEvent::Established { private_data } => Ev::Established(private_data.to_vec()),
            CmEvent::Rejected {
                reason,
                private_data,
            } => Ev::Rejected(reason, private_data.to_vec()),
            CmEvent::Unreachable { cause } => Ev::Unreachable(cause),
            CmEvent::Disconnected {
                cause,
                private_data,
            } => Ev::Disconnected(cause, private_data.to_vec()),
        };
        if ev.is_terminal() {
            assert!(
                !self.pending_qp.iter().any(|(i, _, _)| *i == id),
                "terminal event for {id:?} while its QP modify is outstanding"
            );
        }
        self.events.push((id, ev));
    }

    fn listener_event(&mut self, listener: ListenerId, event: ListenEvent<'_>) {
        let ev = match event {
            ListenEvent::Request(r) => LEv::Request {
                id: r.id,
                private_data: r.private_data.to_vec(),
                rdma_cm: r.rdma_cm,
                remote_qpn: r.remote_qpn,
                responder_resources: r.responder_resources,
                initiator_depth: r.initiator_depth,
            },
            ListenEvent::Withdrawn { id, cause } => LEv::Withdrawn(id, cause),
        };
        self.lev.push((listener, ev));
    }

    fn dropped(&mut self, drop: &DroppedMad) {
        self.drops.push(*drop);
    }
}

impl Rec {
    /// Events of one connection.
    pub(super) fn events_of(&self, id: CmId) -> Vec<Ev> {
        self.events
            .iter()
            .filter(|(i, _)| *i == id)
            .map(|(_, e)| e.clone())
            .collect()
    }

    /// The callback contract: per connection at most one Established,
    /// first if at all, at most one terminal, nothing after it.
    pub(super) fn check_contract(&self) {
        let mut per: BTreeMap<(usize, u16), Vec<&Ev>> = BTreeMap::new();
        for (id, ev) in &self.events {
            per.entry((id.slot(), id.generation()))
                .or_default()
                .push(ev);
        }
        for (id, evs) in per {
            let terminals = evs.iter().filter(|e| e.is_terminal()).count();
            assert!(terminals <= 1, "{id:?}: {evs:?}");
            if terminals == 1 {
                assert!(evs.last().unwrap().is_terminal(), "{id:?}: {evs:?}");
            }
            let established = evs
                .iter()
                .filter(|e| matches!(e, Ev::Established(_)))
                .count();
            assert!(established <= 1, "{id:?}: {evs:?}");
            if established == 1 {
                assert!(matches!(evs[0], Ev::Established(_)), "{id:?}: {evs:?}");
            }
        }
    }
}

pub(super) fn attr_name(mad: &[u8]) -> &'static str {
    match u16::from_be_bytes([mad[16], mad[17]]) {
        attribute::REQ => "REQ",
        attribute::REP => "REP",
        attribute::RTU => "RTU",
        attribute::REJ => "REJ",
        attribute::MRA => "MRA",
        attribute::DREQ => "DREQ",
        attribute::DREP => "DREP",
        _ => "?",
    }
}

// ---- configuration and requests ------------------------------------------

pub(super) const IP_A: Ipv4Address = Ipv4Address::new(10, 0, 0, 1);
pub(super) const IP_B: Ipv4Address = Ipv4Address::new(10, 0, 0, 2);
pub(super) const GUID_A: u64 = 0x0200_00ff_fe00_0001;
pub(super) const GUID_B: u64 = 0x0200_00ff_fe00_0002;
pub(super) const PORT: u16 = 5555;

/// Short (virtual) timeouts: response 4.2 ms + 2 × 1 ms, 3 retries.
pub(super) fn config(ip: Ipv4Address, guid: u64, seed: u64) -> CmConfig {
    CmConfig {
        packet_lifetime: IbTimeout::new(8).unwrap(),
        cm_response_timeout: IbTimeout::new(10).unwrap(),
        max_cm_retries: 3,
        mra_service_timeout: IbTimeout::new(14).unwrap(),
        timewait: IbTimeout::new(12).unwrap(),
        connections: 8,
        listeners: 2,
        seed,
        ..CmConfig::new(Gid::from_ipv4(ip), guid)
    }
}

pub(super) fn endpoints() -> RdmaCmEndpoints {
    RdmaCmEndpoints {
        port_space: PortSpace::Tcp,
        src: IP_A,
        src_port: 40000,
        dst: IP_B,
        dst_port: PORT,
    }
}

pub(super) fn service() -> ServiceId {
    endpoints().service_id()
}

pub(super) fn qpn(n: u32) -> Qpn {
    Qpn::new(n).unwrap()
}

pub(super) fn psn(n: u32) -> Psn {
    Psn::new(n).unwrap()
}

/// An RDMA/CM connect request from A to B with `user` data.
pub(super) fn connect_request<'a>(
    buf: &'a mut [u8; 92],
    user: &[u8],
    local_qpn: u32,
    start_psn: u32,
) -> ConnectRequest<'a> {
    let ep = endpoints();
    ep.req_private_data(user, buf).unwrap();
    ConnectRequest {
        service_id: ep.service_id(),
        peer: ep.peer(),
        path: ep.path(ack_timeout_for(IbTimeout::new(8).unwrap())),
        path_mtu: PathMtu::Mtu1024,
        qp: LocalQp {
            qpn: qpn(local_qpn),
            starting_psn: Some(psn(start_psn)),
        },
        params: ConnParams::SRP,
        private_data: &buf[..],
    }
}

pub(super) fn accept_request(data: &[u8], local_qpn: u32, start_psn: u32) -> AcceptRequest<'_> {
    AcceptRequest {
        qp: LocalQp {
            qpn: qpn(local_qpn),
            starting_psn: Some(psn(start_psn)),
        },
        params: ConnParams {
            initiator_depth: 2,
            ..ConnParams::SRP
        },
        private_data: data,
    }
}

// ---- two engines on a virtual wire -----------------------------------------

pub(super) struct Side {
    pub cm: CmEngine,
    pub rec: Rec,
    pub addr: MadAddress,
    /// Complete QP modifies as soon as they are asked for.
    pub auto_qp: bool,
    /// The result reported for QP modifies.
    pub qp_ok: bool,
}

/// A filter decides per MAD (sender index, bytes) whether it arrives.
type Filter = Box<dyn FnMut(usize, &[u8]) -> bool>;

pub(super) struct Net {
    pub sides: [Side; 2],
    pub now: u64,
    pub filter: Filter,
    /// MADs in flight: (receiver, sender address, bytes).
    pub wire: VecDeque<(usize, MadAddress, Vec<u8>)>,
    pub log: Vec<String>,
    /// Every MAD sent, by sender, in order (lost ones included).
    pub captured: Vec<(usize, Vec<u8>)>,
}

pub(super) const A: usize = 0;
pub(super) const B: usize = 1;

impl Net {
    pub(super) fn new(seed: u64) -> Net {
        let side = |ip, guid, seed| Side {
            cm: CmEngine::new(config(ip, guid, seed)),
            rec: Rec::default(),
            addr: MadAddress::cm(Gid::from_ipv4(ip)),
            auto_qp: true,
            qp_ok: true,
        };
        Net {
            sides: [side(IP_A, GUID_A, seed), side(IP_B, GUID_B, seed ^ 0x55)],
            now: 1_000,
            filter: Box::new(|_, _| true),
            wire: VecDeque::new(),
            log: Vec::new(),
            captured: Vec::new(),
        }
    }

    /// B listens on the RDMA/CM service.
    pub(super) fn listen_b(&mut self) -> ListenerId {
        self.sides[B]
            .cm
            .listen(service(), ListenKind::RdmaCm)
            .unwrap()
    }

    /// A connects to B (RDMA/CM, SRP-like parameters).
    pub(super) fn connect_a(&mut self, user: &[u8]) -> CmId {
        let mut buf = [0u8; 92];
        let req = connect_request(&mut buf, user, 0x100, 0x00_1234);
        let side = &mut self.sides[A];
        let id = side.cm.connect(self.now, &req, &mut side.rec).unwrap();
        self.pump();
        id
    }

    /// The latest request B's listener saw.
    pub(super) fn last_request_b(&self) -> CmId {
        self.sides[B]
            .rec
            .lev
            .iter()
            .rev()
            .find_map(|(_, e)| match e {
                LEv::Request { id, .. } => Some(*id),
                LEv::Withdrawn(..) => None,
            })
            .expect("no request at B")
    }

    pub(super) fn accept_b(&mut self, id: CmId, data: &[u8]) {
        let accept = accept_request(data, 0x200, 0x00_5678);
        let side = &mut self.sides[B];
        side.cm
            .accept(self.now, id, &accept, &mut side.rec)
            .unwrap();
        self.pump();
    }

    /// Moves MADs and QP completions until nothing moves at this time.
    pub(super) fn pump(&mut self) {
        for _ in 0..10_000 {
            let mut moved = false;
            for s in 0..2 {
                let sent = core::mem::take(&mut self.sides[s].rec.sent);
                for (to, mad) in sent {
                    moved = true;
                    let receiver = self.sides.iter().position(|x| x.addr.gid == to.gid);
                    let keep = (self.filter)(s, &mad);
                    self.captured.push((s, mad.clone()));
                    self.log.push(format!(
                        "{} {} {}{}",
                        ["A", "B"][s],
                        if s == A { "->" } else { "<-" },
                        attr_name(&mad),
                        if keep { "" } else { " (lost)" }
                    ));
                    if let (true, Some(r)) = (keep, receiver) {
                        self.wire.push_back((r, self.sides[s].addr, mad));
                    }
                }
                if self.sides[s].auto_qp {
                    while let Some((id, _, _)) = self.sides[s].rec.pending_qp.pop_front() {
                        moved = true;
                        let ok = self.sides[s].qp_ok;
                        let side = &mut self.sides[s];
                        assert!(side.cm.on_qp_modified(self.now, id, ok, &mut side.rec));
                    }
                }
            }
            if let Some((r, from, mad)) = self.wire.pop_front() {
                moved = true;
                let side = &mut self.sides[r];
                side.cm.on_mad(self.now, &from, &mad, &mut side.rec);
            }
            if !moved {
                return;
            }
        }
        panic!("the wire never went quiet");
    }

    /// Completes the QP modifies one side has outstanding now with `ok`
    /// (not those their completion asks for).
    pub(super) fn complete_qp(&mut self, s: usize, ok: bool) {
        let outstanding = core::mem::take(&mut self.sides[s].rec.pending_qp);
        for (id, _, _) in outstanding {
            let side = &mut self.sides[s];
            assert!(side.cm.on_qp_modified(self.now, id, ok, &mut side.rec));
        }
        self.pump();
    }

    /// Moves time to the next deadline of either side (at most `limit`
    /// ahead) and handles it; `false` if none is due within the limit.
    pub(super) fn step_time(&mut self, limit: u64) -> bool {
        let next = self.sides.iter().filter_map(|s| s.cm.next_deadline()).min();
        match next {
            Some(t) if t <= self.now.saturating_add(limit) => {
                self.now = self.now.max(t);
                for s in 0..2 {
                    let side = &mut self.sides[s];
                    side.cm.on_timeout(self.now, &mut side.rec);
                }
                self.pump();
                true
            }
            _ => false,
        }
    }

    /// Runs timers until none is due within `limit` of each other.
    pub(super) fn settle(&mut self, limit: u64) {
        for _ in 0..10_000 {
            if !self.step_time(limit) {
                return;
            }
        }
        panic!("timers never settled");
    }

    pub(super) fn events(&self, s: usize, id: CmId) -> Vec<Ev> {
        self.sides[s].rec.events_of(id)
    }

    pub(super) fn check_contract(&self) {
        for s in &self.sides {
            s.rec.check_contract();
        }
    }

    pub(super) fn lost(&self) -> usize {
        self.log.iter().filter(|l| l.ends_with("(lost)")).count()
    }
}

/// Long enough for every retry and timewait of the test configuration.
pub(super) const FOREVER: u64 = 60_000_000_000;

/// Drops the first `n` MADs named `attr` sent by `sender`.
pub(super) fn lose_first(sender: usize, attr: &'static str, n: usize) -> Filter {
    let mut left = n;
    Box::new(move |s, mad| {
        if s == sender && attr_name(mad) == attr && left > 0 {
            left -= 1;
            false
        } else {
            true
        }
    })
}

fn established_pair(net: &mut Net, user: &[u8], rep_data: &[u8]) -> (CmId, CmId) {
    net.listen_b();
    let a = net.connect_a(user);
    let b = net.last_request_b();
    net.accept_b(b, rep_data);
    (a, b)
}

// ---- scenarios --------------------------------------------------------------

#[test]
fn connect_accept_establish_with_linux_psn_rules() {
    let mut net = Net::new(1);
    let listener = net.listen_b();
    let a = net.connect_a(b"login-req");
    // B's listener saw the request with the consumer's data after the
    // RDMA/CM header, and the header itself.
    let (lid, request) = net.sides[B].rec.lev[0].clone();
    assert_eq!(lid, listener);
    let LEv::Request {
        id: b,
        private_data,
        rdma_cm,
        remote_qpn,
        responder_resources,
        initiator_depth,
    } = request
    else {
        panic!("not a request")
    };
    assert_eq!(private_data.len(), 56);
    assert_eq!(&private_data[..9], b"login-req");
    assert!(private_data[9..].iter().all(|b| *b == 0));
    assert_eq!(rdma_cm, Some(endpoints().header()));
    assert_eq!(remote_qpn, qpn(0x100));
    assert_eq!((responder_resources, initiator_depth), (4, 4));
    assert_eq!(net.sides[B].cm.state(b), Some(CmState::ReqRcvd));
    assert_eq!(net.sides[A].cm.state(a), Some(CmState::ReqSent));

    net.accept_b(b, b"login-rsp");
    assert_eq!(
        net.events(A, a),
        vec![Ev::Established({
            let mut d = b"login-rsp".to_vec();
            d.resize(196, 0);
            d
        })]
    );
    assert_eq!(net.events(B, b), vec![Ev::Established(vec![0; 224])]);
    assert_eq!(net.sides[A].cm.state(a), Some(CmState::Established));
    assert_eq!(net.sides[B].cm.state(b), Some(CmState::Established));
    let log: Vec<&str> = net.log.iter().map(String::as_str).collect();
    assert_eq!(log, ["A -> REQ", "B <- REP", "A -> RTU"]);

    // The QP programming: B goes to RTR before its REP, RTS after the RTU;
    // A goes to RTR and RTS on the REP. As in Linux's CM, each side expects
    // the starting PSN it advertised and sends from the peer's; READ limits
    // are swapped.
    let b_qp: Vec<_> = net.sides[B]
        .rec
        .qp_log
        .iter()
        .map(|(_, q, m)| (*q, *m))
        .collect();
    let [(q1, QpModify::ToRtr(b_rtr)), (q2, QpModify::ToRts(b_rts))] = b_qp[..] else {
        panic!("{b_qp:?}")
    };
    assert_eq!((q1, q2), (qpn(0x200), qpn(0x200)));
    assert_eq!(b_rtr.dest_qpn, qpn(0x100));
    assert_eq!(b_rtr.rq_psn, psn(0x5678), "B expects its own starting PSN");
    assert_eq!(b_rts.sq_psn, psn(0x1234), "B sends from A's");
    assert_eq!(b_rtr.path_mtu, PathMtu::Mtu1024);
    assert_eq!(b_rtr.av.dgid, Gid::from_ipv4(IP_A));
    assert_eq!(b_rtr.av.hop_limit, 64);
    // B's responder resources are bounded by A's initiator depth (4); B's
    // initiator depth is what B asked for (2) under A's responder
    // resources (4).
    assert_eq!(b_rtr.max_dest_rd_atomic, 4);
    assert_eq!(b_rts.max_rd_atomic, 2);
    assert_eq!(b_rts.retry_cnt, 7);
    assert_eq!(b_rts.rnr_retry, 7);
    assert_eq!(b_rts.timeout.exponent(), 9);
    let a_qp: Vec<_> = net.sides[A]
        .rec
        .qp_log
        .iter()
        .map(|(_, q, m)| (*q, *m))
        .collect();
    let [(q, QpModify::ToRtrAndRts(a_rtr, a_rts))] = a_qp[..] else {
        panic!("{a_qp:?}")
    };
    assert_eq!(q, qpn(0x100));
    assert_eq!(a_rtr.dest_qpn, qpn(0x200));
    assert_eq!(a_rtr.rq_psn, psn(0x1234), "A expects its own starting PSN");
    assert_eq!(a_rts.sq_psn, psn(0x5678), "A sends from B's");
    assert_eq!(a_rtr.av.dgid, Gid::from_ipv4(IP_B));
    // A's initiator depth: B's responder resources (4); A's responder
    // resources: B's initiator depth (2).
    assert_eq!(a_rts.max_rd_atomic, 4);
    assert_eq!(a_rtr.max_dest_rd_atomic, 2);
    net.check_contract();
}

#[test]
fn disconnect_reaches_both_sides_and_slots_are_released() {
    let mut net = Net::new(2);
    let (a, b) = established_pair(&mut net, b"x", b"y");
    let side = &mut net.sides[A];
    side.cm
        .disconnect(net.now, a, b"bye", &mut side.rec)
        .unwrap();
    net.pump();
    assert_eq!(
        net.events(A, a).last(),
        Some(&Ev::Disconnected(DisconnectCause::Local, vec![]))
    );
    let mut bye = b"bye".to_vec();
    bye.resize(220, 0);
    assert_eq!(
        net.events(B, b).last(),
        Some(&Ev::Disconnected(DisconnectCause::Remote, bye))
    );
    // Both QPs went to ERR before the terminal event.
    for s in [A, B] {
        assert!(matches!(
            net.sides[s].rec.qp_log.last(),
            Some((_, _, QpModify::ToError))
        ));
    }
    assert_eq!(net.sides[A].cm.state(a), Some(CmState::TimeWait));
    assert_eq!(net.sides[B].cm.state(b), Some(CmState::TimeWait));
    // The consumer's handle is dead at once, the slot lives through
    // timewait, then it is gone.
    let side = &mut net.sides[A];
    assert_eq!(
        side.cm.disconnect(net.now, a, &[], &mut side.rec),
        Err(CmError::UnknownId)
    );
    net.settle(FOREVER);
    assert_eq!(net.sides[A].cm.connections_in_use(), 0);
    assert_eq!(net.sides[B].cm.connections_in_use(), 0);
    assert_eq!(net.sides[A].cm.state(a), None);
    net.check_contract();
}

#[test]
fn reject_with_private_data() {
    let mut net = Net::new(3);
    net.listen_b();
    let a = net.connect_a(b"login");
    let b = net.last_request_b();
    let login_rej = [0xc2u8; 32];
    let side = &mut net.sides[B];
    side.cm
        .reject(
            net.now,
            b,
            RejectReason::ConsumerDefined,
            &login_rej,
            &mut side.rec,
        )
        .unwrap();
    net.pump();
    let mut expect = login_rej.to_vec();
    expect.resize(148, 0);
    assert_eq!(
        net.events(A, a),
        vec![Ev::Rejected(RejectReason::ConsumerDefined, expect)]
    );
    // A's slot is free at once; B's lingers to repeat its REJ.
    assert_eq!(net.sides[A].cm.connections_in_use(), 0);
    assert_eq!(net.sides[B].cm.state(b), Some(CmState::Closed));
    assert!(net.sides[B].rec.events.is_empty());
    assert!(net.sides[A].rec.qp_log.is_empty(), "the QP never left INIT");
    net.settle(FOREVER);
    assert_eq!(net.sides[B].cm.connections_in_use(), 0);
    net.check_contract();
}

#[test]
fn duplicate_req_after_reject_gets_the_same_rej() {
    let mut net = Net::new(4);
    net.listen_b();
    // A's REQ arrives, B rejects, the REJ is lost: A retransmits its REQ
    // and B repeats its REJ (not a new request to the listener).
    net.filter = lose_first(B, "REJ", 1);
    let a = net.connect_a(b"login");
    let b = net.last_request_b();
    let side = &mut net.sides[B];
    side.cm
        .reject(
            net.now,
            b,
            RejectReason::ConsumerDefined,
            &[7; 4],
            &mut side.rec,
        )
        .unwrap();
    net.pump();
    assert!(net.events(A, a).is_empty());
    assert!(net.step_time(FOREVER));
    assert!(matches!(
        net.events(A, a)[..],
        [Ev::Rejected(RejectReason::ConsumerDefined, ref d)] if d[..4] == [7; 4]
    ));
    assert_eq!(net.sides[B].rec.lev.len(), 1, "one request only");
    assert_eq!(net.sides[A].cm.stats().retransmissions, 1);
    net.check_contract();
}

#[test]
fn req_lost_is_retried() {
    let mut net = Net::new(5);
    net.listen_b();
    net.filter = lose_first(A, "REQ", 2);
    let a = net.connect_a(b"");
    assert!(net.sides[B].rec.lev.is_empty());
    net.step_time(FOREVER);
    net.step_time(FOREVER);
    let b = net.last_request_b();
    net.accept_b(b, &[]);
    assert!(matches!(net.events(A, a)[..], [Ev::Established(_)]));
    assert_eq!(net.sides[A].cm.stats().retransmissions, 2);
    assert_eq!(net.lost(), 2);
    net.check_contract();
}

#[test]
fn req_never_answered_times_out() {
    let mut net = Net::new(6);
    net.listen_b();
    net.filter = Box::new(|s, _| s != A);
    let a = net.connect_a(b"");
    net.settle(FOREVER);
    assert_eq!(
        net.events(A, a),
        vec![Ev::Unreachable(UnreachableCause::Timeout)]
    );
    // One REQ and three retries, then a REJ(timeout) for a peer that might
    // have heard the REQ.
    let sent: Vec<&str> = net.log.iter().map(|l| &l[5..8]).collect();
    assert_eq!(sent, ["REQ", "REQ", "REQ", "REQ", "REJ"]);
    let stats = net.sides[A].cm.stats();
    assert_eq!((stats.retransmissions, stats.timeouts), (3, 1));
    assert_eq!(net.sides[A].cm.connections_in_use(), 0);
    net.check_contract();
}

#[test]
fn rep_lost_is_repeated() {
    let mut net = Net::new(7);
    net.filter = lose_first(B, "REP", 1);
    let (a, b) = established_pair(&mut net, b"", b"rsp");
    assert!(net.events(A, a).is_empty());
    // A's REQ retry reaches B in RepSent: B repeats its REP at once.
    net.step_time(FOREVER);
    assert!(matches!(net.events(A, a)[..], [Ev::Established(_)]));
    assert!(matches!(net.events(B, b)[..], [Ev::Established(_)]));
    assert_eq!(net.lost(), 1);
    net.check_contract();
}

#[test]
fn rtu_lost_then_first_packet_establishes_the_passive_side() {
    let mut net = Net::new(8);
    net.filter = lose_first(A, "RTU", 1);
    let (a, b) = established_pair(&mut net, b"", b"");
    assert!(matches!(net.events(A, a)[..], [Ev::Established(_)]));
    assert!(net.events(B, b).is_empty());
    assert_eq!(net.sides[B].cm.state(b), Some(CmState::RepSent));
    // A sends data; B's QP, in RTR, reports communication established.
    let side = &mut net.sides[B];
    assert!(
        !side
            .cm
            .on_comm_established(net.now, qpn(0x999), &mut side.rec)
    );
    assert!(
        side.cm
            .on_comm_established(net.now, qpn(0x200), &mut side.rec)
    );
    net.pump();
    assert_eq!(net.events(B, b), vec![Ev::Established(vec![])]);
    // The late event is harmless.
    let side = &mut net.sides[B];
    assert!(
        !side
            .cm
            .on_comm_established(net.now, qpn(0x200), &mut side.rec)
    );
    net.check_contract();
}

#[test]
fn rtu_lost_then_rep_retry_gets_the_rtu_again() {
    let mut net = Net::new(9);
    net.filter = lose_first(A, "RTU", 1);
    let (a, b) = established_pair(&mut net, b"", b"");
    net.step_time(FOREVER);
    assert!(matches!(net.events(B, b)[..], [Ev::Established(_)]));
    assert!(matches!(net.events(A, a)[..], [Ev::Established(_)]));
    let log: Vec<&str> = net.log.iter().map(String::as_str).collect();
    assert_eq!(
        log,
        [
            "A -> REQ",
            "B <- REP",
            "A -> RTU (lost)",
            "B <- REP",
            "A -> RTU"
        ]
    );
    net.check_contract();
}

#[test]
fn mra_extends_the_requesters_patience() {
    let mut net = Net::new(10);
    net.listen_b();
    let a = net.connect_a(b"");
    let b = net.last_request_b();
    // B's consumer takes its time: A's retry arrives as a duplicate, B
    // answers MRA, A waits the MRA's service timeout instead of retrying.
    assert!(net.step_time(FOREVER));
    assert_eq!(net.sides[B].cm.state(b), Some(CmState::MraReqSent));
    assert_eq!(net.sides[A].cm.state(a), Some(CmState::MraReqRcvd));
    let before = net.sides[A].cm.next_deadline().unwrap();
    let cfg = net.sides[A].cm.config();
    let normal = cfg.response_timeout_ns(cfg.cm_response_timeout);
    assert!(
        before - net.now > normal * 10,
        "MRA service timeout applies"
    );
    // Several normal timeouts later A is still waiting; then B accepts.
    net.now += normal * 5;
    for s in 0..2 {
        let side = &mut net.sides[s];
        side.cm.on_timeout(net.now, &mut side.rec);
    }
    net.pump();
    assert_eq!(net.sides[A].cm.state(a), Some(CmState::MraReqRcvd));
    net.accept_b(b, &[]);
    assert!(matches!(net.events(A, a)[..], [Ev::Established(_)]));
    assert_eq!(net.sides[B].cm.stats().mras_sent, 1);
    net.check_contract();
}

#[test]
fn mra_for_rep_while_the_active_qp_is_slow() {
    let mut net = Net::new(11);
    net.sides[A].auto_qp = false;
    let (a, b) = established_pair(&mut net, b"", b"");
    assert_eq!(net.sides[A].cm.state(a), Some(CmState::RepRcvd));
    // B's REP retry finds A still setting its QP up: A sends MRA(REP).
    net.step_time(FOREVER);
    assert_eq!(net.sides[B].cm.state(b), Some(CmState::MraRepRcvd));
    net.complete_qp(A, true);
    assert!(matches!(net.events(A, a)[..], [Ev::Established(_)]));
    assert!(matches!(net.events(B, b)[..], [Ev::Established(_)]));
    net.check_contract();
}

#[test]
fn simultaneous_disconnect() {
    let mut net = Net::new(12);
    let (a, b) = established_pair(&mut net, b"", b"");
    for (s, id) in [(A, a), (B, b)] {
        let side = &mut net.sides[s];
        side.cm.disconnect(net.now, id, &[], &mut side.rec).unwrap();
    }
    net.pump();
    assert_eq!(
        net.events(A, a).last(),
        Some(&Ev::Disconnected(DisconnectCause::Local, vec![]))
    );
    assert_eq!(
        net.events(B, b).last(),
        Some(&Ev::Disconnected(DisconnectCause::Local, vec![]))
    );
    // DREQs crossed: each side answered the other's with DREP; the DREPs
    // for the crossed DREQs found timewait and were dropped as duplicates.
    for s in [A, B] {
        let stats = net.sides[s].cm.stats();
        assert_eq!(stats.dropped(DropReason::Duplicate), 1, "side {s}");
    }
    net.settle(FOREVER);
    assert_eq!(net.sides[A].cm.connections_in_use(), 0);
    assert_eq!(net.sides[B].cm.connections_in_use(), 0);
    net.check_contract();
}

#[test]
fn dreq_lost_is_retried_and_drep_lost_is_answered_from_timewait() {
    let mut net = Net::new(13);
    let (a, b) = established_pair(&mut net, b"", b"");
    net.filter = {
        let mut dreq = lose_first(A, "DREQ", 1);
        let mut drep = lose_first(B, "DREP", 1);
        Box::new(move |s, m| dreq(s, m) && drep(s, m))
    };
    let side = &mut net.sides[A];
    side.cm.disconnect(net.now, a, &[], &mut side.rec).unwrap();
    net.pump();
    // A's consumer does not wait for the peer.
    assert!(matches!(
        net.events(A, a)[..],
        [_, Ev::Disconnected(DisconnectCause::Local, _)]
    ));
    assert_eq!(net.events(B, b).len(), 1);
    net.step_time(FOREVER); // DREQ retry: B disconnects, its DREP is lost
    assert!(matches!(
        net.events(B, b)[..],
        [_, Ev::Disconnected(DisconnectCause::Remote, _)]
    ));
    assert_eq!(net.sides[A].cm.state(a), Some(CmState::DreqSent));
    net.step_time(FOREVER); // another DREQ: B answers from timewait
    assert_eq!(net.sides[A].cm.state(a), Some(CmState::TimeWait));
    net.settle(FOREVER);
    assert_eq!(net.sides[A].cm.connections_in_use(), 0);
    net.check_contract();
}

#[test]
fn dreq_never_answered_ends_in_timewait() {
    let mut net = Net::new(14);
    let (a, _b) = established_pair(&mut net, b"", b"");
    net.filter = Box::new(|s, _| s != A);
    let side = &mut net.sides[A];
    side.cm.disconnect(net.now, a, &[], &mut side.rec).unwrap();
    net.pump();
    assert!(net.events(A, a)[1].is_terminal());
    net.settle(FOREVER);
    let stats = net.sides[A].cm.stats();
    assert_eq!((stats.retransmissions, stats.timeouts), (3, 1));
    assert_eq!(net.sides[A].cm.connections_in_use(), 0);
}

#[test]
fn a_closing_port_stops_retrying_an_unanswered_dreq() {
    // A peer that never answers the DREQ (LIO's isert after a login the
    // initiator refused): the retries stop, as Linux's cm_destroy_id stops
    // them, and the slot is free after one timewait instead of the whole
    // retry budget.
    let mut net = Net::new(16);
    let (a, _b) = established_pair(&mut net, b"", b"");
    net.filter = Box::new(|s, _| s != A);
    let side = &mut net.sides[A];
    side.cm.disconnect(net.now, a, &[], &mut side.rec).unwrap();
    net.pump();
    assert_eq!(net.sides[A].cm.state(a), Some(CmState::DreqSent));
    let side = &mut net.sides[A];
    assert_eq!(side.cm.end_disconnect_retries(net.now, &mut side.rec), 1);
    assert_eq!(net.sides[A].cm.state(a), Some(CmState::TimeWait));
    let side = &mut net.sides[A];
    assert_eq!(side.cm.end_disconnect_retries(net.now, &mut side.rec), 0);
    net.settle(FOREVER);
    let stats = net.sides[A].cm.stats();
    assert_eq!((stats.retransmissions, stats.timeouts), (0, 0));
    assert_eq!(net.sides[A].cm.connections_in_use(), 0);
}

#[test]
fn disconnect_while_req_sent() {
    let mut net = Net::new(15);
    net.listen_b();
    let a = net.connect_a(b"");
    let b = net.last_request_b();
    let side = &mut net.sides[A];
    side.cm.disconnect(net.now, a, &[], &mut side.rec).unwrap();
    net.pump();
    assert_eq!(
        net.events(A, a),
        vec![Ev::Disconnected(DisconnectCause::Local, vec![])]
    );
    // Linux: REJ(timeout) with the CA GUID as ARI; B's listener learns the
    // request is gone.
    assert_eq!(
        net.sides[B].rec.lev.last().unwrap().1,
        LEv::Withdrawn(b, WithdrawnCause::Rejected(RejectReason::Timeout))
    );
    let side = &mut net.sides[B];
    assert_eq!(
        side.cm
            .accept(net.now, b, &accept_request(&[], 1, 1), &mut side.rec),
        Err(CmError::UnknownId)
    );
    assert_eq!(net.sides[A].cm.connections_in_use(), 0);
    assert_eq!(net.sides[B].cm.connections_in_use(), 0);
    net.check_contract();
}

#[test]
fn disconnect_while_the_active_qp_is_being_set_up() {
    let mut net = Net::new(16);
    net.sides[A].auto_qp = false;
    let (a, b) = established_pair(&mut net, b"", b"");
    let side = &mut net.sides[A];
    side.cm.disconnect(net.now, a, &[], &mut side.rec).unwrap();
    net.pump();
    // No event while the RTR/RTS modify is in flight.
    assert!(net.events(A, a).is_empty());
    net.complete_qp(A, true); // RTR+RTS done → now ERR
    assert!(net.events(A, a).is_empty());
    net.complete_qp(A, true); // ERR done → the terminal event
    assert_eq!(
        net.events(A, a),
        vec![Ev::Disconnected(DisconnectCause::Local, vec![])]
    );
    assert!(matches!(
        net.events(B, b)[..],
        [Ev::Rejected(RejectReason::ConsumerDefined, _)]
    ));
    net.settle(FOREVER);
    assert_eq!(net.sides[A].cm.connections_in_use(), 0);
    assert_eq!(net.sides[B].cm.connections_in_use(), 0);
    net.check_contract();
}

#[test]
fn disconnect_while_accepting_and_while_rep_sent() {
    for rep_sent in [false, true] {
        let mut net = Net::new(17);
        net.sides[B].auto_qp = false;
        net.filter = Box::new(|s, m| !(s == B && attr_name(m) == "REP"));
        net.listen_b();
        let a = net.connect_a(b"");
        let b = net.last_request_b();
        net.accept_b(b, &[]);
        if rep_sent {
            net.complete_qp(B, true);
            assert_eq!(net.sides[B].cm.state(b), Some(CmState::RepSent));
        } else {
            assert_eq!(net.sides[B].cm.state(b), Some(CmState::Accepting));
        }
        let side = &mut net.sides[B];
        side.cm.disconnect(net.now, b, &[], &mut side.rec).unwrap();
        net.pump();
        net.complete_qp(B, true);
        net.complete_qp(B, true);
        assert_eq!(
            net.events(B, b),
            vec![Ev::Disconnected(DisconnectCause::Local, vec![])]
        );
        assert!(matches!(
            net.events(A, a)[..],
            [Ev::Rejected(RejectReason::ConsumerDefined, _)]
        ));
        net.settle(FOREVER);
        assert_eq!(net.sides[B].cm.connections_in_use(), 0);
        assert_eq!(net.sides[A].cm.connections_in_use(), 0);
        net.check_contract();
    }
}

#[test]
fn no_listener_is_rej_8() {
    let mut net = Net::new(18);
    let a = net.connect_a(b"");
    assert!(matches!(
        net.events(A, a)[..],
        [Ev::Rejected(RejectReason::InvalidServiceId, _)]
    ));
    assert_eq!(net.sides[B].cm.connections_in_use(), 0);
    assert_eq!(net.sides[B].cm.stats().rejects_sent, 1);
}

#[test]
fn stale_connection_is_rejected_and_the_old_one_torn_down() {
    let mut net = Net::new(19);
    let (_a, b_old) = established_pair(&mut net, b"", b"");
    // A "reboots": a fresh engine, same CA, same QP number.
    net.sides[A].cm = CmEngine::new(config(IP_A, GUID_A, 99));
    net.sides[A].rec = Rec::default();
    let a2 = net.connect_a(b"");
    assert!(matches!(
        net.events(A, a2)[..],
        [Ev::Rejected(RejectReason::StaleConn, _)]
    ));
    assert_eq!(
        net.events(B, b_old).last(),
        Some(&Ev::Disconnected(DisconnectCause::Stale, vec![]))
    );
    assert_eq!(net.sides[B].rec.lev.len(), 1, "no new request delivered");
    // Until B's timewait ends the QP stays stale; after it a reconnect works.
    let a3 = net.connect_a(b"");
    assert!(matches!(
        net.events(A, a3)[..],
        [Ev::Rejected(RejectReason::StaleConn, _)]
    ));
    net.settle(FOREVER);
    assert_eq!(net.sides[B].cm.connections_in_use(), 0);
    let a4 = net.connect_a(b"");
    let b4 = net.last_request_b();
    assert_ne!(b4, b_old);
    net.accept_b(b4, &[]);
    assert!(matches!(net.events(A, a4)[..], [Ev::Established(_)]));
    net.check_contract();
}

#[test]
fn a_rep_reusing_a_live_qp_is_stale() {
    let mut net = Net::new(20);
    let (a_old, _b) = established_pair(&mut net, b"", b"");
    // B "reboots" and answers a new connect with the same QP number.
    net.sides[B].cm = CmEngine::new(config(IP_B, GUID_B, 77));
    net.sides[B].rec = Rec::default();
    net.listen_b();
    let mut buf = [0u8; 92];
    let req = connect_request(&mut buf, b"", 0x101, 0x10);
    let side = &mut net.sides[A];
    let a_new = side.cm.connect(net.now, &req, &mut side.rec).unwrap();
    net.pump();
    let b_new = net.last_request_b();
    net.accept_b(b_new, &[]);
    assert_eq!(
        net.events(A, a_new),
        vec![Ev::Unreachable(UnreachableCause::StaleConnection)]
    );
    assert_eq!(
        net.events(A, a_old).last(),
        Some(&Ev::Disconnected(DisconnectCause::Stale, vec![]))
    );
    assert!(matches!(
        net.events(B, b_new)[..],
        [Ev::Rejected(RejectReason::StaleConn, _)]
    ));
    net.check_contract();
}

#[test]
fn qp_failures_end_the_connection_defined() {
    // Active side's RTR/RTS fails: REJ to the peer, Unreachable locally.
    let mut net = Net::new(21);
    net.sides[A].qp_ok = false;
    let (a, b) = established_pair(&mut net, b"", b"");
    assert_eq!(
        net.events(A, a),
        vec![Ev::Unreachable(UnreachableCause::QpTransitionFailed)]
    );
    assert!(matches!(
        net.events(B, b)[..],
        [Ev::Rejected(RejectReason::ConsumerDefined, _)]
    ));
    // Passive side's RTR fails.
    let mut net = Net::new(22);
    net.sides[B].qp_ok = false;
    let (a, b) = established_pair(&mut net, b"", b"");
    assert_eq!(
        net.events(B, b),
        vec![Ev::Unreachable(UnreachableCause::QpTransitionFailed)]
    );
    assert!(matches!(
        net.events(A, a)[..],
        [Ev::Rejected(RejectReason::ConsumerDefined, _)]
    ));
    // Passive side's RTS fails after the RTU: DREQ to the peer.
    let mut net = Net::new(23);
    net.sides[B].auto_qp = false;
    let (a, b) = established_pair(&mut net, b"", b"");
    net.complete_qp(B, true); // RTR: REP goes out, RTU comes back
    net.complete_qp(B, false); // RTS fails
    net.complete_qp(B, true); // ERR
    assert_eq!(
        net.events(B, b),
        vec![Ev::Unreachable(UnreachableCause::QpTransitionFailed)]
    );
    assert!(matches!(
        net.events(A, a)[..],
        [
            Ev::Established(_),
            Ev::Disconnected(DisconnectCause::Remote, _)
        ]
    ));
    net.settle(FOREVER);
    for s in [A, B] {
        assert_eq!(net.sides[s].cm.connections_in_use(), 0);
    }
    net.check_contract();
}

#[test]
fn unanswered_request_is_withdrawn_and_rejected() {
    let mut net = Net::new(24);
    let listener = net.listen_b();
    // Only A's first REQ arrives; B's consumer never answers it.
    let mut first = true;
    net.filter = Box::new(move |s, _| s != A || core::mem::replace(&mut first, false));
    let a = net.connect_a(b"");
    let b = net.last_request_b();
    net.settle(FOREVER);
    assert_eq!(
        net.events(A, a),
        vec![Ev::Unreachable(UnreachableCause::Timeout)]
    );
    assert_eq!(
        net.sides[B].rec.lev.last().unwrap(),
        &(listener, LEv::Withdrawn(b, WithdrawnCause::TimedOut))
    );
    assert!(net.log.iter().any(|l| l == "B <- REJ"));
    assert_eq!(net.sides[B].cm.connections_in_use(), 0);
    assert_eq!(net.sides[B].cm.stats().timeouts, 1);
}

#[test]
fn unlisten_rejects_unanswered_requests() {
    let mut net = Net::new(25);
    let listener = net.listen_b();
    let a = net.connect_a(b"");
    let b = net.last_request_b();
    let side = &mut net.sides[B];
    side.cm.unlisten(net.now, listener, &mut side.rec).unwrap();
    assert_eq!(
        side.cm.unlisten(net.now, listener, &mut side.rec),
        Err(CmError::UnknownId)
    );
    net.pump();
    assert!(matches!(
        net.events(A, a)[..],
        [Ev::Rejected(RejectReason::InvalidServiceId, _)]
    ));
    assert_eq!(net.sides[B].rec.lev.len(), 1, "no event after unlisten");
    let side = &mut net.sides[B];
    assert_eq!(
        side.cm
            .accept(net.now, b, &accept_request(&[], 1, 1), &mut side.rec),
        Err(CmError::UnknownId)
    );
    assert_eq!(side.cm.listeners_in_use(), 0);
}

#[test]
fn consumer_call_errors() {
    let mut net = Net::new(26);
    let listener = net.listen_b();
    assert_eq!(
        net.sides[B].cm.listen(service(), ListenKind::IbCm),
        Err(CmError::AlreadyListening)
    );
    net.sides[B]
        .cm
        .listen(ServiceId(1), ListenKind::IbCm)
        .unwrap();
    assert_eq!(
        net.sides[B].cm.listen(ServiceId(2), ListenKind::IbCm),
        Err(CmError::NoFreeListener)
    );
    let mut buf = [0u8; 92];
    let mut req = connect_request(&mut buf, b"", 1, 1);
    let long = [0u8; 93];
    req.private_data = &long;
    let side = &mut net.sides[A];
    assert_eq!(
        side.cm.connect(0, &req, &mut side.rec),
        Err(CmError::PrivateDataTooLong(92))
    );
    req.private_data = &[];
    req.params.retry_count = 8;
    assert!(matches!(
        side.cm.connect(0, &req, &mut side.rec),
        Err(CmError::InvalidParameter(_))
    ));
    req.params.retry_count = 7;
    req.params.min_rnr_timer = 32;
    assert!(matches!(
        side.cm.connect(0, &req, &mut side.rec),
        Err(CmError::InvalidParameter(_))
    ));
    assert!(side.rec.sent.is_empty(), "nothing sent on a refused call");

    let a = net.connect_a(b"");
    let b = net.last_request_b();
    let side = &mut net.sides[B];
    assert_eq!(
        side.cm.disconnect(net.now, b, &[], &mut side.rec),
        Err(CmError::WrongState),
        "an unanswered request is rejected, not disconnected"
    );
    assert_eq!(
        side.cm.accept(
            net.now,
            b,
            &AcceptRequest {
                private_data: &[0; 197],
                ..accept_request(&[], 2, 2)
            },
            &mut side.rec
        ),
        Err(CmError::PrivateDataTooLong(196))
    );
    assert_eq!(
        side.cm.reject(
            net.now,
            b,
            RejectReason::ConsumerDefined,
            &[0; 149],
            &mut side.rec
        ),
        Err(CmError::PrivateDataTooLong(148))
    );
    net.accept_b(b, &[]);
    let side = &mut net.sides[B];
    assert_eq!(
        side.cm
            .accept(net.now, b, &accept_request(&[], 2, 2), &mut side.rec),
        Err(CmError::WrongState)
    );
    assert_eq!(
        side.cm.reject(
            net.now,
            b,
            RejectReason::ConsumerDefined,
            &[],
            &mut side.rec
        ),
        Err(CmError::WrongState)
    );
    let side = &mut net.sides[A];
    assert_eq!(
        side.cm.disconnect(net.now, a, &[0; 221], &mut side.rec),
        Err(CmError::PrivateDataTooLong(220))
    );
    net.sides[A].auto_qp = false;
    let side = &mut net.sides[A];
    side.cm.disconnect(net.now, a, &[], &mut side.rec).unwrap();
    assert_eq!(
        side.cm.disconnect(net.now, a, &[], &mut side.rec),
        Err(CmError::Closing)
    );
    net.complete_qp(A, true);
    let side = &mut net.sides[A];
    assert_eq!(
        side.cm.disconnect(net.now, a, &[], &mut side.rec),
        Err(CmError::UnknownId)
    );
    // A stale QP completion is ignored.
    assert!(!side.cm.on_qp_modified(net.now, a, true, &mut side.rec));
    let _ = listener;
    net.check_contract();
}

#[test]
fn the_table_fills_up_and_frees() {
    let mut net = Net::new(27);
    net.listen_b();
    net.filter = Box::new(|s, _| s != A);
    let mut ids = Vec::new();
    for i in 0..8u32 {
        let mut buf = [0u8; 92];
        let req = connect_request(&mut buf, b"", 0x300 + i, i);
        let side = &mut net.sides[A];
        ids.push(side.cm.connect(net.now, &req, &mut side.rec).unwrap());
    }
    let mut buf = [0u8; 92];
    let req = connect_request(&mut buf, b"", 0x400, 0);
    let side = &mut net.sides[A];
    assert_eq!(
        side.cm.connect(net.now, &req, &mut side.rec),
        Err(CmError::NoFreeSlot)
    );
    // Every local comm ID is distinct.
    let mut comm: Vec<u32> = ids
        .iter()
        .map(|id| net.sides[A].cm.local_comm_id(*id).unwrap())
        .collect();
    comm.sort_unstable();
    comm.dedup();
    assert_eq!(comm.len(), 8);
    net.settle(FOREVER);
    assert_eq!(net.sides[A].cm.connections_in_use(), 0);
    // A reused slot gets a new generation: the old handles are dead.
    let side = &mut net.sides[A];
    let fresh = side.cm.connect(net.now, &req, &mut side.rec).unwrap();
    assert!(ids.iter().all(|id| *id != fresh));
    assert!(ids.iter().all(|id| side.cm.state(*id).is_none()));
}

#[test]
fn passive_table_full_is_rej_3() {
    let mut net = Net::new(28);
    net.listen_b();
    for i in 0..9u32 {
        let mut buf = [0u8; 92];
        let req = connect_request(&mut buf, b"", 0x500 + i, i);
        let side = &mut net.sides[A];
        let _ = side.cm.connect(net.now, &req, &mut side.rec);
    }
    net.pump();
    // A has 8 slots, B has 8: all 8 of A's requests fit at B. Fill B's
    // table from a third CA to see the refusal.
    let c_gid = Gid::from_ipv4(Ipv4Address::new(10, 0, 0, 3));
    let mut mad = [0u8; MAD_LEN];
    let path = CmPathRepr {
        local_gid: c_gid,
        ..endpoints().path(IbTimeout::new(9).unwrap())
    };
    let mut pd = [0u8; 92];
    endpoints().req_private_data(&[], &mut pd).unwrap();
    let req = table::req_repr(9, 0x777, 0xc, path, &pd);
    CmMadRepr {
        transaction_id: 1,
        attribute_modifier: 0,
        message: CmMessage::Req(req),
    }
    .emit(&mut mad)
    .unwrap();
    let side = &mut net.sides[B];
    side.cm
        .on_mad(net.now, &MadAddress::cm(c_gid), &mad, &mut side.rec);
    let (to, rej) = side.rec.sent.last().unwrap();
    assert_eq!(to.gid, c_gid);
    let CmMessage::Rej(r) = CmMadRepr::parse(rej).unwrap().message else {
        panic!()
    };
    assert_eq!(r.reason, RejectReason::NoResources);
}

#[test]
fn ids_and_psns_are_random_when_not_given() {
    let mut net = Net::new(30);
    net.listen_b();
    let mut buf = [0u8; 92];
    let mut req = connect_request(&mut buf, b"", 0x100, 1);
    req.qp.starting_psn = None;
    let side = &mut net.sides[A];
    side.cm.connect(net.now, &req, &mut side.rec).unwrap();
    let (_, mad) = side.rec.sent[0].clone();
    let CmMessage::Req(r) = CmMadRepr::parse(&mad).unwrap().message else {
        panic!()
    };
    let mut other = CmEngine::new(config(IP_A, GUID_A, 31));
    let mut rec = Rec::default();
    other.connect(0, &req, &mut rec).unwrap();
    let CmMessage::Req(r2) = CmMadRepr::parse(&rec.sent[0].1).unwrap().message else {
        panic!()
    };
    assert_ne!(r.starting_psn, r2.starting_psn);
    assert_ne!(r.local_comm_id, r2.local_comm_id);
}
