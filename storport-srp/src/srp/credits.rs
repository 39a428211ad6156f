//! SRP credits (the request limit), exactly as the protocol says.
//!
//! The target grants credits at login (`req_lim_delta` of the login
//! response) and returns them in every `SRP_RSP`, `SRP_CRED_REQ` and
//! `SRP_AER_REQ`. Every `SRP_CMD` and `SRP_TSK_MGMT` the initiator sends
//! spends one; the responses the initiator sends to target requests
//! (`SRP_CRED_RSP`, `SRP_AER_RSP`) spend none.
//!
//! One credit is kept for task management (`SRP_TSK_MGMT_SQ_SIZE`): a
//! command needs the request limit above one, a task management function
//! only above zero — so an abort can always be sent while commands are
//! stuck, as in Linux `ib_srp`'s `__srp_get_tx_iu`.
//!
//! [`Credits`] holds no lock: the channel keeps it under the same lock as
//! its connection state, and [`Credits::reset`] starts a new connection
//! epoch, so a delta that belongs to a dead connection can never reach a
//! new one (the ibmvscsi "request limit out of sync after transport loss"
//! race).
//!
//! # IRQL
//! Pure computation: any IRQL.

#![forbid(unsafe_code)]

/// Credits kept for task management.
pub const TMF_RESERVE: i32 = 1;

/// One channel's request limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Credits {
    req_lim: i32,
    zero_req_lim: u64,
    starved: bool,
}

impl Credits {
    /// No credit (not logged in).
    #[must_use]
    pub const fn new() -> Self {
        Credits {
            req_lim: 0,
            zero_req_lim: 0,
            starved: false,
        }
    }

    /// A new login granted `req_lim`.
    pub fn reset(&mut self, req_lim: i32) {
        self.req_lim = req_lim.max(0);
        self.starved = false;
    }

    /// The connection is gone: nothing may be spent.
    pub fn clear(&mut self) {
        self.req_lim = 0;
        self.starved = false;
    }

    /// Spends a credit for a command; `false` (counted in
    /// [`Self::zero_req_lim`]) if only the task management reserve is left.
    pub fn take_command(&mut self) -> bool {
        if self.req_lim <= TMF_RESERVE {
            self.zero_req_lim += 1;
            self.starved = true;
            return false;
        }
        self.req_lim -= 1;
        true
    }

    /// Spends a credit for a task management function (the reserve too).
    pub fn take_tmf(&mut self) -> bool {
        if self.req_lim <= 0 {
            self.zero_req_lim += 1;
            self.starved = true;
            return false;
        }
        self.req_lim -= 1;
        true
    }

    /// Gives back a credit spent for an IU that was never sent.
    pub fn give_back(&mut self) {
        self.req_lim = self.req_lim.saturating_add(1);
    }

    /// Applies a `req_lim_delta` (it may be negative). Returns `true` when
    /// a refusal happened since the last report and the limit now allows
    /// a command again: the caller tells the core credit is back.
    pub fn add(&mut self, delta: i32) -> bool {
        self.req_lim = self.req_lim.saturating_add(delta);
        if self.starved && self.req_lim > TMF_RESERVE {
            self.starved = false;
            return true;
        }
        false
    }

    /// Marks that a caller was refused for another resource (slots, MRs,
    /// send-queue room) so the next return of credit is reported too.
    pub fn note_starved(&mut self) {
        self.starved = true;
    }

    /// Takes the "someone was refused" mark (when a resource other than
    /// credit came back).
    pub fn take_starved(&mut self) -> bool {
        core::mem::replace(&mut self.starved, false)
    }

    /// The request limit now (`req_lim` in Linux's sysfs).
    #[must_use]
    pub const fn req_lim(&self) -> i32 {
        self.req_lim
    }

    /// How often a command or TMF found no credit (`zero_req_lim`).
    #[must_use]
    pub const fn zero_req_lim(&self) -> u64 {
        self.zero_req_lim
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_leave_the_reserve() {
        let mut c = Credits::new();
        assert!(!c.take_command());
        assert!(!c.take_tmf());
        assert_eq!(c.zero_req_lim(), 2);
        c.reset(3);
        assert!(c.take_command());
        assert!(c.take_command());
        assert_eq!(c.req_lim(), 1);
        assert!(!c.take_command(), "the last credit is for task management");
        assert_eq!(c.zero_req_lim(), 3);
        assert!(c.take_tmf());
        assert!(!c.take_tmf());
        assert_eq!(c.req_lim(), 0);
        assert_eq!(c.zero_req_lim(), 4);
    }

    #[test]
    fn refusal_is_reported_once_when_credit_returns() {
        let mut c = Credits::new();
        c.reset(1);
        assert!(!c.take_command());
        assert!(!c.add(0), "still only the reserve");
        assert!(c.add(1), "credit back after a refusal");
        assert!(!c.add(5), "reported once");
        assert_eq!(c.req_lim(), 7);
        // No refusal, no report.
        assert!(!c.add(1));
    }

    #[test]
    fn negative_deltas_and_saturation() {
        let mut c = Credits::new();
        c.reset(4);
        assert!(!c.add(-10));
        assert_eq!(c.req_lim(), -6);
        assert!(!c.take_tmf());
        assert!(c.add(10), "refused meanwhile");
        assert_eq!(c.req_lim(), 4);
        c.reset(i32::MAX);
        c.give_back();
        assert!(!c.add(i32::MAX));
        assert_eq!(c.req_lim(), i32::MAX);
        c.reset(-5);
        assert_eq!(c.req_lim(), 0, "a negative grant is no credit");
    }

    #[test]
    fn epochs_and_other_resources() {
        let mut c = Credits::new();
        c.reset(10);
        assert!(c.take_command());
        c.give_back();
        assert_eq!(c.req_lim(), 10);
        c.note_starved();
        assert!(c.take_starved());
        assert!(!c.take_starved());
        c.note_starved();
        c.clear();
        assert_eq!(c.req_lim(), 0);
        assert!(!c.take_starved(), "a new epoch starts clean");
    }
}
