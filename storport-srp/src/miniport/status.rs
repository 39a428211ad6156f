//! The one place where a transport's answer becomes an `SrbStatus`.
//!
//! [`map_command`] turns a [`CommandResult`] (SAM status, sense, residual,
//! or a transport-level ending) into the fields StorPort reads on
//! completion; [`map_tmf`] does the same for task management functions.
//! Both are pure and total, and the tables at the bottom of this file are
//! their specification.
//!
//! # Choices, and why
//! * `SRB_STATUS_BUSY` makes StorPort requeue the request at once and is
//!   only allowed before the transaction started. The core uses it only for
//!   requests that never left the initiator (no credit, connection
//!   recovering). A target that answers SCSI BUSY, TASK SET FULL or ACA
//!   ACTIVE gets `SRB_STATUS_ERROR` with that `ScsiStatus`: the class
//!   driver's retry for it is delayed and bounded, StorPort's requeue is
//!   neither.
//! * Underrun and overrun are both `SRB_STATUS_DATA_OVERRUN` with
//!   `DataTransferLength` set to what moved (the Windows convention the
//!   class drivers read).
//! * Sense is copied only for CHECK CONDITION, truncated to the request's
//!   sense buffer, with `SRB_STATUS_AUTOSENSE_VALID` only if at least one
//!   byte was copied.
//! * A command the transport could not finish: fail-fast is
//!   `SRB_STATUS_SELECTION_TIMEOUT` (a path failure multipath acts on),
//!   device loss `SRB_STATUS_NO_DEVICE`, a connection reset
//!   `SRB_STATUS_BUS_RESET` (retried), the engine's own timeout
//!   `SRB_STATUS_TIMEOUT`, a protocol violation by the target
//!   `SRB_STATUS_PHASE_SEQUENCE_FAILURE` (the SCSI analogue: the other side
//!   broke the sequence).

#![forbid(unsafe_code)]

use super::transport::{CommandOutcome, CommandResult, FailureKind, Residual, TmfResponse};
use crate::scsi::Status;
use crate::storport::SrbStatus;

/// What to write into a request on completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SrbOutcome {
    /// `SrbStatus`, flags included.
    pub srb_status: SrbStatus,
    /// `ScsiStatus` (the SAM status; 0 when the target did not answer).
    pub scsi_status: u8,
    /// `DataTransferLength`: bytes that moved.
    pub data_transfer_length: u32,
    /// How many leading bytes of the result's sense to copy into the sense
    /// buffer (and to report in `SenseInfoBufferLength`).
    pub sense_len: u8,
}

impl SrbOutcome {
    /// An outcome decided by the core alone: nothing moved, no SAM status.
    #[must_use]
    pub const fn local(srb_status: SrbStatus) -> Self {
        Self {
            srb_status,
            scsi_status: 0,
            data_transfer_length: 0,
            sense_len: 0,
        }
    }
}

/// The status for a transport-level failure.
#[must_use]
pub const fn failure_status(kind: FailureKind) -> SrbStatus {
    match kind {
        FailureKind::FailFast => SrbStatus::SELECTION_TIMEOUT,
        FailureKind::DeviceLost => SrbStatus::NO_DEVICE,
        FailureKind::ConnectionReset => SrbStatus::BUS_RESET,
        FailureKind::Timeout => SrbStatus::TIMEOUT,
        FailureKind::Protocol => SrbStatus::PHASE_SEQUENCE_FAILURE,
        FailureKind::Unsupported => SrbStatus::INVALID_REQUEST,
    }
}

/// Bytes moved, from the requested length and the residual.
const fn moved(requested: u32, residual: Residual) -> u32 {
    match residual {
        Residual::Underrun(r) => requested.saturating_sub(r),
        Residual::None | Residual::Overrun(_) => requested,
    }
}

