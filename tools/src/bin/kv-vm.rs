//! `kv-vm`: the Linux SRP/iSER target VM (ib_srpt and LIO isert over
//! Soft-RoCE in qemu) for interop tests of the kverbs initiator.
//!
//! ```text
//! kv-vm prepare          # install packages, fetch the kernel, build the initramfs
//! kv-vm up               # boot; prints sockets, MACs, IPs, GUIDs, target ids
//! kv-vm exec -- cat /sys/kernel/config/target/srpt/*/tpgt_1/enable
//! kv-vm console          # the guest's serial console (Ctrl-] leaves)
//! kv-vm status | down
//! ```

use std::io::{IsTerminal, Read, Write};
use std::net::Ipv4Addr;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use kverbs_tools::vm::ethernet::MacAddr;
use kverbs_tools::vm::{
    Accel, Backstore, Instance, LunConfig, PrepareOptions, SrptWwnForm, Vm, VmConfig, VmError,
    WorkDir, prepare,
};

#[derive(Parser, Debug)]
#[command(
    name = "kv-vm",
    version,
    about = "The Linux SRP/iSER target VM over Soft-RoCE for kverbs interop tests"
)]
struct Cli {
    /// Work directory (package cache, kernel, initramfs, run files).
    /// Default: $KV_VM_WORKDIR, else $CARGO_TARGET_DIR/kv-vm, else target/kv-vm.
    #[arg(long, global = true)]
    workdir: Option<PathBuf>,
    /// TOML configuration file (`kv-vm config` prints the defaults).
    #[arg(long, short = 'c', global = true)]
    config: Option<PathBuf>,
    /// Instance name (overrides the file's `instance`).
    #[arg(long, short = 'i', global = true)]
    instance: Option<String>,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Install missing host packages, download and unpack the kernel, build the initramfs.
    Prepare {
        #[command(flatten)]
        prep: PrepArgs,
    },
    /// Prepare if needed, boot the VM and wait until the targets are ready.
    Up {
        #[command(flatten)]
        prep: PrepArgs,
        #[command(flatten)]
        overrides: Overrides,
    },
    /// Stop the VM.
    Down,
    /// Show whether the VM runs and what it serves; exit status 3 if it does not run.
    Status,
    /// Run a shell command in the VM and pass on its output and exit status.
    Exec {
        /// Seconds before the command is killed in the VM.
        #[arg(long, default_value_t = 60)]
        timeout: u64,
        /// The command (joined with spaces and run by the guest's sh).
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
        command: Vec<String>,
    },
    /// Attach to the guest's serial console (a shell; Ctrl-] leaves).
    Console,
    /// Print the effective configuration as TOML.
    Config {
        #[command(flatten)]
        overrides: Overrides,
    },
}

#[derive(Args, Debug)]
struct PrepArgs {
    /// Never run apt-get install; fail if host packages are missing.
    #[arg(long)]
    no_install: bool,
    /// Kernel image package (default: what linux-image-amd64 depends on).
    #[arg(long)]
    kernel_package: Option<String>,
}

