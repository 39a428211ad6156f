//! The I/O driver both in-process stacks share: submit a list of I/Os at a
//! queue depth, never two overlapping ones at once, collect every outcome
//! and check each successful one against the target's medium. The SRP
//! ([`crate::Stack`]) and iSER ([`crate::iser::IserStack`]) stacks differ
//! only in how they are built; what runs over them is the same.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use storport_srp::storport::SrbStatus;
use storport_srp::storport::host::{HostPort, RequestSpec, RequestState, StorPortModel};

use kverbs::irql::Passive;
use storport_srp::storport::HwMiniport;

use kverbs_tools::scsi_target::ScsiTarget;

use crate::{Io, IoDone, Op, first_difference};

/// A full stack in one process: the StorPort model in front, software
/// targets with their media behind.
pub trait FullStack {
    /// The miniport the model drives.
    type Miniport: HwMiniport<HostPort>;

    /// The StorPort model.
    fn model(&self) -> &StorPortModel<Self::Miniport>;

    /// Target `target`'s SCSI side (its LUNs and their media).
    fn scsi(&self, target: u8) -> std::sync::Arc<ScsiTarget>;

    /// `blocks` of a target LUN's medium from `lba` (empty if no such LUN).
    fn medium(&self, target: u8, lun: u8, lba: u64, blocks: u64) -> Vec<u8> {
        let mut out = Vec::new();
        if let Some(l) = self.scsi(target).lun(u16::from(lun)) {
            let _ = l.read_blocks(lba, blocks, &mut |b| out.extend_from_slice(b));
        }
        out
    }
}

/// Submits a request.
///
/// # Panics
/// If the model refuses it (table full, no memory).
pub fn submit<S: FullStack>(s: &S, spec: &RequestSpec, p: &Passive<'_>) -> u32 {
    match s.model().submit(spec, p) {
        Ok(id) => id,
        Err(e) => panic!("submit: {e:?}"),
    }
}

/// Whether request `id` has completed.
pub fn done<S: FullStack>(s: &S, id: u32) -> bool {
    s.model()
        .outcome(id)
        .is_some_and(|o| o.state == RequestState::Completed)
}

