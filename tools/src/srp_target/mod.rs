//! A software SRP target that behaves as Linux `ib_srpt` does, with
//! misbehaviour switches for tests: the far end of the full-stack tests and
//! of `kvbench`.
//!
//! It is a host program built on the same verbs library the initiator
//! uses: a [`kverbs::device::Device`] on a software HCA, a
//! [`kverbs::cm::CmPort`] listening for logins, one RC QP per channel, and
//! the RAM-disk [`ScsiTarget`] behind it all.
//!
//! # Threads
//!
//! * A control thread takes login requests (the CM hands them over at
//!   `DISPATCH_LEVEL`; creating a channel's objects needs
//!   `PASSIVE_LEVEL`), runs `ib_srpt`'s checks (`login`), creates the
//!   channel and accepts or rejects, and joins channels that finished.
//! * One thread per channel (`channel`) serves its IUs at
//!   `PASSIVE_LEVEL`: the CQ, QP and CM callbacks leave notes in its
//!   mailbox and wake it — except for the commands the channel's DPC lane
//!   (`lane`) serves in the CQ's DPC (reads of up to 64 KiB,
//!   immediate-data writes, no-data commands: no thread wake per I/O;
//!   `SrpTargetConfig::serve_in_dpc`, counted in `ius_served_in_dpc`).
//!
//! Every thread runs inside [`HostPlatform::run_passive`], so the host
//! verifier checks the target's own use of the verbs library too.
//!
//! # Use
//!
//! ```no_run
//! # use kverbs_tools::srp_target::{SrpTarget, SrpTargetConfig};
//! # use kverbs_tools::scsi_target::{BlockSize, LunConfig};
//! # fn demo(dev: &kverbs::device::Device<kverbs::platform::host::HostPlatform>,
//! #         p: &kverbs::irql::Passive<'_>) {
//! let config = SrpTargetConfig::with_luns(vec![LunConfig::new(BlockSize::B512, 2048)]);
//! let target = SrpTarget::start(dev, config, p).unwrap();
//! // ... initiators log in to target.rdma_cm_port() at the HCA's address,
//! // with target port id (target.service_guid(), target.service_guid()) ...
//! target.stop(p).unwrap();
//! # }
//! ```
//!
//! Stepped fabrics (`ExecMode::Stepped` with a manual host platform) work
//! too, as long as someone runs the fabric and the platform: pass that as
//! the pump to [`SrpTarget::stop_with`].

mod channel;
pub mod config;
mod counters;
mod lane;
mod login;
pub mod misbehave;
mod shared;
mod staging;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hca_lowlevel::device::{AccessFlags, HcaDevice, QpType};
use kverbs::cm::qp::init_attrs;
use kverbs::cm::{
    AcceptRequest, CmError, CmListener, CmPort, CmPortConfig, CmQp, ConnParams, ListenEvent,
    ListenKind, ListenerId, LocalQp,
};
use kverbs::cq::{Cq, CqConfig};
use kverbs::device::{Device, DeviceConfig};
use kverbs::error::VerbsError;
use kverbs::hostdev::VerifiedHca;
use kverbs::irql::{Dispatch, LeDispatch, Passive};
use kverbs::mr::Mr;
use kverbs::pd::Pd;
use kverbs::platform::host::{HostEvent, HostPlatform};
use kverbs::platform::{EventKind, Platform, RawEvent};
use kverbs::qp::{Qp, QpConfig};
use kverbs::sync::SpinLock;
use kverbs::wire::{CmaAddresses, PortSpace, RejectReason as CmRejectReason, ServiceId};
use storport_srp::wire::srp::{MultiChannelAction, MultiChannelResult, PortId, RejectReason};

use crate::scsi_target::{BlockStore, ScsiTarget, TargetConfig};

pub use config::{CmTiming, ConfigError, IbCmListen, InitiatorAcl, SrpTargetConfig};
pub use counters::CountersSnapshot;
pub use misbehave::{
    HostileAttempt, HostileOutcome, HostileReport, Misbehaviour, RspCorruption, Selector,
};
pub use shared::ChannelState;

use channel::{Channel, Negotiated, Objects, RECV_EXTRA, SCRATCH_LEN, SEND_EXTRA};
use counters::Counters;
use login::{LoginForm, LoginRequest};
use misbehave::Switches;
use shared::{ChannelShared, DisconnectWhy, Request, WrCtx};

type Hp = HostPlatform;

/// Login requests the CM may hand over before the control thread takes
/// them; more are rejected at once (INSUFFICIENT_RESOURCES).
const LOGIN_QUEUE: usize = 64;

