//! Full stack, task management: ABORT TASK under load, LOGICAL UNIT
//! RESET during I/O, and a TMF that times out. Every command and every
//! task management request completes exactly once, with the outcome the
//! target's answer (or its silence) says.

use std::time::Duration;

use kverbs::platform::host::VerifierAllocator;
use kverbs_tests::srp_target::{Misbehaviour, Selector};
use kverbs_tests::{Stack, StackConfig, TargetSetup, Workload};
use kverbs_tools::scsi_target::FaultRule;
use storport_srp::srp::SrpConfig;
use storport_srp::storport::host::RequestSpec;
use storport_srp::storport::{Address, SrbFunction, SrbStatus};

#[global_allocator]
static ALLOCATOR: VerifierAllocator = VerifierAllocator;

fn wide() -> TargetSetup {
    TargetSetup::standard().keys("cmd_sg_entries=255,sg_tablesize=2048,ch_count=2")
}

/// Submits `ios` at once; returns their ids.
fn submit_all(s: &Stack, ios: &[kverbs_tests::Io], p: &kverbs::irql::Passive<'_>) -> Vec<u32> {
    ios.iter().map(|io| s.submit(&io.spec(s), p)).collect()
}

#[test]
fn abort_task_under_load() {
    let config = StackConfig {
        targets: vec![wide()],
        ..StackConfig::default()
    };
    Stack::run(&config, |s, p| {
        let target = s.target(0);
        target.set_misbehaviour(
            Misbehaviour::DropResponses {
                which: Selector::Seeded {
                    probability: 0.1,
                    seed: 17,
                    limit: Some(6),
                },
            },
            p,
        );
        let mut w = Workload::new(21);
        let ios = w.disjoint_ios(120, 0, 0, 512, 32768, 512, 16384, 0.5);
        // At most 64 in flight at once.
        let mut ids = Vec::new();
        for chunk in ios.chunks(60) {
            ids.extend(submit_all(s, chunk, p));
            assert!(s.wait_until(Duration::from_secs(20), || {
                let dropped = target.counters().responses_dropped as usize;
                ids.iter().filter(|id| !s.done(**id)).count() <= dropped
            }));
        }
        let victims: Vec<u32> = ids.iter().copied().filter(|id| !s.done(*id)).collect();
        assert!(!victims.is_empty(), "some responses were dropped");
        assert_eq!(victims.len() as u64, target.counters().responses_dropped);
        let aborts: Vec<u32> = victims
            .iter()
            .map(|v| s.submit(&RequestSpec::abort(Address::new(0, 0, 0), *v), p))
            .collect();
        let out = s.wait(&aborts, Duration::from_secs(20), None, p);
        for o in &out {
            assert_eq!(o.status.base(), SrbStatus::SUCCESS, "{o:?}");
        }
        for o in s.wait(&victims, Duration::from_secs(1), None, p) {
            assert_eq!(o.status.base(), SrbStatus::ABORTED, "{o:?}");
            assert_eq!(o.data_transfer_length, 0);
        }
        let st = s.stats(0, p);
        assert_eq!(st.tmfs_sent, victims.len() as u64, "{st:?}");
        assert_eq!(target.counters().tm_abort_task, victims.len() as u64);
        // Everything else completed normally and checks out.
        for (io, id) in ios.iter().zip(&ids) {
            if victims.contains(id) {
                continue;
            }
            let o = s.model.outcome(*id).unwrap();
            assert_eq!(
                o.status.base(),
                SrbStatus::SUCCESS,
                "{o:?} {io:?} {:?} {:?}",
                s.stats(0, p),
                target.counters()
            );
            let data = s.model.data(*id).unwrap();
            s.check(
                io,
                &kverbs_tests::IoDone {
                    id: *id,
                    outcome: o,
                    data,
                },
            );
        }
        // An abort of a request that is no longer outstanding fails.
        let late = s.submit(&RequestSpec::abort(Address::new(0, 0, 0), ids[0]), p);
        let o = s.wait(&[late], Duration::from_secs(5), None, p);
        assert_eq!(o[0].status.base(), SrbStatus::ABORT_FAILED, "{o:?}");
    });
}

