//! The run: workers keeping I/Os outstanding on their disks, ramp-up, the
//! measured window, and the results.
//!
//! For each access specification in turn, every worker (a thread) opens
//! its own queue on the backend and keeps `outstanding` I/Os in flight on
//! each selected disk, choosing part, direction and offset per I/O
//! ([`super::workload`]). The clock starts when every worker's queue is
//! open. Completions during the ramp-up feed only the IOPS-over-time
//! series; completions inside the measured window are counted; at the end
//! of the window workers stop issuing and drain what is outstanding (those
//! completions count for nothing). A [`CancelToken`] (Ctrl-C) ends the
//! window early: the run still drains and reports, marked interrupted.
//!
//! In verify mode every disk's working set is first written with the
//! pattern ([`super::verify`]), each worker gets a disjoint region of every
//! disk, and a worker never has two I/Os in flight that overlap: so the
//! content of every sector is known when a read returns, and every read is
//! checked.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use fastrand::Rng;
use serde::Serialize;

use super::backend::{
    Backend, BackendError, Direction, IoCompletion, IoQueue, IoRequest, IoStatus, QueueConfig,
    TargetInfo,
};
use super::spec::AccessSpec;
use super::stats::{Counts, CpuSample, Rates, SpecResult, TargetResult, Timeline, latency_buckets};
use super::verify::{self, Verifier, VerifySummary};
use super::workload::{MixPicker, OffsetGenerator, Region, overlaps, pick_direction, pick_random};

/// How a suite runs (the same for every spec in it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RunConfig {
    /// Worker threads (IOmeter's workers).
    pub workers: usize,
    /// Outstanding I/Os per disk per worker.
    pub outstanding: usize,
    /// The disks to drive (indices into [`Backend::targets`]).
    pub targets: Vec<usize>,
    /// Ramp-up before measuring.
    pub ramp: Duration,
    /// The measured window.
    pub run: Duration,
    /// Write a pattern and check every read.
    pub verify: bool,
    /// Seed of the I/O sequence.
    pub seed: u64,
    /// Bytes of each disk to use, from its start (IOmeter's "maximum disk
    /// size"); `None`: the whole disk.
    pub max_bytes: Option<u64>,
    /// How long workers wait for outstanding I/O at the end before they
    /// count it lost.
    pub drain_timeout: Duration,
}

impl Default for RunConfig {
    fn default() -> Self {
        Self {
            workers: 1,
            outstanding: 16,
            targets: vec![0],
            ramp: Duration::from_secs(1),
            run: Duration::from_secs(4),
            verify: false,
            seed: 1,
            max_bytes: None,
            drain_timeout: Duration::from_secs(10),
        }
    }
}

/// Why a suite could not run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BenchError {
    /// The configuration or a spec does not fit the disks.
    Config(String),
    /// The stack failed (not an I/O error: those are counted).
    Backend(String),
}

impl fmt::Display for BenchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Config(m) => write!(f, "bad run configuration: {m}"),
            Self::Backend(m) => write!(f, "the storage stack failed: {m}"),
        }
    }
}

impl std::error::Error for BenchError {}

impl From<BackendError> for BenchError {
    fn from(e: BackendError) -> Self {
        Self::Backend(e.0)
    }
}

#[derive(Debug, Default)]
struct CancelInner {
    at: OnceLock<Instant>,
    flag: AtomicBool,
}

/// Stops a run early (Ctrl-C); cheap to clone, all clones are one token.
#[derive(Debug, Clone, Default)]
pub struct CancelToken {
    inner: Arc<CancelInner>,
}

impl CancelToken {
    /// A token not cancelled.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Cancels (idempotent; the first call's moment counts).
    pub fn cancel(&self) {
        let _ = self.inner.at.set(Instant::now());
        self.inner.flag.store(true, Ordering::Release);
    }

    /// True once cancelled.
    #[must_use]
    pub fn is_cancelled(&self) -> bool {
        self.inner.flag.load(Ordering::Acquire)
    }

    /// When it was cancelled.
    #[must_use]
    pub fn cancelled_at(&self) -> Option<Instant> {
        self.is_cancelled()
            .then(|| self.inner.at.get().copied())
            .flatten()
    }
}

