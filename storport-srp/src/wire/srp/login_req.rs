//! `SRP_LOGIN_REQ`: the 64-byte IU carried in IB CM REQ private data, and
//! the 56-byte RDMA/CM form (`srp_login_req_rdma`) that fits the 92 - 36
//! bytes of private data RDMA/CM leaves after its own header, with the same
//! fields in a different order and only six reserved bytes.
//!
//! Both forms parse to, and emit from, one [`LoginReqRepr`].

use bitflags::bitflags;
use static_assertions::const_assert_eq;

use super::{BufFormats, Error, Opcode, PortId, Result, check_emit_len, expect_opcode};
use crate::wire::bytes;

mod field {
    use crate::wire::Field;

    // IB CM form (srp_login_req), 64 bytes.
    pub const OPCODE: Field = 0..1;
    pub const TAG: Field = 8..16;
    pub const REQ_IT_IU_LEN: Field = 16..20;
    pub const REQ_BUF_FMT: Field = 24..26;
    pub const REQ_FLAGS: Field = 26..27;
    pub const IMM_DATA_OFFSET: Field = 28..30;
    pub const INITIATOR_PORT_ID: Field = 32..48;
    pub const TARGET_PORT_ID: Field = 48..64;

    // RDMA/CM form (srp_login_req_rdma), 56 bytes.
    pub const RDMA_TAG: Field = 0..8;
    pub const RDMA_REQ_BUF_FMT: Field = 8..10;
    pub const RDMA_REQ_FLAGS: Field = 10..11;
    pub const RDMA_OPCODE: Field = 11..12;
    pub const RDMA_REQ_IT_IU_LEN: Field = 12..16;
    pub const RDMA_INITIATOR_PORT_ID: Field = 16..32;
    pub const RDMA_TARGET_PORT_ID: Field = 32..48;
    pub const RDMA_IMM_DATA_OFFSET: Field = 48..50;
    pub const RDMA_RESERVED: Field = 50..56;
}

/// Size of the IB CM form.
pub const LEN: usize = field::TARGET_PORT_ID.end;
/// Size of the RDMA/CM form.
pub const RDMA_LEN: usize = field::RDMA_RESERVED.end;

const_assert_eq!(LEN, 64);
const_assert_eq!(RDMA_LEN, 56);

/// `req_flags` bits 0..=1: what happens to the initiator's other channels
/// to the same target port.
const MTCH_ACTION_MASK: u8 = 0x03;
/// `SRP_IMMED_REQUESTED` (SRP-2).
const IMMED_REQUESTED: u8 = 0x80;

/// The multichannel action of a login request (`req_flags & 0x03`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum MultiChannelAction {
    /// `SRP_MULTICHAN_SINGLE`: terminate every existing channel of this
    /// I_T nexus (Linux `ib_srp` uses it for the first channel).
    Single = 0,
    /// `SRP_MULTICHAN_MULTI`: keep existing channels (further channels).
    Multi = 1,
}

bitflags! {
    /// Which target-initiated IUs the initiator wants sent with the
    /// solicited-event bit (`req_flags` bits 4..=6).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct LoginSolNot: u8 {
        /// `SRP_LOSOLNT`: target logout.
        const LOGOUT = 0x10;
        /// `SRP_CRSOLNT`: credit request.
        const CREDIT = 0x20;
        /// `SRP_AESOLNT`: asynchronous event.
        const ASYNC_EVENT = 0x40;
    }
}

/// The value of an `SRP_LOGIN_REQ`, in either form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LoginReqRepr {
    /// Tag, echoed in the response (Linux `ib_srp` sends 0).
    pub tag: u64,
    /// Largest initiator-to-target IU the initiator will send.
    pub req_it_iu_len: u32,
    /// Descriptor formats the initiator will use.
    pub req_buf_fmt: BufFormats,
    /// What happens to the initiator's other channels.
    pub multichannel: MultiChannelAction,
    /// Solicited-notification requests.
    pub sol_not: LoginSolNot,
    /// `Some(offset)` requests immediate data at that offset of an
    /// `SRP_CMD` (`SRP_IMMED_REQUESTED`); Linux uses 68 = 48 + 16 + 4.
    pub imm_data_offset: Option<u16>,
    /// The initiator port identifier.
    pub initiator_port_id: PortId,
    /// The target port identifier.
    pub target_port_id: PortId,
}

