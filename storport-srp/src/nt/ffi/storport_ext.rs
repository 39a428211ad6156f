//! What mingw-w64's 2003-era `storport.h` lacks, declared by hand from
//! Microsoft's documentation (the `MicrosoftDocs/windows-driver-docs-ddi`
//! pages named next to each item).
//!
//! The pages give syntax blocks (field order and C types) but no `sizeof`.
//! Every expected size and offset below is derived from the page's field list
//! under the x64 C layout rules (natural alignment, `POINTER_ALIGN` = 8) and
//! pinned with a `const` assertion, so a transcription slip fails the build.
//! None of them could be cross-checked against a real WDK here; the Windows
//! CI workflow builds the same shim against `wdk-sys`, whose layout tests are
//! generated from the real headers.

#![allow(
    missing_docs,
    reason = "struct fields carry Microsoft's names; the page cited on each struct documents them"
)]

use super::mingw::{
    _SCSI_NOTIFICATION_TYPE, ACCESS_RANGE, PHW_ADAPTER_CONTROL, PHW_ADAPTER_STATE, PHW_DMA_STARTED,
    PHW_INITIALIZE, PHW_INTERRUPT, PHW_RESET_BUS, PHW_STARTIO,
};
use core::mem::{offset_of, size_of};
use nt_sys::ctypes::c_char;
use nt_sys::mingw::{
    _INTERFACE_TYPE, BOOLEAN, KDPC, KSPIN_LOCK, PHYSICAL_ADDRESS, PUCHAR, PVOID, UCHAR, ULONG,
    USHORT,
};
use static_assertions::const_assert_eq;

// ---------------------------------------------------------------------------
// Callback types mingw lacks (storport/nc-storport-*).
// ---------------------------------------------------------------------------

/// `HW_BUILDIO` (nc-storport-hw_buildio).
pub type PHW_BUILDIO =
    Option<unsafe extern "system" fn(DeviceExtension: PVOID, Srb: PVOID) -> BOOLEAN>;
/// `HW_FREE_ADAPTER_RESOURCES` (nc-storport-hw_free_adapter_resources).
pub type PHW_FREE_ADAPTER_RESOURCES = Option<unsafe extern "system" fn(DeviceExtension: PVOID)>;
/// `HW_PROCESS_SERVICE_REQUEST` (nc-storport-hw_process_service_request).
pub type PHW_PROCESS_SERVICE_REQUEST =
    Option<unsafe extern "system" fn(DeviceExtension: PVOID, Irp: PVOID)>;
/// `HW_COMPLETE_SERVICE_IRP` (nc-storport-hw_complete_service_irp).
pub type PHW_COMPLETE_SERVICE_IRP = Option<unsafe extern "system" fn(DeviceExtension: PVOID)>;
/// `HW_INITIALIZE_TRACING` (nc-storport-hw_initialize_tracing).
pub type PHW_INITIALIZE_TRACING = Option<unsafe extern "system" fn(Arg1: PVOID, Arg2: PVOID)>;
/// `HW_CLEANUP_TRACING` (nc-storport-hw_cleanup_tracing).
pub type PHW_CLEANUP_TRACING = Option<unsafe extern "system" fn(Arg1: PVOID)>;
/// `HW_TRACING_ENABLED` (nc-storport-hw_tracing_enabled).
pub type PHW_TRACING_ENABLED =
    Option<unsafe extern "system" fn(HwDeviceExtension: PVOID, Enabled: BOOLEAN)>;
/// `HW_UNIT_CONTROL` (nc-storport-hw_unit_control); returns
/// `SCSI_UNIT_CONTROL_STATUS`.
pub type PHW_UNIT_CONTROL = Option<
    unsafe extern "system" fn(DeviceExtension: PVOID, ControlType: u32, Parameters: PVOID) -> u32,
>;
/// `HW_PASSIVE_INITIALIZE_ROUTINE` (nc-storport-hw_passive_initialize_routine).
pub type PHW_PASSIVE_INITIALIZE_ROUTINE =
    Option<unsafe extern "system" fn(DeviceExtension: PVOID) -> BOOLEAN>;
/// `VIRTUAL_HW_FIND_ADAPTER` (nc-storport-virtual_hw_find_adapter): the
/// physical form plus `LowerDevice`.
pub type PVIRTUAL_HW_FIND_ADAPTER = Option<
    unsafe extern "system" fn(
        DeviceExtension: PVOID,
        HwContext: PVOID,
        BusInformation: PVOID,
        LowerDevice: PVOID,
        ArgumentString: *mut c_char,
        ConfigInfo: *mut _PORT_CONFIGURATION_INFORMATION,
        Again: *mut BOOLEAN,
    ) -> ULONG,
>;
/// `HW_DPC_ROUTINE` (storport/nf-storport-storportinitializedpc).
pub type PHW_DPC_ROUTINE = Option<
    unsafe extern "system" fn(
        Dpc: *mut _STOR_DPC,
        HwDeviceExtension: PVOID,
        SystemArgument1: PVOID,
        SystemArgument2: PVOID,
    ),
