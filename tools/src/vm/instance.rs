//! Booting, watching, commanding and stopping one VM.

use std::net::Ipv4Addr;
use std::os::unix::net::UnixDatagram;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::config::{Accel, Backstore, VmConfig};
use super::control::{ControlChannel, ExecOutput};
use super::ethernet::MacAddr;
use super::prepare::{Prepared, pack_cpio, write_file};
use super::process;
use super::{RunPaths, VmError, WorkDir, log_tail};

/// Limit for one command in the guest unless the caller names another.
pub const DEFAULT_EXEC_TIMEOUT: Duration = Duration::from_secs(60);
/// How long `down` waits for qemu to leave after SIGTERM before SIGKILL.
const TERM_GRACE: Duration = Duration::from_secs(5);
/// Lines of console log quoted in boot errors.
const TAIL_LINES: usize = 25;
/// Longest path a unix socket address can hold (sun_path, with its NUL).
const SUN_PATH_MAX: usize = 107;

/// Guest marker lines (see `guest/init.sh`).
const READY_MARKER: &str = "KVVM-READY";
const INFO_MARKER: &str = "KVVM-INFO ";
const FAIL_MARKER: &str = "KVVM-FAIL step=";
const FAIL_END_MARKER: &str = "KVVM-FAIL-END";

/// What an initiator needs to know about the running targets.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TargetInfo {
    /// Instance name.
    pub instance: String,
    /// Debian package of the guest kernel.
    pub kernel_package: String,
    /// Guest `uname -r`.
    pub kernel_release: String,
    /// Guest NIC MAC.
    pub vm_mac: MacAddr,
    /// Guest IPv4 address.
    pub vm_ip: Ipv4Addr,
    /// MAC the host end is expected to use.
    pub host_mac: MacAddr,
    /// Host (initiator) IPv4 address.
    pub host_ip: Ipv4Addr,
    /// Subnet prefix length.
    pub prefix_len: u8,
    /// rxe0 node GUID as sysfs prints it (`5054:00ff:fe12:3456`).
    pub node_guid: String,
    /// rxe0 GID 0 as sysfs prints it (link-local, from the GUID).
    pub gid0: String,
    /// GID table index of the VM's IPv4 address as a RoCE v2 GID.
    pub ipv4_gid_index: u32,
    /// The SRP target, if enabled.
    pub srpt: Option<SrptInfo>,
    /// The iSCSI/iSER target, if enabled.
    pub iser: Option<IserInfo>,
    /// The LUNs, exported as `lun_<index>` by every enabled target.
    pub luns: Vec<LunInfo>,
    /// Seconds from qemu start to ready.
    pub boot_secs: f64,
}

/// The SRP target as an initiator addresses it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SrptInfo {
    /// Configfs name of the target port (`/sys/kernel/config/target/srpt/<wwn>`).
    pub wwn: String,
    /// Largest SRP request IU the target accepts (`srp_max_req_size`); a
    /// login asking for a larger `req_it_iu_len` is rejected.
    pub srp_max_req_size: u32,
    /// RDMA/CM port.
    pub rdma_cm_port: u16,
    /// CM service id: `0x0106_0000 | rdma_cm_port` (RDMA_PS_TCP).
    pub service_id: u64,
    /// SRP target_port_id: the service GUID (node GUID) twice, 32 hex digits.
    pub target_port_id: String,
    /// Node ACL names that may log in.
    pub acls: Vec<String>,
}

/// The iSCSI target with the iSER portal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IserInfo {
    /// Target IQN.
    pub target_iqn: String,
    /// Portal address.
    pub portal_ip: Ipv4Addr,
    /// Portal port.
    pub portal_port: u16,
    /// CM service id: `0x0106_0000 | portal_port`.
    pub service_id: u64,
    /// Any initiator may log in.
    pub demo_mode: bool,
    /// Initiator IQNs with explicit ACLs.
    pub acls: Vec<String>,
}

/// One exported LUN.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LunInfo {
    /// LUN number.
    pub lun: u32,
    /// Backstore kind.
    pub backstore: Backstore,
    /// Capacity in bytes.
    pub size_bytes: u64,
    /// Logical block size.
    pub block_size: u32,
    /// VPD page 0x80 unit serial number (`kvvm-lun<n>`).
    pub unit_serial: String,
    /// Backstore directory below `/sys/kernel/config/target/`.
    pub configfs: String,
}

/// RDMA/CM port space of TCP-like connections (RDMA_PS_TCP), the high half of
/// a CM service id.
const RDMA_PS_TCP_SERVICE_BASE: u64 = 0x0106 << 16;

