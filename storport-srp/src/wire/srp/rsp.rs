//! `SRP_RSP` (36 bytes + response data + sense data): the completion of an
//! `SRP_CMD` or `SRP_TSK_MGMT`, carrying credits back to the initiator.
//!
//! The variable part is response data (`resp_data_len` bytes, valid with
//! `RSPVALID`) followed by sense data (`sense_data_len` bytes, valid with
//! `SNSVALID`). A length whose valid flag is clear must be zero here: Linux
//! `ib_srp` places the sense after `resp_data_len` bytes whatever the flag
//! says, so a non-zero length without its flag is ambiguous and rejected.

use static_assertions::const_assert_eq;

use super::{Error, Opcode, Result, SOLNT, check_emit_len, expect_opcode, len_u32};
use crate::wire::{Residual, bytes};

mod field {
    use crate::wire::Field;

    pub const OPCODE: Field = 0..1;
    pub const SOL_NOT: Field = 1..2;
    pub const REQ_LIM_DELTA: Field = 4..8;
    pub const TAG: Field = 8..16;
    pub const FLAGS: Field = 18..19;
    pub const STATUS: Field = 19..20;
    pub const DATA_OUT_RES_CNT: Field = 20..24;
    pub const DATA_IN_RES_CNT: Field = 24..28;
    pub const SENSE_DATA_LEN: Field = 28..32;
    pub const RESP_DATA_LEN: Field = 32..36;
    pub const DATA: usize = 36;
}

/// Size of the fixed part of `SRP_RSP`.
pub const LEN: usize = field::DATA;
const_assert_eq!(field::RESP_DATA_LEN.end, field::DATA);
const_assert_eq!(LEN, 36);

/// `SRP_RSP` flag bits.
mod flag {
    pub const RSPVALID: u8 = 1 << 0;
    pub const SNSVALID: u8 = 1 << 1;
    pub const DOOVER: u8 = 1 << 2;
    pub const DOUNDER: u8 = 1 << 3;
    pub const DIOVER: u8 = 1 << 4;
    pub const DIUNDER: u8 = 1 << 5;
}

/// Decodes one direction's residual. SRP, unlike iSCSI, gives a count
/// without its flag no meaning, so it is rejected rather than ignored.
fn decode_residual(flags: u8, over: u8, under: u8, count: u32) -> Result<Residual> {
    match (flags & over != 0, flags & under != 0) {
        (true, true) => Err(Error::ConflictingResidualFlags),
        (true, false) => Ok(Residual::Overflow(count)),
        (false, true) => Ok(Residual::Underflow(count)),
        (false, false) if count != 0 => Err(Error::LengthWithoutFlag),
        (false, false) => Ok(Residual::None),
    }
}

/// The response code of a task management function, byte 3 of the 4-byte
/// response data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TmResponse {
    /// 0x00: function complete.
    Complete,
    /// 0x04: function not supported.
    NotSupported,
    /// 0x05: function failed.
    Failed,
    /// Any other code, as received.
    Other(u8),
}

impl TmResponse {
    /// The response for a wire code.
    pub const fn from_code(code: u8) -> Self {
        match code {
            0x00 => Self::Complete,
            0x04 => Self::NotSupported,
            0x05 => Self::Failed,
            other => Self::Other(other),
        }
    }

    /// The wire code.
    pub const fn code(self) -> u8 {
        match self {
            Self::Complete => 0x00,
            Self::NotSupported => 0x04,
            Self::Failed => 0x05,
            Self::Other(code) => code,
        }
    }

    /// The 4-byte response data carrying this code, as Linux `ib_srpt`
    /// builds it.
    pub const fn response_data(self) -> [u8; 4] {
        [0, 0, 0, self.code()]
    }
}

/// The value of an `SRP_RSP`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RspRepr<'a> {
    /// `SOLNT`: sent with the solicited-event bit.
    pub solicited: bool,
    /// Credits returned (signed).
    pub req_lim_delta: i32,
    /// The command's tag.
    pub tag: u64,
    /// SCSI status byte.
    pub status: u8,
    /// DATA-OUT residual.
    pub data_out_residual: Residual,
    /// DATA-IN residual.
    pub data_in_residual: Residual,
    /// Response data (`RSPVALID`); 4 bytes for a task management response.
    pub response_data: Option<&'a [u8]>,
    /// Sense data (`SNSVALID`).
    pub sense: Option<&'a [u8]>,
}

