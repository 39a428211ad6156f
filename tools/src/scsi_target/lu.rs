//! Logical unit configuration and the logical unit itself: identity, block
//! geometry, behaviour switches, storage and counters.

use std::sync::atomic::{AtomicU64, Ordering};

use super::store::BlockStore;

/// The two logical block sizes the RAM disk offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockSize {
    /// 512-byte blocks.
    B512,
    /// 4096-byte blocks (4Kn).
    B4096,
}

impl BlockSize {
    /// Bytes per block.
    pub const fn bytes(self) -> u32 {
        match self {
            Self::B512 => 512,
            Self::B4096 => 4096,
        }
    }

    /// The block size of `bytes`, if it is one of the two.
    pub const fn from_bytes(bytes: u32) -> Option<Self> {
        match bytes {
            512 => Some(Self::B512),
            4096 => Some(Self::B4096),
            _ => None,
        }
    }
}

/// How one logical unit looks and behaves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LunConfig {
    /// Logical block size.
    pub block_size: BlockSize,
    /// Capacity in blocks (at least 1).
    pub blocks: u64,
    /// T10 vendor identification (ASCII, at most 8 characters).
    pub vendor: String,
    /// Product identification (ASCII, at most 16 characters).
    pub product: String,
    /// Product revision level (ASCII, at most 4 characters).
    pub revision: String,
    /// Unit serial number (VPD 0x80, ASCII); derived from the target id and
    /// LUN when `None`.
    pub serial: Option<String>,
    /// The 8-byte NAA designator of VPD 0x83; an NAA 3 (locally assigned)
    /// value derived from the target id and LUN when `None`.
    pub naa_id: Option<u64>,
    /// Write protected: writes fail with DATA PROTECT / WRITE PROTECTED and
    /// MODE SENSE reports WP.
    pub read_only: bool,
    /// The caching mode page reports a write-back cache (WCE), so that
    /// initiators send SYNCHRONIZE CACHE.
    pub write_cache: bool,
    /// Sense is sent in descriptor format (control mode page D_SENSE).
    pub descriptor_sense: bool,
    /// Logical block provisioning: UNMAP works, READ CAPACITY(16) reports
    /// LBPME and LBPRZ, VPD 0xB2 is offered.
    pub thin_provisioning: bool,
    /// MAXIMUM TRANSFER LENGTH in blocks (VPD 0xB0): longer READs and
    /// WRITEs get INVALID FIELD IN CDB.
    pub max_transfer_blocks: u32,
}

/// The default maximum transfer: 16 MiB, the largest RDMA transfer Linux
/// `ib_srpt` allows (`MAX_SRPT_RDMA_SIZE`).
pub const DEFAULT_MAX_TRANSFER_BYTES: u32 = 16 << 20;

/// Longest vendor, product and revision strings.
const VENDOR_LEN: usize = 8;
const PRODUCT_LEN: usize = 16;
const REVISION_LEN: usize = 4;
/// Longest serial number: VPD 0x80 must fit an INQUIRY answer comfortably.
const SERIAL_LEN: usize = 64;

/// LUNs the SAM single-level (peripheral/flat) addressing can name.
pub const MAX_LUNS: u16 = 0x4000;

impl LunConfig {
    /// A logical unit of `blocks` blocks of `block_size`, with the defaults:
    /// vendor "KVERBS", product "RAMDISK", revision "0001", write-back cache
    /// reported, fixed-format sense, thin provisioning on, 16 MiB maximum
    /// transfer.
    pub fn new(block_size: BlockSize, blocks: u64) -> Self {
        Self {
            block_size,
            blocks,
            vendor: "KVERBS".into(),
            product: "RAMDISK".into(),
            revision: "0001".into(),
            serial: None,
            naa_id: None,
            read_only: false,
            write_cache: true,
            descriptor_sense: false,
            thin_provisioning: true,
            max_transfer_blocks: DEFAULT_MAX_TRANSFER_BYTES / block_size.bytes(),
        }
    }

    /// A logical unit of `bytes` bytes (rounded down to whole blocks).
    pub fn with_capacity_bytes(block_size: BlockSize, bytes: u64) -> Self {
        Self::new(block_size, bytes / u64::from(block_size.bytes()))
    }

    /// Capacity in bytes.
    pub fn capacity_bytes(&self) -> Option<u64> {
        self.blocks.checked_mul(u64::from(self.block_size.bytes()))
    }

    /// Checks the configuration can be served.
    ///
    /// # Errors
    ///
    /// The first problem found.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.blocks == 0 {
            return Err(ConfigError::ZeroCapacity);
        }
        match self.capacity_bytes() {
            Some(bytes) if bytes <= MAX_CAPACITY_BYTES => {}
            _ => return Err(ConfigError::CapacityTooLarge(self.blocks)),
        }
        if self.max_transfer_blocks == 0 {
            return Err(ConfigError::ZeroMaxTransfer);
        }
        let check = |field: &'static str, text: &str, max: usize| {
            if text.len() > max || !text.bytes().all(|b| b.is_ascii_graphic() || b == b' ') {
                Err(ConfigError::BadIdentification { field, max })
            } else {
                Ok(())
            }
        };
        check("vendor", &self.vendor, VENDOR_LEN)?;
        check("product", &self.product, PRODUCT_LEN)?;
        check("revision", &self.revision, REVISION_LEN)?;
        if let Some(serial) = &self.serial {
            check("serial", serial, SERIAL_LEN)?;
        }
        Ok(())
    }
}

