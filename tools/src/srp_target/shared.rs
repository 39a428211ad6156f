//! What a channel shares with the code that calls into it at
//! `DISPATCH_LEVEL` (its CQ, its QP, the CM) and with the rest of the
//! target: a mailbox those callbacks fill without allocating, the event
//! that wakes the channel thread, and the requests the target sends it.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use hca_lowlevel::device::AsyncEvent;
use kverbs::cm::{CmEvent, CmHandler, CmId};
use kverbs::cq::CqHandler;
use kverbs::irql::{Dispatch, LeDispatch};
use kverbs::platform::host::{HostEvent, HostPlatform};
use kverbs::platform::{EventKind, RawEvent};
use kverbs::qp::QpHandler;
use kverbs::sync::SpinLock;
use kverbs::wr::Completion;
use storport_srp::scsi::SenseRepr;
use storport_srp::wire::srp::PortId;
use storport_srp::wire::srp::rsp::{Rsp, RspRepr};

use kverbs::mr::Mr;

use super::lane::{Credits, Lane, LaneOutcome};
use crate::scsi_target::{BlockStore, DataInSink, Extent};

/// A command's place in its channel's table: slot and generation (a
/// completion for a command that is gone names a dead generation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CmdRef {
    pub(crate) slot: u32,
    pub(crate) generation: u32,
}

/// What a send-queue IU is, for its completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SendWhat {
    /// A command's `SRP_RSP`.
    Response(CmdRef),
    /// A task management response or a target request.
    Plain,
    /// `SRP_T_LOGOUT`: disconnect once delivered.
    TLogout,
    /// A command's `SRP_RSP` the DPC lane posted (from a lane send slot;
    /// the lane accounts for it).
    Served,
}

/// The context of every work request a channel posts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WrCtx {
    /// Receive slot.
    Recv(u32),
    /// A SEND from send slot `slot`.
    Send {
        /// The slot.
        slot: u32,
        /// What it carries.
        what: SendWhat,
    },
    /// An RDMA READ of a command's data-out.
    Read(CmdRef),
    /// The signalled RDMA WRITE of a command's data-in.
    Write(CmdRef),
    /// The zero-length RDMA WRITE after the connection came up.
    ZeroLength,
    /// A hostile attempt (index in the target's report list).
    Hostile(usize),
}

/// How a connection ended, as the CM said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Terminal {
    Disconnected,
    Rejected,
    Unreachable,
}

/// What the `DISPATCH_LEVEL` callbacks leave for the channel thread.
#[derive(Debug)]
pub(crate) enum Note {
    Wc(Completion<WrCtx>),
    Established,
    Terminal(Terminal),
    QpDestroyed,
    CqDestroyed,
    QpEvent(AsyncEvent),
    /// The DPC lane could not post a command's answer (the QP refused).
    LanePostFailed,
    /// The DPC lane finished a command while the thread waits for it.
    LaneIdle,
}

/// Why a channel is asked to disconnect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DisconnectWhy {
    /// The target is stopping.
    Stop,
    /// A SINGLE login of the same I_T nexus.
    Relogin,
}

/// What the target asks of a channel (at `PASSIVE_LEVEL`).
#[derive(Debug, Clone)]
pub(crate) enum Request {
    Disconnect(DisconnectWhy),
    /// The accept failed: no CM event will come; tear down.
    Abandon,
    CredReq {
        delta: i32,
    },
    AerReq {
        lun: u16,
        sense: SenseRepr,
        delta: i32,
    },
    TLogout {
        reason: u32,
    },
}

/// The channel's phase, as others may read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
#[repr(u8)]
pub enum ChannelState {
    /// Accepted; waiting for the connection to come up.
    Connecting = 0,
    /// Up: the zero-length RDMA WRITE completed.
    Live = 1,
    /// Going down.
    Closing = 2,
    /// Gone: every object destroyed.
    Closed = 3,
}

