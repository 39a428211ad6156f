//! Payloads by reference: one copy per byte on a plain in-process link.
//!
//! A SEND/WRITE's data and an RDMA READ response's data are not gathered
//! into a buffer of the device model. The sender resolves its local key (at
//! the time it processes the WQE, as before) into the physical pieces of
//! memory behind it and *pins* them ([`Pinned`]: shared references to the
//! memory regions, which keep their storage alive however the host frees
//! them), and the frame carries that ([`Source::Pinned`]). The receiver,
//! after its own key, bounds and access checks, copies straight from those
//! pieces into the destination ([`super::mem::PhysMemory::write_payload`]):
//! the placement is the one copy of each byte. A frame that must be written
//! out (a capture, fault injection, an Ethernet link) reads the pieces then.
//!
//! # When the source is read
//!
//! The source bytes are read when the frame is placed, not when the WQE is
//! processed. That is within verbs semantics because the placement comes
//! before the work request can complete: on RC a SEND/WRITE completes only
//! once the responder has acknowledged it, that is after it placed the data,
//! and until then the application may not touch the buffer. The one way a
//! work request completes before its frames are placed is a flush (the QP
//! entered the error state with packets still on the wire): the send
//! operation then revokes its source ([`Pinned::revoke`]) before it writes
//! the completion, and a frame of a revoked source is dropped as lost, so
//! no byte the application wrote after the completion reaches the peer. UD
//! sends complete when they are sent, so they keep gathering their bytes.
//!
//! An RDMA READ response reads the responder's memory when the requester
//! places it; the responder's key was checked when the response was made,
//! and the frame holds the key's generation ([`Pinned::guarded`]): if the
//! region was invalidated, re-registered or deregistered before placement,
//! the frame is dropped as lost (the requester retries, and the retry meets
//! the responder's key check).
//!
//! # Freed memory
//!
//! Pinned memory stays allocated while a frame references it, but a region
//! the host frees is unmapped at once, so no one else can write it again: a
//! frame placed from it places the bytes the memory held when it was freed
//! (never someone else's bytes, never a dangling read).

use std::cell::RefCell;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::dma::{DmaBacking, DmaError, copy_bytes, read_bytes};

use super::mem::Region;

/// One physically contiguous piece of pinned memory.
struct Piece {
    region: Arc<Region>,
    /// Byte offset of the piece in the region.
    offset: usize,
    len: usize,
    /// Byte offset of the piece in the payload.
    at: usize,
}

/// Memory pinned for a payload: its pieces in payload order.
pub(crate) struct Pinned {
    pieces: Vec<Piece>,
    len: usize,
    revoked: AtomicBool,
    /// The generation counter of the key that let the memory be read, and
    /// its value then (see [`Self::guarded`]).
    guard: Option<(Arc<AtomicU64>, u64)>,
}

impl Pinned {
    /// Payload bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Appends `len` bytes at byte `offset` of `region`.
    pub fn push(&mut self, region: Arc<Region>, offset: usize, len: usize) {
        let at = self.len;
        self.len += len;
        self.pieces.push(Piece {
            region,
            offset,
            len,
            at,
        });
    }

    /// Makes the payload valid only while `generation` keeps the value it
    /// has now.
    pub fn guarded(&mut self, generation: &Arc<AtomicU64>) {
        self.guard = Some((generation.clone(), generation.load(Ordering::Relaxed)));
    }

    /// The owner may no longer have its bytes read for the wire.
    pub fn revoke(&self) {
        self.revoked.store(true, Ordering::Relaxed);
    }

    /// True while the bytes may still be placed. (Revocation, key changes
    /// and placement all happen in the device model under the world lock,
    /// so relaxed loads see them in order.)
    pub fn valid(&self) -> bool {
        !self.revoked.load(Ordering::Relaxed)
            && self
                .guard
                .as_ref()
                .is_none_or(|(g, v)| g.load(Ordering::Relaxed) == *v)
    }

    /// Calls `f(region, offset_in_region, len, offset_in_range)` for each
    /// part of the payload bytes `start..start + len`.
    fn each(
        &self,
        start: usize,
        len: usize,
        mut f: impl FnMut(&Region, usize, usize, usize) -> Result<(), DmaError>,
    ) -> Result<(), DmaError> {
        let end = start.checked_add(len).ok_or(DmaError::OutOfBounds)?;
        if end > self.len {
            return Err(DmaError::OutOfBounds);
        }
        // The first piece holding `start` (pieces are in payload order).
        let first = self
            .pieces
            .partition_point(|p| p.at + p.len <= start)
            .min(self.pieces.len());
        let mut pos = start;
        for p in self.pieces.get(first..).unwrap_or(&[]) {
            if pos >= end {
                break;
            }
            let within = pos - p.at;
            let n = (p.len - within).min(end - pos);
            f(&p.region, p.offset + within, n, pos - start)?;
            pos += n;
        }
        if pos == end {
            Ok(())
        } else {
            Err(DmaError::OutOfBounds)
        }
    }
}

