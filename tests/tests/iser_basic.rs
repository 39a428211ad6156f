//! Full stack over iSER, first light: login over RDMA, INQUIRY-free
//! reads and writes verified against the medium, the negotiated iSER keys.

use std::time::Duration;

use kverbs::platform::host::VerifierAllocator;
use kverbs_tests::Workload;
use kverbs_tests::iser::{IserSetup, IserStack, IserStackConfig};
use kverbs_tools::iscsi_target::ChapSecret;
use storport_srp::miniport::transport::TargetState;
use storport_srp::storport::SrbStatus;
use storport_srp::storport::host::SgShape;

#[global_allocator]
static ALLOCATOR: VerifierAllocator = VerifierAllocator;

#[test]
fn login_then_write_and_read_back() {
    IserStack::run(&IserStackConfig::default(), |s, p| {
        let neg = s.transport().negotiated(0, p).expect("live session");
        assert_eq!(neg.max_recv_data_segment, 8192);
        assert!(neg.first_burst_length <= storport_srp::iser::UNSOLICITED_MAX);
        let mut w = Workload::new(7);
        let data = w.bytes(64 * 1024);
        let o = s.write(0, 0, 100, &data, SgShape::Contiguous, p);
        assert_eq!(o.status.base(), SrbStatus::SUCCESS, "{o:?}");
        assert_eq!(s.medium(0, 0, 100, 128), data);
        let (o, back) = s.read(0, 0, 100, 128, SgShape::Pages, p);
        assert_eq!(o.status.base(), SrbStatus::SUCCESS, "{o:?}");
        assert_eq!(back, data);
        let st = s.stats(0, p);
        assert!(st.remote_invalidate, "{st:?}");
        assert_eq!(st.remote_invalidations, 2, "{st:?}");
        assert_eq!(st.logins, 1);
    });
}

/// A target that checks the initiator's CHAP and proves itself back
/// (mutual CHAP), with the matching node-record keys.
fn mutual_chap_config() -> IserStackConfig {
    mutual_chap_config_expecting("target-secret-22")
}

/// [`mutual_chap_config`], with the initiator expecting the target to
/// prove `target_secret`.
fn mutual_chap_config_expecting(target_secret: &str) -> IserStackConfig {
    let mut setup = IserSetup::standard()
        .key("node.session.auth.authmethod", "CHAP")
        .key("node.session.auth.username", "kverbs-host")
        .key("node.session.auth.password", "initiator-secret-1")
        .key("node.session.auth.username_in", "lio-target")
        .key("node.session.auth.password_in", target_secret);
    setup.config.iscsi.auth_required = true;
    setup.config.iscsi.chap = Some(ChapSecret {
        user: "kverbs-host".into(),
        secret: b"initiator-secret-1".to_vec(),
    });
    setup.config.iscsi.mutual_chap = Some(ChapSecret {
        user: "lio-target".into(),
        secret: b"target-secret-22".to_vec(),
    });
    IserStackConfig {
        targets: vec![setup],
        ..IserStackConfig::default()
    }
}

#[test]
fn mutual_chap_draws_a_fresh_random_challenge_for_every_login() {
    // The challenge the initiator sends must be unforeseeable: it comes from
    // the platform's CSPRNG (getrandom here, BCryptGenRandom on NT), one per
    // connection attempt, never a counter or clock-seeded sequence.
    IserStack::run(&mutual_chap_config(), |s, p| {
        let o = s.write(0, 0, 8, &[0x5a; 4096], SgShape::Contiguous, p);
        assert_eq!(o.status.base(), SrbStatus::SUCCESS, "{o:?}");
        for round in 1..=3u64 {
            s.target(0).drop_connections(p);
            assert!(
                s.wait_until(Duration::from_secs(20), || s.stats(0, p).logins > round),
                "relogin {round}: {:?}",
                s.stats(0, p)
            );
            assert!(s.wait_state(0, TargetState::Live, Duration::from_secs(20)));
        }
        let (o, back) = s.read(0, 0, 8, 8, SgShape::Contiguous, p);
        assert_eq!(o.status.base(), SrbStatus::SUCCESS, "{o:?}");
        assert_eq!(back, vec![0x5a; 4096]);
        let seen = s.target(0).with_logic(|l| l.mutual_challenges().to_vec());
        assert!(seen.len() >= 4, "{seen:?}");
        for (i, c) in seen.iter().enumerate() {
            assert_eq!(c.len(), 16, "{c:?}");
            assert!(c.iter().any(|&b| b != 0), "{c:?}");
            assert!(!seen[..i].contains(c), "challenge {i} repeats: {seen:?}");
        }
    });
}