>;

// ---------------------------------------------------------------------------
// HW_INITIALIZATION_DATA, StorPort form (ns-storport-_hw_initialization_data-r1).
// mingw's srb.h has only the ScsiPort form, which ends at DeviceId.
// ---------------------------------------------------------------------------

/// `ReservedUshort` / `PortVersionFlags` share storage.
#[repr(C)]
#[derive(Clone, Copy)]
pub union _HW_INITIALIZATION_DATA__bindgen_ty_1 {
    /// Reserved.
    pub ReservedUshort: USHORT,
    /// "Flags to indicate supported features."
    pub PortVersionFlags: USHORT,
}

/// The StorPort `HW_INITIALIZATION_DATA` (Windows 8+), which a virtual
/// miniport uses with `STOR_FEATURE_VIRTUAL_MINIPORT` (the page's remark).
/// `HwFindAdapter` is `PVOID` in the page's syntax block: it holds either
/// the physical or the virtual find-adapter routine.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct _HW_INITIALIZATION_DATA {
    pub HwInitializationDataSize: ULONG,
    pub AdapterInterfaceType: _INTERFACE_TYPE::Type,
    pub HwInitialize: PHW_INITIALIZE,
    pub HwStartIo: PHW_STARTIO,
    pub HwInterrupt: PHW_INTERRUPT,
    pub HwFindAdapter: PVOID,
    pub HwResetBus: PHW_RESET_BUS,
    pub HwDmaStarted: PHW_DMA_STARTED,
    pub HwAdapterState: PHW_ADAPTER_STATE,
    pub DeviceExtensionSize: ULONG,
    pub SpecificLuExtensionSize: ULONG,
    pub SrbExtensionSize: ULONG,
    pub NumberOfAccessRanges: ULONG,
    pub Reserved: PVOID,
    pub MapBuffers: UCHAR,
    pub NeedPhysicalAddresses: BOOLEAN,
    pub TaggedQueuing: BOOLEAN,
    pub AutoRequestSense: BOOLEAN,
    pub MultipleRequestPerLu: BOOLEAN,
    pub ReceiveEvent: BOOLEAN,
    pub VendorIdLength: USHORT,
    pub VendorId: PVOID,
    pub __bindgen_anon_1: _HW_INITIALIZATION_DATA__bindgen_ty_1,
    pub DeviceIdLength: USHORT,
    pub DeviceId: PVOID,
    pub HwAdapterControl: PHW_ADAPTER_CONTROL,
    pub HwBuildIo: PHW_BUILDIO,
    pub HwFreeAdapterResources: PHW_FREE_ADAPTER_RESOURCES,
    pub HwProcessServiceRequest: PHW_PROCESS_SERVICE_REQUEST,
    pub HwCompleteServiceIrp: PHW_COMPLETE_SERVICE_IRP,
    pub HwInitializeTracing: PHW_INITIALIZE_TRACING,
    pub HwCleanupTracing: PHW_CLEANUP_TRACING,
    pub HwTracingEnabled: PHW_TRACING_ENABLED,
    pub FeatureSupport: ULONG,
    pub SrbTypeFlags: ULONG,
    pub AddressTypeFlags: ULONG,
    pub Reserved1: ULONG,
    pub HwUnitControl: PHW_UNIT_CONTROL,
}
/// See [`_HW_INITIALIZATION_DATA`].
pub type HW_INITIALIZATION_DATA = _HW_INITIALIZATION_DATA;
/// See [`_HW_INITIALIZATION_DATA`].
pub type PHW_INITIALIZATION_DATA = *mut _HW_INITIALIZATION_DATA;

// Offsets from the field list of ns-storport-_hw_initialization_data-r1.
const_assert_eq!(offset_of!(_HW_INITIALIZATION_DATA, HwInitialize), 8);
const_assert_eq!(offset_of!(_HW_INITIALIZATION_DATA, HwFindAdapter), 32);
const_assert_eq!(offset_of!(_HW_INITIALIZATION_DATA, DeviceExtensionSize), 64);
const_assert_eq!(offset_of!(_HW_INITIALIZATION_DATA, Reserved), 80);
const_assert_eq!(offset_of!(_HW_INITIALIZATION_DATA, MapBuffers), 88);
const_assert_eq!(offset_of!(_HW_INITIALIZATION_DATA, VendorIdLength), 94);
const_assert_eq!(offset_of!(_HW_INITIALIZATION_DATA, VendorId), 96);
const_assert_eq!(offset_of!(_HW_INITIALIZATION_DATA, __bindgen_anon_1), 104);
const_assert_eq!(offset_of!(_HW_INITIALIZATION_DATA, DeviceId), 112);
const_assert_eq!(offset_of!(_HW_INITIALIZATION_DATA, HwAdapterControl), 120);
const_assert_eq!(offset_of!(_HW_INITIALIZATION_DATA, HwBuildIo), 128);
const_assert_eq!(
    offset_of!(_HW_INITIALIZATION_DATA, HwFreeAdapterResources),
    136
);
const_assert_eq!(offset_of!(_HW_INITIALIZATION_DATA, HwTracingEnabled), 176);
const_assert_eq!(offset_of!(_HW_INITIALIZATION_DATA, FeatureSupport), 184);
const_assert_eq!(offset_of!(_HW_INITIALIZATION_DATA, SrbTypeFlags), 188);
const_assert_eq!(offset_of!(_HW_INITIALIZATION_DATA, AddressTypeFlags), 192);
const_assert_eq!(offset_of!(_HW_INITIALIZATION_DATA, HwUnitControl), 200);
const_assert_eq!(size_of::<_HW_INITIALIZATION_DATA>(), 208);