/// Flags that override the configuration file.
#[derive(Args, Debug, Default)]
struct Overrides {
    /// Guest memory in MiB.
    #[arg(long)]
    memory: Option<u32>,
    /// Guest CPUs.
    #[arg(long)]
    cpus: Option<u32>,
    /// Accelerator.
    #[arg(long, value_enum)]
    accel: Option<Accel>,
    /// Seconds to wait for the targets to be ready.
    #[arg(long)]
    ready_timeout: Option<u64>,
    /// Leave the VM running when a setup step fails (for `kv-vm console`).
    #[arg(long)]
    keep_on_failure: bool,
    /// Guest IPv4 address.
    #[arg(long)]
    vm_ip: Option<Ipv4Addr>,
    /// Host (initiator) IPv4 address.
    #[arg(long)]
    host_ip: Option<Ipv4Addr>,
    /// Subnet prefix length.
    #[arg(long)]
    prefix_len: Option<u8>,
    /// Guest MAC.
    #[arg(long)]
    vm_mac: Option<MacAddr>,
    /// Host MAC.
    #[arg(long)]
    host_mac: Option<MacAddr>,
    /// Give the guest a permanent neighbour entry for the host (no ARP needed).
    #[arg(long)]
    static_host_neighbor: bool,
    /// A LUN as `KIND:SIZE[:BLOCK]` (rd_mcp|fileio, size like 64M or 1G); repeat
    /// for more; replaces the configured list.
    #[arg(long = "lun", value_parser = parse_lun)]
    luns: Vec<LunConfig>,
    /// Do not set up the SRP target.
    #[arg(long)]
    no_srpt: bool,
    /// SRP RDMA/CM port.
    #[arg(long)]
    rdma_cm_port: Option<u16>,
    /// ib_srpt srp_max_req_size.
    #[arg(long)]
    srp_max_req_size: Option<u32>,
    /// ib_srpt srpt_srq_size.
    #[arg(long)]
    srpt_srq_size: Option<u32>,
    /// Configfs name form of the srpt port.
    #[arg(long, value_enum)]
    srpt_wwn: Option<SrptWwnForm>,
    /// srpt node ACL name (repeatable; replaces the configured list).
    #[arg(long = "srpt-acl")]
    srpt_acls: Vec<String>,
    /// srpt TPG attribute NAME=VALUE (repeatable).
    #[arg(long = "srpt-attr", value_parser = parse_pair)]
    srpt_attrs: Vec<(String, String)>,
    /// Do not set up the iSCSI/iSER target.
    #[arg(long)]
    no_iser: bool,
    /// iSCSI target IQN.
    #[arg(long)]
    iser_iqn: Option<String>,
    /// iSER portal IP (default: the VM's).
    #[arg(long)]
    iser_portal_ip: Option<Ipv4Addr>,
    /// iSER portal port.
    #[arg(long)]
    iser_port: Option<u16>,
    /// Turn iSCSI demo mode off (then --iser-acl is needed).
    #[arg(long)]
    no_demo_mode: bool,
    /// Initiator IQN with an explicit ACL (repeatable; replaces the configured list).
    #[arg(long = "iser-acl")]
    iser_acls: Vec<String>,
    /// iSCSI TPG attribute NAME=VALUE (repeatable).
    #[arg(long = "iser-attr", value_parser = parse_pair)]
    iser_attrs: Vec<(String, String)>,
    /// iSCSI login parameter NAME=VALUE (repeatable).
    #[arg(long = "iser-param", value_parser = parse_pair)]
    iser_params: Vec<(String, String)>,
    /// ib_isert sg_tablesize.
    #[arg(long)]
    sg_tablesize: Option<u32>,
}

impl Overrides {
    fn apply(self, c: &mut VmConfig) {
        let m = &mut c.machine;
        set(&mut m.memory_mib, self.memory);
        set(&mut m.cpus, self.cpus);
        set(&mut m.accel, self.accel);
        set(&mut m.ready_timeout_secs, self.ready_timeout);
        m.keep_on_failure |= self.keep_on_failure;
        let n = &mut c.network;
        set(&mut n.vm_ip, self.vm_ip);
        set(&mut n.host_ip, self.host_ip);
        set(&mut n.prefix_len, self.prefix_len);
        set(&mut n.vm_mac, self.vm_mac);
        set(&mut n.host_mac, self.host_mac);
        n.static_host_neighbor |= self.static_host_neighbor;
        if !self.luns.is_empty() {
            c.luns = self.luns;
        }
        let s = &mut c.srpt;
        s.enabled &= !self.no_srpt;
        set(&mut s.rdma_cm_port, self.rdma_cm_port);
        if self.srp_max_req_size.is_some() {
            s.srp_max_req_size = self.srp_max_req_size;
        }
        if self.srpt_srq_size.is_some() {
            s.srpt_srq_size = self.srpt_srq_size;
        }
        set(&mut s.wwn, self.srpt_wwn);
        if !self.srpt_acls.is_empty() {
            s.acls = Some(self.srpt_acls);
        }
        s.attributes.extend(self.srpt_attrs);
        let i = &mut c.iser;
        i.enabled &= !self.no_iser;
        set(&mut i.target_iqn, self.iser_iqn);
        if self.iser_portal_ip.is_some() {
            i.portal_ip = self.iser_portal_ip;
        }
        set(&mut i.portal_port, self.iser_port);
        i.demo_mode &= !self.no_demo_mode;
        if !self.iser_acls.is_empty() {
            i.acls = self.iser_acls;
        }
        i.attributes.extend(self.iser_attrs);
        i.parameters.extend(self.iser_params);
        if self.sg_tablesize.is_some() {
            i.sg_tablesize = self.sg_tablesize;
        }
    }
}

