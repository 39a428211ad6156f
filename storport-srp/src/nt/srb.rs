//! The request block StorPort hands a miniport, as the core's
//! [`Srb`](crate::storport::Srb): the classic `SCSI_REQUEST_BLOCK` or the
//! extended `STORAGE_REQUEST_BLOCK` (an `SRB_FUNCTION_STORAGE_REQUEST_BLOCK`
//! function byte, a signature, and a variable-length tail located by
//! offsets).
//!
//! The extended block is self-describing, so it is treated like wire input:
//! every offset it carries is checked against its own `SrbLength` before it
//! is followed, and a block that fails a check is refused with a specific
//! [`SrbError`] instead of being read out of bounds. Every field access goes
//! through [`Block`], which checks the access against the block's length,
//! so no accessor can read outside the request.
//!
//! # The request's extension
//! StorPort gives each request `SrbExtensionSize` bytes of miniport
//! scratch (`SrbExtension` in the classic form, `MiniportContext` in the
//! extended one). The shim registers it as the core's words
//! ([`HwMiniport::SRB_EXTENSION_WORDS`](crate::storport::HwMiniport)) followed by
//! a [`ShimArea`]: the device extension (so a DMA ExecutionRoutine, which
//! gets only the request, finds its adapter), the DMA list to release, and
//! the scatter/gather list converted to the core's [`SgElement`]s.

use core::mem::{MaybeUninit, offset_of, size_of};
use core::ptr::NonNull;
use core::sync::atomic::AtomicU64;

use super::ffi::{
    SCATTER_GATHER_LIST, SCSI_PNP_REQUEST_BLOCK, SCSI_REQUEST_BLOCK, SRB_FLAGS_QUEUE_ACTION_ENABLE,
    SRB_FUNCTION_PNP, SRB_FUNCTION_STORAGE_REQUEST_BLOCK, SRB_SIGNATURE, SRBEX_DATA_PNP,
    SRBEX_DATA_SCSI_CDB16, STOR_ADDR_BTL8, STOR_ADDR_BTL8_ADDRESS_LENGTH, STOR_ADDRESS_TYPE_BTL8,
    STORAGE_REQUEST_BLOCK, STORAGE_REQUEST_BLOCK_VERSION_1, SrbExDataTypePnP,
    SrbExDataTypeScsiCdb16,
};
use crate::storport::{
    AbortTarget, Address, DataAccessError, DataDirection, PnpAction, QueueAction, SgElement,
    SrbFunction, SrbIdentity, SrbStatus,
};

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

/// Most scatter/gather elements one request may have: the shim tells
/// StorPort `NumberOfPhysicalBreaks` = this minus one, and keeps this many
/// converted elements in each request's [`ShimArea`].
pub const MAX_SG_ELEMENTS: usize = 257;

/// The shim's part of a request's extension, after the core's words.
#[repr(C)]
pub struct ShimArea {
    /// The adapter's device extension.
    pub device_extension: *mut core::ffi::c_void,
    /// The DMA adapter's list for this request, to release; null = none.
    pub dma_list: *mut SCATTER_GATHER_LIST,
    /// Valid entries of `elements`; `u32::MAX` = no list delivered.
    pub element_count: u32,
    /// The list, converted.
    pub elements: [MaybeUninit<SgElement>; MAX_SG_ELEMENTS],
}

/// How a request's extension is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExtensionLayout {
    /// The core's words (`SRB_EXTENSION_WORDS`).
    pub core_words: usize,
}

impl ExtensionLayout {
    /// `SrbExtensionSize`: the core's words, then the shim's area.
    #[must_use]
    pub const fn size(self) -> usize {
        self.core_words * size_of::<u64>() + size_of::<ShimArea>()
    }
}

/// A bounds-checked view of `len` bytes of kernel memory.
///
/// # Invariants
/// `base..base + len` is valid for reads and writes for the life of the
/// view (the request StorPort handed over, until it is completed), and
/// nobody else accesses it meanwhile except through atomics.
#[derive(Clone, Copy)]
struct Block {
    base: NonNull<u8>,
    len: usize,
}

impl Block {
    /// A plain value at `at`, if it lies inside.
    fn read<T: Copy>(&self, at: usize) -> Option<T> {
        let end = at.checked_add(size_of::<T>())?;
        if end > self.len {
            return None;
        }
        // SAFETY: `at..end` lies inside the block (checked), which is valid
        // for reads (invariant); unaligned reads are allowed.
        Some(unsafe {
            self.base
                .as_ptr()
                .wrapping_add(at)
                .cast::<T>()
                .read_unaligned()
        })
    }

    /// Writes a plain value at `at`; `false` if it does not fit.
    fn write<T: Copy>(&self, at: usize, value: T) -> bool {
        let Some(end) = at.checked_add(size_of::<T>()) else {
            return false;
        };
        if end > self.len {
            return false;
        }
        // SAFETY: inside the block (checked), valid for writes (invariant).
        unsafe {
            self.base
                .as_ptr()
                .wrapping_add(at)
                .cast::<T>()
                .write_unaligned(value)
        };
        true
    }

    /// A pointer field.
    fn pointer(&self, at: usize) -> Option<NonNull<u8>> {
        NonNull::new(self.read::<*mut u8>(at)?)
    }
}

/// Field offsets of the two forms.
mod field {
    use super::{SCSI_PNP_REQUEST_BLOCK, SCSI_REQUEST_BLOCK, STORAGE_REQUEST_BLOCK};
    use core::mem::offset_of;

