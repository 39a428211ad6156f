//! What every RDMA backend of the benchmark shares, whichever engine (SRP,
//! iSER) and whichever target (the software targets in this process, the
//! Linux kernel's in the VM): the host platform, the initiator's HCA with
//! its verbs device and connection manager ([`InitiatorHca`]), the
//! StorPort model with the miniport over the engine, the wait for every
//! target to log in ([`start_stack`]), and the teardown through StorPort
//! that reports every broken promise ([`teardown`]).
//!
//! An engine says what a broken promise looks like on its side
//! ([`BenchEngine`]); a target says what it saw of the initiator and how it
//! stops ([`BenchTarget`]). Everything else is the same for all of them.

use std::any::Any;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hca_lowlevel::device::Mtu;
use hca_lowlevel::sim::{Fabric, FabricConfig, FrameSocket, HcaConfig, LinkConfig, SoftHca};
use kverbs::cm::{CmConfig, CmError, CmPort, CmPortConfig};
use kverbs::device::{Device, DeviceConfig};
use kverbs::hostdev::VerifiedHca;
use kverbs::irql::Passive;
use kverbs::platform::host::{ForeignDpcPlacement, HostConfig, HostMode, HostPlatform};
use kverbs::wire::IbTimeout;
use storport_srp::iser::IserTransport;
use storport_srp::miniport::transport::{TargetState, Transport};
use storport_srp::miniport::{Adapter, AdapterConfig, AdapterState, CoreContext, TransportFactory};
use storport_srp::srp::{AdapterShape, SrpTransport};
use storport_srp::storport::AdapterLimits;
use storport_srp::storport::host::{HostPort, ModelConfig, SgShape, StorPortModel};

use super::backend::BackendError;
use super::model::{ModelBackend, ModelIdentity, Teardown};
use crate::srp_target::CmTiming;

/// The initiator HCA's address on the in-process fabric.
pub const INITIATOR_IP: [u8; 4] = [10, 0, 0, 1];
/// How long setup and teardown steps may take.
pub const STEP_TIMEOUT: Duration = Duration::from_secs(30);
/// Bytes of initiator memory on the in-process fabric (data buffers and
/// the engine's IUs).
const IN_PROCESS_MEMORY: usize = 2 << 30;

/// The in-process fabric's HCA at `ip`: an InfiniBand fabric's usual
/// 4096-byte MTU (RoCE with jumbo frames), so a 128 KiB transfer is 32
/// packets rather than 128 — the software HCA's cost is mostly per packet
/// (header build, ICRC both ways), as a real HCA's is per WQE, not per byte.
pub fn in_process_hca(ip: [u8; 4]) -> HcaConfig {
    HcaConfig {
        mtu: Mtu::Mtu4096,
        ..HcaConfig::new(ip)
    }
}

/// Whether the in-process fabric runs the software HCA's engine inside the
/// doorbell write ([`FabricConfig::inline_doorbells`]) unless
/// `KVBENCH_INLINE_DOORBELLS` (`0` or `1`) says otherwise.
pub const IN_PROCESS_INLINE_DOORBELLS: bool = true;

/// An on/off switch from the environment for A/B runs of one binary:
/// `0` or `1` in `var`, else `default` (any other value is reported on
/// stderr, not silently ignored).
pub(crate) fn env_switch(var: &str, default: bool) -> bool {
    match std::env::var(var) {
        Ok(v) if v == "0" => false,
        Ok(v) if v == "1" => true,
        Ok(other) => {
            eprintln!(
                "kvbench: {var}={other:?} is neither 0 nor 1; keeping the default ({})",
                u8::from(default)
            );
            default
        }
        Err(_) => default,
    }
}

