//! Asynchronous Message (0x32): the target reports an event (SCSI
//! asynchronous event with sense data, logout request, dropped connections,
//! renegotiation request).

use super::serial::SerialNumber;
use super::{FINAL, Opcode, RESERVED_TAG, Result, expect_opcode, start_emit};
use crate::wire::Lun;

mod field {
    use crate::wire::Field;

    pub const LUN: Field = 8..16;
    pub const RESERVED_TAG: Field = 16..20;
    pub const STAT_SN: Field = 24..28;
    pub const EXP_CMD_SN: Field = 28..32;
    pub const MAX_CMD_SN: Field = 32..36;
    pub const ASYNC_EVENT: Field = 36..37;
    pub const ASYNC_VCODE: Field = 37..38;
    pub const PARAMETER1: Field = 38..40;
    pub const PARAMETER2: Field = 40..42;
    pub const PARAMETER3: Field = 42..44;
}

/// The event. Codes iSCSI does not define are preserved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AsyncEvent {
    /// 0: SCSI asynchronous event; the data segment holds sense data.
    ScsiEvent,
    /// 1: the target asks for a logout within Parameter3 seconds.
    RequestLogout,
    /// 2: the target will drop the connection Parameter1.
    DroppingConnection,
    /// 3: the target will drop all connections of the session.
    DroppingAllConnections,
    /// 4: the target asks to renegotiate parameters.
    ParameterNegotiation,
    /// 255: vendor specific (AsyncVCode says what).
    VendorSpecific,
    /// Any other code, as received.
    Other(u8),
}

impl AsyncEvent {
    /// The event for a wire code.
    pub const fn from_code(code: u8) -> Self {
        match code {
            0 => Self::ScsiEvent,
            1 => Self::RequestLogout,
            2 => Self::DroppingConnection,
            3 => Self::DroppingAllConnections,
            4 => Self::ParameterNegotiation,
            255 => Self::VendorSpecific,
            other => Self::Other(other),
        }
    }

    /// The wire code.
    pub const fn code(self) -> u8 {
        match self {
            Self::ScsiEvent => 0,
            Self::RequestLogout => 1,
            Self::DroppingConnection => 2,
            Self::DroppingAllConnections => 3,
            Self::ParameterNegotiation => 4,
            Self::VendorSpecific => 255,
            Self::Other(code) => code,
        }
    }
}

/// The value of an Asynchronous Message BHS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AsyncMessageRepr {
    /// Logical unit (for SCSI events).
    pub lun: Lun,
    /// StatSN.
    pub stat_sn: SerialNumber,
    /// ExpCmdSN.
    pub exp_cmd_sn: SerialNumber,
    /// MaxCmdSN.
    pub max_cmd_sn: SerialNumber,
    /// The event.
    pub event: AsyncEvent,
    /// Vendor code (for vendor-specific events).
    pub vendor_code: u8,
    /// Parameter1 (event specific; e.g. the CID being dropped).
    pub parameter1: u16,
    /// Parameter2 (event specific; e.g. Time2Wait).
    pub parameter2: u16,
    /// Parameter3 (event specific; e.g. Time2Retain or the logout deadline).
    pub parameter3: u16,
}

impl AsyncMessageRepr {
    /// Parses an Asynchronous Message BHS.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`](super::Error::Truncated), [`Error::WrongOpcode`](super::Error::WrongOpcode).
    pub fn parse<T: AsRef<[u8]>>(pdu: &AsyncMessage<T>) -> Result<Self> {
        pdu.check_len()?;
        expect_opcode(pdu.opcode_code(), Opcode::AsyncMessage)?;
        Ok(Self {
            lun: pdu.lun(),
            stat_sn: pdu.stat_sn(),
            exp_cmd_sn: pdu.exp_cmd_sn(),
            max_cmd_sn: pdu.max_cmd_sn(),
            event: AsyncEvent::from_code(pdu.async_event()),
            vendor_code: pdu.async_vcode(),
            parameter1: pdu.parameter1(),
            parameter2: pdu.parameter2(),
            parameter3: pdu.parameter3(),
        })
    }

    /// Writes the BHS (with the reserved tag where an ITT would be).
    ///
    /// # Errors
    ///
    /// [`Error::BufferTooSmall`](super::Error::BufferTooSmall).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, pdu: &mut AsyncMessage<T>) -> Result<()> {
        start_emit(pdu.as_bytes_mut(), Opcode::AsyncMessage, false)?;
        pdu.set_flags(FINAL);
        pdu.set_lun(self.lun);
        pdu.set_reserved_tag(RESERVED_TAG);
        pdu.set_stat_sn(self.stat_sn);
        pdu.set_exp_cmd_sn(self.exp_cmd_sn);
        pdu.set_max_cmd_sn(self.max_cmd_sn);
        pdu.set_async_event(self.event.code());
        pdu.set_async_vcode(self.vendor_code);
        pdu.set_parameter1(self.parameter1);
        pdu.set_parameter2(self.parameter2);
        pdu.set_parameter3(self.parameter3);
        Ok(())
    }
}

bhs_view! {
    /// A view of an Asynchronous Message BHS.
    pub struct AsyncMessage;
    /// Logical unit.
    lun, set_lun: Lun = field::LUN;
    /// Bytes 16..20, always the reserved tag.
    reserved_tag, set_reserved_tag: u32 = field::RESERVED_TAG;
    /// StatSN.
    stat_sn, set_stat_sn: SerialNumber = field::STAT_SN;
    /// ExpCmdSN.
    exp_cmd_sn, set_exp_cmd_sn: SerialNumber = field::EXP_CMD_SN;
    /// MaxCmdSN.
    max_cmd_sn, set_max_cmd_sn: SerialNumber = field::MAX_CMD_SN;
    /// AsyncEvent.
    async_event, set_async_event: u8 = field::ASYNC_EVENT;
    /// AsyncVCode.
    async_vcode, set_async_vcode: u8 = field::ASYNC_VCODE;
    /// Parameter1.
    parameter1, set_parameter1: u16 = field::PARAMETER1;
    /// Parameter2.
    parameter2, set_parameter2: u16 = field::PARAMETER2;
    /// Parameter3.
    parameter3, set_parameter3: u16 = field::PARAMETER3;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::iscsi::Error;

    #[test]
    fn codes_round_trip_and_unknown_is_preserved() {
        for code in 0..=u8::MAX {
            let event = AsyncEvent::from_code(code);
            assert_eq!(event.code(), code);
            assert_eq!(
                !matches!(event, AsyncEvent::Other(_)),
                code <= 4 || code == 255
            );
        }
        assert_eq!(
            AsyncMessageRepr::parse(&AsyncMessage::new_unchecked(&[0x3fu8; 48][..])),
            Err(Error::WrongOpcode(0x3f))
        );
        assert_eq!(
            AsyncMessageRepr::parse(&AsyncMessage::new_unchecked(&[0x32u8; 40][..])),
            Err(Error::Truncated)
        );
    }
}
