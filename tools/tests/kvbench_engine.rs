//! The benchmark engine on the RAM backend: the I/O stream follows the
//! spec, results add up, verification catches corruption and lost writes,
//! Ctrl-C ends a run that still reports, bad configurations are refused,
//! and the CSV, JSON and SVG outputs have their documented shape.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kverbs_tools::bench::backend::{
    Backend, BackendError, Direction, IoCompletion, IoQueue, IoRequest, QueueConfig, TargetInfo,
};
use kverbs_tools::bench::engine::{
    BenchError, CancelToken, Observer, RunConfig, Silent, SuiteResult, run_suite,
};
use kverbs_tools::bench::ram::RamBackend;
use kverbs_tools::bench::report::{CSV_COLUMNS, table, write_csv, write_json};
use kverbs_tools::bench::spec::{AccessPart, AccessSpec, builtin_spec};
use kverbs_tools::bench::verify::Found;
use kverbs_tools::bench::{plot, stats::SpecResult};

/// One I/O as the backend saw it.
#[derive(Debug, Clone, Copy)]
struct Seen {
    queue: usize,
    target: usize,
    direction: Direction,
    offset: u64,
    len: u32,
}

/// Wraps a backend, recording every submitted I/O, checking that no queue
/// exceeds its depth or reuses a busy slot, and optionally turning every
/// `lose_every`th write into a read (a write the stack "lost").
struct Recording<B: Backend> {
    inner: B,
    seen: Arc<Mutex<Vec<Seen>>>,
    queues: AtomicUsize,
    lose_every: usize,
    problems: Arc<Mutex<Vec<String>>>,
}

impl<B: Backend> Recording<B> {
    fn new(inner: B) -> Self {
        Self {
            inner,
            seen: Arc::default(),
            queues: AtomicUsize::new(0),
            lose_every: 0,
            problems: Arc::default(),
        }
    }
}

struct RecordingQueue {
    inner: Box<dyn IoQueue>,
    id: usize,
    busy: Vec<bool>,
    writes: usize,
    lose_every: usize,
    seen: Arc<Mutex<Vec<Seen>>>,
    problems: Arc<Mutex<Vec<String>>>,
}

impl<B: Backend> Backend for Recording<B> {
    fn target_type(&self) -> &str {
        self.inner.target_type()
    }
    fn describe(&self) -> String {
        format!("recording {}", self.inner.describe())
    }
    fn targets(&self) -> &[TargetInfo] {
        self.inner.targets()
    }
    fn open_queue(&self, config: &QueueConfig) -> Result<Box<dyn IoQueue>, BackendError> {
        Ok(Box::new(RecordingQueue {
            inner: self.inner.open_queue(config)?,
            id: self.queues.fetch_add(1, Ordering::Relaxed),
            busy: vec![false; config.depth],
            writes: 0,
            lose_every: self.lose_every,
            seen: self.seen.clone(),
            problems: self.problems.clone(),
        }))
    }
}

impl IoQueue for RecordingQueue {
    fn submit(&mut self, io: &IoRequest<'_>) -> Result<(), BackendError> {
        let slot = io.slot as usize;
        if std::mem::replace(&mut self.busy[slot], true) {
            self.problems
                .lock()
                .unwrap()
                .push(format!("slot {slot} reused while busy"));
        }
        self.seen.lock().unwrap().push(Seen {
            queue: self.id,
            target: io.target,
            direction: io.direction,
            offset: io.offset,
            len: io.len,
        });
        let mut io = *io;
        if io.direction == Direction::Write {
            self.writes += 1;
            if self.lose_every != 0 && self.writes % self.lose_every == 0 {
                io.direction = Direction::Read;
                io.data = None;
            }
        }
        self.inner.submit(&io)
    }
    fn reap(&mut self, out: &mut Vec<IoCompletion>, wait: Duration) -> Result<(), BackendError> {
        let from = out.len();
        self.inner.reap(out, wait)?;
        for c in &out[from..] {
            if !std::mem::replace(&mut self.busy[c.slot as usize], false) {
                self.problems
                    .lock()
                    .unwrap()
                    .push(format!("completion for idle slot {}", c.slot));
            }
        }
        Ok(())
    }
    fn read_data(&mut self, slot: u32, out: &mut [u8]) -> Result<(), BackendError> {
        self.inner.read_data(slot, out)
    }
}

