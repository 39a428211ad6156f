//! The full-stack harness: StorPort model → miniport core → SRP engine →
//! kverbs → software HCA ↔ software HCA → software SRP target → RAM disk.
//!
//! [`Stack`] builds a fabric (threaded: a device thread and a threaded host
//! platform, so everything runs concurrently as on a real machine) with one
//! initiator HCA and one HCA per target, starts the software SRP target
//! ([`kverbs_tools::srp_target`]) on each, and installs the miniport with
//! the SRP engine in the host StorPort model, whose data buffers live in
//! the initiator HCA's memory (the host's physical memory, as on Windows).
//! The targets are attached with `add_target` strings, parsed by the
//! driver's own parser.
//!
//! I/O helpers issue reads and writes of any size, alignment and
//! scatter/gather shape ([`SgShape`]) at any queue depth, and check the
//! data byte for byte against the target's medium (what the initiator
//! wrote must be on the disk; what it read must be what the disk holds).
//! Concurrent I/Os never overlap, so each check is exact.
//!
//! Test binaries must install the verifier's allocator, so every
//! allocation at `DISPATCH_LEVEL` anywhere in the stack fails the test
//! (`#[global_allocator] static ALLOCATOR: VerifierAllocator =
//! VerifierAllocator;`, from `kverbs::platform::host`).
//! [`Stack::run`] ends with the teardown checks: every request completed
//! exactly once (the model), no connection left open, no CM consumer left,
//! and no verifier violation.

pub mod driver;
pub mod interop;
pub mod iser;
pub mod teardown;

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
use storport_srp::miniport::{Adapter, AdapterConfig, CoreContext};
use storport_srp::scsi::cdb::{
    Cdb, CdbRepr, InquiryCdb, ReadCapacity16Cdb, ReadWriteCdb, ReportLunsCdb,
};
use storport_srp::srp::params::{TargetParams, parse_add_target};
use storport_srp::srp::{SrpConfig, SrpTransport, TargetStats};
use storport_srp::storport::Address;
use storport_srp::storport::host::{
    HostPort, ModelConfig, RequestOutcome, RequestSpec, SgShape, StorPortModel,
};

pub use kverbs_tools::scsi_target::{BlockSize, LunConfig};
pub use kverbs_tools::srp_target::{self, CmTiming, SrpTarget, SrpTargetConfig};

/// The host platform.
pub type Hp = HostPlatform;
/// The miniport with the SRP engine.
pub type SrpAdapter = Adapter<HostPort, SrpTransport<Hp>>;
/// The StorPort model running it.
pub type Model = StorPortModel<SrpAdapter>;

/// The initiator HCA's address.
pub const INITIATOR_IP: [u8; 4] = [10, 0, 0, 1];

/// Target `i`'s HCA address.
#[must_use]
pub fn target_ip(i: usize) -> [u8; 4] {
    [10, 0, 1, u8::try_from(i + 2).unwrap_or(u8::MAX)]
}

/// CM timing for tests (the host platform's clock is real): a response
/// timeout of 4.096 µs × 2^14 ≈ 67 ms, three retries, short timewait; a
/// packet lifetime of 2^14 × 4.096 µs, which makes the RC ACK timeout
/// ≈ 134 ms — long enough that a loaded two-core host does not look like
/// a lossy fabric.
#[must_use]
pub fn cm_timing() -> CmTiming {
    CmTiming {
        packet_lifetime: IbTimeout::new(14).unwrap_or(IbTimeout::from_low_bits(14)),
        cm_response_timeout: IbTimeout::new(14).unwrap_or(IbTimeout::from_low_bits(14)),
        max_cm_retries: 3,
        timewait: IbTimeout::new(14).unwrap_or(IbTimeout::from_low_bits(14)),
    }
}

fn initiator_cm_config() -> CmConfig {
    let t = cm_timing();
    CmConfig {
        packet_lifetime: t.packet_lifetime,
        cm_response_timeout: t.cm_response_timeout,
        max_cm_retries: t.max_cm_retries,
        timewait: t.timewait,
        connections: 512,
        listeners: 4,
        ..CmConfig::new(hca_lowlevel::wire::Gid::ZERO, 0)
    }
}

