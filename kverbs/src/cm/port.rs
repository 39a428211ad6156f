//! The connection manager bound to one port: the engine driven by MADs on
//! the port's QP1, by a platform timer, by the consumers' QPs' worker, and
//! delivering its events from a DPC.
//!
//! # How the pieces meet
//!
//! * **QP1.** The port owns a GSI QP with its CQ and two registered
//!   buffers: receive slots (GRH + MAD) kept posted, and send slots
//!   (one MAD each) taken from a free list. A receive completion (in the
//!   CQ's DPC, at `DISPATCH_LEVEL`) hands the MAD and its source (the GRH's
//!   source GID, the completion's source QP) to the engine and reposts the
//!   slot; a send completion returns its slot. Sends go to the peer's QP1
//!   with the GSI Q_Key (the GSI QP puts it in every datagram).
//! * **Timers.** One platform timer per port, armed for the engine's
//!   earliest deadline after every engine call.
//! * **QP transitions.** Each connection binds a consumer QP
//!   ([`CmQp`]); the engine's QP modifications go to its asynchronous
//!   modify (the passive worker), whose callback reports back.
//!   "Communication established" reaches the engine through
//!   [`CmPort::qp_events`] (a wrapper around the QP's event handler) or
//!   [`CmPort::notify_comm_established`].
//! * **Callbacks.** Engine events land in a per-slot mailbox (one cell per
//!   kind: request, withdrawn, established, terminal — each happens at
//!   most once per connection), and a DPC delivers them, one at a time, at
//!   `DISPATCH_LEVEL`, outside every lock. A slot is not reused while its
//!   mailbox holds anything, so the mailboxes never overflow. No consumer
//!   call ever runs a callback inline.
//!
//! Every consumer call is allowed at IRQL <= `DISPATCH_LEVEL` and returns
//! at once; only [`CmPort::create`] and [`CmPort::release`] run at
//! `PASSIVE_LEVEL`. Nothing allocates after `create`.

use alloc::boxed::Box;
use alloc::sync::{Arc, Weak};
use alloc::vec::Vec;
use core::fmt;
use core::time::Duration;

use hca_lowlevel::device::{
    AccessFlags, AsyncEvent, GSI_QKEY, QpAttr, QpAttrMask, QpState, QpType,
};
use hca_lowlevel::wire::{Gid, Psn, Qpn};

use super::agent::{CmStats, DroppedMad};
use super::engine::{CmConfig, CmEffects, CmEngine, CmState, ListenKind};
use super::qp::QpModify;
use super::rdma_cm::{self, RdmaCmEndpoints};
use super::types::{
    AcceptRequest, CmError, CmEvent, CmId, ConnParams, ConnectRequest, DisconnectCause,
    IncomingRequest, ListenEvent, ListenerId, LocalQp, MadAddress, UnreachableCause,
    WithdrawnCause,
};
use crate::cq::{Cq, CqConfig, CqHandler};
use crate::device::Device;
use crate::error::VerbsError;
use crate::irql::{AnyIrql, Dispatch, LeDispatch, Passive};
use crate::mr::Mr;
use crate::pd::Pd;
use crate::platform::{DpcTarget, Platform, RawDpc, RawTimer};
use crate::qp::{Qp, QpConfig, QpHandler};
use crate::slowpath::{Callback, CompleteAt};
use crate::sync::SpinLock;
use crate::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use crate::wire::{CmaHeaderRepr, MAD_LEN, PathMtu, RejectReason, ServiceId};
use crate::wr::{Completion, GRH_LEN, Payload, SendWr, Signal, UdDest, WcStatus};

/// Bytes per receive slot (GRH + MAD, rounded up).
const RECV_STRIDE: usize = 512;
/// Largest private data a mailbox cell keeps (RTU/DREP).
const DATA_LEN: usize = 224;
/// REQ private data.
const REQ_DATA_LEN: usize = 92;

/// The QP a connection binds, as the CM drives it: its number and an
/// asynchronous modify. Implemented for [`Qp`]; consumers hand the CM an
/// `Arc<dyn CmQp>` made at `PASSIVE_LEVEL`.
pub trait CmQp: Send + Sync {
    /// The QP number.
    fn qpn(&self) -> u32;

    /// Requests a modify on the worker; `done` runs once with the result
    /// (not at all if this returns an error).
    ///
    /// # Errors
    ///
    /// The QP refused the request at once (queue full, closed).
    ///
    /// # IRQL
    ///
    /// `DISPATCH_LEVEL` (called under the CM's lock).
    fn modify_async(
        &self,
        attr: QpAttr,
        mask: QpAttrMask,
        done: &Callback<Result<(), VerbsError>>,
        irql: &Dispatch<'_>,
    ) -> Result<(), VerbsError>;
}

impl<P: Platform, C: Send + 'static> CmQp for Qp<P, C> {
    fn qpn(&self) -> u32 {
        Qp::qpn(self)
    }

    fn modify_async(
        &self,
        attr: QpAttr,
        mask: QpAttrMask,
        done: &Callback<Result<(), VerbsError>>,
        irql: &Dispatch<'_>,
    ) -> Result<(), VerbsError> {
        Qp::modify_async(self, attr, mask, CompleteAt::Dispatch, done, irql)
    }
}

/// A connection's consumer.
pub trait CmHandler: Send + Sync {
    /// One event of connection `id` (see [`CmEvent`] for the sequence).
    ///
    /// # IRQL
    ///
    /// `DISPATCH_LEVEL` (the port's delivery DPC): must not block. It may
    /// call the port (`disconnect`, `connect`...).
    fn on_event(&self, id: CmId, event: CmEvent<'_>, irql: &Dispatch<'_>);
}

/// A listener's consumer.
pub trait CmListener: Send + Sync {
    /// A request, or the withdrawal of one not yet answered. `accept` and
    /// `reject` may be called from here or later, from any IRQL <=
    /// `DISPATCH_LEVEL`.
    ///
    /// # IRQL
    ///
    /// `DISPATCH_LEVEL` (the port's delivery DPC): must not block.
    fn on_event(&self, listener: ListenerId, event: ListenEvent<'_>, irql: &Dispatch<'_>);
}

/// Receives every dropped MAD (the trace hook).
pub trait CmTrace: Send + Sync {
    /// One dropped MAD.
    ///
    /// # IRQL
    ///
    /// `DISPATCH_LEVEL`, under the port's lock: must not block and must
    /// not call the port.
    fn dropped(&self, drop: &DroppedMad);
}

