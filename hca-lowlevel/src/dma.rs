//! Device-visible (DMA) memory.
//!
//! Memory that a driver and a device both touch is modelled as an array of
//! atomic 64-bit words ([`AtomicU64`]), never as a `&mut [u8]`: the device
//! (hardware, or the software HCA on another thread) may read or write it at
//! any time, and an aliased `&mut` would be undefined behaviour. Byte `i` of a
//! buffer is byte `i % 8` of word `i / 8` in native memory order, which is how
//! a real CPU and a real device see the same physical memory.
//!
//! * [`DmaBuffer`] is the driver's owning handle: physical address, length,
//!   atomic reads and writes at offsets. Dropping it frees the memory: the
//!   device can no longer reach it (it gets a clean error, never stale data).
//! * [`DmaBacking`] is what an allocator implements behind a buffer (the host
//!   simulator's physical memory; on Windows, a common-buffer allocation).
//! * [`DmaAllocator`] is the object-safe allocator a device hands to kverbs.
//!
//! Partial-word writes are compare-and-swap loops, so two writers of adjacent
//! bytes in one word (the two halves of a doorbell record, two RDMA WRITEs to
//! neighbouring bytes) never lose each other's bytes.

use alloc::sync::Arc;
use core::fmt;

use crate::sync::atomic::{AtomicU64, Ordering};

/// A physical (bus) address as the device sees it.
#[derive(Copy, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct PhysAddr(pub u64);

impl PhysAddr {
    /// The raw address.
    #[must_use]
    pub const fn get(self) -> u64 {
        self.0
    }

    /// `self + off`, or `None` on overflow.
    #[must_use]
    pub const fn checked_add(self, off: u64) -> Option<Self> {
        match self.0.checked_add(off) {
            Some(a) => Some(Self(a)),
            None => None,
        }
    }
}

impl fmt::Debug for PhysAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PhysAddr({:#x})", self.0)
    }
}

/// Why a DMA memory operation failed.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum DmaError {
    /// The allocator has no memory left (or the request exceeds its limit).
    OutOfMemory,
    /// A zero-length allocation was requested.
    ZeroLength,
    /// The access reaches outside the buffer.
    OutOfBounds,
    /// A word access at an offset that is not a multiple of its size.
    Misaligned,
    /// The physical address is not backed by live memory (never allocated, or
    /// freed). Only a device model reports this.
    Unmapped,
}

impl fmt::Display for DmaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            Self::OutOfMemory => "out of DMA memory",
            Self::ZeroLength => "zero-length DMA allocation",
            Self::OutOfBounds => "DMA access out of bounds",
            Self::Misaligned => "misaligned DMA word access",
            Self::Unmapped => "physical address not mapped",
        };
        f.write_str(s)
    }
}

/// Anything that exposes shared memory as atomic words (a [`DmaBuffer`] on the
/// driver side, the device model's view of the same memory on the other).
/// Rings and doorbell records are generic over it, so the driver and the
/// device run the same accessor code.
pub trait SharedWords {
    /// The memory, as atomic 64-bit words.
    fn words(&self) -> &[AtomicU64];
}

impl SharedWords for [AtomicU64] {
    fn words(&self) -> &[AtomicU64] {
        self
    }
}

impl<T: SharedWords + ?Sized> SharedWords for &T {
    fn words(&self) -> &[AtomicU64] {
        (**self).words()
    }
}

impl<T: SharedWords + ?Sized> SharedWords for Arc<T> {
    fn words(&self) -> &[AtomicU64] {
        (**self).words()
    }
}

/// The memory behind a [`DmaBuffer`], implemented by an allocator.
///
/// `words()` must return the same memory for the whole life of the object, at
/// least `len()` bytes long; `release()` is called exactly once, when the
/// owning [`DmaBuffer`] is dropped, and must make the memory unreachable to the
/// device (its storage may live on until the last `Arc` is dropped, so an
/// access already in flight completes on valid memory).
pub trait DmaBacking: Send + Sync {
    /// The memory, as atomic 64-bit words.
    fn words(&self) -> &[AtomicU64];
    /// Physical address of byte 0.
    fn phys_addr(&self) -> PhysAddr;
    /// Length in bytes (the words may extend up to 7 bytes past it).
    fn len(&self) -> usize;
    /// True if `len()` is zero.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Unmap the memory from the device's view. Called once, from `Drop`.
    fn release(&self);
}

