//! `loom` models of the lock-free and lock-based state machines: the drain
//! loop and its arm/poll race, the passive worker's queue, and run-down.
//!
//! Run with `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test -p
//! kverbs --lib --release loom` (see `.ci/steps/51-loom-kverbs.sh`).

// UNSAFETY: mints passive tokens for model threads, which stand for
// passive-level system threads.
#![expect(unsafe_code, reason = "token minting for model threads")]

use std::sync::Arc;

use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use loom::thread;

use crate::drain::{
    ArmOutcome, Budget, CompletionHandler, CompletionSource, DpcDrainer, PollBatch,
};
use crate::irql::{AnyIrql, Dispatch, Passive};
use crate::platform::DpcTarget;
use crate::platform::loom::LoomPlatform;
use crate::rundown::Rundown;
use crate::worker::{CompleteAt, Outcome, RequestQueue, WorkHandler, Worker};

fn passive() -> Passive<'static> {
    // SAFETY: model threads stand for passive-level threads.
    unsafe { Passive::assume_unchecked() }
}

/// A CQ whose "hardware" side is a model thread. The arm and the event check
/// are read-modify-writes of `armed`, so exactly one side sees the other
/// (what the real CQ's doorbell barrier provides).
struct ModelCq {
    produced: AtomicUsize,
    consumed: AtomicUsize,
    armed: AtomicBool,
    in_poll: AtomicBool,
    report_missed: bool,
}

impl ModelCq {
    fn new(report_missed: bool) -> Self {
        ModelCq {
            produced: AtomicUsize::new(0),
            consumed: AtomicUsize::new(0),
            armed: AtomicBool::new(true),
            in_poll: AtomicBool::new(false),
            report_missed,
        }
    }
}

impl CompletionSource for ModelCq {
    type Completion = usize;

    fn poll(&self, out: &mut PollBatch<usize>, _irql: &Dispatch<'_>) {
        assert!(
            !self.in_poll.swap(true, Ordering::AcqRel),
            "poll and arm must be serialised per CQ"
        );
        let produced = self.produced.load(Ordering::Acquire);
        let mut consumed = self.consumed.load(Ordering::Relaxed);
        while consumed < produced && out.push(consumed).is_ok() {
            consumed += 1;
        }
        self.consumed.store(consumed, Ordering::Relaxed);
        self.in_poll.store(false, Ordering::Release);
    }

    fn arm(&self, _irql: &Dispatch<'_>) -> ArmOutcome {
        assert!(
            !self.in_poll.swap(true, Ordering::AcqRel),
            "poll and arm must be serialised per CQ"
        );
        self.armed.swap(true, Ordering::AcqRel);
        let pending = self.produced.load(Ordering::Acquire) > self.consumed.load(Ordering::Relaxed);
        self.in_poll.store(false, Ordering::Release);
        if self.report_missed && pending {
            ArmOutcome::MissedEvents
        } else {
            ArmOutcome::Armed
        }
    }

    fn arm_reports_missed_events(&self) -> bool {
        self.report_missed
    }
}

#[derive(Default)]
struct Counter {
    delivered: AtomicUsize,
    next: AtomicUsize,
}

impl CompletionHandler<usize> for Counter {
    fn on_completion(&self, n: usize, _irql: &Dispatch<'_>) {
        assert_eq!(self.next.swap(n + 1, Ordering::Relaxed), n, "order");
        self.delivered.fetch_add(1, Ordering::Relaxed);
    }
}

type ModelDrainer = DpcDrainer<LoomPlatform, ModelCq, Counter>;

/// The "hardware" writes a completion and raises the event if armed.
fn hardware_completes(d: &ModelDrainer) {
    d.source().produced.fetch_add(1, Ordering::AcqRel);
    if d.source().armed.swap(false, Ordering::AcqRel) {
        d.notify();
    }
}

