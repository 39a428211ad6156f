//! Queue pairs: RC and UD (including the GSI QP, QP1, for management
//! datagrams), posting as a batch, exact send-queue accounting, the
//! asynchronous slow path, and disconnect-and-flush with a drain marker.
//!
//! # Posting order
//!
//! [`Qp::begin_send`] takes the send queue's spin lock and claims the
//! producer side of the QP's work-request table; each push builds one WQE
//! in a local buffer (mlx5's BlueFlame idea) and copies it into the ring
//! with 64-bit stores at the producer counter, storing the request's
//! context in the slot the WQE's counter indexes. Nothing is visible to
//! the device yet. [`SendBatch::commit`] then follows
//! [`hca_lowlevel::barrier`] exactly: [`barrier::to_device`], publish the
//! table up to the new counter (so a completion arriving during the
//! doorbell finds its context), write the doorbell record,
//! [`barrier::mmio_wc_start`], write the doorbell register once with the
//! last WQE's first eight bytes, [`barrier::mmio_flush_writes`] — all
//! still under the lock, so two processors' doorbells cannot reach the
//! device out of order. Dropping a batch without committing posts nothing:
//! the counter goes back, the contexts are taken back out of the table.
//!
//! Why an internal spin lock rather than `&mut` on a queue handle: the
//! doorbell ordering rule needs *some* lock around the doorbell, and
//! StorPort calls a virtual miniport's `HwStartIo` on any processor with no
//! lock of its own, so the lock would otherwise move into every consumer.
//! The lock is per queue (send and receive post concurrently, as NDK
//! allows), held only for the batch — a few WQE copies and one doorbell —
//! and a batch is a guard, so it can never be held across anything else.
//!
//! # Send-queue accounting
//!
//! The table ([`crate::slots`]) is the accounting: the producer may use the
//! free WQEBBs `capacity - (published - reclaimed)`, minus one WQEBB always
//! kept for the drain marker, and a push that does not fit is refused
//! *before anything is written* ([`PostErrorKind::QueueFull`], the request
//! handed back). A completion for WQE counter `n` reclaims everything up to
//! the end of that WQE — including every unsignalled WQE before it, whose
//! slots carry no context — so selective signalling keeps the accounting
//! exact across wrap-around, and the queue can never overflow. A counter
//! outside the outstanding window (a faulty device) is refused and
//! counted, never trusted.
//!
//! # Disconnect, the drain marker, and destroy
//!
//! [`Qp::disconnect_and_flush`] (any IRQL <= `DISPATCH_LEVEL`) stops new
//! posts, then the worker moves the QP to ERR — the device completes every
//! outstanding work request with a flush status, each exactly once, through
//! the normal CQ path — and posts one marker on each queue (a NOP on the
//! send queue, an empty receive), in the space kept for them. A marker is
//! posted after everything else on its queue and completes after it, so
//! when both markers' completions reach the CQ handlers every earlier
//! completion has been delivered; then [`QpHandler::on_flushed`] runs (the
//! `ib_drain_qp` guarantee). [`Qp::destroy`] destroys only after the drain:
//! it flushes first if needed, then destroys on the device, detaches from
//! the CQs, and finally [`QpHandler::on_destroyed`] runs once every
//! callback in flight has returned; no callback of the QP runs after it.

use alloc::sync::{Arc, Weak};
use core::fmt;

use hca_lowlevel::barrier;
use hca_lowlevel::cqe::CqeRepr;
use hca_lowlevel::device::{
    AsyncEvent, GSI_QKEY, HcaError, QpAttr, QpAttrMask, QpCaps, QpInit, QpState, QpType,
};
use hca_lowlevel::doorbell::{DoorbellRegister, QpDoorbellRecord};
use hca_lowlevel::ring::{RecvRing, SendRing, SendWqeWriter, WqeHeader};
use hca_lowlevel::wqe::{
    CtrlFlags, DataSegRepr, DatagramSegRepr, MAX_PAGE_SHIFT, MIN_PAGE_SHIFT, RegMrSegRepr,
    SendOpcode,
};

use crate::cq::{Cq, CqItem, DrainMarker};
use crate::device::{AsyncTarget, DeviceInner, TargetId};
use crate::error::{PostError, PostErrorKind, VerbsError};
use crate::irql::{AnyIrql, Dispatch, LeDispatch, Passive};
use crate::mr::{FrMr, FrState, INLINE_PAGES, Mr};
use crate::pd::Pd;
use crate::platform::Platform;
use crate::rundown::Rundown;
use crate::slots::{Producer, SlotRing};
use crate::slowpath::{Callback, Job, ResultSlot, take_result};
use crate::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use crate::sync::{SpinLock, SpinLockGuard};
use crate::words::PinnedWords;
use crate::worker::{CompleteAt, Outcome, Rejected, RequestQueue, WorkHandler};
use crate::wr::{
    Completion, FastReg, GRH_LEN, Grh, Payload, ReadWr, SendFlags, SendWr, Sge, Signal, UdDest,
    UdSource, WriteWr,
};

/// Which queue of a QP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueueKind {
    /// The send queue.
    Send,
    /// The receive queue.
    Recv,
}

/// Receives a QP's events.
pub trait QpHandler: Send + Sync {
    /// An asynchronous event naming this QP (fatal error, access error,
    /// communication established, last WQE reached...).
    ///
    /// # IRQL
    ///
    /// `DISPATCH_LEVEL`.
    fn on_async_event(&self, event: AsyncEvent, irql: &Dispatch<'_>) {
        let _ = (event, irql);
    }

    /// [`Qp::disconnect_and_flush`] finished: every work request posted
    /// before it has completed and been delivered (`Ok`), or the move to
    /// ERR failed (`Err`, nothing was flushed by kverbs).
    ///
    /// # IRQL
    ///
    /// `DISPATCH_LEVEL`.
    fn on_flushed(&self, result: Result<(), VerbsError>, irql: &Dispatch<'_>) {
        let _ = (result, irql);
    }

    /// The QP is destroyed; no callback of it runs after this one.
    ///
    /// # IRQL
    ///
    /// `DISPATCH_LEVEL`.
    fn on_destroyed(&self, irql: &Dispatch<'_>) {
        let _ = irql;
    }
}

/// A handler that ignores everything (for QPs whose owner only polls).
#[derive(Debug, Default)]
pub struct NoQpEvents;

impl QpHandler for NoQpEvents {}

/// How to create a QP.
pub struct QpConfig<P: Platform, C: Send + 'static> {
    /// RC, UD or GSI.
    pub qp_type: QpType,
    /// The CQ for send completions.
    pub send_cq: Cq<P, C>,
    /// The CQ for receive completions (may be the same CQ).
    pub recv_cq: Cq<P, C>,
    /// Send queue size in WQEBBs (one WQEBB is kept for the drain marker;
    /// a WQE takes one WQEBB, or more with inline data, UD addresses,
    /// inline page lists).
    pub send_wqebbs: u32,
    /// Receive queue slots (one is kept for the drain marker).
    pub recv_slots: u32,
    /// Scatter entries per receive.
    pub max_recv_sge: u32,
    /// Port (GSI: the port whose QP1 this is).
    pub port: u8,
}

impl<P: Platform, C: Send + 'static> Clone for QpConfig<P, C> {
    fn clone(&self) -> Self {
        QpConfig {
            qp_type: self.qp_type,
            send_cq: self.send_cq.clone(),
            recv_cq: self.recv_cq.clone(),
            send_wqebbs: self.send_wqebbs,
            recv_slots: self.recv_slots,
            max_recv_sge: self.max_recv_sge,
            port: self.port,
        }
    }
}

