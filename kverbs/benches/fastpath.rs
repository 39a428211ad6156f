//! Fast-path benchmark (not a test): post + poll of a signalled 64-byte
//! SEND, and of a REG_MR + SEND pair (one doorbell), N times each, on the
//! stepped software HCA (doorbells not inline, so the device model runs
//! outside kverbs' functions).
//!
//! `cargo bench -p kverbs --bench fastpath` prints wall-clock rates;
//! `kverbs/benches/callgrind.sh` counts instructions per operation spent in
//! kverbs' fast-path functions only (callgrind `--toggle-collect`).
//! `KVERBS_BENCH_N` sets N (default 20,000).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use hca_lowlevel::device::{AccessFlags, AddressVector, Mtu, QpAttr, QpAttrMask, QpState, QpType};
use hca_lowlevel::dma::PhysAddr;
use hca_lowlevel::sim::{Fabric, HcaConfig};
use kverbs::cq::{Cq, CqConfig, CqHandler};
use kverbs::device::{Device, DeviceConfig};
use kverbs::drain::Budget;
use kverbs::hostdev::VerifiedHca;
use kverbs::irql::{Dispatch, Passive};
use kverbs::mr::{FrPool, Mr};
use kverbs::platform::host::HostPlatform;
use kverbs::qp::{NoQpEvents, Qp, QpConfig};
use kverbs::wr::{Completion, FastReg, Payload, SendWr, Signal};

type Hp = HostPlatform;

#[derive(Default)]
struct Count(AtomicU64);

