//! IBA transport headers and the RoCEv2 frame they travel in.
//!
//! Everything the software HCA puts on, or takes off, the wire goes through
//! this module: the Base Transport Header and its extension headers, the
//! opcode table that says which headers and whether a payload follow, a
//! whole-packet parser/emitter ([`IbPacketRepr`]), 24-bit PSN arithmetic
//! ([`Psn`]), and the Ethernet II / IPv4 / UDP / ARP / ICRC layers of RoCEv2
//! ([`RoceV2FrameRepr`]).
//!
//! # Shape (smoltcp's wire views)
//!
//! Each header `Foo` has two faces:
//!
//! * a view `Foo<T: AsRef<[u8]>>` over a byte buffer, with `new_unchecked`,
//!   `check_len` and `new_checked`, getters on `AsRef<[u8]>` and setters on
//!   `AsMut<[u8]>`. Field ranges live in one private `mod field` per header.
//!   Accessors never panic: once `new_checked` has succeeded every field is
//!   in bounds; on a view made with `new_unchecked` over a short buffer, a
//!   read past the end yields zero and a write past the end is dropped.
//! * a `FooRepr`, the validated meaning of the header, with `parse`, `emit`
//!   and `buffer_len`.
//!
//! # Untrusted input
//!
//! Every byte handed to a parser here may come from a hostile peer. Parsers
//! are total: they never panic, never read out of bounds, never allocate,
//! and every malformed input maps to one specific [`Error`] variant.
//!
//! # IRQL
//!
//! Everything here is pure computation over caller-provided buffers: no
//! allocation, no locks, no blocking, bounded time. Every function may be
//! called at any IRQL, DISPATCH_LEVEL included.

#![forbid(unsafe_code)]

pub mod bytes;

#[macro_use]
mod macros;

mod num;
mod opcode;

mod aeth;
mod atomic_ack_eth;
mod atomic_eth;
mod bth;
mod deth;
mod feth;
mod ieth;
mod immdt;
mod rdeth;
mod reth;

mod packet;

mod arp;
mod ethernet;
mod gid;
mod icrc;
mod ipv4;
mod roce;
mod udp;

pub use num::{Eecn, Msn, Psn, Qpn};
pub use opcode::{HeaderKind, HeaderSet, Opcode, Operation, PacketPosition, Transport};

pub use aeth::{Aeth, AethRepr, AethSyndrome, CreditCount, NakCode, RnrTimer};
pub use atomic_ack_eth::{AtomicAckEth, AtomicAckEthRepr};
pub use atomic_eth::{AtomicEth, AtomicEthRepr};
pub use bth::{Bth, BthRepr};
pub use deth::{Deth, DethRepr, GSI_QKEY};
pub use feth::{Feth, FethRepr, FlushPlacement, FlushSelectivity};
pub use ieth::{Ieth, IethRepr};
pub use immdt::{ImmDt, ImmDtRepr};
pub use rdeth::{Rdeth, RdethRepr};
pub use reth::{Reth, RethRepr};

pub use packet::{IbPacketRepr, pad_for};

pub use arp::{ArpOperation, ArpPacket, ArpRepr};
pub use ethernet::{EtherType, EthernetAddress, EthernetFrame, EthernetRepr};
pub use gid::Gid;
pub use icrc::{ICRC_LEN, icrc_ipv4};
pub use ipv4::{IpProtocol, Ipv4Address, Ipv4Packet, Ipv4Repr};
pub use roce::{FRAMING_LEN, IncomingFrame, ROCEV2_UDP_PORT, RoceV2FrameRepr, emit_arp_frame};
pub use udp::{UdpPacket, UdpRepr};