/// `VIRTUAL_HW_INITIALIZATION_DATA` (ns-storport-_virtual_hw_initialization_data):
/// the pre-Windows-8 registration of a virtual miniport. Declared for
/// completeness; the shim registers with [`HW_INITIALIZATION_DATA`], as that
/// page recommends for drivers that run only on Windows 8 and later.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct _VIRTUAL_HW_INITIALIZATION_DATA {
    pub HwInitializationDataSize: ULONG,
    pub AdapterInterfaceType: _INTERFACE_TYPE::Type,
    pub HwInitialize: PHW_INITIALIZE,
    pub HwStartIo: PHW_STARTIO,
    pub HwInterrupt: PHW_INTERRUPT,
    pub HwFindAdapter: PVIRTUAL_HW_FIND_ADAPTER,
    pub HwResetBus: PHW_RESET_BUS,
    pub HwDmaStarted: PHW_DMA_STARTED,
    pub HwAdapterState: PHW_ADAPTER_STATE,
    pub DeviceExtensionSize: ULONG,
    pub SpecificLuExtensionSize: ULONG,
    pub SrbExtensionSize: ULONG,
    pub NumberOfAccessRanges: ULONG,
    pub Reserved: PVOID,
    pub MapBuffers: UCHAR,
    pub NeedPhysicalAddresses: BOOLEAN,
    pub TaggedQueuing: BOOLEAN,
    pub AutoRequestSense: BOOLEAN,
    pub MultipleRequestPerLu: BOOLEAN,
    pub ReceiveEvent: BOOLEAN,
    pub VendorIdLength: USHORT,
    pub VendorId: PVOID,
    pub __bindgen_anon_1: _HW_INITIALIZATION_DATA__bindgen_ty_1,
    pub DeviceIdLength: USHORT,
    pub DeviceId: PVOID,
    pub HwAdapterControl: PHW_ADAPTER_CONTROL,
    pub HwBuildIo: PHW_BUILDIO,
    pub HwFreeAdapterResources: PHW_FREE_ADAPTER_RESOURCES,
    pub HwProcessServiceRequest: PHW_PROCESS_SERVICE_REQUEST,
    pub HwCompleteServiceIrp: PHW_COMPLETE_SERVICE_IRP,
    pub HwInitializeTracing: PHW_INITIALIZE_TRACING,
    pub HwCleanupTracing: PHW_CLEANUP_TRACING,
}
/// See [`_VIRTUAL_HW_INITIALIZATION_DATA`].
pub type VIRTUAL_HW_INITIALIZATION_DATA = _VIRTUAL_HW_INITIALIZATION_DATA;

// ns-storport-_virtual_hw_initialization_data: same prefix as the StorPort
// HW_INITIALIZATION_DATA, ending at HwCleanupTracing.
const_assert_eq!(
    offset_of!(_VIRTUAL_HW_INITIALIZATION_DATA, HwFindAdapter),
    32
);
const_assert_eq!(
    offset_of!(_VIRTUAL_HW_INITIALIZATION_DATA, HwAdapterControl),
    120
);
const_assert_eq!(
    offset_of!(_VIRTUAL_HW_INITIALIZATION_DATA, HwCleanupTracing),
    168
);
const_assert_eq!(size_of::<_VIRTUAL_HW_INITIALIZATION_DATA>(), 176);

// ---------------------------------------------------------------------------
// PORT_CONFIGURATION_INFORMATION, StorPort form
// (ns-storport-_port_configuration_information). mingw's ends at
// WmiDataProvider (the ScsiPort form).
// ---------------------------------------------------------------------------

/// `MEMORY_REGION` (ns-storport-_memory_region).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct _MEMORY_REGION {
    pub VirtualBase: PUCHAR,
    pub PhysicalBase: PHYSICAL_ADDRESS,
    pub Length: ULONG,
}
/// See [`_MEMORY_REGION`].
pub type MEMORY_REGION = _MEMORY_REGION;
const_assert_eq!(size_of::<_MEMORY_REGION>(), 24);

