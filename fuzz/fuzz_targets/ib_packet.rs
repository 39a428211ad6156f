//! A whole IBA transport packet (BTH through pad): parse arbitrary bytes;
//! whatever parses must emit to the same length and parse back equal.

#![no_main]

use hca_lowlevel::wire::{Aeth, Bth, Deth, IbPacketRepr, Reth};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Views over arbitrary (possibly short) buffers never panic.
    let bth = Bth::new_unchecked(data);
    let _ = (bth.opcode(), bth.pad_count(), bth.dest_qp(), bth.psn(), bth.ack_req());
    let _ = (Reth::new_unchecked(data).dma_len(), Deth::new_unchecked(data).src_qp());
    let _ = Aeth::new_unchecked(data).syndrome();

    let Ok(repr) = IbPacketRepr::parse(data) else {
        return;
    };
    assert!(repr.check().is_ok(), "a parsed packet is consistent");
    let mut out = vec![0u8; repr.buffer_len()];
    let written = repr.emit(&mut out).expect("a parsed packet emits");
    assert_eq!(written, data.len(), "same headers, payload and pad");
    assert_eq!(IbPacketRepr::parse(&out), Ok(repr));
});
