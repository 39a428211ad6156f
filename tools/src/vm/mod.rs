//! The Linux target VM: the kernel's `ib_srpt` and LIO `isert` over Soft-RoCE
//! (`rdma_rxe`) in a qemu guest, reachable through a unix datagram socket that
//! carries raw Ethernet frames.
//!
//! Everything comes from Debian packages: qemu, a busybox initramfs and the
//! distribution kernel, downloaded and unpacked (never installed). The flow:
//!
//! 1. [`prepare`] installs the host packages if they are missing (root and
//!    apt only), downloads and unpacks the kernel, and builds the base
//!    initramfs (modules in dependency order, `modules.dep`, busybox, the
//!    `rdma` tool, the guest `init` and command agent). All of it is cached in
//!    the work directory and rebuilt only when an input changes.
//! 2. [`Vm::boot`] binds the host end of the link, starts qemu under TCG with
//!    the per-boot configuration archive appended to the initramfs, and waits
//!    for the guest's ready marker on the console; the guest reports which
//!    setup step failed if one does.
//! 3. [`Vm::exec`] runs shell commands in the guest over a second serial port
//!    (the control channel for reconfiguring targets and reading configfs).
//! 4. Dropping the [`Vm`] kills qemu; so does the exit of the process that
//!    booted it (`PR_SET_PDEATHSIG`, set from a spawner thread that lives as
//!    long as the process), so tests that share one VM can keep it in a
//!    `static OnceLock<Vm>`. The `kv-vm` CLI instead boots with
//!    [`Vm::boot_detached`], leaving the VM running, and finds it again with
//!    [`Instance::open`].
//!
//! The only network is the unix datagram socket pair: no tap device, no
//! address outside the guest.

mod config;
mod control;
pub mod ethernet;
mod instance;
pub mod link;
mod prepare;
mod process;

use std::path::{Path, PathBuf};

pub use config::{
    Accel, Backstore, IserConfig, LunConfig, MAX_LUNS, MachineConfig, NetworkConfig, SrptConfig,
    SrptWwnForm, VmConfig,
};
pub use control::ExecOutput;
pub use instance::{DEFAULT_EXEC_TIMEOUT, Instance, IserInfo, LunInfo, SrptInfo, TargetInfo, Vm};
pub use prepare::{HOST_PACKAGES, PrepareOptions, Prepared, prepare, prepared_or_skip};

/// Everything that can go wrong, each with what the user needs to act on it.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    /// A configuration value is out of range or unsafe.
    #[error("configuration: {0}")]
    Config(String),
    /// A file or socket operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// Host packages are missing and cannot be installed here.
    #[error(
        "missing host packages: {}\n  {reason}\n  install them with: apt-get install -y --no-install-recommends {}",
        .missing.join(" "), .missing.join(" ")
    )]
    PackagesMissing {
        /// Debian package names.
        missing: Vec<String>,
        /// Why they could not be installed (not root, no apt, apt failed).
        reason: String,
    },
    /// A host command exited unsuccessfully.
    #[error("`{command}` failed ({status})\n{output}")]
    CommandFailed {
        /// The command line.
        command: String,
        /// How it ended.
        status: String,
        /// The tail of its output.
        output: String,
    },
    /// A host command did not finish in time and was killed.
    #[error("`{command}` did not finish within {secs} s and was killed")]
    CommandTimeout {
        /// The command line.
        command: String,
        /// The limit.
        secs: u64,
    },
    /// Something about the host or the packages is not as expected.
    #[error("{0}")]
    Host(String),
    /// The guest never printed its ready marker.
    #[error("VM {instance}: not ready within {secs} s (qemu killed)\n  console log: {log}\n{tail}", log = .log.display())]
    BootTimeout {
        /// Instance name.
        instance: String,
        /// The limit.
        secs: u64,
        /// The kept console log.
        log: PathBuf,
        /// Its last lines.
        tail: String,
    },
    /// A target setup step in the guest failed.
    #[error("VM {instance}: setup step failed: {step}\n{detail}\n  console log: {log}", log = .log.display())]
    SetupFailed {
        /// Instance name.
        instance: String,
        /// The guest's name for the step (which configfs write, which module).
        step: String,
        /// Its exit status, output and the kernel log tail.
        detail: String,
        /// The kept console log.
        log: PathBuf,
    },
    /// qemu exited before the guest was ready.
    #[error("VM {instance}: qemu exited ({status}) before ready\n{stderr}  console log: {log}\n{tail}", log = .log.display())]
    QemuExited {
        /// Instance name.
        instance: String,
        /// Exit status.
        status: String,
        /// qemu's own error output.
        stderr: String,
        /// The kept console log.
        log: PathBuf,
        /// Its last lines.
        tail: String,
    },
    /// `up` on an instance that is already running.
    #[error("instance {instance} is already running (qemu pid {pid}); run `kv-vm down` first")]
    AlreadyRunning {
        /// Instance name.
        instance: String,
        /// qemu's pid.
        pid: u32,
    },
    /// An operation that needs a running instance found none.
    #[error("instance {0} is not running")]
    NotRunning(String),
    /// The control channel to the guest failed or spoke out of turn.
    #[error("control channel: {0}")]
    Control(String),
    /// A command in the guest did not answer in time.
    #[error("command in the VM did not finish within {secs} s: {command}")]
    ExecTimeout {
        /// The command text.
        command: String,
        /// The limit.
        secs: u64,
    },
}

