//! The full stack over iSER: StorPort model → miniport core → iSER engine
//! → kverbs → software HCA ↔ software HCA → software iSER target
//! ([`kverbs_tools::iser_target`]) → RAM disk.
//!
//! [`IserStack`] is [`crate::Stack`] with the transport selected as iSER:
//! the same fabric, platform and StorPort model; the targets are described
//! by `iscsiadm` node records parsed by the driver's own parser. The same
//! workload types ([`crate::Io`], [`crate::Workload`]) and checks apply.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hca_lowlevel::sim::{ExecMode, Fabric, FabricConfig, HcaConfig, SoftHca};
use kverbs::cm::{CmError, CmPort, CmPortConfig};
use kverbs::device::{Device, DeviceConfig};
use kverbs::hostdev::VerifiedHca;
use kverbs::irql::Passive;
use kverbs::platform::host::{HostConfig, HostMode, HostPlatform};
use kverbs_tools::iser_target::{IserTarget, IserTargetConfig};
use storport_srp::iscsi::description::TargetDescription;
use storport_srp::iser::{IserConfig, IserStats, IserTransport};
use storport_srp::miniport::transport::TargetState;
use storport_srp::miniport::{Adapter, AdapterConfig, CoreContext};
use storport_srp::storport::Address;
use storport_srp::storport::host::{
    HostPort, ModelConfig, RequestOutcome, RequestSpec, SgShape, StorPortModel,
};

use crate::{INITIATOR_IP, Io, IoDone, cm_timing, rw_cdb, target_ip};

pub use kverbs_tools::scsi_target::{BlockSize, LunConfig};

/// The host platform.
pub type Hp = HostPlatform;
/// The miniport with the iSER engine.
pub type IserAdapter = Adapter<HostPort, IserTransport<Hp>>;
/// The StorPort model running it.
pub type IserModel = StorPortModel<IserAdapter>;

/// The initiator's IQN.
pub const INITIATOR_NAME: &str = "iqn.1991-05.com.microsoft:kverbs-host";

/// One iSER target to start and attach.
#[derive(Debug, Clone)]
pub struct IserSetup {
    /// The software target's configuration.
    pub config: IserTargetConfig,
    /// Extra node-record lines (`key = value`).
    pub record: Vec<String>,
    /// Attach to this port instead of the target's.
    pub dest_port: Option<u16>,
}

impl IserSetup {
    /// Two LUNs: 16 MiB of 512-byte blocks, 16 MiB of 4 KiB blocks.
    #[must_use]
    pub fn standard() -> Self {
        let mut config = IserTargetConfig::with_luns(vec![
            LunConfig::new(BlockSize::B512, 32768),
            LunConfig::new(BlockSize::B4096, 4096),
        ]);
        config.cm_timing = Some(cm_timing());
        config.iscsi.queue_depth = 128;
        Self {
            config,
            record: Vec::new(),
            dest_port: None,
        }
    }

    /// With a node-record line.
    #[must_use]
    pub fn key(mut self, key: &str, value: &str) -> Self {
        self.record.push(format!("{key} = {value}"));
        self
    }

    /// The node record for target `i` at `port`.
    #[must_use]
    pub fn node_record(&self, i: usize, port: u16) -> String {
        let [a, b, c, d] = target_ip(i);
        let mut r = format!(
            "node.name = {}\nnode.conn[0].address = {a}.{b}.{c}.{d}\nnode.conn[0].port = {port}\n\
             iface.initiatorname = {INITIATOR_NAME}\nnode.session.timeo.reconnect_delay = 1\n\
             node.session.cmds_max = 256\nnode.session.queue_depth = 128\n",
            self.config.iscsi.target_name
        );
        for line in &self.record {
            r.push_str(line);
            r.push('\n');
        }
        r
    }
}

/// How to build an [`IserStack`].
#[derive(Debug, Clone)]
pub struct IserStackConfig {
    /// The fabric's seed.
    pub seed: u64,
    /// The targets.
    pub targets: Vec<IserSetup>,
    /// The engine's settings.
    pub iser: IserConfig,
    /// The StorPort model's behaviour.
    pub model: ModelConfig,
    /// LUNs per target.
    pub luns_per_target: u8,
    /// The host platform.
    pub host: HostConfig,
    /// Wait for every target to be live first.
    pub wait_live: bool,
}

impl Default for IserStackConfig {
    fn default() -> Self {
        Self {
            seed: 1,
            targets: vec![IserSetup::standard()],
            iser: IserConfig::default(),
            model: ModelConfig {
                max_requests: 16384,
                ..ModelConfig::default()
            },
            luns_per_target: 4,
            host: HostConfig {
                mode: HostMode::Threaded,
                processors: 2,
                worker_threads: 2,
                dpc_budget: Duration::from_secs(2),
                ..HostConfig::default()
            },
            wait_live: true,
        }
    }
}

