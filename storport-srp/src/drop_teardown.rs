//! The teardown of a started transport whose handle is dropped without
//! [`Transport::stop`](crate::miniport::transport::Transport::stop), shared by the
//! SRP and iSER engines.
//!
//! Stopping waits (for disconnects, flushes, releases) and so runs at
//! `PASSIVE_LEVEL`; a `Drop` has no IRQL token, may run at
//! `DISPATCH_LEVEL` (a DPC) and must neither block nor allocate there. So
//! a transport reserves, at creation, a one-slot request queue on its
//! engine's own passive worker ([`DropTeardown::new`]); its `Drop` hands
//! what the handle kept running (a [`TearDown`]: the engine and whatever
//! the handle owned with it) to that queue ([`DropTeardown::hand_over`]),
//! and the work item stops it and lets it go, at `PASSIVE_LEVEL`.
//!
//! The worker needs a work item for this besides the one its engine's slow
//! path uses: the stop waits for the slow path's releases.
//!
//! # IRQL
//! [`DropTeardown::new`] at `PASSIVE_LEVEL`; [`DropTeardown::hand_over`]
//! at <= `DISPATCH_LEVEL`, without blocking or allocating;
//! [`TearDown::tear_down`] at `PASSIVE_LEVEL`, on the worker.

use core::marker::PhantomData;

use kverbs::irql::{AnyIrql, Dispatch, Passive};
use kverbs::platform::{AllocError, Platform};
use kverbs::rundown::Rundown;
use kverbs::worker::{CompleteAt, Outcome, RequestQueue, WorkHandler, Worker};

/// What a started handle dropped without `stop()` leaves running.
pub(crate) trait TearDown: Send + 'static {
    /// Stops it as `Transport::stop` does (every connection ended, every
    /// command in flight completed once, no upcall after), then lets it
    /// go, here.
    ///
    /// # IRQL
    /// `PASSIVE_LEVEL` (the engine's worker); waits, bounded.
    fn tear_down(self, irql: &Passive<'_>);
}

/// Runs a [`TearDown`] on the worker.
struct Runner<O>(PhantomData<fn() -> O>);

impl<O: TearDown> WorkHandler for Runner<O> {
    type Request = O;
    type Output = ();

    fn execute(&self, orphan: O, irql: &Passive<'_>) {
        orphan.tear_down(irql);
    }

    fn complete(&self, outcome: Outcome<O, ()>, _irql: AnyIrql<'_, '_>) {
        // `Done`: nothing is left. `Cancelled` cannot happen (nothing shuts
        // the queue down); were it to, the orphan drops here, at
        // `PASSIVE_LEVEL` (it completes there), as a plain drop's would.
        drop(outcome);
    }
}

/// A handle's reserved slot for its own teardown (see the
/// [module docs](self)).
pub(crate) struct DropTeardown<P: Platform, O: TearDown> {
    queue: RequestQueue<P, Runner<O>>,
}

impl<P: Platform, O: TearDown> DropTeardown<P, O> {
    /// One request slot on `worker`, which must have a work item to spare
    /// for it (see the [module docs](self)).
    ///
    /// # Errors
    /// The queue or its rundown could not be allocated.
    ///
    /// # IRQL
    /// `PASSIVE_LEVEL` (allocates).
    pub(crate) fn new(worker: &Worker<P>, irql: &Passive<'_>) -> Result<Self, AllocError> {
        let rundown = Rundown::new(worker.platform(), |_: &Dispatch<'_>| {}, irql)?;
        let queue = RequestQueue::new(worker, Runner(PhantomData), 1, rundown, irql)?;
        Ok(DropTeardown { queue })
    }

    /// Queues `orphan`'s teardown (from a `Drop`, which has no IRQL token).
    /// Use once per handle: the one slot is then taken.
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`; never blocks, never allocates.
    pub(crate) fn hand_over(&self, orphan: O) {
        let rejected =
            raised_to_dispatch::<P, _>(|d| self.queue.submit(orphan, CompleteAt::Passive, d).err());
        // Not reached (one slot, used once, never shut down). Were it, the
        // orphan's references would go as a plain drop's do.
        drop(rejected);
    }
}

/// Runs `f` at `DISPATCH_LEVEL` from a context that holds no IRQL token
/// (a `Drop`).
///
/// # IRQL
/// <= `DISPATCH_LEVEL`.
pub(crate) fn raised_to_dispatch<P: Platform, R>(f: impl for<'t> FnOnce(&Dispatch<'t>) -> R) -> R {
    // SAFETY: lowered below, after `f` returns (LIFO: `f` undoes its own
    // raises); the caller runs at <= DISPATCH_LEVEL (contract above).
    let old = unsafe { P::raise_to_dispatch() };
    let result = {
        // SAFETY: the raise above holds this processor at DISPATCH_LEVEL
        // until the lower below; the token does not outlive `f`.
        let token = unsafe { Dispatch::assume::<P>() };
        f(&token)
    };
    // SAFETY: `old` is what the matching raise returned.
    unsafe { P::lower_irql(old) };
    result
}