fn set<T>(field: &mut T, value: Option<T>) {
    if let Some(v) = value {
        *field = v;
    }
}

fn parse_size_mib(text: &str) -> Result<u32, String> {
    let (digits, unit) = match text.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((at, _)) => text.split_at(at),
        None => (text, "M"),
    };
    let n: u32 = digits.parse().map_err(|_| format!("bad size {text:?}"))?;
    let mib = match unit {
        "M" | "m" | "MiB" => Some(n),
        "G" | "g" | "GiB" => n.checked_mul(1024),
        _ => None,
    };
    mib.ok_or_else(|| format!("bad size {text:?}: use a number with M or G"))
}

fn parse_lun(text: &str) -> Result<LunConfig, String> {
    let mut parts = text.split(':');
    let kind = match parts.next() {
        Some("rd_mcp" | "ram") => Backstore::RdMcp,
        Some("fileio" | "file") => Backstore::Fileio,
        _ => return Err(format!("{text:?}: LUN kind must be rd_mcp or fileio")),
    };
    let size_mib = parse_size_mib(
        parts
            .next()
            .ok_or_else(|| format!("{text:?}: expected KIND:SIZE[:BLOCK]"))?,
    )?;
    let block_size = match parts.next() {
        Some(b) => b.parse().map_err(|_| format!("{text:?}: bad block size"))?,
        None => 512,
    };
    if parts.next().is_some() {
        return Err(format!("{text:?}: expected KIND:SIZE[:BLOCK]"));
    }
    Ok(LunConfig {
        backstore: kind,
        size_mib,
        block_size,
    })
}

