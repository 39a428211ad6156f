//! Errors of the verbs objects: one enum for the control path, and the
//! posting error that hands the unposted request back.

use core::fmt;

use hca_lowlevel::device::HcaError;
use hca_lowlevel::dma::DmaError;

use crate::platform::AllocError;
use crate::worker::RejectReason;

/// Why a control-path (slow-path) operation failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum VerbsError {
    /// The device refused the firmware command.
    Hca(HcaError),
    /// Non-paged pool (or a DPC / work item) could not be allocated.
    Alloc,
    /// Device-visible memory could not be allocated.
    Dma(DmaError),
    /// An argument is out of range (a size of zero, more than the device
    /// allows, a port that does not exist...).
    InvalidArgument,
    /// The CQ is too small for the queues that would complete on it (a CQ
    /// overrun would put the CQ and its QPs in error).
    CqTooSmall,
    /// A fixed-capacity table (QPs per CQ, objects per device) is full.
    TableFull,
    /// The object's request queue is full; try again after a completion.
    QueueFull,
    /// The object is being destroyed (or flushed) and takes no more
    /// requests.
    Closed,
    /// An object still has dependants (a PD with QPs, a CQ with QPs).
    InUse,
    /// The request was cancelled before it ran (object shut down).
    Cancelled,
}

impl From<HcaError> for VerbsError {
    fn from(e: HcaError) -> Self {
        match e {
            HcaError::InUse => Self::InUse,
            other => Self::Hca(other),
        }
    }
}

impl From<AllocError> for VerbsError {
    fn from(_: AllocError) -> Self {
        Self::Alloc
    }
}

impl From<DmaError> for VerbsError {
    fn from(e: DmaError) -> Self {
        Self::Dma(e)
    }
}

impl From<RejectReason> for VerbsError {
    fn from(r: RejectReason) -> Self {
        match r {
            RejectReason::Full => Self::QueueFull,
            RejectReason::Closed => Self::Closed,
        }
    }
}

impl fmt::Display for VerbsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Hca(e) => write!(f, "device: {e}"),
            Self::Alloc => f.write_str("non-paged pool exhausted"),
            Self::Dma(e) => write!(f, "DMA memory: {e}"),
            Self::InvalidArgument => f.write_str("invalid argument"),
            Self::CqTooSmall => f.write_str("CQ too small for the queues attached to it"),
            Self::TableFull => f.write_str("object table full"),
            Self::QueueFull => f.write_str("request queue full"),
            Self::Closed => f.write_str("object closed"),
            Self::InUse => f.write_str("object in use"),
            Self::Cancelled => f.write_str("request cancelled"),
        }
    }
}

/// Why a work request was not posted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PostErrorKind {
    /// The queue has no room for it (send: WQEBBs; receive: slots). Nothing
    /// was written.
    QueueFull,
    /// The QP is being flushed or destroyed: no new work is accepted.
    Flushing,
    /// More gather/scatter entries than the queue allows.
    TooManySge,
    /// Inline data longer than the QP allows.
    InlineTooLong,
    /// The operation does not exist on this QP type (RDMA on UD, a UD
    /// send without an address, invalidate on UD...).
    WrongQpType,
    /// A fast-registration request is malformed (no pages, too many pages,
    /// a page size the device does not take, a region that does not fit
    /// the pages, illegal access flags) or names an MR of another PD.
    BadRegistration,
    /// LOCAL_INV on a fast-registration MR that is not registered.
    NotRegistered,
    /// The WQE could not be built (an internal size error).
    Format,
}

impl fmt::Display for PostErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            Self::QueueFull => "queue full",
            Self::Flushing => "QP flushing",
            Self::TooManySge => "too many SGEs",
            Self::InlineTooLong => "inline data too long",
            Self::WrongQpType => "operation not valid for this QP type",
            Self::BadRegistration => "malformed fast registration",
            Self::NotRegistered => "MR not registered",
            Self::Format => "WQE format error",
        };
        f.write_str(s)
    }
}

/// A refused work request: the reason, and the request's context handed
/// back (mlx5's `bad_wr`, Tock style) so the caller loses nothing.
#[derive(Debug, PartialEq, Eq)]
pub struct PostError<C> {
    /// Why.
    pub kind: PostErrorKind,
    /// The context the request carried (`None` for an unsignalled one).
    pub context: Option<C>,
}

impl<C> PostError<C> {
    pub(crate) fn new(kind: PostErrorKind, context: Option<C>) -> Self {
        PostError { kind, context }
    }
}

impl<C> fmt::Display for PostError<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "work request not posted: {}", self.kind)
    }
}
