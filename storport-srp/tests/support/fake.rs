//! A fake transport: a RAM-disk target behind the `Transport` trait.
//!
//! It moves data the way an RDMA target does — by physical address,
//! through the command's scatter/gather list, in the model's simulated
//! physical memory — or, for small writes when asked, from the CPU view
//! (immediate data). It completes commands synchronously inside `post`,
//! from its completion DPC, late (when the test releases them), or never
//! (until an abort or reset terminates them); in order or shuffled; with
//! scripted statuses, sense and residuals; with a credit limit per target;
//! and with target state changes the test drives.
//!
//! It also checks the core: every entry point's IRQL (through the model's
//! checker), tags posted twice, posts without a prepare, scatter/gather
//! lists that do not cover the transfer. [`FakeTransport::errors`] counts
//! what it caught; tests assert it stays zero.
//!
//! Nothing here allocates at `DISPATCH_LEVEL`: every queue and per-tag
//! buffer is allocated when the fake is created.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use hca_lowlevel::sim::PhysMemory;
use kverbs::irql::{Dispatch, Irql, LeDispatch, Passive};
use kverbs::platform::host::{HostDpc, HostPlatform};
use kverbs::platform::{DpcTarget, Platform, RawDpc};
use kverbs::sync::with_dispatch;
use storport_srp::miniport::transport::{
    CommandOutcome, CommandResult, FailureKind, PostFailed, PrepareError, Residual, ScsiCommand,
    StartFailed, Tag, TargetState, TmfRefused, TmfResponse, Transport, Upcalls,
};
use storport_srp::storport::host::Checker;
use storport_srp::storport::{DataDirection, SgElement};

use super::scsi::{Executed, RamDisk};

/// How a posted command completes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// Inside `post`, before it returns.
    Synchronous,
    /// From the fake's completion DPC.
    Dpc,
    /// When the test calls [`FakeTransport::release_late`].
    Late,
    /// Never, unless an abort or reset terminates it.
    Never,
}

/// The fake's behaviour.
#[derive(Debug, Clone)]
pub struct FakeConfig {
    /// Default delivery.
    pub delivery: Delivery,
    /// Deliver ready completions in a shuffled order.
    pub out_of_order: bool,
    /// Take write data up to [`IMMEDIATE_MAX`] bytes from the CPU view at
    /// `prepare` (immediate data) instead of by physical address.
    pub immediate_writes: bool,
    /// Credits per target.
    pub credits: u32,
    /// Seed of the shuffle.
    pub seed: u64,
    /// LUNs per target on the RAM disk (shared by all targets).
    pub luns: usize,
    /// Blocks per LUN.
    pub blocks: u64,
    /// When `prepare` refuses for lack of credit, credit comes back at
    /// once and the core is told before `prepare` returns — as when a
    /// completion on another processor returns credit between the refusal
    /// and the LUN's hold (the race a hold must survive).
    pub credit_races_refusal: bool,
}

impl Default for FakeConfig {
    fn default() -> Self {
        Self {
            delivery: Delivery::Dpc,
            out_of_order: false,
            immediate_writes: false,
            credits: 1024,
            seed: 1,
            luns: 2,
            blocks: 4096,
            credit_races_refusal: false,
        }
    }
}

/// Largest immediate write.
pub const IMMEDIATE_MAX: usize = 8192;
/// Largest scatter/gather list the fake copies.
const MAX_SG: usize = 1024;

/// A scripted answer for the next posted command.
#[derive(Debug, Clone, Copy, Default)]
pub struct Scripted {
    /// Replace the SAM status.
    pub status: Option<u8>,
    /// Sense to return (with CHECK CONDITION).
    pub sense: Option<[u8; 18]>,
    /// Replace the residual (an underrun also moves that much less).
    pub residual: Option<Residual>,
    /// Override the delivery.
    pub delivery: Option<Delivery>,
    /// Deliver the completion twice (a transport bug the core must absorb).
    pub twice: bool,
    /// Refuse the post with this failure (nothing is sent).
    pub fail_post: Option<FailureKind>,
}

