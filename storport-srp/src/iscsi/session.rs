//! The initiator's full feature phase on one connection (ERL 0, no MC/S),
//! as a sans-IO state machine.
//!
//! # Tasks and tags
//! A fixed table, allocated once at PASSIVE_LEVEL, holds every task the
//! session has outstanding: SCSI commands (`cmds_max`), task management
//! functions, the keepalive ping, the logout and a text exchange. An ITT
//! is `generation << 16 | slot`: allocation and lookup are O(1) (a free
//! list and an index), and a late or forged ITT for a reused slot is
//! recognised by its generation. The slot part stays below `0xffff`, so no
//! ITT is ever the reserved `0xffffffff`.
//!
//! # The command window is the flow control
//! A non-immediate command may be sent only with a CmdSN in
//! `ExpCmdSN..=MaxCmdSN` (RFC 7143 §3.2.2.1, serial arithmetic). Sending
//! takes two steps, as the miniport core's `Transport` does:
//! [`Session::prepare_command`] *reserves* a place in the window and a
//! task slot and builds the PDU; [`Session::post_command`] assigns the
//! CmdSN (and the current ExpStatSN) at the moment of sending, so a
//! discarded command never leaves a hole in the CmdSN sequence. No place
//! or no slot: [`PrepareError::Busy`], and [`SessionEvents::window_open`]
//! as soon as a response opens the window again. A window that stays
//! closed for `window_timeout` after a refusal fails the session: never
//! busy forever.
//!
//! # What the target may do
//! Every PDU from the target updates ExpCmdSN/MaxCmdSN (ignored when
//! MaxCmdSN < ExpCmdSN - 1) and is checked: a status-carrying PDU must
//! carry a StatSN within the statuses the session can have outstanding
//! (targets may send responses out of StatSN order; ExpStatSN stays at the
//! oldest one missing, see [`stat_sn`](super::stat_sn)), its ITT must name
//! a task of the right kind, its data segment
//! must fit the negotiated `InitiatorRecvDataSegmentLength`. A breach is a
//! [`SessionFailure`]; the engine then drops the connection, fences the
//! buffers (flush), calls [`Session::terminate_all`] and lets
//! [`recovery`](super::recovery) reinstate the session.
//!
//! Target NOP-In pings (TTT ≠ `0xffffffff`) are answered with a NOP-Out
//! carrying the TTT and LUN (no data: `isert` does not support NOP-Out
//! data). The initiator pings an idle connection every
//! `noop_out_interval` and fails the session when nothing comes back
//! within `noop_out_timeout`. Asynchronous Messages: a logout request
//! blocks new commands, lets outstanding ones finish, and logs out within
//! half of Parameter3 seconds at the latest; a connection drop announcement
//! fails the session with the target's Time2Wait; a renegotiation request
//! is answered with an empty Text Request (and a logout if the target then
//! proposes keys).
//!
//! # Completions
//! [`SessionEvents::command_done`] is called once per posted command with
//! the slot already released (the core may reuse the tag inside the
//! upcall). Under iSER the engine still has to fence the command's memory
//! region before it hands the result to the core.

use alloc::boxed::Box;
use alloc::vec::Vec;
use core::fmt;

use heapless::Deque;
use kverbs::irql::Passive;
use kverbs::platform::AllocError;

use super::description::Timeouts;
use super::login::Negotiated;
use super::stat_sn::{Arrival, StatSnTracker};
use super::{Millis, earliest};
use crate::miniport::transport::{
    CommandOutcome, CommandResult, FailureKind, ImmediateData, PrepareError, Residual, Tag,
    TmfRefused, TmfResponse,
};
use crate::storport::{DataDirection, QueueAction};
use crate::wire::iscsi::scsi::response as scsi_response;
use crate::wire::iscsi::{
    AHS_EXTENDED_CDB, AsyncEvent, BHS_LEN, BhsRepr, DataOutRepr, IscsiPdu, LogoutReason,
    LogoutRequestRepr, NopOutRepr, Opcode, Padding, RESERVED_TAG, RejectReason, RejectRepr,
    ScsiCommandRepr, SenseData, SerialNumber, TaskAttr, TaskMgmtFunction, TaskMgmtRequestRepr,
    TaskMgmtResponseCode, TextRequestRepr, command_window,
};
use crate::wire::{Lun, Residual as WireResidual};

/// Task management functions outstanding at once.
pub const TMF_SLOTS: u16 = 4;
/// Slots beyond commands and TMFs: the ping, the logout, a text exchange.
const CONTROL_SLOTS: u16 = 3;
/// Control PDUs queued for sending at once.
pub const CONTROL_QUEUE: usize = 16;
/// Longest CDB (the extended-CDB AHS carries up to 260 bytes in all).
pub const MAX_CDB_LEN: usize = 260;
/// Offset of CmdSN in a SCSI Command BHS.
const CMD_SN_OFFSET: usize = 24;
/// Offset of ExpStatSN in a SCSI Command BHS.
const EXP_STAT_SN_OFFSET: usize = 28;

/// The upcalls a session makes.
pub trait SessionEvents {
    /// A posted command ended (exactly once per post). The task slot is
    /// already free.
    fn command_done(&mut self, tag: Tag, result: &CommandResult<'_>);
    /// A task management function ended (exactly once per accepted TMF).
    fn tmf_done(&mut self, tag: Tag, response: TmfResponse);
    /// After a refused `prepare_command` (busy), the window or the task
    /// table has room again.
    fn window_open(&mut self);
}

/// Why the session cannot go on: the engine drops the connection and
/// recovery reinstates the session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SessionFailure {
    /// The target broke the protocol (the detail names how).
    Protocol(Violation),
    /// A keepalive NOP-Out got no answer in time.
    PingTimeout,
    /// The command window stayed closed past `window_timeout`.
    WindowStalled,
    /// A task management function got no answer in time.
    TmfTimeout,
    /// The logout got no answer in time.
    LogoutTimeout,
    /// The target announced it drops the connection (Async Message 2 or
    /// 3); reconnect after Time2Wait seconds.
    TargetDropping {
        /// Seconds to wait before reconnecting.
        time2wait: u16,
    },
    /// More control PDUs to send than the queue holds (a flood of target
    /// pings).
    ControlOverflow,
}

/// A protocol breach by the target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Violation {
    /// Not a parseable iSCSI PDU.
    Malformed,
    /// A PDU the target must not send under iSER in this phase (Data-In,
    /// R2T, Login Response, an initiator opcode...).
    UnexpectedOpcode(u8),
    /// An ITT naming no outstanding task of the PDU's kind.
    UnknownItt(u32),
    /// A StatSN further from ExpStatSN, behind or ahead, than the session
    /// can have statuses outstanding.
    StatSn {
        /// Expected.
        expected: u32,
        /// Received.
        received: u32,
    },
    /// A data segment longer than `InitiatorRecvDataSegmentLength`.
    DataSegmentTooLong,
    /// A Reject of the kind "protocol error" for a PDU that is not a task.
    Rejected(u8),
    /// A NOP-In answering our ping with a TTT other than `0xffffffff`.
    NopInTtt,
}

