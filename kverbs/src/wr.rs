//! Work requests and work completions, as the consumer sees them.
//!
//! A work request names its memory with [`Sge`]s (address, length, lkey,
//! built from a registered [`crate::mr::Mr`] or a fast-registered
//! [`crate::mr::FrMr`]) or carries inline bytes. A signalled request carries
//! the consumer's context `C` ([`Signal::Signalled`]); the completion hands
//! exactly that value back ([`Completion::context`]) — the Linux `ib_cqe`
//! idea, with the type system instead of a `u64` cast back to a pointer.

use hca_lowlevel::cqe::{CqeOpcode, CqeRepr, Syndrome};
use hca_lowlevel::device::{AccessFlags, Gid};
use hca_lowlevel::dma::PhysAddr;
use hca_lowlevel::wqe::{DataSegRepr, SendOpcode};

/// A gather/scatter entry: `len` bytes at `addr` under `lkey`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Sge {
    /// Address (an I/O virtual address of the MR that `lkey` names, or a
    /// physical address with the device's reserved lkey).
    pub addr: u64,
    /// Bytes.
    pub len: u32,
    /// Local key.
    pub lkey: u32,
}

impl Sge {
    pub(crate) fn seg(&self) -> DataSegRepr {
        DataSegRepr {
            byte_count: self.len,
            lkey: self.lkey,
            addr: self.addr,
        }
    }
}

/// Whether a send-queue request produces a completion.
#[derive(Debug, PartialEq, Eq)]
pub enum Signal<C> {
    /// No completion on success (selective signalling). Its send-queue
    /// space is reclaimed when a later signalled request completes; if it
    /// fails or is flushed, the completion carries no context.
    Unsignalled,
    /// A completion carrying this context.
    Signalled(C),
}

impl<C> Signal<C> {
    pub(crate) fn into_context(self) -> Option<C> {
        match self {
            Signal::Unsignalled => None,
            Signal::Signalled(c) => Some(c),
        }
    }
}

/// Where a send's or RDMA WRITE's data comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Payload<'a> {
    /// Gather list (possibly empty: a zero-length message).
    Sges(&'a [Sge]),
    /// Bytes copied into the WQE itself (no lkey needed; the buffer may be
    /// reused as soon as the post returns).
    Inline(&'a [u8]),
}

/// Options shared by every send-queue request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct SendFlags {
    /// Wait for every earlier RDMA READ to complete first (IBA fence).
    pub fence: bool,
    /// Ask the receiver for a solicited event.
    pub solicited: bool,
}

/// A SEND (RC or UD).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SendWr<'a> {
    /// The message.
    pub payload: Payload<'a>,
    /// Immediate data (SEND with immediate).
    pub imm: Option<u32>,
    /// RC only: the rkey the receiver must invalidate (SEND with
    /// invalidate). Exclusive with `imm`.
    pub invalidate: Option<u32>,
    /// Fence / solicited.
    pub flags: SendFlags,
}

impl<'a> SendWr<'a> {
    /// A plain SEND of `payload`.
    pub fn new(payload: Payload<'a>) -> Self {
        SendWr {
            payload,
            imm: None,
            invalidate: None,
            flags: SendFlags::default(),
        }
    }
}

/// An RDMA WRITE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteWr<'a> {
    /// Local data.
    pub payload: Payload<'a>,
    /// Remote address.
    pub remote_addr: u64,
    /// Remote key.
    pub rkey: u32,
    /// Immediate data (RDMA WRITE with immediate; consumes a receive at
    /// the peer).
    pub imm: Option<u32>,
    /// Fence / solicited.
    pub flags: SendFlags,
}

/// An RDMA READ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadWr<'a> {
    /// Where the data lands.
    pub local: &'a [Sge],
    /// Remote address.
    pub remote_addr: u64,
    /// Remote key.
    pub rkey: u32,
    /// Fence.
    pub flags: SendFlags,
}

/// A UD destination: the address vector of one datagram.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct UdDest {
    /// Remote QP number (1 for the GSI QP).
    pub qpn: u32,
    /// Q_Key (ignored for sends from the GSI QP: QP1 always uses the GSI
    /// Q_Key).
    pub qkey: u32,
    /// Remote GID.
    pub dgid: Gid,
    /// Traffic class.
    pub traffic_class: u8,
    /// Hop limit.
    pub hop_limit: u8,
    /// Flow label (20 bits).
    pub flow_label: u32,
    /// Service level.
    pub sl: u8,
}

/// A fast registration (REG_MR by work request) of a page list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FastReg<'a> {
    /// Physical pages, each `1 << page_shift` bytes and aligned to it.
    pub pages: &'a [PhysAddr],
    /// log2 of the page size (12..=30).
    pub page_shift: u8,
    /// I/O virtual address of the region's first byte; its offset within
    /// a page applies to the first page (the NDK first-byte offset).
    pub iova: u64,
    /// Length in bytes.
    pub length: u64,
    /// Exactly the rights to grant (nothing is added).
    pub access: AccessFlags,
}

/// What a completion reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WcStatus {
    /// Done.
    Success,
    /// Flushed: the QP was (or went) in error before the request ran.
    Flushed,
    /// Failed with this syndrome (`None`: a syndrome this crate does not
    /// name; the raw byte is in [`Completion::raw_syndrome`]).
    Error(Option<Syndrome>),
}

