//! The connection manager against hand-made MADs over the software HCA's
//! wire: a third node (C) drives its QP1 by hand. Malformed MADs of every
//! kind get their drop reason (counted and traced) and, where Linux
//! answers, the same answer; a scripted connection checks the matching
//! rules (transaction IDs, comm IDs, QPN, sender) on the real path; a REQ
//! reusing a live connection's QP is stale.

#![cfg(not(loom))]

mod cm_support;
mod vsupport;

use std::collections::BTreeMap;
use std::sync::Arc;

use hca_lowlevel::wire::{Eecn, Gid, Ipv4Address, Psn, Qpn};
use kverbs::cm::rdma_cm::RdmaCmEndpoints;
use kverbs::cm::{CmId, DisconnectCause, DropReason};
use kverbs::irql::Passive;
use kverbs::wire::{
    CmDreqRepr, CmMadRepr, CmMessage, CmMessageKind, CmMraRepr, CmPathRepr, CmRejRepr, CmRepRepr,
    CmReqRepr, CmRtuRepr, IbTimeout, PathMtu, PortSpace, RejectReason, ServiceId,
    TransportServiceType,
};

use cm_support::*;
use vsupport::{Mode, World};

const C_COMM: u32 = 0x00c0_0001;
const C_GUID: u64 = 0x0200_00ff_fe00_00c3;
const C_QPN: u32 = 0x4242;
const REQ_TID: u64 = 0x0000_0c00_0000_0001;

fn mad(tid: u64, message: CmMessage<'_>) -> Vec<u8> {
    let mut buf = vec![0u8; 256];
    CmMadRepr {
        transaction_id: tid,
        attribute_modifier: 0,
        message,
    }
    .emit(&mut buf)
    .unwrap();
    buf
}

/// C's REQ to B, claiming `guid` and QP `qpn`, RDMA/CM addressed.
fn req_from_c(c_gid: Gid, comm: u32, guid: u64, qpn: u32, pd: &mut [u8; 92]) -> CmReqRepr<'_> {
    let ep = RdmaCmEndpoints {
        port_space: PortSpace::Tcp,
        src: c_gid.to_ipv4().unwrap(),
        src_port: 777,
        dst: Ipv4Address(IP_B),
        dst_port: PORT,
    };
    ep.req_private_data(b"from C", pd).unwrap();
    CmReqRepr {
        local_comm_id: comm,
        vendor_id: 0,
        service_id: ServiceId::rdma_cm(PortSpace::Tcp, PORT),
        local_ca_guid: guid,
        local_qkey: 0,
        local_qpn: Qpn::new(qpn).unwrap(),
        responder_resources: 4,
        local_eecn: Eecn::from_low_bits(0),
        initiator_depth: 4,
        remote_eecn: Eecn::from_low_bits(0),
        remote_cm_response_timeout: IbTimeout::new(14).unwrap(),
        transport_service_type: TransportServiceType::Rc,
        end_to_end_flow_control: true,
        starting_psn: Psn::new(0x77).unwrap(),
        // B waits this long (≈ 4.3 s) for C's RTU before repeating its
        // REP: longer than the test, so nothing times out under it.
        local_cm_response_timeout: IbTimeout::new(20).unwrap(),
        retry_count: 7,
        pkey: 0xffff,
        path_mtu: PathMtu::Mtu1024,
        rdc_exists: false,
        rnr_retry_count: 7,
        max_cm_retries: 3,
        srq: false,
        extended_transport_type: 0,
        primary_path: CmPathRepr {
            local_gid: c_gid,
            ..ep.path(IbTimeout::new(13).unwrap())
        },
        alternate_path: None,
        sap_supported: false,
        private_data: &pd[..],
    }
}

