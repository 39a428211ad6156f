//! The seam between the miniport core and a protocol engine (SRP, iSER).
//!
//! The core knows StorPort and SCSI requests; an engine knows its wire
//! protocol, credits, channels, memory registration and recovery timers. The
//! core drives an engine through [`Transport`]; the engine reports back
//! through [`TransportEvents`] (an [`Upcalls`] handle it receives when it is
//! created).
//!
//! # Submitting a command: prepare, then post
//! Submission has two steps so that a completion can never race the
//! submitter for the request:
//!
//! 1. [`Transport::prepare`] borrows the request's CDB, scatter/gather list
//!    and (for immediate data) its CPU view, takes a credit and whatever
//!    else the command needs (a fast-registration MR, an IU buffer) and
//!    builds the command — but sends nothing. It answers
//!    [`PrepareError::Busy`] when a resource is exhausted (no credit: the
//!    core answers `SRB_STATUS_BUSY` and holds the device back, bounded),
//!    [`PrepareError::Blocked`] when the connection is recovering, or
//!    [`PrepareError::Failed`].
//! 2. The core parks the request in its tracker under the command's tag,
//!    then calls [`Transport::post`], which sends it. From then on the
//!    completion may arrive at any moment, on any processor — even before
//!    `post` returns — and finds the request parked.
//!
//! A prepared command that is not posted is returned with
//! [`Transport::discard`] (the credit and MR go back).
//!
//! # The engine's obligations
//! * **Exactly once.** Every posted command is completed exactly once
//!   through [`TransportEvents::command_done`]; every accepted task
//!   management function exactly once through [`TransportEvents::tmf_done`].
//!   A refused `post`/TMF is never completed.
//! * **Fence before completing.** A completion is reported only once the
//!   target can no longer reach the command's buffer (its MR invalidated,
//!   or the QP flushed): the core hands the buffer back to Windows in that
//!   upcall.
//! * **Let go of the tag first.** By the time a command's completion upcall
//!   is made (or `discard` or a failed `post` returns), the engine holds
//!   nothing under its tag: the core may reuse the tag at once, even from
//!   inside the upcall, on another processor.
//! * **Bounded.** [`Transport::reset`] and the task management functions
//!   terminate what they cover without waiting for the target's goodwill:
//!   every covered command is completed promptly (inline, or from the
//!   engine's DPC), at the latest by the engine's fail-fast timer.
//! * **Order.** A successful LUN reset is reported after every command for
//!   that LUN posted before it has been completed; a successful abort after
//!   its victim has been completed.
//! * **Credits.** After refusing a `prepare` for lack of credit, the engine
//!   calls [`TransportEvents::credits_available`] as soon as credit returns,
//!   so the core can release the devices it held back.
//! * **No allocation, no blocking** in anything callable at
//!   `DISPATCH_LEVEL`; [`Transport::start`] and [`Transport::stop`] run on
//!   the passive worker and may block (bounded by the engine's timeouts).

use alloc::sync::{Arc, Weak};
use core::fmt;

use kverbs::irql::{Dispatch, LeDispatch, Passive};

use crate::storport::{DataAccessError, DataDirection, QueueAction, SgElement};
pub use crate::wire::Lun;

/// The core's name for one outstanding request: a slot index and that
/// slot's generation, so a late completion for a reused slot is recognised
/// as stale. Engines use it as their wire tag (SRP tag, iSCSI ITT).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tag(pub u32);

impl Tag {
    /// The raw value (for the wire).
    #[must_use]
    pub const fn raw(self) -> u32 {
        self.0
    }
}

impl fmt::Debug for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tag({}#{})", self.0 & 0xFFFF, self.0 >> 16)
    }
}

