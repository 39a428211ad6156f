//! REP: reply to a REQ (IBA table 110).
//!
//! ```text
//!  0:4   local communication ID      4:4  remote communication ID
//!  8:4   local Q_Key
//!  12:3  local QPN                   15   vendor ID bits 23..16 (ECE)
//!  16:3  local EE context            19   vendor ID bits 15..8
//!  20:3  starting PSN                23   vendor ID bits 7..0
//!  24    responder resources         25   initiator depth
//!  26    target ACK delay(5) | failover accepted(2) | E2E flow control(1)
//!  27    RNR retry count(3) | SRQ(1) | reserved(4)
//!  28:8  local CA GUID
//!  36:196 private data
//! ```

use hca_lowlevel::wire::bytes::{self, Field};
use hca_lowlevel::wire::{Eecn, Psn, Qpn};

use super::{IbTimeout, MESSAGE_LEN, clear_body, get_bits, set_bits};
use crate::wire::{Error, Result, check_range};

mod field {
    use super::Field;
    pub const LOCAL_COMM_ID: Field = 0..4;
    pub const REMOTE_COMM_ID: Field = 4..8;
    pub const LOCAL_QKEY: Field = 8..12;
    pub const LOCAL_QPN: Field = 12..15;
    pub const VENDOR_ID_H: usize = 15;
    pub const LOCAL_EECN: Field = 16..19;
    pub const VENDOR_ID_M: usize = 19;
    pub const STARTING_PSN: Field = 20..23;
    pub const VENDOR_ID_L: usize = 23;
    pub const RESPONDER_RESOURCES: usize = 24;
    pub const INITIATOR_DEPTH: usize = 25;
    pub const BYTE_26: usize = 26;
    pub const BYTE_27: usize = 27;
    pub const LOCAL_CA_GUID: Field = 28..36;
    pub const PRIVATE_DATA: Field = 36..232;
}

/// REP private data length.
pub const PRIVATE_DATA_LEN: usize = 196;
static_assertions::const_assert_eq!(field::PRIVATE_DATA.end, MESSAGE_LEN);
static_assertions::const_assert_eq!(
    field::PRIVATE_DATA.end - field::PRIVATE_DATA.start,
    PRIVATE_DATA_LEN
);

const TARGET_ACK_DELAY: u8 = 0xf8;
const FAILOVER_ACCEPTED: u8 = 0x06;
const E2E_FLOW_CONTROL: u8 = 0x01;
const RNR_RETRY_COUNT: u8 = 0xe0;
const SRQ: u8 = 0x10;

fixed_view! {
    /// A view of a REP body (the MAD data).
    CmRep, MESSAGE_LEN
}

impl<T: AsRef<[u8]>> CmRep<T> {
    fn buf(&self) -> &[u8] {
        self.buffer.as_ref()
    }

    /// Local communication ID (the responder's).
    pub fn local_comm_id(&self) -> u32 {
        bytes::read_be32(self.buf(), field::LOCAL_COMM_ID)
    }

    /// Remote communication ID (the requester's, from the REQ).
    pub fn remote_comm_id(&self) -> u32 {
        bytes::read_be32(self.buf(), field::REMOTE_COMM_ID)
    }

    /// Local Q_Key.
    pub fn local_qkey(&self) -> u32 {
        bytes::read_be32(self.buf(), field::LOCAL_QKEY)
    }

    /// Local QPN.
    pub fn local_qpn(&self) -> Qpn {
        Qpn::from_low_bits(bytes::read_be24(self.buf(), field::LOCAL_QPN))
    }

    /// Vendor ID (24 bits spread over three reserved bytes, ECE).
    pub fn vendor_id(&self) -> u32 {
        let buf = self.buf();
        u32::from_be_bytes([
            0,
            bytes::read_u8(buf, field::VENDOR_ID_H),
            bytes::read_u8(buf, field::VENDOR_ID_M),
            bytes::read_u8(buf, field::VENDOR_ID_L),
        ])
    }

    /// Local EE context.
    pub fn local_eecn(&self) -> Eecn {
        Eecn::from_low_bits(bytes::read_be24(self.buf(), field::LOCAL_EECN))
    }

