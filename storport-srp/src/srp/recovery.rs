//! The recovery state machine of one target, after Linux's SRP transport
//! class (`scsi_transport_srp`, the "rport").
//!
//! ```text
//!            start                 login ok
//!   (any) ─────────► Connecting ───────────────► Live
//!                        │ login fails,               │ QP error, DREQ,
//!                        │ reconnect off              │ T_LOGOUT, bus reset
//!                        ▼                            ▼
//!                      Lost ◄── dev_loss_tmo ──── Blocked ── login ok ──► Live
//!                        ▲                            │ fast_io_fail_tmo (or a
//!                        │                            │ failed reconnect with
//!                        └──── dev_loss_tmo ───── FailFast   both timers off)
//!                                                     └── login ok ──► Live
//! ```
//!
//! * A transport failure of a live target tears down every channel,
//!   blocks new I/O (the core answers `SRB_STATUS_BUSY` and holds the
//!   LUNs), schedules a reconnect after `reconnect_delay` and arms
//!   `fast_io_fail_tmo` and `dev_loss_tmo` (`__srp_start_tl_fail_timers`).
//! * A failed reconnect is retried after `reconnect_delay × min(100,
//!   max(1, failures − 10))` (`srp_reconnect_work`).
//! * `fast_io_fail_tmo` moves a blocked target to FailFast: new and
//!   outstanding I/O fails at once, so multipath can use another path;
//!   reconnecting goes on.
//! * `dev_loss_tmo` declares the target lost: no more reconnects, I/O
//!   fails with "no device" until the adapter restarts.
//! * A successful login makes the target live again and cancels both
//!   timers.
//!
//! Where this differs from Linux, and why:
//! * With `fast_io_fail_tmo` and `dev_loss_tmo` both off, Linux leaves the
//!   port RUNNING after a failure and fails I/O fast once a reconnect
//!   fails; here the target is Blocked (I/O waits) until that first
//!   failed reconnect, then FailFast — the same end, without I/O hitting a
//!   dead queue pair meanwhile.
//! * A bus reset (`HwResetBus`, StorPort's last resort after timeouts)
//!   reconnects at once, like Linux's host reset, but a failed reconnect
//!   then follows the transport-failure path (Blocked, timers) rather than
//!   failing I/O fast immediately.
//! * The first login of a target that never came up is retried with the
//!   same back-off (Linux leaves that to `srp_daemon`); with
//!   `reconnect_delay` off, a failed first login loses the target.
//!
//! The machine is pure: the engine feeds it events with the time, applies
//! the [`Actions`] it returns, and arms one platform timer for
//! [`Recovery::next_deadline`].
//!
//! # IRQL
//! Pure computation: any IRQL.

#![forbid(unsafe_code)]

use super::params::Timeouts;
use crate::miniport::transport::TargetState;

/// Why the channels of a target are torn down.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Cause {
    /// A QP error, a DREQ, a protocol violation, a target logout.
    Transport,
    /// A bus reset.
    Reset,
    /// `dev_loss_tmo` expired.
    DeviceLost,
    /// The adapter stops.
    Stop,
}

/// What the engine must do after an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Actions {
    /// Tear down every channel of the target.
    pub teardown: Option<Cause>,
    /// Start a connection attempt (every channel, first one `SINGLE`).
    pub connect: bool,
    /// The target's new state, to report to the core.
    pub state: Option<TargetState>,
}

/// Nanoseconds of a timeout.
fn ns(d: Option<core::time::Duration>) -> Option<u64> {
    d.map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// One target's recovery state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recovery {
    state: TargetState,
    connecting: bool,
    failed_reconnects: u32,
    reconnect_at: Option<u64>,
    fast_io_fail_at: Option<u64>,
    dev_loss_at: Option<u64>,
    timeouts: Timeouts,
}

impl Recovery {
    /// A target not started yet (reported as Connecting).
    #[must_use]
    pub const fn new(timeouts: Timeouts) -> Self {
        Recovery {
            state: TargetState::Connecting,
            connecting: false,
            failed_reconnects: 0,
            reconnect_at: None,
            fast_io_fail_at: None,
            dev_loss_at: None,
            timeouts,
        }
    }