impl Scripted {
    /// Delivered as `delivery`, otherwise as executed.
    pub fn delivered(delivery: Delivery) -> Self {
        Self {
            delivery: Some(delivery),
            ..Self::default()
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    Free,
    Prepared,
    /// Posted, waiting (late or never).
    Held(Delivery),
    /// Executed or terminated; its completion is queued.
    Done,
}

struct Slot {
    state: SlotState,
    tag: Tag,
    target: u8,
    lun: u8,
    cdb: [u8; 32],
    cdb_len: usize,
    direction: DataDirection,
    len: u32,
    sg: Vec<SgElement>,
    imm: Vec<u8>,
    imm_len: Option<usize>,
    script: Option<Scripted>,
}

#[derive(Debug, Clone, Copy)]
enum Ready {
    Command {
        tag: Tag,
        target: u8,
        outcome: CommandOutcome,
        residual: Residual,
        sense: [u8; 18],
        sense_len: usize,
        twice: bool,
    },
    Tmf {
        tag: Tag,
        response: TmfResponse,
    },
    Credits {
        target: u8,
    },
    State {
        target: u8,
        state: TargetState,
    },
}

struct State {
    slots: Vec<Slot>,
    ready: VecDeque<Ready>,
    late: VecDeque<usize>,
    credits: Vec<u32>,
    starved: Vec<bool>,
    targets: Vec<TargetState>,
    script: VecDeque<Scripted>,
    rng: u64,
    started: bool,
}

/// What the fake saw (snapshots).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FakeStats {
    pub prepared: u64,
    pub posted: u64,
    pub discarded: u64,
    pub busy: u64,
    pub completed: u64,
    pub aborts: u64,
    pub lun_resets: u64,
    pub resets: u64,
    pub starts: u64,
    pub stops: u64,
    pub immediate: u64,
}

#[derive(Default)]
struct Counters {
    prepared: AtomicU64,
    posted: AtomicU64,
    discarded: AtomicU64,
    busy: AtomicU64,
    completed: AtomicU64,
    aborts: AtomicU64,
    lun_resets: AtomicU64,
    resets: AtomicU64,
    starts: AtomicU64,
    stops: AtomicU64,
    immediate: AtomicU64,
}

struct Inner {
    upcalls: Upcalls,
    memory: Arc<PhysMemory>,
    checker: Checker,
    disk: RamDisk,
    state: Mutex<State>,
    dpc: Mutex<Option<HostDpc>>,
    config: FakeConfig,
    errors: AtomicU64,
    counters: Counters,
}

/// The fake transport (see the module docs).
pub struct FakeTransport {
    inner: Arc<Inner>,
}

/// A prepared command: the slot of its tag.
#[derive(Debug)]
pub struct Prepared(Tag);

fn index(tag: Tag) -> usize {
    (tag.raw() & 0xFFFF) as usize
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// Copies `data` into the buffer described by `sg`, from byte `offset`.
fn scatter(memory: &PhysMemory, sg: &[SgElement], offset: u64, data: &[u8]) -> bool {
    let mut base = 0u64;
    let mut done = 0usize;
    for e in sg {
        let end = base + u64::from(e.len);
        let at = offset + done as u64;
        if done < data.len() && at < end {
            let within = at - base;
            let n = ((u64::from(e.len) - within) as usize).min(data.len() - done);
            if memory
                .write(e.phys.get() + within, &data[done..done + n])
                .is_err()
            {
                return false;
            }
            done += n;
        }
        base = end;
    }
    done == data.len()
}

/// Copies from the buffer described by `sg`, from byte `offset`, into `out`.
fn gather(memory: &PhysMemory, sg: &[SgElement], offset: u64, out: &mut [u8]) -> bool {
    let mut base = 0u64;
    let mut done = 0usize;
    let len = out.len();
    for e in sg {
        let end = base + u64::from(e.len);
        let at = offset + done as u64;
        if done < len && at < end {
            let within = at - base;
            let n = ((u64::from(e.len) - within) as usize).min(len - done);
            if memory
                .read(e.phys.get() + within, &mut out[done..done + n])
                .is_err()
            {
                return false;
            }
            done += n;
        }
        base = end;
    }
    done == len
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn error(&self) {
        bump(&self.errors);
    }

    fn kick(&self) {
        if let Some(dpc) = self.dpc.lock().unwrap().as_ref() {
            dpc.queue();
        }
    }

    /// Runs slot `i`'s command against the RAM disk and queues its
    /// completion.
    fn execute(&self, st: &mut State, i: usize) {
        let Some(slot) = st.slots.get_mut(i) else {
            return;
        };
        let len = u64::from(slot.len);
        let script = slot.script.take();
        let limit = match script.and_then(|s| s.residual) {
            Some(Residual::Underrun(r)) => len.saturating_sub(u64::from(r)),
            _ => len,
        };
        let twice = script.is_some_and(|s| s.twice);
        let mut moved_in = 0u64;
        let fault = std::cell::Cell::new(false);
        let memory = &*self.memory;
        let sg = &slot.sg;
        let imm = slot.imm_len.map(|n| &slot.imm[..n]);
        let executed = self.disk.execute(
            usize::from(slot.lun),
            &slot.cdb[..slot.cdb_len],
            &mut |offset, bytes| {
                let room = limit.saturating_sub(offset) as usize;
                let n = bytes.len().min(room);
                fault.set(fault.get() | !scatter(memory, sg, offset, &bytes[..n]));
                moved_in = moved_in.max(offset + n as u64);
            },
            &mut |offset, buf| {
                let room = limit.saturating_sub(offset) as usize;
                let n = buf.len().min(room);
                let ok = match imm {
                    Some(imm) => {
                        let from = offset as usize;
                        match imm.get(from..from + n) {
                            Some(src) => {
                                buf[..n].copy_from_slice(src);
                                true
                            }
                            None => false,
                        }
                    }
                    None => gather(memory, sg, offset, &mut buf[..n]),
                };
                fault.set(fault.get() | !ok);
            },
        );
        let (mut status, mut sense, mut residual) = match executed {
            Executed::Good { wanted } => {
                let residual = if wanted < len {
                    Residual::Underrun((len - wanted) as u32)
                } else if wanted > len {
                    Residual::Overrun((wanted - len) as u32)
                } else {
                    Residual::None
                };
                (0u8, None, residual)
            }
            Executed::Check(s) => (0x02, Some(s), Residual::None),
        };
        if fault.get() {
            // The core handed us a list that does not reach the buffer.
            self.error();
        }
        if let Some(script) = script {
            if let Some(s) = script.status {
                status = s;
            }
            if script.sense.is_some() {
                sense = script.sense;
            }
            if let Some(r) = script.residual {
                residual = r;
            }
        }
        slot.state = SlotState::Done;
        let (sense, sense_len) = match sense {
            Some(s) => (s, 18),
            None => ([0; 18], 0),
        };
        st.ready.push_back(Ready::Command {
            tag: slot.tag,
            target: slot.target,
            outcome: CommandOutcome::Scsi(status),
            residual,
            sense,
            sense_len,
            twice,
        });
    }

    /// Queues a termination for slot `i` (held or not yet executed).
    fn terminate(&self, st: &mut State, i: usize, outcome: CommandOutcome) {
        if let Some(slot) = st.slots.get_mut(i) {
            if matches!(slot.state, SlotState::Held(_)) {
                slot.state = SlotState::Done;
                let ready = Ready::Command {
                    tag: slot.tag,
                    target: slot.target,
                    outcome,
                    residual: Residual::None,
                    sense: [0; 18],
                    sense_len: 0,
                    twice: false,
                };
                st.late.retain(|&l| l != i);
                st.ready.push_back(ready);
            }
        }
    }

    fn pick(&self, st: &mut State) -> Option<Ready> {
        if !self.config.out_of_order || st.ready.len() < 2 {
            return st.ready.pop_front();
        }
        // xorshift; task management answers never overtake the commands
        // queued before them.
        let mut x = st.rng | 1;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        st.rng = x;
        let k = (x % st.ready.len() as u64) as usize;
        match st.ready.get(k) {
            Some(Ready::Command { .. } | Ready::Credits { .. }) => st.ready.remove(k),
            _ => st.ready.pop_front(),
        }
    }

    /// Delivers every queued completion (the completion DPC, or inline).
    fn deliver(&self, d: &Dispatch<'_>) {
        loop {
            let next = {
                let mut st = self.lock();
                let next = self.pick(&mut st);
                if let Some(Ready::Command { tag, target, .. }) = next {
                    if let Some(slot) = st.slots.get_mut(index(tag)) {
                        slot.state = SlotState::Free;
                    }
                    if let Some(c) = st.credits.get_mut(usize::from(target)) {
                        *c += 1;
                    }
                    let starved = st
                        .starved
                        .get_mut(usize::from(target))
                        .map(|s| std::mem::replace(s, false))
                        .unwrap_or(false);
                    if starved {
                        st.ready.push_back(Ready::Credits { target });
                    }
                }
                next
            };
            let Some(ready) = next else { return };
            match ready {
                Ready::Command {
                    tag,
                    outcome,
                    residual,
                    sense,
                    sense_len,
                    twice,
                    ..
                } => {
                    bump(&self.counters.completed);
                    let result = CommandResult {
                        outcome,
                        sense: &sense[..sense_len],
                        residual,
                    };
                    self.upcalls.command_done(tag, &result, d);
                    if twice {
                        self.upcalls.command_done(tag, &result, d);
                    }
                }
                Ready::Tmf { tag, response } => self.upcalls.tmf_done(tag, response, d),
                Ready::Credits { target } => self.upcalls.credits_available(target, d),
                Ready::State { target, state } => self.upcalls.target_state(target, state, d),
            }
        }
    }
}

impl FakeTransport {
    /// A fake for `targets` targets and tags up to `slots`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        upcalls: Upcalls,
        memory: Arc<PhysMemory>,
        checker: Checker,
        platform: &HostPlatform,
        config: FakeConfig,
        targets: u8,
        slots: usize,
        p: &Passive<'_>,
    ) -> Self {
        let t = usize::from(targets);
        let state = State {
            slots: (0..slots)
                .map(|_| Slot {
                    state: SlotState::Free,
                    tag: Tag(0),
                    target: 0,
                    lun: 0,
                    cdb: [0; 32],
                    cdb_len: 0,
                    direction: DataDirection::None,
                    len: 0,
                    sg: Vec::with_capacity(MAX_SG),
                    imm: vec![0; IMMEDIATE_MAX],
                    imm_len: None,
                    script: None,
                })
                .collect(),
            ready: VecDeque::with_capacity(slots * 4 + t * 8),
            late: VecDeque::with_capacity(slots),
            credits: vec![config.credits; t],
            starved: vec![false; t],
            targets: vec![TargetState::Connecting; t],
            script: VecDeque::with_capacity(4096),
            rng: config.seed | 1,
            started: false,
        };
        let inner = Arc::new(Inner {
            upcalls,
            memory,
            checker,
            disk: RamDisk::new(config.luns, config.blocks),
            state: Mutex::new(state),
            dpc: Mutex::new(None),
            config,
            errors: AtomicU64::new(0),
            counters: Counters::default(),
        });
        let weak: Weak<Inner> = Arc::downgrade(&inner);
        let dpc = platform
            .new_dpc(
                Box::new(move |d: &Dispatch<'_>| {
                    if let Some(inner) = weak.upgrade() {
                        inner.deliver(d);
                    }
                }),
                DpcTarget::Current,
                p,
            )
            .expect("DPC");
        *inner.dpc.lock().unwrap() = Some(dpc);
        Self { inner }
    }

