//! Fault hooks: the misbehaviour switches of the software targets. A rule
//! answers the next N matching commands with a given status or sense, or
//! delays them, before the device server looks at them.
//!
//! Checking costs one relaxed atomic load while no rule is armed, so the
//! hooks can stay compiled into the benchmark path.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use storport_srp::scsi::{AdditionalSense, Opcode, SenseKey, Status};

/// Which commands a rule applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultFilter {
    /// Every command.
    All,
    /// READ(6/10/12/16).
    Reads,
    /// WRITE(6/10/12/16).
    Writes,
    /// READ, WRITE and VERIFY: the commands that touch the medium.
    Media,
    /// One operation code.
    Opcode(Opcode),
}

impl FaultFilter {
    fn matches(self, opcode: Opcode) -> bool {
        const READS: [Opcode; 4] = [
            Opcode::READ_6,
            Opcode::READ_10,
            Opcode::READ_12,
            Opcode::READ_16,
        ];
        const WRITES: [Opcode; 4] = [
            Opcode::WRITE_6,
            Opcode::WRITE_10,
            Opcode::WRITE_12,
            Opcode::WRITE_16,
        ];
        const VERIFIES: [Opcode; 3] = [Opcode::VERIFY_10, Opcode::VERIFY_12, Opcode::VERIFY_16];
        match self {
            Self::All => true,
            Self::Opcode(wanted) => wanted == opcode,
            Self::Reads => READS.contains(&opcode),
            Self::Writes => WRITES.contains(&opcode),
            Self::Media => {
                READS.contains(&opcode) || WRITES.contains(&opcode) || VERIFIES.contains(&opcode)
            }
        }
    }
}

/// What a rule does to a command it matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultAction {
    /// CHECK CONDITION with this sense; the command is not executed.
    Sense(SenseKey, AdditionalSense),
    /// This status without sense (BUSY, TASK SET FULL, RESERVATION
    /// CONFLICT, ACA ACTIVE, TASK ABORTED, or even a bare CHECK CONDITION);
    /// the command is not executed.
    Status(Status),
    /// Execute the command normally (after the rule's delay).
    Proceed,
}

/// One fault rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FaultRule {
    /// Which commands.
    pub filter: FaultFilter,
    /// Only commands to this LUN (`None`: any, including absent LUNs).
    pub lun: Option<u16>,
    /// What to do.
    pub action: FaultAction,
    /// Sleep this long before acting (the channel thread stalls, as a slow
    /// target's would).
    pub delay: Duration,
    /// Matching commands still to affect; `None` for every one until
    /// cleared.
    pub remaining: Option<u32>,
}

impl FaultRule {
    fn with_action(action: FaultAction) -> Self {
        Self {
            filter: FaultFilter::All,
            lun: None,
            action,
            delay: Duration::ZERO,
            remaining: Some(1),
        }
    }

    /// Answer the next matching command with CHECK CONDITION and this sense.
    pub fn sense(key: SenseKey, code: AdditionalSense) -> Self {
        Self::with_action(FaultAction::Sense(key, code))
    }

    /// Answer the next matching command with this status.
    pub fn status(status: Status) -> Self {
        Self::with_action(FaultAction::Status(status))
    }

    /// Delay the next matching command, then execute it.
    pub fn delay(delay: Duration) -> Self {
        Self::with_action(FaultAction::Proceed).with_delay(delay)
    }

    /// Affect the next `count` matching commands.
    #[must_use]
    pub fn times(mut self, count: u32) -> Self {
        self.remaining = Some(count);
        self
    }

    /// Affect every matching command until the hooks are cleared.
    #[must_use]
    pub fn forever(mut self) -> Self {
        self.remaining = None;
        self
    }

