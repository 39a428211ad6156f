//! SCSI Command (0x01) and SCSI Response (0x21), and the sense data a
//! response carries in its data segment (2-byte SenseLength + sense, then
//! optional iSCSI response data).

use super::serial::SerialNumber;
use super::{Error, FINAL, Opcode, Result, expect_opcode, start_emit};
use crate::wire::{Lun, Residual, bytes};

mod field {
    use crate::wire::Field;

    pub const LUN: Field = 8..16;
    pub const ITT: Field = 16..20;
    pub const EXPECTED_DATA_LEN: Field = 20..24;
    pub const CMD_SN: Field = 24..28;
    pub const EXP_STAT_SN: Field = 28..32;
    pub const CDB: Field = 32..48;

    // Response.
    pub const RESPONSE: Field = 2..3;
    pub const STATUS: Field = 3..4;
    pub const SNACK_TAG: Field = 20..24;
    pub const STAT_SN: Field = 24..28;
    pub const EXP_CMD_SN: Field = 28..32;
    pub const MAX_CMD_SN: Field = 32..36;
    pub const EXP_DATA_SN: Field = 36..40;
    pub const BIDI_READ_RESIDUAL: Field = 40..44;
    pub const RESIDUAL: Field = 44..48;
}

/// Command flags.
mod flag {
    pub const READ: u8 = 0x40;
    pub const WRITE: u8 = 0x20;
    pub const ATTR_MASK: u8 = 0x07;

    // Response.
    pub const BIDI_OVERFLOW: u8 = 0x10;
    pub const BIDI_UNDERFLOW: u8 = 0x08;
    pub const OVERFLOW: u8 = 0x04;
    pub const UNDERFLOW: u8 = 0x02;
}

/// SCSI Response "Response" codes.
pub mod response {
    /// The command completed at the target (the status byte is valid).
    pub const COMPLETED: u8 = 0x00;
    /// The target failed the command.
    pub const TARGET_FAILURE: u8 = 0x01;
}

/// The iSCSI task attribute (ATTR, three bits). Codes iSCSI does not define
/// are preserved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum TaskAttr {
    /// 0: untagged.
    Untagged,
    /// 1: SIMPLE.
    #[default]
    Simple,
    /// 2: ORDERED.
    Ordered,
    /// 3: HEAD OF QUEUE.
    HeadOfQueue,
    /// 4: ACA.
    Aca,
    /// 5..=7, as received.
    Other(u8),
}

impl TaskAttr {
    /// The attribute for a 3-bit code.
    pub const fn from_code(code: u8) -> Self {
        match code & flag::ATTR_MASK {
            0 => Self::Untagged,
            1 => Self::Simple,
            2 => Self::Ordered,
            3 => Self::HeadOfQueue,
            4 => Self::Aca,
            other => Self::Other(other),
        }
    }

    /// The 3-bit code.
    pub const fn code(self) -> u8 {
        match self {
            Self::Untagged => 0,
            Self::Simple => 1,
            Self::Ordered => 2,
            Self::HeadOfQueue => 3,
            Self::Aca => 4,
            Self::Other(code) => code & flag::ATTR_MASK,
        }
    }
}

/// The value of a SCSI Command BHS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ScsiCommandRepr {
    /// Immediate delivery (I bit).
    pub immediate: bool,
    /// F: no unsolicited Data-Out PDUs follow.
    pub is_final: bool,
    /// R: the command reads (DATA-IN).
    pub read: bool,
    /// W: the command writes (DATA-OUT).
    pub write: bool,
    /// Task attribute.
    pub attr: TaskAttr,
    /// Logical unit.
    pub lun: Lun,
    /// Initiator task tag.
    pub itt: u32,
    /// Expected data transfer length.
    pub expected_data_len: u32,
    /// CmdSN.
    pub cmd_sn: SerialNumber,
    /// ExpStatSN.
    pub exp_stat_sn: SerialNumber,
    /// The first 16 CDB bytes (longer CDBs continue in an AHS).
    pub cdb: [u8; 16],
}

