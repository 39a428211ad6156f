//! A software iSER target that behaves as Linux LIO's `isert` does: the
//! sans-IO [`crate::iscsi_target`] logic carried over kverbs and the RDMA/CM
//! passive side, with the RAM-disk [`ScsiTarget`] behind it.
//!
//! What `isert` does and this target does too:
//!
//! * The REQ's iSER CM header decides remote invalidation: unless the
//!   initiator set `SEND_WITH_INVALIDATE_NOT_SUPPORTED` (and the target is
//!   not told to refuse it), SCSI Responses go out as SEND with invalidate
//!   of the command's STag (read STag if any, else write STag). The REP
//!   private data carries `ZBVA_NOT_USED` and, when it will not invalidate,
//!   `SEND_WITH_INVALIDATE_NOT_USED`.
//! * One login receive buffer until login completes (reposted after each
//!   response is built); the full receive ring is posted before the final
//!   Login Response is sent.
//! * Data-In by RDMA WRITE to the read STag/VA, then the SCSI Response;
//!   the write data not received as immediate/unsolicited data is fetched
//!   by RDMA READ from the write STag/VA **without adding an offset**.
//!
//! # Threads
//! One service thread at `PASSIVE_LEVEL` does everything: accepts requests
//! the listener queued, serves every connection's notes (CQ, QP and CM
//! callbacks only leave notes), runs the iSCSI logic, and tears
//! connections down. Staging memory for RDMA is registered per transfer.
//!
//! # Misbehaviour
//! [`IscsiTarget::misbehaviour`] (through [`IserTarget::with_logic`]) and
//! the RDMA ones in [`IserMisbehaviour`], among them the hostile RDMA
//! attempts of the SRP target ([`HostileAttempt`], reported as
//! [`HostileReport`]s: the channel is the connection's key, the tag the
//! command's ITT).
//!
//! # Capture
//! [`IserTarget::start_capture`] records every PDU received and sent (iSER
//! header included) and every RDMA operation, for golden tests of what the
//! initiator put on the wire ([`Captured`]).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hca_lowlevel::device::{AccessFlags, AsyncEvent, HcaDevice, QpType};
use kverbs::cm::qp::init_attrs;
use kverbs::cm::{
    AcceptRequest, CmError, CmEvent, CmHandler, CmId, CmListener, CmPort, CmPortConfig, CmQp,
    ConnParams, ListenEvent, ListenKind, ListenerId, LocalQp,
};
use kverbs::cq::{Cq, CqConfig, CqHandler};
use kverbs::device::{Device, DeviceConfig};
use kverbs::hostdev::VerifiedHca;
use kverbs::irql::{Dispatch, LeDispatch, Passive};
use kverbs::mr::Mr;
use kverbs::pd::Pd;
use kverbs::platform::host::{HostEvent, HostPlatform};
use kverbs::platform::{EventKind, RawEvent};
use kverbs::qp::{Qp, QpConfig, QpHandler};
use kverbs::sync::SpinLock;
use kverbs::wire::{PortSpace, RejectReason as CmRejectReason, ServiceId};
use kverbs::wr::{Completion, Payload, ReadWr, SendFlags, SendWr, Signal, WcStatus, WriteWr};
use storport_srp::wire::iscsi::AsyncEvent as IscsiAsyncEvent;
use storport_srp::wire::iser::{
    CM_HEADER_LEN, HEADER_LEN, IserCmFlags, IserCmHeader, IserCmRepr, IserCtrlRepr, IserHeader,
    RdmaBuf,
};

use crate::iscsi_target::{ConnId, IscsiTarget, Output, TargetConfig};
use crate::scsi_target::{LunConfig, ScsiTarget, TargetConfig as ScsiConfig};
use crate::srp_target::{CmTiming, HostileAttempt, HostileOutcome, HostileReport};

type Hp = HostPlatform;

/// `ISER_RX_PAYLOAD_SIZE`: headers and 8 KiB of data.
const RX_SIZE: u32 = (HEADER_LEN + 48 + 8192) as u32;
/// `ISERT_QP_MAX_RECV_DTOS`.
const RX_RING: u32 = 128;
/// Send buffers per connection.
const TX_SLOTS: u32 = 128;
/// Notes the mailbox holds.
const MAILBOX: usize = 1 << 16;
/// A buffer is "stale" once its response was delivered this long ago: the
/// initiator has completed the command (and fenced its key) by then.
const STALE_AGE: Duration = Duration::from_millis(20);
/// The byte hostile writes carry.
const HOSTILE_BYTE: u8 = 0xA5;
/// Largest hostile transfer.
const HOSTILE_MAX: u32 = 4096;

/// RDMA misbehaviour (hostile and faulty targets).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IserMisbehaviour {
    /// Refuse remote invalidation (REP flag 0x40) whatever the REQ said.
    pub refuse_send_with_invalidate: bool,
    /// Invalidate a key the command was not given (the initiator must end
    /// the connection).
    pub bogus_invalidate: bool,
    /// Send with invalidate even when not negotiated.
    pub unannounced_invalidate: bool,
    /// Add the bytes already received to the RDMA READ's remote address
    /// (what `isert` does not do; the data goes wrong or faults).
    pub read_with_offset: bool,
    /// Reject every connection request (CM REJ, consumer defined).
    pub reject_connect: bool,
    /// Drop every NOP-Out unanswered (a target that stopped answering
    /// pings; the initiator's NOP-Out timeout must end the connection).
    pub ignore_nop_out: bool,
    /// One hostile RDMA attempt, fired on the first command it applies to
    /// (then disarmed); see [`IserTarget::hostile_reports`].
    pub hostile: Option<HostileAttempt>,
}

/// What [`IserTarget::start_capture`] recorded, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Captured {
    /// A PDU received: iSER header, BHS, AHS, data segment.
    Received {
        /// The connection's key.
        conn: u64,
        /// The bytes as received.
        pdu: Vec<u8>,
    },
    /// A PDU sent: iSER header, BHS, data segment.
    Sent {
        /// The connection's key.
        conn: u64,
        /// The bytes as sent.
        pdu: Vec<u8>,
        /// The STag invalidated remotely with it.
        invalidate: Option<u32>,
    },
    /// An RDMA WRITE (Data-In) posted.
    RdmaWrite {
        /// The connection's key.
        conn: u64,
        /// The command's ITT.
        itt: u32,
        /// The remote address.
        remote_addr: u64,
        /// The rkey (the command's read STag).
        rkey: u32,
        /// Bytes.
        len: u32,
    },
    /// An RDMA READ (Data-Out) posted.
    RdmaRead {
        /// The connection's key.
        conn: u64,
        /// The command's ITT.
        itt: u32,
        /// The remote address.
        remote_addr: u64,
        /// The rkey (the command's write STag).
        rkey: u32,
        /// Bytes.
        len: u32,
    },
}

