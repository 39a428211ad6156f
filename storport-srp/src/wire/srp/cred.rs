//! `SRP_CRED_REQ` and `SRP_CRED_RSP` (16 bytes each): the target grants
//! credits outside a response; the initiator acknowledges.

use static_assertions::const_assert_eq;

use super::{Error, Opcode, Result, SOLNT, check_emit_len, expect_opcode};
use crate::wire::bytes;

mod field {
    use crate::wire::Field;

    pub const OPCODE: Field = 0..1;
    pub const SOL_NOT: Field = 1..2;
    pub const REQ_LIM_DELTA: Field = 4..8;
    pub const TAG: Field = 8..16;
}

/// Size of `SRP_CRED_REQ` and of `SRP_CRED_RSP`.
pub const LEN: usize = field::TAG.end;
const_assert_eq!(LEN, 16);

/// The value of an `SRP_CRED_REQ`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CredReqRepr {
    /// `SOLNT`: sent with the solicited-event bit.
    pub solicited: bool,
    /// Change of the request limit (signed: Linux adds it as an `s32`).
    pub req_lim_delta: i32,
    /// Tag, echoed in the `SRP_CRED_RSP`.
    pub tag: u64,
}

impl CredReqRepr {
    /// Parses a credit request.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`], [`Error::WrongOpcode`].
    pub fn parse<T: AsRef<[u8]>>(iu: &CredReq<T>) -> Result<Self> {
        iu.check_len()?;
        expect_opcode(iu.opcode(), Opcode::CredReq)?;
        Ok(Self {
            solicited: iu.sol_not() & SOLNT != 0,
            req_lim_delta: iu.req_lim_delta(),
            tag: iu.tag(),
        })
    }

    /// Bytes [`Self::emit`] writes.
    pub const fn buffer_len(&self) -> usize {
        LEN
    }

    /// Writes the IU, reserved bytes zeroed.
    ///
    /// # Errors
    ///
    /// [`Error::BufferTooSmall`].
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, iu: &mut CredReq<T>) -> Result<()> {
        check_emit_len(iu.as_bytes(), LEN)?;
        bytes::zero(iu.as_bytes_mut(), 0, LEN);
        iu.set_opcode(Opcode::CredReq as u8);
        iu.set_sol_not(if self.solicited { SOLNT } else { 0 });
        iu.set_req_lim_delta(self.req_lim_delta);
        iu.set_tag(self.tag);
        Ok(())
    }
}

wire_view! {
    /// A view of `SRP_CRED_REQ` (`srp_cred_req`).
    pub struct CredReq, min_len = LEN, error = Error, truncated = Error::Truncated;
    /// IU type byte (0x81).
    opcode, set_opcode: u8 = field::OPCODE;
    /// Raw `sol_not` byte.
    sol_not, set_sol_not: u8 = field::SOL_NOT;
    /// Request limit delta.
    req_lim_delta, set_req_lim_delta: i32 = field::REQ_LIM_DELTA;
    /// Tag.
    tag, set_tag: u64 = field::TAG;
}

/// The value of an `SRP_CRED_RSP`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CredRspRepr {
    /// The credit request's tag.
    pub tag: u64,
}

impl CredRspRepr {
    /// Parses a credit response.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`], [`Error::WrongOpcode`].
    pub fn parse<T: AsRef<[u8]>>(iu: &CredRsp<T>) -> Result<Self> {
        iu.check_len()?;
        expect_opcode(iu.opcode(), Opcode::CredRsp)?;
        Ok(Self { tag: iu.tag() })
    }

    /// Bytes [`Self::emit`] writes.
    pub const fn buffer_len(&self) -> usize {
        LEN
    }

    /// Writes the IU, reserved bytes zeroed.
    ///
    /// # Errors
    ///
    /// [`Error::BufferTooSmall`].
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, iu: &mut CredRsp<T>) -> Result<()> {
        check_emit_len(iu.as_bytes(), LEN)?;
        bytes::zero(iu.as_bytes_mut(), 0, LEN);
        iu.set_opcode(Opcode::CredRsp as u8);
        iu.set_tag(self.tag);
        Ok(())
    }
}

wire_view! {
    /// A view of `SRP_CRED_RSP` (`srp_cred_rsp`).
    pub struct CredRsp, min_len = LEN, error = Error, truncated = Error::Truncated;
    /// IU type byte (0x41).
    opcode, set_opcode: u8 = field::OPCODE;
    /// Tag.
    tag, set_tag: u64 = field::TAG;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn golden_bytes() {
        let req = CredReqRepr {
            solicited: false,
            req_lim_delta: 5,
            tag: 0x77,
        };
        let mut buf = [0xEEu8; 16];
        req.emit(&mut CredReq::new_unchecked(&mut buf[..])).unwrap();
        assert_eq!(buf, [0x81, 0, 0, 0, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0, 0x77]);
        assert_eq!(
            CredReqRepr::parse(&CredReq::new_unchecked(&buf[..])),
            Ok(req)
        );

        let rsp = CredRspRepr { tag: req.tag };
        rsp.emit(&mut CredRsp::new_unchecked(&mut buf[..])).unwrap();
        assert_eq!(buf, [0x41, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x77]);
        assert_eq!(
            CredRspRepr::parse(&CredRsp::new_unchecked(&buf[..])),
            Ok(rsp)
        );
    }

    #[test]
    fn malformed() {
        let buf = [0x81u8; 15];
        assert_eq!(
            CredReqRepr::parse(&CredReq::new_unchecked(&buf[..])),
            Err(Error::Truncated)
        );
        assert_eq!(
            CredRspRepr::parse(&CredRsp::new_unchecked(&[0x81u8; 16][..])),
            Err(Error::WrongOpcode(0x81))
        );
        assert_eq!(
            CredReqRepr::parse(&CredReq::new_unchecked(&[0x41u8; 16][..])),
            Err(Error::WrongOpcode(0x41))
        );
        let mut small = [0u8; 15];
        assert_eq!(
            CredRspRepr { tag: 0 }.emit(&mut CredRsp::new_unchecked(&mut small[..])),
            Err(Error::BufferTooSmall)
        );
    }
}
