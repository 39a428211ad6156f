//! The full SRP stack in one process, for the benchmark: the StorPort
//! model → the miniport core → the SRP engine → kverbs → a software HCA ↔
//! a software HCA per target → the software SRP target → RAM-disk LUNs.
//!
//! Built the way the driver runs on Windows: the targets are attached with
//! `add_target` strings parsed by the driver's own parser, the adapter's
//! limits come from the engine ([`SrpTransport::adapter_shape`]), the
//! engine logs in over RDMA/CM when StorPort initialises the adapter, and
//! the data buffers of StorPort's requests live in the initiator HCA's
//! memory (the host's physical memory), so every I/O is fast-registered,
//! moved by the target's RDMA READs and WRITEs, and invalidated before it
//! completes. Everything runs on threads (the fabric's device thread, the
//! host platform's DPC and worker threads, the target's channel threads).
//!
//! [`ModelBackend::finish`] takes it down as Windows would — adapter stop
//! through StorPort, then free — and checks what the full-stack tests
//! check: no connection left open, the target saw no protocol breach (credit
//! violations, malformed IUs, bad descriptors), the connection manager let
//! go of everything, and neither the StorPort model nor the kverbs verifier
//! recorded a violation.

use hca_lowlevel::sim::HcaConfig;
use kverbs::irql::Passive;
use kverbs::platform::host::HostPlatform;
use storport_srp::srp::params::{TargetParams, parse_add_target};
use storport_srp::srp::{SrpConfig, SrpTransport};
use storport_srp::storport::host::SgShape;

use super::backend::BackendError;
use super::model::{ModelBackend, ModelIdentity};
use super::rdma::{
    BenchTarget, EngineMiniport, InitiatorHca, RdmaParts, STEP_TIMEOUT, StackPlan, StartedStack,
    bench_platform, in_process_cm_timing, rdma_backend, start_stack, step_error, target_ip,
};
use crate::scsi_target::{BlockSize, LunConfig};
use crate::srp_target::{SrpTarget, SrpTargetConfig};

/// The miniport with the SRP engine.
pub type SrpMiniport = EngineMiniport<SrpTransport<HostPlatform>>;

/// The shape of the embedded SRP stack.
#[derive(Debug, Clone)]
pub struct SrpOptions {
    /// Software SRP targets, each on its own HCA.
    pub targets: u8,
    /// LUNs per target.
    pub luns: u8,
    /// Bytes per LUN (sparse RAM disks: only written chunks use memory).
    pub lun_bytes: u64,
    /// Logical block size of every LUN.
    pub block_size: BlockSize,
    /// How request buffers are laid out in physical memory.
    pub sg_shape: SgShape,
    /// Simulated processors (DPC threads) of the host.
    pub processors: u32,
    /// RC channels per target (`ch_count`).
    pub channels: u32,
    /// Commands per channel (`queue_size`); `None`: the engine's default.
    pub queue_size: Option<u32>,
    /// Ask for immediate data (small writes inside the command IU).
    pub immediate_data: bool,
}

impl Default for SrpOptions {
    fn default() -> Self {
        Self {
            targets: 1,
            luns: 1,
            lun_bytes: 256 << 20,
            block_size: BlockSize::B512,
            sg_shape: SgShape::Contiguous,
            processors: 2,
            channels: 1,
            queue_size: None,
            immediate_data: true,
        }
    }
}

/// What the SRP stack keeps besides the model (reach it with
/// [`ModelBackend::kept`]); its `descriptions` are the `add_target`
/// strings.
pub type SrpParts = RdmaParts<SrpTarget>;

impl BenchTarget for SrpTarget {
    fn stop_and_check(self, index: usize, p: &Passive<'_>) -> Vec<String> {
        let mut found = Vec::new();
        let c = self.counters();
        if (c.credit_violations, c.malformed_ius, c.bad_descriptors) != (0, 0, 0) {
            found.push(format!(
                "target {index} saw the initiator break SRP: {} credit violation(s), {} \
                 malformed IU(s), {} bad descriptor(s)",
                c.credit_violations, c.malformed_ius, c.bad_descriptors
            ));
        }
        if let Err(e) = self.stop(p) {
            found.push(format!("target {index} did not stop: {e}"));
        }
        found
    }
}

/// Builds the full SRP stack (see the module docs) and waits for every
/// target to be logged in.
///
/// # Errors
/// [`BackendError`] naming the step that failed (a target that does not
/// start, an `add_target` string the driver refuses, a login that does not
/// complete within 30 s, no disk answering READ CAPACITY).
pub fn srp_backend(options: &SrpOptions) -> Result<ModelBackend<SrpMiniport>, BackendError> {
    let platform = bench_platform(options.processors);
    let started = platform.run_passive(|p| build(&platform, options, p))?;
    let channels = options.channels.max(1);
    rdma_backend(
        started,
        ModelIdentity {
            target_type: "SRP".into(),
            description: format!(
                "srp: StorPort model -> miniport -> SRP engine -> kverbs -> soft HCA <-> soft HCA -> \
                 software SRP target ({} target(s), {channels} channel(s) each, RAM disks)",
                options.targets
            ),
        },
        options.sg_shape,
    )
}