/// Why the target could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The configuration is invalid.
    #[error("configuration: {0}")]
    Config(#[from] ConfigError),
    /// A logical unit could not be added.
    #[error("logical unit: {0}")]
    Lun(#[from] crate::scsi_target::ConfigError),
    /// A verbs object could not be created.
    #[error("verbs: {0:?}")]
    Verbs(VerbsError),
    /// The CM refused to listen.
    #[error("listen: {0}")]
    Listen(CmError),
    /// A thread could not be started.
    #[error("thread: {0}")]
    Thread(std::io::Error),
}

/// Why a stop did not finish cleanly.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StopError {
    /// A stage did not finish within the configuration's `stop_timeout`.
    #[error("stop timed out waiting for {0}")]
    Timeout(&'static str),
    /// A thread panicked.
    #[error("a target thread panicked")]
    ThreadPanicked,
}

/// A channel, as the target reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChannelInfo {
    /// The target's number for it.
    pub id: u32,
    /// The initiator port id of its login.
    pub initiator_port_id: PortId,
    /// Its QP number.
    pub qpn: u32,
    /// Where it is in its life.
    pub state: ChannelState,
    /// The immediate-data offset granted, if any.
    pub imm_data_offset: Option<u16>,
    /// The initiator's `max_ti_iu_len` (its `req_it_iu_len`).
    pub max_ti_iu_len: u32,
    /// RDMA READs the channel keeps outstanding at most.
    pub read_depth: u32,
}

/// A login request handed over by the CM.
#[derive(Debug, Clone, Copy)]
struct PendingLogin {
    id: kverbs::cm::CmId,
    form: LoginForm,
    data: [u8; 92],
    len: usize,
    peer_ip: Option<[u8; 4]>,
    /// The initiator's responder resources (bound our RDMA READ depth).
    responder_resources: u8,
}

struct ChannelEntry {
    shared: Arc<ChannelShared>,
    info: ChannelInfo,
    thread: Option<JoinHandle<()>>,
}

/// What the target's threads share.
pub(crate) struct TargetShared {
    platform: Hp,
    pub(crate) pd: Pd<Hp>,
    pub(crate) port: CmPort<Hp>,
    device: Device<Hp>,
    pub(crate) config: SrpTargetConfig,
    service_guid: u64,
    pub(crate) scsi: Arc<ScsiTarget>,
    /// The key the LUN stores are registered under with `pd` (READs
    /// gather straight from them); `None` when no store is.
    pub(crate) store_key: Option<u64>,
    pub(crate) counters: Counters,
    pub(crate) switches: Switches,
    hostile: Mutex<Vec<HostileReport>>,
    channels: Mutex<Vec<ChannelEntry>>,
    logins: SpinLock<VecDeque<PendingLogin>, Hp>,
    control_wake: HostEvent,
    stopping: AtomicBool,
    next_channel: AtomicU32,
}

impl TargetShared {
    pub(crate) fn add_hostile(&self, report: HostileReport) -> usize {
        let mut list = self.hostile.lock().unwrap_or_else(PoisonError::into_inner);
        list.push(report);
        list.len() - 1
    }

    pub(crate) fn set_hostile_outcome(&self, index: usize, outcome: HostileOutcome) {
        let mut list = self.hostile.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(r) = list.get_mut(index) {
            r.outcome = outcome;
        }
    }

    pub(crate) fn hostile_report(&self, index: usize) -> Option<HostileReport> {
        self.hostile
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(index)
            .copied()
    }

    pub(crate) fn wake_control(&self, irql: &impl LeDispatch) {
        self.control_wake.set(irql);
    }

    fn reject(&self, id: kverbs::cm::CmId, tag: u64, reason: RejectReason, irql: &impl LeDispatch) {
        self.counters.reject(reason);
        let rej = login::login_reject(tag, reason);
        // A request already withdrawn cannot be answered; nothing to do.
        let _ = self
            .port
            .reject(id, CmRejectReason::ConsumerDefined, &rej, irql);
    }

    fn channels(&self) -> std::sync::MutexGuard<'_, Vec<ChannelEntry>> {
        self.channels.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The control thread's body.
    fn control(self: &Arc<Self>, p: &Passive<'_>) {
        loop {
            loop {
                let next = self.logins.lock(p).pop_front();
                let Some(login) = next else { break };
                self.login(&login, p);
            }
            self.reap(p);
            if self.stopping.load(Ordering::Acquire) {
                break;
            }
            let _ = self.control_wake.wait_timeout(Duration::from_millis(50), p);
        }
    }

    /// Joins channel threads that finished.
    fn reap(&self, _p: &Passive<'_>) {
        let done: Vec<JoinHandle<()>> = {
            let mut channels = self.channels();
            let mut done = Vec::new();
            channels.retain_mut(|c| {
                if c.shared.finished.load(Ordering::Acquire) {
                    if let Some(t) = c.thread.take() {
                        done.push(t);
                    }
                    false
                } else {
                    true
                }
            });
            done
        };
        for t in done {
            let _ = t.join();
        }
    }

