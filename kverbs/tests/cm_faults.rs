//! The connection manager against a lossy fabric: REQ lost and retried,
//! REP lost, RTU lost (the passive side established by the first data
//! packet), MRA from a slow listener, a REQ never answered — each ending
//! with every object torn down and the verifier clean.

#![cfg(not(loom))]

mod cm_support;
mod vsupport;

use std::sync::Arc;

use hca_lowlevel::device::{AccessFlags, HcaDevice, QpState};
use hca_lowlevel::wire::Qpn;
use kverbs::cm::{AcceptRequest, CmHandler, CmState, ConnParams, LocalQp, UnreachableCause};
use kverbs::mr::Mr;
use kverbs::wire::IbTimeout;
use kverbs::wr::{Payload, SendWr, Signal};

use cm_support::*;
use vsupport::{Mode, World};

fn accept_now(
    env: &Env<'_>,
    id: kverbs::cm::CmId,
    qp: &ConsumerQp,
    rec: &Arc<Recorder>,
    p: &kverbs::irql::Passive<'_>,
) {
    let handler: Arc<dyn CmHandler> = rec.clone();
    let accept = AcceptRequest {
        qp: LocalQp {
            qpn: Qpn::from_low_bits(qp.qp.qpn()),
            starting_psn: None,
        },
        params: ConnParams::SRP,
        private_data: b"ok",
    };
    env.b
        .port
        .accept(id, &accept, &qp.cm_qp, &handler, p)
        .unwrap();
}

fn both_established(client: &Recorder, a: kverbs::cm::CmId, server: &Recorder) -> bool {
    client.has(a, Kind::Established)
        && server
            .last_request()
            .is_some_and(|b| server.has(b, Kind::Established))
}

/// Disconnects both consumers' connections, waits for their terminal
/// events, destroys the QPs, tears the ports down.
fn finish(
    env: Env<'_>,
    client: &Arc<Recorder>,
    a: kverbs::cm::CmId,
    server: &Arc<Recorder>,
    qps: Vec<ConsumerQp>,
    p: &kverbs::irql::Passive<'_>,
) {
    let _ = env.a.port.disconnect(a, &[], p);
    env.w.wait("terminal events", || {
        client.terminal_of(a).is_some()
            && server
                .accepted
                .lock()
                .unwrap()
                .iter()
                .chain(server.last_request().iter())
                .all(|b| server.terminal_of(*b).is_some() || server.kinds_of(*b).is_empty())
    });
    for qp in qps {
        qp.destroy(env.w, p);
    }
    drop(server.policy.lock().unwrap().take_port());
    for rec in [client, server] {
        assert_eq!(
            rec.contract_broken
                .load(std::sync::atomic::Ordering::Acquire),
            0
        );
    }
    env.teardown(p);
}

#[test]
fn req_lost_is_retried() {
    let w = World::new(Mode::Threaded);
    w.platform.run_passive(|p| {
        let env = Env::new(&w, p);
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
        env.faults(0, 1, all_lost());
        let a = env.connect_a(&qa, b"", &client, p).unwrap();
        w.wait("the REQ is lost", || w.fabric.stats().dropped_by_fault >= 1);
        env.faults(0, 1, no_faults());
        w.wait("established", || both_established(&client, a, &server));
        let stats = env.a.port.stats(p);
        assert!(stats.engine.retransmissions >= 1);
        assert_eq!(stats.engine.timeouts, 0);
        finish(env, &client, a, &server, vec![qa, qb], p);
    });
    w.finish();
}

#[test]
fn rep_lost_is_repeated() {
    let w = World::new(Mode::Threaded);
    w.platform.run_passive(|p| {
        let env = Env::new(&w, p);
        let (client, server) = (Recorder::new(), Recorder::new());
        let qa = ConsumerQp::new(&env.a.node, &env.a.port, p);
        let qb = ConsumerQp::new(&env.b.node, &env.b.port, p);
        *server.policy.lock().unwrap() = Policy::Accept {
            port: env.b.port.clone(),
            qps: vec![qb.cm_qp.clone()],
            handler: server.clone(),
            data: b"rsp".to_vec(),
        };
        env.listen_b(&server, p);
        env.faults(1, 0, all_lost());
        let a = env.connect_a(&qa, b"", &client, p).unwrap();
        w.wait("the REP is lost", || w.fabric.stats().dropped_by_fault >= 1);
        assert!(!client.has(a, Kind::Established));
        env.faults(1, 0, no_faults());
        w.wait("established", || both_established(&client, a, &server));
        assert_eq!(&client.events_of(a)[0].data()[..3], b"rsp");
        // B sent its REP again (answering A's REQ retry, or on its timer).
        assert!(env.b.port.stats(p).engine.sent >= 2);
        assert_eq!(
            server.request_count(),
            1,
            "the retried REQ is no new request"
        );
        finish(env, &client, a, &server, vec![qa, qb], p);
    });
    w.finish();
}

