//! `SRP_CMD` (48 bytes + additional CDB + data buffer descriptors + optional
//! immediate data): a SCSI command. This is the I/O fast path: emitting one
//! writes only into the caller's buffer and touches each byte once.
//!
//! Layout after the fixed part: the additional CDB bytes (`add_cdb_len`,
//! whose low two bits are reserved, so `add_cdb_len & !3` bytes), then the
//! DATA-OUT descriptor, then the DATA-IN descriptor, each in the format its
//! nibble of `buf_fmt` names (high nibble DATA-OUT, low nibble DATA-IN).
//! An indirect descriptor carries `data_{out,in}_desc_cnt` direct
//! descriptors inline. With the SRP-2 immediate format, the DATA-OUT
//! descriptor is a 4-byte length and the data itself starts at the
//! immediate-data offset negotiated at login.
//!
//! An indirect descriptor's table (`table_desc.len / 16` descriptors) must
//! be exactly its direction's inline list. Linux `ib_srpt` requires the
//! table to fit within `data_out_desc_cnt + data_in_desc_cnt` and then
//! reads only the inline list; this is the same rule stated per direction,
//! so a table that would have to be fetched from initiator memory is
//! [`Error::ExternalIndirectTable`] and an inline list longer than its table
//! is [`Error::IndirectCountMismatch`]. A direct descriptor's count field is
//! not used (Linux `ib_srp` leaves it 0, and so does [`CmdRepr::emit`]).

use static_assertions::{const_assert, const_assert_eq};

use super::desc::{self, DescFormat, DirectBuf, DirectDesc, ImmBuf, IndirectBuf, IndirectDesc};
use super::{Error, Opcode, Result, SolNot, check_emit_len, expect_opcode, len_u32};
use crate::wire::Lun;
use crate::wire::bytes::{self, FieldCodec};

mod field {
    use crate::wire::Field;

    pub const OPCODE: Field = 0..1;
    pub const SOL_NOT: Field = 1..2;
    pub const BUF_FMT: Field = 5..6;
    pub const DATA_OUT_DESC_CNT: Field = 6..7;
    pub const DATA_IN_DESC_CNT: Field = 7..8;
    pub const TAG: Field = 8..16;
    pub const LUN: Field = 20..28;
    pub const TASK_ATTR: Field = 29..30;
    pub const ADD_CDB_LEN: Field = 31..32;
    pub const CDB: Field = 32..48;
    pub const ADD_DATA: usize = 48;
}

/// Size of the fixed part of `SRP_CMD`.
pub const LEN: usize = field::ADD_DATA;
const_assert_eq!(field::CDB.end, field::ADD_DATA);
const_assert_eq!(LEN, 48);

/// Bytes of CDB in the fixed part.
pub const CDB_LEN: usize = field::CDB.end - field::CDB.start;
/// Largest additional CDB: the 6-bit dword count of `add_cdb_len`.
pub const MAX_ADD_CDB_LEN: usize = 0xFC;
/// Largest CDB an `SRP_CMD` can carry.
pub const MAX_CDB_LEN: usize = CDB_LEN + MAX_ADD_CDB_LEN;

/// `add_cdb_len`'s low two bits are reserved.
const ADD_CDB_LEN_MASK: u8 = 0xFC;
/// `task_attr`'s bits 3..=7 are reserved.
const TASK_ATTR_MASK: u8 = 0x07;

/// The SAM task attribute of a command. Codes SRP does not define are
/// preserved for the target to handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum TaskAttr {
    /// 0: SIMPLE.
    #[default]
    Simple,
    /// 1: HEAD OF QUEUE.
    HeadOfQueue,
    /// 2: ORDERED.
    Ordered,
    /// 4: ACA.
    Aca,
    /// Any other 3-bit code, as received.
    Other(u8),
}

impl TaskAttr {
    /// The attribute for a wire code (low three bits).
    pub const fn from_code(code: u8) -> Self {
        match code & TASK_ATTR_MASK {
            0 => Self::Simple,
            1 => Self::HeadOfQueue,
            2 => Self::Ordered,
            4 => Self::Aca,
            other => Self::Other(other),
        }
    }

    /// The wire code.
    pub const fn code(self) -> u8 {
        match self {
            Self::Simple => 0,
            Self::HeadOfQueue => 1,
            Self::Ordered => 2,
            Self::Aca => 4,
            Self::Other(code) => code & TASK_ATTR_MASK,
        }
    }
}

/// Where the DATA-OUT (initiator to target) data of a command is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataOut<'a> {
    /// No DATA-OUT transfer.
    None,
    /// One remote buffer the target RDMA-READs.
    Direct(DirectDesc),
    /// A descriptor list the target RDMA-READs from.
    Indirect(IndirectDesc<'a>),
    /// SRP-2 immediate data inside the IU, starting at `offset` (the offset
    /// negotiated at login).
    Immediate {
        /// Byte offset of the data in the IU.
        offset: u16,
        /// The data.
        data: &'a [u8],
    },
    /// Emit-only: immediate data of `len` bytes that the caller sends from
    /// its own buffer as a second scatter/gather element right after the
    /// `offset` bytes [`CmdRepr::emit`] writes (no copy on the fast path).
    /// Parsing never yields this variant.
    ImmediateExternal {
        /// Byte offset of the data in the IU.
        offset: u16,
        /// Length of the data.
        len: u32,
    },
}

