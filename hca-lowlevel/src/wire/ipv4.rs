//! IPv4 header (20 bytes, no options): only what RoCEv2 needs.
//!
//! ```text
//!  byte 0     version(4) | IHL(4)
//!  byte 1     DSCP(6) | ECN(2)  ("TOS")
//!  bytes 2-3  total length
//!  bytes 4-5  identification
//!  bytes 6-7  reserved(1) | DF(1) | MF(1) | fragment offset(13)
//!  byte 8     TTL
//!  byte 9     protocol
//!  bytes 10-11 header checksum
//!  bytes 12-15 source address
//!  bytes 16-19 destination address
//! ```

use core::fmt;

use super::bytes::{self, Field};
use super::{Error, Result};

mod field {
    use super::Field;
    pub const VER_IHL: usize = 0;
    pub const TOS: usize = 1;
    pub const TOTAL_LEN: Field = 2..4;
    pub const IDENT: Field = 4..6;
    pub const FLAGS_FRAG: Field = 6..8;
    pub const TTL: usize = 8;
    pub const PROTOCOL: usize = 9;
    pub const CHECKSUM: Field = 10..12;
    pub const SRC_ADDR: Field = 12..16;
    pub const DST_ADDR: Field = 16..20;
}

/// The IPv4 header length without options.
pub const HEADER_LEN: usize = field::DST_ADDR.end;
static_assertions::const_assert_eq!(HEADER_LEN, 20);

const FLAG_DF: u16 = 0x4000;
const FLAG_MF: u16 = 0x2000;
const FRAG_OFFSET_MASK: u16 = 0x1fff;

/// An IPv4 address.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct Ipv4Address(pub [u8; 4]);

impl Ipv4Address {
    /// `0.0.0.0`.
    pub const UNSPECIFIED: Ipv4Address = Ipv4Address([0; 4]);
    /// `255.255.255.255`.
    pub const BROADCAST: Ipv4Address = Ipv4Address([255; 4]);

    /// The address from its four octets.
    pub const fn new(a: u8, b: u8, c: u8, d: u8) -> Ipv4Address {
        Ipv4Address([a, b, c, d])
    }

    /// `0.0.0.0`.
    pub const fn is_unspecified(&self) -> bool {
        matches!(self.0, [0, 0, 0, 0])
    }

    /// `255.255.255.255`.
    pub const fn is_broadcast(&self) -> bool {
        matches!(self.0, [255, 255, 255, 255])
    }

    /// `224.0.0.0/4`.
    pub const fn is_multicast(&self) -> bool {
        self.0[0] & 0xf0 == 0xe0
    }

    /// `127.0.0.0/8`.
    pub const fn is_loopback(&self) -> bool {
        self.0[0] == 127
    }

    /// A unicast address a RoCEv2 peer may use (the checks the Linux CM
    /// applies to both ends of a connection: not zero, broadcast, multicast
    /// or loopback).
    pub const fn is_unicast(&self) -> bool {
        !(self.is_unspecified() || self.is_broadcast() || self.is_multicast() || self.is_loopback())
    }
}

impl fmt::Debug for Ipv4Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for Ipv4Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [a, b, c, d] = self.0;
        write!(f, "{a}.{b}.{c}.{d}")
    }
}

/// An IP protocol number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpProtocol(pub u8);

impl IpProtocol {
    /// UDP (17), which carries RoCEv2.
    pub const UDP: IpProtocol = IpProtocol(17);
}

/// The 16-bit ones' complement sum of `data` (odd length padded with a zero
/// byte), added to `initial`, not yet folded.
pub(super) fn ones_complement_sum(data: &[u8], initial: u32) -> u32 {
    let mut sum = initial;
    let mut chunks = data.chunks_exact(2);
    for pair in &mut chunks {
        if let [hi, lo] = *pair {
            sum = sum.wrapping_add(u32::from(u16::from_be_bytes([hi, lo])));
        }
    }
    if let [last] = *chunks.remainder() {
        sum = sum.wrapping_add(u32::from(u16::from_be_bytes([last, 0])));
    }
    sum
}

/// Fold a ones' complement sum to 16 bits and complement it.
pub(super) fn fold_complement(mut sum: u32) -> u16 {
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    // CAST: folded to 16 bits above.
    !(sum as u16)
}

fixed_view! {
    /// A view of an IPv4 datagram (header and payload).
    Ipv4Packet, HEADER_LEN
}

impl<T: AsRef<[u8]>> Ipv4Packet<T> {
    /// IP version (4).
    pub fn version(&self) -> u8 {
        bytes::read_u8(self.buffer.as_ref(), field::VER_IHL) >> 4
    }

