//! Full stack over iSER, a hostile target: RDMA to a stale STag, beyond a
//! buffer, against a buffer's access rights, and after completion. Every
//! attempt must be refused by the initiator's HCA (a protection error:
//! per-I/O fast-registered MRs with exact bounds and only the access the
//! direction needs, invalidated — remotely by the target or by LOCAL_INV —
//! before the command completes), touch no byte outside the buffer of an
//! outstanding I/O (canaries around buffers, snapshots of completed
//! buffers), and every request still completes exactly once with a
//! truthful status; the session is reinstated.

use std::time::Duration;

use hca_lowlevel::dma::DmaBuffer;
use kverbs::irql::Passive;
use kverbs::platform::host::VerifierAllocator;
use kverbs_tests::Workload;
use kverbs_tests::iser::{IserStack, IserStackConfig};
use kverbs_tools::iser_target::IserMisbehaviour;
use kverbs_tools::srp_target::{HostileAttempt, HostileOutcome};
use storport_srp::miniport::transport::TargetState;
use storport_srp::storport::host::{RequestOutcome, RequestSpec, SgShape};
use storport_srp::storport::{Address, SrbStatus};

#[global_allocator]
static ALLOCATOR: VerifierAllocator = VerifierAllocator;

/// Initiator memory filled with a pattern, to be checked untouched later.
struct Canary {
    buf: DmaBuffer,
    pattern: Vec<u8>,
}

impl Canary {
    fn new(s: &IserStack, len: usize, seed: u64) -> Canary {
        let buf = s.initiator.phys_memory().alloc(len).unwrap();
        let pattern = Workload::new(seed).bytes(len);
        buf.write(0, &pattern).unwrap();
        Canary { buf, pattern }
    }

    fn intact(&self) -> bool {
        let mut now = vec![0u8; self.pattern.len()];
        self.buf.read(0, &mut now).unwrap();
        now == self.pattern
    }
}

/// Runs one request of `spec` with canaries allocated right before and
/// after its buffers (neighbours in the physical address space).
fn guarded(s: &IserStack, spec: &RequestSpec, p: &Passive<'_>) -> (u32, Canary, Canary) {
    let before = Canary::new(s, 8192, 1);
    let id = s.model.create(spec, p).unwrap();
    let after = Canary::new(s, 8192, 2);
    s.model.issue(id).unwrap();
    s.model.pump(p);
    (id, before, after)
}

fn arm(s: &IserStack, attempt: HostileAttempt, remote_invalidate: bool) {
    s.target(0).set_rdma_misbehaviour(IserMisbehaviour {
        hostile: Some(attempt),
        refuse_send_with_invalidate: !remote_invalidate,
        ..Default::default()
    });
}

/// Waits for `attempt`'s report; every attempt so far was refused.
fn refused(s: &IserStack, attempt: impl Fn(&HostileAttempt) -> bool) {
    assert!(s.wait_until(Duration::from_secs(10), || {
        s.target(0)
            .hostile_reports()
            .iter()
            .any(|r| attempt(&r.attempt) && r.outcome != HostileOutcome::Pending)
    }));
    let reports = s.target(0).hostile_reports();
    assert!(!reports.is_empty());
    for r in reports {
        assert!(
            matches!(r.outcome, HostileOutcome::Refused(_)),
            "the initiator's memory was reachable: {r:?}"
        );
    }
}

fn truthful(o: &RequestOutcome) {
    assert_eq!(o.completions, 1, "{o:?}");
    assert!(
        matches!(o.status.base(), SrbStatus::SUCCESS | SrbStatus::BUS_RESET),
        "{o:?}"
    );
}

fn recovers(s: &IserStack, p: &Passive<'_>) {
    s.target(0)
        .set_rdma_misbehaviour(IserMisbehaviour::default());
    assert!(s.wait_state(0, TargetState::Live, Duration::from_secs(20)));
    let data = Workload::new(77).bytes(4096);
    let o = s.write(0, 0, 300, &data, SgShape::Pages, p);
    assert_eq!(o.status.base(), SrbStatus::SUCCESS, "{o:?}");
    let (o, back) = s.read(0, 0, 300, 8, SgShape::Contiguous, p);
    assert_eq!(o.status.base(), SrbStatus::SUCCESS, "{o:?}");
    assert_eq!(back, data);
}

fn read_spec(lba: u64, blocks: u32, shape: SgShape) -> RequestSpec {
    RequestSpec::scsi_in(
        Address::new(0, 0, 0),
        &kverbs_tests::rw_cdb(true, lba, blocks),
        blocks * 512,
    )
    .shaped(shape)
}