/// The largest capacity a RAM disk may claim: 1 PiB (the storage is sparse,
/// so a claim is cheap; the chunk table is bounded by
/// [`super::store::MAX_CHUNKS`]).
pub const MAX_CAPACITY_BYTES: u64 = 1 << 50;

/// Why a logical unit could not be added.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// Capacity of zero blocks.
    #[error("a logical unit needs at least one block")]
    ZeroCapacity,
    /// Capacity above [`MAX_CAPACITY_BYTES`].
    #[error("capacity of {0} blocks is above the 1 PiB limit")]
    CapacityTooLarge(u64),
    /// A maximum transfer length of zero.
    #[error("the maximum transfer length must be at least one block")]
    ZeroMaxTransfer,
    /// An identification string is too long or not printable ASCII.
    #[error("{field} must be printable ASCII of at most {max} characters")]
    BadIdentification {
        /// Which string.
        field: &'static str,
        /// Its longest allowed length.
        max: usize,
    },
    /// A LUN index above what single-level addressing names.
    #[error("LUN {0} is above 16383")]
    LunOutOfRange(u16),
    /// The LUN is already configured.
    #[error("LUN {0} already exists")]
    DuplicateLun(u16),
}

/// Counters of one logical unit, for tests and benchmarks.
#[derive(Debug, Default)]
pub struct LuStats {
    commands: AtomicU64,
    reads: AtomicU64,
    writes: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    syncs: AtomicU64,
    unmapped_blocks: AtomicU64,
    check_conditions: AtomicU64,
}

/// A copy of [`LuStats`] at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LuStatsSnapshot {
    /// Commands addressed to the unit.
    pub commands: u64,
    /// READ commands that succeeded.
    pub reads: u64,
    /// WRITE commands that succeeded.
    pub writes: u64,
    /// Bytes sent by READs.
    pub bytes_read: u64,
    /// Bytes stored by WRITEs.
    pub bytes_written: u64,
    /// SYNCHRONIZE CACHE commands that succeeded.
    pub syncs: u64,
    /// Blocks deallocated by UNMAP.
    pub unmapped_blocks: u64,
    /// Commands answered with CHECK CONDITION.
    pub check_conditions: u64,
}

impl LuStats {
    pub(super) fn add(counter: &AtomicU64, value: u64) {
        counter.fetch_add(value, Ordering::Relaxed);
    }

    /// The counters now.
    pub fn snapshot(&self) -> LuStatsSnapshot {
        let get = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        LuStatsSnapshot {
            commands: get(&self.commands),
            reads: get(&self.reads),
            writes: get(&self.writes),
            bytes_read: get(&self.bytes_read),
            bytes_written: get(&self.bytes_written),
            syncs: get(&self.syncs),
            unmapped_blocks: get(&self.unmapped_blocks),
            check_conditions: get(&self.check_conditions),
        }
    }
}

/// A block range outside the medium.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("blocks {lba}+{blocks} outside the medium")]
pub struct RangeError {
    /// First LBA.
    pub lba: u64,
    /// Blocks asked for.
    pub blocks: u64,
}

/// One RAM-disk logical unit.
#[derive(Debug)]
pub struct LogicalUnit {
    index: u16,
    config: LunConfig,
    serial: String,
    naa_id: u64,
    store: BlockStore,
    pub(super) stats: LuStats,
}

impl LogicalUnit {
    pub(super) fn new(target_id: u64, index: u16, config: LunConfig) -> Self {
        let serial = config
            .serial
            .clone()
            .unwrap_or_else(|| format!("KV{target_id:012X}L{index:04X}"));
        // NAA 3 (locally assigned): 4-bit NAA, then 60 bits of our own: 44
        // bits of the target id and the 16-bit LUN.
        let naa_id = config
            .naa_id
            .unwrap_or((0x3 << 60) | ((target_id & 0xFFF_FFFF_FFFF) << 16) | u64::from(index));
        let bytes = config.capacity_bytes().unwrap_or(0);
        Self {
            index,
            serial,
            naa_id,
            store: BlockStore::new(bytes),
            stats: LuStats::default(),
            config,
        }
    }

    /// The LUN.
    pub fn index(&self) -> u16 {
        self.index
    }

    /// The configuration it was made with.
    pub fn config(&self) -> &LunConfig {
        &self.config
    }

    /// Logical block length in bytes.
    pub fn block_len(&self) -> u32 {
        self.config.block_size.bytes()
    }

    /// Capacity in blocks.
    pub fn blocks(&self) -> u64 {
        self.config.blocks
    }

    /// The unit serial number (VPD 0x80).
    pub fn serial(&self) -> &str {
        &self.serial
    }

    /// The NAA designator (VPD 0x83).
    pub fn naa_id(&self) -> u64 {
        self.naa_id
    }