/// One send-queue slot of the work-request table: the context and what
/// the completion side needs to reclaim the WQE.
pub(crate) struct SendSlot<C> {
    context: Option<C>,
    wqebbs: u8,
    marker: bool,
}

/// One receive-queue slot.
pub(crate) struct RecvSlot<P: Platform, C: Send + 'static> {
    context: Option<C>,
    /// UD: where the GRH lands (the MR and the offset in its memory).
    grh_at: Option<(Mr<P>, u64)>,
    marker: bool,
}

struct SendQueue {
    /// Its words looked up once (see [`PinnedWords`]): every post writes
    /// a WQE into it.
    ring: SendRing<PinnedWords>,
    doorbell: Arc<dyn DoorbellRegister>,
    /// Committed producer counter (WQEBBs).
    pi: u32,
    accepting: bool,
}

struct RecvQueue {
    ring: RecvRing<PinnedWords>,
    pi: u32,
    accepting: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Active,
    Flushing,
    Flushed,
    Destroying,
    Destroyed,
}

struct Life {
    phase: Phase,
    sq_marker_done: bool,
    rq_marker_done: bool,
    destroy_after_flush: bool,
}

/// Requests on the QP's own queue.
pub(crate) enum QpRequest {
    Modify {
        attr: QpAttr,
        mask: QpAttrMask,
        done: Callback<Result<(), VerbsError>>,
    },
    Flush,
    Destroy,
}

pub(crate) enum QpOutput {
    Modified(Result<(), VerbsError>, Callback<Result<(), VerbsError>>),
    Flushed(Result<(), VerbsError>),
    Destroyed,
}

pub(crate) struct QpWorker<P: Platform, C: Send + 'static> {
    qp: Weak<QpShared<P, C>>,
}

impl<P: Platform, C: Send + 'static> WorkHandler for QpWorker<P, C> {
    type Request = QpRequest;
    type Output = QpOutput;

    fn execute(&self, request: QpRequest, irql: &Passive<'_>) -> QpOutput {
        let qp = self.qp.upgrade();
        match request {
            QpRequest::Modify { attr, mask, done } => {
                let r = match &qp {
                    Some(qp) => qp.modify_now(&attr, mask),
                    None => Err(VerbsError::Closed),
                };
                QpOutput::Modified(r, done)
            }
            QpRequest::Flush => QpOutput::Flushed(match &qp {
                Some(qp) => qp.flush_now(irql),
                None => Err(VerbsError::Closed),
            }),
            QpRequest::Destroy => {
                if let Some(qp) = &qp {
                    qp.destroy_now(irql);
                }
                QpOutput::Destroyed
            }
        }
    }

    fn complete(&self, outcome: Outcome<QpRequest, QpOutput>, irql: AnyIrql<'_, '_>) {
        let qp = self.qp.upgrade();
        match outcome {
            Outcome::Done(QpOutput::Modified(r, done)) => {
                if let Some(qp) = &qp {
                    qp.user_requests.fetch_sub(1, Ordering::AcqRel);
                }
                done(r, irql);
            }
            Outcome::Cancelled(QpRequest::Modify { done, .. }) => {
                if let Some(qp) = &qp {
                    qp.user_requests.fetch_sub(1, Ordering::AcqRel);
                }
                done(Err(VerbsError::Cancelled), irql);
            }
            Outcome::Done(QpOutput::Flushed(r)) => {
                if let (Err(e), Some(qp)) = (r, &qp) {
                    qp.flush_failed(e, &irql);
                }
            }
            Outcome::Cancelled(QpRequest::Flush) => {
                if let Some(qp) = &qp {
                    qp.flush_failed(VerbsError::Cancelled, &irql);
                }
            }
            Outcome::Done(QpOutput::Destroyed) | Outcome::Cancelled(QpRequest::Destroy) => {
                if let Some(qp) = &qp {
                    qp.destroyed(&irql);
                }
            }
        }
    }
}

/// Counters of things that should not happen.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QpStats {
    /// Completions whose counter lay outside the outstanding window, or
    /// named an empty slot (dropped).
    pub bogus_completions: u64,
    /// Contexts found in a slot being reused (a completion the device
    /// never produced; the context was dropped).
    pub lost_contexts: u64,
}

pub(crate) struct QpShared<P: Platform, C: Send + 'static> {
    pub(crate) qpn: u32,
    qp_type: QpType,
    caps: QpCaps,
    port: u8,
    device: Arc<DeviceInner<P>>,
    pd: Pd<P>,
    send_cq: Cq<P, C>,
    recv_cq: Cq<P, C>,
    /// Written at every commit (words looked up once, as the rings').
    dbr: QpDoorbellRecord<PinnedWords>,
    sq: SpinLock<SendQueue, P>,
    rq: SpinLock<RecvQueue, P>,
    sq_slots: SlotRing<SendSlot<C>>,
    rq_slots: SlotRing<RecvSlot<P, C>>,
    handler: Arc<dyn QpHandler>,
    rundown: Arc<Rundown<P>>,
    requests: Option<RequestQueue<P, QpWorker<P, C>>>,
    /// User modify requests queued or running (the queue keeps two slots
    /// for flush and destroy).
    user_requests: AtomicU32,
    life: SpinLock<Life, P>,
    bogus: AtomicU64,
    lost: AtomicU64,
}

/// WQEBBs / slots kept for the drain marker.
const MARKER_RESERVE: u32 = 1;

