//! Interop through the whole initiator: the host StorPort model → the
//! miniport core → the SRP engine → kverbs → the software HCA on the RoCEv2
//! link → the Linux kernel's `ib_srpt` (LIO) over `rdma_rxe` in the target
//! VM. One VM boot for the whole binary; the phases run in order against
//! it, each printing what it did:
//!
//! 1. login through the miniport core (the `add_target` string from the
//!    VM's `TargetInfo`, RDMA/CM, `target_port_id` = service GUID twice);
//! 2. INQUIRY (standard and VPD 0x80), REPORT LUNS, READ CAPACITY, with
//!    LIO's unit attentions read and answered as the class driver would;
//! 3. data-verified reads and writes: every block of both LUNs written and
//!    read back with 1 MiB I/Os, then thousands of random I/Os, 512 B to
//!    1 MiB, at queue depths 1 to 64 (`VM_SRP_IOS` scales them), and the
//!    fileio LUN's backing file hashed in the VM against what we wrote;
//! 4. task management through the StorPort model's SRB functions: ABORT
//!    TASK of queued commands and a LOGICAL UNIT RESET during I/O;
//! 5. the target drops the session (TPG disabled in configfs): the engine
//!    recovers when it is back, I/O held during the outage completes, and
//!    I/O past `fast_io_fail_tmo` fails fast with a truthful status;
//! 6. orderly logout (adapter stop: DREQ/DREP on every channel) and a
//!    teardown that checks every request completed exactly once;
//! 7. a new login with `ch_count=2`: srpt answers the first channel "no
//!    channel" (so the logout really ended the old session there) and the
//!    second "maintained", verified I/O runs over both, then a LUN reset
//!    with I/O in flight on both channels (sent on each) leaves both
//!    channels live and the data intact.
//!
//! The link's pcap is kept in the VM's run directory when the run fails
//! (its path printed). Behind the `vm-tests` feature; CI step 62. It skips
//! (loudly) only when the VM cannot be prepared here, and never under CI.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kverbs::irql::Passive;
use kverbs::platform::host::VerifierAllocator;
use kverbs_tests::interop::{
    Interop, InteropConfig, LinkWire, MIB, PcapGuard, Record, ShadowDisk, command_in_ua, exec,
    interop_platform, prepared_or_skip, spread, wait_until, workload,
};
use kverbs_tests::{Io, Op, env_count};
use kverbs_tools::vm::{Vm, VmConfig};
use md5::Digest as _;
use std::sync::Arc;
use storport_srp::storport::SrbStatus;
use storport_srp::storport::host::SgShape;
use storport_srp::wire::srp::MultiChannelResult;

#[global_allocator]
static ALLOCATOR: VerifierAllocator = VerifierAllocator;