/// An owning handle to device-visible memory.
///
/// Not `Clone`: exactly one owner frees it. Dropping it unmaps the memory from
/// the device (see [`DmaBacking::release`]).
pub struct DmaBuffer {
    backing: Arc<dyn DmaBacking>,
}

impl fmt::Debug for DmaBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DmaBuffer")
            .field("phys", &self.phys_addr())
            .field("len", &self.len())
            .finish()
    }
}

impl Drop for DmaBuffer {
    fn drop(&mut self) {
        self.backing.release();
    }
}

impl SharedWords for DmaBuffer {
    fn words(&self) -> &[AtomicU64] {
        self.backing.words()
    }
}

impl DmaBuffer {
    /// Wraps an allocator's backing object. Only allocators call this.
    #[must_use]
    pub fn from_backing(backing: Arc<dyn DmaBacking>) -> Self {
        Self { backing }
    }

    /// Physical address of byte 0 (what goes into a data segment).
    #[must_use]
    pub fn phys_addr(&self) -> PhysAddr {
        self.backing.phys_addr()
    }

    /// Length in bytes.
    #[must_use]
    pub fn len(&self) -> usize {
        self.backing.len()
    }

    /// True if the buffer has no bytes (allocators never hand these out).
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies `out.len()` bytes starting at `offset` out of the buffer.
    ///
    /// # Errors
    /// [`DmaError::OutOfBounds`] if the range leaves the buffer.
    ///
    /// # IRQL
    /// Any (never blocks).
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), DmaError> {
        read_bytes(self.words(), self.len(), offset, out)
    }

    /// Copies `data` into the buffer at `offset` (relaxed stores; publish with
    /// a barrier from [`crate::barrier`] before telling the device).
    ///
    /// # Errors
    /// [`DmaError::OutOfBounds`] if the range leaves the buffer.
    ///
    /// # IRQL
    /// Any (never blocks).
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), DmaError> {
        write_bytes(self.words(), self.len(), offset, data)
    }

    /// Loads the 64-bit word at byte `offset` (a multiple of 8).
    ///
    /// # Errors
    /// [`DmaError::Misaligned`] or [`DmaError::OutOfBounds`].
    ///
    /// # IRQL
    /// Any (never blocks).
    pub fn load_u64(&self, offset: usize, order: Ordering) -> Result<u64, DmaError> {
        load_word(self.words(), offset, order)
    }

    /// Stores the 64-bit word at byte `offset` (a multiple of 8).
    ///
    /// # Errors
    /// [`DmaError::Misaligned`] or [`DmaError::OutOfBounds`].
    ///
    /// # IRQL
    /// Any (never blocks).
    pub fn store_u64(&self, offset: usize, value: u64, order: Ordering) -> Result<(), DmaError> {
        store_word(self.words(), offset, value, order)
    }
}

/// Allocates device-visible memory. Object safe; a device hands one out
/// ([`crate::device::HcaDevice::dma_allocator`]) so kverbs can allocate its
/// own buffers (IUs, page lists) in memory the device can reach.
///
/// Every allocation starts on a 4 KiB boundary and is zero-filled.
pub trait DmaAllocator: Send + Sync {
    /// Allocates `len` bytes of zeroed, device-visible memory.
    ///
    /// # Errors
    /// [`DmaError::ZeroLength`] for `len == 0`, [`DmaError::OutOfMemory`] when
    /// the allocator cannot satisfy the request.
    ///
    /// # IRQL
    /// PASSIVE_LEVEL only (may block; on Windows this is a common-buffer
    /// allocation).
    fn alloc(&self, len: usize) -> Result<DmaBuffer, DmaError>;
}

