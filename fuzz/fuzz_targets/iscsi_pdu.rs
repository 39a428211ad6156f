//! Fuzzes what an iSER initiator receives in one RDMA SEND: the iSER
//! header, the iSCSI BHS, AHS and data segment, and the data segment's own
//! formats (sense data, rejected header, text). Any bytes must parse to a
//! message or a defined error; a parsed message must emit and re-parse to
//! itself.

#![no_main]

use libfuzzer_sys::fuzz_target;
use storport_srp::wire::iscsi::{AhsIter, BhsRepr, IscsiPdu, Padding, RejectRepr, SenseData};
use storport_srp::wire::iser::IserMessage;
use storport_srp::wire::text::{Limits, TextData};

fn inspect(pdu: &IscsiPdu<'_>) {
    for ahs in AhsIter::new(pdu.ahs) {
        let _ = ahs;
    }
    match pdu.header {
        BhsRepr::ScsiResponse(_) | BhsRepr::AsyncMessage(_) => {
            let _ = SenseData::parse(pdu.data);
        }
        BhsRepr::Reject(_) => {
            if let Ok(bhs) = RejectRepr::rejected_header(pdu.data) {
                let _ = BhsRepr::parse(&bhs);
            }
        }
        BhsRepr::LoginResponse(_) | BhsRepr::TextResponse(_) => {
            if let Ok(text) = TextData::parse(pdu.data, &Limits::NEGOTIATION) {
                for entry in text.entries() {
                    let _ = entry;
                }
            }
        }
        _ => {}
    }
}

fuzz_target!(|input: &[u8]| {
    if let Ok(msg) = IserMessage::parse(input) {
        if let IserMessage::Control { pdu, .. } = &msg {
            inspect(pdu);
        }
        let mut out = vec![0u8; msg.buffer_len()];
        assert_eq!(msg.emit(&mut out), Ok(out.len()));
        assert_eq!(IserMessage::parse(&out), Ok(msg));
    }

    // The same bytes as a bare iSCSI PDU (iSCSI over TCP framing).
    if let Ok(pdu) = IscsiPdu::parse(input) {
        inspect(&pdu);
        let mut out = vec![0u8; pdu.buffer_len(Padding::ToWord)];
        assert_eq!(pdu.emit(&mut out, Padding::ToWord), Ok(out.len()));
        assert_eq!(IscsiPdu::parse(&out), Ok(pdu));
    }
});
