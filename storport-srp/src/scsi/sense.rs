//! Sense data (SPC-4 4.5): sense keys, additional sense codes, and the fixed
//! (0x70/0x71) and descriptor (0x72/0x73) formats.
//!
//! [`SenseRepr::parse`] reads either format into one value. Sense data is
//! routinely cut short on the way (by an allocation length, by SRP's
//! `max_ti_iu_len`, by an initiator's sense buffer), so truncation is *not* an
//! error: a field that is not in the bytes reads as absent (`None`) or zero,
//! as Linux `scsi_normalize_sense` does. What *is* an error is sense that
//! contradicts itself: an unknown response code, a descriptor longer than
//! the sense's own additional length, a known descriptor with the wrong
//! length. The rules, exactly:
//!
//! * no bytes: [`SenseError::Empty`]; a response code other than
//!   0x70..=0x73: [`SenseError::UnknownResponseCode`];
//! * fixed format needs 3 bytes (the sense key), descriptor format 2;
//!   fewer: [`SenseError::Truncated`];
//! * the bytes considered are the first `8 + additional sense length`
//!   (or all of them, if fewer are present);
//! * fixed format: ASC at byte 12 and ASCQ at byte 13 read as zero when cut
//!   off; INFORMATION is present when VALID is set and bytes 3..7 are there;
//!   COMMAND-SPECIFIC INFORMATION is present when non-zero; the
//!   sense-key-specific bytes when SKSV is set and bytes 15..18 are there;
//! * descriptor format: descriptors are read in order; one that the buffer
//!   cuts (but the additional length covers) ends the walk silently, one
//!   that reaches past the additional length is
//!   [`SenseError::DescriptorOverrun`], a known descriptor (types 0..=5) with
//!   the wrong additional length is [`SenseError::BadDescriptorLength`];
//!   unknown descriptor types are skipped.

use core::fmt;

use static_assertions::const_assert_eq;

use super::{FieldPointer, scsi_view};
use crate::wire::bytes::{self, FieldCodec};

/// A sense key (SPC-4 table 45): the class of the condition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum SenseKey {
    /// 0x0: no specific sense key (e.g. a REQUEST SENSE with nothing
    /// pending, or FILEMARK/EOM/ILI only).
    NoSense = 0x0,
    /// 0x1: the command completed after recovery action.
    RecoveredError = 0x1,
    /// 0x2: the logical unit is not accessible.
    NotReady = 0x2,
    /// 0x3: a non-recoverable medium error.
    MediumError = 0x3,
    /// 0x4: a non-recoverable hardware failure.
    HardwareError = 0x4,
    /// 0x5: the command or its parameters are not valid.
    IllegalRequest = 0x5,
    /// 0x6: a unit attention condition (reset, capacity or mode change...).
    UnitAttention = 0x6,
    /// 0x7: the medium is write protected or access is denied.
    DataProtect = 0x7,
    /// 0x8: blank medium or format-defined end of data.
    BlankCheck = 0x8,
    /// 0x9: vendor-specific.
    VendorSpecific = 0x9,
    /// 0xA: EXTENDED COPY aborted.
    CopyAborted = 0xA,
    /// 0xB: the device server aborted the command (the initiator may retry).
    AbortedCommand = 0xB,
    /// 0xC: obsolete (formerly EQUAL).
    Obsolete = 0xC,
    /// 0xD: a buffered device reached the end of the partition.
    VolumeOverflow = 0xD,
    /// 0xE: source data did not match the medium (VERIFY, COMPARE AND
    /// WRITE).
    Miscompare = 0xE,
    /// 0xF: command completed with sense to report (SPC-5).
    Completed = 0xF,
}

impl SenseKey {
    /// The sense key in the low nibble of `byte` (the high nibble is
    /// ignored, so every byte has an answer).
    pub const fn from_nibble(byte: u8) -> Self {
        match byte & 0x0F {
            0x0 => Self::NoSense,
            0x1 => Self::RecoveredError,
            0x2 => Self::NotReady,
            0x3 => Self::MediumError,
            0x4 => Self::HardwareError,
            0x5 => Self::IllegalRequest,
            0x6 => Self::UnitAttention,
            0x7 => Self::DataProtect,
            0x8 => Self::BlankCheck,
            0x9 => Self::VendorSpecific,
            0xA => Self::CopyAborted,
            0xB => Self::AbortedCommand,
            0xC => Self::Obsolete,
            0xD => Self::VolumeOverflow,
            0xE => Self::Miscompare,
            _ => Self::Completed,
        }
    }

    /// The 4-bit code.
    pub const fn code(self) -> u8 {
        self as u8
    }
}

/// An additional sense code and qualifier (ASC/ASCQ, SPC-4 table 47).
///
/// A pair rather than an enum: the table has over a thousand entries and a
/// target may send any of them; the constants name the ones the initiator
/// acts on and the software targets send.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct AdditionalSense {
    /// Additional sense code.
    pub asc: u8,
    /// Additional sense code qualifier.
    pub ascq: u8,
}

