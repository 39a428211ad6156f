//! Logins to the software SRP target: both CM forms, every reject reason
//! in `ib_srpt`'s order, SINGLE and MULTI channel semantics, the access
//! list and the channel limit.

mod srp_target_support;

use hca_lowlevel::sim::HcaConfig;
use kverbs::cm::ConnParams;
use kverbs_tools::srp_target::{InitiatorAcl, Misbehaviour};
use srp_target_support::*;
use storport_srp::wire::srp::{MultiChannelAction, MultiChannelResult, PortId, RejectReason};

fn rejected(
    env: &Env,
    req: &storport_srp::wire::srp::LoginReqRepr,
    p: &kverbs::irql::Passive<'_>,
) -> RejectReason {
    match env.login(req, p) {
        Err(Refused::Rejected(reason)) => reason,
        Err(other) => panic!("refused otherwise: {other:?}"),
        Ok(conn) => {
            conn.close(p);
            panic!("login accepted")
        }
    }
}

#[test]
fn ib_cm_form_logs_in_and_serves_io() {
    run(config(), |env, p| {
        let conn = Conn::open(env, &env.login_req(), Form::IbCm, ConnParams::SRP, p).unwrap();
        assert_eq!(conn.login.req_lim_delta, 128);
        let data = pattern(2048, 4);
        assert_eq!(conn.write10(0, 7, 512, &data, p).status, 0);
        assert_eq!(conn.read10(0, 7, 4, 512, p).1, data);
        conn.close(p);
    });
}

#[test]
fn rejects_in_srpt_order_with_srpt_reasons() {
    run(config(), |env, p| {
        let good = env.login_req();
        let too_small = storport_srp::wire::srp::LoginReqRepr {
            req_it_iu_len: 63,
            ..good
        };
        assert_eq!(
            rejected(env, &too_small, p),
            RejectReason::ReqItIuLengthTooLarge
        );
        // Too large *and* the wrong target port: the IU length is checked
        // first.
        let too_large = storport_srp::wire::srp::LoginReqRepr {
            req_it_iu_len: 8277,
            target_port_id: PortId { id_ext: 1, guid: 2 },
            ..good
        };
        assert_eq!(
            rejected(env, &too_large, p),
            RejectReason::ReqItIuLengthTooLarge
        );
        for target_port_id in [
            PortId {
                id_ext: 0,
                guid: good.target_port_id.guid,
            },
            PortId {
                id_ext: good.target_port_id.id_ext,
                guid: 0,
            },
        ] {
            let wrong = storport_srp::wire::srp::LoginReqRepr {
                target_port_id,
                ..good
            };
            assert_eq!(
                rejected(env, &wrong, p),
                RejectReason::UnableAssociateChannel
            );
        }
        // The forced reject, once: then logins work again.
        env.with_target(|t| {
            t.set_misbehaviour(
                Misbehaviour::RejectLogins {
                    reason: RejectReason::UnsupportedDescriptorFormat,
                    count: Some(1),
                },
                p,
            )
        });
        assert_eq!(
            rejected(env, &good, p),
            RejectReason::UnsupportedDescriptorFormat
        );
        let conn = env.login(&good, p).unwrap();
        conn.close(p);
        let c = env.with_target(|t| t.counters());
        assert_eq!(c.rejected(RejectReason::ReqItIuLengthTooLarge), 2);
        assert_eq!(c.rejected(RejectReason::UnableAssociateChannel), 2);
        assert_eq!(c.rejected(RejectReason::UnsupportedDescriptorFormat), 1);
        assert_eq!((c.login_requests, c.logins_accepted), (6, 1));
    });
}

#[test]
fn a_disabled_target_rejects_with_insufficient_resources() {
    let mut cfg = config();
    cfg.enabled = false;
    run(cfg, |env, p| {
        assert_eq!(
            rejected(env, &env.login_req(), p),
            RejectReason::InsufficientResources
        );
    });
}

