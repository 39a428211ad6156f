//! Completion delivery without recursion: one drain loop per completion
//! queue.
//!
//! A completion handler often posts new work (a response frees a credit, the
//! next command goes out), and on a fast or software HCA that work can
//! complete at once — even inline, during the doorbell write. Delivering that
//! completion by calling the handler again from inside the post would nest
//! handler → post → handler on one stack without bound (the WinOF recursion).
//! Here, every path that wants completions delivered goes through one
//! [`DrainLoop`] per queue:
//!
//! * if no drain is running, the caller becomes the drainer (in a DPC, or
//!   inline via [`DpcDrainer::drain_inline`]);
//! * if one is running — including the one whose handler is on the stack
//!   right now — the caller only sets a "notified" bit and returns; the
//!   running loop polls again before it finishes.
//!
//! So the stack depth is that of one loop iteration whatever the chain
//! length. A DPC drains under a [`Budget`] (count and time) and requeues
//! itself when the budget runs out, instead of looping at `DISPATCH_LEVEL`
//! (the DPC watchdog). When the source runs dry the loop arms it with
//! "report missed events" semantics and then polls once more, so a
//! completion that lands between the last poll and the arm is never
//! stranded (the race of the old Windows SRP initiator, which polled then
//! armed with no re-poll).
//!
//! # State machine
//!
//! `state` holds two bits, `RUNNING` and `NOTIFIED`:
//!
//! | state | meaning |
//! |---|---|
//! | 0 | idle: the source is armed (or about to be) |
//! | `NOTIFIED` | a drain is owed: a DPC is queued (or about to be) |
//! | `RUNNING` | a loop is draining |
//! | `RUNNING \| NOTIFIED` | draining, and told to poll again before leaving |
//!
//! [`DrainLoop::notify`] sets `NOTIFIED` and schedules a DPC only on the
//! 0 → `NOTIFIED` edge; a loop enters by writing exactly `RUNNING`
//! (clearing `NOTIFIED` for its first poll), clears `NOTIFIED` before each
//! further poll, and leaves only by a compare-exchange `RUNNING` → 0, which
//! fails if a notification came in meanwhile.

use core::fmt;

use alloc::boxed::Box;
use alloc::sync::{Arc, Weak};

mod batch;
pub use batch::PollBatch;

use crate::irql::{Dispatch, LeDispatch, Passive};
use crate::platform::{AllocError, DpcTarget, Platform, RawDpc, Ticks};
use crate::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use crate::sync::with_dispatch;

/// Completions polled per batch (Linux `IB_POLL_BATCH`).
pub const POLL_BATCH: usize = 16;

const RUNNING: usize = 0b10;
const NOTIFIED: usize = 0b01;

/// Result of arming a completion source for its next event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArmOutcome {
    /// Armed; the next completion raises an event.
    Armed,
    /// Completions may have arrived since the last poll (the
    /// `IB_CQ_REPORT_MISSED_EVENTS` answer): poll again.
    MissedEvents,
}

/// What the drain loop needs from a completion queue.
///
/// Poll and arm are called only by the single running drain loop, so a
/// source sees them serialised (the NDK rule for `NdkGetCqResults` and
/// `NdkArmCq`).
pub trait CompletionSource {
    /// One completion (a work completion).
    type Completion;