    /// One login, as `ib_srpt`'s `srpt_cm_req_recv`.
    fn login(self: &Arc<Self>, pl: &PendingLogin, p: &Passive<'_>) {
        Counters::add(&self.counters.login_requests, 1);
        let data = pl.data.get(..pl.len).unwrap_or(&[]);
        let Some(req) = LoginRequest::parse(pl.form, data) else {
            self.reject(pl.id, 0, RejectReason::UnableEstablishChannel, p);
            return;
        };
        if self.stopping.load(Ordering::Acquire) {
            self.reject(pl.id, req.tag, RejectReason::InsufficientResources, p);
            return;
        }
        if let Some(reason) = self.switches.take_reject() {
            self.reject(pl.id, req.tag, reason, p);
            return;
        }
        // 1-3.
        if let Err(reason) = login::check_before_resources(&req, &self.config, self.service_guid) {
            self.reject(pl.id, req.tag, reason, p);
            return;
        }
        // 4: the channel's objects.
        let id = self.next_channel.fetch_add(1, Ordering::Relaxed);
        let Ok((shared, objects)) = self.create_objects(id, pl.id, &req, p) else {
            self.reject(pl.id, req.tag, RejectReason::InsufficientResources, p);
            return;
        };
        // 5: access list and channel limit (channels a SINGLE login ends do
        // not count).
        let single = req.multichannel == MultiChannelAction::Single;
        let (open, same_nexus): (usize, Vec<Arc<ChannelShared>>) = {
            let channels = self.channels();
            let live = channels
                .iter()
                .filter(|c| c.shared.state() < ChannelState::Closing);
            let mut open = 0;
            let mut same = Vec::new();
            for c in live {
                if single && c.shared.nexus == req.nexus() {
                    same.push(Arc::clone(&c.shared));
                } else {
                    open += 1;
                }
            }
            (open, same)
        };
        let session = login::check_session(&req, &self.config, pl.peer_ip, open);
        let neg = Negotiated {
            max_ti_iu_len: req.it_iu_len,
            imm_data_offset: login::granted_immediate(&req, &self.config),
            read_depth: u32::from(self.config.initiator_depth.min(pl.responder_resources)),
        };
        let qp: Arc<dyn CmQp> = Arc::new(objects.qp.clone());
        let qpn = objects.qp.qpn();
        let channel = Channel::new(Arc::clone(&shared), Arc::clone(self), objects, neg);
        let info = ChannelInfo {
            id,
            initiator_port_id: req.initiator_port_id,
            qpn,
            state: ChannelState::Connecting,
            imm_data_offset: neg.imm_data_offset,
            max_ti_iu_len: neg.max_ti_iu_len,
            read_depth: neg.read_depth,
        };
        if let Err(reason) = session {
            self.reject(pl.id, req.tag, reason, p);
            if self.spawn(channel, info, p) {
                shared.request(Request::Abandon, p);
            }
            return;
        }
        // 6.
        let multichannel = if single {
            for c in &same_nexus {
                c.request(Request::Disconnect(DisconnectWhy::Relogin), p);
            }
            if same_nexus.is_empty() {
                MultiChannelResult::NoChannel
            } else {
                MultiChannelResult::Terminated
            }
        } else {
            MultiChannelResult::Maintained
        };
        let rsp = login::login_response(&req, &self.config, multichannel, neg.imm_data_offset);
        if !self.spawn(channel, info, p) {
            self.reject(pl.id, req.tag, RejectReason::InsufficientResources, p);
            return;
        }
        let params = ConnParams {
            responder_resources: self.config.responder_resources,
            initiator_depth: self.config.initiator_depth,
            ..ConnParams::SRP
        };
        let accept = AcceptRequest {
            qp: LocalQp {
                qpn: hca_lowlevel::wire::Qpn::from_low_bits(qpn),
                starting_psn: None,
            },
            params,
            private_data: &rsp,
        };
        let handler: Arc<dyn kverbs::cm::CmHandler> = shared.clone();
        match self.port.accept(pl.id, &accept, &qp, &handler, p) {
            Ok(()) => {
                Counters::add(&self.counters.logins_accepted, 1);
                Counters::add(
                    &self.counters.credits_granted,
                    u64::from(self.config.rq_size),
                );
            }
            Err(_) => shared.request(Request::Abandon, p),
        }
    }

