//! Tests of the software HCA through the raw test kit.

use std::sync::Arc;
use std::time::Duration;

use super::testkit::*;
use super::*;
use crate::cqe::{CqeOpcode, CqeRepr, Syndrome};
use crate::device::{AsyncEvent, GSI_QKEY, GSI_QPN, QpState};
use crate::dma::PhysAddr;
use crate::wire::{Operation, RoceV2FrameRepr};
use crate::wqe::{CtrlFlags, DataSegRepr, DatagramSegRepr, RegMrSegRepr, SendOpcode};

fn pair() -> (Fabric, Node, Node) {
    let f = Fabric::stepped();
    let (a, b) = rc_pair(&f, RcOptions::default()).unwrap();
    (f, a, b)
}

fn one(cq: &mut RawCq) -> CqeRepr {
    let v = cq.drain();
    assert_eq!(v.len(), 1, "{v:?}");
    v[0]
}

#[test]
fn send_receive_with_completions() {
    let (f, mut a, mut b) = pair();
    let src = a.buffer(4096, RW).unwrap();
    let dst = b.buffer(4096, RW).unwrap();
    let data = pattern(64, 1);
    src.mem.write(0, &data).unwrap();
    b.qp.post_recv(&[dst.sge(0, 4096)]).unwrap();
    let mut w = send_wqe(
        &a.qp,
        SendOpcode::Send,
        CtrlFlags::CQ_UPDATE,
        0,
        src.sge(0, 64),
    );
    let c = a.qp.post_send(&mut w).unwrap();
    // Stepped: nothing happens until the test runs the device.
    assert!(a.cq.poll().is_none());
    f.run_until_idle();
    let s = one(&mut a.cq);
    assert_eq!(
        (s.opcode, s.wqe_opcode, s.wqe_counter, s.qpn),
        (CqeOpcode::Req, 0x0a, c, a.qp.qpn)
    );
    let r = one(&mut b.cq);
    assert_eq!(
        (r.opcode, r.byte_cnt, r.wqe_counter, r.qpn),
        (CqeOpcode::RespSend, 64, 0, b.qp.qpn)
    );
    assert_eq!(dst.bytes(0, 64), data);
}

/// Gather buffers are recycled without being shortened or cleared: a short
/// SEND after a long one carries exactly its own bytes (no stale tail), and
/// a long one after a short one all of its own.
#[test]
fn recycled_gather_buffers_carry_only_their_own_bytes() {
    let (f, mut a, mut b) = pair();
    let src = a.buffer(3 * 20_000, RW).unwrap();
    let dst = b.buffer(3 * 20_000, RW).unwrap();
    let lens = [20_000u32, 100, 20_000];
    for (i, &len) in lens.iter().enumerate() {
        let at = i as u64 * 20_000;
        let data = pattern(len as usize, 40 + i as u8);
        src.mem.write(at as usize, &data).unwrap();
        dst.mem.write(at as usize, &vec![0xEE; 20_000]).unwrap();
        b.qp.post_recv(&[dst.sge(at, 20_000)]).unwrap();
        let mut w = send_wqe(
            &a.qp,
            SendOpcode::Send,
            CtrlFlags::CQ_UPDATE,
            0,
            src.sge(at, len),
        );
        a.qp.post_send(&mut w).unwrap();
        f.run_until_idle();
        assert_eq!(one(&mut a.cq).error(), None);
        let r = one(&mut b.cq);
        assert_eq!(r.byte_cnt, len, "send {i}");
        assert_eq!(dst.bytes(at as usize, len as usize), data, "send {i}");
        let rest = 20_000 - len as usize;
        assert_eq!(
            dst.bytes(at as usize + len as usize, rest),
            vec![0xEE; rest],
            "send {i}: bytes past the message"
        );
    }
}

#[test]
fn immediate_and_multi_packet_segmentation() {
    let (f, mut a, mut b) = pair();
    let src = a.buffer(8192, RW).unwrap();
    let dst = b.buffer(8192, RW).unwrap();
    let data = pattern(3000, 7);
    src.mem.write(0, &data).unwrap();
    b.qp.post_recv(&[dst.sge(0, 1000), dst.sge(4096, 4096)])
        .unwrap();
    f.set_capture(true);
    let mut w = send_wqe(
        &a.qp,
        SendOpcode::SendImm,
        CtrlFlags::CQ_UPDATE | CtrlFlags::SOLICITED,
        0x1234_5678,
        src.sge(0, 3000),
    );
    a.qp.post_send(&mut w).unwrap();
    f.run_until_idle();
    let r = one(&mut b.cq);
    assert_eq!(
        (r.opcode, r.byte_cnt, r.imm_inval_pkey, r.solicited),
        (CqeOpcode::RespSendImm, 3000, 0x1234_5678, true)
    );
    assert_eq!(dst.bytes(0, 1000), data[..1000]);
    assert_eq!(dst.bytes(4096, 2000), data[1000..]);
    // FIRST and MIDDLE carry exactly the MTU; AckReq only on the last.
    let frames = f.take_captured();
    let reqs: Vec<_> = frames
        .iter()
        .map(|c| RoceV2FrameRepr::parse(&c.bytes).unwrap().packet)
        .filter(|p| p.bth.opcode.is_request())
        .map(|p| {
            (
                p.bth.opcode.operation(),
                p.payload.len(),
                p.bth.ack_req,
                p.bth.psn.get(),
                p.bth.solicited,
            )
        })
        .collect();
    assert_eq!(
        reqs,
        vec![
            (Operation::SendFirst, 1024, false, 0xab_cdef, false),
            (Operation::SendMiddle, 1024, false, 0xab_cdf0, false),
            (Operation::SendLastWithImmediate, 952, true, 0xab_cdf1, true),
        ]
    );
    one(&mut a.cq);
}

#[test]
fn psn_wraps_modulo_2_24() {
    let f = Fabric::stepped();
    let (mut a, mut b) = rc_pair(
        &f,
        RcOptions {
            psn: 0xff_fffe,
            ..RcOptions::default()
        },
    )
    .unwrap();
    let src = a.buffer(8192, RW).unwrap();
    let dst = b.buffer(8192, RW).unwrap();
    src.mem.write(0, &pattern(4000, 3)).unwrap();
    f.set_capture(true);
    for _ in 0..2 {
        b.qp.post_recv(&[dst.sge(0, 8192)]).unwrap();
        let mut w = send_wqe(
            &a.qp,
            SendOpcode::Send,
            CtrlFlags::CQ_UPDATE,
            0,
            src.sge(0, 4000),
        );
        a.qp.post_send(&mut w).unwrap();
    }
    f.run_until_idle();
    assert_eq!(a.cq.drain().len(), 2);
    assert_eq!(b.cq.drain().len(), 2);
    let psns: Vec<u32> = f
        .take_captured()
        .iter()
        .map(|c| RoceV2FrameRepr::parse(&c.bytes).unwrap().packet)
        .filter(|p| p.bth.opcode.is_request())
        .map(|p| p.bth.psn.get())
        .collect();
    assert_eq!(psns, vec![0xff_fffe, 0xff_ffff, 0, 1, 2, 3, 4, 5]);
}

/// Frames are emitted into recycled buffers: every frame on the wire must be
/// byte for byte what its emitter writes into a zeroed buffer (no byte of an
/// earlier frame survives in a header's reserved bits or bytes).
#[test]
fn recycled_frame_buffers_emit_what_zeroed_ones_do() {
    let (f, mut a, mut b) = pair();
    let local = a.buffer(16384, RW).unwrap();
    let remote = b.buffer(16384, RW).unwrap();
    local.mem.write(0, &pattern(16384, 5)).unwrap();
    f.set_capture(true);
    for round in 0..3u32 {
        world::poison_frame_pool();
        b.qp.post_recv(&[remote.sge(8192, 8192)]).unwrap();
        let mut w = send_wqe(
            &a.qp,
            SendOpcode::SendImm,
            CtrlFlags::CQ_UPDATE,
            0x5555_0000 + round,
            local.sge(0, 2500 + round),
        );
        a.qp.post_send(&mut w).unwrap();
        let mut w = rdma_wqe(
            &a.qp,
            SendOpcode::RdmaWrite,
            CtrlFlags::CQ_UPDATE,
            0,
            remote.iova + 3,
            remote.keys.rkey,
            local.sge(1, 3001),
        );
        a.qp.post_send(&mut w).unwrap();
        let mut r = rdma_wqe(
            &a.qp,
            SendOpcode::RdmaRead,
            CtrlFlags::CQ_UPDATE,
            0,
            remote.iova + 3,
            remote.keys.rkey,
            local.sge(12_000, 2049),
        );
        a.qp.post_send(&mut r).unwrap();
        f.run_until_idle();
        assert_eq!(a.cq.drain().len(), 3);
        assert_eq!(b.cq.drain().len(), 1);
    }
    let frames = f.take_captured();
    assert!(frames.len() > 20, "{} frames", frames.len());
    for c in &frames {
        let repr = RoceV2FrameRepr::parse(&c.bytes).unwrap();
        let mut fresh = vec![0u8; repr.buffer_len()];
        repr.emit(&mut fresh).unwrap();
        assert_eq!(fresh, c.bytes);
    }
}

#[test]
fn rdma_write_and_read() {
    let (f, mut a, mut b) = pair();
    let local = a.buffer(16384, RW).unwrap();
    let remote = b.buffer(16384, RW).unwrap();
    let data = pattern(10_000, 9);
    local.mem.write(0, &data).unwrap();
    let mut w = rdma_wqe(
        &a.qp,
        SendOpcode::RdmaWrite,
        CtrlFlags::CQ_UPDATE,
        0,
        remote.iova + 100,
        remote.keys.rkey,
        local.sge(0, 10_000),
    );
    a.qp.post_send(&mut w).unwrap();
    f.run_until_idle();
    let c = one(&mut a.cq);
    assert_eq!((c.opcode, c.wqe_opcode), (CqeOpcode::Req, 0x08));
    assert!(b.cq.poll().is_none(), "RDMA WRITE consumes no receive");
    assert_eq!(remote.bytes(100, 10_000), data);
    // Read it back into another place.
    let mut r = rdma_wqe(
        &a.qp,
        SendOpcode::RdmaRead,
        CtrlFlags::CQ_UPDATE,
        0,
        remote.iova + 100,
        remote.keys.rkey,
        local.sge(12_000, 4000),
    );
    a.qp.post_send(&mut r).unwrap();
    f.run_until_idle();
    let c = one(&mut a.cq);
    assert_eq!(
        (c.opcode, c.wqe_opcode, c.byte_cnt),
        (CqeOpcode::Req, 0x10, 4000)
    );
    assert_eq!(local.bytes(12_000, 4000), data[..4000]);
}

