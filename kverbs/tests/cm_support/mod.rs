//! Shared by the CM integration tests: two (or three) software HCAs with a
//! connection manager on each, consumer RC QPs, recorders for connection
//! and listener events that never allocate at DISPATCH_LEVEL, a raw QP1
//! for injecting hand-made MADs, and a teardown that checks nothing leaks.

#![allow(dead_code, reason = "each test binary uses a different subset")]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use hca_lowlevel::device::{AccessFlags, QpType};
use hca_lowlevel::sim::FaultConfig;
use hca_lowlevel::wire::{Gid, Ipv4Address};
use kverbs::cm::qp::init_attrs;
use kverbs::cm::rdma_cm::RdmaCmEndpoints;
use kverbs::cm::{
    AcceptRequest, CmConfig, CmError, CmEvent, CmHandler, CmId, CmListener, CmPort, CmPortConfig,
    CmQp, CmTrace, ConnParams, DisconnectCause, DroppedMad, ListenEvent, ListenKind, ListenerId,
    LocalQp, UnreachableCause, WithdrawnCause,
};
use kverbs::cq::Cq;
use kverbs::irql::{Dispatch, Passive};
use kverbs::qp::{Qp, QpConfig, QpHandler};
use kverbs::wire::{IbTimeout, PortSpace, RejectReason};

use crate::vsupport::{Collect, Hp, Mode, Node, World};

pub const IP_A: [u8; 4] = [10, 0, 0, 1];
pub const IP_B: [u8; 4] = [10, 0, 0, 2];
pub const IP_C: [u8; 4] = [10, 0, 0, 3];
pub const PORT: u16 = 5555;

/// CM timing for tests (real time on the host platform): a CM response
/// timeout of 4.096 µs × 2^14 ≈ 67 ms plus twice a 16 ms packet lifetime,
/// three retries, timewait ≈ 67 ms.
pub fn cm_config() -> CmConfig {
    CmConfig {
        packet_lifetime: IbTimeout::new(12).unwrap(),
        cm_response_timeout: IbTimeout::new(14).unwrap(),
        max_cm_retries: 3,
        mra_service_timeout: IbTimeout::new(17).unwrap(),
        timewait: IbTimeout::new(14).unwrap(),
        connections: 16,
        listeners: 4,
        ..CmConfig::new(Gid::ZERO, 0)
    }
}

// ---- event recorders --------------------------------------------------------

/// A connection event, without allocation: private data in a fixed array.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Established,
    Rejected(RejectReason),
    Unreachable(UnreachableCause),
    Disconnected(DisconnectCause),
}

#[derive(Clone, Copy, Debug)]
pub struct Recorded {
    pub id: CmId,
    pub kind: Kind,
    pub len: usize,
    pub data: [u8; 224],
}

impl Recorded {
    pub fn data(&self) -> &[u8] {
        &self.data[..self.len]
    }
}

/// A request the listener saw: its id, the listener, the private data.
pub type SeenRequest = (CmId, ListenerId, usize, [u8; 92]);

/// What a listener does with a request.
pub enum Policy {
    Ignore,
    Accept {
        port: CmPort<Hp>,
        qps: Vec<Arc<dyn CmQp>>,
        handler: Arc<dyn CmHandler>,
        data: Vec<u8>,
    },
    Reject {
        port: CmPort<Hp>,
        data: Vec<u8>,
    },
}

impl Policy {
    /// Takes the policy out (back to `Ignore`), breaking the references it
    /// holds (the port, the recorder itself).
    pub fn take_port(&mut self) -> Policy {
        std::mem::replace(self, Policy::Ignore)
    }
}

/// Records connection events (as a `CmHandler`) and listener events (as a
/// `CmListener`), checking the callback contract as they come.
pub struct Recorder {
    pub events: Mutex<Vec<Recorded>>,
    pub requests: Mutex<Vec<SeenRequest>>,
    pub withdrawn: Mutex<Vec<(CmId, WithdrawnCause)>>,
    pub policy: Mutex<Policy>,
    pub accepted: Mutex<Vec<CmId>>,
    pub contract_broken: AtomicUsize,
}

