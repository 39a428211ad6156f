//! StorPort's callbacks mapped onto the core's [`HwMiniport`]: the
//! `extern "system"` trampolines, the device extension they share, the
//! virtual-miniport registration, and `DriverEntry`'s body.
//!
//! # Virtual, not physical
//! The adapter registers as a StorPort **virtual** miniport
//! (`STOR_FEATURE_VIRTUAL_MINIPORT` in the Windows 8+
//! `HW_INITIALIZATION_DATA`, as the `VIRTUAL_HW_INITIALIZATION_DATA` page
//! recommends for drivers that run only on Windows 8 and later):
//! * it owns no hardware: the HCA belongs to its own driver, so there are no
//!   access ranges, no interrupt and no StorPort DMA adapter to claim — a
//!   physical miniport needs a PnP device node with those resources;
//! * data moves by RDMA, so scatter/gather lists come from the *HCA's* DMA
//!   adapter ([`super::dma`]), and StorPort maps every buffer
//!   (`STOR_MAP_ALL_BUFFERS_INCLUDING_READ_WRITE`);
//! * StorPort calls a virtual miniport's `HwStartIo` "at any IRQL <=
//!   DISPATCH_LEVEL" without its StartIo lock, so requests to different
//!   channels proceed in parallel — the design's one-lock-per-channel model.
//!
//! StorPort never calls `HwBuildIo` for a virtual miniport, so the StartIo
//! trampoline runs [`HwMiniport::build_io`] itself, then
//! [`HwMiniport::start_io`]. It first raises to `DISPATCH_LEVEL` (when not
//! there already), so the core always starts requests in one context, the
//! one a physical miniport's StartIo has, and the trampoline needs no IRQL
//! query to know which token to mint.
//!
//! # Contexts and tokens
//! Each trampoline mints the token its StorPort contract guarantees
//! (`Passive::assume`, `Dispatch::assume`, `Dirql::assume`), checked
//! against `KeGetCurrentIrql` in debug builds:
//!
//! | StorPort calls | at | the core's |
//! |---|---|---|
//! | `HwFindAdapter` | PASSIVE | `find_adapter` |
//! | `HwInitialize` | device IRQL | `initialize` |
//! | passive-initialisation routine | PASSIVE | `passive_initialize` |
//! | `HwStartIo` | <= DISPATCH (raised to DISPATCH) | `build_io`, `start_io` |
//! | DMA ExecutionRoutine | DISPATCH | `execution_routine` |
//! | `HwResetBus` | DISPATCH | `reset_bus` |
//! | `HwAdapterControl` query / stop, restart | PASSIVE / device IRQL | `supported_controls` / `stop_adapter`, `restart_adapter` |
//! | the StorPort DPC / timer routines | DISPATCH | `dpc` / `timer` |
//! | `HwFreeAdapterResources` | PASSIVE | `free_adapter_resources` |

use core::cell::UnsafeCell;
use core::ffi::{CStr, c_void};
use core::mem::{MaybeUninit, offset_of, size_of};
use core::ptr::{NonNull, null_mut};
use core::sync::atomic::{AtomicBool, AtomicU8, Ordering};

use kverbs::irql::{Dispatch, Passive};
use kverbs::platform::Platform;
use kverbs::platform::nt::{NtPlatform, pool};

use super::dma::deliver;
use super::ffi::{
    _INTERFACE_TYPE, _SCSI_ADAPTER_CONTROL_STATUS, _SCSI_ADAPTER_CONTROL_TYPE,
    _SCSI_NOTIFICATION_TYPE, ADDRESS_TYPE_FLAG_BTL8, BOOLEAN, DEVICE_OBJECT, DRIVER_OBJECT,
    EnablePassiveInitialization, ExtFunctionFreeTimer, ExtFunctionGetDeviceObjects,
    ExtFunctionInitializeTimer, HW_INITIALIZATION_DATA, IRP, InitializeDpc, NTSTATUS, PCHAR,
    PCUNICODE_STRING, PHW_DPC_ROUTINE, PHW_TIMER_EX, PORT_CONFIGURATION_INFORMATION,
    SCATTER_GATHER_LIST, SCSI_DMA64_MINIPORT_FULL64BIT_SUPPORTED, SCSI_REQUEST_BLOCK,
    SCSI_SUPPORTED_CONTROL_TYPE_LIST, SP_RETURN_BAD_CONFIG, SP_RETURN_ERROR, SP_RETURN_FOUND,
    SRB_STATUS_INVALID_REQUEST, SRB_TYPE_FLAG_SCSI_REQUEST_BLOCK,
    SRB_TYPE_FLAG_STORAGE_REQUEST_BLOCK, SRB_TYPE_STORAGE_REQUEST_BLOCK, STATUS_INVALID_PARAMETER,
    STOR_DPC, STOR_FEATURE_VIRTUAL_MINIPORT, STOR_MAP_ALL_BUFFERS_INCLUDING_READ_WRITE,
    STOR_STATUS_SUCCESS, STORAGE_ADDRESS_TYPE_BTL8, StorPortExtendedFunction, StorPortInitialize,
    StorPortNotification, StorSynchronizeFullDuplex, ULONG,
};
use super::params::Settings;
use super::params::registry::{self, ConfigError};
use super::port::{DpcSlots, MAX_DPCS, MAX_TIMERS, NtStorPort, PortParts, TimerSlot};
use super::srb::{ExtensionLayout, MAX_SG_ELEMENTS, NtSrb, ShimArea};
use crate::storport::{
    AdapterLimits, BuildIo, Dirql, DpcId, FindAdapterError, HwMiniport, StorPort as _, TimerId,
};