/// How to build a [`CmPort`].
#[derive(Clone)]
pub struct CmPortConfig {
    /// The engine's timing and table sizes; its GID, CA GUID and port MTU
    /// are filled in from the device.
    pub cm: CmConfig,
    /// MAD receive slots kept posted on QP1.
    pub recv_buffers: u32,
    /// MAD send slots.
    pub send_buffers: u32,
    /// The trace hook for dropped MADs.
    pub trace: Option<Arc<dyn CmTrace>>,
}

impl fmt::Debug for CmPortConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CmPortConfig")
            .field("cm", &self.cm)
            .field("recv_buffers", &self.recv_buffers)
            .field("send_buffers", &self.send_buffers)
            .finish_non_exhaustive()
    }
}

impl Default for CmPortConfig {
    fn default() -> Self {
        CmPortConfig {
            cm: CmConfig::new(Gid::ZERO, 0),
            recv_buffers: 64,
            send_buffers: 64,
            trace: None,
        }
    }
}

/// The port's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmPortStats {
    /// The engine's.
    pub engine: CmStats,
    /// MADs not sent: no free send slot, or QP1's send queue refused.
    pub send_dropped: u64,
    /// MAD sends that completed with an error.
    pub send_errors: u64,
    /// Receives that completed with an error, without a GRH, or short.
    pub recv_errors: u64,
    /// Receive slots that could not be reposted.
    pub repost_failures: u64,
    /// Events delivered to consumers.
    pub events_delivered: u64,
}

/// What a QP1 work request is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MadSlot {
    /// A receive slot.
    Recv(u32),
    /// A send slot.
    Send(u32),
}

#[derive(Clone, Copy)]
struct Data {
    len: usize,
    bytes: [u8; DATA_LEN],
}

impl Data {
    fn of(src: &[u8]) -> Data {
        let mut d = Data {
            len: src.len().min(DATA_LEN),
            bytes: [0; DATA_LEN],
        };
        if let (Some(dst), Some(s)) = (d.bytes.get_mut(..d.len), src.get(..d.len)) {
            dst.copy_from_slice(s);
        }
        d
    }

    fn as_slice(&self) -> &[u8] {
        self.bytes.get(..self.len).unwrap_or(&[])
    }
}

/// A request, kept until the listener hears it.
#[derive(Clone, Copy)]
struct OwnedRequest {
    listener: ListenerId,
    id: CmId,
    service_id: ServiceId,
    peer: MadAddress,
    remote_qpn: Qpn,
    remote_ca_guid: u64,
    path_mtu: PathMtu,
    responder_resources: u8,
    initiator_depth: u8,
    rdma_cm: Option<CmaHeaderRepr>,
    len: usize,
    data: [u8; REQ_DATA_LEN],
}

#[derive(Clone, Copy)]
enum OwnedEvent {
    Established(Data),
    Rejected(RejectReason, Data),
    Unreachable(UnreachableCause),
    Disconnected(DisconnectCause, Data),
}

impl OwnedEvent {
    fn of(event: &CmEvent<'_>) -> OwnedEvent {
        match *event {
            CmEvent::Established { private_data } => {
                OwnedEvent::Established(Data::of(private_data))
            }
            CmEvent::Rejected {
                reason,
                private_data,
            } => OwnedEvent::Rejected(reason, Data::of(private_data)),
            CmEvent::Unreachable { cause } => OwnedEvent::Unreachable(cause),
            CmEvent::Disconnected {
                cause,
                private_data,
            } => OwnedEvent::Disconnected(cause, Data::of(private_data)),
        }
    }

    fn as_event(&self) -> CmEvent<'_> {
        match self {
            OwnedEvent::Established(d) => CmEvent::Established {
                private_data: d.as_slice(),
            },
            OwnedEvent::Rejected(reason, d) => CmEvent::Rejected {
                reason: *reason,
                private_data: d.as_slice(),
            },
            OwnedEvent::Unreachable(cause) => CmEvent::Unreachable { cause: *cause },
            OwnedEvent::Disconnected(cause, d) => CmEvent::Disconnected {
                cause: *cause,
                private_data: d.as_slice(),
            },
        }
    }
}

/// One slot's undelivered events: at most one of each kind per connection.
#[derive(Clone, Copy, Default)]
struct Mailbox {
    request: Option<OwnedRequest>,
    withdrawn: Option<(ListenerId, CmId, WithdrawnCause)>,
    established: Option<(CmId, OwnedEvent)>,
    terminal: Option<(CmId, OwnedEvent)>,
}

impl Mailbox {
    fn is_empty(&self) -> bool {
        self.request.is_none()
            && self.withdrawn.is_none()
            && self.established.is_none()
            && self.terminal.is_none()
    }
}

/// What a slot's connection is bound to.
#[derive(Default)]
struct Binding {
    qp: Option<Arc<dyn CmQp>>,
    handler: Option<Arc<dyn CmHandler>>,
    /// The connection whose modify is in flight.
    modify_id: Option<CmId>,
    /// Modify callbacks still to come.
    modify_pending: u8,
    modify_failed: bool,
    /// The QP refused the modify at once: report the failure after the
    /// engine call that asked for it.
    modify_refused: bool,
}

/// An event taken out of a mailbox, ready to deliver outside the lock.
enum Delivery {
    Conn(Arc<dyn CmHandler>, CmId, OwnedEvent),
    Request(Arc<dyn CmListener>, OwnedRequest),
    Withdrawn(Arc<dyn CmListener>, ListenerId, CmId, WithdrawnCause),
}

/// One mailbox cell, taken out.
enum Cell {
    Request(OwnedRequest),
    Withdrawn(ListenerId, CmId, WithdrawnCause),
    Established(CmId, OwnedEvent),
    Terminal(CmId, OwnedEvent),
}

impl Cell {
    /// The mailbox's next cell in delivery order.
    fn take(mailbox: &mut Mailbox) -> Option<Cell> {
        if let Some(r) = mailbox.request.take() {
            return Some(Cell::Request(r));
        }
        if let Some((l, id, cause)) = mailbox.withdrawn.take() {
            return Some(Cell::Withdrawn(l, id, cause));
        }
        if let Some((id, event)) = mailbox.established.take() {
            return Some(Cell::Established(id, event));
        }
        mailbox
            .terminal
            .take()
            .map(|(id, event)| Cell::Terminal(id, event))
    }
}