    /// Contract breaches the fake caught in the core.
    pub fn errors(&self) -> u64 {
        self.inner.errors.load(Ordering::Relaxed)
    }

    /// Counters.
    pub fn stats(&self) -> FakeStats {
        let c = &self.inner.counters;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        FakeStats {
            prepared: g(&c.prepared),
            posted: g(&c.posted),
            discarded: g(&c.discarded),
            busy: g(&c.busy),
            completed: g(&c.completed),
            aborts: g(&c.aborts),
            lun_resets: g(&c.lun_resets),
            resets: g(&c.resets),
            starts: g(&c.starts),
            stops: g(&c.stops),
            immediate: g(&c.immediate),
        }
    }

    /// The RAM disk (for direct checks).
    pub fn disk(&self) -> &RamDisk {
        &self.inner.disk
    }

    /// Scripts the answer of the next posted command (call at PASSIVE).
    pub fn script(&self, s: Scripted) {
        self.inner.lock().script.push_back(s);
    }

    /// Commands posted and not completed (held, or queued for delivery).
    pub fn outstanding(&self) -> usize {
        self.inner
            .lock()
            .slots
            .iter()
            .filter(|s| matches!(s.state, SlotState::Held(_) | SlotState::Done))
            .count()
    }

    /// Commands held (late or never).
    pub fn held(&self) -> usize {
        self.inner
            .lock()
            .slots
            .iter()
            .filter(|s| matches!(s.state, SlotState::Held(_)))
            .count()
    }

