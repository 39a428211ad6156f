//! Golden CM exchanges written by hand from the offset tables, round-trip
//! properties for every message, and one test per error.
//!
//! Property tests run proptest's default case count; set `PROPTEST_CASES`
//! for a longer sweep.

use std::collections::HashSet;
use std::vec;
use std::vec::Vec;

use hca_lowlevel::wire::{Eecn, Gid, Ipv4Address, Psn, Qpn};
use proptest::prelude::*;

use super::*;

// ---------------------------------------------------------------------------
// Hand-written MADs. Offsets in `put` are relative to the end of the MAD
// header, as in IBA tables 106-113; each line of bytes was written from the
// field list in wire-formats.md §3.7, not from the emitter.

const TID: u64 = 0x0000_0001_2a3b_4c5d;
const INITIATOR_COMM_ID: u32 = 0x1a2b_3c4d;
const TARGET_COMM_ID: u32 = 0x5e6f_7a8b;

/// A MAD with the CM header for `attribute` and transaction ID `TID`.
fn cm_mad(attribute_lo: u8) -> [u8; 256] {
    let mut m = [0u8; 256];
    m[..24].copy_from_slice(&[
        0x01, // base version
        0x07, // class: CM
        0x02, // class version
        0x03, // method: Send
        0x00,
        0x00, // status
        0x00,
        0x00, // class specific
        0x00,
        0x00,
        0x00,
        0x01,
        0x2a,
        0x3b,
        0x4c,
        0x5d, // transaction ID
        0x00,
        attribute_lo, // attribute ID
        0x00,
        0x00, // reserved
        0x00,
        0x00,
        0x00,
        0x00, // attribute modifier
    ]);
    m
}

/// Write `bytes` at body offset `offset`.
fn put(mad: &mut [u8; 256], offset: usize, bytes: &[u8]) {
    mad[24 + offset..24 + offset + bytes.len()].copy_from_slice(bytes);
}

/// The initiator's RDMA/CM header: 192.0.2.1:50000 -> 192.0.2.2.
const CMA_HDR: [u8; 36] = [
    0x00, 0x40, 0xc3, 0x50, // version 0, IPv4, source port 50000
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 192, 0, 2, 1, // source
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 192, 0, 2, 2, // destination
];

/// An `srp_login_req_rdma` (56 bytes), as consumer data after the CMA header.
const SRP_LOGIN_REQ_RDMA: [u8; 56] = [
    0, 0, 0, 0, 0, 0, 0, 0, // tag
    0x00, 0x06, // req_buf_fmt: direct | indirect
    0x80, // req_flags: IMMED_REQUESTED, single channel
    0x00, // opcode: SRP_LOGIN_REQ
    0x00, 0x00, 0x10, 0x00, // req_it_iu_len 4096
    0, 0, 0, 0, 0, 0, 0, 0, 0x00, 0x00, 0xff, 0xff, 0xc0, 0x00, 0x02, 0x01, // initiator port
    0x50, 0x54, 0x00, 0xff, 0xfe, 0x12, 0x34, 0x56, 0x50, 0x54, 0x00, 0xff, 0xfe, 0x12, 0x34,
    0x56, // target port id = (service GUID, service GUID)
    0x00, 0x44, // imm_data_offset 68
    0, 0, 0, 0, 0, 0, // reserved
];

/// An `srp_login_rsp` (52 bytes), as REP private data.
const SRP_LOGIN_RSP: [u8; 52] = [
    0xc0, 0, 0, 0, // opcode, reserved
    0x00, 0x00, 0x00, 0x80, // req_lim_delta 128
    0, 0, 0, 0, 0, 0, 0, 0, // tag
    0x00, 0x00, 0x20, 0x54, // max_it_iu_len 8276
    0x00, 0x00, 0x10, 0x00, // max_ti_iu_len 4096
    0x00, 0x06, // buf_fmt
    0x80, // rsp_flags: IMMED_SUPP
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, // reserved
];

/// An `srp_login_rej` (32 bytes): UNABLE_ASSOCIATE_CHANNEL.
const SRP_LOGIN_REJ: [u8; 32] = [
    0xc2, 0, 0, 0, // opcode, reserved
    0x00, 0x01, 0x00, 0x03, // reason 0x00010003
    0, 0, 0, 0, 0, 0, 0, 0, // tag
    0, 0, 0, 0, 0, 0, 0, 0, // reserved
    0x00, 0x06, // buf_fmt
    0, 0, 0, 0, 0, 0, // reserved
];

