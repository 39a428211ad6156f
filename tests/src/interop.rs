//! The interop harness: the initiator alone — StorPort model → miniport
//! core → SRP engine → kverbs → software HCA — with its HCA on the RoCEv2
//! link of the Linux target VM ([`kverbs_tools::vm`]), logging in to the
//! kernel's `ib_srpt` over Soft-RoCE ([`Interop::start`]), or the iSER
//! engine in place of the SRP one, logging in to LIO's iSCSI target over
//! `ib_isert` ([`Interop::start_iser`]). The stack is generic over the
//! engine ([`InteropEngine`]); everything past the login is the same.
//!
//! The other end is a real kernel, so the data cannot be checked against
//! a medium in this process: a [`ShadowDisk`] per LUN holds what the
//! initiator wrote (blocks never written are unknown and not checked),
//! [`Interop::run_ios`] checks every successful read against it and
//! records every successful write in it. Blocks a failed write covered
//! become unknown again (the write may or may not have landed), so the
//! check stays exact without trusting a status it cannot see past.
//!
//! The link goes through [`LinkWire`], which counts frames and can be
//! blackholed (both directions) to simulate an outage on the wire. Every
//! frame is captured to a pcap in the VM's run directory; the test keeps
//! it on failure and deletes it on success ([`PcapGuard`]).

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hca_lowlevel::sim::{Fabric, LinkStats, SoftHca};
use kverbs::cm::CmPort;
use kverbs::device::Device;
use kverbs::irql::Passive;
use kverbs_tools::bench::linux_vm::vm_initiator_hca;
use kverbs_tools::bench::rdma::{InitiatorHca, adapter_config, bench_platform};
use kverbs_tools::vm::{TargetInfo, Vm};
use storport_srp::iscsi::description::TargetDescription;
use storport_srp::iser::{IserConfig, IserStats, IserTransport};
use storport_srp::miniport::transport::{TargetState, Transport};
use storport_srp::miniport::{Adapter, AdapterConfig, CoreContext, TransportFactory};
use storport_srp::srp::params::parse_add_target;
use storport_srp::srp::{AdapterShape, SrpConfig, SrpTransport, TargetStats};
use storport_srp::storport::host::{
    HostPort, ModelConfig, RequestOutcome, RequestSpec, RequestState, SgShape, StorPortModel,
};
use storport_srp::storport::{Address, SrbFunction, SrbStatus};

use crate::{Hp, Io, IoDone, Op, SetupError, cdb_bytes, first_difference, rw_cdb};
use storport_srp::scsi::cdb::{CdbRepr, InquiryCdb, ReadCapacity16Cdb, ReportLunsCdb};
use storport_srp::scsi::sense::{AdditionalSense, SenseKey, SenseRepr};

/// Waits (real time) until a condition holds (kvbench's, shared).
pub use kverbs_tools::bench::rdma::wait_until;
/// The host end of the VM's Ethernet link (now in `kverbs_tools`, which
/// kvbench's `linux-vm` transports share).
pub use kverbs_tools::vm::link::LinkWire;
pub use kverbs_tools::vm::prepared_or_skip;

/// Deletes the link's pcap when dropped after [`PcapGuard::passed`]; keeps
/// it (and prints where) otherwise, for whoever debugs the failure, and
/// always when `KV_INTEROP_KEEP_PCAP` is set.
#[derive(Debug)]
pub struct PcapGuard {
    path: PathBuf,
    passed: bool,
}

impl PcapGuard {
    /// Guards the capture at `path`.
    #[must_use]
    pub fn new(path: PathBuf) -> Self {
        PcapGuard {
            path,
            passed: false,
        }
    }

    /// The run passed: the capture can go.
    pub fn passed(&mut self) {
        self.passed = true;
    }
}

impl Drop for PcapGuard {
    fn drop(&mut self) {
        if std::env::var_os("KV_INTEROP_KEEP_PCAP").is_some() {
            eprintln!("link capture kept at {}", self.path.display());
        } else if self.passed {
            let _ = std::fs::remove_file(&self.path);
        } else {
            eprintln!(
                "\n*** interop run failed: the link capture is kept at {} ***\n",
                self.path.display()
            );
        }
    }
}

/// What the initiator knows of one LUN's contents: the bytes it wrote,
/// per block known or not.
#[derive(Debug, Clone)]
pub struct ShadowDisk {
    block_len: u32,
    bytes: Vec<u8>,
    known: Vec<bool>,
}

impl ShadowDisk {
    /// A LUN of `blocks` of `block_len`, nothing known.
    #[must_use]
    pub fn new(block_len: u32, blocks: u64) -> Self {
        let blocks = usize::try_from(blocks).unwrap_or(0);
        ShadowDisk {
            block_len,
            bytes: vec![0; blocks * block_len as usize],
            known: vec![false; blocks],
        }
    }

    /// Block size.
    #[must_use]
    pub fn block_len(&self) -> u32 {
        self.block_len
    }

    /// Blocks.
    #[must_use]
    pub fn blocks(&self) -> u64 {
        self.known.len() as u64
    }

    /// Whether every block is known.
    #[must_use]
    pub fn all_known(&self) -> bool {
        self.known.iter().all(|k| *k)
    }

    /// The whole image (meaningful when [`Self::all_known`]).
    #[must_use]
    pub fn image(&self) -> &[u8] {
        &self.bytes
    }

    fn range(&self, lba: u64, blocks: u32) -> std::ops::Range<usize> {
        let b = self.block_len as usize;
        let start = usize::try_from(lba).unwrap_or(usize::MAX) * b;
        start..start + blocks as usize * b
    }

    /// A successful write of `data` at `lba`.
    pub fn wrote(&mut self, lba: u64, data: &[u8]) {
        let blocks = u32::try_from(data.len() / self.block_len as usize).unwrap_or(0);
        let r = self.range(lba, blocks);
        self.bytes[r].copy_from_slice(data);
        for k in &mut self.known[lba as usize..lba as usize + blocks as usize] {
            *k = true;
        }
    }

    /// A write that failed: its blocks may hold anything now.
    pub fn forget(&mut self, lba: u64, blocks: u32) {
        for k in &mut self.known[lba as usize..lba as usize + blocks as usize] {
            *k = false;
        }
    }

    /// Checks a successful read of `data` at `lba`: every known block must
    /// match. Returns the number of blocks checked.
    ///
    /// # Panics
    /// On a mismatch, naming the block and byte.
    pub fn check_read(&self, lba: u64, data: &[u8], what: &str) -> u64 {
        let b = self.block_len as usize;
        let mut checked = 0;
        for (i, got) in data.chunks(b).enumerate() {
            let block = lba as usize + i;
            if !self.known[block] {
                continue;
            }
            let want = &self.bytes[block * b..(block + 1) * b];
            assert!(
                got == want,
                "{what}: block {block} differs from what was written (first difference at byte {:?})",
                first_difference(got, want)
            );
            checked += 1;
        }
        checked
    }
}

