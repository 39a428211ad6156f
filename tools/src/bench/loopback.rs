//! The loopback transport: a RAM-disk SCSI target behind the miniport
//! core's [`Transport`] seam, in the same process, without RDMA.
//!
//! It stands where the SRP engine will stand, and does what an RDMA target
//! does with a command's buffer: it moves the data by *physical address*
//! through the command's scatter/gather list, in the StorPort model's
//! simulated physical memory. Commands go to a target thread (the target's
//! channel), which runs them on a [`ScsiTarget`] and queues the responses;
//! a completion DPC delivers them to the core at `DISPATCH_LEVEL`, as the
//! engine's CQ DPC will. So a benchmark over it measures the StorPort model
//! and the miniport core (tagging, SG lists, status mapping, completion)
//! plus a SCSI target — everything of the full stack except the SRP engine,
//! kverbs and the software HCAs.
//!
//! Nothing callable at `DISPATCH_LEVEL` allocates: command slots (one per
//! tag, with room for the largest SG list), the work queue and the
//! response queue are allocated when the transport is created.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::thread::JoinHandle;

use hca_lowlevel::sim::PhysMemory;
use kverbs::irql::{Dispatch, LeDispatch, Passive};
use kverbs::platform::host::{HostDpc, HostPlatform};
use kverbs::platform::{AllocError, DpcTarget, Platform, RawDpc};
use kverbs::sync::with_dispatch;
use storport_srp::miniport::transport::{
    CommandOutcome, CommandResult, FailureKind, Lun, PostFailed, PrepareError, Residual,
    ScsiCommand, StartFailed, Tag, TargetState, TmfRefused, TmfResponse, Transport, Upcalls,
};
use storport_srp::storport::{DataDirection, SgElement};
use storport_srp::wire::Residual as WireResidual;

use crate::scsi_target::{Request, ScsiTarget};