/// The in-process fabric kvbench runs on, and the yardstick it is measured
/// against (`verbs_pingpong`) too: a device thread on real time, seed 1,
/// doorbells as [`IN_PROCESS_INLINE_DOORBELLS`] or the environment's
/// `KVBENCH_INLINE_DOORBELLS` (`0`/`1`; any other value is reported on
/// stderr and the default kept), so one binary can compare both modes.
#[must_use]
pub fn in_process_fabric() -> FabricConfig {
    let inline_doorbells = env_switch("KVBENCH_INLINE_DOORBELLS", IN_PROCESS_INLINE_DOORBELLS);
    FabricConfig {
        inline_doorbells,
        ..FabricConfig::threaded(1)
    }
}

/// The address of in-process target `i` (its own HCA).
#[must_use]
pub fn target_ip(i: usize) -> [u8; 4] {
    [10, 0, 1, u8::try_from(i + 2).unwrap_or(u8::MAX)]
}

/// CM timing for an in-process fabric on a shared host: a response timeout
/// of 4.096 µs × 2^14 ≈ 67 ms with three retries, a short timewait, and a
/// packet lifetime that makes the RC ACK timeout ≈ 134 ms — long enough
/// that a busy two-core machine does not look like a lossy fabric.
#[must_use]
pub fn in_process_cm_timing() -> CmTiming {
    let t = IbTimeout::new(14).unwrap_or(IbTimeout::from_low_bits(14));
    CmTiming {
        packet_lifetime: t,
        cm_response_timeout: t,
        max_cm_retries: 3,
        timewait: t,
    }
}