/// The StorPort `PORT_CONFIGURATION_INFORMATION`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct _PORT_CONFIGURATION_INFORMATION {
    pub Length: ULONG,
    pub SystemIoBusNumber: ULONG,
    pub AdapterInterfaceType: _INTERFACE_TYPE::Type,
    pub BusInterruptLevel: ULONG,
    pub BusInterruptVector: ULONG,
    pub InterruptMode: u32,
    pub MaximumTransferLength: ULONG,
    pub NumberOfPhysicalBreaks: ULONG,
    pub DmaChannel: ULONG,
    pub DmaPort: ULONG,
    pub DmaWidth: u32,
    pub DmaSpeed: u32,
    pub AlignmentMask: ULONG,
    pub NumberOfAccessRanges: ULONG,
    pub AccessRanges: *mut ACCESS_RANGE,
    pub MiniportDumpData: PVOID,
    pub Reserved: PVOID,
    pub NumberOfBuses: UCHAR,
    pub InitiatorBusId: [c_char; 8],
    pub ScatterGather: BOOLEAN,
    pub Master: BOOLEAN,
    pub CachesData: BOOLEAN,
    pub AdapterScansDown: BOOLEAN,
    pub AtdiskPrimaryClaimed: BOOLEAN,
    pub AtdiskSecondaryClaimed: BOOLEAN,
    pub Dma32BitAddresses: BOOLEAN,
    pub DemandMode: BOOLEAN,
    pub MapBuffers: UCHAR,
    pub NeedPhysicalAddresses: BOOLEAN,
    pub TaggedQueuing: BOOLEAN,
    pub AutoRequestSense: BOOLEAN,
    pub MultipleRequestPerLu: BOOLEAN,
    pub ReceiveEvent: BOOLEAN,
    pub RealModeInitialized: BOOLEAN,
    pub BufferAccessScsiPortControlled: BOOLEAN,
    pub MaximumNumberOfTargets: UCHAR,
    pub SrbType: UCHAR,
    pub AddressType: UCHAR,
    pub ReservedUchars: [UCHAR; 2],
    pub SlotNumber: ULONG,
    pub BusInterruptLevel2: ULONG,
    pub BusInterruptVector2: ULONG,
    pub InterruptMode2: u32,
    pub DmaChannel2: ULONG,
    pub DmaPort2: ULONG,
    pub DmaWidth2: u32,
    pub DmaSpeed2: u32,
    pub DeviceExtensionSize: ULONG,
    pub SpecificLuExtensionSize: ULONG,
    pub SrbExtensionSize: ULONG,
    pub Dma64BitAddresses: UCHAR,
    pub ResetTargetSupported: BOOLEAN,
    pub MaximumNumberOfLogicalUnits: UCHAR,
    pub WmiDataProvider: BOOLEAN,
    /// `STOR_SYNCHRONIZATION_MODEL` (an enum: 4 bytes).
    pub SynchronizationModel: u32,
    pub HwMSInterruptRoutine: PVOID,
    /// `INTERRUPT_SYNCHRONIZATION_MODE` (an enum: 4 bytes).
    pub InterruptSynchronizationMode: u32,
    pub DumpRegion: MEMORY_REGION,
    pub RequestedDumpBufferSize: ULONG,
    pub VirtualDevice: BOOLEAN,
    pub DumpMode: UCHAR,
    /// Added in Windows 10 2004 ("0 < DmaAddressWidth <= 64"). The page
    /// gives no type; a byte in the former padding after `DumpMode` is the
    /// only placement that leaves the older members where shipped miniports
    /// expect them.
    pub DmaAddressWidth: UCHAR,
    pub ExtendedFlags1: ULONG,
    pub MaxNumberOfIO: ULONG,
    pub MaxIOsPerLun: ULONG,
    pub InitialLunQueueDepth: ULONG,
    pub BusResetHoldTime: ULONG,
    pub FeatureSupport: ULONG,
}
/// See [`_PORT_CONFIGURATION_INFORMATION`].
pub type PORT_CONFIGURATION_INFORMATION = _PORT_CONFIGURATION_INFORMATION;
/// See [`_PORT_CONFIGURATION_INFORMATION`].
pub type PPORT_CONFIGURATION_INFORMATION = *mut _PORT_CONFIGURATION_INFORMATION;