/// What a driver built on the shim supplies: the miniport it registers and
/// how to make that miniport's context from the driver's configuration.
pub trait NtDriver: 'static {
    /// The miniport StorPort drives (the core, over some transport).
    type Miniport: HwMiniport<NtStorPort> + CorePort;

    /// The context `find_adapter` gets, from the validated settings.
    ///
    /// # Errors
    /// [`FindAdapterError`] declines the adapter.
    ///
    /// # IRQL
    /// `PASSIVE_LEVEL`.
    fn context(
        settings: &Settings,
        irql: &Passive<'_>,
    ) -> Result<<Self::Miniport as HwMiniport<NtStorPort>>::Context, FindAdapterError>;
}

/// The miniport type of a driver.
type MiniportOf<D> = <D as NtDriver>::Miniport;

const SLOT_EMPTY: u8 = 0;
const SLOT_LIVE: u8 = 1;

/// The device extension StorPort allocates for each adapter: the
/// miniport value, whether it exists yet, and the StorPort objects the
/// port needs at fixed addresses.
///
/// StorPort zeroes the extension only when it first allocates it and may
/// call `HwFindAdapter` again for the same extension, hence the state.
#[repr(C)]
pub struct AdapterExtension<M> {
    state: AtomicU8,
    dpcs: DpcSlots,
    timers: [TimerSlot; MAX_TIMERS],
    adapter: UnsafeCell<MaybeUninit<M>>,
}

impl<M> AdapterExtension<M> {
    /// An empty extension (what StorPort's zeroed bytes are).
    #[must_use]
    pub const fn new() -> Self {
        AdapterExtension {
            state: AtomicU8::new(SLOT_EMPTY),
            dpcs: DpcSlots::new(),
            timers: [const { TimerSlot::new() }; MAX_TIMERS],
            adapter: UnsafeCell::new(MaybeUninit::uninit()),
        }
    }

    /// The miniport, if `find_adapter` has created it.
    #[must_use]
    pub fn get(&self) -> Option<&M> {
        if self.state.load(Ordering::Acquire) == SLOT_LIVE {
            // SAFETY: shared access to the cell: the value is replaced or
            // dropped only through `&mut self`.
            let value = unsafe { &*self.adapter.get() };
            // SAFETY: LIVE is stored (Release) only after the value is
            // written.
            Some(unsafe { value.assume_init_ref() })
        } else {
            None
        }
    }

    /// Installs a new miniport value, dropping an earlier one.
    pub fn install(&mut self, adapter: M) {
        self.clear();
        self.adapter.get_mut().write(adapter);
        self.state.store(SLOT_LIVE, Ordering::Release);
    }

    /// Drops the miniport value (`HwFreeAdapterResources`).
    pub fn clear(&mut self) {
        if *self.state.get_mut() == SLOT_LIVE {
            *self.state.get_mut() = SLOT_EMPTY;
            // SAFETY: LIVE means initialised; the state is now EMPTY so it is
            // never read or dropped again.
            unsafe { self.adapter.get_mut().assume_init_drop() };
        }
    }
}

impl<M> Default for AdapterExtension<M> {
    fn default() -> Self {
        Self::new()
    }
}

/// The request extension layout for miniport `M`.
#[must_use]
pub const fn layout_of<M: HwMiniport<NtStorPort>>() -> ExtensionLayout {
    ExtensionLayout {
        core_words: M::SRB_EXTENSION_WORDS,
    }
}

/// The device extension StorPort passed to a callback.
///
/// # Safety
/// `ext` is the device extension StorPort passed to a callback of a
/// miniport registered by [`hw_init_data::<D>`] (so it is
/// `size_of::<AdapterExtension<_>>()` bytes, zero on first use), and the
/// reference is not used beyond that callback.
unsafe fn extension<'a, D: NtDriver>(
    ext: *mut c_void,
) -> Option<&'a AdapterExtension<MiniportOf<D>>> {
    let p = ext.cast::<AdapterExtension<MiniportOf<D>>>();
    if p.is_null() || !p.is_aligned() {
        return None;
    }
    // SAFETY: non-null, aligned, StorPort's extension (caller contract).
    Some(unsafe { &*p })
}

/// The miniport of a device extension.
///
/// # Safety
/// As [`extension`].
unsafe fn miniport<'a, D: NtDriver>(ext: *mut c_void) -> Option<&'a MiniportOf<D>> {
    // SAFETY: the caller's contract.
    unsafe { extension::<D>(ext) }.and_then(AdapterExtension::get)
}

/// The service key's registry path, from `DriverEntry` (its string is only
/// valid during that call) to `HwFindAdapter`.
struct ServiceKey {
    set: AtomicBool,
    len: UnsafeCell<usize>,
    units: UnsafeCell<[u16; SERVICE_KEY_MAX]>,
}

/// Longest service key path kept (`\Registry\Machine\...\Services\name`).
const SERVICE_KEY_MAX: usize = 256;

// SAFETY: written once by DriverEntry before StorPortInitialize (so before
// any callback can read it), then only read; `set` publishes it.
unsafe impl Sync for ServiceKey {}

