//! The 24-byte common MAD header (IBA 13.4.3) and the constants the CM uses.
//!
//! ```text
//!  byte 0     BaseVersion (1)
//!  byte 1     MgmtClass (0x07: CM)
//!  byte 2     ClassVersion (2 for the CM)
//!  byte 3     R(1) | Method(7) (0x03: Send)
//!  bytes 4-5  Status
//!  bytes 6-7  ClassSpecific
//!  bytes 8-15 TransactionID
//!  bytes 16-17 AttributeID
//!  bytes 18-19 reserved
//!  bytes 20-23 AttributeModifier
//! ```
//! A MAD is 256 bytes: this header and 232 bytes of class data.

use hca_lowlevel::wire::bytes::{self, Field, Rest};

use super::Result;

mod field {
    use super::{Field, Rest};
    pub const BASE_VERSION: usize = 0;
    pub const MGMT_CLASS: usize = 1;
    pub const CLASS_VERSION: usize = 2;
    pub const METHOD: usize = 3;
    pub const STATUS: Field = 4..6;
    pub const CLASS_SPECIFIC: Field = 6..8;
    pub const TRANSACTION_ID: Field = 8..16;
    pub const ATTRIBUTE_ID: Field = 16..18;
    pub const RESERVED: Field = 18..20;
    pub const ATTRIBUTE_MODIFIER: Field = 20..24;
    pub const DATA: Rest = 24..;
}

/// Length of the common MAD header.
pub const MAD_HEADER_LEN: usize = field::ATTRIBUTE_MODIFIER.end;
/// Length of a MAD (a QP1 datagram's payload).
pub const MAD_LEN: usize = 256;
/// Length of the class data after the header.
pub const MAD_DATA_LEN: usize = MAD_LEN - MAD_HEADER_LEN;
static_assertions::const_assert_eq!(MAD_HEADER_LEN, 24);
static_assertions::const_assert_eq!(MAD_DATA_LEN, 232);

/// The MAD base version.
pub const BASE_VERSION: u8 = 1;
/// The communication management class.
pub const MGMT_CLASS_CM: u8 = 0x07;
/// The CM class version.
pub const CM_CLASS_VERSION: u8 = 2;

/// MAD methods (byte 3; the top bit marks a response).
pub mod method {
    /// Get.
    pub const GET: u8 = 0x01;
    /// Set.
    pub const SET: u8 = 0x02;
    /// Send: every CM message.
    pub const SEND: u8 = 0x03;
    /// Response to a Get.
    pub const GET_RESP: u8 = 0x81;
}

/// CM attribute IDs (IBA table 104).
pub mod attribute {
    /// ClassPortInfo.
    pub const CLASS_PORT_INFO: u16 = 0x0001;
    /// Connection request.
    pub const REQ: u16 = 0x0010;
    /// Message receipt acknowledgement.
    pub const MRA: u16 = 0x0011;
    /// Reject.
    pub const REJ: u16 = 0x0012;
    /// Reply to a REQ.
    pub const REP: u16 = 0x0013;
    /// Ready to use.
    pub const RTU: u16 = 0x0014;
    /// Disconnect request.
    pub const DREQ: u16 = 0x0015;
    /// Disconnect reply.
    pub const DREP: u16 = 0x0016;
    /// Service ID resolution request.
    pub const SIDR_REQ: u16 = 0x0017;
    /// Service ID resolution reply.
    pub const SIDR_REP: u16 = 0x0018;
    /// Load alternate path.
    pub const LAP: u16 = 0x0019;
    /// Alternate path response.
    pub const APR: u16 = 0x001a;
}

fixed_view! {
    /// A view of a MAD (header and class data).
    MadHeader, MAD_HEADER_LEN
}

impl<T: AsRef<[u8]>> MadHeader<T> {
    /// Base version.
    pub fn base_version(&self) -> u8 {
        bytes::read_u8(self.buffer.as_ref(), field::BASE_VERSION)
    }

    /// Management class.
    pub fn mgmt_class(&self) -> u8 {
        bytes::read_u8(self.buffer.as_ref(), field::MGMT_CLASS)
    }

    /// Class version.
    pub fn class_version(&self) -> u8 {
        bytes::read_u8(self.buffer.as_ref(), field::CLASS_VERSION)
    }

    /// Method (response bit included).
    pub fn method(&self) -> u8 {
        bytes::read_u8(self.buffer.as_ref(), field::METHOD)
    }

    /// Status.
    pub fn status(&self) -> u16 {
        bytes::read_be16(self.buffer.as_ref(), field::STATUS)
    }

    /// Class-specific field.
    pub fn class_specific(&self) -> u16 {
        bytes::read_be16(self.buffer.as_ref(), field::CLASS_SPECIFIC)
    }

    /// Transaction ID (the CM reuses the REQ's for REP, RTU, REJ and MRA).
    pub fn transaction_id(&self) -> u64 {
        bytes::read_be64(self.buffer.as_ref(), field::TRANSACTION_ID)
    }

    /// Attribute ID (the CM message type).
    pub fn attribute_id(&self) -> u16 {
        bytes::read_be16(self.buffer.as_ref(), field::ATTRIBUTE_ID)
    }

    /// Attribute modifier (newer kernels carry ECE options here in REQ/REP).
    pub fn attribute_modifier(&self) -> u32 {
        bytes::read_be32(self.buffer.as_ref(), field::ATTRIBUTE_MODIFIER)
    }
}