    /// Starting PSN. As Linux uses it: the PSN the REP sender's receive queue
    /// expects; the active side sends from it.
    pub fn starting_psn(&self) -> Psn {
        Psn::from_low_bits(bytes::read_be24(self.buf(), field::STARTING_PSN))
    }

    /// Responder resources.
    pub fn responder_resources(&self) -> u8 {
        bytes::read_u8(self.buf(), field::RESPONDER_RESOURCES)
    }

    /// Initiator depth.
    pub fn initiator_depth(&self) -> u8 {
        bytes::read_u8(self.buf(), field::INITIATOR_DEPTH)
    }

    /// Target ACK delay.
    pub fn target_ack_delay(&self) -> IbTimeout {
        IbTimeout::from_low_bits(get_bits(self.buf(), field::BYTE_26, TARGET_ACK_DELAY))
    }

    /// Failover accepted (2 bits: 0 accepted, 1 not supported, 2 rejected).
    pub fn failover_accepted(&self) -> u8 {
        get_bits(self.buf(), field::BYTE_26, FAILOVER_ACCEPTED)
    }

    /// End-to-end flow control.
    pub fn end_to_end_flow_control(&self) -> bool {
        get_bits(self.buf(), field::BYTE_26, E2E_FLOW_CONTROL) != 0
    }

    /// RNR retry count (3 bits).
    pub fn rnr_retry_count(&self) -> u8 {
        get_bits(self.buf(), field::BYTE_27, RNR_RETRY_COUNT)
    }

    /// The responder's QP uses an SRQ.
    pub fn srq(&self) -> bool {
        get_bits(self.buf(), field::BYTE_27, SRQ) != 0
    }