fn quick(run_ms: u64) -> RunConfig {
    RunConfig {
        ramp: Duration::from_millis(50),
        run: Duration::from_millis(run_ms),
        ..RunConfig::default()
    }
}

fn align_up(v: u64, a: u64) -> u64 {
    v.div_ceil(a) * a
}

#[test]
fn the_io_stream_follows_the_spec() {
    let backend = Recording::new(RamBackend::new(2, 16 << 20));
    let spec = AccessSpec {
        name: "mix".into(),
        parts: vec![
            AccessPart {
                alignment: 4096,
                ..AccessPart::new(4096, 50, 100)
            }
            .weighted(70),
            AccessPart::new(65536, 0, 0).weighted(30),
        ],
    };
    let max = 8u64 << 20;
    let config = RunConfig {
        workers: 2,
        outstanding: 3,
        targets: vec![0, 1],
        max_bytes: Some(max),
        ..quick(300)
    };
    let suite = run_suite(&backend, &[spec], &config, &CancelToken::new(), &Silent).unwrap();
    assert!(
        backend.problems.lock().unwrap().is_empty(),
        "{:?}",
        backend.problems.lock().unwrap()
    );
    let seen = backend.seen.lock().unwrap().clone();
    assert!(seen.len() > 2000, "enough I/O to judge: {}", seen.len());
    let small: Vec<&Seen> = seen.iter().filter(|s| s.len == 4096).collect();
    let big: Vec<&Seen> = seen.iter().filter(|s| s.len == 65536).collect();
    assert_eq!(small.len() + big.len(), seen.len(), "only the spec's sizes");
    let share = small.len() as f64 / seen.len() as f64;
    assert!((share - 0.70).abs() < 0.05, "4K share {share}");
    let reads = small
        .iter()
        .filter(|s| s.direction == Direction::Read)
        .count() as f64;
    assert!((reads / small.len() as f64 - 0.5).abs() < 0.05);
    assert!(
        big.iter().all(|s| s.direction == Direction::Write),
        "64K part writes only"
    );
    for s in &seen {
        assert!(
            s.offset + u64::from(s.len) <= max,
            "inside the working set: {s:?}"
        );
        assert_eq!(s.offset % u64::from(s.len), 0, "aligned: {s:?}");
    }
    // Sequential I/O continues where the previous I/O of that worker on
    // that disk ended (aligned up), wrapping at the end of the working set.
    let mut last_end: HashMap<(usize, usize), u64> = HashMap::new();
    let mut sequential_checked = 0;
    for s in &seen {
        let key = (s.queue, s.target);
        if s.len == 65536 {
            let expected = align_up(*last_end.get(&key).unwrap_or(&0), 65536);
            let expected = if expected + 65536 > max { 0 } else { expected };
            assert_eq!(s.offset, expected, "sequential continues: {s:?}");
            sequential_checked += 1;
        }
        last_end.insert(key, s.offset + u64::from(s.len));
    }
    assert!(sequential_checked > 100);
    // Both disks, both workers, round robin.
    for q in 0..2 {
        for t in 0..2 {
            assert!(
                seen.iter().any(|s| s.queue == q && s.target == t),
                "queue {q} disk {t}"
            );
        }
    }
    let r = &suite.results[0];
    assert_eq!(r.targets.len(), 2);
    assert_eq!(
        r.rates.ios,
        r.targets.iter().map(|t| t.rates.ios).sum::<u64>()
    );
    assert_eq!(r.rates.ios, r.rates.read_ios + r.rates.write_ios);
    assert!(
        r.rates.ios <= seen.len() as u64,
        "only completed I/O counts"
    );
}

