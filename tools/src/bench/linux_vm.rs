//! The full initiator against the Linux kernel's targets in the qemu VM:
//! the StorPort model → the miniport core → the SRP engine (to `ib_srpt`)
//! or the iSER engine (to LIO's iSCSI target over `ib_isert`) → kverbs →
//! the software HCA on the VM's RoCEv2 link → `rdma_rxe` in the guest →
//! LIO RAM-disk LUNs (`rd_mcp`).
//!
//! [`linux_vm_srp_backend`] and [`linux_vm_iser_backend`] prepare the VM
//! ([`crate::vm::prepare`]: Debian packages, kernel and initramfs, cached
//! in the work directory), boot it under TCG with one target (SRP or iSER)
//! exporting the LUNs, put the initiator's HCA on the link
//! ([`crate::vm::link::LinkWire`]) and log in, as the driver would, from
//! the `add_target` string or node record built from what the guest
//! reported. [`ModelBackend::finish`] logs out through StorPort (adapter
//! stop), checks the target let go of the session, and shuts the VM down.
//!
//! The VM runs under TCG emulation: the numbers say how the stack behaves
//! against a real kernel target, not what real hardware would do.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hca_lowlevel::sim::{HcaConfig, LinkConfig};
use hca_lowlevel::wire::EthernetAddress;
use kverbs::irql::Passive;
use kverbs::platform::host::HostPlatform;
use storport_srp::iscsi::description::TargetDescription;
use storport_srp::iser::{IserConfig, IserTransport};
use storport_srp::miniport::TransportFactory;
use storport_srp::srp::params::parse_add_target;
use storport_srp::srp::{AdapterShape, SrpConfig, SrpTransport};
use storport_srp::storport::host::SgShape;

use super::backend::BackendError;
use super::iser::IserMiniport;
use super::model::{ModelBackend, ModelIdentity};
use super::rdma::{
    BenchEngine, BenchTarget, EngineMiniport, InitiatorHca, StackPlan, StartedStack,
    bench_platform, rdma_backend, start_stack, step_error, wait_until,
};
use super::srp::SrpMiniport;
use crate::scsi_target::BlockSize;
use crate::vm::link::{
    LinkWire, isert_node_record, srpt_add_target, tcg_cm_config, tcg_srp_config,
};
use crate::vm::{
    Backstore, LunConfig, MAX_LUNS, PrepareOptions, TargetInfo, Vm, VmConfig, VmError, WorkDir,
    log_tail, prepare,
};

/// The initiator's IQN towards LIO.
pub const INITIATOR_NAME: &str = "iqn.1991-05.com.microsoft:kvbench-linux-vm";

/// Which of the VM's targets the initiator logs in to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VmProtocol {
    /// SRP to `ib_srpt`.
    Srp,
    /// iSER to LIO's iSCSI target (`ib_isert`).
    Iser,
}

/// The shape of the run against the VM.
#[derive(Debug, Clone)]
pub struct LinuxVmOptions {
    /// The harness's work directory (package cache, kernel, initramfs,
    /// the run directory with the console log).
    pub workdir: WorkDir,
    /// The VM instance's name (its run directory).
    pub instance: String,
    /// Install missing host packages with apt when running as root.
    pub install: bool,
    /// Say (on stderr) that the VM is being prepared and booted, and what
    /// preparing it does (downloads take a while).
    pub verbose: bool,
    /// LUNs the target exports (LIO RAM disks in guest memory).
    pub luns: u8,
    /// Bytes per LUN (rounded up to whole MiB).
    pub lun_bytes: u64,
    /// Logical block size of every LUN.
    pub block_size: BlockSize,
    /// How request buffers are laid out in physical memory.
    pub sg_shape: SgShape,
    /// Simulated processors (DPC threads) of the host.
    pub processors: u32,
    /// SRP: RC channels (`ch_count`).
    pub channels: u32,
    /// SRP: commands per channel (`queue_size`); iSER: commands per
    /// session (`cmds_max`). `None`: 64.
    pub queue_size: Option<u32>,
    /// Ask for immediate data (small writes inside the command).
    pub immediate_data: bool,
}

impl Default for LinuxVmOptions {
    fn default() -> Self {
        Self {
            workdir: WorkDir::default(),
            instance: "kvbench".to_owned(),
            install: true,
            verbose: false,
            luns: 1,
            lun_bytes: 32 << 20,
            block_size: BlockSize::B512,
            sg_shape: SgShape::Contiguous,
            processors: 2,
            channels: 1,
            queue_size: None,
            immediate_data: true,
        }
    }
}