/// Largest scatter/gather list a command may carry (the adapter's
/// `physical_breaks` + 1 must not exceed it).
pub const MAX_SG: usize = 1024;
/// Sense bytes kept per response.
const SENSE_MAX: usize = 64;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Slot index of a tag (the core's tag layout: slot in the low 16 bits).
fn slot_of(tag: Tag) -> usize {
    (tag.raw() & 0xFFFF) as usize
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    Free,
    Prepared,
    Posted,
}

struct Slot {
    state: SlotState,
    tag: Tag,
    target: u8,
    lun: Lun,
    cdb: [u8; 32],
    cdb_len: usize,
    direction: DataDirection,
    len: u32,
    sg: Vec<SgElement>,
    /// The reset epoch when it was posted.
    epoch: u64,
}

#[derive(Debug, Clone, Copy)]
enum Work {
    Command(usize),
    Abort { victim: Tag, tmf: Tag },
    ResetLun { tmf: Tag },
}

#[derive(Clone, Copy)]
enum Ready {
    Command {
        tag: Tag,
        outcome: CommandOutcome,
        residual: Residual,
        sense: [u8; SENSE_MAX],
        sense_len: usize,
    },
    Tmf {
        tag: Tag,
        response: TmfResponse,
    },
}

struct Inner {
    upcalls: Upcalls,
    memory: Arc<PhysMemory>,
    targets: Vec<Arc<ScsiTarget>>,
    slots: Box<[Mutex<Slot>]>,
    work: Mutex<VecDeque<Work>>,
    work_ready: Condvar,
    ready: Mutex<VecDeque<Ready>>,
    dpc: OnceLock<HostDpc>,
    running: AtomicBool,
    stopping: AtomicBool,
    epoch: AtomicU64,
    thread: Mutex<Option<JoinHandle<()>>>,
    commands: AtomicU64,
}

/// The loopback transport (see the module docs).
pub struct LoopbackTransport {
    inner: Arc<Inner>,
}

/// A prepared command: its slot.
#[derive(Debug)]
pub struct Prepared(usize);

fn scatter(memory: &PhysMemory, sg: &[SgElement], offset: u64, data: &[u8]) -> bool {
    let mut base = 0u64;
    let mut done = 0usize;
    for e in sg {
        let end = base + u64::from(e.len);
        let at = offset + done as u64;
        if done < data.len() && at < end {
            let within = at - base;
            let n = usize::try_from(u64::from(e.len) - within)
                .unwrap_or(usize::MAX)
                .min(data.len() - done);
            let Some(piece) = data.get(done..done + n) else {
                return false;
            };
            if memory.write(e.phys.get() + within, piece).is_err() {
                return false;
            }
            done += n;
        }
        base = end;
    }
    done == data.len()
}

fn gather(memory: &PhysMemory, sg: &[SgElement], out: &mut [u8]) -> bool {
    let mut done = 0usize;
    for e in sg {
        let n = (e.len as usize).min(out.len() - done);
        let Some(piece) = out.get_mut(done..done + n) else {
            return false;
        };
        if memory.read(e.phys.get(), piece).is_err() {
            return false;
        }
        done += n;
        if done == out.len() {
            break;
        }
    }
    done == out.len()
}

fn residual(r: WireResidual) -> Residual {
    match r {
        WireResidual::None => Residual::None,
        WireResidual::Underflow(n) => Residual::Underrun(n),
        WireResidual::Overflow(n) => Residual::Overrun(n),
    }
}

impl Inner {
    fn kick(&self) {
        if let Some(dpc) = self.dpc.get() {
            dpc.queue();
        }
    }

    fn push_ready(&self, ready: Ready) {
        lock(&self.ready).push_back(ready);
        self.kick();
    }

    fn command_ready(&self, tag: Tag, outcome: CommandOutcome) -> Ready {
        Ready::Command {
            tag,
            outcome,
            residual: Residual::None,
            sense: [0; SENSE_MAX],
            sense_len: 0,
        }
    }

    /// The completion DPC: hands every queued response to the core.
    fn deliver(&self, d: &Dispatch<'_>) {
        loop {
            let next = lock(&self.ready).pop_front();
            let Some(ready) = next else { return };
            match ready {
                Ready::Command {
                    tag,
                    outcome,
                    residual,
                    sense,
                    sense_len,
                } => {
                    // Let go of the tag before the upcall: the core may
                    // reuse it at once.
                    if let Some(slot) = self.slots.get(slot_of(tag)) {
                        lock(slot).state = SlotState::Free;
                    }
                    let result = CommandResult {
                        outcome,
                        sense: sense.get(..sense_len).unwrap_or(&[]),
                        residual,
                    };
                    self.upcalls.command_done(tag, &result, d);
                }
                Ready::Tmf { tag, response } => self.upcalls.tmf_done(tag, response, d),
            }
        }
    }

    /// The target's channel thread: runs commands in arrival order.
    fn serve(&self) {
        let mut data_out: Vec<u8> = Vec::new();
        loop {
            let work = {
                let mut queue = lock(&self.work);
                loop {
                    if let Some(w) = queue.pop_front() {
                        break Some(w);
                    }
                    if self.stopping.load(Ordering::Acquire) {
                        break None;
                    }
                    queue = self
                        .work_ready
                        .wait(queue)
                        .unwrap_or_else(PoisonError::into_inner);
                }
            };
            let Some(work) = work else { return };
            match work {
                Work::Command(i) => self.execute(i, &mut data_out),
                // Commands run in order: by the time a task management
                // function is served, every command posted before it has
                // been answered.
                Work::Abort { victim, tmf } => {
                    let _ = victim;
                    self.push_ready(Ready::Tmf {
                        tag: tmf,
                        response: TmfResponse::TaskNotFound,
                    });
                }
                Work::ResetLun { tmf } => self.push_ready(Ready::Tmf {
                    tag: tmf,
                    response: TmfResponse::Complete,
                }),
            }
        }
    }

    fn execute(&self, i: usize, data_out: &mut Vec<u8>) {
        let Some(slot) = self.slots.get(i) else {
            return;
        };
        let slot = lock(slot);
        let tag = slot.tag;
        if slot.epoch != self.epoch.load(Ordering::Acquire) {
            drop(slot);
            self.push_ready(self.command_ready(tag, CommandOutcome::Reset));
            return;
        }
        self.commands.fetch_add(1, Ordering::Relaxed);
        let Some(target) = self.targets.get(usize::from(slot.target)) else {
            drop(slot);
            self.push_ready(
                self.command_ready(tag, CommandOutcome::Failed(FailureKind::DeviceLost)),
            );
            return;
        };
        let cdb = slot.cdb.get(..slot.cdb_len).unwrap_or(&[]);
        let len = slot.len as usize;
        let direction = slot.direction;
        let mut fault = false;
        let response = match slot.direction {
            DataDirection::Out => {
                data_out.resize(len, 0);
                fault |= !gather(&self.memory, &slot.sg, data_out);
                target.execute(
                    &Request::with_data_out(slot.lun, cdb, data_out),
                    &mut |_| {},
                )
            }
            _ => {
                let mut offset = 0u64;
                let memory = &*self.memory;
                let sg = &slot.sg;
                target.execute(&Request::new(slot.lun, cdb, slot.len), &mut |piece| {
                    fault |= !scatter(memory, sg, offset, piece);
                    offset += piece.len() as u64;
                })
            }
        };
        drop(slot);
        let ready = if fault {
            // The buffer's SG list does not reach memory: an RDMA target
            // would see a protection error; the command fails.
            self.command_ready(tag, CommandOutcome::Failed(FailureKind::Protocol))
        } else {
            let mut sense = [0u8; SENSE_MAX];
            let mut sense_len = 0;
            if let Some(bytes) = response.sense_bytes() {
                sense_len = bytes.len().min(SENSE_MAX);
                if let (Some(dst), Some(src)) = (sense.get_mut(..sense_len), bytes.get(..sense_len))
                {
                    dst.copy_from_slice(src);
                }
            }
            let r = match direction {
                DataDirection::In => residual(response.data_in_residual),
                DataDirection::Out => residual(response.data_out_residual),
                _ => Residual::None,
            };
            Ready::Command {
                tag,
                outcome: CommandOutcome::Scsi(response.status.0),
                residual: r,
                sense,
                sense_len,
            }
        };
        self.push_ready(ready);
    }

    fn enqueue(&self, work: Work) {
        lock(&self.work).push_back(work);
        self.work_ready.notify_one();
    }
}

impl LoopbackTransport {
    /// A transport for `targets` (target `t` is StorPort target id `t`),
    /// moving data in `memory`, with a slot for each of `slots` tags.
    ///
    /// # Errors
    /// [`AllocError`] if the completion DPC cannot be created.
    ///
    /// # IRQL
    /// `PASSIVE_LEVEL` (it allocates).
    pub fn new(
        upcalls: Upcalls,
        memory: Arc<PhysMemory>,
        platform: &HostPlatform,
        targets: Vec<Arc<ScsiTarget>>,
        slots: usize,
        irql: &Passive<'_>,
    ) -> Result<Self, AllocError> {
        let inner = Arc::new(Inner {
            upcalls,
            memory,
            targets,
            slots: (0..slots)
                .map(|_| {
                    Mutex::new(Slot {
                        state: SlotState::Free,
                        tag: Tag(0),
                        target: 0,
                        lun: Lun([0; 8]),
                        cdb: [0; 32],
                        cdb_len: 0,
                        direction: DataDirection::None,
                        len: 0,
                        sg: Vec::with_capacity(MAX_SG),
                        epoch: 0,
                    })
                })
                .collect(),
            work: Mutex::new(VecDeque::with_capacity(slots * 2 + 64)),
            work_ready: Condvar::new(),
            ready: Mutex::new(VecDeque::with_capacity(slots * 2 + 64)),
            dpc: OnceLock::new(),
            running: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
            epoch: AtomicU64::new(0),
            thread: Mutex::new(None),
            commands: AtomicU64::new(0),
        });
        let weak = Arc::downgrade(&inner);
        let dpc = platform.new_dpc(
            Box::new(move |d: &Dispatch<'_>| {
                if let Some(inner) = weak.upgrade() {
                    inner.deliver(d);
                }
            }),
            DpcTarget::Current,
            irql,
        )?;
        let _ = inner.dpc.set(dpc);
        Ok(Self { inner })
    }

    /// Commands the target has executed.
    #[must_use]
    pub fn commands(&self) -> u64 {
        self.inner.commands.load(Ordering::Relaxed)
    }

    fn stop_thread(&self) {
        let inner = &self.inner;
        inner.stopping.store(true, Ordering::Release);
        {
            let _queue = lock(&inner.work);
            inner.work_ready.notify_all();
        }
        let handle = lock(&inner.thread).take();
        if let Some(handle) = handle {
            let _ = handle.join();
        }
        inner.stopping.store(false, Ordering::Release);
    }
}

