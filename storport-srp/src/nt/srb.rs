//! A checked view of the request block StorPort hands a miniport: the classic
//! `SCSI_REQUEST_BLOCK`, or the extended `STORAGE_REQUEST_BLOCK` (an
//! `SRB_FUNCTION_STORAGE_REQUEST_BLOCK` function byte, a signature, and a
//! variable-length tail located by offsets).
//!
//! The extended block is self-describing, so it is treated like wire input:
//! every offset it carries is checked against its own `SrbLength` before it
//! is followed, and a block that fails a check is refused with a specific
//! [`SrbError`] instead of being read out of bounds.

use super::ffi::{
    PVOID, SCSI_REQUEST_BLOCK, SRB_FUNCTION_STORAGE_REQUEST_BLOCK, SRB_SIGNATURE,
    SRBEX_DATA_SCSI_CDB16, STOR_ADDR_BTL8, STOR_ADDR_BTL8_ADDRESS_LENGTH, STOR_ADDRESS_TYPE_BTL8,
    STORAGE_REQUEST_BLOCK, STORAGE_REQUEST_BLOCK_VERSION_1, SrbExDataTypeScsiCdb16,
};
use core::marker::PhantomData;
use core::mem::{offset_of, size_of};
use core::ptr::{NonNull, addr_of, addr_of_mut};

/// Bus (path), target and LUN: the same type the miniport core uses.
pub use crate::storport::Address;

/// Why a request block was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SrbError {
    /// The pointer was null.
    Null,
    /// An extended SRB without `SRB_SIGNATURE`.
    BadSignature,
    /// An extended SRB of a version this shim does not know.
    BadVersion,
    /// `SrbLength` smaller than the fixed part of the block.
    TooShort,
    /// `AddressOffset` outside the block, misaligned, or not a BTL8 address.
    BadAddress,
}

#[derive(Clone, Copy)]
enum Kind {
    Scsi(NonNull<SCSI_REQUEST_BLOCK>),
    Storage {
        srb: NonNull<STORAGE_REQUEST_BLOCK>,
        /// `SrbLength`, validated at construction.
        len: usize,
    },
}

/// One request, borrowed from StorPort for the duration of a callback.
pub struct Srb<'a> {
    kind: Kind,
    address: Address,
    _borrow: PhantomData<&'a mut u8>,
}

/// Offset of the `SrbExDataOffset` array in an extended SRB.
const EX_OFFSETS: usize = offset_of!(STORAGE_REQUEST_BLOCK, SrbExDataOffset);

impl<'a> Srb<'a> {
    /// Wraps the block StorPort passed to a callback, validating an extended
    /// block's signature, version, length and address.
    ///
    /// # Safety
    /// `raw` is null or points to a request block StorPort passed to the
    /// current miniport callback: valid and not accessed by anyone else for
    /// `'a`. For an extended block, its `SrbLength` bytes are part of the
    /// same allocation (StorPort's contract for `STORAGE_REQUEST_BLOCK`).
    pub unsafe fn from_raw(raw: PVOID) -> Result<Self, SrbError> {
        let base = NonNull::new(raw.cast::<u8>()).ok_or(SrbError::Null)?;
        // SAFETY: both SRB forms begin with `Length: u16, Function: u8`; the
        // caller guarantees at least the classic header is readable.
        let function = unsafe { base.as_ptr().add(2).read() };
        if function != SRB_FUNCTION_STORAGE_REQUEST_BLOCK as u8 {
            let srb = base.cast::<SCSI_REQUEST_BLOCK>();
            // SAFETY: a classic SRB, valid per the caller's contract.
            let (path, target, lun) = unsafe {
                let p = srb.as_ptr();
                ((*p).PathId, (*p).TargetId, (*p).Lun)
            };
            return Ok(Self {
                kind: Kind::Scsi(srb),
                address: Address { path, target, lun },
                _borrow: PhantomData,
            });
        }
        let srb = base.cast::<STORAGE_REQUEST_BLOCK>();
        let p = srb.as_ptr();
        // SAFETY: an extended SRB's fixed part is readable (caller contract).
        let (signature, version, srb_length, address_offset) = unsafe {
            (
                (*p).Signature,
                (*p).Version,
                (*p).SrbLength,
                (*p).AddressOffset,
            )
        };
        if signature != SRB_SIGNATURE as u32 {
            return Err(SrbError::BadSignature);
        }
        if version != STORAGE_REQUEST_BLOCK_VERSION_1 as u32 {
            return Err(SrbError::BadVersion);
        }
        let len = srb_length as usize;
        if len < size_of::<STORAGE_REQUEST_BLOCK>() {
            return Err(SrbError::TooShort);
        }
        let at = address_offset as usize;
        let fits = at
            .checked_add(size_of::<STOR_ADDR_BTL8>())
            .is_some_and(|end| end <= len);
        if at < EX_OFFSETS || !fits || at % align_of::<STOR_ADDR_BTL8>() != 0 {
            return Err(SrbError::BadAddress);
        }
        // SAFETY: `at..at + 16` lies inside the block's `SrbLength` bytes and
        // is 8-aligned (checked above).
        let addr = unsafe { base.as_ptr().add(at).cast::<STOR_ADDR_BTL8>().read() };
        if addr.Type != STOR_ADDRESS_TYPE_BTL8 as u16
            || addr.AddressLength < STOR_ADDR_BTL8_ADDRESS_LENGTH as u32
        {
            return Err(SrbError::BadAddress);
        }
        Ok(Self {
            kind: Kind::Storage { srb, len },
            address: Address {
                path: addr.Path,
                target: addr.Target,
                lun: addr.Lun,
            },
            _borrow: PhantomData,
        })
    }

