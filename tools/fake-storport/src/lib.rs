//! A test-double `storport.sys` for Wine.
//!
//! `StorPortInitialize` plays StorPort's part for one virtual adapter over
//! the real miniport core: HwFindAdapter (with a `DriverParameter`
//! argument string, and an adapter device object from `IoCreateDevice` for
//! `StorPortGetDeviceObjects`), HwInitialize, the passive-initialisation
//! callback, then waits until the core's passive worker (kverbs work items
//! on Wine's thread pool) has reported both attached targets; StartIo with
//! a classic and an extended INQUIRY to attached targets and one to a
//! target outside them (requeuing `SRB_STATUS_BUSY` answers, as StorPort
//! does, while the adapter comes up), HwResetBus, HwAdapterControl (query,
//! stop, restart — running the DPC the core issues from them), another
//! INQUIRY, HwFreeAdapterResources.
//!
//! It records the raw facts of each step as REG_SZ values under
//! `HKLM\...\Services\kvsrp\SmokeRun` (`RtlWriteRegistryValue`) and judges
//! nothing: `kv-sys wine` reads them back and asserts. StorPort services
//! the core calls from its worker threads are counted with atomics.

#![no_std]
#![allow(non_snake_case, reason = "StorPort's export names")]

use core::fmt::Write as _;
use core::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use storport_srp::nt::ffi::{
    _INTERFACE_TYPE, _SCSI_ADAPTER_CONTROL_TYPE, _SCSI_NOTIFICATION_TYPE, BOOLEAN,
    EnablePassiveInitialization, ExtFunctionGetDeviceObjects, HW_INITIALIZATION_DATA,
    InitializeDpc, IssueDpc, NTSTATUS, PCHAR, PORT_CONFIGURATION_INFORMATION, PVOID,
    SCSI_REQUEST_BLOCK, SCSI_SUPPORTED_CONTROL_TYPE_LIST, SRB_FUNCTION_STORAGE_REQUEST_BLOCK,
    SRB_SIGNATURE, STATUS_SUCCESS, STATUS_UNSUCCESSFUL, STOR_ADDRESS_TYPE_BTL8,
    STOR_STATUS_NOT_IMPLEMENTED, STOR_STATUS_SUCCESS, STORAGE_REQUEST_BLOCK_VERSION_1,
    SrbExDataTypeScsiCdb16, ULONG,
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
    fn IoCreateDevice(
        DriverObject: PVOID,
        DeviceExtensionSize: ULONG,
        DeviceName: PVOID,
        DeviceType: ULONG,
        DeviceCharacteristics: ULONG,
        Exclusive: BOOLEAN,
        DeviceObject: *mut PVOID,
    ) -> NTSTATUS;
    fn IoDeleteDevice(DeviceObject: PVOID);
    fn KeDelayExecutionThread(WaitMode: i8, Alertable: BOOLEAN, Interval: *mut i64) -> NTSTATUS;
}

/// `RTL_REGISTRY_SERVICES`: paths relative to `...\CurrentControlSet\Services`.
const RTL_REGISTRY_SERVICES: ULONG = 1;
const REG_SZ: ULONG = 1;
/// `FILE_DEVICE_CONTROLLER`.
const FILE_DEVICE_CONTROLLER: ULONG = 4;
/// `SRB_STATUS_BUSY`.
const SRB_STATUS_BUSY: u8 = 0x05;
/// The argument string StorPort would read from `DriverParameter`.
const DRIVER_PARAMETER: &[u8] = b"QueueSize=32\0";

#[repr(C, align(16))]
struct Extension([u8; 8192]);

static mut EXTENSION: Extension = Extension([0; 8192]);
/// The request extension every SRB gets (one request at a time here).
static mut SRB_EXTENSION: Extension = Extension([0; 8192]);