#[test]
fn srp_through_the_miniport_against_linux_srpt() {
    let Some(prepared) = prepared_or_skip("srp_through_the_miniport_against_linux_srpt") else {
        return;
    };
    // Two 16 MiB LUNs (a RAM disk and a file): small enough to be written
    // whole and read back in a few seconds under TCG.
    let lun = |backstore| kverbs_tools::vm::LunConfig {
        backstore,
        size_mib: 16,
        block_size: 512,
    };
    let config = VmConfig {
        instance: "srp-interop".to_owned(),
        luns: vec![
            lun(kverbs_tools::vm::Backstore::RdMcp),
            lun(kverbs_tools::vm::Backstore::Fileio),
        ],
        ..VmConfig::default()
    };
    let t0 = Instant::now();
    let mut vm = Vm::boot(&config, &prepared).unwrap_or_else(|e| panic!("{e}"));
    let info = vm.info().clone();
    let mut rec = Record::new("interop");
    rec.note(format!(
        "VM: kernel {} ({}), ready after {:.1} s",
        info.kernel_release, info.kernel_package, info.boot_secs
    ));
    let pcap = vm.paths().dir.join("srp-interop.pcap");
    let mut guard = PcapGuard::new(pcap.clone());
    let wire = Arc::new(LinkWire::new(vm.take_link().expect("the link socket")));
    let srpt = info.srpt.clone().expect("srpt enabled");
    let tpg = format!("/sys/kernel/config/target/srpt/{}/tpgt_1", srpt.wwn);

    let platform = interop_platform();
    let iconfig = InteropConfig {
        keys: "queue_size=64,max_sect=2048,max_cmd_per_lun=64,cmd_sg_entries=255,sg_tablesize=2048"
            .to_owned(),
        pcap: Some(pcap.clone()),
        ..InteropConfig::default()
    };
    let stack = platform.run_passive(|p| {
        let s = match Interop::start(platform.clone(), &info, wire.clone(), &iconfig, p) {
            Ok(s) => s,
            Err(e) => panic!(
                "login through the miniport: {}\n{}",
                e.0,
                exec(&vm, "dmesg | tail -30")
            ),
        };
        // ------------------------------------------------------------
        // 1. Login.
        let st = s.stats(p);
        assert_eq!((st.logins, st.live_channels), (1, 1), "{st:?}");
        let neg = s.transport().negotiated(0, 0, p);
        rec.note(format!(
            "login: {} -> live, req_lim {}, negotiated {neg:?}",
            s.add_target, st.req_lim
        ));
        let dmesg = exec(&vm, "dmesg");
        assert!(
            dmesg.contains("Received SRP_LOGIN_REQ"),
            "srpt did not log the login:\n{dmesg}"
        );

        // ------------------------------------------------------------
        // 2. INQUIRY, VPD, REPORT LUNS, READ CAPACITY.
        let mut shadows = BTreeMap::new();
        for lun in &info.luns {
            let l = u8::try_from(lun.lun).unwrap();
            let (o, data, uas) = command_in_ua(&s, l, |s, l, p| s.inquiry(l, p), p);
            assert!(
                matches!(o.status.base(), SrbStatus::SUCCESS | SrbStatus::DATA_OVERRUN),
                "INQUIRY LUN {l}: {o:?}"
            );
            assert!(uas.is_empty(), "INQUIRY reports no unit attention: {uas:?}");
            assert!(data.len() >= 36, "{data:?}");
            assert_eq!(data[0] & 0x1f, 0, "direct access block device");
            let vendor = String::from_utf8_lossy(&data[8..16]).trim().to_owned();
            let product = String::from_utf8_lossy(&data[16..32]).trim().to_owned();
            assert_eq!(vendor, "LIO-ORG");
            let want = match lun.backstore {
                kverbs_tools::vm::Backstore::RdMcp => "RAMDISK-MCP",
                kverbs_tools::vm::Backstore::Fileio => "FILEIO",
            };
            assert!(product.starts_with(want), "LUN {l}: product {product:?}");
            let (o, vpd, _) = command_in_ua(&s, l, |s, l, p| s.inquiry_vpd(l, 0x80, p), p);
            assert!(
                matches!(o.status.base(), SrbStatus::SUCCESS | SrbStatus::DATA_OVERRUN),
                "VPD 0x80 LUN {l}: {o:?}"
            );
            let serial = String::from_utf8_lossy(&vpd[4..]).trim_end_matches('\0').trim().to_owned();
            assert_eq!(serial, lun.unit_serial, "LUN {l}");
            let (o, cap, uas) = command_in_ua(&s, l, |s, l, p| s.read_capacity(l, p), p);
            assert_eq!(o.status.base(), SrbStatus::SUCCESS, "READ CAPACITY LUN {l}: {o:?}");
            let last = u64::from_be_bytes(cap[0..8].try_into().unwrap());
            let block = u32::from_be_bytes(cap[8..12].try_into().unwrap());
            assert_eq!(block, lun.block_size, "LUN {l}");
            assert_eq!((last + 1) * u64::from(block), lun.size_bytes, "LUN {l}");
            rec.note(format!(
                "LUN {l}: {vendor} {product}, serial {serial}, {} x {block} B, unit attentions {uas:?}",
                last + 1
            ));
            shadows.insert(l, ShadowDisk::new(block, last + 1));
        }
        let (o, data, _) = command_in_ua(&s, 0, |s, _, p| s.report_luns(p), p);
        assert!(
            matches!(o.status.base(), SrbStatus::SUCCESS | SrbStatus::DATA_OVERRUN),
            "{o:?}"
        );
        let list = storport_srp::scsi::ReportLunsData::new_checked(&data[..]).unwrap();
        // LIO lists them newest mapping first: the set is what counts.
        let mut luns: Vec<_> = list.luns().map(|l| l.index()).collect();
        luns.sort_unstable();
        assert_eq!(luns, vec![Some(0), Some(1)]);

        // ------------------------------------------------------------
        // 3. Data.
        data_phase(&s, &vm, &info, &mut shadows, &mut rec, p);

        // ------------------------------------------------------------
        // 4. Task management.
        tmf_phase(&s, &mut shadows, &mut rec, p);

        // ------------------------------------------------------------
        // 5. The target drops the session.
        reconnect_phase(&s, &vm, &tpg, &mut shadows, &mut rec, p);

        // ------------------------------------------------------------
        // 6. Orderly logout.
        let before = s.stats(p);
        let t = Instant::now();
        s.stop(p);
        let st = s.stats(p);
        assert_eq!(st.live_channels, 0, "{st:?}");
        assert_eq!(st.transport_failures, before.transport_failures, "{st:?}");
        rec.note(format!(
            "logout: adapter stopped, channels disconnected in {:.2} s",
            t.elapsed().as_secs_f64()
        ));
        let link = s.link_stats().expect("link stats");
        assert_eq!(link.rx_bad_icrc + link.rx_malformed, 0, "{link:?}");
        rec.note(format!("link: {link:?}"));
        s
    });
    platform.run_passive(|p| stack.finish(p));

    // ----------------------------------------------------------------
    // 7. A new login with two channels (SRP multichannel): the first
    //    channel's login finds no channel of ours left at the target (the
    //    logout above really ended the session there), the second joins it.
    let mc_pcap = vm.paths().dir.join("srp-interop-mc.pcap");
    let mut mc_guard = PcapGuard::new(mc_pcap.clone());
    let platform = interop_platform();
    let mc_config = InteropConfig {
        keys: format!("{},ch_count=2", iconfig.keys),
        pcap: Some(mc_pcap),
        ..iconfig.clone()
    };
    let stack = platform.run_passive(|p| {
        let s = match Interop::start(platform.clone(), &info, wire.clone(), &mc_config, p) {
            Ok(s) => s,
            Err(e) => panic!("two-channel login: {}", e.0),
        };
        assert!(
            wait_until(Duration::from_secs(30), || s.stats(p).live_channels == 2),
            "second channel: {:?}",
            s.stats(p)
        );
        let first = s.transport().negotiated(0, 0, p).expect("channel 0");
        let second = s.transport().negotiated(0, 1, p).expect("channel 1");
        assert_eq!(first.multichannel, MultiChannelResult::NoChannel, "{first:?}");
        assert_eq!(second.multichannel, MultiChannelResult::Maintained, "{second:?}");
        // The unit attention of the new nexus, then verified I/O spread
        // over both channels.
        let mut shadows = BTreeMap::new();
        for l in 0..2u8 {
            let (o, cap, uas) = command_in_ua(&s, l, |s, l, p| s.read_capacity(l, p), p);
            assert_eq!(o.status.base(), SrbStatus::SUCCESS, "{o:?}");
            let last = u64::from_be_bytes(cap[0..8].try_into().unwrap());
            shadows.insert(l, ShadowDisk::new(512, last + 1));
            if !uas.is_empty() {
                eprintln!("[interop] two channels, LUN {l}: unit attentions {uas:?}");
            }
        }
        let mut rng = fastrand::Rng::with_seed(0x5eed_0005);
        let n = env_count("VM_SRP_MC_IOS", 400);
        let mut ios = Vec::new();
        for i in 0..n {
            let lun = u8::try_from(i % 2).unwrap();
            let sh = &shadows[&lun];
            // Writes first, then a mix: what is read back was written here.
            let ratio = if i < n / 2 { 0.0 } else { 0.5 };
            ios.extend(workload(&mut rng, 1, lun, 512, sh.blocks(), 512, 256 << 10, ratio));
        }
        let t = Instant::now();
        let done = s.run_ios(&ios, 32, &mut shadows, Duration::from_secs(300), p);
        s.all_succeeded(&done, "two channels", p);
        let checked = ios.iter().filter(|io| io.op == Op::Read).count();
        // A LUN reset with I/O in flight on both channels: it goes out on
        // each (RC orders it only behind its own channel's commands), LIO
        // resets the LUN for both nexuses, and nothing the initiator
        // fenced is run afterwards (no transport failure).
        let tmfs_before = s.stats(p).tmfs_sent;
        let (reset_n, reset_outcomes, reset_uas) = s.lun_reset_during_io(&mut rng, &mut shadows, p);
        s.verify_all(&mut shadows, p);
        let st = s.stats(p);
        assert_eq!(st.transport_failures, 0, "{st:?}");
        assert_eq!(st.live_channels, 2, "{st:?}");
        assert_eq!(st.tmfs_sent - tmfs_before, 2, "one reset per channel: {st:?}");
        rec.note(format!(
            "ch_count=2: LUN RESET during {reset_n} I/Os on both channels: SUCCESS; outcomes {reset_outcomes:?}; unit attentions {reset_uas:?}; TMFs {}",
            st.tmfs_sent - tmfs_before
        ));
        rec.note(format!(
            "ch_count=2: channel 0 {:?}, channel 1 {:?}; {n} I/Os ({checked} reads) at depth 32 in {:.1} s",
            first.multichannel,
            second.multichannel,
            t.elapsed().as_secs_f64()
        ));
        s.stop(p);
        s
    });
    platform.run_passive(|p| stack.finish(p));
    mc_guard.passed();
    // The VM saw nothing wrong from us.
    let dmesg = exec(&vm, "dmesg");
    for bad in ["ICRC", "icrc", "rxe: bad", "BUG", "WARNING"] {
        assert!(
            !dmesg.contains(bad),
            "kernel log mentions {bad:?}:\n{dmesg}"
        );
    }
    rec.note(format!("total {:.1} s", t0.elapsed().as_secs_f64()));
    rec.print_summary();
    guard.passed();
    drop(guard);
    vm.shutdown();
}

