//! Exactly-once flush under thousands of seeded schedules: a manual-mode
//! host platform (the test picks which DPC or work item runs next) and a
//! stepped HCA, random posting, QP errors injected mid-stream, disconnect
//! at a random point, then destroy. Every work request completes exactly
//! once, the drain marker's callback comes after the last completion, and
//! no callback runs after destroy.

#![cfg(not(loom))]

mod vsupport;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use hca_lowlevel::device::{AsyncEvent, QpType};
use kverbs::cq::{CqHandler, WorkCompletions};
use kverbs::error::VerbsError;
use kverbs::irql::Dispatch;
use kverbs::qp::QpHandler;
use kverbs::wr::{Completion, Payload, SendWr, Signal};
use vsupport::{Mode, World, bring_up, env_count};

/// Everything observed for one QP, in one sequence.
#[derive(Default)]
struct Log {
    seq: AtomicU64,
    completions: Mutex<Vec<(u64, Option<u64>)>>,
    flushed_at: Mutex<Option<u64>>,
    destroyed: AtomicBool,
    after_destroy: AtomicU64,
    flush_errors: AtomicU64,
    /// `Some(k)`: take the first `k` completions of each polled batch in
    /// `on_completions` and leave the rest for `on_completion` (the batch
    /// path, drain markers in their place, and its leftovers).
    batch_take: Option<usize>,
}

impl Log {
    fn new(batch_take: Option<usize>) -> Arc<Self> {
        let log = Log {
            batch_take,
            ..Log::default()
        };
        log.completions.lock().unwrap().reserve(4096);
        Arc::new(log)
    }

    fn tick(&self) -> u64 {
        if self.destroyed.load(Ordering::Acquire) {
            self.after_destroy.fetch_add(1, Ordering::Relaxed);
        }
        self.seq.fetch_add(1, Ordering::AcqRel)
    }
}

impl CqHandler<u64> for Log {
    fn on_completion(&self, c: Completion<u64>, _irql: &Dispatch<'_>) {
        let at = self.tick();
        let mut v = self.completions.lock().unwrap();
        assert!(v.len() < v.capacity());
        v.push((at, c.context));
    }

    fn on_completions(&self, completions: &mut WorkCompletions<'_, u64>, irql: &Dispatch<'_>) {
        match self.batch_take {
            Some(take) => completions
                .take(take)
                .for_each(|c| self.on_completion(c, irql)),
            None => completions.for_each(|c| self.on_completion(c, irql)),
        }
    }
}

impl QpHandler for Log {
    fn on_async_event(&self, _e: AsyncEvent, _irql: &Dispatch<'_>) {
        self.tick();
    }

    fn on_flushed(&self, result: Result<(), VerbsError>, _irql: &Dispatch<'_>) {
        let at = self.tick();
        if result.is_err() {
            self.flush_errors.fetch_add(1, Ordering::Relaxed);
        }
        let mut f = self.flushed_at.lock().unwrap();
        assert!(f.is_none(), "on_flushed twice");
        *f = Some(at);
    }

    fn on_destroyed(&self, _irql: &Dispatch<'_>) {
        self.tick();
        assert!(
            !self.destroyed.swap(true, Ordering::AcqRel),
            "on_destroyed twice"
        );
    }
}

