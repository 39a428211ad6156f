//! iSCSI PDUs (RFC 7143) as they travel under iSER (RFC 7145): the 48-byte
//! basic header segment (BHS), optional additional header segments (AHS)
//! and the data segment.
//!
//! One module per PDU family. [`BhsRepr::parse`] dispatches over the opcode;
//! [`IscsiPdu::parse`] takes a whole PDU (BHS + AHS + data segment).
//!
//! Under iSER there are no digests and no padding on the wire (`ib_iser`
//! posts exactly `DataSegmentLength` bytes); over TCP the data segment is
//! padded to a 4-byte boundary. Parsing accepts either; emitting takes a
//! [`Padding`]. Data-In, R2T and solicited Data-Out do not travel under iSER
//! (the target moves data with RDMA), but they still parse, so a target that
//! sends one gets a defined outcome rather than a parse error.

use core::fmt;

use static_assertions::const_assert_eq;

use super::bytes::{self, read_be24, write_be24};

/// Declares a view over a BHS: the common fields (byte 0, byte 1,
/// TotalAHSLength, DataSegmentLength) plus the PDU's own.
macro_rules! bhs_view {
    (
        $(#[$meta:meta])*
        pub struct $name:ident;
        $($fields:tt)*
    ) => {
        wire_view! {
            $(#[$meta])*
            pub struct $name,
                min_len = $crate::wire::iscsi::BHS_LEN,
                error = $crate::wire::iscsi::Error,
                truncated = $crate::wire::iscsi::Error::Truncated;
            /// Raw byte 0: immediate bit (0x40) and opcode (low six bits).
            opcode_byte, set_opcode_byte: u8 = $crate::wire::iscsi::common::OPCODE;
            /// Raw byte 1: the PDU's flags.
            flags, set_flags: u8 = $crate::wire::iscsi::common::FLAGS;
            /// TotalAHSLength, in 4-byte words.
            total_ahs_len, set_total_ahs_len: u8 = $crate::wire::iscsi::common::TOTAL_AHS_LEN;
            $($fields)*
        }

        impl<T: AsRef<[u8]>> $name<T> {
            /// DataSegmentLength (24 bits), without padding.
            #[inline]
            pub fn data_segment_len(&self) -> u32 {
                $crate::wire::bytes::read_be24(
                    self.as_bytes(),
                    $crate::wire::iscsi::common::DATA_SEGMENT_LEN.start,
                )
            }

            /// The immediate-delivery bit of an initiator PDU.
            #[inline]
            pub fn immediate(&self) -> bool {
                self.opcode_byte() & $crate::wire::iscsi::IMMEDIATE_BIT != 0
            }

            /// The opcode (byte 0 without the immediate and reserved bits).
            #[inline]
            pub fn opcode_code(&self) -> u8 {
                self.opcode_byte() & $crate::wire::iscsi::OPCODE_MASK
            }
        }

        impl<T: AsRef<[u8]> + AsMut<[u8]>> $name<T> {
            /// Sets DataSegmentLength.
            ///
            /// # Errors
            ///
            /// [`Error::DataSegmentTooLong`](crate::wire::iscsi::Error) past
            /// 2^24 - 1 bytes.
            #[inline]
            pub fn set_data_segment_len(
                &mut self,
                len: u32,
            ) -> ::core::result::Result<(), $crate::wire::iscsi::Error> {
                if len > $crate::wire::iscsi::MAX_DATA_SEGMENT_LEN {
                    return Err($crate::wire::iscsi::Error::DataSegmentTooLong);
                }
                $crate::wire::bytes::write_be24(
                    self.as_bytes_mut(),
                    $crate::wire::iscsi::common::DATA_SEGMENT_LEN.start,
                    len,
                );
                Ok(())
            }
        }
    };
}

pub mod async_msg;
pub mod data;
pub mod login;
pub mod logout;
pub mod nop;
pub mod r2t;
pub mod reject;
pub mod scsi;
pub mod serial;
pub mod task_mgmt;
pub mod text;

pub use async_msg::{AsyncEvent, AsyncMessage, AsyncMessageRepr};
pub use data::{DataIn, DataInRepr, DataInStatus, DataOut, DataOutRepr};
pub use login::{LoginRequest, LoginRequestRepr, LoginResponse, LoginResponseRepr, LoginStage};
pub use logout::{LogoutReason, LogoutRequest, LogoutRequestRepr, LogoutResponse};
pub use logout::{LogoutResponseCode, LogoutResponseRepr};
pub use nop::{NopIn, NopInRepr, NopOut, NopOutRepr};
pub use r2t::{R2t, R2tRepr};
pub use reject::{Reject, RejectReason, RejectRepr};
pub use scsi::{ScsiCommand, ScsiCommandRepr, ScsiResponse, ScsiResponseRepr, SenseData, TaskAttr};
pub use serial::{SerialNumber, command_window};
pub use task_mgmt::{TaskMgmtFunction, TaskMgmtRequest, TaskMgmtRequestRepr};
pub use task_mgmt::{TaskMgmtResponse, TaskMgmtResponseCode, TaskMgmtResponseRepr};
pub use text::{TextRequest, TextRequestRepr, TextResponse, TextResponseRepr};

/// Size of the basic header segment.
pub const BHS_LEN: usize = 48;
/// Largest DataSegmentLength the 24-bit field can carry.
pub const MAX_DATA_SEGMENT_LEN: u32 = 0x00FF_FFFF;
/// Largest AHS: TotalAHSLength is a byte counting 4-byte words.
pub const MAX_AHS_LEN: usize = 255 * 4;
/// The reserved tag (ITT or TTT) that means "none".
pub const RESERVED_TAG: u32 = 0xFFFF_FFFF;

pub(crate) const IMMEDIATE_BIT: u8 = 0x40;
pub(crate) const OPCODE_MASK: u8 = 0x3F;

/// Fields every BHS has at the same place.
pub(crate) mod common {
    use crate::wire::Field;

    pub const OPCODE: Field = 0..1;
    pub const FLAGS: Field = 1..2;
    pub const TOTAL_AHS_LEN: Field = 4..5;
    pub const DATA_SEGMENT_LEN: Field = 5..8;
    pub const LUN: Field = 8..16;
    pub const ITT: Field = 16..20;
    pub const END: usize = 48;
}

const_assert_eq!(common::END, BHS_LEN);

/// The F (final) bit shared by most PDUs' flags byte.
pub(crate) const FINAL: u8 = 0x80;

/// An iSCSI opcode (byte 0, low six bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Opcode {
    /// NOP-Out, initiator.
    NopOut = 0x00,
    /// SCSI Command, initiator.
    ScsiCommand = 0x01,
    /// SCSI Task Management Function Request, initiator.
    TaskMgmtRequest = 0x02,
    /// Login Request, initiator.
    LoginRequest = 0x03,
    /// Text Request, initiator.
    TextRequest = 0x04,
    /// SCSI Data-Out, initiator.
    DataOut = 0x05,
    /// Logout Request, initiator.
    LogoutRequest = 0x06,
    /// SNACK Request, initiator (error recovery levels > 0 only).
    Snack = 0x10,
    /// NOP-In, target.
    NopIn = 0x20,
    /// SCSI Response, target.
    ScsiResponse = 0x21,
    /// SCSI Task Management Function Response, target.
    TaskMgmtResponse = 0x22,
    /// Login Response, target.
    LoginResponse = 0x23,
    /// Text Response, target.
    TextResponse = 0x24,
    /// SCSI Data-In, target.
    DataIn = 0x25,
    /// Logout Response, target.
    LogoutResponse = 0x26,
    /// Ready To Transfer, target.
    R2t = 0x31,
    /// Asynchronous Message, target.
    AsyncMessage = 0x32,
    /// Reject, target.
    Reject = 0x3F,
}

impl Opcode {
    /// The opcode for the low six bits of byte 0, `None` for codes RFC 7143
    /// does not define (including the vendor-specific 0x1c..=0x1f and
    /// 0x3c..=0x3e).
    pub const fn from_code(code: u8) -> Option<Self> {
        Some(match code & OPCODE_MASK {
            0x00 => Self::NopOut,
            0x01 => Self::ScsiCommand,
            0x02 => Self::TaskMgmtRequest,
            0x03 => Self::LoginRequest,
            0x04 => Self::TextRequest,
            0x05 => Self::DataOut,
            0x06 => Self::LogoutRequest,
            0x10 => Self::Snack,
            0x20 => Self::NopIn,
            0x21 => Self::ScsiResponse,
            0x22 => Self::TaskMgmtResponse,
            0x23 => Self::LoginResponse,
            0x24 => Self::TextResponse,
            0x25 => Self::DataIn,
            0x26 => Self::LogoutResponse,
            0x31 => Self::R2t,
            0x32 => Self::AsyncMessage,
            0x3F => Self::Reject,
            _ => return None,
        })
    }

    /// The six-bit code.
    pub const fn code(self) -> u8 {
        self as u8
    }
}

/// Why an iSCSI PDU or iSER header could not be parsed or emitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Error {
    /// The buffer is shorter than the fixed header.
    Truncated,
    /// The opcode is not one RFC 7143 defines.
    UnknownOpcode(u8),
    /// The opcode is defined but has no representation here (SNACK, used
    /// only at error recovery levels above 0, which this initiator never
    /// negotiates).
    UnsupportedOpcode(u8),
    /// The opcode is not the one of the PDU being parsed.
    WrongOpcode(u8),
    /// A login stage field holds the reserved value 2.
    ReservedStage,
    /// A Login PDU has both the Transit and the Continue bit set.
    TransitAndContinue,
    /// A Text PDU has both the Final and the Continue bit set.
    FinalAndContinue,
    /// Both an overflow and an underflow bit are set.
    ConflictingResidualFlags,
    /// A Data-In PDU carries status (S bit) without the Final bit.
    StatusWithoutFinal,
    /// The AHS extends past the end of the buffer, or an AHS entry past the
    /// end of the AHS.
    AhsOutOfBounds,
    /// The data segment extends past the end of the buffer.
    DataSegmentOutOfBounds,
    /// Bytes follow the (padded) data segment.
    TrailingBytes,
    /// A sense length extends past the data segment.
    SenseOutOfBounds,
    /// `emit`: the data segment is longer than 2^24 - 1 bytes.
    DataSegmentTooLong,
    /// `emit`: the AHS is longer than 1020 bytes or not a multiple of 4.
    BadAhsLength,
    /// `emit`: the buffer is too small.
    BufferTooSmall,
    /// The iSER header's opcode nibble is not control, Hello or HelloReply.
    UnknownIserOpcode(u8),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Truncated => f.write_str("iSCSI header truncated"),
            Self::UnknownOpcode(op) => write!(f, "unknown iSCSI opcode {op:#04x}"),
            Self::UnsupportedOpcode(op) => write!(f, "unsupported iSCSI opcode {op:#04x}"),
            Self::WrongOpcode(op) => write!(f, "unexpected iSCSI opcode {op:#04x}"),
            Self::ReservedStage => f.write_str("reserved login stage"),
            Self::TransitAndContinue => f.write_str("login with both T and C set"),
            Self::FinalAndContinue => f.write_str("text with both F and C set"),
            Self::ConflictingResidualFlags => f.write_str("both overflow and underflow set"),
            Self::StatusWithoutFinal => f.write_str("Data-In status without the final bit"),
            Self::AhsOutOfBounds => f.write_str("AHS outside the PDU"),
            Self::DataSegmentOutOfBounds => f.write_str("data segment outside the PDU"),
            Self::TrailingBytes => f.write_str("bytes after the data segment"),
            Self::SenseOutOfBounds => f.write_str("sense data outside the data segment"),
            Self::DataSegmentTooLong => f.write_str("data segment longer than 2^24 - 1"),
            Self::BadAhsLength => f.write_str("AHS length not a word multiple up to 1020"),
            Self::BufferTooSmall => f.write_str("buffer too small for the PDU"),
            Self::UnknownIserOpcode(op) => write!(f, "unknown iSER opcode {op:#x}"),
        }
    }
}

