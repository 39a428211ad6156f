//! Logout Request (0x06) and Logout Response (0x26).

use super::serial::SerialNumber;
use super::{FINAL, Opcode, Result, expect_opcode, start_emit};

mod field {
    use crate::wire::Field;

    pub const ITT: Field = 16..20;
    pub const CID: Field = 20..22;
    pub const CMD_SN: Field = 24..28;
    pub const EXP_STAT_SN: Field = 28..32;

    // Response.
    pub const RESPONSE: Field = 2..3;
    pub const STAT_SN: Field = 24..28;
    pub const EXP_CMD_SN: Field = 28..32;
    pub const MAX_CMD_SN: Field = 32..36;
    pub const TIME2WAIT: Field = 40..42;
    pub const TIME2RETAIN: Field = 42..44;
}

/// The reason code: the low seven bits of the flags byte.
const REASON_MASK: u8 = 0x7F;

/// Why the initiator logs out. Codes iSCSI does not define are preserved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LogoutReason {
    /// 0: close the session.
    CloseSession,
    /// 1: close the connection.
    CloseConnection,
    /// 2: remove the connection for recovery.
    RemoveForRecovery,
    /// Any other 7-bit code, as received.
    Other(u8),
}

impl LogoutReason {
    /// The reason for a 7-bit code.
    pub const fn from_code(code: u8) -> Self {
        match code & REASON_MASK {
            0 => Self::CloseSession,
            1 => Self::CloseConnection,
            2 => Self::RemoveForRecovery,
            other => Self::Other(other),
        }
    }

    /// The 7-bit code.
    pub const fn code(self) -> u8 {
        match self {
            Self::CloseSession => 0,
            Self::CloseConnection => 1,
            Self::RemoveForRecovery => 2,
            Self::Other(code) => code & REASON_MASK,
        }
    }
}

/// The value of a Logout Request BHS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LogoutRequestRepr {
    /// Immediate delivery (I bit).
    pub immediate: bool,
    /// Why.
    pub reason: LogoutReason,
    /// Initiator task tag.
    pub itt: u32,
    /// Connection to close (for connection-level reasons).
    pub cid: u16,
    /// CmdSN.
    pub cmd_sn: SerialNumber,
    /// ExpStatSN.
    pub exp_stat_sn: SerialNumber,
}

impl LogoutRequestRepr {
    /// Parses a Logout Request BHS.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`](super::Error::Truncated), [`Error::WrongOpcode`](super::Error::WrongOpcode).
    pub fn parse<T: AsRef<[u8]>>(pdu: &LogoutRequest<T>) -> Result<Self> {
        pdu.check_len()?;
        expect_opcode(pdu.opcode_code(), Opcode::LogoutRequest)?;
        Ok(Self {
            immediate: pdu.immediate(),
            reason: LogoutReason::from_code(pdu.flags()),
            itt: pdu.itt(),
            cid: pdu.cid(),
            cmd_sn: pdu.cmd_sn(),
            exp_stat_sn: pdu.exp_stat_sn(),
        })
    }

    /// Writes the BHS.
    ///
    /// # Errors
    ///
    /// [`Error::BufferTooSmall`](super::Error::BufferTooSmall).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, pdu: &mut LogoutRequest<T>) -> Result<()> {
        start_emit(pdu.as_bytes_mut(), Opcode::LogoutRequest, self.immediate)?;
        pdu.set_flags(FINAL | self.reason.code());
        pdu.set_itt(self.itt);
        pdu.set_cid(self.cid);
        pdu.set_cmd_sn(self.cmd_sn);
        pdu.set_exp_stat_sn(self.exp_stat_sn);
        Ok(())
    }
}

bhs_view! {
    /// A view of a Logout Request BHS.
    pub struct LogoutRequest;
    /// Initiator task tag.
    itt, set_itt: u32 = field::ITT;
    /// Connection id.
    cid, set_cid: u16 = field::CID;
    /// CmdSN.
    cmd_sn, set_cmd_sn: SerialNumber = field::CMD_SN;
    /// ExpStatSN.
    exp_stat_sn, set_exp_stat_sn: SerialNumber = field::EXP_STAT_SN;
}

/// The outcome of a logout. Codes iSCSI does not define are preserved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LogoutResponseCode {
    /// 0: closed successfully.
    Success,
    /// 1: CID not found.
    CidNotFound,
    /// 2: connection recovery not supported.
    RecoveryUnsupported,
    /// 3: cleanup failed.
    CleanupFailed,
    /// Any other code, as received.
    Other(u8),
}

