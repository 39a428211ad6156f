//! The software SRP target on its own, against a raw initiator (hand-built
//! IUs over kverbs and `kverbs::cm` on a second software HCA): login,
//! INQUIRY, READ CAPACITY, WRITE then READ with the data checked, every
//! descriptor format, task management, logout, each login reject reason,
//! and each misbehaviour switch doing what it says.

mod srp_target_support;

use hca_lowlevel::device::AccessFlags;
use kverbs_tools::scsi_target::{FaultFilter, FaultRule};
use srp_target_support::*;
use std::time::Duration;
use storport_srp::wire::srp::{BufFormats, DataIn, DataOut, MultiChannelResult};

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

#[test]
fn indirect_and_immediate_descriptors() {
    run(config(), |env, p| {
        let conn = env.connect(p);
        // WRITE of 16 blocks gathered from three buffers (indirect).
        let data = pattern(8192, 9);
        let parts = [(0usize, 4096usize), (4096, 1536), (5632, 2560)];
        let mrs: Vec<_> = parts
            .iter()
            .map(|&(off, len)| {
                let mr = env.buffer(len, AccessFlags::REMOTE_READ, p);
                mr.mem().write(0, &data[off..off + len]).unwrap();
                mr
            })
            .collect();
        let descs: Vec<_> = mrs
            .iter()
            .zip(parts)
            .map(|(mr, (_, len))| desc_of(mr, 0, len as u32))
            .collect();
        let tag = conn.send_cmd(
            0,
            &rw10(0x2a, 40, 16),
            DataOut::Indirect(indirect(&descs)),
            DataIn::None,
            p,
        );
        let rsp = conn.next_rsp(p);
        assert_eq!((rsp.tag, rsp.status), (tag, 0));
        // READ of the same blocks scattered into two buffers (indirect).
        let a = env.buffer(5000, AccessFlags::REMOTE_WRITE, p);
        let b = env.buffer(3192, AccessFlags::REMOTE_WRITE, p);
        let descs = [desc_of(&a, 0, 5000), desc_of(&b, 0, 3192)];
        conn.send_cmd(
            0,
            &rw10(0x28, 40, 16),
            DataOut::None,
            DataIn::Indirect(indirect(&descs)),
            p,
        );
        assert_eq!(conn.next_rsp(p).status, 0);
        let mut back = vec![0u8; 8192];
        a.mem().read(0, &mut back[..5000]).unwrap();
        b.mem().read(0, &mut back[5000..]).unwrap();
        assert_eq!(back, data);
        // WRITE with 4 KiB of immediate data at the negotiated offset 68.
        let imm = pattern(4096, 77);
        let tag = conn.send_cmd(
            0,
            &rw10(0x2a, 200, 8),
            DataOut::Immediate {
                offset: 68,
                data: &imm,
            },
            DataIn::None,
            p,
        );
        let rsp = conn.next_rsp(p);
        assert_eq!((rsp.tag, rsp.status), (tag, 0));
        let (_, back) = conn.read10(0, 200, 8, 512, p);
        assert_eq!(back, imm);
        // The RAM disk holds it too (read behind the SCSI layer's back).
        let mut stored = Vec::new();
        env.with_target(|t| {
            t.scsi()
                .lun(0)
                .unwrap()
                .read_blocks(200, 8, &mut |piece| stored.extend_from_slice(piece))
                .unwrap();
        });
        assert_eq!(stored, imm);
        let c = env.with_target(|t| t.counters());
        assert_eq!(c.bytes_immediate, 4096);
        assert_eq!(c.bad_descriptors, 0);
        for mr in mrs.iter().chain([&a, &b]) {
            mr.dereg(p).unwrap();
        }
        conn.close(p);
    });
}

