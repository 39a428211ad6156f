//! The connection manager on the software HCA: connect, accept, data,
//! reject, no listener, disconnects — each with every object torn down
//! and the IRQL verifier clean (no allocation or blocking at
//! DISPATCH_LEVEL anywhere in the CM paths).

#![cfg(not(loom))]

mod cm_support;
mod vsupport;

use std::sync::Arc;

use hca_lowlevel::device::{AccessFlags, QpState};
use kverbs::cm::{CmState, DisconnectCause};
use kverbs::mr::Mr;
use kverbs::wire::RejectReason;
use kverbs::wr::{Payload, SendWr, Signal, WcOpcode, WcStatus};

use cm_support::*;
use vsupport::{MODES, Mode, World};

fn connect_accept_data_disconnect(mode: Mode) {
    let w = World::new(mode);
    w.platform.run_passive(|p| {
        // A long timewait (≈ 0.5 s), to see the consumers freed well before
        // it ends.
        let cfg = kverbs::cm::CmConfig {
            timewait: kverbs::wire::IbTimeout::new(17).unwrap(),
            ..cm_config()
        };
        let env = Env::with_configs(&w, p, cfg, cfg);
        let client = Recorder::new();
        let server = Recorder::new();
        let qa = ConsumerQp::new(&env.a.node, &env.a.port, p);
        let qb = ConsumerQp::new(&env.b.node, &env.b.port, p);
        *server.policy.lock().unwrap() = Policy::Accept {
            port: env.b.port.clone(),
            qps: vec![qb.cm_qp.clone()],
            handler: server.clone(),
            data: b"SRP_LOGIN_RSP".to_vec(),
        };
        env.listen_b(&server, p);
        w.fabric.set_capture(true);
        let a = env.connect_a(&qa, b"SRP_LOGIN_REQ", &client, p).unwrap();
        w.wait("both sides established", || {
            client.has(a, Kind::Established)
                && server
                    .last_request()
                    .is_some_and(|b| server.has(b, Kind::Established))
        });
        let b = server.last_request().unwrap();
        // On the wire (RoCEv2, raw offsets: Ethernet 14, IPv4 20, UDP 8,
        // BTH 12, DETH 8): each CM MAD is a UD SEND_ONLY from QP1 to QP1
        // with the GSI Q_Key and the default P_Key, a whole 256-byte MAD.
        let cm_frames: Vec<Vec<u8>> = w
            .fabric
            .take_captured()
            .into_iter()
            .map(|f| f.bytes)
            .filter(|f| f.len() > 62 && f[42] == 0x64)
            .collect();
        w.fabric.set_capture(false);
        let attrs: Vec<u16> = cm_frames
            .iter()
            .map(|f| u16::from_be_bytes([f[62 + 16], f[62 + 17]]))
            .collect();
        assert_eq!(attrs, [0x0010, 0x0013, 0x0014], "REQ, REP, RTU");
        for (i, f) in cm_frames.iter().enumerate() {
            assert_eq!(u16::from_be_bytes([f[36], f[37]]), 4791, "RoCEv2 UDP port");
            assert_eq!(&f[44..46], &[0xff, 0xff], "BTH P_Key");
            assert_eq!(&f[47..50], &[0, 0, 1], "BTH DestQP: QP1");
            assert_eq!(&f[54..58], &[0x80, 0x01, 0x00, 0x00], "DETH Q_Key: GSI");
            assert_eq!(&f[59..62], &[0, 0, 1], "DETH SrcQP: QP1");
            assert_eq!(f.len(), 62 + 256 + 4, "MAD then ICRC");
            let (src, dst) = if i == 1 { (IP_B, IP_A) } else { (IP_A, IP_B) };
            assert_eq!(&f[26..30], &src, "IPv4 source");
            assert_eq!(&f[30..34], &dst, "IPv4 destination");
        }
        // The listener saw the consumer's bytes after the RDMA/CM header.
        let (_, _, len, data) = server.requests.lock().unwrap()[0];
        assert_eq!(len, 56);
        assert_eq!(&data[..13], b"SRP_LOGIN_REQ");
        // A got B's REP private data (SRP_LOGIN_RSP), zero-padded.
        let est = client.events_of(a)[0];
        assert_eq!(est.len, 196);
        assert_eq!(&est.data()[..13], b"SRP_LOGIN_RSP");
        assert_eq!(env.a.port.state(a, p), Some(CmState::Established));
        assert_eq!(env.b.port.state(b, p), Some(CmState::Established));

        // The QPs as the HCA has them: RTS both, each sending from its own
        // advertised PSN and expecting the peer's.
        let ha = env.a.node.hca.clone();
        let hb = env.b.node.hca.clone();
        use hca_lowlevel::device::HcaDevice;
        let attr_a = ha.query_qp(qa.qp.qpn()).unwrap();
        let attr_b = hb.query_qp(qb.qp.qpn()).unwrap();
        assert_eq!(attr_a.state, QpState::Rts);
        assert_eq!(attr_b.state, QpState::Rts);
        assert_eq!(attr_a.dest_qpn, qb.qp.qpn());
        assert_eq!(attr_b.dest_qpn, qa.qp.qpn());
        assert_eq!(attr_a.sq_psn, attr_b.rq_psn);
        assert_eq!(attr_b.sq_psn, attr_a.rq_psn);
        assert_eq!(attr_a.path_mtu as u8, 3, "1024 on the 1500-byte link");
        assert_eq!(attr_a.av.dgid, hb.gid());
        assert_eq!(attr_b.av.dgid, ha.gid());

        // Data flows both ways.
        let mr_a = Mr::alloc(&env.a.node.pd, 4096, AccessFlags::LOCAL_WRITE, p).unwrap();
        let mr_b = Mr::alloc(&env.b.node.pd, 4096, AccessFlags::LOCAL_WRITE, p).unwrap();
        for (qp, mr) in [(&qa, &mr_a), (&qb, &mr_b)] {
            let mut r = qp.qp.begin_recv(p).unwrap();
            r.recv(&[mr.sge(0, 1024).unwrap()], 7).unwrap();
            r.commit();
        }
        for (qp, msg) in [(&qa, &b"command"[..]), (&qb, &b"response"[..])] {
            let mut s = qp.qp.begin_send(p).unwrap();
            s.send(&SendWr::new(Payload::Inline(msg)), Signal::Signalled(9))
                .unwrap();
            s.commit();
        }
        w.wait("sends and receives complete", || {
            qa.completions.total() == 2 && qb.completions.total() == 2
        });
        for (qp, mr, msg) in [
            (&qa, &mr_a, &b"response"[..]),
            (&qb, &mr_b, &b"command"[..]),
        ] {
            let got = qp.completions.take();
            assert!(got.iter().all(|c| c.status == WcStatus::Success));
            let recv = got.iter().find(|c| c.opcode == WcOpcode::Recv).unwrap();
            assert_eq!(recv.byte_len as usize, msg.len());
            let mut buf = vec![0u8; msg.len()];
            mr.mem().read(0, &mut buf).unwrap();
            assert_eq!(buf, msg);
        }

        // A disconnects; both consumers get exactly one terminal event, the
        // QPs are in ERR, neither side waited for timewait.
        env.a.port.disconnect(a, b"bye", p).unwrap();
        w.wait("both disconnected", || {
            client.terminal_of(a).is_some() && server.terminal_of(b).is_some()
        });
        assert_eq!(
            client.kinds_of(a),
            [
                Kind::Established,
                Kind::Disconnected(DisconnectCause::Local)
            ]
        );
        let t = server.terminal_of(b).unwrap();
        assert_eq!(t.kind, Kind::Disconnected(DisconnectCause::Remote));
        assert_eq!(&t.data()[..3], b"bye");
        // Neither consumer waited for timewait (nor for the DREP).
        assert!(matches!(
            env.a.port.state(a, p),
            Some(CmState::DreqSent | CmState::TimeWait)
        ));
        assert_eq!(env.b.port.state(b, p), Some(CmState::TimeWait));
        assert_eq!(ha.query_qp(qa.qp.qpn()).unwrap().state, QpState::Err);
        assert_eq!(hb.query_qp(qb.qp.qpn()).unwrap().state, QpState::Err);
        // The slots leave timewait on their own.
        w.wait("timewait over", || {
            env.a.port.connections_in_use(p) == 0 && env.b.port.connections_in_use(p) == 0
        });
        for rec in [&client, &server] {
            assert_eq!(
                rec.contract_broken
                    .load(std::sync::atomic::Ordering::Acquire),
                0
            );
        }
        mr_a.dereg(p).unwrap();
        mr_b.dereg(p).unwrap();
        qa.destroy(&w, p);
        qb.destroy(&w, p);
        drop(server.policy.lock().unwrap().take_port());
        env.teardown(p);
    });
    w.finish();
}

