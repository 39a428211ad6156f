//! Named memory barriers, in the vocabulary of rdma-core's `udma_barrier.h`.
//!
//! A verbs provider talks to its device through three kinds of memory: DMA
//! memory the device reads and writes (work queues, completion queues,
//! doorbell records, data buffers), uncached MMIO registers (the doorbell
//! register in a UAR page) and write-combining MMIO (the BlueFlame buffer).
//! Each call site uses the *narrowest* barrier that states what it orders, so
//! the name documents the intent and the architecture mapping lives here.
//!
//! In the Rust memory model, DMA memory in this crate is atomic 64-bit words
//! (see [`crate::dma`]); the barriers are fences. On x86-64 a release or an
//! acquire fence compiles to nothing but stops the compiler from moving
//! accesses across it (which is exactly what x86 needs for write-back memory);
//! a sequentially consistent fence is `mfence`, which also drains the
//! write-combining buffers. On weaker architectures the same fences become the
//! `dmb`/`fence` instructions the C header selects by hand.
//!
//! # The doorbell order (send queue)
//!
//! 1. Write the WQE(s) into the ring ([`crate::ring::SendRing::write_wqe`]),
//!    with relaxed 64-bit stores.
//! 2. [`to_device`]: every WQE byte is visible before anything that tells the
//!    device to look.
//! 3. Write the doorbell record (`sq head`) ([`crate::doorbell::QpDoorbellRecord::set_sq_head`]).
//! 4. [`mmio_wc_start`]: the record is visible before the register write.
//! 5. Write the doorbell register ([`crate::doorbell::DoorbellRegister::write64`]).
//! 6. [`mmio_flush_writes`], still inside the send-queue lock, so a second CPU
//!    posting next cannot have its doorbell overtake this one.
//!
//! # The completion order (completion queue)
//!
//! 1. Load the CQE word holding `op_own` and check ownership.
//! 2. [`from_device`]: no other byte of the CQE is read before the ownership
//!    check (otherwise a stale payload could pair with a fresh owner bit).
//! 3. Read the rest of the CQE.
//! 4. After a batch, write the consumer index to the CQ doorbell record once.

use crate::sync::atomic::{Ordering, fence};

/// Orders all earlier writes to DMA memory before all later writes to DMA
/// memory *and* to MMIO, as seen by the device.
///
/// Use it between filling descriptors and publishing them: after the WQE
/// stores and before the doorbell-record store; after a CQE's payload and
/// before its ownership word on the device side. Without it the device could
/// see the new producer index and fetch a half-written WQE.
///
/// # IRQL
/// Any.
#[inline(always)]
pub fn to_device() {
    fence(Ordering::Release);
}

/// Orders all earlier reads of DMA memory before all later reads of DMA memory.
///
/// Use it after checking an ownership/valid indicator written by the device
/// (the CQE owner bit and opcode) and before reading the rest of that entry.
/// Without it the CPU may have loaded the payload speculatively before the
/// device finished writing it.
///
/// # IRQL
/// Any.
#[inline(always)]
pub fn from_device() {
    fence(Ordering::Acquire);
}

/// Orders earlier writes to DMA memory before later writes to DMA memory only
/// (not MMIO).
///
/// Use it when the device polls a descriptor for a valid indicator that is
/// written last inside the same DMA region (no doorbell involved) — for example
/// when a second doorbell record word must not become visible before the
/// first. It is weaker than [`to_device`] on architectures that distinguish
/// the two; here both are release fences.
///
/// # IRQL
/// Any.
#[inline(always)]
pub fn ordering_write() {
    fence(Ordering::Release);
}

/// Orders earlier writes to DMA memory and uncached MMIO before a following
/// write-combining MMIO write (the BlueFlame copy or the doorbell register).
///
/// Use it immediately before the doorbell register write: the doorbell record
/// written by the CPU must be visible before the device acts on the register
/// write, or the device reads a stale producer index and the post is lost
/// until the next doorbell.
///
/// # IRQL
/// Any.
#[inline(always)]
pub fn mmio_wc_start() {
    fence(Ordering::Release);
}

/// Forces write-combining MMIO writes out of the CPU's buffers, in order,
/// before anything that follows (on x86-64: `mfence`, a superset of `sfence`).
///
/// Use it after the doorbell register write and *before* releasing the lock
/// that serialises posting on that queue: two CPUs' doorbells that reach the
/// device out of order would let a later producer index be overtaken by an
/// earlier one.
///
/// # IRQL
/// Any.
#[inline(always)]
pub fn mmio_flush_writes() {
    fence(Ordering::SeqCst);
}
