//! Doorbell records (in DMA memory) and doorbell registers (MMIO).
//!
//! A **doorbell record** is a small piece of DMA memory the driver writes and
//! the device reads (and the reverse for nothing): it holds the producer
//! counters of a QP's queues, or a CQ's consumer counter and arm request. A
//! **doorbell register** is the MMIO write that tells the device to look.
//!
//! QP record (8 bytes): 0:4 receive counter (BE, low 16 bits), 4:4 send
//! counter in WQEBBs (BE, low 16 bits) — `MLX5_RCV_DBR = 0`, `MLX5_SND_DBR = 1`.
//!
//! CQ record (8 bytes): 0:4 consumer counter (BE, low 24 bits), 4:4 the last
//! arm request `sn<<28 | cmd | ci` — `MLX5_CQ_SET_CI = 0`, `MLX5_CQ_ARM_DB = 1`.
//!
//! The SQ doorbell register takes the first 8 bytes of the last posted WQE's
//! control segment ([`crate::wqe::CtrlSegRepr::doorbell_value`]); the CQ arm
//! doorbell takes `(sn<<28 | cmd | ci) << 32 | cqn` ([`CqArm::doorbell_value`]).
//! The order of writes is documented in [`crate::barrier`].

#![forbid(unsafe_code)]

use crate::dma::{DmaError, SharedWords, load_be32, store_be32};
use crate::sync::atomic::Ordering;

/// Byte offset of the receive counter in a QP doorbell record.
pub const QP_DBR_RCV: usize = 0;
/// Byte offset of the send counter in a QP doorbell record.
pub const QP_DBR_SND: usize = 4;
/// Byte offset of the consumer counter in a CQ doorbell record.
pub const CQ_DBR_SET_CI: usize = 0;
/// Byte offset of the arm word in a CQ doorbell record.
pub const CQ_DBR_ARM: usize = 4;
/// Bytes of either doorbell record.
pub const DBR_LEN: usize = 8;

/// A QP doorbell record over shared memory.
#[derive(Debug)]
pub struct QpDoorbellRecord<M: SharedWords> {
    mem: M,
}

impl<M: SharedWords> QpDoorbellRecord<M> {
    /// Wraps memory of at least [`DBR_LEN`] bytes.
    ///
    /// # Errors
    /// [`DmaError::OutOfBounds`] if the memory is too small.
    pub fn new(mem: M) -> Result<Self, DmaError> {
        if mem.words().is_empty() {
            return Err(DmaError::OutOfBounds);
        }
        Ok(Self { mem })
    }

    /// The memory.
    pub fn mem(&self) -> &M {
        &self.mem
    }

    /// Gives the memory back (to wrap it differently: [`Self::new`] again
    /// over the wrapper).
    pub fn into_mem(self) -> M {
        self.mem
    }

    /// Publishes the send producer counter (in WQEBBs). Call after
    /// [`crate::barrier::to_device`].
    ///
    /// # IRQL
    /// Any (never blocks).
    pub fn set_sq_head(&self, counter: u16) {
        // The record was checked to be one word long in `new`.
        let _ = store_be32(
            self.mem.words(),
            QP_DBR_SND,
            u32::from(counter),
            Ordering::Release,
        );
    }

    /// Publishes the receive producer counter. Call after
    /// [`crate::barrier::to_device`].
    ///
    /// # IRQL
    /// Any (never blocks).
    pub fn set_rq_head(&self, counter: u16) {
        let _ = store_be32(
            self.mem.words(),
            QP_DBR_RCV,
            u32::from(counter),
            Ordering::Release,
        );
    }

    /// The send producer counter (device side: Acquire, pairs with the store).
    pub fn sq_head(&self) -> u16 {
        (load_be32(self.mem.words(), QP_DBR_SND, Ordering::Acquire).unwrap_or(0) & 0xffff) as u16
    }

    /// The receive producer counter (device side: Acquire).
    pub fn rq_head(&self) -> u16 {
        (load_be32(self.mem.words(), QP_DBR_RCV, Ordering::Acquire).unwrap_or(0) & 0xffff) as u16
    }
}

