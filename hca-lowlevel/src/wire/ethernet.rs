//! Ethernet II frame header (14 bytes, no VLAN tag): only what RoCEv2 needs.

use core::fmt;

use super::Result;
use super::bytes::{self, Field, Rest};

mod field {
    use super::{Field, Rest};
    pub const DESTINATION: Field = 0..6;
    pub const SOURCE: Field = 6..12;
    pub const ETHERTYPE: Field = 12..14;
    pub const PAYLOAD: Rest = 14..;
}

/// The Ethernet II header length.
pub const HEADER_LEN: usize = field::ETHERTYPE.end;
static_assertions::const_assert_eq!(HEADER_LEN, 14);

/// A 48-bit MAC address.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct EthernetAddress(pub [u8; 6]);

impl EthernetAddress {
    /// The broadcast address `ff:ff:ff:ff:ff:ff`.
    pub const BROADCAST: EthernetAddress = EthernetAddress([0xff; 6]);

    /// The group bit (I/G) is set: broadcast or multicast.
    pub const fn is_multicast(&self) -> bool {
        self.0[0] & 0x01 != 0
    }

    /// The broadcast address.
    pub const fn is_broadcast(&self) -> bool {
        matches!(self.0, [0xff, 0xff, 0xff, 0xff, 0xff, 0xff])
    }

    /// A unicast address.
    pub const fn is_unicast(&self) -> bool {
        !self.is_multicast()
    }
}

impl fmt::Debug for EthernetAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for EthernetAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [a, b, c, d, e, g] = self.0;
        write!(f, "{a:02x}:{b:02x}:{c:02x}:{d:02x}:{e:02x}:{g:02x}")
    }
}

/// An EtherType. Any 16-bit value is representable; the parsers that care
/// compare against the constants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EtherType(pub u16);

impl EtherType {
    /// IPv4.
    pub const IPV4: EtherType = EtherType(0x0800);
    /// ARP.
    pub const ARP: EtherType = EtherType(0x0806);
    /// IPv6.
    pub const IPV6: EtherType = EtherType(0x86dd);
}

fixed_view! {
    /// A view of an Ethernet II frame (header and payload).
    EthernetFrame, HEADER_LEN
}

impl<T: AsRef<[u8]>> EthernetFrame<T> {
    /// Destination MAC.
    pub fn destination(&self) -> EthernetAddress {
        EthernetAddress(bytes::read_array(self.buffer.as_ref(), field::DESTINATION))
    }

    /// Source MAC.
    pub fn source(&self) -> EthernetAddress {
        EthernetAddress(bytes::read_array(self.buffer.as_ref(), field::SOURCE))
    }

    /// EtherType.
    pub fn ethertype(&self) -> EtherType {
        EtherType(bytes::read_be16(self.buffer.as_ref(), field::ETHERTYPE))
    }
}

impl<'a, T: AsRef<[u8]> + ?Sized> EthernetFrame<&'a T> {
    /// The bytes after the header (including any minimum-size padding).
    pub fn payload(&self) -> &'a [u8] {
        bytes::rest(self.buffer.as_ref(), field::PAYLOAD)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> EthernetFrame<T> {
    /// Set the destination MAC.
    pub fn set_destination(&mut self, addr: EthernetAddress) {
        bytes::write_bytes(self.buffer.as_mut(), field::DESTINATION, &addr.0);
    }

    /// Set the source MAC.
    pub fn set_source(&mut self, addr: EthernetAddress) {
        bytes::write_bytes(self.buffer.as_mut(), field::SOURCE, &addr.0);
    }

    /// Set the EtherType.
    pub fn set_ethertype(&mut self, ethertype: EtherType) {
        bytes::write_be16(self.buffer.as_mut(), field::ETHERTYPE, ethertype.0);
    }

    /// The mutable bytes after the header.
    pub fn payload_mut(&mut self) -> &mut [u8] {
        self.buffer
            .as_mut()
            .get_mut(field::PAYLOAD)
            .unwrap_or(&mut [])
    }
}

/// The meaning of an Ethernet II header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EthernetRepr {
    /// Source MAC.
    pub src_addr: EthernetAddress,
    /// Destination MAC.
    pub dst_addr: EthernetAddress,
    /// EtherType of the payload.
    pub ethertype: EtherType,
}

impl EthernetRepr {
    /// Parse an Ethernet II header.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`](super::Error::Truncated).
    pub fn parse<T: AsRef<[u8]> + ?Sized>(frame: &EthernetFrame<&T>) -> Result<EthernetRepr> {
        frame.check_len()?;
        Ok(EthernetRepr {
            src_addr: frame.source(),
            dst_addr: frame.destination(),
            ethertype: frame.ethertype(),
        })
    }

    /// The header length.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Write the header.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, frame: &mut EthernetFrame<T>) {
        frame.set_destination(self.dst_addr);
        frame.set_source(self.src_addr);
        frame.set_ethertype(self.ethertype);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Error;

    #[test]
    fn golden_header() {
        let bytes = [
            0x52, 0x54, 0x00, 0x12, 0x34, 0x56, 0x02, 0x00, 0x00, 0x00, 0x00, 0x01, 0x08, 0x00,
            0xaa,
        ];
        let frame = EthernetFrame::new_checked(&bytes[..]).unwrap();
        let repr = EthernetRepr::parse(&frame).unwrap();
        assert_eq!(
            repr.dst_addr,
            EthernetAddress([0x52, 0x54, 0x00, 0x12, 0x34, 0x56])
        );
        assert_eq!(repr.src_addr, EthernetAddress([0x02, 0, 0, 0, 0, 0x01]));
        assert_eq!(repr.ethertype, EtherType::IPV4);
        assert_eq!(frame.payload(), &[0xaa]);
        let mut out = [0u8; 15];
        let mut view = EthernetFrame::new_unchecked(&mut out[..]);
        repr.emit(&mut view);
        view.payload_mut()[0] = 0xaa;
        assert_eq!(out, bytes);
        assert_eq!(
            EthernetFrame::new_checked(&bytes[..13]).unwrap_err(),
            Error::Truncated
        );
    }

    #[test]
    fn address_classes() {
        assert!(EthernetAddress::BROADCAST.is_broadcast());
        assert!(EthernetAddress::BROADCAST.is_multicast());
        assert!(EthernetAddress([0x01, 0, 0x5e, 0, 0, 1]).is_multicast());
        assert!(EthernetAddress([0x52, 0x54, 0, 0x12, 0x34, 0x56]).is_unicast());
        assert_eq!(
            std::format!("{}", EthernetAddress([0x52, 0x54, 0, 0x12, 0x34, 0x56])),
            "52:54:00:12:34:56"
        );
    }
}
