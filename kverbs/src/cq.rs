//! Completion queues: polling the CQ ring, arming with "report missed
//! events" semantics, and delivering `(context, completion)` to the
//! consumer through one drain loop per CQ.
//!
//! # Delivery
//!
//! The HCA's completion event (its interrupt) only notifies the CQ's
//! [`DpcDrainer`]; the CQ's DPC drains under the device's budget
//! ([`crate::device::DeviceConfig::cq_budget`]) and requeues itself when
//! the budget runs out. A consumer may also drain on its own stack
//! ([`Cq::drain_inline`], the `IB_POLL_DIRECT` style). Either way one drain
//! loop runs per CQ, so a handler that posts work which completes at once
//! — even inline, inside the doorbell write — never nests a second
//! delivery: the stack depth is one loop iteration whatever the chain.
//!
//! # Polling and arming (the CQ doorbell record)
//!
//! A poll reads CQEs at the consumer counter by owner-bit parity
//! ([`hca_lowlevel::ring::CqRing::poll`]: ownership, then
//! [`hca_lowlevel::barrier::from_device`], then the contents), resolves
//! each to its work request in O(1) through the QP's slot table (the CQE's
//! WQE counter is the slot index), and writes the consumer counter to the
//! doorbell record once per batch. Arming writes `sn<<28 | ci` to the
//! record, then (after [`hca_lowlevel::barrier::mmio_wc_start`]) the arm
//! doorbell; the device fires at once if CQEs already lie beyond `ci`.
//! kverbs then looks at the CQE at `ci` itself and answers
//! [`ArmOutcome::MissedEvents`] if one is there, so the drain loop polls
//! again instead of waiting for an event that was already spent. The arm
//! sequence number is the count of events received, as the device expects
//! (an arm with the sequence number of an event already delivered is
//! stale and ignored).
//!
//! # Lifetime
//!
//! A CQ outlives every QP attached to it (QPs hold it). Destroy refuses
//! while QPs are attached; after [`CqHandler::on_destroyed`] no callback of
//! the CQ runs again (run-down).

mod attached;
mod shared_dyn;

use alloc::sync::{Arc, Weak};
use core::fmt;

use hca_lowlevel::barrier;
use hca_lowlevel::cqe::{CqeOpcode, CqeRepr};
use hca_lowlevel::device::{AsyncEvent, CqEventHandler, HcaError};
use hca_lowlevel::doorbell::{CqArm, CqDoorbellRecord, DoorbellRegister};
use hca_lowlevel::ring::CqRing;

use crate::device::{AsyncTarget, Device, DeviceInner, TargetId};
use crate::drain::DrainOutcome;
use crate::drain::{
    ArmOutcome, Budget, CompletionHandler, CompletionSource, DpcDrainer, PollBatch, Polled,
};
use crate::error::VerbsError;
use crate::irql::{AnyIrql, Dispatch, LeDispatch, Passive};
use crate::platform::{DpcTarget, Platform};
use crate::qp::{QpShared, QueueKind};
use crate::rundown::Rundown;
use crate::slowpath::{Callback, Job, ResultSlot, take_result};
use crate::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use crate::sync::{SetOnce, SpinLock};
use crate::words::PinnedWords;
use crate::wr::Completion;
use attached::{AttachedTable, ReadClaim};
use shared_dyn::SharedDyn;

/// Most QPs that may complete on one CQ (the lookup from a CQE's QP number
/// to its QP scans this many entries at most; channels usually attach one
/// or two).
pub const MAX_QPS_PER_CQ: usize = 16;

