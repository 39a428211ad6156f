//! Bare verbs SEND/RECV ping-pong latency (not a test): the floor under an
//! SRP I/O's latency on the same software fabric kvbench uses (a threaded
//! fabric — the soft HCA's device thread, doorbells run as kvbench's in-process
//! backend runs them, [`kverbs_tools::bench::rdma::in_process_fabric`] — and a
//! threaded host platform).
//!
//! Two RC QPs, A and B, each on its own HCA. The measuring thread posts a
//! signalled 64-byte SEND on A and spins until A's CQ handler (a DPC) has
//! seen the reply; B's CQ handler (a DPC) answers every message it receives
//! with a SEND of its own. One sample is one round trip as the caller sees
//! it — the same span as kvbench's latency of a QD1 I/O, which is a SEND
//! (the command) answered by a SEND (the response), plus the data.
//!
//! The measuring thread sleeps on a condition variable until the reply
//! arrives, as kvbench's workers wait for their I/Os (`--spin`: it spins
//! instead, the lowest latency this host can show).
//!
//! Usage: `verbs_pingpong [--iters N] [--warmup N] [--spin]`; prints one
//! line, `pingpong_us wait=.. mean=.. p50=.. p99=.. min=.. iters=..`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use hca_lowlevel::device::{AccessFlags, AddressVector, Mtu, QpAttr, QpAttrMask, QpState, QpType};
use hca_lowlevel::sim::{Fabric, HcaConfig};
use kverbs::cq::{Cq, CqConfig, CqHandler};
use kverbs::device::{Device, DeviceConfig};
use kverbs::hostdev::VerifiedHca;
use kverbs::irql::{Dispatch, Passive};
use kverbs::mr::Mr;
use kverbs::platform::host::{HostConfig, HostMode, HostPlatform};
use kverbs::qp::{NoQpEvents, Qp, QpConfig};
use kverbs::wr::{Completion, Payload, SendWr, Sge, Signal, WcOpcode, WcStatus};

type Hp = HostPlatform;

/// One side's CQ handler: counts receives; B also answers each one.
struct Side {
    qp: OnceLock<Qp<Hp, u64>>,
    sges: OnceLock<(Sge, Sge)>,
    received: AtomicU64,
    answer: bool,
    /// For a waiter that sleeps (as kvbench's workers do).
    lock: Mutex<()>,
    changed: Condvar,
}

impl Side {
    fn new(answer: bool) -> Self {
        Side {
            qp: OnceLock::new(),
            sges: OnceLock::new(),
            received: AtomicU64::new(0),
            answer,
            lock: Mutex::new(()),
            changed: Condvar::new(),
        }
    }
}

impl CqHandler<u64> for Side {
    fn on_completion(&self, c: Completion<u64>, irql: &Dispatch<'_>) {
        if !c.is_success() {
            // The final teardown flushes the posted receives.
            assert_eq!(c.status, WcStatus::Flushed, "{c:?}");
            return;
        }
        if c.opcode != WcOpcode::Recv {
            return;
        }
        let (Some(qp), Some(&(send, recv))) = (self.qp.get(), self.sges.get()) else {
            return;
        };
        let n = self.received.load(Ordering::Relaxed) + 1;
        // Repost the receive, then (B) answer: one doorbell each.
        let mut r = qp.begin_recv(irql).expect("begin_recv");
        r.recv(&[recv], n).expect("recv");
        r.commit();
        if self.answer {
            let mut s = qp.begin_send(irql).expect("begin_send");
            // Signalled, so the send queue's slots are reclaimed.
            s.send(&SendWr::new(Payload::Sges(&[send])), Signal::Signalled(n))
                .expect("send");
            s.commit();
        }
        {
            let _g = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
            self.received.store(n, Ordering::Release);
        }
        self.changed.notify_all();
    }
}

fn up(qp: &Qp<Hp, u64>, dgid: hca_lowlevel::device::Gid, dqpn: u32, p: &Passive<'_>) {
    use QpAttrMask as M;
    let mut a = QpAttr {
        state: QpState::Init,
        port: 1,
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        ..QpAttr::default()
    };
    qp.modify(&a, M::STATE | M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS, p)
        .expect("INIT");
    a.state = QpState::Rtr;
    a.av = AddressVector {
        dgid,
        hop_limit: 64,
        ..AddressVector::default()
    };
    a.path_mtu = Mtu::Mtu1024;
    a.dest_qpn = dqpn;
    a.max_dest_rd_atomic = 4;
    a.min_rnr_timer = 1;
    qp.modify(
        &a,
        M::STATE
            | M::AV
            | M::PATH_MTU
            | M::DEST_QPN
            | M::RQ_PSN
            | M::MAX_DEST_RD_ATOMIC
            | M::MIN_RNR_TIMER,
        p,
    )
    .expect("RTR");
    a.state = QpState::Rts;
    a.timeout = 14;
    a.retry_cnt = 7;
    a.rnr_retry = 7;
    a.max_rd_atomic = 4;
    qp.modify(
        &a,
        M::STATE | M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::SQ_PSN | M::MAX_QP_RD_ATOMIC,
        p,
    )
    .expect("RTS");
}

