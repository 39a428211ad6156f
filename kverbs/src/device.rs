//! The opened device: limits, ports and GIDs, the passive worker every
//! object of the device shares, the device-level request queue for
//! asynchronous creates, and the asynchronous-event path.
//!
//! # Asynchronous events
//!
//! The HCA reports port, QP and CQ events in its interrupt context. kverbs
//! queues each event (a fixed ring, no allocation) and delivers it from a
//! DPC at `DISPATCH_LEVEL`: to the object it names — the QP's
//! [`crate::qp::QpHandler::on_async_event`], the CQ's
//! [`crate::cq::CqHandler::on_async_event`], each fenced by that object's
//! run-down, so a destroyed object hears nothing — and then to the
//! device-wide [`DeviceEventHandler`] (port up/down and everything else).
//! If the ring overflows, the lost events are counted
//! ([`Device::lost_async_events`]) and the device handler is told with
//! [`DeviceEvent::EventsLost`].

use alloc::boxed::Box;
use alloc::sync::{Arc, Weak};
use alloc::vec::Vec;
use core::fmt;

use hca_lowlevel::device::{AsyncEvent, AsyncEventHandler, DeviceAttr, Gid, HcaDevice, PortAttr};
use hca_lowlevel::dma::DmaAllocator;

use crate::drain::Budget;
use crate::error::VerbsError;
use crate::interrupt::enter_dispatch;
use crate::irql::{Dispatch, LeDispatch, Passive};
use crate::platform::{DpcTarget, Platform, RawDpc};
use crate::rundown::Rundown;
use crate::slowpath::{Job, JobRunner};
use crate::sync::SpinLock;
use crate::sync::atomic::{AtomicU64, Ordering};
use crate::worker::{CompleteAt, Rejected, RequestQueue, Worker};

/// How to open a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceConfig {
    /// Work items of the passive worker (slow-path requests of different
    /// objects that may run at once).
    pub worker_parallelism: usize,
    /// Request slots of the device's own queue (asynchronous creates).
    pub device_request_slots: usize,
    /// Request slots of each QP's queue (modify, flush, destroy).
    pub qp_request_slots: usize,
    /// Most QPs and CQs the device may have open at once through kverbs
    /// (sizes the asynchronous-event routing table, allocated at open).
    pub max_objects: usize,
    /// The per-DPC budget of every CQ's drain loop.
    pub cq_budget: Budget,
}

impl Default for DeviceConfig {
    fn default() -> Self {
        DeviceConfig {
            worker_parallelism: 2,
            device_request_slots: 64,
            qp_request_slots: 8,
            max_objects: 1024,
            cq_budget: Budget {
                completions: 256,
                // 100 µs at the platform's tick rate is set at open.
                ticks: 0,
            },
        }
    }
}

/// Events for the device-wide handler.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceEvent {
    /// An event from the HCA (every event, after its object heard it).
    Hca(AsyncEvent),
    /// The event ring overflowed; this many events were lost so far.
    EventsLost(u64),
}

