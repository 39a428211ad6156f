//! Full stack over iSER, the fault matrix: a dropped connection under load
//! is reinstated (ERL0); a target invalidating a key it was not given ends
//! the connection; a target-requested logout; packet loss and reordering
//! (seeded); a QP error mid-I/O; CmdSN window starvation and reopening;
//! rejected logins of each class; ABORT TASK and LOGICAL UNIT RESET under
//! load; a StorPort timeout and a bus reset during I/O; fail-fast and
//! device loss; a target that stops answering NOP-Out. After each: every
//! request completed exactly once, data intact (checked against the
//! medium) or a truthful status, no connection or CM consumer left, the
//! verifier clean ([`IserStack::run`]'s teardown). `KV_ISER_FAULT_SEEDS`
//! and `KV_ISER_FAULT_IOS` scale the lossy runs.

use std::time::Duration;

use hca_lowlevel::sim::FaultConfig;
use kverbs::platform::host::VerifierAllocator;
use kverbs_tests::driver::{light_loss, retry_failed, rough_link, truthful, with_fault};
use kverbs_tests::interop::wait_until;
use kverbs_tests::iser::{IserSetup, IserStack, IserStackConfig};
use kverbs_tests::{Io, IoDone, Workload, env_count};
use kverbs_tools::iser_target::IserMisbehaviour;
use storport_srp::miniport::transport::TargetState;
use storport_srp::storport::host::{ModelConfig, RequestSpec, SgShape};
use storport_srp::storport::{Address, SrbStatus};
use storport_srp::wire::iscsi::AsyncEvent;

#[global_allocator]
static ALLOCATOR: VerifierAllocator = VerifierAllocator;

fn pages(mut ios: Vec<kverbs_tests::Io>) -> Vec<kverbs_tests::Io> {
    for io in &mut ios {
        io.shape = SgShape::Pages;
    }
    ios
}

#[test]
fn session_drop_under_load_is_reinstated() {
    IserStack::run(&IserStackConfig::default(), |s, p| {
        let mut w = Workload::new(42);
        let ios = pages(w.disjoint_ios(128, 0, 0, 512, 32768, 4096, 65536, 0.5));
        let ids: Vec<u32> = ios.iter().map(|io| s.submit(&io.request(), p)).collect();
        s.target(0).drop_connections(p);
        let outs = s.wait(&ids, Duration::from_secs(60), p);
        for (io, (id, o)) in ios.iter().zip(ids.iter().zip(&outs)) {
            assert_eq!(o.completions, 1, "{o:?}");
            if o.status.base() == SrbStatus::SUCCESS {
                let data = s.model.data(*id).unwrap_or_default();
                s.check(
                    io,
                    &kverbs_tests::IoDone {
                        id: *id,
                        outcome: o.clone(),
                        data,
                    },
                );
            }
        }
        assert!(s.wait_state(0, TargetState::Live, Duration::from_secs(20)));
        let st = s.stats(0, p);
        assert!(st.logins >= 2, "{st:?}");
        // After reinstatement the data path works.
        let data = w.bytes(16384);
        let o = s.write(0, 0, 7, &data, SgShape::Pages, p);
        assert_eq!(o.status.base(), SrbStatus::SUCCESS);
        assert_eq!(s.medium(0, 0, 7, 32), data);
    });
}

#[test]
fn bogus_remote_invalidation_ends_the_connection() {
    IserStack::run(&IserStackConfig::default(), |s, p| {
        s.target(0).set_rdma_misbehaviour(IserMisbehaviour {
            bogus_invalidate: true,
            ..Default::default()
        });
        let (o, _) = s.read(0, 0, 0, 16, SgShape::Pages, p);
        assert_ne!(o.status.base(), SrbStatus::SUCCESS, "{o:?}");
        assert_eq!(o.completions, 1);
        let st = s.stats(0, p);
        // The HCA refuses to invalidate a key that is not a live MR of the
        // QP's PD (a receive error, code 1); a live key of another command
        // is caught by the engine's check (code 5).
        // The HCA's refusal may be seen first as the QP's fatal event
        // (code 2).
        assert!(
            matches!(st.last_failure, 1 | 2 | 5),
            "bogus invalidate: {st:?}"
        );
        assert_eq!(st.remote_invalidations, 0, "{st:?}");
        s.target(0)
            .set_rdma_misbehaviour(IserMisbehaviour::default());
        assert!(s.wait_state(0, TargetState::Live, Duration::from_secs(20)));
        let (o, _) = s.read(0, 0, 0, 16, SgShape::Pages, p);
        assert_eq!(o.status.base(), SrbStatus::SUCCESS);
    });
}

