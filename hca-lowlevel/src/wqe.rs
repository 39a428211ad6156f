//! Send work queue entries in the mlx5 layout.
//!
//! A send WQE is a sequence of 16-byte segments ("ds" units) starting with a
//! control segment; it occupies `ceil(ds * 16 / 64)` 64-byte basic blocks
//! (WQEBBs) of the send ring and may wrap from the last slot to slot 0.
//!
//! | operation | segments |
//! |---|---|
//! | SEND, SEND_IMM, SEND_INVAL (RC) | ctrl, data… or one inline |
//! | SEND, SEND_IMM (UD) | ctrl, datagram (48 B), data… or one inline |
//! | RDMA_WRITE, RDMA_WRITE_IMM | ctrl, raddr, data… or one inline |
//! | RDMA_READ | ctrl, raddr, data… |
//! | LOCAL_INVAL | ctrl (key to invalidate in `imm`) |
//! | REG_MR (this crate's own) | ctrl, reg-mr (32 B), then the page list inline, or one data segment pointing at it |
//! | NOP | ctrl |
//!
//! mlx5 publishes no WQE layout for fast registration by work request. The
//! [`RegMrSeg`] here is this crate's own, in the same spirit as the UMR
//! segments of real hardware: it carries the mkey with its new key byte, the
//! access rights, the I/O virtual address, length and page size, and either
//! the page list itself (posting the translation inline is what made mlx5
//! REG_MR 3.8x faster) or, for long lists, the physical address of a
//! preallocated page-list buffer. It uses the opcode number mlx5 gives UMR.
//!
//! All views here are `#![forbid(unsafe_code)]`, big-endian, and total.

#![forbid(unsafe_code)]

use bitflags::bitflags;
use heapless::Vec;
use static_assertions::const_assert_eq;

use crate::bytes::{
    get_array, get_be16, get_be32, get_be64, get_u8, set_be16, set_be32, set_be64, set_slice,
    set_u8,
};
use crate::device::AccessFlags;
use crate::dma::PhysAddr;
use crate::view::{FormatError, fixed_view};

/// Bytes in a send WQE basic block (`MLX5_SEND_WQE_BB`).
pub const WQEBB_SIZE: usize = 64;
/// Bytes in one descriptor unit (`ds`).
pub const DS_SIZE: usize = 16;
/// Largest `ds` a control segment may carry (6 bits on mlx5).
pub const MAX_DS: usize = 63;
/// Largest send WQE in bytes.
pub const MAX_SEND_WQE_BYTES: usize = MAX_DS * DS_SIZE;
/// Most data segments this device accepts in one send WQE.
pub const MAX_SEND_SGE: usize = 16;
/// Bit set in an inline segment's byte count (`MLX5_INLINE_SEG`).
pub const INLINE_SEG_FLAG: u32 = 0x8000_0000;
/// Most pages a fast-registration page list may name.
pub const MAX_REG_PAGES: usize = 1 << 16;

/// Send WQE opcodes (`MLX5_OPCODE_*`), plus this crate's REG_MR.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum SendOpcode {
    /// No operation (completes like any WQE).
    Nop = 0x00,
    /// SEND with invalidate: `imm` is the remote key to invalidate.
    SendInval = 0x01,
    /// RDMA WRITE.
    RdmaWrite = 0x08,
    /// RDMA WRITE with immediate (`imm`).
    RdmaWriteImm = 0x09,
    /// SEND.
    Send = 0x0a,
    /// SEND with immediate (`imm`).
    SendImm = 0x0b,
    /// RDMA READ.
    RdmaRead = 0x10,
    /// Local invalidate: `imm` is the key to invalidate.
    LocalInval = 0x1b,
    /// Fast registration by work request (this crate's [`RegMrSeg`]).
    RegMr = 0x25,
}

impl SendOpcode {
    /// Decodes an opcode byte.
    ///
    /// # Errors
    /// [`FormatError::UnknownOpcode`] for anything this device does not execute.
    pub const fn from_u8(v: u8) -> Result<Self, FormatError> {
        Ok(match v {
            0x00 => Self::Nop,
            0x01 => Self::SendInval,
            0x08 => Self::RdmaWrite,
            0x09 => Self::RdmaWriteImm,
            0x0a => Self::Send,
            0x0b => Self::SendImm,
            0x10 => Self::RdmaRead,
            0x1b => Self::LocalInval,
            0x25 => Self::RegMr,
            other => return Err(FormatError::UnknownOpcode(other)),
        })
    }

    /// True for SEND, SEND_IMM and SEND_INVAL.
    #[must_use]
    pub const fn is_send(self) -> bool {
        matches!(self, Self::Send | Self::SendImm | Self::SendInval)
    }

    /// True for operations that act on the local HCA only.
    #[must_use]
    pub const fn is_local(self) -> bool {
        matches!(self, Self::Nop | Self::LocalInval | Self::RegMr)
    }
}

bitflags! {
    /// The control segment's `fm_ce_se` byte.
    #[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
    pub struct CtrlFlags: u8 {
        /// Fence: wait for all earlier RDMA READs to complete first.
        const FENCE = 0x80;
        /// Initiator small fence (treated as [`Self::FENCE`] by this device).
        const SMALL_FENCE = 0x20;
        /// Generate a CQE when this WQE completes successfully ("signalled").
        const CQ_UPDATE = 0x08;
        /// Set the solicited-event bit in the message.
        const SOLICITED = 0x02;
    }
}

mod ctrl_field {
    pub const OPMOD_IDX_OPCODE: usize = 0;
    pub const QPN_DS: usize = 4;
    pub const SIGNATURE: usize = 8;
    pub const STREAM: usize = 9;
    pub const FM_CE_SE: usize = 11;
    pub const IMM: usize = 12;
    pub const END: usize = 16;
}

const_assert_eq!(ctrl_field::END, 16);
const_assert_eq!(ctrl_field::IMM, 12);
const_assert_eq!(ctrl_field::FM_CE_SE, 11);

fixed_view!(
    /// Control segment (`mlx5_wqe_ctrl_seg`, 16 bytes): 0:4
    /// `opmod<<24 | wqe_index<<8 | opcode`, 4:4 `qpn<<8 | ds`, 8 signature,
    /// 9:2 stream id, 11 `fm_ce_se`, 12:4 immediate / key.
    CtrlSeg,
    ctrl_field::END
);

