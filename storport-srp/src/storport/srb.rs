//! The request block as the miniport core sees it: the [`Srb`] trait, and
//! the `SRB_FUNCTION_*`, `SRB_STATUS_*` and `SRB_FLAGS_*` vocabulary.
//!
//! The core never touches a `SCSI_REQUEST_BLOCK` or a
//! `STORAGE_REQUEST_BLOCK` directly. It holds an owned, move-only handle
//! (`StorPort::Srb`) from `HwStartIo` until it hands the handle back to
//! `StorPort::complete_request`; because the handle cannot be copied and
//! completion consumes it, a second completion of the same request does not
//! compile. The host model implements the trait over simulated physical
//! memory ([`crate::storport::host`]); the NT shim implements it over the
//! real block (`nt::srb::Srb` view plus the `SrbExtension`, `DataBuffer` and
//! `SenseInfoBuffer` pointers).
//!
//! | here | `SCSI_REQUEST_BLOCK` / `STORAGE_REQUEST_BLOCK` |
//! |---|---|
//! | [`Srb::function`] | `Function` / `SrbFunction` |
//! | [`Srb::address`] | `PathId`/`TargetId`/`Lun` / the BTL8 address block |
//! | [`Srb::cdb`] | `Cdb`+`CdbLength` / the `SrbExDataTypeScsiCdb16` block |
//! | [`Srb::direction`] | `SrbFlags & (SRB_FLAGS_DATA_IN \| SRB_FLAGS_DATA_OUT)` |
//! | [`Srb::data_transfer_length`] | `DataTransferLength` |
//! | [`Srb::read_data`] / [`Srb::write_data`] | `DataBuffer` (mapped: virtual miniport, `STOR_MAP_ALL_BUFFERS`) |
//! | [`Srb::scatter_gather`] | the `SCATTER_GATHER_LIST` the ExecutionRoutine received |
//! | [`Srb::sense_buffer`] | `SenseInfoBuffer` + `SenseInfoBufferLength` |
//! | [`Srb::extension`] | `SrbExtension` (`SrbExtensionSize` bytes) |
//! | [`Srb::queue_action`] | `QueueAction` + `SRB_FLAGS_QUEUE_ACTION_ENABLE` |
//! | [`Srb::queue_tag`] | `QueueTag` (`SrbGetQueueTag`) |
//! | [`Srb::timeout_secs`] | `TimeOutValue` |
//! | [`Srb::abort_target`] | `NextSrb` (ABORT_COMMAND) and its `SrbExtension` |
//! | [`Srb::pnp_action`] | `SCSI_PNP_REQUEST_BLOCK::PnPAction` / `SRBEX_DATA_PNP` |

use core::fmt;
use core::sync::atomic::AtomicU64;

use hca_lowlevel::dma::PhysAddr;

/// Bus (StorPort's `PathId`), target and LUN of a request: StorPort's BTL8
/// addressing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Address {
    /// SCSI bus (StorPort's `PathId`).
    pub path: u8,
    /// Target on that bus.
    pub target: u8,
    /// Logical unit of that target.
    pub lun: u8,
}

impl Address {
    /// The address of `lun` on `target` of bus `path`.
    #[must_use]
    pub const fn new(path: u8, target: u8, lun: u8) -> Self {
        Self { path, target, lun }
    }
}

/// What a request asks for (`SRB_FUNCTION_*`). Unknown codes are kept, so
/// the core can refuse them truthfully with `SRB_STATUS_INVALID_REQUEST`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SrbFunction {
    /// `SRB_FUNCTION_EXECUTE_SCSI` (0x00): a SCSI command.
    ExecuteScsi,
    /// `SRB_FUNCTION_IO_CONTROL` (0x02): a miniport IOCTL.
    IoControl,
    /// `SRB_FUNCTION_SHUTDOWN` (0x07): the system is going down.
    Shutdown,
    /// `SRB_FUNCTION_FLUSH` (0x08): flush adapter caches.
    Flush,
    /// `SRB_FUNCTION_ABORT_COMMAND` (0x10): abort the request in `NextSrb`.
    AbortCommand,
    /// `SRB_FUNCTION_RESET_BUS` (0x12).
    ResetBus,
    /// `SRB_FUNCTION_RESET_DEVICE` (0x13): a target reset.
    ResetDevice,
    /// `SRB_FUNCTION_RESET_LOGICAL_UNIT` (0x20).
    ResetLogicalUnit,
    /// `SRB_FUNCTION_WMI` (0x17).
    Wmi,
    /// `SRB_FUNCTION_POWER` (0x24).
    Power,
    /// `SRB_FUNCTION_PNP` (0x25).
    Pnp,
    /// Any other code, as received.
    Other(u8),
}

