//! Base Transport Header (12 bytes), present in every IBA packet.
//!
//! ```text
//!  byte 0    opcode
//!  byte 1    SE(0x80) | MigReq(0x40) | PadCnt(0x30) | TVer(0x0f, must be 0)
//!  bytes 2-3 P_Key
//!  byte 4    FECN(0x80) | BECN(0x40) | reserved(6)
//!  bytes 5-7 DestQP (24 bits)
//!  byte 8    AckReq(0x80) | reserved(7)
//!  bytes 9-11 PSN (24 bits)
//! ```

use super::bytes::{self, Field};
use super::{Error, Opcode, Psn, Qpn, Result};

mod field {
    use super::Field;
    pub const OPCODE: usize = 0;
    pub const FLAGS: usize = 1;
    pub const PKEY: Field = 2..4;
    pub const FECN_BECN: usize = 4;
    pub const DEST_QP: Field = 5..8;
    pub const ACK_REQ: usize = 8;
    pub const PSN: Field = 9..12;
}

/// The BTH length.
pub const HEADER_LEN: usize = field::PSN.end;
static_assertions::const_assert_eq!(HEADER_LEN, 12);

const SE: u8 = 0x80;
const MIG_REQ: u8 = 0x40;
const PAD_MASK: u8 = 0x30;
const PAD_SHIFT: u32 = 4;
const TVER_MASK: u8 = 0x0f;
const FECN: u8 = 0x80;
const BECN: u8 = 0x40;
const ACK_REQ: u8 = 0x80;

fixed_view! {
    /// A view of a Base Transport Header at the start of a buffer.
    Bth, HEADER_LEN
}

impl<T: AsRef<[u8]>> Bth<T> {
    /// The raw opcode byte.
    pub fn opcode_raw(&self) -> u8 {
        bytes::read_u8(self.buffer.as_ref(), field::OPCODE)
    }

    /// The opcode.
    ///
    /// # Errors
    ///
    /// [`Error::UnknownOpcode`] when the byte is not an IBA opcode.
    pub fn opcode(&self) -> Result<Opcode> {
        Opcode::from_u8(self.opcode_raw())
    }

    /// Solicited Event.
    pub fn solicited(&self) -> bool {
        self.flags() & SE != 0
    }

    /// Migration request.
    pub fn mig_req(&self) -> bool {
        self.flags() & MIG_REQ != 0
    }

    /// Pad count (0..=3): bytes after the payload that align it to 4.
    pub fn pad_count(&self) -> u8 {
        (self.flags() & PAD_MASK) >> PAD_SHIFT
    }

    /// Transport header version (must be 0).
    pub fn tver(&self) -> u8 {
        self.flags() & TVER_MASK
    }

    /// Partition key.
    pub fn pkey(&self) -> u16 {
        bytes::read_be16(self.buffer.as_ref(), field::PKEY)
    }

    /// Forward explicit congestion notification.
    pub fn fecn(&self) -> bool {
        bytes::read_u8(self.buffer.as_ref(), field::FECN_BECN) & FECN != 0
    }

    /// Backward explicit congestion notification.
    pub fn becn(&self) -> bool {
        bytes::read_u8(self.buffer.as_ref(), field::FECN_BECN) & BECN != 0
    }

    /// Destination queue pair.
    pub fn dest_qp(&self) -> Qpn {
        Qpn::from_low_bits(bytes::read_be24(self.buffer.as_ref(), field::DEST_QP))
    }

    /// Acknowledge request.
    pub fn ack_req(&self) -> bool {
        bytes::read_u8(self.buffer.as_ref(), field::ACK_REQ) & ACK_REQ != 0
    }

    /// Packet sequence number.
    pub fn psn(&self) -> Psn {
        Psn::from_low_bits(bytes::read_be24(self.buffer.as_ref(), field::PSN))
    }