    /// Moves up to `out`'s free capacity of completions into `out` (it is
    /// empty when the drain loop calls), in the order they completed.
    ///
    /// Filling less than the capacity means the source was empty at some
    /// point during the call: the drain loop then goes on to arm without
    /// polling again (a completion that lands after that point is found by
    /// the arm's [`ArmOutcome::MissedEvents`] or the poll after the arm).
    ///
    /// # IRQL
    ///
    /// `DISPATCH_LEVEL`; must not block.
    fn poll(&self, out: &mut PollBatch<Self::Completion>, irql: &Dispatch<'_>);

    /// Requests an event for the next completion, reporting whether some may
    /// have been missed since the last poll.
    ///
    /// # IRQL
    ///
    /// `DISPATCH_LEVEL`; must not block.
    fn arm(&self, irql: &Dispatch<'_>) -> ArmOutcome;

    /// Whether [`Self::arm`] answers [`ArmOutcome::MissedEvents`] for every
    /// completion that landed before the arm took effect (it looks at the
    /// queue after arming, as the CQ does). Then a completion either is
    /// seen by that look or lands while armed and raises an event, and
    /// the drain loop leaves right after an `Armed` answer; otherwise
    /// (the default) it polls once more after arming, which costs every
    /// round an empty poll.
    fn arm_reports_missed_events(&self) -> bool {
        false
    }
}

/// Receives completions from the drain loop.
pub trait CompletionHandler<C> {
    /// Handles one completion. May post new work, and may call
    /// [`DrainLoop::notify`] / [`DpcDrainer::notify`] (directly or through an
    /// inline completion) — that never nests a second delivery.
    ///
    /// # IRQL
    ///
    /// `DISPATCH_LEVEL`.
    fn on_completion(&self, completion: C, irql: &Dispatch<'_>);

    /// Handles the completions of one poll, in poll order: what a handler
    /// with per-batch work (a lookup, a lock) overrides to do that work once
    /// per batch instead of once per completion. The default hands each to
    /// [`Self::on_completion`]. Whatever an override leaves in `batch` is
    /// then handed to [`Self::on_completion`] one by one, so none is lost.
    ///
    /// # IRQL
    ///
    /// `DISPATCH_LEVEL`.
    fn on_batch(&self, batch: &mut Polled<'_, C>, irql: &Dispatch<'_>) {
        for completion in batch {
            self.on_completion(completion, irql);
        }
    }
}

/// The completions of one poll, yielded in poll order (see
/// [`CompletionHandler::on_batch`]).
pub struct Polled<'a, C> {
    batch: &'a mut PollBatch<C>,
}

impl<C> Polled<'_, C> {
    /// Completions not yet taken.
    pub fn remaining(&self) -> usize {
        self.batch.len()
    }

    /// The batch itself, for a crate-internal view over it (the CQ's
    /// [`crate::cq::WorkCompletions`]).
    pub(crate) fn batch_mut(&mut self) -> &mut PollBatch<C> {
        self.batch
    }
}

impl<C> Iterator for Polled<'_, C> {
    type Item = C;

    #[inline]
    fn next(&mut self) -> Option<C> {
        self.batch.take()
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.batch.len(), Some(self.batch.len()))
    }
}

impl<C> fmt::Debug for Polled<'_, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Polled")
            .field("remaining", &self.batch.len())
            .finish()
    }
}

/// How much one drain pass may do before yielding the processor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budget {
    /// Completions per pass (Linux `IB_POLL_BUDGET_IRQ` is 256).
    pub completions: usize,
    /// Time per pass, in platform ticks, checked between batches. The
    /// clock starts after the pass's first batch, and only once the pass is
    /// more than one short batch (so a pass that goes idle after one short
    /// batch reads no clock): the first batch's own time is not counted.
    pub ticks: u64,
}

impl Budget {
    /// No limit (for tests and inline drains that must empty the queue).
    pub const UNLIMITED: Budget = Budget {
        completions: usize::MAX,
        ticks: u64::MAX,
    };
}

/// How a drain pass ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DrainOutcome {
    /// The source is empty and armed; the loop is idle.
    Idle {
        /// Completions delivered by this pass.
        delivered: usize,
    },
    /// The budget ran out with completions possibly left: the caller must
    /// schedule another pass (a DPC requeues itself). The state is
    /// `NOTIFIED`, so notifications until then do not schedule twice.
    BudgetExhausted {
        /// Completions delivered by this pass.
        delivered: usize,
    },
    /// Another loop is running; it was told to poll again.
    Busy,
}