/// One target to start and attach.
#[derive(Debug, Clone)]
pub struct TargetSetup {
    /// The software target's configuration.
    pub config: SrpTargetConfig,
    /// `add_target` keys beyond the addressing (`"ch_count=2,queue_size=32"`).
    pub keys: String,
    /// Attach over IB CM (the `dgid`/`service_id` form) instead of
    /// RDMA/CM.
    pub ib_cm: bool,
    /// Misbehaviour switches armed before the initiator logs in.
    pub misbehave: Vec<srp_target::Misbehaviour>,
    /// Attach to this RDMA/CM port instead of the one the target listens
    /// on (a target that is not there).
    pub dest_port: Option<u16>,
}

impl TargetSetup {
    /// A target with `luns`, test CM timing, and 64 MiB of staging.
    #[must_use]
    pub fn ram_disk(luns: Vec<LunConfig>) -> Self {
        TargetSetup {
            config: SrpTargetConfig {
                luns,
                cm_timing: Some(cm_timing()),
                staging_bytes: 64 << 20,
                ..SrpTargetConfig::default()
            },
            keys: String::new(),
            ib_cm: false,
            misbehave: Vec::new(),
            dest_port: None,
        }
    }

    /// Two LUNs: 16 MiB of 512-byte blocks and 16 MiB of 4 KiB blocks.
    #[must_use]
    pub fn standard() -> Self {
        Self::ram_disk(vec![
            LunConfig::new(BlockSize::B512, 32768),
            LunConfig::new(BlockSize::B4096, 4096),
        ])
    }

    /// With more `add_target` keys.
    #[must_use]
    pub fn keys(mut self, keys: &str) -> Self {
        if !self.keys.is_empty() && !keys.is_empty() {
            self.keys.push(',');
        }
        self.keys.push_str(keys);
        self
    }
}

/// How to build a [`Stack`].
#[derive(Debug, Clone)]
pub struct StackConfig {
    /// The fabric's seed (fault injection).
    pub seed: u64,
    /// The targets.
    pub targets: Vec<TargetSetup>,
    /// The engine's settings.
    pub srp: SrpConfig,
    /// The StorPort model's behaviour.
    pub model: ModelConfig,
    /// LUNs per target StorPort addresses.
    pub luns_per_target: u8,
    /// The host platform (processors, DPC budget).
    pub host: HostConfig,
    /// Initiator memory for data buffers and the engine's IU buffers.
    pub initiator_memory: usize,
    /// Wait for every target to be live before the test body runs.
    pub wait_live: bool,
}

impl Default for StackConfig {
    fn default() -> Self {
        StackConfig {
            seed: 1,
            targets: vec![TargetSetup::standard()],
            srp: SrpConfig {
                timeouts: storport_srp::srp::params::Timeouts::new(
                    Some(Duration::from_millis(50)),
                    Some(Duration::from_secs(5)),
                    Some(Duration::from_secs(30)),
                )
                .unwrap_or_default(),
                ..SrpConfig::default()
            },
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
            initiator_memory: 512 << 20,
            wait_live: true,
        }
    }
}

/// The target end: its HCA, the software target, its attachment.
pub struct TargetEnd {
    /// The HCA.
    pub hca: Arc<SoftHca>,
    /// The software target (taken at teardown).
    pub srp: Option<SrpTarget>,
    /// What the initiator was told.
    pub params: TargetParams,
    /// The `add_target` string.
    pub add_target: String,
}

/// The whole stack (see the [crate docs](self)).
pub struct Stack {
    /// The host platform.
    pub platform: Hp,
    /// The fabric.
    pub fabric: Fabric,
    /// The initiator HCA.
    pub initiator: Arc<SoftHca>,
    /// The initiator device.
    pub device: Device<Hp>,
    /// The initiator port's connection manager.
    pub cm: CmPort<Hp>,
    /// The targets.
    pub targets: Vec<TargetEnd>,
    /// StorPort, with the miniport installed.
    pub model: Model,
    /// The adapter's shape.
    pub adapter: AdapterConfig,
}

/// Why a stack could not be built.
#[derive(Debug)]
pub struct SetupError(pub String);

impl Stack {
    /// Builds the stack and, unless told not to, waits for every target
    /// to be live.
    ///
    /// # Errors
    /// [`SetupError`] naming what failed.
    pub fn new(config: &StackConfig, p: &Passive<'_>) -> Result<Stack, SetupError> {
        let platform = HostPlatform::with_config(config.host.clone());
        Self::on_platform(platform, config, p)
    }

