//! `SRP_LOGIN_RSP` (52 bytes): the target accepts a login. Carried as IB CM
//! REP private data (also with RDMA/CM, which adds no header to a REP).

use static_assertions::const_assert_eq;

use super::{BufFormats, Error, Opcode, Result, check_emit_len, expect_opcode};
use crate::wire::bytes;

mod field {
    use crate::wire::Field;

    pub const OPCODE: Field = 0..1;
    pub const REQ_LIM_DELTA: Field = 4..8;
    pub const TAG: Field = 8..16;
    pub const MAX_IT_IU_LEN: Field = 16..20;
    pub const MAX_TI_IU_LEN: Field = 20..24;
    pub const BUF_FMT: Field = 24..26;
    pub const RSP_FLAGS: Field = 26..27;
    pub const RESERVED: Field = 27..52;
}

/// Size of `SRP_LOGIN_RSP`.
pub const LEN: usize = field::RESERVED.end;
const_assert_eq!(LEN, 52);

const MULTICHAN_MASK: u8 = 0x03;
/// `SRP_LOGIN_RSP_IMMED_SUPP` (SRP-2).
const IMMED_SUPP: u8 = 0x80;

/// What the target did with the initiator's other channels
/// (`rsp_flags & 0x03`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum MultiChannelResult {
    /// `MULTICHAN_NO_CHAN`: there were none.
    NoChannel = 0,
    /// `MULTICHAN_TERMINATED`: existing channels were terminated.
    Terminated = 1,
    /// `MULTICHAN_MAINTAINED`: existing channels were kept.
    Maintained = 2,
}

/// The value of an `SRP_LOGIN_RSP`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LoginRspRepr {
    /// Initial request limit (credits); Linux `ib_srpt` grants its receive
    /// queue size.
    pub req_lim_delta: i32,
    /// The login request's tag.
    pub tag: u64,
    /// Largest initiator-to-target IU the target accepts.
    pub max_it_iu_len: u32,
    /// Largest target-to-initiator IU the target will send.
    pub max_ti_iu_len: u32,
    /// Descriptor formats the target supports.
    pub buf_fmt: BufFormats,
    /// What happened to the initiator's other channels.
    pub multichannel: MultiChannelResult,
    /// `IMMED_SUPP`: the target accepts immediate data at the requested
    /// offset.
    pub immediate_supported: bool,
}

impl LoginRspRepr {
    /// Parses a login response.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`], [`Error::WrongOpcode`],
    /// [`Error::ReservedMultiChannel`].
    pub fn parse<T: AsRef<[u8]>>(iu: &LoginRsp<T>) -> Result<Self> {
        iu.check_len()?;
        expect_opcode(iu.opcode(), Opcode::LoginRsp)?;
        let flags = iu.rsp_flags();
        let multichannel = match flags & MULTICHAN_MASK {
            0 => MultiChannelResult::NoChannel,
            1 => MultiChannelResult::Terminated,
            2 => MultiChannelResult::Maintained,
            code => return Err(Error::ReservedMultiChannel(code)),
        };
        Ok(Self {
            req_lim_delta: iu.req_lim_delta(),
            tag: iu.tag(),
            max_it_iu_len: iu.max_it_iu_len(),
            max_ti_iu_len: iu.max_ti_iu_len(),
            buf_fmt: iu.buf_fmt(),
            multichannel,
            immediate_supported: flags & IMMED_SUPP != 0,
        })
    }

    /// Bytes [`Self::emit`] writes.
    pub const fn buffer_len(&self) -> usize {
        LEN
    }

    /// Writes the response, reserved bytes zeroed.
    ///
    /// # Errors
    ///
    /// [`Error::BufferTooSmall`].
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, iu: &mut LoginRsp<T>) -> Result<()> {
        check_emit_len(iu.as_bytes(), LEN)?;
        bytes::zero(iu.as_bytes_mut(), 0, LEN);
        iu.set_opcode(Opcode::LoginRsp as u8);
        iu.set_req_lim_delta(self.req_lim_delta);
        iu.set_tag(self.tag);
        iu.set_max_it_iu_len(self.max_it_iu_len);
        iu.set_max_ti_iu_len(self.max_ti_iu_len);
        iu.set_buf_fmt(self.buf_fmt);
        let immed = if self.immediate_supported {
            IMMED_SUPP
        } else {
            0
        };
        iu.set_rsp_flags(self.multichannel as u8 | immed);
        Ok(())
    }
}

