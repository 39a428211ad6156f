//! Counting: what each worker records per I/O, and the per-spec results
//! derived from it.
//!
//! Latencies go into [`hdrhistogram`] histograms in nanoseconds (three
//! significant digits: a percentile is exact to 0.1 %); averages and maxima
//! are kept exactly beside them. Only I/Os that *complete* inside the
//! measurement window count, as in IOmeter; the IOPS-over-time series counts
//! completions in fixed buckets from the start of the ramp-up.

use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;

use super::backend::Direction;
use super::verify::VerifySummary;

/// Significant digits the histograms keep.
const SIGFIG: u8 = 3;

fn histogram() -> Histogram<u64> {
    // An auto-resizing histogram from 1 ns: never fails to record.
    Histogram::new(SIGFIG).unwrap_or_else(|_| unreachable_histogram())
}

#[cold]
fn unreachable_histogram() -> Histogram<u64> {
    // `new(3)` cannot fail (sigfig is within 0..=5); keep a fallback
    // rather than a panic.
    Histogram::new_with_bounds(1, u64::MAX / 2, 2).unwrap_or_else(|_| std::process::abort())
}

/// Counters of one direction.
#[derive(Debug, Clone)]
pub struct DirectionCounts {
    /// Completed I/Os (good or failed).
    pub ios: u64,
    /// Bytes moved by good I/Os.
    pub bytes: u64,
    /// Failed I/Os.
    pub errors: u64,
    /// Sum of latencies, nanoseconds.
    pub latency_sum_ns: u128,
    /// Largest latency, nanoseconds.
    pub latency_max_ns: u64,
    /// Latency histogram, nanoseconds.
    pub histogram: Histogram<u64>,
}

impl Default for DirectionCounts {
    fn default() -> Self {
        Self {
            ios: 0,
            bytes: 0,
            errors: 0,
            latency_sum_ns: 0,
            latency_max_ns: 0,
            histogram: histogram(),
        }
    }
}

impl DirectionCounts {
    fn record(&mut self, bytes: u32, latency_ns: u64, ok: bool) {
        self.ios += 1;
        if ok {
            self.bytes += u64::from(bytes);
        } else {
            self.errors += 1;
        }
        self.latency_sum_ns += u128::from(latency_ns);
        self.latency_max_ns = self.latency_max_ns.max(latency_ns);
        // Auto-resizing: recording cannot fail for a value >= 1.
        let _ = self.histogram.record(latency_ns.max(1));
    }

    fn merge(&mut self, other: &Self) {
        self.ios += other.ios;
        self.bytes += other.bytes;
        self.errors += other.errors;
        self.latency_sum_ns += other.latency_sum_ns;
        self.latency_max_ns = self.latency_max_ns.max(other.latency_max_ns);
        let _ = self.histogram.add(&other.histogram);
    }
}

/// What one worker counted for one disk (or for everything).
#[derive(Debug, Clone, Default)]
pub struct Counts {
    /// Reads.
    pub read: DirectionCounts,
    /// Writes.
    pub write: DirectionCounts,
}

impl Counts {
    /// Records one completed I/O.
    pub fn record(&mut self, direction: Direction, bytes: u32, latency: Duration, ok: bool) {
        let ns = u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX);
        match direction {
            Direction::Read => self.read.record(bytes, ns, ok),
            Direction::Write => self.write.record(bytes, ns, ok),
        }
    }

    /// Adds `other` in.
    pub fn merge(&mut self, other: &Self) {
        self.read.merge(&other.read);
        self.write.merge(&other.write);
    }

    /// Reads and writes together.
    #[must_use]
    pub fn total(&self) -> DirectionCounts {
        let mut all = self.read.clone();
        all.merge(&self.write);
        all
    }
}

/// Latency percentiles, milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Percentiles {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p99_9: f64,
    /// 99.99th percentile.
    pub p99_99: f64,
}

const NS_PER_MS: f64 = 1e6;

fn ms(ns: u64) -> f64 {
    ns as f64 / NS_PER_MS
}