impl<T: AsRef<[u8]>> CtrlSeg<T> {
    /// The opcode byte (undecoded).
    pub fn opcode(&self) -> u8 {
        get_u8(self.buffer.as_ref(), ctrl_field::OPMOD_IDX_OPCODE + 3)
    }
    /// The opcode modifier.
    pub fn opmod(&self) -> u8 {
        get_u8(self.buffer.as_ref(), ctrl_field::OPMOD_IDX_OPCODE)
    }
    /// The WQE index (the producer counter, in WQEBBs, modulo 2^16).
    pub fn wqe_index(&self) -> u16 {
        get_be16(self.buffer.as_ref(), ctrl_field::OPMOD_IDX_OPCODE + 1)
    }
    /// The QP number (24 bits).
    pub fn qpn(&self) -> u32 {
        get_be32(self.buffer.as_ref(), ctrl_field::QPN_DS) >> 8
    }
    /// The WQE size in 16-byte units, control segment included.
    pub fn ds(&self) -> u8 {
        get_u8(self.buffer.as_ref(), ctrl_field::QPN_DS + 3)
    }
    /// The signature byte.
    pub fn signature(&self) -> u8 {
        get_u8(self.buffer.as_ref(), ctrl_field::SIGNATURE)
    }
    /// The stream channel id (DC only; zero here).
    pub fn stream(&self) -> u16 {
        get_be16(self.buffer.as_ref(), ctrl_field::STREAM)
    }
    /// The fence / completion / solicited flags (unknown bits dropped).
    pub fn flags(&self) -> CtrlFlags {
        CtrlFlags::from_bits_truncate(get_u8(self.buffer.as_ref(), ctrl_field::FM_CE_SE))
    }
    /// Immediate data (SEND_IMM, RDMA_WRITE_IMM) or key (SEND_INVAL, LOCAL_INVAL).
    pub fn imm(&self) -> u32 {
        get_be32(self.buffer.as_ref(), ctrl_field::IMM)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> CtrlSeg<T> {
    /// Sets `opmod`, WQE index and opcode.
    pub fn set_opmod_idx_opcode(&mut self, opmod: u8, wqe_index: u16, opcode: u8) {
        let v = (u32::from(opmod) << 24) | (u32::from(wqe_index) << 8) | u32::from(opcode);
        set_be32(self.buffer.as_mut(), ctrl_field::OPMOD_IDX_OPCODE, v);
    }
    /// Sets QP number (24 bits) and `ds`.
    pub fn set_qpn_ds(&mut self, qpn: u32, ds: u8) {
        set_be32(
            self.buffer.as_mut(),
            ctrl_field::QPN_DS,
            ((qpn & 0xff_ffff) << 8) | u32::from(ds),
        );
    }
    /// Sets `ds` alone.
    pub fn set_ds(&mut self, ds: u8) {
        set_u8(self.buffer.as_mut(), ctrl_field::QPN_DS + 3, ds);
    }
    /// Sets the signature byte.
    pub fn set_signature(&mut self, v: u8) {
        set_u8(self.buffer.as_mut(), ctrl_field::SIGNATURE, v);
    }
    /// Sets the stream id.
    pub fn set_stream(&mut self, v: u16) {
        set_be16(self.buffer.as_mut(), ctrl_field::STREAM, v);
    }
    /// Sets the flags byte.
    pub fn set_flags(&mut self, f: CtrlFlags) {
        set_u8(self.buffer.as_mut(), ctrl_field::FM_CE_SE, f.bits());
    }
    /// Sets the immediate / key word.
    pub fn set_imm(&mut self, v: u32) {
        set_be32(self.buffer.as_mut(), ctrl_field::IMM, v);
    }
}

/// The decoded control segment.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct CtrlSegRepr {
    /// Operation.
    pub opcode: SendOpcode,
    /// Opcode modifier (zero for every opcode here).
    pub opmod: u8,
    /// Producer counter of the WQE's first WQEBB, modulo 2^16.
    pub wqe_index: u16,
    /// QP number.
    pub qpn: u32,
    /// Size in 16-byte units.
    pub ds: u8,
    /// Fence, completion request, solicited event.
    pub flags: CtrlFlags,
    /// Immediate data or key.
    pub imm: u32,
}

impl CtrlSegRepr {
    /// Bytes of the segment.
    pub const LEN: usize = ctrl_field::END;

    /// Decodes a control segment.
    ///
    /// # Errors
    /// [`FormatError::UnknownOpcode`], [`FormatError::BadDescriptorCount`].
    pub fn parse<T: AsRef<[u8]>>(seg: &CtrlSeg<T>) -> Result<Self, FormatError> {
        seg.check_len()?;
        let ds = seg.ds();
        if ds == 0 || usize::from(ds) > MAX_DS {
            return Err(FormatError::BadDescriptorCount(ds));
        }
        Ok(Self {
            opcode: SendOpcode::from_u8(seg.opcode())?,
            opmod: seg.opmod(),
            wqe_index: seg.wqe_index(),
            qpn: seg.qpn(),
            ds,
            flags: seg.flags(),
            imm: seg.imm(),
        })
    }

    /// Writes the segment.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, seg: &mut CtrlSeg<T>) {
        seg.set_opmod_idx_opcode(self.opmod, self.wqe_index, self.opcode as u8);
        seg.set_qpn_ds(self.qpn, self.ds);
        seg.set_signature(0);
        seg.set_stream(0);
        seg.set_flags(self.flags);
        seg.set_imm(self.imm);
    }

    /// Bytes `emit` writes.
    #[must_use]
    pub const fn buffer_len(&self) -> usize {
        Self::LEN
    }

    /// The segment as the two native-endian words whose bytes are what
    /// [`Self::emit`] writes: for a writer that stores whole words (the
    /// send ring), without a byte buffer between.
    #[must_use]
    #[inline]
    pub fn words(&self) -> [u64; 2] {
        // Signature and stream are zero; then the flags byte and the
        // big-endian immediate.
        let second = (u64::from(self.flags.bits()) << 32) | u64::from(self.imm);
        [self.doorbell_value().to_be(), second.to_be()]
    }

    /// The 64-bit doorbell value for this WQE: its first 8 bytes, big-endian
    /// (what mlx5 writes to the UAR doorbell register).
    #[must_use]
    pub fn doorbell_value(&self) -> u64 {
        let hi =
            (u32::from(self.opmod) << 24) | (u32::from(self.wqe_index) << 8) | self.opcode as u32;
        let lo = ((self.qpn & 0xff_ffff) << 8) | u32::from(self.ds);
        (u64::from(hi) << 32) | u64::from(lo)
    }
}

mod raddr_field {
    pub const RADDR: usize = 0;
    pub const RKEY: usize = 8;
    pub const END: usize = 16;
}
const_assert_eq!(raddr_field::RKEY, 8);
const_assert_eq!(raddr_field::END, 16);

fixed_view!(
    /// Remote address segment (`mlx5_wqe_raddr_seg`, 16 bytes): 0:8 remote
    /// virtual address, 8:4 rkey, 12:4 reserved.
    RaddrSeg,
    raddr_field::END
);

impl<T: AsRef<[u8]>> RaddrSeg<T> {
    /// Remote virtual address.
    pub fn raddr(&self) -> u64 {
        get_be64(self.buffer.as_ref(), raddr_field::RADDR)
    }
    /// Remote key.
    pub fn rkey(&self) -> u32 {
        get_be32(self.buffer.as_ref(), raddr_field::RKEY)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> RaddrSeg<T> {
    /// Sets the remote virtual address.
    pub fn set_raddr(&mut self, v: u64) {
        set_be64(self.buffer.as_mut(), raddr_field::RADDR, v);
    }
    /// Sets the remote key (and clears the reserved word).
    pub fn set_rkey(&mut self, v: u32) {
        set_be32(self.buffer.as_mut(), raddr_field::RKEY, v);
        set_be32(self.buffer.as_mut(), raddr_field::RKEY + 4, 0);
    }
}

/// The decoded remote address segment.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct RaddrSegRepr {
    /// Remote virtual address.
    pub raddr: u64,
    /// Remote key.
    pub rkey: u32,
}

impl RaddrSegRepr {
    /// Bytes of the segment.
    pub const LEN: usize = raddr_field::END;
    /// Decodes the segment.
    ///
    /// # Errors
    /// [`FormatError::Truncated`].
    pub fn parse<T: AsRef<[u8]>>(seg: &RaddrSeg<T>) -> Result<Self, FormatError> {
        seg.check_len()?;
        Ok(Self {
            raddr: seg.raddr(),
            rkey: seg.rkey(),
        })
    }
    /// Writes the segment.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, seg: &mut RaddrSeg<T>) {
        seg.set_raddr(self.raddr);
        seg.set_rkey(self.rkey);
    }
    /// Bytes `emit` writes.
    #[must_use]
    pub const fn buffer_len(&self) -> usize {
        Self::LEN
    }
}

mod data_field {
    pub const BYTE_COUNT: usize = 0;
    pub const LKEY: usize = 4;
    pub const ADDR: usize = 8;
    pub const END: usize = 16;
}
const_assert_eq!(data_field::LKEY, 4);
const_assert_eq!(data_field::ADDR, 8);
const_assert_eq!(data_field::END, 16);

fixed_view!(
    /// Data (scatter/gather) segment (`mlx5_wqe_data_seg`, 16 bytes): 0:4 byte
    /// count, 4:4 lkey, 8:8 address. Used in send WQEs, receive WQEs and as the
    /// page-list pointer of a REG_MR WQE.
    DataSeg,
    data_field::END
);

