//! The NT kernel bindings facade below kverbs and the StorPort shim.
//!
//! kverbs' NT platform backend needs ntoskrnl and HAL (spin locks, DPCs,
//! work items, timers, events, fast mutexes, pool, the performance
//! counter); the StorPort shim in `storport-srp` needs the same kernel
//! names plus StorPort's. kverbs sits below storport-srp, so the kernel
//! part lives here, where both can use it, and storport-srp's facade adds
//! the StorPort part on top (`storport_srp::nt::ffi`), the way `wdk-sys`
//! keeps StorPort behind its `storage` module.
//!
//! With default features the crate is empty: host builds of the workspace
//! never see a kernel symbol. Feature `kernel` fills the facade from one of
//! two sources:
//!
//! * **A — `wdk-sys`** (feature `wdk`, Windows with a WDK installed): the
//!   names are re-exported from `wdk-sys`, whose bindings come from the
//!   WDK's own headers (real layouts). Never built on Linux.
//! * **B — mingw-w64** (default): `mingw`, bindgen's committed output over
//!   Debian's `mingw-w64-x86-64-dev` `ntddk.h` (`kv-sys bindings --check`
//!   proves it current), with layout assertions.
//!
//! Both sources share `ext` (what the headers do not declare: opaque
//! kernel objects, `ExAllocatePool2`, the exported IRQL routines) and
//! `inline` (what the headers implement inline: `KeGetCurrentIrql`,
//! `ExInitializeFastMutex`, `InitializeObjectAttributes`). Users import
//! only the names `facade!` lists, so both sources must provide each
//! under the same path. Kernel routines are linked through import
//! libraries (`kv-sys` makes them from the committed export allowlists; on
//! Windows, the WDK's), so no binding carries a `#[link]`.

#![no_std]
#![allow(
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    reason = "C names"
)]

#[cfg(feature = "kernel")]
pub mod ctypes;
#[cfg(feature = "kernel")]
pub mod ext;
#[cfg(feature = "kernel")]
pub mod inline;
#[cfg(all(feature = "kernel", not(feature = "wdk")))]
pub mod mingw;
#[cfg(feature = "wdk")]
mod wdk;

/// Re-exports the facade's names from the selected source.
#[cfg(feature = "kernel")]
macro_rules! facade {
    ($($src:ident)::+ => { $($name:ident),* $(,)? }) => {
        pub use $($src)::+::{$($name),*};
    };
}

