//! kvbench: an IOmeter-style benchmark of the kverbs initiator stack.
//!
//! With no arguments it runs a short default suite (4K random read, 4K
//! random 70/30, 64K sequential read and write) over the embedded stack and
//! prints the results table. See `kvbench --help`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use clap::{Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};

use kverbs_tools::bench::engine::{
    CancelToken, Observer, Phase, RunConfig, SuiteResult, run_suite,
};
use kverbs_tools::bench::iser::{IserMiniport, IserOptions, iser_backend};
use kverbs_tools::bench::linux_vm::{LinuxVmOptions, linux_vm_iser_backend, linux_vm_srp_backend};
use kverbs_tools::bench::model::{
    LoopbackMiniport, LoopbackOptions, ModelBackend, loopback_backend,
};
use kverbs_tools::bench::ram::RamBackend;
use kverbs_tools::bench::spec::{
    AccessSpec, DEFAULT_SUITE, builtin_spec, builtin_specs, format_bytes, load_spec_file,
    parse_bytes,
};
use kverbs_tools::bench::srp::{SrpMiniport, SrpOptions, srp_backend};
use kverbs_tools::bench::stats::SpecResult;
use kverbs_tools::bench::{Backend, plot, report};
use kverbs_tools::scsi_target::BlockSize;
use kverbs_tools::vm::WorkDir;
use storport_srp::storport::host::SgShape;

/// What the I/O goes through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum TransportKind {
    /// The full SRP stack: StorPort model -> miniport -> SRP engine ->
    /// kverbs -> software HCA <-> software HCA -> software SRP target.
    Srp,
    /// The StorPort model and miniport core over an in-process loopback
    /// transport (no SRP, no RDMA) to RAM-disk targets.
    Loopback,
    /// In-process byte arrays, no initiator stack (the engine's ceiling).
    Ram,
    /// The full iSER stack: StorPort model -> miniport -> iSER engine ->
    /// kverbs -> software HCA <-> software HCA -> software iSER target
    /// (buffers must be contiguous or pages: one MR each).
    Iser,
    /// The full SRP stack against the Linux kernel's ib_srpt in a qemu VM
    /// (TCG), over the software HCA's RoCEv2 link and Soft-RoCE in the
    /// guest; LIO RAM-disk LUNs. Prepares and boots the VM (see --vm-*).
    LinuxVmSrp,
    /// The full iSER stack against Linux LIO's iSCSI target over ib_isert
    /// in a qemu VM (TCG), as linux-vm-srp.
    LinuxVmIser,
}

/// Buffer layout in physical memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Shape {
    /// One contiguous, page-aligned segment per buffer.
    Contiguous,
    /// One segment per 4 KiB page.
    Pages,
    /// Odd-length segments at odd offsets (seeded).
    Odd,
}

fn parse_size(s: &str) -> Result<u64, String> {
    parse_bytes(s)
}

fn parse_secs(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let (number, scale) = if let Some(ms) = t.strip_suffix("ms") {
        (ms, 1e-3)
    } else if let Some(sec) = t.strip_suffix('s') {
        (sec, 1.0)
    } else if let Some(min) = t.strip_suffix('m') {
        (min, 60.0)
    } else {
        (t, 1.0)
    };
    let v: f64 = number
        .trim()
        .parse()
        .map_err(|_| format!("\"{s}\" is not a duration (e.g. 5, 2.5s, 500ms, 1m)"))?;
    if !v.is_finite() || v < 0.0 {
        return Err(format!("\"{s}\" is not a duration of zero or more"));
    }
    Duration::try_from_secs_f64(v * scale).map_err(|e| format!("\"{s}\": {e}"))
}

/// The disks chosen on the command line (empty: all).
#[derive(Debug, Clone)]
struct DiskSelection(Vec<usize>);

fn parse_disks(s: &str) -> Result<DiskSelection, String> {
    if s.eq_ignore_ascii_case("all") {
        return Ok(DiskSelection(Vec::new()));
    }
    s.split(',')
        .map(|d| {
            d.trim()
                .parse::<usize>()
                .map_err(|_| format!("\"{d}\" is not a disk number (use e.g. 0,1 or all)"))
        })
        .collect::<Result<_, _>>()
        .map(DiskSelection)
}