/// The target's configuration.
#[derive(Debug, Clone)]
pub struct IserTargetConfig {
    /// The iSCSI logic's configuration (`TargetConfig::lio`).
    pub iscsi: TargetConfig,
    /// The LUNs.
    pub luns: Vec<LunConfig>,
    /// The RDMA/CM port (3260).
    pub port: u16,
    /// CM timing.
    pub cm_timing: Option<CmTiming>,
    /// How long a stop may take.
    pub stop_timeout: Duration,
    /// Record the wire from the start (login included; see
    /// [`IserTarget::captured`]).
    pub capture: bool,
}

impl IserTargetConfig {
    /// LIO-like on port 3260 serving `luns` as `iqn.2003-01.org.kverbs:disk`.
    #[must_use]
    pub fn with_luns(luns: Vec<LunConfig>) -> Self {
        Self {
            iscsi: TargetConfig::lio("iqn.2003-01.org.kverbs:disk"),
            luns,
            port: 3260,
            cm_timing: None,
            stop_timeout: Duration::from_secs(30),
            capture: false,
        }
    }
}

/// Why the target could not start.
#[derive(Debug, thiserror::Error)]
pub enum IserStartError {
    /// A logical unit could not be added.
    #[error("logical unit: {0}")]
    Lun(#[from] crate::scsi_target::ConfigError),
    /// A verbs object could not be created.
    #[error("verbs: {0:?}")]
    Verbs(kverbs::error::VerbsError),
    /// The CM refused to listen.
    #[error("listen: {0}")]
    Listen(CmError),
    /// The thread could not start.
    #[error("thread: {0}")]
    Thread(std::io::Error),
}

/// Counters.
#[derive(Debug, Default)]
struct Counters {
    connections: AtomicU64,
    closed: AtomicU64,
    send_with_invalidate: AtomicU64,
    rdma_writes: AtomicU64,
    rdma_reads: AtomicU64,
    wr_errors: AtomicU64,
    malformed: AtomicU64,
    login_pdus_early: AtomicU64,
    nop_outs_ignored: AtomicU64,
    hostile_attempts: AtomicU64,
    scsi_commands: AtomicU64,
}

/// A snapshot of the counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IserCounters {
    /// Connections accepted.
    pub connections: u64,
    /// Connections fully torn down.
    pub closed: u64,
    /// Responses sent with invalidate.
    pub send_with_invalidate: u64,
    /// RDMA WRITEs (Data-In).
    pub rdma_writes: u64,
    /// RDMA READs (Data-Out).
    pub rdma_reads: u64,
    /// Work requests that failed (not flushed).
    pub wr_errors: u64,
    /// PDUs that were not iSER control PDUs.
    pub malformed: u64,
    /// A login PDU arrived while no login buffer was posted (must stay 0:
    /// the initiator sends one login PDU at a time).
    pub login_pdus_early: u64,
    /// NOP-Outs dropped unanswered ([`IserMisbehaviour::ignore_nop_out`]).
    pub nop_outs_ignored: u64,
    /// Hostile RDMA attempts made.
    pub hostile_attempts: u64,
    /// SCSI Command PDUs received (held ones included).
    pub scsi_commands: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WrCtx {
    Recv(u32),
    Send(u32),
    Write(u64),
    Read(u64),
    Hostile(u64),
}

#[derive(Debug)]
enum Note {
    Wc(Completion<WrCtx>),
    Established,
    Terminal,
    QpError,
    QpDestroyed,
    CqDestroyed,
}

/// What a connection's callbacks share with the service thread.
struct ConnShared {
    key: u64,
    svc: Weak<Service>,
}

impl ConnShared {
    fn post(&self, note: Note, irql: &impl LeDispatch) {
        if let Some(s) = self.svc.upgrade() {
            {
                let mut m = s.mailbox.lock(irql);
                if m.len() < m.capacity() {
                    m.push_back((self.key, note));
                } else {
                    s.lost.store(true, Ordering::Release);
                }
            }
            s.wake.set(irql);
        }
    }
}

impl CqHandler<WrCtx> for ConnShared {
    fn on_completion(&self, completion: Completion<WrCtx>, irql: &Dispatch<'_>) {
        self.post(Note::Wc(completion), irql);
    }
    fn on_destroyed(&self, irql: &Dispatch<'_>) {
        self.post(Note::CqDestroyed, irql);
    }
}

impl QpHandler for ConnShared {
    fn on_async_event(&self, event: AsyncEvent, irql: &Dispatch<'_>) {
        if matches!(
            event,
            AsyncEvent::QpFatal { .. }
                | AsyncEvent::QpAccessError { .. }
                | AsyncEvent::QpRequestError { .. }
        ) {
            self.post(Note::QpError, irql);
        }
    }
    fn on_destroyed(&self, irql: &Dispatch<'_>) {
        self.post(Note::QpDestroyed, irql);
    }
}

impl CmHandler for ConnShared {
    fn on_event(&self, _id: CmId, event: CmEvent<'_>, irql: &Dispatch<'_>) {
        let note = match event {
            CmEvent::Established { .. } => Note::Established,
            _ => Note::Terminal,
        };
        self.post(note, irql);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Phase {
    Accepting,
    Live,
    Disconnecting,
    DestroyingQp,
    DestroyingCq,
    Done,
}

/// One connection, owned by the service thread.
struct Conn {
    logic: ConnId,
    cm_id: CmId,
    qp: Qp<Hp, WrCtx>,
    cq: Cq<Hp, WrCtx>,
    recv_mr: Mr<Hp>,
    send_mr: Mr<Hp>,
    free_send: Vec<u32>,
    phase: Phase,
    full: bool,
    snd_w_inv: bool,
    /// STags of commands in progress: (read, write, expected data
    /// transfer length).
    stags: HashMap<u32, (Option<RdmaBuf>, Option<RdmaBuf>, u32)>,
    staging: HashMap<u64, (u32, Mr<Hp>)>,
    /// SCSI Responses in flight by send slot: the command's read buffer
    /// and length, and an after-response hostile write armed on it.
    responses: HashMap<u32, (u32, Option<RdmaBuf>, u32, Option<Duration>)>,
    /// Read buffers whose responses were delivered (newest last).
    delivered: VecDeque<(Instant, u32, RdmaBuf, u32)>,
    /// Commands an after-response hostile write is armed on.
    armed_after: HashMap<u32, Duration>,
    /// After-response hostile writes due: (when, ITT, buffer, length).
    later: Vec<(Instant, u32, RdmaBuf, u32)>,
    /// Hostile work requests in flight: report index and scratch MR.
    hostile: HashMap<u64, (usize, Mr<Hp>)>,
    early: VecDeque<Vec<u8>>,
    /// Outputs waiting for a send buffer.
    waiting: VecDeque<Output>,
}

/// A request from the test to the service thread.
#[derive(Debug, Clone)]
enum Request {
    Async {
        event: IscsiAsyncEvent,
        parameter2: u16,
        parameter3: u16,
    },
    Ping,
    Drop,
    ReleaseResponses,
    OpenWindow,
}

struct Pending {
    id: CmId,
    flags: u8,
    responder_resources: u8,
}

/// What the service thread and the callbacks share.
struct Service {
    platform: Hp,
    device: Device<Hp>,
    pd: Pd<Hp>,
    port: CmPort<Hp>,
    config: IserTargetConfig,
    logic: Mutex<IscsiTarget>,
    rdma: Mutex<IserMisbehaviour>,
    pending: SpinLock<VecDeque<Pending>, Hp>,
    mailbox: SpinLock<VecDeque<(u64, Note)>, Hp>,
    requests: Mutex<VecDeque<Request>>,
    lost: AtomicBool,
    wake: HostEvent,
    stopping: AtomicBool,
    counters: Counters,
    live: AtomicU64,
    open: AtomicU64,
    capture: Mutex<Option<Vec<Captured>>>,
    hostile_reports: Mutex<Vec<HostileReport>>,
}

impl Service {
    fn capture(&self, c: impl FnOnce() -> Captured) {
        let mut cap = self.capture.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(v) = cap.as_mut() {
            v.push(c());
        }
    }

    fn add_hostile(&self, r: HostileReport) -> usize {
        self.counters
            .hostile_attempts
            .fetch_add(1, Ordering::Relaxed);
        let mut v = self
            .hostile_reports
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        v.push(r);
        v.len() - 1
    }

    fn set_hostile_outcome(&self, index: usize, outcome: HostileOutcome) {
        if let Some(r) = self
            .hostile_reports
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_mut(index)
        {
            r.outcome = outcome;
        }
    }

    /// Takes the armed hostile attempt if `applies` says it fits.
    fn take_hostile(
        &self,
        applies: impl FnOnce(&HostileAttempt) -> bool,
    ) -> Option<HostileAttempt> {
        let mut m = self.rdma.lock().unwrap_or_else(PoisonError::into_inner);
        let h = m.hostile?;
        if applies(&h) {
            m.hostile = None;
            Some(h)
        } else {
            None
        }
    }
}

struct Listener {
    svc: Weak<Service>,
}

impl CmListener for Listener {
    fn on_event(&self, _l: ListenerId, event: ListenEvent<'_>, irql: &Dispatch<'_>) {
        let ListenEvent::Request(r) = event else {
            return;
        };
        let Some(s) = self.svc.upgrade() else {
            return;
        };
        let flags = r.private_data.first().copied().unwrap_or(0);
        {
            let mut p = s.pending.lock(irql);
            if p.len() < p.capacity() {
                p.push_back(Pending {
                    id: r.id,
                    flags,
                    responder_resources: r.responder_resources,
                });
            } else {
                let _ = s
                    .port
                    .reject(r.id, CmRejectReason::ConsumerDefined, &[], irql);
            }
        }
        s.wake.set(irql);
    }
}

/// The service thread's state.
struct Worker {
    svc: Arc<Service>,
    conns: HashMap<u64, Conn>,
    next_key: u64,
    next_wr: u64,
}

impl Worker {
    fn run(mut self, p: &Passive<'_>) {
        let mut notes = Vec::with_capacity(MAILBOX);
        loop {
            loop {
                let next = self.svc.pending.lock(p).pop_front();
                let Some(pending) = next else { break };
                self.accept(&pending, p);
            }
            loop {
                let next = self
                    .svc
                    .requests
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .pop_front();
                let Some(r) = next else { break };
                self.request(&r, p);
            }
            {
                let mut m = self.svc.mailbox.lock(p);
                notes.extend(m.drain(..));
            }
            for (key, note) in notes.drain(..) {
                self.note(key, note, p);
            }
            self.fire_later(p);
            let done: Vec<u64> = self
                .conns
                .iter()
                .filter(|(_, c)| c.phase == Phase::Done)
                .map(|(k, _)| *k)
                .collect();
            for key in done {
                if let Some(c) = self.conns.remove(&key) {
                    self.release(c, p);
                }
            }
            let stopping = self.svc.stopping.load(Ordering::Acquire);
            if stopping {
                let keys: Vec<u64> = self.conns.keys().copied().collect();
                for k in keys {
                    self.disconnect(k, p);
                }
                if self.conns.is_empty() {
                    return;
                }
            }
            self.svc.live.store(
                self.conns
                    .values()
                    .filter(|c| c.full && c.phase == Phase::Live)
                    .count() as u64,
                Ordering::Release,
            );
            self.svc
                .open
                .store(self.conns.len() as u64, Ordering::Release);
            let _ = self.svc.wake.wait_timeout(Duration::from_millis(20), p);
        }
    }

    fn accept(&mut self, pending: &Pending, p: &Passive<'_>) {
        let svc = Arc::clone(&self.svc);
        let rdma = svc
            .rdma
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if rdma.reject_connect || svc.stopping.load(Ordering::Acquire) {
            let _ = svc
                .port
                .reject(pending.id, CmRejectReason::ConsumerDefined, &[], p);
            return;
        }
        let req = IserCmRepr::parse(&IserCmHeader::new_unchecked(&[pending.flags, 0, 0, 0][..]))
            .map(|r| r.flags)
            .unwrap_or_default();
        let snd_w_inv = !req.contains(IserCmFlags::SEND_WITH_INVALIDATE_NOT_SUPPORTED)
            && !rdma.refuse_send_with_invalidate;
        let key = self.next_key;
        self.next_key += 1;
        let shared = Arc::new(ConnShared {
            key,
            svc: Arc::downgrade(&svc),
        });
        let Ok(conn) = self.create(key, pending.id, &shared, p) else {
            let _ = svc
                .port
                .reject(pending.id, CmRejectReason::ConsumerDefined, &[], p);
            return;
        };
        let qpn = conn.qp.qpn();
        let qp: Arc<dyn CmQp> = Arc::new(conn.qp.clone());
        let mut conn = conn;
        conn.snd_w_inv = snd_w_inv;
        let mut rep_flags = IserCmFlags::ZBVA_NOT_SUPPORTED;
        if !snd_w_inv {
            rep_flags |= IserCmFlags::SEND_WITH_INVALIDATE_NOT_SUPPORTED;
        }
        let mut rep = [0u8; CM_HEADER_LEN];
        let _ =
            IserCmRepr { flags: rep_flags }.emit(&mut IserCmHeader::new_unchecked(&mut rep[..]));
        let params = ConnParams {
            responder_resources: 4,
            initiator_depth: pending.responder_resources.clamp(1, 16),
            rnr_retry_count: 7,
            ..ConnParams::SRP
        };
        let accept = AcceptRequest {
            qp: LocalQp {
                qpn: hca_lowlevel::wire::Qpn::from_low_bits(qpn),
                starting_psn: None,
            },
            params,
            private_data: &rep,
        };
        let handler: Arc<dyn CmHandler> = shared;
        let ok = svc
            .port
            .accept(pending.id, &accept, &qp, &handler, p)
            .is_ok();
        svc.counters.connections.fetch_add(1, Ordering::Relaxed);
        if !ok {
            conn.phase = Phase::DestroyingQp;
            let _ = conn.qp.destroy(p);
        }
        self.conns.insert(key, conn);
    }

    fn create(
        &mut self,
        _key: u64,
        cm_id: CmId,
        shared: &Arc<ConnShared>,
        p: &Passive<'_>,
    ) -> Result<Conn, kverbs::error::VerbsError> {
        let svc = &self.svc;
        let recv_mr = Mr::alloc(
            &svc.pd,
            (RX_RING * RX_SIZE) as usize,
            AccessFlags::LOCAL_WRITE,
            p,
        )?;
        let send_mr = match Mr::alloc(
            &svc.pd,
            (TX_SLOTS * RX_SIZE) as usize,
            AccessFlags::LOCAL_WRITE,
            p,
        ) {
            Ok(m) => m,
            Err(e) => {
                let _ = recv_mr.dereg(p);
                return Err(e);
            }
        };
        let cq = match Cq::create(
            &svc.device,
            CqConfig::new(4096),
            shared.clone() as Arc<dyn CqHandler<WrCtx>>,
            p,
        ) {
            Ok(c) => c,
            Err(e) => {
                let _ = recv_mr.dereg(p);
                let _ = send_mr.dereg(p);
                return Err(e);
            }
        };
        let qp = match Qp::create(
            &svc.pd,
            &QpConfig {
                qp_type: QpType::Rc,
                send_cq: cq.clone(),
                recv_cq: cq.clone(),
                send_wqebbs: 2047,
                recv_slots: RX_RING,
                max_recv_sge: 1,
                port: 1,
            },
            svc.port.qp_events(shared.clone() as Arc<dyn QpHandler>, p),
            p,
        ) {
            Ok(q) => q,
            Err(e) => {
                let _ = cq.destroy(p);
                let _ = recv_mr.dereg(p);
                let _ = send_mr.dereg(p);
                return Err(e);
            }
        };
        let logic = svc
            .logic
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .accept();
        let mut conn = Conn {
            logic,
            cm_id,
            qp,
            cq,
            recv_mr,
            send_mr,
            free_send: (0..TX_SLOTS).rev().collect(),
            phase: Phase::Accepting,
            full: false,
            snd_w_inv: false,
            stags: HashMap::new(),
            staging: HashMap::new(),
            responses: HashMap::new(),
            delivered: VecDeque::new(),
            armed_after: HashMap::new(),
            later: Vec::new(),
            hostile: HashMap::new(),
            early: VecDeque::new(),
            waiting: VecDeque::new(),
        };
        let (attr, mask) = init_attrs(
            1,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE,
        );
        // One login buffer, as isert.
        if conn.qp.modify(&attr, mask, p).is_err() || !post_recv(&conn, 0, p) {
            conn.phase = Phase::DestroyingQp;
            let _ = conn.qp.destroy(p);
            return Ok(conn);
        }
        Ok(conn)
    }

    fn request(&mut self, r: &Request, p: &Passive<'_>) {
        let keys: Vec<u64> = self
            .conns
            .iter()
            .filter(|(_, c)| c.full && c.phase == Phase::Live)
            .map(|(k, _)| *k)
            .collect();
        for key in keys {
            let Some(logic) = self.conns.get(&key).map(|c| c.logic) else {
                continue;
            };
            let out = {
                let mut l = self
                    .svc
                    .logic
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                match r {
                    Request::Async {
                        event,
                        parameter2,
                        parameter3,
                    } => l.send_async(logic, *event, *parameter2, *parameter3),
                    Request::Ping => l.send_ping(logic),
                    Request::Drop => l.drop_connection(logic),
                    Request::ReleaseResponses => l.release_responses(logic),
                    Request::OpenWindow => l.open_window(logic),
                }
            };
            self.outputs(key, out, p);
        }
    }

    fn note(&mut self, key: u64, note: Note, p: &Passive<'_>) {
        let Some(phase) = self.conns.get(&key).map(|c| c.phase) else {
            return;
        };
        match note {
            Note::Wc(c) => self.completion(key, &c, p),
            Note::Established => {
                if phase == Phase::Accepting {
                    if let Some(c) = self.conns.get_mut(&key) {
                        c.phase = Phase::Live;
                    }
                    let early: Vec<Vec<u8>> = self
                        .conns
                        .get_mut(&key)
                        .map(|c| c.early.drain(..).collect())
                        .unwrap_or_default();
                    for pdu in early {
                        self.pdu(key, &pdu, p);
                    }
                } else if phase == Phase::Disconnecting {
                    if let Some(c) = self.conns.get(&key) {
                        let _ = self.svc.port.disconnect(c.cm_id, &[], p);
                    }
                }
            }
            Note::Terminal => {
                if phase < Phase::DestroyingQp {
                    self.destroy_qp(key, p);
                }
            }
            Note::QpError => self.disconnect(key, p),
            Note::QpDestroyed => {
                if let Some(c) = self.conns.get_mut(&key) {
                    if c.phase == Phase::DestroyingQp {
                        c.phase = Phase::DestroyingCq;
                        if c.cq.destroy(p).is_err() {
                            c.phase = Phase::Done;
                        }
                    }
                }
            }
            Note::CqDestroyed => {
                if let Some(c) = self.conns.get_mut(&key) {
                    c.phase = Phase::Done;
                }
            }
        }
    }

    fn destroy_qp(&mut self, key: u64, p: &Passive<'_>) {
        let logic = if let Some(c) = self.conns.get_mut(&key) {
            c.phase = Phase::DestroyingQp;
            let _ = c.qp.destroy(p);
            Some(c.logic)
        } else {
            None
        };
        if let Some(l) = logic {
            self.svc
                .logic
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .connection_lost(l);
        }
    }

    fn disconnect(&mut self, key: u64, p: &Passive<'_>) {
        let Some(c) = self.conns.get_mut(&key) else {
            return;
        };
        if c.phase >= Phase::Disconnecting {
            return;
        }
        let was = c.phase;
        c.phase = Phase::Disconnecting;
        if self.svc.port.disconnect(c.cm_id, &[], p).is_err() && was == Phase::Live {
            // Gone already: its terminal event is on its way.
        }
    }

    fn completion(&mut self, key: u64, c: &Completion<WrCtx>, p: &Passive<'_>) {
        if let WcStatus::Error(_) = c.status {
            self.svc.counters.wr_errors.fetch_add(1, Ordering::Relaxed);
            self.disconnect(key, p);
        }
        let ok = c.status == WcStatus::Success;
        match c.context {
            Some(WrCtx::Recv(slot)) => {
                if !ok {
                    return;
                }
                let Some(conn) = self.conns.get(&key) else {
                    return;
                };
                let len = c.byte_len.min(RX_SIZE) as usize;
                let mut buf = vec![0u8; len];
                let _ = conn
                    .recv_mr
                    .mem()
                    .read(slot as usize * RX_SIZE as usize, &mut buf);
                let full = conn.full;
                let live = conn.phase == Phase::Live;
                if full {
                    post_recv(conn, slot, p);
                }
                if live {
                    self.pdu(key, &buf, p);
                } else if let Some(conn) = self.conns.get_mut(&key) {
                    conn.early.push_back(buf);
                }
            }
            Some(WrCtx::Send(slot)) => {
                if let Some(conn) = self.conns.get_mut(&key) {
                    conn.free_send.push(slot);
                    if let Some((itt, read, len, after)) = conn.responses.remove(&slot) {
                        if let (true, Some(buf)) = (ok, read) {
                            let now = Instant::now();
                            conn.delivered.push_back((now, itt, buf, len));
                            if conn.delivered.len() > 64 {
                                conn.delivered.pop_front();
                            }
                            if let Some(delay) = after {
                                conn.later.push((now + delay, itt, buf, len));
                            }
                        }
                    }
                }
                self.flush_waiting(key, p);
            }
            Some(WrCtx::Hostile(id)) => {
                if let Some((index, mr)) = self
                    .conns
                    .get_mut(&key)
                    .and_then(|conn| conn.hostile.remove(&id))
                {
                    let _ = mr.dereg(p);
                    let outcome = match c.status {
                        WcStatus::Success => HostileOutcome::Succeeded,
                        WcStatus::Flushed => HostileOutcome::Flushed,
                        WcStatus::Error(s) => HostileOutcome::Refused(s),
                    };
                    self.svc.set_hostile_outcome(index, outcome);
                }
            }
            Some(WrCtx::Write(id)) => {
                if let Some(conn) = self.conns.get_mut(&key) {
                    if let Some((_, mr)) = conn.staging.remove(&id) {
                        let _ = mr.dereg(p);
                    }
                }
            }
            Some(WrCtx::Read(id)) => {
                let Some(conn) = self.conns.get_mut(&key) else {
                    return;
                };
                let Some((itt, mr)) = conn.staging.remove(&id) else {
                    return;
                };
                let mut data = vec![0u8; mr.len()];
                let _ = mr.mem().read(0, &mut data);
                let _ = mr.dereg(p);
                if ok {
                    let logic = conn.logic;
                    let out = self
                        .svc
                        .logic
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .rdma_read_done(logic, itt, &data);
                    self.outputs(key, out, p);
                }
            }
            None => {}
        }
    }

    /// One PDU received (iSER header and iSCSI PDU).
    fn pdu(&mut self, key: u64, buf: &[u8], p: &Passive<'_>) {
        let Some(conn) = self.conns.get_mut(&key) else {
            return;
        };
        let header = IserHeader::new_checked(buf)
            .ok()
            .and_then(|h| IserCtrlRepr::parse(&h).ok());
        self.svc.capture(|| Captured::Received {
            conn: key,
            pdu: buf.to_vec(),
        });
        let (Some(header), Some(pdu)) = (header, buf.get(HEADER_LEN..)) else {
            self.svc.counters.malformed.fetch_add(1, Ordering::Relaxed);
            self.disconnect(key, p);
            return;
        };
        let opcode = pdu.first().map(|b| b & 0x3F);
        if opcode == Some(0x00) && conn.full {
            let ignore = self
                .svc
                .rdma
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .ignore_nop_out;
            if ignore {
                self.svc
                    .counters
                    .nop_outs_ignored
                    .fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
        // A SCSI Command's STags.
        let mut command = None;
        if opcode == Some(0x01) {
            if let (Some(itt), Some(edtl)) = (pdu.get(16..20), pdu.get(20..24)) {
                let itt = u32::from_be_bytes([itt[0], itt[1], itt[2], itt[3]]);
                let edtl = u32::from_be_bytes([edtl[0], edtl[1], edtl[2], edtl[3]]);
                conn.stags.insert(itt, (header.read, header.write, edtl));
                command = Some((itt, header.read, header.write, edtl));
            }
        }
        if let Some((itt, read, write, edtl)) = command {
            self.svc
                .counters
                .scsi_commands
                .fetch_add(1, Ordering::Relaxed);
            self.hostile_on_command(key, itt, read, write, edtl, p);
        }
        let Some(conn) = self.conns.get_mut(&key) else {
            return;
        };
        let logic = conn.logic;
        let was_full = conn.full;
        let (out, full) = {
            let mut l = self
                .svc
                .logic
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let out = l.receive(logic, pdu);
            (out, l.is_full_feature(logic))
        };
        if let Some(conn) = self.conns.get_mut(&key) {
            if !was_full {
                if full {
                    // The full ring before the final Login Response.
                    conn.full = true;
                    for slot in 0..RX_RING {
                        post_recv(conn, slot, p);
                    }
                } else {
                    // The login buffer again, after the response is built.
                    post_recv(conn, 0, p);
                }
            }
        }
        self.outputs(key, out, p);
    }

    fn outputs(&mut self, key: u64, out: Vec<Output>, p: &Passive<'_>) {
        if let Some(conn) = self.conns.get_mut(&key) {
            conn.waiting.extend(out);
        }
        self.flush_waiting(key, p);
    }

    fn flush_waiting(&mut self, key: u64, p: &Passive<'_>) {
        let rdma = self
            .svc
            .rdma
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        loop {
            let Some(conn) = self.conns.get_mut(&key) else {
                return;
            };
            if conn.phase != Phase::Live {
                conn.waiting.clear();
                return;
            }
            let Some(o) = conn.waiting.front() else {
                return;
            };
            if matches!(o, Output::Send(..)) && conn.free_send.is_empty() {
                return;
            }
            let Some(o) = conn.waiting.pop_front() else {
                return;
            };
            let posted = match o {
                Output::Send(_, pdu) => self.send(key, &pdu, &rdma, p),
                Output::RdmaWrite {
                    itt, offset, data, ..
                } => self.rdma_write(key, itt, offset, &data, p),
                Output::RdmaRead {
                    itt, offset, len, ..
                } => self.rdma_read(key, itt, offset, len, &rdma, p),
                Output::Close(_) => {
                    self.disconnect(key, p);
                    return;
                }
            };
            if !posted {
                self.disconnect(key, p);
                return;
            }
        }
    }

    fn send(&mut self, key: u64, pdu: &[u8], rdma: &IserMisbehaviour, p: &Passive<'_>) -> bool {
        let svc = Arc::clone(&self.svc);
        let Some(conn) = self.conns.get_mut(&key) else {
            return false;
        };
        let Some(slot) = conn.free_send.pop() else {
            return false;
        };
        let mut buf = vec![0u8; HEADER_LEN + pdu.len()];
        let _ = IserCtrlRepr::default().emit(&mut IserHeader::new_unchecked(&mut buf[..]));
        buf[HEADER_LEN..].copy_from_slice(pdu);
        if buf.len() > RX_SIZE as usize {
            return false;
        }
        let _ = conn
            .send_mr
            .mem()
            .write(slot as usize * RX_SIZE as usize, &buf);
        let Some(sge) = conn
            .send_mr
            .sge(u64::from(slot) * u64::from(RX_SIZE), buf.len() as u32)
        else {
            return false;
        };
        let sges = [sge];
        let mut wr = SendWr::new(Payload::Sges(&sges));
        // A SCSI Response: invalidate the command's STag when allowed.
        if pdu.first().map(|b| b & 0x3F) == Some(0x21) {
            let itt = u32::from_be_bytes([pdu[16], pdu[17], pdu[18], pdu[19]]);
            if let Some((read, write, len)) = conn.stags.remove(&itt) {
                let after = conn.armed_after.remove(&itt);
                conn.responses.insert(slot, (itt, read, len, after));
                let stag = read.or(write).map(|b| b.stag);
                if let Some(stag) = stag {
                    if conn.snd_w_inv || rdma.unannounced_invalidate {
                        let stag = if rdma.bogus_invalidate {
                            stag.wrapping_add(0x100)
                        } else {
                            stag
                        };
                        wr.invalidate = Some(stag);
                        svc.counters
                            .send_with_invalidate
                            .fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
        svc.capture(|| Captured::Sent {
            conn: key,
            pdu: buf.clone(),
            invalidate: wr.invalidate,
        });
        let Ok(mut batch) = conn.qp.begin_send(p) else {
            return false;
        };
        if batch
            .send(&wr, Signal::Signalled(WrCtx::Send(slot)))
            .is_err()
        {
            return false;
        }
        batch.commit();
        true
    }

    fn staging(&mut self, len: usize, data: Option<&[u8]>, p: &Passive<'_>) -> Option<Mr<Hp>> {
        let mr = Mr::alloc(&self.svc.pd, len.max(1), AccessFlags::LOCAL_WRITE, p).ok()?;
        if let Some(d) = data {
            let _ = mr.mem().write(0, d);
        }
        Some(mr)
    }

    fn rdma_write(
        &mut self,
        key: u64,
        itt: u32,
        offset: u32,
        data: &[u8],
        p: &Passive<'_>,
    ) -> bool {
        let Some(read) = self
            .conns
            .get(&key)
            .and_then(|c| c.stags.get(&itt))
            .and_then(|(r, _, _)| *r)
        else {
            return false;
        };
        let Some(mr) = self.staging(data.len(), Some(data), p) else {
            return false;
        };
        let id = self.next_wr;
        self.next_wr += 1;
        let Some(conn) = self.conns.get_mut(&key) else {
            return false;
        };
        let Some(sge) = mr.sge(0, data.len() as u32) else {
            return false;
        };
        self.svc.capture(|| Captured::RdmaWrite {
            conn: key,
            itt,
            remote_addr: read.va + u64::from(offset),
            rkey: read.stag,
            len: data.len() as u32,
        });
        let Ok(mut batch) = conn.qp.begin_send(p) else {
            let _ = mr.dereg(p);
            return false;
        };
        let posted = batch
            .rdma_write(
                &WriteWr {
                    payload: Payload::Sges(&[sge]),
                    remote_addr: read.va + u64::from(offset),
                    rkey: read.stag,
                    imm: None,
                    flags: SendFlags::default(),
                },
                Signal::Signalled(WrCtx::Write(id)),
            )
            .is_ok();
        if !posted {
            drop(batch);
            let _ = mr.dereg(p);
            return false;
        }
        batch.commit();
        conn.staging.insert(id, (itt, mr));
        self.svc
            .counters
            .rdma_writes
            .fetch_add(1, Ordering::Relaxed);
        true
    }

    fn rdma_read(
        &mut self,
        key: u64,
        itt: u32,
        offset: u32,
        len: u32,
        rdma: &IserMisbehaviour,
        p: &Passive<'_>,
    ) -> bool {
        let Some(write) = self
            .conns
            .get(&key)
            .and_then(|c| c.stags.get(&itt))
            .and_then(|(_, w, _)| *w)
        else {
            return false;
        };
        let Some(mr) = self.staging(len as usize, None, p) else {
            return false;
        };
        let id = self.next_wr;
        self.next_wr += 1;
        let Some(conn) = self.conns.get_mut(&key) else {
            return false;
        };
        let Some(sge) = mr.sge(0, len) else {
            return false;
        };
        // isert: from the write VA, no offset added.
        let remote = if rdma.read_with_offset {
            write.va + u64::from(offset)
        } else {
            write.va
        };
        self.svc.capture(|| Captured::RdmaRead {
            conn: key,
            itt,
            remote_addr: remote,
            rkey: write.stag,
            len,
        });
        let Ok(mut batch) = conn.qp.begin_send(p) else {
            let _ = mr.dereg(p);
            return false;
        };
        let posted = batch
            .rdma_read(
                &ReadWr {
                    local: &[sge],
                    remote_addr: remote,
                    rkey: write.stag,
                    flags: SendFlags::default(),
                },
                Signal::Signalled(WrCtx::Read(id)),
            )
            .is_ok();
        if !posted {
            drop(batch);
            let _ = mr.dereg(p);
            return false;
        }
        batch.commit();
        conn.staging.insert(id, (itt, mr));
        self.svc.counters.rdma_reads.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Fires an armed hostile attempt that applies to this command.
    fn hostile_on_command(
        &mut self,
        key: u64,
        itt: u32,
        read: Option<RdmaBuf>,
        write: Option<RdmaBuf>,
        edtl: u32,
        p: &Passive<'_>,
    ) {
        let Some(conn) = self.conns.get(&key) else {
            return;
        };
        let settled = Instant::now().checked_sub(STALE_AGE);
        let stale = conn
            .delivered
            .iter()
            .rev()
            .find(|(at, ..)| settled.is_some_and(|s| *at <= s))
            .map(|&(_, itt, buf, len)| (itt, buf, len));
        let data_in = read.filter(|_| edtl > 0);
        let data_out = write.filter(|_| edtl > 0);
        let Some(attempt) = self.svc.take_hostile(|h| match h {
            HostileAttempt::StaleRkey => stale.is_some(),
            HostileAttempt::BeyondBuffer { .. }
            | HostileAttempt::ReadFromWriteOnly
            | HostileAttempt::AfterResponse { .. } => data_in.is_some(),
            HostileAttempt::WriteToReadOnly => data_out.is_some(),
        }) else {
            return;
        };
        let channel = u32::try_from(key).unwrap_or(u32::MAX);
        let report = |tag: u32, remote_addr: u64, rkey: u32, len: u32| HostileReport {
            attempt,
            channel,
            tag: u64::from(tag),
            remote_addr,
            rkey,
            len,
            outcome: HostileOutcome::Pending,
        };
        match attempt {
            HostileAttempt::StaleRkey => {
                let Some((old, buf, len)) = stale else { return };
                let len = len.clamp(1, 512);
                let index = self.svc.add_hostile(report(old, buf.va, buf.stag, len));
                self.post_hostile(key, index, false, buf.va, buf.stag, len, p);
            }
            HostileAttempt::BeyondBuffer { past_end } => {
                let Some(buf) = data_in else { return };
                let inside = edtl.min(64);
                let len = inside.saturating_add(past_end).min(HOSTILE_MAX);
                let addr = buf.va.wrapping_add(u64::from(edtl - inside));
                let index = self.svc.add_hostile(report(itt, addr, buf.stag, len));
                self.post_hostile(key, index, false, addr, buf.stag, len, p);
            }
            HostileAttempt::ReadFromWriteOnly => {
                let Some(buf) = data_in else { return };
                let len = edtl.min(512);
                let index = self.svc.add_hostile(report(itt, buf.va, buf.stag, len));
                self.post_hostile(key, index, true, buf.va, buf.stag, len, p);
            }
            HostileAttempt::WriteToReadOnly => {
                let Some(buf) = data_out else { return };
                let len = edtl.min(512);
                let index = self.svc.add_hostile(report(itt, buf.va, buf.stag, len));
                self.post_hostile(key, index, false, buf.va, buf.stag, len, p);
            }
            HostileAttempt::AfterResponse { delay } => {
                if let Some(conn) = self.conns.get_mut(&key) {
                    conn.armed_after.insert(itt, delay);
                }
            }
        }
    }

    /// Posts the after-response hostile writes that are due.
    fn fire_later(&mut self, p: &Passive<'_>) {
        let now = Instant::now();
        let mut due = Vec::new();
        for (key, conn) in &mut self.conns {
            let mut i = 0;
            while i < conn.later.len() {
                if conn.later.get(i).is_some_and(|l| l.0 <= now) {
                    due.push((*key, conn.later.swap_remove(i)));
                } else {
                    i += 1;
                }
            }
        }
        for (key, (_, itt, buf, len)) in due {
            let len = len.clamp(1, 512);
            let attempt = HostileAttempt::AfterResponse {
                delay: Duration::ZERO,
            };
            let index = self.svc.add_hostile(HostileReport {
                attempt,
                channel: u32::try_from(key).unwrap_or(u32::MAX),
                tag: u64::from(itt),
                remote_addr: buf.va,
                rkey: buf.stag,
                len,
                outcome: HostileOutcome::Pending,
            });
            self.post_hostile(key, index, false, buf.va, buf.stag, len, p);
        }
    }

    /// Posts one hostile RDMA WRITE (of [`HOSTILE_BYTE`]s) or READ and
    /// records its outcome in report `index`.
    #[allow(clippy::too_many_arguments)]
    fn post_hostile(
        &mut self,
        key: u64,
        index: usize,
        read: bool,
        remote_addr: u64,
        rkey: u32,
        len: u32,
        p: &Passive<'_>,
    ) {
        let fill = vec![HOSTILE_BYTE; len as usize];
        let mr = if read {
            self.staging(len as usize, None, p)
        } else {
            self.staging(len as usize, Some(&fill), p)
        };
        let id = self.next_wr;
        self.next_wr += 1;
        let posted = match (mr, self.conns.get_mut(&key)) {
            (Some(mr), Some(conn)) if conn.phase == Phase::Live => {
                let posted = match (mr.sge(0, len), conn.qp.begin_send(p)) {
                    (Some(sge), Ok(mut batch)) => {
                        let ctx = Signal::Signalled(WrCtx::Hostile(id));
                        let r = if read {
                            batch.rdma_read(
                                &ReadWr {
                                    local: &[sge],
                                    remote_addr,
                                    rkey,
                                    flags: SendFlags::default(),
                                },
                                ctx,
                            )
                        } else {
                            batch.rdma_write(
                                &WriteWr {
                                    payload: Payload::Sges(&[sge]),
                                    remote_addr,
                                    rkey,
                                    imm: None,
                                    flags: SendFlags::default(),
                                },
                                ctx,
                            )
                        };
                        if r.is_ok() {
                            batch.commit();
                            true
                        } else {
                            false
                        }
                    }
                    _ => false,
                };
                if posted {
                    conn.hostile.insert(id, (index, mr));
                } else {
                    let _ = mr.dereg(p);
                }
                posted
            }
            (Some(mr), _) => {
                let _ = mr.dereg(p);
                false
            }
            (None, _) => false,
        };
        if !posted {
            self.svc
                .set_hostile_outcome(index, HostileOutcome::NotPosted);
        }
    }

    fn release(&mut self, c: Conn, p: &Passive<'_>) {
        for (_, (_, mr)) in c.staging {
            let _ = mr.dereg(p);
        }
        for (_, (index, mr)) in c.hostile {
            let _ = mr.dereg(p);
            self.svc.set_hostile_outcome(index, HostileOutcome::Flushed);
        }
        let _ = c.recv_mr.dereg(p);
        let _ = c.send_mr.dereg(p);
        self.svc.counters.closed.fetch_add(1, Ordering::Relaxed);
    }
}

fn post_recv(conn: &Conn, slot: u32, p: &Passive<'_>) -> bool {
    let Some(sge) = conn
        .recv_mr
        .sge(u64::from(slot) * u64::from(RX_SIZE), RX_SIZE)
    else {
        return false;
    };
    let Ok(mut batch) = conn.qp.begin_recv(p) else {
        return false;
    };
    if batch.recv(&[sge], WrCtx::Recv(slot)).is_err() {
        return false;
    }
    batch.commit();
    true
}

/// A running software iSER target (see the [module docs](self)).
pub struct IserTarget {
    svc: Arc<Service>,
    thread: Option<JoinHandle<()>>,
    own_device: bool,
    stopped: bool,
}

impl std::fmt::Debug for IserTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IserTarget")
            .field("port", &self.svc.config.port)
            .finish_non_exhaustive()
    }
}

impl IserTarget {
    /// Starts a target on a software HCA (opens its device, closed at
    /// stop).
    ///
    /// # Errors
    /// [`IserStartError`].
    pub fn start_on_hca(
        platform: &Hp,
        hca: Arc<dyn HcaDevice>,
        config: IserTargetConfig,
        p: &Passive<'_>,
    ) -> Result<Self, IserStartError> {
        let device = Device::open(platform, VerifiedHca::new(hca), DeviceConfig::default(), p)
            .map_err(IserStartError::Verbs)?;
        let r = Self::start(&device, config, true, p);
        if r.is_err() {
            device.close(p);
        }
        r
    }

    /// Starts a target on `device`.
    ///
    /// # Errors
    /// [`IserStartError`].
    pub fn start(
        device: &Device<Hp>,
        config: IserTargetConfig,
        own_device: bool,
        p: &Passive<'_>,
    ) -> Result<Self, IserStartError> {
        let mut scsi = ScsiTarget::new(ScsiConfig::new(device.attr().node_guid));
        for (i, lun) in config.luns.iter().enumerate() {
            scsi.add_lun(u16::try_from(i).unwrap_or(u16::MAX), lun.clone())?;
        }
        let pd = device.alloc_pd(p).map_err(IserStartError::Verbs)?;
        let mut cm = kverbs::cm::CmConfig::new(hca_lowlevel::wire::Gid::ZERO, 0);
        if let Some(t) = config.cm_timing {
            cm.packet_lifetime = t.packet_lifetime;
            cm.cm_response_timeout = t.cm_response_timeout;
            cm.max_cm_retries = t.max_cm_retries;
            cm.timewait = t.timewait;
        }
        let port = match CmPort::create(
            device,
            1,
            CmPortConfig {
                cm,
                recv_buffers: 64,
                send_buffers: 64,
                trace: None,
            },
            p,
        ) {
            Ok(port) => port,
            Err(e) => {
                let _ = pd.dealloc(p);
                return Err(IserStartError::Verbs(e));
            }
        };
        let logic = IscsiTarget::new(config.iscsi.clone(), Arc::new(scsi));
        let capture = config.capture.then(Vec::new);
        let svc = Arc::new(Service {
            platform: device.platform().clone(),
            device: device.clone(),
            pd,
            port,
            config,
            logic: Mutex::new(logic),
            rdma: Mutex::new(IserMisbehaviour::default()),
            pending: SpinLock::new(VecDeque::with_capacity(64)),
            mailbox: SpinLock::new(VecDeque::with_capacity(MAILBOX)),
            requests: Mutex::new(VecDeque::new()),
            lost: AtomicBool::new(false),
            wake: HostEvent::new(EventKind::Synchronization, false),
            stopping: AtomicBool::new(false),
            counters: Counters::default(),
            live: AtomicU64::new(0),
            open: AtomicU64::new(0),
            capture: Mutex::new(capture),
            hostile_reports: Mutex::new(Vec::new()),
        });
        let mut target = IserTarget {
            svc: Arc::clone(&svc),
            thread: None,
            own_device,
            stopped: false,
        };
        let listener: Arc<dyn CmListener> = Arc::new(Listener {
            svc: Arc::downgrade(&svc),
        });
        if let Err(e) = svc.port.listen(
            ServiceId::rdma_cm(PortSpace::Tcp, svc.config.port),
            ListenKind::RdmaCm,
            &listener,
            p,
        ) {
            let _ = target.shutdown(p);
            return Err(IserStartError::Listen(e));
        }
        let worker = Worker {
            svc: Arc::clone(&svc),
            conns: HashMap::new(),
            next_key: 1,
            next_wr: 1,
        };
        let platform = svc.platform.clone();
        match std::thread::Builder::new()
            .name("isert".into())
            .spawn(move || platform.run_passive(|p| worker.run(p)))
        {
            Ok(t) => target.thread = Some(t),
            Err(e) => {
                let _ = target.shutdown(p);
                return Err(IserStartError::Thread(e));
            }
        }
        Ok(target)
    }

    /// The RDMA/CM port.
    #[must_use]
    pub fn port(&self) -> u16 {
        self.svc.config.port
    }

    /// The target's IQN.
    #[must_use]
    pub fn target_name(&self) -> &str {
        &self.svc.config.iscsi.target_name
    }

    /// The SCSI device server.
    #[must_use]
    pub fn scsi(&self) -> Arc<ScsiTarget> {
        Arc::clone(
            self.svc
                .logic
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .scsi(),
        )
    }

    /// Runs `f` on the iSCSI logic (its counters, misbehaviour switches,
    /// configuration).
    pub fn with_logic<R>(&self, f: impl FnOnce(&mut IscsiTarget) -> R) -> R {
        f(&mut self
            .svc
            .logic
            .lock()
            .unwrap_or_else(PoisonError::into_inner))
    }

    /// Sets the RDMA misbehaviour switches.
    pub fn set_rdma_misbehaviour(&self, m: IserMisbehaviour) {
        *self.svc.rdma.lock().unwrap_or_else(PoisonError::into_inner) = m;
    }

    /// Connections in full feature phase.
    #[must_use]
    pub fn live_connections(&self) -> usize {
        self.svc.live.load(Ordering::Acquire) as usize
    }

    /// Connections not yet torn down.
    #[must_use]
    pub fn open_connections(&self) -> usize {
        self.svc.open.load(Ordering::Acquire) as usize
    }

    /// Counters.
    #[must_use]
    pub fn counters(&self) -> IserCounters {
        let c = &self.svc.counters;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        IserCounters {
            connections: g(&c.connections),
            closed: g(&c.closed),
            send_with_invalidate: g(&c.send_with_invalidate),
            rdma_writes: g(&c.rdma_writes),
            rdma_reads: g(&c.rdma_reads),
            wr_errors: g(&c.wr_errors),
            malformed: g(&c.malformed),
            login_pdus_early: g(&c.login_pdus_early),
            nop_outs_ignored: g(&c.nop_outs_ignored),
            hostile_attempts: g(&c.hostile_attempts),
            scsi_commands: g(&c.scsi_commands),
        }
    }

    /// Starts recording what goes over the wire ([`Captured`]), from an
    /// empty record.
    pub fn start_capture(&self) {
        *self
            .svc
            .capture
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(Vec::new());
    }

    /// What was recorded since [`Self::start_capture`] (recording goes on).
    #[must_use]
    pub fn captured(&self) -> Vec<Captured> {
        self.svc
            .capture
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .unwrap_or_default()
    }

    /// Every hostile attempt made, with what happened.
    #[must_use]
    pub fn hostile_reports(&self) -> Vec<HostileReport> {
        self.svc
            .hostile_reports
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn request(&self, r: Request, p: &Passive<'_>) {
        self.svc
            .requests
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push_back(r);
        self.svc.wake.set(p);
    }

    /// Sends an Asynchronous Message on every live connection.
    pub fn send_async(
        &self,
        event: IscsiAsyncEvent,
        parameter2: u16,
        parameter3: u16,
        p: &Passive<'_>,
    ) {
        self.request(
            Request::Async {
                event,
                parameter2,
                parameter3,
            },
            p,
        );
    }

    /// Pings every live connection (NOP-In with a TTT).
    pub fn send_ping(&self, p: &Passive<'_>) {
        self.request(Request::Ping, p);
    }

    /// Drops every live connection (no PDU).
    pub fn drop_connections(&self, p: &Passive<'_>) {
        self.request(Request::Drop, p);
    }

    /// Sends held responses.
    pub fn release_responses(&self, p: &Passive<'_>) {
        self.request(Request::ReleaseResponses, p);
    }

    /// Opens a withheld window.
    pub fn open_window(&self, p: &Passive<'_>) {
        self.request(Request::OpenWindow, p);
    }

    /// Stops: every connection is disconnected and torn down.
    ///
    /// # Errors
    /// A message naming what did not finish in time.
    pub fn stop(mut self, p: &Passive<'_>) -> Result<(), String> {
        self.shutdown(p)
    }

    fn shutdown(&mut self, p: &Passive<'_>) -> Result<(), String> {
        if self.stopped {
            return Ok(());
        }
        self.stopped = true;
        let s = Arc::clone(&self.svc);
        s.stopping.store(true, Ordering::Release);
        s.port.close(p);
        s.wake.set(p);
        let start = Instant::now();
        let timeout = s.config.stop_timeout;
        let mut result = Ok(());
        if let Some(t) = self.thread.take() {
            while !t.is_finished() {
                if start.elapsed() > timeout {
                    return Err("the service thread did not finish".into());
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            if t.join().is_err() {
                result = Err("the service thread panicked".into());
            }
        }
        while s.port.pending_consumers(p) != (0, 0) {
            if start.elapsed() > timeout {
                return Err("CM consumers left".into());
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        while matches!(s.port.release(p), Err(CmError::Busy)) {
            if start.elapsed() > timeout {
                return Err("CM port busy".into());
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let _ = s.pd.dealloc(p);
        if self.own_device {
            s.device.close(p);
        }
        result
    }
}

impl Drop for IserTarget {
    fn drop(&mut self) {
        if !self.stopped {
            let platform = self.svc.platform.clone();
            platform.run_passive(|p| {
                let _ = self.shutdown(p);
            });
        }
    }
}