impl LoginReqRepr {
    fn from_flags(
        tag: u64,
        req_it_iu_len: u32,
        req_buf_fmt: BufFormats,
        flags: u8,
        offset: u16,
        initiator_port_id: PortId,
        target_port_id: PortId,
    ) -> Result<Self> {
        let multichannel = match flags & MTCH_ACTION_MASK {
            0 => MultiChannelAction::Single,
            1 => MultiChannelAction::Multi,
            code => return Err(Error::ReservedMultiChannel(code)),
        };
        Ok(Self {
            tag,
            req_it_iu_len,
            req_buf_fmt,
            multichannel,
            sol_not: LoginSolNot::from_bits_truncate(flags),
            imm_data_offset: (flags & IMMED_REQUESTED != 0).then_some(offset),
            initiator_port_id,
            target_port_id,
        })
    }

    fn flags(&self) -> u8 {
        let immed = if self.imm_data_offset.is_some() {
            IMMED_REQUESTED
        } else {
            0
        };
        self.multichannel as u8 | self.sol_not.bits() | immed
    }

    /// Parses the 64-byte IB CM form.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`], [`Error::WrongOpcode`],
    /// [`Error::ReservedMultiChannel`].
    pub fn parse<T: AsRef<[u8]>>(iu: &LoginReq<T>) -> Result<Self> {
        iu.check_len()?;
        expect_opcode(iu.opcode(), Opcode::LoginReq)?;
        Self::from_flags(
            iu.tag(),
            iu.req_it_iu_len(),
            iu.req_buf_fmt(),
            iu.req_flags(),
            iu.imm_data_offset(),
            iu.initiator_port_id(),
            iu.target_port_id(),
        )
    }

