//! The host model's request block: what a test asks for ([`RequestSpec`]),
//! where its data lives (simulated physical memory, in the scatter/gather
//! shape the test chose), and the handle the miniport holds ([`HostSrb`]).

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use hca_lowlevel::dma::{DmaBuffer, DmaError};
use hca_lowlevel::sim::{PAGE_SIZE, PhysMemory};

use super::ModelShared;
use super::check::ModelViolation;
use crate::storport::{
    AbortTarget, Address, DataAccessError, DataDirection, PnpAction, QueueAction, SgElement, Srb,
    SrbFunction, SrbIdentity, SrbStatus,
};

/// How a request's data buffer is laid out in physical memory — the shapes
/// the initiator's memory registration must cope with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SgShape {
    /// One physically contiguous, page-aligned segment.
    Contiguous,
    /// One segment per 4 KiB page, each page somewhere else.
    Pages,
    /// Segments of random (seeded) odd lengths, each starting at an odd
    /// offset into its own allocation.
    Odd {
        /// Seed of the split.
        seed: u64,
    },
}

/// What a test asks StorPort to send the miniport.
#[derive(Debug, Clone)]
pub struct RequestSpec {
    /// The `SRB_FUNCTION_*`.
    pub function: SrbFunction,
    /// Bus, target, LUN.
    pub address: Address,
    /// The CDB (at most 32 bytes are kept).
    pub cdb: Vec<u8>,
    /// `SrbFlags` direction.
    pub direction: DataDirection,
    /// `DataTransferLength`.
    pub data_len: u32,
    /// Initial buffer contents (zeros if `None`; truncated or padded to
    /// `data_len`).
    pub data: Option<Vec<u8>>,
    /// `SenseInfoBufferLength`.
    pub sense_len: u8,
    /// Layout of the data buffer.
    pub sg_shape: SgShape,
    /// Task attribute.
    pub queue_action: QueueAction,
    /// `TimeOutValue`, seconds.
    pub timeout_secs: u32,
    /// For ABORT_COMMAND: the request to abort.
    pub abort_target: Option<u32>,
    /// For PNP: the action.
    pub pnp_action: Option<PnpAction>,
}

impl RequestSpec {
    /// A SCSI command with no data.
    #[must_use]
    pub fn scsi(address: Address, cdb: &[u8]) -> Self {
        Self {
            function: SrbFunction::ExecuteScsi,
            address,
            cdb: cdb.to_vec(),
            direction: DataDirection::None,
            data_len: 0,
            data: None,
            sense_len: 18,
            sg_shape: SgShape::Contiguous,
            queue_action: QueueAction::Simple,
            timeout_secs: 10,
            abort_target: None,
            pnp_action: None,
        }
    }

    /// A SCSI command reading `len` bytes.
    #[must_use]
    pub fn scsi_in(address: Address, cdb: &[u8], len: u32) -> Self {
        Self {
            direction: DataDirection::In,
            data_len: len,
            ..Self::scsi(address, cdb)
        }
    }

    /// A SCSI command writing `data`.
    #[must_use]
    pub fn scsi_out(address: Address, cdb: &[u8], data: Vec<u8>) -> Self {
        Self {
            direction: DataDirection::Out,
            data_len: u32::try_from(data.len()).unwrap_or(u32::MAX),
            data: Some(data),
            ..Self::scsi(address, cdb)
        }
    }

    /// A non-SCSI function addressed to `address`.
    #[must_use]
    pub fn function(function: SrbFunction, address: Address) -> Self {
        Self {
            function,
            cdb: Vec::new(),
            ..Self::scsi(address, &[])
        }
    }

    /// An ABORT_COMMAND for request `victim`.
    #[must_use]
    pub fn abort(address: Address, victim: u32) -> Self {
        Self {
            abort_target: Some(victim),
            ..Self::function(SrbFunction::AbortCommand, address)
        }
    }

    /// With a data buffer shaped `shape`.
    #[must_use]
    pub fn shaped(mut self, shape: SgShape) -> Self {
        self.sg_shape = shape;
        self
    }

    /// With `TimeOutValue` = `secs`.
    #[must_use]
    pub fn timeout(mut self, secs: u32) -> Self {
        self.timeout_secs = secs;
        self
    }
}

/// One physically contiguous piece of a data buffer: `len` bytes at
/// offset `pad` of its own allocation.
pub(crate) struct Segment {
    buffer: DmaBuffer,
    pad: usize,
    len: u32,
}

/// Where a request's scatter/gather list is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SgState {
    NotBuilt,
    Held,
    Released,
}