#[test]
fn mutual_chap_without_random_bytes_does_not_log_in() {
    // No entropy, no login: the attempt fails before it connects (the
    // target sees no login) and the reason is reported; once the generator
    // works again the session comes back.
    IserStack::run(&mutual_chap_config(), |s, p| {
        let challenges = s.target(0).with_logic(|l| l.mutual_challenges().len());
        s.platform.set_random_unavailable(true);
        let failures = s.stats(0, p).login_failures;
        s.target(0).drop_connections(p);
        assert!(
            s.wait_until(Duration::from_secs(20), || {
                s.stats(0, p).login_failures >= failures + 2
            }),
            "{:?}",
            s.stats(0, p)
        );
        let st = s.stats(0, p);
        assert_eq!(st.last_failure, 13, "{st:?}");
        assert_eq!(st.logins, 1, "{st:?}");
        assert_ne!(s.state(0), TargetState::Live);
        assert_eq!(
            s.target(0).with_logic(|l| l.mutual_challenges().len()),
            challenges
        );
        s.platform.set_random_unavailable(false);
        assert!(s.wait_state(0, TargetState::Live, Duration::from_secs(20)));
        let (o, _) = s.read(0, 0, 0, 8, SgShape::Contiguous, p);
        assert_eq!(o.status.base(), SrbStatus::SUCCESS, "{o:?}");
        assert_eq!(s.stats(0, p).logins, 2);
    });
}

#[test]
fn the_targets_pings_are_answered_and_counted() {
    // A target pings with an unsolicited NOP-In carrying a target transfer
    // tag; the initiator echoes it in a NOP-Out or loses the connection.
    // Each answer is counted once, and the session carries on.
    IserStack::run(&IserStackConfig::default(), |s, p| {
        for n in 1..=3u64 {
            s.target(0).send_ping(p);
            assert!(
                s.wait_until(Duration::from_secs(10), || {
                    s.stats(0, p).target_pings_answered == n
                }),
                "ping {n}: {:?}",
                s.stats(0, p)
            );
        }
        let o = s.write(0, 0, 8, &[0x3c; 4096], SgShape::Contiguous, p);
        assert_eq!(o.status.base(), SrbStatus::SUCCESS, "{o:?}");
        let st = s.stats(0, p);
        assert_eq!(
            (st.target_pings_answered, st.logins, st.transport_failures),
            (3, 1, 0),
            "{st:?}"
        );
    });
}

#[test]
fn a_target_that_fails_mutual_chap_gets_no_session_and_the_stack_still_stops() {
    // The initiator expects a different target secret: it refuses the
    // target's proof (a fatal login failure: the target fails I/O fast at
    // once), keeps retrying on the normal schedule, and an adapter stop in
    // the middle of that ends every connection and CM id (finish checks).
    let mut config = mutual_chap_config_expecting("not-the-target22");
    config.wait_live = false;
    IserStack::run(&config, |s, p| {
        assert!(
            s.wait_state(0, TargetState::FailFast, Duration::from_secs(20)),
            "{:?}",
            s.stats(0, p)
        );
        let st = s.stats(0, p);
        assert_eq!((st.logins, st.last_failure), (0, 11), "{st:?}");
        let (o, _) = s.read(0, 0, 0, 8, SgShape::Contiguous, p);
        assert_ne!(o.status.base(), SrbStatus::SUCCESS, "{o:?}");
        // Let a retry or two start before the stop.
        std::thread::sleep(Duration::from_millis(1500));
    });
}