impl Recorder {
    pub fn new() -> Arc<Recorder> {
        Arc::new(Recorder {
            events: Mutex::new(Vec::with_capacity(256)),
            requests: Mutex::new(Vec::with_capacity(64)),
            withdrawn: Mutex::new(Vec::with_capacity(64)),
            policy: Mutex::new(Policy::Ignore),
            accepted: Mutex::new(Vec::with_capacity(64)),
            contract_broken: AtomicUsize::new(0),
        })
    }

    pub fn events_of(&self, id: CmId) -> Vec<Recorded> {
        self.events
            .lock()
            .unwrap()
            .iter()
            .filter(|e| e.id == id)
            .copied()
            .collect()
    }

    pub fn kinds_of(&self, id: CmId) -> Vec<Kind> {
        self.events_of(id).iter().map(|e| e.kind).collect()
    }

    pub fn has(&self, id: CmId, kind: Kind) -> bool {
        self.events
            .lock()
            .unwrap()
            .iter()
            .any(|e| e.id == id && e.kind == kind)
    }

    pub fn terminal_of(&self, id: CmId) -> Option<Recorded> {
        self.events_of(id)
            .into_iter()
            .find(|e| e.kind != Kind::Established)
    }

    pub fn request_count(&self) -> usize {
        self.requests.lock().unwrap().len()
    }

    pub fn last_request(&self) -> Option<CmId> {
        self.requests.lock().unwrap().last().map(|r| r.0)
    }
}

impl CmHandler for Recorder {
    fn on_event(&self, id: CmId, event: CmEvent<'_>, _irql: &Dispatch<'_>) {
        let (kind, data): (Kind, &[u8]) = match event {
            CmEvent::Established { private_data } => (Kind::Established, private_data),
            CmEvent::Rejected {
                reason,
                private_data,
            } => (Kind::Rejected(reason), private_data),
            CmEvent::Unreachable { cause } => (Kind::Unreachable(cause), &[]),
            CmEvent::Disconnected {
                cause,
                private_data,
            } => (Kind::Disconnected(cause), private_data),
        };
        let mut events = self.events.lock().unwrap();
        // The contract: nothing after a terminal event, Established at
        // most once and first.
        let mut seen_terminal = false;
        let mut seen_established = false;
        for e in events.iter().filter(|e| e.id == id) {
            seen_terminal |= e.kind != Kind::Established;
            seen_established |= e.kind == Kind::Established;
        }
        if seen_terminal || (kind == Kind::Established && seen_established) {
            self.contract_broken.fetch_add(1, Ordering::AcqRel);
        }
        assert!(events.len() < events.capacity(), "recorder full");
        let mut rec = Recorded {
            id,
            kind,
            len: data.len().min(224),
            data: [0; 224],
        };
        rec.data[..rec.len].copy_from_slice(&data[..rec.len]);
        events.push(rec);
    }
}

impl CmListener for Recorder {
    fn on_event(&self, listener: ListenerId, event: ListenEvent<'_>, irql: &Dispatch<'_>) {
        match event {
            ListenEvent::Request(r) => {
                {
                    let mut requests = self.requests.lock().unwrap();
                    assert!(requests.len() < requests.capacity(), "recorder full");
                    let mut data = [0u8; 92];
                    let n = r.private_data.len().min(92);
                    data[..n].copy_from_slice(&r.private_data[..n]);
                    requests.push((r.id, listener, n, data));
                }
                let mut policy = self.policy.lock().unwrap();
                match &mut *policy {
                    Policy::Ignore => {}
                    Policy::Accept {
                        port,
                        qps,
                        handler,
                        data,
                    } => {
                        let qp = qps.pop().expect("no QP left for accept");
                        let accept = AcceptRequest {
                            qp: LocalQp {
                                qpn: hca_lowlevel::wire::Qpn::from_low_bits(qp.qpn()),
                                starting_psn: None,
                            },
                            params: ConnParams::SRP,
                            private_data: data,
                        };
                        port.accept(r.id, &accept, &qp, handler, irql).unwrap();
                        let mut accepted = self.accepted.lock().unwrap();
                        assert!(accepted.len() < accepted.capacity());
                        accepted.push(r.id);
                    }
                    Policy::Reject { port, data } => {
                        port.reject(r.id, RejectReason::ConsumerDefined, data, irql)
                            .unwrap();
                    }
                }
            }
            ListenEvent::Withdrawn { id, cause } => {
                let mut w = self.withdrawn.lock().unwrap();
                assert!(w.len() < w.capacity());
                w.push((id, cause));
            }
        }
    }
}

