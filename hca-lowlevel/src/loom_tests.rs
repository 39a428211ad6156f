//! loom models of ring ownership: the same ring and doorbell-record code
//! the driver and the device run, with loom's atomics (`--cfg loom`).
//!
//! Run: `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test -p hca-lowlevel --lib --release loom`.

use alloc::sync::Arc;
use alloc::vec::Vec;

use loom::thread;

use crate::barrier;
use crate::cqe::{CQE_SIZE, Cqe, CqeOpcode, CqeRepr};
use crate::doorbell::{CqDoorbellRecord, QpDoorbellRecord};
use crate::ring::{CqRing, SendRing};
use crate::sync::atomic::AtomicU64;
use crate::wqe::{CtrlFlags, SendOpcode, SendWqeBuilder};

fn words(n: usize) -> Arc<[AtomicU64]> {
    (0..n).map(|_| AtomicU64::new(0)).collect::<Vec<_>>().into()
}

/// A CQE whose every word depends on `n`, so a torn read shows.
fn cqe_bytes(n: u32) -> [u8; CQE_SIZE] {
    let mut b = [0u8; CQE_SIZE];
    CqeRepr {
        opcode: CqeOpcode::Req,
        solicited: false,
        wqe_opcode: 0x0a,
        qpn: n,
        wqe_counter: n as u16,
        byte_cnt: n.wrapping_mul(3),
        imm_inval_pkey: n.wrapping_mul(5),
        src_qpn: n,
        grh: false,
        syndrome: 0,
        vendor_syndrome: 0,
    }
    .emit(&mut Cqe::new_unchecked(&mut b[..]), false);
    for (i, x) in b.iter_mut().take(24).enumerate() {
        *x = (n as u8).wrapping_add(i as u8);
    }
    b
}

/// Device: writes CQEs into a 2-entry ring, never overwriting one software
/// has not consumed (it reads the consumer index from the doorbell record).
/// Driver: polls by owner bit, reads the whole CQE, publishes the consumer
/// index. Every CQE is seen exactly once, in order, never torn — across a
/// wrap of the ring (owner parity flips).
#[test]
fn loom_cq_owner_bit_and_consumer_index() {
    loom::model(|| {
        const ENTRIES: u32 = 2;
        const TOTAL: u32 = 3;
        let ring_mem = words(ENTRIES as usize * CQE_SIZE / 8);
        let dbr_mem = words(1);
        let init = CqRing::new(ring_mem.clone(), ENTRIES).unwrap();
        init.init_invalid();

        let dev_ring = ring_mem.clone();
        let dev_dbr = dbr_mem.clone();
        let device = thread::spawn(move || {
            let ring = CqRing::new(dev_ring, ENTRIES).unwrap();
            let dbr = CqDoorbellRecord::new(dev_dbr).unwrap();
            for pi in 0..TOTAL {
                // Wait for room: pi - ci < entries.
                while pi.wrapping_sub(dbr.ci()) >= ENTRIES {
                    thread::yield_now();
                }
                ring.write_cqe(pi, &cqe_bytes(pi)).unwrap();
            }
        });

        let ring = CqRing::new(ring_mem, ENTRIES).unwrap();
        let dbr = CqDoorbellRecord::new(dbr_mem).unwrap();
        let mut ci = 0u32;
        while ci < TOTAL {
            match ring.poll(ci) {
                Some(c) => {
                    let mut want = cqe_bytes(ci);
                    want[CQE_SIZE - 1] = (want[CQE_SIZE - 1] & !1) | u8::from(ci & ENTRIES != 0);
                    assert_eq!(c.into_inner(), want, "CQE {ci} torn or stale");
                    ci += 1;
                    dbr.set_ci(ci);
                }
                None => thread::yield_now(),
            }
        }
        device.join().unwrap();
    });
}

/// Driver: builds a WQE, copies it into the send ring with 64-bit stores,
/// `to_device`, then publishes the producer counter in the doorbell record.
/// Device: once it sees the new counter (Acquire), the whole WQE is there.
#[test]
fn loom_send_queue_publication() {
    loom::model(|| {
        let sq_mem = words(2 * 8);
        let dbr_mem = words(1);
        let dev_sq = sq_mem.clone();
        let dev_dbr = dbr_mem.clone();
        let mut b = SendWqeBuilder::new(SendOpcode::Send, 1, 7, CtrlFlags::CQ_UPDATE, 0);
        b.inline(&[0x5a; 60]).unwrap();
        let wqe: Vec<u8> = b.finish().unwrap().to_vec();
        let expect = wqe.clone();

        let device = thread::spawn(move || {
            let sq = SendRing::new(dev_sq, 2).unwrap();
            let dbr = QpDoorbellRecord::new(dev_dbr).unwrap();
            loop {
                if dbr.sq_head() == 3 {
                    // WQE at counter 1 spans slots 1 and 0 (wrap).
                    let mut got = [0u8; 128];
                    sq.read_wqe(1, &mut got[..expect.len()]).unwrap();
                    assert_eq!(&got[..expect.len()], &expect[..]);
                    return;
                }
                thread::yield_now();
            }
        });

        let sq = SendRing::new(sq_mem, 2).unwrap();
        let dbr = QpDoorbellRecord::new(dbr_mem).unwrap();
        sq.write_wqe(1, &wqe).unwrap();
        barrier::to_device();
        dbr.set_sq_head(3);
        device.join().unwrap();
    });
}

/// The two halves of a QP doorbell record are written by different threads
/// (send and receive posting); neither update may be lost.
#[test]
fn loom_doorbell_record_halves() {
    loom::model(|| {
        let mem = words(1);
        let m2 = mem.clone();
        let t = thread::spawn(move || {
            let dbr = QpDoorbellRecord::new(m2).unwrap();
            dbr.set_rq_head(0x1111);
        });
        let dbr = QpDoorbellRecord::new(mem).unwrap();
        dbr.set_sq_head(0x2222);
        t.join().unwrap();
        assert_eq!((dbr.rq_head(), dbr.sq_head()), (0x1111, 0x2222));
    });
}