/// Most spare [`Pinned`] lists a thread keeps.
const PINNED_POOL_MAX: usize = 256;

thread_local! {
    /// Empty pinned lists (with their capacity) of delivered frames and
    /// finished operations: one allocation per payload was a measurable
    /// part of a 4 KiB packet's cost.
    static PINNED_POOL: RefCell<Vec<Arc<Pinned>>> = const { RefCell::new(Vec::new()) };
}

/// An empty pinned list, from this thread's pool when it has one.
pub(crate) fn pinned() -> Arc<Pinned> {
    PINNED_POOL
        .with(|p| p.borrow_mut().pop())
        .unwrap_or_else(|| {
            Arc::new(Pinned {
                pieces: Vec::new(),
                len: 0,
                revoked: AtomicBool::new(false),
                guard: None,
            })
        })
}

/// Unpins the memory of `p` and keeps the list for reuse, if `p` was its
/// last holder.
pub(crate) fn recycle_pinned(mut p: Arc<Pinned>) {
    let Some(v) = Arc::get_mut(&mut p) else {
        return;
    };
    v.pieces.clear();
    v.len = 0;
    v.guard = None;
    *v.revoked.get_mut() = false;
    PINNED_POOL.with(|pool| {
        let mut pool = pool.borrow_mut();
        if pool.len() < PINNED_POOL_MAX {
            pool.push(p);
        }
    });
}

/// Where a frame's payload is.
pub(crate) enum Source {
    /// Bytes gathered into a buffer (inline data, UD sends).
    Bytes(Arc<Vec<u8>>),
    /// The sender's (or READ responder's) memory.
    Pinned(Arc<Pinned>),
}

/// A payload as the receiver gets it: bytes, or a range of pinned memory.
#[derive(Copy, Clone)]
pub(crate) enum Payload<'a> {
    /// Bytes (a frame that was written out and parsed, or gathered data).
    Bytes(&'a [u8]),
    /// `len` bytes at `start` of a pinned payload.
    Pinned {
        src: &'a Pinned,
        start: usize,
        len: usize,
    },
}

impl<'a> Payload<'a> {
    /// Bytes in the payload.
    pub fn len(&self) -> usize {
        match self {
            Payload::Bytes(b) => b.len(),
            Payload::Pinned { len, .. } => *len,
        }
    }

    /// Bytes `at..at + n` of the payload, or `None` past its end.
    pub fn sub(&self, at: usize, n: usize) -> Option<Payload<'a>> {
        let end = at.checked_add(n)?;
        match *self {
            Payload::Bytes(b) => b.get(at..end).map(Payload::Bytes),
            Payload::Pinned { src, start, len } => (end <= len).then_some(Payload::Pinned {
                src,
                start: start + at,
                len: n,
            }),
        }
    }

    /// Copies the payload to bytes `offset..` of `words` (bounded by
    /// `limit`): the placement, straight from the source memory for a
    /// pinned payload.
    ///
    /// # Errors
    /// [`DmaError::OutOfBounds`] if the destination range is out of bounds.
    pub fn write_to(
        &self,
        words: &[AtomicU64],
        limit: usize,
        offset: usize,
    ) -> Result<(), DmaError> {
        match *self {
            Payload::Bytes(b) => crate::dma::write_bytes(words, limit, offset, b),
            Payload::Pinned { src, start, len } => src.each(start, len, |r, off, n, at| {
                copy_bytes(r.words(), r.len(), off, words, limit, offset + at, n)
            }),
        }
    }

    /// The payload's bytes, copied into `out` (exactly its length).
    ///
    /// # Errors
    /// [`DmaError::OutOfBounds`] if `out` is not the payload's length.
    pub fn read_into(&self, out: &mut [u8]) -> Result<(), DmaError> {
        if out.len() != self.len() {
            return Err(DmaError::OutOfBounds);
        }
        match *self {
            Payload::Bytes(b) => {
                out.copy_from_slice(b);
                Ok(())
            }
            Payload::Pinned { src, start, len } => src.each(start, len, |r, off, n, at| {
                let dst = out.get_mut(at..at + n).ok_or(DmaError::OutOfBounds)?;
                read_bytes(r.words(), r.len(), off, dst)
            }),
        }
    }

    /// The payload's bytes, in a new buffer.
    pub fn to_vec(self) -> Result<Vec<u8>, DmaError> {
        let mut v = vec![0; self.len()];
        self.read_into(&mut v)?;
        Ok(v)
    }
}