    fn on_platform(
        platform: Hp,
        config: &StackConfig,
        p: &Passive<'_>,
    ) -> Result<Stack, SetupError> {
        let err = |what: &str, e: &dyn std::fmt::Debug| SetupError(format!("{what}: {e:?}"));
        let fabric = Fabric::new(FabricConfig {
            mode: ExecMode::Thread,
            seed: config.seed,
            ..FabricConfig::default()
        });
        let initiator = fabric.add_hca(HcaConfig {
            mem_limit: config.initiator_memory,
            ..HcaConfig::new(INITIATOR_IP)
        });
        let (device, cm) = open_initiator(&platform, &initiator, p)?;
        let mut targets = Vec::new();
        for (i, setup) in config.targets.iter().enumerate() {
            let hca = fabric.add_hca(HcaConfig::new(target_ip(i)));
            let mut tconfig = setup.config.clone();
            if setup.ib_cm {
                tconfig.ib_cm = srp_target::config::IbCmListen::ServiceGuid;
            }
            let srp = SrpTarget::start_on_hca(&platform, hca.clone(), tconfig, p)
                .map_err(|e| err("SRP target", &e))?;
            for m in &setup.misbehave {
                srp.set_misbehaviour(m.clone(), p);
            }
            let guid = srp.service_guid();
            let [a, b, c, d] = target_ip(i);
            let mut add_target = if setup.ib_cm {
                let gid: String = hca.gid().0.iter().map(|x| format!("{x:02x}")).collect();
                let sid = srp.ib_cm_service_id().unwrap_or(guid);
                format!(
                    "id_ext={guid:016x},ioc_guid={guid:016x},dgid={gid},pkey=ffff,service_id={sid:016x}"
                )
            } else {
                let port = setup
                    .dest_port
                    .unwrap_or_else(|| srp.rdma_cm_port().unwrap_or(5555));
                format!("id_ext={guid:016x},ioc_guid={guid:016x},dest={a}.{b}.{c}.{d}:{port}")
            };
            if !setup.keys.is_empty() {
                add_target.push(',');
                add_target.push_str(&setup.keys);
            }
            let params = parse_add_target(add_target.as_bytes())
                .map_err(|e| err(&format!("add_target {add_target:?}"), &e))?;
            targets.push(TargetEnd {
                hca,
                srp: Some(srp),
                params,
                add_target,
            });
        }
        let params: Vec<TargetParams> = targets.iter().map(|t| t.params).collect();
        let shape = SrpTransport::<Hp>::adapter_shape(&params, &config.srp);
        let adapter = AdapterConfig {
            targets: u8::try_from(params.len()).unwrap_or(u8::MAX).max(1),
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
        let srp_config = config.srp;
        let (dev2, cm2) = (device.clone(), cm.clone());
        let context = CoreContext {
            config: adapter,
            make_transport: Box::new(move |upcalls, p: &Passive<'_>| {
                SrpTransport::new(&dev2, &cm2, srp_config, &params, upcalls, p)
                    .map_err(|_| kverbs::platform::AllocError)
            }),
        };
        model
            .start(&context, p)
            .map_err(|e| err("find_adapter", &e))?;
        let stack = Stack {
            platform,
            fabric,
            initiator,
            device,
            cm,
            targets,
            model,
            adapter,
        };
        if config.wait_live {
            for t in 0..stack.targets.len() {
                let t = u8::try_from(t).unwrap_or(u8::MAX);
                if !stack.wait_state(t, TargetState::Live, Duration::from_secs(20)) {
                    return Err(SetupError(format!(
                        "target {t} not live: {:?}",
                        stack.stats(t, p)
                    )));
                }
                // The target side too (it goes live on the RTU).
                let channels = usize::from(stack.stats(t, p).live_channels);
                let target = stack.target(usize::from(t));
                if !stack.wait_until(Duration::from_secs(5), || {
                    target.live_channels() >= channels
                }) {
                    return Err(SetupError(format!("target {t}: channels not live")));
                }
            }
        }
        Ok(stack)
    }

