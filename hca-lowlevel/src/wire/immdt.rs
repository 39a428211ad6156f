//! Immediate Data Extended Transport Header (4 bytes).
//!
//! The four bytes are opaque to the transport: they go from the sender's work
//! request to the receiver's completion unchanged. They are carried here as
//! the big-endian `u32` the verbs API uses (`imm_data`, `__be32`).

use super::Result;
use super::bytes::{self, Field};

mod field {
    use super::Field;
    pub const DATA: Field = 0..4;
}

/// The ImmDt length.
pub const HEADER_LEN: usize = field::DATA.end;
static_assertions::const_assert_eq!(HEADER_LEN, 4);

fixed_view! {
    /// A view of an ImmDt header at the start of a buffer.
    ImmDt, HEADER_LEN
}

impl<T: AsRef<[u8]>> ImmDt<T> {
    /// The immediate data, read big-endian.
    pub fn data(&self) -> u32 {
        bytes::read_be32(self.buffer.as_ref(), field::DATA)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> ImmDt<T> {
    /// Set the immediate data, written big-endian.
    pub fn set_data(&mut self, data: u32) {
        bytes::write_be32(self.buffer.as_mut(), field::DATA, data);
    }
}

/// The meaning of an ImmDt header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ImmDtRepr {
    /// The immediate data (big-endian on the wire).
    pub data: u32,
}

impl ImmDtRepr {
    /// Parse an ImmDt header.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`](super::Error::Truncated).
    pub fn parse<T: AsRef<[u8]> + ?Sized>(header: &ImmDt<&T>) -> Result<ImmDtRepr> {
        header.check_len()?;
        Ok(ImmDtRepr {
            data: header.data(),
        })
    }

    /// The length of the emitted header.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Write the header.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, header: &mut ImmDt<T>) {
        header.set_data(self.data);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Error;

    #[test]
    fn bytes_round_trip() {
        let bytes = [0x01, 0x02, 0x03, 0x04];
        let repr = ImmDtRepr::parse(&ImmDt::new_checked(&bytes[..]).unwrap()).unwrap();
        assert_eq!(repr.data, 0x0102_0304);
        let mut out = [0u8; 4];
        repr.emit(&mut ImmDt::new_unchecked(&mut out[..]));
        assert_eq!(out, bytes);
        assert_eq!(
            ImmDt::new_checked(&bytes[..3]).unwrap_err(),
            Error::Truncated
        );
    }
}
