//! SCSI RDMA Protocol information units (T10 SRP r16a, plus the SRP-2
//! immediate-data additions Linux implements).
//!
//! One module per IU. [`SrpIu::parse`] dispatches over the opcode byte of an
//! IU received on the RC queue pair (or carried as IB CM private data); the
//! RDMA/CM form of the login request, whose opcode sits at byte 11, is parsed
//! with [`LoginReqRepr::parse_rdma`].
//!
//! All multi-byte fields are big-endian. The 64-bit `tag` is opaque to the
//! target and echoed back, so it is read and written big-endian like every
//! other field; only its byte pattern matters.

use core::fmt;

use bitflags::bitflags;

use super::bytes::FieldCodec;

pub mod aer;
pub mod cmd;
pub mod cred;
pub mod desc;
pub mod i_logout;
pub mod login_rej;
pub mod login_req;
pub mod login_rsp;
pub mod rsp;
pub mod t_logout;
pub mod tsk_mgmt;

pub use super::Residual;
pub use aer::{AerReq, AerReqRepr, AerRsp, AerRspRepr};
pub use cmd::{Cmd, CmdRepr, DataIn, DataOut, TaskAttr};
pub use cred::{CredReq, CredReqRepr, CredRsp, CredRspRepr};
pub use desc::{DescFormat, DescList, DirectBuf, DirectDesc, ImmBuf, IndirectBuf, IndirectDesc};
pub use i_logout::{ILogout, ILogoutRepr};
pub use login_rej::{LoginRej, LoginRejRepr, RejectReason};
pub use login_req::{LoginReq, LoginReqRdma, LoginReqRepr, LoginSolNot, MultiChannelAction};
pub use login_rsp::{LoginRsp, LoginRspRepr, MultiChannelResult};
pub use rsp::{Rsp, RspRepr, TmResponse};
pub use t_logout::{TLogout, TLogoutRepr};
pub use tsk_mgmt::{TaskMgmtFunction, TskMgmt, TskMgmtRepr};

/// An SRP IU type, the first byte of every IU (of the RDMA/CM login request,
/// byte 11).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Opcode {
    /// `SRP_LOGIN_REQ`, initiator to target.
    LoginReq = 0x00,
    /// `SRP_TSK_MGMT`, initiator to target.
    TskMgmt = 0x01,
    /// `SRP_CMD`, initiator to target.
    Cmd = 0x02,
    /// `SRP_I_LOGOUT`, initiator to target.
    ILogout = 0x03,
    /// `SRP_LOGIN_RSP`, target to initiator.
    LoginRsp = 0xC0,
    /// `SRP_RSP`, target to initiator.
    Rsp = 0xC1,
    /// `SRP_LOGIN_REJ`, target to initiator.
    LoginRej = 0xC2,
    /// `SRP_T_LOGOUT`, target to initiator.
    TLogout = 0x80,
    /// `SRP_CRED_REQ`, target to initiator.
    CredReq = 0x81,
    /// `SRP_AER_REQ`, target to initiator.
    AerReq = 0x82,
    /// `SRP_CRED_RSP`, initiator to target.
    CredRsp = 0x41,
    /// `SRP_AER_RSP`, initiator to target.
    AerRsp = 0x42,
}

impl Opcode {
    /// The IU type byte.
    pub const fn to_u8(self) -> u8 {
        self as u8
    }

    /// The opcode for an IU type byte, `None` for a byte SRP does not define.
    pub const fn from_u8(byte: u8) -> Option<Self> {
        Some(match byte {
            0x00 => Self::LoginReq,
            0x01 => Self::TskMgmt,
            0x02 => Self::Cmd,
            0x03 => Self::ILogout,
            0xC0 => Self::LoginRsp,
            0xC1 => Self::Rsp,
            0xC2 => Self::LoginRej,
            0x80 => Self::TLogout,
            0x81 => Self::CredReq,
            0x82 => Self::AerReq,
            0x41 => Self::CredRsp,
            0x42 => Self::AerRsp,
            _ => return None,
        })
    }
}