#[test]
fn outstanding_ios_never_exceed_the_depth_per_disk() {
    /// Counts I/O in flight per (queue, disk) and remembers the peak.
    struct Depth {
        inner: RamBackend,
        peak: Arc<Mutex<HashMap<(usize, usize), usize>>>,
        queues: AtomicUsize,
    }
    struct DepthQueue {
        inner: Box<dyn IoQueue>,
        id: usize,
        target_of: HashMap<u32, usize>,
        now: HashMap<usize, usize>,
        peak: Arc<Mutex<HashMap<(usize, usize), usize>>>,
    }
    impl Backend for Depth {
        fn target_type(&self) -> &str {
            "RAM"
        }
        fn describe(&self) -> String {
            "depth".into()
        }
        fn targets(&self) -> &[TargetInfo] {
            self.inner.targets()
        }
        fn open_queue(&self, c: &QueueConfig) -> Result<Box<dyn IoQueue>, BackendError> {
            Ok(Box::new(DepthQueue {
                inner: self.inner.open_queue(c)?,
                id: self.queues.fetch_add(1, Ordering::Relaxed),
                target_of: HashMap::new(),
                now: HashMap::new(),
                peak: self.peak.clone(),
            }))
        }
    }
    impl IoQueue for DepthQueue {
        fn submit(&mut self, io: &IoRequest<'_>) -> Result<(), BackendError> {
            self.target_of.insert(io.slot, io.target);
            let n = self.now.entry(io.target).or_default();
            *n += 1;
            let mut peak = self.peak.lock().unwrap();
            let p = peak.entry((self.id, io.target)).or_default();
            *p = (*p).max(*n);
            drop(peak);
            self.inner.submit(io)
        }
        fn reap(&mut self, out: &mut Vec<IoCompletion>, w: Duration) -> Result<(), BackendError> {
            let from = out.len();
            self.inner.reap(out, w)?;
            for c in &out[from..] {
                *self.now.get_mut(&self.target_of[&c.slot]).unwrap() -= 1;
            }
            Ok(())
        }
        fn read_data(&mut self, s: u32, o: &mut [u8]) -> Result<(), BackendError> {
            self.inner.read_data(s, o)
        }
    }
    let backend = Depth {
        inner: RamBackend::new(3, 4 << 20).with_service_time(Duration::from_micros(300)),
        peak: Arc::default(),
        queues: AtomicUsize::new(0),
    };
    let config = RunConfig {
        workers: 2,
        outstanding: 5,
        targets: vec![0, 2],
        ..quick(200)
    };
    run_suite(
        &backend,
        &[builtin_spec("4k-random-read").unwrap()],
        &config,
        &CancelToken::new(),
        &Silent,
    )
    .unwrap();
    let peak = backend.peak.lock().unwrap();
    assert_eq!(peak.len(), 4, "two workers on disks 0 and 2 only: {peak:?}");
    for (&(_, disk), &p) in peak.iter() {
        assert_ne!(disk, 1);
        assert_eq!(p, 5, "the depth is reached and never exceeded");
    }
}

#[test]
fn results_add_up_and_latency_is_never_below_the_service_time() {
    let service = Duration::from_millis(2);
    let backend = RamBackend::new(1, 4 << 20).with_service_time(service);
    let config = RunConfig {
        outstanding: 4,
        ramp: Duration::from_millis(100),
        run: Duration::from_millis(600),
        ..RunConfig::default()
    };
    let spec = builtin_spec("4k-random-70-30").unwrap();
    let suite = run_suite(&backend, &[spec], &config, &CancelToken::new(), &Silent).unwrap();
    let r = &suite.results[0];
    let l = &r.rates.latency;
    assert!(r.rates.ios > 50, "{}", r.rates.ios);
    // No I/O completes before its service time: every figure is at least
    // 2 ms, and four slots can never do more than 4 per 2 ms.
    assert!(l.percentiles.p50 >= 2.0 && l.average_ms >= 2.0, "{l:?}");
    assert!(r.rates.iops <= 2000.0 * 1.01, "{}", r.rates.iops);
    // Percentiles are ordered and bounded by the maximum.
    let p = l.percentiles;
    assert!(p.p50 <= p.p90 && p.p90 <= p.p99 && p.p99 <= p.p99_9 && p.p99_9 <= p.p99_99);
    assert!(p.p99_99 <= l.max_ms);
    // Rates are counts over the window.
    let secs = r.run_seconds;
    assert!((secs - 0.6).abs() < 1e-6, "{secs}");
    assert!((r.rates.iops - r.rates.ios as f64 / secs).abs() < 1e-6);
    let bytes = (r.rates.bytes_read + r.rates.bytes_written) as f64;
    assert_eq!(bytes, r.rates.ios as f64 * 4096.0);
    assert!((r.rates.mbps - bytes / secs / 1e6).abs() < 1e-9);
    // The timeline holds the ramp-up too.
    let timeline: u64 = r.timeline.ios.iter().sum();
    assert!(timeline >= r.rates.ios);
    assert_eq!(r.timeline.bucket_ms, 100);
    assert_eq!(r.timeline.ramp_buckets, 1);
    assert!(r.cpu.seconds >= 0.0 && r.cpu.us_per_io >= 0.0);
    assert_eq!(r.lost_ios, 0);
    assert!(!suite.had_errors());
}

