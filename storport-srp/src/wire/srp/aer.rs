//! `SRP_AER_REQ` (36 bytes + sense) and `SRP_AER_RSP` (16 bytes): an
//! asynchronous event report (sense data for a LUN) and its acknowledgement.

use static_assertions::const_assert_eq;

use super::{Error, Opcode, Result, SOLNT, check_emit_len, expect_opcode, len_u32};
use crate::wire::{Lun, bytes};

mod field {
    use crate::wire::Field;

    pub const OPCODE: Field = 0..1;
    pub const SOL_NOT: Field = 1..2;
    pub const REQ_LIM_DELTA: Field = 4..8;
    pub const TAG: Field = 8..16;
    pub const LUN: Field = 20..28;
    pub const SENSE_DATA_LEN: Field = 28..32;
    pub const RESERVED: Field = 32..36;
    pub const SENSE: usize = 36;

    pub const RSP_TAG: Field = 8..16;
}

/// Size of the fixed part of `SRP_AER_REQ`.
pub const REQ_LEN: usize = field::SENSE;
/// Size of `SRP_AER_RSP`.
pub const RSP_LEN: usize = field::RSP_TAG.end;

const_assert_eq!(field::RESERVED.end, field::SENSE);
const_assert_eq!(REQ_LEN, 36);
const_assert_eq!(RSP_LEN, 16);

/// The value of an `SRP_AER_REQ`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AerReqRepr<'a> {
    /// `SOLNT`: sent with the solicited-event bit.
    pub solicited: bool,
    /// Change of the request limit.
    pub req_lim_delta: i32,
    /// Tag, echoed in the `SRP_AER_RSP`.
    pub tag: u64,
    /// The logical unit the event concerns.
    pub lun: Lun,
    /// The sense data describing the event.
    pub sense: &'a [u8],
}

impl<'a> AerReqRepr<'a> {
    /// Parses an asynchronous event request.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`], [`Error::WrongOpcode`],
    /// [`Error::SenseDataOutOfBounds`].
    pub fn parse<T: AsRef<[u8]> + ?Sized>(iu: &AerReq<&'a T>) -> Result<Self> {
        iu.check_len()?;
        expect_opcode(iu.opcode(), Opcode::AerReq)?;
        Ok(Self {
            solicited: iu.sol_not() & SOLNT != 0,
            req_lim_delta: iu.req_lim_delta(),
            tag: iu.tag(),
            lun: iu.lun(),
            sense: iu.sense()?,
        })
    }

    /// Bytes [`Self::emit`] writes.
    pub const fn buffer_len(&self) -> usize {
        REQ_LEN + self.sense.len()
    }

    /// Writes the IU and its sense data, reserved bytes zeroed.
    ///
    /// # Errors
    ///
    /// [`Error::BufferTooSmall`], [`Error::LengthOverflow`].
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, iu: &mut AerReq<T>) -> Result<()> {
        let sense_len = len_u32(self.sense.len())?;
        check_emit_len(iu.as_bytes(), self.buffer_len())?;
        bytes::zero(iu.as_bytes_mut(), 0, REQ_LEN);
        iu.set_opcode(Opcode::AerReq as u8);
        iu.set_sol_not(if self.solicited { SOLNT } else { 0 });
        iu.set_req_lim_delta(self.req_lim_delta);
        iu.set_tag(self.tag);
        iu.set_lun(self.lun);
        iu.set_sense_data_len(sense_len);
        bytes::write_bytes(iu.as_bytes_mut(), field::SENSE, self.sense);
        Ok(())
    }
}

wire_view! {
    /// A view of `SRP_AER_REQ` (`srp_aer_req`).
    pub struct AerReq, min_len = REQ_LEN, error = Error, truncated = Error::Truncated;
    /// IU type byte (0x82).
    opcode, set_opcode: u8 = field::OPCODE;
    /// Raw `sol_not` byte.
    sol_not, set_sol_not: u8 = field::SOL_NOT;
    /// Request limit delta.
    req_lim_delta, set_req_lim_delta: i32 = field::REQ_LIM_DELTA;
    /// Tag.
    tag, set_tag: u64 = field::TAG;
    /// Logical unit.
    lun, set_lun: Lun = field::LUN;
    /// Length of the sense data that follows the fixed part.
    sense_data_len, set_sense_data_len: u32 = field::SENSE_DATA_LEN;
}

impl<'a, T: AsRef<[u8]> + ?Sized> AerReq<&'a T> {
    /// The sense data.
    ///
    /// # Errors
    ///
    /// [`Error::SenseDataOutOfBounds`] if `sense_data_len` reaches past the
    /// buffer.
    pub fn sense(&self) -> Result<&'a [u8]> {
        let len =
            usize::try_from(self.sense_data_len()).map_err(|_| Error::SenseDataOutOfBounds)?;
        bytes::sub(self.buffer.as_ref(), field::SENSE, len).ok_or(Error::SenseDataOutOfBounds)
    }
}

