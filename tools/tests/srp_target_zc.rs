//! READs served straight from the RAM disk's registered chunks: the data
//! across chunk ends and unallocated chunks, the pins that keep a chunk's
//! memory unchanged until the READ's WRITEs completed (a racing write
//! copies the chunk instead), and the pins going on every way a command
//! ends.

mod srp_target_support;

use std::sync::Arc;
use std::time::Duration;

use hca_lowlevel::device::AccessFlags;
use kverbs_tools::scsi_target::ScsiTarget;
use kverbs_tools::srp_target::{Misbehaviour, Selector};
use srp_target_support::*;
use storport_srp::wire::srp::{DataIn, DataOut};

const BLOCK: u32 = 512;
/// Blocks per store chunk of LUN 0 (64 KiB chunks).
const CHUNK_BLOCKS: u32 = (64 << 10) / BLOCK;

fn scsi(env: &Env) -> Arc<ScsiTarget> {
    env.with_target(|t| Arc::clone(t.scsi()))
}

fn delay_next_response(env: &Env, delay: Duration, p: &kverbs::irql::Passive<'_>) {
    env.with_target(|t| {
        t.set_misbehaviour(
            Misbehaviour::DelayResponses {
                delay,
                which: Selector::Next(1),
            },
            p,
        )
    });
}

#[test]
fn reads_across_chunks_and_unallocated_chunks_come_from_the_store() {
    run(config(), |env, p| {
        let conn = env.connect(p);
        let scsi = scsi(env);
        let store = scsi.lun(0).unwrap().store();
        assert_eq!(store.chunk_bytes(), 64 << 10);
        // Chunks 1 and 3 hold data; 0, 2 and 4 were never written.
        let one = pattern(64 << 10, 1);
        let three = pattern(64 << 10, 3);
        assert_eq!(conn.write10(0, CHUNK_BLOCKS, BLOCK, &one, p).status, 0);
        assert_eq!(
            conn.write10(0, 3 * CHUNK_BLOCKS, BLOCK, &three, p).status,
            0
        );
        assert_eq!(store.allocated_chunks(), 2);
        assert_eq!(store.registered_chunks(), 2);
        let mut disk = vec![0u8; 5 << 16];
        disk[64 << 10..128 << 10].copy_from_slice(&one);
        disk[192 << 10..256 << 10].copy_from_slice(&three);
        let zc0 = env.with_target(|t| t.counters()).zero_copy_reads;
        // Unaligned ranges: in the lane (up to 256 KiB) and on the thread.
        let mut reads = 0;
        for (lba, blocks) in [
            (CHUNK_BLOCKS - 3, 6),
            (CHUNK_BLOCKS / 2, 2 * CHUNK_BLOCKS),
            (1, 4 * CHUNK_BLOCKS),
            (7, 5 * CHUNK_BLOCKS - 7),
        ] {
            let (rsp, back) = conn.read10(0, lba, blocks, BLOCK, p);
            assert_eq!(rsp.status, 0);
            let at = (lba * BLOCK) as usize;
            assert!(
                back == disk[at..at + back.len()],
                "READ of {blocks} blocks at {lba}"
            );
            reads += 1;
        }
        // One READ spread over four initiator buffers.
        let mrs: Vec<_> = (0..4)
            .map(|_| env.buffer(48 << 10, AccessFlags::REMOTE_WRITE, p))
            .collect();
        let descs: Vec<_> = mrs.iter().map(|m| desc_of(m, 0, 48 << 10)).collect();
        let lba = CHUNK_BLOCKS / 3;
        let blocks = 4 * 96;
        let tag = conn.send_cmd(
            0,
            &rw10(0x28, lba, blocks),
            DataOut::None,
            DataIn::Indirect(indirect(&descs)),
            p,
        );
        let rsp = conn.next_rsp(p);
        assert_eq!((rsp.tag, rsp.status), (tag, 0));
        let mut back = Vec::new();
        for mr in &mrs {
            let mut part = vec![0u8; 48 << 10];
            mr.mem().read(0, &mut part).unwrap();
            back.extend_from_slice(&part);
            mr.dereg(p).unwrap();
        }
        let at = (lba * BLOCK) as usize;
        assert!(back == disk[at..at + back.len()], "the indirect READ");
        reads += 1;
        let c = env.with_target(|t| t.counters());
        assert_eq!(c.zero_copy_reads - zc0, reads);
        env.wait("every pin gone", || store.pinned_chunks() == 0);
        conn.close(p);
    });
}