impl Percentiles {
    /// The percentiles of `histogram` (nanoseconds in, milliseconds out;
    /// zeros for an empty histogram).
    #[must_use]
    pub fn of(histogram: &Histogram<u64>) -> Self {
        if histogram.is_empty() {
            return Self::default();
        }
        let q = |p: f64| ms(histogram.value_at_quantile(p));
        Self {
            p50: q(0.50),
            p90: q(0.90),
            p99: q(0.99),
            p99_9: q(0.999),
            p99_99: q(0.9999),
        }
    }
}

/// Latency figures of one direction (or both), milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct LatencySummary {
    /// Mean.
    pub average_ms: f64,
    /// Largest.
    pub max_ms: f64,
    /// Percentiles.
    pub percentiles: Percentiles,
}

impl LatencySummary {
    /// The figures of `counts`.
    #[must_use]
    pub fn of(counts: &DirectionCounts) -> Self {
        let average_ms = if counts.ios == 0 {
            0.0
        } else {
            (counts.latency_sum_ns as f64 / counts.ios as f64) / NS_PER_MS
        };
        let max_ms = ms(counts.latency_max_ns);
        // The histogram reports a bucket's upper edge, which can lie just
        // above the exact maximum: no percentile exceeds the maximum.
        let p = Percentiles::of(&counts.histogram);
        Self {
            average_ms,
            max_ms,
            percentiles: Percentiles {
                p50: p.p50.min(max_ms),
                p90: p.p90.min(max_ms),
                p99: p.p99.min(max_ms),
                p99_9: p.p99_9.min(max_ms),
                p99_99: p.p99_99.min(max_ms),
            },
        }
    }
}

/// Rates of one scope (all disks, or one), over the measured window.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Rates {
    /// Completed I/Os.
    pub ios: u64,
    /// Completed reads.
    pub read_ios: u64,
    /// Completed writes.
    pub write_ios: u64,
    /// Bytes read.
    pub bytes_read: u64,
    /// Bytes written.
    pub bytes_written: u64,
    /// Failed I/Os.
    pub errors: u64,
    /// Failed reads.
    pub read_errors: u64,
    /// Failed writes.
    pub write_errors: u64,
    /// I/Os per second.
    pub iops: f64,
    /// Reads per second.
    pub read_iops: f64,
    /// Writes per second.
    pub write_iops: f64,
    /// Megabytes (10^6 bytes) per second.
    pub mbps: f64,
    /// Read megabytes per second.
    pub read_mbps: f64,
    /// Write megabytes per second.
    pub write_mbps: f64,
    /// Mebibytes (2^20 bytes) per second.
    pub mibps: f64,
    /// Read mebibytes per second.
    pub read_mibps: f64,
    /// Write mebibytes per second.
    pub write_mibps: f64,
    /// All I/Os.
    pub latency: LatencySummary,
    /// Reads.
    pub read_latency: LatencySummary,
    /// Writes.
    pub write_latency: LatencySummary,
}

impl Rates {
    /// The rates of `counts` over `seconds` (all zero for an empty window).
    #[must_use]
    pub fn of(counts: &Counts, seconds: f64) -> Self {
        let per_sec = |n: u64| {
            if seconds > 0.0 {
                n as f64 / seconds
            } else {
                0.0
            }
        };
        let total = counts.total();
        Self {
            ios: total.ios,
            read_ios: counts.read.ios,
            write_ios: counts.write.ios,
            bytes_read: counts.read.bytes,
            bytes_written: counts.write.bytes,
            errors: total.errors,
            read_errors: counts.read.errors,
            write_errors: counts.write.errors,
            iops: per_sec(total.ios),
            read_iops: per_sec(counts.read.ios),
            write_iops: per_sec(counts.write.ios),
            mbps: per_sec(total.bytes) / 1e6,
            read_mbps: per_sec(counts.read.bytes) / 1e6,
            write_mbps: per_sec(counts.write.bytes) / 1e6,
            mibps: per_sec(total.bytes) / f64::from(1u32 << 20),
            read_mibps: per_sec(counts.read.bytes) / f64::from(1u32 << 20),
            write_mibps: per_sec(counts.write.bytes) / f64::from(1u32 << 20),
            latency: LatencySummary::of(&total),
            read_latency: LatencySummary::of(&counts.read),
            write_latency: LatencySummary::of(&counts.write),
        }
    }
}

