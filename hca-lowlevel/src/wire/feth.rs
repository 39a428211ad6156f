//! FLUSH Extended Transport Header (4 bytes, IBA 1.5 A19.4.1).
//!
//! ```text
//!  bytes 0-3 (big-endian word): reserved(26) | selectivity level(2) | placement type(4)
//! ```

use bitflags::bitflags;

use super::bytes::{self, Field};
use super::{Error, Result};

mod field {
    use super::Field;
    pub const BITS: Field = 0..4;
}

/// The FETH length.
pub const HEADER_LEN: usize = field::BITS.end;
static_assertions::const_assert_eq!(HEADER_LEN, 4);

const PLACEMENT_MASK: u32 = 0x0000_000f;
const SELECTIVITY_MASK: u32 = 0x0000_0030;
const SELECTIVITY_SHIFT: u32 = 4;

bitflags! {
    /// Placement type: what the FLUSH must make the data reach.
    ///
    /// Bits 2 and 3 are reserved; they are kept as received.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct FlushPlacement: u8 {
        /// Global visibility.
        const GLOBAL_VISIBILITY = 0x1;
        /// Persistence.
        const PERSISTENCE = 0x2;
        // The reserved bits of the nibble are retained as unnamed flags.
        const _ = 0x0c;
    }
}

/// Selectivity level: how much of the memory region the FLUSH covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FlushSelectivity {
    /// The range given by the RETH.
    MemoryRange = 0,
    /// The whole memory region of the RETH's R_Key.
    MemoryRegion = 1,
}

fixed_view! {
    /// A view of a FETH at the start of a buffer.
    Feth, HEADER_LEN
}

impl<T: AsRef<[u8]>> Feth<T> {
    /// Placement type bits (four bits).
    pub fn placement_bits(&self) -> u8 {
        // CAST: masked to four bits.
        (self.word() & PLACEMENT_MASK) as u8
    }

    /// Selectivity level bits (two bits).
    pub fn selectivity_bits(&self) -> u8 {
        // CAST: masked to two bits.
        ((self.word() & SELECTIVITY_MASK) >> SELECTIVITY_SHIFT) as u8
    }

    fn word(&self) -> u32 {
        bytes::read_be32(self.buffer.as_ref(), field::BITS)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Feth<T> {
    /// Set both fields; reserved bits are cleared and excess bits dropped.
    pub fn set_bits(&mut self, placement: u8, selectivity: u8) {
        let word = (u32::from(placement) & PLACEMENT_MASK)
            | ((u32::from(selectivity) << SELECTIVITY_SHIFT) & SELECTIVITY_MASK);
        bytes::write_be32(self.buffer.as_mut(), field::BITS, word);
    }
}

/// The meaning of a FETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FethRepr {
    /// Placement type.
    pub placement: FlushPlacement,
    /// Selectivity level.
    pub selectivity: FlushSelectivity,
}

impl FethRepr {
    /// Parse a FETH.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`]; [`Error::BadFlushSelectivity`] for the reserved
    /// levels 2 and 3.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(header: &Feth<&T>) -> Result<FethRepr> {
        header.check_len()?;
        let selectivity = match header.selectivity_bits() {
            0 => FlushSelectivity::MemoryRange,
            1 => FlushSelectivity::MemoryRegion,
            other => return Err(Error::BadFlushSelectivity(other)),
        };
        Ok(FethRepr {
            placement: FlushPlacement::from_bits_retain(header.placement_bits()),
            selectivity,
        })
    }

    /// The length of the emitted header.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Write the header.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, header: &mut Feth<T>) {
        header.set_bits(self.placement.bits(), self.selectivity as u8);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_round_trip() {
        let bytes = [0x00, 0x00, 0x00, 0x13];
        let repr = FethRepr::parse(&Feth::new_checked(&bytes[..]).unwrap()).unwrap();
        assert_eq!(
            repr,
            FethRepr {
                placement: FlushPlacement::GLOBAL_VISIBILITY | FlushPlacement::PERSISTENCE,
                selectivity: FlushSelectivity::MemoryRegion,
            }
        );
        let mut out = [0xffu8; 4];
        repr.emit(&mut Feth::new_unchecked(&mut out[..]));
        assert_eq!(out, bytes);
    }

    #[test]
    fn reserved_selectivity_and_truncation() {
        let bytes = [0x00, 0x00, 0x00, 0x21];
        assert_eq!(
            FethRepr::parse(&Feth::new_unchecked(&bytes[..])),
            Err(Error::BadFlushSelectivity(2))
        );
        assert_eq!(
            Feth::new_checked(&bytes[..2]).unwrap_err(),
            Error::Truncated
        );
    }
}