/// Which operation completed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WcOpcode {
    /// SEND (any flavour).
    Send,
    /// RDMA WRITE (any flavour).
    RdmaWrite,
    /// RDMA READ.
    RdmaRead,
    /// Fast registration.
    RegMr,
    /// Local invalidate.
    LocalInv,
    /// No-operation.
    Nop,
    /// A receive consumed by a SEND.
    Recv,
    /// A receive consumed by an RDMA WRITE with immediate.
    RecvRdmaWithImm,
}

impl WcOpcode {
    pub(crate) fn from_send(op: u8) -> Self {
        match SendOpcode::from_u8(op) {
            Ok(SendOpcode::RdmaWrite | SendOpcode::RdmaWriteImm) => Self::RdmaWrite,
            Ok(SendOpcode::RdmaRead) => Self::RdmaRead,
            Ok(SendOpcode::RegMr) => Self::RegMr,
            Ok(SendOpcode::LocalInval) => Self::LocalInv,
            Ok(SendOpcode::Nop) => Self::Nop,
            _ => Self::Send,
        }
    }

    /// True for the receive-queue opcodes.
    pub fn is_recv(self) -> bool {
        matches!(self, Self::Recv | Self::RecvRdmaWithImm)
    }
}

/// The global route header a UD receive starts with (RoCE: the IP header
/// rendered as a GRH), decoded by kverbs from the receive buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grh {
    /// Source GID (the sender's port).
    pub sgid: Gid,
    /// Destination GID (this port).
    pub dgid: Gid,
    /// Traffic class.
    pub traffic_class: u8,
    /// Flow label.
    pub flow_label: u32,
    /// Hop limit.
    pub hop_limit: u8,
}

/// Bytes of the GRH at the start of every UD receive buffer.
pub const GRH_LEN: usize = 40;

impl Grh {
    /// Decodes the 40-byte GRH (IPv6 header layout).
    pub fn parse(b: &[u8; GRH_LEN]) -> Self {
        let w0 = u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
        let mut sgid = [0u8; 16];
        sgid.copy_from_slice(&b[8..24]);
        let mut dgid = [0u8; 16];
        dgid.copy_from_slice(&b[24..40]);
        Grh {
            sgid: Gid(sgid),
            dgid: Gid(dgid),
            traffic_class: ((w0 >> 20) & 0xff) as u8,
            flow_label: w0 & 0xf_ffff,
            hop_limit: b[7],
        }
    }
}

/// Where a UD receive came from (what the CM needs of a MAD).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UdSource {
    /// The sender's QP number.
    pub src_qpn: u32,
    /// P_Key table index the packet matched.
    pub pkey_index: u16,
    /// The P_Key at that index.
    pub pkey: u16,
    /// The GRH, when the receive was posted with
    /// [`crate::qp::RecvBatch::recv_ud`] (kverbs reads it out of the
    /// buffer) and the device marked it present.
    pub grh: Option<Grh>,
}

/// One work completion, with the context its request carried.
#[derive(Debug, PartialEq, Eq)]
pub struct Completion<C> {
    /// The QP it belongs to.
    pub qpn: u32,
    /// The request's context (`None` only for an unsignalled send-queue
    /// request that failed or was flushed).
    pub context: Option<C>,
    /// Outcome.
    pub status: WcStatus,
    /// The raw error syndrome (0 on success).
    pub raw_syndrome: u8,
    /// Operation.
    pub opcode: WcOpcode,
    /// Bytes received (receives; including the 40-byte GRH on UD) or read
    /// (RDMA READ).
    pub byte_len: u32,
    /// Immediate data, if the message carried one.
    pub imm: Option<u32>,
    /// The rkey a SEND with invalidate invalidated here.
    pub invalidated_rkey: Option<u32>,
    /// UD receives: the sender.
    pub ud: Option<UdSource>,
    /// The receiver was asked for a solicited event.
    pub solicited: bool,
}

impl<C> Completion<C> {
    /// True for a successful completion.
    pub fn is_success(&self) -> bool {
        self.status == WcStatus::Success
    }

    pub(crate) fn from_cqe(cqe: &CqeRepr, send: bool, context: Option<C>) -> Self {
        let status = if cqe.opcode.is_error() {
            match cqe.error() {
                Some(Syndrome::WrFlush) => WcStatus::Flushed,
                other => WcStatus::Error(other),
            }
        } else {
            WcStatus::Success
        };
        let opcode = if send {
            WcOpcode::from_send(cqe.wqe_opcode)
        } else if cqe.opcode == CqeOpcode::RespWrImm {
            WcOpcode::RecvRdmaWithImm
        } else {
            WcOpcode::Recv
        };
        let imm = matches!(cqe.opcode, CqeOpcode::RespSendImm | CqeOpcode::RespWrImm)
            .then_some(cqe.imm_inval_pkey);
        let invalidated_rkey = (cqe.opcode == CqeOpcode::RespSendInv).then_some(cqe.imm_inval_pkey);
        Completion {
            qpn: cqe.qpn,
            context,
            status,
            raw_syndrome: cqe.syndrome,
            opcode,
            byte_len: cqe.byte_cnt,
            imm,
            invalidated_rkey,
            ud: None,
            solicited: cqe.solicited,
        }
    }
}
