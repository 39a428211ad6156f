//! Power-of-two rings over shared (DMA) memory: the send queue, the receive
//! queue and the completion queue, as both the driver and the device use them.
//!
//! Counters are free-running (`u32`, wrapping); a slot is `counter & (n - 1)`.
//! A send WQE that starts near the end of the ring continues at slot 0, as on
//! mlx5 (`if (seg == qend) seg = start`).
//!
//! Copy-in is done with 64-bit atomic stores, 8 bytes at a time, never with a
//! `memcpy` (the BlueFlame rule: string-move instructions give no ordering,
//! and here the memory is shared with a device). Publication follows
//! [`crate::barrier`]: WQEs, `to_device`, doorbell record, doorbell register;
//! the device writes a CQE's first seven words and then the word holding
//! `op_own` with Release; the driver checks ownership and only then, after
//! `from_device`, reads the rest.

#![forbid(unsafe_code)]

use core::fmt;

use crate::barrier;
use crate::cqe::{CQE_SIZE, Cqe, CqeOpcode, OWNER_WORD, owned_by_software, owner_bit};
use crate::dma::PhysAddr;
use crate::dma::{DmaError, SharedWords};
use crate::recv::{MAX_RECV_SGE, RecvWqe, emit_recv_wqe};
use crate::sync::atomic::AtomicU64;
use crate::sync::atomic::Ordering;
use crate::view::FormatError;
use crate::wqe::{
    CtrlFlags, CtrlSegRepr, DS_SIZE, DataSegRepr, DatagramSegRepr, MAX_DS, MAX_SEND_WQE_BYTES,
    RegMrSegRepr, SegmentEncoder, SegmentSink, SendOpcode, WQEBB_SIZE,
};

/// Why a ring operation failed.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum RingError {
    /// Entry count not a power of two, or the memory is too small for it.
    BadGeometry,
    /// The entry is larger than the ring (or the receive stride).
    TooLarge,
    /// A send WQE whose length is not a multiple of 8 bytes.
    Misaligned,
    /// The entry's contents are malformed.
    Format(FormatError),
    /// The memory refused the access.
    Dma(DmaError),
}

impl From<FormatError> for RingError {
    fn from(e: FormatError) -> Self {
        Self::Format(e)
    }
}

impl From<DmaError> for RingError {
    fn from(e: DmaError) -> Self {
        Self::Dma(e)
    }
}

impl fmt::Display for RingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::BadGeometry => {
                f.write_str("ring size is not a power of two or exceeds its memory")
            }
            Self::TooLarge => f.write_str("entry larger than the ring slot"),
            Self::Misaligned => f.write_str("entry length not a multiple of 8"),
            Self::Format(e) => write!(f, "malformed entry: {e}"),
            Self::Dma(e) => write!(f, "ring memory: {e}"),
        }
    }
}

fn check_geometry(words: usize, entries: u32, entry_bytes: usize) -> Result<(), RingError> {
    if entries == 0 || !entries.is_power_of_two() {
        return Err(RingError::BadGeometry);
    }
    let need = (entries as usize)
        .checked_mul(entry_bytes)
        .ok_or(RingError::BadGeometry)?;
    if words.saturating_mul(8) < need {
        return Err(RingError::BadGeometry);
    }
    Ok(())
}

/// The send queue: `wqebb_count` 64-byte basic blocks.
#[derive(Debug)]
pub struct SendRing<M: SharedWords> {
    mem: M,
    wqebb_count: u32,
}

impl<M: SharedWords> SendRing<M> {
    /// Wraps memory holding `wqebb_count` (a power of two) WQEBBs.
    ///
    /// # Errors
    /// [`RingError::BadGeometry`].
    pub fn new(mem: M, wqebb_count: u32) -> Result<Self, RingError> {
        check_geometry(mem.words().len(), wqebb_count, WQEBB_SIZE)?;
        Ok(Self { mem, wqebb_count })
    }

    /// Number of WQEBBs.
    pub fn wqebb_count(&self) -> u32 {
        self.wqebb_count
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

    fn ring_words(&self) -> usize {
        self.wqebb_count as usize * (WQEBB_SIZE / 8)
    }

    /// Starts a send WQE written in place at WQEBB counter `counter` (mlx5's
    /// way: segments go straight into the queue, no staging copy), using at
    /// most `room_wqebbs` WQEBBs — the free space the caller owns past its
    /// producer counter. The control segment is written last, with its
    /// `ds`, by [`SendWqeWriter::finish`]; nothing is visible to the device until
    /// the caller publishes it ([`barrier::to_device`], doorbell record,
    /// doorbell), so a WQE abandoned half-written is just free space again.
    ///
    /// # IRQL
    /// Any (never blocks).
    pub fn wqe_writer(
        &self,
        counter: u32,
        room_wqebbs: u32,
        header: WqeHeader,
    ) -> SendWqeWriter<'_> {
        let room = (room_wqebbs.min(self.wqebb_count) as usize).saturating_mul(WQEBB_SIZE);
        let ctrl = CtrlSegRepr {
            opcode: header.opcode,
            opmod: 0,
            wqe_index: counter as u16,
            qpn: header.qpn,
            ds: 1,
            flags: header.flags,
            imm: header.imm,
        };
        let ring_words = self.ring_words();
        let words = self.mem.words();
        let mut w = SendWqeWriter {
            // Exactly the ring (the memory may be longer), so a run of
            // words that `get` finds does not wrap.
            words: words.get(..ring_words).unwrap_or(&[]),
            ring_words,
            start: (counter & (self.wqebb_count - 1)) as usize * (WQEBB_SIZE / 8),
            len: 0,
            room,
            ctrl,
            short_of_room: false,
            fault: false,
        };
        // The control segment's place; it is written once, by `finish`,
        // with its final `ds`.
        let _ = w.reserve(CtrlSegRepr::LEN);
        w
    }