/// Waits (real time) until `cond` holds, polling every millisecond.
pub fn wait_until(timeout: Duration, cond: impl Fn() -> bool) -> bool {
    let start = Instant::now();
    while !cond() {
        if start.elapsed() > timeout {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    true
}

/// A [`BackendError`] naming the step and what it returned.
pub fn step_error(what: &str, e: &dyn std::fmt::Debug) -> BackendError {
    BackendError::new(format!("{what}: {e:?}"))
}

/// The threaded host platform the benchmark's stacks run on. A DPC its
/// worker threads queue for the current processor goes round robin, or to
/// an awake DPC thread with `KVBENCH_AWAKE_DPC_THREAD=1` (A/B runs; see
/// [`ForeignDpcPlacement::AwakeThread`]).
#[must_use]
pub fn bench_platform(processors: u32) -> HostPlatform {
    let foreign_dpc_placement = if env_switch("KVBENCH_AWAKE_DPC_THREAD", false) {
        ForeignDpcPlacement::AwakeThread
    } else {
        ForeignDpcPlacement::RoundRobin
    };
    HostPlatform::with_config(HostConfig {
        mode: HostMode::Threaded,
        processors: processors.max(1),
        worker_threads: 2,
        dpc_budget: Duration::from_secs(2),
        foreign_dpc_placement,
    })
}

/// The initiator's HCA with its verbs device and the port's connection
/// manager: what both engines run on.
pub struct InitiatorHca {
    /// The fabric (its device thread runs the HCAs).
    pub fabric: Fabric,
    /// The initiator's HCA.
    pub initiator: Arc<SoftHca>,
    /// The initiator's verbs device.
    pub device: Device<HostPlatform>,
    /// The initiator port's connection manager.
    pub cm: CmPort<HostPlatform>,
}

impl InitiatorHca {
    /// The initiator on a fresh in-process fabric (the targets' HCAs are
    /// added to [`Self::fabric`] afterwards), with the in-process CM
    /// timing.
    ///
    /// # Errors
    /// [`BackendError`] if the device or the CM port cannot be opened.
    pub fn in_process(platform: &HostPlatform, p: &Passive<'_>) -> Result<Self, BackendError> {
        let fabric = Fabric::new(in_process_fabric());
        let initiator = fabric.add_hca(HcaConfig {
            mem_limit: IN_PROCESS_MEMORY,
            ..in_process_hca(INITIATOR_IP)
        });
        let timing = in_process_cm_timing();
        let cm = CmConfig {
            packet_lifetime: timing.packet_lifetime,
            cm_response_timeout: timing.cm_response_timeout,
            max_cm_retries: timing.max_cm_retries,
            timewait: timing.timewait,
            connections: 512,
            listeners: 4,
            ..CmConfig::new(hca_lowlevel::wire::Gid::ZERO, 0)
        };
        Self::open(platform, fabric, initiator, cm, 128, p)
    }

    /// The initiator alone on a fabric whose one HCA sits on an Ethernet
    /// link (`socket` carries its RoCEv2 frames; `link` gives its MAC and
    /// capture), with `cm` for the connection manager.
    ///
    /// # Errors
    /// [`BackendError`] if the HCA cannot be put on the link or the device
    /// or the CM port cannot be opened.
    pub fn on_link(
        platform: &HostPlatform,
        hca: HcaConfig,
        link: LinkConfig,
        socket: Arc<dyn FrameSocket>,
        cm: CmConfig,
        p: &Passive<'_>,
    ) -> Result<Self, BackendError> {
        let fabric = Fabric::new(FabricConfig::threaded(1));
        let initiator = fabric
            .add_hca_on_link(hca, link, socket)
            .map_err(|e| step_error("initiator HCA on the link", &e))?;
        Self::open(platform, fabric, initiator, cm, 64, p)
    }

    fn open(
        platform: &HostPlatform,
        fabric: Fabric,
        initiator: Arc<SoftHca>,
        cm: CmConfig,
        buffers: u32,
        p: &Passive<'_>,
    ) -> Result<Self, BackendError> {
        let device = Device::open(
            platform,
            VerifiedHca::new(initiator.clone()),
            DeviceConfig::default(),
            p,
        )
        .map_err(|e| step_error("initiator device", &e))?;
        let cm = CmPort::create(
            &device,
            1,
            CmPortConfig {
                cm,
                recv_buffers: buffers,
                send_buffers: buffers,
                trace: None,
            },
            p,
        )
        .map_err(|e| step_error("initiator CM", &e))?;
        Ok(Self {
            fabric,
            initiator,
            device,
            cm,
        })
    }
}

/// What a stack keeps besides the model (reach it with
/// [`ModelBackend::kept`]): the initiator's HCA and the targets.
pub struct RdmaParts<Tg> {
    /// The fabric (its device thread runs the HCAs).
    pub fabric: Fabric,
    /// The initiator's HCA.
    pub initiator: Arc<SoftHca>,
    /// The initiator's verbs device.
    pub device: Device<HostPlatform>,
    /// The initiator port's connection manager.
    pub cm: CmPort<HostPlatform>,
    /// The targets (taken when stopped).
    pub targets: Vec<Option<Tg>>,
    /// What the initiator was told of each target: the SRP `add_target`
    /// string or the iSER node record.
    pub descriptions: Vec<String>,
}

/// An engine as the benchmark judges it at teardown.
pub trait BenchEngine: Transport {
    /// The protocol's name in messages (`SRP`, `iSER`).
    const PROTOCOL: &'static str;

    /// What went wrong with target `target` that may not on a loss-free
    /// fabric (lost connections, failed logins, protocol errors); `None`
    /// when nothing did.
    fn broken_promise(&self, target: u8, p: &Passive<'_>) -> Option<String>;

    /// Connections built and not yet released.
    fn connections_open(&self, p: &Passive<'_>) -> usize;
}

impl BenchEngine for SrpTransport<HostPlatform> {
    const PROTOCOL: &'static str = "SRP";

    fn broken_promise(&self, target: u8, p: &Passive<'_>) -> Option<String> {
        // A connection lost on a loss-free fabric is a broken promise of
        // the stack, whether or not recovery hid it.
        let stats = self.target_stats(target, p)?;
        (stats.transport_failures > 0 || stats.protocol_errors > 0).then(|| {
            format!(
                "SRP target {target}: {} transport failure(s) (last reason {:#x}), {} protocol \
                 error(s), {} login(s), {} stale and {} dropped response(s)",
                stats.transport_failures,
                stats.last_transport_failure,
                stats.protocol_errors,
                stats.logins,
                stats.stale_responses,
                stats.dropped_responses
            )
        })
    }

    fn connections_open(&self, p: &Passive<'_>) -> usize {
        self.open_connections(p)
    }
}

impl BenchEngine for IserTransport<HostPlatform> {
    const PROTOCOL: &'static str = "iSER";

    fn broken_promise(&self, target: u8, p: &Passive<'_>) -> Option<String> {
        // A lost connection or a failed login on a loss-free fabric is a
        // broken promise of the stack.
        let st = self.target_stats(target, p)?;
        (st.transport_failures > 0 || st.login_failures > 0).then(|| {
            format!(
                "iSER target {target}: {} transport failure(s) (last reason {}), {} failed \
                 login(s), {} login(s)",
                st.transport_failures, st.last_failure, st.login_failures, st.logins
            )
        })
    }

    fn connections_open(&self, p: &Passive<'_>) -> usize {
        self.open_connections(p)
    }
}

/// A target as the benchmark stops it at teardown.
pub trait BenchTarget: Send + Sync + 'static {
    /// Stops target `index` (after the initiator logged out); every broken
    /// promise of the initiator it saw, and any failure to stop.
    fn stop_and_check(self, index: usize, p: &Passive<'_>) -> Vec<String>;
}

/// How [`start_stack`] builds a stack: the engine and what it was told of
/// each target.
pub struct StackPlan<T: Transport, Tg> {
    /// The initiator.
    pub hca: InitiatorHca,
    /// The targets, in the engine's order.
    pub targets: Vec<Option<Tg>>,
    /// What the initiator was told of each target.
    pub descriptions: Vec<String>,
    /// The adapter's limits as the engine computed them.
    pub shape: AdapterShape,
    /// LUNs per target StorPort addresses.
    pub luns_per_target: u8,
    /// Builds the engine when StorPort initialises the adapter.
    pub make_transport: TransportFactory<T>,
    /// Whether a target's side of the connection(s) is live yet (the
    /// initiator goes live first: the target's side when the CM's RTU
    /// arrives).
    pub target_live: Box<dyn Fn(&Tg) -> bool>,
    /// How long to wait for each login.
    pub live_timeout: Duration,
}

/// The model with the miniport over engine `T`.
pub type EngineMiniport<T> = Adapter<HostPort, T>;

/// A started stack: StorPort with the miniport installed and initialised,
/// the limits the adapter reported, and what the stack keeps.
pub type StartedStack<T, Tg> = (
    StorPortModel<EngineMiniport<T>>,
    AdapterLimits,
    RdmaParts<Tg>,
);

/// The adapter StorPort is told of: `targets` targets of
/// `luns_per_target` LUNs (at least one of each), the engine's queue
/// limits clamped to what StorPort takes (1..=4096).
#[must_use]
pub fn adapter_config(shape: &AdapterShape, targets: u8, luns_per_target: u8) -> AdapterConfig {
    AdapterConfig {
        targets: targets.max(1),
        luns_per_target: luns_per_target.max(1),
        max_io: shape.max_io.clamp(1, 4096),
        max_io_per_lun: shape.max_io_per_lun.clamp(1, 4096),
        max_transfer_bytes: shape.max_transfer_bytes,
        physical_breaks: shape.physical_breaks,
    }
}

/// Installs the miniport over the planned engine in a StorPort model whose
/// memory is the initiator HCA's (so every I/O is fast-registered and
/// moved by RDMA), starts the adapter, and waits for every target to be
/// live on both sides.
///
/// # Errors
/// [`BackendError`] naming the step that failed: the adapter does not
/// start, a target does not log in within `plan.live_timeout`.
pub fn start_stack<T: BenchEngine, Tg: BenchTarget>(
    platform: &HostPlatform,
    plan: StackPlan<T, Tg>,
    p: &Passive<'_>,
) -> Result<StartedStack<T, Tg>, BackendError> {
    let StackPlan {
        hca,
        targets,
        descriptions,
        shape,
        luns_per_target,
        make_transport,
        target_live,
        live_timeout,
    } = plan;
    let count =
        u8::try_from(targets.len()).map_err(|_| BackendError::new("more than 255 targets"))?;
    let adapter = adapter_config(&shape, count, luns_per_target);
    let mut model = StorPortModel::<EngineMiniport<T>>::with_memory(
        platform,
        ModelConfig {
            max_requests: 16_384,
            ..ModelConfig::default()
        },
        hca.initiator.phys_memory().clone(),
        p,
    );
    let context = CoreContext {
        config: adapter,
        make_transport,
    };
    let limits = model
        .start(&context, p)
        .map_err(|e| step_error("the adapter did not start", &e))?;
    for t in 0..count {
        let live = wait_until(live_timeout, || {
            model.miniport().core().target_state_of(t) == TargetState::Live
        });
        if !live {
            let stats = model.miniport().transport().broken_promise(t, p);
            return Err(BackendError::new(format!(
                "{} target {t} did not log in within {live_timeout:?}{}",
                T::PROTOCOL,
                stats.map(|s| format!(": {s}")).unwrap_or_default()
            )));
        }
        let target = targets.get(usize::from(t)).and_then(Option::as_ref);
        if !wait_until(live_timeout, || target.is_some_and(&target_live)) {
            return Err(BackendError::new(format!(
                "{} target {t}: its side of the connection(s) did not go live",
                T::PROTOCOL
            )));
        }
    }
    let InitiatorHca {
        fabric,
        initiator,
        device,
        cm,
    } = hca;
    Ok((
        model,
        limits,
        RdmaParts {
            fabric,
            initiator,
            device,
            cm,
            targets,
            descriptions,
        },
    ))
}

/// Wraps a started stack as a benchmark backend: disk discovery now,
/// [`teardown`] at [`ModelBackend::finish`].
///
/// # Errors
/// [`BackendError`] if no disk answers READ CAPACITY.
pub fn rdma_backend<T: BenchEngine, Tg: BenchTarget>(
    started: (
        StorPortModel<EngineMiniport<T>>,
        AdapterLimits,
        RdmaParts<Tg>,
    ),
    identity: ModelIdentity,
    sg_shape: SgShape,
) -> Result<ModelBackend<EngineMiniport<T>>, BackendError> {
    let (model, limits, parts) = started;
    ModelBackend::new(
        model,
        limits,
        identity,
        sg_shape,
        Box::new(parts),
        Some(teardown::<T, Tg>()),
    )
}

/// Takes the stack down as Windows would — adapter stop through StorPort
/// (the engine logs out and disconnects), free, the targets stopped, the
/// CM port closed and released, the device closed — and reports every
/// broken promise: an engine failure on a loss-free fabric, an adapter
/// that does not stop, a connection left open, what the targets saw, CM
/// consumers left behind.
#[must_use]
pub fn teardown<T: BenchEngine, Tg: BenchTarget>() -> Teardown<EngineMiniport<T>> {
    Box::new(
        |model: &mut StorPortModel<EngineMiniport<T>>,
         keep: &mut (dyn Any + Send + Sync),
         p: &Passive<'_>| {
            let mut found = Vec::new();
            model.settle();
            let targets = keep
                .downcast_ref::<RdmaParts<Tg>>()
                .map_or(0, |x| x.targets.len());
            for t in 0..u8::try_from(targets).unwrap_or(u8::MAX) {
                found.extend(model.miniport().transport().broken_promise(t, p));
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
            let open = model.miniport().transport().connections_open(p);
            if open != 0 {
                found.push(format!(
                    "{open} {} connection(s) left open after stop",
                    T::PROTOCOL
                ));
            }
            model.free_adapter(p);
            let Some(parts) = keep.downcast_mut::<RdmaParts<Tg>>() else {
                found.push(format!("the {} stack's parts are missing", T::PROTOCOL));
                return found;
            };
            for (i, slot) in parts.targets.iter_mut().enumerate() {
                if let Some(target) = slot.take() {
                    found.extend(target.stop_and_check(i, p));
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