/// Result of iSCSI and iSER parsing and emission.
pub type Result<T> = core::result::Result<T, Error>;

bhs_view! {
    /// A view of any BHS: the fields every PDU has at the same place.
    pub struct Bhs;
    /// Bytes 8..16: the LUN, or opcode-specific fields.
    lun_or_specific, set_lun_or_specific: [u8; 8] = common::LUN;
    /// Initiator task tag (the reserved tag in Async Message and Reject).
    itt, set_itt: u32 = common::ITT;
}

impl<T: AsRef<[u8]>> Bhs<T> {
    /// The opcode.
    ///
    /// # Errors
    ///
    /// [`Error::UnknownOpcode`].
    pub fn opcode(&self) -> Result<Opcode> {
        let code = self.opcode_code();
        Opcode::from_code(code).ok_or(Error::UnknownOpcode(code))
    }

    /// Bytes of AHS that follow the BHS.
    pub fn ahs_len(&self) -> usize {
        usize::from(self.total_ahs_len()) * 4
    }

    /// Bytes of the whole PDU: BHS, AHS and data segment, padded to a word
    /// if `padding` says so.
    pub fn pdu_len(&self, padding: Padding) -> usize {
        BHS_LEN + self.ahs_len() + padding.apply(self.data_segment_len() as usize)
    }
}

