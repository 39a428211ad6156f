//! The full iSER stack in one process, for the benchmark: the StorPort
//! model → the miniport core → the iSER engine → kverbs → a software HCA ↔
//! a software HCA per target → the software iSER target (`isert`-like) →
//! RAM-disk LUNs.
//!
//! Built as the driver runs: each target is described by an `iscsiadm`
//! node record parsed by the driver's own parser, the adapter's limits come
//! from the engine ([`IserTransport::adapter_shape`]), the engine logs in
//! over RDMA/CM (iSER CM private data, one login PDU at a time) when
//! StorPort initialises the adapter, and request buffers live in the
//! initiator HCA's memory, so every I/O is fast-registered, moved by the
//! target's RDMA WRITEs and READs (or carried as immediate data), and
//! invalidated — remotely by the target's SEND with invalidate — before it
//! completes.
//!
//! [`ModelBackend::finish`] takes it down through StorPort and checks what
//! the full-stack tests check: no transport failure or failed login on a
//! loss-free fabric, no connection left open, the target saw nothing
//! malformed, no work request error, no command outside the CmdSN window
//! and no login PDU beyond its one login buffer, the CM let go of
//! everything, and neither the StorPort model nor the kverbs verifier
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
use storport_srp::iscsi::description::TargetDescription;
use storport_srp::iser::{IserConfig, IserTransport};
use storport_srp::miniport::transport::TargetState;
use storport_srp::miniport::{Adapter, AdapterConfig, AdapterState, CoreContext};
use storport_srp::storport::host::{HostPort, ModelConfig, SgShape, StorPortModel};

use super::backend::BackendError;
use super::model::{ModelBackend, ModelIdentity, Teardown};
use crate::iser_target::{IserTarget, IserTargetConfig};
use crate::scsi_target::{BlockSize, LunConfig};
use crate::srp_target::CmTiming;

/// The miniport with the iSER engine.
pub type IserMiniport = Adapter<HostPort, IserTransport<HostPlatform>>;

/// The initiator's IQN.
pub const INITIATOR_NAME: &str = "iqn.1991-05.com.microsoft:kvbench";

/// The shape of the embedded iSER stack.
#[derive(Debug, Clone)]
pub struct IserOptions {
    /// Software iSER targets, each on its own HCA.
    pub targets: u8,
    /// LUNs per target.
    pub luns: u8,
    /// Bytes per LUN (sparse RAM disks: only written chunks use memory).
    pub lun_bytes: u64,
    /// Logical block size of every LUN.
    pub block_size: BlockSize,
    /// How request buffers are laid out in physical memory (one MR must
    /// map each: contiguous or per-page).
    pub sg_shape: SgShape,
    /// Simulated processors (DPC threads) of the host.
    pub processors: u32,
    /// Commands in flight per session (`node.session.cmds_max`, and the
    /// target's command window); `None`: 128.
    pub queue_depth: Option<u32>,
    /// Negotiate `ImmediateData=Yes` (small writes inside the command PDU).
    pub immediate_data: bool,
}

impl Default for IserOptions {
    fn default() -> Self {
        Self {
            targets: 1,
            luns: 1,
            lun_bytes: 256 << 20,
            block_size: BlockSize::B512,
            sg_shape: SgShape::Contiguous,
            processors: 2,
            queue_depth: None,
            immediate_data: true,
        }
    }
}

/// What the iSER stack keeps besides the model (reach it with
/// [`ModelBackend::kept`]).
pub struct IserParts {
    /// The fabric (its device thread runs the HCAs).
    pub fabric: Fabric,
    /// The initiator's HCA.
    pub initiator: Arc<SoftHca>,
    /// The initiator's verbs device.
    pub device: Device<HostPlatform>,
    /// The initiator port's connection manager.
    pub cm: CmPort<HostPlatform>,
    /// The software targets (taken when stopped).
    pub targets: Vec<Option<IserTarget>>,
    /// The node records the initiator was given.
    pub records: Vec<String>,
}

/// The initiator HCA's address.
const INITIATOR_IP: [u8; 4] = [10, 0, 0, 1];
/// How long setup and teardown steps may take.
const STEP_TIMEOUT: Duration = Duration::from_secs(30);

fn target_ip(i: usize) -> [u8; 4] {
    [10, 0, 1, u8::try_from(i + 2).unwrap_or(u8::MAX)]
}