/// One disk's figures.
#[derive(Debug, Clone, Serialize)]
pub struct TargetResult {
    /// The disk's name.
    pub name: String,
    /// Its rates.
    #[serde(flatten)]
    pub rates: Rates,
}

/// Process CPU time used in the window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct CpuUsage {
    /// User plus system CPU seconds of the whole process (initiator stack,
    /// target and benchmark alike: they share the process).
    pub seconds: f64,
    /// User CPU seconds.
    pub user_seconds: f64,
    /// System CPU seconds.
    pub system_seconds: f64,
    /// CPU seconds over wall seconds times processors, percent.
    pub utilization_percent: f64,
    /// CPU microseconds per completed I/O.
    pub us_per_io: f64,
}

/// A moment's process CPU times, seconds (user, system).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CpuSample {
    /// User seconds.
    pub user: f64,
    /// System seconds.
    pub system: f64,
}

impl CpuSample {
    /// The process's CPU times now (`getrusage(RUSAGE_SELF)`; zeros if the
    /// call fails).
    #[must_use]
    pub fn now() -> Self {
        let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
        // SAFETY: `usage` is a valid, writable rusage; getrusage only
        // writes it.
        let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) };
        if rc != 0 {
            return Self::default();
        }
        // SAFETY: getrusage succeeded and filled the struct (it was
        // zeroed before, so every field is initialised either way).
        let usage = unsafe { usage.assume_init() };
        let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
        Self {
            user: secs(usage.ru_utime),
            system: secs(usage.ru_stime),
        }
    }

    /// The usage between `self` and `later` over `wall` seconds for `ios`
    /// I/Os on `processors` processors.
    #[must_use]
    pub fn usage_until(&self, later: &Self, wall: f64, ios: u64, processors: usize) -> CpuUsage {
        let user = (later.user - self.user).max(0.0);
        let system = (later.system - self.system).max(0.0);
        let seconds = user + system;
        let capacity = wall * processors.max(1) as f64;
        CpuUsage {
            seconds,
            user_seconds: user,
            system_seconds: system,
            utilization_percent: if capacity > 0.0 {
                100.0 * seconds / capacity
            } else {
                0.0
            },
            us_per_io: if ios > 0 {
                seconds * 1e6 / ios as f64
            } else {
                0.0
            },
        }
    }
}

/// Completions per time bucket, from the start of the ramp-up.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Timeline {
    /// Bucket width, milliseconds.
    pub bucket_ms: u64,
    /// Buckets that belong to the ramp-up (not measured).
    pub ramp_buckets: usize,
    /// Completed I/Os per bucket.
    pub ios: Vec<u64>,
}

impl Timeline {
    /// An empty timeline for a ramp of `ramp` and a run of `run`: about 100
    /// buckets, at least 100 ms and at most 10 s wide.
    #[must_use]
    pub fn new(ramp: Duration, run: Duration) -> Self {
        let total = (ramp + run).as_millis().max(1);
        let bucket_ms = u64::try_from(total / 100)
            .unwrap_or(10_000)
            .clamp(100, 10_000);
        let buckets = usize::try_from(total.div_ceil(u128::from(bucket_ms))).unwrap_or(0);
        Self {
            bucket_ms,
            ramp_buckets: usize::try_from(ramp.as_millis() / u128::from(bucket_ms)).unwrap_or(0),
            ios: vec![0; buckets],
        }
    }

