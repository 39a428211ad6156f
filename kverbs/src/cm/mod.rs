//! The connection manager: IB CM over QP1 with RDMA/CM addressing.
//!
//! A storage initiator connects a reliable-connected QP to a target by
//! exchanging CM MADs on QP1 (REQ → REP → RTU; REJ, MRA, DREQ, DREP around
//! them), with the RDMA/CM conventions Linux targets expect on RoCE
//! (service ID from port space and port, a 36-byte address header in the
//! REQ private data, IPv4-mapped GIDs).
//!
//! * [`engine`]: the protocol engine, sans I/O: every connection's state
//!   machine, listeners, the MAD agent logic (transaction IDs, matching,
//!   retries, drops with a reason), driven by events and answering with
//!   effects ([`CmEffects`]). Pure, deterministic, allocation-free after
//!   creation: callable at `DISPATCH_LEVEL`, testable without an HCA.
//! * [`qp`]: the QP transitions the CM drives (INIT → RTR → RTS, → ERR) and
//!   their attributes, PSNs as Linux uses them.
//! * [`rdma_cm`]: RDMA/CM addressing on top of the IB CM.
//! * [`agent`]: drop reasons, counters and identifiers.
//! * [`port`]: the engine bound to a port — QP1 MADs, the platform timer,
//!   QP transitions through the consumers' QPs (the passive worker), and
//!   callbacks from a DPC: the API consumers use
//!   ([`CmPort::connect_rdma_cm`], [`CmPort::listen`], [`CmPort::accept`],
//!   [`CmPort::reject`], [`CmPort::disconnect`]).
//!
//! # Callbacks
//!
//! Per connection: at most one `Established`, then exactly one terminal
//! event; after it the CM never touches the QP. Per listener: a `Request`
//! for each new REQ, and `Withdrawn` if one goes away unanswered. A CM
//! callback may run at `DISPATCH_LEVEL`: nothing in it may block.

pub mod agent;
pub mod engine;
pub mod port;
pub mod qp;
pub mod rdma_cm;
mod types;

#[cfg(test)]
mod tests;

pub use agent::{CmStats, DropReason, DroppedMad};
pub use engine::{CmConfig, CmEffects, CmEngine, CmState, ListenKind};
pub use port::{CmHandler, CmListener, CmPort, CmPortConfig, CmPortStats, CmQp, CmTrace};
pub use qp::{QpModify, RtrAttrs, RtsAttrs};
pub use types::{
    AcceptRequest, CmError, CmEvent, CmId, ConnParams, ConnectRequest, DisconnectCause,
    IncomingRequest, ListenEvent, ListenerId, LocalQp, MadAddress, UnreachableCause,
    WithdrawnCause,
};
