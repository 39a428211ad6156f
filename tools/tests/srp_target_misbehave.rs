//! The software SRP target's misbehaviour switches, each observably doing
//! what it says: credits withheld then returned by SRP_CRED_REQ, target
//! requests (CRED_REQ, AER_REQ, T_LOGOUT) and the initiator's answers,
//! delayed and dropped responses, a given sense, a dropped connection —
//! and task management against all of them.

mod srp_target_support;

use std::time::Duration;

use hca_lowlevel::device::AccessFlags;
use kverbs_tools::scsi_target::FaultRule;
use kverbs_tools::srp_target::{Misbehaviour, Selector};
use srp_target_support::*;
use storport_srp::scsi::{AdditionalSense, SenseKey, SenseRepr};
use storport_srp::wire::srp::{DataIn, DataOut, Opcode, TaskMgmtFunction, TmResponse};

fn arm(env: &Env, m: Misbehaviour, p: &kverbs::irql::Passive<'_>) -> usize {
    env.with_target(|t| t.set_misbehaviour(m, p))
}

#[test]
fn withheld_credits_come_back_in_a_cred_req() {
    run(config(), |env, p| {
        let conn = env.connect(p);
        arm(
            env,
            Misbehaviour::WithholdCredits {
                responses: 3,
                idle_release: Duration::from_secs(60),
            },
            p,
        );
        for i in 0..3 {
            let rsp = conn.write10(0, i, 512, &[i as u8; 512], p);
            assert_eq!((rsp.status, rsp.req_lim_delta), (0, 0), "response {i}");
        }
        let iu = conn.next_iu(p);
        assert_eq!(iu[0], Opcode::CredReq.to_u8());
        let TargetRequest::Cred { delta, .. } = conn.answer(&iu, p) else {
            unreachable!()
        };
        assert_eq!(delta, 3);
        assert_eq!(conn.write10(0, 9, 512, &[9u8; 512], p).req_lim_delta, 1);
        let c = env.with_target(|t| t.counters());
        assert_eq!(c.credits_withheld_responses, 3);
        assert_eq!((c.cred_req_sent, c.srp_cred_rsp), (1, 1));
        assert_eq!(c.unmatched_target_responses, 0);
        assert_eq!(c.credits_granted, 128 + 3 + 1);
        assert_eq!(c.credit_violations, 0);
        conn.close(p);
    });
}

#[test]
fn withheld_credits_are_released_when_the_channel_goes_idle() {
    run(config(), |env, p| {
        let conn = env.connect(p);
        arm(
            env,
            Misbehaviour::WithholdCredits {
                responses: 1000,
                idle_release: Duration::from_millis(30),
            },
            p,
        );
        for i in 0..2 {
            assert_eq!(conn.write10(0, i, 512, &[1u8; 512], p).req_lim_delta, 0);
        }
        let iu = conn.next_iu(p);
        assert!(matches!(
            conn.answer(&iu, p),
            TargetRequest::Cred { delta: 2, .. }
        ));
        // Withholding ended with the release.
        assert_eq!(conn.write10(0, 5, 512, &[1u8; 512], p).req_lim_delta, 1);
        conn.close(p);
    });
}

#[test]
fn cred_req_and_aer_req_are_sent_and_their_answers_matched() {
    run(config(), |env, p| {
        let conn = env.connect(p);
        env.wait("live", || env.with_target(|t| t.live_channels()) == 1);
        assert_eq!(arm(env, Misbehaviour::SendCredReq { delta: 5 }, p), 1);
        let iu = conn.next_iu(p);
        assert!(matches!(
            conn.answer(&iu, p),
            TargetRequest::Cred { delta: 5, .. }
        ));
        let sense = SenseRepr::new(
            SenseKey::UnitAttention,
            AdditionalSense::CAPACITY_DATA_CHANGED,
        );
        assert_eq!(
            arm(
                env,
                Misbehaviour::SendAerReq {
                    lun: 1,
                    sense,
                    delta: 2
                },
                p
            ),
            1
        );
        let iu = conn.next_iu(p);
        let TargetRequest::Aer {
            delta,
            lun,
            sense: bytes,
            ..
        } = conn.answer(&iu, p)
        else {
            panic!("expected AER_REQ")
        };
        assert_eq!((delta, lun.index()), (2, Some(1)));
        assert_eq!(
            SenseRepr::parse(&bytes).unwrap().code,
            AdditionalSense::CAPACITY_DATA_CHANGED
        );
        // A CRED_RSP nobody asked for is counted, not trusted.
        let mut stray = [0u8; 16];
        storport_srp::wire::srp::CredRspRepr { tag: 0xdead }
            .emit(&mut storport_srp::wire::srp::CredRsp::new_unchecked(
                &mut stray[..],
            ))
            .unwrap();
        conn.send_iu(&stray, p);
        assert_eq!(conn.write10(0, 0, 512, &[1u8; 512], p).status, 0);
        let c = env.with_target(|t| t.counters());
        assert_eq!((c.cred_req_sent, c.aer_req_sent), (1, 1));
        assert_eq!((c.srp_cred_rsp, c.srp_aer_rsp), (2, 1));
        assert_eq!(c.unmatched_target_responses, 1);
        assert_eq!(c.credits_granted, 128 + 5 + 2 + 1);
        conn.close(p);
    });
}