    /// Counts a completion `since_start` after the ramp-up began.
    pub fn record(&mut self, since_start: Duration) {
        let i = usize::try_from(since_start.as_millis() / u128::from(self.bucket_ms.max(1)))
            .unwrap_or(usize::MAX);
        if let Some(b) = self.ios.get_mut(i) {
            *b += 1;
        }
    }

    /// Adds `other` (same shape) in.
    pub fn merge(&mut self, other: &Self) {
        if self.ios.len() < other.ios.len() {
            self.ios.resize(other.ios.len(), 0);
        }
        for (a, b) in self.ios.iter_mut().zip(&other.ios) {
            *a += b;
        }
    }

    /// Drops the empty buckets at the end (after a run ended early).
    pub fn trim(&mut self) {
        while self.ios.len() > self.ramp_buckets + 1 && self.ios.last() == Some(&0) {
            self.ios.pop();
        }
    }

    /// IOPS of each bucket.
    #[must_use]
    pub fn iops(&self) -> Vec<f64> {
        let secs = self.bucket_ms as f64 / 1000.0;
        self.ios.iter().map(|&n| n as f64 / secs).collect()
    }
}

/// One point of the latency distribution, for plots and JSON.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LatencyBucket {
    /// Upper bound of the bucket, microseconds.
    pub upto_us: f64,
    /// I/Os in the bucket.
    pub count: u64,
}

/// The latency distribution of `histogram` in buckets that double in width
/// from 1 µs (empty buckets at both ends left out).
#[must_use]
pub fn latency_buckets(histogram: &Histogram<u64>) -> Vec<LatencyBucket> {
    if histogram.is_empty() {
        return Vec::new();
    }
    let mut out: Vec<LatencyBucket> = histogram
        .iter_log(1000, 2.0)
        .map(|v| LatencyBucket {
            upto_us: v.value_iterated_to() as f64 / 1000.0,
            count: v.count_since_last_iteration(),
        })
        .collect();
    while out.first().is_some_and(|b| b.count == 0) {
        out.remove(0);
    }
    while out.last().is_some_and(|b| b.count == 0) {
        out.pop();
    }
    out
}

/// The results of one access specification.
#[derive(Debug, Clone, Serialize)]
pub struct SpecResult {
    /// The spec's name.
    pub spec: String,
    /// IOmeter's "Target Type" (the transport).
    pub target_type: String,
    /// Workers.
    pub workers: usize,
    /// Disks driven.
    pub disks: usize,
    /// Outstanding I/Os per disk per worker.
    pub outstanding_per_disk: usize,
    /// Ramp-up, seconds.
    pub ramp_seconds: f64,
    /// The measured window, seconds (shorter than asked when interrupted).
    pub run_seconds: f64,
    /// Stopped early (Ctrl-C).
    pub interrupted: bool,
    /// All disks.
    #[serde(flatten)]
    pub rates: Rates,
    /// Per disk.
    pub targets: Vec<TargetResult>,
    /// CPU.
    pub cpu: CpuUsage,
    /// The verifier's findings (verify mode only).
    pub verify: Option<VerifySummary>,
    /// IOPS over time.
    pub timeline: Timeline,
    /// Latency distribution of all I/Os.
    pub latency_distribution: Vec<LatencyBucket>,
    /// I/Os that never completed (still outstanding when the worker gave
    /// up waiting at the end): a broken stack.
    pub lost_ios: u64,
    /// The first failed I/Os, described (direction, size, offset, disk,
    /// and the status the stack gave).
    pub first_errors: Vec<String>,
}