fn parse_pair(text: &str) -> Result<(String, String), String> {
    text.split_once('=')
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("{text:?}: expected NAME=VALUE"))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kv-vm: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<ExitCode, VmError> {
    let workdir = cli.workdir.map(WorkDir::new).unwrap_or_default();
    let mut config = match &cli.config {
        Some(path) => VmConfig::from_file(path)?,
        None => VmConfig::default(),
    };
    if let Some(name) = cli.instance {
        config.instance = name;
    }
    let prep_options = |prep: &PrepArgs, config: &VmConfig| PrepareOptions {
        kernel_package: prep
            .kernel_package
            .clone()
            .or_else(|| config.kernel_package.clone()),
        install: !prep.no_install,
        verbose: true,
    };
    match cli.command {
        Cmd::Prepare { prep } => {
            let prepared = prepare(&workdir, &prep_options(&prep, &config))?;
            println!(
                "kernel:    {} ({})",
                prepared.kernel_release, prepared.kernel_package
            );
            println!("vmlinuz:   {}", prepared.vmlinuz.display());
            println!("initramfs: {}", prepared.base_initramfs.display());
            println!("modules:   {}", prepared.modules.join(" "));
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Up { prep, overrides } => {
            overrides.apply(&mut config);
            config.validate()?;
            let prepared = prepare(&workdir, &prep_options(&prep, &config))?;
            let expect = match config.machine.accel {
                Accel::Tcg => "under TCG, 10-30 s",
                Accel::Kvm => "under KVM",
            };
            eprintln!("kv-vm: booting instance {} ({expect})", config.instance);
            let instance = Vm::boot_detached(&config, &prepared)?;
            println!(
                "kv-vm: instance {} ready in {:.1} s (qemu pid {})",
                instance.config.instance, instance.info.boot_secs, instance.pid
            );
            print!("{}", instance.info.describe(&instance.paths));
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Down => match Instance::open(&workdir, &config.instance) {
            Ok(instance) => {
                let pid = instance.pid;
                instance.down()?;
                println!(
                    "kv-vm: instance {} stopped (qemu pid {pid})",
                    config.instance
                );
                Ok(ExitCode::SUCCESS)
            }
            Err(VmError::NotRunning(name)) => {
                println!("kv-vm: instance {name} is not running");
                Ok(ExitCode::SUCCESS)
            }
            Err(e) => Err(e),
        },
        Cmd::Status => match Instance::open(&workdir, &config.instance) {
            Ok(instance) => {
                let agent = match instance.exec("true", Duration::from_secs(5)) {
                    Ok(out) if out.success() => "responsive".to_owned(),
                    Ok(out) => format!("answered with status {}", out.status),
                    Err(e) => format!("not answering ({e})"),
                };
                println!(
                    "kv-vm: instance {} running (qemu pid {}), control agent {agent}",
                    instance.config.instance, instance.pid
                );
                print!("{}", instance.info.describe(&instance.paths));
                Ok(ExitCode::SUCCESS)
            }
            Err(VmError::NotRunning(name)) => {
                let log = workdir.run(&name).console_log;
                println!("kv-vm: instance {name} is not running");
                if log.exists() {
                    println!("  last console log: {}", log.display());
                }
                Ok(ExitCode::from(3))
            }
            Err(e) => Err(e),
        },
        Cmd::Exec { timeout, command } => {
            let instance = Instance::open(&workdir, &config.instance)?;
            let out = instance.exec(&command.join(" "), Duration::from_secs(timeout))?;
            let _ = std::io::stdout().write_all(&out.stdout);
            let _ = std::io::stderr().write_all(&out.stderr);
            Ok(ExitCode::from(u8::try_from(out.status).unwrap_or(1)))
        }
        Cmd::Console => {
            let instance = Instance::open(&workdir, &config.instance)?;
            console(&instance)?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Config { overrides } => {
            overrides.apply(&mut config);
            print!("{}", config.to_toml());
            config.validate()?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// Ctrl-] ends a console session, as in telnet.
const CONSOLE_ESCAPE: u8 = 0x1d;

fn console(instance: &Instance) -> Result<(), VmError> {
    let path = &instance.paths.console_sock;
    let stream = UnixStream::connect(path)
        .map_err(|e| VmError::io(format!("connecting to {}", path.display()), e))?;
    let mut from_vm = stream
        .try_clone()
        .map_err(|e| VmError::io("cloning the console socket", e))?;
    eprintln!(
        "kv-vm: console of {} (press Enter for a prompt; Ctrl-] leaves)",
        instance.config.instance
    );
    let _raw = RawTerminal::enter();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        let mut out = std::io::stdout();
        while let Ok(n) = from_vm.read(&mut buf) {
            if n == 0 || out.write_all(&buf[..n]).and_then(|_| out.flush()).is_err() {
                break;
            }
        }
    });
    let mut to_vm = stream;
    let mut buf = [0u8; 1024];
    let mut stdin = std::io::stdin();
    loop {
        let n = stdin
            .read(&mut buf)
            .map_err(|e| VmError::io("reading stdin", e))?;
        if n == 0 {
            break;
        }
        let chunk = &buf[..n];
        let (chunk, quit) = match chunk.iter().position(|&b| b == CONSOLE_ESCAPE) {
            Some(at) => (&chunk[..at], true),
            None => (chunk, false),
        };
        if to_vm.write_all(chunk).is_err() || quit {
            break;
        }
    }
    eprintln!("\r\nkv-vm: console closed");
    Ok(())
}

/// Puts the controlling terminal into raw mode for the console session and
/// restores it on drop. Does nothing when stdin is not a terminal.
struct RawTerminal(Option<libc::termios>);

impl RawTerminal {
    fn enter() -> RawTerminal {
        if !std::io::stdin().is_terminal() {
            return RawTerminal(None);
        }
        let mut saved = std::mem::MaybeUninit::<libc::termios>::uninit();
        // SAFETY: tcgetattr fills the termios on success; we use it only then.
        if unsafe { libc::tcgetattr(libc::STDIN_FILENO, saved.as_mut_ptr()) } != 0 {
            return RawTerminal(None);
        }
        // SAFETY: initialised by the successful tcgetattr above.
        let saved = unsafe { saved.assume_init() };
        let mut raw = saved;
        // SAFETY: cfmakeraw only edits the struct we pass.
        unsafe { libc::cfmakeraw(&mut raw) };
        // SAFETY: sets stdin's attributes from a valid termios.
        if unsafe { libc::tcsetattr(libc::STDIN_FILENO, libc::TCSANOW, &raw) } != 0 {
            return RawTerminal(None);
        }
        RawTerminal(Some(saved))
    }
}

impl Drop for RawTerminal {
    fn drop(&mut self) {
        if let Some(saved) = &self.0 {
            // SAFETY: restores the attributes read in `enter`.
            unsafe { libc::tcsetattr(libc::STDIN_FILENO, libc::TCSANOW, saved) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lun_specs_parse() {
        assert_eq!(
            parse_lun("rd_mcp:64M").unwrap(),
            LunConfig {
                backstore: Backstore::RdMcp,
                size_mib: 64,
                block_size: 512
            }
        );
        assert_eq!(
            parse_lun("fileio:1G:4096").unwrap(),
            LunConfig {
                backstore: Backstore::Fileio,
                size_mib: 1024,
                block_size: 4096
            }
        );
        assert_eq!(parse_lun("ram:16").unwrap().size_mib, 16);
        for bad in [
            "disk:1M",
            "rd_mcp",
            "rd_mcp:1T",
            "rd_mcp:x",
            "rd_mcp:1M:512:9",
        ] {
            assert!(parse_lun(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn flags_override_the_file() {
        let cli = Cli::parse_from([
            "kv-vm",
            "up",
            "--memory",
            "1024",
            "--lun",
            "fileio:128M",
            "--rdma-cm-port",
            "6000",
            "--srpt-acl",
            "0x1",
            "--srpt-wwn",
            "gid",
            "--iser-param",
            "ImmediateData=No",
            "--no-demo-mode",
            "--iser-acl",
            "iqn.1991-05.com.microsoft:host",
        ]);
        let Cmd::Up { overrides, .. } = cli.command else {
            panic!("not up")
        };
        let mut c = VmConfig::default();
        overrides.apply(&mut c);
        assert_eq!(c.machine.memory_mib, 1024);
        assert_eq!(c.luns.len(), 1);
        assert_eq!(c.srpt.rdma_cm_port, 6000);
        assert_eq!(c.srpt.wwn, SrptWwnForm::Gid);
        assert_eq!(c.srpt.acls, Some(vec!["0x1".to_owned()]));
        assert_eq!(
            c.iser.parameters.get("ImmediateData").map(String::as_str),
            Some("No")
        );
        assert!(!c.iser.demo_mode);
        c.validate().unwrap();
    }

    #[test]
    fn exec_takes_the_rest_of_the_line() {
        let cli = Cli::parse_from([
            "kv-vm",
            "-i",
            "x",
            "exec",
            "--timeout",
            "5",
            "ls",
            "-l",
            "/sys",
        ]);
        assert_eq!(cli.instance.as_deref(), Some("x"));
        match cli.command {
            Cmd::Exec { timeout, command } => {
                assert_eq!(timeout, 5);
                assert_eq!(command, ["ls", "-l", "/sys"]);
            }
            other => panic!("{other:?}"),
        }
    }
}