    /// Header length in 32-bit words.
    pub fn ihl(&self) -> u8 {
        bytes::read_u8(self.buffer.as_ref(), field::VER_IHL) & 0x0f
    }

    /// Header length in bytes.
    pub fn header_len(&self) -> usize {
        usize::from(self.ihl()) * 4
    }

    /// The DSCP/ECN byte ("type of service").
    pub fn tos(&self) -> u8 {
        bytes::read_u8(self.buffer.as_ref(), field::TOS)
    }

    /// Total datagram length (header and payload).
    pub fn total_len(&self) -> u16 {
        bytes::read_be16(self.buffer.as_ref(), field::TOTAL_LEN)
    }

    /// Identification.
    pub fn ident(&self) -> u16 {
        bytes::read_be16(self.buffer.as_ref(), field::IDENT)
    }

    /// Don't fragment.
    pub fn dont_fragment(&self) -> bool {
        bytes::read_be16(self.buffer.as_ref(), field::FLAGS_FRAG) & FLAG_DF != 0
    }

    /// More fragments.
    pub fn more_fragments(&self) -> bool {
        bytes::read_be16(self.buffer.as_ref(), field::FLAGS_FRAG) & FLAG_MF != 0
    }

    /// Fragment offset in 8-byte units.
    pub fn fragment_offset(&self) -> u16 {
        bytes::read_be16(self.buffer.as_ref(), field::FLAGS_FRAG) & FRAG_OFFSET_MASK
    }

    /// Time to live.
    pub fn ttl(&self) -> u8 {
        bytes::read_u8(self.buffer.as_ref(), field::TTL)
    }

    /// Payload protocol.
    pub fn protocol(&self) -> IpProtocol {
        IpProtocol(bytes::read_u8(self.buffer.as_ref(), field::PROTOCOL))
    }

    /// Header checksum as stored.
    pub fn checksum(&self) -> u16 {
        bytes::read_be16(self.buffer.as_ref(), field::CHECKSUM)
    }

    /// Source address.
    pub fn src_addr(&self) -> Ipv4Address {
        Ipv4Address(bytes::read_array(self.buffer.as_ref(), field::SRC_ADDR))
    }

    /// Destination address.
    pub fn dst_addr(&self) -> Ipv4Address {
        Ipv4Address(bytes::read_array(self.buffer.as_ref(), field::DST_ADDR))
    }

    /// The header checksum verifies (the sum over the header, checksum
    /// included, is all ones). False when the header is not in the buffer.
    pub fn verify_checksum(&self) -> bool {
        let header = bytes::slice(self.buffer.as_ref(), 0..self.header_len());
        header.len() >= HEADER_LEN && fold_complement(ones_complement_sum(header, 0)) == 0
    }
}

impl<'a, T: AsRef<[u8]> + ?Sized> Ipv4Packet<&'a T> {
    /// The payload: from the end of the header to the total length (any
    /// Ethernet padding beyond it excluded); empty when the lengths are
    /// inconsistent.
    pub fn payload(&self) -> &'a [u8] {
        let range = self.header_len()..usize::from(self.total_len());
        bytes::slice(self.buffer.as_ref(), range)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Ipv4Packet<T> {
    /// Set version 4 and the header length in words.
    pub fn set_version_ihl(&mut self, ihl: u8) {
        bytes::write_u8(self.buffer.as_mut(), field::VER_IHL, 0x40 | (ihl & 0x0f));
    }

    /// Set the DSCP/ECN byte.
    pub fn set_tos(&mut self, tos: u8) {
        bytes::write_u8(self.buffer.as_mut(), field::TOS, tos);
    }

    /// Set the total length.
    pub fn set_total_len(&mut self, len: u16) {
        bytes::write_be16(self.buffer.as_mut(), field::TOTAL_LEN, len);
    }

    /// Set the identification.
    pub fn set_ident(&mut self, ident: u16) {
        bytes::write_be16(self.buffer.as_mut(), field::IDENT, ident);
    }

    /// Set DF with MF and the fragment offset clear (an unfragmented datagram).
    pub fn set_unfragmented(&mut self, dont_fragment: bool) {
        let value = if dont_fragment { FLAG_DF } else { 0 };
        bytes::write_be16(self.buffer.as_mut(), field::FLAGS_FRAG, value);
    }

    /// Set the time to live.
    pub fn set_ttl(&mut self, ttl: u8) {
        bytes::write_u8(self.buffer.as_mut(), field::TTL, ttl);
    }

    /// Set the payload protocol.
    pub fn set_protocol(&mut self, protocol: IpProtocol) {
        bytes::write_u8(self.buffer.as_mut(), field::PROTOCOL, protocol.0);
    }

    /// Store a checksum value.
    pub fn set_checksum(&mut self, checksum: u16) {
        bytes::write_be16(self.buffer.as_mut(), field::CHECKSUM, checksum);
    }

    /// Set the source address.
    pub fn set_src_addr(&mut self, addr: Ipv4Address) {
        bytes::write_bytes(self.buffer.as_mut(), field::SRC_ADDR, &addr.0);
    }

    /// Set the destination address.
    pub fn set_dst_addr(&mut self, addr: Ipv4Address) {
        bytes::write_bytes(self.buffer.as_mut(), field::DST_ADDR, &addr.0);
    }

    /// Compute and store the header checksum.
    pub fn fill_checksum(&mut self) {
        self.set_checksum(0);
        let header_len = self.header_len();
        let header = bytes::slice(self.buffer.as_ref(), 0..header_len);
        let checksum = fold_complement(ones_complement_sum(header, 0));
        self.set_checksum(checksum);
    }

    /// The mutable payload bytes (up to the total length).
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let range = self.header_len()..usize::from(self.total_len());
        bytes::slice_mut(self.buffer.as_mut(), range)
    }
}

