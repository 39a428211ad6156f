//! The sector storage of one logical unit: a sparse array of fixed-size
//! chunks, each behind its own reader-writer lock.
//!
//! Why chunks: the software targets run one thread per channel, and several
//! channels (or initiators) hit the same logical unit at once. A lock per
//! chunk lets I/O to different regions run in parallel, and gives every
//! block a simple atomicity guarantee: a chunk is a whole number of blocks,
//! so a block is written under one lock and a concurrent reader sees it
//! either before or after a write, never torn. (A transfer that spans chunks
//! is not atomic as a whole, as SCSI does not promise it is.)
//!
//! Why sparse: capacities are configurable and tests use large ones. A
//! chunk is allocated on its first write (zeroed, which the allocator gets
//! from fresh pages) and freed again by a discard that covers it; an
//! unallocated chunk reads as zeros. The chunk size grows with the capacity
//! so that the chunk table stays at most [`MAX_CHUNKS`] entries.
//!
//! # Registered chunks: READs served straight from the store
//!
//! An RDMA target can attach a protection domain
//! ([`BlockStore::attach_registration`], at `PASSIVE_LEVEL`): from then on
//! every chunk lives in memory registered with that PD (the chunks that
//! exist are moved there, new ones are allocated there), and unallocated
//! chunks read from one shared registered buffer of zeros. A READ then asks
//! for the range as registered extents ([`BlockStore::read_extents`]) and
//! its RDMA WRITEs gather from the chunks themselves: no staging copy.
//!
//! Each extent of a chunk carries a [`StorePin`] (a reference to the
//! chunk's memory) that the target holds until the WRITE that reads the
//! extent has completed. The per-block atomicity above still holds: a
//! write to a pinned chunk does not wait (the pin may be released only by
//! the writer's own thread, later) and does not touch the pinned bytes; it
//! copies the chunk, writes the copy and puts the copy in the table (copy
//! on write). The READ in flight keeps sending the bytes from before the
//! write, as if it had run first; later reads see the write. The old
//! chunk is deregistered once its last pin is gone, never before (retired
//! chunks wait in a list reaped at `PASSIVE_LEVEL`). A write to an
//! unpinned chunk writes in place, as before. The cost of the copy is one
//! chunk (64 KiB for stores up to 4 GiB) per write that races a READ of
//! the same chunk.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard, TryLockError};
use std::time::{Duration, Instant};

use hca_lowlevel::device::AccessFlags;
use hca_lowlevel::dma::{SharedWords, copy_bytes};
use kverbs::error::VerbsError;
use kverbs::irql::Passive;
use kverbs::mr::Mr;
use kverbs::pd::Pd;
use kverbs::platform::host::HostPlatform;

use super::DataOut;

type Hp = HostPlatform;

/// The smallest chunk: 64 KiB (a multiple of both block sizes).
pub const MIN_CHUNK_BYTES: u64 = 64 * 1024;

/// The most chunks a store has; larger capacities get larger chunks.
pub const MAX_CHUNKS: u64 = 64 * 1024;

/// Zeros handed out for unallocated chunks, in pieces of at most this size.
static ZEROS: [u8; 64 * 1024] = [0; 64 * 1024];

/// Bytes copied at a time out of (or between) registered chunks.
const BOUNCE_BYTES: usize = 8 * 1024;

/// How long detaching waits for the last pins of retired chunks.
const DETACH_WAIT: Duration = Duration::from_secs(2);

/// Hands out the keys of registrations.
static NEXT_REGISTRATION: AtomicU64 = AtomicU64::new(1);

/// The bytes of one chunk: on the heap, or in registered DMA memory.
#[derive(Debug)]
enum ChunkMem {
    Heap(Box<[u8]>),
    Registered(Mr<Hp>),
}

impl ChunkMem {
    fn len(&self) -> usize {
        match self {
            Self::Heap(bytes) => bytes.len(),
            Self::Registered(mr) => mr.len(),
        }
    }

    /// Copies `out.len()` bytes from `within` into `out`.
    fn read_into(&self, within: usize, out: &mut [u8]) {
        match self {
            Self::Heap(bytes) => out.copy_from_slice(&bytes[within..within + out.len()]),
            Self::Registered(mr) => {
                // In range: the callers cut pieces to the chunk.
                let _ = mr.mem().read(within, out);
            }
        }
    }

    fn write_at(&mut self, within: usize, data: &[u8]) {
        match self {
            Self::Heap(bytes) => bytes[within..within + data.len()].copy_from_slice(data),
            Self::Registered(mr) => {
                let _ = mr.mem().write(within, data);
            }
        }
    }

