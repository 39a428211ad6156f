//! The callbacks the miniport core implements ([`Miniport`]), the
//! `extern "system"` trampolines StorPort calls, and the registration
//! `DriverEntry` performs.
//!
//! # Virtual, not physical
//! The adapter registers as a StorPort **virtual** miniport
//! (`STOR_FEATURE_VIRTUAL_MINIPORT` in the Windows 8+
//! `HW_INITIALIZATION_DATA`, as the `VIRTUAL_HW_INITIALIZATION_DATA` page
//! recommends for drivers that run only on Windows 8 and later):
//! * it owns no hardware: the HCA belongs to its own driver, so there are no
//!   access ranges, no interrupt and no StorPort DMA adapter to claim — a
//!   physical miniport needs a PnP device node with those resources;
//! * data moves by RDMA, so scatter/gather lists must come from the *HCA's*
//!   DMA adapter (`GetScatterGatherList` with its ExecutionRoutine at
//!   DISPATCH_LEVEL, the context the design posts from), not from StorPort,
//!   which "does not perform DMA" for virtual miniports and maps every buffer
//!   (`STOR_MAP_ALL_BUFFERS_INCLUDING_READ_WRITE`);
//! * StorPort calls a virtual miniport's `HwStartIo` "at any IRQL <=
//!   DISPATCH_LEVEL" without its StartIo lock, so requests to different
//!   channels proceed in parallel — the design's one-lock-per-channel model.
//!
//! StorPort never calls `HwBuildIo` for a virtual miniport (the field "should
//! be set to NULL by virtual miniports"), so the StartIo trampoline runs
//! [`Miniport::build_io`] itself before [`Miniport::start_io`]; the
//! [`hw_build_io`] trampoline exists for a physical registration.

use super::ffi::{
    _INTERFACE_TYPE, _SCSI_ADAPTER_CONTROL_STATUS, _SCSI_ADAPTER_CONTROL_TYPE,
    _SCSI_NOTIFICATION_TYPE, ADDRESS_TYPE_FLAG_BTL8, BOOLEAN, DRIVER_OBJECT,
    EnablePassiveInitialization, HW_INITIALIZATION_DATA, NTSTATUS, PCHAR, PCUNICODE_STRING,
    PORT_CONFIGURATION_INFORMATION, PVOID, SCSI_DMA64_MINIPORT_FULL64BIT_SUPPORTED,
    SCSI_REQUEST_BLOCK, SCSI_SUPPORTED_CONTROL_TYPE_LIST, SP_RETURN_ERROR, SP_RETURN_FOUND,
    SRB_STATUS_INVALID_REQUEST, SRB_TYPE_FLAG_SCSI_REQUEST_BLOCK,
    SRB_TYPE_FLAG_STORAGE_REQUEST_BLOCK, SRB_TYPE_STORAGE_REQUEST_BLOCK,
    STOR_FEATURE_VIRTUAL_MINIPORT, STOR_MAP_ALL_BUFFERS_INCLUDING_READ_WRITE,
    STORAGE_ADDRESS_TYPE_BTL8, StorPortInitialize, StorPortNotification, StorSynchronizeFullDuplex,
    ULONG,
};
use super::srb::Srb;
use core::cell::UnsafeCell;
use core::ffi::CStr;
use core::mem::{MaybeUninit, size_of};
use core::sync::atomic::{AtomicU8, Ordering};

// The vocabulary the core's `HwMiniport` trait shares with this shim.
pub use crate::storport::{AdapterLimits, BuildIo, FindAdapterError};

/// What `start_io` did with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartIo {
    /// Finished now, status set: the trampoline completes it to StorPort.
    Complete,
    /// Accepted; the core completes it later (from its completion DPC).
    Pending,
}

/// What `find_adapter` is given.
pub struct FindAdapterArgs<'a> {
    /// StorPort's `ArgumentString`: the `DriverParameter` registry value
    /// (untrusted: the core must parse it as such), if present.
    pub argument: Option<&'a CStr>,
}