wire_view! {
    /// A view of `SRP_LOGIN_RSP` (`srp_login_rsp`).
    pub struct LoginRsp, min_len = LEN, error = Error, truncated = Error::Truncated;
    /// IU type byte (0xC0).
    opcode, set_opcode: u8 = field::OPCODE;
    /// Initial request limit.
    req_lim_delta, set_req_lim_delta: i32 = field::REQ_LIM_DELTA;
    /// Tag.
    tag, set_tag: u64 = field::TAG;
    /// Maximum initiator-to-target IU length.
    max_it_iu_len, set_max_it_iu_len: u32 = field::MAX_IT_IU_LEN;
    /// Maximum target-to-initiator IU length.
    max_ti_iu_len, set_max_ti_iu_len: u32 = field::MAX_TI_IU_LEN;
    /// Supported descriptor formats.
    buf_fmt, set_buf_fmt: BufFormats = field::BUF_FMT;
    /// Raw `rsp_flags` byte.
    rsp_flags, set_rsp_flags: u8 = field::RSP_FLAGS;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What Linux `ib_srpt` answers an immediate-data login on rxe:
    /// req_lim_delta = 128 (its receive queue), max_it_iu_len = 8276
    /// (`srp_max_req_size`), max_ti_iu_len = the initiator's 8260 echoed,
    /// buf_fmt DIRECT|INDIRECT, no other channel (first login), and
    /// IMMED_SUPP.
    #[test]
    fn srpt_style_golden_bytes() {
        let repr = LoginRspRepr {
            req_lim_delta: 128,
            tag: 0,
            max_it_iu_len: 8276,
            max_ti_iu_len: 8260,
            buf_fmt: BufFormats::DIRECT | BufFormats::INDIRECT,
            multichannel: MultiChannelResult::NoChannel,
            immediate_supported: true,
        };
        let mut expected = [0u8; 52];
        expected[0] = 0xC0;
        expected[4..8].copy_from_slice(&[0, 0, 0, 128]);
        expected[16..20].copy_from_slice(&[0x00, 0x00, 0x20, 0x54]);
        expected[20..24].copy_from_slice(&[0x00, 0x00, 0x20, 0x44]);
        expected[24..26].copy_from_slice(&[0x00, 0x06]);
        expected[26] = 0x80;
        let mut buf = [0xEEu8; 52];
        repr.emit(&mut LoginRsp::new_unchecked(&mut buf[..]))
            .unwrap();
        assert_eq!(buf, expected);
        assert_eq!(
            LoginRspRepr::parse(&LoginRsp::new_unchecked(&buf[..])),
            Ok(repr)
        );
    }

    #[test]
    fn malformed() {
        let mut buf = [0u8; 52];
        buf[0] = 0xC0;
        buf[26] = 0x03;
        assert_eq!(
            LoginRspRepr::parse(&LoginRsp::new_unchecked(&buf[..])),
            Err(Error::ReservedMultiChannel(3))
        );
        buf[26] = 0x02;
        let repr = LoginRspRepr::parse(&LoginRsp::new_unchecked(&buf[..])).unwrap();
        assert_eq!(repr.multichannel, MultiChannelResult::Maintained);
        assert!(!repr.immediate_supported);
        assert_eq!(
            LoginRspRepr::parse(&LoginRsp::new_unchecked(&buf[..51])),
            Err(Error::Truncated)
        );
        buf[0] = 0xC2;
        assert_eq!(
            LoginRspRepr::parse(&LoginRsp::new_unchecked(&buf[..])),
            Err(Error::WrongOpcode(0xC2))
        );
        assert_eq!(
            repr.emit(&mut LoginRsp::new_unchecked(&mut buf[..51])),
            Err(Error::BufferTooSmall)
        );
    }

    #[test]
    fn negative_request_limit_delta() {
        let mut buf = [0u8; 52];
        buf[0] = 0xC0;
        buf[4..8].copy_from_slice(&[0xff, 0xff, 0xff, 0xff]);
        let repr = LoginRspRepr::parse(&LoginRsp::new_unchecked(&buf[..])).unwrap();
        assert_eq!(repr.req_lim_delta, -1);
    }
}