fn build(
    platform: &HostPlatform,
    options: &SrpOptions,
    p: &Passive<'_>,
) -> Result<StartedStack<SrpTransport<HostPlatform>, SrpTarget>, BackendError> {
    let hca = InitiatorHca::in_process(platform, p)?;
    let timing = in_process_cm_timing();
    let mut targets = Vec::new();
    let mut add_targets = Vec::new();
    let mut params: Vec<TargetParams> = Vec::new();
    for i in 0..usize::from(options.targets) {
        let target_hca = hca.fabric.add_hca(target_hca_config(options, i));
        let blocks = options.lun_bytes / u64::from(options.block_size.bytes());
        let config = SrpTargetConfig {
            staging_bytes: TARGET_STAGING_BYTES,
            luns: (0..options.luns)
                .map(|_| LunConfig::new(options.block_size, blocks))
                .collect(),
            cm_timing: Some(timing),
            immediate_data: options.immediate_data,
            serve_in_dpc: target_serves_in_dpc(),
            zero_copy_reads: target_zero_copy_reads(),
            ..SrpTargetConfig::default()
        };
        let target = SrpTarget::start_on_hca(platform, target_hca, config, p)
            .map_err(|e| step_error(&format!("SRP target {i}"), &e))?;
        let guid = target.service_guid();
        let port = target
            .rdma_cm_port()
            .ok_or_else(|| BackendError::new("the SRP target listens on no RDMA/CM port"))?;
        let [a, b, c, d] = target_ip(i);
        let mut add_target =
            format!("id_ext={guid:016x},ioc_guid={guid:016x},dest={a}.{b}.{c}.{d}:{port}");
        add_target.push_str(&format!(",ch_count={}", options.channels.max(1)));
        if let Some(q) = options.queue_size {
            add_target.push_str(&format!(",queue_size={q}"));
        }
        let parsed = parse_add_target(add_target.as_bytes())
            .map_err(|e| step_error(&format!("add_target {add_target:?}"), &e))?;
        params.push(parsed);
        add_targets.push(add_target);
        targets.push(Some(target));
    }
    let srp_config = SrpConfig {
        use_imm_data: options.immediate_data,
        ..SrpConfig::default()
    };
    let shape = SrpTransport::<HostPlatform>::adapter_shape(&params, &srp_config);
    let channels = usize::try_from(options.channels.max(1)).unwrap_or(1);
    let (dev2, cm2) = (hca.device.clone(), hca.cm.clone());
    start_stack(
        platform,
        StackPlan {
            hca,
            targets,
            descriptions: add_targets,
            shape,
            luns_per_target: options.luns,
            make_transport: Box::new(move |upcalls, p: &Passive<'_>| {
                SrpTransport::new(&dev2, &cm2, srp_config, &params, upcalls, p)
                    .map_err(|_| kverbs::platform::AllocError)
            }),
            // The target's side goes live when the CM's RTU arrives.
            target_live: Box::new(move |t: &SrpTarget| t.live_channels() >= channels),
            live_timeout: STEP_TIMEOUT,
        },
        p,
    )
}

/// Staging memory per channel of the in-process SRP target.
const TARGET_STAGING_BYTES: usize = 64 << 20;

/// The in-process target's HCA, with DMA memory for its RAM disks as well
/// as its staging and rings: the target registers its disks' chunks with
/// the HCA (READs go out straight from them), so a disk written whole must
/// not starve the staging buffers of DMA memory.
fn target_hca_config(options: &SrpOptions, i: usize) -> HcaConfig {
    let base = super::rdma::in_process_hca(target_ip(i));
    let disks = options.lun_bytes.saturating_mul(u64::from(options.luns));
    let staging = (TARGET_STAGING_BYTES as u64).saturating_mul(u64::from(options.channels.max(1)));
    let wanted = disks.saturating_add(staging).saturating_add(64 << 20);
    HcaConfig {
        mem_limit: base
            .mem_limit
            .max(usize::try_from(wanted).unwrap_or(usize::MAX)),
        ..base
    }
}

/// Whether the in-process SRP target serves commands in its CQ's DPC
/// ([`SrpTargetConfig::serve_in_dpc`], the default) unless
/// `KVBENCH_TARGET_DPC` (`0` or `1`) says otherwise, so one binary can
/// compare both.
fn target_serves_in_dpc() -> bool {
    super::rdma::env_switch(
        "KVBENCH_TARGET_DPC",
        SrpTargetConfig::default().serve_in_dpc,
    )
}

/// Whether the in-process SRP target sends READ data straight from its RAM
/// disk's registered chunks ([`SrpTargetConfig::zero_copy_reads`], the
/// default) unless `KVBENCH_TARGET_ZC` (`0` or `1`) says otherwise.
fn target_zero_copy_reads() -> bool {
    super::rdma::env_switch(
        "KVBENCH_TARGET_ZC",
        SrpTargetConfig::default().zero_copy_reads,
    )
}