/// Whether a data segment is padded to a 4-byte boundary on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Padding {
    /// No padding: what iSER sends.
    #[default]
    None,
    /// Padding to 4 bytes: what iSCSI over TCP sends.
    ToWord,
}

impl Padding {
    /// The padded length of a `len`-byte segment.
    pub const fn apply(self, len: usize) -> usize {
        match self {
            Self::None => len,
            Self::ToWord => pad4(len),
        }
    }
}

/// `len` rounded up to a multiple of 4 (iSCSI's `ISCSI_PAD_LEN`).
pub const fn pad4(len: usize) -> usize {
    len.saturating_add(3) & !3
}

/// Any basic header segment, parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BhsRepr {
    /// NOP-Out.
    NopOut(NopOutRepr),
    /// SCSI Command.
    ScsiCommand(ScsiCommandRepr),
    /// Task Management Function Request.
    TaskMgmtRequest(TaskMgmtRequestRepr),
    /// Login Request.
    LoginRequest(LoginRequestRepr),
    /// Text Request.
    TextRequest(TextRequestRepr),
    /// SCSI Data-Out.
    DataOut(DataOutRepr),
    /// Logout Request.
    LogoutRequest(LogoutRequestRepr),
    /// NOP-In.
    NopIn(NopInRepr),
    /// SCSI Response.
    ScsiResponse(ScsiResponseRepr),
    /// Task Management Function Response.
    TaskMgmtResponse(TaskMgmtResponseRepr),
    /// Login Response.
    LoginResponse(LoginResponseRepr),
    /// Text Response.
    TextResponse(TextResponseRepr),
    /// SCSI Data-In.
    DataIn(DataInRepr),
    /// Logout Response.
    LogoutResponse(LogoutResponseRepr),
    /// Ready To Transfer.
    R2t(R2tRepr),
    /// Asynchronous Message.
    AsyncMessage(AsyncMessageRepr),
    /// Reject.
    Reject(RejectRepr),
}

