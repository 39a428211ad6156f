//! The NT platform: kverbs' primitives on the Windows kernel (feature `nt`),
//! over the `nt-sys` bindings facade.
//!
//! | trait item | kernel |
//! |---|---|
//! | [`NtSpinLock`] | `KSPIN_LOCK`: `KeAcquireSpinLockRaiseToDpc`, `…AtDpcLevel`, `KeAcquireInStackQueuedSpinLock(AtDpcLevel)` |
//! | [`NtEvent`] | `KEVENT`: `KeInitializeEvent`, `KeSetEvent`, `KeClearEvent`, `KeWaitForSingleObject` |
//! | [`NtMutex`] | `FAST_MUTEX` taken inside a critical region (see below) |
//! | [`NtDpc`] | `KDPC`: `KeInitializeDpc`, `KeSetTargetProcessorDpcEx`, `KeInsertQueueDpc`, `KeRemoveQueueDpc` |
//! | [`NtWorkItem`] | `IO_WORKITEM`: `IoAllocateWorkItem`, `IoQueueWorkItem(DelayedWorkQueue)`, `IoFreeWorkItem` |
//! | [`NtTimer`] | `KTIMER` + `KDPC`: `KeInitializeTimerEx`, `KeSetTimer` (relative), `KeCancelTimer` |
//! | `alloc_nonpaged` | `ExAllocatePool2(POOL_FLAG_NON_PAGED)` (or `ExAllocatePoolWithTag(NonPagedPoolNx)` before Windows 10 2004), [`pool`] |
//! | `now`, `ticks_per_second` | `KeQueryPerformanceCounter` |
//! | `current_irql` | `KeGetCurrentIrql` as `wdm.h` defines it on x64 (`cr8`) |
//! | `raise_to_dispatch`, `lower_irql` | `KfRaiseIrql`, `KeLowerIrql` (the exported forms) |
//! | `stall`, `delay` | `KeStallExecutionProcessor`, `KeDelayExecutionThread` |
//! | `fill_random` | `BCryptGenRandom(NULL, .., BCRYPT_USE_SYSTEM_PREFERRED_RNG)` (cng.sys) |
//!
//! # The device object behind work items
//! `IoQueueWorkItem` requires a *device* object ("If the caller will later
//! pass the work item to IoQueueWorkItem, DeviceObject must point to a
//! device object", nf-wdm-ioallocateworkitem): the I/O manager references
//! it while the item is queued or running, so neither the device nor the
//! driver image can go away under a running routine. An [`NtPlatform`]
//! therefore carries one device object, given by whoever creates it. The
//! StorPort shim passes the adapter's functional device object, which
//! `StorPortGetDeviceObjects` returns (a StorPort miniport creates no device
//! object of its own). The alternatives were weighed and not taken:
//! `ExQueueWorkItem` references nothing, so the driver could unload under a
//! running routine (and it is deprecated for that reason), and
//! `StorPortQueueWorkItem` would tie kverbs, a library for any storage
//! driver, to StorPort.
//!
//! # Pinned storage
//! A `KDPC`, `KTIMER`, `KEVENT` or `FAST_MUTEX` must not move once the
//! kernel knows its address (queue links and wait lists point into it).
//! Each lives in its own heap block ([`Pinned`] for single owners,
//! [`Shared`] for reference-counted ones), never inline in a value that
//! Rust may move. A `KSPIN_LOCK` is a word that may move while it is free;
//! it is only ever held through a borrow, so it stays inline.
//!
//! # Who keeps what alive
//! The trait requires that "a queued or running routine keeps the object's
//! own storage alive", so that dropping a handle at any time is safe:
//! * a DPC: every successful `KeInsertQueueDpc` is paired with one
//!   reference, which the DPC routine consumes when it runs — or `cancel`
//!   does when `KeRemoveQueueDpc` takes it back out. The pairing is exact
//!   because a `KDPC` is queued at most once at a time. Dropping the handle
//!   leaves a queued run alone: it holds its reference, and routines hold
//!   only `Weak`s to their owners;
//! * a work item: likewise, one reference per `IoQueueWorkItem`, consumed
//!   by the routine; the last reference frees the `IO_WORKITEM`, also from
//!   inside its own routine (which the I/O manager allows);
//! * a timer: the kernel queues the timer's DPC itself on expiry, and
//!   coalesces two expiries into one DPC run, so per-expiry references
//!   cannot be counted. Instead, dropping the handle cancels the timer and
//!   hands the storage to a work item
//!   (allocated with the timer) that runs `KeFlushQueuedDpcs` at
//!   `PASSIVE_LEVEL` — after which no routine of the timer can be queued
//!   or running — and only then frees it.
//!
//! # The fast mutex and the passive token
//! `ExAcquireFastMutex` raises to `APC_LEVEL`, which would make the
//! [`Passive`] token of the code under the mutex a lie (`ZwXxx` routines,
//! for one, require `PASSIVE_LEVEL`). [`NtMutex`] therefore enters a
//! critical region (`KeEnterCriticalRegion`: normal kernel APCs off) and
//! takes the mutex with `ExAcquireFastMutexUnsafe`, the documented pairing:
//! the holder stays at `PASSIVE_LEVEL`, and the mutex cannot be suspended
//! away from it.
//!
//! # Where this can run
//! Only in the Windows kernel (and, for the routines Wine implements, in
//! Wine's user-mode kernel). The pure parts — [`Shared`], the time
//! conversions, [`pool`]'s alignment — are unit-tested on the host; see the
//! kv-sys Wine smoke run for the rest.

// UNSAFETY: the whole module is the FFI to the kernel: it implements the
// unsafe `Platform`/`RawSpinLock`/`RawMutex` contracts over kernel objects
// in pinned storage; every block states why the call or access is sound.
#![expect(unsafe_code, reason = "the NT kernel FFI")]

use alloc::boxed::Box;
use core::alloc::Layout;
use core::cell::UnsafeCell;
use core::marker::PhantomData;
use core::mem::MaybeUninit;
use core::ptr::{NonNull, null_mut};
use core::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering, fence};
use core::time::Duration;

use nt_sys::{
    _EVENT_TYPE, _KWAIT_REASON, _MODE, _TIMER_TYPE, _WORK_QUEUE_TYPE, ALL_PROCESSOR_GROUPS,
    BCRYPT_USE_SYSTEM_PREFERRED_RNG, BCryptGenRandom, DEVICE_OBJECT, DISPATCH_LEVEL,
    ExAcquireFastMutexUnsafe, ExInitializeFastMutex, ExReleaseFastMutexUnsafe, FAST_MUTEX,
    IO_NO_INCREMENT, IoAllocateWorkItem, IoFreeWorkItem, IoQueueWorkItem, KDPC, KEVENT,
    KLOCK_QUEUE_HANDLE, KSPIN_LOCK, KTIMER, KeAcquireInStackQueuedSpinLock,
    KeAcquireInStackQueuedSpinLockAtDpcLevel, KeAcquireSpinLockAtDpcLevel,
    KeAcquireSpinLockRaiseToDpc, KeCancelTimer, KeClearEvent, KeDelayExecutionThread,
    KeEnterCriticalRegion, KeFlushQueuedDpcs, KeGetCurrentIrql, KeGetProcessorNumberFromIndex,
    KeInitializeDpc, KeInitializeEvent, KeInitializeTimerEx, KeInsertQueueDpc,
    KeLeaveCriticalRegion, KeLowerIrql, KeQueryActiveProcessorCountEx, KeQueryPerformanceCounter,
    KeReleaseInStackQueuedSpinLock, KeReleaseInStackQueuedSpinLockFromDpcLevel, KeReleaseSpinLock,
    KeReleaseSpinLockFromDpcLevel, KeRemoveQueueDpc, KeSetEvent, KeSetTargetProcessorDpcEx,
    KeSetTimer, KeStallExecutionProcessor, KeWaitForSingleObject, KfRaiseIrql, LARGE_INTEGER,
    PIO_WORKITEM, PROCESSOR_NUMBER, PVOID, STATUS_SUCCESS, spin_lock_initializer,
};