fn golden_req_bytes() -> [u8; 256] {
    let mut m = cm_mad(0x10);
    put(&mut m, 0, &[0x1a, 0x2b, 0x3c, 0x4d]); // local comm ID
    put(&mut m, 4, &[0x00, 0x00, 0x00, 0x00]); // reserved, vendor ID 0
    put(&mut m, 8, &[0x00, 0x00, 0x00, 0x00, 0x01, 0x06, 0x15, 0xb3]); // service ID: TCP ps, port 5555
    put(
        &mut m,
        16,
        &[0x00, 0x00, 0x00, 0xff, 0xfe, 0x00, 0x00, 0x01],
    ); // local CA GUID
    put(&mut m, 28, &[0x00, 0x00, 0x00, 0x00]); // local Q_Key
    put(&mut m, 32, &[0x00, 0x00, 0x11, 0x04]); // local QPN 0x11, responder resources 4
    put(&mut m, 36, &[0x00, 0x00, 0x00, 0x04]); // local EECN 0, initiator depth 4
    put(&mut m, 40, &[0x00, 0x00, 0x00, 0xa1]); // remote EECN 0; timeout 20, RC, E2E flow control
    put(&mut m, 44, &[0x12, 0x34, 0x56, 0xa7]); // starting PSN; local timeout 20, retry 7
    put(&mut m, 48, &[0xff, 0xff]); // P_Key
    put(&mut m, 50, &[0x37]); // path MTU 1024 (3), no RDC, RNR retry 7
    put(&mut m, 51, &[0xf0]); // max CM retries 15, no SRQ, extended type 0
    put(&mut m, 52, &[0xff, 0xff, 0xff, 0xff]); // local and remote LID: permissive
    put(
        &mut m,
        56,
        &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 192, 0, 2, 1],
    ); // local GID
    put(
        &mut m,
        72,
        &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 192, 0, 2, 2],
    ); // remote GID
    put(&mut m, 88, &[0x12, 0x34, 0x50, 0x07]); // flow label 0x12345, packet rate 7
    put(&mut m, 92, &[0x00, 0x40, 0x00, 0x90]); // TC 0, hop limit 64, SL 0, ACK timeout 18
    // 96..140: no alternate path.
    put(&mut m, 140, &CMA_HDR);
    put(&mut m, 176, &SRP_LOGIN_REQ_RDMA);
    m
}

fn golden_rep_bytes() -> [u8; 256] {
    let mut m = cm_mad(0x13);
    put(&mut m, 0, &[0x5e, 0x6f, 0x7a, 0x8b]); // local comm ID (target)
    put(&mut m, 4, &[0x1a, 0x2b, 0x3c, 0x4d]); // remote comm ID (initiator)
    put(&mut m, 8, &[0x00, 0x00, 0x00, 0x00]); // local Q_Key
    put(&mut m, 12, &[0x00, 0x00, 0x22, 0x00]); // local QPN 0x22, vendor ID high
    put(&mut m, 16, &[0x00, 0x00, 0x00, 0x00]); // local EECN, vendor ID middle
    put(&mut m, 20, &[0x65, 0x43, 0x21, 0x00]); // starting PSN, vendor ID low
    put(&mut m, 24, &[0x04, 0x04]); // responder resources, initiator depth
    put(&mut m, 26, &[0x7b]); // target ACK delay 15, failover 1 (not supported), E2E
    put(&mut m, 27, &[0xe0]); // RNR retry 7, no SRQ
    put(
        &mut m,
        28,
        &[0x50, 0x54, 0x00, 0xff, 0xfe, 0x12, 0x34, 0x56],
    ); // local CA GUID
    put(&mut m, 36, &SRP_LOGIN_RSP);
    m
}

fn golden_rtu_bytes() -> [u8; 256] {
    let mut m = cm_mad(0x14);
    put(&mut m, 0, &[0x1a, 0x2b, 0x3c, 0x4d]); // local comm ID (initiator)
    put(&mut m, 4, &[0x5e, 0x6f, 0x7a, 0x8b]); // remote comm ID (target)
    m
}