impl BhsRepr {
    /// Parses a BHS by its opcode.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`], [`Error::UnknownOpcode`],
    /// [`Error::UnsupportedOpcode`], and each PDU's own errors.
    pub fn parse<T: AsRef<[u8]>>(bhs: &Bhs<T>) -> Result<Self> {
        bhs.check_len()?;
        let buf = bhs.as_bytes();
        Ok(match bhs.opcode()? {
            Opcode::NopOut => Self::NopOut(NopOutRepr::parse(&NopOut::new_unchecked(buf))?),
            Opcode::ScsiCommand => {
                Self::ScsiCommand(ScsiCommandRepr::parse(&ScsiCommand::new_unchecked(buf))?)
            }
            Opcode::TaskMgmtRequest => Self::TaskMgmtRequest(TaskMgmtRequestRepr::parse(
                &TaskMgmtRequest::new_unchecked(buf),
            )?),
            Opcode::LoginRequest => {
                Self::LoginRequest(LoginRequestRepr::parse(&LoginRequest::new_unchecked(buf))?)
            }
            Opcode::TextRequest => {
                Self::TextRequest(TextRequestRepr::parse(&TextRequest::new_unchecked(buf))?)
            }
            Opcode::DataOut => Self::DataOut(DataOutRepr::parse(&DataOut::new_unchecked(buf))?),
            Opcode::LogoutRequest => Self::LogoutRequest(LogoutRequestRepr::parse(
                &LogoutRequest::new_unchecked(buf),
            )?),
            Opcode::Snack => return Err(Error::UnsupportedOpcode(Opcode::Snack.code())),
            Opcode::NopIn => Self::NopIn(NopInRepr::parse(&NopIn::new_unchecked(buf))?),
            Opcode::ScsiResponse => {
                Self::ScsiResponse(ScsiResponseRepr::parse(&ScsiResponse::new_unchecked(buf))?)
            }
            Opcode::TaskMgmtResponse => Self::TaskMgmtResponse(TaskMgmtResponseRepr::parse(
                &TaskMgmtResponse::new_unchecked(buf),
            )?),
            Opcode::LoginResponse => Self::LoginResponse(LoginResponseRepr::parse(
                &LoginResponse::new_unchecked(buf),
            )?),
            Opcode::TextResponse => {
                Self::TextResponse(TextResponseRepr::parse(&TextResponse::new_unchecked(buf))?)
            }
            Opcode::DataIn => Self::DataIn(DataInRepr::parse(&DataIn::new_unchecked(buf))?),
            Opcode::LogoutResponse => Self::LogoutResponse(LogoutResponseRepr::parse(
                &LogoutResponse::new_unchecked(buf),
            )?),
            Opcode::R2t => Self::R2t(R2tRepr::parse(&R2t::new_unchecked(buf))?),
            Opcode::AsyncMessage => {
                Self::AsyncMessage(AsyncMessageRepr::parse(&AsyncMessage::new_unchecked(buf))?)
            }
            Opcode::Reject => Self::Reject(RejectRepr::parse(&Reject::new_unchecked(buf))?),
        })
    }

