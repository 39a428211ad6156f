//! Full stack, faults: packet loss and reordering, a QP error mid-I/O, a
//! target logout, a target DREQ, malformed responses, credit starvation, a StorPort timeout, a
//! bus reset during I/O, fail-fast and device loss. After each: every
//! request completed exactly once (the model), data intact for the ones
//! that succeeded (checked against the medium), a truthful status for the
//! others, no connection or CM consumer left, verifier clean
//! ([`Stack::run`]'s teardown).

use std::time::Duration;

use hca_lowlevel::sim::FaultConfig;
use kverbs::platform::host::VerifierAllocator;
use kverbs_tests::driver::{light_loss, retry_failed, rough_link, truthful, with_fault};
use kverbs_tests::interop::wait_until;
use kverbs_tests::srp_target::{Misbehaviour, RspCorruption, Selector};
use kverbs_tests::{Stack, StackConfig, TargetSetup, Workload, env_count};
use storport_srp::miniport::transport::TargetState;
use storport_srp::srp::SrpConfig;
use storport_srp::srp::params::Timeouts;
use storport_srp::storport::SrbStatus;
use storport_srp::storport::host::{ModelConfig, SgShape};

#[global_allocator]
static ALLOCATOR: VerifierAllocator = VerifierAllocator;

fn wide() -> TargetSetup {
    TargetSetup::standard().keys("cmd_sg_entries=255,sg_tablesize=2048")
}

fn lossy(faults: FaultConfig, seed: u64, allowed: &[SrbStatus]) -> (usize, u64) {
    let config = StackConfig {
        seed,
        targets: vec![wide().keys("ch_count=2")],
        ..StackConfig::default()
    };
    Stack::run(&config, |s, p| {
        s.fabric
            .set_link_faults(&s.initiator, &s.targets[0].hca, faults);
        s.fabric
            .set_link_faults(&s.targets[0].hca, &s.initiator, faults);
        let mut w = Workload::new(seed);
        let ios = w.ios(
            env_count("SRP_FAULT_IOS", 120),
            0,
            0,
            512,
            32768,
            512,
            32768,
            0.5,
        );
        let done = s.run_ios(&ios, 16, p);
        if !allowed.contains(&SrbStatus::BUS_RESET) {
            let st = s.stats(0, p);
            assert_eq!(
                st.transport_failures,
                0,
                "{st:?} {:?} {:?}",
                s.fabric.stats(),
                s.target(0).counters()
            );
        }
        let failed = truthful(&done, allowed);
        let stats = s.fabric.stats();
        s.fabric
            .set_link_faults(&s.initiator, &s.targets[0].hca, FaultConfig::default());
        s.fabric
            .set_link_faults(&s.targets[0].hca, &s.initiator, FaultConfig::default());
        if failed > 0 {
            assert!(s.wait_state(0, TargetState::Live, Duration::from_secs(10)));
            retry_failed(s, &ios, &done, p);
        }
        (
            failed,
            stats.dropped_by_fault + stats.duplicated + stats.corrupted,
        )
    })
}

#[test]
fn packet_loss_is_repaired_by_the_transport() {
    for seed in 0..env_count("SRP_FAULT_SEEDS", 2) as u64 {
        let (failed, faults) = lossy(light_loss(), 100 + seed, &[]);
        assert_eq!(failed, 0);
        assert!(faults > 0, "frames were lost");
    }
}

#[test]
fn reordering_duplication_and_corruption() {
    // Heavy reordering can exhaust the RC retry budget (sequence-error
    // NAKs count against it): the connection then fails and recovers, and
    // the requests it took fail for retry — never silently.
    for seed in 0..env_count("SRP_FAULT_SEEDS", 2) as u64 {
        let (_, faults) = lossy(rough_link(), 200 + seed, &[SrbStatus::BUS_RESET]);
        assert!(faults > 0);
    }
}

