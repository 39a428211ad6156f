//! REQ: connection request (IBA table 106).
//!
//! ```text
//!  0:4    local communication ID
//!  4      reserved;  5:3 vendor ID (ECE, newer kernels)
//!  8:8    service ID
//!  16:8   local CA GUID
//!  24:4   reserved
//!  28:4   local Q_Key
//!  32:3   local QPN            35 responder resources
//!  36:3   local EECN           39 initiator depth
//!  40:3   remote EECN          43 remote CM response timeout(5) | transport service type(2) | E2E flow control(1)
//!  44:3   starting PSN         47 local CM response timeout(5) | retry count(3)
//!  48:2   P_Key
//!  50     path MTU(4) | RDC exists(1) | RNR retry count(3)
//!  51     max CM retries(4) | SRQ(1) | extended transport type(3)
//!  52:44  primary path
//!  96:44  alternate path (byte 139 bit 0x04: SAP supported)
//!  140:92 private data
//! ```

use hca_lowlevel::wire::bytes::{self, Field};
use hca_lowlevel::wire::{Eecn, Psn, Qpn};

use super::path::PATH_LEN;
use super::{
    CmPath, CmPathRepr, IbTimeout, MESSAGE_LEN, PathMtu, TransportServiceType, clear_body,
    get_bits, set_bits,
};
use crate::wire::{Error, Result, ServiceId, check_range};

mod field {
    use super::Field;
    pub const LOCAL_COMM_ID: Field = 0..4;
    pub const VENDOR_ID: Field = 5..8;
    pub const SERVICE_ID: Field = 8..16;
    pub const LOCAL_CA_GUID: Field = 16..24;
    pub const LOCAL_QKEY: Field = 28..32;
    pub const LOCAL_QPN: Field = 32..35;
    pub const RESPONDER_RESOURCES: usize = 35;
    pub const LOCAL_EECN: Field = 36..39;
    pub const INITIATOR_DEPTH: usize = 39;
    pub const REMOTE_EECN: Field = 40..43;
    pub const BYTE_43: usize = 43;
    pub const STARTING_PSN: Field = 44..47;
    pub const BYTE_47: usize = 47;
    pub const PKEY: Field = 48..50;
    pub const BYTE_50: usize = 50;
    pub const BYTE_51: usize = 51;
    pub const PRIMARY_PATH: Field = 52..96;
    pub const ALTERNATE_PATH: Field = 96..140;
    pub const SAP_SUPPORTED: usize = 139;
    pub const PRIVATE_DATA: Field = 140..232;
}

static_assertions::const_assert_eq!(field::PRIVATE_DATA.end, MESSAGE_LEN);
static_assertions::const_assert_eq!(
    field::PRIMARY_PATH.end - field::PRIMARY_PATH.start,
    PATH_LEN
);
static_assertions::const_assert_eq!(
    field::ALTERNATE_PATH.end - field::ALTERNATE_PATH.start,
    PATH_LEN
);

/// REQ private data length.
pub const PRIVATE_DATA_LEN: usize = 92;
static_assertions::const_assert_eq!(
    field::PRIVATE_DATA.end - field::PRIVATE_DATA.start,
    PRIVATE_DATA_LEN
);

const REMOTE_CM_TIMEOUT: u8 = 0xf8;
const TRANSPORT_TYPE: u8 = 0x06;
const E2E_FLOW_CONTROL: u8 = 0x01;
const LOCAL_CM_TIMEOUT: u8 = 0xf8;
const RETRY_COUNT: u8 = 0x07;
const PATH_MTU: u8 = 0xf0;
const RDC_EXISTS: u8 = 0x08;
const RNR_RETRY_COUNT: u8 = 0x07;
const MAX_CM_RETRIES: u8 = 0xf0;
const SRQ: u8 = 0x08;
const EXTENDED_TRANSPORT: u8 = 0x07;
const SAP_SUPPORTED: u8 = 0x04;

