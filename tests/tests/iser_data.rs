//! Full stack over iSER, data integrity: sizes 512 B – 1 MiB, contiguous
//! and per-page buffers (one MR each), queue depths 1 – 256, random
//! read/write mixes, immediate and unsolicited data — every byte checked
//! against the target's medium. Buffers one MR cannot map (gaps inside a
//! page run) are refused truthfully. `KV_ISER_SWEEP` scales the random
//! mix (default 200 I/Os).

use kverbs::platform::host::VerifierAllocator;
use kverbs_tests::iser::{IserSetup, IserStack, IserStackConfig};
use kverbs_tests::{Io, Op, Workload, env_count};
use storport_srp::storport::SrbStatus;
use storport_srp::storport::host::SgShape;

#[global_allocator]
static ALLOCATOR: VerifierAllocator = VerifierAllocator;

fn ok(done: &kverbs_tests::IoDone) {
    assert_eq!(done.outcome.status.base(), SrbStatus::SUCCESS, "{done:?}");
    assert_eq!(done.outcome.completions, 1);
}

/// Shapes one MR maps.
fn mappable(shape: SgShape) -> SgShape {
    match shape {
        SgShape::Odd { .. } => SgShape::Pages,
        other => other,
    }
}

#[test]
fn sizes_and_shapes_at_depth_one() {
    sizes_and_shapes(true);
}

/// The same with immediate data copied into the send buffer (the path for
/// buffers with more segments than a SEND gathers).
#[test]
fn sizes_and_shapes_with_immediate_data_copied() {
    sizes_and_shapes(false);
}

fn sizes_and_shapes(gather_immediate: bool) {
    // InitialR2T=No on both sides: unsolicited Data-Out PDUs follow the
    // immediate data.
    let mut setup = IserSetup::standard().key("node.session.iscsi.InitialR2T", "No");
    setup.config.iscsi.values.initial_r2t = false;
    let mut config = IserStackConfig {
        targets: vec![setup],
        ..IserStackConfig::default()
    };
    config.iser.gather_immediate = gather_immediate;
    IserStack::run(&config, |s, p| {
        let mut w = Workload::new(11);
        let sizes = [512u32, 4096, 8192, 12_288, 65_536, 262_144, 1 << 20];
        for (lun, block) in [(0u8, 512u32), (1, 4096)] {
            for (i, &size) in sizes.iter().enumerate() {
                if size < block {
                    continue;
                }
                for shape in [SgShape::Contiguous, SgShape::Pages] {
                    let blocks = size / block;
                    let lba = (i as u64) * u64::from((1 << 20) / block);
                    let data = w.bytes(size as usize);
                    let o = s.write(0, lun, lba, &data, shape, p);
                    assert_eq!(
                        o.status.base(),
                        SrbStatus::SUCCESS,
                        "write {size} {shape:?}"
                    );
                    assert_eq!(
                        s.medium(0, lun, lba, u64::from(blocks)),
                        data,
                        "write {size}"
                    );
                    let (o, back) = s.read(0, lun, lba, blocks, shape, p);
                    assert_eq!(o.status.base(), SrbStatus::SUCCESS, "read {size} {shape:?}");
                    assert!(back == data, "read {size} {shape:?} differs");
                }
            }
        }
        let st = s.stats(0, p);
        assert!(st.immediate_writes > 0, "{st:?}");
        // Contiguous and per-page buffers fit a SEND's gather list.
        let gathered = if gather_immediate {
            st.immediate_writes
        } else {
            0
        };
        assert_eq!(st.immediate_gathered, gathered, "{st:?}");
        assert!(st.data_out_pdus > 0, "unsolicited Data-Out: {st:?}");
        // Writes sent whole as immediate/unsolicited data register nothing;
        // every other command was fenced by the target's invalidation.
        assert!(st.remote_invalidations > 0, "{st:?}");
        assert_eq!(st.local_invalidations + st.fenced_by_flush, 0, "{st:?}");
    });
}

#[test]
fn unmappable_buffer_is_refused_not_corrupted() {
    IserStack::run(&IserStackConfig::default(), |s, p| {
        let mut w = Workload::new(5);
        let before = s.medium(0, 0, 10, 24);
        let data = w.bytes(24 * 512);
        let o = s.write(0, 0, 10, &data, SgShape::Odd { seed: 3 }, p);
        assert_ne!(o.status.base(), SrbStatus::SUCCESS, "{o:?}");
        assert_eq!(o.completions, 1);
        assert_eq!(s.medium(0, 0, 10, 24), before, "nothing written");
        // The session goes on.
        let o = s.write(0, 0, 10, &data, SgShape::Pages, p);
        assert_eq!(o.status.base(), SrbStatus::SUCCESS);
    });
}