/// The meaning of an unfragmented IPv4 header without options.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ipv4Repr {
    /// Source address.
    pub src_addr: Ipv4Address,
    /// Destination address.
    pub dst_addr: Ipv4Address,
    /// Payload protocol.
    pub protocol: IpProtocol,
    /// Payload length in bytes.
    pub payload_len: usize,
    /// DSCP/ECN byte (the RoCE traffic class).
    pub tos: u8,
    /// Time to live (the RoCE hop limit).
    pub ttl: u8,
    /// Identification.
    pub ident: u16,
    /// Don't fragment (rxe sets it).
    pub dont_fragment: bool,
}

impl Ipv4Repr {
    /// Parse and validate an IPv4 header.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`], [`Error::BadIpVersion`],
    /// [`Error::BadIpv4HeaderLength`], [`Error::Ipv4OptionsUnsupported`],
    /// [`Error::BadIpv4TotalLength`], [`Error::Ipv4Fragment`],
    /// [`Error::BadIpv4Checksum`].
    pub fn parse<T: AsRef<[u8]> + ?Sized>(packet: &Ipv4Packet<&T>) -> Result<Ipv4Repr> {
        packet.check_len()?;
        if packet.version() != 4 {
            return Err(Error::BadIpVersion(packet.version()));
        }
        let ihl = packet.ihl();
        if ihl < 5 {
            return Err(Error::BadIpv4HeaderLength(ihl));
        }
        if ihl > 5 {
            return Err(Error::Ipv4OptionsUnsupported);
        }
        let total_len = usize::from(packet.total_len());
        if total_len < HEADER_LEN || total_len > packet.buffer.as_ref().len() {
            return Err(Error::BadIpv4TotalLength);
        }
        if packet.more_fragments() || packet.fragment_offset() != 0 {
            return Err(Error::Ipv4Fragment);
        }
        if !packet.verify_checksum() {
            return Err(Error::BadIpv4Checksum);
        }
        Ok(Ipv4Repr {
            src_addr: packet.src_addr(),
            dst_addr: packet.dst_addr(),
            protocol: packet.protocol(),
            payload_len: total_len - HEADER_LEN,
            tos: packet.tos(),
            ttl: packet.ttl(),
            ident: packet.ident(),
            dont_fragment: packet.dont_fragment(),
        })
    }

    /// The header length.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Write the header, checksum included (the payload is not touched).
    ///
    /// # Errors
    ///
    /// [`Error::PayloadTooLong`] when the total length exceeds 65535.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut Ipv4Packet<T>) -> Result<()> {
        let total_len = self
            .payload_len
            .checked_add(HEADER_LEN)
            .and_then(|len| u16::try_from(len).ok())
            .ok_or(Error::PayloadTooLong)?;
        packet.set_version_ihl(5);
        packet.set_tos(self.tos);
        packet.set_total_len(total_len);
        packet.set_ident(self.ident);
        packet.set_unfragmented(self.dont_fragment);
        packet.set_ttl(self.ttl);
        packet.set_protocol(self.protocol);
        packet.set_src_addr(self.src_addr);
        packet.set_dst_addr(self.dst_addr);
        packet.fill_checksum();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The IPv4 header of the SEND_ONLY golden frame (wire-formats.md §4).
    const GOLDEN: [u8; 20] = [
        0x45, 0x00, 0x00, 0x38, 0x00, 0x01, 0x40, 0x00, 0x40, 0x11, 0xb6, 0xb0, 0xc0, 0x00, 0x02,
        0x01, 0xc0, 0x00, 0x02, 0x02,
    ];