impl Drop for LoopbackTransport {
    fn drop(&mut self) {
        self.stop_thread();
    }
}

impl Transport for LoopbackTransport {
    type Prepared = Prepared;

    fn prepare(
        &self,
        command: &ScsiCommand<'_>,
        _irql: &impl LeDispatch,
    ) -> Result<Prepared, PrepareError> {
        let inner = &*self.inner;
        if !inner.running.load(Ordering::Acquire) {
            return Err(PrepareError::Blocked);
        }
        if usize::from(command.target) >= inner.targets.len() {
            return Err(PrepareError::Failed(FailureKind::DeviceLost));
        }
        let i = slot_of(command.tag);
        let Some(slot) = inner.slots.get(i) else {
            return Err(PrepareError::Failed(FailureKind::Protocol));
        };
        let mut slot = lock(slot);
        let data = matches!(command.direction, DataDirection::In | DataDirection::Out);
        if slot.state != SlotState::Free
            || command.sg_list.len() > MAX_SG
            || command.cdb.len() > slot.cdb.len()
        {
            return Err(PrepareError::Failed(FailureKind::Unsupported));
        }
        slot.state = SlotState::Prepared;
        slot.tag = command.tag;
        slot.target = command.target;
        slot.lun = command.lun;
        slot.cdb_len = command.cdb.len();
        if let Some(dst) = slot.cdb.get_mut(..command.cdb.len()) {
            dst.copy_from_slice(command.cdb);
        }
        slot.direction = command.direction;
        slot.len = if data { command.transfer_length } else { 0 };
        slot.sg.clear();
        slot.sg.extend_from_slice(command.sg_list);
        Ok(Prepared(i))
    }