macro_rules! additional_sense_table {
    ($($(#[$doc:meta])* $name:ident = ($asc:expr, $ascq:expr), $text:expr;)*) => {
        impl AdditionalSense {
            $(
                $(#[$doc])*
                pub const $name: Self = Self { asc: $asc, ascq: $ascq };
            )*

            /// The T10 description of a pair named here, `None` otherwise.
            pub const fn description(self) -> Option<&'static str> {
                match self {
                    $(Self::$name => Some($text),)*
                    _ => None,
                }
            }
        }
    };
}

additional_sense_table! {
    /// 00/00.
    NO_ADDITIONAL_SENSE = (0x00, 0x00), "NO ADDITIONAL SENSE INFORMATION";
    /// 04/00.
    LOGICAL_UNIT_NOT_READY = (0x04, 0x00), "LOGICAL UNIT NOT READY, CAUSE NOT REPORTABLE";
    /// 04/01.
    LOGICAL_UNIT_BECOMING_READY = (0x04, 0x01), "LOGICAL UNIT IS IN PROCESS OF BECOMING READY";
    /// 04/02.
    LOGICAL_UNIT_NOT_READY_INIT_REQUIRED = (0x04, 0x02), "LOGICAL UNIT NOT READY, INITIALIZING COMMAND REQUIRED";
    /// 04/03.
    LOGICAL_UNIT_NOT_READY_MANUAL_INTERVENTION = (0x04, 0x03), "LOGICAL UNIT NOT READY, MANUAL INTERVENTION REQUIRED";
    /// 04/0A.
    LOGICAL_UNIT_NOT_ACCESSIBLE_TRANSITIONING = (0x04, 0x0A), "LOGICAL UNIT NOT ACCESSIBLE, ASYMMETRIC ACCESS STATE TRANSITION";
    /// 08/00.
    LOGICAL_UNIT_COMMUNICATION_FAILURE = (0x08, 0x00), "LOGICAL UNIT COMMUNICATION FAILURE";
    /// 0C/00.
    WRITE_ERROR = (0x0C, 0x00), "WRITE ERROR";
    /// 0E/03.
    INVALID_FIELD_IN_COMMAND_IU = (0x0E, 0x03), "INVALID FIELD IN COMMAND INFORMATION UNIT";
    /// 10/01.
    LOGICAL_BLOCK_GUARD_CHECK_FAILED = (0x10, 0x01), "LOGICAL BLOCK GUARD CHECK FAILED";
    /// 11/00.
    UNRECOVERED_READ_ERROR = (0x11, 0x00), "UNRECOVERED READ ERROR";
    /// 1A/00.
    PARAMETER_LIST_LENGTH_ERROR = (0x1A, 0x00), "PARAMETER LIST LENGTH ERROR";
    /// 1D/00.
    MISCOMPARE_DURING_VERIFY = (0x1D, 0x00), "MISCOMPARE DURING VERIFY OPERATION";
    /// 20/00.
    INVALID_COMMAND_OPERATION_CODE = (0x20, 0x00), "INVALID COMMAND OPERATION CODE";
    /// 21/00.
    LBA_OUT_OF_RANGE = (0x21, 0x00), "LOGICAL BLOCK ADDRESS OUT OF RANGE";
    /// 24/00.
    INVALID_FIELD_IN_CDB = (0x24, 0x00), "INVALID FIELD IN CDB";
    /// 25/00.
    LOGICAL_UNIT_NOT_SUPPORTED = (0x25, 0x00), "LOGICAL UNIT NOT SUPPORTED";
    /// 26/00.
    INVALID_FIELD_IN_PARAMETER_LIST = (0x26, 0x00), "INVALID FIELD IN PARAMETER LIST";
    /// 27/00.
    WRITE_PROTECTED = (0x27, 0x00), "WRITE PROTECTED";
    /// 28/00.
    NOT_READY_TO_READY_CHANGE = (0x28, 0x00), "NOT READY TO READY CHANGE, MEDIUM MAY HAVE CHANGED";
    /// 29/00.
    POWER_ON_RESET = (0x29, 0x00), "POWER ON, RESET, OR BUS DEVICE RESET OCCURRED";
    /// 29/03.
    BUS_DEVICE_RESET = (0x29, 0x03), "BUS DEVICE RESET FUNCTION OCCURRED";
    /// 29/07.
    I_T_NEXUS_LOSS = (0x29, 0x07), "I_T NEXUS LOSS OCCURRED";
    /// 2A/00.
    PARAMETERS_CHANGED = (0x2A, 0x00), "PARAMETERS CHANGED";
    /// 2A/01.
    MODE_PARAMETERS_CHANGED = (0x2A, 0x01), "MODE PARAMETERS CHANGED";
    /// 2A/03.
    RESERVATIONS_PREEMPTED = (0x2A, 0x03), "RESERVATIONS PREEMPTED";
    /// 2A/06.
    ASYMMETRIC_ACCESS_STATE_CHANGED = (0x2A, 0x06), "ASYMMETRIC ACCESS STATE CHANGED";
    /// 2A/09.
    CAPACITY_DATA_CHANGED = (0x2A, 0x09), "CAPACITY DATA HAS CHANGED";
    /// 2C/00.
    COMMAND_SEQUENCE_ERROR = (0x2C, 0x00), "COMMAND SEQUENCE ERROR";
    /// 2F/00.
    COMMANDS_CLEARED_BY_ANOTHER_INITIATOR = (0x2F, 0x00), "COMMANDS CLEARED BY ANOTHER INITIATOR";
    /// 39/00.
    SAVING_PARAMETERS_NOT_SUPPORTED = (0x39, 0x00), "SAVING PARAMETERS NOT SUPPORTED";
    /// 3A/00.
    MEDIUM_NOT_PRESENT = (0x3A, 0x00), "MEDIUM NOT PRESENT";
    /// 3F/0E.
    REPORTED_LUNS_DATA_CHANGED = (0x3F, 0x0E), "REPORTED LUNS DATA HAS CHANGED";
    /// 44/00.
    INTERNAL_TARGET_FAILURE = (0x44, 0x00), "INTERNAL TARGET FAILURE";
    /// 47/00.
    SCSI_PARITY_ERROR = (0x47, 0x00), "SCSI PARITY ERROR";
    /// 48/00.
    INITIATOR_DETECTED_ERROR = (0x48, 0x00), "INITIATOR DETECTED ERROR MESSAGE RECEIVED";
    /// 4B/00.
    DATA_PHASE_ERROR = (0x4B, 0x00), "DATA PHASE ERROR";
    /// 4E/00.
    OVERLAPPED_COMMANDS = (0x4E, 0x00), "OVERLAPPED COMMANDS ATTEMPTED";
    /// 55/03.
    INSUFFICIENT_RESOURCES = (0x55, 0x03), "INSUFFICIENT RESOURCES";
}

impl fmt::Debug for AdditionalSense {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:02X}/{:02X}", self.asc, self.ascq)?;
        if let Some(text) = self.description() {
            write!(f, " {text}")?;
        }
        Ok(())
    }
}