/// Every block of every LUN written (1 MiB writes) and read back, then
/// random I/O over sizes and depths, then the fileio backing file hashed in
/// the VM against the shadow.
fn data_phase(
    s: &Interop,
    vm: &Vm,
    info: &kverbs_tools::vm::TargetInfo,
    shadows: &mut BTreeMap<u8, ShadowDisk>,
    rec: &mut Record,
    p: &Passive<'_>,
) {
    let mut rng = fastrand::Rng::with_seed(0x5eed_0001);
    let t = Instant::now();
    let mut fill = Vec::new();
    let mut read_all = Vec::new();
    for (lun, sh) in shadows.iter() {
        let per = MIB / sh.block_len();
        for lba in (0..sh.blocks()).step_by(per as usize) {
            let blocks = per.min(u32::try_from(sh.blocks() - lba).unwrap());
            let mut data = vec![0u8; (blocks * sh.block_len()) as usize];
            rng.fill(&mut data);
            let io = Io {
                target: 0,
                lun: *lun,
                op: Op::Write,
                lba,
                blocks,
                block_len: sh.block_len(),
                shape: SgShape::Pages,
                data,
            };
            read_all.push(Io {
                op: Op::Read,
                data: Vec::new(),
                shape: SgShape::Odd { seed: lba },
                ..io.clone()
            });
            fill.push(io);
        }
    }
    let bytes: u64 = fill
        .iter()
        .map(|io| u64::from(io.blocks * io.block_len))
        .sum();
    let done = s.run_ios(&fill, 8, shadows, Duration::from_secs(300), p);
    s.all_succeeded(&done, "fill", p);
    let done = s.run_ios(&read_all, 8, shadows, Duration::from_secs(300), p);
    s.all_succeeded(&done, "read back", p);
    assert!(shadows.values().all(ShadowDisk::all_known));
    let secs = t.elapsed().as_secs_f64();
    rec.note(format!(
        "fill + read back: {} I/Os of 1 MiB, {:.0} MiB in {secs:.1} s ({:.1} MiB/s)",
        fill.len() + read_all.len(),
        2.0 * bytes as f64 / f64::from(MIB),
        2.0 * bytes as f64 / f64::from(MIB) / secs
    ));

    // Random I/O: log-uniform 512 B..1 MiB at each depth.
    let total = env_count("VM_SRP_IOS", 2400);
    let depths = [1usize, 4, 16, 64];
    for depth in depths {
        let n = total / depths.len();
        let mut ios = Vec::new();
        for i in 0..n {
            let lun = u8::try_from(i % 2).unwrap();
            let sh = &shadows[&lun];
            ios.extend(workload(
                &mut rng,
                1,
                lun,
                sh.block_len(),
                sh.blocks(),
                512,
                MIB,
                0.5,
            ));
        }
        // Placed clear of the `depth` before each, so that an overlap does
        // not hold the run below its depth (random placement alone kept
        // "depth 64" far lower).
        spread(&mut rng, &mut ios, depth, shadows);
        let t = Instant::now();
        let (done, queue) = s.run_ios_measured(&ios, depth, shadows, Duration::from_secs(240), p);
        s.all_succeeded(&done, &format!("depth {depth}"), p);
        assert_eq!(queue.peak, depth, "depth {depth}: {queue:?}");
        let secs = t.elapsed().as_secs_f64();
        let bytes: u64 = ios
            .iter()
            .map(|io| u64::from(io.blocks * io.block_len))
            .sum();
        let (small, large) = (
            ios.iter()
                .map(|io| io.blocks * io.block_len)
                .min()
                .unwrap_or(0),
            ios.iter()
                .map(|io| io.blocks * io.block_len)
                .max()
                .unwrap_or(0),
        );
        rec.note(format!(
            "depth {depth}: {n} I/Os ({} reads), {small} B..{large} B, {:.1} MiB in {secs:.1} s ({:.0} IOPS, {:.1} MiB/s), \
             in flight peak {} mean {:.1}",
            ios.iter().filter(|io| io.op == Op::Read).count(),
            bytes as f64 / f64::from(MIB),
            n as f64 / secs,
            bytes as f64 / f64::from(MIB) / secs,
            queue.peak,
            queue.mean
        ));
    }
    let st = s.stats(p);
    assert_eq!(st.transport_failures, 0, "{st:?}");
    rec.note(format!(
        "engine: {} completed, {} direct, {} indirect, {} immediate writes, busy credit {}, busy resources {}",
        st.completed,
        st.direct_commands,
        st.indirect_commands,
        st.immediate_writes,
        st.busy_credit,
        st.busy_resources
    ));

    // The fileio LUN's backing file, hashed in the VM.
    for lun in info
        .luns
        .iter()
        .filter(|l| l.backstore == kverbs_tools::vm::Backstore::Fileio)
    {
        let l = u8::try_from(lun.lun).unwrap();
        let sh = &shadows[&l];
        assert!(sh.all_known());
        let out = exec(vm, &format!("md5sum /run/kvvm/lun{l}.img"));
        let theirs = out.split_whitespace().next().unwrap_or("").to_owned();
        let ours: String = md5::Md5::digest(sh.image())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(
            theirs, ours,
            "LUN {l}: the backing file is not what we wrote"
        );
        rec.note(format!(
            "LUN {l}: backing file md5 {theirs} matches the shadow"
        ));
    }
}

