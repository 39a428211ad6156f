//! The device interface kverbs drives.
//!
//! Three parts, as on real hardware:
//!
//! * **Control** ([`HcaDevice`]): query, PD, CQ, QP and MR management. On a
//!   real HCA these are firmware commands that wait for the firmware to
//!   answer, so every control method may block: **PASSIVE_LEVEL only**.
//! * **Data path** (the resources control returns): the send, receive and
//!   completion rings ([`crate::ring`]), their doorbell records and doorbell
//!   registers ([`crate::doorbell`]). kverbs writes WQEs and reads CQEs itself;
//!   there is no `post_send` here. Nothing on the data path blocks.
//! * **Events**: a completion event per CQ, delivered to the
//!   [`CqEventHandler`] given at CQ creation (one event per arm; arming while
//!   CQEs are pending fires at once), and asynchronous events
//!   ([`AsyncEvent`]) to the handler set with
//!   [`HcaDevice::set_async_event_handler`].
//!
//! The QP state machine's attribute rules (IBA 11.2.5, as Linux's
//! `ib_modify_qp_is_ok` tabulates them) are in [`transition_rule`] and
//! [`check_modify`], so a device and kverbs apply the same table.

#![forbid(unsafe_code)]

use alloc::sync::Arc;
use core::fmt;

use bitflags::bitflags;

use crate::dma::{DmaAllocator, DmaBuffer, DmaError, PhysAddr};
use crate::doorbell::{CqDoorbellRecord, DoorbellRegister, QpDoorbellRecord};
use crate::ring::{CqRing, RecvRing, RingError, SendRing};

bitflags! {
    /// Memory and QP access rights (`IB_ACCESS_*` subset).
    #[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Default)]
    pub struct AccessFlags: u32 {
        /// The HCA may write the memory locally (receives, READ responses).
        const LOCAL_WRITE = 1;
        /// Remote peers may RDMA WRITE it.
        const REMOTE_WRITE = 2;
        /// Remote peers may RDMA READ it.
        const REMOTE_READ = 4;
        /// Remote peers may perform atomics on it (not executed by the sim).
        const REMOTE_ATOMIC = 8;
    }
}

impl AccessFlags {
    /// True if the combination is legal for an MR: remote write or atomic
    /// access requires local write (IBA 10.6.3.1).
    #[must_use]
    pub const fn is_valid_for_mr(self) -> bool {
        !self.intersects(Self::REMOTE_WRITE.union(Self::REMOTE_ATOMIC))
            || self.contains(Self::LOCAL_WRITE)
    }

    /// True if any remote right is granted (the key is usable as an rkey).
    #[must_use]
    pub const fn is_remote(self) -> bool {
        self.intersects(
            Self::REMOTE_WRITE
                .union(Self::REMOTE_READ)
                .union(Self::REMOTE_ATOMIC),
        )
    }
}

pub use crate::wire::Gid;

/// IBA path MTU (enum values as in the CM REQ / `ib_mtu`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
#[repr(u8)]
pub enum Mtu {
    /// 256 bytes.
    Mtu256 = 1,
    /// 512 bytes.
    Mtu512 = 2,
    /// 1024 bytes (what RoCE over a 1500-byte Ethernet uses).
    #[default]
    Mtu1024 = 3,
    /// 2048 bytes.
    Mtu2048 = 4,
    /// 4096 bytes.
    Mtu4096 = 5,
}

impl Mtu {
    /// Payload bytes per packet.
    #[must_use]
    pub const fn bytes(self) -> u32 {
        128 << (self as u32)
    }

    /// Decodes the IBA enum value.
    #[must_use]
    pub const fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Self::Mtu256,
            2 => Self::Mtu512,
            3 => Self::Mtu1024,
            4 => Self::Mtu2048,
            5 => Self::Mtu4096,
            _ => return None,
        })
    }
}

/// QP transport service.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum QpType {
    /// Reliable connected.
    Rc,
    /// Unreliable datagram.
    Ud,
    /// The general services interface QP (QP1), for management datagrams:
    /// UD with the fixed Q_Key [`GSI_QKEY`], one per port.
    Gsi,
}

impl QpType {
    /// True for the datagram types (UD and GSI).
    #[must_use]
    pub const fn is_datagram(self) -> bool {
        matches!(self, Self::Ud | Self::Gsi)
    }
}

/// The Q_Key every GSI (QP1) datagram carries.
pub const GSI_QKEY: u32 = 0x8001_0000;
/// QP number of the GSI QP.
pub const GSI_QPN: u32 = 1;

/// QP states (IBA 10.3.1).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum QpState {
    /// Reset: nothing is processed; rings are empty.
    Reset,
    /// Initialised: receives may be posted, nothing is processed.
    Init,
    /// Ready to receive.
    Rtr,
    /// Ready to send.
    Rts,
    /// Send queue drain: no new send WQE is started.
    Sqd,
    /// Send queue error (datagram QPs): sends flushed, receives go on.
    Sqe,
    /// Error: everything outstanding is flushed.
    Err,
}