#[test]
fn write_with_immediate_consumes_a_receive() {
    let (f, mut a, mut b) = pair();
    let local = a.buffer(4096, RW).unwrap();
    let remote = b.buffer(4096, RW).unwrap();
    local.mem.write(0, &pattern(2048, 4)).unwrap();
    b.qp.post_recv(&[]).unwrap();
    let mut w = rdma_wqe(
        &a.qp,
        SendOpcode::RdmaWriteImm,
        CtrlFlags::CQ_UPDATE,
        0xfeed,
        remote.iova,
        remote.keys.rkey,
        local.sge(0, 2048),
    );
    a.qp.post_send(&mut w).unwrap();
    f.run_until_idle();
    let r = one(&mut b.cq);
    assert_eq!(
        (r.opcode, r.byte_cnt, r.imm_inval_pkey),
        (CqeOpcode::RespWrImm, 2048, 0xfeed)
    );
    assert_eq!(remote.bytes(0, 2048), pattern(2048, 4));
}

#[test]
fn zero_length_write_needs_no_rkey() {
    let (f, mut a, mut b) = pair();
    // IBA C9-88: no R_Key check for a zero-length RDMA WRITE.
    let mut w = rdma_wqe(
        &a.qp,
        SendOpcode::RdmaWrite,
        CtrlFlags::CQ_UPDATE,
        0,
        0,
        0xdead_beef,
        DataSegRepr::default(),
    );
    a.qp.post_send(&mut w).unwrap();
    f.run_until_idle();
    let c = one(&mut a.cq);
    assert_eq!(c.opcode, CqeOpcode::Req);
    assert!(b.cq.poll().is_none());
    assert_eq!(b.hca.query_qp(b.qp.qpn).unwrap().state, QpState::Rts);
    // A non-zero WRITE with the same bogus key is a remote access error.
    let local = a.buffer(64, RW).unwrap();
    let mut w = rdma_wqe(
        &a.qp,
        SendOpcode::RdmaWrite,
        CtrlFlags::CQ_UPDATE,
        0,
        0,
        0xdead_beef,
        local.sge(0, 8),
    );
    a.qp.post_send(&mut w).unwrap();
    f.run_until_idle();
    assert_eq!(one(&mut a.cq).error(), Some(Syndrome::RemoteAccess));
}

#[test]
fn selective_signalling() {
    let (f, mut a, mut b) = pair();
    let src = a.buffer(4096, RW).unwrap();
    let dst = b.buffer(4096, RW).unwrap();
    for i in 0..4 {
        b.qp.post_recv(&[dst.sge(0, 64)]).unwrap();
        let flags = if i == 3 {
            CtrlFlags::CQ_UPDATE
        } else {
            CtrlFlags::empty()
        };
        let mut w = send_wqe(&a.qp, SendOpcode::Send, flags, 0, src.sge(0, 16));
        a.qp.write_send(&mut w).unwrap();
    }
    a.qp.ring_sq();
    f.run_until_idle();
    let c = a.cq.drain();
    assert_eq!(c.len(), 1);
    assert_eq!(c[0].wqe_counter, 3);
    assert_eq!(b.cq.drain().len(), 4);
}

/// An RC QP connected to itself, both queues on `cq`.
fn loopback_rc_qp(hca: &SoftHca, pd: Pdn, cq: &RawCq, sq_sig_all: bool) -> RawQp {
    let init = QpInit {
        qp_type: QpType::Rc,
        pd,
        send_cq: cq.cqn,
        recv_cq: cq.cqn,
        sq_wqebbs: 8,
        rq_entries: 8,
        max_recv_sge: 1,
        sq_sig_all,
        port: 1,
    };
    let qp = RawQp::new(hca.create_qp(&init).unwrap());
    bring_up_qp(
        hca,
        qp.qpn,
        QpType::Rc,
        Some((hca.gid(), qp.qpn)),
        RcOptions::default(),
    )
    .unwrap();
    qp
}

#[test]
fn sq_sig_all_signals_everything() {
    let f = Fabric::stepped();
    let hca = f.add_hca(HcaConfig::new([10, 0, 0, 9]));
    let pd = hca.alloc_pd().unwrap();
    let log = EventLog::new();
    let mut cq = RawCq::new(hca.create_cq(16, log).unwrap());
    let mut qp = loopback_rc_qp(&hca, pd, &cq, true);
    let mut w = qp.builder(SendOpcode::RdmaWrite, CtrlFlags::empty(), 0);
    w.raddr(0, 0).unwrap();
    qp.post_send(&mut w).unwrap();
    f.run_until_idle();
    assert_eq!(cq.drain().len(), 1);
}

#[test]
fn local_protection_errors_flush_the_rest() {
    let (f, mut a, mut b) = pair();
    let src = a.buffer(4096, RW).unwrap();
    let dst = b.buffer(4096, RW).unwrap();
    b.qp.post_recv(&[dst.sge(0, 4096)]).unwrap();
    // Good, bad lkey (rotated key byte), then two more.
    let mut w0 = send_wqe(
        &a.qp,
        SendOpcode::Send,
        CtrlFlags::empty(),
        0,
        src.sge(0, 8),
    );
    a.qp.write_send(&mut w0).unwrap();
    let mut bad = src.sge(0, 8);
    bad.lkey ^= 1;
    let mut w1 = send_wqe(&a.qp, SendOpcode::Send, CtrlFlags::empty(), 0, bad);
    a.qp.write_send(&mut w1).unwrap();
    for _ in 0..2 {
        let mut w = send_wqe(
            &a.qp,
            SendOpcode::Send,
            CtrlFlags::empty(),
            0,
            src.sge(0, 8),
        );
        a.qp.write_send(&mut w).unwrap();
    }
    a.qp.ring_sq();
    f.run_until_idle();
    let c = a.cq.drain();
    // The unsignalled good one completes silently; the bad one reports
    // LOCAL_PROT; the rest are flushed (flushes always complete).
    let got: Vec<_> = c.iter().map(|c| (c.wqe_counter, c.error())).collect();
    assert_eq!(
        got,
        vec![
            (1, Some(Syndrome::LocalProt)),
            (2, Some(Syndrome::WrFlush)),
            (3, Some(Syndrome::WrFlush))
        ]
    );
    assert_eq!(a.hca.query_qp(a.qp.qpn).unwrap().state, QpState::Err);
    assert_eq!(one(&mut b.cq).opcode, CqeOpcode::RespSend);
    assert!(
        a.events
            .asyncs()
            .contains(&AsyncEvent::QpLastWqeReached { qpn: a.qp.qpn })
    );
    // Posting to a QP in error flushes at once.
    let mut w = send_wqe(
        &a.qp,
        SendOpcode::Send,
        CtrlFlags::CQ_UPDATE,
        0,
        src.sge(0, 8),
    );
    a.qp.post_send(&mut w).unwrap();
    a.qp.post_recv(&[src.sge(0, 8)]).unwrap();
    f.run_until_idle();
    let c = a.cq.drain();
    assert_eq!(c.len(), 2);
    assert!(c.iter().all(|c| c.error() == Some(Syndrome::WrFlush)));
    assert_eq!(
        c.iter().filter(|c| c.opcode == CqeOpcode::RespErr).count(),
        1
    );
}

/// Posts an RDMA WRITE of 8 bytes with `rkey` at `raddr` and returns the
/// requester's error and the responder's state.
fn remote_write_outcome(
    a: &mut Node,
    b: &Node,
    f: &Fabric,
    raddr: u64,
    rkey: u32,
    len: u32,
) -> (Option<Syndrome>, QpState) {
    let local = a.buffer(4096, RW).unwrap();
    let mut w = rdma_wqe(
        &a.qp,
        SendOpcode::RdmaWrite,
        CtrlFlags::CQ_UPDATE,
        0,
        raddr,
        rkey,
        local.sge(0, len),
    );
    a.qp.post_send(&mut w).unwrap();
    f.run_until_idle();
    let c = a.cq.drain();
    (
        c.first().and_then(CqeRepr::error),
        b.hca.query_qp(b.qp.qpn).unwrap().state,
    )
}