/// Loads the word at byte `offset` of `words`.
///
/// # Errors
/// [`DmaError::Misaligned`] unless `offset % 8 == 0`; [`DmaError::OutOfBounds`].
pub fn load_word(words: &[AtomicU64], offset: usize, order: Ordering) -> Result<u64, DmaError> {
    if offset % 8 != 0 {
        return Err(DmaError::Misaligned);
    }
    words
        .get(offset / 8)
        .map(|w| w.load(order))
        .ok_or(DmaError::OutOfBounds)
}

/// Stores the word at byte `offset` of `words`.
///
/// # Errors
/// [`DmaError::Misaligned`] unless `offset % 8 == 0`; [`DmaError::OutOfBounds`].
pub fn store_word(
    words: &[AtomicU64],
    offset: usize,
    value: u64,
    order: Ordering,
) -> Result<(), DmaError> {
    if offset % 8 != 0 {
        return Err(DmaError::Misaligned);
    }
    words
        .get(offset / 8)
        .map(|w| w.store(value, order))
        .ok_or(DmaError::OutOfBounds)
}

/// Loads the big-endian 32-bit field at byte `offset` (a multiple of 4).
///
/// # Errors
/// [`DmaError::Misaligned`] or [`DmaError::OutOfBounds`].
pub fn load_be32(words: &[AtomicU64], offset: usize, order: Ordering) -> Result<u32, DmaError> {
    if offset % 4 != 0 {
        return Err(DmaError::Misaligned);
    }
    let w = words
        .get(offset / 8)
        .ok_or(DmaError::OutOfBounds)?
        .load(order)
        .to_ne_bytes();
    let at = offset % 8;
    let mut b = [0u8; 4];
    b.copy_from_slice(w.get(at..at + 4).ok_or(DmaError::OutOfBounds)?);
    Ok(u32::from_be_bytes(b))
}

/// Stores the big-endian 32-bit field at byte `offset` (a multiple of 4),
/// leaving the other half of its word untouched even if another thread writes
/// that half concurrently.
///
/// # Errors
/// [`DmaError::Misaligned`] or [`DmaError::OutOfBounds`].
pub fn store_be32(
    words: &[AtomicU64],
    offset: usize,
    value: u32,
    order: Ordering,
) -> Result<(), DmaError> {
    if offset % 4 != 0 {
        return Err(DmaError::Misaligned);
    }
    let cell = words.get(offset / 8).ok_or(DmaError::OutOfBounds)?;
    merge_into_word(cell, offset % 8, &value.to_be_bytes(), order);
    Ok(())
}

/// Replaces bytes `at..at + src.len()` of one word with `src` atomically
/// (a compare-and-swap loop; the other bytes are preserved).
fn merge_into_word(cell: &AtomicU64, at: usize, src: &[u8], order: Ordering) {
    let failure = match order {
        Ordering::Release | Ordering::Relaxed => Ordering::Relaxed,
        _ => Ordering::Acquire,
    };
    let mut cur = cell.load(Ordering::Relaxed);
    loop {
        let mut b = cur.to_ne_bytes();
        if let Some(dst) = b.get_mut(at..at + src.len()) {
            dst.copy_from_slice(src);
        }
        match cell.compare_exchange_weak(cur, u64::from_ne_bytes(b), order, failure) {
            Ok(_) => return,
            Err(seen) => cur = seen,
        }
    }
}

fn check_range(
    words: &[AtomicU64],
    limit: usize,
    offset: usize,
    len: usize,
) -> Result<(), DmaError> {
    let end = offset.checked_add(len).ok_or(DmaError::OutOfBounds)?;
    if end > limit || end > words.len().saturating_mul(8) {
        return Err(DmaError::OutOfBounds);
    }
    Ok(())
}

