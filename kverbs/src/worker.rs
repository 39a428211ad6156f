//! The passive worker: blocking operations requested from any IRQL <=
//! `DISPATCH_LEVEL`, run at `PASSIVE_LEVEL`, reported through a callback.
//!
//! QP modify, memory registration and object create/destroy are firmware
//! commands that wait, so they may only run at `PASSIVE_LEVEL`; StorPort
//! calls us at `DISPATCH_LEVEL`. The NDK answer — "returns pending, calls you
//! back" — is what this module provides:
//!
//! * A [`Worker`] owns a few `IO_WORKITEM`s (its parallelism) and a run
//!   queue of request queues that have work.
//! * Each object owns a [`RequestQueue`] with a fixed number of request
//!   slots, allocated when the object is created (at `PASSIVE_LEVEL`).
//!   [`RequestQueue::submit`] is callable at <= `DISPATCH_LEVEL`, never
//!   allocates, never blocks; a full queue is [`RejectReason::Full`] at once,
//!   with the request handed back.
//! * The worker runs one queue's requests one at a time, in submission
//!   order (a queue is in the run queue at most once and serviced by one
//!   work item at a time), so requests on one object run in the order they
//!   were made; different objects' requests run in parallel up to the
//!   worker's parallelism.
//! * After running a request at `PASSIVE_LEVEL` ([`WorkHandler::execute`]),
//!   the worker reports the outcome through [`WorkHandler::complete`],
//!   either right there at `PASSIVE_LEVEL` or, if the submitter asked
//!   ([`CompleteAt::Dispatch`]), from the queue's DPC at `DISPATCH_LEVEL`.
//! * [`RequestQueue::shutdown`] (at <= `DISPATCH_LEVEL`) cancels what has
//!   not started: each queued request completes with
//!   [`Outcome::Cancelled`] (the request handed back), through the same
//!   path and at the same level its submitter asked for. A request that is
//!   running finishes normally. Every accepted request completes exactly
//!   once; a rejected one never completes.
//! * Each accepted request holds a reference on the owner's [`Rundown`]
//!   until its callback has returned, so the owner's destroy callback comes
//!   after every completion of every request on it.

use alloc::boxed::Box;
use alloc::collections::VecDeque;
use alloc::sync::{Arc, Weak};
use alloc::vec::Vec;
use core::fmt;

use crate::irql::{AnyIrql, Dispatch, LeDispatch, Passive};
use crate::platform::{AllocError, DpcTarget, Platform, RawDpc, RawWorkItem};
use crate::rundown::{OwnedRundownRef, Rundown};
use crate::sync::SpinLock;
use crate::sync::atomic::{AtomicUsize, Ordering};

/// Runs one object's blocking requests and receives their outcomes.
pub trait WorkHandler: Send + Sync + 'static {
    /// A request (e.g. "modify QP to RTS with these attributes").
    type Request: Send + 'static;
    /// What running a request produced (e.g. a status).
    type Output: Send + 'static;

    /// Runs `request`; may block.
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL`, on the worker.
    fn execute(&self, request: Self::Request, irql: &Passive<'_>) -> Self::Output;

    /// Reports the outcome of one accepted request; called exactly once per
    /// request. May submit further requests (the slot is already free).
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL` (worker) or `DISPATCH_LEVEL` (DPC), as the submitter
    /// asked with [`CompleteAt`]; `irql` says which.
    fn complete(&self, outcome: Outcome<Self::Request, Self::Output>, irql: AnyIrql<'_, '_>);
}

/// How an accepted request ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome<R, O> {
    /// It ran; here is what it produced.
    Done(O),
    /// It was cancelled by [`RequestQueue::shutdown`] before it started; the
    /// request is handed back.
    Cancelled(R),
}

/// Where the completion callback of a request runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompleteAt {
    /// On the worker, at `PASSIVE_LEVEL`, right after the request ran.
    Passive,
    /// In the queue's DPC, at `DISPATCH_LEVEL`.
    Dispatch,
}

/// Why [`RequestQueue::submit`] refused a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RejectReason {
    /// Every request slot of the queue is in use.
    Full,
    /// The queue was shut down, or its owner is being destroyed.
    Closed,
}

/// A refused request, handed back to the submitter with the reason.
#[derive(Debug, PartialEq, Eq)]
pub struct Rejected<R> {
    /// Why it was refused.
    pub reason: RejectReason,
    /// The request, unchanged.
    pub request: R,
}

impl<R> fmt::Display for Rejected<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.reason {
            RejectReason::Full => f.write_str("request queue full"),
            RejectReason::Closed => f.write_str("request queue closed"),
        }
    }
}

/// A fixed-capacity FIFO whose storage is allocated once, at creation.
struct Ring<T> {
    slots: Box<[Option<T>]>,
    head: usize,
    len: usize,
}

