//! The asynchronous slow path: blocking verbs requested from any IRQL <=
//! `DISPATCH_LEVEL`, run at `PASSIVE_LEVEL` by the passive worker, reported
//! through a callback at the level the caller chose ([`CompleteAt`]).
//!
//! Two shapes, both allocation-free at submission:
//!
//! * Operations on an existing object (modify QP, flush, destroy) carry a
//!   [`Callback`] — an `Arc` the consumer made once at `PASSIVE_LEVEL`;
//!   submitting clones it (a reference count, no allocation) into a slot
//!   of the object's own [`crate::worker::RequestQueue`].
//! * Operations that *create* something (a CQ, a QP, an MR) are prepared
//!   at `PASSIVE_LEVEL` as a [`Job`] — the request with room for its
//!   result — and submitted later, from any IRQL <= `DISPATCH_LEVEL`, to
//!   the device's request queue ([`crate::device::Device::submit`]).
//!
//! Every accepted request completes exactly once: with its result, or with
//! [`crate::error::VerbsError::Cancelled`] if its queue was shut down first.

use alloc::sync::Arc;

use crate::error::VerbsError;
use crate::platform::Platform;
use crate::sync::SpinLock;

pub use crate::irql::AnyIrql;
use crate::irql::Passive;
pub use crate::worker::CompleteAt;
use crate::worker::{Outcome, WorkHandler};

/// A completion callback: called once with the result, at `PASSIVE_LEVEL`
/// or `DISPATCH_LEVEL` as the submitter asked (the token says which).
pub type Callback<T> = Arc<dyn for<'t, 'a> Fn(T, AnyIrql<'t, 'a>) + Send + Sync>;

/// A prepared slow-path request (see the [module docs](self)).
pub trait Job: Send + Sync {
    /// Runs the blocking work.
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL`, on the worker.
    fn run(&self, irql: &Passive<'_>);

    /// Reports the result (`cancelled`: the job never ran).
    ///
    /// # IRQL
    ///
    /// As the submitter asked.
    fn complete(&self, cancelled: bool, irql: AnyIrql<'_, '_>);
}

/// Runs [`Job`]s for a request queue.
pub(crate) struct JobRunner;

impl WorkHandler for JobRunner {
    type Request = Arc<dyn Job>;
    type Output = Arc<dyn Job>;

    fn execute(&self, job: Arc<dyn Job>, irql: &Passive<'_>) -> Arc<dyn Job> {
        job.run(irql);
        job
    }

    fn complete(&self, outcome: Outcome<Arc<dyn Job>, Arc<dyn Job>>, irql: AnyIrql<'_, '_>) {
        match outcome {
            Outcome::Done(job) => job.complete(false, irql),
            Outcome::Cancelled(job) => job.complete(true, irql),
        }
    }
}

/// Where a job keeps its result between `run` and `complete`.
pub(crate) type ResultSlot<T, P> = SpinLock<Option<Result<T, VerbsError>>, P>;

/// Takes a job's result (or `Cancelled`).
pub(crate) fn take_result<P: Platform, T>(
    slot: &ResultSlot<T, P>,
    cancelled: bool,
    irql: &AnyIrql<'_, '_>,
) -> Result<T, VerbsError> {
    let taken = match irql {
        AnyIrql::Passive(p) => slot.lock(*p).take(),
        AnyIrql::Dispatch(d) => slot.lock(*d).take(),
    };
    match (cancelled, taken) {
        (false, Some(r)) => r,
        _ => Err(VerbsError::Cancelled),
    }
}
