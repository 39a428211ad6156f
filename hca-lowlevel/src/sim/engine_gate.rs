//! When a doorbell that finds the world busy must wake the device thread.
//!
//! A doorbell never blocks: it rings ([`EngineGate::ring`]) and then either
//! runs the engine itself (the world lock was free) or leaves the doorbell
//! to someone else. Whoever holds the world may be an engine run, or a
//! control command or deadline query that lets go without running the
//! engine. Before this gate the doorbell woke the device thread in both
//! cases; when the holder is an engine run that wake is wasted (a futex
//! wake, and a context switch, whenever the device thread was parked: 0.6 %
//! of the process's futex wakes in a 128 KiB sequential read): the run
//! re-checks `pending` after it lets go and picks the doorbell up.
//!
//! The protocol, every access `SeqCst`:
//!
//! * a doorbell: `pending.swap(true)`, then, if the world is busy,
//!   `running.load()`: wake the device thread only if it reads 0;
//! * an engine run (holding the world): `running += 1`,
//!   `pending.swap(false)`, run, let go of the world, deliver the events,
//!   `running -= 1`, then `pending.load()`: if set, run again — and if the
//!   world is busy by then, act as a doorbell that found it busy (above).
//!
//! Why a skipped wake loses no doorbell (Dekker): a doorbell that reads
//! `running > 0` read it before the decrement of some run `R` that had
//! incremented it, in the single total order of `SeqCst` operations. `R`'s
//! `pending` load follows its decrement, so it follows the doorbell's
//! swap: it reads `true` — and `R` runs again or hands over as above — or
//! it reads `false` written by a later run's `pending.swap(false)`, and
//! that run executes the engine after its swap. Either way an engine pass
//! starts after the doorbell rang. Because every write of `pending` is a
//! read-modify-write, the run's swap also synchronizes with the doorbell's
//! (a release sequence), so that pass sees what the doorbell published
//! before ringing (a QP's `rang` flag), not just the flag.
//!
//! A holder that is not an engine run never counts in `running`, so a
//! doorbell that finds it still wakes the device thread. A count (not a
//! flag) keeps overlapping runs exact: a run delivering events after letting
//! go of the world and a new run holding it both count.
//!
//! The exhaustive interleaving test in this module checks the protocol,
//! and that it misses a doorbell when the wake is skipped unconditionally,
//! when a run's re-check that finds the world busy gives up, or when a run
//! re-checks before it stops counting.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

/// The doorbell flag and the count of engine runs that will re-check it.
pub(crate) struct EngineGate {
    pending: AtomicBool,
    running: AtomicU32,
}

impl EngineGate {
    pub const fn new() -> Self {
        Self {
            pending: AtomicBool::new(false),
            running: AtomicU32::new(0),
        }
    }

    /// A doorbell rang (after it published what it rang for). A swap, not
    /// a store: see the module docs on the release sequence.
    pub fn ring(&self) {
        self.pending.swap(true, Ordering::SeqCst);
    }

    /// The world was busy after a ring (or a run's re-check found a
    /// doorbell): whether the device thread must be woken for it, that is,
    /// whether no engine run is in progress that will re-check `pending`.
    pub fn busy_needs_wake(&self) -> bool {
        self.running.load(Ordering::SeqCst) == 0
    }

    /// An engine run starts (the caller holds the world); it counts until
    /// the returned guard drops — also if an event handler panics, so a
    /// count is never left behind to suppress every later wake.
    pub fn begin_run(&self) -> RunCount<'_> {
        self.running.fetch_add(1, Ordering::SeqCst);
        RunCount(self)
    }

    /// Takes the doorbells rung so far (the run then executes the engine).
    pub fn take_pending(&self) {
        self.pending.swap(false, Ordering::SeqCst);
    }

    /// The run is over (world released, events delivered): what dropping
    /// its [`RunCount`] does. The caller then re-checks
    /// ([`Self::rang_since`]), in that order.
    fn end_run(&self) {
        self.running.fetch_sub(1, Ordering::SeqCst);
    }

    /// Whether a doorbell rang since the last [`Self::take_pending`]: a run
    /// that ended must run again (or hand the doorbell over).
    pub fn rang_since(&self) -> bool {
        self.pending.load(Ordering::SeqCst)
    }
}

/// An engine run in progress, as counted by [`EngineGate::begin_run`].
pub(crate) struct RunCount<'a>(&'a EngineGate);

impl Drop for RunCount<'_> {
    fn drop(&mut self) {
        self.0.end_run();
    }
}

#[cfg(test)]
mod tests {
    //! An exhaustive model of the protocol: every interleaving, under
    //! sequential consistency (exact here: every gate access is `SeqCst`
    //! and the world lock is one atomic try-lock step), of a few threads
    //! driving a real [`EngineGate`] one atomic access per step.

    use super::EngineGate;
    use std::collections::HashSet;
    use std::sync::atomic::Ordering;

