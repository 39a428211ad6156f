//! Completion delivery without recursion: chained inline completions with a
//! measured, bounded stack depth; budgeted DPCs that requeue; the arm/poll
//! race.

// The host backend does not exist under `--cfg loom`; the loom models live
// in the library (`src/loom_tests.rs`).
#![cfg(not(loom))]

mod support;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use kverbs::drain::{
    ArmOutcome, Budget, CompletionHandler, CompletionSource, DpcDrainer, DrainLoop, DrainOutcome,
    POLL_BATCH, PollBatch, Polled,
};
use kverbs::irql::Dispatch;
use kverbs::platform::host::{HostEvent, HostPlatform, ViolationKind};
use kverbs::platform::{DpcTarget, EventKind, Platform, RawEvent, Ticks};

type Drainer = DpcDrainer<HostPlatform, FakeCq, Chain>;

/// A completion queue in software. `push` is the "hardware" writing a CQE:
/// if the CQ is armed it disarms and raises the event (calls `notify`).
struct FakeCq {
    entries: Mutex<VecDeque<u64>>,
    armed: AtomicBool,
    /// Report `MissedEvents` from `arm` when entries are present.
    report_missed: bool,
    /// Completions to "land" inside the next `arm`, before it takes effect
    /// (the window between the last empty poll and the arm).
    land_during_arm: AtomicU64,
    /// Time each poll takes, to exercise the time budget.
    poll_stall: Duration,
    event: OnceLock<Weak<Drainer>>,
    polls: AtomicUsize,
}

impl FakeCq {
    fn new(report_missed: bool) -> Self {
        FakeCq {
            entries: Mutex::new(VecDeque::with_capacity(4096)),
            armed: AtomicBool::new(false),
            report_missed,
            land_during_arm: AtomicU64::new(0),
            poll_stall: Duration::ZERO,
            event: OnceLock::new(),
            polls: AtomicUsize::new(0),
        }
    }

    /// The HCA writes a completion (no allocation: capacity is reserved).
    fn push(&self, value: u64) {
        let mut entries = self.entries.lock().unwrap();
        assert!(entries.len() < entries.capacity(), "fake CQ overrun");
        entries.push_back(value);
        drop(entries);
        if self.armed.swap(false, Ordering::AcqRel) {
            self.raise_event();
        }
    }

    fn raise_event(&self) {
        if let Some(drainer) = self.event.get().and_then(Weak::upgrade) {
            drainer.notify();
        }
    }

    fn len(&self) -> usize {
        self.entries.lock().unwrap().len()
    }
}

impl CompletionSource for FakeCq {
    type Completion = u64;

    fn poll(&self, out: &mut PollBatch<u64>, _irql: &Dispatch<'_>) {
        self.polls.fetch_add(1, Ordering::Relaxed);
        if !self.poll_stall.is_zero() {
            let start = std::time::Instant::now();
            while start.elapsed() < self.poll_stall {
                std::hint::spin_loop();
            }
        }
        let mut entries = self.entries.lock().unwrap();
        while !out.is_full() {
            match entries.pop_front() {
                Some(v) => out.push(v).unwrap(),
                None => break,
            }
        }
    }

    fn arm(&self, _irql: &Dispatch<'_>) -> ArmOutcome {
        // A completion landing here is written while the CQ is not armed:
        // it raises no event.
        let landing = self.land_during_arm.swap(0, Ordering::AcqRel);
        for i in 0..landing {
            self.entries.lock().unwrap().push_back(1_000_000 + i);
        }
        self.armed.store(true, Ordering::Release);
        if self.report_missed && self.len() > 0 {
            ArmOutcome::MissedEvents
        } else {
            ArmOutcome::Armed
        }
    }

    fn arm_reports_missed_events(&self) -> bool {
        self.report_missed
    }
}