    /// The raw pointer, to hand back to StorPort.
    #[must_use]
    pub fn as_raw(&self) -> PVOID {
        match self.kind {
            Kind::Scsi(p) => p.as_ptr().cast(),
            Kind::Storage { srb, .. } => srb.as_ptr().cast(),
        }
    }

    /// Whether this is an extended (`STORAGE_REQUEST_BLOCK`) request.
    #[must_use]
    pub fn is_extended(&self) -> bool {
        matches!(self.kind, Kind::Storage { .. })
    }

    /// The `SRB_FUNCTION_*` code.
    #[must_use]
    pub fn function(&self) -> u32 {
        match self.kind {
            // SAFETY: valid for 'a (construction contract).
            Kind::Scsi(p) => u32::from(unsafe { (*p.as_ptr()).Function }),
            // SAFETY: the fixed part of a validated extended SRB.
            Kind::Storage { srb, .. } => unsafe { (*srb.as_ptr()).SrbFunction },
        }
    }

    /// Where the request is addressed.
    #[must_use]
    pub fn address(&self) -> Address {
        self.address
    }

    /// The SCSI command descriptor block, when the request carries one this
    /// shim can read (classic SRBs; extended SRBs with a 16-byte-CDB block).
    #[must_use]
    pub fn cdb(&self) -> Option<&[u8]> {
        match self.kind {
            Kind::Scsi(p) => {
                // SAFETY: valid for 'a; `Cdb` is a 16-byte array in the block.
                let (cdb, len) =
                    unsafe { (&*addr_of!((*p.as_ptr()).Cdb), (*p.as_ptr()).CdbLength) };
                cdb.get(..usize::from(len).min(cdb.len()))
            }
            Kind::Storage { .. } => {
                let block = self.cdb16_block()?;
                // SAFETY: `cdb16_block` proved the block lies in the SRB.
                let (cdb, len) = unsafe { (&*addr_of!((*block).Cdb), (*block).CdbLength) };
                cdb.get(..usize::from(len).min(cdb.len()))
            }
        }
    }

    /// The first extended-data block of type `SrbExDataTypeScsiCdb16` that
    /// lies wholly inside the SRB, if any.
    fn cdb16_block(&self) -> Option<*mut SRBEX_DATA_SCSI_CDB16> {
        let Kind::Storage { srb, len } = self.kind else {
            return None;
        };
        let base = srb.as_ptr().cast::<u8>();
        // SAFETY: fixed part of a validated extended SRB.
        let count = unsafe { (*srb.as_ptr()).NumSrbExData } as usize;
        // Only as many offsets as fit inside `SrbLength` can exist.
        let max = (len - EX_OFFSETS) / size_of::<u32>();
        for i in 0..count.min(max) {
            // SAFETY: `EX_OFFSETS + 4 * i + 4 <= len` by the bound above, and
            // the array is 4-aligned (offset 120 of an 8-aligned block).
            let off = unsafe { base.add(EX_OFFSETS + 4 * i).cast::<u32>().read() } as usize;
            let fits = off
                .checked_add(size_of::<SRBEX_DATA_SCSI_CDB16>())
                .is_some_and(|end| end <= len);
            if !fits || off % align_of::<SRBEX_DATA_SCSI_CDB16>() != 0 || off < EX_OFFSETS {
                continue;
            }
            // SAFETY: `off..off + 40` is inside the block and 8-aligned.
            let block = unsafe { base.add(off) }.cast::<SRBEX_DATA_SCSI_CDB16>();
            // SAFETY: as above; `Type` is the first field.
            if unsafe { (*block).Type } as u32 == SrbExDataTypeScsiCdb16 as u32 {
                return Some(block);
            }
        }
        None
    }