#[test]
fn remote_protection_checks() {
    type Case = (&'static str, fn(&Node, &Buffer) -> (u64, u32, u32));
    let cases: [Case; 6] = [
        ("bounds: one byte past the end", |_, m| {
            (m.iova + 4089, m.keys.rkey, 8)
        }),
        ("bounds: before the start", |_, m| {
            (m.iova - 1, m.keys.rkey, 8)
        }),
        ("rotated key byte", |_, m| (m.iova, m.keys.rkey ^ 0x01, 8)),
        ("unknown key", |_, _| (0, 0x00ff_ff00, 8)),
        ("reserved lkey is never an rkey", |_, _| {
            (0x1_0000_0000, RESERVED_LKEY, 8)
        }),
        ("no remote write right", |n, _| {
            let m = n
                .buffer(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ)
                .unwrap();
            let r = (m.iova, m.keys.rkey, 8);
            std::mem::forget(m);
            r
        }),
    ];
    for (what, case) in cases {
        let (f, mut a, mut b) = pair();
        let mr = b.buffer(4096, RW).unwrap();
        // A receive to show the flush on the responder.
        b.qp.post_recv(&[mr.sge(0, 16)]).unwrap();
        let (raddr, rkey, len) = case(&b, &mr);
        let (err, state) = remote_write_outcome(&mut a, &b, &f, raddr, rkey, len);
        assert_eq!(err, Some(Syndrome::RemoteAccess), "{what}");
        assert_eq!(state, QpState::Err, "{what}");
        assert_eq!(
            a.hca.query_qp(a.qp.qpn).unwrap().state,
            QpState::Err,
            "{what}"
        );
        let r = b.cq.drain();
        assert_eq!(r.len(), 1, "{what}");
        assert_eq!(r[0].error(), Some(Syndrome::WrFlush), "{what}");
        assert!(
            b.events
                .asyncs()
                .contains(&AsyncEvent::QpAccessError { qpn: b.qp.qpn }),
            "{what}"
        );
    }
}

#[test]
fn remote_key_of_another_pd_is_rejected() {
    let (f, mut a, b) = pair();
    let other_pd = b.hca.alloc_pd().unwrap();
    let mem = b.hca.dma_allocator().alloc(4096).unwrap();
    let keys = b
        .hca
        .reg_mr(&MrRegistration {
            pd: other_pd,
            iova: 0x5000,
            length: 4096,
            page_shift: 12,
            pages: &pages_of(&mem),
            access: RW,
        })
        .unwrap();
    let (err, state) = remote_write_outcome(&mut a, &b, &f, 0x5000, keys.rkey, 8);
    assert_eq!((err, state), (Some(Syndrome::RemoteAccess), QpState::Err));
}

#[test]
fn qp_without_remote_read_rejects_reads() {
    let f = Fabric::stepped();
    let opts = RcOptions {
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        ..RcOptions::default()
    };
    let (mut a, b) = rc_pair(&f, opts).unwrap();
    let local = a.buffer(64, RW).unwrap();
    let remote = b.buffer(64, RW).unwrap();
    let mut r = rdma_wqe(
        &a.qp,
        SendOpcode::RdmaRead,
        CtrlFlags::CQ_UPDATE,
        0,
        remote.iova,
        remote.keys.rkey,
        local.sge(0, 8),
    );
    a.qp.post_send(&mut r).unwrap();
    f.run_until_idle();
    assert_eq!(one(&mut a.cq).error(), Some(Syndrome::RemoteInvalRequest));
}

#[test]
fn receive_too_small_is_a_length_error() {
    let (f, mut a, mut b) = pair();
    let src = a.buffer(4096, RW).unwrap();
    let dst = b.buffer(4096, RW).unwrap();
    b.qp.post_recv(&[dst.sge(0, 100)]).unwrap();
    let mut w = send_wqe(
        &a.qp,
        SendOpcode::Send,
        CtrlFlags::CQ_UPDATE,
        0,
        src.sge(0, 200),
    );
    a.qp.post_send(&mut w).unwrap();
    f.run_until_idle();
    assert_eq!(one(&mut a.cq).error(), Some(Syndrome::RemoteInvalRequest));
    assert_eq!(one(&mut b.cq).error(), Some(Syndrome::LocalLength));
}

#[test]
fn reserved_lkey_is_local_physical_access() {
    let (f, mut a, mut b) = pair();
    let raw = a.hca.dma_allocator().alloc(256).unwrap();
    raw.write(0, b"physical").unwrap();
    let dst = b.buffer(256, RW).unwrap();
    b.qp.post_recv(&[dst.sge(0, 256)]).unwrap();
    let sge = DataSegRepr {
        byte_count: 8,
        lkey: RESERVED_LKEY,
        addr: raw.phys_addr().get(),
    };
    let mut w = send_wqe(&a.qp, SendOpcode::Send, CtrlFlags::CQ_UPDATE, 0, sge);
    a.qp.post_send(&mut w).unwrap();
    f.run_until_idle();
    assert_eq!(one(&mut a.cq).error(), None);
    assert_eq!(dst.bytes(0, 8), b"physical");
    // Freed memory is unreachable: the device reports an error, nothing else.
    let pa = raw.phys_addr().get();
    drop(raw);
    b.qp.post_recv(&[dst.sge(0, 256)]).unwrap();
    let sge = DataSegRepr {
        byte_count: 8,
        lkey: RESERVED_LKEY,
        addr: pa,
    };
    let mut w = send_wqe(&a.qp, SendOpcode::Send, CtrlFlags::CQ_UPDATE, 0, sge);
    a.qp.post_send(&mut w).unwrap();
    f.run_until_idle();
    assert_eq!(one(&mut a.cq).error(), Some(Syndrome::LocalAccess));
}

fn fast_reg(
    a: &mut Node,
    mkey: u32,
    key: u8,
    buf: &DmaBuffer,
    access: AccessFlags,
    inline: bool,
) -> u32 {
    let pages = pages_of(buf);
    let new_key = (mkey & !0xff) | u32::from(key);
    let reg = RegMrSegRepr {
        mkey: new_key,
        access,
        page_shift: 12,
        inline_list: inline,
        iova: 0x7700_0000,
        length: buf.len() as u64,
        npages: pages.len() as u32,
    };
    let mut w = a.qp.builder(SendOpcode::RegMr, CtrlFlags::CQ_UPDATE, 0);
    if inline {
        w.reg_mr_inline(&reg, &pages).unwrap();
        a.qp.post_send(&mut w).unwrap();
    } else {
        let list = a.hca.dma_allocator().alloc(pages.len() * 8).unwrap();
        for (i, p) in pages.iter().enumerate() {
            list.write(i * 8, &p.get().to_be_bytes()).unwrap();
        }
        let seg = DataSegRepr {
            byte_count: (pages.len() * 8) as u32,
            lkey: RESERVED_LKEY,
            addr: list.phys_addr().get(),
        };
        w.reg_mr_indirect(&reg, seg).unwrap();
        a.qp.post_send(&mut w).unwrap();
        // Keep the list alive until the device has read it.
        std::mem::forget(list);
    }
    new_key
}

#[test]
fn fast_registration_rotation_and_invalidation() {
    for inline in [true, false] {
        let (f, a, mut b) = pair();
        let buf = a.hca.dma_allocator().alloc(3 * 4096).unwrap();
        let mkey = a.hca.alloc_mkey(a.pd, 4).unwrap();
        // Free mkey: unusable.
        let (err, _) = remote_write_outcome(&mut b, &a, &f, 0x7700_0000, mkey, 8);
        assert_eq!(err, Some(Syndrome::RemoteAccess));
        let (f, mut a, mut b) = pair();
        let buf2 = a.hca.dma_allocator().alloc(3 * 4096).unwrap();
        let mkey = a.hca.alloc_mkey(a.pd, 4).unwrap();
        let rkey = fast_reg(&mut a, mkey, 0x42, &buf2, RW, inline);
        f.run_until_idle();
        assert_eq!(one(&mut a.cq).error(), None, "inline {inline}");
        // The peer writes through the new rkey, across a page boundary.
        let src = b.buffer(8192, RW).unwrap();
        src.mem.write(0, &pattern(6000, 5)).unwrap();
        let mut w = rdma_wqe(
            &b.qp,
            SendOpcode::RdmaWrite,
            CtrlFlags::CQ_UPDATE,
            0,
            0x7700_0000 + 100,
            rkey,
            src.sge(0, 6000),
        );
        b.qp.post_send(&mut w).unwrap();
        f.run_until_idle();
        assert_eq!(one(&mut b.cq).error(), None);
        let mut got = vec![0u8; 6000];
        buf2.read(100, &mut got).unwrap();
        assert_eq!(got, pattern(6000, 5));
        // Registering a valid mkey again is an error.
        let _ = fast_reg(&mut a, mkey, 0x43, &buf2, RW, inline);
        f.run_until_idle();
        assert_eq!(one(&mut a.cq).error(), Some(Syndrome::LocalProt));
        drop(buf);
    }
}

#[test]
fn local_invalidate_then_rotated_key() {
    let (f, mut a, mut b) = pair();
    let buf = a.hca.dma_allocator().alloc(4096).unwrap();
    let mkey = a.hca.alloc_mkey(a.pd, 1).unwrap();
    let k1 = fast_reg(&mut a, mkey, 1, &buf, RW, true);
    let mut inv =
        a.qp.builder(SendOpcode::LocalInval, CtrlFlags::CQ_UPDATE, k1);
    a.qp.post_send(&mut inv).unwrap();
    let k2 = fast_reg(&mut a, mkey, 2, &buf, RW, true);
    f.run_until_idle();
    assert_eq!(
        a.cq.drain().iter().map(CqeRepr::error).collect::<Vec<_>>(),
        vec![None, None, None]
    );
    // The old key is dead, the new one works.
    let (err, _) = remote_write_outcome(&mut b, &a, &f, 0x7700_0000, k1, 8);
    assert_eq!(err, Some(Syndrome::RemoteAccess));
    let (f, mut a, mut b) = pair();
    let buf = a.hca.dma_allocator().alloc(4096).unwrap();
    let mkey = a.hca.alloc_mkey(a.pd, 1).unwrap();
    let k = fast_reg(&mut a, mkey, 9, &buf, RW, true);
    f.run_until_idle();
    a.cq.drain();
    let (err, _) = remote_write_outcome(&mut b, &a, &f, 0x7700_0000, k, 8);
    assert_eq!(err, None);
    let _ = k2;
    // Invalidating with a stale key byte fails locally.
    let mut inv =
        a.qp.builder(SendOpcode::LocalInval, CtrlFlags::CQ_UPDATE, k ^ 1);
    a.qp.post_send(&mut inv).unwrap();
    f.run_until_idle();
    assert_eq!(one(&mut a.cq).error(), Some(Syndrome::LocalProt));
}

#[test]
fn send_with_invalidate() {
    let (f, mut a, mut b) = pair();
    let buf = b.hca.dma_allocator().alloc(4096).unwrap();
    let mkey = b.hca.alloc_mkey(b.pd, 1).unwrap();
    let rkey = fast_reg(&mut b, mkey, 7, &buf, RW, true);
    f.run_until_idle();
    b.cq.drain();
    let rbuf = b.buffer(64, RW).unwrap();
    b.qp.post_recv(&[rbuf.sge(0, 64)]).unwrap();
    let src = a.buffer(64, RW).unwrap();
    let mut w = send_wqe(
        &a.qp,
        SendOpcode::SendInval,
        CtrlFlags::CQ_UPDATE,
        rkey,
        src.sge(0, 32),
    );
    a.qp.post_send(&mut w).unwrap();
    f.run_until_idle();
    let r = one(&mut b.cq);
    assert_eq!(
        (r.opcode, r.imm_inval_pkey, r.byte_cnt),
        (CqeOpcode::RespSendInv, rkey, 32)
    );
    one(&mut a.cq);
    // The rkey is gone.
    let (err, _) = remote_write_outcome(&mut a, &b, &f, 0x7700_0000, rkey, 8);
    assert_eq!(err, Some(Syndrome::RemoteAccess));
}

#[test]
fn rnr_waits_and_retries() {
    let f = Fabric::stepped();
    let (mut a, mut b) = rc_pair(
        &f,
        RcOptions {
            min_rnr_timer: 14,
            ..RcOptions::default()
        },
    )
    .unwrap();
    let src = a.buffer(64, RW).unwrap();
    let dst = b.buffer(64, RW).unwrap();
    let mut w = send_wqe(
        &a.qp,
        SendOpcode::Send,
        CtrlFlags::CQ_UPDATE,
        0,
        src.sge(0, 8),
    );
    a.qp.post_send(&mut w).unwrap();
    f.run_until_idle();
    assert!(a.cq.poll().is_none());
    assert_eq!(b.hca.qp_stats(b.qp.qpn).unwrap().rnr_naks_sent, 1);
    b.qp.post_recv(&[dst.sge(0, 64)]).unwrap();
    // Nothing before the RNR timer (1.28 ms) expires.
    f.advance(Duration::from_micros(1000));
    assert!(a.cq.poll().is_none());
    f.advance(Duration::from_micros(300));
    assert_eq!(one(&mut a.cq).error(), None);
    assert_eq!(one(&mut b.cq).byte_cnt, 8);
}

#[test]
fn rnr_retry_exhaustion() {
    let f = Fabric::stepped();
    let (mut a, b) = rc_pair(
        &f,
        RcOptions {
            rnr_retry: 2,
            min_rnr_timer: 1,
            ..RcOptions::default()
        },
    )
    .unwrap();
    let src = a.buffer(64, RW).unwrap();
    let mut w = send_wqe(
        &a.qp,
        SendOpcode::Send,
        CtrlFlags::CQ_UPDATE,
        0,
        src.sge(0, 8),
    );
    a.qp.post_send(&mut w).unwrap();
    f.advance(Duration::from_millis(10));
    assert_eq!(one(&mut a.cq).error(), Some(Syndrome::RnrRetryExceeded));
    assert_eq!(b.hca.qp_stats(b.qp.qpn).unwrap().rnr_naks_sent, 3);
}

#[test]
fn gsi_datagrams_with_grh_and_qkey_check() {
    let f = Fabric::stepped();
    let mut a = Node::new(&f, [10, 0, 0, 1], QpType::Gsi).unwrap();
    let mut b = Node::new(&f, [10, 0, 0, 2], QpType::Gsi).unwrap();
    assert_eq!(a.qp.qpn, GSI_QPN);
    a.bring_up(
        None,
        RcOptions {
            qkey: GSI_QKEY,
            ..RcOptions::default()
        },
    )
    .unwrap();
    b.bring_up(
        None,
        RcOptions {
            qkey: GSI_QKEY,
            ..RcOptions::default()
        },
    )
    .unwrap();
    let src = a.buffer(256, RW).unwrap();
    let dst = b.buffer(512, RW).unwrap();
    src.mem.write(0, &pattern(256, 2)).unwrap();
    b.qp.post_recv(&[dst.sge(0, 512)]).unwrap();
    let av = DatagramSegRepr {
        qkey: GSI_QKEY,
        dqpn: GSI_QPN,
        rgid: b.hca.gid().0,
        hop_limit: 64,
        ..Default::default()
    };
    let mut w = a.qp.builder(SendOpcode::Send, CtrlFlags::CQ_UPDATE, 0);
    w.datagram(&av).unwrap().data(src.sge(0, 256)).unwrap();
    a.qp.post_send(&mut w).unwrap();
    f.run_until_idle();
    assert_eq!(one(&mut a.cq).error(), None);
    let r = one(&mut b.cq);
    assert_eq!(
        (r.opcode, r.byte_cnt, r.src_qpn, r.grh),
        (CqeOpcode::RespSend, 296, GSI_QPN, true)
    );
    let grh = dst.bytes(0, 40);
    assert_eq!(grh[0] >> 4, 6);
    assert_eq!(&grh[8..24], &a.hca.gid().0);
    assert_eq!(&grh[24..40], &b.hca.gid().0);
    assert_eq!(dst.bytes(40, 256), pattern(256, 2));
    // A second GSI QP on the port is refused.
    let cq = b.cq.cqn;
    let init = QpInit {
        qp_type: QpType::Gsi,
        pd: b.pd,
        send_cq: cq,
        recv_cq: cq,
        sq_wqebbs: 4,
        rq_entries: 4,
        max_recv_sge: 1,
        sq_sig_all: false,
        port: 1,
    };
    assert_eq!(
        b.hca.create_qp(&init).err(),
        Some(HcaError::InvalidOperation)
    );
}

#[test]
fn ud_qkey_mismatch_and_small_buffer() {
    let f = Fabric::stepped();
    let mut a = Node::new(&f, [10, 0, 0, 1], QpType::Ud).unwrap();
    let mut b = Node::new(&f, [10, 0, 0, 2], QpType::Ud).unwrap();
    a.bring_up(
        None,
        RcOptions {
            qkey: 0x42,
            ..RcOptions::default()
        },
    )
    .unwrap();
    b.bring_up(
        None,
        RcOptions {
            qkey: 0x43,
            ..RcOptions::default()
        },
    )
    .unwrap();
    let src = a.buffer(256, RW).unwrap();
    let dst = b.buffer(512, RW).unwrap();
    b.qp.post_recv(&[dst.sge(0, 100)]).unwrap();
    let send = |a: &mut Node, qkey: u32, len: u32| {
        let av = DatagramSegRepr {
            qkey,
            dqpn: b.qp.qpn,
            rgid: b.hca.gid().0,
            ..Default::default()
        };
        let mut w = a.qp.builder(SendOpcode::Send, CtrlFlags::CQ_UPDATE, 0);
        w.datagram(&av).unwrap().data(src.sge(0, len)).unwrap();
        a.qp.post_send(&mut w).unwrap();
    };
    // Bit 31 set: use the sender QP's own Q_Key (0x42): dropped at b.
    send(&mut a, 0x8000_0000, 10);
    f.run_until_idle();
    assert!(b.cq.poll().is_none());
    assert_eq!(b.hca.qp_stats(b.qp.qpn).unwrap().ud_dropped, 1);
    // Right Q_Key but 100 bytes cannot hold 40 + 80.
    send(&mut a, 0x43, 80);
    f.run_until_idle();
    assert_eq!(one(&mut b.cq).error(), Some(Syndrome::LocalLength));
    assert_eq!(b.hca.query_qp(b.qp.qpn).unwrap().state, QpState::Rts);
    assert_eq!(a.cq.drain().len(), 2);
}

#[test]
fn cq_events_one_per_arm() {
    let (f, mut a, mut b) = pair();
    let src = a.buffer(64, RW).unwrap();
    let dst = b.buffer(4096, RW).unwrap();
    let send = |a: &mut Node, flags| {
        let mut w = send_wqe(&a.qp, SendOpcode::Send, flags, 0, src.sge(0, 8));
        a.qp.post_send(&mut w).unwrap();
    };
    for _ in 0..4 {
        b.qp.post_recv(&[dst.sge(0, 64)]).unwrap();
    }
    // Not armed: no event.
    send(&mut a, CtrlFlags::empty());
    f.run_until_idle();
    assert!(b.events.completions().is_empty());
    // Armed with a CQE pending: fires at once.
    b.cq.arm(false);
    f.run_until_idle();
    assert_eq!(b.events.completions(), vec![b.cq.cqn]);
    b.cq.ack_event();
    b.cq.drain();
    // One event per arm, however many CQEs.
    b.cq.arm(false);
    send(&mut a, CtrlFlags::empty());
    send(&mut a, CtrlFlags::empty());
    f.run_until_idle();
    assert_eq!(b.events.completions().len(), 2);
    b.cq.ack_event();
    b.cq.drain();
    // Solicited-only: an unsolicited message does not fire; a solicited one does.
    b.cq.arm(true);
    f.run_until_idle();
    assert_eq!(b.events.completions().len(), 2);
    send(&mut a, CtrlFlags::SOLICITED);
    f.run_until_idle();
    assert_eq!(b.events.completions().len(), 3);
}

#[test]
fn stale_arm_is_ignored() {
    let (f, mut a, mut b) = pair();
    let src = a.buffer(64, RW).unwrap();
    let dst = b.buffer(64, RW).unwrap();
    b.qp.post_recv(&[dst.sge(0, 64)]).unwrap();
    b.qp.post_recv(&[dst.sge(0, 64)]).unwrap();
    b.cq.arm(false);
    let mut w = send_wqe(
        &a.qp,
        SendOpcode::Send,
        CtrlFlags::empty(),
        0,
        src.sge(0, 8),
    );
    a.qp.post_send(&mut w).unwrap();
    f.run_until_idle();
    assert_eq!(b.events.completions().len(), 1);
    // The same arm (same sequence number) replayed: no second event.
    b.cq.arm(false);
    let mut w = send_wqe(
        &a.qp,
        SendOpcode::Send,
        CtrlFlags::empty(),
        0,
        src.sge(0, 8),
    );
    a.qp.post_send(&mut w).unwrap();
    f.run_until_idle();
    assert_eq!(b.events.completions().len(), 1);
}

#[test]
fn inline_doorbell_completes_before_post_returns() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    static POSTING: AtomicBool = AtomicBool::new(false);
    struct Probe(AtomicUsize);
    impl CqEventHandler for Probe {
        fn completion_event(&self, _cqn: u32) {
            // Handlers are driver code, not the device model.
            assert!(!device_model_active());
            if POSTING.load(Ordering::SeqCst) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
    }
    let f = Fabric::stepped();
    let (mut a, _b) = rc_pair(&f, RcOptions::default()).unwrap();
    let probe = Arc::new(Probe(AtomicUsize::new(0)));
    let mut cq = RawCq::new(a.hca.create_cq(8, probe.clone()).unwrap());
    let mut qp = loopback_rc_qp(&a.hca, a.pd, &cq, false);
    cq.arm(false);
    f.set_inline_doorbells(true);
    let mut w = qp.builder(SendOpcode::RdmaWrite, CtrlFlags::CQ_UPDATE, 0);
    w.raddr(0, 0).unwrap();
    POSTING.store(true, Ordering::SeqCst);
    qp.post_send(&mut w).unwrap();
    POSTING.store(false, Ordering::SeqCst);
    assert_eq!(
        probe.0.load(Ordering::SeqCst),
        1,
        "the event arrived inside the doorbell write"
    );
    assert_eq!(cq.drain().len(), 1);
    let _ = &mut a;
}

/// `n` receives of 2 KiB on `b`, then `n` signalled 2 KiB SENDs from `a`.
fn post_2k_sends(a: &mut Node, b: &mut Node, src: &Buffer, dst: &Buffer, n: u64) {
    for i in 0..n {
        b.qp.post_recv(&[dst.sge(i * 2048, 2048)]).unwrap();
    }
    for i in 0..n {
        let mut w = send_wqe(
            &a.qp,
            SendOpcode::Send,
            CtrlFlags::CQ_UPDATE,
            0,
            src.sge(i * 2048, 2048),
        );
        a.qp.post_send(&mut w).unwrap();
    }
}

#[test]
fn device_thread_mode() {
    let f = Fabric::new(FabricConfig {
        mode: ExecMode::Thread,
        seed: 1,
        ..FabricConfig::default()
    });
    let (mut a, mut b) = rc_pair(&f, RcOptions::default()).unwrap();
    let src = a.buffer(65536, RW).unwrap();
    let dst = b.buffer(65536, RW).unwrap();
    src.mem.write(0, &pattern(65536, 8)).unwrap();
    let n = 32;
    post_2k_sends(&mut a, &mut b, &src, &dst, n);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let (mut sent, mut recvd) = (0, 0);
    while (sent < n || recvd < n) && std::time::Instant::now() < deadline {
        sent += a.cq.drain().len() as u64;
        recvd += b.cq.drain().len() as u64;
        std::thread::yield_now();
    }
    assert_eq!((sent, recvd), (n, n));
    assert_eq!(dst.bytes(0, 65536), pattern(65536, 8));
}

/// Thread mode with inline doorbells: a doorbell that finds the engine free
/// runs it on the ringing thread (the completion event is delivered there,
/// before the post returns); one that finds the world held (here by the test,
/// as a control command would) is served by the device thread.
#[test]
fn thread_mode_inline_doorbells_run_on_the_ringing_thread() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    struct Probe {
        poster: std::thread::ThreadId,
        on_poster: AtomicUsize,
        elsewhere: AtomicUsize,
    }
    impl CqEventHandler for Probe {
        fn completion_event(&self, _cqn: u32) {
            assert!(!device_model_active());
            if std::thread::current().id() == self.poster {
                self.on_poster.fetch_add(1, Ordering::SeqCst);
            } else {
                self.elsewhere.fetch_add(1, Ordering::SeqCst);
            }
        }
    }
    let f = Fabric::new(FabricConfig {
        inline_doorbells: true,
        ..FabricConfig::threaded(5)
    });
    let (a, _b) = rc_pair(&f, RcOptions::default()).unwrap();
    let probe = Arc::new(Probe {
        poster: std::thread::current().id(),
        on_poster: AtomicUsize::new(0),
        elsewhere: AtomicUsize::new(0),
    });
    let mut cq = RawCq::new(a.hca.create_cq(8, probe.clone()).unwrap());
    let mut qp = loopback_rc_qp(&a.hca, a.pd, &cq, false);
    let events = || probe.on_poster.load(Ordering::SeqCst) + probe.elsewhere.load(Ordering::SeqCst);
    let post = |cq: &mut RawCq, qp: &mut RawQp| {
        cq.arm(false);
        let mut w = qp.builder(SendOpcode::RdmaWrite, CtrlFlags::CQ_UPDATE, 0);
        w.raddr(0, 0).unwrap();
        qp.post_send(&mut w).unwrap();
    };
    let wait = |cq: &mut RawCq, round: usize| {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        let mut got = 0;
        while (got < 1 || events() <= round) && std::time::Instant::now() < deadline {
            got += cq.drain().len();
            std::thread::yield_now();
        }
        assert_eq!((got, events()), (1, round + 1), "round {round}");
        cq.ack_event();
    };
    let rounds = 64;
    for round in 0..rounds {
        post(&mut cq, &mut qp);
        wait(&mut cq, round);
    }
    // The device thread takes the world only briefly (a pass when it wakes,
    // at least every 2 ms): most doorbells find the engine free.
    let on_poster = probe.on_poster.load(Ordering::SeqCst);
    assert!(
        on_poster >= rounds / 4,
        "only {on_poster} of {rounds} events inside the doorbell write"
    );
    // The world held: the doorbells return without running the engine, and
    // the device thread serves them once the world is let go (a plain drop,
    // not a control command's kick).
    let elsewhere = probe.elsewhere.load(Ordering::SeqCst);
    let held = f.shared.lock();
    post(&mut cq, &mut qp);
    assert_eq!(events(), rounds, "nothing ran while the world was held");
    drop(held);
    wait(&mut cq, rounds);
    assert_eq!(probe.elsewhere.load(Ordering::SeqCst), elsewhere + 1);
}

