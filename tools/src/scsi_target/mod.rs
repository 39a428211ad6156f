//! A RAM-disk SCSI target: the device server behind the software SRP and
//! iSER targets, independent of the transport.
//!
//! A [`ScsiTarget`] is a set of logical units ([`LogicalUnit`]) with
//! sparse, chunk-locked storage. A transport calls [`ScsiTarget::execute`]
//! once per command, from any thread (the software targets run one thread
//! per channel), with a [`Request`]:
//!
//! * the LUN and CDB as received;
//! * the data-out, already fetched ([`DataOut`]): bytes (iSCSI collects
//!   immediate and Data-Out PDUs; SRP immediate data), or the registered
//!   memory the SRP target's RDMA READs landed in, which a WRITE copies
//!   straight into the store's chunk (one copy on the target);
//! * the initiator's data-in capacity (the SRP data-in descriptor length,
//!   the iSCSI expected data transfer length);
//!
//! and a data-in sink that receives the answer in pieces. For READ the
//! pieces are slices of the store itself, handed over under the chunk's
//! read lock, so a transport can RDMA-WRITE (or copy) them straight out
//! without an intermediate buffer. The [`Response`] carries status, sense
//! (already in the unit's format), the bytes sent, and both residuals as
//! SRP and iSCSI report them.
//!
//! What the device server implements (SPC-4, SBC-3):
//! INQUIRY (standard data; VPD 0x00, 0x80, 0x83, 0xB0, 0xB1, 0xB2), READ
//! CAPACITY(10/16), READ and WRITE(6/10/12/16), VERIFY(10/12/16) with
//! BYTCHK 0, 1 and 3, SYNCHRONIZE CACHE(10/16), TEST UNIT READY, REPORT
//! LUNS, MODE SENSE(6/10) (caching and control pages, all pages), REQUEST
//! SENSE, UNMAP. Everything else gets CHECK CONDITION, ILLEGAL REQUEST,
//! INVALID COMMAND OPERATION CODE.
//!
//! Rules followed, in the order they are checked:
//!
//! 1. Armed [fault hooks](FaultHooks) come first.
//! 2. A LUN that does not exist: REPORT LUNS works as on any LUN, standard
//!    INQUIRY answers peripheral qualifier 011b / type 1Fh, REQUEST SENSE
//!    returns GOOD with ILLEGAL REQUEST / LOGICAL UNIT NOT SUPPORTED in its
//!    data, everything else (INQUIRY with EVPD included) is CHECK CONDITION,
//!    ILLEGAL REQUEST, LOGICAL UNIT NOT SUPPORTED (SPC-4 4.5.1 and 6.4.2).
//! 3. Unknown opcode or service action: INVALID COMMAND OPERATION CODE, or
//!    INVALID FIELD IN CDB for an unknown SERVICE ACTION IN(16) action.
//! 4. NACA or LINK set in the control byte: INVALID FIELD IN CDB (no ACA, no
//!    linked commands).
//! 5. Per-command field checks: INVALID FIELD IN CDB with a field pointer.
//! 6. LBA range: LOGICAL BLOCK ADDRESS OUT OF RANGE.
//! 7. Write protection: DATA PROTECT, WRITE PROTECTED.
//! 8. Data-out shorter than the command needs: INVALID FIELD IN COMMAND
//!    INFORMATION UNIT, with a data-out overflow residual.
//!
//! Allocation lengths truncate byte-wise (the header's length fields still
//! describe the whole answer); an allocation length of zero is not an
//! error. Data-in is further capped by the initiator's capacity: the
//! residual is an overflow when the command had more to send than the
//! buffer holds, an underflow when it sent less than the buffer holds.

mod commands;
pub mod fault;
pub mod lu;
pub mod pages;
pub mod store;

#[cfg(test)]
mod tests;

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;

use hca_lowlevel::dma::DmaBuffer;

use storport_srp::scsi::{Lun, SenseFormat, SenseRepr, Status};
use storport_srp::wire::Residual;

pub use fault::{FaultAction, FaultFilter, FaultHooks, FaultRule};
pub use lu::{
    BlockSize, ConfigError, LogicalUnit, LuStatsSnapshot, LunConfig, MAX_LUNS, RangeError,
};
pub use store::{BlockStore, Extent, ExtentError, StorePin};