static SERVICE_KEY: ServiceKey = ServiceKey {
    set: AtomicBool::new(false),
    len: UnsafeCell::new(0),
    units: UnsafeCell::new([0; SERVICE_KEY_MAX]),
};

impl ServiceKey {
    /// Keeps `path` (DriverEntry only).
    ///
    /// # Safety
    /// Called once, before any reader runs.
    unsafe fn store(&self, path: &[u16]) -> bool {
        if path.len() > SERVICE_KEY_MAX || self.set.load(Ordering::Acquire) {
            return false;
        }
        // SAFETY: no reader yet (caller contract), so the cells are ours.
        let units = unsafe { &mut *self.units.get() };
        if let Some(dst) = units.get_mut(..path.len()) {
            dst.copy_from_slice(path);
        }
        // SAFETY: as above.
        unsafe { *self.len.get() = path.len() };
        self.set.store(true, Ordering::Release);
        true
    }

    /// The path, once stored.
    fn get(&self) -> Option<&[u16]> {
        if !self.set.load(Ordering::Acquire) {
            return None;
        }
        // SAFETY: written before `set` (Release/Acquire), never again.
        let units = unsafe { &*self.units.get() };
        // SAFETY: as above.
        let len = unsafe { *self.len.get() };
        units.get(..len)
    }
}

/// Completes a request with `SRB_STATUS_INVALID_REQUEST` when the shim
/// cannot take it over (the status byte is at offset 3 in both SRB forms).
///
/// # Safety
/// `raw` is null or a request StorPort gave this adapter, not completed.
unsafe fn refuse(ext: *mut c_void, raw: *mut c_void) {
    if raw.is_null() {
        return;
    }
    let status = raw.cast::<u8>().wrapping_add(3);
    // CAST: every SRB_STATUS_* fits a byte.
    // SAFETY: both SRB forms start `u16 Length, u8 Function, u8 SrbStatus`.
    unsafe { status.write(SRB_STATUS_INVALID_REQUEST as u8) };
    // SAFETY: a request of this adapter, completed once here.
    unsafe { StorPortNotification(_SCSI_NOTIFICATION_TYPE::RequestComplete, ext, raw) };
}

/// `StorPortGetDeviceObjects`: the adapter's functional device object.
///
/// # Safety
/// `ext` is this adapter's device extension; PASSIVE_LEVEL.
unsafe fn adapter_device(ext: *mut c_void) -> Option<NonNull<DEVICE_OBJECT>> {
    let mut fdo: *mut c_void = null_mut();
    let mut pdo: *mut c_void = null_mut();
    let mut lower: *mut c_void = null_mut();
    // SAFETY: the inline StorPortGetDeviceObjects: (function, extension,
    // &Adapter, &Physical, &Lower); out-parameters are locals.
    let status = unsafe {
        StorPortExtendedFunction(
            ExtFunctionGetDeviceObjects,
            ext,
            &raw mut fdo,
            &raw mut pdo,
            &raw mut lower,
        )
    };
    if status != STOR_STATUS_SUCCESS {
        return None;
    }
    NonNull::new(fdo.cast())
}

/// Frees the StorPort timers of an extension.
///
/// # Safety
/// `ext` is this adapter's device extension; <= DISPATCH_LEVEL.
unsafe fn free_timers(ext: *mut c_void, timers: &[TimerSlot]) {
    for slot in timers {
        let handle = slot.handle.swap(null_mut(), Ordering::AcqRel);
        if !handle.is_null() {
            // SAFETY: a timer this adapter initialised, freed once.
            unsafe { StorPortExtendedFunction(ExtFunctionFreeTimer, ext, handle) };
        }
    }
}