    fn post(&self, prepared: Prepared, _irql: &impl LeDispatch) -> Result<(), PostFailed> {
        let inner = &*self.inner;
        let Some(slot) = inner.slots.get(prepared.0) else {
            return Err(PostFailed(FailureKind::Protocol));
        };
        {
            let mut slot = lock(slot);
            if slot.state != SlotState::Prepared {
                return Err(PostFailed(FailureKind::Protocol));
            }
            slot.state = SlotState::Posted;
            slot.epoch = inner.epoch.load(Ordering::Acquire);
        }
        inner.enqueue(Work::Command(prepared.0));
        Ok(())
    }

    fn discard(&self, prepared: Prepared, _irql: &impl LeDispatch) {
        if let Some(slot) = self.inner.slots.get(prepared.0) {
            lock(slot).state = SlotState::Free;
        }
    }

    fn abort_task(
        &self,
        _target: u8,
        _lun: Lun,
        victim: Tag,
        tmf: Tag,
        _irql: &impl LeDispatch,
    ) -> Result<(), TmfRefused> {
        if !self.inner.running.load(Ordering::Acquire) {
            return Err(TmfRefused::NotConnected);
        }
        self.inner.enqueue(Work::Abort { victim, tmf });
        Ok(())
    }

    fn reset_lun(
        &self,
        _target: u8,
        _lun: Lun,
        tmf: Tag,
        _irql: &impl LeDispatch,
    ) -> Result<(), TmfRefused> {
        if !self.inner.running.load(Ordering::Acquire) {
            return Err(TmfRefused::NotConnected);
        }
        self.inner.enqueue(Work::ResetLun { tmf });
        Ok(())
    }

    fn reset(&self, _irql: &impl LeDispatch) {
        // Commands not yet served are answered "reset" when the target
        // thread reaches them (it never waits for anything in between).
        self.inner.epoch.fetch_add(1, Ordering::AcqRel);
    }

    fn start(&self, irql: &Passive<'_>) -> Result<(), StartFailed> {
        let inner = &self.inner;
        if !inner.running.swap(true, Ordering::AcqRel) {
            let serving = Arc::clone(inner);
            let handle = std::thread::Builder::new()
                .name("kvbench-loopback-target".into())
                .spawn(move || serving.serve())
                .map_err(|_| StartFailed { code: 1 })?;
            *lock(&inner.thread) = Some(handle);
        }
        with_dispatch::<HostPlatform, _, _>(irql, |d| {
            for t in 0..inner.targets.len() {
                inner.upcalls.target_state(
                    u8::try_from(t).unwrap_or(u8::MAX),
                    TargetState::Live,
                    d,
                );
            }
        });
        Ok(())
    }

    fn stop(&self, irql: &Passive<'_>) {
        let inner = &self.inner;
        inner.running.store(false, Ordering::Release);
        // Serve (or answer "reset") everything posted, then stop the
        // thread and deliver what is left.
        inner.epoch.fetch_add(1, Ordering::AcqRel);
        self.stop_thread();
        with_dispatch::<HostPlatform, _, _>(irql, |d| {
            inner.deliver(d);
            for t in 0..inner.targets.len() {
                inner.upcalls.target_state(
                    u8::try_from(t).unwrap_or(u8::MAX),
                    TargetState::Connecting,
                    d,
                );
            }
        });
    }
}
