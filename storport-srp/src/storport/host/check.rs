//! What the model checks, and where it writes down what it found.
//!
//! A [`Checker`] is a per-model log of [`ModelViolation`]s. Recording never
//! allocates (it runs inside miniport callbacks at `DISPATCH_LEVEL`, under
//! the kverbs verifier), so the log is a fixed array with an exact count.
//!
//! The device-IRQL context is thread-local: while the model runs a
//! routine StorPort calls at device IRQL (`HwInitialize`, the Stop and
//! Restart adapter controls), every service call and every transport call
//! made on that thread is checked against it — a virtual miniport that
//! completes requests, takes a spin lock's worth of services or tears its
//! transport down inline there is caught. Transports under test report
//! their entry points through [`Checker::require_irql`].

use std::cell::Cell;
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

use kverbs::irql::Irql;
use kverbs::platform::Platform;
use kverbs::platform::host::HostPlatform;

/// One broken rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelViolation {
    /// A request was completed a second time (or while StorPort, not the
    /// miniport, held it).
    DoubleCompletion {
        /// The request's index.
        request: u32,
    },
    /// A completion named a request StorPort never gave the miniport.
    UnknownRequest {
        /// The index the handle claimed.
        request: u32,
    },
    /// A request was completed at an IRQL where that is not allowed.
    CompletionAtBadIrql {
        /// The request.
        request: u32,
        /// The thread's IRQL.
        irql: Irql,
        /// Whether it was inside a device-IRQL routine.
        device_irql: bool,
    },
    /// A request was completed with `SRB_STATUS_PENDING`.
    CompletedPending {
        /// The request.
        request: u32,
    },
    /// A request was completed still holding its scatter/gather list.
    SgListNotReleased {
        /// The request.
        request: u32,
    },
    /// A StorPort service, or a transport entry point, was called at an
    /// IRQL its contract does not allow.
    WrongIrql {
        /// Which call.
        what: &'static str,
        /// The thread's IRQL.
        irql: Irql,
        /// Whether it was inside a device-IRQL routine.
        device_irql: bool,
    },
    /// A request handle was dropped without being completed (it would hang
    /// forever on Windows).
    DroppedWithoutCompletion {
        /// The request.
        request: u32,
    },
    /// A request StorPort issued was never completed.
    NeverCompleted {
        /// The request.
        request: u32,
    },
    /// A request the miniport held when the bus was reset was still not
    /// completed when the reset's grace period ended.
    ResetLeftOutstanding {
        /// The request.
        request: u32,
    },
    /// No request completed (other than `SRB_STATUS_BUSY` answers) for
    /// longer than the budget while requests were waiting: the adapter is
    /// busy forever.
    BusyForever {
        /// Virtual milliseconds without progress.
        stalled_ms: u64,
        /// Requests waiting in StorPort's queue.
        waiting: u32,
    },
    /// A device-IRQL routine ran longer than its budget (it blocked or
    /// did real work where only a flag and a DPC belong).
    DeviceIrqlOverBudget {
        /// Which routine.
        routine: &'static str,
        /// How long it ran, microseconds of wall time.
        elapsed_us: u64,
    },
    /// A callback returned a value StorPort does not accept (e.g.
    /// `find_adapter` limits out of range).
    BadCallbackResult {
        /// Which callback.
        routine: &'static str,
    },
}

impl fmt::Display for ModelViolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self:?}")
    }
}

/// How many violations a log keeps in detail (the count is exact).
const LOG_CAPACITY: usize = 128;

struct CheckLog {
    entries: Mutex<[Option<ModelViolation>; LOG_CAPACITY]>,
    count: AtomicUsize,
}

/// A model's violation log (cheap to copy; lives as long as the process,
/// like the kverbs verifier's log, so any thread may hold it).
#[derive(Clone, Copy)]
pub struct Checker {
    log: &'static CheckLog,
}

impl fmt::Debug for Checker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Checker")
            .field("count", &self.count())
            .finish()
    }
}

thread_local! {
    /// Nesting depth of device-IRQL routines on this thread.
    static DEVICE_IRQL: Cell<u32> = const { Cell::new(0) };
}

/// Whether the current thread runs inside a device-IRQL routine.
#[must_use]
pub fn in_device_irql() -> bool {
    DEVICE_IRQL.try_with(Cell::get).unwrap_or(0) > 0
}

/// Marks the current thread as running at device IRQL for its lifetime.
pub(crate) struct DeviceIrqlScope;

impl DeviceIrqlScope {
    pub(crate) fn enter() -> Self {
        let _ = DEVICE_IRQL.try_with(|d| d.set(d.get() + 1));
        DeviceIrqlScope
    }
}

impl Drop for DeviceIrqlScope {
    fn drop(&mut self) {
        let _ = DEVICE_IRQL.try_with(|d| d.set(d.get().saturating_sub(1)));
    }
}

impl Checker {
    pub(crate) fn new() -> Self {
        let log: &'static CheckLog = Box::leak(Box::new(CheckLog {
            entries: Mutex::new([None; LOG_CAPACITY]),
            count: AtomicUsize::new(0),
        }));
        Self { log }
    }

    /// Records a violation. Never allocates.
    pub fn record(&self, violation: ModelViolation) {
        let index = self.log.count.fetch_add(1, Ordering::Relaxed);
        let mut entries = self
            .log
            .entries
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(slot) = entries.get_mut(index) {
            *slot = Some(violation);
        }
    }

    /// Violations recorded so far (exact, even past the detailed log).
    #[must_use]
    pub fn count(&self) -> usize {
        self.log.count.load(Ordering::Relaxed)
    }

    /// Takes the recorded violations, emptying the log.
    pub fn take(&self) -> Vec<ModelViolation> {
        let mut entries = self
            .log
            .entries
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let taken = entries.iter_mut().filter_map(Option::take).collect();
        self.log.count.store(0, Ordering::Relaxed);
        taken
    }

    /// Checks that the current thread may make a call documented for IRQL
    /// <= `max` (and not from a device-IRQL routine); records
    /// [`ModelViolation::WrongIrql`] otherwise. Returns whether it was
    /// allowed. Transports under test call this at their entry points.
    pub fn require_irql(&self, what: &'static str, max: Irql) -> bool {
        let irql = HostPlatform::current_irql();
        let device_irql = in_device_irql();
        if device_irql || irql > max {
            self.record(ModelViolation::WrongIrql {
                what,
                irql,
                device_irql,
            });
            false
        } else {
            true
        }
    }

    /// Checks that the current thread runs at exactly `DISPATCH_LEVEL`
    /// (not at device IRQL); records [`ModelViolation::WrongIrql`]
    /// otherwise.
    pub fn require_dispatch(&self, what: &'static str) -> bool {
        let irql = HostPlatform::current_irql();
        let device_irql = in_device_irql();
        if device_irql || irql != Irql::DISPATCH {
            self.record(ModelViolation::WrongIrql {
                what,
                irql,
                device_irql,
            });
            false
        } else {
            true
        }
    }
}