#[test]
fn lun_reset_during_io_completes_the_lun_first() {
    let config = StackConfig {
        targets: vec![wide()],
        ..StackConfig::default()
    };
    Stack::run(&config, |s, p| {
        let target = s.target(0);
        target.set_misbehaviour(
            Misbehaviour::DelayResponses {
                delay: Duration::from_secs(30),
                which: Selector::All,
            },
            p,
        );
        let mut w = Workload::new(22);
        let lun0 = w.disjoint_ios(40, 0, 0, 512, 32768, 512, 8192, 0.5);
        let ids0 = submit_all(s, &lun0, p);
        assert!(s.wait_until(Duration::from_secs(10), || {
            target.counters().responses_delayed >= 30
        }));
        let reset = s.submit(
            &RequestSpec::function(SrbFunction::ResetLogicalUnit, Address::new(0, 0, 0)),
            p,
        );
        let start = std::time::Instant::now();
        while !s.done(reset) {
            assert!(start.elapsed() < Duration::from_secs(20), "reset not done");
            std::thread::yield_now();
        }
        // Reported only after every command of the LUN completed.
        assert!(
            ids0.iter().all(|id| s.done(*id)),
            "a LUN command outlived its reset"
        );
        assert_eq!(
            s.model.outcome(reset).unwrap().status.base(),
            SrbStatus::SUCCESS
        );
        let mut reset_count = 0;
        for o in s.wait(&ids0, Duration::from_secs(1), None, p) {
            match o.status.base() {
                SrbStatus::BUS_RESET => reset_count += 1,
                SrbStatus::SUCCESS => {}
                other => panic!("unexpected {other:?}: {o:?}"),
            }
        }
        assert!(reset_count >= 30, "{reset_count}");
        // ch_count=2: the reset goes out on both channels, each covering
        // the commands that channel carried.
        assert_eq!(target.counters().tm_lun_reset, 2);
        assert_eq!(s.stats(0, p).tmfs_sent, 2);
        target.clear_misbehaviour();
        // The LUN works again; the other LUN never stopped.
        let (o, _) = s.read(0, 0, 0, 8, storport_srp::storport::host::SgShape::Pages, p);
        assert_eq!(
            o.status.base(),
            SrbStatus::SUCCESS,
            "{o:?} {:?} {:?}",
            s.stats(0, p),
            target.counters()
        );
        let (o, _) = s.read(0, 1, 0, 2, storport_srp::storport::host::SgShape::Pages, p);
        assert_eq!(o.status.base(), SrbStatus::SUCCESS);
        // No command the initiator completed (and fenced) at the reset was
        // run by the target afterwards: a reset sent on one channel only
        // overtook commands still in flight on the other, the target's
        // RDMA hit their invalidated keys and the connection died.
        let (st, c) = (s.stats(0, p), target.counters());
        assert_eq!(
            (st.transport_failures, c.wr_errors, c.protection_errors),
            (0, 0, 0),
            "{st:?} {c:?}"
        );
    });
}

/// With two channels, a LUN reset must not overtake commands still queued
/// on the other channel: the target's thread for one channel is held in a
/// command of LUN 1 while READs of LUN 0 queue behind it, then LUN 0 is
/// reset. Were the reset sent on the other channel only, the initiator
/// would complete and fence the queued READs when it is answered, and the
/// target would run them later into invalidated keys (a protection error
/// that kills the connection). Each channel's reset is behind its own
/// commands, so nothing of the kind may happen.
#[test]
fn lun_reset_does_not_overtake_commands_on_another_channel() {
    let config = StackConfig {
        targets: vec![wide()],
        ..StackConfig::default()
    };
    Stack::run(&config, |s, p| {
        // Channels are chosen by tag, which this test does not control:
        // rounds with and without another command in flight put the held
        // command on either channel (a reset sent on one channel only
        // failed one round in three).
        for round in 0..4u64 {
            reset_behind_a_held_channel(s, round, p);
        }
    });
}

/// A one-block READ of LUN 1 at `lba`.
fn lun1_read(s: &Stack, lba: u64) -> RequestSpec {
    RequestSpec::scsi_in(
        Address::new(0, 0, 1),
        &kverbs_tests::rw_cdb(true, lba, 1),
        s.block_len(0, 1),
    )
}

/// Holds the target's thread of one channel (the one the READ of LUN 1
/// lands on) for `hold`; returns the held READ's id.
fn hold_a_channel(s: &Stack, lba: u64, hold: Duration, p: &kverbs::irql::Passive<'_>) -> u32 {
    s.target(0).set_misbehaviour(
        Misbehaviour::ScsiFault(FaultRule::delay(hold).on_lun(1).times(1)),
        p,
    );
    let stall = s.submit(&lun1_read(s, lba), p);
    std::thread::sleep(Duration::from_millis(100));
    stall
}

fn reset_behind_a_held_channel(s: &Stack, round: u64, p: &kverbs::irql::Passive<'_>) {
    let target = s.target(0);
    let warm = (round % 2 == 1).then(|| s.submit(&lun1_read(s, round), p));
    let stall = hold_a_channel(s, round, Duration::from_millis(1500), p);
    let mut w = Workload::new(31 + round);
    let lun0 = w.disjoint_ios(16, 0, 0, 512, 32768, 4096, 4096, 1.0);
    let ids = submit_all(s, &lun0, p);
    let reset = s.submit(
        &RequestSpec::function(SrbFunction::ResetLogicalUnit, Address::new(0, 0, 0)),
        p,
    );
    let mut all = ids.clone();
    all.extend([reset, stall]);
    all.extend(warm);
    for o in s.wait(&all, Duration::from_secs(20), None, p) {
        assert_eq!(o.completions, 1, "round {round}: {o:?}");
        assert!(
            matches!(o.status.base(), SrbStatus::SUCCESS | SrbStatus::BUS_RESET),
            "round {round}: {o:?}"
        );
    }
    let answer = s.model.outcome(reset).unwrap();
    assert_eq!(
        answer.status.base(),
        SrbStatus::SUCCESS,
        "round {round}: the LUN reset {answer:?}; {:?} {:?}",
        s.stats(0, p),
        target.counters()
    );
    // The target is still reachable and nothing it ran hit a fence.
    let (o, _) = s.read(0, 0, 0, 8, storport_srp::storport::host::SgShape::Pages, p);
    assert_eq!(o.status.base(), SrbStatus::SUCCESS, "round {round}: {o:?}");
    let (st, c) = (s.stats(0, p), target.counters());
    assert_eq!(
        (st.transport_failures, c.wr_errors, c.protection_errors),
        (0, 0, 0),
        "round {round}: {st:?} {c:?}"
    );
}