fixed_view! {
    /// A view of a REQ body (the MAD data).
    CmReq, MESSAGE_LEN
}

impl<T: AsRef<[u8]>> CmReq<T> {
    fn buf(&self) -> &[u8] {
        self.buffer.as_ref()
    }

    /// Local communication ID.
    pub fn local_comm_id(&self) -> u32 {
        bytes::read_be32(self.buf(), field::LOCAL_COMM_ID)
    }

    /// Vendor ID (24 bits, ECE).
    pub fn vendor_id(&self) -> u32 {
        bytes::read_be24(self.buf(), field::VENDOR_ID)
    }

    /// Service ID.
    pub fn service_id(&self) -> ServiceId {
        ServiceId(bytes::read_be64(self.buf(), field::SERVICE_ID))
    }

    /// Local CA GUID.
    pub fn local_ca_guid(&self) -> u64 {
        bytes::read_be64(self.buf(), field::LOCAL_CA_GUID)
    }

    /// Local Q_Key.
    pub fn local_qkey(&self) -> u32 {
        bytes::read_be32(self.buf(), field::LOCAL_QKEY)
    }

    /// Local QPN.
    pub fn local_qpn(&self) -> Qpn {
        Qpn::from_low_bits(bytes::read_be24(self.buf(), field::LOCAL_QPN))
    }

    /// Responder resources (RDMA READ/atomic requests the sender accepts).
    pub fn responder_resources(&self) -> u8 {
        bytes::read_u8(self.buf(), field::RESPONDER_RESOURCES)
    }

    /// Local EECN.
    pub fn local_eecn(&self) -> Eecn {
        Eecn::from_low_bits(bytes::read_be24(self.buf(), field::LOCAL_EECN))
    }

    /// Initiator depth (RDMA READ/atomic requests the sender issues).
    pub fn initiator_depth(&self) -> u8 {
        bytes::read_u8(self.buf(), field::INITIATOR_DEPTH)
    }

    /// Remote EECN.
    pub fn remote_eecn(&self) -> Eecn {
        Eecn::from_low_bits(bytes::read_be24(self.buf(), field::REMOTE_EECN))
    }

    /// Remote CM response timeout.
    pub fn remote_cm_response_timeout(&self) -> IbTimeout {
        IbTimeout::from_low_bits(get_bits(self.buf(), field::BYTE_43, REMOTE_CM_TIMEOUT))
    }

    /// Transport service type.
    pub fn transport_service_type(&self) -> TransportServiceType {
        TransportServiceType::from_bits(get_bits(self.buf(), field::BYTE_43, TRANSPORT_TYPE))
    }

    /// End-to-end flow control.
    pub fn end_to_end_flow_control(&self) -> bool {
        get_bits(self.buf(), field::BYTE_43, E2E_FLOW_CONTROL) != 0
    }

    /// Starting PSN. Linux's CM (and so every Linux target) treats it as the
    /// PSN the REQ sender's *receive* queue expects: the passive side sends
    /// from it.
    pub fn starting_psn(&self) -> Psn {
        Psn::from_low_bits(bytes::read_be24(self.buf(), field::STARTING_PSN))
    }

    /// Local CM response timeout.
    pub fn local_cm_response_timeout(&self) -> IbTimeout {
        IbTimeout::from_low_bits(get_bits(self.buf(), field::BYTE_47, LOCAL_CM_TIMEOUT))
    }

    /// Transport retry count (3 bits).
    pub fn retry_count(&self) -> u8 {
        get_bits(self.buf(), field::BYTE_47, RETRY_COUNT)
    }

    /// Partition key.
    pub fn pkey(&self) -> u16 {
        bytes::read_be16(self.buf(), field::PKEY)
    }

    /// Path MTU code as stored (4 bits; see [`PathMtu::from_code`]).
    pub fn path_mtu_code(&self) -> u8 {
        get_bits(self.buf(), field::BYTE_50, PATH_MTU)
    }

    /// RDC exists.
    pub fn rdc_exists(&self) -> bool {
        get_bits(self.buf(), field::BYTE_50, RDC_EXISTS) != 0
    }