/// Where a spec's run is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Writing the verify pattern over the working sets.
    Prefill,
    /// Ramping up (not measured).
    RampUp,
    /// Measuring.
    Measure,
    /// Waiting for outstanding I/O.
    Drain,
}

/// Told what happens during a suite (the progress bar).
pub trait Observer: Sync {
    /// Spec `index` of `total` starts.
    fn spec_started(&self, _index: usize, _total: usize, _spec: &AccessSpec) {}
    /// About ten times a second: the phase, the time since the ramp-up
    /// began (or since the prefill began), and the I/Os completed so far.
    fn progress(&self, _phase: Phase, _elapsed: Duration, _ios: u64) {}
    /// A spec finished.
    fn spec_finished(&self, _result: &SpecResult) {}
}

/// An observer that ignores everything.
#[derive(Debug, Clone, Copy, Default)]
pub struct Silent;

impl Observer for Silent {}

/// The results of a suite.
#[derive(Debug, Clone, Serialize)]
pub struct SuiteResult {
    /// What the I/O went through.
    pub backend: String,
    /// IOmeter's "Target Type".
    pub target_type: String,
    /// The disks driven.
    pub targets: Vec<TargetInfo>,
    /// The run's configuration.
    pub config: RunConfig,
    /// One per spec run (an interrupted spec included).
    pub results: Vec<SpecResult>,
    /// Ctrl-C ended the suite early.
    pub interrupted: bool,
    /// Everything the verifier found (verify mode).
    pub verify: Option<VerifySummary>,
}

impl SuiteResult {
    /// True if the verifier found any mismatch.
    #[must_use]
    pub fn verify_failed(&self) -> bool {
        self.verify.as_ref().is_some_and(|v| v.mismatches > 0)
    }

    /// True if any I/O failed or was lost.
    #[must_use]
    pub fn had_errors(&self) -> bool {
        self.results
            .iter()
            .any(|r| r.rates.errors > 0 || r.lost_ios > 0)
    }
}

/// The working set of each backend disk (0 for disks not driven), whole
/// blocks only.
fn working_sets(targets: &[TargetInfo], config: &RunConfig) -> Vec<u64> {
    targets
        .iter()
        .enumerate()
        .map(|(i, t)| {
            if !config.targets.contains(&i) {
                return 0;
            }
            let bytes = config.max_bytes.map_or(t.capacity, |m| m.min(t.capacity));
            bytes / u64::from(t.block_size.max(1)) * u64::from(t.block_size.max(1))
        })
        .collect()
}

/// The granule worker regions start on: a multiple of every alignment and
/// block size in play (so every region is aligned as the whole disk is).
fn region_granule(specs: &[AccessSpec], targets: &[TargetInfo]) -> u64 {
    let gcd = |mut a: u64, mut b: u64| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    let lcm = |a: u64, b: u64| a / gcd(a, b).max(1) * b;
    let mut g = 4096u64;
    for p in specs.iter().flat_map(|s| &s.parts) {
        g = lcm(g, u64::from(p.alignment));
    }
    for t in targets {
        g = lcm(g, u64::from(t.block_size.max(1)));
    }
    g.min(1 << 30)
}

fn check_config(
    backend: &dyn Backend,
    specs: &[AccessSpec],
    config: &RunConfig,
) -> Result<(), BenchError> {
    let bad = |m: String| Err(BenchError::Config(m));
    let targets = backend.targets();
    if specs.is_empty() {
        return bad("no access specification to run".into());
    }
    if config.workers == 0 {
        return bad("at least one worker is needed".into());
    }
    if config.outstanding == 0 {
        return bad("at least one outstanding I/O per disk is needed".into());
    }
    if config.targets.is_empty() {
        return bad("no disk selected".into());
    }
    for &t in &config.targets {
        if t >= targets.len() {
            return bad(format!(
                "disk {t} does not exist (the stack has {} disk(s))",
                targets.len()
            ));
        }
    }
    let mut seen = config.targets.clone();
    seen.sort_unstable();
    seen.dedup();
    if seen.len() != config.targets.len() {
        return bad("a disk is selected twice".into());
    }
    if config.run.is_zero() {
        return bad("the run time is zero".into());
    }
    let sets = working_sets(targets, config);
    let granule = region_granule(specs, targets);
    for spec in specs {
        spec.check().map_err(BenchError::Config)?;
        for &t in &config.targets {
            let info = &targets[t];
            for p in &spec.parts {
                let block = info.block_size.max(1);
                if p.transfer_size % block != 0 || p.alignment % block != 0 {
                    return bad(format!(
                        "spec \"{}\": transfer size {} / alignment {} is not a multiple of \
                         {}'s block size {block}",
                        spec.name, p.transfer_size, p.alignment, info.name
                    ));
                }
            }
            let need = u64::from(spec.max_transfer());
            let share = if config.verify {
                Region::split(sets[t], config.workers, granule)
                    .iter()
                    .map(|r| r.len)
                    .min()
                    .unwrap_or(0)
            } else {
                sets[t]
            };
            if share < need {
                return bad(format!(
                    "spec \"{}\": {} bytes per worker on {} cannot hold a {need}-byte transfer{}",
                    spec.name,
                    share,
                    info.name,
                    if config.verify {
                        " (verify mode splits each disk between the workers)"
                    } else {
                        ""
                    }
                ));
            }
        }
    }
    Ok(())
}

