//! UDP header (8 bytes): only what RoCEv2 needs.
//!
//! RoCEv2 senders (rxe, ConnectX) put checksum 0 ("none", allowed over IPv4)
//! and rely on the ICRC; this module emits 0 and verifies a non-zero
//! checksum when one arrives.

use super::bytes::{self, Field};
use super::ipv4::{fold_complement, ones_complement_sum};
use super::{Error, IpProtocol, Ipv4Address, Result};

mod field {
    use super::Field;
    pub const SRC_PORT: Field = 0..2;
    pub const DST_PORT: Field = 2..4;
    pub const LENGTH: Field = 4..6;
    pub const CHECKSUM: Field = 6..8;
}

/// The UDP header length.
pub const HEADER_LEN: usize = field::CHECKSUM.end;
static_assertions::const_assert_eq!(HEADER_LEN, 8);

fixed_view! {
    /// A view of a UDP datagram (header and payload).
    UdpPacket, HEADER_LEN
}

impl<T: AsRef<[u8]>> UdpPacket<T> {
    /// Source port.
    pub fn src_port(&self) -> u16 {
        bytes::read_be16(self.buffer.as_ref(), field::SRC_PORT)
    }

    /// Destination port.
    pub fn dst_port(&self) -> u16 {
        bytes::read_be16(self.buffer.as_ref(), field::DST_PORT)
    }

    /// Length of header and payload.
    pub fn len(&self) -> u16 {
        bytes::read_be16(self.buffer.as_ref(), field::LENGTH)
    }

    /// The length field is zero (always malformed).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Checksum as stored (0: none).
    pub fn checksum(&self) -> u16 {
        bytes::read_be16(self.buffer.as_ref(), field::CHECKSUM)
    }

    /// The checksum verifies against the IPv4 pseudo-header, or is 0 (none).
    /// False when the length field exceeds the buffer.
    pub fn verify_checksum(&self, src: Ipv4Address, dst: Ipv4Address) -> bool {
        if self.checksum() == 0 {
            return true;
        }
        let len = usize::from(self.len());
        match self.buffer.as_ref().get(..len) {
            Some(datagram) => fold_complement(checksum_sum(src, dst, datagram)) == 0,
            None => false,
        }
    }
}

/// Pseudo-header plus datagram, unfolded.
fn checksum_sum(src: Ipv4Address, dst: Ipv4Address, datagram: &[u8]) -> u32 {
    let mut pseudo = [0u8; 12];
    bytes::write_bytes(&mut pseudo, 0..4, &src.0);
    bytes::write_bytes(&mut pseudo, 4..8, &dst.0);
    bytes::write_u8(&mut pseudo, 9, IpProtocol::UDP.0);
    // CAST: callers bound `datagram` by a 16-bit length field.
    bytes::write_be16(&mut pseudo, 10..12, datagram.len() as u16);
    ones_complement_sum(datagram, ones_complement_sum(&pseudo, 0))
}

impl<'a, T: AsRef<[u8]> + ?Sized> UdpPacket<&'a T> {
    /// The payload, bounded by the length field; empty when it is inconsistent.
    pub fn payload(&self) -> &'a [u8] {
        let range = HEADER_LEN..usize::from(self.len());
        bytes::slice(self.buffer.as_ref(), range)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> UdpPacket<T> {
    /// Set the source port.
    pub fn set_src_port(&mut self, port: u16) {
        bytes::write_be16(self.buffer.as_mut(), field::SRC_PORT, port);
    }

    /// Set the destination port.
    pub fn set_dst_port(&mut self, port: u16) {
        bytes::write_be16(self.buffer.as_mut(), field::DST_PORT, port);
    }

    /// Set the length.
    pub fn set_len(&mut self, len: u16) {
        bytes::write_be16(self.buffer.as_mut(), field::LENGTH, len);
    }

    /// Store a checksum value (0: none).
    pub fn set_checksum(&mut self, checksum: u16) {
        bytes::write_be16(self.buffer.as_mut(), field::CHECKSUM, checksum);
    }

    /// Compute and store the checksum over the pseudo-header and the datagram
    /// (as far as the length field says). A computed 0 is sent as 0xffff.
    pub fn fill_checksum(&mut self, src: Ipv4Address, dst: Ipv4Address) {
        self.set_checksum(0);
        let len = usize::from(self.len());
        let datagram = bytes::slice(self.buffer.as_ref(), 0..len);
        let checksum = match fold_complement(checksum_sum(src, dst, datagram)) {
            0 => 0xffff,
            sum => sum,
        };
        self.set_checksum(checksum);
    }

    /// The mutable payload bytes (up to the length field).
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let range = HEADER_LEN..usize::from(self.len());
        bytes::slice_mut(self.buffer.as_mut(), range)
    }
}

