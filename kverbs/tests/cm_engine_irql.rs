//! The CM engine at DISPATCH_LEVEL under the host verifier: whole
//! connection lives — connect, MRA, accept, establish, disconnect, REQ
//! retries and timeouts, rejects, malformed and unknown MADs — run raised
//! to DISPATCH_LEVEL with effects that keep everything in fixed-capacity
//! storage, so any allocation or blocking in an engine path is a
//! violation that fails the test.

#![cfg(not(loom))]

mod support;

use hca_lowlevel::wire::{Gid, Ipv4Address, Psn, Qpn};
use kverbs::cm::rdma_cm::{RdmaCmEndpoints, ack_timeout_for};
use kverbs::cm::{
    AcceptRequest, CmConfig, CmEffects, CmEngine, CmEvent, CmId, CmState, ConnParams,
    ConnectRequest, DroppedMad, ListenEvent, ListenKind, ListenerId, LocalQp, MadAddress, QpModify,
};
use kverbs::irql::Dispatch;
use kverbs::wire::{IbTimeout, MAD_LEN, PathMtu, PortSpace, RejectReason};

/// Effects in fixed-capacity storage (heapless): nothing allocates.
#[derive(Default)]
struct FixedFx {
    sent: heapless::Deque<(MadAddress, [u8; MAD_LEN]), 32>,
    qp: heapless::Deque<CmId, 8>,
    terminal: u32,
    established: u32,
    requests: heapless::Vec<CmId, 8>,
    withdrawn: u32,
    drops: u32,
}

impl CmEffects for FixedFx {
    fn send_mad(&mut self, to: &MadAddress, mad: &[u8; MAD_LEN]) {
        assert!(self.sent.push_back((*to, *mad)).is_ok(), "wire full");
    }

    fn modify_qp(&mut self, id: CmId, _qpn: Qpn, _modify: &QpModify) {
        assert!(self.qp.push_back(id).is_ok());
    }

    fn event(&mut self, _id: CmId, event: CmEvent<'_>) {
        if event.is_terminal() {
            self.terminal += 1;
        } else {
            self.established += 1;
        }
    }

    fn listener_event(&mut self, _listener: ListenerId, event: ListenEvent<'_>) {
        match event {
            ListenEvent::Request(r) => assert!(self.requests.push(r.id).is_ok()),
            ListenEvent::Withdrawn { .. } => self.withdrawn += 1,
        }
    }

    fn dropped(&mut self, _drop: &DroppedMad) {
        self.drops += 1;
    }
}

struct Node {
    cm: CmEngine,
    fx: FixedFx,
    addr: MadAddress,
}

fn config(ip: [u8; 4], guid: u64) -> CmConfig {
    CmConfig {
        packet_lifetime: IbTimeout::new(8).unwrap(),
        cm_response_timeout: IbTimeout::new(10).unwrap(),
        max_cm_retries: 2,
        timewait: IbTimeout::new(11).unwrap(),
        connections: 4,
        listeners: 2,
        ..CmConfig::new(Gid::from_ipv4(Ipv4Address(ip)), guid)
    }
}

/// Moves every MAD and completes every QP modify until nothing moves.
fn pump(nodes: &mut [Node; 2], now: u64, lose_from: Option<usize>) {
    loop {
        let mut moved = false;
        for s in 0..2 {
            while let Some(id) = nodes[s].fx.qp.pop_front() {
                moved = true;
                let n = &mut nodes[s];
                n.cm.on_qp_modified(now, id, true, &mut n.fx);
            }
            while let Some((_, mad)) = nodes[s].fx.sent.pop_front() {
                moved = true;
                if lose_from == Some(s) {
                    continue;
                }
                let from = nodes[s].addr;
                let r = &mut nodes[1 - s];
                r.cm.on_mad(now, &from, &mad, &mut r.fx);
            }
        }
        if !moved {
            return;
        }
    }
}

/// Runs every deadline up to `until`.
fn run_timers(nodes: &mut [Node; 2], now: &mut u64, until: u64, lose_from: Option<usize>) {
    loop {
        let next = nodes.iter().filter_map(|n| n.cm.next_deadline()).min();
        match next {
            Some(t) if t <= until => {
                *now = t.max(*now);
                for n in nodes.iter_mut() {
                    n.cm.on_timeout(*now, &mut n.fx);
                }
                pump(nodes, *now, lose_from);
            }
            _ => return,
        }
    }
}

