//! RC queue pairs between two software HCAs: SEND (+imm, +invalidate),
//! RDMA WRITE (+imm), RDMA READ, fast registration with key rotation and
//! LOCAL_INV — data verified — in the threaded and the stepped mode.

#![cfg(not(loom))]

mod vsupport;

use hca_lowlevel::cqe::Syndrome;
use hca_lowlevel::device::{AccessFlags, QpType};
use hca_lowlevel::dma::PhysAddr;
use kverbs::mr::{FrPool, Mr};
use kverbs::wr::{FastReg, Payload, ReadWr, SendWr, Signal, WcOpcode, WcStatus, WriteWr};
use vsupport::{Collect, MODES, Mode, World, bring_up};

fn pages(mr: &Mr<vsupport::Hp>, n: usize) -> Vec<PhysAddr> {
    let base = mr.mem().phys_addr().get();
    (0..n as u64).map(|i| PhysAddr(base + i * 4096)).collect()
}

fn round_trip(mode: Mode) {
    let w = World::new(mode);
    w.platform.run_passive(|p| {
        let a = w.node([10, 0, 0, 1], p);
        let b = w.node([10, 0, 0, 2], p);
        let ca = Collect::<u32>::new(256);
        let cb = Collect::<u32>::new(256);
        let cq_a = a.cq(128, ca.clone(), p);
        let cq_b = b.cq(128, cb.clone(), p);
        let qa = a.qp(QpType::Rc, &cq_a, 32, 16, p);
        let qb = b.qp(QpType::Rc, &cq_b, 32, 16, p);
        bring_up(&qa, Some((b.gid(), qb.qpn())), p);
        bring_up(&qb, Some((a.gid(), qa.qpn())), p);
        let rw = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
        let a_mr = Mr::alloc(&a.pd, 8 * 4096, AccessFlags::LOCAL_WRITE, p).unwrap();
        let b_mr = Mr::alloc(&b.pd, 8 * 4096, rw, p).unwrap();
        let b_fr_buf = Mr::alloc(&b.pd, 8 * 4096, AccessFlags::LOCAL_WRITE, p).unwrap();
        let pattern = |seed: u8, n: usize| -> Vec<u8> {
            (0..n)
                .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
                .collect()
        };

        // SEND and SEND with immediate (inline).
        {
            let mut r = qb.begin_recv(p).unwrap();
            for ctx in 100..104 {
                let off = u64::from(ctx - 100) * 4096;
                r.recv(&[b_mr.sge(off, 4096).unwrap()], ctx).unwrap();
            }
            assert_eq!(r.commit(), 4);
        }
        let msg = pattern(1, 3000);
        a_mr.mem().write(0, &msg).unwrap();
        {
            let mut s = qa.begin_send(p).unwrap();
            s.send(
                &SendWr::new(Payload::Sges(&[a_mr.sge(0, 3000).unwrap()])),
                Signal::Signalled(1),
            )
            .unwrap();
            let mut wr = SendWr::new(Payload::Inline(b"inline hello"));
            wr.imm = Some(0xabcd_0123);
            s.send(&wr, Signal::Signalled(2)).unwrap();
            assert_eq!(s.commit(), 2);
        }
        w.wait("sends", || ca.len() == 2 && cb.len() == 2);
        let got = cb.take();
        assert_eq!(got[0].context, Some(100));
        assert_eq!(got[0].byte_len, 3000);
        assert_eq!(got[0].opcode, WcOpcode::Recv);
        assert_eq!(got[1].context, Some(101));
        assert_eq!(got[1].imm, Some(0xabcd_0123));
        let mut buf = vec![0u8; 3000];
        b_mr.mem().read(0, &mut buf).unwrap();
        assert_eq!(buf, msg);
        let mut small = [0u8; 12];
        b_mr.mem().read(4096, &mut small).unwrap();
        assert_eq!(&small, b"inline hello");
        let sent = ca.take();
        assert!(
            sent.iter()
                .all(|c| c.is_success() && c.opcode == WcOpcode::Send)
        );

        // RDMA WRITE, RDMA WRITE with immediate, RDMA READ.
        let wdata = pattern(7, 5000);
        a_mr.mem().write(8192, &wdata).unwrap();
        let b_rkey = b_mr.rkey().unwrap();
        {
            let mut s = qa.begin_send(p).unwrap();
            s.rdma_write(
                &WriteWr {
                    payload: Payload::Sges(&[a_mr.sge(8192, 5000).unwrap()]),
                    remote_addr: b_mr.iova() + 3 * 4096,
                    rkey: b_rkey,
                    imm: None,
                    flags: Default::default(),
                },
                Signal::Unsignalled,
            )
            .unwrap();
            s.rdma_write(
                &WriteWr {
                    payload: Payload::Inline(b"tail"),
                    remote_addr: b_mr.iova() + 3 * 4096 + 5000,
                    rkey: b_rkey,
                    imm: Some(77),
                    flags: Default::default(),
                },
                Signal::Signalled(3),
            )
            .unwrap();
            // Read back what was just written, into a fresh place of A.
            s.rdma_read(
                &ReadWr {
                    local: &[a_mr.sge(20_000, 5004).unwrap()],
                    remote_addr: b_mr.iova() + 3 * 4096,
                    rkey: b_rkey,
                    flags: Default::default(),
                },
                Signal::Signalled(4),
            )
            .unwrap();
            assert_eq!(s.commit(), 3);
        }
        w.wait("RDMA", || ca.len() == 2 && cb.len() == 1);
        let rdma = ca.take();
        assert_eq!(rdma[0].context, Some(3));
        assert_eq!(rdma[0].opcode, WcOpcode::RdmaWrite);
        assert_eq!(rdma[1].context, Some(4));
        assert_eq!(rdma[1].opcode, WcOpcode::RdmaRead);
        assert!(rdma.iter().all(|c| c.is_success()));
        let imm = cb.take();
        assert_eq!(imm[0].opcode, WcOpcode::RecvRdmaWithImm);
        assert_eq!(imm[0].imm, Some(77));
        assert_eq!(
            imm[0].context,
            Some(102),
            "WRITE with immediate consumes a receive"
        );
        let mut back = vec![0u8; 5004];
        a_mr.mem().read(20_000, &mut back).unwrap();
        assert_eq!(&back[..5000], &wdata[..]);
        assert_eq!(&back[5000..], b"tail");

        // Fast registration on B: an indirect page list (8 pages), key
        // rotation, LOCAL_INV, re-registration inline (2 pages), remote
        // invalidation, and the stale rkey refused.
        let pool = FrPool::new(&b.pd, 4, 16, p).unwrap();
        let mut fr = pool.get(p).unwrap();
        // Page lists are built before a batch opens: a batch holds the
        // send lock (DISPATCH_LEVEL), where nothing may allocate.
        let pages8 = pages(&b_fr_buf, 8);
        let pages2 = pages(&b_fr_buf, 2);
        let iova = 0x7000_0000_0000u64 + 100;
        let rkey1 = {
            let mut s = qb.begin_send(p).unwrap();
            let k = s
                .reg_mr(
                    &mut fr,
                    &FastReg {
                        pages: &pages8,
                        page_shift: 12,
                        iova,
                        length: 8 * 4096 - 100,
                        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
                    },
                    Signal::Signalled(200),
                )
                .unwrap();
            s.commit();
            k
        };
        assert_eq!(fr.rkey(), Some(rkey1));
        w.wait("REG_MR", || cb.len() == 1);
        assert!(cb.take()[0].is_success());
        let fdata = pattern(9, 6000);
        a_mr.mem().write(0, &fdata).unwrap();
        let write_to = |rkey: u32, ctx: u32| {
            let mut s = qa.begin_send(p).unwrap();
            s.rdma_write(
                &WriteWr {
                    payload: Payload::Sges(&[a_mr.sge(0, 6000).unwrap()]),
                    remote_addr: iova + 4000,
                    rkey,
                    imm: None,
                    flags: Default::default(),
                },
                Signal::Signalled(ctx),
            )
            .unwrap();
            s.commit();
        };
        write_to(rkey1, 5);
        w.wait("write via FR", || ca.len() == 1);
        assert!(ca.take()[0].is_success());
        let mut check = vec![0u8; 6000];
        // iova + 4000 is byte 100 + 4000 of the first page run.
        b_fr_buf.mem().read(4100, &mut check).unwrap();
        assert_eq!(check, fdata);
        // LOCAL_INV, then register again (inline list): a new key.
        let rkey2 = {
            let mut s = qb.begin_send(p).unwrap();
            s.local_inv(&mut fr, Signal::Signalled(201)).unwrap();
            let k = s
                .reg_mr(
                    &mut fr,
                    &FastReg {
                        pages: &pages2,
                        page_shift: 12,
                        iova,
                        length: 4096,
                        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
                    },
                    Signal::Signalled(202),
                )
                .unwrap();
            s.commit();
            k
        };
        assert_ne!(rkey1, rkey2, "the key byte rotates on every registration");
        assert_eq!(rkey1 >> 8, rkey2 >> 8, "same mkey");
        w.wait("LOCAL_INV + REG_MR", || cb.len() == 2);
        assert!(cb.take().iter().all(|c| c.is_success()));
        // SEND with invalidate of rkey2: B sees the invalidated key.
        {
            let mut s = qa.begin_send(p).unwrap();
            let mut wr = SendWr::new(Payload::Inline(b"done"));
            wr.invalidate = Some(rkey2);
            s.send(&wr, Signal::Signalled(6)).unwrap();
            s.commit();
        }
        w.wait("SEND with invalidate", || ca.len() == 1 && cb.len() == 1);
        assert!(ca.take()[0].is_success());
        let inv = cb.take();
        assert_eq!(inv[0].invalidated_rkey, Some(rkey2));
        assert!(
            !fr.remote_invalidated(rkey1),
            "a stale key is not this MR's"
        );
        assert!(fr.remote_invalidated(rkey2));
        assert!(!fr.is_registered());
        // Register once more (a third key), then use the *stale* rkey1:
        // the responder refuses it with a remote access error.
        {
            let mut s = qb.begin_send(p).unwrap();
            let k3 = s
                .reg_mr(
                    &mut fr,
                    &FastReg {
                        pages: &pages8,
                        page_shift: 12,
                        iova,
                        length: 8 * 4096 - 100,
                        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
                    },
                    Signal::Signalled(203),
                )
                .unwrap();
            assert!(k3 != rkey1 && k3 != rkey2);
            s.commit();
        }
        w.wait("REG_MR 3", || cb.len() == 1);
        cb.take();
        b_fr_buf.mem().write(4100, &vec![0u8; 6000]).unwrap();
        write_to(rkey1, 7);
        w.wait("stale rkey refused", || ca.len() == 1);
        let refused = ca.take();
        assert_eq!(refused[0].context, Some(7));
        assert_eq!(
            refused[0].status,
            WcStatus::Error(Some(Syndrome::RemoteAccess)),
            "stale rkey must be a protection error"
        );
        b_fr_buf.mem().read(4100, &mut check).unwrap();
        assert!(
            check.iter().all(|&x| x == 0),
            "nothing written via a stale rkey"
        );

        // Tear down (A's QP is in error now; destroy drains both).
        qa.destroy(p).unwrap();
        qb.destroy(p).unwrap();
        w.wait("QP teardown", || {
            qa.outstanding(kverbs::qp::QueueKind::Send) == 0 && cb.total() >= 8
        });
        let leftovers = cb.take();
        assert!(
            leftovers.iter().all(|c| c.status == WcStatus::Flushed),
            "B's last receive comes back flushed"
        );
        assert_eq!(
            qa.stats().bogus_completions + qb.stats().bogus_completions,
            0
        );
        assert_eq!(qa.stats().lost_contexts + qb.stats().lost_contexts, 0);
        drop(fr);
        for _ in 0..50 {
            w.step();
        }
        pool.destroy(p).unwrap();
        cq_a.destroy(p).unwrap();
        cq_b.destroy(p).unwrap();
    });
    w.finish();
}

#[test]
fn rc_send_write_read_fastreg_round_trip_threaded() {
    round_trip(MODES[0]);
}

#[test]
fn rc_send_write_read_fastreg_round_trip_stepped() {
    round_trip(MODES[1]);
}