/// Where the session is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SessionState {
    /// Full feature phase.
    Running,
    /// The target asked for a logout: no new commands; the logout goes out
    /// when outstanding commands are done or at the deadline.
    LogoutRequested,
    /// The Logout Request is queued or sent.
    LoggingOut,
    /// Logged out: the session is over; the target asks for `time2wait`
    /// seconds before a new login.
    LoggedOut {
        /// Seconds to wait before logging in again.
        time2wait: u16,
    },
}

/// One SCSI command to send.
#[derive(Debug, Clone, Copy)]
pub struct CommandSpec<'a> {
    /// The core's tag.
    pub tag: Tag,
    /// The LUN.
    pub lun: Lun,
    /// The CDB, 1 to 260 bytes (beyond 16 it travels in an AHS).
    pub cdb: &'a [u8],
    /// `In` (R), `Out` (W) or `None`.
    pub direction: DataDirection,
    /// Expected data transfer length.
    pub transfer_length: u32,
    /// Task attribute.
    pub attr: TaskAttr,
    /// Immediate delivery (I bit): outside the window, CmdSN not
    /// advanced.
    pub immediate_delivery: bool,
}

/// A built, unsent command. It holds a task slot and (unless immediate) a
/// place in the command window until [`Session::post_command`] or
/// [`Session::discard_command`].
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a prepared command holds a slot and a window place until posted or discarded"]
pub struct PreparedCommand {
    slot: u16,
    itt: u32,
    header_len: usize,
    pdu_len: usize,
    immediate_len: u32,
    unsolicited_len: u32,
    immediate_delivery: bool,
}

impl PreparedCommand {
    /// The ITT.
    #[must_use]
    pub const fn itt(&self) -> u32 {
        self.itt
    }

    /// Bytes of the SCSI Command PDU: its header (BHS and AHS) and the
    /// immediate data behind it.
    #[must_use]
    pub const fn pdu_len(&self) -> usize {
        self.pdu_len
    }

    /// Bytes of the PDU's header (BHS and AHS): what
    /// [`Session::prepare_command_header`] writes.
    #[must_use]
    pub const fn header_len(&self) -> usize {
        self.header_len
    }

    /// Write data sent inside the command PDU.
    #[must_use]
    pub const fn immediate_len(&self) -> u32 {
        self.immediate_len
    }

    /// Write data the initiator sends itself (immediate plus unsolicited
    /// Data-Out PDUs); the target fetches the rest by RDMA READ, from this
    /// offset of the buffer on (`isert` adds no offset itself: the iSER
    /// header's write VA must point here).
    #[must_use]
    pub const fn unsolicited_len(&self) -> u32 {
        self.unsolicited_len
    }
}

/// What posting assigned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PostedCommand {
    /// The ITT.
    pub itt: u32,
    /// The CmdSN the command carries.
    pub cmd_sn: SerialNumber,
}

/// [`Session::post_command`] could not send: nothing was sent, the slot
/// and window place are released, no completion will come.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PostError {
    /// The session stopped taking commands (logout) since the prepare.
    NotRunning,
    /// The buffer does not hold the prepared SCSI Command PDU.
    BadBuffer,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TaskKind {
    Free,
    /// Prepared (not posted) or posted command.
    Command {
        tag: Tag,
        lun: Lun,
        cmd_sn: Option<SerialNumber>,
    },
    Tmf {
        tag: Tag,
        function: TaskMgmtFunction,
        lun: Lun,
        /// ABORT TASK: the victim's slot and ITT.
        victim: Option<(u16, u32)>,
        cmd_sn: SerialNumber,
        deadline: Millis,
    },
    Ping,
    Logout,
    Text,
}

#[derive(Debug, Clone, Copy)]
struct Task {
    kind: TaskKind,
    generation: u16,
    next_free: u16,
}

const NO_SLOT: u16 = u16::MAX;

/// A control PDU waiting to be sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Control {
    /// Answer to a target ping.
    NopReply {
        ttt: u32,
        lun: Lun,
    },
    /// Our keepalive.
    Ping {
        itt: u32,
    },
    Tmf {
        slot: u16,
    },
    Logout {
        itt: u32,
    },
    Text {
        itt: u32,
    },
}

/// One session's full feature phase.
pub struct Session {
    neg: Negotiated,
    timeouts: Timeouts,
    cid: u16,
    cmds_max: u16,
    tasks: Box<[Task]>,
    free_head: u16,
    commands_outstanding: u16,
    tmfs_outstanding: u16,
    cmd_sn: SerialNumber,
    exp_cmd_sn: SerialNumber,
    max_cmd_sn: SerialNumber,
    reserved: u32,
    stat_sn: StatSnTracker,
    statuses_out_of_order: u32,
    busy_reported: bool,
    window_stall_since: Option<Millis>,
    control: Deque<Control, CONTROL_QUEUE>,
    last_rx: Millis,
    last_tx: Millis,
    ping: Option<(u32, Millis)>,
    /// The target's pings (NOP-In asking for a reply) answered so far.
    pings_answered: u64,
    state: SessionState,
    logout_deadline: Option<Millis>,
    logout_sent: bool,
    text_pending: bool,
}

impl fmt::Debug for Session {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Session")
            .field("state", &self.state)
            .field("cmd_sn", &self.cmd_sn)
            .field("exp_cmd_sn", &self.exp_cmd_sn)
            .field("max_cmd_sn", &self.max_cmd_sn)
            .field("exp_stat_sn", &self.stat_sn.expected())
            .field("commands_outstanding", &self.commands_outstanding)
            .finish_non_exhaustive()
    }
}

fn violation(v: Violation) -> SessionFailure {
    SessionFailure::Protocol(v)
}

fn map_residual(r: WireResidual) -> Residual {
    match r {
        WireResidual::None => Residual::None,
        WireResidual::Overflow(n) => Residual::Overrun(n),
        WireResidual::Underflow(n) => Residual::Underrun(n),
    }
}

fn map_tmf_response(code: TaskMgmtResponseCode) -> TmfResponse {
    match code {
        TaskMgmtResponseCode::Complete => TmfResponse::Complete,
        TaskMgmtResponseCode::NoSuchTask => TmfResponse::TaskNotFound,
        TaskMgmtResponseCode::NoSuchLun => TmfResponse::IncorrectLun,
        TaskMgmtResponseCode::NotSupported => TmfResponse::NotSupported,
        _ => TmfResponse::Failed,
    }
}

/// The iSCSI task attribute for a StorPort queue action.
#[must_use]
pub const fn task_attr(action: QueueAction) -> TaskAttr {
    match action {
        QueueAction::Simple => TaskAttr::Simple,
        QueueAction::HeadOfQueue => TaskAttr::HeadOfQueue,
        QueueAction::Ordered => TaskAttr::Ordered,
    }
}

