//! Full stack over iSER, first light: login over RDMA, INQUIRY-free
//! reads and writes verified against the medium, the negotiated iSER keys.

use kverbs::platform::host::VerifierAllocator;
use kverbs_tests::Workload;
use kverbs_tests::iser::{IserStack, IserStackConfig};
use storport_srp::storport::SrbStatus;
use storport_srp::storport::host::SgShape;

#[global_allocator]
static ALLOCATOR: VerifierAllocator = VerifierAllocator;

#[test]
fn login_then_write_and_read_back() {
    IserStack::run(&IserStackConfig::default(), |s, p| {
        let neg = s.transport().negotiated(0, p).expect("live session");
        assert_eq!(neg.max_recv_data_segment, 8192);
        assert!(neg.first_burst_length <= storport_srp::iser::UNSOLICITED_MAX);
        let mut w = Workload::new(7);
        let data = w.bytes(64 * 1024);
        let o = s.write(0, 0, 100, &data, SgShape::Contiguous, p);
        assert_eq!(o.status.base(), SrbStatus::SUCCESS, "{o:?}");
        assert_eq!(s.medium(0, 0, 100, 128), data);
        let (o, back) = s.read(0, 0, 100, 128, SgShape::Pages, p);
        assert_eq!(o.status.base(), SrbStatus::SUCCESS, "{o:?}");
        assert_eq!(back, data);
        let st = s.stats(0, p);
        assert!(st.remote_invalidate, "{st:?}");
        assert_eq!(st.remote_invalidations, 2, "{st:?}");
        assert_eq!(st.logins, 1);
    });
}
