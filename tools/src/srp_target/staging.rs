//! Staging memory: the registered buffers the target's RDMA READs land in
//! and its RDMA WRITEs go out from, and how a transfer is cut into work
//! requests.
//!
//! Each command that moves data by RDMA gets one contiguous buffer, taken
//! from a per-channel cache of power-of-two size classes and registered on
//! first use (the channel thread runs at `PASSIVE_LEVEL`, where registering
//! is allowed). The channel's budget bounds what is registered in all —
//! in use plus cached; a command that does not fit waits until others give
//! memory back. READs served from the store's registered chunks need none
//! (their WRITEs are cut by [`for_each_gather_piece`]).

use hca_lowlevel::device::AccessFlags;
use kverbs::error::VerbsError;
use kverbs::irql::Passive;
use kverbs::mr::Mr;
use kverbs::pd::Pd;
use kverbs::platform::host::HostPlatform;
use storport_srp::wire::srp::DirectDesc;

use crate::scsi_target::Extent;

/// The smallest buffer handed out.
const MIN_CLASS_SHIFT: u32 = 12;

/// One staging buffer.
#[derive(Debug)]
pub(crate) struct Staging {
    pub(crate) mr: Mr<HostPlatform>,
    class: u32,
}

impl Staging {
    fn size(&self) -> usize {
        1usize << self.class
    }
}

/// Why a buffer could not be had now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StagingError {
    /// More than the whole budget: it never will.
    TooLarge,
    /// Not now: memory is in use; try again when some comes back.
    Busy,
    /// Registration failed with nothing in use to wait for.
    Failed(VerbsError),
}

/// The per-channel cache.
pub(crate) struct StagingPool {
    pd: Pd<HostPlatform>,
    budget: usize,
    in_use: usize,
    idle_bytes: usize,
    /// Idle buffers by size class.
    idle: Vec<Vec<Staging>>,
}

impl StagingPool {
    pub(crate) fn new(pd: Pd<HostPlatform>, budget: usize) -> Self {
        Self {
            pd,
            budget,
            in_use: 0,
            idle_bytes: 0,
            idle: (0..usize::BITS).map(|_| Vec::new()).collect(),
        }
    }

    /// The size class of `len` bytes.
    fn class_of(len: usize) -> u32 {
        len.max(1)
            .next_power_of_two()
            .trailing_zeros()
            .max(MIN_CLASS_SHIFT)
    }

    /// Whether a buffer of `len` bytes could ever be had.
    pub(crate) fn fits(&self, len: usize) -> bool {
        len <= self.budget && (1usize << Self::class_of(len)) <= self.budget
    }

    /// A buffer of at least `len` bytes.
    ///
    /// # Errors
    ///
    /// See [`StagingError`].
    pub(crate) fn get(&mut self, len: usize, p: &Passive<'_>) -> Result<Staging, StagingError> {
        if !self.fits(len) {
            return Err(StagingError::TooLarge);
        }
        let class = Self::class_of(len);
        let size = 1usize << class;
        if let Some(buf) = self
            .idle
            .get_mut(class as usize)
            .and_then(std::vec::Vec::pop)
        {
            self.idle_bytes -= size;
            self.in_use += size;
            return Ok(buf);
        }
        // Make room by giving back idle buffers of other sizes.
        while self.in_use + self.idle_bytes + size > self.budget {
            if !self.free_one_idle(p) {
                return Err(StagingError::Busy);
            }
        }
        match Mr::alloc(&self.pd, size, AccessFlags::LOCAL_WRITE, p) {
            Ok(mr) => {
                self.in_use += size;
                Ok(Staging { mr, class })
            }
            Err(_) if self.in_use > 0 => Err(StagingError::Busy),
            Err(e) => Err(StagingError::Failed(e)),
        }
    }

    /// Gives a buffer back (kept for reuse).
    pub(crate) fn put(&mut self, buf: Staging) {
        let size = buf.size();
        self.in_use -= size;
        self.idle_bytes += size;
        if let Some(list) = self.idle.get_mut(buf.class as usize) {
            list.push(buf);
        }
    }

    fn free_one_idle(&mut self, p: &Passive<'_>) -> bool {
        let Some(list) = self.idle.iter_mut().rev().find(|l| !l.is_empty()) else {
            return false;
        };
        if let Some(buf) = list.pop() {
            self.idle_bytes -= buf.size();
            let _ = buf.mr.dereg(p);
        }
        true
    }

    /// Bytes handed out and not given back.
    pub(crate) fn in_use(&self) -> usize {
        self.in_use
    }

    /// Deregisters every idle buffer (at teardown, after every buffer came
    /// back).
    pub(crate) fn release(&mut self, p: &Passive<'_>) {
        while self.free_one_idle(p) {}
    }
}

/// One RDMA work request of a transfer: `len` bytes between
/// `local_off` of the staging buffer and the initiator's
/// `remote_addr`/`rkey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Piece {
    pub(crate) remote_addr: u64,
    pub(crate) rkey: u32,
    pub(crate) local_off: u32,
    pub(crate) len: u32,
}

/// Cuts the first `bytes` bytes of the buffers `descs` describe (in order)
/// into work requests of at most `max` bytes. Empty descriptors are
/// skipped; a descriptor whose address range wraps is cut where it wraps
/// (the initiator's HCA refuses it).
pub(crate) fn pieces(descs: &[DirectDesc], bytes: u32, max: u32) -> Vec<Piece> {
    let mut out = Vec::new();
    for_each_piece(descs, bytes, max, |remote_addr, rkey, local_off, len| {
        out.push(Piece {
            remote_addr,
            rkey,
            local_off,
            len,
        });
    });
    out
}

