//! The software HCA's objects other than QPs: completion queues and memory
//! regions (with every protection check).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use crate::cqe::{CQE_SIZE, Cqe, CqeOpcode, CqeRepr};
use crate::device::{AccessFlags, AsyncEvent, CqEventHandler};
use crate::dma::{DmaBacking, DmaError};
use crate::doorbell::{CqArm, CqDoorbellRecord, DoorbellRegister};
use crate::ring::CqRing;

use super::mem::{DeviceMem, PhysMemory, Region};
use super::payload::{Payload, Pinned};
use super::world::{Event, Outbox, Shared};

/// Index part of the reserved (physical, local-only) lkey.
pub const RESERVED_LKEY: u32 = 0x0000_0200;
/// First mkey index handed out.
pub(crate) const FIRST_MKEY_INDEX: u32 = 0x10;

/// What the event path needs of a CQ, shared with the delivery code.
pub(crate) struct CqShared {
    pub cqn: u32,
    pub handler: Arc<dyn CqEventHandler>,
    /// False once destroyed: no event is delivered after that.
    pub alive: AtomicBool,
    /// Last arm doorbell value with bit 63 set, or 0.
    pub pending_arm: AtomicU64,
    /// The device's CQE producer index (24 bits used), published after each
    /// CQE so an arm doorbell can tell, without the world lock, whether it
    /// must wake the device: only an arm with CQEs already past its consumer
    /// index fires at once; any later arm is applied by the next CQE push.
    pub produced: AtomicU32,
}

/// The CQ arm doorbell register.
pub(crate) struct CqDoorbell {
    pub cq: Arc<CqShared>,
    pub shared: std::sync::Weak<Shared>,
}

impl DoorbellRegister for CqDoorbell {
    fn write64(&self, value: u64) {
        let (_, cqn) = CqArm::from_doorbell_value(value);
        if cqn != self.cq.cqn {
            // A doorbell for another CQ on this register: hardware would arm
            // whatever CQ the value names; this device ignores it and counts it.
            if let Some(s) = self.shared.upgrade() {
                s.bad_doorbells.fetch_add(1, Ordering::Relaxed);
            }
            return;
        }
        let (arm, _) = CqArm::from_doorbell_value(value);
        // SeqCst store, then SeqCst load; the device does the mirror image
        // (`produced` stored SeqCst, then `pending_arm` swapped SeqCst in
        // `Cq::push`): either this load sees the CQE the arm must fire for,
        // and the device is woken to fire it, or the device's swap sees this
        // arm and fires it while pushing. An arm with nothing past its
        // consumer index needs no device work now, so it costs no wake-up
        // (one per CQ DPC before: the re-arm woke the device thread).
        self.cq
            .pending_arm
            .store(value | (1 << 63), Ordering::SeqCst);
        let produced = self.cq.produced.load(Ordering::SeqCst);
        if produced.wrapping_sub(arm.ci) & 0xff_ffff != 0 {
            if let Some(s) = self.shared.upgrade() {
                s.kick();
            }
        }
    }
}

pub(crate) struct Cq {
    pub shared: Arc<CqShared>,
    pub ring: CqRing<DeviceMem>,
    pub dbr: CqDoorbellRecord<DeviceMem>,
    /// Producer counter.
    pub pi: u32,
    pub armed: Option<CqArm>,
    pub last_fired_sn: Option<u8>,
    pub error: bool,
    /// QPs attached.
    pub users: u32,
}

impl Cq {
    fn outstanding(&self) -> u32 {
        self.pi.wrapping_sub(self.dbr.ci()) & 0xff_ffff
    }

    /// Applies a pending arm doorbell, if any.
    pub fn process_arm(&mut self, out: &mut Outbox) {
        let v = self.shared.pending_arm.swap(0, Ordering::SeqCst);
        if v & (1 << 63) == 0 {
            return;
        }
        let (arm, _) = CqArm::from_doorbell_value(v & !(1 << 63));
        if self.last_fired_sn == Some(arm.sn) {
            // A stale or duplicated arm for an event already delivered.
            return;
        }
        self.armed = Some(arm);
        // Arming with CQEs already past the armed consumer index fires at once.
        if self.pi.wrapping_sub(arm.ci) & 0xff_ffff != 0 {
            self.fire(out);
        }
    }