/// ABORT TASK of commands queued behind others, and a LUN RESET during
/// I/O, through the StorPort model's SRB functions. A too-late abort's
/// victim may have been reset when the engine escalated a TMF timeout (a
/// reconnect).
fn tmf_phase(
    s: &Interop,
    shadows: &mut BTreeMap<u8, ShadowDisk>,
    rec: &mut Record,
    p: &Passive<'_>,
) {
    let mut rng = fastrand::Rng::with_seed(0x5eed_0002);
    let before = s.stats(p);
    let tally = s.abort_queued_tasks(
        &mut rng,
        shadows,
        |st| st.tmf_timeouts > before.tmf_timeouts,
        rec,
        p,
    );
    let st = s.stats(p);
    rec.note(format!(
        "ABORT TASK: {} aborted {:?}, {} too late {:?}; TMFs sent {}, timed out {}",
        tally.aborted,
        tally.aborted_ops,
        tally.too_late,
        tally.late_ops,
        st.tmfs_sent - before.tmfs_sent,
        st.tmf_timeouts - before.tmf_timeouts
    ));

    let (n, by_status, uas) = s.lun_reset_during_io(&mut rng, shadows, p);
    rec.note(format!(
        "LUN RESET during {n} I/Os: SUCCESS; I/O outcomes {by_status:?}; then unit attentions {uas:?}"
    ));
    s.verify_all(shadows, p);
}