struct PortState {
    engine: CmEngine,
    bindings: Box<[Binding]>,
    mailboxes: Box<[Mailbox]>,
    listeners: Box<[Option<Arc<dyn CmListener>>]>,
    /// Free send slots (a stack).
    send_free: Vec<u32>,
    /// The deadline the timer is armed for.
    armed: Option<u64>,
    /// Where the delivery scan resumes (fairness across slots).
    cursor: usize,
    closing: bool,
    stats: CmPortStats,
}

impl PortState {
    /// Who hears `cell`; `None` if nobody does any more.
    fn resolve(&mut self, slot: usize, cell: Cell) -> Option<Delivery> {
        let listener = |table: &[Option<Arc<dyn CmListener>>], l: ListenerId| {
            table.get(l.index()).and_then(Option::clone)
        };
        match cell {
            Cell::Request(r) => {
                listener(&self.listeners, r.listener).map(|l| Delivery::Request(l, r))
            }
            Cell::Withdrawn(lid, id, cause) => {
                listener(&self.listeners, lid).map(|l| Delivery::Withdrawn(l, lid, id, cause))
            }
            Cell::Established(id, event) => self
                .bindings
                .get(slot)
                .and_then(|b| b.handler.clone())
                .map(|h| Delivery::Conn(h, id, event)),
            // The last event: the binding goes with it.
            Cell::Terminal(id, event) => self
                .bindings
                .get_mut(slot)
                .and_then(|b| {
                    b.qp = None;
                    b.handler.take()
                })
                .map(|h| Delivery::Conn(h, id, event)),
        }
    }
}

/// The back-reference the port's callbacks (timer, DPC, CQ, QP modify)
/// hold: filled once the port exists, emptied when it is released.
struct Back<P: Platform> {
    port: SpinLock<Weak<PortShared<P>>, P>,
}

impl<P: Platform> Back<P> {
    fn get(&self, irql: &impl LeDispatch) -> Option<Arc<PortShared<P>>> {
        self.port.lock(irql).upgrade()
    }
}

struct PortShared<P: Platform> {
    port: u8,
    gid: Gid,
    port_mtu: PathMtu,
    packet_lifetime: crate::wire::IbTimeout,
    pd: Pd<P>,
    gsi: Qp<P, MadSlot>,
    cq: Cq<P, MadSlot>,
    recv_mr: Mr<P>,
    send_mr: Mr<P>,
    state: SpinLock<PortState, P>,
    timer: P::Timer,
    delivery_dpc: P::Dpc,
    /// RUNNING | NOTIFIED, as in [`crate::drain`].
    delivery: AtomicUsize,
    modify_done: Box<[Callback<Result<(), VerbsError>>]>,
    trace: Option<Arc<dyn CmTrace>>,
    gsi_destroyed: AtomicBool,
    back: Arc<Back<P>>,
}

const RUNNING: usize = 0b10;
const NOTIFIED: usize = 0b01;

/// The connection manager of one port (cheap to clone; clones share it).
pub struct CmPort<P: Platform> {
    shared: Arc<PortShared<P>>,
}

impl<P: Platform> Clone for CmPort<P> {
    fn clone(&self) -> Self {
        CmPort {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<P: Platform> fmt::Debug for CmPort<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CmPort")
            .field("port", &self.shared.port)
            .field("gid", &self.shared.gid)
            .finish_non_exhaustive()
    }
}

/// The QP handler of QP1: notes its destruction.
struct GsiEvents<P: Platform> {
    back: Arc<Back<P>>,
}

impl<P: Platform> QpHandler for GsiEvents<P> {
    fn on_destroyed(&self, irql: &Dispatch<'_>) {
        if let Some(port) = self.back.get(irql) {
            port.gsi_destroyed.store(true, Ordering::Release);
        }
    }
}

/// The CQ handler of QP1.
struct GsiCompletions<P: Platform> {
    back: Arc<Back<P>>,
}

impl<P: Platform> CqHandler<MadSlot> for GsiCompletions<P> {
    fn on_completion(&self, completion: Completion<MadSlot>, irql: &Dispatch<'_>) {
        if let Some(port) = self.back.get(irql) {
            port.on_completion(&completion, irql);
        }
    }
}

/// A consumer QP handler with the CM listening in (see
/// [`CmPort::qp_events`]).
struct CmQpEvents<P: Platform> {
    back: Arc<Back<P>>,
    inner: Arc<dyn QpHandler>,
}

impl<P: Platform> QpHandler for CmQpEvents<P> {
    fn on_async_event(&self, event: AsyncEvent, irql: &Dispatch<'_>) {
        if let AsyncEvent::CommEstablished { qpn } = event {
            if let Some(port) = self.back.get(irql) {
                port.comm_established(Qpn::from_low_bits(qpn), irql);
            }
        }
        self.inner.on_async_event(event, irql);
    }

    fn on_flushed(&self, result: Result<(), VerbsError>, irql: &Dispatch<'_>) {
        self.inner.on_flushed(result, irql);
    }

    fn on_destroyed(&self, irql: &Dispatch<'_>) {
        self.inner.on_destroyed(irql);
    }
}

/// The engine's effects under the port's lock.
struct PortFx<'a, P: Platform> {
    shared: &'a PortShared<P>,
    bindings: &'a mut [Binding],
    mailboxes: &'a mut [Mailbox],
    send_free: &'a mut Vec<u32>,
    stats: &'a mut CmPortStats,
    irql: &'a Dispatch<'a>,
    /// Some binding has `modify_refused` set.
    refused: bool,
    notify: bool,
}

