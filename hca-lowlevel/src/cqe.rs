//! Completion queue entries in the mlx5 layout (`mlx5_cqe64`).
//!
//! | off | size | field |
//! |---|---|---|
//! | 2 | 2 | wqe_id |
//! | 22 | 2 | slid |
//! | 24 | 4 | flags_rqpn: bits 23..0 remote QPN (UD), bit 28 GRH present |
//! | 36 | 4 | imm_inval_pkey: immediate / invalidated rkey |
//! | 44 | 4 | byte_cnt |
//! | 48 | 8 | timestamp (error CQE: 54 vendor syndrome, 55 syndrome) |
//! | 56 | 4 | sop_drop_qpn: 31..24 WQE opcode (requester), 23..0 QPN |
//! | 60 | 2 | wqe_counter |
//! | 62 | 1 | signature |
//! | 63 | 1 | op_own: 7..4 opcode, 3..2 format, 1 solicited, 0 owner |
//!
//! Ownership: the CQE at consumer counter `n` of a ring of `entries` (a power
//! of two) belongs to software iff its opcode is not [`CqeOpcode::Invalid`]
//! and its owner bit equals `(n & entries) != 0`, the wrap parity of the
//! counter. Software initialises every CQE to opcode `Invalid`; the device
//! writes owner = wrap parity of its producer counter, and writes the word
//! holding `op_own` last (see [`crate::ring::CqRing`]).

#![forbid(unsafe_code)]

use static_assertions::const_assert_eq;

use crate::bytes::{get_be16, get_be32, get_be64, get_u8, set_be16, set_be32, set_be64, set_u8};
use crate::view::{FormatError, fixed_view};

/// Bytes in a CQE.
pub const CQE_SIZE: usize = 64;
/// `flags_rqpn` bit: the first 40 bytes of the receive buffer hold a GRH.
pub const CQE_FLAG_GRH: u32 = 1 << 28;

mod field {
    pub const WQE_ID: usize = 2;
    pub const SLID: usize = 22;
    pub const FLAGS_RQPN: usize = 24;
    pub const SRQN_UIDX: usize = 32;
    pub const IMM_INVAL_PKEY: usize = 36;
    pub const BYTE_CNT: usize = 44;
    pub const TIMESTAMP: usize = 48;
    pub const VENDOR_SYNDROME: usize = 54;
    pub const SYNDROME: usize = 55;
    pub const SOP_DROP_QPN: usize = 56;
    pub const WQE_COUNTER: usize = 60;
    pub const SIGNATURE: usize = 62;
    pub const OP_OWN: usize = 63;
    pub const END: usize = 64;
}
const_assert_eq!(field::FLAGS_RQPN, 24);
const_assert_eq!(field::IMM_INVAL_PKEY, 36);
const_assert_eq!(field::BYTE_CNT, 44);
const_assert_eq!(field::SYNDROME, 55);
const_assert_eq!(field::SOP_DROP_QPN, 56);
const_assert_eq!(field::WQE_COUNTER, 60);
const_assert_eq!(field::OP_OWN, 63);
const_assert_eq!(field::END, CQE_SIZE);

/// Index of the 64-bit word that holds `op_own` (written last, with Release).
pub const OWNER_WORD: usize = field::SOP_DROP_QPN / 8;
const_assert_eq!(OWNER_WORD, 7);

/// CQE opcodes (`MLX5_CQE_*`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum CqeOpcode {
    /// Requester (send queue) completion.
    Req = 0,
    /// Responder: RDMA WRITE with immediate.
    RespWrImm = 1,
    /// Responder: SEND.
    RespSend = 2,
    /// Responder: SEND with immediate.
    RespSendImm = 3,
    /// Responder: SEND with invalidate.
    RespSendInv = 4,
    /// The CQ moved to a new ring (see `HcaDevice::resize_cq`).
    ResizeCq = 5,
    /// No packet (unused here).
    NoPacket = 6,
    /// Signature error (unused here).
    SigErr = 12,
    /// Requester error (syndrome valid).
    ReqErr = 13,
    /// Responder error (syndrome valid).
    RespErr = 14,
    /// Not written by the device yet.
    Invalid = 15,
}