/// Thread mode with inline doorbells keeps the device thread's timers: a
/// lossy link's lost packets are retransmitted although no doorbell rings
/// after the posts (an engine run on a doorbell's thread that schedules a
/// retransmit wakes the device thread for it).
#[test]
fn thread_mode_inline_doorbells_keep_retransmit_timers() {
    let f = Fabric::new(FabricConfig {
        inline_doorbells: true,
        ..FabricConfig::threaded(11)
    });
    let opts = RcOptions {
        timeout: 8,
        retry_cnt: 7,
        ..RcOptions::default()
    };
    let (mut a, mut b) = rc_pair(&f, opts).unwrap();
    f.set_link_faults(
        &a.hca,
        &b.hca,
        FaultConfig {
            drop: 0.3,
            ..FaultConfig::default()
        },
    );
    let src = a.buffer(16384, RW).unwrap();
    let dst = b.buffer(16384, RW).unwrap();
    src.mem.write(0, &pattern(16384, 3)).unwrap();
    let n = 8;
    post_2k_sends(&mut a, &mut b, &src, &dst, n);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let (mut sent, mut recvd) = (Vec::new(), Vec::new());
    while (sent.len() < n as usize || recvd.len() < n as usize)
        && std::time::Instant::now() < deadline
    {
        sent.extend(a.cq.drain());
        recvd.extend(b.cq.drain());
        std::thread::yield_now();
    }
    assert_eq!((sent.len(), recvd.len()), (n as usize, n as usize));
    assert!(
        sent.iter().chain(&recvd).all(|c| c.syndrome == 0),
        "{sent:?}"
    );
    assert_eq!(dst.bytes(0, 16384), pattern(16384, 3));
    assert!(f.stats().dropped_by_fault > 0, "the link dropped nothing");
}