/// A request's contents; travels with the handle while the miniport holds
/// it, and rests in the model's table otherwise.
pub(crate) struct SrbBody {
    pub(crate) function: SrbFunction,
    pub(crate) address: Address,
    cdb: [u8; 32],
    cdb_len: usize,
    pub(crate) direction: DataDirection,
    pub(crate) data_transfer_length: u32,
    pub(crate) srb_status: SrbStatus,
    pub(crate) scsi_status: u8,
    pub(crate) sense: Box<[u8]>,
    pub(crate) sense_len: u8,
    segments: Vec<Segment>,
    sg: Vec<SgElement>,
    pub(crate) sg_state: SgState,
    queue_action: QueueAction,
    pub(crate) timeout_secs: u32,
    abort_target: Option<u32>,
    pnp_action: Option<PnpAction>,
}

/// A tiny deterministic generator for buffer shapes (xorshift64*).
struct Shuffle(u64);

impl Shuffle {
    fn next(&mut self) -> u64 {
        let mut x = self.0 | 1;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

fn segment_lengths(total: u32, shape: SgShape) -> Vec<(usize, u32)> {
    let mut out = Vec::new();
    if total == 0 {
        return out;
    }
    match shape {
        SgShape::Contiguous => out.push((0, total)),
        SgShape::Pages => {
            let page = u32::try_from(PAGE_SIZE).unwrap_or(4096);
            let mut left = total;
            while left > 0 {
                let n = left.min(page);
                out.push((0, n));
                left -= n;
            }
        }
        SgShape::Odd { seed } => {
            let mut rng = Shuffle(seed ^ u64::from(total).rotate_left(17));
            let mut left = total;
            while left > 0 {
                // Odd lengths between 1 and ~3 pages, odd start offsets.
                let want = u32::try_from(rng.next() % 12_000).unwrap_or(1) | 1;
                let n = left.min(want);
                let pad = usize::try_from(rng.next() % 4000).unwrap_or(1) | 1;
                out.push((pad, n));
                left -= n;
            }
        }
    }
    out
}

impl SrbBody {
    pub(crate) fn new(spec: &RequestSpec, memory: &PhysMemory) -> Result<Self, DmaError> {
        let mut cdb = [0u8; 32];
        let cdb_len = spec.cdb.len().min(cdb.len());
        if let (Some(dst), Some(src)) = (cdb.get_mut(..cdb_len), spec.cdb.get(..cdb_len)) {
            dst.copy_from_slice(src);
        }
        let mut segments = Vec::new();
        let mut sg = Vec::new();
        for (pad, len) in segment_lengths(spec.data_len, spec.sg_shape) {
            let buffer = memory.alloc(pad + len as usize)?;
            let phys = buffer
                .phys_addr()
                .checked_add(pad as u64)
                .ok_or(DmaError::OutOfBounds)?;
            sg.push(SgElement { phys, len });
            segments.push(Segment { buffer, pad, len });
        }
        let body = Self {
            function: spec.function,
            address: spec.address,
            cdb,
            cdb_len,
            direction: spec.direction,
            data_transfer_length: spec.data_len,
            srb_status: SrbStatus::PENDING,
            scsi_status: 0,
            sense: vec![0u8; usize::from(spec.sense_len)].into_boxed_slice(),
            sense_len: spec.sense_len,
            segments,
            sg,
            sg_state: SgState::NotBuilt,
            queue_action: spec.queue_action,
            timeout_secs: spec.timeout_secs,
            abort_target: spec.abort_target,
            pnp_action: spec.pnp_action,
        };
        if let Some(data) = &spec.data {
            let n = data.len().min(spec.data_len as usize);
            if let Some(data) = data.get(..n) {
                body.write(0, data).map_err(|_| DmaError::OutOfBounds)?;
            }
        }
        Ok(body)
    }

    /// Makes a completed request's body new again for
    /// [`super::StorPortModel::reissue`]: new address, CDB and direction,
    /// the whole buffer to transfer, nothing set by the last completion
    /// left.
    pub(crate) fn rearm(&mut self, address: Address, cdb: &[u8], direction: DataDirection) {
        self.address = address;
        let n = cdb.len().min(self.cdb.len());
        self.cdb = [0; 32];
        if let (Some(dst), Some(src)) = (self.cdb.get_mut(..n), cdb.get(..n)) {
            dst.copy_from_slice(src);
        }
        self.cdb_len = n;
        self.direction = direction;
        self.data_transfer_length = u32::try_from(self.buffer_len()).unwrap_or(u32::MAX);
        self.srb_status = SrbStatus::PENDING;
        self.scsi_status = 0;
        self.sense.fill(0);
        self.sense_len = u8::try_from(self.sense.len()).unwrap_or(u8::MAX);
        self.sg_state = SgState::NotBuilt;
    }

    /// Bytes of the whole data buffer (its allocated size).
    pub(crate) fn buffer_len(&self) -> u64 {
        self.segments.iter().map(|s| u64::from(s.len)).sum()
    }

    pub(crate) fn sg_list(&self) -> &[SgElement] {
        &self.sg
    }

    pub(crate) fn cdb(&self) -> &[u8] {
        self.cdb.get(..self.cdb_len).unwrap_or(&[])
    }

    fn locate(&self, offset: u64, len: usize) -> Result<(), DataAccessError> {
        let end = offset
            .checked_add(len as u64)
            .ok_or(DataAccessError::OutOfBounds)?;
        if end > self.buffer_len() {
            return Err(DataAccessError::OutOfBounds);
        }
        Ok(())
    }

    /// Walks the segments covering `offset..offset + len`, calling `f` with
    /// (segment, offset in its buffer, range in the caller's slice).
    fn walk(
        &self,
        offset: u64,
        len: usize,
        mut f: impl FnMut(&Segment, usize, core::ops::Range<usize>) -> Result<(), DataAccessError>,
    ) -> Result<(), DataAccessError> {
        self.locate(offset, len)?;
        let mut base = 0u64;
        let mut done = 0usize;
        for segment in &self.segments {
            if done == len {
                break;
            }
            let seg_end = base + u64::from(segment.len);
            let at = offset + done as u64;
            if at < seg_end {
                let within =
                    usize::try_from(at - base).map_err(|_| DataAccessError::OutOfBounds)?;
                let n = (segment.len as usize - within).min(len - done);
                f(segment, segment.pad + within, done..done + n)?;
                done += n;
            }
            base = seg_end;
        }
        Ok(())
    }

    pub(crate) fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), DataAccessError> {
        let len = out.len();
        self.walk(offset, len, |segment, at, range| {
            let dst = out.get_mut(range).ok_or(DataAccessError::OutOfBounds)?;
            segment
                .buffer
                .read(at, dst)
                .map_err(|_| DataAccessError::Unmapped)
        })
    }

    pub(crate) fn write(&self, offset: u64, data: &[u8]) -> Result<(), DataAccessError> {
        self.walk(offset, data.len(), |segment, at, range| {
            let src = data.get(range).ok_or(DataAccessError::OutOfBounds)?;
            segment
                .buffer
                .write(at, src)
                .map_err(|_| DataAccessError::Unmapped)
        })
    }
}

/// The miniport's handle on one request (the model's `StorPort::Srb`).
///
/// Move-only; completing it through the port consumes it. Dropping one
/// without completing it is recorded as
/// [`ModelViolation::DroppedWithoutCompletion`].
pub struct HostSrb {
    pub(crate) shared: Arc<ModelShared>,
    pub(crate) index: u32,
    pub(crate) generation: u32,
    pub(crate) body: Option<Box<SrbBody>>,
}

impl core::fmt::Debug for HostSrb {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("HostSrb")
            .field("index", &self.index)
            .field("generation", &self.generation)
            .finish_non_exhaustive()
    }
}

