//! Interop through the whole initiator over iSER: the host StorPort model →
//! the miniport core → the iSER engine → kverbs → the software HCA on the
//! RoCEv2 link → `rdma_rxe` → LIO's iSCSI target over `ib_isert` in the
//! target VM. One VM boot (iSER portal only); the phases run in order,
//! each printing what it did:
//!
//! 1. iSER connect (RDMA/CM with the iSER CM header) and the full iSCSI
//!    login, from the node record built from the VM's `TargetInfo`; LIO
//!    must list our initiator among the TPG's sessions;
//! 2. INQUIRY (standard and VPD 0x80) and READ CAPACITY on both LUNs, with
//!    LIO's unit attentions answered as the class driver would;
//! 3. an idle session kept alive: the engine pings with NOP-Out every 2 s
//!    (`noop_out_interval`), LIO must answer each with a NOP-In within
//!    `noop_out_timeout` or the engine drops the connection; nothing may
//!    fail in 12 s of silence;
//! 4. data-verified reads and writes: every block of both LUNs written and
//!    read back with 1 MiB I/Os, then thousands of random I/Os of 512 B to
//!    1 MiB at queue depths 1, 4, 16 and 64 (`VM_ISER_IOS` scales them; the
//!    session allows 64: `cmds_max`/`queue_depth` 64 and LIO's CmdSN
//!    window `default_cmdsn_depth` 64), and the fileio LUN's backing file
//!    hashed in the VM against what we wrote;
//! 5. task management through the StorPort model's SRB functions: ABORT
//!    TASK of commands still queued at LIO (FUNCTION COMPLETE or TASK DOES
//!    NOT EXIST, each agreeing with its victim's own completion) and a
//!    LOGICAL UNIT RESET with I/O in flight;
//! 6. LIO drops the session (TPG disabled in configfs): the engine logs in
//!    afresh once it is enabled again, I/O submitted during a short outage
//!    is held and completes, and I/O past `replacement_timeout` fails fast
//!    with a truthful status;
//! 7. orderly logout (adapter stop: iSCSI Logout, then disconnect), after
//!    which LIO lists no session, and a teardown that checks every request
//!    completed exactly once;
//! 8. a new session (same ISID, a fresh login after the logout) with
//!    `InitialR2T=No` (LIO is booted offering it; the first session kept
//!    the initiator's `Yes`): writes carry immediate data and unsolicited
//!    Data-Out PDUs up to the first burst, the rest fetched by RDMA READ
//!    from the VA past them; everything read back and checked, logout;
//! 9. CHAP both ways against LIO's implementation (its TPG's demo-mode
//!    authentication): the right secrets log in and read back what was
//!    written; a wrong secret of ours (LIO refuses) and a wrong expected
//!    target secret (we refuse LIO's proof) each leave no session and the
//!    target failing I/O fast.
//!
//! The link's pcap is kept in the VM's run directory when the run fails
//! (its path printed). Behind the `vm-tests` feature; CI step 63. It skips
//! (loudly) only when the VM cannot be prepared here, and never under CI.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kverbs::irql::Passive;
use kverbs::platform::host::VerifierAllocator;
use kverbs_tests::interop::{
    Interop, InteropConfig, LinkWire, MIB, PcapGuard, Record, ShadowDisk, command_in_ua, exec,
    interop_platform, prepared_or_skip, spread, target_log, wait_until, workload,
};
use kverbs_tests::iser::INITIATOR_NAME;
use kverbs_tests::{Io, Op, env_count};
use kverbs_tools::vm::{Vm, VmConfig};
use md5::Digest as _;
use storport_srp::iser::IserTransport;
use storport_srp::miniport::transport::TargetState;
use storport_srp::storport::SrbStatus;
use storport_srp::storport::host::SgShape;

#[global_allocator]
static ALLOCATOR: VerifierAllocator = VerifierAllocator;

/// The node record's queue and recovery keys for every session: 64
/// commands outstanding, all of them on one LUN if need be (LIO's CmdSN
/// window, `default_cmdsn_depth`, is set to the same 64), and I/O failing
/// fast after 10 s without a session.
const QUEUE_KEYS: &str = "node.session.cmds_max = 64\nnode.session.queue_depth = 64\n\
                          node.session.timeo.replacement_timeout = 10";