impl CqeOpcode {
    /// Decodes the opcode nibble.
    ///
    /// # Errors
    /// [`FormatError::UnknownCqeOpcode`] for 7..=11.
    pub const fn from_u8(v: u8) -> Result<Self, FormatError> {
        Ok(match v {
            0 => Self::Req,
            1 => Self::RespWrImm,
            2 => Self::RespSend,
            3 => Self::RespSendImm,
            4 => Self::RespSendInv,
            5 => Self::ResizeCq,
            6 => Self::NoPacket,
            12 => Self::SigErr,
            13 => Self::ReqErr,
            14 => Self::RespErr,
            15 => Self::Invalid,
            other => return Err(FormatError::UnknownCqeOpcode(other)),
        })
    }

    /// True for the error opcodes (syndrome valid).
    #[must_use]
    pub const fn is_error(self) -> bool {
        matches!(self, Self::ReqErr | Self::RespErr)
    }
}

/// Error CQE syndromes (`MLX5_CQE_SYNDROME_*`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Syndrome {
    /// Local length error (message larger than the buffers / limits).
    LocalLength = 0x01,
    /// Local QP operation error (malformed WQE, bad opcode for the QP type).
    LocalQpOp = 0x02,
    /// Local protection error (lkey, PD, access or bounds).
    LocalProt = 0x04,
    /// Work request flushed (QP in error).
    WrFlush = 0x05,
    /// Memory window bind error.
    MwBind = 0x06,
    /// Bad response from the responder.
    BadResp = 0x10,
    /// Local access error (responder side).
    LocalAccess = 0x11,
    /// Remote side reported an invalid request.
    RemoteInvalRequest = 0x12,
    /// Remote access error (rkey, PD, access or bounds at the responder).
    RemoteAccess = 0x13,
    /// Remote operational error.
    RemoteOp = 0x14,
    /// Transport retry counter exceeded.
    TransportRetryExceeded = 0x15,
    /// RNR retry counter exceeded.
    RnrRetryExceeded = 0x16,
    /// Remote aborted.
    RemoteAborted = 0x22,
}

impl Syndrome {
    /// Decodes a syndrome byte (`None` for values this crate does not define).
    #[must_use]
    pub const fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            0x01 => Self::LocalLength,
            0x02 => Self::LocalQpOp,
            0x04 => Self::LocalProt,
            0x05 => Self::WrFlush,
            0x06 => Self::MwBind,
            0x10 => Self::BadResp,
            0x11 => Self::LocalAccess,
            0x12 => Self::RemoteInvalRequest,
            0x13 => Self::RemoteAccess,
            0x14 => Self::RemoteOp,
            0x15 => Self::TransportRetryExceeded,
            0x16 => Self::RnrRetryExceeded,
            0x22 => Self::RemoteAborted,
            _ => return None,
        })
    }
}

fixed_view!(
    /// A 64-byte CQE (normal and error layouts share the ownership word).
    Cqe,
    field::END
);

