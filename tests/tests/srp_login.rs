//! Full stack, logins: every SRP reject reason, a CM-level reject, the
//! direct-only retry, the IB CM form, and multichannel with an extra
//! channel the target refuses.

use std::time::Duration;

use kverbs::platform::host::VerifierAllocator;
use kverbs_tests::srp_target::Misbehaviour;
use kverbs_tests::{Stack, StackConfig, TargetSetup, Workload};
use storport_srp::miniport::transport::TargetState;
use storport_srp::srp::login::LoginFailure;
use storport_srp::storport::SrbStatus;
use storport_srp::storport::host::SgShape;
use storport_srp::wire::srp::{BufFormats, MultiChannelResult, RejectReason};

#[global_allocator]
static ALLOCATOR: VerifierAllocator = VerifierAllocator;

fn io_works(s: &Stack, p: &kverbs::irql::Passive<'_>) {
    let mut w = Workload::new(1);
    let data = w.bytes(4096);
    let o = s.write(0, 0, 8, &data, SgShape::Pages, p);
    assert_eq!(o.status.base(), SrbStatus::SUCCESS, "{o:?}");
    let (o, back) = s.read(0, 0, 8, 8, SgShape::Contiguous, p);
    assert_eq!(o.status.base(), SrbStatus::SUCCESS, "{o:?}");
    assert_eq!(back, data);
}

#[test]
fn every_reject_reason_is_reported_then_retried() {
    let reasons = [
        RejectReason::UnableEstablishChannel,
        RejectReason::InsufficientResources,
        RejectReason::ReqItIuLengthTooLarge,
        RejectReason::UnableAssociateChannel,
        RejectReason::MultiChannelUnsupported,
        RejectReason::ChannelLimitReached,
        RejectReason::Other(0x0001_00ff),
    ];
    for reason in reasons {
        let mut t = TargetSetup::standard();
        t.misbehave.push(Misbehaviour::RejectLogins {
            reason,
            count: Some(2),
        });
        let config = StackConfig {
            targets: vec![t],
            ..StackConfig::default()
        };
        Stack::run(&config, |s, p| {
            let st = s.stats(0, p);
            assert_eq!(st.login_failures, 2, "{reason:?}: {st:?}");
            assert_eq!(
                st.last_login_failure,
                LoginFailure::Rejected(reason).code(),
                "{reason:?}"
            );
            assert_eq!(st.logins, 1);
            assert_eq!(st.direct_only_retries, 0);
            assert_eq!(st.connect_attempts, 3, "first login and two retries");
            io_works(s, p);
        });
    }
}

#[test]
fn unsupported_descriptor_format_retries_direct_only_at_once() {
    let mut t = TargetSetup::standard().keys("cmd_sg_entries=255,sg_tablesize=1024");
    t.misbehave.push(Misbehaviour::RejectLogins {
        reason: RejectReason::UnsupportedDescriptorFormat,
        count: Some(1),
    });
    let config = StackConfig {
        targets: vec![t],
        ..StackConfig::default()
    };
    Stack::run(&config, |s, p| {
        let st = s.stats(0, p);
        assert_eq!(st.direct_only_retries, 1, "{st:?}");
        assert_eq!(st.connect_attempts, 1, "retried within the same attempt");
        let n = s.transport().negotiated(0, 0, p).unwrap();
        assert_eq!(n.formats, BufFormats::DIRECT);
        io_works(s, p);
        // One MR covers a buffer of one MDL (up to 512 pages): a direct
        // descriptor carries it.
        let mut w = Workload::new(2);
        let data = w.bytes(1 << 20);
        let o = s.write(0, 0, 0, &data, SgShape::Pages, p);
        assert_eq!(o.status.base(), SrbStatus::SUCCESS, "{o:?}");
        // A buffer with gaps needs several descriptors: not carried.
        let o = s.write(0, 0, 0, &data[..65536], SgShape::Odd { seed: 5 }, p);
        assert_eq!(o.status.base(), SrbStatus::INVALID_REQUEST, "{o:?}");
        assert_eq!(s.stats(0, p).indirect_commands, 0);
    });
}

#[test]
fn no_listener_is_retried_and_the_target_never_appears() {
    let mut t = TargetSetup::standard();
    t.dest_port = Some(5556);
    let config = StackConfig {
        targets: vec![t],
        wait_live: false,
        ..StackConfig::default()
    };
    Stack::run(&config, |s, p| {
        let cm_reject = LoginFailure::CmRejected(kverbs::wire::RejectReason::InvalidServiceId);
        assert!(s.wait_until(Duration::from_secs(10), || {
            s.stats(0, p).login_failures >= 3
        }));
        let st = s.stats(0, p);
        assert_eq!(st.last_login_failure, cm_reject.code(), "{st:?}");
        assert_eq!(st.logins, 0);
        assert_eq!(s.state(0), TargetState::Connecting);
        // StorPort's requests to it are refused as "no such target yet".
        let (o, _) = s.read(0, 0, 0, 1, SgShape::Contiguous, p);
        assert_eq!(o.status.base(), SrbStatus::SELECTION_TIMEOUT, "{o:?}");
    });
}

#[test]
fn ib_cm_form_logs_in() {
    let mut t = TargetSetup::standard();
    t.ib_cm = true;
    t.config.rdma_cm_port = None;
    let config = StackConfig {
        targets: vec![t],
        ..StackConfig::default()
    };
    Stack::run(&config, |s, p| {
        assert!(s.targets[0].add_target.contains("service_id="));
        io_works(s, p);
    });
}

#[test]
fn extra_channels_the_target_refuses_reduce_the_count() {
    let mut t = TargetSetup::standard().keys("ch_count=4");
    t.config.max_channels = 2;
    let config = StackConfig {
        targets: vec![t],
        ..StackConfig::default()
    };
    Stack::run(&config, |s, p| {
        let st = s.stats(0, p);
        assert_eq!(st.channels, 2, "{st:?}");
        assert_eq!(st.live_channels, 2);
        assert_eq!(st.login_failures, 1);
        assert_eq!(
            s.transport().negotiated(0, 1, p).unwrap().multichannel,
            MultiChannelResult::Maintained
        );
        let mut w = Workload::new(3);
        let ios = w.ios(200, 0, 0, 512, 32768, 512, 32768, 0.5);
        for d in s.run_ios(&ios, 32, p) {
            assert_eq!(d.outcome.status.base(), SrbStatus::SUCCESS);
        }
    });
}