use crate::irql::{Dispatch, Irql, LeDispatch, Passive};
use crate::platform::{
    AllocError, DpcRoutine, DpcTarget, EventKind, Platform, RandomUnavailable, RawDpc, RawEvent,
    RawMutex, RawSpinLock, RawTimer, RawWorkItem, Ticks, WorkRoutine,
};

// ---------------------------------------------------------------------------
// Time conversions (pure).
// ---------------------------------------------------------------------------

/// A relative kernel due time for `d`: negative, in 100 ns units, rounded
/// up, at least one unit (a zero would be the *absolute* time 0, which is
/// also in the past, but say what is meant), saturating.
#[must_use]
pub fn relative_due_time(d: Duration) -> i64 {
    let units = d.as_nanos().div_ceil(100).max(1);
    i64::try_from(units).map_or(i64::MIN + 1, |u| -u)
}

/// `KeStallExecutionProcessor` takes microseconds as a `ULONG`; Microsoft
/// asks for short stalls, so longer ones are split into chunks of at most
/// this many.
pub const STALL_CHUNK_US: u32 = 50;

/// The chunks (in microseconds, each at most [`STALL_CHUNK_US`]) a stall of
/// `d` is made of, rounded up to whole microseconds.
pub fn stall_chunks(d: Duration) -> impl Iterator<Item = u32> {
    let mut left = d.as_micros().min(u128::from(u64::MAX));
    if left == 0 && !d.is_zero() {
        left = 1;
    }
    core::iter::from_fn(move || {
        if left == 0 {
            return None;
        }
        let chunk = left.min(u128::from(STALL_CHUNK_US));
        left -= chunk;
        u32::try_from(chunk).ok()
    })
}

// ---------------------------------------------------------------------------
// Pinned, reference-counted storage (pure).
// ---------------------------------------------------------------------------

struct SharedBlock<T> {
    refs: AtomicUsize,
    value: T,
}

/// A reference-counted heap block that never moves and whose allocation
/// can fail (`Arc::try_new` is not stable): the storage of kernel objects
/// whose routines hold references of their own ([`NtDpc`], [`NtWorkItem`]).
///
/// # Invariants
/// `block` points to a live `SharedBlock<T>` from the global allocator
/// whose `refs` counts the `Shared` handles plus the raw references made
/// by [`Shared::into_raw`] and not yet reclaimed.
pub struct Shared<T> {
    block: NonNull<SharedBlock<T>>,
    _owns: PhantomData<SharedBlock<T>>,
}

// SAFETY: a `Shared<T>` hands out only `&T`, from any thread; that is sound
// exactly when `T` is `Sync`, and dropping the last handle on another
// thread drops `T` there, which needs `Send`.
unsafe impl<T: Send + Sync> Send for Shared<T> {}
// SAFETY: as above.
unsafe impl<T: Send + Sync> Sync for Shared<T> {}

impl<T> Shared<T> {
    /// Moves `value` into a new block with one reference.
    ///
    /// # Errors
    /// [`AllocError`] when the allocator has no memory.
    pub fn try_new(value: T) -> Result<Self, AllocError> {
        let layout = Layout::new::<SharedBlock<T>>();
        // SAFETY: the layout has a non-zero size (it holds an AtomicUsize).
        let raw = unsafe { alloc::alloc::alloc(layout) }.cast::<SharedBlock<T>>();
        let block = NonNull::new(raw).ok_or(AllocError)?;
        // SAFETY: a fresh allocation of the block's layout.
        unsafe {
            block.as_ptr().write(SharedBlock {
                refs: AtomicUsize::new(1),
                value,
            });
        }
        // INVARIANT: one handle, one reference.
        Ok(Shared {
            block,
            _owns: PhantomData,
        })
    }

    fn block(&self) -> &SharedBlock<T> {
        // SAFETY: live while this handle exists (invariant).
        unsafe { self.block.as_ref() }
    }

    /// The value.
    #[must_use]
    pub fn get(&self) -> &T {
        &self.block().value
    }

    /// The value's address: stable for the block's life, for the kernel.
    #[must_use]
    pub fn as_ptr(&self) -> *mut core::ffi::c_void {
        self.block.as_ptr().cast()
    }

    /// Turns this handle into a raw reference (the count is unchanged),
    /// for the kernel to hold.
    #[must_use]
    pub fn into_raw(self) -> *mut core::ffi::c_void {
        let raw = self.as_ptr();
        core::mem::forget(self);
        raw
    }

    /// Takes a raw reference back as a handle.
    ///
    /// # Safety
    /// `raw` came from [`Shared::into_raw`] (or [`Shared::as_ptr`] of a
    /// handle whose reference was leaked with `into_raw`) for this `T`, and
    /// that reference has not been reclaimed yet.
    #[must_use]
    pub unsafe fn from_raw(raw: *mut core::ffi::c_void) -> Self {
        // INVARIANT: the caller gives back one counted reference.
        Shared {
            // SAFETY: non-null: it came from a live block (caller contract).
            block: unsafe { NonNull::new_unchecked(raw.cast()) },
            _owns: PhantomData,
        }
    }

    /// Borrows the value behind a raw reference without taking it over.
    ///
    /// # Safety
    /// `raw` came from [`Shared::as_ptr`] for this `T`, and some reference
    /// keeps the block alive for `'a`.
    #[must_use]
    pub unsafe fn borrow_raw<'a>(raw: *mut core::ffi::c_void) -> &'a T {
        // SAFETY: a live block (caller contract).
        unsafe { &(*raw.cast::<SharedBlock<T>>()).value }
    }

    /// Drops one counted reference without a handle (the kernel's, when a
    /// queued routine was taken back out of its queue).
    ///
    /// # Safety
    /// One reference made by [`Shared::into_raw`] for this block is still
    /// outstanding and is given up here.
    pub unsafe fn release_raw(&self) {
        // The handle `self` keeps the count above one, so this never frees.
        self.block().refs.fetch_sub(1, Ordering::Release);
    }

    /// The number of references (handles plus raw), a snapshot.
    #[must_use]
    pub fn ref_count(&self) -> usize {
        self.block().refs.load(Ordering::Acquire)
    }
}

impl<T> Clone for Shared<T> {
    fn clone(&self) -> Self {
        // NO-OVERFLOW: every reference is a live object or a kernel queue
        // entry; there cannot be `usize::MAX` of them.
        self.block().refs.fetch_add(1, Ordering::Relaxed);
        Shared {
            block: self.block,
            _owns: PhantomData,
        }
    }
}