    /// Builds a stack, runs `f`, and tears everything down with every
    /// check ([`Stack::finish`]).
    ///
    /// # Panics
    /// If the stack cannot be built, or any teardown check fails.
    pub fn run<R>(config: &StackConfig, f: impl FnOnce(&Stack, &Passive<'_>) -> R) -> R {
        let platform = HostPlatform::with_config(config.host.clone());
        let (stack, result) = platform.run_passive(|p| {
            let stack = match Self::on_platform(platform.clone(), config, p) {
                Ok(s) => s,
                Err(e) => panic!("stack: {}", e.0),
            };
            let result = f(&stack, p);
            (stack, result)
        });
        stack.finish();
        result
    }

    /// The engine.
    #[must_use]
    pub fn transport(&self) -> &SrpTransport<Hp> {
        self.model.miniport().transport()
    }

    /// A target's counters (engine side).
    #[must_use]
    pub fn stats(&self, target: u8, p: &Passive<'_>) -> TargetStats {
        self.transport().target_stats(target, p).unwrap_or_default()
    }

    /// The target's state as the core sees it.
    #[must_use]
    pub fn state(&self, target: u8) -> TargetState {
        self.model.miniport().core().target_state_of(target)
    }

    /// Waits (real time) until `target` is in `state`.
    #[must_use]
    pub fn wait_state(&self, target: u8, state: TargetState, timeout: Duration) -> bool {
        self.wait_until(timeout, || self.state(target) == state)
    }

    /// Waits (real time) until `cond` holds, polling.
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
    pub fn target(&self, i: usize) -> &SrpTarget {
        match self.targets.get(i).and_then(|t| t.srp.as_ref()) {
            Some(t) => t,
            None => panic!("no target {i}"),
        }
    }

    /// Block size of a target's LUN.
    #[must_use]
    pub fn block_len(&self, target: u8, lun: u8) -> u32 {
        self.target(usize::from(target))
            .scsi()
            .lun(u16::from(lun))
            .map_or(512, |l| l.block_len())
    }

    /// Blocks of a target's LUN.
    #[must_use]
    pub fn blocks(&self, target: u8, lun: u8) -> u64 {
        self.target(usize::from(target))
            .scsi()
            .lun(u16::from(lun))
            .map_or(0, |l| l.blocks())
    }

    /// The medium of a target's LUN, `blocks` at `lba`.
    #[must_use]
    pub fn medium(&self, target: u8, lun: u8, lba: u64, blocks: u64) -> Vec<u8> {
        crate::driver::FullStack::medium(self, target, lun, lba, blocks)
    }

    /// Submits a request.
    ///
    /// # Panics
    /// If the model cannot create it (table full, no memory).
    pub fn submit(&self, spec: &RequestSpec, p: &Passive<'_>) -> u32 {
        crate::driver::submit(self, spec, p)
    }

    /// Whether request `id` has completed.
    #[must_use]
    pub fn done(&self, id: u32) -> bool {
        crate::driver::done(self, id)
    }

    /// Waits for requests to complete (real time; StorPort's clock does not
    /// move unless `tick` is set, then by `tick` every millisecond).
    ///
    /// # Panics
    /// If one has not completed within `timeout`.
    pub fn wait(
        &self,
        ids: &[u32],
        timeout: Duration,
        tick: Option<Duration>,
        p: &Passive<'_>,
    ) -> Vec<RequestOutcome> {
        let start = Instant::now();
        loop {
            if ids.iter().all(|id| self.done(*id)) {
                break;
            }
            assert!(
                start.elapsed() < timeout,
                "requests not completed in {timeout:?}: {:?}",
                ids.iter()
                    .filter(|id| !self.done(**id))
                    .map(|id| (id, self.model.outcome(*id)))
                    .collect::<Vec<_>>()
            );
            if let Some(t) = tick {
                self.model.advance(t, p);
            } else {
                self.model.pump(p);
            }
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

    /// A READ of `blocks` at `lba`, buffer shaped `shape`; waits.
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
        let out = self.wait(&[id], Duration::from_secs(30), None, p);
        let data = self.model.data(id).unwrap_or_default();
        (
            out.into_iter()
                .next()
                .unwrap_or_else(|| panic!("no outcome")),
            data,
        )
    }

    /// A WRITE of `data` at `lba`, buffer shaped `shape`; waits.
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
        self.wait(&[id], Duration::from_secs(30), None, p)
            .into_iter()
            .next()
            .unwrap_or_else(|| panic!("no outcome"))
    }

    /// A command with data-in of `len` bytes; waits; returns the outcome
    /// and the bytes that moved.
    pub fn command_in(
        &self,
        target: u8,
        lun: u8,
        cdb: &[u8],
        len: u32,
        p: &Passive<'_>,
    ) -> (RequestOutcome, Vec<u8>) {
        let spec = RequestSpec::scsi_in(Address::new(0, target, lun), cdb, len);
        let id = self.submit(&spec, p);
        let out = self
            .wait(&[id], Duration::from_secs(30), None, p)
            .into_iter()
            .next()
            .unwrap_or_else(|| panic!("no outcome"));
        let mut data = self.model.data(id).unwrap_or_default();
        data.truncate(out.data_transfer_length as usize);
        (out, data)
    }

    /// INQUIRY (standard data, 96 bytes).
    pub fn inquiry(&self, target: u8, lun: u8, p: &Passive<'_>) -> (RequestOutcome, Vec<u8>) {
        let cdb = cdb_bytes(&CdbRepr::Inquiry(InquiryCdb {
            alloc_len: 96,
            ..InquiryCdb::default()
        }));
        self.command_in(target, lun, &cdb, 96, p)
    }

    /// READ CAPACITY(16).
    pub fn read_capacity(&self, target: u8, lun: u8, p: &Passive<'_>) -> (RequestOutcome, Vec<u8>) {
        let cdb = cdb_bytes(&CdbRepr::ReadCapacity16(ReadCapacity16Cdb {
            alloc_len: 32,
            ..ReadCapacity16Cdb::default()
        }));
        self.command_in(target, lun, &cdb, 32, p)
    }

    /// REPORT LUNS.
    pub fn report_luns(&self, target: u8, p: &Passive<'_>) -> (RequestOutcome, Vec<u8>) {
        let cdb = cdb_bytes(&CdbRepr::ReportLuns(ReportLunsCdb {
            select_report: 0,
            alloc_len: 4096,
        }));
        self.command_in(target, 0, &cdb, 4096, p)
    }

    /// Runs `ios` keeping up to `depth` in flight (no two in flight
    /// overlap), checking each against the target's medium as it
    /// completes. Returns the outcomes in `ios` order.
    ///
    /// # Panics
    /// On a data mismatch, or a request that does not complete in time.
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

    /// Tears everything down and checks: the adapter stops (the engine
    /// reports no connection left), the targets stop, the CM port has no
    /// consumer left, every request completed exactly once (the model),
    /// and the verifier saw no violation.
    ///
    /// # Panics
    /// On any failed check.
    pub fn finish(mut self) {
        let platform = self.platform.clone();
        platform.run_passive(|p| {
            // Stop the transport (through StorPort's adapter control, as
            // Windows does), then check it let go of everything.
            self.model.settle();
            assert!(self.model.stop_adapter(p), "stop adapter");
            let stopped = self.wait_until(Duration::from_secs(60), || {
                self.model.miniport().core().state()
                    == storport_srp::miniport::AdapterState::Stopped
            });
            assert!(stopped, "the adapter did not stop");
            let open = self.transport().open_connections(p);
            assert_eq!(open, 0, "connections left open after stop");
            let engine = self.transport().engine_probe();
            self.model.free_adapter(p);
            // Nothing the connections left behind (their handlers, held by
            // kverbs objects and the CM; the registry's links) keeps the
            // engine once the transport handle is gone.
            let engine_gone = self.wait_until(Duration::from_secs(30), || !engine.is_alive());
            assert!(engine_gone, "the SRP engine outlived its transport");
            for (i, t) in self.targets.iter_mut().enumerate() {
                if let Some(srp) = t.srp.as_ref() {
                    assert_initiator_kept_protocol(srp, i);
                }
                if let Some(srp) = t.srp.take() {
                    if let Err(e) = srp.stop(p) {
                        panic!("target stop: {e}");
                    }
                }
            }
            close_initiator(&self.cm, &self.device, p);
        });
        let Stack { model, fabric, .. } = self;
        model.finish();
        drop(fabric);
    }
}

/// Opens the initiator's device on `hca` and its CM port (port 1, the
/// tests' CM timing, room for every channel), as every stack does.
///
/// # Errors
/// [`SetupError`] naming what failed.
pub fn open_initiator(
    platform: &Hp,
    hca: &Arc<SoftHca>,
    p: &Passive<'_>,
) -> Result<(Device<Hp>, CmPort<Hp>), SetupError> {
    let err = |what: &str, e: &dyn std::fmt::Debug| SetupError(format!("{what}: {e:?}"));
    let device = Device::open(
        platform,
        VerifiedHca::new(hca.clone()),
        DeviceConfig::default(),
        p,
    )
    .map_err(|e| err("initiator device", &e))?;
    let cm = CmPort::create(
        &device,
        1,
        CmPortConfig {
            cm: initiator_cm_config(),
            recv_buffers: 128,
            send_buffers: 128,
            trace: None,
        },
        p,
    )
    .map_err(|e| err("initiator CM", &e))?;
    Ok((device, cm))
}

/// Closes the initiator's CM port and device, as every teardown does: the
/// CM closes, its consumers and connections drain, the port releases, the
/// device closes.
///
/// # Panics
/// If the CM keeps a consumer or a connection, or will not release, for
/// 30 s each.
pub fn close_initiator(cm: &CmPort<Hp>, device: &Device<Hp>, p: &Passive<'_>) {
    cm.close(p);
    let quiet = kverbs_tools::bench::rdma::wait_until(Duration::from_secs(30), || {
        cm.pending_consumers(p) == (0, 0) && cm.connections_in_use(p) == 0
    });
    assert!(
        quiet,
        "CM consumers left: {:?}, connections in use {}, {:?}",
        cm.pending_consumers(p),
        cm.connections_in_use(p),
        cm.stats(p)
    );
    let released =
        kverbs_tools::bench::rdma::wait_until(Duration::from_secs(30), || match cm.release(p) {
            Ok(()) => true,
            Err(CmError::Busy) => false,
            Err(e) => panic!("CM release: {e:?}"),
        });
    assert!(released, "CM port not released");
    device.close(p);
}

/// Read or write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// READ(10/16).
    Read,
    /// WRITE(10/16).
    Write,
}