// Types and constants.
#[cfg(all(feature = "kernel", not(feature = "wdk")))]
facade!(self::mingw => {
    BOOLEAN, UCHAR, USHORT, ULONG, LONG, ULONG64, ULONG_PTR, PVOID, PCHAR, NTSTATUS, KIRQL,
    SIZE_T, HANDLE, LARGE_INTEGER, PHYSICAL_ADDRESS, UNICODE_STRING, PCUNICODE_STRING,
    _POOL_TYPE, _INTERFACE_TYPE, PASSIVE_LEVEL, APC_LEVEL, DISPATCH_LEVEL,
    KSPIN_LOCK, KLOCK_QUEUE_HANDLE, KDPC, KTIMER, KEVENT, FAST_MUTEX, PROCESSOR_NUMBER,
    ALL_PROCESSOR_GROUPS, IO_NO_INCREMENT,
    PKDEFERRED_ROUTINE, PIO_WORKITEM, PIO_WORKITEM_ROUTINE,
    _EVENT_TYPE, _TIMER_TYPE, _KWAIT_REASON, _MODE, _WORK_QUEUE_TYPE,
    OBJECT_ATTRIBUTES, KEY_BASIC_INFORMATION, KEY_VALUE_PARTIAL_INFORMATION,
    _KEY_INFORMATION_CLASS, _KEY_VALUE_INFORMATION_CLASS, KEY_READ, OBJ_CASE_INSENSITIVE,
    OBJ_KERNEL_HANDLE, REG_DWORD, REG_SZ,
    MDL, DMA_ADAPTER, DMA_OPERATIONS, SCATTER_GATHER_LIST, SCATTER_GATHER_ELEMENT,
    PDRIVER_LIST_CONTROL,
});
// Routines.
#[cfg(all(feature = "kernel", not(feature = "wdk")))]
facade!(self::mingw => {
    KeBugCheckEx, ExAllocatePoolWithTag, ExFreePoolWithTag, MmGetSystemRoutineAddress,
    RtlInitUnicodeString,
    KeAcquireSpinLockRaiseToDpc, KeReleaseSpinLock, KeAcquireSpinLockAtDpcLevel,
    KeReleaseSpinLockFromDpcLevel, KeAcquireInStackQueuedSpinLock,
    KeReleaseInStackQueuedSpinLock, KeAcquireInStackQueuedSpinLockAtDpcLevel,
    KeReleaseInStackQueuedSpinLockFromDpcLevel,
    KeInitializeDpc, KeInsertQueueDpc, KeRemoveQueueDpc, KeSetTargetProcessorDpcEx,
    KeGetProcessorNumberFromIndex, KeQueryActiveProcessorCountEx, KeFlushQueuedDpcs,
    IoAllocateWorkItem, IoQueueWorkItem, IoFreeWorkItem,
    KeInitializeTimerEx, KeSetTimer, KeCancelTimer,
    KeInitializeEvent, KeSetEvent, KeClearEvent, KeWaitForSingleObject,
    ExAcquireFastMutexUnsafe, ExReleaseFastMutexUnsafe, KeEnterCriticalRegion,
    KeLeaveCriticalRegion,
    KeStallExecutionProcessor, KeDelayExecutionThread, KeQueryPerformanceCounter,
    ZwOpenKey, ZwEnumerateKey, ZwQueryValueKey, ZwClose,
});

// Source A.
#[cfg(feature = "wdk")]
pub use wdk::*;

// Both sources.
#[cfg(feature = "kernel")]
facade!(self::ext => {
    DRIVER_OBJECT, PDRIVER_OBJECT, DEVICE_OBJECT, PDEVICE_OBJECT, IRP, PIRP,
    POOL_FLAGS, POOL_FLAG_NON_PAGED, POOL_FLAG_UNINITIALIZED, PFN_EX_ALLOCATE_POOL2,
    STATUS_SUCCESS, STATUS_TIMEOUT, STATUS_BUFFER_OVERFLOW, STATUS_NO_MORE_ENTRIES,
    STATUS_UNSUCCESSFUL, STATUS_INVALID_PARAMETER, STATUS_BUFFER_TOO_SMALL,
    STATUS_OBJECT_NAME_NOT_FOUND, STATUS_INSUFFICIENT_RESOURCES,
    KfRaiseIrql, KeLowerIrql, BCryptGenRandom, BCRYPT_USE_SYSTEM_PREFERRED_RNG,
});
#[cfg(feature = "kernel")]
facade!(self::inline => {
    KeGetCurrentIrql, spin_lock_initializer, ExInitializeFastMutex, object_attributes,
});

// The sizes every kernel object kverbs embeds must have on x64 (the WDK's
// values; both sources must agree, or the pinned storage is wrong).
#[cfg(feature = "kernel")]
mod layout {
    use static_assertions::const_assert_eq;
    const_assert_eq!(size_of::<super::KDPC>(), 64);
    const_assert_eq!(size_of::<super::KTIMER>(), 64);
    const_assert_eq!(size_of::<super::KEVENT>(), 24);
    const_assert_eq!(size_of::<super::FAST_MUTEX>(), 56);
    const_assert_eq!(size_of::<super::KLOCK_QUEUE_HANDLE>(), 24);
    const_assert_eq!(size_of::<super::KSPIN_LOCK>(), 8);
    const_assert_eq!(size_of::<super::PROCESSOR_NUMBER>(), 4);
    const_assert_eq!(size_of::<super::OBJECT_ATTRIBUTES>(), 48);
    const_assert_eq!(size_of::<super::SCATTER_GATHER_ELEMENT>(), 24);
}