#[test]
fn connect_accept_data_disconnect_in_both_modes() {
    for mode in MODES {
        connect_accept_data_disconnect(mode);
    }
}

#[test]
fn reject_with_private_data() {
    let w = World::new(Mode::Threaded);
    w.platform.run_passive(|p| {
        let env = Env::new(&w, p);
        let client = Recorder::new();
        let server = Recorder::new();
        let qa = ConsumerQp::new(&env.a.node, &env.a.port, p);
        let login_rej: Vec<u8> = (0..32).map(|i| 0xc0 + i).collect();
        *server.policy.lock().unwrap() = Policy::Reject {
            port: env.b.port.clone(),
            data: login_rej.clone(),
        };
        env.listen_b(&server, p);
        let a = env.connect_a(&qa, b"login", &client, p).unwrap();
        w.wait("rejected", || client.terminal_of(a).is_some());
        let t = client.terminal_of(a).unwrap();
        assert_eq!(t.kind, Kind::Rejected(RejectReason::ConsumerDefined));
        assert_eq!(t.len, 148);
        assert_eq!(&t.data()[..32], &login_rej[..]);
        assert!(t.data()[32..].iter().all(|b| *b == 0));
        assert_eq!(client.kinds_of(a).len(), 1);
        // A's QP never left INIT: the CM did not touch it.
        use hca_lowlevel::device::HcaDevice;
        let attr = env.a.node.hca.query_qp(qa.qp.qpn()).unwrap();
        assert_eq!(attr.state, QpState::Init);
        qa.destroy(&w, p);
        drop(server.policy.lock().unwrap().take_port());
        env.teardown(p);
    });
    w.finish();
}