fn parse(m: &[u8]) -> (u64, String, Option<CmRepRepr<'_>>, Option<CmRejRepr<'_>>) {
    let parsed = CmMadRepr::parse(m).unwrap();
    let name = match parsed.message {
        CmMessage::Req(_) => "REQ".to_string(),
        CmMessage::Rep(_) => "REP".to_string(),
        CmMessage::Rtu(_) => "RTU".to_string(),
        CmMessage::Rej(r) => format!("REJ({})", r.reason.code()),
        CmMessage::Mra(_) => "MRA".to_string(),
        CmMessage::Dreq(_) => "DREQ".to_string(),
        CmMessage::Drep(_) => "DREP".to_string(),
    };
    let rep = match parsed.message {
        CmMessage::Rep(r) => Some(r),
        _ => None,
    };
    let rej = match parsed.message {
        CmMessage::Rej(r) => Some(r),
        _ => None,
    };
    (parsed.transaction_id, name, rep, rej)
}

/// Waits for C to receive MADs until `want` of them came; returns their
/// names (REJ with its reason).
fn wait_answers(w: &World, c: &RawMads, want: usize, p: &Passive<'_>) -> Vec<Vec<u8>> {
    let got = std::cell::RefCell::new(Vec::new());
    w.wait("answers at C", || {
        got.borrow_mut().extend(c.received(p));
        got.borrow().len() >= want
    });
    got.into_inner()
}

fn drops_by_reason(trace: &Trace) -> BTreeMap<String, usize> {
    let mut map = BTreeMap::new();
    for d in trace.drops.lock().unwrap().iter() {
        *map.entry(format!("{:?}", d.reason)).or_default() += 1;
    }
    map
}