// From the field list of ns-storport-_port_configuration_information; the
// ScsiPort prefix (through WmiDataProvider) equals mingw's srb.h layout.
const_assert_eq!(
    offset_of!(_PORT_CONFIGURATION_INFORMATION, AccessRanges),
    56
);
const_assert_eq!(
    offset_of!(_PORT_CONFIGURATION_INFORMATION, NumberOfBuses),
    80
);
const_assert_eq!(offset_of!(_PORT_CONFIGURATION_INFORMATION, MapBuffers), 97);
const_assert_eq!(
    offset_of!(_PORT_CONFIGURATION_INFORMATION, MaximumNumberOfTargets),
    105
);
const_assert_eq!(offset_of!(_PORT_CONFIGURATION_INFORMATION, SrbType), 106);
const_assert_eq!(offset_of!(_PORT_CONFIGURATION_INFORMATION, SlotNumber), 112);
const_assert_eq!(
    offset_of!(_PORT_CONFIGURATION_INFORMATION, DeviceExtensionSize),
    144
);
const_assert_eq!(
    offset_of!(_PORT_CONFIGURATION_INFORMATION, Dma64BitAddresses),
    156
);
const_assert_eq!(
    offset_of!(_PORT_CONFIGURATION_INFORMATION, WmiDataProvider),
    159
);
const_assert_eq!(
    offset_of!(_PORT_CONFIGURATION_INFORMATION, SynchronizationModel),
    160
);
const_assert_eq!(
    offset_of!(_PORT_CONFIGURATION_INFORMATION, HwMSInterruptRoutine),
    168
);
const_assert_eq!(offset_of!(_PORT_CONFIGURATION_INFORMATION, DumpRegion), 184);
const_assert_eq!(
    offset_of!(_PORT_CONFIGURATION_INFORMATION, VirtualDevice),
    212
);
const_assert_eq!(
    offset_of!(_PORT_CONFIGURATION_INFORMATION, ExtendedFlags1),
    216
);
const_assert_eq!(
    offset_of!(_PORT_CONFIGURATION_INFORMATION, MaxNumberOfIO),
    220
);
const_assert_eq!(
    offset_of!(_PORT_CONFIGURATION_INFORMATION, FeatureSupport),
    236
);
const_assert_eq!(size_of::<_PORT_CONFIGURATION_INFORMATION>(), 240);

// ---------------------------------------------------------------------------
// STORAGE_REQUEST_BLOCK (ns-storport-_storage_request_block) and its address
// and extended-data blocks.
// ---------------------------------------------------------------------------

/// `RequestTagHigh4Bytes` shares storage with `SystemStatus`.
#[repr(C)]
#[derive(Clone, Copy)]
pub union _STORAGE_REQUEST_BLOCK__bindgen_ty_1 {
    /// Port-to-class status; not for miniports.
    pub SystemStatus: ULONG,
    /// High half of a 64-bit request tag.
    pub RequestTagHigh4Bytes: ULONG,
}

/// The extended SRB. The page's syntax block lists `SystemStatus` once in
/// the union and again after it; the union *is* that member (it was widened
/// to carry `RequestTagHigh4Bytes`), so it appears once here. With the
/// documented `Length` ("equal to the offset of the Signature member") and
/// `DataBuffer` at 64, the block's fixed part is 120 bytes plus the
/// `SrbExDataOffset[ANYSIZE_ARRAY]` tail.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct _STORAGE_REQUEST_BLOCK {
    pub Length: USHORT,
    pub Function: UCHAR,
    pub SrbStatus: UCHAR,
    pub ReservedUlong1: ULONG,
    pub Signature: ULONG,
    pub Version: ULONG,
    pub SrbLength: ULONG,
    pub SrbFunction: ULONG,
    pub SrbFlags: ULONG,
    pub ReservedUlong2: ULONG,
    pub RequestTag: ULONG,
    pub RequestPriority: USHORT,
    pub RequestAttribute: USHORT,
    pub TimeOutValue: ULONG,
    pub __bindgen_anon_1: _STORAGE_REQUEST_BLOCK__bindgen_ty_1,
    pub ZeroGuard1: ULONG,
    pub AddressOffset: ULONG,
    pub NumSrbExData: ULONG,
    pub DataTransferLength: ULONG,
    pub DataBuffer: PVOID,
    pub ZeroGuard2: PVOID,
    pub OriginalRequest: PVOID,
    pub ClassContext: PVOID,
    pub PortContext: PVOID,
    pub MiniportContext: PVOID,
    pub NextSrb: *mut _STORAGE_REQUEST_BLOCK,
    pub SrbExDataOffset: [ULONG; 1],
}
/// See [`_STORAGE_REQUEST_BLOCK`].
pub type STORAGE_REQUEST_BLOCK = _STORAGE_REQUEST_BLOCK;
/// See [`_STORAGE_REQUEST_BLOCK`].
pub type PSTORAGE_REQUEST_BLOCK = *mut _STORAGE_REQUEST_BLOCK;

const_assert_eq!(offset_of!(_STORAGE_REQUEST_BLOCK, Signature), 8);
const_assert_eq!(offset_of!(_STORAGE_REQUEST_BLOCK, SrbFunction), 20);
const_assert_eq!(offset_of!(_STORAGE_REQUEST_BLOCK, RequestTag), 32);
const_assert_eq!(offset_of!(_STORAGE_REQUEST_BLOCK, TimeOutValue), 40);
const_assert_eq!(offset_of!(_STORAGE_REQUEST_BLOCK, AddressOffset), 52);
const_assert_eq!(offset_of!(_STORAGE_REQUEST_BLOCK, DataTransferLength), 60);
const_assert_eq!(offset_of!(_STORAGE_REQUEST_BLOCK, DataBuffer), 64);
const_assert_eq!(offset_of!(_STORAGE_REQUEST_BLOCK, MiniportContext), 104);
const_assert_eq!(offset_of!(_STORAGE_REQUEST_BLOCK, NextSrb), 112);
const_assert_eq!(offset_of!(_STORAGE_REQUEST_BLOCK, SrbExDataOffset), 120);
const_assert_eq!(size_of::<_STORAGE_REQUEST_BLOCK>(), 128);