/// A handler that, for each completion below `limit`, "posts" the next
/// request, which completes inline: the CQE is written at once and the
/// provider even tries to deliver it on the spot (`drain_inline`), as a
/// careless provider would. Records the stack address of every call.
struct Chain {
    limit: u64,
    drainer: OnceLock<Weak<Drainer>>,
    delivered: AtomicU64,
    next_expected: AtomicU64,
    out_of_order: AtomicBool,
    lowest_sp: AtomicUsize,
    highest_sp: AtomicUsize,
    nested_busy: AtomicU64,
    done: HostEvent,
}

impl Chain {
    fn new(limit: u64) -> Self {
        Chain {
            limit,
            drainer: OnceLock::new(),
            delivered: AtomicU64::new(0),
            next_expected: AtomicU64::new(0),
            out_of_order: AtomicBool::new(false),
            lowest_sp: AtomicUsize::new(usize::MAX),
            highest_sp: AtomicUsize::new(0),
            nested_busy: AtomicU64::new(0),
            done: HostEvent::new(EventKind::Notification, false),
        }
    }

    fn depth_spread(&self) -> usize {
        self.highest_sp.load(Ordering::Relaxed) - self.lowest_sp.load(Ordering::Relaxed)
    }
}

impl CompletionHandler<u64> for Chain {
    fn on_completion(&self, n: u64, irql: &Dispatch<'_>) {
        let marker = 0u8;
        let sp = std::ptr::addr_of!(marker).addr();
        self.lowest_sp.fetch_min(sp, Ordering::Relaxed);
        self.highest_sp.fetch_max(sp, Ordering::Relaxed);
        if self.next_expected.swap(n + 1, Ordering::Relaxed) != n {
            self.out_of_order.store(true, Ordering::Relaxed);
        }
        let delivered = self.delivered.fetch_add(1, Ordering::Relaxed) + 1;
        let drainer = self.drainer.get().and_then(Weak::upgrade).unwrap();
        if n + 1 < self.limit {
            // Post the next request; it completes inline.
            drainer.source().push(n + 1);
            if drainer.drain_inline(Budget::UNLIMITED, irql) == DrainOutcome::Busy {
                self.nested_busy.fetch_add(1, Ordering::Relaxed);
            }
        }
        if delivered == self.limit {
            self.done.set(irql);
        }
    }
}

fn drainer(
    platform: &HostPlatform,
    cq: FakeCq,
    chain: Chain,
    budget: Budget,
    p: &kverbs::irql::Passive<'_>,
) -> Arc<Drainer> {
    let d = DpcDrainer::new(platform, cq, chain, budget, DpcTarget::Processor(0), p).unwrap();
    d.source().event.set(Arc::downgrade(&d)).ok().unwrap();
    d.handler().drainer.set(Arc::downgrade(&d)).ok().unwrap();
    d
}

fn chain_length() -> u64 {
    support::env_count("KVERBS_CHAIN", 100_000) as u64
}

#[test]
fn chained_inline_completions_in_a_budgeted_dpc_keep_the_stack_flat() {
    let platform = support::threaded();
    let limit = chain_length();
    let budget = Budget {
        completions: 4096,
        ticks: 20_000_000, // 20 ms: well inside the verifier's DPC budget
    };
    platform.run_passive(|p| {
        let d = drainer(&platform, FakeCq::new(true), Chain::new(limit), budget, p);
        d.source().push(0);
        d.notify();
        assert!(
            d.handler().done.wait_timeout(Duration::from_secs(120), p),
            "chain stalled after {} completions",
            d.handler().delivered.load(Ordering::Relaxed)
        );
        let chain = d.handler();
        assert_eq!(chain.delivered.load(Ordering::Relaxed), limit);
        assert!(!chain.out_of_order.load(Ordering::Relaxed));
        // Every inline delivery attempt found the loop running.
        assert_eq!(chain.nested_busy.load(Ordering::Relaxed), limit - 1);
        // Every handler call ran at the same stack depth: the spread of the
        // handler's frame address over the whole chain (across DPC passes
        // that started on the same thread) is zero. Allow a little for a
        // compiler that varies frame layout, nowhere near one frame per link.
        let spread = chain.depth_spread();
        println!("stack spread over {limit} chained completions: {spread} bytes");
        assert!(spread <= 256, "stack grew by {spread} bytes");
    });
    platform.finish();
}