/// An IOmeter-style benchmark of the kverbs initiator stack.
///
/// Runs access specifications one after another; each runs `--workers`
/// workers that keep `--outstanding` I/Os in flight on every selected disk,
/// ramps up for `--ramp`, then measures for `--run`. Prints a table;
/// optionally writes IOmeter-column CSV, JSON, and SVG plots. Ctrl-C stops
/// the run and still reports.
///
/// Exit status: 0 success; 1 the stack could not be built or failed; 2 bad
/// arguments or spec file; 3 data verification failed; 4 I/O errors, lost
/// I/Os or stack violations; 130 interrupted.
#[derive(Debug, Parser)]
#[command(name = "kvbench", version, about, long_about)]
struct Args {
    /// What the I/O goes through.
    #[arg(long, value_enum, default_value_t = TransportKind::Srp)]
    transport: TransportKind,

    /// Built-in access specifications to run, in order (comma-separated or
    /// repeated; see --list-specs). Default: the default suite, unless
    /// --spec-file is given.
    #[arg(long = "spec", value_delimiter = ',')]
    specs: Vec<String>,

    /// TOML or JSON file of access specifications, run after the built-in
    /// ones (repeatable).
    #[arg(long = "spec-file")]
    spec_files: Vec<PathBuf>,

    /// List the built-in access specifications and exit.
    #[arg(long)]
    list_specs: bool,

    /// Workers (threads), each driving every selected disk.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=256))]
    workers: u32,

    /// Outstanding I/Os per disk per worker.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=4096))]
    outstanding: u32,

    /// Disks to drive: comma-separated numbers, or "all".
    #[arg(long, default_value = "all", value_parser = parse_disks)]
    disks: DiskSelection,

    /// Ramp-up time before measuring (e.g. 1, 500ms, 2s).
    #[arg(long, default_value = "1s", value_parser = parse_secs)]
    ramp: Duration,

    /// Measured time per access specification (e.g. 4, 10s, 1m).
    #[arg(long, default_value = "4s", value_parser = parse_secs)]
    run: Duration,

    /// Bytes of each disk to use from its start (e.g. 64M); default the
    /// whole disk.
    #[arg(long, value_parser = parse_size)]
    max_size: Option<u64>,

    /// Write a pattern that encodes disk, sector and write generation, and
    /// check every read; fail (exit 3) on any mismatch.
    #[arg(long)]
    verify: bool,

    /// Seed of the I/O sequence.
    #[arg(long, default_value_t = 1)]
    seed: u64,

    /// Write IOmeter-column CSV here.
    #[arg(long)]
    csv: Option<PathBuf>,

    /// Write every figure as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,

    /// Write SVG plots (latency histogram, IOPS over time) per spec into
    /// this directory.
    #[arg(long)]
    plots: Option<PathBuf>,

    /// Targets in the embedded stack (linux-vm: one).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=16))]
    targets: u8,

    /// LUNs per target in the embedded stack, or of the VM's target
    /// (linux-vm, at most 16).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=16))]
    luns: u8,

    /// Size of each RAM-disk LUN (sparse: only what is written uses
    /// memory; in the VM, whole MiB of guest RAM). Default 256M, or 32M
    /// for the linux-vm transports.
    #[arg(long, value_parser = parse_size)]
    lun_size: Option<u64>,

    /// Logical block size of the RAM-disk LUNs: 512 or 4096.
    #[arg(long, default_value_t = 512)]
    block_size: u32,

    /// How I/O buffers are laid out in physical memory (what memory
    /// registration must cope with).
    #[arg(long, value_enum, default_value_t = Shape::Contiguous)]
    sg_shape: Shape,

    /// Simulated processors (DPC threads) of the embedded stack.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=64))]
    processors: u32,

    /// SRP: RC channels per target (`ch_count`).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=16))]
    channels: u32,

    /// SRP: commands per channel (`queue_size`); default the engine's.
    /// iSER: commands per session (`cmds_max`, the target's window);
    /// default 128.
    #[arg(long, value_parser = clap::value_parser!(u32).range(2..=4096))]
    queue_size: Option<u32>,

    /// SRP, iSER: do not ask for immediate data (every write is fetched
    /// by RDMA READ).
    #[arg(long)]
    no_immediate: bool,