/// The whole stack over iSER.
pub struct IserStack {
    /// The host platform.
    pub platform: Hp,
    /// The fabric.
    pub fabric: Fabric,
    /// The initiator HCA.
    pub initiator: Arc<SoftHca>,
    /// The initiator device.
    pub device: Device<Hp>,
    /// The initiator's connection manager.
    pub cm: CmPort<Hp>,
    /// The targets' HCAs.
    pub hcas: Vec<Arc<SoftHca>>,
    /// The software targets (taken at teardown).
    pub targets: Vec<Option<IserTarget>>,
    /// The node records the initiator was given.
    pub records: Vec<String>,
    /// StorPort, with the miniport installed.
    pub model: IserModel,
}

impl IserStack {
    /// Builds a stack, runs `f`, tears down with every check.
    ///
    /// # Panics
    /// If the stack cannot be built or a teardown check fails.
    pub fn run<R>(config: &IserStackConfig, f: impl FnOnce(&IserStack, &Passive<'_>) -> R) -> R {
        let platform = HostPlatform::with_config(config.host.clone());
        let (stack, result) = platform.run_passive(|p| {
            let stack = match Self::build(platform.clone(), config, p) {
                Ok(s) => s,
                Err(e) => panic!("iSER stack: {e}"),
            };
            let result = f(&stack, p);
            (stack, result)
        });
        stack.finish();
        result
    }

    fn build(platform: Hp, config: &IserStackConfig, p: &Passive<'_>) -> Result<Self, String> {
        let fabric = Fabric::new(FabricConfig {
            mode: ExecMode::Thread,
            seed: config.seed,
            ..FabricConfig::default()
        });
        let initiator = fabric.add_hca(HcaConfig {
            mem_limit: 512 << 20,
            ..HcaConfig::new(INITIATOR_IP)
        });
        let device = Device::open(
            &platform,
            VerifiedHca::new(initiator.clone()),
            DeviceConfig::default(),
            p,
        )
        .map_err(|e| format!("device: {e:?}"))?;
        let t = cm_timing();
        let cm = CmPort::create(
            &device,
            1,
            CmPortConfig {
                cm: kverbs::cm::CmConfig {
                    packet_lifetime: t.packet_lifetime,
                    cm_response_timeout: t.cm_response_timeout,
                    max_cm_retries: t.max_cm_retries,
                    timewait: t.timewait,
                    connections: 512,
                    listeners: 4,
                    ..kverbs::cm::CmConfig::new(hca_lowlevel::wire::Gid::ZERO, 0)
                },
                recv_buffers: 128,
                send_buffers: 128,
                trace: None,
            },
            p,
        )
        .map_err(|e| format!("CM: {e:?}"))?;
        let mut hcas = Vec::new();
        let mut targets = Vec::new();
        let mut records = Vec::new();
        let mut descs = Vec::new();
        for (i, setup) in config.targets.iter().enumerate() {
            let hca = fabric.add_hca(HcaConfig::new(target_ip(i)));
            let target = IserTarget::start_on_hca(&platform, hca.clone(), setup.config.clone(), p)
                .map_err(|e| format!("iSER target: {e}"))?;
            let record = setup.node_record(i, setup.dest_port.unwrap_or(target.port()));
            let desc = TargetDescription::parse(&record)
                .map_err(|e| format!("node record {record:?}: {e}"))?;
            descs.push(desc);
            records.push(record);
            hcas.push(hca);
            targets.push(Some(target));
        }
        let shape =
            IserTransport::<Hp>::adapter_shape(&descs, device.attr().max_fast_reg_page_list_len);
        let adapter = AdapterConfig {
            targets: u8::try_from(descs.len()).unwrap_or(u8::MAX).max(1),
            luns_per_target: config.luns_per_target,
            max_io: shape.max_io.clamp(1, 4096),
            max_io_per_lun: shape.max_io_per_lun.clamp(1, 4096),
            max_transfer_bytes: shape.max_transfer_bytes,
            physical_breaks: shape.physical_breaks,
        };
        let mut model = StorPortModel::with_memory(
            &platform,
            config.model.clone(),
            initiator.phys_memory().clone(),
            p,
        );
        let iser = config.iser;
        let (dev2, cm2) = (device.clone(), cm.clone());
        let context = CoreContext {
            config: adapter,
            make_transport: Box::new(move |upcalls, p: &Passive<'_>| {
                IserTransport::new(&dev2, &cm2, iser, &descs, upcalls, p)
                    .map_err(|_| kverbs::platform::AllocError)
            }),
        };
        model
            .start(&context, p)
            .map_err(|e| format!("find_adapter: {e:?}"))?;
        let stack = IserStack {
            platform,
            fabric,
            initiator,
            device,
            cm,
            hcas,
            targets,
            records,
            model,
        };
        if config.wait_live {
            for t in 0..stack.targets.len() {
                let t = u8::try_from(t).unwrap_or(u8::MAX);
                if !stack.wait_state(t, TargetState::Live, Duration::from_secs(20)) {
                    return Err(format!("target {t} not live: {:?}", stack.stats(t, p)));
                }
            }
        }
        Ok(stack)
    }