    /// Also sleep `delay` before acting.
    #[must_use]
    pub fn with_delay(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    /// Only commands matching `filter`.
    #[must_use]
    pub fn only(mut self, filter: FaultFilter) -> Self {
        self.filter = filter;
        self
    }

    /// Only commands addressed to LUN `index`.
    #[must_use]
    pub fn on_lun(mut self, index: u16) -> Self {
        self.lun = Some(index);
        self
    }
}

/// The armed rules of one target.
#[derive(Debug, Default)]
pub struct FaultHooks {
    armed: AtomicBool,
    fired: AtomicU64,
    rules: Mutex<Vec<FaultRule>>,
}

impl FaultHooks {
    /// Arms `rule` after the ones already armed (the first matching rule
    /// wins).
    pub fn push(&self, rule: FaultRule) {
        if rule.remaining == Some(0) {
            return;
        }
        let mut rules = self.rules.lock().unwrap_or_else(PoisonError::into_inner);
        rules.push(rule);
        self.armed.store(true, Ordering::Release);
    }

    /// Disarms every rule.
    pub fn clear(&self) {
        let mut rules = self.rules.lock().unwrap_or_else(PoisonError::into_inner);
        rules.clear();
        self.armed.store(false, Ordering::Release);
    }

    /// Rules still armed.
    pub fn pending(&self) -> usize {
        self.rules
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// Whether any rule is armed (a command may be delayed or failed).
    pub fn armed(&self) -> bool {
        self.armed.load(Ordering::Acquire)
    }

    /// How many commands a rule has affected so far.
    pub fn fired(&self) -> u64 {
        self.fired.load(Ordering::Relaxed)
    }

    /// The action and delay for a command, consuming one use of the first
    /// matching rule.
    pub(super) fn take(&self, lun: Option<u16>, opcode: Opcode) -> Option<(FaultAction, Duration)> {
        if !self.armed.load(Ordering::Acquire) {
            return None;
        }
        let mut rules = self.rules.lock().unwrap_or_else(PoisonError::into_inner);
        let at = rules.iter().position(|rule| {
            rule.filter.matches(opcode) && (rule.lun.is_none() || rule.lun == lun)
        })?;
        let rule = rules.get_mut(at)?;
        let taken = (rule.action, rule.delay);
        if let Some(left) = rule.remaining.as_mut() {
            *left -= 1;
            if *left == 0 {
                rules.remove(at);
            }
        }
        if rules.is_empty() {
            self.armed.store(false, Ordering::Release);
        }
        self.fired.fetch_add(1, Ordering::Relaxed);
        Some(taken)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_are_consumed_in_order() {
        let hooks = FaultHooks::default();
        assert_eq!(hooks.take(Some(0), Opcode::READ_10), None);
        hooks.push(
            FaultRule::status(Status::BUSY)
                .times(2)
                .only(FaultFilter::Writes),
        );
        hooks.push(
            FaultRule::sense(SenseKey::UnitAttention, AdditionalSense::POWER_ON_RESET).on_lun(1),
        );
        hooks.push(FaultRule::status(Status::TASK_SET_FULL).times(0));
        assert_eq!(hooks.pending(), 2);
        // A read on LUN 0 matches neither rule.
        assert_eq!(hooks.take(Some(0), Opcode::READ_10), None);
        let busy = Some((FaultAction::Status(Status::BUSY), Duration::ZERO));
        assert_eq!(hooks.take(Some(0), Opcode::WRITE_16), busy);
        assert_eq!(hooks.take(None, Opcode::WRITE_6), busy);
        assert_eq!(hooks.take(Some(0), Opcode::WRITE_10), None);
        assert_eq!(
            hooks.take(Some(1), Opcode::INQUIRY),
            Some((
                FaultAction::Sense(SenseKey::UnitAttention, AdditionalSense::POWER_ON_RESET),
                Duration::ZERO
            ))
        );
        assert_eq!(hooks.pending(), 0);
        assert_eq!(hooks.fired(), 3);
        assert_eq!(hooks.take(Some(1), Opcode::INQUIRY), None);
    }

    #[test]
    fn forever_until_cleared() {
        let hooks = FaultHooks::default();
        hooks.push(
            FaultRule::delay(Duration::from_millis(1))
                .forever()
                .only(FaultFilter::Media),
        );
        for _ in 0..5 {
            assert_eq!(
                hooks.take(Some(0), Opcode::VERIFY_16),
                Some((FaultAction::Proceed, Duration::from_millis(1)))
            );
        }
        assert_eq!(hooks.take(Some(0), Opcode::TEST_UNIT_READY), None);
        hooks.clear();
        assert_eq!(hooks.take(Some(0), Opcode::READ_10), None);
    }
}
