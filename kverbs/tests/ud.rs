//! UD and GSI (QP1) queue pairs: management datagrams with an address
//! vector, received with the source QPN, GID and P_Key.

#![cfg(not(loom))]

mod vsupport;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use hca_lowlevel::device::{AccessFlags, QpType};
use kverbs::device::DEFAULT_PKEY;
use kverbs::irql::Dispatch;
use kverbs::mr::Mr;
use kverbs::qp::QpHandler;
use kverbs::wr::{GRH_LEN, Payload, SendWr, Signal, UdDest, WcOpcode, WcStatus};
use vsupport::{Collect, MODES, Mode, QKEY, World, bring_up};

#[derive(Default)]
struct Destroyed(AtomicUsize);

impl QpHandler for Destroyed {
    fn on_destroyed(&self, _irql: &Dispatch<'_>) {
        self.0.fetch_add(1, Ordering::AcqRel);
    }
}

fn mad_round_trip(mode: Mode, ty: QpType) {
    let w = World::new(mode);
    w.platform.run_passive(|p| {
        let a = w.node([10, 0, 0, 1], p);
        let b = w.node([10, 0, 0, 2], p);
        let ca = Collect::<u32>::new(64);
        let cb = Collect::<u32>::new(64);
        let cq_a = a.cq(64, ca.clone(), p);
        let cq_b = b.cq(64, cb.clone(), p);
        let da = Arc::new(Destroyed::default());
        let db = Arc::new(Destroyed::default());
        let qa = a.qp_with(ty, &cq_a, 16, 16, da.clone(), p);
        let qb = b.qp_with(ty, &cq_b, 16, 16, db.clone(), p);
        if ty == QpType::Gsi {
            assert_eq!((qa.qpn(), qb.qpn()), (1, 1), "GSI QPs are QP1");
        }
        bring_up(&qa, None, p);
        bring_up(&qb, None, p);
        let send_mr = Mr::alloc(&a.pd, 4096, AccessFlags::LOCAL_WRITE, p).unwrap();
        let recv_mr = Mr::alloc(&b.pd, 4096, AccessFlags::LOCAL_WRITE, p).unwrap();
        let mad: Vec<u8> = (0..256u32).map(|i| (i * 7 + 3) as u8).collect();
        send_mr.mem().write(0, &mad).unwrap();
        // Two receives: at offsets 0 and 1024 of the receive MR.
        {
            let mut r = qb.begin_recv(p).unwrap();
            r.recv_ud(&recv_mr, 0, 512, 100).unwrap();
            r.recv_ud(&recv_mr, 1024, 512, 101).unwrap();
            assert_eq!(r.commit(), 2);
        }
        let dest = UdDest {
            qpn: qb.qpn(),
            qkey: QKEY,
            dgid: b.gid(),
            hop_limit: 64,
            traffic_class: 0,
            flow_label: 0,
            sl: 0,
        };
        let sge = send_mr.sge(0, 256).unwrap();
        {
            let mut s = qa.begin_send(p).unwrap();
            s.send_ud(
                &dest,
                &SendWr::new(Payload::Sges(&[sge])),
                Signal::Signalled(1),
            )
            .unwrap();
            // A second MAD, inline, with immediate data.
            let mut wr = SendWr::new(Payload::Inline(&mad[..64]));
            wr.imm = Some(0xfeed);
            s.send_ud(&dest, &wr, Signal::Signalled(2)).unwrap();
            assert_eq!(s.commit(), 2);
        }
        w.wait("MADs delivered", || ca.len() == 2 && cb.len() == 2);
        let sent = ca.take();
        assert_eq!(
            sent.iter().map(|c| c.context).collect::<Vec<_>>(),
            [Some(1), Some(2)]
        );
        assert!(sent.iter().all(|c| c.status == WcStatus::Success));
        let got = cb.take();
        assert_eq!(got.len(), 2);
        for (i, c) in got.iter().enumerate() {
            assert_eq!(c.context, Some(100 + i as u32));
            assert_eq!(c.status, WcStatus::Success);
            assert_eq!(c.opcode, WcOpcode::Recv);
            let ud = c.ud.expect("UD source");
            assert_eq!(ud.src_qpn, qa.qpn(), "source QPN");
            assert_eq!(ud.pkey, DEFAULT_PKEY);
            assert_eq!(ud.pkey_index, 0);
            let grh = ud.grh.expect("GRH decoded");
            assert_eq!(grh.sgid, a.gid(), "source GID");
            assert_eq!(grh.dgid, b.gid());
        }
        assert_eq!(got[0].byte_len as usize, GRH_LEN + 256);
        assert_eq!(got[0].imm, None);
        assert_eq!(got[1].byte_len as usize, GRH_LEN + 64);
        assert_eq!(got[1].imm, Some(0xfeed));
        let mut buf = vec![0u8; 256];
        recv_mr.mem().read(GRH_LEN, &mut buf).unwrap();
        assert_eq!(buf, mad);
        recv_mr.mem().read(1024 + GRH_LEN, &mut buf[..64]).unwrap();
        assert_eq!(&buf[..64], &mad[..64]);
        // A datagram with the wrong Q_Key is dropped (UD only: QP1 always
        // uses the GSI Q_Key).
        if ty == QpType::Ud {
            let mut r = qb.begin_recv(p).unwrap();
            r.recv_ud(&recv_mr, 2048, 512, 102).unwrap();
            r.commit();
            let mut s = qa.begin_send(p).unwrap();
            let bad = UdDest {
                qkey: 0x5555,
                ..dest
            };
            s.send_ud(
                &bad,
                &SendWr::new(Payload::Inline(b"x")),
                Signal::Signalled(3),
            )
            .unwrap();
            s.commit();
            w.wait("send completion", || ca.len() == 1);
            for _ in 0..20 {
                w.step();
            }
            assert_eq!(cb.len(), 0, "wrong Q_Key must not be delivered");
        }
        // Tear down: destroy flushes first; the outstanding receive (UD)
        // comes back flushed with its context.
        qa.destroy(p).unwrap();
        qb.destroy(p).unwrap();
        w.wait("QPs destroyed", || {
            da.0.load(Ordering::Acquire) == 1 && db.0.load(Ordering::Acquire) == 1
        });
        if ty == QpType::Ud {
            let flushed = cb.take();
            assert_eq!(flushed.len(), 1);
            assert_eq!(flushed[0].context, Some(102));
            assert_eq!(flushed[0].status, WcStatus::Flushed);
        }
        assert_eq!(
            qa.stats().bogus_completions + qb.stats().bogus_completions,
            0
        );
        cq_a.destroy(p).unwrap();
        cq_b.destroy(p).unwrap();
        send_mr.dereg(p).unwrap();
        recv_mr.dereg(p).unwrap();
        a.pd.dealloc(p).unwrap();
        b.pd.dealloc(p).unwrap();
        w.wait("CQs destroyed", || {
            ca.destroyed.load(Ordering::Acquire) == 1 && cb.destroyed.load(Ordering::Acquire) == 1
        });
    });
    w.finish();
}

#[test]
fn gsi_mad_round_trip_in_both_modes() {
    for mode in MODES {
        mad_round_trip(mode, QpType::Gsi);
    }
}

#[test]
fn ud_round_trip_with_qkey_in_both_modes() {
    for mode in MODES {
        mad_round_trip(mode, QpType::Ud);
    }
}
