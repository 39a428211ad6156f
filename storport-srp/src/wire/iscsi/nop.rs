//! NOP-Out (0x00) and NOP-In (0x20): pings in either direction.
//!
//! An initiator NOP-Out with ITT 0xffffffff asks for no answer; one with a
//! real ITT is answered by a NOP-In echoing it. A target NOP-In with a real
//! TTT asks for a NOP-Out echoing that TTT.

use super::serial::SerialNumber;
use super::{FINAL, Opcode, Result, expect_opcode, start_emit};
use crate::wire::Lun;

mod field {
    use crate::wire::Field;

    pub const LUN: Field = 8..16;
    pub const ITT: Field = 16..20;
    pub const TTT: Field = 20..24;
    pub const CMD_SN: Field = 24..28;
    pub const EXP_STAT_SN: Field = 28..32;

    // NOP-In.
    pub const STAT_SN: Field = 24..28;
    pub const EXP_CMD_SN: Field = 28..32;
    pub const MAX_CMD_SN: Field = 32..36;
}

/// The value of a NOP-Out BHS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NopOutRepr {
    /// Immediate delivery (I bit).
    pub immediate: bool,
    /// Logical unit (when answering a NOP-In that named one).
    pub lun: Lun,
    /// Initiator task tag; [`super::RESERVED_TAG`] asks for no answer.
    pub itt: u32,
    /// Target transfer tag of the NOP-In being answered, else the reserved
    /// tag.
    pub ttt: u32,
    /// CmdSN.
    pub cmd_sn: SerialNumber,
    /// ExpStatSN.
    pub exp_stat_sn: SerialNumber,
}

impl NopOutRepr {
    /// Parses a NOP-Out BHS.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`](super::Error::Truncated), [`Error::WrongOpcode`](super::Error::WrongOpcode).
    pub fn parse<T: AsRef<[u8]>>(pdu: &NopOut<T>) -> Result<Self> {
        pdu.check_len()?;
        expect_opcode(pdu.opcode_code(), Opcode::NopOut)?;
        Ok(Self {
            immediate: pdu.immediate(),
            lun: pdu.lun(),
            itt: pdu.itt(),
            ttt: pdu.ttt(),
            cmd_sn: pdu.cmd_sn(),
            exp_stat_sn: pdu.exp_stat_sn(),
        })
    }

    /// Writes the BHS.
    ///
    /// # Errors
    ///
    /// [`Error::BufferTooSmall`](super::Error::BufferTooSmall).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, pdu: &mut NopOut<T>) -> Result<()> {
        start_emit(pdu.as_bytes_mut(), Opcode::NopOut, self.immediate)?;
        pdu.set_flags(FINAL);
        pdu.set_lun(self.lun);
        pdu.set_itt(self.itt);
        pdu.set_ttt(self.ttt);
        pdu.set_cmd_sn(self.cmd_sn);
        pdu.set_exp_stat_sn(self.exp_stat_sn);
        Ok(())
    }
}

bhs_view! {
    /// A view of a NOP-Out BHS.
    pub struct NopOut;
    /// Logical unit.
    lun, set_lun: Lun = field::LUN;
    /// Initiator task tag.
    itt, set_itt: u32 = field::ITT;
    /// Target transfer tag.
    ttt, set_ttt: u32 = field::TTT;
    /// CmdSN.
    cmd_sn, set_cmd_sn: SerialNumber = field::CMD_SN;
    /// ExpStatSN.
    exp_stat_sn, set_exp_stat_sn: SerialNumber = field::EXP_STAT_SN;
}

/// The value of a NOP-In BHS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NopInRepr {
    /// Logical unit.
    pub lun: Lun,
    /// ITT of the NOP-Out answered, or the reserved tag.
    pub itt: u32,
    /// A real TTT asks the initiator to answer; else the reserved tag.
    pub ttt: u32,
    /// StatSN.
    pub stat_sn: SerialNumber,
    /// ExpCmdSN.
    pub exp_cmd_sn: SerialNumber,
    /// MaxCmdSN.
    pub max_cmd_sn: SerialNumber,
}

impl NopInRepr {
    /// Parses a NOP-In BHS.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`](super::Error::Truncated), [`Error::WrongOpcode`](super::Error::WrongOpcode).
    pub fn parse<T: AsRef<[u8]>>(pdu: &NopIn<T>) -> Result<Self> {
        pdu.check_len()?;
        expect_opcode(pdu.opcode_code(), Opcode::NopIn)?;
        Ok(Self {
            lun: pdu.lun(),
            itt: pdu.itt(),
            ttt: pdu.ttt(),
            stat_sn: pdu.stat_sn(),
            exp_cmd_sn: pdu.exp_cmd_sn(),
            max_cmd_sn: pdu.max_cmd_sn(),
        })
    }

    /// Writes the BHS.
    ///
    /// # Errors
    ///
    /// [`Error::BufferTooSmall`](super::Error::BufferTooSmall).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, pdu: &mut NopIn<T>) -> Result<()> {
        start_emit(pdu.as_bytes_mut(), Opcode::NopIn, false)?;
        pdu.set_flags(FINAL);
        pdu.set_lun(self.lun);
        pdu.set_itt(self.itt);
        pdu.set_ttt(self.ttt);
        pdu.set_stat_sn(self.stat_sn);
        pdu.set_exp_cmd_sn(self.exp_cmd_sn);
        pdu.set_max_cmd_sn(self.max_cmd_sn);
        Ok(())
    }
}

bhs_view! {
    /// A view of a NOP-In BHS.
    pub struct NopIn;
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::iscsi::Error;

    #[test]
    fn malformed() {
        let buf = [0x20u8; 48];
        assert_eq!(
            NopOutRepr::parse(&NopOut::new_unchecked(&buf[..])),
            Err(Error::WrongOpcode(0x20))
        );
        assert_eq!(
            NopInRepr::parse(&NopIn::new_unchecked(&buf[..47])),
            Err(Error::Truncated)
        );
        assert_eq!(
            NopInRepr::parse(&NopIn::new_unchecked(&[0x00u8; 48][..])),
            Err(Error::WrongOpcode(0x00))
        );
    }
}