/// Maps a command's result for a request of `requested` bytes whose sense
/// buffer holds `sense_capacity` bytes.
///
/// Inlined: once per command, and a GOOD status takes the first arm.
#[must_use]
#[inline]
pub fn map_command(
    requested: u32,
    result: &CommandResult<'_>,
    sense_capacity: usize,
) -> SrbOutcome {
    let status = match result.outcome {
        CommandOutcome::Scsi(status) => status,
        CommandOutcome::Aborted => return SrbOutcome::local(SrbStatus::ABORTED),
        CommandOutcome::Reset => return SrbOutcome::local(SrbStatus::BUS_RESET),
        CommandOutcome::Failed(kind) => return SrbOutcome::local(failure_status(kind)),
    };
    let residual = if requested == 0 {
        Residual::None
    } else {
        result.residual
    };
    match Status(status) {
        Status::GOOD | Status::CONDITION_MET => {
            let short = matches!(residual, Residual::Underrun(r) | Residual::Overrun(r) if r > 0);
            SrbOutcome {
                srb_status: if short {
                    SrbStatus::DATA_OVERRUN
                } else {
                    SrbStatus::SUCCESS
                },
                scsi_status: status,
                data_transfer_length: moved(requested, residual),
                sense_len: 0,
            }
        }
        Status::CHECK_CONDITION => {
            let copy = result
                .sense
                .len()
                .min(sense_capacity)
                .min(usize::from(u8::MAX));
            let sense_len = u8::try_from(copy).unwrap_or(u8::MAX);
            SrbOutcome {
                srb_status: if sense_len > 0 {
                    SrbStatus::ERROR.with_autosense()
                } else {
                    SrbStatus::ERROR
                },
                scsi_status: status,
                data_transfer_length: moved(requested, residual),
                sense_len,
            }
        }
        // The target did not execute the command: nothing moved.
        Status::BUSY
        | Status::TASK_SET_FULL
        | Status::ACA_ACTIVE
        | Status::RESERVATION_CONFLICT => SrbOutcome {
            srb_status: SrbStatus::ERROR,
            scsi_status: status,
            data_transfer_length: 0,
            sense_len: 0,
        },
        Status::TASK_ABORTED => SrbOutcome {
            srb_status: SrbStatus::ABORTED,
            scsi_status: status,
            data_transfer_length: 0,
            sense_len: 0,
        },
        Status(other) => SrbOutcome {
            srb_status: SrbStatus::ERROR,
            scsi_status: other,
            data_transfer_length: moved(requested, residual),
            sense_len: 0,
        },
    }
}

/// Which task management function a response answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TmfKind {
    /// ABORT TASK (for `SRB_FUNCTION_ABORT_COMMAND`).
    AbortTask,
    /// LOGICAL UNIT RESET (for `SRB_FUNCTION_RESET_LOGICAL_UNIT` and
    /// `SRB_FUNCTION_RESET_DEVICE`).
    LunReset,
}