impl<T: AsRef<[u8]>> Cqe<T> {
    /// The `op_own` byte.
    pub fn op_own(&self) -> u8 {
        get_u8(self.buffer.as_ref(), field::OP_OWN)
    }
    /// The opcode nibble (undecoded).
    pub fn opcode_raw(&self) -> u8 {
        self.op_own() >> 4
    }
    /// Owner bit.
    pub fn owner(&self) -> bool {
        self.op_own() & 1 != 0
    }
    /// Solicited-event bit.
    pub fn solicited(&self) -> bool {
        self.op_own() & 2 != 0
    }
    /// Format bits (always 0 here: no compression, no inline scatter).
    pub fn format(&self) -> u8 {
        (self.op_own() >> 2) & 3
    }
    /// `wqe_id` field.
    pub fn wqe_id(&self) -> u16 {
        get_be16(self.buffer.as_ref(), field::WQE_ID)
    }
    /// Source LID (unused on RoCE).
    pub fn slid(&self) -> u16 {
        get_be16(self.buffer.as_ref(), field::SLID)
    }
    /// The raw `flags_rqpn` word.
    pub fn flags_rqpn(&self) -> u32 {
        get_be32(self.buffer.as_ref(), field::FLAGS_RQPN)
    }
    /// Remote (source) QP number of a UD receive.
    pub fn src_qpn(&self) -> u32 {
        self.flags_rqpn() & 0xff_ffff
    }
    /// The receive buffer starts with a 40-byte GRH.
    pub fn grh(&self) -> bool {
        self.flags_rqpn() & CQE_FLAG_GRH != 0
    }
    /// `srqn_uidx` word.
    pub fn srqn_uidx(&self) -> u32 {
        get_be32(self.buffer.as_ref(), field::SRQN_UIDX)
    }
    /// Immediate data, or the rkey a SEND with invalidate invalidated.
    pub fn imm_inval_pkey(&self) -> u32 {
        get_be32(self.buffer.as_ref(), field::IMM_INVAL_PKEY)
    }
    /// Bytes transferred (received bytes; bytes read for an RDMA READ).
    pub fn byte_cnt(&self) -> u32 {
        get_be32(self.buffer.as_ref(), field::BYTE_CNT)
    }
    /// Timestamp (normal CQEs).
    pub fn timestamp(&self) -> u64 {
        get_be64(self.buffer.as_ref(), field::TIMESTAMP)
    }
    /// Syndrome (error CQEs).
    pub fn syndrome(&self) -> u8 {
        get_u8(self.buffer.as_ref(), field::SYNDROME)
    }
    /// Vendor syndrome (error CQEs).
    pub fn vendor_syndrome(&self) -> u8 {
        get_u8(self.buffer.as_ref(), field::VENDOR_SYNDROME)
    }
    /// The WQE opcode byte of a requester CQE.
    pub fn wqe_opcode(&self) -> u8 {
        get_u8(self.buffer.as_ref(), field::SOP_DROP_QPN)
    }
    /// QP number.
    pub fn qpn(&self) -> u32 {
        get_be32(self.buffer.as_ref(), field::SOP_DROP_QPN) & 0xff_ffff
    }
    /// Counter of the completed WQE (send: WQEBB counter of its first block;
    /// receive: receive-queue counter), modulo 2^16.
    pub fn wqe_counter(&self) -> u16 {
        get_be16(self.buffer.as_ref(), field::WQE_COUNTER)
    }
    /// Signature byte.
    pub fn signature(&self) -> u8 {
        get_u8(self.buffer.as_ref(), field::SIGNATURE)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Cqe<T> {
    /// Sets `op_own` from its parts.
    pub fn set_op_own(&mut self, opcode: u8, solicited: bool, owner: bool) {
        let v = (opcode << 4) | (u8::from(solicited) << 1) | u8::from(owner);
        set_u8(self.buffer.as_mut(), field::OP_OWN, v);
    }
    /// Sets the raw `flags_rqpn` word.
    pub fn set_flags_rqpn(&mut self, v: u32) {
        set_be32(self.buffer.as_mut(), field::FLAGS_RQPN, v);
    }
    /// Sets the immediate / invalidated key.
    pub fn set_imm_inval_pkey(&mut self, v: u32) {
        set_be32(self.buffer.as_mut(), field::IMM_INVAL_PKEY, v);
    }
    /// Sets the byte count.
    pub fn set_byte_cnt(&mut self, v: u32) {
        set_be32(self.buffer.as_mut(), field::BYTE_CNT, v);
    }
    /// Sets the timestamp.
    pub fn set_timestamp(&mut self, v: u64) {
        set_be64(self.buffer.as_mut(), field::TIMESTAMP, v);
    }
    /// Sets syndrome and vendor syndrome (error CQEs; overlaps the timestamp).
    pub fn set_syndrome(&mut self, syndrome: u8, vendor: u8) {
        set_u8(self.buffer.as_mut(), field::VENDOR_SYNDROME, vendor);
        set_u8(self.buffer.as_mut(), field::SYNDROME, syndrome);
    }
    /// Sets WQE opcode and QPN.
    pub fn set_sop_drop_qpn(&mut self, wqe_opcode: u8, qpn: u32) {
        set_be32(
            self.buffer.as_mut(),
            field::SOP_DROP_QPN,
            (u32::from(wqe_opcode) << 24) | (qpn & 0xff_ffff),
        );
    }
    /// Sets the WQE counter.
    pub fn set_wqe_counter(&mut self, v: u16) {
        set_be16(self.buffer.as_mut(), field::WQE_COUNTER, v);
    }
}

/// A decoded CQE.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct CqeRepr {
    /// Completion opcode.
    pub opcode: CqeOpcode,
    /// Solicited event (responder CQEs of messages with SE set).
    pub solicited: bool,
    /// Opcode of the completed send WQE (requester CQEs; 0 otherwise).
    pub wqe_opcode: u8,
    /// QP number.
    pub qpn: u32,
    /// WQE counter (see [`Cqe::wqe_counter`]).
    pub wqe_counter: u16,
    /// Byte count (normal CQEs).
    pub byte_cnt: u32,
    /// Immediate data or invalidated rkey (normal CQEs).
    pub imm_inval_pkey: u32,
    /// Source QPN (UD receives).
    pub src_qpn: u32,
    /// GRH in the first 40 bytes of the receive buffer (UD receives).
    pub grh: bool,
    /// Syndrome byte (error CQEs; see [`Syndrome::from_u8`]).
    pub syndrome: u8,
    /// Vendor syndrome (error CQEs).
    pub vendor_syndrome: u8,
}

impl CqeRepr {
    /// Bytes of a CQE.
    pub const LEN: usize = CQE_SIZE;