    // Both forms start `u16 Length, u8 Function, u8 SrbStatus`.
    pub const FUNCTION: usize = 2;
    pub const SRB_STATUS: usize = 3;

    pub const SCSI_STATUS: usize = offset_of!(SCSI_REQUEST_BLOCK, ScsiStatus);
    pub const PATH: usize = offset_of!(SCSI_REQUEST_BLOCK, PathId);
    pub const TARGET: usize = offset_of!(SCSI_REQUEST_BLOCK, TargetId);
    pub const LUN: usize = offset_of!(SCSI_REQUEST_BLOCK, Lun);
    pub const QUEUE_TAG: usize = offset_of!(SCSI_REQUEST_BLOCK, QueueTag);
    pub const QUEUE_ACTION: usize = offset_of!(SCSI_REQUEST_BLOCK, QueueAction);
    pub const CDB_LENGTH: usize = offset_of!(SCSI_REQUEST_BLOCK, CdbLength);
    pub const SENSE_LENGTH: usize = offset_of!(SCSI_REQUEST_BLOCK, SenseInfoBufferLength);
    pub const FLAGS: usize = offset_of!(SCSI_REQUEST_BLOCK, SrbFlags);
    pub const TRANSFER_LENGTH: usize = offset_of!(SCSI_REQUEST_BLOCK, DataTransferLength);
    pub const TIMEOUT: usize = offset_of!(SCSI_REQUEST_BLOCK, TimeOutValue);
    pub const DATA_BUFFER: usize = offset_of!(SCSI_REQUEST_BLOCK, DataBuffer);
    pub const SENSE_BUFFER: usize = offset_of!(SCSI_REQUEST_BLOCK, SenseInfoBuffer);
    pub const NEXT_SRB: usize = offset_of!(SCSI_REQUEST_BLOCK, NextSrb);
    pub const EXTENSION: usize = offset_of!(SCSI_REQUEST_BLOCK, SrbExtension);
    pub const CDB: usize = offset_of!(SCSI_REQUEST_BLOCK, Cdb);
    pub const PNP_ACTION: usize = offset_of!(SCSI_PNP_REQUEST_BLOCK, PnPAction);

    pub const EX_SIGNATURE: usize = offset_of!(STORAGE_REQUEST_BLOCK, Signature);
    pub const EX_VERSION: usize = offset_of!(STORAGE_REQUEST_BLOCK, Version);
    pub const EX_LENGTH: usize = offset_of!(STORAGE_REQUEST_BLOCK, SrbLength);
    pub const EX_FUNCTION: usize = offset_of!(STORAGE_REQUEST_BLOCK, SrbFunction);
    pub const EX_FLAGS: usize = offset_of!(STORAGE_REQUEST_BLOCK, SrbFlags);
    pub const EX_TAG: usize = offset_of!(STORAGE_REQUEST_BLOCK, RequestTag);
    pub const EX_ATTRIBUTE: usize = offset_of!(STORAGE_REQUEST_BLOCK, RequestAttribute);
    pub const EX_TIMEOUT: usize = offset_of!(STORAGE_REQUEST_BLOCK, TimeOutValue);
    pub const EX_ADDRESS_OFFSET: usize = offset_of!(STORAGE_REQUEST_BLOCK, AddressOffset);
    pub const EX_DATA_COUNT: usize = offset_of!(STORAGE_REQUEST_BLOCK, NumSrbExData);
    pub const EX_TRANSFER_LENGTH: usize = offset_of!(STORAGE_REQUEST_BLOCK, DataTransferLength);
    pub const EX_DATA_BUFFER: usize = offset_of!(STORAGE_REQUEST_BLOCK, DataBuffer);
    pub const EX_MINIPORT_CONTEXT: usize = offset_of!(STORAGE_REQUEST_BLOCK, MiniportContext);
    pub const EX_NEXT_SRB: usize = offset_of!(STORAGE_REQUEST_BLOCK, NextSrb);
    pub const EX_DATA_OFFSETS: usize = offset_of!(STORAGE_REQUEST_BLOCK, SrbExDataOffset);
}

/// Offsets inside an extended-data block.
mod exfield {
    use super::{SRBEX_DATA_PNP, SRBEX_DATA_SCSI_CDB16, STOR_ADDR_BTL8};
    use core::mem::offset_of;

    pub const TYPE: usize = 0;
    pub const CDB16_SCSI_STATUS: usize = offset_of!(SRBEX_DATA_SCSI_CDB16, ScsiStatus);
    pub const CDB16_SENSE_LENGTH: usize = offset_of!(SRBEX_DATA_SCSI_CDB16, SenseInfoBufferLength);
    pub const CDB16_CDB_LENGTH: usize = offset_of!(SRBEX_DATA_SCSI_CDB16, CdbLength);
    pub const CDB16_SENSE_BUFFER: usize = offset_of!(SRBEX_DATA_SCSI_CDB16, SenseInfoBuffer);
    pub const CDB16_CDB: usize = offset_of!(SRBEX_DATA_SCSI_CDB16, Cdb);
    pub const PNP_ACTION: usize = offset_of!(SRBEX_DATA_PNP, PnPAction);
    pub const BTL8_TYPE: usize = offset_of!(STOR_ADDR_BTL8, Type);
    pub const BTL8_LENGTH: usize = offset_of!(STOR_ADDR_BTL8, AddressLength);
    pub const BTL8_PATH: usize = offset_of!(STOR_ADDR_BTL8, Path);
    pub const BTL8_TARGET: usize = offset_of!(STOR_ADDR_BTL8, Target);
    pub const BTL8_LUN: usize = offset_of!(STOR_ADDR_BTL8, Lun);
}