/// Words copied per step of the bulk loops: a fixed-size inner loop the
/// compiler unrolls whole, so the loop's counting and branching is paid once
/// per 64 bytes. Measured under callgrind on a 128 KiB transfer (16 Ki
/// words): ~2.8 instructions per word with a plain per-word loop, ~2.6 in
/// steps, against a floor of 2 (each word is one relaxed 64-bit atomic load
/// or store, which cannot be merged or vectorised).
const WORDS_PER_STEP: usize = 8;

/// `out` (a whole number of words long) from `src`, one relaxed load per word.
fn copy_words_out(src: &[AtomicU64], out: &mut [u8]) {
    let mut src_steps = src.chunks_exact(WORDS_PER_STEP);
    let mut out_steps = out.chunks_exact_mut(WORDS_PER_STEP * 8);
    for (words, bytes) in (&mut src_steps).zip(&mut out_steps) {
        for (w, dst) in words.iter().zip(bytes.chunks_exact_mut(8)) {
            dst.copy_from_slice(&w.load(Ordering::Relaxed).to_ne_bytes());
        }
    }
    let rest = src_steps.remainder();
    for (w, dst) in rest
        .iter()
        .zip(out_steps.into_remainder().chunks_exact_mut(8))
    {
        dst.copy_from_slice(&w.load(Ordering::Relaxed).to_ne_bytes());
    }
}

/// `dst` from `data` (a whole number of words long), one relaxed store per word.
fn copy_words_in(data: &[u8], dst: &[AtomicU64]) {
    let mut dst_steps = dst.chunks_exact(WORDS_PER_STEP);
    let mut data_steps = data.chunks_exact(WORDS_PER_STEP * 8);
    for (cells, bytes) in (&mut dst_steps).zip(&mut data_steps) {
        for (cell, src) in cells.iter().zip(bytes.chunks_exact(8)) {
            cell.store(word_of(src), Ordering::Relaxed);
        }
    }
    let rest = dst_steps.remainder();
    for (cell, src) in rest.iter().zip(data_steps.remainder().chunks_exact(8)) {
        cell.store(word_of(src), Ordering::Relaxed);
    }
}

/// The native-endian word of 8 bytes (fewer are zero-extended; never
/// called with fewer).
fn word_of(src: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    if let Some(head) = w.get_mut(..src.len()) {
        head.copy_from_slice(src);
    }
    u64::from_ne_bytes(w)
}

/// Copies bytes `offset..offset + out.len()` of `words` (bounded by `limit`
/// bytes) into `out`, with relaxed word loads.
///
/// # Errors
/// [`DmaError::OutOfBounds`] if the range leaves `limit` or the words.
pub fn read_bytes(
    words: &[AtomicU64],
    limit: usize,
    offset: usize,
    out: &mut [u8],
) -> Result<(), DmaError> {
    check_range(words, limit, offset, out.len())?;
    // Head (up to the first word boundary), whole words, tail: the whole
    // words go one load and one 8-byte copy each, with the bounds checked
    // once for the run rather than per byte range.
    let (head, rest) = out
        .split_at_mut_checked(((8 - offset % 8) % 8).min(out.len()))
        .ok_or(DmaError::OutOfBounds)?;
    let mut pos = offset;
    if !head.is_empty() {
        read_partial(words, pos, head)?;
        pos += head.len();
    }
    let whole = rest.len() / 8;
    let (body, tail) = rest
        .split_at_mut_checked(whole * 8)
        .ok_or(DmaError::OutOfBounds)?;
    let first = pos / 8;
    let src = words
        .get(first..first + whole)
        .ok_or(DmaError::OutOfBounds)?;
    copy_words_out(src, body);
    pos += whole * 8;
    if !tail.is_empty() {
        read_partial(words, pos, tail)?;
    }
    Ok(())
}

/// Bytes `pos..pos + out.len()`, all inside one word.
fn read_partial(words: &[AtomicU64], pos: usize, out: &mut [u8]) -> Result<(), DmaError> {
    let at = pos % 8;
    let w = words
        .get(pos / 8)
        .ok_or(DmaError::OutOfBounds)?
        .load(Ordering::Relaxed)
        .to_ne_bytes();
    out.copy_from_slice(w.get(at..at + out.len()).ok_or(DmaError::OutOfBounds)?);
    Ok(())
}

