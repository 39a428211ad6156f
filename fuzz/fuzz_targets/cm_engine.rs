//! The CM engine driven by a fuzzer-written script: two engines with a
//! connection set up between them, then MADs (spliced into real ones
//! captured from the exchange, or raw), time jumps, disconnects, QP
//! completions that succeed or fail, and "communication established"
//! events, in the order the input says. Whatever happens: no panic, the
//! callback contract holds (at most one Established, then exactly one
//! terminal event, nothing after it, no QP modify after it), and once both
//! sides disconnect and the timers run out no connection is left.

#![no_main]

use std::collections::{BTreeMap, VecDeque};

use hca_lowlevel::wire::{Gid, Ipv4Address, Psn, Qpn};
use kverbs::cm::rdma_cm::{RdmaCmEndpoints, ack_timeout_for};
use kverbs::cm::{
    AcceptRequest, CmConfig, CmEffects, CmEngine, CmEvent, CmId, ConnParams, ConnectRequest,
    DroppedMad, ListenEvent, ListenKind, ListenerId, LocalQp, MadAddress, QpModify,
};
use kverbs::wire::{IbTimeout, MAD_LEN, PathMtu, PortSpace};
use libfuzzer_sys::fuzz_target;

#[derive(Default)]
struct Fx {
    sent: VecDeque<[u8; MAD_LEN]>,
    qp: VecDeque<CmId>,
    /// Per connection: events seen (true = terminal).
    events: BTreeMap<(usize, u16), Vec<bool>>,
    requests: Vec<CmId>,
}

impl CmEffects for Fx {
    fn send_mad(&mut self, _to: &MadAddress, mad: &[u8; MAD_LEN]) {
        self.sent.push_back(*mad);
    }

    fn modify_qp(&mut self, id: CmId, _qpn: Qpn, _modify: &QpModify) {
        let seen = self.events.get(&(id.slot(), id.generation()));
        assert!(
            !seen.is_some_and(|e| e.contains(&true)),
            "QP modify after the terminal event"
        );
        assert!(!self.qp.contains(&id), "two QP modifies outstanding");
        self.qp.push_back(id);
    }

    fn event(&mut self, id: CmId, event: CmEvent<'_>) {
        let seen = self.events.entry((id.slot(), id.generation())).or_default();
        assert!(!seen.contains(&true), "event after the terminal event");
        if !event.is_terminal() {
            assert!(seen.is_empty(), "Established twice or late");
        }
        assert!(
            !self.qp.contains(&id) || !event.is_terminal(),
            "terminal with QP busy"
        );
        seen.push(event.is_terminal());
    }

    fn listener_event(&mut self, _listener: ListenerId, event: ListenEvent<'_>) {
        if let ListenEvent::Request(r) = event {
            self.requests.push(r.id);
        }
    }

    fn dropped(&mut self, _drop: &DroppedMad) {}
}

struct Side {
    cm: CmEngine,
    fx: Fx,
    addr: MadAddress,
}

fn config(ip: [u8; 4], guid: u64) -> CmConfig {
    CmConfig {
        packet_lifetime: IbTimeout::new(8).unwrap(),
        cm_response_timeout: IbTimeout::new(10).unwrap(),
        max_cm_retries: 2,
        timewait: IbTimeout::new(11).unwrap(),
        connections: 4,
        listeners: 1,
        ..CmConfig::new(Gid::from_ipv4(Ipv4Address(ip)), guid)
    }
}