/// The CDB array of either form holds at most 16 bytes here (the extended
/// 32-byte and variable CDB blocks are not read: no such request reaches a
/// SCSI initiator of disks).
const CDB_CAPACITY: usize = 16;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Form {
    Classic,
    Extended {
        /// Offset of the first `SrbExDataTypeScsiCdb16` block, if any.
        cdb16: Option<usize>,
        /// Offset of the first `SrbExDataTypePnP` block, if any.
        pnp: Option<usize>,
    },
}

/// One request, owned by the miniport from `HwStartIo` (or the DMA
/// ExecutionRoutine) until it is completed: the NT implementation of the
/// core's [`Srb`](crate::storport::Srb).
///
/// # Invariants
/// `block` is the request StorPort handed over and has not been completed;
/// `extension`, when present, points to `core_words` 8-aligned words
/// followed by a [`ShimArea`], all of this request's extension.
pub struct NtSrb {
    block: Block,
    form: Form,
    address: Address,
    extension: Option<NonNull<AtomicU64>>,
    core_words: usize,
}

// SAFETY: the handle owns the request exclusively until it is completed
// (StorPort does not touch it meanwhile), so moving it to another processor
// moves that ownership; the kernel memory behind it is not thread-bound.
unsafe impl Send for NtSrb {}

/// Whether the request at `base` is in the extended form (its function
/// byte; both forms start `u16 Length, u8 Function`).
///
/// # Safety
/// `base` points to a request block (at least its first 4 bytes readable).
unsafe fn is_extended_at(base: NonNull<u8>) -> bool {
    // INVARIANT: 4 header bytes (caller contract).
    let header = Block { base, len: 4 };
    header
        .read::<u8>(field::FUNCTION)
        .is_some_and(|f| u32::from(f) == u32::from(SRB_FUNCTION_STORAGE_REQUEST_BLOCK))
}

/// The fixed part of a request block in the form its function byte says.
///
/// # Safety
/// `base` points to a request block StorPort gave this miniport.
unsafe fn fixed_part(base: NonNull<u8>) -> (Block, bool) {
    // SAFETY: the caller's contract.
    let extended = unsafe { is_extended_at(base) };
    let len = if extended {
        size_of::<STORAGE_REQUEST_BLOCK>()
    } else {
        size_of::<SCSI_REQUEST_BLOCK>()
    };
    // INVARIANT: the fixed part of the form the block says it is.
    (Block { base, len }, extended)
}

/// The extension pointer of a request block, if StorPort gave one and it
/// is 8-aligned.
fn extension_of(block: &Block, extended: bool) -> Option<NonNull<AtomicU64>> {
    let at = if extended {
        field::EX_MINIPORT_CONTEXT
    } else {
        field::EXTENSION
    };
    let p = block.pointer(at)?;
    p.as_ptr()
        .cast::<AtomicU64>()
        .is_aligned()
        .then(|| p.cast())
}

/// Whether the extended SRB's `i`-th data block at `offset` lies inside and
/// is of `kind`, with room for `size` bytes.
fn ex_block_of(block: &Block, offset: usize, kind: u32, size: usize) -> bool {
    let fits = offset.checked_add(size).is_some_and(|end| end <= block.len);
    fits && offset >= field::EX_DATA_OFFSETS
        && offset % 8 == 0
        && block.read::<u32>(offset + exfield::TYPE) == Some(kind)
}

impl NtSrb {
    /// Takes over the block StorPort passed to a callback, validating an
    /// extended block's signature, version, length and address. `fresh`
    /// means the request was just issued (StartIo), so the shim's area of
    /// its extension is reset; the DMA ExecutionRoutine passes `false` to
    /// find it as `get_scatter_gather_list` left it.
    ///
    /// # Safety
    /// `raw` is null or a request block StorPort passed to this miniport and
    /// that has not been completed: valid, and not accessed by anyone else
    /// until the handle is completed or dropped. For an extended block, its
    /// `SrbLength` bytes are part of the same allocation (StorPort's
    /// contract for `STORAGE_REQUEST_BLOCK`). Its extension, if any, is
    /// `layout.size()` bytes.
    pub unsafe fn from_raw(
        raw: *mut core::ffi::c_void,
        layout: ExtensionLayout,
        fresh: bool,
    ) -> Result<Self, SrbError> {
        let base = NonNull::new(raw.cast::<u8>()).ok_or(SrbError::Null)?;
        // SAFETY: a request block (caller contract).
        let (block, extended) = unsafe { fixed_part(base) };
        let (block, form, address) = if extended {
            Self::validate_extended(base)?
        } else {
            let address = Address::new(
                block.read(field::PATH).unwrap_or(0),
                block.read(field::TARGET).unwrap_or(0),
                block.read(field::LUN).unwrap_or(0),
            );
            (block, Form::Classic, address)
        };
        let srb = NtSrb {
            block,
            form,
            address,
            extension: extension_of(&block, matches!(form, Form::Extended { .. })),
            core_words: layout.core_words,
        };
        if fresh {
            if let Some(shim) = srb.shim() {
                // SAFETY: the request's own extension (invariant), exclusive.
                unsafe {
                    shim.as_ptr()
                        .cast::<u8>()
                        .write_bytes(0, offset_of!(ShimArea, elements));
                }
                srb.set_elements(None);
            }
        }
        Ok(srb)
    }

