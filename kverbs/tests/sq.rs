//! Send-queue accounting under selective signalling (with wrap-around of
//! the ring and of the 16-bit WQE counter), overflow refused before
//! anything is written, the asynchronous slow path, and asynchronous
//! events to the QP's handler.

#![cfg(not(loom))]

mod vsupport;

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use hca_lowlevel::device::{AsyncEvent, QpAttr, QpAttrMask, QpState, QpType};
use kverbs::error::{PostErrorKind, VerbsError};
use kverbs::irql::{AnyIrql, Dispatch};
use kverbs::qp::{QpHandler, QueueKind};
use kverbs::slowpath::{Callback, CompleteAt};
use kverbs::wr::{Payload, SendWr, Signal};
use vsupport::{Collect, MODES, Mode, World, bring_up, env_count};

fn accounting(mode: Mode, total: u64) {
    let w = World::new(mode);
    w.platform.run_passive(|p| {
        let a = w.node([10, 0, 0, 1], p);
        let b = w.node([10, 0, 0, 2], p);
        let ca = Collect::<u64>::new(total as usize + 64);
        let cb = Collect::<u64>::new(4096);
        let cq_a = a.cq(64, ca.clone(), p);
        let cq_b = b.cq(512, cb.clone(), p);
        // 8 + 1 (marker) rounds up to 16 WQEBBs: 15 usable.
        let qa = a.qp(QpType::Rc, &cq_a, 8, 1, p);
        let qb = b.qp(QpType::Rc, &cq_b, 8, 128, p);
        assert_eq!(qa.send_capacity(), 15);
        bring_up(&qa, Some((b.gid(), qb.qpn())), p);
        bring_up(&qb, Some((a.gid(), qa.qpn())), p);
        let rbuf = kverbs::mr::Mr::alloc(
            &b.pd,
            256 * 16,
            hca_lowlevel::device::AccessFlags::LOCAL_WRITE,
            p,
        )
        .unwrap();
        let mut next = 0u64;
        let mut signalled = Vec::with_capacity(total as usize);
        let mut receives_posted = 0u64;
        while next < total {
            // Keep B's receive queue stocked.
            let got = cb.take().len() as u64;
            let _ = got;
            if receives_posted < next + 100 {
                let mut r = qb.begin_recv(p).unwrap();
                while r.free_slots() > 0 {
                    let sge = rbuf.sge((receives_posted % 256) * 16, 16).unwrap();
                    r.recv(&[sge], receives_posted).unwrap();
                    receives_posted += 1;
                }
                r.commit();
            }
            let mut s = qa.begin_send(p).unwrap();
            // Fill the queue: every 4th request signalled, and always the
            // last one that fits, so the space is reclaimed.
            loop {
                if next >= total {
                    break;
                }
                let free = s.free_wqebbs();
                if free == 0 {
                    if mode == Mode::Threaded {
                        // The device may be reclaiming concurrently.
                        break;
                    }
                    // Nothing runs meanwhile in stepped mode: a full queue
                    // refuses, hands the context back, writes nothing.
                    let e = s
                        .send(
                            &SendWr::new(Payload::Inline(&[1])),
                            Signal::Signalled(u64::MAX),
                        )
                        .unwrap_err();
                    assert_eq!(e.kind, PostErrorKind::QueueFull);
                    assert_eq!(e.context, Some(u64::MAX));
                    break;
                }
                let sig = if next % 4 == 3 || free == 1 || next + 1 == total {
                    signalled.push(next);
                    Signal::Signalled(next)
                } else {
                    Signal::Unsignalled
                };
                s.send(&SendWr::new(Payload::Inline(&next.to_le_bytes())), sig)
                    .unwrap();
                next += 1;
            }
            s.commit();
            assert!(
                qa.outstanding(QueueKind::Send) <= 16,
                "never more than the ring"
            );
            w.wait("space reclaimed", || {
                qa.outstanding(QueueKind::Send) == 0 || mode == Mode::Threaded && ca.len() > 0
            });
        }
        let sl = signalled.len();
        w.wait("all completions", || ca.total() == sl);
        let got: Vec<u64> = ca
            .take()
            .into_iter()
            .map(|c| {
                assert!(c.is_success());
                c.context.unwrap()
            })
            .collect();
        assert_eq!(got, signalled, "signalled contexts, in order, exactly once");
        w.wait("idle", || qa.outstanding(QueueKind::Send) == 0);
        assert_eq!(qa.stats().bogus_completions, 0);
        assert_eq!(qa.stats().lost_contexts, 0);
        qa.destroy(p).unwrap();
        qb.destroy(p).unwrap();
        w.wait("destroyed", || qb.outstanding(QueueKind::Recv) == 0);
        for _ in 0..20 {
            w.step();
        }
    });
    w.finish();
}