/// Why an SRP IU could not be parsed or emitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Error {
    /// The buffer is shorter than the IU's fixed part.
    Truncated,
    /// The IU type byte is not the one of the IU being parsed.
    WrongOpcode(u8),
    /// The IU type byte names no SRP IU.
    UnknownOpcode(u8),
    /// A buffer-format nibble holds a reserved descriptor format (4..=15).
    ReservedDescFormat(u8),
    /// The DATA-IN nibble says "immediate", which SRP allows only for
    /// DATA-OUT.
    ImmediateDataIn,
    /// A data buffer descriptor lies partly or wholly outside the IU.
    DescriptorOutOfBounds,
    /// An indirect descriptor's table length is not a multiple of 16.
    IndirectTableMisaligned,
    /// The IU carries more inline descriptors than its indirect table holds.
    IndirectCountMismatch,
    /// The indirect table holds descriptors the IU does not carry inline
    /// (`table_desc.len / 16` exceeds `data_out_desc_cnt + data_in_desc_cnt`):
    /// they would have to be fetched from initiator memory, which this
    /// implementation, like Linux `ib_srpt`, does not do.
    ExternalIndirectTable,
    /// The indirect descriptor's total length is not the sum of its
    /// descriptors' lengths.
    IndirectLengthMismatch,
    /// An IU uses immediate data but the channel did not negotiate it.
    ImmediateNotNegotiated,
    /// The immediate-data offset lies inside the IU header or descriptors.
    ImmediateOffsetOverlap,
    /// The immediate data extends past the end of the IU.
    ImmediateDataOutOfBounds,
    /// The response data extends past the end of the IU.
    ResponseDataOutOfBounds,
    /// The sense data extends past the end of the IU.
    SenseDataOutOfBounds,
    /// A length or residual count is non-zero while the flag that makes it
    /// valid is clear.
    LengthWithoutFlag,
    /// Both the overflow and the underflow flag are set for one direction.
    ConflictingResidualFlags,
    /// A login multichannel action or result uses a reserved code.
    ReservedMultiChannel(u8),
    /// `emit`: the buffer is shorter than `buffer_len()`.
    BufferTooSmall,
    /// `emit`: the CDB is longer than 16 + 252 bytes.
    CdbTooLong,
    /// `emit`: more than 255 descriptors for one direction.
    TooManyDescriptors,
    /// `emit`: a length does not fit its 32-bit field.
    LengthOverflow,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Truncated => f.write_str("SRP IU truncated"),
            Self::WrongOpcode(op) => write!(f, "unexpected SRP IU type {op:#04x}"),
            Self::UnknownOpcode(op) => write!(f, "unknown SRP IU type {op:#04x}"),
            Self::ReservedDescFormat(fmt) => write!(f, "reserved descriptor format {fmt}"),
            Self::ImmediateDataIn => f.write_str("immediate descriptor format for DATA-IN"),
            Self::DescriptorOutOfBounds => f.write_str("data descriptor outside the IU"),
            Self::IndirectTableMisaligned => {
                f.write_str("indirect table length not a multiple of 16")
            }
            Self::IndirectCountMismatch => {
                f.write_str("more inline descriptors than the indirect table holds")
            }
            Self::ExternalIndirectTable => f.write_str("indirect table not carried inline"),
            Self::IndirectLengthMismatch => {
                f.write_str("indirect total length differs from the descriptor sum")
            }
            Self::ImmediateNotNegotiated => f.write_str("immediate data not negotiated"),
            Self::ImmediateOffsetOverlap => {
                f.write_str("immediate data offset overlaps the descriptors")
            }
            Self::ImmediateDataOutOfBounds => f.write_str("immediate data outside the IU"),
            Self::ResponseDataOutOfBounds => f.write_str("response data outside the IU"),
            Self::SenseDataOutOfBounds => f.write_str("sense data outside the IU"),
            Self::LengthWithoutFlag => f.write_str("length set without its valid flag"),
            Self::ConflictingResidualFlags => f.write_str("both overflow and underflow set"),
            Self::ReservedMultiChannel(code) => write!(f, "reserved multichannel code {code}"),
            Self::BufferTooSmall => f.write_str("buffer too small for the IU"),
            Self::CdbTooLong => f.write_str("CDB longer than 268 bytes"),
            Self::TooManyDescriptors => f.write_str("more than 255 descriptors"),
            Self::LengthOverflow => f.write_str("length does not fit 32 bits"),
        }
    }
}