/// CPU access to a request's data buffer, for engines that send write data
/// inside the command IU (immediate data) instead of letting the target
/// fetch it by RDMA.
pub trait ImmediateData {
    /// Copies `out.len()` bytes of the data buffer from `offset`.
    ///
    /// # Errors
    /// [`DataAccessError`] if the range leaves the buffer.
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`; never blocks.
    fn read(&self, offset: u32, out: &mut [u8]) -> Result<(), DataAccessError>;
}

/// One SCSI command, borrowed from its request for the duration of
/// [`Transport::prepare`].
pub struct ScsiCommand<'a> {
    /// The core's tag for the command.
    pub tag: Tag,
    /// Which attached target (StorPort's target id).
    pub target: u8,
    /// The LUN on the wire.
    pub lun: Lun,
    /// The CDB (6 to 32 bytes).
    pub cdb: &'a [u8],
    /// Which way data moves ([`DataDirection::Unspecified`] never reaches
    /// an engine: the core resolves it from the CDB or refuses it).
    pub direction: DataDirection,
    /// Bytes to move (the buffer size).
    pub transfer_length: u32,
    /// The SAM task attribute.
    pub task_attribute: QueueAction,
    /// The data buffer as physical segments for the HCA (empty without a
    /// data phase).
    pub sg_list: &'a [SgElement],
    /// The data buffer as the CPU sees it.
    pub immediate: &'a dyn ImmediateData,
}

impl fmt::Debug for ScsiCommand<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ScsiCommand")
            .field("tag", &self.tag)
            .field("target", &self.target)
            .field("lun", &self.lun)
            .field("cdb", &self.cdb)
            .field("direction", &self.direction)
            .field("transfer_length", &self.transfer_length)
            .field("sg_elements", &self.sg_list.len())
            .finish_non_exhaustive()
    }
}

/// Why a transport failed a command (or a whole target).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailureKind {
    /// The target is not reachable on this path now and the engine has
    /// given up waiting (`fast_io_fail`): fail over.
    FailFast,
    /// The target is gone for good (`dev_loss`).
    DeviceLost,
    /// The connection was reset (reconnect, QP error): the command did not
    /// complete and may be retried.
    ConnectionReset,
    /// The engine timed the command out itself.
    Timeout,
    /// The target sent something the protocol does not allow for this
    /// command (malformed or inconsistent response).
    Protocol,
    /// The command cannot be carried (too many segments, too long).
    Unsupported,
}

/// How a command ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CommandOutcome {
    /// The target answered with this SAM status byte.
    Scsi(u8),
    /// Terminated by an abort-task function the core requested.
    Aborted,
    /// Terminated by a LUN reset or [`Transport::reset`].
    Reset,
    /// The transport could not complete it.
    Failed(FailureKind),
}

/// How much of the buffer did not move (from the response's residual
/// fields).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Residual {
    /// Exactly the requested length moved.
    #[default]
    None,
    /// This many bytes fewer than requested moved.
    Underrun(u32),
    /// The target had this many bytes more than the buffer holds.
    Overrun(u32),
}

/// A command's result, borrowed from the engine for the upcall.
#[derive(Debug, Clone, Copy)]
pub struct CommandResult<'a> {
    /// How it ended.
    pub outcome: CommandOutcome,
    /// Sense data (CHECK CONDITION), as received; may be empty.
    pub sense: &'a [u8],
    /// The residual.
    pub residual: Residual,
}

impl CommandResult<'_> {
    /// A result with no sense and no residual.
    #[must_use]
    pub const fn plain(outcome: CommandOutcome) -> CommandResult<'static> {
        CommandResult {
            outcome,
            sense: &[],
            residual: Residual::None,
        }
    }
}

/// A task management function's response (SRP `TSK_MGMT` response codes,
/// iSCSI TMF responses).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TmfResponse {
    /// Function complete.
    Complete,
    /// Function succeeded.
    Succeeded,
    /// The task to abort does not exist at the target.
    TaskNotFound,
    /// The LUN does not exist (or is not this function's LUN).
    IncorrectLun,
    /// The target does not support the function.
    NotSupported,
    /// The target rejected or failed it.
    Failed,
    /// The transport could not deliver it or lost the answer.
    Transport(FailureKind),
}

/// A target's connection state, as the engine's recovery machine sees it
/// (the rport states of Linux `scsi_transport_srp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TargetState {
    /// Not connected yet (first login pending).
    Connecting,
    /// Connected and usable.
    Live,
    /// Connection lost, reconnecting: new commands must wait (bounded).
    Blocked,
    /// Reconnecting failed for `fast_io_fail_tmo`: fail commands fast so
    /// multipath can use another path.
    FailFast,
    /// Gone for good (`dev_loss_tmo`, or detached).
    Lost,
}

impl TargetState {
    /// A small number for logs.
    #[must_use]
    pub const fn code(self) -> u64 {
        match self {
            Self::Connecting => 0,
            Self::Live => 1,
            Self::Blocked => 2,
            Self::FailFast => 3,
            Self::Lost => 4,
        }
    }