#[test]
fn no_listener_is_rej_8() {
    let w = World::new(Mode::Threaded);
    w.platform.run_passive(|p| {
        let env = Env::new(&w, p);
        let client = Recorder::new();
        let qa = ConsumerQp::new(&env.a.node, &env.a.port, p);
        let a = env.connect_a(&qa, b"", &client, p).unwrap();
        w.wait("rejected", || client.terminal_of(a).is_some());
        assert_eq!(
            client.terminal_of(a).unwrap().kind,
            Kind::Rejected(RejectReason::InvalidServiceId)
        );
        assert_eq!(env.b.port.connections_in_use(p), 0);
        assert_eq!(env.b.port.stats(p).engine.rejects_sent, 1);
        qa.destroy(&w, p);
        env.teardown(p);
    });
    w.finish();
}

#[test]
fn simultaneous_disconnect() {
    // Stepped: nothing moves between the two calls, so the DREQs cross.
    let w = World::new(Mode::Stepped);
    w.platform.run_passive(|p| {
        let env = Env::new(&w, p);
        let client = Recorder::new();
        let server = Recorder::new();
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
        // Both at once: the DREQs cross.
        env.a.port.disconnect(a, &[], p).unwrap();
        env.b.port.disconnect(b, &[], p).unwrap();
        w.wait("both disconnected", || {
            client.terminal_of(a).is_some() && server.terminal_of(b).is_some()
        });
        assert_eq!(
            client.terminal_of(a).unwrap().kind,
            Kind::Disconnected(DisconnectCause::Local)
        );
        assert_eq!(
            server.terminal_of(b).unwrap().kind,
            Kind::Disconnected(DisconnectCause::Local)
        );
        w.wait("timewait over", || {
            env.a.port.connections_in_use(p) == 0 && env.b.port.connections_in_use(p) == 0
        });
        // Nothing was sent into the void: every DREQ got its DREP.
        for side in [&env.a, &env.b] {
            assert_eq!(side.port.stats(p).engine.timeouts, 0);
        }
        qa.destroy(&w, p);
        qb.destroy(&w, p);
        drop(server.policy.lock().unwrap().take_port());
        env.teardown(p);
    });
    w.finish();
}