impl<P: Platform, C: Send + 'static> QpShared<P, C> {
    fn depth(&self, queue: QueueKind) -> u32 {
        match queue {
            QueueKind::Send => self.sq_slots.capacity(),
            QueueKind::Recv => self.rq_slots.capacity(),
        }
    }

    /// Resolves a send-queue CQE to its work request.
    pub(crate) fn complete_send(&self, cqe: &CqeRepr) -> Option<CqItem<C>> {
        let Some(mut consumer) = self.sq_slots.consumer() else {
            self.bogus.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        let Some(index) = consumer.widen(cqe.wqe_counter) else {
            self.bogus.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        let Ok(Some(slot)) = consumer.take(index) else {
            self.bogus.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        // Everything up to the end of this WQE is free again: this WQE and
        // every unsignalled one before it.
        let end = index.wrapping_add(u32::from(slot.wqebbs.max(1)));
        if consumer.reclaim(end).is_err() {
            self.bogus.fetch_add(1, Ordering::Relaxed);
        }
        if slot.marker {
            return Some(CqItem::Marker(self.arc()?, QueueKind::Send));
        }
        Some(CqItem::Wc(Completion::from_cqe(cqe, true, slot.context)))
    }

    /// Resolves a receive-queue CQE to its work request.
    pub(crate) fn complete_recv(&self, cqe: &CqeRepr) -> Option<CqItem<C>> {
        let Some(mut consumer) = self.rq_slots.consumer() else {
            self.bogus.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        let Some(index) = consumer.widen(cqe.wqe_counter) else {
            self.bogus.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        let Ok(Some(slot)) = consumer.take(index) else {
            self.bogus.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        if consumer.reclaim(index.wrapping_add(1)).is_err() {
            self.bogus.fetch_add(1, Ordering::Relaxed);
        }
        if slot.marker {
            return Some(CqItem::Marker(self.arc()?, QueueKind::Recv));
        }
        if !self.qp_type.is_datagram() || cqe.opcode.is_error() {
            // Built in the return slot: a completion built first and
            // amended after (the datagram case below) is built on the
            // stack and copied out, ~90 bytes per receive.
            return Some(CqItem::Wc(Completion::from_cqe(cqe, false, slot.context)));
        }
        let mut wc = Completion::from_cqe(cqe, false, slot.context);
        let pkey_index = 0;
        let grh = match (&slot.grh_at, cqe.grh) {
            (Some((mr, offset)), true) => {
                let mut raw = [0u8; GRH_LEN];
                usize::try_from(*offset)
                    .ok()
                    .and_then(|at| mr.mem().read(at, &mut raw).ok())
                    .map(|()| Grh::parse(&raw))
            }
            _ => None,
        };
        wc.ud = Some(UdSource {
            src_qpn: cqe.src_qpn,
            pkey_index,
            pkey: self.device.pkey(self.port, pkey_index),
            grh,
        });
        Some(CqItem::Wc(wc))
    }

    /// The `Arc` the CQs hold (present while attached).
    fn arc(&self) -> Option<Arc<QpShared<P, C>>> {
        self.requests
            .as_ref()
            .and_then(|q| q.handler().qp.upgrade())
    }

    fn modify_now(&self, attr: &QpAttr, mask: QpAttrMask) -> Result<(), VerbsError> {
        if mask.contains(QpAttrMask::STATE) && attr.state == QpState::Reset {
            // RESET would discard outstanding work without completions.
            return Err(VerbsError::InvalidArgument);
        }
        Ok(self.device.hca.modify_qp(self.qpn, attr, mask)?)
    }

    /// The worker's half of the flush: ERR, then the markers.
    fn flush_now(&self, irql: &Passive<'_>) -> Result<(), VerbsError> {
        let attr = QpAttr {
            state: QpState::Err,
            ..QpAttr::default()
        };
        self.device
            .hca
            .modify_qp(self.qpn, &attr, QpAttrMask::STATE)?;
        // The receive marker first: the send marker's doorbell makes the
        // device look at both queues.
        self.post_recv_marker(irql)?;
        self.post_send_marker(irql)
    }

    fn post_send_marker(&self, irql: &Passive<'_>) -> Result<(), VerbsError> {
        let mut batch = SendBatch::open(self, irql, false).map_err(|_| VerbsError::Closed)?;
        batch.marker = true;
        batch
            .push(
                SendOpcode::Nop,
                SendFlags::default(),
                0,
                Signal::Unsignalled,
                |_| Ok(()),
            )
            .map_err(|_| VerbsError::QueueFull)?;
        batch.commit();
        Ok(())
    }

    fn post_recv_marker(&self, irql: &Passive<'_>) -> Result<(), VerbsError> {
        let mut batch = RecvBatch::open(self, irql).map_err(|_| VerbsError::Closed)?;
        batch.marker = true;
        batch
            .push(&[], None, None)
            .map_err(|_| VerbsError::QueueFull)?;
        batch.commit();
        Ok(())
    }
}

impl<P: Platform, C: Send + 'static> DrainMarker for QpShared<P, C> {
    /// A marker's completion reached its CQ's handler stage.
    fn marker_completed(&self, queue: QueueKind, irql: &Dispatch<'_>) {
        let (done, destroy) = {
            let mut life = self.life.lock_at_dpc_level(irql);
            match queue {
                QueueKind::Send => life.sq_marker_done = true,
                QueueKind::Recv => life.rq_marker_done = true,
            }
            let done = life.sq_marker_done && life.rq_marker_done && life.phase == Phase::Flushing;
            let mut destroy = false;
            if done {
                life.phase = Phase::Flushed;
                if life.destroy_after_flush {
                    life.phase = Phase::Destroying;
                    destroy = true;
                }
            }
            (done, destroy)
        };
        if done {
            if let Some(_entered) = self.rundown.acquire() {
                self.handler.on_flushed(Ok(()), irql);
            }
        }
        if destroy {
            self.submit_internal(QpRequest::Destroy, irql);
        }
    }
}

impl<P: Platform, C: Send + 'static> QpShared<P, C> {
    fn flush_failed(&self, error: VerbsError, irql: &AnyIrql<'_, '_>) {
        let destroy = with_lock(&self.life, irql, |life| {
            if life.phase != Phase::Flushing {
                return false;
            }
            life.phase = Phase::Flushed;
            if life.destroy_after_flush {
                life.phase = Phase::Destroying;
                true
            } else {
                false
            }
        });
        match irql {
            AnyIrql::Dispatch(d) => self.report_flush_error(error, d),
            AnyIrql::Passive(p) => crate::sync::with_dispatch::<P, _, _>(*p, |d| {
                self.report_flush_error(error, d);
            }),
        }
        if destroy {
            match irql {
                AnyIrql::Dispatch(d) => self.submit_internal(QpRequest::Destroy, *d),
                AnyIrql::Passive(p) => self.submit_internal(QpRequest::Destroy, *p),
            }
        }
    }

    fn report_flush_error(&self, error: VerbsError, irql: &Dispatch<'_>) {
        if let Some(_entered) = self.rundown.acquire() {
            self.handler.on_flushed(Err(error), irql);
        }
    }

    /// The worker's half of destroy.
    fn destroy_now(&self, irql: &Passive<'_>) {
        let _ = self.device.hca.destroy_qp(self.qpn);
        self.device.unregister_target(TargetId::Qp(self.qpn), irql);
        let (sq_depth, rq_depth) = (self.depth(QueueKind::Send), self.depth(QueueKind::Recv));
        if Arc::ptr_eq(&self.send_cq.shared, &self.recv_cq.shared) {
            // Attached once with both depths.
            self.send_cq
                .detach(self, sq_depth.saturating_add(rq_depth), irql);
        } else {
            self.send_cq.detach(self, sq_depth, irql);
            self.recv_cq.detach(self, rq_depth, irql);
        }
    }

    fn destroyed(&self, irql: &AnyIrql<'_, '_>) {
        with_lock(&self.life, irql, |life| life.phase = Phase::Destroyed);
        if let Some(q) = &self.requests {
            match irql {
                AnyIrql::Dispatch(d) => q.shutdown(*d),
                AnyIrql::Passive(p) => q.shutdown(*p),
            }
        }
        // The destroy callback follows in a DPC once every callback in
        // flight (this request's included) has returned.
        let _ = self.rundown.destroy();
    }

    fn submit_internal(&self, request: QpRequest, irql: &impl LeDispatch) {
        if let Some(q) = &self.requests {
            // Two slots are kept for flush and destroy, and each runs once
            // per QP, so this cannot be refused for space; a closed queue
            // means the QP is already gone.
            let _ = q.submit(request, CompleteAt::Dispatch, irql);
        }
    }

    fn stop_posting(&self, irql: &impl LeDispatch) {
        self.sq.lock(irql).accepting = false;
        self.rq.lock(irql).accepting = false;
    }
}

fn with_lock<T, P: Platform, R>(
    lock: &SpinLock<T, P>,
    irql: &AnyIrql<'_, '_>,
    f: impl FnOnce(&mut T) -> R,
) -> R {
    match irql {
        AnyIrql::Passive(p) => f(&mut lock.lock(*p)),
        AnyIrql::Dispatch(d) => f(&mut lock.lock(*d)),
    }
}

impl<P: Platform, C: Send + 'static> AsyncTarget for QpShared<P, C> {
    fn async_event(&self, event: AsyncEvent, irql: &Dispatch<'_>) {
        if let Some(_entered) = self.rundown.acquire() {
            self.handler.on_async_event(event, irql);
        }
    }
}

/// A queue pair whose signalled work requests carry contexts of type `C`
/// (cheap to clone; clones share it).
pub struct Qp<P: Platform, C: Send + 'static> {
    shared: Arc<QpShared<P, C>>,
}

impl<P: Platform, C: Send + 'static> Clone for Qp<P, C> {
    fn clone(&self) -> Self {
        Qp {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<P: Platform, C: Send + 'static> fmt::Debug for Qp<P, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Qp")
            .field("qpn", &self.shared.qpn)
            .field("type", &self.shared.qp_type)
            .finish()
    }
}

impl<P: Platform, C: Send + 'static> Qp<P, C> {
    /// Creates a QP in the RESET state on `pd`, attached to its CQs.
    ///
    /// # Errors
    ///
    /// [`VerbsError::InvalidArgument`] (zero sizes, CQs of another device),
    /// [`VerbsError::CqTooSmall`], [`VerbsError::TableFull`],
    /// [`VerbsError::Hca`], [`VerbsError::Alloc`].
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL` only.
    pub fn create(
        pd: &Pd<P>,
        config: &QpConfig<P, C>,
        handler: Arc<dyn QpHandler>,
        irql: &Passive<'_>,
    ) -> Result<Self, VerbsError> {
        let dev = &pd.inner.device;
        if config.send_wqebbs == 0
            || config.max_recv_sge == 0
            || !Arc::ptr_eq(&config.send_cq.shared.device, dev)
            || !Arc::ptr_eq(&config.recv_cq.shared.device, dev)
        {
            return Err(VerbsError::InvalidArgument);
        }
        let init = QpInit {
            qp_type: config.qp_type,
            pd: pd.inner.pdn,
            send_cq: config.send_cq.cqn(),
            recv_cq: config.recv_cq.cqn(),
            sq_wqebbs: config.send_wqebbs.saturating_add(MARKER_RESERVE),
            rq_entries: config.recv_slots.saturating_add(MARKER_RESERVE),
            max_recv_sge: config.max_recv_sge,
            sq_sig_all: false,
            port: config.port,
        };
        let res = dev.hca.create_qp(&init)?;
        let qpn = res.qpn;
        let caps = res.caps;
        // The same rings and record, their words looked up once. The
        // device sized them already; a wrapper that fails the same checks
        // is a device that broke its own contract.
        let (sq_wqebbs, rq_entries, rq_stride) =
            (res.sq.wqebb_count(), res.rq.entries(), res.rq.stride());
        let sq = SendRing::new(PinnedWords::new(res.sq.into_mem()), sq_wqebbs);
        let rq = RecvRing::new(PinnedWords::new(res.rq.into_mem()), rq_entries, rq_stride);
        let dbr = QpDoorbellRecord::new(PinnedWords::new(res.doorbell_record.into_mem()));
        let (Ok(sq), Ok(rq), Ok(dbr)) = (sq, rq, dbr) else {
            let _ = dev.hca.destroy_qp(qpn);
            return Err(VerbsError::Hca(HcaError::InvalidSize));
        };
        let sq_doorbell = res.sq_doorbell;
        let rundown = {
            let handler = Arc::clone(&handler);
            match Rundown::new(
                &dev.platform,
                move |d: &Dispatch<'_>| handler.on_destroyed(d),
                irql,
            ) {
                Ok(r) => r,
                Err(e) => {
                    let _ = dev.hca.destroy_qp(qpn);
                    return Err(e.into());
                }
            }
        };
        let slots = dev.config.qp_request_slots;
        let shared = Arc::new_cyclic(|weak: &Weak<QpShared<P, C>>| {
            let requests = RequestQueue::new(
                &dev.worker,
                QpWorker { qp: weak.clone() },
                slots + 2,
                Arc::clone(&rundown),
                irql,
            )
            .ok();
            QpShared {
                qpn,
                qp_type: config.qp_type,
                caps,
                port: config.port,
                device: Arc::clone(dev),
                pd: pd.clone(),
                send_cq: config.send_cq.clone(),
                recv_cq: config.recv_cq.clone(),
                dbr,
                sq: SpinLock::new(SendQueue {
                    ring: sq,
                    doorbell: sq_doorbell,
                    pi: 0,
                    accepting: true,
                }),
                rq: SpinLock::new(RecvQueue {
                    ring: rq,
                    pi: 0,
                    accepting: true,
                }),
                sq_slots: SlotRing::new(caps.sq_wqebbs),
                rq_slots: SlotRing::new(caps.rq_entries),
                handler,
                rundown,
                requests,
                user_requests: AtomicU32::new(0),
                life: SpinLock::new(Life {
                    phase: Phase::Active,
                    sq_marker_done: false,
                    rq_marker_done: false,
                    destroy_after_flush: false,
                }),
                bogus: AtomicU64::new(0),
                lost: AtomicU64::new(0),
            }
        });
        let undo = |e: VerbsError| {
            let _ = dev.hca.destroy_qp(qpn);
            e
        };
        if shared.requests.is_none() {
            return Err(undo(VerbsError::Alloc));
        }
        let sq_depth = shared.depth(QueueKind::Send);
        let rq_depth = shared.depth(QueueKind::Recv);
        if Arc::ptr_eq(&config.send_cq.shared, &config.recv_cq.shared) {
            config
                .send_cq
                .attach(&shared, sq_depth + rq_depth, irql)
                .map_err(undo)?;
        } else {
            config
                .send_cq
                .attach(&shared, sq_depth, irql)
                .map_err(undo)?;
            if let Err(e) = config.recv_cq.attach(&shared, rq_depth, irql) {
                config.send_cq.detach(&shared, sq_depth, irql);
                return Err(undo(e));
            }
        }
        let target: Arc<dyn AsyncTarget> = shared.clone();
        if let Err(e) = dev.register_target(TargetId::Qp(qpn), Arc::downgrade(&target), irql) {
            shared.destroy_now(irql);
            return Err(e);
        }
        Ok(Qp { shared })
    }

    /// Prepares an asynchronous create (see [`crate::slowpath`]); submit it
    /// with [`crate::device::Device::submit`].
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL` (it allocates the job).
    pub fn prepare_create(
        pd: &Pd<P>,
        config: QpConfig<P, C>,
        handler: Arc<dyn QpHandler>,
        done: Callback<Result<Qp<P, C>, VerbsError>>,
        _irql: &Passive<'_>,
    ) -> Arc<CreateQpJob<P, C>> {
        Arc::new(CreateQpJob {
            pd: pd.clone(),
            config,
            handler,
            result: SpinLock::new(None),
            done,
        })
    }

    /// The QP number (1 for the GSI QP).
    pub fn qpn(&self) -> u32 {
        self.shared.qpn
    }

    /// The transport.
    pub fn qp_type(&self) -> QpType {
        self.shared.qp_type
    }

    /// The sizes the device created.
    pub fn caps(&self) -> QpCaps {
        self.shared.caps
    }

    /// The PD.
    pub fn pd(&self) -> &Pd<P> {
        &self.shared.pd
    }

    /// WQEBBs the consumer may have outstanding on the send queue (the
    /// marker's WQEBB excluded).
    pub fn send_capacity(&self) -> u32 {
        self.shared.sq_slots.capacity() - MARKER_RESERVE
    }

    /// Receive slots the consumer may have outstanding.
    pub fn recv_capacity(&self) -> u32 {
        self.shared.rq_slots.capacity() - MARKER_RESERVE
    }

    /// WQEBBs / slots the device holds now (a snapshot).
    pub fn outstanding(&self, queue: QueueKind) -> u32 {
        match queue {
            QueueKind::Send => self.shared.sq_slots.outstanding(),
            QueueKind::Recv => self.shared.rq_slots.outstanding(),
        }
    }

    /// Counters.
    pub fn stats(&self) -> QpStats {
        QpStats {
            bogus_completions: self.shared.bogus.load(Ordering::Relaxed),
            lost_contexts: self.shared.lost.load(Ordering::Relaxed),
        }
    }

    /// Starts a batch of send-queue work requests (see the
    /// [module docs](self)).
    ///
    /// # Errors
    ///
    /// [`PostErrorKind::Flushing`] once the QP is being flushed.
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`; the batch holds the send lock (at
    /// `DISPATCH_LEVEL`) until it is committed or dropped.
    pub fn begin_send<'q, I: LeDispatch>(
        &'q self,
        irql: &'q I,
    ) -> Result<SendBatch<'q, P, C>, PostErrorKind> {
        SendBatch::open(&self.shared, irql, true)
    }

    /// Starts a batch of receives.
    ///
    /// # Errors
    ///
    /// [`PostErrorKind::Flushing`] once the QP is being flushed.
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`; the batch holds the receive lock.
    pub fn begin_recv<'q, I: LeDispatch>(
        &'q self,
        irql: &'q I,
    ) -> Result<RecvBatch<'q, P, C>, PostErrorKind> {
        let batch = RecvBatch::open(&self.shared, irql)?;
        if !batch.guard.accepting {
            return Err(PostErrorKind::Flushing);
        }
        Ok(batch)
    }

    /// Modifies the QP (a firmware command). Moving to RESET is refused
    /// (outstanding work would vanish without completions); use
    /// [`Qp::disconnect_and_flush`] to stop a QP.
    ///
    /// # Errors
    ///
    /// [`VerbsError::Hca`] (`Modify` with the IBA rule broken, limits),
    /// [`VerbsError::InvalidArgument`], [`VerbsError::Closed`].
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL` only.
    pub fn modify(
        &self,
        attr: &QpAttr,
        mask: QpAttrMask,
        irql: &Passive<'_>,
    ) -> Result<(), VerbsError> {
        if self.shared.life.lock(irql).phase != Phase::Active {
            return Err(VerbsError::Closed);
        }
        self.shared.modify_now(attr, mask)
    }

    /// Requests a modify from any IRQL <= `DISPATCH_LEVEL`; `done` runs
    /// once with the result, at the level `at` asks for.
    ///
    /// # Errors
    ///
    /// [`VerbsError::QueueFull`] (the QP's request slots are in use) or
    /// [`VerbsError::Closed`]; `done` is not called then.
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    pub fn modify_async(
        &self,
        attr: QpAttr,
        mask: QpAttrMask,
        at: CompleteAt,
        done: &Callback<Result<(), VerbsError>>,
        irql: &impl LeDispatch,
    ) -> Result<(), VerbsError> {
        let s = &self.shared;
        if s.life.lock(irql).phase != Phase::Active {
            return Err(VerbsError::Closed);
        }
        let limit = u32::try_from(s.device.config.qp_request_slots).unwrap_or(u32::MAX);
        if s.user_requests.fetch_add(1, Ordering::AcqRel) >= limit {
            s.user_requests.fetch_sub(1, Ordering::AcqRel);
            return Err(VerbsError::QueueFull);
        }
        let request = QpRequest::Modify {
            attr,
            mask,
            done: Arc::clone(done),
        };
        let queue = s.requests.as_ref().ok_or(VerbsError::Closed)?;
        match queue.submit(request, at, irql) {
            Ok(()) => Ok(()),
            Err(Rejected { reason, .. }) => {
                s.user_requests.fetch_sub(1, Ordering::AcqRel);
                Err(reason.into())
            }
        }
    }

    /// Stops the QP and flushes it (see the [module docs](self)): new posts
    /// are refused at once; the QP goes to ERR on the worker; every
    /// outstanding request completes exactly once (flushed, unless it
    /// finished first); then [`QpHandler::on_flushed`] runs. Safe to call
    /// on a QP the device already put in error.
    ///
    /// # Errors
    ///
    /// [`VerbsError::Closed`] if a flush or destroy already started.
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    pub fn disconnect_and_flush(&self, irql: &impl LeDispatch) -> Result<(), VerbsError> {
        let s = &self.shared;
        {
            let mut life = s.life.lock(irql);
            if life.phase != Phase::Active {
                return Err(VerbsError::Closed);
            }
            life.phase = Phase::Flushing;
        }
        s.stop_posting(irql);
        s.submit_internal(QpRequest::Flush, irql);
        Ok(())
    }

    /// Destroys the QP after draining it: flushes first if that has not
    /// happened, then destroys it on the device and detaches it from its
    /// CQs; [`QpHandler::on_destroyed`] follows once every callback in
    /// flight has returned, and nothing of the QP is called after it.
    ///
    /// # Errors
    ///
    /// [`VerbsError::Closed`] if destroy already started.
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    pub fn destroy(&self, irql: &impl LeDispatch) -> Result<(), VerbsError> {
        let s = &self.shared;
        let (flush, destroy) = {
            let mut life = s.life.lock(irql);
            match life.phase {
                Phase::Active => {
                    life.phase = Phase::Flushing;
                    life.destroy_after_flush = true;
                    (true, false)
                }
                Phase::Flushing => {
                    if life.destroy_after_flush {
                        return Err(VerbsError::Closed);
                    }
                    life.destroy_after_flush = true;
                    (false, false)
                }
                Phase::Flushed => {
                    life.phase = Phase::Destroying;
                    (false, true)
                }
                Phase::Destroying | Phase::Destroyed => return Err(VerbsError::Closed),
            }
        };
        if flush {
            s.stop_posting(irql);
            s.submit_internal(QpRequest::Flush, irql);
        }
        if destroy {
            s.submit_internal(QpRequest::Destroy, irql);
        }
        Ok(())
    }
}

/// A prepared asynchronous QP create ([`Qp::prepare_create`]).
pub struct CreateQpJob<P: Platform, C: Send + 'static> {
    pd: Pd<P>,
    config: QpConfig<P, C>,
    handler: Arc<dyn QpHandler>,
    result: ResultSlot<Qp<P, C>, P>,
    done: Callback<Result<Qp<P, C>, VerbsError>>,
}

impl<P: Platform, C: Send + 'static> Job for CreateQpJob<P, C> {
    fn run(&self, irql: &Passive<'_>) {
        let r = Qp::create(&self.pd, &self.config, Arc::clone(&self.handler), irql);
        *self.result.lock(irql) = Some(r);
    }

    fn complete(&self, cancelled: bool, irql: AnyIrql<'_, '_>) {
        let r = take_result(&self.result, cancelled, &irql);
        (self.done)(r, irql);
    }
}

// ---------------------------------------------------------------------------
// Send batches
// ---------------------------------------------------------------------------

/// A batch of send-queue work requests (see the [module docs](self)).
/// Commit with [`SendBatch::commit`]; dropping it posts nothing.
pub struct SendBatch<'q, P: Platform, C: Send + 'static> {
    qp: &'q QpShared<P, C>,
    // Fields drop in declaration order: the claim on the slot ring must go
    // before the send lock, or a poster that takes the lock in between
    // finds the ring claimed and is told the QP is flushing.
    producer: Producer<'q, SendSlot<C>>,
    guard: SpinLockGuard<'q, SendQueue, P>,
    /// Next WQEBB counter.
    pi: u32,
    last_ctrl: u64,
    wqes: u32,
    marker: bool,
}

impl<'q, P: Platform, C: Send + 'static> SendBatch<'q, P, C> {
    /// Takes the send lock and the producer claim; with `only_accepting`,
    /// refuses a QP that stopped posting ([`PostErrorKind::Flushing`]).
    ///
    /// Every check comes before the batch is built, so the value is built
    /// once, in the caller's return slot (a check after building it made
    /// the compiler build it on the stack and copy it out).
    #[inline]
    fn open<I: LeDispatch>(
        qp: &'q QpShared<P, C>,
        irql: &'q I,
        only_accepting: bool,
    ) -> Result<Self, PostErrorKind> {
        let guard = qp.sq.lock(irql);
        if only_accepting && !guard.accepting {
            return Err(PostErrorKind::Flushing);
        }
        // The send lock serialises producers, so the claim always succeeds.
        let producer = qp.sq_slots.producer().ok_or(PostErrorKind::Flushing)?;
        let pi = guard.pi;
        Ok(SendBatch {
            qp,
            guard,
            producer,
            pi,
            last_ctrl: 0,
            wqes: 0,
            marker: false,
        })
    }

    /// Takes every context back out of the slots this batch wrote and did
    /// not publish (a batch dropped uncommitted). Out of line and cold:
    /// the committed drop stays a compare and the two releases.
    #[cold]
    #[inline(never)]
    fn discard_unpublished(&mut self) {
        let mut at = self.producer.published();
        while at != self.pi {
            let step = match self.producer.take_unpublished(at) {
                Ok(Some(slot)) => u32::from(slot.wqebbs.max(1)),
                _ => 1,
            };
            at = at.wrapping_add(step);
        }
    }

    /// Where the next work request of this batch goes in the send queue
    /// (the WQEBB counter, wrapping). Batches are serialised by the send
    /// lock, so a batch opened at an earlier position (in serial-number
    /// order) reaches the wire first: a consumer compares positions to
    /// tell whether one request was posted before another on this QP.
    pub fn position(&self) -> u32 {
        self.pi
    }

    /// WQEBBs still free for this batch (the marker's excluded).
    pub fn free_wqebbs(&self) -> u32 {
        let used = self.pi.wrapping_sub(self.producer.published());
        self.producer
            .free()
            .saturating_sub(used)
            .saturating_sub(if self.marker { 0 } else { MARKER_RESERVE })
    }

    /// Work requests pushed so far.
    pub fn len(&self) -> u32 {
        self.wqes
    }

    /// True if nothing was pushed.
    pub fn is_empty(&self) -> bool {
        self.wqes == 0
    }

    /// Builds one WQE in place at the producer counter, inside the free
    /// WQEBBs this batch owns (nothing is visible to the device before
    /// `commit`, so a refused WQE leaves only free space behind).
    fn push(
        &mut self,
        opcode: SendOpcode,
        flags: SendFlags,
        imm: u32,
        signal: Signal<C>,
        build: impl FnOnce(&mut SendWqeWriter<'_>) -> Result<(), PostErrorKind>,
    ) -> Result<(), PostError<C>> {
        // A drain marker carries no context but is always signalled.
        let signalled = self.marker || matches!(signal, Signal::Signalled(_));
        let mut ctrl = CtrlFlags::empty();
        if signalled {
            ctrl |= CtrlFlags::CQ_UPDATE;
        }
        if flags.fence {
            ctrl |= CtrlFlags::FENCE;
        }
        if flags.solicited {
            ctrl |= CtrlFlags::SOLICITED;
        }
        let header = WqeHeader {
            opcode,
            qpn: self.qp.qpn,
            flags: ctrl,
            imm,
        };
        let room = self.free_wqebbs();
        let mut w = self.guard.ring.wqe_writer(self.pi, room, header);
        if let Err(kind) = build(&mut w) {
            return Err(PostError::new(kind, signal.into_context()));
        }
        // The accounting check: a WQE that outgrew the free space was
        // measured, not stored, and is refused whole.
        if w.short_of_room() {
            return Err(PostError::new(
                PostErrorKind::QueueFull,
                signal.into_context(),
            ));
        }
        let wqebbs = w.wqebbs();
        let Ok(last_ctrl) = w.finish() else {
            return Err(PostError::new(PostErrorKind::Format, signal.into_context()));
        };
        let slot = SendSlot {
            context: signal.into_context(),
            wqebbs: wqebbs as u8,
            marker: self.marker,
        };
        match self.producer.put(self.pi, slot) {
            Ok(Some(old)) => {
                if old.context.is_some() {
                    self.qp.lost.fetch_add(1, Ordering::Relaxed);
                }
            }
            Ok(None) => {}
            Err((_, slot)) => {
                return Err(PostError::new(PostErrorKind::QueueFull, slot.context));
            }
        }
        self.last_ctrl = last_ctrl.doorbell_value();
        self.pi = self.pi.wrapping_add(wqebbs);
        self.wqes += 1;
        Ok(())
    }

    fn max_sge(&self) -> usize {
        self.qp.caps.max_send_sge as usize
    }

    /// An RC SEND (with immediate or with invalidate as `wr` says).
    ///
    /// # Errors
    ///
    /// The request handed back: [`PostErrorKind::WrongQpType`] on a UD
    /// QP (use [`SendBatch::send_ud`]), [`PostErrorKind::QueueFull`],
    /// [`PostErrorKind::TooManySge`], [`PostErrorKind::InlineTooLong`].
    ///
    /// # IRQL
    ///
    /// `DISPATCH_LEVEL` (the batch holds the send lock).
    pub fn send(&mut self, wr: &SendWr<'_>, signal: Signal<C>) -> Result<(), PostError<C>> {
        if self.qp.qp_type != QpType::Rc || (wr.imm.is_some() && wr.invalidate.is_some()) {
            return Err(PostError::new(
                PostErrorKind::WrongQpType,
                signal.into_context(),
            ));
        }
        let (opcode, imm) = match (wr.imm, wr.invalidate) {
            (Some(imm), _) => (SendOpcode::SendImm, imm),
            (None, Some(rkey)) => (SendOpcode::SendInval, rkey),
            (None, None) => (SendOpcode::Send, 0),
        };
        let payload = wr.payload;
        let max_sge = self.max_sge();
        let max_inline = self.qp.caps.max_inline_data as usize;
        self.push(opcode, wr.flags, imm, signal, |b| {
            emit_payload(b, &payload, max_sge, max_inline)
        })
    }

    /// A UD (or GSI) SEND to `dest`: the MAD path of the connection
    /// manager.
    ///
    /// # Errors
    ///
    /// As [`SendBatch::send`]; [`PostErrorKind::WrongQpType`] on an RC QP
    /// or with `invalidate` set.
    ///
    /// # IRQL
    ///
    /// `DISPATCH_LEVEL` (the batch holds the send lock).
    pub fn send_ud(
        &mut self,
        dest: &UdDest,
        wr: &SendWr<'_>,
        signal: Signal<C>,
    ) -> Result<(), PostError<C>> {
        if !self.qp.qp_type.is_datagram() || wr.invalidate.is_some() {
            return Err(PostError::new(
                PostErrorKind::WrongQpType,
                signal.into_context(),
            ));
        }
        let (opcode, imm) = match wr.imm {
            Some(imm) => (SendOpcode::SendImm, imm),
            None => (SendOpcode::Send, 0),
        };
        let av = DatagramSegRepr {
            qkey: if self.qp.qp_type == QpType::Gsi {
                GSI_QKEY
            } else {
                dest.qkey
            },
            dqpn: dest.qpn,
            sl: dest.sl,
            tclass: dest.traffic_class,
            hop_limit: dest.hop_limit,
            flow_label: dest.flow_label,
            rgid: dest.dgid.0,
            rmac: [0; 6],
        };
        let payload = wr.payload;
        let max_sge = self.max_sge();
        let max_inline = self.qp.caps.max_inline_data as usize;
        self.push(opcode, wr.flags, imm, signal, |b| {
            b.datagram(&av).map_err(|_| PostErrorKind::Format)?;
            emit_payload(b, &payload, max_sge, max_inline)
        })
    }

    /// An RDMA WRITE (with immediate as `wr` says).
    ///
    /// # Errors
    ///
    /// As [`SendBatch::send`].
    ///
    /// # IRQL
    ///
    /// `DISPATCH_LEVEL` (the batch holds the send lock).
    pub fn rdma_write(&mut self, wr: &WriteWr<'_>, signal: Signal<C>) -> Result<(), PostError<C>> {
        if self.qp.qp_type != QpType::Rc {
            return Err(PostError::new(
                PostErrorKind::WrongQpType,
                signal.into_context(),
            ));
        }
        let (opcode, imm) = match wr.imm {
            Some(imm) => (SendOpcode::RdmaWriteImm, imm),
            None => (SendOpcode::RdmaWrite, 0),
        };
        let (payload, raddr, rkey) = (wr.payload, wr.remote_addr, wr.rkey);
        let max_sge = self.max_sge();
        let max_inline = self.qp.caps.max_inline_data as usize;
        self.push(opcode, wr.flags, imm, signal, |b| {
            b.raddr(raddr, rkey).map_err(|_| PostErrorKind::Format)?;
            emit_payload(b, &payload, max_sge, max_inline)
        })
    }

    /// An RDMA READ.
    ///
    /// # Errors
    ///
    /// As [`SendBatch::send`].
    ///
    /// # IRQL
    ///
    /// `DISPATCH_LEVEL` (the batch holds the send lock).
    pub fn rdma_read(&mut self, wr: &ReadWr<'_>, signal: Signal<C>) -> Result<(), PostError<C>> {
        if self.qp.qp_type != QpType::Rc {
            return Err(PostError::new(
                PostErrorKind::WrongQpType,
                signal.into_context(),
            ));
        }
        let (local, raddr, rkey) = (wr.local, wr.remote_addr, wr.rkey);
        let max_sge = self.max_sge();
        self.push(SendOpcode::RdmaRead, wr.flags, 0, signal, |b| {
            b.raddr(raddr, rkey).map_err(|_| PostErrorKind::Format)?;
            emit_payload(b, &Payload::Sges(local), max_sge, 0)
        })
    }

    /// A NOP (completes like any request; useful as a fence point).
    ///
    /// # Errors
    ///
    /// [`PostErrorKind::QueueFull`].
    ///
    /// # IRQL
    ///
    /// `DISPATCH_LEVEL` (the batch holds the send lock).
    pub fn nop(&mut self, flags: SendFlags, signal: Signal<C>) -> Result<(), PostError<C>> {
        self.push(SendOpcode::Nop, flags, 0, signal, |_| Ok(()))
    }

    /// Fast-registers `mr` (REG_MR by work request) with a **new key byte**
    /// and exactly `reg.access`; returns the new key. If `mr` is still
    /// registered, a LOCAL_INV of its old key is chained in front (same
    /// batch, unsignalled). Long page lists are written to the MR's
    /// preallocated page-list buffer, short ones go inline.
    ///
    /// # Errors
    ///
    /// [`PostErrorKind::BadRegistration`] (malformed request, MR of another
    /// PD), [`PostErrorKind::WrongQpType`] (UD), [`PostErrorKind::QueueFull`]
    /// — the MR is left as it was.
    ///
    /// # IRQL
    ///
    /// `DISPATCH_LEVEL` (the batch holds the send lock).
    pub fn reg_mr(
        &mut self,
        mr: &mut FrMr<P>,
        reg: &FastReg<'_>,
        signal: Signal<C>,
    ) -> Result<u32, PostError<C>> {
        let bad = |signal: Signal<C>| {
            Err(PostError::new(
                PostErrorKind::BadRegistration,
                signal.into_context(),
            ))
        };
        if self.qp.qp_type != QpType::Rc {
            return Err(PostError::new(
                PostErrorKind::WrongQpType,
                signal.into_context(),
            ));
        }
        let npages = reg.pages.len();
        if !mr.pool_pd_is(&self.qp.pd)
            || npages == 0
            || npages > mr.max_pages() as usize
            || !(MIN_PAGE_SHIFT..=MAX_PAGE_SHIFT).contains(&reg.page_shift)
            || !reg.access.is_valid_for_mr()
        {
            return bad(signal);
        }
        let mask = (1u64 << reg.page_shift) - 1;
        let span = (npages as u64) << reg.page_shift;
        if (reg.iova & mask)
            .checked_add(reg.length)
            .is_none_or(|end| end > span)
            || reg.pages.iter().any(|p| p.get() & mask != 0)
        {
            return bad(signal);
        }
        let needs_inval = !matches!(mr.state, FrState::Free);
        // Both WQEs must fit, or neither is written.
        let inval_bbs = u32::from(needs_inval);
        let reg_bbs: u32 = if npages <= INLINE_PAGES {
            ((16 + 32 + (npages * 8).div_ceil(16) * 16) as u32).div_ceil(64)
        } else {
            1
        };
        if inval_bbs + reg_bbs > self.free_wqebbs() {
            return Err(PostError::new(
                PostErrorKind::QueueFull,
                signal.into_context(),
            ));
        }
        if needs_inval {
            let old = mr.key();
            if let Err(e) = self.push(
                SendOpcode::LocalInval,
                SendFlags::default(),
                old,
                Signal::Unsignalled,
                |_| Ok(()),
            ) {
                return Err(PostError::new(e.kind, signal.into_context()));
            }
            mr.state = FrState::Free;
        }
        let key = mr.rotate_key();
        let seg = RegMrSegRepr {
            mkey: key,
            access: reg.access,
            page_shift: reg.page_shift,
            inline_list: npages <= INLINE_PAGES,
            iova: reg.iova,
            length: reg.length,
            npages: npages as u32,
        };
        let list = if npages > INLINE_PAGES {
            let Some(buf) = mr.page_list() else {
                return bad(signal);
            };
            for (i, page) in reg.pages.iter().enumerate() {
                let word = u64::from_ne_bytes(page.get().to_be_bytes());
                if buf.store_u64(i * 8, word, Ordering::Relaxed).is_err() {
                    return bad(signal);
                }
            }
            Some(DataSegRepr {
                byte_count: (npages * 8) as u32,
                lkey: self.qp.device.attr.reserved_lkey,
                addr: buf.phys_addr().get(),
            })
        } else {
            None
        };
        let pages = reg.pages;
        self.push(SendOpcode::RegMr, SendFlags::default(), 0, signal, |b| {
            match list {
                None => b.reg_mr_inline(&seg, pages).map(|_| ()),
                Some(d) => b.reg_mr_indirect(&seg, d).map(|_| ()),
            }
            .map_err(|_| PostErrorKind::BadRegistration)
        })?;
        mr.state = FrState::Registered {
            rkey: key,
            iova: reg.iova,
            length: reg.length,
            access: reg.access,
        };
        Ok(key)
    }

    /// Invalidates `mr` (LOCAL_INV of its current key).
    ///
    /// # Errors
    ///
    /// [`PostErrorKind::NotRegistered`] if it is not registered,
    /// [`PostErrorKind::BadRegistration`] for an MR of another PD,
    /// [`PostErrorKind::QueueFull`].
    ///
    /// # IRQL
    ///
    /// `DISPATCH_LEVEL` (the batch holds the send lock).
    pub fn local_inv(&mut self, mr: &mut FrMr<P>, signal: Signal<C>) -> Result<(), PostError<C>> {
        if !mr.pool_pd_is(&self.qp.pd) {
            return Err(PostError::new(
                PostErrorKind::BadRegistration,
                signal.into_context(),
            ));
        }
        if matches!(mr.state, FrState::Free) {
            return Err(PostError::new(
                PostErrorKind::NotRegistered,
                signal.into_context(),
            ));
        }
        let key = mr.key();
        self.push(
            SendOpcode::LocalInval,
            SendFlags::default(),
            key,
            signal,
            |_| Ok(()),
        )?;
        mr.state = FrState::Free;
        Ok(())
    }

    /// Posts the batch: one doorbell record update and one doorbell for
    /// all of it, in the order of [`hca_lowlevel::barrier`]. Returns the
    /// number of work requests posted.
    ///
    /// # IRQL
    ///
    /// `DISPATCH_LEVEL` (the batch holds the send lock; it is released on
    /// return).
    pub fn commit(mut self) -> u32 {
        if self.wqes == 0 {
            return 0;
        }
        barrier::to_device();
        // Publish before the doorbell: a completion may arrive inside the
        // doorbell write and must find its slot published.
        if self.producer.publish(self.pi).is_err() {
            // Unreachable: every push checked the window.
            return 0;
        }
        self.qp.dbr.set_sq_head(self.pi as u16);
        barrier::mmio_wc_start();
        P::write_doorbell(&*self.guard.doorbell, self.last_ctrl);
        barrier::mmio_flush_writes();
        self.guard.pi = self.pi;
        // `published == pi` now: the drop finds nothing to take back.
        self.wqes
    }
}

fn emit_payload(
    b: &mut SendWqeWriter<'_>,
    payload: &Payload<'_>,
    max_sge: usize,
    max_inline: usize,
) -> Result<(), PostErrorKind> {
    match payload {
        Payload::Sges(sges) => {
            if sges.len() > max_sge {
                return Err(PostErrorKind::TooManySge);
            }
            for s in sges.iter() {
                b.data(s.seg()).map_err(|_| PostErrorKind::TooManySge)?;
            }
            Ok(())
        }
        Payload::Inline(data) => {
            if data.len() > max_inline {
                return Err(PostErrorKind::InlineTooLong);
            }
            b.inline(data).map_err(|_| PostErrorKind::InlineTooLong)?;
            Ok(())
        }
    }
}

impl<P: Platform, C: Send + 'static> Drop for SendBatch<'_, P, C> {
    /// An uncommitted batch wrote slots below `pi` it never published
    /// (commit publishes up to `pi`, an empty batch never moved it); their
    /// contexts are taken back. The claim and the lock go after, in field
    /// order.
    #[inline]
    fn drop(&mut self) {
        if self.producer.published() != self.pi {
            self.discard_unpublished();
        }
    }
}

// ---------------------------------------------------------------------------
// Receive batches
// ---------------------------------------------------------------------------

/// A batch of receives. Commit with [`RecvBatch::commit`]; dropping it
/// posts nothing.
pub struct RecvBatch<'q, P: Platform, C: Send + 'static> {
    qp: &'q QpShared<P, C>,
    // Dropped before the lock (see `SendBatch`).
    producer: Producer<'q, RecvSlot<P, C>>,
    guard: SpinLockGuard<'q, RecvQueue, P>,
    pi: u32,
    marker: bool,
    committed: bool,
}

impl<'q, P: Platform, C: Send + 'static> RecvBatch<'q, P, C> {
    fn open<I: LeDispatch>(qp: &'q QpShared<P, C>, irql: &'q I) -> Result<Self, PostErrorKind> {
        let guard = qp.rq.lock(irql);
        let producer = qp.rq_slots.producer().ok_or(PostErrorKind::Flushing)?;
        let pi = guard.pi;
        Ok(RecvBatch {
            qp,
            guard,
            producer,
            pi,
            marker: false,
            committed: false,
        })
    }

    /// Receive slots still free for this batch.
    pub fn free_slots(&self) -> u32 {
        let used = self.pi.wrapping_sub(self.producer.published());
        self.producer
            .free()
            .saturating_sub(used)
            .saturating_sub(if self.marker { 0 } else { MARKER_RESERVE })
    }

    fn push(
        &mut self,
        sges: &[Sge],
        context: Option<C>,
        grh_at: Option<(Mr<P>, u64)>,
    ) -> Result<(), PostError<C>> {
        if self.free_slots() == 0 {
            return Err(PostError::new(PostErrorKind::QueueFull, context));
        }
        let max = self.guard.ring.max_sge();
        if sges.len() > max {
            return Err(PostError::new(PostErrorKind::TooManySge, context));
        }
        // The usual receive (one buffer) goes straight to the ring; longer
        // lists are gathered first (the ring takes decoded segments).
        let written = if let [one] = sges {
            self.guard.ring.write_wqe(self.pi, &[one.seg()])
        } else {
            let mut segs: heapless::Vec<DataSegRepr, { hca_lowlevel::recv::MAX_RECV_SGE }> =
                heapless::Vec::new();
            for s in sges {
                if segs.push(s.seg()).is_err() {
                    return Err(PostError::new(PostErrorKind::TooManySge, context));
                }
            }
            self.guard.ring.write_wqe(self.pi, &segs)
        };
        if written.is_err() {
            return Err(PostError::new(PostErrorKind::TooManySge, context));
        }
        let slot = RecvSlot {
            context,
            grh_at,
            marker: self.marker,
        };
        match self.producer.put(self.pi, slot) {
            Ok(Some(old)) => {
                if old.context.is_some() {
                    self.qp.lost.fetch_add(1, Ordering::Relaxed);
                }
            }
            Ok(None) => {}
            Err((_, slot)) => return Err(PostError::new(PostErrorKind::QueueFull, slot.context)),
        }
        self.pi = self.pi.wrapping_add(1);
        Ok(())
    }

    /// A receive into `sges`; its completion carries `context`.
    ///
    /// # Errors
    ///
    /// [`PostErrorKind::QueueFull`], [`PostErrorKind::TooManySge`], the
    /// context handed back.
    ///
    /// # IRQL
    ///
    /// `DISPATCH_LEVEL` (the batch holds the receive lock).
    pub fn recv(&mut self, sges: &[Sge], context: C) -> Result<(), PostError<C>> {
        self.push(sges, Some(context), None)
    }

    /// A UD receive into `len` bytes at `offset` of `mr`: the first 40
    /// bytes receive the GRH, which kverbs decodes into the completion's
    /// [`UdSource::grh`] (the MAD receive path).
    ///
    /// # Errors
    ///
    /// [`PostErrorKind::WrongQpType`] on an RC QP,
    /// [`PostErrorKind::TooManySge`] if the range leaves `mr` or is shorter
    /// than the GRH, [`PostErrorKind::QueueFull`].
    ///
    /// # IRQL
    ///
    /// `DISPATCH_LEVEL` (the batch holds the receive lock).
    pub fn recv_ud(
        &mut self,
        mr: &Mr<P>,
        offset: u64,
        len: u32,
        context: C,
    ) -> Result<(), PostError<C>> {
        if !self.qp.qp_type.is_datagram() {
            return Err(PostError::new(PostErrorKind::WrongQpType, Some(context)));
        }
        let Some(sge) = mr.sge(offset, len).filter(|_| len as usize >= GRH_LEN) else {
            return Err(PostError::new(PostErrorKind::TooManySge, Some(context)));
        };
        self.push(&[sge], Some(context), Some((mr.clone(), offset)))
    }

    /// Posts the batch: [`barrier::to_device`], publish, then the doorbell
    /// record (receives need no doorbell register). Returns the number of
    /// receives posted.
    ///
    /// # IRQL
    ///
    /// `DISPATCH_LEVEL` (the batch holds the receive lock).
    pub fn commit(mut self) -> u32 {
        let n = self.pi.wrapping_sub(self.producer.published());
        if n == 0 {
            return 0;
        }
        barrier::to_device();
        if self.producer.publish(self.pi).is_err() {
            return 0;
        }
        self.qp.dbr.set_rq_head(self.pi as u16);
        self.guard.pi = self.pi;
        self.committed = true;
        n
    }
}

impl<P: Platform, C: Send + 'static> Drop for RecvBatch<'_, P, C> {
    fn drop(&mut self) {
        if self.committed {
            return;
        }
        let mut at = self.producer.published();
        while at != self.pi {
            let _ = self.producer.take_unpublished(at);
            at = at.wrapping_add(1);
        }
    }
}
