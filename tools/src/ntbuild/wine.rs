//! Wine as a second engine: its SetupAPI installs the stamped INF (the
//! service and `Parameters` values are read back and checked), and its
//! `winedevice` loads `kvsrp.sys` against the test-double `storport.sys`,
//! whose recorded facts are checked here.

use super::{Layout, run};
use anyhow::{Context, Result, bail};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The service key, as `reg` spells it.
pub const SERVICE_KEY: &str = r"HKLM\System\CurrentControlSet\Services\kvsrp";

/// How long Wine's services.exe waits for a service to start (ms, as the
/// REG_SZ it reads); Wine's default is 10 000.
const SERVICE_START_TIMEOUT_MS: &str = "120000";

/// A parsed `reg query /s`: key -> (value -> (type, data)).
pub type RegTree = BTreeMap<String, BTreeMap<String, (String, String)>>;

/// A Wine prefix of our own under `target/nt/wineprefix`.
#[derive(Debug)]
pub struct Wine {
    prefix: PathBuf,
    wine: PathBuf,
}

impl Wine {
    /// Creates a fresh prefix (`wineboot --init`).
    ///
    /// # Errors
    /// Wine is missing or fails to initialise.
    pub fn fresh(l: &Layout) -> Result<Self> {
        let prefix = l.out.join("wineprefix");
        if prefix.exists() {
            std::fs::remove_dir_all(&prefix)?;
        }
        let wine = ["/usr/lib/wine/wine64", "/usr/bin/wine64", "/usr/bin/wine"]
            .iter()
            .map(PathBuf::from)
            .find(|p| p.is_file())
            .context("wine64 not found (install Debian's wine64)")?;
        let w = Self { prefix, wine };
        w.cmd(&["wineboot", "--init"]).context("wineboot --init")?;
        w.raise_service_start_timeout()?;
        Ok(w)
    }

    /// Raises how long services.exe waits for a service to start, and
    /// restarts the prefix's processes so that it reads the new value.
    ///
    /// Wine gives a service 10 s to report that it started, and a kernel
    /// service's `DriverEntry` runs inside that window: a cold, loaded CI
    /// machine has overrun it. The value is read when services.exe starts.
    ///
    /// # Errors
    /// `reg add` fails.
    pub fn raise_service_start_timeout(&self) -> Result<()> {
        self.cmd(&[
            "reg",
            "add",
            r"HKLM\System\CurrentControlSet\Control",
            "/v",
            "ServicesPipeTimeout",
            "/t",
            "REG_SZ",
            "/d",
            SERVICE_START_TIMEOUT_MS,
            "/f",
        ])
        .context("reg add ServicesPipeTimeout")?;
        self.stop();
        Ok(())
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(&self.wine);
        c.args(args)
            .env("WINEPREFIX", &self.prefix)
            .env("WINEDEBUG", "-all")
            .env("WINEDLLOVERRIDES", "mscoree,mshtml=")
            .env_remove("DISPLAY");
        c
    }

    /// Runs a Wine program and returns its stdout.
    ///
    /// # Errors
    /// It exits non-zero.
    pub fn cmd(&self, args: &[&str]) -> Result<String> {
        run(&mut self.command(args))
    }

    /// `C:\windows\system32\drivers` on the host side.
    #[must_use]
    pub fn drivers_dir(&self) -> PathBuf {
        self.prefix.join("drive_c/windows/system32/drivers")
    }

    /// A host path as Wine's `Z:` drive sees it.
    #[must_use]
    pub fn z_path(path: &Path) -> String {
        format!("Z:{}", path.display()).replace('/', "\\")
    }

    /// `reg query KEY /s`, parsed into key -> (value -> (type, data)).
    ///
    /// # Errors
    /// The key does not exist.
    pub fn reg_query(&self, key: &str) -> Result<RegTree> {
        let text = self.cmd(&["reg", "query", key, "/s"])?;
        Ok(parse_reg_query(&text))
    }

    /// Shuts the prefix's wineserver down and waits until it has exited.
    ///
    /// Debian keeps `wineserver` beside `wine64` in `/usr/lib/wine`, off
    /// `PATH`.
    pub fn stop(&self) {
        let server = self
            .wine
            .parent()
            .map(|dir| dir.join("wineserver"))
            .filter(|p| p.is_file())
            .unwrap_or_else(|| PathBuf::from("wineserver"));
        for arg in ["-k", "-w"] {
            let _ = Command::new(&server)
                .arg(arg)
                .env("WINEPREFIX", &self.prefix)
                .status();
        }
    }
}

