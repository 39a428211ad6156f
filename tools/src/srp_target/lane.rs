//! The DPC lane: a channel serves an `SRP_CMD` in its CQ's DPC, at
//! `DISPATCH_LEVEL`, when everything the command needs is ready without
//! `PASSIVE_LEVEL`-only work — as a kernel target serves from its
//! completion handler instead of waking a thread for every command.
//!
//! # What the lane serves
//!
//! A command with no data, with immediate data, or with a DATA-IN buffer
//! in at most [`LANE_MAX_DESCS`] descriptors of at most [`LANE_BUF_BYTES`]
//! (or, for a READ when the target's stores are registered, at most
//! [`LANE_ZC_BYTES`]: its WRITEs gather straight from the store's chunks,
//! which stay pinned until the command's SEND completes),
//! that the SCSI target can run without blocking or allocating
//! ([`crate::scsi_target::ScsiTarget::try_execute`]: READ, WRITE, TEST UNIT
//! READY). Its staging buffer comes from a pool registered at login, its
//! `SRP_RSP` from send slots reserved for the lane, and its work requests
//! from a share of the send queue reserved for the lane, so nothing is
//! allocated, registered or waited for.
//!
//! Everything else goes to the channel thread as before: data-out fetched
//! by RDMA READ, larger transfers, task management, target requests and
//! their answers, logout, any IU while a misbehaviour switch or a fault
//! rule is armed or credits are withheld, any IU before the channel is live
//! or after it began to go down, and a command that finds the lane's pool,
//! slots or send-queue share used up or a store chunk locked.
//!
//! # Why the thread's rules still hold
//!
//! The lane runs a command to its end in one go: when its DPC returns, the
//! command's WRITEs and `SRP_RSP` are posted in one batch (data before the
//! response, as on the thread), so a later task management function finds
//! it answered, as it would find a thread command whose response was
//! posted. The credit account (the initiator's credits, the deltas owed
//! for aborted commands) and the history of delivered buffers (for the
//! stale-rkey switch) live here, behind the lane's spin lock, shared with
//! the thread. The thread counts the lane's commands as outstanding (an
//! `SRP_I_LOGOUT` waits for them) and leaves the lane's share of the send
//! queue alone.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicI64, AtomicU32, Ordering};
use std::time::Instant;

use hca_lowlevel::device::AccessFlags;
use kverbs::error::VerbsError;
use kverbs::irql::{Dispatch, Passive};
use kverbs::mr::Mr;
use kverbs::pd::Pd;
use kverbs::platform::host::HostPlatform;
use kverbs::qp::Qp;
use kverbs::wr::{Completion, Payload, SendFlags, SendWr, Signal, WcStatus, WriteWr};
use storport_srp::scsi::Status;
use storport_srp::wire::srp::{
    self, Cmd, CmdRepr, DataIn, DataOut, DirectDesc, Opcode, RspRepr, SolNot,
};

use super::TargetShared;
use super::channel::Negotiated;
use super::channel::is_read;
use super::config::SrpTargetConfig;
use super::counters::Counters;
use super::shared::{SendWhat, SrpSink, WrCtx, write_response};
use super::staging::{for_each_gather_piece, for_each_piece};
use crate::scsi_target::{DataOut as ScsiDataOut, Extent, Request as ScsiRequest};

type Hp = HostPlatform;

/// Size of each of the lane's staging buffers: the largest data-in the lane
/// serves.
pub(crate) const LANE_BUF_BYTES: usize = 64 << 10;
/// Largest READ the lane serves straight from the store's registered
/// chunks (no staging buffer, so larger than [`LANE_BUF_BYTES`]).
pub(crate) const LANE_ZC_BYTES: usize = 256 << 10;
/// Most store extents (chunk pieces, zeros) of a READ the lane serves
/// from the store: a 256 KiB READ over 64 KiB chunks spans at most 5.
pub(crate) const LANE_MAX_EXTENTS: usize = 8;
/// Most commands the lane has in flight (its send slots and buffers).
pub(crate) const LANE_SLOTS: u32 = 16;
/// Most data-in descriptors of a command the lane serves.
pub(crate) const LANE_MAX_DESCS: usize = 16;
/// How many delivered buffers the stale-rkey switch remembers.
pub(crate) const DONE_HISTORY: usize = 64;