bitflags! {
    /// Which attributes a modify carries (`IB_QP_*`, same bit order).
    #[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Default)]
    pub struct QpAttrMask: u32 {
        /// `state` (always required).
        const STATE = 1 << 0;
        /// `cur_state` (must match the actual state).
        const CUR_STATE = 1 << 1;
        /// `en_sqd_async_notify`.
        const EN_SQD_ASYNC_NOTIFY = 1 << 2;
        /// `access`.
        const ACCESS_FLAGS = 1 << 3;
        /// `pkey_index`.
        const PKEY_INDEX = 1 << 4;
        /// `port`.
        const PORT = 1 << 5;
        /// `qkey`.
        const QKEY = 1 << 6;
        /// `av` (primary path).
        const AV = 1 << 7;
        /// `path_mtu`.
        const PATH_MTU = 1 << 8;
        /// `timeout` (local ACK timeout).
        const TIMEOUT = 1 << 9;
        /// `retry_cnt`.
        const RETRY_CNT = 1 << 10;
        /// `rnr_retry`.
        const RNR_RETRY = 1 << 11;
        /// `rq_psn`.
        const RQ_PSN = 1 << 12;
        /// `max_rd_atomic` (initiator depth).
        const MAX_QP_RD_ATOMIC = 1 << 13;
        /// Alternate path (not supported by this device).
        const ALT_PATH = 1 << 14;
        /// `min_rnr_timer`.
        const MIN_RNR_TIMER = 1 << 15;
        /// `sq_psn`.
        const SQ_PSN = 1 << 16;
        /// `max_dest_rd_atomic` (responder resources).
        const MAX_DEST_RD_ATOMIC = 1 << 17;
        /// Path migration state (not supported by this device).
        const PATH_MIG_STATE = 1 << 18;
        /// `dest_qpn`.
        const DEST_QPN = 1 << 20;
    }
}

/// The destination of an RC QP (primary path), or of a UD send.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
pub struct AddressVector {
    /// Destination GID.
    pub dgid: Gid,
    /// Index of the source GID in the port's table.
    pub sgid_index: u8,
    /// Hop limit (IPv4 TTL on RoCEv2).
    pub hop_limit: u8,
    /// Traffic class.
    pub traffic_class: u8,
    /// Flow label (20 bits).
    pub flow_label: u32,
    /// Service level.
    pub sl: u8,
}

/// QP attributes for modify and query (`ib_qp_attr` subset).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct QpAttr {
    /// Target (modify) or current (query) state.
    pub state: QpState,
    /// Expected current state (with [`QpAttrMask::CUR_STATE`]).
    pub cur_state: QpState,
    /// Request a [`AsyncEvent::SqDrained`] when RTS→SQD completes.
    pub en_sqd_async_notify: bool,
    /// Remote access the QP's responder allows.
    pub access: AccessFlags,
    /// P_Key table index.
    pub pkey_index: u16,
    /// Port (1-based).
    pub port: u8,
    /// Q_Key (datagram QPs).
    pub qkey: u32,
    /// Primary path (RC).
    pub av: AddressVector,
    /// Path MTU (RC).
    pub path_mtu: Mtu,
    /// Local ACK timeout exponent: 4.096 µs × 2^timeout; 0 = infinite.
    pub timeout: u8,
    /// Transport retries (0..=7).
    pub retry_cnt: u8,
    /// RNR retries (0..=7; 7 = infinite).
    pub rnr_retry: u8,
    /// Expected PSN of the first request to receive.
    pub rq_psn: u32,
    /// PSN of the first request to send.
    pub sq_psn: u32,
    /// Initiator depth: RDMA READs this QP may have outstanding.
    pub max_rd_atomic: u8,
    /// Responder resources: RDMA READs this QP accepts outstanding.
    pub max_dest_rd_atomic: u8,
    /// RNR NAK timer code this QP's responder advertises (0..=31).
    pub min_rnr_timer: u8,
    /// Remote QP number (RC).
    pub dest_qpn: u32,
}

impl Default for QpAttr {
    fn default() -> Self {
        Self {
            state: QpState::Reset,
            cur_state: QpState::Reset,
            en_sqd_async_notify: false,
            access: AccessFlags::empty(),
            pkey_index: 0,
            port: 1,
            qkey: 0,
            av: AddressVector::default(),
            path_mtu: Mtu::Mtu1024,
            timeout: 0,
            retry_cnt: 0,
            rnr_retry: 0,
            rq_psn: 0,
            sq_psn: 0,
            max_rd_atomic: 0,
            max_dest_rd_atomic: 0,
            min_rnr_timer: 0,
            dest_qpn: 0,
        }
    }
}

/// What a state transition requires and allows.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct TransitionRule {
    /// Attributes that must be present (besides `STATE`).
    pub required: QpAttrMask,
    /// Attributes that may be present.
    pub optional: QpAttrMask,
}

/// Why a modify was rejected.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ModifyError {
    /// The state machine has no such edge for this QP type.
    InvalidTransition {
        /// Current state.
        from: QpState,
        /// Requested state.
        to: QpState,
    },
    /// Required attributes are missing (the bits listed).
    MissingAttributes(QpAttrMask),
    /// Attributes not allowed on this transition (the bits listed).
    UnexpectedAttributes(QpAttrMask),
    /// `cur_state` was given and is not the QP's state.
    CurrentStateMismatch {
        /// The QP's actual state.
        actual: QpState,
    },
    /// An attribute's value is out of range (the bit names it).
    InvalidValue(QpAttrMask),
}

impl fmt::Display for ModifyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::InvalidTransition { from, to } => {
                write!(f, "no QP transition {from:?} -> {to:?}")
            }
            Self::MissingAttributes(m) => write!(f, "missing required QP attributes {m:?}"),
            Self::UnexpectedAttributes(m) => write!(f, "QP attributes not allowed here {m:?}"),
            Self::CurrentStateMismatch { actual } => {
                write!(f, "cur_state does not match actual state {actual:?}")
            }
            Self::InvalidValue(m) => write!(f, "QP attribute value out of range {m:?}"),
        }
    }
}

