//! The management-datagram agent's bookkeeping: transaction IDs, the
//! identifiers the engine hands out, and what happens to a MAD it cannot
//! use.
//!
//! Every MAD arrives from the network, so every one has a defined fate:
//! it drives a connection, it is answered (REJ, DREP, MRA), or it is
//! dropped with one [`DropReason`]. Each reason has a counter
//! ([`CmStats::dropped`]) and each drop is reported to the trace hook
//! ([`CmEffects::dropped`](super::CmEffects::dropped)) with enough context
//! to diagnose a misbehaving peer.
//!
//! # IRQL
//!
//! Every function here is pure computation over its arguments (no
//! allocation, no lock, bounded time): callable at any IRQL.

use core::fmt;

use hca_lowlevel::wire::Psn;

use super::types::MadAddress;
use crate::wire::Error as WireError;

/// Why a received MAD was not used.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum DropReason {
    /// Shorter than a MAD, or a message body cut short.
    Truncated,
    /// MAD base version is not 1.
    BadBaseVersion,
    /// Not the CM management class.
    NotCmClass,
    /// CM class version is not 2.
    BadClassVersion,
    /// Not the Send method.
    NotSend,
    /// A CM attribute this CM does not handle (SIDR, LAP, APR, ...).
    UnsupportedAttribute,
    /// A field holds a reserved value (path MTU, message kind, ARI length).
    MalformedField,
    /// No connection has the communication ID it names.
    UnknownConnection,
    /// It came from another port than the connection's peer.
    WrongPeer,
    /// The sender's communication ID is not the connection's peer's.
    CommIdMismatch,
    /// Its transaction ID is not that of the exchange it answers.
    TidMismatch,
    /// A DREQ naming another QP than the connection's.
    QpnMismatch,
    /// The message has no meaning in the connection's state.
    UnexpectedInState,
    /// A duplicate of a message already acted on.
    Duplicate,
}

impl DropReason {
    /// Number of reasons.
    pub const COUNT: usize = 14;

    /// Every reason, in counter order.
    pub const ALL: [DropReason; DropReason::COUNT] = [
        DropReason::Truncated,
        DropReason::BadBaseVersion,
        DropReason::NotCmClass,
        DropReason::BadClassVersion,
        DropReason::NotSend,
        DropReason::UnsupportedAttribute,
        DropReason::MalformedField,
        DropReason::UnknownConnection,
        DropReason::WrongPeer,
        DropReason::CommIdMismatch,
        DropReason::TidMismatch,
        DropReason::QpnMismatch,
        DropReason::UnexpectedInState,
        DropReason::Duplicate,
    ];

    /// The counter index of this reason.
    pub const fn index(self) -> usize {
        match self {
            DropReason::Truncated => 0,
            DropReason::BadBaseVersion => 1,
            DropReason::NotCmClass => 2,
            DropReason::BadClassVersion => 3,
            DropReason::NotSend => 4,
            DropReason::UnsupportedAttribute => 5,
            DropReason::MalformedField => 6,
            DropReason::UnknownConnection => 7,
            DropReason::WrongPeer => 8,
            DropReason::CommIdMismatch => 9,
            DropReason::TidMismatch => 10,
            DropReason::QpnMismatch => 11,
            DropReason::UnexpectedInState => 12,
            DropReason::Duplicate => 13,
        }
    }

    /// The reason a parse error stands for.
    pub const fn from_wire(error: WireError) -> DropReason {
        match error {
            WireError::Truncated | WireError::BufferTooShort => DropReason::Truncated,
            WireError::BadBaseVersion(_) => DropReason::BadBaseVersion,
            WireError::UnexpectedMgmtClass(_) => DropReason::NotCmClass,
            WireError::BadClassVersion(_) => DropReason::BadClassVersion,
            WireError::UnexpectedMethod(_) => DropReason::NotSend,
            WireError::UnsupportedAttribute(_) => DropReason::UnsupportedAttribute,
            WireError::BadPathMtu(_)
            | WireError::ReservedMessageKind(_)
            | WireError::BadRejectInfoLength(_)
            | WireError::PrivateDataTooLong(_)
            | WireError::FieldOutOfRange(_)
            | WireError::BadCmaVersion(_)
            | WireError::BadCmaIpVersion(_) => DropReason::MalformedField,
        }
    }
}