    /// Decodes a CQE (ownership is the ring's business, not checked here).
    ///
    /// # Errors
    /// [`FormatError::Truncated`], [`FormatError::UnknownCqeOpcode`].
    pub fn parse<T: AsRef<[u8]>>(cqe: &Cqe<T>) -> Result<Self, FormatError> {
        cqe.check_len()?;
        let opcode = CqeOpcode::from_u8(cqe.opcode_raw())?;
        let err = opcode.is_error();
        Ok(Self {
            opcode,
            solicited: cqe.solicited(),
            wqe_opcode: cqe.wqe_opcode(),
            qpn: cqe.qpn(),
            wqe_counter: cqe.wqe_counter(),
            byte_cnt: if err { 0 } else { cqe.byte_cnt() },
            imm_inval_pkey: if err { 0 } else { cqe.imm_inval_pkey() },
            src_qpn: if err { 0 } else { cqe.src_qpn() },
            grh: !err && cqe.grh(),
            syndrome: if err { cqe.syndrome() } else { 0 },
            vendor_syndrome: if err { cqe.vendor_syndrome() } else { 0 },
        })
    }

    /// Writes the CQE with the given owner bit (all other bytes zeroed first).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, cqe: &mut Cqe<T>, owner: bool) {
        if let Some(b) = cqe.buffer.as_mut().get_mut(..CQE_SIZE) {
            b.fill(0);
        }
        if self.opcode.is_error() {
            cqe.set_syndrome(self.syndrome, self.vendor_syndrome);
        } else {
            let grh = if self.grh { CQE_FLAG_GRH } else { 0 };
            cqe.set_flags_rqpn(grh | (self.src_qpn & 0xff_ffff));
            cqe.set_imm_inval_pkey(self.imm_inval_pkey);
            cqe.set_byte_cnt(self.byte_cnt);
        }
        cqe.set_sop_drop_qpn(self.wqe_opcode, self.qpn);
        cqe.set_wqe_counter(self.wqe_counter);
        cqe.set_op_own(self.opcode as u8, self.solicited, owner);
    }

    /// Bytes `emit` writes.
    #[must_use]
    pub const fn buffer_len(&self) -> usize {
        Self::LEN
    }

    /// The decoded syndrome of an error CQE.
    #[must_use]
    pub const fn error(&self) -> Option<Syndrome> {
        if self.opcode.is_error() {
            Syndrome::from_u8(self.syndrome)
        } else {
            None
        }
    }
}

/// The owner-bit rule: true if a CQE whose `op_own` byte is `op_own`, found at
/// consumer counter `counter` of a ring of `entries` (power of two), belongs
/// to software.
///
/// The parity is tested first: in the steady state (a ring past its first
/// lap) the slot a poll finds empty holds the last lap's CQE, which the
/// parity alone rejects; the opcode matters only for slots the device has
/// never written (initialised Invalid: the first lap).
#[must_use]
pub const fn owned_by_software(op_own: u8, counter: u32, entries: u32) -> bool {
    ((op_own & 1) != 0) == ((counter & entries) != 0) && (op_own >> 4) != CqeOpcode::Invalid as u8
}

