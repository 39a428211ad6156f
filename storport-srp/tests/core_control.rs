//! The miniport core's control paths over the fake transport, under the
//! StorPort model: flow control under credit starvation, timeouts and bus
//! resets, abort and LUN reset reaching the transport, adapter stop and
//! restart, target state changes, transport contract breaches.

mod support;

use kverbs::irql::Passive;
use storport_srp::miniport::AdapterState;
use storport_srp::miniport::transport::{FailureKind, TargetState};
use storport_srp::storport::host::{ModelConfig, RequestSpec, RequestState, SgDelivery};
use storport_srp::storport::{SrbFunction, SrbStatus};

use support::fake::{Delivery, FakeConfig, Scripted};
use support::scsi::{self, BLOCK};
use support::{Model, SECOND, adapter_config, lun, manual, run, start};

fn read(at: storport_srp::storport::Address, lba: u32) -> RequestSpec {
    RequestSpec::scsi_in(at, &scsi::read10(lba, 2), 2 * BLOCK as u32)
}

fn write(at: storport_srp::storport::Address, lba: u32, fill: u8) -> RequestSpec {
    RequestSpec::scsi_out(at, &scsi::write10(lba, 2), vec![fill; 2 * BLOCK])
}

fn done_once(model: &Model, id: u32) -> SrbStatus {
    let o = model.outcome(id).unwrap();
    assert_eq!(o.state, RequestState::Completed, "request {id}");
    assert_eq!(o.completions, 1, "request {id}");
    o.status
}