    fn with_payload(header: &[u8; 20]) -> [u8; 56] {
        let mut buf = [0u8; 56];
        buf[..20].copy_from_slice(header);
        buf
    }

    #[test]
    fn golden_parse_and_emit() {
        let buf = with_payload(&GOLDEN);
        let packet = Ipv4Packet::new_checked(&buf[..]).unwrap();
        assert!(packet.verify_checksum());
        let repr = Ipv4Repr::parse(&packet).unwrap();
        assert_eq!(
            repr,
            Ipv4Repr {
                src_addr: Ipv4Address::new(192, 0, 2, 1),
                dst_addr: Ipv4Address::new(192, 0, 2, 2),
                protocol: IpProtocol::UDP,
                payload_len: 36,
                tos: 0,
                ttl: 64,
                ident: 1,
                dont_fragment: true,
            }
        );
        assert_eq!(packet.payload().len(), 36);
        let mut out = [0u8; 20];
        repr.emit(&mut Ipv4Packet::new_unchecked(&mut out[..]))
            .unwrap();
        assert_eq!(out, GOLDEN);
    }

    #[test]
    fn each_check_has_its_error() {
        let parse = |h: [u8; 20]| {
            let buf = with_payload(&h);
            Ipv4Repr::parse(&Ipv4Packet::new_unchecked(&buf[..]))
        };
        let fixed = |mut h: [u8; 20]| {
            let mut p = Ipv4Packet::new_unchecked(&mut h[..]);
            p.fill_checksum();
            h
        };
        let mut h = GOLDEN;
        h[0] = 0x65;
        assert_eq!(parse(fixed(h)), Err(Error::BadIpVersion(6)));
        h = GOLDEN;
        h[0] = 0x44;
        assert_eq!(parse(h), Err(Error::BadIpv4HeaderLength(4)));
        h = GOLDEN;
        h[0] = 0x46;
        assert_eq!(parse(fixed(h)), Err(Error::Ipv4OptionsUnsupported));
        h = GOLDEN;
        h[3] = 0x39; // 57 > 56 bytes of buffer
        assert_eq!(parse(fixed(h)), Err(Error::BadIpv4TotalLength));
        h = GOLDEN;
        h[2] = 0;
        h[3] = 19;
        assert_eq!(parse(fixed(h)), Err(Error::BadIpv4TotalLength));
        h = GOLDEN;
        h[6] = 0x20; // MF
        assert_eq!(parse(fixed(h)), Err(Error::Ipv4Fragment));
        h = GOLDEN;
        h[7] = 0x01; // offset 1
        assert_eq!(parse(fixed(h)), Err(Error::Ipv4Fragment));
        h = GOLDEN;
        h[11] ^= 1;
        assert_eq!(parse(h), Err(Error::BadIpv4Checksum));
        assert_eq!(
            Ipv4Packet::new_checked(&GOLDEN[..19]).unwrap_err(),
            Error::Truncated
        );
    }

    #[test]
    fn oversized_payload_refused() {
        let repr = Ipv4Repr {
            src_addr: Ipv4Address::UNSPECIFIED,
            dst_addr: Ipv4Address::BROADCAST,
            protocol: IpProtocol::UDP,
            payload_len: 65_516,
            tos: 0,
            ttl: 1,
            ident: 0,
            dont_fragment: false,
        };
        let mut out = [0u8; 20];
        assert_eq!(
            repr.emit(&mut Ipv4Packet::new_unchecked(&mut out[..])),
            Err(Error::PayloadTooLong)
        );
    }

    #[test]
    fn address_classes() {
        assert!(Ipv4Address::new(192, 0, 2, 1).is_unicast());
        assert!(!Ipv4Address::new(127, 0, 0, 1).is_unicast());
        assert!(!Ipv4Address::new(224, 0, 0, 1).is_unicast());
        assert!(!Ipv4Address::BROADCAST.is_unicast());
        assert!(!Ipv4Address::UNSPECIFIED.is_unicast());
        assert_eq!(
            std::format!("{}", Ipv4Address::new(10, 0, 0, 7)),
            "10.0.0.7"
        );
    }
}
