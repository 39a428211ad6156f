//! Memory registration: MRs over DMA buffers (a firmware command, at
//! `PASSIVE_LEVEL` or asynchronously), and the per-channel pool of
//! fast-registration MRs whose registration is a work request.
//!
//! # Fast registration and key rotation
//!
//! A [`FrPool`] is created at `PASSIVE_LEVEL` with every mkey and every
//! page-list buffer it will ever use. On the data path a channel takes an
//! [`FrMr`] ([`FrPool::get`], no allocation), registers it with a REG_MR
//! work request ([`crate::qp::SendBatch::reg_mr`]) and later invalidates it
//! (LOCAL_INV, or the peer's SEND with invalidate, checked with
//! [`FrMr::remote_invalidated`]). **Every registration rotates the key
//! byte**, so an rkey handed to a target for one I/O is refused by the HCA
//! once the MR is re-registered for the next — a late or hostile RDMA on a
//! stale rkey is a protection error, never a write into another I/O's
//! buffer. Access is exactly what the request asks (nothing is added).
//! An MR returned to the pool while still registered is invalidated by the
//! next registration (a LOCAL_INV chained in front of the REG_MR, as iSER
//! does).

use alloc::boxed::Box;
use alloc::sync::Arc;
use alloc::vec::Vec;
use core::fmt;

use hca_lowlevel::device::{AccessFlags, MrKeys, MrRegistration};
use hca_lowlevel::dma::{DmaBuffer, PhysAddr};
use hca_lowlevel::wqe::MIN_PAGE_SHIFT;

use crate::error::VerbsError;
use crate::irql::{AnyIrql, LeDispatch, Passive};
use crate::pd::Pd;
use crate::platform::Platform;
use crate::slowpath::{Callback, Job, ResultSlot, take_result};
use crate::sync::SpinLock;
use crate::sync::atomic::{AtomicBool, Ordering};
use crate::wr::Sge;

/// Bytes per page kverbs registers DMA buffers with.
pub const PAGE_SIZE: u64 = 1 << MIN_PAGE_SHIFT;

/// The offset kverbs adds to a buffer's physical address to make its I/O
/// virtual address, so an iova is never mistaken for a physical address
/// (and a missing translation shows up in tests).
pub const IOVA_BASE: u64 = 0x0100_0000_0000_0000;

struct MrInner<P: Platform> {
    pd: Pd<P>,
    mem: DmaBuffer,
    keys: MrKeys,
    iova: u64,
    access: AccessFlags,
    deregistered: AtomicBool,
}

/// A registered memory region over a DMA buffer (cheap to clone).
pub struct Mr<P: Platform> {
    inner: Arc<MrInner<P>>,
}