impl<T> Ring<T> {
    fn with_capacity(capacity: usize) -> Self {
        Ring {
            slots: (0..capacity).map(|_| None).collect(),
            head: 0,
            len: 0,
        }
    }

    fn push(&mut self, value: T) -> Result<(), T> {
        let capacity = self.slots.len();
        if self.len == capacity {
            return Err(value);
        }
        let index = (self.head + self.len) % capacity;
        match self.slots.get_mut(index) {
            Some(slot) => {
                *slot = Some(value);
                self.len += 1;
                Ok(())
            }
            None => Err(value),
        }
    }

    fn pop(&mut self) -> Option<T> {
        if self.len == 0 {
            return None;
        }
        let value = self.slots.get_mut(self.head).and_then(Option::take);
        self.head = (self.head + 1) % self.slots.len();
        self.len -= 1;
        value
    }

    fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Something the worker can give a turn: one request queue.
trait Service: Send + Sync {
    /// Runs (or cancels) the oldest queued request and reports it; `true`
    /// if more requests are queued (the worker requeues the service).
    fn service_one(&self, irql: &Passive<'_>) -> bool;
}

struct WorkerState {
    /// Queues with work, each at most once (their `scheduled` flag).
    run_queue: VecDeque<Arc<dyn Service>>,
    /// Which work items are queued or running.
    busy: Box<[bool]>,
}

struct WorkerShared<P: Platform> {
    platform: P,
    state: SpinLock<WorkerState, P>,
    items: Vec<P::WorkItem>,
    /// Live request queues: the run queue never holds more entries.
    registered: AtomicUsize,
}

/// The passive worker (cheap to clone; clones share it).
pub struct Worker<P: Platform> {
    shared: Arc<WorkerShared<P>>,
}

impl<P: Platform> Clone for Worker<P> {
    fn clone(&self) -> Self {
        Worker {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<P: Platform> fmt::Debug for Worker<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Worker")
            .field("parallelism", &self.shared.items.len())
            .finish_non_exhaustive()
    }
}

impl<P: Platform> Worker<P> {
    /// A worker running up to `parallelism` requests (of different queues)
    /// at once.
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL` (it allocates its work items).
    pub fn new(platform: &P, parallelism: usize, irql: &Passive<'_>) -> Result<Self, AllocError> {
        let parallelism = parallelism.max(1);
        let shared = Arc::new_cyclic(|weak: &Weak<WorkerShared<P>>| {
            let items = (0..parallelism)
                .map_while(|index| {
                    let weak = weak.clone();
                    platform
                        .new_work_item(
                            Box::new(move |p: &Passive<'_>| {
                                if let Some(shared) = weak.upgrade() {
                                    shared.drain(index, p);
                                }
                            }),
                            irql,
                        )
                        .ok()
                })
                .collect::<Vec<_>>();
            WorkerShared {
                platform: platform.clone(),
                state: SpinLock::new(WorkerState {
                    run_queue: VecDeque::new(),
                    busy: (0..parallelism).map(|_| false).collect(),
                }),
                items,
                registered: AtomicUsize::new(0),
            }
        });
        if shared.items.len() != parallelism {
            return Err(AllocError);
        }
        Ok(Worker { shared })
    }

    /// The platform the worker runs on.
    pub fn platform(&self) -> &P {
        &self.shared.platform
    }

    /// Whether no queue is waiting for a turn and no work item is active (a
    /// snapshot).
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    pub fn is_idle(&self, irql: &impl LeDispatch) -> bool {
        let state = self.shared.state.lock(irql);
        state.run_queue.is_empty() && state.busy.iter().all(|b| !b)
    }
}

impl<P: Platform> WorkerShared<P> {
    /// Makes room in the run queue for one more request queue; allocates
    /// outside the spin lock.
    fn register(&self, irql: &Passive<'_>) {
        let needed = self.registered.fetch_add(1, Ordering::AcqRel) + 1;
        loop {
            let capacity = self.state.lock(irql).run_queue.capacity();
            if capacity >= needed {
                return;
            }
            let mut fresh: VecDeque<Arc<dyn Service>> = VecDeque::with_capacity(needed * 2);
            let mut state = self.state.lock(irql);
            if state.run_queue.capacity() >= needed {
                return;
            }
            // `fresh` has room for every entry (at most `needed - 1` live
            // queues are registered), so this moves without allocating.
            while let Some(entry) = state.run_queue.pop_front() {
                fresh.push_back(entry);
            }
            core::mem::swap(&mut state.run_queue, &mut fresh);
            drop(state);
            // `fresh` now holds the old, empty storage; freed here, at
            // PASSIVE_LEVEL.
        }
    }

    fn unregister(&self) {
        self.registered.fetch_sub(1, Ordering::AcqRel);
    }

    /// Gives `service` a turn: appends it to the run queue and starts an
    /// idle work item if there is one.
    fn enqueue(&self, service: Arc<dyn Service>, irql: &impl LeDispatch) {
        let kick = {
            let mut state = self.state.lock(irql);
            // Capacity >= live registered queues >= entries + 1 (this one is
            // not in the queue: its `scheduled` flag was clear), so no
            // allocation happens here.
            state.run_queue.push_back(service);
            let idle = state.busy.iter().position(|b| !b);
            if let Some(index) = idle {
                if let Some(b) = state.busy.get_mut(index) {
                    *b = true;
                }
            }
            idle
        };
        if let Some(item) = kick.and_then(|index| self.items.get(index)) {
            item.queue(irql);
        }
    }

    /// The work-item routine: serves queues until the run queue is empty.
    fn drain(&self, index: usize, irql: &Passive<'_>) {
        loop {
            let next = {
                let mut state = self.state.lock(irql);
                let next = state.run_queue.pop_front();
                if next.is_none() {
                    if let Some(b) = state.busy.get_mut(index) {
                        *b = false;
                    }
                }
                next
            };
            let Some(service) = next else { return };
            if service.service_one(irql) {
                let mut state = self.state.lock(irql);
                state.run_queue.push_back(service);
            }
        }
    }
}

/// An accepted request waiting to run.
struct Queued<P: Platform, H: WorkHandler> {
    request: H::Request,
    at: CompleteAt,
    reference: OwnedRundownRef<P>,
    /// Keeps the queue alive until the request's callback has run.
    keep: Arc<QueueShared<P, H>>,
}

/// A finished request waiting for the DPC to report it.
struct Finished<P: Platform, H: WorkHandler> {
    outcome: Outcome<H::Request, H::Output>,
    reference: OwnedRundownRef<P>,
    keep: Arc<QueueShared<P, H>>,
}

struct QueueState<P: Platform, H: WorkHandler> {
    queued: Ring<Queued<P, H>>,
    finished: Ring<Finished<P, H>>,
    /// Accepted requests whose callback has not started.
    in_use: usize,
    capacity: usize,
    /// In the worker's run queue or being served.
    scheduled: bool,
    closing: bool,
}

struct QueueShared<P: Platform, H: WorkHandler> {
    handler: H,
    worker: Arc<WorkerShared<P>>,
    rundown: Arc<Rundown<P>>,
    state: SpinLock<QueueState<P, H>, P>,
    dpc: Option<P::Dpc>,
    me: Weak<QueueShared<P, H>>,
}

/// One object's request queue (see the [module docs](self)).
pub struct RequestQueue<P: Platform, H: WorkHandler> {
    shared: Arc<QueueShared<P, H>>,
}

impl<P: Platform, H: WorkHandler> fmt::Debug for RequestQueue<P, H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RequestQueue").finish_non_exhaustive()
    }
}

impl<P: Platform, H: WorkHandler> RequestQueue<P, H> {
    /// A queue with `capacity` request slots on `worker`, for the object
    /// protected by `rundown`.
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL` (it allocates the slots and the DPC).
    pub fn new(
        worker: &Worker<P>,
        handler: H,
        capacity: usize,
        rundown: Arc<Rundown<P>>,
        irql: &Passive<'_>,
    ) -> Result<Self, AllocError> {
        let capacity = capacity.max(1);
        let platform = worker.shared.platform.clone();
        let shared = Arc::new_cyclic(|weak: &Weak<QueueShared<P, H>>| {
            let dpc_weak = weak.clone();
            let dpc = platform
                .new_dpc(
                    Box::new(move |d: &Dispatch<'_>| {
                        if let Some(queue) = dpc_weak.upgrade() {
                            queue.deliver_finished(d);
                        }
                    }),
                    DpcTarget::Current,
                    irql,
                )
                .ok();
            QueueShared {
                handler,
                worker: Arc::clone(&worker.shared),
                rundown,
                state: SpinLock::new(QueueState {
                    queued: Ring::with_capacity(capacity),
                    finished: Ring::with_capacity(capacity),
                    in_use: 0,
                    capacity,
                    scheduled: false,
                    closing: false,
                }),
                dpc,
                me: weak.clone(),
            }
        });
        if shared.dpc.is_none() {
            return Err(AllocError);
        }
        shared.worker.register(irql);
        Ok(RequestQueue { shared })
    }