    /// Executes up to `n` late commands (oldest first) and queues their
    /// completions for the DPC.
    pub fn release_late(&self, n: usize) -> usize {
        let mut st = self.inner.lock();
        let mut done = 0;
        while done < n {
            let Some(i) = st.late.pop_front() else { break };
            self.inner.execute(&mut st, i);
            done += 1;
        }
        drop(st);
        self.inner.kick();
        done
    }

    /// Sets target `target`'s credits to `n` (a starved target is told,
    /// from the DPC, when `n > 0`).
    pub fn set_credits(&self, target: u8, n: u32) {
        let mut st = self.inner.lock();
        if let Some(c) = st.credits.get_mut(usize::from(target)) {
            *c = n;
        }
        let starved = n > 0
            && st
                .starved
                .get_mut(usize::from(target))
                .is_some_and(|s| std::mem::replace(s, false));
        if starved {
            st.ready.push_back(Ready::Credits { target });
        }
        drop(st);
        self.inner.kick();
    }

    /// Credits target `target` has now.
    pub fn credits(&self, target: u8) -> u32 {
        self.inner.lock().credits[usize::from(target)]
    }

    /// Moves target `target` to `state` (the engine's recovery machine):
    /// fail-fast and loss terminate its outstanding commands; the core is
    /// told from the DPC.
    pub fn set_target_state(&self, target: u8, state: TargetState) {
        let mut st = self.inner.lock();
        if let Some(t) = st.targets.get_mut(usize::from(target)) {
            *t = state;
        }
        let outcome = match state {
            TargetState::FailFast => Some(CommandOutcome::Failed(FailureKind::FailFast)),
            TargetState::Lost => Some(CommandOutcome::Failed(FailureKind::DeviceLost)),
            _ => None,
        };
        st.ready.push_back(Ready::State { target, state });
        if let Some(outcome) = outcome {
            for i in 0..st.slots.len() {
                if st.slots[i].target == target {
                    self.inner.terminate(&mut st, i, outcome);
                }
            }
        }
        drop(st);
        self.inner.kick();
    }