    /// Starts a channel's thread; `false` if the thread could not start
    /// (the channel's objects are then destroyed here).
    fn spawn(self: &Arc<Self>, channel: Channel, info: ChannelInfo, p: &Passive<'_>) -> bool {
        let shared = Arc::clone(channel.shared());
        let platform = self.platform.clone();
        let name = format!("srpt-ch{}", info.id);
        // The thread must exist for the objects to be torn down; if it
        // cannot be started, the channel is run to its end here.
        let slot: Arc<Mutex<Option<Channel>>> = Arc::new(Mutex::new(Some(channel)));
        let taken = Arc::clone(&slot);
        let spawned = std::thread::Builder::new().name(name).spawn(move || {
            let channel = taken.lock().unwrap_or_else(PoisonError::into_inner).take();
            if let Some(channel) = channel {
                platform.run_passive(|p| channel.run(p));
            }
        });
        match spawned {
            Ok(thread) => {
                self.channels().push(ChannelEntry {
                    shared,
                    info,
                    thread: Some(thread),
                });
                true
            }
            Err(_) => {
                let channel = slot.lock().unwrap_or_else(PoisonError::into_inner).take();
                if let Some(channel) = channel {
                    shared.request(Request::Abandon, p);
                    channel.run(p);
                }
                false
            }
        }
    }

    /// Creates a channel's objects: memory first (deregistered on the
    /// spot if something later fails), then the CQ, then the QP, moved to
    /// INIT with every receive posted.
    fn create_objects(
        self: &Arc<Self>,
        id: u32,
        cm_id: kverbs::cm::CmId,
        req: &LoginRequest,
        p: &Passive<'_>,
    ) -> Result<(Arc<ChannelShared>, Objects), VerbsError> {
        let config = &self.config;
        let recv_slots = config.rq_size + RECV_EXTRA;
        let send_slots = config.rq_size + SEND_EXTRA;
        // The DPC lane's own send slots (after the thread's) and share of
        // the send queue.
        let plan = lane::LanePlan::for_config(config);
        // Each command: its WRITEs (or READs) and one SEND; the queue holds
        // a few per command and the channel waits for room beyond that.
        // (The device rounds each queue, kverbs' drain marker included, up
        // to a power of two; the CQ covers both rounded queues.)
        let sq_ring = (config.rq_size * 4 + SEND_EXTRA + plan.wr_budget).next_power_of_two();
        let send_wqebbs = sq_ring - 1;
        let cq_entries = (sq_ring + (recv_slots + 1).next_power_of_two()).next_power_of_two();
        let recv_mr = Mr::alloc(
            &self.pd,
            recv_slots as usize * config.srp_max_req_size as usize,
            AccessFlags::LOCAL_WRITE,
            p,
        )?;
        let undo_mr = |mrs: &[&Mr<Hp>]| {
            for mr in mrs {
                let _ = mr.dereg(p);
            }
        };
        let send_mr = match Mr::alloc(
            &self.pd,
            (send_slots + plan.slots) as usize * config.srp_max_rsp_size as usize,
            AccessFlags::LOCAL_WRITE,
            p,
        ) {
            Ok(mr) => mr,
            Err(e) => {
                undo_mr(&[&recv_mr]);
                return Err(e);
            }
        };
        let scratch_mr = match Mr::alloc(&self.pd, SCRATCH_LEN, AccessFlags::LOCAL_WRITE, p) {
            Ok(mr) => mr,
            Err(e) => {
                undo_mr(&[&recv_mr, &send_mr]);
                return Err(e);
            }
        };
        let _ = scratch_mr
            .mem()
            .write(0, &[channel::HOSTILE_BYTE; SCRATCH_LEN]);
        let shared = Arc::new(ChannelShared::new(
            id,
            cm_id,
            req.nexus(),
            cq_entries as usize + 64,
            config.rq_size,
        ));
        let cq = match Cq::create(
            &self.device,
            CqConfig::new(cq_entries),
            shared.clone() as Arc<dyn kverbs::cq::CqHandler<WrCtx>>,
            p,
        ) {
            Ok(cq) => cq,
            Err(e) => {
                undo_mr(&[&recv_mr, &send_mr, &scratch_mr]);
                return Err(e);
            }
        };
        let qp_handler = self
            .port
            .qp_events(shared.clone() as Arc<dyn kverbs::qp::QpHandler>, p);
        let qp_config = QpConfig {
            qp_type: QpType::Rc,
            send_cq: cq.clone(),
            recv_cq: cq.clone(),
            send_wqebbs,
            recv_slots,
            max_recv_sge: 1,
            port: 1,
        };
        let qp = match Qp::create(&self.pd, &qp_config, qp_handler, p) {
            Ok(qp) => qp,
            Err(e) => {
                let _ = cq.destroy(p);
                undo_mr(&[&recv_mr, &send_mr, &scratch_mr]);
                return Err(e);
            }
        };
        let objects = Objects {
            qp,
            cq,
            recv_mr,
            send_mr,
            scratch_mr,
            send_slots,
        };
        // From here the QP exists: failures tear down through a channel
        // thread (destroying a QP is asynchronous).
        let (attr, mask) = init_attrs(1, AccessFlags::LOCAL_WRITE);
        let ready = objects.qp.modify(&attr, mask, p).is_ok()
            && (0..recv_slots).all(|slot| post_initial_recv(&objects, config, slot, p));
        if !ready {
            let neg = Negotiated {
                max_ti_iu_len: 0,
                imm_data_offset: None,
                read_depth: 0,
            };
            let qpn = objects.qp.qpn();
            let channel = Channel::new(Arc::clone(&shared), Arc::clone(self), objects, neg);
            let info = ChannelInfo {
                id,
                initiator_port_id: req.initiator_port_id,
                qpn,
                state: ChannelState::Closing,
                imm_data_offset: None,
                max_ti_iu_len: 0,
                read_depth: 0,
            };
            if self.spawn(channel, info, p) {
                shared.request(Request::Abandon, p);
            }
            return Err(VerbsError::InvalidArgument);
        }
        // The lane is an optimisation: without its memory, the thread
        // serves everything.
        let io = if config.serve_in_dpc {
            lane::LaneIo::new(
                Arc::clone(self),
                &self.pd,
                objects.qp.clone(),
                objects.recv_mr.clone(),
                objects.send_mr.clone(),
                send_slots,
                plan,
                p,
            )
            .ok()
        } else {
            None
        };
        if let Some(io) = io {
            shared.lane.lock(p).install(io);
        }
        Ok((shared, objects))
    }
}

