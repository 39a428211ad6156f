//! SCSI status codes (SAM-5 5.3.1).

use core::fmt;

/// The status byte of a completed command.
///
/// A newtype so that a reserved or obsolete value from a target is kept as
/// it came and can be reported, not folded into a guess.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Status(pub u8);

impl Status {
    /// 0x00: the command completed successfully.
    pub const GOOD: Self = Self(0x00);
    /// 0x02: sense data describes an error or exception.
    pub const CHECK_CONDITION: Self = Self(0x02);
    /// 0x04: PRE-FETCH found the blocks cached (block devices only).
    pub const CONDITION_MET: Self = Self(0x04);
    /// 0x08: the logical unit is busy; retry later.
    pub const BUSY: Self = Self(0x08);
    /// 0x18: a reservation held by another I_T nexus forbids the command.
    pub const RESERVATION_CONFLICT: Self = Self(0x18);
    /// 0x28: the task set is full; retry when a command completes.
    pub const TASK_SET_FULL: Self = Self(0x28);
    /// 0x30: an ACA condition exists and the command was not an ACA command.
    pub const ACA_ACTIVE: Self = Self(0x30);
    /// 0x40: the command was aborted by another I_T nexus (TAS=1).
    pub const TASK_ABORTED: Self = Self(0x40);

    /// The status name, `None` for a reserved or obsolete value.
    pub const fn name(self) -> Option<&'static str> {
        Some(match self {
            Self::GOOD => "GOOD",
            Self::CHECK_CONDITION => "CHECK CONDITION",
            Self::CONDITION_MET => "CONDITION MET",
            Self::BUSY => "BUSY",
            Self::RESERVATION_CONFLICT => "RESERVATION CONFLICT",
            Self::TASK_SET_FULL => "TASK SET FULL",
            Self::ACA_ACTIVE => "ACA ACTIVE",
            Self::TASK_ABORTED => "TASK ABORTED",
            _ => return None,
        })
    }

    /// Whether the command did what was asked (GOOD or CONDITION MET).
    pub const fn is_success(self) -> bool {
        matches!(self, Self::GOOD | Self::CONDITION_MET)
    }

    /// Whether the same command may simply be sent again later: the target
    /// did not run it because of a transient condition (BUSY, TASK SET
    /// FULL). CHECK CONDITION needs the sense to decide.
    pub const fn is_transient(self) -> bool {
        matches!(self, Self::BUSY | Self::TASK_SET_FULL)
    }
}

impl fmt::Debug for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => write!(f, "Status({name})"),
            None => write!(f, "Status({:#04x})", self.0),
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => f.write_str(name),
            None => write!(f, "status {:#04x}", self.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_match_sam() {
        let table = [
            (Status::GOOD, 0x00),
            (Status::CHECK_CONDITION, 0x02),
            (Status::CONDITION_MET, 0x04),
            (Status::BUSY, 0x08),
            (Status::RESERVATION_CONFLICT, 0x18),
            (Status::TASK_SET_FULL, 0x28),
            (Status::ACA_ACTIVE, 0x30),
            (Status::TASK_ABORTED, 0x40),
        ];
        for (status, byte) in table {
            assert_eq!(status.0, byte);
            assert!(status.name().is_some());
        }
        let named = (0..=255u8).filter(|b| Status(*b).name().is_some()).count();
        assert_eq!(named, table.len());
    }

    #[test]
    fn classification() {
        assert!(Status::GOOD.is_success());
        assert!(Status::CONDITION_MET.is_success());
        assert!(!Status::CHECK_CONDITION.is_success());
        assert!(Status::BUSY.is_transient());
        assert!(Status::TASK_SET_FULL.is_transient());
        assert!(!Status::RESERVATION_CONFLICT.is_transient());
        assert_eq!(format!("{:?}", Status(0x22)), "Status(0x22)");
        assert_eq!(format!("{}", Status::TASK_ABORTED), "TASK ABORTED");
    }
}
