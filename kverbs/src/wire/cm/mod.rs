//! IB CM messages (IBA chapter 12) and the typed values they carry.
//!
//! Each message view covers the 232 bytes of MAD data after the MAD
//! header; [`CmMadRepr`] adds the header and dispatches on the attribute ID.

use core::fmt;

use hca_lowlevel::wire::bytes;

use super::mad::{self, MadHeader};
use super::{Error, MAD_DATA_LEN, MAD_HEADER_LEN, MAD_LEN, Result, attribute};

mod drep;
mod dreq;
mod mra;
mod path;
mod rej;
mod rep;
mod req;
mod rtu;

pub use drep::{CmDrep, CmDrepRepr};
pub use dreq::{CmDreq, CmDreqRepr};
pub use mra::{CmMra, CmMraRepr};
pub use path::{CmPath, CmPathRepr, PERMISSIVE_LID};
pub use rej::{ARI_LEN, CmRej, CmRejRepr};
pub use rep::{CmRep, CmRepRepr};
pub use req::{CmReq, CmReqRepr};
pub use rtu::{CmRtu, CmRtuRepr};

/// The length of every CM message body (the MAD data).
pub const MESSAGE_LEN: usize = MAD_DATA_LEN;

/// Read the bits of `mask` in the byte at `at`, shifted down.
pub(crate) fn get_bits(buf: &[u8], at: usize, mask: u8) -> u8 {
    (bytes::read_u8(buf, at) & mask) >> mask.trailing_zeros()
}

/// Replace the bits of `mask` in the byte at `at` with `value` shifted up.
pub(crate) fn set_bits(buf: &mut [u8], at: usize, mask: u8, value: u8) {
    let shifted = value.checked_shl(mask.trailing_zeros()).unwrap_or(0);
    bytes::write_bits_u8(buf, at, mask, shifted);
}

/// Zero the whole message body before an emit, so reserved fields and
/// private-data padding go out as zero.
pub(crate) fn clear_body(buf: &mut [u8]) {
    bytes::slice_mut(buf, 0..MESSAGE_LEN).fill(0);
}

/// An IBA time value: 4.096 µs × 2^exponent, a five-bit exponent.
///
/// Used for the CM response timeouts, the MRA service timeout, the REP
/// target ACK delay and the path's local ACK timeout (where exponent 0
/// means "no timeout").
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct IbTimeout(u8);

impl IbTimeout {
    /// RDMA/CM's CM response timeout (`CMA_CM_RESPONSE_TIMEOUT`, ≈ 4.3 s).
    pub const CMA_CM_RESPONSE: IbTimeout = IbTimeout(20);
    /// RDMA/CM's packet lifetime for RoCE (`CMA_IBOE_PACKET_LIFETIME`, ≈ 1.07 s).
    pub const CMA_IBOE_PACKET_LIFETIME: IbTimeout = IbTimeout(18);
    /// The longest value.
    pub const MAX: IbTimeout = IbTimeout(31);

    /// The exponent, or `None` above 31.
    pub const fn new(exponent: u8) -> Option<IbTimeout> {
        if exponent <= 31 {
            Some(IbTimeout(exponent))
        } else {
            None
        }
    }

    /// The low five bits of `exponent`.
    pub const fn from_low_bits(exponent: u8) -> IbTimeout {
        IbTimeout(exponent & 0x1f)
    }

    /// The exponent (0..=31).
    pub const fn exponent(self) -> u8 {
        self.0
    }

    /// The duration in nanoseconds: 4096 ns × 2^exponent.
    pub const fn as_nanos(self) -> u64 {
        4096u64 << self.0
    }

    /// The smallest value whose duration is at least `nanos` ([`Self::MAX`]
    /// when none is).
    pub const fn at_least_nanos(nanos: u64) -> IbTimeout {
        let mut exponent = 0;
        while exponent < 31 && (4096u64 << exponent) < nanos {
            exponent += 1;
        }
        IbTimeout(exponent)
    }
}