impl SrbFunction {
    /// The function for a raw `SRB_FUNCTION_*` code.
    #[must_use]
    pub const fn from_code(code: u8) -> Self {
        match code {
            0x00 => Self::ExecuteScsi,
            0x02 => Self::IoControl,
            0x07 => Self::Shutdown,
            0x08 => Self::Flush,
            0x10 => Self::AbortCommand,
            0x12 => Self::ResetBus,
            0x13 => Self::ResetDevice,
            0x17 => Self::Wmi,
            0x20 => Self::ResetLogicalUnit,
            0x24 => Self::Power,
            0x25 => Self::Pnp,
            other => Self::Other(other),
        }
    }

    /// The raw `SRB_FUNCTION_*` code.
    #[must_use]
    pub const fn code(self) -> u8 {
        match self {
            Self::ExecuteScsi => 0x00,
            Self::IoControl => 0x02,
            Self::Shutdown => 0x07,
            Self::Flush => 0x08,
            Self::AbortCommand => 0x10,
            Self::ResetBus => 0x12,
            Self::ResetDevice => 0x13,
            Self::Wmi => 0x17,
            Self::ResetLogicalUnit => 0x20,
            Self::Power => 0x24,
            Self::Pnp => 0x25,
            Self::Other(code) => code,
        }
    }
}

/// An `SrbStatus` byte: an `SRB_STATUS_*` value in the low six bits, plus
/// the `SRB_STATUS_AUTOSENSE_VALID` and `SRB_STATUS_QUEUE_FROZEN` flags.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct SrbStatus(u8);

impl SrbStatus {
    /// `SRB_STATUS_PENDING`: not completed yet (never a completion status).
    pub const PENDING: Self = Self(0x00);
    /// `SRB_STATUS_SUCCESS`.
    pub const SUCCESS: Self = Self(0x01);
    /// `SRB_STATUS_ABORTED`: the request was aborted (by ABORT_COMMAND, or
    /// by the target's TASK ABORTED).
    pub const ABORTED: Self = Self(0x02);
    /// `SRB_STATUS_ABORT_FAILED`: an ABORT_COMMAND found nothing to abort,
    /// or the target refused.
    pub const ABORT_FAILED: Self = Self(0x03);
    /// `SRB_STATUS_ERROR`: the target reported an error (see `ScsiStatus`
    /// and the sense data), or the transport failed the command.
    pub const ERROR: Self = Self(0x04);
    /// `SRB_STATUS_BUSY`: StorPort requeues the request (BuildIo and
    /// StartIo run again). Only before any data moved.
    pub const BUSY: Self = Self(0x05);
    /// `SRB_STATUS_INVALID_REQUEST`: the function is not supported.
    pub const INVALID_REQUEST: Self = Self(0x06);
    /// `SRB_STATUS_INVALID_PATH_ID`: no such bus.
    pub const INVALID_PATH_ID: Self = Self(0x07);
    /// `SRB_STATUS_NO_DEVICE`: the device is gone (device loss).
    pub const NO_DEVICE: Self = Self(0x08);
    /// `SRB_STATUS_TIMEOUT`: the miniport timed the request out.
    pub const TIMEOUT: Self = Self(0x09);
    /// `SRB_STATUS_SELECTION_TIMEOUT`: the target did not answer
    /// (unreachable now: not attached, or failed fast).
    pub const SELECTION_TIMEOUT: Self = Self(0x0A);
    /// `SRB_STATUS_COMMAND_TIMEOUT`.
    pub const COMMAND_TIMEOUT: Self = Self(0x0B);
    /// `SRB_STATUS_BUS_RESET`: terminated by a bus, device or LUN reset, or
    /// by a reconnect; the class driver retries it.
    pub const BUS_RESET: Self = Self(0x0E);
    /// `SRB_STATUS_NO_HBA`.
    pub const NO_HBA: Self = Self(0x11);
    /// `SRB_STATUS_DATA_OVERRUN`: over- or underrun; `DataTransferLength`
    /// says how much moved.
    pub const DATA_OVERRUN: Self = Self(0x12);
    /// `SRB_STATUS_PHASE_SEQUENCE_FAILURE`.
    pub const PHASE_SEQUENCE_FAILURE: Self = Self(0x14);
    /// `SRB_STATUS_INVALID_LUN`.
    pub const INVALID_LUN: Self = Self(0x20);
    /// `SRB_STATUS_INVALID_TARGET_ID`.
    pub const INVALID_TARGET_ID: Self = Self(0x21);
    /// `SRB_STATUS_BAD_FUNCTION`.
    pub const BAD_FUNCTION: Self = Self(0x22);
    /// `SRB_STATUS_INTERNAL_ERROR`.
    pub const INTERNAL_ERROR: Self = Self(0x30);

