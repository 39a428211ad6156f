//! A whole IBA transport packet: BTH, the extension headers its opcode
//! implies, the payload and its pad.
//!
//! The byte buffer starts at the BTH and ends after the pad bytes; the
//! ICRC (RoCEv2) or LRH/GRH/VCRC (native IB) are not part of it.

use super::bytes;
use super::{
    Aeth, AethRepr, AtomicAckEth, AtomicAckEthRepr, AtomicEth, AtomicEthRepr, Bth, BthRepr, Deth,
    DethRepr, Error, Feth, FethRepr, HeaderKind, HeaderSet, Ieth, IethRepr, ImmDt, ImmDtRepr,
    Rdeth, RdethRepr, Result, Reth, RethRepr,
};

/// The meaning of an IBA transport packet.
///
/// Each extension header is `Some` exactly when the opcode carries it
/// ([`Opcode::headers`](super::Opcode::headers)); [`IbPacketRepr::parse`]
/// guarantees this and [`IbPacketRepr::emit`] checks it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IbPacketRepr<'a> {
    /// Base transport header.
    pub bth: BthRepr,
    /// RDETH (RD only).
    pub rdeth: Option<RdethRepr>,
    /// DETH (UD, and RD requests).
    pub deth: Option<DethRepr>,
    /// FETH (FLUSH).
    pub feth: Option<FethRepr>,
    /// RETH (RDMA WRITE first/only, READ request, FLUSH, ATOMIC WRITE).
    pub reth: Option<RethRepr>,
    /// AtomicETH (COMPARE SWAP, FETCH ADD).
    pub atomic_eth: Option<AtomicEthRepr>,
    /// AETH (ACK, atomic ACK, READ response first/last/only).
    pub aeth: Option<AethRepr>,
    /// AtomicAckETH (atomic ACK).
    pub atomic_ack_eth: Option<AtomicAckEthRepr>,
    /// Immediate data (`*_WITH_IMMEDIATE`).
    pub immdt: Option<ImmDtRepr>,
    /// R_Key to invalidate (`SEND_*_WITH_INVALIDATE`).
    pub ieth: Option<IethRepr>,
    /// Payload, without the pad bytes.
    pub payload: &'a [u8],
}

/// Pad bytes that bring `payload_len` to a multiple of 4.
pub const fn pad_for(payload_len: usize) -> u8 {
    // CAST: the value is below 4.
    (payload_len.wrapping_neg() & 3) as u8
}