    /// Publishes the producer index to arm doorbells (SeqCst: see
    /// `CqDoorbell::write64`).
    fn publish_pi(&self) {
        self.shared.produced.store(self.pi, Ordering::SeqCst);
    }

    fn fire(&mut self, out: &mut Outbox) {
        if let Some(arm) = self.armed.take() {
            self.last_fired_sn = Some(arm.sn);
            out.events.push(Event::Completion(self.shared.clone()));
        }
    }

    /// Writes a CQE; `Err` if the CQ is in error or overflows (it then enters
    /// the error state and raises [`AsyncEvent::CqError`]).
    pub fn push(
        &mut self,
        repr: &CqeRepr,
        async_handler: &Option<Arc<dyn crate::device::AsyncEventHandler>>,
        out: &mut Outbox,
    ) -> Result<(), ()> {
        if self.error {
            return Err(());
        }
        if self.outstanding() >= self.ring.entries() || !self.ring.mem().alive() {
            self.error = true;
            if let Some(h) = async_handler {
                out.events.push(Event::Async(
                    h.clone(),
                    AsyncEvent::CqError {
                        cqn: self.shared.cqn,
                    },
                ));
            }
            return Err(());
        }
        let mut bytes = [0u8; CQE_SIZE];
        repr.emit(&mut Cqe::new_unchecked(&mut bytes[..]), false);
        if self.ring.write_cqe(self.pi, &bytes).is_err() {
            self.error = true;
            return Err(());
        }
        self.pi = self.pi.wrapping_add(1);
        self.publish_pi();
        // An arm doorbell that did not wake the device (see `CqDoorbell`)
        // takes effect here, before this CQE's own event check.
        self.process_arm(out);
        if let Some(arm) = self.armed {
            if !arm.solicited_only || repr.solicited || repr.opcode.is_error() {
                self.fire(out);
            }
        }
        Ok(())
    }

    /// Moves to a new ring (see `HcaDevice::resize_cq`).
    pub fn resize(&mut self, new_ring: CqRing<DeviceMem>) -> Result<(), crate::device::HcaError> {
        if self.outstanding() >= self.ring.entries() {
            return Err(crate::device::HcaError::Busy);
        }
        if self.outstanding() + 1 > new_ring.entries() {
            return Err(crate::device::HcaError::InvalidSize);
        }
        let resize = CqeRepr {
            opcode: CqeOpcode::ResizeCq,
            solicited: false,
            wqe_opcode: 0,
            qpn: 0,
            wqe_counter: 0,
            byte_cnt: 0,
            imm_inval_pkey: 0,
            src_qpn: 0,
            grh: false,
            syndrome: 0,
            vendor_syndrome: 0,
        };
        let mut bytes = [0u8; CQE_SIZE];
        resize.emit(&mut Cqe::new_unchecked(&mut bytes[..]), false);
        self.ring
            .write_cqe(self.pi, &bytes)
            .map_err(|_| crate::device::HcaError::InvalidSize)?;
        self.pi = self.pi.wrapping_add(1);
        self.publish_pi();
        self.ring = new_ring;
        Ok(())
    }
}

/// Why a key check failed (all map to protection errors).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum KeyError {
    /// No MR with that index, or a stale key byte.
    NoSuchKey,
    /// The MR is invalid (free fast-registration mkey, or invalidated).
    Invalid,
    /// Another PD.
    WrongPd,
    /// Rights missing.
    Access,
    /// Outside the region.
    Bounds,
    /// The reserved lkey used remotely.
    Reserved,
    /// Memory behind the MR is gone.
    Unmapped,
}

impl From<DmaError> for KeyError {
    fn from(_: DmaError) -> Self {
        Self::Unmapped
    }
}

