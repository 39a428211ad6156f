//! Writing results: a table for people, CSV with IOmeter's result columns,
//! and JSON with everything.

use std::fmt::Write as _;
use std::io::Write;

use super::engine::SuiteResult;
use super::stats::{Rates, SpecResult};

/// The CSV header: IOmeter's result columns that apply, in IOmeter's
/// order, then the percentiles and verify counts IOmeter does not have.
/// Times are milliseconds, as IOmeter reports them.
pub const CSV_COLUMNS: &[&str] = &[
    "Target Type",
    "Target Name",
    "Access Specification Name",
    "# Managers",
    "# Workers",
    "# Disks",
    "IOps",
    "Read IOps",
    "Write IOps",
    "MiBps (Binary)",
    "Read MiBps (Binary)",
    "Write MiBps (Binary)",
    "MBps (Decimal)",
    "Read MBps (Decimal)",
    "Write MBps (Decimal)",
    "Transactions per Second",
    "Average Response Time",
    "Average Read Response Time",
    "Average Write Response Time",
    "Maximum Response Time",
    "Maximum Read Response Time",
    "Maximum Write Response Time",
    "Errors",
    "Read Errors",
    "Write Errors",
    "Bytes Read",
    "Bytes Written",
    "Read I/Os",
    "Write I/Os",
    "% CPU Utilization",
    "% User Time",
    "% Privileged Time",
    "Outstanding I/Os per Disk",
    "Ramp Up Time (s)",
    "Run Time (s)",
    "50th Percentile Response Time",
    "90th Percentile Response Time",
    "99th Percentile Response Time",
    "99.9th Percentile Response Time",
    "99.99th Percentile Response Time",
    "CPU Time per I/O (us)",
    "Lost I/Os",
    "Verify Mismatches",
    "Interrupted",
];

fn f(v: f64) -> String {
    format!("{v:.4}")
}

fn rate_fields(r: &Rates) -> [String; 23] {
    [
        f(r.iops),
        f(r.read_iops),
        f(r.write_iops),
        f(r.mibps),
        f(r.read_mibps),
        f(r.write_mibps),
        f(r.mbps),
        f(r.read_mbps),
        f(r.write_mbps),
        f(r.iops),
        f(r.latency.average_ms),
        f(r.read_latency.average_ms),
        f(r.write_latency.average_ms),
        f(r.latency.max_ms),
        f(r.read_latency.max_ms),
        f(r.write_latency.max_ms),
        r.errors.to_string(),
        r.read_errors.to_string(),
        r.write_errors.to_string(),
        r.bytes_read.to_string(),
        r.bytes_written.to_string(),
        r.read_ios.to_string(),
        r.write_ios.to_string(),
    ]
}

fn csv_row(
    result: &SpecResult,
    target_type: &str,
    target_name: &str,
    disks: usize,
    rates: &Rates,
    whole: bool,
) -> Vec<String> {
    let cpu_field = |v: f64| if whole { f(v) } else { String::new() };
    let wall = result.run_seconds.max(f64::MIN_POSITIVE);
    let processors = std::thread::available_parallelism().map_or(1, std::num::NonZero::get) as f64;
    let share = |secs: f64| 100.0 * secs / (wall * processors);
    let mut row = vec![
        target_type.to_owned(),
        target_name.to_owned(),
        result.spec.clone(),
        "1".to_owned(),
        result.workers.to_string(),
        disks.to_string(),
    ];
    row.extend(rate_fields(rates));
    row.extend([
        cpu_field(result.cpu.utilization_percent),
        cpu_field(share(result.cpu.user_seconds)),
        cpu_field(share(result.cpu.system_seconds)),
        result.outstanding_per_disk.to_string(),
        f(result.ramp_seconds),
        f(result.run_seconds),
        f(rates.latency.percentiles.p50),
        f(rates.latency.percentiles.p90),
        f(rates.latency.percentiles.p99),
        f(rates.latency.percentiles.p99_9),
        f(rates.latency.percentiles.p99_99),
        cpu_field(result.cpu.us_per_io),
        if whole {
            result.lost_ios.to_string()
        } else {
            String::new()
        },
        if whole {
            result
                .verify
                .as_ref()
                .map_or(String::new(), |v| v.mismatches.to_string())
        } else {
            String::new()
        },
        result.interrupted.to_string(),
    ]);
    row
}