#[test]
fn chained_inline_completions_drained_inline_keep_the_stack_flat() {
    let platform = support::threaded();
    let limit = chain_length();
    platform.run_passive(|p| {
        let d = drainer(
            &platform,
            FakeCq::new(true),
            Chain::new(limit),
            Budget::UNLIMITED,
            p,
        );
        d.source().push(0);
        let outcome = d.drain_inline(Budget::UNLIMITED, p);
        assert_eq!(
            outcome,
            DrainOutcome::Idle {
                delivered: usize::try_from(limit).unwrap()
            }
        );
        let chain = d.handler();
        assert_eq!(chain.delivered.load(Ordering::Relaxed), limit);
        let spread = chain.depth_spread();
        println!("stack spread over {limit} inline completions: {spread} bytes");
        assert_eq!(spread, 0, "stack grew by {spread} bytes");
        assert!(d.source().armed.load(Ordering::Acquire), "left unarmed");
    });
    platform.finish();
}

/// A handler that only counts (and remembers the pass it ran in).
#[derive(Default)]
struct Count {
    delivered: AtomicUsize,
}

impl CompletionHandler<u64> for Count {
    fn on_completion(&self, _n: u64, _irql: &Dispatch<'_>) {
        self.delivered.fetch_add(1, Ordering::Relaxed);
    }
}

#[test]
fn the_count_budget_requeues_the_dpc_instead_of_looping() {
    let platform = support::manual();
    platform.run_passive(|p| {
        let budget = Budget {
            completions: 100,
            ticks: u64::MAX,
        };
        let d = DpcDrainer::new(
            &platform,
            FakeCq::new(false),
            Count::default(),
            budget,
            DpcTarget::Processor(1),
            p,
        )
        .unwrap();
        for i in 0..1000 {
            d.source().push(i);
        }
        d.notify();
        d.notify(); // A second event while one is owed schedules nothing.
        assert_eq!(platform.pending(), 1);
        let mut passes = 0;
        let mut last = 0;
        while platform.run_one(&mut |_| 0) {
            passes += 1;
            let now = d.handler().delivered.load(Ordering::Relaxed);
            assert!(
                now - last <= 100 + POLL_BATCH,
                "a pass delivered {} (budget 100)",
                now - last
            );
            last = now;
        }
        assert_eq!(d.handler().delivered.load(Ordering::Relaxed), 1000);
        assert!(
            passes >= 9,
            "only {passes} DPC passes for 1000 with budget 100"
        );
        assert!(!d.drain_loop().is_running());
        assert!(d.source().armed.load(Ordering::Acquire));
    });
    platform.finish();
}

/// A handler with per-batch work: it takes the first `take` completions of
/// each polled batch itself and leaves the rest, which the drain loop must
/// then hand to `on_completion`.
struct Batched {
    take: usize,
    batches: Mutex<Vec<usize>>,
    by_batch: Mutex<Vec<u64>>,
    by_one: Mutex<Vec<u64>>,
    order: Mutex<Vec<u64>>,
}

impl CompletionHandler<u64> for Batched {
    fn on_completion(&self, n: u64, _irql: &Dispatch<'_>) {
        self.by_one.lock().unwrap().push(n);
        self.order.lock().unwrap().push(n);
    }

    fn on_batch(&self, batch: &mut Polled<'_, u64>, _irql: &Dispatch<'_>) {
        self.batches.lock().unwrap().push(batch.remaining());
        for n in batch.by_ref().take(self.take) {
            self.by_batch.lock().unwrap().push(n);
            self.order.lock().unwrap().push(n);
        }
    }
}