    fn validate_extended(base: NonNull<u8>) -> Result<(Block, Form, Address), SrbError> {
        let fixed = Block {
            base,
            len: size_of::<STORAGE_REQUEST_BLOCK>(),
        };
        let read = |at| fixed.read::<u32>(at).ok_or(SrbError::TooShort);
        if read(field::EX_SIGNATURE)? != SRB_SIGNATURE {
            return Err(SrbError::BadSignature);
        }
        if read(field::EX_VERSION)? != STORAGE_REQUEST_BLOCK_VERSION_1 {
            return Err(SrbError::BadVersion);
        }
        let len = read(field::EX_LENGTH)? as usize;
        if len < size_of::<STORAGE_REQUEST_BLOCK>() {
            return Err(SrbError::TooShort);
        }
        // INVARIANT: StorPort's contract: `SrbLength` bytes are the block.
        let block = Block { base, len };
        let at = read(field::EX_ADDRESS_OFFSET)? as usize;
        if at < field::EX_DATA_OFFSETS || at % 8 != 0 {
            return Err(SrbError::BadAddress);
        }
        let address_type = block.read::<u16>(at + exfield::BTL8_TYPE);
        let address_length = block.read::<u32>(at + exfield::BTL8_LENGTH);
        let fits = at
            .checked_add(size_of::<STOR_ADDR_BTL8>())
            .is_some_and(|end| end <= len);
        if !fits
            || address_type != Some(STOR_ADDRESS_TYPE_BTL8)
            || address_length.is_none_or(|l| l < STOR_ADDR_BTL8_ADDRESS_LENGTH)
        {
            return Err(SrbError::BadAddress);
        }
        let address = Address::new(
            block.read(at + exfield::BTL8_PATH).unwrap_or(0),
            block.read(at + exfield::BTL8_TARGET).unwrap_or(0),
            block.read(at + exfield::BTL8_LUN).unwrap_or(0),
        );
        // Only as many offsets as fit inside `SrbLength` can exist.
        let count = block.read::<u32>(field::EX_DATA_COUNT).unwrap_or(0) as usize;
        let room = (len - field::EX_DATA_OFFSETS) / size_of::<u32>();
        let mut cdb16 = None;
        let mut pnp = None;
        for i in 0..count.min(room) {
            let Some(offset) = block.read::<u32>(field::EX_DATA_OFFSETS + 4 * i) else {
                break;
            };
            let offset = offset as usize;
            if cdb16.is_none()
                && ex_block_of(
                    &block,
                    offset,
                    SrbExDataTypeScsiCdb16,
                    size_of::<SRBEX_DATA_SCSI_CDB16>(),
                )
            {
                cdb16 = Some(offset);
            }
            if pnp.is_none()
                && ex_block_of(
                    &block,
                    offset,
                    SrbExDataTypePnP,
                    size_of::<SRBEX_DATA_PNP>(),
                )
            {
                pnp = Some(offset);
            }
        }
        Ok((block, Form::Extended { cdb16, pnp }, address))
    }

    /// Gives the handle up for the raw pointer (the request is then owned
    /// by whoever StorPort or the DMA adapter hands it to next).
    #[must_use]
    pub fn into_raw(self) -> *mut core::ffi::c_void {
        self.as_raw()
    }

    /// The raw pointer, to hand back to StorPort.
    #[must_use]
    pub fn as_raw(&self) -> *mut core::ffi::c_void {
        self.block.base.as_ptr().cast()
    }

    /// Whether this is an extended (`STORAGE_REQUEST_BLOCK`) request.
    #[must_use]
    pub fn is_extended(&self) -> bool {
        matches!(self.form, Form::Extended { .. })
    }

    /// The shim's area of the extension, if the request has one.
    #[must_use]
    pub fn shim(&self) -> Option<NonNull<ShimArea>> {
        let words = self.extension?;
        // The area follows the core's words inside the extension.
        NonNull::new(
            words
                .as_ptr()
                .wrapping_add(self.core_words)
                .cast::<ShimArea>(),
        )
    }

    /// Records the converted scatter/gather list (`None`: no list).
    pub fn set_elements(&self, count: Option<u32>) {
        if let Some(shim) = self.shim() {
            let at = shim
                .as_ptr()
                .wrapping_byte_add(offset_of!(ShimArea, element_count));
            // SAFETY: inside the request's own extension (invariant).
            unsafe { at.cast::<u32>().write(count.unwrap_or(u32::MAX)) };
        }
    }

    /// The `DataBuffer` and the current `DataTransferLength`.
    fn data(&self) -> (Option<NonNull<u8>>, u32) {
        let (buffer, length) = if self.is_extended() {
            (field::EX_DATA_BUFFER, field::EX_TRANSFER_LENGTH)
        } else {
            (field::DATA_BUFFER, field::TRANSFER_LENGTH)
        };
        (
            self.block.pointer(buffer),
            self.block.read(length).unwrap_or(0),
        )
    }

    /// The data buffer range `offset..offset + len`, if inside.
    fn data_range(&self, offset: u32, len: usize) -> Result<*mut u8, DataAccessError> {
        let (buffer, length) = self.data();
        let buffer = buffer.ok_or(DataAccessError::OutOfBounds)?;
        let end = (offset as usize)
            .checked_add(len)
            .ok_or(DataAccessError::OutOfBounds)?;
        if end > length as usize {
            return Err(DataAccessError::OutOfBounds);
        }
        Ok(buffer.as_ptr().wrapping_add(offset as usize))
    }