    fn flags(&self) -> u8 {
        bytes::read_u8(self.buffer.as_ref(), field::FLAGS)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Bth<T> {
    /// Set the opcode.
    pub fn set_opcode(&mut self, opcode: Opcode) {
        bytes::write_u8(self.buffer.as_mut(), field::OPCODE, opcode.to_u8());
    }

    /// Set Solicited Event.
    pub fn set_solicited(&mut self, value: bool) {
        self.set_flag_bits(SE, if value { SE } else { 0 });
    }

    /// Set the migration request bit.
    pub fn set_mig_req(&mut self, value: bool) {
        self.set_flag_bits(MIG_REQ, if value { MIG_REQ } else { 0 });
    }

    /// Set the pad count; only the low two bits of `pad` are stored.
    pub fn set_pad_count(&mut self, pad: u8) {
        self.set_flag_bits(PAD_MASK, pad << PAD_SHIFT);
    }

    /// Set the transport header version; only the low four bits are stored.
    pub fn set_tver(&mut self, tver: u8) {
        self.set_flag_bits(TVER_MASK, tver);
    }

    /// Set the partition key.
    pub fn set_pkey(&mut self, pkey: u16) {
        bytes::write_be16(self.buffer.as_mut(), field::PKEY, pkey);
    }

    /// Set FECN and BECN; the six reserved bits of the byte are cleared.
    pub fn set_fecn_becn(&mut self, fecn: bool, becn: bool) {
        let value = if fecn { FECN } else { 0 } | if becn { BECN } else { 0 };
        bytes::write_u8(self.buffer.as_mut(), field::FECN_BECN, value);
    }

    /// Set the destination QP.
    pub fn set_dest_qp(&mut self, qpn: Qpn) {
        bytes::write_be24(self.buffer.as_mut(), field::DEST_QP, qpn.get());
    }

    /// Set AckReq; the seven reserved bits of the byte are cleared.
    pub fn set_ack_req(&mut self, value: bool) {
        let byte = if value { ACK_REQ } else { 0 };
        bytes::write_u8(self.buffer.as_mut(), field::ACK_REQ, byte);
    }

    /// Set the PSN.
    pub fn set_psn(&mut self, psn: Psn) {
        bytes::write_be24(self.buffer.as_mut(), field::PSN, psn.get());
    }

    fn set_flag_bits(&mut self, mask: u8, value: u8) {
        bytes::write_bits_u8(self.buffer.as_mut(), field::FLAGS, mask, value);
    }
}

/// The meaning of a BTH.
///
/// The pad count is not here: it encodes the payload length, so
/// [`IbPacketRepr`](super::IbPacketRepr) derives it. TVer is always 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BthRepr {
    /// Opcode.
    pub opcode: Opcode,
    /// Solicited Event: ask the responder to raise a solicited completion event.
    pub solicited: bool,
    /// Migration request (APM); 0 unless migrating.
    pub mig_req: bool,
    /// Partition key (0xFFFF: default, full membership).
    pub pkey: u16,
    /// Forward explicit congestion notification.
    pub fecn: bool,
    /// Backward explicit congestion notification.
    pub becn: bool,
    /// Destination queue pair.
    pub dest_qp: Qpn,
    /// Ask the responder for an acknowledgement.
    pub ack_req: bool,
    /// Packet sequence number.
    pub psn: Psn,
}

impl BthRepr {
    /// Parse a BTH; reserved bits are ignored, as the IBA asks of receivers.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`], [`Error::UnknownOpcode`],
    /// [`Error::BadTransportVersion`].
    pub fn parse<T: AsRef<[u8]> + ?Sized>(bth: &Bth<&T>) -> Result<BthRepr> {
        bth.check_len()?;
        let opcode = bth.opcode()?;
        let tver = bth.tver();
        if tver != 0 {
            return Err(Error::BadTransportVersion(tver));
        }
        Ok(BthRepr {
            opcode,
            solicited: bth.solicited(),
            mig_req: bth.mig_req(),
            pkey: bth.pkey(),
            fecn: bth.fecn(),
            becn: bth.becn(),
            dest_qp: bth.dest_qp(),
            ack_req: bth.ack_req(),
            psn: bth.psn(),
        })
    }