    /// Copies `data` to `within`: bytes as [`Self::write_at`]; device
    /// memory straight from its words (one copy, no bounce buffer).
    fn write_from(&mut self, within: usize, data: DataOut<'_>) {
        // In range: a `DmaData` is checked against its buffer when built,
        // and the callers cut pieces to the chunk.
        match (self, data) {
            (chunk, DataOut::Bytes(bytes)) => chunk.write_at(within, bytes),
            (Self::Heap(bytes), DataOut::Dma(src)) => {
                let out = &mut bytes[within..within + data.len()];
                let _ = src.buf().read(src.offset(), out);
            }
            (Self::Registered(mr), DataOut::Dma(src)) => {
                let (from, to) = (src.buf(), mr.mem());
                let _ = copy_bytes(
                    from.words(),
                    from.len(),
                    src.offset(),
                    to.words(),
                    to.len(),
                    within,
                    data.len(),
                );
            }
        }
    }

    fn zero(&mut self, within: usize, len: usize) {
        match self {
            Self::Heap(bytes) => bytes[within..within + len].fill(0),
            Self::Registered(mr) => {
                let mut at = within;
                let end = within + len;
                while at < end {
                    let step = (end - at).min(ZEROS.len());
                    let _ = mr.mem().write(at, &ZEROS[..step]);
                    at += step;
                }
            }
        }
    }

    /// Copies all of `from` (the same length) into `self`.
    fn copy_from(&mut self, from: &Self) {
        if let (Self::Heap(to), Self::Heap(src)) = (&mut *self, from) {
            to.copy_from_slice(src);
            return;
        }
        let mut bounce = [0u8; BOUNCE_BYTES];
        let mut at = 0;
        while at < from.len() {
            let step = (from.len() - at).min(BOUNCE_BYTES);
            from.read_into(at, &mut bounce[..step]);
            self.write_at(at, &bounce[..step]);
            at += step;
        }
    }

    /// Hands `piece` bytes from `within` to `sink` (through a bounce
    /// buffer for registered memory, which is only reachable by copy).
    fn emit(&self, within: usize, piece: usize, sink: &mut dyn FnMut(&[u8])) {
        match self {
            Self::Heap(bytes) => sink(&bytes[within..within + piece]),
            Self::Registered(_) => {
                let mut bounce = [0u8; BOUNCE_BYTES];
                let mut at = within;
                let end = within + piece;
                while at < end {
                    let step = (end - at).min(BOUNCE_BYTES);
                    self.read_into(at, &mut bounce[..step]);
                    sink(&bounce[..step]);
                    at += step;
                }
            }
        }
    }

    /// The offset of the first byte in `within..` that differs from
    /// `expected`.
    fn first_difference(&self, within: usize, expected: &[u8]) -> Option<usize> {
        match self {
            Self::Heap(bytes) => {
                first_difference(&bytes[within..within + expected.len()], expected)
            }
            Self::Registered(_) => {
                let mut bounce = [0u8; BOUNCE_BYTES];
                let mut done = 0;
                for want in expected.chunks(BOUNCE_BYTES) {
                    let got = &mut bounce[..want.len()];
                    self.read_into(within + done, got);
                    if let Some(at) = first_difference(got, want) {
                        return Some(done + at);
                    }
                    done += want.len();
                }
                None
            }
        }
    }
}

type Chunk = Option<Arc<ChunkMem>>;

/// The protection domain the chunks are registered with, and its buffer
/// of zeros.
#[derive(Debug)]
struct Registration {
    key: u64,
    platform: Hp,
    pd: Pd<Hp>,
    zeros: Mr<Hp>,
}

impl Registration {
    /// A registered chunk of `len` zeroed bytes, or `None` if the HCA
    /// refuses (the chunk then lives on the heap and READs of it copy).
    fn alloc(&self, len: usize) -> Option<ChunkMem> {
        let mr = self
            .platform
            .run_passive(|p| Mr::alloc(&self.pd, len, AccessFlags::LOCAL_WRITE, p));
        mr.ok().map(ChunkMem::Registered)
    }
}

