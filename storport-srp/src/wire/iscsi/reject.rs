//! Reject (0x3f): the target refuses a PDU; the data segment holds the
//! rejected PDU's header.

use super::serial::SerialNumber;
use super::{Bhs, FINAL, Opcode, RESERVED_TAG, Result, expect_opcode, start_emit};

mod field {
    use crate::wire::Field;

    pub const REASON: Field = 2..3;
    pub const RESERVED_TAG: Field = 16..20;
    pub const STAT_SN: Field = 24..28;
    pub const EXP_CMD_SN: Field = 28..32;
    pub const MAX_CMD_SN: Field = 32..36;
    pub const DATA_SN: Field = 36..40;
}

/// Why a PDU was rejected. Codes iSCSI does not define are preserved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RejectReason {
    /// 0x01: reserved (command before login in RFC 3720).
    CommandBeforeLogin,
    /// 0x02: data (payload) digest error.
    DataDigestError,
    /// 0x03: SNACK reject.
    SnackReject,
    /// 0x04: protocol error.
    ProtocolError,
    /// 0x05: command not supported.
    CommandNotSupported,
    /// 0x06: immediate command rejected (too many immediate commands).
    ImmediateCommandRejected,
    /// 0x07: task in progress.
    TaskInProgress,
    /// 0x08: invalid data ACK.
    InvalidDataAck,
    /// 0x09: invalid PDU field.
    InvalidPduField,
    /// 0x0a: long operation reject (out of resources).
    OutOfResources,
    /// 0x0b: negotiation reset (deprecated).
    NegotiationReset,
    /// 0x0c: waiting for logout.
    WaitingForLogout,
    /// Any other code, as received.
    Other(u8),
}

impl RejectReason {
    /// The reason for a wire code.
    pub const fn from_code(code: u8) -> Self {
        match code {
            0x01 => Self::CommandBeforeLogin,
            0x02 => Self::DataDigestError,
            0x03 => Self::SnackReject,
            0x04 => Self::ProtocolError,
            0x05 => Self::CommandNotSupported,
            0x06 => Self::ImmediateCommandRejected,
            0x07 => Self::TaskInProgress,
            0x08 => Self::InvalidDataAck,
            0x09 => Self::InvalidPduField,
            0x0a => Self::OutOfResources,
            0x0b => Self::NegotiationReset,
            0x0c => Self::WaitingForLogout,
            other => Self::Other(other),
        }
    }

    /// The wire code.
    pub const fn code(self) -> u8 {
        match self {
            Self::CommandBeforeLogin => 0x01,
            Self::DataDigestError => 0x02,
            Self::SnackReject => 0x03,
            Self::ProtocolError => 0x04,
            Self::CommandNotSupported => 0x05,
            Self::ImmediateCommandRejected => 0x06,
            Self::TaskInProgress => 0x07,
            Self::InvalidDataAck => 0x08,
            Self::InvalidPduField => 0x09,
            Self::OutOfResources => 0x0a,
            Self::NegotiationReset => 0x0b,
            Self::WaitingForLogout => 0x0c,
            Self::Other(code) => code,
        }
    }
}

/// The value of a Reject BHS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RejectRepr {
    /// Why.
    pub reason: RejectReason,
    /// StatSN.
    pub stat_sn: SerialNumber,
    /// ExpCmdSN.
    pub exp_cmd_sn: SerialNumber,
    /// MaxCmdSN.
    pub max_cmd_sn: SerialNumber,
    /// DataSN/R2TSN (for rejected data SNACKs; 0 otherwise).
    pub data_sn: SerialNumber,
}

impl RejectRepr {
    /// Parses a Reject BHS.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`](super::Error::Truncated), [`Error::WrongOpcode`](super::Error::WrongOpcode).
    pub fn parse<T: AsRef<[u8]>>(pdu: &Reject<T>) -> Result<Self> {
        pdu.check_len()?;
        expect_opcode(pdu.opcode_code(), Opcode::Reject)?;
        Ok(Self {
            reason: RejectReason::from_code(pdu.reason()),
            stat_sn: pdu.stat_sn(),
            exp_cmd_sn: pdu.exp_cmd_sn(),
            max_cmd_sn: pdu.max_cmd_sn(),
            data_sn: pdu.data_sn(),
        })
    }

    /// The rejected PDU's header, from the Reject's data segment.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`](super::Error::Truncated) if the data segment is shorter than a BHS.
    pub fn rejected_header(data: &[u8]) -> Result<Bhs<&[u8]>> {
        Bhs::new_checked(data)
    }

    /// Writes the BHS (with the reserved tag where an ITT would be).
    ///
    /// # Errors
    ///
    /// [`Error::BufferTooSmall`](super::Error::BufferTooSmall).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, pdu: &mut Reject<T>) -> Result<()> {
        start_emit(pdu.as_bytes_mut(), Opcode::Reject, false)?;
        pdu.set_flags(FINAL);
        pdu.set_reason(self.reason.code());
        pdu.set_reserved_tag(RESERVED_TAG);
        pdu.set_stat_sn(self.stat_sn);
        pdu.set_exp_cmd_sn(self.exp_cmd_sn);
        pdu.set_max_cmd_sn(self.max_cmd_sn);
        pdu.set_data_sn(self.data_sn);
        Ok(())
    }
}

bhs_view! {
    /// A view of a Reject BHS.
    pub struct Reject;
    /// Reason code.
    reason, set_reason: u8 = field::REASON;
    /// Bytes 16..20, always the reserved tag.
    reserved_tag, set_reserved_tag: u32 = field::RESERVED_TAG;
    /// StatSN.
    stat_sn, set_stat_sn: SerialNumber = field::STAT_SN;
    /// ExpCmdSN.
    exp_cmd_sn, set_exp_cmd_sn: SerialNumber = field::EXP_CMD_SN;
    /// MaxCmdSN.
    max_cmd_sn, set_max_cmd_sn: SerialNumber = field::MAX_CMD_SN;
    /// DataSN/R2TSN.
    data_sn, set_data_sn: SerialNumber = field::DATA_SN;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::iscsi::Error;

    #[test]
    fn codes_and_rejected_header() {
        for code in 0..=u8::MAX {
            let reason = RejectReason::from_code(code);
            assert_eq!(reason.code(), code);
            assert_eq!(
                !matches!(reason, RejectReason::Other(_)),
                (1..=0x0c).contains(&code)
            );
        }
        let mut header = [0u8; 48];
        header[0] = 0x01;
        let bhs = RejectRepr::rejected_header(&header).unwrap();
        assert_eq!(bhs.opcode(), Ok(Opcode::ScsiCommand));
        assert_eq!(
            RejectRepr::rejected_header(&header[..47]).unwrap_err(),
            Error::Truncated
        );
        assert_eq!(
            RejectRepr::parse(&Reject::new_unchecked(&header[..])),
            Err(Error::WrongOpcode(0x01))
        );
    }
}