    /// Queues `request` to run at `PASSIVE_LEVEL` on the worker; its
    /// callback runs at the level `at` asks for. Never blocks, never
    /// allocates; a full or closed queue hands the request back at once.
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    pub fn submit(
        &self,
        request: H::Request,
        at: CompleteAt,
        irql: &impl LeDispatch,
    ) -> Result<(), Rejected<H::Request>> {
        let shared = &self.shared;
        let Some(reference) = shared.rundown.acquire_owned() else {
            return Err(Rejected {
                reason: RejectReason::Closed,
                request,
            });
        };
        let Some(keep) = shared.me.upgrade() else {
            return Err(Rejected {
                reason: RejectReason::Closed,
                request,
            });
        };
        let schedule = {
            let mut state = shared.state.lock(irql);
            let reason = if state.closing {
                Some(RejectReason::Closed)
            } else if state.in_use >= state.capacity {
                Some(RejectReason::Full)
            } else {
                None
            };
            if let Some(reason) = reason {
                drop(state);
                // `reference` and `keep` drop here, outside the lock.
                return Err(Rejected { reason, request });
            }
            let entry = Queued {
                request,
                at,
                reference,
                keep,
            };
            match state.queued.push(entry) {
                Ok(()) => {}
                Err(entry) => {
                    // Unreachable while `in_use` counts queued entries; kept
                    // total rather than trusted.
                    drop(state);
                    return Err(Rejected {
                        reason: RejectReason::Full,
                        request: entry.request,
                    });
                }
            }
            state.in_use += 1;
            !core::mem::replace(&mut state.scheduled, true)
        };
        if schedule {
            self.give_turn(irql);
        }
        Ok(())
    }