/// The per-queue drain state machine (platform-free; see the
/// [module docs](self)).
#[derive(Debug, Default)]
pub struct DrainLoop {
    state: AtomicUsize,
}

impl DrainLoop {
    /// An idle loop.
    pub fn new() -> Self {
        DrainLoop {
            state: AtomicUsize::new(0),
        }
    }

    /// Records that completions may be waiting (a completion event, or an
    /// inline completion). `true` if the caller must schedule a drain (a
    /// DPC); `false` if one is scheduled or running and will see them.
    ///
    /// # IRQL
    ///
    /// Any.
    pub fn notify(&self) -> bool {
        self.state.fetch_or(NOTIFIED, Ordering::AcqRel) == 0
    }

    /// Whether a loop is running now (a snapshot).
    pub fn is_running(&self) -> bool {
        self.state.load(Ordering::Acquire) & RUNNING != 0
    }

    /// Drains `source` into `handler` until the source is empty and armed
    /// (then [`DrainOutcome::Idle`]) or the budget runs out.
    ///
    /// `now` is the clock the time budget is measured with.
    ///
    /// # IRQL
    ///
    /// `DISPATCH_LEVEL`.
    // Inline: into the DPC routine it saves a call and the spill of its
    // six arguments on every drain round (every completion round at QD 1).
    // `always`, like the whole per-round chain (`deliver`, `CqCore::poll`,
    // `CqDeliver::on_batch`, `CqCore::arm`): under the plain hint the
    // inliner's size budget split the chain into calls as soon as one link
    // grew (the arm's inlined doorbell write pushed out `run`, then
    // `deliver`, then `poll` and `on_batch`), some 30 instructions per
    // round each. One instance per CQ type: one DPC routine's worth of code.
    #[inline(always)]
    pub fn run<S, H>(
        &self,
        source: &S,
        handler: &H,
        budget: Budget,
        now: impl Fn() -> Ticks,
        irql: &Dispatch<'_>,
    ) -> DrainOutcome
    where
        S: CompletionSource + ?Sized,
        H: CompletionHandler<S::Completion> + ?Sized,
    {
        // Enter: from idle or notified become the runner; if a loop runs,
        // tell it to poll again.
        let mut current = self.state.load(Ordering::Acquire);
        loop {
            if current & RUNNING != 0 {
                if self.state.fetch_or(NOTIFIED, Ordering::AcqRel) & RUNNING != 0 {
                    return DrainOutcome::Busy;
                }
                // The runner left between the load and the `or`; retry.
                current = self.state.load(Ordering::Acquire);
                continue;
            }
            match self.state.compare_exchange_weak(
                current,
                RUNNING,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => break,
                Err(actual) => current = actual,
            }
        }

        // The time budget's clock starts when a pass turns out to be more
        // than one short batch (a full batch, or a poll after one that
        // delivered): a pass that delivers one short batch and goes idle —
        // every pass at low queue depth — reads no clock at all.
        let mut clock: Option<Ticks> = None;
        let mut delivered = 0usize;
        let mut batch: PollBatch<S::Completion> = PollBatch::new();
        // The enter above left the state exactly `RUNNING`: NOTIFIED is
        // clear for the first poll (so a pass clears it only before a
        // poll again, not on every round).
        loop {
            'again: {
                let polled = deliver(source, handler, &mut batch, irql);
                if polled > 0 {
                    // `delivered != 0`: an earlier poll of this pass
                    // delivered, so this one is its second at least.
                    let out_of_time = (polled == POLL_BATCH || delivered != 0) && {
                        let t = now();
                        t.since(*clock.get_or_insert(t)) >= budget.ticks
                    };
                    delivered = delivered.saturating_add(polled);
                    if delivered >= budget.completions || out_of_time {
                        self.state.store(NOTIFIED, Ordering::Release);
                        return DrainOutcome::BudgetExhausted { delivered };
                    }
                    if polled == POLL_BATCH {
                        break 'again;
                    }
                    // A short batch: the source was empty at this poll.
                    // What landed since was either notified (checked next)
                    // or is caught by the arm (missed events) and the poll
                    // after it, so a second, empty poll here would only
                    // cost a round.
                }
                if self.state.load(Ordering::Acquire) & NOTIFIED != 0 {
                    break 'again;
                }
                if source.arm(irql) == ArmOutcome::MissedEvents {
                    break 'again;
                }
                // Armed. A completion that landed between the empty poll
                // above and the arm raised no event: poll once more —
                // unless the arm itself looked (then it would have
                // answered MissedEvents).
                if !source.arm_reports_missed_events() {
                    let polled = deliver(source, handler, &mut batch, irql);
                    if polled > 0 {
                        delivered = delivered.saturating_add(polled);
                        break 'again;
                    }
                }
                if self
                    .state
                    .compare_exchange(RUNNING, 0, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    return DrainOutcome::Idle { delivered };
                }
            }
            // Poll again. Clear NOTIFIED first: a notification from here
            // on means "poll again", and this poll covers everything
            // before.
            self.state.fetch_and(!NOTIFIED, Ordering::AcqRel);
        }
    }
}

