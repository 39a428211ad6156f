//! SRP data buffer descriptors: direct (`srp_direct_buf`, 16 bytes), indirect
//! (`srp_indirect_buf`, 20 bytes + inline list) and SRP-2 immediate
//! (`srp_imm_buf`, 4 bytes).
//!
//! A direct descriptor names one remote buffer (virtual address, R_Key,
//! length). An indirect descriptor names a *table* of direct descriptors in
//! initiator memory, the total transfer length, and carries (a prefix of) the
//! table inline in the IU. The descriptor *format* of each direction is a
//! nibble of `SRP_CMD.buf_fmt`: high nibble DATA-OUT, low nibble DATA-IN.

use static_assertions::const_assert_eq;

use super::{Error, Result};
use crate::wire::bytes::{self, FieldCodec};

mod field {
    use crate::wire::Field;

    // srp_direct_buf
    pub const VA: Field = 0..8;
    pub const KEY: Field = 8..12;
    pub const LEN: Field = 12..16;

    // srp_indirect_buf
    pub const TABLE_DESC: Field = 0..16;
    pub const TOTAL_LEN: Field = 16..20;
    pub const DESC_LIST: usize = 20;

    // srp_imm_buf
    pub const IMM_LEN: Field = 0..4;
}

/// Size of a direct data buffer descriptor.
pub const DIRECT_LEN: usize = field::LEN.end;
/// Size of the fixed part of an indirect data buffer descriptor.
pub const INDIRECT_LEN: usize = field::DESC_LIST;
/// Size of an immediate data buffer descriptor.
pub const IMM_LEN: usize = field::IMM_LEN.end;

const_assert_eq!(DIRECT_LEN, 16);
const_assert_eq!(INDIRECT_LEN, 20);
const_assert_eq!(field::TABLE_DESC.end, field::TOTAL_LEN.start);
const_assert_eq!(field::TOTAL_LEN.end, field::DESC_LIST);
const_assert_eq!(IMM_LEN, 4);

/// A data buffer descriptor format: one nibble of `SRP_CMD.buf_fmt`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DescFormat {
    /// `SRP_NO_DATA_DESC`: no data in this direction.
    None = 0,
    /// `SRP_DATA_DESC_DIRECT`: one direct descriptor.
    Direct = 1,
    /// `SRP_DATA_DESC_INDIRECT`: an indirect descriptor.
    Indirect = 2,
    /// `SRP_DATA_DESC_IMM` (SRP-2): an immediate descriptor, data in the IU.
    /// Valid for DATA-OUT only.
    Immediate = 3,
}

impl DescFormat {
    /// Decodes a nibble.
    ///
    /// # Errors
    ///
    /// [`Error::ReservedDescFormat`] for 4..=15.
    pub const fn from_nibble(nibble: u8) -> Result<Self> {
        match nibble {
            0 => Ok(Self::None),
            1 => Ok(Self::Direct),
            2 => Ok(Self::Indirect),
            3 => Ok(Self::Immediate),
            other => Err(Error::ReservedDescFormat(other)),
        }
    }

    /// Packs a DATA-OUT and a DATA-IN format into the `buf_fmt` byte.
    pub const fn pack(data_out: Self, data_in: Self) -> u8 {
        ((data_out as u8) << 4) | data_in as u8
    }
}

/// One remote buffer: the value of a direct data buffer descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct DirectDesc {
    /// Virtual address (or offset, for zero-based MRs) of the buffer.
    pub va: u64,
    /// The R_Key the target uses for its RDMA READ/WRITE.
    pub rkey: u32,
    /// Buffer length in bytes.
    pub len: u32,
}

wire_view! {
    /// A view of a direct data buffer descriptor (`srp_direct_buf`).
    pub struct DirectBuf, min_len = DIRECT_LEN, error = Error, truncated = Error::Truncated;
    /// Virtual address.
    va, set_va: u64 = field::VA;
    /// R_Key (SRP calls it the memory handle).
    key, set_key: u32 = field::KEY;
    /// Length in bytes.
    length, set_length: u32 = field::LEN;
}

impl DirectDesc {
    /// Reads a direct descriptor from a view.
    pub fn parse<T: AsRef<[u8]>>(view: &DirectBuf<T>) -> Result<Self> {
        view.check_len()?;
        Ok(Self {
            va: view.va(),
            rkey: view.key(),
            len: view.length(),
        })
    }

    /// Bytes [`Self::emit`] writes.
    pub const fn buffer_len(&self) -> usize {
        DIRECT_LEN
    }