#[test]
fn tmf_timeout_is_reported_and_the_late_answer_ignored() {
    let config = StackConfig {
        srp: SrpConfig {
            tmf_timeout: Duration::from_millis(200),
            ..StackConfig::default().srp
        },
        ..StackConfig::default()
    };
    Stack::run(&config, |s, p| {
        // The target's channel thread is stuck in this command for 1.5 s:
        // the abort is not answered in time.
        s.target(0).set_misbehaviour(
            Misbehaviour::ScsiFault(FaultRule::delay(Duration::from_millis(1500)).times(1)),
            p,
        );
        let spec = RequestSpec::scsi_in(
            Address::new(0, 0, 0),
            &kverbs_tests::rw_cdb(true, 0, 8),
            4096,
        );
        let id = s.submit(&spec, p);
        std::thread::sleep(Duration::from_millis(50));
        let abort = s.submit(&RequestSpec::abort(Address::new(0, 0, 0), id), p);
        let o = s.wait(&[abort], Duration::from_secs(5), None, p);
        assert_eq!(o[0].status.base(), SrbStatus::ABORT_FAILED, "{o:?}");
        let st = s.stats(0, p);
        assert_eq!(st.tmf_timeouts, 1, "{st:?}");
        // The command itself completes when the target gets to it.
        let o = s.wait(&[id], Duration::from_secs(10), None, p);
        assert_eq!(o[0].status.base(), SrbStatus::SUCCESS, "{o:?}");
        // The late TMF answer finds nothing (its slot moved on).
        assert!(
            s.wait_until(Duration::from_secs(5), || s.stats(0, p).stale_responses
                >= 1)
        );
    });
}

/// A LUN reset covers the commands its channel carried *before* the TMF,
/// not those posted on the channel while its answer is on the way: the
/// target runs those after the reset, as new tasks. One channel's target
/// thread is held in a command of LUN 1, LUN 0 is reset (its TMF queues
/// behind the held command on that channel), then READs of LUN 0 go out on
/// both channels. Were they counted as reset when the held channel's
/// answer arrives, the initiator would complete and fence them while the
/// target still runs them: their RDMA WRITEs hit invalidated keys and the
/// connection dies.
#[test]
fn commands_posted_after_a_lun_reset_are_not_covered_by_it() {
    let config = StackConfig {
        targets: vec![wide()],
        ..StackConfig::default()
    };
    Stack::run(&config, |s, p| {
        let target = s.target(0);
        for round in 0..2u64 {
            let stall = hold_a_channel(s, round, Duration::from_millis(800), p);
            let reset = s.submit(
                &RequestSpec::function(SrbFunction::ResetLogicalUnit, Address::new(0, 0, 0)),
                p,
            );
            // The reset's TMFs are on both wires before these are posted.
            assert!(s.wait_until(Duration::from_secs(5), || {
                s.stats(0, p).tmfs_sent >= 2 * (round + 1)
            }));
            let mut w = Workload::new(77 + round);
            let after = w.disjoint_ios(16, 0, 0, 512, 32768, 4096, 4096, 1.0);
            let ids = submit_all(s, &after, p);
            let mut all = ids.clone();
            all.extend([reset, stall]);
            let outcomes = s.wait(&all, Duration::from_secs(20), None, p);
            for (id, o) in all.iter().zip(&outcomes) {
                assert_eq!(o.completions, 1, "round {round}: {id} {o:?}");
            }
            for (id, o) in ids.iter().zip(&outcomes) {
                assert_eq!(
                    o.status.base(),
                    SrbStatus::SUCCESS,
                    "round {round}: READ {id} posted after the reset: {o:?}; {:?} {:?}",
                    s.stats(0, p),
                    target.counters()
                );
            }
            let answer = s.model.outcome(reset).unwrap();
            assert_eq!(
                answer.status.base(),
                SrbStatus::SUCCESS,
                "round {round}: {answer:?}"
            );
            let (st, c) = (s.stats(0, p), target.counters());
            assert_eq!(
                (st.transport_failures, c.wr_errors, c.protection_errors),
                (0, 0, 0),
                "round {round}: {st:?} {c:?}"
            );
        }
        target.clear_misbehaviour();
    });
}