    /// The sense buffer pointer and its capacity.
    fn sense(&self) -> (Option<NonNull<u8>>, u8) {
        match self.form {
            Form::Classic => (
                self.block.pointer(field::SENSE_BUFFER),
                self.block.read(field::SENSE_LENGTH).unwrap_or(0),
            ),
            Form::Extended {
                cdb16: Some(at), ..
            } => (
                self.block.pointer(at + exfield::CDB16_SENSE_BUFFER),
                self.block
                    .read(at + exfield::CDB16_SENSE_LENGTH)
                    .unwrap_or(0),
            ),
            Form::Extended { cdb16: None, .. } => (None, 0),
        }
    }

    /// Where the SCSI status byte lives, if anywhere.
    fn scsi_status_at(&self) -> Option<usize> {
        match self.form {
            Form::Classic => Some(field::SCSI_STATUS),
            Form::Extended { cdb16, .. } => cdb16.map(|at| at + exfield::CDB16_SCSI_STATUS),
        }
    }

    fn flags(&self) -> u32 {
        let at = if self.is_extended() {
            field::EX_FLAGS
        } else {
            field::FLAGS
        };
        self.block.read(at).unwrap_or(0)
    }
}

impl crate::storport::Srb for NtSrb {
    fn identity(&self) -> SrbIdentity {
        SrbIdentity(self.block.base.as_ptr() as u64)
    }

    fn function(&self) -> SrbFunction {
        let code = if self.is_extended() {
            self.block
                .read::<u32>(field::EX_FUNCTION)
                .and_then(|f| u8::try_from(f).ok())
                .unwrap_or(u8::MAX)
        } else {
            self.block.read(field::FUNCTION).unwrap_or(u8::MAX)
        };
        SrbFunction::from_code(code)
    }

    fn address(&self) -> Address {
        self.address
    }

    fn cdb(&self) -> &[u8] {
        let (at, length_at) = match self.form {
            Form::Classic => (field::CDB, field::CDB_LENGTH),
            Form::Extended { cdb16: Some(b), .. } => {
                (b + exfield::CDB16_CDB, b + exfield::CDB16_CDB_LENGTH)
            }
            Form::Extended { cdb16: None, .. } => return &[],
        };
        let length = usize::from(self.block.read::<u8>(length_at).unwrap_or(0)).min(CDB_CAPACITY);
        if at + CDB_CAPACITY > self.block.len {
            return &[];
        }
        // SAFETY: `at..at + 16` lies inside the request (checked), which
        // lives as long as the handle (invariant); nobody writes the CDB.
        unsafe { core::slice::from_raw_parts(self.block.base.as_ptr().wrapping_add(at), length) }
    }

    fn direction(&self) -> DataDirection {
        DataDirection::from_srb_flags(self.flags())
    }

    fn data_transfer_length(&self) -> u32 {
        self.data().1
    }

    fn set_data_transfer_length(&mut self, len: u32) {
        let at = if self.is_extended() {
            field::EX_TRANSFER_LENGTH
        } else {
            field::TRANSFER_LENGTH
        };
        self.block.write(at, len);
    }

    fn srb_status(&self) -> SrbStatus {
        SrbStatus::from_raw(self.block.read(field::SRB_STATUS).unwrap_or(0))
    }

    fn set_srb_status(&mut self, status: SrbStatus) {
        self.block.write(field::SRB_STATUS, status.raw());
    }

    fn scsi_status(&self) -> u8 {
        self.scsi_status_at()
            .and_then(|at| self.block.read(at))
            .unwrap_or(0)
    }

    fn set_scsi_status(&mut self, status: u8) {
        if let Some(at) = self.scsi_status_at() {
            self.block.write(at, status);
        }
    }

    fn sense_buffer(&mut self) -> &mut [u8] {
        match self.sense() {
            // SAFETY: StorPort's sense buffer of `length` bytes belongs to
            // the request (invariant) and to nobody else meanwhile.
            (Some(p), length) => unsafe {
                core::slice::from_raw_parts_mut(p.as_ptr(), usize::from(length))
            },
            (None, _) => &mut [],
        }
    }

    fn set_sense_length(&mut self, len: u8) {
        let (_, capacity) = self.sense();
        let len = len.min(capacity);
        match self.form {
            Form::Classic => {
                self.block.write(field::SENSE_LENGTH, len);
            }
            Form::Extended {
                cdb16: Some(at), ..
            } => {
                self.block.write(at + exfield::CDB16_SENSE_LENGTH, len);
            }
            Form::Extended { cdb16: None, .. } => {}
        }
    }

    fn read_data(&self, offset: u32, out: &mut [u8]) -> Result<(), DataAccessError> {
        let from = self.data_range(offset, out.len())?;
        // SAFETY: inside the mapped data buffer (checked; StorPort maps every
        // buffer of a virtual miniport), which belongs to the request.
        unsafe {
            core::ptr::copy_nonoverlapping(from, out.as_mut_ptr(), out.len());
        }
        Ok(())
    }

    fn write_data(&mut self, offset: u32, data: &[u8]) -> Result<(), DataAccessError> {
        let to = self.data_range(offset, data.len())?;
        // SAFETY: as in `read_data`.
        unsafe { core::ptr::copy_nonoverlapping(data.as_ptr(), to, data.len()) };
        Ok(())
    }