/// Result of SRP parsing and emission.
pub type Result<T> = core::result::Result<T, Error>;

/// An SRP port identifier: 16 bytes, `id_ext || guid` in SRP r16a order
/// (r10, `SRP_REV10_IB_IO_CLASS`, swapped the halves).
///
/// Linux `ib_srpt` requires both halves of the target port id to be its
/// service GUID; `ib_srp` sends `initiator_ext || port GUID` as the
/// initiator port id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct PortId {
    /// Identifier extension, the first 8 bytes.
    pub id_ext: u64,
    /// GUID, the last 8 bytes.
    pub guid: u64,
}

impl PortId {
    /// The 16 wire bytes.
    pub const fn to_bytes(self) -> [u8; 16] {
        let e = self.id_ext.to_be_bytes();
        let g = self.guid.to_be_bytes();
        [
            e[0], e[1], e[2], e[3], e[4], e[5], e[6], e[7], g[0], g[1], g[2], g[3], g[4], g[5],
            g[6], g[7],
        ]
    }

    /// Reads the 16 wire bytes.
    pub const fn from_bytes(b: [u8; 16]) -> Self {
        Self {
            id_ext: u64::from_be_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]),
            guid: u64::from_be_bytes([b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]]),
        }
    }
}

impl FieldCodec for PortId {
    const SIZE: usize = 16;
    fn read(buf: &[u8], at: usize) -> Self {
        Self::from_bytes(super::bytes::read_array(buf, at))
    }
    fn write(self, buf: &mut [u8], at: usize) {
        super::bytes::write_bytes(buf, at, &self.to_bytes());
    }
}

bitflags! {
    /// Supported data buffer descriptor formats, the 16-bit `req_buf_fmt` /
    /// `buf_fmt` of the login IUs.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct BufFormats: u16 {
        /// `SRP_BUF_FORMAT_DIRECT`: direct data buffer descriptors.
        const DIRECT = 1 << 1;
        /// `SRP_BUF_FORMAT_INDIRECT`: indirect data buffer descriptors.
        const INDIRECT = 1 << 2;
    }
}

impl FieldCodec for BufFormats {
    const SIZE: usize = 2;
    fn read(buf: &[u8], at: usize) -> Self {
        // Reserved bits are ignored on receipt and never sent.
        Self::from_bits_truncate(u16::read(buf, at))
    }
    fn write(self, buf: &mut [u8], at: usize) {
        self.bits().write(buf, at);
    }
}

bitflags! {
    /// Solicited-notification bits of `SRP_CMD` and `SRP_TSK_MGMT`: which
    /// responses the target sends with the solicited-event bit.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct SolNot: u8 {
        /// `SCSOLNT`: solicit on a successful completion.
        const SUCCESSFUL = 0x02;
        /// `UCSOLNT`: solicit on an unsuccessful completion.
        const UNSUCCESSFUL = 0x04;
    }
}

impl FieldCodec for SolNot {
    const SIZE: usize = 1;
    fn read(buf: &[u8], at: usize) -> Self {
        Self::from_bits_truncate(u8::read(buf, at))
    }
    fn write(self, buf: &mut [u8], at: usize) {
        self.bits().write(buf, at);
    }
}

/// The `SOLNT` bit of target-originated IUs (`SRP_RSP`, `SRP_T_LOGOUT`,
/// `SRP_CRED_REQ`, `SRP_AER_REQ`): the IU was sent with the solicited-event
/// bit.
pub(crate) const SOLNT: u8 = 0x01;