/// The IBA attribute rule for `from → to` on a QP of type `ty`, or `None` if
/// the transition does not exist. (Linux `qp_state_table`, RC/UD/GSI columns.)
#[must_use]
pub fn transition_rule(ty: QpType, from: QpState, to: QpState) -> Option<TransitionRule> {
    use QpAttrMask as M;
    use QpState::{Err, Init, Reset, Rtr, Rts, Sqd, Sqe};
    let none = M::empty();
    let rule = |required: M, optional: M| Some(TransitionRule { required, optional });
    let rc = ty == QpType::Rc;
    match (from, to) {
        (_, Reset) => rule(none, none),
        (_, Err) => rule(none, none),
        (Reset, Init) => match ty {
            QpType::Rc => rule(M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS, none),
            QpType::Ud => rule(M::PKEY_INDEX | M::PORT | M::QKEY, none),
            QpType::Gsi => rule(M::PKEY_INDEX | M::QKEY, none),
        },
        (Init, Init) => match ty {
            QpType::Rc => rule(none, M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS),
            QpType::Ud => rule(none, M::PKEY_INDEX | M::PORT | M::QKEY),
            QpType::Gsi => rule(none, M::PKEY_INDEX | M::QKEY),
        },
        (Init, Rtr) => {
            if rc {
                rule(
                    M::AV
                        | M::PATH_MTU
                        | M::DEST_QPN
                        | M::RQ_PSN
                        | M::MAX_DEST_RD_ATOMIC
                        | M::MIN_RNR_TIMER,
                    M::ALT_PATH | M::ACCESS_FLAGS | M::PKEY_INDEX,
                )
            } else {
                rule(none, M::PKEY_INDEX | M::QKEY)
            }
        }
        (Rtr, Rts) => {
            if rc {
                rule(
                    M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::SQ_PSN | M::MAX_QP_RD_ATOMIC,
                    M::CUR_STATE
                        | M::ALT_PATH
                        | M::ACCESS_FLAGS
                        | M::MIN_RNR_TIMER
                        | M::PATH_MIG_STATE,
                )
            } else {
                rule(M::SQ_PSN, M::CUR_STATE | M::QKEY)
            }
        }
        (Rts, Rts) | (Sqd, Rts) => {
            if rc {
                rule(
                    none,
                    M::CUR_STATE
                        | M::ACCESS_FLAGS
                        | M::ALT_PATH
                        | M::PATH_MIG_STATE
                        | M::MIN_RNR_TIMER,
                )
            } else {
                rule(none, M::CUR_STATE | M::QKEY)
            }
        }
        (Rts, Sqd) => rule(none, M::EN_SQD_ASYNC_NOTIFY),
        (Sqd, Sqd) => {
            if rc {
                rule(
                    none,
                    M::AV
                        | M::ALT_PATH
                        | M::ACCESS_FLAGS
                        | M::PKEY_INDEX
                        | M::MIN_RNR_TIMER
                        | M::PATH_MIG_STATE
                        | M::TIMEOUT
                        | M::RETRY_CNT
                        | M::RNR_RETRY
                        | M::MAX_QP_RD_ATOMIC
                        | M::MAX_DEST_RD_ATOMIC,
                )
            } else {
                rule(none, M::PKEY_INDEX | M::QKEY)
            }
        }
        (Sqe, Rts) => {
            if rc {
                None
            } else {
                rule(none, M::CUR_STATE | M::QKEY)
            }
        }
        _ => None,
    }
}

/// Attributes this device does not implement even where IBA allows them.
pub const UNSUPPORTED_ATTRIBUTES: QpAttrMask =
    QpAttrMask::ALT_PATH.union(QpAttrMask::PATH_MIG_STATE);

/// Checks a modify against the transition table and the universal value
/// ranges; returns the new state. Device-specific limits (port count, read
/// depths, P_Key table) are the device's to check.
///
/// # Errors
/// The specific [`ModifyError`].
pub fn check_modify(
    ty: QpType,
    current: QpState,
    attr: &QpAttr,
    mask: QpAttrMask,
) -> Result<QpState, ModifyError> {
    if !mask.contains(QpAttrMask::STATE) {
        return Err(ModifyError::MissingAttributes(QpAttrMask::STATE));
    }
    if mask.contains(QpAttrMask::CUR_STATE) && attr.cur_state != current {
        return Err(ModifyError::CurrentStateMismatch { actual: current });
    }
    let rule = transition_rule(ty, current, attr.state).ok_or(ModifyError::InvalidTransition {
        from: current,
        to: attr.state,
    })?;
    let given = mask.difference(QpAttrMask::STATE);
    let missing = rule.required.difference(given);
    if !missing.is_empty() {
        return Err(ModifyError::MissingAttributes(missing));
    }
    let allowed = rule.required.union(rule.optional);
    // CUR_STATE is harmless wherever it matched; IBA lists it per edge, Linux
    // accepts it as a check. Be strict: only where the table allows it.
    let extra = given.difference(allowed);
    if !extra.is_empty() {
        return Err(ModifyError::UnexpectedAttributes(extra));
    }
    let unsupported = given.intersection(UNSUPPORTED_ATTRIBUTES);
    if !unsupported.is_empty() {
        return Err(ModifyError::UnexpectedAttributes(unsupported));
    }
    let checks: [(QpAttrMask, bool); 7] = [
        (QpAttrMask::TIMEOUT, attr.timeout <= 31),
        (QpAttrMask::RETRY_CNT, attr.retry_cnt <= 7),
        (QpAttrMask::RNR_RETRY, attr.rnr_retry <= 7),
        (QpAttrMask::MIN_RNR_TIMER, attr.min_rnr_timer <= 31),
        (QpAttrMask::RQ_PSN, attr.rq_psn <= 0xff_ffff),
        (QpAttrMask::SQ_PSN, attr.sq_psn <= 0xff_ffff),
        (
            QpAttrMask::DEST_QPN,
            attr.dest_qpn <= 0xff_ffff && attr.dest_qpn != 0,
        ),
    ];
    for (bit, ok) in checks {
        if given.contains(bit) && !ok {
            return Err(ModifyError::InvalidValue(bit));
        }
    }
    if given.contains(QpAttrMask::AV) && attr.av.flow_label > 0xf_ffff {
        return Err(ModifyError::InvalidValue(QpAttrMask::AV));
    }
    Ok(attr.state)
}

