//! DREP: disconnect reply (IBA table 113).
//!
//! ```text
//!  0:4   local communication ID
//!  4:4   remote communication ID
//!  8:224 private data
//! ```

use hca_lowlevel::wire::bytes::{self, Field};

use super::{MESSAGE_LEN, clear_body};
use crate::wire::{Error, Result};

mod field {
    use super::Field;
    pub const LOCAL_COMM_ID: Field = 0..4;
    pub const REMOTE_COMM_ID: Field = 4..8;
    pub const PRIVATE_DATA: Field = 8..232;
}

/// DREP private data length.
pub const PRIVATE_DATA_LEN: usize = 224;
static_assertions::const_assert_eq!(field::PRIVATE_DATA.end, MESSAGE_LEN);
static_assertions::const_assert_eq!(
    field::PRIVATE_DATA.end - field::PRIVATE_DATA.start,
    PRIVATE_DATA_LEN
);

fixed_view! {
    /// A view of a DREP body (the MAD data).
    CmDrep, MESSAGE_LEN
}

impl<T: AsRef<[u8]>> CmDrep<T> {
    /// Local communication ID (the DREQ's receiver's).
    pub fn local_comm_id(&self) -> u32 {
        bytes::read_be32(self.buffer.as_ref(), field::LOCAL_COMM_ID)
    }

    /// Remote communication ID.
    pub fn remote_comm_id(&self) -> u32 {
        bytes::read_be32(self.buffer.as_ref(), field::REMOTE_COMM_ID)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> CmDrep<T> {
    /// Set the local communication ID.
    pub fn set_local_comm_id(&mut self, value: u32) {
        bytes::write_be32(self.buffer.as_mut(), field::LOCAL_COMM_ID, value);
    }

    /// Set the remote communication ID.
    pub fn set_remote_comm_id(&mut self, value: u32) {
        bytes::write_be32(self.buffer.as_mut(), field::REMOTE_COMM_ID, value);
    }
}

private_data_accessors!(CmDrep, field::PRIVATE_DATA);

/// The meaning of a DREP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CmDrepRepr<'a> {
    /// Local communication ID (the DREQ's receiver's).
    pub local_comm_id: u32,
    /// Remote communication ID.
    pub remote_comm_id: u32,
    /// Private data (up to 224 bytes).
    pub private_data: &'a [u8],
}

impl<'a> CmDrepRepr<'a> {
    /// Parse a DREP body.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`].
    pub fn parse<T: AsRef<[u8]> + ?Sized>(msg: &CmDrep<&'a T>) -> Result<CmDrepRepr<'a>> {
        msg.check_len()?;
        Ok(CmDrepRepr {
            local_comm_id: msg.local_comm_id(),
            remote_comm_id: msg.remote_comm_id(),
            private_data: msg.private_data(),
        })
    }

    /// The body length.
    pub const fn buffer_len(&self) -> usize {
        MESSAGE_LEN
    }

    /// Write the body; unused private data is zeroed.
    ///
    /// # Errors
    ///
    /// [`Error::PrivateDataTooLong`]; [`Error::BufferTooShort`].
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, msg: &mut CmDrep<T>) -> Result<()> {
        if self.private_data.len() > PRIVATE_DATA_LEN {
            return Err(Error::PrivateDataTooLong(PRIVATE_DATA_LEN));
        }
        msg.check_len().map_err(|_| Error::BufferTooShort)?;
        clear_body(msg.buffer.as_mut());
        msg.set_local_comm_id(self.local_comm_id);
        msg.set_remote_comm_id(self.remote_comm_id);
        msg.set_private_data(self.private_data)
    }
}