fn golden_rej_bytes() -> [u8; 256] {
    let mut m = cm_mad(0x12);
    put(&mut m, 0, &[0x5e, 0x6f, 0x7a, 0x8b]); // local comm ID (target)
    put(&mut m, 4, &[0x1a, 0x2b, 0x3c, 0x4d]); // remote comm ID (initiator)
    put(&mut m, 8, &[0x00]); // message rejected: REQ
    put(&mut m, 9, &[0x00]); // reject info length 0
    put(&mut m, 10, &[0x00, 0x1c]); // reason 28: consumer defined
    put(&mut m, 84, &SRP_LOGIN_REJ);
    m
}

fn roce_path(local: [u8; 4], remote: [u8; 4]) -> CmPathRepr {
    CmPathRepr {
        local_lid: cm::PERMISSIVE_LID,
        remote_lid: cm::PERMISSIVE_LID,
        local_gid: Gid::from_ipv4(Ipv4Address(local)),
        remote_gid: Gid::from_ipv4(Ipv4Address(remote)),
        flow_label: 0x1_2345,
        packet_rate: 7,
        traffic_class: 0,
        hop_limit: 64,
        sl: 0,
        subnet_local: false,
        local_ack_timeout: IbTimeout::new(18).unwrap(),
    }
}

fn golden_req(private_data: &[u8]) -> CmMadRepr<'_> {
    CmMadRepr {
        transaction_id: TID,
        attribute_modifier: 0,
        message: CmMessage::Req(CmReqRepr {
            local_comm_id: INITIATOR_COMM_ID,
            vendor_id: 0,
            service_id: ServiceId::rdma_cm(PortSpace::Tcp, 5555),
            local_ca_guid: 0x0000_00ff_fe00_0001,
            local_qkey: 0,
            local_qpn: Qpn::new(0x11).unwrap(),
            responder_resources: 4,
            local_eecn: Eecn::new(0).unwrap(),
            initiator_depth: 4,
            remote_eecn: Eecn::new(0).unwrap(),
            remote_cm_response_timeout: IbTimeout::CMA_CM_RESPONSE,
            transport_service_type: TransportServiceType::Rc,
            end_to_end_flow_control: true,
            starting_psn: Psn::new(0x12_3456).unwrap(),
            local_cm_response_timeout: IbTimeout::CMA_CM_RESPONSE,
            retry_count: 7,
            pkey: 0xffff,
            path_mtu: PathMtu::Mtu1024,
            rdc_exists: false,
            rnr_retry_count: 7,
            max_cm_retries: 15,
            srq: false,
            extended_transport_type: 0,
            primary_path: roce_path([192, 0, 2, 1], [192, 0, 2, 2]),
            alternate_path: None,
            sap_supported: false,
            private_data,
        }),
    }
}

fn golden_rep(private_data: &[u8]) -> CmMadRepr<'_> {
    CmMadRepr {
        transaction_id: TID,
        attribute_modifier: 0,
        message: CmMessage::Rep(CmRepRepr {
            local_comm_id: TARGET_COMM_ID,
            remote_comm_id: INITIATOR_COMM_ID,
            local_qkey: 0,
            local_qpn: Qpn::new(0x22).unwrap(),
            vendor_id: 0,
            local_eecn: Eecn::new(0).unwrap(),
            starting_psn: Psn::new(0x65_4321).unwrap(),
            responder_resources: 4,
            initiator_depth: 4,
            target_ack_delay: IbTimeout::new(15).unwrap(),
            failover_accepted: 1,
            end_to_end_flow_control: true,
            rnr_retry_count: 7,
            srq: false,
            local_ca_guid: 0x5054_00ff_fe12_3456,
            private_data,
        }),
    }
}

fn golden_rtu(private_data: &[u8]) -> CmMadRepr<'_> {
    CmMadRepr {
        transaction_id: TID,
        attribute_modifier: 0,
        message: CmMessage::Rtu(CmRtuRepr {
            local_comm_id: INITIATOR_COMM_ID,
            remote_comm_id: TARGET_COMM_ID,
            private_data,
        }),
    }
}

fn golden_rej(private_data: &[u8]) -> CmMadRepr<'_> {
    CmMadRepr {
        transaction_id: TID,
        attribute_modifier: 0,
        message: CmMessage::Rej(CmRejRepr {
            local_comm_id: TARGET_COMM_ID,
            remote_comm_id: INITIATOR_COMM_ID,
            message_rejected: CmMessageKind::Req,
            reason: RejectReason::ConsumerDefined,
            ari: &[],
            private_data,
        }),
    }
}