#[test]
fn descriptors_the_target_cannot_use_get_invalid_field_in_cdb() {
    let mut cfg = config();
    cfg.staging_bytes = 1 << 20;
    run(cfg, |env, p| {
        let conn = env.connect(p);
        let mr = env.buffer(4096, AccessFlags::REMOTE_READ, p);
        let d = desc_of(&mr, 0, 1024);
        // An indirect table longer than the inline list (ib_srpt never
        // fetches the table from initiator memory).
        let descs = [d, d, d];
        let repr = storport_srp::wire::srp::CmdRepr {
            sol_not: storport_srp::wire::srp::SolNot::UNSUCCESSFUL,
            tag: 0xbad1,
            lun: storport_srp::wire::Lun::from_index(0).unwrap(),
            task_attr: storport_srp::wire::srp::TaskAttr::Simple,
            cdb: &rw10(0x2a, 0, 6),
            data_out: DataOut::Indirect(indirect(&descs)),
            data_in: DataIn::None,
        };
        let mut iu = vec![0u8; repr.buffer_len().unwrap()];
        repr.emit(&mut storport_srp::wire::srp::Cmd::new_unchecked(
            &mut iu[..],
        ))
        .unwrap();
        iu[60..64].copy_from_slice(&(16u32 * 5).to_be_bytes());
        conn.send_iu(&iu, p);
        let rsp = conn.next_rsp(p);
        assert_eq!((rsp.tag, rsp.status), (0xbad1, 2));
        assert!(rsp.solicited, "UCSOLNT asked for a solicited response");
        let sense = rsp.sense.unwrap();
        assert_eq!((sense[2] & 0xf, sense[12], sense[13]), (5, 0x24, 0));
        // More data than the channel can stage.
        let big = desc_of(&mr, 0, 4096);
        let huge = storport_srp::wire::srp::DirectDesc {
            len: 2 << 20,
            ..big
        };
        conn.send_cmd(
            0,
            &rw10(0x2a, 0, 4096),
            DataOut::Direct(huge),
            DataIn::None,
            p,
        );
        assert_eq!(conn.next_rsp(p).status, 2);
        // Immediate data the channel did not negotiate.
        let no_imm = env
            .login(
                &storport_srp::wire::srp::LoginReqRepr {
                    imm_data_offset: None,
                    multichannel: storport_srp::wire::srp::MultiChannelAction::Multi,
                    ..env.login_req()
                },
                p,
            )
            .unwrap();
        assert!(!no_imm.login.immediate_supported);
        no_imm.send_cmd(
            0,
            &rw10(0x2a, 0, 1),
            DataOut::Immediate {
                offset: 68,
                data: &[1u8; 512],
            },
            DataIn::None,
            p,
        );
        assert_eq!(no_imm.next_rsp(p).status, 2);
        assert_eq!(env.with_target(|t| t.counters()).bad_descriptors, 3);
        // The channels still work.
        assert_eq!(conn.write10(0, 0, 512, &[5u8; 512], p).status, 0);
        mr.dereg(p).unwrap();
        no_imm.close(p);
        conn.close(p);
    });
}

#[test]
fn errors_carry_sense_and_residuals() {
    run(config(), |env, p| {
        let conn = env.connect(p);
        // Past the end of the 8192-block LUN: LBA OUT OF RANGE.
        let (rsp, _) = conn.read10(0, 8190, 4, 512, p);
        assert_eq!(rsp.status, 2);
        let sense = rsp.sense.unwrap();
        assert_eq!(sense.len(), 18);
        assert_eq!((sense[2] & 0xf, sense[12]), (5, 0x21));
        // Two blocks asked into a one-block buffer: data-in overflow.
        let (rsp, _) = conn.data_in(0, &rw10(0x28, 0, 2), 512, p);
        assert_eq!(
            rsp.data_in_residual,
            storport_srp::wire::Residual::Overflow(512)
        );
        // An absent LUN.
        let (rsp, _) = conn.data_in(7, &read_capacity10(), 8, p);
        assert_eq!(rsp.status, 2);
        assert_eq!(rsp.sense.unwrap()[12], 0x25);
        conn.close(p);
    });
}

#[test]
fn sense_is_cut_to_the_response_buffer() {
    let mut cfg = config();
    cfg.srp_max_rsp_size = 40;
    run(cfg, |env, p| {
        let conn = env.connect(p);
        let (rsp, _) = conn.read10(0, 9000, 1, 512, p);
        assert_eq!(rsp.status, 2);
        // 40 - 36: four bytes of the 18-byte fixed sense.
        assert_eq!(rsp.sense.unwrap().len(), 4);
        conn.close(p);
    });
}