impl<P: Platform> CmEffects for PortFx<'_, P> {
    fn send_mad(&mut self, to: &MadAddress, mad: &[u8; MAD_LEN]) {
        let Some(slot) = self.send_free.pop() else {
            self.stats.send_dropped += 1;
            return;
        };
        if !self.shared.post_send(slot, to, mad, self.irql) {
            self.send_free.push(slot);
            self.stats.send_dropped += 1;
        }
    }

    fn modify_qp(&mut self, id: CmId, _qpn: Qpn, modify: &QpModify) {
        // The engine's slot index is always one of ours (same table size).
        let Some(binding) = self.bindings.get_mut(id.slot()) else {
            return;
        };
        let done = self.shared.modify_done.get(id.slot());
        binding.modify_id = Some(id);
        binding.modify_pending = 0;
        binding.modify_failed = false;
        if let (Some(qp), Some(done)) = (&binding.qp, done) {
            for (attr, mask) in modify.steps().into_iter().flatten() {
                match qp.modify_async(attr, mask, done, self.irql) {
                    Ok(()) => binding.modify_pending += 1,
                    Err(_) => {
                        binding.modify_failed = true;
                        break;
                    }
                }
            }
        }
        if binding.modify_pending == 0 {
            binding.modify_refused = true;
            self.refused = true;
        }
    }

    fn event(&mut self, id: CmId, event: CmEvent<'_>) {
        if let Some(mailbox) = self.mailboxes.get_mut(id.slot()) {
            let owned = Some((id, OwnedEvent::of(&event)));
            if event.is_terminal() {
                mailbox.terminal = owned;
            } else {
                mailbox.established = owned;
            }
            self.notify = true;
        }
    }

    fn listener_event(&mut self, listener: ListenerId, event: ListenEvent<'_>) {
        match event {
            ListenEvent::Request(r) => {
                if let Some(mailbox) = self.mailboxes.get_mut(r.id.slot()) {
                    let mut data = [0u8; REQ_DATA_LEN];
                    let len = r.private_data.len().min(REQ_DATA_LEN);
                    if let (Some(d), Some(s)) = (data.get_mut(..len), r.private_data.get(..len)) {
                        d.copy_from_slice(s);
                    }
                    mailbox.request = Some(OwnedRequest {
                        listener,
                        id: r.id,
                        service_id: r.service_id,
                        peer: r.peer,
                        remote_qpn: r.remote_qpn,
                        remote_ca_guid: r.remote_ca_guid,
                        path_mtu: r.path_mtu,
                        responder_resources: r.responder_resources,
                        initiator_depth: r.initiator_depth,
                        rdma_cm: r.rdma_cm,
                        len,
                        data,
                    });
                    self.notify = true;
                }
            }
            ListenEvent::Withdrawn { id, cause } => {
                if let Some(mailbox) = self.mailboxes.get_mut(id.slot()) {
                    mailbox.withdrawn = Some((listener, id, cause));
                    self.notify = true;
                }
            }
        }
    }

    fn dropped(&mut self, drop: &DroppedMad) {
        if let Some(trace) = &self.shared.trace {
            trace.dropped(drop);
        }
    }

    fn slot_reusable(&self, slot: usize) -> bool {
        let quiet = self.mailboxes.get(slot).is_some_and(Mailbox::is_empty);
        let idle = self
            .bindings
            .get(slot)
            .is_some_and(|b| b.modify_pending == 0 && b.handler.is_none() && b.qp.is_none());
        quiet && idle
    }
}

impl<P: Platform> PortShared<P> {
    fn now_ns() -> u64 {
        let ticks = u128::from(P::now().0);
        let per_second = u128::from(P::ticks_per_second().max(1));
        u64::try_from(ticks.saturating_mul(1_000_000_000) / per_second).unwrap_or(u64::MAX)
    }