    /// Flag: `SenseInfoBuffer` holds valid sense data.
    pub const AUTOSENSE_VALID: u8 = 0x80;
    /// Flag: the LUN queue is frozen (not used by StorPort miniports).
    pub const QUEUE_FROZEN: u8 = 0x40;

    /// The status for a raw `SrbStatus` byte.
    #[must_use]
    pub const fn from_raw(raw: u8) -> Self {
        Self(raw)
    }

    /// The raw byte, flags included.
    #[must_use]
    pub const fn raw(self) -> u8 {
        self.0
    }

    /// The status without its flags (`SRB_STATUS(x)`).
    #[must_use]
    pub const fn base(self) -> Self {
        Self(self.0 & 0x3F)
    }

    /// This status with `SRB_STATUS_AUTOSENSE_VALID` set.
    #[must_use]
    pub const fn with_autosense(self) -> Self {
        Self(self.0 | Self::AUTOSENSE_VALID)
    }

    /// Whether `SRB_STATUS_AUTOSENSE_VALID` is set.
    #[must_use]
    pub const fn autosense_valid(self) -> bool {
        self.0 & Self::AUTOSENSE_VALID != 0
    }

    /// Whether the base status is `SRB_STATUS_PENDING`.
    #[must_use]
    pub const fn is_pending(self) -> bool {
        self.0 & 0x3F == 0
    }
}

impl fmt::Debug for SrbStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self.base().0 {
            0x00 => "PENDING",
            0x01 => "SUCCESS",
            0x02 => "ABORTED",
            0x03 => "ABORT_FAILED",
            0x04 => "ERROR",
            0x05 => "BUSY",
            0x06 => "INVALID_REQUEST",
            0x07 => "INVALID_PATH_ID",
            0x08 => "NO_DEVICE",
            0x09 => "TIMEOUT",
            0x0A => "SELECTION_TIMEOUT",
            0x0B => "COMMAND_TIMEOUT",
            0x0E => "BUS_RESET",
            0x11 => "NO_HBA",
            0x12 => "DATA_OVERRUN",
            0x14 => "PHASE_SEQUENCE_FAILURE",
            0x20 => "INVALID_LUN",
            0x21 => "INVALID_TARGET_ID",
            0x22 => "BAD_FUNCTION",
            0x30 => "INTERNAL_ERROR",
            _ => "",
        };
        if name.is_empty() {
            write!(f, "SRB_STATUS({:#04x})", self.base().0)?;
        } else {
            write!(f, "SRB_STATUS_{name}")?;
        }
        if self.autosense_valid() {
            f.write_str("|AUTOSENSE_VALID")?;
        }
        Ok(())
    }
}