/// Runs `specs` in order on `backend`.
///
/// # Errors
/// [`BenchError::Config`] before anything runs if the configuration does
/// not fit the disks; [`BenchError::Backend`] if the stack fails.
pub fn run_suite(
    backend: &dyn Backend,
    specs: &[AccessSpec],
    config: &RunConfig,
    cancel: &CancelToken,
    observer: &dyn Observer,
) -> Result<SuiteResult, BenchError> {
    check_config(backend, specs, config)?;
    let targets = backend.targets();
    let sets = working_sets(targets, config);
    let verifier = config.verify.then(|| Verifier::new(&sets));
    if let Some(v) = &verifier {
        prefill(backend, config, &sets, v, cancel, observer)?;
    }
    let mut results = Vec::with_capacity(specs.len());
    for (index, spec) in specs.iter().enumerate() {
        if cancel.is_cancelled() {
            break;
        }
        observer.spec_started(index, specs.len(), spec);
        let result = run_spec(
            backend,
            spec,
            index,
            specs,
            config,
            &sets,
            verifier.as_ref(),
            cancel,
            observer,
        )?;
        observer.spec_finished(&result);
        results.push(result);
    }
    Ok(SuiteResult {
        backend: backend.describe(),
        target_type: backend.target_type().to_owned(),
        targets: config
            .targets
            .iter()
            .filter_map(|&t| targets.get(t).cloned())
            .collect(),
        config: config.clone(),
        results,
        interrupted: cancel.is_cancelled(),
        verify: verifier.as_ref().map(Verifier::summary),
    })
}

/// Bytes per prefill write.
const PREFILL_CHUNK: u64 = 128 << 10;
/// Prefill writes in flight.
const PREFILL_DEPTH: usize = 8;

