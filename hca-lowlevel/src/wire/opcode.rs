//! The BTH opcode: transport base plus operation, and what each implies.
//!
//! The opcode decides which extension headers follow the BTH, in which
//! order, and whether a payload may follow them (IBA tables 35/36, as in
//! rxe's `rxe_opcode` table). [`Opcode`] can only hold the combinations the
//! IBA defines for RC, UC, RD and UD, so an unknown opcode is refused at
//! parse time and never reaches the transport engine.

use bitflags::bitflags;
use core::fmt;

use super::{Error, Result};

/// The transport service, the top three bits of the opcode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Transport {
    /// Reliable Connected (`0x00`).
    Rc = 0x00,
    /// Unreliable Connected (`0x20`).
    Uc = 0x20,
    /// Reliable Datagram (`0x40`).
    Rd = 0x40,
    /// Unreliable Datagram (`0x60`).
    Ud = 0x60,
}

/// The operation, the low five bits of the opcode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Operation {
    /// First packet of a multi-packet SEND.
    SendFirst = 0x00,
    /// Middle packet of a SEND.
    SendMiddle = 0x01,
    /// Last packet of a SEND.
    SendLast = 0x02,
    /// Last packet of a SEND, with immediate data.
    SendLastWithImmediate = 0x03,
    /// A SEND in one packet.
    SendOnly = 0x04,
    /// A SEND in one packet, with immediate data.
    SendOnlyWithImmediate = 0x05,
    /// First packet of an RDMA WRITE (carries the RETH).
    RdmaWriteFirst = 0x06,
    /// Middle packet of an RDMA WRITE.
    RdmaWriteMiddle = 0x07,
    /// Last packet of an RDMA WRITE.
    RdmaWriteLast = 0x08,
    /// Last packet of an RDMA WRITE, with immediate data.
    RdmaWriteLastWithImmediate = 0x09,
    /// An RDMA WRITE in one packet.
    RdmaWriteOnly = 0x0a,
    /// An RDMA WRITE in one packet, with immediate data.
    RdmaWriteOnlyWithImmediate = 0x0b,
    /// An RDMA READ request.
    RdmaReadRequest = 0x0c,
    /// First packet of an RDMA READ response.
    RdmaReadResponseFirst = 0x0d,
    /// Middle packet of an RDMA READ response.
    RdmaReadResponseMiddle = 0x0e,
    /// Last packet of an RDMA READ response.
    RdmaReadResponseLast = 0x0f,
    /// An RDMA READ response in one packet.
    RdmaReadResponseOnly = 0x10,
    /// ACK, RNR NAK or NAK (the AETH says which).
    Acknowledge = 0x11,
    /// The response to an atomic operation.
    AtomicAcknowledge = 0x12,
    /// Atomic compare and swap.
    CompareSwap = 0x13,
    /// Atomic fetch and add.
    FetchAdd = 0x14,
    /// Last packet of a SEND that invalidates an R_Key.
    SendLastWithInvalidate = 0x16,
    /// A SEND in one packet that invalidates an R_Key.
    SendOnlyWithInvalidate = 0x17,
    /// FLUSH (IBA 1.5): make written data visible or persistent.
    Flush = 0x1c,
    /// ATOMIC WRITE (IBA 1.5): an 8-byte write performed atomically.
    AtomicWrite = 0x1d,
}