/// The lane's resources for a channel with this configuration: send slots
/// (one per command), staging buffers, and its share of the send queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LanePlan {
    pub(crate) slots: u32,
    pub(crate) wr_budget: u32,
}

impl LanePlan {
    pub(crate) fn for_config(config: &SrpTargetConfig) -> Self {
        let slots = LANE_SLOTS.min(config.rq_size);
        let max_rdma = config.max_rdma_size.max(1) as usize;
        // Each command: its WRITEs (one per max_rdma_size of data, plus
        // one per descriptor boundary) and one SEND.
        // A READ from the store is also cut at each extent's end.
        let staged = LANE_BUF_BYTES.div_ceil(max_rdma) + LANE_MAX_DESCS;
        let gathered = LANE_ZC_BYTES.div_ceil(max_rdma) + LANE_MAX_DESCS + LANE_MAX_EXTENTS;
        let writes = staged.max(gathered);
        let per_command = u32::try_from(writes + 1).unwrap_or(u32::MAX);
        Self {
            slots,
            wr_budget: slots.saturating_mul(per_command),
        }
    }
}

/// One command the lane posted, until its `SRP_RSP`'s SEND completes.
#[derive(Debug, Default)]
struct LaneSlot {
    buf: Option<u16>,
    /// The store extents a READ's WRITEs gather from, pinned until the
    /// SEND completes (or is flushed, or the lane is released): clearing
    /// drops the pins. Made with [`LANE_MAX_EXTENTS`] capacity at login;
    /// never grows.
    extents: Vec<Extent>,
    /// Work requests the command posted (its WRITEs and the SEND).
    wrs: u32,
    tag: u64,
    /// Its first non-empty data-in buffer.
    first: Option<DirectDesc>,
}

/// What the lane needs to serve: the channel's objects (shared handles)
/// and its own pre-registered memory. Installed at login, taken back when
/// the channel is released.
pub(crate) struct LaneIo {
    target: Arc<TargetShared>,
    qp: Qp<Hp, WrCtx>,
    recv_mr: Mr<Hp>,
    send_mr: Mr<Hp>,
    req_size: usize,
    rsp_size: usize,
    neg: Negotiated,
    max_rdma: u32,
    /// The IU being served, copied out of its receive slot.
    iu: Vec<u8>,
    bufs: Vec<Mr<Hp>>,
    free_bufs: Vec<u16>,
    slots: Vec<LaneSlot>,
    free_slots: Vec<u16>,
    /// The first of the lane's send slots in the send buffer.
    slot_base: u32,
    wr_budget: u32,
}

