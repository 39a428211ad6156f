//! Scatter/gather lists for a virtual miniport: the HCA's DMA adapter.
//!
//! # Why not `StorPortGetScatterGatherList`
//! StorPort builds scatter/gather lists with the *miniport's* DMA adapter,
//! and a virtual miniport has none: "Virtual miniport drivers do not
//! perform DMA" (`VIRTUAL_HW_INITIALIZATION_DATA.HwDmaStarted`), and StorPort
//! maps every buffer into system space instead
//! (`STOR_MAP_ALL_BUFFERS_INCLUDING_READ_WRITE`). The device that moves the
//! data is the HCA, so the bus addresses must be the HCA's: the shim takes
//! the request's MDL (`StorPortGetOriginalMdl`) and asks the **HCA's**
//! `DMA_ADAPTER` for the list (`DMA_OPERATIONS.GetScatterGatherList`), whose
//! ExecutionRoutine runs at `DISPATCH_LEVEL` — the context the design posts
//! from — possibly before the call returns. The list is released with
//! `PutScatterGatherList` before the request completes.
//!
//! In this build there is no HCA on Windows (kverbs has no NT HCA backend),
//! so an adapter is registered without a [`DmaPath`] and refuses every
//! list; the core never asks, because no target is reachable.

use core::ffi::c_void;
use core::mem::offset_of;
use core::ptr::{NonNull, null_mut};

use hca_lowlevel::dma::PhysAddr;
use kverbs::irql::Dispatch;

use super::ffi::{
    DEVICE_OBJECT, DMA_ADAPTER, DMA_OPERATIONS, ExtFunctionGetOriginalMdl, MDL,
    PDRIVER_LIST_CONTROL, SCATTER_GATHER_ELEMENT, SCATTER_GATHER_LIST, STATUS_SUCCESS,
    STOR_STATUS_SUCCESS, StorPortExtendedFunction,
};
use super::srb::{ExtensionLayout, MAX_SG_ELEMENTS, NtSrb, ShimArea};
use crate::storport::{DataDirection, SgElement, SgListRefused, Srb as _};

/// The HCA's DMA adapter and device object, and the shim's
/// ExecutionRoutine for this miniport.
///
/// # Invariants
/// `adapter` and `device` stay valid while the adapter exists.
pub struct DmaPath {
    adapter: NonNull<DMA_ADAPTER>,
    device: NonNull<DEVICE_OBJECT>,
    execution_routine: PDRIVER_LIST_CONTROL,
}

impl DmaPath {
    /// The HCA's DMA path.
    ///
    /// # Safety
    /// `adapter` is the HCA's DMA adapter (`IoGetDmaAdapter` on its PDO)
    /// and `device` the HCA device object it belongs to, both valid while
    /// the miniport's adapter exists; `execution_routine` is the shim's
    /// ExecutionRoutine for this miniport type.
    #[must_use]
    pub unsafe fn new(
        adapter: NonNull<DMA_ADAPTER>,
        device: NonNull<DEVICE_OBJECT>,
        execution_routine: PDRIVER_LIST_CONTROL,
    ) -> Self {
        // INVARIANT: the caller's contract.
        DmaPath {
            adapter,
            device,
            execution_routine,
        }
    }

    /// The adapter's operations table.
    fn operations(&self) -> Option<&DMA_OPERATIONS> {
        // SAFETY: a live DMA adapter (invariant).
        let table = unsafe { (*self.adapter.as_ptr()).DmaOperations };
        // SAFETY: the HAL's table for the adapter, as long-lived as it.
        unsafe { table.as_ref() }
    }