/// `SRB_FUNCTION_STORAGE_REQUEST_BLOCK`: the `Function` byte that marks an
/// extended SRB (storport.h/srb.h; the STORAGE_REQUEST_BLOCK page names it
/// without its value).
pub const SRB_FUNCTION_STORAGE_REQUEST_BLOCK: UCHAR = 0x28;
/// `SRB_SIGNATURE` ("SRBX", srb.h; named, not valued, by the page).
pub const SRB_SIGNATURE: ULONG = 0x5352_4258;
/// `STORAGE_REQUEST_BLOCK_VERSION_1` (srb.h).
pub const STORAGE_REQUEST_BLOCK_VERSION_1: ULONG = 0x10;

/// `STOR_ADDRESS` (ns-storport-_stor_address): `STOR_ADDRESS_ALIGN` makes it
/// 8-aligned.
#[repr(C, align(8))]
#[derive(Clone, Copy)]
pub struct _STOR_ADDRESS {
    pub Type: USHORT,
    pub Port: USHORT,
    pub AddressLength: ULONG,
    pub AddressData: [UCHAR; 1],
}
/// See [`_STOR_ADDRESS`].
pub type STOR_ADDRESS = _STOR_ADDRESS;
const_assert_eq!(size_of::<_STOR_ADDRESS>(), 16);

/// `STOR_ADDR_BTL8` (ns-storport-_stor_addr_btl8).
#[repr(C, align(8))]
#[derive(Clone, Copy)]
pub struct _STOR_ADDR_BTL8 {
    pub Type: USHORT,
    pub Port: USHORT,
    pub AddressLength: ULONG,
    pub Path: UCHAR,
    pub Target: UCHAR,
    pub Lun: UCHAR,
    pub Reserved: UCHAR,
}
/// See [`_STOR_ADDR_BTL8`].
pub type STOR_ADDR_BTL8 = _STOR_ADDR_BTL8;
const_assert_eq!(offset_of!(_STOR_ADDR_BTL8, Path), 8);
const_assert_eq!(size_of::<_STOR_ADDR_BTL8>(), 16);
/// `STOR_ADDRESS_TYPE_BTL8` (scsi.h).
pub const STOR_ADDRESS_TYPE_BTL8: USHORT = 0x0001;
/// `STOR_ADDR_BTL8_ADDRESS_LENGTH`: the four bytes Path..Reserved.
pub const STOR_ADDR_BTL8_ADDRESS_LENGTH: ULONG = 4;

/// `SRBEX_DATA` (ns-storport-_srbex_data): the header every extended-data
/// block starts with.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct _SRBEX_DATA {
    /// `SRBEXDATATYPE` (an enum: 4 bytes).
    pub Type: u32,
    pub Length: ULONG,
    pub Data: [UCHAR; 1],
}
/// See [`_SRBEX_DATA`].
pub type SRBEX_DATA = _SRBEX_DATA;
const_assert_eq!(offset_of!(_SRBEX_DATA, Data), 8);

/// `SRBEX_DATA_SCSI_CDB16` (ns-storport-_srbex_data_scsi_cdb16).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct _SRBEX_DATA_SCSI_CDB16 {
    pub Type: u32,
    pub Length: ULONG,
    pub ScsiStatus: UCHAR,
    pub SenseInfoBufferLength: UCHAR,
    pub CdbLength: UCHAR,
    pub Reserved: UCHAR,
    pub Reserved1: ULONG,
    pub SenseInfoBuffer: PVOID,
    pub Cdb: [UCHAR; 16],
}
/// See [`_SRBEX_DATA_SCSI_CDB16`].
pub type SRBEX_DATA_SCSI_CDB16 = _SRBEX_DATA_SCSI_CDB16;
const_assert_eq!(offset_of!(_SRBEX_DATA_SCSI_CDB16, ScsiStatus), 8);
const_assert_eq!(offset_of!(_SRBEX_DATA_SCSI_CDB16, SenseInfoBuffer), 16);
const_assert_eq!(offset_of!(_SRBEX_DATA_SCSI_CDB16, Cdb), 24);
const_assert_eq!(size_of::<_SRBEX_DATA_SCSI_CDB16>(), 40);
/// `SrbExDataTypeScsiCdb16` (srb.h; the SRBEX_DATA page names the
/// enumerator without its value).
pub const SrbExDataTypeScsiCdb16: u32 = 0x40;