#[test]
fn a_read_in_flight_pins_its_chunk_and_a_racing_write_copies_it() {
    run(config(), |env, p| {
        let conn = env.connect(p);
        let scsi = scsi(env);
        let store = scsi.lun(0).unwrap().store();
        let old = pattern(64 << 10, 1);
        assert_eq!(conn.write10(0, CHUNK_BLOCKS, BLOCK, &old, p).status, 0);
        // The READ executes (its extents taken, the chunk pinned) and its
        // response and data are held back.
        delay_next_response(env, Duration::from_millis(500), p);
        let mr = env.buffer(64 << 10, AccessFlags::REMOTE_WRITE, p);
        let tag = conn.send_cmd(
            0,
            &rw10(0x28, CHUNK_BLOCKS, CHUNK_BLOCKS),
            DataOut::None,
            DataIn::Direct(desc_of(&mr, 0, 64 << 10)),
            p,
        );
        env.wait("the READ to pin its chunk", || store.pinned_chunks() == 1);
        // A write to the same blocks does not wait for the READ: it writes
        // a copy of the chunk.
        let new = pattern(64 << 10, 2);
        assert_eq!(conn.write10(0, CHUNK_BLOCKS, BLOCK, &new, p).status, 0);
        assert_eq!(store.copies_on_write(), 1);
        assert_eq!(store.retired_chunks(), 1);
        assert_eq!(store.pinned_chunks(), 1);
        // The READ sends the bytes from before the write, whole.
        let rsp = conn.next_rsp(p);
        assert_eq!((rsp.tag, rsp.status), (tag, 0));
        let mut back = vec![0u8; 64 << 10];
        mr.mem().read(0, &mut back).unwrap();
        assert!(back == old, "the READ saw the racing write");
        mr.dereg(p).unwrap();
        env.wait("the READ's pin to go", || store.pinned_chunks() == 0);
        // Later READs see the write; the retired chunk is deregistered by
        // the next write.
        let (rsp, back) = conn.read10(0, CHUNK_BLOCKS, CHUNK_BLOCKS, BLOCK, p);
        assert_eq!((rsp.status, back == new), (0, true));
        assert_eq!(conn.write10(0, 0, BLOCK, &[7; 512], p).status, 0);
        assert_eq!(store.retired_chunks(), 0);
        // A write to an unpinned chunk writes in place.
        assert_eq!(store.copies_on_write(), 1);
        conn.close(p);
    });
}

#[test]
fn a_disconnect_unpins_and_stop_deregisters_every_chunk() {
    run(config(), |env, p| {
        let conn = env.connect(p);
        let scsi = scsi(env);
        let store = scsi.lun(0).unwrap().store();
        let data = pattern(128 << 10, 4);
        assert_eq!(conn.write10(0, 0, BLOCK, &data, p).status, 0);
        delay_next_response(env, Duration::from_secs(30), p);
        let mr = env.buffer(128 << 10, AccessFlags::REMOTE_WRITE, p);
        conn.send_cmd(
            0,
            &rw10(0x28, 0, 2 * CHUNK_BLOCKS),
            DataOut::None,
            DataIn::Direct(desc_of(&mr, 0, 128 << 10)),
            p,
        );
        env.wait("the READ to pin two chunks", || store.pinned_chunks() == 2);
        // A write racing it copies both chunks, retiring the pinned ones.
        assert_eq!(conn.write10(0, 0, BLOCK, &data, p).status, 0);
        assert_eq!(store.retired_chunks(), 2);
        // The initiator goes away with the READ unanswered: the channel
        // closes, its command goes, the pins with it.
        conn.close(p);
        env.wait("the pins to go", || store.pinned_chunks() == 0);
        mr.dereg(p).unwrap();
        assert_eq!(store.registered_chunks(), 2);
        env.stop_target(p);
        // Stopping moved the data back to the heap and deregistered every
        // chunk (the target's PD could not be freed otherwise).
        assert_eq!(store.registered_chunks(), 0);
        assert_eq!(store.retired_chunks(), 0);
        let mut back = Vec::new();
        store.read(0, data.len() as u64, &mut |piece| {
            back.extend_from_slice(piece)
        });
        assert!(back == data);
    });
}

