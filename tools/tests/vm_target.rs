//! The Linux target VM, for real: prepare (install packages if needed and
//! allowed), boot under TCG, check the targets over the control channel,
//! prove the frame path with ARP, check error reporting, tear down, and make
//! sure no qemu is left behind.
//!
//! Skips only when the host packages cannot be installed (not root, no apt),
//! with a loud message, and never under CI (`CI` set), where it must run.

use std::net::Ipv4Addr;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kverbs_tools::vm::ethernet::ArpPacket;
use kverbs_tools::vm::{
    Backstore, LunConfig, PrepareOptions, Vm, VmConfig, VmError, prepare, prepared_or_skip,
};

/// The VMs of this file boot one after another: two TCG guests at once on a
/// two-core machine only make both slow.
static ONE_VM_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Pids of live processes whose command line mentions `run_dir` (our qemu).
fn qemu_processes_for(run_dir: &Path) -> Vec<u32> {
    let needle = run_dir.as_os_str().as_encoded_bytes();
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        if cmdline.windows(needle.len()).any(|w| w == needle) {
            pids.push(pid);
        }
    }
    pids
}

fn test_config(instance: &str) -> VmConfig {
    let mut config = VmConfig {
        instance: instance.to_owned(),
        ..VmConfig::default()
    };
    config.machine.ready_timeout_secs = 240;
    config
}

fn exec_ok(vm: &Vm, command: &str) -> String {
    match vm.exec_ok(command) {
        Ok(out) => out,
        Err(e) => panic!("{e}\nconsole log: {}", vm.paths().console_log.display()),
    }
}