impl<T> Drop for Shared<T> {
    fn drop(&mut self) {
        if self.block().refs.fetch_sub(1, Ordering::Release) != 1 {
            return;
        }
        // Every other reference's uses happen before this free.
        fence(Ordering::Acquire);
        let raw = self.block.as_ptr();
        // SAFETY: the last reference: nobody else can reach the block. It
        // came from the global allocator with this layout.
        unsafe {
            core::ptr::drop_in_place(raw);
        }
        // SAFETY: as above; the value was dropped in place.
        unsafe { alloc::alloc::dealloc(raw.cast(), Layout::new::<SharedBlock<T>>()) };
    }
}

/// A single-owner heap cell that never moves (a `KEVENT`, a `FAST_MUTEX`).
/// The kernel object inside is reached only through raw pointers.
pub struct Pinned<T> {
    cell: Box<UnsafeCell<MaybeUninit<T>>>,
}

impl<T> Pinned<T> {
    /// Zeroed storage, to be initialised in place by the kernel.
    fn zeroed() -> Self {
        Pinned {
            cell: Box::new(UnsafeCell::new(MaybeUninit::zeroed())),
        }
    }

    /// The object's address, stable for the cell's life.
    fn as_ptr(&self) -> *mut T {
        self.cell.get().cast()
    }
}

// ---------------------------------------------------------------------------
// Non-paged pool.
// ---------------------------------------------------------------------------

/// Non-paged pool with the alignment a `Layout` asks for.
///
/// Pool blocks are 16-byte aligned on x64. For larger alignments the
/// allocator over-allocates by `align`, rounds the pointer up, and stores
/// the pool block's address in the 8 bytes just below the aligned pointer,
/// where [`dealloc_aligned`](pool::dealloc_aligned) finds it. (`wdk-alloc`
/// ignores `Layout::align`; this does not.)
///
/// `ExAllocatePool2` exists from Windows 10 2004 on. It is resolved through
/// `MmGetSystemRoutineAddress` once (the mechanism of the WDK's
/// `POOL_ZERO_DOWN_LEVEL_SUPPORT`), falling back to
/// `ExAllocatePoolWithTag(NonPagedPoolNx)`, so one binary loads on older
/// systems — and under Wine, whose ntoskrnl lacks the routine.
pub mod pool {
    use core::alloc::Layout;
    use core::ptr::null_mut;
    use core::sync::atomic::{AtomicPtr, Ordering};

    use nt_sys::{
        _POOL_TYPE, ExAllocatePoolWithTag, ExFreePoolWithTag, MmGetSystemRoutineAddress,
        PFN_EX_ALLOCATE_POOL2, POOL_FLAG_NON_PAGED, POOL_FLAG_UNINITIALIZED, UNICODE_STRING,
    };

    /// Alignment every pool block has on x64.
    pub const POOL_ALIGN: usize = 16;
    /// The pool tag, `'KvSr'` as WinDbg's `!pool` shows it.
    pub const POOL_TAG: u32 = u32::from_le_bytes(*b"KvSr");

    /// Where raw blocks come from: the kernel pool, or a test double.
    pub trait PoolSource {
        /// A block of `size` bytes aligned to [`POOL_ALIGN`], or null.
        fn allocate(&self, size: usize, zeroed: bool) -> *mut u8;
        /// Returns a block `allocate` produced.
        ///
        /// # Safety
        /// `block` came from `allocate` of this source and is freed once.
        unsafe fn free(&self, block: *mut u8);
    }

    /// Allocates `layout` from `pool`, aligning beyond [`POOL_ALIGN`] by hand.
    pub fn alloc_aligned(pool: &impl PoolSource, layout: Layout, zeroed: bool) -> *mut u8 {
        let size = layout.size().max(1);
        if layout.align() <= POOL_ALIGN {
            return pool.allocate(size, zeroed);
        }
        // align >= 32: room for the aligned block and the 8-byte back-pointer.
        let Some(total) = size.checked_add(layout.align()) else {
            return null_mut();
        };
        let block = pool.allocate(total, zeroed);
        if block.is_null() {
            return null_mut();
        }
        let addr = block as usize;
        // NO-OVERFLOW: `addr + total` did not wrap for the pool, and the
        // rounded-up address is at most `addr + align`.
        let aligned = (addr + 8 + layout.align() - 1) & !(layout.align() - 1);
        let offset = aligned - addr;
        // `offset <= align`, so `aligned..aligned + size` and the 8 bytes
        // below it lie inside the `total`-byte block.
        let user = block.wrapping_add(offset);
        let back_pointer = user.wrapping_sub(8).cast::<*mut u8>();
        // SAFETY: `aligned - 8` is 8-aligned and inside the block (above).
        unsafe { back_pointer.write(block) };
        user
    }

    /// Frees what [`alloc_aligned`] returned for the same `layout`.
    ///
    /// # Safety
    /// `ptr` came from `alloc_aligned(pool, layout, _)` and is freed once.
    pub unsafe fn dealloc_aligned(pool: &impl PoolSource, ptr: *mut u8, layout: Layout) {
        if layout.align() <= POOL_ALIGN {
            // SAFETY: the block itself (caller contract).
            unsafe { pool.free(ptr) };
        } else {
            let back_pointer = ptr.wrapping_sub(8).cast::<*mut u8>();
            // SAFETY: `alloc_aligned` stored the block pointer just below
            // `ptr`, 8-aligned, inside the block.
            let block = unsafe { back_pointer.read() };
            // SAFETY: the block `allocate` returned.
            unsafe { pool.free(block) };
        }
    }

    /// `ExAllocatePool2` once resolved; null = not (yet) resolved, use the
    /// fallback.
    static EX_ALLOCATE_POOL2: AtomicPtr<()> = AtomicPtr::new(null_mut());

    /// Looks `ExAllocatePool2` up in the kernel's export table; before this
    /// runs (or where it finds nothing) the pool falls back to
    /// `ExAllocatePoolWithTag`.
    ///
    /// # IRQL
    /// `PASSIVE_LEVEL` (`MmGetSystemRoutineAddress`).
    pub fn resolve_pool_routines(_irql: &crate::irql::Passive<'_>) {
        let mut name = [0u16; 15];
        for (wide, ascii) in name.iter_mut().zip(b"ExAllocatePool2") {
            *wide = u16::from(*ascii);
        }
        // CAST: 30 bytes.
        let bytes = (name.len() * 2) as u16;
        let mut us = UNICODE_STRING {
            Length: bytes,
            MaximumLength: bytes,
            Buffer: name.as_ptr().cast_mut(),
        };
        // SAFETY: a valid counted string; the routine only reads it; the
        // token proves PASSIVE_LEVEL.
        let routine = unsafe { MmGetSystemRoutineAddress(&raw mut us) };
        EX_ALLOCATE_POOL2.store(routine.cast(), Ordering::Release);
    }

    /// Non-paged, no-execute pool.
    pub struct KernelPool;

    impl PoolSource for KernelPool {
        fn allocate(&self, size: usize, zeroed: bool) -> *mut u8 {
            let routine = EX_ALLOCATE_POOL2.load(Ordering::Acquire);
            if routine.is_null() {
                // SAFETY: non-paged pool may be allocated at IRQL <=
                // DISPATCH_LEVEL, where every caller of this runs.
                let p = unsafe {
                    ExAllocatePoolWithTag(_POOL_TYPE::NonPagedPoolNx, size as _, POOL_TAG)
                }
                .cast::<u8>();
                if zeroed && !p.is_null() {
                    // SAFETY: `p` is a fresh block of `size` bytes.
                    unsafe { core::ptr::write_bytes(p, 0, size) };
                }
                return p;
            }
            // SAFETY: the address MmGetSystemRoutineAddress returned for
            // "ExAllocatePool2", whose signature this is.
            let alloc: PFN_EX_ALLOCATE_POOL2 = unsafe { core::mem::transmute(routine) };
            let flags = if zeroed {
                POOL_FLAG_NON_PAGED
            } else {
                POOL_FLAG_NON_PAGED | POOL_FLAG_UNINITIALIZED
            };
            // SAFETY: non-paged flags, callable at IRQL <= DISPATCH_LEVEL.
            unsafe { alloc(flags, size, POOL_TAG) }.cast()
        }

