//! A simulated physical address space per host.
//!
//! Every DMA buffer of a host — rings, doorbell records, data buffers — is a
//! [`Region`] of atomic words mapped at a page-aligned physical address, with
//! an unmapped guard page after it. The device model reaches memory only by
//! physical address through [`PhysMemory::resolve`]; freed memory is unmapped
//! at once, so a device access to it fails with [`DmaError::Unmapped`]
//! instead of touching anything (the storage of a region lives on while an
//! access already holds it, so there is never a dangling reference).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock, Weak};

use crate::dma::{
    DmaAllocator, DmaBacking, DmaBuffer, DmaError, PhysAddr, SharedWords, read_bytes, write_bytes,
};

use super::payload::Payload;

/// Page size of the simulated address space.
pub const PAGE_SIZE: u64 = 4096;
/// Lowest physical address handed out (address 0 and its neighbourhood are
/// never mapped, so a zeroed descriptor faults).
const BASE: u64 = 0x1_0000_0000;

/// One allocation.
pub struct Region {
    base: u64,
    len: usize,
    words: Box<[AtomicU64]>,
    released: AtomicBool,
    owner: Weak<PhysMemory>,
}

impl Region {
    /// True once the owning buffer was dropped.
    pub fn is_released(&self) -> bool {
        self.released.load(Ordering::Acquire)
    }

    /// Physical address of byte 0.
    pub fn base(&self) -> u64 {
        self.base
    }
}

impl DmaBacking for Region {
    fn words(&self) -> &[AtomicU64] {
        &self.words
    }
    fn phys_addr(&self) -> PhysAddr {
        PhysAddr(self.base)
    }
    fn len(&self) -> usize {
        self.len
    }
    fn release(&self) {
        if !self.released.swap(true, Ordering::AcqRel) {
            if let Some(mem) = self.owner.upgrade() {
                mem.unmap(self.base, self.len);
            }
        }
    }
}

/// The device's handle on a region it uses for a ring or doorbell record: it
/// sees no memory at all once the driver freed it.
#[derive(Clone)]
pub struct DeviceMem(pub(crate) Arc<Region>);

impl SharedWords for DeviceMem {
    fn words(&self) -> &[AtomicU64] {
        if self.0.is_released() {
            &[]
        } else {
            &self.0.words
        }
    }
}

impl DeviceMem {
    /// True while the driver still owns the memory.
    pub fn alive(&self) -> bool {
        !self.0.is_released()
    }
}

/// A host's physical memory.
pub struct PhysMemory {
    map: RwLock<BTreeMap<u64, Arc<Region>>>,
    next: AtomicU64,
    used: AtomicUsize,
    limit: usize,
    me: Weak<PhysMemory>,
}

impl PhysMemory {
    /// A new, empty address space that will hand out at most `limit` bytes.
    pub fn new(limit: usize) -> Arc<Self> {
        Arc::new_cyclic(|me| Self {
            map: RwLock::new(BTreeMap::new()),
            next: AtomicU64::new(BASE),
            used: AtomicUsize::new(0),
            limit,
            me: me.clone(),
        })
    }

    /// Allocates `len` zeroed bytes at a fresh page-aligned address.
    ///
    /// # Errors
    /// [`DmaError::ZeroLength`], [`DmaError::OutOfMemory`].
    pub fn alloc(&self, len: usize) -> Result<DmaBuffer, DmaError> {
        Ok(DmaBuffer::from_backing(self.alloc_region(len)?))
    }

    pub(crate) fn alloc_region(&self, len: usize) -> Result<Arc<Region>, DmaError> {
        if len == 0 {
            return Err(DmaError::ZeroLength);
        }
        let used = self.used.fetch_add(len, Ordering::AcqRel);
        if used.saturating_add(len) > self.limit {
            self.used.fetch_sub(len, Ordering::AcqRel);
            return Err(DmaError::OutOfMemory);
        }
        let pages = (len as u64).div_ceil(PAGE_SIZE);
        // One unmapped guard page after every region.
        let base = self
            .next
            .fetch_add((pages + 1) * PAGE_SIZE, Ordering::Relaxed);
        let words: Box<[AtomicU64]> = (0..len.div_ceil(8)).map(|_| AtomicU64::new(0)).collect();
        let region = Arc::new(Region {
            base,
            len,
            words,
            released: AtomicBool::new(false),
            owner: self.me.clone(),
        });
        self.map
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(base, region.clone());
        Ok(region)
    }