/// The callbacks the miniport core implements. The trampolines below call
/// these in StorPort's contexts; the method docs restate each context.
///
/// The adapter value lives in StorPort's per-adapter device extension and
/// is shared by concurrent callbacks (a virtual miniport's StartIo runs on
/// many CPUs at once with no StorPort lock), so methods take `&self` and the
/// type must be `Sync`.
pub trait Miniport: Sized + Sync {
    /// Bytes of per-request scratch (`SrbExtensionSize`).
    const SRB_EXTENSION_SIZE: u32 = 0;

    /// Creates the adapter and states its limits.
    ///
    /// # IRQL
    /// PASSIVE_LEVEL, no StorPort lock held (nc-storport-hw_find_adapter).
    ///
    /// # Errors
    /// [`FindAdapterError`] declines the adapter.
    fn find_adapter(args: &FindAdapterArgs<'_>) -> Result<(Self, AdapterLimits), FindAdapterError>;

    /// Brings the adapter up; defer real work to [`Self::passive_initialize`].
    ///
    /// # IRQL
    /// DIRQL per nc-storport-hw_initialize: must not block or allocate.
    fn initialize(&self) -> bool {
        true
    }

    /// Initialisation that needs PASSIVE_LEVEL (creating queues, starting
    /// the worker, first logins).
    ///
    /// # IRQL
    /// PASSIVE_LEVEL, no spin lock held (nc-storport-hw_passive_initialize_routine).
    fn passive_initialize(&self) -> bool {
        true
    }

    /// Unsynchronised preparation of a request (build the SRP/iSER IU).
    ///
    /// # IRQL
    /// DISPATCH_LEVEL, no spin lock held; may run on several CPUs at once.
    fn build_io(&self, _srb: &mut Srb<'_>) -> BuildIo {
        BuildIo::Proceed
    }

    /// Starts a request.
    ///
    /// # IRQL
    /// Virtual miniport: any IRQL <= DISPATCH_LEVEL, no StorPort lock held.
    fn start_io(&self, srb: &mut Srb<'_>) -> StartIo;

    /// Resets a bus: every outstanding request on it must be completed.
    ///
    /// # IRQL
    /// DISPATCH_LEVEL under the StartIo lock (nc-storport-hw_reset_bus).
    fn reset_bus(&self, path: u32) -> bool;

    /// `ScsiStopAdapter`: quiesce. Must not block (teardown is queued to the
    /// passive worker).
    ///
    /// # IRQL
    /// DIRQL with the interrupt lock held, as documented for physical
    /// miniports (prior-art §4.5).
    fn stop_adapter(&self) -> bool {
        true
    }

    /// `ScsiRestartAdapter`: resume after a stop.
    ///
    /// # IRQL
    /// As [`Self::stop_adapter`].
    fn restart_adapter(&self) -> bool {
        true
    }
}

const SLOT_EMPTY: u8 = 0;
const SLOT_LIVE: u8 = 1;

/// The device extension: the adapter value plus whether it is initialised
/// (StorPort zeroes the extension only when it first allocates it, and may
/// call `HwFindAdapter` again for the same extension).
pub struct AdapterSlot<M> {
    state: AtomicU8,
    value: UnsafeCell<MaybeUninit<M>>,
}

impl<M: Miniport> AdapterSlot<M> {
    /// A slot as StorPort hands it over: all zero = empty.
    #[must_use]
    pub const fn empty() -> Self {
        Self {
            state: AtomicU8::new(SLOT_EMPTY),
            value: UnsafeCell::new(MaybeUninit::uninit()),
        }
    }

    /// The adapter, if `find_adapter` has created it.
    #[must_use]
    pub fn get(&self) -> Option<&M> {
        if self.state.load(Ordering::Acquire) == SLOT_LIVE {
            // SAFETY: LIVE is stored (Release) only after the value is
            // written, and the value is dropped only through `&mut self`.
            Some(unsafe { (*self.value.get()).assume_init_ref() })
        } else {
            None
        }
    }

    /// Installs a new adapter value, dropping an earlier one.
    pub fn install(&mut self, adapter: M) {
        self.clear();
        self.value.get_mut().write(adapter);
        self.state.store(SLOT_LIVE, Ordering::Release);
    }

    /// Drops the adapter value (`HwFreeAdapterResources`).
    pub fn clear(&mut self) {
        if *self.state.get_mut() == SLOT_LIVE {
            *self.state.get_mut() = SLOT_EMPTY;
            // SAFETY: LIVE means initialised; the state is now EMPTY so it is
            // never read or dropped again.
            unsafe { self.value.get_mut().assume_init_drop() };
        }
    }
}

/// The per-adapter extension StorPort allocates for `M`.
///
/// # Safety
/// `ext` is the device extension StorPort passed to a callback of a miniport
/// registered by [`hw_init_data::<M>`] (so it is `size_of::<AdapterSlot<M>>()`
/// zero-initialised bytes on first use), and the returned reference is not
/// used beyond that callback.
unsafe fn slot<'a, M: Miniport>(ext: PVOID) -> Option<&'a AdapterSlot<M>> {
    let p = ext.cast::<AdapterSlot<M>>();
    if p.is_null() || !p.is_aligned() {
        return None;
    }
    // SAFETY: non-null, aligned, StorPort's extension (caller contract).
    Some(unsafe { &*p })
}

/// Completes a request to StorPort (`StorPortNotification(RequestComplete)`).
///
/// # Safety
/// `ext` is this adapter's device extension and `srb` a request StorPort
/// gave this adapter that has not been completed yet.
///
/// # IRQL
/// <= DISPATCH_LEVEL.
pub unsafe fn complete_request(ext: PVOID, srb: PVOID) {
    // SAFETY: RequestComplete takes (extension, srb); the caller guarantees
    // both, and that this request is completed once.
    unsafe {
        StorPortNotification(_SCSI_NOTIFICATION_TYPE::RequestComplete, ext, srb);
    }
}

/// `HwStorFindAdapter` in its virtual form.
///
/// # Safety
/// Called by StorPort at PASSIVE_LEVEL with no lock held, with this
/// adapter's zeroed (first call) or previously used device extension and a
/// valid `ConfigInfo`.
pub unsafe extern "system" fn hw_find_adapter<M: Miniport>(
    ext: PVOID,
    _hw_context: PVOID,
    _bus_information: PVOID,
    _lower_device: PVOID,
    argument: PCHAR,
    config: *mut PORT_CONFIGURATION_INFORMATION,
    again: *mut BOOLEAN,
) -> ULONG {
    let p = ext.cast::<AdapterSlot<M>>();
    if p.is_null() || !p.is_aligned() || config.is_null() {
        return SP_RETURN_ERROR as ULONG;
    }
    if !again.is_null() {
        // SAFETY: StorPort's out-parameter.
        unsafe { *again = 0 };
    }
    let argument = if argument.is_null() {
        None
    } else {
        // SAFETY: StorPort passes a NUL-terminated string or null.
        Some(unsafe { CStr::from_ptr(argument.cast_const()) })
    };
    match M::find_adapter(&FindAdapterArgs { argument }) {
        Ok((adapter, limits)) => {
            // SAFETY: aligned, StorPort's extension; FindAdapter runs before
            // any other callback for this extension, so access is exclusive.
            unsafe { (*p).install(adapter) };
            // SAFETY: valid config (StorPort), exclusively ours here.
            configure_virtual_adapter(unsafe { &mut *config }, &limits);
            SP_RETURN_FOUND as ULONG
        }
        Err(FindAdapterError::Resources) => SP_RETURN_ERROR as ULONG,
        Err(FindAdapterError::BadConfig) => 3, // SP_RETURN_BAD_CONFIG
    }
}

/// Fills the StorPort-owned configuration a virtual adapter must set.
pub fn configure_virtual_adapter(c: &mut PORT_CONFIGURATION_INFORMATION, l: &AdapterLimits) {
    c.NumberOfBuses = l.buses;
    c.MaximumNumberOfTargets = l.targets_per_bus;
    c.MaximumNumberOfLogicalUnits = l.luns_per_target;
    c.MaximumTransferLength = l.max_transfer_bytes;
    c.NumberOfPhysicalBreaks = l.physical_breaks;
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
    c.MapBuffers = STOR_MAP_ALL_BUFFERS_INCLUDING_READ_WRITE as _;
    c.Dma64BitAddresses = SCSI_DMA64_MINIPORT_FULL64BIT_SUPPORTED as _;
    c.SynchronizationModel = StorSynchronizeFullDuplex as _;
    c.SrbType = SRB_TYPE_STORAGE_REQUEST_BLOCK as _;
    c.AddressType = STORAGE_ADDRESS_TYPE_BTL8 as _;
}

/// `HwStorInitialize`; on success it also asks StorPort for the passive
/// initialisation callback (only allowed from here).
///
/// # Safety
/// Called by StorPort (at DIRQL per nc-storport-hw_initialize) with the
/// device extension `hw_find_adapter` filled.
pub unsafe extern "system" fn hw_initialize<M: Miniport>(ext: PVOID) -> BOOLEAN {
    // SAFETY: StorPort's extension for this miniport.
    let Some(adapter) = (unsafe { slot::<M>(ext) }).and_then(AdapterSlot::get) else {
        return 0;
    };
    if !adapter.initialize() {
        return 0;
    }
    let mut enabled: i32 = 0;
    let routine: unsafe extern "system" fn(PVOID) -> BOOLEAN = hw_passive_initialize::<M>;
    // SAFETY: the inline StorPortEnablePassiveInitialization of storport.h:
    // (EnablePassiveInitialization, extension, routine, &LONG success).
    unsafe {
        StorPortNotification(
            EnablePassiveInitialization,
            ext,
            routine as PVOID,
            &raw mut enabled,
        );
    }
    BOOLEAN::from(enabled != 0)
}

/// `HwStorPassiveInitializeRoutine`.
///
/// # Safety
/// Called by StorPort at PASSIVE_LEVEL, no spin lock held, after
/// `hw_initialize` succeeded.
pub unsafe extern "system" fn hw_passive_initialize<M: Miniport>(ext: PVOID) -> BOOLEAN {
    // SAFETY: StorPort's extension for this miniport.
    match (unsafe { slot::<M>(ext) }).and_then(AdapterSlot::get) {
        Some(adapter) => BOOLEAN::from(adapter.passive_initialize()),
        None => 0,
    }
}

/// `HwStorBuildIo` (physical registrations only; see the module docs).
///
/// # Safety
/// Called by StorPort at DISPATCH_LEVEL with no spin lock held, with a
/// request for this adapter.
pub unsafe extern "system" fn hw_build_io<M: Miniport>(ext: PVOID, raw: PVOID) -> BOOLEAN {
    // SAFETY: StorPort's extension for this miniport.
    let Some(adapter) = (unsafe { slot::<M>(ext) }).and_then(AdapterSlot::get) else {
        return 0;
    };
    // SAFETY: StorPort's request, ours for this callback.
    match unsafe { Srb::from_raw(raw) } {
        Ok(mut srb) => match adapter.build_io(&mut srb) {
            BuildIo::Proceed => 1,
            BuildIo::Complete => {
                // SAFETY: not yet completed; completed once here.
                unsafe { complete_request(ext, raw) };
                0
            }
        },
        Err(_) => {
            // SAFETY: `raw` is non-null when `from_raw` fails otherwise.
            unsafe { refuse(ext, raw) };
            0
        }
    }
}

/// `HwStorStartIo`.
///
/// # Safety
/// Called by StorPort with a request for this adapter: for a virtual
/// miniport at any IRQL <= DISPATCH_LEVEL with no StorPort lock held.
pub unsafe extern "system" fn hw_start_io<M: Miniport>(
    ext: PVOID,
    raw: *mut SCSI_REQUEST_BLOCK,
) -> BOOLEAN {
    let raw: PVOID = raw.cast();
    // SAFETY: StorPort's extension for this miniport.
    let Some(adapter) = (unsafe { slot::<M>(ext) }).and_then(AdapterSlot::get) else {
        // SAFETY: a request StorPort gave us; complete it as refused.
        unsafe { refuse(ext, raw) };
        return 1;
    };
    // SAFETY: StorPort's request, ours for this callback.
    let mut srb = match unsafe { Srb::from_raw(raw) } {
        Ok(srb) => srb,
        Err(_) => {
            // SAFETY: as above.
            unsafe { refuse(ext, raw) };
            return 1;
        }
    };
    let done = match adapter.build_io(&mut srb) {
        BuildIo::Complete => true,
        BuildIo::Proceed => adapter.start_io(&mut srb) == StartIo::Complete,
    };
    if done {
        // SAFETY: not yet completed; completed once here.
        unsafe { complete_request(ext, raw) };
    }
    1
}

/// Completes a request the shim cannot parse with
/// `SRB_STATUS_INVALID_REQUEST` (the status byte is at offset 3 in both SRB
/// forms).
///
/// # Safety
/// `raw` is null or a request StorPort gave this adapter, not completed.
unsafe fn refuse(ext: PVOID, raw: PVOID) {
    if raw.is_null() {
        return;
    }
    // SAFETY: both SRB forms start `u16 Length, u8 Function, u8 SrbStatus`.
    unsafe {
        raw.cast::<u8>()
            .add(3)
            .write(SRB_STATUS_INVALID_REQUEST as u8)
    };
    // SAFETY: caller contract.
    unsafe { complete_request(ext, raw) };
}

/// `HwStorResetBus`.
///
/// # Safety
/// Called by StorPort at DISPATCH_LEVEL holding the StartIo lock.
pub unsafe extern "system" fn hw_reset_bus<M: Miniport>(ext: PVOID, path: ULONG) -> BOOLEAN {
    // SAFETY: StorPort's extension for this miniport.
    match (unsafe { slot::<M>(ext) }).and_then(AdapterSlot::get) {
        Some(adapter) => BOOLEAN::from(adapter.reset_bus(path)),
        None => 0,
    }
}

/// `HwStorAdapterControl`.
///
/// # Safety
/// Called by StorPort: `ScsiQuerySupportedControlTypes` at PASSIVE_LEVEL with
/// a `SCSI_SUPPORTED_CONTROL_TYPE_LIST` in `params`; Stop/Restart at DIRQL
/// with the interrupt lock held.
#[allow(
    non_upper_case_globals,
    reason = "matching on the WDK's enumerator names"
)]
pub unsafe extern "system" fn hw_adapter_control<M: Miniport>(
    ext: PVOID,
    control: _SCSI_ADAPTER_CONTROL_TYPE::Type,
    params: PVOID,
) -> _SCSI_ADAPTER_CONTROL_STATUS::Type {
    use _SCSI_ADAPTER_CONTROL_STATUS::{ScsiAdapterControlSuccess, ScsiAdapterControlUnsuccessful};
    use _SCSI_ADAPTER_CONTROL_TYPE::{
        ScsiQuerySupportedControlTypes, ScsiRestartAdapter, ScsiStopAdapter,
    };
    // SAFETY: StorPort's extension for this miniport.
    let adapter = (unsafe { slot::<M>(ext) }).and_then(AdapterSlot::get);
    let ok = match control {
        ScsiQuerySupportedControlTypes => {
            let list = params.cast::<SCSI_SUPPORTED_CONTROL_TYPE_LIST>();
            if list.is_null() {
                return ScsiAdapterControlUnsuccessful;
            }
            // SAFETY: StorPort passes a list whose `SupportedTypeList` has
            // `MaxControlType` entries; only indices below it are written.
            unsafe {
                let max = (*list).MaxControlType as usize;
                let entries = core::ptr::addr_of_mut!((*list).SupportedTypeList).cast::<BOOLEAN>();
                for supported in [
                    ScsiQuerySupportedControlTypes,
                    ScsiStopAdapter,
                    ScsiRestartAdapter,
                ] {
                    let i = supported as usize;
                    if i < max {
                        entries.add(i).write(1);
                    }
                }
            }
            true
        }
        ScsiStopAdapter => adapter.is_some_and(Miniport::stop_adapter),
        ScsiRestartAdapter => adapter.is_some_and(Miniport::restart_adapter),
        _ => false,
    };
    if ok {
        ScsiAdapterControlSuccess
    } else {
        ScsiAdapterControlUnsuccessful
    }
}