    /// Writes the descriptor.
    ///
    /// # Errors
    ///
    /// [`Error::BufferTooSmall`].
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, view: &mut DirectBuf<T>) -> Result<()> {
        super::check_emit_len(view.as_bytes(), DIRECT_LEN)?;
        view.set_va(self.va);
        view.set_key(self.rkey);
        view.set_length(self.len);
        Ok(())
    }
}

impl FieldCodec for DirectDesc {
    const SIZE: usize = DIRECT_LEN;
    #[inline]
    fn read(buf: &[u8], at: usize) -> Self {
        Self {
            va: u64::read(buf, at.saturating_add(field::VA.start)),
            rkey: u32::read(buf, at.saturating_add(field::KEY.start)),
            len: u32::read(buf, at.saturating_add(field::LEN.start)),
        }
    }
    #[inline]
    fn write(self, buf: &mut [u8], at: usize) {
        self.va.write(buf, at.saturating_add(field::VA.start));
        self.rkey.write(buf, at.saturating_add(field::KEY.start));
        self.len.write(buf, at.saturating_add(field::LEN.start));
    }
}

/// A list of direct descriptors: either the inline list of a received IU, or
/// a caller's slice to be emitted. Both iterate as [`DirectDesc`] values and
/// compare equal when they hold the same descriptors.
#[derive(Debug, Clone, Copy)]
pub struct DescList<'a>(DescListInner<'a>);

#[derive(Debug, Clone, Copy)]
enum DescListInner<'a> {
    /// `16 * n` wire bytes.
    Wire(&'a [u8]),
    Slice(&'a [DirectDesc]),
}

impl<'a> DescList<'a> {
    /// A list to emit, from the caller's descriptors.
    pub const fn from_slice(descs: &'a [DirectDesc]) -> Self {
        Self(DescListInner::Slice(descs))
    }

    /// A list over wire bytes; a trailing partial descriptor is ignored.
    pub(crate) const fn from_wire(bytes: &'a [u8]) -> Self {
        Self(DescListInner::Wire(bytes))
    }

    /// Number of descriptors.
    pub const fn len(&self) -> usize {
        match self.0 {
            DescListInner::Wire(bytes) => bytes.len() / DIRECT_LEN,
            DescListInner::Slice(descs) => descs.len(),
        }
    }

    /// Whether the list is empty.
    pub const fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The `index`th descriptor.
    pub fn get(&self, index: usize) -> Option<DirectDesc> {
        match self.0 {
            DescListInner::Wire(bytes) => {
                let at = index.checked_mul(DIRECT_LEN)?;
                let raw = bytes::sub(bytes, at, DIRECT_LEN)?;
                Some(DirectDesc::read(raw, 0))
            }
            DescListInner::Slice(descs) => descs.get(index).copied(),
        }
    }

    /// Iterates over the descriptors.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = DirectDesc> + 'a {
        let list = *self;
        (0..list.len()).map(move |i| list.get(i).unwrap_or_default())
    }

    /// Sum of the descriptor lengths (saturating; a list that fits in memory
    /// cannot reach `u64::MAX`).
    pub fn total_len(&self) -> u64 {
        self.iter()
            .map(|d| u64::from(d.len))
            .fold(0u64, u64::saturating_add)
    }
}

impl PartialEq for DescList<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.iter().zip(other.iter()).all(|(a, b)| a == b)
    }
}

impl Eq for DescList<'_> {}

/// The value of an indirect data buffer descriptor with its inline list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndirectDesc<'a> {
    /// Where the whole descriptor table lives in initiator memory; its
    /// `len` is `16 * number of descriptors`.
    pub table: DirectDesc,
    /// Total transfer length: the sum of all descriptor lengths.
    pub total_len: u32,
    /// The descriptors carried in the IU.
    pub descs: DescList<'a>,
}

impl<'a> IndirectDesc<'a> {
    /// An indirect descriptor whose table is carried whole in the IU, as
    /// this initiator always sends it: `table.len` and `total_len` are
    /// computed from `descs`; `table_va`/`table_rkey` say where the same
    /// table lives in registered initiator memory (targets that fetch it
    /// use them; Linux `ib_srpt` never does).
    ///
    /// # Errors
    ///
    /// [`Error::TooManyDescriptors`] beyond 255 descriptors,
    /// [`Error::LengthOverflow`] if the lengths sum past `u32::MAX`.
    pub fn inline(table_va: u64, table_rkey: u32, descs: &'a [DirectDesc]) -> Result<Self> {
        let list = DescList::from_slice(descs);
        if list.len() > usize::from(u8::MAX) {
            return Err(Error::TooManyDescriptors);
        }
        let total_len = u32::try_from(list.total_len()).map_err(|_| Error::LengthOverflow)?;
        Ok(Self {
            table: DirectDesc {
                va: table_va,
                rkey: table_rkey,
                len: super::len_u32(list.len() * DIRECT_LEN)?,
            },
            total_len,
            descs: list,
        })
    }