/// Delivers MADs (recording them as splice templates) and completes QP
/// modifies with `qp_ok` until nothing moves.
fn pump(sides: &mut [Side; 2], now: u64, qp_ok: bool, templates: &mut Vec<[u8; MAD_LEN]>) {
    for _ in 0..1000 {
        let mut moved = false;
        for s in 0..2 {
            while let Some(id) = sides[s].fx.qp.pop_front() {
                moved = true;
                let side = &mut sides[s];
                side.cm.on_qp_modified(now, id, qp_ok, &mut side.fx);
            }
            while let Some(mad) = sides[s].fx.sent.pop_front() {
                moved = true;
                if templates.len() < 64 {
                    templates.push(mad);
                }
                let from = sides[s].addr;
                let r = &mut sides[1 - s];
                r.cm.on_mad(now, &from, &mad, &mut r.fx);
            }
        }
        if !moved {
            return;
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let ep = RdmaCmEndpoints {
        port_space: PortSpace::Tcp,
        src: Ipv4Address([10, 0, 0, 1]),
        src_port: 9,
        dst: Ipv4Address([10, 0, 0, 2]),
        dst_port: 5555,
    };
    let mut sides = [
        Side {
            cm: CmEngine::new(config([10, 0, 0, 1], 1)),
            fx: Fx::default(),
            addr: MadAddress::cm(Gid::from_ipv4(ep.src)),
        },
        Side {
            cm: CmEngine::new(config([10, 0, 0, 2], 2)),
            fx: Fx::default(),
            addr: MadAddress::cm(Gid::from_ipv4(ep.dst)),
        },
    ];
    let mut pd = [0u8; 92];
    ep.req_private_data(b"x", &mut pd).unwrap();
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
        private_data: b"y",
    };
    let mut now = 1_000u64;
    let mut templates = Vec::new();
    let mut ids: Vec<(usize, CmId)> = Vec::new();
    sides[1]
        .cm
        .listen(ep.service_id(), ListenKind::RdmaCm)
        .unwrap();
    // A connection to start from.
    let a = sides[0]
        .cm
        .connect(now, &request(0x100), &mut sides[0].fx)
        .unwrap();
    ids.push((0, a));
    pump(&mut sides, now, true, &mut templates);
    if let Some(&b) = sides[1].fx.requests.first() {
        let side = &mut sides[1];
        if side.cm.accept(now, b, &accept, &mut side.fx).is_ok() {
            ids.push((1, b));
        }
    }
    pump(&mut sides, now, true, &mut templates);

    let mut input = data.iter().copied();
    let mut next_qpn = 0x300;
    while let Some(op) = input.next() {
        let side = usize::from(op & 1);
        let mut qp_ok = true;
        match (op >> 1) % 8 {
            0..=2 => {
                // A captured MAD with fuzzer bytes spliced in.
                if templates.is_empty() {
                    continue;
                }
                let mut mad = templates[usize::from(op >> 4) % templates.len()];
                let at = usize::from(input.next().unwrap_or(0));
                let n = usize::from(input.next().unwrap_or(0) % 8);
                for i in 0..n {
                    if let (Some(b), Some(slot)) = (input.next(), mad.get_mut((at + i) % MAD_LEN)) {
                        *slot = b;
                    }
                }
                let from = sides[1 - side].addr;
                let s = &mut sides[side];
                s.cm.on_mad(now, &from, &mad, &mut s.fx);
            }
            3 => {
                let len = usize::from(input.next().unwrap_or(0));
                let raw: Vec<u8> = input.by_ref().take(len).collect();
                let from = sides[1 - side].addr;
                let s = &mut sides[side];
                s.cm.on_mad(now, &from, &raw, &mut s.fx);
            }
            4 => {
                now += u64::from(input.next().unwrap_or(1)) * 1_000_000;
                for s in sides.iter_mut() {
                    s.cm.on_timeout(now, &mut s.fx);
                }
            }
            5 => {
                if let Some(&(s, id)) = ids.get(usize::from(op >> 4) % ids.len().max(1)) {
                    let side = &mut sides[s];
                    let _ = side.cm.disconnect(now, id, &[], &mut side.fx);
                }
            }
            6 => {
                qp_ok = op & 0x10 == 0;
                if op & 0x20 != 0 {
                    let s = &mut sides[1];
                    s.cm.on_comm_established(now, Qpn::new(0x200).unwrap(), &mut s.fx);
                }
            }
            _ => {
                // A new connection, or an answer to a pending request.
                if op & 0x10 == 0 {
                    next_qpn += 1;
                    if let Ok(id) = sides[0]
                        .cm
                        .connect(now, &request(next_qpn), &mut sides[0].fx)
                    {
                        ids.push((0, id));
                    }
                } else if let Some(id) = sides[1].fx.requests.pop() {
                    let s = &mut sides[1];
                    if s.cm.accept(now, id, &accept, &mut s.fx).is_ok() {
                        ids.push((1, id));
                    }
                }
            }
        }
        pump(&mut sides, now, qp_ok, &mut templates);
    }

    // Wind down: everyone leaves, the timers run out, nothing is left.
    for &(s, id) in &ids {
        let side = &mut sides[s];
        let _ = side.cm.disconnect(now, id, &[], &mut side.fx);
    }
    for id in std::mem::take(&mut sides[1].fx.requests) {
        let s = &mut sides[1];
        let _ = s.cm.reject(
            now,
            id,
            kverbs::wire::RejectReason::NoResources,
            &[],
            &mut s.fx,
        );
    }
    pump(&mut sides, now, true, &mut templates);
    for _ in 0..10_000 {
        let Some(t) = sides.iter().filter_map(|s| s.cm.next_deadline()).min() else {
            break;
        };
        now = now.max(t);
        for s in sides.iter_mut() {
            s.cm.on_timeout(now, &mut s.fx);
        }
        pump(&mut sides, now, true, &mut templates);
    }
    for s in &sides {
        assert_eq!(s.cm.connections_in_use(), 0, "a connection leaked");
    }
    for &(s, id) in &ids {
        let seen = sides[s].fx.events.get(&(id.slot(), id.generation()));
        assert_eq!(
            seen.map_or(0, |e| e.iter().filter(|t| **t).count()),
            1,
            "every consumer connection ends exactly once"
        );
    }
});