/// The IBA RNR NAK timer table (code 0..=31) in nanoseconds; code 0 is the
/// longest (655.36 ms).
#[must_use]
pub const fn rnr_timer_ns(code: u8) -> u64 {
    const US_X100: [u64; 32] = [
        65536, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024,
        1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768, 49152,
    ];
    // Units of 10 µs. PANIC: `code & 31` is below the table length (32).
    #[expect(clippy::indexing_slicing, reason = "index masked to the table length")]
    let v = US_X100[(code & 31) as usize];
    v * 10_000
}

/// The local ACK timeout in nanoseconds: 4.096 µs × 2^timeout, or `None`
/// (infinite) for 0.
#[must_use]
pub const fn ack_timeout_ns(timeout: u8) -> Option<u64> {
    if timeout == 0 {
        None
    } else {
        Some(4096u64 << (timeout & 31))
    }
}

/// Device limits (`ib_device_attr` subset).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct DeviceAttr {
    /// Node GUID.
    pub node_guid: u64,
    /// Number of ports.
    pub phys_port_cnt: u8,
    /// Most QPs.
    pub max_qp: u32,
    /// Most WQEBBs in a send queue (and slots in a receive queue).
    pub max_qp_wr: u32,
    /// Most gather segments per send WQE.
    pub max_send_sge: u32,
    /// Most scatter segments per receive WQE.
    pub max_recv_sge: u32,
    /// Most inline bytes in a send WQE.
    pub max_inline_data: u32,
    /// Most CQs.
    pub max_cq: u32,
    /// Most CQEs in one CQ.
    pub max_cqe: u32,
    /// Most PDs.
    pub max_pd: u32,
    /// Most MRs (registered or fast-registration mkeys).
    pub max_mr: u32,
    /// Largest MR in bytes.
    pub max_mr_size: u64,
    /// Most pages in a fast-registration page list.
    pub max_fast_reg_page_list_len: u32,
    /// Most outstanding RDMA READs a QP may accept as responder.
    pub max_qp_rd_atom: u8,
    /// Most outstanding RDMA READs a QP may issue as initiator.
    pub max_qp_init_rd_atom: u8,
    /// The privileged, local-only lkey for physical addresses (like mlx5's
    /// reserved lkey or NDK's privileged token): a data segment with this
    /// lkey names physical memory directly. It is never valid as an rkey.
    pub reserved_lkey: u32,
}

/// Port state.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum PortState {
    /// Link down.
    Down,
    /// Link up and usable.
    Active,
}

/// Port attributes (`ib_port_attr` subset).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct PortAttr {
    /// State.
    pub state: PortState,
    /// Largest MTU the port supports.
    pub max_mtu: Mtu,
    /// MTU of the link.
    pub active_mtu: Mtu,
    /// Entries in the GID table.
    pub gid_tbl_len: u16,
    /// Entries in the P_Key table.
    pub pkey_tbl_len: u16,
}

/// Protection domain number.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Pdn(pub u32);

/// What to create a QP with.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct QpInit {
    /// Transport.
    pub qp_type: QpType,
    /// Protection domain.
    pub pd: Pdn,
    /// CQ for send completions.
    pub send_cq: u32,
    /// CQ for receive completions.
    pub recv_cq: u32,
    /// Send queue size in WQEBBs (rounded up to a power of two).
    pub sq_wqebbs: u32,
    /// Receive queue slots (rounded up to a power of two; may be 0 for
    /// send-only QPs).
    pub rq_entries: u32,
    /// Scatter segments per receive WQE (sets the stride).
    pub max_recv_sge: u32,
    /// Every send WQE completes with a CQE, whatever its CQ_UPDATE bit.
    pub sq_sig_all: bool,
    /// Port (GSI only: the port whose QP1 this is).
    pub port: u8,
}

/// The sizes a QP was actually created with.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct QpCaps {
    /// Send queue WQEBBs (power of two).
    pub sq_wqebbs: u32,
    /// Receive queue slots (power of two, or 0).
    pub rq_entries: u32,
    /// Receive WQE stride in bytes.
    pub rq_stride: u32,
    /// Most gather segments per send WQE.
    pub max_send_sge: u32,
    /// Most scatter segments per receive WQE.
    pub max_recv_sge: u32,
    /// Most inline bytes per send WQE.
    pub max_inline_data: u32,
}

/// The data-path resources of a new QP. kverbs owns them; dropping the ring
/// or record memory before [`HcaDevice::destroy_qp`] makes the device see a
/// fault (the QP goes to error), never undefined behaviour.
#[derive(Debug)]
pub struct QpResources {
    /// QP number.
    pub qpn: u32,
    /// Actual sizes.
    pub caps: QpCaps,
    /// Send ring.
    pub sq: SendRing<DmaBuffer>,
    /// Receive ring.
    pub rq: RecvRing<DmaBuffer>,
    /// Doorbell record (send and receive producer counters).
    pub doorbell_record: QpDoorbellRecord<DmaBuffer>,
    /// Send doorbell register (write the first 8 bytes of the last WQE's
    /// control segment). Receives need no register: the record suffices.
    pub sq_doorbell: Arc<dyn DoorbellRegister>,
}