/// `HwStorFindAdapter` in its virtual form.
///
/// # Safety
/// Called by StorPort at PASSIVE_LEVEL with no lock held, with this
/// adapter's zeroed (first call) or previously used device extension and a
/// valid `ConfigInfo`.
pub unsafe extern "system" fn hw_find_adapter<D: NtDriver>(
    ext: *mut c_void,
    _hw_context: *mut c_void,
    _bus_information: *mut c_void,
    _lower_device: *mut c_void,
    argument: PCHAR,
    config: *mut PORT_CONFIGURATION_INFORMATION,
    again: *mut BOOLEAN,
) -> ULONG {
    let p = ext.cast::<AdapterExtension<MiniportOf<D>>>();
    let Some(extension_ptr) = NonNull::new(p).filter(|p| p.as_ptr().is_aligned()) else {
        return SP_RETURN_ERROR;
    };
    if config.is_null() {
        return SP_RETURN_ERROR;
    }
    if !again.is_null() {
        // SAFETY: StorPort's out-parameter.
        unsafe { again.write(0) };
    }
    // SAFETY: StorPort calls HwFindAdapter at PASSIVE_LEVEL.
    let passive = unsafe { Passive::assume::<NtPlatform>() };
    let argument = if argument.is_null() {
        None
    } else {
        // SAFETY: StorPort passes a NUL-terminated string or null.
        Some(unsafe { CStr::from_ptr(argument.cast_const()) }.to_bytes())
    };
    const {
        assert!(MiniportOf::<D>::DPC_COUNT as usize <= MAX_DPCS);
        assert!(MiniportOf::<D>::TIMER_COUNT as usize <= MAX_TIMERS);
    }
    // SAFETY: StorPort's extension, live for the adapter; FindAdapter runs
    // before any other callback for it. Only shared references are made
    // until the value is installed.
    let extension = unsafe { extension_ptr.as_ref() };
    // SAFETY: this adapter's extension at PASSIVE_LEVEL.
    let Some(device) = (unsafe { adapter_device(ext) }) else {
        return SP_RETURN_ERROR;
    };
    // SAFETY: the adapter's FDO outlives the adapter value, and with it
    // every work item and timer its kverbs objects create: StorPort deletes
    // it only after HwFreeAdapterResources, which drops them.
    let platform = unsafe { NtPlatform::new(device) };
    let dpc_routine: PHW_DPC_ROUTINE = Some(hw_dpc::<D>);
    for index in 0..usize::from(MiniportOf::<D>::DPC_COUNT) {
        let Some(dpc) = extension.dpcs.get(index) else {
            return SP_RETURN_ERROR;
        };
        // SAFETY: the inline StorPortInitializeDpc: (InitializeDpc,
        // extension, &STOR_DPC, routine); the STOR_DPC is in the extension.
        unsafe { StorPortNotification(InitializeDpc, ext, dpc, dpc_routine) };
    }
    for slot in extension
        .timers
        .iter()
        .take(usize::from(MiniportOf::<D>::TIMER_COUNT))
    {
        let mut handle: *mut c_void = null_mut();
        // SAFETY: the inline StorPortInitializeTimer: (function, extension,
        // &handle); PASSIVE_LEVEL.
        let status =
            unsafe { StorPortExtendedFunction(ExtFunctionInitializeTimer, ext, &raw mut handle) };
        if status != STOR_STATUS_SUCCESS || handle.is_null() {
            // SAFETY: this extension's timers, at PASSIVE_LEVEL.
            unsafe { free_timers(ext, &extension.timers) };
            return SP_RETURN_ERROR;
        }
        slot.handle.store(handle, Ordering::Release);
    }
    let settings = match SERVICE_KEY.get() {
        Some(service) => registry::read(service, argument, &passive),
        None => Err(ConfigError::Read(registry::ReadError::NameTooLong)),
    };
    let Ok(settings) = settings else {
        // SAFETY: as above.
        unsafe { free_timers(ext, &extension.timers) };
        return SP_RETURN_BAD_CONFIG;
    };
    let context = match D::context(&settings, &passive) {
        Ok(c) => c,
        Err(e) => {
            // SAFETY: as above.
            unsafe { free_timers(ext, &extension.timers) };
            return find_error(e);
        }
    };
    let timer_callback: PHW_TIMER_EX = Some(hw_timer::<D>);
    let field = |offset: usize| extension_ptr.cast::<u8>().as_ptr().wrapping_add(offset);
    let dpcs = field(offset_of!(AdapterExtension<MiniportOf<D>>, dpcs)).cast::<DpcSlots>();
    let timers = field(offset_of!(AdapterExtension<MiniportOf<D>>, timers))
        .cast::<[TimerSlot; MAX_TIMERS]>();
    let (Some(dpcs), Some(timers)) = (NonNull::new(dpcs), NonNull::new(timers)) else {
        return SP_RETURN_ERROR;
    };
    // SAFETY: the parts all point into this extension, initialised above;
    // the port value lives inside the same extension.
    let port = unsafe {
        NtStorPort::new(PortParts {
            extension: extension_ptr.cast(),
            platform,
            dpcs,
            dpc_count: MiniportOf::<D>::DPC_COUNT,
            timers,
            timer_count: MiniportOf::<D>::TIMER_COUNT,
            timer_callback,
            dma: None,
            layout: layout_of::<MiniportOf<D>>(),
        })
    };
    match MiniportOf::<D>::find_adapter(port, &context, argument, &passive) {
        Ok((adapter, limits)) => {
            // SAFETY: no other callback runs yet, and no reference into the
            // extension is live: this is the one exclusive access.
            unsafe { (*extension_ptr.as_ptr()).install(adapter) };
            // SAFETY: valid config (StorPort), exclusively ours here.
            configure_virtual_adapter(unsafe { &mut *config }, &limits);
            SP_RETURN_FOUND
        }
        Err(e) => {
            // SAFETY: as above.
            unsafe { free_timers(ext, &extension.timers) };
            find_error(e)
        }
    }
}

/// The `SP_RETURN_*` for a declined adapter.
fn find_error(e: FindAdapterError) -> ULONG {
    match e {
        FindAdapterError::Resources => SP_RETURN_ERROR,
        FindAdapterError::BadConfig => SP_RETURN_BAD_CONFIG,
    }
}

/// Fills the StorPort-owned configuration a virtual adapter must set.
pub fn configure_virtual_adapter(c: &mut PORT_CONFIGURATION_INFORMATION, l: &AdapterLimits) {
    c.NumberOfBuses = l.buses;
    c.MaximumNumberOfTargets = l.targets_per_bus;
    c.MaximumNumberOfLogicalUnits = l.luns_per_target;
    c.MaximumTransferLength = l.max_transfer_bytes;
    // CAST: MAX_SG_ELEMENTS is 257.
    c.NumberOfPhysicalBreaks = l.physical_breaks.min(MAX_SG_ELEMENTS as u32 - 1);
    c.MaxNumberOfIO = l.max_io;
    c.MaxIOsPerLun = l.max_io_per_lun;
    c.InitialLunQueueDepth = l.max_io_per_lun;
    c.VirtualDevice = 1;
    c.ScatterGather = 1;
    c.Master = 1;
    c.CachesData = 0;
    c.TaggedQueuing = 1;
    c.AutoRequestSense = 1;
    c.MultipleRequestPerLu = 1;
    c.MapBuffers = STOR_MAP_ALL_BUFFERS_INCLUDING_READ_WRITE;
    // CAST: SCSI_DMA64_MINIPORT_FULL64BIT_SUPPORTED is 2.
    c.Dma64BitAddresses = SCSI_DMA64_MINIPORT_FULL64BIT_SUPPORTED as u8;
    c.SynchronizationModel = StorSynchronizeFullDuplex;
    c.SrbType = SRB_TYPE_STORAGE_REQUEST_BLOCK;
    c.AddressType = STORAGE_ADDRESS_TYPE_BTL8;
}