pub(crate) struct Mr {
    pub index: u32,
    pub key: u8,
    pub pd: u32,
    /// `Some(max_pages)` for a fast-registration mkey.
    pub fast_reg: Option<u32>,
    pub valid: bool,
    pub iova: u64,
    pub length: u64,
    pub page_shift: u8,
    pub pages: Vec<u64>,
    pub access: AccessFlags,
    /// Moves on whenever what the key reaches may change (invalidation,
    /// fast registration, deregistration): an RDMA READ response made under
    /// the key, still on the wire by reference, is stale then (see
    /// [`super::payload`]).
    pub generation: Arc<AtomicU64>,
}

impl Drop for Mr {
    fn drop(&mut self) {
        self.retire();
    }
}

impl Mr {
    pub fn mkey(&self) -> u32 {
        (self.index << 8) | u32::from(self.key)
    }

    /// What the key reached so far may no longer be read by reference.
    pub fn retire(&self) {
        self.generation.fetch_add(1, Ordering::Relaxed);
    }

    /// Calls `f(phys, len, offset_in_request)` for each physically contiguous
    /// piece of `va..va+len` (bounds already checked).
    ///
    /// Pages that follow each other in physical memory as in the page list
    /// make one piece: a buffer registered from one allocation is a single
    /// piece however many pages it spans, so a 128 KiB transfer resolves
    /// its memory once instead of 32 times (each resolve takes the address
    /// map's lock and searches it). The checks are the same: the whole piece
    /// must lie in one live allocation, and allocations are never
    /// physically adjacent (an unmapped guard page follows each), so a run
    /// never merges two of them.
    fn walk(
        &self,
        va: u64,
        len: u64,
        mut f: impl FnMut(u64, usize, usize) -> Result<(), KeyError>,
    ) -> Result<(), KeyError> {
        let page_size = 1u64 << self.page_shift;
        let mask = page_size - 1;
        let mut off = (self.iova & mask) + (va - self.iova);
        let mut done = 0u64;
        while done < len {
            let mut page = usize::try_from(off >> self.page_shift).map_err(|_| KeyError::Bounds)?;
            let within = off & mask;
            let base = *self.pages.get(page).ok_or(KeyError::Bounds)?;
            let mut n = (page_size - within).min(len - done);
            // Extend over the following pages while they are the next
            // physical pages.
            let mut next = base.wrapping_add(page_size);
            while done + n < len {
                page += 1;
                match self.pages.get(page) {
                    Some(&p) if p == next => {
                        n += page_size.min(len - done - n);
                        next = next.wrapping_add(page_size);
                    }
                    _ => break,
                }
            }
            let piece = usize::try_from(n).map_err(|_| KeyError::Bounds)?;
            f(base + within, piece, done as usize)?;
            off += n;
            done += n;
        }
        Ok(())
    }
}

/// Resolves and checks a key. `remote` selects rkey rules (the reserved
/// lkey is never valid remotely).
pub(crate) fn check_key(
    mrs: &std::collections::BTreeMap<u32, Mr>,
    key: u32,
    pd: u32,
    need: AccessFlags,
    va: u64,
    len: u64,
    remote: bool,
) -> Result<Option<&Mr>, KeyError> {
    if key == RESERVED_LKEY {
        return if remote {
            Err(KeyError::Reserved)
        } else {
            Ok(None)
        };
    }
    let mr = mrs.get(&(key >> 8)).ok_or(KeyError::NoSuchKey)?;
    if u32::from(mr.key) != key & 0xff {
        return Err(KeyError::NoSuchKey);
    }
    if !mr.valid {
        return Err(KeyError::Invalid);
    }
    if mr.pd != pd {
        return Err(KeyError::WrongPd);
    }
    if !mr.access.contains(need) {
        return Err(KeyError::Access);
    }
    let end = va.checked_add(len).ok_or(KeyError::Bounds)?;
    if va < mr.iova || end > mr.iova.saturating_add(mr.length) {
        return Err(KeyError::Bounds);
    }
    Ok(Some(mr))
}