impl<'a> RspRepr<'a> {
    /// Parses a response.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`], [`Error::WrongOpcode`],
    /// [`Error::ConflictingResidualFlags`], [`Error::LengthWithoutFlag`],
    /// [`Error::ResponseDataOutOfBounds`], [`Error::SenseDataOutOfBounds`].
    ///
    /// Inlined: once per command on the initiator's receive path.
    #[inline]
    pub fn parse<T: AsRef<[u8]> + ?Sized>(iu: &Rsp<&'a T>) -> Result<Self> {
        iu.check_len()?;
        expect_opcode(iu.opcode(), Opcode::Rsp)?;
        let flags = iu.flags();
        let data_out_residual =
            decode_residual(flags, flag::DOOVER, flag::DOUNDER, iu.data_out_res_cnt())?;
        let data_in_residual =
            decode_residual(flags, flag::DIOVER, flag::DIUNDER, iu.data_in_res_cnt())?;
        Ok(Self {
            solicited: iu.sol_not() & SOLNT != 0,
            req_lim_delta: iu.req_lim_delta(),
            tag: iu.tag(),
            status: iu.status(),
            data_out_residual,
            data_in_residual,
            response_data: iu.response_data()?,
            sense: iu.sense()?,
        })
    }

    /// The task management response code, if this answers an
    /// `SRP_TSK_MGMT` (4 bytes of response data).
    pub fn tm_response(&self) -> Option<TmResponse> {
        match self.response_data {
            Some(&[_, _, _, code]) => Some(TmResponse::from_code(code)),
            _ => None,
        }
    }

    /// Bytes [`Self::emit`] writes.
    pub const fn buffer_len(&self) -> usize {
        let resp = match self.response_data {
            Some(data) => data.len(),
            None => 0,
        };
        let sense = match self.sense {
            Some(data) => data.len(),
            None => 0,
        };
        LEN + resp + sense
    }

    /// Writes the response, its response data and its sense data.
    ///
    /// # Errors
    ///
    /// [`Error::BufferTooSmall`], [`Error::LengthOverflow`].
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, iu: &mut Rsp<T>) -> Result<()> {
        let resp = self.response_data.unwrap_or(&[]);
        let sense = self.sense.unwrap_or(&[]);
        let resp_len = len_u32(resp.len())?;
        let sense_len = len_u32(sense.len())?;
        check_emit_len(iu.as_bytes(), self.buffer_len())?;
        bytes::zero(iu.as_bytes_mut(), 0, LEN);
        let (out_flag, out_count) = self.data_out_residual.encode(flag::DOOVER, flag::DOUNDER);
        let (in_flag, in_count) = self.data_in_residual.encode(flag::DIOVER, flag::DIUNDER);
        let mut flags = out_flag | in_flag;
        if self.response_data.is_some() {
            flags |= flag::RSPVALID;
        }
        if self.sense.is_some() {
            flags |= flag::SNSVALID;
        }
        iu.set_opcode(Opcode::Rsp as u8);
        iu.set_sol_not(if self.solicited { SOLNT } else { 0 });
        iu.set_req_lim_delta(self.req_lim_delta);
        iu.set_tag(self.tag);
        iu.set_flags(flags);
        iu.set_status(self.status);
        iu.set_data_out_res_cnt(out_count);
        iu.set_data_in_res_cnt(in_count);
        iu.set_sense_data_len(sense_len);
        iu.set_resp_data_len(resp_len);
        let buf = iu.as_bytes_mut();
        bytes::write_bytes(buf, field::DATA, resp);
        bytes::write_bytes(buf, field::DATA + resp.len(), sense);
        Ok(())
    }
}