/// Parses `reg query /s` output.
#[must_use]
pub fn parse_reg_query(text: &str) -> RegTree {
    let mut out: RegTree = BTreeMap::new();
    let mut key = String::new();
    for line in text.lines() {
        let line = line.trim_end_matches('\r');
        if line.starts_with("HKEY_") {
            key = line.trim().to_owned();
            out.entry(key.clone()).or_default();
        } else if let Some(rest) = line.strip_prefix("    ") {
            let mut parts = rest.splitn(3, "    ");
            if let (Some(name), Some(kind)) = (parts.next(), parts.next()) {
                let data = parts.next().unwrap_or("").to_owned();
                out.entry(key.clone())
                    .or_default()
                    .insert(name.to_owned(), (kind.to_owned(), data));
            }
        }
    }
    out
}

/// Looks a value up in a parsed `reg query` result by key suffix.
fn value<'a>(reg: &'a RegTree, key_suffix: &str, name: &str) -> Option<&'a (String, String)> {
    reg.iter()
        .find(|(k, _)| {
            k.to_ascii_lowercase()
                .ends_with(&key_suffix.to_ascii_lowercase())
        })
        .and_then(|(_, v)| v.get(name))
}

/// Expectation helper: collects mismatches.
#[derive(Default)]
struct Expect(Vec<String>);

impl Expect {
    fn eq(&mut self, what: &str, got: Option<&str>, want: &str) {
        if got != Some(want) {
            self.0.push(format!("{what}: got {got:?}, want {want:?}"));
        }
    }
    fn finish(self, stage: &str) -> Result<()> {
        if self.0.is_empty() {
            println!("  {stage}: all checks passed");
            Ok(())
        } else {
            for p in &self.0 {
                eprintln!("  PROBLEM: {p}");
            }
            bail!("{stage}: {} check(s) failed", self.0.len())
        }
    }
}

/// Installs the stamped INF with SetupAPI and checks the service and its
/// parameters. `targets` are the subkeys the INF was stamped with:
/// (name, value, data).
///
/// # Errors
/// The install fails or a value differs.
pub fn install_and_check(w: &Wine, inf: &Path, targets: &[(&str, &str, &str)]) -> Result<()> {
    let section = "KvSrp_Install.NT";
    w.cmd(&[
        "rundll32",
        "setupapi.dll,InstallHinfSection",
        section,
        "128",
        &Wine::z_path(inf),
    ])
    .context("SetupAPI InstallHinfSection")?;
    let reg = w.reg_query(SERVICE_KEY)?;
    let mut e = Expect::default();
    let v = |key: &str, name: &str| value(&reg, key, name).map(|(_, d)| d.as_str());
    let t = |key: &str, name: &str| value(&reg, key, name).map(|(k, _)| k.as_str());
    e.eq("Type", v(r"\kvsrp", "Type"), "0x1");
    e.eq("Start", v(r"\kvsrp", "Start"), "0x3");
    e.eq("ErrorControl", v(r"\kvsrp", "ErrorControl"), "0x1");
    e.eq("Group", v(r"\kvsrp", "Group"), "SCSI miniport");
    let image = v(r"\kvsrp", "ImagePath").unwrap_or("").to_ascii_lowercase();
    if !image.ends_with(r"\drivers\kvsrp.sys") {
        e.0.push(format!(
            "ImagePath {image:?} is not ...\\drivers\\kvsrp.sys"
        ));
    }
    for (name, want) in [
        ("QueueSize", "0x40"),
        ("ChannelCount", "0x0"),
        ("ReconnectDelay", "0xa"),
        ("FastIoFailTmo", "0xf"),
        ("DevLossTmo", "0x258"),
        ("BusType", "0x1"),
    ] {
        e.eq(name, v(r"\kvsrp\Parameters", name), want);
        e.eq(
            &format!("{name} type"),
            t(r"\kvsrp\Parameters", name),
            "REG_DWORD",
        );
    }
    e.eq(
        "PnpInterface\\0",
        v(r"\Parameters\PnpInterface", "0"),
        "0x1",
    );
    if !reg
        .keys()
        .any(|k| k.to_ascii_lowercase().ends_with(r"\parameters\targets"))
    {
        e.0.push("Parameters\\Targets key missing".into());
    }
    for (target, name, data) in targets {
        let key = format!(r"\Parameters\Targets\{target}");
        e.eq(&format!("{target}\\{name}"), v(&key, name), data);
        e.eq(&format!("{target}\\{name} type"), t(&key, name), "REG_SZ");
    }
    let copied = w.drivers_dir().join("kvsrp.sys");
    if !copied.is_file() {
        e.0.push("CopyFiles did not place kvsrp.sys in system32\\drivers".into());
    }
    e.finish("INF install")
}