/// CM timing for an in-process fabric on a shared host (as the SRP
/// backend's): ≈ 67 ms CM response timeout, three retries.
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
fn teardown() -> Teardown<IserMiniport> {
    Box::new(
        |model: &mut StorPortModel<IserMiniport>, keep: &mut (dyn Any + Send + Sync), p| {
            let mut found = Vec::new();
            model.settle();
            let targets = keep
                .downcast_ref::<IserParts>()
                .map_or(0, |x| x.targets.len());
            for t in 0..u8::try_from(targets).unwrap_or(u8::MAX) {
                if let Some(st) = model.miniport().transport().target_stats(t, p) {
                    // A lost connection or a failed login on a loss-free
                    // in-process fabric is a broken promise of the stack.
                    if st.transport_failures > 0 || st.login_failures > 0 {
                        found.push(format!(
                            "iSER target {t}: {} transport failure(s) (last reason {}), {} \
                             failed login(s), {} login(s)",
                            st.transport_failures, st.last_failure, st.login_failures, st.logins
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
                found.push(format!("{open} iSER connection(s) left open after stop"));
            }
            model.free_adapter(p);
            let Some(parts) = keep.downcast_mut::<IserParts>() else {
                found.push("the iSER stack's parts are missing".to_owned());
                return found;
            };
            for (i, slot) in parts.targets.iter_mut().enumerate() {
                if let Some(target) = slot.take() {
                    let c = target.counters();
                    let out_of_window = target.with_logic(|l| l.counters().out_of_window);
                    if (c.malformed, c.wr_errors, c.login_pdus_early, out_of_window) != (0, 0, 0, 0)
                    {
                        found.push(format!(
                            "target {i} saw the initiator break iSER/iSCSI: {} malformed PDU(s), \
                             {} work request error(s), {} login PDU(s) beyond the login buffer, \
                             {} command(s) outside the CmdSN window",
                            c.malformed, c.wr_errors, c.login_pdus_early, out_of_window
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

/// Builds the full iSER stack (see the module docs) and waits for every
/// session to be up.
///
/// # Errors
/// [`BackendError`] naming the step that failed (a scatter/gather shape one
/// MR cannot map, a target that does not start, a node record the driver
/// refuses, a login that does not complete within 30 s, no disk answering
/// READ CAPACITY).
pub fn iser_backend(options: &IserOptions) -> Result<ModelBackend<IserMiniport>, BackendError> {
    if matches!(options.sg_shape, SgShape::Odd { .. }) {
        return Err(BackendError::new(
            "iSER maps each buffer with one memory region (one STag per direction); odd \
             scatter/gather segments leave gaps inside a page run: use contiguous or pages",
        ));
    }
    let platform = HostPlatform::with_config(HostConfig {
        mode: HostMode::Threaded,
        processors: options.processors.max(1),
        worker_threads: 2,
        dpc_budget: Duration::from_secs(2),
    });
    let built = platform.run_passive(|p| build(&platform, options, p));
    let (model, limits, parts) = built?;
    ModelBackend::new(
        model,
        limits,
        ModelIdentity {
            target_type: "iSER".into(),
            description: format!(
                "iser: StorPort model -> miniport -> iSER engine -> kverbs -> soft HCA <-> soft \
                 HCA -> software iSER target ({} target(s), RAM disks)",
                options.targets
            ),
        },
        options.sg_shape,
        Box::new(parts),
        Some(teardown()),
    )
}

fn node_record(i: usize, name: &str, port: u16, options: &IserOptions) -> String {
    let [a, b, c, d] = target_ip(i);
    let depth = options.queue_depth.unwrap_or(128).clamp(2, 1024);
    let immediate = if options.immediate_data { "Yes" } else { "No" };
    format!(
        "node.name = {name}\nnode.conn[0].address = {a}.{b}.{c}.{d}\nnode.conn[0].port = {port}\n\
         iface.initiatorname = {INITIATOR_NAME}\nnode.session.timeo.reconnect_delay = 1\n\
         node.session.cmds_max = {depth}\nnode.session.queue_depth = {depth}\n\
         node.session.iscsi.ImmediateData = {immediate}\n"
    )
}

fn build(
    platform: &HostPlatform,
    options: &IserOptions,
    p: &Passive<'_>,
) -> Result<
    (
        StorPortModel<IserMiniport>,
        storport_srp::storport::AdapterLimits,
        IserParts,
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
    let mut records = Vec::new();
    let mut descs = Vec::new();
    let depth = options.queue_depth.unwrap_or(128).clamp(2, 1024);
    for i in 0..usize::from(options.targets) {
        let hca = fabric.add_hca(HcaConfig::new(target_ip(i)));
        let blocks = options.lun_bytes / u64::from(options.block_size.bytes());
        let mut config = IserTargetConfig::with_luns(
            (0..options.luns)
                .map(|_| LunConfig::new(options.block_size, blocks))
                .collect(),
        );
        config.iscsi.target_name = format!("iqn.2003-01.org.kverbs:bench{i}");
        config.iscsi.queue_depth = depth;
        config.iscsi.values.immediate_data = options.immediate_data;
        config.cm_timing = Some(timing);
        let target = IserTarget::start_on_hca(platform, hca, config, p)
            .map_err(|e| err(&format!("iSER target {i}"), &e))?;
        let record = node_record(i, target.target_name(), target.port(), options);
        let desc = TargetDescription::parse(&record)
            .map_err(|e| err(&format!("node record {record:?}"), &e))?;
        descs.push(desc);
        records.push(record);
        targets.push(Some(target));
    }
    let shape = IserTransport::<HostPlatform>::adapter_shape(
        &descs,
        device.attr().max_fast_reg_page_list_len,
    );
    let adapter = AdapterConfig {
        targets: options.targets.max(1),
        luns_per_target: options.luns.max(1),
        max_io: shape.max_io.clamp(1, 4096),
        max_io_per_lun: shape.max_io_per_lun.clamp(1, 4096),
        max_transfer_bytes: shape.max_transfer_bytes,
        physical_breaks: shape.physical_breaks,
    };
    let mut model = StorPortModel::<IserMiniport>::with_memory(
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
            IserTransport::new(&dev2, &cm2, IserConfig::default(), &descs, upcalls, p)
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
        let target = targets.get(usize::from(t)).and_then(Option::as_ref);
        if !wait_until(STEP_TIMEOUT, || {
            target.is_some_and(|x| x.live_connections() >= 1)
        }) {
            return Err(BackendError::new(format!(
                "target {t}: its connection did not reach full feature phase"
            )));
        }
    }
    Ok((
        model,
        limits,
        IserParts {
            fabric,
            initiator,
            device,
            cm,
            targets,
            records,
        },
    ))
}