impl<P: Platform> Clone for Mr<P> {
    fn clone(&self) -> Self {
        Mr {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<P: Platform> fmt::Debug for Mr<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Mr")
            .field("lkey", &self.inner.keys.lkey)
            .field("len", &self.inner.mem.len())
            .field("access", &self.inner.access)
            .finish()
    }
}

/// Physical pages of a (physically contiguous) DMA buffer.
fn pages_of(mem: &DmaBuffer) -> Vec<PhysAddr> {
    let base = mem.phys_addr().get() & !(PAGE_SIZE - 1);
    let end = mem.phys_addr().get().saturating_add(mem.len() as u64);
    let n = end.saturating_sub(base).div_ceil(PAGE_SIZE);
    (0..n).map(|i| PhysAddr(base + i * PAGE_SIZE)).collect()
}

impl<P: Platform> Mr<P> {
    /// Registers `mem` (a DMA buffer from the device's allocator) with
    /// exactly `access`.
    ///
    /// # Errors
    ///
    /// [`VerbsError::Hca`] (`InvalidAccess`, `InvalidRange`,
    /// `OutOfResources`), the buffer handed back.
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL` only.
    pub fn register(
        pd: &Pd<P>,
        mem: DmaBuffer,
        access: AccessFlags,
        _irql: &Passive<'_>,
    ) -> Result<Self, (VerbsError, DmaBuffer)> {
        let pages = pages_of(&mem);
        let iova = IOVA_BASE | mem.phys_addr().get();
        let reg = MrRegistration {
            pd: pd.inner.pdn,
            iova,
            length: mem.len() as u64,
            page_shift: MIN_PAGE_SHIFT,
            pages: &pages,
            access,
        };
        match pd.inner.device.hca.reg_mr(&reg) {
            Ok(keys) => Ok(Mr {
                inner: Arc::new(MrInner {
                    pd: pd.clone(),
                    mem,
                    keys,
                    iova,
                    access,
                    deregistered: AtomicBool::new(false),
                }),
            }),
            Err(e) => Err((e.into(), mem)),
        }
    }

    /// Allocates `len` bytes of zeroed DMA memory and registers it.
    ///
    /// # Errors
    ///
    /// [`VerbsError::Dma`], or as [`Mr::register`].
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL` only.
    pub fn alloc(
        pd: &Pd<P>,
        len: usize,
        access: AccessFlags,
        irql: &Passive<'_>,
    ) -> Result<Self, VerbsError> {
        let mem = pd.inner.device.dma.alloc(len)?;
        Self::register(pd, mem, access, irql).map_err(|(e, _)| e)
    }

    /// Prepares an asynchronous registration of `mem` (see
    /// [`crate::slowpath`]): submit the job with
    /// [`crate::device::Device::submit`] from any IRQL <= `DISPATCH_LEVEL`;
    /// `done` receives the MR (or the error).
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL` (it allocates the job).
    pub fn prepare_register(
        pd: &Pd<P>,
        mem: DmaBuffer,
        access: AccessFlags,
        done: Callback<Result<Mr<P>, VerbsError>>,
        _irql: &Passive<'_>,
    ) -> Arc<RegMrJob<P>> {
        Arc::new(RegMrJob {
            pd: pd.clone(),
            access,
            input: SpinLock::new(Some(mem)),
            result: SpinLock::new(None),
            done,
        })
    }

    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.inner.keys.lkey
    }

    /// Remote key, if remote access was granted.
    pub fn rkey(&self) -> Option<u32> {
        self.inner
            .access
            .is_remote()
            .then_some(self.inner.keys.rkey)
    }

    /// I/O virtual address of byte 0.
    pub fn iova(&self) -> u64 {
        self.inner.iova
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.mem.len()
    }

    /// True for an empty region (never: allocators refuse zero lengths).
    pub fn is_empty(&self) -> bool {
        self.inner.mem.is_empty()
    }

    /// The rights it was registered with.
    pub fn access(&self) -> AccessFlags {
        self.inner.access
    }

    /// The memory.
    pub fn mem(&self) -> &DmaBuffer {
        &self.inner.mem
    }

    /// The PD.
    pub fn pd(&self) -> &Pd<P> {
        &self.inner.pd
    }

    /// A gather/scatter entry over `offset..offset + len`; `None` if it
    /// leaves the region.
    pub fn sge(&self, offset: u64, len: u32) -> Option<Sge> {
        let end = offset.checked_add(u64::from(len))?;
        (end <= self.inner.mem.len() as u64).then(|| Sge {
            addr: self.inner.iova + offset,
            len,
            lkey: self.inner.keys.lkey,
        })
    }

    /// Deregisters the MR on the device (the memory stays allocated until
    /// the last handle drops).
    ///
    /// # Errors
    ///
    /// [`VerbsError::Closed`] if already deregistered; [`VerbsError::Hca`].
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL` only.
    pub fn dereg(&self, _irql: &Passive<'_>) -> Result<(), VerbsError> {
        if self.inner.deregistered.swap(true, Ordering::AcqRel) {
            return Err(VerbsError::Closed);
        }
        self.inner
            .pd
            .inner
            .device
            .hca
            .dereg_mr(self.inner.keys.lkey)
            .map_err(VerbsError::from)
    }

