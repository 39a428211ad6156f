//! SCSI Data-Out (0x05) and SCSI Data-In (0x25).
//!
//! Under iSER only *unsolicited* Data-Out PDUs travel (write data within
//! FirstBurstLength when InitialR2T=No); Data-In never does, since the
//! target RDMA-WRITEs read data. Data-In still parses, so a target sending
//! one gets a defined outcome.

use super::scsi::decode_residual;
use super::serial::SerialNumber;
use super::{Error, FINAL, Opcode, Result, expect_opcode, start_emit};
use crate::wire::{Lun, Residual};

mod field {
    use crate::wire::Field;

    pub const LUN: Field = 8..16;
    pub const ITT: Field = 16..20;
    pub const TTT: Field = 20..24;
    pub const EXP_STAT_SN: Field = 28..32;
    pub const DATA_SN: Field = 36..40;
    pub const BUFFER_OFFSET: Field = 40..44;

    // Data-In.
    pub const STATUS: Field = 3..4;
    pub const STAT_SN: Field = 24..28;
    pub const EXP_CMD_SN: Field = 28..32;
    pub const MAX_CMD_SN: Field = 32..36;
    pub const RESIDUAL: Field = 44..48;
}

/// Data-In flags.
mod flag {
    pub const ACKNOWLEDGE: u8 = 0x40;
    pub const OVERFLOW: u8 = 0x04;
    pub const UNDERFLOW: u8 = 0x02;
    pub const STATUS: u8 = 0x01;
}

/// The value of a Data-Out BHS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DataOutRepr {
    /// F: the last PDU of this sequence.
    pub is_final: bool,
    /// Logical unit.
    pub lun: Lun,
    /// ITT of the command.
    pub itt: u32,
    /// TTT of the R2T answered; the reserved tag for unsolicited data.
    pub ttt: u32,
    /// ExpStatSN.
    pub exp_stat_sn: SerialNumber,
    /// DataSN within the sequence.
    pub data_sn: SerialNumber,
    /// Offset of this data in the command's buffer.
    pub buffer_offset: u32,
}

impl DataOutRepr {
    /// Parses a Data-Out BHS.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`], [`Error::WrongOpcode`].
    pub fn parse<T: AsRef<[u8]>>(pdu: &DataOut<T>) -> Result<Self> {
        pdu.check_len()?;
        expect_opcode(pdu.opcode_code(), Opcode::DataOut)?;
        Ok(Self {
            is_final: pdu.flags() & FINAL != 0,
            lun: pdu.lun(),
            itt: pdu.itt(),
            ttt: pdu.ttt(),
            exp_stat_sn: pdu.exp_stat_sn(),
            data_sn: pdu.data_sn(),
            buffer_offset: pdu.buffer_offset(),
        })
    }

    /// Writes the BHS.
    ///
    /// # Errors
    ///
    /// [`Error::BufferTooSmall`].
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, pdu: &mut DataOut<T>) -> Result<()> {
        start_emit(pdu.as_bytes_mut(), Opcode::DataOut, false)?;
        pdu.set_flags(if self.is_final { FINAL } else { 0 });
        pdu.set_lun(self.lun);
        pdu.set_itt(self.itt);
        pdu.set_ttt(self.ttt);
        pdu.set_exp_stat_sn(self.exp_stat_sn);
        pdu.set_data_sn(self.data_sn);
        pdu.set_buffer_offset(self.buffer_offset);
        Ok(())
    }
}

bhs_view! {
    /// A view of a Data-Out BHS.
    pub struct DataOut;
    /// Logical unit.
    lun, set_lun: Lun = field::LUN;
    /// Initiator task tag.
    itt, set_itt: u32 = field::ITT;
    /// Target transfer tag.
    ttt, set_ttt: u32 = field::TTT;
    /// ExpStatSN.
    exp_stat_sn, set_exp_stat_sn: SerialNumber = field::EXP_STAT_SN;
    /// DataSN.
    data_sn, set_data_sn: SerialNumber = field::DATA_SN;
    /// Buffer offset.
    buffer_offset, set_buffer_offset: u32 = field::BUFFER_OFFSET;
}

/// The status part of a Data-In PDU that completes its command (S bit).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DataInStatus {
    /// SCSI status.
    pub status: u8,
    /// StatSN.
    pub stat_sn: SerialNumber,
    /// Residual.
    pub residual: Residual,
}

/// The value of a Data-In BHS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DataInRepr {
    /// F: the last PDU of this sequence.
    pub is_final: bool,
    /// A: the target asks for a DataACK SNACK (error recovery only).
    pub acknowledge: bool,
    /// Present when the PDU carries the command's status (S bit).
    pub status: Option<DataInStatus>,
    /// Logical unit.
    pub lun: Lun,
    /// ITT of the command.
    pub itt: u32,
    /// TTT (with A), else the reserved tag.
    pub ttt: u32,
    /// ExpCmdSN.
    pub exp_cmd_sn: SerialNumber,
    /// MaxCmdSN.
    pub max_cmd_sn: SerialNumber,
    /// DataSN.
    pub data_sn: SerialNumber,
    /// Offset of this data in the command's buffer.
    pub buffer_offset: u32,
}