impl Operation {
    /// Every operation, in opcode order.
    pub const ALL: [Operation; 25] = [
        Operation::SendFirst,
        Operation::SendMiddle,
        Operation::SendLast,
        Operation::SendLastWithImmediate,
        Operation::SendOnly,
        Operation::SendOnlyWithImmediate,
        Operation::RdmaWriteFirst,
        Operation::RdmaWriteMiddle,
        Operation::RdmaWriteLast,
        Operation::RdmaWriteLastWithImmediate,
        Operation::RdmaWriteOnly,
        Operation::RdmaWriteOnlyWithImmediate,
        Operation::RdmaReadRequest,
        Operation::RdmaReadResponseFirst,
        Operation::RdmaReadResponseMiddle,
        Operation::RdmaReadResponseLast,
        Operation::RdmaReadResponseOnly,
        Operation::Acknowledge,
        Operation::AtomicAcknowledge,
        Operation::CompareSwap,
        Operation::FetchAdd,
        Operation::SendLastWithInvalidate,
        Operation::SendOnlyWithInvalidate,
        Operation::Flush,
        Operation::AtomicWrite,
    ];

    const fn from_bits(bits: u8) -> Option<Operation> {
        Some(match bits {
            0x00 => Operation::SendFirst,
            0x01 => Operation::SendMiddle,
            0x02 => Operation::SendLast,
            0x03 => Operation::SendLastWithImmediate,
            0x04 => Operation::SendOnly,
            0x05 => Operation::SendOnlyWithImmediate,
            0x06 => Operation::RdmaWriteFirst,
            0x07 => Operation::RdmaWriteMiddle,
            0x08 => Operation::RdmaWriteLast,
            0x09 => Operation::RdmaWriteLastWithImmediate,
            0x0a => Operation::RdmaWriteOnly,
            0x0b => Operation::RdmaWriteOnlyWithImmediate,
            0x0c => Operation::RdmaReadRequest,
            0x0d => Operation::RdmaReadResponseFirst,
            0x0e => Operation::RdmaReadResponseMiddle,
            0x0f => Operation::RdmaReadResponseLast,
            0x10 => Operation::RdmaReadResponseOnly,
            0x11 => Operation::Acknowledge,
            0x12 => Operation::AtomicAcknowledge,
            0x13 => Operation::CompareSwap,
            0x14 => Operation::FetchAdd,
            0x16 => Operation::SendLastWithInvalidate,
            0x17 => Operation::SendOnlyWithInvalidate,
            0x1c => Operation::Flush,
            0x1d => Operation::AtomicWrite,
            _ => return None,
        })
    }
}

/// Where a packet sits in its message.
///
/// Single-packet operations (READ request, atomics, ACKs, FLUSH, ATOMIC
/// WRITE) are `Only`: they both start and end their message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PacketPosition {
    /// First packet of a multi-packet message.
    First,
    /// A middle packet.
    Middle,
    /// Last packet of a multi-packet message.
    Last,
    /// The whole message in one packet.
    Only,
}

/// One extension transport header, in wire order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HeaderKind {
    /// Reliable Datagram ETH (4 bytes).
    Rdeth,
    /// Datagram ETH (8 bytes).
    Deth,
    /// FLUSH ETH (4 bytes).
    Feth,
    /// RDMA ETH (16 bytes).
    Reth,
    /// Atomic ETH (28 bytes).
    AtomicEth,
    /// ACK ETH (4 bytes).
    Aeth,
    /// Atomic ACK ETH (8 bytes).
    AtomicAckEth,
    /// Immediate data (4 bytes).
    ImmDt,
    /// Invalidate ETH (4 bytes).
    Ieth,
}

impl HeaderKind {
    /// All kinds in the order they appear after the BTH.
    pub const WIRE_ORDER: [HeaderKind; 9] = [
        HeaderKind::Rdeth,
        HeaderKind::Deth,
        HeaderKind::Feth,
        HeaderKind::Reth,
        HeaderKind::AtomicEth,
        HeaderKind::Aeth,
        HeaderKind::AtomicAckEth,
        HeaderKind::ImmDt,
        HeaderKind::Ieth,
    ];

