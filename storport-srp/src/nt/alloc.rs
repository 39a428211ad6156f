//! The kernel global allocator: non-paged pool with the alignment a
//! `Layout` asks for — kverbs' NT pool ([`kverbs::platform::nt::pool`]),
//! which also resolves `ExAllocatePool2` (falling back to
//! `ExAllocatePoolWithTag` before Windows 10 2004, and under Wine).
//!
//! Allocation is a PASSIVE_LEVEL affair in this project (the design's
//! rule); the allocator itself is callable at IRQL <= DISPATCH_LEVEL, as the
//! pool is.

use core::alloc::{GlobalAlloc, Layout};

use kverbs::platform::nt::pool::{KernelPool, alloc_aligned, dealloc_aligned};

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