/// `HwStorInitialize`; on success it also asks StorPort for the passive
/// initialisation callback (only allowed from here).
///
/// # Safety
/// Called by StorPort (at device IRQL per nc-storport-hw_initialize) with
/// the device extension `hw_find_adapter` filled.
pub unsafe extern "system" fn hw_initialize<D: NtDriver>(ext: *mut c_void) -> BOOLEAN {
    // SAFETY: StorPort's extension for this miniport.
    let Some(adapter) = (unsafe { miniport::<D>(ext) }) else {
        return 0;
    };
    // SAFETY: StorPort calls HwInitialize at device IRQL; the token lives
    // for this call.
    let dirql = unsafe { Dirql::assume() };
    if !adapter.initialize(&dirql) {
        return 0;
    }
    let mut enabled: i32 = 0;
    let routine: unsafe extern "system" fn(*mut c_void) -> BOOLEAN = hw_passive_initialize::<D>;
    // SAFETY: the inline StorPortEnablePassiveInitialization of storport.h:
    // (EnablePassiveInitialization, extension, routine, &LONG success).
    unsafe {
        StorPortNotification(EnablePassiveInitialization, ext, routine, &raw mut enabled);
    }
    BOOLEAN::from(enabled != 0)
}

/// `HwStorPassiveInitializeRoutine`.
///
/// # Safety
/// Called by StorPort at PASSIVE_LEVEL, no spin lock held, after
/// `hw_initialize` succeeded.
pub unsafe extern "system" fn hw_passive_initialize<D: NtDriver>(ext: *mut c_void) -> BOOLEAN {
    // SAFETY: StorPort's extension for this miniport.
    let Some(adapter) = (unsafe { miniport::<D>(ext) }) else {
        return 0;
    };
    // SAFETY: StorPort runs this routine at PASSIVE_LEVEL.
    let passive = unsafe { Passive::assume::<NtPlatform>() };
    BOOLEAN::from(adapter.passive_initialize(&passive))
}

/// `HwStorStartIo`.
///
/// # Safety
/// Called by StorPort with a request for this adapter: for a virtual
/// miniport at any IRQL <= DISPATCH_LEVEL with no StorPort lock held.
pub unsafe extern "system" fn hw_start_io<D: NtDriver>(
    ext: *mut c_void,
    raw: *mut SCSI_REQUEST_BLOCK,
) -> BOOLEAN {
    let raw: *mut c_void = raw.cast();
    // SAFETY: StorPort's extension for this miniport.
    let Some(adapter) = (unsafe { miniport::<D>(ext) }) else {
        // SAFETY: a request StorPort gave us; completed once, as refused.
        unsafe { refuse(ext, raw) };
        return 1;
    };
    // SAFETY: StorPort's request, ours until completed; its extension is
    // this miniport's layout (registration).
    let srb = unsafe { NtSrb::from_raw(raw, layout_of::<MiniportOf<D>>(), true) };
    let Ok(mut srb) = srb else {
        // SAFETY: as above.
        unsafe { refuse(ext, raw) };
        return 1;
    };
    if let Some(shim) = srb.shim() {
        let at = shim
            .as_ptr()
            .wrapping_byte_add(core::mem::offset_of!(ShimArea, device_extension));
        // SAFETY: the request's own extension area, ours until completion.
        unsafe { at.cast::<*mut c_void>().write(ext) };
    }
    // SAFETY: a virtual miniport's StartIo runs at <= DISPATCH_LEVEL; the
    // level is restored below, in LIFO order.
    let old = unsafe { NtPlatform::raise_to_dispatch() };
    {
        // SAFETY: raised to DISPATCH_LEVEL just above, until the lower.
        let dispatch = unsafe { Dispatch::assume::<NtPlatform>() };
        match adapter.build_io(&mut srb, &dispatch) {
            BuildIo::Proceed => adapter.start_io(srb, &dispatch),
            BuildIo::Complete => {
                adapter.core_port().complete_request(srb, &dispatch);
            }
        }
    }
    // SAFETY: `old` is what the raise returned.
    unsafe { NtPlatform::lower_irql(old) };
    1
}

