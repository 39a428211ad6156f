//! A test-double `storport.sys` for Wine.
//!
//! `StorPortInitialize` plays StorPort's part for one virtual adapter:
//! HwFindAdapter, HwInitialize, the passive-initialisation callback, StartIo
//! with a classic and an extended INQUIRY to a target ID inside the reported
//! range and one to a target outside it, HwResetBus, HwAdapterControl and
//! HwFreeAdapterResources. It records the raw facts of each step as REG_SZ
//! values under `HKLM\...\Services\kvsrp\SmokeRun` (`RtlWriteRegistryValue`)
//! and judges nothing: `kv-sys smoke` reads them back and asserts.
//!
//! It uses the declarations of `storport_srp::nt::ffi`, so it checks the
//! shim's behaviour, not the layouts themselves (those cannot be checked
//! without a WDK).

#![no_std]
#![allow(non_snake_case, reason = "StorPort's export names")]

use core::cell::UnsafeCell;
use core::fmt::Write as _;
use storport_srp::nt::ffi::{
    _INTERFACE_TYPE, _SCSI_ADAPTER_CONTROL_TYPE, _SCSI_NOTIFICATION_TYPE, BOOLEAN,
    EnablePassiveInitialization, HW_INITIALIZATION_DATA, NTSTATUS, PCHAR,
    PORT_CONFIGURATION_INFORMATION, PVOID, SCSI_REQUEST_BLOCK, SCSI_SUPPORTED_CONTROL_TYPE_LIST,
    SRB_FUNCTION_STORAGE_REQUEST_BLOCK, SRB_SIGNATURE, STATUS_SUCCESS, STATUS_UNSUCCESSFUL,
    STOR_ADDRESS_TYPE_BTL8, STORAGE_REQUEST_BLOCK_VERSION_1, SrbExDataTypeScsiCdb16, ULONG,
};

#[global_allocator]
static ALLOCATOR: storport_srp::nt::alloc::PoolAllocator = storport_srp::nt::alloc::PoolAllocator;

#[panic_handler]
fn panic(_: &core::panic::PanicInfo<'_>) -> ! {
    loop {}
}

unsafe extern "system" {
    fn RtlCreateRegistryKey(RelativeTo: ULONG, Path: *const u16) -> NTSTATUS;
    fn RtlWriteRegistryValue(
        RelativeTo: ULONG,
        Path: *const u16,
        ValueName: *const u16,
        ValueType: ULONG,
        ValueData: PVOID,
        ValueLength: ULONG,
    ) -> NTSTATUS;
}

/// `RTL_REGISTRY_SERVICES`: paths relative to `...\CurrentControlSet\Services`.
const RTL_REGISTRY_SERVICES: ULONG = 1;
const REG_SZ: ULONG = 1;

/// State of the one simulated adapter (single-threaded: everything runs
/// inside `StorPortInitialize`).
struct Shared<T>(UnsafeCell<T>);
// SAFETY: only touched from the one thread that runs StorPortInitialize.
unsafe impl<T> Sync for Shared<T> {}

#[repr(C, align(16))]
struct Extension([u8; 4096]);

static EXTENSION: Shared<Extension> = Shared(UnsafeCell::new(Extension([0; 4096])));
/// (RequestComplete count, last completed SRB).
static COMPLETED: Shared<(u32, usize)> = Shared(UnsafeCell::new((0, 0)));
static PASSIVE: Shared<usize> = Shared(UnsafeCell::new(0));

/// Widens ASCII into a NUL-terminated UTF-16 buffer.
fn wide<const N: usize>(s: &str) -> [u16; N] {
    let mut w = [0u16; N];
    for (d, b) in w.iter_mut().zip(s.bytes().take(N - 1)) {
        *d = u16::from(b);
    }
    w
}

/// A fixed-capacity text buffer.
struct Line {
    buf: [u8; 240],
    len: usize,
}

impl core::fmt::Write for Line {
    fn write_str(&mut self, s: &str) -> core::fmt::Result {
        for b in s.bytes() {
            if self.len < self.buf.len() {
                self.buf[self.len] = b;
                self.len += 1;
            }
        }
        Ok(())
    }
}

