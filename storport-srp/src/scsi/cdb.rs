//! Command descriptor blocks: a generic view ([`Cdb`]) for the fields every
//! CDB has, and [`CdbRepr`], the decoded form of the commands a block device
//! initiator sends and the RAM-disk target serves, with builders.
//!
//! `CdbRepr::parse` decodes every field SBC-3/SPC-4 defines for these
//! commands, including the ones a target must *reject* (RDPROTECT, CMDDT,
//! BYTCHK = 10b...): whether a value is acceptable is the device server's
//! decision, not the decoder's. Reserved bits are ignored. Obsolete fields
//! without a use (RELADR, FUA_NV, RARC) are dropped. The control byte is
//! read through the view ([`Cdb::control`]) and written as zero by `emit`.

use core::fmt;

use super::{DataDirection, FieldPointer, Opcode};
use crate::wire::bytes::{FieldCodec, read_be24, write_be24};

/// Why a CDB could not be decoded or built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CdbError {
    /// No bytes at all.
    Empty,
    /// The CDB is shorter than its opcode's group implies.
    Truncated {
        /// The opcode.
        opcode: Opcode,
        /// The length its group implies.
        needed: u8,
    },
    /// An opcode [`CdbRepr`] does not decode (the target answers INVALID
    /// COMMAND OPERATION CODE).
    UnsupportedOpcode(Opcode),
    /// A field that selects the command is not one decoded here: the
    /// service action of SERVICE ACTION IN(16) (the target answers INVALID
    /// FIELD IN CDB with this pointer).
    InvalidField(FieldPointer),
    /// A value does not fit the chosen CDB size or its field (emit only).
    NotRepresentable,
    /// The output buffer is shorter than [`CdbRepr::buffer_len`].
    BufferTooSmall,
}

impl fmt::Display for CdbError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Empty => f.write_str("empty CDB"),
            Self::Truncated { opcode, needed } => {
                write!(f, "{opcode} CDB shorter than {needed} bytes")
            }
            Self::UnsupportedOpcode(opcode) => write!(f, "unsupported {opcode}"),
            Self::InvalidField(field) => write!(f, "invalid field in CDB at {field:?}"),
            Self::NotRepresentable => f.write_str("value does not fit the CDB"),
            Self::BufferTooSmall => f.write_str("buffer too small for the CDB"),
        }
    }
}

/// Control byte bit 2: NACA (normal ACA).
const NACA: u8 = 0x04;

/// A view over the bytes of one CDB: what every CDB has in common.
///
/// Unlike the fixed-layout views, its length depends on the opcode, so
/// `check_len` needs the first byte: an empty buffer or one shorter than the
/// opcode's group length is [`CdbError::Truncated`]; an opcode without a
/// group length (0x60..=0x7F, 0xC0..=0xFF) passes with any non-empty buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cdb<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Cdb<T> {
    /// Wraps `buffer` without checking it; accessors read zeros past its
    /// end.
    pub const fn new_unchecked(buffer: T) -> Self {
        Self { buffer }
    }

    /// Wraps `buffer` after [`Self::check_len`].
    ///
    /// # Errors
    ///
    /// [`CdbError::Empty`], [`CdbError::Truncated`].
    pub fn new_checked(buffer: T) -> Result<Self, CdbError> {
        let view = Self::new_unchecked(buffer);
        view.check_len()?;
        Ok(view)
    }

    /// Checks the buffer holds the opcode's whole CDB (trailing bytes, as in
    /// SRP's 16-byte CDB field, are allowed).
    ///
    /// # Errors
    ///
    /// [`CdbError::Empty`], [`CdbError::Truncated`].
    pub fn check_len(&self) -> Result<(), CdbError> {
        let bytes = self.buffer.as_ref();
        let Some(&first) = bytes.first() else {
            return Err(CdbError::Empty);
        };
        let opcode = Opcode(first);
        match opcode.cdb_len() {
            Some(needed) if bytes.len() < needed => Err(CdbError::Truncated {
                opcode,
                // CAST: group lengths are at most 16.
                needed: needed as u8,
            }),
            _ => Ok(()),
        }
    }

    /// Gives the buffer back.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// The operation code.
    pub fn opcode(&self) -> Opcode {
        Opcode(u8::read(self.buffer.as_ref(), 0))
    }

    /// The CDB length its opcode's group implies, `None` for groups 3, 6
    /// and 7.
    pub fn cdb_len(&self) -> Option<usize> {
        self.opcode().cdb_len()
    }

    /// The CDB's own bytes: the first [`Self::cdb_len`] bytes (all of the buffer
    /// for an opcode without a group length, or when the buffer is short).
    pub fn as_bytes(&self) -> &[u8] {
        let bytes = self.buffer.as_ref();
        match self.cdb_len() {
            Some(len) => bytes.get(..len).unwrap_or(bytes),
            None => bytes,
        }
    }

    /// The control byte (the last byte of the CDB), 0 when the length is
    /// unknown.
    pub fn control(&self) -> u8 {
        match self.cdb_len() {
            Some(len) => u8::read(self.buffer.as_ref(), len - 1),
            None => 0,
        }
    }

    /// Where the control byte's NACA bit is, for a field pointer.
    pub fn naca_field(&self) -> FieldPointer {
        // CAST: group lengths are at most 16.
        FieldPointer::bit(self.cdb_len().unwrap_or(1).saturating_sub(1) as u16, 2)
    }

    /// The NACA bit: the initiator asks for an ACA condition on CHECK
    /// CONDITION (which the software targets do not support).
    pub fn naca(&self) -> bool {
        self.control() & NACA != 0
    }

    /// The data direction: that of the decoded command when [`CdbRepr`]
    /// decodes it, otherwise the opcode's fixed direction, otherwise `None`.
    pub fn data_direction(&self) -> Option<DataDirection> {
        match CdbRepr::parse(self) {
            Ok(repr) => Some(repr.data_direction()),
            Err(_) => self.opcode().fixed_data_direction(),
        }
    }
}