#[test]
fn failed_ios_are_counted_as_errors() {
    let backend = RamBackend::new(1, 4 << 20);
    backend.fail_every(10);
    let suite = run_suite(
        &backend,
        &[builtin_spec("4k-random-read").unwrap()],
        &quick(200),
        &CancelToken::new(),
        &Silent,
    )
    .unwrap();
    let r = &suite.results[0].rates;
    let share = r.errors as f64 / r.ios as f64;
    assert!((share - 0.1).abs() < 0.01, "{share}");
    assert_eq!(r.errors, r.read_errors);
    assert_eq!(r.bytes_read, (r.ios - r.errors) * 4096);
    assert!(suite.had_errors());
}

/// Corrupts a byte range of a RAM disk when the first spec starts (after
/// the verify prefill wrote the pattern).
struct CorruptAtStart<'a> {
    backend: &'a RamBackend,
    offset: u64,
}

impl Observer for CorruptAtStart<'_> {
    fn spec_started(&self, index: usize, _total: usize, _spec: &AccessSpec) {
        if index == 0 {
            self.backend.corrupt(0, self.offset, 1);
        }
    }
}

#[test]
fn verify_catches_a_corrupted_block() {
    let backend = RamBackend::new(1, 16 << 20);
    let config = RunConfig {
        verify: true,
        max_bytes: Some(256 << 10),
        outstanding: 4,
        ..quick(150)
    };
    let spec = AccessSpec::single("seq read", AccessPart::new(4096, 100, 0));
    let observer = CorruptAtStart {
        backend: &backend,
        offset: 8192 + 100,
    };
    let suite = run_suite(&backend, &[spec], &config, &CancelToken::new(), &observer).unwrap();
    assert!(suite.verify_failed());
    let v = suite.verify.as_ref().unwrap();
    assert!(v.mismatches >= 1);
    let m = v.first_mismatches[0];
    assert_eq!((m.target, m.sector), (0, 16));
    assert_eq!(m.found, Found::Corrupted { byte: 100 });
    assert!(table(&suite).contains("VERIFY FAILED"));
    assert!(table(&suite).contains("disk 0 sector 16"));
}

#[test]
fn verify_passes_an_intact_stack_and_checks_what_it_reads() {
    let backend = RamBackend::new(2, 16 << 20);
    let config = RunConfig {
        verify: true,
        workers: 2,
        outstanding: 8,
        targets: vec![0, 1],
        max_bytes: Some(1 << 20),
        ..quick(200)
    };
    let specs = [
        builtin_spec("4k-random-70-30").unwrap(),
        builtin_spec("file-server").unwrap(),
    ];
    let suite = run_suite(&backend, &specs, &config, &CancelToken::new(), &Silent).unwrap();
    let v = suite.verify.as_ref().unwrap();
    assert_eq!(v.mismatches, 0, "{:?}", v.first_mismatches);
    assert!(v.sectors_checked > 1000, "reads were checked: {v:?}");
    assert_eq!(v.sectors_skipped, 0, "the prefill made every sector known");
    assert!(table(&suite).contains("all intact"));
}