/// What the smoke run must record: `SmokeRun` value -> expected text.
///
/// The driver runs the real miniport core over the transport Windows has
/// today (no HCA), configured from the registry the INF wrote (two attached
/// targets) and the `DriverParameter` string the fake passes
/// (`QueueSize=32`): 2 targets x 32 = 64 requests per adapter. The core's
/// passive worker (kverbs work items, here on Wine's thread pool) reports
/// both targets unreachable — a bus change and a log entry each, then
/// "adapter running" — after which INQUIRY to an attached target completes
/// `SRB_STATUS_SELECTION_TIMEOUT` (0x0a) and one beyond them
/// `SRB_STATUS_INVALID_TARGET_ID` (0x21), nothing transferred, no SCSI
/// status. The bus reset logs `BusReset` (unique id 0x08000000), stop and
/// restart each issue the core's adapter-control DPC and complete on the
/// worker (log entries 5 and 6), and no request was ever held back.
pub const EXPECTED_SMOKE: &[(&str, &str)] = &[
    (
        "01-registration",
        "size=208 interface=0 features=0x1 srb_types=0x3 address_types=0x1 ext_fits=1 srb_ext_fits=1 map=3 find=1 init=1 start=1 reset=1 control=1 free=1 build=0",
    ),
    (
        "02-find-adapter",
        "ret=1 buses=1 targets=2 luns=8 virtual=1 map=3 srb_type=1 max_io=64 per_lun=32 max_transfer=1048576 breaks=256 dpcs=1",
    ),
    ("03-initialize", "ret=1 passive_registered=1"),
    ("04-passive-initialize", "ret=1"),
    (
        "05-targets-reported",
        "started=1 bus_changes=2 log_entries=3",
    ),
    (
        "06-inquiry-classic",
        "ret=1 completions=1 same_srb=1 srb_status=0x0a scsi_status=0 transferred=0",
    ),
    (
        "07-inquiry-extended",
        "ret=1 completions=1 same_srb=1 srb_status=0x0a scsi_status=0 transferred=0",
    ),
    (
        "08-inquiry-out-of-range",
        "ret=1 completions=1 same_srb=1 srb_status=0x21 scsi_status=0 transferred=0",
    ),
    ("09-reset-bus", "ret=1 last_log=0x08000000"),
    ("10-adapter-control", "ret=0 supported=11100"),
    ("11-stop-adapter", "ret=0 dpcs_issued=1 settled=1"),
    ("12-restart-adapter", "ret=0 dpcs_issued=1 settled=1"),
    (
        "13-inquiry-after-restart",
        "ret=1 completions=1 same_srb=1 srb_status=0x0a scsi_status=0 transferred=0",
    ),
    ("14-free-adapter-resources", "done dpcs_pending=0"),
    ("15-holds", "holds=0 releases=0"),
];

/// Places the fake `storport.sys`, starts the service and checks what the
/// fake recorded.
///
/// # Errors
/// The service fails to start or a recorded fact differs.
pub fn smoke(w: &Wine, fake: &Path) -> Result<()> {
    std::fs::copy(fake, w.drivers_dir().join("storport.sys"))?;
    std::fs::copy(fake, w.drivers_dir().join("..").join("storport.sys"))?;
    let started = w.cmd(&["net", "start", "kvsrp"]);
    let reg = w
        .reg_query(&format!(r"{SERVICE_KEY}\SmokeRun"))
        .unwrap_or_default();
    let mut e = Expect::default();
    if let Err(err) = started {
        e.0.push(format!("net start kvsrp failed: {err:#}"));
    }
    for (name, want) in EXPECTED_SMOKE {
        let got = value(&reg, r"\SmokeRun", name).map(|(_, d)| d.as_str());
        println!("  {name}: {}", got.unwrap_or("(missing)"));
        e.eq(name, got, want);
    }
    let _ = w.cmd(&["net", "stop", "kvsrp"]);
    e.finish("smoke run")
}