impl ScsiCommandRepr {
    /// Parses a SCSI Command BHS.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`], [`Error::WrongOpcode`].
    pub fn parse<T: AsRef<[u8]>>(pdu: &ScsiCommand<T>) -> Result<Self> {
        pdu.check_len()?;
        expect_opcode(pdu.opcode_code(), Opcode::ScsiCommand)?;
        let flags = pdu.flags();
        Ok(Self {
            immediate: pdu.immediate(),
            is_final: flags & FINAL != 0,
            read: flags & flag::READ != 0,
            write: flags & flag::WRITE != 0,
            attr: TaskAttr::from_code(flags),
            lun: pdu.lun(),
            itt: pdu.itt(),
            expected_data_len: pdu.expected_data_len(),
            cmd_sn: pdu.cmd_sn(),
            exp_stat_sn: pdu.exp_stat_sn(),
            cdb: pdu.cdb(),
        })
    }

    /// Writes the BHS.
    ///
    /// # Errors
    ///
    /// [`Error::BufferTooSmall`].
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, pdu: &mut ScsiCommand<T>) -> Result<()> {
        start_emit(pdu.as_bytes_mut(), Opcode::ScsiCommand, self.immediate)?;
        let mut flags = self.attr.code();
        if self.is_final {
            flags |= FINAL;
        }
        if self.read {
            flags |= flag::READ;
        }
        if self.write {
            flags |= flag::WRITE;
        }
        pdu.set_flags(flags);
        pdu.set_lun(self.lun);
        pdu.set_itt(self.itt);
        pdu.set_expected_data_len(self.expected_data_len);
        pdu.set_cmd_sn(self.cmd_sn);
        pdu.set_exp_stat_sn(self.exp_stat_sn);
        pdu.set_cdb(self.cdb);
        Ok(())
    }
}

bhs_view! {
    /// A view of a SCSI Command BHS.
    pub struct ScsiCommand;
    /// Logical unit.
    lun, set_lun: Lun = field::LUN;
    /// Initiator task tag.
    itt, set_itt: u32 = field::ITT;
    /// Expected data transfer length.
    expected_data_len, set_expected_data_len: u32 = field::EXPECTED_DATA_LEN;
    /// CmdSN.
    cmd_sn, set_cmd_sn: SerialNumber = field::CMD_SN;
    /// ExpStatSN.
    exp_stat_sn, set_exp_stat_sn: SerialNumber = field::EXP_STAT_SN;
    /// CDB (first 16 bytes).
    cdb, set_cdb: [u8; 16] = field::CDB;
}

/// The value of a SCSI Response BHS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ScsiResponseRepr {
    /// Response code (see [`response`]); the status is valid only for
    /// [`response::COMPLETED`].
    pub response: u8,
    /// SCSI status byte.
    pub status: u8,
    /// Residual of the (read, for bidirectional commands) transfer.
    pub residual: Residual,
    /// Residual of the read part of a bidirectional command.
    pub bidi_read_residual: Residual,
    /// Initiator task tag.
    pub itt: u32,
    /// SNACK tag (error recovery only; 0 otherwise).
    pub snack_tag: u32,
    /// StatSN.
    pub stat_sn: SerialNumber,
    /// ExpCmdSN.
    pub exp_cmd_sn: SerialNumber,
    /// MaxCmdSN.
    pub max_cmd_sn: SerialNumber,
    /// ExpDataSN: Data-In PDUs the target sent (0 under iSER).
    pub exp_data_sn: u32,
}

/// Decodes a residual. RFC 7143 says a count without its flag must be
/// ignored on reception, so it is.
pub(crate) fn decode_residual(flags: u8, over: u8, under: u8, count: u32) -> Result<Residual> {
    match (flags & over != 0, flags & under != 0) {
        (true, true) => Err(Error::ConflictingResidualFlags),
        (true, false) => Ok(Residual::Overflow(count)),
        (false, true) => Ok(Residual::Underflow(count)),
        (false, false) => Ok(Residual::None),
    }
}