#[test]
fn transfers_are_cut_into_rdma_work_requests_within_the_initiator_depth() {
    let mut cfg = config();
    cfg.max_rdma_size = 4096;
    run(cfg, |env, p| {
        let conn = env.connect(p);
        assert_eq!(env.with_target(|t| t.channels()[0].read_depth), 4);
        let data = pattern(65536, 1);
        assert_eq!(conn.write10(0, 1000, 512, &data, p).status, 0);
        let (_, back) = conn.read10(0, 1000, 128, 512, p);
        assert_eq!(back, data);
        let c = env.with_target(|t| t.counters());
        assert_eq!(c.rdma_reads, 16);
        // + the zero-length WRITE.
        assert_eq!(c.rdma_writes, 16 + 1);
        assert!(
            (2..=4).contains(&c.max_reads_outstanding),
            "{}",
            c.max_reads_outstanding
        );
        conn.close(p);
    });
    // An initiator that accepts one RDMA READ at a time gets one.
    let mut cfg = config();
    cfg.max_rdma_size = 4096;
    run(cfg, |env, p| {
        let params = kverbs::cm::ConnParams {
            responder_resources: 1,
            ..kverbs::cm::ConnParams::SRP
        };
        let conn = Conn::open(env, &env.login_req(), Form::RdmaCm, params, p).unwrap();
        assert_eq!(env.with_target(|t| t.channels()[0].read_depth), 1);
        let data = pattern(32768, 2);
        assert_eq!(conn.write10(0, 0, 512, &data, p).status, 0);
        let (_, back) = conn.read10(0, 0, 64, 512, p);
        assert_eq!(back, data);
        assert_eq!(env.with_target(|t| t.counters()).max_reads_outstanding, 1);
        conn.close(p);
    });
}

#[test]
fn many_commands_in_flight_with_little_staging_memory() {
    let mut cfg = config();
    cfg.staging_bytes = 128 << 10;
    cfg.max_rdma_size = 16384;
    run(cfg, |env, p| {
        let conn = env.connect(p);
        let n = 24u32;
        let blocks = 64u32; // 32 KiB each: four fit in the staging memory
        // The first WRITE stalls the channel thread (after its RDMA READ)
        // long enough for every other command to arrive, so they pile up
        // and must wait for staging memory. Without the stall the thread
        // could serve each WRITE before the next arrived, and the test's
        // "commands waited" check failed about one run in twenty.
        env.with_target(|t| {
            t.scsi()
                .faults()
                .push(FaultRule::delay(Duration::from_millis(200)).only(FaultFilter::Writes));
        });
        let mut mrs = Vec::new();
        let mut tags = Vec::new();
        for i in 0..n {
            let data = pattern((blocks * 512) as usize, i as u8);
            let mr = env.buffer(data.len(), AccessFlags::REMOTE_READ, p);
            mr.mem().write(0, &data).unwrap();
            tags.push(conn.send_cmd(
                0,
                &rw10(0x2a, i * blocks, blocks),
                DataOut::Direct(desc_of(&mr, 0, data.len() as u32)),
                DataIn::None,
                p,
            ));
            mrs.push(mr);
        }
        let mut answered: Vec<u64> = (0..n)
            .map(|_| conn.next_rsp(p))
            .map(|r| {
                assert_eq!(r.status, 0);
                r.tag
            })
            .collect();
        answered.sort_unstable();
        assert_eq!(answered, tags);
        let mut ins = Vec::new();
        for i in 0..n {
            let mr = env.buffer((blocks * 512) as usize, AccessFlags::REMOTE_WRITE, p);
            conn.send_cmd(
                0,
                &rw10(0x28, i * blocks, blocks),
                DataOut::None,
                DataIn::Direct(desc_of(&mr, 0, blocks * 512)),
                p,
            );
            ins.push(mr);
        }
        for _ in 0..n {
            assert_eq!(conn.next_rsp(p).status, 0);
        }
        for (i, mr) in ins.iter().enumerate() {
            let mut back = vec![0u8; (blocks * 512) as usize];
            mr.mem().read(0, &mut back).unwrap();
            assert_eq!(back, pattern(back.len(), i as u8), "command {i}");
        }
        let c = env.with_target(|t| t.counters());
        assert!(
            c.staging_waits > 0,
            "commands should have waited for memory"
        );
        assert_eq!(c.credit_violations, 0);
        for mr in mrs.iter().chain(&ins) {
            mr.dereg(p).unwrap();
        }
        conn.close(p);
    });
}

#[test]
fn works_on_a_stepped_fabric_too() {
    run_in(
        Mode::Stepped,
        config(),
        hca_lowlevel::sim::HcaConfig::new(TARGET_IP),
        |env, p| {
            let conn = env.connect(p);
            let data = pattern(4096, 5);
            assert_eq!(conn.write10(1, 3, 4096, &data, p).status, 0);
            let (_, back) = conn.read10(1, 3, 1, 4096, p);
            assert_eq!(back, data);
            conn.close(p);
        },
    );
}