#[test]
fn depths_one_to_256() {
    IserStack::run(&IserStackConfig::default(), |s, p| {
        let mut w = Workload::new(21);
        for depth in [1usize, 8, 64, 256] {
            let n = depth.max(32);
            let mut ios = w.disjoint_ios(n, 0, 0, 512, 32768, 512, 16384, 0.5);
            for io in &mut ios {
                io.shape = mappable(io.shape);
            }
            for d in s.run_ios(&ios, depth, p) {
                ok(&d);
            }
        }
    });
}

#[test]
fn random_mix_both_luns() {
    let n = env_count("KV_ISER_SWEEP", 200);
    IserStack::run(&IserStackConfig::default(), |s, p| {
        let mut w = Workload::new(0xA5);
        let mut ios: Vec<Io> = w.ios(n, 0, 0, 512, 32768, 512, 256 * 1024, 0.6);
        ios.extend(w.ios(n / 2, 0, 1, 4096, 4096, 4096, 1 << 20, 0.4));
        for io in &mut ios {
            io.shape = mappable(io.shape);
        }
        let done = s.run_ios(&ios, 32, p);
        for d in &done {
            ok(d);
        }
        assert!(ios.iter().any(|i| i.op == Op::Write) && ios.iter().any(|i| i.op == Op::Read));
    });
}

#[test]
fn local_invalidation_when_remote_refused() {
    let mut config = IserStackConfig::default();
    config.iser.accept_remote_invalidate = false;
    IserStack::run(&config, |s, p| {
        let mut w = Workload::new(3);
        let ios = w.disjoint_ios(64, 0, 0, 512, 32768, 512, 65536, 0.5);
        let ios: Vec<Io> = ios
            .into_iter()
            .map(|mut i| {
                i.shape = mappable(i.shape);
                i
            })
            .collect();
        for d in s.run_ios(&ios, 16, p) {
            ok(&d);
        }
        let st = s.stats(0, p);
        assert!(!st.remote_invalidate);
        assert_eq!(st.remote_invalidations, 0, "{st:?}");
        assert!(st.local_invalidations >= 48, "{st:?}");
        assert_eq!(s.target(0).counters().send_with_invalidate, 0);
    });
}

#[test]
fn target_refusing_remote_invalidation_is_honoured() {
    let config = IserStackConfig::default();
    IserStack::run(&config, |s, p| {
        // Applies from the next connection: drop the current one.
        s.target(0)
            .set_rdma_misbehaviour(kverbs_tools::iser_target::IserMisbehaviour {
                refuse_send_with_invalidate: true,
                ..Default::default()
            });
        s.transport().drop_connection(0, p);
        assert!(s.wait_until(std::time::Duration::from_secs(20), || {
            s.stats(0, p).logins >= 2
                && s.state(0) == storport_srp::miniport::transport::TargetState::Live
        }));
        let before = s.stats(0, p);
        assert!(!before.remote_invalidate, "REP flag 0x40 read: {before:?}");
        let mut w = Workload::new(4);
        let data = w.bytes(65536);
        let o = s.write(0, 0, 0, &data, SgShape::Pages, p);
        assert_eq!(o.status.base(), SrbStatus::SUCCESS);
        let after = s.stats(0, p);
        assert_eq!(after.remote_invalidations, before.remote_invalidations);
        assert!(after.local_invalidations > before.local_invalidations);
    });
}

#[test]
fn without_immediate_data() {
    let config = IserStackConfig {
        targets: vec![IserSetup::standard().key("node.session.iscsi.ImmediateData", "No")],
        ..IserStackConfig::default()
    };
    IserStack::run(&config, |s, p| {
        let mut w = Workload::new(8);
        let data = w.bytes(32768);
        let o = s.write(0, 0, 64, &data, SgShape::Contiguous, p);
        assert_eq!(o.status.base(), SrbStatus::SUCCESS);
        assert_eq!(s.medium(0, 0, 64, 64), data);
        assert_eq!(s.stats(0, p).immediate_writes, 0);
    });
}