fn with_model(fake: FakeConfig, model: ModelConfig, test: impl FnOnce(&Model, &Passive<'_>)) {
    let platform = manual();
    platform.run_passive(|p| {
        let m = start(&platform, model, adapter_config(), fake, p);
        test(&m, p);
        assert_eq!(m.miniport().transport().errors(), 0, "fake caught the core");
        m.finish();
    });
}

/// With two credits and late completions, most requests are answered BUSY
/// and the LUN is held (device busy: a posted command will release it);
/// credits coming back release it and everything completes once. A LUN
/// with nothing posted is held by a short pause instead, released early
/// when credit returns.
#[test]
fn credit_starvation_holds_and_releases() {
    let fake = FakeConfig {
        credits: 2,
        delivery: Delivery::Late,
        ..FakeConfig::default()
    };
    with_model(fake, ModelConfig::default(), |model, p| {
        let fake = model.miniport().transport();
        let ids: Vec<u32> = (0..6)
            .map(|i| model.submit(&write(lun(0, 0), i * 2, i as u8), p).unwrap())
            .collect();
        model.settle();
        assert_eq!(fake.held(), 2);
        let stats = model.miniport().core().stats();
        assert!(stats.busy_no_credit >= 1);
        assert!(model.stats().device_busy_calls >= 1);
        // LUN 1 has nothing posted: paused, not busied.
        let other = model.submit(&read(lun(0, 1), 0), p).unwrap();
        model.settle();
        assert!(model.stats().pause_calls >= 1);
        assert_eq!(model.outcome(other).unwrap().state, RequestState::Queued);
        // Drain: release late commands as they are posted.
        for _ in 0..20 {
            fake.release_late(usize::MAX);
            model.settle();
        }
        for &id in ids.iter().chain([other].iter()) {
            assert_eq!(done_once(model, id), SrbStatus::SUCCESS);
        }
        assert!(model.stats().ready_calls + model.stats().resume_calls >= 1);
        for i in 0..6u32 {
            assert_eq!(
                fake.disk().peek(0, (i * 2) as usize * BLOCK, 2 * BLOCK),
                vec![i as u8; 2 * BLOCK]
            );
        }
        assert_eq!(fake.credits(0), 2);
    });
}

/// Credit that comes back between the transport's refusal and the LUN's
/// hold (another processor completing a command) must still end the hold:
/// the release found nothing held, so the hold ends itself. Before the
/// fix, the LUN stayed paused until StorPort's clock ended the pause (1 s
/// on Windows; forever here, where the clock does not move), which stalled
/// the interop test against Linux `ib_srpt` at queue depth 64.
#[test]
fn credit_returned_before_the_hold_ends_it() {
    let fake = FakeConfig {
        credits: 0,
        credit_races_refusal: true,
        ..FakeConfig::default()
    };
    with_model(fake, ModelConfig::default(), |model, p| {
        let fake = model.miniport().transport();
        // LUN 1 has nothing posted: the refusal pauses it.
        let id = model.submit(&write(lun(0, 1), 4, 0x5a), p).unwrap();
        model.settle();
        assert!(model.stats().pause_calls >= 1, "{:?}", model.stats());
        assert!(model.miniport().core().stats().busy_no_credit >= 1);
        // Without time moving, it went through.
        assert_eq!(done_once(model, id), SrbStatus::SUCCESS);
        assert!(model.stats().resume_calls >= 1, "{:?}", model.stats());
        assert_eq!(
            fake.disk().peek(1, 4 * BLOCK, 2 * BLOCK),
            vec![0x5a; 2 * BLOCK]
        );
    });
}

/// Requests the target never answers time out; StorPort resets the bus;
/// every one of them — posted, or still waiting for its scatter/gather
/// list — completes exactly once with BUS_RESET, and the adapter works on.
#[test]
fn timeouts_reset_the_bus_and_complete_everything_once() {
    let fake = FakeConfig {
        delivery: Delivery::Never,
        ..FakeConfig::default()
    };
    let config = ModelConfig {
        sg_delivery: SgDelivery::Deferred,
        ..ModelConfig::default()
    };
    with_model(fake, config, |model, p| {
        let fake = model.miniport().transport();
        let mut ids = Vec::new();
        for i in 0..4 {
            ids.push(model.submit(&read(lun(0, 0), i).timeout(5), p).unwrap());
            ids.push(
                model
                    .submit(
                        &RequestSpec::scsi(lun(1, 1), &scsi::test_unit_ready()).timeout(5),
                        p,
                    )
                    .unwrap(),
            );
        }
        model.settle();
        assert_eq!(fake.held(), 8);
        // One more, still waiting for its list when the reset comes.
        let waiting = model
            .submit(&write(lun(1, 0), 9, 1).timeout(30), p)
            .unwrap();
        assert_eq!(
            model.outcome(waiting).unwrap().state,
            RequestState::InSgBuild
        );
        model.advance(5 * SECOND, p);
        assert_eq!(model.stats().bus_resets, 1);
        model.settle();
        for &id in &ids {
            assert_eq!(done_once(model, id), SrbStatus::BUS_RESET);
        }
        assert_eq!(done_once(model, waiting), SrbStatus::BUS_RESET);
        assert_eq!(fake.outstanding(), 0);
        assert_eq!(fake.stats().resets, 1);
        assert_eq!(model.miniport().core().stats().bus_resets, 1);
        // Time moves on: no reset left anything outstanding.
        model.advance(SECOND, p);
        // And the adapter still works.
        fake.script(Scripted::delivered(Delivery::Dpc));
        let (_, o) = run(model, &read(lun(0, 0), 0), p);
        assert_eq!(o.status, SrbStatus::SUCCESS);
    });
}

/// A transport that completes a command twice: the second is stale and
/// ignored; one that refuses a post: the request completes with the
/// failure, once.
#[test]
fn transport_breaches_are_absorbed() {
    with_model(FakeConfig::default(), ModelConfig::default(), |model, p| {
        let fake = model.miniport().transport();
        fake.script(Scripted {
            twice: true,
            ..Scripted::default()
        });
        let (id, o) = run(model, &read(lun(0, 0), 0), p);
        assert_eq!((o.status, o.completions), (SrbStatus::SUCCESS, 1));
        assert_eq!(model.miniport().core().stats().stale_completions, 1);
        let _ = id;
        fake.script(Scripted {
            fail_post: Some(FailureKind::ConnectionReset),
            ..Scripted::default()
        });
        let (_, o) = run(model, &write(lun(0, 0), 0, 3), p);
        assert_eq!((o.status, o.completions), (SrbStatus::BUS_RESET, 1));
        fake.script(Scripted {
            fail_post: Some(FailureKind::Unsupported),
            ..Scripted::default()
        });
        let (_, o) = run(
            model,
            &RequestSpec::scsi(lun(0, 1), &scsi::test_unit_ready()),
            p,
        );
        assert_eq!(o.status, SrbStatus::INVALID_REQUEST);
        // The target's own credits were returned each time.
        assert_eq!(fake.credits(0), FakeConfig::default().credits);
    });
}

/// ABORT_COMMAND becomes ABORT TASK at the target: the victim completes
/// ABORTED, the abort SUCCESS. A victim still waiting for its list is
/// aborted before it reaches the transport. An abort with nothing to abort
/// fails.
#[test]
fn abort_reaches_the_transport() {
    let fake = FakeConfig {
        delivery: Delivery::Never,
        ..FakeConfig::default()
    };
    let config = ModelConfig {
        sg_delivery: SgDelivery::Deferred,
        ..ModelConfig::default()
    };
    with_model(fake, config, |model, p| {
        let fake = model.miniport().transport();
        let victim = model.submit(&read(lun(1, 0), 4), p).unwrap();
        model.settle();
        assert_eq!(fake.held(), 1);
        let abort = model
            .submit(&RequestSpec::abort(lun(1, 0), victim), p)
            .unwrap();
        model.settle();
        assert_eq!(done_once(model, victim), SrbStatus::ABORTED);
        assert_eq!(done_once(model, abort), SrbStatus::SUCCESS);
        assert_eq!(fake.stats().aborts, 1);
        assert_eq!(model.miniport().core().stats().tmfs_sent, 1);
        // Nothing left to abort.
        let again = model
            .submit(&RequestSpec::abort(lun(1, 0), victim), p)
            .unwrap();
        model.settle();
        assert_eq!(done_once(model, again), SrbStatus::ABORT_FAILED);
        // The victim is still building its list: claimed locally.
        let early = model.submit(&write(lun(1, 1), 8, 9), p).unwrap();
        assert_eq!(model.outcome(early).unwrap().state, RequestState::InSgBuild);
        let abort = model
            .submit(&RequestSpec::abort(lun(1, 1), early), p)
            .unwrap();
        assert_eq!(done_once(model, abort), SrbStatus::SUCCESS);
        let posted = fake.stats().posted;
        model.settle();
        assert_eq!(done_once(model, early), SrbStatus::ABORTED);
        assert_eq!(fake.stats().posted, posted, "never posted");
        assert_eq!(fake.stats().aborts, 1, "no TMF needed");
        // A victim the target has executed (its answer is on the way):
        // the abort finds nothing to abort and fails; the victim completes
        // with its real result.
        fake.script(Scripted::delivered(Delivery::Late));
        let late = model.submit(&read(lun(0, 0), 0), p).unwrap();
        model.settle();
        assert_eq!(fake.release_late(1), 1);
        let id = model
            .submit(&RequestSpec::abort(lun(0, 0), late), p)
            .unwrap();
        model.settle();
        assert_eq!(done_once(model, late), SrbStatus::SUCCESS);
        assert_eq!(done_once(model, id), SrbStatus::ABORT_FAILED);
        assert_eq!(fake.stats().aborts, 2);
    });
}

/// RESET_LOGICAL_UNIT and RESET_DEVICE become LOGICAL UNIT RESET at the
/// target (unlike WinOF, which sent nothing): that LUN's commands complete
/// BUS_RESET, other LUNs' are untouched.
#[test]
fn lun_reset_reaches_the_transport() {
    let fake = FakeConfig {
        delivery: Delivery::Never,
        ..FakeConfig::default()
    };
    with_model(fake, ModelConfig::default(), |model, p| {
        let fake = model.miniport().transport();
        let here: Vec<u32> = (0..3)
            .map(|i| model.submit(&read(lun(0, 1), i), p).unwrap())
            .collect();
        let there = model.submit(&read(lun(0, 0), 0), p).unwrap();
        model.settle();
        assert_eq!(fake.held(), 4);
        let reset = model
            .submit(
                &RequestSpec::function(SrbFunction::ResetLogicalUnit, lun(0, 1)),
                p,
            )
            .unwrap();
        model.settle();
        assert_eq!(done_once(model, reset), SrbStatus::SUCCESS);
        for &id in &here {
            assert_eq!(done_once(model, id), SrbStatus::BUS_RESET);
        }
        assert_eq!(
            model.outcome(there).unwrap().state,
            RequestState::InMiniport
        );
        assert_eq!(fake.stats().lun_resets, 1);
        let device = model
            .submit(
                &RequestSpec::function(SrbFunction::ResetDevice, lun(0, 0)),
                p,
            )
            .unwrap();
        model.settle();
        assert_eq!(done_once(model, device), SrbStatus::SUCCESS);
        assert_eq!(done_once(model, there), SrbStatus::BUS_RESET);
        assert_eq!(fake.stats().lun_resets, 2);
        assert_eq!(fake.held(), 0);
    });
}

/// ScsiStopAdapter at device IRQL only queues the teardown; the passive
/// worker stops the transport (which completes what it held). Restart
/// reconnects, and I/O flows again.
#[test]
fn stop_and_restart_the_adapter() {
    with_model(FakeConfig::default(), ModelConfig::default(), |model, p| {
        let fake = model.miniport().transport();
        let core = model.miniport().core();
        assert_eq!(core.state(), AdapterState::Running);
        let (_, o) = run(model, &write(lun(0, 0), 1, 7), p);
        assert_eq!(o.status, SrbStatus::SUCCESS);
        fake.script(Scripted::delivered(Delivery::Never));
        let stuck = model.submit(&read(lun(0, 0), 1), p).unwrap();
        model.settle();
        assert!(model.stop_adapter(p));
        assert_eq!(core.state(), AdapterState::Stopping);
        assert_eq!(fake.stats().stops, 0, "nothing torn down at device IRQL");
        model.settle();
        assert_eq!(core.state(), AdapterState::Stopped);
        assert_eq!(fake.stats().stops, 1);
        assert_eq!(done_once(model, stuck), SrbStatus::BUS_RESET);
        assert!(model.restart_adapter(p));
        model.settle();
        assert_eq!(core.state(), AdapterState::Running);
        assert_eq!(fake.stats().starts, 2);
        let (id, o) = run(model, &read(lun(0, 0), 1), p);
        assert_eq!(o.status, SrbStatus::SUCCESS);
        assert_eq!(model.data(id).unwrap(), vec![7; 2 * BLOCK]);
        // Stop and restart back to back, before the worker runs: the
        // worker ends where the last request says.
        assert!(model.stop_adapter(p));
        assert!(model.restart_adapter(p));
        model.settle();
        assert_eq!(core.state(), AdapterState::Running);
        let (_, o) = run(model, &read(lun(1, 1), 0), p);
        assert_eq!(o.status, SrbStatus::SUCCESS);
    });
}

/// Requests arriving while the adapter restarts are answered BUSY and the
/// adapter paused (briefly); the restart resumes it.
#[test]
fn requests_during_restart_wait() {
    with_model(FakeConfig::default(), ModelConfig::default(), |model, p| {
        assert!(model.stop_adapter(p));
        model.settle();
        assert!(model.restart_adapter(p));
        // The worker has not run yet: the adapter is starting.
        let id = model.submit(&read(lun(0, 0), 0), p).unwrap();
        assert_eq!(model.outcome(id).unwrap().state, RequestState::Queued);
        assert_eq!(model.miniport().core().stats().busy_not_ready, 1);
        model.settle();
        assert_eq!(done_once(model, id), SrbStatus::SUCCESS);
        assert!(model.stats().resume_calls >= 1);
    });
}

/// The target's connection state drives what requests get: blocked →
/// BUSY and held (bounded), live again → released; fail-fast → outstanding
/// and new requests fail over (SELECTION_TIMEOUT); lost → NO_DEVICE and a
/// bus change so Windows re-enumerates.
#[test]
fn target_states_drive_requests() {
    let fake = FakeConfig {
        delivery: Delivery::Never,
        ..FakeConfig::default()
    };
    with_model(fake, ModelConfig::default(), |model, p| {
        let fake = model.miniport().transport();
        let changes = model.stats().bus_changes;
        assert!(changes >= 1, "targets appearing at start");
        // Blocked: held, then released when live again.
        fake.set_target_state(1, TargetState::Blocked);
        model.settle();
        fake.script(Scripted::delivered(Delivery::Dpc));
        let blocked = model.submit(&read(lun(1, 0), 0), p).unwrap();
        model.settle();
        assert_eq!(model.outcome(blocked).unwrap().state, RequestState::Queued);
        assert_eq!(model.outcome(blocked).unwrap().busy_requeues, 1);
        fake.set_target_state(1, TargetState::Live);
        model.settle();
        assert_eq!(done_once(model, blocked), SrbStatus::SUCCESS);
        assert_eq!(model.stats().bus_changes, changes, "no visibility change");
        // Fail-fast: the outstanding command and new ones fail over.
        let outstanding = model.submit(&read(lun(1, 0), 1), p).unwrap();
        model.settle();
        fake.set_target_state(1, TargetState::FailFast);
        model.settle();
        assert_eq!(done_once(model, outstanding), SrbStatus::SELECTION_TIMEOUT);
        let (_, o) = run(model, &read(lun(1, 1), 0), p);
        assert_eq!(o.status, SrbStatus::SELECTION_TIMEOUT);
        // Lost: NO_DEVICE, and Windows is told.
        let held = model.submit(&read(lun(0, 0), 0), p).unwrap();
        model.settle();
        fake.set_target_state(0, TargetState::Lost);
        model.settle();
        assert_eq!(done_once(model, held), SrbStatus::NO_DEVICE);
        assert_eq!(model.stats().bus_changes, changes + 1);
        let (_, o) = run(model, &read(lun(0, 1), 0), p);
        assert_eq!(o.status, SrbStatus::NO_DEVICE);
        // Target 1 comes back.
        fake.set_target_state(1, TargetState::Live);
        model.settle();
        fake.script(Scripted::delivered(Delivery::Dpc));
        let (_, o) = run(model, &read(lun(1, 1), 0), p);
        assert_eq!(o.status, SrbStatus::SUCCESS);
    });
}

/// A reset while requests are still building their lists and while the
/// transport holds others: none slips past the reset.
#[test]
fn reset_bus_srb_covers_requests_in_every_stage() {
    let fake = FakeConfig {
        delivery: Delivery::Never,
        ..FakeConfig::default()
    };
    let config = ModelConfig {
        sg_delivery: SgDelivery::Deferred,
        ..ModelConfig::default()
    };
    with_model(fake, config, |model, p| {
        let fake = model.miniport().transport();
        let posted = model.submit(&read(lun(0, 0), 0), p).unwrap();
        model.settle();
        let building = model.submit(&read(lun(0, 1), 0), p).unwrap();
        let reset = model
            .submit(&RequestSpec::function(SrbFunction::ResetBus, lun(0, 0)), p)
            .unwrap();
        assert_eq!(done_once(model, reset), SrbStatus::SUCCESS);
        assert_eq!(done_once(model, posted), SrbStatus::BUS_RESET);
        model.settle();
        assert_eq!(done_once(model, building), SrbStatus::BUS_RESET);
        assert_eq!(fake.held(), 0);
        assert_eq!(fake.stats().posted, 1);
    });
}