/// The DMA adapter's ExecutionRoutine (`DRIVER_LIST_CONTROL`): the request
/// is back with its scatter/gather list.
///
/// # Safety
/// Called by the DMA adapter at DISPATCH_LEVEL for a list
/// [`super::dma::DmaPath::get`] asked for; `context` is the request, whose
/// shim area holds its device extension.
pub unsafe extern "system" fn dma_execution_routine<D: NtDriver>(
    _device: *mut DEVICE_OBJECT,
    _irp: *mut IRP,
    list: *mut SCATTER_GATHER_LIST,
    context: *mut c_void,
) {
    // SAFETY: the request `get` handed over, not completed; its shim area
    // is as `get` left it.
    let Ok(srb) = (unsafe { NtSrb::from_raw(context, layout_of::<MiniportOf<D>>(), false) }) else {
        return;
    };
    let Some(shim) = srb.shim() else { return };
    let at = shim
        .as_ptr()
        .wrapping_byte_add(core::mem::offset_of!(ShimArea, device_extension));
    // SAFETY: the request's own extension area, written by StartIo.
    let ext = unsafe { at.cast::<*mut c_void>().read() };
    // SAFETY: the extension of the adapter that asked for the list.
    let Some(adapter) = (unsafe { miniport::<D>(ext) }) else {
        return;
    };
    // SAFETY: the DMA adapter's list for this request. A list too long to
    // keep is recorded as none: the core then fails the request.
    let _ = unsafe { deliver(&srb, list) };
    // SAFETY: ExecutionRoutines run at DISPATCH_LEVEL, for this call.
    let dispatch = unsafe { Dispatch::assume::<NtPlatform>() };
    adapter.execution_routine(srb, &dispatch);
}

/// `HwStorResetBus`.
///
/// # Safety
/// Called by StorPort at DISPATCH_LEVEL.
pub unsafe extern "system" fn hw_reset_bus<D: NtDriver>(ext: *mut c_void, path: ULONG) -> BOOLEAN {
    // SAFETY: StorPort's extension for this miniport.
    let Some(adapter) = (unsafe { miniport::<D>(ext) }) else {
        return 0;
    };
    let Ok(path) = u8::try_from(path) else {
        return 0;
    };
    // SAFETY: StorPort calls HwResetBus at DISPATCH_LEVEL.
    let dispatch = unsafe { Dispatch::assume::<NtPlatform>() };
    BOOLEAN::from(adapter.reset_bus(path, &dispatch))
}

/// `HwStorAdapterControl`.
///
/// # Safety
/// Called by StorPort: `ScsiQuerySupportedControlTypes` at PASSIVE_LEVEL with
/// a `SCSI_SUPPORTED_CONTROL_TYPE_LIST` in `params`; Stop/Restart at device
/// IRQL with the interrupt lock held.
#[expect(
    non_upper_case_globals,
    reason = "matching on the WDK's enumerator names"
)]
pub unsafe extern "system" fn hw_adapter_control<D: NtDriver>(
    ext: *mut c_void,
    control: _SCSI_ADAPTER_CONTROL_TYPE::Type,
    params: *mut c_void,
) -> _SCSI_ADAPTER_CONTROL_STATUS::Type {
    use _SCSI_ADAPTER_CONTROL_STATUS::{ScsiAdapterControlSuccess, ScsiAdapterControlUnsuccessful};
    use _SCSI_ADAPTER_CONTROL_TYPE::{
        ScsiQuerySupportedControlTypes, ScsiRestartAdapter, ScsiStopAdapter,
    };
    // SAFETY: StorPort's extension for this miniport.
    let Some(adapter) = (unsafe { miniport::<D>(ext) }) else {
        return ScsiAdapterControlUnsuccessful;
    };
    let ok = match control {
        ScsiQuerySupportedControlTypes => {
            let list = params.cast::<SCSI_SUPPORTED_CONTROL_TYPE_LIST>();
            if list.is_null() {
                return ScsiAdapterControlUnsuccessful;
            }
            let supported = adapter.supported_controls();
            // SAFETY: StorPort's list (contract above).
            let max = unsafe { (*list).MaxControlType } as usize;
            let entries = list
                .wrapping_byte_add(core::mem::offset_of!(
                    SCSI_SUPPORTED_CONTROL_TYPE_LIST,
                    SupportedTypeList
                ))
                .cast::<BOOLEAN>();
            for (control, on) in [
                (ScsiQuerySupportedControlTypes, true),
                (ScsiStopAdapter, supported.stop),
                (ScsiRestartAdapter, supported.restart),
            ] {
                let i = control as usize;
                if on && i < max {
                    // SAFETY: the list has `MaxControlType` entries; only
                    // indices below it are written.
                    unsafe { entries.wrapping_add(i).write(1) };
                }
            }
            true
        }
        ScsiStopAdapter | ScsiRestartAdapter => {
            // SAFETY: StorPort calls Stop and Restart at device IRQL.
            let dirql = unsafe { Dirql::assume() };
            if control == ScsiStopAdapter {
                adapter.stop_adapter(&dirql)
            } else {
                adapter.restart_adapter(&dirql)
            }
        }
        _ => false,
    };
    if ok {
        ScsiAdapterControlSuccess
    } else {
        ScsiAdapterControlUnsuccessful
    }
}

/// The miniport's StorPort DPC routine (`HW_DPC_ROUTINE`).
///
/// # Safety
/// Called by StorPort at DISPATCH_LEVEL for a DPC `hw_find_adapter`
/// initialised; `argument1` is the index `NtStorPort::issue_dpc` passed.
pub unsafe extern "system" fn hw_dpc<D: NtDriver>(
    _dpc: *mut STOR_DPC,
    ext: *mut c_void,
    argument1: *mut c_void,
    _argument2: *mut c_void,
) {
    // SAFETY: StorPort's extension for this miniport.
    let Some(adapter) = (unsafe { miniport::<D>(ext) }) else {
        return;
    };
    let Ok(index) = u8::try_from(argument1 as usize) else {
        return;
    };
    if index >= MiniportOf::<D>::DPC_COUNT {
        return;
    }
    // SAFETY: StorPort runs DPC routines at DISPATCH_LEVEL.
    let dispatch = unsafe { Dispatch::assume::<NtPlatform>() };
    adapter.dpc(DpcId(index), &dispatch);
}

