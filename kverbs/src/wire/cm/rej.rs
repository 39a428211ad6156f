//! REJ: reject (IBA table 108).
//!
//! ```text
//!  0:4   local communication ID (0 when rejecting a REQ before any REP)
//!  4:4   remote communication ID
//!  8     message rejected(2) | reserved(6)
//!  9     reject info length(7) | reserved(1)
//!  10:2  reason
//!  12:72 additional reject information (ARI)
//!  84:148 private data
//! ```

use hca_lowlevel::wire::bytes::{self, Field};

use super::{CmMessageKind, MESSAGE_LEN, RejectReason, clear_body, get_bits, set_bits};
use crate::wire::{Error, Result};

mod field {
    use super::Field;
    pub const LOCAL_COMM_ID: Field = 0..4;
    pub const REMOTE_COMM_ID: Field = 4..8;
    pub const MESSAGE_REJECTED: usize = 8;
    pub const REJECT_INFO_LEN: usize = 9;
    pub const REASON: Field = 10..12;
    pub const ARI: Field = 12..84;
    pub const PRIVATE_DATA: Field = 84..232;
}

/// Length of the ARI field.
pub const ARI_LEN: usize = 72;
/// REJ private data length.
pub const PRIVATE_DATA_LEN: usize = 148;
static_assertions::const_assert_eq!(field::ARI.end - field::ARI.start, ARI_LEN);
static_assertions::const_assert_eq!(field::PRIVATE_DATA.end, MESSAGE_LEN);
static_assertions::const_assert_eq!(
    field::PRIVATE_DATA.end - field::PRIVATE_DATA.start,
    PRIVATE_DATA_LEN
);

const MESSAGE_MASK: u8 = 0xc0;
const INFO_LEN_MASK: u8 = 0xfe;

fixed_view! {
    /// A view of a REJ body (the MAD data).
    CmRej, MESSAGE_LEN
}

impl<T: AsRef<[u8]>> CmRej<T> {
    /// Local communication ID (the rejecting side's).
    pub fn local_comm_id(&self) -> u32 {
        bytes::read_be32(self.buffer.as_ref(), field::LOCAL_COMM_ID)
    }

    /// Remote communication ID (the rejected side's).
    pub fn remote_comm_id(&self) -> u32 {
        bytes::read_be32(self.buffer.as_ref(), field::REMOTE_COMM_ID)
    }

    /// The "message rejected" bits as stored (see [`CmMessageKind::from_bits`]).
    pub fn message_rejected_bits(&self) -> u8 {
        get_bits(self.buffer.as_ref(), field::MESSAGE_REJECTED, MESSAGE_MASK)
    }

    /// Reject info length as stored (7 bits; valid up to 72).
    pub fn reject_info_len(&self) -> u8 {
        get_bits(self.buffer.as_ref(), field::REJECT_INFO_LEN, INFO_LEN_MASK)
    }

    /// Reason.
    pub fn reason(&self) -> RejectReason {
        RejectReason::from_code(bytes::read_be16(self.buffer.as_ref(), field::REASON))
    }
}

impl<'a, T: AsRef<[u8]> + ?Sized> CmRej<&'a T> {
    /// The whole 72-byte ARI field.
    pub fn ari_field(&self) -> &'a [u8] {
        bytes::slice(self.buffer.as_ref(), field::ARI)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> CmRej<T> {
    /// Set the local communication ID.
    pub fn set_local_comm_id(&mut self, value: u32) {
        bytes::write_be32(self.buffer.as_mut(), field::LOCAL_COMM_ID, value);
    }

    /// Set the remote communication ID.
    pub fn set_remote_comm_id(&mut self, value: u32) {
        bytes::write_be32(self.buffer.as_mut(), field::REMOTE_COMM_ID, value);
    }

    /// Set which message is rejected.
    pub fn set_message_rejected(&mut self, kind: CmMessageKind) {
        set_bits(
            self.buffer.as_mut(),
            field::MESSAGE_REJECTED,
            MESSAGE_MASK,
            kind as u8,
        );
    }

    /// Set the reason.
    pub fn set_reason(&mut self, reason: RejectReason) {
        bytes::write_be16(self.buffer.as_mut(), field::REASON, reason.code());
    }

    /// Copy `ari` into the ARI field, zero the rest and set the reject info length.
    ///
    /// # Errors
    ///
    /// [`Error::FieldOutOfRange`] when `ari` is longer than 72 bytes.
    pub fn set_ari(&mut self, ari: &[u8]) -> Result<()> {
        let len = u8::try_from(ari.len())
            .ok()
            .filter(|&len| usize::from(len) <= ARI_LEN)
            .ok_or(Error::FieldOutOfRange("REJ ARI"))?;
        let field = bytes::slice_mut(self.buffer.as_mut(), field::ARI);
        if let Some((head, tail)) = field.split_at_mut_checked(ari.len()) {
            head.copy_from_slice(ari);
            tail.fill(0);
        }
        set_bits(
            self.buffer.as_mut(),
            field::REJECT_INFO_LEN,
            INFO_LEN_MASK,
            len,
        );
        Ok(())
    }
}

private_data_accessors!(CmRej, field::PRIVATE_DATA);

/// The meaning of a REJ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CmRejRepr<'a> {
    /// Local communication ID (the rejecting side's).
    pub local_comm_id: u32,
    /// Remote communication ID (the rejected side's).
    pub remote_comm_id: u32,
    /// Which message is rejected.
    pub message_rejected: CmMessageKind,
    /// Reason (unknown codes kept as [`RejectReason::Other`]).
    pub reason: RejectReason,
    /// Additional reject information (its length is the reject info length, up to 72).
    pub ari: &'a [u8],
    /// Private data (up to 148 bytes; reason 28: the consumer's, e.g. `SRP_LOGIN_REJ`).
    pub private_data: &'a [u8],
}