impl<T: AsRef<[u8]>> DataSeg<T> {
    /// Byte count (bit 31 set means this is an inline segment header instead).
    pub fn byte_count(&self) -> u32 {
        get_be32(self.buffer.as_ref(), data_field::BYTE_COUNT)
    }
    /// Local key.
    pub fn lkey(&self) -> u32 {
        get_be32(self.buffer.as_ref(), data_field::LKEY)
    }
    /// Address (virtual for a registered lkey, physical for the reserved lkey).
    pub fn addr(&self) -> u64 {
        get_be64(self.buffer.as_ref(), data_field::ADDR)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> DataSeg<T> {
    /// Sets the byte count.
    pub fn set_byte_count(&mut self, v: u32) {
        set_be32(self.buffer.as_mut(), data_field::BYTE_COUNT, v);
    }
    /// Sets the local key.
    pub fn set_lkey(&mut self, v: u32) {
        set_be32(self.buffer.as_mut(), data_field::LKEY, v);
    }
    /// Sets the address.
    pub fn set_addr(&mut self, v: u64) {
        set_be64(self.buffer.as_mut(), data_field::ADDR, v);
    }
}

/// The decoded data segment.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
pub struct DataSegRepr {
    /// Bytes (zero: an empty segment).
    pub byte_count: u32,
    /// Local key.
    pub lkey: u32,
    /// Address.
    pub addr: u64,
}

impl DataSegRepr {
    /// Bytes of the segment.
    pub const LEN: usize = data_field::END;
    /// Decodes the segment.
    ///
    /// # Errors
    /// [`FormatError::Truncated`]; [`FormatError::BadInline`] if bit 31 of the
    /// byte count marks it as an inline header.
    pub fn parse<T: AsRef<[u8]>>(seg: &DataSeg<T>) -> Result<Self, FormatError> {
        seg.check_len()?;
        if seg.byte_count() & INLINE_SEG_FLAG != 0 {
            return Err(FormatError::BadInline);
        }
        Ok(Self {
            byte_count: seg.byte_count(),
            lkey: seg.lkey(),
            addr: seg.addr(),
        })
    }
    /// Writes the segment.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, seg: &mut DataSeg<T>) {
        seg.set_byte_count(self.byte_count);
        seg.set_lkey(self.lkey);
        seg.set_addr(self.addr);
    }
    /// Bytes `emit` writes.
    #[must_use]
    pub const fn buffer_len(&self) -> usize {
        Self::LEN
    }
}

mod av_field {
    pub const QKEY: usize = 0;
    pub const DQP_DCT: usize = 8;
    pub const STAT_RATE_SL: usize = 12;
    pub const FL_MLID: usize = 13;
    pub const RLID: usize = 14;
    pub const RMAC: usize = 20;
    pub const TCLASS: usize = 26;
    pub const HOP_LIMIT: usize = 27;
    pub const GRH_GID_FL: usize = 28;
    pub const RGID: usize = 32;
    pub const END: usize = 48;
}
const_assert_eq!(av_field::DQP_DCT, 8);
const_assert_eq!(av_field::RMAC, 20);
const_assert_eq!(av_field::GRH_GID_FL, 28);
const_assert_eq!(av_field::RGID, 32);
const_assert_eq!(av_field::END, 48);

/// `dqp_dct` bit 31: extended address vector (`MLX5_EXTENDED_UD_AV`).
pub const AV_EXTENDED: u32 = 0x8000_0000;
/// `grh_gid_fl` bit 30: a GRH (here: the RoCE IP header) is present.
pub const AV_GRH: u32 = 0x4000_0000;

fixed_view!(
    /// UD datagram segment (`mlx5_wqe_av`, 48 bytes): 0:4 Q_Key (4:4
    /// reserved), 8:4 destination QPN (bit 31 extended AV), 12 stat rate/SL,
    /// 13 fl/mlid, 14:2 rlid, 16:4 reserved, 20:6 rmac, 26 traffic class,
    /// 27 hop limit, 28:4 GRH flag / sgid index / flow label, 32:16 rgid.
    DatagramSeg,
    av_field::END
);

impl<T: AsRef<[u8]>> DatagramSeg<T> {
    /// Q_Key (if bit 31 is set, the sending QP's own Q_Key is used instead).
    pub fn qkey(&self) -> u32 {
        get_be32(self.buffer.as_ref(), av_field::QKEY)
    }
    /// Destination QP number (24 bits).
    pub fn dqpn(&self) -> u32 {
        get_be32(self.buffer.as_ref(), av_field::DQP_DCT) & 0xff_ffff
    }
    /// The raw `dqp_dct` word.
    pub fn dqp_dct(&self) -> u32 {
        get_be32(self.buffer.as_ref(), av_field::DQP_DCT)
    }
    /// Service level (low nibble of `stat_rate_sl`).
    pub fn sl(&self) -> u8 {
        get_u8(self.buffer.as_ref(), av_field::STAT_RATE_SL) & 0x0f
    }
    /// `fl_mlid` byte.
    pub fn fl_mlid(&self) -> u8 {
        get_u8(self.buffer.as_ref(), av_field::FL_MLID)
    }
    /// Remote LID (unused on RoCE).
    pub fn rlid(&self) -> u16 {
        get_be16(self.buffer.as_ref(), av_field::RLID)
    }
    /// Remote MAC (RoCE).
    pub fn rmac(&self) -> [u8; 6] {
        get_array(self.buffer.as_ref(), av_field::RMAC)
    }
    /// Traffic class.
    pub fn tclass(&self) -> u8 {
        get_u8(self.buffer.as_ref(), av_field::TCLASS)
    }
    /// Hop limit.
    pub fn hop_limit(&self) -> u8 {
        get_u8(self.buffer.as_ref(), av_field::HOP_LIMIT)
    }
    /// The raw `grh_gid_fl` word.
    pub fn grh_gid_fl(&self) -> u32 {
        get_be32(self.buffer.as_ref(), av_field::GRH_GID_FL)
    }
    /// Flow label (20 bits).
    pub fn flow_label(&self) -> u32 {
        self.grh_gid_fl() & 0xf_ffff
    }
    /// Remote GID.
    pub fn rgid(&self) -> [u8; 16] {
        get_array(self.buffer.as_ref(), av_field::RGID)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> DatagramSeg<T> {
    /// Sets the Q_Key (and clears the reserved word after it).
    pub fn set_qkey(&mut self, v: u32) {
        set_be32(self.buffer.as_mut(), av_field::QKEY, v);
        set_be32(self.buffer.as_mut(), av_field::QKEY + 4, 0);
    }
    /// Sets the raw `dqp_dct` word.
    pub fn set_dqp_dct(&mut self, v: u32) {
        set_be32(self.buffer.as_mut(), av_field::DQP_DCT, v);
    }
    /// Sets the `stat_rate_sl` byte.
    pub fn set_stat_rate_sl(&mut self, v: u8) {
        set_u8(self.buffer.as_mut(), av_field::STAT_RATE_SL, v);
    }
    /// Sets the `fl_mlid` byte.
    pub fn set_fl_mlid(&mut self, v: u8) {
        set_u8(self.buffer.as_mut(), av_field::FL_MLID, v);
    }
    /// Sets the remote LID (and clears the reserved word after it).
    pub fn set_rlid(&mut self, v: u16) {
        set_be16(self.buffer.as_mut(), av_field::RLID, v);
        set_be32(self.buffer.as_mut(), av_field::RLID + 2, 0);
    }
    /// Sets the remote MAC.
    pub fn set_rmac(&mut self, v: [u8; 6]) {
        set_slice(self.buffer.as_mut(), av_field::RMAC, &v);
    }
    /// Sets the traffic class.
    pub fn set_tclass(&mut self, v: u8) {
        set_u8(self.buffer.as_mut(), av_field::TCLASS, v);
    }
    /// Sets the hop limit.
    pub fn set_hop_limit(&mut self, v: u8) {
        set_u8(self.buffer.as_mut(), av_field::HOP_LIMIT, v);
    }
    /// Sets the raw `grh_gid_fl` word.
    pub fn set_grh_gid_fl(&mut self, v: u32) {
        set_be32(self.buffer.as_mut(), av_field::GRH_GID_FL, v);
    }
    /// Sets the remote GID.
    pub fn set_rgid(&mut self, v: [u8; 16]) {
        set_slice(self.buffer.as_mut(), av_field::RGID, &v);
    }
}

/// A UD destination (the decoded datagram segment, RoCE subset).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
pub struct DatagramSegRepr {
    /// Q_Key; with bit 31 set the QP's own Q_Key is used (IBA rule).
    pub qkey: u32,
    /// Destination QP number.
    pub dqpn: u32,
    /// Service level.
    pub sl: u8,
    /// Traffic class.
    pub tclass: u8,
    /// Hop limit.
    pub hop_limit: u8,
    /// Flow label (20 bits).
    pub flow_label: u32,
    /// Remote GID (IPv4-mapped for RoCEv2 over IPv4).
    pub rgid: [u8; 16],
    /// Remote MAC (RoCE; the in-process fabric ignores it).
    pub rmac: [u8; 6],
}

impl DatagramSegRepr {
    /// Bytes of the segment.
    pub const LEN: usize = av_field::END;
    /// Decodes the segment.
    ///
    /// # Errors
    /// [`FormatError::Truncated`].
    pub fn parse<T: AsRef<[u8]>>(seg: &DatagramSeg<T>) -> Result<Self, FormatError> {
        seg.check_len()?;
        Ok(Self {
            qkey: seg.qkey(),
            dqpn: seg.dqpn(),
            sl: seg.sl(),
            tclass: seg.tclass(),
            hop_limit: seg.hop_limit(),
            flow_label: seg.flow_label(),
            rgid: seg.rgid(),
            rmac: seg.rmac(),
        })
    }
    /// Writes the segment (extended AV with GRH, as RoCE requires).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, seg: &mut DatagramSeg<T>) {
        seg.set_qkey(self.qkey);
        seg.set_dqp_dct(AV_EXTENDED | (self.dqpn & 0xff_ffff));
        seg.set_stat_rate_sl(self.sl & 0x0f);
        seg.set_fl_mlid(0);
        seg.set_rlid(0);
        seg.set_rmac(self.rmac);
        seg.set_tclass(self.tclass);
        seg.set_hop_limit(self.hop_limit);
        seg.set_grh_gid_fl(AV_GRH | (self.flow_label & 0xf_ffff));
        seg.set_rgid(self.rgid);
    }
    /// Bytes `emit` writes.
    #[must_use]
    pub const fn buffer_len(&self) -> usize {
        Self::LEN
    }
}

mod regmr_field {
    pub const MKEY: usize = 0;
    pub const ACCESS: usize = 4;
    pub const PAGE_SHIFT: usize = 5;
    pub const FLAGS: usize = 6;
    pub const IOVA: usize = 8;
    pub const LENGTH: usize = 16;
    pub const NPAGES: usize = 24;
    pub const END: usize = 32;
}
const_assert_eq!(regmr_field::IOVA, 8);
const_assert_eq!(regmr_field::LENGTH, 16);
const_assert_eq!(regmr_field::NPAGES, 24);
const_assert_eq!(regmr_field::END, 32);

/// `RegMrSeg` flags bit 0: the page list follows inline.
pub const REG_MR_INLINE_LIST: u8 = 0x01;
/// Smallest page shift a registration may use (4 KiB).
pub const MIN_PAGE_SHIFT: u8 = 12;
/// Largest page shift a registration may use (1 GiB).
pub const MAX_PAGE_SHIFT: u8 = 30;

fixed_view!(
    /// Fast-registration segment (this crate's own layout, 32 bytes):
    /// 0:4 mkey (index<<8 | the *new* key byte), 4 access flags, 5 page shift,
    /// 6 flags (bit 0: page list inline), 7 reserved, 8:8 I/O virtual address,
    /// 16:8 length, 24:4 number of pages, 28:4 reserved.
    ///
    /// It is followed either by the page list inline (`npages` big-endian
    /// 64-bit physical page addresses, padded to 16 bytes), or by one data
    /// segment whose address/lkey name a device-visible buffer holding that
    /// list and whose byte count is `npages * 8`.
    RegMrSeg,
    regmr_field::END
);

impl<T: AsRef<[u8]>> RegMrSeg<T> {
    /// The mkey with its new key byte.
    pub fn mkey(&self) -> u32 {
        get_be32(self.buffer.as_ref(), regmr_field::MKEY)
    }
    /// Access rights byte.
    pub fn access(&self) -> u8 {
        get_u8(self.buffer.as_ref(), regmr_field::ACCESS)
    }
    /// log2 of the page size.
    pub fn page_shift(&self) -> u8 {
        get_u8(self.buffer.as_ref(), regmr_field::PAGE_SHIFT)
    }
    /// Flags byte.
    pub fn flags(&self) -> u8 {
        get_u8(self.buffer.as_ref(), regmr_field::FLAGS)
    }
    /// I/O virtual address of byte 0 of the region.
    pub fn iova(&self) -> u64 {
        get_be64(self.buffer.as_ref(), regmr_field::IOVA)
    }
    /// Length of the region in bytes.
    pub fn length(&self) -> u64 {
        get_be64(self.buffer.as_ref(), regmr_field::LENGTH)
    }
    /// Number of pages in the list.
    pub fn npages(&self) -> u32 {
        get_be32(self.buffer.as_ref(), regmr_field::NPAGES)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> RegMrSeg<T> {
    /// Sets the mkey.
    pub fn set_mkey(&mut self, v: u32) {
        set_be32(self.buffer.as_mut(), regmr_field::MKEY, v);
    }
    /// Sets the access byte.
    pub fn set_access(&mut self, v: u8) {
        set_u8(self.buffer.as_mut(), regmr_field::ACCESS, v);
    }
    /// Sets the page shift.
    pub fn set_page_shift(&mut self, v: u8) {
        set_u8(self.buffer.as_mut(), regmr_field::PAGE_SHIFT, v);
    }
    /// Sets the flags byte (and clears the reserved byte after it).
    pub fn set_flags(&mut self, v: u8) {
        set_u8(self.buffer.as_mut(), regmr_field::FLAGS, v);
        set_u8(self.buffer.as_mut(), regmr_field::FLAGS + 1, 0);
    }
    /// Sets the I/O virtual address.
    pub fn set_iova(&mut self, v: u64) {
        set_be64(self.buffer.as_mut(), regmr_field::IOVA, v);
    }
    /// Sets the length.
    pub fn set_length(&mut self, v: u64) {
        set_be64(self.buffer.as_mut(), regmr_field::LENGTH, v);
    }
    /// Sets the page count (and clears the reserved word after it).
    pub fn set_npages(&mut self, v: u32) {
        set_be32(self.buffer.as_mut(), regmr_field::NPAGES, v);
        set_be32(self.buffer.as_mut(), regmr_field::NPAGES + 4, 0);
    }
}

/// The decoded fast-registration segment.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct RegMrSegRepr {
    /// mkey index << 8 | new key byte.
    pub mkey: u32,
    /// Access rights granted.
    pub access: AccessFlags,
    /// log2 page size.
    pub page_shift: u8,
    /// True: the page list follows inline; false: a data segment points at it.
    pub inline_list: bool,
    /// I/O virtual address of the region's first byte.
    pub iova: u64,
    /// Region length in bytes.
    pub length: u64,
    /// Pages in the list.
    pub npages: u32,
}

impl RegMrSegRepr {
    /// Bytes of the segment.
    pub const LEN: usize = regmr_field::END;

