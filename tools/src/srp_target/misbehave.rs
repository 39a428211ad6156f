//! The misbehaviour switches: what a test can make the target do wrong,
//! each reproducible (the random ones draw from a seeded generator).
//!
//! Switches come in two kinds. *Armed* ones wait in `Armed` until the
//! event they act on comes along (a login, a response, a command) and are
//! consumed by whichever channel meets it first. *One-shot* requests
//! (send a `SRP_CRED_REQ`, an `SRP_AER_REQ`, an `SRP_T_LOGOUT`) go straight
//! to every live channel.
//!
//! The hostile RDMA attempts report back what happened
//! ([`HostileReport`]): the target posts the offending work request and
//! observes its completion — a protection error (its QP then goes to the
//! error state, with the error completion) or, against an initiator that
//! left its memory open, success.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use hca_lowlevel::cqe::Syndrome;
use storport_srp::scsi::SenseRepr;
use storport_srp::wire::srp::RejectReason;

use crate::scsi_target::FaultRule;

/// Which events a switch applies to.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Selector {
    /// The next `n`.
    Next(u32),
    /// Every one, until cleared.
    All,
    /// Each with probability `probability`, drawn from a generator seeded
    /// with `seed`; at most `limit` of them when set.
    Seeded {
        /// Chance per event (0.0..=1.0).
        probability: f64,
        /// The generator's seed.
        seed: u64,
        /// Most events affected.
        limit: Option<u32>,
    },
}

/// A selector's running state.
#[derive(Debug)]
pub(crate) struct SelectorState {
    selector: Selector,
    rng: Option<fastrand::Rng>,
    taken: u32,
}

impl SelectorState {
    pub(crate) fn new(selector: Selector) -> Self {
        let rng = match selector {
            Selector::Seeded { seed, .. } => Some(fastrand::Rng::with_seed(seed)),
            _ => None,
        };
        Self {
            selector,
            rng,
            taken: 0,
        }
    }

    /// Whether this event is selected.
    pub(crate) fn take(&mut self) -> bool {
        let hit = match self.selector {
            Selector::Next(n) => self.taken < n,
            Selector::All => true,
            Selector::Seeded {
                probability, limit, ..
            } => {
                let unit = self.rng.as_mut().map_or(1.0, fastrand::Rng::f64);
                limit.is_none_or(|l| self.taken < l) && unit < probability
            }
        };
        if hit {
            self.taken = self.taken.saturating_add(1);
        }
        hit
    }

    /// Whether the selector can select anything any more.
    pub(crate) fn exhausted(&self) -> bool {
        match self.selector {
            Selector::Next(n) => self.taken >= n,
            Selector::All => false,
            Selector::Seeded { limit, .. } => limit.is_some_and(|l| self.taken >= l),
        }
    }
}

/// A hostile RDMA attempt: the target touches initiator memory it has no
/// business touching, and reports what happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostileAttempt {
    /// When a command arrives, RDMA WRITE to the buffer of the most recent
    /// command whose response was delivered at least 20 ms earlier (so the
    /// initiator has had time to complete it: its rkey is stale if the
    /// initiator invalidated it, as it must). Waits for such a command.
    StaleRkey,
    /// On the next command with a DATA-IN buffer, RDMA WRITE a run that
    /// starts inside the buffer and ends `past_end` bytes after it.
    BeyondBuffer {
        /// Bytes written past the end of the described buffer.
        past_end: u32,
    },
    /// On the next command with a DATA-IN buffer (which the initiator
    /// opened for remote write only), RDMA READ from it.
    ReadFromWriteOnly,
    /// On the next command with a DATA-OUT buffer fetched by RDMA READ
    /// (opened for remote read only), RDMA WRITE to it.
    WriteToReadOnly,
    /// On the next command with a DATA-IN buffer: serve it normally, then,
    /// `delay` after its response was delivered, RDMA WRITE to its buffer
    /// again.
    AfterResponse {
        /// Wait after the response's send completed.
        delay: Duration,
    },
}