    /// Cancels every request that has not started: each completes with
    /// [`Outcome::Cancelled`] (asynchronously, at the level its submitter
    /// asked for); later submissions are refused with
    /// [`RejectReason::Closed`]. Idempotent.
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    pub fn shutdown(&self, irql: &impl LeDispatch) {
        let schedule = {
            let mut state = self.shared.state.lock(irql);
            state.closing = true;
            !state.queued.is_empty() && !core::mem::replace(&mut state.scheduled, true)
        };
        if schedule {
            self.give_turn(irql);
        }
    }

    /// Accepted requests whose callback has not started yet (a snapshot).
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    pub fn in_use(&self, irql: &impl LeDispatch) -> usize {
        self.shared.state.lock(irql).in_use
    }

    /// The handler.
    pub fn handler(&self) -> &H {
        &self.shared.handler
    }

    fn give_turn(&self, irql: &impl LeDispatch) {
        let service: Arc<dyn Service> = self.shared.clone();
        self.shared.worker.enqueue(service, irql);
    }
}

impl<P: Platform, H: WorkHandler> QueueShared<P, H> {
    /// The queue DPC: reports finished requests at `DISPATCH_LEVEL`.
    fn deliver_finished(&self, irql: &Dispatch<'_>) {
        loop {
            let next = {
                let mut state = self.state.lock_at_dpc_level(irql);
                let next = state.finished.pop();
                if next.is_some() {
                    state.in_use -= 1;
                }
                next
            };
            let Some(Finished {
                outcome,
                reference,
                keep,
            }) = next
            else {
                return;
            };
            self.handler.complete(outcome, AnyIrql::Dispatch(irql));
            drop(reference);
            drop(keep);
        }
    }
}

impl<P: Platform, H: WorkHandler> Service for QueueShared<P, H> {
    fn service_one(&self, irql: &Passive<'_>) -> bool {
        let (entry, cancel) = {
            let mut state = self.state.lock(irql);
            match state.queued.pop() {
                Some(entry) => (entry, state.closing),
                None => {
                    state.scheduled = false;
                    return false;
                }
            }
        };
        let Queued {
            request,
            at,
            reference,
            keep,
        } = entry;
        let outcome = if cancel {
            Outcome::Cancelled(request)
        } else {
            Outcome::Done(self.handler.execute(request, irql))
        };
        match at {
            CompleteAt::Passive => {
                self.state.lock(irql).in_use -= 1;
                self.handler.complete(outcome, AnyIrql::Passive(irql));
                drop(reference);
                drop(keep);
            }
            CompleteAt::Dispatch => {
                let rejected = self
                    .state
                    .lock(irql)
                    .finished
                    .push(Finished {
                        outcome,
                        reference,
                        keep,
                    })
                    .err();
                match rejected {
                    None => {
                        if let Some(dpc) = &self.dpc {
                            dpc.queue();
                        }
                    }
                    // Unreachable: `finished` has a slot per accepted
                    // request. Report at PASSIVE rather than lose it.
                    Some(Finished {
                        outcome,
                        reference,
                        keep,
                    }) => {
                        self.state.lock(irql).in_use -= 1;
                        self.handler.complete(outcome, AnyIrql::Passive(irql));
                        drop(reference);
                        drop(keep);
                    }
                }
            }
        }
        let mut state = self.state.lock(irql);
        let more = !state.queued.is_empty();
        if !more {
            state.scheduled = false;
        }
        more
    }
}

impl<P: Platform, H: WorkHandler> Drop for QueueShared<P, H> {
    fn drop(&mut self) {
        self.worker.unregister();
    }
}