/// The shared half of a channel.
pub(crate) struct ChannelShared {
    pub(crate) id: u32,
    pub(crate) cm_id: CmId,
    pub(crate) nexus: (PortId, PortId),
    mailbox: SpinLock<VecDeque<Note>, HostPlatform>,
    /// The DPC lane and the state it shares with the thread (credits,
    /// delivered buffers).
    pub(crate) lane: SpinLock<Lane, HostPlatform>,
    /// The credit account, shared by the thread and the lane.
    pub(crate) credits: Credits,
    /// Notes that found the mailbox full (a sizing bug: the channel fails).
    pub(crate) lost: AtomicU64,
    wake: HostEvent,
    requests: Mutex<VecDeque<Request>>,
    state: std::sync::atomic::AtomicU8,
    /// The thread has released everything and is about to return.
    pub(crate) finished: AtomicBool,
}

impl ChannelShared {
    pub(crate) fn new(
        id: u32,
        cm_id: CmId,
        nexus: (PortId, PortId),
        capacity: usize,
        initial_credits: u32,
    ) -> Self {
        Self {
            id,
            cm_id,
            nexus,
            mailbox: SpinLock::new(VecDeque::with_capacity(capacity)),
            lane: SpinLock::new(Lane::new()),
            credits: Credits::new(initial_credits),
            lost: AtomicU64::new(0),
            wake: HostEvent::new(EventKind::Synchronization, false),
            requests: Mutex::new(VecDeque::new()),
            state: std::sync::atomic::AtomicU8::new(ChannelState::Connecting as u8),
            finished: AtomicBool::new(false),
        }
    }

    /// Leaves a note (never allocates: the mailbox is sized for every
    /// completion the CQ can hold plus the CM and object events).
    fn post(&self, note: Note, irql: &impl LeDispatch) {
        {
            let mut mailbox = self.mailbox.lock(irql);
            if mailbox.len() < mailbox.capacity() {
                mailbox.push_back(note);
            } else {
                self.lost.fetch_add(1, Ordering::AcqRel);
            }
        }
        self.wake.set(irql);
    }

    /// Takes every note.
    pub(crate) fn take_notes(&self, irql: &impl LeDispatch, into: &mut Vec<Note>) {
        let mut mailbox = self.mailbox.lock(irql);
        // `into` keeps its capacity between calls; it grows (at
        // PASSIVE_LEVEL, outside the lock) only if needed.
        let n = mailbox.len();
        if into.capacity() - into.len() < n {
            drop(mailbox);
            into.reserve(n + 64);
            mailbox = self.mailbox.lock(irql);
        }
        while into.len() < into.capacity() {
            match mailbox.pop_front() {
                Some(note) => into.push(note),
                None => break,
            }
        }
    }

    /// Queues a request and wakes the thread.
    pub(crate) fn request(&self, request: Request, irql: &kverbs::irql::Passive<'_>) {
        self.requests
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push_back(request);
        self.wake.set(irql);
    }

    pub(crate) fn take_request(&self) -> Option<Request> {
        self.requests
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop_front()
    }

    /// Sleeps until woken or `timeout`.
    pub(crate) fn wait(&self, timeout: std::time::Duration, irql: &kverbs::irql::Passive<'_>) {
        let _ = self.wake.wait_timeout(timeout, irql);
    }

    pub(crate) fn state(&self) -> ChannelState {
        match self.state.load(Ordering::Acquire) {
            0 => ChannelState::Connecting,
            1 => ChannelState::Live,
            2 => ChannelState::Closing,
            _ => ChannelState::Closed,
        }
    }

    pub(crate) fn set_state(&self, state: ChannelState) {
        self.state.store(state as u8, Ordering::Release);
    }
}

impl CqHandler<WrCtx> for ChannelShared {
    fn on_completion(&self, completion: Completion<WrCtx>, irql: &Dispatch<'_>) {
        // The lane serves what it can here; the rest wakes the thread.
        let outcome =
            self.lane
                .lock_at_dpc_level(irql)
                .on_completion(completion, &self.credits, irql);
        match outcome {
            LaneOutcome::Done => {}
            LaneOutcome::Wake => self.post(Note::LaneIdle, irql),
            LaneOutcome::Forward(c) => self.post(Note::Wc(c), irql),
            LaneOutcome::PostFailed => self.post(Note::LanePostFailed, irql),
        }
    }