fn post_initial_recv(
    objects: &Objects,
    config: &SrpTargetConfig,
    slot: u32,
    p: &Passive<'_>,
) -> bool {
    let size = u64::from(config.srp_max_req_size);
    let Some(sge) = objects
        .recv_mr
        .sge(u64::from(slot) * size, config.srp_max_req_size)
    else {
        return false;
    };
    let Ok(mut batch) = objects.qp.begin_recv(p) else {
        return false;
    };
    if batch.recv(&[sge], WrCtx::Recv(slot)).is_err() {
        return false;
    }
    batch.commit();
    true
}

/// The CM listener: hands requests to the control thread (at
/// `DISPATCH_LEVEL`: a copy into a queue sized at start, no allocation).
struct Listener {
    target: Weak<TargetShared>,
    form: LoginForm,
}

impl CmListener for Listener {
    fn on_event(&self, _listener: ListenerId, event: ListenEvent<'_>, irql: &Dispatch<'_>) {
        let ListenEvent::Request(r) = event else {
            // A request withdrawn before the control thread answered: its
            // accept or reject fails, which the control thread handles.
            return;
        };
        let Some(target) = self.target.upgrade() else {
            return;
        };
        let mut data = [0u8; 92];
        let len = r.private_data.len().min(data.len());
        if let (Some(dst), Some(src)) = (data.get_mut(..len), r.private_data.get(..len)) {
            dst.copy_from_slice(src);
        }
        let peer_ip = r.rdma_cm.and_then(|h| match h.addresses {
            CmaAddresses::V4 { src, .. } => Some(src.0),
            CmaAddresses::V6 { .. } => None,
        });
        let login = PendingLogin {
            id: r.id,
            form: self.form,
            data,
            len,
            peer_ip,
            responder_resources: r.responder_resources,
        };
        let queued = {
            let mut logins = target.logins.lock(irql);
            if logins.len() < logins.capacity() {
                logins.push_back(login);
                true
            } else {
                false
            }
        };
        if queued {
            target.control_wake.set(irql);
        } else {
            Counters::add(&target.counters.login_requests, 1);
            let tag =
                LoginRequest::parse(self.form, data.get(..len).unwrap_or(&[])).map_or(0, |r| r.tag);
            target.reject(r.id, tag, RejectReason::InsufficientResources, irql);
        }
        // `target` is not the last reference: the SrpTarget handle keeps
        // one until stop has removed this listener.
        drop(target);
    }
}

/// A running software SRP target (see the [module docs](self)).
pub struct SrpTarget {
    shared: Arc<TargetShared>,
    control: Option<JoinHandle<()>>,
    /// The device, when the target opened it itself (closed at stop).
    own_device: bool,
    stopped: bool,
}

impl std::fmt::Debug for SrpTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SrpTarget")
            .field("service_guid", &self.shared.service_guid)
            .field("rdma_cm_port", &self.shared.config.rdma_cm_port)
            .finish_non_exhaustive()
    }
}

impl SrpTarget {
    /// Starts a target on `device` with RAM-disk logical units built from
    /// `config.luns`: creates its CM port (the device's port 1 must have
    /// none yet), listens, and starts the control thread.
    ///
    /// # Errors
    ///
    /// See [`StartError`]; nothing is left behind.
    pub fn start(
        device: &Device<Hp>,
        config: SrpTargetConfig,
        p: &Passive<'_>,
    ) -> Result<Self, StartError> {
        config.validate()?;
        let service_guid = config.service_guid.unwrap_or(device.attr().node_guid);
        let scsi = build_scsi(&config, service_guid)?;
        Self::start_inner(device, Arc::new(scsi), config, false, p)
    }