    /// Decodes the segment, checking it is self-consistent: page shift in
    /// 12..=30, 1..=[`MAX_REG_PAGES`] pages, no unknown access bits, and the
    /// region (starting at `iova`'s offset within the first page) fits in the
    /// pages.
    ///
    /// # Errors
    /// [`FormatError::Truncated`], [`FormatError::BadRegistration`].
    pub fn parse<T: AsRef<[u8]>>(seg: &RegMrSeg<T>) -> Result<Self, FormatError> {
        seg.check_len()?;
        let shift = seg.page_shift();
        let npages = seg.npages();
        let access =
            AccessFlags::from_bits(u32::from(seg.access())).ok_or(FormatError::BadRegistration)?;
        if !(MIN_PAGE_SHIFT..=MAX_PAGE_SHIFT).contains(&shift)
            || npages == 0
            || npages as usize > MAX_REG_PAGES
            || seg.flags() & !REG_MR_INLINE_LIST != 0
        {
            return Err(FormatError::BadRegistration);
        }
        let first_off = seg.iova() & ((1u64 << shift) - 1);
        let span = u64::from(npages) << shift;
        if first_off
            .checked_add(seg.length())
            .is_none_or(|end| end > span)
        {
            return Err(FormatError::BadRegistration);
        }
        Ok(Self {
            mkey: seg.mkey(),
            access,
            page_shift: shift,
            inline_list: seg.flags() & REG_MR_INLINE_LIST != 0,
            iova: seg.iova(),
            length: seg.length(),
            npages,
        })
    }

