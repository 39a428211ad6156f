//! Management datagrams: the MAD header, every CM message and the RDMA/CM
//! header. Parse arbitrary bytes, and the same bytes under a valid CM header
//! (attribute picked by the input) so every message parser is reached;
//! whatever parses must emit and parse back equal.

#![no_main]

use kverbs::wire::{
    CmMadRepr, CmMessage, CmaHeader, CmaHeaderRepr, MadHeader, MadHeaderRepr, ServiceId,
};
use libfuzzer_sys::fuzz_target;

fn round_trip(mad: &[u8]) {
    let Ok(repr) = CmMadRepr::parse(mad) else {
        return;
    };
    let mut out = [0u8; 256];
    assert_eq!(repr.emit(&mut out), Ok(256));
    assert_eq!(CmMadRepr::parse(&out), Ok(repr));
    if let CmMessage::Req(req) = repr.message {
        let _ = (req.service_id.port_space(), req.service_id.port(), req.path_mtu.bytes());
        if let Ok((cma, user)) = CmaHeaderRepr::parse_private_data(req.private_data) {
            assert_eq!(user.len(), req.private_data.len() - 36);
            let mut hdr = [0u8; 36];
            cma.emit(&mut CmaHeader::new_unchecked(&mut hdr[..]));
            assert_eq!(CmaHeaderRepr::parse_private_data(&hdr), Ok((cma, &[][..])));
        }
    }
}

fuzz_target!(|data: &[u8]| {
    if let Ok(header) = MadHeaderRepr::parse(&MadHeader::new_unchecked(data)) {
        let mut out = [0u8; 24];
        header.emit(&mut MadHeader::new_unchecked(&mut out[..]));
        assert_eq!(MadHeaderRepr::parse(&MadHeader::new_unchecked(&out[..])), Ok(header));
    }
    let _ = ServiceId(u64::from_le_bytes(
        data.get(..8).and_then(|b| b.try_into().ok()).unwrap_or([0; 8]),
    ))
    .port_space();
    let _ = CmaHeaderRepr::parse_private_data(data);

    round_trip(data);
    if data.len() >= 24 {
        let mut fixed = data.to_vec();
        fixed[..4].copy_from_slice(&[1, 7, 2, 3]);
        // Attributes 0x10..=0x16 are the messages handled; 0x17 is refused.
        fixed[16] = 0;
        fixed[17] = 0x10 + data[17] % 8;
        round_trip(&fixed);
    }
});