/// LIO's CmdSN window per session (the TPG attribute `default_cmdsn_depth`
/// that dynamic node ACLs inherit): as deep as the queue.
const CMDSN_DEPTH: u32 = 64;

/// Fast-fail (`replacement_timeout`) in the node record, seconds.
const FAST_FAIL_SECS: u64 = 10;

/// The stack with the iSER engine.
type IserInterop = Interop<IserTransport<kverbs_tests::Hp>>;

#[test]
fn iser_through_the_miniport_against_linux_isert() {
    let Some(prepared) = prepared_or_skip("iser_through_the_miniport_against_linux_isert") else {
        return;
    };
    // Two 16 MiB LUNs (a RAM disk and a file), the iSER portal only.
    let lun = |backstore| kverbs_tools::vm::LunConfig {
        backstore,
        size_mib: 16,
        block_size: 512,
    };
    let mut config = VmConfig {
        instance: "iser-interop".to_owned(),
        luns: vec![
            lun(kverbs_tools::vm::Backstore::RdMcp),
            lun(kverbs_tools::vm::Backstore::Fileio),
        ],
        ..VmConfig::default()
    };
    config.srpt.enabled = false;
    // LIO offers InitialR2T=No (BOOL_OR: a session is "No" only when the
    // initiator asks for it too: phase 1 asks "Yes", phase 6 "No").
    config
        .iser
        .parameters
        .insert("InitialR2T".to_owned(), "No".to_owned());
    // The CmdSN window LIO grants each session, set explicitly (read back
    // below) so that depth 64 is the window, not an accident of a default.
    config
        .iser
        .attributes
        .insert("default_cmdsn_depth".to_owned(), CMDSN_DEPTH.to_string());
    // Rejected logins and isert's own messages reach the console log.
    config.machine.console_loglevel = 7;
    let t0 = Instant::now();
    let mut vm = Vm::boot(&config, &prepared).unwrap_or_else(|e| panic!("{e}"));
    let info = vm.info().clone();
    let mut rec = Record::new("iser-interop");
    rec.note(format!(
        "VM: kernel {} ({}), ready after {:.1} s",
        info.kernel_release, info.kernel_package, info.boot_secs
    ));
    let iser = info.iser.clone().expect("iSER enabled");
    let tpg = format!("/sys/kernel/config/target/iscsi/{}/tpgt_1", iser.target_iqn);
    let pcap = vm.paths().dir.join("iser-interop.pcap");
    let mut guard = PcapGuard::new(pcap.clone());
    let wire = Arc::new(LinkWire::new(vm.take_link().expect("the link socket")));

    let platform = interop_platform();
    let iconfig = InteropConfig {
        keys: format!(
            "{QUEUE_KEYS}\nnode.session.iscsi.InitialR2T = Yes\nnode.conn[0].timeo.noop_out_interval = 2"
        ),
        pcap: Some(pcap.clone()),
        ..InteropConfig::default()
    };
    let stack = platform.run_passive(|p| {
        let s = match IserInterop::start_iser(platform.clone(), &info, wire.clone(), &iconfig, p)
        {
            Ok(s) => s,
            Err(e) => panic!(
                "iSER login through the miniport: {}\nLIO:\n{}",
                e.0,
                target_log(&vm)
            ),
        };
        // ------------------------------------------------------------
        // 1. Connect and login.
        let st = s.stats(p);
        assert_eq!((st.logins, st.login_failures), (1, 0), "{st:?}");
        let neg = s.transport().negotiated(0, p);
        assert!(
            neg.is_some_and(|n| n.initial_r2t && n.immediate_data),
            "{neg:?}"
        );
        rec.note(format!(
            "login: live after {} connect attempt(s), remote invalidation {}, negotiated {neg:?}",
            st.connect_attempts, st.remote_invalidate
        ));
        let sessions = exec(&vm, &format!("cat {tpg}/dynamic_sessions"));
        assert!(
            sessions.contains(INITIATOR_NAME),
            "LIO lists no session of {INITIATOR_NAME}: {sessions:?}\n{}",
            target_log(&vm)
        );
        rec.note(format!("LIO sessions: {}", sessions.trim()));
        let depth = exec(&vm, &format!("cat {tpg}/attrib/default_cmdsn_depth"));
        assert_eq!(depth.trim(), CMDSN_DEPTH.to_string(), "LIO's CmdSN window");
        assert!(
            s.adapter.max_io >= 64 && s.adapter.max_io_per_lun >= 64,
            "the adapter cannot queue 64: {:?}",
            s.adapter
        );
        rec.note(format!(
            "queue: LIO default_cmdsn_depth {}, adapter max_io {} per LUN {}",
            depth.trim(),
            s.adapter.max_io,
            s.adapter.max_io_per_lun
        ));

        // ------------------------------------------------------------
        // 2. INQUIRY, VPD 0x80, READ CAPACITY.
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
            let serial = String::from_utf8_lossy(&vpd[4..])
                .trim_end_matches('\0')
                .trim()
                .to_owned();
            assert_eq!(serial, lun.unit_serial, "LUN {l}");
            let (o, cap, uas2) = command_in_ua(&s, l, |s, l, p| s.read_capacity(l, p), p);
            assert_eq!(
                o.status.base(),
                SrbStatus::SUCCESS,
                "READ CAPACITY LUN {l}: {o:?}"
            );
            let last = u64::from_be_bytes(cap[0..8].try_into().unwrap());
            let block = u32::from_be_bytes(cap[8..12].try_into().unwrap());
            assert_eq!(block, lun.block_size, "LUN {l}");
            assert_eq!((last + 1) * u64::from(block), lun.size_bytes, "LUN {l}");
            rec.note(format!(
                "LUN {l}: {vendor} {product}, serial {serial}, {} x {block} B, unit attentions {uas2:?}",
                last + 1,
            ));
            shadows.insert(l, ShadowDisk::new(block, last + 1));
        }

        // ------------------------------------------------------------
        // 3. Idle: our keepalive answered.
        let before = s.stats(p);
        let idle = Instant::now();
        while idle.elapsed() < Duration::from_secs(12) {
            s.tick(p);
            std::thread::sleep(Duration::from_millis(20));
        }
        let st = s.stats(p);
        assert_eq!(
            (st.transport_failures, st.logins),
            (before.transport_failures, before.logins),
            "{st:?}\n{}",
            target_log(&vm)
        );
        assert_eq!(s.state(), TargetState::Live, "{st:?}");
        // One ping per 2 s; each unanswered one would have failed the
        // connection (checked above).
        assert!(
            st.control_pdus >= before.control_pdus + 4,
            "no keepalive went out: {before:?} -> {st:?}"
        );
        rec.note(format!(
            "idle 12 s: {} NOP-Outs sent and answered, session live",
            st.control_pdus - before.control_pdus
        ));

        // ------------------------------------------------------------
        // 4. Data.
        data_phase(&s, &vm, &info, &mut shadows, &mut rec, p);

        // ------------------------------------------------------------
        // 5. Task management.
        tmf_phase(&s, &mut shadows, &mut rec, p);

        // ------------------------------------------------------------
        // 6. The target drops the session.
        reconnect_phase(&s, &vm, &tpg, &mut shadows, &mut rec, p);

        // ------------------------------------------------------------
        // 7. Orderly logout.
        let before = s.stats(p);
        let t = Instant::now();
        s.stop(p);
        let st = s.stats(p);
        assert_eq!(st.transport_failures, before.transport_failures, "{st:?}");
        rec.note(format!(
            "logout: adapter stopped in {:.2} s; engine {st:?}",
            t.elapsed().as_secs_f64()
        ));
        let gone = wait_until(Duration::from_secs(30), || {
            !exec(&vm, &format!("cat {tpg}/dynamic_sessions")).contains(INITIATOR_NAME)
        });
        assert!(
            gone,
            "LIO still lists our session after the logout\n{}",
            target_log(&vm)
        );
        let link = s.link_stats().expect("link stats");
        assert_eq!(link.rx_bad_icrc + link.rx_malformed, 0, "{link:?}");
        rec.note(format!("link: {link:?}"));
        (s, shadows)
    });
    let (stack, mut shadows) = stack;
    platform.run_passive(|p| stack.finish(p));

    // ----------------------------------------------------------------
    // 8. A new session with InitialR2T=No: unsolicited Data-Out.
    let pcap2 = vm.paths().dir.join("iser-interop-unsolicited.pcap");
    let mut guard2 = PcapGuard::new(pcap2.clone());
    let platform = interop_platform();
    let config2 = InteropConfig {
        keys: format!(
            "{QUEUE_KEYS}\nnode.session.iscsi.InitialR2T = No\nnode.session.iscsi.ImmediateData = Yes"
        ),
        pcap: Some(pcap2),
        ..iconfig.clone()
    };
    let stack = platform.run_passive(|p| {
        let s = match IserInterop::start_iser(platform.clone(), &info, wire.clone(), &config2, p) {
            Ok(s) => s,
            Err(e) => panic!(
                "second iSER login: {}\nLIO:\n{}",
                e.0,
                target_log(&vm)
            ),
        };
        let neg = s.transport().negotiated(0, p).expect("negotiated");
        assert!(!neg.initial_r2t && neg.immediate_data, "{neg:?}");
        let mut uas = Vec::new();
        for l in 0..2u8 {
            let (o, _, ua) = command_in_ua(&s, l, |s, l, p| s.read_capacity(l, p), p);
            assert_eq!(o.status.base(), SrbStatus::SUCCESS, "{o:?}");
            uas.extend(ua);
        }
        // What the first session wrote is still there (a sample of each
        // LUN, read through the new session).
        let mut rng = fastrand::Rng::with_seed(0x15e4_0005);
        let mut ios = Vec::new();
        for i in 0..64 {
            let lun = u8::try_from(i % 2).unwrap();
            let sh = &shadows[&lun];
            ios.extend(workload(&mut rng, 1, lun, 512, sh.blocks(), 512, 256 << 10, 1.0));
        }
        // Then writes of every size class around the burst limits (one
        // PDU of immediate data, several Data-Out PDUs, past the first
        // burst), then a random mix, all read back.
        for bytes in [512u32, 4096, 8192, 12288, 16384, 20480, 65536, MIB] {
            for lun in 0..2u8 {
                let mut data = vec![0u8; bytes as usize];
                rng.fill(&mut data);
                ios.push(Io {
                    target: 0,
                    lun,
                    op: Op::Write,
                    lba: u64::from(bytes / 512) * 7,
                    blocks: bytes / 512,
                    block_len: 512,
                    shape: SgShape::Pages,
                    data,
                });
            }
        }
        let n = env_count("VM_ISER_UNSOLICITED_IOS", 300);
        for i in 0..n {
            let lun = u8::try_from(i % 2).unwrap();
            let sh = &shadows[&lun];
            ios.extend(workload(&mut rng, 1, lun, 512, sh.blocks(), 512, 128 << 10, 0.4));
        }
        for io in &mut ios {
            if matches!(io.shape, SgShape::Odd { .. }) {
                io.shape = SgShape::Contiguous;
            }
        }
        let reads: Vec<Io> = ios
            .iter()
            .filter(|io| io.op == Op::Write)
            .map(|io| Io {
                op: Op::Read,
                data: Vec::new(),
                ..io.clone()
            })
            .collect();
        let before = s.stats(p);
        let t = Instant::now();
        let done = s.run_ios(&ios, 16, &mut shadows, Duration::from_secs(300), p);
        s.all_succeeded(&done, "InitialR2T=No", p);
        let done = s.run_ios(&reads, 16, &mut shadows, Duration::from_secs(300), p);
        s.all_succeeded(&done, "InitialR2T=No read back", p);
        let st = s.stats(p);
        assert_eq!((st.logins, st.transport_failures), (1, 0), "{st:?}");
        assert!(st.immediate_writes > before.immediate_writes, "{st:?}");
        assert!(st.data_out_pdus > before.data_out_pdus, "{st:?}");
        rec.note(format!(
            "InitialR2T=No session: unit attentions {uas:?}; {} I/Os + {} reads back at depth 16 in {:.1} s; \
             {} immediate writes, {} Data-Out PDUs",
            ios.len(),
            reads.len(),
            t.elapsed().as_secs_f64(),
            st.immediate_writes,
            st.data_out_pdus
        ));
        s.stop(p);
        s
    });
    platform.run_passive(|p| stack.finish(p));
    guard2.passed();

    // ----------------------------------------------------------------
    // 9. CHAP, both ways, against LIO's own implementation.
    chap_phase(&vm, &info, &tpg, &wire, &iconfig, &mut shadows, &mut rec);
    // The VM saw nothing wrong from us.
    let dmesg = exec(&vm, "dmesg");
    for bad in ["ICRC", "icrc", "rxe: bad", "BUG", "WARNING", "Unknown iSER"] {
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

/// The CHAP names and secrets LIO's TPG is given for phase 9 (its demo-mode
/// authentication context: `tpgt_1/auth`). LIO wants 12 to 16 bytes of
/// secret from an initiator's side of mutual CHAP.
const CHAP_USER: &str = "kverbs-host";
const CHAP_SECRET: &str = "initiator-secret-1";
const CHAP_TARGET_USER: &str = "lio-target";
const CHAP_TARGET_SECRET: &str = "target-secret-22";

/// Phase 9: LIO requires CHAP (`attrib/authentication 1`) and proves
/// itself back. A session with the right secrets both ways logs in and
/// reads what the first session wrote; one with a wrong secret of ours is
/// refused by LIO, and one that expects a different target secret refuses
/// LIO's proof. Either refusal leaves the target failing I/O fast, with
/// no session at LIO.
fn chap_phase(
    vm: &Vm,
    info: &kverbs_tools::vm::TargetInfo,
    tpg: &str,
    wire: &Arc<LinkWire>,
    base: &InteropConfig,
    shadows: &mut BTreeMap<u8, ShadowDisk>,
    rec: &mut Record,
) {
    for (name, value) in [
        ("auth/userid", CHAP_USER),
        ("auth/password", CHAP_SECRET),
        ("auth/userid_mutual", CHAP_TARGET_USER),
        ("auth/password_mutual", CHAP_TARGET_SECRET),
        ("attrib/authentication", "1"),
    ] {
        exec(vm, &format!("echo -n {value} > {tpg}/{name}"));
        let back = exec(vm, &format!("cat {tpg}/{name}"));
        assert_eq!(back.trim(), value, "LIO's {name}");
    }
    let keys = |secret: &str, target_secret: &str| {
        format!(
            "{QUEUE_KEYS}\nnode.session.auth.authmethod = CHAP\n\
             node.session.auth.username = {CHAP_USER}\nnode.session.auth.password = {secret}\n\
             node.session.auth.username_in = {CHAP_TARGET_USER}\n\
             node.session.auth.password_in = {target_secret}"
        )
    };

    // Right secrets both ways: a session, and the data is there.
    let platform = interop_platform();
    let config = InteropConfig {
        keys: keys(CHAP_SECRET, CHAP_TARGET_SECRET),
        pcap: None,
        ..base.clone()
    };
    let stack = platform.run_passive(|p| {
        let s = match IserInterop::start_iser(platform.clone(), info, wire.clone(), &config, p) {
            Ok(s) => s,
            Err(e) => panic!("mutual-CHAP login: {}\nLIO:\n{}", e.0, target_log(vm)),
        };
        let st = s.stats(p);
        assert_eq!((st.logins, st.login_failures), (1, 0), "{st:?}");
        let sessions = exec(vm, &format!("cat {tpg}/dynamic_sessions"));
        assert!(sessions.contains(INITIATOR_NAME), "{sessions:?}");
        let mut rng = fastrand::Rng::with_seed(0x15e4_0009);
        let mut ios = Vec::new();
        for i in 0..32 {
            let lun = u8::try_from(i % 2).unwrap();
            let sh = &shadows[&lun];
            ios.extend(workload(
                &mut rng,
                1,
                lun,
                512,
                sh.blocks(),
                512,
                64 << 10,
                1.0,
            ));
        }
        for io in &mut ios {
            if matches!(io.shape, SgShape::Odd { .. }) {
                io.shape = SgShape::Contiguous;
            }
        }
        for l in 0..2u8 {
            let _ = command_in_ua(&s, l, |s, l, p| s.read_capacity(l, p), p);
        }
        let done = s.run_ios(&ios, 8, shadows, Duration::from_secs(120), p);
        s.all_succeeded(&done, "mutual-CHAP session reads", p);
        rec.note(format!(
            "CHAP: LIO checked our CHAP and proved itself back; {} reads verified",
            ios.len()
        ));
        s.stop(p);
        s
    });
    platform.run_passive(|p| stack.finish(p));
    let gone = wait_until(Duration::from_secs(30), || {
        !exec(vm, &format!("cat {tpg}/dynamic_sessions")).contains(INITIATOR_NAME)
    });
    assert!(gone, "LIO still lists the CHAP session\n{}", target_log(vm));

    // A wrong secret on either side: no session, I/O fails fast.
    for (what, secret, target_secret) in [
        (
            "LIO refuses our response",
            "initiator-wrong-1",
            CHAP_TARGET_SECRET,
        ),
        ("we refuse LIO's proof", CHAP_SECRET, "target-wrong-222"),
    ] {
        let platform = interop_platform();
        let config = InteropConfig {
            keys: keys(secret, target_secret),
            pcap: None,
            wait_live: false,
            ..base.clone()
        };
        let stack = platform.run_passive(|p| {
            let s = match IserInterop::start_iser(platform.clone(), info, wire.clone(), &config, p)
            {
                Ok(s) => s,
                Err(e) => panic!("{what}: setup: {}", e.0),
            };
            let failed = s.wait_state(TargetState::FailFast, Duration::from_secs(60));
            let st = s.stats(p);
            assert!(
                failed,
                "{what}: {:?}, {st:?}\nLIO:\n{}",
                s.state(),
                target_log(vm)
            );
            assert_eq!(st.logins, 0, "{what}: {st:?}");
            assert!(st.login_failures >= 1, "{what}: {st:?}");
            // LIO answers a failed CHAP with "authentication failure"
            // and drops the connection at once; over iSER the drop can
            // flush its answer. So: our login failure (11, after which the
            // target fails fast at once) or LIO's disconnect (3, retried
            // until `replacement_timeout` makes it fail fast). Our refusal
            // of LIO's proof is always ours.
            let want: &[u32] = if target_secret == CHAP_TARGET_SECRET {
                &[11, 3]
            } else {
                &[11]
            };
            assert!(
                want.contains(&st.last_failure),
                "{what}: why the attempts ended: {st:?}\nLIO:\n{}",
                target_log(vm)
            );
            let (o, _) = s.read_capacity(0, p);
            assert_ne!(o.status.base(), SrbStatus::SUCCESS, "{what}: {o:?}");
            assert_eq!(o.completions, 1, "{what}: {o:?}");
            rec.note(format!(
                "CHAP: {what}: {} attempt(s) failed (last: {}), target failing fast, READ CAPACITY {:?}",
                st.login_failures,
                st.last_failure,
                o.status.base()
            ));
            s.stop(p);
            s
        });
        platform.run_passive(|p| stack.finish(p));
        let sessions = exec(vm, &format!("cat {tpg}/dynamic_sessions"));
        assert!(!sessions.contains(INITIATOR_NAME), "{what}: {sessions:?}");
        if target_secret == CHAP_TARGET_SECRET {
            let said = exec(
                vm,
                "dmesg | grep -i -E 'chap|authenticat|security' | tail -2 || true",
            );
            rec.note(format!("CHAP: {what}: LIO logged {:?}", said.trim()));
        }
    }
}

/// Every block of every LUN written (1 MiB writes) and read back, then
/// random I/O over sizes and depths, then the fileio backing file hashed in
/// the VM against the shadow.
fn data_phase(
    s: &IserInterop,
    vm: &Vm,
    info: &kverbs_tools::vm::TargetInfo,
    shadows: &mut BTreeMap<u8, ShadowDisk>,
    rec: &mut Record,
    p: &Passive<'_>,
) {
    let mut rng = fastrand::Rng::with_seed(0x15e4_0001);
    // First light: one of each size class alone, so a failure names the
    // smallest case.
    for (lun, sh) in shadows.iter_mut() {
        for bytes in [512u32, 4096, 65536, MIB] {
            let blocks = bytes / sh.block_len();
            let mut data = vec![0u8; bytes as usize];
            rng.fill(&mut data);
            let write = Io {
                target: 0,
                lun: *lun,
                op: Op::Write,
                lba: 0,
                blocks,
                block_len: sh.block_len(),
                shape: SgShape::Contiguous,
                data,
            };
            let read = Io {
                op: Op::Read,
                data: Vec::new(),
                ..write.clone()
            };
            let mut one = BTreeMap::from([(*lun, sh.clone())]);
            let done = s.run_ios(&[write], 1, &mut one, Duration::from_secs(60), p);
            s.all_succeeded(&done, &format!("LUN {lun}: first write of {bytes} B"), p);
            let done = s.run_ios(&[read], 1, &mut one, Duration::from_secs(60), p);
            s.all_succeeded(&done, &format!("LUN {lun}: first read of {bytes} B"), p);
            if let Some(updated) = one.remove(lun) {
                *sh = updated;
            }
        }
    }
    rec.note("first light: 512 B, 4 KiB, 64 KiB, 1 MiB written and read back on each LUN".into());

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
                shape: SgShape::Pages,
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
        "fill + read back: {} I/Os of 1 MiB at depth 8, {:.0} MiB in {secs:.1} s ({:.1} MiB/s)",
        fill.len() + read_all.len(),
        2.0 * bytes as f64 / f64::from(MIB),
        2.0 * bytes as f64 / f64::from(MIB) / secs
    ));

    // Random I/O: log-uniform 512 B..1 MiB at each depth. iSER has one
    // STag per direction, so only buffers one MR maps (contiguous or
    // per page) are used; `Odd` shapes would be refused as unsupported.
    let total = env_count("VM_ISER_IOS", 1200);
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
        for io in &mut ios {
            if matches!(io.shape, SgShape::Odd { .. }) {
                io.shape = SgShape::Pages;
            }
        }
        // An I/O overlapping one in flight waits for it, and the run with
        // it: random placement alone keeps "depth 64" near 17 on average.
        // Placed apart from the `depth` before it, the queue stays full.
        spread(&mut rng, &mut ios, depth, shadows);
        let t = Instant::now();
        let (done, queue) = s.run_ios_measured(&ios, depth, shadows, Duration::from_secs(240), p);
        s.all_succeeded(&done, &format!("depth {depth}"), p);
        // The queue really was that deep at least once (the engine took
        // every command: nothing overlapping held the run below it).
        assert_eq!(queue.peak, depth, "depth {depth}: {queue:?}");
        let secs = t.elapsed().as_secs_f64();
        let bytes: u64 = ios
            .iter()
            .map(|io| u64::from(io.blocks * io.block_len))
            .sum();
        let sizes = ios.iter().map(|io| io.blocks * io.block_len);
        let (small, large) = (sizes.clone().min().unwrap_or(0), sizes.max().unwrap_or(0));
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
    assert_eq!(st.unmappable, 0, "{st:?}");
    // InitialR2T=Yes: only immediate data is unsolicited.
    assert_eq!(st.data_out_pdus, 0, "{st:?}");
    assert!(st.immediate_writes > 0, "{st:?}");
    rec.note(format!(
        "engine: {} completed, {} immediate writes, {} Data-Out PDUs, {} remote / {} local invalidations, busy {}, \
         {} responses ahead of an older StatSN",
        st.completed,
        st.immediate_writes,
        st.data_out_pdus,
        st.remote_invalidations,
        st.local_invalidations,
        st.busy,
        st.statuses_out_of_order
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

/// ABORT TASK of commands still queued at LIO, and a LOGICAL UNIT RESET
/// with I/O in flight, through the StorPort model's SRB functions.
///
/// LIO answers an ABORT TASK FUNCTION COMPLETE when it found the command
/// (and then sends no response for it), or TASK DOES NOT EXIST when the
/// command had already finished (its SCSI Response went out first). The
/// core reports the first as SUCCESS with the victim ABORTED, the second
/// as ABORT_FAILED with the victim's own outcome; each must agree, and
/// every request must complete exactly once. A TMF that timed out
/// reinstates the session (a transport failure), which may reset a
/// too-late abort's victim; neither TMF may cost the session otherwise.
fn tmf_phase(
    s: &IserInterop,
    shadows: &mut BTreeMap<u8, ShadowDisk>,
    rec: &mut Record,
    p: &Passive<'_>,
) {
    let mut rng = fastrand::Rng::with_seed(0x15e4_0002);
    let before = s.stats(p);
    let tally = s.abort_queued_tasks(
        &mut rng,
        shadows,
        |st| st.transport_failures > before.transport_failures,
        rec,
        p,
    );
    let st = s.stats(p);
    assert_eq!(
        st.transport_failures, before.transport_failures,
        "an abort cost the session: {st:?}"
    );
    rec.note(format!(
        "ABORT TASK: {} FUNCTION COMPLETE {:?} (victims ABORTED), \
         {} ABORT_FAILED, i.e. TASK DOES NOT EXIST {:?} (victims SUCCESS); TMFs {}",
        tally.aborted,
        tally.aborted_ops,
        tally.too_late,
        tally.late_ops,
        st.tmfs - before.tmfs
    ));

    // LUN RESET with 24 MiB in flight on LUN 0: reported after every
    // command of the LUN completed, each truthfully; then LIO's unit
    // attention for the reset (or none), and the LUN works.
    let (n, by_status, uas) = s.lun_reset_during_io(&mut rng, shadows, p);
    let st = s.stats(p);
    assert_eq!(
        st.transport_failures, before.transport_failures,
        "the LUN reset cost the session: {st:?}"
    );
    rec.note(format!(
        "LUN RESET during {n} I/Os of 1 MiB: SUCCESS; I/O outcomes {by_status:?}; then unit attentions {uas:?}"
    ));
    // ... and holds what we know.
    s.verify_all(shadows, p);
    rec.note("after the TMFs: both LUNs read whole and checked against the shadow".into());
}

/// LIO drops the session: the TPG is disabled in configfs (LIO releases
/// its sessions, isert disconnects, and logins are refused with "service
/// unavailable" until it is enabled again).
fn reconnect_phase(
    s: &IserInterop,
    vm: &Vm,
    tpg: &str,
    shadows: &mut BTreeMap<u8, ShadowDisk>,
    rec: &mut Record,
    p: &Passive<'_>,
) {
    let mut rng = fastrand::Rng::with_seed(0x15e4_0004);
    // (a) A short outage with I/O in flight and I/O submitted during it:
    // held, then completed after the reconnect (a fresh login).
    let short = s.short_outage(&mut rng, shadows, vm, tpg, p);
    let why = short.at_loss.last_failure;
    let refused = short.before_enable.login_failures - short.before.login_failures;
    assert_eq!(
        short.held, short.submitted_during,
        "I/O submitted during a short outage is held, not failed: {:?}",
        short.during
    );
    let sessions = exec(vm, &format!("cat {tpg}/dynamic_sessions"));
    assert!(
        sessions.contains(INITIATOR_NAME),
        "LIO lists no session after the reconnect: {sessions:?}"
    );
    // Why LIO refused the logins while disabled (a disabled TPG is not
    // found: a target-error login response, which the engine retries).
    let no_tpg: u64 = exec(
        vm,
        "dmesg | grep -c 'Unable to locate Target Portal Group' || true",
    )
    .trim()
    .parse()
    .unwrap_or(0);
    assert!(
        refused == 0 || no_tpg > 0,
        "{refused} logins refused, but not for the disabled TPG:\n{}",
        target_log(vm)
    );
    rec.note(format!(
        "TPG disabled: session lost after {:.2} s (why {}); {} of {} I/Os submitted during the \
         outage held; {refused} login(s) refused while disabled (LIO: TPG not found \
         {no_tpg}x); logged in again {:.2} s after \
         re-enable; in flight {:?}, during {:?}",
        short.lost_after.as_secs_f64(),
        why,
        short.held,
        short.submitted_during,
        short.back_after.as_secs_f64(),
        short.in_flight,
        short.during,
    ));

    // (b) An outage past fast-fail (`replacement_timeout`): held I/O fails
    // fast, truthfully, and not before its time.
    let long = s.outage_past_fast_fail(&mut rng, shadows, vm, tpg, p);
    let (b, failed_after) = (&long.outcomes, long.failed_after_drop);
    // No target to select: what the core reports once recovery gave the
    // path up for now (multipath's cue), every one of them.
    assert_eq!(
        b.get(&SrbStatus::SELECTION_TIMEOUT).copied(),
        Some(long.submitted),
        "I/O past fast-fail while the target is gone: {b:?}"
    );
    assert!(
        failed_after >= Duration::from_secs(FAST_FAIL_SECS - 1),
        "I/O failed {failed_after:?} after the drop, before fast-fail ({FAST_FAIL_SECS} s): {b:?}"
    );
    rec.note(format!(
        "TPG disabled past replacement_timeout ({FAST_FAIL_SECS} s): target {:?}, I/O failed \
         {:.1} s after the drop with {b:?}; reconnected after re-enable",
        long.state_when_failed,
        failed_after.as_secs_f64()
    ));
    // I/O resumes (no `Odd` buffers: the engine refuses them), and the data is
    // what we know.
    let n = s.resume_after_outage(
        &mut rng,
        shadows,
        |mut io| {
            if matches!(io.shape, SgShape::Odd { .. }) {
                io.shape = SgShape::Pages;
            }
            io
        },
        p,
    );
    let st = s.stats(p);
    rec.note(format!(
        "after the outages: both LUNs checked whole, {n} random I/Os verified; engine logins {}, \
         transport failures {}, login failures {}",
        st.logins, st.transport_failures, st.login_failures
    ));
}
