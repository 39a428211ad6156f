//! Recovery at error recovery level 0: the session is reinstated (a new
//! login with the same ISID and TSIH 0, which makes the target end the old
//! one), with the same timers Linux's SRP transport runs for an rport.
//!
//! ```text
//!            connected                 connection lost
//! Connecting ─────────► Live ──────────────────────────► Blocked
//!     │                  ▲  ◄───── reconnected ──────────   │
//!     │                  └──────── reconnected ───────┐     │ fast_io_fail
//!     │ fast_io_fail (or a fatal login error)          │     ▼
//!     └──────────────────────────────────────────► FailFast
//!                                                          │ dev_loss
//!                                                          ▼
//!                                                        Lost (terminal)
//! ```
//!
//! * While not `Live`, a reconnect is attempted every `reconnect_delay`
//!   seconds; after ten failed attempts the delay grows linearly up to a
//!   hundredfold, as `scsi_transport_srp` backs off. A target's
//!   Time2Wait (from a logout response or a drop announcement) is honoured
//!   as a lower bound.
//! * `Blocked`: new commands wait (the engine answers `Blocked`).
//! * `FailFast` after `fast_io_fail` seconds without a connection (or at
//!   once after a login error that retrying cannot fix, such as failed
//!   authentication): commands fail fast so multipath can use another
//!   path; reconnects go on.
//! * `Lost` after `dev_loss` seconds: the target is given up.
//!
//! Pure state and time: [`Recovery::poll_at`] says when to call
//! [`Recovery::handle_timeout`], which says when to start a login.

use super::description::Timeouts;
use super::login::Disposition;
use super::{Millis, earliest};
use crate::miniport::transport::{FailureKind, PrepareError, TargetState};

/// Failed attempts before the back-off starts growing.
const BACKOFF_AFTER: u32 = 10;
/// Largest back-off multiplier.
const BACKOFF_MAX: u32 = 100;

/// What [`Recovery::handle_timeout`] asks of the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RecoveryStep {
    /// Start a login now (connect, then [`super::login::Login`]).
    pub connect: bool,
    /// The target state changed to this (report it to the core).
    pub state_changed: Option<TargetState>,
}

/// The recovery machine of one target.
#[derive(Debug, Clone)]
pub struct Recovery {
    timeouts: Timeouts,
    state: TargetState,
    /// When the target was last without a connection (first connect or
    /// loss); the fast-fail and dev-loss timers run from here.
    down_since: Option<Millis>,
    next_attempt: Option<Millis>,
    attempt_running: bool,
    failed_attempts: u32,
}

impl Recovery {
    /// A target being connected for the first time at `now`: the first
    /// login may start at once.
    #[must_use]
    pub fn new(timeouts: &Timeouts, now: Millis) -> Self {
        Self {
            timeouts: *timeouts,
            state: TargetState::Connecting,
            down_since: Some(now),
            next_attempt: Some(now),
            attempt_running: false,
            failed_attempts: 0,
        }
    }

    /// The state to report to the core.
    #[must_use]
    pub const fn state(&self) -> TargetState {
        self.state
    }

    /// Failed reconnect attempts since the last connection.
    #[must_use]
    pub const fn failed_attempts(&self) -> u32 {
        self.failed_attempts
    }

    /// What a new command gets in this state: `Ok` when live.
    ///
    /// # Errors
    ///
    /// [`PrepareError::Blocked`] while connecting or blocked,
    /// [`PrepareError::Failed`] with [`FailureKind::FailFast`] or
    /// [`FailureKind::DeviceLost`].
    pub const fn admit(&self) -> Result<(), PrepareError> {
        match self.state {
            TargetState::Live => Ok(()),
            TargetState::Connecting | TargetState::Blocked => Err(PrepareError::Blocked),
            TargetState::FailFast => Err(PrepareError::Failed(FailureKind::FailFast)),
            TargetState::Lost => Err(PrepareError::Failed(FailureKind::DeviceLost)),
        }
    }

    /// How commands that were outstanding when the connection went down
    /// end: retried by the class driver while the target may come back.
    #[must_use]
    pub const fn outstanding_failure(&self) -> FailureKind {
        match self.state {
            TargetState::FailFast => FailureKind::FailFast,
            TargetState::Lost => FailureKind::DeviceLost,
            _ => FailureKind::ConnectionReset,
        }
    }

