//! ARP for IPv4 over Ethernet (28 bytes): a RoCEv2 stack on a TAP device
//! must answer the target's ARP requests for the initiator's address, and
//! resolve the target's MAC itself.
//!
//! ```text
//!  bytes 0-1   hardware type (1: Ethernet)
//!  bytes 2-3   protocol type (0x0800: IPv4)
//!  byte 4      hardware address length (6)
//!  byte 5      protocol address length (4)
//!  bytes 6-7   operation (1 request, 2 reply)
//!  bytes 8-13  sender hardware address
//!  bytes 14-17 sender protocol address
//!  bytes 18-23 target hardware address
//!  bytes 24-27 target protocol address
//! ```

use super::bytes::{self, Field};
use super::{Error, EtherType, EthernetAddress, Ipv4Address, Result};

mod field {
    use super::Field;
    pub const HTYPE: Field = 0..2;
    pub const PTYPE: Field = 2..4;
    pub const HLEN: usize = 4;
    pub const PLEN: usize = 5;
    pub const OPER: Field = 6..8;
    pub const SHA: Field = 8..14;
    pub const SPA: Field = 14..18;
    pub const THA: Field = 18..24;
    pub const TPA: Field = 24..28;
}

/// The length of an Ethernet/IPv4 ARP packet.
pub const PACKET_LEN: usize = field::TPA.end;
static_assertions::const_assert_eq!(PACKET_LEN, 28);

const HTYPE_ETHERNET: u16 = 1;

/// An ARP operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum ArpOperation {
    /// Who has the target protocol address?
    Request = 1,
    /// The sender has the sender protocol address.
    Reply = 2,
}

fixed_view! {
    /// A view of an ARP packet (the Ethernet payload).
    ArpPacket, PACKET_LEN
}

impl<T: AsRef<[u8]>> ArpPacket<T> {
    /// Hardware type.
    pub fn hardware_type(&self) -> u16 {
        bytes::read_be16(self.buffer.as_ref(), field::HTYPE)
    }

    /// Protocol type.
    pub fn protocol_type(&self) -> u16 {
        bytes::read_be16(self.buffer.as_ref(), field::PTYPE)
    }

    /// Hardware address length.
    pub fn hardware_len(&self) -> u8 {
        bytes::read_u8(self.buffer.as_ref(), field::HLEN)
    }

    /// Protocol address length.
    pub fn protocol_len(&self) -> u8 {
        bytes::read_u8(self.buffer.as_ref(), field::PLEN)
    }

    /// Raw operation.
    pub fn operation(&self) -> u16 {
        bytes::read_be16(self.buffer.as_ref(), field::OPER)
    }

    /// Sender MAC.
    pub fn source_hardware_addr(&self) -> EthernetAddress {
        EthernetAddress(bytes::read_array(self.buffer.as_ref(), field::SHA))
    }

    /// Sender IPv4 address.
    pub fn source_protocol_addr(&self) -> Ipv4Address {
        Ipv4Address(bytes::read_array(self.buffer.as_ref(), field::SPA))
    }

    /// Target MAC.
    pub fn target_hardware_addr(&self) -> EthernetAddress {
        EthernetAddress(bytes::read_array(self.buffer.as_ref(), field::THA))
    }