#[test]
fn t_logout_is_sent_then_the_channel_closes() {
    run(config(), |env, p| {
        let conn = env.connect(p);
        env.wait("live", || env.with_target(|t| t.live_channels()) == 1);
        assert_eq!(arm(env, Misbehaviour::SendTLogout { reason: 7 }, p), 1);
        let iu = conn.next_iu(p);
        assert!(matches!(
            conn.answer(&iu, p),
            TargetRequest::Logout { reason: 7, .. }
        ));
        assert_eq!(conn.wait_terminal(), "disconnected-remote");
        assert_eq!(env.with_target(|t| t.counters()).t_logout_sent, 1);
        conn.close(p);
    });
}

#[test]
fn delayed_response_arrives_late_and_can_be_aborted() {
    run(config(), |env, p| {
        let conn = env.connect(p);
        arm(
            env,
            Misbehaviour::DelayResponses {
                delay: Duration::from_millis(300),
                which: Selector::Next(2),
            },
            p,
        );
        let mr = env.buffer(512, AccessFlags::REMOTE_WRITE, p);
        let tag = conn.send_cmd(
            0,
            &rw10(0x28, 0, 1),
            DataOut::None,
            DataIn::Direct(desc_of(&mr, 0, 512)),
            p,
        );
        assert!(
            conn.try_next_iu(p, Duration::from_millis(100)).is_none(),
            "not yet"
        );
        let rsp = conn.next_rsp(p);
        assert_eq!((rsp.tag, rsp.status), (tag, 0));
        // The second delayed one is aborted: no response, its credit comes
        // back with the task management response.
        let victim = conn.send_cmd(
            0,
            &rw10(0x28, 0, 1),
            DataOut::None,
            DataIn::Direct(desc_of(&mr, 0, 512)),
            p,
        );
        env.idle(Duration::from_millis(30));
        let tm = conn.send_tm(TaskMgmtFunction::AbortTask, 0, victim, p);
        let rsp = conn.next_rsp(p);
        assert_eq!(rsp.tag, tm);
        assert_eq!(rsp.tm(), Some(TmResponse::Complete));
        assert_eq!(rsp.req_lim_delta, 2);
        assert!(conn.try_next_iu(p, Duration::from_millis(400)).is_none());
        let c = env.with_target(|t| t.counters());
        assert_eq!(
            (c.responses_delayed, c.tasks_aborted, c.tm_abort_task),
            (2, 1, 1)
        );
        mr.dereg(p).unwrap();
        conn.close(p);
    });
}

#[test]
fn dropped_response_moves_the_data_and_waits_for_an_abort() {
    run(config(), |env, p| {
        let conn = env.connect(p);
        arm(
            env,
            Misbehaviour::DropResponses {
                which: Selector::Next(1),
            },
            p,
        );
        let data = pattern(1024, 8);
        let mr = env.buffer(1024, AccessFlags::REMOTE_READ, p);
        mr.mem().write(0, &data).unwrap();
        let victim = conn.send_cmd(
            0,
            &rw10(0x2a, 50, 2),
            DataOut::Direct(desc_of(&mr, 0, 1024)),
            DataIn::None,
            p,
        );
        assert!(conn.try_next_iu(p, Duration::from_millis(200)).is_none());
        // The write happened.
        assert_eq!(conn.read10(0, 50, 2, 512, p).1, data);
        let tm = conn.send_tm(TaskMgmtFunction::AbortTask, 0, victim, p);
        let rsp = conn.next_rsp(p);
        assert_eq!(
            (rsp.tag, rsp.tm(), rsp.req_lim_delta),
            (tm, Some(TmResponse::Complete), 2)
        );
        // Aborting it again finds nothing.
        conn.send_tm(TaskMgmtFunction::AbortTask, 0, victim, p);
        assert_eq!(conn.next_rsp(p).tm(), Some(TmResponse::Failed));
        let c = env.with_target(|t| t.counters());
        assert_eq!((c.responses_dropped, c.tasks_aborted), (1, 1));
        mr.dereg(p).unwrap();
        conn.close(p);
    });
}

