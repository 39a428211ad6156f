//! Just enough Ethernet and ARP to prove the frame path to the VM both ways.
//!
//! The real RoCEv2 link lives in `hca-lowlevel`; this module only builds an
//! ARP request and recognises the VM's reply, so the harness test can check
//! that a frame sent into the unix datagram socket reaches the guest's
//! network stack and that the guest's answer comes back.

use std::fmt;
use std::net::Ipv4Addr;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// EtherType of ARP.
pub const ETHERTYPE_ARP: u16 = 0x0806;
/// Length of an Ethernet II header (no VLAN tag).
pub const ETHERNET_HEADER_LEN: usize = 14;
/// Length of an ARP packet for IPv4 over Ethernet.
pub const ARP_IPV4_LEN: usize = 28;
/// ARP operation: request.
pub const ARP_OP_REQUEST: u16 = 1;
/// ARP operation: reply.
pub const ARP_OP_REPLY: u16 = 2;

/// A 48-bit Ethernet MAC address, written `52:54:00:12:34:56`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MacAddr(pub [u8; 6]);

impl MacAddr {
    /// The broadcast address `ff:ff:ff:ff:ff:ff`.
    pub const BROADCAST: MacAddr = MacAddr([0xff; 6]);

    /// True for a unicast address (group bit clear), the only kind a NIC may own.
    pub fn is_unicast(&self) -> bool {
        self.0[0] & 1 == 0
    }

    /// The modified EUI-64 that rxe derives from this MAC for its node GUID
    /// and the interface id of GID 0 (`addrconf_addr_eui48`).
    pub fn eui64(&self) -> [u8; 8] {
        let m = self.0;
        [m[0] ^ 0x02, m[1], m[2], 0xff, 0xfe, m[3], m[4], m[5]]
    }
}

impl fmt::Display for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = self.0;
        write!(
            f,
            "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
            m[0], m[1], m[2], m[3], m[4], m[5]
        )
    }
}

/// Why a MAC address string was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid MAC address {0:?}: expected six hex octets like 52:54:00:12:34:56")]
pub struct ParseMacError(String);

impl FromStr for MacAddr {
    type Err = ParseMacError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut out = [0u8; 6];
        let mut parts = s.split([':', '-']);
        for byte in &mut out {
            let part = parts.next().ok_or_else(|| ParseMacError(s.to_owned()))?;
            if part.len() != 2 {
                return Err(ParseMacError(s.to_owned()));
            }
            *byte = u8::from_str_radix(part, 16).map_err(|_| ParseMacError(s.to_owned()))?;
        }
        if parts.next().is_some() {
            return Err(ParseMacError(s.to_owned()));
        }
        Ok(MacAddr(out))
    }
}

impl Serialize for MacAddr {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for MacAddr {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// An ARP packet for IPv4 over Ethernet, as carried in one frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArpPacket {
    /// Ethernet destination of the frame.
    pub eth_dst: MacAddr,
    /// Ethernet source of the frame.
    pub eth_src: MacAddr,
    /// [`ARP_OP_REQUEST`] or [`ARP_OP_REPLY`] (other values are kept as read).
    pub operation: u16,
    /// Sender hardware address.
    pub sender_mac: MacAddr,
    /// Sender protocol address.
    pub sender_ip: Ipv4Addr,
    /// Target hardware address (zero in a request).
    pub target_mac: MacAddr,
    /// Target protocol address.
    pub target_ip: Ipv4Addr,
}

/// Why a frame is not an IPv4-over-Ethernet ARP packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ArpParseError {
    /// Shorter than an Ethernet header plus a 28-byte ARP body.
    #[error("frame of {0} bytes is too short for ARP")]
    TooShort(usize),
    /// The EtherType is not ARP.
    #[error("EtherType {0:#06x} is not ARP")]
    NotArp(u16),
    /// The hardware/protocol types or lengths are not Ethernet/IPv4.
    #[error("ARP for another hardware or protocol type")]
    NotEthernetIpv4,
}

impl ArpPacket {
    /// A broadcast who-has request for `target_ip` from `sender_mac`/`sender_ip`.
    pub fn request(sender_mac: MacAddr, sender_ip: Ipv4Addr, target_ip: Ipv4Addr) -> Self {
        ArpPacket {
            eth_dst: MacAddr::BROADCAST,
            eth_src: sender_mac,
            operation: ARP_OP_REQUEST,
            sender_mac,
            sender_ip,
            target_mac: MacAddr([0; 6]),
            target_ip,
        }
    }

    /// The frame bytes (Ethernet header plus ARP body; no padding, no FCS).
    pub fn to_frame(&self) -> Vec<u8> {
        let mut frame = Vec::with_capacity(ETHERNET_HEADER_LEN + ARP_IPV4_LEN);
        frame.extend_from_slice(&self.eth_dst.0);
        frame.extend_from_slice(&self.eth_src.0);
        frame.extend_from_slice(&ETHERTYPE_ARP.to_be_bytes());
        frame.extend_from_slice(&1u16.to_be_bytes()); // hardware type: Ethernet
        frame.extend_from_slice(&0x0800u16.to_be_bytes()); // protocol type: IPv4
        frame.push(6);
        frame.push(4);
        frame.extend_from_slice(&self.operation.to_be_bytes());
        frame.extend_from_slice(&self.sender_mac.0);
        frame.extend_from_slice(&self.sender_ip.octets());
        frame.extend_from_slice(&self.target_mac.0);
        frame.extend_from_slice(&self.target_ip.octets());
        frame
    }