/// Where a command's data-in goes: built answers as bytes, and media data
/// either as bytes (the default) or, for a transport that can send from
/// the store's own memory, however it takes it.
pub trait DataInSink {
    /// The next `piece` of data-in.
    fn bytes(&mut self, piece: &[u8]);

    /// The next `len` bytes of data-in are the store's at `offset`.
    /// Returns `false` to decline (only when `nonblocking`: a lock is held
    /// or the transport cannot take it now); the command is then not
    /// counted and runs again on a thread. The default copies the bytes
    /// into [`Self::bytes`].
    fn store_range(
        &mut self,
        store: &BlockStore,
        offset: u64,
        len: u64,
        nonblocking: bool,
    ) -> bool {
        let mut sink = |piece: &[u8]| self.bytes(piece);
        if nonblocking {
            store.try_read(offset, len, &mut sink)
        } else {
            store.read(offset, len, &mut sink);
            true
        }
    }
}

impl<F: FnMut(&[u8])> DataInSink for F {
    fn bytes(&mut self, piece: &[u8]) {
        self(piece);
    }
}

/// A command's data-out, where the transport holds it.
#[derive(Debug, Clone, Copy)]
pub enum DataOut<'a> {
    /// Bytes in memory (immediate data, iSCSI PDUs, tests).
    Bytes(&'a [u8]),
    /// Device memory: the SRP target's staging buffer after its RDMA
    /// READs. A WRITE copies it straight into the store's chunks, with no
    /// intermediate buffer; built by [`DataOut::dma`].
    Dma(DmaData<'a>),
}

/// Bytes `offset..offset + len` of a DMA buffer, checked to lie inside it
/// when built, so copying them out cannot fail.
#[derive(Debug, Clone, Copy)]
pub struct DmaData<'a> {
    buf: &'a DmaBuffer,
    offset: usize,
    len: usize,
}

impl<'a> DmaData<'a> {
    /// The buffer.
    pub(crate) fn buf(&self) -> &'a DmaBuffer {
        self.buf
    }

    /// Where the bytes start in [`Self::buf`].
    pub(crate) fn offset(&self) -> usize {
        self.offset
    }
}

impl<'a> DataOut<'a> {
    /// The first `len` bytes of `buf`; `None` if it is shorter.
    pub fn dma(buf: &'a DmaBuffer, len: usize) -> Option<Self> {
        (len <= buf.len()).then_some(Self::Dma(DmaData {
            buf,
            offset: 0,
            len,
        }))
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self {
            Self::Bytes(bytes) => bytes.len(),
            Self::Dma(d) => d.len,
        }
    }

    /// True if there are no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The first `len` bytes; `None` if there are fewer.
    pub fn prefix(self, len: usize) -> Option<Self> {
        Some(self.split_at(len)?.0)
    }

    /// The bytes before `mid` and from `mid` on; `None` if `mid` is past
    /// the end.
    pub fn split_at(self, mid: usize) -> Option<(Self, Self)> {
        match self {
            Self::Bytes(bytes) => {
                let (head, tail) = bytes.split_at_checked(mid)?;
                Some((Self::Bytes(head), Self::Bytes(tail)))
            }
            Self::Dma(d) => {
                let rest = d.len.checked_sub(mid)?;
                let head = DmaData { len: mid, ..d };
                let tail = DmaData {
                    offset: d.offset + mid,
                    len: rest,
                    ..d
                };
                Some((Self::Dma(head), Self::Dma(tail)))
            }
        }
    }

    /// The bytes as a slice: borrowed, or (device memory; VERIFY and UNMAP
    /// only, never a WRITE) copied out.
    pub fn to_bytes(self) -> Cow<'a, [u8]> {
        match self {
            Self::Bytes(bytes) => Cow::Borrowed(bytes),
            Self::Dma(d) => {
                let mut out = vec![0u8; d.len];
                // In range: checked when `d` was built.
                let _ = d.buf.read(d.offset, &mut out);
                Cow::Owned(out)
            }
        }
    }
}