/// Receives a CQ's completions and events.
pub trait CqHandler<C>: Send + Sync {
    /// One completion with the context its work request carried.
    ///
    /// # IRQL
    ///
    /// `DISPATCH_LEVEL` (the CQ's DPC, or an inline drain raised to it).
    fn on_completion(&self, completion: Completion<C>, irql: &Dispatch<'_>);

    /// The completions of one poll of the CQ, in poll order: a handler
    /// with per-batch work (finding its consumer, taking a lock) overrides
    /// this to do that work once per batch. The default hands each to
    /// [`Self::on_completion`]; whatever an override leaves unread is then
    /// delivered one by one the same way, so none is lost.
    ///
    /// `completions` is a concrete iterator, not a `dyn` one: its `next`
    /// inlines into the override, so taking a completion is no dynamic
    /// call and the end of the batch is one compare.
    ///
    /// # IRQL
    ///
    /// `DISPATCH_LEVEL` (the CQ's DPC, or an inline drain raised to it).
    fn on_completions(&self, completions: &mut WorkCompletions<'_, C>, irql: &Dispatch<'_>) {
        for completion in completions {
            self.on_completion(completion, irql);
        }
    }

    /// An asynchronous event for this CQ ([`AsyncEvent::CqError`]: the CQ
    /// overran and it and its QPs are unusable).
    ///
    /// # IRQL
    ///
    /// `DISPATCH_LEVEL`.
    fn on_async_event(&self, event: AsyncEvent, irql: &Dispatch<'_>) {
        let _ = (event, irql);
    }

    /// The CQ is destroyed; no callback of it runs after this one.
    ///
    /// # IRQL
    ///
    /// `DISPATCH_LEVEL`.
    fn on_destroyed(&self, irql: &Dispatch<'_>) {
        let _ = irql;
    }
}

/// How to create a CQ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CqConfig {
    /// CQEs (rounded up to a power of two by the device). Must cover the
    /// send and receive queues of every QP attached.
    pub entries: u32,
    /// The processor of the CQ's DPC.
    pub dpc_target: DpcTarget,
    /// The drain budget per DPC (`None`: the device's default).
    pub budget: Option<Budget>,
}

impl CqConfig {
    /// `entries` CQEs, DPC on the current processor, default budget.
    pub fn new(entries: u32) -> Self {
        CqConfig {
            entries,
            dpc_target: DpcTarget::Current,
            budget: None,
        }
    }
}

/// What one CQE turns into.
pub(crate) enum CqItem<C> {
    /// A completion for the consumer.
    Wc(Completion<C>),
    /// A QP's drain marker: every completion of that queue before it has
    /// been delivered.
    Marker(Arc<dyn DrainMarker>, QueueKind),
}

/// A QP whose drain marker a poll found: behind a `dyn` so that a polled
/// batch — and the consumer's [`WorkCompletions`] over it — does not
/// depend on the platform type (markers are rare: one per queue when a
/// QP is flushed).
pub(crate) trait DrainMarker: Send + Sync {
    /// The marker of `queue` reached the handler stage.
    ///
    /// # IRQL
    ///
    /// `DISPATCH_LEVEL`.
    fn marker_completed(&self, queue: QueueKind, irql: &Dispatch<'_>);
}

/// The attached QPs, read by every poll without a lock.
type QpTable<P, C> = AttachedTable<QpShared<P, C>, MAX_QPS_PER_CQ>;

/// Counters of things that should not happen.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CqStats {
    /// CQEs polled.
    pub polled: u64,
    /// Completion events received.
    pub events: u64,
    /// CQEs naming a QP not attached to this CQ, or a counter outside the
    /// QP's outstanding window (a faulty device): dropped.
    pub stray_cqes: u64,
    /// CQEs that could not be decoded: dropped.
    pub malformed_cqes: u64,
}

/// The ring side: the drain loop's [`CompletionSource`].
pub(crate) struct CqCore<P: Platform, C: Send + 'static> {
    cqn: u32,
    /// The ring and the doorbell record, their words looked up once (each
    /// is read or written in every poll and every arm).
    ring: CqRing<PinnedWords>,
    dbr: CqDoorbellRecord<PinnedWords>,
    /// The arm doorbell, its object's address worked out once (it is
    /// rung every round; see `SharedDyn`).
    arm_doorbell: SharedDyn<dyn DoorbellRegister>,
    /// CQEs consumed since the CQ was created; written only by a poll,
    /// which holds the claim on `qps` and runs in the drain loop (see
    /// [`CqCore::arm`]). Its low 32 bits are the consumer counter
    /// ([`consumer_counter`]), and the count itself is
    /// [`CqStats::polled`], so a poll updates one counter, not two.
    consumed: AtomicU64,
    /// Completion events received: the next arm's sequence number.
    events: AtomicU32,
    /// The arm word last written to the doorbell record; written only by
    /// an arm, which the drain loop never runs beside a poll, so a poll can
    /// rewrite the whole record with it.
    arm_word: AtomicU32,
    /// The attached QPs; a poll reads them under its read claim.
    qps: QpTable<P, C>,
    /// CQEs the attached queues can have outstanding; held across an
    /// attach's check and insert, so attaches never overcommit the ring.
    attached_depth: SpinLock<u32, P>,
    stray: AtomicU64,
    malformed: AtomicU64,
}

