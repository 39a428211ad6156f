//! What the kernel headers do not give bindgen, declared by hand: opaque
//! kernel objects, `NTSTATUS` values mingw writes as casts, `ExAllocatePool2`
//! (newer than mingw), and the exported forms of the x64 IRQL routines the
//! headers define inline. Shared by both sources of the facade.

#![allow(
    non_camel_case_types,
    non_snake_case,
    reason = "the C names of the Windows headers"
)]

use super::ctypes::c_void;

/// `NTSTATUS` (a `LONG`), spelled out so this module is the same under
/// both sources.
type Status = i32;

// ---------------------------------------------------------------------------
// NTSTATUS values (`ntstatus.h`; mingw writes them as casts bindgen skips).
// ---------------------------------------------------------------------------

/// `STATUS_SUCCESS`.
pub const STATUS_SUCCESS: Status = 0;
/// `STATUS_TIMEOUT` (0x102): a wait timed out (a success code).
pub const STATUS_TIMEOUT: Status = 0x0000_0102;
/// `STATUS_BUFFER_OVERFLOW` (0x80000005): the data did not fit (a warning).
pub const STATUS_BUFFER_OVERFLOW: Status = 0x8000_0005_u32 as Status;
/// `STATUS_NO_MORE_ENTRIES` (0x8000001A): an enumeration ended.
pub const STATUS_NO_MORE_ENTRIES: Status = 0x8000_001A_u32 as Status;
/// `STATUS_UNSUCCESSFUL` (0xC0000001).
pub const STATUS_UNSUCCESSFUL: Status = 0xC000_0001_u32 as Status;
/// `STATUS_INVALID_PARAMETER` (0xC000000D).
pub const STATUS_INVALID_PARAMETER: Status = 0xC000_000D_u32 as Status;
/// `STATUS_BUFFER_TOO_SMALL` (0xC0000023).
pub const STATUS_BUFFER_TOO_SMALL: Status = 0xC000_0023_u32 as Status;
/// `STATUS_OBJECT_NAME_NOT_FOUND` (0xC0000034): no such registry key or value.
pub const STATUS_OBJECT_NAME_NOT_FOUND: Status = 0xC000_0034_u32 as Status;
/// `STATUS_INSUFFICIENT_RESOURCES` (0xC000009A).
pub const STATUS_INSUFFICIENT_RESOURCES: Status = 0xC000_009A_u32 as Status;

// ---------------------------------------------------------------------------
// Opaque kernel objects. mingw's DEVICE_OBJECT lacks its DECLSPEC_ALIGN(16)
// (328 bytes instead of 336), so nothing here sees their fields: the
// pointers are only passed back to the kernel.
// ---------------------------------------------------------------------------

/// `DRIVER_OBJECT`, opaque.
#[repr(C)]
pub struct _DRIVER_OBJECT {
    _opaque: [u8; 0],
}
/// See [`_DRIVER_OBJECT`].
pub type DRIVER_OBJECT = _DRIVER_OBJECT;
/// See [`_DRIVER_OBJECT`].
pub type PDRIVER_OBJECT = *mut _DRIVER_OBJECT;
/// `DEVICE_OBJECT`, opaque.
#[repr(C)]
pub struct _DEVICE_OBJECT {
    _opaque: [u8; 0],
}
/// See [`_DEVICE_OBJECT`].
pub type DEVICE_OBJECT = _DEVICE_OBJECT;
/// See [`_DEVICE_OBJECT`].
pub type PDEVICE_OBJECT = *mut _DEVICE_OBJECT;
/// `IRP`, opaque.
#[repr(C)]
pub struct _IRP {
    _opaque: [u8; 0],
}
/// See [`_IRP`].
pub type IRP = _IRP;
/// See [`_IRP`].
pub type PIRP = *mut _IRP;

// ---------------------------------------------------------------------------
// ExAllocatePool2 (wdm/nf-wdm-exallocatepool2; kernel/pool_flags). Windows 10
// 2004 and later; absent from mingw's headers and libntoskrnl.a.
// ---------------------------------------------------------------------------

/// `POOL_FLAGS`: "A ULONG64-typed value" (kernel/pool_flags).
pub type POOL_FLAGS = u64;
/// Don't zero-initialize the allocation (kernel/pool_flags: 0x2).
pub const POOL_FLAG_UNINITIALIZED: POOL_FLAGS = 0x0000_0000_0000_0002;
/// Non-paged, no-execute pool (kernel/pool_flags: 0x40).
pub const POOL_FLAG_NON_PAGED: POOL_FLAGS = 0x0000_0000_0000_0040;
/// The signature of `ExAllocatePool2`, resolved at run time through
/// `MmGetSystemRoutineAddress` (the documented down-level pattern), so that
/// a driver still loads where the routine does not exist.
pub type PFN_EX_ALLOCATE_POOL2 =
    unsafe extern "system" fn(Flags: POOL_FLAGS, NumberOfBytes: usize, Tag: u32) -> *mut c_void;

// ---------------------------------------------------------------------------
// The IRQL routines. On x64 the headers define `KfRaiseIrql`, `KeLowerIrql`
// and `KeGetCurrentIrql` as inline `cr8` accesses (so bindgen sees no
// declaration), and ntoskrnl.exe also exports all three (mingw's
// libntoskrnl.a lists them; Wine's ntoskrnl exports the first two).
// Raising and lowering go through the exports: the same effect, and the
// one form Wine can run (a `cr8` access faults in user mode).
// ---------------------------------------------------------------------------

unsafe extern "system" {
    /// `KfRaiseIrql` (wdm/nf-wdm-keraiseirql): raises to `NewIrql`,
    /// returns the previous level.
    pub fn KfRaiseIrql(NewIrql: u8) -> u8;
    /// `KeLowerIrql` (wdm/nf-wdm-kelowerirql): restores a level a raise
    /// returned.
    pub fn KeLowerIrql(NewIrql: u8);
}

// ---------------------------------------------------------------------------
// BCryptGenRandom (bcrypt/nf-bcrypt-bcryptgenrandom): kernel-mode CNG,
// exported by cng.sys (`Cng.lib`); bcrypt.h is not among the headers
// bindgen reads.
// ---------------------------------------------------------------------------

/// `BCRYPT_USE_SYSTEM_PREFERRED_RNG` (0x2): use the system-preferred
/// generator with a NULL algorithm handle; supported only at PASSIVE_LEVEL.
pub const BCRYPT_USE_SYSTEM_PREFERRED_RNG: u32 = 0x0000_0002;

unsafe extern "system" {
    /// `BCryptGenRandom`: fills `cbBuffer` bytes at `pbBuffer` from the
    /// generator (NIST SP800-90 CTR_DRBG); returns an `NTSTATUS`.
    pub fn BCryptGenRandom(
        hAlgorithm: *mut c_void,
        pbBuffer: *mut u8,
        cbBuffer: u32,
        dwFlags: u32,
    ) -> Status;
}