/// An arm doorbell with a CQE already past its consumer index must run the
/// device (inline doorbells: before the write returns); one with nothing
/// pending leaves it alone, and the next CQE fires it.
#[test]
fn arm_with_a_pending_cqe_runs_the_device_at_once() {
    let (f, mut a, mut b) = pair();
    let src = a.buffer(64, RW).unwrap();
    let dst = b.buffer(64, RW).unwrap();
    b.qp.post_recv(&[dst.sge(0, 64)]).unwrap();
    b.qp.post_recv(&[dst.sge(0, 64)]).unwrap();
    let mut w = send_wqe(
        &a.qp,
        SendOpcode::Send,
        CtrlFlags::empty(),
        0,
        src.sge(0, 8),
    );
    a.qp.post_send(&mut w).unwrap();
    f.run_until_idle();
    f.set_inline_doorbells(true);
    b.cq.arm(false);
    assert_eq!(
        b.events.completions().len(),
        1,
        "fired inside the arm write"
    );
    b.cq.ack_event();
    assert_eq!(b.cq.drain().len(), 1);
    b.cq.arm(false);
    assert_eq!(b.events.completions().len(), 1, "nothing pending: no event");
    f.set_inline_doorbells(false);
    let mut w = send_wqe(
        &a.qp,
        SendOpcode::Send,
        CtrlFlags::empty(),
        0,
        src.sge(0, 8),
    );
    a.qp.post_send(&mut w).unwrap();
    f.run_until_idle();
    assert_eq!(
        b.events.completions().len(),
        2,
        "the next CQE fires the arm"
    );
}

/// Thread mode: an arm doorbell only wakes the device when a CQE is already
/// past its consumer index; an arm that races the device's next CQE must
/// still fire exactly once (the producer index / pending arm handshake).
#[test]
fn thread_mode_arms_fire_once_whichever_side_wins() {
    let f = Fabric::new(FabricConfig {
        mode: ExecMode::Thread,
        seed: 3,
        ..FabricConfig::default()
    });
    let (mut a, mut b) = rc_pair(&f, RcOptions::default()).unwrap();
    let src = a.buffer(64, RW).unwrap();
    let dst = b.buffer(64, RW).unwrap();
    fn wait_for(mut what: impl FnMut() -> bool) -> bool {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while std::time::Instant::now() < deadline {
            if what() {
                return true;
            }
            std::thread::yield_now();
        }
        false
    }
    let rounds = 200;
    for i in 0..rounds {
        b.qp.post_recv(&[dst.sge(0, 64)]).unwrap();
        let mut w = send_wqe(
            &a.qp,
            SendOpcode::Send,
            CtrlFlags::CQ_UPDATE,
            0,
            src.sge(0, 8),
        );
        if i % 2 == 0 {
            // Arm first (nothing past the consumer index: no wake-up), then
            // the CQE, which races the arm on the device thread.
            b.cq.arm(false);
            a.qp.post_send(&mut w).unwrap();
            assert!(wait_for(|| a.cq.drain().len() == 1), "round {i}: send CQE");
        } else {
            // The CQE first (the responder writes it before the ACK that
            // completes the send), then the arm: it must wake the device
            // and fire at once, with nothing else happening.
            a.qp.post_send(&mut w).unwrap();
            assert!(wait_for(|| a.cq.drain().len() == 1), "round {i}: send CQE");
            assert_eq!(b.events.completions().len(), i, "round {i}: unarmed");
            b.cq.arm(false);
        }
        assert!(
            wait_for(|| b.events.completions().len() > i),
            "round {i}: no event"
        );
        b.cq.ack_event();
        assert_eq!(b.cq.drain().len(), 1, "round {i}");
    }
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(b.events.completions().len(), rounds, "one event per arm");
}

#[test]
fn modify_errors_surface_and_reset_restarts() {
    let (f, mut a, mut b) = pair();
    let bad = QpAttr {
        state: QpState::Rtr,
        ..QpAttr::default()
    };
    assert_eq!(
        a.hca.modify_qp(a.qp.qpn, &bad, QpAttrMask::STATE),
        Err(HcaError::Modify(ModifyError::InvalidTransition {
            from: QpState::Rts,
            to: QpState::Rtr
        }))
    );
    assert_eq!(
        a.hca.modify_qp(0x9999, &bad, QpAttrMask::STATE),
        Err(HcaError::NoSuchQp(0x9999))
    );
    let mut d = QpAttr {
        state: QpState::Rts,
        max_rd_atomic: 17,
        ..QpAttr::default()
    };
    d.state = QpState::Sqd;
    a.hca.modify_qp(a.qp.qpn, &d, QpAttrMask::STATE).unwrap();
    d.state = QpState::Sqd;
    assert_eq!(
        a.hca.modify_qp(
            a.qp.qpn,
            &d,
            QpAttrMask::STATE | QpAttrMask::MAX_QP_RD_ATOMIC
        ),
        Err(HcaError::ExceedsLimit)
    );
    // Reset and bring it back: counters restart at zero.
    let reset = QpAttr {
        state: QpState::Reset,
        ..QpAttr::default()
    };
    for n in [&a, &b] {
        n.hca
            .modify_qp(n.qp.qpn, &reset, QpAttrMask::STATE)
            .unwrap();
    }
    a.qp.reset_counters();
    b.qp.reset_counters();
    a.bring_up(Some((b.hca.gid(), b.qp.qpn)), RcOptions::default())
        .unwrap();
    b.bring_up(Some((a.hca.gid(), a.qp.qpn)), RcOptions::default())
        .unwrap();
    let src = a.buffer(64, RW).unwrap();
    let dst = b.buffer(64, RW).unwrap();
    b.qp.post_recv(&[dst.sge(0, 64)]).unwrap();
    let mut w = send_wqe(
        &a.qp,
        SendOpcode::Send,
        CtrlFlags::CQ_UPDATE,
        0,
        src.sge(0, 8),
    );
    assert_eq!(a.qp.post_send(&mut w).unwrap(), 0);
    f.run_until_idle();
    assert_eq!(one(&mut a.cq).wqe_counter, 0);
    assert_eq!(one(&mut b.cq).wqe_counter, 0);
}

#[test]
fn sqd_drains_and_notifies() {
    let (f, mut a, mut b) = pair();
    let src = a.buffer(64, RW).unwrap();
    let dst = b.buffer(64, RW).unwrap();
    b.qp.post_recv(&[dst.sge(0, 64)]).unwrap();
    let mut w = send_wqe(
        &a.qp,
        SendOpcode::Send,
        CtrlFlags::CQ_UPDATE,
        0,
        src.sge(0, 8),
    );
    a.qp.post_send(&mut w).unwrap();
    let sqd = QpAttr {
        state: QpState::Sqd,
        en_sqd_async_notify: true,
        ..QpAttr::default()
    };
    a.hca
        .modify_qp(
            a.qp.qpn,
            &sqd,
            QpAttrMask::STATE | QpAttrMask::EN_SQD_ASYNC_NOTIFY,
        )
        .unwrap();
    f.run_until_idle();
    // The WQE was posted before the doorbell was processed: SQD starts none.
    assert!(a.cq.poll().is_none());
    assert!(
        a.events
            .asyncs()
            .contains(&AsyncEvent::SqDrained { qpn: a.qp.qpn })
    );
    let rts = QpAttr {
        state: QpState::Rts,
        ..QpAttr::default()
    };
    a.hca.modify_qp(a.qp.qpn, &rts, QpAttrMask::STATE).unwrap();
    a.qp.ring_sq();
    f.run_until_idle();
    assert_eq!(one(&mut a.cq).error(), None);
}