// ---------------------------------------------------------------------------
// Registration flags (ns-storport-_hw_initialization_data-r1 names them;
// values from storport.h).
// ---------------------------------------------------------------------------

/// `STOR_FEATURE_VIRTUAL_MINIPORT`: "This is a virtual miniport driver."
pub const STOR_FEATURE_VIRTUAL_MINIPORT: ULONG = 0x0000_0001;
/// `SRB_TYPE_FLAG_SCSI_REQUEST_BLOCK`.
pub const SRB_TYPE_FLAG_SCSI_REQUEST_BLOCK: ULONG = 0x1;
/// `SRB_TYPE_FLAG_STORAGE_REQUEST_BLOCK`.
pub const SRB_TYPE_FLAG_STORAGE_REQUEST_BLOCK: ULONG = 0x2;
/// `ADDRESS_TYPE_FLAG_BTL8`, the only address scheme StorPort supports.
pub const ADDRESS_TYPE_FLAG_BTL8: ULONG = 0x1;
/// `SRB_TYPE_STORAGE_REQUEST_BLOCK` for `PORT_CONFIGURATION_INFORMATION.SrbType`.
pub const SRB_TYPE_STORAGE_REQUEST_BLOCK: UCHAR = 0x1;
/// `STORAGE_ADDRESS_TYPE_BTL8` for `PORT_CONFIGURATION_INFORMATION.AddressType`.
pub const STORAGE_ADDRESS_TYPE_BTL8: UCHAR = 0x0;
/// `STOR_MAP_ALL_BUFFERS_INCLUDING_READ_WRITE` (Windows 8+): a virtual
/// miniport "must map all data buffers into virtual address space".
pub const STOR_MAP_ALL_BUFFERS_INCLUDING_READ_WRITE: UCHAR = 3;
/// `StorSynchronizeFullDuplex` (`STOR_SYNCHRONIZATION_MODEL`).
pub const StorSynchronizeFullDuplex: u32 = 1;

// ---------------------------------------------------------------------------
// StorPortNotification extensions and the StorPortExtendedFunction family.
// ---------------------------------------------------------------------------

/// `EnablePassiveInitialization`: the `SCSI_NOTIFICATION_TYPE` through which
/// the inline `StorPortEnablePassiveInitialization` ("implemented using
/// inline function definitions", nf-storport-storportenablepassiveinitialization)
/// reaches storport.sys. The value is storport.h's; no page gives it.
pub const EnablePassiveInitialization: _SCSI_NOTIFICATION_TYPE::Type = 0x1000;
/// `InitializeDpc` (the inline `StorPortInitializeDpc`).
pub const InitializeDpc: _SCSI_NOTIFICATION_TYPE::Type = 0x1001;
/// `IssueDpc` (the inline `StorPortIssueDpc`).
pub const IssueDpc: _SCSI_NOTIFICATION_TYPE::Type = 0x1002;
/// `AcquireSpinLock` (the inline `StorPortAcquireSpinLock`).
pub const AcquireSpinLock: _SCSI_NOTIFICATION_TYPE::Type = 0x1003;
/// `ReleaseSpinLock` (the inline `StorPortReleaseSpinLock`).
pub const ReleaseSpinLock: _SCSI_NOTIFICATION_TYPE::Type = 0x1004;

/// `STOR_DPC` (ns-storport-_stor_dpc): "an opaque structure" whose members
/// are `Dpc` and `Lock`; `StorPortInitializeDpc` requires a buffer of at
/// least `sizeof(STOR_DPC)`. Typed by the member names: a `KDPC` and a
/// `KSPIN_LOCK` (the page gives no types).
#[repr(C)]
pub struct _STOR_DPC {
    pub Dpc: KDPC,
    pub Lock: KSPIN_LOCK,
}
/// See [`_STOR_DPC`].
pub type STOR_DPC = _STOR_DPC;
/// See [`_STOR_DPC`].
pub type PSTOR_DPC = *mut _STOR_DPC;
const_assert_eq!(size_of::<_STOR_DPC>(), 72);

/// `STOR_SPINLOCK` (ne-storport-_stor_spinlock): which lock to take.
pub type STOR_SPINLOCK = u32;
/// `DpcLock`.
pub const DpcLock: STOR_SPINLOCK = 1;
/// `StartIoLock`.
pub const StartIoLock: STOR_SPINLOCK = 2;
/// `InterruptLock`.
pub const InterruptLock: STOR_SPINLOCK = 3;

/// `STOR_LOCK_HANDLE`: no page documents its layout (the
/// StorPortAcquireSpinLock page calls it "a buffer that, on return, will
/// contain a lock handle"). The caller owns the buffer and StorPort writes
/// at most its own `sizeof`, so it is declared *oversized*: the selector,
/// then room for a `KLOCK_QUEUE_HANDLE` (24 bytes) and an old IRQL with
/// generous slack. Never read by the shim.
#[repr(C, align(8))]
pub struct _STOR_LOCK_HANDLE {
    pub Lock: STOR_SPINLOCK,
    pub Context: [u64; 6],
}
/// See [`_STOR_LOCK_HANDLE`].
pub type STOR_LOCK_HANDLE = _STOR_LOCK_HANDLE;
const_assert_eq!(size_of::<_STOR_LOCK_HANDLE>(), 56);