    /// The opcode.
    pub const fn opcode(&self) -> Opcode {
        match self {
            Self::NopOut(_) => Opcode::NopOut,
            Self::ScsiCommand(_) => Opcode::ScsiCommand,
            Self::TaskMgmtRequest(_) => Opcode::TaskMgmtRequest,
            Self::LoginRequest(_) => Opcode::LoginRequest,
            Self::TextRequest(_) => Opcode::TextRequest,
            Self::DataOut(_) => Opcode::DataOut,
            Self::LogoutRequest(_) => Opcode::LogoutRequest,
            Self::NopIn(_) => Opcode::NopIn,
            Self::ScsiResponse(_) => Opcode::ScsiResponse,
            Self::TaskMgmtResponse(_) => Opcode::TaskMgmtResponse,
            Self::LoginResponse(_) => Opcode::LoginResponse,
            Self::TextResponse(_) => Opcode::TextResponse,
            Self::DataIn(_) => Opcode::DataIn,
            Self::LogoutResponse(_) => Opcode::LogoutResponse,
            Self::R2t(_) => Opcode::R2t,
            Self::AsyncMessage(_) => Opcode::AsyncMessage,
            Self::Reject(_) => Opcode::Reject,
        }
    }

    /// Writes the BHS into the first 48 bytes of `buf`, with TotalAHSLength
    /// and DataSegmentLength zero (see [`IscsiPdu::emit`] for a whole PDU).
    ///
    /// # Errors
    ///
    /// [`Error::BufferTooSmall`].
    pub fn emit(&self, buf: &mut [u8]) -> Result<()> {
        match self {
            Self::NopOut(r) => r.emit(&mut NopOut::new_unchecked(buf)),
            Self::ScsiCommand(r) => r.emit(&mut ScsiCommand::new_unchecked(buf)),
            Self::TaskMgmtRequest(r) => r.emit(&mut TaskMgmtRequest::new_unchecked(buf)),
            Self::LoginRequest(r) => r.emit(&mut LoginRequest::new_unchecked(buf)),
            Self::TextRequest(r) => r.emit(&mut TextRequest::new_unchecked(buf)),
            Self::DataOut(r) => r.emit(&mut DataOut::new_unchecked(buf)),
            Self::LogoutRequest(r) => r.emit(&mut LogoutRequest::new_unchecked(buf)),
            Self::NopIn(r) => r.emit(&mut NopIn::new_unchecked(buf)),
            Self::ScsiResponse(r) => r.emit(&mut ScsiResponse::new_unchecked(buf)),
            Self::TaskMgmtResponse(r) => r.emit(&mut TaskMgmtResponse::new_unchecked(buf)),
            Self::LoginResponse(r) => r.emit(&mut LoginResponse::new_unchecked(buf)),
            Self::TextResponse(r) => r.emit(&mut TextResponse::new_unchecked(buf)),
            Self::DataIn(r) => r.emit(&mut DataIn::new_unchecked(buf)),
            Self::LogoutResponse(r) => r.emit(&mut LogoutResponse::new_unchecked(buf)),
            Self::R2t(r) => r.emit(&mut R2t::new_unchecked(buf)),
            Self::AsyncMessage(r) => r.emit(&mut AsyncMessage::new_unchecked(buf)),
            Self::Reject(r) => r.emit(&mut Reject::new_unchecked(buf)),
        }
    }
}

