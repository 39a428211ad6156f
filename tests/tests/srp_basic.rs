//! Full stack, the basics: login, INQUIRY / READ CAPACITY / REPORT LUNS
//! through the StorPort model, and data written and read back.

use std::time::Duration;

use kverbs::platform::host::VerifierAllocator;
use kverbs_tests::{Stack, StackConfig, Workload};
use storport_srp::storport::SrbStatus;
use storport_srp::storport::host::SgShape;

#[global_allocator]
static ALLOCATOR: VerifierAllocator = VerifierAllocator;

#[test]
fn login_inquiry_capacity_and_one_write_read() {
    Stack::run(&StackConfig::default(), |s, p| {
        let (o, data) = s.inquiry(0, 0, p);
        // 36 bytes of standard data for a 96-byte buffer: an underrun,
        // which Windows reports as DATA_OVERRUN with the length moved.
        assert_eq!(o.status.base(), SrbStatus::DATA_OVERRUN, "{o:?}");
        assert_eq!(o.data_transfer_length, 36);
        assert!(data.len() >= 36);
        assert_eq!(data[0] & 0x1f, 0, "direct access block device");
        let (o, data) = s.read_capacity(0, 1, p);
        assert_eq!(o.status.base(), SrbStatus::SUCCESS, "{o:?}");
        assert_eq!(u64::from_be_bytes(data[0..8].try_into().unwrap()), 4095);
        assert_eq!(u32::from_be_bytes(data[8..12].try_into().unwrap()), 4096);
        let (o, data) = s.report_luns(0, p);
        assert!(
            matches!(
                o.status.base(),
                SrbStatus::SUCCESS | SrbStatus::DATA_OVERRUN
            ),
            "{o:?}"
        );
        let list = storport_srp::scsi::ReportLunsData::new_checked(&data[..]).unwrap();
        let luns: Vec<_> = list.luns().map(|l| l.index()).collect();
        assert_eq!(luns, vec![Some(0), Some(1)]);
        // A LUN the target does not have: INQUIRY answers "not present".
        let (o, data) = s.inquiry(0, 3, p);
        assert!(matches!(
            o.status.base(),
            SrbStatus::SUCCESS | SrbStatus::DATA_OVERRUN
        ));
        assert_eq!(data[0], 0x7f, "peripheral qualifier 011b, type 1Fh");
        let mut w = Workload::new(7);
        let bytes = w.bytes(8192);
        let o = s.write(0, 0, 100, &bytes, SgShape::Contiguous, p);
        assert_eq!(o.status.base(), SrbStatus::SUCCESS, "{o:?}");
        assert_eq!(s.medium(0, 0, 100, 16), bytes);
        let (o, back) = s.read(0, 0, 100, 16, SgShape::Pages, p);
        assert_eq!(o.status.base(), SrbStatus::SUCCESS, "{o:?}");
        assert_eq!(back, bytes);
        let st = s.stats(0, p);
        assert_eq!(st.completed, 6);
        assert!(st.req_lim > 1 && st.zero_req_lim == 0, "{st:?}");
        let _ = Duration::ZERO;
    });
}
