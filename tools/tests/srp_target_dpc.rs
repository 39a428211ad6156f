//! The SRP target's DPC lane: which commands it serves in the CQ's DPC
//! (counted in `ius_served_in_dpc`), which it leaves to the channel
//! thread, and that serving at `DISPATCH_LEVEL` allocates nothing (the
//! verifier's allocator counts allocations at DISPATCH, and every test
//! ends with `HostPlatform::finish`, which fails on any violation).

mod srp_target_support;

use std::time::Duration;

use hca_lowlevel::device::AccessFlags;
use kverbs_tools::srp_target::{Misbehaviour, Selector};
use srp_target_support::*;
use storport_srp::wire::srp::{DataIn, DataOut, TaskMgmtFunction, TmResponse};

fn served(env: &Env) -> u64 {
    env.with_target(|t| t.counters()).ius_served_in_dpc
}

#[test]
fn reads_immediate_writes_and_no_data_commands_are_served_in_the_dpc_without_allocating() {
    run(config(), |env, p| {
        let conn = env.connect(p);
        let before_allocs = env.platform.allocations_at_dispatch();
        let c0 = env.with_target(|t| t.counters());
        // The first write to an empty chunk allocates it: the thread's job
        // (the lane declines, the thread writes).
        let first = pattern(4096, 1);
        let rsp = conn.send_cmd(
            0,
            &rw10(0x2a, 0, 8),
            DataOut::Immediate {
                offset: 68,
                data: &first,
            },
            DataIn::None,
            p,
        );
        assert_eq!(conn.next_rsp(p).tag, rsp);
        assert_eq!(served(env), c0.ius_served_in_dpc);
        // The chunk exists now: an immediate-data WRITE, READs of 4 KiB and
        // 64 KiB, and TEST UNIT READY are served in the DPC.
        let second = pattern(4096, 2);
        let tag = conn.send_cmd(
            0,
            &rw10(0x2a, 8, 8),
            DataOut::Immediate {
                offset: 68,
                data: &second,
            },
            DataIn::None,
            p,
        );
        let rsp = conn.next_rsp(p);
        assert_eq!((rsp.tag, rsp.status), (tag, 0));
        let (rsp, back) = conn.read10(0, 0, 16, 512, p);
        assert_eq!(rsp.status, 0);
        assert_eq!(&back[..4096], &first[..]);
        assert_eq!(&back[4096..], &second[..]);
        let (rsp, big) = conn.read10(0, 0, 128, 512, p);
        assert_eq!(rsp.status, 0);
        assert_eq!(&big[..8192], &back[..]);
        // 128 KiB over two chunks, the second never written: served in the
        // DPC from the first chunk and the shared zeros, no staging buffer.
        let (rsp, huge) = conn.read10(0, 0, 256, 512, p);
        assert_eq!(rsp.status, 0);
        assert_eq!(&huge[..64 << 10], &big[..]);
        assert!(huge[64 << 10..].iter().all(|b| *b == 0));
        let tag = conn.send_cmd(0, &[0u8; 6], DataOut::None, DataIn::None, p);
        assert_eq!(conn.next_rsp(p).tag, tag);
        let c1 = env.with_target(|t| t.counters());
        assert_eq!(c1.ius_served_in_dpc - c0.ius_served_in_dpc, 5);
        assert_eq!(c1.zero_copy_reads - c0.zero_copy_reads, 3);
        // Counted as the thread counts them.
        assert_eq!(c1.srp_cmd - c0.srp_cmd, 6);
        assert_eq!(c1.responses_sent - c0.responses_sent, 6);
        assert_eq!(c1.credits_granted - c0.credits_granted, 6);
        assert_eq!(c1.bytes_immediate - c0.bytes_immediate, 8192);
        assert_eq!(c1.bytes_data_in - c0.bytes_data_in, 8192 + 65536 + 131_072);
        assert_eq!(c1.credit_violations, 0);
        assert_eq!(
            env.platform.allocations_at_dispatch(),
            before_allocs,
            "the lane allocated at DISPATCH_LEVEL"
        );
        conn.close(p);
    });
}