    /// Starts a target in front of an existing SCSI target (shared with
    /// another transport, say); `config.luns` is not used.
    ///
    /// # Errors
    ///
    /// See [`StartError`].
    pub fn start_with_scsi(
        device: &Device<Hp>,
        scsi: Arc<ScsiTarget>,
        config: SrpTargetConfig,
        p: &Passive<'_>,
    ) -> Result<Self, StartError> {
        let check = SrpTargetConfig {
            luns: Vec::new(),
            ..config.clone()
        };
        check.validate()?;
        Self::start_inner(device, scsi, config, false, p)
    }

    /// Opens `hca` through kverbs (wrapped for the host verifier) and
    /// starts a target on it; the device is closed again at stop.
    ///
    /// # Errors
    ///
    /// See [`StartError`].
    pub fn start_on_hca(
        platform: &Hp,
        hca: Arc<dyn HcaDevice>,
        config: SrpTargetConfig,
        p: &Passive<'_>,
    ) -> Result<Self, StartError> {
        config.validate()?;
        let device = Device::open(platform, VerifiedHca::new(hca), DeviceConfig::default(), p)
            .map_err(StartError::Verbs)?;
        let service_guid = config.service_guid.unwrap_or(device.attr().node_guid);
        let started = build_scsi(&config, service_guid)
            .and_then(|scsi| Self::start_inner(&device, Arc::new(scsi), config, true, p));
        if started.is_err() {
            device.close(p);
        }
        started
    }

    fn start_inner(
        device: &Device<Hp>,
        scsi: Arc<ScsiTarget>,
        config: SrpTargetConfig,
        own_device: bool,
        p: &Passive<'_>,
    ) -> Result<Self, StartError> {
        let service_guid = config.service_guid.unwrap_or(device.attr().node_guid);
        let pd = device.alloc_pd(p).map_err(StartError::Verbs)?;
        let port = match CmPort::create(
            device,
            1,
            CmPortConfig {
                cm: config.cm_config(),
                recv_buffers: 64,
                send_buffers: 64,
                trace: None,
            },
            p,
        ) {
            Ok(port) => port,
            Err(e) => {
                let _ = pd.dealloc(p);
                return Err(StartError::Verbs(e));
            }
        };
        let store_key = if config.zero_copy_reads {
            register_stores(&scsi, device.platform(), &pd, p)
        } else {
            None
        };
        let shared = Arc::new(TargetShared {
            platform: device.platform().clone(),
            pd,
            port,
            device: device.clone(),
            config,
            service_guid,
            scsi,
            store_key,
            counters: Counters::default(),
            switches: Switches::default(),
            hostile: Mutex::new(Vec::new()),
            channels: Mutex::new(Vec::new()),
            logins: SpinLock::new(VecDeque::with_capacity(LOGIN_QUEUE)),
            control_wake: HostEvent::new(EventKind::Synchronization, false),
            stopping: AtomicBool::new(false),
            next_channel: AtomicU32::new(0),
        });
        let mut target = SrpTarget {
            shared,
            control: None,
            own_device,
            stopped: false,
        };
        if let Err(e) = target.listen(p) {
            let _ = target.shutdown(p, &mut || std::thread::sleep(Duration::from_millis(1)));
            return Err(e);
        }
        let shared = Arc::clone(&target.shared);
        let platform = shared.platform.clone();
        match std::thread::Builder::new()
            .name("srpt-control".into())
            .spawn(move || platform.run_passive(|p| shared.control(p)))
        {
            Ok(t) => target.control = Some(t),
            Err(e) => {
                let _ = target.shutdown(p, &mut || std::thread::sleep(Duration::from_millis(1)));
                return Err(StartError::Thread(e));
            }
        }
        Ok(target)
    }

    fn listen(&self, p: &Passive<'_>) -> Result<(), StartError> {
        let s = &self.shared;
        if let Some(port) = s.config.rdma_cm_port {
            let listener: Arc<dyn CmListener> = Arc::new(Listener {
                target: Arc::downgrade(s),
                form: LoginForm::RdmaCm,
            });
            s.port
                .listen(
                    ServiceId::rdma_cm(PortSpace::Tcp, port),
                    ListenKind::RdmaCm,
                    &listener,
                    p,
                )
                .map_err(StartError::Listen)?;
        }
        let ib = match s.config.ib_cm {
            IbCmListen::Off => None,
            IbCmListen::ServiceGuid => Some(s.service_guid),
            IbCmListen::ServiceId(id) => Some(id),
        };
        if let Some(id) = ib {
            let listener: Arc<dyn CmListener> = Arc::new(Listener {
                target: Arc::downgrade(s),
                form: LoginForm::IbCm,
            });
            s.port
                .listen(ServiceId(id), ListenKind::IbCm, &listener, p)
                .map_err(StartError::Listen)?;
        }
        Ok(())
    }