/// Any SRP IU, parsed (see [`SrpIu::parse`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SrpIu<'a> {
    /// `SRP_LOGIN_REQ` in its 64-byte IB CM form.
    LoginReq(LoginReqRepr),
    /// `SRP_LOGIN_RSP`.
    LoginRsp(LoginRspRepr),
    /// `SRP_LOGIN_REJ`.
    LoginRej(LoginRejRepr),
    /// `SRP_I_LOGOUT`.
    ILogout(ILogoutRepr),
    /// `SRP_T_LOGOUT`.
    TLogout(TLogoutRepr),
    /// `SRP_TSK_MGMT`.
    TskMgmt(TskMgmtRepr),
    /// `SRP_CMD`.
    Cmd(CmdRepr<'a>),
    /// `SRP_RSP`.
    Rsp(RspRepr<'a>),
    /// `SRP_CRED_REQ`.
    CredReq(CredReqRepr),
    /// `SRP_CRED_RSP`.
    CredRsp(CredRspRepr),
    /// `SRP_AER_REQ`.
    AerReq(AerReqRepr<'a>),
    /// `SRP_AER_RSP`.
    AerRsp(AerRspRepr),
}

impl<'a> SrpIu<'a> {
    /// Parses any SRP IU by its type byte.
    ///
    /// `imm_data_offset` is the immediate-data offset this channel negotiated
    /// at login (`Some` only if the target granted `IMMED_SUPP`); an
    /// `SRP_CMD` with an immediate descriptor is rejected without it.
    ///
    /// # Errors
    ///
    /// Every malformed IU yields a specific [`Error`]; an empty buffer is
    /// [`Error::Truncated`], an undefined type byte
    /// [`Error::UnknownOpcode`].
    pub fn parse(buf: &'a [u8], imm_data_offset: Option<u16>) -> Result<Self> {
        let byte = *buf.first().ok_or(Error::Truncated)?;
        let opcode = Opcode::from_u8(byte).ok_or(Error::UnknownOpcode(byte))?;
        Ok(match opcode {
            Opcode::LoginReq => Self::LoginReq(LoginReqRepr::parse(&LoginReq::new_checked(buf)?)?),
            Opcode::LoginRsp => Self::LoginRsp(LoginRspRepr::parse(&LoginRsp::new_checked(buf)?)?),
            Opcode::LoginRej => Self::LoginRej(LoginRejRepr::parse(&LoginRej::new_checked(buf)?)?),
            Opcode::ILogout => Self::ILogout(ILogoutRepr::parse(&ILogout::new_checked(buf)?)?),
            Opcode::TLogout => Self::TLogout(TLogoutRepr::parse(&TLogout::new_checked(buf)?)?),
            Opcode::TskMgmt => Self::TskMgmt(TskMgmtRepr::parse(&TskMgmt::new_checked(buf)?)?),
            Opcode::Cmd => Self::Cmd(CmdRepr::parse(&Cmd::new_checked(buf)?, imm_data_offset)?),
            Opcode::Rsp => Self::Rsp(RspRepr::parse(&Rsp::new_checked(buf)?)?),
            Opcode::CredReq => Self::CredReq(CredReqRepr::parse(&CredReq::new_checked(buf)?)?),
            Opcode::CredRsp => Self::CredRsp(CredRspRepr::parse(&CredRsp::new_checked(buf)?)?),
            Opcode::AerReq => Self::AerReq(AerReqRepr::parse(&AerReq::new_checked(buf)?)?),
            Opcode::AerRsp => Self::AerRsp(AerRspRepr::parse(&AerRsp::new_checked(buf)?)?),
        })
    }

    /// The IU type.
    pub const fn opcode(&self) -> Opcode {
        match self {
            Self::LoginReq(_) => Opcode::LoginReq,
            Self::LoginRsp(_) => Opcode::LoginRsp,
            Self::LoginRej(_) => Opcode::LoginRej,
            Self::ILogout(_) => Opcode::ILogout,
            Self::TLogout(_) => Opcode::TLogout,
            Self::TskMgmt(_) => Opcode::TskMgmt,
            Self::Cmd(_) => Opcode::Cmd,
            Self::Rsp(_) => Opcode::Rsp,
            Self::CredReq(_) => Opcode::CredReq,
            Self::CredRsp(_) => Opcode::CredRsp,
            Self::AerReq(_) => Opcode::AerReq,
            Self::AerRsp(_) => Opcode::AerRsp,
        }
    }

    /// The IU's tag, which every SRP IU carries.
    pub const fn tag(&self) -> u64 {
        match self {
            Self::LoginReq(r) => r.tag,
            Self::LoginRsp(r) => r.tag,
            Self::LoginRej(r) => r.tag,
            Self::ILogout(r) => r.tag,
            Self::TLogout(r) => r.tag,
            Self::TskMgmt(r) => r.tag,
            Self::Cmd(r) => r.tag,
            Self::Rsp(r) => r.tag,
            Self::CredReq(r) => r.tag,
            Self::CredRsp(r) => r.tag,
            Self::AerReq(r) => r.tag,
            Self::AerRsp(r) => r.tag,
        }
    }

    /// Bytes [`Self::emit`] writes.
    ///
    /// # Errors
    ///
    /// As for the IU's own `buffer_len` (only `SRP_CMD` can fail).
    pub fn buffer_len(&self) -> Result<usize> {
        Ok(match self {
            Self::LoginReq(r) => r.buffer_len(),
            Self::LoginRsp(r) => r.buffer_len(),
            Self::LoginRej(r) => r.buffer_len(),
            Self::ILogout(r) => r.buffer_len(),
            Self::TLogout(r) => r.buffer_len(),
            Self::TskMgmt(r) => r.buffer_len(),
            Self::Cmd(r) => r.buffer_len()?,
            Self::Rsp(r) => r.buffer_len(),
            Self::CredReq(r) => r.buffer_len(),
            Self::CredRsp(r) => r.buffer_len(),
            Self::AerReq(r) => r.buffer_len(),
            Self::AerRsp(r) => r.buffer_len(),
        })
    }

    /// Writes the IU at the start of `buf` and returns its length.
    ///
    /// # Errors
    ///
    /// [`Error::BufferTooSmall`], or the IU's own consistency errors.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize> {
        match self {
            Self::LoginReq(r) => r.emit(&mut LoginReq::new_unchecked(&mut *buf)),
            Self::LoginRsp(r) => r.emit(&mut LoginRsp::new_unchecked(&mut *buf)),
            Self::LoginRej(r) => r.emit(&mut LoginRej::new_unchecked(&mut *buf)),
            Self::ILogout(r) => r.emit(&mut ILogout::new_unchecked(&mut *buf)),
            Self::TLogout(r) => r.emit(&mut TLogout::new_unchecked(&mut *buf)),
            Self::TskMgmt(r) => r.emit(&mut TskMgmt::new_unchecked(&mut *buf)),
            Self::Cmd(r) => r.emit(&mut Cmd::new_unchecked(&mut *buf)),
            Self::Rsp(r) => r.emit(&mut Rsp::new_unchecked(&mut *buf)),
            Self::CredReq(r) => r.emit(&mut CredReq::new_unchecked(&mut *buf)),
            Self::CredRsp(r) => r.emit(&mut CredRsp::new_unchecked(&mut *buf)),
            Self::AerReq(r) => r.emit(&mut AerReq::new_unchecked(&mut *buf)),
            Self::AerRsp(r) => r.emit(&mut AerRsp::new_unchecked(&mut *buf)),
        }?;
        self.buffer_len()
    }
}

/// Checks the type byte of an IU about to be parsed as `expected`.
pub(crate) fn expect_opcode(byte: u8, expected: Opcode) -> Result<()> {
    if byte == expected as u8 {
        Ok(())
    } else {
        Err(Error::WrongOpcode(byte))
    }
}

/// Checks that `buf` can hold `len` bytes of an IU about to be emitted.
pub(crate) fn check_emit_len(buf: &[u8], len: usize) -> Result<()> {
    if buf.len() < len {
        Err(Error::BufferTooSmall)
    } else {
        Ok(())
    }
}

/// A slice length as a 32-bit wire length.
pub(crate) fn len_u32(len: usize) -> Result<u32> {
    u32::try_from(len).map_err(|_| Error::LengthOverflow)
}

#[cfg(test)]
mod tests;