/// `STORPORT_FUNCTION_CODE`: the selector `StorPortExtendedFunction` takes.
/// Its enumerator values are not on any page; the shim names none of them.
pub type STORPORT_FUNCTION_CODE = u32;

// Routines absent from mingw's storport.h. Linked from storport.sys through
// the import library `kv-sys` makes from `imports/storport.def`.
unsafe extern "system" {
    /// `StorPortExtendedFunction` (nf-storport-storportextendedfunction):
    /// variadic, returns a `STOR_STATUS`.
    pub fn StorPortExtendedFunction(
        FunctionCode: STORPORT_FUNCTION_CODE,
        HwDeviceExtension: PVOID,
        ...
    ) -> ULONG;
}

/// `STOR_STATUS_SUCCESS` (storport.h's status codes, the storage
/// equivalent of `NTSTATUS`; the pages name them without values).
pub const STOR_STATUS_SUCCESS: ULONG = 0x0000_0000;
/// `STOR_STATUS_UNSUCCESSFUL`.
pub const STOR_STATUS_UNSUCCESSFUL: ULONG = 0xC100_0001;
/// `STOR_STATUS_NOT_IMPLEMENTED`: the routine does not exist on this system.
pub const STOR_STATUS_NOT_IMPLEMENTED: ULONG = 0xC100_0002;
/// `STOR_STATUS_INSUFFICIENT_RESOURCES`.
pub const STOR_STATUS_INSUFFICIENT_RESOURCES: ULONG = 0xC100_0003;
/// `STOR_STATUS_INVALID_PARAMETER`.
pub const STOR_STATUS_INVALID_PARAMETER: ULONG = 0xC100_0006;
/// `STOR_STATUS_BUSY`: for `StorPortRequestTimer`, an earlier request is
/// still pending (nf-storport-storportrequesttimer).
pub const STOR_STATUS_BUSY: ULONG = 0xC100_000C;

// `STORPORT_FUNCTION_CODE` enumerators (storport.h numbers them in
// declaration order from 0; the inline wrappers on the pages named beside
// each pass them to `StorPortExtendedFunction`).

/// `ExtFunctionGetOriginalMdl` (nf-storport-storportgetoriginalmdl).
pub const ExtFunctionGetOriginalMdl: STORPORT_FUNCTION_CODE = 6;
/// `ExtFunctionGetDeviceObjects` (nf-storport-storportgetdeviceobjects).
pub const ExtFunctionGetDeviceObjects: STORPORT_FUNCTION_CODE = 8;
/// `ExtFunctionInitializeTimer` (nf-storport-storportinitializetimer, Windows 8).
pub const ExtFunctionInitializeTimer: STORPORT_FUNCTION_CODE = 32;
/// `ExtFunctionRequestTimer` (nf-storport-storportrequesttimer, Windows 8).
pub const ExtFunctionRequestTimer: STORPORT_FUNCTION_CODE = 33;
/// `ExtFunctionFreeTimer` (nf-storport-storportfreetimer, Windows 8).
pub const ExtFunctionFreeTimer: STORPORT_FUNCTION_CODE = 34;

/// `HW_TIMER_EX` (nf-storport-storportrequesttimer): a StorPort timer's
/// callback.
pub type PHW_TIMER_EX = Option<unsafe extern "system" fn(DeviceExtension: PVOID, Context: PVOID)>;

/// `SrbExDataTypePnP` (srb.h's `SRBEXDATATYPE`: `SrbExDataTypeWmi = 0x60`,
/// then `Power`, then `PnP`).
pub const SrbExDataTypePnP: u32 = 0x62;

/// `SRBEX_DATA_PNP` (ns-srb-_srbex_data_pnp): the PnP block of an extended
/// `SRB_FUNCTION_PNP` request.
#[repr(C, align(8))]
#[derive(Clone, Copy)]
pub struct _SRBEX_DATA_PNP {
    /// `SRBEXDATATYPE` (an enum: 4 bytes).
    pub Type: u32,
    pub Length: ULONG,
    pub PnPSubFunction: UCHAR,
    pub Reserved: [UCHAR; 3],
    /// `STOR_PNP_ACTION` (an enum: 4 bytes).
    pub PnPAction: u32,
    pub SrbPnPFlags: ULONG,
    pub Reserved1: ULONG,
}
/// See [`_SRBEX_DATA_PNP`].
pub type SRBEX_DATA_PNP = _SRBEX_DATA_PNP;
const_assert_eq!(offset_of!(_SRBEX_DATA_PNP, PnPAction), 12);
const_assert_eq!(size_of::<_SRBEX_DATA_PNP>(), 24);