#[test]
fn malformed_and_mismatched_mads_over_the_wire() {
    let w = World::new(Mode::Threaded);
    w.platform.run_passive(|p| {
        let env = Env::new(&w, p);
        let c = RawMads::new(&w, IP_C, p);
        let b_gid = env.b.node.gid();
        let server = Recorder::new();
        let qb = ConsumerQp::new(&env.b.node, &env.b.port, p);
        *server.policy.lock().unwrap() = Policy::Accept {
            port: env.b.port.clone(),
            qps: vec![qb.cm_qp.clone()],
            handler: server.clone(),
            data: b"welcome".to_vec(),
        };
        env.listen_b(&server, p);

        // C connects by hand: REQ → B accepts → REP to C.
        let mut pd = [0u8; 92];
        let req = req_from_c(c.gid(), C_COMM, C_GUID, C_QPN, &mut pd);
        c.send(b_gid, &mad(REQ_TID, CmMessage::Req(req)), p);
        let answers = wait_answers(&w, &c, 1, p);
        let (tid, name, rep, _) = parse(&answers[0]);
        assert_eq!(
            (tid, name.as_str()),
            (REQ_TID, "REP"),
            "REP echoes the REQ's TID"
        );
        let rep = rep.unwrap();
        assert_eq!(rep.remote_comm_id, C_COMM);
        assert_eq!(rep.local_qpn.get(), qb.qp.qpn());
        assert_eq!(&rep.private_data[..7], b"welcome");
        let b_comm = rep.local_comm_id;
        let b_id: CmId = server.last_request().unwrap();
        assert_eq!(server.requests.lock().unwrap()[0].3[..6], *b"from C");

        let rtu = |tid: u64, local: u32| {
            mad(
                tid,
                CmMessage::Rtu(CmRtuRepr {
                    local_comm_id: local,
                    remote_comm_id: b_comm,
                    private_data: b"rtu",
                }),
            )
        };
        let dreq = |tid: u64, qpn: u32, remote: u32| {
            mad(
                tid,
                CmMessage::Dreq(CmDreqRepr {
                    local_comm_id: C_COMM,
                    remote_comm_id: remote,
                    remote_qpn: Qpn::new(qpn).unwrap(),
                    private_data: b"dreq",
                }),
            )
        };
        let good = rtu(REQ_TID, C_COMM);
        let mut cases: Vec<(&str, Vec<u8>, &str)> = Vec::new();
        cases.push(("short", good[..100].to_vec(), "Truncated"));
        let with = |at: usize, v: u8| {
            let mut m = good.clone();
            m[at] = v;
            m
        };
        cases.push(("base version", with(0, 2), "BadBaseVersion"));
        cases.push(("class", with(1, 0x04), "NotCmClass"));
        cases.push(("class version", with(2, 1), "BadClassVersion"));
        cases.push(("method", with(3, 0x81), "NotSend"));
        cases.push(("SIDR_REQ", with(17, 0x17), "UnsupportedAttribute"));
        let mut bad_rej = mad(
            REQ_TID,
            CmMessage::Rej(CmRejRepr {
                local_comm_id: C_COMM,
                remote_comm_id: b_comm,
                message_rejected: CmMessageKind::Rep,
                reason: RejectReason::ConsumerDefined,
                ari: &[],
                private_data: &[],
            }),
        );
        bad_rej[24 + 9] = 73 << 1;
        cases.push(("ARI length", bad_rej, "MalformedField"));
        cases.push(("TID", rtu(REQ_TID + 1, C_COMM), "TidMismatch"));
        cases.push(("sender comm ID", rtu(REQ_TID, C_COMM + 1), "CommIdMismatch"));
        cases.push(("QPN", dreq(99, C_QPN, b_comm), "QpnMismatch"));
        cases.push((
            "unknown RTU",
            mad(
                REQ_TID,
                CmMessage::Rtu(CmRtuRepr {
                    local_comm_id: C_COMM,
                    remote_comm_id: 0x0bad_0bad,
                    private_data: &[],
                }),
            ),
            "UnknownConnection",
        ));
        cases.push((
            "MRA of other",
            mad(
                REQ_TID,
                CmMessage::Mra(CmMraRepr {
                    local_comm_id: C_COMM,
                    remote_comm_id: b_comm,
                    message_mraed: CmMessageKind::Other,
                    service_timeout: IbTimeout::new(3).unwrap(),
                    private_data: &[],
                }),
            ),
            "UnexpectedInState",
        ));
        let mut expected: BTreeMap<String, usize> = BTreeMap::new();
        for (_, m, reason) in &cases {
            c.send(b_gid, m, p);
            *expected.entry(reason.to_string()).or_default() += 1;
        }
        let total: usize = expected.values().sum();
        w.wait("every drop traced", || {
            env.b.trace.drops.lock().unwrap().len() >= total
        });
        assert_eq!(drops_by_reason(&env.b.trace), expected);
        let stats = env.b.port.stats(p).engine;
        assert_eq!(stats.dropped_total(), total as u64);
        assert_eq!(stats.dropped(DropReason::TidMismatch), 1);
        assert!(
            server.kinds_of(b_id).is_empty(),
            "nothing reached the consumer"
        );

        // Unknown DREQ → DREP; unknown REP → REJ(6); REQ with a reserved
        // MTU → REJ(26).
        c.send(b_gid, &dreq(0x5150, C_QPN, 0x0bad_0bad), p);
        let mut unknown_rep = mad(REQ_TID, CmMessage::Rep(rep));
        unknown_rep[24 + 4..24 + 8].copy_from_slice(&0x0bad_0badu32.to_be_bytes());
        c.send(b_gid, &unknown_rep, p);
        let mut pd2 = [0u8; 92];
        let mut bad_mtu = mad(
            7,
            CmMessage::Req(req_from_c(c.gid(), 0x99, C_GUID, 0x99, &mut pd2)),
        );
        bad_mtu[24 + 50] = (bad_mtu[24 + 50] & 0x0f) | 0x70;
        c.send(b_gid, &bad_mtu, p);
        let answers = wait_answers(&w, &c, 3, p);
        let mut names: Vec<String> = answers.iter().map(|m| parse(m).1).collect();
        names.sort();
        // A REP retransmission may slip in while the RTU is withheld.
        names.retain(|n| n != "REP");
        assert_eq!(names, ["DREP", "REJ(26)", "REJ(6)"]);

        // The right RTU establishes B; C's DREQ then ends it.
        c.send(b_gid, &good, p);
        w.wait("B established", || server.has(b_id, Kind::Established));
        assert_eq!(&server.events_of(b_id)[0].data()[..3], b"rtu");
        // The same RTU again is a duplicate; from another port (D) it is
        // not the peer's.
        let d = RawMads::new(&w, [10, 0, 0, 4], p);
        let before = env.b.trace.drops.lock().unwrap().len();
        c.send(b_gid, &good, p);
        d.send(b_gid, &good, p);
        w.wait("both traced", || {
            env.b.trace.drops.lock().unwrap().len() >= before + 2
        });
        let by_reason = drops_by_reason(&env.b.trace);
        assert_eq!(by_reason.get("Duplicate"), Some(&1));
        assert_eq!(by_reason.get("WrongPeer"), Some(&1));
        assert_eq!(server.kinds_of(b_id), [Kind::Established]);
        d.destroy(&w, p);
        c.send(b_gid, &dreq(0x600d, qb.qp.qpn(), b_comm), p);
        w.wait("B disconnected", || server.terminal_of(b_id).is_some());
        let t = server.terminal_of(b_id).unwrap();
        assert_eq!(t.kind, Kind::Disconnected(DisconnectCause::Remote));
        assert_eq!(&t.data()[..4], b"dreq");
        let answers = wait_answers(&w, &c, 1, p);
        let drep = answers
            .iter()
            .map(|m| parse(m))
            .find(|(_, n, ..)| n == "DREP")
            .unwrap();
        assert_eq!(drep.0, 0x600d, "DREP echoes the DREQ's TID");

        qb.destroy(&w, p);
        drop(server.policy.lock().unwrap().take_port());
        c.destroy(&w, p);
        env.teardown(p);
    });
    w.finish();
}