#[test]
fn target_logout_request_then_relogin() {
    IserStack::run(&IserStackConfig::default(), |s, p| {
        s.target(0).send_async(AsyncEvent::RequestLogout, 0, 2, p);
        assert!(s.wait_until(Duration::from_secs(20), || s.stats(0, p).logins >= 2));
        assert!(s.wait_state(0, TargetState::Live, Duration::from_secs(20)));
        let mut w = Workload::new(1);
        let data = w.bytes(4096);
        let o = s.write(0, 1, 3, &data, SgShape::Contiguous, p);
        assert_eq!(o.status.base(), SrbStatus::SUCCESS);
        assert!(s.target(0).with_logic(|l| l.counters().logouts) >= 1);
    });
}

/// Buffers one MR maps (iSER has one STag per direction).
fn mappable(mut ios: Vec<Io>) -> Vec<Io> {
    for (i, io) in ios.iter_mut().enumerate() {
        io.shape = if i % 2 == 0 {
            SgShape::Pages
        } else {
            SgShape::Contiguous
        };
    }
    ios
}

fn set_link(s: &IserStack, faults: FaultConfig) {
    s.fabric.set_link_faults(&s.initiator, &s.hcas[0], faults);
    s.fabric.set_link_faults(&s.hcas[0], &s.initiator, faults);
}