impl<P: Platform, C: Send + 'static> CqCore<P, C> {
    /// Claims the poll side: what lets a poll read the attached QPs without
    /// a lock (and makes polls exclusive even if a caller misuses the
    /// API; the drain loop serialises them already).
    fn claim(&self) -> Option<ReadClaim<'_, QpShared<P, C>, MAX_QPS_PER_CQ>> {
        self.qps.claim()
    }

    fn resolve(
        &self,
        cqe: &CqeRepr,
        qps: &ReadClaim<'_, QpShared<P, C>, MAX_QPS_PER_CQ>,
    ) -> Option<CqItem<C>> {
        let qp = qps.find(|q| q.qpn == cqe.qpn)?;
        let send = matches!(cqe.opcode, CqeOpcode::Req | CqeOpcode::ReqErr);
        if send {
            qp.complete_send(cqe)
        } else {
            qp.complete_recv(cqe)
        }
    }
}

impl<P: Platform, C: Send + 'static> CompletionSource for CqCore<P, C> {
    type Completion = CqItem<C>;

    // Inline: into the drain loop (the CQ's DPC routine), whose frame
    // already holds every register; a call of its own costs each poll a
    // prologue and an epilogue — a per-round cost a QD 1 I/O pays twice.
    // `always`: see `DrainLoop::run`.
    #[inline(always)]
    fn poll(&self, out: &mut PollBatch<CqItem<C>>, _irql: &Dispatch<'_>) {
        let Some(claim) = self.claim() else { return };
        let consumed = self.consumed.load(Ordering::Relaxed);
        let start = consumer_counter(consumed);
        // The ring's words looked up once for the whole batch. No separate
        // "is anything there" look first: the loop's first owner-bit check
        // is that look, and a poll almost always finds a CQE (the drain
        // loop polls again only when notified or told of missed events).
        let ring = self.ring.view();
        let mut ci = start;
        // The batch's room read once and counted down per completion
        // pushed: one compare per CQE instead of `is_full`'s two.
        let mut room = out.room();
        {
            while room != 0 {
                let Some(raw) = ring.poll(ci) else { break };
                ci = ci.wrapping_add(1);
                let cqe = match CqeRepr::parse(&raw) {
                    Ok(c) => c,
                    Err(_) => {
                        self.malformed.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                };
                if cqe.opcode == CqeOpcode::ResizeCq {
                    continue;
                }
                match self.resolve(&cqe, &claim) {
                    Some(item) => {
                        room -= 1;
                        if let Err(item) = out.push(item) {
                            // Unreachable: `room` counts the free slots.
                            drop(item);
                        }
                    }
                    None => {
                        self.stray.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
        if ci != start {
            self.consumed.store(
                consumed.wrapping_add(u64::from(ci.wrapping_sub(start))),
                Ordering::Relaxed,
            );
            // One consumer-index update per batch: the CQEs are free again.
            // The whole record in one store (the arm half unchanged).
            let arm = CqArm::from_word(self.arm_word.load(Ordering::Relaxed));
            self.dbr.set_ci_and_arm(ci, arm);
        }
    }

    // Inline (`always`: see `DrainLoop::run`): the drain loop arms once per
    // round (twice per QD 1 I/O); out of line, the call and the registers
    // saved around the doorbell write cost more than the write itself.
    //
    // No claim: an arm reads no attached QP, and the drain loop — the only
    // caller of `poll` and `arm` (`CqCore` is reachable only through its
    // drainer) — runs them one at a time, one runner at a time, its
    // state's acquire/release ordering one runner's poll before the next
    // runner's arm. The claim's swap and release were a per-round cost.
    #[inline(always)]
    fn arm(&self, _irql: &Dispatch<'_>) -> ArmOutcome {
        let ci = consumer_counter(self.consumed.load(Ordering::Relaxed));
        let arm = CqArm {
            sn: (self.events.load(Ordering::Acquire) & 3) as u8,
            solicited_only: false,
            ci,
        };
        self.arm_word.store(arm.word(), Ordering::Relaxed);
        // The whole record in one store (the counter half unchanged).
        self.dbr.set_ci_and_arm(ci, arm);
        barrier::mmio_wc_start();
        P::write_doorbell(&*self.arm_doorbell, arm.doorbell_value(self.cqn));
        barrier::mmio_flush_writes();
        // Report missed events: a CQE already waiting at `ci` may have been
        // written before the arm took effect.
        if self.ring.is_ready(ci) {
            ArmOutcome::MissedEvents
        } else {
            ArmOutcome::Armed
        }
    }

    /// The arm looks at the CQE at `ci` after the arm doorbell: a CQE
    /// written before the arm took effect is reported, one written after
    /// raises an event, so the drain loop needs no poll after arming.
    fn arm_reports_missed_events(&self) -> bool {
        true
    }
}

/// The consumer counter of a CQ that has consumed `consumed` CQEs: their
/// count modulo 2^32 (the ring and the doorbell record count in 32 bits
/// and wrap).
#[inline]
fn consumer_counter(consumed: u64) -> u32 {
    // The low half: the truncation is the wrap.
    u32::try_from(consumed & u64::from(u32::MAX)).unwrap_or(0)
}

/// The delivery side: the drain loop's [`CompletionHandler`].
pub(crate) struct CqDeliver<P: Platform, C: Send + 'static> {
    /// The consumer, its object's address worked out once (it is called
    /// every round; see `SharedDyn`).
    handler: SharedDyn<dyn CqHandler<C>>,
    rundown: Arc<Rundown<P>>,
}

impl<P: Platform, C: Send + 'static> CompletionHandler<CqItem<C>> for CqDeliver<P, C> {
    fn on_completion(&self, item: CqItem<C>, irql: &Dispatch<'_>) {
        match item {
            CqItem::Wc(wc) => {
                if let Some(_entered) = self.rundown.acquire() {
                    self.handler.on_completion(wc, irql);
                }
            }
            CqItem::Marker(qp, queue) => qp.marker_completed(queue, irql),
        }
    }

    /// One run-down reference for the whole batch; the consumer sees the
    /// work completions as one iterator (drain markers are handled in
    /// their place in the order as the iterator passes them).
    ///
    /// Inline into the drain loop, as [`CqCore::poll`] is: it runs once per
    /// polled batch (`always`: see [`DrainLoop::run`](crate::drain::DrainLoop::run)).
    #[inline(always)]
    fn on_batch(&self, batch: &mut Polled<'_, CqItem<C>>, irql: &Dispatch<'_>) {
        let Some(_entered) = self.rundown.acquire() else {
            // Destroying: no completion reaches the consumer; markers still
            // complete their QPs' drains.
            for item in batch {
                if let CqItem::Marker(qp, queue) = item {
                    qp.marker_completed(queue, irql);
                }
            }
            return;
        };
        let mut completions = WorkCompletions {
            batch: batch.batch_mut(),
            irql,
        };
        self.handler.on_completions(&mut completions, irql);
    }
}

/// The work completions of one poll of a CQ, in poll order (see
/// [`CqHandler::on_completions`]). A QP's drain marker among them is
/// completed in its place as the iterator passes it.
pub struct WorkCompletions<'a, C> {
    batch: &'a mut PollBatch<CqItem<C>>,
    irql: &'a Dispatch<'a>,
}

impl<C> Iterator for WorkCompletions<'_, C> {
    type Item = Completion<C>;

    #[inline]
    fn next(&mut self) -> Option<Completion<C>> {
        loop {
            match self.batch.take()? {
                CqItem::Wc(wc) => return Some(wc),
                CqItem::Marker(qp, queue) => qp.marker_completed(queue, self.irql),
            }
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (0, Some(self.batch.len()))
    }
}

impl<C> fmt::Debug for WorkCompletions<'_, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkCompletions")
            .field("left", &self.batch.len())
            .finish()
    }
}