/// Which of the two sense formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum SenseFormat {
    /// Fixed format (response codes 0x70/0x71), 18 bytes when built here.
    #[default]
    Fixed,
    /// Descriptor format (response codes 0x72/0x73).
    Descriptor,
}

/// Why sense data could not be parsed or emitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SenseError {
    /// There are no sense bytes at all.
    Empty,
    /// Too few bytes for the sense key (3 for fixed, 2 for descriptor
    /// format).
    Truncated,
    /// The response code (byte 0, bits 6..0) is not 0x70..=0x73; 0x7F
    /// (vendor-specific format) lands here too.
    UnknownResponseCode(u8),
    /// The descriptor at this byte offset reaches past the additional
    /// sense length.
    DescriptorOverrun {
        /// Byte offset of the descriptor.
        offset: u16,
    },
    /// A descriptor of a type SPC defines has the wrong additional length.
    BadDescriptorLength {
        /// Its descriptor type.
        descriptor_type: u8,
        /// Its additional length as received.
        length: u8,
    },
    /// The output buffer is shorter than [`SenseRepr::buffer_len`].
    BufferTooSmall,
    /// INFORMATION or COMMAND-SPECIFIC INFORMATION above `u32::MAX` does
    /// not fit fixed format; use descriptor format.
    NotRepresentable,
}

impl fmt::Display for SenseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Empty => f.write_str("no sense data"),
            Self::Truncated => f.write_str("sense data too short for a sense key"),
            Self::UnknownResponseCode(code) => write!(f, "unknown sense response code {code:#04x}"),
            Self::DescriptorOverrun { offset } => write!(
                f,
                "sense descriptor at byte {offset} runs past the additional sense length"
            ),
            Self::BadDescriptorLength {
                descriptor_type,
                length,
            } => write!(
                f,
                "sense descriptor type {descriptor_type:#04x} has additional length {length}"
            ),
            Self::BufferTooSmall => f.write_str("buffer too small for the sense data"),
            Self::NotRepresentable => f.write_str("value does not fit fixed-format sense"),
        }
    }
}

/// Response codes (byte 0, bits 6..0).
mod response_code {
    pub const FIXED_CURRENT: u8 = 0x70;
    pub const FIXED_DEFERRED: u8 = 0x71;
    pub const DESCRIPTOR_CURRENT: u8 = 0x72;
    pub const DESCRIPTOR_DEFERRED: u8 = 0x73;
}

mod fixed {
    use crate::wire::Field;

    pub const RESPONSE_CODE: Field = 0..1;
    pub const FLAGS_KEY: Field = 2..3;
    pub const INFORMATION: Field = 3..7;
    pub const ADDITIONAL_LEN: Field = 7..8;
    pub const COMMAND_SPECIFIC: Field = 8..12;
    pub const ASC: Field = 12..13;
    pub const ASCQ: Field = 13..14;
    pub const FRU: Field = 14..15;
    pub const SENSE_KEY_SPECIFIC: Field = 15..18;
    pub const LEN: usize = SENSE_KEY_SPECIFIC.end;

    /// Byte 0 bit 7: INFORMATION is valid.
    pub const VALID: u8 = 0x80;
    /// Byte 2 flag bits.
    pub const FILEMARK: u8 = 0x80;
    pub const EOM: u8 = 0x40;
    pub const ILI: u8 = 0x20;
    pub const SDAT_OVFL: u8 = 0x10;
}

mod desc {
    use crate::wire::Field;

    pub const RESPONSE_CODE: Field = 0..1;
    pub const KEY: Field = 1..2;
    pub const ASC: Field = 2..3;
    pub const ASCQ: Field = 3..4;
    pub const FLAGS: Field = 4..5;
    pub const ADDITIONAL_LEN: Field = 7..8;
    pub const HEADER_LEN: usize = 8;

    /// Byte 4 bit 7: sense data overflow.
    pub const SDAT_OVFL: u8 = 0x80;

