//! What a consumer hands the connection manager and what it gets back.
//!
//! # IRQL
//!
//! Every function here is pure computation over its arguments (no
//! allocation, no lock, bounded time): callable at any IRQL.

use core::fmt;

use hca_lowlevel::wire::{Gid, Psn, Qpn};

use crate::wire::{CmPathRepr, CmaHeaderRepr, PathMtu, RejectReason, ServiceId};

/// A connection in a [`CmEngine`](super::CmEngine)'s table.
///
/// The slot index plus a generation: a handle kept past the end of its
/// connection names nothing (calls with it fail with
/// [`CmError::UnknownId`]) even after the slot is reused.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct CmId {
    slot: u16,
    generation: u16,
}

impl CmId {
    pub(crate) const fn new(slot: u16, generation: u16) -> CmId {
        CmId { slot, generation }
    }

    /// The slot index in the engine's table.
    pub const fn slot(self) -> usize {
        self.slot as usize
    }

    /// The generation of the slot this handle was issued for.
    pub const fn generation(self) -> u16 {
        self.generation
    }
}

impl fmt::Debug for CmId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CmId({}.{})", self.slot, self.generation)
    }
}

/// A listener in a [`CmEngine`](super::CmEngine)'s table (index plus
/// generation, like [`CmId`]).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct ListenerId {
    index: u16,
    generation: u16,
}

impl ListenerId {
    pub(crate) const fn new(index: u16, generation: u16) -> ListenerId {
        ListenerId { index, generation }
    }

    /// The index in the engine's listener table.
    pub const fn index(self) -> usize {
        self.index as usize
    }

    /// The generation of the entry this handle was issued for.
    pub const fn generation(self) -> u16 {
        self.generation
    }
}

impl fmt::Debug for ListenerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ListenerId({}.{})", self.index, self.generation)
    }
}

/// Where a MAD comes from or goes to: a port GID and a QP on it (the CM
/// talks QP1 to QP1; replies go to the sender's source QP).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct MadAddress {
    /// The port's GID (RoCE: its IPv4-mapped address).
    pub gid: Gid,
    /// The QP (QP1 for a CM).
    pub qpn: Qpn,
}

impl MadAddress {
    /// The CM of the port with `gid` (its QP1).
    pub const fn cm(gid: Gid) -> MadAddress {
        MadAddress { gid, qpn: Qpn::GSI }
    }
}

/// The transport parameters of one side of a connection.
///
/// The CM advertises them in its REQ or REP, swaps them with the peer's
/// (responder resources on one side bound the initiator depth on the
/// other), and programs the QP with the result.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct ConnParams {
    /// RDMA READs this side accepts outstanding (`max_dest_rd_atomic`).
    pub responder_resources: u8,
    /// RDMA READs this side issues outstanding (`max_rd_atomic`).
    pub initiator_depth: u8,
    /// Transport retries on ACK timeout (0..=7). The active side's value
    /// is used by both sides (it travels in the REQ); the passive side's is
    /// ignored.
    pub retry_count: u8,
    /// How often the *peer* retries when this side answers RNR NAK
    /// (0..=7, 7 = forever): what this side advertises in its REQ/REP.
    pub rnr_retry_count: u8,
    /// The RNR NAK timer code this side's responder advertises (0..=31).
    pub min_rnr_timer: u8,
    /// End-to-end flow control (credits in ACKs).
    pub flow_control: bool,
    /// The local QP receives from a shared receive queue.
    pub srq: bool,
}

impl ConnParams {
    /// What Linux `ib_srp` asks for: 4 responder resources, RC retries 7,
    /// RNR retries 7 (forever), flow control on. The initiator depth is
    /// that of `ib_srpt`'s accept (4).
    pub const SRP: ConnParams = ConnParams {
        responder_resources: 4,
        initiator_depth: 4,
        retry_count: 7,
        rnr_retry_count: 7,
        min_rnr_timer: 12,
        flow_control: true,
        srq: false,
    };

    pub(crate) fn check(&self) -> Result<(), CmError> {
        if self.retry_count > 7 {
            return Err(CmError::InvalidParameter("retry count above 7"));
        }
        if self.rnr_retry_count > 7 {
            return Err(CmError::InvalidParameter("RNR retry count above 7"));
        }
        if self.min_rnr_timer > 31 {
            return Err(CmError::InvalidParameter("RNR timer code above 31"));
        }
        Ok(())
    }
}

/// The local QP a connection binds.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct LocalQp {
    /// Its number.
    pub qpn: Qpn,
    /// The PSN its send queue starts from (what this side advertises);
    /// `None`: the engine picks a random one, as Linux does.
    pub starting_psn: Option<Psn>,
}

/// An active connection request ([`CmEngine::connect`](super::CmEngine::connect)).
#[derive(Clone, Copy, Debug)]
pub struct ConnectRequest<'a> {
    /// The listener to reach.
    pub service_id: ServiceId,
    /// The peer's CM (its GID, QP1).
    pub peer: MadAddress,
    /// The primary path as it goes into the REQ: local GID = this port,
    /// remote GID = the peer, and the local ACK timeout both QPs use.
    pub path: CmPathRepr,
    /// The path MTU (lowered to the port's MTU if larger).
    pub path_mtu: PathMtu,
    /// The QP to connect, in the INIT state.
    pub qp: LocalQp,
    /// This side's transport parameters.
    pub params: ConnParams,
    /// REQ private data, at most 92 bytes (RDMA/CM: its 36-byte header
    /// first, see [`super::rdma_cm`]).
    pub private_data: &'a [u8],
}