        unsafe fn free(&self, block: *mut u8) {
            // SAFETY: a block from this pool with this tag (caller contract).
            unsafe { ExFreePoolWithTag(block.cast(), POOL_TAG) };
        }
    }
}

// ---------------------------------------------------------------------------
// The platform value.
// ---------------------------------------------------------------------------

/// The device object work items are queued against.
#[derive(Clone, Copy)]
struct IoObject(NonNull<DEVICE_OBJECT>);

// SAFETY: a device object is a kernel object usable from any thread; the
// pointer is only passed to `IoAllocateWorkItem`.
unsafe impl Send for IoObject {}
// SAFETY: as above.
unsafe impl Sync for IoObject {}

/// The NT platform. Cheap to clone; clones share the device object.
#[derive(Clone)]
pub struct NtPlatform {
    device: IoObject,
}

impl core::fmt::Debug for NtPlatform {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("NtPlatform")
            .field("device", &self.device.0)
            .finish()
    }
}

impl NtPlatform {
    /// A platform whose work items are queued against `device` (see the
    /// [module docs](self) for why a device object).
    ///
    /// # Safety
    /// `device` is a device object of the calling driver that stays valid
    /// until every work item and timer created through this platform (and
    /// its clones) has been dropped and its routine has returned.
    ///
    /// # IRQL
    /// Any.
    #[must_use]
    pub unsafe fn new(device: NonNull<DEVICE_OBJECT>) -> Self {
        NtPlatform {
            device: IoObject(device),
        }
    }

    /// The device object work items are queued against.
    #[must_use]
    pub fn device(&self) -> NonNull<DEVICE_OBJECT> {
        self.device.0
    }

    /// Waits until every DPC queued on any processor so far has run
    /// (`KeFlushQueuedDpcs`): the point after which a driver that stopped
    /// queueing DPCs may unload.
    ///
    /// # IRQL
    /// `PASSIVE_LEVEL`.
    pub fn flush_dpcs(&self, _irql: &Passive<'_>) {
        // SAFETY: the token proves PASSIVE_LEVEL, the routine's requirement.
        unsafe { KeFlushQueuedDpcs() };
    }
}

/// `KeQueryPerformanceCounter`'s frequency, read once.
static PERFORMANCE_FREQUENCY: AtomicU64 = AtomicU64::new(0);

// SAFETY: the `# Implementation safety` obligations of `Platform`:
// * `current_irql` reads cr8, the processor's IRQL — the same instruction
//   `wdm.h`'s inline `KeGetCurrentIrql` is on x64;
// * DPC and timer routines are the kernel's `KDEFERRED_ROUTINE`s, which it
//   calls at DISPATCH_LEVEL; work-item routines are `IO_WORKITEM_ROUTINE`s,
//   which a system worker thread calls at PASSIVE_LEVEL; each trampoline
//   mints its token for the duration of that call only;
// * a KDPC is queued at most once at a time (the kernel's rule, reported by
//   `KeInsertQueueDpc`'s result); work items refuse a second queue while
//   one is pending (`queued` flag); each queued routine holds a reference
//   to its storage, and a timer's storage is freed only after its DPC is
//   flushed (module docs);
// * `alloc_nonpaged` returns pool memory valid for the layout until
//   `free_nonpaged`.
unsafe impl Platform for NtPlatform {
    type SpinLock = NtSpinLock;
    type Event = NtEvent;
    type Mutex = NtMutex;
    type Dpc = NtDpc;
    type WorkItem = NtWorkItem;
    type Timer = NtTimer;

    fn current_irql() -> Irql {
        // SAFETY: kverbs' NT backend runs in kernel mode, where reading cr8
        // is allowed.
        Irql::from_raw(unsafe { KeGetCurrentIrql() })
    }

    fn now() -> Ticks {
        // SAFETY: any IRQL; a null frequency pointer is allowed.
        let counter = unsafe { KeQueryPerformanceCounter(null_mut()) };
        // SAFETY: every bit pattern of the union is a valid i64.
        Ticks(u64::try_from(unsafe { counter.QuadPart }).unwrap_or(0))
    }

    fn ticks_per_second() -> u64 {
        let cached = PERFORMANCE_FREQUENCY.load(Ordering::Relaxed);
        if cached != 0 {
            return cached;
        }
        let mut frequency = LARGE_INTEGER::default();
        // SAFETY: any IRQL; the frequency goes to a local.
        unsafe { KeQueryPerformanceCounter(&raw mut frequency) };
        // SAFETY: as above.
        let hz = u64::try_from(unsafe { frequency.QuadPart })
            .unwrap_or(1)
            .max(1);
        PERFORMANCE_FREQUENCY.store(hz, Ordering::Relaxed);
        hz
    }

    fn processor_count(&self) -> u32 {
        // CAST: the group number argument is a USHORT; 0xFFFF fits.
        // SAFETY: any IRQL.
        unsafe { KeQueryActiveProcessorCountEx(ALL_PROCESSOR_GROUPS as u16) }.max(1)
    }

    fn stall(&self, d: Duration) {
        for chunk in stall_chunks(d) {
            // SAFETY: any IRQL; a short busy wait.
            unsafe { KeStallExecutionProcessor(chunk) };
        }
    }

    fn delay(&self, d: Duration, _irql: &Passive<'_>) {
        let mut interval = LARGE_INTEGER {
            QuadPart: relative_due_time(d),
        };
        // SAFETY: the token proves PASSIVE_LEVEL; a non-alertable kernel-mode
        // wait on a relative interval in a local.
        unsafe { KeDelayExecutionThread(_MODE::KernelMode as _, 0, &raw mut interval) };
    }

    unsafe fn raise_to_dispatch() -> Irql {
        // CAST: DISPATCH_LEVEL is 2.
        // SAFETY: the caller is at <= DISPATCH_LEVEL and restores the level
        // (trait contract).
        Irql::from_raw(unsafe { KfRaiseIrql(DISPATCH_LEVEL as u8) })
    }

    unsafe fn lower_irql(old: Irql) {
        // SAFETY: `old` is what the matching raise returned (caller contract).
        unsafe { KeLowerIrql(old.raw()) };
    }

    fn new_dpc(
        &self,
        routine: DpcRoutine,
        target: DpcTarget,
        _irql: &Passive<'_>,
    ) -> Result<NtDpc, AllocError> {
        NtDpc::new(routine, target, self.processor_count())
    }

    fn new_work_item(
        &self,
        routine: WorkRoutine,
        _irql: &Passive<'_>,
    ) -> Result<NtWorkItem, AllocError> {
        NtWorkItem::new(self.device.0, routine)
    }

    fn new_timer(&self, routine: DpcRoutine, _irql: &Passive<'_>) -> Result<NtTimer, AllocError> {
        NtTimer::new(self.device.0, routine)
    }