    fn post_inner(&self, i: usize, irql: &impl LeDispatch) -> Result<(), PostFailed> {
        let inner = &*self.inner;
        let mut st = inner.lock();
        let script = st.script.pop_front();
        if let Some(slot) = st.slots.get_mut(i) {
            slot.script = script;
        }
        let delivery = script
            .and_then(|s| s.delivery)
            .unwrap_or(inner.config.delivery);
        if let Some(kind) = script.and_then(|s| s.fail_post) {
            let target = st.slots.get_mut(i).map_or(0, |slot| {
                slot.state = SlotState::Free;
                slot.target
            });
            st.credits[usize::from(target)] += 1;
            return Err(PostFailed(kind));
        }
        bump(&inner.counters.posted);
        match delivery {
            Delivery::Synchronous => {
                inner.execute(&mut st, i);
                drop(st);
                with_dispatch::<HostPlatform, _, _>(irql, |d| inner.deliver(d));
            }
            Delivery::Dpc => {
                inner.execute(&mut st, i);
                drop(st);
                inner.kick();
            }
            Delivery::Late | Delivery::Never => {
                if let Some(slot) = st.slots.get_mut(i) {
                    slot.state = SlotState::Held(delivery);
                }
                if delivery == Delivery::Late {
                    st.late.push_back(i);
                }
            }
        }
        Ok(())
    }
}

impl Transport for FakeTransport {
    type Prepared = Prepared;

