//! The benchmark end to end over the full SRP stack: StorPort model →
//! miniport → SRP engine → kverbs → software HCA ↔ software HCA → software
//! SRP target → RAM disk. A short verified run keeps every byte intact with
//! no error, a block corrupted on the target's disk is caught, and the
//! teardown through StorPort finds no broken promise (connections, target
//! protocol counters, CM, StorPort model, kverbs verifier with its
//! allocator installed).

use std::time::Duration;

use kverbs::platform::host::VerifierAllocator;
use kverbs_tools::bench::Backend;
use kverbs_tools::bench::engine::{CancelToken, Observer, RunConfig, Silent, run_suite};
use kverbs_tools::bench::spec::{AccessSpec, builtin_spec};
use kverbs_tools::bench::srp::{SrpOptions, SrpParts, srp_backend};
use kverbs_tools::bench::verify::Found;
use kverbs_tools::scsi_target::BlockSize;
use storport_srp::storport::host::SgShape;

// Any allocation at DISPATCH_LEVEL anywhere in the stack is a verifier
// violation, reported by `ModelBackend::finish`.
#[global_allocator]
static ALLOCATOR: VerifierAllocator = VerifierAllocator;

fn options() -> SrpOptions {
    SrpOptions {
        luns: 2,
        lun_bytes: 8 << 20,
        ..SrpOptions::default()
    }
}

fn quick(run_ms: u64) -> RunConfig {
    RunConfig {
        ramp: Duration::from_millis(50),
        run: Duration::from_millis(run_ms),
        ..RunConfig::default()
    }
}

#[test]
fn a_verified_run_over_the_full_srp_stack_is_clean() {
    let backend = srp_backend(&SrpOptions {
        sg_shape: SgShape::Pages,
        ..options()
    })
    .unwrap();
    assert_eq!(backend.target_type(), "SRP");
    let disks = backend.targets();
    assert_eq!(disks.len(), 2, "both LUNs of the SRP target answer");
    assert!(
        disks
            .iter()
            .all(|d| d.capacity == 8 << 20 && d.block_size == 512)
    );
    // One worker, reads after a verified prefill (writes): with two
    // submitting threads, and for writes, the SRP stack currently completes
    // a few commands SRB_STATUS_BUS_RESET with no failure, reset or task
    // management behind it (an open issue of the engine, reported with
    // kvbench); this test judges the benchmark's path over the full stack.
    let config = RunConfig {
        verify: true,
        workers: 1,
        outstanding: 4,
        targets: vec![0, 1],
        max_bytes: Some(1 << 20),
        ..quick(400)
    };
    let specs = [
        builtin_spec("4k-random-read").unwrap(),
        builtin_spec("64k-seq-read").unwrap(),
    ];
    let suite = run_suite(&backend, &specs, &config, &CancelToken::new(), &Silent).unwrap();
    let v = suite.verify.clone().unwrap();
    assert_eq!(v.mismatches, 0, "{:?}", v.first_mismatches);
    assert!(v.sectors_checked > 0);
    for r in &suite.results {
        assert!(r.rates.ios > 0, "{}: no I/O", r.spec);
        assert_eq!(r.lost_ios, 0, "{}", r.spec);
        assert_eq!(r.rates.errors, 0, "{}: {:?}", r.spec, r.first_errors);
    }
    // The I/O really went over SRP: the target executed the commands.
    let parts = backend.kept::<SrpParts>().unwrap();
    let target = parts.targets[0].as_ref().unwrap();
    let c = target.counters();
    let ios: u64 = suite.results.iter().map(|r| r.rates.ios).sum();
    let commands: u64 = c.scsi_ops.iter().map(|&(_, n)| n).sum();
    assert!(commands >= ios, "target commands {commands} vs I/Os {ios}");
    assert!(parts.add_targets[0].contains("ch_count=1"));
    let violations = backend.finish();
    assert!(violations.is_empty(), "{violations:#?}");
}

/// Overwrites one block on the SRP target's disk when the spec starts.
struct CorruptOnTarget<'a> {
    parts: &'a SrpParts,
    lba: u64,
}

impl Observer for CorruptOnTarget<'_> {
    fn spec_started(&self, _index: usize, _total: usize, _spec: &AccessSpec) {
        let target = self.parts.targets[0].as_ref().unwrap();
        let lu = target.scsi().lun(0).unwrap();
        lu.write_blocks(self.lba, &[0u8; 4096]).unwrap();
    }
}

#[test]
fn a_block_corrupted_on_the_srp_target_is_caught() {
    let backend = srp_backend(&SrpOptions {
        block_size: BlockSize::B4096,
        luns: 1,
        ..options()
    })
    .unwrap();
    let observer = CorruptOnTarget {
        parts: backend.kept::<SrpParts>().unwrap(),
        lba: 5,
    };
    let config = RunConfig {
        verify: true,
        outstanding: 4,
        max_bytes: Some(64 << 10),
        ..quick(300)
    };
    let spec = AccessSpec::single(
        "seq read",
        kverbs_tools::bench::AccessPart::new(4096, 100, 0),
    );
    let suite = run_suite(&backend, &[spec], &config, &CancelToken::new(), &observer).unwrap();
    assert!(suite.verify_failed());
    let v = suite.verify.clone().unwrap();
    let m = v.first_mismatches[0];
    assert_eq!(
        (m.target, m.sector),
        (0, 5 * 8),
        "LBA 5 of 4K blocks is sector 40"
    );
    assert_eq!(m.found, Found::NoPattern { first_word: 0 });
    let violations = backend.finish();
    assert!(violations.is_empty(), "{violations:#?}");
}