/// Where the DATA-IN (target to initiator) data of a command goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataIn<'a> {
    /// No DATA-IN transfer.
    None,
    /// One remote buffer the target RDMA-WRITEs.
    Direct(DirectDesc),
    /// A descriptor list the target RDMA-WRITEs to.
    Indirect(IndirectDesc<'a>),
}

impl DataOut<'_> {
    /// The descriptor format this variant is sent with.
    pub const fn format(&self) -> DescFormat {
        match self {
            Self::None => DescFormat::None,
            Self::Direct(_) => DescFormat::Direct,
            Self::Indirect(_) => DescFormat::Indirect,
            Self::Immediate { .. } | Self::ImmediateExternal { .. } => DescFormat::Immediate,
        }
    }

    /// Bytes of descriptor in the IU.
    const fn desc_len(&self) -> usize {
        match self {
            Self::None => 0,
            Self::Direct(_) => desc::DIRECT_LEN,
            Self::Indirect(ind) => ind.buffer_len(),
            Self::Immediate { .. } | Self::ImmediateExternal { .. } => desc::IMM_LEN,
        }
    }

    /// Inline descriptor count sent in `data_out_desc_cnt`.
    const fn desc_cnt(&self) -> usize {
        match self {
            Self::Indirect(ind) => ind.descs.len(),
            _ => 0,
        }
    }
}

impl DataIn<'_> {
    /// The descriptor format this variant is sent with.
    pub const fn format(&self) -> DescFormat {
        match self {
            Self::None => DescFormat::None,
            Self::Direct(_) => DescFormat::Direct,
            Self::Indirect(_) => DescFormat::Indirect,
        }
    }

    const fn desc_len(&self) -> usize {
        match self {
            Self::None => 0,
            Self::Direct(_) => desc::DIRECT_LEN,
            Self::Indirect(ind) => ind.buffer_len(),
        }
    }

    const fn desc_cnt(&self) -> usize {
        match self {
            Self::Indirect(ind) => ind.descs.len(),
            _ => 0,
        }
    }
}

/// The value of an `SRP_CMD`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CmdRepr<'a> {
    /// Which responses are solicited.
    pub sol_not: SolNot,
    /// The command's tag, echoed in its `SRP_RSP`.
    pub tag: u64,
    /// The logical unit.
    pub lun: Lun,
    /// The task attribute.
    pub task_attr: TaskAttr,
    /// The CDB. Parsing yields the 16 bytes of the fixed part plus any
    /// additional CDB bytes; emitting pads to 16 and the additional part to
    /// a multiple of 4.
    pub cdb: &'a [u8],
    /// The DATA-OUT buffer.
    pub data_out: DataOut<'a>,
    /// The DATA-IN buffer.
    pub data_in: DataIn<'a>,
}

/// Byte positions of an IU about to be emitted.
struct Layout {
    add_cdb_len: usize,
    /// End of all descriptors.
    desc_end: usize,
    /// Total bytes written.
    total: usize,
}