/// The meaning of a UDP header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct UdpRepr {
    /// Source port.
    pub src_port: u16,
    /// Destination port.
    pub dst_port: u16,
    /// Payload length.
    pub payload_len: usize,
}

impl UdpRepr {
    /// Parse a UDP header carried over IPv4 from `src` to `dst`.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`]; [`Error::BadUdpLength`] for a length below 8 or
    /// beyond the buffer; [`Error::BadUdpChecksum`] for a non-zero checksum
    /// that does not verify.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(
        packet: &UdpPacket<&T>,
        src: Ipv4Address,
        dst: Ipv4Address,
    ) -> Result<UdpRepr> {
        packet.check_len()?;
        let len = usize::from(packet.len());
        if len < HEADER_LEN || len > packet.buffer.as_ref().len() {
            return Err(Error::BadUdpLength);
        }
        if !packet.verify_checksum(src, dst) {
            return Err(Error::BadUdpChecksum);
        }
        Ok(UdpRepr {
            src_port: packet.src_port(),
            dst_port: packet.dst_port(),
            payload_len: len - HEADER_LEN,
        })
    }

    /// The header length.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Write the header with checksum 0 (none), as RoCEv2 senders do.
    ///
    /// # Errors
    ///
    /// [`Error::PayloadTooLong`] when the length exceeds 65535.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut UdpPacket<T>) -> Result<()> {
        let len = self
            .payload_len
            .checked_add(HEADER_LEN)
            .and_then(|len| u16::try_from(len).ok())
            .ok_or(Error::PayloadTooLong)?;
        packet.set_src_port(self.src_port);
        packet.set_dst_port(self.dst_port);
        packet.set_len(len);
        packet.set_checksum(0);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SRC: Ipv4Address = Ipv4Address::new(192, 0, 2, 1);
    const DST: Ipv4Address = Ipv4Address::new(192, 0, 2, 2);
    // The UDP header of the golden frame, followed by 4 payload bytes.
    const DATAGRAM: [u8; 12] = [0xc0, 0x00, 0x12, 0xb7, 0x00, 0x0c, 0x00, 0x00, 1, 2, 3, 4];

    #[test]
    fn parse_and_emit() {
        let packet = UdpPacket::new_checked(&DATAGRAM[..]).unwrap();
        let repr = UdpRepr::parse(&packet, SRC, DST).unwrap();
        assert_eq!(
            repr,
            UdpRepr {
                src_port: 0xc000,
                dst_port: 4791,
                payload_len: 4
            }
        );
        assert_eq!(packet.payload(), &[1, 2, 3, 4]);
        let mut out = DATAGRAM;
        out[..8].fill(0xee);
        repr.emit(&mut UdpPacket::new_unchecked(&mut out[..]))
            .unwrap();
        assert_eq!(out, DATAGRAM);
    }

    #[test]
    fn checksum_verified_when_present() {
        let mut buf = DATAGRAM;
        let mut packet = UdpPacket::new_unchecked(&mut buf[..]);
        packet.fill_checksum(SRC, DST);
        assert_ne!(packet.checksum(), 0);
        assert!(UdpRepr::parse(&UdpPacket::new_unchecked(&buf[..]), SRC, DST).is_ok());
        buf[11] ^= 0xff;
        assert_eq!(
            UdpRepr::parse(&UdpPacket::new_unchecked(&buf[..]), SRC, DST),
            Err(Error::BadUdpChecksum)
        );
    }

    #[test]
    fn bad_lengths() {
        let mut buf = DATAGRAM;
        buf[5] = 7;
        assert_eq!(
            UdpRepr::parse(&UdpPacket::new_unchecked(&buf[..]), SRC, DST),
            Err(Error::BadUdpLength)
        );
        buf[5] = 13;
        assert_eq!(
            UdpRepr::parse(&UdpPacket::new_unchecked(&buf[..]), SRC, DST),
            Err(Error::BadUdpLength)
        );
        assert_eq!(
            UdpPacket::new_checked(&buf[..7]).unwrap_err(),
            Error::Truncated
        );
        let repr = UdpRepr {
            src_port: 1,
            dst_port: 2,
            payload_len: 65_528,
        };
        assert_eq!(
            repr.emit(&mut UdpPacket::new_unchecked(&mut buf[..])),
            Err(Error::PayloadTooLong)
        );
    }
}