/// The target drops the session: the TPG is disabled in configfs (srpt
/// disconnects every channel of it and refuses logins until it is enabled
/// again).
fn reconnect_phase(
    s: &Interop,
    vm: &Vm,
    tpg: &str,
    shadows: &mut BTreeMap<u8, ShadowDisk>,
    rec: &mut Record,
    p: &Passive<'_>,
) {
    let mut rng = fastrand::Rng::with_seed(0x5eed_0004);
    // (a) A short outage with I/O in flight and I/O submitted during it:
    // held, then completed after the reconnect.
    let short = s.short_outage(&mut rng, shadows, vm, tpg, p);
    rec.note(format!(
        "TPG disabled: session lost after {:.2} s; {} of {} I/Os held during the outage; reconnected {:.2} s after re-enable; in flight {:?}, during {:?}; failure code {:#x}",
        short.lost_after.as_secs_f64(),
        short.held,
        short.submitted_during,
        short.back_after.as_secs_f64(),
        short.in_flight,
        short.during,
        s.stats(p).last_transport_failure
    ));

    // (b) An outage past fast_io_fail_tmo: held I/O fails fast, truthfully.
    let long = s.outage_past_fast_fail(&mut rng, shadows, vm, tpg, p);
    assert_eq!(
        long.outcomes.get(&SrbStatus::SUCCESS),
        None,
        "success while the target is gone: {:?}",
        long.outcomes
    );
    rec.note(format!(
        "TPG disabled past fast_io_fail_tmo: I/O failed after {:.1} s with {:?}; reconnected",
        long.failed_after_submit.as_secs_f64(),
        long.outcomes
    ));
    // I/O resumes, and the data is what we know.
    s.resume_after_outage(&mut rng, shadows, |io| io, p);
}
