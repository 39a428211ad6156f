//! Parameter data an initiator reads itself: READ CAPACITY(10/16), standard
//! INQUIRY, REPORT LUNS. The software targets build the same layouts with
//! the `emit` side.

use core::fmt;

use static_assertions::const_assert_eq;

use super::{Lun, scsi_view};
use crate::wire::bytes::{self, FieldCodec};

/// Why parameter data could not be parsed or built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DataError {
    /// Fewer bytes than the fixed layout (8 for READ CAPACITY(10), 32 for
    /// READ CAPACITY(16), 36 for standard INQUIRY, 8 for the REPORT LUNS
    /// header).
    Truncated,
    /// A value does not fit its field (emit only).
    NotRepresentable,
    /// The output buffer is too small (emit only).
    BufferTooSmall,
}

impl fmt::Display for DataError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Truncated => "parameter data too short",
            Self::NotRepresentable => "value does not fit the parameter data",
            Self::BufferTooSmall => "buffer too small for the parameter data",
        })
    }
}

mod rc10 {
    use crate::wire::Field;

    pub const LAST_LBA: Field = 0..4;
    pub const BLOCK_LEN: Field = 4..8;
    pub const LEN: usize = BLOCK_LEN.end;
}

mod rc16 {
    use crate::wire::Field;

    pub const LAST_LBA: Field = 0..8;
    pub const BLOCK_LEN: Field = 8..12;
    pub const PROTECTION: Field = 12..13;
    pub const EXPONENTS: Field = 13..14;
    pub const PROVISIONING_ALIGNMENT: Field = 14..16;
    pub const LEN: usize = 32;
}

mod inquiry {
    use crate::wire::Field;

    pub const PERIPHERAL: Field = 0..1;
    pub const RMB: Field = 1..2;
    pub const VERSION: Field = 2..3;
    pub const FORMAT_FLAGS: Field = 3..4;
    pub const ADDITIONAL_LEN: Field = 4..5;
    pub const FLAGS5: Field = 5..6;
    pub const FLAGS6: Field = 6..7;
    pub const FLAGS7: Field = 7..8;
    pub const VENDOR: Field = 8..16;
    pub const PRODUCT: Field = 16..32;
    pub const REVISION: Field = 32..36;
    pub const LEN: usize = REVISION.end;
}

mod luns {
    use crate::wire::Field;

    pub const LIST_LEN: Field = 0..4;
    pub const HEADER_LEN: usize = 8;
    pub const ENTRY_LEN: usize = 8;
}

const_assert_eq!(rc10::LEN, 8);
const_assert_eq!(inquiry::LEN, 36);
const_assert_eq!(luns::HEADER_LEN, luns::LIST_LEN.end + 4);

scsi_view! {
    /// READ CAPACITY(10) parameter data (8 bytes).
    pub struct ReadCapacity10Data, min_len = rc10::LEN, error: DataError = DataError::Truncated;
    /// RETURNED LOGICAL BLOCK ADDRESS (0xFFFFFFFF: use READ CAPACITY(16)).
    last_lba, set_last_lba: u32 = rc10::LAST_LBA;
    /// LOGICAL BLOCK LENGTH IN BYTES.
    block_len, set_block_len: u32 = rc10::BLOCK_LEN;
}

scsi_view! {
    /// READ CAPACITY(16) parameter data (32 bytes).
    pub struct ReadCapacity16Data, min_len = rc16::LEN, error: DataError = DataError::Truncated;
    /// RETURNED LOGICAL BLOCK ADDRESS.
    last_lba, set_last_lba: u64 = rc16::LAST_LBA;
    /// LOGICAL BLOCK LENGTH IN BYTES.
    block_len, set_block_len: u32 = rc16::BLOCK_LEN;
    /// Byte 12: P_TYPE (bits 3..1) and PROT_EN (bit 0).
    protection, set_protection: u8 = rc16::PROTECTION;
    /// Byte 13: P_I_EXPONENT (bits 7..4), LOGICAL BLOCKS PER PHYSICAL BLOCK
    /// EXPONENT (bits 3..0).
    exponents, set_exponents: u8 = rc16::EXPONENTS;
    /// Bytes 14..16: LBPME (bit 15), LBPRZ (bit 14), LOWEST ALIGNED LOGICAL
    /// BLOCK ADDRESS (bits 13..0).
    provisioning_alignment, set_provisioning_alignment: u16 = rc16::PROVISIONING_ALIGNMENT;
}