static_assertions::const_assert_eq!(CQ_DBR_SET_CI, 0);
static_assertions::const_assert_eq!(CQ_DBR_ARM, 4);
static_assertions::const_assert_eq!(DBR_LEN, 8);

/// Arm command: event on the next CQE of any kind.
pub const CQ_ARM_NEXT: u32 = 0;
/// Arm command: event on the next solicited or error CQE.
pub const CQ_ARM_SOLICITED: u32 = 1 << 24;

/// A CQ arm request (`sn<<28 | cmd | ci`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct CqArm {
    /// Arm sequence number (2 bits), incremented by the driver per event.
    pub sn: u8,
    /// Solicited-only arm.
    pub solicited_only: bool,
    /// Consumer counter at the time of arming (24 bits).
    pub ci: u32,
}

impl CqArm {
    /// The arm word of the doorbell record.
    #[must_use]
    pub const fn word(&self) -> u32 {
        let cmd = if self.solicited_only {
            CQ_ARM_SOLICITED
        } else {
            CQ_ARM_NEXT
        };
        ((self.sn as u32 & 3) << 28) | cmd | (self.ci & 0xff_ffff)
    }

    /// Decodes an arm word.
    #[must_use]
    pub const fn from_word(w: u32) -> Self {
        Self {
            sn: ((w >> 28) & 3) as u8,
            solicited_only: w & CQ_ARM_SOLICITED != 0,
            ci: w & 0xff_ffff,
        }
    }

    /// The 64-bit value for the CQ doorbell register.
    #[must_use]
    pub const fn doorbell_value(&self, cqn: u32) -> u64 {
        ((self.word() as u64) << 32) | cqn as u64
    }

    /// Decodes a doorbell register value into (arm, cqn).
    #[must_use]
    pub const fn from_doorbell_value(v: u64) -> (Self, u32) {
        (Self::from_word((v >> 32) as u32), v as u32)
    }
}

/// A CQ doorbell record over shared memory.
#[derive(Debug)]
pub struct CqDoorbellRecord<M: SharedWords> {
    mem: M,
}

impl<M: SharedWords> CqDoorbellRecord<M> {
    /// Wraps memory of at least [`DBR_LEN`] bytes.
    ///
    /// # Errors
    /// [`DmaError::OutOfBounds`] if the memory is too small.
    pub fn new(mem: M) -> Result<Self, DmaError> {
        if mem.words().is_empty() {
            return Err(DmaError::OutOfBounds);
        }
        Ok(Self { mem })
    }

    /// The memory.
    pub fn mem(&self) -> &M {
        &self.mem
    }

    /// Gives the memory back (to wrap it differently: [`Self::new`] again
    /// over the wrapper).
    pub fn into_mem(self) -> M {
        self.mem
    }

    /// Publishes the consumer counter (once per polled batch), freeing the
    /// consumed CQEs for the device to overwrite.
    ///
    /// # IRQL
    /// Any (never blocks).
    pub fn set_ci(&self, counter: u32) {
        let _ = store_be32(
            self.mem.words(),
            CQ_DBR_SET_CI,
            counter & 0xff_ffff,
            Ordering::Release,
        );
    }

    /// The consumer counter (24 bits; device side, Acquire).
    pub fn ci(&self) -> u32 {
        load_be32(self.mem.words(), CQ_DBR_SET_CI, Ordering::Acquire).unwrap_or(0) & 0xff_ffff
    }

    /// Records an arm request (before ringing the CQ doorbell register).
    ///
    /// # IRQL
    /// Any (never blocks).
    pub fn set_arm(&self, arm: CqArm) {
        let _ = store_be32(self.mem.words(), CQ_DBR_ARM, arm.word(), Ordering::Release);
    }