fn arm_poll_race(report_missed: bool) {
    loom::model(move || {
        let platform = LoomPlatform::new();
        let d: Arc<ModelDrainer> = DpcDrainer::new(
            &platform,
            ModelCq::new(report_missed),
            Counter::default(),
            Budget::UNLIMITED,
            DpcTarget::Current,
            &passive(),
        )
        .unwrap_or_else(|_| unreachable!());
        let hw = {
            let d = Arc::clone(&d);
            thread::spawn(move || {
                hardware_completes(&d);
                hardware_completes(&d);
            })
        };
        let inline = {
            let d = Arc::clone(&d);
            thread::spawn(move || {
                d.drain_inline(Budget::UNLIMITED, &passive());
            })
        };
        // This thread is the DPC processor.
        platform.run_dpcs();
        hw.join().unwrap();
        inline.join().unwrap();
        platform.run_dpcs();
        // Nothing stranded: every completion the hardware wrote was
        // delivered, by the DPC or the inline drainer.
        assert_eq!(d.handler().delivered.load(Ordering::Relaxed), 2);
        assert!(!d.drain_loop().is_running());
    });
}

#[test]
fn loom_drain_arm_poll_race_with_rearm_repoll() {
    arm_poll_race(false);
}

#[test]
fn loom_drain_arm_poll_race_with_missed_event_reports() {
    arm_poll_race(true);
}

#[test]
fn loom_drain_budget_requeue_races_a_notification() {
    loom::model(|| {
        let platform = LoomPlatform::new();
        let budget = Budget {
            completions: 1,
            ticks: u64::MAX,
        };
        let d: Arc<ModelDrainer> = DpcDrainer::new(
            &platform,
            ModelCq::new(false),
            Counter::default(),
            budget,
            DpcTarget::Current,
            &passive(),
        )
        .unwrap_or_else(|_| unreachable!());
        hardware_completes(&d);
        let hw = {
            let d = Arc::clone(&d);
            thread::spawn(move || hardware_completes(&d))
        };
        platform.run_dpcs();
        hw.join().unwrap();
        platform.run_dpcs();
        assert_eq!(d.handler().delivered.load(Ordering::Relaxed), 2);
    });
}

/// Records what the worker did with each of two requests.
struct Recorder {
    executed: [AtomicUsize; 2],
    completions: [AtomicUsize; 2],
    last_executed: AtomicUsize,
}

impl WorkHandler for Arc<Recorder> {
    type Request = usize;
    type Output = usize;

    fn execute(&self, id: usize, _irql: &Passive<'_>) -> usize {
        // Request ids are submitted in order: 1, then 2.
        let previous = self.last_executed.swap(id + 1, Ordering::Relaxed);
        assert!(previous < id + 1, "requests on one object ran out of order");
        self.executed[id].fetch_add(1, Ordering::Relaxed);
        id
    }

    fn complete(&self, outcome: Outcome<usize, usize>, _irql: AnyIrql<'_, '_>) {
        let id = match outcome {
            Outcome::Done(id) | Outcome::Cancelled(id) => id,
        };
        self.completions[id].fetch_add(1, Ordering::Relaxed);
    }
}

#[test]
fn loom_worker_queue_exactly_once_with_shutdown_race() {
    loom::model(|| {
        let platform = LoomPlatform::new();
        let p = passive();
        let worker = Worker::new(&platform, 1, &p).unwrap_or_else(|_| unreachable!());
        let rundown = Rundown::new(&platform, |_d| {}, &p).unwrap_or_else(|_| unreachable!());
        let recorder = Arc::new(Recorder {
            executed: [AtomicUsize::new(0), AtomicUsize::new(0)],
            completions: [AtomicUsize::new(0), AtomicUsize::new(0)],
            last_executed: AtomicUsize::new(0),
        });
        let queue = Arc::new(
            RequestQueue::new(&worker, Arc::clone(&recorder), 2, rundown, &p)
                .unwrap_or_else(|_| unreachable!()),
        );
        // Request 0 is queued before the race (so the worker has something
        // to run from the start); request 1 and the shutdown race the worker.
        let first = queue.submit(0, CompleteAt::Passive, &p).is_ok();
        let submitter = {
            let queue = Arc::clone(&queue);
            thread::spawn(move || queue.submit(1, CompleteAt::Dispatch, &passive()).is_ok())
        };
        let closer = {
            let queue = Arc::clone(&queue);
            thread::spawn(move || queue.shutdown(&passive()))
        };
        // This thread is the system worker (and the DPC processor).
        platform.run_work_items();
        let second = submitter.join().unwrap();
        closer.join().unwrap();
        platform.run_until_idle();
        for (id, accepted) in [first, second].into_iter().enumerate() {
            let completions = recorder.completions[id].load(Ordering::Relaxed);
            assert_eq!(completions, usize::from(accepted), "request {id}");
            assert!(recorder.executed[id].load(Ordering::Relaxed) <= completions);
        }
        assert_eq!(queue.in_use(&p), 0);
        assert!(worker.is_idle(&p));
    });
}