#[test]
fn the_thread_serves_what_the_lane_cannot() {
    run(config(), |env, p| {
        let conn = env.connect(p);
        let data = pattern(512 << 10, 5);
        // DATA-OUT by RDMA READ and a 512 KiB READ: the thread (a READ
        // from the store's chunks goes to the lane up to 256 KiB).
        let before = served(env);
        assert_eq!(conn.write10(0, 0, 512, &data, p).status, 0);
        let (rsp, back) = conn.read10(0, 0, 1024, 512, p);
        assert_eq!((rsp.status, back == data), (0, true));
        assert_eq!(served(env), before);
        // A 128 KiB READ: the lane, straight from the chunks.
        let zc = env.with_target(|t| t.counters()).zero_copy_reads;
        let (rsp, back) = conn.read10(0, 128, 256, 512, p);
        assert_eq!((rsp.status, &back[..]), (0, &data[64 << 10..192 << 10]));
        assert_eq!(served(env), before + 1);
        assert_eq!(env.with_target(|t| t.counters()).zero_copy_reads, zc + 1);
        let before = served(env);
        // INQUIRY builds its answer on the heap: the thread.
        let (rsp, _) = conn.data_in(0, &inquiry(96), 96, p);
        assert_eq!(rsp.status, 0);
        assert_eq!(served(env), before);
        // A switch armed: the thread (it applies the switch), and the lane
        // again once it is cleared.
        env.with_target(|t| {
            t.set_misbehaviour(
                Misbehaviour::DelayResponses {
                    delay: Duration::from_millis(1),
                    which: Selector::Next(1),
                },
                p,
            )
        });
        let (rsp, _) = conn.read10(0, 0, 8, 512, p);
        assert_eq!(rsp.status, 0);
        assert_eq!(served(env), before);
        assert_eq!(env.with_target(|t| t.counters()).responses_delayed, 1);
        let (rsp, _) = conn.read10(0, 0, 8, 512, p);
        assert_eq!(rsp.status, 0);
        assert_eq!(served(env), before + 1);
        // Task management is the thread's; a command the lane answered is
        // not abortable any more (as a thread command whose response was
        // posted).
        let (_, _) = conn.read10(0, 0, 8, 512, p);
        let answered = conn.new_tag() - 1;
        let tm = conn.send_tm(TaskMgmtFunction::AbortTask, 0, answered, p);
        let rsp = conn.next_rsp(p);
        assert_eq!(rsp.tag, tm);
        assert_eq!(rsp.tm(), Some(TmResponse::Failed));
        conn.close(p);
    });
}

#[test]
fn off_in_the_configuration_the_thread_serves_everything() {
    let mut cfg = config();
    cfg.serve_in_dpc = false;
    run(cfg, |env, p| {
        let conn = env.connect(p);
        assert_eq!(conn.write10(0, 0, 512, &pattern(4096, 3), p).status, 0);
        for _ in 0..4 {
            let (rsp, back) = conn.read10(0, 0, 8, 512, p);
            assert_eq!((rsp.status, back), (0, pattern(4096, 3)));
        }
        assert_eq!(served(env), 0);
        conn.close(p);
    });
}

#[test]
fn logout_waits_for_the_lane_s_commands() {
    run(config(), |env, p| {
        let conn = env.connect(p);
        assert_eq!(conn.write10(0, 0, 512, &pattern(4096, 4), p).status, 0);
        // Several reads in flight at once, then the logout right behind
        // them: every one is answered before the target disconnects.
        let mut mrs = Vec::new();
        let mut tags = Vec::new();
        for _ in 0..8 {
            let mr = env.buffer(4096, AccessFlags::REMOTE_WRITE, p);
            tags.push(conn.send_cmd(
                0,
                &rw10(0x28, 0, 8),
                DataOut::None,
                DataIn::Direct(desc_of(&mr, 0, 4096)),
                p,
            ));
            mrs.push(mr);
        }
        conn.i_logout(p);
        let mut answered: Vec<u64> = (0..8).map(|_| conn.next_rsp(p).tag).collect();
        answered.sort_unstable();
        assert_eq!(answered, tags);
        assert_eq!(conn.wait_terminal(), "disconnected-remote");
        for mr in &mrs {
            let mut back = vec![0u8; 4096];
            mr.mem().read(0, &mut back).unwrap();
            assert_eq!(back, pattern(4096, 4));
            mr.dereg(p).unwrap();
        }
        assert!(served(env) > 0, "the lane served none of the reads");
        conn.close(p);
    });
}