/// A pin on a registered chunk: while it lives, the chunk's memory stays
/// registered and unchanged (writers copy the chunk instead). An RDMA
/// target holds the pins of a READ's extents until its WRITEs completed;
/// dropping one never blocks, allocates or deregisters (any `IRQL`).
#[derive(Debug, Clone)]
pub struct StorePin(#[allow(dead_code)] Arc<ChunkMem>);

/// A piece of a read range in registered memory: `len` bytes at `addr`
/// (an I/O virtual address) under `lkey`.
#[derive(Debug, Clone)]
pub struct Extent {
    /// I/O virtual address of the first byte.
    pub addr: u64,
    /// The local key of the memory.
    pub lkey: u32,
    /// Bytes.
    pub len: u32,
    /// The chunk's pin (`None` for the shared zeros, which never change).
    pub pin: Option<StorePin>,
}

/// Why [`BlockStore::read_extents`] could not describe a range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExtentError {
    /// The store is not registered under this key, or a chunk of the range
    /// lives on the heap (its registration failed): copy instead.
    NotRegistered,
    /// Non-blocking, and a chunk lock is held by a writer.
    WouldBlock,
    /// The consumer refused an extent (it has no room for more).
    Refused,
}

/// A sparse, chunk-locked byte store of a fixed size.
#[derive(Debug)]
pub struct BlockStore {
    len: u64,
    chunk_bytes: u64,
    chunks: Box<[RwLock<Chunk>]>,
    /// Set while an RDMA target has the chunks registered. Read before a
    /// chunk lock is taken, never under one (attach and detach take chunk
    /// locks under it).
    registration: RwLock<Option<Arc<Registration>>>,
    /// Registered chunks replaced or discarded while pinned, until their
    /// last pin is gone (then they are deregistered).
    retired: Mutex<Vec<Arc<ChunkMem>>>,
    /// Writes that found their chunk pinned and copied it.
    copies_on_write: AtomicU64,
}

impl BlockStore {
    /// A zero-filled store of `len` bytes (no chunk is allocated yet).
    pub fn new(len: u64) -> Self {
        let wanted = len.div_ceil(MAX_CHUNKS).max(MIN_CHUNK_BYTES);
        let chunk_bytes = wanted.checked_next_power_of_two().unwrap_or(1 << 63);
        let count = len.div_ceil(chunk_bytes);
        // NO-OVERFLOW: count <= MAX_CHUNKS.
        let chunks = (0..count).map(|_| RwLock::new(None)).collect();
        Self {
            len,
            chunk_bytes,
            chunks,
            registration: RwLock::new(None),
            retired: Mutex::new(Vec::new()),
            copies_on_write: AtomicU64::new(0),
        }
    }

    /// Size in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the store has no bytes at all.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The chunk size (a power of two, at least [`MIN_CHUNK_BYTES`]).
    pub fn chunk_bytes(&self) -> u64 {
        self.chunk_bytes
    }

    /// How many chunks hold data (the rest read as zeros).
    pub fn allocated_chunks(&self) -> usize {
        self.chunks
            .iter()
            .filter(|chunk| read_lock(chunk).is_some())
            .count()
    }

    /// How many chunks (in the table or retired) are pinned by a READ in
    /// flight.
    pub fn pinned_chunks(&self) -> usize {
        let live = self
            .chunks
            .iter()
            .filter(|chunk| {
                read_lock(chunk)
                    .as_ref()
                    .is_some_and(|c| Arc::strong_count(c) > 1)
            })
            .count();
        let retired = self
            .retired
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .filter(|c| Arc::strong_count(c) > 1)
            .count();
        live + retired
    }

