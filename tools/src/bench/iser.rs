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

use kverbs::irql::Passive;
use kverbs::platform::host::HostPlatform;
use storport_srp::iscsi::description::TargetDescription;
use storport_srp::iser::{IserConfig, IserTransport};
use storport_srp::storport::host::SgShape;

use super::backend::BackendError;
use super::model::{ModelBackend, ModelIdentity};
use super::rdma::{
    BenchTarget, EngineMiniport, InitiatorHca, RdmaParts, STEP_TIMEOUT, StackPlan, StartedStack,
    bench_platform, in_process_cm_timing, rdma_backend, start_stack, step_error, target_ip,
};
use crate::iser_target::{IserTarget, IserTargetConfig};
use crate::scsi_target::{BlockSize, LunConfig};

/// The miniport with the iSER engine.
pub type IserMiniport = EngineMiniport<IserTransport<HostPlatform>>;

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
/// [`ModelBackend::kept`]); its `descriptions` are the node records.
pub type IserParts = RdmaParts<IserTarget>;

impl BenchTarget for IserTarget {
    fn stop_and_check(self, index: usize, p: &Passive<'_>) -> Vec<String> {
        let mut found = Vec::new();
        let c = self.counters();
        let out_of_window = self.with_logic(|l| l.counters().out_of_window);
        if (c.malformed, c.wr_errors, c.login_pdus_early, out_of_window) != (0, 0, 0, 0) {
            found.push(format!(
                "target {index} saw the initiator break iSER/iSCSI: {} malformed PDU(s), {} work \
                 request error(s), {} login PDU(s) beyond the login buffer, {} command(s) \
                 outside the CmdSN window",
                c.malformed, c.wr_errors, c.login_pdus_early, out_of_window
            ));
        }
        if let Err(e) = self.stop(p) {
            found.push(format!("target {index} did not stop: {e}"));
        }
        found
    }
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
    let platform = bench_platform(options.processors);
    let started = platform.run_passive(|p| build(&platform, options, p))?;
    rdma_backend(
        started,
        ModelIdentity {
            target_type: "iSER".into(),
            description: format!(
                "iser: StorPort model -> miniport -> iSER engine -> kverbs -> soft HCA <-> soft \
                 HCA -> software iSER target ({} target(s), RAM disks)",
                options.targets
            ),
        },
        options.sg_shape,
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
) -> Result<StartedStack<IserTransport<HostPlatform>, IserTarget>, BackendError> {
    let hca = InitiatorHca::in_process(platform, p)?;
    let timing = in_process_cm_timing();
    let mut targets = Vec::new();
    let mut records = Vec::new();
    let mut descs = Vec::new();
    let depth = options.queue_depth.unwrap_or(128).clamp(2, 1024);
    for i in 0..usize::from(options.targets) {
        let target_hca = hca
            .fabric
            .add_hca(super::rdma::in_process_hca(target_ip(i)));
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
        let target = IserTarget::start_on_hca(platform, target_hca, config, p)
            .map_err(|e| step_error(&format!("iSER target {i}"), &e))?;
        let record = node_record(i, target.target_name(), target.port(), options);
        let desc = TargetDescription::parse(&record)
            .map_err(|e| step_error(&format!("node record {record:?}"), &e))?;
        descs.push(desc);
        records.push(record);
        targets.push(Some(target));
    }
    let shape = IserTransport::<HostPlatform>::adapter_shape(
        &descs,
        hca.device.attr().max_fast_reg_page_list_len,
    );
    let (dev2, cm2) = (hca.device.clone(), hca.cm.clone());
    start_stack(
        platform,
        StackPlan {
            hca,
            targets,
            descriptions: records,
            shape,
            luns_per_target: options.luns,
            make_transport: Box::new(move |upcalls, p: &Passive<'_>| {
                IserTransport::new(&dev2, &cm2, IserConfig::default(), &descs, upcalls, p)
                    .map_err(|_| kverbs::platform::AllocError)
            }),
            // Its side is up when the connection reaches full feature phase.
            target_live: Box::new(|t: &IserTarget| t.live_connections() >= 1),
            live_timeout: STEP_TIMEOUT,
        },
        p,
    )
}