impl fmt::Debug for dyn DoorbellRegister {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("DoorbellRegister")
    }
}

/// The data-path resources of a new CQ.
#[derive(Debug)]
pub struct CqResources {
    /// CQ number.
    pub cqn: u32,
    /// Ring (initialised to invalid CQEs).
    pub ring: CqRing<DmaBuffer>,
    /// Doorbell record (consumer counter, arm word).
    pub doorbell_record: CqDoorbellRecord<DmaBuffer>,
    /// Arm doorbell register (`CqArm::doorbell_value`).
    pub arm_doorbell: Arc<dyn DoorbellRegister>,
}

/// A memory registration over physical pages.
#[derive(Copy, Clone, Debug)]
pub struct MrRegistration<'a> {
    /// Protection domain.
    pub pd: Pdn,
    /// I/O virtual address of the region's first byte.
    pub iova: u64,
    /// Length in bytes.
    pub length: u64,
    /// log2 page size (12..=30).
    pub page_shift: u8,
    /// Physical pages; `iova`'s offset within a page applies to the first.
    pub pages: &'a [PhysAddr],
    /// Rights.
    pub access: AccessFlags,
}

/// Keys of a registered MR. On this device lkey and rkey are the same mkey;
/// the rkey is valid only if remote access was granted.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct MrKeys {
    /// Local key.
    pub lkey: u32,
    /// Remote key.
    pub rkey: u32,
}

/// Receives completion events ("the interrupt").
pub trait CqEventHandler: Send + Sync {
    /// CQ `cqn` has a new completion after being armed.
    ///
    /// # IRQL
    /// Called in the device's interrupt context: on hardware, from the ISR's
    /// DPC; in the software HCA, on the device thread or inline in a doorbell
    /// write. Must not block; typically it queues a DPC.
    fn completion_event(&self, cqn: u32);
}

/// Asynchronous events.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum AsyncEvent {
    /// The port's link came up.
    PortActive {
        /// Port.
        port: u8,
    },
    /// The port's link went down.
    PortDown {
        /// Port.
        port: u8,
    },
    /// A QP hit a fatal error and is in the error state.
    QpFatal {
        /// QP number.
        qpn: u32,
    },
    /// The responder detected an invalid request (QP in error).
    QpRequestError {
        /// QP number.
        qpn: u32,
    },
    /// The responder detected an access violation (QP in error).
    QpAccessError {
        /// QP number.
        qpn: u32,
    },
    /// A QP in the error state has flushed its last receive WQE: no further
    /// receive completion will be generated for it.
    QpLastWqeReached {
        /// QP number.
        qpn: u32,
    },
    /// An RC QP in RTR received its first packet (communication established).
    CommEstablished {
        /// QP number.
        qpn: u32,
    },
    /// The send queue finished draining after RTS→SQD (if requested).
    SqDrained {
        /// QP number.
        qpn: u32,
    },
    /// The CQ overflowed and is in error.
    CqError {
        /// CQ number.
        cqn: u32,
    },
}

/// Receives asynchronous events.
pub trait AsyncEventHandler: Send + Sync {
    /// An asynchronous event occurred.
    ///
    /// # IRQL
    /// Device interrupt context, as [`CqEventHandler::completion_event`].
    fn async_event(&self, event: AsyncEvent);
}

/// Why a control command failed.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum HcaError {
    /// No such port.
    InvalidPort(u8),
    /// No such GID index.
    InvalidGidIndex(u16),
    /// No such PD.
    NoSuchPd(Pdn),
    /// No such CQ.
    NoSuchCq(u32),
    /// No such QP.
    NoSuchQp(u32),
    /// No such MR / mkey.
    NoSuchMr(u32),
    /// The object is still in use (a PD with QPs/MRs, a CQ with QPs).
    InUse,
    /// A size is zero or above the device limit.
    InvalidSize,
    /// An attribute value exceeds a device limit.
    ExceedsLimit,
    /// The device has no more objects of that kind.
    OutOfResources,
    /// A QP modify was rejected.
    Modify(ModifyError),
    /// Illegal access flag combination.
    InvalidAccess,
    /// The region is inconsistent (length beyond the pages, bad page shift,
    /// unmapped page).
    InvalidRange,
    /// The operation is not valid for this object (e.g. deregistering a
    /// fast-registration mkey, a second GSI QP on a port).
    InvalidOperation,
    /// Resize impossible now (the old ring is full).
    Busy,
    /// DMA memory could not be allocated.
    Dma(DmaError),
}

impl From<ModifyError> for HcaError {
    fn from(e: ModifyError) -> Self {
        Self::Modify(e)
    }
}

impl From<DmaError> for HcaError {
    fn from(e: DmaError) -> Self {
        Self::Dma(e)
    }
}

impl From<RingError> for HcaError {
    fn from(_: RingError) -> Self {
        Self::InvalidSize
    }
}

impl fmt::Display for HcaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Modify(m) => write!(f, "modify QP: {m}"),
            Self::Dma(d) => write!(f, "DMA: {d}"),
            other => write!(f, "{other:?}"),
        }
    }
}

/// The device control interface (object safe, `Send + Sync`).
///
/// Every method is a "firmware command": **# IRQL: PASSIVE_LEVEL only** (it
/// may block). The data path is the resources it returns.
pub trait HcaDevice: Send + Sync {
    /// Device limits.
    ///
    /// # IRQL
    /// PASSIVE_LEVEL only.
    fn query_device(&self) -> DeviceAttr;