#[test]
fn disconnect_during_connect_withdraws_the_request() {
    let w = World::new(Mode::Threaded);
    w.platform.run_passive(|p| {
        let env = Env::new(&w, p);
        let client = Recorder::new();
        let server = Recorder::new();
        let qa = ConsumerQp::new(&env.a.node, &env.a.port, p);
        env.listen_b(&server, p); // ignores requests
        let a = env.connect_a(&qa, b"", &client, p).unwrap();
        w.wait("request seen", || server.request_count() == 1);
        env.a.port.disconnect(a, &[], p).unwrap();
        w.wait("withdrawn", || {
            client.terminal_of(a).is_some() && !server.withdrawn.lock().unwrap().is_empty()
        });
        assert_eq!(
            client.kinds_of(a),
            [Kind::Disconnected(DisconnectCause::Local)]
        );
        let (id, cause) = server.withdrawn.lock().unwrap()[0];
        assert_eq!(id, server.last_request().unwrap());
        assert_eq!(
            cause,
            kverbs::cm::WithdrawnCause::Rejected(RejectReason::Timeout)
        );
        // Accepting it now is refused.
        let qb = ConsumerQp::new(&env.b.node, &env.b.port, p);
        let handler: Arc<dyn kverbs::cm::CmHandler> = server.clone();
        let accept = kverbs::cm::AcceptRequest {
            qp: kverbs::cm::LocalQp {
                qpn: hca_lowlevel::wire::Qpn::from_low_bits(qb.qp.qpn()),
                starting_psn: None,
            },
            params: kverbs::cm::ConnParams::SRP,
            private_data: &[],
        };
        assert!(
            env.b
                .port
                .accept(id, &accept, &qb.cm_qp, &handler, p)
                .is_err()
        );
        qa.destroy(&w, p);
        qb.destroy(&w, p);
        env.teardown(p);
    });
    w.finish();
}

#[test]
fn a_qp_destroyed_under_the_cm_does_not_wedge_it() {
    let w = World::new(Mode::Threaded);
    w.platform.run_passive(|p| {
        let env = Env::new(&w, p);
        let client = Recorder::new();
        let server = Recorder::new();
        let qa = ConsumerQp::new(&env.a.node, &env.a.port, p);
        let qb = ConsumerQp::new(&env.b.node, &env.b.port, p);
        // B accepts with a QP its consumer already tore down: the RTR
        // modify is refused at once; B rejects, A hears it, B's consumer
        // gets its terminal event all the same.
        qb.qp.destroy(p).unwrap();
        w.wait("B's QP destroyed", || {
            qb.destroyed.0.load(std::sync::atomic::Ordering::Acquire) == 1
        });
        *server.policy.lock().unwrap() = Policy::Accept {
            port: env.b.port.clone(),
            qps: vec![qb.cm_qp.clone()],
            handler: server.clone(),
            data: vec![],
        };
        env.listen_b(&server, p);
        let a = env.connect_a(&qa, b"", &client, p).unwrap();
        w.wait("both ended", || {
            client.terminal_of(a).is_some()
                && server
                    .last_request()
                    .is_some_and(|b| server.terminal_of(b).is_some())
        });
        let b = server.last_request().unwrap();
        assert_eq!(
            server.kinds_of(b),
            [Kind::Unreachable(
                kverbs::cm::UnreachableCause::QpTransitionFailed
            )]
        );
        assert_eq!(
            client.kinds_of(a),
            [Kind::Rejected(RejectReason::ConsumerDefined)]
        );
        qa.destroy(&w, p);
        let ConsumerQp {
            cq, completions, ..
        } = qb;
        cq.destroy(p).unwrap();
        w.wait("B's CQ destroyed", || {
            completions
                .destroyed
                .load(std::sync::atomic::Ordering::Acquire)
                == 1
        });
        drop(server.policy.lock().unwrap().take_port());
        env.teardown(p);
    });
    w.finish();
}