#[test]
fn lun_reset_and_unsupported_functions() {
    run(config(), |env, p| {
        let conn = env.connect(p);
        arm(
            env,
            Misbehaviour::DelayResponses {
                delay: Duration::from_secs(30),
                which: Selector::Next(3),
            },
            p,
        );
        let mr = env.buffer(4096, AccessFlags::REMOTE_WRITE, p);
        for lun in [0u16, 0, 1] {
            conn.send_cmd(
                lun,
                &rw10(0x28, 0, 1),
                DataOut::None,
                DataIn::Direct(desc_of(&mr, 0, 512)),
                p,
            );
        }
        env.idle(Duration::from_millis(30));
        // LUN 0's two commands go; LUN 1's stays.
        conn.send_tm(TaskMgmtFunction::LunReset, 0, 0, p);
        let rsp = conn.next_rsp(p);
        assert_eq!(
            (rsp.tm(), rsp.req_lim_delta),
            (Some(TmResponse::Complete), 3)
        );
        conn.send_tm(TaskMgmtFunction::LunReset, 9, 0, p);
        assert_eq!(conn.next_rsp(p).tm(), Some(TmResponse::Failed));
        conn.send_tm(TaskMgmtFunction::ClearAca, 0, 0, p);
        assert_eq!(conn.next_rsp(p).tm(), Some(TmResponse::NotSupported));
        conn.send_tm(TaskMgmtFunction::AbortTaskSet, 0, 0, p);
        assert_eq!(conn.next_rsp(p).tm(), Some(TmResponse::NotSupported));
        conn.send_tm(TaskMgmtFunction::LunReset, 1, 0, p);
        assert_eq!(conn.next_rsp(p).tm(), Some(TmResponse::Complete));
        let c = env.with_target(|t| t.counters());
        assert_eq!(
            (c.tm_lun_reset, c.tm_unsupported, c.tasks_aborted),
            (3, 2, 3)
        );
        mr.dereg(p).unwrap();
        conn.close(p);
    });
}

#[test]
fn a_given_sense_through_the_scsi_fault_hooks() {
    run(config(), |env, p| {
        let conn = env.connect(p);
        arm(
            env,
            Misbehaviour::ScsiFault(FaultRule::sense(
                SenseKey::MediumError,
                AdditionalSense::UNRECOVERED_READ_ERROR,
            )),
            p,
        );
        let (rsp, _) = conn.read10(0, 0, 1, 512, p);
        assert_eq!(rsp.status, 2);
        let sense = SenseRepr::parse(&rsp.sense.unwrap()).unwrap();
        assert_eq!(
            (sense.key, sense.code),
            (
                SenseKey::MediumError,
                AdditionalSense::UNRECOVERED_READ_ERROR
            )
        );
        assert_eq!(conn.read10(0, 0, 1, 512, p).0.status, 0);
        conn.close(p);
    });
}

#[test]
fn connection_dropped_mid_io() {
    run(config(), |env, p| {
        let conn = env.connect(p);
        arm(env, Misbehaviour::DisconnectAfter { commands: 1 }, p);
        assert_eq!(conn.write10(0, 0, 512, &[3u8; 512], p).status, 0);
        let mr = env.buffer(512, AccessFlags::REMOTE_WRITE, p);
        conn.send_cmd(
            0,
            &rw10(0x28, 0, 1),
            DataOut::None,
            DataIn::Direct(desc_of(&mr, 0, 512)),
            p,
        );
        assert_eq!(conn.wait_terminal(), "disconnected-remote");
        assert!(conn.try_next_iu(p, Duration::from_millis(50)).is_none());
        assert_eq!(env.with_target(|t| t.counters()).forced_disconnects, 1);
        mr.dereg(p).unwrap();
        conn.close(p);
        // The target takes new logins.
        env.connect(p).close(p);
    });
}

#[test]
fn initiator_disconnects_with_commands_outstanding() {
    run(config(), |env, p| {
        let conn = env.connect(p);
        arm(
            env,
            Misbehaviour::DelayResponses {
                delay: Duration::from_secs(60),
                which: Selector::All,
            },
            p,
        );
        let inb = env.buffer(8192, AccessFlags::REMOTE_WRITE, p);
        let out = env.buffer(8192, AccessFlags::REMOTE_READ, p);
        for i in 0..4u32 {
            conn.send_cmd(
                0,
                &rw10(0x28, i * 4, 4),
                DataOut::None,
                DataIn::Direct(desc_of(&inb, u64::from(i) * 2048, 2048)),
                p,
            );
            conn.send_cmd(
                0,
                &rw10(0x2a, 100 + i * 4, 4),
                DataOut::Direct(desc_of(&out, u64::from(i) * 2048, 2048)),
                DataIn::None,
                p,
            );
        }
        env.wait("eight commands held", || {
            env.with_target(|t| t.counters()).responses_delayed == 8
        });
        conn.close(p);
        env.wait("the channel closed", || {
            env.with_target(|t| t.counters()).channels_closed == 1
        });
        env.with_target(|t| t.clear_misbehaviour());
        let again = env.connect(p);
        assert_eq!(again.write10(0, 0, 512, &[7u8; 512], p).status, 0);
        inb.dereg(p).unwrap();
        out.dereg(p).unwrap();
        again.close(p);
    });
}