impl fmt::Debug for IbTimeout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IbTimeout(2^{} x 4.096us)", self.0)
    }
}

/// A path MTU code (REQ byte 50, IBA table 106; also the QP attribute).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum PathMtu {
    /// 256 bytes.
    Mtu256 = 1,
    /// 512 bytes.
    Mtu512 = 2,
    /// 1024 bytes (RoCE on a 1500-byte Ethernet MTU).
    Mtu1024 = 3,
    /// 2048 bytes.
    Mtu2048 = 4,
    /// 4096 bytes.
    Mtu4096 = 5,
}

impl PathMtu {
    /// Decode a code.
    ///
    /// # Errors
    ///
    /// [`Error::BadPathMtu`] for 0 and 6..=15 (reserved).
    pub const fn from_code(code: u8) -> Result<PathMtu> {
        match code {
            1 => Ok(PathMtu::Mtu256),
            2 => Ok(PathMtu::Mtu512),
            3 => Ok(PathMtu::Mtu1024),
            4 => Ok(PathMtu::Mtu2048),
            5 => Ok(PathMtu::Mtu4096),
            other => Err(Error::BadPathMtu(other)),
        }
    }

    /// The code.
    pub const fn code(self) -> u8 {
        self as u8
    }

    /// The MTU in bytes.
    pub const fn bytes(self) -> u32 {
        128 << (self as u32)
    }

    /// The MTU for exactly `bytes`, if it is one of the five.
    pub const fn from_bytes(bytes: u32) -> Option<PathMtu> {
        match bytes {
            256 => Some(PathMtu::Mtu256),
            512 => Some(PathMtu::Mtu512),
            1024 => Some(PathMtu::Mtu1024),
            2048 => Some(PathMtu::Mtu2048),
            4096 => Some(PathMtu::Mtu4096),
            _ => None,
        }
    }

    /// The largest path MTU that fits a RoCE packet into an Ethernet MTU of
    /// `netdev_mtu` bytes, as Linux `iboe_get_mtu` computes it (96 bytes of
    /// IP/UDP/IBA headers and ICRC reserved); `None` below 256 + 96.
    pub const fn for_roce_netdev_mtu(netdev_mtu: u32) -> Option<PathMtu> {
        let room = netdev_mtu.saturating_sub(40 + 8 + 12 + 4 + 28 + 4);
        if room >= 4096 {
            Some(PathMtu::Mtu4096)
        } else if room >= 2048 {
            Some(PathMtu::Mtu2048)
        } else if room >= 1024 {
            Some(PathMtu::Mtu1024)
        } else if room >= 512 {
            Some(PathMtu::Mtu512)
        } else if room >= 256 {
            Some(PathMtu::Mtu256)
        } else {
            None
        }
    }
}

/// The REQ transport service type (2 bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum TransportServiceType {
    /// Reliable connected.
    Rc = 0,
    /// Unreliable connected.
    Uc = 1,
    /// Reliable datagram.
    Rd = 2,
    /// See the extended transport type (1: XRC).
    Extended = 3,
}

impl TransportServiceType {
    /// Decode the two bits (total).
    pub const fn from_bits(bits: u8) -> TransportServiceType {
        match bits & 3 {
            0 => TransportServiceType::Rc,
            1 => TransportServiceType::Uc,
            2 => TransportServiceType::Rd,
            _ => TransportServiceType::Extended,
        }
    }
}

/// Which message an MRA acknowledges or a REJ rejects (2 bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum CmMessageKind {
    /// A REQ.
    Req = 0,
    /// A REP.
    Rep = 1,
    /// Another message (LAP).
    Other = 2,
}

impl CmMessageKind {
    /// Decode the two bits.
    ///
    /// # Errors
    ///
    /// [`Error::ReservedMessageKind`] for 3.
    pub const fn from_bits(bits: u8) -> Result<CmMessageKind> {
        match bits {
            0 => Ok(CmMessageKind::Req),
            1 => Ok(CmMessageKind::Rep),
            2 => Ok(CmMessageKind::Other),
            other => Err(Error::ReservedMessageKind(other)),
        }
    }
}