/// The trace hook: counts drops per reason.
#[derive(Default)]
pub struct Trace {
    pub drops: Mutex<Vec<DroppedMad>>,
}

impl Trace {
    pub fn new() -> Arc<Trace> {
        Arc::new(Trace {
            drops: Mutex::new(Vec::with_capacity(256)),
        })
    }
}

impl CmTrace for Trace {
    fn dropped(&self, drop: &DroppedMad) {
        let mut d = self.drops.lock().unwrap();
        assert!(d.len() < d.capacity(), "trace full");
        d.push(*drop);
    }
}

// ---- consumer QPs -----------------------------------------------------------

/// A consumer's RC QP in INIT, with its CQ and completion collector.
pub struct ConsumerQp {
    pub qp: Qp<Hp, u32>,
    pub cm_qp: Arc<dyn CmQp>,
    pub cq: Cq<Hp, u32>,
    pub completions: Arc<Collect<u32>>,
    pub destroyed: Arc<Destroyed>,
}

#[derive(Default)]
pub struct Destroyed(pub AtomicUsize);

impl QpHandler for Destroyed {
    fn on_destroyed(&self, _irql: &Dispatch<'_>) {
        self.0.fetch_add(1, Ordering::AcqRel);
    }
}

impl ConsumerQp {
    pub fn new(node: &Node, port: &CmPort<Hp>, p: &Passive<'_>) -> ConsumerQp {
        let completions = Collect::<u32>::new(256);
        let cq = node.cq(64, completions.clone(), p);
        let destroyed = Arc::new(Destroyed::default());
        let handler = port.qp_events(destroyed.clone(), p);
        let cfg = QpConfig {
            qp_type: QpType::Rc,
            send_cq: cq.clone(),
            recv_cq: cq.clone(),
            send_wqebbs: 16,
            recv_slots: 16,
            max_recv_sge: 1,
            port: 1,
        };
        let qp = Qp::create(&node.pd, &cfg, handler, p).unwrap();
        let (attr, mask) = init_attrs(
            1,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        );
        qp.modify(&attr, mask, p).unwrap();
        let cm_qp: Arc<dyn CmQp> = Arc::new(qp.clone());
        ConsumerQp {
            qp,
            cm_qp,
            cq,
            completions,
            destroyed,
        }
    }

    /// Destroys the QP and its CQ (waiting for the QP's destroy callback).
    pub fn destroy(self, w: &World, p: &Passive<'_>) {
        let _ = self.qp.destroy(p);
        w.wait("consumer QP destroyed", || {
            self.destroyed.0.load(Ordering::Acquire) == 1
        });
        drop(self.cm_qp);
        self.cq.destroy(p).unwrap();
        let cq_destroyed = self.completions.clone();
        w.wait("consumer CQ destroyed", || {
            cq_destroyed.destroyed.load(Ordering::Acquire) == 1
        });
    }
}

// ---- the environment --------------------------------------------------------

pub struct Side {
    pub node: Node,
    pub port: CmPort<Hp>,
    pub trace: Arc<Trace>,
}

pub struct Env<'w> {
    pub w: &'w World,
    pub a: Side,
    pub b: Side,
}

