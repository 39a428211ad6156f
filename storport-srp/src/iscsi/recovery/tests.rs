use super::*;

fn timeouts(ff: Option<u32>, dl: Option<u32>) -> Timeouts {
    Timeouts {
        reconnect_delay: 2,
        fast_io_fail: ff,
        dev_loss: dl,
        ..Timeouts::default()
    }
}

const fn s(secs: u64) -> Millis {
    Millis(secs * 1000)
}

#[test]
fn first_connect_then_loss_and_reconnect() {
    let mut r = Recovery::new(&timeouts(Some(15), Some(60)), s(0));
    assert_eq!(r.state(), TargetState::Connecting);
    assert_eq!(r.admit(), Err(PrepareError::Blocked));
    assert_eq!(r.poll_at(), Some(s(0)));
    let step = r.handle_timeout(s(0));
    assert!(step.connect);
    assert_eq!(r.poll_at(), Some(s(15)), "no second attempt while one runs");
    assert_eq!(r.connected().state_changed, Some(TargetState::Live));
    assert_eq!(r.admit(), Ok(()));
    assert_eq!(r.poll_at(), None);

    // Lost at 100 s with the target's Time2Wait of 5: first retry at 105.
    let step = r.connection_lost(s(100), 5);
    assert_eq!(step.state_changed, Some(TargetState::Blocked));
    assert_eq!(r.outstanding_failure(), FailureKind::ConnectionReset);
    assert_eq!(r.poll_at(), Some(s(105)));
    assert!(!r.handle_timeout(s(104)).connect);
    assert!(r.handle_timeout(s(105)).connect);
    assert_eq!(
        r.attempt_failed(s(106), Disposition::Retry),
        RecoveryStep::default()
    );
    assert_eq!(r.poll_at(), Some(s(108)));
    assert!(r.handle_timeout(s(108)).connect);
    assert_eq!(r.connected().state_changed, Some(TargetState::Live));
    assert_eq!(r.failed_attempts(), 0);
}

#[test]
fn fast_fail_then_device_loss() {
    let mut r = Recovery::new(&timeouts(Some(15), Some(60)), s(0));
    r.handle_timeout(s(0));
    r.connected();
    r.connection_lost(s(10), 0);
    let mut t = 10;
    let mut fast_failed_at = None;
    let mut lost_at = None;
    while lost_at.is_none() {
        let at = r.poll_at().expect("timers run until lost");
        assert!(at.0 >= t * 1000);
        t = at.0 / 1000;
        let step = r.handle_timeout(at);
        match step.state_changed {
            Some(TargetState::FailFast) => fast_failed_at = Some(t),
            Some(TargetState::Lost) => lost_at = Some(t),
            _ => {}
        }
        if step.connect {
            r.attempt_failed(at, Disposition::Retry);
        }
    }
    assert_eq!(fast_failed_at, Some(25));
    assert_eq!(lost_at, Some(70));
    assert_eq!(
        r.admit(),
        Err(PrepareError::Failed(FailureKind::DeviceLost))
    );
    assert_eq!(r.outstanding_failure(), FailureKind::DeviceLost);
    assert_eq!(r.poll_at(), None);
    // Lost is terminal.
    assert_eq!(r.connected(), RecoveryStep::default());
    assert_eq!(r.state(), TargetState::Lost);
}

#[test]
fn fatal_login_errors_fail_fast_at_once_and_redirects_retry_at_once() {
    let mut r = Recovery::new(&timeouts(Some(120), Some(600)), s(0));
    assert!(r.handle_timeout(s(0)).connect);
    let step = r.attempt_failed(s(1), Disposition::Redirect);
    assert_eq!(step.state_changed, None);
    assert_eq!(r.poll_at(), Some(s(1)));
    assert!(r.handle_timeout(s(1)).connect);
    let step = r.attempt_failed(s(2), Disposition::Fatal);
    assert_eq!(step.state_changed, Some(TargetState::FailFast));
    assert_eq!(r.admit(), Err(PrepareError::Failed(FailureKind::FailFast)));
    // Reconnects go on, and succeed when the target is fixed.
    assert!(r.handle_timeout(s(4)).connect);
    assert_eq!(r.connected().state_changed, Some(TargetState::Live));
}

#[test]
fn back_off_grows_after_ten_failures_and_is_capped() {
    let mut r = Recovery::new(&timeouts(None, Some(1_000_000)), s(0));
    let mut now = s(0);
    let mut delays = Vec::new();
    for _ in 0..120 {
        let at = r.poll_at().unwrap();
        assert!(r.handle_timeout(at).connect);
        delays.push((at.0 - now.0) / 1000);
        now = at;
        r.attempt_failed(now, Disposition::Retry);
    }
    assert_eq!(&delays[1..11], &[2; 10]);
    assert_eq!(delays[11], 2, "factor 1 at 11 failures");
    assert_eq!(delays[12], 4);
    assert_eq!(delays[13], 6);
    assert_eq!(*delays.last().unwrap(), 200, "capped at 100 x");
}

#[test]
fn fast_fail_off_still_loses_the_device_and_remove_is_immediate() {
    let mut r = Recovery::new(&timeouts(None, Some(30)), s(0));
    r.handle_timeout(s(0));
    r.attempt_failed(s(1), Disposition::Retry);
    let mut last = None;
    while let Some(at) = r.poll_at() {
        let step = r.handle_timeout(at);
        if step.connect {
            r.attempt_failed(at, Disposition::Retry);
        }
        if step.state_changed.is_some() {
            last = step.state_changed.map(|st| (st, at));
        }
    }
    assert_eq!(last, Some((TargetState::Lost, s(30))));
    let mut r = Recovery::new(&timeouts(Some(5), None), s(0));
    assert_eq!(r.remove().state_changed, Some(TargetState::Lost));
    assert_eq!(r.poll_at(), None);
}
