//! MRA: message receipt acknowledgement (IBA table 107): "I got your
//! message; give me this much longer before you time out or retry".
//!
//! ```text
//!  0:4   local communication ID
//!  4:4   remote communication ID
//!  8     message MRAed(2) | reserved(6)
//!  9     service timeout(5) | reserved(3)
//!  10:222 private data
//! ```

use hca_lowlevel::wire::bytes::{self, Field};

use super::{CmMessageKind, IbTimeout, MESSAGE_LEN, clear_body, get_bits, set_bits};
use crate::wire::{Error, Result};

mod field {
    use super::Field;
    pub const LOCAL_COMM_ID: Field = 0..4;
    pub const REMOTE_COMM_ID: Field = 4..8;
    pub const MESSAGE_MRAED: usize = 8;
    pub const SERVICE_TIMEOUT: usize = 9;
    pub const PRIVATE_DATA: Field = 10..232;
}

/// MRA private data length.
pub const PRIVATE_DATA_LEN: usize = 222;
static_assertions::const_assert_eq!(field::PRIVATE_DATA.end, MESSAGE_LEN);
static_assertions::const_assert_eq!(
    field::PRIVATE_DATA.end - field::PRIVATE_DATA.start,
    PRIVATE_DATA_LEN
);

const MESSAGE_MASK: u8 = 0xc0;
const TIMEOUT_MASK: u8 = 0xf8;

fixed_view! {
    /// A view of an MRA body (the MAD data).
    CmMra, MESSAGE_LEN
}

impl<T: AsRef<[u8]>> CmMra<T> {
    /// Local communication ID (the MRA sender's).
    pub fn local_comm_id(&self) -> u32 {
        bytes::read_be32(self.buffer.as_ref(), field::LOCAL_COMM_ID)
    }

    /// Remote communication ID.
    pub fn remote_comm_id(&self) -> u32 {
        bytes::read_be32(self.buffer.as_ref(), field::REMOTE_COMM_ID)
    }

    /// The "message MRAed" bits as stored (see [`CmMessageKind::from_bits`]).
    pub fn message_mraed_bits(&self) -> u8 {
        get_bits(self.buffer.as_ref(), field::MESSAGE_MRAED, MESSAGE_MASK)
    }

    /// The extra time the sender asks for.
    pub fn service_timeout(&self) -> IbTimeout {
        IbTimeout::from_low_bits(get_bits(
            self.buffer.as_ref(),
            field::SERVICE_TIMEOUT,
            TIMEOUT_MASK,
        ))
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> CmMra<T> {
    /// Set the local communication ID.
    pub fn set_local_comm_id(&mut self, value: u32) {
        bytes::write_be32(self.buffer.as_mut(), field::LOCAL_COMM_ID, value);
    }

    /// Set the remote communication ID.
    pub fn set_remote_comm_id(&mut self, value: u32) {
        bytes::write_be32(self.buffer.as_mut(), field::REMOTE_COMM_ID, value);
    }

    /// Set which message is acknowledged.
    pub fn set_message_mraed(&mut self, kind: CmMessageKind) {
        set_bits(
            self.buffer.as_mut(),
            field::MESSAGE_MRAED,
            MESSAGE_MASK,
            kind as u8,
        );
    }

    /// Set the service timeout.
    pub fn set_service_timeout(&mut self, timeout: IbTimeout) {
        set_bits(
            self.buffer.as_mut(),
            field::SERVICE_TIMEOUT,
            TIMEOUT_MASK,
            timeout.exponent(),
        );
    }
}

private_data_accessors!(CmMra, field::PRIVATE_DATA);

/// The meaning of an MRA.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CmMraRepr<'a> {
    /// Local communication ID (the MRA sender's).
    pub local_comm_id: u32,
    /// Remote communication ID.
    pub remote_comm_id: u32,
    /// Which message is acknowledged.
    pub message_mraed: CmMessageKind,
    /// The extra time the sender asks for.
    pub service_timeout: IbTimeout,
    /// Private data (up to 222 bytes).
    pub private_data: &'a [u8],
}

impl<'a> CmMraRepr<'a> {
    /// Parse an MRA body.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`]; [`Error::ReservedMessageKind`].
    pub fn parse<T: AsRef<[u8]> + ?Sized>(msg: &CmMra<&'a T>) -> Result<CmMraRepr<'a>> {
        msg.check_len()?;
        Ok(CmMraRepr {
            local_comm_id: msg.local_comm_id(),
            remote_comm_id: msg.remote_comm_id(),
            message_mraed: CmMessageKind::from_bits(msg.message_mraed_bits())?,
            service_timeout: msg.service_timeout(),
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
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, msg: &mut CmMra<T>) -> Result<()> {
        if self.private_data.len() > PRIVATE_DATA_LEN {
            return Err(Error::PrivateDataTooLong(PRIVATE_DATA_LEN));
        }
        msg.check_len().map_err(|_| Error::BufferTooShort)?;
        clear_body(msg.buffer.as_mut());
        msg.set_local_comm_id(self.local_comm_id);
        msg.set_remote_comm_id(self.remote_comm_id);
        msg.set_message_mraed(self.message_mraed);
        msg.set_service_timeout(self.service_timeout);
        msg.set_private_data(self.private_data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bits() {
        let mut body = [0u8; MESSAGE_LEN];
        let repr = CmMraRepr {
            local_comm_id: 1,
            remote_comm_id: 2,
            message_mraed: CmMessageKind::Rep,
            service_timeout: IbTimeout::new(21).unwrap(),
            private_data: &[],
        };
        repr.emit(&mut CmMra::new_unchecked(&mut body[..])).unwrap();
        assert_eq!(&body[8..10], &[0x40, 0xa8]);
        assert_eq!(
            CmMraRepr::parse(&CmMra::new_checked(&body[..]).unwrap()).map(|r| r.message_mraed),
            Ok(CmMessageKind::Rep)
        );
        body[8] = 0xc0;
        assert_eq!(
            CmMraRepr::parse(&CmMra::new_checked(&body[..]).unwrap()),
            Err(Error::ReservedMessageKind(3))
        );
    }
}