/// Runs `ios` with at most `depth` in flight, never two overlapping ones
/// at once; checks every successful one against the medium as it
/// completes. Returns the outcomes in the order of `ios`.
///
/// # Panics
/// On a data mismatch, or if the I/O does not finish within 120 s.
pub fn run_ios<S: FullStack>(s: &S, ios: &[Io], depth: usize, p: &Passive<'_>) -> Vec<IoDone> {
    let depth = depth.max(1);
    let mut results: Vec<Option<IoDone>> = (0..ios.len()).map(|_| None).collect();
    let mut next = 0usize;
    let mut in_flight: BTreeMap<u32, usize> = BTreeMap::new();
    let start = Instant::now();
    while next < ios.len() || !in_flight.is_empty() {
        while next < ios.len() && in_flight.len() < depth {
            let Some(io) = ios.get(next) else { break };
            let overlaps = in_flight
                .values()
                .filter_map(|i| ios.get(*i))
                .any(|o| o.overlaps_with(io));
            if overlaps {
                break;
            }
            let id = submit(s, &io.request(), p);
            in_flight.insert(id, next);
            next += 1;
        }
        let finished: Vec<u32> = in_flight
            .keys()
            .copied()
            .filter(|id| done(s, *id))
            .collect();
        for id in finished {
            let Some(index) = in_flight.remove(&id) else {
                continue;
            };
            let Some(io) = ios.get(index) else { continue };
            let outcome = s
                .model()
                .outcome(id)
                .unwrap_or_else(|| panic!("no request {id}"));
            let data = s.model().data(id).unwrap_or_default();
            let done = IoDone { id, outcome, data };
            if done.outcome.status.base() == SrbStatus::SUCCESS {
                check(s, io, &done);
            }
            if let Some(slot) = results.get_mut(index) {
                *slot = Some(done);
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "I/O did not finish: {} in flight",
            in_flight.len()
        );
        if !in_flight.is_empty() {
            s.model().pump(p);
            std::thread::yield_now();
        }
    }
    results
        .into_iter()
        .map(|r| r.unwrap_or_else(|| panic!("missing result")))
        .collect()
}

/// Checks a successful I/O against the medium: a write must be on it, a
/// read must have returned it.
///
/// # Panics
/// On a mismatch.
pub fn check<S: FullStack>(s: &S, io: &Io, done: &IoDone) {
    let medium = s.medium(io.target, io.lun, io.lba, u64::from(io.blocks));
    let (what, got) = match io.op {
        Op::Write => ("write", &io.data),
        Op::Read => ("read", &done.data),
    };
    assert!(
        &medium == got,
        "{what} of {} blocks at {} on {}:{} ({:?}) differs from the medium at byte {:?}",
        io.blocks,
        io.lba,
        io.target,
        io.lun,
        io.shape,
        first_difference(&medium, got)
    );
}

/// Every I/O completed exactly once; successes were checked against the
/// medium by [`run_ios`], everything else must be a status in `allowed`
/// (one the class driver retries), with no data reported. Returns how many
/// failed.
///
/// # Panics
/// On a double completion, a status not in `allowed`, or a failure that
/// reports moved data.
pub fn truthful(done: &[IoDone], allowed: &[SrbStatus]) -> usize {
    let mut failed = 0;
    for d in done {
        assert_eq!(d.outcome.completions, 1, "{d:?}");
        let base = d.outcome.status.base();
        if base != SrbStatus::SUCCESS {
            assert!(allowed.contains(&base), "unexpected status: {d:?}");
            assert_eq!(d.outcome.data_transfer_length, 0, "{d:?}");
            failed += 1;
        }
    }
    failed
}

/// The class driver's retry of what failed in `done`: all of it must
/// succeed now.
///
/// # Panics
/// If a retried I/O fails.
pub fn retry_failed<S: FullStack>(s: &S, ios: &[Io], done: &[IoDone], p: &Passive<'_>) {
    let again: Vec<Io> = ios
        .iter()
        .zip(done)
        .filter(|(_, d)| d.outcome.status.base() != SrbStatus::SUCCESS)
        .map(|(io, _)| io.clone())
        .collect();
    for d in run_ios(s, &again, 8, p) {
        assert_eq!(d.outcome.status.base(), SrbStatus::SUCCESS, "{d:?}");
    }
}

/// Runs `ios` at `depth` while `fault` runs on another thread after
/// `after`; returns the results.
pub fn with_fault<S: FullStack>(
    s: &S,
    ios: &[Io],
    depth: usize,
    after: std::time::Duration,
    fault: impl FnOnce() + Send,
    p: &Passive<'_>,
) -> Vec<IoDone> {
    std::thread::scope(|scope| {
        scope.spawn(move || {
            std::thread::sleep(after);
            fault();
        });
        run_ios(s, ios, depth, p)
    })
}

/// The link faults the transport must repair without a failed I/O: light
/// loss and jitter.
#[must_use]
pub fn light_loss() -> hca_lowlevel::sim::FaultConfig {
    hca_lowlevel::sim::FaultConfig {
        drop: 0.005,
        jitter_ns: 20_000,
        ..hca_lowlevel::sim::FaultConfig::default()
    }
}

/// Loss with duplication, reordering and corruption. Heavy reordering can
/// exhaust the RC retry budget (sequence-error NAKs count against it): the
/// connection then fails and recovers, and the requests it took fail for
/// retry — never silently.
#[must_use]
pub fn rough_link() -> hca_lowlevel::sim::FaultConfig {
    hca_lowlevel::sim::FaultConfig {
        drop: 0.005,
        duplicate: 0.01,
        reorder: 0.03,
        reorder_delay_ns: 300_000,
        corrupt: 0.005,
        jitter_ns: 20_000,
        ..hca_lowlevel::sim::FaultConfig::default()
    }
}
