//! The software SRP target on its own, against a raw initiator (hand-built
//! IUs over kverbs and `kverbs::cm` on a second software HCA): login,
//! INQUIRY, READ CAPACITY, WRITE then READ with the data checked, every
//! descriptor format, task management, logout, each login reject reason,
//! and each misbehaviour switch doing what it says.

mod srp_target_support;

use srp_target_support::*;
use storport_srp::wire::srp::{BufFormats, MultiChannelResult};

#[test]
fn login_inquiry_capacity_write_read_logout() {
    run(config(), |env, p| {
        let conn = env.connect(p);
        let login = conn.login;
        assert_eq!(login.req_lim_delta, 128);
        assert_eq!(login.max_it_iu_len, 8276);
        assert_eq!(login.max_ti_iu_len, 8260);
        assert_eq!(login.buf_fmt, BufFormats::DIRECT | BufFormats::INDIRECT);
        assert_eq!(login.multichannel, MultiChannelResult::NoChannel);
        assert!(login.immediate_supported);
        let (rsp, data) = conn.data_in(0, &inquiry(96), 96, p);
        assert_eq!(rsp.status, 0);
        assert_eq!(&data[8..14], b"KVERBS");
        let inquiry_len = 96
            - match rsp.data_in_residual {
                storport_srp::wire::Residual::Underflow(n) => n,
                other => panic!("INQUIRY residual {other:?}"),
            };
        let (rsp, cap) = conn.data_in(0, &read_capacity10(), 8, p);
        assert_eq!(rsp.status, 0);
        assert_eq!(u32::from_be_bytes(cap[0..4].try_into().unwrap()), 8191);
        assert_eq!(u32::from_be_bytes(cap[4..8].try_into().unwrap()), 512);
        let data = pattern(8192, 3);
        let rsp = conn.write10(0, 100, 512, &data, p);
        assert_eq!((rsp.status, rsp.req_lim_delta), (0, 1));
        let (rsp, back) = conn.read10(0, 100, 16, 512, p);
        assert_eq!(rsp.status, 0);
        assert_eq!(back, data);
        let c = env.with_target(|t| t.counters());
        assert_eq!(c.srp_cmd, 4);
        assert_eq!(c.zero_length_writes, 1);
        assert_eq!(u64::from(inquiry_len), 36);
        assert_eq!(c.bytes_data_in, u64::from(inquiry_len) + 8 + 8192);
        assert_eq!(c.bytes_data_out, 8192);
        assert_eq!(c.credits_granted, 128 + 4);
        assert_eq!(c.scsi(0x2a), 1);
        conn.i_logout(p);
        assert_eq!(conn.wait_terminal(), "disconnected-remote");
        conn.close(p);
        env.wait("the channel gone", || {
            env.with_target(|t| t.channels().is_empty())
        });
        let c = env.with_target(|t| t.counters());
        assert_eq!((c.srp_i_logout, c.channels_closed), (1, 1));
    });
}

#[test]
fn stop_disconnects_live_channels_and_destroys_everything() {
    run(config(), |env, p| {
        let a = env.connect(p);
        let mut req = env.login_req();
        req.multichannel = storport_srp::wire::srp::MultiChannelAction::Multi;
        let b = env.login(&req, p).unwrap();
        assert_eq!(b.login.multichannel, MultiChannelResult::Maintained);
        env.wait("two live channels", || {
            env.with_target(|t| t.live_channels()) == 2
        });
        env.stop_target(p);
        assert_eq!(a.wait_terminal(), "disconnected-remote");
        assert_eq!(b.wait_terminal(), "disconnected-remote");
        a.close(p);
        b.close(p);
    });
}