impl<'a> From<&'a [u8]> for DataOut<'a> {
    fn from(bytes: &'a [u8]) -> Self {
        Self::Bytes(bytes)
    }
}

/// One SCSI command as the transport received it.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// The LUN (8 bytes, SAM encoding).
    pub lun: Lun,
    /// The CDB; trailing bytes past the opcode's CDB length are ignored
    /// (SRP and iSCSI carry 16 bytes).
    pub cdb: &'a [u8],
    /// The data-out, fetched from the initiator before the call.
    pub data_out: Option<DataOut<'a>>,
    /// How many data-in bytes the initiator can take.
    pub data_in_capacity: u32,
}

impl<'a> Request<'a> {
    /// A command without data-out.
    pub fn new(lun: Lun, cdb: &'a [u8], data_in_capacity: u32) -> Self {
        Self {
            lun,
            cdb,
            data_out: None,
            data_in_capacity,
        }
    }

    /// A command with data-out.
    pub fn with_data_out(lun: Lun, cdb: &'a [u8], data_out: &'a [u8]) -> Self {
        Self {
            lun,
            cdb,
            data_out: Some(DataOut::Bytes(data_out)),
            data_in_capacity: 0,
        }
    }
}

/// Sense bytes as they go on the wire (at most 252, SPC-4; the ones built
/// here are at most 48).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct SenseBytes {
    bytes: [u8; 64],
    len: usize,
}

impl std::ops::Deref for SenseBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

impl std::fmt::Debug for SenseBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SenseBytes({:02x?})", &**self)
    }
}

impl SenseBytes {
    fn encode(sense: &SenseRepr) -> Self {
        let mut bytes = [0u8; 64];
        // Fixed format holds 32-bit INFORMATION only; fall back to
        // descriptor format for anything wider.
        let len = sense.emit(&mut bytes).unwrap_or_else(|_| {
            sense
                .in_format(SenseFormat::Descriptor)
                .emit(&mut bytes)
                .expect("descriptor sense built here fits 64 bytes")
        });
        Self { bytes, len }
    }
}

/// The outcome of one command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Response {
    /// SCSI status.
    pub status: Status,
    /// Sense data (with CHECK CONDITION), in the logical unit's format.
    pub sense: Option<SenseRepr>,
    /// Data-in bytes handed to the sink.
    pub data_in_len: u32,
    /// Data-in residual against the initiator's capacity.
    pub data_in_residual: Residual,
    /// Data-out residual against the data-out buffer.
    pub data_out_residual: Residual,
}

impl Response {
    /// The sense bytes to send, if any.
    pub fn sense_bytes(&self) -> Option<SenseBytes> {
        self.sense.as_ref().map(SenseBytes::encode)
    }
}

/// Identity of the target itself, used where no logical unit answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetConfig {
    /// Distinguishes targets: derived serial numbers and NAA ids use it.
    pub target_id: u64,
    /// Vendor for INQUIRY on an absent LUN.
    pub vendor: String,
    /// Product for INQUIRY on an absent LUN.
    pub product: String,
    /// Revision for INQUIRY on an absent LUN.
    pub revision: String,
}

impl TargetConfig {
    /// A target with id `target_id` and the default identity (KVERBS
    /// RAMDISK 0001).
    pub fn new(target_id: u64) -> Self {
        Self {
            target_id,
            vendor: "KVERBS".into(),
            product: "RAMDISK".into(),
            revision: "0001".into(),
        }
    }
}

/// A set of RAM-disk logical units and the device server in front of them.
///
/// `Send + Sync`: share it (`Arc`) between channel threads and call
/// [`Self::execute`] concurrently.
#[derive(Debug)]
pub struct ScsiTarget {
    config: TargetConfig,
    luns: BTreeMap<u16, Arc<LogicalUnit>>,
    faults: FaultHooks,
}

impl ScsiTarget {
    /// A target without logical units.
    pub fn new(config: TargetConfig) -> Self {
        Self {
            config,
            luns: BTreeMap::new(),
            faults: FaultHooks::default(),
        }
    }

