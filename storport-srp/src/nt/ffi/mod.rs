//! The bindings facade the NT shim uses: the kernel part from `nt-sys`
//! (re-exported here whole, so the shim has one place to import from) and
//! the StorPort part on top of it, filled from one of two sources:
//!
//! * **A — `wdk-sys`** (feature `wdk`, Windows with a WDK installed): the
//!   names are re-exported from `wdk-sys`'s `storage` module, whose
//!   bindings come from the WDK's own headers. Never built on Linux.
//! * **B — mingw-w64** (default): [`mingw`], bindgen's committed output over
//!   the items *defined in* Debian's `srb.h` and `storport.h` (every kernel
//!   type they name is `nt-sys`'s), plus [`storport_ext`], the StorPort-era
//!   declarations those 2003 headers lack, written from Microsoft's
//!   documentation with layout assertions.
//!
//! The shim imports only the names listed in [`facade!`]'s invocations
//! below (and `nt-sys`'s facade), so both sources must provide each of
//! them under the same path. Kernel routines are linked through import
//! libraries (`kv-sys` makes them from the committed export allowlists in
//! `storport-srp/driver/imports/`; on Windows the WDK's own libraries), so
//! no binding carries a `#[link]`.

#![allow(
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    reason = "C names"
)]

pub use nt_sys::*;

#[cfg(not(feature = "wdk"))]
pub mod mingw;
#[cfg(not(feature = "wdk"))]
pub mod storport_ext;

/// Re-exports the facade's names from the selected source.
macro_rules! facade {
    ($($src:ident)::+ => { $($name:ident),* $(,)? }) => {
        pub use $($src)::+::{$($name),*};
    };
}

// Types, constants and routines of srb.h and storport.h.
#[cfg(not(feature = "wdk"))]
facade!(self::mingw => {
    SCSI_REQUEST_BLOCK, SCSI_PNP_REQUEST_BLOCK, _SCSI_NOTIFICATION_TYPE,
    _SCSI_ADAPTER_CONTROL_TYPE, _SCSI_ADAPTER_CONTROL_STATUS, SCSI_SUPPORTED_CONTROL_TYPE_LIST,
    SRB_STATUS_SUCCESS, SRB_STATUS_ABORT_FAILED, SRB_STATUS_INVALID_REQUEST,
    SRB_STATUS_SELECTION_TIMEOUT, SRB_STATUS_INVALID_PATH_ID, SRB_STATUS_INVALID_TARGET_ID,
    SRB_STATUS_INVALID_LUN, SRB_STATUS_BAD_FUNCTION,
    SRB_FUNCTION_EXECUTE_SCSI, SRB_FUNCTION_IO_CONTROL, SRB_FUNCTION_SHUTDOWN, SRB_FUNCTION_FLUSH,
    SRB_FUNCTION_ABORT_COMMAND, SRB_FUNCTION_RESET_BUS, SRB_FUNCTION_RESET_DEVICE,
    SRB_FUNCTION_RESET_LOGICAL_UNIT, SRB_FUNCTION_WMI, SRB_FUNCTION_POWER, SRB_FUNCTION_PNP,
    SRB_FLAGS_QUEUE_ACTION_ENABLE, SP_INTERNAL_ADAPTER_ERROR,
    SP_RETURN_FOUND, SP_RETURN_ERROR, SP_RETURN_BAD_CONFIG,
    SCSI_DMA64_MINIPORT_FULL64BIT_SUPPORTED,
    StorPortInitialize, StorPortNotification, StorPortBusy, StorPortReady, StorPortDeviceBusy,
    StorPortDeviceReady, StorPortPause, StorPortResume, StorPortPauseDevice,
    StorPortResumeDevice, StorPortLogError,
});
#[cfg(not(feature = "wdk"))]
facade!(self::storport_ext => {
    HW_INITIALIZATION_DATA, PORT_CONFIGURATION_INFORMATION, VIRTUAL_HW_INITIALIZATION_DATA,
    STORAGE_REQUEST_BLOCK, STOR_ADDRESS, STOR_ADDR_BTL8, SRBEX_DATA, SRBEX_DATA_SCSI_CDB16,
    SRBEX_DATA_PNP, STOR_DPC, STOR_LOCK_HANDLE, STOR_SPINLOCK, STORPORT_FUNCTION_CODE,
    PHW_PASSIVE_INITIALIZE_ROUTINE, PVIRTUAL_HW_FIND_ADAPTER, PHW_DPC_ROUTINE, PHW_TIMER_EX,
    SRB_FUNCTION_STORAGE_REQUEST_BLOCK, SRB_SIGNATURE,
    STORAGE_REQUEST_BLOCK_VERSION_1, STOR_ADDRESS_TYPE_BTL8, STOR_ADDR_BTL8_ADDRESS_LENGTH,
    SrbExDataTypeScsiCdb16, SrbExDataTypePnP, STOR_FEATURE_VIRTUAL_MINIPORT,
    SRB_TYPE_FLAG_SCSI_REQUEST_BLOCK,
    SRB_TYPE_FLAG_STORAGE_REQUEST_BLOCK, ADDRESS_TYPE_FLAG_BTL8, SRB_TYPE_STORAGE_REQUEST_BLOCK,
    STORAGE_ADDRESS_TYPE_BTL8, STOR_MAP_ALL_BUFFERS_INCLUDING_READ_WRITE,
    StorSynchronizeFullDuplex, EnablePassiveInitialization, InitializeDpc, IssueDpc,
    StorPortExtendedFunction,
    STOR_STATUS_SUCCESS, STOR_STATUS_UNSUCCESSFUL, STOR_STATUS_NOT_IMPLEMENTED,
    STOR_STATUS_INSUFFICIENT_RESOURCES, STOR_STATUS_INVALID_PARAMETER, STOR_STATUS_BUSY,
    ExtFunctionGetOriginalMdl, ExtFunctionGetDeviceObjects, ExtFunctionInitializeTimer,
    ExtFunctionRequestTimer, ExtFunctionFreeTimer,
});

// Source A. The names are the WDK's, so they are the same list.
#[cfg(feature = "wdk")]
pub use wdk::*;
#[cfg(feature = "wdk")]
mod wdk;