    fn scatter_gather(&self) -> Option<&[SgElement]> {
        let shim = self.shim()?;
        let count_at = shim
            .as_ptr()
            .wrapping_byte_add(offset_of!(ShimArea, element_count));
        // SAFETY: inside the request's own extension (invariant).
        let count = unsafe { count_at.cast::<u32>().read() };
        if count as usize > MAX_SG_ELEMENTS {
            return None;
        }
        let elements = shim
            .as_ptr()
            .wrapping_byte_add(offset_of!(ShimArea, elements));
        // SAFETY: the first `count` elements were written by the DMA
        // ExecutionRoutine (`dma::deliver`) and stay until the request
        // completes or the list is released.
        Some(unsafe { core::slice::from_raw_parts(elements.cast::<SgElement>(), count as usize) })
    }

    fn extension(&self) -> &[AtomicU64] {
        match self.extension {
            // SAFETY: `core_words` 8-aligned words of the request's own
            // extension (invariant), shared only through atomics.
            Some(p) => unsafe { core::slice::from_raw_parts(p.as_ptr(), self.core_words) },
            None => &[],
        }
    }

    fn queue_action(&self) -> QueueAction {
        if self.is_extended() {
            let attribute = self.block.read::<u16>(field::EX_ATTRIBUTE).unwrap_or(0);
            QueueAction::from_code(u8::try_from(attribute).unwrap_or(0))
        } else if self.flags() & SRB_FLAGS_QUEUE_ACTION_ENABLE != 0 {
            QueueAction::from_code(self.block.read(field::QUEUE_ACTION).unwrap_or(0))
        } else {
            QueueAction::Simple
        }
    }

    fn queue_tag(&self) -> u8 {
        if self.is_extended() {
            // CAST: StorPort's tag for the LUN queue; the core only logs it.
            self.block.read::<u32>(field::EX_TAG).unwrap_or(0) as u8
        } else {
            self.block.read(field::QUEUE_TAG).unwrap_or(0)
        }
    }

    fn timeout_secs(&self) -> u32 {
        let at = if self.is_extended() {
            field::EX_TIMEOUT
        } else {
            field::TIMEOUT
        };
        self.block.read(at).unwrap_or(0)
    }

    fn abort_target(&self) -> Option<AbortTarget<'_>> {
        if self.function() != SrbFunction::AbortCommand {
            return None;
        }
        let at = if self.is_extended() {
            field::EX_NEXT_SRB
        } else {
            field::NEXT_SRB
        };
        let victim = self.block.pointer(at)?;
        // SAFETY: the victim is another request StorPort considers
        // outstanding with this miniport; only its fixed part and extension
        // are read.
        let (header, extended) = unsafe { fixed_part(victim) };
        let words = extension_of(&header, extended)?;
        Some(AbortTarget {
            identity: SrbIdentity(victim.as_ptr() as u64),
            // SAFETY: the victim's extension: `core_words` aligned words of
            // a request still outstanding, shared only through atomics.
            extension: unsafe { core::slice::from_raw_parts(words.as_ptr(), self.core_words) },
        })
    }

    fn pnp_action(&self) -> Option<PnpAction> {
        if self.function() != SrbFunction::Pnp {
            return None;
        }
        let action = match self.form {
            Form::Classic => {
                debug_assert_eq!(u32::from(SrbFunction::Pnp.code()), SRB_FUNCTION_PNP);
                self.block.read::<u32>(field::PNP_ACTION)?
            }
            Form::Extended { pnp: Some(at), .. } => {
                self.block.read::<u32>(at + exfield::PNP_ACTION)?
            }
            Form::Extended { pnp: None, .. } => return None,
        };
        Some(PnpAction::from_code(action))
    }
}

#[cfg(test)]
#[expect(
    clippy::field_reassign_with_default,
    reason = "request fixtures read best as the fields StorPort would set"
)]
mod tests {
    use super::*;
    use crate::nt::ffi::{
        SRB_FUNCTION_ABORT_COMMAND, SRB_FUNCTION_EXECUTE_SCSI, SRB_FUNCTION_RESET_BUS,
    };
    use crate::storport::Srb as _;
    use core::sync::atomic::Ordering;

    const LAYOUT: ExtensionLayout = ExtensionLayout { core_words: 1 };

    /// An 8-aligned buffer to build extended SRBs in.
    #[repr(C, align(8))]
    struct Block256([u8; 256]);

    /// An 8-aligned request extension.
    #[repr(C, align(8))]
    struct Extension([u8; 8 + size_of::<ShimArea>()]);

    fn extension() -> Box<Extension> {
        Box::new(Extension([0xEE; 8 + size_of::<ShimArea>()]))
    }

    fn put32(b: &mut Block256, at: usize, v: u32) {
        b.0[at..at + 4].copy_from_slice(&v.to_le_bytes());
    }