    fn alloc_nonpaged(
        &self,
        layout: Layout,
        _irql: &Passive<'_>,
    ) -> Result<NonNull<u8>, AllocError> {
        NonNull::new(pool::alloc_aligned(&pool::KernelPool, layout, false)).ok_or(AllocError)
    }

    unsafe fn free_nonpaged(&self, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: from `alloc_nonpaged` with this layout (caller contract).
        unsafe { pool::dealloc_aligned(&pool::KernelPool, ptr.as_ptr(), layout) };
    }

    fn fill_random(&self, buf: &mut [u8], _irql: &Passive<'_>) -> Result<(), RandomUnavailable> {
        // `cbBuffer` is a ULONG: ask in pieces no longer than that.
        for piece in buf.chunks_mut(u32::MAX as usize) {
            // CAST: `chunks_mut` bounds the piece to u32::MAX bytes.
            let len = piece.len() as u32;
            // SAFETY: the token proves PASSIVE_LEVEL, where the
            // system-preferred generator may be used with a NULL handle;
            // `piece` is a live, writable buffer of `len` bytes (a kernel
            // stack or pool buffer, resident while the thread runs).
            let status = unsafe {
                BCryptGenRandom(
                    null_mut(),
                    piece.as_mut_ptr(),
                    len,
                    BCRYPT_USE_SYSTEM_PREFERRED_RNG,
                )
            };
            if status != STATUS_SUCCESS {
                return Err(RandomUnavailable);
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// Spin lock.
// ---------------------------------------------------------------------------

/// A `KSPIN_LOCK`.
pub struct NtSpinLock {
    lock: UnsafeCell<KSPIN_LOCK>,
}

// SAFETY: the kernel's spin-lock routines serialise every access to the
// word; Rust never touches it directly after `new`.
unsafe impl Send for NtSpinLock {}
// SAFETY: as above.
unsafe impl Sync for NtSpinLock {}

/// A `KLOCK_QUEUE_HANDLE`, the per-acquisition state of an in-stack queued
/// acquisition.
#[repr(transparent)]
pub struct NtQueueHandle(KLOCK_QUEUE_HANDLE);

impl NtQueueHandle {
    /// The kernel structure behind a handle pointer (same address).
    fn raw(handle: *mut NtQueueHandle) -> *mut KLOCK_QUEUE_HANDLE {
        handle.cast()
    }
}

impl Default for NtQueueHandle {
    fn default() -> Self {
        // SAFETY: all-zero is a valid KLOCK_QUEUE_HANDLE (pointers and an
        // integer); the acquisition initialises it.
        NtQueueHandle(unsafe { core::mem::zeroed() })
    }
}

// SAFETY: mutual exclusion and the IRQL effects are the kernel's:
// `KeAcquireSpinLockRaiseToDpc` and `KeAcquireInStackQueuedSpinLock` raise
// to DISPATCH_LEVEL and return (or record) the old level, which the
// release routines restore; the `AtDpcLevel` forms leave the IRQL alone.
// The lock word lives at a fixed address while held (it is borrowed).
unsafe impl RawSpinLock for NtSpinLock {
    type QueueHandle = NtQueueHandle;

    fn new() -> Self {
        NtSpinLock {
            lock: UnsafeCell::new(spin_lock_initializer()),
        }
    }

    fn acquire(&self) -> Irql {
        // SAFETY: a valid, initialised lock; callers are at <= DISPATCH_LEVEL
        // (the trait's IRQL contract, proven by the guard's token).
        Irql::from_raw(unsafe { KeAcquireSpinLockRaiseToDpc(self.lock.get()) })
    }

    unsafe fn release(&self, old: Irql) {
        // SAFETY: held by this thread, `old` from its acquisition (caller
        // contract).
        unsafe { KeReleaseSpinLock(self.lock.get(), old.raw()) };
    }

    fn acquire_at_dpc_level(&self) {
        // SAFETY: the caller is at DISPATCH_LEVEL (proven by its token).
        unsafe { KeAcquireSpinLockAtDpcLevel(self.lock.get()) };
    }

    unsafe fn release_from_dpc_level(&self) {
        // SAFETY: held from `acquire_at_dpc_level` (caller contract).
        unsafe { KeReleaseSpinLockFromDpcLevel(self.lock.get()) };
    }

    unsafe fn acquire_in_stack_queued(&self, handle: *mut NtQueueHandle) {
        // SAFETY: `handle` stays put until the matching release (caller
        // contract); the lock word is borrowed, so it does not move either.
        unsafe { KeAcquireInStackQueuedSpinLock(self.lock.get(), NtQueueHandle::raw(handle)) };
    }

    unsafe fn release_in_stack_queued(&self, handle: *mut NtQueueHandle) {
        // SAFETY: the handle of the matching acquisition, unmoved.
        unsafe { KeReleaseInStackQueuedSpinLock(NtQueueHandle::raw(handle)) };
    }

    unsafe fn acquire_in_stack_queued_at_dpc_level(&self, handle: *mut NtQueueHandle) {
        // SAFETY: as `acquire_in_stack_queued`; the caller is at
        // DISPATCH_LEVEL.
        unsafe {
            KeAcquireInStackQueuedSpinLockAtDpcLevel(self.lock.get(), NtQueueHandle::raw(handle))
        };
    }

    unsafe fn release_in_stack_queued_from_dpc_level(&self, handle: *mut NtQueueHandle) {
        // SAFETY: the handle of the matching acquisition, unmoved.
        unsafe { KeReleaseInStackQueuedSpinLockFromDpcLevel(NtQueueHandle::raw(handle)) };
    }
}

// ---------------------------------------------------------------------------
// Event and fast mutex.
// ---------------------------------------------------------------------------

/// A `KEVENT` in pinned storage.
///
/// Creating one allocates (kverbs creates events with their objects, at
/// `PASSIVE_LEVEL`); the trait's constructor is infallible, so pool
/// exhaustion here ends in the allocation-error handler (a bugcheck), like
/// any other infallible allocation.
pub struct NtEvent {
    event: Pinned<KEVENT>,
}

// SAFETY: the kernel synchronises every operation on a KEVENT.
unsafe impl Send for NtEvent {}
// SAFETY: as above.
unsafe impl Sync for NtEvent {}

impl NtEvent {
    fn wait_raw(&self, timeout: Option<Duration>) -> bool {
        let mut due = LARGE_INTEGER {
            QuadPart: timeout.map_or(0, relative_due_time),
        };
        let due_ptr = if timeout.is_some() {
            &raw mut due
        } else {
            null_mut()
        };
        // SAFETY: an initialised event at a fixed address; kernel mode,
        // non-alertable; callers hold a PASSIVE token.
        let status = unsafe {
            KeWaitForSingleObject(
                self.event.as_ptr().cast(),
                _KWAIT_REASON::Executive,
                _MODE::KernelMode as _,
                0,
                due_ptr,
            )
        };
        status == STATUS_SUCCESS
    }
}

impl RawEvent for NtEvent {
    fn new(kind: EventKind, signalled: bool) -> Self {
        let event = Pinned::zeroed();
        let kind = match kind {
            EventKind::Notification => _EVENT_TYPE::NotificationEvent,
            EventKind::Synchronization => _EVENT_TYPE::SynchronizationEvent,
        };
        // SAFETY: fresh pinned storage, initialised once, never moved.
        unsafe { KeInitializeEvent(event.as_ptr(), kind, u8::from(signalled)) };
        NtEvent { event }
    }

    fn set(&self, _irql: &impl LeDispatch) {
        // SAFETY: an initialised event; <= DISPATCH_LEVEL (token); Wait =
        // FALSE, so the caller does not keep the dispatcher lock.
        unsafe { KeSetEvent(self.event.as_ptr(), IO_NO_INCREMENT as _, 0) };
    }

    fn clear(&self, _irql: &impl LeDispatch) {
        // SAFETY: an initialised event; <= DISPATCH_LEVEL (token).
        unsafe { KeClearEvent(self.event.as_ptr()) };
    }

    fn wait(&self, _irql: &Passive<'_>) {
        self.wait_raw(None);
    }

    fn wait_timeout(&self, timeout: Duration, _irql: &Passive<'_>) -> bool {
        self.wait_raw(Some(timeout))
    }
}

/// A `FAST_MUTEX` in pinned storage, taken inside a critical region so the
/// holder stays at `PASSIVE_LEVEL` (module docs). Allocates like
/// [`NtEvent`].
pub struct NtMutex {
    mutex: Pinned<FAST_MUTEX>,
}

// SAFETY: the kernel synchronises every operation on a FAST_MUTEX.
unsafe impl Send for NtMutex {}
// SAFETY: as above.
unsafe impl Sync for NtMutex {}

// SAFETY: `ExAcquireFastMutexUnsafe` gives mutual exclusion with the
// acquire/release ordering of a kernel lock; the critical region entered
// before it (and left after the release) is what the routine requires of
// a caller at PASSIVE_LEVEL.
unsafe impl RawMutex for NtMutex {
    fn new() -> Self {
        let mutex = Pinned::zeroed();
        // SAFETY: fresh pinned storage, initialised once, never moved.
        unsafe { ExInitializeFastMutex(mutex.as_ptr()) };
        NtMutex { mutex }
    }

    fn lock(&self, _irql: &Passive<'_>) {
        // SAFETY: PASSIVE_LEVEL (token); paired with the leave in `unlock`.
        unsafe { KeEnterCriticalRegion() };
        // SAFETY: an initialised mutex inside a critical region.
        unsafe { ExAcquireFastMutexUnsafe(self.mutex.as_ptr()) };
    }

    unsafe fn unlock(&self) {
        // SAFETY: held by this thread (caller contract).
        unsafe { ExReleaseFastMutexUnsafe(self.mutex.as_ptr()) };
        // SAFETY: leaves the region `lock` entered.
        unsafe { KeLeaveCriticalRegion() };
    }
}

// ---------------------------------------------------------------------------
// DPC.
// ---------------------------------------------------------------------------

struct DpcInner {
    kdpc: UnsafeCell<KDPC>,
    routine: DpcRoutine,
}

// SAFETY: the KDPC is touched only by the kernel's DPC routines, which
// synchronise among themselves; the routine is `Send + Sync`.
unsafe impl Send for DpcInner {}
// SAFETY: as above.
unsafe impl Sync for DpcInner {}

/// A `KDPC` with its routine, in reference-counted pinned storage.
pub struct NtDpc {
    inner: Shared<DpcInner>,
}

/// The `KDEFERRED_ROUTINE` of every [`NtDpc`].
///
/// # Safety
/// Called by the kernel at DISPATCH_LEVEL for a DPC initialised in
/// [`NtDpc::new`], whose `DeferredContext` is its block; the insertion that
/// queued it made one reference, which this call consumes.
unsafe extern "system" fn dpc_trampoline(
    _dpc: *mut KDPC,
    context: PVOID,
    _argument1: PVOID,
    _argument2: PVOID,
) {
    // SAFETY: the queue's reference (contract above).
    let inner = unsafe { Shared::<DpcInner>::from_raw(context) };
    // SAFETY: the kernel runs DPC routines at DISPATCH_LEVEL, for this call.
    let token = unsafe { Dispatch::assume_unchecked() };
    (inner.get().routine)(&token);
}

impl NtDpc {
    fn new(routine: DpcRoutine, target: DpcTarget, processors: u32) -> Result<Self, AllocError> {
        let inner = Shared::try_new(DpcInner {
            // SAFETY: all-zero is valid storage for a KDPC before
            // KeInitializeDpc fills it.
            kdpc: UnsafeCell::new(unsafe { core::mem::zeroed() }),
            routine,
        })?;
        let kdpc = inner.get().kdpc.get();
        // SAFETY: pinned storage, initialised once before any queueing; the
        // context is the block, which outlives every run (module docs).
        unsafe { KeInitializeDpc(kdpc, Some(dpc_trampoline), inner.as_ptr()) };
        if let DpcTarget::Processor(n) = target {
            let mut number = PROCESSOR_NUMBER::default();
            // SAFETY: an index below the active processor count, a local
            // out-parameter.
            let status = unsafe { KeGetProcessorNumberFromIndex(n % processors, &raw mut number) };
            if status == STATUS_SUCCESS {
                // SAFETY: an initialised, not yet queued DPC.
                unsafe { KeSetTargetProcessorDpcEx(kdpc, &raw mut number) };
            }
        }
        Ok(NtDpc { inner })
    }
}

impl RawDpc for NtDpc {
    fn queue(&self) -> bool {
        let reference = self.inner.clone().into_raw();
        // SAFETY: an initialised DPC in pinned storage; any IRQL.
        let queued =
            unsafe { KeInsertQueueDpc(self.inner.get().kdpc.get(), null_mut(), null_mut()) };
        if queued == 0 {
            // Already queued: that insertion holds its own reference.
            // SAFETY: the reference made just above, never handed out.
            drop(unsafe { Shared::<DpcInner>::from_raw(reference) });
            return false;
        }
        true
    }

    fn cancel(&self) -> bool {
        // SAFETY: an initialised DPC; any IRQL.
        let removed = unsafe { KeRemoveQueueDpc(self.inner.get().kdpc.get()) };
        if removed == 0 {
            return false;
        }
        // The insertion's reference will not be consumed by a run now.
        // SAFETY: that reference is outstanding and given up here.
        unsafe { self.inner.release_raw() };
        true
    }
}

// ---------------------------------------------------------------------------
// Work item.
// ---------------------------------------------------------------------------

struct WorkInner {
    item: PIO_WORKITEM,
    queued: AtomicBool,
    routine: WorkRoutine,
}

// SAFETY: the IO_WORKITEM is used only through the kernel's routines, which
// may be called from any thread; the routine is `Send + Sync`.
unsafe impl Send for WorkInner {}
// SAFETY: as above.
unsafe impl Sync for WorkInner {}

impl Drop for WorkInner {
    fn drop(&mut self) {
        // SAFETY: the last reference: the item is neither queued nor
        // running (each of those holds a reference), or this runs at the
        // end of its own routine, where freeing it is allowed.
        unsafe { IoFreeWorkItem(self.item) };
    }
}

/// An `IO_WORKITEM` with its routine, in reference-counted storage.
pub struct NtWorkItem {
    inner: Shared<WorkInner>,
}

/// The `IO_WORKITEM_ROUTINE` of every [`NtWorkItem`].
///
/// # Safety
/// Called by a system worker thread at PASSIVE_LEVEL for an item queued by
/// [`NtWorkItem::queue`], whose context is a reference made for this run.
unsafe extern "system" fn work_trampoline(_device: *mut DEVICE_OBJECT, context: PVOID) {
    // SAFETY: the queue's reference (contract above).
    let inner = unsafe { Shared::<WorkInner>::from_raw(context) };
    // From here a new `queue` may succeed: this run has started.
    inner.get().queued.store(false, Ordering::Release);
    // SAFETY: system worker threads run work items at PASSIVE_LEVEL.
    let token = unsafe { Passive::assume_unchecked() };
    (inner.get().routine)(&token);
}

impl NtWorkItem {
    fn new(device: NonNull<DEVICE_OBJECT>, routine: WorkRoutine) -> Result<Self, AllocError> {
        // SAFETY: a device object of this driver (NtPlatform::new contract).
        let item = unsafe { IoAllocateWorkItem(device.as_ptr()) };
        if item.is_null() {
            return Err(AllocError);
        }
        let inner = Shared::try_new(WorkInner {
            item,
            queued: AtomicBool::new(false),
            routine,
        });
        if inner.is_err() {
            // SAFETY: allocated above, never queued.
            unsafe { IoFreeWorkItem(item) };
        }
        Ok(NtWorkItem { inner: inner? })
    }
}

impl RawWorkItem for NtWorkItem {
    fn queue(&self, _irql: &impl LeDispatch) -> bool {
        if self.inner.get().queued.swap(true, Ordering::AcqRel) {
            return false;
        }
        let reference = self.inner.clone().into_raw();
        // SAFETY: an allocated work item not queued now (flag above); <=
        // DISPATCH_LEVEL (token); the context is one reference for the run.
        unsafe {
            IoQueueWorkItem(
                self.inner.get().item,
                Some(work_trampoline),
                _WORK_QUEUE_TYPE::DelayedWorkQueue,
                reference,
            );
        };
        true
    }
}

// ---------------------------------------------------------------------------
// Timer.
// ---------------------------------------------------------------------------

struct TimerInner {
    ktimer: UnsafeCell<KTIMER>,
    kdpc: UnsafeCell<KDPC>,
    /// The work item that frees this block after `KeFlushQueuedDpcs`.
    reaper: PIO_WORKITEM,
    routine: DpcRoutine,
}

/// A one-shot `KTIMER` whose expiry runs its routine from a `KDPC`.
///
/// # Invariants
/// `inner` is a live block from `Box::into_raw`, owned by this handle until
/// `Drop` hands it to the reaper work item.
pub struct NtTimer {
    inner: NonNull<TimerInner>,
}

// SAFETY: the kernel objects are used only through the kernel's routines,
// callable from any thread; the routine is `Send + Sync`.
unsafe impl Send for NtTimer {}
// SAFETY: as above.
unsafe impl Sync for NtTimer {}

/// The timer's `KDEFERRED_ROUTINE`.
///
/// # Safety
/// Called by the kernel at DISPATCH_LEVEL when the timer of the block in
/// `context` expires. The block is freed only after `KeFlushQueuedDpcs`
/// has returned with the timer cancelled, so it outlives this call.
unsafe extern "system" fn timer_trampoline(
    _dpc: *mut KDPC,
    context: PVOID,
    _argument1: PVOID,
    _argument2: PVOID,
) {
    // SAFETY: a live block (contract above).
    let inner = unsafe { &*context.cast::<TimerInner>() };
    // SAFETY: DPC routines run at DISPATCH_LEVEL, for this call.
    let token = unsafe { Dispatch::assume_unchecked() };
    (inner.routine)(&token);
}

/// Frees a dropped timer's block once no DPC of it can run.
///
/// # Safety
/// Called by a system worker thread at PASSIVE_LEVEL; `context` is a block
/// an [`NtTimer`] gave up in `Drop`, after cancelling the timer.
unsafe extern "system" fn timer_reaper(_device: *mut DEVICE_OBJECT, context: PVOID) {
    // SAFETY: PASSIVE_LEVEL (work item). After this returns, every DPC
    // queued before — the timer's included — has run.
    unsafe { KeFlushQueuedDpcs() };
    // SAFETY: the block the timer's Drop gave up; nothing else refers to it
    // now (the timer is cancelled and its DPC flushed).
    let inner = unsafe { Box::from_raw(context.cast::<TimerInner>()) };
    let reaper = inner.reaper;
    drop(inner);
    // SAFETY: this routine's own work item; freeing it here is allowed.
    unsafe { IoFreeWorkItem(reaper) };
}

impl NtTimer {
    fn new(device: NonNull<DEVICE_OBJECT>, routine: DpcRoutine) -> Result<Self, AllocError> {
        // SAFETY: a device object of this driver (NtPlatform::new contract).
        let reaper = unsafe { IoAllocateWorkItem(device.as_ptr()) };
        if reaper.is_null() {
            return Err(AllocError);
        }
        let layout = Layout::new::<TimerInner>();
        // SAFETY: a non-zero-sized layout.
        let raw = unsafe { alloc::alloc::alloc(layout) }.cast::<TimerInner>();
        let Some(block) = NonNull::new(raw) else {
            // SAFETY: allocated above, never queued.
            unsafe { IoFreeWorkItem(reaper) };
            return Err(AllocError);
        };
        // SAFETY: all-zero is valid storage for a KTIMER before
        // KeInitializeTimerEx fills it (in place, below).
        let ktimer = unsafe { core::mem::zeroed() };
        // SAFETY: likewise for the KDPC and KeInitializeDpc.
        let kdpc = unsafe { core::mem::zeroed() };
        let value = TimerInner {
            ktimer: UnsafeCell::new(ktimer),
            kdpc: UnsafeCell::new(kdpc),
            reaper,
            routine,
        };
        // SAFETY: fresh storage for one TimerInner.
        unsafe { block.as_ptr().write(value) };
        // INVARIANT: the block came from the global allocator with the
        // layout `Box` uses, so `Box::from_raw` may free it.
        let timer = NtTimer { inner: block };
        let inner = timer.inner();
        // SAFETY: pinned storage, initialised once.
        unsafe { KeInitializeTimerEx(inner.ktimer.get(), _TIMER_TYPE::NotificationTimer) };
        // SAFETY: pinned storage, initialised once; the context outlives
        // every run (reaper).
        unsafe {
            KeInitializeDpc(
                inner.kdpc.get(),
                Some(timer_trampoline),
                block.as_ptr().cast(),
            )
        };
        Ok(timer)
    }

    fn inner(&self) -> &TimerInner {
        // SAFETY: live and owned while the handle exists (invariant).
        unsafe { self.inner.as_ref() }
    }
}

impl RawTimer for NtTimer {
    fn set(&self, due: Duration, _irql: &impl LeDispatch) -> bool {
        let due = LARGE_INTEGER {
            QuadPart: relative_due_time(due),
        };
        let inner = self.inner();
        // SAFETY: initialised timer and DPC; <= DISPATCH_LEVEL (token).
        unsafe { KeSetTimer(inner.ktimer.get(), due, inner.kdpc.get()) != 0 }
    }

    fn cancel(&self, _irql: &impl LeDispatch) -> bool {
        // SAFETY: an initialised timer; <= DISPATCH_LEVEL (token).
        unsafe { KeCancelTimer(self.inner().ktimer.get()) != 0 }
    }
}

impl Drop for NtTimer {
    fn drop(&mut self) {
        let inner = self.inner();
        // No expiry after this; an expiry whose DPC is already queued still
        // runs once (routines hold only `Weak`s to their owners), before the
        // reaper's flush returns.
        // SAFETY: an initialised timer; drops happen at <= DISPATCH_LEVEL.
        unsafe { KeCancelTimer(inner.ktimer.get()) };
        // The block goes to the reaper; no handle refers to it any more.
        // SAFETY: the timer's own, never queued work item; <= DISPATCH_LEVEL;
        // the routine frees the block after flushing DPCs.
        unsafe {
            IoQueueWorkItem(
                inner.reaper,
                Some(timer_reaper),
                _WORK_QUEUE_TYPE::DelayedWorkQueue,
                self.inner.as_ptr().cast(),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicUsize as StdCounter;

    #[test]
    fn due_times_are_relative_rounded_up_and_never_zero() {
        assert_eq!(relative_due_time(Duration::ZERO), -1);
        assert_eq!(relative_due_time(Duration::from_nanos(1)), -1);
        assert_eq!(relative_due_time(Duration::from_nanos(100)), -1);
        assert_eq!(relative_due_time(Duration::from_nanos(101)), -2);
        assert_eq!(relative_due_time(Duration::from_millis(1)), -10_000);
        assert_eq!(relative_due_time(Duration::from_secs(10)), -100_000_000);
        assert_eq!(relative_due_time(Duration::MAX), i64::MIN + 1);
    }

    #[test]
    fn stalls_are_split_into_short_chunks_that_add_up() {
        for (d, total) in [
            (Duration::ZERO, 0u128),
            (Duration::from_nanos(1), 1),
            (Duration::from_micros(50), 50),
            (Duration::from_micros(51), 51),
            (Duration::from_millis(3), 3000),
        ] {
            let chunks: Vec<u32> = stall_chunks(d).collect();
            assert!(
                chunks.iter().all(|&c| c > 0 && c <= STALL_CHUNK_US),
                "{d:?}"
            );
            assert_eq!(chunks.iter().map(|&c| u128::from(c)).sum::<u128>(), total);
        }
    }

    struct Counted(Arc<StdCounter>);
    impl Drop for Counted {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn shared_frees_once_after_the_last_reference() {
        let drops = Arc::new(StdCounter::new(0));
        let a = Shared::try_new(Counted(drops.clone())).unwrap();
        let b = a.clone();
        assert_eq!(a.ref_count(), 2);
        // A kernel queue takes a reference and gives it back on its run.
        let raw = a.clone().into_raw();
        assert_eq!(raw, a.as_ptr());
        assert_eq!(a.ref_count(), 3);
        drop(a);
        drop(b);
        assert_eq!(drops.load(Ordering::SeqCst), 0, "the queue still holds it");
        // SAFETY: the reference made by `into_raw` above.
        let run = unsafe { Shared::<Counted>::from_raw(raw) };
        assert_eq!(run.ref_count(), 1);
        drop(run);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_reference_taken_back_out_of_a_queue_is_released_by_the_handle() {
        let drops = Arc::new(StdCounter::new(0));
        let handle = Shared::try_new(Counted(drops.clone())).unwrap();
        let _raw = handle.clone().into_raw();
        // SAFETY: the reference made just above.
        unsafe { handle.release_raw() };
        assert_eq!(handle.ref_count(), 1);
        drop(handle);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn shared_is_pinned_and_borrowable_from_its_raw_address() {
        let handle = Shared::try_new(41_u64).unwrap();
        let address = handle.as_ptr();
        let moved = handle;
        assert_eq!(moved.as_ptr(), address);
        // SAFETY: `moved` keeps the block alive.
        assert_eq!(unsafe { *Shared::<u64>::borrow_raw(address) }, 41);
    }

    #[test]
    fn shared_references_race_to_exactly_one_free() {
        let drops = Arc::new(StdCounter::new(0));
        let handle = Shared::try_new(Counted(drops.clone())).unwrap();
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let mine = handle.clone();
                std::thread::spawn(move || {
                    for _ in 0..1000 {
                        let raw = mine.clone().into_raw();
                        // SAFETY: the reference made just above.
                        drop(unsafe { Shared::<Counted>::from_raw(raw) });
                    }
                })
            })
            .collect();
        drop(handle);
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(drops.load(Ordering::SeqCst), 1);
    }

    /// A pool double with the kernel's 16-byte alignment and a live count.
    #[derive(Default)]
    struct TestPool {
        live: core::cell::Cell<isize>,
    }

    const HDR: usize = 16;

    impl pool::PoolSource for TestPool {
        fn allocate(&self, size: usize, zeroed: bool) -> *mut u8 {
            let Ok(l) = Layout::from_size_align(size + HDR, pool::POOL_ALIGN) else {
                return null_mut();
            };
            let p = if zeroed {
                // SAFETY: non-zero size.
                unsafe { std::alloc::alloc_zeroed(l) }
            } else {
                // SAFETY: non-zero size.
                unsafe { std::alloc::alloc(l) }
            };
            // SAFETY: the block has HDR spare bytes in front for its size.
            unsafe { p.cast::<usize>().write(size) };
            self.live.set(self.live.get() + 1);
            // SAFETY: inside the block.
            unsafe { p.add(HDR) }
        }

        unsafe fn free(&self, block: *mut u8) {
            // SAFETY: `block` came from `allocate`.
            let p = unsafe { block.sub(HDR) };
            // SAFETY: the size written by `allocate`.
            let size = unsafe { p.cast::<usize>().read() };
            let l = Layout::from_size_align(size + HDR, pool::POOL_ALIGN).unwrap();
            // SAFETY: allocated with this layout.
            unsafe { std::alloc::dealloc(p, l) };
            self.live.set(self.live.get() - 1);
        }
    }

    #[test]
    fn pool_honours_every_alignment_and_frees_what_it_took() {
        let pool = TestPool::default();
        for align_log in 0..=12 {
            for size in [1, 7, 64, 4095] {
                let layout = Layout::from_size_align(size, 1 << align_log).unwrap();
                let p = pool::alloc_aligned(&pool, layout, true);
                assert!(!p.is_null());
                assert_eq!(p as usize % layout.align(), 0, "{layout:?}");
                // SAFETY: `size` bytes were just allocated, zeroed.
                let bytes = unsafe { std::slice::from_raw_parts_mut(p, size) };
                assert!(bytes.iter().all(|&b| b == 0));
                bytes.fill(0xA5);
                // SAFETY: from `alloc_aligned` with this layout, once.
                unsafe { pool::dealloc_aligned(&pool, p, layout) };
            }
        }
        assert_eq!(pool.live.get(), 0);
    }

    #[test]
    fn a_failing_or_overflowing_pool_request_yields_null() {
        struct Empty;
        impl pool::PoolSource for Empty {
            fn allocate(&self, _: usize, _: bool) -> *mut u8 {
                null_mut()
            }
            unsafe fn free(&self, _: *mut u8) {
                unreachable!("nothing was allocated");
            }
        }
        for align in [8, 64] {
            let layout = Layout::from_size_align(8, align).unwrap();
            assert!(pool::alloc_aligned(&Empty, layout, false).is_null());
        }
        let huge = Layout::from_size_align(isize::MAX as usize - 63, 64).unwrap();
        assert!(pool::alloc_aligned(&TestPool::default(), huge, false).is_null());
    }

    #[test]
    fn queue_handles_start_zeroed() {
        let handle = NtQueueHandle::default();
        assert!(handle.0.LockQueue.Next.is_null());
        assert!(handle.0.LockQueue.Lock.is_null());
        assert_eq!(handle.0.OldIrql, 0);
    }
}