    /// Prepares an asynchronous deregistration (see [`crate::slowpath`]).
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL` (it allocates the job).
    pub fn prepare_dereg(
        &self,
        done: Callback<Result<(), VerbsError>>,
        _irql: &Passive<'_>,
    ) -> Arc<DeregMrJob<P>> {
        Arc::new(DeregMrJob {
            mr: self.clone(),
            result: SpinLock::new(None),
            done,
        })
    }
}

/// A prepared asynchronous registration ([`Mr::prepare_register`]).
pub struct RegMrJob<P: Platform> {
    pd: Pd<P>,
    access: AccessFlags,
    input: SpinLock<Option<DmaBuffer>, P>,
    result: ResultSlot<Mr<P>, P>,
    done: Callback<Result<Mr<P>, VerbsError>>,
}

impl<P: Platform> Job for RegMrJob<P> {
    fn run(&self, irql: &Passive<'_>) {
        let mem = self.input.lock(irql).take();
        let result = match mem {
            Some(mem) => Mr::register(&self.pd, mem, self.access, irql).map_err(|(e, m)| {
                // The buffer is freed here, at PASSIVE_LEVEL.
                drop(m);
                e
            }),
            None => Err(VerbsError::Closed),
        };
        *self.result.lock(irql) = Some(result);
    }

    fn complete(&self, cancelled: bool, irql: AnyIrql<'_, '_>) {
        let result = take_result(&self.result, cancelled, &irql);
        (self.done)(result, irql);
    }
}

/// A prepared asynchronous deregistration ([`Mr::prepare_dereg`]).
pub struct DeregMrJob<P: Platform> {
    mr: Mr<P>,
    result: ResultSlot<(), P>,
    done: Callback<Result<(), VerbsError>>,
}

impl<P: Platform> Job for DeregMrJob<P> {
    fn run(&self, irql: &Passive<'_>) {
        let r = self.mr.dereg(irql);
        *self.result.lock(irql) = Some(r);
    }

    fn complete(&self, cancelled: bool, irql: AnyIrql<'_, '_>) {
        let r = take_result(&self.result, cancelled, &irql);
        (self.done)(r, irql);
    }
}

// ---------------------------------------------------------------------------
// Fast registration
// ---------------------------------------------------------------------------

/// Page lists up to this many pages go inline in the REG_MR WQE; longer
/// ones are written to the MR's preallocated page-list buffer.
pub const INLINE_PAGES: usize = 4;

/// One fast-registration mkey with its page-list buffer.
struct FrEntry {
    /// The mkey with key byte 0.
    mkey_base: u32,
    page_list: DmaBuffer,
}

/// Where an entry stands between two uses (kept while it is in the pool).
#[derive(Clone, Copy, Debug, Default)]
struct FrParked {
    key: u8,
    registered: bool,
}

pub(crate) struct FrPoolInner<P: Platform> {
    pd: Pd<P>,
    entries: Box<[FrEntry]>,
    free: SpinLock<Vec<(u32, FrParked)>, P>,
    max_pages: u32,
    destroyed: AtomicBool,
}

/// A channel's pool of fast-registration MRs (cheap to clone).
pub struct FrPool<P: Platform> {
    inner: Arc<FrPoolInner<P>>,
}

impl<P: Platform> Clone for FrPool<P> {
    fn clone(&self) -> Self {
        FrPool {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<P: Platform> fmt::Debug for FrPool<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FrPool")
            .field("size", &self.inner.entries.len())
            .field("max_pages", &self.inner.max_pages)
            .finish()
    }
}

impl<P: Platform> FrPool<P> {
    /// Allocates `count` fast-registration mkeys of up to `max_pages` pages
    /// each, with their page-list buffers.
    ///
    /// # Errors
    ///
    /// [`VerbsError::InvalidArgument`] for zero sizes or more pages than
    /// the device maps; [`VerbsError::Hca`], [`VerbsError::Dma`] (what was
    /// allocated is freed again).
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL` only.
    pub fn new(
        pd: &Pd<P>,
        count: usize,
        max_pages: u32,
        irql: &Passive<'_>,
    ) -> Result<Self, VerbsError> {
        let dev = &pd.inner.device;
        if count == 0
            || max_pages == 0
            || max_pages > dev.attr.max_fast_reg_page_list_len
            || count > usize::from(u16::MAX)
        {
            return Err(VerbsError::InvalidArgument);
        }
        let mut entries = Vec::with_capacity(count);
        let mut failure = None;
        for _ in 0..count {
            let mkey = match dev.hca.alloc_mkey(pd.inner.pdn, max_pages) {
                Ok(k) => k,
                Err(e) => {
                    failure = Some(VerbsError::from(e));
                    break;
                }
            };
            match dev.dma.alloc(max_pages as usize * 8) {
                Ok(page_list) => entries.push(FrEntry {
                    mkey_base: mkey & !0xff,
                    page_list,
                }),
                Err(e) => {
                    let _ = dev.hca.free_mkey(mkey);
                    failure = Some(VerbsError::from(e));
                    break;
                }
            }
        }
        if let Some(e) = failure {
            for entry in &entries {
                let _ = dev.hca.free_mkey(entry.mkey_base);
            }
            return Err(e);
        }
        let free = (0..count)
            .rev()
            .map(|i| (i as u32, FrParked::default()))
            .collect();
        let _ = irql;
        Ok(FrPool {
            inner: Arc::new(FrPoolInner {
                pd: pd.clone(),
                entries: entries.into_boxed_slice(),
                free: SpinLock::new(free),
                max_pages,
                destroyed: AtomicBool::new(false),
            }),
        })
    }