    /// Descriptor types and their additional lengths.
    pub const INFORMATION: u8 = 0x00;
    pub const INFORMATION_LEN: u8 = 0x0A;
    pub const COMMAND_SPECIFIC: u8 = 0x01;
    pub const COMMAND_SPECIFIC_LEN: u8 = 0x0A;
    pub const SENSE_KEY_SPECIFIC: u8 = 0x02;
    pub const SENSE_KEY_SPECIFIC_LEN: u8 = 0x06;
    pub const FRU: u8 = 0x03;
    pub const FRU_LEN: u8 = 0x02;
    pub const STREAM: u8 = 0x04;
    pub const STREAM_LEN: u8 = 0x02;
    pub const BLOCK: u8 = 0x05;
    pub const BLOCK_LEN: u8 = 0x02;
}

const_assert_eq!(fixed::LEN, 18);
const_assert_eq!(desc::HEADER_LEN, desc::ADDITIONAL_LEN.end);

/// Sense-key-specific byte 0, bit 7: the three bytes are valid.
const SKSV: u8 = 0x80;

scsi_view! {
    /// Fixed-format sense data (SPC-4 4.5.3), the 18 bytes this crate emits.
    /// Sense received from a target may be shorter; [`SenseRepr::parse`]
    /// handles that.
    pub struct FixedSense, min_len = fixed::LEN, error: SenseError = SenseError::Truncated;
    /// Byte 0: VALID bit and response code.
    response_byte, set_response_byte: u8 = fixed::RESPONSE_CODE;
    /// Byte 2: FILEMARK, EOM, ILI, SDAT_OVFL and the sense key.
    flags_key, set_flags_key: u8 = fixed::FLAGS_KEY;
    /// INFORMATION (meaningful with VALID).
    information, set_information: u32 = fixed::INFORMATION;
    /// ADDITIONAL SENSE LENGTH (bytes after byte 7).
    additional_len, set_additional_len: u8 = fixed::ADDITIONAL_LEN;
    /// COMMAND-SPECIFIC INFORMATION.
    command_specific, set_command_specific: u32 = fixed::COMMAND_SPECIFIC;
    /// ADDITIONAL SENSE CODE.
    asc, set_asc: u8 = fixed::ASC;
    /// ADDITIONAL SENSE CODE QUALIFIER.
    ascq, set_ascq: u8 = fixed::ASCQ;
    /// FIELD REPLACEABLE UNIT CODE.
    fru, set_fru: u8 = fixed::FRU;
    /// SENSE KEY SPECIFIC bytes (SKSV in bit 7 of the first).
    sense_key_specific, set_sense_key_specific: [u8; 3] = fixed::SENSE_KEY_SPECIFIC;
}

scsi_view! {
    /// The 8-byte header of descriptor-format sense data (SPC-4 4.5.2);
    /// descriptors follow.
    pub struct DescriptorSenseHeader, min_len = desc::HEADER_LEN, error: SenseError = SenseError::Truncated;
    /// Byte 0: response code.
    response_byte, set_response_byte: u8 = desc::RESPONSE_CODE;
    /// Byte 1: sense key in the low nibble.
    key_byte, set_key_byte: u8 = desc::KEY;
    /// ADDITIONAL SENSE CODE.
    asc, set_asc: u8 = desc::ASC;
    /// ADDITIONAL SENSE CODE QUALIFIER.
    ascq, set_ascq: u8 = desc::ASCQ;
    /// Byte 4: SDAT_OVFL in bit 7.
    flags, set_flags: u8 = desc::FLAGS;
    /// ADDITIONAL SENSE LENGTH (bytes of descriptors).
    additional_len, set_additional_len: u8 = desc::ADDITIONAL_LEN;
}

/// Sense data, decoded: everything a block device initiator looks at, in
/// either format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SenseRepr {
    /// The format it came in or is to be sent in.
    pub format: SenseFormat,
    /// Deferred error (response code 0x71/0x73) rather than current.
    pub deferred: bool,
    /// The sense key.
    pub key: SenseKey,
    /// ASC/ASCQ.
    pub code: AdditionalSense,
    /// INFORMATION (e.g. the first failing LBA, the miscompare offset).
    /// Fixed format carries only 32 bits.
    pub information: Option<u64>,
    /// COMMAND-SPECIFIC INFORMATION. In fixed format a zero value reads as
    /// `None`.
    pub command_specific: Option<u64>,
    /// The three sense-key-specific bytes, present when SKSV was set; the
    /// SKSV bit itself is cleared here and set again by `emit`.
    pub sense_key_specific: Option<[u8; 3]>,
    /// FIELD REPLACEABLE UNIT CODE (0: none).
    pub fru: u8,
    /// FILEMARK (stream devices).
    pub filemark: bool,
    /// EOM (stream devices).
    pub eom: bool,
    /// ILI: the requested length did not match the block length.
    pub ili: bool,
    /// SDAT_OVFL: the device server had more sense than fitted.
    pub overflow: bool,
}

impl SenseRepr {
    /// Current, fixed-format sense with only a key and ASC/ASCQ: what a
    /// target sends for most errors.
    pub const fn new(key: SenseKey, code: AdditionalSense) -> Self {
        Self {
            format: SenseFormat::Fixed,
            deferred: false,
            key,
            code,
            information: None,
            command_specific: None,
            sense_key_specific: None,
            fru: 0,
            filemark: false,
            eom: false,
            ili: false,
            overflow: false,
        }
    }

    /// The same sense in `format`.
    #[must_use]
    pub const fn in_format(mut self, format: SenseFormat) -> Self {
        self.format = format;
        self
    }

    /// The same sense with INFORMATION set.
    #[must_use]
    pub const fn with_information(mut self, information: u64) -> Self {
        self.information = Some(information);
        self
    }

