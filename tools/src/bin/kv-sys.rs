//! `kv-sys`: the Windows driver binary, built and checked on Linux.
//!
//! ```text
//! cargo run -p kverbs-tools --bin kv-sys -- ci        # everything below, in order
//! cargo run -p kverbs-tools --bin kv-sys -- bindings [--check]
//! cargo run -p kverbs-tools --bin kv-sys -- allowlist [--check]
//! cargo run -p kverbs-tools --bin kv-sys -- build     # link, checksum, check, sign
//! cargo run -p kverbs-tools --bin kv-sys -- stamp [--srp-target N=STR] [--iser-target N=IQN@HOST:PORT]
//! cargo run -p kverbs-tools --bin kv-sys -- wine      # INF install + smoke run under Wine
//! ```

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use kverbs_tools::ntbuild::{self, Layout, allowlist, bindings, inf, pe, wine};
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Parser)]
#[command(about = "Build, sign, check and smoke-run the kvsrp.sys StorPort miniport")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Regenerate the mingw-w64 bindings (or check the committed ones).
    Bindings {
        #[arg(long)]
        check: bool,
    },
    /// Regenerate the ntoskrnl/HAL export allowlists (or check them).
    Allowlist {
        #[arg(long)]
        check: bool,
    },
    /// Build kvsrp.sys, write its checksum, check it and test-sign it.
    Build {
        /// Largest stack frame accepted, bytes.
        #[arg(long, default_value_t = pe::DEFAULT_MAX_FRAME)]
        max_frame: u32,
    },
    /// Check an existing image.
    Check {
        image: PathBuf,
        #[arg(long, default_value_t = pe::DEFAULT_MAX_FRAME)]
        max_frame: u32,
    },
    /// Stamp inf/kvsrp.inx into target/nt/package/kvsrp.inf.
    Stamp {
        #[command(flatten)]
        targets: Targets,
    },
    /// Install the stamped INF under Wine and run the smoke test.
    Wine,
    /// Everything, as CI runs it.
    Ci,
}

#[derive(clap::Args, Default)]
struct Targets {
    /// An SRP target: NAME=<ib_srp add_target string>.
    #[arg(long = "srp-target")]
    srp: Vec<String>,
    /// An iSER target: NAME=IQN@HOST:PORT.
    #[arg(long = "iser-target")]
    iser: Vec<String>,
}

/// The targets the CI smoke run stamps into the INF and reads back.
const CI_SRP: &str = "array1=id_ext=200100e08b000000,ioc_guid=0002c90200402bd4,dgid=fe800000000000000002c90200402bd5,pkey=ffff,service_id=0002c90200402bd4";
const CI_ISER: &str = "lio1=iqn.2003-01.org.linux-iscsi.target:sn.0123456789ab@192.0.2.10:3260";

fn stamp(l: &Layout, t: &Targets) -> Result<(PathBuf, Vec<inf::Target>)> {
    let mut targets = Vec::new();
    for s in &t.srp {
        targets.push(inf::parse_srp(s)?);
    }
    for s in &t.iser {
        targets.push(inf::parse_iser(s)?);
    }
    let inx = std::fs::read_to_string(l.root.join("inf/kvsrp.inx"))?;
    let version = format!("{},{}.0", chrono_free_date(), env!("CARGO_PKG_VERSION"));
    let text = inf::stamp(&inx, "amd64", &version, &targets)?;
    let out = l.package().join("kvsrp.inf");
    std::fs::create_dir_all(l.package())?;
    std::fs::write(&out, text)?;
    println!("stamped {}", out.display());
    Ok((out, targets))
}

/// Today's date as MM/DD/YYYY from the system clock (civil-from-days).
fn chrono_free_date() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let z = (secs / 86_400) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{month:02}/{day:02}/{year}")
}

fn build(l: &Layout, max_frame: u32) -> Result<PathBuf> {
    let sys = ntbuild::build_driver(l)?;
    ntbuild::check_image(l, &sys, max_frame)?;
    ntbuild::sign(l, &sys)?;
    ntbuild::check_image(l, &sys, max_frame).context("after signing")?;
    Ok(sys)
}

fn wine_run(l: &Layout) -> Result<()> {
    let targets = Targets {
        srp: vec![CI_SRP.into()],
        iser: vec![CI_ISER.into()],
    };
    let (inf_path, parsed) = stamp(l, &targets)?;
    let fake = ntbuild::cargo_build(l, "tools/fake-storport", "storport")?;
    let probe = ntbuild::cargo_build(l, "tools/nt-probe", "kvprobe")?;
    let t0 = Instant::now();
    let w = wine::Wine::fresh(l)?;
    println!("  wineboot: {:.1} s", t0.elapsed().as_secs_f64());
    let mut expect = Vec::new();
    for t in &parsed {
        match t {
            inf::Target::Srp { name, add_target } => {
                expect.push((name.as_str(), "Protocol", "srp"));
                expect.push((name.as_str(), "AddTarget", add_target.as_str()));
            }
            inf::Target::Iser { name, iqn, portal } => {
                expect.push((name.as_str(), "Protocol", "iser"));
                expect.push((name.as_str(), "TargetName", iqn.as_str()));
                expect.push((name.as_str(), "Portal", portal.as_str()));
            }
        }
    }
    let result = wine::install_and_check(&w, &inf_path, &expect)
        .and_then(|()| wine::smoke(&w, &fake))
        .and_then(|()| wine::probe(&w, &probe));
    w.stop();
    result
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()?;
    let l = Layout::new(&root);
    let include = Path::new(bindings::MINGW_INCLUDE);
    match cli.command {
        Cmd::Bindings { check } => {
            bindings::run(&root, include, check)?;
        }
        Cmd::Allowlist { check } => allowlist::run(&root, check)?,
        Cmd::Build { max_frame } => {
            build(&l, max_frame)?;
        }
        Cmd::Check { image, max_frame } => {
            ntbuild::check_image(&l, &image, max_frame)?;
        }
        Cmd::Stamp { targets } => {
            stamp(&l, &targets)?;
        }
        Cmd::Wine => wine_run(&l)?,
        Cmd::Ci => {
            let t0 = Instant::now();
            bindings::run(&root, include, true)?;
            println!("bindings: up to date");
            allowlist::run(&root, true)?;
            println!("allowlists: up to date");
            build(&l, pe::DEFAULT_MAX_FRAME)?;
            wine_run(&l)?;
            println!("kv-sys ci: passed in {:.0} s", t0.elapsed().as_secs_f64());
        }
    }
    Ok(())
}