impl<'a> IbPacketRepr<'a> {
    /// A packet with the given BTH and payload and no extension headers;
    /// set the ones the opcode needs before emitting.
    pub const fn new(bth: BthRepr, payload: &'a [u8]) -> IbPacketRepr<'a> {
        IbPacketRepr {
            bth,
            rdeth: None,
            deth: None,
            feth: None,
            reth: None,
            atomic_eth: None,
            aeth: None,
            atomic_ack_eth: None,
            immdt: None,
            ieth: None,
            payload,
        }
    }

    /// Parse an IBA packet (BTH through pad, no ICRC).
    ///
    /// # Errors
    ///
    /// * [`Error::Truncated`]: shorter than the BTH and the headers its opcode implies;
    /// * [`Error::UnknownOpcode`], [`Error::BadTransportVersion`]: from the BTH;
    /// * [`Error::UnalignedPacketLength`]: length not a multiple of 4;
    /// * [`Error::BadPadCount`]: pad count beyond the bytes after the headers,
    ///   or non-zero on an opcode without payload;
    /// * [`Error::UnexpectedPayload`]: bytes after the headers of an opcode that has no payload;
    /// * [`Error::BadPayloadLength`]: ATOMIC WRITE payload other than 8 bytes;
    /// * [`Error::ReservedAethSyndrome`], [`Error::BadFlushSelectivity`]: from the headers.
    pub fn parse(packet: &'a [u8]) -> Result<IbPacketRepr<'a>> {
        let bth = BthRepr::parse(&Bth::new_checked(packet)?)?;
        let opcode = bth.opcode;
        let headers = opcode.headers();
        let mut repr = IbPacketRepr::new(bth, &[]);
        // Wire order; each header the opcode implies must be there whole.
        let mut offset = super::bth::HEADER_LEN;
        macro_rules! parse_header {
            ($field:ident, $view:ident, $repr:ident, $kind:ident) => {
                if headers.contains(HeaderKind::$kind.flag()) {
                    let at = bytes::rest(packet, offset..);
                    repr.$field = Some($repr::parse(&$view::new_checked(at)?)?);
                    offset += HeaderKind::$kind.byte_len();
                }
            };
        }
        parse_header!(rdeth, Rdeth, RdethRepr, Rdeth);
        parse_header!(deth, Deth, DethRepr, Deth);
        parse_header!(feth, Feth, FethRepr, Feth);
        parse_header!(reth, Reth, RethRepr, Reth);
        parse_header!(atomic_eth, AtomicEth, AtomicEthRepr, AtomicEth);
        parse_header!(aeth, Aeth, AethRepr, Aeth);
        parse_header!(atomic_ack_eth, AtomicAckEth, AtomicAckEthRepr, AtomicAckEth);
        parse_header!(immdt, ImmDt, ImmDtRepr, ImmDt);
        parse_header!(ieth, Ieth, IethRepr, Ieth);

        if packet.len() % 4 != 0 {
            return Err(Error::UnalignedPacketLength);
        }
        let after_headers = bytes::rest(packet, offset..);
        let pad = Bth::new_unchecked(packet).pad_count();
        if !opcode.has_payload() {
            if !after_headers.is_empty() {
                return Err(Error::UnexpectedPayload);
            }
            if pad != 0 {
                return Err(Error::BadPadCount(pad));
            }
            return Ok(repr);
        }
        let payload_len = after_headers
            .len()
            .checked_sub(usize::from(pad))
            .ok_or(Error::BadPadCount(pad))?;
        // With the packet length a multiple of 4 and pad <= 3, the pad is
        // necessarily the one that aligns the payload: no further check needed.
        repr.payload = after_headers.get(..payload_len).unwrap_or(&[]);
        if let Some(fixed) = opcode.fixed_payload_len() {
            if payload_len != fixed {
                return Err(Error::BadPayloadLength);
            }
        }
        Ok(repr)
    }

    /// The extension headers present in this representation.
    pub fn present_headers(&self) -> HeaderSet {
        // Plain bit arithmetic: this runs for every packet emitted.
        let bit = |present: bool, flag: HeaderSet| if present { flag.bits() } else { 0 };
        HeaderSet::from_bits_retain(
            bit(self.rdeth.is_some(), HeaderSet::RDETH)
                | bit(self.deth.is_some(), HeaderSet::DETH)
                | bit(self.feth.is_some(), HeaderSet::FETH)
                | bit(self.reth.is_some(), HeaderSet::RETH)
                | bit(self.atomic_eth.is_some(), HeaderSet::ATOMIC_ETH)
                | bit(self.aeth.is_some(), HeaderSet::AETH)
                | bit(self.atomic_ack_eth.is_some(), HeaderSet::ATOMIC_ACK_ETH)
                | bit(self.immdt.is_some(), HeaderSet::IMMDT)
                | bit(self.ieth.is_some(), HeaderSet::IETH),
        )
    }

    /// The BTH pad count this packet is emitted with.
    pub const fn pad_count(&self) -> u8 {
        pad_for(self.payload.len())
    }

    /// Length of the BTH and the extension headers.
    pub const fn header_len(&self) -> usize {
        self.bth.opcode.header_len()
    }

    /// Length of the emitted packet: headers, payload and pad.
    pub const fn buffer_len(&self) -> usize {
        self.header_len() + self.payload.len() + self.pad_count() as usize
    }

    /// Check that the representation is one [`Self::parse`] could return.
    ///
    /// # Errors
    ///
    /// [`Error::MissingHeader`] / [`Error::UnexpectedHeader`] when the
    /// extension headers differ from the opcode's; [`Error::UnexpectedPayload`]
    /// for a payload on an opcode without one; [`Error::BadPayloadLength`]
    /// for an ATOMIC WRITE payload other than 8 bytes.
    pub fn check(&self) -> Result<()> {
        self.check_payload_len(self.payload.len())
    }

    /// [`Self::check`] of this packet with a payload of `payload_len` bytes
    /// in place of [`Self::payload`] (a sender whose payload goes by
    /// reference checks its headers without copying the representation to
    /// put a stand-in payload in it).
    ///
    /// # Errors
    ///
    /// Those of [`Self::check`].
    pub fn check_payload_len(&self, payload_len: usize) -> Result<()> {
        let opcode = self.bth.opcode;
        let wanted = opcode.headers();
        let present = self.present_headers();
        if present != wanted {
            if let Some(err) = header_mismatch(wanted, present) {
                return Err(err);
            }
        }
        if !opcode.has_payload() && payload_len != 0 {
            return Err(Error::UnexpectedPayload);
        }
        if let Some(fixed) = opcode.fixed_payload_len() {
            if payload_len != fixed {
                return Err(Error::BadPayloadLength);
            }
        }
        Ok(())
    }

    /// Write the packet into the start of `buf`; returns its length.
    ///
    /// Reserved bits and pad bytes are written as zero.
    ///
    /// # Errors
    ///
    /// Those of [`Self::check`], and [`Error::BufferTooShort`] when `buf`
    /// is shorter than [`Self::buffer_len`].
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize> {
        self.check()?;
        self.emit_checked(buf)
    }

    /// [`Self::emit`] of a representation [`Self::check`] accepted (a
    /// frame's emitter checks first, and needs not check twice).
    ///
    /// # Errors
    ///
    /// [`Error::BufferTooShort`] when `buf` is shorter than
    /// [`Self::buffer_len`].
    pub(super) fn emit_checked(&self, buf: &mut [u8]) -> Result<usize> {
        let len = self.buffer_len();
        let out = buf.get_mut(..len).ok_or(Error::BufferTooShort)?;

        let mut bth = Bth::new_unchecked(&mut *out);
        self.bth.emit(&mut bth);
        bth.set_pad_count(self.pad_count());

        // The checked headers are exactly the opcode's, so `len` has room
        // for each; the slices are total all the same. Wire order.
        let mut offset = super::bth::HEADER_LEN;
        macro_rules! emit_header {
            ($field:ident, $view:ident, $kind:ident) => {
                if let Some(h) = &self.$field {
                    let end = offset + HeaderKind::$kind.byte_len();
                    h.emit(&mut $view::new_unchecked(bytes::slice_mut(
                        out,
                        offset..end,
                    )));
                    offset = end;
                }
            };
        }
        emit_header!(rdeth, Rdeth, Rdeth);
        emit_header!(deth, Deth, Deth);
        emit_header!(feth, Feth, Feth);
        emit_header!(reth, Reth, Reth);
        emit_header!(atomic_eth, AtomicEth, AtomicEth);
        emit_header!(aeth, Aeth, Aeth);
        emit_header!(atomic_ack_eth, AtomicAckEth, AtomicAckEth);
        emit_header!(immdt, ImmDt, ImmDt);
        emit_header!(ieth, Ieth, Ieth);

        let payload_end = offset + self.payload.len();
        bytes::write_bytes(out, offset..payload_end, self.payload);
        for pad in bytes::slice_mut(out, payload_end..len) {
            *pad = 0;
        }
        Ok(len)
    }
}

/// The error of [`IbPacketRepr::check`] for headers that differ from the
/// opcode's: about the first header, in wire order, that is missing or
/// unexpected (`None` if the sets agree on every kind). Out of line: the
/// common path only compares the sets.
#[cold]
fn header_mismatch(wanted: HeaderSet, present: HeaderSet) -> Option<Error> {
    HeaderKind::WIRE_ORDER.into_iter().find_map(|kind| {
        let flag = kind.flag();
        match (wanted.contains(flag), present.contains(flag)) {
            (true, false) => Some(Error::MissingHeader(kind)),
            (false, true) => Some(Error::UnexpectedHeader(kind)),
            _ => None,
        }
    })
}