    fn unmap(&self, base: u64, len: usize) {
        self.map
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&base);
        self.used.fetch_sub(len, Ordering::AcqRel);
    }

    /// Finds the live region holding `phys..phys + len`; returns it and the
    /// offset of `phys` in it.
    ///
    /// # Errors
    /// [`DmaError::Unmapped`] if any byte of the range is not in one live region.
    pub fn resolve(&self, phys: u64, len: usize) -> Result<(Arc<Region>, usize), DmaError> {
        self.with_region(phys, len, |region, off| Ok((region.clone(), off)))
    }

    /// Runs `f` on the live region holding `phys..phys + len` and the
    /// offset of `phys` in it, under the map's read lock: an access that is
    /// over when `f` returns borrows the region instead of taking a
    /// reference to it. `f` must not allocate or free memory of this
    /// address space (it would wait for the lock it is called under).
    ///
    /// # Errors
    /// [`DmaError::Unmapped`] as [`Self::resolve`], or `f`'s error.
    fn with_region<R>(
        &self,
        phys: u64,
        len: usize,
        f: impl FnOnce(&Arc<Region>, usize) -> Result<R, DmaError>,
    ) -> Result<R, DmaError> {
        let map = self
            .map
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (_, region) = map.range(..=phys).next_back().ok_or(DmaError::Unmapped)?;
        let off = phys - region.base;
        let end = off.checked_add(len as u64).ok_or(DmaError::Unmapped)?;
        if end > region.len as u64 || region.is_released() {
            return Err(DmaError::Unmapped);
        }
        f(region, off as usize)
    }

    /// Device read of physical memory.
    ///
    /// # Errors
    /// [`DmaError::Unmapped`].
    pub fn read(&self, phys: u64, out: &mut [u8]) -> Result<(), DmaError> {
        if out.is_empty() {
            return Ok(());
        }
        self.with_region(phys, out.len(), |r, off| {
            read_bytes(&r.words, r.len, off, out)
        })
    }

    /// Device write of physical memory.
    ///
    /// # Errors
    /// [`DmaError::Unmapped`].
    pub fn write(&self, phys: u64, data: &[u8]) -> Result<(), DmaError> {
        if data.is_empty() {
            return Ok(());
        }
        self.with_region(phys, data.len(), |r, off| {
            write_bytes(&r.words, r.len, off, data)
        })
    }

    /// Device write of a payload (bytes, or a copy straight from pinned
    /// memory: see [`super::payload`]).
    ///
    /// # Errors
    /// [`DmaError::Unmapped`].
    pub(crate) fn write_payload(&self, phys: u64, data: Payload<'_>) -> Result<(), DmaError> {
        if data.len() == 0 {
            return Ok(());
        }
        self.with_region(phys, data.len(), |r, off| {
            data.write_to(&r.words, r.len, off)
        })
    }

    /// True if `phys..phys+len` is live memory.
    pub fn is_mapped(&self, phys: u64, len: usize) -> bool {
        self.with_region(phys, len.max(1), |_, _| Ok(())).is_ok()
    }

    /// Bytes currently allocated.
    pub fn used_bytes(&self) -> usize {
        self.used.load(Ordering::Acquire)
    }

    /// Number of live regions.
    pub fn region_count(&self) -> usize {
        self.map
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len()
    }
}

/// [`DmaAllocator`] over a host's [`PhysMemory`].
pub struct SimDmaAllocator(pub Arc<PhysMemory>);

impl DmaAllocator for SimDmaAllocator {
    fn alloc(&self, len: usize) -> Result<DmaBuffer, DmaError> {
        self.0.alloc(len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freed_memory_is_unreachable() {
        let mem = PhysMemory::new(1 << 20);
        let buf = mem.alloc(100).unwrap();
        let pa = buf.phys_addr().get();
        assert_eq!(pa % PAGE_SIZE, 0);
        buf.write(10, b"hello").unwrap();
        let mut out = [0u8; 5];
        mem.read(pa + 10, &mut out).unwrap();
        assert_eq!(&out, b"hello");
        // Past the end (into the guard page) and before the base.
        assert_eq!(mem.read(pa + 98, &mut [0; 4]), Err(DmaError::Unmapped));
        assert_eq!(mem.read(pa - 1, &mut [0; 1]), Err(DmaError::Unmapped));
        let (region, _) = mem.resolve(pa, 1).unwrap();
        let dev = DeviceMem(region);
        assert!(dev.alive());
        drop(buf);
        assert!(!dev.alive());
        assert!(dev.words().is_empty());
        assert_eq!(mem.write(pa, b"x"), Err(DmaError::Unmapped));
        assert_eq!(mem.used_bytes(), 0);
        assert_eq!(mem.region_count(), 0);
    }

    #[test]
    fn limit_and_zero_length() {
        let mem = PhysMemory::new(8192);
        assert_eq!(mem.alloc(0).err(), Some(DmaError::ZeroLength));
        let a = mem.alloc(8192).unwrap();
        assert_eq!(mem.alloc(1).err(), Some(DmaError::OutOfMemory));
        drop(a);
        assert!(mem.alloc(1).is_ok());
    }

    #[test]
    fn unmapped_low_addresses() {
        let mem = PhysMemory::new(1 << 20);
        let _b = mem.alloc(64).unwrap();
        assert_eq!(mem.read(0, &mut [0; 8]), Err(DmaError::Unmapped));
    }
}