/// The owner bit the device writes for producer counter `counter`.
#[must_use]
pub const fn owner_bit(counter: u32, entries: u32) -> bool {
    (counter & entries) != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requester_cqe_golden_bytes() {
        let c = CqeRepr {
            opcode: CqeOpcode::Req,
            solicited: false,
            wqe_opcode: 0x0a,
            qpn: 0x12_3456,
            wqe_counter: 0x0102,
            byte_cnt: 0,
            imm_inval_pkey: 0,
            src_qpn: 0,
            grh: false,
            syndrome: 0,
            vendor_syndrome: 0,
        };
        let mut b = [0xffu8; 64];
        c.emit(&mut Cqe::new_unchecked(&mut b[..]), true);
        let mut want = [0u8; 64];
        want[56..64].copy_from_slice(&[0x0a, 0x12, 0x34, 0x56, 0x01, 0x02, 0x00, 0x01]);
        assert_eq!(b, want);
        assert_eq!(
            CqeRepr::parse(&Cqe::new_checked(&b[..]).unwrap()).unwrap(),
            c
        );
    }

    #[test]
    fn responder_cqe_golden_bytes() {
        let c = CqeRepr {
            opcode: CqeOpcode::RespSendImm,
            solicited: true,
            wqe_opcode: 0,
            qpn: 1,
            wqe_counter: 5,
            byte_cnt: 296,
            imm_inval_pkey: 0xcafe_f00d,
            src_qpn: 0x77,
            grh: true,
            syndrome: 0,
            vendor_syndrome: 0,
        };
        let mut b = [0u8; 64];
        c.emit(&mut Cqe::new_unchecked(&mut b[..]), false);
        assert_eq!(&b[24..28], &[0x10, 0, 0, 0x77]);
        assert_eq!(&b[36..40], &[0xca, 0xfe, 0xf0, 0x0d]);
        assert_eq!(&b[44..48], &[0, 0, 1, 0x28]);
        assert_eq!(b[63], 0x32);
        assert_eq!(
            CqeRepr::parse(&Cqe::new_checked(&b[..]).unwrap()).unwrap(),
            c
        );
    }

    #[test]
    fn error_cqe_golden_bytes() {
        let c = CqeRepr {
            opcode: CqeOpcode::ReqErr,
            solicited: false,
            wqe_opcode: 0x08,
            qpn: 9,
            wqe_counter: 3,
            byte_cnt: 0,
            imm_inval_pkey: 0,
            src_qpn: 0,
            grh: false,
            syndrome: Syndrome::RemoteAccess as u8,
            vendor_syndrome: 0x88,
        };
        let mut b = [0u8; 64];
        c.emit(&mut Cqe::new_unchecked(&mut b[..]), true);
        assert_eq!(b[54], 0x88);
        assert_eq!(b[55], 0x13);
        assert_eq!(b[63], 0xd1);
        let p = CqeRepr::parse(&Cqe::new_checked(&b[..]).unwrap()).unwrap();
        assert_eq!(p, c);
        assert_eq!(p.error(), Some(Syndrome::RemoteAccess));
    }

    #[test]
    fn ownership_follows_wrap_parity() {
        let entries = 4;
        let invalid = 0xf0;
        assert!(!owned_by_software(invalid, 0, entries));
        // Lap 0: owner 0.
        assert!(owned_by_software(0x00, 0, entries));
        assert!(!owned_by_software(0x01, 3, entries));
        // Lap 1: owner 1; a stale lap-0 CQE is not ours.
        assert!(owned_by_software(0x01, 4, entries));
        assert!(!owned_by_software(0x00, 5, entries));
        assert!(owner_bit(4, entries));
        assert!(!owner_bit(8, entries));
    }

    #[test]
    fn unknown_opcode_rejected() {
        let mut b = [0u8; 64];
        b[63] = 0x70;
        assert_eq!(
            CqeRepr::parse(&Cqe::new_unchecked(&b[..])),
            Err(FormatError::UnknownCqeOpcode(7))
        );
        assert_eq!(
            Cqe::new_checked(&b[..63]).err(),
            Some(FormatError::Truncated)
        );
        assert_eq!(Syndrome::from_u8(0x03), None);
    }
}