/// READ CAPACITY(10) data, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ReadCapacity10Repr {
    /// The last LBA, or 0xFFFFFFFF when the capacity needs READ
    /// CAPACITY(16).
    pub last_lba: u32,
    /// Logical block length in bytes.
    pub block_len: u32,
}

impl ReadCapacity10Repr {
    /// The answer for a medium of `blocks` blocks: the last LBA, or
    /// 0xFFFFFFFF when it does not fit 32 bits (SBC-3 5.16.2). `blocks` 0
    /// (no medium) gives last LBA 0.
    pub const fn for_capacity(blocks: u64, block_len: u32) -> Self {
        let last = blocks.saturating_sub(1);
        Self {
            last_lba: if last > 0xFFFF_FFFE {
                u32::MAX
            } else {
                last as u32
            },
            block_len,
        }
    }

    /// Parses the 8 bytes.
    ///
    /// # Errors
    ///
    /// [`DataError::Truncated`].
    pub fn parse<T: AsRef<[u8]> + ?Sized>(
        data: &ReadCapacity10Data<&T>,
    ) -> Result<Self, DataError> {
        data.check_len()?;
        Ok(Self {
            last_lba: data.last_lba(),
            block_len: data.block_len(),
        })
    }

    /// Bytes [`Self::emit`] writes.
    pub const fn buffer_len(&self) -> usize {
        rc10::LEN
    }

    /// Writes the 8 bytes.
    ///
    /// # Errors
    ///
    /// [`DataError::BufferTooSmall`].
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(
        &self,
        data: &mut ReadCapacity10Data<T>,
    ) -> Result<(), DataError> {
        data.check_len().map_err(|_| DataError::BufferTooSmall)?;
        data.set_last_lba(self.last_lba);
        data.set_block_len(self.block_len);
        Ok(())
    }
}

/// READ CAPACITY(16) data, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ReadCapacity16Repr {
    /// The last LBA.
    pub last_lba: u64,
    /// Logical block length in bytes.
    pub block_len: u32,
    /// PROT_EN: protection information enabled.
    pub prot_en: bool,
    /// P_TYPE (3 bits).
    pub p_type: u8,
    /// P_I_EXPONENT (4 bits).
    pub p_i_exponent: u8,
    /// LOGICAL BLOCKS PER PHYSICAL BLOCK EXPONENT (4 bits).
    pub blocks_per_physical_exponent: u8,
    /// LBPME: thin provisioned (UNMAP works).
    pub lbpme: bool,
    /// LBPRZ: unmapped blocks read as zeros.
    pub lbprz: bool,
    /// LOWEST ALIGNED LOGICAL BLOCK ADDRESS (14 bits).
    pub lowest_aligned_lba: u16,
}

impl ReadCapacity16Repr {
    /// Parses the 32 bytes; reserved bits are ignored.
    ///
    /// # Errors
    ///
    /// [`DataError::Truncated`].
    pub fn parse<T: AsRef<[u8]> + ?Sized>(
        data: &ReadCapacity16Data<&T>,
    ) -> Result<Self, DataError> {
        data.check_len()?;
        let protection = data.protection();
        let exponents = data.exponents();
        let provisioning = data.provisioning_alignment();
        Ok(Self {
            last_lba: data.last_lba(),
            block_len: data.block_len(),
            prot_en: protection & 0x01 != 0,
            p_type: (protection >> 1) & 0x07,
            p_i_exponent: exponents >> 4,
            blocks_per_physical_exponent: exponents & 0x0F,
            lbpme: provisioning & 0x8000 != 0,
            lbprz: provisioning & 0x4000 != 0,
            lowest_aligned_lba: provisioning & 0x3FFF,
        })
    }

    /// Bytes [`Self::emit`] writes.
    pub const fn buffer_len(&self) -> usize {
        rc16::LEN
    }