    fn prepare(
        &self,
        command: &ScsiCommand<'_>,
        irql: &impl LeDispatch,
    ) -> Result<Prepared, PrepareError> {
        let inner = &*self.inner;
        inner
            .checker
            .require_irql("Transport::prepare", Irql::DISPATCH);
        bump(&inner.counters.prepared);
        let mut st = inner.lock();
        let t = usize::from(command.target);
        match st.targets.get(t) {
            Some(TargetState::Live) => {}
            Some(TargetState::Blocked | TargetState::Connecting) => {
                return Err(PrepareError::Blocked);
            }
            Some(TargetState::FailFast) => {
                return Err(PrepareError::Failed(FailureKind::FailFast));
            }
            Some(TargetState::Lost) | None => {
                return Err(PrepareError::Failed(FailureKind::DeviceLost));
            }
        }
        if st.credits[t] == 0 {
            bump(&inner.counters.busy);
            if inner.config.credit_races_refusal {
                st.credits[t] = 1;
                drop(st);
                with_dispatch::<HostPlatform, _, _>(irql, |d| {
                    inner.upcalls.credits_available(command.target, d);
                });
                return Err(PrepareError::Busy);
            }
            st.starved[t] = true;
            return Err(PrepareError::Busy);
        }
        let i = index(command.tag);
        let sg_total: u64 = command.sg_list.iter().map(|e| u64::from(e.len)).sum();
        let data = command.direction != DataDirection::None;
        let Some(slot) = st.slots.get_mut(i) else {
            inner.error();
            return Err(PrepareError::Failed(FailureKind::Protocol));
        };
        if slot.state != SlotState::Free
            || command.direction == DataDirection::Unspecified
            || (data && sg_total != u64::from(command.transfer_length))
            || command.sg_list.len() > MAX_SG
            || command.cdb.len() > 32
        {
            inner.error();
            return Err(PrepareError::Failed(FailureKind::Protocol));
        }
        slot.state = SlotState::Prepared;
        slot.tag = command.tag;
        slot.target = command.target;
        slot.lun = command.lun.0[1];
        slot.cdb_len = command.cdb.len();
        slot.cdb[..command.cdb.len()].copy_from_slice(command.cdb);
        slot.direction = command.direction;
        slot.len = if data { command.transfer_length } else { 0 };
        slot.sg.clear();
        slot.sg.extend_from_slice(command.sg_list);
        slot.imm_len = None;
        let len = slot.len as usize;
        if inner.config.immediate_writes
            && command.direction == DataDirection::Out
            && len <= IMMEDIATE_MAX
        {
            if command.immediate.read(0, &mut slot.imm[..len]).is_ok() {
                slot.imm_len = Some(len);
                bump(&inner.counters.immediate);
            } else {
                inner.error();
            }
        }
        st.credits[t] -= 1;
        Ok(Prepared(command.tag))
    }

    fn post(&self, prepared: Prepared, irql: &impl LeDispatch) -> Result<(), PostFailed> {
        let inner = &*self.inner;
        inner
            .checker
            .require_irql("Transport::post", Irql::DISPATCH);
        let i = index(prepared.0);
        let ok = {
            let st = inner.lock();
            st.slots
                .get(i)
                .is_some_and(|s| s.state == SlotState::Prepared && s.tag == prepared.0)
        };
        if !ok {
            inner.error();
            return Err(PostFailed(FailureKind::Protocol));
        }
        self.post_inner(i, irql)
    }

    fn discard(&self, prepared: Prepared, _irql: &impl LeDispatch) {
        let inner = &*self.inner;
        inner
            .checker
            .require_irql("Transport::discard", Irql::DISPATCH);
        bump(&inner.counters.discarded);
        let mut st = inner.lock();
        let i = index(prepared.0);
        let target = match st.slots.get_mut(i) {
            Some(s) if s.state == SlotState::Prepared && s.tag == prepared.0 => {
                s.state = SlotState::Free;
                s.target
            }
            _ => {
                inner.error();
                return;
            }
        };
        st.credits[usize::from(target)] += 1;
    }