    /// The state now.
    #[must_use]
    pub const fn state(&self) -> TargetState {
        self.state
    }

    /// Whether a connection attempt is under way.
    #[must_use]
    pub const fn connecting(&self) -> bool {
        self.connecting
    }

    /// Consecutive failed reconnects.
    #[must_use]
    pub const fn failed_reconnects(&self) -> u32 {
        self.failed_reconnects
    }

    /// When the timer must fire next (nanoseconds on the caller's clock).
    #[must_use]
    pub fn next_deadline(&self) -> Option<u64> {
        [self.reconnect_at, self.fast_io_fail_at, self.dev_loss_at]
            .into_iter()
            .flatten()
            .min()
    }

    fn set_state(&mut self, state: TargetState, actions: &mut Actions) {
        if self.state != state {
            self.state = state;
            actions.state = Some(state);
        }
    }

    fn clear_timers(&mut self) {
        self.reconnect_at = None;
        self.fast_io_fail_at = None;
        self.dev_loss_at = None;
    }

    fn connect_now(&mut self, actions: &mut Actions) {
        self.reconnect_at = None;
        self.connecting = true;
        actions.connect = true;
    }

    /// The back-off delay after `failed_reconnects` failures.
    fn reconnect_delay(&self) -> Option<u64> {
        let base = ns(self.timeouts.reconnect_delay)?;
        let factor = u64::from(self.failed_reconnects.saturating_sub(10).clamp(1, 100));
        Some(base.saturating_mul(factor))
    }

    /// The adapter starts: connect.
    pub fn start(&mut self, _now: u64) -> Actions {
        let mut a = Actions::default();
        self.clear_timers();
        self.failed_reconnects = 0;
        self.set_state(TargetState::Connecting, &mut a);
        self.connect_now(&mut a);
        a
    }

    /// A connection attempt ended (`ok`: every channel that could log in
    /// did, the first one at least).
    pub fn connect_finished(&mut self, now: u64, ok: bool) -> Actions {
        let mut a = Actions::default();
        if !self.connecting {
            // Not ours (stale), or overtaken by dev_loss / stop.
            if ok {
                a.teardown = Some(match self.state {
                    TargetState::Lost => Cause::DeviceLost,
                    _ => Cause::Stop,
                });
            }
            return a;
        }
        self.connecting = false;
        if ok {
            self.failed_reconnects = 0;
            self.clear_timers();
            self.set_state(TargetState::Live, &mut a);
            return a;
        }
        self.failed_reconnects = self.failed_reconnects.saturating_add(1);
        self.reconnect_at = self.reconnect_delay().map(|d| now.saturating_add(d));
        match self.state {
            TargetState::Connecting if self.reconnect_at.is_none() => {
                self.set_state(TargetState::Lost, &mut a);
            }
            TargetState::Blocked
                if self.fast_io_fail_at.is_none() && self.dev_loss_at.is_none() =>
            {
                self.set_state(TargetState::FailFast, &mut a);
            }
            _ => {}
        }
        if self.state == TargetState::FailFast
            && self.reconnect_at.is_none()
            && self.dev_loss_at.is_none()
        {
            // Nothing would ever change again: no reconnect, no loss.
            self.set_state(TargetState::Lost, &mut a);
        }
        a
    }

    /// Arms the failure timers and blocks I/O, as a transport failure of a
    /// live target does.
    fn fail(&mut self, now: u64, a: &mut Actions) {
        self.set_state(TargetState::Blocked, a);
        self.fast_io_fail_at = ns(self.timeouts.fast_io_fail).map(|d| now.saturating_add(d));
        self.dev_loss_at = ns(self.timeouts.dev_loss).map(|d| now.saturating_add(d));
        self.reconnect_at = ns(self.timeouts.reconnect_delay).map(|d| now.saturating_add(d));
    }