/// Polls one batch and hands each completion to the handler.
///
/// Inline into [`DrainLoop::run`]: it runs once per poll, a per-round cost
/// (at QD 1 every poll is a round of its own); `always`, see `run`.
#[inline(always)]
fn deliver<S, H>(
    source: &S,
    handler: &H,
    batch: &mut PollBatch<S::Completion>,
    irql: &Dispatch<'_>,
) -> usize
where
    S: CompletionSource + ?Sized,
    H: CompletionHandler<S::Completion> + ?Sized,
{
    // `batch` is empty here: every poll's completions are all taken below.
    source.poll(batch, irql);
    let polled = batch.len();
    // Deliver in poll order, leaving `batch` empty for the next poll: one
    // move per completion, out of its slot.
    if polled > 0 {
        handler.on_batch(&mut Polled { batch }, irql);
        while let Some(completion) = batch.take() {
            handler.on_completion(completion, irql);
        }
    }
    polled
}

/// A drain loop bound to a source, a handler and a DPC: the shape the CQ
/// uses. Completion events call [`DpcDrainer::notify`]; the DPC drains under
/// the budget and requeues itself; callers may also drain inline.
///
/// # The DPC routine and the drainer's lifetime
///
/// The routine holds a strong reference to the drain state (the loop, the
/// source, the handler: `DrainCore`) and a weak one to the drainer,
/// which it does not upgrade on every run (a compare-exchange and a
/// release per round): the drainer owns the DPC, the DPC's routine keeps
/// the state alive, and nothing owns the drainer back. When the last owner
/// drops the drainer, its `Drop` marks the state closed, and a routine
/// still queued finds it so and does nothing; one already running finishes its pass
/// on the state it holds (alive until the platform frees the routine,
/// which is after it returns). The weak reference is upgraded only to
/// requeue the DPC when the budget runs out.
pub struct DpcDrainer<P: Platform, S, H> {
    core: Arc<DrainCore<P, S, H>>,
    dpc: Option<P::Dpc>,
}

/// What a [`DpcDrainer`]'s DPC routine drains with (see
/// [`DpcDrainer`]'s lifetime notes).
struct DrainCore<P: Platform, S, H> {
    drain: DrainLoop,
    source: S,
    handler: H,
    budget: Budget,
    /// The drainer, to requeue its DPC when the budget runs out; dead once
    /// the last owner dropped it.
    owner: Weak<DpcDrainer<P, S, H>>,
    /// Set when the drainer is dropped: a routine still queued then does
    /// nothing. One flag to load per run, where testing `owner` for life
    /// costs a dangling-pointer check and a load of its count.
    closed: AtomicBool,
}

