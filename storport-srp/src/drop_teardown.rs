//! The teardown of a started transport whose handle is dropped without
//! [`Transport::stop`](crate::miniport::transport::Transport::stop), shared by the
//! SRP and iSER engines.
//!
//! Stopping waits (for disconnects, flushes, releases) and so runs at
//! `PASSIVE_LEVEL`; a `Drop` has no IRQL token, may run at
//! `DISPATCH_LEVEL` (a DPC) and must neither block nor allocate there. So
//! a transport reserves, at creation, a one-slot request queue on its
//! engine's own passive worker ([`DropTeardown::new`]), and its handle
//! keeps everything it owns (the engine, and whatever it owned with it: a
//! [`TearDown`]) in a [`TornDownOnDrop`] with that slot. Dropped while the
//! engine runs, it moves what it kept into the slot; the work item stops
//! it and lets it go, at `PASSIVE_LEVEL`. Moved, not cloned: from the
//! hand-over on, the teardown holds the handle's only references, so the
//! engine is freed there, at `PASSIVE_LEVEL`, however long the dropping
//! thread takes to return (with clones, a drop stalled past the whole
//! teardown would free the engine at the drop's IRQL).
//!
//! The worker needs a work item for this besides the one its engine's slow
//! path uses: the stop waits for the slow path's releases.
//!
//! # IRQL
//! [`DropTeardown::new`] at `PASSIVE_LEVEL`; dropping a [`TornDownOnDrop`]
//! at <= `DISPATCH_LEVEL`, without blocking or allocating;
//! [`TearDown::tear_down`] at `PASSIVE_LEVEL`, on the worker.

use core::marker::PhantomData;
use core::mem::ManuallyDrop;
use core::ops::Deref;

use kverbs::irql::{AnyIrql, Dispatch, Passive};
use kverbs::platform::{AllocError, Platform};
use kverbs::rundown::Rundown;
use kverbs::worker::{CompleteAt, Outcome, RequestQueue, WorkHandler, Worker};