    /// The header's length in bytes.
    pub const fn byte_len(self) -> usize {
        match self {
            HeaderKind::Rdeth => super::rdeth::HEADER_LEN,
            HeaderKind::Deth => super::deth::HEADER_LEN,
            HeaderKind::Feth => super::feth::HEADER_LEN,
            HeaderKind::Reth => super::reth::HEADER_LEN,
            HeaderKind::AtomicEth => super::atomic_eth::HEADER_LEN,
            HeaderKind::Aeth => super::aeth::HEADER_LEN,
            HeaderKind::AtomicAckEth => super::atomic_ack_eth::HEADER_LEN,
            HeaderKind::ImmDt => super::immdt::HEADER_LEN,
            HeaderKind::Ieth => super::ieth::HEADER_LEN,
        }
    }

    /// The flag for this kind in a [`HeaderSet`].
    pub const fn flag(self) -> HeaderSet {
        match self {
            HeaderKind::Rdeth => HeaderSet::RDETH,
            HeaderKind::Deth => HeaderSet::DETH,
            HeaderKind::Feth => HeaderSet::FETH,
            HeaderKind::Reth => HeaderSet::RETH,
            HeaderKind::AtomicEth => HeaderSet::ATOMIC_ETH,
            HeaderKind::Aeth => HeaderSet::AETH,
            HeaderKind::AtomicAckEth => HeaderSet::ATOMIC_ACK_ETH,
            HeaderKind::ImmDt => HeaderSet::IMMDT,
            HeaderKind::Ieth => HeaderSet::IETH,
        }
    }
}

bitflags! {
    /// The set of extension headers an opcode carries.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct HeaderSet: u16 {
        /// RDETH.
        const RDETH = 1 << 0;
        /// DETH.
        const DETH = 1 << 1;
        /// FETH.
        const FETH = 1 << 2;
        /// RETH.
        const RETH = 1 << 3;
        /// AtomicETH.
        const ATOMIC_ETH = 1 << 4;
        /// AETH.
        const AETH = 1 << 5;
        /// AtomicAckETH.
        const ATOMIC_ACK_ETH = 1 << 6;
        /// ImmDt.
        const IMMDT = 1 << 7;
        /// IETH.
        const IETH = 1 << 8;
    }
}

impl HeaderSet {
    /// Total length of the headers in the set, BTH excluded.
    pub const fn byte_len(self) -> usize {
        const fn part(set: HeaderSet, kind: HeaderKind) -> usize {
            if set.contains(kind.flag()) {
                kind.byte_len()
            } else {
                0
            }
        }
        part(self, HeaderKind::Rdeth)
            + part(self, HeaderKind::Deth)
            + part(self, HeaderKind::Feth)
            + part(self, HeaderKind::Reth)
            + part(self, HeaderKind::AtomicEth)
            + part(self, HeaderKind::Aeth)
            + part(self, HeaderKind::AtomicAckEth)
            + part(self, HeaderKind::ImmDt)
            + part(self, HeaderKind::Ieth)
    }
}

/// [`Opcode::headers`] by opcode byte (bits of [`HeaderSet`]; 0 for bytes
/// that are no opcode).
#[expect(
    clippy::indexing_slicing,
    reason = "compile time; the loop bounds the index"
)]
const HEADERS_BY_CODE: [u16; 128] = {
    let mut table = [0u16; 128];
    let mut code = 0;
    while code < table.len() {
        // CAST: `code` is below 128.
        if let Ok(op) = Opcode::from_u8(code as u8) {
            table[code] = op.headers_computed().bits();
        }
        code += 1;
    }
    table
};

/// [`Opcode::header_len`] by opcode byte (0 for bytes that are no opcode).
#[expect(
    clippy::indexing_slicing,
    reason = "compile time; the loop bounds the index"
)]
const HEADER_LEN_BY_CODE: [u8; 128] = {
    let mut table = [0u8; 128];
    let mut code = 0;
    while code < table.len() {
        // CAST: `code` is below 128.
        if let Ok(op) = Opcode::from_u8(code as u8) {
            let len = super::bth::HEADER_LEN + op.headers_computed().byte_len();
            // CAST: at most 12 + 4 + 8 + 28 (BTH, RDETH, DETH, AtomicETH) bytes.
            table[code] = len as u8;
        }
        code += 1;
    }
    table
};