    /// Takes an MR from the pool; `None` if all are in use (the caller
    /// should report "busy", never tear the connection down).
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    pub fn get(&self, irql: &impl LeDispatch) -> Option<FrMr<P>> {
        if self.inner.destroyed.load(Ordering::Acquire) {
            return None;
        }
        let (index, parked) = self.inner.free.lock(irql).pop()?;
        let entry = self.inner.entries.get(index as usize)?;
        Some(FrMr {
            pool: Arc::clone(&self.inner),
            index,
            mkey_base: entry.mkey_base,
            key: parked.key,
            state: if parked.registered {
                FrState::Stale
            } else {
                FrState::Free
            },
        })
    }

    /// MRs in the pool now.
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`.
    pub fn available(&self, irql: &impl LeDispatch) -> usize {
        self.inner.free.lock(irql).len()
    }

    /// Most pages one MR maps.
    pub fn max_pages(&self) -> u32 {
        self.inner.max_pages
    }

    /// Whether `mr` was taken from this pool (a consumer that keeps an MR
    /// between uses checks it still belongs to the current pool).
    ///
    /// # IRQL
    ///
    /// Any.
    pub fn owns(&self, mr: &FrMr<P>) -> bool {
        Arc::ptr_eq(&self.inner, &mr.pool)
    }

    /// Frees every mkey. Every MR must be back in the pool.
    ///
    /// # Errors
    ///
    /// [`VerbsError::InUse`] if MRs are still out; [`VerbsError::Closed`] if
    /// destroyed already.
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL` only.
    pub fn destroy(&self, irql: &Passive<'_>) -> Result<(), VerbsError> {
        if self.inner.free.lock(irql).len() != self.inner.entries.len() {
            return Err(VerbsError::InUse);
        }
        if self.inner.destroyed.swap(true, Ordering::AcqRel) {
            return Err(VerbsError::Closed);
        }
        let hca = &self.inner.pd.inner.device.hca;
        for e in self.inner.entries.iter() {
            hca.free_mkey(e.mkey_base)?;
        }
        Ok(())
    }
}

/// What the device holds for an [`FrMr`], as far as kverbs knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FrState {
    /// Invalid on the device: may be registered.
    Free,
    /// Registered (REG_MR posted) with this mapping.
    Registered {
        rkey: u32,
        iova: u64,
        length: u64,
        access: AccessFlags,
    },
    /// Came back to the pool registered: the next registration invalidates
    /// it first.
    Stale,
}