/// Reads `out.len()` bytes at `va` through `mr` (or physically for `None`).
pub(crate) fn mr_read(
    mem: &PhysMemory,
    mr: Option<&Mr>,
    va: u64,
    out: &mut [u8],
) -> Result<(), KeyError> {
    match mr {
        None => Ok(mem.read(va, out)?),
        Some(mr) => mr.walk(va, out.len() as u64, |pa, n, at| {
            let dst = out.get_mut(at..at + n).ok_or(KeyError::Bounds)?;
            Ok(mem.read(pa, dst)?)
        }),
    }
}

/// Writes `data` at `va` through `mr` (or physically for `None`).
pub(crate) fn mr_write(
    mem: &PhysMemory,
    mr: Option<&Mr>,
    va: u64,
    data: Payload<'_>,
) -> Result<(), KeyError> {
    match mr {
        None => Ok(mem.write_payload(va, data)?),
        Some(mr) => mr.walk(va, data.len() as u64, |pa, n, at| {
            let src = data.sub(at, n).ok_or(KeyError::Bounds)?;
            Ok(mem.write_payload(pa, src)?)
        }),
    }
}

/// Where the rest of a multi-packet RDMA WRITE lands, resolved once at its
/// first packet: the one live region its whole range (checked against the
/// rkey then) lies in. Each later packet is placed through it only while
/// the MR is exactly as it was (its generation moves on invalidation, fast
/// registration and deregistration) and the region is not released; any
/// change sends the packet back to the full key check and resolve, so a
/// packet never reaches memory the key no longer grants. Saves the key
/// lookup, page walk and address-map search of every packet after the
/// first (31 of the 32 packets of a 128 KiB WRITE).
pub(crate) struct WriteTarget {
    region: Arc<Region>,
    /// Offset in `region` of the next byte of the message.
    offset: usize,
    /// Bytes of the message not placed yet.
    left: usize,
    generation: Arc<AtomicU64>,
    seen: u64,
}

impl WriteTarget {
    /// The target of `va..va + len` through `mr` (bounds and rights
    /// already checked), if it is one physically contiguous piece of live
    /// memory; `None` otherwise (the packets then take the full path).
    pub fn resolve(mem: &PhysMemory, mr: &Mr, va: u64, len: u64) -> Option<Self> {
        let seen = mr.generation.load(Ordering::Relaxed);
        let mut piece = None;
        mr.walk(va, len, |pa, n, _| match piece {
            None => {
                piece = Some((pa, n));
                Ok(())
            }
            // More than one piece: not worth caching.
            Some(_) => Err(KeyError::Bounds),
        })
        .ok()?;
        let (pa, n) = piece?;
        let (region, offset) = mem.resolve(pa, n).ok()?;
        Some(Self {
            region,
            offset,
            left: n,
            generation: mr.generation.clone(),
            seen,
        })
    }

    /// Places `data` as the message's next bytes, if the MR is unchanged,
    /// the region live and the bytes within the message; `None` if the
    /// packet must take the full check instead.
    pub fn place(&mut self, data: Payload<'_>) -> Option<Result<(), KeyError>> {
        let n = data.len();
        if self.generation.load(Ordering::Relaxed) != self.seen
            || self.region.is_released()
            || n > self.left
        {
            return None;
        }
        let placed = data.write_to(self.region.words(), self.region.len(), self.offset);
        if placed.is_ok() {
            self.offset += n;
            self.left -= n;
        }
        Some(placed.map_err(KeyError::from))
    }
}

