//! Source A: the facade's kernel names from `wdk-sys` (Windows with a WDK
//! only). `wdk-sys` generates its bindings from the installed WDK's
//! headers, so every type here has the real layout; its layout tests and
//! the assertions in this crate's `layout` module both apply. Routines are
//! in `wdk_sys::ntddk`, types and constants at its root. Never built on
//! Linux: keep this list equal to the mingw one in `lib.rs`.

pub use wdk_sys::ntddk::{
    ExAcquireFastMutexUnsafe, ExAllocatePoolWithTag, ExFreePoolWithTag, ExReleaseFastMutexUnsafe,
    IoAllocateWorkItem, IoFreeWorkItem, IoQueueWorkItem, KeAcquireInStackQueuedSpinLock,
    KeAcquireInStackQueuedSpinLockAtDpcLevel, KeAcquireSpinLockAtDpcLevel,
    KeAcquireSpinLockRaiseToDpc, KeBugCheckEx, KeCancelTimer, KeClearEvent, KeDelayExecutionThread,
    KeEnterCriticalRegion, KeFlushQueuedDpcs, KeGetProcessorNumberFromIndex, KeInitializeDpc,
    KeInitializeEvent, KeInitializeTimerEx, KeInsertQueueDpc, KeLeaveCriticalRegion,
    KeQueryActiveProcessorCountEx, KeQueryPerformanceCounter, KeReleaseInStackQueuedSpinLock,
    KeReleaseInStackQueuedSpinLockFromDpcLevel, KeReleaseSpinLock, KeReleaseSpinLockFromDpcLevel,
    KeRemoveQueueDpc, KeSetEvent, KeSetTargetProcessorDpcEx, KeSetTimer, KeStallExecutionProcessor,
    KeWaitForSingleObject, MmGetSystemRoutineAddress, RtlInitUnicodeString, ZwClose,
    ZwEnumerateKey, ZwOpenKey, ZwQueryValueKey,
};
pub use wdk_sys::{
    _EVENT_TYPE, _INTERFACE_TYPE, _KEY_INFORMATION_CLASS, _KEY_VALUE_INFORMATION_CLASS,
    _KWAIT_REASON, _MODE, _POOL_TYPE, _TIMER_TYPE, _WORK_QUEUE_TYPE, ALL_PROCESSOR_GROUPS,
    APC_LEVEL, BOOLEAN, DISPATCH_LEVEL, DMA_ADAPTER, DMA_OPERATIONS, FAST_MUTEX, HANDLE,
    IO_NO_INCREMENT, KDPC, KEVENT, KEY_BASIC_INFORMATION, KEY_READ, KEY_VALUE_PARTIAL_INFORMATION,
    KIRQL, KLOCK_QUEUE_HANDLE, KSPIN_LOCK, KTIMER, LARGE_INTEGER, LONG, MDL, NTSTATUS,
    OBJ_CASE_INSENSITIVE, OBJ_KERNEL_HANDLE, OBJECT_ATTRIBUTES, PASSIVE_LEVEL, PCHAR,
    PCUNICODE_STRING, PDRIVER_LIST_CONTROL, PHYSICAL_ADDRESS, PIO_WORKITEM, PIO_WORKITEM_ROUTINE,
    PKDEFERRED_ROUTINE, PROCESSOR_NUMBER, PVOID, REG_DWORD, REG_SZ, SCATTER_GATHER_ELEMENT,
    SCATTER_GATHER_LIST, SIZE_T, UCHAR, ULONG, ULONG_PTR, ULONG64, UNICODE_STRING, USHORT,
};
