//! Object lifetime: run-down protection with an asynchronous, bounded destroy.
//!
//! Two mechanisms keep a kverbs object safe while callbacks race its
//! teardown:
//!
//! * **Memory** is reference counted (`Arc`); DPCs and work items capture
//!   `Weak` references, so nothing is freed while a routine can still touch
//!   it, and a routine that finds its owner gone does nothing.
//! * **Callbacks** are fenced by run-down protection (NT's `EX_RUNDOWN_REF`):
//!   every entry into an object's callbacks — a CQ handler, a worker
//!   completion, a timer — first acquires a run-down reference. [`Rundown::destroy`]
//!   stops new acquisitions and returns at once (callable at
//!   <= `DISPATCH_LEVEL`); when the last outstanding reference is released,
//!   the destroy callback runs **once**, in a DPC. Since no acquisition can
//!   succeed after destroy starts, no callback for the object ever runs
//!   after its destroy callback — the guarantee NDK gives for close ("all
//!   callbacks have returned").
//!
//! Destroy is bounded by the callbacks in flight: it never waits on a
//! thread, and the destroy callback never runs inline inside `destroy` or
//! inside a release (it is always a fresh DPC), so a caller may destroy an
//! object from within one of that object's callbacks.

use core::fmt;

use alloc::boxed::Box;
use alloc::sync::Arc;

use crate::irql::{Dispatch, Passive};
use crate::platform::{AllocError, DpcTarget, Platform, RawDpc};
use crate::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Bit 0 of the state: run-down has started.
const ACTIVE: usize = 1;
/// One reference, counted in the bits above [`ACTIVE`].
const ONE_REF: usize = 2;

/// The run-down counter (`EX_RUNDOWN_REF`), platform-free.
///
/// # Invariants
///
/// `state = references * 2 + active`. Once `active` is set it stays set, so
/// the transition to "active with no references" happens exactly once, and
/// exactly one caller (of [`RundownRef::begin`] or [`RundownRef::release`])
/// observes it.
#[derive(Debug, Default)]
pub struct RundownRef {
    state: AtomicUsize,
}

/// Run-down had already started.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AlreadyRunningDown;

impl fmt::Display for AlreadyRunningDown {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("run-down already started")
    }
}

impl RundownRef {
    /// A counter with no references, not running down.
    pub fn new() -> Self {
        RundownRef {
            state: AtomicUsize::new(0),
        }
    }

    /// Takes a reference unless run-down has started
    /// (`ExAcquireRundownProtection`).
    ///
    /// # IRQL
    ///
    /// Any.
    #[inline]
    pub fn try_acquire(&self) -> bool {
        let mut current = self.state.load(Ordering::Relaxed);
        loop {
            if current & ACTIVE != 0 {
                return false;
            }
            let Some(next) = current.checked_add(ONE_REF) else {
                return false;
            };
            match self.state.compare_exchange_weak(
                current,
                next,
                Ordering::Acquire,
                Ordering::Relaxed,
            ) {
                Ok(_) => return true,
                Err(actual) => current = actual,
            }
        }
    }

    /// Drops a reference (`ExReleaseRundownProtection`); `true` if this was
    /// the last one after run-down started: the caller must then complete
    /// the run-down.
    ///
    /// # IRQL
    ///
    /// Any.
    #[inline]
    pub fn release(&self) -> bool {
        let previous = self.state.fetch_sub(ONE_REF, Ordering::AcqRel);
        debug_assert!(previous >= ONE_REF, "run-down reference released twice");
        previous == ACTIVE | ONE_REF
    }

    /// Starts run-down: later acquisitions fail. `Ok(true)` if no reference
    /// was outstanding (the caller completes the run-down now), `Ok(false)`
    /// if the last [`RundownRef::release`] will report it.
    ///
    /// # IRQL
    ///
    /// Any.
    pub fn begin(&self) -> Result<bool, AlreadyRunningDown> {
        let previous = self.state.fetch_or(ACTIVE, Ordering::AcqRel);
        if previous & ACTIVE != 0 {
            return Err(AlreadyRunningDown);
        }
        Ok(previous == 0)
    }

    /// Whether run-down has started.
    pub fn is_running_down(&self) -> bool {
        self.state.load(Ordering::Acquire) & ACTIVE != 0
    }

    /// References outstanding now (a snapshot).
    pub fn references(&self) -> usize {
        self.state.load(Ordering::Acquire) / ONE_REF
    }
}

/// Run-down protection for one object, with its destroy callback.
///
/// Create it with the object (at `PASSIVE_LEVEL`); fence every callback with
/// [`Rundown::acquire`] or hold an [`OwnedRundownRef`] for work that outlives
/// a call (a queued worker request); call [`Rundown::destroy`] to tear down.
pub struct Rundown<P: Platform> {
    counter: RundownRef,
    destroy_dpc: P::Dpc,
}

