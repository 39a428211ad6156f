//! Single-thread memcpy bandwidth (not a test): the yardstick for the
//! full stack's sequential bandwidth, measured in the same run as kvbench
//! (`tools/perf/run.sh`), so both see the same machine moment.
//!
//! Copies `--chunk` bytes at a time (default 128 KiB, the transfer size of
//! the sequential-read goal) from one 64 MiB buffer to another — larger
//! than the caches, as the stack's data buffers and RAM disk are — for
//! `--secs` seconds (default 1), and prints
//! `memcpy_mb_s=.. chunk=.. bytes=..` (MB = 10^6 bytes, as kvbench's MB/s).

use std::hint::black_box;
use std::time::{Duration, Instant};

fn arg(name: &str, default: u64) -> u64 {
    let mut it = std::env::args();
    while let Some(a) = it.next() {
        if a == name {
            return it.next().and_then(|v| v.parse().ok()).unwrap_or(default);
        }
    }
    default
}

fn main() {
    const BUFFER: usize = 64 << 20;
    let chunk = usize::try_from(arg("--chunk", 128 << 10))
        .unwrap_or(128 << 10)
        .clamp(64, BUFFER);
    let secs = arg("--secs", 1).max(1);
    // Written once, so every page is mapped before the clock starts.
    let src: Vec<u8> = (0..BUFFER).map(|i| i as u8).collect();
    let mut dst = vec![1u8; BUFFER];
    let chunks = BUFFER / chunk;
    let run = Duration::from_secs(secs);
    let start = Instant::now();
    let mut copied = 0u64;
    let mut i = 0usize;
    while start.elapsed() < run {
        // 64 chunks between clock reads.
        for _ in 0..64 {
            let at = (i % chunks) * chunk;
            dst[at..at + chunk].copy_from_slice(&src[at..at + chunk]);
            i += 1;
        }
        copied += 64 * chunk as u64;
        black_box(&mut dst);
    }
    let elapsed = start.elapsed().as_secs_f64();
    println!(
        "memcpy_mb_s={:.0} chunk={chunk} bytes={copied}",
        copied as f64 / elapsed / 1e6
    );
}