fn scenario(nodes: &mut [Node; 2], _d: &Dispatch<'_>) {
    let ep = RdmaCmEndpoints {
        port_space: PortSpace::Tcp,
        src: Ipv4Address([10, 0, 0, 1]),
        src_port: 1,
        dst: Ipv4Address([10, 0, 0, 2]),
        dst_port: 5555,
    };
    let mut pd = [0u8; 92];
    ep.req_private_data(b"login", &mut pd).unwrap();
    let request = |qpn: u32| ConnectRequest {
        service_id: ep.service_id(),
        peer: ep.peer(),
        path: ep.path(ack_timeout_for(IbTimeout::new(8).unwrap())),
        path_mtu: PathMtu::Mtu1024,
        qp: LocalQp {
            qpn: Qpn::new(qpn).unwrap(),
            starting_psn: None,
        },
        params: ConnParams::SRP,
        private_data: &pd,
    };
    let accept = AcceptRequest {
        qp: LocalQp {
            qpn: Qpn::new(0x200).unwrap(),
            starting_psn: Some(Psn::new(5).unwrap()),
        },
        params: ConnParams::SRP,
        private_data: b"rsp",
    };
    let mut now = 1_000u64;
    nodes[1]
        .cm
        .listen(ep.service_id(), ListenKind::RdmaCm)
        .unwrap();

    // 1. Connect; B's consumer is slow (MRA), then accepts; established.
    let id_a = {
        let n = &mut nodes[0];
        n.cm.connect(now, &request(0x100), &mut n.fx).unwrap()
    };
    pump(nodes, now, None);
    let id_b = nodes[1].fx.requests[0];
    let first_deadline = nodes[0].cm.next_deadline().unwrap();
    run_timers(nodes, &mut now, first_deadline, None);
    assert_eq!(nodes[0].cm.state(id_a), Some(CmState::MraReqRcvd));
    {
        let n = &mut nodes[1];
        n.cm.accept(now, id_b, &accept, &mut n.fx).unwrap();
    }
    pump(nodes, now, None);
    assert_eq!(nodes[0].fx.established + nodes[1].fx.established, 2);
    // 2. Malformed and unknown MADs.
    let from_a = nodes[0].addr;
    {
        let n = &mut nodes[1];
        n.cm.on_mad(now, &from_a, &[0u8; 100], &mut n.fx);
        let mut junk = [0xa5u8; MAD_LEN];
        n.cm.on_mad(now, &from_a, &junk, &mut n.fx);
        junk[..4].copy_from_slice(&[1, 7, 2, 3]);
        junk[16..18].copy_from_slice(&0x0015u16.to_be_bytes());
        n.cm.on_mad(now, &from_a, &junk, &mut n.fx);
    }
    pump(nodes, now, None);
    assert!(nodes[1].fx.drops >= 3);
    // 3. Disconnect from A; timewait runs out.
    {
        let n = &mut nodes[0];
        n.cm.disconnect(now, id_a, &[], &mut n.fx).unwrap();
    }
    pump(nodes, now, None);
    assert_eq!(nodes[0].fx.terminal + nodes[1].fx.terminal, 2);
    run_timers(nodes, &mut now, u64::MAX, None);
    assert_eq!(nodes[0].cm.connections_in_use(), 0);
    assert_eq!(nodes[1].cm.connections_in_use(), 0);
    // 4. A REQ into the void: retries, timeout.
    let id = {
        let n = &mut nodes[0];
        n.cm.connect(now, &request(0x101), &mut n.fx).unwrap()
    };
    pump(nodes, now, Some(0));
    run_timers(nodes, &mut now, u64::MAX, Some(0));
    assert_eq!(nodes[0].cm.state(id), None);
    assert_eq!(nodes[0].fx.terminal, 2);
    // 5. A rejected request.
    let _ = {
        let n = &mut nodes[0];
        n.cm.connect(now, &request(0x102), &mut n.fx).unwrap()
    };
    pump(nodes, now, None);
    let req = *nodes[1].fx.requests.last().unwrap();
    {
        let n = &mut nodes[1];
        n.cm.reject(now, req, RejectReason::ConsumerDefined, b"no", &mut n.fx)
            .unwrap();
    }
    pump(nodes, now, None);
    assert_eq!(nodes[0].fx.terminal, 3);
    run_timers(nodes, &mut now, u64::MAX, None);
    assert_eq!(nodes[1].cm.connections_in_use(), 0);
}

#[test]
fn engine_paths_never_allocate_at_dispatch() {
    let platform = support::manual();
    platform.run_passive(|_p| {
        let mut nodes = [
            Node {
                cm: CmEngine::new(config([10, 0, 0, 1], 1)),
                fx: FixedFx::default(),
                addr: MadAddress::cm(Gid::from_ipv4(Ipv4Address([10, 0, 0, 1]))),
            },
            Node {
                cm: CmEngine::new(config([10, 0, 0, 2], 2)),
                fx: FixedFx::default(),
                addr: MadAddress::cm(Gid::from_ipv4(Ipv4Address([10, 0, 0, 2]))),
            },
        ];
        platform.run_at_dispatch(|d| scenario(&mut nodes, d));
    });
    platform.finish();
}