/// A BTH opcode that the IBA defines: a transport and an operation valid for it.
///
/// # Invariants
///
/// `operation` is valid for `transport` (see [`Opcode::new`]).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Opcode {
    transport: Transport,
    operation: Operation,
}

impl Opcode {
    /// The opcode for `operation` on `transport`, or `None` when the IBA
    /// defines no such opcode.
    ///
    /// RC has every operation; UC has SEND and RDMA WRITE (with immediate, no
    /// invalidate); RD has RC's set up to FETCH ADD (no invalidate, FLUSH or
    /// ATOMIC WRITE); UD has SEND ONLY with and without immediate.
    pub const fn new(transport: Transport, operation: Operation) -> Option<Opcode> {
        use Operation as O;
        let valid = match transport {
            Transport::Rc => true,
            Transport::Uc => (operation as u8) <= (O::RdmaWriteOnlyWithImmediate as u8),
            Transport::Rd => (operation as u8) <= (O::FetchAdd as u8),
            Transport::Ud => matches!(operation, O::SendOnly | O::SendOnlyWithImmediate),
        };
        if valid {
            Some(Opcode {
                transport,
                operation,
            })
        } else {
            None
        }
    }

    /// Decode a BTH opcode byte.
    ///
    /// # Errors
    ///
    /// [`Error::UnknownOpcode`] for any byte the IBA does not define for RC,
    /// UC, RD or UD (this includes CNP `0x81`, XRC and the manufacturer range).
    pub const fn from_u8(code: u8) -> Result<Opcode> {
        let transport = match code & 0xe0 {
            0x00 => Transport::Rc,
            0x20 => Transport::Uc,
            0x40 => Transport::Rd,
            0x60 => Transport::Ud,
            _ => return Err(Error::UnknownOpcode(code)),
        };
        match Operation::from_bits(code & 0x1f) {
            Some(operation) => match Opcode::new(transport, operation) {
                Some(op) => Ok(op),
                None => Err(Error::UnknownOpcode(code)),
            },
            None => Err(Error::UnknownOpcode(code)),
        }
    }

    /// The opcode byte.
    pub const fn to_u8(self) -> u8 {
        self.transport as u8 | self.operation as u8
    }

    /// The transport service.
    pub const fn transport(self) -> Transport {
        self.transport
    }

    /// The operation.
    pub const fn operation(self) -> Operation {
        self.operation
    }

    /// The extension headers that follow the BTH, as a set; they appear in
    /// [`HeaderKind::WIRE_ORDER`].
    ///
    /// One table load: every packet parsed, checked and emitted asks, and
    /// the two matches it is computed from (at compile time) cost more.
    #[expect(clippy::indexing_slicing, reason = "index masked to the table length")]
    pub const fn headers(self) -> HeaderSet {
        // PANIC: the masked byte is below the table length (128); the opcode
        // byte is below 0x80 anyway (transports 0x00..=0x60, operations
        // below 0x20).
        HeaderSet::from_bits_retain(HEADERS_BY_CODE[(self.to_u8() & 0x7f) as usize])
    }