/// How long the login may take: a TCG guest answers slowly, and the CM
/// retries at about 4 s.
const LIVE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the target may take to drop the session after the logout.
const LOGOUT_TIMEOUT: Duration = Duration::from_secs(30);
/// Initiator memory: every outstanding request's buffer lives in it.
const INITIATOR_MEMORY: usize = 1 << 30;
/// Guest memory besides the RAM LUNs (the harness's minimum is 192 MiB).
const GUEST_SYSTEM_MIB: u64 = 256;

/// The VM's target as the benchmark holds it: the VM itself, and where
/// its session shows in configfs.
pub struct VmTarget {
    vm: Vm,
    protocol: VmProtocol,
    /// The configfs file that lists the initiator's session while it is
    /// logged in.
    sessions_file: String,
    /// What that file says of our session.
    session_marker: String,
    /// The target portal group's configfs directory.
    tpg: String,
    wire: Arc<LinkWire>,
}

impl VmTarget {
    /// The booted VM's `protocol` target: its portal group at `tpg`, our
    /// session shown by `session_marker` in `sessions_file`.
    fn new(
        booted: Booted,
        protocol: VmProtocol,
        tpg: String,
        sessions_file: String,
        session_marker: String,
    ) -> Self {
        Self {
            vm: booted.vm,
            protocol,
            sessions_file,
            session_marker,
            tpg,
            wire: booted.wire,
        }
    }

    /// The VM.
    #[must_use]
    pub fn vm(&self) -> &Vm {
        &self.vm
    }

    /// The host end of the link (frame counters).
    #[must_use]
    pub fn wire(&self) -> &LinkWire {
        &self.wire
    }

    /// Whether the target lists our session now (`None`: the guest did not
    /// answer).
    #[must_use]
    pub fn session_listed(&self) -> Option<bool> {
        // A file that cannot be read (no session) lists nothing.
        let out = self
            .vm
            .exec(&format!("cat {} 2>/dev/null; true", self.sessions_file))
            .ok()?;
        out.success()
            .then(|| out.stdout_text().contains(&self.session_marker))
    }

    /// SCSI commands the target received on all its LUNs (LIO's port
    /// statistics); `None` if the guest did not answer.
    #[must_use]
    pub fn commands_received(&self) -> Option<u64> {
        let out = self
            .vm
            .exec(&format!(
                "cat {}/lun/lun_*/statistics/scsi_tgt_port/in_cmds",
                self.tpg
            ))
            .ok()?;
        if !out.success() {
            return None;
        }
        out.stdout_text()
            .split_whitespace()
            .map(|n| n.parse::<u64>().ok())
            .sum()
    }

    /// The target's and rxe's kernel messages (the evidence when something
    /// fails).
    #[must_use]
    pub fn kernel_log(&self) -> String {
        self.vm
            .exec("dmesg | grep -i -E 'srpt|isert|iscsi|rxe|target' | tail -20")
            .map(|o| o.stdout_text())
            .unwrap_or_default()
    }
}

impl BenchTarget for VmTarget {
    fn stop_and_check(self, index: usize, _p: &Passive<'_>) -> Vec<String> {
        let mut found = Vec::new();
        // The adapter stop logged out: the kernel must let go of the session.
        let gone = wait_until(LOGOUT_TIMEOUT, || self.session_listed() == Some(false));
        if !gone {
            found.push(format!(
                "target {index} ({}) still lists the session ({:?} in {}) {LOGOUT_TIMEOUT:?} \
                 after the logout\n{}",
                protocol_name(self.protocol),
                self.session_marker,
                self.sessions_file,
                self.kernel_log()
            ));
        }
        self.vm.shutdown();
        found
    }
}

fn protocol_name(protocol: VmProtocol) -> &'static str {
    match protocol {
        VmProtocol::Srp => "ib_srpt",
        VmProtocol::Iser => "LIO iSER",
    }
}

/// The report's target type for `protocol`.
fn target_type(protocol: VmProtocol) -> &'static str {
    match protocol {
        VmProtocol::Srp => "SRP (Linux ib_srpt)",
        VmProtocol::Iser => "iSER (Linux LIO)",
    }
}

/// A booted VM with its link taken.
struct Booted {
    vm: Vm,
    info: TargetInfo,
    wire: Arc<LinkWire>,
}