#[test]
fn qp_error_mid_io_fails_outstanding_for_retry_and_reconnects() {
    let config = StackConfig {
        targets: vec![wide().keys("ch_count=2")],
        ..StackConfig::default()
    };
    Stack::run(&config, |s, p| {
        let qpn = s.transport().channel_qpn(0, 0, p).unwrap();
        let mut w = Workload::new(5);
        let ios = w.ios(400, 0, 0, 512, 32768, 4096, 65536, 0.5);
        let (fabric, initiator, target) = (&s.fabric, &s.initiator, s.target(0));
        // The error lands once the target has taken 64 commands of this
        // run, not after a fixed delay (which can pass before the first
        // command is posted).
        let start = target.counters().srp_cmd;
        let done = with_fault(
            s,
            &ios,
            32,
            Duration::ZERO,
            move || {
                let under_way = wait_until(Duration::from_secs(30), || {
                    target.counters().srp_cmd >= start + 64
                });
                assert!(under_way, "the run never got going");
                fabric.force_qp_error(initiator, qpn);
            },
            p,
        );
        let failed = truthful(&done, &[SrbStatus::BUS_RESET]);
        assert!(
            failed > 0,
            "the error hit outstanding I/O: {:?}",
            s.stats(0, p)
        );
        assert!(s.wait_state(0, TargetState::Live, Duration::from_secs(10)));
        let st = s.stats(0, p);
        assert!(
            st.transport_failures >= 1 && st.fenced_by_flush > 0,
            "{st:?}"
        );
        assert_eq!(st.live_channels, 2, "every channel reconnected: {st:?}");
        assert_ne!(s.transport().channel_qpn(0, 0, p), Some(qpn), "a new QP");
        // Both ended connections give every MR back (the slots' spares
        // included), so their pools are destroyed, not leaked.
        let released = wait_until(Duration::from_secs(30), || {
            s.stats(0, p).released_conns >= 2
        });
        let st = s.stats(0, p);
        assert!(released, "the old connections were released: {st:?}");
        assert_eq!(st.leaked_mr_pools, 0, "{st:?}");
        retry_failed(s, &ios, &done, p);
    });
}

#[test]
fn target_logout_and_target_dreq() {
    let config = StackConfig {
        targets: vec![wide()],
        ..StackConfig::default()
    };
    Stack::run(&config, |s, p| {
        let mut w = Workload::new(6);
        let ios = w.ios(300, 0, 0, 512, 32768, 512, 16384, 0.5);
        let target = s.target(0);
        let done = with_fault(
            s,
            &ios,
            16,
            Duration::from_millis(20),
            move || {
                kverbs::platform::host::HostPlatform::new().run_passive(|p| {
                    target.set_misbehaviour(Misbehaviour::SendTLogout { reason: 7 }, p);
                });
            },
            p,
        );
        truthful(&done, &[SrbStatus::BUS_RESET]);
        assert!(s.wait_state(0, TargetState::Live, Duration::from_secs(10)));
        assert!(s.stats(0, p).t_logouts >= 1);
        retry_failed(s, &ios, &done, p);

        target.set_misbehaviour(Misbehaviour::DisconnectAfter { commands: 40 }, p);
        let ios = w.ios(200, 0, 0, 512, 32768, 512, 16384, 0.5);
        let done = s.run_ios(&ios, 16, p);
        let failed = truthful(&done, &[SrbStatus::BUS_RESET]);
        assert!(failed >= 1, "the unanswered command failed for retry");
        assert!(s.wait_state(0, TargetState::Live, Duration::from_secs(10)));
        retry_failed(s, &ios, &done, p);
        assert!(s.stats(0, p).transport_failures >= 2);
    });
}

/// A malformed `SRP_RSP` (too short; sense data reaching past the IU's
/// end) is a protocol error: the initiator cannot know what became of the
/// command, so it ends the connection (never completes that command as
/// good from a response it cannot read), fails what was outstanding for
/// retry, and logs in again.
#[test]
fn malformed_responses_end_the_connection_and_fail_for_retry() {
    let config = StackConfig {
        targets: vec![wide()],
        ..StackConfig::default()
    };
    for (seed, how) in [
        (8, RspCorruption::Truncated),
        (9, RspCorruption::SenseBeyondIu),
    ] {
        Stack::run(&config, |s, p| {
            let mut w = Workload::new(seed);
            let ios = w.ios(200, 0, 0, 512, 32768, 512, 16384, 0.5);
            let target = s.target(0);
            let before = s.stats(0, p);
            target.set_misbehaviour(
                Misbehaviour::CorruptResponses {
                    how,
                    which: Selector::Next(1),
                },
                p,
            );
            let done = s.run_ios(&ios, 16, p);
            let failed = truthful(&done, &[SrbStatus::BUS_RESET]);
            assert!(
                failed >= 1,
                "{how:?}: the command answered malformed failed"
            );
            assert!(s.wait_state(0, TargetState::Live, Duration::from_secs(10)));
            let st = s.stats(0, p);
            assert_eq!(
                st.protocol_errors,
                before.protocol_errors + 1,
                "{how:?}: {st:?}"
            );
            assert!(
                st.transport_failures > before.transport_failures,
                "{how:?}: {st:?}"
            );
            assert_eq!(target.counters().responses_corrupted, 1);
            retry_failed(s, &ios, &done, p);
        });
    }
}

