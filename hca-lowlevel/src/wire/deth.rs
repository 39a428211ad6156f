//! Datagram Extended Transport Header (8 bytes): Q_Key and source QP.
//!
//! ```text
//!  bytes 0-3 Q_Key
//!  byte 4    reserved
//!  bytes 5-7 source QP (24 bits)
//! ```

use super::bytes::{self, Field};
use super::{Qpn, Result};

mod field {
    use super::Field;
    pub const QKEY: Field = 0..4;
    pub const SRC_QP_WORD: Field = 4..8;
    pub const SRC_QP: Field = 5..8;
}

/// The DETH length.
pub const HEADER_LEN: usize = field::SRC_QP.end;
static_assertions::const_assert_eq!(HEADER_LEN, 8);

/// The Q_Key that QP1 (the GSI QP, which carries CM MADs) requires.
pub const GSI_QKEY: u32 = 0x8001_0000;

fixed_view! {
    /// A view of a DETH at the start of a buffer.
    Deth, HEADER_LEN
}

impl<T: AsRef<[u8]>> Deth<T> {
    /// Queue key.
    pub fn qkey(&self) -> u32 {
        bytes::read_be32(self.buffer.as_ref(), field::QKEY)
    }

    /// Source QP.
    pub fn src_qp(&self) -> Qpn {
        Qpn::from_low_bits(bytes::read_be24(self.buffer.as_ref(), field::SRC_QP))
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Deth<T> {
    /// Set the queue key.
    pub fn set_qkey(&mut self, qkey: u32) {
        bytes::write_be32(self.buffer.as_mut(), field::QKEY, qkey);
    }

    /// Set the source QP; the reserved byte is cleared.
    pub fn set_src_qp(&mut self, qpn: Qpn) {
        bytes::write_be32(self.buffer.as_mut(), field::SRC_QP_WORD, qpn.get());
    }
}

/// The meaning of a DETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DethRepr {
    /// Queue key ([`DethRepr::GSI_QKEY`] for QP1).
    pub qkey: u32,
    /// Source QP (replies go there).
    pub src_qp: Qpn,
}

impl DethRepr {
    /// The Q_Key that QP1 (the GSI QP, which carries CM MADs) requires.
    pub const GSI_QKEY: u32 = GSI_QKEY;

    /// Parse a DETH.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`](super::Error::Truncated).
    pub fn parse<T: AsRef<[u8]> + ?Sized>(header: &Deth<&T>) -> Result<DethRepr> {
        header.check_len()?;
        Ok(DethRepr {
            qkey: header.qkey(),
            src_qp: header.src_qp(),
        })
    }

    /// The length of the emitted header.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Write the header.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, header: &mut Deth<T>) {
        header.set_qkey(self.qkey);
        header.set_src_qp(self.src_qp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Error;

    #[test]
    fn gsi_deth_bytes() {
        let bytes = [0x80, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01];
        let repr = DethRepr::parse(&Deth::new_checked(&bytes[..]).unwrap()).unwrap();
        assert_eq!(
            repr,
            DethRepr {
                qkey: DethRepr::GSI_QKEY,
                src_qp: Qpn::GSI
            }
        );
        let mut out = [0xffu8; 8];
        repr.emit(&mut Deth::new_unchecked(&mut out[..]));
        assert_eq!(out, bytes);
        assert_eq!(
            Deth::new_checked(&bytes[..7]).unwrap_err(),
            Error::Truncated
        );
    }
}