/// `e` with the tail of the VM's console log (the kernel's view of a
/// failed login or a stuck target), which is kept after the VM stops.
fn with_console(e: BackendError, console: &std::path::Path) -> BackendError {
    BackendError::new(format!("{e}\n{}", log_tail(console, 15)))
}

fn vm_error(what: &str, e: &VmError) -> BackendError {
    BackendError::new(format!("{what}: {e}"))
}

/// Prepares and boots the VM with one target of `protocol` exporting the
/// LUNs.
fn boot(options: &LinuxVmOptions, protocol: VmProtocol) -> Result<Booted, BackendError> {
    let luns = usize::from(options.luns.max(1));
    if luns > MAX_LUNS {
        return Err(BackendError::new(format!(
            "the VM's targets export at most {MAX_LUNS} LUNs"
        )));
    }
    let size_mib = options.lun_bytes.div_ceil(1 << 20).max(1);
    let size_mib = u32::try_from(size_mib)
        .map_err(|_| BackendError::new("the LUN size is too large for the VM"))?;
    if options.verbose {
        eprintln!(
            "kvbench: preparing and booting the Linux target VM ({}; TCG, 15-60 s)",
            protocol_name(protocol)
        );
    }
    let prepared = prepare(
        &options.workdir,
        &PrepareOptions {
            install: options.install,
            verbose: options.verbose,
            ..PrepareOptions::default()
        },
    )
    .map_err(|e| vm_error("the Linux target VM cannot be prepared here", &e))?;
    let lun = LunConfig {
        backstore: Backstore::RdMcp,
        size_mib,
        block_size: options.block_size.bytes(),
    };
    let mut config = VmConfig {
        instance: options.instance.clone(),
        luns: vec![lun; luns],
        ..VmConfig::default()
    };
    let ram = u64::from(size_mib) * luns as u64 + GUEST_SYSTEM_MIB;
    config.machine.memory_mib = u32::try_from(ram)
        .map_err(|_| BackendError::new("the LUNs do not fit in the VM's memory"))?
        .max(config.machine.memory_mib);
    config.srpt.enabled = protocol == VmProtocol::Srp;
    config.iser.enabled = protocol == VmProtocol::Iser;
    let mut vm = Vm::boot(&config, &prepared).map_err(|e| vm_error("booting the VM", &e))?;
    let info = vm.info().clone();
    let sock = vm
        .take_link()
        .ok_or_else(|| BackendError::new("the VM's link socket is gone"))?;
    Ok(Booted {
        vm,
        info,
        wire: Arc::new(LinkWire::new(sock)),
    })
}

/// The initiator's HCA on the VM's link: the host's MAC and IP as the VM
/// knows them, TCG-friendly CM timing.
fn linked_hca(
    platform: &HostPlatform,
    booted: &Booted,
    p: &Passive<'_>,
) -> Result<InitiatorHca, BackendError> {
    vm_initiator_hca(
        platform,
        &booted.info,
        booted.wire.clone(),
        INITIATOR_MEMORY,
        None,
        p,
    )
}

/// The initiator's HCA (with `memory` bytes of memory) alone on the
/// VM's link `wire`, with the host's MAC and IP as the VM (`info`) knows
/// them and TCG-friendly CM timing ([`tcg_cm_config`]), every frame
/// captured to `pcap` if given: what kvbench's `linux-vm` transports and
/// the interop tests run their engines on.
///
/// # Errors
/// [`BackendError`] if the HCA cannot be put on the link or the device
/// or the CM port cannot be opened.
pub fn vm_initiator_hca(
    platform: &HostPlatform,
    info: &TargetInfo,
    wire: Arc<LinkWire>,
    memory: usize,
    pcap: Option<std::path::PathBuf>,
    p: &Passive<'_>,
) -> Result<InitiatorHca, BackendError> {
    let mut link = LinkConfig::new(EthernetAddress(info.host_mac.0));
    link.pcap = pcap;
    InitiatorHca::on_link(
        platform,
        HcaConfig {
            mem_limit: memory,
            ..HcaConfig::new(info.host_ip.octets())
        },
        link,
        wire,
        tcg_cm_config(),
        p,
    )
}