#[test]
fn a_batch_handler_sees_each_poll_once_and_what_it_leaves_is_still_delivered() {
    let platform = support::manual();
    platform.run_passive(|p| {
        let handler = Batched {
            take: 3,
            // Capacity reserved: no allocation at DISPATCH_LEVEL.
            batches: Mutex::new(Vec::with_capacity(64)),
            by_batch: Mutex::new(Vec::with_capacity(64)),
            by_one: Mutex::new(Vec::with_capacity(64)),
            order: Mutex::new(Vec::with_capacity(64)),
        };
        let d = DpcDrainer::new(
            &platform,
            FakeCq::new(false),
            handler,
            Budget::UNLIMITED,
            DpcTarget::Processor(0),
            p,
        )
        .unwrap();
        let total = 2 * POLL_BATCH as u64 + 5;
        for i in 0..total {
            d.source().push(i);
        }
        d.notify();
        while platform.run_one(&mut |_| 0) {}
        let h = d.handler();
        // One call per delivering poll, none for the empty ones.
        assert_eq!(*h.batches.lock().unwrap(), [POLL_BATCH, POLL_BATCH, 5]);
        assert_eq!(h.by_batch.lock().unwrap().len(), 9);
        assert_eq!(h.by_one.lock().unwrap().len(), total as usize - 9);
        // Exactly once each, in poll order across both paths.
        assert_eq!(*h.order.lock().unwrap(), (0..total).collect::<Vec<_>>());
        assert!(!d.drain_loop().is_running());
    });
    platform.finish();
}

#[test]
fn the_time_budget_requeues_the_dpc() {
    let platform = support::manual();
    platform.run_passive(|p| {
        let mut cq = FakeCq::new(false);
        cq.poll_stall = Duration::from_millis(2);
        let budget = Budget {
            completions: usize::MAX,
            ticks: 5_000_000, // 5 ms
        };
        let d = DpcDrainer::new(
            &platform,
            cq,
            Count::default(),
            budget,
            DpcTarget::Processor(0),
            p,
        )
        .unwrap();
        for i in 0..(POLL_BATCH as u64 * 20) {
            d.source().push(i);
        }
        d.notify();
        let passes = platform.run_until_idle(&mut |_| 0, 1000);
        assert_eq!(
            d.handler().delivered.load(Ordering::Relaxed),
            POLL_BATCH * 20
        );
        assert!(
            passes >= 4,
            "time budget never cut a pass ({passes} passes)"
        );
    });
    platform.finish();
}

#[test]
fn a_completion_landing_between_the_last_poll_and_the_arm_is_not_stranded() {
    // The CQ does not report missed events: only the re-poll after arming
    // can find the completion that landed while the CQ was unarmed.
    let platform = support::manual();
    platform.run_passive(|p| {
        let d = DpcDrainer::new(
            &platform,
            FakeCq::new(false),
            Count::default(),
            Budget::UNLIMITED,
            DpcTarget::Processor(0),
            p,
        )
        .unwrap();
        d.source().push(1);
        d.source().land_during_arm.store(1, Ordering::Release);
        d.notify();
        platform.run_until_idle(&mut |_| 0, 10);
        assert_eq!(d.handler().delivered.load(Ordering::Relaxed), 2);
        assert_eq!(d.source().len(), 0);
    });
    platform.finish();
}

/// What the old Windows SRP initiator did: poll until empty, then arm, no
/// re-poll. Kept here to show the test above can fail.
fn naive_drain(cq: &FakeCq, handler: &Count, d: &Dispatch<'_>) {
    loop {
        let mut batch = PollBatch::new();
        cq.poll(&mut batch, d);
        if batch.is_empty() {
            break;
        }
        while let Some(c) = batch.take() {
            handler.on_completion(c, d);
        }
    }
    cq.arm(d);
}