/// The miniport's StorPort timer routine (`HW_TIMER_EX`).
///
/// # Safety
/// Called by StorPort at DISPATCH_LEVEL for a timer `hw_find_adapter`
/// initialised; `context` is the index `NtStorPort::request_timer` passed.
pub unsafe extern "system" fn hw_timer<D: NtDriver>(ext: *mut c_void, context: *mut c_void) {
    // SAFETY: StorPort's extension for this miniport.
    let Some(extension) = (unsafe { extension::<D>(ext) }) else {
        return;
    };
    let Some(adapter) = extension.get() else {
        return;
    };
    let Ok(index) = u8::try_from(context as usize) else {
        return;
    };
    if index >= MiniportOf::<D>::TIMER_COUNT {
        return;
    }
    if let Some(slot) = extension.timers.get(usize::from(index)) {
        slot.armed.store(false, Ordering::Release);
    }
    // SAFETY: StorPort runs timer routines at DISPATCH_LEVEL.
    let dispatch = unsafe { Dispatch::assume::<NtPlatform>() };
    adapter.timer(TimerId(index), &dispatch);
}

/// `HwStorFreeAdapterResources`: the miniport releases everything, the
/// timers are freed, queued DPCs are flushed, and the value is dropped.
///
/// # Safety
/// Called by StorPort at PASSIVE_LEVEL once the adapter is stopped and no
/// other callback for it runs.
pub unsafe extern "system" fn hw_free_adapter_resources<D: NtDriver>(ext: *mut c_void) {
    let p = ext.cast::<AdapterExtension<MiniportOf<D>>>();
    if p.is_null() || !p.is_aligned() {
        return;
    }
    // SAFETY: StorPort's extension; no concurrent callback (contract).
    let extension = unsafe { &mut *p };
    // SAFETY: StorPort calls this at PASSIVE_LEVEL.
    let passive = unsafe { Passive::assume::<NtPlatform>() };
    if let Some(adapter) = extension.get() {
        adapter.free_adapter_resources(&passive);
        adapter.core_port().platform().flush_dpcs(&passive);
    }
    // SAFETY: this extension's timers, at PASSIVE_LEVEL.
    unsafe { free_timers(ext, &extension.timers) };
    extension.clear();
}

/// Access to the port a miniport was found on, for the trampolines.
pub trait CorePort {
    /// The port.
    fn core_port(&self) -> &NtStorPort;
}

impl<T: crate::miniport::transport::Transport> CorePort
    for crate::miniport::Adapter<NtStorPort, T>
{
    fn core_port(&self) -> &NtStorPort {
        self.core().port()
    }
}

/// The registration for a virtual miniport running `D`.
#[must_use]
pub fn hw_init_data<D: NtDriver>() -> HW_INITIALIZATION_DATA {
    // SAFETY: all-zero is a valid HW_INITIALIZATION_DATA (integers, raw
    // pointers and `Option<fn>`), and the page requires it zeroed first.
    let mut d: HW_INITIALIZATION_DATA = unsafe { core::mem::zeroed() };
    let find: unsafe extern "system" fn(
        *mut c_void,
        *mut c_void,
        *mut c_void,
        *mut c_void,
        PCHAR,
        *mut PORT_CONFIGURATION_INFORMATION,
        *mut BOOLEAN,
    ) -> ULONG = hw_find_adapter::<D>;
    // CAST: 208 bytes.
    d.HwInitializationDataSize = size_of::<HW_INITIALIZATION_DATA>() as ULONG;
    d.AdapterInterfaceType = _INTERFACE_TYPE::Internal;
    d.HwInitialize = Some(hw_initialize::<D>);
    d.HwStartIo = Some(hw_start_io::<D>);
    d.HwFindAdapter = find as *mut c_void;
    d.HwResetBus = Some(hw_reset_bus::<D>);
    d.HwAdapterControl = Some(hw_adapter_control::<D>);
    d.HwFreeAdapterResources = Some(hw_free_adapter_resources::<D>);
    // CAST: the extension and the request extension are a few KiB.
    d.DeviceExtensionSize = size_of::<AdapterExtension<MiniportOf<D>>>() as ULONG;
    d.SrbExtensionSize = layout_of::<MiniportOf<D>>().size() as ULONG;
    d.MapBuffers = STOR_MAP_ALL_BUFFERS_INCLUDING_READ_WRITE;
    d.TaggedQueuing = 1;
    d.AutoRequestSense = 1;
    d.MultipleRequestPerLu = 1;
    d.FeatureSupport = STOR_FEATURE_VIRTUAL_MINIPORT;
    d.SrbTypeFlags = SRB_TYPE_FLAG_SCSI_REQUEST_BLOCK | SRB_TYPE_FLAG_STORAGE_REQUEST_BLOCK;
    d.AddressTypeFlags = ADDRESS_TYPE_FLAG_BTL8;
    d
}