    /// Bytes the descriptor occupies in an IU (fixed part + inline list).
    pub const fn buffer_len(&self) -> usize {
        INDIRECT_LEN + self.descs.len() * DIRECT_LEN
    }

    /// Checks the spec-level invariants of an indirect descriptor whose
    /// inline list must be the whole table.
    ///
    /// # Errors
    ///
    /// [`Error::IndirectTableMisaligned`], [`Error::IndirectCountMismatch`],
    /// [`Error::ExternalIndirectTable`], [`Error::IndirectLengthMismatch`].
    pub fn validate(&self) -> Result<()> {
        if self.table.len % DIRECT_LEN as u32 != 0 {
            return Err(Error::IndirectTableMisaligned);
        }
        let table_count = (self.table.len / DIRECT_LEN as u32) as usize;
        let inline = self.descs.len();
        if inline > table_count {
            return Err(Error::IndirectCountMismatch);
        }
        if inline < table_count {
            return Err(Error::ExternalIndirectTable);
        }
        if self.descs.total_len() != u64::from(self.total_len) {
            return Err(Error::IndirectLengthMismatch);
        }
        Ok(())
    }
}

wire_view! {
    /// A view of an indirect data buffer descriptor (`srp_indirect_buf`):
    /// table descriptor, total length, inline descriptor list.
    pub struct IndirectBuf, min_len = INDIRECT_LEN, error = Error, truncated = Error::Truncated;
    /// Where the descriptor table lives; `len / 16` is the descriptor count.
    table_desc, set_table_desc: DirectDesc = field::TABLE_DESC;
    /// Total transfer length in bytes.
    total_len, set_total_len: u32 = field::TOTAL_LEN;
}

impl<'a, T: AsRef<[u8]> + ?Sized> IndirectBuf<&'a T> {
    /// The first `count` inline descriptors.
    ///
    /// # Errors
    ///
    /// [`Error::DescriptorOutOfBounds`] if they extend past the buffer.
    pub fn desc_list(&self, count: u8) -> Result<DescList<'a>> {
        let bytes = bytes::sub(
            self.buffer.as_ref(),
            field::DESC_LIST,
            usize::from(count) * DIRECT_LEN,
        )
        .ok_or(Error::DescriptorOutOfBounds)?;
        Ok(DescList::from_wire(bytes))
    }
}

impl<'a> IndirectDesc<'a> {
    /// Reads an indirect descriptor whose IU says it carries `count` inline
    /// descriptors, and checks it (see [`Self::validate`]).
    ///
    /// # Errors
    ///
    /// [`Error::DescriptorOutOfBounds`] and the [`Self::validate`] errors.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(view: &IndirectBuf<&'a T>, count: u8) -> Result<Self> {
        if view.check_len().is_err() {
            return Err(Error::DescriptorOutOfBounds);
        }
        let desc = Self {
            table: view.table_desc(),
            total_len: view.total_len(),
            descs: view.desc_list(count)?,
        };
        desc.validate()?;
        Ok(desc)
    }

    /// Writes the descriptor and its inline list, after [`Self::validate`].
    ///
    /// # Errors
    ///
    /// [`Error::BufferTooSmall`], [`Error::TooManyDescriptors`] and the
    /// [`Self::validate`] errors.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, view: &mut IndirectBuf<T>) -> Result<()> {
        if self.descs.len() > usize::from(u8::MAX) {
            return Err(Error::TooManyDescriptors);
        }
        self.validate()?;
        super::check_emit_len(view.as_bytes(), self.buffer_len())?;
        view.set_table_desc(self.table);
        view.set_total_len(self.total_len);
        let buf = view.as_bytes_mut();
        for (i, desc) in self.descs.iter().enumerate() {
            desc.write(buf, field::DESC_LIST + i * DIRECT_LEN);
        }
        Ok(())
    }
}