    /// Port attributes.
    ///
    /// # Errors
    /// [`HcaError::InvalidPort`].
    ///
    /// # IRQL
    /// PASSIVE_LEVEL only.
    fn query_port(&self, port: u8) -> Result<PortAttr, HcaError>;

    /// GID table entry.
    ///
    /// # Errors
    /// [`HcaError::InvalidPort`], [`HcaError::InvalidGidIndex`].
    ///
    /// # IRQL
    /// PASSIVE_LEVEL only.
    fn query_gid(&self, port: u8, index: u16) -> Result<Gid, HcaError>;

    /// The allocator for device-visible memory (IUs, page lists).
    ///
    /// # IRQL
    /// PASSIVE_LEVEL only (the allocator itself is PASSIVE_LEVEL only too).
    fn dma_allocator(&self) -> Arc<dyn DmaAllocator>;

    /// Installs (or removes) the asynchronous event handler.
    ///
    /// # IRQL
    /// PASSIVE_LEVEL only.
    fn set_async_event_handler(&self, handler: Option<Arc<dyn AsyncEventHandler>>);

    /// Allocates a protection domain.
    ///
    /// # Errors
    /// [`HcaError::OutOfResources`].
    ///
    /// # IRQL
    /// PASSIVE_LEVEL only.
    fn alloc_pd(&self) -> Result<Pdn, HcaError>;

    /// Frees a protection domain (it must have no QPs or MRs).
    ///
    /// # Errors
    /// [`HcaError::NoSuchPd`], [`HcaError::InUse`].
    ///
    /// # IRQL
    /// PASSIVE_LEVEL only.
    fn dealloc_pd(&self, pd: Pdn) -> Result<(), HcaError>;

    /// Creates a CQ of at least `entries` CQEs; `handler` receives its
    /// completion events.
    ///
    /// # Errors
    /// [`HcaError::InvalidSize`], [`HcaError::OutOfResources`], [`HcaError::Dma`].
    ///
    /// # IRQL
    /// PASSIVE_LEVEL only.
    fn create_cq(
        &self,
        entries: u32,
        handler: Arc<dyn CqEventHandler>,
    ) -> Result<CqResources, HcaError>;

    /// Moves the CQ to a new ring of at least `entries` CQEs (which must hold
    /// every CQE not yet consumed). The device writes a
    /// [`crate::cqe::CqeOpcode::ResizeCq`] CQE at the old ring's next producer
    /// counter `n`; every later CQE goes to the new ring, starting at counter
    /// `n + 1` (counters continue; owner parity is relative to the new size).
    /// The driver polls the old ring up to the resize CQE, then switches.
    ///
    /// # Errors
    /// [`HcaError::NoSuchCq`], [`HcaError::InvalidSize`], [`HcaError::Busy`]
    /// (old ring full: consume first).
    ///
    /// # IRQL
    /// PASSIVE_LEVEL only.
    fn resize_cq(&self, cqn: u32, entries: u32) -> Result<CqRing<DmaBuffer>, HcaError>;

    /// Destroys a CQ (no QP may use it).
    ///
    /// # Errors
    /// [`HcaError::NoSuchCq`], [`HcaError::InUse`].
    ///
    /// # IRQL
    /// PASSIVE_LEVEL only. After it returns, no event for this CQ is delivered.
    fn destroy_cq(&self, cqn: u32) -> Result<(), HcaError>;

    /// Creates a QP in the RESET state.
    ///
    /// # Errors
    /// [`HcaError::NoSuchPd`], [`HcaError::NoSuchCq`], [`HcaError::InvalidSize`],
    /// [`HcaError::InvalidOperation`] (second GSI QP on a port),
    /// [`HcaError::OutOfResources`], [`HcaError::Dma`].
    ///
    /// # IRQL
    /// PASSIVE_LEVEL only.
    fn create_qp(&self, init: &QpInit) -> Result<QpResources, HcaError>;

    /// Modifies a QP: the IBA transition and attribute rules
    /// ([`check_modify`]) plus device limits. Moving to RESET empties the
    /// rings and zeroes the doorbell record (the driver restarts its
    /// counters at 0); moving to ERR flushes everything outstanding, and
    /// WQEs posted while in ERR are flushed as the device sees them.
    ///
    /// # Errors
    /// [`HcaError::NoSuchQp`], [`HcaError::Modify`], [`HcaError::InvalidPort`],
    /// [`HcaError::ExceedsLimit`].
    ///
    /// # IRQL
    /// PASSIVE_LEVEL only.
    fn modify_qp(&self, qpn: u32, attr: &QpAttr, mask: QpAttrMask) -> Result<(), HcaError>;

    /// The QP's current state and attributes.
    ///
    /// # Errors
    /// [`HcaError::NoSuchQp`].
    ///
    /// # IRQL
    /// PASSIVE_LEVEL only.
    fn query_qp(&self, qpn: u32) -> Result<QpAttr, HcaError>;

    /// Destroys a QP (in any state; nothing more is processed or completed).
    ///
    /// # Errors
    /// [`HcaError::NoSuchQp`].
    ///
    /// # IRQL
    /// PASSIVE_LEVEL only.
    fn destroy_qp(&self, qpn: u32) -> Result<(), HcaError>;