    fn abort_task(
        &self,
        target: u8,
        lun: storport_srp::miniport::transport::Lun,
        victim: Tag,
        tmf: Tag,
        _irql: &impl LeDispatch,
    ) -> Result<(), TmfRefused> {
        let inner = &*self.inner;
        inner
            .checker
            .require_irql("Transport::abort_task", Irql::DISPATCH);
        let mut st = inner.lock();
        if st.targets.get(usize::from(target)) != Some(&TargetState::Live) {
            return Err(TmfRefused::NotConnected);
        }
        let i = index(victim);
        let state = match st.slots.get(i) {
            Some(s) if s.tag == victim && s.target == target && s.lun == lun.0[1] => s.state,
            _ => return Err(TmfRefused::UnknownTask),
        };
        bump(&inner.counters.aborts);
        let response = match state {
            SlotState::Held(_) => {
                inner.terminate(&mut st, i, CommandOutcome::Aborted);
                TmfResponse::Complete
            }
            // Already executed: its completion is on its way; nothing left
            // to abort at the target.
            SlotState::Done => TmfResponse::TaskNotFound,
            SlotState::Free | SlotState::Prepared => return Err(TmfRefused::UnknownTask),
        };
        st.ready.push_back(Ready::Tmf { tag: tmf, response });
        drop(st);
        inner.kick();
        Ok(())
    }

    fn reset_lun(
        &self,
        target: u8,
        lun: storport_srp::miniport::transport::Lun,
        tmf: Tag,
        _irql: &impl LeDispatch,
    ) -> Result<(), TmfRefused> {
        let inner = &*self.inner;
        inner
            .checker
            .require_irql("Transport::reset_lun", Irql::DISPATCH);
        let mut st = inner.lock();
        if st.targets.get(usize::from(target)) != Some(&TargetState::Live) {
            return Err(TmfRefused::NotConnected);
        }
        bump(&inner.counters.lun_resets);
        for i in 0..st.slots.len() {
            let s = &st.slots[i];
            if s.target == target && s.lun == lun.0[1] {
                inner.terminate(&mut st, i, CommandOutcome::Reset);
            }
        }
        st.ready.push_back(Ready::Tmf {
            tag: tmf,
            response: TmfResponse::Complete,
        });
        drop(st);
        inner.kick();
        Ok(())
    }

    fn reset(&self, irql: &impl LeDispatch) {
        let inner = &*self.inner;
        inner
            .checker
            .require_irql("Transport::reset", Irql::DISPATCH);
        bump(&inner.counters.resets);
        {
            let mut st = inner.lock();
            for i in 0..st.slots.len() {
                inner.terminate(&mut st, i, CommandOutcome::Reset);
            }
        }
        // Terminated commands are fenced at once here: deliver inline.
        with_dispatch::<HostPlatform, _, _>(irql, |d| inner.deliver(d));
    }

    fn start(&self, irql: &Passive<'_>) -> Result<(), StartFailed> {
        let inner = &*self.inner;
        inner
            .checker
            .require_irql("Transport::start", Irql::PASSIVE);
        bump(&inner.counters.starts);
        let targets = {
            let mut st = inner.lock();
            st.started = true;
            for t in &mut st.targets {
                *t = TargetState::Live;
            }
            st.targets.len()
        };
        with_dispatch::<HostPlatform, _, _>(irql, |d| {
            for t in 0..targets {
                inner.upcalls.target_state(t as u8, TargetState::Live, d);
            }
        });
        Ok(())
    }

    fn stop(&self, irql: &Passive<'_>) {
        let inner = &*self.inner;
        inner.checker.require_irql("Transport::stop", Irql::PASSIVE);
        bump(&inner.counters.stops);
        let targets = {
            let mut st = inner.lock();
            st.started = false;
            for i in 0..st.slots.len() {
                inner.terminate(
                    &mut st,
                    i,
                    CommandOutcome::Failed(FailureKind::ConnectionReset),
                );
            }
            for t in &mut st.targets {
                *t = TargetState::Connecting;
            }
            st.targets.len()
        };
        with_dispatch::<HostPlatform, _, _>(irql, |d| {
            inner.deliver(d);
            for t in 0..targets {
                inner
                    .upcalls
                    .target_state(t as u8, TargetState::Connecting, d);
            }
        });
    }
}