    /// The service GUID: initiators send it twice as the target port id.
    pub fn service_guid(&self) -> u64 {
        self.shared.service_guid
    }

    /// The target port id initiators log in to: (service GUID, service
    /// GUID).
    pub fn target_port_id(&self) -> PortId {
        PortId {
            id_ext: self.shared.service_guid,
            guid: self.shared.service_guid,
        }
    }

    /// The RDMA/CM port listened on.
    pub fn rdma_cm_port(&self) -> Option<u16> {
        self.shared.config.rdma_cm_port
    }

    /// The IB CM service ID listened on.
    pub fn ib_cm_service_id(&self) -> Option<u64> {
        match self.shared.config.ib_cm {
            IbCmListen::Off => None,
            IbCmListen::ServiceGuid => Some(self.shared.service_guid),
            IbCmListen::ServiceId(id) => Some(id),
        }
    }

    /// The port's GID (its IPv4-mapped address on RoCE).
    pub fn gid(&self) -> hca_lowlevel::wire::Gid {
        self.shared.port.gid()
    }

    /// The configuration in force.
    pub fn config(&self) -> &SrpTargetConfig {
        &self.shared.config
    }

    /// The SCSI target behind the channels (its logical units, their
    /// stores, its fault hooks).
    pub fn scsi(&self) -> &Arc<ScsiTarget> {
        &self.shared.scsi
    }

    /// The counters, now.
    pub fn counters(&self) -> CountersSnapshot {
        self.shared.counters.snapshot()
    }

    /// The channels not yet reaped (live ones and those closing).
    pub fn channels(&self) -> Vec<ChannelInfo> {
        self.shared
            .channels()
            .iter()
            .map(|c| ChannelInfo {
                state: c.shared.state(),
                ..c.info.clone()
            })
            .collect()
    }

    /// Channels that are live.
    pub fn live_channels(&self) -> usize {
        self.shared
            .channels()
            .iter()
            .filter(|c| c.shared.state() == ChannelState::Live)
            .count()
    }