    /// Registered chunks replaced while pinned and not yet deregistered.
    pub fn retired_chunks(&self) -> usize {
        self.retired
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// Writes that found their chunk pinned and wrote a copy.
    pub fn copies_on_write(&self) -> u64 {
        self.copies_on_write.load(Ordering::Relaxed)
    }

    /// How many chunks live in registered memory.
    pub fn registered_chunks(&self) -> usize {
        self.chunks
            .iter()
            .filter(|chunk| matches!(read_lock(chunk).as_deref(), Some(ChunkMem::Registered(_))))
            .count()
    }

    /// A new key for [`Self::attach_registration`] (one per protection
    /// domain; a target registers all its stores under one key).
    pub fn new_registration_key() -> u64 {
        NEXT_REGISTRATION.fetch_add(1, Ordering::Relaxed)
    }

    /// Registers the store with `pd` under `key`: the chunks that exist
    /// move into registered memory, later ones are allocated there, and a
    /// buffer of zeros stands for the unallocated ones. `false` if another
    /// PD has the store already (that caller copies, as before).
    ///
    /// # Errors
    ///
    /// The zeros buffer could not be registered (nothing changed).
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL`; allocates and registers.
    pub fn attach_registration(
        &self,
        key: u64,
        platform: &Hp,
        pd: &Pd<Hp>,
        p: &Passive<'_>,
    ) -> Result<bool, VerbsError> {
        let mut slot = self
            .registration
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        if slot.is_some() {
            return Ok(false);
        }
        let zeros = Mr::alloc(pd, ZEROS.len(), AccessFlags::LOCAL_WRITE, p)?;
        let registration = Arc::new(Registration {
            key,
            platform: platform.clone(),
            pd: pd.clone(),
            zeros,
        });
        for chunk in self.chunks.iter() {
            let mut guard = write_lock(chunk);
            let Some(old) = guard.as_ref() else { continue };
            if matches!(**old, ChunkMem::Registered(_)) {
                continue;
            }
            if let Some(mut moved) = registration.alloc(old.len()) {
                moved.copy_from(old);
                *guard = Some(Arc::new(moved));
            }
        }
        *slot = Some(registration);
        Ok(true)
    }

    /// Undoes [`Self::attach_registration`] for `key`: every chunk moves
    /// back to the heap and is deregistered, after waiting (a bounded
    /// time) for pins still held. Returns how many registered chunks had
    /// to be left registered because a pin never went (0 when every READ
    /// finished, as it has after the target closed its channels).
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL`.
    pub fn detach_registration(&self, key: u64, p: &Passive<'_>) -> usize {
        let registration = {
            let mut slot = self
                .registration
                .write()
                .unwrap_or_else(PoisonError::into_inner);
            if slot.as_ref().map(|r| r.key) != Some(key) {
                return 0;
            }
            slot.take()
        };
        for chunk in self.chunks.iter() {
            let mut guard = write_lock(chunk);
            let Some(old) = guard.as_ref() else { continue };
            if !matches!(**old, ChunkMem::Registered(_)) {
                continue;
            }
            let mut moved = ChunkMem::Heap(vec![0u8; old.len()].into_boxed_slice());
            moved.copy_from(old);
            if let Some(old) = guard.replace(Arc::new(moved)) {
                self.retire(old);
            }
        }
        let start = Instant::now();
        while self.reap(p) > 0 && start.elapsed() < DETACH_WAIT {
            std::thread::sleep(Duration::from_millis(1));
        }
        if let Some(registration) = registration {
            let _ = registration.zeros.dereg(p);
        }
        self.retired_chunks()
    }

    /// The registration, looked up before any chunk lock is taken.
    fn registration(&self) -> Option<Arc<Registration>> {
        read_lock_any(&self.registration).clone()
    }

    /// Keeps a replaced registered chunk until its pins are gone.
    fn retire(&self, old: Arc<ChunkMem>) {
        if matches!(*old, ChunkMem::Registered(_)) {
            self.retired
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(old);
        }
    }

    /// Deregisters the retired chunks nobody pins any more; returns how
    /// many are left.
    fn reap(&self, p: &Passive<'_>) -> usize {
        let mut retired = self.retired.lock().unwrap_or_else(PoisonError::into_inner);
        retired.retain(|chunk| {
            // Only the list holds it: no pin can appear (pins are taken
            // from the table, which no longer has it).
            if Arc::strong_count(chunk) > 1 {
                return true;
            }
            if let ChunkMem::Registered(mr) = &**chunk {
                let _ = mr.dereg(p);
            }
            false
        });
        retired.len()
    }

    /// [`Self::reap`] when something is retired, from a writer's thread.
    fn reap_soon(&self, registration: Option<&Registration>) {
        let any = !self
            .retired
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_empty();
        if let (true, Some(registration)) = (any, registration) {
            registration.platform.run_passive(|p| {
                self.reap(p);
            });
        }
    }

    /// Splits `offset..offset + len` into per-chunk pieces:
    /// `(chunk index, offset in chunk, piece length)`. The caller has
    /// checked the range lies inside the store.
    fn pieces(&self, offset: u64, len: u64) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        let end = offset + len;
        let mut at = offset;
        std::iter::from_fn(move || {
            if at >= end {
                return None;
            }
            let index = at / self.chunk_bytes;
            let within = at % self.chunk_bytes;
            let piece = (self.chunk_bytes - within).min(end - at);
            at += piece;
            // CAST: chunk offsets and pieces are below the chunk size, which
            // fits in memory because the chunk was (or can be) allocated.
            Some((index as usize, within as usize, piece as usize))
        })
    }