    /// The current `SrbStatus`.
    #[must_use]
    pub fn srb_status(&self) -> u8 {
        match self.kind {
            // SAFETY: valid for 'a.
            Kind::Scsi(p) => unsafe { (*p.as_ptr()).SrbStatus },
            // SAFETY: valid for 'a.
            Kind::Storage { srb, .. } => unsafe { (*srb.as_ptr()).SrbStatus },
        }
    }

    /// Sets `SrbStatus` (an `SRB_STATUS_*` value), the result StorPort reads
    /// when the request completes.
    pub fn set_srb_status(&mut self, status: u8) {
        match self.kind {
            // SAFETY: valid and exclusively ours for 'a.
            Kind::Scsi(p) => unsafe { *addr_of_mut!((*p.as_ptr()).SrbStatus) = status },
            // SAFETY: valid and exclusively ours for 'a.
            Kind::Storage { srb, .. } => unsafe {
                *addr_of_mut!((*srb.as_ptr()).SrbStatus) = status
            },
        }
    }

    /// Sets the SCSI status byte the target returned (extended SRBs keep it
    /// in their CDB block; without one there is nowhere to put it).
    pub fn set_scsi_status(&mut self, status: u8) {
        match self.kind {
            // SAFETY: valid and exclusively ours for 'a.
            Kind::Scsi(p) => unsafe { *addr_of_mut!((*p.as_ptr()).ScsiStatus) = status },
            Kind::Storage { .. } => {
                if let Some(block) = self.cdb16_block() {
                    // SAFETY: inside the SRB (checked by `cdb16_block`).
                    unsafe { *addr_of_mut!((*block).ScsiStatus) = status };
                }
            }
        }
    }

    /// `DataTransferLength`: the buffer size on entry, the bytes moved on
    /// completion.
    #[must_use]
    pub fn data_transfer_length(&self) -> u32 {
        match self.kind {
            // SAFETY: valid for 'a.
            Kind::Scsi(p) => unsafe { (*p.as_ptr()).DataTransferLength },
            // SAFETY: valid for 'a.
            Kind::Storage { srb, .. } => unsafe { (*srb.as_ptr()).DataTransferLength },
        }
    }

