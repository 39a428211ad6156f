//! Receive work queue entries in the mlx5 layout.
//!
//! A receive WQE is nothing but data segments ([`crate::wqe::DataSeg`]) in a
//! slot of `stride = 2^wqe_shift` bytes. If fewer segments than fit are used,
//! the list ends with a terminator segment: byte count 0, lkey
//! [`INVALID_LKEY`] (0x100), address 0.

#![forbid(unsafe_code)]

use heapless::Vec;

use crate::bytes::get_be32;
use crate::view::FormatError;
use crate::wqe::{DataSeg, DataSegRepr};

/// The lkey that terminates a receive WQE's segment list (`MLX5_INVALID_LKEY`).
pub const INVALID_LKEY: u32 = 0x100;
/// Most scatter segments in one receive WQE.
pub const MAX_RECV_SGE: usize = 16;

/// The terminator segment.
pub const TERMINATOR: DataSegRepr = DataSegRepr {
    byte_count: 0,
    lkey: INVALID_LKEY,
    addr: 0,
};

/// A decoded receive WQE: its scatter list.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct RecvWqe {
    /// Scatter segments in order (terminator excluded).
    pub sges: Vec<DataSegRepr, MAX_RECV_SGE>,
}

impl RecvWqe {
    /// Decodes a receive WQE slot (`stride` bytes): segments up to the
    /// terminator or the end of the slot.
    ///
    /// # Errors
    /// [`FormatError::Truncated`] for a slot that is not a multiple of 16
    /// bytes, [`FormatError::TooManySegments`], [`FormatError::BadInline`] for
    /// an inline header (receive WQEs have none).
    pub fn parse(slot: &[u8]) -> Result<Self, FormatError> {
        if slot.len() % DataSegRepr::LEN != 0 {
            return Err(FormatError::Truncated);
        }
        let mut out = Self::default();
        for chunk in slot.chunks_exact(DataSegRepr::LEN) {
            if get_be32(chunk, 4) == INVALID_LKEY {
                break;
            }
            let d = DataSegRepr::parse(&DataSeg::new_checked(chunk)?)?;
            out.sges.push(d).map_err(|_| FormatError::TooManySegments)?;
        }
        Ok(out)
    }

    /// Total bytes the WQE can receive.
    #[must_use]
    pub fn capacity(&self) -> u64 {
        self.sges.iter().map(|d| u64::from(d.byte_count)).sum()
    }
}

/// Writes `sges` (plus a terminator if they do not fill the slot) into
/// `slot`; returns the bytes written.
///
/// # Errors
/// [`FormatError::WqeTooLarge`] if the segments do not fit the slot.
pub fn emit_recv_wqe(sges: &[DataSegRepr], slot: &mut [u8]) -> Result<usize, FormatError> {
    let cap = slot.len() / DataSegRepr::LEN;
    if sges.len() > cap {
        return Err(FormatError::WqeTooLarge);
    }
    let mut chunks = slot.chunks_exact_mut(DataSegRepr::LEN);
    for (d, chunk) in sges.iter().zip(&mut chunks) {
        d.emit(&mut DataSeg::new_unchecked(chunk));
    }
    let mut n = sges.len() * DataSegRepr::LEN;
    if let Some(chunk) = chunks.next() {
        TERMINATOR.emit(&mut DataSeg::new_unchecked(chunk));
        n += DataSegRepr::LEN;
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terminator_golden_bytes() {
        let mut slot = [0xeeu8; 48];
        let n = emit_recv_wqe(
            &[DataSegRepr {
                byte_count: 0x40,
                lkey: 7,
                addr: 0x1000,
            }],
            &mut slot,
        )
        .unwrap();
        assert_eq!(n, 32);
        assert_eq!(
            &slot[..16],
            &[0, 0, 0, 0x40, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0x10, 0]
        );
        assert_eq!(
            &slot[16..32],
            &[0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0]
        );
        // The third segment is left alone.
        assert_eq!(&slot[32..], &[0xee; 16]);
        let w = RecvWqe::parse(&slot).unwrap();
        assert_eq!(w.sges.len(), 1);
        assert_eq!(w.capacity(), 0x40);
    }

    #[test]
    fn full_slot_needs_no_terminator() {
        let segs = [DataSegRepr {
            byte_count: 1,
            lkey: 2,
            addr: 3,
        }; 2];
        let mut slot = [0u8; 32];
        assert_eq!(emit_recv_wqe(&segs, &mut slot).unwrap(), 32);
        assert_eq!(RecvWqe::parse(&slot).unwrap().sges.len(), 2);
        assert_eq!(
            emit_recv_wqe(&[segs[0]; 3], &mut slot),
            Err(FormatError::WqeTooLarge)
        );
        assert_eq!(RecvWqe::parse(&slot[..20]), Err(FormatError::Truncated));
        let mut inl = slot;
        inl[0] = 0x80;
        assert_eq!(RecvWqe::parse(&inl), Err(FormatError::BadInline));
    }
}