#[test]
fn no_memory_for_the_channel_is_insufficient_resources() {
    // A receive ring of 1024 × 64 KiB cannot be had from a 16 MiB HCA.
    let mut cfg = config();
    cfg.srp_max_req_size = 65536;
    cfg.rq_size = 1024;
    let hca = HcaConfig {
        mem_limit: 16 << 20,
        ..HcaConfig::new(TARGET_IP)
    };
    run_in(Mode::Threaded, cfg, hca, |env, p| {
        assert_eq!(
            rejected(env, &env.login_req(), p),
            RejectReason::InsufficientResources
        );
        // And again: nothing leaked by the first attempt is in the way.
        assert_eq!(
            rejected(env, &env.login_req(), p),
            RejectReason::InsufficientResources
        );
    });
}

#[test]
fn access_list_by_guid_port_id_and_ip() {
    let mut cfg = config();
    cfg.accepted_initiators = Some(vec![InitiatorAcl::Guid(0x1234)]);
    run(cfg, |env, p| {
        assert_eq!(
            rejected(env, &env.login_req(), p),
            RejectReason::ChannelLimitReached
        );
        let listed = storport_srp::wire::srp::LoginReqRepr {
            initiator_port_id: PortId {
                id_ext: 9,
                guid: 0x1234,
            },
            ..env.login_req()
        };
        env.login(&listed, p).unwrap().close(p);
    });
    let mut cfg = config();
    cfg.accepted_initiators = Some(vec![InitiatorAcl::Ip(INIT_IP)]);
    run(cfg, |env, p| env.connect(p).close(p));
    let mut cfg = config();
    cfg.accepted_initiators = Some(vec![InitiatorAcl::Ip([10, 9, 9, 9])]);
    run(cfg, |env, p| {
        assert_eq!(
            rejected(env, &env.login_req(), p),
            RejectReason::ChannelLimitReached
        );
    });
}

#[test]
fn channel_limit() {
    let mut cfg = config();
    cfg.max_channels = 2;
    run(cfg, |env, p| {
        let multi = storport_srp::wire::srp::LoginReqRepr {
            multichannel: MultiChannelAction::Multi,
            ..env.login_req()
        };
        let a = env.login(&multi, p).unwrap();
        let b = env.login(&multi, p).unwrap();
        assert_eq!(rejected(env, &multi, p), RejectReason::ChannelLimitReached);
        // A SINGLE login of the same nexus replaces them: its channels
        // do not count against the limit.
        let c = env.connect(p);
        assert_eq!(c.login.multichannel, MultiChannelResult::Terminated);
        assert_eq!(a.wait_terminal(), "disconnected-remote");
        assert_eq!(b.wait_terminal(), "disconnected-remote");
        for conn in [&a, &b, &c] {
            conn.close(p);
        }
    });
}

#[test]
fn single_terminates_the_nexus_and_multi_maintains_it() {
    run(config(), |env, p| {
        let first = env.connect(p);
        assert_eq!(first.login.multichannel, MultiChannelResult::NoChannel);
        let multi = storport_srp::wire::srp::LoginReqRepr {
            multichannel: MultiChannelAction::Multi,
            ..env.login_req()
        };
        let second = env.login(&multi, p).unwrap();
        assert_eq!(second.login.multichannel, MultiChannelResult::Maintained);
        // Another initiator's SINGLE login leaves this nexus alone.
        let other = storport_srp::wire::srp::LoginReqRepr {
            initiator_port_id: PortId {
                id_ext: 1,
                guid: INIT_GUID,
            },
            ..env.login_req()
        };
        let third = env.login(&other, p).unwrap();
        assert_eq!(third.login.multichannel, MultiChannelResult::NoChannel);
        env.wait("three live channels", || {
            env.with_target(|t| t.live_channels()) == 3
        });
        // A SINGLE re-login of the first nexus ends both of its channels.
        let again = env.connect(p);
        assert_eq!(again.login.multichannel, MultiChannelResult::Terminated);
        assert_eq!(first.wait_terminal(), "disconnected-remote");
        assert_eq!(second.wait_terminal(), "disconnected-remote");
        assert_eq!(third.events.terminal(), None);
        assert_eq!(third.write10(0, 0, 512, &[1u8; 512], p).status, 0);
        assert_eq!(again.write10(0, 1, 512, &[2u8; 512], p).status, 0);
        let c = env.with_target(|t| t.counters());
        assert_eq!(c.channels_terminated_by_relogin, 2);
        for conn in [&first, &second, &third, &again] {
            conn.close(p);
        }
    });
}