impl<P: Platform> fmt::Debug for Rundown<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rundown")
            .field("counter", &self.counter)
            .finish_non_exhaustive()
    }
}

impl<P: Platform> Rundown<P> {
    /// Creates the protection; `on_destroyed` runs once, at
    /// `DISPATCH_LEVEL` in a DPC, after [`Rundown::destroy`] and once every
    /// reference is released.
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL` (it allocates the destroy DPC).
    pub fn new(
        platform: &P,
        on_destroyed: impl for<'a> Fn(&Dispatch<'a>) + Send + Sync + 'static,
        irql: &Passive<'_>,
    ) -> Result<Arc<Self>, AllocError> {
        let fired = AtomicBool::new(false);
        let destroy_dpc = platform.new_dpc(
            Box::new(move |d: &Dispatch<'_>| {
                // The DPC is queued once (the run-down completes once); the
                // flag makes "once" independent of the platform too.
                if !fired.swap(true, Ordering::AcqRel) {
                    on_destroyed(d);
                }
            }),
            DpcTarget::Current,
            irql,
        )?;
        Ok(Arc::new(Rundown {
            counter: RundownRef::new(),
            destroy_dpc,
        }))
    }

    /// Enters the object for the scope of the guard; `None` once destroy has
    /// started (the caller must then skip the callback).
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    pub fn acquire(&self) -> Option<RundownGuard<'_, P>> {
        // `then`, not `then_some`: the guard must not exist (and release on
        // drop) unless the acquisition succeeded.
        self.counter
            .try_acquire()
            .then(|| RundownGuard { rundown: self })
    }

    /// A reference that can be stored (with a queued request, say) and is
    /// released when dropped; `None` once destroy has started.
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    pub fn acquire_owned(self: &Arc<Self>) -> Option<OwnedRundownRef<P>> {
        self.counter.try_acquire().then(|| OwnedRundownRef {
            rundown: Arc::clone(self),
        })
    }

    /// Starts the destroy: no new reference can be taken; the destroy
    /// callback runs in a DPC once the outstanding ones are released (at
    /// once if there are none). Never blocks, never runs the callback
    /// inline.
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    pub fn destroy(&self) -> Result<(), AlreadyRunningDown> {
        if self.counter.begin()? {
            self.complete();
        }
        Ok(())
    }

    /// Whether destroy has started.
    pub fn is_destroying(&self) -> bool {
        self.counter.is_running_down()
    }

    /// References outstanding now (a snapshot).
    pub fn references(&self) -> usize {
        self.counter.references()
    }

    fn release(&self) {
        if self.counter.release() {
            self.complete();
        }
    }

    fn complete(&self) {
        let queued = self.destroy_dpc.queue();
        debug_assert!(queued, "the destroy DPC was queued twice");
    }
}

/// A scoped run-down reference: the object's callbacks may run while it is
/// held.
#[must_use = "the reference is released immediately when unused"]
pub struct RundownGuard<'a, P: Platform> {
    rundown: &'a Rundown<P>,
}

impl<P: Platform> Drop for RundownGuard<'_, P> {
    fn drop(&mut self) {
        self.rundown.release();
    }
}

/// An owned run-down reference, released on drop (at any IRQL <=
/// `DISPATCH_LEVEL`; the destroy callback it may trigger runs in a DPC).
pub struct OwnedRundownRef<P: Platform> {
    rundown: Arc<Rundown<P>>,
}

impl<P: Platform> OwnedRundownRef<P> {
    /// The protection this reference belongs to.
    pub fn rundown(&self) -> &Arc<Rundown<P>> {
        &self.rundown
    }
}

impl<P: Platform> fmt::Debug for OwnedRundownRef<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OwnedRundownRef").finish_non_exhaustive()
    }
}

impl<P: Platform> Drop for OwnedRundownRef<P> {
    fn drop(&mut self) {
        self.rundown.release();
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn counter_transitions_once() {
        let r = RundownRef::new();
        assert!(r.try_acquire());
        assert!(r.try_acquire());
        assert_eq!(r.references(), 2);
        assert!(!r.release(), "not running down: no completion");
        assert_eq!(r.begin(), Ok(false), "one reference still out");
        assert_eq!(r.begin(), Err(AlreadyRunningDown));
        assert!(!r.try_acquire(), "acquisition after begin must fail");
        assert!(r.release(), "the last release completes the run-down");
        assert_eq!(r.references(), 0);
    }

    #[test]
    fn begin_without_references_completes_at_once() {
        let r = RundownRef::new();
        assert_eq!(r.begin(), Ok(true));
        assert!(r.is_running_down());
        assert!(!r.try_acquire());
    }
}