    /// An extended INQUIRY to 0/3/1 with one CDB16 block, as StorPort lays it
    /// out: header, BTL8 address at 128, CDB16 block at 144.
    fn extended_inquiry() -> Block256 {
        let mut b = Block256([0; 256]);
        b.0[2] = SRB_FUNCTION_STORAGE_REQUEST_BLOCK;
        put32(&mut b, 8, SRB_SIGNATURE);
        put32(&mut b, 12, STORAGE_REQUEST_BLOCK_VERSION_1);
        put32(&mut b, 16, 184); // SrbLength
        put32(&mut b, 20, SRB_FUNCTION_EXECUTE_SCSI);
        put32(&mut b, 24, 0x40); // SrbFlags: DATA_IN
        put32(&mut b, 40, 30); // TimeOutValue
        put32(&mut b, 52, 128); // AddressOffset
        put32(&mut b, 56, 1); // NumSrbExData
        put32(&mut b, 60, 96); // DataTransferLength
        put32(&mut b, 120, 144); // SrbExDataOffset[0]
        b.0[128..130].copy_from_slice(&STOR_ADDRESS_TYPE_BTL8.to_le_bytes());
        put32(&mut b, 132, 4);
        b.0[136..139].copy_from_slice(&[0, 3, 1]);
        put32(&mut b, 144, SrbExDataTypeScsiCdb16);
        put32(&mut b, 148, 32);
        b.0[154] = 6; // CdbLength
        b.0[168..174].copy_from_slice(&[0x12, 0, 0, 0, 96, 0]);
        b
    }

    fn view(b: &mut Block256) -> Result<NtSrb, SrbError> {
        // SAFETY: the block is ours, 256 bytes, 8-aligned, and SrbLength
        // never exceeds 256 in these tests; no extension.
        unsafe { NtSrb::from_raw(b.0.as_mut_ptr().cast(), LAYOUT, true) }
    }

    fn classic(srb: &mut SCSI_REQUEST_BLOCK) -> NtSrb {
        // SAFETY: a live local SRB whose pointers (if any) point at live
        // locals of the test.
        unsafe { NtSrb::from_raw((srb as *mut SCSI_REQUEST_BLOCK).cast(), LAYOUT, true) }.unwrap()
    }

    #[test]
    fn classic_srb_fields() {
        let mut data = [0u8; 36];
        let mut sense = [0u8; 18];
        let mut ext = extension();
        let mut srb = SCSI_REQUEST_BLOCK::default();
        srb.Function = SRB_FUNCTION_EXECUTE_SCSI as u8;
        srb.TargetId = 5;
        srb.Lun = 2;
        srb.CdbLength = 6;
        srb.Cdb[0] = 0x12;
        srb.DataTransferLength = 36;
        srb.SrbFlags = 0x40 | SRB_FLAGS_QUEUE_ACTION_ENABLE;
        srb.QueueAction = 0x22;
        srb.QueueTag = 7;
        srb.TimeOutValue = 10;
        srb.DataBuffer = data.as_mut_ptr().cast();
        srb.SenseInfoBuffer = sense.as_mut_ptr().cast();
        srb.SenseInfoBufferLength = 18;
        srb.SrbExtension = ext.0.as_mut_ptr().cast();
        let mut v = classic(&mut srb);
        assert!(!v.is_extended());
        assert_eq!(v.function(), SrbFunction::ExecuteScsi);
        assert_eq!(v.address(), Address::new(0, 5, 2));
        assert_eq!(v.cdb(), &[0x12, 0, 0, 0, 0, 0][..]);
        assert_eq!(v.direction(), DataDirection::In);
        assert_eq!(v.queue_action(), QueueAction::Ordered);
        assert_eq!((v.queue_tag(), v.timeout_secs()), (7, 10));
        assert_eq!(v.extension().len(), 1);
        v.extension()[0].store(0x1234, Ordering::Relaxed);
        assert_eq!(
            v.scatter_gather(),
            None,
            "no list before the ExecutionRoutine"
        );
        v.write_data(32, &[1, 2, 3, 4]).unwrap();
        assert_eq!(
            v.write_data(33, &[1, 2, 3, 4]),
            Err(DataAccessError::OutOfBounds)
        );
        let mut back = [0u8; 4];
        v.read_data(32, &mut back).unwrap();
        assert_eq!(back, [1, 2, 3, 4]);
        v.sense_buffer()[..2].copy_from_slice(&[0x70, 0]);
        v.set_sense_length(200);
        v.set_srb_status(SrbStatus::ERROR.with_autosense());
        v.set_scsi_status(2);
        v.set_data_transfer_length(0);
        assert_eq!(
            (
                srb.SrbStatus,
                srb.ScsiStatus,
                srb.DataTransferLength,
                srb.SenseInfoBufferLength
            ),
            (0x84, 2, 0, 18)
        );
        assert_eq!(&ext.0[..8], &0x1234_u64.to_le_bytes());
        assert_eq!(&data[32..], &[1, 2, 3, 4]);
        assert_eq!(sense[0], 0x70);
    }

    #[test]
    fn classic_cdb_length_is_clamped_and_missing_buffers_are_empty() {
        let mut srb = SCSI_REQUEST_BLOCK::default();
        srb.CdbLength = 200;
        srb.DataTransferLength = 512;
        let mut v = classic(&mut srb);
        assert_eq!(v.cdb().len(), 16);
        assert!(v.sense_buffer().is_empty());
        assert!(v.extension().is_empty());
        assert_eq!(
            v.read_data(0, &mut [0; 4]),
            Err(DataAccessError::OutOfBounds)
        );
        assert_eq!(
            v.queue_action(),
            QueueAction::Simple,
            "queue actions not enabled"
        );
    }