/// One I/O of a workload.
#[derive(Clone)]
pub struct Io {
    /// Target.
    pub target: u8,
    /// LUN.
    pub lun: u8,
    /// Direction.
    pub op: Op,
    /// First block.
    pub lba: u64,
    /// Blocks.
    pub blocks: u32,
    /// Block size.
    pub block_len: u32,
    /// Buffer shape.
    pub shape: SgShape,
    /// Data to write (writes).
    pub data: Vec<u8>,
}

impl std::fmt::Debug for Io {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Io")
            .field("target", &self.target)
            .field("lun", &self.lun)
            .field("op", &self.op)
            .field("lba", &self.lba)
            .field("blocks", &self.blocks)
            .field("shape", &self.shape)
            .finish_non_exhaustive()
    }
}

impl Io {
    /// The request for it.
    #[must_use]
    pub fn spec(&self, _stack: &Stack) -> RequestSpec {
        self.request()
    }

    /// Whether two I/Os touch the same blocks.
    #[must_use]
    pub fn overlaps_with(&self, other: &Io) -> bool {
        self.target == other.target
            && self.lun == other.lun
            && self.lba < other.lba + u64::from(other.blocks)
            && other.lba < self.lba + u64::from(self.blocks)
    }

    /// The request for it, on any transport's stack.
    #[must_use]
    pub fn request(&self) -> RequestSpec {
        let address = Address::new(0, self.target, self.lun);
        match self.op {
            Op::Read => RequestSpec::scsi_in(
                address,
                &rw_cdb(true, self.lba, self.blocks),
                self.blocks * self.block_len,
            ),
            Op::Write => RequestSpec::scsi_out(
                address,
                &rw_cdb(false, self.lba, self.blocks),
                self.data.clone(),
            ),
        }
        .shaped(self.shape)
    }
}