/// The four CDB sizes of the block commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CdbSize {
    /// 6-byte CDB (group 0).
    Six,
    /// 10-byte CDB (groups 1 and 2).
    Ten,
    /// 12-byte CDB (group 5).
    Twelve,
    /// 16-byte CDB (group 4).
    Sixteen,
}

impl CdbSize {
    /// The length in bytes.
    pub const fn bytes(self) -> usize {
        match self {
            Self::Six => 6,
            Self::Ten => 10,
            Self::Twelve => 12,
            Self::Sixteen => 16,
        }
    }
}

/// READ(6/10/12/16) or WRITE(6/10/12/16).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ReadWriteCdb {
    /// Which of the four CDBs.
    pub size: CdbSize,
    /// First logical block address (21 bits for the 6-byte form, 32 for
    /// 10 and 12).
    pub lba: u64,
    /// Number of logical blocks. The 6-byte form encodes 256 as 0 and
    /// cannot express 0; the 10-byte form holds 16 bits.
    pub blocks: u32,
    /// RDPROTECT / WRPROTECT (3 bits; not in the 6-byte form).
    pub protect: u8,
    /// DPO: disable page out (not in the 6-byte form).
    pub dpo: bool,
    /// FUA: force unit access (not in the 6-byte form).
    pub fua: bool,
    /// GROUP NUMBER (5 bits; not in the 6-byte form).
    pub group: u8,
}

impl ReadWriteCdb {
    /// A plain transfer of `blocks` blocks at `lba` with the smallest CDB
    /// that holds it (10 bytes unless the LBA or length needs 16; the
    /// 6-byte form is never chosen, as Windows never does).
    pub const fn new(lba: u64, blocks: u32) -> Self {
        let size = if lba > u32::MAX as u64 || blocks > u16::MAX as u32 {
            CdbSize::Sixteen
        } else {
            CdbSize::Ten
        };
        Self {
            size,
            lba,
            blocks,
            protect: 0,
            dpo: false,
            fua: false,
            group: 0,
        }
    }

    /// The same transfer with FUA set.
    #[must_use]
    pub const fn with_fua(mut self, fua: bool) -> Self {
        self.fua = fua;
        self
    }
}

/// VERIFY(10/12/16).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct VerifyCdb {
    /// 10, 12 or 16 bytes (6 is not a VERIFY size).
    pub size: CdbSize,
    /// First LBA.
    pub lba: u64,
    /// VERIFICATION LENGTH in blocks.
    pub blocks: u32,
    /// VRPROTECT (3 bits).
    pub protect: u8,
    /// DPO.
    pub dpo: bool,
    /// BYTCHK (2 bits): 00b medium check only, 01b compare with
    /// `blocks` blocks of data-out, 11b compare every block with one block
    /// of data-out, 10b reserved.
    pub bytchk: u8,
    /// GROUP NUMBER (5 bits).
    pub group: u8,
}

/// SYNCHRONIZE CACHE(10/16).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SynchronizeCacheCdb {
    /// 10 or 16 bytes.
    pub size: CdbSize,
    /// First LBA.
    pub lba: u64,
    /// NUMBER OF LOGICAL BLOCKS; 0 means "to the last LBA".
    pub blocks: u32,
    /// IMMED: return status before the flush completes.
    pub immed: bool,
    /// GROUP NUMBER (5 bits).
    pub group: u8,
}

/// READ CAPACITY(10).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ReadCapacity10Cdb {
    /// LOGICAL BLOCK ADDRESS (obsolete with PMI; must be 0 without it).
    pub lba: u32,
    /// PMI (obsolete in SBC-4).
    pub pmi: bool,
}