    /// Writes the 32 bytes (reserved bytes zero).
    ///
    /// # Errors
    ///
    /// [`DataError::BufferTooSmall`]; [`DataError::NotRepresentable`] for a
    /// field value wider than its field.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(
        &self,
        data: &mut ReadCapacity16Data<T>,
    ) -> Result<(), DataError> {
        data.check_len().map_err(|_| DataError::BufferTooSmall)?;
        if self.p_type > 7
            || self.p_i_exponent > 15
            || self.blocks_per_physical_exponent > 15
            || self.lowest_aligned_lba > 0x3FFF
        {
            return Err(DataError::NotRepresentable);
        }
        bytes::zero(data.as_bytes_mut(), 0, rc16::LEN);
        data.set_last_lba(self.last_lba);
        data.set_block_len(self.block_len);
        data.set_protection((self.p_type << 1) | u8::from(self.prot_en));
        data.set_exponents((self.p_i_exponent << 4) | self.blocks_per_physical_exponent);
        let mut provisioning = self.lowest_aligned_lba;
        if self.lbpme {
            provisioning |= 0x8000;
        }
        if self.lbprz {
            provisioning |= 0x4000;
        }
        data.set_provisioning_alignment(provisioning);
        Ok(())
    }
}

scsi_view! {
    /// Standard INQUIRY data, the first 36 bytes (SPC-4 6.4.2).
    pub struct StandardInquiry, min_len = inquiry::LEN, error: DataError = DataError::Truncated;
    /// Byte 0: PERIPHERAL QUALIFIER (bits 7..5), DEVICE TYPE (bits 4..0).
    peripheral, set_peripheral: u8 = inquiry::PERIPHERAL;
    /// Byte 1: RMB (bit 7).
    rmb_byte, set_rmb_byte: u8 = inquiry::RMB;
    /// VERSION (0x06: SPC-4).
    version, set_version: u8 = inquiry::VERSION;
    /// Byte 3: NORMACA (bit 5), HISUP (bit 4), RESPONSE DATA FORMAT (3..0).
    format_flags, set_format_flags: u8 = inquiry::FORMAT_FLAGS;
    /// ADDITIONAL LENGTH (bytes after byte 4).
    additional_len, set_additional_len: u8 = inquiry::ADDITIONAL_LEN;
    /// Byte 5: SCCS, ACC, TPGS, 3PC, PROTECT.
    flags5, set_flags5: u8 = inquiry::FLAGS5;
    /// Byte 6: ENCSERV, MULTIP...
    flags6, set_flags6: u8 = inquiry::FLAGS6;
    /// Byte 7: CMDQUE (bit 1).
    flags7, set_flags7: u8 = inquiry::FLAGS7;
    /// T10 VENDOR IDENTIFICATION (ASCII, space padded).
    vendor, set_vendor: [u8; 8] = inquiry::VENDOR;
    /// PRODUCT IDENTIFICATION.
    product, set_product: [u8; 16] = inquiry::PRODUCT;
    /// PRODUCT REVISION LEVEL.
    revision, set_revision: [u8; 4] = inquiry::REVISION;
}

/// Peripheral qualifier 011b with device type 1Fh: "no logical unit here"
/// (SPC-4 6.4.2), the byte 0 of INQUIRY data for a LUN that does not exist.
pub const PERIPHERAL_NO_LUN: u8 = 0x7F;

/// Standard INQUIRY data, decoded (the fields a block initiator uses).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct StandardInquiryRepr {
    /// PERIPHERAL QUALIFIER (3 bits): 0 connected, 1 not connected, 3 no
    /// logical unit.
    pub qualifier: u8,
    /// PERIPHERAL DEVICE TYPE (5 bits): 0x00 direct access block device.
    pub device_type: u8,
    /// RMB: removable medium.
    pub removable: bool,
    /// VERSION.
    pub version: u8,
    /// NORMACA.
    pub normaca: bool,
    /// HISUP: hierarchical LUN addressing.
    pub hisup: bool,
    /// RESPONSE DATA FORMAT (4 bits, 2 for SPC-2 and later).
    pub response_format: u8,
    /// ADDITIONAL LENGTH as received (emit writes 31, for 36 bytes).
    pub additional_len: u8,
    /// TPGS (2 bits): ALUA support.
    pub tpgs: u8,
    /// 3PC: third-party copy.
    pub third_party_copy: bool,
    /// PROTECT: protection information supported.
    pub protect: bool,
    /// MULTIP: multiple ports.
    pub multi_port: bool,
    /// CMDQUE: command queuing (Windows requires it for tagged queuing).
    pub cmdque: bool,
    /// T10 vendor identification.
    pub vendor: [u8; 8],
    /// Product identification.
    pub product: [u8; 16],
    /// Product revision level.
    pub revision: [u8; 4],
}

