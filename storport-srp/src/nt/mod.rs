//! The NT shim: everything between the Windows kernel and the miniport core.
//!
//! * [`ffi`] — the bindings facade: `nt-sys`'s kernel part plus the
//!   StorPort part (wdk-sys on Windows, mingw-w64 + hand-written StorPort
//!   declarations on Linux);
//! * [`miniport`] — the `extern "system"` trampolines that map StorPort's
//!   callbacks onto the core's [`HwMiniport`](crate::storport::HwMiniport),
//!   the device extension, the virtual-miniport registration and
//!   `DriverEntry`'s body, for any [`NtDriver`](miniport::NtDriver);
//! * [`port`] — [`NtStorPort`](port::NtStorPort), the core's
//!   [`StorPort`](crate::storport::StorPort) over `storport.sys`;
//! * [`srb`] — [`NtSrb`](srb::NtSrb), the core's
//!   [`Srb`](crate::storport::Srb) over both SRB forms, checked;
//! * [`dma`] — scatter/gather lists from the HCA's DMA adapter;
//! * [`params`] — the registry `Parameters`, `DriverParameter` and the
//!   attached targets, parsed strictly;
//! * [`no_hca`] — the transport (no HCA on Windows yet) and the driver the
//!   `kvsrp.sys` crate registers;
//! * [`alloc`] — the pool-backed global allocator;
//! * [`bugcheck_on_panic`] — the panic path (a panic is a bugcheck).
//!
//! The kernel primitives (spin locks, DPCs, work items, timers, pool) are
//! kverbs' NT platform (`kverbs::platform::nt`). The driver crate
//! (`storport-srp/driver`) is a few lines on top of this:
//! `#[panic_handler]`, `#[global_allocator]` and the `DriverEntry` export.

pub mod alloc;
pub mod dma;
pub mod ffi;
pub mod miniport;
pub mod no_hca;
pub mod params;
pub mod port;
pub mod srb;

use core::panic::PanicInfo;

/// Bugcheck code for a Rust panic: ASCII "RPNC", as `wdk-panic` uses, so
/// crash dumps of either driver read the same.
pub const RUST_PANIC_BUGCHECK_CODE: u32 = u32::from_be_bytes(*b"RPNC");

/// Bugchecks with the panic's location: parameter 1 and 2 are the source
/// file name's address and length (readable in the dump), 3 the line, 4 the
/// column. The driver's `#[panic_handler]` calls this.
///
/// # IRQL
/// Any.
pub fn bugcheck_on_panic(info: &PanicInfo<'_>) -> ! {
    let (file, len, line, column) = info.location().map_or((0, 0, 0, 0), |l| {
        (
            l.file().as_ptr() as u64,
            l.file().len() as u64,
            u64::from(l.line()),
            u64::from(l.column()),
        )
    });
    // SAFETY: KeBugCheckEx takes plain values and is callable at any IRQL;
    // it does not return.
    unsafe { ffi::KeBugCheckEx(RUST_PANIC_BUGCHECK_CODE, file, len, line, column) }
}

// `__chkstk`: the MSVC target calls it for any frame over a page, and
// neither compiler-builtins nor the kernel import libraries provide it. This
// one touches each page of the new frame from the top down (a kernel stack
// has a guard page, so an overflow faults there instead of corrupting memory
// below) and clobbers only r10, r11 and flags, as the MSVC contract allows.
#[cfg(all(target_os = "windows", target_arch = "x86_64"))]
core::arch::global_asm!(
    ".globl __chkstk",
    "__chkstk:",
    "    lea r10, [rsp + 8]", // the caller's rsp
    "    mov r11, r10",
    "    sub r11, rax", // lowest address of the new frame
    "    jb 3f",        // wrapped: let the final probe fault
    "2:  sub r10, 0x1000",
    "    cmp r10, r11",
    "    jb 3f",
    "    test qword ptr [r10], r10",
    "    jmp 2b",
    "3:  test qword ptr [r11], r11",
    "    ret",
);