    /// [`Self::headers`], computed (builds [`HEADERS_BY_CODE`]).
    const fn headers_computed(self) -> HeaderSet {
        use Operation as O;
        let op_headers = match self.operation {
            O::SendFirst
            | O::SendMiddle
            | O::SendLast
            | O::SendOnly
            | O::RdmaWriteMiddle
            | O::RdmaWriteLast
            | O::RdmaReadResponseMiddle => HeaderSet::empty(),
            O::SendLastWithImmediate | O::SendOnlyWithImmediate | O::RdmaWriteLastWithImmediate => {
                HeaderSet::IMMDT
            }
            O::SendLastWithInvalidate | O::SendOnlyWithInvalidate => HeaderSet::IETH,
            O::RdmaWriteFirst | O::RdmaWriteOnly | O::RdmaReadRequest | O::AtomicWrite => {
                HeaderSet::RETH
            }
            O::RdmaWriteOnlyWithImmediate => HeaderSet::RETH.union(HeaderSet::IMMDT),
            O::RdmaReadResponseFirst
            | O::RdmaReadResponseLast
            | O::RdmaReadResponseOnly
            | O::Acknowledge => HeaderSet::AETH,
            O::AtomicAcknowledge => HeaderSet::AETH.union(HeaderSet::ATOMIC_ACK_ETH),
            O::CompareSwap | O::FetchAdd => HeaderSet::ATOMIC_ETH,
            O::Flush => HeaderSet::FETH.union(HeaderSet::RETH),
        };
        let transport_headers = match self.transport {
            Transport::Rc | Transport::Uc => HeaderSet::empty(),
            Transport::Rd if self.is_request() => HeaderSet::RDETH.union(HeaderSet::DETH),
            Transport::Rd => HeaderSet::RDETH,
            Transport::Ud => HeaderSet::DETH,
        };
        op_headers.union(transport_headers)
    }

    /// Length of the BTH plus the extension headers (a table load, like
    /// [`Self::headers`]).
    #[expect(clippy::indexing_slicing, reason = "index masked to the table length")]
    pub const fn header_len(self) -> usize {
        // PANIC: as in `headers`, the masked byte is below 128.
        HEADER_LEN_BY_CODE[(self.to_u8() & 0x7f) as usize] as usize
    }

    /// The packet may carry a payload (it may still be empty).
    pub const fn has_payload(self) -> bool {
        use Operation as O;
        !matches!(
            self.operation,
            O::RdmaReadRequest
                | O::Acknowledge
                | O::AtomicAcknowledge
                | O::CompareSwap
                | O::FetchAdd
                | O::Flush
        )
    }

    /// The payload length the opcode fixes, if it fixes one (ATOMIC WRITE: 8).
    pub const fn fixed_payload_len(self) -> Option<usize> {
        match self.operation {
            Operation::AtomicWrite => Some(8),
            _ => None,
        }
    }

    /// Where the packet sits in its message.
    pub const fn position(self) -> PacketPosition {
        use Operation as O;
        match self.operation {
            O::SendFirst | O::RdmaWriteFirst | O::RdmaReadResponseFirst => PacketPosition::First,
            O::SendMiddle | O::RdmaWriteMiddle | O::RdmaReadResponseMiddle => {
                PacketPosition::Middle
            }
            O::SendLast
            | O::SendLastWithImmediate
            | O::SendLastWithInvalidate
            | O::RdmaWriteLast
            | O::RdmaWriteLastWithImmediate
            | O::RdmaReadResponseLast => PacketPosition::Last,
            O::SendOnly
            | O::SendOnlyWithImmediate
            | O::SendOnlyWithInvalidate
            | O::RdmaWriteOnly
            | O::RdmaWriteOnlyWithImmediate
            | O::RdmaReadRequest
            | O::RdmaReadResponseOnly
            | O::Acknowledge
            | O::AtomicAcknowledge
            | O::CompareSwap
            | O::FetchAdd
            | O::Flush
            | O::AtomicWrite => PacketPosition::Only,
        }
    }

    /// First packet of a multi-packet message.
    pub const fn is_first(self) -> bool {
        matches!(self.position(), PacketPosition::First)
    }

    /// Middle packet of a multi-packet message.
    pub const fn is_middle(self) -> bool {
        matches!(self.position(), PacketPosition::Middle)
    }

    /// Last packet of a multi-packet message.
    pub const fn is_last(self) -> bool {
        matches!(self.position(), PacketPosition::Last)
    }

    /// The whole message in one packet.
    pub const fn is_only(self) -> bool {
        matches!(self.position(), PacketPosition::Only)
    }