    /// A target with one logical unit, LUN 0.
    ///
    /// # Errors
    ///
    /// The unit's configuration is not valid.
    pub fn single(target_id: u64, lun0: LunConfig) -> Result<Self, ConfigError> {
        let mut target = Self::new(TargetConfig::new(target_id));
        target.add_lun(0, lun0)?;
        Ok(target)
    }

    /// Adds logical unit `index`.
    ///
    /// # Errors
    ///
    /// The configuration is not valid, `index` is 16384 or more, or the LUN
    /// exists.
    pub fn add_lun(
        &mut self,
        index: u16,
        config: LunConfig,
    ) -> Result<Arc<LogicalUnit>, ConfigError> {
        if index >= MAX_LUNS {
            return Err(ConfigError::LunOutOfRange(index));
        }
        if self.luns.contains_key(&index) {
            return Err(ConfigError::DuplicateLun(index));
        }
        config.validate()?;
        let lu = Arc::new(LogicalUnit::new(self.config.target_id, index, config));
        self.luns.insert(index, Arc::clone(&lu));
        Ok(lu)
    }

    /// The target's identity.
    pub fn config(&self) -> &TargetConfig {
        &self.config
    }

    /// Logical unit `index`.
    pub fn lun(&self, index: u16) -> Option<&Arc<LogicalUnit>> {
        self.luns.get(&index)
    }

    /// The configured LUNs, ascending.
    pub fn lun_indices(&self) -> impl Iterator<Item = u16> + '_ {
        self.luns.keys().copied()
    }

    /// The fault hooks (misbehaviour switches).
    pub fn faults(&self) -> &FaultHooks {
        &self.faults
    }

    /// Executes one command. Data-in goes to `data_in` in order, in pieces,
    /// never more than `request.data_in_capacity` bytes in all. The sink runs
    /// while a chunk of the store is read-locked: it must not issue writes
    /// to the same target.
    pub fn execute(&self, request: &Request<'_>, data_in: &mut dyn FnMut(&[u8])) -> Response {
        let mut sink = data_in;
        commands::execute(self, request, &mut sink)
    }

    /// [`Self::execute`] with a sink that may take data straight from the
    /// store (see [`DataInSink::store_range`]).
    pub fn execute_into(&self, request: &Request<'_>, data_in: &mut dyn DataInSink) -> Response {
        commands::execute(self, request, data_in)
    }

    /// [`Self::execute`] for a caller that must neither block nor allocate
    /// (the SRP target serving a command in its CQ's DPC): `None` when the
    /// command cannot run to its end that way — a fault rule is armed (it
    /// may sleep), the command is not a READ, WRITE or TEST UNIT READY
    /// (the others build their answers on the heap), a chunk lock is held,
    /// or a WRITE would allocate a chunk. Nothing is counted then, and the
    /// caller runs [`Self::execute`] on a thread instead; the sink may have
    /// seen a prefix of the data-in, and a WRITE may have stored a prefix of
    /// its (identical) data.
    pub fn try_execute(
        &self,
        request: &Request<'_>,
        data_in: &mut dyn FnMut(&[u8]),
    ) -> Option<Response> {
        let mut sink = data_in;
        self.try_execute_into(request, &mut sink)
    }

    /// [`Self::execute_into`] for a sink that may decline
    /// ([`DataInSink::store_range`] returning `false`): `None` then, with
    /// nothing counted, and the caller runs the command again another way.
    pub fn execute_declinable(
        &self,
        request: &Request<'_>,
        data_in: &mut dyn DataInSink,
    ) -> Option<Response> {
        commands::execute_in(self, request, data_in, false)
    }

    /// [`Self::try_execute`] with a sink that may take data straight from
    /// the store (its [`DataInSink::store_range`] is called non-blocking).
    pub fn try_execute_into(
        &self,
        request: &Request<'_>,
        data_in: &mut dyn DataInSink,
    ) -> Option<Response> {
        if self.faults.armed() {
            return None;
        }
        commands::execute_in(self, request, data_in, true)
    }

    /// [`Self::execute`] collecting the data-in into a vector (tests,
    /// tools).
    pub fn execute_to_vec(&self, request: &Request<'_>) -> (Response, Vec<u8>) {
        let mut data = Vec::new();
        let response = self.execute(request, &mut |piece| data.extend_from_slice(piece));
        (response, data)
    }
}