impl DataInRepr {
    /// Parses a Data-In BHS. StatSN and the residual are read only with the
    /// S bit, as RFC 7143 defines them only then.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`], [`Error::WrongOpcode`],
    /// [`Error::StatusWithoutFinal`], [`Error::ConflictingResidualFlags`].
    pub fn parse<T: AsRef<[u8]>>(pdu: &DataIn<T>) -> Result<Self> {
        pdu.check_len()?;
        expect_opcode(pdu.opcode_code(), Opcode::DataIn)?;
        let flags = pdu.flags();
        let is_final = flags & FINAL != 0;
        let status = if flags & flag::STATUS != 0 {
            if !is_final {
                return Err(Error::StatusWithoutFinal);
            }
            Some(DataInStatus {
                status: pdu.status(),
                stat_sn: pdu.stat_sn(),
                residual: decode_residual(flags, flag::OVERFLOW, flag::UNDERFLOW, pdu.residual())?,
            })
        } else {
            None
        };
        Ok(Self {
            is_final,
            acknowledge: flags & flag::ACKNOWLEDGE != 0,
            status,
            lun: pdu.lun(),
            itt: pdu.itt(),
            ttt: pdu.ttt(),
            exp_cmd_sn: pdu.exp_cmd_sn(),
            max_cmd_sn: pdu.max_cmd_sn(),
            data_sn: pdu.data_sn(),
            buffer_offset: pdu.buffer_offset(),
        })
    }

    /// Writes the BHS. With a status, the F bit is set whatever
    /// `is_final` says (RFC 7143 requires it).
    ///
    /// # Errors
    ///
    /// [`Error::BufferTooSmall`].
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, pdu: &mut DataIn<T>) -> Result<()> {
        start_emit(pdu.as_bytes_mut(), Opcode::DataIn, false)?;
        let mut flags = if self.is_final { FINAL } else { 0 };
        if self.acknowledge {
            flags |= flag::ACKNOWLEDGE;
        }
        if let Some(status) = self.status {
            let (residual_flag, count) = status.residual.encode(flag::OVERFLOW, flag::UNDERFLOW);
            flags |= FINAL | flag::STATUS | residual_flag;
            pdu.set_status(status.status);
            pdu.set_stat_sn(status.stat_sn);
            pdu.set_residual(count);
        }
        pdu.set_flags(flags);
        pdu.set_lun(self.lun);
        pdu.set_itt(self.itt);
        pdu.set_ttt(self.ttt);
        pdu.set_exp_cmd_sn(self.exp_cmd_sn);
        pdu.set_max_cmd_sn(self.max_cmd_sn);
        pdu.set_data_sn(self.data_sn);
        pdu.set_buffer_offset(self.buffer_offset);
        Ok(())
    }
}

bhs_view! {
    /// A view of a Data-In BHS.
    pub struct DataIn;
    /// SCSI status (with S).
    status, set_status: u8 = field::STATUS;
    /// Logical unit.
    lun, set_lun: Lun = field::LUN;
    /// Initiator task tag.
    itt, set_itt: u32 = field::ITT;
    /// Target transfer tag.
    ttt, set_ttt: u32 = field::TTT;
    /// StatSN (with S).
    stat_sn, set_stat_sn: SerialNumber = field::STAT_SN;
    /// ExpCmdSN.
    exp_cmd_sn, set_exp_cmd_sn: SerialNumber = field::EXP_CMD_SN;
    /// MaxCmdSN.
    max_cmd_sn, set_max_cmd_sn: SerialNumber = field::MAX_CMD_SN;
    /// DataSN.
    data_sn, set_data_sn: SerialNumber = field::DATA_SN;
    /// Buffer offset.
    buffer_offset, set_buffer_offset: u32 = field::BUFFER_OFFSET;
    /// Residual count (with S).
    residual, set_residual: u32 = field::RESIDUAL;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_rules() {
        let mut buf = [0u8; 48];
        buf[0] = 0x25;
        buf[1] = 0x01; // S without F
        assert_eq!(
            DataInRepr::parse(&DataIn::new_unchecked(&buf[..])),
            Err(Error::StatusWithoutFinal)
        );
        buf[1] = 0x81 | 0x06;
        assert_eq!(
            DataInRepr::parse(&DataIn::new_unchecked(&buf[..])),
            Err(Error::ConflictingResidualFlags)
        );
        // Without S, residual flags and StatSN are not interpreted.
        buf[1] = 0x80 | 0x06;
        buf[27] = 7;
        let repr = DataInRepr::parse(&DataIn::new_unchecked(&buf[..])).unwrap();
        assert_eq!(repr.status, None);
        assert_eq!(
            DataInRepr::parse(&DataIn::new_unchecked(&buf[..47])),
            Err(Error::Truncated)
        );
        assert_eq!(
            DataOutRepr::parse(&DataOut::new_unchecked(&buf[..])),
            Err(Error::WrongOpcode(0x25))
        );
    }
}
