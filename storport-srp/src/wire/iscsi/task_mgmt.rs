//! SCSI Task Management Function Request (0x02) and Response (0x22).

use super::serial::SerialNumber;
use super::{FINAL, Opcode, Result, expect_opcode, start_emit};
use crate::wire::Lun;

mod field {
    use crate::wire::Field;

    pub const LUN: Field = 8..16;
    pub const ITT: Field = 16..20;
    pub const RTT: Field = 20..24;
    pub const CMD_SN: Field = 24..28;
    pub const EXP_STAT_SN: Field = 28..32;
    pub const REF_CMD_SN: Field = 32..36;
    pub const EXP_DATA_SN: Field = 36..40;

    // Response.
    pub const RESPONSE: Field = 2..3;
    pub const STAT_SN: Field = 24..28;
    pub const EXP_CMD_SN: Field = 28..32;
    pub const MAX_CMD_SN: Field = 32..36;
}

/// The function field: the low seven bits of the flags byte.
const FUNCTION_MASK: u8 = 0x7F;

/// A task management function. Codes iSCSI does not define are preserved,
/// so a target can answer "function not supported".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TaskMgmtFunction {
    /// 1: ABORT TASK (the task named by the RTT).
    AbortTask,
    /// 2: ABORT TASK SET.
    AbortTaskSet,
    /// 3: CLEAR ACA.
    ClearAca,
    /// 4: CLEAR TASK SET.
    ClearTaskSet,
    /// 5: LOGICAL UNIT RESET.
    LogicalUnitReset,
    /// 6: TARGET WARM RESET.
    TargetWarmReset,
    /// 7: TARGET COLD RESET.
    TargetColdReset,
    /// 8: TASK REASSIGN.
    TaskReassign,
    /// Any other 7-bit code, as received.
    Other(u8),
}

impl TaskMgmtFunction {
    /// The function for a 7-bit code.
    pub const fn from_code(code: u8) -> Self {
        match code & FUNCTION_MASK {
            1 => Self::AbortTask,
            2 => Self::AbortTaskSet,
            3 => Self::ClearAca,
            4 => Self::ClearTaskSet,
            5 => Self::LogicalUnitReset,
            6 => Self::TargetWarmReset,
            7 => Self::TargetColdReset,
            8 => Self::TaskReassign,
            other => Self::Other(other),
        }
    }

    /// The 7-bit code.
    pub const fn code(self) -> u8 {
        match self {
            Self::AbortTask => 1,
            Self::AbortTaskSet => 2,
            Self::ClearAca => 3,
            Self::ClearTaskSet => 4,
            Self::LogicalUnitReset => 5,
            Self::TargetWarmReset => 6,
            Self::TargetColdReset => 7,
            Self::TaskReassign => 8,
            Self::Other(code) => code & FUNCTION_MASK,
        }
    }
}

/// The value of a Task Management Function Request BHS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TaskMgmtRequestRepr {
    /// Immediate delivery (I bit; task management is usually immediate).
    pub immediate: bool,
    /// The function.
    pub function: TaskMgmtFunction,
    /// Logical unit.
    pub lun: Lun,
    /// This request's initiator task tag.
    pub itt: u32,
    /// Referenced task tag: the ITT of the task to abort, else the reserved
    /// tag.
    pub rtt: u32,
    /// CmdSN.
    pub cmd_sn: SerialNumber,
    /// ExpStatSN.
    pub exp_stat_sn: SerialNumber,
    /// RefCmdSN: CmdSN of the task to abort.
    pub ref_cmd_sn: SerialNumber,
    /// ExpDataSN (task reassign only).
    pub exp_data_sn: u32,
}

impl TaskMgmtRequestRepr {
    /// Parses a Task Management Function Request BHS.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`](super::Error::Truncated), [`Error::WrongOpcode`](super::Error::WrongOpcode).
    pub fn parse<T: AsRef<[u8]>>(pdu: &TaskMgmtRequest<T>) -> Result<Self> {
        pdu.check_len()?;
        expect_opcode(pdu.opcode_code(), Opcode::TaskMgmtRequest)?;
        Ok(Self {
            immediate: pdu.immediate(),
            function: TaskMgmtFunction::from_code(pdu.flags()),
            lun: pdu.lun(),
            itt: pdu.itt(),
            rtt: pdu.rtt(),
            cmd_sn: pdu.cmd_sn(),
            exp_stat_sn: pdu.exp_stat_sn(),
            ref_cmd_sn: pdu.ref_cmd_sn(),
            exp_data_sn: pdu.exp_data_sn(),
        })
    }

    /// Writes the BHS.
    ///
    /// # Errors
    ///
    /// [`Error::BufferTooSmall`](super::Error::BufferTooSmall).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, pdu: &mut TaskMgmtRequest<T>) -> Result<()> {
        start_emit(pdu.as_bytes_mut(), Opcode::TaskMgmtRequest, self.immediate)?;
        pdu.set_flags(FINAL | self.function.code());
        pdu.set_lun(self.lun);
        pdu.set_itt(self.itt);
        pdu.set_rtt(self.rtt);
        pdu.set_cmd_sn(self.cmd_sn);
        pdu.set_exp_stat_sn(self.exp_stat_sn);
        pdu.set_ref_cmd_sn(self.ref_cmd_sn);
        pdu.set_exp_data_sn(self.exp_data_sn);
        Ok(())
    }
}