/// Which way data moves (`SRB_FLAGS_DATA_IN` / `SRB_FLAGS_DATA_OUT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DataDirection {
    /// No data phase (`SRB_FLAGS_NO_DATA_TRANSFER`).
    None,
    /// Device to host (`SRB_FLAGS_DATA_IN`): a READ.
    In,
    /// Host to device (`SRB_FLAGS_DATA_OUT`): a WRITE.
    Out,
    /// Both flags (`SRB_FLAGS_UNSPECIFIED_DIRECTION`): the CDB decides.
    Unspecified,
}

impl DataDirection {
    /// `SRB_FLAGS_DATA_IN`.
    pub const FLAG_IN: u32 = 0x40;
    /// `SRB_FLAGS_DATA_OUT`.
    pub const FLAG_OUT: u32 = 0x80;

    /// The direction an `SrbFlags` value states.
    #[must_use]
    pub const fn from_srb_flags(flags: u32) -> Self {
        match (flags & Self::FLAG_IN != 0, flags & Self::FLAG_OUT != 0) {
            (false, false) => Self::None,
            (true, false) => Self::In,
            (false, true) => Self::Out,
            (true, true) => Self::Unspecified,
        }
    }

    /// The `SrbFlags` bits for this direction.
    #[must_use]
    pub const fn srb_flags(self) -> u32 {
        match self {
            Self::None => 0,
            Self::In => Self::FLAG_IN,
            Self::Out => Self::FLAG_OUT,
            Self::Unspecified => Self::FLAG_IN | Self::FLAG_OUT,
        }
    }
}

/// The SAM task attribute StorPort asks for (`QueueAction`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QueueAction {
    /// `SRB_SIMPLE_TAG_REQUEST` (0x20), also the default when queue actions
    /// are not enabled.
    Simple,
    /// `SRB_HEAD_OF_QUEUE_TAG_REQUEST` (0x21).
    HeadOfQueue,
    /// `SRB_ORDERED_QUEUE_TAG_REQUEST` (0x22).
    Ordered,
}

impl QueueAction {
    /// The action for a raw `QueueAction` byte; unknown values are simple.
    #[must_use]
    pub const fn from_code(code: u8) -> Self {
        match code {
            0x21 => Self::HeadOfQueue,
            0x22 => Self::Ordered,
            _ => Self::Simple,
        }
    }

    /// The raw `QueueAction` byte.
    #[must_use]
    pub const fn code(self) -> u8 {
        match self {
            Self::Simple => 0x20,
            Self::HeadOfQueue => 0x21,
            Self::Ordered => 0x22,
        }
    }
}

/// The PnP action of an `SRB_FUNCTION_PNP` request (`STOR_PNP_ACTION`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PnpAction {
    /// `StorStartDevice` (0).
    StartDevice,
    /// `StorRemoveDevice` (2).
    RemoveDevice,
    /// `StorStopDevice` (4).
    StopDevice,
    /// `StorQueryCapabilities` (9).
    QueryCapabilities,
    /// `StorSurpriseRemoval` (23).
    SurpriseRemoval,
    /// Any other action, as received.
    Other(u32),
}

impl PnpAction {
    /// The action for a raw `STOR_PNP_ACTION` value.
    #[must_use]
    pub const fn from_code(code: u32) -> Self {
        match code {
            0 => Self::StartDevice,
            2 => Self::RemoveDevice,
            4 => Self::StopDevice,
            9 => Self::QueryCapabilities,
            23 => Self::SurpriseRemoval,
            other => Self::Other(other),
        }
    }

    /// The raw `STOR_PNP_ACTION` value.
    #[must_use]
    pub const fn code(self) -> u32 {
        match self {
            Self::StartDevice => 0,
            Self::RemoveDevice => 2,
            Self::StopDevice => 4,
            Self::QueryCapabilities => 9,
            Self::SurpriseRemoval => 23,
            Self::Other(code) => code,
        }
    }
}