#[test]
fn credit_starvation_then_cred_req() {
    let mut t = wide().keys("queue_size=32");
    t.config.rq_size = 8;
    let config = StackConfig {
        targets: vec![t],
        ..StackConfig::default()
    };
    Stack::run(&config, |s, p| {
        s.target(0).set_misbehaviour(
            Misbehaviour::WithholdCredits {
                responses: 40,
                idle_release: Duration::from_millis(30),
            },
            p,
        );
        let mut w = Workload::new(8);
        let ios = w.ios(150, 0, 0, 512, 32768, 512, 8192, 0.5);
        let done = s.run_ios(&ios, 32, p);
        assert_eq!(truthful(&done, &[]), 0);
        let st = s.stats(0, p);
        assert!(st.cred_reqs >= 1, "{st:?}");
        assert!(st.busy_credit > 0 && st.zero_req_lim > 0, "{st:?}");
        assert!(
            s.target(0).counters().srp_cred_rsp >= 1,
            "every CRED_REQ answered"
        );
        assert!(st.req_lim > 1, "credits back: {st:?}");
    });
}

#[test]
fn aer_req_is_answered() {
    Stack::run(&StackConfig::default(), |s, p| {
        let sense = storport_srp::scsi::SenseRepr::new(
            storport_srp::scsi::SenseKey::UnitAttention,
            storport_srp::scsi::AdditionalSense {
                asc: 0x2a,
                ascq: 0x09,
            },
        );
        let before = s.stats(0, p).req_lim;
        assert_eq!(
            s.target(0).set_misbehaviour(
                Misbehaviour::SendAerReq {
                    lun: 0,
                    sense,
                    delta: 3
                },
                p
            ),
            1
        );
        assert!(s.wait_until(Duration::from_secs(5), || {
            s.target(0).counters().srp_aer_rsp == 1
        }));
        let st = s.stats(0, p);
        assert_eq!(st.aer_reqs, 1);
        assert_eq!(st.req_lim, before + 3, "the AER's credits are applied");
    });
}

#[test]
fn storport_timeout_resets_the_bus() {
    let config = StackConfig {
        model: ModelConfig {
            max_requests: 4096,
            reset_grace: Duration::from_secs(5),
            ..ModelConfig::default()
        },
        ..StackConfig::default()
    };
    Stack::run(&config, |s, p| {
        s.target(0).set_misbehaviour(
            Misbehaviour::DropResponses {
                which: Selector::Next(1),
            },
            p,
        );
        let spec = storport_srp::storport::host::RequestSpec::scsi_in(
            storport_srp::storport::Address::new(0, 0, 0),
            &kverbs_tests::rw_cdb(true, 0, 8),
            4096,
        )
        .timeout(10);
        let id = s.submit(&spec, p);
        // Not answered: StorPort's clock passes its timeout.
        std::thread::sleep(Duration::from_millis(50));
        assert!(!s.done(id));
        s.model.advance(Duration::from_secs(11), p);
        let o = s.wait(&[id], Duration::from_secs(10), None, p);
        assert_eq!(o[0].status.base(), SrbStatus::BUS_RESET, "{o:?}");
        assert!(s.model.stats().bus_resets >= 1);
        assert!(s.wait_state(0, TargetState::Live, Duration::from_secs(10)));
        let (o, _) = s.read(0, 0, 0, 8, SgShape::Contiguous, p);
        assert_eq!(o.status.base(), SrbStatus::SUCCESS);
    });
}

#[test]
fn bus_reset_during_io() {
    let config = StackConfig {
        targets: vec![wide().keys("ch_count=2")],
        model: ModelConfig {
            max_requests: 8192,
            reset_grace: Duration::from_secs(5),
            ..ModelConfig::default()
        },
        ..StackConfig::default()
    };
    Stack::run(&config, |s, p| {
        let mut w = Workload::new(9);
        let ios = w.ios(300, 0, 0, 512, 32768, 512, 65536, 0.5);
        let model = &s.model;
        let platform = s.platform.clone();
        let done = with_fault(
            s,
            &ios,
            32,
            Duration::from_millis(20),
            move || {
                platform.run_passive(|p| model.reset_bus(p));
            },
            p,
        );
        truthful(&done, &[SrbStatus::BUS_RESET]);
        assert!(s.wait_state(0, TargetState::Live, Duration::from_secs(10)));
        retry_failed(s, &ios, &done, p);
    });
}

