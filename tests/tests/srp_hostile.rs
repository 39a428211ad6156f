//! Full stack, a hostile target: RDMA to a stale rkey, beyond a buffer,
//! against a buffer's access rights, and after completion. Every attempt
//! must be refused by the initiator's HCA (a protection error: no global
//! rkey, per-I/O MRs with exact bounds and rights, invalidated before
//! completion), touch no byte outside the buffer of an outstanding I/O
//! (canaries around buffers, snapshots of completed buffers), and every
//! request still completes exactly once with a truthful status; the
//! connection recovers.

use std::time::Duration;

use hca_lowlevel::dma::DmaBuffer;
use kverbs::platform::host::VerifierAllocator;
use kverbs_tests::srp_target::{HostileAttempt, HostileOutcome, Misbehaviour};
use kverbs_tests::{Stack, StackConfig, TargetSetup, Workload};
use storport_srp::miniport::transport::TargetState;
use storport_srp::storport::host::{RequestSpec, SgShape};
use storport_srp::storport::{Address, SrbStatus};

#[global_allocator]
static ALLOCATOR: VerifierAllocator = VerifierAllocator;

/// A region of initiator memory filled with a pattern, to be checked
/// untouched later.
struct Canary {
    buf: DmaBuffer,
    pattern: Vec<u8>,
}