/// Runs a seeded workload over a faulty link; returns the failed count and
/// the faults the fabric injected.
fn lossy(faults: FaultConfig, seed: u64, allowed: &[SrbStatus]) -> (usize, u64) {
    let config = IserStackConfig {
        seed,
        ..IserStackConfig::default()
    };
    IserStack::run(&config, |s, p| {
        set_link(s, faults);
        let mut w = Workload::new(seed);
        let n = env_count("KV_ISER_FAULT_IOS", 120);
        let ios = mappable(w.ios(n, 0, 0, 512, 32768, 512, 65536, 0.5));
        let done = s.run_ios(&ios, 16, p);
        if !allowed.contains(&SrbStatus::BUS_RESET) {
            let st = s.stats(0, p);
            assert_eq!(st.transport_failures, 0, "{st:?} {:?}", s.fabric.stats());
        }
        let failed = truthful(&done, allowed);
        let stats = s.fabric.stats();
        set_link(s, FaultConfig::default());
        if failed > 0 {
            assert!(s.wait_state(0, TargetState::Live, Duration::from_secs(20)));
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
    for seed in 0..env_count("KV_ISER_FAULT_SEEDS", 2) as u64 {
        let (failed, faults) = lossy(light_loss(), 300 + seed, &[]);
        assert_eq!(failed, 0);
        assert!(faults > 0, "frames were lost");
    }
}

#[test]
fn reordering_duplication_and_corruption() {
    // Heavy reordering can exhaust the RC retry budget: the connection then
    // fails, the session is reinstated, and the requests it took fail for
    // retry — never silently.
    for seed in 0..env_count("KV_ISER_FAULT_SEEDS", 2) as u64 {
        let (_, faults) = lossy(rough_link(), 400 + seed, &[SrbStatus::BUS_RESET]);
        assert!(faults > 0);
    }
}

#[test]
fn qp_error_mid_io_fails_outstanding_for_retry_and_reinstates() {
    IserStack::run(&IserStackConfig::default(), |s, p| {
        let qpn = s.transport().qpn(0, p).expect("a live QP");
        let mut w = Workload::new(5);
        let ios = mappable(w.ios(400, 0, 0, 512, 32768, 4096, 65536, 0.5));
        let (fabric, initiator, target) = (&s.fabric, &s.initiator, s.target(0));
        // The error lands once the target has taken 64 commands of this
        // run: a fixed delay sometimes hit before the first was posted
        // (nothing outstanding, nothing fenced, the test then failed).
        let start = target.counters().scsi_commands;
        let done = with_fault(
            s,
            &ios,
            32,
            Duration::ZERO,
            move || {
                let under_way = wait_until(Duration::from_secs(30), || {
                    target.counters().scsi_commands >= start + 64
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
        assert!(s.wait_state(0, TargetState::Live, Duration::from_secs(20)));
        let st = s.stats(0, p);
        assert!(
            st.transport_failures >= 1 && st.fenced_by_flush > 0,
            "{st:?}"
        );
        assert!(st.logins >= 2, "{st:?}");
        assert_ne!(s.transport().qpn(0, p), Some(qpn), "a new QP");
        retry_failed(s, &ios, &done, p);
    });
}

#[test]
fn cmd_sn_window_starvation_then_reopened() {
    IserStack::run(&IserStackConfig::default(), |s, p| {
        // The target keeps MaxCmdSN where it is for its next 128
        // completions: the window (128) closes after 128 commands.
        s.target(0)
            .with_logic(|l| l.misbehaviour.withhold_max_cmd_sn = 128);
        let mut w = Workload::new(12);
        let ios = mappable(w.disjoint_ios(200, 0, 0, 512, 32768, 512, 8192, 0.5));
        let ids: Vec<u32> = ios.iter().map(|io| s.submit(&io.request(), p)).collect();
        let done_count = || ids.iter().filter(|id| s.done(**id)).count();
        assert!(s.wait_until(Duration::from_secs(20), || {
            s.model.pump(p);
            done_count() >= 128 && s.stats(0, p).busy > 0
        }));
        // Starved: nothing more is sent while the window stays shut.
        std::thread::sleep(Duration::from_millis(200));
        s.model.pump(p);
        assert_eq!(done_count(), 128, "commands past a closed window");
        assert_eq!(
            s.target(0).with_logic(|l| l.counters().out_of_window),
            0,
            "the initiator respected MaxCmdSN"
        );
        assert_eq!(s.state(0), TargetState::Live);
        s.target(0).open_window(p);
        let outs = s.wait(&ids, Duration::from_secs(30), p);
        for (io, (id, o)) in ios.iter().zip(ids.iter().zip(&outs)) {
            assert_eq!(o.completions, 1, "{o:?}");
            assert_eq!(o.status.base(), SrbStatus::SUCCESS, "{o:?}");
            let data = s.model.data(*id).unwrap_or_default();
            s.check(
                io,
                &IoDone {
                    id: *id,
                    outcome: o.clone(),
                    data,
                },
            );
        }
        let st = s.stats(0, p);
        assert_eq!(st.transport_failures, 0, "{st:?}");
        assert_eq!(st.logins, 1, "{st:?}");
    });
}

fn arm_reject(s: &IserStack, class: u8, detail: u8, redirect: Option<&str>) {
    s.target(0).with_logic(|l| {
        l.misbehaviour.reject_login = Some((class, detail));
        l.misbehaviour.redirect_address = redirect.map(str::to_owned);
    });
}

fn clear_reject(s: &IserStack) {
    s.target(0).with_logic(|l| {
        l.misbehaviour.reject_login = None;
        l.misbehaviour.redirect_address = None;
    });
}

#[test]
fn rejected_login_initiator_error_fails_fast_then_recovers() {
    // Initiator error (class 2, 0x03 not found): retrying will not fix
    // it soon, so I/O fails fast at once; reconnects go on.
    IserStack::run(&IserStackConfig::default(), |s, p| {
        arm_reject(s, 2, 0x03, None);
        s.target(0).drop_connections(p);
        assert!(s.wait_state(0, TargetState::FailFast, Duration::from_secs(20)));
        let st = s.stats(0, p);
        assert!(st.login_failures >= 1, "{st:?}");
        let (o, _) = s.read(0, 0, 0, 8, SgShape::Contiguous, p);
        assert_eq!(o.status.base(), SrbStatus::SELECTION_TIMEOUT, "{o:?}");
        assert_eq!(o.completions, 1);
        clear_reject(s);
        assert!(s.wait_state(0, TargetState::Live, Duration::from_secs(20)));
        let (o, _) = s.read(0, 0, 0, 8, SgShape::Contiguous, p);
        assert_eq!(o.status.base(), SrbStatus::SUCCESS, "{o:?}");
    });
}

#[test]
fn rejected_login_target_error_is_retried() {
    // Target error (class 3, 0x01 service unavailable): retried after the
    // reconnect delay; I/O waits (the target is not failed fast).
    IserStack::run(&IserStackConfig::default(), |s, p| {
        arm_reject(s, 3, 0x01, None);
        s.target(0).drop_connections(p);
        assert!(s.wait_until(Duration::from_secs(20), || {
            s.stats(0, p).login_failures >= 2
        }));
        assert_ne!(s.state(0), TargetState::FailFast);
        assert_ne!(s.state(0), TargetState::Live);
        // Submitted while the target refuses: held, then served.
        let spec = RequestSpec::scsi_in(
            Address::new(0, 0, 0),
            &kverbs_tests::rw_cdb(true, 0, 8),
            4096,
        );
        let id = s.submit(&spec, p);
        std::thread::sleep(Duration::from_millis(100));
        s.model.pump(p);
        assert!(!s.done(id), "held while the target is unavailable");
        clear_reject(s);
        let o = s.wait(&[id], Duration::from_secs(20), p);
        assert_eq!(o[0].status.base(), SrbStatus::SUCCESS, "{o:?}");
        assert_eq!(o[0].completions, 1);
    });
}

#[test]
fn rejected_login_authentication_failure_fails_fast() {
    // The target demands CHAP the node record has no secret for, then
    // answers authentication failure (class 2, 0x01): fatal login errors,
    // reported as fail-fast.
    IserStack::run(&IserStackConfig::default(), |s, p| {
        s.target(0)
            .with_logic(|l| l.misbehaviour.demand_chap = true);
        s.target(0).drop_connections(p);
        assert!(s.wait_state(0, TargetState::FailFast, Duration::from_secs(20)));
        assert!(s.stats(0, p).login_failures >= 1);
        let (o, _) = s.read(0, 0, 0, 8, SgShape::Contiguous, p);
        assert_eq!(o.status.base(), SrbStatus::SELECTION_TIMEOUT, "{o:?}");
        s.target(0)
            .with_logic(|l| l.misbehaviour.demand_chap = false);
        assert!(s.wait_state(0, TargetState::Live, Duration::from_secs(20)));
        let before = s.stats(0, p).login_failures;
        arm_reject(s, 2, 0x01, None);
        s.target(0).drop_connections(p);
        assert!(s.wait_state(0, TargetState::FailFast, Duration::from_secs(20)));
        assert!(s.stats(0, p).login_failures > before);
        clear_reject(s);
        assert!(s.wait_state(0, TargetState::Live, Duration::from_secs(20)));
    });
}

#[test]
fn rejected_login_redirect_is_followed_to_the_named_portal() {
    // Two portals of the same target name. The first answers a temporary
    // redirect (class 1, detail 1) naming the second: the engine logs in
    // there at once (no reconnect delay, no fail-fast) and its I/O lands
    // there. The redirect holds for that connection only: when it drops,
    // the engine goes back to the configured portal.
    let config = IserStackConfig {
        targets: vec![IserSetup::standard(), IserSetup::standard()],
        ..IserStackConfig::default()
    };
    IserStack::run(&config, |s, p| {
        let [a, b, c, d] = kverbs_tests::target_ip(1);
        let second = format!("{a}.{b}.{c}.{d}:{},1", s.target(1).port());
        let before = s.target(1).counters().connections;
        arm_reject(s, 1, 0x01, Some(&second));
        s.target(0).drop_connections(p);
        assert!(s.wait_until(Duration::from_secs(20), || {
            s.stats(0, p).logins >= 2 && s.state(0) == TargetState::Live
        }));
        let st = s.stats(0, p);
        // On a loaded machine a connect to the new portal may time out
        // (then the configured portal is tried again and redirects again).
        assert!(st.login_failures >= 1, "{st:?}");
        assert!(s.target(1).counters().connections > before);
        let data = Workload::new(31).bytes(8192);
        let o = s.write(0, 0, 40, &data, SgShape::Pages, p);
        assert_eq!(o.status.base(), SrbStatus::SUCCESS, "{o:?}");
        assert_eq!(s.medium(1, 0, 40, 16), data, "written at the named portal");
        assert_ne!(s.medium(0, 0, 40, 16), data);
        // Back to the configured portal once the redirected connection ends.
        clear_reject(s);
        let logins = s.stats(0, p).logins;
        s.target(1).drop_connections(p);
        assert!(s.wait_until(Duration::from_secs(20), || {
            s.stats(0, p).logins > logins && s.state(0) == TargetState::Live
        }));
        let o = s.write(0, 0, 80, &data, SgShape::Contiguous, p);
        assert_eq!(o.status.base(), SrbStatus::SUCCESS, "{o:?}");
        assert_eq!(
            s.medium(0, 0, 80, 16),
            data,
            "written at the configured portal"
        );
    });
}

#[test]
fn rejected_login_redirect_to_an_unreachable_portal_falls_back() {
    // A redirect to a portal nobody answers: the connect there fails, the
    // next attempt goes to the configured portal again; I/O waits (no
    // fail-fast) and the session comes back once the redirect stops.
    IserStack::run(&IserStackConfig::default(), |s, p| {
        arm_reject(s, 1, 0x01, Some("10.0.0.99:3260,1"));
        s.target(0).drop_connections(p);
        assert!(s.wait_until(Duration::from_secs(20), || {
            s.stats(0, p).login_failures >= 3
        }));
        assert!(
            s.target(0).counters().connections >= 3,
            "the configured portal is tried again"
        );
        assert_ne!(s.state(0), TargetState::FailFast);
        clear_reject(s);
        assert!(s.wait_state(0, TargetState::Live, Duration::from_secs(20)));
        let (o, _) = s.read(0, 0, 0, 8, SgShape::Contiguous, p);
        assert_eq!(o.status.base(), SrbStatus::SUCCESS, "{o:?}");
    });
}

/// Holds every SCSI Response back until released.
fn hold(s: &IserStack, on: bool) {
    s.target(0)
        .with_logic(|l| l.misbehaviour.hold_responses = on);
}

#[test]
fn abort_task_under_load() {
    IserStack::run(&IserStackConfig::default(), |s, p| {
        hold(s, true);
        let mut w = Workload::new(21);
        let ios = mappable(w.disjoint_ios(60, 0, 0, 512, 32768, 512, 16384, 0.5));
        let ids: Vec<u32> = ios.iter().map(|io| s.submit(&io.request(), p)).collect();
        assert!(s.wait_until(Duration::from_secs(20), || {
            s.model.pump(p);
            s.target(0).counters().scsi_commands >= 60
        }));
        assert!(ids.iter().all(|id| !s.done(*id)), "responses are held");
        let victims: Vec<u32> = ids.iter().copied().step_by(6).collect();
        let aborts: Vec<u32> = victims
            .iter()
            .map(|v| s.submit(&RequestSpec::abort(Address::new(0, 0, 0), *v), p))
            .collect();
        for o in s.wait(&aborts, Duration::from_secs(20), p) {
            assert_eq!(o.status.base(), SrbStatus::SUCCESS, "{o:?}");
            assert_eq!(o.completions, 1);
        }
        for o in s.wait(&victims, Duration::from_secs(5), p) {
            assert_eq!(o.status.base(), SrbStatus::ABORTED, "{o:?}");
            assert_eq!(o.completions, 1);
            assert_eq!(o.data_transfer_length, 0);
        }
        assert_eq!(
            s.target(0).with_logic(|l| l.counters().aborted),
            victims.len() as u64
        );
        assert_eq!(s.stats(0, p).tmfs, victims.len() as u64);
        hold(s, false);
        s.target(0).release_responses(p);
        let outs = s.wait(&ids, Duration::from_secs(20), p);
        for ((io, id), o) in ios.iter().zip(&ids).zip(&outs) {
            assert_eq!(o.completions, 1, "{o:?}");
            if victims.contains(id) {
                continue;
            }
            assert_eq!(o.status.base(), SrbStatus::SUCCESS, "{o:?}");
            let data = s.model.data(*id).unwrap_or_default();
            s.check(
                io,
                &IoDone {
                    id: *id,
                    outcome: o.clone(),
                    data,
                },
            );
        }
        assert_eq!(s.stats(0, p).transport_failures, 0);
    });
}

#[test]
fn lun_reset_under_load() {
    IserStack::run(&IserStackConfig::default(), |s, p| {
        hold(s, true);
        let mut w = Workload::new(22);
        let lun0 = mappable(w.disjoint_ios(30, 0, 0, 512, 32768, 512, 8192, 0.5));
        let lun1 = mappable(w.disjoint_ios(20, 0, 1, 4096, 4096, 4096, 16384, 0.5));
        let ids0: Vec<u32> = lun0.iter().map(|io| s.submit(&io.request(), p)).collect();
        let ids1: Vec<u32> = lun1.iter().map(|io| s.submit(&io.request(), p)).collect();
        assert!(s.wait_until(Duration::from_secs(20), || {
            s.model.pump(p);
            s.target(0).counters().scsi_commands >= 50
        }));
        let reset = s.submit(
            &RequestSpec::function(
                storport_srp::storport::SrbFunction::ResetLogicalUnit,
                Address::new(0, 0, 0),
            ),
            p,
        );
        let o = s.wait(&[reset], Duration::from_secs(20), p);
        assert_eq!(o[0].status.base(), SrbStatus::SUCCESS, "{o:?}");
        // Every command of the reset LUN ended with it, none succeeded
        // (their responses were never sent).
        assert!(
            ids0.iter().all(|id| s.done(*id)),
            "a LUN 0 command outlived the reset"
        );
        for o in s.wait(&ids0, Duration::from_secs(1), p) {
            assert_eq!(o.completions, 1, "{o:?}");
            assert!(
                matches!(o.status.base(), SrbStatus::BUS_RESET | SrbStatus::ABORTED),
                "{o:?}"
            );
            assert_eq!(o.data_transfer_length, 0);
        }
        // The other LUN's commands are untouched.
        assert!(ids1.iter().all(|id| !s.done(*id)));
        hold(s, false);
        s.target(0).release_responses(p);
        let outs = s.wait(&ids1, Duration::from_secs(20), p);
        for ((io, id), o) in lun1.iter().zip(&ids1).zip(&outs) {
            assert_eq!(o.status.base(), SrbStatus::SUCCESS, "{o:?}");
            let data = s.model.data(*id).unwrap_or_default();
            s.check(
                io,
                &IoDone {
                    id: *id,
                    outcome: o.clone(),
                    data,
                },
            );
        }
        let (o, _) = s.read(0, 0, 0, 8, SgShape::Pages, p);
        assert_eq!(o.status.base(), SrbStatus::SUCCESS);
        assert_eq!(s.stats(0, p).transport_failures, 0);
    });
}

fn resetting_model() -> IserStackConfig {
    IserStackConfig {
        model: ModelConfig {
            max_requests: 8192,
            reset_grace: Duration::from_secs(5),
            ..ModelConfig::default()
        },
        ..IserStackConfig::default()
    }
}

#[test]
fn storport_timeout_resets_the_bus() {
    IserStack::run(&resetting_model(), |s, p| {
        hold(s, true);
        let spec = RequestSpec::scsi_in(
            Address::new(0, 0, 0),
            &kverbs_tests::rw_cdb(true, 0, 8),
            4096,
        )
        .timeout(10);
        let id = s.submit(&spec, p);
        std::thread::sleep(Duration::from_millis(50));
        s.model.pump(p);
        assert!(!s.done(id));
        hold(s, false);
        s.model.advance(Duration::from_secs(11), p);
        let o = s.wait_ticking(
            &[id],
            Duration::from_secs(20),
            Duration::from_millis(100),
            p,
        );
        assert_eq!(o[0].status.base(), SrbStatus::BUS_RESET, "{o:?}");
        assert_eq!(o[0].completions, 1);
        assert!(s.model.stats().bus_resets >= 1);
        assert!(s.wait_state(0, TargetState::Live, Duration::from_secs(20)));
        let (o, _) = s.read(0, 0, 0, 8, SgShape::Contiguous, p);
        assert_eq!(o.status.base(), SrbStatus::SUCCESS, "{o:?}");
    });
}

#[test]
fn bus_reset_during_io() {
    IserStack::run(&resetting_model(), |s, p| {
        let mut w = Workload::new(9);
        let ios = mappable(w.ios(300, 0, 0, 512, 32768, 512, 65536, 0.5));
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
        assert!(s.wait_state(0, TargetState::Live, Duration::from_secs(20)));
        retry_failed(s, &ios, &done, p);
    });
}

fn timeouts(fast_fail: u32, dev_loss: u32) -> IserStackConfig {
    let setup = IserSetup::standard()
        .key(
            "node.session.timeo.replacement_timeout",
            &fast_fail.to_string(),
        )
        .key("node.session.timeo.dev_loss_tmo", &dev_loss.to_string());
    IserStackConfig {
        targets: vec![setup],
        ..IserStackConfig::default()
    }
}

fn cut() -> FaultConfig {
    FaultConfig {
        drop: 1.0,
        ..FaultConfig::default()
    }
}

fn read8() -> RequestSpec {
    RequestSpec::scsi_in(
        Address::new(0, 0, 0),
        &kverbs_tests::rw_cdb(true, 0, 8),
        4096,
    )
}

#[test]
fn fail_fast_then_device_loss() {
    IserStack::run(&timeouts(1, 3), |s, p| {
        set_link(s, cut());
        // A read notices: its SEND exhausts the RC retries, the QP fails.
        let id = s.submit(&read8(), p);
        let o = s.wait(&[id], Duration::from_secs(20), p);
        assert_eq!(o[0].status.base(), SrbStatus::BUS_RESET, "{o:?}");
        assert!(
            s.wait_state(0, TargetState::Blocked, Duration::from_secs(2))
                || s.state(0) == TargetState::FailFast
        );
        // While blocked, I/O waits; it fails fast once fast_io_fail passes.
        let id = s.submit(&read8(), p);
        assert!(s.wait_state(0, TargetState::FailFast, Duration::from_secs(5)));
        let o = s.wait(&[id], Duration::from_secs(10), p);
        assert_eq!(o[0].status.base(), SrbStatus::SELECTION_TIMEOUT, "{o:?}");
        assert!(s.wait_state(0, TargetState::Lost, Duration::from_secs(10)));
        let (o, _) = s.read(0, 0, 0, 8, SgShape::Contiguous, p);
        assert_eq!(o.status.base(), SrbStatus::NO_DEVICE, "{o:?}");
        // Healed too late: lost stays lost.
        set_link(s, FaultConfig::default());
        std::thread::sleep(Duration::from_millis(1500));
        assert_eq!(s.state(0), TargetState::Lost);
    });
}

#[test]
fn recovery_from_fail_fast_when_the_link_heals() {
    IserStack::run(&timeouts(1, 60), |s, p| {
        set_link(s, cut());
        let (o, _) = s.read(0, 0, 0, 8, SgShape::Contiguous, p);
        assert_eq!(o.status.base(), SrbStatus::BUS_RESET, "{o:?}");
        assert!(s.wait_state(0, TargetState::FailFast, Duration::from_secs(10)));
        set_link(s, FaultConfig::default());
        assert!(s.wait_state(0, TargetState::Live, Duration::from_secs(20)));
        assert!(s.stats(0, p).connect_attempts >= 2);
        let (o, _) = s.read(0, 0, 0, 8, SgShape::Contiguous, p);
        assert_eq!(o.status.base(), SrbStatus::SUCCESS);
    });
}

#[test]
fn target_that_stops_answering_nop_out() {
    let setup = IserSetup::standard()
        .key("node.conn[0].timeo.noop_out_interval", "1")
        .key("node.conn[0].timeo.noop_out_timeout", "1");
    let config = IserStackConfig {
        targets: vec![setup],
        ..IserStackConfig::default()
    };
    IserStack::run(&config, |s, p| {
        // Answered pings keep the session up.
        std::thread::sleep(Duration::from_millis(2500));
        assert_eq!(s.stats(0, p).transport_failures, 0);
        assert!(s.target(0).with_logic(|l| l.counters().initiator_pings) >= 1);
        s.target(0).set_rdma_misbehaviour(IserMisbehaviour {
            ignore_nop_out: true,
            ..Default::default()
        });
        assert!(s.wait_until(Duration::from_secs(10), || {
            s.stats(0, p).transport_failures >= 1
        }));
        assert!(s.target(0).counters().nop_outs_ignored >= 1);
        s.target(0)
            .set_rdma_misbehaviour(IserMisbehaviour::default());
        assert!(s.wait_state(0, TargetState::Live, Duration::from_secs(20)));
        let (o, _) = s.read(0, 0, 0, 8, SgShape::Contiguous, p);
        assert_eq!(o.status.base(), SrbStatus::SUCCESS, "{o:?}");
    });
}