    /// The engine.
    #[must_use]
    pub fn transport(&self) -> &IserTransport<Hp> {
        self.model.miniport().transport()
    }

    /// A target's engine counters.
    #[must_use]
    pub fn stats(&self, target: u8, p: &Passive<'_>) -> IserStats {
        self.transport().target_stats(target, p).unwrap_or_default()
    }

    /// The target's state as the core sees it.
    #[must_use]
    pub fn state(&self, target: u8) -> TargetState {
        self.model.miniport().core().target_state_of(target)
    }

    /// Waits until `target` is in `state`.
    #[must_use]
    pub fn wait_state(&self, target: u8, state: TargetState, timeout: Duration) -> bool {
        self.wait_until(timeout, || self.state(target) == state)
    }

    /// Waits until `cond` holds.
    pub fn wait_until(&self, timeout: Duration, cond: impl Fn() -> bool) -> bool {
        let start = Instant::now();
        while !cond() {
            if start.elapsed() > timeout {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }

    /// The software target `i`.
    ///
    /// # Panics
    /// If it was stopped.
    #[must_use]
    pub fn target(&self, i: usize) -> &IserTarget {
        match self.targets.get(i).and_then(Option::as_ref) {
            Some(t) => t,
            None => panic!("no target {i}"),
        }
    }

    /// Block size of a LUN.
    #[must_use]
    pub fn block_len(&self, target: u8, lun: u8) -> u32 {
        self.target(usize::from(target))
            .scsi()
            .lun(u16::from(lun))
            .map_or(512, |l| l.block_len())
    }

    /// Blocks of a LUN.
    #[must_use]
    pub fn blocks(&self, target: u8, lun: u8) -> u64 {
        self.target(usize::from(target))
            .scsi()
            .lun(u16::from(lun))
            .map_or(0, |l| l.blocks())
    }

    /// The medium of a LUN.
    #[must_use]
    pub fn medium(&self, target: u8, lun: u8, lba: u64, blocks: u64) -> Vec<u8> {
        crate::driver::FullStack::medium(self, target, lun, lba, blocks)
    }

    /// Submits a request.
    ///
    /// # Panics
    /// If the model refuses it.
    pub fn submit(&self, spec: &RequestSpec, p: &Passive<'_>) -> u32 {
        crate::driver::submit(self, spec, p)
    }

    /// Whether request `id` completed.
    #[must_use]
    pub fn done(&self, id: u32) -> bool {
        crate::driver::done(self, id)
    }

    /// Waits for requests (pumping the model).
    ///
    /// # Panics
    /// If one does not complete within `timeout`.
    pub fn wait(&self, ids: &[u32], timeout: Duration, p: &Passive<'_>) -> Vec<RequestOutcome> {
        let start = Instant::now();
        while !ids.iter().all(|id| self.done(*id)) {
            assert!(
                start.elapsed() < timeout,
                "requests not completed in {timeout:?}"
            );
            self.model.pump(p);
            std::thread::sleep(Duration::from_millis(1));
        }
        ids.iter()
            .map(|id| {
                self.model
                    .outcome(*id)
                    .unwrap_or_else(|| panic!("no request {id}"))
            })
            .collect()
    }

    /// Waits for requests, advancing StorPort's clock by `tick` each
    /// round (its request timeouts run on that clock).
    ///
    /// # Panics
    /// If one does not complete within `timeout`.
    pub fn wait_ticking(
        &self,
        ids: &[u32],
        timeout: Duration,
        tick: Duration,
        p: &Passive<'_>,
    ) -> Vec<RequestOutcome> {
        let start = Instant::now();
        while !ids.iter().all(|id| self.done(*id)) {
            assert!(
                start.elapsed() < timeout,
                "requests not completed in {timeout:?}"
            );
            self.model.advance(tick, p);
            std::thread::sleep(Duration::from_millis(1));
        }
        ids.iter()
            .map(|id| {
                self.model
                    .outcome(*id)
                    .unwrap_or_else(|| panic!("no request {id}"))
            })
            .collect()
    }

    /// A READ; waits.
    pub fn read(
        &self,
        target: u8,
        lun: u8,
        lba: u64,
        blocks: u32,
        shape: SgShape,
        p: &Passive<'_>,
    ) -> (RequestOutcome, Vec<u8>) {
        let len = blocks * self.block_len(target, lun);
        let spec = RequestSpec::scsi_in(
            Address::new(0, target, lun),
            &rw_cdb(true, lba, blocks),
            len,
        )
        .shaped(shape);
        let id = self.submit(&spec, p);
        let out = self.wait(&[id], Duration::from_secs(30), p);
        let data = self.model.data(id).unwrap_or_default();
        (
            out.into_iter().next().unwrap_or_else(|| panic!("none")),
            data,
        )
    }

    /// A WRITE; waits.
    pub fn write(
        &self,
        target: u8,
        lun: u8,
        lba: u64,
        data: &[u8],
        shape: SgShape,
        p: &Passive<'_>,
    ) -> RequestOutcome {
        let blocks = u32::try_from(data.len()).unwrap_or(u32::MAX) / self.block_len(target, lun);
        let spec = RequestSpec::scsi_out(
            Address::new(0, target, lun),
            &rw_cdb(false, lba, blocks),
            data.to_vec(),
        )
        .shaped(shape);
        let id = self.submit(&spec, p);
        self.wait(&[id], Duration::from_secs(30), p)
            .into_iter()
            .next()
            .unwrap_or_else(|| panic!("none"))
    }

    /// Runs `ios` with up to `depth` in flight (never overlapping),
    /// checking each successful one against the medium.
    ///
    /// # Panics
    /// On a data mismatch or a request that does not complete in time.
    pub fn run_ios(&self, ios: &[Io], depth: usize, p: &Passive<'_>) -> Vec<IoDone> {
        crate::driver::run_ios(self, ios, depth, p)
    }

    /// Checks a successful I/O against the medium.
    ///
    /// # Panics
    /// On a mismatch.
    pub fn check(&self, io: &Io, done: &IoDone) {
        crate::driver::check(self, io, done);
    }

    /// Tears down and checks: the adapter stops with no connection left,
    /// the targets stop, the CM has no consumer left, every request
    /// completed exactly once, the verifier saw nothing.
    ///
    /// # Panics
    /// On any failed check.
    pub fn finish(mut self) {
        let platform = self.platform.clone();
        platform.run_passive(|p| {
            self.model.settle();
            let targets = u8::try_from(self.targets.len()).unwrap_or(u8::MAX);
            let failures = |p: &Passive<'_>| -> Vec<u64> {
                (0..targets)
                    .map(|i| self.stats(i, p).transport_failures)
                    .collect()
            };
            let before = failures(p);
            assert!(self.model.stop_adapter(p), "stop adapter");
            let stopped = self.wait_until(Duration::from_secs(60), || {
                self.model.miniport().core().state()
                    == storport_srp::miniport::AdapterState::Stopped
            });
            assert!(stopped, "the adapter did not stop");
            // The target ends the connection as soon as it has answered the
            // logout: that is the stop, not a transport failure.
            assert_eq!(failures(p), before, "stop counted as a transport failure");
            let open = self.transport().open_connections(p);
            assert_eq!(open, 0, "connections left open after stop");
            self.model.free_adapter(p);
            for (i, t) in self.targets.iter_mut().enumerate() {
                if let Some(t) = t.take() {
                    let early = t.counters().login_pdus_early;
                    assert_eq!(early, 0, "target {i}: login PDUs beyond the one buffer");
                    if let Err(e) = t.stop(p) {
                        panic!("target stop: {e}");
                    }
                }
            }
            self.cm.close(p);
            let quiet = self.wait_until(Duration::from_secs(30), || {
                self.cm.pending_consumers(p) == (0, 0) && self.cm.connections_in_use(p) == 0
            });
            assert!(quiet, "CM consumers left");
            let released = self.wait_until(Duration::from_secs(30), || match self.cm.release(p) {
                Ok(()) => true,
                Err(CmError::Busy) => false,
                Err(e) => panic!("CM release: {e:?}"),
            });
            assert!(released, "CM port not released");
            self.device.close(p);
        });
        let IserStack { model, fabric, .. } = self;
        model.finish();
        drop(fabric);
    }
}

impl crate::driver::FullStack for IserStack {
    type Miniport = IserAdapter;

    fn model(&self) -> &StorPortModel<IserAdapter> {
        &self.model
    }

    fn scsi(&self, target: u8) -> Arc<kverbs_tools::scsi_target::ScsiTarget> {
        self.target(usize::from(target)).scsi()
    }
}