wire_view! {
    /// A view of an SRP-2 immediate data buffer descriptor (`srp_imm_buf`).
    pub struct ImmBuf, min_len = IMM_LEN, error = Error, truncated = Error::Truncated;
    /// Length of the immediate data, which starts at the negotiated offset.
    length, set_length: u32 = field::IMM_LEN;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn direct_golden_bytes() {
        let desc = DirectDesc {
            va: 0x0000_7f00_1234_5000,
            rkey: 0xabcd_0102,
            len: 4096,
        };
        let mut buf = [0u8; 16];
        desc.emit(&mut DirectBuf::new_unchecked(&mut buf[..]))
            .unwrap();
        assert_eq!(
            buf,
            [
                0x00, 0x00, 0x7f, 0x00, 0x12, 0x34, 0x50, 0x00, // va
                0xab, 0xcd, 0x01, 0x02, // key
                0x00, 0x00, 0x10, 0x00, // len
            ]
        );
        assert_eq!(
            DirectDesc::parse(&DirectBuf::new_unchecked(&buf[..])).unwrap(),
            desc
        );
        assert_eq!(
            DirectDesc::parse(&DirectBuf::new_unchecked(&buf[..15])),
            Err(Error::Truncated)
        );
        assert_eq!(
            desc.emit(&mut DirectBuf::new_unchecked(&mut buf[..15])),
            Err(Error::BufferTooSmall)
        );
    }

    #[test]
    fn format_nibbles() {
        assert_eq!(
            DescFormat::pack(DescFormat::Immediate, DescFormat::Direct),
            0x31
        );
        assert_eq!(DescFormat::from_nibble(2), Ok(DescFormat::Indirect));
        assert_eq!(
            DescFormat::from_nibble(4),
            Err(Error::ReservedDescFormat(4))
        );
    }

    #[test]
    fn indirect_invariants() {
        let descs = [
            DirectDesc {
                va: 0x1000,
                rkey: 1,
                len: 512,
            },
            DirectDesc {
                va: 0x3000,
                rkey: 2,
                len: 1024,
            },
        ];
        let good = IndirectDesc::inline(0x9000, 7, &descs).unwrap();
        assert_eq!(
            good.table,
            DirectDesc {
                va: 0x9000,
                rkey: 7,
                len: 32
            }
        );
        assert_eq!(good.total_len, 1536);
        assert_eq!(good.validate(), Ok(()));

        let mut bad = good;
        bad.table.len = 33;
        assert_eq!(bad.validate(), Err(Error::IndirectTableMisaligned));
        bad.table.len = 16;
        assert_eq!(bad.validate(), Err(Error::IndirectCountMismatch));
        bad.table.len = 48;
        assert_eq!(bad.validate(), Err(Error::ExternalIndirectTable));
        bad.table.len = 32;
        bad.total_len = 1535;
        assert_eq!(bad.validate(), Err(Error::IndirectLengthMismatch));

        let mut buf = [0u8; 52];
        good.emit(&mut IndirectBuf::new_unchecked(&mut buf[..]))
            .unwrap();
        let parsed = IndirectDesc::parse(&IndirectBuf::new_unchecked(&buf[..]), 2).unwrap();
        assert_eq!(parsed, good);
        assert_eq!(
            IndirectDesc::parse(&IndirectBuf::new_unchecked(&buf[..51]), 2),
            Err(Error::DescriptorOutOfBounds)
        );
        assert_eq!(
            bad.emit(&mut IndirectBuf::new_unchecked(&mut buf[..])),
            Err(Error::IndirectLengthMismatch)
        );
        assert_eq!(
            good.emit(&mut IndirectBuf::new_unchecked(&mut buf[..51])),
            Err(Error::BufferTooSmall)
        );
    }

    #[test]
    fn too_many_inline_descriptors() {
        let descs = [DirectDesc::default(); 256];
        assert_eq!(
            IndirectDesc::inline(0, 0, &descs),
            Err(Error::TooManyDescriptors)
        );
        let list = DescList::from_slice(&descs);
        let forged = IndirectDesc {
            table: DirectDesc {
                va: 0,
                rkey: 0,
                len: 256 * 16,
            },
            total_len: 0,
            descs: list,
        };
        let mut buf = vec![0u8; forged.buffer_len()];
        assert_eq!(
            forged.emit(&mut IndirectBuf::new_unchecked(&mut buf[..])),
            Err(Error::TooManyDescriptors)
        );
    }

    #[test]
    fn length_sum_overflow_is_an_error() {
        let descs = [DirectDesc {
            va: 0,
            rkey: 0,
            len: u32::MAX,
        }; 2];
        assert_eq!(
            IndirectDesc::inline(0, 0, &descs),
            Err(Error::LengthOverflow)
        );
    }
}