#[test]
fn a_logout_answers_the_pinned_read_then_every_pin_goes() {
    run(config(), |env, p| {
        let conn = env.connect(p);
        let scsi = scsi(env);
        let store = scsi.lun(0).unwrap().store();
        let data = pattern(64 << 10, 9);
        assert_eq!(conn.write10(0, 0, BLOCK, &data, p).status, 0);
        delay_next_response(env, Duration::from_millis(300), p);
        let mr = env.buffer(64 << 10, AccessFlags::REMOTE_WRITE, p);
        let tag = conn.send_cmd(
            0,
            &rw10(0x28, 0, CHUNK_BLOCKS),
            DataOut::None,
            DataIn::Direct(desc_of(&mr, 0, 64 << 10)),
            p,
        );
        env.wait("the READ to pin its chunk", || store.pinned_chunks() == 1);
        // The target answers what it still owes, then ends the channel.
        conn.i_logout(p);
        let rsp = conn.next_rsp(p);
        assert_eq!((rsp.tag, rsp.status), (tag, 0));
        let mut back = vec![0u8; 64 << 10];
        mr.mem().read(0, &mut back).unwrap();
        assert!(back == data);
        conn.wait_terminal();
        env.wait("the pin to go", || store.pinned_chunks() == 0);
        mr.dereg(p).unwrap();
        conn.close(p);
    });
}

/// Blocks of version `v`: each 512-byte block is its LBA (8 bytes) and
/// then `v` repeated.
fn versioned(lba: u32, blocks: u32, v: u8) -> Vec<u8> {
    let mut out = Vec::with_capacity((blocks * BLOCK) as usize);
    for b in 0..blocks {
        out.extend_from_slice(&u64::from(lba + b).to_le_bytes());
        out.extend(std::iter::repeat_n(v, BLOCK as usize - 8));
    }
    out
}

/// Every block read is one version whole (or never written): none torn.
fn check_blocks(lba: u32, data: &[u8]) {
    for (i, block) in data.chunks(BLOCK as usize).enumerate() {
        if block.iter().all(|b| *b == 0) {
            continue;
        }
        let want_lba = u64::from(lba) + i as u64;
        assert_eq!(
            block[..8],
            want_lba.to_le_bytes(),
            "block {want_lba}: wrong LBA"
        );
        let v = block[8];
        assert!(
            block[8..].iter().all(|b| *b == v),
            "block {want_lba} is torn"
        );
    }
}

#[test]
fn reads_racing_overlapping_writes_see_whole_blocks() {
    let rounds: u32 = std::env::var("SRP_TARGET_ZC_RACE_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(12);
    run(config(), |env, p| {
        let conn = env.connect(p);
        let scsi = scsi(env);
        let store = scsi.lun(0).unwrap().store();
        // 96 KiB writes and 128 KiB reads over three chunks, overlapping,
        // in flight together: reads run in the DPC and on the thread, the
        // writes on the thread (their data comes by RDMA READ).
        let span = 3 * CHUNK_BLOCKS;
        let mut rng = fastrand::Rng::with_seed(7);
        for round in 0..rounds {
            let mut reads = Vec::new();
            let mut writes = Vec::new();
            for i in 0..12u32 {
                if i % 3 == 0 {
                    let blocks = 192;
                    let lba = rng.u32(0..span - blocks);
                    let v = (round * 4 + i / 3 + 1) as u8;
                    let data = versioned(lba, blocks, v);
                    let mr = env.buffer(data.len(), AccessFlags::REMOTE_READ, p);
                    mr.mem().write(0, &data).unwrap();
                    let tag = conn.send_cmd(
                        0,
                        &rw10(0x2a, lba, blocks),
                        DataOut::Direct(desc_of(&mr, 0, data.len() as u32)),
                        DataIn::None,
                        p,
                    );
                    writes.push((tag, mr));
                } else {
                    let blocks = 256;
                    let lba = rng.u32(0..span - blocks);
                    let mr = env.buffer((blocks * BLOCK) as usize, AccessFlags::REMOTE_WRITE, p);
                    let tag = conn.send_cmd(
                        0,
                        &rw10(0x28, lba, blocks),
                        DataOut::None,
                        DataIn::Direct(desc_of(&mr, 0, blocks * BLOCK)),
                        p,
                    );
                    reads.push((tag, lba, mr));
                }
            }
            for _ in 0..reads.len() + writes.len() {
                assert_eq!(conn.next_rsp(p).status, 0);
            }
            for (_, lba, mr) in reads {
                let mut back = vec![0u8; mr.len()];
                mr.mem().read(0, &mut back).unwrap();
                check_blocks(lba, &back);
                mr.dereg(p).unwrap();
            }
            for (_, mr) in writes {
                mr.dereg(p).unwrap();
            }
        }
        env.wait("every pin gone", || store.pinned_chunks() == 0);
        let c = env.with_target(|t| t.counters());
        assert!(c.zero_copy_reads >= u64::from(rounds) * 8);
        conn.close(p);
    });
}