/// Maps a task management response to the status of the request that
/// asked for it.
#[must_use]
pub const fn map_tmf(kind: TmfKind, response: TmfResponse) -> SrbStatus {
    match (kind, response) {
        (_, TmfResponse::Complete | TmfResponse::Succeeded) => SrbStatus::SUCCESS,
        (TmfKind::AbortTask, TmfResponse::IncorrectLun)
        | (TmfKind::LunReset, TmfResponse::IncorrectLun) => SrbStatus::INVALID_LUN,
        (
            TmfKind::AbortTask,
            TmfResponse::TaskNotFound
            | TmfResponse::NotSupported
            | TmfResponse::Failed
            | TmfResponse::Transport(_),
        ) => SrbStatus::ABORT_FAILED,
        (TmfKind::LunReset, TmfResponse::NotSupported) => SrbStatus::INVALID_REQUEST,
        (TmfKind::LunReset, TmfResponse::TaskNotFound | TmfResponse::Failed) => SrbStatus::ERROR,
        (TmfKind::LunReset, TmfResponse::Transport(kind)) => failure_status(kind),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use CommandOutcome::{Aborted, Failed, Reset, Scsi};

    const SENSE: [u8; 18] = [
        0x70, 0, 0x05, 0, 0, 0, 0, 10, 0, 0, 0, 0, 0x20, 0x00, 0, 0, 0, 0,
    ];

    fn r(outcome: CommandOutcome, residual: Residual, sense: &[u8]) -> CommandResult<'_> {
        CommandResult {
            outcome,
            sense,
            residual,
        }
    }

    fn o(srb_status: SrbStatus, scsi_status: u8, dtl: u32, sense_len: u8) -> SrbOutcome {
        SrbOutcome {
            srb_status,
            scsi_status,
            data_transfer_length: dtl,
            sense_len,
        }
    }

    /// (requested, result, sense capacity) -> outcome: the specification.
    #[test]
    fn command_table() {
        use Residual::{None as Whole, Overrun, Underrun};
        let autosense = SrbStatus::ERROR.with_autosense();
        let table: &[(u32, CommandResult<'_>, usize, SrbOutcome)] = &[
            // GOOD and the other good statuses.
            (
                4096,
                r(Scsi(0x00), Whole, &[]),
                18,
                o(SrbStatus::SUCCESS, 0, 4096, 0),
            ),
            (
                4096,
                r(Scsi(0x04), Whole, &[]),
                18,
                o(SrbStatus::SUCCESS, 4, 4096, 0),
            ),
            // INTERMEDIATE (obsolete since SAM-4: no linked commands) is
            // not a status this initiator can have asked for.
            (
                4096,
                r(Scsi(0x10), Whole, &[]),
                18,
                o(SrbStatus::ERROR, 0x10, 4096, 0),
            ),
            // Residuals.
            (
                4096,
                r(Scsi(0), Underrun(1024), &[]),
                18,
                o(SrbStatus::DATA_OVERRUN, 0, 3072, 0),
            ),
            (
                4096,
                r(Scsi(0), Underrun(0), &[]),
                18,
                o(SrbStatus::SUCCESS, 0, 4096, 0),
            ),
            (
                4096,
                r(Scsi(0), Underrun(9999), &[]),
                18,
                o(SrbStatus::DATA_OVERRUN, 0, 0, 0),
            ),
            (
                4096,
                r(Scsi(0), Overrun(512), &[]),
                18,
                o(SrbStatus::DATA_OVERRUN, 0, 4096, 0),
            ),
            (
                4096,
                r(Scsi(0), Overrun(0), &[]),
                18,
                o(SrbStatus::SUCCESS, 0, 4096, 0),
            ),
            // No data phase: a residual means nothing.
            (
                0,
                r(Scsi(0), Underrun(512), &[]),
                18,
                o(SrbStatus::SUCCESS, 0, 0, 0),
            ),
            // CHECK CONDITION: sense copied, truncated, flagged.
            (
                512,
                r(Scsi(0x02), Whole, &SENSE),
                18,
                o(autosense, 2, 512, 18),
            ),
            (
                512,
                r(Scsi(0x02), Whole, &SENSE),
                8,
                o(autosense, 2, 512, 8),
            ),
            (
                512,
                r(Scsi(0x02), Whole, &SENSE),
                0,
                o(SrbStatus::ERROR, 2, 512, 0),
            ),
            (
                512,
                r(Scsi(0x02), Whole, &[]),
                18,
                o(SrbStatus::ERROR, 2, 512, 0),
            ),
            (
                512,
                r(Scsi(0x02), Underrun(512), &SENSE),
                255,
                o(autosense, 2, 0, 18),
            ),
            // Not executed by the target: nothing moved, class driver retries.
            (
                512,
                r(Scsi(0x08), Whole, &[]),
                18,
                o(SrbStatus::ERROR, 8, 0, 0),
            ),
            (
                512,
                r(Scsi(0x28), Whole, &[]),
                18,
                o(SrbStatus::ERROR, 0x28, 0, 0),
            ),
            (
                512,
                r(Scsi(0x30), Whole, &[]),
                18,
                o(SrbStatus::ERROR, 0x30, 0, 0),
            ),
            (
                512,
                r(Scsi(0x18), Whole, &SENSE),
                18,
                o(SrbStatus::ERROR, 0x18, 0, 0),
            ),
            (
                512,
                r(Scsi(0x40), Whole, &[]),
                18,
                o(SrbStatus::ABORTED, 0x40, 0, 0),
            ),
            // An unknown status is an error, reported as received.
            (
                512,
                r(Scsi(0x7e), Underrun(12), &SENSE),
                18,
                o(SrbStatus::ERROR, 0x7e, 500, 0),
            ),
            // Terminations and transport failures: nothing moved.
            (
                512,
                r(Aborted, Whole, &SENSE),
                18,
                SrbOutcome::local(SrbStatus::ABORTED),
            ),
            (
                512,
                r(Reset, Whole, &[]),
                18,
                SrbOutcome::local(SrbStatus::BUS_RESET),
            ),
            (
                512,
                r(Failed(FailureKind::FailFast), Whole, &[]),
                18,
                SrbOutcome::local(SrbStatus::SELECTION_TIMEOUT),
            ),
            (
                512,
                r(Failed(FailureKind::DeviceLost), Whole, &[]),
                18,
                SrbOutcome::local(SrbStatus::NO_DEVICE),
            ),
            (
                512,
                r(Failed(FailureKind::ConnectionReset), Whole, &[]),
                18,
                SrbOutcome::local(SrbStatus::BUS_RESET),
            ),
            (
                512,
                r(Failed(FailureKind::Timeout), Whole, &[]),
                18,
                SrbOutcome::local(SrbStatus::TIMEOUT),
            ),
            (
                512,
                r(Failed(FailureKind::Protocol), Whole, &[]),
                18,
                SrbOutcome::local(SrbStatus::PHASE_SEQUENCE_FAILURE),
            ),
            (
                512,
                r(Failed(FailureKind::Unsupported), Whole, &[]),
                18,
                SrbOutcome::local(SrbStatus::INVALID_REQUEST),
            ),
        ];
        for (i, (requested, result, capacity, want)) in table.iter().enumerate() {
            assert_eq!(
                map_command(*requested, result, *capacity),
                *want,
                "row {i}: {result:?}"
            );
        }
    }

    #[test]
    fn sense_longer_than_a_byte_can_count_is_capped() {
        let sense = [0x72u8; 300];
        let out = map_command(0, &r(Scsi(2), Residual::None, &sense), 1000);
        assert_eq!(out.sense_len, 255);
    }

    #[test]
    fn no_status_is_ever_pending_or_busy() {
        // Every SAM status and every transport ending gives a real,
        // non-requeueing status.
        for status in 0..=u8::MAX {
            let out = map_command(512, &r(Scsi(status), Residual::None, &SENSE), 18);
            assert!(!out.srb_status.is_pending(), "{status:#x}");
            assert_ne!(out.srb_status.base(), SrbStatus::BUSY, "{status:#x}");
            assert!(out.data_transfer_length <= 512);
        }
    }

    #[test]
    fn tmf_table() {
        use TmfKind::{AbortTask, LunReset};
        use TmfResponse::*;
        let table = [
            (AbortTask, Complete, SrbStatus::SUCCESS),
            (AbortTask, Succeeded, SrbStatus::SUCCESS),
            (AbortTask, TaskNotFound, SrbStatus::ABORT_FAILED),
            (AbortTask, NotSupported, SrbStatus::ABORT_FAILED),
            (AbortTask, Failed, SrbStatus::ABORT_FAILED),
            (AbortTask, IncorrectLun, SrbStatus::INVALID_LUN),
            (
                AbortTask,
                Transport(FailureKind::ConnectionReset),
                SrbStatus::ABORT_FAILED,
            ),
            (LunReset, Complete, SrbStatus::SUCCESS),
            (LunReset, Succeeded, SrbStatus::SUCCESS),
            (LunReset, TaskNotFound, SrbStatus::ERROR),
            (LunReset, Failed, SrbStatus::ERROR),
            (LunReset, NotSupported, SrbStatus::INVALID_REQUEST),
            (LunReset, IncorrectLun, SrbStatus::INVALID_LUN),
            (
                LunReset,
                Transport(FailureKind::ConnectionReset),
                SrbStatus::BUS_RESET,
            ),
            (
                LunReset,
                Transport(FailureKind::DeviceLost),
                SrbStatus::NO_DEVICE,
            ),
        ];
        for (kind, response, want) in table {
            assert_eq!(map_tmf(kind, response), want, "{kind:?} {response:?}");
        }
    }
}
