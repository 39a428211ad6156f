//! The NT shim: everything between the Windows kernel and the miniport core.
//!
//! * [`ffi`] — the one bindings facade (wdk-sys on Windows, mingw-w64 +
//!   hand-written StorPort declarations on Linux);
//! * [`miniport`] — the [`Miniport`](miniport::Miniport) trait the core
//!   implements, the `extern "system"` trampolines, the virtual-miniport
//!   registration and `DriverEntry`'s body;
//! * [`srb`] — a checked view of both SRB forms;
//! * [`no_target`] — the adapter used until the core lands;
//! * [`alloc`] — the pool-backed global allocator that honours alignment;
//! * [`bugcheck_on_panic`] — the panic path (a panic is a bugcheck).
//!
//! The driver crate (`storport-srp/driver`) is a few lines on top of this:
//! `#[panic_handler]`, `#[global_allocator]` and the `DriverEntry` export.

pub mod alloc;
pub mod ffi;
pub mod miniport;
pub mod no_target;
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
            l.file().as_ptr() as usize,
            l.file().len(),
            l.line() as usize,
            l.column() as usize,
        )
    });
    // SAFETY: KeBugCheckEx takes plain values and is callable at any IRQL;
    // it does not return.
    unsafe {
        ffi::KeBugCheckEx(
            RUST_PANIC_BUGCHECK_CODE,
            file as _,
            len as _,
            line as _,
            column as _,
        )
    }
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