impl LaneIo {
    /// Registers the lane's staging buffers (at `PASSIVE_LEVEL`).
    ///
    /// # Errors
    ///
    /// A failed registration (the buffers registered so far are
    /// deregistered).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        target: Arc<TargetShared>,
        pd: &Pd<Hp>,
        qp: Qp<Hp, WrCtx>,
        recv_mr: Mr<Hp>,
        send_mr: Mr<Hp>,
        slot_base: u32,
        plan: LanePlan,
        p: &Passive<'_>,
    ) -> Result<Self, VerbsError> {
        let mut bufs = Vec::with_capacity(plan.slots as usize);
        for _ in 0..plan.slots {
            match Mr::alloc(pd, LANE_BUF_BYTES, AccessFlags::LOCAL_WRITE, p) {
                Ok(mr) => bufs.push(mr),
                Err(e) => {
                    for mr in &bufs {
                        let _ = mr.dereg(p);
                    }
                    return Err(e);
                }
            }
        }
        let config = &target.config;
        let req_size = config.srp_max_req_size as usize;
        let rsp_size = config.srp_max_rsp_size as usize;
        let max_rdma = config.max_rdma_size;
        let count = u16::try_from(plan.slots).unwrap_or(u16::MAX);
        Ok(Self {
            target,
            qp,
            recv_mr,
            send_mr,
            req_size,
            rsp_size,
            neg: Negotiated {
                max_ti_iu_len: 0,
                imm_data_offset: None,
                read_depth: 0,
            },
            max_rdma,
            iu: vec![0; req_size],
            bufs,
            free_bufs: (0..count).rev().collect(),
            slots: (0..count)
                .map(|_| LaneSlot {
                    extents: Vec::with_capacity(LANE_MAX_EXTENTS),
                    ..LaneSlot::default()
                })
                .collect(),
            free_slots: (0..count).rev().collect(),
            slot_base,
            wr_budget: plan.wr_budget,
        })
    }

    /// Deregisters the staging buffers (at `PASSIVE_LEVEL`, after the CQ
    /// is gone, so no completion can name them any more).
    pub(crate) fn release(self, p: &Passive<'_>) {
        for mr in &self.bufs {
            let _ = mr.dereg(p);
        }
    }
}

/// The credit account of a channel, shared by its thread and its lane
/// (atomics: either side updates it at any IRQL without a lock).
#[derive(Debug)]
pub(crate) struct Credits {
    /// Credits the initiator holds, as the target counts them.
    initiator: AtomicI64,
    /// Credits owed to the initiator (aborted commands), returned with the
    /// next response.
    pending_delta: AtomicI32,
    /// Commands the lane posted whose SEND has not completed (the thread
    /// counts them as outstanding).
    lane_inflight: AtomicU32,
    /// The thread withholds credits (or is about to): the lane must not
    /// answer with a delta of its own.
    hold: AtomicBool,
}

impl Credits {
    pub(crate) fn new(initial: u32) -> Self {
        Self {
            initiator: AtomicI64::new(i64::from(initial)),
            pending_delta: AtomicI32::new(0),
            lane_inflight: AtomicU32::new(0),
            hold: AtomicBool::new(false),
        }
    }

    /// One credit used by an IU that needs one.
    pub(crate) fn use_credit(&self, counters: &Counters) {
        if self.initiator.fetch_sub(1, Ordering::AcqRel) <= 0 {
            Counters::add(&counters.credit_violations, 1);
        }
    }

    /// Records credits given to the initiator.
    pub(crate) fn grant(&self, delta: i32, counters: &Counters) {
        self.initiator.fetch_add(i64::from(delta), Ordering::AcqRel);
        if delta > 0 {
            Counters::add(&counters.credits_granted, delta.unsigned_abs().into());
        }
    }

    /// Takes what is owed.
    pub(crate) fn take_pending(&self) -> i32 {
        self.pending_delta.swap(0, Ordering::AcqRel)
    }

    /// Owes one more credit (an aborted command).
    pub(crate) fn owe_one(&self) {
        let _ = self
            .pending_delta
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |d| {
                Some(d.saturating_add(1))
            });
    }

    /// Sets or clears the withholding hold.
    pub(crate) fn set_hold(&self, hold: bool) {
        self.hold.store(hold, Ordering::SeqCst);
    }

    /// Commands the lane has in flight.
    pub(crate) fn lane_inflight(&self) -> u32 {
        self.lane_inflight.load(Ordering::Acquire)
    }
}

/// The lane's state, behind the channel's lane spin lock.
pub(crate) struct Lane {
    /// The thread lets the lane serve (live; no switch, withholding or
    /// logout in progress).
    pub(crate) serving: bool,
    /// Buffers of commands whose responses were delivered: (when, tag,
    /// first descriptor), newest last.
    pub(crate) done: VecDeque<(Instant, u64, DirectDesc)>,
    /// When the lane last finished a command.
    pub(crate) idle_since: Instant,
    /// Work requests the lane posted that have not retired.
    wrs: u32,
    io: Option<LaneIo>,
}

