//! RDMA Extended Transport Header (16 bytes): remote address, R_Key, length.
//!
//! ```text
//!  bytes 0-7   virtual address
//!  bytes 8-11  R_Key
//!  bytes 12-15 DMA length
//! ```

use super::Result;
use super::bytes::{self, Field};

mod field {
    use super::Field;
    pub const VA: Field = 0..8;
    pub const RKEY: Field = 8..12;
    pub const DMA_LEN: Field = 12..16;
}

/// The RETH length.
pub const HEADER_LEN: usize = field::DMA_LEN.end;
static_assertions::const_assert_eq!(HEADER_LEN, 16);

fixed_view! {
    /// A view of a RETH at the start of a buffer.
    Reth, HEADER_LEN
}

impl<T: AsRef<[u8]>> Reth<T> {
    /// Remote virtual address.
    pub fn va(&self) -> u64 {
        bytes::read_be64(self.buffer.as_ref(), field::VA)
    }

    /// Remote key.
    pub fn rkey(&self) -> u32 {
        bytes::read_be32(self.buffer.as_ref(), field::RKEY)
    }

    /// Length of the whole RDMA operation in bytes.
    pub fn dma_len(&self) -> u32 {
        bytes::read_be32(self.buffer.as_ref(), field::DMA_LEN)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Reth<T> {
    /// Set the remote virtual address.
    pub fn set_va(&mut self, va: u64) {
        bytes::write_be64(self.buffer.as_mut(), field::VA, va);
    }

    /// Set the remote key.
    pub fn set_rkey(&mut self, rkey: u32) {
        bytes::write_be32(self.buffer.as_mut(), field::RKEY, rkey);
    }

    /// Set the DMA length.
    pub fn set_dma_len(&mut self, len: u32) {
        bytes::write_be32(self.buffer.as_mut(), field::DMA_LEN, len);
    }
}

/// The meaning of a RETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RethRepr {
    /// Remote virtual address.
    pub va: u64,
    /// Remote key.
    pub rkey: u32,
    /// Length of the whole RDMA operation in bytes.
    pub dma_len: u32,
}

impl RethRepr {
    /// Parse a RETH.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`](super::Error::Truncated).
    pub fn parse<T: AsRef<[u8]> + ?Sized>(header: &Reth<&T>) -> Result<RethRepr> {
        header.check_len()?;
        Ok(RethRepr {
            va: header.va(),
            rkey: header.rkey(),
            dma_len: header.dma_len(),
        })
    }

    /// The length of the emitted header.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Write the header.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, header: &mut Reth<T>) {
        header.set_va(self.va);
        header.set_rkey(self.rkey);
        header.set_dma_len(self.dma_len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Error;

    #[test]
    fn bytes_round_trip() {
        let bytes = [
            0x00, 0x00, 0x7f, 0x12, 0x34, 0x56, 0x78, 0x9a, 0xde, 0xad, 0xbe, 0xef, 0x00, 0x01,
            0x00, 0x00,
        ];
        let repr = RethRepr::parse(&Reth::new_checked(&bytes[..]).unwrap()).unwrap();
        assert_eq!(
            repr,
            RethRepr {
                va: 0x7f12_3456_789a,
                rkey: 0xdead_beef,
                dma_len: 0x1_0000
            }
        );
        let mut out = [0u8; 16];
        repr.emit(&mut Reth::new_unchecked(&mut out[..]));
        assert_eq!(out, bytes);
        assert_eq!(
            Reth::new_checked(&bytes[..15]).unwrap_err(),
            Error::Truncated
        );
    }
}