/// Writes the pattern over every disk's working set, so reads have
/// something known to check from the first I/O on.
fn prefill(
    backend: &dyn Backend,
    config: &RunConfig,
    sets: &[u64],
    verifier: &Verifier,
    cancel: &CancelToken,
    observer: &dyn Observer,
) -> Result<(), BenchError> {
    let targets = backend.targets();
    let mut jobs: Vec<(usize, u64, u32)> = Vec::new();
    let mut sizes: Vec<u32> = Vec::new();
    for &t in &config.targets {
        let mut offset = 0;
        while offset < sets[t] {
            let len = u32::try_from((sets[t] - offset).min(PREFILL_CHUNK)).unwrap_or(0);
            let len = len / targets[t].block_size.max(1) * targets[t].block_size.max(1);
            if len == 0 {
                break;
            }
            jobs.push((t, offset, len));
            if !sizes.contains(&len) {
                sizes.push(len);
            }
            offset += u64::from(len);
        }
    }
    let mut queue = backend.open_queue(&QueueConfig {
        depth: PREFILL_DEPTH,
        transfer_sizes: sizes,
    })?;
    let started = Instant::now();
    let mut buf = vec![0u8; usize::try_from(PREFILL_CHUNK).unwrap_or(0)];
    let mut slots: Vec<Option<(usize, u64, u32, u32)>> = vec![None; PREFILL_DEPTH];
    let mut next = 0usize;
    let mut inflight = 0usize;
    let mut done = 0u64;
    let mut completions = Vec::new();
    let mut last_progress = Instant::now();
    while next < jobs.len() || inflight > 0 {
        while next < jobs.len() && !cancel.is_cancelled() {
            let Some(slot) = slots.iter().position(Option::is_none) else {
                break;
            };
            let (t, offset, len) = jobs[next];
            let generation = verifier.next_generation();
            let data = &mut buf[..len as usize];
            verify::fill(
                data,
                u16::try_from(t).unwrap_or(u16::MAX),
                offset / u64::from(super::spec::SECTOR),
                generation,
            );
            queue.submit(&IoRequest {
                slot: u32::try_from(slot).unwrap_or(u32::MAX),
                target: t,
                direction: Direction::Write,
                offset,
                len,
                data: Some(data),
            })?;
            slots[slot] = Some((t, offset, len, generation));
            next += 1;
            inflight += 1;
        }
        if cancel.is_cancelled() && inflight == 0 {
            break;
        }
        queue.reap(&mut completions, Duration::from_millis(50))?;
        for c in completions.drain(..) {
            let Some((t, offset, len, generation)) =
                slots.get_mut(c.slot as usize).and_then(Option::take)
            else {
                return Err(BenchError::Backend(format!(
                    "completion for slot {} that has no I/O",
                    c.slot
                )));
            };
            inflight -= 1;
            done += 1;
            if let IoStatus::Failed(why) = &c.status {
                return Err(BenchError::Backend(format!(
                    "writing the verify pattern to {} at byte {offset} failed: {why}",
                    targets[t].name
                )));
            }
            verifier.write_done(t, offset, len as usize, generation, true);
        }
        if last_progress.elapsed() >= Duration::from_millis(100) {
            observer.progress(Phase::Prefill, started.elapsed(), done);
            last_progress = Instant::now();
        }
    }
    Ok(())
}

/// Where workers wait until every worker's queue is open and the clock
/// has started (a barrier that cannot deadlock when a thread failed to
/// start).
#[derive(Default)]
struct Gate {
    /// Workers arrived, and whether the gate is open.
    state: Mutex<(usize, bool)>,
    changed: Condvar,
}

impl Gate {
    fn arrive_and_wait(&self) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.0 += 1;
        self.changed.notify_all();
        while !state.1 {
            state = self
                .changed
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    fn wait_for(&self, workers: usize) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        while state.0 < workers {
            state = self
                .changed
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    fn open(&self) {
        self.state.lock().unwrap_or_else(PoisonError::into_inner).1 = true;
        self.changed.notify_all();
    }
}

/// The moments of one spec's run, fixed when every queue is open.
#[derive(Debug, Clone, Copy)]
struct Window {
    /// Ramp-up begins.
    start: Instant,
    /// Measuring begins.
    measure: Instant,
    /// Measuring ends (issuing stops).
    end: Instant,
}

/// Failed I/Os whose reasons a result keeps.
const KEPT_ERRORS: usize = 8;

/// What a worker hands back.
struct WorkerOutput {
    /// Per selected disk (in `config.targets` order).
    per_target: Vec<Counts>,
    timeline: Timeline,
    lost: u64,
    /// The first failed I/Os, described.
    errors: Vec<String>,
}

#[derive(Clone, Copy)]
struct InFlight {
    /// Position in `config.targets`.
    target: usize,
    direction: Direction,
    offset: u64,
    len: u32,
    issued_at: Instant,
    generation: u32,
}

struct Shared<'a> {
    backend: &'a dyn Backend,
    spec: &'a AccessSpec,
    config: &'a RunConfig,
    sets: &'a [u64],
    granule: u64,
    verifier: Option<&'a Verifier>,
    cancel: &'a CancelToken,
    completed: AtomicU64,
    window: OnceLock<Window>,
    gate: Gate,
    seed: u64,
}

impl Shared<'_> {
    /// Where counting stops: the end of the window, or Ctrl-C.
    fn counting_end(&self, window: &Window) -> Instant {
        self.cancel
            .cancelled_at()
            .map_or(window.end, |c| c.min(window.end))
    }
}