/// Writes the suite as CSV: per spec an `ALL` row (every disk), then one
/// row per disk (IOmeter's layout of a results file, without the manager
/// and worker rows).
///
/// # Errors
/// The writer's error.
pub fn write_csv(suite: &SuiteResult, out: impl Write) -> Result<(), csv::Error> {
    let mut w = csv::Writer::from_writer(out);
    w.write_record(CSV_COLUMNS)?;
    for result in &suite.results {
        w.write_record(csv_row(
            result,
            "ALL",
            "All",
            result.disks,
            &result.rates,
            true,
        ))?;
        for t in &result.targets {
            w.write_record(csv_row(
                result,
                &suite.target_type,
                &t.name,
                1,
                &t.rates,
                false,
            ))?;
        }
    }
    w.flush()?;
    Ok(())
}

/// Writes the suite as pretty JSON (every figure, the timelines and the
/// latency distributions).
///
/// # Errors
/// The writer's error.
pub fn write_json(suite: &SuiteResult, out: impl Write) -> Result<(), serde_json::Error> {
    serde_json::to_writer_pretty(out, suite)
}

/// The table people read: one line per spec, then what went wrong.
#[must_use]
pub fn table(suite: &SuiteResult) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "kvbench over {}", suite.backend);
    let disks: Vec<String> = suite
        .targets
        .iter()
        .map(|t| {
            format!(
                "{} ({} MiB, {} B blocks)",
                t.name,
                t.capacity >> 20,
                t.block_size
            )
        })
        .collect();
    let c = &suite.config;
    let _ = writeln!(
        s,
        "{} worker(s) x {} disk(s) [{}], {} outstanding per disk per worker, ramp {:.1} s, run {:.1} s{}",
        c.workers,
        suite.targets.len(),
        disks.join(", "),
        c.outstanding,
        c.ramp.as_secs_f64(),
        c.run.as_secs_f64(),
        if c.verify { ", verifying data" } else { "" }
    );
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "{:<26} {:>9} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9} {:>6} {:>7}",
        "access specification",
        "IOPS",
        "MB/s",
        "MiB/s",
        "avg us",
        "p50 us",
        "p99 us",
        "p99.9 us",
        "p99.99",
        "max us",
        "errors",
        "CPU us"
    );
    let us = |ms: f64| ms * 1000.0;
    for r in &suite.results {
        let l = &r.rates.latency;
        let mut name = r.spec.clone();
        if name.chars().count() > 26 {
            name = name.chars().take(25).collect::<String>() + "~";
        }
        let _ = writeln!(
            s,
            "{:<26} {:>9.0} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>9.1} {:>6} {:>7.1}{}",
            name,
            r.rates.iops,
            r.rates.mbps,
            r.rates.mibps,
            us(l.average_ms),
            us(l.percentiles.p50),
            us(l.percentiles.p99),
            us(l.percentiles.p99_9),
            us(l.percentiles.p99_99),
            us(l.max_ms),
            r.rates.errors + r.lost_ios,
            r.cpu.us_per_io,
            if r.interrupted { "  (interrupted)" } else { "" }
        );
    }
    let _ = writeln!(
        s,
        "(latency in microseconds, from submission to the completion the stack reported; CPU us = process CPU time per I/O, \
         initiator, target and benchmark together)"
    );
    if suite.interrupted {
        let _ = writeln!(
            s,
            "\nInterrupted: the last spec's figures cover the time until Ctrl-C."
        );
    }
    for r in &suite.results {
        if r.rates.errors > 0 {
            let _ = writeln!(
                s,
                "{}: {} I/O(s) failed; the first:",
                r.spec, r.rates.errors
            );
            for e in &r.first_errors {
                let _ = writeln!(s, "  {e}");
            }
        }
        if r.lost_ios > 0 {
            let _ = writeln!(
                s,
                "{}: {} I/O(s) never completed (the stack lost them)",
                r.spec, r.lost_ios
            );
        }
    }
    if let Some(v) = &suite.verify {
        let _ = writeln!(s);
        if v.mismatches == 0 {
            let _ = writeln!(
                s,
                "Verify: {} sectors checked, all intact ({} of unknown content skipped).",
                v.sectors_checked, v.sectors_skipped
            );
        } else {
            let _ = writeln!(
                s,
                "VERIFY FAILED: {} of {} sectors checked did not hold what was written. First {}:",
                v.mismatches,
                v.sectors_checked,
                v.first_mismatches.len()
            );
            for m in &v.first_mismatches {
                let _ = writeln!(s, "  {m}");
            }
        }
    }
    s
}