#[test]
fn stale_stag() {
    // Fenced by the target's SEND with invalidate, then by LOCAL_INV.
    for remote_invalidate in [true, false] {
        IserStack::run(&IserStackConfig::default(), |s, p| {
            s.target(0).set_rdma_misbehaviour(IserMisbehaviour {
                refuse_send_with_invalidate: !remote_invalidate,
                ..Default::default()
            });
            s.target(0).drop_connections(p);
            assert!(s.wait_until(Duration::from_secs(20), || {
                s.stats(0, p).logins >= 2 && s.state(0) == TargetState::Live
            }));
            assert_eq!(s.stats(0, p).remote_invalidate, remote_invalidate);
            let (first, before, after) = guarded(s, &read_spec(0, 16, SgShape::Contiguous), p);
            let o = s.wait(&[first], Duration::from_secs(5), p);
            assert_eq!(o[0].status.base(), SrbStatus::SUCCESS);
            let snapshot = s.model.data(first).unwrap();
            // Older than the target's 20 ms settling time.
            std::thread::sleep(Duration::from_millis(50));
            arm(s, HostileAttempt::StaleRkey, remote_invalidate);
            let (second, b2, a2) = guarded(s, &read_spec(64, 8, SgShape::Pages), p);
            refused(s, |a| *a == HostileAttempt::StaleRkey);
            truthful(&s.wait(&[second], Duration::from_secs(20), p)[0]);
            assert_eq!(
                s.model.data(first).unwrap(),
                snapshot,
                "the completed buffer was touched"
            );
            assert!(before.intact() && after.intact() && b2.intact() && a2.intact());
            recovers(s, p);
        });
    }
}

#[test]
fn beyond_the_buffer() {
    for shape in [SgShape::Contiguous, SgShape::Pages] {
        IserStack::run(&IserStackConfig::default(), |s, p| {
            let attempt = HostileAttempt::BeyondBuffer { past_end: 512 };
            arm(s, attempt, true);
            let (id, before, after) = guarded(s, &read_spec(0, 9, shape), p);
            refused(s, |a| *a == attempt);
            truthful(&s.wait(&[id], Duration::from_secs(20), p)[0]);
            assert!(
                before.intact() && after.intact(),
                "bytes beyond the buffer were written"
            );
            recovers(s, p);
        });
    }
}

#[test]
fn against_the_access_rights() {
    IserStack::run(&IserStackConfig::default(), |s, p| {
        // Reading a buffer opened for remote write only (a READ's).
        let attempt = HostileAttempt::ReadFromWriteOnly;
        arm(s, attempt, true);
        let (id, before, after) = guarded(s, &read_spec(0, 8, SgShape::Contiguous), p);
        refused(s, |a| *a == attempt);
        truthful(&s.wait(&[id], Duration::from_secs(20), p)[0]);
        assert!(before.intact() && after.intact());
        recovers(s, p);
        // Writing a buffer opened for remote read only (a WRITE's, longer
        // than the immediate data so the target must RDMA-READ the rest).
        let attempt = HostileAttempt::WriteToReadOnly;
        arm(s, attempt, true);
        let data = Workload::new(5).bytes(65536);
        let spec = RequestSpec::scsi_out(
            Address::new(0, 0, 0),
            &kverbs_tests::rw_cdb(false, 100, 128),
            data.clone(),
        );
        let (id, before, after) = guarded(s, &spec, p);
        refused(s, |a| *a == attempt);
        truthful(&s.wait(&[id], Duration::from_secs(20), p)[0]);
        assert_eq!(
            s.model.data(id).unwrap(),
            data,
            "the data-out buffer was written"
        );
        assert!(before.intact() && after.intact());
        recovers(s, p);
    });
}

#[test]
fn after_completion() {
    for remote_invalidate in [true, false] {
        IserStack::run(&IserStackConfig::default(), |s, p| {
            if !remote_invalidate {
                s.target(0).set_rdma_misbehaviour(IserMisbehaviour {
                    refuse_send_with_invalidate: true,
                    ..Default::default()
                });
                s.target(0).drop_connections(p);
                assert!(s.wait_until(Duration::from_secs(20), || {
                    s.stats(0, p).logins >= 2 && s.state(0) == TargetState::Live
                }));
            }
            arm(
                s,
                HostileAttempt::AfterResponse {
                    delay: Duration::from_millis(50),
                },
                remote_invalidate,
            );
            let (id, before, after) = guarded(s, &read_spec(0, 16, SgShape::Pages), p);
            let o = s.wait(&[id], Duration::from_secs(5), p);
            assert_eq!(
                o[0].status.base(),
                SrbStatus::SUCCESS,
                "served normally first"
            );
            let snapshot = s.model.data(id).unwrap();
            assert_eq!(snapshot, s.medium(0, 0, 0, 16));
            refused(s, |a| matches!(a, HostileAttempt::AfterResponse { .. }));
            assert_eq!(
                s.model.data(id).unwrap(),
                snapshot,
                "written after completion"
            );
            assert!(before.intact() && after.intact());
            recovers(s, p);
        });
    }
}
