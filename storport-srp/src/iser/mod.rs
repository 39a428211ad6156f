//! The iSER initiator engine: the [`Transport`](crate::miniport::transport::Transport)
//! the miniport core drives, speaking iSCSI over RDMA (RFC 7145) as Linux
//! `ib_iser` does against LIO's `isert`.
//!
//! The iSCSI half is the sans-IO [`crate::iscsi`] machinery (login,
//! full-feature session, ERL0 recovery); this module carries it over
//! kverbs:
//!
//! * **Connect** over RDMA/CM with the 4-byte iSER CM header in the REQ
//!   private data: `ZBVA_NOT_SUPPORTED` always (no zero-based addressing),
//!   `SEND_WITH_INVALIDATE_NOT_SUPPORTED` only when
//!   [`IserConfig::accept_remote_invalidate`] is off. The target's REP flags
//!   say whether it will invalidate remotely; only then is a SEND with
//!   invalidate accepted.
//! * **Login** one PDU at a time over a single login receive buffer
//!   (`isert` posts one and reposts it only after answering); when the
//!   final response arrives the full-feature receive ring, sized from
//!   `InitiatorRecvDataSegmentLength`, is posted, and the session is
//!   created on the engine's passive worker (it allocates its task table).
//! * **Commands**: per I/O one fast-registered MR with a rotated key and
//!   only the access the direction needs (remote write for a READ, remote
//!   read for a WRITE); the iSER header carries the read STag/VA, or the
//!   write STag with the VA past the immediate and unsolicited data already
//!   sent (`isert` adds no offset). Immediate data travels in the command
//!   PDU, gathered by the HCA from the request's own buffer behind the
//!   header built in the send buffer (copied there only when the buffer has
//!   more segments than the SEND gathers, or with
//!   [`IserConfig::gather_immediate`] off); unsolicited Data-Out PDUs
//!   follow it in the same doorbell, copied.
//!   A buffer one MR cannot map (a scatter/gather list with gaps inside a
//!   page run) is refused as unsupported: iSER has one STag per direction.
//! * **Fence before completing**: a SCSI Response received with invalidate
//!   must name exactly the command's registered key (anything else, or an
//!   invalidation the target did not announce, is a protocol breach that
//!   ends the connection, as `iser_check_remote_inv` does); otherwise a
//!   LOCAL_INV is posted and its completion fences. A command completes
//!   only when its SEND completed, its response is in and its MR is fenced
//!   (or the QP flushed).
//! * **Flow control** is the CmdSN window ([`crate::iscsi::session`]):
//!   no window room is "busy", and `credits_available` follows when a
//!   response opens it.
//! * **Login redirects** (status class 1) are followed at once to the
//!   portal the target's `TargetAddress` names, for that connection only:
//!   a failed connect there, or the loss of the redirected connection, sends
//!   the next attempt to the configured portal again.
//! * **Recovery** is ERL0 session reinstatement: on any connection
//!   failure the QP is flushed, every command completes with the failure
//!   the recovery machine names, and a new login (same ISID, TSIH 0)
//!   follows after the reconnect delay, with the fast-fail and device-loss
//!   timers of [`crate::iscsi::recovery`].
//!
//! # Locks
//! One lock per target holds the session, the login, the command slots and
//! the connection; sends are posted under it (the session's author notes:
//! CmdSN order is the posting order). Order: target lock → kverbs'
//! send-queue lock → kverbs' MR-pool lock. No upcall is made and no CM call
//! is issued with it held.
//!
//! # IRQL
//! [`IserTransport::new`], `start` and `stop` run at `PASSIVE_LEVEL`;
//! everything else at <= `DISPATCH_LEVEL`, without allocation. Dropping a
//! started handle queues `stop` on the engine's worker (see
//! [`IserTransport`]).

mod engine;

pub use engine::UNSOLICITED_MAX;

pub use crate::miniport::transport::EngineProbe;
pub use engine::{IserConfig, IserError, IserPrepared, IserStats, IserTransport};