fn describe(protocol: VmProtocol, info: &TargetInfo, options: &LinuxVmOptions) -> String {
    let (engine, target) = match protocol {
        VmProtocol::Srp => ("SRP", "ib_srpt"),
        VmProtocol::Iser => ("iSER", "LIO iSCSI/ib_isert"),
    };
    format!(
        "linux-vm-{}: StorPort model -> miniport -> {engine} engine -> kverbs -> soft HCA on \
         RoCEv2 -> rdma_rxe -> {target} in the qemu VM (Linux {}, TCG emulation, booted in \
         {:.1} s; {} RAM-disk LUN(s) of {} MiB)",
        engine.to_ascii_lowercase(),
        info.kernel_release,
        info.boot_secs,
        options.luns.max(1),
        options.lun_bytes.div_ceil(1 << 20)
    )
}

/// Boots the VM with `ib_srpt` and logs the SRP engine in (see the module
/// docs).
///
/// # Errors
/// [`BackendError`] naming the step: the VM cannot be prepared here (which
/// packages are missing and how to install them), it does not boot, the
/// login does not complete within 60 s, no LUN answers READ CAPACITY.
pub fn linux_vm_srp_backend(
    options: &LinuxVmOptions,
) -> Result<ModelBackend<SrpMiniport>, BackendError> {
    linux_vm_backend(options, VmProtocol::Srp, build_srp)
}

/// Puts the initiator with engine `T` on the booted VM's link and logs in
/// to its target (`build_srp`, `build_iser`).
type BuildOnVm<T> = fn(
    &HostPlatform,
    Booted,
    &LinuxVmOptions,
    &Passive<'_>,
) -> Result<StartedStack<T, VmTarget>, BackendError>;

/// Boots the VM with `protocol`'s target, has `build` put the initiator
/// with its engine on the link and log in, and wraps the stack as a
/// benchmark backend; a failure carries the tail of the VM's console.
fn linux_vm_backend<T: BenchEngine>(
    options: &LinuxVmOptions,
    protocol: VmProtocol,
    build: BuildOnVm<T>,
) -> Result<ModelBackend<EngineMiniport<T>>, BackendError> {
    let booted = boot(options, protocol)?;
    let identity = ModelIdentity {
        target_type: target_type(protocol).into(),
        description: describe(protocol, &booted.info, options),
    };
    let platform = bench_platform(options.processors);
    let console = booted.vm.paths().console_log.clone();
    platform
        .run_passive(|p| build(&platform, booted, options, p))
        .and_then(|started| rdma_backend(started, identity, options.sg_shape))
        .map_err(|e| with_console(e, &console))
}

fn build_srp(
    platform: &HostPlatform,
    booted: Booted,
    options: &LinuxVmOptions,
    p: &Passive<'_>,
) -> Result<StartedStack<SrpTransport<HostPlatform>, VmTarget>, BackendError> {
    let hca = linked_hca(platform, &booted, p)?;
    let queue = options.queue_size.unwrap_or(64);
    // 1 MiB transfers (max_sect 2048), as many descriptors as ib_srpt
    // takes in the command IU.
    let keys = format!(
        "queue_size={queue},max_cmd_per_lun={queue},max_sect=2048,cmd_sg_entries=255,\
         sg_tablesize=2048,ch_count={}",
        options.channels.max(1)
    );
    let add_target =
        srpt_add_target(&booted.info, &keys).map_err(|e| vm_error("the SRP target", &e))?;
    let params = parse_add_target(add_target.as_bytes())
        .map_err(|e| step_error(&format!("add_target {add_target:?}"), &e))?;
    // A TCG guest is slow: generous reconnect, loss and command timeouts.
    let srp_config = SrpConfig {
        use_imm_data: options.immediate_data,
        ..tcg_srp_config()
    };
    let shape = SrpTransport::<HostPlatform>::adapter_shape(&[params], &srp_config);
    let srpt = booted
        .info
        .srpt
        .as_ref()
        .ok_or_else(|| BackendError::new("the VM runs no SRP target"))?;
    let tpg = format!("/sys/kernel/config/target/srpt/{}/tpgt_1", srpt.wwn);
    // ib_srpt has no session list; LIO's per-LUN statistics of the ACL
    // name the attached initiator port ("<acl>+i+") while a session exists
    // and fail with ENODEV when none does.
    let sessions_file = format!("{tpg}/acls/*/lun_0/statistics/scsi_att_intr_port/port_ident");
    let target = VmTarget::new(
        booted,
        VmProtocol::Srp,
        tpg,
        sessions_file,
        "+i+".to_owned(),
    );
    let (dev2, cm2) = (hca.device.clone(), hca.cm.clone());
    start_on_vm(
        platform,
        hca,
        target,
        add_target,
        shape,
        options,
        Box::new(move |upcalls, p: &Passive<'_>| {
            SrpTransport::new(&dev2, &cm2, srp_config, &[params], upcalls, p)
                .map_err(|_| kverbs::platform::AllocError)
        }),
        p,
    )
}