/// [`pieces`] without the vector, for the DPC lane (which must not
/// allocate): `f(remote_addr, rkey, local_off, len)` for each piece.
pub(crate) fn for_each_piece(
    descs: &[DirectDesc],
    bytes: u32,
    max: u32,
    mut f: impl FnMut(u64, u32, u32, u32),
) {
    let max = max.max(1);
    let mut left = bytes;
    let mut local: u32 = 0;
    for d in descs {
        if left == 0 {
            break;
        }
        let mut take = d.len.min(left);
        let mut addr = d.va;
        while take > 0 {
            let len = take.min(max);
            f(addr, d.rkey, local, len);
            addr = addr.wrapping_add(u64::from(len));
            local += len;
            take -= len;
            left -= len;
        }
    }
}

/// [`for_each_piece`] over data that lies in several registered extents
/// (a READ served straight from the store's chunks): each work request is
/// also cut where an extent ends, so it gathers from one extent with one
/// SGE. `f(remote_addr, rkey, len, lkey, local_addr)` for each piece.
/// Stops early (returning `false`) if the extents hold fewer bytes than
/// the cut asks for.
pub(crate) fn for_each_gather_piece(
    descs: &[DirectDesc],
    extents: &[Extent],
    bytes: u32,
    max: u32,
    mut f: impl FnMut(u64, u32, u32, u32, u64),
) -> bool {
    let mut index = 0usize;
    // Offset of extents[index] in the transfer.
    let mut extent_start: u32 = 0;
    let mut complete = true;
    for_each_piece(descs, bytes, max, |remote_addr, rkey, local_off, len| {
        let mut at = local_off;
        let end = local_off + len;
        while at < end && complete {
            let Some(extent) = extents.get(index) else {
                complete = false;
                return;
            };
            let extent_end = extent_start + extent.len;
            if at >= extent_end {
                index += 1;
                extent_start = extent_end;
                continue;
            }
            let take = (end - at).min(extent_end - at);
            let local = extent.addr + u64::from(at - extent_start);
            f(
                remote_addr + u64::from(at - local_off),
                rkey,
                take,
                extent.lkey,
                local,
            );
            at += take;
        }
    });
    complete
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(va: u64, rkey: u32, len: u32) -> DirectDesc {
        DirectDesc { va, rkey, len }
    }

    #[test]
    fn cut_at_the_limit_and_at_descriptor_boundaries() {
        let descs = [
            d(0x1000, 7, 10_000),
            d(0x9000_0000, 8, 0),
            d(0x5000, 9, 3000),
        ];
        let p = pieces(&descs, 13_000, 4096);
        let expect = [
            (0x1000, 7, 0, 4096),
            (0x2000, 7, 4096, 4096),
            (0x3000, 7, 8192, 1808),
            (0x5000, 9, 10_000, 3000),
        ];
        assert_eq!(p.len(), expect.len());
        for (got, (addr, rkey, off, len)) in p.iter().zip(expect) {
            assert_eq!(
                (got.remote_addr, got.rkey, got.local_off, got.len),
                (addr, rkey, off, len)
            );
        }
        // Fewer bytes than the buffers hold: only the first ones.
        let p = pieces(&descs, 5000, 65536);
        assert_eq!(p.len(), 1);
        assert_eq!(p[0].len, 5000);
        assert!(pieces(&descs, 0, 4096).is_empty());
        // The pieces always cover exactly min(bytes, total).
        for bytes in [1u32, 4095, 4096, 4097, 13_000, 20_000] {
            let total: u32 = pieces(&descs, bytes, 4096).iter().map(|p| p.len).sum();
            assert_eq!(total, bytes.min(13_000));
        }
    }

    #[test]
    fn gather_pieces_cut_at_extent_ends_and_cover_every_byte() {
        let ext = |addr, len| Extent {
            addr,
            lkey: (addr >> 20) as u32,
            len,
            pin: None,
        };
        // 10,000 + 3,000 bytes of remote buffers; local data in extents of
        // 5,000, 100 and 7,900 bytes.
        let descs = [d(0x1000, 7, 10_000), d(0x5000, 9, 3000)];
        let extents = [
            ext(0x10_0000, 5000),
            ext(0x20_0000, 100),
            ext(0x30_0000, 7900),
        ];
        let mut got = Vec::new();
        assert!(for_each_gather_piece(
            &descs,
            &extents,
            13_000,
            4096,
            |ra, rk, len, lk, la| got.push((ra, rk, len, lk, la))
        ));
        let expect = [
            (0x1000, 7, 4096, 1, 0x10_0000),
            (0x2000, 7, 904, 1, 0x10_0000 + 4096),
            (0x2000 + 904, 7, 100, 2, 0x20_0000),
            (0x2000 + 1004, 7, 3092, 3, 0x30_0000),
            (0x3000, 7, 1808, 3, 0x30_0000 + 3092),
            (0x5000, 9, 3000, 3, 0x30_0000 + 4900),
        ];
        assert_eq!(got, expect);
        // Too few extent bytes: reported, never read past the last one.
        let short = [ext(0x10_0000, 5000)];
        let mut total = 0;
        assert!(!for_each_gather_piece(
            &descs,
            &short,
            13_000,
            4096,
            |_, _, len, _, _| total += len
        ));
        assert_eq!(total, 5000);
    }

    #[test]
    fn size_classes() {
        assert_eq!(StagingPool::class_of(1), 12);
        assert_eq!(StagingPool::class_of(4096), 12);
        assert_eq!(StagingPool::class_of(4097), 13);
        assert_eq!(StagingPool::class_of(1 << 20), 20);
    }
}