    /// The segment as the four native-endian words whose bytes are what
    /// [`Self::emit`] writes (for a writer that stores whole words).
    #[must_use]
    #[inline]
    pub fn words(&self) -> [u64; 4] {
        // Access flags fit a byte by construction of `AccessFlags`.
        let access = u8::try_from(self.access.bits()).unwrap_or(0);
        let flags = if self.inline_list {
            REG_MR_INLINE_LIST
        } else {
            0
        };
        // mkey, access, page shift, flags, a reserved zero byte.
        let first = (u64::from(self.mkey) << 32)
            | (u64::from(access) << 24)
            | (u64::from(self.page_shift) << 16)
            | (u64::from(flags) << 8);
        [
            first.to_be(),
            self.iova.to_be(),
            self.length.to_be(),
            // The page count, then a reserved zero word.
            (u64::from(self.npages) << 32).to_be(),
        ]
    }

    /// Writes the segment.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, seg: &mut RegMrSeg<T>) {
        seg.set_mkey(self.mkey);
        // Access flags fit a byte by construction of `AccessFlags`.
        seg.set_access(u8::try_from(self.access.bits()).unwrap_or(0));
        seg.set_page_shift(self.page_shift);
        seg.set_flags(if self.inline_list {
            REG_MR_INLINE_LIST
        } else {
            0
        });
        seg.set_iova(self.iova);
        seg.set_length(self.length);
        seg.set_npages(self.npages);
    }

    /// Bytes `emit` writes.
    #[must_use]
    pub const fn buffer_len(&self) -> usize {
        Self::LEN
    }
}

/// Bytes an inline segment of `len` data bytes occupies (4-byte header plus
/// data, padded to 16).
#[must_use]
pub const fn inline_seg_len(len: usize) -> usize {
    (4 + len).div_ceil(DS_SIZE) * DS_SIZE
}

/// Number of WQEBBs a WQE of `ds` descriptor units occupies.
#[must_use]
pub const fn wqebbs_for_ds(ds: u8) -> u32 {
    ((ds as usize * DS_SIZE).div_ceil(WQEBB_SIZE)) as u32
}

/// Where the data of a send WQE comes from.
#[expect(
    clippy::large_enum_variant,
    reason = "fixed capacity by design: no allocation on the data path"
)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Gather<'a> {
    /// Pointer segments (possibly none).
    Sges(Vec<DataSegRepr, MAX_SEND_SGE>),
    /// Inline bytes.
    Inline(&'a [u8]),
}

impl Gather<'_> {
    /// Total bytes named.
    #[must_use]
    pub fn total_len(&self) -> u64 {
        match self {
            Self::Sges(s) => s.iter().map(|d| u64::from(d.byte_count)).sum(),
            Self::Inline(b) => b.len() as u64,
        }
    }
}

/// Where a REG_MR WQE's page list is.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum PageList<'a> {
    /// Inline: `npages` big-endian 64-bit addresses.
    Inline(&'a [u8]),
    /// In device-visible memory named by a data segment.
    Indirect(DataSegRepr),
}

impl PageList<'_> {
    /// Page `i` of an inline list (`None` past the end or for an indirect list).
    #[must_use]
    pub fn inline_page(&self, i: usize) -> Option<PhysAddr> {
        match self {
            Self::Inline(b) => {
                let at = i.checked_mul(8)?;
                b.get(at..at + 8).map(|s| PhysAddr(get_be64(s, 0)))
            }
            Self::Indirect(_) => None,
        }
    }
}

/// A whole send WQE, decoded (the device's view of what was posted).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SendWqe<'a> {
    /// Control segment.
    pub ctrl: CtrlSegRepr,
    /// Remote address (RDMA READ/WRITE).
    pub raddr: Option<RaddrSegRepr>,
    /// UD destination.
    pub datagram: Option<DatagramSegRepr>,
    /// Fast registration.
    pub reg_mr: Option<RegMrSegRepr>,
    /// The registration's page list.
    pub page_list: Option<PageList<'a>>,
    /// Data.
    pub gather: Gather<'a>,
}

impl<'a> SendWqe<'a> {
    /// Decodes a send WQE from `bytes` (at least `ds * 16` bytes, already
    /// unwrapped from the ring). `ud` selects whether SENDs carry a datagram
    /// segment.
    ///
    /// # Errors
    /// Every malformed WQE gets a specific [`FormatError`].
    pub fn parse(bytes: &'a [u8], ud: bool) -> Result<Self, FormatError> {
        let ctrl = CtrlSegRepr::parse(&CtrlSeg::new_checked(bytes)?)?;
        let total = usize::from(ctrl.ds) * DS_SIZE;
        let wqe = bytes.get(..total).ok_or(FormatError::Truncated)?;
        let mut rest = wqe.get(CtrlSegRepr::LEN..).ok_or(FormatError::Truncated)?;
        let mut out = Self {
            ctrl,
            raddr: None,
            datagram: None,
            reg_mr: None,
            page_list: None,
            gather: Gather::Sges(Vec::new()),
        };
        let op = ctrl.opcode;
        if ud && op.is_send() {
            if op == SendOpcode::SendInval {
                return Err(FormatError::UnknownOpcode(op as u8));
            }
            out.datagram = Some(DatagramSegRepr::parse(
                &DatagramSeg::new_checked(rest).map_err(|_| FormatError::MissingSegment)?,
            )?);
            rest = rest
                .get(DatagramSegRepr::LEN..)
                .ok_or(FormatError::MissingSegment)?;
        }
        match op {
            SendOpcode::Nop | SendOpcode::LocalInval => return Ok(out),
            SendOpcode::RdmaWrite | SendOpcode::RdmaWriteImm | SendOpcode::RdmaRead => {
                if ud {
                    return Err(FormatError::UnknownOpcode(op as u8));
                }
                out.raddr = Some(RaddrSegRepr::parse(
                    &RaddrSeg::new_checked(rest).map_err(|_| FormatError::MissingSegment)?,
                )?);
                rest = rest
                    .get(RaddrSegRepr::LEN..)
                    .ok_or(FormatError::MissingSegment)?;
            }
            SendOpcode::RegMr => {
                let reg = RegMrSegRepr::parse(
                    &RegMrSeg::new_checked(rest).map_err(|_| FormatError::MissingSegment)?,
                )?;
                rest = rest
                    .get(RegMrSegRepr::LEN..)
                    .ok_or(FormatError::MissingSegment)?;
                if reg.inline_list {
                    let n = reg.npages as usize * 8;
                    let list = rest.get(..n).ok_or(FormatError::BadRegistration)?;
                    out.page_list = Some(PageList::Inline(list));
                } else {
                    let d = DataSegRepr::parse(
                        &DataSeg::new_checked(rest).map_err(|_| FormatError::MissingSegment)?,
                    )?;
                    if u64::from(d.byte_count) != u64::from(reg.npages) * 8 {
                        return Err(FormatError::BadRegistration);
                    }
                    out.page_list = Some(PageList::Indirect(d));
                }
                out.reg_mr = Some(reg);
                return Ok(out);
            }
            SendOpcode::Send | SendOpcode::SendImm | SendOpcode::SendInval => {}
        }
        out.gather = parse_gather(rest, op != SendOpcode::RdmaRead)?;
        Ok(out)
    }
}

fn parse_gather(mut rest: &[u8], inline_ok: bool) -> Result<Gather<'_>, FormatError> {
    if rest.len() >= 4 && get_be32(rest, 0) & INLINE_SEG_FLAG != 0 {
        if !inline_ok {
            return Err(FormatError::BadInline);
        }
        let len = (get_be32(rest, 0) & !INLINE_SEG_FLAG) as usize;
        let data = rest.get(4..4 + len).ok_or(FormatError::BadInline)?;
        // Nothing may follow the inline segment but its padding.
        if rest.len() > inline_seg_len(len) {
            return Err(FormatError::BadInline);
        }
        return Ok(Gather::Inline(data));
    }
    let mut sges = Vec::new();
    while !rest.is_empty() {
        let d = DataSegRepr::parse(&DataSeg::new_checked(rest)?)?;
        sges.push(d).map_err(|_| FormatError::TooManySegments)?;
        rest = rest.get(DataSegRepr::LEN..).unwrap_or(&[]);
    }
    Ok(Gather::Sges(sges))
}