static COMPLETED: AtomicU32 = AtomicU32::new(0);
static LAST_COMPLETED: AtomicUsize = AtomicUsize::new(0);
static PASSIVE_ROUTINE: AtomicUsize = AtomicUsize::new(0);
static DPC_ROUTINE: AtomicUsize = AtomicUsize::new(0);
static DPCS_INITIALIZED: AtomicU32 = AtomicU32::new(0);
static DPC_OBJECT: AtomicUsize = AtomicUsize::new(0);
/// Issued DPCs not yet run, by their first system argument + 1.
static DPC_PENDING: AtomicUsize = AtomicUsize::new(0);
static DPCS_ISSUED: AtomicU32 = AtomicU32::new(0);
static BUS_CHANGES: AtomicU32 = AtomicU32::new(0);
static LOG_ERRORS: AtomicU32 = AtomicU32::new(0);
static LAST_LOG: AtomicU32 = AtomicU32::new(0);
static HOLDS: AtomicU32 = AtomicU32::new(0);
static RELEASES: AtomicU32 = AtomicU32::new(0);
static DEVICE: AtomicUsize = AtomicUsize::new(0);

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
    let mut line = Line {
        buf: [0; 240],
        len: 0,
    };
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

/// Sleeps `ms` milliseconds.
fn sleep_ms(ms: i64) {
    let mut interval = -ms * 10_000;
    // SAFETY: a relative interval in a local; kernel mode.
    unsafe { KeDelayExecutionThread(0, 0, &mut interval) };
}

/// Waits up to ~10 s for `done`; returns whether it came true.
fn wait_until(done: impl Fn() -> bool) -> bool {
    for _ in 0..1000 {
        if done() {
            return true;
        }
        sleep_ms(10);
    }
    done()
}

