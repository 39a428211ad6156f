//! Full stack over iSER, faults: a dropped connection under load is
//! reinstated (ERL0) with every request completed exactly once and data
//! intact or a truthful error; a hostile target invalidating a key it was
//! not given ends the connection; a target-requested logout; a reset.

use std::time::Duration;

use kverbs::platform::host::VerifierAllocator;
use kverbs_tests::Workload;
use kverbs_tests::iser::{IserStack, IserStackConfig};
use kverbs_tools::iser_target::IserMisbehaviour;
use storport_srp::miniport::transport::TargetState;
use storport_srp::storport::SrbStatus;
use storport_srp::storport::host::SgShape;
use storport_srp::wire::iscsi::AsyncEvent;

#[global_allocator]
static ALLOCATOR: VerifierAllocator = VerifierAllocator;

fn pages(mut ios: Vec<kverbs_tests::Io>) -> Vec<kverbs_tests::Io> {
    for io in &mut ios {
        io.shape = SgShape::Pages;
    }
    ios
}

#[test]
fn session_drop_under_load_is_reinstated() {
    IserStack::run(&IserStackConfig::default(), |s, p| {
        let mut w = Workload::new(42);
        let ios = pages(w.disjoint_ios(128, 0, 0, 512, 32768, 4096, 65536, 0.5));
        let ids: Vec<u32> = ios.iter().map(|io| s.submit(&io.request(), p)).collect();
        s.target(0).drop_connections(p);
        let outs = s.wait(&ids, Duration::from_secs(60), p);
        for (io, (id, o)) in ios.iter().zip(ids.iter().zip(&outs)) {
            assert_eq!(o.completions, 1, "{o:?}");
            if o.status.base() == SrbStatus::SUCCESS {
                let data = s.model.data(*id).unwrap_or_default();
                s.check(
                    io,
                    &kverbs_tests::IoDone {
                        id: *id,
                        outcome: o.clone(),
                        data,
                    },
                );
            }
        }
        assert!(s.wait_state(0, TargetState::Live, Duration::from_secs(20)));
        let st = s.stats(0, p);
        assert!(st.logins >= 2, "{st:?}");
        // After reinstatement the data path works.
        let data = w.bytes(16384);
        let o = s.write(0, 0, 7, &data, SgShape::Pages, p);
        assert_eq!(o.status.base(), SrbStatus::SUCCESS);
        assert_eq!(s.medium(0, 0, 7, 32), data);
    });
}

#[test]
fn bogus_remote_invalidation_ends_the_connection() {
    IserStack::run(&IserStackConfig::default(), |s, p| {
        s.target(0).set_rdma_misbehaviour(IserMisbehaviour {
            bogus_invalidate: true,
            ..Default::default()
        });
        let (o, _) = s.read(0, 0, 0, 16, SgShape::Pages, p);
        assert_ne!(o.status.base(), SrbStatus::SUCCESS, "{o:?}");
        assert_eq!(o.completions, 1);
        let st = s.stats(0, p);
        // The HCA refuses to invalidate a key that is not a live MR of the
        // QP's PD (a receive error, code 1); a live key of another command
        // is caught by the engine's check (code 5).
        assert!(matches!(st.last_failure, 1 | 5), "bogus invalidate: {st:?}");
        assert_eq!(st.remote_invalidations, 0, "{st:?}");
        s.target(0)
            .set_rdma_misbehaviour(IserMisbehaviour::default());
        assert!(s.wait_state(0, TargetState::Live, Duration::from_secs(20)));
        let (o, _) = s.read(0, 0, 0, 16, SgShape::Pages, p);
        assert_eq!(o.status.base(), SrbStatus::SUCCESS);
    });
}

#[test]
fn target_logout_request_then_relogin() {
    IserStack::run(&IserStackConfig::default(), |s, p| {
        s.target(0).send_async(AsyncEvent::RequestLogout, 0, 2, p);
        assert!(s.wait_until(Duration::from_secs(20), || s.stats(0, p).logins >= 2));
        assert!(s.wait_state(0, TargetState::Live, Duration::from_secs(20)));
        let mut w = Workload::new(1);
        let data = w.bytes(4096);
        let o = s.write(0, 1, 3, &data, SgShape::Contiguous, p);
        assert_eq!(o.status.base(), SrbStatus::SUCCESS);
        assert!(s.target(0).with_logic(|l| l.counters().logouts) >= 1);
    });
}