/// Where a send WQE's segments are stored: the staging buffer of a
/// [`SendWqeBuilder`], or the send ring itself
/// ([`crate::ring::SendWqeWriter`]). Both append their segments through the
/// one encoder below ([`SegmentEncoder`]), so the two can never disagree on
/// a byte of a WQE.
pub(crate) trait SegmentSink {
    /// Claims `n` more bytes (a multiple of [`DS_SIZE`]); the byte offset
    /// in the WQE they start at.
    fn reserve(&mut self, n: usize) -> Result<usize, FormatError>;

    /// Stores `bytes` (a multiple of 8 long, inside a claimed range) at
    /// byte `at` of the WQE.
    fn put(&mut self, at: usize, bytes: &[u8]);
}

/// The segment encoders of a send WQE, over any [`SegmentSink`]. Each
/// segment is encoded by its `Repr` into a small stack buffer (never more
/// than 48 bytes) and handed to the sink whole.
pub(crate) trait SegmentEncoder: SegmentSink {
    /// Appends a remote address segment.
    #[inline]
    fn put_raddr(&mut self, raddr: u64, rkey: u32) -> Result<(), FormatError> {
        let at = self.reserve(RaddrSegRepr::LEN)?;
        let mut seg = [0u8; RaddrSegRepr::LEN];
        RaddrSegRepr { raddr, rkey }.emit(&mut RaddrSeg::new_unchecked(&mut seg[..]));
        self.put(at, &seg);
        Ok(())
    }

    /// Appends a data segment.
    #[inline]
    fn put_data(&mut self, seg: DataSegRepr) -> Result<(), FormatError> {
        let at = self.reserve(DataSegRepr::LEN)?;
        let mut bytes = [0u8; DataSegRepr::LEN];
        seg.emit(&mut DataSeg::new_unchecked(&mut bytes[..]));
        self.put(at, &bytes);
        Ok(())
    }

    /// Appends an inline data segment holding `data`: the header and the
    /// data as one byte stream, zero-padded to 16, 16 bytes at a time.
    #[inline]
    fn put_inline(&mut self, data: &[u8]) -> Result<(), FormatError> {
        let hdr =
            u32::try_from(data.len()).map_err(|_| FormatError::WqeTooLarge)? | INLINE_SEG_FLAG;
        let at = self.reserve(inline_seg_len(data.len()))?;
        let mut chunk = [0u8; DS_SIZE];
        set_be32(&mut chunk, 0, hdr);
        let mut filled = 4;
        let mut offset = at;
        let mut rest = data;
        loop {
            let n = rest.len().min(DS_SIZE - filled);
            let (now, later) = rest.split_at_checked(n).unwrap_or((rest, &[]));
            set_slice(&mut chunk, filled, now);
            filled += n;
            rest = later;
            if filled == DS_SIZE || rest.is_empty() {
                if let Some(pad) = chunk.get_mut(filled..) {
                    pad.fill(0);
                }
                self.put(offset, &chunk);
                offset += DS_SIZE;
                filled = 0;
            }
            if rest.is_empty() {
                return Ok(());
            }
        }
    }

    /// Appends a UD datagram segment.
    #[inline]
    fn put_datagram(&mut self, av: &DatagramSegRepr) -> Result<(), FormatError> {
        let at = self.reserve(DatagramSegRepr::LEN)?;
        let mut seg = [0u8; DatagramSegRepr::LEN];
        av.emit(&mut DatagramSeg::new_unchecked(&mut seg[..]));
        self.put(at, &seg);
        Ok(())
    }

    /// Appends a fast-registration segment.
    #[inline]
    fn put_reg_mr(&mut self, reg: &RegMrSegRepr) -> Result<(), FormatError> {
        let at = self.reserve(RegMrSegRepr::LEN)?;
        let mut seg = [0u8; RegMrSegRepr::LEN];
        reg.emit(&mut RegMrSeg::new_unchecked(&mut seg[..]));
        self.put(at, &seg);
        Ok(())
    }

    /// Appends a fast-registration segment followed by its page list
    /// inline (big-endian addresses, zero-padded to 16).
    #[inline]
    fn put_reg_mr_inline(
        &mut self,
        reg: &RegMrSegRepr,
        pages: &[PhysAddr],
    ) -> Result<(), FormatError> {
        if !reg.inline_list || pages.len() != reg.npages as usize {
            return Err(FormatError::BadRegistration);
        }
        self.put_reg_mr(reg)?;
        let at = self.reserve((pages.len() * 8).div_ceil(DS_SIZE) * DS_SIZE)?;
        for (i, p) in pages.iter().enumerate() {
            self.put(at + i * 8, &p.0.to_be_bytes());
        }
        if pages.len() % 2 == 1 {
            self.put(at + pages.len() * 8, &[0; 8]);
        }
        Ok(())
    }

    /// Appends a fast-registration segment whose page list lives in device
    /// memory named by `list` (byte count `npages * 8`).
    #[inline]
    fn put_reg_mr_indirect(
        &mut self,
        reg: &RegMrSegRepr,
        list: DataSegRepr,
    ) -> Result<(), FormatError> {
        if reg.inline_list || u64::from(list.byte_count) != u64::from(reg.npages) * 8 {
            return Err(FormatError::BadRegistration);
        }
        self.put_reg_mr(reg)?;
        self.put_data(list)
    }
}

impl<S: SegmentSink + ?Sized> SegmentEncoder for S {}

/// Builds one send WQE in a local buffer (the BlueFlame idea: build it in
/// cacheable memory, then copy it into the ring with 64-bit stores using
/// [`crate::ring::SendRing::write_wqe`]). The driver writes WQEs in place
/// ([`crate::ring::SendWqeWriter`], the same segment encoder); this builder
/// serves tests, the device model's checks and callers that need the
/// bytes.
///
/// Segments must be pushed in the order the opcode's layout requires (see the
/// module table); [`SendWqeBuilder::finish`] fills in `ds`.
#[derive(Clone)]
pub struct SendWqeBuilder {
    buf: [u8; MAX_SEND_WQE_BYTES],
    len: usize,
    ctrl: CtrlSegRepr,
}

impl SegmentSink for SendWqeBuilder {
    fn reserve(&mut self, n: usize) -> Result<usize, FormatError> {
        let start = self.len;
        let end = start.checked_add(n).ok_or(FormatError::WqeTooLarge)?;
        self.buf
            .get_mut(start..end)
            .ok_or(FormatError::WqeTooLarge)?
            .fill(0);
        self.len = end;
        Ok(start)
    }

    fn put(&mut self, at: usize, bytes: &[u8]) {
        set_slice(&mut self.buf, at, bytes);
    }
}

impl SendWqeBuilder {
    /// Starts a WQE with its control segment (`ds` is filled in by `finish`).
    #[must_use]
    pub fn new(opcode: SendOpcode, wqe_index: u16, qpn: u32, flags: CtrlFlags, imm: u32) -> Self {
        let ctrl = CtrlSegRepr {
            opcode,
            opmod: 0,
            wqe_index,
            qpn,
            ds: 1,
            flags,
            imm,
        };
        let mut b = Self {
            buf: [0; MAX_SEND_WQE_BYTES],
            len: CtrlSegRepr::LEN,
            ctrl,
        };
        ctrl.emit(&mut CtrlSeg::new_unchecked(&mut b.buf[..]));
        b
    }

    /// Appends a remote address segment.
    ///
    /// # Errors
    /// [`FormatError::WqeTooLarge`].
    pub fn raddr(&mut self, raddr: u64, rkey: u32) -> Result<&mut Self, FormatError> {
        self.put_raddr(raddr, rkey)?;
        Ok(self)
    }

    /// Appends a data segment.
    ///
    /// # Errors
    /// [`FormatError::WqeTooLarge`].
    pub fn data(&mut self, seg: DataSegRepr) -> Result<&mut Self, FormatError> {
        self.put_data(seg)?;
        Ok(self)
    }

    /// Appends an inline data segment holding `data`.
    ///
    /// # Errors
    /// [`FormatError::WqeTooLarge`].
    pub fn inline(&mut self, data: &[u8]) -> Result<&mut Self, FormatError> {
        self.put_inline(data)?;
        Ok(self)
    }

    /// Appends a UD datagram segment.
    ///
    /// # Errors
    /// [`FormatError::WqeTooLarge`].
    pub fn datagram(&mut self, av: &DatagramSegRepr) -> Result<&mut Self, FormatError> {
        self.put_datagram(av)?;
        Ok(self)
    }