/// READ CAPACITY(16) (SERVICE ACTION IN(16), service action 0x10).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ReadCapacity16Cdb {
    /// LOGICAL BLOCK ADDRESS (obsolete with PMI).
    pub lba: u64,
    /// ALLOCATION LENGTH.
    pub alloc_len: u32,
    /// PMI.
    pub pmi: bool,
}

/// INQUIRY.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct InquiryCdb {
    /// EVPD: return the vital product data page `page_code`.
    pub evpd: bool,
    /// CMDDT (obsolete; a target rejects it set).
    pub cmddt: bool,
    /// PAGE CODE (must be 0 without EVPD).
    pub page_code: u8,
    /// ALLOCATION LENGTH.
    pub alloc_len: u16,
}

/// The PC field of MODE SENSE: which values of the pages to return.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum PageControl {
    /// 00b: current values.
    #[default]
    Current,
    /// 01b: a mask of the changeable fields.
    Changeable,
    /// 10b: default values.
    Default,
    /// 11b: saved values.
    Saved,
}

impl PageControl {
    const fn from_bits(bits: u8) -> Self {
        match bits & 0x03 {
            0 => Self::Current,
            1 => Self::Changeable,
            2 => Self::Default,
            _ => Self::Saved,
        }
    }

    const fn bits(self) -> u8 {
        match self {
            Self::Current => 0,
            Self::Changeable => 1,
            Self::Default => 2,
            Self::Saved => 3,
        }
    }
}

/// MODE SENSE(6/10).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ModeSenseCdb {
    /// 6 or 10 bytes.
    pub size: CdbSize,
    /// DBD: no block descriptors.
    pub dbd: bool,
    /// LLBAA: long LBA block descriptors allowed (10-byte form only).
    pub llbaa: bool,
    /// PC.
    pub page_control: PageControl,
    /// PAGE CODE (6 bits; 0x3F = all pages).
    pub page_code: u8,
    /// SUBPAGE CODE (0xFF with page 0x3F = all pages and subpages).
    pub subpage: u8,
    /// ALLOCATION LENGTH (8 bits in the 6-byte form).
    pub alloc_len: u16,
}

/// REPORT LUNS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ReportLunsCdb {
    /// SELECT REPORT (0x00 all, 0x01 well-known only, 0x02 all of both).
    pub select_report: u8,
    /// ALLOCATION LENGTH.
    pub alloc_len: u32,
}

/// REQUEST SENSE.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct RequestSenseCdb {
    /// DESC: descriptor-format sense wanted.
    pub desc: bool,
    /// ALLOCATION LENGTH.
    pub alloc_len: u8,
}

/// UNMAP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct UnmapCdb {
    /// ANCHOR.
    pub anchor: bool,
    /// GROUP NUMBER (5 bits).
    pub group: u8,
    /// PARAMETER LIST LENGTH.
    pub param_list_len: u16,
}

/// A decoded CDB.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CdbRepr {
    /// TEST UNIT READY.
    TestUnitReady,
    /// REQUEST SENSE.
    RequestSense(RequestSenseCdb),
    /// INQUIRY.
    Inquiry(InquiryCdb),
    /// MODE SENSE(6/10).
    ModeSense(ModeSenseCdb),
    /// READ CAPACITY(10).
    ReadCapacity10(ReadCapacity10Cdb),
    /// READ CAPACITY(16).
    ReadCapacity16(ReadCapacity16Cdb),
    /// READ(6/10/12/16).
    Read(ReadWriteCdb),
    /// WRITE(6/10/12/16).
    Write(ReadWriteCdb),
    /// VERIFY(10/12/16).
    Verify(VerifyCdb),
    /// SYNCHRONIZE CACHE(10/16).
    SynchronizeCache(SynchronizeCacheCdb),
    /// REPORT LUNS.
    ReportLuns(ReportLunsCdb),
    /// UNMAP.
    Unmap(UnmapCdb),
}

/// Byte 1 bits of the block commands.
const DPO: u8 = 0x10;
const FUA: u8 = 0x08;
const IMMED: u8 = 0x02;
const GROUP_MASK: u8 = 0x1F;

fn bit(byte: u8, mask: u8) -> bool {
    byte & mask != 0
}

fn flag(set: bool, mask: u8) -> u8 {
    if set { mask } else { 0 }
}

/// Reads LBA and length of a 10/12/16-byte block CDB.
fn lba_len(b: &[u8], size: CdbSize) -> (u64, u32) {
    match size {
        CdbSize::Six => (u64::from(read_be24(b, 1) & 0x1F_FFFF), 0),
        CdbSize::Ten => (u64::from(u32::read(b, 2)), u32::from(u16::read(b, 7))),
        CdbSize::Twelve => (u64::from(u32::read(b, 2)), u32::read(b, 6)),
        CdbSize::Sixteen => (u64::read(b, 2), u32::read(b, 10)),
    }
}