    /// linux-vm: the VM harness's work directory (package cache, kernel,
    /// initramfs, run directory with the console log); default
    /// $KV_VM_WORKDIR, else target/kv-vm.
    #[arg(long, value_name = "DIR")]
    vm_workdir: Option<PathBuf>,

    /// linux-vm: the VM instance's name (its run directory under the work
    /// directory).
    #[arg(long, default_value = "kvbench", value_name = "NAME")]
    vm_instance: String,

    /// linux-vm: never install missing host packages (by default they are
    /// installed with apt when running as root).
    #[arg(long)]
    vm_no_install: bool,

    /// No progress bar.
    #[arg(long)]
    no_progress: bool,
}

/// The progress bar.
struct Progress {
    bar: ProgressBar,
    spec_ms: u64,
    spec_index: AtomicU32,
}

impl Progress {
    fn new(specs: usize, ramp: Duration, run: Duration, hidden: bool) -> Self {
        let spec_ms = u64::try_from((ramp + run).as_millis()).unwrap_or(u64::MAX);
        let bar = if hidden {
            ProgressBar::hidden()
        } else {
            ProgressBar::new(spec_ms.saturating_mul(specs as u64))
        };
        bar.set_style(
            ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {bar:30.cyan/blue} {percent:>3}% {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        Self {
            bar,
            spec_ms,
            spec_index: AtomicU32::new(0),
        }
    }
}

impl Observer for Progress {
    fn spec_started(&self, index: usize, total: usize, spec: &AccessSpec) {
        self.spec_index
            .store(u32::try_from(index).unwrap_or(u32::MAX), Ordering::Relaxed);
        self.bar.set_position(self.spec_ms * index as u64);
        self.bar
            .set_message(format!("[{}/{}] {}", index + 1, total, spec.name));
    }

    fn progress(&self, phase: Phase, elapsed: Duration, ios: u64) {
        let base = self.spec_ms * u64::from(self.spec_index.load(Ordering::Relaxed));
        let ms = u64::try_from(elapsed.as_millis())
            .unwrap_or(0)
            .min(self.spec_ms);
        let what = match phase {
            Phase::Prefill => "writing the verify pattern",
            Phase::RampUp => "ramp-up",
            Phase::Measure => "measuring",
            Phase::Drain => "draining",
        };
        if phase != Phase::Prefill {
            self.bar.set_position(base + ms);
        }
        let name = self
            .bar
            .message()
            .split(" - ")
            .next()
            .unwrap_or_default()
            .to_owned();
        self.bar.set_message(format!("{name} - {what}, {ios} I/Os"));
    }

    fn spec_finished(&self, result: &SpecResult) {
        self.bar.println(format!(
            "  {:<28} {:>10.0} IOPS {:>9.1} MB/s  avg {:.3} ms  p99 {:.3} ms{}",
            result.spec,
            result.rates.iops,
            result.rates.mbps,
            result.rates.latency.average_ms,
            result.rates.latency.percentiles.p99,
            if result.interrupted {
                "  (interrupted)"
            } else {
                ""
            }
        ));
    }
}

fn list_specs() {
    println!("Built-in access specifications (--spec ID):\n");
    for b in builtin_specs() {
        let default = if DEFAULT_SUITE.contains(&b.id) {
            " [default suite]"
        } else {
            ""
        };
        println!("  {:<16} {}{}", b.id, b.spec.name, default);
        println!("  {:<16} {}", "", b.description);
        for p in &b.spec.parts {
            println!(
                "  {:<16}   {:>5}  weight {:>3}  read {:>3}%  random {:>3}%  align {}",
                "",
                format_bytes(u64::from(p.transfer_size)),
                p.weight,
                p.read_percent,
                p.random_percent,
                format_bytes(u64::from(p.alignment))
            );
        }
    }
}

fn collect_specs(args: &Args) -> Result<Vec<AccessSpec>, String> {
    let mut specs = Vec::new();
    let ids: Vec<String> = if args.specs.is_empty() && args.spec_files.is_empty() {
        DEFAULT_SUITE.iter().map(|s| (*s).to_owned()).collect()
    } else {
        args.specs.clone()
    };
    for id in &ids {
        let spec = builtin_spec(id.trim()).ok_or_else(|| {
            format!(
                "unknown access specification \"{id}\" (see --list-specs; known: {})",
                builtin_specs()
                    .iter()
                    .map(|b| b.id)
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })?;
        specs.push(spec);
    }
    for path in &args.spec_files {
        specs.extend(load_spec_file(path)?);
    }
    Ok(specs)
}

/// The stack a run goes through.
enum Built {
    Boxed(Box<dyn Backend>),
    Loopback(ModelBackend<LoopbackMiniport>),
    Srp(ModelBackend<SrpMiniport>),
    Iser(ModelBackend<IserMiniport>),
}

impl Built {
    fn backend(&self) -> &dyn Backend {
        match self {
            Self::Boxed(b) => b.as_ref(),
            Self::Loopback(b) => b,
            Self::Srp(b) => b,
            Self::Iser(b) => b,
        }
    }

    /// Tears the stack down; the violations it recorded.
    fn finish(self) -> Vec<String> {
        match self {
            Self::Boxed(_) => Vec::new(),
            Self::Loopback(b) => b.finish(),
            Self::Srp(b) => b.finish(),
            Self::Iser(b) => b.finish(),
        }
    }
}

fn build(args: &Args) -> Result<Built, String> {
    let block_size = BlockSize::from_bytes(args.block_size)
        .ok_or_else(|| format!("--block-size {} is not 512 or 4096", args.block_size))?;
    let lun_size = args.lun_size.unwrap_or(256 << 20);
    let sg_shape = match args.sg_shape {
        Shape::Contiguous => SgShape::Contiguous,
        Shape::Pages => SgShape::Pages,
        Shape::Odd => SgShape::Odd { seed: args.seed },
    };
    match args.transport {
        TransportKind::Srp => {
            let options = SrpOptions {
                targets: args.targets,
                luns: args.luns,
                lun_bytes: lun_size,
                block_size,
                sg_shape,
                processors: args.processors,
                channels: args.channels,
                queue_size: args.queue_size,
                immediate_data: !args.no_immediate,
            };
            srp_backend(&options)
                .map(Built::Srp)
                .map_err(|e| format!("cannot build the SRP stack: {e}"))
        }
        TransportKind::Iser => {
            let options = IserOptions {
                targets: args.targets,
                luns: args.luns,
                lun_bytes: lun_size,
                block_size,
                sg_shape,
                processors: args.processors,
                queue_depth: args.queue_size,
                immediate_data: !args.no_immediate,
            };
            iser_backend(&options)
                .map(Built::Iser)
                .map_err(|e| format!("cannot build the iSER stack: {e}"))
        }
        TransportKind::LinuxVmSrp | TransportKind::LinuxVmIser => {
            if args.targets != 1 {
                return Err("the Linux target VM runs one target: --targets must be 1".into());
            }
            let options = LinuxVmOptions {
                workdir: args
                    .vm_workdir
                    .clone()
                    .map_or_else(WorkDir::default, WorkDir::new),
                instance: args.vm_instance.clone(),
                install: !args.vm_no_install,
                verbose: !args.no_progress,
                luns: args.luns,
                lun_bytes: args.lun_size.unwrap_or(32 << 20),
                block_size,
                sg_shape,
                processors: args.processors,
                channels: args.channels,
                queue_size: args.queue_size,
                immediate_data: !args.no_immediate,
            };
            if args.transport == TransportKind::LinuxVmSrp {
                linux_vm_srp_backend(&options)
                    .map(Built::Srp)
                    .map_err(|e| format!("cannot run against ib_srpt in the VM: {e}"))
            } else {
                linux_vm_iser_backend(&options)
                    .map(Built::Iser)
                    .map_err(|e| format!("cannot run against LIO iSER in the VM: {e}"))
            }
        }
        TransportKind::Ram => {
            if args.block_size != 512 {
                return Err("--transport ram has 512-byte blocks only".into());
            }
            let disks = usize::from(args.targets) * usize::from(args.luns);
            let total = lun_size.saturating_mul(disks as u64);
            if total > 8 << 30 {
                return Err(format!(
                    "--transport ram allocates its disks: {} bytes is too much (at most 8 GiB)",
                    total
                ));
            }
            Ok(Built::Boxed(Box::new(RamBackend::new(disks, lun_size))))
        }
        TransportKind::Loopback => {
            let options = LoopbackOptions {
                targets: args.targets,
                luns: args.luns,
                lun_bytes: lun_size,
                block_size,
                sg_shape,
                processors: args.processors,
                ..LoopbackOptions::default()
            };
            loopback_backend(&options)
                .map(Built::Loopback)
                .map_err(|e| format!("cannot build the loopback stack: {e}"))
        }
    }
}

fn slug(name: &str) -> String {
    let s: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    s.split('-')
        .filter(|p| !p.is_empty())
        .collect::<Vec<_>>()
        .join("-")
}

/// Creates an output file, and its directory if it does not exist yet.
fn create_output(path: &std::path::Path) -> Result<std::fs::File, String> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    std::fs::File::create(path).map_err(|e| format!("cannot create {}: {e}", path.display()))
}

fn write_outputs(args: &Args, suite: &SuiteResult) -> Result<(), String> {
    if let Some(path) = &args.csv {
        let file = create_output(path)?;
        report::write_csv(suite, file).map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    if let Some(path) = &args.json {
        let file = create_output(path)?;
        report::write_json(suite, std::io::BufWriter::new(file))
            .map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    if let Some(dir) = &args.plots {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        for (i, r) in suite.results.iter().enumerate() {
            let base = format!("{:02}-{}", i + 1, slug(&r.spec));
            plot::latency_histogram(r, &dir.join(format!("{base}-latency.svg")))
                .map_err(|e| format!("plot of {}: {e}", r.spec))?;
            plot::iops_over_time(r, &dir.join(format!("{base}-iops.svg")))
                .map_err(|e| format!("plot of {}: {e}", r.spec))?;
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.list_specs {
        list_specs();
        return ExitCode::SUCCESS;
    }
    let specs = match collect_specs(&args) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kvbench: {e}");
            return ExitCode::from(2);
        }
    };
    let cancel = CancelToken::new();
    {
        let cancel = cancel.clone();
        let presses = AtomicU32::new(0);
        let installed = ctrlc::set_handler(move || {
            if presses.fetch_add(1, Ordering::Relaxed) == 0 {
                eprintln!(
                    "\nkvbench: interrupted; finishing the current I/O and reporting (Ctrl-C again to quit at once)"
                );
                cancel.cancel();
            } else {
                std::process::exit(130);
            }
        });
        if let Err(e) = installed {
            eprintln!("kvbench: cannot install the Ctrl-C handler: {e}");
        }
    }
    let built = match build(&args) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("kvbench: {e}");
            return ExitCode::from(1);
        }
    };
    let backend = built.backend();
    let targets = if args.disks.0.is_empty() {
        (0..backend.targets().len()).collect()
    } else {
        args.disks.0.clone()
    };
    let config = RunConfig {
        workers: args.workers as usize,
        outstanding: args.outstanding as usize,
        targets,
        ramp: args.ramp,
        run: args.run,
        verify: args.verify,
        seed: args.seed,
        max_bytes: args.max_size,
        ..RunConfig::default()
    };
    let progress = Progress::new(specs.len(), args.ramp, args.run, args.no_progress);
    eprintln!("kvbench: {}", backend.describe());
    let outcome = run_suite(backend, &specs, &config, &cancel, &progress);
    progress.bar.finish_and_clear();
    let suite = match outcome {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kvbench: {e}");
            let violations = built.finish();
            for v in &violations {
                eprintln!("kvbench: {v}");
            }
            return ExitCode::from(match e {
                kverbs_tools::bench::BenchError::Config(_) => 2,
                kverbs_tools::bench::BenchError::Backend(_) => 1,
            });
        }
    };
    print!("{}", report::table(&suite));
    let mut status = 0u8;
    if let Err(e) = write_outputs(&args, &suite) {
        eprintln!("kvbench: {e}");
        status = 1;
    }
    let violations = built.finish();
    if !violations.is_empty() {
        println!(
            "\nThe stack broke its contract {} time(s):",
            violations.len()
        );
        for v in violations.iter().take(20) {
            println!("  {v}");
        }
        status = status.max(4);
    }
    if suite.had_errors() {
        status = status.max(4);
    }
    if suite.verify_failed() {
        status = 3;
    }
    if status == 0 && suite.interrupted {
        status = 130;
    }
    ExitCode::from(status)
}