    /// A live channel failed (QP error, DREQ, target logout, protocol
    /// violation).
    pub fn transport_failed(&mut self, now: u64) -> Actions {
        let mut a = Actions::default();
        if self.connecting {
            // The attempt under way fails with it.
            a.teardown = Some(Cause::Transport);
            let mut b = self.connect_finished(now, false);
            b.teardown = a.teardown;
            return b;
        }
        if self.state == TargetState::Live {
            a.teardown = Some(Cause::Transport);
            self.fail(now, &mut a);
            if self.reconnect_at.is_none()
                && self.fast_io_fail_at.is_none()
                && self.dev_loss_at.is_none()
            {
                self.set_state(TargetState::Lost, &mut a);
            }
        }
        a
    }

    /// A bus reset: terminate everything and reconnect at once.
    pub fn reset(&mut self, now: u64) -> Actions {
        let mut a = Actions::default();
        match self.state {
            TargetState::Lost => {}
            TargetState::Live => {
                a.teardown = Some(Cause::Reset);
                self.fail(now, &mut a);
                self.connect_now(&mut a);
            }
            TargetState::Connecting | TargetState::Blocked | TargetState::FailFast => {
                if !self.connecting {
                    a.teardown = Some(Cause::Reset);
                    self.connect_now(&mut a);
                }
            }
        }
        a
    }

    /// The adapter stops: tear down, forget the timers, start over at the
    /// next [`Self::start`].
    pub fn stop(&mut self) -> Actions {
        let mut a = Actions {
            teardown: Some(Cause::Stop),
            ..Actions::default()
        };
        self.clear_timers();
        self.connecting = false;
        self.failed_reconnects = 0;
        self.set_state(TargetState::Connecting, &mut a);
        a
    }