fn arg(name: &str, default: u64) -> u64 {
    let mut it = std::env::args();
    while let Some(a) = it.next() {
        if a == name {
            return it.next().and_then(|v| v.parse().ok()).unwrap_or(default);
        }
    }
    default
}

fn main() {
    let iters = arg("--iters", 20_000);
    let warmup = arg("--warmup", 1_000);
    let spin = std::env::args().any(|a| a == "--spin");
    // As kvbench's SRP backend: two simulated processors, a device thread.
    let platform = HostPlatform::with_config(HostConfig {
        mode: HostMode::Threaded,
        processors: 2,
        worker_threads: 2,
        dpc_budget: Duration::from_secs(2),
        ..HostConfig::default()
    });
    // The fabric kvbench's in-process backend runs on (the same doorbell
    // mode: a fair yardstick).
    let fabric = Fabric::new(kverbs_tools::bench::rdma::in_process_fabric());
    let samples = platform.run_passive(|p| {
        let ha = fabric.add_hca(HcaConfig::new([10, 0, 0, 1]));
        let hb = fabric.add_hca(HcaConfig::new([10, 0, 1, 2]));
        let open = |h| {
            Device::open(&platform, VerifiedHca::new(h), DeviceConfig::default(), p)
                .expect("device")
        };
        let (da, db) = (open(ha.clone()), open(hb.clone()));
        let (pa, pb) = (da.alloc_pd(p).expect("pd"), db.alloc_pd(p).expect("pd"));
        let (sa, sb) = (Arc::new(Side::new(false)), Arc::new(Side::new(true)));
        let cq_a = Cq::create(&da, CqConfig::new(256), sa.clone(), p).expect("cq");
        let cq_b = Cq::create(&db, CqConfig::new(256), sb.clone(), p).expect("cq");
        let cfg = |cq: &Cq<Hp, u64>| QpConfig {
            qp_type: QpType::Rc,
            send_cq: cq.clone(),
            recv_cq: cq.clone(),
            send_wqebbs: 32,
            recv_slots: 32,
            max_recv_sge: 1,
            port: 1,
        };
        let qa = Qp::create(&pa, &cfg(&cq_a), Arc::new(NoQpEvents), p).expect("qp");
        let qb = Qp::create(&pb, &cfg(&cq_b), Arc::new(NoQpEvents), p).expect("qp");
        up(&qa, hb.gid(), qb.qpn(), p);
        up(&qb, ha.gid(), qa.qpn(), p);
        let ma = Mr::alloc(&pa, 4096, AccessFlags::LOCAL_WRITE, p).expect("mr");
        let mb = Mr::alloc(&pb, 4096, AccessFlags::LOCAL_WRITE, p).expect("mr");
        let (send_a, recv_a) = (ma.sge(0, 64).expect("sge"), ma.sge(2048, 64).expect("sge"));
        let (send_b, recv_b) = (mb.sge(0, 64).expect("sge"), mb.sge(2048, 64).expect("sge"));
        for (qp, recv) in [(&qa, recv_a), (&qb, recv_b)] {
            let mut r = qp.begin_recv(p).expect("begin_recv");
            r.recv(&[recv], 0).expect("recv");
            r.commit();
        }
        let _ = sa.sges.set((send_a, recv_a));
        let _ = sb.sges.set((send_b, recv_b));
        let _ = sa.qp.set(qa.clone());
        let _ = sb.qp.set(qb.clone());
        let mut samples = Vec::with_capacity(usize::try_from(iters).unwrap_or(0));
        for i in 0..warmup + iters {
            let start = Instant::now();
            let mut s = qa.begin_send(p).expect("begin_send");
            s.send(&SendWr::new(Payload::Sges(&[send_a])), Signal::Signalled(i))
                .expect("send");
            s.commit();
            let deadline = start + Duration::from_secs(10);
            if spin {
                while sa.received.load(Ordering::Acquire) <= i {
                    assert!(Instant::now() < deadline, "no reply to ping {i}");
                    std::hint::spin_loop();
                }
            } else {
                let mut g = sa.lock.lock().unwrap_or_else(PoisonError::into_inner);
                while sa.received.load(Ordering::Acquire) <= i {
                    assert!(Instant::now() < deadline, "no reply to ping {i}");
                    g = sa
                        .changed
                        .wait_timeout(g, Duration::from_millis(100))
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                }
            }
            let elapsed = start.elapsed();
            if i >= warmup {
                samples.push(elapsed);
            }
        }
        qa.destroy(p).expect("destroy");
        qb.destroy(p).expect("destroy");
        samples
    });
    drop(fabric);
    let mut us: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e6).collect();
    us.sort_by(f64::total_cmp);
    let pick = |q: f64| us[((us.len() as f64 - 1.0) * q).round() as usize];
    let mean = us.iter().sum::<f64>() / us.len() as f64;
    println!(
        "pingpong_us wait={} mean={mean:.2} p50={:.2} p99={:.2} min={:.2} iters={}",
        if spin { "spin" } else { "condvar" },
        pick(0.5),
        pick(0.99),
        pick(0.0),
        us.len()
    );
}