/// A finished I/O.
#[derive(Clone)]
pub struct IoDone {
    /// The model's request id.
    pub id: u32,
    /// How it ended.
    pub outcome: RequestOutcome,
    /// Its buffer after completion.
    pub data: Vec<u8>,
}

impl std::fmt::Debug for IoDone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IoDone")
            .field("id", &self.id)
            .field("outcome", &self.outcome)
            .field("data_len", &self.data.len())
            .finish()
    }
}

/// A seeded workload generator.
#[derive(Debug)]
pub struct Workload {
    rng: fastrand::Rng,
}

impl Workload {
    /// A generator with `seed`.
    #[must_use]
    pub fn new(seed: u64) -> Self {
        Workload {
            rng: fastrand::Rng::with_seed(seed),
        }
    }

    /// `n` I/Os on `target`/`lun` (`blocks_total` blocks of `block_len`):
    /// reads with probability `read_ratio`, sizes `min_bytes..=max_bytes`
    /// (whole blocks), shapes drawn from contiguous, per-page and odd.
    #[must_use]
    #[expect(clippy::too_many_arguments, reason = "the workload's knobs")]
    pub fn ios(
        &mut self,
        n: usize,
        target: u8,
        lun: u8,
        block_len: u32,
        blocks_total: u64,
        min_bytes: u32,
        max_bytes: u32,
        read_ratio: f64,
    ) -> Vec<Io> {
        (0..n)
            .map(|_| {
                let min_blocks = (min_bytes / block_len).max(1);
                let max_blocks = (max_bytes / block_len).max(min_blocks);
                let blocks = self.rng.u32(min_blocks..=max_blocks);
                let lba = self
                    .rng
                    .u64(0..=blocks_total.saturating_sub(u64::from(blocks)));
                let op = if self.rng.f64() < read_ratio {
                    Op::Read
                } else {
                    Op::Write
                };
                let shape = match self.rng.u8(0..3) {
                    0 => SgShape::Contiguous,
                    1 => SgShape::Pages,
                    _ => SgShape::Odd {
                        seed: self.rng.u64(..),
                    },
                };
                let len = (blocks * block_len) as usize;
                let data = if op == Op::Write {
                    let mut d = vec![0u8; len];
                    self.rng.fill(&mut d);
                    d
                } else {
                    Vec::new()
                };
                Io {
                    target,
                    lun,
                    op,
                    lba,
                    blocks,
                    block_len,
                    shape,
                    data,
                }
            })
            .collect()
    }