    /// The timer fired at `now`: runs every deadline that is due.
    pub fn timer(&mut self, now: u64) -> Actions {
        let mut a = Actions::default();
        let due = |t: Option<u64>| t.is_some_and(|t| t <= now);
        if due(self.fast_io_fail_at) {
            self.fast_io_fail_at = None;
            if self.state == TargetState::Blocked {
                self.set_state(TargetState::FailFast, &mut a);
            }
        }
        if due(self.dev_loss_at) {
            self.clear_timers();
            if self.connecting || self.state != TargetState::Live {
                self.connecting = false;
                a.teardown = Some(Cause::DeviceLost);
                self.set_state(TargetState::Lost, &mut a);
            }
        }
        if due(self.reconnect_at) {
            self.reconnect_at = None;
            if !self.connecting && !matches!(self.state, TargetState::Lost | TargetState::Live) {
                self.connect_now(&mut a);
            }
        }
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use TargetState::{Blocked, Connecting, FailFast, Live, Lost};
    use core::time::Duration;

    const S: u64 = 1_000_000_000;

    fn t(r: Option<u64>, f: Option<u64>, d: Option<u64>) -> Timeouts {
        Timeouts::new(
            r.map(Duration::from_secs),
            f.map(Duration::from_secs),
            d.map(Duration::from_secs),
        )
        .unwrap()
    }

    fn live(timeouts: Timeouts) -> Recovery {
        let mut r = Recovery::new(timeouts);
        let a = r.start(0);
        assert!(a.connect && a.state.is_none(), "{a:?}");
        let a = r.connect_finished(0, true);
        assert_eq!(a.state, Some(Live));
        r
    }

    #[test]
    fn first_login_and_retry_with_backoff() {
        let mut r = Recovery::new(t(Some(10), Some(15), Some(600)));
        assert_eq!(r.state(), Connecting);
        let a = r.start(0);
        assert!(a.connect && r.connecting());
        // A repeated result is stale.
        let a = r.connect_finished(S, false);
        assert_eq!(a, Actions::default());
        assert!(!r.connecting());
        assert_eq!(r.state(), Connecting, "not visible: no fail timers");
        assert_eq!(r.next_deadline(), Some(11 * S));
        assert_eq!(r.connect_finished(S, false), Actions::default(), "stale");
        // Not due yet.
        assert_eq!(r.timer(10 * S), Actions::default());
        let a = r.timer(11 * S);
        assert!(a.connect);
        // Eleven failures at the base delay, then linear back-off.
        let mut now = 11 * S;
        for n in 2..=14u64 {
            r.connect_finished(now, false);
            let factor = n.saturating_sub(10).clamp(1, 100);
            assert_eq!(
                r.next_deadline(),
                Some(now + 10 * S * factor),
                "failure {n}"
            );
            now = r.next_deadline().unwrap();
            assert!(r.timer(now).connect);
        }
        assert_eq!(r.failed_reconnects(), 14);
        let a = r.connect_finished(now, true);
        assert_eq!(a.state, Some(Live));
        assert_eq!(r.failed_reconnects(), 0);
        assert_eq!(r.next_deadline(), None);
    }

    #[test]
    fn backoff_caps_at_one_hundred() {
        let mut r = Recovery::new(t(Some(1), None, Some(500)));
        r.start(0);
        for _ in 0..200 {
            r.connect_finished(0, false);
            assert!(r.timer(r.next_deadline().unwrap()).connect);
        }
        r.connect_finished(0, false);
        assert_eq!(r.next_deadline(), Some(100 * S));
    }

    #[test]
    fn first_login_without_reconnect_loses_the_target() {
        let mut r = Recovery::new(t(None, Some(5), Some(10)));
        r.start(0);
        let a = r.connect_finished(0, false);
        assert_eq!(a.state, Some(Lost));
        assert_eq!(r.next_deadline(), None);
    }

    #[test]
    fn transport_failure_blocks_then_fails_fast_then_is_lost() {
        let mut r = live(t(Some(10), Some(15), Some(60)));
        let a = r.transport_failed(100 * S);
        assert_eq!(a.teardown, Some(Cause::Transport));
        assert_eq!(a.state, Some(Blocked));
        assert!(!a.connect);
        assert_eq!(r.next_deadline(), Some(110 * S));
        // A second failure while blocked changes nothing.
        assert_eq!(r.transport_failed(101 * S), Actions::default());
        let a = r.timer(110 * S);
        assert!(a.connect && a.state.is_none());
        r.connect_finished(111 * S, false);
        assert_eq!(r.state(), Blocked, "fail timers running: still blocked");
        assert_eq!(r.next_deadline(), Some(115 * S));
        let a = r.timer(115 * S);
        assert_eq!(a.state, Some(FailFast));
        assert!(a.teardown.is_none());
        // Reconnects go on while failing fast.
        let a = r.timer(121 * S);
        assert!(a.connect);
        r.connect_finished(122 * S, false);
        let a = r.timer(160 * S);
        assert_eq!(a.state, Some(Lost));
        assert_eq!(a.teardown, Some(Cause::DeviceLost));
        assert_eq!(r.next_deadline(), None);
        // Lost is final until a restart.
        assert_eq!(r.transport_failed(170 * S), Actions::default());
        assert_eq!(r.reset(170 * S), Actions::default());
        assert_eq!(r.timer(10_000 * S), Actions::default());
        let a = r.stop();
        assert_eq!(a.state, Some(Connecting));
        assert!(r.start(0).connect);
    }

    #[test]
    fn reconnect_success_cancels_the_timers() {
        let mut r = live(Timeouts::default());
        r.transport_failed(0);
        assert!(r.timer(10 * S).connect);
        let a = r.connect_finished(11 * S, true);
        assert_eq!(a.state, Some(Live));
        assert_eq!(r.next_deadline(), None);
        assert_eq!(r.timer(700 * S), Actions::default());
    }

    #[test]
    fn recovery_from_fail_fast() {
        let mut r = live(Timeouts::default());
        r.transport_failed(0);
        assert!(r.timer(10 * S).connect);
        r.connect_finished(10 * S, false);
        assert_eq!(r.timer(15 * S).state, Some(FailFast));
        assert!(r.timer(20 * S).connect);
        assert_eq!(r.connect_finished(20 * S, true).state, Some(Live));
    }

    #[test]
    fn dev_loss_during_an_attempt_aborts_it() {
        let mut r = live(t(Some(1), None, Some(5)));
        r.transport_failed(0);
        assert!(r.timer(S).connect);
        let a = r.timer(5 * S);
        assert_eq!(a.state, Some(Lost));
        assert_eq!(a.teardown, Some(Cause::DeviceLost));
        assert!(!r.connecting());
        // The attempt's late success is torn down.
        let a = r.connect_finished(6 * S, true);
        assert_eq!(a.teardown, Some(Cause::DeviceLost));
        assert_eq!(r.state(), Lost);
    }

    #[test]
    fn both_fail_timers_off_fail_fast_after_a_failed_reconnect() {
        let mut r = live(t(Some(2), None, None));
        let a = r.transport_failed(0);
        assert_eq!(a.state, Some(Blocked));
        assert!(r.timer(2 * S).connect);
        let a = r.connect_finished(3 * S, false);
        assert_eq!(a.state, Some(FailFast));
        assert!(r.timer(5 * S).connect);
        assert_eq!(r.connect_finished(5 * S, true).state, Some(Live));
    }

    #[test]
    fn reconnect_off_waits_for_the_timers() {
        let mut r = live(t(None, Some(3), Some(9)));
        r.transport_failed(0);
        assert_eq!(r.timer(3 * S).state, Some(FailFast));
        assert!(!r.timer(4 * S).connect);
        assert_eq!(r.timer(9 * S).state, Some(Lost));
        // Only fail-fast on and no reconnect: lost once nothing can change.
        let mut r = live(t(None, Some(3), None));
        r.transport_failed(0);
        assert_eq!(r.timer(3 * S).state, Some(FailFast));
        let mut r = live(t(None, None, Some(3)));
        assert_eq!(r.transport_failed(0).state, Some(Blocked));
        assert_eq!(r.timer(3 * S).state, Some(Lost));
    }

    #[test]
    fn failure_while_connecting_fails_the_attempt() {
        let mut r = live(Timeouts::default());
        r.transport_failed(0);
        assert!(r.timer(10 * S).connect);
        let a = r.transport_failed(10 * S);
        assert_eq!(a.teardown, Some(Cause::Transport));
        assert!(!r.connecting());
        assert_eq!(r.failed_reconnects(), 1);
        assert_eq!(r.state(), Blocked);
        assert_eq!(r.next_deadline(), Some(15 * S));
    }

    #[test]
    fn bus_reset() {
        let mut r = live(Timeouts::default());
        let a = r.reset(0);
        assert_eq!(a.teardown, Some(Cause::Reset));
        assert!(a.connect);
        assert_eq!(a.state, Some(Blocked));
        // A second reset during the attempt does nothing more.
        assert_eq!(r.reset(0), Actions::default());
        assert_eq!(r.connect_finished(S, true).state, Some(Live));
        // A failed reconnect after a reset follows the failure path.
        r.reset(2 * S);
        assert!(r.connect_finished(3 * S, false).state.is_none());
        assert_eq!(r.state(), Blocked);
        assert!(r.timer(13 * S).connect);
        r.connect_finished(14 * S, false);
        assert_eq!(r.timer(17 * S).state, Some(FailFast));
        // Reset while failing fast reconnects at once.
        let a = r.reset(18 * S);
        assert!(a.connect);
        assert_eq!(a.teardown, Some(Cause::Reset));
        // Reset before the first login completes is a no-op while connecting.
        let mut r = Recovery::new(Timeouts::default());
        r.start(0);
        assert_eq!(r.reset(0), Actions::default());
    }

    #[test]
    fn stop_forgets_everything() {
        let mut r = live(Timeouts::default());
        r.transport_failed(0);
        let a = r.stop();
        assert_eq!(a.teardown, Some(Cause::Stop));
        assert_eq!(a.state, Some(Connecting));
        assert_eq!(r.next_deadline(), None);
        assert!(!r.connecting());
        assert_eq!(r.timer(1000 * S), Actions::default());
        // A result arriving after stop is torn down.
        let mut r = Recovery::new(Timeouts::default());
        r.start(0);
        r.stop();
        assert_eq!(r.connect_finished(0, true).teardown, Some(Cause::Stop));
    }

    #[test]
    fn deadlines_all_due_at_once() {
        let mut r = live(t(Some(5), Some(5), Some(6)));
        r.transport_failed(0);
        let a = r.timer(100 * S);
        assert_eq!(a.state, Some(Lost));
        assert_eq!(a.teardown, Some(Cause::DeviceLost));
        assert!(!a.connect, "lost: no reconnect");
    }
}