#[test]
fn the_naive_poll_then_arm_strands_that_completion() {
    let platform = support::threaded();
    let cq = FakeCq::new(false);
    let handler = Count::default();
    cq.push(1);
    cq.land_during_arm.store(1, Ordering::Release);
    platform.run_at_dispatch(|d| naive_drain(&cq, &handler, d));
    assert_eq!(handler.delivered.load(Ordering::Relaxed), 1);
    assert_eq!(
        cq.len(),
        1,
        "the landed completion is stranded: armed, no event"
    );
    assert!(cq.armed.load(Ordering::Acquire));
    platform.finish();
}

#[test]
fn drain_loop_reports_busy_to_a_second_drainer_and_repolls() {
    let platform = support::threaded();
    let cq = FakeCq::new(false);
    let counter = Count::default();
    let drain = DrainLoop::new();
    cq.push(1);
    platform.run_at_dispatch(|d| {
        struct Reenter<'a> {
            drain: &'a DrainLoop,
            cq: &'a FakeCq,
            inner: &'a Count,
            reentered: AtomicBool,
        }
        impl CompletionHandler<u64> for Reenter<'_> {
            fn on_completion(&self, n: u64, irql: &Dispatch<'_>) {
                self.inner.on_completion(n, irql);
                if !self.reentered.swap(true, Ordering::Relaxed) {
                    self.cq.push(2);
                    let nested = self.drain.run(self.cq, self, Budget::UNLIMITED, now, irql);
                    assert_eq!(nested, DrainOutcome::Busy);
                }
            }
        }
        let handler = Reenter {
            drain: &drain,
            cq: &cq,
            inner: &counter,
            reentered: AtomicBool::new(false),
        };
        let outcome = drain.run(&cq, &handler, Budget::UNLIMITED, now, d);
        assert_eq!(outcome, DrainOutcome::Idle { delivered: 2 });
    });
    assert_eq!(counter.delivered.load(Ordering::Relaxed), 2);
    platform.finish();
}

fn now() -> Ticks {
    HostPlatform::now()
}

#[test]
fn completions_racing_the_arm_from_another_thread_are_all_delivered() {
    // A "hardware" thread writes completions with random gaps while the
    // drain DPC polls and arms on another thread: every completion must be
    // delivered; a stranded one shows as a timeout.
    let rounds = support::env_count("KVERBS_ARM_RACE_ROUNDS", 20);
    let per_round = 2_000u64;
    for seed in 0..rounds as u64 {
        let platform = support::threaded();
        let mut rng = fastrand::Rng::with_seed(seed);
        platform.run_passive(|p| {
            let total = Arc::new(AtomicUsize::new(0));
            let d: Arc<DpcDrainer<HostPlatform, FakeCq, Count>> = DpcDrainer::new(
                &platform,
                FakeCq::new(seed % 2 == 0),
                Count::default(),
                Budget {
                    completions: 64,
                    ticks: 1_000_000,
                },
                DpcTarget::Processor(0),
                p,
            )
            .unwrap();
            // Arm before the first completion, as a freshly created CQ is.
            platform.run_at_dispatch(|dl| d.source().arm(dl));
            let producer = {
                let d = Arc::clone(&d);
                let total = Arc::clone(&total);
                let gaps: Vec<u32> = (0..per_round).map(|_| rng.u32(0..200)).collect();
                std::thread::spawn(move || {
                    for (i, gap) in gaps.into_iter().enumerate() {
                        for _ in 0..gap {
                            std::hint::spin_loop();
                        }
                        // The event path: notify only if the CQ was armed.
                        let cq = d.source();
                        cq.entries.lock().unwrap().push_back(i as u64);
                        if cq.armed.swap(false, Ordering::AcqRel) {
                            d.notify();
                        }
                        total.fetch_add(1, Ordering::Relaxed);
                    }
                })
            };
            producer.join().unwrap();
            let deadline = std::time::Instant::now() + Duration::from_secs(20);
            while d.handler().delivered.load(Ordering::Relaxed) < per_round as usize {
                assert!(
                    std::time::Instant::now() < deadline,
                    "seed {seed}: {} of {per_round} delivered; {} stranded in the CQ",
                    d.handler().delivered.load(Ordering::Relaxed),
                    d.source().len()
                );
                platform.delay(Duration::from_micros(100), p);
            }
            assert_eq!(total.load(Ordering::Relaxed), per_round as usize);
        });
        platform.finish();
    }
}