    /// The same sense with a field pointer (ILLEGAL REQUEST): the offending
    /// field is in the CDB (`in_cdb`) or in the parameter data.
    #[must_use]
    pub const fn with_field_pointer(mut self, in_cdb: bool, field: FieldPointer) -> Self {
        let mut first = if in_cdb { 0x40 } else { 0 };
        if let Some(bit) = field.bit {
            first |= 0x08 | (bit & 0x07);
        }
        let [hi, lo] = field.byte.to_be_bytes();
        self.sense_key_specific = Some([first, hi, lo]);
        self
    }

    /// The field pointer of ILLEGAL REQUEST sense: whether the field is in
    /// the CDB, and where. `None` for other keys or without SKSV.
    pub const fn field_pointer(&self) -> Option<(bool, FieldPointer)> {
        match (self.key, self.sense_key_specific) {
            (SenseKey::IllegalRequest, Some([first, hi, lo])) => {
                let bit = if first & 0x08 != 0 {
                    Some(first & 0x07)
                } else {
                    None
                };
                Some((
                    first & 0x40 != 0,
                    FieldPointer {
                        byte: u16::from_be_bytes([hi, lo]),
                        bit,
                    },
                ))
            }
            _ => None,
        }
    }

    /// Parses fixed or descriptor sense; see the module documentation for
    /// exactly what short or malformed sense yields.
    ///
    /// # Errors
    ///
    /// [`SenseError::Empty`], [`SenseError::Truncated`],
    /// [`SenseError::UnknownResponseCode`], [`SenseError::DescriptorOverrun`],
    /// [`SenseError::BadDescriptorLength`].
    pub fn parse(sense: &[u8]) -> Result<Self, SenseError> {
        let first = *sense.first().ok_or(SenseError::Empty)?;
        match first & 0x7F {
            response_code::FIXED_CURRENT => Self::parse_fixed(sense, false),
            response_code::FIXED_DEFERRED => Self::parse_fixed(sense, true),
            response_code::DESCRIPTOR_CURRENT => Self::parse_descriptor(sense, false),
            response_code::DESCRIPTOR_DEFERRED => Self::parse_descriptor(sense, true),
            other => Err(SenseError::UnknownResponseCode(other)),
        }
    }

    /// The bytes to consider: all of them up to byte 7, then no more than
    /// the additional sense length announces.
    fn considered_len(sense: &[u8], additional_len_at: usize) -> usize {
        match sense.get(additional_len_at) {
            Some(&additional) => sense
                .len()
                .min(additional_len_at + 1 + usize::from(additional)),
            None => sense.len(),
        }
    }

    fn parse_fixed(sense: &[u8], deferred: bool) -> Result<Self, SenseError> {
        if sense.len() < fixed::FLAGS_KEY.end {
            return Err(SenseError::Truncated);
        }
        let len = Self::considered_len(sense, fixed::ADDITIONAL_LEN.start);
        let bytes = sense.get(..len).ok_or(SenseError::Truncated)?;
        let view = FixedSense::new_unchecked(bytes);
        let has = |field: &crate::wire::Field| len >= field.end;
        let flags = view.flags_key();
        let information = (view.response_byte() & fixed::VALID != 0 && has(&fixed::INFORMATION))
            .then(|| u64::from(view.information()));
        let command_specific = Some(view.command_specific())
            .filter(|value| *value != 0 && has(&fixed::COMMAND_SPECIFIC))
            .map(u64::from);
        let sks = view.sense_key_specific();
        let sense_key_specific = (has(&fixed::SENSE_KEY_SPECIFIC) && sks[0] & SKSV != 0)
            .then_some([sks[0] & !SKSV, sks[1], sks[2]]);
        Ok(Self {
            format: SenseFormat::Fixed,
            deferred,
            key: SenseKey::from_nibble(flags),
            // A cut-off ASC/ASCQ reads as zero (the view reads zeros past
            // the considered bytes).
            code: AdditionalSense {
                asc: view.asc(),
                ascq: view.ascq(),
            },
            information,
            command_specific,
            sense_key_specific,
            fru: view.fru(),
            filemark: flags & fixed::FILEMARK != 0,
            eom: flags & fixed::EOM != 0,
            ili: flags & fixed::ILI != 0,
            overflow: flags & fixed::SDAT_OVFL != 0,
        })
    }

    fn parse_descriptor(sense: &[u8], deferred: bool) -> Result<Self, SenseError> {
        if sense.len() < desc::KEY.end {
            return Err(SenseError::Truncated);
        }
        let header = DescriptorSenseHeader::new_unchecked(sense);
        let mut repr = Self {
            format: SenseFormat::Descriptor,
            deferred,
            key: SenseKey::from_nibble(header.key_byte()),
            code: AdditionalSense {
                asc: header.asc(),
                ascq: header.ascq(),
            },
            overflow: header.flags() & desc::SDAT_OVFL != 0,
            ..Self::new(SenseKey::NoSense, AdditionalSense::NO_ADDITIONAL_SENSE)
        };
        if sense.len() < desc::HEADER_LEN {
            return Ok(repr);
        }
        let declared_end = desc::HEADER_LEN + usize::from(header.additional_len());
        let mut offset = desc::HEADER_LEN;
        while offset < declared_end {
            let Some(&[kind, additional]) =
                bytes::sub(sense, offset, 2).and_then(|header| <&[u8; 2]>::try_from(header).ok())
            else {
                // The descriptor header itself is cut: by the buffer (fine)
                // or by the additional length (one dangling byte).
                if offset + 2 > declared_end && offset < sense.len() {
                    return Err(overrun(offset));
                }
                break;
            };
            let end = offset + 2 + usize::from(additional);
            if end > declared_end {
                return Err(overrun(offset));
            }
            let Some(body) = sense.get(offset..end) else {
                break; // Cut by the buffer: what came before stands.
            };
            repr.apply_descriptor(kind, additional, body)?;
            offset = end;
        }
        Ok(repr)
    }