#[test]
fn verify_catches_a_lost_write() {
    let mut backend = Recording::new(RamBackend::new(1, 16 << 20));
    backend.lose_every = 7;
    let config = RunConfig {
        verify: true,
        max_bytes: Some(64 << 10),
        outstanding: 2,
        ..quick(200)
    };
    let spec = AccessSpec::single("rw", AccessPart::new(4096, 50, 100));
    let suite = run_suite(&backend, &[spec], &config, &CancelToken::new(), &Silent).unwrap();
    let v = suite.verify.as_ref().unwrap();
    assert!(v.mismatches > 0);
    assert!(
        v.first_mismatches
            .iter()
            .all(|m| matches!(m.found, Found::OtherPattern { sector, generation, .. } if sector == m.sector && generation < m.expected_generation)),
        "a lost write leaves the older generation: {:?}",
        v.first_mismatches
    );
}

#[test]
fn verify_mode_never_overlaps_ios_in_flight() {
    /// Fails the run if two I/Os in flight overlap.
    struct NoOverlap {
        inner: RamBackend,
        clash: Arc<Mutex<Vec<String>>>,
        inflight: Arc<Mutex<Vec<(usize, u64, u64)>>>,
    }
    struct Q {
        inner: Box<dyn IoQueue>,
        mine: HashMap<u32, (usize, u64, u64)>,
        clash: Arc<Mutex<Vec<String>>>,
        inflight: Arc<Mutex<Vec<(usize, u64, u64)>>>,
    }
    impl Backend for NoOverlap {
        fn target_type(&self) -> &str {
            "RAM"
        }
        fn describe(&self) -> String {
            "no-overlap".into()
        }
        fn targets(&self) -> &[TargetInfo] {
            self.inner.targets()
        }
        fn open_queue(&self, c: &QueueConfig) -> Result<Box<dyn IoQueue>, BackendError> {
            Ok(Box::new(Q {
                inner: self.inner.open_queue(c)?,
                mine: HashMap::new(),
                clash: self.clash.clone(),
                inflight: self.inflight.clone(),
            }))
        }
    }
    impl IoQueue for Q {
        fn submit(&mut self, io: &IoRequest<'_>) -> Result<(), BackendError> {
            let me = (io.target, io.offset, io.offset + u64::from(io.len));
            let mut all = self.inflight.lock().unwrap();
            if all
                .iter()
                .any(|&(t, a, b)| t == me.0 && a < me.2 && me.1 < b)
            {
                self.clash.lock().unwrap().push(format!("{me:?} overlaps"));
            }
            all.push(me);
            self.mine.insert(io.slot, me);
            drop(all);
            self.inner.submit(io)
        }
        fn reap(&mut self, out: &mut Vec<IoCompletion>, w: Duration) -> Result<(), BackendError> {
            let from = out.len();
            self.inner.reap(out, w)?;
            let mut all = self.inflight.lock().unwrap();
            for c in &out[from..] {
                let me = self.mine.remove(&c.slot).unwrap();
                let i = all.iter().position(|&x| x == me).unwrap();
                all.swap_remove(i);
            }
            Ok(())
        }
        fn read_data(&mut self, s: u32, o: &mut [u8]) -> Result<(), BackendError> {
            self.inner.read_data(s, o)
        }
    }
    let backend = NoOverlap {
        inner: RamBackend::new(1, 4 << 20).with_service_time(Duration::from_micros(200)),
        clash: Arc::default(),
        inflight: Arc::default(),
    };
    // A tiny working set and many outstanding I/Os: collisions would be
    // certain without the check.
    let config = RunConfig {
        verify: true,
        workers: 3,
        outstanding: 8,
        max_bytes: Some(192 << 10),
        ..quick(200)
    };
    let spec = builtin_spec("4k-random-70-30").unwrap();
    let suite = run_suite(&backend, &[spec], &config, &CancelToken::new(), &Silent).unwrap();
    assert!(suite.results[0].rates.ios > 100);
    assert!(
        backend.clash.lock().unwrap().is_empty(),
        "{:?}",
        backend.clash.lock().unwrap()
    );
    assert_eq!(suite.verify.unwrap().mismatches, 0);
}