/// The body of `DriverEntry`: keeps the service key for `HwFindAdapter`,
/// resolves the pool routines, and registers `D` with StorPort.
///
/// # Safety
/// Called once, from the driver's `DriverEntry`, with the arguments the I/O
/// manager passed it.
///
/// # IRQL
/// PASSIVE_LEVEL.
pub unsafe fn driver_entry<D: NtDriver>(
    driver: *mut DRIVER_OBJECT,
    registry_path: PCUNICODE_STRING,
) -> NTSTATUS {
    // SAFETY: the I/O manager calls DriverEntry at PASSIVE_LEVEL.
    let passive = unsafe { Passive::assume::<NtPlatform>() };
    pool::resolve_pool_routines(&passive);
    if registry_path.is_null() {
        return STATUS_INVALID_PARAMETER;
    }
    // SAFETY: the I/O manager's counted string, valid during DriverEntry.
    let path = unsafe { &*registry_path };
    let (buffer, bytes) = (path.Buffer, path.Length);
    if buffer.is_null() {
        return STATUS_INVALID_PARAMETER;
    }
    // SAFETY: `Length` bytes of UTF-16 at `Buffer` (the string's contract).
    let units = unsafe { core::slice::from_raw_parts(buffer, usize::from(bytes) / 2) };
    // SAFETY: DriverEntry runs once, before any callback reads the key.
    if !unsafe { SERVICE_KEY.store(units) } {
        return STATUS_INVALID_PARAMETER;
    }
    let mut data = hw_init_data::<D>();
    // SAFETY: StorPortInitialize(DriverObject, RegistryPath, &init, context)
    // with the pointers the I/O manager gave DriverEntry.
    let status = unsafe {
        StorPortInitialize(
            driver.cast(),
            registry_path.cast_mut().cast(),
            &raw mut data,
            null_mut(),
        )
    };
    // CAST: StorPortInitialize returns an NTSTATUS in a ULONG.
    status as NTSTATUS
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::miniport::{ADAPTER_CONTROL_DPC, Adapter};
    use crate::nt::no_hca::NoHca;

    type Core = Adapter<NtStorPort, NoHca<NtPlatform>>;

    /// The registration itself (which names every trampoline, so it can
    /// only be linked into a kernel image) is checked by the kv-sys Wine
    /// smoke run; here, what it is computed from.
    #[test]
    fn the_request_extension_holds_the_core_words_and_the_shim_area() {
        let layout = layout_of::<Core>();
        assert_eq!(
            layout.core_words,
            <Core as HwMiniport<NtStorPort>>::SRB_EXTENSION_WORDS
        );
        assert_eq!(layout.size(), 8 * layout.core_words + size_of::<ShimArea>());
        assert!(usize::from(ADAPTER_CONTROL_DPC.0) < MAX_DPCS);
        assert!(usize::from(<Core as HwMiniport<NtStorPort>>::DPC_COUNT) <= MAX_DPCS);
        assert!(usize::from(<Core as HwMiniport<NtStorPort>>::TIMER_COUNT) <= MAX_TIMERS);
    }

    #[test]
    fn the_adapter_configuration_is_virtual_and_clamped() {
        // SAFETY: all-zero is a valid configuration.
        let mut c: PORT_CONFIGURATION_INFORMATION = unsafe { core::mem::zeroed() };
        let limits = AdapterLimits {
            buses: 1,
            targets_per_bus: 2,
            luns_per_target: 8,
            max_transfer_bytes: 1 << 20,
            physical_breaks: 4096,
            max_io: 128,
            max_io_per_lun: 64,
        };
        configure_virtual_adapter(&mut c, &limits);
        assert_eq!(
            (c.VirtualDevice, c.NumberOfBuses, c.MaximumNumberOfTargets),
            (1, 1, 2)
        );
        assert_eq!(c.NumberOfPhysicalBreaks, MAX_SG_ELEMENTS as u32 - 1);
        assert_eq!((c.MaxNumberOfIO, c.MaxIOsPerLun), (128, 64));
        assert_eq!(c.SrbType, SRB_TYPE_STORAGE_REQUEST_BLOCK);
    }

    #[test]
    fn the_extension_slot_installs_and_drops_once() {
        struct Counted<'a>(&'a core::cell::Cell<u32>);
        impl Drop for Counted<'_> {
            fn drop(&mut self) {
                self.0.set(self.0.get() + 1);
            }
        }
        let drops = core::cell::Cell::new(0);
        let mut slot: AdapterExtension<Counted<'_>> = AdapterExtension::new();
        assert!(slot.get().is_none());
        slot.install(Counted(&drops));
        assert!(slot.get().is_some());
        slot.install(Counted(&drops));
        assert_eq!(drops.get(), 1, "a second FindAdapter drops the first value");
        slot.clear();
        slot.clear();
        assert_eq!(drops.get(), 2);
        assert!(slot.get().is_none());
    }

    #[test]
    fn the_service_key_is_kept_once() {
        let key = ServiceKey {
            set: AtomicBool::new(false),
            len: UnsafeCell::new(0),
            units: UnsafeCell::new([0; SERVICE_KEY_MAX]),
        };
        assert_eq!(key.get(), None);
        let long = [b'x'.into(); SERVICE_KEY_MAX + 1];
        // SAFETY: no reader runs concurrently in this test.
        assert!(!unsafe { key.store(&long) });
        let path: Vec<u16> = "\\Registry\\Machine\\kvsrp".encode_utf16().collect();
        // SAFETY: as above.
        assert!(unsafe { key.store(&path) });
        assert_eq!(key.get(), Some(&path[..]));
        // SAFETY: as above.
        assert!(!unsafe { key.store(&path) }, "stored once");
    }
}