    /// Appends a fast-registration segment followed by its page list inline.
    ///
    /// # Errors
    /// [`FormatError::WqeTooLarge`]; [`FormatError::BadRegistration`] if
    /// `pages.len()` differs from `reg.npages` or `reg.inline_list` is false.
    pub fn reg_mr_inline(
        &mut self,
        reg: &RegMrSegRepr,
        pages: &[PhysAddr],
    ) -> Result<&mut Self, FormatError> {
        self.put_reg_mr_inline(reg, pages)?;
        Ok(self)
    }

    /// Appends a fast-registration segment whose page list lives in device
    /// memory named by `list` (byte count `npages * 8`).
    ///
    /// # Errors
    /// [`FormatError::WqeTooLarge`]; [`FormatError::BadRegistration`] if
    /// `reg.inline_list` is set or `list` has the wrong size.
    pub fn reg_mr_indirect(
        &mut self,
        reg: &RegMrSegRepr,
        list: DataSegRepr,
    ) -> Result<&mut Self, FormatError> {
        self.put_reg_mr_indirect(reg, list)?;
        Ok(self)
    }

    /// Finishes the WQE: writes `ds` and returns the bytes (a multiple of 16).
    ///
    /// # Errors
    /// [`FormatError::WqeTooLarge`] if more than [`MAX_DS`] units were pushed.
    pub fn finish(&mut self) -> Result<&[u8], FormatError> {
        let ds = u8::try_from(self.len / DS_SIZE).map_err(|_| FormatError::WqeTooLarge)?;
        if usize::from(ds) > MAX_DS {
            return Err(FormatError::WqeTooLarge);
        }
        self.ctrl.ds = ds;
        let len = self.len;
        let buf = self.buf.get_mut(..len).ok_or(FormatError::WqeTooLarge)?;
        CtrlSeg::new_unchecked(&mut *buf).set_ds(ds);
        Ok(buf)
    }

    /// The control segment as it stands (after `finish`, with the final `ds`).
    #[must_use]
    pub fn ctrl(&self) -> CtrlSegRepr {
        self.ctrl
    }

