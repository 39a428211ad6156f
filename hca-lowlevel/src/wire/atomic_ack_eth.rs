//! Atomic Acknowledge Extended Transport Header (8 bytes): the original
//! value of the remote location before a COMPARE SWAP or FETCH ADD.

use super::Result;
use super::bytes::{self, Field};

mod field {
    use super::Field;
    pub const ORIGINAL: Field = 0..8;
}

/// The AtomicAckETH length.
pub const HEADER_LEN: usize = field::ORIGINAL.end;
static_assertions::const_assert_eq!(HEADER_LEN, 8);

fixed_view! {
    /// A view of an AtomicAckETH at the start of a buffer.
    AtomicAckEth, HEADER_LEN
}

impl<T: AsRef<[u8]>> AtomicAckEth<T> {
    /// The remote value before the atomic operation.
    pub fn original(&self) -> u64 {
        bytes::read_be64(self.buffer.as_ref(), field::ORIGINAL)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> AtomicAckEth<T> {
    /// Set the original remote value.
    pub fn set_original(&mut self, value: u64) {
        bytes::write_be64(self.buffer.as_mut(), field::ORIGINAL, value);
    }
}

/// The meaning of an AtomicAckETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AtomicAckEthRepr {
    /// The remote value before the atomic operation.
    pub original: u64,
}

impl AtomicAckEthRepr {
    /// Parse an AtomicAckETH.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`](super::Error::Truncated).
    pub fn parse<T: AsRef<[u8]> + ?Sized>(header: &AtomicAckEth<&T>) -> Result<AtomicAckEthRepr> {
        header.check_len()?;
        Ok(AtomicAckEthRepr {
            original: header.original(),
        })
    }

    /// The length of the emitted header.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Write the header.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, header: &mut AtomicAckEth<T>) {
        header.set_original(self.original);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Error;

    #[test]
    fn bytes_round_trip() {
        let bytes = [1, 2, 3, 4, 5, 6, 7, 8];
        let repr =
            AtomicAckEthRepr::parse(&AtomicAckEth::new_checked(&bytes[..]).unwrap()).unwrap();
        assert_eq!(repr.original, 0x0102_0304_0506_0708);
        let mut out = [0u8; 8];
        repr.emit(&mut AtomicAckEth::new_unchecked(&mut out[..]));
        assert_eq!(out, bytes);
        assert_eq!(
            AtomicAckEth::new_checked(&bytes[..7]).unwrap_err(),
            Error::Truncated
        );
    }
}