impl<'w> Env<'w> {
    pub fn new(w: &'w World, p: &Passive<'_>) -> Env<'w> {
        Self::with_configs(w, p, cm_config(), cm_config())
    }

    pub fn with_configs(
        w: &'w World,
        p: &Passive<'_>,
        cfg_a: CmConfig,
        cfg_b: CmConfig,
    ) -> Env<'w> {
        let side = |ip, cfg: CmConfig| {
            let node = w.node(ip, p);
            let trace = Trace::new();
            let port = CmPort::create(
                &node.dev,
                1,
                CmPortConfig {
                    cm: cfg,
                    recv_buffers: 32,
                    send_buffers: 32,
                    trace: Some(trace.clone()),
                },
                p,
            )
            .unwrap();
            Side { node, port, trace }
        };
        let a = side(IP_A, cfg_a);
        let b = side(IP_B, cfg_b);
        Env { w, a, b }
    }

    pub fn endpoints(&self) -> RdmaCmEndpoints {
        RdmaCmEndpoints {
            port_space: PortSpace::Tcp,
            src: Ipv4Address(IP_A),
            src_port: 40000,
            dst: Ipv4Address(IP_B),
            dst_port: PORT,
        }
    }

    pub fn listen_b(&self, rec: &Arc<Recorder>, p: &Passive<'_>) -> ListenerId {
        let listener: Arc<dyn CmListener> = rec.clone();
        self.b
            .port
            .listen(
                kverbs::wire::ServiceId::rdma_cm(PortSpace::Tcp, PORT),
                ListenKind::RdmaCm,
                &listener,
                p,
            )
            .unwrap()
    }

    /// A connects `qp` with `user` data; events go to `rec`.
    pub fn connect_a(
        &self,
        qp: &ConsumerQp,
        user: &[u8],
        rec: &Arc<Recorder>,
        p: &Passive<'_>,
    ) -> Result<CmId, CmError> {
        let handler: Arc<dyn CmHandler> = rec.clone();
        self.a.port.connect_rdma_cm(
            &self.endpoints(),
            user,
            ConnParams::SRP,
            None,
            &qp.cm_qp,
            &handler,
            p,
        )
    }

    /// Sets the faults on the link `from → to` (0 = A, 1 = B).
    pub fn faults(&self, from: usize, to: usize, cfg: FaultConfig) {
        let hca = |i: usize| {
            if i == 0 {
                &self.a.node.hca
            } else {
                &self.b.node.hca
            }
        };
        self.w.fabric.set_link_faults(hca(from), hca(to), cfg);
    }

    /// Closes both ports, waits for every consumer to have its terminal
    /// event, releases them and the PDs (consumer QPs must be destroyed
    /// first). The caller ends with `World::finish` (the verifier).
    pub fn teardown(self, p: &Passive<'_>) {
        for side in [&self.a, &self.b] {
            side.port.close(p);
        }
        for side in [&self.a, &self.b] {
            self.w.wait("consumers have their last events", || {
                side.port.pending_consumers(p) == (0, 0)
            });
        }
        // Every CM id ends on its own (timewait included): none is left
        // for release to forget.
        for side in [&self.a, &self.b] {
            self.w
                .wait("every CM id ended", || side.port.connections_in_use(p) == 0);
        }
        for side in [&self.a, &self.b] {
            self.w.wait("QP1 released", || match side.port.release(p) {
                Ok(()) => true,
                Err(CmError::Busy) => false,
                Err(e) => panic!("release: {e:?}"),
            });
            let stats = side.port.stats(p);
            assert_eq!(stats.engine.emit_failures, 0);
            assert_eq!(stats.repost_failures, 0);
        }
        let Env { a, b, .. } = self;
        for side in [a, b] {
            side.node.pd.dealloc(p).unwrap();
        }
    }
}

/// Drop everything the first `n` matching frames need: a one-shot full
/// loss on a link, lifted by the test.
pub fn all_lost() -> FaultConfig {
    FaultConfig {
        drop: 1.0,
        ..FaultConfig::default()
    }
}

pub fn no_faults() -> FaultConfig {
    FaultConfig::default()
}

pub fn threaded() -> World {
    World::new(Mode::Threaded)
}

// ---- a raw QP1 for hand-made MADs -------------------------------------------