    /// Runs `f` on the engine under the lock, then everything that follows
    /// from it: refused modifies reported, the timer re-armed, the
    /// delivery DPC queued.
    fn with_engine<R>(
        &self,
        irql: &impl LeDispatch,
        f: impl FnOnce(&mut CmEngine, u64, &mut PortFx<'_, P>) -> R,
    ) -> R {
        let now = Self::now_ns();
        let (result, notify) = {
            let mut guard = self.state.lock(irql);
            let (state, d) = guard.split();
            let PortState {
                engine,
                bindings,
                mailboxes,
                send_free,
                stats,
                armed,
                ..
            } = state;
            let mut fx = PortFx {
                shared: self,
                bindings,
                mailboxes,
                send_free,
                stats,
                irql: d,
                refused: false,
                notify: false,
            };
            let result = f(engine, now, &mut fx);
            // A refused modify is a failed one; its report may ask for
            // another (to ERR) that may be refused too, and that one's
            // report asks for nothing more: two passes settle everything,
            // the bound is slack.
            for _ in 0..4 {
                if !core::mem::replace(&mut fx.refused, false) {
                    break;
                }
                for slot in 0..fx.bindings.len() {
                    let id = match fx.bindings.get_mut(slot) {
                        Some(b) if b.modify_refused => {
                            b.modify_refused = false;
                            b.modify_id.take()
                        }
                        _ => None,
                    };
                    if let Some(id) = id {
                        engine.on_qp_modified(now, id, false, &mut fx);
                    }
                }
            }
            let notify = fx.notify;
            let next = engine.next_deadline();
            if next != *armed {
                match next {
                    Some(due) => {
                        self.timer
                            .set(Duration::from_nanos(due.saturating_sub(now)), d);
                    }
                    None => {
                        self.timer.cancel(d);
                    }
                }
                *armed = next;
            }
            (result, notify)
        };
        if notify {
            self.kick();
        }
        result
    }

    /// Queues the delivery DPC unless a delivery is queued or running.
    fn kick(&self) {
        if self.delivery.fetch_or(NOTIFIED, Ordering::AcqRel) == 0 {
            self.delivery_dpc.queue();
        }
    }

    /// The delivery DPC: one deliverer at a time, callbacks outside the
    /// lock, until every mailbox is empty.
    fn deliver(&self, irql: &Dispatch<'_>) {
        let mut current = self.delivery.load(Ordering::Acquire);
        loop {
            if current & RUNNING != 0 {
                // Another processor delivers; it was told to look again.
                match self.delivery.compare_exchange(
                    current,
                    current | NOTIFIED,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                ) {
                    Ok(_) => return,
                    Err(seen) => current = seen,
                }
            } else {
                match self.delivery.compare_exchange(
                    current,
                    RUNNING,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                ) {
                    Ok(_) => break,
                    Err(seen) => current = seen,
                }
            }
        }
        loop {
            self.delivery.fetch_and(!NOTIFIED, Ordering::AcqRel);
            while let Some(item) = self.take_delivery(irql) {
                match item {
                    Delivery::Conn(handler, id, event) => {
                        handler.on_event(id, event.as_event(), irql);
                    }
                    Delivery::Request(listener, r) => {
                        let request = IncomingRequest {
                            id: r.id,
                            service_id: r.service_id,
                            peer: r.peer,
                            remote_qpn: r.remote_qpn,
                            remote_ca_guid: r.remote_ca_guid,
                            path_mtu: r.path_mtu,
                            responder_resources: r.responder_resources,
                            initiator_depth: r.initiator_depth,
                            rdma_cm: r.rdma_cm,
                            private_data: r.data.get(..r.len).unwrap_or(&[]),
                        };
                        listener.on_event(r.listener, ListenEvent::Request(request), irql);
                    }
                    Delivery::Withdrawn(listener, lid, id, cause) => {
                        listener.on_event(lid, ListenEvent::Withdrawn { id, cause }, irql);
                    }
                }
            }
            if self
                .delivery
                .compare_exchange(RUNNING, 0, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                return;
            }
        }
    }

    /// Takes the next deliverable event (request, withdrawal, established,
    /// terminal, in that order per slot; slots round-robin). A cell whose
    /// consumer is gone (listener removed) is dropped on the way.
    fn take_delivery(&self, irql: &Dispatch<'_>) -> Option<Delivery> {
        let mut guard = self.state.lock_at_dpc_level(irql);
        let state = &mut *guard;
        let n = state.mailboxes.len().max(1);
        for step in 0..n {
            let slot = (state.cursor + step) % n;
            while let Some(cell) = state.mailboxes.get_mut(slot).and_then(Cell::take) {
                if let Some(delivery) = state.resolve(slot, cell) {
                    state.cursor = slot;
                    state.stats.events_delivered += 1;
                    return Some(delivery);
                }
            }
        }
        None
    }

    /// Writes a MAD into send slot `slot` and posts it to `to`; `false`
    /// if it could not be posted.
    fn post_send(
        &self,
        slot: u32,
        to: &MadAddress,
        mad: &[u8; MAD_LEN],
        irql: &Dispatch<'_>,
    ) -> bool {
        let offset = (slot as usize).saturating_mul(MAD_LEN);
        if self.send_mr.mem().write(offset, mad).is_err() {
            return false;
        }
        let Some(sge) = self.send_mr.sge(offset as u64, MAD_LEN as u32) else {
            return false;
        };
        let dest = UdDest {
            qpn: to.qpn.get(),
            qkey: GSI_QKEY,
            dgid: to.gid,
            traffic_class: 0,
            hop_limit: rdma_cm::ROCE_HOP_LIMIT,
            flow_label: 0,
            sl: 0,
        };
        let Ok(mut batch) = self.gsi.begin_send(irql) else {
            return false;
        };
        let sent = batch
            .send_ud(
                &dest,
                &SendWr::new(Payload::Sges(&[sge])),
                Signal::Signalled(MadSlot::Send(slot)),
            )
            .is_ok();
        batch.commit();
        sent
    }

    fn post_recv(&self, slot: u32, irql: &impl LeDispatch) -> bool {
        let offset = (slot as u64).saturating_mul(RECV_STRIDE as u64);
        match self.gsi.begin_recv(irql) {
            Ok(mut batch) => {
                let ok = batch
                    .recv_ud(
                        &self.recv_mr,
                        offset,
                        RECV_STRIDE as u32,
                        MadSlot::Recv(slot),
                    )
                    .is_ok();
                batch.commit();
                ok
            }
            Err(_) => false,
        }
    }

    fn on_completion(&self, c: &Completion<MadSlot>, irql: &Dispatch<'_>) {
        match c.context {
            Some(MadSlot::Send(slot)) => {
                let mut state = self.state.lock_at_dpc_level(irql);
                if c.status != WcStatus::Success && c.status != WcStatus::Flushed {
                    state.stats.send_errors += 1;
                }
                state.send_free.push(slot);
            }
            Some(MadSlot::Recv(slot)) => {
                if c.status == WcStatus::Flushed {
                    // QP1 is going away: nothing to repost.
                    return;
                }
                self.on_recv(slot, c, irql);
                if !self.post_recv(slot, irql) {
                    self.state.lock_at_dpc_level(irql).stats.repost_failures += 1;
                }
            }
            None => {}
        }
    }

    fn on_recv(&self, slot: u32, c: &Completion<MadSlot>, irql: &Dispatch<'_>) {
        let source = c.ud.and_then(|ud| {
            ud.grh.map(|grh| MadAddress {
                gid: grh.sgid,
                qpn: Qpn::from_low_bits(ud.src_qpn),
            })
        });
        let len = (c.byte_len as usize).saturating_sub(GRH_LEN).min(MAD_LEN);
        let mut mad = [0u8; MAD_LEN];
        let offset = (slot as usize).saturating_mul(RECV_STRIDE) + GRH_LEN;
        let read = mad
            .get_mut(..len)
            .is_some_and(|buf| self.recv_mr.mem().read(offset, buf).is_ok());
        match (c.status, source, read) {
            (WcStatus::Success, Some(from), true) => {
                let body = mad.get(..len).unwrap_or(&[]);
                self.with_engine(irql, |engine, now, fx| engine.on_mad(now, &from, body, fx));
            }
            _ => self.state.lock_at_dpc_level(irql).stats.recv_errors += 1,
        }
    }

    fn on_modify_done(&self, slot: usize, result: Result<(), VerbsError>, irql: &impl LeDispatch) {
        self.with_engine(irql, |engine, now, fx| {
            let Some(binding) = fx.bindings.get_mut(slot) else {
                return;
            };
            binding.modify_pending = binding.modify_pending.saturating_sub(1);
            binding.modify_failed |= result.is_err();
            if binding.modify_pending == 0 {
                let ok = !binding.modify_failed;
                if let Some(id) = binding.modify_id.take() {
                    engine.on_qp_modified(now, id, ok, fx);
                }
            }
        });
    }

    fn on_timer(&self, irql: &Dispatch<'_>) {
        // The expiry disarmed the timer: forget what it was armed for, so
        // `with_engine` arms it again even for the same deadline (a timer
        // may fire a hair before the deadline it was set for).
        self.state.lock_at_dpc_level(irql).armed = None;
        self.with_engine(irql, |engine, now, fx| {
            engine.on_timeout(now, fx);
        });
    }

    fn comm_established(&self, qpn: Qpn, irql: &impl LeDispatch) -> bool {
        self.with_engine(irql, |engine, now, fx| {
            engine.on_comm_established(now, qpn, fx)
        })
    }
}

impl<P: Platform> CmPort<P> {
    /// Creates the connection manager of `port` on `device`: its own PD,
    /// QP1 with its CQ and MAD buffers (receives posted), the timer, the
    /// delivery DPC, and the engine.
    ///
    /// # Errors
    ///
    /// [`VerbsError::InvalidArgument`] (no such port, zero buffers), and
    /// whatever creating the objects returns. Nothing is left behind on
    /// failure except objects the device reclaims when it closes.
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL` (it allocates and runs firmware commands).
    pub fn create(
        device: &Device<P>,
        port: u8,
        config: CmPortConfig,
        irql: &Passive<'_>,
    ) -> Result<CmPort<P>, VerbsError> {
        let info = device
            .ports()
            .iter()
            .find(|p| p.port == port)
            .cloned()
            .ok_or(VerbsError::InvalidArgument)?;
        if config.recv_buffers == 0 || config.send_buffers == 0 {
            return Err(VerbsError::InvalidArgument);
        }
        let port_mtu = PathMtu::from_code(info.attr.active_mtu as u8)
            .map_err(|_| VerbsError::InvalidArgument)?;
        let cm_config = CmConfig {
            local_gid: info.gid,
            local_ca_guid: device.attr().node_guid,
            port_mtu,
            ..config.cm
        };
        let platform = device.platform().clone();
        let back = Arc::new(Back {
            port: SpinLock::new(Weak::new()),
        });
        let pd = device.alloc_pd(irql)?;
        let recv = config.recv_buffers;
        let send = config.send_buffers;
        let cq = Cq::create(
            device,
            // Every send WQEBB and receive slot (one more each for the
            // drain markers, rounded up to the device's powers of two) may
            // hold a completion.
            CqConfig::new(
                send.saturating_mul(2)
                    .saturating_add(1)
                    .checked_next_power_of_two()
                    .unwrap_or(u32::MAX)
                    .saturating_add(
                        recv.saturating_add(1)
                            .checked_next_power_of_two()
                            .unwrap_or(u32::MAX),
                    ),
            ),
            Arc::new(GsiCompletions {
                back: Arc::clone(&back),
            }),
            irql,
        )?;
        let gsi = Qp::create(
            &pd,
            &QpConfig {
                qp_type: QpType::Gsi,
                send_cq: cq.clone(),
                recv_cq: cq.clone(),
                // A UD send with one SGE takes two WQEBBs.
                send_wqebbs: send.saturating_mul(2),
                recv_slots: recv,
                max_recv_sge: 1,
                port,
            },
            Arc::new(GsiEvents {
                back: Arc::clone(&back),
            }),
            irql,
        )?;
        let mut attr = QpAttr {
            state: QpState::Init,
            pkey_index: 0,
            qkey: GSI_QKEY,
            ..QpAttr::default()
        };
        gsi.modify(
            &attr,
            QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::QKEY,
            irql,
        )?;
        attr.state = QpState::Rtr;
        gsi.modify(&attr, QpAttrMask::STATE, irql)?;
        attr.state = QpState::Rts;
        attr.sq_psn = 0;
        gsi.modify(&attr, QpAttrMask::STATE | QpAttrMask::SQ_PSN, irql)?;
        let recv_mr = Mr::alloc(
            &pd,
            (recv as usize).saturating_mul(RECV_STRIDE),
            AccessFlags::LOCAL_WRITE,
            irql,
        )?;
        let send_mr = Mr::alloc(
            &pd,
            (send as usize).saturating_mul(MAD_LEN),
            AccessFlags::LOCAL_WRITE,
            irql,
        )?;
        let timer = {
            let back = Arc::clone(&back);
            platform.new_timer(
                Box::new(move |d: &Dispatch<'_>| {
                    if let Some(port) = back.get(d) {
                        port.on_timer(d);
                    }
                }),
                irql,
            )?
        };
        let delivery_dpc = {
            let back = Arc::clone(&back);
            platform.new_dpc(
                Box::new(move |d: &Dispatch<'_>| {
                    if let Some(port) = back.get(d) {
                        port.deliver(d);
                    }
                }),
                DpcTarget::Current,
                irql,
            )?
        };
        let engine = CmEngine::new(cm_config);
        let connections = cm_config.connections.clamp(1, usize::from(u16::MAX));
        let listeners = cm_config.listeners.clamp(1, usize::from(u16::MAX));
        let modify_done: Box<[Callback<Result<(), VerbsError>>]> = (0..connections)
            .map(|slot| {
                let back = Arc::clone(&back);
                let done: Callback<Result<(), VerbsError>> = Arc::new(
                    move |result: Result<(), VerbsError>, at: AnyIrql<'_, '_>| match at {
                        AnyIrql::Dispatch(d) => {
                            if let Some(port) = back.get(d) {
                                port.on_modify_done(slot, result, d);
                            }
                        }
                        AnyIrql::Passive(p) => {
                            if let Some(port) = back.get(p) {
                                port.on_modify_done(slot, result, p);
                            }
                        }
                    },
                );
                done
            })
            .collect();
        let state = PortState {
            engine,
            bindings: (0..connections).map(|_| Binding::default()).collect(),
            mailboxes: (0..connections).map(|_| Mailbox::default()).collect(),
            listeners: (0..listeners).map(|_| None).collect(),
            send_free: (0..send).rev().collect(),
            armed: None,
            cursor: 0,
            closing: false,
            stats: CmPortStats::default(),
        };
        let shared = Arc::new(PortShared {
            port,
            gid: info.gid,
            port_mtu,
            packet_lifetime: cm_config.packet_lifetime,
            pd,
            gsi,
            cq,
            recv_mr,
            send_mr,
            state: SpinLock::new(state),
            timer,
            delivery_dpc,
            delivery: AtomicUsize::new(0),
            modify_done,
            trace: config.trace,
            gsi_destroyed: AtomicBool::new(false),
            back: Arc::clone(&back),
        });
        *back.port.lock(irql) = Arc::downgrade(&shared);
        let mut posted = 0;
        for slot in 0..recv {
            posted += u32::from(shared.post_recv(slot, irql));
        }
        let port = CmPort { shared };
        if posted != recv {
            port.close(irql);
            return Err(VerbsError::QueueFull);
        }
        Ok(port)
    }

    /// This port's GID.
    ///
    /// # IRQL
    ///
    /// Any.
    pub fn gid(&self) -> Gid {
        self.shared.gid
    }

    /// This port's active path MTU.
    ///
    /// # IRQL
    ///
    /// Any.
    pub fn port_mtu(&self) -> PathMtu {
        self.shared.port_mtu
    }

    /// QP1's number as the device knows it (1).
    ///
    /// # IRQL
    ///
    /// Any.
    pub fn gsi_qpn(&self) -> u32 {
        self.shared.gsi.qpn()
    }

    /// The counters (a snapshot).
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    pub fn stats(&self, irql: &impl LeDispatch) -> CmPortStats {
        let state = self.shared.state.lock(irql);
        CmPortStats {
            engine: *state.engine.stats(),
            ..state.stats
        }
    }

    /// Connection slots in use (timewait included) (a snapshot).
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    pub fn connections_in_use(&self, irql: &impl LeDispatch) -> usize {
        self.shared.state.lock(irql).engine.connections_in_use()
    }

    /// Connections whose consumer has not had its terminal event yet, and
    /// events not yet delivered (a snapshot; both zero when the port is
    /// quiet for consumers).
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    pub fn pending_consumers(&self, irql: &impl LeDispatch) -> (usize, usize) {
        let state = self.shared.state.lock(irql);
        let bound = state
            .bindings
            .iter()
            .filter(|b| b.handler.is_some())
            .count();
        let undelivered = state.mailboxes.iter().filter(|m| !m.is_empty()).count();
        (bound, undelivered)
    }

    /// The state of connection `id` (`None` once its slot is free).
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    pub fn state(&self, id: CmId, irql: &impl LeDispatch) -> Option<CmState> {
        self.shared.state.lock(irql).engine.state(id)
    }

    /// The local communication ID of connection `id` (what the peer's
    /// messages name it by; for diagnostics and tests).
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    pub fn local_comm_id(&self, id: CmId, irql: &impl LeDispatch) -> Option<u32> {
        self.shared.state.lock(irql).engine.local_comm_id(id)
    }

    /// Wraps a consumer QP's event handler so the CM hears its
    /// "communication established" event (the passive side's fallback when
    /// the RTU is lost). Create the consumer QP with the result.
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL` (it allocates the wrapper).
    pub fn qp_events(&self, inner: Arc<dyn QpHandler>, _irql: &Passive<'_>) -> Arc<dyn QpHandler> {
        Arc::new(CmQpEvents {
            back: Arc::clone(&self.shared.back),
            inner,
        })
    }