    /// Registers memory over physical pages.
    ///
    /// # Errors
    /// [`HcaError::NoSuchPd`], [`HcaError::InvalidAccess`],
    /// [`HcaError::InvalidRange`], [`HcaError::OutOfResources`].
    ///
    /// # IRQL
    /// PASSIVE_LEVEL only.
    fn reg_mr(&self, reg: &MrRegistration<'_>) -> Result<MrKeys, HcaError>;

    /// Deregisters memory registered with [`Self::reg_mr`].
    ///
    /// # Errors
    /// [`HcaError::NoSuchMr`], [`HcaError::InvalidOperation`] for a
    /// fast-registration mkey.
    ///
    /// # IRQL
    /// PASSIVE_LEVEL only.
    fn dereg_mr(&self, lkey: u32) -> Result<(), HcaError>;

    /// Allocates an mkey for fast registration by work request, able to map
    /// up to `max_pages` pages. It starts invalid (free); a REG_MR WQE makes
    /// it valid with a new key byte; LOCAL_INVAL or SEND with invalidate
    /// makes it free again. Returns the mkey with key byte 0.
    ///
    /// # Errors
    /// [`HcaError::NoSuchPd`], [`HcaError::InvalidSize`], [`HcaError::OutOfResources`].
    ///
    /// # IRQL
    /// PASSIVE_LEVEL only.
    fn alloc_mkey(&self, pd: Pdn, max_pages: u32) -> Result<u32, HcaError>;

    /// Frees a fast-registration mkey (any key byte of it).
    ///
    /// # Errors
    /// [`HcaError::NoSuchMr`], [`HcaError::InvalidOperation`] for a
    /// [`Self::reg_mr`] registration.
    ///
    /// # IRQL
    /// PASSIVE_LEVEL only.
    fn free_mkey(&self, mkey: u32) -> Result<(), HcaError>;
}

#[cfg(test)]
mod tests {
    use super::*;
    use QpAttrMask as M;
    use QpState::{Init, Reset, Rtr, Rts, Sqd, Sqe};
    const ERR: QpState = QpState::Err;

    fn attr(to: QpState) -> QpAttr {
        QpAttr {
            state: to,
            dest_qpn: 5,
            ..QpAttr::default()
        }
    }

    const RC_RTR: M = M::AV
        .union(M::PATH_MTU)
        .union(M::DEST_QPN)
        .union(M::RQ_PSN)
        .union(M::MAX_DEST_RD_ATOMIC)
        .union(M::MIN_RNR_TIMER);
    const RC_RTS: M = M::TIMEOUT
        .union(M::RETRY_CNT)
        .union(M::RNR_RETRY)
        .union(M::SQ_PSN)
        .union(M::MAX_QP_RD_ATOMIC);

    #[test]
    fn rc_bring_up_rules() {
        let init = M::STATE | M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS;
        assert_eq!(check_modify(QpType::Rc, Reset, &attr(Init), init), Ok(Init));
        assert_eq!(
            check_modify(
                QpType::Rc,
                Reset,
                &attr(Init),
                M::STATE | M::PKEY_INDEX | M::PORT
            ),
            Err(ModifyError::MissingAttributes(M::ACCESS_FLAGS))
        );
        assert_eq!(
            check_modify(QpType::Rc, Reset, &attr(Init), init | M::QKEY),
            Err(ModifyError::UnexpectedAttributes(M::QKEY))
        );
        assert_eq!(
            check_modify(QpType::Rc, Init, &attr(Rtr), M::STATE | RC_RTR),
            Ok(Rtr)
        );
        for bit in RC_RTR.iter() {
            assert_eq!(
                check_modify(
                    QpType::Rc,
                    Init,
                    &attr(Rtr),
                    (M::STATE | RC_RTR).difference(bit)
                ),
                Err(ModifyError::MissingAttributes(bit)),
                "{bit:?}"
            );
        }
        assert_eq!(
            check_modify(QpType::Rc, Rtr, &attr(Rts), M::STATE | RC_RTS),
            Ok(Rts)
        );
        for bit in RC_RTS.iter() {
            assert_eq!(
                check_modify(
                    QpType::Rc,
                    Rtr,
                    &attr(Rts),
                    (M::STATE | RC_RTS).difference(bit)
                ),
                Err(ModifyError::MissingAttributes(bit))
            );
        }
        assert_eq!(
            check_modify(QpType::Rc, Rtr, &attr(Rts), M::STATE | RC_RTS | M::DEST_QPN),
            Err(ModifyError::UnexpectedAttributes(M::DEST_QPN))
        );
    }

    #[test]
    fn ud_and_gsi_rules() {
        let ud_init = M::STATE | M::PKEY_INDEX | M::PORT | M::QKEY;
        assert_eq!(
            check_modify(QpType::Ud, Reset, &attr(Init), ud_init),
            Ok(Init)
        );
        assert_eq!(
            check_modify(QpType::Gsi, Reset, &attr(Init), ud_init),
            Err(ModifyError::UnexpectedAttributes(M::PORT))
        );
        assert_eq!(
            check_modify(
                QpType::Gsi,
                Reset,
                &attr(Init),
                M::STATE | M::PKEY_INDEX | M::QKEY
            ),
            Ok(Init)
        );
        assert_eq!(
            check_modify(QpType::Ud, Init, &attr(Rtr), M::STATE),
            Ok(Rtr)
        );
        assert_eq!(
            check_modify(QpType::Ud, Init, &attr(Rtr), M::STATE | M::AV),
            Err(ModifyError::UnexpectedAttributes(M::AV))
        );
        assert_eq!(
            check_modify(QpType::Ud, Rtr, &attr(Rts), M::STATE),
            Err(ModifyError::MissingAttributes(M::SQ_PSN))
        );
        assert_eq!(
            check_modify(QpType::Ud, Rtr, &attr(Rts), M::STATE | M::SQ_PSN | M::QKEY),
            Ok(Rts)
        );
        assert_eq!(check_modify(QpType::Ud, Sqe, &attr(Rts), M::STATE), Ok(Rts));
        assert_eq!(
            check_modify(QpType::Rc, Sqe, &attr(Rts), M::STATE),
            Err(ModifyError::InvalidTransition { from: Sqe, to: Rts })
        );
    }

