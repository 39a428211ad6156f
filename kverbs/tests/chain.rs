//! 100,000 chained inline completions on real objects: the stepped HCA
//! executes each SEND inside its doorbell write, and the completion
//! handler posts the next SEND from within the CQ's drain loop. The stack
//! depth of the handler is measured over the whole chain and must stay
//! flat (one drain loop per CQ: no nesting).

#![cfg(not(loom))]

mod vsupport;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use hca_lowlevel::device::{AccessFlags, QpType};
use kverbs::cq::CqHandler;
use kverbs::irql::Dispatch;
use kverbs::mr::Mr;
use kverbs::qp::Qp;
use kverbs::wr::{Completion, Payload, SendWr, Signal};
use vsupport::{Hp, MODES, Mode, World, bring_up, env_count};

thread_local! {
    static SPAN: std::cell::Cell<(usize, usize)> = const { std::cell::Cell::new((usize::MAX, 0)) };
}

/// A's handler: each completion posts the next SEND.
struct Chain {
    limit: u64,
    qp: OnceLock<Qp<Hp, u64>>,
    delivered: AtomicU64,
    next: AtomicU64,
    out_of_order: AtomicBool,
    failed: AtomicBool,
    highest_sp: AtomicUsize,
}

impl CqHandler<u64> for Chain {
    fn on_completion(&self, c: Completion<u64>, irql: &Dispatch<'_>) {
        let marker = 0u8;
        let sp = std::ptr::addr_of!(marker).addr();
        // Per thread: DPCs of one CQ may run on different processors, each
        // with its own stack.
        let spread = SPAN.with(|span| {
            let (lo, hi) = span.get();
            let (lo, hi) = (lo.min(sp), hi.max(sp));
            span.set((lo, hi));
            hi - lo
        });
        self.highest_sp.fetch_max(spread, Ordering::Relaxed);
        if !c.is_success() {
            self.failed.store(true, Ordering::Relaxed);
            return;
        }
        let n = c.context.unwrap_or(u64::MAX);
        if self.next.swap(n + 1, Ordering::Relaxed) != n {
            self.out_of_order.store(true, Ordering::Relaxed);
        }
        self.delivered.fetch_add(1, Ordering::Relaxed);
        if n + 1 < self.limit {
            let qp = self.qp.get().unwrap();
            let mut s = qp.begin_send(irql).unwrap();
            let bytes = (n + 1).to_le_bytes();
            s.send(
                &SendWr::new(Payload::Inline(&bytes)),
                Signal::Signalled(n + 1),
            )
            .unwrap();
            s.commit();
        }
    }
}

/// B's handler: reposts each receive.
struct Repost {
    qp: OnceLock<Qp<Hp, u64>>,
    mr: OnceLock<Mr<Hp>>,
    received: AtomicU64,
    failed: AtomicBool,
}

impl CqHandler<u64> for Repost {
    fn on_completion(&self, c: Completion<u64>, irql: &Dispatch<'_>) {
        if !c.is_success() {
            self.failed.store(true, Ordering::Relaxed);
            return;
        }
        self.received.fetch_add(1, Ordering::Relaxed);
        let slot = c.context.unwrap_or(0);
        let sge = self.mr.get().unwrap().sge(slot * 64, 64).unwrap();
        let qp = self.qp.get().unwrap();
        let mut r = qp.begin_recv(irql).unwrap();
        r.recv(&[sge], slot).unwrap();
        r.commit();
    }
}

fn chain(mode: Mode, limit: u64) {
    let w = World::new(mode);
    w.fabric.set_inline_doorbells(true);
    w.platform.run_passive(|p| {
        let a = w.node([10, 0, 0, 1], p);
        let b = w.node([10, 0, 0, 2], p);
        let chain = Arc::new(Chain {
            limit,
            qp: OnceLock::new(),
            delivered: AtomicU64::new(0),
            next: AtomicU64::new(0),
            out_of_order: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            highest_sp: AtomicUsize::new(0),
        });
        let repost = Arc::new(Repost {
            qp: OnceLock::new(),
            mr: OnceLock::new(),
            received: AtomicU64::new(0),
            failed: AtomicBool::new(false),
        });
        let cq_a = a.cq(256, chain.clone(), p);
        let cq_b = b.cq(4096, repost.clone(), p);
        let qa = a.qp(QpType::Rc, &cq_a, 64, 1, p);
        let qb = b.qp(QpType::Rc, &cq_b, 8, 1024, p);
        bring_up(&qa, Some((b.gid(), qb.qpn())), p);
        bring_up(&qb, Some((a.gid(), qa.qpn())), p);
        let mr = Mr::alloc(&b.pd, 1024 * 64, AccessFlags::LOCAL_WRITE, p).unwrap();
        {
            let mut r = qb.begin_recv(p).unwrap();
            for slot in 0..1000u64 {
                r.recv(&[mr.sge(slot * 64, 64).unwrap()], slot).unwrap();
            }
            r.commit();
        }
        chain.qp.set(qa.clone()).unwrap();
        repost.qp.set(qb.clone()).unwrap();
        repost.mr.set(mr.clone()).unwrap();
        let start = Instant::now();
        {
            let mut s = qa.begin_send(p).unwrap();
            s.send(
                &SendWr::new(Payload::Inline(&0u64.to_le_bytes())),
                Signal::Signalled(0),
            )
            .unwrap();
            s.commit();
        }
        while chain.delivered.load(Ordering::Relaxed) < limit {
            assert!(
                start.elapsed() < Duration::from_secs(300),
                "chain stalled at {}",
                chain.delivered.load(Ordering::Relaxed)
            );
            assert!(!chain.failed.load(Ordering::Relaxed), "a SEND failed");
            w.step();
        }
        w.wait("last receive", || {
            repost.received.load(Ordering::Relaxed) == limit
        });
        assert!(!chain.out_of_order.load(Ordering::Relaxed));
        assert!(!repost.failed.load(Ordering::Relaxed));
        let spread = chain.highest_sp.load(Ordering::Relaxed);
        println!(
            "{mode:?}: {limit} chained inline completions, handler stack spread {spread} bytes"
        );
        // One frame per link would be kilobytes after a few links; the
        // drain loop keeps every delivery on a thread at the same depth (a
        // DPC that starts from a different caller frame may sit a little
        // deeper or shallower).
        assert!(spread <= 1024, "stack grew by {spread} bytes");
        qa.destroy(p).unwrap();
        qb.destroy(p).unwrap();
        w.wait("drained", || {
            qa.outstanding(kverbs::qp::QueueKind::Send) == 0
                && qb.outstanding(kverbs::qp::QueueKind::Recv) == 0
        });
        for _ in 0..20 {
            w.step();
        }
    });
    w.finish();
}

#[test]
fn chained_inline_completions_keep_the_stack_flat() {
    let limit = env_count("KVERBS_CHAIN", 100_000) as u64;
    for mode in MODES {
        chain(mode, limit);
    }
}
