//! Full stack under a kvbench-shaped load, threaded (the fabric's device
//! thread, the host's DPC and worker threads, the target's threads and the
//! submitting thread all run at once): 16 outstanding 4 KiB random reads
//! and writes (70/30), then 64 KiB sequential reads and writes, every byte
//! checked against the target's medium, on two LUNs at once (two
//! submitting threads on one channel). On a loss-free fabric every
//! request must succeed exactly once and no connection may end: a
//! sporadic `SRB_STATUS_BUS_RESET` or a request that never completes is a
//! broken contract somewhere between StorPort and the HCA.
//!
//! Rounds: `SRP_LOAD_ROUNDS` (default 1), I/Os per 4 KiB round
//! `SRP_LOAD_IOS` (default 1500).

use kverbs::irql::Passive;
use kverbs::platform::host::VerifierAllocator;
use kverbs_tests::{Io, IoDone, Op, Stack, StackConfig, Workload, env_count};
use storport_srp::storport::SrbStatus;
use storport_srp::storport::host::SgShape;

#[global_allocator]
static ALLOCATOR: VerifierAllocator = VerifierAllocator;

/// kvbench's outstanding I/Os per disk.
const DEPTH: usize = 16;

fn all_ok(what: &str, done: &[IoDone]) {
    for d in done {
        assert_eq!(
            (d.outcome.status.base(), d.outcome.completions),
            (SrbStatus::SUCCESS, 1),
            "{what}: {d:?}"
        );
    }
}

/// `n` sequential I/Os of `bytes` on `lun` from block 0, wrapping.
fn sequential(s: &Stack, w: &mut Workload, lun: u8, op: Op, n: usize, bytes: u32) -> Vec<Io> {
    let block_len = s.block_len(0, lun);
    let blocks = (bytes / block_len).max(1);
    let span = (s.blocks(0, lun) / u64::from(blocks)).max(1);
    (0..n)
        .map(|i| Io {
            target: 0,
            lun,
            op,
            lba: (i as u64 % span) * u64::from(blocks),
            blocks,
            block_len,
            shape: SgShape::Contiguous,
            data: match op {
                Op::Write => w.bytes((blocks * block_len) as usize),
                Op::Read => Vec::new(),
            },
        })
        .collect()
}

/// kvbench's access specifications, `rounds` times, on one LUN.
fn kvbench_suite(s: &Stack, lun: u8, rounds: usize, n: usize, p: &Passive<'_>) {
    let mut w = Workload::new(58 + u64::from(lun));
    let (block_len, total) = (s.block_len(0, lun), s.blocks(0, lun));
    for round in 0..rounds {
        let random = w.ios(n, 0, lun, block_len, total, 4096, 4096, 0.7);
        all_ok(
            &format!("LUN {lun} round {round}: 4K random 70/30"),
            &s.run_ios(&random, DEPTH, p),
        );
        for op in [Op::Read, Op::Write] {
            let seq = sequential(s, &mut w, lun, op, n / 8, 64 << 10);
            all_ok(
                &format!("LUN {lun} round {round}: 64K sequential {op:?}"),
                &s.run_ios(&seq, DEPTH, p),
            );
        }
    }
}

#[test]
fn kvbench_shaped_load_completes_every_request_once_without_a_reset() {
    let rounds = env_count("SRP_LOAD_ROUNDS", 1);
    let n = env_count("SRP_LOAD_IOS", 1500);
    Stack::run(&StackConfig::default(), |s, p| {
        // Two submitters (one per LUN, as two kvbench workers) share the
        // channel with the completion DPCs.
        std::thread::scope(|scope| {
            let other = scope.spawn(|| {
                s.platform
                    .run_passive(|p| kvbench_suite(s, 1, rounds, n, p))
            });
            kvbench_suite(s, 0, rounds, n, p);
            if let Err(e) = other.join() {
                std::panic::resume_unwind(e);
            }
        });
        let stats = s.stats(0, p);
        assert_eq!(
            (
                stats.transport_failures,
                stats.protocol_errors,
                stats.stale_responses,
                stats.dropped_responses,
            ),
            (0, 0, 0, 0),
            "the connection must survive a loss-free load: {stats:?}"
        );
        assert_eq!(stats.fenced_by_flush, 0, "{stats:?}");
    });
}