#[test]
fn rtu_lost_first_data_packet_establishes_the_passive_side() {
    let w = World::new(Mode::Threaded);
    w.platform.run_passive(|p| {
        // A tells B (in its REQ) to wait long for A's answers, so B does
        // not repeat its REP before the data arrives.
        let slow = kverbs::cm::CmConfig {
            cm_response_timeout: IbTimeout::new(20).unwrap(),
            ..cm_config()
        };
        let env = Env::with_configs(&w, p, slow, cm_config());
        let (client, server) = (Recorder::new(), Recorder::new());
        let qa = ConsumerQp::new(&env.a.node, &env.a.port, p);
        let qb = ConsumerQp::new(&env.b.node, &env.b.port, p);
        env.listen_b(&server, p);
        let a = env.connect_a(&qa, b"", &client, p).unwrap();
        w.wait("request", || server.request_count() == 1);
        let b = server.last_request().unwrap();
        // From now on A's MADs are lost: the REQ got through, the RTU won't.
        env.faults(0, 1, all_lost());
        accept_now(&env, b, &qb, &server, p);
        w.wait("A established", || client.has(a, Kind::Established));
        w.wait("the RTU is lost", || w.fabric.stats().dropped_by_fault >= 1);
        assert_eq!(env.b.port.state(b, p), Some(CmState::RepSent));
        assert!(server.kinds_of(b).is_empty());
        assert_eq!(
            env.b.node.hca.query_qp(qb.qp.qpn()).unwrap().state,
            QpState::Rtr
        );
        env.faults(0, 1, no_faults());
        // A sends; B's QP, in RTR, reports communication established.
        let mr_b = Mr::alloc(&env.b.node.pd, 4096, AccessFlags::LOCAL_WRITE, p).unwrap();
        {
            let mut r = qb.qp.begin_recv(p).unwrap();
            r.recv(&[mr_b.sge(0, 64).unwrap()], 1).unwrap();
            r.commit();
        }
        {
            let mut s = qa.qp.begin_send(p).unwrap();
            s.send(
                &SendWr::new(Payload::Inline(b"first")),
                Signal::Signalled(2),
            )
            .unwrap();
            s.commit();
        }
        w.wait("B established", || server.has(b, Kind::Established));
        // Established without an RTU: no private data at all.
        assert_eq!(server.events_of(b)[0].len, 0);
        assert_eq!(
            env.b.node.hca.query_qp(qb.qp.qpn()).unwrap().state,
            QpState::Rts
        );
        w.wait("data delivered", || {
            qb.completions.total() == 1 && qa.completions.total() == 1
        });
        mr_b.dereg(p).unwrap();
        finish(env, &client, a, &server, vec![qa, qb], p);
    });
    w.finish();
}

#[test]
fn slow_listener_gets_an_mra_out() {
    let w = World::new(Mode::Threaded);
    w.platform.run_passive(|p| {
        let env = Env::new(&w, p);
        let (client, server) = (Recorder::new(), Recorder::new());
        let qa = ConsumerQp::new(&env.a.node, &env.a.port, p);
        let qb = ConsumerQp::new(&env.b.node, &env.b.port, p);
        env.listen_b(&server, p);
        let a = env.connect_a(&qa, b"", &client, p).unwrap();
        w.wait("request", || server.request_count() == 1);
        let b = server.last_request().unwrap();
        // A's REQ retry finds B still thinking: B sends MRA, A waits longer.
        w.wait("MRA", || {
            env.a.port.state(a, p) == Some(CmState::MraReqRcvd)
        });
        assert!(env.b.port.stats(p).engine.mras_sent >= 1);
        assert_eq!(env.b.port.state(b, p), Some(CmState::MraReqSent));
        accept_now(&env, b, &qb, &server, p);
        w.wait("established", || both_established(&client, a, &server));
        assert_eq!(env.a.port.stats(p).engine.timeouts, 0);
        assert_eq!(server.request_count(), 1);
        finish(env, &client, a, &server, vec![qa, qb], p);
    });
    w.finish();
}

#[test]
fn req_never_answered_is_unreachable() {
    let w = World::new(Mode::Threaded);
    w.platform.run_passive(|p| {
        let env = Env::new(&w, p);
        let client = Recorder::new();
        let qa = ConsumerQp::new(&env.a.node, &env.a.port, p);
        env.faults(0, 1, all_lost());
        let a = env.connect_a(&qa, b"", &client, p).unwrap();
        w.wait("gave up", || client.terminal_of(a).is_some());
        assert_eq!(
            client.kinds_of(a),
            [Kind::Unreachable(UnreachableCause::Timeout)]
        );
        let stats = env.a.port.stats(p);
        assert_eq!(
            (stats.engine.retransmissions, stats.engine.timeouts),
            (3, 1)
        );
        assert_eq!(env.a.port.connections_in_use(p), 0);
        qa.destroy(&w, p);
        env.teardown(p);
    });
    w.finish();
}