/// What the harness needs of an engine besides [`Transport`]: its
/// counters for one target and the connections it holds.
pub trait InteropEngine: Transport {
    /// The engine's per-target counters.
    type Stats: std::fmt::Debug + Default;

    /// Target `target`'s counters.
    fn stats_of(&self, target: u8, p: &Passive<'_>) -> Option<Self::Stats>;

    /// Connections built and not yet released.
    fn connections(&self, p: &Passive<'_>) -> usize;

    /// Logins that succeeded (reconnects included), from `stats`.
    fn logins(stats: &Self::Stats) -> u64;

    /// Sessions lost to a transport failure, from `stats`.
    fn transport_failures(stats: &Self::Stats) -> u64;
}

/// Implements [`InteropEngine`] for engines whose inherent
/// `target_stats`/`open_connections` and whose counters' `logins`/
/// `transport_failures` already answer it (both do, by the same names).
macro_rules! interop_engine {
    ($($engine:ty => $stats:ty),+ $(,)?) => {$(
        impl InteropEngine for $engine {
            type Stats = $stats;

            fn stats_of(&self, target: u8, p: &Passive<'_>) -> Option<$stats> {
                self.target_stats(target, p)
            }

            fn connections(&self, p: &Passive<'_>) -> usize {
                self.open_connections(p)
            }

            fn logins(stats: &$stats) -> u64 {
                stats.logins
            }

            fn transport_failures(stats: &$stats) -> u64 {
                stats.transport_failures
            }
        }
    )+};
}

interop_engine!(SrpTransport<Hp> => TargetStats, IserTransport<Hp> => IserStats);

/// How to build an [`Interop`].
#[derive(Debug, Clone)]
pub struct InteropConfig {
    /// SRP: `add_target` keys beyond the addressing
    /// (`"queue_size=64,max_sect=2048"`). iSER: extra node-record lines
    /// (`"node.session.queue_depth = 16"`), one per line.
    pub keys: String,
    /// The SRP engine's settings.
    pub srp: SrpConfig,
    /// The iSER engine's settings.
    pub iser: IserConfig,
    /// The StorPort model's behaviour.
    pub model: ModelConfig,
    /// LUNs per target StorPort addresses.
    pub luns_per_target: u8,
    /// Initiator memory (data buffers and the engine's IUs).
    pub initiator_memory: usize,
    /// Where the link capture goes.
    pub pcap: Option<PathBuf>,
    /// How long to wait for the login.
    pub live_timeout: Duration,
    /// Whether starting waits for the login at all: off for a login that
    /// is meant to fail, whose stack the test then inspects.
    pub wait_live: bool,
}

impl Default for InteropConfig {
    fn default() -> Self {
        InteropConfig {
            keys: String::new(),
            srp: kverbs_tools::vm::link::tcg_srp_config(),
            iser: IserConfig::default(),
            model: ModelConfig {
                max_requests: 65536,
                ..ModelConfig::default()
            },
            luns_per_target: 2,
            initiator_memory: 384 << 20,
            pcap: None,
            live_timeout: Duration::from_secs(60),
            wait_live: true,
        }
    }
}

/// The initiator stack on the VM's link (see the [module docs](self)),
/// with the SRP engine or (`Interop<IserTransport<Hp>>`) the iSER one.
pub struct Interop<T: InteropEngine = SrpTransport<Hp>> {
    /// The host platform.
    pub platform: Hp,
    /// The fabric holding the one linked HCA.
    pub fabric: Fabric,
    /// The initiator HCA.
    pub initiator: Arc<SoftHca>,
    /// The link socket wrapper.
    pub wire: Arc<LinkWire>,
    /// The initiator device.
    pub device: Device<Hp>,
    /// The port's connection manager.
    pub cm: CmPort<Hp>,
    /// StorPort with the miniport installed.
    pub model: StorPortModel<Adapter<HostPort, T>>,
    /// The adapter's shape.
    pub adapter: AdapterConfig,
    /// What the initiator was told about the target: the SRP `add_target`
    /// string, or the iSER node record.
    pub add_target: String,
    /// When the stack started (StorPort's clock follows it).
    pub started: Instant,
}

/// The `add_target` string for the VM's `ib_srpt`: RDMA/CM form, the
/// target port id being the service GUID (the node GUID) twice.
///
/// # Errors
/// When the VM runs no SRP target or reports an odd GUID.
pub fn srpt_add_target(info: &TargetInfo, keys: &str) -> Result<String, SetupError> {
    kverbs_tools::vm::link::srpt_add_target(info, keys).map_err(|e| SetupError(e.to_string()))
}

/// The iSER node record (the `iscsiadm` form the driver parses) for the
/// VM's LIO iSCSI target: its IQN and iSER portal, our initiator name, a
/// short reconnect delay, then `keys` (extra `key = value` lines).
///
/// # Errors
/// When the VM runs no iSER target.
pub fn isert_node_record(info: &TargetInfo, keys: &str) -> Result<String, SetupError> {
    kverbs_tools::vm::link::isert_node_record(info, crate::iser::INITIATOR_NAME, keys)
        .map_err(|e| SetupError(e.to_string()))
}

fn setup_err(what: &str, e: &dyn std::fmt::Debug) -> SetupError {
    SetupError(format!("{what}: {e:?}"))
}

/// The initiator's HCA on the VM's link with its device and CM port, as
/// kvbench's `linux-vm` transports build it: what both engines run on.
fn linked_hca(
    platform: &Hp,
    info: &TargetInfo,
    wire: &Arc<LinkWire>,
    config: &InteropConfig,
    p: &Passive<'_>,
) -> Result<InitiatorHca, SetupError> {
    vm_initiator_hca(
        platform,
        info,
        wire.clone(),
        config.initiator_memory,
        config.pcap.clone(),
        p,
    )
    .map_err(|e| SetupError(e.to_string()))
}

impl Interop<SrpTransport<Hp>> {
    /// Builds the initiator with the SRP engine on the VM's link (`wire`:
    /// the socket taken from the VM, wrapped; it can serve one stack after
    /// another) and starts the adapter; waits for the target to be live.
    ///
    /// # Errors
    /// [`SetupError`] naming what failed.
    pub fn start(
        platform: Hp,
        info: &TargetInfo,
        wire: Arc<LinkWire>,
        config: &InteropConfig,
        p: &Passive<'_>,
    ) -> Result<Self, SetupError> {
        let hca = linked_hca(&platform, info, &wire, config, p)?;
        let add_target = srpt_add_target(info, &config.keys)?;
        let params = parse_add_target(add_target.as_bytes())
            .map_err(|e| setup_err(&format!("add_target {add_target:?}"), &e))?;
        let shape = SrpTransport::<Hp>::adapter_shape(&[params], &config.srp);
        let srp_config = config.srp;
        let (dev2, cm2) = (hca.device.clone(), hca.cm.clone());
        let make_transport: TransportFactory<SrpTransport<Hp>> =
            Box::new(move |upcalls, p: &Passive<'_>| {
                SrpTransport::new(&dev2, &cm2, srp_config, &[params], upcalls, p)
                    .map_err(|_| kverbs::platform::AllocError)
            });
        Self::assemble(
            platform,
            hca,
            wire,
            shape,
            make_transport,
            add_target,
            config,
            p,
        )
    }
}

impl Interop<IserTransport<Hp>> {
    /// Builds the initiator with the iSER engine on the VM's link, aimed at
    /// the VM's LIO iSCSI target through its iSER portal (the node record
    /// of [`isert_node_record`] with `config.keys`), and starts the
    /// adapter; waits for the session to be live (connect + full login).
    ///
    /// # Errors
    /// [`SetupError`] naming what failed.
    pub fn start_iser(
        platform: Hp,
        info: &TargetInfo,
        wire: Arc<LinkWire>,
        config: &InteropConfig,
        p: &Passive<'_>,
    ) -> Result<Self, SetupError> {
        let hca = linked_hca(&platform, info, &wire, config, p)?;
        let record = isert_node_record(info, &config.keys)?;
        let desc = TargetDescription::parse(&record)
            .map_err(|e| SetupError(format!("node record {record:?}: {e}")))?;
        let descs = vec![desc];
        let shape = IserTransport::<Hp>::adapter_shape(
            &descs,
            hca.device.attr().max_fast_reg_page_list_len,
        );
        let iser_config = config.iser;
        let (dev2, cm2) = (hca.device.clone(), hca.cm.clone());
        let make_transport: TransportFactory<IserTransport<Hp>> =
            Box::new(move |upcalls, p: &Passive<'_>| {
                IserTransport::new(&dev2, &cm2, iser_config, &descs, upcalls, p)
                    .map_err(|_| kverbs::platform::AllocError)
            });
        Self::assemble(
            platform,
            hca,
            wire,
            shape,
            make_transport,
            record,
            config,
            p,
        )
    }
}

