//! The pieces the transport teardown tests share (`tests/tests/srp_teardown.rs`,
//! `tests/tests/iser_teardown.rs`): an upcall sink that counts with atomics
//! only (upcalls run at `DISPATCH_LEVEL`, where the verifier's allocator
//! fails any allocation) and a command without data.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use hca_lowlevel::sim::{ExecMode, Fabric, FabricConfig};
use kverbs::irql::{Dispatch, Passive};
use kverbs::platform::host::{HostConfig, HostPlatform};
use kverbs::sync::with_dispatch;
use kverbs_tools::bench::rdma::wait_until;
use storport_srp::miniport::transport::{
    CommandOutcome, CommandResult, EngineProbe, ImmediateData, Lun, ScsiCommand, Tag, TargetState,
    TmfResponse, Transport, TransportEvents,
};
use storport_srp::storport::{DataAccessError, DataDirection, QueueAction};

/// Tags the tests use (each slot counts the completions of one tag).
pub const TAGS: usize = 64;

/// Counts every upcall, per tag for completions; allocation-free.
pub struct CountingEvents {
    pub done: [AtomicU32; TAGS],
    /// Completions with SCSI status GOOD.
    pub good: AtomicU32,
    /// Completions the transport failed ([`CommandOutcome::Failed`]).
    pub failed: AtomicU32,
    /// Completions for a tag outside `0..TAGS` (never posted).
    pub stray: AtomicU32,
    pub tmf: AtomicU32,
    pub live: AtomicU32,
    pub states: AtomicU32,
    pub credits: AtomicU32,
    /// Set when the handle has been dropped.
    pub dropped: AtomicBool,
    /// Upcalls of any kind made after the drop.
    pub after_drop: AtomicU32,
}

impl Default for CountingEvents {
    fn default() -> Self {
        Self::new()
    }
}

impl CountingEvents {
    /// Every count at zero.
    #[must_use]
    pub fn new() -> Self {
        CountingEvents {
            done: std::array::from_fn(|_| AtomicU32::new(0)),
            good: AtomicU32::new(0),
            failed: AtomicU32::new(0),
            stray: AtomicU32::new(0),
            tmf: AtomicU32::new(0),
            live: AtomicU32::new(0),
            states: AtomicU32::new(0),
            credits: AtomicU32::new(0),
            dropped: AtomicBool::new(false),
            after_drop: AtomicU32::new(0),
        }
    }

    /// Counts an upcall made after the drop.
    fn note(&self) {
        if self.dropped.load(Ordering::Acquire) {
            self.after_drop.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Completions of tag `tag` so far (0 for a tag outside `0..TAGS`).
    #[must_use]
    pub fn done_count(&self, tag: usize) -> u32 {
        self.done.get(tag).map_or(0, |n| n.load(Ordering::Acquire))
    }
}

impl TransportEvents for CountingEvents {
    fn command_done(&self, tag: Tag, result: &CommandResult<'_>, _irql: &Dispatch<'_>) {
        self.note();
        match self.done.get(tag.raw() as usize) {
            Some(n) => {
                n.fetch_add(1, Ordering::AcqRel);
            }
            None => {
                self.stray.fetch_add(1, Ordering::AcqRel);
            }
        }
        match result.outcome {
            CommandOutcome::Scsi(0) => {
                self.good.fetch_add(1, Ordering::AcqRel);
            }
            CommandOutcome::Failed(_) => {
                self.failed.fetch_add(1, Ordering::AcqRel);
            }
            _ => {}
        }
    }

    fn tmf_done(&self, _tag: Tag, _response: TmfResponse, _irql: &Dispatch<'_>) {
        self.note();
        self.tmf.fetch_add(1, Ordering::AcqRel);
    }

    fn target_state(&self, _target: u8, state: TargetState, _irql: &Dispatch<'_>) {
        self.note();
        self.states.fetch_add(1, Ordering::AcqRel);
        if state == TargetState::Live {
            self.live.fetch_add(1, Ordering::AcqRel);
        }
    }

    fn credits_available(&self, _target: u8, _irql: &Dispatch<'_>) {
        self.note();
        self.credits.fetch_add(1, Ordering::AcqRel);
    }
}

/// No data buffer (TEST UNIT READY has no data phase).
pub struct NoData;

impl ImmediateData for NoData {
    fn read(&self, _offset: u32, _out: &mut [u8]) -> Result<(), DataAccessError> {
        Err(DataAccessError::OutOfBounds)
    }
}

/// Prepares and posts TEST UNIT READY under `tag` to target 0, LUN 0.
///
/// # Panics
/// If the transport refuses it.
pub fn post_tur<T: Transport>(transport: &T, tag: u32, p: &Passive<'_>) {
    let cdb = [0u8; 6];
    let command = ScsiCommand {
        tag: Tag(tag),
        target: 0,
        lun: Lun::from_index(0).unwrap_or(Lun([0; 8])),
        cdb: &cdb,
        direction: DataDirection::None,
        transfer_length: 0,
        task_attribute: QueueAction::Simple,
        sg_list: &[],
        immediate: &NoData,
    };
    let prepared = transport
        .prepare(&command, p)
        .unwrap_or_else(|e| panic!("prepare tag {tag}: {e:?}"));
    if let Err(e) = transport.post(prepared, p) {
        panic!("post tag {tag}: {e:?}");
    }
}

/// Where a test drops the handle.
#[derive(Debug, Clone, Copy)]
pub enum DropAt {
    /// At `PASSIVE_LEVEL`, as the miniport core would.
    Passive,
    /// At `DISPATCH_LEVEL`, as from a DPC: the verifier fails the test if
    /// the drop blocks, and [`with_fabric`] if it allocates.
    Dispatch,
}

/// Drops `transport` at `level` without `stop()` (noted in `events`
/// first, so later upcalls count as after the drop) and waits (bounded)
/// for the engine behind `probe` to go.
///
/// # Panics
/// If the engine outlives the handle by 30 s.
pub fn drop_without_stop<T>(
    transport: T,
    probe: &EngineProbe,
    events: &CountingEvents,
    level: DropAt,
    p: &Passive<'_>,
) {
    events.dropped.store(true, Ordering::Release);
    match level {
        DropAt::Passive => drop(transport),
        DropAt::Dispatch => with_dispatch::<HostPlatform, _, _>(p, |_d| drop(transport)),
    }
    assert!(
        wait_until(Duration::from_secs(30), || !probe.is_alive()),
        "the engine outlived its dropped transport handle"
    );
}

/// Runs `f` on a fresh host platform (`host`) and a threaded fabric;
/// checks the verifier saw no allocation at `DISPATCH_LEVEL`.
///
/// # Panics
/// If anything allocated at `DISPATCH_LEVEL`.
pub fn with_fabric(host: HostConfig, f: impl FnOnce(&HostPlatform, &Fabric, &Passive<'_>)) {
    let platform = HostPlatform::with_config(host);
    let fabric = Fabric::new(FabricConfig {
        mode: ExecMode::Thread,
        seed: 7,
        ..FabricConfig::default()
    });
    platform.run_passive(|p| f(&platform, &fabric, p));
    assert_eq!(
        platform.allocations_at_dispatch(),
        0,
        "allocations at DISPATCH_LEVEL"
    );
    drop(fabric);
}