impl HostSrb {
    /// A second handle to the same request, for negative tests of the
    /// model: completing both is exactly the bug (a stale pointer kept by a
    /// C miniport) the model must catch. It carries no contents.
    #[must_use]
    pub fn duplicate_for_fault_injection(&self) -> HostSrb {
        HostSrb {
            shared: self.shared.clone(),
            index: self.index,
            generation: self.generation,
            body: None,
        }
    }

    /// The model's index of this request (what `StorPortModel` calls its
    /// request id).
    #[must_use]
    pub fn request_index(&self) -> u32 {
        self.index
    }
}

impl Drop for HostSrb {
    fn drop(&mut self) {
        if let Some(body) = self.body.take() {
            self.shared
                .checker
                .record(ModelViolation::DroppedWithoutCompletion {
                    request: self.index,
                });
            self.shared.park_dropped(self.index, body);
        }
    }
}

const NO_EXTENSION: &[AtomicU64] = &[];

impl Srb for HostSrb {
    fn identity(&self) -> SrbIdentity {
        SrbIdentity(u64::from(self.index))
    }

    fn function(&self) -> SrbFunction {
        self.body
            .as_ref()
            .map_or(SrbFunction::Other(0xFF), |b| b.function)
    }

    fn address(&self) -> Address {
        self.body
            .as_ref()
            .map_or(Address::new(0xFF, 0xFF, 0xFF), |b| b.address)
    }

    fn cdb(&self) -> &[u8] {
        self.body.as_ref().map_or(&[], |b| b.cdb())
    }

    fn direction(&self) -> DataDirection {
        self.body
            .as_ref()
            .map_or(DataDirection::None, |b| b.direction)
    }

    fn data_transfer_length(&self) -> u32 {
        self.body.as_ref().map_or(0, |b| b.data_transfer_length)
    }

    fn set_data_transfer_length(&mut self, len: u32) {
        if let Some(b) = self.body.as_mut() {
            b.data_transfer_length = len;
        }
    }