#[test]
fn cancel_ends_the_run_early_and_it_still_reports() {
    let backend = RamBackend::new(1, 4 << 20).with_service_time(Duration::from_micros(500));
    let config = RunConfig {
        ramp: Duration::from_millis(100),
        run: Duration::from_secs(120),
        ..RunConfig::default()
    };
    let specs = [
        builtin_spec("4k-random-read").unwrap(),
        builtin_spec("64k-seq-read").unwrap(),
    ];
    let cancel = CancelToken::new();
    let canceller = {
        let cancel = cancel.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(400));
            cancel.cancel();
        })
    };
    let started = Instant::now();
    let suite = run_suite(&backend, &specs, &config, &cancel, &Silent).unwrap();
    canceller.join().unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "the run stopped"
    );
    assert!(suite.interrupted);
    assert_eq!(suite.results.len(), 1, "the next spec did not start");
    let r = &suite.results[0];
    assert!(r.interrupted);
    assert!(r.rates.ios > 0, "the interrupted window is reported");
    assert!(
        r.run_seconds > 0.1 && r.run_seconds < 60.0,
        "{}",
        r.run_seconds
    );
    assert!((r.rates.iops - r.rates.ios as f64 / r.run_seconds).abs() < 1e-6);
    assert!(
        r.timeline.ios.len() < 100,
        "the timeline ends at the interruption"
    );
    assert!(table(&suite).contains("interrupted"));
}

#[test]
fn bad_configurations_are_refused_before_anything_runs() {
    let backend = RamBackend::new(2, 1 << 20);
    let spec = [builtin_spec("4k-random-read").unwrap()];
    let refused = |config: RunConfig, says: &str| match run_suite(
        &backend,
        &spec,
        &config,
        &CancelToken::new(),
        &Silent,
    ) {
        Err(BenchError::Config(m)) => assert!(m.contains(says), "{m:?} should say {says:?}"),
        other => panic!("expected a configuration error saying {says:?}, got {other:?}"),
    };
    refused(
        RunConfig {
            workers: 0,
            ..quick(10)
        },
        "worker",
    );
    refused(
        RunConfig {
            outstanding: 0,
            ..quick(10)
        },
        "outstanding",
    );
    refused(
        RunConfig {
            targets: vec![],
            ..quick(10)
        },
        "no disk",
    );
    refused(
        RunConfig {
            targets: vec![2],
            ..quick(10)
        },
        "disk 2 does not exist",
    );
    refused(
        RunConfig {
            targets: vec![1, 1],
            ..quick(10)
        },
        "twice",
    );
    refused(
        RunConfig {
            run: Duration::ZERO,
            ..quick(10)
        },
        "run time",
    );
    refused(
        RunConfig {
            max_bytes: Some(2048),
            ..quick(10)
        },
        "cannot hold",
    );
    refused(
        RunConfig {
            verify: true,
            workers: 32,
            max_bytes: Some(64 << 10),
            ..quick(10)
        },
        "verify mode splits",
    );
    match run_suite(&backend, &[], &quick(10), &CancelToken::new(), &Silent) {
        Err(BenchError::Config(m)) => assert!(m.contains("no access specification")),
        other => panic!("{other:?}"),
    }
    let odd = AccessSpec::single(
        "odd",
        AccessPart {
            alignment: 1000,
            ..AccessPart::new(4096, 1, 1)
        },
    );
    match run_suite(&backend, &[odd], &quick(10), &CancelToken::new(), &Silent) {
        Err(BenchError::Config(m)) => assert!(m.contains("alignment 1000"), "{m}"),
        other => panic!("{other:?}"),
    }
}

fn small_suite() -> SuiteResult {
    let backend = RamBackend::new(2, 4 << 20);
    let config = RunConfig {
        targets: vec![0, 1],
        ..quick(100)
    };
    let specs = [
        builtin_spec("4k-random-read").unwrap(),
        builtin_spec("64k-seq-write").unwrap(),
    ];
    run_suite(&backend, &specs, &config, &CancelToken::new(), &Silent).unwrap()
}