/// Writes LBA and length of a 10/12/16-byte block CDB, refusing values
/// that do not fit.
fn put_lba_len(b: &mut [u8], size: CdbSize, lba: u64, blocks: u32) -> Result<(), CdbError> {
    let narrow_lba = || u32::try_from(lba).map_err(|_| CdbError::NotRepresentable);
    match size {
        CdbSize::Six => return Err(CdbError::NotRepresentable),
        CdbSize::Ten => {
            narrow_lba()?.write(b, 2);
            u16::try_from(blocks)
                .map_err(|_| CdbError::NotRepresentable)?
                .write(b, 7);
        }
        CdbSize::Twelve => {
            narrow_lba()?.write(b, 2);
            blocks.write(b, 6);
        }
        CdbSize::Sixteen => {
            lba.write(b, 2);
            blocks.write(b, 10);
        }
    }
    Ok(())
}

/// The byte offset of the GROUP NUMBER field.
const fn group_at(size: CdbSize) -> usize {
    match size {
        CdbSize::Six => 0, // none; callers never ask
        CdbSize::Ten => 6,
        CdbSize::Twelve => 10,
        CdbSize::Sixteen => 14,
    }
}

fn check_bits(value: u8, max: u8) -> Result<u8, CdbError> {
    if value > max {
        Err(CdbError::NotRepresentable)
    } else {
        Ok(value)
    }
}

impl CdbRepr {
    /// Decodes a CDB.
    ///
    /// # Errors
    ///
    /// [`CdbError::Empty`], [`CdbError::Truncated`],
    /// [`CdbError::UnsupportedOpcode`], [`CdbError::InvalidField`] (a
    /// SERVICE ACTION IN(16) service action other than READ CAPACITY(16)).
    pub fn parse<T: AsRef<[u8]>>(cdb: &Cdb<T>) -> Result<Self, CdbError> {
        cdb.check_len()?;
        let b = cdb.buffer.as_ref();
        let byte = |at: usize| u8::read(b, at);
        let rw = |size: CdbSize| -> ReadWriteCdb {
            let (lba, blocks) = lba_len(b, size);
            if size == CdbSize::Six {
                let blocks = match byte(4) {
                    0 => 256,
                    n => u32::from(n),
                };
                return ReadWriteCdb {
                    size,
                    lba,
                    blocks,
                    protect: 0,
                    dpo: false,
                    fua: false,
                    group: 0,
                };
            }
            ReadWriteCdb {
                size,
                lba,
                blocks,
                protect: byte(1) >> 5,
                dpo: bit(byte(1), DPO),
                fua: bit(byte(1), FUA),
                group: byte(group_at(size)) & GROUP_MASK,
            }
        };
        let verify = |size: CdbSize| -> VerifyCdb {
            let (lba, blocks) = lba_len(b, size);
            VerifyCdb {
                size,
                lba,
                blocks,
                protect: byte(1) >> 5,
                dpo: bit(byte(1), DPO),
                bytchk: (byte(1) >> 1) & 0x03,
                group: byte(group_at(size)) & GROUP_MASK,
            }
        };
        let sync = |size: CdbSize| -> SynchronizeCacheCdb {
            let (lba, blocks) = lba_len(b, size);
            SynchronizeCacheCdb {
                size,
                lba,
                blocks,
                immed: bit(byte(1), IMMED),
                group: byte(group_at(size)) & GROUP_MASK,
            }
        };
        let mode_sense = |size: CdbSize| -> ModeSenseCdb {
            ModeSenseCdb {
                size,
                dbd: bit(byte(1), 0x08),
                llbaa: size == CdbSize::Ten && bit(byte(1), 0x10),
                page_control: PageControl::from_bits(byte(2) >> 6),
                page_code: byte(2) & 0x3F,
                subpage: byte(3),
                alloc_len: if size == CdbSize::Six {
                    u16::from(byte(4))
                } else {
                    u16::read(b, 7)
                },
            }
        };
        Ok(match cdb.opcode() {
            Opcode::TEST_UNIT_READY => Self::TestUnitReady,
            Opcode::REQUEST_SENSE => Self::RequestSense(RequestSenseCdb {
                desc: bit(byte(1), 0x01),
                alloc_len: byte(4),
            }),
            Opcode::INQUIRY => Self::Inquiry(InquiryCdb {
                evpd: bit(byte(1), 0x01),
                cmddt: bit(byte(1), 0x02),
                page_code: byte(2),
                alloc_len: u16::read(b, 3),
            }),
            Opcode::MODE_SENSE_6 => Self::ModeSense(mode_sense(CdbSize::Six)),
            Opcode::MODE_SENSE_10 => Self::ModeSense(mode_sense(CdbSize::Ten)),
            Opcode::READ_CAPACITY_10 => Self::ReadCapacity10(ReadCapacity10Cdb {
                lba: u32::read(b, 2),
                pmi: bit(byte(8), 0x01),
            }),
            Opcode::SERVICE_ACTION_IN_16 => {
                if byte(1) & 0x1F != Opcode::SA_READ_CAPACITY_16 {
                    return Err(CdbError::InvalidField(FieldPointer::bit(1, 4)));
                }
                Self::ReadCapacity16(ReadCapacity16Cdb {
                    lba: u64::read(b, 2),
                    alloc_len: u32::read(b, 10),
                    pmi: bit(byte(14), 0x01),
                })
            }
            Opcode::READ_6 => Self::Read(rw(CdbSize::Six)),
            Opcode::READ_10 => Self::Read(rw(CdbSize::Ten)),
            Opcode::READ_12 => Self::Read(rw(CdbSize::Twelve)),
            Opcode::READ_16 => Self::Read(rw(CdbSize::Sixteen)),
            Opcode::WRITE_6 => Self::Write(rw(CdbSize::Six)),
            Opcode::WRITE_10 => Self::Write(rw(CdbSize::Ten)),
            Opcode::WRITE_12 => Self::Write(rw(CdbSize::Twelve)),
            Opcode::WRITE_16 => Self::Write(rw(CdbSize::Sixteen)),
            Opcode::VERIFY_10 => Self::Verify(verify(CdbSize::Ten)),
            Opcode::VERIFY_12 => Self::Verify(verify(CdbSize::Twelve)),
            Opcode::VERIFY_16 => Self::Verify(verify(CdbSize::Sixteen)),
            Opcode::SYNCHRONIZE_CACHE_10 => Self::SynchronizeCache(sync(CdbSize::Ten)),
            Opcode::SYNCHRONIZE_CACHE_16 => Self::SynchronizeCache(sync(CdbSize::Sixteen)),
            Opcode::REPORT_LUNS => Self::ReportLuns(ReportLunsCdb {
                select_report: byte(2),
                alloc_len: u32::read(b, 6),
            }),
            Opcode::UNMAP => Self::Unmap(UnmapCdb {
                anchor: bit(byte(1), 0x01),
                group: byte(6) & GROUP_MASK,
                param_list_len: u16::read(b, 7),
            }),
            other => return Err(CdbError::UnsupportedOpcode(other)),
        })
    }