impl TargetInfo {
    fn new(
        config: &VmConfig,
        prepared: &Prepared,
        facts: &GuestFacts,
        boot_secs: f64,
    ) -> Result<Self, VmError> {
        let guid_hex: String = facts.node_guid.chars().filter(|c| *c != ':').collect();
        if guid_hex.len() != 16 || !guid_hex.chars().all(|c| c.is_ascii_hexdigit()) {
            return Err(VmError::Control(format!(
                "guest reported node GUID {:?}",
                facts.node_guid
            )));
        }
        let n = &config.network;
        Ok(TargetInfo {
            instance: config.instance.clone(),
            kernel_package: prepared.kernel_package.clone(),
            kernel_release: facts.kernel_release.clone(),
            vm_mac: n.vm_mac,
            vm_ip: n.vm_ip,
            host_mac: n.host_mac,
            host_ip: n.host_ip,
            prefix_len: n.prefix_len,
            node_guid: facts.node_guid.clone(),
            gid0: facts.gid0.clone(),
            ipv4_gid_index: facts.ipv4_gid_index,
            srpt: config.srpt.enabled.then(|| SrptInfo {
                wwn: facts.srpt_wwn.clone(),
                srp_max_req_size: facts.srp_max_req_size,
                rdma_cm_port: config.srpt.rdma_cm_port,
                service_id: RDMA_PS_TCP_SERVICE_BASE | u64::from(config.srpt.rdma_cm_port),
                target_port_id: format!("0x{guid_hex}{guid_hex}"),
                acls: config.srpt_acls(),
            }),
            iser: config.iser.enabled.then(|| IserInfo {
                target_iqn: config.iser.target_iqn.clone(),
                portal_ip: config.iser_portal_ip(),
                portal_port: config.iser.portal_port,
                service_id: RDMA_PS_TCP_SERVICE_BASE | u64::from(config.iser.portal_port),
                demo_mode: config.iser.demo_mode,
                acls: config.iser.acls.clone(),
            }),
            luns: config
                .luns
                .iter()
                .enumerate()
                .map(|(i, l)| LunInfo {
                    lun: i as u32,
                    backstore: l.backstore,
                    size_bytes: u64::from(l.size_mib) << 20,
                    block_size: l.block_size,
                    unit_serial: format!("kvvm-lun{i}"),
                    configfs: match l.backstore {
                        Backstore::RdMcp => format!("core/rd_mcp_{i}/ram{i}"),
                        Backstore::Fileio => format!("core/fileio_{i}/file{i}"),
                    },
                })
                .collect(),
            boot_secs,
        })
    }

    /// A human-readable summary with everything an initiator needs.
    pub fn describe(&self, paths: &RunPaths) -> String {
        let mut s = String::new();
        let mut line = |k: &str, v: String| s.push_str(&format!("  {k:<15} {v}\n"));
        line(
            "kernel",
            format!("{} ({})", self.kernel_release, self.kernel_package),
        );
        line(
            "frame socket",
            format!(
                "bind {} (unix datagram), send to {}",
                paths.host_sock.display(),
                paths.qemu_sock.display()
            ),
        );
        line("", "one Ethernet frame per datagram, no FCS".to_owned());
        line(
            "vm",
            format!("{} {}/{}", self.vm_mac, self.vm_ip, self.prefix_len),
        );
        line("host", format!("{} {}", self.host_mac, self.host_ip));
        line(
            "rxe0",
            format!(
                "node GUID {}, GID0 {}, IPv4 RoCE v2 GID index {}",
                self.node_guid, self.gid0, self.ipv4_gid_index
            ),
        );
        if let Some(t) = &self.srpt {
            line(
                "srpt",
                format!(
                    "wwn {}, RDMA/CM port {}, service id {:#018x}",
                    t.wwn, t.rdma_cm_port, t.service_id
                ),
            );
            line(
                "",
                format!(
                    "target_port_id {}, srp_max_req_size {}, ACLs {}",
                    t.target_port_id,
                    t.srp_max_req_size,
                    t.acls.join(" ")
                ),
            );
        }
        if let Some(t) = &self.iser {
            line(
                "iser",
                format!(
                    "{} portal {}:{}, service id {:#018x}",
                    t.target_iqn, t.portal_ip, t.portal_port, t.service_id
                ),
            );
            let acl = if t.demo_mode {
                "demo mode (any initiator)".to_owned()
            } else {
                String::new()
            };
            line("", format!("{acl} {}", t.acls.join(" ")).trim().to_owned());
        }
        for l in &self.luns {
            line(
                &format!("lun {}", l.lun),
                format!(
                    "{} {} MiB, {} B blocks, serial {} ({})",
                    l.backstore.lio_name(),
                    l.size_bytes >> 20,
                    l.block_size,
                    l.unit_serial,
                    l.configfs
                ),
            );
        }
        line(
            "console",
            format!(
                "{} (log {})",
                paths.console_sock.display(),
                paths.console_log.display()
            ),
        );
        line("control", paths.control_sock.display().to_string());
        line(
            "state",
            format!("{} (TOML, for programs)", paths.state.display()),
        );
        s
    }
}

/// Facts the guest printed in its `KVVM-INFO` lines.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct GuestFacts {
    kernel_release: String,
    node_guid: String,
    gid0: String,
    ipv4_gid_index: u32,
    srpt_wwn: String,
    srp_max_req_size: u32,
}

/// What the console log says so far.
#[derive(Debug, Clone, PartialEq, Eq)]
enum ConsoleState {
    Booting,
    Ready(GuestFacts),
    /// A step failed; `complete` once its report has ended.
    Failed {
        step: String,
        detail: String,
        complete: bool,
    },
}