    /// Copies a built WQE into the ring at WQEBB counter `counter`, wrapping to
    /// slot 0 past the end, with relaxed 64-bit stores. Publish it with
    /// [`barrier::to_device`] and the doorbell record.
    ///
    /// # Errors
    /// [`RingError::Misaligned`] unless `wqe.len() % 8 == 0`;
    /// [`RingError::TooLarge`] if it is larger than the ring.
    ///
    /// # IRQL
    /// Any (never blocks).
    pub fn write_wqe(&self, counter: u32, wqe: &[u8]) -> Result<(), RingError> {
        if wqe.len() % 8 != 0 {
            return Err(RingError::Misaligned);
        }
        let ring_words = self.ring_words();
        if wqe.len() / 8 > ring_words {
            return Err(RingError::TooLarge);
        }
        let words = self.mem.words();
        let start = (counter & (self.wqebb_count - 1)) as usize * (WQEBB_SIZE / 8);
        for (i, chunk) in wqe.chunks_exact(8).enumerate() {
            let mut w = [0u8; 8];
            w.copy_from_slice(chunk);
            let cell = words
                .get((start + i) % ring_words)
                .ok_or(RingError::Dma(DmaError::OutOfBounds))?;
            cell.store(u64::from_ne_bytes(w), Ordering::Relaxed);
        }
        Ok(())
    }

    /// Copies `out.len()` bytes of the ring starting at WQEBB counter
    /// `counter` (with wrap-around) into `out` — the device's fetch.
    ///
    /// # Errors
    /// [`RingError::Misaligned`] unless `out.len() % 8 == 0`;
    /// [`RingError::TooLarge`] if longer than the ring.
    pub fn read_wqe(&self, counter: u32, out: &mut [u8]) -> Result<(), RingError> {
        if out.len() % 8 != 0 {
            return Err(RingError::Misaligned);
        }
        let ring_words = self.ring_words();
        if out.len() / 8 > ring_words {
            return Err(RingError::TooLarge);
        }
        let words = self.mem.words();
        let start = (counter & (self.wqebb_count - 1)) as usize * (WQEBB_SIZE / 8);
        for (i, chunk) in out.chunks_exact_mut(8).enumerate() {
            let cell = words
                .get((start + i) % ring_words)
                .ok_or(RingError::Dma(DmaError::OutOfBounds))?;
            chunk.copy_from_slice(&cell.load(Ordering::Relaxed).to_ne_bytes());
        }
        Ok(())
    }
}

/// The receive queue: `entries` slots of `stride` bytes (both powers of two).
#[derive(Debug)]
pub struct RecvRing<M: SharedWords> {
    mem: M,
    entries: u32,
    stride: usize,
}

/// Largest receive WQE stride.
pub const MAX_RECV_STRIDE: usize = MAX_RECV_SGE * DataSegRepr::LEN;

impl<M: SharedWords> RecvRing<M> {
    /// Wraps memory holding `entries` slots of `stride` bytes.
    ///
    /// # Errors
    /// [`RingError::BadGeometry`] unless both are powers of two, the stride is
    /// 16..=256 bytes and the memory is large enough.
    pub fn new(mem: M, entries: u32, stride: usize) -> Result<Self, RingError> {
        if !stride.is_power_of_two() || !(DataSegRepr::LEN..=MAX_RECV_STRIDE).contains(&stride) {
            return Err(RingError::BadGeometry);
        }
        check_geometry(mem.words().len(), entries, stride)?;
        Ok(Self {
            mem,
            entries,
            stride,
        })
    }

    /// Number of slots.
    pub fn entries(&self) -> u32 {
        self.entries
    }

    /// Bytes per slot.
    pub fn stride(&self) -> usize {
        self.stride
    }