impl<T: InteropEngine> Interop<T> {
    /// Installs the miniport with the engine `make_transport` builds on
    /// `hca`, starts the adapter and (unless `config.wait_live` is off)
    /// waits for target 0 to be live.
    #[expect(clippy::too_many_arguments, reason = "the stack's parts")]
    fn assemble(
        platform: Hp,
        hca: InitiatorHca,
        wire: Arc<LinkWire>,
        shape: AdapterShape,
        make_transport: TransportFactory<T>,
        add_target: String,
        config: &InteropConfig,
        p: &Passive<'_>,
    ) -> Result<Self, SetupError> {
        let adapter = adapter_config(&shape, 1, config.luns_per_target);
        let mut model = StorPortModel::with_memory(
            &platform,
            config.model.clone(),
            hca.initiator.phys_memory().clone(),
            p,
        );
        let context = CoreContext {
            config: adapter,
            make_transport,
        };
        model
            .start(&context, p)
            .map_err(|e| setup_err("find_adapter", &e))?;
        let InitiatorHca {
            fabric,
            initiator,
            device,
            cm,
        } = hca;
        let stack = Interop {
            platform,
            fabric,
            initiator,
            wire,
            device,
            cm,
            model,
            adapter,
            add_target,
            started: Instant::now(),
        };
        if config.wait_live && !stack.wait_state(TargetState::Live, config.live_timeout) {
            return Err(SetupError(format!(
                "target not live after {:?}: {:?}; link {:?}",
                config.live_timeout,
                stack.stats(p),
                stack.link_stats()
            )));
        }
        Ok(stack)
    }

    /// The engine.
    #[must_use]
    pub fn transport(&self) -> &T {
        self.model.miniport().transport()
    }

    /// Asserts that every I/O succeeded and completed exactly once; a
    /// failure names the I/O and the engine's counters (why the connection
    /// last ended, which session failure), so a rare one is diagnosable.
    ///
    /// # Panics
    /// On the first that did not, named with `what`.
    pub fn all_succeeded(&self, done: &[IoDone], what: &str, p: &Passive<'_>) {
        if let Some(bad) = done
            .iter()
            .find(|d| d.outcome.status.base() != SrbStatus::SUCCESS || d.outcome.completions != 1)
        {
            panic!(
                "{what}: {bad:?} ({} of {} not SUCCESS once)\nengine: {:?}",
                done.iter()
                    .filter(|d| d.outcome.status.base() != SrbStatus::SUCCESS
                        || d.outcome.completions != 1)
                    .count(),
                done.len(),
                self.stats(p)
            );
        }
    }

    /// The target's counters (engine side).
    #[must_use]
    pub fn stats(&self, p: &Passive<'_>) -> T::Stats {
        self.transport().stats_of(0, p).unwrap_or_default()
    }

    /// The link's counters.
    #[must_use]
    pub fn link_stats(&self) -> Option<LinkStats> {
        self.fabric.link_stats(&self.initiator)
    }

    /// The target's state as the core sees it.
    #[must_use]
    pub fn state(&self) -> TargetState {
        self.model.miniport().core().target_state_of(0)
    }

    /// Waits (real time) until the target is in `state`.
    #[must_use]
    pub fn wait_state(&self, state: TargetState, timeout: Duration) -> bool {
        wait_until(timeout, || self.state() == state)
    }

    /// Moves StorPort's (virtual) clock up to real time since the stack
    /// started, and dispatches what may go. StorPort's clock drives the
    /// retry of requests the miniport answered `SRB_STATUS_BUSY` and the
    /// request timeouts, so against a real target it runs in real time.
    pub fn tick(&self, p: &Passive<'_>) {
        let now = self.started.elapsed();
        let model_now = self.model.now();
        if now > model_now + Duration::from_millis(5) {
            self.model.advance(now - model_now, p);
        } else {
            self.model.pump(p);
        }
    }

    /// Submits a request.
    ///
    /// # Panics
    /// If the model cannot create it.
    pub fn submit(&self, spec: &RequestSpec, p: &Passive<'_>) -> u32 {
        match self.model.submit(spec, p) {
            Ok(id) => id,
            Err(e) => panic!("submit: {e:?}"),
        }
    }

    /// Whether request `id` has completed.
    #[must_use]
    pub fn done(&self, id: u32) -> bool {
        self.model
            .outcome(id)
            .is_some_and(|o| o.state == RequestState::Completed)
    }