/// Pins the memory of `va..va + len` through `mr` (or physically for
/// `None`) onto the end of `pinned`: what a read of it would read, by
/// reference (see [`super::payload`]).
pub(crate) fn mr_pin(
    mem: &PhysMemory,
    mr: Option<&Mr>,
    va: u64,
    len: usize,
    pinned: &mut Pinned,
) -> Result<(), KeyError> {
    if len == 0 {
        return Ok(());
    }
    let mut pin = |pa: u64, n: usize| -> Result<(), KeyError> {
        let (region, off) = mem.resolve(pa, n)?;
        pinned.push(region, off, n);
        Ok(())
    };
    match mr {
        None => pin(va, len),
        Some(mr) => mr.walk(va, len as u64, |pa, n, _| pin(pa, n)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mr(iova: u64, pages: Vec<u64>) -> Mr {
        Mr {
            index: FIRST_MKEY_INDEX,
            key: 0,
            pd: 1,
            fast_reg: None,
            valid: true,
            iova,
            length: (pages.len() as u64) << 12,
            page_shift: 12,
            pages,
            access: AccessFlags::LOCAL_WRITE,
            generation: Arc::default(),
        }
    }

    fn pieces(mr: &Mr, va: u64, len: u64) -> Vec<(u64, usize, usize)> {
        let mut out = Vec::new();
        mr.walk(va, len, |pa, n, at| {
            out.push((pa, n, at));
            Ok(())
        })
        .unwrap();
        out
    }

    #[test]
    fn walk_merges_physically_contiguous_pages_only() {
        // Pages 0-1 contiguous, then a jump, then 3-4 contiguous, then the
        // same page twice (never merged: the second is not the next page).
        let pages = vec![0x10_000, 0x11_000, 0x40_000, 0x41_000, 0x50_000, 0x50_000];
        let m = mr(0x7000_0800, pages);
        let all = pieces(&m, 0x7000_0800, 6 * 4096 - 0x800);
        assert_eq!(
            all,
            [
                (0x10_800, 0x1800, 0),
                (0x40_000, 0x2000, 0x1800),
                (0x50_000, 0x1000, 0x3800),
                (0x50_000, 0x1000, 0x4800),
            ]
        );
        // A range starting and ending inside pages.
        assert_eq!(pieces(&m, 0x7000_0900, 0x1000), [(0x10_900, 0x1000, 0)]);
        assert_eq!(
            pieces(&m, 0x7000_1f00, 0x300),
            [(0x11_f00, 0x100, 0), (0x40_000, 0x200, 0x100)]
        );
        // The pieces always cover the range exactly, in order.
        for (va, len) in [
            (0x7000_0800u64, 1u64),
            (0x7000_1000, 0x3000),
            (0x7000_27ff, 0x2802),
        ] {
            let p = pieces(&m, va, len);
            assert_eq!(p.iter().map(|x| x.1 as u64).sum::<u64>(), len);
            let mut at = 0;
            for (_, n, off) in p {
                assert_eq!(off, at);
                at += n;
            }
        }
    }

    #[test]
    fn reads_and_writes_through_merged_pages_match_the_memory() {
        let mem = PhysMemory::new(1 << 20);
        let a = mem.alloc(3 * 4096).unwrap();
        let b = mem.alloc(4096).unwrap();
        let pa = a.phys_addr().get();
        let pb = b.phys_addr().get();
        // a's pages 0 and 1, b, a's page 2: two merged runs split by b.
        let m = mr(0x1000, vec![pa, pa + 4096, pb, pa + 8192]);
        let data: Vec<u8> = (0..4 * 4096u32).map(|i| (i % 251) as u8).collect();
        mr_write(&mem, Some(&m), 0x1000 + 5, Payload::Bytes(&data[5..])).unwrap();
        let mut back = vec![0u8; data.len() - 5];
        mr_read(&mem, Some(&m), 0x1000 + 5, &mut back).unwrap();
        assert_eq!(back, data[5..]);
        let mut first = vec![0u8; 8192 - 5];
        a.read(5, &mut first).unwrap();
        assert_eq!(first, data[5..8192]);
        let mut third = vec![0u8; 4096];
        b.read(0, &mut third).unwrap();
        assert_eq!(third, data[8192..12288]);
        // A page list that runs on into the guard page after `b` fails as a
        // whole piece.
        let bad = mr(0x1000, vec![pb, pb + 4096]);
        assert_eq!(
            mr_write(&mem, Some(&bad), 0x1000, Payload::Bytes(&data[..8192])),
            Err(KeyError::Unmapped)
        );
    }
}