    fn check(&self, offset: u64, len: u64) {
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= self.len),
            "store range {offset}+{len} outside {} bytes",
            self.len
        );
    }

    /// Hands `offset..offset + len` to `sink` in order, in pieces: slices of
    /// the chunks themselves, read-locked while the sink runs (so the sink
    /// must not write to this store), or zeros for unallocated chunks.
    ///
    /// # Panics
    ///
    /// If the range is outside the store (the device server checks LBAs
    /// first).
    pub fn read(&self, offset: u64, len: u64, sink: &mut dyn FnMut(&[u8])) {
        self.check(offset, len);
        for (index, within, piece) in self.pieces(offset, len) {
            let guard = read_lock(&self.chunks[index]);
            emit_piece(guard.as_deref(), within, piece, sink);
        }
    }

    /// [`Self::read`] for a caller that must neither block nor allocate
    /// (the SRP target serving in its CQ's DPC): `false` as soon as a chunk
    /// lock is held by a writer. The sink may have received a prefix of
    /// the range then; the caller drops it and serves the command on a
    /// thread instead.
    ///
    /// # Panics
    ///
    /// If the range is outside the store.
    pub fn try_read(&self, offset: u64, len: u64, sink: &mut dyn FnMut(&[u8])) -> bool {
        self.check(offset, len);
        for (index, within, piece) in self.pieces(offset, len) {
            let guard = match self.chunks[index].try_read() {
                Ok(guard) => guard,
                Err(TryLockError::Poisoned(e)) => e.into_inner(),
                Err(TryLockError::WouldBlock) => return false,
            };
            emit_piece(guard.as_deref(), within, piece, sink);
        }
        true
    }

    /// Describes `offset..offset + len` as registered extents, in order,
    /// for a store registered under `key`: the chunks' own memory (each
    /// extent pinned) or the shared zeros. `consume` returns `false` when
    /// it can take no more. Neither allocates nor deregisters; with
    /// `nonblocking` it also never waits for a lock (callable at
    /// `DISPATCH_LEVEL`).
    ///
    /// On an error, `consume` may have received a prefix of the range; the
    /// caller drops it (and its pins) and copies instead, or retries on a
    /// thread.
    ///
    /// # Errors
    ///
    /// See [`ExtentError`].
    ///
    /// # Panics
    ///
    /// If the range is outside the store.
    pub fn read_extents(
        &self,
        key: u64,
        offset: u64,
        len: u64,
        nonblocking: bool,
        consume: &mut dyn FnMut(Extent) -> bool,
    ) -> Result<(), ExtentError> {
        self.check(offset, len);
        let registration = if nonblocking {
            match self.registration.try_read() {
                Ok(guard) => guard.clone(),
                Err(TryLockError::Poisoned(e)) => e.into_inner().clone(),
                Err(TryLockError::WouldBlock) => return Err(ExtentError::WouldBlock),
            }
        } else {
            self.registration()
        };
        let registration = registration
            .filter(|r| r.key == key)
            .ok_or(ExtentError::NotRegistered)?;
        for (index, within, piece) in self.pieces(offset, len) {
            let guard = if nonblocking {
                match self.chunks[index].try_read() {
                    Ok(guard) => guard,
                    Err(TryLockError::Poisoned(e)) => e.into_inner(),
                    Err(TryLockError::WouldBlock) => return Err(ExtentError::WouldBlock),
                }
            } else {
                read_lock(&self.chunks[index])
            };
            match guard.as_ref() {
                None => {
                    let zeros = &registration.zeros;
                    let mut left = piece;
                    while left > 0 {
                        let step = left.min(zeros.len());
                        let extent = Extent {
                            addr: zeros.iova(),
                            lkey: zeros.lkey(),
                            len: u32::try_from(step).map_err(|_| ExtentError::Refused)?,
                            pin: None,
                        };
                        if !consume(extent) {
                            return Err(ExtentError::Refused);
                        }
                        left -= step;
                    }
                }
                Some(chunk) => {
                    let ChunkMem::Registered(mr) = &**chunk else {
                        return Err(ExtentError::NotRegistered);
                    };
                    let extent = Extent {
                        addr: mr.iova() + within as u64,
                        lkey: mr.lkey(),
                        len: u32::try_from(piece).map_err(|_| ExtentError::Refused)?,
                        pin: Some(StorePin(Arc::clone(chunk))),
                    };
                    if !consume(extent) {
                        return Err(ExtentError::Refused);
                    }
                }
            }
        }
        Ok(())
    }

    /// [`Self::write`] for a caller that must neither block nor allocate:
    /// `false` as soon as a chunk lock is held, a chunk would have to be
    /// allocated, or a chunk is pinned (writing it means copying it). The
    /// chunks before that one were written then; the caller writes the
    /// whole range again on a thread (a transfer that spans chunks is not
    /// atomic anyway, and the bytes are the same).
    ///
    /// # Panics
    ///
    /// If the range is outside the store.
    pub fn try_write(&self, offset: u64, data: &[u8]) -> bool {
        self.try_write_from(offset, DataOut::Bytes(data))
    }

    /// [`Self::try_write`] from bytes or device memory.
    ///
    /// # Panics
    ///
    /// If the range is outside the store.
    pub fn try_write_from(&self, offset: u64, data: DataOut<'_>) -> bool {
        self.check(offset, data.len() as u64);
        let mut rest = data;
        for (index, within, piece) in self.pieces(offset, data.len() as u64) {
            let (head, tail) = rest.split_at(piece).expect("pieces cover the data");
            rest = tail;
            let mut guard = match self.chunks[index].try_write() {
                Ok(guard) => guard,
                Err(TryLockError::Poisoned(e)) => e.into_inner(),
                Err(TryLockError::WouldBlock) => return false,
            };
            let Some(chunk) = guard.as_mut().and_then(Arc::get_mut) else {
                return false;
            };
            chunk.write_from(within, head);
        }
        true
    }

    /// Copies `data` into the store at `offset`.
    ///
    /// # Panics
    ///
    /// If the range is outside the store.
    pub fn write(&self, offset: u64, data: &[u8]) {
        self.write_from(offset, DataOut::Bytes(data));
    }

    /// Copies `data` into the store at `offset`: bytes, or device memory
    /// (the SRP target's staging buffer) copied straight into the chunks.
    ///
    /// # Panics
    ///
    /// If the range is outside the store.
    pub fn write_from(&self, offset: u64, data: DataOut<'_>) {
        self.check(offset, data.len() as u64);
        let registration = self.registration();
        let mut rest = data;
        for (index, within, piece) in self.pieces(offset, data.len() as u64) {
            let (head, tail) = rest.split_at(piece).expect("pieces cover the data");
            rest = tail;
            let mut guard = write_lock(&self.chunks[index]);
            self.modify(&mut guard, index, registration.as_deref(), |chunk| {
                chunk.write_from(within, head);
            });
        }
        self.reap_soon(registration.as_deref());
    }

    /// Runs `change` on chunk `index` (write-locked in `guard`): in place,
    /// or on a copy when a READ pins the chunk (the copy replaces it; the
    /// pinned one is retired).
    fn modify(
        &self,
        guard: &mut RwLockWriteGuard<'_, Chunk>,
        index: usize,
        registration: Option<&Registration>,
        change: impl FnOnce(&mut ChunkMem),
    ) {
        let Some(current) = guard.as_mut() else {
            let mut fresh = self.new_chunk(index, registration);
            change(&mut fresh);
            **guard = Some(Arc::new(fresh));
            return;
        };
        // Pins are only taken under the read lock, which this writer
        // excludes: a chunk found unpinned stays unpinned here.
        if let Some(chunk) = Arc::get_mut(current) {
            change(chunk);
            return;
        }
        self.copies_on_write.fetch_add(1, Ordering::Relaxed);
        let mut fresh = self.new_chunk(index, registration);
        fresh.copy_from(current);
        change(&mut fresh);
        let old = std::mem::replace(current, Arc::new(fresh));
        self.retire(old);
    }

    /// Compares the store at `offset` with `expected`; returns the offset
    /// (from `offset`) of the first differing byte.
    ///
    /// # Panics
    ///
    /// If the range is outside the store.
    pub fn compare(&self, offset: u64, expected: &[u8]) -> Option<u64> {
        self.check(offset, expected.len() as u64);
        let mut rest = expected;
        let mut done = 0u64;
        for (index, within, piece) in self.pieces(offset, expected.len() as u64) {
            let (head, tail) = rest.split_at(piece);
            rest = tail;
            let guard = read_lock(&self.chunks[index]);
            let mismatch = match guard.as_deref() {
                Some(data) => data.first_difference(within, head),
                None => head.iter().position(|byte| *byte != 0),
            };
            if let Some(at) = mismatch {
                return Some(done + at as u64);
            }
            done += piece as u64;
        }
        None
    }

    /// Zeroes `offset..offset + len`, freeing every chunk the range covers
    /// whole.
    ///
    /// # Panics
    ///
    /// If the range is outside the store.
    pub fn discard(&self, offset: u64, len: u64) {
        self.check(offset, len);
        let registration = self.registration();
        for (index, within, piece) in self.pieces(offset, len) {
            let mut guard = write_lock(&self.chunks[index]);
            if within == 0 && piece == self.chunk_len(index) {
                if let Some(old) = guard.take() {
                    self.retire(old);
                }
            } else if guard.is_some() {
                self.modify(&mut guard, index, registration.as_deref(), |chunk| {
                    chunk.zero(within, piece);
                });
            }
        }
        self.reap_soon(registration.as_deref());
    }

    /// The length of chunk `index` (the last one may be short).
    fn chunk_len(&self, index: usize) -> usize {
        let start = index as u64 * self.chunk_bytes;
        // CAST: at most the chunk size.
        (self.len - start).min(self.chunk_bytes) as usize
    }

    /// A zeroed chunk: registered when the store is, else (or if the
    /// registration fails) on the heap.
    fn new_chunk(&self, index: usize, registration: Option<&Registration>) -> ChunkMem {
        let len = self.chunk_len(index);
        registration
            .and_then(|r| r.alloc(len))
            .unwrap_or_else(|| ChunkMem::Heap(vec![0u8; len].into_boxed_slice()))
    }
}

fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    if a == b {
        return None;
    }
    a.iter().zip(b).position(|(x, y)| x != y)
}

/// Locks for reading. A poisoned lock (a sink that panicked in a test) still
/// guards consistent bytes: every write is one `copy_from_slice`.
fn read_lock(lock: &RwLock<Chunk>) -> RwLockReadGuard<'_, Chunk> {
    lock.read().unwrap_or_else(PoisonError::into_inner)
}

fn read_lock_any<T>(lock: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(PoisonError::into_inner)
}

fn write_lock(lock: &RwLock<Chunk>) -> RwLockWriteGuard<'_, Chunk> {
    lock.write().unwrap_or_else(PoisonError::into_inner)
}

/// Hands `piece` bytes of a chunk from `within` to `sink`: the chunk's
/// bytes, or zeros for a chunk never written.
fn emit_piece(chunk: Option<&ChunkMem>, within: usize, piece: usize, sink: &mut dyn FnMut(&[u8])) {
    match chunk {
        Some(data) => data.emit(within, piece, sink),
        None => {
            let mut left = piece;
            while left > 0 {
                let step = left.min(ZEROS.len());
                sink(&ZEROS[..step]);
                left -= step;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn try_read_and_try_write_refuse_instead_of_waiting_or_allocating() {
        let store = BlockStore::new(4 * MIN_CHUNK_BYTES);
        // An unallocated chunk reads as zeros but cannot be written without
        // allocating it.
        let mut seen = Vec::new();
        assert!(store.try_read(10, 100, &mut |p| seen.extend_from_slice(p)));
        assert_eq!(seen, vec![0u8; 100]);
        assert!(!store.try_write(10, &[7; 100]));
        assert_eq!(store.allocated_chunks(), 0);
        store.write(0, &[1; 8]);
        assert!(store.try_write(10, &[7; 100]));
        assert_eq!(collect(&store, 8, 4), [0, 0, 7, 7]);
        // A held chunk lock: both refuse rather than wait.
        let held = store.chunks[0].write().unwrap();
        assert!(!store.try_read(0, 4, &mut |_| {}));
        assert!(!store.try_write(0, &[3; 4]));
        drop(held);
        let held = store.chunks[0].read().unwrap();
        assert!(store.try_read(0, 4, &mut |_| {}));
        assert!(!store.try_write(0, &[3; 4]));
        drop(held);
        assert!(store.try_write(0, &[3; 4]));
        assert_eq!(collect(&store, 0, 2), [3, 3]);
    }

    /// A DMA buffer holding `bytes` (the SRP target's staging buffer
    /// after its RDMA READs).
    fn dma_holding(bytes: &[u8]) -> hca_lowlevel::dma::DmaBuffer {
        let memory = hca_lowlevel::sim::PhysMemory::new(1 << 20);
        let buf = memory.alloc(bytes.len()).unwrap();
        buf.write(0, bytes).unwrap();
        buf
    }

    #[test]
    fn writes_from_device_memory_land_as_bytes_do() {
        let data: Vec<u8> = (0..150_000u32).map(|i| (i % 253) as u8).collect();
        let buf = dma_holding(&data);
        let dma = DataOut::dma(&buf, data.len()).unwrap();
        let (from_dma, from_bytes) = (
            BlockStore::new(4 * MIN_CHUNK_BYTES),
            BlockStore::new(4 * MIN_CHUNK_BYTES),
        );
        // Across two chunk ends, starting off a word boundary.
        from_dma.write_from(MIN_CHUNK_BYTES - 1_003, dma);
        from_bytes.write(MIN_CHUNK_BYTES - 1_003, &data);
        let len = 4 * MIN_CHUNK_BYTES;
        assert_eq!(collect(&from_dma, 0, len), collect(&from_bytes, 0, len));
        assert_eq!(
            collect(&from_dma, MIN_CHUNK_BYTES - 1_003, data.len() as u64),
            data
        );
        // The non-blocking write takes the same source, into allocated
        // chunks only.
        let (head, _) = dma.split_at(4_096).unwrap();
        from_dma.discard(0, len);
        assert!(!from_dma.try_write_from(512, head));
        from_dma.write(0, &[0; 8]);
        assert!(from_dma.try_write_from(512, head));
        assert_eq!(collect(&from_dma, 512, 4_096), data[..4_096]);
        assert_eq!(collect(&from_dma, 0, 512), vec![0u8; 512]);
    }

    #[test]
    fn device_memory_data_out_stays_inside_its_buffer() {
        let buf = dma_holding(&[9; 4_096]);
        assert!(DataOut::dma(&buf, 4_097).is_none());
        let whole = DataOut::dma(&buf, 4_096).unwrap();
        assert!(whole.split_at(4_097).is_none());
        assert!(whole.prefix(4_097).is_none());
        let (head, tail) = whole.split_at(100).unwrap();
        assert_eq!((head.len(), tail.len()), (100, 3_996));
        assert_eq!(tail.prefix(3).unwrap().to_bytes().as_ref(), [9, 9, 9]);
        assert!(DataOut::dma(&buf, 0).unwrap().is_empty());
    }

    fn collect(store: &BlockStore, offset: u64, len: u64) -> Vec<u8> {
        let mut out = Vec::new();
        store.read(offset, len, &mut |piece| out.extend_from_slice(piece));
        out
    }

    #[test]
    fn chunk_size_scales_with_capacity() {
        assert_eq!(BlockStore::new(1 << 20).chunk_bytes(), MIN_CHUNK_BYTES);
        let big = BlockStore::new(1 << 40);
        assert_eq!(big.chunk_bytes(), 16 << 20);
        assert_eq!(big.chunks.len() as u64, MAX_CHUNKS);
        let odd = BlockStore::new(3 * MIN_CHUNK_BYTES + 512);
        assert_eq!(odd.chunks.len(), 4);
        assert_eq!(odd.chunk_len(3), 512);
    }

    #[test]
    fn writes_across_chunks_read_back_and_zeros_elsewhere() {
        let store = BlockStore::new(4 * MIN_CHUNK_BYTES);
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let at = MIN_CHUNK_BYTES - 1000;
        store.write(at, &data);
        // 1000 bytes in chunk 0, all of chunk 1, the rest in chunk 2.
        assert_eq!(store.allocated_chunks(), 3);
        assert_eq!(collect(&store, at, data.len() as u64), data);
        assert!(collect(&store, 0, at).iter().all(|b| *b == 0));
        let tail_start = at + data.len() as u64;
        let tail = collect(&store, tail_start, store.len() - tail_start);
        assert!(tail.iter().all(|b| *b == 0));
        assert_eq!(store.compare(at, &data), None);
        let mut wrong = data.clone();
        wrong[70_000] ^= 1;
        assert_eq!(store.compare(at, &wrong), Some(70_000));
        assert_eq!(store.compare(0, &[0, 0, 1]), Some(2));
    }

    #[test]
    fn discard_frees_whole_chunks_and_zeroes_partial_ones() {
        let store = BlockStore::new(3 * MIN_CHUNK_BYTES);
        store.write(0, &vec![0xAB; store.len() as usize]);
        assert_eq!(store.allocated_chunks(), 3);
        store.discard(512, 2 * MIN_CHUNK_BYTES);
        assert_eq!(store.allocated_chunks(), 2);
        let all = collect(&store, 0, store.len());
        assert!(all[..512].iter().all(|b| *b == 0xAB));
        assert!(
            all[512..512 + 2 * MIN_CHUNK_BYTES as usize]
                .iter()
                .all(|b| *b == 0)
        );
        assert!(
            all[512 + 2 * MIN_CHUNK_BYTES as usize..]
                .iter()
                .all(|b| *b == 0xAB)
        );
    }

    #[test]
    #[should_panic(expected = "outside")]
    fn out_of_range_is_a_caller_bug() {
        BlockStore::new(1024).write(1000, &[0; 25]);
    }
}