/// What the lane did with a completion.
#[derive(Debug)]
pub(crate) enum LaneOutcome {
    /// Handled: the thread need not know.
    Done,
    /// Handled, and the thread should look (it waits for the lane's
    /// commands to finish).
    Wake,
    /// Not the lane's: the thread handles it.
    Forward(Completion<WrCtx>),
    /// The lane could not post a command's answer: the QP is going away;
    /// the thread disconnects.
    PostFailed,
}

impl Lane {
    pub(crate) fn new() -> Self {
        Self {
            serving: false,
            done: VecDeque::with_capacity(DONE_HISTORY),
            idle_since: Instant::now(),
            wrs: 0,
            io: None,
        }
    }

    /// Installs the lane's resources (login, `PASSIVE_LEVEL`).
    pub(crate) fn install(&mut self, io: LaneIo) {
        self.io = Some(io);
    }

    /// Sets what was negotiated at login.
    pub(crate) fn negotiated(&mut self, neg: Negotiated) {
        if let Some(io) = self.io.as_mut() {
            io.neg = neg;
        }
    }

    /// Takes the resources back (release).
    pub(crate) fn take_io(&mut self) -> Option<LaneIo> {
        self.serving = false;
        self.io.take()
    }

    /// Remembers a delivered buffer for the stale-rkey switch.
    pub(crate) fn remember(&mut self, tag: u64, desc: DirectDesc) {
        if self.done.len() == DONE_HISTORY {
            self.done.pop_front();
        }
        // Never grows: the deque was made with this capacity.
        if self.done.len() < self.done.capacity() {
            self.done.push_back((Instant::now(), tag, desc));
        }
    }

    /// The DPC's part of a completion on the channel's CQ.
    ///
    /// # IRQL
    ///
    /// `DISPATCH_LEVEL` (the CQ's DPC); allocates nothing, blocks on
    /// nothing.
    pub(crate) fn on_completion(
        &mut self,
        c: Completion<WrCtx>,
        credits: &Credits,
        irql: &Dispatch<'_>,
    ) -> LaneOutcome {
        match c.context {
            Some(WrCtx::Send {
                slot,
                what: SendWhat::Served,
            }) => {
                let delivered = c.status == WcStatus::Success;
                self.sent(slot, delivered, credits);
                if matches!(c.status, WcStatus::Error(_)) {
                    // The thread counts the error and takes the channel down.
                    LaneOutcome::Forward(c)
                } else if self.serving {
                    LaneOutcome::Done
                } else {
                    LaneOutcome::Wake
                }
            }
            Some(WrCtx::Recv(slot)) if c.status == WcStatus::Success => {
                match self.serve(slot, c.byte_len, credits, irql) {
                    Some(true) => LaneOutcome::Done,
                    Some(false) => LaneOutcome::PostFailed,
                    None => LaneOutcome::Forward(c),
                }
            }
            _ => LaneOutcome::Forward(c),
        }
    }