#[test]
fn vm_serves_srpt_and_iser_over_rxe_and_answers_arp() {
    let Some(prepared) = prepared_or_skip("vm_serves_srpt_and_iser_over_rxe_and_answers_arp")
    else {
        return;
    };
    let _one = ONE_VM_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());

    let mut config = test_config("test-target");
    config.luns = vec![
        LunConfig {
            backstore: Backstore::RdMcp,
            size_mib: 16,
            block_size: 512,
        },
        LunConfig {
            backstore: Backstore::Fileio,
            size_mib: 24,
            block_size: 4096,
        },
    ];
    config.srpt.rdma_cm_port = 5556;
    config.srpt.srp_max_req_size = Some(4200);
    config.srpt.srpt_srq_size = Some(512);
    config
        .srpt
        .attributes
        .insert("srp_sq_size".into(), "2048".into());
    config.iser.portal_port = 3261;
    config
        .iser
        .parameters
        .insert("MaxRecvDataSegmentLength".into(), "65536".into());

    let started = Instant::now();
    let mut vm = Vm::boot(&config, &prepared).unwrap_or_else(|e| panic!("{e}"));
    eprintln!(
        "VM ready after {:.1} s (guest says {:.1} s)",
        started.elapsed().as_secs_f64(),
        vm.info().boot_secs
    );
    let run_dir = vm.paths().dir.clone();
    let pid = vm.pid();
    assert_eq!(qemu_processes_for(&run_dir), vec![pid]);

    // What the guest reported fits the configuration.
    let info = vm.info().clone();
    assert_eq!(
        info.node_guid, "5054:00ff:fe12:3456",
        "node GUID is the EUI-64 of the MAC"
    );
    assert_eq!(info.gid0, "fe80:0000:0000:0000:5054:00ff:fe12:3456");
    let srpt = info.srpt.as_ref().unwrap();
    assert_eq!(srpt.wwn, "5054:00ff:fe12:3456");
    assert_eq!(srpt.service_id, 0x0106_0000 | 5556);
    assert_eq!(srpt.srp_max_req_size, 4200);
    assert_eq!(info.iser.as_ref().unwrap().service_id, 0x0106_0000 | 3261);

    // Soft-RoCE is up on eth0, and the IPv4 GID sits where the guest said.
    let link = exec_ok(&vm, "rdma link show rxe0/1");
    assert!(
        link.contains("state ACTIVE") && link.contains("netdev eth0"),
        "rdma link: {link}"
    );
    let gid = exec_ok(
        &vm,
        &format!(
            "cat /sys/class/infiniband/rxe0/ports/1/gids/{}",
            info.ipv4_gid_index
        ),
    );
    assert_eq!(gid.trim(), "0000:0000:0000:0000:0000:ffff:0a00:0002");

    // The SRP target: enabled, RDMA/CM port, both LUNs, the 6.1 ACL, module parameters.
    let w = format!("/sys/kernel/config/target/srpt/{}/tpgt_1", srpt.wwn);
    assert_eq!(exec_ok(&vm, &format!("cat {w}/enable")).trim(), "1");
    assert_eq!(
        exec_ok(
            &vm,
            "cat /sys/kernel/config/target/srpt/discovery_auth/rdma_cm_port"
        )
        .trim(),
        "5556"
    );
    assert_eq!(
        exec_ok(&vm, &format!("ls {w}/lun"))
            .split_whitespace()
            .collect::<Vec<_>>(),
        ["lun_0", "lun_1"]
    );
    assert_eq!(
        exec_ok(&vm, &format!("ls -d {w}/acls/10.0.0.2/lun_*"))
            .split_whitespace()
            .count(),
        2,
        "ACL 10.0.0.2 maps both LUNs"
    );
    assert_eq!(
        exec_ok(&vm, &format!("cat {w}/attrib/srp_sq_size")).trim(),
        "2048"
    );
    assert_eq!(
        exec_ok(&vm, "cat /sys/module/ib_srpt/parameters/srp_max_req_size").trim(),
        "4200"
    );
    assert_eq!(
        exec_ok(&vm, "cat /sys/module/ib_srpt/parameters/srpt_srq_size").trim(),
        "512"
    );

    // The iSCSI target with its iSER portal, in demo mode, with both LUNs.
    let i = "/sys/kernel/config/target/iscsi/iqn.2003-01.org.linux-iscsi.kverbs:target/tpgt_1";
    assert_eq!(exec_ok(&vm, &format!("cat {i}/enable")).trim(), "1");
    assert_eq!(
        exec_ok(&vm, &format!("cat {i}/np/10.0.0.2:3261/iser")).trim(),
        "1"
    );
    assert_eq!(
        exec_ok(&vm, &format!("ls {i}/lun"))
            .split_whitespace()
            .collect::<Vec<_>>(),
        ["lun_0", "lun_1"]
    );
    assert_eq!(
        exec_ok(&vm, &format!("cat {i}/attrib/generate_node_acls")).trim(),
        "1"
    );
    assert_eq!(
        exec_ok(&vm, &format!("cat {i}/param/MaxRecvDataSegmentLength")).trim(),
        "65536"
    );

    // The backstores: sizes, block sizes, serials.
    let core = "/sys/kernel/config/target/core";
    let ram = exec_ok(&vm, &format!("cat {core}/rd_mcp_0/ram0/info"));
    assert!(
        ram.contains("PAGES/PAGE_SIZE: 4096*4096"),
        "rd_mcp info: {ram}"
    );
    let file = exec_ok(&vm, &format!("cat {core}/fileio_1/file1/info"));
    assert!(
        file.contains(&format!("Size: {}", 24u64 << 20)),
        "fileio info: {file}"
    );
    assert_eq!(
        exec_ok(&vm, &format!("cat {core}/fileio_1/file1/attrib/block_size")).trim(),
        "4096"
    );
    assert!(
        exec_ok(
            &vm,
            &format!("cat {core}/rd_mcp_0/ram0/wwn/vpd_unit_serial")
        )
        .contains("kvvm-lun0")
    );

    // The control channel itself: status, stderr, binary-safe output, and a
    // command that outlives its limit.
    let out = vm.exec("printf 'a\\000b'; echo oops >&2; exit 7").unwrap();
    assert_eq!(
        (
            out.status,
            out.stdout.as_slice(),
            out.stderr_text().as_str()
        ),
        (7, &b"a\0b"[..], "oops\n")
    );
    let t0 = Instant::now();
    let out = vm.exec_timeout("sleep 30", Duration::from_secs(2)).unwrap();
    assert_eq!(out.status, 137, "killed by the guest-side limit");
    assert!(t0.elapsed() < Duration::from_secs(20));
    assert_eq!(exec_ok(&vm, "echo still-here").trim(), "still-here");

    // The frame path both ways: the VM answers our ARP request for its IP.
    let socket = vm.take_link().expect("the host end of the link");
    socket
        .set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let request = ArpPacket::request(
        config.network.host_mac,
        config.network.host_ip,
        config.network.vm_ip,
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut buf = [0u8; 2048];
    let mut others = 0usize;
    let reply = 'outer: loop {
        assert!(
            Instant::now() < deadline,
            "no ARP reply within 20 s ({others} other frames seen)"
        );
        socket.send(&request.to_frame()).unwrap();
        let resend_at = Instant::now() + Duration::from_secs(1);
        while Instant::now() < resend_at {
            match socket.recv(&mut buf) {
                Ok(n) => match ArpPacket::parse(&buf[..n]) {
                    Ok(arp) if arp.is_reply_to(&request) => break 'outer arp,
                    _ => others += 1,
                },
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(e) => panic!("receiving from the link: {e}"),
            }
        }
    };
    assert_eq!(reply.sender_mac, config.network.vm_mac);
    assert_eq!(reply.sender_ip, Ipv4Addr::new(10, 0, 0, 2));
    // And the guest learnt our MAC from the request.
    let neigh = exec_ok(&vm, "ip neigh show 10.0.0.1");
    assert!(
        neigh.contains("52:54:00:12:34:01"),
        "guest neighbour table: {neigh}"
    );

    // Teardown leaves nothing running.
    let log = vm.paths().console_log.clone();
    vm.shutdown();
    assert!(
        qemu_processes_for(&run_dir).is_empty(),
        "qemu {pid} survived shutdown"
    );
    assert!(
        std::fs::read_to_string(&log)
            .unwrap()
            .contains("KVVM-READY"),
        "console log kept"
    );
}