    /// `GetScatterGatherList` for `srb`'s data buffer; the
    /// ExecutionRoutine receives the request (possibly before this
    /// returns).
    pub fn get(
        &self,
        extension: NonNull<c_void>,
        layout: ExtensionLayout,
        srb: NtSrb,
        _irql: &Dispatch<'_>,
    ) -> Result<(), SgListRefused<NtSrb>> {
        let Some(shim) = srb.shim() else {
            return Err(SgListRefused { srb });
        };
        let mut mdl: *mut MDL = null_mut();
        // SAFETY: the inline StorPortGetOriginalMdl: (function, extension,
        // srb, &PVOID); a request of this adapter; <= DISPATCH_LEVEL.
        let status = unsafe {
            StorPortExtendedFunction(
                ExtFunctionGetOriginalMdl,
                extension.as_ptr(),
                srb.as_raw(),
                &raw mut mdl,
            )
        };
        if status != STOR_STATUS_SUCCESS || mdl.is_null() {
            return Err(SgListRefused { srb });
        }
        // SAFETY: StorPort's MDL for the request, valid until it completes.
        let start = unsafe { (*mdl).StartVa };
        // SAFETY: as above.
        let offset = unsafe { (*mdl).ByteOffset };
        // MmGetMdlVirtualAddress.
        let va = start
            .cast::<u8>()
            .wrapping_add(offset as usize)
            .cast::<c_void>();
        let write_to_device = u8::from(srb.direction() == DataDirection::Out);
        let length = srb.data_transfer_length();
        // SAFETY: the request's own extension area.
        unsafe {
            shim.as_ptr()
                .wrapping_byte_add(offset_of!(ShimArea, device_extension))
                .cast::<*mut c_void>()
                .write(extension.as_ptr());
        }
        let Some(get) = self.operations().and_then(|ops| ops.GetScatterGatherList) else {
            return Err(SgListRefused { srb });
        };
        // The ExecutionRoutine owns the request from here: it rebuilds the
        // handle from `raw`, and this one is given up.
        let raw = srb.into_raw();
        // SAFETY: the documented call at DISPATCH_LEVEL (token) with the
        // request's MDL, its virtual address and length; the context is the
        // request, which stays valid until it is completed.
        let status = unsafe {
            get(
                self.adapter.as_ptr(),
                self.device.as_ptr(),
                mdl,
                va,
                length,
                self.execution_routine,
                raw,
                write_to_device,
            )
        };
        if status == STATUS_SUCCESS {
            return Ok(());
        }
        // Not queued: the ExecutionRoutine will not run; take it back.
        // SAFETY: the request given up just above, still not completed; its
        // extension is as `get` left it.
        match unsafe { NtSrb::from_raw(raw, layout, false) } {
            Ok(srb) => Err(SgListRefused { srb }),
            // Unreachable: the block validated a moment ago.
            Err(_) => Ok(()),
        }
    }

    /// `PutScatterGatherList` for the list the ExecutionRoutine recorded.
    pub fn put(&self, srb: &mut NtSrb, _irql: &Dispatch<'_>) {
        let Some(shim) = srb.shim() else { return };
        let slot = shim
            .as_ptr()
            .wrapping_byte_add(offset_of!(ShimArea, dma_list))
            .cast::<*mut SCATTER_GATHER_LIST>();
        // SAFETY: the request's own extension area.
        let list = unsafe { slot.read() };
        if list.is_null() {
            return;
        }
        // SAFETY: as above; released once.
        unsafe { slot.write(null_mut()) };
        srb.set_elements(None);
        if let Some(put) = self.operations().and_then(|ops| ops.PutScatterGatherList) {
            let write_to_device = u8::from(srb.direction() == DataDirection::Out);
            // SAFETY: the list this adapter delivered for the request, at
            // DISPATCH_LEVEL (token).
            unsafe { put(self.adapter.as_ptr(), list, write_to_device) };
        }
    }
}

/// Why a delivered list could not be recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeliverError {
    /// The request has no extension to keep the list in.
    NoExtension,
    /// More elements than [`MAX_SG_ELEMENTS`].
    TooManyElements,
}

/// Records the list the DMA adapter delivered in the request's shim area,
/// converted to the core's elements.
///
/// # Safety
/// `list` is the `SCATTER_GATHER_LIST` the DMA adapter passed to the
/// ExecutionRoutine for `srb`, valid until it is put back.
pub unsafe fn deliver(srb: &NtSrb, list: *mut SCATTER_GATHER_LIST) -> Result<u32, DeliverError> {
    let shim = srb.shim().ok_or(DeliverError::NoExtension)?;
    let slot = shim
        .as_ptr()
        .wrapping_byte_add(offset_of!(ShimArea, dma_list))
        .cast::<*mut SCATTER_GATHER_LIST>();
    // SAFETY: the request's own extension area.
    unsafe { slot.write(list) };
    let out = shim
        .as_ptr()
        .wrapping_byte_add(offset_of!(ShimArea, elements))
        .cast::<SgElement>();
    // SAFETY: `elements` holds MAX_SG_ELEMENTS slots; the list is the
    // adapter's (caller contract).
    let count = unsafe { convert(list, out, MAX_SG_ELEMENTS) };
    match count {
        Some(n) => {
            srb.set_elements(Some(n));
            Ok(n)
        }
        None => {
            srb.set_elements(None);
            Err(DeliverError::TooManyElements)
        }
    }
}