impl LogoutResponseCode {
    /// The response for a wire code.
    pub const fn from_code(code: u8) -> Self {
        match code {
            0 => Self::Success,
            1 => Self::CidNotFound,
            2 => Self::RecoveryUnsupported,
            3 => Self::CleanupFailed,
            other => Self::Other(other),
        }
    }

    /// The wire code.
    pub const fn code(self) -> u8 {
        match self {
            Self::Success => 0,
            Self::CidNotFound => 1,
            Self::RecoveryUnsupported => 2,
            Self::CleanupFailed => 3,
            Self::Other(code) => code,
        }
    }
}

/// The value of a Logout Response BHS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LogoutResponseRepr {
    /// The outcome.
    pub response: LogoutResponseCode,
    /// ITT of the request.
    pub itt: u32,
    /// StatSN.
    pub stat_sn: SerialNumber,
    /// ExpCmdSN.
    pub exp_cmd_sn: SerialNumber,
    /// MaxCmdSN.
    pub max_cmd_sn: SerialNumber,
    /// Seconds to wait before reconnecting (recovery).
    pub time2wait: u16,
    /// Seconds the target keeps connection state (recovery).
    pub time2retain: u16,
}

impl LogoutResponseRepr {
    /// Parses a Logout Response BHS.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`](super::Error::Truncated), [`Error::WrongOpcode`](super::Error::WrongOpcode).
    pub fn parse<T: AsRef<[u8]>>(pdu: &LogoutResponse<T>) -> Result<Self> {
        pdu.check_len()?;
        expect_opcode(pdu.opcode_code(), Opcode::LogoutResponse)?;
        Ok(Self {
            response: LogoutResponseCode::from_code(pdu.response()),
            itt: pdu.itt(),
            stat_sn: pdu.stat_sn(),
            exp_cmd_sn: pdu.exp_cmd_sn(),
            max_cmd_sn: pdu.max_cmd_sn(),
            time2wait: pdu.time2wait(),
            time2retain: pdu.time2retain(),
        })
    }

    /// Writes the BHS.
    ///
    /// # Errors
    ///
    /// [`Error::BufferTooSmall`](super::Error::BufferTooSmall).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, pdu: &mut LogoutResponse<T>) -> Result<()> {
        start_emit(pdu.as_bytes_mut(), Opcode::LogoutResponse, false)?;
        pdu.set_flags(FINAL);
        pdu.set_response(self.response.code());
        pdu.set_itt(self.itt);
        pdu.set_stat_sn(self.stat_sn);
        pdu.set_exp_cmd_sn(self.exp_cmd_sn);
        pdu.set_max_cmd_sn(self.max_cmd_sn);
        pdu.set_time2wait(self.time2wait);
        pdu.set_time2retain(self.time2retain);
        Ok(())
    }
}

bhs_view! {
    /// A view of a Logout Response BHS.
    pub struct LogoutResponse;
    /// Response code.
    response, set_response: u8 = field::RESPONSE;
    /// Initiator task tag.
    itt, set_itt: u32 = field::ITT;
    /// StatSN.
    stat_sn, set_stat_sn: SerialNumber = field::STAT_SN;
    /// ExpCmdSN.
    exp_cmd_sn, set_exp_cmd_sn: SerialNumber = field::EXP_CMD_SN;
    /// MaxCmdSN.
    max_cmd_sn, set_max_cmd_sn: SerialNumber = field::MAX_CMD_SN;
    /// Time2Wait.
    time2wait, set_time2wait: u16 = field::TIME2WAIT;
    /// Time2Retain.
    time2retain, set_time2retain: u16 = field::TIME2RETAIN;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::iscsi::Error;

    #[test]
    fn codes_round_trip_and_unknown_is_preserved() {
        for code in 0..0x80u8 {
            let reason = LogoutReason::from_code(code);
            assert_eq!(reason.code(), code);
            assert_eq!(matches!(reason, LogoutReason::Other(_)), code > 2);
        }
        for code in 0..=u8::MAX {
            let response = LogoutResponseCode::from_code(code);
            assert_eq!(response.code(), code);
            assert_eq!(matches!(response, LogoutResponseCode::Other(_)), code > 3);
        }
    }

    #[test]
    fn malformed() {
        let buf = [0x26u8; 48];
        assert_eq!(
            LogoutRequestRepr::parse(&LogoutRequest::new_unchecked(&buf[..])),
            Err(Error::WrongOpcode(0x26))
        );
        assert_eq!(
            LogoutResponseRepr::parse(&LogoutResponse::new_unchecked(&buf[..1])),
            Err(Error::Truncated)
        );
    }
}