impl StandardInquiryRepr {
    /// Parses the first 36 bytes; other bits are ignored.
    ///
    /// # Errors
    ///
    /// [`DataError::Truncated`].
    pub fn parse<T: AsRef<[u8]> + ?Sized>(data: &StandardInquiry<&T>) -> Result<Self, DataError> {
        data.check_len()?;
        let peripheral = data.peripheral();
        let format = data.format_flags();
        let flags5 = data.flags5();
        Ok(Self {
            qualifier: peripheral >> 5,
            device_type: peripheral & 0x1F,
            removable: data.rmb_byte() & 0x80 != 0,
            version: data.version(),
            normaca: format & 0x20 != 0,
            hisup: format & 0x10 != 0,
            response_format: format & 0x0F,
            additional_len: data.additional_len(),
            tpgs: (flags5 >> 4) & 0x03,
            third_party_copy: flags5 & 0x08 != 0,
            protect: flags5 & 0x01 != 0,
            multi_port: data.flags6() & 0x10 != 0,
            cmdque: data.flags7() & 0x02 != 0,
            vendor: data.vendor(),
            product: data.product(),
            revision: data.revision(),
        })
    }

    /// Bytes [`Self::emit`] writes.
    pub const fn buffer_len(&self) -> usize {
        inquiry::LEN
    }

    /// Writes the 36 bytes; ADDITIONAL LENGTH is written as 31 whatever
    /// [`Self::additional_len`] holds.
    ///
    /// # Errors
    ///
    /// [`DataError::BufferTooSmall`]; [`DataError::NotRepresentable`] for a
    /// field value wider than its field.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(
        &self,
        data: &mut StandardInquiry<T>,
    ) -> Result<(), DataError> {
        data.check_len().map_err(|_| DataError::BufferTooSmall)?;
        if self.qualifier > 7
            || self.device_type > 0x1F
            || self.response_format > 0x0F
            || self.tpgs > 3
        {
            return Err(DataError::NotRepresentable);
        }
        let flag = |set: bool, bit: u8| if set { bit } else { 0 };
        bytes::zero(data.as_bytes_mut(), 0, inquiry::LEN);
        data.set_peripheral((self.qualifier << 5) | self.device_type);
        data.set_rmb_byte(flag(self.removable, 0x80));
        data.set_version(self.version);
        data.set_format_flags(
            flag(self.normaca, 0x20) | flag(self.hisup, 0x10) | self.response_format,
        );
        // CAST: 36 - 5 = 31.
        data.set_additional_len((inquiry::LEN - inquiry::ADDITIONAL_LEN.end) as u8);
        data.set_flags5(
            (self.tpgs << 4) | flag(self.third_party_copy, 0x08) | flag(self.protect, 0x01),
        );
        data.set_flags6(flag(self.multi_port, 0x10));
        data.set_flags7(flag(self.cmdque, 0x02));
        data.set_vendor(self.vendor);
        data.set_product(self.product);
        data.set_revision(self.revision);
        Ok(())
    }
}

/// Copies an ASCII identification into a fixed field, space padded (SPC-4
/// 4.4.1: left-aligned, padded with spaces); bytes past the field are
/// dropped.
pub fn ascii_field<const N: usize>(text: &str) -> [u8; N] {
    let mut out = [b' '; N];
    for (dst, src) in out.iter_mut().zip(text.bytes()) {
        *dst = if src.is_ascii_graphic() || src == b' ' {
            src
        } else {
            b'?'
        };
    }
    out
}