/// Converts a `SCATTER_GATHER_LIST` into `SgElement`s at `out`; `None` if
/// it has more than `capacity` elements.
///
/// # Safety
/// `list` is a valid list with `NumberOfElements` elements; `out` has room
/// for `capacity` elements.
pub unsafe fn convert(
    list: *const SCATTER_GATHER_LIST,
    out: *mut SgElement,
    capacity: usize,
) -> Option<u32> {
    // SAFETY: a valid list (caller contract).
    let count = unsafe { (*list).NumberOfElements };
    if count as usize > capacity {
        return None;
    }
    let first = list
        .wrapping_byte_add(offset_of!(SCATTER_GATHER_LIST, Elements))
        .cast::<SCATTER_GATHER_ELEMENT>();
    for i in 0..count as usize {
        // SAFETY: element `i < NumberOfElements` of the list.
        let element = unsafe { first.wrapping_add(i).read() };
        // SAFETY: every bit pattern of the union is a valid i64.
        let address = unsafe { element.Address.QuadPart };
        let converted = SgElement {
            // CAST: a bus address is a 64-bit unsigned value.
            phys: PhysAddr(address as u64),
            len: element.Length,
        };
        // SAFETY: slot `i < count <= capacity` of the caller's storage.
        unsafe { out.wrapping_add(i).write(converted) };
    }
    Some(count)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nt::ffi::PHYSICAL_ADDRESS;

    /// A list of `n` elements in suitably aligned storage.
    fn list(n: usize) -> Vec<u64> {
        let bytes = offset_of!(SCATTER_GATHER_LIST, Elements)
            + n * core::mem::size_of::<SCATTER_GATHER_ELEMENT>();
        let mut storage = vec![0u64; bytes.div_ceil(8)];
        let head = storage.as_mut_ptr().cast::<SCATTER_GATHER_LIST>();
        let count = head
            .wrapping_byte_add(offset_of!(SCATTER_GATHER_LIST, NumberOfElements))
            .cast::<u32>();
        // SAFETY: the storage holds the header, 8-aligned.
        unsafe { count.write(n as u32) };
        let first = head
            .wrapping_byte_add(offset_of!(SCATTER_GATHER_LIST, Elements))
            .cast::<SCATTER_GATHER_ELEMENT>();
        for i in 0..n {
            let element = SCATTER_GATHER_ELEMENT {
                Address: PHYSICAL_ADDRESS {
                    QuadPart: 0x1_0000_0000 + (i as i64) * 0x1000,
                },
                Length: 512 + i as u32,
                Reserved: 0,
            };
            // SAFETY: element `i < n` of the storage.
            unsafe { first.wrapping_add(i).write(element) };
        }
        storage
    }

    #[test]
    fn lists_convert_element_by_element() {
        let storage = list(3);
        let mut out = [SgElement {
            phys: PhysAddr(0),
            len: 0,
        }; 4];
        // SAFETY: a 3-element list and room for 4.
        let n = unsafe { convert(storage.as_ptr().cast(), out.as_mut_ptr(), 4) };
        assert_eq!(n, Some(3));
        assert_eq!(out[0].phys, PhysAddr(0x1_0000_0000));
        assert_eq!(out[2].phys, PhysAddr(0x1_0000_2000));
        assert_eq!((out[0].len, out[2].len, out[3].len), (512, 514, 0));
    }

    #[test]
    fn a_list_longer_than_the_room_is_refused_untouched() {
        let storage = list(5);
        let mut out = [SgElement {
            phys: PhysAddr(7),
            len: 7,
        }; 4];
        // SAFETY: a 5-element list and room for 4.
        let n = unsafe { convert(storage.as_ptr().cast(), out.as_mut_ptr(), 4) };
        assert_eq!(n, None);
        assert!(out.iter().all(|e| e.len == 7));
    }
}