    /// Scatter segments a slot can hold.
    pub fn max_sge(&self) -> usize {
        self.stride / DataSegRepr::LEN
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

    /// Writes a receive WQE (the segments plus terminator) at counter `counter`.
    ///
    /// # Errors
    /// [`RingError::TooLarge`] if the segments do not fit a slot.
    ///
    /// # IRQL
    /// Any (never blocks).
    pub fn write_wqe(&self, counter: u32, sges: &[DataSegRepr]) -> Result<(), RingError> {
        let mut slot = [0u8; MAX_RECV_STRIDE];
        let buf = slot.get_mut(..self.stride).ok_or(RingError::TooLarge)?;
        let n = emit_recv_wqe(sges, buf).map_err(|_| RingError::TooLarge)?;
        let at = (counter & (self.entries - 1)) as usize * self.stride;
        let data = buf
            .get(..n.next_multiple_of(8))
            .ok_or(RingError::TooLarge)?;
        let words = self.mem.words();
        for (i, chunk) in data.chunks_exact(8).enumerate() {
            let mut w = [0u8; 8];
            w.copy_from_slice(chunk);
            let cell = words
                .get(at / 8 + i)
                .ok_or(RingError::Dma(DmaError::OutOfBounds))?;
            cell.store(u64::from_ne_bytes(w), Ordering::Relaxed);
        }
        Ok(())
    }

    /// Reads and decodes the receive WQE at counter `counter` (device side).
    ///
    /// # Errors
    /// [`RingError::Format`] for a malformed WQE.
    pub fn read_wqe(&self, counter: u32) -> Result<RecvWqe, RingError> {
        let mut slot = [0u8; MAX_RECV_STRIDE];
        let buf = slot.get_mut(..self.stride).ok_or(RingError::TooLarge)?;
        let at = (counter & (self.entries - 1)) as usize * self.stride;
        let words = self.mem.words();
        for (i, chunk) in buf.chunks_exact_mut(8).enumerate() {
            let cell = words
                .get(at / 8 + i)
                .ok_or(RingError::Dma(DmaError::OutOfBounds))?;
            chunk.copy_from_slice(&cell.load(Ordering::Relaxed).to_ne_bytes());
        }
        Ok(RecvWqe::parse(buf)?)
    }
}

/// The completion queue: `entries` 64-byte CQEs.
#[derive(Debug)]
pub struct CqRing<M: SharedWords> {
    mem: M,
    entries: u32,
}

impl<M: SharedWords> CqRing<M> {
    /// Wraps memory holding `entries` CQEs (power of two).
    ///
    /// # Errors
    /// [`RingError::BadGeometry`].
    pub fn new(mem: M, entries: u32) -> Result<Self, RingError> {
        check_geometry(mem.words().len(), entries, CQE_SIZE)?;
        Ok(Self { mem, entries })
    }

    /// Number of CQEs.
    pub fn entries(&self) -> u32 {
        self.entries
    }

    /// The memory.
    pub fn mem(&self) -> &M {
        &self.mem
    }

    /// Gives the memory back (to wrap it differently, e.g. with its words
    /// looked up once: [`CqRing::new`] again over the wrapper).
    pub fn into_mem(self) -> M {
        self.mem
    }

    /// The same ring over the memory's words, looked up once: a poller
    /// reading several CQEs (and the owner bit before them) pays for
    /// [`SharedWords::words`] — a dynamic call for a [`crate::dma::DmaBuffer`]
    /// — once per batch instead of once per CQE.
    ///
    /// # IRQL
    /// Any (never blocks).
    #[inline]
    pub fn view(&self) -> CqRing<&[AtomicU64]> {
        CqRing {
            mem: self.mem.words(),
            entries: self.entries,
        }
    }

    /// Marks every CQE invalid (opcode [`CqeOpcode::Invalid`], owner 0), as
    /// software must before handing the ring to the device.
    pub fn init_invalid(&self) {
        let words = self.mem.words();
        for i in 0..self.entries as usize {
            for w in 0..CQE_SIZE / 8 {
                let v = if w == OWNER_WORD {
                    let mut b = [0u8; 8];
                    b[7] = (CqeOpcode::Invalid as u8) << 4;
                    u64::from_ne_bytes(b)
                } else {
                    0
                };
                if let Some(cell) = words.get(i * (CQE_SIZE / 8) + w) {
                    cell.store(v, Ordering::Relaxed);
                }
            }
        }
        barrier::to_device();
    }

    /// Whether the CQE at consumer counter `counter` belongs to software (the
    /// owner-bit parity and opcode check of [`CqRing::poll`], without
    /// reading the contents): one load, for an "is anything there" test
    /// before a poller takes its locks.
    ///
    /// # IRQL
    /// Any (never blocks).
    #[inline]
    pub fn is_ready(&self, counter: u32) -> bool {
        let base = (counter & (self.entries - 1)) as usize * (CQE_SIZE / 8);
        self.mem.words().get(base + OWNER_WORD).is_some_and(|w| {
            owned_by_software(
                w.load(Ordering::Relaxed).to_ne_bytes()[7],
                counter,
                self.entries,
            )
        })
    }

    /// Returns the CQE at consumer counter `counter` if it belongs to software
    /// (owner-bit parity and opcode), reading its contents only after the
    /// ownership check and [`barrier::from_device`].
    ///
    /// # IRQL
    /// Any (never blocks).
    pub fn poll(&self, counter: u32) -> Option<Cqe<[u8; CQE_SIZE]>> {
        let words = self.mem.words();
        let base = (counter & (self.entries - 1)) as usize * (CQE_SIZE / 8);
        let owner_word = words.get(base + OWNER_WORD)?.load(Ordering::Relaxed);
        let op_own = owner_word.to_ne_bytes()[7];
        if !owned_by_software(op_own, counter, self.entries) {
            return None;
        }
        barrier::from_device();
        let mut out = [0u8; CQE_SIZE];
        for (i, chunk) in out.chunks_exact_mut(8).enumerate() {
            let v = if i == OWNER_WORD {
                owner_word
            } else {
                words.get(base + i)?.load(Ordering::Relaxed)
            };
            chunk.copy_from_slice(&v.to_ne_bytes());
        }
        Some(Cqe::new_unchecked(out))
    }