/// Boots the VM with LIO's iSER portal and logs the iSER engine in (see
/// the module docs).
///
/// # Errors
/// As [`linux_vm_srp_backend`]; also odd scatter/gather shapes, which one
/// memory region per buffer cannot map.
pub fn linux_vm_iser_backend(
    options: &LinuxVmOptions,
) -> Result<ModelBackend<IserMiniport>, BackendError> {
    if matches!(options.sg_shape, SgShape::Odd { .. }) {
        return Err(BackendError::new(
            "iSER maps each buffer with one memory region; odd scatter/gather segments leave \
             gaps inside a page run: use contiguous or pages",
        ));
    }
    linux_vm_backend(options, VmProtocol::Iser, build_iser)
}

fn build_iser(
    platform: &HostPlatform,
    booted: Booted,
    options: &LinuxVmOptions,
    p: &Passive<'_>,
) -> Result<StartedStack<IserTransport<HostPlatform>, VmTarget>, BackendError> {
    let hca = linked_hca(platform, &booted, p)?;
    let depth = options.queue_size.unwrap_or(64).clamp(2, 1024);
    let immediate = if options.immediate_data { "Yes" } else { "No" };
    let keys = format!(
        "node.session.cmds_max = {depth}\nnode.session.queue_depth = {depth}\n\
         node.session.iscsi.ImmediateData = {immediate}"
    );
    let record = isert_node_record(&booted.info, INITIATOR_NAME, &keys)
        .map_err(|e| vm_error("the iSER target", &e))?;
    let desc = TargetDescription::parse(&record)
        .map_err(|e| step_error(&format!("node record {record:?}"), &e))?;
    let descs = vec![desc];
    let shape = IserTransport::<HostPlatform>::adapter_shape(
        &descs,
        hca.device.attr().max_fast_reg_page_list_len,
    );
    let iser = booted
        .info
        .iser
        .as_ref()
        .ok_or_else(|| BackendError::new("the VM runs no iSER target"))?;
    let tpg = format!("/sys/kernel/config/target/iscsi/{}/tpgt_1", iser.target_iqn);
    // Demo mode: the session is a dynamic one, listed by initiator name.
    let sessions_file = format!("{tpg}/dynamic_sessions");
    let target = VmTarget::new(
        booted,
        VmProtocol::Iser,
        tpg,
        sessions_file,
        INITIATOR_NAME.to_owned(),
    );
    let (dev2, cm2) = (hca.device.clone(), hca.cm.clone());
    start_on_vm(
        platform,
        hca,
        target,
        record,
        shape,
        options,
        Box::new(move |upcalls, p: &Passive<'_>| {
            IserTransport::new(&dev2, &cm2, IserConfig::default(), &descs, upcalls, p)
                .map_err(|_| kverbs::platform::AllocError)
        }),
        p,
    )
}

/// Starts the stack over the engine `make_transport` builds, with the VM's
/// one target (told of as `description`), and waits for both sides of
/// the login.
#[expect(clippy::too_many_arguments, reason = "the stack's parts")]
fn start_on_vm<T: BenchEngine>(
    platform: &HostPlatform,
    hca: InitiatorHca,
    target: VmTarget,
    description: String,
    shape: AdapterShape,
    options: &LinuxVmOptions,
    make_transport: TransportFactory<T>,
    p: &Passive<'_>,
) -> Result<StartedStack<T, VmTarget>, BackendError> {
    start_stack(
        platform,
        StackPlan {
            hca,
            targets: vec![Some(target)],
            descriptions: vec![description],
            shape,
            luns_per_target: options.luns,
            make_transport,
            target_live: Box::new(poll_session),
            live_timeout: LIVE_TIMEOUT,
        },
        p,
    )
}

/// The target's side is live when it lists the session; asked at most
/// every 200 ms (each question is a command in the guest).
fn poll_session(target: &VmTarget) -> bool {
    let asked = Instant::now();
    let listed = target.session_listed() == Some(true);
    if !listed {
        std::thread::sleep(Duration::from_millis(200).saturating_sub(asked.elapsed()));
    }
    listed
}