/// Why a REJ rejects (IBA table 109, Linux `enum ib_cm_rej_reason`).
///
/// A reason this module does not know is kept as [`RejectReason::Other`]:
/// a REJ is a REJ whatever its reason, and the connection attempt ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RejectReason {
    /// 1: no QP available.
    NoQp,
    /// 2: no EE context available.
    NoEec,
    /// 3: no resources.
    NoResources,
    /// 4: timeout (the ARI holds the GUID of the CA that timed out).
    Timeout,
    /// 5: unsupported request.
    Unsupported,
    /// 6: invalid communication ID.
    InvalidCommId,
    /// 7: invalid communication instance.
    InvalidCommInstance,
    /// 8: no listener for the service ID.
    InvalidServiceId,
    /// 9: invalid transport service type.
    InvalidTransportType,
    /// 10: stale connection: the receiver still holds this QPN/GUID in timewait.
    StaleConn,
    /// 11: RDC does not exist.
    RdcNotExist,
    /// 12: invalid primary GID (RoCE: no route back to the sender).
    InvalidGid,
    /// 13: invalid primary LID.
    InvalidLid,
    /// 14: invalid primary SL.
    InvalidSl,
    /// 15: invalid primary traffic class.
    InvalidTrafficClass,
    /// 16: invalid primary hop limit.
    InvalidHopLimit,
    /// 17: invalid primary packet rate.
    InvalidPacketRate,
    /// 18: invalid alternate GID.
    InvalidAltGid,
    /// 19: invalid alternate LID.
    InvalidAltLid,
    /// 20: invalid alternate SL.
    InvalidAltSl,
    /// 21: invalid alternate traffic class.
    InvalidAltTrafficClass,
    /// 22: invalid alternate hop limit.
    InvalidAltHopLimit,
    /// 23: invalid alternate packet rate.
    InvalidAltPacketRate,
    /// 24: redirect to another port's CM (ARI: ClassPortInfo).
    PortCmRedirect,
    /// 25: redirect to another port.
    PortRedirect,
    /// 26: invalid path MTU.
    InvalidMtu,
    /// 27: insufficient responder resources.
    InsufficientRespResources,
    /// 28: the consumer refused; its reason is in the private data (SRP
    /// `SRP_LOGIN_REJ`, iSER).
    ConsumerDefined,
    /// 29: invalid RNR retry count.
    InvalidRnrRetry,
    /// 30: duplicate local communication ID.
    DuplicateLocalCommId,
    /// 31: unsupported CM class version.
    InvalidClassVersion,
    /// 32: invalid primary flow label.
    InvalidFlowLabel,
    /// 33: invalid alternate flow label.
    InvalidAltFlowLabel,
    /// 35: ECE vendor option not supported.
    VendorOptionNotSupported,
    /// A code without a name here (kept, not refused).
    Other(u16),
}

impl RejectReason {
    /// The reason for a code.
    pub const fn from_code(code: u16) -> RejectReason {
        use RejectReason as R;
        match code {
            1 => R::NoQp,
            2 => R::NoEec,
            3 => R::NoResources,
            4 => R::Timeout,
            5 => R::Unsupported,
            6 => R::InvalidCommId,
            7 => R::InvalidCommInstance,
            8 => R::InvalidServiceId,
            9 => R::InvalidTransportType,
            10 => R::StaleConn,
            11 => R::RdcNotExist,
            12 => R::InvalidGid,
            13 => R::InvalidLid,
            14 => R::InvalidSl,
            15 => R::InvalidTrafficClass,
            16 => R::InvalidHopLimit,
            17 => R::InvalidPacketRate,
            18 => R::InvalidAltGid,
            19 => R::InvalidAltLid,
            20 => R::InvalidAltSl,
            21 => R::InvalidAltTrafficClass,
            22 => R::InvalidAltHopLimit,
            23 => R::InvalidAltPacketRate,
            24 => R::PortCmRedirect,
            25 => R::PortRedirect,
            26 => R::InvalidMtu,
            27 => R::InsufficientRespResources,
            28 => R::ConsumerDefined,
            29 => R::InvalidRnrRetry,
            30 => R::DuplicateLocalCommId,
            31 => R::InvalidClassVersion,
            32 => R::InvalidFlowLabel,
            33 => R::InvalidAltFlowLabel,
            35 => R::VendorOptionNotSupported,
            other => R::Other(other),
        }
    }