    /// Decodes the CDB at the start of `bytes` (trailing bytes are ignored).
    ///
    /// # Errors
    ///
    /// As [`Self::parse`].
    pub fn parse_bytes(bytes: &[u8]) -> Result<Self, CdbError> {
        Self::parse(&Cdb::new_unchecked(bytes))
    }

    /// The operation code this CDB is sent with.
    pub const fn opcode(&self) -> Opcode {
        match self {
            Self::TestUnitReady => Opcode::TEST_UNIT_READY,
            Self::RequestSense(_) => Opcode::REQUEST_SENSE,
            Self::Inquiry(_) => Opcode::INQUIRY,
            Self::ModeSense(c) => match c.size {
                CdbSize::Six => Opcode::MODE_SENSE_6,
                _ => Opcode::MODE_SENSE_10,
            },
            Self::ReadCapacity10(_) => Opcode::READ_CAPACITY_10,
            Self::ReadCapacity16(_) => Opcode::SERVICE_ACTION_IN_16,
            Self::Read(c) => match c.size {
                CdbSize::Six => Opcode::READ_6,
                CdbSize::Ten => Opcode::READ_10,
                CdbSize::Twelve => Opcode::READ_12,
                CdbSize::Sixteen => Opcode::READ_16,
            },
            Self::Write(c) => match c.size {
                CdbSize::Six => Opcode::WRITE_6,
                CdbSize::Ten => Opcode::WRITE_10,
                CdbSize::Twelve => Opcode::WRITE_12,
                CdbSize::Sixteen => Opcode::WRITE_16,
            },
            Self::Verify(c) => match c.size {
                CdbSize::Twelve => Opcode::VERIFY_12,
                CdbSize::Sixteen => Opcode::VERIFY_16,
                _ => Opcode::VERIFY_10,
            },
            Self::SynchronizeCache(c) => match c.size {
                CdbSize::Sixteen => Opcode::SYNCHRONIZE_CACHE_16,
                _ => Opcode::SYNCHRONIZE_CACHE_10,
            },
            Self::ReportLuns(_) => Opcode::REPORT_LUNS,
            Self::Unmap(_) => Opcode::UNMAP,
        }
    }

    /// Bytes [`Self::emit`] writes (the opcode's group length).
    pub const fn buffer_len(&self) -> usize {
        match self.opcode().cdb_len() {
            Some(len) => len,
            None => 16, // unreachable: every opcode above has a group length
        }
    }