/// One element of a scatter/gather list: a physically contiguous piece of
/// the data buffer, as the HCA must address it (`STOR_SCATTER_GATHER_ELEMENT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SgElement {
    /// Bus address of the first byte.
    pub phys: PhysAddr,
    /// Length in bytes.
    pub len: u32,
}

/// Identifies one request to StorPort while it is outstanding: the SRB's
/// address on NT, an index and generation in the host model. Used to check
/// that an ABORT_COMMAND's `NextSrb` is the request a tag belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SrbIdentity(pub u64);

/// The request an `SRB_FUNCTION_ABORT_COMMAND` names (`NextSrb`), with its
/// `SrbExtension`, where the core wrote the victim's tag.
#[derive(Debug, Clone, Copy)]
pub struct AbortTarget<'a> {
    /// The victim's identity.
    pub identity: SrbIdentity,
    /// The victim's `SrbExtension` words.
    pub extension: &'a [AtomicU64],
}

/// A CPU access to the data buffer reached outside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataAccessError {
    /// `offset + len` exceeds `DataTransferLength`, or there is no buffer.
    OutOfBounds,
    /// The memory behind the buffer is not reachable (host model: unmapped).
    Unmapped,
}

impl fmt::Display for DataAccessError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::OutOfBounds => "data buffer access out of bounds",
            Self::Unmapped => "data buffer memory not mapped",
        })
    }
}