    /// Waits for requests to complete (real time; StorPort's clock does
    /// not move).
    ///
    /// # Panics
    /// If one has not completed within `timeout`.
    pub fn wait(&self, ids: &[u32], timeout: Duration, p: &Passive<'_>) -> Vec<RequestOutcome> {
        let start = Instant::now();
        while !ids.iter().all(|id| self.done(*id)) {
            assert!(
                start.elapsed() < timeout,
                "requests not completed in {timeout:?}: {:?}; engine {:?}",
                ids.iter()
                    .filter(|id| !self.done(**id))
                    .map(|id| (id, self.model.outcome(*id)))
                    .collect::<Vec<_>>(),
                self.stats(p)
            );
            self.tick(p);
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

    /// A command with data-in of `len` bytes; waits; returns the outcome
    /// and the bytes that moved.
    pub fn command_in(
        &self,
        lun: u8,
        cdb: &[u8],
        len: u32,
        p: &Passive<'_>,
    ) -> (RequestOutcome, Vec<u8>) {
        let spec = RequestSpec::scsi_in(Address::new(0, 0, lun), cdb, len).timeout(IO_TIMEOUT_SECS);
        let id = self.submit(&spec, p);
        let out = self
            .wait(&[id], Duration::from_secs(60), p)
            .into_iter()
            .next()
            .unwrap_or_else(|| panic!("no outcome"));
        let mut data = self.model.data(id).unwrap_or_default();
        data.truncate(out.data_transfer_length as usize);
        let _ = self.model.release(id);
        (out, data)
    }

    /// INQUIRY (standard data, 96 bytes).
    pub fn inquiry(&self, lun: u8, p: &Passive<'_>) -> (RequestOutcome, Vec<u8>) {
        let cdb = cdb_bytes(&CdbRepr::Inquiry(InquiryCdb {
            alloc_len: 96,
            ..InquiryCdb::default()
        }));
        self.command_in(lun, &cdb, 96, p)
    }

    /// INQUIRY of a VPD page.
    pub fn inquiry_vpd(&self, lun: u8, page: u8, p: &Passive<'_>) -> (RequestOutcome, Vec<u8>) {
        let cdb = cdb_bytes(&CdbRepr::Inquiry(InquiryCdb {
            evpd: true,
            page_code: page,
            alloc_len: 252,
            ..InquiryCdb::default()
        }));
        self.command_in(lun, &cdb, 252, p)
    }

    /// READ CAPACITY(16).
    pub fn read_capacity(&self, lun: u8, p: &Passive<'_>) -> (RequestOutcome, Vec<u8>) {
        let cdb = cdb_bytes(&CdbRepr::ReadCapacity16(ReadCapacity16Cdb {
            alloc_len: 32,
            ..ReadCapacity16Cdb::default()
        }));
        self.command_in(lun, &cdb, 32, p)
    }

    /// REPORT LUNS.
    pub fn report_luns(&self, p: &Passive<'_>) -> (RequestOutcome, Vec<u8>) {
        let cdb = cdb_bytes(&CdbRepr::ReportLuns(ReportLunsCdb {
            select_report: 0,
            alloc_len: 4096,
        }));
        self.command_in(0, &cdb, 4096, p)
    }

    /// Runs `ios` (on target 0) keeping up to `depth` in flight, no two in
    /// flight overlapping; checks each successful read against the LUN's
    /// shadow and records each successful write in it; a failed write
    /// makes its blocks unknown. Each request is released once checked,
    /// so the outcomes returned in `ios` order carry no data.
    ///
    /// # Panics
    /// On a data mismatch, or an I/O not done within `timeout`.
    pub fn run_ios(
        &self,
        ios: &[Io],
        depth: usize,
        shadows: &mut BTreeMap<u8, ShadowDisk>,
        timeout: Duration,
        p: &Passive<'_>,
    ) -> Vec<IoDone> {
        self.run_ios_measured(ios, depth, shadows, timeout, p).0
    }

    /// [`Self::run_ios`], also saying how deep the queue really was: an
    /// I/O overlapping one in flight waits for it (and everything behind
    /// waits too), so the depth asked for is a ceiling, not a fact.
    ///
    /// # Panics
    /// As [`Self::run_ios`].
    pub fn run_ios_measured(
        &self,
        ios: &[Io],
        depth: usize,
        shadows: &mut BTreeMap<u8, ShadowDisk>,
        timeout: Duration,
        p: &Passive<'_>,
    ) -> (Vec<IoDone>, QueueDepth) {
        let depth = depth.max(1);
        let mut queue = QueueDepth::default();
        let mut depth_time = 0.0f64;
        let mut last = Instant::now();
        let mut results: Vec<Option<IoDone>> = (0..ios.len()).map(|_| None).collect();
        let mut next = 0usize;
        let mut in_flight: BTreeMap<u32, usize> = BTreeMap::new();
        let start = Instant::now();
        while next < ios.len() || !in_flight.is_empty() {
            while next < ios.len() && in_flight.len() < depth {
                let Some(io) = ios.get(next) else { break };
                let overlaps = in_flight.values().filter_map(|i| ios.get(*i)).any(|o| {
                    o.lun == io.lun
                        && o.lba < io.lba + u64::from(io.blocks)
                        && io.lba < o.lba + u64::from(o.blocks)
                });
                if overlaps {
                    break;
                }
                let spec = io_spec(io);
                let now = Instant::now();
                depth_time += in_flight.len() as f64 * (now - last).as_secs_f64();
                last = now;
                let id = self.submit(&spec, p);
                in_flight.insert(id, next);
                next += 1;
                queue.peak = queue.peak.max(in_flight.len());
            }
            let finished: Vec<u32> = in_flight
                .keys()
                .copied()
                .filter(|id| self.done(*id))
                .collect();
            if !finished.is_empty() {
                let now = Instant::now();
                depth_time += in_flight.len() as f64 * (now - last).as_secs_f64();
                last = now;
            }
            for id in finished {
                let Some(index) = in_flight.remove(&id) else {
                    continue;
                };
                let Some(io) = ios.get(index) else { continue };
                let outcome = self
                    .model
                    .outcome(id)
                    .unwrap_or_else(|| panic!("no request {id}"));
                let data = self.model.data(id).unwrap_or_default();
                let shadow = shadows
                    .get_mut(&io.lun)
                    .unwrap_or_else(|| panic!("no shadow of LUN {}", io.lun));
                let ok = outcome.status.base() == SrbStatus::SUCCESS;
                match (io.op, ok) {
                    (Op::Write, true) => shadow.wrote(io.lba, &io.data),
                    (Op::Write, false) => shadow.forget(io.lba, io.blocks),
                    (Op::Read, true) => {
                        assert_eq!(
                            outcome.data_transfer_length as usize,
                            io.blocks as usize * io.block_len as usize,
                            "{io:?} {outcome:?}"
                        );
                        shadow.check_read(io.lba, &data, &format!("{io:?}"));
                    }
                    (Op::Read, false) => {}
                }
                // Done with it: StorPort frees the SRB and its buffer.
                let _ = self.model.release(id);
                if let Some(slot) = results.get_mut(index) {
                    *slot = Some(IoDone {
                        id,
                        outcome,
                        data: Vec::new(),
                    });
                }
            }
            assert!(
                start.elapsed() < timeout,
                "I/O did not finish in {timeout:?}: {} in flight; engine {:?}",
                in_flight.len(),
                self.stats(p)
            );
            if !in_flight.is_empty() {
                self.tick(p);
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        let secs = start.elapsed().as_secs_f64();
        if secs > 0.0 {
            queue.mean = depth_time / secs;
        }
        let results = results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| panic!("missing result")))
            .collect();
        (results, queue)
    }

    /// Stops the adapter (the orderly logout: the engine disconnects its
    /// channels) and checks it let go of every connection.
    ///
    /// # Panics
    /// If it does not stop in time or leaves a connection open.
    pub fn stop(&self, p: &Passive<'_>) {
        self.model.settle();
        assert!(self.model.stop_adapter(p), "stop adapter");
        let stopped = wait_until(Duration::from_secs(60), || {
            self.model.miniport().core().state() == storport_srp::miniport::AdapterState::Stopped
        });
        assert!(stopped, "the adapter did not stop");
        assert_eq!(
            self.transport().connections(p),
            0,
            "connections left open after stop"
        );
    }

    /// Tears everything down and checks: the CM port has no consumer
    /// left, every request completed exactly once (the model), and the
    /// verifier saw no violation. Call [`Self::stop`] first.
    ///
    /// # Panics
    /// On any failed check.
    pub fn finish(mut self, p: &Passive<'_>) {
        self.model.free_adapter(p);
        crate::close_initiator(&self.cm, &self.device, p);
        let Interop { model, fabric, .. } = self;
        model.finish();
        drop(fabric);
    }
}

/// How many I/Os a run really kept in flight.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct QueueDepth {
    /// The most in flight at once.
    pub peak: usize,
    /// In flight on average over the run (time-weighted).
    pub mean: f64,
}

/// StorPort's request timeout for the interop I/O: Windows' disk class
/// default (`TimeOutValue` 60 s). A TCG guest serving 64 MiB queued at a
/// few MiB/s takes longer than the older 10 s default.
pub const IO_TIMEOUT_SECS: u32 = 60;

/// The request for an I/O (target 0).
#[must_use]
pub fn io_spec(io: &Io) -> RequestSpec {
    let address = Address::new(0, 0, io.lun);
    match io.op {
        Op::Read => RequestSpec::scsi_in(
            address,
            &rw_cdb(true, io.lba, io.blocks),
            io.blocks * io.block_len,
        ),
        Op::Write => {
            RequestSpec::scsi_out(address, &rw_cdb(false, io.lba, io.blocks), io.data.clone())
        }
    }
    .shaped(io.shape)
    .timeout(IO_TIMEOUT_SECS)
}

/// A host platform shaped like the full-stack harness's (threaded, two
/// processors), with a DPC budget that tolerates a loaded two-core host:
/// kvbench's, with two processors.
#[must_use]
pub fn interop_platform() -> Hp {
    bench_platform(2)
}

/// Sizes drawn log-uniformly from `min..=max` bytes (whole blocks): as
/// many small I/Os as large ones per octave, so the whole range is
/// covered by a few thousand I/Os.
#[must_use]
pub fn log_uniform_blocks(rng: &mut fastrand::Rng, block_len: u32, min: u32, max: u32) -> u32 {
    let lo = f64::from((min / block_len).max(1)).ln();
    let hi = f64::from((max / block_len).max(1)).ln();
    let x = lo + rng.f64() * (hi - lo);
    let blocks = x.exp().round() as u32;
    blocks.clamp((min / block_len).max(1), (max / block_len).max(1))
}

/// `n` I/Os on `lun` of a `blocks_total`-block LUN: reads with
/// probability `read_ratio`, sizes log-uniform in `min..=max` bytes,
/// buffer shapes contiguous, per page or odd.
#[must_use]
#[expect(clippy::too_many_arguments, reason = "the workload's knobs")]
pub fn workload(
    rng: &mut fastrand::Rng,
    n: usize,
    lun: u8,
    block_len: u32,
    blocks_total: u64,
    min: u32,
    max: u32,
    read_ratio: f64,
) -> Vec<Io> {
    (0..n)
        .map(|_| {
            let blocks = log_uniform_blocks(rng, block_len, min, max);
            let lba = rng.u64(0..=blocks_total.saturating_sub(u64::from(blocks)));
            let op = if rng.f64() < read_ratio {
                Op::Read
            } else {
                Op::Write
            };
            let shape = match rng.u8(0..3) {
                0 => SgShape::Contiguous,
                1 => SgShape::Pages,
                _ => SgShape::Odd { seed: rng.u64(..) },
            };
            let data = if op == Op::Write {
                let mut d = vec![0u8; (blocks * block_len) as usize];
                rng.fill(&mut d);
                d
            } else {
                Vec::new()
            };
            Io {
                target: 0,
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

// ------------------------------------------------------------------------
// Scaffolding the VM interop tests share (`vm_srp_interop`,
// `vm_iser_interop`): preparing the VM, guest commands, sense decoding,
// the class driver's unit-attention retry, the record of what each phase
// did, and the submit/settle helpers of the task-management and recovery
// phases.

/// Runs a shell command in the guest; its output.
///
/// # Panics
/// When the command fails (the error names it and its output).
pub fn exec(vm: &Vm, cmd: &str) -> String {
    match vm.exec_ok(cmd) {
        Ok(out) => out,
        Err(e) => panic!("{e}"),
    }
}

/// The sense of a CHECK CONDITION, decoded.
#[must_use]
pub fn sense_of(o: &RequestOutcome) -> Option<SenseRepr> {
    (o.scsi_status == 0x02)
        .then(|| SenseRepr::parse(&o.sense).ok())
        .flatten()
}

/// Issues a data-in command, retrying on UNIT ATTENTION as the class
/// driver does; returns the outcome, the data and the unit attentions
/// seen on the way.
///
/// # Panics
/// After four unit attentions in a row.
pub fn command_in_ua<T: InteropEngine>(
    s: &Interop<T>,
    lun: u8,
    f: impl Fn(&Interop<T>, u8, &Passive<'_>) -> (RequestOutcome, Vec<u8>),
    p: &Passive<'_>,
) -> (RequestOutcome, Vec<u8>, Vec<AdditionalSense>) {
    let mut uas = Vec::new();
    for _ in 0..4 {
        let (o, data) = f(s, lun, p);
        match sense_of(&o) {
            Some(sense) if sense.key == SenseKey::UnitAttention => uas.push(sense.code),
            _ => return (o, data, uas),
        }
    }
    panic!("LUN {lun}: unit attention after unit attention: {uas:?}");
}

/// What a run did, phase by phase: each line printed as it happens (with
/// the test's prefix) and again in the summary at the end.
#[derive(Debug)]
pub struct Record {
    prefix: &'static str,
    lines: Vec<String>,
}

impl Record {
    /// An empty record whose lines are printed as `[prefix] line`.
    #[must_use]
    pub fn new(prefix: &'static str) -> Self {
        Record {
            prefix,
            lines: Vec::new(),
        }
    }

    /// Notes (and prints) one line.
    pub fn note(&mut self, line: String) {
        eprintln!("[{}] {line}", self.prefix);
        self.lines.push(line);
    }

    /// Prints every line noted, as the run's summary.
    pub fn print_summary(&self) {
        eprintln!("\n[{}] summary:", self.prefix);
        for l in &self.lines {
            eprintln!("  {l}");
        }
    }
}

/// Non-overlapping large I/O on `lun`, one stripe of `bytes` each,
/// alternately writes (random data) and reads, per-page buffers.
#[must_use]
pub fn stripes(rng: &mut fastrand::Rng, sh: &ShadowDisk, lun: u8, n: usize, bytes: u32) -> Vec<Io> {
    let blocks = bytes / sh.block_len();
    (0..n)
        .map(|i| {
            let op = if i % 2 == 0 { Op::Write } else { Op::Read };
            let data = if op == Op::Write {
                let mut d = vec![0u8; bytes as usize];
                rng.fill(&mut d);
                d
            } else {
                Vec::new()
            };
            Io {
                target: 0,
                lun,
                op,
                lba: (i as u64 * u64::from(blocks)) % sh.blocks(),
                blocks,
                block_len: sh.block_len(),
                shape: SgShape::Pages,
                data,
            }
        })
        .collect()
}

impl<T: InteropEngine> Interop<T> {
    /// Submits `ios` at once; returns their ids.
    pub fn submit_all(&self, ios: &[Io], p: &Passive<'_>) -> Vec<u32> {
        ios.iter().map(|io| self.submit(&io_spec(io), p)).collect()
    }

    /// Applies finished I/Os (`ids`, submitted for `ios`) to the shadows as
    /// [`Self::run_ios`] does, checks the reads, releases the requests;
    /// returns how many ended with each status.
    ///
    /// # Panics
    /// If one is not completed exactly once, a failed one moved data, or a
    /// read does not match.
    pub fn settle_into_shadows(
        &self,
        ios: &[Io],
        ids: &[u32],
        shadows: &mut BTreeMap<u8, ShadowDisk>,
    ) -> HashMap<SrbStatus, usize> {
        let mut by_status = HashMap::new();
        for (io, id) in ios.iter().zip(ids) {
            let o = self
                .model
                .outcome(*id)
                .unwrap_or_else(|| panic!("no request {id}"));
            assert_eq!(o.completions, 1, "{o:?}");
            *by_status.entry(o.status.base()).or_insert(0) += 1;
            let sh = shadows
                .get_mut(&io.lun)
                .unwrap_or_else(|| panic!("no shadow of LUN {}", io.lun));
            let ok = o.status.base() == SrbStatus::SUCCESS;
            if !ok {
                assert_eq!(o.data_transfer_length, 0, "a failed I/O moved data: {o:?}");
            }
            match (io.op, ok) {
                (Op::Write, true) => sh.wrote(io.lba, &io.data),
                (Op::Write, false) => sh.forget(io.lba, io.blocks),
                (Op::Read, true) => {
                    let data = self.model.data(*id).unwrap_or_default();
                    sh.check_read(io.lba, &data, &format!("{io:?}"));
                }
                (Op::Read, false) => {}
            }
            let _ = self.model.release(*id);
        }
        by_status
    }

    /// Reads every LUN whole (1 MiB reads, depth 16) and checks it against
    /// the shadow, then rewrites the LUNs with blocks a failed write made
    /// unknown, so later phases check everything again.
    ///
    /// # Panics
    /// On a mismatch or a failed I/O.
    pub fn verify_all(&self, shadows: &mut BTreeMap<u8, ShadowDisk>, p: &Passive<'_>) {
        let mut rng = fastrand::Rng::with_seed(0x5eed_0003);
        let mut ios = Vec::new();
        for (lun, sh) in shadows.iter() {
            let per = MIB / sh.block_len();
            for lba in (0..sh.blocks()).step_by(per as usize) {
                let blocks = per.min(u32::try_from(sh.blocks() - lba).unwrap_or(per));
                ios.push(Io {
                    target: 0,
                    lun: *lun,
                    op: Op::Read,
                    lba,
                    blocks,
                    block_len: sh.block_len(),
                    shape: SgShape::Contiguous,
                    data: Vec::new(),
                });
            }
        }
        let done = self.run_ios(&ios, 16, shadows, Duration::from_secs(300), p);
        self.all_succeeded(&done, "verify", p);
        let mut rewrite = Vec::new();
        for (lun, sh) in shadows.iter() {
            if sh.all_known() {
                continue;
            }
            let per = MIB / sh.block_len();
            for lba in (0..sh.blocks()).step_by(per as usize) {
                let blocks = per.min(u32::try_from(sh.blocks() - lba).unwrap_or(per));
                let mut data = vec![0u8; (blocks * sh.block_len()) as usize];
                rng.fill(&mut data);
                rewrite.push(Io {
                    target: 0,
                    lun: *lun,
                    op: Op::Write,
                    lba,
                    blocks,
                    block_len: sh.block_len(),
                    shape: SgShape::Pages,
                    data,
                });
            }
        }
        let done = self.run_ios(&rewrite, 16, shadows, Duration::from_secs(300), p);
        self.all_succeeded(&done, "rewrite", p);
    }
}

/// The kernel log lines of the Linux targets and Soft-RoCE (the evidence
/// when something fails).
pub fn target_log(vm: &Vm) -> String {
    exec(
        vm,
        "dmesg | grep -i -E 'srpt|isert|iscsi|rxe|target' | tail -40 || true",
    )
}

/// What the ABORT TASK rounds of [`Interop::abort_queued_tasks`] found.
#[derive(Debug, Default)]
pub struct AbortTally {
    /// Aborts answered SUCCESS: the victim ended ABORTED, no data moved.
    pub aborted: usize,
    /// Aborts answered ABORT_FAILED: the victim finished first (or an
    /// escalation reset it).
    pub too_late: usize,
    /// The operations of the aborted victims.
    pub aborted_ops: Vec<Op>,
    /// The operations of the victims the abort came too late for.
    pub late_ops: Vec<Op>,
}

/// What a short target outage did (see [`Interop::short_outage`]).
#[derive(Debug)]
pub struct ShortOutage<S> {
    /// The engine's counters before the outage.
    pub before: S,
    /// From disabling the TPG to the engine seeing the session gone.
    pub lost_after: Duration,
    /// The engine's counters when it saw the session gone.
    pub at_loss: S,
    /// I/Os submitted during the outage.
    pub submitted_during: usize,
    /// Of those, how many were still held 3 s later.
    pub held: usize,
    /// The engine's counters just before the TPG was enabled again.
    pub before_enable: S,
    /// From enabling the TPG to the target being live again.
    pub back_after: Duration,
    /// How the I/Os in flight at the drop ended.
    pub in_flight: HashMap<SrbStatus, usize>,
    /// How the I/Os submitted during the outage ended.
    pub during: HashMap<SrbStatus, usize>,
}

/// What an outage past fast-fail did (see [`Interop::outage_past_fast_fail`]).
#[derive(Debug)]
pub struct LongOutage {
    /// From disabling the TPG to every I/O submitted during it completing.
    pub failed_after_drop: Duration,
    /// From submitting those I/Os to all of them completing.
    pub failed_after_submit: Duration,
    /// I/Os submitted during the outage.
    pub submitted: usize,
    /// How they ended.
    pub outcomes: HashMap<SrbStatus, usize>,
    /// The target's state once they had ended (before re-enabling).
    pub state_when_failed: TargetState,
}

/// The phases both interop tests (SRP against `ib_srpt`, iSER against
/// LIO's isert) run the same way: ABORT TASK, LUN RESET, the target
/// dropping the session. Each asserts what holds for either engine; the
/// tests add what is particular to theirs.
impl<T: InteropEngine> Interop<T> {
    /// ABORT TASK of commands still queued at the target: 12 MiB of
    /// 512 KiB writes and reads queued at once on LUN 1, the last four
    /// aborted at once. Under TCG the target is still busy with the first
    /// ones, so the victims are still queued there. Each abort must be
    /// answered exactly once and agree with its victim's outcome: SUCCESS
    /// with the victim ABORTED and no data, or ABORT_FAILED with the victim
    /// finished on its own — or reset (BUS_RESET) by the engine escalating
    /// a TMF that timed out, which `escalated` reads from the engine's
    /// counters. Up to three rounds, until one abort found its victim.
    ///
    /// # Panics
    /// When an abort and its victim disagree, or no round aborted anything.
    pub fn abort_queued_tasks(
        &self,
        rng: &mut fastrand::Rng,
        shadows: &mut BTreeMap<u8, ShadowDisk>,
        escalated: impl Fn(&T::Stats) -> bool,
        rec: &mut Record,
        p: &Passive<'_>,
    ) -> AbortTally {
        let mut tally = AbortTally::default();
        for round in 0..3 {
            let ios = stripes(rng, &shadows[&1], 1, 24, 512 << 10);
            let ids = self.submit_all(&ios, p);
            let victims: Vec<u32> = ids[20..].to_vec();
            let aborts: Vec<u32> = victims
                .iter()
                .map(|v| self.submit(&RequestSpec::abort(Address::new(0, 0, 1), *v), p))
                .collect();
            let out = self.wait(&aborts, Duration::from_secs(120), p);
            self.wait(&ids, Duration::from_secs(120), p);
            for ((o, v), io) in out.iter().zip(&victims).zip(&ios[20..]) {
                assert_eq!(o.completions, 1, "abort: {o:?}");
                let victim = self
                    .model
                    .outcome(*v)
                    .unwrap_or_else(|| panic!("no victim {v}"));
                match o.status.base() {
                    SrbStatus::SUCCESS => {
                        tally.aborted += 1;
                        tally.aborted_ops.push(io.op);
                        assert_eq!(victim.status.base(), SrbStatus::ABORTED, "{victim:?}");
                        assert_eq!(victim.data_transfer_length, 0, "{victim:?}");
                    }
                    SrbStatus::ABORT_FAILED => {
                        tally.too_late += 1;
                        tally.late_ops.push(io.op);
                        let st = self.stats(p);
                        let reset_by_escalation =
                            escalated(&st) && victim.status.base() == SrbStatus::BUS_RESET;
                        assert!(
                            victim.status.base() == SrbStatus::SUCCESS || reset_by_escalation,
                            "abort failed, victim {victim:?}; engine {st:?}"
                        );
                    }
                    _ => panic!("abort: {o:?} (victim {victim:?})"),
                }
            }
            let by_status = self.settle_into_shadows(&ios, &ids, shadows);
            rec.note(format!("abort round {round}: I/O outcomes {by_status:?}"));
            if tally.aborted > 0 {
                break;
            }
        }
        assert!(
            tally.aborted > 0,
            "no ABORT TASK found its command still queued at the target"
        );
        tally
    }

    /// LUN RESET with 24 MiB (1 MiB each) in flight on LUN 0: reported
    /// (once, SUCCESS) after every command of the LUN completed, each
    /// truthfully; the next command sees the target's unit attention for
    /// the reset (or none), then the LUN works. Returns the I/O count,
    /// their outcomes and the unit attentions.
    ///
    /// # Panics
    /// When any of that does not hold.
    pub fn lun_reset_during_io(
        &self,
        rng: &mut fastrand::Rng,
        shadows: &mut BTreeMap<u8, ShadowDisk>,
        p: &Passive<'_>,
    ) -> (usize, HashMap<SrbStatus, usize>, Vec<AdditionalSense>) {
        let ios = stripes(rng, &shadows[&0], 0, 24, MIB);
        let ids = self.submit_all(&ios, p);
        std::thread::sleep(Duration::from_millis(20));
        let reset = self.submit(
            &RequestSpec::function(SrbFunction::ResetLogicalUnit, Address::new(0, 0, 0)),
            p,
        );
        assert!(
            wait_until(Duration::from_secs(120), || self.done(reset)),
            "LUN reset not done: {:?}",
            self.stats(p)
        );
        assert!(
            ids.iter().all(|id| self.done(*id)),
            "a LUN command outlived its reset"
        );
        let o = self
            .model
            .outcome(reset)
            .unwrap_or_else(|| panic!("no reset request {reset}"));
        assert_eq!(o.status.base(), SrbStatus::SUCCESS, "LUN reset: {o:?}");
        assert_eq!(o.completions, 1, "{o:?}");
        let by_status = self.settle_into_shadows(&ios, &ids, shadows);
        for st in by_status.keys() {
            assert!(
                [SrbStatus::SUCCESS, SrbStatus::BUS_RESET, SrbStatus::ABORTED].contains(st),
                "after a LUN reset: {by_status:?}"
            );
        }
        let (o, _, uas) = command_in_ua(self, 0, |s, l, p| s.read_capacity(l, p), p);
        assert_eq!(o.status.base(), SrbStatus::SUCCESS, "{o:?}");
        (ios.len(), by_status, uas)
    }

    /// A short outage: the TPG at `tpg` (its configfs directory in `vm`) is
    /// disabled with 4 MiB in flight on LUN 0, 512 KiB more is submitted
    /// to LUN 1 during the outage, and after 3 s the TPG is enabled again.
    /// The engine must notice the drop, log in again, and complete the I/O
    /// truthfully (success, reset, aborted or error); what was submitted
    /// during the outage must succeed after the reconnect.
    ///
    /// # Panics
    /// When any of that does not hold.
    pub fn short_outage(
        &self,
        rng: &mut fastrand::Rng,
        shadows: &mut BTreeMap<u8, ShadowDisk>,
        vm: &Vm,
        tpg: &str,
        p: &Passive<'_>,
    ) -> ShortOutage<T::Stats> {
        let before = self.stats(p);
        let ios = stripes(rng, &shadows[&0], 0, 16, 256 << 10);
        let ids = self.submit_all(&ios, p);
        let t = Instant::now();
        exec(vm, &format!("echo 0 > {tpg}/enable"));
        assert!(
            wait_until(Duration::from_secs(30), || self.state()
                != TargetState::Live),
            "the engine did not notice the target dropping the session: {:?}",
            self.stats(p)
        );
        let lost_after = t.elapsed();
        let at_loss = self.stats(p);
        let during = stripes(rng, &shadows[&1], 1, 8, 64 << 10);
        let during_ids = self.submit_all(&during, p);
        std::thread::sleep(Duration::from_secs(3));
        let held = during_ids.iter().filter(|id| !self.done(**id)).count();
        let before_enable = self.stats(p);
        exec(vm, &format!("echo 1 > {tpg}/enable"));
        let t = Instant::now();
        assert!(
            self.wait_state(TargetState::Live, Duration::from_secs(60)),
            "no reconnect: {:?}\n{}",
            self.stats(p),
            target_log(vm)
        );
        let back_after = t.elapsed();
        self.wait(&ids, Duration::from_secs(120), p);
        self.wait(&during_ids, Duration::from_secs(120), p);
        let a = self.settle_into_shadows(&ios, &ids, shadows);
        let b = self.settle_into_shadows(&during, &during_ids, shadows);
        for st in a.keys().chain(b.keys()) {
            assert!(
                [
                    SrbStatus::SUCCESS,
                    SrbStatus::BUS_RESET,
                    SrbStatus::ABORTED,
                    SrbStatus::ERROR
                ]
                .contains(st),
                "short outage: {a:?} {b:?}"
            );
        }
        assert_eq!(
            b.get(&SrbStatus::SUCCESS).copied().unwrap_or(0),
            during.len(),
            "I/O submitted during a short outage completes after the reconnect: {b:?}"
        );
        let st = self.stats(p);
        assert!(T::logins(&st) > T::logins(&before), "{st:?}");
        assert!(
            T::transport_failures(&st) > T::transport_failures(&before),
            "{st:?}"
        );
        ShortOutage {
            before,
            lost_after,
            at_loss,
            submitted_during: during.len(),
            held,
            before_enable,
            back_after,
            in_flight: a,
            during: b,
        }
    }

    /// An outage past fast-fail: the TPG is disabled, 512 KiB is submitted
    /// to LUN 1 once the engine saw the session gone, and the TPG stays
    /// disabled until all of it completed (within 60 s); then it is
    /// enabled again and the engine must log in again. What the I/O must
    /// have ended with is the caller's to check.
    ///
    /// # Panics
    /// When the engine misses the drop, the I/O does not complete, or the
    /// engine does not reconnect.
    pub fn outage_past_fast_fail(
        &self,
        rng: &mut fastrand::Rng,
        shadows: &mut BTreeMap<u8, ShadowDisk>,
        vm: &Vm,
        tpg: &str,
        p: &Passive<'_>,
    ) -> LongOutage {
        // The fast-fail timer starts when the connection is lost, after this.
        let dropped = Instant::now();
        exec(vm, &format!("echo 0 > {tpg}/enable"));
        assert!(wait_until(Duration::from_secs(30), || self.state()
            != TargetState::Live));
        let during = stripes(rng, &shadows[&1], 1, 8, 64 << 10);
        let during_ids = self.submit_all(&during, p);
        let submitted = Instant::now();
        self.wait(&during_ids, Duration::from_secs(60), p);
        let failed_after_submit = submitted.elapsed();
        let failed_after_drop = dropped.elapsed();
        let outcomes = self.settle_into_shadows(&during, &during_ids, shadows);
        let state_when_failed = self.state();
        exec(vm, &format!("echo 1 > {tpg}/enable"));
        assert!(
            self.wait_state(TargetState::Live, Duration::from_secs(60)),
            "no reconnect after fail-fast: {:?}",
            self.stats(p)
        );
        LongOutage {
            failed_after_drop,
            failed_after_submit,
            submitted: during.len(),
            outcomes,
            state_when_failed,
        }
    }

    /// After the outages: every LUN read whole and checked, then 64 random
    /// data-checked I/Os (512 B..256 KiB, half reads, alternating LUNs 0
    /// and 1, each passed through `adapt`) at depth 16, all of which must
    /// succeed. Returns how many random I/Os ran.
    ///
    /// # Panics
    /// On a mismatch or a failed I/O.
    pub fn resume_after_outage(
        &self,
        rng: &mut fastrand::Rng,
        shadows: &mut BTreeMap<u8, ShadowDisk>,
        adapt: impl Fn(Io) -> Io,
        p: &Passive<'_>,
    ) -> usize {
        self.verify_all(shadows, p);
        let ios: Vec<Io> = (0..64u8)
            .flat_map(|i| {
                let lun = i % 2;
                let sh = &shadows[&lun];
                workload(
                    rng,
                    1,
                    lun,
                    sh.block_len(),
                    sh.blocks(),
                    512,
                    256 << 10,
                    0.5,
                )
            })
            .map(adapt)
            .collect();
        let done = self.run_ios(&ios, 16, shadows, Duration::from_secs(300), p);
        self.all_succeeded(&done, "after reconnect", p);
        ios.len()
    }
}

/// One MiB.
pub const MIB: u32 = 1 << 20;

/// Moves each I/O (keeping its LUN and size) to a random place clear of
/// the `window` I/Os before it on the same LUN, when one is found in a
/// bounded number of draws, so that `run_ios` at depth `window` seldom
/// waits on an overlap.
pub fn spread(
    rng: &mut fastrand::Rng,
    ios: &mut [Io],
    window: usize,
    shadows: &BTreeMap<u8, ShadowDisk>,
) {
    for i in 0..ios.len() {
        let (before, rest) = ios.split_at_mut(i);
        let io = &mut rest[0];
        let recent = &before[i.saturating_sub(window)..];
        let clear = |lba: u64| {
            recent.iter().all(|o| {
                o.lun != io.lun
                    || o.lba + u64::from(o.blocks) <= lba
                    || lba + u64::from(io.blocks) <= o.lba
            })
        };
        if clear(io.lba) {
            continue;
        }
        let last = shadows
            .get(&io.lun)
            .map_or(0, ShadowDisk::blocks)
            .saturating_sub(u64::from(io.blocks));
        if let Some(lba) = (0..200).map(|_| rng.u64(0..=last)).find(|l| clear(*l)) {
            io.lba = lba;
        }
    }
}