/// `HwStorFreeAdapterResources`: drops the adapter value.
///
/// # Safety
/// Called by StorPort once the adapter is stopped and no other callback for
/// it runs.
pub unsafe extern "system" fn hw_free_adapter_resources<M: Miniport>(ext: PVOID) {
    let p = ext.cast::<AdapterSlot<M>>();
    if !p.is_null() && p.is_aligned() {
        // SAFETY: StorPort's extension; no concurrent callback (contract).
        unsafe { (*p).clear() };
    }
}

/// The registration for a virtual miniport running `M`.
#[must_use]
pub fn hw_init_data<M: Miniport>() -> HW_INITIALIZATION_DATA {
    // SAFETY: all-zero is a valid HW_INITIALIZATION_DATA (integers, raw
    // pointers and `Option<fn>`), and the page requires it zeroed first.
    let mut d: HW_INITIALIZATION_DATA = unsafe { core::mem::zeroed() };
    let find: unsafe extern "system" fn(
        PVOID,
        PVOID,
        PVOID,
        PVOID,
        PCHAR,
        *mut PORT_CONFIGURATION_INFORMATION,
        *mut BOOLEAN,
    ) -> ULONG = hw_find_adapter::<M>;
    d.HwInitializationDataSize = size_of::<HW_INITIALIZATION_DATA>() as ULONG;
    d.AdapterInterfaceType = _INTERFACE_TYPE::Internal;
    d.HwInitialize = Some(hw_initialize::<M>);
    d.HwStartIo = Some(hw_start_io::<M>);
    d.HwFindAdapter = find as PVOID;
    d.HwResetBus = Some(hw_reset_bus::<M>);
    d.HwAdapterControl = Some(hw_adapter_control::<M>);
    d.HwFreeAdapterResources = Some(hw_free_adapter_resources::<M>);
    d.DeviceExtensionSize = size_of::<AdapterSlot<M>>() as ULONG;
    d.SrbExtensionSize = M::SRB_EXTENSION_SIZE;
    d.MapBuffers = STOR_MAP_ALL_BUFFERS_INCLUDING_READ_WRITE as _;
    d.TaggedQueuing = 1;
    d.AutoRequestSense = 1;
    d.MultipleRequestPerLu = 1;
    d.FeatureSupport = STOR_FEATURE_VIRTUAL_MINIPORT as ULONG;
    d.SrbTypeFlags =
        (SRB_TYPE_FLAG_SCSI_REQUEST_BLOCK | SRB_TYPE_FLAG_STORAGE_REQUEST_BLOCK) as ULONG;
    d.AddressTypeFlags = ADDRESS_TYPE_FLAG_BTL8 as ULONG;
    d
}

/// The body of `DriverEntry`: registers `M` with StorPort.
///
/// # Safety
/// Called once, from the driver's `DriverEntry`, with the arguments the I/O
/// manager passed it.
///
/// # IRQL
/// PASSIVE_LEVEL.
pub unsafe fn driver_entry<M: Miniport>(
    driver: *mut DRIVER_OBJECT,
    registry_path: PCUNICODE_STRING,
) -> NTSTATUS {
    super::alloc::resolve_pool_routines();
    let mut data = hw_init_data::<M>();
    // SAFETY: StorPortInitialize(DriverObject, RegistryPath, &init, context)
    // with the pointers the I/O manager gave DriverEntry.
    let status = unsafe {
        StorPortInitialize(
            driver.cast(),
            registry_path.cast_mut().cast(),
            (&raw mut data).cast(),
            core::ptr::null_mut(),
        )
    };
    status as NTSTATUS
}