/// The unsolicited data rules (RFC 7143 §3.2.4.2): how many bytes of a
/// write go inside the command PDU, and how many the initiator sends in
/// all before the target asks (immediate plus Data-Out PDUs).
#[must_use]
pub fn unsolicited_split(neg: &Negotiated, write_len: u32) -> (u32, u32) {
    let first_burst = write_len.min(neg.first_burst_length);
    let immediate = if neg.immediate_data {
        first_burst.min(neg.max_send_data_segment)
    } else {
        0
    };
    let unsolicited = if neg.initial_r2t {
        immediate
    } else {
        first_burst
    };
    (immediate, unsolicited)
}

impl Session {
    /// A session in full feature phase after a login that produced `neg`,
    /// with a task table for `cmds_max` commands.
    ///
    /// # Errors
    ///
    /// [`AllocError`]: the table could not be allocated.
    ///
    /// # IRQL
    ///
    /// PASSIVE_LEVEL (allocates).
    pub fn new(
        neg: &Negotiated,
        timeouts: &Timeouts,
        cmds_max: u16,
        cid: u16,
        now: Millis,
        _irql: &Passive<'_>,
    ) -> Result<Self, AllocError> {
        let cmds_max = cmds_max.clamp(1, super::description::MAX_CMDS);
        let slots = cmds_max + TMF_SLOTS + CONTROL_SLOTS;
        let mut tasks = Vec::new();
        tasks
            .try_reserve_exact(usize::from(slots))
            .map_err(|_| AllocError)?;
        for i in 0..slots {
            tasks.push(Task {
                kind: TaskKind::Free,
                generation: 0,
                next_free: if i + 1 < slots { i + 1 } else { NO_SLOT },
            });
        }
        // Statuses outstanding: one per task at most, plus the target's
        // Async Messages; twice the table is ample.
        let stat_sn = StatSnTracker::new(neg.exp_stat_sn, u32::from(slots).saturating_mul(2))
            .map_err(|_| AllocError)?;
        Ok(Self {
            neg: *neg,
            timeouts: *timeouts,
            cid,
            cmds_max,
            tasks: tasks.into_boxed_slice(),
            free_head: 0,
            commands_outstanding: 0,
            tmfs_outstanding: 0,
            cmd_sn: neg.cmd_sn,
            exp_cmd_sn: neg.exp_cmd_sn,
            max_cmd_sn: neg.max_cmd_sn,
            reserved: 0,
            stat_sn,
            statuses_out_of_order: 0,
            busy_reported: false,
            window_stall_since: None,
            control: Deque::new(),
            last_rx: now,
            last_tx: now,
            ping: None,
            pings_answered: 0,
            state: SessionState::Running,
            logout_deadline: None,
            logout_sent: false,
            text_pending: false,
        })
    }

    /// The negotiated parameters.
    #[must_use]
    pub const fn negotiated(&self) -> &Negotiated {
        &self.neg
    }

    /// The state.
    #[must_use]
    pub const fn state(&self) -> SessionState {
        self.state
    }

    /// The next CmdSN to assign.
    #[must_use]
    pub const fn cmd_sn(&self) -> SerialNumber {
        self.cmd_sn
    }

    /// ExpCmdSN and MaxCmdSN as last accepted.
    #[must_use]
    pub const fn window(&self) -> (SerialNumber, SerialNumber) {
        (self.exp_cmd_sn, self.max_cmd_sn)
    }

    /// The StatSN expected next.
    #[must_use]
    pub const fn exp_stat_sn(&self) -> SerialNumber {
        self.stat_sn.expected()
    }

    /// Statuses that arrived ahead of an older one or repeated a number
    /// (wrapping count): how often the target's responses crossed on the
    /// wire.
    #[must_use]
    pub const fn statuses_out_of_order(&self) -> u32 {
        self.statuses_out_of_order
    }

    /// Commands prepared or posted and not yet completed.
    #[must_use]
    pub const fn commands_outstanding(&self) -> u16 {
        self.commands_outstanding
    }

    /// Places left in the command window for new commands.
    #[must_use]
    pub fn window_room(&self) -> u32 {
        command_window(self.cmd_sn, self.max_cmd_sn)
            .unwrap_or(0)
            .saturating_sub(self.reserved)
    }

    // ---- task table -------------------------------------------------

    fn alloc_slot(&mut self, kind: TaskKind) -> Option<(u16, u32)> {
        let slot = self.free_head;
        let task = self.tasks.get_mut(usize::from(slot))?;
        self.free_head = task.next_free;
        task.kind = kind;
        task.next_free = NO_SLOT;
        let itt = (u32::from(task.generation) << 16) | u32::from(slot);
        Some((slot, itt))
    }

    fn free_slot(&mut self, slot: u16) {
        if let Some(task) = self.tasks.get_mut(usize::from(slot)) {
            task.kind = TaskKind::Free;
            task.generation = task.generation.wrapping_add(1);
            task.next_free = self.free_head;
            self.free_head = slot;
        }
    }

    /// The slot an ITT names, if its generation is current.
    fn lookup(&self, itt: u32) -> Option<(u16, TaskKind)> {
        if itt == RESERVED_TAG {
            return None;
        }
        // The low half is the slot, the high half the generation.
        let slot = (itt & 0xFFFF) as u16;
        let generation = (itt >> 16) as u16;
        let task = self.tasks.get(usize::from(slot))?;
        if task.generation != generation || task.kind == TaskKind::Free {
            return None;
        }
        Some((slot, task.kind))
    }

    fn itt_of(&self, slot: u16) -> u32 {
        let generation = self
            .tasks
            .get(usize::from(slot))
            .map_or(0, |t| t.generation);
        (u32::from(generation) << 16) | u32::from(slot)
    }

    fn push_control(&mut self, c: Control) -> Result<(), SessionFailure> {
        self.control
            .push_back(c)
            .map_err(|_| SessionFailure::ControlOverflow)
    }

    // ---- commands ---------------------------------------------------

    /// Builds the SCSI Command PDU of `cmd` into `buf` (BHS, an
    /// extended-CDB AHS if the CDB is longer than 16 bytes, then the
    /// immediate data read through `data`), reserving a task slot and a
    /// window place.
    ///
    /// # Errors
    ///
    /// [`PrepareError::Busy`] (window closed or table full; a
    /// [`SessionEvents::window_open`] follows), [`PrepareError::Blocked`]
    /// (logout pending), [`PrepareError::Failed`] with
    /// [`FailureKind::Unsupported`] (CDB length, direction, buffer).
    ///
    /// # IRQL
    ///
    /// <= DISPATCH_LEVEL; never blocks, never allocates.
    pub fn prepare_command(
        &mut self,
        now: Millis,
        cmd: &CommandSpec<'_>,
        data: &dyn ImmediateData,
        buf: &mut [u8],
    ) -> Result<PreparedCommand, PrepareError> {
        self.prepare(now, cmd, Some(data), buf)
    }