impl<'a> CmdRepr<'a> {
    /// Parses a command.
    ///
    /// `imm_data_offset` is the channel's negotiated immediate-data offset
    /// (`None` if the target did not grant `IMMED_SUPP`).
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`] (also for an additional CDB past the end),
    /// [`Error::WrongOpcode`], [`Error::ReservedDescFormat`],
    /// [`Error::ImmediateDataIn`], [`Error::DescriptorOutOfBounds`], the
    /// indirect-descriptor errors of [`IndirectDesc::validate`],
    /// [`Error::ImmediateNotNegotiated`], [`Error::ImmediateOffsetOverlap`],
    /// [`Error::ImmediateDataOutOfBounds`].
    pub fn parse<T: AsRef<[u8]> + ?Sized>(
        iu: &Cmd<&'a T>,
        imm_data_offset: Option<u16>,
    ) -> Result<Self> {
        iu.check_len()?;
        expect_opcode(iu.opcode(), Opcode::Cmd)?;
        let (data_out, data_in) = iu.data_descriptors(imm_data_offset)?;
        Ok(Self {
            sol_not: iu.sol_not(),
            tag: iu.tag(),
            lun: iu.lun(),
            task_attr: TaskAttr::from_code(iu.task_attr()),
            cdb: iu.cdb()?,
            data_out,
            data_in,
        })
    }

    fn layout(&self) -> Result<Layout> {
        if self.cdb.len() > MAX_CDB_LEN {
            return Err(Error::CdbTooLong);
        }
        if self.data_out.desc_cnt() > usize::from(u8::MAX)
            || self.data_in.desc_cnt() > usize::from(u8::MAX)
        {
            return Err(Error::TooManyDescriptors);
        }
        let add_cdb_len = self.cdb.len().saturating_sub(CDB_LEN).next_multiple_of(4);
        let desc_end = LEN + add_cdb_len + self.data_out.desc_len() + self.data_in.desc_len();
        let total = match self.data_out {
            DataOut::Immediate { offset, data } => {
                Self::check_imm_offset(offset, desc_end)?;
                usize::from(offset) + data.len()
            }
            DataOut::ImmediateExternal { offset, .. } => {
                Self::check_imm_offset(offset, desc_end)?;
                usize::from(offset)
            }
            _ => desc_end,
        };
        Ok(Layout {
            add_cdb_len,
            desc_end,
            total,
        })
    }

    fn check_imm_offset(offset: u16, desc_end: usize) -> Result<()> {
        if usize::from(offset) < desc_end {
            Err(Error::ImmediateOffsetOverlap)
        } else {
            Ok(())
        }
    }

    /// Bytes [`Self::emit`] writes. With [`DataOut::ImmediateExternal`],
    /// the immediate data is not included.
    ///
    /// # Errors
    ///
    /// [`Error::CdbTooLong`], [`Error::TooManyDescriptors`],
    /// [`Error::ImmediateOffsetOverlap`].
    pub fn buffer_len(&self) -> Result<usize> {
        Ok(self.layout()?.total)
    }

    /// Writes the command into the start of the caller's buffer.
    ///
    /// Only the IU's own bytes are written: header, CDB (zero padded),
    /// descriptors, and for immediate data the gap up to the offset and the
    /// data. Indirect descriptors are checked like [`IndirectDesc::emit`]
    /// checks them.
    ///
    /// # Errors
    ///
    /// [`Error::BufferTooSmall`], the [`Self::buffer_len`] errors, the
    /// [`IndirectDesc::validate`] errors, [`Error::LengthOverflow`].
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, iu: &mut Cmd<T>) -> Result<()> {
        let layout = self.layout()?;
        check_emit_len(iu.as_bytes(), layout.total)?;
        let add_cdb_code = u8::try_from(layout.add_cdb_len).map_err(|_| Error::CdbTooLong)?;

        let buf = iu.as_bytes_mut();
        bytes::zero(buf, 0, LEN + layout.add_cdb_len);
        Opcode::Cmd.to_u8().write(buf, field::OPCODE.start);
        self.sol_not.write(buf, field::SOL_NOT.start);
        DescFormat::pack(self.data_out.format(), self.data_in.format())
            .write(buf, field::BUF_FMT.start);
        // Counts fit: `layout` checked them against u8::MAX.
        (self.data_out.desc_cnt() as u8).write(buf, field::DATA_OUT_DESC_CNT.start);
        (self.data_in.desc_cnt() as u8).write(buf, field::DATA_IN_DESC_CNT.start);
        self.tag.write(buf, field::TAG.start);
        self.lun.write(buf, field::LUN.start);
        self.task_attr.code().write(buf, field::TASK_ATTR.start);
        add_cdb_code.write(buf, field::ADD_CDB_LEN.start);
        bytes::write_bytes(buf, field::CDB.start, self.cdb);

        let mut at = LEN + layout.add_cdb_len;
        let rest = buf.get_mut(at..).ok_or(Error::BufferTooSmall)?;
        match self.data_out {
            DataOut::None => {}
            DataOut::Direct(d) => d.emit(&mut DirectBuf::new_unchecked(&mut *rest))?,
            DataOut::Indirect(ind) => ind.emit(&mut IndirectBuf::new_unchecked(&mut *rest))?,
            DataOut::Immediate { data, .. } => {
                ImmBuf::new_unchecked(&mut *rest).set_length(len_u32(data.len())?);
            }
            DataOut::ImmediateExternal { len, .. } => {
                ImmBuf::new_unchecked(&mut *rest).set_length(len)
            }
        }
        at += self.data_out.desc_len();
        let rest = buf.get_mut(at..).ok_or(Error::BufferTooSmall)?;
        match self.data_in {
            DataIn::None => {}
            DataIn::Direct(d) => d.emit(&mut DirectBuf::new_unchecked(rest))?,
            DataIn::Indirect(ind) => ind.emit(&mut IndirectBuf::new_unchecked(rest))?,
        }
        match self.data_out {
            DataOut::Immediate { offset, data } => {
                let offset = usize::from(offset);
                bytes::zero(buf, layout.desc_end, offset);
                bytes::write_bytes(buf, offset, data);
            }
            DataOut::ImmediateExternal { offset, .. } => {
                bytes::zero(buf, layout.desc_end, usize::from(offset));
            }
            _ => {}
        }
        Ok(())
    }
}

/// The size of [`emit_short`]'s buffer: the fixed part and one direct
/// descriptor (64 bytes), or an immediate-data header up to an offset of
/// at most 80 (SRP-2's usual offset, which Linux and this initiator use,
/// is 68).
pub const SHORT_MAX: usize = 80;
const_assert!(SHORT_MAX >= LEN + desc::DIRECT_LEN);

/// The data of a command in the short form [`emit_short`] writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShortData {
    /// No data descriptor.
    None,
    /// One direct DATA-IN descriptor (the target RDMA-WRITEs).
    In(DirectDesc),
    /// One direct DATA-OUT descriptor (the target RDMA-READs).
    Out(DirectDesc),
    /// `len` bytes of immediate data the caller sends from its own buffer
    /// after the `offset` header bytes (as [`DataOut::ImmediateExternal`]).
    ImmediateExternal {
        /// Byte offset of the data in the IU (at most [`SHORT_MAX`]).
        offset: u16,
        /// Length of the data.
        len: u32,
    },
}

/// Writes the I/O fast path's `SRP_CMD` — a CDB of at most [`CDB_LEN`]
/// bytes and no descriptor, one direct one or an immediate-data header —
/// over all of `out`, and returns the IU length (48 or 64; the offset for
/// immediate data).
///
/// The bytes are those [`CmdRepr::emit`] writes for the same command (the
/// tests compare them); what differs is that every offset is a constant
/// of a fixed-size buffer, so nothing of the general layout (additional
/// CDB, indirect lists, immediate data) is derived per command.
///
/// # Errors
///
/// [`Error::CdbTooLong`] for a longer CDB (that needs [`CmdRepr::emit`]);
/// for immediate data [`Error::ImmediateOffsetOverlap`] as
/// [`CmdRepr::emit`], and [`Error::BufferTooSmall`] for an offset past
/// [`SHORT_MAX`].
pub fn emit_short(
    tag: u64,
    lun: Lun,
    task_attr: TaskAttr,
    cdb: &[u8],
    data: ShortData,
    out: &mut [u8; SHORT_MAX],
) -> Result<usize> {
    let mut field = [0u8; CDB_LEN];
    let Some(dst) = field.get_mut(..cdb.len()) else {
        return Err(Error::CdbTooLong);
    };
    dst.copy_from_slice(cdb);
    emit_short_field(tag, lun, task_attr, &field, data, out)
}

/// [`emit_short`] with the CDB already as its 16-byte field holds it
/// (zero-padded): the initiator keeps its commands' CDBs that way, so the
/// CDB goes in as one fixed-size copy, not a `memcpy` call.
///
/// Inline hint: once per command on the initiator's fast path, where the
/// call and moving its result cost a fifth of it.
///
/// # Errors
/// As [`emit_short`] (never [`Error::CdbTooLong`]).
#[inline]
pub fn emit_short_field(
    tag: u64,
    lun: Lun,
    task_attr: TaskAttr,
    cdb: &[u8; CDB_LEN],
    data: ShortData,
    out: &mut [u8; SHORT_MAX],
) -> Result<usize> {
    *out = [0; SHORT_MAX];
    let buf = out.as_mut_slice();
    Opcode::Cmd.to_u8().write(buf, field::OPCODE.start);
    let (data_out, data_in, total) = match data {
        ShortData::None => (DescFormat::None, DescFormat::None, LEN),
        ShortData::In(d) => {
            d.write(buf, LEN);
            (DescFormat::None, DescFormat::Direct, LEN + desc::DIRECT_LEN)
        }
        ShortData::Out(d) => {
            d.write(buf, LEN);
            (DescFormat::Direct, DescFormat::None, LEN + desc::DIRECT_LEN)
        }
        ShortData::ImmediateExternal { offset, len } => {
            CmdRepr::check_imm_offset(offset, LEN + desc::IMM_LEN)?;
            if usize::from(offset) > SHORT_MAX {
                return Err(Error::BufferTooSmall);
            }
            len.write(buf, LEN);
            (DescFormat::Immediate, DescFormat::None, usize::from(offset))
        }
    };
    DescFormat::pack(data_out, data_in).write(buf, field::BUF_FMT.start);
    tag.write(buf, field::TAG.start);
    lun.write(buf, field::LUN.start);
    task_attr.code().write(buf, field::TASK_ATTR.start);
    if let Some(dst) = buf.get_mut(field::CDB) {
        // Both 16 bytes (`field::CDB` is `CDB_LEN` long): a fixed copy.
        dst.copy_from_slice(cdb);
    }
    Ok(total)
}

wire_view! {
    /// A view of `SRP_CMD` (`srp_cmd`).
    pub struct Cmd, min_len = LEN, error = Error, truncated = Error::Truncated;
    /// IU type byte (0x02).
    opcode, set_opcode: u8 = field::OPCODE;
    /// Solicited-notification bits.
    sol_not, set_sol_not: SolNot = field::SOL_NOT;
    /// Raw buffer formats: high nibble DATA-OUT, low nibble DATA-IN.
    buf_fmt, set_buf_fmt: u8 = field::BUF_FMT;
    /// Inline DATA-OUT descriptors of an indirect descriptor.
    data_out_desc_cnt, set_data_out_desc_cnt: u8 = field::DATA_OUT_DESC_CNT;
    /// Inline DATA-IN descriptors of an indirect descriptor.
    data_in_desc_cnt, set_data_in_desc_cnt: u8 = field::DATA_IN_DESC_CNT;
    /// Tag.
    tag, set_tag: u64 = field::TAG;
    /// Logical unit (aligned only to 4 bytes, as SRP defines it).
    lun, set_lun: Lun = field::LUN;
    /// Raw task attribute byte.
    task_attr, set_task_attr: u8 = field::TASK_ATTR;
    /// Raw additional CDB length byte (low two bits reserved).
    add_cdb_len, set_add_cdb_len: u8 = field::ADD_CDB_LEN;
    /// The first 16 CDB bytes.
    cdb16, set_cdb16: [u8; 16] = field::CDB;
}

impl<T: AsRef<[u8]>> Cmd<T> {
    /// The DATA-OUT descriptor format (high nibble of `buf_fmt`).
    ///
    /// # Errors
    ///
    /// [`Error::ReservedDescFormat`].
    pub fn data_out_format(&self) -> Result<DescFormat> {
        DescFormat::from_nibble(self.buf_fmt() >> 4)
    }

    /// The DATA-IN descriptor format (low nibble of `buf_fmt`).
    ///
    /// # Errors
    ///
    /// [`Error::ReservedDescFormat`], [`Error::ImmediateDataIn`].
    pub fn data_in_format(&self) -> Result<DescFormat> {
        match DescFormat::from_nibble(self.buf_fmt() & 0x0F)? {
            DescFormat::Immediate => Err(Error::ImmediateDataIn),
            format => Ok(format),
        }
    }

    /// Bytes of additional CDB: `add_cdb_len` without its reserved bits.
    pub fn additional_cdb_len(&self) -> usize {
        usize::from(self.add_cdb_len() & ADD_CDB_LEN_MASK)
    }

    /// Where the data buffer descriptors start: `48 + (add_cdb_len & !3)`.
    pub fn desc_offset(&self) -> usize {
        LEN + self.additional_cdb_len()
    }
}

impl<'a, T: AsRef<[u8]> + ?Sized> Cmd<&'a T> {
    /// The whole CDB: 16 bytes plus the additional CDB.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`] if the additional CDB extends past the buffer.
    pub fn cdb(&self) -> Result<&'a [u8]> {
        bytes::sub(
            self.buffer.as_ref(),
            field::CDB.start,
            CDB_LEN + self.additional_cdb_len(),
        )
        .ok_or(Error::Truncated)
    }

    /// Decodes both data buffer descriptors (and the immediate data).
    ///
    /// # Errors
    ///
    /// As [`CmdRepr::parse`], except the opcode check.
    pub fn data_descriptors(
        &self,
        imm_data_offset: Option<u16>,
    ) -> Result<(DataOut<'a>, DataIn<'a>)> {
        let out_format = self.data_out_format()?;
        let in_format = self.data_in_format()?;
        let buf: &'a [u8] = self.buffer.as_ref();
        let out_at = self.desc_offset();

        // The DATA-OUT descriptor; immediate data is resolved once the end
        // of all descriptors is known.
        let (data_out, imm_len, out_len) = match out_format {
            DescFormat::None => (DataOut::None, None, 0),
            DescFormat::Direct => (
                DataOut::Direct(direct_at(buf, out_at)?),
                None,
                desc::DIRECT_LEN,
            ),
            DescFormat::Indirect => {
                let ind = indirect_at(buf, out_at, self.data_out_desc_cnt())?;
                (DataOut::Indirect(ind), None, ind.buffer_len())
            }
            DescFormat::Immediate => {
                let raw =
                    bytes::sub(buf, out_at, desc::IMM_LEN).ok_or(Error::DescriptorOutOfBounds)?;
                (
                    DataOut::None,
                    Some(ImmBuf::new_unchecked(raw).length()),
                    desc::IMM_LEN,
                )
            }
        };

        let in_at = out_at + out_len;
        let (data_in, in_len) = match in_format {
            DescFormat::None => (DataIn::None, 0),
            DescFormat::Direct => (DataIn::Direct(direct_at(buf, in_at)?), desc::DIRECT_LEN),
            DescFormat::Indirect => {
                let ind = indirect_at(buf, in_at, self.data_in_desc_cnt())?;
                (DataIn::Indirect(ind), ind.buffer_len())
            }
            DescFormat::Immediate => return Err(Error::ImmediateDataIn),
        };
        let desc_end = in_at + in_len;

        let data_out = match imm_len {
            None => data_out,
            Some(len) => {
                let offset = imm_data_offset.ok_or(Error::ImmediateNotNegotiated)?;
                if usize::from(offset) < desc_end {
                    return Err(Error::ImmediateOffsetOverlap);
                }
                let len = usize::try_from(len).map_err(|_| Error::ImmediateDataOutOfBounds)?;
                let data = bytes::sub(buf, usize::from(offset), len)
                    .ok_or(Error::ImmediateDataOutOfBounds)?;
                DataOut::Immediate { offset, data }
            }
        };
        Ok((data_out, data_in))
    }
}