    #[test]
    fn extended_srb_fields() {
        let mut b = extended_inquiry();
        let mut v = view(&mut b).unwrap();
        assert!(v.is_extended());
        assert_eq!(v.function(), SrbFunction::ExecuteScsi);
        assert_eq!(v.address(), Address::new(0, 3, 1));
        assert_eq!(v.cdb(), &[0x12, 0, 0, 0, 96, 0][..]);
        assert_eq!(v.data_transfer_length(), 96);
        assert_eq!(v.direction(), DataDirection::In);
        assert_eq!(v.timeout_secs(), 30);
        v.set_srb_status(SrbStatus::SELECTION_TIMEOUT);
        v.set_scsi_status(2);
        v.set_data_transfer_length(0);
        assert_eq!(b.0[3], 0x0A);
        assert_eq!(b.0[152], 2);
        assert_eq!(&b.0[60..64], &[0, 0, 0, 0]);
    }

    #[test]
    fn null_is_refused() {
        // SAFETY: null is allowed by the contract.
        let null = unsafe { NtSrb::from_raw(core::ptr::null_mut(), LAYOUT, true) };
        assert_eq!(null.err(), Some(SrbError::Null));
    }

    #[test]
    fn malformed_extended_blocks_get_specific_errors() {
        type Spoil = fn(&mut Block256);
        let cases: [(Spoil, SrbError); 6] = [
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
        for (offset, count, readable) in [(170, 1, false), (146, 1, false), (144, u32::MAX, true)] {
            let mut b = extended_inquiry();
            put32(&mut b, 120, offset);
            put32(&mut b, 56, count);
            let v = view(&mut b).unwrap();
            assert_eq!(!v.cdb().is_empty(), readable, "{offset} {count}");
        }
    }

    #[test]
    fn extended_non_scsi_and_pnp_functions() {
        let mut b = extended_inquiry();
        put32(&mut b, 20, SRB_FUNCTION_RESET_BUS);
        put32(&mut b, 56, 0);
        let v = view(&mut b).unwrap();
        assert_eq!(v.function(), SrbFunction::ResetBus);
        assert!(v.cdb().is_empty());
        assert_eq!(v.pnp_action(), None);
        // A PnP request with its SRBEX_DATA_PNP block at 144.
        let mut b = extended_inquiry();
        put32(&mut b, 20, SRB_FUNCTION_PNP);
        put32(&mut b, 144, SrbExDataTypePnP);
        put32(&mut b, 148, 16);
        put32(&mut b, 156, 2); // StorRemoveDevice
        let v = view(&mut b).unwrap();
        assert_eq!(v.pnp_action(), Some(PnpAction::RemoveDevice));
    }

    #[test]
    fn classic_pnp_and_abort_requests() {
        let mut pnp = SCSI_REQUEST_BLOCK::default();
        pnp.Function = SRB_FUNCTION_PNP as u8;
        // SCSI_PNP_REQUEST_BLOCK puts PnPAction where the classic form keeps
        // QueueTag..CdbLength.
        let action = (&raw mut pnp)
            .cast::<u8>()
            .wrapping_add(field::PNP_ACTION)
            .cast::<u32>();
        // SAFETY: the PnP form overlays the same 88 bytes.
        unsafe { action.write_unaligned(9) };
        assert_eq!(
            classic(&mut pnp).pnp_action(),
            Some(PnpAction::QueryCapabilities)
        );

        let mut victim_ext = extension();
        victim_ext.0[..8].copy_from_slice(&0xABCD_u64.to_le_bytes());
        let mut victim = SCSI_REQUEST_BLOCK::default();
        victim.SrbExtension = victim_ext.0.as_mut_ptr().cast();
        let mut abort = SCSI_REQUEST_BLOCK::default();
        abort.Function = SRB_FUNCTION_ABORT_COMMAND as u8;
        abort.NextSrb = &raw mut victim;
        let v = classic(&mut abort);
        let target = v.abort_target().unwrap();
        assert_eq!(target.identity, SrbIdentity((&raw const victim) as u64));
        assert_eq!(target.extension[0].load(Ordering::Relaxed), 0xABCD);
        let mut no_victim = SCSI_REQUEST_BLOCK::default();
        no_victim.Function = SRB_FUNCTION_ABORT_COMMAND as u8;
        assert!(classic(&mut no_victim).abort_target().is_none());
    }

    #[test]
    fn a_fresh_request_has_no_list_and_a_delivered_one_is_read_back() {
        let mut ext = extension();
        let mut srb = SCSI_REQUEST_BLOCK::default();
        srb.SrbExtension = ext.0.as_mut_ptr().cast();
        let v = classic(&mut srb);
        assert_eq!(v.scatter_gather(), None);
        let shim = v.shim().unwrap();
        let first = shim
            .as_ptr()
            .wrapping_byte_add(offset_of!(ShimArea, elements))
            .cast::<SgElement>();
        // SAFETY: the test's own extension, as `dma::deliver` writes it.
        unsafe {
            first.write(SgElement {
                phys: hca_lowlevel::dma::PhysAddr(0x1000),
                len: 512,
            });
        }
        v.set_elements(Some(1));
        assert_eq!(v.scatter_gather().map(<[SgElement]>::len), Some(1));
        // Reissued (StartIo again): the stale list is gone.
        // SAFETY: as `classic`.
        let again = unsafe { NtSrb::from_raw((&raw mut srb).cast(), LAYOUT, true) }.unwrap();
        assert_eq!(again.scatter_gather(), None);
    }

    #[test]
    fn misaligned_extensions_are_not_used() {
        let mut ext = extension();
        let mut srb = SCSI_REQUEST_BLOCK::default();
        srb.SrbExtension = ext.0[1..].as_mut_ptr().cast();
        let v = classic(&mut srb);
        assert!(v.extension().is_empty());
        assert!(v.shim().is_none());
    }
}
