//! The kernel global allocator: non-paged pool through `ExAllocatePool2`,
//! honouring `Layout::align` (which `wdk-alloc` ignores, its FIXME).
//!
//! Pool blocks are 16-byte aligned on x64. For larger alignments the
//! allocator over-allocates by `align`, rounds the pointer up, and stores the
//! pool block's address in the 8 bytes just below the aligned pointer, where
//! `dealloc` finds it.
//!
//! `ExAllocatePool2` exists from Windows 10 2004 on. It is resolved through
//! `MmGetSystemRoutineAddress` when `DriverEntry` runs (the mechanism of the
//! WDK's `POOL_ZERO_DOWN_LEVEL_SUPPORT`), falling back to
//! `ExAllocatePoolWithTag(NonPagedPoolNx)`, so one binary loads on older
//! systems — and under Wine, whose ntoskrnl lacks the routine.
//!
//! Allocation is a PASSIVE_LEVEL affair in this project (the design's
//! rule); the allocator itself is callable at IRQL <= DISPATCH_LEVEL, as the
//! pool is.

use core::alloc::{GlobalAlloc, Layout};
use core::ptr::null_mut;

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
    // SAFETY: `offset <= align`, so `aligned..aligned + size` and the 8 bytes
    // below it lie inside the `total`-byte block; `aligned - 8` is 8-aligned.
    unsafe {
        let user = block.add(offset);
        user.sub(8).cast::<usize>().write(addr);
        user
    }
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
        // SAFETY: `alloc_aligned` stored the block address just below `ptr`.
        let block = unsafe { ptr.sub(8).cast::<usize>().read() } as *mut u8;
        // SAFETY: the block `allocate` returned.
        unsafe { pool.free(block) };
    }
}

mod kernel {
    use super::{POOL_TAG, PoolSource};
    use crate::nt::ffi::{
        _POOL_TYPE, ExAllocatePoolWithTag, ExFreePoolWithTag, MmGetSystemRoutineAddress,
        PFN_EX_ALLOCATE_POOL2, POOL_FLAG_NON_PAGED, POOL_FLAG_UNINITIALIZED, UNICODE_STRING,
    };
    use core::sync::atomic::{AtomicPtr, Ordering};

    /// `ExAllocatePool2` once resolved; null = use the fallback.
    static EX_ALLOCATE_POOL2: AtomicPtr<()> = AtomicPtr::new(core::ptr::null_mut());

    /// Looks `ExAllocatePool2` up in the kernel's export table.
    ///
    /// # IRQL
    /// PASSIVE_LEVEL (`MmGetSystemRoutineAddress`).
    pub fn resolve_pool_routines() {
        let name: &[u16] = &[
            b'E' as u16,
            b'x' as u16,
            b'A' as u16,
            b'l' as u16,
            b'l' as u16,
            b'o' as u16,
            b'c' as u16,
            b'a' as u16,
            b't' as u16,
            b'e' as u16,
            b'P' as u16,
            b'o' as u16,
            b'o' as u16,
            b'l' as u16,
            b'2' as u16,
        ];
        let bytes = (name.len() * 2) as u16;
        let mut us = UNICODE_STRING {
            Length: bytes,
            MaximumLength: bytes,
            Buffer: name.as_ptr().cast_mut(),
        };
        // SAFETY: a valid counted string; the routine only reads it.
        let routine = unsafe { MmGetSystemRoutineAddress(&raw mut us) };
        EX_ALLOCATE_POOL2.store(routine.cast(), Ordering::Release);
    }

    /// Non-paged, no-execute pool.
    pub struct KernelPool;

    impl PoolSource for KernelPool {
        fn allocate(&self, size: usize, zeroed: bool) -> *mut u8 {
            let routine = EX_ALLOCATE_POOL2.load(Ordering::Acquire);
            if routine.is_null() {
                // SAFETY: IRQL <= DISPATCH with non-paged pool is allowed.
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
            unsafe { alloc(flags, size as _, POOL_TAG) }.cast()
        }

        unsafe fn free(&self, block: *mut u8) {
            // SAFETY: a block from this pool with this tag (caller contract).
            unsafe { ExFreePoolWithTag(block.cast(), POOL_TAG) };
        }
    }
}

pub use kernel::{KernelPool, resolve_pool_routines};

/// The `#[global_allocator]` a driver installs.
pub struct PoolAllocator;

// SAFETY: blocks come from the pool with the layout's size and alignment
// (alloc_aligned) and go back to it (dealloc_aligned).
unsafe impl GlobalAlloc for PoolAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        alloc_aligned(&KernelPool, layout, false)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        alloc_aligned(&KernelPool, layout, true)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc`/`alloc_zeroed` with this layout.
        unsafe { dealloc_aligned(&KernelPool, ptr, layout) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::alloc::{alloc, alloc_zeroed, dealloc};
    use std::cell::Cell;

    /// A pool double with the kernel's 16-byte alignment and a live count.
    #[derive(Default)]
    struct TestPool {
        live: Cell<isize>,
    }

    const HDR: usize = 16;

    impl PoolSource for TestPool {
        fn allocate(&self, size: usize, zeroed: bool) -> *mut u8 {
            let l = Layout::from_size_align(size + HDR, POOL_ALIGN).unwrap();
            // SAFETY: non-zero size.
            let p = unsafe { if zeroed { alloc_zeroed(l) } else { alloc(l) } };
            // SAFETY: the block has HDR spare bytes in front for its size.
            unsafe {
                p.cast::<usize>().write(size);
                self.live.set(self.live.get() + 1);
                p.add(HDR)
            }
        }

        unsafe fn free(&self, block: *mut u8) {
            // SAFETY: `block` came from `allocate`.
            unsafe {
                let p = block.sub(HDR);
                let size = p.cast::<usize>().read();
                dealloc(p, Layout::from_size_align(size + HDR, POOL_ALIGN).unwrap());
            }
            self.live.set(self.live.get() - 1);
        }
    }

    #[test]
    fn every_alignment_is_honoured_and_freed() {
        let pool = TestPool::default();
        for align_log in 0..=12 {
            for size in [1, 7, 64, 4095] {
                let layout = Layout::from_size_align(size, 1 << align_log).unwrap();
                let p = alloc_aligned(&pool, layout, true);
                assert!(!p.is_null());
                assert_eq!(p as usize % layout.align(), 0, "{layout:?}");
                // SAFETY: `size` bytes were just allocated, zeroed.
                unsafe {
                    assert!(std::slice::from_raw_parts(p, size).iter().all(|&b| b == 0));
                    p.write_bytes(0xA5, size);
                    dealloc_aligned(&pool, p, layout);
                }
            }
        }
        assert_eq!(pool.live.get(), 0);
    }

    #[test]
    fn a_failing_pool_yields_null() {
        struct Empty;
        impl PoolSource for Empty {
            fn allocate(&self, _: usize, _: bool) -> *mut u8 {
                null_mut()
            }
            unsafe fn free(&self, _: *mut u8) {
                unreachable!("nothing was allocated");
            }
        }
        for align in [8, 64] {
            assert!(
                alloc_aligned(&Empty, Layout::from_size_align(8, align).unwrap(), false).is_null()
            );
        }
    }

    #[test]
    fn overflowing_requests_yield_null() {
        let layout = Layout::from_size_align(usize::MAX - 63, 64).unwrap_or(Layout::new::<u8>());
        if layout.align() == 64 {
            assert!(alloc_aligned(&TestPool::default(), layout, false).is_null());
        }
    }
}