impl ScsiResponseRepr {
    /// Parses a SCSI Response BHS.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`], [`Error::WrongOpcode`],
    /// [`Error::ConflictingResidualFlags`].
    pub fn parse<T: AsRef<[u8]>>(pdu: &ScsiResponse<T>) -> Result<Self> {
        pdu.check_len()?;
        expect_opcode(pdu.opcode_code(), Opcode::ScsiResponse)?;
        let flags = pdu.flags();
        Ok(Self {
            response: pdu.response(),
            status: pdu.status(),
            residual: decode_residual(flags, flag::OVERFLOW, flag::UNDERFLOW, pdu.residual())?,
            bidi_read_residual: decode_residual(
                flags,
                flag::BIDI_OVERFLOW,
                flag::BIDI_UNDERFLOW,
                pdu.bidi_read_residual(),
            )?,
            itt: pdu.itt(),
            snack_tag: pdu.snack_tag(),
            stat_sn: pdu.stat_sn(),
            exp_cmd_sn: pdu.exp_cmd_sn(),
            max_cmd_sn: pdu.max_cmd_sn(),
            exp_data_sn: pdu.exp_data_sn(),
        })
    }

    /// Writes the BHS.
    ///
    /// # Errors
    ///
    /// [`Error::BufferTooSmall`].
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, pdu: &mut ScsiResponse<T>) -> Result<()> {
        start_emit(pdu.as_bytes_mut(), Opcode::ScsiResponse, false)?;
        let (flag_rd, residual) = self.residual.encode(flag::OVERFLOW, flag::UNDERFLOW);
        let (flag_bidi, bidi) = self
            .bidi_read_residual
            .encode(flag::BIDI_OVERFLOW, flag::BIDI_UNDERFLOW);
        pdu.set_flags(FINAL | flag_rd | flag_bidi);
        pdu.set_response(self.response);
        pdu.set_status(self.status);
        pdu.set_itt(self.itt);
        pdu.set_snack_tag(self.snack_tag);
        pdu.set_stat_sn(self.stat_sn);
        pdu.set_exp_cmd_sn(self.exp_cmd_sn);
        pdu.set_max_cmd_sn(self.max_cmd_sn);
        pdu.set_exp_data_sn(self.exp_data_sn);
        pdu.set_bidi_read_residual(bidi);
        pdu.set_residual(residual);
        Ok(())
    }
}

bhs_view! {
    /// A view of a SCSI Response BHS.
    pub struct ScsiResponse;
    /// Response code.
    response, set_response: u8 = field::RESPONSE;
    /// SCSI status.
    status, set_status: u8 = field::STATUS;
    /// Initiator task tag.
    itt, set_itt: u32 = field::ITT;
    /// SNACK tag.
    snack_tag, set_snack_tag: u32 = field::SNACK_TAG;
    /// StatSN.
    stat_sn, set_stat_sn: SerialNumber = field::STAT_SN;
    /// ExpCmdSN.
    exp_cmd_sn, set_exp_cmd_sn: SerialNumber = field::EXP_CMD_SN;
    /// MaxCmdSN.
    max_cmd_sn, set_max_cmd_sn: SerialNumber = field::MAX_CMD_SN;
    /// ExpDataSN.
    exp_data_sn, set_exp_data_sn: u32 = field::EXP_DATA_SN;
    /// Bidirectional read residual count.
    bidi_read_residual, set_bidi_read_residual: u32 = field::BIDI_READ_RESIDUAL;
    /// Residual count.
    residual, set_residual: u32 = field::RESIDUAL;
}

/// The data segment of a SCSI Response (and of a SCSI-event Async
/// Message): `SenseLength` (2 bytes), the sense data, then any iSCSI
/// response data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct SenseData<'a> {
    /// The sense data (empty when the segment is empty).
    pub sense: &'a [u8],
    /// iSCSI response data after the sense (rarely present).
    pub response_data: &'a [u8],
}

impl<'a> SenseData<'a> {
    /// Parses a data segment; an empty segment has no sense.
    ///
    /// # Errors
    ///
    /// [`Error::SenseOutOfBounds`] if the segment is one byte long or the
    /// sense length reaches past it.
    pub fn parse(segment: &'a [u8]) -> Result<Self> {
        if segment.is_empty() {
            return Ok(Self::default());
        }
        let len_bytes = bytes::sub(segment, 0, 2).ok_or(Error::SenseOutOfBounds)?;
        let len = usize::from(u16::from_be_bytes(bytes::read_array(len_bytes, 0)));
        let sense = bytes::sub(segment, 2, len).ok_or(Error::SenseOutOfBounds)?;
        let response_data = segment.get(2 + len..).unwrap_or(&[]);
        Ok(Self {
            sense,
            response_data,
        })
    }

