//! Reliable Datagram Extended Transport Header (4 bytes): the EE context.
//!
//! ```text
//!  byte 0    reserved
//!  bytes 1-3 EE context (24 bits)
//! ```

use super::bytes::{self, Field};
use super::{Eecn, Result};

mod field {
    use super::Field;
    pub const EECN: Field = 1..4;
}

/// The RDETH length.
pub const HEADER_LEN: usize = field::EECN.end;
static_assertions::const_assert_eq!(HEADER_LEN, 4);

fixed_view! {
    /// A view of an RDETH at the start of a buffer.
    Rdeth, HEADER_LEN
}

impl<T: AsRef<[u8]>> Rdeth<T> {
    /// End-to-end context.
    pub fn eecn(&self) -> Eecn {
        Eecn::from_low_bits(bytes::read_be24(self.buffer.as_ref(), field::EECN))
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Rdeth<T> {
    /// Set the end-to-end context; the reserved byte is cleared.
    pub fn set_eecn(&mut self, eecn: Eecn) {
        bytes::write_be32(self.buffer.as_mut(), 0..4, eecn.get());
    }
}

/// The meaning of an RDETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RdethRepr {
    /// End-to-end context.
    pub eecn: Eecn,
}

impl RdethRepr {
    /// Parse an RDETH.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`](super::Error::Truncated).
    pub fn parse<T: AsRef<[u8]> + ?Sized>(header: &Rdeth<&T>) -> Result<RdethRepr> {
        header.check_len()?;
        Ok(RdethRepr {
            eecn: header.eecn(),
        })
    }

    /// The length of the emitted header.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Write the header.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, header: &mut Rdeth<T>) {
        header.set_eecn(self.eecn);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Error;

    #[test]
    fn round_trip_bytes() {
        let bytes = [0x00, 0x12, 0x34, 0x56];
        let repr = RdethRepr::parse(&Rdeth::new_checked(&bytes[..]).unwrap()).unwrap();
        assert_eq!(repr.eecn.get(), 0x12_3456);
        let mut out = [0xffu8; 4];
        repr.emit(&mut Rdeth::new_unchecked(&mut out[..]));
        assert_eq!(out, bytes);
        assert_eq!(
            Rdeth::new_checked(&bytes[..3]).unwrap_err(),
            Error::Truncated
        );
    }
}