fn emit(repr: &CmMadRepr<'_>) -> [u8; 256] {
    let mut out = [0xa5u8; 256];
    assert_eq!(repr.emit(&mut out), Ok(256));
    out
}

/// `data` followed by zeros up to `len` (what a parser returns for private
/// data shorter than its field).
fn padded(data: &[u8], len: usize) -> Vec<u8> {
    let mut v = data.to_vec();
    v.resize(len, 0);
    v
}

#[test]
fn golden_req_rep_rtu_exchange() {
    let mut req_pd = Vec::new();
    req_pd.extend_from_slice(&CMA_HDR);
    req_pd.extend_from_slice(&SRP_LOGIN_REQ_RDMA);
    assert_eq!(req_pd.len(), 92);

    // REQ: emitter output equals the hand-written bytes, and back.
    let req_bytes = golden_req_bytes();
    assert_eq!(emit(&golden_req(&req_pd)), req_bytes);
    assert_eq!(CmMadRepr::parse(&req_bytes), Ok(golden_req(&req_pd)));

    // What the passive side reads out of the REQ.
    let Ok(CmMadRepr {
        message: CmMessage::Req(req),
        ..
    }) = CmMadRepr::parse(&req_bytes)
    else {
        panic!("not a REQ");
    };
    assert_eq!(req.service_id.port_space(), Some(PortSpace::Tcp));
    assert_eq!(req.service_id.port(), 5555);
    assert_eq!(req.path_mtu.bytes(), 1024);
    assert_eq!(
        req.primary_path.local_gid.to_ipv4(),
        Some(Ipv4Address::new(192, 0, 2, 1))
    );
    let (cma, user) = CmaHeaderRepr::parse_private_data(req.private_data).unwrap();
    assert_eq!(cma.src_port, 50000);
    assert_eq!(
        cma.addresses,
        CmaAddresses::V4 {
            src: Ipv4Address::new(192, 0, 2, 1),
            dst: Ipv4Address::new(192, 0, 2, 2)
        }
    );
    assert_eq!(user, &SRP_LOGIN_REQ_RDMA[..]);

    // REP with 52 bytes of private data: zero-padded to 196 on the wire.
    let rep_bytes = golden_rep_bytes();
    assert_eq!(emit(&golden_rep(&SRP_LOGIN_RSP)), rep_bytes);
    let rep_pd = padded(&SRP_LOGIN_RSP, 196);
    assert_eq!(CmMadRepr::parse(&rep_bytes), Ok(golden_rep(&rep_pd)));

    // RTU with no private data.
    let rtu_bytes = golden_rtu_bytes();
    assert_eq!(emit(&golden_rtu(&[])), rtu_bytes);
    let rtu_pd = [0u8; 224];
    assert_eq!(CmMadRepr::parse(&rtu_bytes), Ok(golden_rtu(&rtu_pd)));
}

#[test]
fn golden_rej_consumer_defined_with_srp_login_rej() {
    let rej_bytes = golden_rej_bytes();
    assert_eq!(emit(&golden_rej(&SRP_LOGIN_REJ)), rej_bytes);
    let pd = padded(&SRP_LOGIN_REJ, 148);
    let parsed = CmMadRepr::parse(&rej_bytes).unwrap();
    assert_eq!(parsed, golden_rej(&pd));
    let CmMessage::Rej(rej) = parsed.message else {
        panic!("not a REJ");
    };
    assert_eq!(rej.reason.code(), 28);
    assert_eq!(&rej.private_data[..32], &SRP_LOGIN_REJ);
}

#[test]
fn rej_with_unknown_reason_is_still_a_rej() {
    let mut bytes = golden_rej_bytes();
    put(&mut bytes, 10, &[0x00, 0x22]); // 34: not assigned
    let parsed = CmMadRepr::parse(&bytes).unwrap();
    let CmMessage::Rej(rej) = parsed.message else {
        panic!("not a REJ");
    };
    assert_eq!(rej.reason, RejectReason::Other(34));
    assert_eq!(emit(&parsed), bytes);
}

#[test]
fn header_sizes() {
    assert_eq!(MAD_HEADER_LEN, 24);
    assert_eq!(MAD_LEN, 256);
    assert_eq!(MAD_DATA_LEN, 232);
    assert_eq!(CMA_HEADER_LEN, 36);
    assert_eq!(cm::MESSAGE_LEN, 232);
    assert_eq!(cm::ARI_LEN, 72);
}