    /// Device side: writes `cqe` at producer counter `counter`, setting the
    /// owner bit to the counter's wrap parity, payload words first and the
    /// `op_own` word last with Release.
    ///
    /// # Errors
    /// [`RingError::Dma`] if the memory is too small (cannot happen for a ring
    /// built by [`Self::new`]).
    pub fn write_cqe(&self, counter: u32, cqe: &[u8; CQE_SIZE]) -> Result<(), RingError> {
        let words = self.mem.words();
        let base = (counter & (self.entries - 1)) as usize * (CQE_SIZE / 8);
        let mut bytes = *cqe;
        let own = u8::from(owner_bit(counter, self.entries));
        bytes[CQE_SIZE - 1] = (bytes[CQE_SIZE - 1] & !1) | own;
        for (i, chunk) in bytes.chunks_exact(8).enumerate() {
            if i == OWNER_WORD {
                continue;
            }
            let mut w = [0u8; 8];
            w.copy_from_slice(chunk);
            words
                .get(base + i)
                .ok_or(RingError::Dma(DmaError::OutOfBounds))?
                .store(u64::from_ne_bytes(w), Ordering::Relaxed);
        }
        let mut w = [0u8; 8];
        w.copy_from_slice(&bytes[OWNER_WORD * 8..]);
        words
            .get(base + OWNER_WORD)
            .ok_or(RingError::Dma(DmaError::OutOfBounds))?
            .store(u64::from_ne_bytes(w), Ordering::Release);
        Ok(())
    }
}

/// What a send WQE's control segment says besides its place and size.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct WqeHeader {
    /// The operation.
    pub opcode: SendOpcode,
    /// The QP number.
    pub qpn: u32,
    /// Completion/fence/solicited flags.
    pub flags: CtrlFlags,
    /// Immediate data, or the key to invalidate.
    pub imm: u32,
}

/// A send WQE being written in place in a [`SendRing`] (see
/// [`SendRing::wqe_writer`]): the same segment encoder as
/// [`crate::wqe::SendWqeBuilder`] (so byte for byte the same WQE), but each
/// segment goes from its small stack buffer straight into the ring's words
/// — no zeroed maximum-size staging WQE, no second copy.
#[derive(Debug)]
pub struct SendWqeWriter<'r> {
    /// The ring's words, no more (checked by its geometry).
    words: &'r [AtomicU64],
    ring_words: usize,
    /// First word of the WQE.
    start: usize,
    /// Bytes written so far (a multiple of 16).
    len: usize,
    /// Bytes the caller owns past its producer counter.
    room: usize,
    ctrl: CtrlSegRepr,
    short_of_room: bool,
    /// A store fell outside the ring's memory.
    fault: bool,
}

impl SegmentSink for SendWqeWriter<'_> {
    /// Claims `n` more bytes; the offset they start at. Past the room the
    /// WQE is still measured (so a caller learns the same format errors as
    /// from the staging builder) but nothing more is stored, and
    /// [`SendWqeWriter::finish`] refuses it.
    #[inline]
    fn reserve(&mut self, n: usize) -> Result<usize, FormatError> {
        let start = self.len;
        let end = start.checked_add(n).ok_or(FormatError::WqeTooLarge)?;
        if end > MAX_SEND_WQE_BYTES {
            return Err(FormatError::WqeTooLarge);
        }
        if end > self.room {
            self.short_of_room = true;
        }
        self.len = end;
        Ok(start)
    }

    /// Stores `bytes` (a multiple of 8 long) at byte `at` of the WQE, one
    /// 64-bit store per word: one room and bound check for the whole
    /// segment when it lies inside the room and does not wrap (the usual
    /// case), else word by word.
    #[inline]
    fn put(&mut self, at: usize, bytes: &[u8]) {
        if let Some(cells) = self.run(at, bytes.len() / 8) {
            for (cell, chunk) in cells.iter().zip(bytes.chunks_exact(8)) {
                let mut w = [0u8; 8];
                w.copy_from_slice(chunk);
                cell.store(u64::from_ne_bytes(w), Ordering::Relaxed);
            }
            return;
        }
        for (i, chunk) in bytes.chunks_exact(8).enumerate() {
            let mut w = [0u8; 8];
            w.copy_from_slice(chunk);
            self.put_word(at + i * 8, u64::from_ne_bytes(w));
        }
    }
}