bhs_view! {
    /// A view of a Task Management Function Request BHS.
    pub struct TaskMgmtRequest;
    /// Logical unit.
    lun, set_lun: Lun = field::LUN;
    /// Initiator task tag.
    itt, set_itt: u32 = field::ITT;
    /// Referenced task tag.
    rtt, set_rtt: u32 = field::RTT;
    /// CmdSN.
    cmd_sn, set_cmd_sn: SerialNumber = field::CMD_SN;
    /// ExpStatSN.
    exp_stat_sn, set_exp_stat_sn: SerialNumber = field::EXP_STAT_SN;
    /// RefCmdSN.
    ref_cmd_sn, set_ref_cmd_sn: SerialNumber = field::REF_CMD_SN;
    /// ExpDataSN.
    exp_data_sn, set_exp_data_sn: u32 = field::EXP_DATA_SN;
}

/// A task management response code. Codes iSCSI does not define are
/// preserved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TaskMgmtResponseCode {
    /// 0: function complete.
    Complete,
    /// 1: task does not exist.
    NoSuchTask,
    /// 2: LUN does not exist.
    NoSuchLun,
    /// 3: task still allegiant.
    TaskAllegiant,
    /// 4: task allegiance reassignment not supported.
    ReassignNotSupported,
    /// 5: function not supported.
    NotSupported,
    /// 6: function authorization failed.
    AuthorizationFailed,
    /// 255: function rejected.
    Rejected,
    /// Any other code, as received.
    Other(u8),
}

impl TaskMgmtResponseCode {
    /// The response for a wire code.
    pub const fn from_code(code: u8) -> Self {
        match code {
            0 => Self::Complete,
            1 => Self::NoSuchTask,
            2 => Self::NoSuchLun,
            3 => Self::TaskAllegiant,
            4 => Self::ReassignNotSupported,
            5 => Self::NotSupported,
            6 => Self::AuthorizationFailed,
            0xFF => Self::Rejected,
            other => Self::Other(other),
        }
    }

    /// The wire code.
    pub const fn code(self) -> u8 {
        match self {
            Self::Complete => 0,
            Self::NoSuchTask => 1,
            Self::NoSuchLun => 2,
            Self::TaskAllegiant => 3,
            Self::ReassignNotSupported => 4,
            Self::NotSupported => 5,
            Self::AuthorizationFailed => 6,
            Self::Rejected => 0xFF,
            Self::Other(code) => code,
        }
    }
}

/// The value of a Task Management Function Response BHS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TaskMgmtResponseRepr {
    /// The outcome.
    pub response: TaskMgmtResponseCode,
    /// ITT of the request.
    pub itt: u32,
    /// StatSN.
    pub stat_sn: SerialNumber,
    /// ExpCmdSN.
    pub exp_cmd_sn: SerialNumber,
    /// MaxCmdSN.
    pub max_cmd_sn: SerialNumber,
}

impl TaskMgmtResponseRepr {
    /// Parses a Task Management Function Response BHS.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`](super::Error::Truncated), [`Error::WrongOpcode`](super::Error::WrongOpcode).
    pub fn parse<T: AsRef<[u8]>>(pdu: &TaskMgmtResponse<T>) -> Result<Self> {
        pdu.check_len()?;
        expect_opcode(pdu.opcode_code(), Opcode::TaskMgmtResponse)?;
        Ok(Self {
            response: TaskMgmtResponseCode::from_code(pdu.response()),
            itt: pdu.itt(),
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
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, pdu: &mut TaskMgmtResponse<T>) -> Result<()> {
        start_emit(pdu.as_bytes_mut(), Opcode::TaskMgmtResponse, false)?;
        pdu.set_flags(FINAL);
        pdu.set_response(self.response.code());
        pdu.set_itt(self.itt);
        pdu.set_stat_sn(self.stat_sn);
        pdu.set_exp_cmd_sn(self.exp_cmd_sn);
        pdu.set_max_cmd_sn(self.max_cmd_sn);
        Ok(())
    }
}

bhs_view! {
    /// A view of a Task Management Function Response BHS.
    pub struct TaskMgmtResponse;
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::iscsi::Error;

    #[test]
    fn codes_round_trip_and_unknown_is_preserved() {
        for code in 0..0x80u8 {
            let function = TaskMgmtFunction::from_code(code);
            assert_eq!(function.code(), code);
            assert_eq!(
                matches!(function, TaskMgmtFunction::Other(_)),
                !(1..=8).contains(&code)
            );
        }
        for code in 0..=u8::MAX {
            let response = TaskMgmtResponseCode::from_code(code);
            assert_eq!(response.code(), code);
            let known = code <= 6 || code == 0xFF;
            assert_eq!(!matches!(response, TaskMgmtResponseCode::Other(_)), known);
        }
    }

    #[test]
    fn malformed() {
        let buf = [0x22u8; 48];
        assert_eq!(
            TaskMgmtRequestRepr::parse(&TaskMgmtRequest::new_unchecked(&buf[..])),
            Err(Error::WrongOpcode(0x22))
        );
        assert_eq!(
            TaskMgmtResponseRepr::parse(&TaskMgmtResponse::new_unchecked(&buf[..40])),
            Err(Error::Truncated)
        );
    }
}