#[test]
fn fail_fast_then_device_loss() {
    let config = StackConfig {
        srp: SrpConfig {
            timeouts: Timeouts::new(
                Some(Duration::from_millis(50)),
                Some(Duration::from_millis(400)),
                Some(Duration::from_millis(1500)),
            )
            .unwrap(),
            ..StackConfig::default().srp
        },
        ..StackConfig::default()
    };
    Stack::run(&config, |s, p| {
        let cut = FaultConfig {
            drop: 1.0,
            ..FaultConfig::default()
        };
        let (i, t) = (&s.initiator, &s.targets[0].hca);
        s.fabric.set_link_faults(i, t, cut);
        s.fabric.set_link_faults(t, i, cut);
        // A read notices: its SEND exhausts the RC retries, the QP fails.
        let spec = storport_srp::storport::host::RequestSpec::scsi_in(
            storport_srp::storport::Address::new(0, 0, 0),
            &kverbs_tests::rw_cdb(true, 0, 8),
            4096,
        );
        let id = s.submit(&spec, p);
        let o = s.wait(&[id], Duration::from_secs(10), None, p);
        assert_eq!(o[0].status.base(), SrbStatus::BUS_RESET, "{o:?}");
        assert!(
            s.wait_state(0, TargetState::Blocked, Duration::from_secs(2))
                || s.state(0) == TargetState::FailFast
        );
        // While blocked, I/O waits (BUSY, held by StorPort): submitted now,
        // it fails fast once fast_io_fail_tmo expires.
        let id = s.submit(&spec, p);
        assert!(s.wait_state(0, TargetState::FailFast, Duration::from_secs(5)));
        let o = s.wait(
            &[id],
            Duration::from_secs(10),
            Some(Duration::from_millis(100)),
            p,
        );
        assert_eq!(o[0].status.base(), SrbStatus::SELECTION_TIMEOUT, "{o:?}");
        assert!(s.wait_state(0, TargetState::Lost, Duration::from_secs(5)));
        let (o, _) = s.read(0, 0, 0, 8, SgShape::Contiguous, p);
        assert_eq!(o.status.base(), SrbStatus::NO_DEVICE, "{o:?}");
        // Healed too late: lost stays lost (no reconnect after dev_loss).
        s.fabric.set_link_faults(i, t, FaultConfig::default());
        s.fabric.set_link_faults(t, i, FaultConfig::default());
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(s.state(0), TargetState::Lost);
    });
}

#[test]
fn recovery_from_fail_fast_when_the_link_heals() {
    let config = StackConfig {
        srp: SrpConfig {
            timeouts: Timeouts::new(
                Some(Duration::from_millis(50)),
                Some(Duration::from_millis(300)),
                Some(Duration::from_secs(30)),
            )
            .unwrap(),
            ..StackConfig::default().srp
        },
        ..StackConfig::default()
    };
    Stack::run(&config, |s, p| {
        let cut = FaultConfig {
            drop: 1.0,
            ..FaultConfig::default()
        };
        let (i, t) = (&s.initiator, &s.targets[0].hca);
        s.fabric.set_link_faults(i, t, cut);
        s.fabric.set_link_faults(t, i, cut);
        let (o, _) = s.read(0, 0, 0, 8, SgShape::Contiguous, p);
        assert_eq!(o.status.base(), SrbStatus::BUS_RESET, "{o:?}");
        assert!(s.wait_state(0, TargetState::FailFast, Duration::from_secs(5)));
        s.fabric.set_link_faults(i, t, FaultConfig::default());
        s.fabric.set_link_faults(t, i, FaultConfig::default());
        assert!(s.wait_state(0, TargetState::Live, Duration::from_secs(10)));
        let st = s.stats(0, p);
        assert!(st.connect_attempts >= 2, "reconnected: {st:?}");
        let (o, _) = s.read(0, 0, 0, 8, SgShape::Contiguous, p);
        assert_eq!(o.status.base(), SrbStatus::SUCCESS);
    });
}