/// A whole PDU: header, AHS and data segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IscsiPdu<'a> {
    /// The basic header segment.
    pub header: BhsRepr,
    /// The additional header segments (a multiple of 4 bytes; see
    /// [`AhsIter`]).
    pub ahs: &'a [u8],
    /// The data segment, without padding.
    pub data: &'a [u8],
}

impl<'a> IscsiPdu<'a> {
    /// Parses a whole PDU. The data segment may be followed by up to its
    /// padding (whatever the padding bytes hold), nothing more.
    ///
    /// # Errors
    ///
    /// [`BhsRepr::parse`]'s errors, [`Error::AhsOutOfBounds`],
    /// [`Error::DataSegmentOutOfBounds`], [`Error::TrailingBytes`].
    pub fn parse(buf: &'a [u8]) -> Result<Self> {
        let bhs = Bhs::new_checked(buf)?;
        let header = BhsRepr::parse(&bhs)?;
        let ahs = bytes::sub(buf, BHS_LEN, bhs.ahs_len()).ok_or(Error::AhsOutOfBounds)?;
        let data_start = BHS_LEN + ahs.len();
        let data_len = bhs.data_segment_len() as usize;
        let data = bytes::sub(buf, data_start, data_len).ok_or(Error::DataSegmentOutOfBounds)?;
        if buf.len() > data_start + pad4(data_len) {
            return Err(Error::TrailingBytes);
        }
        Ok(Self { header, ahs, data })
    }

    /// Bytes [`Self::emit`] writes.
    pub const fn buffer_len(&self, padding: Padding) -> usize {
        BHS_LEN + self.ahs.len() + padding.apply(self.data.len())
    }

    /// Writes the whole PDU (padding bytes zero) and returns its length.
    ///
    /// # Errors
    ///
    /// [`Error::BadAhsLength`], [`Error::DataSegmentTooLong`],
    /// [`Error::BufferTooSmall`].
    pub fn emit(&self, buf: &mut [u8], padding: Padding) -> Result<usize> {
        if self.ahs.len() % 4 != 0 || self.ahs.len() > MAX_AHS_LEN {
            return Err(Error::BadAhsLength);
        }
        let data_len = u32::try_from(self.data.len())
            .ok()
            .filter(|&len| len <= MAX_DATA_SEGMENT_LEN)
            .ok_or(Error::DataSegmentTooLong)?;
        let total = self.buffer_len(padding);
        let out = buf.get_mut(..total).ok_or(Error::BufferTooSmall)?;
        self.header.emit(out)?;
        let mut bhs = Bhs::new_unchecked(&mut *out);
        // The length check above keeps the word count within a byte.
        bhs.set_total_ahs_len((self.ahs.len() / 4) as u8);
        bhs.set_data_segment_len(data_len)?;
        bytes::write_bytes(out, BHS_LEN, self.ahs);
        let data_start = BHS_LEN + self.ahs.len();
        bytes::write_bytes(out, data_start, self.data);
        bytes::zero(out, data_start + self.data.len(), total);
        Ok(total)
    }
}