    /// Folds one complete descriptor (`body` includes its 2-byte header).
    fn apply_descriptor(
        &mut self,
        kind: u8,
        additional: u8,
        body: &[u8],
    ) -> Result<(), SenseError> {
        let expected = match kind {
            desc::INFORMATION => desc::INFORMATION_LEN,
            desc::COMMAND_SPECIFIC => desc::COMMAND_SPECIFIC_LEN,
            desc::SENSE_KEY_SPECIFIC => desc::SENSE_KEY_SPECIFIC_LEN,
            desc::FRU => desc::FRU_LEN,
            desc::STREAM => desc::STREAM_LEN,
            desc::BLOCK => desc::BLOCK_LEN,
            _ => return Ok(()), // Not one a block device uses: skipped.
        };
        if additional != expected {
            return Err(SenseError::BadDescriptorLength {
                descriptor_type: kind,
                length: additional,
            });
        }
        let byte = |at: usize| body.get(at).copied().unwrap_or(0);
        match kind {
            desc::INFORMATION => {
                self.information = (byte(2) & 0x80 != 0).then(|| u64::read(body, 4));
            }
            desc::COMMAND_SPECIFIC => self.command_specific = Some(u64::read(body, 4)),
            desc::SENSE_KEY_SPECIFIC => {
                self.sense_key_specific =
                    (byte(4) & SKSV != 0).then_some([byte(4) & !SKSV, byte(5), byte(6)]);
            }
            desc::FRU => self.fru = byte(3),
            desc::STREAM => {
                self.filemark = byte(3) & 0x80 != 0;
                self.eom = byte(3) & 0x40 != 0;
                self.ili = byte(3) & 0x20 != 0;
            }
            _ => self.ili = byte(3) & 0x20 != 0,
        }
        Ok(())
    }

    /// Bytes [`Self::emit`] writes: 18 for fixed format; for descriptor
    /// format the header plus one descriptor per present field.
    pub const fn buffer_len(&self) -> usize {
        match self.format {
            SenseFormat::Fixed => fixed::LEN,
            SenseFormat::Descriptor => {
                let mut len = desc::HEADER_LEN;
                if self.information.is_some() {
                    len += 12;
                }
                if self.command_specific.is_some() {
                    len += 12;
                }
                if self.sense_key_specific.is_some() {
                    len += 8;
                }
                if self.fru != 0 {
                    len += 4;
                }
                if self.filemark || self.eom || self.ili {
                    len += 4;
                }
                len
            }
        }
    }

    /// Writes the sense in its format; returns the bytes written
    /// ([`Self::buffer_len`]).
    ///
    /// # Errors
    ///
    /// [`SenseError::BufferTooSmall`]; [`SenseError::NotRepresentable`] for
    /// fixed format with INFORMATION or COMMAND-SPECIFIC INFORMATION above
    /// 32 bits.
    pub fn emit(&self, out: &mut [u8]) -> Result<usize, SenseError> {
        let len = self.buffer_len();
        let out = out.get_mut(..len).ok_or(SenseError::BufferTooSmall)?;
        out.fill(0);
        match self.format {
            SenseFormat::Fixed => self.emit_fixed(out)?,
            SenseFormat::Descriptor => self.emit_descriptor(out),
        }
        Ok(len)
    }

    fn emit_fixed(&self, out: &mut [u8]) -> Result<(), SenseError> {
        let narrow = |value: Option<u64>| -> Result<u32, SenseError> {
            u32::try_from(value.unwrap_or(0)).map_err(|_| SenseError::NotRepresentable)
        };
        let information = narrow(self.information)?;
        let command_specific = narrow(self.command_specific)?;
        let mut view = FixedSense::new_unchecked(out);
        let code = if self.deferred {
            response_code::FIXED_DEFERRED
        } else {
            response_code::FIXED_CURRENT
        };
        let valid = if self.information.is_some() {
            fixed::VALID
        } else {
            0
        };
        view.set_response_byte(valid | code);
        let mut flags = self.key.code();
        for (set, bit) in [
            (self.filemark, fixed::FILEMARK),
            (self.eom, fixed::EOM),
            (self.ili, fixed::ILI),
            (self.overflow, fixed::SDAT_OVFL),
        ] {
            if set {
                flags |= bit;
            }
        }
        view.set_flags_key(flags);
        view.set_information(information);
        // CAST: fixed::LEN - 8 = 10.
        view.set_additional_len((fixed::LEN - fixed::ADDITIONAL_LEN.end) as u8);
        view.set_command_specific(command_specific);
        view.set_asc(self.code.asc);
        view.set_ascq(self.code.ascq);
        view.set_fru(self.fru);
        if let Some([first, hi, lo]) = self.sense_key_specific {
            view.set_sense_key_specific([first | SKSV, hi, lo]);
        }
        Ok(())
    }