wire_view! {
    /// A view of `SRP_RSP` (`srp_rsp`).
    pub struct Rsp, min_len = LEN, error = Error, truncated = Error::Truncated;
    /// IU type byte (0xC1).
    opcode, set_opcode: u8 = field::OPCODE;
    /// Raw `sol_not` byte.
    sol_not, set_sol_not: u8 = field::SOL_NOT;
    /// Request limit delta.
    req_lim_delta, set_req_lim_delta: i32 = field::REQ_LIM_DELTA;
    /// Tag.
    tag, set_tag: u64 = field::TAG;
    /// Raw flags (RSPVALID, SNSVALID, DOOVER, DOUNDER, DIOVER, DIUNDER).
    flags, set_flags: u8 = field::FLAGS;
    /// SCSI status.
    status, set_status: u8 = field::STATUS;
    /// DATA-OUT residual count.
    data_out_res_cnt, set_data_out_res_cnt: u32 = field::DATA_OUT_RES_CNT;
    /// DATA-IN residual count.
    data_in_res_cnt, set_data_in_res_cnt: u32 = field::DATA_IN_RES_CNT;
    /// Sense data length.
    sense_data_len, set_sense_data_len: u32 = field::SENSE_DATA_LEN;
    /// Response data length.
    resp_data_len, set_resp_data_len: u32 = field::RESP_DATA_LEN;
}