/// What a hostile attempt did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostileOutcome {
    /// Posted, completion not seen yet.
    Pending,
    /// The initiator's HCA refused it: the target's work request completed
    /// with this error, and its QP went to the error state.
    Refused(Option<Syndrome>),
    /// It completed successfully: the initiator's memory was reachable.
    Succeeded,
    /// Flushed before it ran (the QP was already in error).
    Flushed,
    /// Could not be posted (the channel was going away).
    NotPosted,
}

/// One hostile attempt, as the target saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostileReport {
    /// What was tried.
    pub attempt: HostileAttempt,
    /// The channel (see [`super::ChannelInfo`]).
    pub channel: u32,
    /// The tag of the command whose buffer was used.
    pub tag: u64,
    /// The remote address used.
    pub remote_addr: u64,
    /// The rkey used.
    pub rkey: u32,
    /// Bytes the work request moved (or tried to).
    pub len: u32,
    /// What happened.
    pub outcome: HostileOutcome,
}

/// A switch.
#[derive(Debug, Clone)]
pub enum Misbehaviour {
    /// Reject logins with this SRP reason (before any other check).
    RejectLogins {
        /// The reason in the `SRP_LOGIN_REJ`.
        reason: RejectReason,
        /// The next `count` logins; all until cleared when `None`.
        count: Option<u32>,
    },
    /// Send `req_lim_delta = 0` in the next `responses` responses, then
    /// give the withheld credits back with one `SRP_CRED_REQ` — also once
    /// the channel has had nothing outstanding for `idle_release`, so an
    /// initiator starved of every credit is not stuck for ever.
    WithholdCredits {
        /// Responses sent without credit.
        responses: u32,
        /// Idle time after which the withheld credits are returned early.
        idle_release: Duration,
    },
    /// One-shot: every live channel sends an `SRP_CRED_REQ` granting
    /// `delta` credits (its accumulated delta added).
    SendCredReq {
        /// Credits granted.
        delta: i32,
    },
    /// One-shot: every live channel sends an `SRP_AER_REQ` for `lun` with
    /// `sense`, granting `delta` credits.
    SendAerReq {
        /// The LUN the event is about.
        lun: u16,
        /// The sense data.
        sense: SenseRepr,
        /// Credits granted with it.
        delta: i32,
    },
    /// One-shot: every live channel sends `SRP_T_LOGOUT` with `reason`,
    /// then disconnects once it is delivered.
    SendTLogout {
        /// The logout reason.
        reason: u32,
    },
    /// Hold selected responses back for `delay` (data already moved).
    DelayResponses {
        /// How long.
        delay: Duration,
        /// Which responses.
        which: Selector,
    },
    /// Never send selected responses (the data moves, the `SRP_RSP` does
    /// not). The command stays known to the target until task management
    /// aborts it, which returns its credit.
    DropResponses {
        /// Which responses.
        which: Selector,
    },
    /// Send selected responses malformed, as `how` says (the data moves;
    /// the `SRP_RSP` that follows it does not parse). An initiator must
    /// treat it as a protocol error, not guess at the command's outcome.
    CorruptResponses {
        /// What is wrong with them.
        how: RspCorruption,
        /// Which responses.
        which: Selector,
    },
    /// Answer commands as the rule says (CHECK CONDITION with a sense,
    /// a status, a delay), through the SCSI target's fault hooks.
    ScsiFault(FaultRule),
    /// Let `commands` more commands through (counted over all channels);
    /// the channel that receives the next one disconnects (CM DREQ) at
    /// once, answering neither it nor anything still outstanding.
    DisconnectAfter {
        /// Commands let through first.
        commands: u32,
    },
    /// A hostile RDMA attempt (one-shot, taken by the first channel where
    /// it applies).
    Hostile(HostileAttempt),
}

/// How a corrupted `SRP_RSP` is malformed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RspCorruption {
    /// Cut to fewer bytes than the fixed part of an `SRP_RSP`.
    Truncated,
    /// `SNSVALID` set with a sense length reaching past the IU's end.
    SenseBeyondIu,
}

/// The armed switches (target-wide).
#[derive(Debug, Default)]
pub(crate) struct Armed {
    pub(crate) reject: Option<(RejectReason, Option<u32>)>,
    pub(crate) withhold: Option<(u32, Duration)>,
    pub(crate) delay: Option<(Duration, SelectorState)>,
    pub(crate) drop: Option<SelectorState>,
    pub(crate) corrupt: Option<(RspCorruption, SelectorState)>,
    pub(crate) disconnect_after: Option<u32>,
    pub(crate) hostile: Vec<HostileAttempt>,
}