    /// The length of the emitted header.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Write the header with pad count 0 and all reserved bits clear.
    ///
    /// The view must have been sized with [`Self::buffer_len`].
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, bth: &mut Bth<T>) {
        bth.set_opcode(self.opcode);
        bytes::write_u8(bth.buffer.as_mut(), field::FLAGS, 0);
        bth.set_solicited(self.solicited);
        bth.set_mig_req(self.mig_req);
        bth.set_pkey(self.pkey);
        bth.set_fecn_becn(self.fecn, self.becn);
        bth.set_dest_qp(self.dest_qp);
        bth.set_ack_req(self.ack_req);
        bth.set_psn(self.psn);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The BTH of the SEND_ONLY golden frame (wire-formats.md §4).
    const GOLDEN: [u8; 12] = [
        0x04, 0x10, 0xff, 0xff, 0x00, 0x00, 0x00, 0x11, 0x80, 0x00, 0x01, 0x00,
    ];

    #[test]
    fn deconstruct() {
        let bth = Bth::new_checked(&GOLDEN[..]).unwrap();
        assert_eq!(bth.opcode_raw(), 0x04);
        assert!(!bth.solicited() && !bth.mig_req());
        assert_eq!(bth.pad_count(), 1);
        assert_eq!(bth.tver(), 0);
        assert_eq!(bth.pkey(), 0xffff);
        assert!(!bth.fecn() && !bth.becn());
        assert_eq!(bth.dest_qp().get(), 0x11);
        assert!(bth.ack_req());
        assert_eq!(bth.psn().get(), 256);
    }

    #[test]
    fn construct() {
        let repr = BthRepr::parse(&Bth::new_unchecked(&GOLDEN[..])).unwrap();
        let mut buf = [0xa5u8; 12];
        let mut bth = Bth::new_unchecked(&mut buf[..]);
        repr.emit(&mut bth);
        bth.set_pad_count(1);
        assert_eq!(buf, GOLDEN);
    }

    #[test]
    fn all_bits() {
        let mut buf = [0u8; 12];
        let mut bth = Bth::new_unchecked(&mut buf[..]);
        bth.set_solicited(true);
        bth.set_mig_req(true);
        bth.set_pad_count(3);
        bth.set_fecn_becn(true, true);
        bth.set_dest_qp(Qpn::MAX);
        bth.set_ack_req(true);
        bth.set_psn(Psn::MAX);
        assert_eq!(
            buf,
            [
                0x00, 0xf0, 0, 0, 0xc0, 0xff, 0xff, 0xff, 0x80, 0xff, 0xff, 0xff
            ]
        );
    }

    #[test]
    fn reject_truncated_version_and_opcode() {
        assert_eq!(
            Bth::new_checked(&GOLDEN[..11]).unwrap_err(),
            Error::Truncated
        );
        let mut bad = GOLDEN;
        bad[1] = 0x11;
        assert_eq!(
            BthRepr::parse(&Bth::new_unchecked(&bad[..])),
            Err(Error::BadTransportVersion(1))
        );
        bad = GOLDEN;
        bad[0] = 0x81;
        assert_eq!(
            BthRepr::parse(&Bth::new_unchecked(&bad[..])),
            Err(Error::UnknownOpcode(0x81))
        );
    }

    #[test]
    fn reserved_bits_ignored() {
        let mut noisy = GOLDEN;
        noisy[4] |= 0x3f;
        noisy[8] |= 0x7f;
        let a = BthRepr::parse(&Bth::new_unchecked(&GOLDEN[..])).unwrap();
        let b = BthRepr::parse(&Bth::new_unchecked(&noisy[..])).unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn unchecked_short_view_never_panics() {
        let mut short = [0u8; 3];
        let mut bth = Bth::new_unchecked(&mut short[..]);
        bth.set_psn(Psn::MAX);
        bth.set_dest_qp(Qpn::MAX);
        assert_eq!(bth.psn().get(), 0);
        assert!(BthRepr::parse(&Bth::new_unchecked(&short[..])).is_err());
    }
}