    /// A lane command's SEND completed (or was flushed).
    fn sent(&mut self, slot: u32, delivered: bool, credits: &Credits) {
        let Some(io) = self.io.as_mut() else {
            return;
        };
        let Some(index) = slot
            .checked_sub(io.slot_base)
            .and_then(|i| u16::try_from(i).ok())
        else {
            return;
        };
        let Some(entry) = io.slots.get_mut(usize::from(index)) else {
            return;
        };
        // The WRITEs before this SEND have completed: the pins go.
        entry.extents.clear();
        let done = LaneSlot {
            buf: entry.buf.take(),
            extents: Vec::new(),
            wrs: std::mem::take(&mut entry.wrs),
            tag: entry.tag,
            first: entry.first.take(),
        };
        if let Some(buf) = done.buf {
            io.free_bufs.push(buf);
        }
        io.free_slots.push(index);
        self.wrs = self.wrs.saturating_sub(done.wrs);
        let _ = credits
            .lane_inflight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                Some(n.saturating_sub(1))
            });
        if delivered {
            if let Some(desc) = done.first {
                self.remember(done.tag, desc);
            }
        }
        self.idle_since = Instant::now();
    }

    /// Serves the IU in receive slot `slot` if the lane can: `None` leaves
    /// it to the thread (nothing changed); `Some(true)` served;
    /// `Some(false)` executed but its answer could not be posted.
    fn serve(
        &mut self,
        slot: u32,
        byte_len: u32,
        credits: &Credits,
        irql: &Dispatch<'_>,
    ) -> Option<bool> {
        if !self.serving {
            return None;
        }
        let io = self.io.as_mut()?;
        let target = &io.target;
        if !target.switches.idle() || credits.hold.load(Ordering::SeqCst) {
            return None;
        }
        let len = (byte_len as usize).min(io.req_size);
        let at = slot as usize * io.req_size;
        let iu = io.iu.get_mut(..len)?;
        io.recv_mr.mem().read(at, iu).ok()?;
        let iu = io.iu.get(..len)?;
        if Opcode::from_u8(*iu.first()?) != Some(Opcode::Cmd) {
            return None;
        }
        let view = Cmd::new_checked(iu).ok()?;
        let repr = CmdRepr::parse(&view, io.neg.imm_data_offset).ok()?;
        // The transfer, ib_srpt's way (DATA-IN if named, else DATA-OUT).
        let mut descs = [DirectDesc::default(); LANE_MAX_DESCS];
        let mut count = 0usize;
        let mut immediate: Option<&[u8]> = None;
        let mut add = |d: DirectDesc| -> Option<()> {
            d.va.checked_add(u64::from(d.len))?;
            *descs.get_mut(count)? = d;
            count += 1;
            Some(())
        };
        match (repr.data_in, repr.data_out) {
            (DataIn::Direct(d), _) => add(d)?,
            (DataIn::Indirect(ind), _) => {
                for d in ind.descs.iter() {
                    add(d)?;
                }
            }
            (DataIn::None, DataOut::Immediate { data, .. }) => immediate = Some(data),
            (DataIn::None, DataOut::None) => {}
            _ => return None,
        }
        let descs = descs.get(..count)?;
        let total = descs
            .iter()
            .try_fold(0u32, |acc, d| acc.checked_add(d.len))?;
        // A READ with the stores registered goes out from the chunks.
        let store_key = target
            .store_key
            .filter(|_| count > 0 && total > 0 && is_read(repr.cdb));
        let limit = if store_key.is_some() {
            LANE_ZC_BYTES
        } else {
            LANE_BUF_BYTES
        };
        if total as usize > limit {
            return None;
        }
        // Resources: a send slot, a buffer for data-in, room in the lane's
        // share of the send queue for every WRITE and the SEND.
        let extent_cuts = if store_key.is_some() {
            LANE_MAX_EXTENTS as u32
        } else {
            0
        };
        let wrs_needed = piece_count(descs, total, io.max_rdma)
            .checked_add(extent_cuts)?
            .checked_add(1)?;
        if self.wrs.checked_add(wrs_needed)? > io.wr_budget {
            return None;
        }
        let lane_slot = *io.free_slots.last()?;
        let buf = if total > 0 && store_key.is_none() {
            Some(*io.free_bufs.last()?)
        } else {
            None
        };
        let staging = match buf {
            Some(b) => Some(io.bufs.get(usize::from(b))?),
            None => None,
        };
        let request = ScsiRequest {
            lun: repr.lun,
            cdb: repr.cdb,
            data_out: immediate.map(ScsiDataOut::Bytes),
            data_in_capacity: if count > 0 { total } else { 0 },
        };
        let extents = &mut io.slots.get_mut(usize::from(lane_slot))?.extents;
        extents.clear();
        let mut sink = SrpSink {
            staging,
            written: 0,
            store_key,
            extents,
            max_extents: LANE_MAX_EXTENTS,
        };
        // Declined: the sink dropped whatever extents it had taken.
        let response = target.scsi.try_execute_into(&request, &mut sink)?;
        // From here the command is the lane's: count it as the thread
        // would, in the thread's order.
        io.free_slots.pop();
        if buf.is_some() {
            io.free_bufs.pop();
        }
        let counters = &target.counters;
        Counters::add(&counters.srp_cmd, 1);
        credits.use_credit(counters);
        if let Some(&op) = repr.cdb.first() {
            counters.scsi_ops.count(op);
        }
        if let Some(data) = immediate {
            Counters::add(&counters.bytes_immediate, data.len() as u64);
        }
        // The receive slot takes the next IU at once.
        if let Some(sge) = io
            .recv_mr
            .sge(u64::from(slot) * io.req_size as u64, io.req_size as u32)
        {
            if let Ok(mut batch) = io.qp.begin_recv(irql) {
                if batch.recv(&[sge], WrCtx::Recv(slot)).is_ok() {
                    batch.commit();
                }
            }
        }
        // The response.
        let good = response.status == Status::GOOD;
        let solicited = if good {
            repr.sol_not.contains(SolNot::SUCCESSFUL)
        } else {
            repr.sol_not.contains(SolNot::UNSUCCESSFUL)
        };
        let max_rsp = io.rsp_size.min(io.neg.max_ti_iu_len as usize);
        let sense = response.sense_bytes();
        let sense = sense.as_ref().map(|s| {
            let keep = s.len().min(max_rsp.saturating_sub(srp::rsp::LEN));
            s.get(..keep).unwrap_or(&[])
        });
        let delta = 1 + credits.take_pending();
        credits.grant(delta, counters);
        let repr_rsp = RspRepr {
            solicited,
            req_lim_delta: delta,
            tag: repr.tag,
            status: response.status.0,
            data_out_residual: response.data_out_residual,
            data_in_residual: response.data_in_residual,
            response_data: None,
            sense,
        };
        let send_slot = io.slot_base + u32::from(lane_slot);
        let rsp_len = write_response(&io.send_mr, io.rsp_size, send_slot, &repr_rsp);
        Counters::add(&counters.responses_sent, 1);
        // Data-in WRITEs, then the SEND, in one batch.
        let mut posted = 0u32;
        let ok = (|| -> Option<()> {
            let mut batch = io.qp.begin_send(irql).ok()?;
            let extents = &io.slots.get(usize::from(lane_slot))?.extents;
            let mut out = DataInWrites {
                batch: &mut batch,
                failed: false,
                posted: 0,
                counters,
            };
            if store_key.is_some() {
                let complete = for_each_gather_piece(
                    descs,
                    extents,
                    response.data_in_len,
                    io.max_rdma,
                    |remote_addr, rkey, len, lkey, local| {
                        let sge = kverbs::wr::Sge {
                            addr: local,
                            len,
                            lkey,
                        };
                        out.write(remote_addr, rkey, sge);
                    },
                );
                if out.failed || !complete {
                    return None;
                }
                Counters::add(&counters.zero_copy_reads, 1);
            }
            if let Some(mr) = staging {
                let (lkey, base) = (mr.lkey(), mr.iova());
                for_each_piece(
                    descs,
                    response.data_in_len,
                    io.max_rdma,
                    |remote_addr, rkey, local_off, len| {
                        let sge = kverbs::wr::Sge {
                            addr: base + u64::from(local_off),
                            len,
                            lkey,
                        };
                        out.write(remote_addr, rkey, sge);
                    },
                );
                if out.failed {
                    return None;
                }
            }
            posted = out.posted;
            let sge = io
                .send_mr
                .sge(u64::from(send_slot) * io.rsp_size as u64, rsp_len)?;
            let sges = [sge];
            let mut wr = SendWr::new(Payload::Sges(&sges));
            wr.flags.solicited = solicited;
            batch
                .send(
                    &wr,
                    Signal::Signalled(WrCtx::Send {
                        slot: send_slot,
                        what: SendWhat::Served,
                    }),
                )
                .ok()?;
            batch.commit();
            Some(())
        })();
        if ok.is_none() {
            // Dropping the batch posted nothing: give everything back.
            if let Some(entry) = io.slots.get_mut(usize::from(lane_slot)) {
                entry.extents.clear();
            }
            io.free_slots.push(lane_slot);
            if let Some(b) = buf {
                io.free_bufs.push(b);
            }
            return Some(false);
        }
        let first = descs.iter().copied().find(|d| d.len > 0);
        if let Some(entry) = io.slots.get_mut(usize::from(lane_slot)) {
            entry.buf = buf;
            entry.wrs = posted + 1;
            entry.tag = repr.tag;
            entry.first = first;
        }
        self.wrs += posted + 1;
        credits.lane_inflight.fetch_add(1, Ordering::AcqRel);
        Counters::add(&counters.ius_served_in_dpc, 1);
        Some(true)
    }
}