/// What the kverbs NT platform probe (`tools/nt-probe`) must record under
/// Debian's Wine 8: `1` where the primitive behaved as the Windows kernel
/// documents. Two values record where Wine 8 differs from Windows, pinned
/// so that a change in Wine is noticed:
/// * `06-dpc ran=0`: Wine's `KeInsertQueueDpc` accepts the DPC but never
///   runs it (on Windows, `ran=1`);
/// * `07-timer rearm_was_armed=1`: after the timer fired, Wine's
///   `KeSetTimer` still reports it as set (on Windows it returns FALSE, so
///   `rearm_was_armed=0`).
///
/// Not probed (Wine cannot run them): the IRQL read (`cr8`), per-processor
/// DPC targeting, `KeStallExecutionProcessor`.
pub const EXPECTED_PROBE: &[(&str, &str)] = &[
    ("01-spin-locks", "ok=1"),
    (
        "02-events",
        "timeout=1 set=1 auto_clear=1 notification=1 clear=1",
    ),
    ("03-fast-mutex", "ok=1"),
    ("04-time", "frequency=1 delay_measured=1"),
    (
        "05-work-item",
        "queued=1 ran=1 requeued=1 ran_after_drop=1 runs=2",
    ),
    ("06-dpc", "queued=1 ran=0"),
    (
        "07-timer",
        "was_armed=0 fired=1 not_early=1 rearm_was_armed=1 cancel=1 cancel_again=0 hits=1",
    ),
    ("08-pool", "aligned=1"),
    ("09-processors", "at_least_one=1"),
    ("10-flush-dpcs", "returned=1"),
    ("11-random", "filled=1 nonzero=1 differ=1"),
];

/// Installs `kvprobe.sys` as a kernel service, starts it, and checks what
/// it recorded about kverbs' NT platform.
///
/// # Errors
/// The service fails to start or a recorded fact differs.
pub fn probe(w: &Wine, image: &Path) -> Result<()> {
    std::fs::copy(image, w.drivers_dir().join("kvprobe.sys"))?;
    w.cmd(&[
        "sc",
        "create",
        "kvprobe",
        "type=",
        "kernel",
        "start=",
        "demand",
        "binPath=",
        r"C:\windows\system32\drivers\kvprobe.sys",
    ])
    .context("sc create kvprobe")?;
    let t0 = std::time::Instant::now();
    let started = w.cmd(&["net", "start", "kvprobe"]);
    println!("  net start kvprobe: {:.1} s", t0.elapsed().as_secs_f64());
    let reg = w
        .reg_query(r"HKLM\System\CurrentControlSet\Services\kvprobe\Probe")
        .unwrap_or_default();
    let mut e = Expect::default();
    if let Err(err) = started {
        e.0.push(format!("net start kvprobe failed: {err:#}"));
    }
    for (name, want) in EXPECTED_PROBE {
        let got = value(&reg, r"\Probe", name).map(|(_, d)| d.as_str());
        println!("  {name}: {}", got.unwrap_or("(missing)"));
        e.eq(name, got, want);
    }
    for (key, values) in &reg {
        for (name, (_, data)) in values {
            if key.ends_with("Probe") && !EXPECTED_PROBE.iter().any(|(n, _)| n == name) {
                e.0.push(format!("unexpected probe record {name}: {data}"));
            }
        }
    }
    let _ = w.cmd(&["net", "stop", "kvprobe"]);
    e.finish("NT platform probe")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reg_query_output_parses() {
        let text = "\r\nHKEY_LOCAL_MACHINE\\System\\CurrentControlSet\\Services\\kvsrp\r\n    Type    REG_DWORD    0x1\r\n    ImagePath    REG_EXPAND_SZ    C:\\windows\\system32\\drivers\\kvsrp.sys\r\n\r\nHKEY_LOCAL_MACHINE\\System\\CurrentControlSet\\Services\\kvsrp\\Parameters\r\n    QueueSize    REG_DWORD    0x40\r\n    Empty    REG_SZ    \r\n";
        let reg = parse_reg_query(text);
        assert_eq!(
            value(&reg, r"\kvsrp", "Type"),
            Some(&("REG_DWORD".into(), "0x1".into()))
        );
        assert_eq!(
            value(&reg, r"\kvsrp\Parameters", "QueueSize").map(|v| v.1.as_str()),
            Some("0x40")
        );
        assert_eq!(
            value(&reg, r"\kvsrp\Parameters", "Empty").map(|v| v.1.as_str()),
            Some("")
        );
        assert_eq!(value(&reg, r"\kvsrp\Parameters", "Type"), None);
    }
}