#[test]
fn cq_overrun_is_an_error() {
    let f = Fabric::stepped();
    let mut a = Node::with_config(&f, HcaConfig::new([10, 0, 0, 1]), QpType::Rc, 64, 2).unwrap();
    let b = Node::new(&f, [10, 0, 0, 2], QpType::Rc).unwrap();
    a.bring_up(Some((b.hca.gid(), b.qp.qpn)), RcOptions::default())
        .unwrap();
    b.bring_up(Some((a.hca.gid(), a.qp.qpn)), RcOptions::default())
        .unwrap();
    for _ in 0..3 {
        let mut w = a.qp.builder(SendOpcode::RdmaWrite, CtrlFlags::CQ_UPDATE, 0);
        w.raddr(0, 0).unwrap();
        a.qp.post_send(&mut w).unwrap();
    }
    f.run_until_idle();
    assert_eq!(a.hca.cq_in_error(a.cq.cqn), Some(true));
    let ev = a.events.asyncs();
    assert!(
        ev.contains(&AsyncEvent::CqError { cqn: a.cq.cqn }),
        "{ev:?}"
    );
    assert!(
        ev.contains(&AsyncEvent::QpFatal { qpn: a.qp.qpn }),
        "{ev:?}"
    );
    assert_eq!(a.cq.drain().len(), 2);
}

#[test]
fn freed_ring_memory_faults_the_qp() {
    let (f, a, _b) = pair();
    let qpn = a.qp.qpn;
    let Node {
        hca, qp, events, ..
    } = a;
    let doorbell = qp.sq_doorbell().clone();
    drop(qp.into_parts());
    // The device finds the memory gone the next time it looks at the QP: a
    // fatal QP error, not a stale read.
    doorbell.write64(u64::from(qpn << 8) | 1);
    f.run_until_idle();
    assert_eq!(events.asyncs(), vec![AsyncEvent::QpFatal { qpn }]);
    assert_eq!(hca.query_qp(qpn).unwrap().state, QpState::Err);
}

#[test]
fn resize_cq_moves_to_the_new_ring() {
    let (f, mut a, b) = pair();
    let writes = |a: &mut Node, n| {
        for _ in 0..n {
            let mut w = a.qp.builder(SendOpcode::RdmaWrite, CtrlFlags::CQ_UPDATE, 0);
            w.raddr(0, 0).unwrap();
            a.qp.post_send(&mut w).unwrap();
        }
        f.run_until_idle();
    };
    writes(&mut a, 3);
    let ring = a.hca.resize_cq(a.cq.cqn, 256).unwrap();
    assert_eq!(ring.entries(), 256);
    a.cq.set_resized_ring(ring);
    writes(&mut a, 35);
    writes(&mut a, 35);
    let all = a.cq.drain();
    assert_eq!(all.len(), 73);
    let counters: Vec<u16> = all.iter().map(|c| c.wqe_counter).collect();
    assert_eq!(counters, (0..73).collect::<Vec<u16>>());
    assert!(a.hca.resize_cq(a.cq.cqn, 0).is_err());
    let _ = b;
}

#[test]
fn control_object_rules() {
    let f = Fabric::stepped();
    let hca = f.add_hca(HcaConfig::new([10, 0, 0, 1]));
    assert_eq!(hca.query_port(2).err(), Some(HcaError::InvalidPort(2)));
    assert_eq!(
        hca.query_gid(1, 1).err(),
        Some(HcaError::InvalidGidIndex(1))
    );
    assert_eq!(hca.query_gid(1, 0).unwrap(), hca.gid());
    assert_eq!(hca.query_device().reserved_lkey, RESERVED_LKEY);
    let pd = hca.alloc_pd().unwrap();
    let log = EventLog::new();
    let cq = hca.create_cq(8, log).unwrap();
    let init = QpInit {
        qp_type: QpType::Rc,
        pd,
        send_cq: cq.cqn,
        recv_cq: cq.cqn,
        sq_wqebbs: 3,
        rq_entries: 5,
        max_recv_sge: 3,
        sq_sig_all: false,
        port: 1,
    };
    let qp = hca.create_qp(&init).unwrap();
    assert_eq!(
        (qp.caps.sq_wqebbs, qp.caps.rq_entries, qp.caps.rq_stride),
        (4, 8, 64)
    );
    assert_eq!(hca.dealloc_pd(pd), Err(HcaError::InUse));
    assert_eq!(hca.destroy_cq(cq.cqn), Err(HcaError::InUse));
    let mem = hca.dma_allocator().alloc(8192).unwrap();
    let pages = pages_of(&mem);
    let reg = |access, length, iova| MrRegistration {
        pd,
        iova,
        length,
        page_shift: 12,
        pages: &pages,
        access,
    };
    assert_eq!(
        hca.reg_mr(&reg(AccessFlags::REMOTE_WRITE, 10, 0)),
        Err(HcaError::InvalidAccess)
    );
    assert_eq!(hca.reg_mr(&reg(RW, 8193, 0)), Err(HcaError::InvalidRange));
    assert_eq!(
        hca.reg_mr(&reg(RW, 8000, 0x300)),
        Err(HcaError::InvalidRange)
    );
    let keys = hca.reg_mr(&reg(RW, 8192, 0)).unwrap();
    assert_eq!(keys.lkey, keys.rkey);
    let unaligned = [PhysAddr(mem.phys_addr().get() + 8)];
    assert_eq!(
        hca.reg_mr(&MrRegistration {
            pd,
            iova: 0,
            length: 8,
            page_shift: 12,
            pages: &unaligned,
            access: RW
        }),
        Err(HcaError::InvalidRange)
    );
    let mkey = hca.alloc_mkey(pd, 4).unwrap();
    assert_eq!(hca.dereg_mr(mkey), Err(HcaError::InvalidOperation));
    assert_eq!(hca.free_mkey(keys.lkey), Err(HcaError::InvalidOperation));
    hca.free_mkey(mkey).unwrap();
    hca.dereg_mr(keys.lkey).unwrap();
    assert_eq!(hca.dereg_mr(keys.lkey), Err(HcaError::NoSuchMr(keys.lkey)));
    hca.destroy_qp(qp.qpn).unwrap();
    hca.destroy_cq(cq.cqn).unwrap();
    hca.dealloc_pd(pd).unwrap();
    assert_eq!(hca.dealloc_pd(pd), Err(HcaError::NoSuchPd(pd)));
}

#[test]
fn initiator_depth_limits_outstanding_reads() {
    let f = Fabric::stepped();
    let (mut a, b) = rc_pair(
        &f,
        RcOptions {
            max_rd_atomic: 2,
            max_dest_rd_atomic: 2,
            ..RcOptions::default()
        },
    )
    .unwrap();
    let local = a.buffer(65536, RW).unwrap();
    let remote = b.buffer(65536, RW).unwrap();
    remote.mem.write(0, &pattern(65536, 6)).unwrap();
    for i in 0..8u64 {
        let mut r = rdma_wqe(
            &a.qp,
            SendOpcode::RdmaRead,
            CtrlFlags::CQ_UPDATE,
            0,
            remote.iova + i * 8192,
            remote.keys.rkey,
            local.sge(i * 8192, 8192),
        );
        a.qp.write_send(&mut r).unwrap();
    }
    a.qp.ring_sq();
    f.run_until_idle();
    assert_eq!(
        a.cq.drain().iter().filter(|c| c.error().is_none()).count(),
        8
    );
    assert_eq!(a.hca.qp_stats(a.qp.qpn).unwrap().max_reads_outstanding, 2);
    assert_eq!(local.bytes(0, 65536), pattern(65536, 6));
}

#[test]
fn responder_resources_are_enforced() {
    let f = Fabric::stepped();
    let (mut a, b) = rc_pair(
        &f,
        RcOptions {
            max_rd_atomic: 4,
            max_dest_rd_atomic: 1,
            ..RcOptions::default()
        },
    )
    .unwrap();
    let local = a.buffer(65536, RW).unwrap();
    let remote = b.buffer(65536, RW).unwrap();
    for i in 0..4u64 {
        let mut r = rdma_wqe(
            &a.qp,
            SendOpcode::RdmaRead,
            CtrlFlags::CQ_UPDATE,
            0,
            remote.iova + i * 16384,
            remote.keys.rkey,
            local.sge(i * 16384, 16384),
        );
        a.qp.write_send(&mut r).unwrap();
    }
    a.qp.ring_sq();
    f.run_until_idle();
    let errs: Vec<_> = a.cq.drain().iter().map(CqeRepr::error).collect();
    assert!(
        errs.contains(&Some(Syndrome::RemoteInvalRequest)),
        "{errs:?}"
    );
    assert_eq!(b.hca.query_qp(b.qp.qpn).unwrap().state, QpState::Err);
}

#[test]
fn duplicate_read_requests_take_no_extra_responder_resources() {
    // Every request frame is delivered twice: the second copy of each READ
    // request is a duplicate the responder replays, but the replay answers a
    // read the requester already counts as outstanding, so it must not use
    // up one of the `max_dest_rd_atomic` slots a later, new READ needs.
    let f = Fabric::stepped();
    let (mut a, b) = rc_pair(
        &f,
        RcOptions {
            max_rd_atomic: 1,
            max_dest_rd_atomic: 1,
            ..RcOptions::default()
        },
    )
    .unwrap();
    f.set_link_faults(
        &a.hca,
        &b.hca,
        FaultConfig {
            duplicate: 1.0,
            ..FaultConfig::default()
        },
    );
    let size = 1024 * 1024u64;
    let local = a.buffer(size as usize, RW).unwrap();
    let remote = b.buffer(size as usize, RW).unwrap();
    remote.mem.write(0, &pattern(size as usize, 8)).unwrap();
    let chunk = 256 * 1024u64;
    for i in 0..size / chunk {
        let mut r = rdma_wqe(
            &a.qp,
            SendOpcode::RdmaRead,
            CtrlFlags::CQ_UPDATE,
            0,
            remote.iova + i * chunk,
            remote.keys.rkey,
            local.sge(i * chunk, chunk as u32),
        );
        a.qp.write_send(&mut r).unwrap();
    }
    a.qp.ring_sq();
    f.run_until_idle();
    let errs: Vec<_> = a.cq.drain().iter().map(CqeRepr::error).collect();
    assert_eq!(errs, vec![None; (size / chunk) as usize]);
    assert_eq!(b.hca.query_qp(b.qp.qpn).unwrap().state, QpState::Rts);
    assert!(b.hca.qp_stats(b.qp.qpn).unwrap().duplicates > 0);
    assert_eq!(local.bytes(0, size as usize), pattern(size as usize, 8));
}

#[test]
fn malformed_wqe_is_a_local_qp_op_error() {
    let (f, mut a, _b) = pair();
    // A WQE whose control segment names another QP.
    let mut w =
        crate::wqe::SendWqeBuilder::new(SendOpcode::Nop, 0, a.qp.qpn + 1, CtrlFlags::CQ_UPDATE, 0);
    a.qp.write_send(&mut w).unwrap();
    a.qp.set_sq_head_raw(1);
    a.qp.sq_doorbell().write64(u64::from(a.qp.qpn << 8) | 1);
    f.run_until_idle();
    assert_eq!(one(&mut a.cq).error(), Some(Syndrome::LocalQpOp));
    // A doorbell naming another QP is ignored and counted.
    let before = f.bad_doorbells();
    a.qp.sq_doorbell().write64(0x1234_5600);
    assert_eq!(f.bad_doorbells(), before + 1);
}