    /// Starts a message (first or only).
    pub const fn starts_message(self) -> bool {
        matches!(
            self.position(),
            PacketPosition::First | PacketPosition::Only
        )
    }

    /// Ends a message (last or only).
    pub const fn ends_message(self) -> bool {
        matches!(self.position(), PacketPosition::Last | PacketPosition::Only)
    }

    /// Sent by a requester (everything but responses and acknowledgements).
    pub const fn is_request(self) -> bool {
        !self.is_response()
    }

    /// Sent by a responder: READ responses, ACK/NAK, atomic ACK.
    pub const fn is_response(self) -> bool {
        use Operation as O;
        matches!(
            self.operation,
            O::RdmaReadResponseFirst
                | O::RdmaReadResponseMiddle
                | O::RdmaReadResponseLast
                | O::RdmaReadResponseOnly
                | O::Acknowledge
                | O::AtomicAcknowledge
        )
    }

    /// A SEND packet of any kind.
    pub const fn is_send(self) -> bool {
        use Operation as O;
        matches!(
            self.operation,
            O::SendFirst
                | O::SendMiddle
                | O::SendLast
                | O::SendLastWithImmediate
                | O::SendOnly
                | O::SendOnlyWithImmediate
                | O::SendLastWithInvalidate
                | O::SendOnlyWithInvalidate
        )
    }

    /// An RDMA WRITE packet of any kind (not ATOMIC WRITE).
    pub const fn is_rdma_write(self) -> bool {
        use Operation as O;
        matches!(
            self.operation,
            O::RdmaWriteFirst
                | O::RdmaWriteMiddle
                | O::RdmaWriteLast
                | O::RdmaWriteLastWithImmediate
                | O::RdmaWriteOnly
                | O::RdmaWriteOnlyWithImmediate
        )
    }

    /// An RDMA READ request.
    pub const fn is_read_request(self) -> bool {
        matches!(self.operation, Operation::RdmaReadRequest)
    }

    /// An RDMA READ response packet.
    pub const fn is_read_response(self) -> bool {
        use Operation as O;
        matches!(
            self.operation,
            O::RdmaReadResponseFirst
                | O::RdmaReadResponseMiddle
                | O::RdmaReadResponseLast
                | O::RdmaReadResponseOnly
        )
    }

    /// An ACKNOWLEDGE (ACK, RNR NAK or NAK; see the AETH).
    pub const fn is_acknowledge(self) -> bool {
        matches!(self.operation, Operation::Acknowledge)
    }

    /// An ATOMIC ACKNOWLEDGE.
    pub const fn is_atomic_acknowledge(self) -> bool {
        matches!(self.operation, Operation::AtomicAcknowledge)
    }

    /// COMPARE SWAP or FETCH ADD.
    pub const fn is_atomic(self) -> bool {
        matches!(self.operation, Operation::CompareSwap | Operation::FetchAdd)
    }

    /// Carries immediate data (ImmDt).
    pub const fn has_immediate(self) -> bool {
        self.headers().contains(HeaderSet::IMMDT)
    }

    /// Carries an R_Key to invalidate (IETH).
    pub const fn has_invalidate(self) -> bool {
        self.headers().contains(HeaderSet::IETH)
    }

    /// Carries an AETH (ACK, atomic ACK, READ response first/last/only).
    pub const fn has_aeth(self) -> bool {
        self.headers().contains(HeaderSet::AETH)
    }

    /// Consumes a receive WQE at the responder: the first packet of a SEND,
    /// and the packet of an RDMA WRITE that delivers immediate data (rxe's
    /// `RXE_RWR_MASK`). A responder with no receive posted answers RNR NAK.
    pub const fn consumes_receive_wqe(self) -> bool {
        use Operation as O;
        matches!(
            self.operation,
            O::SendFirst
                | O::SendOnly
                | O::SendOnlyWithImmediate
                | O::SendOnlyWithInvalidate
                | O::RdmaWriteLastWithImmediate
                | O::RdmaWriteOnlyWithImmediate
        )
    }

