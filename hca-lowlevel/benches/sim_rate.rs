//! Message rate and bandwidth of the software HCA, beside a plain memcpy
//! measured in the same run.
//!
//! `cargo bench -p hca-lowlevel --bench sim_rate`
//! (`SIM_RATE_SECS` sets the time per measurement, default 1.)
//!
//! The fabric runs in stepped mode on this thread, so the figures are the
//! engine's own cost (WQE fetch, packetisation into RoCEv2 frames with ICRC,
//! the responder, ACKs, CQEs), not scheduling noise: a batch is posted with
//! one doorbell, the engine runs until idle, the CQs are drained.

use std::hint::black_box;
use std::time::{Duration, Instant};

use hca_lowlevel::device::QpType;
use hca_lowlevel::sim::testkit::{Node, RW, RcOptions, rdma_wqe, send_wqe};
use hca_lowlevel::sim::{Fabric, HcaConfig};
use hca_lowlevel::wqe::{CtrlFlags, SendOpcode};

fn secs() -> Duration {
    let s = std::env::var("SIM_RATE_SECS")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(1.0);
    Duration::from_secs_f64(s)
}

fn pair(f: &Fabric, mtu: hca_lowlevel::device::Mtu) -> (Node, Node) {
    let cfg = |ip| HcaConfig {
        mtu,
        ..HcaConfig::new(ip)
    };
    let a = Node::with_config(f, cfg([10, 0, 0, 1]), QpType::Rc, 1024, 4096).expect("node a");
    let b = Node::with_config(f, cfg([10, 0, 0, 2]), QpType::Rc, 1024, 4096).expect("node b");
    let o = RcOptions {
        mtu,
        ..RcOptions::default()
    };
    a.bring_up(Some((b.hca.gid(), b.qp.qpn)), o)
        .expect("bring up a");
    b.bring_up(Some((a.hca.gid(), a.qp.qpn)), o)
        .expect("bring up b");
    (a, b)
}

/// 64-byte SENDs, 32 per doorbell, every 32nd signalled.
fn send_rate() -> f64 {
    let f = Fabric::stepped();
    let (mut a, mut b) = pair(&f, hca_lowlevel::device::Mtu::Mtu1024);
    let src = a.buffer(4096, RW).expect("buffer");
    let dst = b.buffer(64 * 64, RW).expect("buffer");
    const BATCH: u64 = 32;
    let (mut msgs, start, limit) = (0u64, Instant::now(), secs());
    while start.elapsed() < limit {
        for i in 0..BATCH {
            b.qp.post_recv(&[dst.sge(i * 64, 64)]).expect("recv");
            let flags = if i + 1 == BATCH {
                CtrlFlags::CQ_UPDATE
            } else {
                CtrlFlags::empty()
            };
            let mut w = send_wqe(&a.qp, SendOpcode::Send, flags, 0, src.sge(0, 64));
            a.qp.write_send(&mut w).expect("send");
        }
        a.qp.ring_sq();
        f.run_until_idle();
        let s = a.cq.drain().len() as u64;
        let r = b.cq.drain().len() as u64;
        assert_eq!((s, r), (1, BATCH), "completions");
        msgs += BATCH;
    }
    msgs as f64 / start.elapsed().as_secs_f64()
}

/// RDMA WRITEs of `size` bytes, `batch` per doorbell; returns bytes/s.
fn write_bandwidth(size: usize, batch: usize) -> f64 {
    let f = Fabric::stepped();
    let (mut a, b) = pair(&f, hca_lowlevel::device::Mtu::Mtu4096);
    let src = a.buffer(size * batch, RW).expect("buffer");
    let dst = b.buffer(size * batch, RW).expect("buffer");
    src.mem.write(0, &vec![0xa5; size * batch]).expect("fill");
    let (mut bytes, start, limit) = (0u64, Instant::now(), secs());
    while start.elapsed() < limit {
        for i in 0..batch {
            let off = (i * size) as u64;
            let flags = if i + 1 == batch {
                CtrlFlags::CQ_UPDATE
            } else {
                CtrlFlags::empty()
            };
            let mut w = rdma_wqe(
                &a.qp,
                SendOpcode::RdmaWrite,
                flags,
                0,
                dst.iova + off,
                dst.keys.rkey,
                src.sge(off, size as u32),
            );
            a.qp.write_send(&mut w).expect("write");
        }
        a.qp.ring_sq();
        f.run_until_idle();
        assert_eq!(a.cq.drain().len(), 1, "completions");
        bytes += (size * batch) as u64;
    }
    assert_eq!(
        dst.bytes(size * batch - 8, 8),
        vec![0xa5; 8],
        "data arrived"
    );
    bytes as f64 / start.elapsed().as_secs_f64()
}

/// Plain memcpy of `size`-byte blocks between two heap buffers; bytes/s.
fn memcpy_bandwidth(size: usize) -> f64 {
    let src = vec![0x5au8; size];
    let mut dst = vec![0u8; size];
    let (mut bytes, start, limit) = (0u64, Instant::now(), secs());
    while start.elapsed() < limit {
        for _ in 0..64 {
            dst.copy_from_slice(black_box(&src));
            black_box(&mut dst);
        }
        bytes += 64 * size as u64;
    }
    bytes as f64 / start.elapsed().as_secs_f64()
}

fn main() {
    // `cargo test --benches` passes --bench-less arguments; run only under
    // `cargo bench` (which passes `--bench`).
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let gib = |b: f64| b / (1u64 << 30) as f64;
    println!(
        "software HCA (stepped, one thread), {:.1} s per figure",
        secs().as_secs_f64()
    );
    println!(
        "  64 B SEND message rate         {:>10.0} msg/s",
        send_rate()
    );
    println!(
        "  4 KiB RDMA WRITE bandwidth     {:>10.3} GiB/s",
        gib(write_bandwidth(4096, 32))
    );
    println!(
        "  128 KiB RDMA WRITE bandwidth   {:>10.3} GiB/s",
        gib(write_bandwidth(128 << 10, 8))
    );
    println!(
        "  memcpy 4 KiB blocks            {:>10.3} GiB/s",
        gib(memcpy_bandwidth(4096))
    );
    println!(
        "  memcpy 128 KiB blocks          {:>10.3} GiB/s",
        gib(memcpy_bandwidth(128 << 10))
    );
}