#[allow(clippy::too_many_arguments)]
fn run_spec(
    backend: &dyn Backend,
    spec: &AccessSpec,
    index: usize,
    all_specs: &[AccessSpec],
    config: &RunConfig,
    sets: &[u64],
    verifier: Option<&Verifier>,
    cancel: &CancelToken,
    observer: &dyn Observer,
) -> Result<SpecResult, BenchError> {
    let shared = Shared {
        backend,
        spec,
        config,
        sets,
        granule: region_granule(all_specs, backend.targets()),
        verifier,
        cancel,
        completed: AtomicU64::new(0),
        window: OnceLock::new(),
        gate: Gate::default(),
        seed: config.seed ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
    };
    let first_error: Mutex<Option<BackendError>> = Mutex::new(None);
    let (outputs, cpu, window, counting_end) = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..config.workers)
            .map(|w| {
                let shared = &shared;
                std::thread::Builder::new()
                    .name(format!("kvbench-worker-{w}"))
                    .spawn_scoped(scope, move || worker(shared, w))
            })
            .collect();
        let spawned = handles.iter().filter(|h| h.is_ok()).count();
        // Every worker has opened its queue (or failed to): start the clock.
        shared.gate.wait_for(spawned);
        let start = Instant::now();
        let window = Window {
            start,
            measure: start + config.ramp,
            end: start + config.ramp + config.run,
        };
        let _ = shared.window.set(window);
        shared.gate.open();
        // Ramp-up, then the window, reporting progress.
        let mut cpu_start = None;
        let cpu_end;
        loop {
            let now = Instant::now();
            if cpu_start.is_none() && (now >= window.measure || cancel.is_cancelled()) {
                cpu_start = Some((CpuSample::now(), Instant::now()));
            }
            if now >= window.end || cancel.is_cancelled() {
                cpu_end = Some((CpuSample::now(), Instant::now()));
                break;
            }
            let phase = if now < window.measure {
                Phase::RampUp
            } else {
                Phase::Measure
            };
            observer.progress(
                phase,
                now - window.start,
                shared.completed.load(Ordering::Relaxed),
            );
            let next = if now < window.measure {
                window.measure
            } else {
                window.end
            };
            std::thread::sleep((next - now).min(Duration::from_millis(100)));
        }
        let mut outputs = Vec::with_capacity(config.workers);
        for handle in handles {
            let result = match handle {
                Ok(h) => h
                    .join()
                    .unwrap_or_else(|_| Err(BackendError::new("a worker thread panicked"))),
                Err(e) => Err(BackendError::new(format!(
                    "cannot start a worker thread: {e}"
                ))),
            };
            match result {
                Ok(o) => outputs.push(o),
                Err(e) => {
                    let mut first = first_error.lock().unwrap_or_else(PoisonError::into_inner);
                    if first.is_none() {
                        *first = Some(e);
                    }
                }
            }
            observer.progress(
                Phase::Drain,
                window.start.elapsed(),
                shared.completed.load(Ordering::Relaxed),
            );
        }
        let counting_end = shared.counting_end(&window);
        (outputs, (cpu_start, cpu_end), window, counting_end)
    });
    if let Some(e) = first_error
        .into_inner()
        .unwrap_or_else(PoisonError::into_inner)
    {
        return Err(e.into());
    }
    let mut per_target: Vec<Counts> = vec![Counts::default(); config.targets.len()];
    let mut timeline = Timeline::new(config.ramp, config.run);
    let mut lost = 0;
    let mut first_errors = Vec::new();
    for o in &outputs {
        for (a, b) in per_target.iter_mut().zip(&o.per_target) {
            a.merge(b);
        }
        timeline.merge(&o.timeline);
        lost += o.lost;
        first_errors.extend(o.errors.iter().cloned());
    }
    first_errors.truncate(KEPT_ERRORS);
    if cancel.is_cancelled() {
        let keep = usize::try_from(
            counting_end
                .saturating_duration_since(window.start)
                .as_millis()
                / u128::from(timeline.bucket_ms.max(1)),
        )
        .unwrap_or(usize::MAX)
            + 1;
        timeline.ios.truncate(keep);
        timeline.trim();
    }
    let mut all = Counts::default();
    for c in &per_target {
        all.merge(c);
    }
    let seconds = counting_end
        .saturating_duration_since(window.measure)
        .as_secs_f64();
    let rates = Rates::of(&all, seconds);
    let processors = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    let cpu = match cpu {
        (Some((a, at)), Some((b, bt))) => a.usage_until(
            &b,
            bt.saturating_duration_since(at).as_secs_f64(),
            rates.ios,
            processors,
        ),
        _ => Default::default(),
    };
    let total_histogram = all.total().histogram;
    Ok(SpecResult {
        spec: spec.name.clone(),
        target_type: backend.target_type().to_owned(),
        workers: config.workers,
        disks: config.targets.len(),
        outstanding_per_disk: config.outstanding,
        ramp_seconds: config.ramp.as_secs_f64(),
        run_seconds: seconds,
        interrupted: cancel.is_cancelled(),
        targets: config
            .targets
            .iter()
            .zip(&per_target)
            .map(|(&t, c)| TargetResult {
                name: backend.targets()[t].name.clone(),
                rates: Rates::of(c, seconds),
            })
            .collect(),
        rates,
        cpu,
        verify: verifier.map(Verifier::summary),
        timeline,
        latency_distribution: latency_buckets(&total_histogram),
        lost_ios: lost,
        first_errors,
    })
}