/// StorPort's notification entry. Variadic in C; the Windows x64 ABI passes
/// variadic arguments in the same registers and stack slots as fixed ones.
#[unsafe(no_mangle)]
pub unsafe extern "system" fn StorPortNotification(
    kind: u32,
    _ext: PVOID,
    a: usize,
    b: usize,
    c: usize,
    d: usize,
) {
    if kind == _SCSI_NOTIFICATION_TYPE::RequestComplete {
        LAST_COMPLETED.store(a, Ordering::SeqCst);
        COMPLETED.fetch_add(1, Ordering::SeqCst);
    } else if kind == _SCSI_NOTIFICATION_TYPE::BusChangeDetected {
        BUS_CHANGES.fetch_add(1, Ordering::SeqCst);
    } else if kind == EnablePassiveInitialization {
        PASSIVE_ROUTINE.store(a, Ordering::SeqCst);
        if b != 0 {
            // SAFETY: the caller's LONG success flag.
            unsafe { (b as *mut i32).write(1) };
        }
    } else if kind == InitializeDpc {
        DPC_OBJECT.store(a, Ordering::SeqCst);
        DPC_ROUTINE.store(b, Ordering::SeqCst);
        DPCS_INITIALIZED.fetch_add(1, Ordering::SeqCst);
    } else if kind == IssueDpc {
        // (dpc, SystemArgument1, SystemArgument2, &BOOLEAN queued)
        let _ = c;
        let queued = DPC_PENDING
            .compare_exchange(0, b + 1, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok();
        DPCS_ISSUED.fetch_add(1, Ordering::SeqCst);
        if d != 0 {
            // SAFETY: the caller's BOOLEAN.
            unsafe { (d as *mut u8).write(u8::from(queued)) };
        }
    }
}

/// Runs the DPC a StartIo or adapter control issued, as StorPort would
/// once the caller's IRQL drops.
fn run_pending_dpc() {
    let pending = DPC_PENDING.swap(0, Ordering::SeqCst);
    let routine = DPC_ROUTINE.load(Ordering::SeqCst);
    if pending == 0 || routine == 0 {
        return;
    }
    // SAFETY: the HW_DPC_ROUTINE the miniport registered.
    let routine: unsafe extern "system" fn(PVOID, PVOID, PVOID, PVOID) =
        unsafe { core::mem::transmute(routine) };
    // SAFETY: the DPC object, the extension and the issuer's argument.
    unsafe {
        routine(
            DPC_OBJECT.load(Ordering::SeqCst) as PVOID,
            (&raw mut EXTENSION).cast(),
            (pending - 1) as PVOID,
            core::ptr::null_mut(),
        )
    };
}

/// The StorPort extended functions the miniport uses.
#[unsafe(no_mangle)]
pub unsafe extern "system" fn StorPortExtendedFunction(
    code: u32,
    _ext: PVOID,
    a: usize,
    b: usize,
    c: usize,
) -> ULONG {
    if code == ExtFunctionGetDeviceObjects {
        // SAFETY: the caller's three out-parameters.
        unsafe {
            (a as *mut usize).write(DEVICE.load(Ordering::SeqCst));
            (b as *mut usize).write(0);
            (c as *mut usize).write(0);
        }
        return STOR_STATUS_SUCCESS;
    }
    STOR_STATUS_NOT_IMPLEMENTED
}

macro_rules! hold {
    ($($name:ident($($arg:ident: $ty:ty),*)),* $(,)?) => {$(
        /// A queue hold: counted.
        #[unsafe(no_mangle)]
        pub unsafe extern "system" fn $name(_ext: PVOID $(, $arg: $ty)*) -> BOOLEAN {
            $(let _ = $arg;)*
            HOLDS.fetch_add(1, Ordering::SeqCst);
            1
        }
    )*};
}
macro_rules! release {
    ($($name:ident($($arg:ident: $ty:ty),*)),* $(,)?) => {$(
        /// A hold released: counted.
        #[unsafe(no_mangle)]
        pub unsafe extern "system" fn $name(_ext: PVOID $(, $arg: $ty)*) -> BOOLEAN {
            $(let _ = $arg;)*
            RELEASES.fetch_add(1, Ordering::SeqCst);
            1
        }
    )*};
}
hold!(
    StorPortBusy(n: ULONG),
    StorPortPause(t: ULONG),
    StorPortDeviceBusy(p: u8, t: u8, l: u8, n: ULONG),
    StorPortPauseDevice(p: u8, t: u8, l: u8, s: ULONG),
);
release!(
    StorPortReady(),
    StorPortResume(),
    StorPortDeviceReady(p: u8, t: u8, l: u8),
    StorPortResumeDevice(p: u8, t: u8, l: u8),
);

/// `StorPortLogError`: counted, the unique id kept.
#[unsafe(no_mangle)]
pub unsafe extern "system" fn StorPortLogError(
    _ext: PVOID,
    _srb: PVOID,
    _path: u8,
    _target: u8,
    _lun: u8,
    _code: ULONG,
    unique: ULONG,
) {
    LAST_LOG.store(unique, Ordering::SeqCst);
    LOG_ERRORS.fetch_add(1, Ordering::SeqCst);
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

/// Runs one request through StartIo, requeuing `SRB_STATUS_BUSY` answers
/// (StorPort reissues them) while the adapter comes up, and records the
/// outcome.
///
/// # Safety
/// `srb` points to a live request block whose extension pointer is ours;
/// `hw` is the miniport's registration.
unsafe fn start_io(key: &str, hw: &HW_INITIALIZATION_DATA, srb: PVOID, make: &dyn Fn(PVOID)) {
    let Some(start) = hw.HwStartIo else {
        note(key, format_args!("no HwStartIo"));
        return;
    };
    let ext: PVOID = (&raw mut EXTENSION).cast();
    let mut ret = 0;
    let mut completions = 0;
    let mut last = 0;
    for _ in 0..500 {
        make(srb);
        let before = COMPLETED.load(Ordering::SeqCst);
        // SAFETY: the miniport's StartIo with its extension and a live SRB.
        ret = unsafe { start(ext, srb.cast()) };
        run_pending_dpc();
        completions = COMPLETED.load(Ordering::SeqCst) - before;
        last = LAST_COMPLETED.load(Ordering::SeqCst);
        // SAFETY: the SRB is live; the status byte is at 3 in both forms.
        let status = unsafe { srb.cast::<u8>().add(3).read() };
        if status != SRB_STATUS_BUSY {
            break;
        }
        sleep_ms(10);
    }
    // SAFETY: the SRB is live.
    let status = unsafe { srb.cast::<u8>().add(3).read() };
    // SAFETY: as above; the function byte says which form.
    let extended = unsafe { srb.cast::<u8>().add(2).read() } == SRB_FUNCTION_STORAGE_REQUEST_BLOCK;
    let (scsi, xfer) = if extended {
        // SAFETY: the extended layout built below: ScsiStatus of the CDB16
        // block at 144 + 8, DataTransferLength at 60.
        unsafe {
            (
                srb.cast::<u8>().add(152).read(),
                srb.cast::<u8>().add(60).cast::<u32>().read(),
            )
        }
    } else {
        let s = srb.cast::<SCSI_REQUEST_BLOCK>();
        // SAFETY: a classic SRB.
        unsafe { ((*s).ScsiStatus, (*s).DataTransferLength) }
    };
    note(
        key,
        format_args!(
            "ret={ret} completions={completions} same_srb={} srb_status={status:#04x} scsi_status={scsi} transferred={xfer}",
            u8::from(last == srb as usize)
        ),
    );
}

fn srb_extension() -> PVOID {
    (&raw mut SRB_EXTENSION).cast()
}

fn classic_inquiry(target: u8) -> impl Fn(PVOID) {
    move |p: PVOID| {
        let mut srb = SCSI_REQUEST_BLOCK::default();
        srb.Length = core::mem::size_of::<SCSI_REQUEST_BLOCK>() as u16;
        srb.TargetId = target;
        srb.CdbLength = 6;
        srb.Cdb[..6].copy_from_slice(&[0x12, 0, 0, 0, 36, 0]);
        srb.DataTransferLength = 36;
        srb.SrbFlags = 0x40; // SRB_FLAGS_DATA_IN
        srb.ScsiStatus = 0xff;
        srb.SrbExtension = srb_extension();
        // SAFETY: `p` is a classic SRB's storage.
        unsafe { p.cast::<SCSI_REQUEST_BLOCK>().write(srb) };
    }
}

#[repr(C, align(8))]
struct ExBlock([u8; 192]);

fn put32(b: &mut ExBlock, at: usize, v: u32) {
    b.0[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

/// An extended INQUIRY as StorPort lays it out: header, BTL8 address at
/// 128, one 16-byte-CDB block at 144.
fn extended_inquiry(target: u8) -> impl Fn(PVOID) {
    move |p: PVOID| {
        let mut b = ExBlock([0; 192]);
        b.0[0] = 8; // Length: offset of Signature
        b.0[2] = SRB_FUNCTION_STORAGE_REQUEST_BLOCK;
        put32(&mut b, 8, SRB_SIGNATURE);
        put32(&mut b, 12, STORAGE_REQUEST_BLOCK_VERSION_1);
        put32(&mut b, 16, 184);
        put32(&mut b, 24, 0x40); // SrbFlags: DATA_IN
        put32(&mut b, 52, 128);
        put32(&mut b, 56, 1);
        put32(&mut b, 60, 36);
        b.0[104..112].copy_from_slice(&(srb_extension() as u64).to_le_bytes());
        put32(&mut b, 120, 144);
        b.0[128..130].copy_from_slice(&STOR_ADDRESS_TYPE_BTL8.to_le_bytes());
        put32(&mut b, 132, 4);
        b.0[136..139].copy_from_slice(&[0, target, 0]);
        put32(&mut b, 144, SrbExDataTypeScsiCdb16);
        put32(&mut b, 148, 32);
        b.0[152] = 0xff;
        b.0[154] = 6;
        b.0[168..174].copy_from_slice(&[0x12, 0, 0, 0, 36, 0]);
        // SAFETY: `p` is 192 bytes of 8-aligned storage.
        unsafe { p.cast::<ExBlock>().write(b) };
    }
}

/// `HwAdapterControl(control)`, then the DPC it issued; records `ret`.
///
/// # Safety
/// `hw` is the miniport's registration.
unsafe fn adapter_control(key: &str, hw: &HW_INITIALIZATION_DATA, control: u32, logs: u32) {
    let Some(routine) = hw.HwAdapterControl else {
        return;
    };
    let issued = DPCS_ISSUED.load(Ordering::SeqCst);
    // SAFETY: the miniport's HwAdapterControl; Stop/Restart take no list.
    let ret = unsafe { routine((&raw mut EXTENSION).cast(), control, core::ptr::null_mut()) };
    let dpcs = DPCS_ISSUED.load(Ordering::SeqCst) - issued;
    run_pending_dpc();
    let settled = wait_until(|| LOG_ERRORS.load(Ordering::SeqCst) >= logs);
    note(
        key,
        format_args!("ret={ret} dpcs_issued={dpcs} settled={}", u8::from(settled)),
    );
}

/// StorPort's initialisation, played for one virtual adapter.
///
/// # Safety
/// Called by the driver's DriverEntry with a valid registration.
#[unsafe(no_mangle)]
pub unsafe extern "system" fn StorPortInitialize(
    driver: PVOID,
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
            "size={} interface={} features={:#x} srb_types={:#x} address_types={:#x} ext_fits={} srb_ext_fits={} map={} find={} init={} start={} reset={} control={} free={} build={}",
            hw.HwInitializationDataSize,
            hw.AdapterInterfaceType,
            hw.FeatureSupport,
            hw.SrbTypeFlags,
            hw.AddressTypeFlags,
            u8::from(hw.DeviceExtensionSize as usize <= core::mem::size_of::<Extension>()),
            u8::from(hw.SrbExtensionSize as usize <= core::mem::size_of::<Extension>()),
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
        || hw.SrbExtensionSize as usize > core::mem::size_of::<Extension>()
        || hw.HwFindAdapter.is_null()
    {
        return STATUS_UNSUCCESSFUL as ULONG;
    }
    let mut device: PVOID = core::ptr::null_mut();
    // SAFETY: the driver object DriverEntry got; an unnamed controller
    // device stands in for the adapter FDO StorPort would create.
    let created = unsafe {
        IoCreateDevice(
            driver,
            0,
            core::ptr::null_mut(),
            FILE_DEVICE_CONTROLLER,
            0,
            0,
            &mut device,
        )
    };
    if created != STATUS_SUCCESS || device.is_null() {
        note("00-error", format_args!("IoCreateDevice {created:#x}"));
        return STATUS_UNSUCCESSFUL as ULONG;
    }
    DEVICE.store(device as usize, Ordering::SeqCst);
    let ext: PVOID = (&raw mut EXTENSION).cast();
    // SAFETY: a zeroed PORT_CONFIGURATION_INFORMATION is what StorPort
    // starts from (integers and pointers).
    let mut config: PORT_CONFIGURATION_INFORMATION = unsafe { core::mem::zeroed() };
    config.Length = core::mem::size_of::<PORT_CONFIGURATION_INFORMATION>() as ULONG;
    config.AdapterInterfaceType = _INTERFACE_TYPE::Internal;
    let mut again: BOOLEAN = 0;
    // SAFETY: the registration's HwFindAdapter is the virtual form (its
    // FeatureSupport says virtual; recorded above and checked by the test).
    let find: FindAdapter = unsafe { core::mem::transmute(hw.HwFindAdapter) };
    // SAFETY: a zeroed extension of the requested size, the argument string
    // and a config.
    let found = unsafe {
        find(
            ext,
            core::ptr::null_mut(),
            core::ptr::null_mut(),
            core::ptr::null_mut(),
            DRIVER_PARAMETER.as_ptr().cast_mut().cast(),
            &raw mut config,
            &raw mut again,
        )
    };
    note(
        "02-find-adapter",
        format_args!(
            "ret={found} buses={} targets={} luns={} virtual={} map={} srb_type={} max_io={} per_lun={} max_transfer={} breaks={} dpcs={}",
            config.NumberOfBuses,
            config.MaximumNumberOfTargets,
            config.MaximumNumberOfLogicalUnits,
            config.VirtualDevice,
            config.MapBuffers,
            config.SrbType,
            config.MaxNumberOfIO,
            config.MaxIOsPerLun,
            config.MaximumTransferLength,
            config.NumberOfPhysicalBreaks,
            DPCS_INITIALIZED.load(Ordering::SeqCst),
        ),
    );
    if found != 1 {
        // SAFETY: the device created above.
        unsafe { IoDeleteDevice(device) };
        return STATUS_UNSUCCESSFUL as ULONG;
    }
    let Some(initialize) = hw.HwInitialize else {
        return STATUS_UNSUCCESSFUL as ULONG;
    };
    // SAFETY: the miniport's HwInitialize with its extension.
    let ok = unsafe { initialize(ext) };
    let passive = PASSIVE_ROUTINE.load(Ordering::SeqCst);
    note(
        "03-initialize",
        format_args!("ret={ok} passive_registered={}", u8::from(passive != 0)),
    );
    if passive != 0 {
        // SAFETY: the routine the miniport registered, of this type.
        let routine: unsafe extern "system" fn(PVOID) -> BOOLEAN =
            unsafe { core::mem::transmute(passive) };
        // SAFETY: its extension.
        let ok = unsafe { routine(ext) };
        note("04-passive-initialize", format_args!("ret={ok}"));
    }
    // The core starts its transport on the passive worker (a kverbs work
    // item, here on Wine's thread pool): both targets are reported (a bus
    // change each, a target-state log entry each) and the adapter is
    // announced running (one more log entry).
    let started = wait_until(|| {
        BUS_CHANGES.load(Ordering::SeqCst) >= 2 && LOG_ERRORS.load(Ordering::SeqCst) >= 3
    });
    note(
        "05-targets-reported",
        format_args!(
            "started={} bus_changes={} log_entries={}",
            u8::from(started),
            BUS_CHANGES.load(Ordering::SeqCst),
            LOG_ERRORS.load(Ordering::SeqCst),
        ),
    );
    let mut classic = SCSI_REQUEST_BLOCK::default();
    let classic_ptr: PVOID = (&raw mut classic).cast();
    let mut ex = ExBlock([0; 192]);
    let ex_ptr: PVOID = ex.0.as_mut_ptr().cast();
    // SAFETY: live SRBs for each call, re-made before each issue.
    unsafe { start_io("06-inquiry-classic", hw, classic_ptr, &classic_inquiry(0)) };
    // SAFETY: as above.
    unsafe { start_io("07-inquiry-extended", hw, ex_ptr, &extended_inquiry(1)) };
    // SAFETY: as above.
    unsafe {
        start_io(
            "08-inquiry-out-of-range",
            hw,
            classic_ptr,
            &classic_inquiry(200),
        )
    };
    if let Some(reset) = hw.HwResetBus {
        // SAFETY: the miniport's HwResetBus.
        let ok = unsafe { reset(ext, 0) };
        note(
            "09-reset-bus",
            format_args!(
                "ret={ok} last_log={:#010x}",
                LAST_LOG.load(Ordering::SeqCst)
            ),
        );
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
            control(
                ext,
                _SCSI_ADAPTER_CONTROL_TYPE::ScsiQuerySupportedControlTypes,
                (&raw mut list).cast(),
            )
        };
        let entries = (&raw const list.head.SupportedTypeList).cast::<BOOLEAN>();
        // SAFETY: 5 entries inside `list`.
        let s = |i| unsafe { entries.add(i).read() };
        note(
            "10-adapter-control",
            format_args!(
                "ret={ret} supported={}{}{}{}{}",
                s(0),
                s(1),
                s(2),
                s(3),
                s(4)
            ),
        );
    }
    // Stop: the core queues teardown to its worker through a DPC, which
    // logs "adapter stopped" when done (log entry 5, after the bus reset's).
    // SAFETY: the registration.
    unsafe {
        adapter_control(
            "11-stop-adapter",
            hw,
            _SCSI_ADAPTER_CONTROL_TYPE::ScsiStopAdapter,
            5,
        )
    };
    // Restart: the same way back, "adapter restarted" (entry 6).
    // SAFETY: the registration.
    unsafe {
        adapter_control(
            "12-restart-adapter",
            hw,
            _SCSI_ADAPTER_CONTROL_TYPE::ScsiRestartAdapter,
            6,
        )
    };
    // SAFETY: as for the first INQUIRYs.
    unsafe {
        start_io(
            "13-inquiry-after-restart",
            hw,
            classic_ptr,
            &classic_inquiry(1),
        )
    };
    if let Some(free) = hw.HwFreeAdapterResources {
        // SAFETY: the miniport's teardown, last call.
        unsafe { free(ext) };
        note(
            "14-free-adapter-resources",
            format_args!(
                "done dpcs_pending={}",
                u8::from(DPC_PENDING.load(Ordering::SeqCst) != 0)
            ),
        );
        note(
            "15-holds",
            format_args!(
                "holds={} releases={}",
                HOLDS.load(Ordering::SeqCst),
                RELEASES.load(Ordering::SeqCst)
            ),
        );
    }
    // SAFETY: the device created above; nothing refers to it now.
    unsafe { IoDeleteDevice(device) };
    STATUS_SUCCESS as ULONG
}