#[test]
fn vm_reports_the_failing_configfs_step() {
    let Some(prepared) = prepared_or_skip("vm_reports_the_failing_configfs_step") else {
        return;
    };
    let _one = ONE_VM_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());

    // A portal on an address the VM does not own: the TCP portal is created
    // (LIO binds it freely), but isert cannot bind RDMA/CM to it.
    let mut config = test_config("test-fail");
    config.iser.portal_ip = Some(Ipv4Addr::new(10, 0, 0, 9));
    let run_dir = prepared.workdir.run(&config.instance).dir;
    match Vm::boot(&config, &prepared) {
        Err(VmError::SetupFailed {
            step, detail, log, ..
        }) => {
            assert_eq!(
                step, "iscsi: enable iSER on portal 10.0.0.9:3260",
                "detail:\n{detail}"
            );
            assert!(detail.contains("exit status 1"), "{detail}");
            assert!(
                detail.contains("rdma_bind_addr() failed"),
                "kernel log tail in the detail:\n{detail}"
            );
            let log = std::fs::read_to_string(log).unwrap();
            assert!(log.contains("KVVM-FAIL step=iscsi: enable iSER on portal 10.0.0.9:3260"));
        }
        Err(e) => panic!("expected a setup failure, got: {e}"),
        Ok(vm) => panic!("a portal on a foreign IP was accepted: {:?}", vm.info()),
    }
    assert!(
        qemu_processes_for(&run_dir).is_empty(),
        "qemu survived a failed setup"
    );
}

#[test]
fn vm_boot_timeout_kills_qemu_and_quotes_the_log() {
    let Some(prepared) = prepared_or_skip("vm_boot_timeout_kills_qemu_and_quotes_the_log") else {
        return;
    };
    let _one = ONE_VM_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());

    let mut config = test_config("test-timeout");
    config.machine.ready_timeout_secs = 3;
    let run_dir = prepared.workdir.run(&config.instance).dir;
    match Vm::boot(&config, &prepared) {
        Err(e @ VmError::BootTimeout { .. }) => {
            let text = e.to_string();
            assert!(text.contains("not ready within 3 s"), "{text}");
            assert!(text.contains("console.log"), "{text}");
        }
        Err(e) => panic!("expected a boot timeout, got: {e}"),
        Ok(_) => panic!("booted in under 3 s under TCG?"),
    }
    assert!(
        qemu_processes_for(&run_dir).is_empty(),
        "qemu survived a boot timeout"
    );
}

#[test]
fn prepare_reuses_its_cache() {
    let Some(first) = prepared_or_skip("prepare_reuses_its_cache") else {
        return;
    };
    let mtime = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).unwrap();
    let (kernel_before, initramfs_before) = (mtime(&first.vmlinuz), mtime(&first.base_initramfs));
    let options = PrepareOptions {
        install: false,
        ..PrepareOptions::default()
    };
    let second = prepare(&first.workdir, &options).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(second, first);
    assert_eq!(
        mtime(&second.vmlinuz),
        kernel_before,
        "kernel unpacked again"
    );
    assert_eq!(
        mtime(&second.base_initramfs),
        initramfs_before,
        "initramfs rebuilt"
    );
    assert!(second.modules.iter().any(|m| m == "ib_srpt"));
    assert!(
        second.modules.iter().any(|m| m == "crc32_generic"),
        "rdma_rxe's hidden need"
    );
    let pos = |name: &str| second.modules.iter().position(|m| m == name).unwrap();
    assert!(pos("ib_core") < pos("rdma_rxe") && pos("target_core_mod") < pos("ib_srpt"));
    assert!(
        pos("iscsi_target_mod") < pos("ib_isert"),
        "dependencies load first"
    );
}