/// Why a buffer could not be parsed, or a representation could not be emitted.
///
/// One variant per distinct defect, so that a caller (and a fault-injection
/// test) can tell exactly which check refused the input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Error {
    /// The buffer ends before a header (or the data a length field promises).
    Truncated,
    /// An emit target is shorter than the representation's `buffer_len`.
    BufferTooShort,
    /// A payload is too long for the length field that must describe it.
    PayloadTooLong,
    /// The BTH opcode is not one the IBA defines for RC, UC, RD or UD.
    UnknownOpcode(u8),
    /// The BTH transport header version is not 0.
    BadTransportVersion(u8),
    /// The IBA packet length is not a multiple of 4 bytes.
    UnalignedPacketLength,
    /// The BTH pad count is larger than the bytes that follow the headers.
    BadPadCount(u8),
    /// Bytes follow the headers of an opcode that carries no payload.
    UnexpectedPayload,
    /// The payload length is not the one the opcode fixes (ATOMIC WRITE: 8).
    BadPayloadLength,
    /// An emitted packet lacks an extension header its opcode requires.
    MissingHeader(HeaderKind),
    /// An emitted packet has an extension header its opcode does not carry.
    UnexpectedHeader(HeaderKind),
    /// The AETH syndrome uses the reserved type `0b10`.
    ReservedAethSyndrome(u8),
    /// The FETH selectivity level is a reserved value.
    BadFlushSelectivity(u8),
    /// The Ethernet type is not the one this parser handles.
    UnexpectedEtherType(u16),
    /// The IP version nibble is not 4.
    BadIpVersion(u8),
    /// The IPv4 header length (IHL, in 32-bit words) is below 5.
    BadIpv4HeaderLength(u8),
    /// The IPv4 header carries options (IHL above 5); RoCEv2 never sends them.
    Ipv4OptionsUnsupported,
    /// The IPv4 total length is below the header length or beyond the buffer.
    BadIpv4TotalLength,
    /// The IPv4 datagram is a fragment (MF set or a fragment offset).
    Ipv4Fragment,
    /// The IPv4 header checksum does not verify.
    BadIpv4Checksum,
    /// The IPv4 protocol is not the one expected (UDP for RoCEv2).
    UnexpectedIpProtocol(u8),
    /// The UDP length is below 8 or differs from the IPv4 payload length.
    BadUdpLength,
    /// A non-zero UDP checksum does not verify.
    BadUdpChecksum,
    /// The UDP destination port is not 4791 (RoCEv2).
    NotRoceV2Port(u16),
    /// The ARP packet is not Ethernet/IPv4 (hardware or protocol type or length).
    UnsupportedArp,
    /// The ARP operation is neither request (1) nor reply (2).
    BadArpOperation(u16),
    /// The RoCEv2 invariant CRC does not match the packet.
    BadIcrc,
}

impl core::fmt::Display for Error {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match *self {
            Error::Truncated => f.write_str("truncated header or data"),
            Error::BufferTooShort => f.write_str("emit buffer too short"),
            Error::PayloadTooLong => f.write_str("payload too long for its length field"),
            Error::UnknownOpcode(op) => write!(f, "unknown BTH opcode {op:#04x}"),
            Error::BadTransportVersion(v) => write!(f, "BTH TVer {v} (must be 0)"),
            Error::UnalignedPacketLength => f.write_str("IBA packet length not a multiple of 4"),
            Error::BadPadCount(p) => write!(f, "BTH pad count {p} exceeds payload area"),
            Error::UnexpectedPayload => f.write_str("payload on an opcode that carries none"),
            Error::BadPayloadLength => f.write_str("payload length differs from the opcode's"),
            Error::MissingHeader(h) => write!(f, "opcode requires {h:?}"),
            Error::UnexpectedHeader(h) => write!(f, "opcode does not carry {h:?}"),
            Error::ReservedAethSyndrome(s) => write!(f, "reserved AETH syndrome {s:#04x}"),
            Error::BadFlushSelectivity(s) => write!(f, "reserved FETH selectivity level {s}"),
            Error::UnexpectedEtherType(t) => write!(f, "unexpected EtherType {t:#06x}"),
            Error::BadIpVersion(v) => write!(f, "IP version {v} (expected 4)"),
            Error::BadIpv4HeaderLength(l) => write!(f, "IPv4 IHL {l} below 5"),
            Error::Ipv4OptionsUnsupported => f.write_str("IPv4 options not supported"),
            Error::BadIpv4TotalLength => f.write_str("IPv4 total length inconsistent"),
            Error::Ipv4Fragment => f.write_str("IPv4 fragment"),
            Error::BadIpv4Checksum => f.write_str("IPv4 header checksum mismatch"),
            Error::UnexpectedIpProtocol(p) => write!(f, "unexpected IP protocol {p}"),
            Error::BadUdpLength => f.write_str("UDP length inconsistent"),
            Error::BadUdpChecksum => f.write_str("UDP checksum mismatch"),
            Error::NotRoceV2Port(p) => write!(f, "UDP destination port {p} is not RoCEv2"),
            Error::UnsupportedArp => f.write_str("ARP is not Ethernet/IPv4"),
            Error::BadArpOperation(op) => write!(f, "ARP operation {op}"),
            Error::BadIcrc => f.write_str("RoCEv2 ICRC mismatch"),
        }
    }
}

/// Shorthand for results of this module.
pub type Result<T> = core::result::Result<T, Error>;

#[cfg(test)]
mod tests;