type Drainer<P, C> = DpcDrainer<P, CqCore<P, C>, CqDeliver<P, C>>;

/// The completion-event hook given to the HCA (interrupt context).
struct CqEventHook<P: Platform, C: Send + 'static> {
    /// Set once, right after the drainer is built (an event before that
    /// finds nothing to notify, as the ring is still empty), never
    /// cleared: read with one acquire load on every event, with no raise
    /// and no lock (every event is a per-round cost at QD 1).
    drainer: SetOnce<Weak<Drainer<P, C>>>,
}

impl<P: Platform, C: Send + 'static> CqEventHandler for CqEventHook<P, C> {
    fn completion_event(&self, _cqn: u32) {
        // Counting the event and queueing the DPC are both callable at any
        // IRQL, so nothing here needs `DISPATCH_LEVEL`.
        if let Some(drainer) = self.drainer.get().and_then(Weak::upgrade) {
            drainer.source().events.fetch_add(1, Ordering::AcqRel);
            drainer.notify();
        }
    }
}

pub(crate) struct CqShared<P: Platform, C: Send + 'static> {
    pub(crate) cqn: u32,
    pub(crate) entries: u32,
    drainer: Arc<Drainer<P, C>>,
    pub(crate) device: Arc<DeviceInner<P>>,
    destroyed: AtomicBool,
}