impl<'r> SendWqeWriter<'r> {
    /// The `n` ring words from byte `at` of the WQE, if they all lie inside
    /// the room and do not wrap past the ring's last slot.
    #[inline]
    fn run(&self, at: usize, n: usize) -> Option<&'r [AtomicU64]> {
        // `at` is below MAX_SEND_WQE_BYTES and `start` inside the ring
        // (see `reserve` and `SendRing::wqe_writer`): no overflow.
        if at + n * 8 > self.room {
            return None;
        }
        let first = self.start + at / 8;
        self.words.get(first..first + n)
    }

    /// Stores one word at byte `at` of the WQE (wrapping to slot 0), if it
    /// lies inside the room.
    #[inline]
    fn put_word(&mut self, at: usize, value: u64) {
        if at >= self.room {
            return;
        }
        // `ring_words` is a power of two (a power-of-two WQEBB count).
        let index = (self.start + at / 8) & self.ring_words.wrapping_sub(1);
        match self.words.get(index) {
            Some(cell) => cell.store(value, Ordering::Relaxed),
            None => self.fault = true,
        }
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

    /// WQEBBs the WQE occupies so far.
    #[must_use]
    pub fn wqebbs(&self) -> u32 {
        self.len.div_ceil(WQEBB_SIZE) as u32
    }

    /// True if the WQE has grown past the room the caller gave (a full
    /// queue, not a malformed request): only its head was stored, and
    /// [`SendWqeWriter::finish`] will refuse it.
    #[must_use]
    pub fn short_of_room(&self) -> bool {
        self.short_of_room
    }

    /// Finishes the WQE: writes its `ds` into the control segment in the
    /// ring and returns that control segment (for the doorbell value).
    ///
    /// # Errors
    /// [`RingError::TooLarge`] if it outgrew its room
    /// ([`SendWqeWriter::short_of_room`]); [`RingError::Format`] if more
    /// than [`MAX_DS`] units were written; [`RingError::Dma`] if a store
    /// fell outside the ring's memory.
    // Inline: it runs once per posted WQE (three per 4K read), and out of
    // line the writer (some 80 bytes) is copied into its by-value argument
    // and the caller's checks (`short_of_room`) are made again behind a
    // call; inlined, the copy goes and the repeated checks fold.
    #[inline]
    pub fn finish(mut self) -> Result<CtrlSegRepr, RingError> {
        if self.short_of_room {
            return Err(RingError::TooLarge);
        }
        if self.fault || self.len < CtrlSegRepr::LEN {
            return Err(RingError::Dma(DmaError::OutOfBounds));
        }
        let ds = u8::try_from(self.len / DS_SIZE).map_err(|_| FormatError::WqeTooLarge)?;
        if usize::from(ds) > MAX_DS {
            return Err(FormatError::WqeTooLarge.into());
        }
        self.ctrl.ds = ds;
        // The control segment as two word stores, straight from its fields
        // (`CtrlSegRepr::words`, the bytes `emit` would write).
        let [first, second] = self.ctrl.words();
        if let Some([cell0, cell1]) = self.run(0, 2) {
            cell0.store(first, Ordering::Relaxed);
            cell1.store(second, Ordering::Relaxed);
        } else {
            self.put_word(0, first);
            self.put_word(8, second);
        }
        if self.fault {
            return Err(RingError::Dma(DmaError::OutOfBounds));
        }
        Ok(self.ctrl)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::cqe::CqeRepr;
    use crate::sync::atomic::AtomicU64;
    use crate::wqe::SendWqe;
    use crate::wqe::SendWqeBuilder;
    use alloc::vec;
    use alloc::vec::Vec;

    fn mem(words: usize) -> Vec<AtomicU64> {
        (0..words).map(|_| AtomicU64::new(0)).collect()
    }

    #[test]
    fn geometry_checks() {
        let m = mem(64);
        assert!(SendRing::new(&m[..], 8).is_ok());
        assert_eq!(
            SendRing::new(&m[..], 16).err(),
            Some(RingError::BadGeometry)
        );
        assert_eq!(SendRing::new(&m[..], 6).err(), Some(RingError::BadGeometry));
        assert_eq!(
            RecvRing::new(&m[..], 8, 24).err(),
            Some(RingError::BadGeometry)
        );
        assert_eq!(
            RecvRing::new(&m[..], 8, 512).err(),
            Some(RingError::BadGeometry)
        );
        assert!(CqRing::new(&m[..], 8).is_ok());
        assert_eq!(CqRing::new(&m[..], 0).err(), Some(RingError::BadGeometry));
    }

    #[test]
    fn wqe_wraps_to_slot_zero() {
        let m = mem(4 * 8);
        let ring = SendRing::new(&m[..], 4).unwrap();
        let mut b = SendWqeBuilder::new(SendOpcode::Send, 3, 5, CtrlFlags::CQ_UPDATE, 0);
        b.inline(&[0x11; 100]).unwrap();
        let bytes = b.finish().unwrap().to_vec();
        assert_eq!(bytes.len(), 128);
        // Counter 7 -> slot 3 (the last): the second block lands in slot 0.
        ring.write_wqe(7, &bytes).unwrap();
        let mut slot0 = [0u8; 64];
        crate::dma::read_bytes(&m, 256, 0, &mut slot0).unwrap();
        assert_eq!(&slot0[..], &bytes[64..]);
        let mut back = [0u8; 128];
        ring.read_wqe(7, &mut back).unwrap();
        assert_eq!(&back[..], &bytes[..]);
        let w = SendWqe::parse(&back, false).unwrap();
        assert_eq!(w.ctrl.wqe_index, 3);
        assert_eq!(ring.write_wqe(0, &[0; 12]), Err(RingError::Misaligned));
        assert_eq!(ring.write_wqe(0, &[0; 264]), Err(RingError::TooLarge));
    }

    /// One WQE shape, applied alike to the staging builder and to the
    /// in-place writer.
    #[derive(Clone, Copy)]
    enum Shape<'a> {
        Sges(u32),
        Inline(&'a [u8]),
        Write(u32),
        Datagram,
        RegInline(&'a [PhysAddr]),
        RegIndirect(u32),
        Nothing,
    }

    fn reg(npages: u32, inline_list: bool) -> RegMrSegRepr {
        RegMrSegRepr {
            mkey: 0x1234_5601,
            access: crate::device::AccessFlags::LOCAL_WRITE
                | crate::device::AccessFlags::REMOTE_WRITE,
            page_shift: 12,
            inline_list,
            iova: 0x7000_0000_0123,
            length: (u64::from(npages) * 4096).saturating_sub(0x123),
            npages,
        }
    }

    fn seg(i: u32) -> DataSegRepr {
        DataSegRepr {
            byte_count: 100 + i,
            lkey: 0x500 + i,
            addr: 0x1_0000 * u64::from(i + 1),
        }
    }

    fn av() -> DatagramSegRepr {
        DatagramSegRepr {
            qkey: 0x8001_0000,
            dqpn: 0x00ab_cdef,
            sl: 3,
            tclass: 0x20,
            hop_limit: 64,
            flow_label: 0x1_2345,
            rgid: [7; 16],
            rmac: [1, 2, 3, 4, 5, 6],
        }
    }

    macro_rules! apply {
        ($b:expr, $shape:expr) => {
            match $shape {
                Shape::Sges(n) => {
                    for i in 0..n {
                        $b.data(seg(i)).map(|_| ())?;
                    }
                    Ok(())
                }
                Shape::Inline(d) => $b.inline(d).map(|_| ()),
                Shape::Write(n) => {
                    $b.raddr(0xdead_beef_0000, 0x77).map(|_| ())?;
                    for i in 0..n {
                        $b.data(seg(i)).map(|_| ())?;
                    }
                    Ok(())
                }
                Shape::Datagram => {
                    $b.datagram(&av()).map(|_| ())?;
                    $b.data(seg(0)).map(|_| ())
                }
                Shape::RegInline(pages) => $b
                    .reg_mr_inline(&reg(pages.len() as u32, true), pages)
                    .map(|_| ()),
                Shape::RegIndirect(n) => $b
                    .reg_mr_indirect(
                        &reg(n, false),
                        DataSegRepr {
                            byte_count: n * 8,
                            lkey: 0,
                            addr: 0x9000,
                        },
                    )
                    .map(|_| ()),
                Shape::Nothing => Ok(()),
            }
        };
    }

    fn staged(shape: Shape<'_>, index: u16) -> Result<(Vec<u8>, CtrlSegRepr), FormatError> {
        let mut b = SendWqeBuilder::new(SendOpcode::Send, index, 0x42, CtrlFlags::CQ_UPDATE, 9);
        (|| -> Result<(), FormatError> { apply!(b, shape) })()?;
        let bytes = b.finish()?.to_vec();
        Ok((bytes, b.ctrl()))
    }

    /// The writer's verdict: the WQE, a format error, or no room.
    #[derive(Debug, PartialEq)]
    enum Written {
        Wqe(CtrlSegRepr, u32),
        Refused(FormatError),
        NoRoom,
    }

    fn in_place(
        ring: &SendRing<&[AtomicU64]>,
        shape: Shape<'_>,
        counter: u32,
        room: u32,
    ) -> Written {
        let header = WqeHeader {
            opcode: SendOpcode::Send,
            qpn: 0x42,
            flags: CtrlFlags::CQ_UPDATE,
            imm: 9,
        };
        let mut w = ring.wqe_writer(counter, room, header);
        let r = (|| -> Result<(), FormatError> { apply!(w, shape) })();
        if let Err(e) = r {
            return Written::Refused(e);
        }
        if w.short_of_room() {
            assert_eq!(w.finish(), Err(RingError::TooLarge));
            return Written::NoRoom;
        }
        let bbs = w.wqebbs();
        Written::Wqe(w.finish().unwrap(), bbs)
    }

    #[test]
    fn in_place_writer_matches_the_staging_builder() {
        let pages: Vec<PhysAddr> = (1..=9).map(|i| PhysAddr(i * 0x1000)).collect();
        let data: Vec<u8> = (0..=200).map(|i| i as u8).collect();
        let mut shapes = vec![Shape::Nothing, Shape::Datagram, Shape::RegIndirect(64)];
        for n in 0..=MAX_DS as u32 {
            shapes.push(Shape::Sges(n));
            shapes.push(Shape::Write(n));
        }
        // Miri runs a sample (every length class around the 16-byte
        // boundaries is still there).
        let step = if cfg!(miri) { 5 } else { 1 };
        for n in (0..=data.len()).step_by(step) {
            shapes.push(Shape::Inline(&data[..n]));
        }
        for n in 0..=pages.len() {
            shapes.push(Shape::RegInline(&pages[..n]));
        }
        // A 16-WQEBB ring, every WQE at every start counter (most wrap).
        let m = mem(16 * 8);
        let ring = SendRing::new(&m[..], 16).unwrap();
        for (k, shape) in shapes.iter().enumerate() {
            let counters: &[u32] = if cfg!(miri) {
                &[15]
            } else {
                &[0, 5, 13, 15, 16 + 14, u32::MAX]
            };
            for &counter in counters {
                let expected = staged(*shape, counter as u16);
                // Dirty the ring first: every byte of the WQE must be written.
                for w in m.iter() {
                    w.store(0xA5A5_A5A5_A5A5_A5A5, Ordering::Relaxed);
                }
                let got = in_place(&ring, *shape, counter, 16);
                match (expected, got) {
                    (Ok((bytes, ctrl)), Written::Wqe(got_ctrl, bbs)) => {
                        assert_eq!(got_ctrl, ctrl, "shape {k} at {counter}");
                        assert_eq!(bbs as usize, bytes.len().div_ceil(WQEBB_SIZE));
                        let mut back = vec![0u8; bytes.len()];
                        ring.read_wqe(counter, &mut back).unwrap();
                        assert_eq!(back, bytes, "shape {k} at {counter}");
                    }
                    // The ring holds 16 WQEBBs = 1024 bytes >= the largest
                    // WQE: a refusal is never for room.
                    (Err(e), Written::Refused(g)) => assert_eq!(g, e, "shape {k}"),
                    (e, g) => panic!("shape {k} at {counter}: staged {e:?}, in place {g:?}"),
                }
            }
        }
    }

    /// In memory longer than the ring, a WQE that runs past the last slot
    /// still wraps to slot 0 (the writer's whole-segment stores never
    /// reach the words beyond the ring).
    #[test]
    fn in_place_writer_wraps_inside_longer_memory() {
        let m = mem(8 * 8 + 16);
        let ring = SendRing::new(&m[..], 8).unwrap();
        for w in m.iter() {
            w.store(7, Ordering::Relaxed);
        }
        let shape = Shape::Sges(7);
        let (bytes, ctrl) = staged(shape, 7).unwrap();
        assert!(bytes.len() > WQEBB_SIZE);
        assert_eq!(in_place(&ring, shape, 7, 8), Written::Wqe(ctrl, 2));
        let mut back = vec![0u8; bytes.len()];
        ring.read_wqe(7, &mut back).unwrap();
        assert_eq!(back, bytes);
        for (i, w) in m.iter().enumerate().skip(8 * 8) {
            assert_eq!(w.load(Ordering::Relaxed), 7, "word {i} past the ring");
        }
    }

    #[test]
    fn in_place_writer_stays_inside_its_room() {
        let m = mem(8 * 8);
        let ring = SendRing::new(&m[..], 8).unwrap();
        for w in m.iter() {
            w.store(7, Ordering::Relaxed);
        }
        // Room for 1 WQEBB (64 bytes: ctrl + 3 data segments); with a
        // fourth the WQE is measured but refused for room, and nothing
        // past the WQEBB moved.
        assert!(matches!(
            in_place(&ring, Shape::Sges(3), 6, 1),
            Written::Wqe(_, 1)
        ));
        assert_eq!(in_place(&ring, Shape::Sges(4), 6, 1), Written::NoRoom);
        assert_eq!(
            in_place(&ring, Shape::Inline(&[9; 200]), 6, 1),
            Written::NoRoom
        );
        for (i, w) in m.iter().enumerate() {
            if !(48..56).contains(&i) {
                assert_eq!(w.load(Ordering::Relaxed), 7, "word {i}");
            }
        }
        // A format error comes first, as from the staging builder, even
        // without room.
        let big = mem(16 * 8);
        let big = SendRing::new(&big[..], 16).unwrap();
        assert_eq!(
            in_place(&big, Shape::Sges(MAX_DS as u32), 0, 64),
            Written::Refused(FormatError::WqeTooLarge)
        );
        assert_eq!(
            in_place(&ring, Shape::Sges(MAX_DS as u32), 0, 1),
            Written::Refused(FormatError::WqeTooLarge)
        );
        // No room at all: not even the control segment.
        let nop = WqeHeader {
            opcode: SendOpcode::Nop,
            qpn: 1,
            flags: CtrlFlags::empty(),
            imm: 0,
        };
        assert_eq!(
            ring.wqe_writer(0, 0, nop).finish(),
            Err(RingError::TooLarge)
        );
    }

    #[test]
    fn recv_ring_round_trip() {
        let m = mem(4 * 4);
        let ring = RecvRing::new(&m[..], 4, 32).unwrap();
        let seg = DataSegRepr {
            byte_count: 256,
            lkey: 3,
            addr: 0x4000,
        };
        ring.write_wqe(5, &[seg]).unwrap();
        let w = ring.read_wqe(5).unwrap();
        assert_eq!(&w.sges[..], &[seg]);
        assert_eq!(ring.write_wqe(0, &[seg; 3]), Err(RingError::TooLarge));
    }

    #[test]
    fn cq_ownership_across_laps() {
        let m = mem(2 * 8);
        let ring = CqRing::new(&m[..], 2).unwrap();
        ring.init_invalid();
        assert!(ring.poll(0).is_none());
        let mut c = [0u8; 64];
        CqeRepr {
            opcode: CqeOpcode::Req,
            solicited: false,
            wqe_opcode: 0x0a,
            qpn: 3,
            wqe_counter: 0,
            byte_cnt: 0,
            imm_inval_pkey: 0,
            src_qpn: 0,
            grh: false,
            syndrome: 0,
            vendor_syndrome: 0,
        }
        .emit(&mut Cqe::new_unchecked(&mut c[..]), false);
        for counter in 0..6u32 {
            // Before the device writes it, the slot holds last lap's CQE (or
            // the invalid init): never software's.
            assert!(ring.poll(counter).is_none(), "counter {counter}");
            c[61] = counter as u8;
            ring.write_cqe(counter, &c).unwrap();
            let got = ring.poll(counter).unwrap();
            assert_eq!(got.wqe_counter(), counter as u16);
            // The borrowed view reads the same ring.
            let view = ring.view();
            assert_eq!(view.entries(), 2);
            assert!(view.is_ready(counter));
            assert!(!view.is_ready(counter + 1));
            assert_eq!(view.poll(counter).unwrap().wqe_counter(), counter as u16);
            assert!(view.poll(counter + 1).is_none());
            assert_eq!(got.owner(), counter & 2 != 0);
            // The next counter's slot is the other one, still stale.
            assert!(ring.poll(counter + 1).is_none());
        }
    }
}

/// Real threads over the same ring code (what Miri checks for data races
/// and weak-memory effects).
#[cfg(all(test, not(loom)))]
mod thread_tests {
    use super::*;
    use crate::cqe::CqeRepr;
    use crate::doorbell::CqDoorbellRecord;
    use crate::sync::atomic::AtomicU64;
    use alloc::sync::Arc;
    use alloc::vec::Vec;

    #[test]
    fn cq_producer_consumer_threads() {
        const ENTRIES: u32 = 4;
        let total: u32 = if cfg!(miri) { 12 } else { 2000 };
        let ring_mem: Arc<[AtomicU64]> = (0..ENTRIES as usize * 8)
            .map(|_| AtomicU64::new(0))
            .collect::<Vec<_>>()
            .into();
        let dbr_mem: Arc<[AtomicU64]> =
            (0..1).map(|_| AtomicU64::new(0)).collect::<Vec<_>>().into();
        CqRing::new(ring_mem.clone(), ENTRIES)
            .unwrap()
            .init_invalid();
        let (rm, dm) = (ring_mem.clone(), dbr_mem.clone());
        let device = std::thread::spawn(move || {
            let ring = CqRing::new(rm, ENTRIES).unwrap();
            let dbr = CqDoorbellRecord::new(dm).unwrap();
            for pi in 0..total {
                while pi.wrapping_sub(dbr.ci()) >= ENTRIES {
                    std::thread::yield_now();
                }
                let mut b = [0u8; CQE_SIZE];
                CqeRepr {
                    opcode: CqeOpcode::Req,
                    solicited: false,
                    wqe_opcode: 0,
                    qpn: pi & 0xff_ffff,
                    wqe_counter: pi as u16,
                    byte_cnt: pi,
                    imm_inval_pkey: !pi,
                    src_qpn: 0,
                    grh: false,
                    syndrome: 0,
                    vendor_syndrome: 0,
                }
                .emit(&mut Cqe::new_unchecked(&mut b[..]), false);
                ring.write_cqe(pi, &b).unwrap();
            }
        });
        let ring = CqRing::new(ring_mem, ENTRIES).unwrap();
        let dbr = CqDoorbellRecord::new(dbr_mem).unwrap();
        let mut ci = 0;
        while ci < total {
            if let Some(c) = ring.poll(ci) {
                let r = CqeRepr::parse(&c).unwrap();
                assert_eq!(
                    (r.byte_cnt, r.imm_inval_pkey, r.wqe_counter),
                    (ci, !ci, ci as u16)
                );
                ci += 1;
                dbr.set_ci(ci);
            } else {
                std::thread::yield_now();
            }
        }
        device.join().unwrap();
    }

    #[test]
    fn send_queue_publication_threads() {
        use crate::doorbell::QpDoorbellRecord;
        use crate::wqe::{CtrlFlags, SendOpcode, SendWqeBuilder};
        let rounds: u32 = if cfg!(miri) { 6 } else { 500 };
        // Ring of 4 WQEBBs; each WQE takes 2, so two are in flight at most.
        let sq_mem: Arc<[AtomicU64]> = (0..4 * 8)
            .map(|_| AtomicU64::new(0))
            .collect::<Vec<_>>()
            .into();
        let dbr_mem: Arc<[AtomicU64]> =
            (0..1).map(|_| AtomicU64::new(0)).collect::<Vec<_>>().into();
        // The device reports how many WQEs it has consumed (a completion).
        let done: Arc<AtomicU64> = Arc::new(AtomicU64::new(0));
        let (sm, dm, dn) = (sq_mem.clone(), dbr_mem.clone(), done.clone());
        let build = |i: u32| {
            let mut b =
                SendWqeBuilder::new(SendOpcode::Send, (i * 2) as u16, 9, CtrlFlags::empty(), i);
            b.inline(&[i as u8; 100]).unwrap();
            b.finish().unwrap().to_vec()
        };
        let device = std::thread::spawn(move || {
            let sq = SendRing::new(sm, 4).unwrap();
            let dbr = QpDoorbellRecord::new(dm).unwrap();
            let mut next = 0u32;
            while next < rounds {
                if dbr.sq_head() != (next * 2) as u16 {
                    let want = build(next);
                    let mut got = [0u8; 128];
                    sq.read_wqe(next * 2, &mut got).unwrap();
                    assert_eq!(&got[..], &want[..], "WQE {next}");
                    next += 1;
                    dn.store(u64::from(next), crate::sync::atomic::Ordering::Release);
                } else {
                    std::thread::yield_now();
                }
            }
        });
        let sq = SendRing::new(sq_mem, 4).unwrap();
        let dbr = QpDoorbellRecord::new(dbr_mem).unwrap();
        for i in 0..rounds {
            while u64::from(i) - done.load(crate::sync::atomic::Ordering::Acquire) >= 2 {
                std::thread::yield_now();
            }
            sq.write_wqe(i * 2, &build(i)).unwrap();
            crate::barrier::to_device();
            dbr.set_sq_head(((i + 1) * 2) as u16);
        }
        device.join().unwrap();
    }
}