/// The armed switches behind one flag, so the fast path pays one relaxed
/// load while nothing is armed.
#[derive(Debug, Default)]
pub(crate) struct Switches {
    any: AtomicBool,
    armed: std::sync::Mutex<Armed>,
}

/// What to do with a response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fate {
    Send,
    Delay(Duration),
    Drop,
    Corrupt(RspCorruption),
}

impl Switches {
    fn with<R>(&self, f: impl FnOnce(&mut Armed) -> R) -> R {
        let mut armed = self
            .armed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let r = f(&mut armed);
        let any = armed.reject.is_some()
            || armed.withhold.is_some()
            || armed.delay.is_some()
            || armed.drop.is_some()
            || armed.corrupt.is_some()
            || armed.disconnect_after.is_some()
            || !armed.hostile.is_empty();
        self.any.store(any, Ordering::Release);
        r
    }

    /// Whether no switch is armed (one atomic load: the DPC lane asks it
    /// for every command).
    pub(crate) fn idle(&self) -> bool {
        !self.any.load(Ordering::Acquire)
    }

    /// Arms a switch of the armed kind.
    pub(crate) fn arm(&self, m: &Misbehaviour) {
        self.with(|a| match m {
            Misbehaviour::RejectLogins { reason, count } => a.reject = Some((*reason, *count)),
            Misbehaviour::WithholdCredits {
                responses,
                idle_release,
            } => a.withhold = Some((*responses, *idle_release)),
            Misbehaviour::DelayResponses { delay, which } => {
                a.delay = Some((*delay, SelectorState::new(*which)));
            }
            Misbehaviour::DropResponses { which } => a.drop = Some(SelectorState::new(*which)),
            Misbehaviour::CorruptResponses { how, which } => {
                a.corrupt = Some((*how, SelectorState::new(*which)));
            }
            Misbehaviour::DisconnectAfter { commands } => a.disconnect_after = Some(*commands),
            Misbehaviour::Hostile(h) => a.hostile.push(*h),
            Misbehaviour::SendCredReq { .. }
            | Misbehaviour::SendAerReq { .. }
            | Misbehaviour::SendTLogout { .. }
            | Misbehaviour::ScsiFault(_) => {}
        });
    }

    /// Disarms everything.
    pub(crate) fn clear(&self) {
        self.with(|a| *a = Armed::default());
    }

    /// A login: the reject reason to force, if armed.
    pub(crate) fn take_reject(&self) -> Option<RejectReason> {
        if self.idle() {
            return None;
        }
        self.with(|a| {
            let (reason, count) = a.reject?;
            match count {
                None => {}
                Some(0) => {
                    a.reject = None;
                    return None;
                }
                Some(n) => a.reject = (n > 1).then_some((reason, Some(n - 1))),
            }
            Some(reason)
        })
    }

    /// A channel takes the withholding order (it applies it to its own
    /// responses).
    pub(crate) fn take_withhold(&self) -> Option<(u32, Duration)> {
        if self.idle() {
            return None;
        }
        self.with(|a| a.withhold.take())
    }

    /// The fate of the next response.
    pub(crate) fn response_fate(&self) -> Fate {
        if self.idle() {
            return Fate::Send;
        }
        self.with(|a| {
            if let Some(sel) = a.drop.as_mut() {
                let hit = sel.take();
                if sel.exhausted() {
                    a.drop = None;
                }
                if hit {
                    return Fate::Drop;
                }
            }
            if let Some((how, sel)) = a.corrupt.as_mut() {
                let how = *how;
                let hit = sel.take();
                if sel.exhausted() {
                    a.corrupt = None;
                }
                if hit {
                    return Fate::Corrupt(how);
                }
            }
            if let Some((delay, sel)) = a.delay.as_mut() {
                let delay = *delay;
                let hit = sel.take();
                if sel.exhausted() {
                    a.delay = None;
                }
                if hit {
                    return Fate::Delay(delay);
                }
            }
            Fate::Send
        })
    }