    /// The code.
    pub const fn code(self) -> u16 {
        use RejectReason as R;
        match self {
            R::NoQp => 1,
            R::NoEec => 2,
            R::NoResources => 3,
            R::Timeout => 4,
            R::Unsupported => 5,
            R::InvalidCommId => 6,
            R::InvalidCommInstance => 7,
            R::InvalidServiceId => 8,
            R::InvalidTransportType => 9,
            R::StaleConn => 10,
            R::RdcNotExist => 11,
            R::InvalidGid => 12,
            R::InvalidLid => 13,
            R::InvalidSl => 14,
            R::InvalidTrafficClass => 15,
            R::InvalidHopLimit => 16,
            R::InvalidPacketRate => 17,
            R::InvalidAltGid => 18,
            R::InvalidAltLid => 19,
            R::InvalidAltSl => 20,
            R::InvalidAltTrafficClass => 21,
            R::InvalidAltHopLimit => 22,
            R::InvalidAltPacketRate => 23,
            R::PortCmRedirect => 24,
            R::PortRedirect => 25,
            R::InvalidMtu => 26,
            R::InsufficientRespResources => 27,
            R::ConsumerDefined => 28,
            R::InvalidRnrRetry => 29,
            R::DuplicateLocalCommId => 30,
            R::InvalidClassVersion => 31,
            R::InvalidFlowLabel => 32,
            R::InvalidAltFlowLabel => 33,
            R::VendorOptionNotSupported => 35,
            R::Other(code) => code,
        }
    }
}

impl From<u16> for RejectReason {
    fn from(code: u16) -> RejectReason {
        RejectReason::from_code(code)
    }
}

impl From<RejectReason> for u16 {
    fn from(reason: RejectReason) -> u16 {
        reason.code()
    }
}

