//! Ready To Transfer (0x31). Under iSER the target RDMA-READs write data
//! instead of sending R2Ts; the PDU still parses so that a target that sends
//! one meets a defined protocol error in the engine, not a parse failure.

use super::serial::SerialNumber;
use super::{FINAL, Opcode, Result, expect_opcode, start_emit};
use crate::wire::Lun;

mod field {
    use crate::wire::Field;

    pub const LUN: Field = 8..16;
    pub const ITT: Field = 16..20;
    pub const TTT: Field = 20..24;
    pub const STAT_SN: Field = 24..28;
    pub const EXP_CMD_SN: Field = 28..32;
    pub const MAX_CMD_SN: Field = 32..36;
    pub const R2T_SN: Field = 36..40;
    pub const BUFFER_OFFSET: Field = 40..44;
    pub const DESIRED_LEN: Field = 44..48;
}

/// The value of an R2T BHS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct R2tRepr {
    /// Logical unit.
    pub lun: Lun,
    /// ITT of the command.
    pub itt: u32,
    /// TTT the Data-Out PDUs must carry.
    pub ttt: u32,
    /// StatSN (the next one, not advanced).
    pub stat_sn: SerialNumber,
    /// ExpCmdSN.
    pub exp_cmd_sn: SerialNumber,
    /// MaxCmdSN.
    pub max_cmd_sn: SerialNumber,
    /// R2TSN.
    pub r2t_sn: SerialNumber,
    /// Offset of the requested data.
    pub buffer_offset: u32,
    /// Length of the requested data.
    pub desired_len: u32,
}

impl R2tRepr {
    /// Parses an R2T BHS.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`](super::Error::Truncated), [`Error::WrongOpcode`](super::Error::WrongOpcode).
    pub fn parse<T: AsRef<[u8]>>(pdu: &R2t<T>) -> Result<Self> {
        pdu.check_len()?;
        expect_opcode(pdu.opcode_code(), Opcode::R2t)?;
        Ok(Self {
            lun: pdu.lun(),
            itt: pdu.itt(),
            ttt: pdu.ttt(),
            stat_sn: pdu.stat_sn(),
            exp_cmd_sn: pdu.exp_cmd_sn(),
            max_cmd_sn: pdu.max_cmd_sn(),
            r2t_sn: pdu.r2t_sn(),
            buffer_offset: pdu.buffer_offset(),
            desired_len: pdu.desired_len(),
        })
    }

    /// Writes the BHS.
    ///
    /// # Errors
    ///
    /// [`Error::BufferTooSmall`](super::Error::BufferTooSmall).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, pdu: &mut R2t<T>) -> Result<()> {
        start_emit(pdu.as_bytes_mut(), Opcode::R2t, false)?;
        pdu.set_flags(FINAL);
        pdu.set_lun(self.lun);
        pdu.set_itt(self.itt);
        pdu.set_ttt(self.ttt);
        pdu.set_stat_sn(self.stat_sn);
        pdu.set_exp_cmd_sn(self.exp_cmd_sn);
        pdu.set_max_cmd_sn(self.max_cmd_sn);
        pdu.set_r2t_sn(self.r2t_sn);
        pdu.set_buffer_offset(self.buffer_offset);
        pdu.set_desired_len(self.desired_len);
        Ok(())
    }
}

bhs_view! {
    /// A view of an R2T BHS.
    pub struct R2t;
    /// Logical unit.
    lun, set_lun: Lun = field::LUN;
    /// Initiator task tag.
    itt, set_itt: u32 = field::ITT;
    /// Target transfer tag.
    ttt, set_ttt: u32 = field::TTT;
    /// StatSN.
    stat_sn, set_stat_sn: SerialNumber = field::STAT_SN;
    /// ExpCmdSN.
    exp_cmd_sn, set_exp_cmd_sn: SerialNumber = field::EXP_CMD_SN;
    /// MaxCmdSN.
    max_cmd_sn, set_max_cmd_sn: SerialNumber = field::MAX_CMD_SN;
    /// R2TSN.
    r2t_sn, set_r2t_sn: SerialNumber = field::R2T_SN;
    /// Buffer offset.
    buffer_offset, set_buffer_offset: u32 = field::BUFFER_OFFSET;
    /// Desired data transfer length.
    desired_len, set_desired_len: u32 = field::DESIRED_LEN;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::iscsi::Error;

    #[test]
    fn malformed() {
        assert_eq!(
            R2tRepr::parse(&R2t::new_unchecked(&[0x31u8; 47][..])),
            Err(Error::Truncated)
        );
        assert_eq!(
            R2tRepr::parse(&R2t::new_unchecked(&[0x32u8; 48][..])),
            Err(Error::WrongOpcode(0x32))
        );
    }
}