/// Copies `data` into bytes `offset..` of `words` (bounded by `limit` bytes):
/// whole words with relaxed 64-bit stores, partial words with a
/// compare-and-swap merge.
///
/// # Errors
/// [`DmaError::OutOfBounds`] if the range leaves `limit` or the words.
pub fn write_bytes(
    words: &[AtomicU64],
    limit: usize,
    offset: usize,
    data: &[u8],
) -> Result<(), DmaError> {
    check_range(words, limit, offset, data.len())?;
    // As `read_bytes`: head, whole words (one store each), tail.
    let (head, rest) = data
        .split_at_checked(((8 - offset % 8) % 8).min(data.len()))
        .ok_or(DmaError::OutOfBounds)?;
    let mut pos = offset;
    if !head.is_empty() {
        let cell = words.get(pos / 8).ok_or(DmaError::OutOfBounds)?;
        merge_into_word(cell, pos % 8, head, Ordering::Relaxed);
        pos += head.len();
    }
    let whole = rest.len() / 8;
    let (body, tail) = rest
        .split_at_checked(whole * 8)
        .ok_or(DmaError::OutOfBounds)?;
    let first = pos / 8;
    let dst = words
        .get(first..first + whole)
        .ok_or(DmaError::OutOfBounds)?;
    copy_words_in(body, dst);
    pos += whole * 8;
    if !tail.is_empty() {
        let cell = words.get(pos / 8).ok_or(DmaError::OutOfBounds)?;
        merge_into_word(cell, pos % 8, tail, Ordering::Relaxed);
    }
    Ok(())
}

/// `dst` from `src`, both a whole number of words, one relaxed load and one
/// relaxed store per word (no staging buffer in between).
fn copy_words(src: &[AtomicU64], dst: &[AtomicU64]) {
    let mut src_steps = src.chunks_exact(WORDS_PER_STEP);
    let mut dst_steps = dst.chunks_exact(WORDS_PER_STEP);
    for (s, d) in (&mut src_steps).zip(&mut dst_steps) {
        for (s, d) in s.iter().zip(d) {
            d.store(s.load(Ordering::Relaxed), Ordering::Relaxed);
        }
    }
    for (s, d) in src_steps.remainder().iter().zip(dst_steps.remainder()) {
        d.store(s.load(Ordering::Relaxed), Ordering::Relaxed);
    }
}

/// Bytes a misaligned [`copy_bytes`] stages at a time (on the stack).
const COPY_STAGE: usize = 256;

