//! Payloads by reference (see [`super::payload`]): the bytes placed, the
//! receiver's checks, and memory freed while a payload references it.

use std::time::Duration;

use super::testkit::*;
use super::*;
use crate::cqe::{CqeRepr, Syndrome};
use crate::device::QpState;
use crate::wqe::{CtrlFlags, SendOpcode};

fn no_errors(cqes: &[CqeRepr]) {
    assert!(cqes.iter().all(|c| c.error().is_none()), "{cqes:?}");
}

/// A WRITE, a SEND and a READ whose data go by reference from several
/// source pieces at different word offsets place exactly their bytes, and
/// nothing around them; every data packet (READ responses included) was
/// delivered by reference.
#[test]
fn one_copy_frames_place_the_right_bytes() {
    let f = Fabric::stepped();
    let (mut a, mut b) = rc_pair(&f, RcOptions::default()).unwrap();
    let src1 = a.buffer(10_000, RW).unwrap();
    let src2 = a.buffer(10_000, RW).unwrap();
    let remote = b.buffer(3 * 8192, RW).unwrap();
    let fill = vec![0xEE; 3 * 8192];
    remote.mem.write(0, &fill).unwrap();
    let d1 = pattern(5000, 1);
    let d2 = pattern(4000, 2);
    src1.mem.write(3, &d1).unwrap();
    src2.mem.write(0, &d2).unwrap();
    let before = f.stats();

    // WRITE: two SGEs (one starting mid-word) to a destination that
    // starts at yet another offset in its word.
    let mut w = rdma_wqe(
        &a.qp,
        SendOpcode::RdmaWrite,
        CtrlFlags::CQ_UPDATE,
        0,
        remote.iova + 5,
        remote.keys.rkey,
        src1.sge(3, 5000),
    );
    w.data(src2.sge(0, 4000)).unwrap();
    a.qp.post_send(&mut w).unwrap();
    f.run_until_idle();
    no_errors(&a.cq.drain());
    let mut want = fill.clone();
    want[5..5005].copy_from_slice(&d1);
    want[5005..9005].copy_from_slice(&d2);
    assert_eq!(remote.bytes(0, want.len()), want);

    // SEND: the same two pieces into two receive SGEs.
    b.qp.post_recv(&[remote.sge(10_001, 2500), remote.sge(16_384, 7000)])
        .unwrap();
    let mut s = send_wqe(
        &a.qp,
        SendOpcode::Send,
        CtrlFlags::CQ_UPDATE,
        0,
        src1.sge(3, 5000),
    );
    s.data(src2.sge(0, 4000)).unwrap();
    a.qp.post_send(&mut s).unwrap();
    f.run_until_idle();
    no_errors(&a.cq.drain());
    let r = b.cq.drain();
    no_errors(&r);
    assert_eq!(r.first().map(|c| c.byte_cnt), Some(9000));
    let sent: Vec<u8> = d1.iter().chain(&d2).copied().collect();
    want[10_001..12_501].copy_from_slice(&sent[..2500]);
    want[16_384..22_884].copy_from_slice(&sent[2500..]);
    assert_eq!(remote.bytes(0, want.len()), want);

    // READ it back: the responder's memory by reference, into two local
    // SGEs at offsets of their own.
    let back = a.buffer(12_000, RW).unwrap();
    back.mem.write(0, &[0x11; 12_000]).unwrap();
    let mut rd = rdma_wqe(
        &a.qp,
        SendOpcode::RdmaRead,
        CtrlFlags::CQ_UPDATE,
        0,
        remote.iova + 5,
        remote.keys.rkey,
        back.sge(1, 3001),
    );
    rd.data(back.sge(4006, 5999)).unwrap();
    a.qp.post_send(&mut rd).unwrap();
    f.run_until_idle();
    no_errors(&a.cq.drain());
    let mut got = back.bytes(1, 3001);
    got.extend(back.bytes(4006, 5999));
    assert_eq!(got, want[5..9005]);
    assert_eq!(back.bytes(0, 1), [0x11]);
    assert_eq!(back.bytes(3002, 1004), vec![0x11; 1004]);

    // 9 packets each for the WRITE and the SEND at MTU 1024, and 9 READ
    // responses.
    let s = f.stats();
    assert_eq!(s.frames_direct - before.frames_direct, 27, "{s:?}");
    assert_eq!(s.dropped_stale_source, 0);
}

