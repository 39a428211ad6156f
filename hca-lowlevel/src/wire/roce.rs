//! RoCEv2 frames: `Ethernet | IPv4 | UDP 4791 | IBA packet | ICRC`.
//!
//! This is the unit the software HCA exchanges with a Linux `rdma_rxe`
//! peer over a TAP device, and the unit its in-process fabric can carry
//! too, so that one parser sees every packet.

use super::bytes;
use super::{
    ArpPacket, ArpRepr, Error, EtherType, EthernetAddress, EthernetFrame, EthernetRepr, Gid,
    IbPacketRepr, IpProtocol, Ipv4Address, Ipv4Packet, Ipv4Repr, Result, UdpPacket, UdpRepr,
    icrc::{ICRC_LEN, icrc_ipv4},
};

/// The UDP destination port of RoCEv2.
pub const ROCEV2_UDP_PORT: u16 = 4791;

const ETH_LEN: usize = super::ethernet::HEADER_LEN;
const IP_LEN: usize = super::ipv4::HEADER_LEN;
const UDP_LEN: usize = super::udp::HEADER_LEN;
/// Bytes of framing around the IBA packet: Ethernet, IPv4, UDP and ICRC.
pub const FRAMING_LEN: usize = ETH_LEN + IP_LEN + UDP_LEN + ICRC_LEN;

/// Whether a parse recomputes the ICRC.
#[derive(Copy, Clone, PartialEq, Eq)]
enum IcrcCheck {
    /// Recompute and compare (every frame from outside the process).
    Verify,
    /// The emitter in this process computed it over these unaltered bytes.
    TrustEmitter,
}

/// The meaning of a RoCEv2 frame over IPv4.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RoceV2FrameRepr<'a> {
    /// Source MAC.
    pub src_mac: EthernetAddress,
    /// Destination MAC.
    pub dst_mac: EthernetAddress,
    /// Source IPv4 address (the sender's GID, IPv4-mapped).
    pub src_ip: Ipv4Address,
    /// Destination IPv4 address (the receiver's GID, IPv4-mapped).
    pub dst_ip: Ipv4Address,
    /// DSCP/ECN byte (the address vector's traffic class).
    pub tos: u8,
    /// Time to live (the address vector's hop limit).
    pub ttl: u8,
    /// IPv4 identification.
    pub ident: u16,
    /// IPv4 don't-fragment (rxe sets it).
    pub dont_fragment: bool,
    /// UDP source port (entropy for ECMP; receivers accept any).
    pub udp_src_port: u16,
    /// The IBA packet.
    pub packet: IbPacketRepr<'a>,
}