impl<P: Platform, S, H> fmt::Debug for DpcDrainer<P, S, H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DpcDrainer")
            .field("drain", &self.core.drain)
            .field("budget", &self.core.budget)
            .finish_non_exhaustive()
    }
}

impl<P, S, H> DrainCore<P, S, H>
where
    P: Platform,
    S: CompletionSource + Send + Sync + 'static,
    H: CompletionHandler<S::Completion> + Send + Sync + 'static,
{
    /// The DPC routine's pass.
    fn run_dpc(&self, irql: &Dispatch<'_>) {
        // The owner dropped the drainer: nothing more to deliver to (a
        // load, not an upgrade; see `DpcDrainer`).
        if self.closed.load(Ordering::Acquire) {
            return;
        }
        let outcome = self
            .drain
            .run(&self.source, &self.handler, self.budget, P::now, irql);
        if let DrainOutcome::BudgetExhausted { .. } = outcome {
            if let Some(owner) = self.owner.upgrade() {
                owner.queue_dpc();
            }
        }
    }
}

impl<P, S, H> DpcDrainer<P, S, H>
where
    P: Platform,
    S: CompletionSource + Send + Sync + 'static,
    H: CompletionHandler<S::Completion> + Send + Sync + 'static,
{
    /// Creates the drainer and its DPC (on `target`).
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL` (it allocates).
    pub fn new(
        platform: &P,
        source: S,
        handler: H,
        budget: Budget,
        target: DpcTarget,
        irql: &Passive<'_>,
    ) -> Result<Arc<Self>, AllocError> {
        let this = Arc::new_cyclic(|weak: &Weak<Self>| {
            let core = Arc::new(DrainCore {
                drain: DrainLoop::new(),
                source,
                handler,
                budget,
                owner: weak.clone(),
                closed: AtomicBool::new(false),
            });
            let routine_core = Arc::clone(&core);
            let dpc = platform
                .new_dpc(
                    Box::new(move |d: &Dispatch<'_>| routine_core.run_dpc(d)),
                    target,
                    irql,
                )
                .ok();
            DpcDrainer { core, dpc }
        });
        if this.dpc.is_none() {
            return Err(AllocError);
        }
        Ok(this)
    }

    /// A completion event (or an inline completion): schedules the DPC
    /// unless a drain is scheduled or running.
    ///
    /// # IRQL
    ///
    /// Any.
    pub fn notify(&self) {
        if self.core.drain.notify() {
            self.queue_dpc();
        }
    }

    /// Drains on the caller's stack (the `IB_POLL_DIRECT` style), raising to
    /// `DISPATCH_LEVEL` if needed; if the budget runs out the rest goes to
    /// the DPC. Returns at once ([`DrainOutcome::Busy`]) if a drain is
    /// running, e.g. when called from inside a completion handler.
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    pub fn drain_inline(&self, budget: Budget, irql: &impl LeDispatch) -> DrainOutcome {
        let outcome = with_dispatch::<P, _, _>(irql, |d| {
            let core = &*self.core;
            core.drain
                .run(&core.source, &core.handler, budget, P::now, d)
        });
        if let DrainOutcome::BudgetExhausted { .. } = outcome {
            self.queue_dpc();
        }
        outcome
    }

    /// The completion source.
    pub fn source(&self) -> &S {
        &self.core.source
    }

    /// The completion handler.
    pub fn handler(&self) -> &H {
        &self.core.handler
    }

    /// The underlying state machine.
    pub fn drain_loop(&self) -> &DrainLoop {
        &self.core.drain
    }

    fn queue_dpc(&self) {
        if let Some(dpc) = &self.dpc {
            dpc.queue();
        }
    }
}

impl<P: Platform, S, H> Drop for DpcDrainer<P, S, H> {
    /// The last owner let go: a routine that runs from now on does nothing
    /// (one that runs while the count is already zero but before this
    /// store finishes its pass, as one already running does).
    fn drop(&mut self) {
        self.core.closed.store(true, Ordering::Release);
    }
}