    /// The storage, for direct access by range.
    pub fn store(&self) -> &BlockStore {
        &self.store
    }

    /// The counters now.
    pub fn stats(&self) -> LuStatsSnapshot {
        self.stats.snapshot()
    }

    /// Byte offset of `lba` after checking `lba + blocks` is on the medium.
    pub(super) fn range(&self, lba: u64, blocks: u64) -> Result<u64, RangeError> {
        match lba.checked_add(blocks) {
            Some(end) if end <= self.config.blocks => Ok(lba * u64::from(self.block_len())),
            _ => Err(RangeError { lba, blocks }),
        }
    }

    /// Hands blocks `lba..lba + blocks` to `sink` straight from the store
    /// (no SCSI processing, no counters): the zero-copy path a transport
    /// can use, and the way tests look at the medium.
    ///
    /// # Errors
    ///
    /// The range is not on the medium.
    pub fn read_blocks(
        &self,
        lba: u64,
        blocks: u64,
        sink: &mut dyn FnMut(&[u8]),
    ) -> Result<(), RangeError> {
        let offset = self.range(lba, blocks)?;
        self.store
            .read(offset, blocks * u64::from(self.block_len()), sink);
        Ok(())
    }

    /// Stores `data` (whole blocks) at `lba`, bypassing SCSI processing.
    ///
    /// # Errors
    ///
    /// The range is not on the medium, or `data` is not whole blocks.
    pub fn write_blocks(&self, lba: u64, data: &[u8]) -> Result<(), RangeError> {
        let block_len = u64::from(self.block_len());
        let len = data.len() as u64;
        let blocks = len.div_ceil(block_len);
        if len % block_len != 0 {
            return Err(RangeError { lba, blocks });
        }
        let offset = self.range(lba, blocks)?;
        self.store.write(offset, data);
        Ok(())
    }

    pub(super) fn count_command(&self) {
        LuStats::add(&self.stats.commands, 1);
    }

    pub(super) fn count_check_condition(&self) {
        LuStats::add(&self.stats.check_conditions, 1);
    }

    pub(super) fn count_read(&self, bytes: u64) {
        LuStats::add(&self.stats.reads, 1);
        LuStats::add(&self.stats.bytes_read, bytes);
    }

    pub(super) fn count_write(&self, bytes: u64) {
        LuStats::add(&self.stats.writes, 1);
        LuStats::add(&self.stats.bytes_written, bytes);
    }

    pub(super) fn count_sync(&self) {
        LuStats::add(&self.stats.syncs, 1);
    }

    pub(super) fn count_unmap(&self, blocks: u64) {
        LuStats::add(&self.stats.unmapped_blocks, blocks);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation() {
        let ok = LunConfig::new(BlockSize::B512, 2048);
        assert_eq!(ok.validate(), Ok(()));
        assert_eq!(ok.max_transfer_blocks, 32768);
        assert_eq!(
            LunConfig::new(BlockSize::B4096, 1).max_transfer_blocks,
            4096
        );
        assert_eq!(
            LunConfig::new(BlockSize::B512, 0).validate(),
            Err(ConfigError::ZeroCapacity)
        );
        assert_eq!(
            LunConfig::new(BlockSize::B4096, u64::MAX / 2).validate(),
            Err(ConfigError::CapacityTooLarge(u64::MAX / 2))
        );
        let mut long_vendor = ok.clone();
        long_vendor.vendor = "NINE CHAR".into();
        assert!(matches!(
            long_vendor.validate(),
            Err(ConfigError::BadIdentification {
                field: "vendor",
                ..
            })
        ));
        let mut control = ok.clone();
        control.serial = Some("A\tB".into());
        assert!(control.validate().is_err());
        let mut zero_max = ok;
        zero_max.max_transfer_blocks = 0;
        assert_eq!(zero_max.validate(), Err(ConfigError::ZeroMaxTransfer));
        assert_eq!(
            LunConfig::with_capacity_bytes(BlockSize::B4096, 10_000).blocks,
            2
        );
        assert_eq!(BlockSize::from_bytes(4096), Some(BlockSize::B4096));
        assert_eq!(BlockSize::from_bytes(1024), None);
    }

    #[test]
    fn direct_block_access() {
        let lu = LogicalUnit::new(7, 3, LunConfig::new(BlockSize::B512, 16));
        assert_eq!(lu.serial(), "KV000000000007L0003");
        assert_eq!(lu.naa_id(), 0x3000_0000_0007_0003);
        lu.write_blocks(15, &[0x5A; 512]).unwrap();
        assert_eq!(
            lu.write_blocks(15, &[0; 1024]),
            Err(RangeError { lba: 15, blocks: 2 })
        );
        assert!(lu.write_blocks(0, &[0; 100]).is_err());
        let mut seen = Vec::new();
        lu.read_blocks(14, 2, &mut |piece| seen.extend_from_slice(piece))
            .unwrap();
        assert!(seen[..512].iter().all(|b| *b == 0));
        assert!(seen[512..].iter().all(|b| *b == 0x5A));
        assert!(lu.read_blocks(u64::MAX, 2, &mut |_| {}).is_err());
    }
}