    /// Which way the command moves data.
    pub const fn data_direction(&self) -> DataDirection {
        match self {
            Self::TestUnitReady | Self::SynchronizeCache(_) => DataDirection::None,
            Self::RequestSense(_)
            | Self::Inquiry(_)
            | Self::ModeSense(_)
            | Self::ReadCapacity10(_)
            | Self::ReadCapacity16(_)
            | Self::Read(_)
            | Self::ReportLuns(_) => DataDirection::In,
            Self::Write(_) | Self::Unmap(_) => DataDirection::Out,
            Self::Verify(c) => match c.bytchk {
                1 | 3 => DataDirection::Out,
                _ => DataDirection::None,
            },
        }
    }

    /// The number of bytes the command asks to move, given the logical
    /// block length: blocks times block length for reads and writes, the
    /// allocation or parameter list length otherwise. (What the target
    /// actually moves may be less: see the allocation length rules.)
    pub const fn transfer_len(&self, block_len: u32) -> u64 {
        let block_len = block_len as u64;
        match self {
            Self::TestUnitReady | Self::SynchronizeCache(_) => 0,
            Self::RequestSense(c) => c.alloc_len as u64,
            Self::Inquiry(c) => c.alloc_len as u64,
            Self::ModeSense(c) => c.alloc_len as u64,
            Self::ReadCapacity10(_) => 8,
            Self::ReadCapacity16(c) => c.alloc_len as u64,
            Self::Read(c) | Self::Write(c) => c.blocks as u64 * block_len,
            Self::Verify(c) => match c.bytchk {
                1 => c.blocks as u64 * block_len,
                3 => block_len,
                _ => 0,
            },
            Self::ReportLuns(c) => c.alloc_len as u64,
            Self::Unmap(c) => c.param_list_len as u64,
        }
    }