#[test]
fn selective_signalling_accounting_wraps_ring_and_counter() {
    // 70,000 WQEs wrap the 16-bit WQE counter once.
    let total = env_count("KVERBS_SQ_WQES", 70_000) as u64;
    for mode in MODES {
        accounting(mode, total);
    }
}

#[derive(Default)]
struct Events {
    events: Mutex<Vec<AsyncEvent>>,
    flushed: AtomicUsize,
}

impl QpHandler for Events {
    fn on_async_event(&self, e: AsyncEvent, _irql: &Dispatch<'_>) {
        let mut v = self.events.lock().unwrap();
        if v.len() < v.capacity() {
            v.push(e);
        }
    }
    fn on_flushed(&self, r: Result<(), VerbsError>, _irql: &Dispatch<'_>) {
        assert!(r.is_ok());
        self.flushed.fetch_add(1, Ordering::AcqRel);
    }
}

fn slow_path_and_events(mode: Mode) {
    let w = World::new(mode);
    w.platform.run_passive(|p| {
        let a = w.node([10, 0, 0, 1], p);
        let ca = Collect::<u64>::new(64);
        let cq = a.cq(64, ca.clone(), p);
        let ev = Arc::new(Events::default());
        ev.events.lock().unwrap().reserve(16);
        let qp = a.qp_with(QpType::Ud, &cq, 8, 8, ev.clone(), p);
        // Modify requested at DISPATCH_LEVEL, run on the worker, reported
        // in a DPC and at PASSIVE_LEVEL as asked.
        let results = Arc::new(Mutex::new(Vec::with_capacity(8)));
        let levels = Arc::new(AtomicU32::new(0));
        let done: Callback<Result<(), VerbsError>> = {
            let results = results.clone();
            let levels = levels.clone();
            Arc::new(move |r: Result<(), VerbsError>, irql: AnyIrql<'_, '_>| {
                levels.fetch_or(
                    if irql.passive().is_some() { 1 } else { 2 },
                    Ordering::AcqRel,
                );
                results.lock().unwrap().push(r);
            })
        };
        let init = QpAttr {
            state: QpState::Init,
            qkey: 0x42,
            port: 1,
            ..QpAttr::default()
        };
        use QpAttrMask as M;
        w.platform.run_at_dispatch(|d| {
            qp.modify_async(
                init,
                M::STATE | M::PKEY_INDEX | M::PORT | M::QKEY,
                CompleteAt::Dispatch,
                &done,
                d,
            )
            .unwrap();
            // An invalid edge (INIT -> RTS) is refused by the device, and
            // reported through the same callback.
            let rts = QpAttr {
                state: QpState::Rts,
                ..init
            };
            qp.modify_async(rts, M::STATE | M::SQ_PSN, CompleteAt::Passive, &done, d)
                .unwrap();
        });
        w.wait("modifies", || results.lock().unwrap().len() == 2);
        let r = results.lock().unwrap().clone();
        // The two callbacks run at different levels, so in either order.
        assert_eq!(r.iter().filter(|x| x.is_ok()).count(), 1, "{r:?}");
        assert!(
            r.iter().any(|x| matches!(x, Err(VerbsError::Hca(_)))),
            "{r:?}"
        );
        assert_eq!(levels.load(Ordering::Acquire), 3, "both levels were used");
        // A fatal device error reaches the QP's handler (and the QP
        // refuses further modify after a flush).
        w.fabric.force_qp_error(&a.hca, qp.qpn());
        w.wait("QP fatal event", || {
            ev.events
                .lock()
                .unwrap()
                .contains(&AsyncEvent::QpFatal { qpn: qp.qpn() })
        });
        qp.disconnect_and_flush(p).unwrap();
        w.wait("flushed", || ev.flushed.load(Ordering::Acquire) == 1);
        assert_eq!(
            qp.modify(&init, M::STATE, p),
            Err(VerbsError::Closed),
            "no modify after disconnect"
        );
        assert_eq!(
            qp.begin_send(p).err(),
            Some(PostErrorKind::Flushing),
            "no posting after disconnect"
        );
        qp.destroy(p).unwrap();
        w.wait("destroy", || qp.outstanding(QueueKind::Send) == 0);
        for _ in 0..20 {
            w.step();
        }
    });
    w.finish();
}

#[test]
fn async_slow_path_and_async_events_in_both_modes() {
    for mode in MODES {
        slow_path_and_events(mode);
    }
}