    /// RNR retry count (3 bits; 7 = infinite).
    pub fn rnr_retry_count(&self) -> u8 {
        get_bits(self.buf(), field::BYTE_50, RNR_RETRY_COUNT)
    }

    /// Max CM retries (4 bits).
    pub fn max_cm_retries(&self) -> u8 {
        get_bits(self.buf(), field::BYTE_51, MAX_CM_RETRIES)
    }

    /// The sender's QP uses an SRQ.
    pub fn srq(&self) -> bool {
        get_bits(self.buf(), field::BYTE_51, SRQ) != 0
    }

    /// Extended transport type (3 bits; 1 = XRC).
    pub fn extended_transport_type(&self) -> u8 {
        get_bits(self.buf(), field::BYTE_51, EXTENDED_TRANSPORT)
    }

    /// SAP supported (in the alternate path's last byte).
    pub fn sap_supported(&self) -> bool {
        get_bits(self.buf(), field::SAP_SUPPORTED, SAP_SUPPORTED) != 0
    }
}

impl<'a, T: AsRef<[u8]> + ?Sized> CmReq<&'a T> {
    /// The primary path.
    pub fn primary_path(&self) -> CmPath<&'a [u8]> {
        CmPath::new_unchecked(bytes::slice(self.buffer.as_ref(), field::PRIMARY_PATH))
    }

    /// The alternate path.
    pub fn alternate_path(&self) -> CmPath<&'a [u8]> {
        CmPath::new_unchecked(bytes::slice(self.buffer.as_ref(), field::ALTERNATE_PATH))
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> CmReq<T> {
    fn buf_mut(&mut self) -> &mut [u8] {
        self.buffer.as_mut()
    }

    /// Set the local communication ID.
    pub fn set_local_comm_id(&mut self, value: u32) {
        bytes::write_be32(self.buf_mut(), field::LOCAL_COMM_ID, value);
    }

    /// Set the vendor ID (low 24 bits).
    pub fn set_vendor_id(&mut self, value: u32) {
        bytes::write_be24(self.buf_mut(), field::VENDOR_ID, value);
    }

    /// Set the service ID.
    pub fn set_service_id(&mut self, value: ServiceId) {
        bytes::write_be64(self.buf_mut(), field::SERVICE_ID, value.0);
    }

    /// Set the local CA GUID.
    pub fn set_local_ca_guid(&mut self, value: u64) {
        bytes::write_be64(self.buf_mut(), field::LOCAL_CA_GUID, value);
    }

    /// Set the local Q_Key.
    pub fn set_local_qkey(&mut self, value: u32) {
        bytes::write_be32(self.buf_mut(), field::LOCAL_QKEY, value);
    }

    /// Set the local QPN.
    pub fn set_local_qpn(&mut self, value: Qpn) {
        bytes::write_be24(self.buf_mut(), field::LOCAL_QPN, value.get());
    }

    /// Set the responder resources.
    pub fn set_responder_resources(&mut self, value: u8) {
        bytes::write_u8(self.buf_mut(), field::RESPONDER_RESOURCES, value);
    }

    /// Set the local EECN.
    pub fn set_local_eecn(&mut self, value: Eecn) {
        bytes::write_be24(self.buf_mut(), field::LOCAL_EECN, value.get());
    }

    /// Set the initiator depth.
    pub fn set_initiator_depth(&mut self, value: u8) {
        bytes::write_u8(self.buf_mut(), field::INITIATOR_DEPTH, value);
    }

    /// Set the remote EECN.
    pub fn set_remote_eecn(&mut self, value: Eecn) {
        bytes::write_be24(self.buf_mut(), field::REMOTE_EECN, value.get());
    }

    /// Set the remote CM response timeout.
    pub fn set_remote_cm_response_timeout(&mut self, value: IbTimeout) {
        set_bits(
            self.buf_mut(),
            field::BYTE_43,
            REMOTE_CM_TIMEOUT,
            value.exponent(),
        );
    }

    /// Set the transport service type.
    pub fn set_transport_service_type(&mut self, value: TransportServiceType) {
        set_bits(self.buf_mut(), field::BYTE_43, TRANSPORT_TYPE, value as u8);
    }

    /// Set end-to-end flow control.
    pub fn set_end_to_end_flow_control(&mut self, value: bool) {
        set_bits(
            self.buf_mut(),
            field::BYTE_43,
            E2E_FLOW_CONTROL,
            u8::from(value),
        );
    }

    /// Set the starting PSN.
    pub fn set_starting_psn(&mut self, value: Psn) {
        bytes::write_be24(self.buf_mut(), field::STARTING_PSN, value.get());
    }

    /// Set the local CM response timeout.
    pub fn set_local_cm_response_timeout(&mut self, value: IbTimeout) {
        set_bits(
            self.buf_mut(),
            field::BYTE_47,
            LOCAL_CM_TIMEOUT,
            value.exponent(),
        );
    }

    /// Set the retry count (low 3 bits).
    pub fn set_retry_count(&mut self, value: u8) {
        set_bits(self.buf_mut(), field::BYTE_47, RETRY_COUNT, value);
    }

    /// Set the partition key.
    pub fn set_pkey(&mut self, value: u16) {
        bytes::write_be16(self.buf_mut(), field::PKEY, value);
    }

    /// Set the path MTU.
    pub fn set_path_mtu(&mut self, value: PathMtu) {
        set_bits(self.buf_mut(), field::BYTE_50, PATH_MTU, value.code());
    }

    /// Set RDC exists.
    pub fn set_rdc_exists(&mut self, value: bool) {
        set_bits(self.buf_mut(), field::BYTE_50, RDC_EXISTS, u8::from(value));
    }

    /// Set the RNR retry count (low 3 bits).
    pub fn set_rnr_retry_count(&mut self, value: u8) {
        set_bits(self.buf_mut(), field::BYTE_50, RNR_RETRY_COUNT, value);
    }

    /// Set max CM retries (low 4 bits).
    pub fn set_max_cm_retries(&mut self, value: u8) {
        set_bits(self.buf_mut(), field::BYTE_51, MAX_CM_RETRIES, value);
    }

    /// Set SRQ.
    pub fn set_srq(&mut self, value: bool) {
        set_bits(self.buf_mut(), field::BYTE_51, SRQ, u8::from(value));
    }

    /// Set the extended transport type (low 3 bits).
    pub fn set_extended_transport_type(&mut self, value: u8) {
        set_bits(self.buf_mut(), field::BYTE_51, EXTENDED_TRANSPORT, value);
    }

    /// Set SAP supported.
    pub fn set_sap_supported(&mut self, value: bool) {
        set_bits(
            self.buf_mut(),
            field::SAP_SUPPORTED,
            SAP_SUPPORTED,
            u8::from(value),
        );
    }

    /// The primary path, for writing.
    pub fn primary_path_mut(&mut self) -> CmPath<&mut [u8]> {
        CmPath::new_unchecked(bytes::slice_mut(self.buf_mut(), field::PRIMARY_PATH))
    }

    /// The alternate path, for writing.
    pub fn alternate_path_mut(&mut self) -> CmPath<&mut [u8]> {
        CmPath::new_unchecked(bytes::slice_mut(self.buf_mut(), field::ALTERNATE_PATH))
    }
}