    fn fast_fail_at(&self) -> Option<Millis> {
        let since = self.down_since?;
        let secs = self.timeouts.fast_io_fail?;
        Some(since.plus(Millis::from_secs(secs)))
    }

    fn dev_loss_at(&self) -> Option<Millis> {
        let since = self.down_since?;
        let secs = self.timeouts.dev_loss?;
        Some(since.plus(Millis::from_secs(secs)))
    }

    /// When [`Self::handle_timeout`] must run next.
    #[must_use]
    pub fn poll_at(&self) -> Option<Millis> {
        if self.state == TargetState::Lost {
            return None;
        }
        let mut at = if self.attempt_running {
            None
        } else {
            self.next_attempt
        };
        if self.state != TargetState::Live {
            if self.state != TargetState::FailFast {
                at = earliest(at, self.fast_fail_at());
            }
            at = earliest(at, self.dev_loss_at());
        }
        at
    }

    fn set_state(&mut self, state: TargetState, step: &mut RecoveryStep) {
        if self.state != state {
            self.state = state;
            step.state_changed = Some(state);
        }
    }

    /// Runs the timers due at `now`.
    pub fn handle_timeout(&mut self, now: Millis) -> RecoveryStep {
        let mut step = RecoveryStep::default();
        if self.state == TargetState::Lost || self.state == TargetState::Live {
            return step;
        }
        if self.dev_loss_at().is_some_and(|at| now >= at) {
            self.set_state(TargetState::Lost, &mut step);
            self.next_attempt = None;
            return step;
        }
        if self.state != TargetState::FailFast && self.fast_fail_at().is_some_and(|at| now >= at) {
            self.set_state(TargetState::FailFast, &mut step);
        }
        if !self.attempt_running && self.next_attempt.is_some_and(|at| now >= at) {
            self.attempt_running = true;
            self.next_attempt = None;
            step.connect = true;
        }
        step
    }

    /// The login succeeded: the target is live.
    pub fn connected(&mut self) -> RecoveryStep {
        let mut step = RecoveryStep::default();
        if self.state == TargetState::Lost {
            return step;
        }
        self.attempt_running = false;
        self.failed_attempts = 0;
        self.down_since = None;
        self.next_attempt = None;
        self.set_state(TargetState::Live, &mut step);
        step
    }

    fn delay(&self, time2wait: u16) -> Millis {
        let factor = self
            .failed_attempts
            .saturating_sub(BACKOFF_AFTER)
            .clamp(1, BACKOFF_MAX);
        let secs = self.timeouts.reconnect_delay.saturating_mul(factor);
        Millis::from_secs(secs.max(u32::from(time2wait)))
    }

    /// The connection of a live session was lost (failure, drop, logout
    /// requested by the target) at `now`; `time2wait` is the target's
    /// requested wait (0 if none).
    pub fn connection_lost(&mut self, now: Millis, time2wait: u16) -> RecoveryStep {
        let mut step = RecoveryStep::default();
        if self.state == TargetState::Lost {
            return step;
        }
        self.attempt_running = false;
        if self.down_since.is_none() {
            self.down_since = Some(now);
        }
        self.next_attempt = Some(now.plus(self.delay(time2wait)));
        if self.state == TargetState::Live {
            self.set_state(TargetState::Blocked, &mut step);
        }
        step
    }

    /// A login attempt failed at `now`.
    pub fn attempt_failed(&mut self, now: Millis, disposition: Disposition) -> RecoveryStep {
        let mut step = RecoveryStep::default();
        if self.state == TargetState::Lost {
            return step;
        }
        self.attempt_running = false;
        self.failed_attempts = self.failed_attempts.saturating_add(1);
        self.next_attempt = Some(match disposition {
            // A redirect is followed at once.
            Disposition::Redirect => now,
            Disposition::Retry | Disposition::Fatal => now.plus(self.delay(0)),
        });
        if disposition == Disposition::Fatal {
            // Retrying will not fix it soon: fail I/O fast meanwhile.
            self.set_state(TargetState::FailFast, &mut step);
        }
        step
    }

    /// The target is detached: give it up now.
    pub fn remove(&mut self) -> RecoveryStep {
        let mut step = RecoveryStep::default();
        self.next_attempt = None;
        self.attempt_running = false;
        self.set_state(TargetState::Lost, &mut step);
        step
    }
}

#[cfg(test)]
mod tests;