/// A third node whose QP1 the test drives by hand: it sends any bytes as a
/// MAD to another port's QP1 and collects what comes back.
pub struct RawMads {
    pub node: Node,
    pub qp: Qp<Hp, u32>,
    pub cq: Cq<Hp, u32>,
    pub completions: Arc<Collect<u32>>,
    pub destroyed: Arc<Destroyed>,
    pub send_mr: kverbs::mr::Mr<Hp>,
    pub recv_mr: kverbs::mr::Mr<Hp>,
    next_send: AtomicUsize,
}

const RAW_SLOTS: u32 = 16;

impl RawMads {
    pub fn new(w: &World, ip: [u8; 4], p: &Passive<'_>) -> RawMads {
        let node = w.node(ip, p);
        let completions = Collect::<u32>::new(1024);
        let cq = node.cq(128, completions.clone(), p);
        let destroyed = Arc::new(Destroyed::default());
        let qp = node.qp_with(QpType::Gsi, &cq, 32, RAW_SLOTS, destroyed.clone(), p);
        crate::vsupport::bring_up(&qp, None, p);
        let send_mr =
            kverbs::mr::Mr::alloc(&node.pd, 64 * 256, AccessFlags::LOCAL_WRITE, p).unwrap();
        let recv_mr = kverbs::mr::Mr::alloc(
            &node.pd,
            RAW_SLOTS as usize * 512,
            AccessFlags::LOCAL_WRITE,
            p,
        )
        .unwrap();
        let raw = RawMads {
            node,
            qp,
            cq,
            completions,
            destroyed,
            send_mr,
            recv_mr,
            next_send: AtomicUsize::new(0),
        };
        for slot in 0..RAW_SLOTS {
            raw.post_recv(slot, p);
        }
        raw
    }

    fn post_recv(&self, slot: u32, p: &Passive<'_>) {
        let mut r = self.qp.begin_recv(p).unwrap();
        r.recv_ud(&self.recv_mr, u64::from(slot) * 512, 512, 1000 + slot)
            .unwrap();
        r.commit();
    }

    pub fn gid(&self) -> Gid {
        self.node.gid()
    }

    /// Sends `mad` (any length up to 256) to the QP1 at `to`.
    pub fn send(&self, to: Gid, mad: &[u8], p: &Passive<'_>) {
        use kverbs::wr::{Payload, SendWr, Signal, UdDest};
        let slot = self.next_send.fetch_add(1, Ordering::AcqRel) % 64;
        self.send_mr.mem().write(slot * 256, mad).unwrap();
        let sge = self
            .send_mr
            .sge(slot as u64 * 256, mad.len() as u32)
            .unwrap();
        let dest = UdDest {
            qpn: 1,
            qkey: hca_lowlevel::device::GSI_QKEY,
            dgid: to,
            traffic_class: 0,
            hop_limit: 64,
            flow_label: 0,
            sl: 0,
        };
        let mut s = self.qp.begin_send(p).unwrap();
        s.send_ud(
            &dest,
            &SendWr::new(Payload::Sges(&[sge])),
            Signal::Signalled(slot as u32),
        )
        .unwrap();
        s.commit();
    }

    /// MADs received since the last call (receives reposted).
    pub fn received(&self, p: &Passive<'_>) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        for c in self.completions.take() {
            if let Some(ctx) = c.context {
                if ctx >= 1000 && c.status == kverbs::wr::WcStatus::Success {
                    let slot = ctx - 1000;
                    let len = c.byte_len as usize - kverbs::wr::GRH_LEN;
                    let mut buf = vec![0u8; len];
                    self.recv_mr
                        .mem()
                        .read(slot as usize * 512 + kverbs::wr::GRH_LEN, &mut buf)
                        .unwrap();
                    out.push(buf);
                    self.post_recv(slot, p);
                }
            }
        }
        out
    }

    pub fn destroy(self, w: &World, p: &Passive<'_>) {
        self.qp.destroy(p).unwrap();
        w.wait("raw QP1 destroyed", || {
            self.destroyed.0.load(Ordering::Acquire) == 1
        });
        self.cq.destroy(p).unwrap();
        self.send_mr.dereg(p).unwrap();
        self.recv_mr.dereg(p).unwrap();
        self.node.pd.dealloc(p).unwrap();
    }
}