    /// Bytes [`Self::emit`] writes: 0 with neither sense nor response data.
    pub const fn buffer_len(&self) -> usize {
        if self.sense.is_empty() && self.response_data.is_empty() {
            0
        } else {
            2 + self.sense.len() + self.response_data.len()
        }
    }

    /// Writes the data segment and returns its length.
    ///
    /// # Errors
    ///
    /// [`Error::SenseOutOfBounds`] for sense longer than 65535 bytes,
    /// [`Error::BufferTooSmall`].
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize> {
        let len = self.buffer_len();
        if len == 0 {
            return Ok(0);
        }
        let sense_len = u16::try_from(self.sense.len()).map_err(|_| Error::SenseOutOfBounds)?;
        let out = bytes::sub_mut(buf, 0, len).ok_or(Error::BufferTooSmall)?;
        bytes::write_bytes(out, 0, &sense_len.to_be_bytes());
        bytes::write_bytes(out, 2, self.sense);
        bytes::write_bytes(out, 2 + self.sense.len(), self.response_data);
        Ok(len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sense_data() {
        let seg = [0, 3, 0x70, 0, 5, 0xAA];
        let parsed = SenseData::parse(&seg).unwrap();
        assert_eq!(parsed.sense, &[0x70, 0, 5]);
        assert_eq!(parsed.response_data, &[0xAA]);
        let mut out = [0u8; 6];
        assert_eq!(parsed.emit(&mut out), Ok(6));
        assert_eq!(out, seg);
        assert_eq!(SenseData::parse(&[]), Ok(SenseData::default()));
        assert_eq!(SenseData::default().emit(&mut []), Ok(0));
        assert_eq!(SenseData::parse(&[0]), Err(Error::SenseOutOfBounds));
        assert_eq!(
            SenseData::parse(&[0, 4, 1, 2, 3]),
            Err(Error::SenseOutOfBounds)
        );
        assert_eq!(parsed.emit(&mut out[..5]), Err(Error::BufferTooSmall));
        let huge = [0u8; 65536];
        let too_long = SenseData {
            sense: &huge,
            response_data: &[],
        };
        let mut big = vec![0u8; 70000];
        assert_eq!(too_long.emit(&mut big), Err(Error::SenseOutOfBounds));
    }

    #[test]
    fn residual_flags() {
        let mut buf = [0u8; 48];
        buf[0] = 0x21;
        buf[1] = 0x80 | 0x04 | 0x02;
        assert_eq!(
            ScsiResponseRepr::parse(&ScsiResponse::new_unchecked(&buf[..])),
            Err(Error::ConflictingResidualFlags)
        );
        buf[1] = 0x80 | 0x10 | 0x08;
        assert_eq!(
            ScsiResponseRepr::parse(&ScsiResponse::new_unchecked(&buf[..])),
            Err(Error::ConflictingResidualFlags)
        );
        // A count without a flag is ignored, as RFC 7143 says.
        buf[1] = 0x80;
        buf[47] = 9;
        let repr = ScsiResponseRepr::parse(&ScsiResponse::new_unchecked(&buf[..])).unwrap();
        assert_eq!(repr.residual, Residual::None);
        assert_eq!(
            ScsiResponseRepr::parse(&ScsiResponse::new_unchecked(&buf[..47])),
            Err(Error::Truncated)
        );
        assert_eq!(
            ScsiCommandRepr::parse(&ScsiCommand::new_unchecked(&buf[..])),
            Err(Error::WrongOpcode(0x21))
        );
    }

    #[test]
    fn task_attr_codes() {
        for code in 0..8u8 {
            let attr = TaskAttr::from_code(code);
            assert_eq!(attr.code(), code);
            assert_eq!(matches!(attr, TaskAttr::Other(_)), code > 4);
        }
    }
}