/// A passive side's answer to a request ([`CmEngine::accept`](super::CmEngine::accept)).
#[derive(Clone, Copy, Debug)]
pub struct AcceptRequest<'a> {
    /// The QP to connect, in the INIT state.
    pub qp: LocalQp,
    /// This side's transport parameters (responder resources and initiator
    /// depth are lowered to what the REQ offers; the retry count is the
    /// REQ's).
    pub params: ConnParams,
    /// REP private data, at most 196 bytes (SRP: `SRP_LOGIN_RSP`).
    pub private_data: &'a [u8],
}

/// An incoming connection request, as the listener sees it.
#[derive(Clone, Copy, Debug)]
pub struct IncomingRequest<'a> {
    /// The new connection; answer with `accept` or `reject`.
    pub id: CmId,
    /// The service ID the REQ names.
    pub service_id: ServiceId,
    /// The peer's CM.
    pub peer: MadAddress,
    /// The peer's QP.
    pub remote_qpn: Qpn,
    /// The peer's CA GUID.
    pub remote_ca_guid: u64,
    /// The path MTU both QPs will use.
    pub path_mtu: PathMtu,
    /// The peer's responder resources (bounds this side's initiator depth).
    pub responder_resources: u8,
    /// The peer's initiator depth (bounds this side's responder resources).
    pub initiator_depth: u8,
    /// The RDMA/CM header of the REQ, for RDMA/CM listeners.
    pub rdma_cm: Option<CmaHeaderRepr>,
    /// The consumer's private data: after the RDMA/CM header for RDMA/CM
    /// listeners (56 bytes), the whole 92 bytes otherwise; zero-padded.
    pub private_data: &'a [u8],
}

/// Why a connection attempt got no answer it could use.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum UnreachableCause {
    /// No reply after every retry (REQ: no REP; REP: no RTU).
    Timeout,
    /// The peer's QP is still known from an earlier connection (stale).
    StaleConnection,
    /// Moving the local QP to RTR or RTS failed.
    QpTransitionFailed,
}

/// Why a connection ended.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum DisconnectCause {
    /// This side called `disconnect`.
    Local,
    /// The peer sent DREQ (or rejected an established connection).
    Remote,
    /// The peer reconnected with the same QP: this connection is stale.
    Stale,
}

/// What a connection's callback learns. Per connection: at most one
/// [`CmEvent::Established`], then exactly one terminal event (the other
/// three). After the terminal event the CM never touches the QP again and
/// the [`CmId`] is dead for consumer calls.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum CmEvent<'a> {
    /// The connection is up: the QP is in RTS. Private data: REP (active
    /// side; SRP `SRP_LOGIN_RSP`) or RTU (passive side).
    Established {
        /// The peer's private data (zero-padded field).
        private_data: &'a [u8],
    },
    /// The peer rejected the request (active side) or withdrew it after
    /// this side accepted (passive side).
    Rejected {
        /// The CM reason (28, consumer defined: SRP/iSER rejects).
        reason: RejectReason,
        /// The REJ private data (SRP: `SRP_LOGIN_REJ`).
        private_data: &'a [u8],
    },
    /// The connection could not be set up.
    Unreachable {
        /// Why.
        cause: UnreachableCause,
    },
    /// The connection is down (or its setup was abandoned by
    /// `disconnect`); the QP is in the error state if the CM had moved it
    /// past INIT.
    Disconnected {
        /// Who ended it.
        cause: DisconnectCause,
        /// DREQ or REJ private data from the peer (empty if local).
        private_data: &'a [u8],
    },
}

impl CmEvent<'_> {
    /// Whether this is the connection's last event.
    pub const fn is_terminal(&self) -> bool {
        !matches!(self, CmEvent::Established { .. })
    }
}

/// Why a request delivered to a listener went away before the consumer
/// answered it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum WithdrawnCause {
    /// The peer sent REJ (usually: it timed out waiting).
    Rejected(RejectReason),
    /// The consumer did not answer within the peer's patience; the engine
    /// rejected it with reason Timeout.
    TimedOut,
}

/// What a listener's callback learns.
#[derive(Clone, Copy, Debug)]
pub enum ListenEvent<'a> {
    /// A new connection request.
    Request(IncomingRequest<'a>),
    /// A request not yet answered is gone; `accept`/`reject` on it now fail.
    Withdrawn {
        /// The request's connection.
        id: CmId,
        /// Why.
        cause: WithdrawnCause,
    },
}

/// Why a consumer call failed (nothing was sent, nothing changed).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum CmError {
    /// Every connection slot is in use (slots in timewait included).
    NoFreeSlot,
    /// Every listener slot is in use.
    NoFreeListener,
    /// Another listener has this service ID.
    AlreadyListening,
    /// Private data longer than the message carries (the maximum given).
    PrivateDataTooLong(usize),
    /// A parameter is out of range (named).
    InvalidParameter(&'static str),
    /// No such connection or listener (never existed, or ended).
    UnknownId,
    /// The call does not apply in the connection's current state.
    WrongState,
    /// The connection is already ending: its terminal event is on its way
    /// (or the port is closing).
    Closing,
    /// Not yet: something is still winding down; call again.
    Busy,
}

impl fmt::Display for CmError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CmError::NoFreeSlot => f.write_str("no free connection slot"),
            CmError::NoFreeListener => f.write_str("no free listener slot"),
            CmError::AlreadyListening => f.write_str("service ID already has a listener"),
            CmError::PrivateDataTooLong(max) => write!(f, "private data longer than {max}"),
            CmError::InvalidParameter(what) => write!(f, "invalid parameter: {what}"),
            CmError::UnknownId => f.write_str("unknown connection or listener"),
            CmError::WrongState => f.write_str("not allowed in the connection's state"),
            CmError::Closing => f.write_str("connection already closing"),
            CmError::Busy => f.write_str("still winding down"),
        }
    }
}