    fn srb_status(&self) -> SrbStatus {
        self.body
            .as_ref()
            .map_or(SrbStatus::PENDING, |b| b.srb_status)
    }

    fn set_srb_status(&mut self, status: SrbStatus) {
        if let Some(b) = self.body.as_mut() {
            b.srb_status = status;
        }
    }

    fn scsi_status(&self) -> u8 {
        self.body.as_ref().map_or(0, |b| b.scsi_status)
    }

    fn set_scsi_status(&mut self, status: u8) {
        if let Some(b) = self.body.as_mut() {
            b.scsi_status = status;
        }
    }

    fn sense_buffer(&mut self) -> &mut [u8] {
        match self.body.as_mut() {
            Some(b) => &mut b.sense,
            None => &mut [],
        }
    }

    fn set_sense_length(&mut self, len: u8) {
        if let Some(b) = self.body.as_mut() {
            let cap = u8::try_from(b.sense.len()).unwrap_or(u8::MAX);
            b.sense_len = len.min(cap);
        }
    }

    fn read_data(&self, offset: u32, out: &mut [u8]) -> Result<(), DataAccessError> {
        let body = self.body.as_ref().ok_or(DataAccessError::OutOfBounds)?;
        body.read(u64::from(offset), out)
    }

    fn write_data(&mut self, offset: u32, data: &[u8]) -> Result<(), DataAccessError> {
        let body = self.body.as_ref().ok_or(DataAccessError::OutOfBounds)?;
        body.write(u64::from(offset), data)
    }

    fn scatter_gather(&self) -> Option<&[SgElement]> {
        let body = self.body.as_ref()?;
        (body.sg_state == SgState::Held).then(|| body.sg_list())
    }

    fn extension(&self) -> &[AtomicU64] {
        self.shared.extension(self.index).unwrap_or(NO_EXTENSION)
    }

    fn queue_action(&self) -> QueueAction {
        self.body
            .as_ref()
            .map_or(QueueAction::Simple, |b| b.queue_action)
    }

    fn queue_tag(&self) -> u8 {
        // StorPort hands out tags per LUN; the model numbers them by
        // request, which is as unique while outstanding.
        self.index.to_le_bytes()[0]
    }

    fn timeout_secs(&self) -> u32 {
        self.body.as_ref().map_or(0, |b| b.timeout_secs)
    }

    fn abort_target(&self) -> Option<AbortTarget<'_>> {
        let victim = self.body.as_ref()?.abort_target?;
        let extension = self.shared.extension(victim)?;
        Some(AbortTarget {
            identity: SrbIdentity(u64::from(victim)),
            extension,
        })
    }

    fn pnp_action(&self) -> Option<PnpAction> {
        self.body.as_ref()?.pnp_action
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_cover_the_length_exactly() {
        for total in [1u32, 511, 4096, 4097, 65536, 100_003] {
            for shape in [
                SgShape::Contiguous,
                SgShape::Pages,
                SgShape::Odd { seed: 7 },
                SgShape::Odd { seed: 99 },
            ] {
                let parts = segment_lengths(total, shape);
                assert_eq!(
                    parts.iter().map(|p| u64::from(p.1)).sum::<u64>(),
                    u64::from(total),
                    "{shape:?} {total}"
                );
                assert!(parts.iter().all(|p| p.1 > 0));
                if let SgShape::Odd { .. } = shape {
                    assert!(parts.iter().all(|p| p.0 % 2 == 1), "odd offsets");
                }
            }
        }
        assert!(segment_lengths(0, SgShape::Pages).is_empty());
    }

    #[test]
    fn scattered_buffer_reads_back_what_was_written() {
        let memory = PhysMemory::new(1 << 24);
        let data: Vec<u8> = (0..50_000u32).map(|i| (i * 7 % 251) as u8).collect();
        for shape in [SgShape::Pages, SgShape::Odd { seed: 3 }] {
            let spec =
                RequestSpec::scsi_out(Address::new(0, 0, 0), &[0x2a], data.clone()).shaped(shape);
            let body = SrbBody::new(&spec, &memory).unwrap();
            assert!(body.sg_list().len() > 1);
            let mut back = vec![0u8; data.len()];
            body.read(0, &mut back).unwrap();
            assert_eq!(back, data);
            // Through physical memory, as the HCA sees it.
            let mut via_phys = Vec::new();
            for e in body.sg_list() {
                let mut piece = vec![0u8; e.len as usize];
                memory.read(e.phys.get(), &mut piece).unwrap();
                via_phys.extend_from_slice(&piece);
            }
            assert_eq!(via_phys, data);
            let mut tail = [0u8; 10];
            body.read(49_990, &mut tail).unwrap();
            assert_eq!(&tail[..], &data[49_990..]);
            assert_eq!(
                body.read(49_995, &mut tail),
                Err(DataAccessError::OutOfBounds)
            );
        }
    }
}
