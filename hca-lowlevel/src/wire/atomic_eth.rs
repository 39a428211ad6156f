//! Atomic Extended Transport Header (28 bytes).
//!
//! ```text
//!  bytes 0-7   virtual address (8-byte aligned target)
//!  bytes 8-11  R_Key
//!  bytes 12-19 swap (COMPARE SWAP) or add (FETCH ADD) data
//!  bytes 20-27 compare data (COMPARE SWAP)
//! ```

use super::Result;
use super::bytes::{self, Field};

mod field {
    use super::Field;
    pub const VA: Field = 0..8;
    pub const RKEY: Field = 8..12;
    pub const SWAP_ADD: Field = 12..20;
    pub const COMPARE: Field = 20..28;
}

/// The AtomicETH length.
pub const HEADER_LEN: usize = field::COMPARE.end;
static_assertions::const_assert_eq!(HEADER_LEN, 28);

fixed_view! {
    /// A view of an AtomicETH at the start of a buffer.
    AtomicEth, HEADER_LEN
}

impl<T: AsRef<[u8]>> AtomicEth<T> {
    /// Remote virtual address.
    pub fn va(&self) -> u64 {
        bytes::read_be64(self.buffer.as_ref(), field::VA)
    }

    /// Remote key.
    pub fn rkey(&self) -> u32 {
        bytes::read_be32(self.buffer.as_ref(), field::RKEY)
    }

    /// Swap (COMPARE SWAP) or add (FETCH ADD) operand.
    pub fn swap_add(&self) -> u64 {
        bytes::read_be64(self.buffer.as_ref(), field::SWAP_ADD)
    }

    /// Compare operand (COMPARE SWAP).
    pub fn compare(&self) -> u64 {
        bytes::read_be64(self.buffer.as_ref(), field::COMPARE)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> AtomicEth<T> {
    /// Set the remote virtual address.
    pub fn set_va(&mut self, va: u64) {
        bytes::write_be64(self.buffer.as_mut(), field::VA, va);
    }

    /// Set the remote key.
    pub fn set_rkey(&mut self, rkey: u32) {
        bytes::write_be32(self.buffer.as_mut(), field::RKEY, rkey);
    }

    /// Set the swap/add operand.
    pub fn set_swap_add(&mut self, value: u64) {
        bytes::write_be64(self.buffer.as_mut(), field::SWAP_ADD, value);
    }

    /// Set the compare operand.
    pub fn set_compare(&mut self, value: u64) {
        bytes::write_be64(self.buffer.as_mut(), field::COMPARE, value);
    }
}

/// The meaning of an AtomicETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AtomicEthRepr {
    /// Remote virtual address.
    pub va: u64,
    /// Remote key.
    pub rkey: u32,
    /// Swap (COMPARE SWAP) or add (FETCH ADD) operand.
    pub swap_add: u64,
    /// Compare operand (COMPARE SWAP; 0 for FETCH ADD).
    pub compare: u64,
}

impl AtomicEthRepr {
    /// Parse an AtomicETH.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`](super::Error::Truncated).
    pub fn parse<T: AsRef<[u8]> + ?Sized>(header: &AtomicEth<&T>) -> Result<AtomicEthRepr> {
        header.check_len()?;
        Ok(AtomicEthRepr {
            va: header.va(),
            rkey: header.rkey(),
            swap_add: header.swap_add(),
            compare: header.compare(),
        })
    }

    /// The length of the emitted header.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Write the header.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, header: &mut AtomicEth<T>) {
        header.set_va(self.va);
        header.set_rkey(self.rkey);
        header.set_swap_add(self.swap_add);
        header.set_compare(self.compare);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Error;

    #[test]
    fn bytes_round_trip() {
        let mut bytes = [0u8; 28];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = i as u8 + 1;
        }
        let repr = AtomicEthRepr::parse(&AtomicEth::new_checked(&bytes[..]).unwrap()).unwrap();
        assert_eq!(repr.va, 0x0102_0304_0506_0708);
        assert_eq!(repr.rkey, 0x090a_0b0c);
        assert_eq!(repr.swap_add, 0x0d0e_0f10_1112_1314);
        assert_eq!(repr.compare, 0x1516_1718_191a_1b1c);
        let mut out = [0u8; 28];
        repr.emit(&mut AtomicEth::new_unchecked(&mut out[..]));
        assert_eq!(out, bytes);
        assert_eq!(
            AtomicEth::new_checked(&bytes[..27]).unwrap_err(),
            Error::Truncated
        );
    }
}