fn scan_console(text: &str) -> Result<ConsoleState, VmError> {
    let text = text.replace('\r', "");
    let mut facts = GuestFacts::default();
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        if let Some(rest) = line.strip_prefix(FAIL_MARKER) {
            let (step, rc) = match rest.rsplit_once(" rc=") {
                Some((step, rc)) => (step.to_owned(), rc.to_owned()),
                None => (rest.to_owned(), "?".to_owned()),
            };
            let mut detail = format!("  exit status {rc}\n");
            let mut complete = false;
            for l in lines.by_ref() {
                if l == FAIL_END_MARKER {
                    complete = true;
                    break;
                }
                detail.push_str("  | ");
                detail.push_str(l);
                detail.push('\n');
            }
            return Ok(ConsoleState::Failed {
                step,
                detail,
                complete,
            });
        }
        if let Some(kv) = line.strip_prefix(INFO_MARKER) {
            let (key, value) = kv.split_once('=').unwrap_or((kv, ""));
            let value = value.trim().to_owned();
            match key {
                "kernel" => facts.kernel_release = value,
                "node_guid" => facts.node_guid = value,
                "gid0" => facts.gid0 = value,
                "ipv4_gid_index" => {
                    facts.ipv4_gid_index = value.parse().map_err(|_| {
                        VmError::Control(format!("guest reported GID index {value:?}"))
                    })?
                }
                "srpt_wwn" => facts.srpt_wwn = value,
                "srp_max_req_size" => {
                    facts.srp_max_req_size = value.parse().map_err(|_| {
                        VmError::Control(format!("guest reported srp_max_req_size {value:?}"))
                    })?
                }
                _ => {}
            }
        }
        if line.starts_with(READY_MARKER) {
            return Ok(ConsoleState::Ready(facts));
        }
    }
    Ok(ConsoleState::Booting)
}

/// The state file of a running instance (`state.toml`).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct StateFile {
    pid: u32,
    config: VmConfig,
    info: TargetInfo,
}

/// A booted VM owned by this process: dropping it kills qemu, and qemu also
/// dies with this process (`PR_SET_PDEATHSIG`), so a crashed test leaves no
/// VM behind.
pub struct Vm {
    child: Option<Child>,
    pid: u32,
    paths: RunPaths,
    config: VmConfig,
    info: TargetInfo,
    link: Option<UnixDatagram>,
    control: Mutex<Option<ControlChannel>>,
}

impl std::fmt::Debug for Vm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vm")
            .field("instance", &self.config.instance)
            .field("pid", &self.pid)
            .finish_non_exhaustive()
    }
}

impl Vm {
    /// Boots a VM for `config` and waits until its targets are ready. The
    /// host end of the link is bound at [`RunPaths::host_sock`] and
    /// connected to qemu's end; take it with [`Vm::take_link`].
    ///
    /// Blocks for the boot (10-20 s under TCG; at most
    /// `config.machine.ready_timeout_secs`).
    pub fn boot(config: &VmConfig, prepared: &Prepared) -> Result<Vm, VmError> {
        Self::launch(config, prepared, LaunchMode::Owned)
    }

    /// Boots a VM that outlives this process (what `kv-vm up` does) and
    /// returns its handle once ready. The host socket is left for the caller
    /// to bind.
    pub fn boot_detached(config: &VmConfig, prepared: &Prepared) -> Result<Instance, VmError> {
        let vm = Self::launch(config, prepared, LaunchMode::Detached)?;
        Ok(vm.detach())
    }

    fn launch(config: &VmConfig, prepared: &Prepared, mode: LaunchMode) -> Result<Vm, VmError> {
        config.validate()?;
        let paths = prepared.workdir.run(&config.instance);
        if let Ok(running) = Instance::open(&prepared.workdir, &config.instance) {
            return Err(VmError::AlreadyRunning {
                instance: config.instance.clone(),
                pid: running.pid,
            });
        }
        prepare_run_dir(&paths)?;
        build_initrd(config, prepared, &paths)?;

        // The host end exists before qemu starts, so no early frame is lost.
        let link =
            match mode {
                LaunchMode::Owned => Some(UnixDatagram::bind(&paths.host_sock).map_err(|e| {
                    VmError::io(format!("binding {}", paths.host_sock.display()), e)
                })?),
                LaunchMode::Detached => None,
            };

        let mut cmd = qemu_command(config, prepared, &paths);
        let output = std::fs::File::create(&paths.qemu_output)
            .map_err(|e| VmError::io(format!("creating {}", paths.qemu_output.display()), e))?;
        let output_err = output
            .try_clone()
            .map_err(|e| VmError::io("duplicating qemu's output file", e))?;
        cmd.stdin(Stdio::null()).stdout(output).stderr(output_err);
        let started = Instant::now();
        let child = match mode {
            LaunchMode::Owned => spawn_tied_to_process(cmd),
            LaunchMode::Detached => {
                // SAFETY: the hook only calls setsid, which is
                // async-signal-safe, and allocates nothing.
                unsafe { cmd.pre_exec(new_session) };
                cmd.spawn()
            }
        }
        .map_err(|e| VmError::io(format!("starting {}", prepared.qemu.display()), e))?;
        let pid = child.id();
        let mut vm = Vm {
            child: Some(child),
            pid,
            paths,
            config: config.clone(),
            info: placeholder_info(config, prepared),
            link,
            control: Mutex::new(None),
        };
        let facts = match vm.wait_ready(started) {
            Ok(facts) => facts,
            Err(e) => {
                let keep = mode == LaunchMode::Detached
                    && config.machine.keep_on_failure
                    && matches!(e, VmError::SetupFailed { .. });
                if keep {
                    eprintln!(
                        "kv-vm: keeping the failed VM running (pid {pid}); `kv-vm console` to look, `kv-vm down` to stop"
                    );
                    let _ = vm.write_state();
                    drop(vm.detach());
                } else {
                    vm.kill();
                }
                return Err(e);
            }
        };
        vm.info = TargetInfo::new(config, prepared, &facts, started.elapsed().as_secs_f64())?;
        if let Some(link) = &vm.link {
            link.connect(&vm.paths.qemu_sock).map_err(|e| {
                VmError::io(format!("connecting to {}", vm.paths.qemu_sock.display()), e)
            })?;
        }
        vm.write_state()?;
        Ok(vm)
    }