impl<P: Platform, C: Send + 'static> AsyncTarget for CqShared<P, C> {
    fn async_event(&self, event: AsyncEvent, irql: &Dispatch<'_>) {
        let deliver = self.drainer.handler();
        if let Some(_entered) = deliver.rundown.acquire() {
            deliver.handler.on_async_event(event, irql);
        }
    }
}

/// A completion queue whose completions carry contexts of type `C`
/// (cheap to clone; clones share it).
pub struct Cq<P: Platform, C: Send + 'static> {
    pub(crate) shared: Arc<CqShared<P, C>>,
}

impl<P: Platform, C: Send + 'static> Clone for Cq<P, C> {
    fn clone(&self) -> Self {
        Cq {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<P: Platform, C: Send + 'static> fmt::Debug for Cq<P, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cq")
            .field("cqn", &self.shared.cqn)
            .field("entries", &self.shared.entries)
            .finish()
    }
}

impl<P: Platform, C: Send + 'static> Cq<P, C> {
    /// Creates a CQ delivering to `handler`, and arms it.
    ///
    /// # Errors
    ///
    /// [`VerbsError::Hca`] (`InvalidSize`, `OutOfResources`),
    /// [`VerbsError::Alloc`], [`VerbsError::TableFull`].
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL` only.
    pub fn create(
        device: &Device<P>,
        config: CqConfig,
        handler: Arc<dyn CqHandler<C>>,
        irql: &Passive<'_>,
    ) -> Result<Self, VerbsError> {
        let dev = &device.inner;
        let hook: Arc<CqEventHook<P, C>> = Arc::new(CqEventHook {
            drainer: SetOnce::new(),
        });
        let res = dev.hca.create_cq(config.entries, hook.clone())?;
        let entries = res.ring.entries();
        let cqn = res.cqn;
        // The same ring and record, their words looked up once. The device
        // sized both already; a wrapper that fails the same checks is a
        // device that broke its own contract.
        let ring = CqRing::new(PinnedWords::new(res.ring.into_mem()), entries);
        let dbr = CqDoorbellRecord::new(PinnedWords::new(res.doorbell_record.into_mem()));
        let (Ok(ring), Ok(dbr)) = (ring, dbr) else {
            let _ = dev.hca.destroy_cq(cqn);
            return Err(VerbsError::Hca(HcaError::InvalidSize));
        };
        let on_destroyed = {
            let handler = Arc::clone(&handler);
            move |d: &Dispatch<'_>| handler.on_destroyed(d)
        };
        let built = Rundown::new(&dev.platform, on_destroyed, irql).and_then(|rundown| {
            let core = CqCore {
                cqn,
                ring,
                dbr,
                arm_doorbell: SharedDyn::new(res.arm_doorbell),
                consumed: AtomicU64::new(0),
                events: AtomicU32::new(0),
                arm_word: AtomicU32::new(0),
                qps: AttachedTable::new(),
                attached_depth: SpinLock::new(0),
                stray: AtomicU64::new(0),
                malformed: AtomicU64::new(0),
            };
            let deliver = CqDeliver {
                handler: SharedDyn::new(handler),
                rundown,
            };
            DpcDrainer::new(
                &dev.platform,
                core,
                deliver,
                config.budget.unwrap_or(dev.config.cq_budget),
                config.dpc_target,
                irql,
            )
        });
        let drainer = match built {
            Ok(d) => d,
            Err(e) => {
                let _ = dev.hca.destroy_cq(cqn);
                return Err(e.into());
            }
        };
        // A fresh cell, set only here: it cannot be set already.
        let _ = hook.drainer.set(Arc::downgrade(&drainer));
        let shared = Arc::new(CqShared {
            cqn,
            entries,
            drainer,
            device: Arc::clone(dev),
            destroyed: AtomicBool::new(false),
        });
        let target: Arc<dyn AsyncTarget> = shared.clone();
        if let Err(e) = dev.register_target(TargetId::Cq(cqn), Arc::downgrade(&target), irql) {
            let _ = dev.hca.destroy_cq(cqn);
            return Err(e);
        }
        let cq = Cq { shared };
        // Start armed: the first completion raises an event.
        cq.drain_inline(Budget::UNLIMITED, irql);
        Ok(cq)
    }

    /// Prepares an asynchronous create (see [`crate::slowpath`]); submit it
    /// with [`Device::submit`] from any IRQL <= `DISPATCH_LEVEL`.
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL` (it allocates the job).
    pub fn prepare_create(
        device: &Device<P>,
        config: CqConfig,
        handler: Arc<dyn CqHandler<C>>,
        done: Callback<Result<Cq<P, C>, VerbsError>>,
        _irql: &Passive<'_>,
    ) -> Arc<CreateCqJob<P, C>> {
        Arc::new(CreateCqJob {
            device: device.clone(),
            config,
            handler,
            result: SpinLock::new(None),
            done,
        })
    }

    /// The CQ number.
    pub fn cqn(&self) -> u32 {
        self.shared.cqn
    }

    /// CQEs the ring holds.
    pub fn entries(&self) -> u32 {
        self.shared.entries
    }

    /// Schedules a drain (as a completion event does).
    ///
    /// # IRQL
    ///
    /// Any.
    pub fn notify(&self) {
        self.shared.drainer.notify();
    }

    /// Drains on the caller's stack, raised to `DISPATCH_LEVEL`, up to
    /// `budget` (what is left goes to the DPC); returns at once
    /// ([`DrainOutcome::Busy`]) if a drain is running — from inside a
    /// completion handler, say.
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    pub fn drain_inline(&self, budget: Budget, irql: &impl LeDispatch) -> DrainOutcome {
        self.shared.drainer.drain_inline(budget, irql)
    }

    /// Counters.
    pub fn stats(&self) -> CqStats {
        let core = self.shared.drainer.source();
        CqStats {
            polled: core.consumed.load(Ordering::Relaxed),
            events: u64::from(core.events.load(Ordering::Relaxed)),
            stray_cqes: core.stray.load(Ordering::Relaxed),
            malformed_cqes: core.malformed.load(Ordering::Relaxed),
        }
    }

    /// Destroys the CQ on the device; [`CqHandler::on_destroyed`] follows
    /// in a DPC once no callback is running, and no callback runs after it.
    ///
    /// # Errors
    ///
    /// [`VerbsError::InUse`] while QPs are attached; [`VerbsError::Closed`]
    /// if destroyed already.
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL` only.
    pub fn destroy(&self, irql: &Passive<'_>) -> Result<(), VerbsError> {
        if !self.shared.drainer.source().qps.is_empty() {
            return Err(VerbsError::InUse);
        }
        if self.shared.destroyed.swap(true, Ordering::AcqRel) {
            return Err(VerbsError::Closed);
        }
        let dev = &self.shared.device;
        if let Err(e) = dev.hca.destroy_cq(self.shared.cqn) {
            self.shared.destroyed.store(false, Ordering::Release);
            return Err(e.into());
        }
        dev.unregister_target(TargetId::Cq(self.shared.cqn), irql);
        let _ = self.shared.drainer.handler().rundown.destroy();
        Ok(())
    }

    /// Prepares an asynchronous destroy (see [`crate::slowpath`]).
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL` (it allocates the job).
    pub fn prepare_destroy(
        &self,
        done: Callback<Result<(), VerbsError>>,
        _irql: &Passive<'_>,
    ) -> Arc<DestroyCqJob<P, C>> {
        Arc::new(DestroyCqJob {
            cq: self.clone(),
            result: SpinLock::new(None),
            done,
        })
    }

    /// Attaches a QP's queues (`depth` CQEs) to this CQ.
    pub(crate) fn attach(
        &self,
        qp: &Arc<QpShared<P, C>>,
        depth: u32,
        irql: &Passive<'_>,
    ) -> Result<(), VerbsError> {
        let core = self.shared.drainer.source();
        let mut attached_depth = core.attached_depth.lock(irql);
        let total = attached_depth.saturating_add(depth);
        if total > self.shared.entries {
            return Err(VerbsError::CqTooSmall);
        }
        if core.qps.insert(Arc::clone(qp)).is_err() {
            return Err(VerbsError::TableFull);
        }
        *attached_depth = total;
        Ok(())
    }

    /// Detaches a QP (`qp` is compared by address). Waits out a poll that
    /// may be resolving one of its CQEs (bounded: one poll); the `Arc` the
    /// CQ held is dropped after that, outside any lock.
    pub(crate) fn detach(&self, qp: &QpShared<P, C>, depth: u32, irql: &impl LeDispatch) {
        let core = self.shared.drainer.source();
        let removed = core.qps.remove(qp);
        if removed.is_some() {
            let mut attached_depth = core.attached_depth.lock(irql);
            *attached_depth = attached_depth.saturating_sub(depth);
        }
        drop(removed);
    }
}

