//! The benchmark over the StorPort model and the miniport core (the
//! loopback transport to RAM-disk SCSI targets): disks are discovered,
//! verified I/O runs clean through every buffer shape and block size, a
//! block corrupted on the target is caught, and the stack's own checks
//! (the StorPort model, the kverbs verifier with its allocator installed)
//! stay silent.

use std::sync::Arc;
use std::time::Duration;

use kverbs::platform::host::VerifierAllocator;
use kverbs_tools::bench::Backend;
use kverbs_tools::bench::engine::{
    BenchError, CancelToken, Observer, RunConfig, Silent, run_suite,
};
use kverbs_tools::bench::model::{LoopbackOptions, loopback_backend};
use kverbs_tools::bench::spec::{AccessSpec, builtin_spec};
use kverbs_tools::bench::verify::Found;
use kverbs_tools::scsi_target::{BlockSize, ScsiTarget};
use storport_srp::storport::host::SgShape;

// Any allocation at DISPATCH_LEVEL anywhere in the stack (the model, the
// core, the loopback transport, the benchmark's completion routing) is a
// verifier violation, reported by `ModelBackend::finish`.
#[global_allocator]
static ALLOCATOR: VerifierAllocator = VerifierAllocator;

fn options(block_size: BlockSize, sg_shape: SgShape) -> LoopbackOptions {
    LoopbackOptions {
        targets: 1,
        luns: 2,
        lun_bytes: 8 << 20,
        block_size,
        sg_shape,
        ..LoopbackOptions::default()
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
fn disks_are_discovered_and_verified_io_runs_clean() {
    let backend = loopback_backend(&options(BlockSize::B512, SgShape::Contiguous)).unwrap();
    let disks = backend.targets();
    assert_eq!(disks.len(), 2, "both LUNs answer READ CAPACITY(16)");
    assert_eq!(disks[0].name, "t0 lun0");
    assert_eq!(disks[1].name, "t0 lun1");
    assert!(
        disks
            .iter()
            .all(|d| d.capacity == 8 << 20 && d.block_size == 512)
    );
    assert_eq!(backend.target_type(), "LOOPBACK");
    let config = RunConfig {
        verify: true,
        workers: 2,
        outstanding: 4,
        targets: vec![0, 1],
        max_bytes: Some(2 << 20),
        ..quick(300)
    };
    let specs = [
        builtin_spec("4k-random-70-30").unwrap(),
        builtin_spec("64k-seq-write").unwrap(),
        builtin_spec("file-server").unwrap(),
    ];
    let suite = run_suite(&backend, &specs, &config, &CancelToken::new(), &Silent).unwrap();
    let v = suite.verify.clone().unwrap();
    assert_eq!(v.mismatches, 0, "{:?}", v.first_mismatches);
    assert!(v.sectors_checked > 100, "{v:?}");
    for r in &suite.results {
        assert!(r.rates.ios > 0, "{}: no I/O", r.spec);
        assert_eq!(r.rates.errors + r.lost_ios, 0, "{}", r.spec);
        assert_eq!(r.targets.len(), 2);
    }
    let violations = backend.finish();
    assert!(violations.is_empty(), "{violations:#?}");
}

#[test]
fn odd_buffer_shapes_and_4k_blocks_keep_data_intact() {
    for (block, shape) in [
        (BlockSize::B4096, SgShape::Odd { seed: 3 }),
        (BlockSize::B512, SgShape::Pages),
    ] {
        let backend = loopback_backend(&options(block, shape)).unwrap();
        assert!(
            backend
                .targets()
                .iter()
                .all(|d| d.block_size == block.bytes())
        );
        let config = RunConfig {
            verify: true,
            outstanding: 6,
            max_bytes: Some(1 << 20),
            ..quick(250)
        };
        let specs = [
            builtin_spec("4k-random-70-30").unwrap(),
            builtin_spec("64k-seq-read").unwrap(),
        ];
        let suite = run_suite(&backend, &specs, &config, &CancelToken::new(), &Silent).unwrap();
        let v = suite.verify.clone().unwrap();
        assert_eq!(
            v.mismatches, 0,
            "{block:?} {shape:?}: {:?}",
            v.first_mismatches
        );
        assert!(v.sectors_checked > 0);
        assert!(!suite.had_errors(), "{block:?} {shape:?}");
        if block == BlockSize::B4096 {
            // 512-byte I/O does not fit 4K blocks: refused up front.
            match run_suite(
                &backend,
                &[builtin_spec("512b-seq-read").unwrap()],
                &config,
                &CancelToken::new(),
                &Silent,
            ) {
                Err(BenchError::Config(m)) => assert!(m.contains("block size 4096"), "{m}"),
                other => panic!("{other:?}"),
            }
        }
        let violations = backend.finish();
        assert!(violations.is_empty(), "{violations:#?}");
    }
}

/// Overwrites one block on the target itself, behind the initiator's
/// back, when the spec starts (after the verify pattern was written).
struct CorruptOnTarget {
    target: Arc<ScsiTarget>,
    lba: u64,
}

impl Observer for CorruptOnTarget {
    fn spec_started(&self, _index: usize, _total: usize, _spec: &AccessSpec) {
        let lu = self.target.lun(0).unwrap();
        lu.write_blocks(self.lba, &[0xEE; 512]).unwrap();
    }
}

#[test]
fn a_block_corrupted_on_the_target_is_caught() {
    let backend = loopback_backend(&options(BlockSize::B512, SgShape::Contiguous)).unwrap();
    let target = backend.kept::<Vec<Arc<ScsiTarget>>>().unwrap()[0].clone();
    let observer = CorruptOnTarget { target, lba: 37 };
    let config = RunConfig {
        verify: true,
        outstanding: 4,
        max_bytes: Some(128 << 10),
        ..quick(200)
    };
    let spec = builtin_spec("512b-seq-read").unwrap();
    let suite = run_suite(&backend, &[spec], &config, &CancelToken::new(), &observer).unwrap();
    assert!(suite.verify_failed());
    let v = suite.verify.clone().unwrap();
    let m = v.first_mismatches[0];
    assert_eq!((m.target, m.sector), (0, 37));
    assert!(
        matches!(m.found, Found::NoPattern { first_word } if first_word == 0xEEEE_EEEE_EEEE_EEEE)
    );
    let violations = backend.finish();
    assert!(violations.is_empty(), "{violations:#?}");
}
