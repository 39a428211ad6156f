//! `kv-sys`: builds, links, signs and checks the StorPort miniport `.sys` on
//! Linux, stamps its INF, and runs it under Wine against a test-double
//! `storport.sys`.
//!
//! Outputs go to `target/nt/`: `importlibs/` (from the allowlists),
//! `x86_64-pc-windows-msvc/release/` (cargo), and `package/` (the signed
//! `kvsrp.sys`, the stamped `kvsrp.inf`, the test certificate).

pub mod allowlist;
pub mod bindings;
pub mod inf;
pub mod pe;
pub mod wine;

use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The kernel target.
pub const TARGET: &str = "x86_64-pc-windows-msvc";

/// Paths of one build.
#[derive(Debug, Clone)]
pub struct Layout {
    /// Workspace root.
    pub root: PathBuf,
    /// `target/nt`.
    pub out: PathBuf,
}

impl Layout {
    /// The layout under `root`.
    #[must_use]
    pub fn new(root: &Path) -> Self {
        Self {
            root: root.to_path_buf(),
            out: root.join("target").join("nt"),
        }
    }

    /// `target/nt/package`.
    #[must_use]
    pub fn package(&self) -> PathBuf {
        self.out.join("package")
    }
}

/// Builds one of the excluded kernel crates (`storport-srp/driver` or
/// `tools/fake-storport`) for the kernel target and returns its `.dll`.
///
/// # Errors
/// cargo or the linker failed.
pub fn cargo_build(l: &Layout, crate_dir: &str, artifact: &str) -> Result<PathBuf> {
    let libs = allowlist::make_import_libs(&l.root, &l.out.join("importlibs"))?;
    let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .current_dir(l.root.join(crate_dir))
        .args(["build", "--release", "--target", TARGET])
        .env("CARGO_TARGET_DIR", &l.out)
        .env("KVSRP_IMPORT_LIBS", &libs)
        .env("CARGO_TARGET_X86_64_PC_WINDOWS_MSVC_LINKER", "lld-link")
        .status()
        .context("running cargo")?;
    if !status.success() {
        bail!("building {crate_dir} failed");
    }
    Ok(l.out
        .join(TARGET)
        .join("release")
        .join(format!("{artifact}.dll")))
}

/// Builds the driver, renames it `.sys` and writes its PE checksum.
///
/// # Errors
/// The build failed.
pub fn build_driver(l: &Layout) -> Result<PathBuf> {
    let dll = cargo_build(l, "storport-srp/driver", "kvsrp")?;
    let pkg = l.package();
    std::fs::create_dir_all(&pkg)?;
    let sys = pkg.join("kvsrp.sys");
    let mut image = std::fs::read(&dll)?;
    pe::fix_checksum(&mut image)?;
    std::fs::write(&sys, image)?;
    let map = dll
        .parent()
        .map(|p| p.join("deps").join("kvsrp.map"))
        .unwrap_or_default();
    if map.is_file() {
        std::fs::copy(&map, pkg.join("kvsrp.map"))?;
    }
    Ok(sys)
}

/// Checks an image and prints the report; fails on any problem.
///
/// # Errors
/// The image has a problem.
pub fn check_image(l: &Layout, sys: &Path, max_frame: u32) -> Result<pe::Report> {
    let data = std::fs::read(sys).with_context(|| format!("reading {}", sys.display()))?;
    let allow = allowlist::load(&l.root)?;
    let mut report = pe::check(&data, &allow, max_frame)?;
    let map = sys.with_extension("map");
    if let Ok(text) = std::fs::read_to_string(&map) {
        pe::name_frames(&mut report.frames, &text, report.image_base);
    }
    println!(
        "{}: {} bytes, checksum {:#010x}",
        sys.display(),
        data.len(),
        report.checksum
    );
    println!("  sections: {}", report.sections.join(" "));
    for (module, names) in &report.imports {
        println!("  imports {module}: {}", names.join(" "));
    }
    for f in report.frames.iter().take(3) {
        println!(
            "  frame {:>5} bytes  {:#07x} {}",
            f.bytes,
            f.rva,
            f.name.as_deref().unwrap_or("?")
        );
    }
    println!("  {} functions with unwind data", report.frames.len());
    if !report.problems.is_empty() {
        for p in &report.problems {
            eprintln!("  PROBLEM: {p}");
        }
        bail!(
            "{} failed {} check(s)",
            sys.display(),
            report.problems.len()
        );
    }
    println!("  all checks passed");
    Ok(report)
}

/// Test-signs `sys` in place with a throwaway self-signed code-signing
/// certificate (made once under `package/testcert/`), then verifies the
/// signature and checksum with `osslsigncode verify`.
///
/// # Errors
/// openssl or osslsigncode missing or failing.
pub fn sign(l: &Layout, sys: &Path) -> Result<()> {
    let dir = l.package().join("testcert");
    std::fs::create_dir_all(&dir)?;
    let key = dir.join("kvsrp-test.key");
    let cert = dir.join("kvsrp-test.crt");
    if !cert.is_file() {
        run(Command::new("openssl")
            .args([
                "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "30",
            ])
            .args(["-subj", "/CN=kvsrp throwaway test signing"])
            .args(["-addext", "extendedKeyUsage=codeSigning"])
            .arg("-keyout")
            .arg(&key)
            .arg("-out")
            .arg(&cert))?;
    }
    let unsigned = sys.with_extension("unsigned");
    std::fs::rename(sys, &unsigned)?;
    run(Command::new("osslsigncode")
        .args(["sign", "-h", "sha256", "-n", "kvsrp"])
        .arg("-certs")
        .arg(&cert)
        .arg("-key")
        .arg(&key)
        .arg("-in")
        .arg(&unsigned)
        .arg("-out")
        .arg(sys))?;
    std::fs::remove_file(&unsigned)?;
    // osslsigncode keeps the header checksum of the input; rewrite it over
    // the signed file (the Authenticode digest excludes the field).
    let mut image = std::fs::read(sys)?;
    pe::fix_checksum(&mut image)?;
    std::fs::write(sys, image)?;
    let out = Command::new("osslsigncode")
        .args(["verify", "-CAfile"])
        .arg(&cert)
        .arg("-in")
        .arg(sys)
        .output()
        .context("running osslsigncode verify")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() || !text.contains("Signature verification: ok") {
        bail!(
            "signature does not verify:\n{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // osslsigncode prints "PE checksum : X" when the header is right, and a
    // current/calculated pair when it is not.
    if text.contains("Calculated PE checksum") {
        bail!("osslsigncode reports a wrong PE checksum:\n{text}");
    }
    let ours = format!("{:08X}", pe::pe_checksum(&std::fs::read(sys)?)?);
    let theirs = field(&text, "PE checksum").unwrap_or_default();
    if theirs != ours {
        bail!("PE checksum: osslsigncode says {theirs}, kv-sys computes {ours}");
    }
    println!("  signed; osslsigncode verifies the signature and checksum {theirs}");
    Ok(())
}

fn field(text: &str, key: &str) -> Option<String> {
    text.lines()
        .find_map(|l| l.trim().strip_prefix(key))
        .map(|v| v.trim_start_matches([' ', ':']).trim().to_owned())
}

/// Runs a command, failing with its output if it fails.
///
/// # Errors
/// The command could not run or exited non-zero.
pub fn run(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