/// Receives the device's asynchronous events.
pub trait DeviceEventHandler: Send + Sync {
    /// One event.
    ///
    /// # IRQL
    ///
    /// `DISPATCH_LEVEL` (the device's event DPC).
    fn on_device_event(&self, event: DeviceEvent, irql: &Dispatch<'_>);
}

/// An object that hears its own asynchronous events.
pub(crate) trait AsyncTarget: Send + Sync {
    fn async_event(&self, event: AsyncEvent, irql: &Dispatch<'_>);
}

/// Which object an event names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TargetId {
    Qp(u32),
    Cq(u32),
}

fn target_of(event: &AsyncEvent) -> Option<TargetId> {
    match *event {
        AsyncEvent::QpFatal { qpn }
        | AsyncEvent::QpRequestError { qpn }
        | AsyncEvent::QpAccessError { qpn }
        | AsyncEvent::QpLastWqeReached { qpn }
        | AsyncEvent::CommEstablished { qpn }
        | AsyncEvent::SqDrained { qpn } => Some(TargetId::Qp(qpn)),
        AsyncEvent::CqError { cqn } => Some(TargetId::Cq(cqn)),
        _ => None,
    }
}

/// The routing table: which object hears events naming which id.
type TargetTable = Vec<(TargetId, Weak<dyn AsyncTarget>)>;

/// Events queued between the interrupt and the DPC.
const EVENT_RING: usize = 64;

struct Router<P: Platform> {
    targets: SpinLock<TargetTable, P>,
    capacity: usize,
    pending: SpinLock<heapless::Deque<AsyncEvent, EVENT_RING>, P>,
    consumer: SpinLock<Option<Arc<dyn DeviceEventHandler>>, P>,
    lost: AtomicU64,
    reported_lost: AtomicU64,
    dpc: Option<P::Dpc>,
}

impl<P: Platform> Router<P> {
    fn deliver(&self, irql: &Dispatch<'_>) {
        loop {
            let next = self.pending.lock(irql).pop_front();
            let Some(event) = next else { break };
            if let Some(id) = target_of(&event) {
                let target = self
                    .targets
                    .lock(irql)
                    .iter()
                    .find(|(t, _)| *t == id)
                    .and_then(|(_, w)| w.upgrade());
                if let Some(target) = target {
                    target.async_event(event, irql);
                }
            }
            let consumer = self.consumer.lock(irql).clone();
            if let Some(c) = consumer {
                c.on_device_event(DeviceEvent::Hca(event), irql);
            }
        }
        let lost = self.lost.load(Ordering::Acquire);
        if self.reported_lost.swap(lost, Ordering::AcqRel) != lost {
            let consumer = self.consumer.lock(irql).clone();
            if let Some(c) = consumer {
                c.on_device_event(DeviceEvent::EventsLost(lost), irql);
            }
        }
    }
}

/// The adapter the HCA calls (interrupt context).
struct RouterHook<P: Platform>(Weak<Router<P>>);

impl<P: Platform> AsyncEventHandler for RouterHook<P> {
    fn async_event(&self, event: AsyncEvent) {
        let Some(router) = self.0.upgrade() else {
            return;
        };
        enter_dispatch::<P, _>(|d| {
            if router.pending.lock(d).push_back(event).is_err() {
                router.lost.fetch_add(1, Ordering::AcqRel);
            }
        });
        if let Some(dpc) = &router.dpc {
            dpc.queue();
        }
    }
}

pub(crate) struct DeviceInner<P: Platform> {
    pub(crate) hca: Arc<dyn HcaDevice>,
    pub(crate) platform: P,
    pub(crate) worker: Worker<P>,
    pub(crate) attr: DeviceAttr,
    pub(crate) config: DeviceConfig,
    pub(crate) dma: Arc<dyn DmaAllocator>,
    jobs: RequestQueue<P, JobRunner>,
    router: Arc<Router<P>>,
    ports: heapless::Vec<PortInfo, 4>,
}

impl<P: Platform> DeviceInner<P> {
    /// Registers an object for its asynchronous events.
    pub(crate) fn register_target(
        &self,
        id: TargetId,
        target: Weak<dyn AsyncTarget>,
        irql: &Passive<'_>,
    ) -> Result<(), VerbsError> {
        let mut targets = self.router.targets.lock(irql);
        if targets.len() >= self.router.capacity {
            return Err(VerbsError::TableFull);
        }
        // Within the capacity reserved at open: no allocation.
        targets.push((id, target));
        Ok(())
    }

    /// Removes an object from the routing table.
    pub(crate) fn unregister_target(&self, id: TargetId, irql: &impl LeDispatch) {
        let mut targets = self.router.targets.lock(irql);
        if let Some(i) = targets.iter().position(|(t, _)| *t == id) {
            // The Weak dropped here frees nothing (the object holds the Arc).
            targets.swap_remove(i);
        }
    }

    /// The P_Key at `index` of `port`.
    pub(crate) fn pkey(&self, port: u8, index: u16) -> u16 {
        self.ports
            .iter()
            .find(|p| p.port == port)
            .and_then(|p| p.pkeys.get(usize::from(index)).copied())
            .unwrap_or(DEFAULT_PKEY)
    }
}

/// The default (full-membership) P_Key.
pub const DEFAULT_PKEY: u16 = 0xffff;

/// What kverbs learned about a port when the device was opened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortInfo {
    /// Port number (1-based).
    pub port: u8,
    /// Attributes at open time (query again for the live state).
    pub attr: PortAttr,
    /// GID table entry 0.
    pub gid: Gid,
    /// The P_Key table. The device interface has no P_Key query; a RoCE
    /// port's table is the default P_Key at index 0.
    pub pkeys: heapless::Vec<u16, 4>,
}

/// An opened HCA (cheap to clone; clones share it).
pub struct Device<P: Platform> {
    pub(crate) inner: Arc<DeviceInner<P>>,
}