/// The receiver's key, bounds and access checks are the same for a
/// payload by reference: a bad rkey and a range past the region fail the
/// WRITE with a remote access error and write nothing; a READ response
/// whose local SGE is too short is a local error.
#[test]
fn by_reference_payloads_keep_the_receivers_checks() {
    type Case = (&'static str, fn(&Buffer) -> (u64, u32));
    let cases: [Case; 3] = [
        ("one byte past the end", |m| {
            (m.iova + 8192 - 2047, m.keys.rkey)
        }),
        ("rotated key byte", |m| (m.iova, m.keys.rkey ^ 0x01)),
        ("before the start", |m| (m.iova - 1, m.keys.rkey)),
    ];
    for (what, case) in cases {
        let f = Fabric::stepped();
        let (mut a, b) = rc_pair(&f, RcOptions::default()).unwrap();
        let src = a.buffer(4096, RW).unwrap();
        src.mem.write(0, &pattern(2048, 3)).unwrap();
        let remote = b.buffer(8192, RW).unwrap();
        remote.mem.write(0, &[0x5A; 8192]).unwrap();
        let before = f.stats();
        let (raddr, rkey) = case(&remote);
        let mut w = rdma_wqe(
            &a.qp,
            SendOpcode::RdmaWrite,
            CtrlFlags::CQ_UPDATE,
            0,
            raddr,
            rkey,
            src.sge(0, 2048),
        );
        a.qp.post_send(&mut w).unwrap();
        f.run_until_idle();
        let c = a.cq.drain();
        assert_eq!(
            c.first().and_then(CqeRepr::error),
            Some(Syndrome::RemoteAccess),
            "{what}"
        );
        assert_eq!(
            b.hca.query_qp(b.qp.qpn).unwrap().state,
            QpState::Err,
            "{what}"
        );
        assert_eq!(remote.bytes(0, 8192), vec![0x5A; 8192], "{what}");
        // The request did go by reference.
        assert!(f.stats().frames_direct > before.frames_direct, "{what}");
    }
}

/// A source freed and deregistered while its send references it (the SEND
/// waits out an RNR NAK, then is retransmitted) is never read after free:
/// the pinned memory lives on, unmapped, and the retransmission places the
/// bytes it held when it was freed. (Through its own address the memory is
/// gone: the host cannot write it again.)
#[test]
fn a_source_freed_while_referenced_places_its_last_bytes() {
    let f = Fabric::stepped();
    let (mut a, mut b) = rc_pair(
        &f,
        RcOptions {
            min_rnr_timer: 14,
            ..RcOptions::default()
        },
    )
    .unwrap();
    let data = pattern(3000, 9);
    let src = a.buffer(4096, RW).unwrap();
    src.mem.write(0, &data).unwrap();
    let dst = b.buffer(4096, RW).unwrap();
    let mut w = send_wqe(
        &a.qp,
        SendOpcode::Send,
        CtrlFlags::CQ_UPDATE,
        0,
        src.sge(0, 3000),
    );
    a.qp.post_send(&mut w).unwrap();
    f.run_until_idle();
    assert_eq!(b.hca.qp_stats(b.qp.qpn).unwrap().rnr_naks_sent, 1);
    // Free the source: deregister it and drop the memory.
    let pa = src.mem.phys_addr().get();
    a.hca.dereg_mr(src.keys.lkey).unwrap();
    drop(src);
    assert!(!a.hca.phys_memory().is_mapped(pa, 1));
    b.qp.post_recv(&[dst.sge(0, 4096)]).unwrap();
    f.advance(Duration::from_millis(2));
    f.run_until_idle();
    no_errors(&a.cq.drain());
    let r = b.cq.drain();
    no_errors(&r);
    assert_eq!(r.first().map(|c| c.byte_cnt), Some(3000));
    assert_eq!(dst.bytes(0, 3000), data);
}

/// The later packets of a multi-packet WRITE are placed through the memory
/// resolved at its first packet ([`super::resources::WriteTarget`]) only
/// while that still holds: with the MR deregistered, or its memory freed,
/// between two packets of the message, the rest is refused with a remote
/// access error and writes nothing; untouched, the whole message lands.
#[test]
fn a_write_target_is_not_used_once_its_mr_or_memory_is_gone() {
    for case in ["intact", "deregistered", "freed"] {
        let f = Fabric::stepped();
        let (mut a, mut b) = rc_pair(&f, RcOptions::default()).unwrap();
        let data = pattern(4096, 4);
        let src = a.buffer(4096, RW).unwrap();
        src.mem.write(0, &data).unwrap();
        let remote = b.buffer(4096, RW).unwrap();
        remote.mem.write(0, &[0x5A; 4096]).unwrap();
        // Record the WRITE's four packets (MTU 1024) instead of delivering
        // them, then hand them to the responder one by one.
        f.set_capture(true);
        let lost = FaultConfig {
            drop: 1.0,
            ..FaultConfig::default()
        };
        f.set_link_faults(&a.hca, &b.hca, lost);
        let mut w = rdma_wqe(
            &a.qp,
            SendOpcode::RdmaWrite,
            CtrlFlags::CQ_UPDATE,
            0,
            remote.iova,
            remote.keys.rkey,
            src.sge(0, 4096),
        );
        a.qp.post_send(&mut w).unwrap();
        f.step();
        let frames: Vec<Vec<u8>> = f.take_captured().into_iter().map(|c| c.bytes).collect();
        assert_eq!(frames.len(), 4, "{case}");
        f.set_capture(false);
        f.set_link_faults(&a.hca, &b.hca, FaultConfig::default());
        let mut frames = frames.into_iter();
        for frame in frames.by_ref().take(2) {
            f.inject(&b.hca, frame);
        }
        assert_eq!(remote.bytes(0, 2048), data[..2048], "{case}");
        let Buffer { mem, keys, .. } = remote;
        let mem = match case {
            "deregistered" => {
                b.hca.dereg_mr(keys.lkey).unwrap();
                Some(mem)
            }
            "freed" => {
                drop(mem);
                None
            }
            _ => Some(mem),
        };
        for frame in frames {
            f.inject(&b.hca, frame);
        }
        f.run_until_idle();
        let c = a.cq.drain();
        let state = b.hca.query_qp(b.qp.qpn).unwrap().state;
        if case == "intact" {
            no_errors(&c);
            assert_eq!(c.len(), 1);
            assert_ne!(state, QpState::Err);
        } else {
            assert_eq!(
                c.first().and_then(CqeRepr::error),
                Some(Syndrome::RemoteAccess),
                "{case}"
            );
            assert_eq!(state, QpState::Err, "{case}");
        }
        if let Some(mem) = mem {
            let mut got = vec![0u8; 4096];
            mem.read(0, &mut got).unwrap();
            let mut want = data.clone();
            if case != "intact" {
                want[2048..].fill(0x5A);
            }
            assert_eq!(got, want, "{case}");
        }
        let _ = &mut b;
    }
}