    /// Completes a receive WQE at the responder: the last packet of a SEND,
    /// or an RDMA WRITE with immediate (rxe's `RXE_COMP_MASK`).
    pub const fn completes_receive(self) -> bool {
        use Operation as O;
        matches!(
            self.operation,
            O::SendLast
                | O::SendLastWithImmediate
                | O::SendLastWithInvalidate
                | O::SendOnly
                | O::SendOnlyWithImmediate
                | O::SendOnlyWithInvalidate
                | O::RdmaWriteLastWithImmediate
                | O::RdmaWriteOnlyWithImmediate
        )
    }

    /// Every opcode the type can hold, in byte order.
    pub fn all() -> impl Iterator<Item = Opcode> {
        [Transport::Rc, Transport::Uc, Transport::Rd, Transport::Ud]
            .into_iter()
            .flat_map(|t| {
                Operation::ALL
                    .into_iter()
                    .filter_map(move |o| Opcode::new(t, o))
            })
    }
}

impl TryFrom<u8> for Opcode {
    type Error = Error;

    fn try_from(code: u8) -> Result<Opcode> {
        Opcode::from_u8(code)
    }
}

impl From<Opcode> for u8 {
    fn from(op: Opcode) -> u8 {
        op.to_u8()
    }
}

impl fmt::Debug for Opcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?}_{:?}({:#04x})",
            self.transport,
            self.operation,
            self.to_u8()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::vec::Vec;

    #[test]
    fn header_tables_match_the_computed_sets() {
        let mut seen = 0;
        for op in Opcode::all() {
            assert_eq!(op.headers(), op.headers_computed(), "{op:?}");
            assert_eq!(
                op.header_len(),
                crate::wire::bth::HEADER_LEN + op.headers_computed().byte_len(),
                "{op:?}"
            );
            seen += 1;
        }
        // RC 25, UC 12, RD 21, UD 2.
        assert_eq!(seen, 60);
        // Bytes that are no opcode have no entry.
        for code in 0u8..=0x7f {
            if Opcode::from_u8(code).is_err() {
                assert_eq!(HEADERS_BY_CODE[usize::from(code)], 0);
                assert_eq!(HEADER_LEN_BY_CODE[usize::from(code)], 0);
            }
        }
    }

    #[test]
    fn byte_round_trip_and_counts() {
        let all: Vec<Opcode> = Opcode::all().collect();
        // RC 25, UC 12, RD 21, UD 2.
        assert_eq!(all.len(), 25 + 12 + 21 + 2);
        for op in &all {
            assert_eq!(Opcode::from_u8(op.to_u8()), Ok(*op));
        }
        let mut accepted = 0;
        for code in 0..=255u8 {
            match Opcode::from_u8(code) {
                Ok(op) => {
                    accepted += 1;
                    assert_eq!(op.to_u8(), code);
                }
                Err(e) => assert_eq!(e, Error::UnknownOpcode(code)),
            }
        }
        assert_eq!(accepted, all.len());
    }

    #[test]
    fn known_values() {
        assert_eq!(
            Opcode::from_u8(0x04).map(|o| (o.transport(), o.operation())),
            Ok((Transport::Rc, Operation::SendOnly))
        );
        assert_eq!(
            Opcode::from_u8(0x64).map(|o| (o.transport(), o.operation())),
            Ok((Transport::Ud, Operation::SendOnly))
        );
        assert_eq!(
            Opcode::from_u8(0x17).map(|o| o.operation()),
            Ok(Operation::SendOnlyWithInvalidate)
        );
        // Reserved operation, UC invalidate, RD flush, UD write, CNP, XRC.
        for code in [0x15, 0x37, 0x5c, 0x6a, 0x81, 0xa4, 0x18, 0x1e, 0xff] {
            assert_eq!(Opcode::from_u8(code), Err(Error::UnknownOpcode(code)));
        }
    }

    #[test]
    fn header_table_matches_rxe() {
        let h = |code: u8| Opcode::from_u8(code).unwrap().headers();
        assert_eq!(h(0x04), HeaderSet::empty());
        assert_eq!(h(0x05), HeaderSet::IMMDT);
        assert_eq!(h(0x0a), HeaderSet::RETH);
        assert_eq!(h(0x0b), HeaderSet::RETH | HeaderSet::IMMDT);
        assert_eq!(h(0x0c), HeaderSet::RETH);
        assert_eq!(h(0x0d), HeaderSet::AETH);
        assert_eq!(h(0x0e), HeaderSet::empty());
        assert_eq!(h(0x11), HeaderSet::AETH);
        assert_eq!(h(0x12), HeaderSet::AETH | HeaderSet::ATOMIC_ACK_ETH);
        assert_eq!(h(0x13), HeaderSet::ATOMIC_ETH);
        assert_eq!(h(0x17), HeaderSet::IETH);
        assert_eq!(h(0x1c), HeaderSet::FETH | HeaderSet::RETH);
        assert_eq!(h(0x1d), HeaderSet::RETH);
        assert_eq!(h(0x64), HeaderSet::DETH);
        assert_eq!(h(0x65), HeaderSet::DETH | HeaderSet::IMMDT);
        assert_eq!(
            h(0x4b),
            HeaderSet::RDETH | HeaderSet::DETH | HeaderSet::RETH | HeaderSet::IMMDT
        );
        assert_eq!(h(0x50), HeaderSet::RDETH | HeaderSet::AETH);
        assert_eq!(h(0x4e), HeaderSet::RDETH);
        assert_eq!(
            h(0x53),
            HeaderSet::RDETH | HeaderSet::DETH | HeaderSet::ATOMIC_ETH
        );
        // Header lengths as rxe's `.length`.
        let len = |code: u8| Opcode::from_u8(code).unwrap().header_len();
        assert_eq!(len(0x04), 12);
        assert_eq!(len(0x0b), 12 + 16 + 4);
        assert_eq!(len(0x12), 12 + 4 + 8);
        assert_eq!(len(0x13), 12 + 28);
        assert_eq!(len(0x1c), 12 + 4 + 16);
        assert_eq!(len(0x64), 12 + 8);
        assert_eq!(len(0x4b), 12 + 4 + 8 + 16 + 4);
    }

    #[test]
    fn predicates() {
        let op = |code: u8| Opcode::from_u8(code).unwrap();
        assert!(op(0x00).is_first() && op(0x00).starts_message() && !op(0x00).ends_message());
        assert!(op(0x01).is_middle());
        assert!(op(0x16).is_last() && op(0x16).has_invalidate() && op(0x16).ends_message());
        assert!(op(0x0c).is_only() && op(0x0c).is_read_request() && !op(0x0c).has_payload());
        assert!(op(0x0f).is_read_response() && op(0x0f).is_response() && op(0x0f).has_aeth());
        assert!(op(0x11).is_acknowledge() && !op(0x11).is_request());
        assert!(op(0x12).is_atomic_acknowledge());
        assert!(op(0x14).is_atomic() && op(0x14).is_request());
        assert!(op(0x09).has_immediate() && op(0x09).consumes_receive_wqe());
        assert!(op(0x09).completes_receive() && op(0x09).is_rdma_write());
        assert!(!op(0x08).consumes_receive_wqe() && !op(0x02).consumes_receive_wqe());
        assert!(op(0x02).completes_receive() && op(0x02).is_send());
        assert_eq!(op(0x1d).fixed_payload_len(), Some(8));
        assert_eq!(op(0x04).fixed_payload_len(), None);
        assert!(!op(0x1c).has_payload());
    }
}