#[test]
fn the_depth_measurement_sees_recursion() {
    // Control for the two tests above: a delivery that nests (handler ->
    // post -> handler) on one stack shows a spread proportional to the chain.
    fn nested(n: u32, lowest: &AtomicUsize, highest: &AtomicUsize) {
        let marker = 0u8;
        let sp = std::ptr::addr_of!(marker).addr();
        lowest.fetch_min(sp, Ordering::Relaxed);
        highest.fetch_max(sp, Ordering::Relaxed);
        if n > 0 {
            nested(std::hint::black_box(n - 1), lowest, highest);
        }
    }
    let (lowest, highest) = (AtomicUsize::new(usize::MAX), AtomicUsize::new(0));
    nested(200, &lowest, &highest);
    let spread = highest.load(Ordering::Relaxed) - lowest.load(Ordering::Relaxed);
    assert!(
        spread >= 200 * 16,
        "recursion of 200 measured as {spread} bytes"
    );
}

/// A source that hands out `n` clones of one `Arc` once: each completion's
/// life shows in the `Arc`'s count.
struct Tracked {
    item: Arc<()>,
    left: AtomicUsize,
}

impl CompletionSource for Tracked {
    type Completion = Arc<()>;

    fn poll(&self, out: &mut PollBatch<Arc<()>>, _irql: &Dispatch<'_>) {
        while !out.is_full() && self.left.load(Ordering::Relaxed) > 0 {
            self.left.fetch_sub(1, Ordering::Relaxed);
            assert!(out.push(Arc::clone(&self.item)).is_ok());
        }
    }

    fn arm(&self, _irql: &Dispatch<'_>) -> ArmOutcome {
        ArmOutcome::Armed
    }
}

/// Unwinds on its `at`-th completion (counting from 1).
struct UnwindAt {
    at: usize,
    seen: AtomicUsize,
}

impl CompletionHandler<Arc<()>> for UnwindAt {
    fn on_completion(&self, completion: Arc<()>, _irql: &Dispatch<'_>) {
        drop(completion);
        if self.seen.fetch_add(1, Ordering::Relaxed) + 1 == self.at {
            panic!("handler unwinds mid-batch");
        }
    }
}

/// The pass's batch is dropped, not forgotten: a handler that unwinds
/// mid-batch leaves completions in it, and they are released with it (the
/// empty fast path in `PollBatch`'s drop must not skip them).
#[test]
fn completions_left_in_the_batch_by_an_unwinding_handler_are_dropped() {
    let platform = support::threaded();
    let item = Arc::new(());
    let source = Tracked {
        item: Arc::clone(&item),
        left: AtomicUsize::new(5),
    };
    let handler = UnwindAt {
        at: 2,
        seen: AtomicUsize::new(0),
    };
    let drain = DrainLoop::new();
    let unwound = platform.run_at_dispatch(|d| {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            drain.run(&source, &handler, Budget::UNLIMITED, now, d)
        }))
        .is_err()
    });
    assert!(unwound);
    // The unwind itself allocates (its payload, the panic hook) at
    // DISPATCH_LEVEL; the verifier must have seen nothing else.
    let violations = platform.take_violations();
    assert!(
        violations
            .iter()
            .all(|v| matches!(v.kind, ViolationKind::AllocatedAtDispatch { .. })),
        "{violations:?}"
    );
    assert_eq!(handler.seen.load(Ordering::Relaxed), 2);
    assert_eq!(source.left.load(Ordering::Relaxed), 0);
    // Two delivered and dropped by the handler, three left in the batch:
    // none may outlive the pass.
    assert_eq!(Arc::strong_count(&item), 2, "the source's and this one");
    drop(source);
    assert_eq!(Arc::strong_count(&item), 1);
    platform.finish();
}