#[test]
fn several_channels_at_once() {
    run(config(), |env, p| {
        let multi = storport_srp::wire::srp::LoginReqRepr {
            multichannel: storport_srp::wire::srp::MultiChannelAction::Multi,
            ..env.login_req()
        };
        let conns: Vec<_> = (0..3).map(|_| env.login(&multi, p).unwrap()).collect();
        // Eight commands in flight per channel, interleaved.
        let mut pending = Vec::new();
        for round in 0..8u32 {
            for (c, conn) in conns.iter().enumerate() {
                let lba = (c as u32 * 8 + round) * 8;
                let data = pattern(4096, (c as u32 * 8 + round) as u8);
                let mr = env.buffer(4096, AccessFlags::REMOTE_READ, p);
                mr.mem().write(0, &data).unwrap();
                conn.send_cmd(
                    0,
                    &rw10(0x2a, lba, 8),
                    DataOut::Direct(desc_of(&mr, 0, 4096)),
                    DataIn::None,
                    p,
                );
                pending.push((c, mr));
            }
        }
        for conn in &conns {
            for _ in 0..8 {
                assert_eq!(conn.next_rsp(p).status, 0);
            }
        }
        for (_, mr) in pending {
            mr.dereg(p).unwrap();
        }
        // Every block as written, read back over another channel.
        for c in 0..3u32 {
            for round in 0..8u32 {
                let lba = (c * 8 + round) * 8;
                let reader = &conns[((c + 1) % 3) as usize];
                let (_, back) = reader.read10(0, lba, 8, 512, p);
                assert_eq!(back, pattern(4096, (c * 8 + round) as u8));
            }
        }
        assert_eq!(env.with_target(|t| t.live_channels()), 3);
        // The initiator's DREQs end the target's channels.
        for conn in &conns {
            conn.close(p);
        }
        env.wait("every channel closed", || {
            env.with_target(|t| t.channels().is_empty() && t.counters().channels_closed == 3)
        });
    });
}

#[test]
fn stop_with_commands_outstanding() {
    run(config(), |env, p| {
        let conn = env.connect(p);
        env.with_target(|t| {
            t.set_misbehaviour(
                kverbs_tools::srp_target::Misbehaviour::DelayResponses {
                    delay: std::time::Duration::from_secs(60),
                    which: kverbs_tools::srp_target::Selector::All,
                },
                p,
            )
        });
        let mr = env.buffer(8192, AccessFlags::REMOTE_WRITE, p);
        for i in 0..4 {
            conn.send_cmd(
                0,
                &rw10(0x28, i * 4, 4),
                DataOut::None,
                DataIn::Direct(desc_of(&mr, u64::from(i) * 2048, 2048)),
                p,
            );
        }
        env.idle(std::time::Duration::from_millis(20));
        // Bounded: stop fails (and the test with it) if a stage outlasts
        // the configured stop timeout.
        env.stop_target(p);
        assert_eq!(conn.wait_terminal(), "disconnected-remote");
        mr.dereg(p).unwrap();
        conn.close(p);
    });
}

#[test]
fn a_restarted_target_serves_the_same_disk() {
    run(config(), |env, p| {
        let conn = env.connect(p);
        let data = pattern(4096, 0x71);
        assert_eq!(conn.write10(1, 5, 4096, &data, p).status, 0);
        let scsi = env.with_target(|t| std::sync::Arc::clone(t.scsi()));
        env.stop_target(p);
        conn.close(p);
        // Everything of the first target is gone (its CM port too), so a
        // new one can start on the same device.
        let again =
            kverbs_tools::srp_target::SrpTarget::start_with_scsi(&env.tnode.dev, scsi, config(), p)
                .unwrap();
        *env.target.lock().unwrap() = Some(again);
        let conn = env.connect(p);
        assert_eq!(conn.read10(1, 5, 1, 4096, p).1, data);
        conn.close(p);
    });
}

#[test]
fn start_on_hca_opens_and_closes_its_own_device() {
    use hca_lowlevel::sim::{ExecMode, Fabric, FabricConfig, HcaConfig};
    let platform = kverbs::platform::host::HostPlatform::new();
    let fabric = Fabric::new(FabricConfig {
        mode: ExecMode::Thread,
        seed: 1,
        ..FabricConfig::default()
    });
    let hca = fabric.add_hca(HcaConfig::new(TARGET_IP));
    platform.run_passive(|p| {
        let target =
            kverbs_tools::srp_target::SrpTarget::start_on_hca(&platform, hca, config(), p).unwrap();
        // The service GUID defaults to the HCA's node GUID.
        assert_eq!(target.service_guid(), 0x0200_00ff_fe00_0000 | 0x0a00_0002);
        assert_eq!(target.target_port_id().guid, target.service_guid());
        assert_eq!(target.scsi().lun_indices().count(), 2);
        target.stop(p).unwrap();
    });
    drop(fabric);
    platform.finish();
}
