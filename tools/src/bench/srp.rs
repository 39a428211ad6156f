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

use std::any::Any;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hca_lowlevel::sim::{ExecMode, Fabric, FabricConfig, HcaConfig, SoftHca};
use kverbs::cm::{CmConfig, CmError, CmPort, CmPortConfig};
use kverbs::device::{Device, DeviceConfig};
use kverbs::hostdev::VerifiedHca;
use kverbs::irql::Passive;
use kverbs::platform::host::{HostConfig, HostMode, HostPlatform};
use kverbs::wire::IbTimeout;
use storport_srp::miniport::transport::TargetState;
use storport_srp::miniport::{Adapter, AdapterConfig, AdapterState, CoreContext};
use storport_srp::srp::params::{TargetParams, parse_add_target};
use storport_srp::srp::{SrpConfig, SrpTransport};
use storport_srp::storport::host::{HostPort, ModelConfig, SgShape, StorPortModel};

use super::backend::BackendError;
use super::model::{ModelBackend, ModelIdentity, Teardown};
use crate::scsi_target::{BlockSize, LunConfig};
use crate::srp_target::{CmTiming, SrpTarget, SrpTargetConfig};

/// The miniport with the SRP engine.
pub type SrpMiniport = Adapter<HostPort, SrpTransport<HostPlatform>>;

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
/// [`ModelBackend::kept`]).
pub struct SrpParts {
    /// The fabric (its device thread runs the HCAs).
    pub fabric: Fabric,
    /// The initiator's HCA.
    pub initiator: Arc<SoftHca>,
    /// The initiator's verbs device.
    pub device: Device<HostPlatform>,
    /// The initiator port's connection manager.
    pub cm: CmPort<HostPlatform>,
    /// The software targets (taken when stopped).
    pub targets: Vec<Option<SrpTarget>>,
    /// What the initiator was told of each target.
    pub add_targets: Vec<String>,
}

/// The initiator HCA's address.
const INITIATOR_IP: [u8; 4] = [10, 0, 0, 1];
/// How long setup and teardown steps may take.
const STEP_TIMEOUT: Duration = Duration::from_secs(30);

fn target_ip(i: usize) -> [u8; 4] {
    [10, 0, 1, u8::try_from(i + 2).unwrap_or(u8::MAX)]
}

/// CM timing for an in-process fabric on a shared host: a response timeout
/// of 4.096 µs × 2^14 ≈ 67 ms with three retries, a short timewait, and a
/// packet lifetime that makes the RC ACK timeout ≈ 134 ms — long enough
/// that a busy two-core machine does not look like a lossy fabric.
fn cm_timing() -> CmTiming {
    let t = IbTimeout::new(14).unwrap_or(IbTimeout::from_low_bits(14));
    CmTiming {
        packet_lifetime: t,
        cm_response_timeout: t,
        max_cm_retries: 3,
        timewait: t,
    }
}