/// Copies `len` bytes from `src_off..` of `src` (bounded by `src_limit`) to
/// `dst_off..` of `dst` (bounded by `dst_limit`): a device copying memory to
/// memory with no buffer of its own in between (the software HCA placing a
/// payload straight from the sender's memory). When both offsets sit at the
/// same place in a word (page-aligned buffers: the usual case), the whole
/// words go one relaxed load and one relaxed store each, and the partial
/// head and tail words merge as in [`write_bytes`]; otherwise the bytes are
/// staged through a small stack buffer. Overlapping ranges of one memory are
/// copied front to back (what a DMA engine does), not as `memmove`.
///
/// # Errors
/// [`DmaError::OutOfBounds`] if either range leaves its limit or its words.
pub fn copy_bytes(
    src: &[AtomicU64],
    src_limit: usize,
    src_off: usize,
    dst: &[AtomicU64],
    dst_limit: usize,
    dst_off: usize,
    len: usize,
) -> Result<(), DmaError> {
    check_range(src, src_limit, src_off, len)?;
    check_range(dst, dst_limit, dst_off, len)?;
    if src_off % 8 != dst_off % 8 {
        let mut stage = [0u8; COPY_STAGE];
        let mut done = 0;
        while done < len {
            let n = (len - done).min(COPY_STAGE);
            let buf = stage.get_mut(..n).ok_or(DmaError::OutOfBounds)?;
            read_bytes(src, src_limit, src_off + done, buf)?;
            write_bytes(dst, dst_limit, dst_off + done, buf)?;
            done += n;
        }
        return Ok(());
    }
    let head = ((8 - dst_off % 8) % 8).min(len);
    if head > 0 {
        let mut b = [0u8; 8];
        let part = b.get_mut(..head).ok_or(DmaError::OutOfBounds)?;
        read_partial(src, src_off, part)?;
        let cell = dst.get(dst_off / 8).ok_or(DmaError::OutOfBounds)?;
        merge_into_word(cell, dst_off % 8, part, Ordering::Relaxed);
    }
    let whole = (len - head) / 8;
    let (s, d) = ((src_off + head) / 8, (dst_off + head) / 8);
    let src_words = src.get(s..s + whole).ok_or(DmaError::OutOfBounds)?;
    let dst_words = dst.get(d..d + whole).ok_or(DmaError::OutOfBounds)?;
    copy_words(src_words, dst_words);
    let done = head + whole * 8;
    if done < len {
        let mut b = [0u8; 8];
        let part = b.get_mut(..len - done).ok_or(DmaError::OutOfBounds)?;
        read_partial(src, src_off + done, part)?;
        let cell = dst.get((dst_off + done) / 8).ok_or(DmaError::OutOfBounds)?;
        merge_into_word(cell, (dst_off + done) % 8, part, Ordering::Relaxed);
    }
    Ok(())
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use alloc::vec::Vec;

    fn words(n: usize) -> Vec<AtomicU64> {
        (0..n).map(|_| AtomicU64::new(0)).collect()
    }

    #[test]
    fn byte_round_trip_across_word_boundaries() {
        let w = words(4);
        let data: Vec<u8> = (1..=21).collect();
        write_bytes(&w, 32, 5, &data).unwrap();
        let mut out = [0u8; 21];
        read_bytes(&w, 32, 5, &mut out).unwrap();
        assert_eq!(&out[..], &data[..]);
        // Bytes around the write are untouched.
        let mut all = [0xAAu8; 32];
        read_bytes(&w, 32, 0, &mut all).unwrap();
        assert_eq!(&all[..5], &[0; 5]);
        assert_eq!(&all[26..], &[0; 6]);
    }

    #[test]
    fn copy_bytes_matches_a_byte_model() {
        // Every alignment of source and destination, lengths across word
        // boundaries; then long runs across the misaligned path's stage.
        // The destination is the model's, bytes outside the copied range
        // untouched. (Small buffers: Miri runs this.)
        let check = |src_off: usize, dst_off: usize, len: usize, size: usize| {
            let src_model: Vec<u8> = (0..size).map(|i| (i * 13 + 5) as u8).collect();
            let src = words(size / 8);
            write_bytes(&src, size, 0, &src_model).unwrap();
            let dst = words(size / 8);
            let mut model = vec![0xEEu8; size];
            write_bytes(&dst, size, 0, &model).unwrap();
            copy_bytes(&src, size, src_off, &dst, size, dst_off, len).unwrap();
            model[dst_off..dst_off + len].copy_from_slice(&src_model[src_off..src_off + len]);
            let mut got = vec![0u8; size];
            read_bytes(&dst, size, 0, &mut got).unwrap();
            assert_eq!(got, model, "{src_off} {dst_off} {len}");
        };
        for src_off in 0..9 {
            for dst_off in 0..9 {
                for len in [0, 1, 3, 7, 8, 9, 17, 70] {
                    check(src_off, dst_off, len, 96);
                }
            }
        }
        for (src_off, dst_off) in [(0, 0), (3, 3), (3, 5), (5, 3)] {
            check(src_off, dst_off, 600, 616);
        }
        // Out of bounds on either side, by the limit or by the words.
        let src = words(8);
        let dst = words(4);
        assert_eq!(
            copy_bytes(&src, 64, 59, &dst, 32, 0, 6),
            Err(DmaError::OutOfBounds)
        );
        assert_eq!(
            copy_bytes(&src, 64, 0, &dst, 30, 25, 6),
            Err(DmaError::OutOfBounds)
        );
        assert_eq!(
            copy_bytes(&src, 64, 0, &dst, 64, 30, 6),
            Err(DmaError::OutOfBounds)
        );
    }

    #[test]
    fn every_offset_and_length_matches_a_byte_model() {
        // Head, whole words and tail in every combination, against a plain
        // byte array doing the same copies.
        for offset in 0..17 {
            for len in 0..41 {
                let w = words(8);
                let mut model = [0u8; 64];
                let fill: Vec<u8> = (0..64).map(|i| 0x80 | i as u8).collect();
                write_bytes(&w, 64, 0, &fill).unwrap();
                model.copy_from_slice(&fill);
                let data: Vec<u8> = (0..len).map(|i| (i * 7 + offset) as u8).collect();
                write_bytes(&w, 64, offset, &data).unwrap();
                model[offset..offset + len].copy_from_slice(&data);
                let mut all = [0u8; 64];
                read_bytes(&w, 64, 0, &mut all).unwrap();
                assert_eq!(all, model, "write at {offset}, {len} bytes");
                let mut part = vec![0u8; len];
                read_bytes(&w, 64, offset, &mut part).unwrap();
                assert_eq!(part, data, "read at {offset}, {len} bytes");
            }
        }
    }

    #[test]
    fn long_copies_in_whole_steps_and_remainders_match_a_byte_model() {
        // Bodies of several 64-byte steps plus every remainder of words,
        // at a few head offsets.
        const LEN: usize = 512;
        for offset in [0usize, 1, 7, 8, 13] {
            for len in [64usize, 65, 120, 128, 200, 255, 256, 440, LEN - 16] {
                let w = words(LEN / 8);
                let mut model = [0u8; LEN];
                let data: Vec<u8> = (0..len).map(|i| (i * 13 + offset + 1) as u8).collect();
                write_bytes(&w, LEN, offset, &data).unwrap();
                model[offset..offset + len].copy_from_slice(&data);
                let mut all = [0u8; LEN];
                read_bytes(&w, LEN, 0, &mut all).unwrap();
                assert_eq!(all, model, "write at {offset}, {len} bytes");
                let mut part = vec![0u8; len];
                read_bytes(&w, LEN, offset, &mut part).unwrap();
                assert_eq!(part, data, "read at {offset}, {len} bytes");
            }
        }
    }

    #[test]
    fn bounds_are_enforced() {
        let w = words(2);
        assert_eq!(write_bytes(&w, 12, 8, &[0; 5]), Err(DmaError::OutOfBounds));
        assert_eq!(write_bytes(&w, 12, 8, &[0; 4]), Ok(()));
        assert_eq!(
            read_bytes(&w, 16, usize::MAX, &mut [0; 2]),
            Err(DmaError::OutOfBounds)
        );
        assert_eq!(
            load_word(&w, 4, Ordering::Relaxed),
            Err(DmaError::Misaligned)
        );
        assert_eq!(
            load_word(&w, 16, Ordering::Relaxed),
            Err(DmaError::OutOfBounds)
        );
        assert_eq!(
            store_be32(&w, 2, 0, Ordering::Relaxed),
            Err(DmaError::Misaligned)
        );
    }

    #[test]
    fn be32_halves_are_independent() {
        let w = words(1);
        store_be32(&w, 0, 0x1122_3344, Ordering::Relaxed).unwrap();
        store_be32(&w, 4, 0x5566_7788, Ordering::Relaxed).unwrap();
        assert_eq!(load_be32(&w, 0, Ordering::Relaxed).unwrap(), 0x1122_3344);
        assert_eq!(load_be32(&w, 4, Ordering::Relaxed).unwrap(), 0x5566_7788);
        let mut b = [0u8; 8];
        read_bytes(&w, 8, 0, &mut b).unwrap();
        assert_eq!(b, [0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88]);
    }
}
