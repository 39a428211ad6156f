//! Full stack, data integrity: transfer sizes 512 B – 1 MiB, odd
//! alignments and scatter/gather shapes, queue depths 1 – 256, random
//! read/write mixes, several channels, immediate data on and off — every
//! byte checked against the target's medium.

use kverbs::platform::host::VerifierAllocator;
use kverbs_tests::{Io, Op, Stack, StackConfig, TargetSetup, Workload, env_count};
use storport_srp::srp::SrpConfig;
use storport_srp::storport::SrbStatus;
use storport_srp::storport::host::SgShape;

#[global_allocator]
static ALLOCATOR: VerifierAllocator = VerifierAllocator;

fn ok(done: &kverbs_tests::IoDone) {
    assert_eq!(done.outcome.status.base(), SrbStatus::SUCCESS, "{done:?}");
    assert_eq!(done.outcome.completions, 1);
}

/// A target with room for odd shapes: 255 descriptors per command, 2048
/// scatter/gather elements per request.
fn wide() -> TargetSetup {
    TargetSetup::standard().keys("cmd_sg_entries=255,sg_tablesize=2048")
}

#[test]
fn sizes_and_shapes_at_depth_one() {
    let config = StackConfig {
        targets: vec![wide()],
        ..StackConfig::default()
    };
    Stack::run(&config, |s, p| {
        let mut w = Workload::new(11);
        let sizes = [
            512u32,
            1024,
            4096,
            4608,
            8192,
            65536,
            65536 + 512,
            262_144,
            1 << 20,
        ];
        let shapes = [
            SgShape::Contiguous,
            SgShape::Pages,
            SgShape::Odd { seed: 3 },
            SgShape::Odd { seed: 99 },
        ];
        let mut lba = 0u64;
        for &size in &sizes {
            for &shape in &shapes {
                let blocks = size / 512;
                let data = w.bytes(size as usize);
                let write = Io {
                    target: 0,
                    lun: 0,
                    op: Op::Write,
                    lba,
                    blocks,
                    block_len: 512,
                    shape,
                    data,
                };
                let read = Io {
                    op: Op::Read,
                    data: Vec::new(),
                    shape: match shape {
                        SgShape::Odd { seed } => SgShape::Odd { seed: seed + 1 },
                        other => other,
                    },
                    ..write.clone()
                };
                let done = s.run_ios(&[write.clone(), read], 1, p);
                for d in &done {
                    ok(d);
                }
                assert_eq!(done[1].data, write.data, "size {size} shape {shape:?}");
                lba = (lba + u64::from(blocks)) % (32768 - 2048);
            }
        }
        let st = s.stats(0, p);
        assert!(
            st.immediate_writes > 0,
            "small writes went as immediate data"
        );
        assert!(st.direct_commands > 0 && st.indirect_commands > 0, "{st:?}");
    });
}

#[test]
fn four_kib_blocks_and_large_cdbs() {
    Stack::run(&StackConfig::default(), |s, p| {
        let mut w = Workload::new(5);
        // LUN 1 has 4 KiB blocks; an LBA above 32 bits needs no 16-byte
        // CDB here, but 70000 blocks do.
        let data = w.bytes(4096 * 3);
        let o = s.write(0, 1, 4090, &data, SgShape::Pages, p);
        assert_eq!(o.status.base(), SrbStatus::SUCCESS, "{o:?}");
        let (o, back) = s.read(0, 1, 4090, 3, SgShape::Odd { seed: 1 }, p);
        assert_eq!(o.status.base(), SrbStatus::SUCCESS, "{o:?}");
        assert_eq!(back, data);
        // Past the end: CHECK CONDITION with sense through autosense.
        let (o, _) = s.read(0, 1, 4095, 2, SgShape::Contiguous, p);
        assert_eq!(o.status.base(), SrbStatus::ERROR, "{o:?}");
        assert!(o.status.autosense_valid(), "{o:?}");
        assert_eq!(o.scsi_status, 0x02);
        assert_eq!(
            o.sense.get(12),
            Some(&0x21),
            "LBA out of range: {:?}",
            o.sense
        );
    });
}

fn mix(stack_config: &StackConfig, seed: u64, n: usize, depth: usize, max_bytes: u32) {
    Stack::run(stack_config, |s, p| {
        let mut w = Workload::new(seed);
        let targets = u8::try_from(s.targets.len()).unwrap();
        let mut ios = Vec::new();
        for t in 0..targets {
            ios.extend(w.ios(
                n / usize::from(targets),
                t,
                0,
                512,
                32768,
                512,
                max_bytes,
                0.5,
            ));
        }
        // Interleave the targets.
        ios.sort_by_key(|io| (io.lba % 7, io.target));
        let done = s.run_ios(&ios, depth, p);
        for d in &done {
            ok(d);
        }
        for t in 0..targets {
            let st = s.stats(t, p);
            assert_eq!(st.protocol_errors + st.stale_responses, 0, "{st:?}");
        }
    });
}

#[test]
fn random_mix_at_several_depths() {
    let n = env_count("SRP_DATA_IOS", 300);
    let config = StackConfig {
        targets: vec![wide().keys("queue_size=128")],
        ..StackConfig::default()
    };
    for (seed, depth) in [(1u64, 1usize), (2, 8), (3, 64)] {
        mix(&config, seed, n, depth, 128 * 1024);
    }
}

#[test]
fn depth_256_on_four_channels() {
    let n = env_count("SRP_DATA_IOS", 600);
    let mut t = wide().keys("ch_count=4,queue_size=64");
    t.config.rq_size = 128;
    let config = StackConfig {
        targets: vec![t],
        ..StackConfig::default()
    };
    Stack::run(&config, |s, p| {
        let st = s.stats(0, p);
        assert_eq!((st.channels, st.live_channels), (4, 4), "{st:?}");
        assert_eq!(s.target(0).live_channels(), 4);
        let mut w = Workload::new(42);
        let ios = w.ios(n, 0, 0, 512, 32768, 512, 64 * 1024, 0.6);
        let done = s.run_ios(&ios, 256, p);
        for d in &done {
            ok(d);
        }
    });
}

#[test]
fn immediate_data_off_and_two_targets() {
    let n = env_count("SRP_DATA_IOS", 300);
    let config = StackConfig {
        targets: vec![wide().keys("ch_count=2"), wide()],
        srp: SrpConfig {
            use_imm_data: false,
            ..StackConfig::default().srp
        },
        ..StackConfig::default()
    };
    mix(&config, 9, n, 32, 32 * 1024);
    Stack::run(&config, |s, p| {
        let mut w = Workload::new(3);
        let data = w.bytes(2048);
        let o = s.write(1, 0, 10, &data, SgShape::Contiguous, p);
        assert_eq!(o.status.base(), SrbStatus::SUCCESS);
        assert_eq!(s.stats(1, p).immediate_writes, 0, "immediate data off");
        assert!(
            s.transport()
                .negotiated(1, 0, p)
                .unwrap()
                .immediate
                .is_none()
        );
    });
}
