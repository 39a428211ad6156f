//! Invalidate Extended Transport Header (4 bytes): the R_Key that a SEND
//! WITH INVALIDATE asks the responder to invalidate.

use super::Result;
use super::bytes::{self, Field};

mod field {
    use super::Field;
    pub const RKEY: Field = 0..4;
}

/// The IETH length.
pub const HEADER_LEN: usize = field::RKEY.end;
static_assertions::const_assert_eq!(HEADER_LEN, 4);

fixed_view! {
    /// A view of an IETH at the start of a buffer.
    Ieth, HEADER_LEN
}

impl<T: AsRef<[u8]>> Ieth<T> {
    /// The R_Key to invalidate.
    pub fn rkey(&self) -> u32 {
        bytes::read_be32(self.buffer.as_ref(), field::RKEY)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Ieth<T> {
    /// Set the R_Key to invalidate.
    pub fn set_rkey(&mut self, rkey: u32) {
        bytes::write_be32(self.buffer.as_mut(), field::RKEY, rkey);
    }
}

/// The meaning of an IETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IethRepr {
    /// The R_Key to invalidate.
    pub rkey: u32,
}

impl IethRepr {
    /// Parse an IETH.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`](super::Error::Truncated).
    pub fn parse<T: AsRef<[u8]> + ?Sized>(header: &Ieth<&T>) -> Result<IethRepr> {
        header.check_len()?;
        Ok(IethRepr {
            rkey: header.rkey(),
        })
    }

    /// The length of the emitted header.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Write the header.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, header: &mut Ieth<T>) {
        header.set_rkey(self.rkey);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Error;

    #[test]
    fn bytes_round_trip() {
        let bytes = [0x00, 0x00, 0x12, 0x34];
        let repr = IethRepr::parse(&Ieth::new_checked(&bytes[..]).unwrap()).unwrap();
        assert_eq!(repr.rkey, 0x1234);
        let mut out = [0u8; 4];
        repr.emit(&mut Ieth::new_unchecked(&mut out[..]));
        assert_eq!(out, bytes);
        assert_eq!(
            Ieth::new_checked(&bytes[..1]).unwrap_err(),
            Error::Truncated
        );
    }
}
