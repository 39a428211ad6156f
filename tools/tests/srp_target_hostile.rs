//! The hostile switches: the target touches initiator memory it was not
//! given (a stale rkey, past the end of a buffer, the wrong direction,
//! after the response). Against an initiator that registers each buffer
//! exactly, with only the access it needs, and invalidates it when the
//! command is done, every attempt is refused by the initiator's HCA — the
//! target sees the protection error (error completion, QP in error, the
//! channel goes down) and reports it, and no byte outside what the
//! initiator handed out changes. Against an initiator that leaves a
//! buffer open, the same attempt succeeds, and the report says so.

mod srp_target_support;

use std::time::Duration;

use hca_lowlevel::cqe::Syndrome;
use hca_lowlevel::device::AccessFlags;
use kverbs_tools::srp_target::{HostileAttempt, HostileOutcome, HostileReport, Misbehaviour};
use srp_target_support::*;
use storport_srp::wire::srp::{DataIn, DataOut};

fn arm(env: &Env, attempt: HostileAttempt, p: &kverbs::irql::Passive<'_>) {
    env.with_target(|t| t.set_misbehaviour(Misbehaviour::Hostile(attempt), p));
}

/// Waits for the single hostile report to have its outcome.
fn report(env: &Env) -> HostileReport {
    env.wait("the hostile attempt's outcome", || {
        env.with_target(|t| t.hostile_reports())
            .first()
            .is_some_and(|r| r.outcome != HostileOutcome::Pending)
    });
    let reports = env.with_target(|t| t.hostile_reports());
    assert_eq!(reports.len(), 1, "{reports:?}");
    reports[0]
}

/// The refusal every attempt must meet, and what follows from it.
fn assert_refused(env: &Env, conn: &Conn<'_>, r: &HostileReport) {
    assert_eq!(
        r.outcome,
        HostileOutcome::Refused(Some(Syndrome::RemoteAccess)),
        "{r:?}"
    );
    let c = env.with_target(|t| t.counters());
    assert!(c.protection_errors >= 1);
    assert_eq!(c.hostile_attempts, 1);
    // The target's QP is in error: the channel goes down.
    assert_eq!(conn.wait_terminal(), "disconnected-remote");
    env.wait("the channel closed", || {
        env.with_target(|t| t.counters()).channels_closed == 1
    });
}

fn read_back(mr: &kverbs::mr::Mr<Hp>) -> Vec<u8> {
    let mut v = vec![0u8; mr.len()];
    mr.mem().read(0, &mut v).unwrap();
    v
}

#[test]
fn stale_rkey_is_refused() {
    run(config(), |env, p| {
        let conn = env.connect(p);
        let old = env.buffer(4096, AccessFlags::REMOTE_WRITE, p);
        conn.send_cmd(
            0,
            &rw10(0x28, 0, 8),
            DataOut::None,
            DataIn::Direct(desc_of(&old, 0, 4096)),
            p,
        );
        assert_eq!(conn.next_rsp(p).status, 0);
        let delivered = read_back(&old);
        // The initiator is done with the buffer: it invalidates the key.
        old.dereg(p).unwrap();
        arm(env, HostileAttempt::StaleRkey, p);
        // (The switch uses a buffer delivered at least 20 ms before.)
        env.idle(Duration::from_millis(30));
        let new = env.buffer(4096, AccessFlags::REMOTE_WRITE, p);
        conn.send_cmd(
            0,
            &rw10(0x28, 8, 8),
            DataOut::None,
            DataIn::Direct(desc_of(&new, 0, 4096)),
            p,
        );
        let r = report(env);
        assert_eq!((r.remote_addr, r.rkey), (old.iova(), old.rkey().unwrap()));
        assert_refused(env, &conn, &r);
        assert_eq!(read_back(&old), delivered, "the stale buffer changed");
        new.dereg(p).unwrap();
        conn.close(p);
    });
}

