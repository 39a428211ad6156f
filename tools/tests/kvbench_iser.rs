//! The benchmark end to end over the full iSER stack: StorPort model →
//! miniport → iSER engine → kverbs → software HCA ↔ software HCA → software
//! iSER target → RAM disk. A short verified run keeps every byte intact
//! with no error, a block corrupted on the target's disk is caught, and the
//! teardown through StorPort finds no broken promise (transport failures,
//! connections, the target's protocol counters, CM, StorPort model, kverbs
//! verifier with its allocator installed).

use std::time::Duration;

use kverbs::platform::host::VerifierAllocator;
use kverbs_tools::bench::Backend;
use kverbs_tools::bench::engine::{CancelToken, Observer, RunConfig, Silent, run_suite};
use kverbs_tools::bench::iser::{IserOptions, IserParts, iser_backend};
use kverbs_tools::bench::spec::{AccessSpec, builtin_spec};
use kverbs_tools::bench::verify::Found;
use kverbs_tools::scsi_target::BlockSize;
use storport_srp::storport::host::SgShape;

// Any allocation at DISPATCH_LEVEL anywhere in the stack is a verifier
// violation, reported by `ModelBackend::finish`.
#[global_allocator]
static ALLOCATOR: VerifierAllocator = VerifierAllocator;

fn options() -> IserOptions {
    IserOptions {
        luns: 2,
        lun_bytes: 8 << 20,
        ..IserOptions::default()
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
fn a_verified_run_over_the_full_iser_stack_is_clean() {
    let backend = iser_backend(&IserOptions {
        sg_shape: SgShape::Pages,
        ..options()
    })
    .unwrap();
    assert_eq!(backend.target_type(), "iSER");
    let disks = backend.targets();
    assert_eq!(disks.len(), 2, "both LUNs of the iSER target answer");
    assert!(
        disks
            .iter()
            .all(|d| d.capacity == 8 << 20 && d.block_size == 512)
    );
    let config = RunConfig {
        verify: true,
        workers: 2,
        outstanding: 8,
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
    // The I/O really went over iSER: the target received the commands and
    // moved the data by RDMA.
    let parts = backend.kept::<IserParts>().unwrap();
    let target = parts.targets[0].as_ref().unwrap();
    let c = target.counters();
    let ios: u64 = suite.results.iter().map(|r| r.rates.ios).sum();
    assert!(
        c.scsi_commands >= ios,
        "target commands {} vs I/Os {ios}",
        c.scsi_commands
    );
    assert!(c.rdma_writes > 0 && c.send_with_invalidate > 0, "{c:?}");
    assert!(parts.records[0].contains("node.session.iscsi.ImmediateData = Yes"));
    let violations = backend.finish();
    assert!(violations.is_empty(), "{violations:#?}");
}

/// Overwrites one block on the iSER target's disk when the spec starts.
struct CorruptOnTarget<'a> {
    parts: &'a IserParts,
    lba: u64,
}

impl Observer for CorruptOnTarget<'_> {
    fn spec_started(&self, _index: usize, _total: usize, _spec: &AccessSpec) {
        let target = self.parts.targets[0].as_ref().unwrap();
        let scsi = target.scsi();
        let lu = scsi.lun(0).unwrap();
        lu.write_blocks(self.lba, &[0u8; 4096]).unwrap();
    }
}

#[test]
fn a_block_corrupted_on_the_iser_target_is_caught() {
    let backend = iser_backend(&IserOptions {
        block_size: BlockSize::B4096,
        luns: 1,
        ..options()
    })
    .unwrap();
    let observer = CorruptOnTarget {
        parts: backend.kept::<IserParts>().unwrap(),
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