    /// WQEBBs the WQE occupies so far.
    #[must_use]
    pub fn wqebbs(&self) -> u32 {
        self.len.div_ceil(WQEBB_SIZE) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn word_bytes<const N: usize>(words: [u64; N]) -> alloc::vec::Vec<u8> {
        words.iter().flat_map(|w| w.to_ne_bytes()).collect()
    }

    /// The word forms the send ring's writer stores are byte for byte what
    /// `emit` writes, every field set to a distinct non-zero pattern (and
    /// each flag both ways).
    #[test]
    fn words_match_emit() {
        for (flags, imm) in [
            (CtrlFlags::CQ_UPDATE | CtrlFlags::SOLICITED, 0xdead_beef),
            (CtrlFlags::empty(), 0x0102_0304),
            (CtrlFlags::all(), u32::MAX),
        ] {
            let ctrl = CtrlSegRepr {
                opcode: SendOpcode::SendImm,
                opmod: 0x5a,
                wqe_index: 0x1234,
                qpn: 0xab_cdef,
                ds: 7,
                flags,
                imm,
            };
            let mut b = [0xffu8; CtrlSegRepr::LEN];
            ctrl.emit(&mut CtrlSeg::new_unchecked(&mut b[..]));
            assert_eq!(word_bytes(ctrl.words()), b.to_vec());
        }
        for inline_list in [true, false] {
            let reg = RegMrSegRepr {
                mkey: 0x1122_3344,
                access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ,
                page_shift: 21,
                inline_list,
                iova: 0x0102_0304_0506_0708,
                length: 0x1112_1314_1516_1718,
                npages: 0x2122_2324,
            };
            let mut b = [0xffu8; RegMrSegRepr::LEN];
            reg.emit(&mut RegMrSeg::new_unchecked(&mut b[..]));
            assert_eq!(word_bytes(reg.words()), b.to_vec());
        }
    }

    #[test]
    fn ctrl_golden_bytes() {
        let mut b = [0u8; 16];
        let repr = CtrlSegRepr {
            opcode: SendOpcode::SendImm,
            opmod: 0,
            wqe_index: 0x1234,
            qpn: 0xab_cdef,
            ds: 3,
            flags: CtrlFlags::CQ_UPDATE | CtrlFlags::SOLICITED,
            imm: 0xdead_beef,
        };
        repr.emit(&mut CtrlSeg::new_unchecked(&mut b[..]));
        assert_eq!(
            b,
            [
                0x00, 0x12, 0x34, 0x0b, 0xab, 0xcd, 0xef, 0x03, 0, 0, 0, 0x0a, 0xde, 0xad, 0xbe,
                0xef
            ]
        );
        assert_eq!(
            CtrlSegRepr::parse(&CtrlSeg::new_checked(&b[..]).unwrap()).unwrap(),
            repr
        );
        assert_eq!(repr.doorbell_value(), 0x0012_340b_abcd_ef03);
    }

    #[test]
    fn ctrl_rejects_bad_opcode_and_ds() {
        let mut b = [0u8; 16];
        b[3] = 0x0a;
        b[7] = 0;
        assert_eq!(
            CtrlSegRepr::parse(&CtrlSeg::new_unchecked(&b[..])),
            Err(FormatError::BadDescriptorCount(0))
        );
        b[7] = 64;
        assert_eq!(
            CtrlSegRepr::parse(&CtrlSeg::new_unchecked(&b[..])),
            Err(FormatError::BadDescriptorCount(64))
        );
        b[7] = 1;
        b[3] = 0x11; // atomic CS: not executed by this device
        assert_eq!(
            CtrlSegRepr::parse(&CtrlSeg::new_unchecked(&b[..])),
            Err(FormatError::UnknownOpcode(0x11))
        );
        assert_eq!(
            CtrlSeg::new_checked(&b[..15]).err(),
            Some(FormatError::Truncated)
        );
    }

    #[test]
    fn raddr_and_data_golden_bytes() {
        let mut b = [0xffu8; 16];
        RaddrSegRepr {
            raddr: 0x0102_0304_0506_0708,
            rkey: 0x1122_3344,
        }
        .emit(&mut RaddrSeg::new_unchecked(&mut b[..]));
        assert_eq!(
            b,
            [1, 2, 3, 4, 5, 6, 7, 8, 0x11, 0x22, 0x33, 0x44, 0, 0, 0, 0]
        );
        let mut d = [0u8; 16];
        DataSegRepr {
            byte_count: 0x200,
            lkey: 0x100,
            addr: 0xfeed_0000_1000,
        }
        .emit(&mut DataSeg::new_unchecked(&mut d[..]));
        assert_eq!(d, [0, 0, 2, 0, 0, 0, 1, 0, 0, 0, 0xfe, 0xed, 0, 0, 0x10, 0]);
        let mut inl = d;
        inl[0] = 0x80;
        assert_eq!(
            DataSegRepr::parse(&DataSeg::new_unchecked(&inl[..])),
            Err(FormatError::BadInline)
        );
    }

    #[test]
    fn datagram_golden_bytes() {
        let mut b = [0xaau8; 48];
        let mut gid = [0u8; 16];
        gid[10] = 0xff;
        gid[11] = 0xff;
        gid[12..].copy_from_slice(&[192, 0, 2, 1]);
        let av = DatagramSegRepr {
            qkey: 0x8001_0000,
            dqpn: 1,
            sl: 3,
            tclass: 0x10,
            hop_limit: 64,
            flow_label: 0x12345,
            rgid: gid,
            rmac: [2, 0, 0, 0, 0, 1],
        };
        av.emit(&mut DatagramSeg::new_unchecked(&mut b[..]));
        let mut want = [0u8; 48];
        want[..4].copy_from_slice(&[0x80, 0x01, 0, 0]);
        want[8..12].copy_from_slice(&[0x80, 0, 0, 1]);
        want[12] = 3;
        want[20..26].copy_from_slice(&[2, 0, 0, 0, 0, 1]);
        want[26] = 0x10;
        want[27] = 64;
        want[28..32].copy_from_slice(&[0x40, 0x01, 0x23, 0x45]);
        want[32..].copy_from_slice(&gid);
        assert_eq!(b, want);
        assert_eq!(
            DatagramSegRepr::parse(&DatagramSeg::new_checked(&b[..]).unwrap()).unwrap(),
            av
        );
    }

    #[test]
    fn reg_mr_golden_bytes_and_checks() {
        let reg = RegMrSegRepr {
            mkey: 0x0000_1207,
            access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
            page_shift: 12,
            inline_list: true,
            iova: 0x7000_0000_0010,
            length: 0x1ff0,
            npages: 2,
        };
        let mut b = [0u8; 32];
        reg.emit(&mut RegMrSeg::new_unchecked(&mut b[..]));
        let want: [u8; 32] = [
            0, 0, 0x12, 0x07, 0x03, 12, 0x01, 0, //
            0, 0, 0x70, 0, 0, 0, 0, 0x10, //
            0, 0, 0, 0, 0, 0, 0x1f, 0xf0, //
            0, 0, 0, 2, 0, 0, 0, 0,
        ];
        assert_eq!(b, want);
        assert_eq!(
            RegMrSegRepr::parse(&RegMrSeg::new_checked(&b[..]).unwrap()).unwrap(),
            reg
        );
        // One byte too long for two pages from offset 0x10.
        let mut long = b;
        long[23] = 0xf1;
        assert_eq!(
            RegMrSegRepr::parse(&RegMrSeg::new_unchecked(&long[..])),
            Err(FormatError::BadRegistration)
        );
        let mut shift = b;
        shift[5] = 11;
        assert_eq!(
            RegMrSegRepr::parse(&RegMrSeg::new_unchecked(&shift[..])),
            Err(FormatError::BadRegistration)
        );
        let mut zero = b;
        zero[27] = 0;
        assert_eq!(
            RegMrSegRepr::parse(&RegMrSeg::new_unchecked(&zero[..])),
            Err(FormatError::BadRegistration)
        );
        let mut acc = b;
        acc[4] = 0x80;
        assert_eq!(
            RegMrSegRepr::parse(&RegMrSeg::new_unchecked(&acc[..])),
            Err(FormatError::BadRegistration)
        );
    }

    #[test]
    fn builder_rdma_write_golden_and_parse() {
        let mut b = SendWqeBuilder::new(SendOpcode::RdmaWrite, 7, 0x42, CtrlFlags::CQ_UPDATE, 0);
        b.raddr(0x1000, 0x55).unwrap();
        b.data(DataSegRepr {
            byte_count: 64,
            lkey: 0x77,
            addr: 0x2000,
        })
        .unwrap();
        let bytes = b.finish().unwrap().to_vec();
        assert_eq!(bytes.len(), 48);
        assert_eq!(&bytes[..8], &[0, 0, 7, 0x08, 0, 0, 0x42, 3]);
        assert_eq!(b.wqebbs(), 1);
        let w = SendWqe::parse(&bytes, false).unwrap();
        assert_eq!(
            w.raddr,
            Some(RaddrSegRepr {
                raddr: 0x1000,
                rkey: 0x55
            })
        );
        assert_eq!(w.gather.total_len(), 64);
    }

    #[test]
    fn builder_inline_pads_and_wraps_bbs() {
        let data = [0x5au8; 100];
        let mut b = SendWqeBuilder::new(SendOpcode::Send, 0, 1, CtrlFlags::empty(), 0);
        b.inline(&data).unwrap();
        let bytes = b.finish().unwrap().to_vec();
        // ctrl 16 + inline (4 + 100 -> 112)
        assert_eq!(bytes.len(), 128);
        assert_eq!(&bytes[16..20], &[0x80, 0, 0, 100]);
        assert_eq!(b.wqebbs(), 2);
        let w = SendWqe::parse(&bytes, false).unwrap();
        assert_eq!(w.gather, Gather::Inline(&data[..]));
        // An inline length past the WQE is rejected.
        let mut bad = bytes.clone();
        bad[19] = 120;
        assert_eq!(SendWqe::parse(&bad, false), Err(FormatError::BadInline));
        // Inline is not allowed for RDMA READ.
        let mut rd = SendWqeBuilder::new(SendOpcode::RdmaRead, 0, 1, CtrlFlags::empty(), 0);
        rd.raddr(0, 0).unwrap().inline(&[1, 2]).unwrap();
        let rd = rd.finish().unwrap().to_vec();
        assert_eq!(SendWqe::parse(&rd, false), Err(FormatError::BadInline));
    }

    #[test]
    fn builder_reg_mr_inline_and_indirect() {
        let reg = RegMrSegRepr {
            mkey: 0x301,
            access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ,
            page_shift: 12,
            inline_list: true,
            iova: 0x10_0000,
            length: 0x3000,
            npages: 3,
        };
        let pages = [PhysAddr(0x1000), PhysAddr(0x9000), PhysAddr(0x4000)];
        let mut b = SendWqeBuilder::new(SendOpcode::RegMr, 3, 9, CtrlFlags::empty(), 0);
        b.reg_mr_inline(&reg, &pages).unwrap();
        let bytes = b.finish().unwrap().to_vec();
        // ctrl 16 + seg 32 + list 24 -> 32
        assert_eq!(bytes.len(), 80);
        let w = SendWqe::parse(&bytes, false).unwrap();
        let list = w.page_list.unwrap();
        assert_eq!(list.inline_page(1), Some(PhysAddr(0x9000)));
        assert_eq!(list.inline_page(3), None);
        let ind = RegMrSegRepr {
            inline_list: false,
            ..reg
        };
        let mut b = SendWqeBuilder::new(SendOpcode::RegMr, 3, 9, CtrlFlags::empty(), 0);
        assert_eq!(
            b.reg_mr_indirect(
                &ind,
                DataSegRepr {
                    byte_count: 16,
                    lkey: 0,
                    addr: 0
                }
            )
            .err(),
            Some(FormatError::BadRegistration)
        );
        b.reg_mr_indirect(
            &ind,
            DataSegRepr {
                byte_count: 24,
                lkey: 0,
                addr: 0x8000,
            },
        )
        .unwrap();
        let bytes = b.finish().unwrap().to_vec();
        let w = SendWqe::parse(&bytes, false).unwrap();
        assert_eq!(
            w.page_list,
            Some(PageList::Indirect(DataSegRepr {
                byte_count: 24,
                lkey: 0,
                addr: 0x8000
            }))
        );
    }

    #[test]
    fn ud_send_requires_datagram() {
        let mut b = SendWqeBuilder::new(SendOpcode::Send, 0, 1, CtrlFlags::empty(), 0);
        b.datagram(&DatagramSegRepr {
            dqpn: 1,
            qkey: 0x8001_0000,
            ..Default::default()
        })
        .unwrap();
        b.data(DataSegRepr {
            byte_count: 256,
            lkey: 1,
            addr: 2,
        })
        .unwrap();
        let bytes = b.finish().unwrap().to_vec();
        let w = SendWqe::parse(&bytes, true).unwrap();
        assert_eq!(w.datagram.unwrap().dqpn, 1);
        // Too short for a datagram segment.
        let short = SendWqeBuilder::new(SendOpcode::Send, 0, 1, CtrlFlags::empty(), 0)
            .finish()
            .unwrap()
            .to_vec();
        assert_eq!(
            SendWqe::parse(&short, true),
            Err(FormatError::MissingSegment)
        );
        let mut rw = SendWqeBuilder::new(SendOpcode::RdmaWrite, 0, 1, CtrlFlags::empty(), 0);
        let rw = rw.finish().unwrap().to_vec();
        assert_eq!(SendWqe::parse(&rw, false), Err(FormatError::MissingSegment));
        assert_eq!(
            SendWqe::parse(&rw, true),
            Err(FormatError::UnknownOpcode(0x08))
        );
    }

    #[test]
    fn too_many_segments() {
        let mut b = SendWqeBuilder::new(SendOpcode::Send, 0, 1, CtrlFlags::empty(), 0);
        for _ in 0..17 {
            b.data(DataSegRepr::default()).unwrap();
        }
        let bytes = b.finish().unwrap().to_vec();
        assert_eq!(
            SendWqe::parse(&bytes, false),
            Err(FormatError::TooManySegments)
        );
        let mut b = SendWqeBuilder::new(SendOpcode::Send, 0, 1, CtrlFlags::empty(), 0);
        for _ in 0..62 {
            b.data(DataSegRepr::default()).unwrap();
        }
        assert_eq!(
            b.data(DataSegRepr::default()).err(),
            Some(FormatError::WqeTooLarge)
        );
    }
}