impl<P: Platform> Clone for Device<P> {
    fn clone(&self) -> Self {
        Device {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<P: Platform> fmt::Debug for Device<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device")
            .field("node_guid", &self.inner.attr.node_guid)
            .finish_non_exhaustive()
    }
}

impl<P: Platform> Device<P> {
    /// Opens `hca`: queries its limits and ports, starts the passive worker
    /// and installs the asynchronous-event path.
    ///
    /// # Errors
    ///
    /// [`VerbsError::Alloc`]; [`VerbsError::Hca`] from the port queries.
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL` only.
    pub fn open(
        platform: &P,
        hca: Arc<dyn HcaDevice>,
        config: DeviceConfig,
        irql: &Passive<'_>,
    ) -> Result<Self, VerbsError> {
        let mut config = config;
        if config.cq_budget.ticks == 0 {
            config.cq_budget.ticks = (P::ticks_per_second() / 10_000).max(1);
        }
        let attr = hca.query_device();
        let mut ports = heapless::Vec::new();
        for port in 1..=attr.phys_port_cnt.min(4) {
            let pattr = hca.query_port(port)?;
            let gid = hca.query_gid(port, 0)?;
            let mut pkeys = heapless::Vec::new();
            let _ = pkeys.push(DEFAULT_PKEY);
            let _ = ports.push(PortInfo {
                port,
                attr: pattr,
                gid,
                pkeys,
            });
        }
        let worker = Worker::new(platform, config.worker_parallelism, irql)?;
        let rundown = Rundown::new(platform, |_| {}, irql)?;
        let jobs = RequestQueue::new(
            &worker,
            JobRunner,
            config.device_request_slots,
            rundown,
            irql,
        )?;
        let capacity = config.max_objects.max(1);
        let router = Arc::new_cyclic(|weak: &Weak<Router<P>>| {
            let weak = weak.clone();
            let dpc = platform
                .new_dpc(
                    Box::new(move |d: &Dispatch<'_>| {
                        if let Some(r) = weak.upgrade() {
                            r.deliver(d);
                        }
                    }),
                    DpcTarget::Current,
                    irql,
                )
                .ok();
            Router {
                targets: SpinLock::new(Vec::with_capacity(capacity)),
                capacity,
                pending: SpinLock::new(heapless::Deque::new()),
                consumer: SpinLock::new(None),
                lost: AtomicU64::new(0),
                reported_lost: AtomicU64::new(0),
                dpc,
            }
        });
        if router.dpc.is_none() {
            return Err(VerbsError::Alloc);
        }
        let dma = hca.dma_allocator();
        hca.set_async_event_handler(Some(Arc::new(RouterHook(Arc::downgrade(&router)))));
        Ok(Device {
            inner: Arc::new(DeviceInner {
                hca,
                platform: platform.clone(),
                worker,
                attr,
                config,
                dma,
                jobs,
                router,
                ports,
            }),
        })
    }

    /// Installs (or removes) the device-wide event handler.
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL` (the handler was allocated by the caller).
    pub fn set_event_handler(
        &self,
        handler: Option<Arc<dyn DeviceEventHandler>>,
        irql: &impl LeDispatch,
    ) {
        let old = core::mem::replace(&mut *self.inner.router.consumer.lock(irql), handler);
        drop(old);
    }

    /// Device limits (queried at open).
    pub fn attr(&self) -> &DeviceAttr {
        &self.inner.attr
    }

    /// The ports as found at open.
    pub fn ports(&self) -> &[PortInfo] {
        &self.inner.ports
    }

    /// Live port attributes (a firmware command).
    ///
    /// # Errors
    ///
    /// [`VerbsError::Hca`] (`InvalidPort`).
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL` only.
    pub fn query_port(&self, port: u8, _irql: &Passive<'_>) -> Result<PortAttr, VerbsError> {
        Ok(self.inner.hca.query_port(port)?)
    }

    /// A GID table entry (a firmware command).
    ///
    /// # Errors
    ///
    /// [`VerbsError::Hca`] (`InvalidPort`, `InvalidGidIndex`).
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL` only.
    pub fn query_gid(&self, port: u8, index: u16, _irql: &Passive<'_>) -> Result<Gid, VerbsError> {
        Ok(self.inner.hca.query_gid(port, index)?)
    }

    /// The platform.
    pub fn platform(&self) -> &P {
        &self.inner.platform
    }

    /// The passive worker the device's objects share.
    pub fn worker(&self) -> &Worker<P> {
        &self.inner.worker
    }

    /// Asynchronous events lost to a full event ring so far.
    pub fn lost_async_events(&self) -> u64 {
        self.inner.router.lost.load(Ordering::Acquire)
    }

    /// Submits a prepared slow-path [`Job`] (an asynchronous create) to
    /// run on the worker; it reports through its own callback at the level
    /// `at` asks for. Never blocks, never allocates.
    ///
    /// # Errors
    ///
    /// The job handed back with the reason (queue full, or closed).
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    pub fn submit(
        &self,
        job: Arc<dyn Job>,
        at: CompleteAt,
        irql: &impl LeDispatch,
    ) -> Result<(), Rejected<Arc<dyn Job>>> {
        self.inner.jobs.submit(job, at, irql)
    }

    /// Closes the device: removes the event path and cancels queued
    /// device-level jobs. Objects still open keep the device alive (they
    /// hold it); destroy them first.
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL` only.
    pub fn close(&self, irql: &Passive<'_>) {
        self.inner.hca.set_async_event_handler(None);
        self.inner.jobs.shutdown(irql);
        let old = self.inner.router.consumer.lock(irql).take();
        drop(old);
    }
}
