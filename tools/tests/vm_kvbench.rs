//! kvbench against the Linux kernel's targets in the VM, as a user runs
//! it: `kvbench --transport linux-vm-srp` (ib_srpt) and `linux-vm-iser`
//! (LIO over ib_isert), each a short verified mixed run (4K random 70/30
//! read/write, 64K sequential read) writing JSON. Each must exit 0 (no
//! error, no lost I/O, no broken promise at teardown, which includes the
//! target letting go of the session after the logout), the JSON must say
//! the I/O went to the kernel's target and every byte read back intact,
//! and no qemu may outlive the run.
//!
//! Behind the `vm-tests` feature (CI step 64). It skips (loudly) only when
//! the VM cannot be prepared here, and never under CI.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use kverbs_tools::vm::WorkDir;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvbench-vm-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Whether process `pid` still exists (a zombie does not count).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next().map(str::to_owned))
        })
        .is_some_and(|state| state != "Z")
}

/// Runs kvbench over `transport` against instance `instance`; checks the
/// exit status and the JSON; returns the JSON.
fn run_against_the_vm(transport: &str, instance: &str, target: &str) -> serde_json::Value {
    let dir = scratch(transport);
    let json = dir.join("results.json");
    let t0 = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_kvbench"))
        .args([
            "--no-progress",
            "--transport",
            transport,
            "--vm-no-install",
            "--vm-instance",
            instance,
            "--spec",
            "4k-random-70-30,64k-seq-read",
            "--ramp",
            "200ms",
            "--run",
            "1500ms",
            "--outstanding",
            "4",
            "--max-size",
            "2M",
            "--verify",
            "--json",
        ])
        .arg(&json)
        .output()
        .expect("kvbench runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!(
        "[vm-kvbench] {transport}: exit {:?} after {:.1} s\n{stdout}{stderr}",
        out.status.code(),
        t0.elapsed().as_secs_f64()
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "kvbench --transport {transport} failed"
    );
    assert!(stdout.contains("all intact"), "{stdout}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert!(
        v["backend"].as_str().unwrap().contains(target),
        "{}",
        v["backend"]
    );
    assert_eq!(v["interrupted"], false);
    assert_eq!(v["targets"].as_array().unwrap().len(), 1, "one LUN");
    assert_eq!(v["targets"][0]["capacity"], 32 << 20);
    let results = v["results"].as_array().unwrap();
    assert_eq!(results.len(), 2);
    for r in results {
        assert!(r["ios"].as_u64().unwrap() > 0, "{}: no I/O", r["spec"]);
        assert_eq!(r["errors"], 0, "{}: {}", r["spec"], r["first_errors"]);
        assert_eq!(r["lost_ios"], 0, "{}", r["spec"]);
    }
    // The mix wrote and read; the sequential spec only read.
    assert!(results[0]["write_ios"].as_u64().unwrap() > 0);
    assert!(results[0]["read_ios"].as_u64().unwrap() > 0);
    assert_eq!(results[1]["write_ios"], 0);
    assert_eq!(v["verify"]["mismatches"], 0);
    assert!(v["verify"]["sectors_checked"].as_u64().unwrap() > 0);
    std::fs::remove_dir_all(&dir).unwrap();
    v
}

/// The qemu of `instance` is gone once kvbench has exited.
fn qemu_is_gone(instance: &str) {
    let pidfile: PathBuf = WorkDir::default().run(instance).pidfile;
    let pid = std::fs::read_to_string(Path::new(&pidfile))
        .unwrap_or_else(|e| panic!("{}: {e}", pidfile.display()));
    let pid: u32 = pid.trim().parse().unwrap();
    assert!(!alive(pid), "qemu {pid} of {instance} outlived kvbench");
}

#[test]
fn kvbench_runs_verified_against_linux_srpt_and_lio_iser() {
    if kverbs_tools::vm::prepared_or_skip("kvbench_runs_verified_against_linux_srpt_and_lio_iser")
        .is_none()
    {
        return;
    }
    let srp = run_against_the_vm("linux-vm-srp", "kvbench-srp", "ib_srpt");
    assert_eq!(srp["target_type"], "SRP (Linux ib_srpt)");
    qemu_is_gone("kvbench-srp");
    let iser = run_against_the_vm("linux-vm-iser", "kvbench-iser", "LIO");
    assert_eq!(iser["target_type"], "iSER (Linux LIO)");
    qemu_is_gone("kvbench-iser");
}