    /// What decides, after a ring or a run's re-check, that the world is
    /// busy and the device thread need not be woken — the real rule and two
    /// broken ones the model must catch.
    #[derive(Copy, Clone, PartialEq, Eq, Debug)]
    enum Policy {
        /// The protocol as implemented.
        Real,
        /// Never wake when the world is busy (the skip made unconditional).
        NeverWake,
        /// A run's re-check that finds the world busy gives up silently
        /// (what `run_engine` did before the gate).
        RecheckGivesUp,
        /// A run re-checks `pending` before it stops counting (the Dekker
        /// pair in the wrong order).
        RecheckFirst,
    }

    #[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
    enum Role {
        /// An inline doorbell: publish, ring, try the world; run the engine
        /// or hand over.
        Doorbell(usize),
        /// A thread that already holds the world to run the engine (the
        /// device thread, or a doorbell that got the lock earlier).
        Engine,
        /// A control command or deadline query: holds the world, lets go
        /// without running the engine.
        Control,
        /// The same, taking the world (blocking) while the others run.
        LateControl,
    }

    #[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
    enum Pc {
        Lock,
        Publish,
        Ring,
        TryLock,
        LoadRunning,
        Begin,
        Take,
        Scan,
        Unlock,
        End,
        Recheck,
        Done,
    }

    #[derive(Clone, PartialEq, Eq, Hash)]
    struct Thread {
        role: Role,
        pc: Pc,
        /// [`Policy::RecheckFirst`]: what the early re-check saw.
        saw: bool,
    }

    struct State {
        gate: EngineGate,
        locked: bool,
        /// Per doorbell: its `rang` flag (set by Publish, cleared by a scan).
        rang: Vec<bool>,
        /// Per doorbell: its ring happened, then a scan saw it or a wake
        /// followed.
        served: Vec<bool>,
        /// Per doorbell: its ring step is done.
        rung: Vec<bool>,
        threads: Vec<Thread>,
    }

    impl Clone for State {
        fn clone(&self) -> Self {
            let gate = EngineGate::new();
            gate.pending
                .store(self.gate.pending.load(Ordering::SeqCst), Ordering::SeqCst);
            gate.running
                .store(self.gate.running.load(Ordering::SeqCst), Ordering::SeqCst);
            Self {
                gate,
                locked: self.locked,
                rang: self.rang.clone(),
                served: self.served.clone(),
                rung: self.rung.clone(),
                threads: self.threads.clone(),
            }
        }
    }

    impl State {
        fn new(roles: &[Role]) -> Self {
            let doorbells = roles
                .iter()
                .filter(|r| matches!(r, Role::Doorbell(_)))
                .count();
            // Engine and Control start holding the world; at most one may.
            let holds = |r: &&Role| matches!(r, Role::Engine | Role::Control);
            assert!(
                roles.iter().filter(holds).count() <= 1,
                "one holder at most"
            );
            let threads = roles
                .iter()
                .map(|&role| Thread {
                    role,
                    saw: false,
                    pc: match role {
                        Role::Doorbell(_) => Pc::Publish,
                        Role::Engine => Pc::Begin,
                        Role::Control => Pc::Unlock,
                        Role::LateControl => Pc::Lock,
                    },
                })
                .collect();
            Self {
                gate: EngineGate::new(),
                locked: roles
                    .iter()
                    .any(|r| matches!(r, Role::Engine | Role::Control)),
                rang: vec![false; doorbells],
                served: vec![false; doorbells],
                rung: vec![false; doorbells],
                threads,
            }
        }

        /// The device thread is woken: it will run the engine after every
        /// ring so far.
        fn wake(&mut self) {
            for (served, rung) in self.served.iter_mut().zip(&self.rung) {
                *served |= *rung;
            }
        }

        /// One atomic step of thread `t`.
        fn step(&mut self, t: usize, policy: Policy) {
            let Thread { role, pc, .. } = self.threads[t].clone();
            let next = match pc {
                Pc::Lock => {
                    self.locked = true;
                    Pc::Unlock
                }
                Pc::Publish => {
                    if let Role::Doorbell(d) = role {
                        self.rang[d] = true;
                    }
                    Pc::Ring
                }
                Pc::Ring => {
                    self.gate.ring();
                    if let Role::Doorbell(d) = role {
                        self.rung[d] = true;
                    }
                    Pc::TryLock
                }
                Pc::TryLock => {
                    if self.locked {
                        Pc::LoadRunning
                    } else {
                        self.locked = true;
                        Pc::Begin
                    }
                }
                Pc::LoadRunning => {
                    let wake = match policy {
                        Policy::Real | Policy::RecheckGivesUp | Policy::RecheckFirst => {
                            self.gate.busy_needs_wake()
                        }
                        Policy::NeverWake => false,
                    };
                    if wake {
                        self.wake();
                    }
                    Pc::Done
                }
                Pc::Begin => {
                    // Ended by an explicit step (`End`), not a drop.
                    std::mem::forget(self.gate.begin_run());
                    Pc::Take
                }
                Pc::Take => {
                    self.gate.take_pending();
                    Pc::Scan
                }
                Pc::Scan => {
                    // The engine pass executes every published doorbell.
                    for (rang, served) in self.rang.iter_mut().zip(&mut self.served) {
                        if std::mem::take(rang) {
                            *served = true;
                        }
                    }
                    Pc::Unlock
                }
                Pc::Unlock => {
                    self.locked = false;
                    if matches!(role, Role::Control | Role::LateControl) {
                        Pc::Done
                    } else {
                        Pc::End
                    }
                }
                Pc::End => {
                    if policy == Policy::RecheckFirst {
                        self.threads[t].saw = self.gate.rang_since();
                    } else {
                        self.gate.end_run();
                    }
                    Pc::Recheck
                }
                Pc::Recheck => {
                    let rang = if policy == Policy::RecheckFirst {
                        self.gate.end_run();
                        self.threads[t].saw
                    } else {
                        self.gate.rang_since()
                    };
                    if rang {
                        // Run again: try the world; busy means hand over.
                        if self.locked && policy == Policy::RecheckGivesUp {
                            Pc::Done
                        } else {
                            Pc::TryLock
                        }
                    } else {
                        Pc::Done
                    }
                }
                Pc::Done => Pc::Done,
            };
            self.threads[t].pc = next;
        }

