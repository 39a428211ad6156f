//! The iSCSI half of the iSER initiator: everything iSCSI (RFC 7143, with
//! the RFC 7145 iSER keys) that does not touch RDMA, as sans-IO state
//! machines — PDUs and time in, PDUs and upcalls out.
//!
//! * [`description`]: the target as an administrator describes it with
//!   `iscsiadm` node-record keys (target and initiator names, portal, ISID,
//!   CHAP credentials, the negotiable parameters, the timeouts), parsed
//!   strictly without allocation.
//! * [`chap`]: CHAP with MD5 (RFC 1994 as RFC 7143 uses it) and the
//!   hex/base64 encodings of binary key values.
//! * [`login`]: the initiator's login (security stage with `AuthMethod`
//!   and optional CHAP, operational stage with the iSER keys), one login
//!   PDU outstanding at a time as Linux `isert` requires; its result is a
//!   typed [`login::Negotiated`].
//! * [`session`]: the full feature phase: task tags, the
//!   CmdSN/ExpCmdSN/MaxCmdSN command window as the flow control, SCSI
//!   Command PDUs with immediate and unsolicited data, SCSI Responses,
//!   NOP-Out keepalive and answers to target NOP-Ins, task management,
//!   Reject, Asynchronous Messages and logout.
//! * [`recovery`]: error recovery level 0 — session reinstatement with
//!   back-off, and the fast-fail and device-loss timers SRP uses.
//!
//! # Time
//!
//! Nothing here reads a clock: every call that depends on time takes the
//! caller's monotonic [`Millis`], and every machine reports the next
//! instant it needs to be called at (`poll_at`). The engine arms one
//! platform timer for the earliest.
//!
//! # IRQL
//!
//! Everything is pure computation on caller-owned buffers, callable at
//! any IRQL <= `DISPATCH_LEVEL`, except the constructors that allocate
//! fixed tables ([`session::Session::new`]), which take a `Passive` token.

#![forbid(unsafe_code)]

pub mod chap;
pub mod description;
pub mod login;
pub mod recovery;
pub mod session;
pub mod stat_sn;

use core::fmt;

/// A monotonic instant or a duration in milliseconds, as the engine's
/// platform clock gives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Millis(pub u64);

impl Millis {
    /// `secs` seconds.
    #[must_use]
    pub const fn from_secs(secs: u32) -> Self {
        Self(secs as u64 * 1000)
    }

    /// `self + d`, saturating.
    #[must_use]
    pub const fn plus(self, d: Millis) -> Self {
        Self(self.0.saturating_add(d.0))
    }

    /// How long from `earlier` to `self` (zero if `earlier` is later).
    #[must_use]
    pub const fn since(self, earlier: Millis) -> Millis {
        Millis(self.0.saturating_sub(earlier.0))
    }
}

impl fmt::Display for Millis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ms", self.0)
    }
}

/// The earlier of two optional deadlines.
pub(crate) fn earliest(a: Option<Millis>, b: Option<Millis>) -> Option<Millis> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, None) => x,
        (None, y) => y,
    }
}
