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

use std::sync::{PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard, TryLockError};

/// The smallest chunk: 64 KiB (a multiple of both block sizes).
pub const MIN_CHUNK_BYTES: u64 = 64 * 1024;

/// The most chunks a store has; larger capacities get larger chunks.
pub const MAX_CHUNKS: u64 = 64 * 1024;

/// Zeros handed out for unallocated chunks, in pieces of at most this size.
static ZEROS: [u8; 64 * 1024] = [0; 64 * 1024];

type Chunk = Option<Box<[u8]>>;

/// A sparse, chunk-locked byte store of a fixed size.
#[derive(Debug)]
pub struct BlockStore {
    len: u64,
    chunk_bytes: u64,
    chunks: Box<[RwLock<Chunk>]>,
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

    /// [`Self::write`] for a caller that must neither block nor allocate:
    /// `false` as soon as a chunk lock is held or a chunk would have to be
    /// allocated. The chunks before that one were written then; the caller
    /// writes the whole range again on a thread (a transfer that spans
    /// chunks is not atomic anyway, and the bytes are the same).
    ///
    /// # Panics
    ///
    /// If the range is outside the store.
    pub fn try_write(&self, offset: u64, data: &[u8]) -> bool {
        self.check(offset, data.len() as u64);
        let mut rest = data;
        for (index, within, piece) in self.pieces(offset, data.len() as u64) {
            let (head, tail) = rest.split_at(piece);
            rest = tail;
            let mut guard = match self.chunks[index].try_write() {
                Ok(guard) => guard,
                Err(TryLockError::Poisoned(e)) => e.into_inner(),
                Err(TryLockError::WouldBlock) => return false,
            };
            let Some(chunk) = guard.as_deref_mut() else {
                return false;
            };
            chunk[within..within + piece].copy_from_slice(head);
        }
        true
    }

    /// Copies `data` into the store at `offset`.
    ///
    /// # Panics
    ///
    /// If the range is outside the store.
    pub fn write(&self, offset: u64, data: &[u8]) {
        self.check(offset, data.len() as u64);
        let mut rest = data;
        for (index, within, piece) in self.pieces(offset, data.len() as u64) {
            let (head, tail) = rest.split_at(piece);
            rest = tail;
            let mut guard = write_lock(&self.chunks[index]);
            let chunk = guard.get_or_insert_with(|| self.new_chunk(index));
            chunk[within..within + piece].copy_from_slice(head);
        }
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
                Some(data) => first_difference(&data[within..within + piece], head),
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
        for (index, within, piece) in self.pieces(offset, len) {
            let mut guard = write_lock(&self.chunks[index]);
            if within == 0 && piece == self.chunk_len(index) {
                *guard = None;
            } else if let Some(chunk) = guard.as_deref_mut() {
                chunk[within..within + piece].fill(0);
            }
        }
    }

    /// The length of chunk `index` (the last one may be short).
    fn chunk_len(&self, index: usize) -> usize {
        let start = index as u64 * self.chunk_bytes;
        // CAST: at most the chunk size.
        (self.len - start).min(self.chunk_bytes) as usize
    }

    fn new_chunk(&self, index: usize) -> Box<[u8]> {
        vec![0u8; self.chunk_len(index)].into_boxed_slice()
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

fn write_lock(lock: &RwLock<Chunk>) -> RwLockWriteGuard<'_, Chunk> {
    lock.write().unwrap_or_else(PoisonError::into_inner)
}

/// Hands `piece` bytes of a chunk from `within` to `sink`: the chunk's
/// bytes, or zeros for a chunk never written.
fn emit_piece(chunk: Option<&[u8]>, within: usize, piece: usize, sink: &mut dyn FnMut(&[u8])) {
    match chunk {
        Some(data) => sink(&data[within..within + piece]),
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