#[test]
fn port_down_drops_and_reports() {
    let f = Fabric::stepped();
    let (mut a, b) = rc_pair(
        &f,
        RcOptions {
            retry_cnt: 1,
            timeout: 10,
            ..RcOptions::default()
        },
    )
    .unwrap();
    f.set_port_state(&b.hca, PortState::Down);
    assert!(
        b.events
            .asyncs()
            .contains(&AsyncEvent::PortDown { port: 1 })
    );
    let mut w = a.qp.builder(SendOpcode::RdmaWrite, CtrlFlags::CQ_UPDATE, 0);
    w.raddr(0, 0).unwrap();
    a.qp.post_send(&mut w).unwrap();
    f.advance(Duration::from_millis(50));
    assert_eq!(
        one(&mut a.cq).error(),
        Some(Syndrome::TransportRetryExceeded)
    );
    f.set_port_state(&b.hca, PortState::Active);
    assert!(
        b.events
            .asyncs()
            .contains(&AsyncEvent::PortActive { port: 1 })
    );
}

// ------------------------------------------------------------ RC robustness

fn lossless_send(f: &Fabric, a: &mut Node, b: &mut Node, n: usize, len: u32) -> (Buffer, Buffer) {
    let src = a.buffer(len as usize * n, RW).unwrap();
    let dst = b.buffer(len as usize * n, RW).unwrap();
    src.mem.write(0, &pattern(len as usize * n, 11)).unwrap();
    for i in 0..n as u64 {
        b.qp.post_recv(&[dst.sge(i * u64::from(len), len)]).unwrap();
        let mut w = send_wqe(
            &a.qp,
            SendOpcode::Send,
            CtrlFlags::CQ_UPDATE,
            0,
            src.sge(i * u64::from(len), len),
        );
        a.qp.write_send(&mut w).unwrap();
    }
    a.qp.ring_sq();
    let _ = f;
    (src, dst)
}

#[test]
fn lost_packet_is_retransmitted_after_the_ack_timeout() {
    let f = Fabric::stepped();
    let (mut a, mut b) = rc_pair(
        &f,
        RcOptions {
            timeout: 10,
            ..RcOptions::default()
        },
    )
    .unwrap();
    // Every frame a -> b is lost until the link is repaired.
    f.set_link_faults(
        &a.hca,
        &b.hca,
        FaultConfig {
            drop: 1.0,
            ..FaultConfig::default()
        },
    );
    let (_src, dst) = lossless_send(&f, &mut a, &mut b, 1, 100);
    f.run_until_idle();
    assert!(a.cq.poll().is_none());
    f.set_link_faults(&a.hca, &b.hca, FaultConfig::default());
    // 4.096 µs * 2^10 = 4.19 ms.
    f.advance(Duration::from_millis(4));
    assert!(
        a.cq.poll().is_none(),
        "no retransmission before the timeout"
    );
    f.advance(Duration::from_millis(1));
    assert_eq!(one(&mut a.cq).error(), None);
    assert_eq!(one(&mut b.cq).byte_cnt, 100);
    assert_eq!(dst.bytes(0, 100), pattern(100, 11));
    let s = a.hca.qp_stats(a.qp.qpn).unwrap();
    assert_eq!((s.timeouts, s.retransmits), (1, 1));
}

#[test]
fn retry_count_exceeded() {
    let f = Fabric::stepped();
    let (mut a, mut b) = rc_pair(
        &f,
        RcOptions {
            timeout: 8,
            retry_cnt: 3,
            ..RcOptions::default()
        },
    )
    .unwrap();
    f.set_link_faults(
        &a.hca,
        &b.hca,
        FaultConfig {
            drop: 1.0,
            ..FaultConfig::default()
        },
    );
    let (_s, _d) = lossless_send(&f, &mut a, &mut b, 3, 10);
    f.advance(Duration::from_millis(100));
    let c = a.cq.drain();
    let got: Vec<_> = c.iter().map(CqeRepr::error).collect();
    assert_eq!(
        got,
        vec![
            Some(Syndrome::TransportRetryExceeded),
            Some(Syndrome::WrFlush),
            Some(Syndrome::WrFlush)
        ]
    );
    // 1 transmission + 3 retries.
    assert_eq!(a.hca.qp_stats(a.qp.qpn).unwrap().timeouts, 4);
    assert_eq!(a.hca.query_qp(a.qp.qpn).unwrap().state, QpState::Err);
}

#[test]
fn sequence_nak_triggers_immediate_go_back_n() {
    let f = Fabric::new(FabricConfig {
        mode: ExecMode::Stepped,
        seed: 3,
        ..FabricConfig::default()
    });
    let (mut a, mut b) = rc_pair(&f, RcOptions::default()).unwrap();
    // Drop exactly the second frame a -> b: capture, then let a scripted
    // fault drop it by dropping everything for one frame.
    let src = a.buffer(4096, RW).unwrap();
    let dst = b.buffer(4096, RW).unwrap();
    src.mem.write(0, &pattern(3000, 1)).unwrap();
    b.qp.post_recv(&[dst.sge(0, 4096)]).unwrap();
    let mut w = send_wqe(
        &a.qp,
        SendOpcode::Send,
        CtrlFlags::CQ_UPDATE,
        0,
        src.sge(0, 3000),
    );
    // The FIRST packet gets through, MIDDLE and LAST are lost; then the
    // repaired link carries a new message whose PSN is beyond the gap.
    a.qp.write_send(&mut w).unwrap();
    f.set_link_faults(
        &a.hca,
        &b.hca,
        FaultConfig {
            drop: 1.0,
            ..FaultConfig::default()
        },
    );
    let mut w2 = send_wqe(
        &a.qp,
        SendOpcode::Send,
        CtrlFlags::CQ_UPDATE,
        0,
        src.sge(0, 10),
    );
    a.qp.write_send(&mut w2).unwrap();
    a.qp.ring_sq();
    f.run_until_idle();
    f.set_link_faults(&a.hca, &b.hca, FaultConfig::default());
    b.qp.post_recv(&[dst.sge(3000, 10)]).unwrap();
    // Timeout retransmits from the first unacked PSN.
    f.advance(Duration::from_millis(100));
    assert_eq!(a.cq.drain().len(), 2);
    assert_eq!(b.cq.drain().len(), 2);
    assert_eq!(dst.bytes(0, 3000), pattern(3000, 1));
}

#[test]
fn out_of_order_arrival_naks_once_and_recovers() {
    let f = Fabric::new(FabricConfig {
        mode: ExecMode::Stepped,
        seed: 5,
        ..FabricConfig::default()
    });
    let (mut a, mut b) = rc_pair(
        &f,
        RcOptions {
            timeout: 20,
            ..RcOptions::default()
        },
    )
    .unwrap();
    // Every frame delayed at random by up to 100 µs: arrivals reorder.
    f.set_link_faults(
        &a.hca,
        &b.hca,
        FaultConfig {
            jitter_ns: 100_000,
            ..FaultConfig::default()
        },
    );
    let (_src, dst) = lossless_send(&f, &mut a, &mut b, 8, 3000);
    f.advance(Duration::from_millis(1));
    let sb = b.hca.qp_stats(b.qp.qpn).unwrap();
    assert!(sb.seq_naks_sent >= 1, "{sb:?}");
    let sa = a.hca.qp_stats(a.qp.qpn).unwrap();
    assert!(sa.seq_naks_received >= 1 && sa.retransmits >= 1, "{sa:?}");
    // With a 4 s ACK timeout, recovery came from the NAKs, not the timer.
    f.advance(Duration::from_millis(20));
    assert_eq!(
        a.cq.drain().iter().filter(|c| c.error().is_none()).count(),
        8
    );
    let r = b.cq.drain();
    assert_eq!(
        r.iter().map(|c| c.wqe_counter).collect::<Vec<_>>(),
        (0..8).collect::<Vec<u16>>()
    );
    assert_eq!(dst.bytes(0, 24_000), pattern(24_000, 11));
    assert_eq!(a.hca.qp_stats(a.qp.qpn).unwrap().timeouts, 0);
}

#[test]
fn duplicates_are_re_acked_and_not_redelivered() {
    let f = Fabric::new(FabricConfig {
        mode: ExecMode::Stepped,
        seed: 9,
        ..FabricConfig::default()
    });
    let (mut a, mut b) = rc_pair(&f, RcOptions::default()).unwrap();
    f.set_link_faults(
        &a.hca,
        &b.hca,
        FaultConfig {
            duplicate: 1.0,
            ..FaultConfig::default()
        },
    );
    let (_src, dst) = lossless_send(&f, &mut a, &mut b, 4, 2000);
    f.run_until_idle();
    assert_eq!(a.cq.drain().len(), 4);
    assert_eq!(b.cq.drain().len(), 4);
    assert_eq!(dst.bytes(0, 8000), pattern(8000, 11));
    assert!(b.hca.qp_stats(b.qp.qpn).unwrap().duplicates >= 8);
    assert!(f.stats().duplicated >= 8);
}

#[test]
fn lost_read_response_is_retried() {
    let f = Fabric::new(FabricConfig {
        mode: ExecMode::Stepped,
        seed: 2,
        ..FabricConfig::default()
    });
    let (mut a, b) = rc_pair(
        &f,
        RcOptions {
            timeout: 10,
            ..RcOptions::default()
        },
    )
    .unwrap();
    let local = a.buffer(16384, RW).unwrap();
    let remote = b.buffer(16384, RW).unwrap();
    remote.mem.write(0, &pattern(16384, 3)).unwrap();
    f.set_link_faults(
        &b.hca,
        &a.hca,
        FaultConfig {
            drop: 0.3,
            ..FaultConfig::default()
        },
    );
    let mut r = rdma_wqe(
        &a.qp,
        SendOpcode::RdmaRead,
        CtrlFlags::CQ_UPDATE,
        0,
        remote.iova,
        remote.keys.rkey,
        local.sge(0, 16384),
    );
    a.qp.post_send(&mut r).unwrap();
    f.advance(Duration::from_millis(500));
    assert_eq!(one(&mut a.cq).error(), None);
    assert_eq!(local.bytes(0, 16384), pattern(16384, 3));
    assert!(a.hca.qp_stats(a.qp.qpn).unwrap().retransmits >= 1);
}

