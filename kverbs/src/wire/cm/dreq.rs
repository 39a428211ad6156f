//! DREQ: disconnect request (IBA table 112).
//!
//! ```text
//!  0:4   local communication ID
//!  4:4   remote communication ID
//!  8:3   remote QPN/EECN          11 reserved
//!  12:220 private data
//! ```

use hca_lowlevel::wire::Qpn;
use hca_lowlevel::wire::bytes::{self, Field};

use super::{MESSAGE_LEN, clear_body};
use crate::wire::{Error, Result};

mod field {
    use super::Field;
    pub const LOCAL_COMM_ID: Field = 0..4;
    pub const REMOTE_COMM_ID: Field = 4..8;
    pub const REMOTE_QPN_EECN: Field = 8..11;
    pub const PRIVATE_DATA: Field = 12..232;
}

/// DREQ private data length.
pub const PRIVATE_DATA_LEN: usize = 220;
static_assertions::const_assert_eq!(field::PRIVATE_DATA.end, MESSAGE_LEN);
static_assertions::const_assert_eq!(
    field::PRIVATE_DATA.end - field::PRIVATE_DATA.start,
    PRIVATE_DATA_LEN
);

fixed_view! {
    /// A view of a DREQ body (the MAD data).
    CmDreq, MESSAGE_LEN
}

impl<T: AsRef<[u8]>> CmDreq<T> {
    /// Local communication ID (the disconnecting side's).
    pub fn local_comm_id(&self) -> u32 {
        bytes::read_be32(self.buffer.as_ref(), field::LOCAL_COMM_ID)
    }

    /// Remote communication ID.
    pub fn remote_comm_id(&self) -> u32 {
        bytes::read_be32(self.buffer.as_ref(), field::REMOTE_COMM_ID)
    }

    /// The receiver's QPN (or EECN) that the sender disconnects.
    pub fn remote_qpn(&self) -> Qpn {
        Qpn::from_low_bits(bytes::read_be24(
            self.buffer.as_ref(),
            field::REMOTE_QPN_EECN,
        ))
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> CmDreq<T> {
    /// Set the local communication ID.
    pub fn set_local_comm_id(&mut self, value: u32) {
        bytes::write_be32(self.buffer.as_mut(), field::LOCAL_COMM_ID, value);
    }

    /// Set the remote communication ID.
    pub fn set_remote_comm_id(&mut self, value: u32) {
        bytes::write_be32(self.buffer.as_mut(), field::REMOTE_COMM_ID, value);
    }

    /// Set the remote QPN/EECN.
    pub fn set_remote_qpn(&mut self, value: Qpn) {
        bytes::write_be24(self.buffer.as_mut(), field::REMOTE_QPN_EECN, value.get());
    }
}

private_data_accessors!(CmDreq, field::PRIVATE_DATA);

/// The meaning of a DREQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CmDreqRepr<'a> {
    /// Local communication ID (the disconnecting side's).
    pub local_comm_id: u32,
    /// Remote communication ID.
    pub remote_comm_id: u32,
    /// The receiver's QPN (or EECN).
    pub remote_qpn: Qpn,
    /// Private data (up to 220 bytes).
    pub private_data: &'a [u8],
}

impl<'a> CmDreqRepr<'a> {
    /// Parse a DREQ body.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`].
    pub fn parse<T: AsRef<[u8]> + ?Sized>(msg: &CmDreq<&'a T>) -> Result<CmDreqRepr<'a>> {
        msg.check_len()?;
        Ok(CmDreqRepr {
            local_comm_id: msg.local_comm_id(),
            remote_comm_id: msg.remote_comm_id(),
            remote_qpn: msg.remote_qpn(),
            private_data: msg.private_data(),
        })
    }

    /// The body length.
    pub const fn buffer_len(&self) -> usize {
        MESSAGE_LEN
    }

    /// Write the body; reserved fields and unused private data are zeroed.
    ///
    /// # Errors
    ///
    /// [`Error::PrivateDataTooLong`]; [`Error::BufferTooShort`].
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, msg: &mut CmDreq<T>) -> Result<()> {
        if self.private_data.len() > PRIVATE_DATA_LEN {
            return Err(Error::PrivateDataTooLong(PRIVATE_DATA_LEN));
        }
        msg.check_len().map_err(|_| Error::BufferTooShort)?;
        clear_body(msg.buffer.as_mut());
        msg.set_local_comm_id(self.local_comm_id);
        msg.set_remote_comm_id(self.remote_comm_id);
        msg.set_remote_qpn(self.remote_qpn);
        msg.set_private_data(self.private_data)
    }
}