impl<'a> RoceV2FrameRepr<'a> {
    /// Parse and verify a frame.
    ///
    /// Trailing bytes after the IPv4 total length (Ethernet minimum-size
    /// padding) are ignored. The ICRC is verified before the IBA headers
    /// are interpreted.
    ///
    /// # Errors
    ///
    /// [`Error::UnexpectedEtherType`] unless IPv4; the IPv4 errors of
    /// [`Ipv4Repr::parse`]; [`Error::UnexpectedIpProtocol`] unless UDP; the
    /// UDP errors of [`UdpRepr::parse`], and [`Error::BadUdpLength`] when
    /// the UDP length differs from the IPv4 payload length;
    /// [`Error::NotRoceV2Port`]; [`Error::Truncated`] when the UDP payload
    /// cannot hold an ICRC; [`Error::BadIcrc`]; then the errors of
    /// [`IbPacketRepr::parse`].
    pub fn parse(frame: &'a [u8]) -> Result<RoceV2FrameRepr<'a>> {
        Self::parse_frame(frame, IcrcCheck::Verify)
    }

    /// Parse a frame whose bytes are known to be exactly what
    /// [`Self::emit`] wrote in this process, with nothing in between that
    /// could alter them (an in-process link with no fault injection and no
    /// capture): every check of [`Self::parse`] except the ICRC, which the
    /// emitter computed over these very bytes. The ICRC trailer must still
    /// be there. Never use it on bytes that came from a wire, a file or a
    /// fault injector: those go through [`Self::parse`].
    ///
    /// # Errors
    ///
    /// Those of [`Self::parse`], except [`Error::BadIcrc`].
    pub fn parse_emitted_in_process(frame: &'a [u8]) -> Result<RoceV2FrameRepr<'a>> {
        Self::parse_frame(frame, IcrcCheck::TrustEmitter)
    }

    fn parse_frame(frame: &'a [u8], icrc_check: IcrcCheck) -> Result<RoceV2FrameRepr<'a>> {
        let eth = EthernetFrame::new_checked(frame)?;
        let ethernet = EthernetRepr::parse(&eth)?;
        if ethernet.ethertype != EtherType::IPV4 {
            return Err(Error::UnexpectedEtherType(ethernet.ethertype.0));
        }
        Self::parse_ipv4(ethernet, eth.payload(), icrc_check)
    }

    fn parse_ipv4(
        ethernet: EthernetRepr,
        ip_bytes: &'a [u8],
        icrc_check: IcrcCheck,
    ) -> Result<RoceV2FrameRepr<'a>> {
        let ip_packet = Ipv4Packet::new_checked(ip_bytes)?;
        let ip = Ipv4Repr::parse(&ip_packet)?;
        if ip.protocol != IpProtocol::UDP {
            return Err(Error::UnexpectedIpProtocol(ip.protocol.0));
        }
        let udp_bytes = ip_packet.payload();
        let udp_packet = UdpPacket::new_checked(udp_bytes)?;
        let udp = UdpRepr::parse(&udp_packet, ip.src_addr, ip.dst_addr)?;
        if udp.payload_len + UDP_LEN != ip.payload_len {
            return Err(Error::BadUdpLength);
        }
        if udp.dst_port != ROCEV2_UDP_PORT {
            return Err(Error::NotRoceV2Port(udp.dst_port));
        }
        let body = udp_packet.payload();
        let ib_len = body.len().checked_sub(ICRC_LEN).ok_or(Error::Truncated)?;
        let (ib_bytes, icrc_bytes) = body.split_at_checked(ib_len).ok_or(Error::Truncated)?;
        if icrc_check == IcrcCheck::Verify {
            let expected = icrc_ipv4(
                &bytes::read_array(ip_bytes, 0..IP_LEN),
                &bytes::read_array(udp_bytes, 0..UDP_LEN),
                ib_bytes,
            );
            if icrc_bytes != expected.to_le_bytes() {
                return Err(Error::BadIcrc);
            }
        }
        Ok(RoceV2FrameRepr {
            src_mac: ethernet.src_addr,
            dst_mac: ethernet.dst_addr,
            src_ip: ip.src_addr,
            dst_ip: ip.dst_addr,
            tos: ip.tos,
            ttl: ip.ttl,
            ident: ip.ident,
            dont_fragment: ip.dont_fragment,
            udp_src_port: udp.src_port,
            packet: IbPacketRepr::parse(ib_bytes)?,
        })
    }

    /// The sender's GID (IPv4-mapped source address).
    pub const fn src_gid(&self) -> Gid {
        Gid::from_ipv4(self.src_ip)
    }

    /// The receiver's GID (IPv4-mapped destination address).
    pub const fn dst_gid(&self) -> Gid {
        Gid::from_ipv4(self.dst_ip)
    }

    /// Length of the emitted frame (without Ethernet minimum-size padding).
    pub const fn buffer_len(&self) -> usize {
        FRAMING_LEN + self.packet.buffer_len()
    }

    /// Write the frame into the start of `buf`, with the IPv4 checksum,
    /// UDP checksum 0 and the ICRC; returns its length.
    ///
    /// # Errors
    ///
    /// Those of [`IbPacketRepr::check`]; [`Error::BufferTooShort`] when
    /// `buf` is shorter than [`Self::buffer_len`]; [`Error::PayloadTooLong`]
    /// when the packet does not fit an IPv4 datagram.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize> {
        self.packet.check()?;
        let ib_len = self.packet.buffer_len();
        let total = self.buffer_len();
        let ip_payload_len = UDP_LEN + ib_len + ICRC_LEN;
        let ip = Ipv4Repr {
            src_addr: self.src_ip,
            dst_addr: self.dst_ip,
            protocol: IpProtocol::UDP,
            payload_len: ip_payload_len,
            tos: self.tos,
            ttl: self.ttl,
            ident: self.ident,
            dont_fragment: self.dont_fragment,
        };
        let udp = UdpRepr {
            src_port: self.udp_src_port,
            dst_port: ROCEV2_UDP_PORT,
            payload_len: ib_len + ICRC_LEN,
        };
        if IP_LEN + ip_payload_len > usize::from(u16::MAX) {
            return Err(Error::PayloadTooLong);
        }
        let out = buf.get_mut(..total).ok_or(Error::BufferTooShort)?;

        let ethernet = EthernetRepr {
            src_addr: self.src_mac,
            dst_addr: self.dst_mac,
            ethertype: EtherType::IPV4,
        };
        ethernet.emit(&mut EthernetFrame::new_unchecked(&mut *out));
        let ip_bytes = bytes::slice_mut(out, ETH_LEN..total);
        ip.emit(&mut Ipv4Packet::new_unchecked(&mut *ip_bytes))?;
        let udp_bytes = bytes::slice_mut(ip_bytes, IP_LEN..IP_LEN + ip_payload_len);
        udp.emit(&mut UdpPacket::new_unchecked(&mut *udp_bytes))?;
        let ib_start = UDP_LEN;
        let ib_end = ib_start + ib_len;
        // Checked above.
        self.packet
            .emit_checked(bytes::slice_mut(udp_bytes, ib_start..ib_end))?;

        let icrc = icrc_ipv4(
            &bytes::read_array(out, ETH_LEN..ETH_LEN + IP_LEN),
            &bytes::read_array(out, ETH_LEN + IP_LEN..ETH_LEN + IP_LEN + UDP_LEN),
            bytes::slice(out, ETH_LEN + IP_LEN + UDP_LEN..total - ICRC_LEN),
        );
        bytes::write_bytes(out, total - ICRC_LEN..total, &icrc.to_le_bytes());
        Ok(total)
    }
}

/// A frame a RoCEv2 port receives: an ARP packet it may have to answer,
/// or a RoCEv2 packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IncomingFrame<'a> {
    /// An Ethernet/IPv4 ARP packet.
    Arp {
        /// The Ethernet header (a reply goes back to its source).
        ethernet: EthernetRepr,
        /// The ARP packet.
        arp: ArpRepr,
    },
    /// A verified RoCEv2 packet.
    RoceV2(RoceV2FrameRepr<'a>),
}

impl<'a> IncomingFrame<'a> {
    /// Classify and parse a received Ethernet frame.
    ///
    /// # Errors
    ///
    /// [`Error::UnexpectedEtherType`] for anything but ARP and IPv4; then
    /// the errors of [`ArpRepr::parse`] or [`RoceV2FrameRepr::parse`].
    pub fn parse(frame: &'a [u8]) -> Result<IncomingFrame<'a>> {
        let eth = EthernetFrame::new_checked(frame)?;
        let ethernet = EthernetRepr::parse(&eth)?;
        match ethernet.ethertype {
            EtherType::ARP => Ok(IncomingFrame::Arp {
                ethernet,
                arp: ArpRepr::parse(&ArpPacket::new_checked(eth.payload())?)?,
            }),
            EtherType::IPV4 => Ok(IncomingFrame::RoceV2(RoceV2FrameRepr::parse_ipv4(
                ethernet,
                eth.payload(),
                IcrcCheck::Verify,
            )?)),
            other => Err(Error::UnexpectedEtherType(other.0)),
        }
    }
}

/// Write an ARP packet in an Ethernet frame into the start of `buf`;
/// returns its length (42 bytes, without minimum-size padding).
///
/// # Errors
///
/// [`Error::BufferTooShort`].
pub fn emit_arp_frame(
    src_mac: EthernetAddress,
    dst_mac: EthernetAddress,
    arp: &ArpRepr,
    buf: &mut [u8],
) -> Result<usize> {
    let total = ETH_LEN + arp.buffer_len();
    let out = buf.get_mut(..total).ok_or(Error::BufferTooShort)?;
    let mut frame = EthernetFrame::new_unchecked(&mut *out);
    EthernetRepr {
        src_addr: src_mac,
        dst_addr: dst_mac,
        ethertype: EtherType::ARP,
    }
    .emit(&mut frame);
    arp.emit(&mut ArpPacket::new_unchecked(frame.payload_mut()));
    Ok(total)
}