impl Canary {
    fn new(s: &Stack, len: usize, seed: u64) -> Canary {
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
fn guarded(s: &Stack, spec: &RequestSpec, p: &kverbs::irql::Passive<'_>) -> (u32, Canary, Canary) {
    let before = Canary::new(s, 8192, 1);
    let id = s.model.create(spec, p).unwrap();
    let after = Canary::new(s, 8192, 2);
    s.model.issue(id).unwrap();
    s.model.pump(p);
    (id, before, after)
}

fn hostile_stack() -> StackConfig {
    StackConfig {
        targets: vec![TargetSetup::standard()],
        ..StackConfig::default()
    }
}

fn refused(s: &Stack, attempt: HostileAttempt) {
    assert!(s.wait_until(Duration::from_secs(10), || {
        s.target(0)
            .hostile_reports()
            .iter()
            .any(|r| r.attempt == attempt && r.outcome != HostileOutcome::Pending)
    }));
    for r in s.target(0).hostile_reports() {
        assert!(
            matches!(r.outcome, HostileOutcome::Refused(_)),
            "the initiator's memory was reachable: {r:?}"
        );
    }
}

fn truthful(o: &storport_srp::storport::host::RequestOutcome) {
    assert_eq!(o.completions, 1, "{o:?}");
    assert!(
        matches!(o.status.base(), SrbStatus::SUCCESS | SrbStatus::BUS_RESET),
        "{o:?}"
    );
}

/// The refused access ended the connection (the initiator has seen `lost`
/// transport failures in all: until it has, the target still reads as
/// live, and a command sent then would meet the disconnect), then the
/// target is live again and serves I/O.
fn recovers(s: &Stack, lost: u64, p: &kverbs::irql::Passive<'_>) {
    assert!(
        s.wait_until(Duration::from_secs(10), || {
            s.stats(0, p).transport_failures >= lost
        }),
        "the refused access did not end the connection: {:?}",
        s.stats(0, p)
    );
    assert!(s.wait_state(0, TargetState::Live, Duration::from_secs(10)));
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
fn stale_rkey() {
    Stack::run(&hostile_stack(), |s, p| {
        // A READ that completes: its MR is invalidated before it does.
        let (first, before, after) = guarded(s, &read_spec(0, 16, SgShape::Contiguous), p);
        let o = s.wait(&[first], Duration::from_secs(5), None, p);
        assert_eq!(o[0].status.base(), SrbStatus::SUCCESS);
        let snapshot = s.model.data(first).unwrap();
        // The target uses a buffer whose response it delivered at least
        // 20 ms ago (so the initiator has surely completed it).
        std::thread::sleep(Duration::from_millis(50));
        // The next command makes the target write to that buffer's rkey.
        let attempt = HostileAttempt::StaleRkey;
        s.target(0)
            .set_misbehaviour(Misbehaviour::Hostile(attempt), p);
        let (second, b2, a2) = guarded(s, &read_spec(64, 8, SgShape::Pages), p);
        refused(s, attempt);
        let o = s.wait(&[second], Duration::from_secs(10), None, p);
        truthful(&o[0]);
        assert_eq!(
            s.model.data(first).unwrap(),
            snapshot,
            "the completed buffer was touched"
        );
        assert!(before.intact() && after.intact() && b2.intact() && a2.intact());
        recovers(s, 1, p);
    });
}

#[test]
fn beyond_the_buffer() {
    for shape in [SgShape::Contiguous, SgShape::Odd { seed: 4 }] {
        Stack::run(&hostile_stack(), |s, p| {
            let attempt = HostileAttempt::BeyondBuffer { past_end: 512 };
            s.target(0)
                .set_misbehaviour(Misbehaviour::Hostile(attempt), p);
            let (id, before, after) = guarded(s, &read_spec(0, 9, shape), p);
            refused(s, attempt);
            let o = s.wait(&[id], Duration::from_secs(10), None, p);
            truthful(&o[0]);
            assert!(
                before.intact() && after.intact(),
                "bytes beyond the buffer were written"
            );
            recovers(s, 1, p);
        });
    }
}

#[test]
fn against_the_access_rights() {
    Stack::run(&hostile_stack(), |s, p| {
        // Reading a buffer opened for remote write only (a READ's).
        let attempt = HostileAttempt::ReadFromWriteOnly;
        s.target(0)
            .set_misbehaviour(Misbehaviour::Hostile(attempt), p);
        let (id, before, after) = guarded(s, &read_spec(0, 8, SgShape::Contiguous), p);
        refused(s, attempt);
        truthful(&s.wait(&[id], Duration::from_secs(10), None, p)[0]);
        assert!(before.intact() && after.intact());
        recovers(s, 1, p);
        // Writing a buffer opened for remote read only (a WRITE's, too big
        // for immediate data so the target must RDMA-READ it).
        let attempt = HostileAttempt::WriteToReadOnly;
        s.target(0)
            .set_misbehaviour(Misbehaviour::Hostile(attempt), p);
        let data = Workload::new(5).bytes(16384);
        let spec = RequestSpec::scsi_out(
            Address::new(0, 0, 0),
            &kverbs_tests::rw_cdb(false, 100, 32),
            data.clone(),
        );
        let (id, before, after) = guarded(s, &spec, p);
        refused(s, attempt);
        truthful(&s.wait(&[id], Duration::from_secs(10), None, p)[0]);
        assert_eq!(
            s.model.data(id).unwrap(),
            data,
            "the data-out buffer was written"
        );
        assert!(before.intact() && after.intact());
        recovers(s, 2, p);
    });
}

#[test]
fn after_completion() {
    Stack::run(&hostile_stack(), |s, p| {
        let attempt = HostileAttempt::AfterResponse {
            delay: Duration::from_millis(50),
        };
        s.target(0)
            .set_misbehaviour(Misbehaviour::Hostile(attempt), p);
        let (id, before, after) = guarded(s, &read_spec(0, 16, SgShape::Pages), p);
        let o = s.wait(&[id], Duration::from_secs(5), None, p);
        assert_eq!(
            o[0].status.base(),
            SrbStatus::SUCCESS,
            "served normally first"
        );
        let snapshot = s.model.data(id).unwrap();
        assert_eq!(snapshot, s.medium(0, 0, 0, 16));
        refused(s, attempt);
        assert_eq!(
            s.model.data(id).unwrap(),
            snapshot,
            "written after completion"
        );
        assert!(before.intact() && after.intact());
        recovers(s, 1, p);
    });
}