#[test]
fn private_data_limits() {
    // REQ 92, REP 196, RTU 224, REJ 148, MRA 222, DREQ 220, DREP 224.
    let limits: [(CmMessage<'static>, usize); 7] = [
        (golden_req(&[]).message, 92),
        (golden_rep(&[]).message, 196),
        (golden_rtu(&[]).message, 224),
        (golden_rej(&[]).message, 148),
        (
            CmMessage::Mra(CmMraRepr {
                local_comm_id: 1,
                remote_comm_id: 2,
                message_mraed: CmMessageKind::Req,
                service_timeout: IbTimeout::new(0).unwrap(),
                private_data: &[],
            }),
            222,
        ),
        (
            CmMessage::Dreq(CmDreqRepr {
                local_comm_id: 1,
                remote_comm_id: 2,
                remote_qpn: Qpn::new(3).unwrap(),
                private_data: &[],
            }),
            220,
        ),
        (
            CmMessage::Drep(CmDrepRepr {
                local_comm_id: 1,
                remote_comm_id: 2,
                private_data: &[],
            }),
            224,
        ),
    ];
    let data = [0x5au8; 225];
    for (message, max) in limits {
        for (len, ok) in [(max, true), (max + 1, false)] {
            let msg = with_private_data(message, &data[..len]);
            let mad = CmMadRepr {
                transaction_id: 1,
                attribute_modifier: 0,
                message: msg,
            };
            let mut out = [0u8; 256];
            let result = mad.emit(&mut out);
            if ok {
                assert_eq!(result, Ok(256));
                let parsed = CmMadRepr::parse(&out).unwrap();
                assert_eq!(parsed, mad);
            } else {
                assert_eq!(result, Err(Error::PrivateDataTooLong(max)));
            }
        }
    }
}

fn with_private_data<'a>(message: CmMessage<'_>, data: &'a [u8]) -> CmMessage<'a> {
    match message {
        CmMessage::Req(m) => CmMessage::Req(CmReqRepr {
            private_data: data,
            ..m
        }),
        CmMessage::Rep(m) => CmMessage::Rep(CmRepRepr {
            private_data: data,
            ..m
        }),
        CmMessage::Rtu(m) => CmMessage::Rtu(CmRtuRepr {
            private_data: data,
            ..m
        }),
        CmMessage::Rej(m) => CmMessage::Rej(CmRejRepr {
            private_data: data,
            ari: &[],
            ..m
        }),
        CmMessage::Mra(m) => CmMessage::Mra(CmMraRepr {
            private_data: data,
            ..m
        }),
        CmMessage::Dreq(m) => CmMessage::Dreq(CmDreqRepr {
            private_data: data,
            ..m
        }),
        CmMessage::Drep(m) => CmMessage::Drep(CmDrepRepr {
            private_data: data,
            ..m
        }),
    }
}

// ---------------------------------------------------------------------------
// One input per error; `all_errors_reached` checks the list is complete.

fn produced_errors() -> Vec<Error> {
    let mut errors = Vec::new();
    let req = golden_req_bytes();
    let parse = |m: &[u8]| CmMadRepr::parse(m).unwrap_err();

    errors.push(parse(&req[..255]));
    errors.push(golden_rtu(&[]).emit(&mut [0u8; 255]).unwrap_err());
    let mut m = req;
    m[0] = 0x80; // OPA base version
    errors.push(parse(&m));
    m = req;
    m[1] = 0x03; // subnet administration
    errors.push(parse(&m));
    m = req;
    m[2] = 1;
    errors.push(parse(&m));
    m = req;
    m[3] = 0x01; // Get
    errors.push(parse(&m));
    m = req;
    m[17] = 0x17; // SIDR_REQ
    errors.push(parse(&m));
    m = req;
    m[24 + 50] = 0x07; // MTU code 0
    errors.push(parse(&m));
    m = golden_rej_bytes();
    m[24 + 8] = 0xc0; // message rejected: 3
    errors.push(parse(&m));
    m = golden_rej_bytes();
    m[24 + 9] = 100 << 1; // reject info length 100
    errors.push(parse(&m));
    errors.push(golden_rtu(&[0u8; 225]).emit(&mut [0u8; 256]).unwrap_err());
    let mut bad_req = golden_req(&[]);
    if let CmMessage::Req(r) = &mut bad_req.message {
        r.retry_count = 8;
    }
    errors.push(bad_req.emit(&mut [0u8; 256]).unwrap_err());
    let mut cma = CMA_HDR;
    cma[0] = 1;
    errors.push(CmaHeaderRepr::parse_private_data(&cma).unwrap_err());
    cma = CMA_HDR;
    cma[1] = 0x00;
    errors.push(CmaHeaderRepr::parse_private_data(&cma).unwrap_err());
    errors
}

#[test]
fn each_error_has_its_input() {
    assert_eq!(
        produced_errors(),
        [
            Error::Truncated,
            Error::BufferTooShort,
            Error::BadBaseVersion(0x80),
            Error::UnexpectedMgmtClass(0x03),
            Error::BadClassVersion(1),
            Error::UnexpectedMethod(0x01),
            Error::UnsupportedAttribute(0x0017),
            Error::BadPathMtu(0),
            Error::ReservedMessageKind(3),
            Error::BadRejectInfoLength(100),
            Error::PrivateDataTooLong(224),
            Error::FieldOutOfRange("REQ retry count"),
            Error::BadCmaVersion(1),
            Error::BadCmaIpVersion(0),
        ]
    );
}

/// A dense index per variant; the exhaustive match makes a new variant a
/// compile error here until a test produces it.
fn variant(e: Error) -> usize {
    match e {
        Error::Truncated => 0,
        Error::BufferTooShort => 1,
        Error::BadBaseVersion(_) => 2,
        Error::UnexpectedMgmtClass(_) => 3,
        Error::BadClassVersion(_) => 4,
        Error::UnexpectedMethod(_) => 5,
        Error::UnsupportedAttribute(_) => 6,
        Error::BadPathMtu(_) => 7,
        Error::ReservedMessageKind(_) => 8,
        Error::BadRejectInfoLength(_) => 9,
        Error::PrivateDataTooLong(_) => 10,
        Error::FieldOutOfRange(_) => 11,
        Error::BadCmaVersion(_) => 12,
        Error::BadCmaIpVersion(_) => 13,
    }
}

#[test]
fn all_errors_reached() {
    let reached: HashSet<usize> = produced_errors().into_iter().map(variant).collect();
    assert_eq!(
        reached.len(),
        14,
        "every Error variant has a producing input"
    );
    for e in produced_errors() {
        assert!(!std::format!("{e}").is_empty());
    }
}

// ---------------------------------------------------------------------------
// Round-trip properties: arbitrary message -> emit -> parse -> equal.

fn arb_gid() -> impl Strategy<Value = Gid> {
    any::<[u8; 16]>().prop_map(Gid)
}

fn arb_timeout() -> impl Strategy<Value = IbTimeout> {
    (0u8..32).prop_map(IbTimeout::from_low_bits)
}

fn arb_u24() -> impl Strategy<Value = u32> {
    0u32..=0xff_ffff
}

fn arb_path() -> impl Strategy<Value = CmPathRepr> {
    (
        any::<(u16, u16)>(),
        arb_gid(),
        arb_gid(),
        (0u32..=0xf_ffff, 0u8..64, any::<u8>(), any::<u8>()),
        (0u8..16, any::<bool>(), arb_timeout()),
    )
        .prop_map(
            |(
                (local_lid, remote_lid),
                local_gid,
                remote_gid,
                (flow_label, packet_rate, traffic_class, hop_limit),
                (sl, subnet_local, local_ack_timeout),
            )| CmPathRepr {
                local_lid,
                remote_lid,
                local_gid,
                remote_gid,
                flow_label,
                packet_rate,
                traffic_class,
                hop_limit,
                sl,
                subnet_local,
                local_ack_timeout,
            },
        )
}

fn arb_mtu() -> impl Strategy<Value = PathMtu> {
    (1u8..=5).prop_map(|c| PathMtu::from_code(c).unwrap())
}

fn arb_kind() -> impl Strategy<Value = CmMessageKind> {
    (0u8..3).prop_map(|b| CmMessageKind::from_bits(b).unwrap())
}

/// Owned bytes a message's slices borrow from.
#[derive(Debug, Clone)]
struct Blobs {
    private_data: Vec<u8>,
    ari: Vec<u8>,
}

fn arb_blobs() -> impl Strategy<Value = Blobs> {
    (
        proptest::collection::vec(any::<u8>(), 224),
        proptest::collection::vec(any::<u8>(), 0..=72),
    )
        .prop_map(|(private_data, ari)| Blobs { private_data, ari })
}

/// The fixed (non-slice) fields of one of each message.
#[derive(Debug, Clone)]
struct Fields {
    ids: (u32, u32, u32, u64, u64),
    qpn: u32,
    eecns: (u32, u32),
    vendor: u32,
    psn: u32,
    depths: (u8, u8),
    timeouts: (IbTimeout, IbTimeout),
    counts: (u8, u8, u8, u8),
    flags: (bool, bool, bool, bool),
    tst: u8,
    pkey: u16,
    mtu: PathMtu,
    paths: (CmPathRepr, Option<CmPathRepr>),
    kind: CmMessageKind,
    reason: u16,
    failover: u8,
}

fn arb_fields() -> impl Strategy<Value = Fields> {
    (
        (
            any::<(u32, u32, u32, u64, u64)>(),
            arb_u24(),
            (arb_u24(), arb_u24()),
            arb_u24(),
            arb_u24(),
            any::<(u8, u8)>(),
            (arb_timeout(), arb_timeout()),
            (0u8..8, 0u8..8, 0u8..16, 0u8..8),
        ),
        (
            any::<(bool, bool, bool, bool)>(),
            0u8..4,
            any::<u16>(),
            arb_mtu(),
            arb_path(),
            proptest::option::of(arb_path().prop_filter("present", |p| p.is_present())),
            arb_kind(),
            any::<u16>(),
            0u8..4,
        ),
    )
        .prop_map(
            |(
                (ids, qpn, eecns, vendor, psn, depths, timeouts, counts),
                (flags, tst, pkey, mtu, primary, alternate, kind, reason, failover),
            )| Fields {
                ids,
                qpn,
                eecns,
                vendor,
                psn,
                depths,
                timeouts,
                counts,
                flags,
                tst,
                pkey,
                mtu,
                paths: (primary, alternate),
                kind,
                reason,
                failover,
            },
        )
}

fn messages<'a>(f: &Fields, b: &'a Blobs) -> [CmMessage<'a>; 7] {
    let pd = |n: usize| &b.private_data[..n];
    [
        CmMessage::Req(CmReqRepr {
            local_comm_id: f.ids.0,
            vendor_id: f.vendor,
            service_id: ServiceId(f.ids.3),
            local_ca_guid: f.ids.4,
            local_qkey: f.ids.2,
            local_qpn: Qpn::from_low_bits(f.qpn),
            responder_resources: f.depths.0,
            local_eecn: Eecn::from_low_bits(f.eecns.0),
            initiator_depth: f.depths.1,
            remote_eecn: Eecn::from_low_bits(f.eecns.1),
            remote_cm_response_timeout: f.timeouts.0,
            transport_service_type: TransportServiceType::from_bits(f.tst),
            end_to_end_flow_control: f.flags.0,
            starting_psn: Psn::from_low_bits(f.psn),
            local_cm_response_timeout: f.timeouts.1,
            retry_count: f.counts.0,
            pkey: f.pkey,
            path_mtu: f.mtu,
            rdc_exists: f.flags.1,
            rnr_retry_count: f.counts.1,
            max_cm_retries: f.counts.2,
            srq: f.flags.2,
            extended_transport_type: f.counts.3,
            primary_path: f.paths.0,
            alternate_path: f.paths.1,
            sap_supported: f.flags.3,
            private_data: pd(92),
        }),
        CmMessage::Rep(CmRepRepr {
            local_comm_id: f.ids.0,
            remote_comm_id: f.ids.1,
            local_qkey: f.ids.2,
            local_qpn: Qpn::from_low_bits(f.qpn),
            vendor_id: f.vendor,
            local_eecn: Eecn::from_low_bits(f.eecns.0),
            starting_psn: Psn::from_low_bits(f.psn),
            responder_resources: f.depths.0,
            initiator_depth: f.depths.1,
            target_ack_delay: f.timeouts.0,
            failover_accepted: f.failover,
            end_to_end_flow_control: f.flags.0,
            rnr_retry_count: f.counts.1,
            srq: f.flags.2,
            local_ca_guid: f.ids.4,
            private_data: pd(196),
        }),
        CmMessage::Rtu(CmRtuRepr {
            local_comm_id: f.ids.0,
            remote_comm_id: f.ids.1,
            private_data: pd(224),
        }),
        CmMessage::Rej(CmRejRepr {
            local_comm_id: f.ids.0,
            remote_comm_id: f.ids.1,
            message_rejected: f.kind,
            reason: RejectReason::from_code(f.reason),
            ari: &b.ari,
            private_data: pd(148),
        }),
        CmMessage::Mra(CmMraRepr {
            local_comm_id: f.ids.0,
            remote_comm_id: f.ids.1,
            message_mraed: f.kind,
            service_timeout: f.timeouts.1,
            private_data: pd(222),
        }),
        CmMessage::Dreq(CmDreqRepr {
            local_comm_id: f.ids.0,
            remote_comm_id: f.ids.1,
            remote_qpn: Qpn::from_low_bits(f.qpn),
            private_data: pd(220),
        }),
        CmMessage::Drep(CmDrepRepr {
            local_comm_id: f.ids.0,
            remote_comm_id: f.ids.1,
            private_data: pd(224),
        }),
    ]
}

