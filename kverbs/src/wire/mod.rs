//! Management datagrams and the connection-manager wire formats.
//!
//! A connection on RoCE (or IB) is set up by the IB CM exchanging MADs on
//! QP1: REQ → REP → RTU, with REJ, MRA, DREQ and DREP around them
//! (IBA chapter 12). RDMA/CM puts its own 36-byte header at the start of
//! the REQ private data and encodes its port space and port in the
//! service ID. This module is those formats, and nothing else: no state,
//! no timers (the CM state machine lives elsewhere in `kverbs`).
//!
//! The shape is the one of `hca_lowlevel::wire`: a view `Foo<T: AsRef<[u8]>>`
//! with `new_unchecked`/`new_checked`/`check_len`, getters and setters that
//! never panic, and a `FooRepr` with `parse`, `emit` and `buffer_len`. Views
//! of CM messages cover the 232 bytes that follow the 24-byte MAD header
//! (offsets as in IBA tables 106-113, relative to the end of the MAD header;
//! bit fields are numbered MSB first). [`CmMadRepr`] parses and emits a
//! whole 256-byte CM MAD.
//!
//! Every byte here arrives from the network: parsers are total, never
//! allocate, and map each malformed input to one specific [`Error`].
//!
//! # IRQL
//!
//! Everything here is pure computation over caller-provided buffers: no
//! allocation, no locks, no blocking, bounded time. Every function may be
//! called at any IRQL, DISPATCH_LEVEL included.

#![forbid(unsafe_code)]

#[macro_use]
mod macros;

pub mod cm;
mod cma;
mod mad;
mod service_id;

pub use cm::{
    CmDrep, CmDrepRepr, CmDreq, CmDreqRepr, CmMadRepr, CmMessage, CmMessageKind, CmMra, CmMraRepr,
    CmPath, CmPathRepr, CmRej, CmRejRepr, CmRep, CmRepRepr, CmReq, CmReqRepr, CmRtu, CmRtuRepr,
    IbTimeout, PathMtu, RejectReason, TransportServiceType,
};
pub use cma::{CMA_HEADER_LEN, CmaAddresses, CmaHeader, CmaHeaderRepr};
pub use mad::{MAD_DATA_LEN, MAD_HEADER_LEN, MAD_LEN, MadHeader, MadHeaderRepr, attribute, method};
pub use service_id::{PortSpace, ServiceId};

/// Why a MAD or CM message could not be parsed or emitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Error {
    /// The buffer is shorter than the MAD or message it must hold.
    Truncated,
    /// An emit target is shorter than the representation's `buffer_len`.
    BufferTooShort,
    /// The MAD base version is not 1.
    BadBaseVersion(u8),
    /// The management class is not the one expected (CM: 0x07).
    UnexpectedMgmtClass(u8),
    /// The CM class version is not 2.
    BadClassVersion(u8),
    /// The method is not Send (0x03), the only one the CM uses.
    UnexpectedMethod(u8),
    /// A CM attribute this module does not handle (SIDR, LAP, APR,
    /// ClassPortInfo, or an unknown one).
    UnsupportedAttribute(u16),
    /// The REQ path MTU code is reserved (valid: 1..=5).
    BadPathMtu(u8),
    /// The "message MRAed/rejected" field holds the reserved value 3.
    ReservedMessageKind(u8),
    /// The REJ reject-info length exceeds the 72-byte ARI field.
    BadRejectInfoLength(u8),
    /// Private data longer than the message can carry (the maximum given).
    PrivateDataTooLong(usize),
    /// A value does not fit the bit field it is emitted into (field named).
    FieldOutOfRange(&'static str),
    /// The RDMA/CM header version is not 0.
    BadCmaVersion(u8),
    /// The RDMA/CM header IP version is neither 4 nor 6.
    BadCmaIpVersion(u8),
}

impl core::fmt::Display for Error {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match *self {
            Error::Truncated => f.write_str("truncated MAD"),
            Error::BufferTooShort => f.write_str("emit buffer too short"),
            Error::BadBaseVersion(v) => write!(f, "MAD base version {v} (expected 1)"),
            Error::UnexpectedMgmtClass(c) => write!(f, "management class {c:#04x}"),
            Error::BadClassVersion(v) => write!(f, "CM class version {v} (expected 2)"),
            Error::UnexpectedMethod(m) => write!(f, "MAD method {m:#04x} (expected Send)"),
            Error::UnsupportedAttribute(a) => write!(f, "unsupported CM attribute {a:#06x}"),
            Error::BadPathMtu(m) => write!(f, "reserved path MTU code {m}"),
            Error::ReservedMessageKind(k) => write!(f, "reserved message kind {k}"),
            Error::BadRejectInfoLength(l) => write!(f, "reject info length {l} > 72"),
            Error::PrivateDataTooLong(max) => write!(f, "private data longer than {max}"),
            Error::FieldOutOfRange(name) => write!(f, "value out of range for {name}"),
            Error::BadCmaVersion(v) => write!(f, "RDMA/CM header version {v}"),
            Error::BadCmaIpVersion(v) => write!(f, "RDMA/CM header IP version {v}"),
        }
    }
}

/// Shorthand for results of this module.
pub type Result<T> = core::result::Result<T, Error>;

/// Fail with [`Error::FieldOutOfRange`] naming `name` unless `value <= max`.
pub(crate) fn check_range(value: u32, max: u32, name: &'static str) -> Result<()> {
    if value <= max {
        Ok(())
    } else {
        Err(Error::FieldOutOfRange(name))
    }
}

#[cfg(test)]
mod tests;