    fn emit_descriptor(&self, out: &mut [u8]) {
        let code = if self.deferred {
            response_code::DESCRIPTOR_DEFERRED
        } else {
            response_code::DESCRIPTOR_CURRENT
        };
        let total = self.buffer_len();
        {
            let mut header = DescriptorSenseHeader::new_unchecked(&mut *out);
            header.set_response_byte(code);
            header.set_key_byte(self.key.code());
            header.set_asc(self.code.asc);
            header.set_ascq(self.code.ascq);
            header.set_flags(if self.overflow { desc::SDAT_OVFL } else { 0 });
            // CAST: at most 8 + 12 + 12 + 8 + 4 + 4 = 48 bytes in all.
            header.set_additional_len((total - desc::HEADER_LEN) as u8);
        }
        let mut at = desc::HEADER_LEN;
        let mut put = |descriptor: &[u8]| {
            bytes::write_bytes(out, at, descriptor);
            at += descriptor.len();
        };
        if let Some(information) = self.information {
            // Byte 2 bit 7: VALID.
            let mut d = [
                desc::INFORMATION,
                desc::INFORMATION_LEN,
                0x80,
                0,
                0,
                0,
                0,
                0,
                0,
                0,
                0,
                0,
            ];
            information.write(&mut d, 4);
            put(&d);
        }
        if let Some(command_specific) = self.command_specific {
            let mut d = [
                desc::COMMAND_SPECIFIC,
                desc::COMMAND_SPECIFIC_LEN,
                0,
                0,
                0,
                0,
                0,
                0,
                0,
                0,
                0,
                0,
            ];
            command_specific.write(&mut d, 4);
            put(&d);
        }
        if let Some([first, hi, lo]) = self.sense_key_specific {
            put(&[
                desc::SENSE_KEY_SPECIFIC,
                desc::SENSE_KEY_SPECIFIC_LEN,
                0,
                0,
                first | SKSV,
                hi,
                lo,
                0,
            ]);
        }
        if self.fru != 0 {
            put(&[desc::FRU, desc::FRU_LEN, 0, self.fru]);
        }
        if self.filemark || self.eom {
            let mut flags = 0;
            if self.filemark {
                flags |= 0x80;
            }
            if self.eom {
                flags |= 0x40;
            }
            if self.ili {
                flags |= 0x20;
            }
            put(&[desc::STREAM, desc::STREAM_LEN, 0, flags]);
        } else if self.ili {
            put(&[desc::BLOCK, desc::BLOCK_LEN, 0, 0x20]);
        }
    }
}