/// A prepared asynchronous CQ create ([`Cq::prepare_create`]).
pub struct CreateCqJob<P: Platform, C: Send + 'static> {
    device: Device<P>,
    config: CqConfig,
    handler: Arc<dyn CqHandler<C>>,
    result: ResultSlot<Cq<P, C>, P>,
    done: Callback<Result<Cq<P, C>, VerbsError>>,
}

impl<P: Platform, C: Send + 'static> Job for CreateCqJob<P, C> {
    fn run(&self, irql: &Passive<'_>) {
        let r = Cq::create(&self.device, self.config, Arc::clone(&self.handler), irql);
        *self.result.lock(irql) = Some(r);
    }

    fn complete(&self, cancelled: bool, irql: AnyIrql<'_, '_>) {
        let r = take_result(&self.result, cancelled, &irql);
        (self.done)(r, irql);
    }
}

/// A prepared asynchronous CQ destroy ([`Cq::prepare_destroy`]).
pub struct DestroyCqJob<P: Platform, C: Send + 'static> {
    cq: Cq<P, C>,
    result: ResultSlot<(), P>,
    done: Callback<Result<(), VerbsError>>,
}

impl<P: Platform, C: Send + 'static> Job for DestroyCqJob<P, C> {
    fn run(&self, irql: &Passive<'_>) {
        let r = self.cq.destroy(irql);
        *self.result.lock(irql) = Some(r);
    }

    fn complete(&self, cancelled: bool, irql: AnyIrql<'_, '_>) {
        let r = take_result(&self.result, cancelled, &irql);
        (self.done)(r, irql);
    }
}