    /// Reads an ARP packet from a frame; any trailing padding is ignored.
    pub fn parse(frame: &[u8]) -> Result<Self, ArpParseError> {
        let body = frame
            .get(ETHERNET_HEADER_LEN..ETHERNET_HEADER_LEN + ARP_IPV4_LEN)
            .ok_or(ArpParseError::TooShort(frame.len()))?;
        let ethertype = u16::from_be_bytes([frame[12], frame[13]]);
        if ethertype != ETHERTYPE_ARP {
            return Err(ArpParseError::NotArp(ethertype));
        }
        if body[0..6] != [0, 1, 0x08, 0x00, 6, 4] {
            return Err(ArpParseError::NotEthernetIpv4);
        }
        let mac = |at: usize| {
            let mut m = [0u8; 6];
            m.copy_from_slice(&body[at..at + 6]);
            MacAddr(m)
        };
        let ip = |at: usize| Ipv4Addr::new(body[at], body[at + 1], body[at + 2], body[at + 3]);
        Ok(ArpPacket {
            eth_dst: {
                let mut m = [0u8; 6];
                m.copy_from_slice(&frame[0..6]);
                MacAddr(m)
            },
            eth_src: {
                let mut m = [0u8; 6];
                m.copy_from_slice(&frame[6..12]);
                MacAddr(m)
            },
            operation: u16::from_be_bytes([body[6], body[7]]),
            sender_mac: mac(8),
            sender_ip: ip(14),
            target_mac: mac(18),
            target_ip: ip(24),
        })
    }

    /// True if `self` answers `request`: a reply, sent to the requester, in
    /// which the owner of the requested IP gives its own MAC.
    pub fn is_reply_to(&self, request: &ArpPacket) -> bool {
        self.operation == ARP_OP_REPLY
            && self.eth_dst == request.sender_mac
            && self.sender_ip == request.target_ip
            && self.target_ip == request.sender_ip
            && self.target_mac == request.sender_mac
            && self.eth_src == self.sender_mac
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mac_round_trips_and_rejects_garbage() {
        let mac: MacAddr = "52:54:00:12:34:56".parse().unwrap();
        assert_eq!(mac.0, [0x52, 0x54, 0x00, 0x12, 0x34, 0x56]);
        assert_eq!(mac.to_string(), "52:54:00:12:34:56");
        assert!(mac.is_unicast());
        assert!(!MacAddr::BROADCAST.is_unicast());
        for bad in [
            "",
            "52:54:00:12:34",
            "52:54:00:12:34:56:78",
            "5:54:00:12:34:56",
            "zz:54:00:12:34:56",
        ] {
            assert!(bad.parse::<MacAddr>().is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn eui64_matches_rxe_node_guid() {
        // MAC 52:54:00:12:34:56 gives rxe node GUID 5054:00ff:fe12:3456.
        let mac: MacAddr = "52:54:00:12:34:56".parse().unwrap();
        assert_eq!(
            mac.eui64(),
            [0x50, 0x54, 0x00, 0xff, 0xfe, 0x12, 0x34, 0x56]
        );
    }

    #[test]
    fn arp_request_layout_and_reply_matching() {
        let host: MacAddr = "52:54:00:12:34:01".parse().unwrap();
        let vm: MacAddr = "52:54:00:12:34:56".parse().unwrap();
        let req = ArpPacket::request(host, Ipv4Addr::new(10, 0, 0, 1), Ipv4Addr::new(10, 0, 0, 2));
        let frame = req.to_frame();
        assert_eq!(frame.len(), 42);
        assert_eq!(&frame[0..6], &[0xff; 6]);
        assert_eq!(&frame[12..14], &[0x08, 0x06]);
        assert_eq!(&frame[20..22], &[0, 1]);
        assert_eq!(&frame[38..42], &[10, 0, 0, 2]);
        assert_eq!(ArpPacket::parse(&frame), Ok(req));

        let reply = ArpPacket {
            eth_dst: host,
            eth_src: vm,
            operation: ARP_OP_REPLY,
            sender_mac: vm,
            sender_ip: req.target_ip,
            target_mac: host,
            target_ip: req.sender_ip,
        };
        let mut padded = reply.to_frame();
        padded.resize(60, 0);
        let parsed = ArpPacket::parse(&padded).unwrap();
        assert!(parsed.is_reply_to(&req));
        assert!(!req.is_reply_to(&req));
        let wrong_ip = ArpPacket {
            sender_ip: Ipv4Addr::new(10, 0, 0, 3),
            ..reply
        };
        assert!(!wrong_ip.is_reply_to(&req));
    }

    #[test]
    fn arp_parse_rejects_other_frames() {
        assert_eq!(
            ArpPacket::parse(&[0u8; 41]),
            Err(ArpParseError::TooShort(41))
        );
        let mut ipv6 = vec![0u8; 60];
        ipv6[12] = 0x86;
        ipv6[13] = 0xdd;
        assert_eq!(ArpPacket::parse(&ipv6), Err(ArpParseError::NotArp(0x86dd)));
        let mut odd = ArpPacket::request(MacAddr([2; 6]), Ipv4Addr::LOCALHOST, Ipv4Addr::LOCALHOST)
            .to_frame();
        odd[18] = 16; // hardware length 16
        assert_eq!(ArpPacket::parse(&odd), Err(ArpParseError::NotEthernetIpv4));
    }
}