impl<'a, T: AsRef<[u8]> + ?Sized> Rsp<&'a T> {
    /// The response data, `None` without `RSPVALID`.
    ///
    /// # Errors
    ///
    /// [`Error::LengthWithoutFlag`] (a length without `RSPVALID`),
    /// [`Error::ResponseDataOutOfBounds`].
    pub fn response_data(&self) -> Result<Option<&'a [u8]>> {
        let len = self.resp_data_len();
        if self.flags() & flag::RSPVALID == 0 {
            return if len == 0 {
                Ok(None)
            } else {
                Err(Error::LengthWithoutFlag)
            };
        }
        let len = usize::try_from(len).map_err(|_| Error::ResponseDataOutOfBounds)?;
        bytes::sub(self.buffer.as_ref(), field::DATA, len)
            .map(Some)
            .ok_or(Error::ResponseDataOutOfBounds)
    }

    /// The sense data, `None` without `SNSVALID`. It follows the response
    /// data.
    ///
    /// # Errors
    ///
    /// [`Error::LengthWithoutFlag`], [`Error::ResponseDataOutOfBounds`],
    /// [`Error::SenseDataOutOfBounds`].
    pub fn sense(&self) -> Result<Option<&'a [u8]>> {
        let len = self.sense_data_len();
        if self.flags() & flag::SNSVALID == 0 {
            return if len == 0 {
                Ok(None)
            } else {
                Err(Error::LengthWithoutFlag)
            };
        }
        let start = field::DATA + self.response_data()?.map_or(0, <[u8]>::len);
        let len = usize::try_from(len).map_err(|_| Error::SenseDataOutOfBounds)?;
        bytes::sub(self.buffer.as_ref(), start, len)
            .map(Some)
            .ok_or(Error::SenseDataOutOfBounds)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CHECK CONDITION with fixed-format sense (ILLEGAL REQUEST, INVALID
    /// FIELD IN CDB), DATA-IN underflow of 512 bytes, one credit back.
    #[test]
    fn check_condition_golden_bytes() {
        let sense = [
            0x70, 0, 0x05, 0, 0, 0, 0, 10, 0, 0, 0, 0, 0x24, 0x00, 0, 0, 0, 0,
        ];
        let repr = RspRepr {
            solicited: false,
            req_lim_delta: 1,
            tag: 0x10,
            status: 0x02,
            data_out_residual: Residual::None,
            data_in_residual: Residual::Underflow(512),
            response_data: None,
            sense: Some(&sense),
        };
        let mut expected = [0u8; 54];
        expected[0] = 0xC1;
        expected[7] = 1;
        expected[15] = 0x10;
        expected[18] = 0x02 | 0x20; // SNSVALID | DIUNDER
        expected[19] = 0x02;
        expected[24..28].copy_from_slice(&[0, 0, 2, 0]);
        expected[31] = 18;
        expected[36..].copy_from_slice(&sense);
        let mut buf = [0xEEu8; 54];
        repr.emit(&mut Rsp::new_unchecked(&mut buf[..])).unwrap();
        assert_eq!(buf, expected);
        assert_eq!(RspRepr::parse(&Rsp::new_unchecked(&buf[..])), Ok(repr));
        assert_eq!(repr.tm_response(), None);
    }

    /// A task management response as `ib_srpt` sends it: RSPVALID, 4 bytes
    /// of response data, code in byte 3.
    #[test]
    fn tm_response_golden_bytes() {
        let data = TmResponse::NotSupported.response_data();
        let repr = RspRepr {
            solicited: false,
            req_lim_delta: 1,
            tag: 0x8000_0000,
            status: 0,
            data_out_residual: Residual::None,
            data_in_residual: Residual::None,
            response_data: Some(&data),
            sense: None,
        };
        let mut buf = [0u8; 40];
        repr.emit(&mut Rsp::new_unchecked(&mut buf[..])).unwrap();
        assert_eq!(buf[18], 0x01);
        assert_eq!(buf[32..40], [0, 0, 0, 4, 0, 0, 0, 4]);
        let parsed = RspRepr::parse(&Rsp::new_unchecked(&buf[..])).unwrap();
        assert_eq!(parsed.tm_response(), Some(TmResponse::NotSupported));
        for code in 0..=u8::MAX {
            assert_eq!(TmResponse::from_code(code).code(), code);
        }
    }

    #[test]
    fn response_data_then_sense() {
        let resp = [1, 2, 3, 4, 5, 6, 7, 8];
        let sense = [9, 10, 11];
        let repr = RspRepr {
            solicited: true,
            req_lim_delta: -3,
            tag: 1,
            status: 0,
            data_out_residual: Residual::Overflow(7),
            data_in_residual: Residual::None,
            response_data: Some(&resp),
            sense: Some(&sense),
        };
        let mut buf = [0u8; 47];
        repr.emit(&mut Rsp::new_unchecked(&mut buf[..])).unwrap();
        assert_eq!(buf[36..], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]);
        assert_eq!(RspRepr::parse(&Rsp::new_unchecked(&buf[..])), Ok(repr));
        assert_eq!(
            RspRepr::parse(&Rsp::new_unchecked(&buf[..46])),
            Err(Error::SenseDataOutOfBounds)
        );
        assert_eq!(
            RspRepr::parse(&Rsp::new_unchecked(&buf[..43])),
            Err(Error::ResponseDataOutOfBounds)
        );
        assert_eq!(
            repr.emit(&mut Rsp::new_unchecked(&mut buf[..46])),
            Err(Error::BufferTooSmall)
        );
    }

    #[test]
    fn malformed_flags() {
        let mut buf = [0u8; 36];
        buf[0] = 0xC1;
        buf[18] = 0x04 | 0x08;
        assert_eq!(
            RspRepr::parse(&Rsp::new_unchecked(&buf[..])),
            Err(Error::ConflictingResidualFlags)
        );
        buf[18] = 0x10 | 0x20;
        assert_eq!(
            RspRepr::parse(&Rsp::new_unchecked(&buf[..])),
            Err(Error::ConflictingResidualFlags)
        );
        buf[18] = 0;
        buf[23] = 1; // DATA-OUT residual without a flag
        assert_eq!(
            RspRepr::parse(&Rsp::new_unchecked(&buf[..])),
            Err(Error::LengthWithoutFlag)
        );
        buf[23] = 0;
        buf[31] = 1; // sense length without SNSVALID
        assert_eq!(
            RspRepr::parse(&Rsp::new_unchecked(&buf[..])),
            Err(Error::LengthWithoutFlag)
        );
        buf[31] = 0;
        buf[35] = 1; // response length without RSPVALID
        assert_eq!(
            RspRepr::parse(&Rsp::new_unchecked(&buf[..])),
            Err(Error::LengthWithoutFlag)
        );
        buf[35] = 0;
        assert!(RspRepr::parse(&Rsp::new_unchecked(&buf[..])).is_ok());
        assert_eq!(
            RspRepr::parse(&Rsp::new_unchecked(&buf[..35])),
            Err(Error::Truncated)
        );
        buf[0] = 0xC0;
        assert_eq!(
            RspRepr::parse(&Rsp::new_unchecked(&buf[..])),
            Err(Error::WrongOpcode(0xC0))
        );
    }

    #[test]
    fn hostile_lengths() {
        let mut buf = [0u8; 36];
        buf[0] = 0xC1;
        buf[18] = 0x03;
        buf[28..32].copy_from_slice(&[0xff; 4]);
        buf[32..36].copy_from_slice(&[0xff; 4]);
        assert_eq!(
            RspRepr::parse(&Rsp::new_unchecked(&buf[..])),
            Err(Error::ResponseDataOutOfBounds)
        );
        buf[32..36].copy_from_slice(&[0; 4]);
        assert_eq!(
            RspRepr::parse(&Rsp::new_unchecked(&buf[..])),
            Err(Error::SenseDataOutOfBounds)
        );
    }
}