/// Records one fact as `SmokeRun\<key> = <text>`.
fn note(key: &str, args: core::fmt::Arguments<'_>) {
    let mut line = Line { buf: [0; 240], len: 0 };
    let _ = line.write_fmt(args);
    let text = core::str::from_utf8(&line.buf[..line.len]).unwrap_or("?");
    let path = wide::<32>("kvsrp\\SmokeRun");
    let name = wide::<64>(key);
    let mut data = wide::<256>(text);
    let bytes = ((text.len().min(255) + 1) * 2) as ULONG;
    // SAFETY: NUL-terminated wide strings and a buffer of `bytes` bytes.
    unsafe {
        RtlCreateRegistryKey(RTL_REGISTRY_SERVICES, path.as_ptr());
        RtlWriteRegistryValue(
            RTL_REGISTRY_SERVICES,
            path.as_ptr(),
            name.as_ptr(),
            REG_SZ,
            data.as_mut_ptr().cast(),
            bytes,
        );
    }
}

/// StorPort's notification entry. Variadic in C; the Windows x64 ABI passes
/// the first four arguments of a variadic call in the same registers as a
/// fixed one, and no notification used here has more.
#[unsafe(no_mangle)]
pub unsafe extern "system" fn StorPortNotification(kind: u32, _ext: PVOID, a: usize, b: usize) {
    if kind == _SCSI_NOTIFICATION_TYPE::RequestComplete {
        // SAFETY: single-threaded (see `Shared`).
        unsafe { *COMPLETED.0.get() = ((*COMPLETED.0.get()).0 + 1, a) };
    } else if kind == EnablePassiveInitialization {
        // SAFETY: single-threaded; `b` is the caller's LONG success flag.
        unsafe {
            *PASSIVE.0.get() = a;
            if b != 0 {
                (b as *mut i32).write(1);
            }
        }
    }
}

/// Present so the allowlist's export exists; the shim does not call it.
#[unsafe(no_mangle)]
pub unsafe extern "system" fn StorPortExtendedFunction(_code: u32, _ext: PVOID) -> ULONG {
    1 // STOR_STATUS_NOT_IMPLEMENTED-like: anything but success
}

type FindAdapter = unsafe extern "system" fn(
    PVOID,
    PVOID,
    PVOID,
    PVOID,
    PCHAR,
    *mut PORT_CONFIGURATION_INFORMATION,
    *mut BOOLEAN,
) -> ULONG;

/// Runs one request through StartIo and records the outcome.
///
/// # Safety
/// `srb` points to a live request block; `hw` is the miniport's registration.
unsafe fn start_io(key: &str, hw: &HW_INITIALIZATION_DATA, ext: PVOID, srb: PVOID) {
    // SAFETY: single-threaded.
    let before = unsafe { (*COMPLETED.0.get()).0 };
    let Some(start) = hw.HwStartIo else {
        note(key, format_args!("no HwStartIo"));
        return;
    };
    // SAFETY: the miniport's StartIo with its extension and a live SRB.
    let ret = unsafe { start(ext, srb.cast()) };
    // SAFETY: single-threaded; the SRB is live.
    let (count, last) = unsafe { *COMPLETED.0.get() };
    let status = unsafe { srb.cast::<u8>().add(3).read() };
    let (scsi, xfer) = if unsafe { srb.cast::<u8>().add(2).read() } == SRB_FUNCTION_STORAGE_REQUEST_BLOCK as u8 {
        // SAFETY: the extended layout built below: ScsiStatus of the CDB16
        // block at 144 + 8, DataTransferLength at 60.
        unsafe { (srb.cast::<u8>().add(152).read(), srb.cast::<u8>().add(60).cast::<u32>().read()) }
    } else {
        let s = srb.cast::<SCSI_REQUEST_BLOCK>();
        // SAFETY: a classic SRB.
        unsafe { ((*s).ScsiStatus, (*s).DataTransferLength) }
    };
    note(
        key,
        format_args!(
            "ret={ret} completions={} same_srb={} srb_status={status:#04x} scsi_status={scsi} transferred={xfer}",
            count - before,
            u8::from(last == srb as usize)
        ),
    );
}