impl fmt::Display for DropReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = match self {
            DropReason::Truncated => "truncated",
            DropReason::BadBaseVersion => "bad MAD base version",
            DropReason::NotCmClass => "not a CM MAD",
            DropReason::BadClassVersion => "bad CM class version",
            DropReason::NotSend => "method is not Send",
            DropReason::UnsupportedAttribute => "unsupported CM attribute",
            DropReason::MalformedField => "reserved field value",
            DropReason::UnknownConnection => "unknown communication ID",
            DropReason::WrongPeer => "sender is not the connection's peer",
            DropReason::CommIdMismatch => "peer communication ID mismatch",
            DropReason::TidMismatch => "transaction ID mismatch",
            DropReason::QpnMismatch => "DREQ names another QP",
            DropReason::UnexpectedInState => "unexpected in this state",
            DropReason::Duplicate => "duplicate",
        };
        f.write_str(text)
    }
}

/// One dropped MAD, as the trace hook sees it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct DroppedMad {
    /// Why.
    pub reason: DropReason,
    /// Who sent it.
    pub from: MadAddress,
    /// Its attribute ID (0 if too short to tell).
    pub attribute_id: u16,
    /// Its transaction ID (0 if too short to tell).
    pub transaction_id: u64,
    /// The local communication ID it was matched to, if any.
    pub local_comm_id: Option<u32>,
}

/// The engine's counters.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct CmStats {
    /// MADs handed to the engine.
    pub received: u64,
    /// MADs the engine sent (retransmissions included).
    pub sent: u64,
    /// Retransmissions (REQ, REP, DREQ) after a timeout.
    pub retransmissions: u64,
    /// Exchanges given up after the last retry.
    pub timeouts: u64,
    /// REJs sent.
    pub rejects_sent: u64,
    /// MRAs sent.
    pub mras_sent: u64,
    /// Messages the engine failed to emit (a bug: they were not sent).
    pub emit_failures: u64,
    /// Drops, indexed by [`DropReason::index`].
    pub dropped: [u64; DropReason::COUNT],
}

impl CmStats {
    /// Drops with `reason`.
    pub fn dropped(&self, reason: DropReason) -> u64 {
        self.dropped.get(reason.index()).copied().unwrap_or(0)
    }

    /// Drops of any reason.
    pub fn dropped_total(&self) -> u64 {
        self.dropped.iter().sum()
    }

    pub(crate) fn count_drop(&mut self, reason: DropReason) {
        if let Some(n) = self.dropped.get_mut(reason.index()) {
            *n = n.saturating_add(1);
        }
    }
}

/// The engine's source of identifiers: transaction IDs, the salt of local
/// communication IDs, and random starting PSNs (xorshift64*, seeded).
#[derive(Clone, Debug)]
pub(crate) struct IdSource {
    rng: u64,
    tid_high: u32,
    tid_low: u32,
    pub(crate) comm_id_salt: u32,
}

impl IdSource {
    pub(crate) fn new(seed: u64) -> IdSource {
        // A zero state would stay zero; any other value works.
        let mut source = IdSource {
            rng: seed ^ 0x9e37_79b9_7f4a_7c15,
            tid_high: 0,
            tid_low: 0,
            comm_id_salt: 0,
        };
        if source.rng == 0 {
            source.rng = 1;
        }
        // CAST: keep the high half as the agent's TID prefix, the low half
        // as the comm ID salt.
        let first = source.next_u64();
        source.tid_high = (first >> 32) as u32;
        source.comm_id_salt = first as u32;
        source
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        let mut x = self.rng;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A new transaction ID: the agent's 32-bit prefix and a counter (the
    /// shape of Linux `cm_form_tid`: agent high half, per-agent low half).
    pub(crate) fn next_tid(&mut self) -> u64 {
        self.tid_low = self.tid_low.wrapping_add(1);
        (u64::from(self.tid_high) << 32) | u64::from(self.tid_low)
    }

    /// A random 24-bit starting PSN.
    pub(crate) fn next_psn(&mut self) -> Psn {
        // CAST: only the low 24 bits are kept.
        Psn::from_low_bits(self.next_u64() as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_index_their_counters() {
        for (i, reason) in DropReason::ALL.iter().enumerate() {
            assert_eq!(reason.index(), i);
            assert!(!reason.to_string().is_empty());
        }
        let mut stats = CmStats::default();
        stats.count_drop(DropReason::Duplicate);
        stats.count_drop(DropReason::Duplicate);
        stats.count_drop(DropReason::Truncated);
        assert_eq!(stats.dropped(DropReason::Duplicate), 2);
        assert_eq!(stats.dropped_total(), 3);
    }

    #[test]
    fn ids_are_seeded_and_distinct() {
        let mut a = IdSource::new(7);
        let mut b = IdSource::new(7);
        assert_eq!(a.next_tid(), b.next_tid());
        let t1 = a.next_tid();
        let t2 = a.next_tid();
        assert_ne!(t1, t2);
        assert_eq!(t1 >> 32, t2 >> 32);
        assert_ne!(IdSource::new(8).comm_id_salt, a.comm_id_salt);
        let psn = a.next_psn();
        assert!(psn.get() <= 0xff_ffff);
    }
}
