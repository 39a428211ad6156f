//! `SRP_TSK_MGMT` (48 bytes): a SCSI task management request.

use static_assertions::const_assert_eq;

use super::{Error, Opcode, Result, SolNot, check_emit_len, expect_opcode};
use crate::wire::{Lun, bytes};

mod field {
    use crate::wire::Field;

    pub const OPCODE: Field = 0..1;
    pub const SOL_NOT: Field = 1..2;
    pub const TAG: Field = 8..16;
    pub const LUN: Field = 20..28;
    pub const FUNCTION: Field = 30..31;
    pub const TASK_TAG: Field = 32..40;
    pub const RESERVED: Field = 40..48;
}

/// Size of `SRP_TSK_MGMT`.
pub const LEN: usize = field::RESERVED.end;
const_assert_eq!(LEN, 48);

/// A task management function. Codes SRP does not define are preserved so
/// a target can answer them with "function not supported".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TaskMgmtFunction {
    /// 0x01 `SRP_TSK_ABORT_TASK`: abort the task named by `task_tag`.
    AbortTask,
    /// 0x02 `SRP_TSK_ABORT_TASK_SET`.
    AbortTaskSet,
    /// 0x04 `SRP_TSK_CLEAR_TASK_SET`.
    ClearTaskSet,
    /// 0x08 `SRP_TSK_LUN_RESET`.
    LunReset,
    /// 0x40 `SRP_TSK_CLEAR_ACA`.
    ClearAca,
    /// Any other code, as received.
    Other(u8),
}

impl TaskMgmtFunction {
    /// The function for a wire code.
    pub const fn from_code(code: u8) -> Self {
        match code {
            0x01 => Self::AbortTask,
            0x02 => Self::AbortTaskSet,
            0x04 => Self::ClearTaskSet,
            0x08 => Self::LunReset,
            0x40 => Self::ClearAca,
            other => Self::Other(other),
        }
    }

    /// The wire code.
    pub const fn code(self) -> u8 {
        match self {
            Self::AbortTask => 0x01,
            Self::AbortTaskSet => 0x02,
            Self::ClearTaskSet => 0x04,
            Self::LunReset => 0x08,
            Self::ClearAca => 0x40,
            Self::Other(code) => code,
        }
    }
}

/// The value of an `SRP_TSK_MGMT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TskMgmtRepr {
    /// Which responses are solicited.
    pub sol_not: SolNot,
    /// This request's own tag.
    pub tag: u64,
    /// The logical unit.
    pub lun: Lun,
    /// The function.
    pub function: TaskMgmtFunction,
    /// For ABORT TASK, the tag of the command to abort.
    pub task_tag: u64,
}

impl TskMgmtRepr {
    /// Parses a task management request.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`], [`Error::WrongOpcode`].
    pub fn parse<T: AsRef<[u8]>>(iu: &TskMgmt<T>) -> Result<Self> {
        iu.check_len()?;
        expect_opcode(iu.opcode(), Opcode::TskMgmt)?;
        Ok(Self {
            sol_not: iu.sol_not(),
            tag: iu.tag(),
            lun: iu.lun(),
            function: TaskMgmtFunction::from_code(iu.function()),
            task_tag: iu.task_tag(),
        })
    }

    /// Bytes [`Self::emit`] writes.
    pub const fn buffer_len(&self) -> usize {
        LEN
    }

    /// Writes the IU, reserved bytes zeroed.
    ///
    /// # Errors
    ///
    /// [`Error::BufferTooSmall`].
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, iu: &mut TskMgmt<T>) -> Result<()> {
        check_emit_len(iu.as_bytes(), LEN)?;
        bytes::zero(iu.as_bytes_mut(), 0, LEN);
        iu.set_opcode(Opcode::TskMgmt as u8);
        iu.set_sol_not(self.sol_not);
        iu.set_tag(self.tag);
        iu.set_lun(self.lun);
        iu.set_function(self.function.code());
        iu.set_task_tag(self.task_tag);
        Ok(())
    }
}

wire_view! {
    /// A view of `SRP_TSK_MGMT` (`srp_tsk_mgmt`).
    pub struct TskMgmt, min_len = LEN, error = Error, truncated = Error::Truncated;
    /// IU type byte (0x01).
    opcode, set_opcode: u8 = field::OPCODE;
    /// Solicited-notification bits.
    sol_not, set_sol_not: SolNot = field::SOL_NOT;
    /// Tag.
    tag, set_tag: u64 = field::TAG;
    /// Logical unit (aligned only to 4 bytes, as SRP defines it).
    lun, set_lun: Lun = field::LUN;
    /// Raw function code.
    function, set_function: u8 = field::FUNCTION;
    /// Tag of the task to manage.
    task_tag, set_task_tag: u64 = field::TASK_TAG;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn abort_task_golden_bytes() {
        let repr = TskMgmtRepr {
            sol_not: SolNot::empty(),
            tag: 0x8000_0000,
            lun: Lun::from_index(1).unwrap(),
            function: TaskMgmtFunction::AbortTask,
            task_tag: 0x2a,
        };
        let mut expected = [0u8; 48];
        expected[0] = 0x01;
        expected[12..16].copy_from_slice(&[0x80, 0, 0, 0]);
        expected[21] = 1;
        expected[30] = 0x01;
        expected[39] = 0x2a;
        let mut buf = [0xEEu8; 48];
        repr.emit(&mut TskMgmt::new_unchecked(&mut buf[..]))
            .unwrap();
        assert_eq!(buf, expected);
        assert_eq!(
            TskMgmtRepr::parse(&TskMgmt::new_unchecked(&buf[..])),
            Ok(repr)
        );
    }

    #[test]
    fn every_function_round_trips_and_unknown_is_preserved() {
        for code in 0..=u8::MAX {
            let function = TaskMgmtFunction::from_code(code);
            assert_eq!(function.code(), code);
            let known = matches!(code, 0x01 | 0x02 | 0x04 | 0x08 | 0x40);
            assert_eq!(
                !matches!(function, TaskMgmtFunction::Other(_)),
                known,
                "{code:#x}"
            );
        }
    }

    #[test]
    fn malformed() {
        let buf = [0x01u8; 47];
        assert_eq!(
            TskMgmtRepr::parse(&TskMgmt::new_unchecked(&buf[..])),
            Err(Error::Truncated)
        );
        let buf = [0x02u8; 48];
        assert_eq!(
            TskMgmtRepr::parse(&TskMgmt::new_unchecked(&buf[..])),
            Err(Error::WrongOpcode(0x02))
        );
    }
}