    /// Parses the 56-byte RDMA/CM form (the consumer part of RDMA/CM REQ
    /// private data).
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`], [`Error::WrongOpcode`] (byte 11),
    /// [`Error::ReservedMultiChannel`].
    pub fn parse_rdma<T: AsRef<[u8]>>(iu: &LoginReqRdma<T>) -> Result<Self> {
        iu.check_len()?;
        expect_opcode(iu.opcode(), Opcode::LoginReq)?;
        Self::from_flags(
            iu.tag(),
            iu.req_it_iu_len(),
            iu.req_buf_fmt(),
            iu.req_flags(),
            iu.imm_data_offset(),
            iu.initiator_port_id(),
            iu.target_port_id(),
        )
    }

    /// Bytes of the IB CM form.
    pub const fn buffer_len(&self) -> usize {
        LEN
    }

    /// Bytes of the RDMA/CM form.
    pub const fn rdma_buffer_len(&self) -> usize {
        RDMA_LEN
    }

    /// Writes the 64-byte IB CM form, reserved bytes zeroed.
    ///
    /// # Errors
    ///
    /// [`Error::BufferTooSmall`].
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, iu: &mut LoginReq<T>) -> Result<()> {
        check_emit_len(iu.as_bytes(), LEN)?;
        bytes::zero(iu.as_bytes_mut(), 0, LEN);
        iu.set_opcode(Opcode::LoginReq as u8);
        iu.set_tag(self.tag);
        iu.set_req_it_iu_len(self.req_it_iu_len);
        iu.set_req_buf_fmt(self.req_buf_fmt);
        iu.set_req_flags(self.flags());
        iu.set_imm_data_offset(self.imm_data_offset.unwrap_or(0));
        iu.set_initiator_port_id(self.initiator_port_id);
        iu.set_target_port_id(self.target_port_id);
        Ok(())
    }

    /// Writes the 56-byte RDMA/CM form, reserved bytes zeroed.
    ///
    /// # Errors
    ///
    /// [`Error::BufferTooSmall`].
    pub fn emit_rdma<T: AsRef<[u8]> + AsMut<[u8]>>(&self, iu: &mut LoginReqRdma<T>) -> Result<()> {
        check_emit_len(iu.as_bytes(), RDMA_LEN)?;
        bytes::zero(iu.as_bytes_mut(), 0, RDMA_LEN);
        iu.set_opcode(Opcode::LoginReq as u8);
        iu.set_tag(self.tag);
        iu.set_req_it_iu_len(self.req_it_iu_len);
        iu.set_req_buf_fmt(self.req_buf_fmt);
        iu.set_req_flags(self.flags());
        iu.set_imm_data_offset(self.imm_data_offset.unwrap_or(0));
        iu.set_initiator_port_id(self.initiator_port_id);
        iu.set_target_port_id(self.target_port_id);
        Ok(())
    }
}

wire_view! {
    /// A view of the 64-byte IB CM form of `SRP_LOGIN_REQ` (`srp_login_req`).
    pub struct LoginReq, min_len = LEN, error = Error, truncated = Error::Truncated;
    /// IU type byte (0x00).
    opcode, set_opcode: u8 = field::OPCODE;
    /// Tag.
    tag, set_tag: u64 = field::TAG;
    /// Requested maximum initiator-to-target IU length.
    req_it_iu_len, set_req_it_iu_len: u32 = field::REQ_IT_IU_LEN;
    /// Requested descriptor formats.
    req_buf_fmt, set_req_buf_fmt: BufFormats = field::REQ_BUF_FMT;
    /// Raw `req_flags` byte (see [`LoginReqRepr`] for its meaning).
    req_flags, set_req_flags: u8 = field::REQ_FLAGS;
    /// Requested immediate-data offset (meaningful with `IMMED_REQUESTED`).
    imm_data_offset, set_imm_data_offset: u16 = field::IMM_DATA_OFFSET;
    /// Initiator port identifier.
    initiator_port_id, set_initiator_port_id: PortId = field::INITIATOR_PORT_ID;
    /// Target port identifier.
    target_port_id, set_target_port_id: PortId = field::TARGET_PORT_ID;
}

wire_view! {
    /// A view of the 56-byte RDMA/CM form of `SRP_LOGIN_REQ`
    /// (`srp_login_req_rdma`).
    pub struct LoginReqRdma, min_len = RDMA_LEN, error = Error, truncated = Error::Truncated;
    /// Tag.
    tag, set_tag: u64 = field::RDMA_TAG;
    /// Requested descriptor formats.
    req_buf_fmt, set_req_buf_fmt: BufFormats = field::RDMA_REQ_BUF_FMT;
    /// Raw `req_flags` byte.
    req_flags, set_req_flags: u8 = field::RDMA_REQ_FLAGS;
    /// IU type byte (0x00), at byte 11 in this form.
    opcode, set_opcode: u8 = field::RDMA_OPCODE;
    /// Requested maximum initiator-to-target IU length.
    req_it_iu_len, set_req_it_iu_len: u32 = field::RDMA_REQ_IT_IU_LEN;
    /// Initiator port identifier.
    initiator_port_id, set_initiator_port_id: PortId = field::RDMA_INITIATOR_PORT_ID;
    /// Target port identifier.
    target_port_id, set_target_port_id: PortId = field::RDMA_TARGET_PORT_ID;
    /// Requested immediate-data offset.
    imm_data_offset, set_imm_data_offset: u16 = field::RDMA_IMM_DATA_OFFSET;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ib_srp_style() -> LoginReqRepr {
        LoginReqRepr {
            tag: 0,
            req_it_iu_len: 8260,
            req_buf_fmt: BufFormats::DIRECT | BufFormats::INDIRECT,
            multichannel: MultiChannelAction::Single,
            sol_not: LoginSolNot::empty(),
            imm_data_offset: Some(68),
            initiator_port_id: PortId {
                id_ext: 0,
                guid: 0x5054_00ff_fe12_3456,
            },
            target_port_id: PortId {
                id_ext: 0x5054_00ff_fe4a_0b7b,
                guid: 0x5054_00ff_fe4a_0b7b,
            },
        }
    }

    /// An ib_srp-style RDMA/CM login request: tag 0, max IU 8260,
    /// DIRECT|INDIRECT, SINGLE + IMMED_REQUESTED at offset 68, initiator id
    /// 0 || rxe GUID, target id = (service GUID, service GUID).
    #[test]
    fn rdma_cm_golden_bytes() {
        let expected: [u8; 56] = [
            0, 0, 0, 0, 0, 0, 0, 0, // tag
            0x00, 0x06, // req_buf_fmt
            0x80, // req_flags: SINGLE | IMMED_REQUESTED
            0x00, // opcode
            0x00, 0x00, 0x20, 0x44, // req_it_iu_len 8260
            0, 0, 0, 0, 0, 0, 0, 0, 0x50, 0x54, 0x00, 0xff, 0xfe, 0x12, 0x34, 0x56, // i port
            0x50, 0x54, 0x00, 0xff, 0xfe, 0x4a, 0x0b, 0x7b, // t port id_ext
            0x50, 0x54, 0x00, 0xff, 0xfe, 0x4a, 0x0b, 0x7b, // t port guid
            0x00, 0x44, // imm_data_offset 68
            0, 0, 0, 0, 0, 0, // reserved
        ];
        let mut buf = [0xEEu8; 56];
        ib_srp_style()
            .emit_rdma(&mut LoginReqRdma::new_unchecked(&mut buf[..]))
            .unwrap();
        assert_eq!(buf, expected);
        let parsed = LoginReqRepr::parse_rdma(&LoginReqRdma::new_checked(&buf[..]).unwrap());
        assert_eq!(parsed, Ok(ib_srp_style()));
    }

    #[test]
    fn ib_cm_golden_bytes() {
        let mut repr = ib_srp_style();
        repr.multichannel = MultiChannelAction::Multi;
        repr.sol_not = LoginSolNot::CREDIT;
        repr.tag = 0x0102_0304_0506_0708;
        let mut buf = [0xEEu8; 92]; // IB CM REQ private data
        repr.emit(&mut LoginReq::new_unchecked(&mut buf[..]))
            .unwrap();
        let mut expected = [0u8; 64];
        expected[8..16].copy_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
        expected[16..20].copy_from_slice(&[0x00, 0x00, 0x20, 0x44]);
        expected[24..26].copy_from_slice(&[0x00, 0x06]);
        expected[26] = 0x80 | 0x20 | 0x01;
        expected[28..30].copy_from_slice(&[0x00, 0x44]);
        expected[40..48].copy_from_slice(&[0x50, 0x54, 0x00, 0xff, 0xfe, 0x12, 0x34, 0x56]);
        expected[48..56].copy_from_slice(&[0x50, 0x54, 0x00, 0xff, 0xfe, 0x4a, 0x0b, 0x7b]);
        expected[56..64].copy_from_slice(&[0x50, 0x54, 0x00, 0xff, 0xfe, 0x4a, 0x0b, 0x7b]);
        assert_eq!(buf[..64], expected);
        assert_eq!(buf[64..], [0xEE; 28]);
        assert_eq!(
            LoginReqRepr::parse(&LoginReq::new_unchecked(&buf[..])),
            Ok(repr)
        );
    }

    #[test]
    fn malformed() {
        let mut buf = [0u8; 64];
        ib_srp_style()
            .emit(&mut LoginReq::new_unchecked(&mut buf[..]))
            .unwrap();
        assert_eq!(
            LoginReqRepr::parse(&LoginReq::new_unchecked(&buf[..63])),
            Err(Error::Truncated)
        );
        buf[26] = 0x02;
        assert_eq!(
            LoginReqRepr::parse(&LoginReq::new_unchecked(&buf[..])),
            Err(Error::ReservedMultiChannel(2))
        );
        buf[0] = 0xC0;
        assert_eq!(
            LoginReqRepr::parse(&LoginReq::new_unchecked(&buf[..])),
            Err(Error::WrongOpcode(0xC0))
        );
        let mut rdma = [0u8; 56];
        rdma[11] = 0x02;
        assert_eq!(
            LoginReqRepr::parse_rdma(&LoginReqRdma::new_unchecked(&rdma[..])),
            Err(Error::WrongOpcode(0x02))
        );
        assert_eq!(
            ib_srp_style().emit_rdma(&mut LoginReqRdma::new_unchecked(&mut rdma[..55])),
            Err(Error::BufferTooSmall)
        );
        assert_eq!(
            ib_srp_style().emit(&mut LoginReq::new_unchecked(&mut buf[..63])),
            Err(Error::BufferTooSmall)
        );
    }

    #[test]
    fn offset_ignored_without_immed_requested() {
        let mut buf = [0u8; 64];
        buf[28..30].copy_from_slice(&[0x00, 0x44]);
        let repr = LoginReqRepr::parse(&LoginReq::new_unchecked(&buf[..])).unwrap();
        assert_eq!(repr.imm_data_offset, None);
        // Reserved req_flags bits are ignored.
        buf[26] = 0x0c;
        let repr = LoginReqRepr::parse(&LoginReq::new_unchecked(&buf[..])).unwrap();
        assert_eq!(repr.sol_not, LoginSolNot::empty());
    }
}