impl CqHandler<u64> for Count {
    fn on_completion(&self, c: Completion<u64>, _irql: &Dispatch<'_>) {
        // Teardown flushes the last receive; everything measured succeeds.
        if c.is_success() {
            self.0.fetch_add(1, Ordering::Relaxed);
        } else {
            assert_eq!(c.status, kverbs::wr::WcStatus::Flushed);
        }
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
        .unwrap();
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
    .unwrap();
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
    .unwrap();
}

/// Posts the receive for the next message (the peer side; measured too,
/// as a target would repost).
#[inline(never)]
fn repost(qb: &Qp<Hp, u64>, sge: kverbs::wr::Sge, i: u64, p: &Passive<'_>) {
    let mut r = qb.begin_recv(p).unwrap();
    r.recv(&[sge], i).unwrap();
    r.commit();
}

fn main() {
    let n: u64 = std::env::var("KVERBS_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let platform = HostPlatform::manual();
    let fabric = Fabric::stepped();
    platform.run_passive(|p| {
        let ha = fabric.add_hca(HcaConfig::new([10, 0, 0, 1]));
        let hb = fabric.add_hca(HcaConfig::new([10, 0, 0, 2]));
        let da = Device::open(
            &platform,
            VerifiedHca::new(ha.clone()),
            DeviceConfig::default(),
            p,
        )
        .unwrap();
        let db = Device::open(
            &platform,
            VerifiedHca::new(hb.clone()),
            DeviceConfig::default(),
            p,
        )
        .unwrap();
        let (pa, pb) = (da.alloc_pd(p).unwrap(), db.alloc_pd(p).unwrap());
        let (ca, cb) = (Arc::new(Count::default()), Arc::new(Count::default()));
        let cq_a = Cq::create(&da, CqConfig::new(256), ca.clone(), p).unwrap();
        let cq_b = Cq::create(&db, CqConfig::new(256), cb.clone(), p).unwrap();
        let cfg = |cq: &Cq<Hp, u64>| QpConfig {
            qp_type: QpType::Rc,
            send_cq: cq.clone(),
            recv_cq: cq.clone(),
            send_wqebbs: 32,
            recv_slots: 32,
            max_recv_sge: 1,
            port: 1,
        };
        let qa = Qp::create(&pa, &cfg(&cq_a), Arc::new(NoQpEvents), p).unwrap();
        let qb = Qp::create(&pb, &cfg(&cq_b), Arc::new(NoQpEvents), p).unwrap();
        up(&qa, hb.gid(), qb.qpn(), p);
        up(&qb, ha.gid(), qa.qpn(), p);
        let src = Mr::alloc(&pa, 8192, AccessFlags::LOCAL_WRITE, p).unwrap();
        let dst = Mr::alloc(&pb, 8192, AccessFlags::LOCAL_WRITE, p).unwrap();
        let pool = FrPool::new(&pa, 4, 32, p).unwrap();
        let io = Mr::alloc(&pa, 8 * 4096, AccessFlags::LOCAL_WRITE, p).unwrap();
        let pages: Vec<PhysAddr> = (0..8)
            .map(|i| PhysAddr(io.mem().phys_addr().get() + i * 4096))
            .collect();
        let send_sge = src.sge(0, 64).unwrap();
        let recv_sge = dst.sge(0, 64).unwrap();
        repost(&qb, recv_sge, 0, p);

        // 1. Signalled 64-byte SEND: post, device, poll.
        let start = Instant::now();
        for i in 0..n {
            bench_send(&qa, send_sge, i, p);
            fabric.run_until_idle();
            bench_poll(&cq_a, p);
            bench_poll(&cq_b, p);
            repost(&qb, recv_sge, i + 1, p);
        }
        let t_send = start.elapsed();
        assert_eq!(ca.0.load(Ordering::Relaxed), n);

        // 2. REG_MR (8 pages, chained LOCAL_INV of the previous key) + SEND,
        //    one doorbell.
        let mut fr = pool.get(p).unwrap();
        let start = Instant::now();
        for i in 0..n {
            bench_reg_send(&qa, &mut fr, &pages, send_sge, i, p);
            fabric.run_until_idle();
            bench_poll(&cq_a, p);
            bench_poll(&cq_b, p);
            repost(&qb, recv_sge, i + 1, p);
        }
        let t_reg = start.elapsed();
        assert_eq!(ca.0.load(Ordering::Relaxed), 2 * n);
        println!(
            "fastpath: {n} x signalled 64-byte SEND: {:.0} ns/op (device model included)",
            t_send.as_nanos() as f64 / n as f64
        );
        println!(
            "fastpath: {n} x REG_MR+SEND: {:.0} ns/op (device model included)",
            t_reg.as_nanos() as f64 / n as f64
        );
        println!("fastpath: N={n}");
        drop(fr);
        qa.destroy(p).unwrap();
        qb.destroy(p).unwrap();
        fabric.run_until_idle();
        platform.run_until_idle(&mut |_| 0, 1_000_000);
        fabric.run_until_idle();
        platform.run_until_idle(&mut |_| 0, 1_000_000);
    });
    drop(fabric);
    platform.finish();
}

/// Fast-path entry point measured by callgrind: one signalled SEND batch.
#[inline(never)]
fn bench_send(qa: &Qp<Hp, u64>, sge: kverbs::wr::Sge, i: u64, p: &Passive<'_>) {
    let mut s = qa.begin_send(p).unwrap();
    s.send(&SendWr::new(Payload::Sges(&[sge])), Signal::Signalled(i))
        .unwrap();
    s.commit();
}

/// Fast-path entry point measured by callgrind: REG_MR + SEND, one doorbell.
#[inline(never)]
fn bench_reg_send(
    qa: &Qp<Hp, u64>,
    fr: &mut kverbs::mr::FrMr<Hp>,
    pages: &[PhysAddr],
    sge: kverbs::wr::Sge,
    i: u64,
    p: &Passive<'_>,
) {
    let mut s = qa.begin_send(p).unwrap();
    s.reg_mr(
        fr,
        &FastReg {
            pages,
            page_shift: 12,
            iova: 0x5000_0000,
            length: 8 * 4096,
            access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        },
        Signal::Unsignalled,
    )
    .unwrap();
    s.send(&SendWr::new(Payload::Sges(&[sge])), Signal::Signalled(i))
        .unwrap();
    s.commit();
}

/// Fast-path entry point measured by callgrind: poll + deliver + re-arm.
#[inline(never)]
fn bench_poll(cq: &Cq<Hp, u64>, p: &Passive<'_>) {
    cq.drain_inline(Budget::UNLIMITED, p);
}