#[test]
fn a_req_reusing_a_live_qp_is_stale() {
    let w = World::new(Mode::Threaded);
    w.platform.run_passive(|p| {
        let env = Env::new(&w, p);
        let c = RawMads::new(&w, IP_C, p);
        let (client, server) = (Recorder::new(), Recorder::new());
        let qa = ConsumerQp::new(&env.a.node, &env.a.port, p);
        let qb = ConsumerQp::new(&env.b.node, &env.b.port, p);
        *server.policy.lock().unwrap() = Policy::Accept {
            port: env.b.port.clone(),
            qps: vec![qb.cm_qp.clone()],
            handler: server.clone(),
            data: vec![],
        };
        env.listen_b(&server, p);
        let a = env.connect_a(&qa, b"", &client, p).unwrap();
        w.wait("established", || {
            client.has(a, Kind::Established)
                && server
                    .last_request()
                    .is_some_and(|b| server.has(b, Kind::Established))
        });
        let b = server.last_request().unwrap();
        // A REQ naming A's CA and A's QP again (as after a reboot of A):
        // B rejects it as stale and tears the old connection down (DREQ).
        let a_guid = env.a.node.dev.attr().node_guid;
        let mut pd = [0u8; 92];
        let req = req_from_c(c.gid(), 0x5555, a_guid, qa.qp.qpn(), &mut pd);
        c.send(env.b.node.gid(), &mad(0x77, CmMessage::Req(req)), p);
        let answers = wait_answers(&w, &c, 1, p);
        let (tid, name, _, rej) = parse(&answers[0]);
        assert_eq!((tid, name.as_str()), (0x77, "REJ(10)"));
        assert_eq!(rej.unwrap().remote_comm_id, 0x5555);
        w.wait("old connection down", || {
            server.terminal_of(b).is_some() && client.terminal_of(a).is_some()
        });
        assert_eq!(
            server.terminal_of(b).unwrap().kind,
            Kind::Disconnected(DisconnectCause::Stale)
        );
        assert_eq!(
            client.terminal_of(a).unwrap().kind,
            Kind::Disconnected(DisconnectCause::Remote)
        );
        assert_eq!(
            server.request_count(),
            1,
            "the stale REQ reached no listener"
        );
        qa.destroy(&w, p);
        qb.destroy(&w, p);
        drop(server.policy.lock().unwrap().take_port());
        c.destroy(&w, p);
        let _ = Arc::clone(&client);
        env.teardown(p);
    });
    w.finish();
}