    /// As [`Self::ios`], but no two I/Os overlap (each gets its own stripe
    /// of `max_bytes`): safe to have all in flight at once.
    #[must_use]
    #[expect(clippy::too_many_arguments, reason = "the workload's knobs")]
    pub fn disjoint_ios(
        &mut self,
        n: usize,
        target: u8,
        lun: u8,
        block_len: u32,
        blocks_total: u64,
        min_bytes: u32,
        max_bytes: u32,
        read_ratio: f64,
    ) -> Vec<Io> {
        let stripe = u64::from((max_bytes / block_len).max(1));
        let stripes = (blocks_total / stripe).max(1);
        let mut ios = self.ios(
            n, target, lun, block_len, stripe, min_bytes, max_bytes, read_ratio,
        );
        for (i, io) in ios.iter_mut().enumerate() {
            io.lba = (i as u64 % stripes) * stripe;
        }
        ios
    }

    /// Random bytes.
    #[must_use]
    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        let mut d = vec![0u8; len];
        self.rng.fill(&mut d);
        d
    }
}

/// The READ or WRITE CDB for `blocks` at `lba` (10 bytes when it fits).
#[must_use]
pub fn rw_cdb(read: bool, lba: u64, blocks: u32) -> Vec<u8> {
    let rw = ReadWriteCdb::new(lba, blocks);
    cdb_bytes(&if read {
        CdbRepr::Read(rw)
    } else {
        CdbRepr::Write(rw)
    })
}

/// A CDB's bytes.
#[must_use]
pub fn cdb_bytes(repr: &CdbRepr) -> Vec<u8> {
    let mut buf = vec![0u8; repr.buffer_len()];
    if repr.emit(&mut Cdb::new_unchecked(&mut buf[..])).is_err() {
        buf.clear();
    }
    buf
}

/// The first index where `a` and `b` differ (or the shorter length).
#[must_use]
pub fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter()
        .zip(b)
        .position(|(x, y)| x != y)
        .or((a.len() != b.len()).then(|| a.len().min(b.len())))
}

/// A count from the environment (the big sweeps), or `default`.
#[must_use]
pub fn env_count(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

impl crate::driver::FullStack for Stack {
    type Miniport = SrpAdapter;

    fn model(&self) -> &StorPortModel<SrpAdapter> {
        &self.model
    }

    fn scsi(&self, target: u8) -> Arc<kverbs_tools::scsi_target::ScsiTarget> {
        Arc::clone(self.target(usize::from(target)).scsi())
    }
}

/// Asserts the initiator never broke the SRP protocol as target `index`
/// saw it: no credit violation, malformed IU or bad descriptor.
///
/// # Panics
/// If the target counted any.
pub fn assert_initiator_kept_protocol(target: &SrpTarget, index: usize) {
    let c = target.counters();
    assert_eq!(
        (c.credit_violations, c.malformed_ius, c.bad_descriptors),
        (0, 0, 0),
        "target {index}: credit violations, malformed IUs, bad descriptors"
    );
}
