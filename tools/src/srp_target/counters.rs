//! What the target counts: logins, IUs by type, SCSI commands by operation
//! code, bytes, credits, and the things a test wants to see happen (or not).
//!
//! Relaxed atomics, bumped by the channel threads; [`Counters::snapshot`]
//! reads them all (not as one atomic picture, which no test needs).

use std::sync::atomic::{AtomicU64, Ordering};

use storport_srp::wire::srp::RejectReason;

macro_rules! counters {
    ($($(#[$doc:meta])* $name:ident,)*) => {
        /// The live counters of one target.
        #[derive(Debug, Default)]
        pub(crate) struct Counters {
            $(pub(crate) $name: AtomicU64,)*
            /// SCSI commands by operation code.
            pub(crate) scsi_ops: ScsiOps,
            /// Logins rejected, by reason (0..=6: 0x00010000 + n; 7: other).
            pub(crate) rejects: [AtomicU64; 8],
        }

        /// A snapshot of the target's counters.
        #[derive(Debug, Clone, PartialEq, Eq, Default)]
        pub struct CountersSnapshot {
            $($(#[$doc])* pub $name: u64,)*
            /// SCSI commands received, by operation code.
            pub scsi_ops: Vec<(u8, u64)>,
            /// Logins rejected, by SRP reason.
            pub rejects: Vec<(RejectReason, u64)>,
        }

        impl Counters {
            /// Reads every counter.
            pub(crate) fn snapshot(&self) -> CountersSnapshot {
                CountersSnapshot {
                    $($name: self.$name.load(Ordering::Relaxed),)*
                    scsi_ops: self.scsi_ops.nonzero(),
                    rejects: self
                        .rejects
                        .iter()
                        .enumerate()
                        .filter_map(|(i, c)| {
                            let n = c.load(Ordering::Relaxed);
                            (n > 0).then(|| (reason_of_index(i), n))
                        })
                        .collect(),
                }
            }
        }
    };
}

counters! {
    /// Login requests seen (accepted or not).
    login_requests,
    /// Logins accepted (LOGIN_RSP sent in a CM REP).
    logins_accepted,
    /// Logins rejected (LOGIN_REJ sent in a CM REJ).
    logins_rejected,
    /// Channels that reached the live state (zero-length WRITE completed).
    channels_live,
    /// Channels torn down.
    channels_closed,
    /// Existing channels terminated by a SINGLE login of the same nexus.
    channels_terminated_by_relogin,
    /// `SRP_CMD` IUs received.
    srp_cmd,
    /// `SRP_TSK_MGMT` IUs received.
    srp_tsk_mgmt,
    /// `SRP_I_LOGOUT` IUs received.
    srp_i_logout,
    /// `SRP_CRED_RSP` IUs received.
    srp_cred_rsp,
    /// `SRP_AER_RSP` IUs received.
    srp_aer_rsp,
    /// IUs dropped: unknown type, target-only type, too short to answer.
    malformed_ius,
    /// `SRP_CMD`s with descriptors the target could not use (answered with
    /// CHECK CONDITION, INVALID FIELD IN CDB).
    bad_descriptors,
    /// IUs that arrived while the initiator held no credit.
    credit_violations,
    /// `SRP_RSP`s sent (commands and task management).
    responses_sent,
    /// Credits granted: the login's plus every `req_lim_delta` sent.
    credits_granted,
    /// Responses sent with `req_lim_delta` 0 by the withholding switch.
    credits_withheld_responses,
    /// `SRP_CRED_REQ`s sent.
    cred_req_sent,
    /// `SRP_AER_REQ`s sent.
    aer_req_sent,
    /// `SRP_T_LOGOUT`s sent.
    t_logout_sent,
    /// Target requests whose response tag matched nothing outstanding.
    unmatched_target_responses,
    /// Bytes RDMA-written to initiators (data-in).
    bytes_data_in,
    /// Bytes RDMA-read from initiators (data-out).
    bytes_data_out,
    /// Bytes of immediate data received.
    bytes_immediate,
    /// RDMA READ work requests posted.
    rdma_reads,
    /// RDMA WRITE work requests posted (zero-length and hostile ones
    /// included).
    rdma_writes,
    /// Most RDMA READs outstanding at once on one channel.
    max_reads_outstanding,
    /// Zero-length RDMA WRITEs completed after a connection came up.
    zero_length_writes,
    /// Task management: ABORT_TASK received.
    tm_abort_task,
    /// Task management: LUN_RESET received.
    tm_lun_reset,
    /// Task management: other functions (answered FUNCTION NOT SUPPORTED).
    tm_unsupported,
    /// Commands aborted by task management (their responses never sent).
    tasks_aborted,
    /// Responses held back by the delay switch.
    responses_delayed,
    /// Responses dropped by the drop switch.
    responses_dropped,
    /// Responses sent malformed by the corruption switch.
    responses_corrupted,
    /// Connections dropped by the disconnect switch.
    forced_disconnects,
    /// Commands that waited for staging memory.
    staging_waits,
    /// Work completions with an error other than a flush.
    wr_errors,
    /// Work completions with a protection or access error (remote access,
    /// local protection, local access).
    protection_errors,
    /// Hostile RDMA attempts made.
    hostile_attempts,
    /// `SRP_CMD`s served in the CQ's DPC, without waking the channel
    /// thread (see the lane in `srp_target::lane`).
    ius_served_in_dpc,
    /// READs whose data went out straight from the store's registered
    /// chunks (no staging copy), on the thread or in the DPC.
    zero_copy_reads,
}

/// The SRP reason of a reject-counter index.
fn reason_of_index(i: usize) -> RejectReason {
    match u32::try_from(i) {
        Ok(n) if n < 7 => RejectReason::from_code(0x0001_0000 + n),
        _ => RejectReason::Other(0),
    }
}

impl Counters {
    /// Counts one reject.
    pub(crate) fn reject(&self, reason: RejectReason) {
        let code = reason.code();
        let index = match code.checked_sub(0x0001_0000) {
            Some(n) if n < 7 => n as usize,
            _ => 7,
        };
        self.logins_rejected.fetch_add(1, Ordering::Relaxed);
        if let Some(c) = self.rejects.get(index) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Adds `n` to a counter.
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Raises a high-water mark.
    pub(crate) fn raise(counter: &AtomicU64, value: u64) {
        counter.fetch_max(value, Ordering::Relaxed);
    }
}

/// One counter per SCSI operation code.
#[derive(Debug)]
pub(crate) struct ScsiOps([AtomicU64; 256]);

impl Default for ScsiOps {
    fn default() -> Self {
        Self(std::array::from_fn(|_| AtomicU64::new(0)))
    }
}

impl ScsiOps {
    pub(crate) fn count(&self, opcode: u8) {
        if let Some(c) = self.0.get(usize::from(opcode)) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn nonzero(&self) -> Vec<(u8, u64)> {
        (0u8..=255)
            .zip(self.0.iter())
            .filter_map(|(op, c)| {
                let n = c.load(Ordering::Relaxed);
                (n > 0).then_some((op, n))
            })
            .collect()
    }
}

impl CountersSnapshot {
    /// SCSI commands received with operation code `opcode`.
    pub fn scsi(&self, opcode: u8) -> u64 {
        self.scsi_ops
            .iter()
            .find(|(op, _)| *op == opcode)
            .map_or(0, |(_, n)| *n)
    }

    /// Logins rejected with `reason`.
    pub fn rejected(&self, reason: RejectReason) -> u64 {
        self.rejects
            .iter()
            .find(|(r, _)| *r == reason)
            .map_or(0, |(_, n)| *n)
    }
}