/// How many work requests `for_each_piece` makes of `bytes` bytes.
fn piece_count(descs: &[DirectDesc], bytes: u32, max: u32) -> u32 {
    let mut n = 0u32;
    for_each_piece(descs, bytes, max, |_, _, _, _| n += 1);
    n
}

/// Where a served READ's data-in WRITEs go: the batch they join, and what
/// the lane keeps count of. Once a post fails nothing more is posted, and
/// the command falls back whole.
struct DataInWrites<'b, 'q> {
    batch: &'b mut kverbs::qp::SendBatch<'q, Hp, WrCtx>,
    /// A post failed: nothing more is posted.
    failed: bool,
    /// WRITEs posted so far.
    posted: u32,
    counters: &'b Counters,
}

impl DataInWrites<'_, '_> {
    /// Posts `sge` as one unsignalled RDMA WRITE to `remote_addr`/`rkey`.
    ///
    /// # IRQL
    /// DISPATCH_LEVEL (the CQ's DPC); never blocks, never allocates.
    fn write(&mut self, remote_addr: u64, rkey: u32, sge: kverbs::wr::Sge) {
        let wr = WriteWr {
            payload: Payload::Sges(&[sge]),
            remote_addr,
            rkey,
            imm: None,
            flags: SendFlags::default(),
        };
        if self.failed || self.batch.rdma_write(&wr, Signal::Unsignalled).is_err() {
            self.failed = true;
            return;
        }
        self.posted += 1;
        Counters::add(&self.counters.rdma_writes, 1);
        Counters::add(&self.counters.bytes_data_in, u64::from(sge.len));
    }
}