/// REPORT LUNS parameter data: an 8-byte header holding the LUN LIST
/// LENGTH, then 8 bytes per LUN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReportLunsData<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> ReportLunsData<T> {
    /// Wraps `buffer` without checking it.
    pub const fn new_unchecked(buffer: T) -> Self {
        Self { buffer }
    }

    /// Wraps `buffer` after [`Self::check_len`].
    ///
    /// # Errors
    ///
    /// [`DataError::Truncated`].
    pub fn new_checked(buffer: T) -> Result<Self, DataError> {
        let view = Self::new_unchecked(buffer);
        view.check_len()?;
        Ok(view)
    }

    /// Checks the header is there. The list may be cut short by the
    /// allocation length; [`Self::luns`] yields only complete entries.
    ///
    /// # Errors
    ///
    /// [`DataError::Truncated`].
    pub fn check_len(&self) -> Result<(), DataError> {
        if self.buffer.as_ref().len() < luns::HEADER_LEN {
            Err(DataError::Truncated)
        } else {
            Ok(())
        }
    }

    /// LUN LIST LENGTH: bytes of the *whole* list at the target (more than
    /// the buffer holds when the allocation length was too small).
    pub fn list_len(&self) -> u32 {
        u32::read(self.buffer.as_ref(), luns::LIST_LEN.start)
    }

    /// How many LUNs the target has (the list length over 8).
    pub fn lun_count(&self) -> u32 {
        self.list_len() / 8
    }

    /// Whether the buffer holds the whole list.
    pub fn is_complete(&self) -> bool {
        let whole = luns::HEADER_LEN as u64 + u64::from(self.list_len());
        self.buffer.as_ref().len() as u64 >= whole
    }

    /// The complete LUN entries in the buffer, in order, up to the list
    /// length.
    pub fn luns(&self) -> impl Iterator<Item = Lun> + '_ {
        let bytes = self.buffer.as_ref();
        let listed = usize::try_from(self.list_len()).unwrap_or(usize::MAX);
        let list = bytes.get(luns::HEADER_LEN..).unwrap_or(&[]);
        let usable = list.len().min(listed);
        list.get(..usable)
            .unwrap_or(&[])
            .chunks_exact(luns::ENTRY_LEN)
            .map(|entry| Lun(bytes::read_array(entry, 0)))
    }
}

/// Bytes of REPORT LUNS data for `count` LUNs.
pub const fn report_luns_len(count: usize) -> usize {
    luns::HEADER_LEN + count * luns::ENTRY_LEN
}