    /// Reports how many bytes were actually transferred.
    pub fn set_data_transfer_length(&mut self, len: u32) {
        match self.kind {
            // SAFETY: valid and exclusively ours for 'a.
            Kind::Scsi(p) => unsafe { *addr_of_mut!((*p.as_ptr()).DataTransferLength) = len },
            // SAFETY: valid and exclusively ours for 'a.
            Kind::Storage { srb, .. } => unsafe {
                *addr_of_mut!((*srb.as_ptr()).DataTransferLength) = len;
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nt::ffi::{SRB_FUNCTION_EXECUTE_SCSI, SRB_FUNCTION_RESET_BUS};

    /// An 8-aligned buffer to build extended SRBs in.
    #[repr(C, align(8))]
    struct Block([u8; 256]);

    fn put32(b: &mut Block, at: usize, v: u32) {
        b.0[at..at + 4].copy_from_slice(&v.to_le_bytes());
    }

    /// An extended INQUIRY to 0/3/1 with one CDB16 block, as StorPort lays it
    /// out: header, BTL8 address at 128, CDB16 block at 144.
    fn extended_inquiry() -> Block {
        let mut b = Block([0; 256]);
        b.0[2] = SRB_FUNCTION_STORAGE_REQUEST_BLOCK as u8;
        put32(&mut b, 8, SRB_SIGNATURE as u32);
        put32(&mut b, 12, STORAGE_REQUEST_BLOCK_VERSION_1 as u32);
        put32(&mut b, 16, 184); // SrbLength
        put32(&mut b, 20, SRB_FUNCTION_EXECUTE_SCSI as u32);
        put32(&mut b, 52, 128); // AddressOffset
        put32(&mut b, 56, 1); // NumSrbExData
        put32(&mut b, 60, 96); // DataTransferLength
        put32(&mut b, 120, 144); // SrbExDataOffset[0]
        b.0[128..130].copy_from_slice(&(STOR_ADDRESS_TYPE_BTL8 as u16).to_le_bytes());
        put32(&mut b, 132, 4);
        b.0[136..139].copy_from_slice(&[0, 3, 1]);
        put32(&mut b, 144, SrbExDataTypeScsiCdb16 as u32);
        put32(&mut b, 148, 32);
        b.0[154] = 6; // CdbLength
        b.0[168..174].copy_from_slice(&[0x12, 0, 0, 0, 96, 0]);
        b
    }

    fn view(b: &mut Block) -> Result<Srb<'_>, SrbError> {
        // SAFETY: the block is ours, 256 bytes, 8-aligned, and SrbLength
        // never exceeds 256 in these tests.
        unsafe { Srb::from_raw(b.0.as_mut_ptr().cast()) }
    }

    #[test]
    fn classic_srb_fields() {
        let mut srb = SCSI_REQUEST_BLOCK::default();
        srb.Function = SRB_FUNCTION_EXECUTE_SCSI as u8;
        srb.PathId = 0;
        srb.TargetId = 5;
        srb.Lun = 2;
        srb.CdbLength = 6;
        srb.Cdb[0] = 0x12;
        srb.DataTransferLength = 36;
        // SAFETY: a live local SRB.
        let mut v = unsafe { Srb::from_raw((&raw mut srb).cast()) }.unwrap();
        assert!(!v.is_extended());
        assert_eq!(v.function(), SRB_FUNCTION_EXECUTE_SCSI);
        assert_eq!(
            v.address(),
            Address {
                path: 0,
                target: 5,
                lun: 2
            }
        );
        assert_eq!(v.cdb(), Some(&[0x12, 0, 0, 0, 0, 0][..]));
        v.set_srb_status(0x0A);
        v.set_scsi_status(2);
        v.set_data_transfer_length(0);
        assert_eq!(
            (srb.SrbStatus, srb.ScsiStatus, srb.DataTransferLength),
            (0x0A, 2, 0)
        );
    }

    #[test]
    fn classic_cdb_length_is_clamped() {
        let mut srb = SCSI_REQUEST_BLOCK::default();
        srb.CdbLength = 200;
        // SAFETY: a live local SRB.
        let v = unsafe { Srb::from_raw((&raw mut srb).cast()) }.unwrap();
        assert_eq!(v.cdb().map(<[u8]>::len), Some(16));
    }

    #[test]
    fn extended_srb_fields() {
        let mut b = extended_inquiry();
        let mut v = view(&mut b).unwrap();
        assert!(v.is_extended());
        assert_eq!(v.function(), SRB_FUNCTION_EXECUTE_SCSI);
        assert_eq!(
            v.address(),
            Address {
                path: 0,
                target: 3,
                lun: 1
            }
        );
        assert_eq!(v.cdb(), Some(&[0x12, 0, 0, 0, 96, 0][..]));
        assert_eq!(v.data_transfer_length(), 96);
        v.set_srb_status(0x0A);
        v.set_scsi_status(2);
        v.set_data_transfer_length(0);
        drop(v);
        assert_eq!(b.0[3], 0x0A);
        assert_eq!(b.0[152], 2);
        assert_eq!(&b.0[60..64], &[0, 0, 0, 0]);
    }

    #[test]
    fn null_is_refused() {
        // SAFETY: null is allowed by the contract.
        assert_eq!(
            unsafe { Srb::from_raw(core::ptr::null_mut()) }.err(),
            Some(SrbError::Null)
        );
    }

    #[test]
    fn malformed_extended_blocks_get_specific_errors() {
        let cases: [(fn(&mut Block), SrbError); 6] = [
            (|b| put32(b, 8, 0x1234_5678), SrbError::BadSignature),
            (|b| put32(b, 12, 0x11), SrbError::BadVersion),
            (|b| put32(b, 16, 64), SrbError::TooShort),
            (|b| put32(b, 52, 180), SrbError::BadAddress),
            (|b| put32(b, 52, 130), SrbError::BadAddress),
            (|b| b.0[128] = 7, SrbError::BadAddress),
        ];
        for (spoil, expected) in cases {
            let mut b = extended_inquiry();
            spoil(&mut b);
            assert_eq!(view(&mut b).err(), Some(expected));
        }
    }

    #[test]
    fn extended_data_offsets_outside_the_block_are_ignored() {
        // An offset past SrbLength, a misaligned one, and a count far larger
        // than the block can hold: no CDB, no out-of-bounds read.
        for (offset, count) in [(170, 1), (146, 1), (144, u32::MAX)] {
            let mut b = extended_inquiry();
            put32(&mut b, 120, offset);
            put32(&mut b, 56, count);
            let v = view(&mut b).unwrap();
            if offset == 144 {
                assert!(v.cdb().is_some());
            } else {
                assert_eq!(v.cdb(), None);
            }
        }
    }

    #[test]
    fn extended_non_scsi_function() {
        let mut b = extended_inquiry();
        put32(&mut b, 20, SRB_FUNCTION_RESET_BUS);
        put32(&mut b, 56, 0);
        let v = view(&mut b).unwrap();
        assert_eq!(v.function(), SRB_FUNCTION_RESET_BUS);
        assert_eq!(v.cdb(), None);
    }
}