/// What a transport handle owns: the engine, and whatever the handle owned
/// with it.
pub(crate) trait TearDown: Send + 'static {
    /// Whether the engine runs (started, not stopped), so a dropped handle
    /// must have it torn down rather than just let go.
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`; never blocks.
    fn needs_tear_down(&self) -> bool;

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
/// [module docs](self)); [`TornDownOnDrop`] uses it.
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
    fn hand_over(&self, orphan: O) {
        let rejected =
            raised_to_dispatch::<P, _>(|d| self.queue.submit(orphan, CompleteAt::Passive, d).err());
        // Not reached (one slot, used once, never shut down). Were it, the
        // orphan's references would go as a plain drop's do.
        drop(rejected);
    }
}

/// What a transport handle owns, torn down on the engine's worker if the
/// handle is dropped while the engine runs (see the [module docs](self)).
///
/// Reads go through [`Deref`] (no check: what it keeps is there until the
/// drop).
pub(crate) struct TornDownOnDrop<P: Platform, O: TearDown> {
    /// Taken out only by the drop.
    kept: ManuallyDrop<O>,
    /// One slot, for the teardown of a handle dropped with the engine
    /// running.
    slot: DropTeardown<P, O>,
}

impl<P: Platform, O: TearDown> TornDownOnDrop<P, O> {
    /// Keeps `kept`, to be handed to `slot` if dropped while it runs.
    pub(crate) fn new(kept: O, slot: DropTeardown<P, O>) -> Self {
        TornDownOnDrop {
            kept: ManuallyDrop::new(kept),
            slot,
        }
    }
}

impl<P: Platform, O: TearDown> Deref for TornDownOnDrop<P, O> {
    type Target = O;

    #[inline]
    fn deref(&self) -> &O {
        &self.kept
    }
}

impl<P: Platform, O: TearDown> Drop for TornDownOnDrop<P, O> {
    /// Hands what it kept to the teardown if the engine runs, else lets it
    /// go here. Either way nothing of it stays with the handle.
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`; never blocks, never allocates.
    fn drop(&mut self) {
        // SAFETY: `kept` is taken once, here, and not used again: `drop`
        // is the last use of `self`, `Deref` cannot run after it, and a
        // `ManuallyDrop` field is not dropped again with the struct.
        let kept = unsafe { ManuallyDrop::take(&mut self.kept) };
        if kept.needs_tear_down() {
            self.slot.hand_over(kept);
        } else {
            // Never started, or stopped: nothing is connected.
            drop(kept);
        }
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

#[cfg(all(test, feature = "host"))]
mod tests {
    use alloc::sync::{Arc, Weak};
    use core::sync::atomic::{AtomicUsize, Ordering};

    use kverbs::platform::host::HostPlatform;

    use super::*;

    /// Stands for the engine.
    struct Engine;

    /// What a handle keeps: the engine, as the transports keep it.
    struct Kept {
        engine: Arc<Engine>,
        running: bool,
        /// Strong references to the engine when the teardown ran (0: it
        /// has not run).
        seen: Arc<AtomicUsize>,
        /// Armed on the handle's side: where the handle's references are
        /// let go, the dropping thread first stalls for as long as the
        /// whole teardown takes (it runs the worker to idle).
        stall: Option<HostPlatform>,
    }

    impl Drop for Kept {
        fn drop(&mut self) {
            if let Some(platform) = self.stall.take() {
                platform.run_until_idle(&mut |_| 0, 1_000);
            }
        }
    }

    impl TearDown for Kept {
        fn needs_tear_down(&self) -> bool {
            self.running
        }

        fn tear_down(mut self, _irql: &Passive<'_>) {
            self.stall = None;
            self.seen
                .store(Arc::strong_count(&self.engine), Ordering::SeqCst);
        }
    }

    /// A handle on `platform` keeping `running`; with the engine's weak
    /// view and what its teardown will see.
    fn handle(
        platform: &HostPlatform,
        running: bool,
    ) -> (
        TornDownOnDrop<HostPlatform, Kept>,
        Weak<Engine>,
        Arc<AtomicUsize>,
    ) {
        platform.run_passive(|p| {
            let worker = Worker::new(platform, 1, p).unwrap_or_else(|_| panic!("worker"));
            let slot = DropTeardown::new(&worker, p).unwrap_or_else(|_| panic!("slot"));
            let engine = Arc::new(Engine);
            let weak = Arc::downgrade(&engine);
            let seen = Arc::new(AtomicUsize::new(0));
            let kept = Kept {
                engine,
                running,
                seen: Arc::clone(&seen),
                stall: Some(platform.clone()),
            };
            (TornDownOnDrop::new(kept, slot), weak, seen)
        })
    }

    #[test]
    fn dropped_running_the_teardown_holds_the_only_references() {
        let platform = HostPlatform::manual();
        let (handle, engine, seen) = handle(&platform, true);
        assert!(
            handle.needs_tear_down(),
            "reads go through to what it keeps"
        );
        drop(handle);
        // Handed over: the queued teardown is the engine's only owner, and
        // nothing of the handle ran it (a handle left holding references
        // would have stalled and run it, before letting them go).
        assert_eq!(
            (engine.strong_count(), seen.load(Ordering::SeqCst)),
            (1, 0),
            "(owners of the engine, owners the teardown saw) after the drop"
        );
        assert_eq!(platform.run_until_idle(&mut |_| 0, 1_000), 1);
        assert_eq!(
            (engine.strong_count(), seen.load(Ordering::SeqCst)),
            (0, 1),
            "(owners of the engine, owners the teardown saw) after it ran"
        );
        platform.finish();
    }

    #[test]
    fn dropped_stopped_it_goes_at_once() {
        let platform = HostPlatform::manual();
        let (handle, engine, seen) = handle(&platform, false);
        drop(handle);
        assert_eq!(engine.strong_count(), 0, "the plain drop let the engine go");
        assert_eq!(
            platform.run_until_idle(&mut |_| 0, 1_000),
            0,
            "nothing queued"
        );
        assert_eq!(
            seen.load(Ordering::SeqCst),
            0,
            "no teardown for a stopped engine"
        );
        platform.finish();
    }
}
