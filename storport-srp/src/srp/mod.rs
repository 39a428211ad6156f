//! The SRP initiator engine: the [`Transport`](crate::miniport::transport::Transport)
//! the miniport core drives, speaking SRP over kverbs.
//!
//! * [`params`]: target attachment strings as Linux `ib_srp`'s
//!   `add_target` takes them, and the recovery timeouts.
//! * [`login`]: the login request, response and reject.
//! * [`credits`], [`tags`], [`mapping`], [`iu`], [`recovery`]: the pure
//!   pieces — the request limit, wire tags and slot free lists, the
//!   registration plan of a scatter/gather list, the `SRP_CMD` and its
//!   descriptors, the rport state machine.
//! * [`SrpTransport`] ([`engine`]): targets and their channels; the fast
//!   path and the completion side live in `channel`, a connection's
//!   objects and its orderly end in `conn`.
//!
//! Security: no global rkey, ever. Every data buffer is fast-registered
//! per I/O with a rotated key and only the access the direction needs,
//! invalidated before the request completes; each connection has its own
//! PD, so an rkey of an earlier connection is void for good.

mod channel;
mod conn;
pub mod credits;
pub mod engine;
pub mod iu;
pub mod login;
pub mod mapping;
pub mod params;
pub mod recovery;
mod reset_group;
mod sq_budget;
pub mod tags;

pub use crate::miniport::transport::EngineProbe;
pub use channel::SrpPrepared;
pub use engine::{AdapterShape, SrpConfig, SrpError, SrpTransport, TargetStats};