/// One CM message, by attribute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CmMessage<'a> {
    /// Connection request.
    Req(CmReqRepr<'a>),
    /// Reply.
    Rep(CmRepRepr<'a>),
    /// Ready to use.
    Rtu(CmRtuRepr<'a>),
    /// Reject.
    Rej(CmRejRepr<'a>),
    /// Message receipt acknowledgement.
    Mra(CmMraRepr<'a>),
    /// Disconnect request.
    Dreq(CmDreqRepr<'a>),
    /// Disconnect reply.
    Drep(CmDrepRepr<'a>),
}

impl CmMessage<'_> {
    /// The MAD attribute ID of this message.
    pub const fn attribute_id(&self) -> u16 {
        match self {
            CmMessage::Req(_) => attribute::REQ,
            CmMessage::Rep(_) => attribute::REP,
            CmMessage::Rtu(_) => attribute::RTU,
            CmMessage::Rej(_) => attribute::REJ,
            CmMessage::Mra(_) => attribute::MRA,
            CmMessage::Dreq(_) => attribute::DREQ,
            CmMessage::Drep(_) => attribute::DREP,
        }
    }
}

/// A whole CM MAD: the header fields the CM sets, and the message.
///
/// Emitted with base version 1, class 0x07, class version 2, method Send,
/// status and class-specific 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CmMadRepr<'a> {
    /// Transaction ID (a REP, RTU, REJ or MRA reuses the REQ's).
    pub transaction_id: u64,
    /// Attribute modifier (0, or ECE options in REQ/REP on newer kernels).
    pub attribute_modifier: u32,
    /// The message.
    pub message: CmMessage<'a>,
}

impl<'a> CmMadRepr<'a> {
    /// Parse a CM MAD (at least 256 bytes; anything after is ignored).
    ///
    /// Status and class-specific header fields are not interpreted.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`]; [`Error::BadBaseVersion`],
    /// [`Error::UnexpectedMgmtClass`], [`Error::BadClassVersion`],
    /// [`Error::UnexpectedMethod`], [`Error::UnsupportedAttribute`] from the
    /// header; then the errors of the message's `parse`.
    pub fn parse(mad: &'a [u8]) -> Result<CmMadRepr<'a>> {
        if mad.len() < MAD_LEN {
            return Err(Error::Truncated);
        }
        let header = MadHeader::new_checked(mad)?;
        if header.base_version() != mad::BASE_VERSION {
            return Err(Error::BadBaseVersion(header.base_version()));
        }
        if header.mgmt_class() != mad::MGMT_CLASS_CM {
            return Err(Error::UnexpectedMgmtClass(header.mgmt_class()));
        }
        if header.class_version() != mad::CM_CLASS_VERSION {
            return Err(Error::BadClassVersion(header.class_version()));
        }
        if header.method() != super::method::SEND {
            return Err(Error::UnexpectedMethod(header.method()));
        }
        let body = header.data();
        let message = match header.attribute_id() {
            attribute::REQ => CmMessage::Req(CmReqRepr::parse(&CmReq::new_checked(body)?)?),
            attribute::REP => CmMessage::Rep(CmRepRepr::parse(&CmRep::new_checked(body)?)?),
            attribute::RTU => CmMessage::Rtu(CmRtuRepr::parse(&CmRtu::new_checked(body)?)?),
            attribute::REJ => CmMessage::Rej(CmRejRepr::parse(&CmRej::new_checked(body)?)?),
            attribute::MRA => CmMessage::Mra(CmMraRepr::parse(&CmMra::new_checked(body)?)?),
            attribute::DREQ => CmMessage::Dreq(CmDreqRepr::parse(&CmDreq::new_checked(body)?)?),
            attribute::DREP => CmMessage::Drep(CmDrepRepr::parse(&CmDrep::new_checked(body)?)?),
            other => return Err(Error::UnsupportedAttribute(other)),
        };
        Ok(CmMadRepr {
            transaction_id: header.transaction_id(),
            attribute_modifier: header.attribute_modifier(),
            message,
        })
    }

    /// The emitted length: a whole MAD.
    pub const fn buffer_len(&self) -> usize {
        MAD_LEN
    }

    /// Write the MAD into the start of `buf`; returns 256.
    ///
    /// # Errors
    ///
    /// [`Error::BufferTooShort`]; then the errors of the message's `emit`
    /// (out-of-range fields, private data too long).
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize> {
        let out = buf.get_mut(..MAD_LEN).ok_or(Error::BufferTooShort)?;
        let mut header = MadHeader::new_unchecked(&mut *out);
        super::MadHeaderRepr {
            base_version: mad::BASE_VERSION,
            mgmt_class: mad::MGMT_CLASS_CM,
            class_version: mad::CM_CLASS_VERSION,
            method: super::method::SEND,
            status: 0,
            class_specific: 0,
            transaction_id: self.transaction_id,
            attribute_id: self.message.attribute_id(),
            attribute_modifier: self.attribute_modifier,
        }
        .emit(&mut header);
        let body = bytes::slice_mut(out, MAD_HEADER_LEN..MAD_LEN);
        match &self.message {
            CmMessage::Req(m) => m.emit(&mut CmReq::new_unchecked(body))?,
            CmMessage::Rep(m) => m.emit(&mut CmRep::new_unchecked(body))?,
            CmMessage::Rtu(m) => m.emit(&mut CmRtu::new_unchecked(body))?,
            CmMessage::Rej(m) => m.emit(&mut CmRej::new_unchecked(body))?,
            CmMessage::Mra(m) => m.emit(&mut CmMra::new_unchecked(body))?,
            CmMessage::Dreq(m) => m.emit(&mut CmDreq::new_unchecked(body))?,
            CmMessage::Drep(m) => m.emit(&mut CmDrep::new_unchecked(body))?,
        }
        Ok(MAD_LEN)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts() {
        assert_eq!(IbTimeout::new(0).unwrap().as_nanos(), 4096);
        assert_eq!(IbTimeout::CMA_CM_RESPONSE.as_nanos(), 4_294_967_296);
        assert_eq!(IbTimeout::MAX.as_nanos(), 4096 << 31);
        assert_eq!(IbTimeout::new(32), None);
        assert_eq!(IbTimeout::from_low_bits(0xff), IbTimeout::MAX);
        assert_eq!(IbTimeout::at_least_nanos(0).exponent(), 0);
        assert_eq!(IbTimeout::at_least_nanos(4096).exponent(), 0);
        assert_eq!(IbTimeout::at_least_nanos(4097).exponent(), 1);
        assert_eq!(IbTimeout::at_least_nanos(4_000_000_000).exponent(), 20);
        assert_eq!(IbTimeout::at_least_nanos(u64::MAX), IbTimeout::MAX);
    }

    #[test]
    fn path_mtu() {
        for code in 0..=15u8 {
            match PathMtu::from_code(code) {
                Ok(mtu) => {
                    assert_eq!(mtu.code(), code);
                    assert_eq!(PathMtu::from_bytes(mtu.bytes()), Some(mtu));
                }
                Err(e) => {
                    assert!(code == 0 || code > 5);
                    assert_eq!(e, Error::BadPathMtu(code));
                }
            }
        }
        assert_eq!(PathMtu::Mtu1024.bytes(), 1024);
        assert_eq!(PathMtu::Mtu4096.bytes(), 4096);
        assert_eq!(PathMtu::for_roce_netdev_mtu(1500), Some(PathMtu::Mtu1024));
        assert_eq!(PathMtu::for_roce_netdev_mtu(9000), Some(PathMtu::Mtu4096));
        assert_eq!(
            PathMtu::for_roce_netdev_mtu(4096 + 96),
            Some(PathMtu::Mtu4096)
        );
        assert_eq!(
            PathMtu::for_roce_netdev_mtu(4096 + 95),
            Some(PathMtu::Mtu2048)
        );
        assert_eq!(PathMtu::for_roce_netdev_mtu(300), None);
    }

    #[test]
    fn reject_reasons_round_trip() {
        for code in 0..=u16::MAX {
            let reason = RejectReason::from_code(code);
            assert_eq!(reason.code(), code);
        }
        assert_eq!(RejectReason::from(28), RejectReason::ConsumerDefined);
        assert_eq!(RejectReason::from(8), RejectReason::InvalidServiceId);
        assert_eq!(RejectReason::from(34), RejectReason::Other(34));
        assert_eq!(u16::from(RejectReason::StaleConn), 10);
    }

    #[test]
    fn message_kinds_and_transport() {
        assert_eq!(CmMessageKind::from_bits(1), Ok(CmMessageKind::Rep));
        assert_eq!(
            CmMessageKind::from_bits(3),
            Err(Error::ReservedMessageKind(3))
        );
        assert_eq!(
            TransportServiceType::from_bits(3),
            TransportServiceType::Extended
        );
        assert_eq!(TransportServiceType::from_bits(0), TransportServiceType::Rc);
    }

    #[test]
    fn bit_helpers() {
        let mut b = [0u8; 1];
        set_bits(&mut b, 0, 0xf8, 20);
        assert_eq!(b[0], 0xa0);
        set_bits(&mut b, 0, 0x06, 1);
        set_bits(&mut b, 0, 0x01, 1);
        assert_eq!(b[0], 0xa3);
        assert_eq!(get_bits(&b, 0, 0xf8), 20);
        assert_eq!(get_bits(&b, 0, 0x06), 1);
        // Excess bits of the value are dropped by the mask.
        set_bits(&mut b, 0, 0x06, 0xff);
        assert_eq!(b[0], 0xa7);
    }
}
