//! Fuzzes the login/text `key=value` parser: any bytes must validate or be
//! rejected with a defined error; a validated segment must type-check
//! without panicking and rebuild, pair by pair, into the same bytes.
//!
//! Input: byte 0 bit 0 selects the SendTargets limits, the rest is the
//! segment.

#![no_main]

use libfuzzer_sys::fuzz_target;
use storport_srp::wire::text::{Limits, TextData, TextWriter};

fuzz_target!(|input: &[u8]| {
    let Some((&mode, data)) = input.split_first() else {
        return;
    };
    let limits = if mode & 1 == 0 { Limits::NEGOTIATION } else { Limits::SEND_TARGETS };
    let Ok(text) = TextData::parse(data, &limits) else {
        return;
    };
    for entry in text.entries() {
        let _ = entry;
    }
    let mut out = vec![0u8; data.len()];
    let mut writer = TextWriter::with_repeats(&mut out, limits.repeats);
    for pair in text.pairs() {
        writer.push(pair.key, pair.value).expect("a validated pair is writable");
    }
    let len = writer.finish();
    assert_eq!(&out[..len], data);
});