#[cfg(test)]
mod tests {
    use super::super::staging::pieces;
    use super::*;

    #[test]
    fn the_piece_count_matches_the_thread_s_cut() {
        let d = |va, rkey, len| DirectDesc { va, rkey, len };
        let descs = [
            d(0x1000, 7, 10_000),
            d(0x9000_0000, 8, 0),
            d(0x5000, 9, 3000),
        ];
        for bytes in [0u32, 1, 4095, 4096, 4097, 13_000, 20_000] {
            for max in [512u32, 4096, 65536] {
                let mut got = Vec::new();
                for_each_piece(&descs, bytes, max, |a, r, o, l| got.push((a, r, o, l)));
                let want = pieces(&descs, bytes, max);
                assert_eq!(got.len(), want.len(), "{bytes} bytes, max {max}");
                assert_eq!(piece_count(&descs, bytes, max) as usize, want.len());
            }
        }
    }

    #[test]
    fn the_plan_leaves_room_for_every_command_s_writes() {
        let mut config = SrpTargetConfig {
            max_rdma_size: 4096,
            ..SrpTargetConfig::default()
        };
        let plan = LanePlan::for_config(&config);
        assert_eq!(plan.slots, LANE_SLOTS);
        // 256 KiB from the store in 4 KiB WRITEs, one more per descriptor
        // and per extent, and the SEND.
        assert_eq!(plan.wr_budget, LANE_SLOTS * (64 + 16 + 8 + 1));
        config.rq_size = 4;
        assert_eq!(LanePlan::for_config(&config).slots, 4);
    }
}