    /// Every hostile attempt made so far, with what happened.
    pub fn hostile_reports(&self) -> Vec<HostileReport> {
        self.shared
            .hostile
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Turns a misbehaviour switch on. Armed switches wait for the event
    /// they act on; the one-shot requests go to every live channel at
    /// once. Returns the number of channels a one-shot request went to
    /// (0 for armed switches).
    pub fn set_misbehaviour(&self, m: Misbehaviour, p: &Passive<'_>) -> usize {
        let request = match &m {
            Misbehaviour::SendCredReq { delta } => Request::CredReq { delta: *delta },
            Misbehaviour::SendAerReq { lun, sense, delta } => Request::AerReq {
                lun: *lun,
                sense: *sense,
                delta: *delta,
            },
            Misbehaviour::SendTLogout { reason } => Request::TLogout { reason: *reason },
            Misbehaviour::ScsiFault(rule) => {
                self.shared.scsi.faults().push(rule.clone());
                return 0;
            }
            _ => {
                self.shared.switches.arm(&m);
                return 0;
            }
        };
        let live: Vec<Arc<ChannelShared>> = self
            .shared
            .channels()
            .iter()
            .filter(|c| c.shared.state() == ChannelState::Live)
            .map(|c| Arc::clone(&c.shared))
            .collect();
        for c in &live {
            c.request(request.clone(), p);
        }
        live.len()
    }

    /// Turns every armed switch off (and clears the SCSI fault hooks).
    pub fn clear_misbehaviour(&self) {
        self.shared.switches.clear();
        self.shared.scsi.faults().clear();
    }

    /// Stops the target: no new logins, every channel disconnected and
    /// destroyed, the CM port released, every thread joined. Bounded by
    /// the configuration's `stop_timeout` per stage.
    ///
    /// # Errors
    ///
    /// [`StopError`]: a stage timed out (something is leaked) or a thread
    /// panicked.
    pub fn stop(self, p: &Passive<'_>) -> Result<(), StopError> {
        self.stop_with(p, &mut || std::thread::sleep(Duration::from_millis(1)))
    }

    /// [`Self::stop`], calling `pump` while it waits (a stepped fabric and
    /// a manual platform need someone to run them).
    ///
    /// # Errors
    ///
    /// As [`Self::stop`].
    pub fn stop_with(mut self, p: &Passive<'_>, pump: &mut dyn FnMut()) -> Result<(), StopError> {
        self.shutdown(p, pump)
    }

    fn shutdown(&mut self, p: &Passive<'_>, pump: &mut dyn FnMut()) -> Result<(), StopError> {
        if self.stopped {
            return Ok(());
        }
        self.stopped = true;
        let s = Arc::clone(&self.shared);
        let timeout = s.config.stop_timeout;
        let wait = |what: &'static str, pump: &mut dyn FnMut(), done: &dyn Fn() -> bool| {
            let start = Instant::now();
            while !done() {
                if start.elapsed() > timeout {
                    return Err(StopError::Timeout(what));
                }
                pump();
            }
            Ok(())
        };
        s.stopping.store(true, Ordering::Release);
        // No new logins; every connection the CM holds is disconnected.
        s.port.close(p);
        s.control_wake.set(p);
        let mut result = Ok(());
        if let Some(control) = self.control.take() {
            let r = wait("the control thread", pump, &|| control.is_finished());
            if r.is_ok() && control.join().is_err() {
                result = Err(StopError::ThreadPanicked);
            }
            result = result.and(r);
        }
        // Channels the CM did not know yet (accepting) are told directly.
        let all: Vec<Arc<ChannelShared>> =
            s.channels().iter().map(|c| Arc::clone(&c.shared)).collect();
        for c in &all {
            c.request(Request::Disconnect(DisconnectWhy::Stop), p);
        }
        let r = wait("the channels to close", pump, &|| {
            s.channels()
                .iter()
                .all(|c| c.shared.finished.load(Ordering::Acquire))
        });
        result = result.and(r);
        // A thread that did not finish is left running (and reported by
        // the timeout above); joining it would block for ever.
        let threads: Vec<JoinHandle<()>> = s
            .channels()
            .iter_mut()
            .filter(|c| c.shared.finished.load(Ordering::Acquire))
            .filter_map(|c| c.thread.take())
            .collect();
        for t in threads {
            if t.join().is_err() {
                result = result.and(Err(StopError::ThreadPanicked));
            }
        }
        s.channels().clear();
        let r = wait("the CM's consumers", pump, &|| {
            s.port.pending_consumers(p) == (0, 0)
        });
        result = result.and(r);
        let r = wait("the CM port", pump, &|| {
            !matches!(s.port.release(p), Err(CmError::Busy))
        });
        result = result.and(r);
        // Every channel is gone, so no READ pins a chunk any more: the
        // stores go back to the heap before the PD goes.
        if let Some(key) = s.store_key {
            for index in s.scsi.lun_indices() {
                if let Some(lu) = s.scsi.lun(index) {
                    if lu.store().detach_registration(key, p) > 0 {
                        result = result.and(Err(StopError::Timeout("chunk pins")));
                    }
                }
            }
        }
        let _ = s.pd.dealloc(p);
        if self.own_device {
            s.device.close(p);
        }
        result
    }
}

impl Drop for SrpTarget {
    fn drop(&mut self) {
        if self.stopped || Hp::current_irql() != kverbs::irql::Irql::PASSIVE {
            return;
        }
        let platform = self.shared.platform.clone();
        platform.run_passive(|p| {
            let _ = self.shutdown(p, &mut || std::thread::sleep(Duration::from_millis(1)));
        });
    }
}

/// Registers every LUN's store with `pd` under one new key (see
/// [`crate::scsi_target::store`]); the key if any store took it.
fn register_stores(scsi: &ScsiTarget, platform: &Hp, pd: &Pd<Hp>, p: &Passive<'_>) -> Option<u64> {
    let key = BlockStore::new_registration_key();
    let mut any = false;
    for index in scsi.lun_indices() {
        if let Some(lu) = scsi.lun(index) {
            // A store another target registered (or a failed registration)
            // is served by copying.
            any |= lu
                .store()
                .attach_registration(key, platform, pd, p)
                .unwrap_or(false);
        }
    }
    any.then_some(key)
}

/// The RAM-disk target of a configuration: LUN `i` is `config.luns[i]`,
/// its maximum transfer lowered to what one channel can stage.
fn build_scsi(config: &SrpTargetConfig, service_guid: u64) -> Result<ScsiTarget, StartError> {
    let mut scsi = ScsiTarget::new(TargetConfig::new(config.target_id.unwrap_or(service_guid)));
    for (i, lun) in config.luns.iter().enumerate() {
        let mut lun = lun.clone();
        // Staging buffers come in powers of two.
        let largest = 1usize << (usize::BITS - 1 - config.staging_bytes.leading_zeros());
        let stageable =
            u32::try_from(largest / lun.block_size.bytes() as usize).unwrap_or(u32::MAX);
        lun.max_transfer_blocks = lun.max_transfer_blocks.min(stageable.max(1));
        let index = u16::try_from(i).map_err(|_| ConfigError::TooManyLuns(config.luns.len()))?;
        scsi.add_lun(index, lun)?;
    }
    Ok(scsi)
}