#[test]
fn stale_rkey_left_open_by_a_sloppy_initiator_is_reported_as_succeeded() {
    run(config(), |env, p| {
        let conn = env.connect(p);
        let old = env.buffer(4096, AccessFlags::REMOTE_WRITE, p);
        conn.send_cmd(
            0,
            &rw10(0x28, 0, 8),
            DataOut::None,
            DataIn::Direct(desc_of(&old, 0, 4096)),
            p,
        );
        assert_eq!(conn.next_rsp(p).status, 0);
        // No invalidation: the old key still opens the buffer.
        arm(env, HostileAttempt::StaleRkey, p);
        env.idle(Duration::from_millis(30));
        conn.send_cmd(
            0,
            &rw10(0x28, 8, 8),
            DataOut::None,
            DataIn::Direct(desc_of(&old, 0, 4096)),
            p,
        );
        let r = report(env);
        assert_eq!(r.outcome, HostileOutcome::Succeeded);
        assert_eq!(env.with_target(|t| t.counters()).protection_errors, 0);
        let rsp = conn.next_rsp(p);
        assert_eq!(rsp.status, 0);
        // The channel lives on.
        assert_eq!(conn.write10(0, 0, 512, &[1u8; 512], p).status, 0);
        old.dereg(p).unwrap();
        conn.close(p);
    });
}

#[test]
fn writing_past_the_end_of_the_buffer_is_refused() {
    run(config(), |env, p| {
        let conn = env.connect(p);
        let buf = env.buffer(4096, AccessFlags::REMOTE_WRITE, p);
        let canary = pattern(4096, 0x5a);
        buf.mem().write(0, &canary).unwrap();
        arm(env, HostileAttempt::BeyondBuffer { past_end: 16 }, p);
        conn.send_cmd(
            0,
            &rw10(0x28, 0, 8),
            DataOut::None,
            DataIn::Direct(desc_of(&buf, 0, 4096)),
            p,
        );
        let r = report(env);
        assert_eq!(r.remote_addr + u64::from(r.len), buf.iova() + 4096 + 16);
        assert_refused(env, &conn, &r);
        assert_eq!(read_back(&buf), canary, "not even the part inside changed");
        buf.dereg(p).unwrap();
        conn.close(p);
    });
}

#[test]
fn reading_a_write_only_buffer_is_refused() {
    run(config(), |env, p| {
        let conn = env.connect(p);
        let buf = env.buffer(4096, AccessFlags::REMOTE_WRITE, p);
        arm(env, HostileAttempt::ReadFromWriteOnly, p);
        conn.send_cmd(
            0,
            &rw10(0x28, 0, 8),
            DataOut::None,
            DataIn::Direct(desc_of(&buf, 0, 4096)),
            p,
        );
        let r = report(env);
        assert_refused(env, &conn, &r);
        buf.dereg(p).unwrap();
        conn.close(p);
    });
}

#[test]
fn writing_a_read_only_buffer_is_refused() {
    run(config(), |env, p| {
        let conn = env.connect(p);
        let data = pattern(4096, 0x33);
        let buf = env.buffer(4096, AccessFlags::REMOTE_READ, p);
        buf.mem().write(0, &data).unwrap();
        arm(env, HostileAttempt::WriteToReadOnly, p);
        conn.send_cmd(
            0,
            &rw10(0x2a, 0, 8),
            DataOut::Direct(desc_of(&buf, 0, 4096)),
            DataIn::None,
            p,
        );
        let r = report(env);
        assert_refused(env, &conn, &r);
        assert_eq!(read_back(&buf), data);
        buf.dereg(p).unwrap();
        conn.close(p);
    });
}

#[test]
fn writing_after_the_response_is_refused() {
    run(config(), |env, p| {
        let conn = env.connect(p);
        let data = pattern(4096, 0x44);
        assert_eq!(conn.write10(0, 16, 512, &data, p).status, 0);
        let buf = env.buffer(4096, AccessFlags::REMOTE_WRITE, p);
        arm(
            env,
            HostileAttempt::AfterResponse {
                delay: Duration::from_millis(100),
            },
            p,
        );
        conn.send_cmd(
            0,
            &rw10(0x28, 16, 8),
            DataOut::None,
            DataIn::Direct(desc_of(&buf, 0, 4096)),
            p,
        );
        assert_eq!(conn.next_rsp(p).status, 0);
        // The command is complete: the initiator invalidates at once.
        buf.dereg(p).unwrap();
        let r = report(env);
        assert_refused(env, &conn, &r);
        assert_eq!(read_back(&buf), data, "the delivered data was overwritten");
        conn.close(p);
    });
}
