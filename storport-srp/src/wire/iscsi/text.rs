//! Text Request (0x04) and Text Response (0x24): `key=value` negotiation
//! in full feature phase (and SendTargets discovery). The data segment is
//! parsed by [`crate::wire::text`].

use super::serial::SerialNumber;
use super::{Error, FINAL, Opcode, Result, expect_opcode, start_emit};
use crate::wire::Lun;

mod field {
    use crate::wire::Field;

    pub const LUN: Field = 8..16;
    pub const ITT: Field = 16..20;
    pub const TTT: Field = 20..24;
    pub const CMD_SN: Field = 24..28;
    pub const EXP_STAT_SN: Field = 28..32;

    // Response.
    pub const STAT_SN: Field = 24..28;
    pub const EXP_CMD_SN: Field = 28..32;
    pub const MAX_CMD_SN: Field = 32..36;
}

/// The C (continue) bit.
const CONTINUE: u8 = 0x40;

/// F and C of a Text PDU; both set is a protocol error.
fn decode_flags(flags: u8) -> Result<(bool, bool)> {
    let is_final = flags & FINAL != 0;
    let continues = flags & CONTINUE != 0;
    if is_final && continues {
        return Err(Error::FinalAndContinue);
    }
    Ok((is_final, continues))
}

fn encode_flags(is_final: bool, continues: bool) -> Result<u8> {
    if is_final && continues {
        return Err(Error::FinalAndContinue);
    }
    Ok((if is_final { FINAL } else { 0 }) | if continues { CONTINUE } else { 0 })
}

/// The value of a Text Request BHS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TextRequestRepr {
    /// Immediate delivery (I bit).
    pub immediate: bool,
    /// F: the initiator's last Text Request of this exchange.
    pub is_final: bool,
    /// C: the text continues in the next PDU.
    pub continues: bool,
    /// Logical unit (usually zero).
    pub lun: Lun,
    /// Initiator task tag.
    pub itt: u32,
    /// TTT of the Text Response being continued, else the reserved tag.
    pub ttt: u32,
    /// CmdSN.
    pub cmd_sn: SerialNumber,
    /// ExpStatSN.
    pub exp_stat_sn: SerialNumber,
}

impl TextRequestRepr {
    /// Parses a Text Request BHS.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`], [`Error::WrongOpcode`],
    /// [`Error::FinalAndContinue`].
    pub fn parse<T: AsRef<[u8]>>(pdu: &TextRequest<T>) -> Result<Self> {
        pdu.check_len()?;
        expect_opcode(pdu.opcode_code(), Opcode::TextRequest)?;
        let (is_final, continues) = decode_flags(pdu.flags())?;
        Ok(Self {
            immediate: pdu.immediate(),
            is_final,
            continues,
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
    /// [`Error::FinalAndContinue`], [`Error::BufferTooSmall`].
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, pdu: &mut TextRequest<T>) -> Result<()> {
        let flags = encode_flags(self.is_final, self.continues)?;
        start_emit(pdu.as_bytes_mut(), Opcode::TextRequest, self.immediate)?;
        pdu.set_flags(flags);
        pdu.set_lun(self.lun);
        pdu.set_itt(self.itt);
        pdu.set_ttt(self.ttt);
        pdu.set_cmd_sn(self.cmd_sn);
        pdu.set_exp_stat_sn(self.exp_stat_sn);
        Ok(())
    }
}

bhs_view! {
    /// A view of a Text Request BHS.
    pub struct TextRequest;
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

/// The value of a Text Response BHS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TextResponseRepr {
    /// F: the target's last Text Response of this exchange.
    pub is_final: bool,
    /// C: the text continues in the next PDU.
    pub continues: bool,
    /// Logical unit.
    pub lun: Lun,
    /// ITT of the request.
    pub itt: u32,
    /// A real TTT when more responses follow, else the reserved tag.
    pub ttt: u32,
    /// StatSN.
    pub stat_sn: SerialNumber,
    /// ExpCmdSN.
    pub exp_cmd_sn: SerialNumber,
    /// MaxCmdSN.
    pub max_cmd_sn: SerialNumber,
}

impl TextResponseRepr {
    /// Parses a Text Response BHS.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`], [`Error::WrongOpcode`],
    /// [`Error::FinalAndContinue`].
    pub fn parse<T: AsRef<[u8]>>(pdu: &TextResponse<T>) -> Result<Self> {
        pdu.check_len()?;
        expect_opcode(pdu.opcode_code(), Opcode::TextResponse)?;
        let (is_final, continues) = decode_flags(pdu.flags())?;
        Ok(Self {
            is_final,
            continues,
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
    /// [`Error::FinalAndContinue`], [`Error::BufferTooSmall`].
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, pdu: &mut TextResponse<T>) -> Result<()> {
        let flags = encode_flags(self.is_final, self.continues)?;
        start_emit(pdu.as_bytes_mut(), Opcode::TextResponse, false)?;
        pdu.set_flags(flags);
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
    /// A view of a Text Response BHS.
    pub struct TextResponse;
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

    #[test]
    fn final_and_continue_is_an_error() {
        let mut buf = [0u8; 48];
        buf[0] = 0x04;
        buf[1] = 0xC0;
        assert_eq!(
            TextRequestRepr::parse(&TextRequest::new_unchecked(&buf[..])),
            Err(Error::FinalAndContinue)
        );
        buf[0] = 0x24;
        assert_eq!(
            TextResponseRepr::parse(&TextResponse::new_unchecked(&buf[..])),
            Err(Error::FinalAndContinue)
        );
        buf[1] = 0x40;
        let repr = TextResponseRepr::parse(&TextResponse::new_unchecked(&buf[..])).unwrap();
        assert!(repr.continues && !repr.is_final);
        assert_eq!(
            TextRequestRepr::parse(&TextRequest::new_unchecked(&buf[..])),
            Err(Error::WrongOpcode(0x24))
        );
        let both = TextResponseRepr {
            is_final: true,
            ..repr
        };
        assert_eq!(
            both.emit(&mut TextResponse::new_unchecked(&mut buf[..])),
            Err(Error::FinalAndContinue)
        );
    }
}