/// One additional header segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ahs<'a> {
    /// AHSType: 1 extended CDB, 2 bidirectional expected read length.
    pub ahs_type: u8,
    /// The AHS-specific bytes (`AHSLength` of them, without padding).
    pub specific: &'a [u8],
}

/// AHSType of an extended-CDB AHS.
pub const AHS_EXTENDED_CDB: u8 = 1;
/// AHSType of a bidirectional expected read-data length AHS.
pub const AHS_BIDI_READ_LENGTH: u8 = 2;

/// Iterates the AHS entries of a PDU: each is a 2-byte length, a type byte
/// and `length` specific bytes, padded to 4.
#[derive(Debug, Clone)]
pub struct AhsIter<'a> {
    rest: &'a [u8],
}

impl<'a> AhsIter<'a> {
    /// Iterates over `ahs` (an [`IscsiPdu::ahs`]).
    pub const fn new(ahs: &'a [u8]) -> Self {
        Self { rest: ahs }
    }
}

impl<'a> Iterator for AhsIter<'a> {
    type Item = Result<Ahs<'a>>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.is_empty() {
            return None;
        }
        let len = usize::from(u16::from_be_bytes(bytes::read_array(self.rest, 0)));
        let entry = (|| {
            let header = bytes::sub(self.rest, 0, 3)?;
            let specific = bytes::sub(self.rest, 3, len)?;
            let consumed = pad4(3 + len).min(self.rest.len());
            Some((header, specific, consumed))
        })();
        match entry {
            Some((header, specific, consumed)) => {
                let ahs_type = header.get(2).copied().unwrap_or(0);
                self.rest = self.rest.get(consumed..).unwrap_or(&[]);
                Some(Ok(Ahs { ahs_type, specific }))
            }
            None => {
                self.rest = &[];
                Some(Err(Error::AhsOutOfBounds))
            }
        }
    }
}

/// Reads the 24-bit DataSegmentLength of a BHS held in `buf`.
pub fn data_segment_len(buf: &[u8]) -> u32 {
    read_be24(buf, common::DATA_SEGMENT_LEN.start)
}

/// Writes the 24-bit DataSegmentLength of a BHS held in `buf`.
///
/// # Errors
///
/// [`Error::DataSegmentTooLong`], [`Error::Truncated`].
pub fn set_data_segment_len(buf: &mut [u8], len: u32) -> Result<()> {
    if len > MAX_DATA_SEGMENT_LEN {
        return Err(Error::DataSegmentTooLong);
    }
    if buf.len() < BHS_LEN {
        return Err(Error::Truncated);
    }
    write_be24(buf, common::DATA_SEGMENT_LEN.start, len);
    Ok(())
}

/// Zeroes the BHS part of `buf` and writes the opcode byte: what every
/// PDU's `emit` starts with.
pub(crate) fn start_emit(buf: &mut [u8], opcode: Opcode, immediate: bool) -> Result<()> {
    if buf.len() < BHS_LEN {
        return Err(Error::BufferTooSmall);
    }
    bytes::zero(buf, 0, BHS_LEN);
    let byte = opcode.code() | if immediate { IMMEDIATE_BIT } else { 0 };
    bytes::write_bytes(buf, common::OPCODE.start, &[byte]);
    Ok(())
}

/// Checks the opcode of a BHS about to be parsed as `expected`.
pub(crate) fn expect_opcode(code: u8, expected: Opcode) -> Result<()> {
    if code == expected.code() {
        Ok(())
    } else {
        Err(Error::WrongOpcode(code))
    }
}

#[cfg(test)]
mod tests;