#[test]
fn corruption_is_caught_by_the_icrc() {
    let f = Fabric::new(FabricConfig {
        mode: ExecMode::Stepped,
        seed: 4,
        ..FabricConfig::default()
    });
    let (mut a, mut b) = rc_pair(
        &f,
        RcOptions {
            timeout: 10,
            ..RcOptions::default()
        },
    )
    .unwrap();
    f.set_link_faults(
        &a.hca,
        &b.hca,
        FaultConfig {
            corrupt: 0.5,
            ..FaultConfig::default()
        },
    );
    let (_src, dst) = lossless_send(&f, &mut a, &mut b, 8, 2500);
    f.advance(Duration::from_millis(500));
    assert_eq!(
        a.cq.drain().iter().filter(|c| c.error().is_none()).count(),
        8
    );
    assert_eq!(b.cq.drain().len(), 8);
    assert_eq!(dst.bytes(0, 20_000), pattern(20_000, 11));
    let s = f.stats();
    assert!(s.corrupted > 0);
    // Every corrupted frame was dropped (most by the ICRC; a flipped bit in
    // the IPv4/UDP part of the ICRC coverage can also fail an earlier check).
    assert_eq!(s.dropped_malformed, s.corrupted);
    assert!(s.dropped_bad_icrc > 0);
}

/// The ICRC is trusted (computed once, at emit) only on an in-process link
/// with no fault configuration and no capture; a configured link, even one
/// whose faults are all zero, and a running capture keep the full check.
/// On such a plain link the data packets go by reference to the sender's
/// gathered payload (never written out); everywhere else every frame is
/// real bytes, and a capture holds frames whose ICRC verifies.
#[test]
fn icrc_is_trusted_only_on_a_plain_in_process_link() {
    let run = |setup: &dyn Fn(&Fabric, &Node, &Node)| {
        let f = Fabric::stepped();
        let (mut a, mut b) = rc_pair(&f, RcOptions::default()).unwrap();
        setup(&f, &a, &b);
        let before = f.stats();
        let (_src, dst) = lossless_send(&f, &mut a, &mut b, 4, 9000);
        f.run_until_idle();
        assert_eq!(a.cq.drain().len(), 4);
        assert_eq!(b.cq.drain().len(), 4);
        assert_eq!(dst.bytes(0, 36_000), pattern(36_000, 11));
        let s = f.stats();
        let delivered = s.frames_delivered - before.frames_delivered;
        assert!(delivered >= 8, "{s:?}");
        (
            delivered,
            s.icrc_trusted - before.icrc_trusted,
            s.frames_direct - before.frames_direct,
            f,
        )
    };
    let (delivered, trusted, direct, _) = run(&|_, _, _| {});
    assert_eq!(trusted, delivered);
    // 4 SENDs of 9000 bytes at MTU 1024: 9 data packets each, by
    // reference; the ACKs are written out.
    assert_eq!(direct, 36);
    let (_, trusted, direct, _) = run(&|f, a, b| {
        f.set_link_faults(&a.hca, &b.hca, FaultConfig::default());
        f.set_link_faults(&b.hca, &a.hca, FaultConfig::default());
    });
    assert_eq!((trusted, direct), (0, 0));
    let (delivered, trusted, direct, f) = run(&|f, _, _| f.set_capture(true));
    assert_eq!((trusted, direct), (0, 0));
    let captured = f.take_captured();
    assert_eq!(captured.len() as u64, delivered);
    let payload: usize = captured
        .iter()
        .map(|c| {
            RoceV2FrameRepr::parse(&c.bytes)
                .unwrap()
                .packet
                .payload
                .len()
        })
        .sum();
    assert_eq!(payload, 36_000);
}

#[test]
fn rnr_retry_seven_is_infinite() {
    let f = Fabric::stepped();
    let (mut a, mut b) = rc_pair(
        &f,
        RcOptions {
            rnr_retry: 7,
            min_rnr_timer: 1,
            ..RcOptions::default()
        },
    )
    .unwrap();
    let src = a.buffer(64, RW).unwrap();
    let dst = b.buffer(64, RW).unwrap();
    let mut w = send_wqe(
        &a.qp,
        SendOpcode::Send,
        CtrlFlags::CQ_UPDATE,
        0,
        src.sge(0, 8),
    );
    a.qp.post_send(&mut w).unwrap();
    // 10 µs RNR timer: 1000 retries in 10 ms.
    f.advance(Duration::from_millis(10));
    assert!(a.cq.poll().is_none());
    assert!(b.hca.qp_stats(b.qp.qpn).unwrap().rnr_naks_sent > 500);
    b.qp.post_recv(&[dst.sge(0, 64)]).unwrap();
    f.advance(Duration::from_millis(1));
    assert_eq!(one(&mut a.cq).error(), None);
}

#[test]
fn forced_error_flushes_both_queues() {
    let (f, mut a, mut b) = pair();
    f.set_link_faults(
        &a.hca,
        &b.hca,
        FaultConfig {
            drop: 1.0,
            ..FaultConfig::default()
        },
    );
    let (_s, _d) = lossless_send(&f, &mut a, &mut b, 3, 10);
    let buf = a.buffer(64, RW).unwrap();
    a.qp.post_recv(&[buf.sge(0, 64)]).unwrap();
    f.run_until_idle();
    f.force_qp_error(&a.hca, a.qp.qpn);
    let c = a.cq.drain();
    assert_eq!(c.len(), 4);
    assert!(c.iter().all(|c| c.error() == Some(Syndrome::WrFlush)));
    assert!(
        a.events
            .asyncs()
            .contains(&AsyncEvent::QpFatal { qpn: a.qp.qpn })
    );
}

#[test]
fn faults_are_reproducible_from_the_seed() {
    let run = |seed: u64| {
        let f = Fabric::new(FabricConfig {
            mode: ExecMode::Stepped,
            seed,
            ..FabricConfig::default()
        });
        let (mut a, mut b) = rc_pair(
            &f,
            RcOptions {
                timeout: 8,
                ..RcOptions::default()
            },
        )
        .unwrap();
        let cfg = FaultConfig {
            drop: 0.1,
            duplicate: 0.1,
            reorder: 0.2,
            corrupt: 0.05,
            delay_ns: 1000,
            jitter_ns: 5000,
            reorder_delay_ns: 50_000,
        };
        f.set_link_faults(&a.hca, &b.hca, cfg);
        f.set_link_faults(&b.hca, &a.hca, cfg);
        f.set_capture(true);
        let (_s, _d) = lossless_send(&f, &mut a, &mut b, 10, 3000);
        f.advance(Duration::from_millis(200));
        assert_eq!(a.cq.drain().len(), 10);
        let frames: Vec<(u64, Vec<u8>)> = f
            .take_captured()
            .into_iter()
            .map(|c| (c.at_ns, c.bytes))
            .collect();
        (f.stats(), frames)
    };
    let (s1, f1) = run(77);
    let (s2, f2) = run(77);
    assert_eq!(s1, s2);
    assert_eq!(f1, f2);
    let (s3, _) = run(78);
    assert_ne!(s1, s3, "another seed, another fault pattern");
}

#[test]
fn first_packet_in_rtr_raises_comm_established() {
    use crate::device::AddressVector;
    let f = Fabric::stepped();
    let mut a = Node::new(&f, [10, 0, 0, 1], QpType::Rc).unwrap();
    let mut b = Node::new(&f, [10, 0, 0, 2], QpType::Rc).unwrap();
    let o = RcOptions::default();
    a.bring_up(Some((b.hca.gid(), b.qp.qpn)), o).unwrap();
    // b only to RTR (as a passive side before the CM RTU arrives).
    use QpAttrMask as M;
    let mut at = QpAttr {
        port: 1,
        access: o.access,
        state: QpState::Init,
        ..QpAttr::default()
    };
    b.hca
        .modify_qp(
            b.qp.qpn,
            &at,
            M::STATE | M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS,
        )
        .unwrap();
    at.state = QpState::Rtr;
    at.av = AddressVector {
        dgid: a.hca.gid(),
        hop_limit: 64,
        ..AddressVector::default()
    };
    at.dest_qpn = a.qp.qpn;
    at.rq_psn = o.psn;
    at.max_dest_rd_atomic = 1;
    let rtr = M::STATE
        | M::AV
        | M::PATH_MTU
        | M::DEST_QPN
        | M::RQ_PSN
        | M::MAX_DEST_RD_ATOMIC
        | M::MIN_RNR_TIMER;
    b.hca.modify_qp(b.qp.qpn, &at, rtr).unwrap();
    let dst = b.buffer(64, RW).unwrap();
    let src = a.buffer(64, RW).unwrap();
    b.qp.post_recv(&[dst.sge(0, 64)]).unwrap();
    let mut w = send_wqe(
        &a.qp,
        SendOpcode::Send,
        CtrlFlags::CQ_UPDATE,
        0,
        src.sge(0, 8),
    );
    a.qp.post_send(&mut w).unwrap();
    f.run_until_idle();
    assert_eq!(
        b.events.asyncs(),
        vec![AsyncEvent::CommEstablished { qpn: b.qp.qpn }]
    );
    // An RTR QP receives (and acknowledges) but does not send.
    assert_eq!(one(&mut b.cq).byte_cnt, 8);
    assert_eq!(one(&mut a.cq).error(), None);
}

#[test]
fn gsi_requires_the_gsi_qkey() {
    let f = Fabric::stepped();
    let mut a = Node::new(&f, [10, 0, 0, 1], QpType::Ud).unwrap();
    let mut b = Node::new(&f, [10, 0, 0, 2], QpType::Gsi).unwrap();
    a.bring_up(
        None,
        RcOptions {
            qkey: 0x1234,
            ..RcOptions::default()
        },
    )
    .unwrap();
    b.bring_up(
        None,
        RcOptions {
            qkey: GSI_QKEY,
            ..RcOptions::default()
        },
    )
    .unwrap();
    let src = a.buffer(256, RW).unwrap();
    let dst = b.buffer(512, RW).unwrap();
    b.qp.post_recv(&[dst.sge(0, 512)]).unwrap();
    let send = |a: &mut Node, qkey: u32| {
        let av = DatagramSegRepr {
            qkey,
            dqpn: GSI_QPN,
            rgid: b.hca.gid().0,
            ..Default::default()
        };
        let mut w = a.qp.builder(SendOpcode::Send, CtrlFlags::CQ_UPDATE, 0);
        w.datagram(&av).unwrap().data(src.sge(0, 24)).unwrap();
        a.qp.post_send(&mut w).unwrap();
        f.run_until_idle();
    };
    // A plain Q_Key is not the GSI's: dropped.
    send(&mut a, 0x1234);
    // GSI_QKEY has bit 31 set (a controlled Q_Key): a work request cannot
    // carry it; it selects the QP's own Q_Key, which a privileged consumer
    // sets to the GSI Q_Key.
    send(&mut a, GSI_QKEY);
    assert_eq!(b.hca.qp_stats(GSI_QPN).unwrap().ud_dropped, 2);
    let q = QpAttr {
        state: QpState::Rts,
        qkey: GSI_QKEY,
        ..QpAttr::default()
    };
    a.hca
        .modify_qp(a.qp.qpn, &q, QpAttrMask::STATE | QpAttrMask::QKEY)
        .unwrap();
    send(&mut a, 0x8000_0000);
    assert_eq!(b.hca.qp_stats(GSI_QPN).unwrap().ud_dropped, 2);
    let r = one(&mut b.cq);
    assert_eq!((r.src_qpn, r.byte_cnt), (a.qp.qpn, 64));
}
