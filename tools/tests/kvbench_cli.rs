//! The kvbench command: listing, bad arguments and spec files (clear
//! errors, exit 2), what the Linux VM transports cannot do (refused before
//! a boot), a short run writing its CSV, JSON and plots, and Ctrl-C
//! (SIGINT) stopping a long run that still prints its table.

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use wait_timeout::ChildExt;

fn kvbench() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvbench"));
    c.arg("--no-progress");
    c
}

fn run(args: &[&str]) -> Output {
    kvbench().args(args).output().expect("kvbench runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvbench-cli-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn list_specs_shows_the_built_ins() {
    let out = run(&["--list-specs"]);
    assert!(out.status.success());
    let s = text(&out.stdout);
    for id in [
        "4k-random-read",
        "4k-random-70-30",
        "64k-seq-read",
        "1m-seq-write",
        "file-server",
    ] {
        assert!(s.contains(id), "{id} listed");
    }
    assert!(s.contains("[default suite]"));
}

#[test]
fn bad_arguments_are_refused_with_a_clear_message() {
    for (args, says) in [
        (&["--workers", "0"][..], "workers"),
        (&["--outstanding", "x"][..], "outstanding"),
        (&["--ramp", "soon"][..], "not a duration"),
        (&["--max-size", "12Q"][..], "unknown unit"),
        (&["--disks", "0,b"][..], "not a disk number"),
        (&["--transport", "carrier-pigeon"][..], "carrier-pigeon"),
        (
            &["--spec", "no-such-spec"][..],
            "unknown access specification",
        ),
    ] {
        let out = run(args);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            text(&out.stderr)
        );
        let err = text(&out.stderr);
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

#[test]
fn a_bad_spec_file_is_refused_naming_file_line_and_field() {
    let dir = scratch("badspec");
    let path = dir.join("specs.toml");
    std::fs::write(
        &path,
        "[[spec]]\nname = \"mine\"\nsize = \"4K\"\nread = 170\nrandom = 0\n",
    )
    .unwrap();
    let out = run(&["--transport", "ram", "--spec-file", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let err = text(&out.stderr);
    assert!(err.contains("specs.toml"), "{err}");
    assert!(err.contains("line 4"), "{err}");
    assert!(err.contains("spec[0].read"), "{err}");
    assert!(err.contains("170 is over 100 percent"), "{err}");
    let missing = run(&["--spec-file", dir.join("absent.json").to_str().unwrap()]);
    assert_eq!(missing.status.code(), Some(2));
    assert!(text(&missing.stderr).contains("cannot read spec file"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_linux_vm_transports_refuse_what_the_vm_cannot_be_before_booting_it() {
    // The old single value is gone; clap names the two that replace it.
    let out = run(&["--transport", "linux-vm"]);
    assert_eq!(out.status.code(), Some(2));
    let err = text(&out.stderr);
    assert!(
        err.contains("linux-vm-srp") && err.contains("linux-vm-iser"),
        "{err}"
    );
    // The VM runs one target.
    let out = run(&["--transport", "linux-vm-srp", "--targets", "2"]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("one target"), "{err}");
    assert!(!err.contains("booting"), "refused before booting: {err}");
    // iSER maps each buffer with one MR, in the VM as in process.
    let out = run(&["--transport", "linux-vm-iser", "--sg-shape", "odd"]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("one memory region"), "{err}");
    assert!(!err.contains("booting"), "refused before booting: {err}");
}

#[test]
fn iser_refuses_buffers_one_memory_region_cannot_map() {
    let out = run(&["--transport", "iser", "--sg-shape", "odd"]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("cannot build the iSER stack"), "{err}");
    assert!(err.contains("one memory region"), "{err}");
}

#[test]
fn a_short_run_prints_the_table_and_writes_csv_json_and_plots() {
    let dir = scratch("outputs");
    let spec_file = dir.join("mine.json");
    std::fs::write(
        &spec_file,
        r#"{"spec": [{"name": "my 8K mix", "part": [
            {"size": "8K", "weight": 3, "read": 50, "random": 100},
            {"size": "16K", "weight": 1, "read": 100, "random": 0}
        ]}]}"#,
    )
    .unwrap();
    // The CSV and JSON go into a directory that does not exist yet.
    let (csv, json, plots) = (
        dir.join("tables/r.csv"),
        dir.join("tables/r.json"),
        dir.join("plots"),
    );
    let out = run(&[
        "--transport",
        "ram",
        "--lun-size",
        "8M",
        "--luns",
        "2",
        "--workers",
        "2",
        "--spec",
        "4k-random-read",
        "--spec-file",
        spec_file.to_str().unwrap(),
        "--ramp",
        "100ms",
        "--run",
        "300ms",
        "--verify",
        "--csv",
        csv.to_str().unwrap(),
        "--json",
        json.to_str().unwrap(),
        "--plots",
        plots.to_str().unwrap(),
    ]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(stdout.contains("access specification"), "{stdout}");
    assert!(stdout.contains("4K random read"));
    assert!(stdout.contains("my 8K mix"));
    assert!(stdout.contains("all intact"));
    let csv = std::fs::read_to_string(&csv).unwrap();
    assert!(csv.starts_with("Target Type,Target Name,Access Specification Name"));
    assert_eq!(
        csv.lines().count(),
        1 + 2 * 3,
        "header + (ALL + 2 disks) per spec"
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["results"].as_array().unwrap().len(), 2);
    assert_eq!(v["verify"]["mismatches"], 0);
    let mut svgs: Vec<String> = std::fs::read_dir(&plots)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    svgs.sort();
    assert_eq!(
        svgs,
        [
            "01-4k-random-read-iops.svg",
            "01-4k-random-read-latency.svg",
            "02-my-8k-mix-iops.svg",
            "02-my-8k-mix-latency.svg"
        ]
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_default_transport_is_the_full_srp_stack() {
    let out = run(&[
        "--spec",
        "4k-random-read",
        "--ramp",
        "100ms",
        "--run",
        "300ms",
        "--lun-size",
        "16M",
    ]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("kvbench over srp: StorPort model -> miniport -> SRP engine"),
        "{stdout}"
    );
    assert!(
        stdout.contains("t0 lun0 (16 MiB, 512 B blocks)"),
        "{stdout}"
    );
    assert!(stdout.contains("4K random read"), "{stdout}");
    assert!(!stdout.contains("broke its contract"), "{stdout}");
}

#[test]
fn sigint_stops_a_long_run_which_still_reports() {
    let mut child = kvbench()
        .args([
            "--transport",
            "loopback",
            "--lun-size",
            "16M",
            "--spec",
            "4k-random-read,64k-seq-read",
            "--ramp",
            "200ms",
            "--run",
            "10m",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kvbench starts");
    // Let it get into the measured window.
    std::thread::sleep(Duration::from_millis(1500));
    let pid = libc::pid_t::try_from(child.id()).unwrap();
    // SAFETY: sending a signal to our own child process.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGINT) }, 0);
    let status = child
        .wait_timeout(Duration::from_secs(60))
        .unwrap()
        .unwrap_or_else(|| {
            let _ = child.kill();
            panic!("kvbench did not stop within 60 s of SIGINT");
        });
    let mut stdout = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut stdout)
        .unwrap();
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert_eq!(status.code(), Some(130), "{stdout}\n{stderr}");
    assert!(stderr.contains("interrupted"), "{stderr}");
    assert!(stdout.contains("4K random read"), "{stdout}");
    assert!(stdout.contains("(interrupted)"), "{stdout}");
    assert!(
        !stdout.contains("64K sequential read"),
        "the next spec never started: {stdout}"
    );
    assert!(!stdout.contains("broke its contract"), "{stdout}");
}