/// The value of an `SRP_AER_RSP`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AerRspRepr {
    /// The event request's tag.
    pub tag: u64,
}

impl AerRspRepr {
    /// Parses an asynchronous event response.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`], [`Error::WrongOpcode`].
    pub fn parse<T: AsRef<[u8]>>(iu: &AerRsp<T>) -> Result<Self> {
        iu.check_len()?;
        expect_opcode(iu.opcode(), Opcode::AerRsp)?;
        Ok(Self { tag: iu.tag() })
    }

    /// Bytes [`Self::emit`] writes.
    pub const fn buffer_len(&self) -> usize {
        RSP_LEN
    }

    /// Writes the IU, reserved bytes zeroed.
    ///
    /// # Errors
    ///
    /// [`Error::BufferTooSmall`].
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, iu: &mut AerRsp<T>) -> Result<()> {
        check_emit_len(iu.as_bytes(), RSP_LEN)?;
        bytes::zero(iu.as_bytes_mut(), 0, RSP_LEN);
        iu.set_opcode(Opcode::AerRsp as u8);
        iu.set_tag(self.tag);
        Ok(())
    }
}

wire_view! {
    /// A view of `SRP_AER_RSP` (`srp_aer_rsp`).
    pub struct AerRsp, min_len = RSP_LEN, error = Error, truncated = Error::Truncated;
    /// IU type byte (0x42).
    opcode, set_opcode: u8 = field::OPCODE;
    /// Tag.
    tag, set_tag: u64 = field::RSP_TAG;
}

#[cfg(test)]
mod tests {
    use super::*;

    const SENSE: [u8; 18] = [
        0x70, 0, 0x06, 0, 0, 0, 0, 10, 0, 0, 0, 0, 0x3f, 0x0e, 0, 0, 0, 0,
    ];

    #[test]
    fn golden_bytes() {
        let req = AerReqRepr {
            solicited: true,
            req_lim_delta: 1,
            tag: 3,
            lun: Lun::from_index(2).unwrap(),
            sense: &SENSE,
        };
        let mut buf = [0xEEu8; 60];
        req.emit(&mut AerReq::new_unchecked(&mut buf[..])).unwrap();
        let mut expected = [0u8; 54];
        expected[0] = 0x82;
        expected[1] = 1;
        expected[7] = 1;
        expected[15] = 3;
        expected[21] = 2;
        expected[31] = 18;
        expected[36..].copy_from_slice(&SENSE);
        assert_eq!(buf[..54], expected);
        assert_eq!(
            AerReqRepr::parse(&AerReq::new_unchecked(&buf[..54])),
            Ok(req)
        );

        let rsp = AerRspRepr { tag: 3 };
        rsp.emit(&mut AerRsp::new_unchecked(&mut buf[..])).unwrap();
        assert_eq!(
            buf[..16],
            [0x42, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3]
        );
        assert_eq!(
            AerRspRepr::parse(&AerRsp::new_unchecked(&buf[..16])),
            Ok(rsp)
        );
    }

    #[test]
    fn malformed() {
        let mut buf = [0u8; 40];
        buf[0] = 0x82;
        buf[31] = 5; // claims 5 bytes of sense, only 4 present
        assert_eq!(
            AerReqRepr::parse(&AerReq::new_unchecked(&buf[..])),
            Err(Error::SenseDataOutOfBounds)
        );
        buf[28..32].copy_from_slice(&[0xff; 4]);
        assert_eq!(
            AerReqRepr::parse(&AerReq::new_unchecked(&buf[..])),
            Err(Error::SenseDataOutOfBounds)
        );
        assert_eq!(
            AerReqRepr::parse(&AerReq::new_unchecked(&buf[..35])),
            Err(Error::Truncated)
        );
        buf[0] = 0x42;
        assert_eq!(
            AerReqRepr::parse(&AerReq::new_unchecked(&buf[..])),
            Err(Error::WrongOpcode(0x42))
        );
        assert_eq!(
            AerRspRepr::parse(&AerRsp::new_unchecked(&buf[..15])),
            Err(Error::Truncated)
        );
        assert_eq!(
            AerRspRepr::parse(&AerRsp::new_unchecked(&[0x82u8; 16][..])),
            Err(Error::WrongOpcode(0x82))
        );
        let req = AerReqRepr {
            solicited: false,
            req_lim_delta: 0,
            tag: 0,
            lun: Lun::default(),
            sense: &SENSE,
        };
        assert_eq!(
            req.emit(&mut AerReq::new_unchecked(&mut buf[..])),
            Err(Error::BufferTooSmall)
        );
        assert_eq!(
            AerRspRepr { tag: 0 }.emit(&mut AerRsp::new_unchecked(&mut buf[..15])),
            Err(Error::BufferTooSmall)
        );
    }
}