/// A fast-registration MR taken from an [`FrPool`]; returns to the pool on
/// drop (registered or not — see the module docs).
pub struct FrMr<P: Platform> {
    pool: Arc<FrPoolInner<P>>,
    index: u32,
    mkey_base: u32,
    key: u8,
    pub(crate) state: FrState,
}

impl<P: Platform> fmt::Debug for FrMr<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FrMr")
            .field("mkey", &(self.mkey_base | u32::from(self.key)))
            .field("state", &self.state)
            .finish()
    }
}

impl<P: Platform> FrMr<P> {
    /// The current key (lkey and rkey are the same on this device family).
    pub fn key(&self) -> u32 {
        self.mkey_base | u32::from(self.key)
    }

    /// The rkey while registered with remote access.
    pub fn rkey(&self) -> Option<u32> {
        match self.state {
            FrState::Registered { rkey, access, .. } if access.is_remote() => Some(rkey),
            _ => None,
        }
    }

    /// True while registered.
    pub fn is_registered(&self) -> bool {
        matches!(self.state, FrState::Registered { .. })
    }

    /// The registered region's I/O virtual address and length.
    pub fn region(&self) -> Option<(u64, u64)> {
        match self.state {
            FrState::Registered { iova, length, .. } => Some((iova, length)),
            _ => None,
        }
    }

    /// A local SGE over `offset..offset + len` of the registered region.
    pub fn sge(&self, offset: u64, len: u32) -> Option<Sge> {
        let (iova, length) = self.region()?;
        let end = offset.checked_add(u64::from(len))?;
        (end <= length).then(|| Sge {
            addr: iova + offset,
            len,
            lkey: self.key(),
        })
    }

    /// The peer invalidated `rkey` (a receive completed with invalidate):
    /// `true` if that is this MR's current key — the MR is then free — and
    /// `false` for any other key (a bogus invalidation: the protocol layer
    /// should treat the connection as broken, as iSER does).
    pub fn remote_invalidated(&mut self, rkey: u32) -> bool {
        match self.state {
            FrState::Registered { rkey: current, .. } if current == rkey => {
                self.state = FrState::Free;
                true
            }
            _ => false,
        }
    }

    /// Forgets a registration whose REG_MR was in a batch that was dropped
    /// uncommitted (the device never saw it).
    pub fn abandon_registration(&mut self) {
        if matches!(self.state, FrState::Registered { .. }) {
            self.state = FrState::Free;
        }
    }

    pub(crate) fn pool_pd_is(&self, pd: &Pd<P>) -> bool {
        Arc::ptr_eq(&self.pool.pd.inner, &pd.inner)
    }

    pub(crate) fn max_pages(&self) -> u32 {
        self.pool.max_pages
    }

    pub(crate) fn page_list(&self) -> Option<&DmaBuffer> {
        self.pool
            .entries
            .get(self.index as usize)
            .map(|e| &e.page_list)
    }

    /// Rotates the key byte for a new registration; returns the new key.
    pub(crate) fn rotate_key(&mut self) -> u32 {
        self.key = self.key.wrapping_add(1);
        self.key()
    }
}

impl<P: Platform> Drop for FrMr<P> {
    fn drop(&mut self) {
        let parked = FrParked {
            key: self.key,
            registered: !matches!(self.state, FrState::Free),
        };
        // Returning to the pool is a push within the capacity reserved at
        // creation (every entry has a slot): no allocation. A drop has no
        // token and may run at any IRQL <= DISPATCH_LEVEL: raise for the
        // lock.
        crate::interrupt::enter_dispatch::<P, _>(|d| {
            self.pool.free.lock(d).push((self.index, parked));
        });
    }
}