#[test]
fn csv_has_iometer_columns_an_all_row_and_a_row_per_disk() {
    let suite = small_suite();
    let mut out = Vec::new();
    write_csv(&suite, &mut out).unwrap();
    let mut reader = csv::Reader::from_reader(&out[..]);
    let header: Vec<String> = reader
        .headers()
        .unwrap()
        .iter()
        .map(str::to_owned)
        .collect();
    assert_eq!(header, CSV_COLUMNS);
    for must in [
        "Target Type",
        "Target Name",
        "Access Specification Name",
        "# Workers",
        "# Disks",
        "IOps",
        "Read IOps",
        "Write IOps",
        "MBps (Decimal)",
        "Read MBps (Decimal)",
        "Write MBps (Decimal)",
        "Transactions per Second",
        "Average Response Time",
        "Average Read Response Time",
        "Average Write Response Time",
        "Maximum Response Time",
        "% CPU Utilization",
        "Errors",
    ] {
        assert!(header.iter().any(|h| h == must), "{must}");
    }
    let col = |name: &str| header.iter().position(|h| h == name).unwrap();
    let rows: Vec<csv::StringRecord> = reader.records().map(Result::unwrap).collect();
    assert_eq!(rows.len(), 2 * 3, "per spec: ALL + 2 disks");
    for (i, r) in suite.results.iter().enumerate() {
        let all = &rows[i * 3];
        assert_eq!(&all[col("Target Type")], "ALL");
        assert_eq!(&all[col("Access Specification Name")], r.spec);
        assert_eq!(&all[col("# Disks")], "2");
        let iops: f64 = all[col("IOps")].parse().unwrap();
        assert!((iops - r.rates.iops).abs() < 1e-3);
        let avg: f64 = all[col("Average Response Time")].parse().unwrap();
        assert!(
            (avg - r.rates.latency.average_ms).abs() < 1e-3,
            "milliseconds, as IOmeter"
        );
        let disk_sum: f64 = (1..=2)
            .map(|k| rows[i * 3 + k][col("IOps")].parse::<f64>().unwrap())
            .sum();
        assert!((disk_sum - iops).abs() < 0.01 * iops.max(1.0));
        for k in 1..=2 {
            assert_eq!(&rows[i * 3 + k][col("Target Type")], "RAM");
            assert_eq!(
                &rows[i * 3 + k][col("Target Name")],
                format!("ram{}", k - 1)
            );
        }
    }
}

#[test]
fn json_holds_every_figure() {
    let suite = small_suite();
    let mut out = Vec::new();
    write_json(&suite, &mut out).unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["target_type"], "RAM");
    assert_eq!(v["config"]["workers"], 1);
    assert_eq!(v["interrupted"], false);
    assert!(v["verify"].is_null());
    let results = v["results"].as_array().unwrap();
    assert_eq!(results.len(), 2);
    let r = &results[0];
    assert_eq!(r["spec"], "4K random read");
    for key in [
        "iops",
        "read_iops",
        "write_iops",
        "mbps",
        "mibps",
        "errors",
        "run_seconds",
        "lost_ios",
    ] {
        assert!(r[key].is_number(), "{key}: {}", r[key]);
    }
    for key in ["p50", "p90", "p99", "p99_9", "p99_99"] {
        assert!(r["latency"]["percentiles"][key].is_number(), "{key}");
    }
    assert!(r["cpu"]["us_per_io"].is_number());
    assert!(!r["timeline"]["ios"].as_array().unwrap().is_empty());
    assert!(!r["latency_distribution"].as_array().unwrap().is_empty());
    assert_eq!(r["targets"].as_array().unwrap().len(), 2);
    assert_eq!(
        r["iops"].as_f64().unwrap().round(),
        suite.results[0].rates.iops.round()
    );
}

#[test]
fn plots_are_svg_with_the_spec_name() {
    let suite = small_suite();
    let dir = std::env::temp_dir().join(format!("kvbench-plots-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let r: &SpecResult = &suite.results[0];
    let lat = dir.join("lat.svg");
    let iops = dir.join("iops.svg");
    plot::latency_histogram(r, &lat).unwrap();
    plot::iops_over_time(r, &iops).unwrap();
    for path in [&lat, &iops] {
        let svg = std::fs::read_to_string(path).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..40.min(svg.len())]);
        assert!(svg.contains("4K random read"), "title drawn");
        assert!(svg.contains("<rect") || svg.contains("<polyline") || svg.contains("<path"));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