private_data_accessors!(CmReq, field::PRIVATE_DATA);

/// The meaning of a REQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CmReqRepr<'a> {
    /// Local communication ID (the requester's).
    pub local_comm_id: u32,
    /// Vendor ID (24 bits, ECE; 0 when unused).
    pub vendor_id: u32,
    /// Service ID of the listener.
    pub service_id: ServiceId,
    /// Local CA GUID.
    pub local_ca_guid: u64,
    /// Local Q_Key.
    pub local_qkey: u32,
    /// Local QPN.
    pub local_qpn: Qpn,
    /// RDMA READ/atomic requests the requester accepts (the responder
    /// uses it as its initiator depth).
    pub responder_resources: u8,
    /// Local EECN (RD).
    pub local_eecn: Eecn,
    /// RDMA READ/atomic requests the requester issues (the responder uses
    /// it as its responder resources).
    pub initiator_depth: u8,
    /// Remote EECN (RD).
    pub remote_eecn: Eecn,
    /// How long the requester waits for the responder's CM reply.
    pub remote_cm_response_timeout: IbTimeout,
    /// Transport service type.
    pub transport_service_type: TransportServiceType,
    /// End-to-end flow control.
    pub end_to_end_flow_control: bool,
    /// Starting PSN: as Linux's CM uses it, the PSN the requester's receive
    /// queue expects (the responder's send queue starts there).
    pub starting_psn: Psn,
    /// How long the responder should wait for the requester's CM replies.
    pub local_cm_response_timeout: IbTimeout,
    /// Transport retry count (3 bits).
    pub retry_count: u8,
    /// Partition key.
    pub pkey: u16,
    /// Path MTU.
    pub path_mtu: PathMtu,
    /// RDC exists (RD).
    pub rdc_exists: bool,
    /// RNR retry count (3 bits; 7 = infinite).
    pub rnr_retry_count: u8,
    /// Max CM retries (4 bits).
    pub max_cm_retries: u8,
    /// The requester's QP uses an SRQ.
    pub srq: bool,
    /// Extended transport type (3 bits).
    pub extended_transport_type: u8,
    /// Primary path.
    pub primary_path: CmPathRepr,
    /// Alternate path, if any (see [`CmPathRepr::is_present`]).
    pub alternate_path: Option<CmPathRepr>,
    /// SAP supported.
    pub sap_supported: bool,
    /// Private data (up to 92 bytes; RDMA/CM: its 36-byte header first).
    pub private_data: &'a [u8],
}