proptest! {
    #[test]
    fn every_cm_message_round_trips(
        fields in arb_fields(),
        blobs in arb_blobs(),
        tid in any::<u64>(),
        attr_mod in any::<u32>(),
    ) {
        for message in messages(&fields, &blobs) {
            let mad = CmMadRepr { transaction_id: tid, attribute_modifier: attr_mod, message };
            let mut buf = [0u8; 256];
            prop_assert_eq!(mad.emit(&mut buf), Ok(256));
            prop_assert_eq!(CmMadRepr::parse(&buf), Ok(mad));
        }
    }

    #[test]
    fn mad_header_round_trips(h in any::<(u8, u8, u8, u8, u16, u16, u64, u16, u32)>()) {
        let repr = MadHeaderRepr {
            base_version: h.0,
            mgmt_class: h.1,
            class_version: h.2,
            method: h.3,
            status: h.4,
            class_specific: h.5,
            transaction_id: h.6,
            attribute_id: h.7,
            attribute_modifier: h.8,
        };
        let mut buf = [0u8; 24];
        repr.emit(&mut MadHeader::new_unchecked(&mut buf[..]));
        prop_assert_eq!(MadHeaderRepr::parse(&MadHeader::new_checked(&buf[..]).unwrap()), Ok(repr));
    }

    #[test]
    fn cma_header_round_trips(
        port in any::<u16>(),
        v6 in any::<bool>(),
        src in any::<[u8; 16]>(),
        dst in any::<[u8; 16]>(),
    ) {
        let addresses = if v6 {
            CmaAddresses::V6 { src, dst }
        } else {
            CmaAddresses::V4 {
                src: Ipv4Address([src[0], src[1], src[2], src[3]]),
                dst: Ipv4Address([dst[0], dst[1], dst[2], dst[3]]),
            }
        };
        let repr = CmaHeaderRepr { src_port: port, addresses };
        let mut buf = [0u8; 36];
        repr.emit(&mut CmaHeader::new_unchecked(&mut buf[..]));
        prop_assert_eq!(CmaHeaderRepr::parse_private_data(&buf), Ok((repr, &[][..])));
    }

    #[test]
    fn service_id_round_trips(ps in 0usize..4, port in any::<u16>()) {
        let space = [PortSpace::Ipoib, PortSpace::Tcp, PortSpace::Udp, PortSpace::Ib][ps];
        let id = ServiceId::rdma_cm(space, port);
        prop_assert_eq!(id.port_space(), Some(space));
        prop_assert_eq!(id.port(), port);
    }

    #[test]
    fn arbitrary_mads_parse_totally(
        bytes in proptest::collection::vec(any::<u8>(), 0..300),
        attr in 0x10u8..=0x16,
    ) {
        // Raw bytes, then the same bytes with a valid CM header so that the
        // message parsers see them too.
        let mut fixed = bytes.clone();
        if fixed.len() >= 24 {
            fixed[..4].copy_from_slice(&[1, 7, 2, 3]);
            fixed[16] = 0;
            fixed[17] = attr;
        }
        for input in [&bytes, &fixed] {
            if let Ok(mad) = CmMadRepr::parse(input) {
                let mut again = vec![0u8; 256];
                prop_assert_eq!(mad.emit(&mut again), Ok(256));
                prop_assert_eq!(CmMadRepr::parse(&again), Ok(mad));
            }
        }
        let _ = CmaHeaderRepr::parse_private_data(&bytes);
    }
}
