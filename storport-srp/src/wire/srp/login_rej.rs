//! `SRP_LOGIN_REJ` (32 bytes): the target refuses a login. Carried as IB CM
//! REJ private data with REJ reason 28 (consumer defined).

use static_assertions::const_assert_eq;

use super::{BufFormats, Error, Opcode, Result, check_emit_len, expect_opcode};
use crate::wire::bytes;

mod field {
    use crate::wire::Field;

    pub const OPCODE: Field = 0..1;
    pub const REASON: Field = 4..8;
    pub const TAG: Field = 8..16;
    pub const BUF_FMT: Field = 24..26;
    pub const RESERVED: Field = 26..32;
}

/// Size of `SRP_LOGIN_REJ`.
pub const LEN: usize = field::RESERVED.end;
const_assert_eq!(LEN, 32);

/// Why a target rejected a login. Codes SRP does not define are preserved,
/// so an engine can log exactly what the target said.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RejectReason {
    /// 0x00010000: unable to establish the RDMA channel, no reason given.
    UnableEstablishChannel,
    /// 0x00010001: insufficient RDMA channel resources.
    InsufficientResources,
    /// 0x00010002: requested maximum initiator-to-target IU length too
    /// large (or, for Linux `ib_srpt`, below 64).
    ReqItIuLengthTooLarge,
    /// 0x00010003: unable to associate the channel with the I_T nexus
    /// (`ib_srpt`: the target port id is not its service GUID twice).
    UnableAssociateChannel,
    /// 0x00010004: one of the requested descriptor formats is not supported.
    UnsupportedDescriptorFormat,
    /// 0x00010005: multichannel operation not supported.
    MultiChannelUnsupported,
    /// 0x00010006: no more channels for this I_T nexus.
    ChannelLimitReached,
    /// Any other code, as received.
    Other(u32),
}

impl RejectReason {
    /// The reason for a wire code.
    pub const fn from_code(code: u32) -> Self {
        match code {
            0x0001_0000 => Self::UnableEstablishChannel,
            0x0001_0001 => Self::InsufficientResources,
            0x0001_0002 => Self::ReqItIuLengthTooLarge,
            0x0001_0003 => Self::UnableAssociateChannel,
            0x0001_0004 => Self::UnsupportedDescriptorFormat,
            0x0001_0005 => Self::MultiChannelUnsupported,
            0x0001_0006 => Self::ChannelLimitReached,
            other => Self::Other(other),
        }
    }

    /// The wire code.
    pub const fn code(self) -> u32 {
        match self {
            Self::UnableEstablishChannel => 0x0001_0000,
            Self::InsufficientResources => 0x0001_0001,
            Self::ReqItIuLengthTooLarge => 0x0001_0002,
            Self::UnableAssociateChannel => 0x0001_0003,
            Self::UnsupportedDescriptorFormat => 0x0001_0004,
            Self::MultiChannelUnsupported => 0x0001_0005,
            Self::ChannelLimitReached => 0x0001_0006,
            Self::Other(code) => code,
        }
    }
}

/// The value of an `SRP_LOGIN_REJ`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LoginRejRepr {
    /// Why the login was rejected.
    pub reason: RejectReason,
    /// The login request's tag.
    pub tag: u64,
    /// Descriptor formats the target supports.
    pub buf_fmt: BufFormats,
}

impl LoginRejRepr {
    /// Parses a login reject.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`], [`Error::WrongOpcode`].
    pub fn parse<T: AsRef<[u8]>>(iu: &LoginRej<T>) -> Result<Self> {
        iu.check_len()?;
        expect_opcode(iu.opcode(), Opcode::LoginRej)?;
        Ok(Self {
            reason: RejectReason::from_code(iu.reason()),
            tag: iu.tag(),
            buf_fmt: iu.buf_fmt(),
        })
    }

    /// Bytes [`Self::emit`] writes.
    pub const fn buffer_len(&self) -> usize {
        LEN
    }

    /// Writes the reject, reserved bytes zeroed.
    ///
    /// # Errors
    ///
    /// [`Error::BufferTooSmall`].
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, iu: &mut LoginRej<T>) -> Result<()> {
        check_emit_len(iu.as_bytes(), LEN)?;
        bytes::zero(iu.as_bytes_mut(), 0, LEN);
        iu.set_opcode(Opcode::LoginRej as u8);
        iu.set_reason(self.reason.code());
        iu.set_tag(self.tag);
        iu.set_buf_fmt(self.buf_fmt);
        Ok(())
    }
}

wire_view! {
    /// A view of `SRP_LOGIN_REJ` (`srp_login_rej`).
    pub struct LoginRej, min_len = LEN, error = Error, truncated = Error::Truncated;
    /// IU type byte (0xC2).
    opcode, set_opcode: u8 = field::OPCODE;
    /// Raw reason code.
    reason, set_reason: u32 = field::REASON;
    /// Tag.
    tag, set_tag: u64 = field::TAG;
    /// Supported descriptor formats.
    buf_fmt, set_buf_fmt: BufFormats = field::BUF_FMT;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `ib_srpt` sends when the target port id does not match.
    #[test]
    fn srpt_style_golden_bytes() {
        let repr = LoginRejRepr {
            reason: RejectReason::UnableAssociateChannel,
            tag: 0,
            buf_fmt: BufFormats::DIRECT | BufFormats::INDIRECT,
        };
        let mut expected = [0u8; 32];
        expected[0] = 0xC2;
        expected[4..8].copy_from_slice(&[0x00, 0x01, 0x00, 0x03]);
        expected[24..26].copy_from_slice(&[0x00, 0x06]);
        let mut buf = [0xEEu8; 32];
        repr.emit(&mut LoginRej::new_unchecked(&mut buf[..]))
            .unwrap();
        assert_eq!(buf, expected);
        assert_eq!(
            LoginRejRepr::parse(&LoginRej::new_unchecked(&buf[..])),
            Ok(repr)
        );
    }

    #[test]
    fn every_reason_round_trips_and_unknown_is_preserved() {
        for code in 0x0001_0000..=0x0001_0006 {
            let reason = RejectReason::from_code(code);
            assert!(!matches!(reason, RejectReason::Other(_)), "{code:#x}");
            assert_eq!(reason.code(), code);
        }
        assert_eq!(
            RejectReason::from_code(0x0001_0007),
            RejectReason::Other(0x0001_0007)
        );
        assert_eq!(RejectReason::Other(0xdead_beef).code(), 0xdead_beef);
    }

    #[test]
    fn malformed() {
        let buf = [0xC2u8; 31];
        assert_eq!(
            LoginRejRepr::parse(&LoginRej::new_unchecked(&buf[..])),
            Err(Error::Truncated)
        );
        let buf = [0xC0u8; 32];
        assert_eq!(
            LoginRejRepr::parse(&LoginRej::new_unchecked(&buf[..])),
            Err(Error::WrongOpcode(0xC0))
        );
    }
}