impl SpecResult {
    /// Transactions per second (IOmeter: I/Os per second when every
    /// transaction is one I/O, as here).
    #[must_use]
    pub fn transactions_per_second(&self) -> f64 {
        self.rates.iops
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_of_a_known_distribution() {
        let mut counts = Counts::default();
        // 1..=10_000 microseconds, one each.
        for us in 1..=10_000u64 {
            counts.record(Direction::Read, 4096, Duration::from_micros(us), true);
        }
        let s = LatencySummary::of(&counts.read);
        let close = |got: f64, want: f64| (got - want).abs() <= want * 0.001 + 1e-9;
        assert!(close(s.percentiles.p50, 5.0), "p50 {}", s.percentiles.p50);
        assert!(close(s.percentiles.p90, 9.0), "p90 {}", s.percentiles.p90);
        assert!(close(s.percentiles.p99, 9.9), "p99 {}", s.percentiles.p99);
        assert!(
            close(s.percentiles.p99_9, 9.99),
            "p99.9 {}",
            s.percentiles.p99_9
        );
        assert!(
            close(s.percentiles.p99_99, 9.999),
            "p99.99 {}",
            s.percentiles.p99_99
        );
        // Exact mean and max (not the histogram's quantised ones).
        assert!((s.average_ms - 5.0005).abs() < 1e-9, "avg {}", s.average_ms);
        assert!((s.max_ms - 10.0).abs() < 1e-12);
    }

    #[test]
    fn tail_percentiles_see_rare_outliers() {
        let mut counts = Counts::default();
        for _ in 0..99_990 {
            counts.record(Direction::Write, 512, Duration::from_micros(100), true);
        }
        for _ in 0..10 {
            counts.record(Direction::Write, 512, Duration::from_millis(50), true);
        }
        let p = Percentiles::of(&counts.write.histogram);
        assert!((p.p99_9 - 0.1).abs() < 0.001, "{p:?}");
        // 10 in 100 000 is exactly 1e-4: p99.99 is still the fast value,
        // one more outlier would move it.
        assert!((p.p99_99 - 0.1).abs() < 0.001, "{p:?}");
        counts.record(Direction::Write, 512, Duration::from_millis(50), true);
        let p = Percentiles::of(&counts.write.histogram);
        assert!((p.p99_99 - 50.0).abs() < 0.1, "{p:?}");
    }

    #[test]
    fn rates_split_reads_writes_and_errors() {
        let mut counts = Counts::default();
        for _ in 0..300 {
            counts.record(Direction::Read, 4096, Duration::from_micros(10), true);
        }
        for _ in 0..100 {
            counts.record(Direction::Write, 4096, Duration::from_micros(30), true);
        }
        counts.record(Direction::Write, 4096, Duration::from_micros(30), false);
        let r = Rates::of(&counts, 2.0);
        assert_eq!((r.ios, r.read_ios, r.write_ios), (401, 300, 101));
        assert_eq!((r.errors, r.read_errors, r.write_errors), (1, 0, 1));
        assert!((r.iops - 200.5).abs() < 1e-9);
        assert!((r.read_iops - 150.0).abs() < 1e-9);
        // Failed I/Os move no bytes.
        assert_eq!(r.bytes_written, 100 * 4096);
        assert!((r.mbps - 400.0 * 4096.0 / 2.0 / 1e6).abs() < 1e-9);
        assert!((r.mibps - 400.0 * 4096.0 / 2.0 / 1048576.0).abs() < 1e-9);
        assert!((r.read_latency.average_ms - 0.01).abs() < 1e-9);
        assert!((r.write_latency.average_ms - 0.03).abs() < 1e-9);
        let all = (300.0 * 0.01 + 101.0 * 0.03) / 401.0;
        assert!((r.latency.average_ms - all).abs() < 1e-9);
        // An empty window has no rates.
        assert_eq!(Rates::of(&Counts::default(), 0.0).iops, 0.0);
    }

    #[test]
    fn merging_adds_up() {
        let mut a = Counts::default();
        let mut b = Counts::default();
        a.record(Direction::Read, 512, Duration::from_micros(5), true);
        b.record(Direction::Read, 512, Duration::from_micros(7), true);
        b.record(Direction::Write, 512, Duration::from_micros(9), false);
        a.merge(&b);
        assert_eq!(a.read.ios, 2);
        assert_eq!(a.read.histogram.len(), 2);
        assert_eq!(a.write.errors, 1);
        assert_eq!(a.read.latency_max_ns, 7000);
    }

    #[test]
    fn timeline_buckets_and_iops() {
        let mut t = Timeline::new(Duration::from_secs(1), Duration::from_secs(4));
        assert_eq!(t.bucket_ms, 100);
        assert_eq!(t.ramp_buckets, 10);
        t.record(Duration::from_millis(50));
        t.record(Duration::from_millis(99));
        t.record(Duration::from_millis(100));
        t.record(Duration::from_secs(3600)); // past the end: dropped
        assert_eq!(&t.ios[..2], &[2, 1]);
        assert_eq!(t.ios.len(), 50, "exactly the ramp and the run");
        assert!((t.iops()[0] - 20.0).abs() < 1e-9);
        t.trim();
        assert_eq!(t.ios.len(), 11, "trimmed to the ramp plus one");
        let long = Timeline::new(Duration::ZERO, Duration::from_secs(3600));
        assert_eq!(long.bucket_ms, 10_000, "capped at 10 s");
    }

    #[test]
    fn cpu_usage_per_io() {
        let a = CpuSample {
            user: 1.0,
            system: 0.5,
        };
        let b = CpuSample {
            user: 2.0,
            system: 1.0,
        };
        let u = a.usage_until(&b, 1.0, 1000, 2);
        assert!((u.seconds - 1.5).abs() < 1e-12);
        assert!((u.us_per_io - 1500.0).abs() < 1e-9);
        assert!((u.utilization_percent - 75.0).abs() < 1e-9);
        // The real clock moves forward when we burn CPU.
        let before = CpuSample::now();
        let mut x = 0u64;
        for i in 0..20_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        let after = CpuSample::now();
        assert!(after.user + after.system > before.user + before.system);
    }

    #[test]
    fn latency_buckets_cover_every_io() {
        let mut counts = Counts::default();
        for us in [3u64, 3, 40, 41, 900, 5000] {
            counts.record(Direction::Read, 512, Duration::from_micros(us), true);
        }
        let buckets = latency_buckets(&counts.read.histogram);
        assert_eq!(buckets.iter().map(|b| b.count).sum::<u64>(), 6);
        assert!(buckets.first().unwrap().upto_us <= 4.0 + 1e-9);
        assert!(buckets.last().unwrap().upto_us >= 5000.0);
    }

    mod properties {
        use super::*;
        use proptest::prelude::{ProptestConfig, prop_assert, prop_assert_eq, proptest};

        fn cases() -> u32 {
            std::env::var("KVBENCH_PROPTEST_CASES")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(64)
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(cases()))]

            /// Every percentile agrees with the exact nearest-rank value of
            /// the sorted samples to within the histogram's 3 significant
            /// digits; the mean and maximum are exact.
            #[test]
            fn percentiles_match_the_sorted_samples(
                samples in proptest::collection::vec(1u64..50_000_000, 1..2000),
            ) {
                let mut counts = Counts::default();
                for &ns in &samples {
                    counts.record(Direction::Read, 512, Duration::from_nanos(ns), true);
                }
                let mut sorted = samples.clone();
                sorted.sort_unstable();
                let exact = |q: f64| {
                    // Nearest rank: the smallest value with at least q of
                    // the samples at or below it.
                    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
                    sorted[rank - 1] as f64 / 1e6
                };
                let s = LatencySummary::of(&counts.read);
                let p = s.percentiles;
                for (got, q) in [(p.p50, 0.5), (p.p90, 0.9), (p.p99, 0.99), (p.p99_9, 0.999), (p.p99_99, 0.9999)] {
                    let want = exact(q);
                    prop_assert!((got - want).abs() <= want * 0.001 + 1e-6, "q {}: {} vs {}", q, got, want);
                }
                let mean = samples.iter().map(|&v| v as f64).sum::<f64>() / samples.len() as f64 / 1e6;
                prop_assert!((s.average_ms - mean).abs() <= mean * 1e-9 + 1e-12);
                prop_assert_eq!(s.max_ms, *sorted.last().unwrap() as f64 / 1e6);
            }
        }
    }
}