impl<'a, T: AsRef<[u8]> + ?Sized> MadHeader<&'a T> {
    /// The class data after the header (up to 232 bytes in a whole MAD).
    pub fn data(&self) -> &'a [u8] {
        bytes::rest(self.buffer.as_ref(), field::DATA)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> MadHeader<T> {
    /// Set the base version.
    pub fn set_base_version(&mut self, value: u8) {
        bytes::write_u8(self.buffer.as_mut(), field::BASE_VERSION, value);
    }

    /// Set the management class.
    pub fn set_mgmt_class(&mut self, value: u8) {
        bytes::write_u8(self.buffer.as_mut(), field::MGMT_CLASS, value);
    }

    /// Set the class version.
    pub fn set_class_version(&mut self, value: u8) {
        bytes::write_u8(self.buffer.as_mut(), field::CLASS_VERSION, value);
    }

    /// Set the method.
    pub fn set_method(&mut self, value: u8) {
        bytes::write_u8(self.buffer.as_mut(), field::METHOD, value);
    }

    /// Set the status.
    pub fn set_status(&mut self, value: u16) {
        bytes::write_be16(self.buffer.as_mut(), field::STATUS, value);
    }

    /// Set the class-specific field.
    pub fn set_class_specific(&mut self, value: u16) {
        bytes::write_be16(self.buffer.as_mut(), field::CLASS_SPECIFIC, value);
    }

    /// Set the transaction ID.
    pub fn set_transaction_id(&mut self, value: u64) {
        bytes::write_be64(self.buffer.as_mut(), field::TRANSACTION_ID, value);
    }

    /// Set the attribute ID; the reserved field after it is cleared.
    pub fn set_attribute_id(&mut self, value: u16) {
        bytes::write_be16(self.buffer.as_mut(), field::ATTRIBUTE_ID, value);
        bytes::write_be16(self.buffer.as_mut(), field::RESERVED, 0);
    }

    /// Set the attribute modifier.
    pub fn set_attribute_modifier(&mut self, value: u32) {
        bytes::write_be32(self.buffer.as_mut(), field::ATTRIBUTE_MODIFIER, value);
    }

    /// The mutable class data after the header.
    pub fn data_mut(&mut self) -> &mut [u8] {
        self.buffer.as_mut().get_mut(field::DATA).unwrap_or(&mut [])
    }
}

/// The meaning of a MAD header, any class (no values are checked here;
/// [`CmMadRepr`](super::CmMadRepr) checks the CM's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MadHeaderRepr {
    /// Base version (1).
    pub base_version: u8,
    /// Management class.
    pub mgmt_class: u8,
    /// Class version.
    pub class_version: u8,
    /// Method (response bit included).
    pub method: u8,
    /// Status.
    pub status: u16,
    /// Class-specific field.
    pub class_specific: u16,
    /// Transaction ID.
    pub transaction_id: u64,
    /// Attribute ID.
    pub attribute_id: u16,
    /// Attribute modifier.
    pub attribute_modifier: u32,
}

impl MadHeaderRepr {
    /// Parse a MAD header.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`](super::Error::Truncated).
    pub fn parse<T: AsRef<[u8]> + ?Sized>(header: &MadHeader<&T>) -> Result<MadHeaderRepr> {
        header.check_len()?;
        Ok(MadHeaderRepr {
            base_version: header.base_version(),
            mgmt_class: header.mgmt_class(),
            class_version: header.class_version(),
            method: header.method(),
            status: header.status(),
            class_specific: header.class_specific(),
            transaction_id: header.transaction_id(),
            attribute_id: header.attribute_id(),
            attribute_modifier: header.attribute_modifier(),
        })
    }

    /// The header length.
    pub const fn buffer_len(&self) -> usize {
        MAD_HEADER_LEN
    }

    /// Write the header.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, header: &mut MadHeader<T>) {
        header.set_base_version(self.base_version);
        header.set_mgmt_class(self.mgmt_class);
        header.set_class_version(self.class_version);
        header.set_method(self.method);
        header.set_status(self.status);
        header.set_class_specific(self.class_specific);
        header.set_transaction_id(self.transaction_id);
        header.set_attribute_id(self.attribute_id);
        header.set_attribute_modifier(self.attribute_modifier);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Error;

    #[test]
    fn header_round_trip() {
        let bytes = [
            0x01, 0x07, 0x02, 0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, 0x2a, 0x3b,
            0x4c, 0x5d, 0x00, 0x10, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xee,
        ];
        let view = MadHeader::new_checked(&bytes[..]).unwrap();
        let repr = MadHeaderRepr::parse(&view).unwrap();
        assert_eq!(repr.base_version, BASE_VERSION);
        assert_eq!(repr.mgmt_class, MGMT_CLASS_CM);
        assert_eq!(repr.class_version, CM_CLASS_VERSION);
        assert_eq!(repr.method, method::SEND);
        assert_eq!(repr.transaction_id, 0x1_2a3b_4c5d);
        assert_eq!(repr.attribute_id, attribute::REQ);
        assert_eq!(view.data(), &[0xee]);
        let mut out = [0u8; 25];
        let mut header = MadHeader::new_unchecked(&mut out[..]);
        repr.emit(&mut header);
        header.data_mut()[0] = 0xee;
        assert_eq!(out, bytes);
        assert_eq!(
            MadHeader::new_checked(&bytes[..23]).unwrap_err(),
            Error::Truncated
        );
    }
}