fn direct_at(buf: &[u8], at: usize) -> Result<DirectDesc> {
    let raw = bytes::sub(buf, at, desc::DIRECT_LEN).ok_or(Error::DescriptorOutOfBounds)?;
    DirectDesc::parse(&DirectBuf::new_unchecked(raw))
}

fn indirect_at(buf: &[u8], at: usize, count: u8) -> Result<IndirectDesc<'_>> {
    let rest = buf.get(at..).ok_or(Error::DescriptorOutOfBounds)?;
    IndirectDesc::parse(&IndirectBuf::new_unchecked(rest), count)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::srp::DescList;

    const READ10: [u8; 10] = [0x28, 0, 0, 0, 0x10, 0, 0, 0, 8, 0];

    /// The short form is byte for byte the general one, for every CDB
    /// length it takes, each task attribute and each data shape, whatever
    /// the output buffer held before.
    #[test]
    fn emit_short_matches_emit() {
        let cdb: [u8; CDB_LEN] = core::array::from_fn(|i| 0xA0 ^ i as u8);
        let d = DirectDesc {
            va: 0x0102_0304_0506_0708,
            rkey: 0x1122_3344,
            len: 0x5566_7788,
        };
        let attrs = [
            TaskAttr::Simple,
            TaskAttr::HeadOfQueue,
            TaskAttr::Ordered,
            TaskAttr::Aca,
            TaskAttr::Other(5),
        ];
        let shapes = [
            (ShortData::None, DataOut::None, DataIn::None),
            (ShortData::In(d), DataOut::None, DataIn::Direct(d)),
            (ShortData::Out(d), DataOut::Direct(d), DataIn::None),
        ];
        let imm = |offset: u16| {
            let len = 0x0102_0304;
            (
                ShortData::ImmediateExternal { offset, len },
                DataOut::ImmediateExternal { offset, len },
                DataIn::None,
            )
        };
        let shapes = [shapes[0], shapes[1], shapes[2], imm(52), imm(68), imm(80)];
        for cdb_len in 0..=CDB_LEN {
            for attr in attrs {
                for (short, data_out, data_in) in shapes {
                    let repr = CmdRepr {
                        sol_not: SolNot::empty(),
                        tag: 0xfeed_0000_0000_0000 | cdb_len as u64,
                        lun: Lun([1, 2, 3, 4, 5, 6, 7, 8]),
                        task_attr: attr,
                        cdb: &cdb[..cdb_len],
                        data_out,
                        data_in,
                    };
                    let mut general = [0u8; SHORT_MAX];
                    repr.emit(&mut Cmd::new_unchecked(&mut general[..]))
                        .unwrap();
                    let mut fast = [0xEEu8; SHORT_MAX];
                    let n = emit_short(repr.tag, repr.lun, attr, repr.cdb, short, &mut fast);
                    assert_eq!(n, repr.buffer_len(), "{cdb_len} {attr:?} {short:?}");
                    let n = n.unwrap();
                    assert_eq!(fast[..n], general[..n], "{cdb_len} {attr:?} {short:?}");
                    assert!(fast[n..].iter().all(|b| *b == 0));
                }
            }
        }
    }

    #[test]
    fn emit_short_refuses_additional_cdb() {
        let mut out = [0u8; SHORT_MAX];
        let cdb = [0u8; CDB_LEN + 1];
        let r = emit_short(
            1,
            Lun::default(),
            TaskAttr::Simple,
            &cdb,
            ShortData::None,
            &mut out,
        );
        assert_eq!(r, Err(Error::CdbTooLong));
    }

    #[test]
    fn emit_short_refuses_immediate_offsets_it_cannot_hold() {
        let mut out = [0u8; SHORT_MAX];
        let imm = |offset| ShortData::ImmediateExternal { offset, len: 1 };
        let cdb = [0u8; 10];
        let mut emit = |data| emit_short(1, Lun::default(), TaskAttr::Simple, &cdb, data, &mut out);
        assert_eq!(emit(imm(51)), Err(Error::ImmediateOffsetOverlap));
        assert_eq!(emit(imm(81)), Err(Error::BufferTooSmall));
        assert_eq!(emit(imm(52)), Ok(52));
    }

    /// READ(10) of 8 blocks at LBA 0x1000 into one fast-registered buffer.
    #[test]
    fn read10_direct_golden_bytes() {
        let repr = CmdRepr {
            sol_not: SolNot::empty(),
            tag: 5,
            lun: Lun::from_index(0).unwrap(),
            task_attr: TaskAttr::Simple,
            cdb: &READ10,
            data_out: DataOut::None,
            data_in: DataIn::Direct(DirectDesc {
                va: 0x7f12_3456_7000,
                rkey: 0x0001_2345,
                len: 4096,
            }),
        };
        assert_eq!(repr.buffer_len(), Ok(64));
        let expected: [u8; 64] = [
            0x02, 0, 0, 0, 0, 0x01, 0,
            0, // opcode, sol_not, rsvd, buf_fmt (DATA-IN direct), counts
            0, 0, 0, 0, 0, 0, 0, 5, // tag
            0, 0, 0, 0, // rsvd
            0, 0, 0, 0, 0, 0, 0, 0, // lun 0
            0, 0, 0, 0, // rsvd, task_attr simple, rsvd, add_cdb_len
            0x28, 0, 0, 0, 0x10, 0, 0, 0, 8, 0, 0, 0, 0, 0, 0, 0, // cdb
            0, 0, 0x7f, 0x12, 0x34, 0x56, 0x70, 0x00, // va
            0x00, 0x01, 0x23, 0x45, // rkey
            0x00, 0x00, 0x10, 0x00, // len
        ];
        let mut buf = [0xEEu8; 64];
        repr.emit(&mut Cmd::new_unchecked(&mut buf[..])).unwrap();
        assert_eq!(buf, expected);
        let parsed = CmdRepr::parse(&Cmd::new_checked(&buf[..]).unwrap(), None).unwrap();
        let mut cdb16 = [0u8; 16];
        cdb16[..10].copy_from_slice(&READ10);
        assert_eq!(parsed.cdb, &cdb16);
        assert_eq!(
            CmdRepr {
                cdb: &cdb16,
                ..parsed
            },
            CmdRepr {
                cdb: &cdb16,
                ..repr
            }
        );
    }

    /// WRITE(10) with an indirect descriptor of three inline buffers, the
    /// table itself at 0xa000 / rkey 0x99.
    #[test]
    fn indirect_golden_bytes() {
        let descs = [
            DirectDesc {
                va: 0x1000,
                rkey: 0x11,
                len: 0x200,
            },
            DirectDesc {
                va: 0x3000,
                rkey: 0x12,
                len: 0x400,
            },
            DirectDesc {
                va: 0x9000,
                rkey: 0x13,
                len: 0x600,
            },
        ];
        let cdb = [0x2a, 0, 0, 0, 0, 0x20, 0, 0, 6, 0, 0, 0, 0, 0, 0, 0];
        let repr = CmdRepr {
            sol_not: SolNot::UNSUCCESSFUL,
            tag: 0xabc,
            lun: Lun::from_index(3).unwrap(),
            task_attr: TaskAttr::Ordered,
            cdb: &cdb,
            data_out: DataOut::Indirect(IndirectDesc::inline(0xa000, 0x99, &descs).unwrap()),
            data_in: DataIn::None,
        };
        assert_eq!(repr.buffer_len(), Ok(48 + 20 + 48));
        let mut buf = [0xEEu8; 116];
        repr.emit(&mut Cmd::new_unchecked(&mut buf[..])).unwrap();
        assert_eq!(buf[..8], [0x02, 0x04, 0, 0, 0, 0x20, 3, 0]);
        assert_eq!(buf[21], 3);
        assert_eq!(buf[29], 2);
        assert_eq!(buf[31], 0);
        // table_desc: va 0xa000, key 0x99, len 48; total 0xc00
        assert_eq!(
            buf[48..68],
            [
                0, 0, 0, 0, 0, 0, 0xa0, 0, 0, 0, 0, 0x99, 0, 0, 0, 48, 0, 0, 0x0c, 0
            ]
        );
        assert_eq!(
            buf[68..84],
            [0, 0, 0, 0, 0, 0, 0x10, 0, 0, 0, 0, 0x11, 0, 0, 2, 0]
        );
        assert_eq!(
            buf[100..116],
            [0, 0, 0, 0, 0, 0, 0x90, 0, 0, 0, 0, 0x13, 0, 0, 6, 0]
        );
        let parsed = CmdRepr::parse(&Cmd::new_unchecked(&buf[..]), None).unwrap();
        assert_eq!(parsed, repr);
        match parsed.data_out {
            DataOut::Indirect(ind) => assert_eq!(ind.descs.iter().collect::<Vec<_>>(), descs),
            other => panic!("{other:?}"),
        }
    }

    /// ib_srp-style immediate WRITE: the IU is 68 bytes of header and the
    /// data follows as a second SGE.
    #[test]
    fn immediate_data_external_and_inline() {
        let cdb = [0x2a, 0, 0, 0, 0, 1, 0, 0, 1, 0];
        let external = CmdRepr {
            sol_not: SolNot::empty(),
            tag: 1,
            lun: Lun::default(),
            task_attr: TaskAttr::Simple,
            cdb: &cdb,
            data_out: DataOut::ImmediateExternal {
                offset: 68,
                len: 512,
            },
            data_in: DataIn::None,
        };
        assert_eq!(external.buffer_len(), Ok(68));
        let mut buf = [0xEEu8; 68 + 512];
        external
            .emit(&mut Cmd::new_unchecked(&mut buf[..]))
            .unwrap();
        assert_eq!(buf[5], 0x30);
        assert_eq!(buf[48..52], [0, 0, 2, 0]);
        assert_eq!(buf[52..68], [0; 16]);
        assert_eq!(buf[68], 0xEE, "the data part is the caller's");
        buf[68..].fill(0x5A);
        let parsed = CmdRepr::parse(&Cmd::new_unchecked(&buf[..]), Some(68)).unwrap();
        assert_eq!(
            parsed.data_out,
            DataOut::Immediate {
                offset: 68,
                data: &[0x5A; 512]
            }
        );

        let data = [0x5Au8; 512];
        let inline = CmdRepr {
            data_out: DataOut::Immediate {
                offset: 68,
                data: &data,
            },
            ..external
        };
        let mut buf2 = [0u8; 580];
        inline.emit(&mut Cmd::new_unchecked(&mut buf2[..])).unwrap();
        assert_eq!(buf, buf2);

        assert_eq!(
            CmdRepr::parse(&Cmd::new_unchecked(&buf[..]), None),
            Err(Error::ImmediateNotNegotiated)
        );
        assert_eq!(
            CmdRepr::parse(&Cmd::new_unchecked(&buf[..]), Some(51)),
            Err(Error::ImmediateOffsetOverlap)
        );
        assert_eq!(
            CmdRepr::parse(&Cmd::new_unchecked(&buf[..579]), Some(68)),
            Err(Error::ImmediateDataOutOfBounds)
        );
        let overlapping = CmdRepr {
            data_out: DataOut::Immediate {
                offset: 50,
                data: &data,
            },
            ..external
        };
        assert_eq!(overlapping.buffer_len(), Err(Error::ImmediateOffsetOverlap));
    }

    #[test]
    fn additional_cdb_moves_descriptors() {
        let cdb32: [u8; 32] = core::array::from_fn(|i| 0x7f + i as u8);
        let repr = CmdRepr {
            sol_not: SolNot::empty(),
            tag: 2,
            lun: Lun::default(),
            task_attr: TaskAttr::Simple,
            cdb: &cdb32,
            data_out: DataOut::None,
            data_in: DataIn::Direct(DirectDesc {
                va: 1,
                rkey: 2,
                len: 3,
            }),
        };
        let mut buf = [0u8; 80];
        repr.emit(&mut Cmd::new_unchecked(&mut buf[..])).unwrap();
        assert_eq!(buf[31], 16);
        let view = Cmd::new_unchecked(&buf[..]);
        assert_eq!(view.desc_offset(), 64);
        assert_eq!(CmdRepr::parse(&view, None), Ok(repr));
        // The reserved low bits of add_cdb_len do not move the descriptors.
        buf[31] = 16 | 3;
        assert_eq!(
            CmdRepr::parse(&Cmd::new_unchecked(&buf[..]), None),
            Ok(repr)
        );
        // A CDB that is not a multiple of 4 past 16 is padded.
        let cdb18 = [1u8; 18];
        let odd = CmdRepr {
            cdb: &cdb18,
            ..repr
        };
        assert_eq!(odd.buffer_len(), Ok(48 + 4 + 16));
        let too_long = [0u8; MAX_CDB_LEN + 1];
        assert_eq!(
            CmdRepr {
                cdb: &too_long,
                ..repr
            }
            .buffer_len(),
            Err(Error::CdbTooLong)
        );
        let longest = [0u8; MAX_CDB_LEN];
        assert_eq!(
            CmdRepr {
                cdb: &longest,
                ..repr
            }
            .buffer_len(),
            Ok(48 + 252 + 16)
        );
    }

    #[test]
    fn malformed_formats_and_bounds() {
        let mut buf = [0u8; 64];
        buf[0] = 0x02;
        buf[5] = 0x40;
        assert_eq!(
            CmdRepr::parse(&Cmd::new_unchecked(&buf[..]), None),
            Err(Error::ReservedDescFormat(4))
        );
        buf[5] = 0x03;
        assert_eq!(
            CmdRepr::parse(&Cmd::new_unchecked(&buf[..]), None),
            Err(Error::ImmediateDataIn)
        );
        buf[5] = 0x0F;
        assert_eq!(
            CmdRepr::parse(&Cmd::new_unchecked(&buf[..]), None),
            Err(Error::ReservedDescFormat(15))
        );
        buf[5] = 0x11; // bidirectional direct: needs 48 + 32 bytes
        assert_eq!(
            CmdRepr::parse(&Cmd::new_unchecked(&buf[..]), None),
            Err(Error::DescriptorOutOfBounds)
        );
        buf[5] = 0x02; // indirect DATA-IN, 0 inline, needs 20 bytes
        assert_eq!(
            CmdRepr::parse(&Cmd::new_unchecked(&buf[..]), None),
            Err(Error::DescriptorOutOfBounds)
        );
        buf[5] = 0x30; // immediate, 4-byte descriptor fits, data length 0
        assert_eq!(
            CmdRepr::parse(&Cmd::new_unchecked(&buf[..]), Some(52)).map(|r| r.data_out),
            Ok(DataOut::Immediate {
                offset: 52,
                data: &[]
            })
        );
        buf[5] = 0;
        buf[31] = 20; // additional CDB past the end
        assert_eq!(
            CmdRepr::parse(&Cmd::new_unchecked(&buf[..]), None),
            Err(Error::Truncated)
        );
        assert_eq!(
            CmdRepr::parse(&Cmd::new_unchecked(&buf[..47]), None),
            Err(Error::Truncated)
        );
        buf[0] = 0x01;
        assert_eq!(
            CmdRepr::parse(&Cmd::new_unchecked(&buf[..]), None),
            Err(Error::WrongOpcode(0x01))
        );
    }

    #[test]
    fn indirect_table_checked_against_counts() {
        let descs = [DirectDesc {
            va: 0,
            rkey: 1,
            len: 8,
        }; 2];
        let repr = CmdRepr {
            sol_not: SolNot::empty(),
            tag: 0,
            lun: Lun::default(),
            task_attr: TaskAttr::Simple,
            cdb: &[0; 16],
            data_out: DataOut::None,
            data_in: DataIn::Indirect(IndirectDesc::inline(0, 0, &descs).unwrap()),
        };
        let mut buf = [0u8; 120];
        repr.emit(&mut Cmd::new_unchecked(&mut buf[..])).unwrap();
        assert_eq!(
            CmdRepr::parse(&Cmd::new_unchecked(&buf[..100]), None),
            Ok(repr)
        );
        buf[7] = 1; // one inline descriptor, table of two
        assert_eq!(
            CmdRepr::parse(&Cmd::new_unchecked(&buf[..]), None),
            Err(Error::ExternalIndirectTable)
        );
        buf[7] = 3; // three inline, table of two
        assert_eq!(
            CmdRepr::parse(&Cmd::new_unchecked(&buf[..]), None),
            Err(Error::IndirectCountMismatch)
        );
        buf[7] = 4; // four inline descriptors do not fit the buffer
        assert_eq!(
            CmdRepr::parse(&Cmd::new_unchecked(&buf[..]), None),
            Err(Error::DescriptorOutOfBounds)
        );
        buf[7] = 2;
        buf[63] = 33; // table length 33
        assert_eq!(
            CmdRepr::parse(&Cmd::new_unchecked(&buf[..]), None),
            Err(Error::IndirectTableMisaligned)
        );
        buf[63] = 32;
        buf[67] = 17; // total length 17, descriptors sum to 16
        assert_eq!(
            CmdRepr::parse(&Cmd::new_unchecked(&buf[..]), None),
            Err(Error::IndirectLengthMismatch)
        );
    }

    #[test]
    fn emit_errors() {
        let descs = [DirectDesc::default(); 256];
        let forged = IndirectDesc {
            table: DirectDesc {
                va: 0,
                rkey: 0,
                len: 256 * 16,
            },
            total_len: 0,
            descs: DescList::from_slice(&descs),
        };
        let repr = CmdRepr {
            sol_not: SolNot::empty(),
            tag: 0,
            lun: Lun::default(),
            task_attr: TaskAttr::Simple,
            cdb: &[0; 16],
            data_out: DataOut::Indirect(forged),
            data_in: DataIn::None,
        };
        assert_eq!(repr.buffer_len(), Err(Error::TooManyDescriptors));
        let small = CmdRepr {
            data_out: DataOut::None,
            ..repr
        };
        let mut buf = [0u8; 47];
        assert_eq!(
            small.emit(&mut Cmd::new_unchecked(&mut buf[..])),
            Err(Error::BufferTooSmall)
        );
        let bad = IndirectDesc {
            total_len: 1,
            ..IndirectDesc::inline(0, 0, &descs[..1]).unwrap()
        };
        let mut buf = [0u8; 200];
        assert_eq!(
            CmdRepr {
                data_out: DataOut::None,
                data_in: DataIn::Indirect(bad),
                ..repr
            }
            .emit(&mut Cmd::new_unchecked(&mut buf[..])),
            Err(Error::IndirectLengthMismatch)
        );
    }

    #[test]
    fn task_attr_codes() {
        for code in 0..8u8 {
            let attr = TaskAttr::from_code(code);
            assert_eq!(attr.code(), code);
            assert_eq!(
                matches!(attr, TaskAttr::Other(_)),
                matches!(code, 3 | 5 | 6 | 7)
            );
        }
        assert_eq!(TaskAttr::from_code(0xF9), TaskAttr::HeadOfQueue);
    }
}