    fn wait_ready(&mut self, started: Instant) -> Result<GuestFacts, VmError> {
        let limit = Duration::from_secs(self.config.machine.ready_timeout_secs);
        let mut fail_seen: Option<Instant> = None;
        loop {
            let text = std::fs::read(&self.paths.console_log)
                .map(|b| String::from_utf8_lossy(&b).into_owned());
            let state = scan_console(text.as_deref().unwrap_or(""))?;
            match state {
                ConsoleState::Ready(facts) => return Ok(facts),
                ConsoleState::Failed {
                    step,
                    detail,
                    complete,
                } => {
                    // Give the guest a moment to finish its report.
                    let first = *fail_seen.get_or_insert_with(Instant::now);
                    if complete
                        || first.elapsed() > Duration::from_secs(5)
                        || self.exited().is_some()
                    {
                        return Err(VmError::SetupFailed {
                            instance: self.config.instance.clone(),
                            step,
                            detail,
                            log: self.paths.console_log.clone(),
                        });
                    }
                }
                ConsoleState::Booting => {}
            }
            if let Some(status) = self.exited() {
                // Pick up lines written just before the exit.
                if let Ok(ConsoleState::Failed { step, detail, .. }) =
                    scan_console(&String::from_utf8_lossy(
                        &std::fs::read(&self.paths.console_log).unwrap_or_default(),
                    ))
                {
                    return Err(VmError::SetupFailed {
                        instance: self.config.instance.clone(),
                        step,
                        detail,
                        log: self.paths.console_log.clone(),
                    });
                }
                let stderr = std::fs::read_to_string(&self.paths.qemu_output).unwrap_or_default();
                let stderr: String = stderr
                    .lines()
                    .rev()
                    .take(15)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .map(|l| format!("  qemu: {l}\n"))
                    .collect();
                return Err(VmError::QemuExited {
                    instance: self.config.instance.clone(),
                    status,
                    stderr,
                    log: self.paths.console_log.clone(),
                    tail: log_tail(&self.paths.console_log, TAIL_LINES),
                });
            }
            if started.elapsed() > limit {
                return Err(VmError::BootTimeout {
                    instance: self.config.instance.clone(),
                    secs: limit.as_secs(),
                    log: self.paths.console_log.clone(),
                    tail: log_tail(&self.paths.console_log, TAIL_LINES),
                });
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Exit status if qemu has exited.
    fn exited(&mut self) -> Option<String> {
        match self.child.as_mut().map(|c| c.try_wait()) {
            Some(Ok(Some(status))) => Some(status.to_string()),
            Some(Ok(None)) => None,
            Some(Err(e)) => Some(format!("wait failed: {e}")),
            None => Some("not a child of this process".to_owned()),
        }
    }

    fn write_state(&self) -> Result<(), VmError> {
        let state = StateFile {
            pid: self.pid,
            config: self.config.clone(),
            info: self.info.clone(),
        };
        let text = toml::to_string_pretty(&state)
            .map_err(|e| VmError::Host(format!("serialising state: {e}")))?;
        let tmp = self.paths.state.with_extension("toml.partial");
        std::fs::write(&tmp, text)
            .map_err(|e| VmError::io(format!("writing {}", tmp.display()), e))?;
        std::fs::rename(&tmp, &self.paths.state)
            .map_err(|e| VmError::io("moving the state file into place", e))
    }

    /// Kills qemu (if it is still ours), reaps it and removes the sockets and
    /// the state file; the logs stay.
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.link = None;
        remove_run_files(&self.paths);
    }

    /// Hands the running VM over to an [`Instance`] (it keeps running after
    /// this process exits only if it was booted with [`Vm::boot_detached`]).
    fn detach(mut self) -> Instance {
        let _ = self.child.take();
        // With the child handle gone, Drop has nothing left to kill.
        Instance {
            pid: self.pid,
            paths: self.paths.clone(),
            config: self.config.clone(),
            info: self.info.clone(),
        }
    }

    /// What an initiator needs to know.
    pub fn info(&self) -> &TargetInfo {
        &self.info
    }

    /// The configuration it was booted with.
    pub fn config(&self) -> &VmConfig {
        &self.config
    }

    /// Its files (sockets, logs).
    pub fn paths(&self) -> &RunPaths {
        &self.paths
    }

    /// qemu's pid.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The host end of the Ethernet link (bound and connected), unless taken.
    pub fn link(&self) -> Option<&UnixDatagram> {
        self.link.as_ref()
    }

    /// Takes the host end of the link: a unix datagram socket bound at
    /// [`RunPaths::host_sock`], connected to qemu's end; one Ethernet frame
    /// per datagram in both directions.
    pub fn take_link(&mut self) -> Option<UnixDatagram> {
        self.link.take()
    }

    /// Runs a shell command in the guest (limit [`DEFAULT_EXEC_TIMEOUT`]).
    pub fn exec(&self, command: &str) -> Result<ExecOutput, VmError> {
        self.exec_timeout(command, DEFAULT_EXEC_TIMEOUT)
    }

    /// Runs a shell command in the guest, killed there after `limit`.
    pub fn exec_timeout(&self, command: &str, limit: Duration) -> Result<ExecOutput, VmError> {
        let mut guard = self
            .control
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if guard.is_none() {
            *guard = Some(ControlChannel::connect(&self.paths.control_sock)?);
        }
        let result = match guard.as_mut() {
            Some(channel) => channel.exec(command, limit),
            None => Err(VmError::Control("no control channel".to_owned())),
        };
        if result.is_err() {
            // Start afresh next time; a half-read answer is skipped by its id.
            *guard = None;
        }
        result
    }

    /// Runs a command and fails unless it exits 0; returns its stdout.
    pub fn exec_ok(&self, command: &str) -> Result<String, VmError> {
        checked(command, self.exec(command)?)
    }

    /// Stops the VM and waits for qemu to be gone.
    pub fn shutdown(mut self) {
        self.kill();
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        if self.child.is_some() {
            self.kill();
        }
    }
}

fn checked(command: &str, out: ExecOutput) -> Result<String, VmError> {
    if out.success() {
        Ok(out.stdout_text())
    } else {
        Err(VmError::Control(format!(
            "`{command}` exited with {} in the VM:\n{}{}",
            out.status,
            out.stdout_text(),
            out.stderr_text()
        )))
    }
}

fn placeholder_info(config: &VmConfig, prepared: &Prepared) -> TargetInfo {
    let facts = GuestFacts {
        node_guid: "0000:0000:0000:0000".to_owned(),
        ..GuestFacts::default()
    };
    // The GUID above is well-formed, so this cannot fail; fall back anyway.
    TargetInfo::new(config, prepared, &facts, 0.0).unwrap_or(TargetInfo {
        instance: config.instance.clone(),
        kernel_package: prepared.kernel_package.clone(),
        kernel_release: String::new(),
        vm_mac: config.network.vm_mac,
        vm_ip: config.network.vm_ip,
        host_mac: config.network.host_mac,
        host_ip: config.network.host_ip,
        prefix_len: config.network.prefix_len,
        node_guid: String::new(),
        gid0: String::new(),
        ipv4_gid_index: 0,
        srpt: None,
        iser: None,
        luns: Vec::new(),
        boot_secs: 0.0,
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LaunchMode {
    /// Killed with its `Vm` and with this process.
    Owned,
    /// Its own session; outlives this process.
    Detached,
}

/// Spawns `cmd` from one long-lived thread with `PR_SET_PDEATHSIG`, so the
/// child is killed when this process exits. (The signal follows the thread
/// that forked; a test thread that ends must not take a shared VM with it.)
fn spawn_tied_to_process(mut cmd: Command) -> std::io::Result<Child> {
    type Request = (Command, mpsc::Sender<std::io::Result<Child>>);
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<Request>>> = OnceLock::new();
    let parent = std::process::id();
    // SAFETY: the hook only calls async-signal-safe functions (prctl,
    // getppid, _exit) and allocates nothing.
    unsafe { cmd.pre_exec(move || die_with_parent(parent)) };
    let sender = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Request>();
        std::thread::Builder::new()
            .name("kv-vm-spawner".to_owned())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
            })
            .map(|_| ())
            .unwrap_or_else(|e| eprintln!("kv-vm: cannot start the spawner thread: {e}"));
        Mutex::new(tx)
    });
    let (reply_tx, reply_rx) = mpsc::channel();
    let sent = sender
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .send((cmd, reply_tx));
    if sent.is_err() {
        return Err(std::io::Error::other("the kv-vm spawner thread is gone"));
    }
    reply_rx
        .recv()
        .map_err(|_| std::io::Error::other("the kv-vm spawner thread did not answer"))?
}

/// Removes the sockets, the state file and the (large, reproducible)
/// initramfs of a stopped VM; the logs stay.
fn remove_run_files(paths: &RunPaths) {
    for path in [
        &paths.host_sock,
        &paths.qemu_sock,
        &paths.console_sock,
        &paths.control_sock,
        &paths.state,
        &paths.initrd,
        &paths.dir.join("config.cpio"),
    ] {
        let _ = std::fs::remove_file(path);
    }
}

/// In the forked child: start a new session, so the terminal's signals and
/// the exit of `kv-vm up` leave qemu alone.
fn new_session() -> std::io::Result<()> {
    // SAFETY: setsid has no memory-safety preconditions.
    if unsafe { libc::setsid() } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// In the forked child: ask for SIGKILL when the parent goes, and leave at
/// once if it already went before the request took effect.
fn die_with_parent(parent: u32) -> std::io::Result<()> {
    // SAFETY: prctl(PR_SET_PDEATHSIG) takes a plain signal number.
    if unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: getppid has no preconditions.
    let ppid = unsafe { libc::getppid() };
    if u32::try_from(ppid).ok() != Some(parent) {
        // SAFETY: _exit ends the child without running the parent's atexit
        // handlers, as a forked child must.
        unsafe { libc::_exit(1) };
    }
    Ok(())
}

/// Clears what a previous run left (keeping its console log as
/// `console.log.prev`) and checks that the socket paths fit.
fn prepare_run_dir(paths: &RunPaths) -> Result<(), VmError> {
    std::fs::create_dir_all(&paths.dir)
        .map_err(|e| VmError::io(format!("creating {}", paths.dir.display()), e))?;
    for sock in [
        &paths.host_sock,
        &paths.qemu_sock,
        &paths.console_sock,
        &paths.control_sock,
    ] {
        let len = sock.as_os_str().len();
        if len > SUN_PATH_MAX {
            return Err(VmError::Config(format!(
                "socket path {} is {len} bytes, more than a unix socket address holds ({SUN_PATH_MAX}); use a shorter work directory (--workdir or KV_VM_WORKDIR)",
                sock.display()
            )));
        }
        if sock.to_string_lossy().contains(',') {
            return Err(VmError::Config(format!(
                "path {} contains ',', which qemu options cannot carry",
                sock.display()
            )));
        }
    }
    if paths.console_log.exists() {
        let _ = std::fs::rename(&paths.console_log, paths.dir.join("console.log.prev"));
    }
    for path in [
        &paths.host_sock,
        &paths.qemu_sock,
        &paths.console_sock,
        &paths.control_sock,
        &paths.control_log,
        &paths.pidfile,
        &paths.state,
        &paths.qemu_output,
    ] {
        match std::fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(VmError::io(format!("removing {}", path.display()), e)),
        }
    }
    Ok(())
}

/// The boot's initramfs: the cached base archive followed by a small archive
/// with `/etc/kvvm/config.sh` (the kernel unpacks concatenated archives in order).
fn build_initrd(config: &VmConfig, prepared: &Prepared, paths: &RunPaths) -> Result<(), VmError> {
    let staging = paths.dir.join("config-root");
    let _ = std::fs::remove_dir_all(&staging);
    write_file(
        &staging.join("etc/kvvm/config.sh"),
        config.render_guest_config().as_bytes(),
        0o644,
    )?;
    let config_cpio = paths.dir.join("config.cpio");
    pack_cpio(&staging, &config_cpio)?;
    let _ = std::fs::remove_dir_all(&staging);
    let mut out = std::fs::File::create(&paths.initrd)
        .map_err(|e| VmError::io(format!("creating {}", paths.initrd.display()), e))?;
    for part in [&prepared.base_initramfs, &config_cpio] {
        let mut input = std::fs::File::open(part)
            .map_err(|e| VmError::io(format!("opening {}", part.display()), e))?;
        std::io::copy(&mut input, &mut out)
            .map_err(|e| VmError::io(format!("writing {}", paths.initrd.display()), e))?;
    }
    Ok(())
}

/// The qemu command line: TCG, no default devices, one virtio-net NIC on a
/// unix datagram socket pair, ttyS0 (console) and ttyS1 (agent) on unix
/// stream sockets with their output logged.
fn qemu_command(config: &VmConfig, prepared: &Prepared, paths: &RunPaths) -> Command {
    let m = &config.machine;
    let mut cmd = Command::new(&prepared.qemu);
    let p = |path: &Path| path.display().to_string();
    cmd.arg("-name").arg(format!("kv-vm-{}", config.instance));
    match m.accel {
        Accel::Tcg => {
            cmd.args(["-accel", "tcg,thread=multi", "-cpu", "max"]);
        }
        Accel::Kvm => {
            cmd.args(["-accel", "kvm", "-cpu", "host"]);
        }
    }
    cmd.args(["-machine", "pc", "-m"])
        .arg(m.memory_mib.to_string());
    cmd.arg("-smp").arg(m.cpus.to_string());
    cmd.args([
        "-display",
        "none",
        "-nodefaults",
        "-no-user-config",
        "-no-reboot",
    ]);
    cmd.arg("-kernel").arg(&prepared.vmlinuz);
    cmd.arg("-initrd").arg(&paths.initrd);
    cmd.arg("-append")
        .arg("console=ttyS0 quiet loglevel=4 panic=-1");
    cmd.arg("-netdev").arg(format!(
        "dgram,id=n0,local.type=unix,local.path={},remote.type=unix,remote.path={}",
        p(&paths.qemu_sock),
        p(&paths.host_sock)
    ));
    cmd.arg("-device").arg(format!(
        "virtio-net-pci,netdev=n0,mac={},romfile=",
        config.network.vm_mac
    ));
    cmd.arg("-chardev").arg(format!(
        "socket,id=con0,path={},server=on,wait=off,logfile={}",
        p(&paths.console_sock),
        p(&paths.console_log)
    ));
    cmd.args(["-serial", "chardev:con0"]);
    cmd.arg("-chardev").arg(format!(
        "socket,id=ctl0,path={},server=on,wait=off,logfile={}",
        p(&paths.control_sock),
        p(&paths.control_log)
    ));
    cmd.args(["-serial", "chardev:ctl0"]);
    cmd.arg("-pidfile").arg(&paths.pidfile);
    cmd
}

/// A running VM found through its state file (what the CLI works with).
#[derive(Debug, Clone)]
pub struct Instance {
    /// qemu's pid.
    pub pid: u32,
    /// Its files.
    pub paths: RunPaths,
    /// The configuration it was booted with.
    pub config: VmConfig,
    /// What an initiator needs to know.
    pub info: TargetInfo,
}

impl Instance {
    /// Finds the running instance `name`; [`VmError::NotRunning`] if there is
    /// none (a stale state file is removed).
    pub fn open(workdir: &WorkDir, name: &str) -> Result<Instance, VmError> {
        let paths = workdir.run(name);
        let text = match std::fs::read_to_string(&paths.state) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(VmError::NotRunning(name.to_owned()));
            }
            Err(e) => return Err(VmError::io(format!("reading {}", paths.state.display()), e)),
        };
        let state: StateFile = toml::from_str(&text)
            .map_err(|e| VmError::Host(format!("{}: {}", paths.state.display(), e.message())))?;
        let instance = Instance {
            pid: state.pid,
            paths,
            config: state.config,
            info: state.info,
        };
        if !instance.is_alive() {
            let _ = std::fs::remove_file(&instance.paths.state);
            return Err(VmError::NotRunning(name.to_owned()));
        }
        Ok(instance)
    }

    /// True while its qemu process exists.
    pub fn is_alive(&self) -> bool {
        process::process_matches(self.pid, self.paths.dir.as_os_str())
    }

    /// Runs a shell command in the guest, killed there after `limit`.
    pub fn exec(&self, command: &str, limit: Duration) -> Result<ExecOutput, VmError> {
        ControlChannel::connect(&self.paths.control_sock)?.exec(command, limit)
    }

    /// Stops qemu (SIGTERM, then SIGKILL) and removes sockets and state.
    pub fn down(self) -> Result<(), VmError> {
        if self.is_alive() {
            process::signal(self.pid, libc::SIGTERM)
                .map_err(|e| VmError::io(format!("signalling qemu {}", self.pid), e))?;
            let start = Instant::now();
            while self.is_alive() && start.elapsed() < TERM_GRACE {
                std::thread::sleep(Duration::from_millis(50));
            }
            if self.is_alive() {
                let _ = process::signal(self.pid, libc::SIGKILL);
                let start = Instant::now();
                while self.is_alive() && start.elapsed() < TERM_GRACE {
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
            if self.is_alive() {
                return Err(VmError::Host(format!("qemu pid {} does not die", self.pid)));
            }
        }
        remove_run_files(&self.paths);
        Ok(())
    }

    /// Where its console log is.
    pub fn console_log(&self) -> PathBuf {
        self.paths.console_log.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn console_scan_finds_ready_and_facts() {
        let log = "SeaBIOS\r\nkvvm: init started\r\nKVVM-INFO kernel=6.1.0-56-amd64\r\n\
KVVM-INFO node_guid=5054:00ff:fe12:3456\r\nKVVM-INFO gid0=fe80:0000:0000:0000:5054:00ff:fe12:3456\r\n\
KVVM-INFO ipv4_gid_index=1\r\nKVVM-INFO srpt_wwn=5054:00ff:fe12:3456\r\n\
KVVM-INFO srp_max_req_size=8276\r\nKVVM-READY uptime=9.1\r\n";
        let facts = match scan_console(log).unwrap() {
            ConsoleState::Ready(f) => f,
            other => panic!("{other:?}"),
        };
        assert_eq!(facts.kernel_release, "6.1.0-56-amd64");
        assert_eq!(facts.ipv4_gid_index, 1);
        assert_eq!(facts.srpt_wwn, "5054:00ff:fe12:3456");
        assert_eq!(facts.srp_max_req_size, 8276);
        assert_eq!(
            scan_console("SeaBIOS\nkvvm: init\n").unwrap(),
            ConsoleState::Booting
        );
        assert!(scan_console("KVVM-INFO ipv4_gid_index=x\nKVVM-READY\n").is_err());
    }

    #[test]
    fn console_scan_reports_the_failed_step() {
        let partial = "KVVM-FAIL step=iscsi: portal 10.0.0.9:3260 rc=1\nmkdir: can't create\n";
        match scan_console(partial).unwrap() {
            ConsoleState::Failed {
                step,
                detail,
                complete,
            } => {
                assert_eq!(step, "iscsi: portal 10.0.0.9:3260");
                assert!(
                    detail.contains("exit status 1") && detail.contains("| mkdir: can't create")
                );
                assert!(!complete);
            }
            other => panic!("{other:?}"),
        }
        let full = format!("{partial}--- kernel log (tail)\nKVVM-FAIL-END\nKVVM-READY\n");
        assert!(matches!(
            scan_console(&full).unwrap(),
            ConsoleState::Failed { complete: true, .. }
        ));
    }

    fn prepared_for_tests(root: &Path) -> Prepared {
        Prepared {
            workdir: WorkDir::new(root),
            kernel_package: "linux-image-6.1.0-56-amd64".into(),
            kernel_release: "6.1.0-56-amd64".into(),
            vmlinuz: root.join("vmlinuz"),
            base_initramfs: root.join("base.cpio"),
            modules: vec![],
            qemu: PathBuf::from("/usr/bin/qemu-system-x86_64"),
        }
    }

    #[test]
    fn qemu_command_uses_only_unix_sockets() {
        let root = Path::new("/w");
        let config = VmConfig::default();
        let prepared = prepared_for_tests(root);
        let paths = prepared.workdir.run("default");
        let cmd = qemu_command(&config, &prepared, &paths);
        let line = process::describe(&cmd);
        assert!(line.contains("-accel tcg,thread=multi"));
        assert!(line.contains(
            "-netdev dgram,id=n0,local.type=unix,local.path=/w/run/default/qemu.sock,remote.type=unix,remote.path=/w/run/default/host.sock"
        ));
        assert!(line.contains("virtio-net-pci,netdev=n0,mac=52:54:00:12:34:56,romfile="));
        assert!(line.contains("-nodefaults"));
        // One netdev, unix datagram sockets only: no user-mode networking,
        // tap, or inet socket.
        let args: Vec<String> = cmd
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        let netdevs: Vec<&String> = args
            .windows(2)
            .filter(|w| w[0] == "-netdev")
            .map(|w| &w[1])
            .collect();
        assert_eq!(netdevs.len(), 1);
        assert!(netdevs[0].starts_with("dgram,"));
        assert_eq!(netdevs[0].matches(".type=unix").count(), 2);
        for banned in ["-net", "-nic", "inet", "tap", "hostfwd", "127.0.0.1"] {
            assert!(
                !args
                    .iter()
                    .any(|a| a == banned || a.contains(&format!("{banned},"))),
                "{banned}"
            );
        }
        assert!(!line.contains("inet") && !line.contains("tap,"), "{line}");
    }

    #[test]
    fn target_info_derives_ids() {
        let config = VmConfig::default();
        let prepared = prepared_for_tests(Path::new("/w"));
        let facts = GuestFacts {
            kernel_release: "6.1.0-56-amd64".into(),
            node_guid: "5054:00ff:fe12:3456".into(),
            gid0: "fe80:0000:0000:0000:5054:00ff:fe12:3456".into(),
            ipv4_gid_index: 1,
            srpt_wwn: "5054:00ff:fe12:3456".into(),
            srp_max_req_size: 8276,
        };
        let info = TargetInfo::new(&config, &prepared, &facts, 12.0).unwrap();
        let srpt = info.srpt.as_ref().unwrap();
        assert_eq!(srpt.service_id, 0x0000_0000_0106_15b3);
        assert_eq!(srpt.target_port_id, "0x505400fffe123456505400fffe123456");
        assert_eq!(srpt.acls, vec!["10.0.0.2"]);
        let iser = info.iser.as_ref().unwrap();
        assert_eq!(iser.service_id, 0x0000_0000_0106_0cbc);
        assert_eq!(info.luns[1].configfs, "core/fileio_1/file1");
        assert_eq!(info.luns[0].size_bytes, 32 << 20);
        let text = info.describe(&prepared.workdir.run("default"));
        assert!(text.contains("service id 0x00000000010615b3"), "{text}");
        let bad = GuestFacts {
            node_guid: "zz".into(),
            ..facts
        };
        assert!(TargetInfo::new(&config, &prepared, &bad, 0.0).is_err());
    }

    #[test]
    fn state_file_round_trips() {
        let config = VmConfig::default();
        let prepared = prepared_for_tests(Path::new("/w"));
        let state = StateFile {
            pid: 42,
            config: config.clone(),
            info: placeholder_info(&config, &prepared),
        };
        let text = toml::to_string_pretty(&state).unwrap();
        let back: StateFile = toml::from_str(&text).unwrap();
        assert_eq!(back.pid, 42);
        assert_eq!(back.config, config);
        assert_eq!(back.info, state.info);
    }
}