fn classic_inquiry(target: u8) -> SCSI_REQUEST_BLOCK {
    let mut srb = SCSI_REQUEST_BLOCK::default();
    srb.Length = core::mem::size_of::<SCSI_REQUEST_BLOCK>() as u16;
    srb.TargetId = target;
    srb.CdbLength = 6;
    srb.Cdb[..6].copy_from_slice(&[0x12, 0, 0, 0, 36, 0]);
    srb.DataTransferLength = 36;
    srb.ScsiStatus = 0xff;
    srb
}

#[repr(C, align(8))]
struct ExBlock([u8; 192]);

fn put32(b: &mut ExBlock, at: usize, v: u32) {
    b.0[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

/// An extended INQUIRY as StorPort lays it out: header, BTL8 address at
/// 128, one 16-byte-CDB block at 144.
fn extended_inquiry(target: u8) -> ExBlock {
    let mut b = ExBlock([0; 192]);
    b.0[0] = 8; // Length: offset of Signature
    b.0[2] = SRB_FUNCTION_STORAGE_REQUEST_BLOCK as u8;
    put32(&mut b, 8, SRB_SIGNATURE as u32);
    put32(&mut b, 12, STORAGE_REQUEST_BLOCK_VERSION_1 as u32);
    put32(&mut b, 16, 184);
    put32(&mut b, 52, 128);
    put32(&mut b, 56, 1);
    put32(&mut b, 60, 36);
    put32(&mut b, 120, 144);
    b.0[128..130].copy_from_slice(&(STOR_ADDRESS_TYPE_BTL8 as u16).to_le_bytes());
    put32(&mut b, 132, 4);
    b.0[136..139].copy_from_slice(&[0, target, 0]);
    put32(&mut b, 144, SrbExDataTypeScsiCdb16 as u32);
    put32(&mut b, 148, 32);
    b.0[152] = 0xff;
    b.0[154] = 6;
    b.0[168..174].copy_from_slice(&[0x12, 0, 0, 0, 36, 0]);
    b
}

/// StorPort's initialisation, played for one virtual adapter.
///
/// # Safety
/// Called by the driver's DriverEntry with a valid registration.
#[unsafe(no_mangle)]
pub unsafe extern "system" fn StorPortInitialize(
    _driver: PVOID,
    _registry: PVOID,
    init: *mut HW_INITIALIZATION_DATA,
    _context: PVOID,
) -> ULONG {
    if init.is_null() {
        note("00-error", format_args!("null HW_INITIALIZATION_DATA"));
        return STATUS_UNSUCCESSFUL as ULONG;
    }
    // SAFETY: the driver's registration, live for this call.
    let hw = unsafe { &*init };
    note(
        "01-registration",
        format_args!(
            "size={} interface={} features={:#x} srb_types={:#x} address_types={:#x} ext={} map={} find={} init={} start={} reset={} control={} free={} build={}",
            hw.HwInitializationDataSize,
            hw.AdapterInterfaceType,
            hw.FeatureSupport,
            hw.SrbTypeFlags,
            hw.AddressTypeFlags,
            hw.DeviceExtensionSize,
            hw.MapBuffers,
            u8::from(!hw.HwFindAdapter.is_null()),
            u8::from(hw.HwInitialize.is_some()),
            u8::from(hw.HwStartIo.is_some()),
            u8::from(hw.HwResetBus.is_some()),
            u8::from(hw.HwAdapterControl.is_some()),
            u8::from(hw.HwFreeAdapterResources.is_some()),
            u8::from(hw.HwBuildIo.is_some()),
        ),
    );
    if hw.HwInitializationDataSize as usize != core::mem::size_of::<HW_INITIALIZATION_DATA>()
        || hw.DeviceExtensionSize as usize > core::mem::size_of::<Extension>()
        || hw.HwFindAdapter.is_null()
    {
        return STATUS_UNSUCCESSFUL as ULONG;
    }
    let ext: PVOID = EXTENSION.0.get().cast();
    // SAFETY: a zeroed PORT_CONFIGURATION_INFORMATION is what StorPort
    // starts from (integers and pointers).
    let mut config: PORT_CONFIGURATION_INFORMATION = unsafe { core::mem::zeroed() };
    config.Length = core::mem::size_of::<PORT_CONFIGURATION_INFORMATION>() as ULONG;
    config.AdapterInterfaceType = _INTERFACE_TYPE::Internal;
    let mut again: BOOLEAN = 0;
    // SAFETY: the registration's HwFindAdapter is the virtual form (its
    // FeatureSupport says virtual; recorded above and checked by the test).
    let find: FindAdapter = unsafe { core::mem::transmute(hw.HwFindAdapter) };
    // SAFETY: a zeroed extension of the requested size and a config.
    let found = unsafe {
        find(ext, core::ptr::null_mut(), core::ptr::null_mut(), core::ptr::null_mut(),
             core::ptr::null_mut(), &raw mut config, &raw mut again)
    };
    note(
        "02-find-adapter",
        format_args!(
            "ret={found} buses={} targets={} luns={} virtual={} map={} srb_type={} max_io={} per_lun={} max_transfer={}",
            config.NumberOfBuses,
            config.MaximumNumberOfTargets,
            config.MaximumNumberOfLogicalUnits,
            config.VirtualDevice,
            config.MapBuffers,
            config.SrbType,
            config.MaxNumberOfIO,
            config.MaxIOsPerLun,
            config.MaximumTransferLength,
        ),
    );
    let Some(initialize) = hw.HwInitialize else {
        return STATUS_UNSUCCESSFUL as ULONG;
    };
    // SAFETY: the miniport's HwInitialize with its extension.
    let ok = unsafe { initialize(ext) };
    // SAFETY: single-threaded.
    let passive = unsafe { *PASSIVE.0.get() };
    note("03-initialize", format_args!("ret={ok} passive_registered={}", u8::from(passive != 0)));
    if passive != 0 {
        // SAFETY: the routine the miniport registered, of this type.
        let routine: unsafe extern "system" fn(PVOID) -> BOOLEAN = unsafe { core::mem::transmute(passive) };
        // SAFETY: its extension.
        let ok = unsafe { routine(ext) };
        note("04-passive-initialize", format_args!("ret={ok}"));
    }
    let mut srb = classic_inquiry(0);
    // SAFETY: live SRBs for each call.
    unsafe { start_io("05-inquiry-classic", hw, ext, (&raw mut srb).cast()) };
    let mut ex = extended_inquiry(1);
    // SAFETY: as above.
    unsafe { start_io("06-inquiry-extended", hw, ext, ex.0.as_mut_ptr().cast()) };
    let mut far = classic_inquiry(200);
    // SAFETY: as above.
    unsafe { start_io("07-inquiry-out-of-range", hw, ext, (&raw mut far).cast()) };
    if let Some(reset) = hw.HwResetBus {
        // SAFETY: the miniport's HwResetBus.
        let ok = unsafe { reset(ext, 0) };
        note("08-reset-bus", format_args!("ret={ok}"));
    }
    if let Some(control) = hw.HwAdapterControl {
        #[repr(C)]
        struct List {
            head: SCSI_SUPPORTED_CONTROL_TYPE_LIST,
            more: [BOOLEAN; 8],
        }
        // SAFETY: zero is a valid list.
        let mut list: List = unsafe { core::mem::zeroed() };
        list.head.MaxControlType = 5;
        // SAFETY: the miniport's HwAdapterControl with a 5-entry list.
        let ret = unsafe {
            control(ext, _SCSI_ADAPTER_CONTROL_TYPE::ScsiQuerySupportedControlTypes, (&raw mut list).cast())
        };
        let entries = (&raw const list.head.SupportedTypeList).cast::<BOOLEAN>();
        // SAFETY: 5 entries inside `list`.
        let s = |i| unsafe { entries.add(i).read() };
        note("09-adapter-control", format_args!("ret={ret} supported={}{}{}{}{}", s(0), s(1), s(2), s(3), s(4)));
    }
    if let Some(free) = hw.HwFreeAdapterResources {
        // SAFETY: the miniport's teardown, last call.
        unsafe { free(ext) };
        note("10-free-adapter-resources", format_args!("done"));
    }
    STATUS_SUCCESS as ULONG
}
