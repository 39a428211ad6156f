//! `kvsrp.sys`: the StorPort virtual miniport for SRP and iSER over RDMA.
//!
//! Everything lives in `storport_srp::nt`; this crate only supplies what a
//! kernel image needs exactly once: the `DriverEntry` export, the panic
//! handler (a panic bugchecks with its location) and the pool allocator.
//! It registers the real miniport core over the transport Windows has
//! today, one without an HCA
//! ([`NoHcaDriver`](storport_srp::nt::no_hca::NoHcaDriver)).

#![no_std]

use storport_srp::nt::alloc::PoolAllocator;
use storport_srp::nt::ffi::{DRIVER_OBJECT, NTSTATUS, PCUNICODE_STRING};
use storport_srp::nt::miniport::driver_entry as register;
use storport_srp::nt::no_hca::NoHcaDriver;

#[global_allocator]
static ALLOCATOR: PoolAllocator = PoolAllocator;

#[panic_handler]
fn panic(info: &core::panic::PanicInfo<'_>) -> ! {
    storport_srp::nt::bugcheck_on_panic(info)
}

/// The image entry point: registers the adapter with StorPort.
///
/// # Safety
/// Called once by the I/O manager at PASSIVE_LEVEL with this driver's
/// object and its service key path.
// SAFETY: the one symbol named `DriverEntry` in the image (/ENTRY).
#[unsafe(export_name = "DriverEntry")]
pub unsafe extern "system" fn driver_entry(
    driver: *mut DRIVER_OBJECT,
    registry_path: PCUNICODE_STRING,
) -> NTSTATUS {
    // SAFETY: forwarded unchanged from the I/O manager, once.
    unsafe { register::<NoHcaDriver>(driver, registry_path) }
}