    #[test]
    fn every_invalid_edge_is_rejected() {
        let states = [Reset, Init, Rtr, Rts, Sqd, Sqe, ERR];
        let valid: &[(QpState, QpState)] = &[
            (Reset, Init),
            (Init, Init),
            (Init, Rtr),
            (Rtr, Rts),
            (Rts, Rts),
            (Rts, Sqd),
            (Sqd, Sqd),
            (Sqd, Rts),
            (Sqe, Rts),
        ];
        for ty in [QpType::Rc, QpType::Ud, QpType::Gsi] {
            for from in states {
                for to in states {
                    let exists = to == Reset
                        || to == ERR
                        || (valid.contains(&(from, to)) && !(ty == QpType::Rc && from == Sqe));
                    assert_eq!(
                        transition_rule(ty, from, to).is_some(),
                        exists,
                        "{ty:?} {from:?}->{to:?}"
                    );
                    if !exists {
                        assert_eq!(
                            check_modify(ty, from, &attr(to), M::STATE),
                            Err(ModifyError::InvalidTransition { from, to })
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn reset_and_error_take_no_attributes() {
        for from in [Reset, Init, Rtr, Rts, Sqd, Sqe, ERR] {
            assert_eq!(
                check_modify(QpType::Rc, from, &attr(ERR), M::STATE),
                Ok(ERR)
            );
            assert_eq!(
                check_modify(QpType::Rc, from, &attr(Reset), M::STATE),
                Ok(Reset)
            );
            assert_eq!(
                check_modify(QpType::Rc, from, &attr(ERR), M::STATE | M::QKEY),
                Err(ModifyError::UnexpectedAttributes(M::QKEY))
            );
        }
    }

    #[test]
    fn sqd_rules_and_cur_state() {
        assert_eq!(
            check_modify(
                QpType::Rc,
                Rts,
                &attr(Sqd),
                M::STATE | M::EN_SQD_ASYNC_NOTIFY
            ),
            Ok(Sqd)
        );
        assert_eq!(
            check_modify(QpType::Rc, Sqd, &attr(Sqd), M::STATE | M::TIMEOUT | M::AV),
            Ok(Sqd)
        );
        let mut a = attr(Rts);
        a.cur_state = Rtr;
        assert_eq!(
            check_modify(QpType::Rc, Rts, &a, M::STATE | M::CUR_STATE),
            Err(ModifyError::CurrentStateMismatch { actual: Rts })
        );
        a.cur_state = Rts;
        assert_eq!(
            check_modify(QpType::Rc, Rts, &a, M::STATE | M::CUR_STATE),
            Ok(Rts)
        );
        assert_eq!(
            check_modify(QpType::Rc, Rts, &a, M::CUR_STATE),
            Err(ModifyError::MissingAttributes(M::STATE))
        );
        assert_eq!(
            check_modify(QpType::Rc, Rts, &a, M::STATE | M::ALT_PATH),
            Err(ModifyError::UnexpectedAttributes(M::ALT_PATH))
        );
    }

    #[test]
    fn value_ranges() {
        let base = M::STATE | RC_RTS;
        type Case = (fn(&mut QpAttr), M);
        let cases: [Case; 4] = [
            (|a| a.timeout = 32, M::TIMEOUT),
            (|a| a.retry_cnt = 8, M::RETRY_CNT),
            (|a| a.rnr_retry = 8, M::RNR_RETRY),
            (|a| a.sq_psn = 1 << 24, M::SQ_PSN),
        ];
        for (f, bit) in cases {
            let mut a = attr(Rts);
            f(&mut a);
            assert_eq!(
                check_modify(QpType::Rc, Rtr, &a, base),
                Err(ModifyError::InvalidValue(bit))
            );
        }
        let mut a = attr(Rtr);
        a.dest_qpn = 0;
        assert_eq!(
            check_modify(QpType::Rc, Init, &a, M::STATE | RC_RTR),
            Err(ModifyError::InvalidValue(M::DEST_QPN))
        );
        a.dest_qpn = 3;
        a.rq_psn = 1 << 24;
        assert_eq!(
            check_modify(QpType::Rc, Init, &a, M::STATE | RC_RTR),
            Err(ModifyError::InvalidValue(M::RQ_PSN))
        );
        a.rq_psn = 0;
        a.min_rnr_timer = 32;
        assert_eq!(
            check_modify(QpType::Rc, Init, &a, M::STATE | RC_RTR),
            Err(ModifyError::InvalidValue(M::MIN_RNR_TIMER))
        );
    }

    #[test]
    fn timers_and_helpers() {
        assert_eq!(rnr_timer_ns(0), 655_360_000);
        assert_eq!(rnr_timer_ns(1), 10_000);
        assert_eq!(rnr_timer_ns(14), 1_280_000);
        assert_eq!(rnr_timer_ns(31), 491_520_000);
        assert_eq!(ack_timeout_ns(0), None);
        assert_eq!(ack_timeout_ns(14), Some(67_108_864));
        assert_eq!(Mtu::Mtu1024.bytes(), 1024);
        assert_eq!(Mtu::Mtu4096.bytes(), 4096);
        assert_eq!(Mtu::from_u8(6), None);
        assert!(
            AccessFlags::LOCAL_WRITE
                .union(AccessFlags::REMOTE_WRITE)
                .is_valid_for_mr()
        );
        assert!(!AccessFlags::REMOTE_WRITE.is_valid_for_mr());
        assert!(AccessFlags::REMOTE_READ.is_valid_for_mr());
    }
}