    /// Local CA GUID.
    pub fn local_ca_guid(&self) -> u64 {
        bytes::read_be64(self.buf(), field::LOCAL_CA_GUID)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> CmRep<T> {
    fn buf_mut(&mut self) -> &mut [u8] {
        self.buffer.as_mut()
    }

    /// Set the local communication ID.
    pub fn set_local_comm_id(&mut self, value: u32) {
        bytes::write_be32(self.buf_mut(), field::LOCAL_COMM_ID, value);
    }

    /// Set the remote communication ID.
    pub fn set_remote_comm_id(&mut self, value: u32) {
        bytes::write_be32(self.buf_mut(), field::REMOTE_COMM_ID, value);
    }

    /// Set the local Q_Key.
    pub fn set_local_qkey(&mut self, value: u32) {
        bytes::write_be32(self.buf_mut(), field::LOCAL_QKEY, value);
    }

    /// Set the local QPN.
    pub fn set_local_qpn(&mut self, value: Qpn) {
        bytes::write_be24(self.buf_mut(), field::LOCAL_QPN, value.get());
    }

    /// Set the vendor ID (low 24 bits).
    pub fn set_vendor_id(&mut self, value: u32) {
        let [_, h, m, l] = value.to_be_bytes();
        let buf = self.buf_mut();
        bytes::write_u8(buf, field::VENDOR_ID_H, h);
        bytes::write_u8(buf, field::VENDOR_ID_M, m);
        bytes::write_u8(buf, field::VENDOR_ID_L, l);
    }

    /// Set the local EE context.
    pub fn set_local_eecn(&mut self, value: Eecn) {
        bytes::write_be24(self.buf_mut(), field::LOCAL_EECN, value.get());
    }

    /// Set the starting PSN.
    pub fn set_starting_psn(&mut self, value: Psn) {
        bytes::write_be24(self.buf_mut(), field::STARTING_PSN, value.get());
    }

    /// Set the responder resources.
    pub fn set_responder_resources(&mut self, value: u8) {
        bytes::write_u8(self.buf_mut(), field::RESPONDER_RESOURCES, value);
    }

    /// Set the initiator depth.
    pub fn set_initiator_depth(&mut self, value: u8) {
        bytes::write_u8(self.buf_mut(), field::INITIATOR_DEPTH, value);
    }

    /// Set the target ACK delay.
    pub fn set_target_ack_delay(&mut self, value: IbTimeout) {
        set_bits(
            self.buf_mut(),
            field::BYTE_26,
            TARGET_ACK_DELAY,
            value.exponent(),
        );
    }

    /// Set failover accepted (low 2 bits).
    pub fn set_failover_accepted(&mut self, value: u8) {
        set_bits(self.buf_mut(), field::BYTE_26, FAILOVER_ACCEPTED, value);
    }

    /// Set end-to-end flow control.
    pub fn set_end_to_end_flow_control(&mut self, value: bool) {
        set_bits(
            self.buf_mut(),
            field::BYTE_26,
            E2E_FLOW_CONTROL,
            u8::from(value),
        );
    }

    /// Set the RNR retry count (low 3 bits).
    pub fn set_rnr_retry_count(&mut self, value: u8) {
        set_bits(self.buf_mut(), field::BYTE_27, RNR_RETRY_COUNT, value);
    }

    /// Set SRQ.
    pub fn set_srq(&mut self, value: bool) {
        set_bits(self.buf_mut(), field::BYTE_27, SRQ, u8::from(value));
    }

    /// Set the local CA GUID.
    pub fn set_local_ca_guid(&mut self, value: u64) {
        bytes::write_be64(self.buf_mut(), field::LOCAL_CA_GUID, value);
    }
}

private_data_accessors!(CmRep, field::PRIVATE_DATA);

/// The meaning of a REP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CmRepRepr<'a> {
    /// Local communication ID (the responder's).
    pub local_comm_id: u32,
    /// Remote communication ID (the requester's).
    pub remote_comm_id: u32,
    /// Local Q_Key.
    pub local_qkey: u32,
    /// Local QPN (the responder's QP: the requester's destination QP).
    pub local_qpn: Qpn,
    /// Vendor ID (24 bits, ECE; 0 when unused).
    pub vendor_id: u32,
    /// Local EE context (RD).
    pub local_eecn: Eecn,
    /// Starting PSN. As Linux uses it: the PSN the REP sender's receive queue
    /// expects; the active side sends from it.
    pub starting_psn: Psn,
    /// RDMA READ/atomic requests the responder accepts.
    pub responder_resources: u8,
    /// RDMA READ/atomic requests the responder issues.
    pub initiator_depth: u8,
    /// Target ACK delay.
    pub target_ack_delay: IbTimeout,
    /// Failover accepted (2 bits).
    pub failover_accepted: u8,
    /// End-to-end flow control.
    pub end_to_end_flow_control: bool,
    /// RNR retry count (3 bits).
    pub rnr_retry_count: u8,
    /// The responder's QP uses an SRQ.
    pub srq: bool,
    /// Local CA GUID.
    pub local_ca_guid: u64,
    /// Private data (up to 196 bytes; SRP: `SRP_LOGIN_RSP`).
    pub private_data: &'a [u8],
}

impl<'a> CmRepRepr<'a> {
    /// Parse a REP body (total beyond the length check).
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`].
    pub fn parse<T: AsRef<[u8]> + ?Sized>(rep: &CmRep<&'a T>) -> Result<CmRepRepr<'a>> {
        rep.check_len()?;
        Ok(CmRepRepr {
            local_comm_id: rep.local_comm_id(),
            remote_comm_id: rep.remote_comm_id(),
            local_qkey: rep.local_qkey(),
            local_qpn: rep.local_qpn(),
            vendor_id: rep.vendor_id(),
            local_eecn: rep.local_eecn(),
            starting_psn: rep.starting_psn(),
            responder_resources: rep.responder_resources(),
            initiator_depth: rep.initiator_depth(),
            target_ack_delay: rep.target_ack_delay(),
            failover_accepted: rep.failover_accepted(),
            end_to_end_flow_control: rep.end_to_end_flow_control(),
            rnr_retry_count: rep.rnr_retry_count(),
            srq: rep.srq(),
            local_ca_guid: rep.local_ca_guid(),
            private_data: rep.private_data(),
        })
    }

    /// The body length.
    pub const fn buffer_len(&self) -> usize {
        MESSAGE_LEN
    }

    /// Check every value fits its field.
    ///
    /// # Errors
    ///
    /// [`Error::FieldOutOfRange`]; [`Error::PrivateDataTooLong`].
    pub fn check(&self) -> Result<()> {
        check_range(self.vendor_id, 0xff_ffff, "REP vendor ID")?;
        check_range(
            u32::from(self.failover_accepted),
            3,
            "REP failover accepted",
        )?;
        check_range(u32::from(self.rnr_retry_count), 7, "REP RNR retry count")?;
        if self.private_data.len() > PRIVATE_DATA_LEN {
            return Err(Error::PrivateDataTooLong(PRIVATE_DATA_LEN));
        }
        Ok(())
    }

    /// Write the body; reserved fields and unused private data are zeroed.
    ///
    /// # Errors
    ///
    /// Those of [`Self::check`]; [`Error::BufferTooShort`].
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, rep: &mut CmRep<T>) -> Result<()> {
        self.check()?;
        rep.check_len().map_err(|_| Error::BufferTooShort)?;
        clear_body(rep.buf_mut());
        rep.set_local_comm_id(self.local_comm_id);
        rep.set_remote_comm_id(self.remote_comm_id);
        rep.set_local_qkey(self.local_qkey);
        rep.set_local_qpn(self.local_qpn);
        rep.set_vendor_id(self.vendor_id);
        rep.set_local_eecn(self.local_eecn);
        rep.set_starting_psn(self.starting_psn);
        rep.set_responder_resources(self.responder_resources);
        rep.set_initiator_depth(self.initiator_depth);
        rep.set_target_ack_delay(self.target_ack_delay);
        rep.set_failover_accepted(self.failover_accepted);
        rep.set_end_to_end_flow_control(self.end_to_end_flow_control);
        rep.set_rnr_retry_count(self.rnr_retry_count);
        rep.set_srq(self.srq);
        rep.set_local_ca_guid(self.local_ca_guid);
        rep.set_private_data(self.private_data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vendor_id_bytes_and_bit_fields() {
        let mut body = [0u8; MESSAGE_LEN];
        let mut rep = CmRep::new_unchecked(&mut body[..]);
        rep.set_local_qpn(Qpn::new(0xab_cdef).unwrap());
        rep.set_vendor_id(0x12_3456);
        rep.set_local_eecn(Eecn::new(0x01_0203).unwrap());
        rep.set_starting_psn(Psn::new(0x0a_0b0c).unwrap());
        rep.set_target_ack_delay(IbTimeout::new(1).unwrap());
        rep.set_failover_accepted(2);
        rep.set_end_to_end_flow_control(true);
        rep.set_rnr_retry_count(7);
        rep.set_srq(true);
        assert_eq!(
            &body[12..24],
            &[
                0xab, 0xcd, 0xef, 0x12, 0x01, 0x02, 0x03, 0x34, 0x0a, 0x0b, 0x0c, 0x56
            ]
        );
        assert_eq!(body[26], 0x0d);
        assert_eq!(body[27], 0xf0);
        let repr = CmRepRepr::parse(&CmRep::new_checked(&body[..]).unwrap()).unwrap();
        assert_eq!(repr.vendor_id, 0x12_3456);
        assert_eq!(repr.local_qpn.get(), 0xab_cdef);
        assert_eq!(repr.failover_accepted, 2);
    }

    #[test]
    fn range_checks() {
        let body = [0u8; MESSAGE_LEN];
        let base = CmRepRepr::parse(&CmRep::new_unchecked(&body[..])).unwrap();
        let mut out = [0u8; MESSAGE_LEN];
        let bad = CmRepRepr {
            failover_accepted: 4,
            ..base
        };
        assert_eq!(
            bad.emit(&mut CmRep::new_unchecked(&mut out[..])),
            Err(Error::FieldOutOfRange("REP failover accepted"))
        );
        let long = [0u8; 197];
        let bad = CmRepRepr {
            private_data: &long,
            ..base
        };
        assert_eq!(bad.check(), Err(Error::PrivateDataTooLong(196)));
        assert_eq!(
            base.emit(&mut CmRep::new_unchecked(&mut out[..231])),
            Err(Error::BufferTooShort)
        );
    }
}