    /// Target IPv4 address.
    pub fn target_protocol_addr(&self) -> Ipv4Address {
        Ipv4Address(bytes::read_array(self.buffer.as_ref(), field::TPA))
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> ArpPacket<T> {
    /// Set the Ethernet/IPv4 type and length fields.
    pub fn set_ethernet_ipv4(&mut self) {
        let buf = self.buffer.as_mut();
        bytes::write_be16(buf, field::HTYPE, HTYPE_ETHERNET);
        bytes::write_be16(buf, field::PTYPE, EtherType::IPV4.0);
        bytes::write_u8(buf, field::HLEN, 6);
        bytes::write_u8(buf, field::PLEN, 4);
    }

    /// Set the operation.
    pub fn set_operation(&mut self, op: ArpOperation) {
        bytes::write_be16(self.buffer.as_mut(), field::OPER, op as u16);
    }

    /// Set the sender MAC.
    pub fn set_source_hardware_addr(&mut self, addr: EthernetAddress) {
        bytes::write_bytes(self.buffer.as_mut(), field::SHA, &addr.0);
    }

    /// Set the sender IPv4 address.
    pub fn set_source_protocol_addr(&mut self, addr: Ipv4Address) {
        bytes::write_bytes(self.buffer.as_mut(), field::SPA, &addr.0);
    }

    /// Set the target MAC.
    pub fn set_target_hardware_addr(&mut self, addr: EthernetAddress) {
        bytes::write_bytes(self.buffer.as_mut(), field::THA, &addr.0);
    }

    /// Set the target IPv4 address.
    pub fn set_target_protocol_addr(&mut self, addr: Ipv4Address) {
        bytes::write_bytes(self.buffer.as_mut(), field::TPA, &addr.0);
    }
}

/// The meaning of an Ethernet/IPv4 ARP packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ArpRepr {
    /// Request or reply.
    pub operation: ArpOperation,
    /// Sender MAC.
    pub source_hardware_addr: EthernetAddress,
    /// Sender IPv4 address.
    pub source_protocol_addr: Ipv4Address,
    /// Target MAC (zero in a request).
    pub target_hardware_addr: EthernetAddress,
    /// Target IPv4 address.
    pub target_protocol_addr: Ipv4Address,
}

impl ArpRepr {
    /// Parse an ARP packet (trailing Ethernet padding is ignored).
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`]; [`Error::UnsupportedArp`] unless hardware type
    /// 1, protocol type 0x0800 and lengths 6/4; [`Error::BadArpOperation`]
    /// for operations other than request and reply.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(packet: &ArpPacket<&T>) -> Result<ArpRepr> {
        packet.check_len()?;
        if packet.hardware_type() != HTYPE_ETHERNET
            || packet.protocol_type() != EtherType::IPV4.0
            || packet.hardware_len() != 6
            || packet.protocol_len() != 4
        {
            return Err(Error::UnsupportedArp);
        }
        let operation = match packet.operation() {
            1 => ArpOperation::Request,
            2 => ArpOperation::Reply,
            other => return Err(Error::BadArpOperation(other)),
        };
        Ok(ArpRepr {
            operation,
            source_hardware_addr: packet.source_hardware_addr(),
            source_protocol_addr: packet.source_protocol_addr(),
            target_hardware_addr: packet.target_hardware_addr(),
            target_protocol_addr: packet.target_protocol_addr(),
        })
    }

    /// A request asking who has `target`, from `mac`/`ip`.
    pub const fn request(mac: EthernetAddress, ip: Ipv4Address, target: Ipv4Address) -> ArpRepr {
        ArpRepr {
            operation: ArpOperation::Request,
            source_hardware_addr: mac,
            source_protocol_addr: ip,
            target_hardware_addr: EthernetAddress([0; 6]),
            target_protocol_addr: target,
        }
    }

    /// The reply to this packet from the owner of `ip` at `mac`, if this is
    /// a request for `ip`.
    pub fn reply_for(&self, mac: EthernetAddress, ip: Ipv4Address) -> Option<ArpRepr> {
        (self.operation == ArpOperation::Request && self.target_protocol_addr == ip).then_some(
            ArpRepr {
                operation: ArpOperation::Reply,
                source_hardware_addr: mac,
                source_protocol_addr: ip,
                target_hardware_addr: self.source_hardware_addr,
                target_protocol_addr: self.source_protocol_addr,
            },
        )
    }

    /// The packet length.
    pub const fn buffer_len(&self) -> usize {
        PACKET_LEN
    }

    /// Write the packet.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut ArpPacket<T>) {
        packet.set_ethernet_ipv4();
        packet.set_operation(self.operation);
        packet.set_source_hardware_addr(self.source_hardware_addr);
        packet.set_source_protocol_addr(self.source_protocol_addr);
        packet.set_target_hardware_addr(self.target_hardware_addr);
        packet.set_target_protocol_addr(self.target_protocol_addr);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAC_A: EthernetAddress = EthernetAddress([0x52, 0x54, 0x00, 0x12, 0x34, 0x56]);
    const MAC_B: EthernetAddress = EthernetAddress([0x02, 0, 0, 0, 0, 0x01]);
    const IP_A: Ipv4Address = Ipv4Address::new(192, 0, 2, 2);
    const IP_B: Ipv4Address = Ipv4Address::new(192, 0, 2, 1);

    // Written by hand from the layout above: A asks who has B.
    const REQUEST: [u8; 28] = [
        0x00, 0x01, 0x08, 0x00, 0x06, 0x04, 0x00, 0x01, 0x52, 0x54, 0x00, 0x12, 0x34, 0x56, 192, 0,
        2, 2, 0, 0, 0, 0, 0, 0, 192, 0, 2, 1,
    ];

    #[test]
    fn request_and_reply() {
        let req = ArpRepr::parse(&ArpPacket::new_checked(&REQUEST[..]).unwrap()).unwrap();
        assert_eq!(req, ArpRepr::request(MAC_A, IP_A, IP_B));
        let mut out = [0xffu8; 28];
        req.emit(&mut ArpPacket::new_unchecked(&mut out[..]));
        assert_eq!(out, REQUEST);

        let reply = req.reply_for(MAC_B, IP_B).unwrap();
        assert_eq!(reply.operation, ArpOperation::Reply);
        assert_eq!(reply.target_hardware_addr, MAC_A);
        assert_eq!(reply.target_protocol_addr, IP_A);
        assert_eq!(req.reply_for(MAC_B, IP_A), None);
        assert_eq!(reply.reply_for(MAC_B, IP_B), None);
    }

    #[test]
    fn malformed() {
        let parse = |b: &[u8]| ArpRepr::parse(&ArpPacket::new_unchecked(b));
        for (at, value) in [(1, 6u8), (2, 0x86), (4, 8), (5, 16)] {
            let mut b = REQUEST;
            b[at] = value;
            assert_eq!(parse(&b), Err(Error::UnsupportedArp));
        }
        let mut b = REQUEST;
        b[7] = 3;
        assert_eq!(parse(&b), Err(Error::BadArpOperation(3)));
        assert_eq!(parse(&REQUEST[..27]), Err(Error::Truncated));
    }
}