fn overrun(offset: usize) -> SenseError {
    SenseError::DescriptorOverrun {
        // CAST: offsets are below 8 + 255.
        offset: u16::try_from(offset).unwrap_or(u16::MAX),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn golden_fixed_invalid_opcode() {
        let sense = SenseRepr::new(
            SenseKey::IllegalRequest,
            AdditionalSense::INVALID_COMMAND_OPERATION_CODE,
        );
        let mut buf = [0xEEu8; 32];
        assert_eq!(sense.emit(&mut buf), Ok(18));
        assert_eq!(
            &buf[..18],
            &[
                0x70, 0x00, 0x05, 0x00, 0x00, 0x00, 0x00, 0x0A, 0x00, 0x00, 0x00, 0x00, 0x20, 0x00,
                0x00, 0x00, 0x00, 0x00
            ]
        );
        assert_eq!(buf[18], 0xEE, "emit wrote past buffer_len");
        assert_eq!(SenseRepr::parse(&buf[..18]), Ok(sense));
    }

    #[test]
    fn golden_fixed_field_pointer_and_information() {
        // INVALID FIELD IN CDB, pointing at byte 1 bit 4 of the CDB, with
        // INFORMATION 0x01020304.
        let sense = SenseRepr::new(
            SenseKey::IllegalRequest,
            AdditionalSense::INVALID_FIELD_IN_CDB,
        )
        .with_field_pointer(true, FieldPointer::bit(1, 4))
        .with_information(0x0102_0304);
        let mut buf = [0u8; 18];
        sense.emit(&mut buf).unwrap();
        assert_eq!(
            buf,
            [
                0xF0, 0x00, 0x05, 0x01, 0x02, 0x03, 0x04, 0x0A, 0x00, 0x00, 0x00, 0x00, 0x24, 0x00,
                0x00, 0xCC, 0x00, 0x01
            ]
        );
        let parsed = SenseRepr::parse(&buf).unwrap();
        assert_eq!(parsed, sense);
        assert_eq!(
            parsed.field_pointer(),
            Some((true, FieldPointer::bit(1, 4)))
        );
    }

    #[test]
    fn golden_descriptor() {
        let sense = SenseRepr::new(
            SenseKey::Miscompare,
            AdditionalSense::MISCOMPARE_DURING_VERIFY,
        )
        .with_information(0x1_0000_0200)
        .in_format(SenseFormat::Descriptor);
        let mut buf = [0u8; 20];
        assert_eq!(sense.emit(&mut buf), Ok(20));
        assert_eq!(
            buf,
            [
                0x72, 0x0E, 0x1D, 0x00, 0x00, 0x00, 0x00, 0x0C, // header
                0x00, 0x0A, 0x80, 0x00, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x02, 0x00,
            ]
        );
        assert_eq!(SenseRepr::parse(&buf), Ok(sense));
        // The same INFORMATION does not fit fixed format.
        let mut small = [0u8; 18];
        assert_eq!(
            sense.in_format(SenseFormat::Fixed).emit(&mut small),
            Err(SenseError::NotRepresentable)
        );
    }

    #[test]
    fn short_fixed_sense_reads_what_is_there() {
        // 8-byte fixed sense with an additional length of 0: key only.
        let short = [0x70, 0, 0x06, 0, 0, 0, 0, 0];
        let parsed = SenseRepr::parse(&short).unwrap();
        assert_eq!(parsed.key, SenseKey::UnitAttention);
        assert_eq!(parsed.code, AdditionalSense::NO_ADDITIONAL_SENSE);
        // The additional length limits what is read even if more bytes
        // follow: ASC 0x29 at byte 12 is beyond it.
        let mut limited = [0u8; 18];
        limited[0] = 0x70;
        limited[2] = 0x06;
        limited[7] = 4;
        limited[12] = 0x29;
        assert_eq!(SenseRepr::parse(&limited).unwrap().code.asc, 0);
        limited[7] = 6;
        assert_eq!(
            SenseRepr::parse(&limited).unwrap().code,
            AdditionalSense { asc: 0x29, ascq: 0 }
        );
        // VALID with the INFORMATION bytes cut off: no information.
        assert_eq!(
            SenseRepr::parse(&[0xF0, 0, 0x03, 0, 0])
                .unwrap()
                .information,
            None
        );
        assert_eq!(SenseRepr::parse(&[0x70, 0]), Err(SenseError::Truncated));
        assert_eq!(SenseRepr::parse(&[]), Err(SenseError::Empty));
        assert_eq!(
            SenseRepr::parse(&[0x7F, 0, 0, 0]),
            Err(SenseError::UnknownResponseCode(0x7F))
        );
        assert_eq!(
            SenseRepr::parse(&[0x00, 0, 0, 0]),
            Err(SenseError::UnknownResponseCode(0x00))
        );
    }

    #[test]
    fn descriptor_errors_and_truncation() {
        // Information descriptor with the wrong length.
        let bad_len = [0x72, 0x03, 0x11, 0x00, 0, 0, 0, 4, 0x00, 0x02, 0x80, 0];
        assert_eq!(
            SenseRepr::parse(&bad_len),
            Err(SenseError::BadDescriptorLength {
                descriptor_type: 0,
                length: 2
            })
        );
        // A descriptor longer than the additional length.
        let overrun_bytes = [
            0x72, 0x03, 0x11, 0x00, 0, 0, 0, 4, 0x05, 0x04, 0, 0x20, 0, 0,
        ];
        assert_eq!(
            SenseRepr::parse(&overrun_bytes),
            Err(SenseError::DescriptorOverrun { offset: 8 })
        );
        // One dangling byte inside the additional length.
        let dangling = [
            0x72, 0x03, 0x11, 0x00, 0, 0, 0, 5, 0x05, 0x02, 0, 0x20, 0x05,
        ];
        assert_eq!(
            SenseRepr::parse(&dangling),
            Err(SenseError::DescriptorOverrun { offset: 12 })
        );
        // The buffer cuts the second descriptor: the first one stands.
        let cut = [
            0x72, 0x03, 0x11, 0x00, 0, 0, 0, 16, 0x05, 0x02, 0, 0x20, 0x00, 0x0A, 0x80,
        ];
        let parsed = SenseRepr::parse(&cut).unwrap();
        assert!(parsed.ili);
        assert_eq!(parsed.information, None);
        assert_eq!(parsed.code, AdditionalSense::UNRECOVERED_READ_ERROR);
        // Unknown descriptor types are skipped.
        let vendor = [
            0x73, 0x04, 0x44, 0x00, 0, 0, 0, 7, 0x80, 0x01, 0xAA, 0x03, 0x02, 0, 7,
        ];
        let parsed = SenseRepr::parse(&vendor).unwrap();
        assert!(parsed.deferred);
        assert_eq!(parsed.fru, 7);
        // Header only, and less than a header.
        assert_eq!(
            SenseRepr::parse(&[0x72, 0x02, 0x04]).unwrap().key,
            SenseKey::NotReady
        );
        assert_eq!(SenseRepr::parse(&[0x72]), Err(SenseError::Truncated));
    }

    #[test]
    fn every_key_round_trips_through_its_nibble() {
        for nibble in 0..16u8 {
            assert_eq!(SenseKey::from_nibble(nibble).code(), nibble);
            assert_eq!(SenseKey::from_nibble(nibble | 0xF0).code(), nibble);
        }
    }

    #[test]
    fn descriptions() {
        assert_eq!(
            AdditionalSense::LBA_OUT_OF_RANGE.description(),
            Some("LOGICAL BLOCK ADDRESS OUT OF RANGE")
        );
        assert_eq!(AdditionalSense { asc: 0x99, ascq: 1 }.description(), None);
        assert_eq!(
            format!("{:?}", AdditionalSense::INVALID_FIELD_IN_CDB),
            "24/00 INVALID FIELD IN CDB"
        );
    }

    #[test]
    fn emit_refuses_short_buffers() {
        let sense = SenseRepr::new(SenseKey::NotReady, AdditionalSense::MEDIUM_NOT_PRESENT);
        assert_eq!(sense.emit(&mut [0u8; 17]), Err(SenseError::BufferTooSmall));
        let descriptor = sense.in_format(SenseFormat::Descriptor);
        assert_eq!(descriptor.buffer_len(), 8);
        assert_eq!(
            descriptor.emit(&mut [0u8; 7]),
            Err(SenseError::BufferTooSmall)
        );
    }
}