fn one_schedule(seed: u64) -> (usize, usize) {
    let mut checked = (0usize, 0usize);
    let mut rng = fastrand::Rng::with_seed(seed);
    let w = World::with_seed(Mode::Stepped, seed);
    w.platform.run_passive(|p| {
        let a = w.node([10, 0, 0, 1], p);
        let b = w.node([10, 0, 0, 2], p);
        // A's handler takes whole batches; B's a seeded part of each.
        let la = Log::new(None);
        let lb = Log::new(Some(rng.usize(0..4)));
        let cq_a = a.cq(256, la.clone(), p);
        let cq_b = b.cq(256, lb.clone(), p);
        let qa = a.qp_with(QpType::Rc, &cq_a, 16, 16, la.clone(), p);
        let qb = b.qp_with(QpType::Rc, &cq_b, 16, 64, lb.clone(), p);
        bring_up(&qa, Some((b.gid(), qb.qpn())), p);
        bring_up(&qb, Some((a.gid(), qa.qpn())), p);
        // Every context handed to kverbs, per QP, with whether it must come
        // back (signalled sends and receives must; unsignalled sends have
        // no context).
        // Reserved: some pushes happen while a batch holds a queue lock.
        let mut expect_a: Vec<u64> = Vec::with_capacity(4096);
        let mut expect_b: Vec<u64> = Vec::with_capacity(4096);
        {
            let mut r = qb.begin_recv(p).unwrap();
            for i in 0..64 {
                r.recv(&[], 1_000_000 + i).unwrap();
                expect_b.push(1_000_000 + i);
            }
            r.commit();
            let mut r = qa.begin_recv(p).unwrap();
            for i in 0..16 {
                r.recv(&[], 2_000_000 + i).unwrap();
                expect_a.push(2_000_000 + i);
            }
            r.commit();
        }
        let mut next_id = 0u64;
        let steps = rng.usize(20..80);
        let error_at = rng.usize(0..steps * 2);
        let error_b = rng.bool();
        let disconnect_at = rng.usize(0..steps);
        let mut disconnected = false;
        for step in 0..steps {
            if step == error_at {
                let (hca, qpn) = if error_b {
                    (&b.hca, qb.qpn())
                } else {
                    (&a.hca, qa.qpn())
                };
                w.fabric.force_qp_error(hca, qpn);
            }
            if step == disconnect_at {
                w.platform
                    .run_at_dispatch(|d| qa.disconnect_and_flush(d))
                    .unwrap();
                disconnected = true;
            }
            match rng.u8(0..4) {
                0 => {
                    let ids: Vec<(u64, bool)> = (0..rng.u32(1..5))
                        .map(|_| {
                            next_id += 1;
                            (next_id, rng.u8(0..3) == 0)
                        })
                        .collect();
                    // Reserved here: nothing may allocate at DISPATCH_LEVEL.
                    let mut posted = Vec::with_capacity(ids.len());
                    w.platform.run_at_dispatch(|d| {
                        let Ok(mut s) = qa.begin_send(d) else {
                            return;
                        };
                        for &(id, unsignalled) in &ids {
                            let sig = if unsignalled {
                                Signal::Unsignalled
                            } else {
                                Signal::Signalled(id)
                            };
                            let bytes = id.to_le_bytes();
                            match s.send(&SendWr::new(Payload::Inline(&bytes)), sig) {
                                Ok(()) => posted.push((id, unsignalled)),
                                Err(e) => {
                                    // Refused: the context comes back now.
                                    assert_eq!(e.context, (!unsignalled).then_some(id));
                                }
                            }
                        }
                        s.commit();
                    });
                    for (id, unsignalled) in posted {
                        if !unsignalled {
                            expect_a.push(id);
                        }
                    }
                }
                1 => {
                    w.fabric.step();
                }
                _ => {
                    w.platform.run_one(&mut |n| rng.usize(..n));
                }
            }
        }
        if !disconnected {
            qa.disconnect_and_flush(p).unwrap();
        }
        qa.destroy(p).unwrap();
        qb.destroy(p).unwrap();
        let mut guard = 0;
        while !(la.destroyed.load(Ordering::Acquire) && lb.destroyed.load(Ordering::Acquire)) {
            guard += 1;
            assert!(guard < 100_000, "seed {seed}: teardown stalled");
            if rng.bool() {
                w.fabric.step();
            } else if !w.platform.run_one(&mut |n| rng.usize(..n)) {
                w.fabric.run_until_idle();
            }
        }
        for (name, log, expect, qp) in [("A", &la, &expect_a, &qa), ("B", &lb, &expect_b, &qb)] {
            let got = log.completions.lock().unwrap();
            let mut seen: HashMap<u64, usize> = HashMap::new();
            for (_, ctx) in got.iter() {
                if let Some(id) = ctx {
                    *seen.entry(*id).or_default() += 1;
                }
            }
            for id in expect.iter() {
                assert_eq!(
                    seen.get(id).copied().unwrap_or(0),
                    1,
                    "seed {seed}: {name} context {id} not delivered exactly once"
                );
            }
            assert_eq!(
                seen.len(),
                expect.len(),
                "seed {seed}: {name} unknown contexts"
            );
            checked.0 += expect.len();
            checked.1 += got.iter().filter(|(_, c)| c.is_some()).count();
            let flushed = log.flushed_at.lock().unwrap().expect("on_flushed ran");
            assert_eq!(log.flush_errors.load(Ordering::Relaxed), 0, "seed {seed}");
            assert!(
                got.iter().all(|(at, _)| *at < flushed),
                "seed {seed}: {name} completion after the drain marker"
            );
            assert_eq!(log.after_destroy.load(Ordering::Relaxed), 0, "seed {seed}");
            assert_eq!(qp.stats().bogus_completions, 0, "seed {seed}");
            assert_eq!(qp.stats().lost_contexts, 0, "seed {seed}");
        }
        cq_a.destroy(p).unwrap();
        cq_b.destroy(p).unwrap();
    });
    w.finish();
    checked
}

#[test]
fn every_work_request_completes_exactly_once_under_seeded_schedules() {
    let seeds = env_count("KVERBS_FLUSH_SEEDS", 3000) as u64;
    let (mut contexts, mut delivered) = (0, 0);
    for seed in 0..seeds {
        let (c, d) = one_schedule(seed);
        contexts += c;
        delivered += d;
    }
    println!("{seeds} schedules: {contexts} contexts, {delivered} delivered exactly once");
    assert!(contexts >= seeds as usize * 80, "every schedule posts work");
}