    pub(crate) const fn from_code(code: u8) -> Self {
        match code {
            1 => Self::Live,
            2 => Self::Blocked,
            3 => Self::FailFast,
            4 => Self::Lost,
            _ => Self::Connecting,
        }
    }
}

/// Why [`Transport::prepare`] did not build a command.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PrepareError {
    /// Out of credit (or MRs, IU buffers): try again when
    /// [`TransportEvents::credits_available`] says so.
    Busy,
    /// The target's connection is recovering: try again later.
    Blocked,
    /// The command cannot be sent.
    Failed(FailureKind),
}

/// [`Transport::post`] could not send the command; nothing was sent and no
/// completion will come.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PostFailed(pub FailureKind);

/// A task management function could not be sent; no response will come.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TmfRefused {
    /// No credit or TMF slot free now.
    Busy,
    /// The target is not connected.
    NotConnected,
    /// The victim tag is not outstanding in the engine.
    UnknownTask,
}

/// [`Transport::start`] failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StartFailed {
    /// The engine's error code (for the log).
    pub code: u32,
}

/// A protocol engine the core drives. See the [module docs](self) for the
/// obligations an implementation takes on.
pub trait Transport: Send + Sync + 'static {
    /// A built, unsent command (holds its credit and resources).
    type Prepared: Send;

    /// Builds a command without sending it.
    ///
    /// # Errors
    /// [`PrepareError`]; nothing is held afterwards.
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`; never blocks, never allocates.
    fn prepare(
        &self,
        command: &ScsiCommand<'_>,
        irql: &impl LeDispatch,
    ) -> Result<Self::Prepared, PrepareError>;

    /// Sends a prepared command. Its completion may be delivered before
    /// this returns.
    ///
    /// # Errors
    /// [`PostFailed`]: nothing was sent, no completion will come.
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`; never blocks, never allocates.
    fn post(&self, prepared: Self::Prepared, irql: &impl LeDispatch) -> Result<(), PostFailed>;

    /// Returns a prepared command's resources without sending it.
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    fn discard(&self, prepared: Self::Prepared, irql: &impl LeDispatch);

    /// Sends ABORT TASK for `victim` on `target`/`lun`; the response comes
    /// through [`TransportEvents::tmf_done`] for `tmf`.
    ///
    /// # Errors
    /// [`TmfRefused`]: nothing was sent.
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    fn abort_task(
        &self,
        target: u8,
        lun: Lun,
        victim: Tag,
        tmf: Tag,
        irql: &impl LeDispatch,
    ) -> Result<(), TmfRefused>;

    /// Sends LOGICAL UNIT RESET for `target`/`lun`; the response comes
    /// through [`TransportEvents::tmf_done`] for `tmf`.
    ///
    /// # Errors
    /// [`TmfRefused`]: nothing was sent.
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    fn reset_lun(
        &self,
        target: u8,
        lun: Lun,
        tmf: Tag,
        irql: &impl LeDispatch,
    ) -> Result<(), TmfRefused>;

    /// Terminates every outstanding command and task management function
    /// (a bus reset): each completes with [`CommandOutcome::Reset`] (or
    /// [`TmfResponse::Transport`]) once fenced — inline or promptly after.
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    fn reset(&self, irql: &impl LeDispatch);

    /// Connects (logs in to) the attached targets. Target states are
    /// reported through [`TransportEvents::target_state`].
    ///
    /// # Errors
    /// [`StartFailed`] if the engine cannot run at all (a target that
    /// cannot be reached is a target state, not an error).
    ///
    /// # IRQL
    /// `PASSIVE_LEVEL` (the passive worker); may block, bounded.
    fn start(&self, irql: &Passive<'_>) -> Result<(), StartFailed>;

    /// Disconnects and flushes: when it returns every command and TMF has
    /// been completed and no upcall will follow until the next `start`.
    ///
    /// Call it before dropping a started transport (the miniport core
    /// does): it is the synchronous teardown. A started SRP or iSER
    /// transport dropped without it runs the same stop asynchronously on
    /// its passive worker (the drop neither blocks nor allocates): its
    /// connections end and its commands in flight complete once, with a
    /// failure, shortly after the drop rather than before it returns
    /// (`tests/tests/srp_teardown.rs`, `tests/tests/iser_teardown.rs`).
    ///
    /// # IRQL
    /// `PASSIVE_LEVEL` (the passive worker); may block, bounded.
    fn stop(&self, irql: &Passive<'_>);
}

/// The upcalls an engine makes into the core.
pub trait TransportEvents: Send + Sync {
    /// A posted command finished (exactly once per post).
    ///
    /// # IRQL
    /// `DISPATCH_LEVEL` (the engine's completion DPC, or inline from a call
    /// the core made, raised).
    fn command_done(&self, tag: Tag, result: &CommandResult<'_>, irql: &Dispatch<'_>);

    /// A task management function finished (exactly once per accepted
    /// TMF).
    ///
    /// # IRQL
    /// `DISPATCH_LEVEL`.
    fn tmf_done(&self, tag: Tag, response: TmfResponse, irql: &Dispatch<'_>);

    /// A target's connection state changed.
    ///
    /// # IRQL
    /// `DISPATCH_LEVEL`.
    fn target_state(&self, target: u8, state: TargetState, irql: &Dispatch<'_>);

    /// Credit returned after a `prepare` was refused for lack of it.
    ///
    /// # IRQL
    /// `DISPATCH_LEVEL`.
    fn credits_available(&self, target: u8, irql: &Dispatch<'_>);
}

/// The engine's handle on the core: where its upcalls go.
#[derive(Clone)]
pub struct Upcalls {
    sink: Arc<dyn TransportEvents>,
}

impl Upcalls {
    /// Wraps an event sink (the core passes itself; tests may pass a
    /// recorder).
    #[must_use]
    pub fn new(sink: Arc<dyn TransportEvents>) -> Self {
        Self { sink }
    }

    /// See [`TransportEvents::command_done`].
    pub fn command_done(&self, tag: Tag, result: &CommandResult<'_>, irql: &Dispatch<'_>) {
        self.sink.command_done(tag, result, irql);
    }

    /// See [`TransportEvents::tmf_done`].
    pub fn tmf_done(&self, tag: Tag, response: TmfResponse, irql: &Dispatch<'_>) {
        self.sink.tmf_done(tag, response, irql);
    }

    /// See [`TransportEvents::target_state`].
    pub fn target_state(&self, target: u8, state: TargetState, irql: &Dispatch<'_>) {
        self.sink.target_state(target, state, irql);
    }

    /// See [`TransportEvents::credits_available`].
    pub fn credits_available(&self, target: u8, irql: &Dispatch<'_>) {
        self.sink.credits_available(target, irql);
    }
}

impl fmt::Debug for Upcalls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Upcalls")
    }
}

/// A weak view of a transport's engine (`SrpTransport::engine_probe`,
/// `IserTransport::engine_probe`): whether it still exists, for tests and
/// diagnostics of teardown. It keeps nothing alive.
pub struct EngineProbe(Weak<dyn Send + Sync>);

impl EngineProbe {
    /// A probe of `engine`.
    pub(crate) fn new<E: Send + Sync + 'static>(engine: &Arc<E>) -> Self {
        let weak: Weak<E> = Arc::downgrade(engine);
        EngineProbe(weak)
    }

    /// Whether the engine still exists.
    #[must_use]
    pub fn is_alive(&self) -> bool {
        self.0.strong_count() > 0
    }
}

impl fmt::Debug for EngineProbe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EngineProbe")
            .field("alive", &self.is_alive())
            .finish()
    }
}

/// Checks `done` every millisecond, sleeping between checks, until it
/// holds or `limit` has passed; whether it held. An engine's stop waits
/// with it for what it started (logouts, disconnects, releases), each
/// step of which is bounded itself.
///
/// # IRQL
/// `PASSIVE_LEVEL` (sleeps).
pub(crate) fn wait_bounded<P: kverbs::platform::Platform>(
    platform: &P,
    limit: core::time::Duration,
    irql: &Passive<'_>,
    mut done: impl FnMut() -> bool,
) -> bool {
    let step = core::time::Duration::from_millis(1);
    let mut waited = core::time::Duration::ZERO;
    while waited < limit {
        if done() {
            return true;
        }
        platform.delay(step, irql);
        waited += step;
    }
    done()
}