/// Writes REPORT LUNS data for `list` into `out`, truncated byte-wise to
/// `out.len()` as an allocation length truncates it; the LUN LIST LENGTH
/// always describes the whole list. Returns the bytes written.
///
/// # Errors
///
/// [`DataError::NotRepresentable`] when the list is longer than a 32-bit
/// length can describe.
pub fn emit_report_luns(list: &[Lun], out: &mut [u8]) -> Result<usize, DataError> {
    let list_len = list
        .len()
        .checked_mul(luns::ENTRY_LEN)
        .and_then(|len| u32::try_from(len).ok())
        .ok_or(DataError::NotRepresentable)?;
    let mut header = [0u8; luns::HEADER_LEN];
    list_len.write(&mut header, luns::LIST_LEN.start);
    let entries = list.iter().flat_map(|lun| lun.0);
    let mut written = 0;
    for (dst, src) in out.iter_mut().zip(header.into_iter().chain(entries)) {
        *dst = src;
        written += 1;
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_capacity10_golden_and_saturation() {
        let repr = ReadCapacity10Repr::for_capacity(0x20_0000, 512);
        let mut out = [0u8; 8];
        repr.emit(&mut ReadCapacity10Data::new_unchecked(&mut out))
            .unwrap();
        assert_eq!(out, [0x00, 0x1F, 0xFF, 0xFF, 0x00, 0x00, 0x02, 0x00]);
        assert_eq!(
            ReadCapacity10Repr::parse(&ReadCapacity10Data::new_unchecked(&out[..])),
            Ok(repr)
        );
        assert_eq!(
            ReadCapacity10Repr::for_capacity(1 << 32, 4096).last_lba,
            u32::MAX
        );
        assert_eq!(
            ReadCapacity10Repr::for_capacity(0xFFFF_FFFF, 512).last_lba,
            0xFFFF_FFFE
        );
        assert_eq!(
            ReadCapacity10Repr::parse(&ReadCapacity10Data::new_unchecked(&out[..7])),
            Err(DataError::Truncated)
        );
    }

    #[test]
    fn read_capacity16_golden() {
        let repr = ReadCapacity16Repr {
            last_lba: 0x1_0000_0000,
            block_len: 4096,
            blocks_per_physical_exponent: 3,
            lbpme: true,
            lbprz: true,
            lowest_aligned_lba: 0x0123,
            ..Default::default()
        };
        let mut out = [0xFFu8; 32];
        repr.emit(&mut ReadCapacity16Data::new_unchecked(&mut out))
            .unwrap();
        let mut expected = [0u8; 32];
        expected[..16].copy_from_slice(&[
            0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0x10, 0, 0x00, 0x03, 0xC1, 0x23,
        ]);
        assert_eq!(out, expected);
        assert_eq!(
            ReadCapacity16Repr::parse(&ReadCapacity16Data::new_unchecked(&out[..])),
            Ok(repr)
        );
        let wide = ReadCapacity16Repr { p_type: 8, ..repr };
        assert_eq!(
            wide.emit(&mut ReadCapacity16Data::new_unchecked(&mut out)),
            Err(DataError::NotRepresentable)
        );
    }

    #[test]
    fn inquiry_round_trip() {
        let repr = StandardInquiryRepr {
            version: 6,
            hisup: true,
            response_format: 2,
            additional_len: 31,
            cmdque: true,
            vendor: ascii_field("KVERBS"),
            product: ascii_field("RAMDISK"),
            revision: ascii_field("0001"),
            ..Default::default()
        };
        let mut out = [0u8; 36];
        repr.emit(&mut StandardInquiry::new_unchecked(&mut out))
            .unwrap();
        assert_eq!(&out[..8], &[0x00, 0x00, 0x06, 0x12, 31, 0x00, 0x00, 0x02]);
        assert_eq!(&out[8..16], b"KVERBS  ");
        assert_eq!(
            StandardInquiryRepr::parse(&StandardInquiry::new_unchecked(&out[..])),
            Ok(repr)
        );
        assert_eq!(ascii_field::<4>("a\u{e9}bcdef"), *b"a??b");
    }

    #[test]
    fn emit_refuses_short_buffers() {
        let mut short = [0u8; 31];
        assert_eq!(
            ReadCapacity10Repr::default()
                .emit(&mut ReadCapacity10Data::new_unchecked(&mut short[..7])),
            Err(DataError::BufferTooSmall)
        );
        assert_eq!(
            ReadCapacity16Repr::default().emit(&mut ReadCapacity16Data::new_unchecked(&mut short)),
            Err(DataError::BufferTooSmall)
        );
        assert_eq!(
            StandardInquiryRepr::default().emit(&mut StandardInquiry::new_unchecked(&mut short)),
            Err(DataError::BufferTooSmall)
        );
        assert_eq!(short, [0; 31], "a refused emit writes nothing");
        let wide = StandardInquiryRepr {
            device_type: 0x20,
            ..Default::default()
        };
        assert_eq!(
            wide.emit(&mut StandardInquiry::new_unchecked(&mut [0u8; 36])),
            Err(DataError::NotRepresentable)
        );
    }

    #[test]
    fn report_luns_truncation() {
        let list = [
            Lun::from_index(0).unwrap(),
            Lun::from_index(1).unwrap(),
            Lun::from_index(300).unwrap(),
        ];
        let mut full = [0u8; 64];
        assert_eq!(emit_report_luns(&list, &mut full), Ok(32));
        assert_eq!(&full[..8], &[0, 0, 0, 24, 0, 0, 0, 0]);
        assert_eq!(&full[24..32], &[0x41, 0x2C, 0, 0, 0, 0, 0, 0]);
        let view = ReportLunsData::new_checked(&full[..32]).unwrap();
        assert!(view.is_complete());
        assert_eq!(view.luns().collect::<Vec<_>>(), list);

        let mut cut = [0u8; 20];
        assert_eq!(emit_report_luns(&list, &mut cut), Ok(20));
        let view = ReportLunsData::new_checked(&cut[..]).unwrap();
        assert_eq!(view.lun_count(), 3);
        assert!(!view.is_complete());
        assert_eq!(view.luns().count(), 1);
        assert_eq!(
            ReportLunsData::new_checked(&cut[..7]).err(),
            Some(DataError::Truncated)
        );
        // A list length shorter than the buffer bounds the walk.
        full[3] = 8;
        assert_eq!(ReportLunsData::new_unchecked(&full[..]).luns().count(), 1);
        assert_eq!(report_luns_len(3), 32);
    }
}