/// Posters on several processors share one QP: a batch must hand its
/// queue on whole. Each poster opens and drops (or commits) batches
/// as fast as it can; none may ever be refused — the QP is live, so a
/// refusal ("flushing") is a lie a consumer would act on by tearing its
/// connection down. (The batch once let go of the send lock before its
/// claim on the slot ring, so a poster that took the lock in between found
/// the ring "claimed" and was told the QP was flushing.)
#[test]
fn concurrent_posters_are_never_refused_on_a_live_qp() {
    let rounds = env_count("KVERBS_SQ_POSTER_ROUNDS", 100_000);
    let w = World::new(Mode::Threaded);
    let refused = AtomicUsize::new(0);
    w.platform.run_passive(|p| {
        let a = w.node([10, 0, 0, 1], p);
        let b = w.node([10, 0, 0, 2], p);
        let cq_a = a.cq(64, Collect::<u64>::new(64), p);
        let cq_b = b.cq(64, Collect::<u64>::new(64), p);
        let qa = a.qp(QpType::Rc, &cq_a, 8, 1, p);
        let qb = b.qp(QpType::Rc, &cq_b, 8, 8, p);
        bring_up(&qa, Some((b.gid(), qb.qpn())), p);
        bring_up(&qb, Some((a.gid(), qa.qpn())), p);
        std::thread::scope(|scope| {
            for _ in 0..2 {
                scope.spawn(|| {
                    w.platform.run_passive(|p| {
                        for _ in 0..rounds {
                            match qa.begin_send(p) {
                                Ok(batch) => drop(batch),
                                Err(kind) => {
                                    assert_eq!(kind, PostErrorKind::Flushing);
                                    refused.fetch_add(1, Ordering::Relaxed);
                                }
                            }
                            match qa.begin_recv(p) {
                                Ok(batch) => drop(batch),
                                Err(kind) => {
                                    assert_eq!(kind, PostErrorKind::Flushing);
                                    refused.fetch_add(1, Ordering::Relaxed);
                                }
                            }
                        }
                    });
                });
            }
        });
    });
    assert_eq!(
        refused.load(Ordering::Relaxed),
        0,
        "a live QP refused batches"
    );
    w.finish();
}

/// A batch dropped uncommitted posts nothing and gives back the contexts of
/// the requests it wrote (their slots are free for the next batch, which
/// then loses nothing); a committed batch's contexts come back once, in
/// completions.
fn dropped_batch(mode: Mode) {
    let w = World::new(mode);
    w.platform.run_passive(|p| {
        let a = w.node([10, 0, 0, 1], p);
        let b = w.node([10, 0, 0, 2], p);
        let ca = Collect::<Arc<u64>>::new(64);
        let cq_a = a.cq(64, ca.clone(), p);
        let cq_b = b.cq(64, Collect::<u64>::new(64), p);
        let qa = a.qp(QpType::Rc, &cq_a, 8, 1, p);
        let qb = b.qp(QpType::Rc, &cq_b, 8, 8, p);
        bring_up(&qa, Some((b.gid(), qb.qpn())), p);
        bring_up(&qb, Some((a.gid(), qa.qpn())), p);
        let rbuf = kverbs::mr::Mr::alloc(
            &b.pd,
            8 * 16,
            hca_lowlevel::device::AccessFlags::LOCAL_WRITE,
            p,
        )
        .unwrap();
        let mut r = qb.begin_recv(p).unwrap();
        for i in 0..4u64 {
            r.recv(&[rbuf.sge(i * 16, 16).unwrap()], i).unwrap();
        }
        r.commit();
        let dropped = Arc::new(7u64);
        let mut s = qa.begin_send(p).unwrap();
        for _ in 0..3 {
            s.send(
                &SendWr::new(Payload::Inline(&[1])),
                Signal::Signalled(Arc::clone(&dropped)),
            )
            .unwrap();
        }
        assert_eq!(s.len(), 3);
        drop(s);
        assert_eq!(
            Arc::strong_count(&dropped),
            1,
            "the dropped batch gave its contexts back"
        );
        assert_eq!(qa.outstanding(QueueKind::Send), 0, "nothing was posted");
        let kept = Arc::new(8u64);
        let mut s = qa.begin_send(p).unwrap();
        for _ in 0..2 {
            s.send(
                &SendWr::new(Payload::Inline(&[2])),
                Signal::Signalled(Arc::clone(&kept)),
            )
            .unwrap();
        }
        assert_eq!(s.commit(), 2);
        w.wait("both completions", || ca.total() == 2);
        for c in ca.take() {
            assert!(c.is_success());
            assert_eq!(c.context.as_deref(), Some(&8));
        }
        assert_eq!(Arc::strong_count(&kept), 1, "each context came back once");
        assert_eq!(qa.stats().lost_contexts, 0);
        assert_eq!(qa.stats().bogus_completions, 0);
        qa.destroy(p).unwrap();
        qb.destroy(p).unwrap();
        for _ in 0..20 {
            w.step();
        }
    });
    w.finish();
}

#[test]
fn dropped_batch_gives_contexts_back_and_posts_nothing() {
    for mode in MODES {
        dropped_batch(mode);
    }
}