        /// Whether thread `t` can take a step (done, or waiting for the
        /// world, it cannot).
        fn enabled(&self, t: usize) -> bool {
            match self.threads[t].pc {
                Pc::Done => false,
                Pc::Lock => !self.locked,
                _ => true,
            }
        }

        fn all_done(&self) -> bool {
            self.threads.iter().all(|t| t.pc == Pc::Done)
        }

        /// Everything a future step depends on, to visit each state once.
        fn key(&self) -> Key {
            (
                self.gate.pending.load(Ordering::SeqCst),
                self.gate.running.load(Ordering::SeqCst),
                self.locked,
                self.rang.clone(),
                self.served.clone(),
                self.rung.clone(),
                self.threads.clone(),
            )
        }
    }

    type Key = (
        bool,
        u32,
        bool,
        Vec<bool>,
        Vec<bool>,
        Vec<bool>,
        Vec<Thread>,
    );

    /// Explores every interleaving (each reachable state once); returns the
    /// number of states reached and whether a final state left a doorbell
    /// neither executed by an engine pass nor woken for.
    fn explore(roles: &[Role], policy: Policy) -> (usize, bool) {
        fn go(
            s: &State,
            policy: Policy,
            seen: &mut HashSet<Key>,
            finals: &mut usize,
            lost: &mut bool,
        ) {
            if !seen.insert(s.key()) {
                return;
            }
            if s.all_done() {
                *finals += 1;
                *lost |= s.served.iter().any(|served| !served);
                return;
            }
            let mut stepped = false;
            for t in 0..s.threads.len() {
                if s.enabled(t) {
                    stepped = true;
                    let mut n = s.clone();
                    n.step(t, policy);
                    go(&n, policy, seen, finals, lost);
                }
            }
            assert!(stepped, "the model deadlocked");
        }
        let mut seen = HashSet::new();
        let mut finals = 0;
        let mut lost = false;
        go(
            &State::new(roles),
            policy,
            &mut seen,
            &mut finals,
            &mut lost,
        );
        assert!(finals > 0, "no interleaving finished");
        (seen.len(), lost)
    }

    const SCENARIOS: &[&[Role]] = &[
        &[Role::Doorbell(0), Role::Engine],
        &[Role::Doorbell(0), Role::Control],
        &[Role::Doorbell(0), Role::Doorbell(1)],
        &[Role::Doorbell(0), Role::Doorbell(1), Role::Engine],
        &[Role::Doorbell(0), Role::Doorbell(1), Role::Control],
        &[Role::Doorbell(0), Role::Engine, Role::LateControl],
        &[Role::Doorbell(0), Role::Doorbell(1), Role::LateControl],
        &[
            Role::Doorbell(0),
            Role::Doorbell(1),
            Role::Engine,
            Role::LateControl,
        ],
    ];

    #[test]
    fn no_doorbell_is_lost_in_any_interleaving() {
        for roles in SCENARIOS {
            let (states, lost) = explore(roles, Policy::Real);
            assert!(states > 10, "{roles:?}: reached only {states} states");
            assert!(!lost, "{roles:?}: a doorbell was neither run nor woken for");
        }
    }

    #[test]
    fn the_model_catches_an_unconditional_skip() {
        // A control command holds the world: no engine run will re-check.
        let (_, lost) = explore(&[Role::Doorbell(0), Role::Control], Policy::NeverWake);
        assert!(lost);
    }

    #[test]
    fn the_model_catches_a_recheck_that_gives_up() {
        // A run's re-check finds a control command holding the world.
        let lost = SCENARIOS
            .iter()
            .any(|roles| explore(roles, Policy::RecheckGivesUp).1);
        assert!(lost);
    }

    #[test]
    fn the_model_catches_a_recheck_before_the_run_stops_counting() {
        let lost = SCENARIOS
            .iter()
            .any(|roles| explore(roles, Policy::RecheckFirst).1);
        assert!(lost);
    }
}