impl VmError {
    /// An [`VmError::Io`] saying what was being done.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        VmError::Io {
            context: context.into(),
            source,
        }
    }
}

/// The harness's work directory: package cache, unpacked kernels, initramfs
/// images and one run directory per instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkDir {
    root: PathBuf,
}

impl WorkDir {
    /// `$KV_VM_WORKDIR` if set, else `$CARGO_TARGET_DIR/kv-vm`, else
    /// `target/kv-vm` of this workspace.
    pub fn default_path() -> PathBuf {
        if let Some(dir) = std::env::var_os("KV_VM_WORKDIR") {
            return PathBuf::from(dir);
        }
        if let Some(dir) = std::env::var_os("CARGO_TARGET_DIR") {
            return PathBuf::from(dir).join("kv-vm");
        }
        let tools = Path::new(env!("CARGO_MANIFEST_DIR"));
        tools.parent().unwrap_or(tools).join("target").join("kv-vm")
    }

    /// A work directory at `root` (created when first needed). A relative
    /// path is made absolute so that socket paths stay valid for qemu.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        let root = root.into();
        let root = if root.is_absolute() {
            root
        } else {
            std::env::current_dir()
                .map(|cwd| cwd.join(&root))
                .unwrap_or(root)
        };
        WorkDir { root }
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Downloaded `.deb` files.
    pub fn debs(&self) -> PathBuf {
        self.root.join("debs")
    }

    /// Unpacked kernel packages, one directory each.
    pub fn kernels(&self) -> PathBuf {
        self.root.join("kernel")
    }

    /// Base initramfs images and their manifests.
    pub fn initramfs(&self) -> PathBuf {
        self.root.join("initramfs")
    }

    /// The run directory of one instance.
    pub fn run(&self, instance: &str) -> RunPaths {
        RunPaths::new(self.root.join("run").join(instance))
    }
}

impl Default for WorkDir {
    fn default() -> Self {
        WorkDir::new(WorkDir::default_path())
    }
}

/// The files of one instance. Kept after the VM stops, so the console log
/// can be read after a failure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunPaths {
    /// The run directory.
    pub dir: PathBuf,
    /// Serial console (ttyS0): kernel messages, init's progress, a shell.
    pub console_sock: PathBuf,
    /// Everything the console printed, always kept.
    pub console_log: PathBuf,
    /// Second serial port (ttyS1): the command agent.
    pub control_sock: PathBuf,
    /// Everything that crossed the control channel.
    pub control_log: PathBuf,
    /// The host end of the Ethernet link: bind this unix datagram socket.
    pub host_sock: PathBuf,
    /// qemu's end of the link: send frames here.
    pub qemu_sock: PathBuf,
    /// qemu's pid.
    pub pidfile: PathBuf,
    /// qemu's own stdout and stderr.
    pub qemu_output: PathBuf,
    /// The initramfs of this boot (base plus configuration archive).
    pub initrd: PathBuf,
    /// The instance's state: configuration, guest facts, pid.
    pub state: PathBuf,
}

impl RunPaths {
    fn new(dir: PathBuf) -> Self {
        RunPaths {
            console_sock: dir.join("console.sock"),
            console_log: dir.join("console.log"),
            control_sock: dir.join("control.sock"),
            control_log: dir.join("control.log"),
            host_sock: dir.join("host.sock"),
            qemu_sock: dir.join("qemu.sock"),
            pidfile: dir.join("qemu.pid"),
            qemu_output: dir.join("qemu.out"),
            initrd: dir.join("initrd.img"),
            state: dir.join("state.toml"),
            dir,
        }
    }
}

/// The last `lines` lines of a (console) log, for error messages.
pub fn log_tail(path: &Path, lines: usize) -> String {
    let Ok(bytes) = std::fs::read(path) else {
        return format!("  (no log at {})", path.display());
    };
    let text = String::from_utf8_lossy(&bytes).replace('\r', "");
    let all: Vec<&str> = text.lines().collect();
    let start = all.len().saturating_sub(lines);
    let mut out = format!(
        "  --- last {} lines of {}\n",
        all.len() - start,
        path.display()
    );
    for line in &all[start..] {
        out.push_str("  | ");
        out.push_str(line);
        out.push('\n');
    }
    out
}