impl<'a> CmReqRepr<'a> {
    /// Parse a REQ body.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`]; [`Error::BadPathMtu`] for a reserved MTU code.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(req: &CmReq<&'a T>) -> Result<CmReqRepr<'a>> {
        req.check_len()?;
        let primary_path = CmPathRepr::parse(&req.primary_path())?;
        let alternate = CmPathRepr::parse(&req.alternate_path())?;
        Ok(CmReqRepr {
            local_comm_id: req.local_comm_id(),
            vendor_id: req.vendor_id(),
            service_id: req.service_id(),
            local_ca_guid: req.local_ca_guid(),
            local_qkey: req.local_qkey(),
            local_qpn: req.local_qpn(),
            responder_resources: req.responder_resources(),
            local_eecn: req.local_eecn(),
            initiator_depth: req.initiator_depth(),
            remote_eecn: req.remote_eecn(),
            remote_cm_response_timeout: req.remote_cm_response_timeout(),
            transport_service_type: req.transport_service_type(),
            end_to_end_flow_control: req.end_to_end_flow_control(),
            starting_psn: req.starting_psn(),
            local_cm_response_timeout: req.local_cm_response_timeout(),
            retry_count: req.retry_count(),
            pkey: req.pkey(),
            path_mtu: PathMtu::from_code(req.path_mtu_code())?,
            rdc_exists: req.rdc_exists(),
            rnr_retry_count: req.rnr_retry_count(),
            max_cm_retries: req.max_cm_retries(),
            srq: req.srq(),
            extended_transport_type: req.extended_transport_type(),
            primary_path,
            alternate_path: alternate.is_present().then_some(alternate),
            sap_supported: req.sap_supported(),
            private_data: req.private_data(),
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
    /// [`Error::FieldOutOfRange`] naming the field; [`Error::PrivateDataTooLong`].
    pub fn check(&self) -> Result<()> {
        check_range(self.vendor_id, 0xff_ffff, "REQ vendor ID")?;
        check_range(u32::from(self.retry_count), 7, "REQ retry count")?;
        check_range(u32::from(self.rnr_retry_count), 7, "REQ RNR retry count")?;
        check_range(u32::from(self.max_cm_retries), 15, "REQ max CM retries")?;
        check_range(
            u32::from(self.extended_transport_type),
            7,
            "REQ extended transport type",
        )?;
        self.primary_path.check()?;
        if let Some(alternate) = &self.alternate_path {
            if !alternate.is_present() {
                // It would read back as "no alternate path".
                return Err(Error::FieldOutOfRange(
                    "REQ alternate path (zero LID and GID)",
                ));
            }
            alternate.check()?;
        }
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
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, req: &mut CmReq<T>) -> Result<()> {
        self.check()?;
        req.check_len().map_err(|_| Error::BufferTooShort)?;
        clear_body(req.buf_mut());
        req.set_local_comm_id(self.local_comm_id);
        req.set_vendor_id(self.vendor_id);
        req.set_service_id(self.service_id);
        req.set_local_ca_guid(self.local_ca_guid);
        req.set_local_qkey(self.local_qkey);
        req.set_local_qpn(self.local_qpn);
        req.set_responder_resources(self.responder_resources);
        req.set_local_eecn(self.local_eecn);
        req.set_initiator_depth(self.initiator_depth);
        req.set_remote_eecn(self.remote_eecn);
        req.set_remote_cm_response_timeout(self.remote_cm_response_timeout);
        req.set_transport_service_type(self.transport_service_type);
        req.set_end_to_end_flow_control(self.end_to_end_flow_control);
        req.set_starting_psn(self.starting_psn);
        req.set_local_cm_response_timeout(self.local_cm_response_timeout);
        req.set_retry_count(self.retry_count);
        req.set_pkey(self.pkey);
        req.set_path_mtu(self.path_mtu);
        req.set_rdc_exists(self.rdc_exists);
        req.set_rnr_retry_count(self.rnr_retry_count);
        req.set_max_cm_retries(self.max_cm_retries);
        req.set_srq(self.srq);
        req.set_extended_transport_type(self.extended_transport_type);
        self.primary_path.emit(&mut req.primary_path_mut())?;
        if let Some(alternate) = &self.alternate_path {
            alternate.emit(&mut req.alternate_path_mut())?;
        }
        req.set_sap_supported(self.sap_supported);
        req.set_private_data(self.private_data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_43_47_50_51_bits() {
        let mut body = [0u8; MESSAGE_LEN];
        let mut req = CmReq::new_unchecked(&mut body[..]);
        req.set_remote_cm_response_timeout(IbTimeout::new(20).unwrap());
        req.set_transport_service_type(TransportServiceType::Rd);
        req.set_end_to_end_flow_control(true);
        req.set_local_cm_response_timeout(IbTimeout::new(31).unwrap());
        req.set_retry_count(5);
        req.set_path_mtu(PathMtu::Mtu4096);
        req.set_rdc_exists(true);
        req.set_rnr_retry_count(6);
        req.set_max_cm_retries(15);
        req.set_srq(true);
        req.set_extended_transport_type(1);
        req.set_sap_supported(true);
        assert_eq!(body[43], 0xa5);
        assert_eq!(body[47], 0xfd);
        assert_eq!(body[50], 0x5e);
        assert_eq!(body[51], 0xf9);
        assert_eq!(body[139], 0x04);
    }

    #[test]
    fn reserved_mtu_is_an_error() {
        let mut body = [0u8; MESSAGE_LEN];
        body[50] = 0x60;
        assert_eq!(
            CmReqRepr::parse(&CmReq::new_checked(&body[..]).unwrap()),
            Err(Error::BadPathMtu(6))
        );
        // The view still reads what a CM needs to send REJ(26, invalid MTU).
        body[0..4].copy_from_slice(&[0, 0, 0, 9]);
        assert_eq!(CmReq::new_checked(&body[..]).unwrap().local_comm_id(), 9);
    }
}
