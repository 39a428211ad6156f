//! Send-side gather lists both RDMA engines build: immediate write data
//! sent from the request's own buffer, so the HCA gathers it and the CPU
//! copies nothing.

use hca_lowlevel::wqe::{CtrlSegRepr, DataSegRepr, WQEBB_SIZE};
use kverbs::wr::Sge;

use crate::storport::SgElement;

/// Most gather entries immediate data takes besides the PDU/IU header's:
/// with the header's, seven data segments — a SEND of two WQEBBs.
pub const IMM_DATA_SGES: usize = 6;

/// The first `len` bytes of `sg_list` as gather entries under `lkey` (the
/// device's reserved lkey: the addresses are bus addresses) in `out`; how
/// many, or `None` when the list is shorter than `len` or needs more
/// entries than `out` holds (the caller then copies).
///
/// # IRQL
///
/// Any; touches only its arguments.
#[must_use]
pub fn gather_prefix(sg_list: &[SgElement], len: u32, lkey: u32, out: &mut [Sge]) -> Option<usize> {
    let mut left = len;
    let mut n = 0;
    for element in sg_list {
        if left == 0 {
            break;
        }
        let take = element.len.min(left);
        if take == 0 {
            continue;
        }
        *out.get_mut(n)? = Sge {
            addr: element.phys.get(),
            len: take,
            lkey,
        };
        n += 1;
        left -= take;
    }
    (left == 0).then_some(n)
}

/// WQEBBs a SEND with `sges` gather entries occupies on the send queue.
#[must_use]
pub fn send_wqebbs(sges: usize) -> u32 {
    u32::try_from((CtrlSegRepr::LEN + sges * DataSegRepr::LEN).div_ceil(WQEBB_SIZE))
        .unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use hca_lowlevel::dma::PhysAddr;

    fn sg(phys: u64, len: u32) -> SgElement {
        SgElement {
            phys: PhysAddr(phys),
            len,
        }
    }

    #[test]
    fn gathers_exactly_the_prefix() {
        let list = [sg(0x1000, 0x100), sg(0x5000, 0x100), sg(0x9000, 0x100)];
        let mut out = [Sge::default(); IMM_DATA_SGES];
        assert_eq!(gather_prefix(&list, 0x180, 7, &mut out), Some(2));
        assert_eq!((out[0].addr, out[0].len, out[0].lkey), (0x1000, 0x100, 7));
        assert_eq!((out[1].addr, out[1].len), (0x5000, 0x80), "cut at len");
        // Empty elements are skipped, not sent as zero-length entries.
        let holes = [sg(0x1000, 0), sg(0x2000, 0x1000)];
        assert_eq!(gather_prefix(&holes, 0x1000, 1, &mut out), Some(1));
        assert_eq!(out[0].addr, 0x2000);
        assert_eq!(gather_prefix(&holes, 0, 1, &mut out), Some(0));
    }

    #[test]
    fn refuses_a_short_list_or_too_many_entries() {
        let list = [sg(0x1000, 0x100), sg(0x5000, 0x100), sg(0x9000, 0x100)];
        let mut out = [Sge::default(); IMM_DATA_SGES];
        assert_eq!(gather_prefix(&list, 0x301, 7, &mut out), None, "short");
        assert_eq!(gather_prefix(&[], 1, 7, &mut out), None);
        assert_eq!(gather_prefix(&list, 0x201, 7, &mut out[..2]), None, "room");
        assert_eq!(gather_prefix(&list, 0x200, 7, &mut out[..2]), Some(2));
    }

    #[test]
    fn send_wqebbs_counts_control_and_data_segments() {
        // 16-byte control segment, 16 bytes per gather entry, 64-byte WQEBBs.
        assert_eq!(send_wqebbs(1), 1);
        assert_eq!(send_wqebbs(3), 1);
        assert_eq!(send_wqebbs(4), 2);
        assert_eq!(send_wqebbs(1 + IMM_DATA_SGES), 2);
    }
}