    /// Writes the CDB (control byte zero).
    ///
    /// # Errors
    ///
    /// [`CdbError::BufferTooSmall`]; [`CdbError::NotRepresentable`] for a
    /// value that does not fit its field or CDB size (an LBA above 21 bits
    /// or 0 or more than 256 blocks in a 6-byte READ/WRITE, a 6-byte
    /// READ/WRITE with protect, DPO, FUA or a group, a 16-bit length above
    /// 0xFFFF, a 3-bit field above 7, a 6-byte VERIFY or SYNCHRONIZE CACHE,
    /// LLBAA or an allocation length above 255 in MODE SENSE(6)...).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, cdb: &mut Cdb<T>) -> Result<(), CdbError> {
        let len = self.buffer_len();
        let b = cdb
            .buffer
            .as_mut()
            .get_mut(..len)
            .ok_or(CdbError::BufferTooSmall)?;
        // Validate into a scratch copy first so that a refused emit leaves
        // no half-written CDB behind.
        let mut scratch = [0u8; 16];
        let s = scratch.get_mut(..len).ok_or(CdbError::BufferTooSmall)?;
        self.emit_fields(s)?;
        b.copy_from_slice(s);
        Ok(())
    }

    fn emit_fields(&self, b: &mut [u8]) -> Result<(), CdbError> {
        self.opcode().0.write(b, 0);
        match *self {
            Self::TestUnitReady => {}
            Self::RequestSense(c) => {
                flag(c.desc, 0x01).write(b, 1);
                c.alloc_len.write(b, 4);
            }
            Self::Inquiry(c) => {
                (flag(c.evpd, 0x01) | flag(c.cmddt, 0x02)).write(b, 1);
                c.page_code.write(b, 2);
                c.alloc_len.write(b, 3);
            }
            Self::ModeSense(c) => {
                let page = (c.page_control.bits() << 6) | check_bits(c.page_code, 0x3F)?;
                page.write(b, 2);
                c.subpage.write(b, 3);
                match c.size {
                    CdbSize::Six => {
                        if c.llbaa {
                            return Err(CdbError::NotRepresentable);
                        }
                        flag(c.dbd, 0x08).write(b, 1);
                        u8::try_from(c.alloc_len)
                            .map_err(|_| CdbError::NotRepresentable)?
                            .write(b, 4);
                    }
                    CdbSize::Ten => {
                        (flag(c.dbd, 0x08) | flag(c.llbaa, 0x10)).write(b, 1);
                        c.alloc_len.write(b, 7);
                    }
                    _ => return Err(CdbError::NotRepresentable),
                }
            }
            Self::ReadCapacity10(c) => {
                c.lba.write(b, 2);
                flag(c.pmi, 0x01).write(b, 8);
            }
            Self::ReadCapacity16(c) => {
                Opcode::SA_READ_CAPACITY_16.write(b, 1);
                c.lba.write(b, 2);
                c.alloc_len.write(b, 10);
                flag(c.pmi, 0x01).write(b, 14);
            }
            Self::Read(c) | Self::Write(c) => {
                if c.size == CdbSize::Six {
                    let plain = c.protect == 0 && !c.dpo && !c.fua && c.group == 0;
                    let blocks = match c.blocks {
                        256 => 0,
                        // CAST: 1..=255 checked by the pattern.
                        n @ 1..=255 => n as u8,
                        _ => return Err(CdbError::NotRepresentable),
                    };
                    if !plain || c.lba > 0x1F_FFFF {
                        return Err(CdbError::NotRepresentable);
                    }
                    // CAST: checked to fit 21 bits just above.
                    write_be24(b, 1, c.lba as u32);
                    blocks.write(b, 4);
                } else {
                    let byte1 =
                        (check_bits(c.protect, 7)? << 5) | flag(c.dpo, DPO) | flag(c.fua, FUA);
                    byte1.write(b, 1);
                    put_lba_len(b, c.size, c.lba, c.blocks)?;
                    check_bits(c.group, GROUP_MASK)?.write(b, group_at(c.size));
                }
            }
            Self::Verify(c) => {
                let byte1 = (check_bits(c.protect, 7)? << 5)
                    | flag(c.dpo, DPO)
                    | (check_bits(c.bytchk, 3)? << 1);
                byte1.write(b, 1);
                put_lba_len(b, c.size, c.lba, c.blocks)?;
                check_bits(c.group, GROUP_MASK)?.write(b, group_at(c.size));
            }
            Self::SynchronizeCache(c) => {
                if c.size == CdbSize::Twelve {
                    return Err(CdbError::NotRepresentable);
                }
                flag(c.immed, IMMED).write(b, 1);
                put_lba_len(b, c.size, c.lba, c.blocks)?;
                check_bits(c.group, GROUP_MASK)?.write(b, group_at(c.size));
            }
            Self::ReportLuns(c) => {
                c.select_report.write(b, 2);
                c.alloc_len.write(b, 6);
            }
            Self::Unmap(c) => {
                flag(c.anchor, 0x01).write(b, 1);
                check_bits(c.group, GROUP_MASK)?.write(b, 6);
                c.param_list_len.write(b, 7);
            }
        }
        Ok(())
    }

    /// The CDB in a zero-padded 16-byte array, the form SRP's `SRP_CMD` and
    /// iSCSI's SCSI Command PDU carry; the real length is
    /// [`Self::buffer_len`].
    ///
    /// # Errors
    ///
    /// [`CdbError::NotRepresentable`] as for [`Self::emit`].
    pub fn to_cdb16(&self) -> Result<[u8; 16], CdbError> {
        let mut out = [0u8; 16];
        self.emit(&mut Cdb::new_unchecked(&mut out[..]))?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn golden_read10() {
        // READ(10) of LBA 0x12345678, 8 blocks.
        let cdb = CdbRepr::Read(ReadWriteCdb::new(0x1234_5678, 8));
        let bytes = cdb.to_cdb16().unwrap();
        assert_eq!(
            bytes,
            [
                0x28, 0x00, 0x12, 0x34, 0x56, 0x78, 0x00, 0x00, 0x08, 0x00, 0, 0, 0, 0, 0, 0
            ]
        );
        assert_eq!(cdb.buffer_len(), 10);
        assert_eq!(CdbRepr::parse_bytes(&bytes), Ok(cdb));
        assert_eq!(cdb.transfer_len(512), 4096);
        assert_eq!(cdb.data_direction(), DataDirection::In);
    }

    #[test]
    fn golden_write16_fua() {
        let cdb = CdbRepr::Write(ReadWriteCdb::new(0x0102_0304_0506, 0x1_0000).with_fua(true));
        let mut out = [0u8; 16];
        cdb.emit(&mut Cdb::new_unchecked(&mut out[..])).unwrap();
        assert_eq!(
            out,
            [
                0x8A, 0x08, 0x00, 0x00, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x00, 0x01, 0x00, 0x00,
                0x00, 0x00
            ]
        );
        assert_eq!(CdbRepr::parse_bytes(&out), Ok(cdb));
        assert_eq!(cdb.data_direction(), DataDirection::Out);
    }

    #[test]
    fn golden_small_commands() {
        let inquiry = CdbRepr::Inquiry(InquiryCdb {
            evpd: true,
            cmddt: false,
            page_code: 0x83,
            alloc_len: 0x0200,
        });
        assert_eq!(
            &inquiry.to_cdb16().unwrap()[..6],
            &[0x12, 0x01, 0x83, 0x02, 0x00, 0x00]
        );
        let rc16 = CdbRepr::ReadCapacity16(ReadCapacity16Cdb {
            lba: 0,
            alloc_len: 32,
            pmi: false,
        });
        assert_eq!(
            rc16.to_cdb16().unwrap(),
            [0x9E, 0x10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x20, 0, 0]
        );
        let luns = CdbRepr::ReportLuns(ReportLunsCdb {
            select_report: 0,
            alloc_len: 0x1000,
        });
        assert_eq!(
            &luns.to_cdb16().unwrap()[..12],
            &[0xA0, 0, 0, 0, 0, 0, 0, 0, 0x10, 0, 0, 0]
        );
        let mode = CdbRepr::ModeSense(ModeSenseCdb {
            size: CdbSize::Six,
            dbd: true,
            llbaa: false,
            page_control: PageControl::Current,
            page_code: 0x08,
            subpage: 0,
            alloc_len: 0xC0,
        });
        assert_eq!(
            &mode.to_cdb16().unwrap()[..6],
            &[0x1A, 0x08, 0x08, 0x00, 0xC0, 0x00]
        );
        let read6 = CdbRepr::Read(ReadWriteCdb {
            size: CdbSize::Six,
            ..ReadWriteCdb::new(0x1_2345, 256)
        });
        assert_eq!(
            &read6.to_cdb16().unwrap()[..6],
            &[0x08, 0x01, 0x23, 0x45, 0x00, 0x00]
        );
        assert_eq!(
            CdbRepr::parse_bytes(&[0x08, 0xE1, 0x23, 0x45, 0x00, 0x00]),
            Ok(read6),
            "READ(6) ignores the three reserved bits above the LBA"
        );
    }

    #[test]
    fn unrepresentable_values_are_refused_without_writing() {
        let mut out = [0xAAu8; 16];
        let too_far = CdbRepr::Read(ReadWriteCdb {
            size: CdbSize::Ten,
            ..ReadWriteCdb::new(1 << 32, 1)
        });
        assert_eq!(
            too_far.emit(&mut Cdb::new_unchecked(&mut out[..])),
            Err(CdbError::NotRepresentable)
        );
        assert_eq!(out, [0xAA; 16]);
        let zero6 = CdbRepr::Write(ReadWriteCdb {
            size: CdbSize::Six,
            ..ReadWriteCdb::new(0, 0)
        });
        assert_eq!(zero6.to_cdb16(), Err(CdbError::NotRepresentable));
        let fua6 = CdbRepr::Write(ReadWriteCdb {
            size: CdbSize::Six,
            ..ReadWriteCdb::new(0, 1).with_fua(true)
        });
        assert_eq!(fua6.to_cdb16(), Err(CdbError::NotRepresentable));
        let verify6 = CdbRepr::Verify(VerifyCdb {
            size: CdbSize::Six,
            lba: 0,
            blocks: 1,
            protect: 0,
            dpo: false,
            bytchk: 0,
            group: 0,
        });
        assert_eq!(verify6.to_cdb16(), Err(CdbError::NotRepresentable));
        let short = CdbRepr::TestUnitReady;
        assert_eq!(
            short.emit(&mut Cdb::new_unchecked(&mut [0u8; 5][..])),
            Err(CdbError::BufferTooSmall)
        );
    }

    #[test]
    fn view_checks_and_control_byte() {
        assert_eq!(CdbRepr::parse_bytes(&[]), Err(CdbError::Empty));
        assert_eq!(
            CdbRepr::parse_bytes(&[0x28, 0, 0, 0, 0, 0, 0, 0, 0]),
            Err(CdbError::Truncated {
                opcode: Opcode::READ_10,
                needed: 10
            })
        );
        assert_eq!(
            CdbRepr::parse_bytes(&[0x9E, 0x11, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]),
            Err(CdbError::InvalidField(FieldPointer::bit(1, 4)))
        );
        assert_eq!(
            CdbRepr::parse_bytes(&[0xC5, 1, 2]),
            Err(CdbError::UnsupportedOpcode(Opcode(0xC5)))
        );
        let tur = Cdb::new_checked(&[0u8, 0, 0, 0, 0, 0x04, 0xFF, 0xFF][..]).unwrap();
        assert!(tur.naca());
        assert_eq!(tur.naca_field(), FieldPointer::bit(5, 2));
        assert_eq!(tur.as_bytes().len(), 6);
        assert_eq!(tur.data_direction(), Some(DataDirection::None));
        let mode_select = Cdb::new_unchecked(&[0x15u8, 0, 0, 0, 12, 0][..]);
        assert_eq!(mode_select.data_direction(), Some(DataDirection::Out));
        let verify = Cdb::new_unchecked(&[0x2Fu8, 0x02, 0, 0, 0, 0, 0, 0, 1, 0][..]);
        assert_eq!(verify.data_direction(), Some(DataDirection::Out));
        let verify = Cdb::new_unchecked(&[0x2Fu8, 0x00, 0, 0, 0, 0, 0, 0, 1, 0][..]);
        assert_eq!(verify.data_direction(), Some(DataDirection::None));
        assert_eq!(Cdb::new_unchecked(&[0xC5u8][..]).data_direction(), None);
    }
}