    /// As [`Session::prepare_command`], but writes only the PDU's header
    /// ([`PreparedCommand::header_len`] bytes; its DataSegmentLength already
    /// counts the immediate data): the caller sends the first
    /// [`PreparedCommand::immediate_len`] bytes of the data buffer right
    /// behind it, for example gathered by the HCA from the request's own
    /// buffer.
    ///
    /// # Errors
    ///
    /// As [`Session::prepare_command`].
    ///
    /// # IRQL
    ///
    /// <= DISPATCH_LEVEL; never blocks, never allocates.
    pub fn prepare_command_header(
        &mut self,
        now: Millis,
        cmd: &CommandSpec<'_>,
        buf: &mut [u8],
    ) -> Result<PreparedCommand, PrepareError> {
        self.prepare(now, cmd, None, buf)
    }

    fn prepare(
        &mut self,
        now: Millis,
        cmd: &CommandSpec<'_>,
        data: Option<&dyn ImmediateData>,
        buf: &mut [u8],
    ) -> Result<PreparedCommand, PrepareError> {
        if self.state != SessionState::Running {
            return Err(PrepareError::Blocked);
        }
        let unsupported = PrepareError::Failed(FailureKind::Unsupported);
        if cmd.cdb.is_empty() || cmd.cdb.len() > MAX_CDB_LEN {
            return Err(unsupported);
        }
        let (read, write) = match cmd.direction {
            DataDirection::None => (false, false),
            DataDirection::In => (true, false),
            DataDirection::Out => (false, true),
            DataDirection::Unspecified => return Err(unsupported),
        };
        let busy = |s: &mut Self| {
            s.busy_reported = true;
            if s.window_stall_since.is_none() {
                s.window_stall_since = Some(now);
            }
            PrepareError::Busy
        };
        if self.commands_outstanding >= self.cmds_max {
            return Err(busy(self));
        }
        if !cmd.immediate_delivery && self.window_room() == 0 {
            return Err(busy(self));
        }
        let (immediate_len, unsolicited_len) = if write {
            unsolicited_split(&self.neg, cmd.transfer_length)
        } else {
            (0, 0)
        };
        let ahs_len = if cmd.cdb.len() > 16 {
            crate::wire::iscsi::pad4(3 + 1 + cmd.cdb.len() - 16)
        } else {
            0
        };
        let data_start = BHS_LEN + ahs_len;
        let pdu_len = data_start + immediate_len as usize;
        let written = if data.is_some() { pdu_len } else { data_start };
        if buf.len() < written {
            return Err(unsupported);
        }
        let (slot, itt) = self
            .alloc_slot(TaskKind::Command {
                tag: cmd.tag,
                lun: cmd.lun,
                cmd_sn: None,
            })
            .ok_or_else(|| busy(self))?;
        let built = self.build_command(cmd, itt, read, write, unsolicited_len, ahs_len, buf);
        let built = built.and_then(|()| {
            let Some(data) = data else {
                return Ok(());
            };
            let dst = buf
                .get_mut(data_start..pdu_len)
                .ok_or(PrepareError::Failed(FailureKind::Unsupported))?;
            data.read(0, dst)
                .map_err(|_| PrepareError::Failed(FailureKind::Unsupported))
        });
        if let Err(e) = built {
            self.free_slot(slot);
            return Err(e);
        }
        if !cmd.immediate_delivery {
            self.reserved += 1;
        }
        self.commands_outstanding += 1;
        Ok(PreparedCommand {
            slot,
            itt,
            header_len: data_start,
            pdu_len,
            immediate_len,
            unsolicited_len,
            immediate_delivery: cmd.immediate_delivery,
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn build_command(
        &self,
        cmd: &CommandSpec<'_>,
        itt: u32,
        read: bool,
        write: bool,
        unsolicited_len: u32,
        ahs_len: usize,
        buf: &mut [u8],
    ) -> Result<(), PrepareError> {
        let unsupported = PrepareError::Failed(FailureKind::Unsupported);
        let (immediate_len, _) = if write {
            unsolicited_split(&self.neg, cmd.transfer_length)
        } else {
            (0, 0)
        };
        let mut cdb = [0u8; 16];
        let head = cmd.cdb.len().min(16);
        if let (Some(dst), Some(src)) = (cdb.get_mut(..head), cmd.cdb.get(..head)) {
            dst.copy_from_slice(src);
        }
        let repr = ScsiCommandRepr {
            immediate: cmd.immediate_delivery,
            // F: no unsolicited Data-Out PDUs follow.
            is_final: unsolicited_len == immediate_len,
            read,
            write,
            attr: cmd.attr,
            lun: cmd.lun,
            itt,
            expected_data_len: cmd.transfer_length,
            cmd_sn: self.cmd_sn,
            exp_stat_sn: self.stat_sn.expected(),
            cdb,
        };
        BhsRepr::ScsiCommand(repr)
            .emit(buf)
            .map_err(|_| unsupported)?;
        if ahs_len > 0 {
            let tail = cmd.cdb.get(16..).unwrap_or(&[]);
            // AHSLength counts the reserved byte and the CDB's tail.
            let ahs_length = u16::try_from(1 + tail.len()).map_err(|_| unsupported)?;
            let ahs = buf.get_mut(BHS_LEN..BHS_LEN + ahs_len).ok_or(unsupported)?;
            ahs.fill(0);
            let (hdr, rest) = ahs.split_at_mut(4);
            hdr.copy_from_slice(&[
                ahs_length.to_be_bytes()[0],
                ahs_length.to_be_bytes()[1],
                AHS_EXTENDED_CDB,
                0,
            ]);
            rest.get_mut(..tail.len())
                .ok_or(unsupported)?
                .copy_from_slice(tail);
            // TotalAHSLength in words.
            let words = u8::try_from(ahs_len / 4).map_err(|_| unsupported)?;
            if let Some(b) = buf.get_mut(4) {
                *b = words;
            }
        }
        crate::wire::iscsi::set_data_segment_len(buf, immediate_len).map_err(|_| unsupported)
    }

    /// Builds unsolicited Data-Out PDU number `index` of a prepared write
    /// into `buf` and returns its length, `None` when `index` is past the
    /// last one. Each carries at most the negotiated send segment; the last
    /// has the F bit.
    ///
    /// # Errors
    ///
    /// [`PrepareError::Failed`] if `buf` is too small or the data cannot
    /// be read.
    ///
    /// # IRQL
    ///
    /// <= DISPATCH_LEVEL; never blocks, never allocates.
    pub fn build_data_out(
        &self,
        prepared: &PreparedCommand,
        lun: Lun,
        index: u32,
        data: &dyn ImmediateData,
        buf: &mut [u8],
    ) -> Result<Option<usize>, PrepareError> {
        let unsupported = PrepareError::Failed(FailureKind::Unsupported);
        let segment = self.neg.max_send_data_segment.max(1);
        let offset = u64::from(prepared.immediate_len) + u64::from(index) * u64::from(segment);
        if offset >= u64::from(prepared.unsolicited_len) {
            return Ok(None);
        }
        // Below unsolicited_len, so within u32.
        let offset = offset as u32;
        let len = segment.min(prepared.unsolicited_len - offset);
        let repr = DataOutRepr {
            is_final: offset + len == prepared.unsolicited_len,
            lun,
            itt: prepared.itt,
            ttt: RESERVED_TAG,
            exp_stat_sn: self.stat_sn.expected(),
            data_sn: SerialNumber(index),
            buffer_offset: offset,
        };
        let total = BHS_LEN + len as usize;
        let out = buf.get_mut(..total).ok_or(unsupported)?;
        BhsRepr::DataOut(repr).emit(out).map_err(|_| unsupported)?;
        crate::wire::iscsi::set_data_segment_len(out, len).map_err(|_| unsupported)?;
        let dst = out.get_mut(BHS_LEN..).ok_or(unsupported)?;
        data.read(offset, dst).map_err(|_| unsupported)?;
        Ok(Some(total))
    }

    /// Assigns the CmdSN (non-immediate commands take the next one) and
    /// the current ExpStatSN to a prepared command whose PDU is `buf`, at
    /// the moment it is sent. The engine sends in the order it posts; a
    /// target reorders within the window anyway.
    ///
    /// # Errors
    ///
    /// [`PostError`]: nothing may be sent; the command is gone.
    ///
    /// # IRQL
    ///
    /// <= DISPATCH_LEVEL; never blocks, never allocates.
    pub fn post_command(
        &mut self,
        now: Millis,
        prepared: PreparedCommand,
        buf: &mut [u8],
    ) -> Result<PostedCommand, PostError> {
        let ok_buffer = buf.len() >= BHS_LEN
            && buf.first().map(|b| b & 0x3F) == Some(Opcode::ScsiCommand.code())
            && buf.get(16..20) == Some(&prepared.itt.to_be_bytes()[..]);
        let running = self.state == SessionState::Running;
        if !ok_buffer || !running {
            self.discard_command(prepared);
            return Err(if running {
                PostError::BadBuffer
            } else {
                PostError::NotRunning
            });
        }
        let cmd_sn = self.cmd_sn;
        if !prepared.immediate_delivery {
            self.cmd_sn = self.cmd_sn.next();
            self.reserved = self.reserved.saturating_sub(1);
        }
        if let Some(b) = buf.get_mut(CMD_SN_OFFSET..CMD_SN_OFFSET + 4) {
            b.copy_from_slice(&cmd_sn.0.to_be_bytes());
        }
        if let Some(b) = buf.get_mut(EXP_STAT_SN_OFFSET..EXP_STAT_SN_OFFSET + 4) {
            b.copy_from_slice(&self.stat_sn.expected().0.to_be_bytes());
        }
        if let Some(task) = self.tasks.get_mut(usize::from(prepared.slot)) {
            if let TaskKind::Command { cmd_sn: sn, .. } = &mut task.kind {
                *sn = Some(cmd_sn);
            }
        }
        self.last_tx = now;
        Ok(PostedCommand {
            itt: prepared.itt,
            cmd_sn,
        })
    }

    /// Returns a prepared command's slot and window place.
    pub fn discard_command(&mut self, prepared: PreparedCommand) {
        if !prepared.immediate_delivery {
            self.reserved = self.reserved.saturating_sub(1);
        }
        self.commands_outstanding = self.commands_outstanding.saturating_sub(1);
        self.free_slot(prepared.slot);
    }

    // ---- task management --------------------------------------------

    fn queue_tmf(
        &mut self,
        now: Millis,
        tag: Tag,
        function: TaskMgmtFunction,
        lun: Lun,
        victim: Option<(u16, u32)>,
    ) -> Result<(), TmfRefused> {
        if self.state != SessionState::Running && self.state != SessionState::LogoutRequested {
            return Err(TmfRefused::NotConnected);
        }
        if self.tmfs_outstanding >= TMF_SLOTS || self.control.is_full() {
            return Err(TmfRefused::Busy);
        }
        let secs = match function {
            TaskMgmtFunction::AbortTask => self.timeouts.abort,
            _ => self.timeouts.lu_reset,
        };
        let (slot, _) = self
            .alloc_slot(TaskKind::Tmf {
                tag,
                function,
                lun,
                victim,
                cmd_sn: self.cmd_sn,
                deadline: now.plus(Millis::from_secs(secs)),
            })
            .ok_or(TmfRefused::Busy)?;
        if self.control.push_back(Control::Tmf { slot }).is_err() {
            self.free_slot(slot);
            return Err(TmfRefused::Busy);
        }
        self.tmfs_outstanding += 1;
        Ok(())
    }

    /// Queues ABORT TASK for the posted command `victim` (found by a scan
    /// of the table: aborts are rare). Its response comes through
    /// [`SessionEvents::tmf_done`] for `tmf`, after the victim's own
    /// completion.
    ///
    /// # Errors
    ///
    /// [`TmfRefused`].
    ///
    /// # IRQL
    ///
    /// <= DISPATCH_LEVEL; never blocks, never allocates.
    pub fn abort_task(&mut self, now: Millis, tmf: Tag, victim: Tag) -> Result<(), TmfRefused> {
        let found = self
            .tasks
            .iter()
            .enumerate()
            .find_map(|(i, t)| match t.kind {
                TaskKind::Command {
                    tag,
                    lun,
                    cmd_sn: Some(_),
                } if tag == victim => u16::try_from(i).ok().map(|s| (s, lun)),
                _ => None,
            });
        let (slot, lun) = found.ok_or(TmfRefused::UnknownTask)?;
        let itt = self.itt_of(slot);
        self.queue_tmf(
            now,
            tmf,
            TaskMgmtFunction::AbortTask,
            lun,
            Some((slot, itt)),
        )
    }

    /// Queues LOGICAL UNIT RESET for `lun`. Its response comes through
    /// [`SessionEvents::tmf_done`], after every command for `lun` posted
    /// before it has been completed.
    ///
    /// # Errors
    ///
    /// [`TmfRefused`].
    ///
    /// # IRQL
    ///
    /// <= DISPATCH_LEVEL; never blocks, never allocates.
    pub fn reset_lun(&mut self, now: Millis, tmf: Tag, lun: Lun) -> Result<(), TmfRefused> {
        self.queue_tmf(now, tmf, TaskMgmtFunction::LogicalUnitReset, lun, None)
    }

    // ---- logout -----------------------------------------------------

    /// Starts a graceful logout (close the session): new commands are
    /// refused, the Logout Request goes out now.
    pub fn logout(&mut self, now: Millis) {
        if matches!(
            self.state,
            SessionState::LoggingOut | SessionState::LoggedOut { .. }
        ) {
            return;
        }
        self.begin_logout(now);
    }

    fn begin_logout(&mut self, now: Millis) {
        self.state = SessionState::LoggingOut;
        self.logout_deadline = Some(now.plus(Millis::from_secs(self.timeouts.logout)));
        if let Some((_, itt)) = self.alloc_slot(TaskKind::Logout) {
            if self.control.push_back(Control::Logout { itt }).is_ok() {
                self.logout_sent = true;
            }
        }
    }

    // ---- timers -----------------------------------------------------

    /// The next instant [`Self::handle_timeout`] must run at.
    #[must_use]
    pub fn poll_at(&self) -> Option<Millis> {
        if matches!(self.state, SessionState::LoggedOut { .. }) {
            return None;
        }
        let mut at = self.logout_deadline;
        if self.timeouts.noop_out_interval > 0 && self.state == SessionState::Running {
            let ping_at = match self.ping {
                Some((_, sent)) => self
                    .last_rx
                    .max(sent)
                    .plus(Millis::from_secs(self.timeouts.noop_out_timeout)),
                None => self
                    .last_rx
                    .plus(Millis::from_secs(self.timeouts.noop_out_interval)),
            };
            at = earliest(at, Some(ping_at));
        }
        if let Some(since) = self.window_stall_since {
            at = earliest(
                at,
                Some(since.plus(Millis::from_secs(self.timeouts.window))),
            );
        }
        for t in self.tasks.iter() {
            if let TaskKind::Tmf { deadline, .. } = t.kind {
                at = earliest(at, Some(deadline));
            }
        }
        at
    }

    /// Runs the timers due at `now`: pings, the window stall, TMF and
    /// logout timeouts, the deadline of a target-requested logout.
    ///
    /// # Errors
    ///
    /// A [`SessionFailure`].
    ///
    /// # IRQL
    ///
    /// <= DISPATCH_LEVEL; never blocks, never allocates.
    pub fn handle_timeout(&mut self, now: Millis) -> Result<(), SessionFailure> {
        if let Some(deadline) = self.logout_deadline {
            if now >= deadline {
                match self.state {
                    SessionState::LogoutRequested => self.begin_logout(now),
                    SessionState::LoggingOut => return Err(SessionFailure::LogoutTimeout),
                    _ => {}
                }
            }
        }
        if let Some(since) = self.window_stall_since {
            if now >= since.plus(Millis::from_secs(self.timeouts.window)) {
                return Err(SessionFailure::WindowStalled);
            }
        }
        for t in self.tasks.iter() {
            if let TaskKind::Tmf { deadline, .. } = t.kind {
                if now >= deadline {
                    return Err(SessionFailure::TmfTimeout);
                }
            }
        }
        if self.timeouts.noop_out_interval > 0 && self.state == SessionState::Running {
            match self.ping {
                Some((_, sent)) => {
                    let quiet_since = self.last_rx.max(sent);
                    if now >= quiet_since.plus(Millis::from_secs(self.timeouts.noop_out_timeout)) {
                        return Err(SessionFailure::PingTimeout);
                    }
                }
                None => {
                    let idle = self
                        .last_rx
                        .plus(Millis::from_secs(self.timeouts.noop_out_interval));
                    if now >= idle && !self.control.is_full() {
                        if let Some((_, itt)) = self.alloc_slot(TaskKind::Ping) {
                            self.push_control(Control::Ping { itt })?;
                            self.ping = Some((itt, now));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    // ---- transmit ---------------------------------------------------

    /// Builds the next queued control PDU (NOP-Out, TMF, Logout, Text)
    /// into `buf` and returns its length, `None` when nothing is queued.
    /// Control PDUs are immediate: they carry the next CmdSN without
    /// taking it.
    ///
    /// # IRQL
    ///
    /// <= DISPATCH_LEVEL; never blocks, never allocates.
    pub fn poll_transmit(&mut self, now: Millis, buf: &mut [u8]) -> Option<usize> {
        // Skip TMFs that ended before they were sent (terminate_all).
        while let Some(Control::Tmf { slot }) = self.control.front().copied() {
            match self.tasks.get(usize::from(slot)).map(|t| t.kind) {
                Some(TaskKind::Tmf { .. }) => break,
                _ => {
                    let _ = self.control.pop_front();
                }
            }
        }
        let control = *self.control.front()?;
        let header = match control {
            Control::NopReply { ttt, lun } => BhsRepr::NopOut(NopOutRepr {
                immediate: true,
                lun,
                itt: RESERVED_TAG,
                ttt,
                cmd_sn: self.cmd_sn,
                exp_stat_sn: self.stat_sn.expected(),
            }),
            Control::Ping { itt } => BhsRepr::NopOut(NopOutRepr {
                immediate: true,
                lun: Lun::default(),
                itt,
                ttt: RESERVED_TAG,
                cmd_sn: self.cmd_sn,
                exp_stat_sn: self.stat_sn.expected(),
            }),
            Control::Tmf { slot } => {
                let itt = self.itt_of(slot);
                let Some(TaskKind::Tmf {
                    function,
                    lun,
                    victim,
                    cmd_sn,
                    ..
                }) = self.tasks.get(usize::from(slot)).map(|t| t.kind)
                else {
                    return None;
                };
                let ref_cmd_sn = victim
                    .and_then(
                        |(vslot, _)| match self.tasks.get(usize::from(vslot))?.kind {
                            TaskKind::Command { cmd_sn, .. } => cmd_sn,
                            _ => None,
                        },
                    )
                    .unwrap_or(cmd_sn);
                BhsRepr::TaskMgmtRequest(TaskMgmtRequestRepr {
                    immediate: true,
                    function,
                    lun,
                    itt,
                    rtt: victim.map_or(RESERVED_TAG, |(_, vitt)| vitt),
                    cmd_sn,
                    exp_stat_sn: self.stat_sn.expected(),
                    ref_cmd_sn,
                    exp_data_sn: 0,
                })
            }
            Control::Logout { itt } => BhsRepr::LogoutRequest(LogoutRequestRepr {
                immediate: true,
                reason: LogoutReason::CloseSession,
                itt,
                cid: self.cid,
                cmd_sn: self.cmd_sn,
                exp_stat_sn: self.stat_sn.expected(),
            }),
            Control::Text { itt } => BhsRepr::TextRequest(TextRequestRepr {
                immediate: true,
                is_final: true,
                continues: false,
                lun: Lun::default(),
                itt,
                ttt: RESERVED_TAG,
                cmd_sn: self.cmd_sn,
                exp_stat_sn: self.stat_sn.expected(),
            }),
        };
        let pdu = IscsiPdu {
            header,
            ahs: &[],
            data: &[],
        };
        let len = pdu.emit(buf, Padding::None).ok()?;
        let _ = self.control.pop_front();
        if matches!(control, Control::NopReply { .. }) {
            self.pings_answered = self.pings_answered.wrapping_add(1);
        }
        self.last_tx = now;
        Some(len)
    }

    /// How many of the target's pings (an unsolicited NOP-In with a target
    /// transfer tag) [`Self::poll_transmit`] has answered. A target that
    /// pings and gets no answer drops the connection; the count makes that
    /// liveness exchange visible.
    #[must_use]
    pub const fn pings_answered(&self) -> u64 {
        self.pings_answered
    }

    /// Whether a control PDU waits for [`Self::poll_transmit`].
    #[must_use]
    pub fn has_control(&self) -> bool {
        !self.control.is_empty()
    }

    // ---- receive ----------------------------------------------------

    /// Accepts ExpCmdSN/MaxCmdSN from a target PDU (RFC 7143 §4.2.2.1).
    fn update_window<E: SessionEvents>(
        &mut self,
        exp: SerialNumber,
        max: SerialNumber,
        events: &mut E,
    ) {
        if command_window(exp, max).is_none() {
            return;
        }
        if max > self.max_cmd_sn {
            self.max_cmd_sn = max;
        }
        if exp > self.exp_cmd_sn {
            self.exp_cmd_sn = exp;
        }
        self.maybe_open(events);
    }

    fn maybe_open<E: SessionEvents>(&mut self, events: &mut E) {
        let room = self.window_room() > 0 && self.commands_outstanding < self.cmds_max;
        if room {
            self.window_stall_since = None;
            if self.busy_reported && self.state == SessionState::Running {
                self.busy_reported = false;
                events.window_open();
            }
        }
    }

    fn check_stat_sn(&mut self, stat_sn: SerialNumber) -> Result<(), SessionFailure> {
        let expected = self.stat_sn.expected();
        let arrival = self.stat_sn.receive(stat_sn).map_err(|_| {
            violation(Violation::StatSn {
                expected: expected.0,
                received: stat_sn.0,
            })
        })?;
        if arrival != Arrival::InOrder {
            self.statuses_out_of_order = self.statuses_out_of_order.wrapping_add(1);
        }
        Ok(())
    }

    fn complete_command<E: SessionEvents>(
        &mut self,
        slot: u16,
        tag: Tag,
        result: &CommandResult<'_>,
        events: &mut E,
    ) {
        self.free_slot(slot);
        self.commands_outstanding = self.commands_outstanding.saturating_sub(1);
        events.command_done(tag, result);
    }

    /// Handles one PDU from the target (BHS, AHS and data segment, no iSER
    /// header) received at `now`.
    ///
    /// # Errors
    ///
    /// A [`SessionFailure`]: the engine drops the connection.
    ///
    /// # IRQL
    ///
    /// <= DISPATCH_LEVEL; never blocks, never allocates.
    pub fn handle_pdu<E: SessionEvents>(
        &mut self,
        now: Millis,
        pdu: &[u8],
        events: &mut E,
    ) -> Result<(), SessionFailure> {
        let parsed = IscsiPdu::parse(pdu).map_err(|_| violation(Violation::Malformed))?;
        if parsed.data.len() > self.neg.max_recv_data_segment as usize {
            return Err(violation(Violation::DataSegmentTooLong));
        }
        self.last_rx = now;
        match parsed.header {
            BhsRepr::ScsiResponse(rsp) => {
                self.check_stat_sn(rsp.stat_sn)?;
                let Some((
                    slot,
                    TaskKind::Command {
                        tag,
                        cmd_sn: Some(_),
                        ..
                    },
                )) = self.lookup(rsp.itt)
                else {
                    return Err(violation(Violation::UnknownItt(rsp.itt)));
                };
                let (outcome, sense) = match rsp.response {
                    scsi_response::COMPLETED => match SenseData::parse(parsed.data) {
                        Ok(sense) => (CommandOutcome::Scsi(rsp.status), sense.sense),
                        Err(_) => (CommandOutcome::Failed(FailureKind::Protocol), &[][..]),
                    },
                    // The target failed the command: retry it.
                    scsi_response::TARGET_FAILURE => (
                        CommandOutcome::Failed(FailureKind::ConnectionReset),
                        &[][..],
                    ),
                    _ => (CommandOutcome::Failed(FailureKind::Protocol), &[][..]),
                };
                let result = CommandResult {
                    outcome,
                    sense,
                    residual: map_residual(rsp.residual),
                };
                self.complete_command(slot, tag, &result, events);
                self.update_window(rsp.exp_cmd_sn, rsp.max_cmd_sn, events);
                self.after_completion(now);
            }
            BhsRepr::NopIn(nop) => {
                if nop.itt == RESERVED_TAG {
                    // Unsolicited: StatSN is not advanced.
                    if nop.ttt != RESERVED_TAG {
                        self.push_control(Control::NopReply {
                            ttt: nop.ttt,
                            lun: nop.lun,
                        })?;
                    }
                } else {
                    self.check_stat_sn(nop.stat_sn)?;
                    match self.lookup(nop.itt) {
                        Some((slot, TaskKind::Ping)) if nop.ttt == RESERVED_TAG => {
                            self.free_slot(slot);
                            self.ping = None;
                        }
                        Some((_, TaskKind::Ping)) => return Err(violation(Violation::NopInTtt)),
                        _ => return Err(violation(Violation::UnknownItt(nop.itt))),
                    }
                }
                self.update_window(nop.exp_cmd_sn, nop.max_cmd_sn, events);
            }
            BhsRepr::TaskMgmtResponse(rsp) => {
                self.check_stat_sn(rsp.stat_sn)?;
                let Some((slot, TaskKind::Tmf { .. })) = self.lookup(rsp.itt) else {
                    return Err(violation(Violation::UnknownItt(rsp.itt)));
                };
                self.update_window(rsp.exp_cmd_sn, rsp.max_cmd_sn, events);
                self.finish_tmf(slot, map_tmf_response(rsp.response), events);
                self.after_completion(now);
            }
            BhsRepr::LogoutResponse(rsp) => {
                self.check_stat_sn(rsp.stat_sn)?;
                let Some((slot, TaskKind::Logout)) = self.lookup(rsp.itt) else {
                    return Err(violation(Violation::UnknownItt(rsp.itt)));
                };
                self.free_slot(slot);
                self.update_window(rsp.exp_cmd_sn, rsp.max_cmd_sn, events);
                self.logout_deadline = None;
                self.state = SessionState::LoggedOut {
                    time2wait: rsp.time2wait,
                };
            }
            BhsRepr::TextResponse(rsp) => {
                self.check_stat_sn(rsp.stat_sn)?;
                let Some((slot, TaskKind::Text)) = self.lookup(rsp.itt) else {
                    return Err(violation(Violation::UnknownItt(rsp.itt)));
                };
                self.free_slot(slot);
                self.text_pending = false;
                self.update_window(rsp.exp_cmd_sn, rsp.max_cmd_sn, events);
                // The empty request offered nothing; a target that now
                // proposes keys gets a logout instead of a negotiation.
                if !parsed.data.is_empty() || rsp.continues || !rsp.is_final {
                    self.request_logout(now, 0);
                }
            }
            BhsRepr::AsyncMessage(msg) => {
                self.check_stat_sn(msg.stat_sn)?;
                self.update_window(msg.exp_cmd_sn, msg.max_cmd_sn, events);
                match msg.event {
                    AsyncEvent::RequestLogout => self.request_logout(now, msg.parameter3),
                    AsyncEvent::DroppingConnection | AsyncEvent::DroppingAllConnections => {
                        return Err(SessionFailure::TargetDropping {
                            time2wait: msg.parameter2,
                        });
                    }
                    AsyncEvent::ParameterNegotiation
                        if !self.text_pending && self.state == SessionState::Running =>
                    {
                        if let Some((_, itt)) = self.alloc_slot(TaskKind::Text) {
                            self.push_control(Control::Text { itt })?;
                            self.text_pending = true;
                        }
                    }
                    // SCSI events (unit attention follows on the next
                    // command anyway) and vendor events need nothing.
                    _ => {}
                }
            }
            BhsRepr::Reject(rej) => {
                self.check_stat_sn(rej.stat_sn)?;
                self.update_window(rej.exp_cmd_sn, rej.max_cmd_sn, events);
                self.handle_reject(now, &rej, parsed.data, events)?;
            }
            other => {
                return Err(violation(Violation::UnexpectedOpcode(
                    other.opcode().code(),
                )));
            }
        }
        Ok(())
    }

    fn request_logout(&mut self, now: Millis, within_secs: u16) {
        if self.state != SessionState::Running {
            return;
        }
        self.state = SessionState::LogoutRequested;
        // Leave the second half of the target's deadline for the exchange.
        let half = Millis(u64::from(within_secs) * 500);
        self.logout_deadline = Some(now.plus(half));
        self.after_completion(now);
    }

    /// Sends the logout a target asked for once nothing is outstanding.
    fn after_completion(&mut self, now: Millis) {
        if self.state == SessionState::LogoutRequested
            && self.commands_outstanding == 0
            && self.tmfs_outstanding == 0
        {
            self.begin_logout(now);
        }
    }

    fn finish_tmf<E: SessionEvents>(&mut self, slot: u16, response: TmfResponse, events: &mut E) {
        let Some(TaskKind::Tmf {
            tag,
            function,
            lun,
            victim,
            cmd_sn,
            ..
        }) = self.tasks.get(usize::from(slot)).map(|t| t.kind)
        else {
            return;
        };
        self.free_slot(slot);
        self.tmfs_outstanding = self.tmfs_outstanding.saturating_sub(1);
        if response == TmfResponse::Complete {
            match function {
                TaskMgmtFunction::AbortTask => {
                    if let Some((vslot, vitt)) = victim {
                        if let Some((_, TaskKind::Command { tag: vtag, .. })) = self.lookup(vitt) {
                            self.complete_command(
                                vslot,
                                vtag,
                                &CommandResult::plain(CommandOutcome::Aborted),
                                events,
                            );
                        }
                    }
                }
                _ => {
                    // Every command for the LUN sent before the reset.
                    for i in 0..self.tasks.len() {
                        let Ok(s) = u16::try_from(i) else { break };
                        if let Some(TaskKind::Command {
                            tag: ctag,
                            lun: clun,
                            cmd_sn: Some(csn),
                        }) = self.tasks.get(i).map(|t| t.kind)
                        {
                            if clun == lun && csn < cmd_sn {
                                self.complete_command(
                                    s,
                                    ctag,
                                    &CommandResult::plain(CommandOutcome::Reset),
                                    events,
                                );
                            }
                        }
                    }
                }
            }
            self.maybe_open(events);
        }
        events.tmf_done(tag, response);
    }

    fn handle_reject<E: SessionEvents>(
        &mut self,
        now: Millis,
        rej: &RejectRepr,
        data: &[u8],
        events: &mut E,
    ) -> Result<(), SessionFailure> {
        let header = RejectRepr::rejected_header(data).ok();
        let target = header.as_ref().and_then(|h| {
            let itt = h.itt();
            self.lookup(itt)
                .map(|(slot, kind)| (slot, kind, h.opcode_code()))
        });
        match target {
            Some((slot, TaskKind::Command { tag, .. }, code))
                if code == Opcode::ScsiCommand.code() =>
            {
                let kind = match rej.reason {
                    RejectReason::WaitingForLogout
                    | RejectReason::ImmediateCommandRejected
                    | RejectReason::OutOfResources => FailureKind::ConnectionReset,
                    _ => FailureKind::Protocol,
                };
                self.complete_command(
                    slot,
                    tag,
                    &CommandResult::plain(CommandOutcome::Failed(kind)),
                    events,
                );
                self.maybe_open(events);
                self.after_completion(now);
            }
            Some((slot, TaskKind::Ping, _)) => {
                self.free_slot(slot);
                self.ping = None;
            }
            Some((slot, TaskKind::Tmf { .. }, _)) => {
                self.finish_tmf(slot, TmfResponse::Failed, events);
            }
            Some((slot, TaskKind::Text, _)) => {
                self.free_slot(slot);
                self.text_pending = false;
                self.request_logout(now, 0);
            }
            Some((_, TaskKind::Logout, _)) => {
                // The target refuses a logout: nothing graceful is left.
                return Err(violation(Violation::Rejected(rej.reason.code())));
            }
            // A rejected Data-Out (the task goes on; the target answers
            // it with a SCSI Response), or something that names no task.
            _ => {
                if rej.reason == RejectReason::ProtocolError && target.is_none() {
                    return Err(violation(Violation::Rejected(rej.reason.code())));
                }
            }
        }
        Ok(())
    }

    // ---- teardown ---------------------------------------------------

    /// Completes every task the session holds (after the engine dropped
    /// the connection and fenced the buffers): posted commands with
    /// `outcome`, TMFs with `TmfResponse::Transport(kind)` (TMFs first
    /// see nothing; their commands are completed before them). Prepared,
    /// unposted commands stay with their holder (it discards them).
    pub fn terminate_all<E: SessionEvents>(
        &mut self,
        outcome: CommandOutcome,
        tmf_kind: FailureKind,
        events: &mut E,
    ) {
        for i in 0..self.tasks.len() {
            let Ok(slot) = u16::try_from(i) else { break };
            if let Some(TaskKind::Command {
                tag,
                cmd_sn: Some(_),
                ..
            }) = self.tasks.get(i).map(|t| t.kind)
            {
                self.complete_command(slot, tag, &CommandResult::plain(outcome), events);
            }
        }
        for i in 0..self.tasks.len() {
            let Ok(slot) = u16::try_from(i) else { break };
            match self.tasks.get(i).map(|t| t.kind) {
                Some(TaskKind::Tmf { tag, .. }) => {
                    self.free_slot(slot);
                    self.tmfs_outstanding = self.tmfs_outstanding.saturating_sub(1);
                    events.tmf_done(tag, TmfResponse::Transport(tmf_kind));
                }
                Some(TaskKind::Ping | TaskKind::Logout | TaskKind::Text) => self.free_slot(slot),
                _ => {}
            }
        }
        self.control.clear();
        self.ping = None;
        self.text_pending = false;
        self.busy_reported = false;
        self.window_stall_since = None;
        self.logout_deadline = None;
        if !matches!(self.state, SessionState::LoggedOut { .. }) {
            self.state = SessionState::LoggedOut { time2wait: 0 };
        }
    }
}

#[cfg(all(test, feature = "host"))]
mod tests;