    /// Tells the CM the QP `qpn` received its first packet in RTR (for
    /// consumers that route QP events themselves). Returns whether a
    /// connection waiting for its RTU took it.
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    pub fn notify_comm_established(&self, qpn: u32, irql: &impl LeDispatch) -> bool {
        self.shared.comm_established(Qpn::from_low_bits(qpn), irql)
    }

    fn refuse_if_closing(&self, irql: &impl LeDispatch) -> Result<(), CmError> {
        if self.shared.state.lock(irql).closing {
            Err(CmError::Closing)
        } else {
            Ok(())
        }
    }

    /// Connects `qp` (in INIT) as `request` describes; returns at once.
    /// `handler` gets `Established` (REP private data: SRP's
    /// `SRP_LOGIN_RSP`), then one terminal event. The request's QP number
    /// is taken from `qp`.
    ///
    /// # Errors
    ///
    /// As [`CmEngine::connect`]; [`CmError::Closing`] once the port closes.
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL` (no allocation, no blocking).
    pub fn connect(
        &self,
        request: &ConnectRequest<'_>,
        qp: &Arc<dyn CmQp>,
        handler: &Arc<dyn CmHandler>,
        irql: &impl LeDispatch,
    ) -> Result<CmId, CmError> {
        self.refuse_if_closing(irql)?;
        let request = ConnectRequest {
            qp: LocalQp {
                qpn: Qpn::from_low_bits(qp.qpn()),
                starting_psn: request.qp.starting_psn,
            },
            ..*request
        };
        self.shared.with_engine(irql, |engine, now, fx| {
            // Bind first: the REQ may be answered before this returns (on
            // another processor), and the engine picks the slot.
            let id = engine.connect(now, &request, fx)?;
            if let Some(binding) = fx.bindings.get_mut(id.slot()) {
                binding.qp = Some(Arc::clone(qp));
                binding.handler = Some(Arc::clone(handler));
            }
            Ok(id)
        })
    }

    /// Connects over RDMA/CM: service ID from the endpoints' port space and
    /// port, the RDMA/CM header and `user_data` (at most 56 bytes) as REQ
    /// private data, IPv4-mapped GIDs, permissive LIDs, this port's MTU,
    /// the local ACK timeout from the packet lifetime. The source address
    /// must be this port's.
    ///
    /// # Errors
    ///
    /// [`CmError::InvalidParameter`] (source is not this port),
    /// [`CmError::PrivateDataTooLong`] (above 56), and as
    /// [`CmPort::connect`].
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    #[expect(clippy::too_many_arguments, reason = "the connect parameters")]
    pub fn connect_rdma_cm(
        &self,
        endpoints: &RdmaCmEndpoints,
        user_data: &[u8],
        params: ConnParams,
        starting_psn: Option<Psn>,
        qp: &Arc<dyn CmQp>,
        handler: &Arc<dyn CmHandler>,
        irql: &impl LeDispatch,
    ) -> Result<CmId, CmError> {
        if endpoints.local_gid() != self.shared.gid {
            return Err(CmError::InvalidParameter(
                "source address is not this port's",
            ));
        }
        let mut private_data = [0u8; rdma_cm::REQ_PRIVATE_DATA_LEN];
        endpoints.req_private_data(user_data, &mut private_data)?;
        let request = ConnectRequest {
            service_id: endpoints.service_id(),
            peer: endpoints.peer(),
            path: endpoints.path(rdma_cm::ack_timeout_for(self.shared.packet_lifetime)),
            path_mtu: self.shared.port_mtu,
            qp: LocalQp {
                qpn: Qpn::from_low_bits(qp.qpn()),
                starting_psn,
            },
            params,
            private_data: &private_data,
        };
        self.connect(&request, qp, handler, irql)
    }

    /// Listens on `service_id` (RDMA/CM: [`ServiceId::rdma_cm`] with
    /// [`ListenKind::RdmaCm`]).
    ///
    /// # Errors
    ///
    /// As [`CmEngine::listen`]; [`CmError::Closing`].
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    pub fn listen(
        &self,
        service_id: ServiceId,
        kind: ListenKind,
        listener: &Arc<dyn CmListener>,
        irql: &impl LeDispatch,
    ) -> Result<ListenerId, CmError> {
        let mut state = self.shared.state.lock(irql);
        if state.closing {
            return Err(CmError::Closing);
        }
        let id = state.engine.listen(service_id, kind)?;
        match state.listeners.get_mut(id.index()) {
            Some(entry) => *entry = Some(Arc::clone(listener)),
            None => return Err(CmError::NoFreeListener),
        }
        Ok(id)
    }

    /// Stops listening: unanswered requests are rejected (8); no new
    /// listener callback starts after this returns (one already running
    /// finishes).
    ///
    /// # Errors
    ///
    /// [`CmError::UnknownId`].
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    pub fn unlisten(&self, listener: ListenerId, irql: &impl LeDispatch) -> Result<(), CmError> {
        let dropped = self.shared.with_engine(irql, |engine, now, fx| {
            engine.unlisten(now, listener, fx)?;
            // Undelivered requests of this listener go with it.
            for mailbox in fx.mailboxes.iter_mut() {
                if mailbox.request.is_some_and(|r| r.listener == listener) {
                    mailbox.request = None;
                }
                if mailbox.withdrawn.is_some_and(|(l, _, _)| l == listener) {
                    mailbox.withdrawn = None;
                }
            }
            Ok::<(), CmError>(())
        });
        dropped?;
        let mut state = self.shared.state.lock(irql);
        let entry = state.listeners.get_mut(listener.index()).map(Option::take);
        drop(state);
        // The listener's Arc is released here, outside the lock.
        drop(entry);
        Ok(())
    }

    /// Accepts a request with `qp` (in INIT) and REP private data; returns
    /// at once. `handler` gets `Established` (RTU private data), then one
    /// terminal event.
    ///
    /// # Errors
    ///
    /// As [`CmEngine::accept`]; [`CmError::Closing`].
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    pub fn accept(
        &self,
        id: CmId,
        accept: &AcceptRequest<'_>,
        qp: &Arc<dyn CmQp>,
        handler: &Arc<dyn CmHandler>,
        irql: &impl LeDispatch,
    ) -> Result<(), CmError> {
        self.refuse_if_closing(irql)?;
        let accept = AcceptRequest {
            qp: LocalQp {
                qpn: Qpn::from_low_bits(qp.qpn()),
                starting_psn: accept.qp.starting_psn,
            },
            ..*accept
        };
        self.shared.with_engine(irql, |engine, now, fx| {
            // Bind before the engine asks for the RTR modify.
            let slot = id.slot();
            let previous = fx.bindings.get_mut(slot).map(|b| {
                (
                    b.qp.replace(Arc::clone(qp)),
                    b.handler.replace(Arc::clone(handler)),
                )
            });
            let result = engine.accept(now, id, &accept, fx);
            if result.is_err() {
                if let (Some(binding), Some((qp, handler))) = (fx.bindings.get_mut(slot), previous)
                {
                    binding.qp = qp;
                    binding.handler = handler;
                }
            }
            result
        })
    }

    /// Rejects a request (SRP: reason 28 with `SRP_LOGIN_REJ`).
    ///
    /// # Errors
    ///
    /// As [`CmEngine::reject`].
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    pub fn reject(
        &self,
        id: CmId,
        reason: RejectReason,
        private_data: &[u8],
        irql: &impl LeDispatch,
    ) -> Result<(), CmError> {
        self.shared.with_engine(irql, |engine, now, fx| {
            engine.reject(now, id, reason, private_data, fx)
        })
    }

    /// Ends a connection or abandons its setup; returns at once. The
    /// terminal event (`Disconnected`, cause `Local`) follows once the QP
    /// is in ERR — never waiting for the peer's DREP or for timewait.
    ///
    /// # Errors
    ///
    /// As [`CmEngine::disconnect`].
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    pub fn disconnect(
        &self,
        id: CmId,
        private_data: &[u8],
        irql: &impl LeDispatch,
    ) -> Result<(), CmError> {
        self.shared.with_engine(irql, |engine, now, fx| {
            engine.disconnect(now, id, private_data, fx)
        })
    }

    /// Starts closing: no new connect, accept or listen; every listener is
    /// removed (unanswered requests rejected), every connection a consumer
    /// still holds is disconnected (its terminal event follows as usual),
    /// and every DREQ still unanswered stops being retried: its connection
    /// goes to timewait ([`CmEngine::end_disconnect_retries`]). Idempotent.
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    pub fn close(&self, irql: &impl LeDispatch) {
        let listeners = {
            let mut state = self.shared.state.lock(irql);
            state.closing = true;
            state.listeners.len()
        };
        for index in 0..listeners {
            let id = {
                let state = self.shared.state.lock(irql);
                match state.listeners.get(index) {
                    Some(Some(_)) => state.engine.listener_id(index),
                    _ => None,
                }
            };
            if let Some(id) = id {
                let _ = self.unlisten(id, irql);
            }
        }
        for slot in 0..self.shared.modify_done.len() {
            let id = {
                let state = self.shared.state.lock(irql);
                match state.bindings.get(slot) {
                    Some(b) if b.handler.is_some() => state.engine.id_of_slot(slot),
                    _ => None,
                }
            };
            if let Some(id) = id {
                let _ = self.disconnect(id, &[], irql);
            }
        }
        self.shared.with_engine(irql, |engine, now, fx| {
            engine.end_disconnect_retries(now, fx)
        });
    }

    /// Releases the port's objects once it is quiet for consumers: QP1 is
    /// destroyed (its flushed receives are not reposted), then its CQ, the
    /// MAD buffers and the PD. Connections still in timewait are
    /// forgotten. Call after [`CmPort::close`], once every consumer has had
    /// its terminal event ([`CmPort::pending_consumers`] is `(0, 0)`);
    /// QP1's destruction is asynchronous, so call again while it answers
    /// [`CmError::Busy`]. Never blocks.
    ///
    /// # Errors
    ///
    /// [`CmError::Closing`] if the port was not closed first,
    /// [`CmError::WrongState`] while consumers still wait for events,
    /// [`CmError::Busy`] while QP1 is being destroyed.
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL` (firmware commands).
    pub fn release(&self, irql: &Passive<'_>) -> Result<(), CmError> {
        {
            let state = self.shared.state.lock(irql);
            if !state.closing {
                return Err(CmError::Closing);
            }
            let bound = state
                .bindings
                .iter()
                .any(|b| b.handler.is_some() || b.modify_pending > 0);
            let undelivered = state.mailboxes.iter().any(|m| !m.is_empty());
            if bound || undelivered {
                return Err(CmError::WrongState);
            }
        }
        self.shared.timer.cancel(irql);
        if !self.shared.gsi_destroyed.load(Ordering::Acquire) {
            // Idempotent: a second call finds the destroy under way.
            let _ = self.shared.gsi.destroy(irql);
            if !self.shared.gsi_destroyed.load(Ordering::Acquire) {
                return Err(CmError::Busy);
            }
        }
        // Nothing calls into the port any more: QP1 is gone, so its CQ is
        // quiet; a timer expiry already queued finds the back reference
        // empty.
        *self.shared.back.port.lock(irql) = Weak::new();
        let _ = self.shared.cq.destroy(irql);
        let _ = self.shared.recv_mr.dereg(irql);
        let _ = self.shared.send_mr.dereg(irql);
        let _ = self.shared.pd.dealloc(irql);
        Ok(())
    }
}