/// Random offsets tried before a verify-mode worker waits for a
/// completion instead (the candidate overlapped an I/O in flight).
const OVERLAP_RETRIES: usize = 16;
/// Longest a worker blocks in one reap.
const REAP_WAIT: Duration = Duration::from_millis(20);

fn worker(shared: &Shared<'_>, index: usize) -> Result<WorkerOutput, BackendError> {
    let config = shared.config;
    let depth = config.outstanding * config.targets.len();
    let queue = shared.backend.open_queue(&QueueConfig {
        depth,
        transfer_sizes: shared.spec.transfer_sizes(),
    });
    shared.gate.arrive_and_wait();
    let mut queue = queue?;
    let window = *shared
        .window
        .get()
        .ok_or_else(|| BackendError::new("the run did not start"))?;
    let result = issue_loop(shared, index, queue.as_mut(), &window);
    drop(queue);
    result
}

fn issue_loop(
    shared: &Shared<'_>,
    index: usize,
    queue: &mut dyn IoQueue,
    window: &Window,
) -> Result<WorkerOutput, BackendError> {
    let config = shared.config;
    let spec = shared.spec;
    let ntargets = config.targets.len();
    let depth = config.outstanding * ntargets;
    let mut rng =
        Rng::with_seed(shared.seed ^ (index as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03));
    let picker = MixPicker::new(spec);
    let mut generators: Vec<OffsetGenerator> = config
        .targets
        .iter()
        .map(|&t| {
            let whole = Region {
                start: 0,
                len: shared.sets[t],
            };
            let region = if shared.verifier.is_some() {
                Region::split(whole.len, config.workers, shared.granule)
                    .get(index)
                    .copied()
                    .unwrap_or(whole)
            } else {
                whole
            };
            OffsetGenerator::new(region)
        })
        .collect();
    let mut slots: Vec<Option<InFlight>> = vec![None; depth];
    let mut free: Vec<u32> = (0..u32::try_from(depth).unwrap_or(u32::MAX))
        .rev()
        .collect();
    let mut per_target_inflight = vec![0usize; ntargets];
    let mut per_target: Vec<Counts> = vec![Counts::default(); ntargets];
    let mut timeline = Timeline::new(config.ramp, config.run);
    let largest = spec.max_transfer() as usize;
    let mut data = vec![
        0u8;
        if shared.verifier.is_some() {
            largest
        } else {
            0
        }
    ];
    let mut completions: Vec<IoCompletion> = Vec::with_capacity(depth);
    let mut next_target = 0usize;
    let mut inflight = 0usize;
    let mut drain_started: Option<Instant> = None;
    let mut errors: Vec<String> = Vec::new();
    loop {
        let now = Instant::now();
        let issuing = now < window.end && !shared.cancel.is_cancelled();
        if issuing {
            'fill: while let Some(&slot) = free.last() {
                // The next disk (round robin) with room for another I/O.
                let Some(t) = (0..ntargets)
                    .map(|k| (next_target + k) % ntargets)
                    .find(|&t| per_target_inflight[t] < config.outstanding)
                else {
                    break;
                };
                next_target = (t + 1) % ntargets;
                let part = spec.parts[picker.pick(&mut rng)];
                let direction = pick_direction(&part, &mut rng);
                let random = pick_random(&part, &mut rng);
                let mut chosen = None;
                for _ in 0..OVERLAP_RETRIES {
                    let Some(offset) = generators[t].next(&part, random, &mut rng) else {
                        return Err(BackendError::new(format!(
                            "no room for a {}-byte transfer on disk {}",
                            part.transfer_size, config.targets[t]
                        )));
                    };
                    let clash = shared.verifier.is_some()
                        && slots.iter().flatten().any(|f| {
                            f.target == t
                                && overlaps(
                                    f.offset,
                                    u64::from(f.len),
                                    offset,
                                    u64::from(part.transfer_size),
                                )
                        });
                    if !clash {
                        chosen = Some(offset);
                        break;
                    }
                    if !random {
                        break;
                    }
                }
                let Some(offset) = chosen else {
                    // Everything tried overlaps an I/O in flight: wait for
                    // completions.
                    break 'fill;
                };
                let backend_target = config.targets[t];
                let len = part.transfer_size;
                let mut generation = 0;
                let payload = match (shared.verifier, direction) {
                    (Some(v), Direction::Write) => {
                        generation = v.next_generation();
                        let buf = &mut data[..len as usize];
                        verify::fill(
                            buf,
                            u16::try_from(backend_target).unwrap_or(u16::MAX),
                            offset / u64::from(super::spec::SECTOR),
                            generation,
                        );
                        Some(&buf[..])
                    }
                    _ => None,
                };
                let issued_at = Instant::now();
                queue.submit(&IoRequest {
                    slot,
                    target: backend_target,
                    direction,
                    offset,
                    len,
                    data: payload,
                })?;
                free.pop();
                slots[slot as usize] = Some(InFlight {
                    target: t,
                    direction,
                    offset,
                    len,
                    issued_at,
                    generation,
                });
                per_target_inflight[t] += 1;
                inflight += 1;
            }
        } else if inflight == 0 {
            break;
        } else {
            let since = *drain_started.get_or_insert(now);
            if now.saturating_duration_since(since) > config.drain_timeout {
                break;
            }
        }
        let wait = if issuing {
            window.end.saturating_duration_since(now).min(REAP_WAIT)
        } else {
            REAP_WAIT
        };
        queue.reap(&mut completions, wait)?;
        let counting_end = shared.counting_end(window);
        let reaped = completions.len() as u64;
        for c in completions.drain(..) {
            let Some(io) = slots.get_mut(c.slot as usize).and_then(Option::take) else {
                return Err(BackendError::new(format!(
                    "completion for slot {} that has no I/O",
                    c.slot
                )));
            };
            free.push(c.slot);
            per_target_inflight[io.target] -= 1;
            inflight -= 1;
            let ok = c.status == IoStatus::Good;
            if let IoStatus::Failed(why) = &c.status {
                if errors.len() < KEPT_ERRORS {
                    errors.push(format!(
                        "{:?} of {} bytes at byte {} of disk {}: {why}",
                        io.direction, io.len, io.offset, config.targets[io.target]
                    ));
                }
            }
            if c.completed_at < counting_end {
                timeline.record(c.completed_at.saturating_duration_since(window.start));
                if c.completed_at >= window.measure {
                    per_target[io.target].record(
                        io.direction,
                        io.len,
                        c.completed_at.saturating_duration_since(io.issued_at),
                        ok,
                    );
                }
            }
            if let Some(v) = shared.verifier {
                let backend_target = config.targets[io.target];
                match io.direction {
                    Direction::Write => {
                        v.write_done(
                            backend_target,
                            io.offset,
                            io.len as usize,
                            io.generation,
                            ok,
                        );
                    }
                    Direction::Read if ok => {
                        let buf = &mut data[..io.len as usize];
                        queue.read_data(c.slot, buf)?;
                        v.check_read(backend_target, io.offset, buf);
                    }
                    Direction::Read => {}
                }
            }
        }
        shared.completed.fetch_add(reaped, Ordering::Relaxed);
    }
    Ok(WorkerOutput {
        per_target,
        timeline,
        lost: inflight as u64,
        errors,
    })
}