    fn on_destroyed(&self, irql: &Dispatch<'_>) {
        self.post(Note::CqDestroyed, irql);
    }
}

impl QpHandler for ChannelShared {
    fn on_async_event(&self, event: AsyncEvent, irql: &Dispatch<'_>) {
        self.post(Note::QpEvent(event), irql);
    }

    fn on_destroyed(&self, irql: &Dispatch<'_>) {
        self.post(Note::QpDestroyed, irql);
    }
}

impl CmHandler for ChannelShared {
    fn on_event(&self, _id: CmId, event: CmEvent<'_>, irql: &Dispatch<'_>) {
        let note = match event {
            CmEvent::Established { .. } => Note::Established,
            CmEvent::Disconnected { .. } => Note::Terminal(Terminal::Disconnected),
            CmEvent::Rejected { .. } => Note::Terminal(Terminal::Rejected),
            CmEvent::Unreachable { .. } => Note::Terminal(Terminal::Unreachable),
        };
        self.post(note, irql);
    }
}

/// Emits `repr` into send slot `slot` of `send_mr` (slots of `rsp_size`
/// bytes); the bytes written (the response cut to the slot, whose sense
/// the caller already cut to fit), 0 if nothing could be written.
pub(crate) fn write_response(
    send_mr: &Mr<HostPlatform>,
    rsp_size: usize,
    slot: u32,
    repr: &RspRepr<'_>,
) -> u32 {
    let mut buf = [0u8; super::config::MAX_MAX_RSP_SIZE as usize];
    let len = repr.buffer_len().min(rsp_size).min(buf.len());
    let Some(iu) = buf.get_mut(..len) else {
        return 0;
    };
    let _ = repr.emit(&mut Rsp::new_unchecked(&mut *iu));
    let _ = send_mr.mem().write(slot as usize * rsp_size, iu);
    len as u32
}

/// Where an `SRP_CMD`'s data-in goes, on the thread and in the lane: built
/// answers into the command's staging buffer, and — when the target's
/// stores are registered (`store_key`) — READ data as extents of the
/// store's own chunks, pinned, for the RDMA WRITEs to gather from.
pub(crate) struct SrpSink<'a> {
    /// The staging buffer, if the command has one.
    pub(crate) staging: Option<&'a Mr<HostPlatform>>,
    /// Bytes written into it so far.
    pub(crate) written: usize,
    /// Take store data as extents under this registration key.
    pub(crate) store_key: Option<u64>,
    /// The extents taken (never grown past `max_extents`).
    pub(crate) extents: &'a mut Vec<Extent>,
    /// Most extents (the lane's vector has this capacity, so it never
    /// allocates).
    pub(crate) max_extents: usize,
}

impl DataInSink for SrpSink<'_> {
    fn bytes(&mut self, piece: &[u8]) {
        if let Some(mr) = self.staging {
            let _ = mr.mem().write(self.written, piece);
        }
        self.written += piece.len();
    }

    fn store_range(
        &mut self,
        store: &BlockStore,
        offset: u64,
        len: u64,
        nonblocking: bool,
    ) -> bool {
        let Some(key) = self.store_key else {
            let mut sink = |piece: &[u8]| self.bytes(piece);
            if nonblocking {
                return store.try_read(offset, len, &mut sink);
            }
            store.read(offset, len, &mut sink);
            return true;
        };
        let before = self.extents.len();
        let max = self.max_extents;
        let extents = &mut *self.extents;
        let taken = store.read_extents(key, offset, len, nonblocking, &mut |extent| {
            if extents.len() >= max {
                return false;
            }
            extents.push(extent);
            true
        });
        if taken.is_err() {
            // Dropping them unpins the chunks.
            self.extents.truncate(before);
            return false;
        }
        true
    }
}