fn wait_until(timeout: Duration, cond: impl Fn() -> bool) -> bool {
    let start = Instant::now();
    while !cond() {
        if start.elapsed() > timeout {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    true
}

fn err(what: &str, e: &dyn std::fmt::Debug) -> BackendError {
    BackendError::new(format!("{what}: {e:?}"))
}

/// Takes the stack down and reports what it broke.
fn teardown() -> Teardown<SrpMiniport> {
    Box::new(
        |model: &mut StorPortModel<SrpMiniport>, keep: &mut (dyn Any + Send + Sync), p| {
            let mut found = Vec::new();
            model.settle();
            // A connection lost on a loss-free in-process fabric is a broken
            // promise of the stack, whether or not recovery hid it.
            let targets = keep
                .downcast_ref::<SrpParts>()
                .map_or(0, |x| x.targets.len());
            for t in 0..u8::try_from(targets).unwrap_or(u8::MAX) {
                if let Some(stats) = model.miniport().transport().target_stats(t, p) {
                    if stats.transport_failures > 0 || stats.protocol_errors > 0 {
                        found.push(format!(
                            "SRP target {t}: {} transport failure(s) (last reason {:#x}), {} \
                             protocol error(s), {} login(s), {} stale and {} dropped response(s)",
                            stats.transport_failures,
                            stats.last_transport_failure,
                            stats.protocol_errors,
                            stats.logins,
                            stats.stale_responses,
                            stats.dropped_responses
                        ));
                    }
                }
            }
            if !model.stop_adapter(p) {
                found.push("the adapter refused to stop".to_owned());
            }
            let stopped = wait_until(Duration::from_secs(60), || {
                model.miniport().core().state() == AdapterState::Stopped
            });
            if !stopped {
                found.push("the adapter did not stop within 60 s".to_owned());
            }
            let open = model.miniport().transport().open_connections(p);
            if open != 0 {
                found.push(format!("{open} SRP connection(s) left open after stop"));
            }
            model.free_adapter(p);
            let Some(parts) = keep.downcast_mut::<SrpParts>() else {
                found.push("the SRP stack's parts are missing".to_owned());
                return found;
            };
            for (i, slot) in parts.targets.iter_mut().enumerate() {
                if let Some(target) = slot.take() {
                    let c = target.counters();
                    if (c.credit_violations, c.malformed_ius, c.bad_descriptors) != (0, 0, 0) {
                        found.push(format!(
                            "target {i} saw the initiator break SRP: {} credit violation(s), \
                             {} malformed IU(s), {} bad descriptor(s)",
                            c.credit_violations, c.malformed_ius, c.bad_descriptors
                        ));
                    }
                    if let Err(e) = target.stop(p) {
                        found.push(format!("target {i} did not stop: {e}"));
                    }
                }
            }
            parts.cm.close(p);
            let quiet = wait_until(STEP_TIMEOUT, || {
                parts.cm.pending_consumers(p) == (0, 0) && parts.cm.connections_in_use(p) == 0
            });
            if !quiet {
                found.push(format!(
                    "CM consumers left after close: {:?}",
                    parts.cm.pending_consumers(p)
                ));
            }
            let released = wait_until(STEP_TIMEOUT, || {
                !matches!(parts.cm.release(p), Err(CmError::Busy))
            });
            if !released {
                found.push("the CM port was not released".to_owned());
            }
            parts.device.close(p);
            found
        },
    )
}

/// Builds the full SRP stack (see the module docs) and waits for every
/// target to be logged in.
///
/// # Errors
/// [`BackendError`] naming the step that failed (a target that does not
/// start, an `add_target` string the driver refuses, a login that does not
/// complete within 30 s, no disk answering READ CAPACITY).
pub fn srp_backend(options: &SrpOptions) -> Result<ModelBackend<SrpMiniport>, BackendError> {
    let platform = HostPlatform::with_config(HostConfig {
        mode: HostMode::Threaded,
        processors: options.processors.max(1),
        worker_threads: 2,
        dpc_budget: Duration::from_secs(2),
    });
    let built = platform.run_passive(|p| build(&platform, options, p));
    let (model, limits, parts) = built?;
    let channels = options.channels.max(1);
    ModelBackend::new(
        model,
        limits,
        ModelIdentity {
            target_type: "SRP".into(),
            description: format!(
                "srp: StorPort model -> miniport -> SRP engine -> kverbs -> soft HCA <-> soft HCA -> \
                 software SRP target ({} target(s), {channels} channel(s) each, RAM disks)",
                options.targets
            ),
        },
        options.sg_shape,
        Box::new(parts),
        Some(teardown()),
    )
}

fn build(
    platform: &HostPlatform,
    options: &SrpOptions,
    p: &Passive<'_>,
) -> Result<
    (
        StorPortModel<SrpMiniport>,
        storport_srp::storport::AdapterLimits,
        SrpParts,
    ),
    BackendError,
> {
    let fabric = Fabric::new(FabricConfig {
        mode: ExecMode::Thread,
        seed: 1,
    });
    let initiator = fabric.add_hca(HcaConfig {
        mem_limit: 2 << 30,
        ..HcaConfig::new(INITIATOR_IP)
    });
    let device = Device::open(
        platform,
        VerifiedHca::new(initiator.clone()),
        DeviceConfig::default(),
        p,
    )
    .map_err(|e| err("initiator device", &e))?;
    let timing = cm_timing();
    let cm = CmPort::create(
        &device,
        1,
        CmPortConfig {
            cm: CmConfig {
                packet_lifetime: timing.packet_lifetime,
                cm_response_timeout: timing.cm_response_timeout,
                max_cm_retries: timing.max_cm_retries,
                timewait: timing.timewait,
                connections: 512,
                listeners: 4,
                ..CmConfig::new(hca_lowlevel::wire::Gid::ZERO, 0)
            },
            recv_buffers: 128,
            send_buffers: 128,
            trace: None,
        },
        p,
    )
    .map_err(|e| err("initiator CM", &e))?;
    let mut targets = Vec::new();
    let mut add_targets = Vec::new();
    let mut params: Vec<TargetParams> = Vec::new();
    for i in 0..usize::from(options.targets) {
        let hca = fabric.add_hca(HcaConfig::new(target_ip(i)));
        let blocks = options.lun_bytes / u64::from(options.block_size.bytes());
        let config = SrpTargetConfig {
            luns: (0..options.luns)
                .map(|_| LunConfig::new(options.block_size, blocks))
                .collect(),
            cm_timing: Some(timing),
            staging_bytes: 64 << 20,
            immediate_data: options.immediate_data,
            ..SrpTargetConfig::default()
        };
        let target = SrpTarget::start_on_hca(platform, hca, config, p)
            .map_err(|e| err(&format!("SRP target {i}"), &e))?;
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
            .map_err(|e| err(&format!("add_target {add_target:?}"), &e))?;
        params.push(parsed);
        add_targets.push(add_target);
        targets.push(Some(target));
    }
    let srp_config = SrpConfig {
        use_imm_data: options.immediate_data,
        ..SrpConfig::default()
    };
    let shape = SrpTransport::<HostPlatform>::adapter_shape(&params, &srp_config);
    let adapter = AdapterConfig {
        targets: options.targets.max(1),
        luns_per_target: options.luns.max(1),
        max_io: shape.max_io.clamp(1, 4096),
        max_io_per_lun: shape.max_io_per_lun.clamp(1, 4096),
        max_transfer_bytes: shape.max_transfer_bytes,
        physical_breaks: shape.physical_breaks,
    };
    let mut model = StorPortModel::<SrpMiniport>::with_memory(
        platform,
        ModelConfig {
            max_requests: 16_384,
            ..ModelConfig::default()
        },
        initiator.phys_memory().clone(),
        p,
    );
    let (dev2, cm2) = (device.clone(), cm.clone());
    let context = CoreContext {
        config: adapter,
        make_transport: Box::new(move |upcalls, p: &Passive<'_>| {
            SrpTransport::new(&dev2, &cm2, srp_config, &params, upcalls, p)
                .map_err(|_| kverbs::platform::AllocError)
        }),
    };
    let limits = model
        .start(&context, p)
        .map_err(|e| err("the adapter did not start", &e))?;
    for t in 0..options.targets {
        let live = wait_until(STEP_TIMEOUT, || {
            model.miniport().core().target_state_of(t) == TargetState::Live
        });
        if !live {
            let stats = model.miniport().transport().target_stats(t, p);
            return Err(BackendError::new(format!(
                "target {t} did not log in within {STEP_TIMEOUT:?}: {stats:?}"
            )));
        }
        // The target's side goes live when the CM's RTU arrives.
        let channels = usize::try_from(options.channels.max(1)).unwrap_or(1);
        let target = targets.get(usize::from(t)).and_then(Option::as_ref);
        if !wait_until(STEP_TIMEOUT, || {
            target.is_some_and(|x| x.live_channels() >= channels)
        }) {
            return Err(BackendError::new(format!(
                "target {t}: its channels did not go live"
            )));
        }
    }
    Ok((
        model,
        limits,
        SrpParts {
            fabric,
            initiator,
            device,
            cm,
            targets,
            add_targets,
        },
    ))
}