    /// A command arrived: whether it is the one that drops the connection.
    pub(crate) fn command_disconnects(&self) -> bool {
        if self.idle() {
            return false;
        }
        self.with(|a| match a.disconnect_after {
            Some(0) => {
                a.disconnect_after = None;
                true
            }
            Some(n) => {
                a.disconnect_after = Some(n - 1);
                false
            }
            None => false,
        })
    }

    /// Takes the first armed hostile attempt `applies` accepts.
    pub(crate) fn take_hostile(
        &self,
        applies: impl Fn(&HostileAttempt) -> bool,
    ) -> Option<HostileAttempt> {
        if self.idle() {
            return None;
        }
        self.with(|a| {
            let at = a.hostile.iter().position(&applies)?;
            Some(a.hostile.remove(at))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn picks(selector: Selector, n: usize) -> Vec<bool> {
        let mut s = SelectorState::new(selector);
        (0..n).map(|_| s.take()).collect()
    }

    #[test]
    fn selectors() {
        assert_eq!(picks(Selector::Next(2), 4), [true, true, false, false]);
        assert!(picks(Selector::All, 50).into_iter().all(|b| b));
        let seeded = Selector::Seeded {
            probability: 0.3,
            seed: 42,
            limit: None,
        };
        // Reproducible: the same seed picks the same events.
        let a = picks(seeded, 200);
        assert_eq!(a, picks(seeded, 200));
        let hits = a.iter().filter(|b| **b).count();
        assert!((30..=90).contains(&hits), "{hits} of 200 at p = 0.3");
        let other = picks(
            Selector::Seeded {
                probability: 0.3,
                seed: 43,
                limit: None,
            },
            200,
        );
        assert_ne!(a, other, "another seed, other picks");
        let limited = picks(
            Selector::Seeded {
                probability: 1.0,
                seed: 1,
                limit: Some(3),
            },
            10,
        );
        assert_eq!(limited.iter().filter(|b| **b).count(), 3);
        assert!(SelectorState::new(Selector::Next(0)).exhausted());
    }

    #[test]
    fn switches_are_consumed() {
        let s = Switches::default();
        assert_eq!(s.take_reject(), None);
        assert_eq!(s.response_fate(), Fate::Send);
        s.arm(&Misbehaviour::RejectLogins {
            reason: RejectReason::ChannelLimitReached,
            count: Some(2),
        });
        assert_eq!(s.take_reject(), Some(RejectReason::ChannelLimitReached));
        assert_eq!(s.take_reject(), Some(RejectReason::ChannelLimitReached));
        assert_eq!(s.take_reject(), None);
        s.arm(&Misbehaviour::DropResponses {
            which: Selector::Next(1),
        });
        s.arm(&Misbehaviour::DelayResponses {
            delay: Duration::from_millis(5),
            which: Selector::Next(1),
        });
        s.arm(&Misbehaviour::CorruptResponses {
            how: RspCorruption::Truncated,
            which: Selector::Next(1),
        });
        // Drop is asked first, then corruption; each selector counts only
        // what it takes.
        assert_eq!(s.response_fate(), Fate::Drop);
        assert_eq!(s.response_fate(), Fate::Corrupt(RspCorruption::Truncated));
        assert_eq!(s.response_fate(), Fate::Delay(Duration::from_millis(5)));
        assert_eq!(s.response_fate(), Fate::Send);
        assert!(s.idle(), "every one-shot switch is used up");
        s.arm(&Misbehaviour::DisconnectAfter { commands: 1 });
        assert!(!s.command_disconnects());
        assert!(s.command_disconnects());
        assert!(!s.command_disconnects());
        s.arm(&Misbehaviour::Hostile(HostileAttempt::StaleRkey));
        s.arm(&Misbehaviour::Hostile(HostileAttempt::ReadFromWriteOnly));
        assert_eq!(
            s.take_hostile(|h| *h == HostileAttempt::ReadFromWriteOnly),
            Some(HostileAttempt::ReadFromWriteOnly)
        );
        assert_eq!(s.take_hostile(|_| false), None);
        s.clear();
        assert_eq!(s.take_hostile(|_| true), None);
    }
}