    /// Publishes the consumer counter and the arm word together, as one
    /// 64-bit store of the whole record. [`Self::set_ci`] and
    /// [`Self::set_arm`] each merge 32 bits into the record's word (a
    /// compare-and-swap loop in this DMA model); a driver that is the
    /// record's only writer and knows both halves — the CQ's poller, which
    /// remembers its last arm word — writes both for the price of one
    /// plain store. The half it rewrites unchanged is no new information to
    /// the device. `ci` is truncated to 24 bits as in [`Self::set_ci`].
    ///
    /// # IRQL
    /// Any (never blocks).
    #[inline]
    pub fn set_ci_and_arm(&self, ci: u32, arm: CqArm) {
        // The record's layout: the counter at CQ_DBR_SET_CI (0), the arm
        // word at CQ_DBR_ARM (4), both big-endian (pinned above): the
        // 64-bit value `ci << 32 | arm`, stored big-endian.
        let record = (u64::from(ci & 0xff_ffff) << 32) | u64::from(arm.word());
        // The record was checked to be one word long in `new`.
        if let Some(word) = self.mem.words().first() {
            word.store(record.to_be(), Ordering::Release);
        }
    }

    /// The last recorded arm request.
    pub fn arm(&self) -> CqArm {
        CqArm::from_word(load_be32(self.mem.words(), CQ_DBR_ARM, Ordering::Acquire).unwrap_or(0))
    }
}

/// A doorbell register: one 64-bit MMIO write.
///
/// On hardware this is a write to a UAR page; in the software HCA it is a
/// call into the device model (which, in stepped-inline mode, may execute the
/// posted work — and deliver completion events — before it returns).
pub trait DoorbellRegister: Send + Sync {
    /// Writes the 64-bit doorbell value.
    ///
    /// # IRQL
    /// <= DISPATCH_LEVEL. Never blocks, never allocates in the caller's
    /// context beyond what the device model documents.
    fn write64(&self, value: u64);
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::sync::atomic::AtomicU64;

    #[test]
    fn qp_record_golden_bytes() {
        let w = [AtomicU64::new(0)];
        let r = QpDoorbellRecord::new(&w[..]).unwrap();
        r.set_rq_head(0x0102);
        r.set_sq_head(0xa0b0);
        let mut b = [0u8; 8];
        crate::dma::read_bytes(&w, 8, 0, &mut b).unwrap();
        assert_eq!(b, [0, 0, 0x01, 0x02, 0, 0, 0xa0, 0xb0]);
        assert_eq!(r.sq_head(), 0xa0b0);
        assert_eq!(r.rq_head(), 0x0102);
        assert!(QpDoorbellRecord::new(&[][..]).is_err());
    }

    #[test]
    fn cq_record_and_arm_golden_bytes() {
        let w = [AtomicU64::new(0)];
        let r = CqDoorbellRecord::new(&w[..]).unwrap();
        r.set_ci(0x0123_4567);
        let arm = CqArm {
            sn: 2,
            solicited_only: true,
            ci: 0x45_6789,
        };
        r.set_arm(arm);
        let mut b = [0u8; 8];
        crate::dma::read_bytes(&w, 8, 0, &mut b).unwrap();
        assert_eq!(b, [0, 0x23, 0x45, 0x67, 0x21, 0x45, 0x67, 0x89]);
        assert_eq!(r.ci(), 0x23_4567);
        assert_eq!(r.arm(), arm);
        // Both halves in one store: the same bytes as the two merges.
        let w2 = [AtomicU64::new(u64::MAX)];
        let r2 = CqDoorbellRecord::new(&w2[..]).unwrap();
        r2.set_ci_and_arm(0x0123_4567, arm);
        let mut b2 = [0u8; 8];
        crate::dma::read_bytes(&w2, 8, 0, &mut b2).unwrap();
        assert_eq!(b2, b);
        assert_eq!((r2.ci(), r2.arm()), (0x23_4567, arm));
        assert_eq!(arm.doorbell_value(0x42), 0x2145_6789_0000_0042);
        assert_eq!(
            CqArm::from_doorbell_value(0x2145_6789_0000_0042),
            (arm, 0x42)
        );
    }
}