impl<'a> CmRejRepr<'a> {
    /// Parse a REJ body.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`]; [`Error::ReservedMessageKind`];
    /// [`Error::BadRejectInfoLength`] for a reject info length above 72.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(msg: &CmRej<&'a T>) -> Result<CmRejRepr<'a>> {
        msg.check_len()?;
        let info_len = msg.reject_info_len();
        let ari = msg
            .ari_field()
            .get(..usize::from(info_len))
            .ok_or(Error::BadRejectInfoLength(info_len))?;
        Ok(CmRejRepr {
            local_comm_id: msg.local_comm_id(),
            remote_comm_id: msg.remote_comm_id(),
            message_rejected: CmMessageKind::from_bits(msg.message_rejected_bits())?,
            reason: msg.reason(),
            ari,
            private_data: msg.private_data(),
        })
    }

    /// The body length.
    pub const fn buffer_len(&self) -> usize {
        MESSAGE_LEN
    }

    /// Write the body; reserved fields, unused ARI and private data are zeroed.
    ///
    /// # Errors
    ///
    /// [`Error::FieldOutOfRange`] for an ARI above 72 bytes;
    /// [`Error::PrivateDataTooLong`]; [`Error::BufferTooShort`].
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, msg: &mut CmRej<T>) -> Result<()> {
        if self.ari.len() > ARI_LEN {
            return Err(Error::FieldOutOfRange("REJ ARI"));
        }
        if self.private_data.len() > PRIVATE_DATA_LEN {
            return Err(Error::PrivateDataTooLong(PRIVATE_DATA_LEN));
        }
        msg.check_len().map_err(|_| Error::BufferTooShort)?;
        clear_body(msg.buffer.as_mut());
        msg.set_local_comm_id(self.local_comm_id);
        msg.set_remote_comm_id(self.remote_comm_id);
        msg.set_message_rejected(self.message_rejected);
        msg.set_reason(self.reason);
        msg.set_ari(self.ari)?;
        msg.set_private_data(self.private_data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ari_and_bits() {
        let mut body = [0u8; MESSAGE_LEN];
        let repr = CmRejRepr {
            local_comm_id: 0,
            remote_comm_id: 7,
            message_rejected: CmMessageKind::Rep,
            reason: RejectReason::InvalidGid,
            ari: &[0xaa; 16],
            private_data: &[1, 2, 3],
        };
        repr.emit(&mut CmRej::new_unchecked(&mut body[..])).unwrap();
        assert_eq!(&body[8..12], &[0x40, 0x20, 0x00, 0x0c]);
        assert_eq!(
            &body[12..29],
            &[
                0xaa, 0xaa, 0xaa, 0xaa, 0xaa, 0xaa, 0xaa, 0xaa, 0xaa, 0xaa, 0xaa, 0xaa, 0xaa, 0xaa,
                0xaa, 0xaa, 0x00
            ]
        );
        let parsed = CmRejRepr::parse(&CmRej::new_checked(&body[..]).unwrap()).unwrap();
        assert_eq!(parsed.ari, &[0xaa; 16]);
        assert_eq!(&parsed.private_data[..4], &[1, 2, 3, 0]);
        assert_eq!(parsed.private_data.len(), PRIVATE_DATA_LEN);
    }

    #[test]
    fn malformed() {
        let mut body = [0u8; MESSAGE_LEN];
        body[9] = 73 << 1;
        assert_eq!(
            CmRejRepr::parse(&CmRej::new_checked(&body[..]).unwrap()),
            Err(Error::BadRejectInfoLength(73))
        );
        body[9] = 72 << 1;
        assert!(CmRejRepr::parse(&CmRej::new_checked(&body[..]).unwrap()).is_ok());
        body[8] = 0xc0;
        assert_eq!(
            CmRejRepr::parse(&CmRej::new_checked(&body[..]).unwrap()),
            Err(Error::ReservedMessageKind(3))
        );
        // An unknown reason is still a REJ.
        body[8] = 0;
        body[10..12].copy_from_slice(&[0x12, 0x34]);
        let parsed = CmRejRepr::parse(&CmRej::new_checked(&body[..]).unwrap()).unwrap();
        assert_eq!(parsed.reason, RejectReason::Other(0x1234));
        let too_long = [0u8; 73];
        let bad = CmRejRepr {
            ari: &too_long,
            ..parsed
        };
        let mut out = [0u8; MESSAGE_LEN];
        assert_eq!(
            bad.emit(&mut CmRej::new_unchecked(&mut out[..])),
            Err(Error::FieldOutOfRange("REJ ARI"))
        );
    }
}