#[test]
fn loom_rundown_destroy_after_last_reference_exactly_once() {
    loom::model(|| {
        let platform = LoomPlatform::new();
        let destroyed = Arc::new(AtomicUsize::new(0));
        let inside = Arc::new(AtomicBool::new(false));
        let (d2, i2) = (Arc::clone(&destroyed), Arc::clone(&inside));
        let rundown = Rundown::new(
            &platform,
            move |_d| {
                assert!(
                    !i2.load(Ordering::Acquire),
                    "destroy ran while a callback was inside"
                );
                d2.fetch_add(1, Ordering::AcqRel);
            },
            &passive(),
        )
        .unwrap_or_else(|_| unreachable!());
        let caller = {
            let (rundown, inside, destroyed) = (
                Arc::clone(&rundown),
                Arc::clone(&inside),
                Arc::clone(&destroyed),
            );
            thread::spawn(move || {
                if let Some(entry) = rundown.acquire_owned() {
                    inside.store(true, Ordering::Release);
                    assert_eq!(
                        destroyed.load(Ordering::Acquire),
                        0,
                        "callback after destroy"
                    );
                    inside.store(false, Ordering::Release);
                    drop(entry);
                }
            })
        };
        rundown.destroy().unwrap_or_else(|_| unreachable!());
        platform.run_dpcs();
        caller.join().unwrap();
        platform.run_dpcs();
        assert_eq!(destroyed.load(Ordering::Acquire), 1);
    });
}

/// The send queue's work-request table and accounting
/// ([`crate::slots::SlotRing`]): a poster and the completion side race on
/// a ring of 2 slots across wrap-around; every value arrives exactly once,
/// in order, and the producer never writes a slot the consumer owns (loom
/// checks the `UnsafeCell` accesses).
#[test]
fn loom_slot_ring_handoff_and_accounting() {
    use crate::slots::SlotRing;
    loom::model(|| {
        let ring: Arc<SlotRing<u32>> = Arc::new(SlotRing::new(2));
        let producer = {
            let ring = Arc::clone(&ring);
            thread::spawn(move || {
                let mut next = 0u32;
                while next < 3 {
                    let mut p = ring.producer().unwrap_or_else(|| unreachable!());
                    if p.free() == 0 {
                        drop(p);
                        thread::yield_now();
                        continue;
                    }
                    let at = p.published();
                    assert!(p.put(at, next).is_ok(), "producer owns free slots");
                    assert!(p.publish(at + 1).is_ok());
                    next += 1;
                }
            })
        };
        let mut got = 0u32;
        while got < 3 {
            let mut c = ring.consumer().unwrap_or_else(|| unreachable!());
            let at = c.reclaimed();
            if c.published() == at {
                drop(c);
                thread::yield_now();
                continue;
            }
            assert_eq!(c.take(at), Ok(Some(got)), "in order, exactly once");
            assert!(c.reclaim(at + 1).is_ok());
            got += 1;
        }
        producer.join().unwrap();
        assert_eq!(ring.outstanding(), 0);
    });
}