/// One request, owned by the miniport from `HwStartIo` (or the
/// ExecutionRoutine) until it is passed to `StorPort::complete_request`.
///
/// The handle is move-only: completion consumes it, so a request cannot be
/// completed twice by the code that holds it. Dropping a handle without
/// completing it is a bug (the request would hang); the host model reports
/// it.
///
/// Every method is callable at any IRQL <= `DISPATCH_LEVEL`, never blocks
/// and never allocates.
pub trait Srb: Send + 'static {
    /// Who this request is to StorPort (for matching an ABORT_COMMAND).
    fn identity(&self) -> SrbIdentity;

    /// The `SRB_FUNCTION_*`.
    fn function(&self) -> SrbFunction;

    /// Bus, target and LUN.
    fn address(&self) -> Address;

    /// The CDB (EXECUTE_SCSI; empty for other functions, at most 16 bytes
    /// for classic SRBs, up to 32 for extended ones).
    fn cdb(&self) -> &[u8];

    /// Which way data moves.
    fn direction(&self) -> DataDirection;

    /// `DataTransferLength`: the buffer size on entry; on completion, the
    /// bytes actually moved.
    fn data_transfer_length(&self) -> u32;

    /// Sets `DataTransferLength` (on completion: bytes actually moved).
    fn set_data_transfer_length(&mut self, len: u32);

    /// The current `SrbStatus`.
    fn srb_status(&self) -> SrbStatus;

    /// Sets `SrbStatus`.
    fn set_srb_status(&mut self, status: SrbStatus);

    /// The `ScsiStatus` byte.
    fn scsi_status(&self) -> u8;

    /// Sets the `ScsiStatus` byte (the SAM status the target returned).
    fn set_scsi_status(&mut self, status: u8);

    /// The auto-sense buffer (`SenseInfoBuffer`, `SenseInfoBufferLength`
    /// bytes); empty when the request carries none.
    fn sense_buffer(&mut self) -> &mut [u8];

    /// Sets `SenseInfoBufferLength` to the number of valid sense bytes
    /// written (never more than the buffer's length).
    fn set_sense_length(&mut self, len: u8);

    /// Copies `out.len()` bytes of the data buffer, from `offset`, as the
    /// CPU sees it (immediate data, emulated commands).
    ///
    /// # Errors
    /// [`DataAccessError`] if the range leaves the buffer.
    fn read_data(&self, offset: u32, out: &mut [u8]) -> Result<(), DataAccessError>;

    /// Copies `data` into the data buffer at `offset`, as the CPU sees it.
    ///
    /// # Errors
    /// [`DataAccessError`] if the range leaves the buffer.
    fn write_data(&mut self, offset: u32, data: &[u8]) -> Result<(), DataAccessError>;

    /// The scatter/gather list the ExecutionRoutine delivered (physical
    /// segments for the HCA); `None` before that and after
    /// `StorPort::put_scatter_gather_list`.
    fn scatter_gather(&self) -> Option<&[SgElement]>;

    /// The per-request scratch (`SrbExtension`), as 64-bit words. Its
    /// contents are undefined on every (re)issue: StorPort does not clear it
    /// and an `SRB_STATUS_BUSY` requeue loses it.
    fn extension(&self) -> &[AtomicU64];

    /// The task attribute.
    fn queue_action(&self) -> QueueAction;

    /// StorPort's own tag for the request (`QueueTag`). Informational: the
    /// core names requests by its own [`crate::miniport::transport::Tag`].
    fn queue_tag(&self) -> u8;

    /// `TimeOutValue`, seconds.
    fn timeout_secs(&self) -> u32;

    /// For `SRB_FUNCTION_ABORT_COMMAND`: the request to abort, while
    /// StorPort still considers it outstanding.
    fn abort_target(&self) -> Option<AbortTarget<'_>>;

    /// For `SRB_FUNCTION_PNP`: the action.
    fn pnp_action(&self) -> Option<PnpAction>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn function_codes_round_trip() {
        for code in 0..=u8::MAX {
            assert_eq!(SrbFunction::from_code(code).code(), code);
        }
        assert_eq!(SrbFunction::from_code(0x20), SrbFunction::ResetLogicalUnit);
        assert_eq!(SrbFunction::from_code(0x28), SrbFunction::Other(0x28));
    }

    #[test]
    fn status_flags() {
        let s = SrbStatus::ERROR.with_autosense();
        assert_eq!(s.raw(), 0x84);
        assert_eq!(s.base(), SrbStatus::ERROR);
        assert!(s.autosense_valid());
        assert!(!SrbStatus::ERROR.autosense_valid());
        assert!(SrbStatus::from_raw(0x80).is_pending());
        assert_eq!(
            format!("{s:?}"),
            "SRB_STATUS_ERROR|AUTOSENSE_VALID".to_string()
        );
        assert_eq!(
            format!("{:?}", SrbStatus::from_raw(0x3f)),
            "SRB_STATUS(0x3f)"
        );
    }

    #[test]
    fn directions_from_flags() {
        for d in [
            DataDirection::None,
            DataDirection::In,
            DataDirection::Out,
            DataDirection::Unspecified,
        ] {
            assert_eq!(DataDirection::from_srb_flags(d.srb_flags() | 0x2), d);
        }
    }

    #[test]
    fn queue_and_pnp_codes() {
        for q in [
            QueueAction::Simple,
            QueueAction::HeadOfQueue,
            QueueAction::Ordered,
        ] {
            assert_eq!(QueueAction::from_code(q.code()), q);
        }
        for code in [0, 2, 4, 9, 23, 7] {
            assert_eq!(PnpAction::from_code(code).code(), code);
        }
    }

    /// The constants agree with the Windows headers the NT shim binds.
    #[cfg(all(feature = "nt", not(feature = "wdk")))]
    #[test]
    fn constants_match_the_ddk() {
        use crate::nt::ffi::mingw as k;
        let pairs = [
            (SrbStatus::PENDING, k::SRB_STATUS_PENDING),
            (SrbStatus::SUCCESS, k::SRB_STATUS_SUCCESS),
            (SrbStatus::ABORTED, k::SRB_STATUS_ABORTED),
            (SrbStatus::ABORT_FAILED, k::SRB_STATUS_ABORT_FAILED),
            (SrbStatus::ERROR, k::SRB_STATUS_ERROR),
            (SrbStatus::BUSY, k::SRB_STATUS_BUSY),
            (SrbStatus::INVALID_REQUEST, k::SRB_STATUS_INVALID_REQUEST),
            (SrbStatus::INVALID_PATH_ID, k::SRB_STATUS_INVALID_PATH_ID),
            (SrbStatus::NO_DEVICE, k::SRB_STATUS_NO_DEVICE),
            (SrbStatus::TIMEOUT, k::SRB_STATUS_TIMEOUT),
            (
                SrbStatus::SELECTION_TIMEOUT,
                k::SRB_STATUS_SELECTION_TIMEOUT,
            ),
            (SrbStatus::COMMAND_TIMEOUT, k::SRB_STATUS_COMMAND_TIMEOUT),
            (SrbStatus::BUS_RESET, k::SRB_STATUS_BUS_RESET),
            (SrbStatus::NO_HBA, k::SRB_STATUS_NO_HBA),
            (SrbStatus::DATA_OVERRUN, k::SRB_STATUS_DATA_OVERRUN),
            (
                SrbStatus::PHASE_SEQUENCE_FAILURE,
                k::SRB_STATUS_PHASE_SEQUENCE_FAILURE,
            ),
            (SrbStatus::INVALID_LUN, k::SRB_STATUS_INVALID_LUN),
            (
                SrbStatus::INVALID_TARGET_ID,
                k::SRB_STATUS_INVALID_TARGET_ID,
            ),
            (SrbStatus::BAD_FUNCTION, k::SRB_STATUS_BAD_FUNCTION),
            (SrbStatus::INTERNAL_ERROR, k::SRB_STATUS_INTERNAL_ERROR),
        ];
        for (ours, theirs) in pairs {
            assert_eq!(u32::from(ours.raw()), theirs, "{ours:?}");
        }
        assert_eq!(
            u32::from(SrbStatus::AUTOSENSE_VALID),
            k::SRB_STATUS_AUTOSENSE_VALID
        );
        let functions = [
            (SrbFunction::ExecuteScsi, k::SRB_FUNCTION_EXECUTE_SCSI),
            (SrbFunction::IoControl, k::SRB_FUNCTION_IO_CONTROL),
            (SrbFunction::Shutdown, k::SRB_FUNCTION_SHUTDOWN),
            (SrbFunction::Flush, k::SRB_FUNCTION_FLUSH),
            (SrbFunction::AbortCommand, k::SRB_FUNCTION_ABORT_COMMAND),
            (SrbFunction::ResetBus, k::SRB_FUNCTION_RESET_BUS),
            (SrbFunction::ResetDevice, k::SRB_FUNCTION_RESET_DEVICE),
            (SrbFunction::Wmi, k::SRB_FUNCTION_WMI),
            (
                SrbFunction::ResetLogicalUnit,
                k::SRB_FUNCTION_RESET_LOGICAL_UNIT,
            ),
            (SrbFunction::Power, k::SRB_FUNCTION_POWER),
            (SrbFunction::Pnp, k::SRB_FUNCTION_PNP),
        ];
        for (ours, theirs) in functions {
            assert_eq!(u32::from(ours.code()), theirs, "{ours:?}");
        }
        assert_eq!(DataDirection::FLAG_IN, k::SRB_FLAGS_DATA_IN);
        assert_eq!(DataDirection::FLAG_OUT, k::SRB_FLAGS_DATA_OUT);
        assert_eq!(
            u32::from(QueueAction::Ordered.code()),
            k::SRB_ORDERED_QUEUE_TAG_REQUEST
        );
        for (ours, theirs) in [
            (PnpAction::StartDevice, k::_STOR_PNP_ACTION::StorStartDevice),
            (
                PnpAction::RemoveDevice,
                k::_STOR_PNP_ACTION::StorRemoveDevice,
            ),
            (PnpAction::StopDevice, k::_STOR_PNP_ACTION::StorStopDevice),
            (
                PnpAction::QueryCapabilities,
                k::_STOR_PNP_ACTION::StorQueryCapabilities,
            ),
            (
                PnpAction::SurpriseRemoval,
                k::_STOR_PNP_ACTION::StorSurpriseRemoval,
            ),
        ] {
            assert_eq!(ours.code(), theirs, "{ours:?}");
        }
    }
}
