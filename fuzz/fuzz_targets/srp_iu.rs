//! Fuzzes the SRP IU parser: any bytes must parse to an IU or a defined
//! error, never panic; a parsed IU must emit and re-parse to itself.
//!
//! Input: byte 0 selects the channel's immediate-data offset (bit 0: none;
//! otherwise bytes 1..3 hold it), the rest is the IU.

#![no_main]

use libfuzzer_sys::fuzz_target;
use storport_srp::wire::srp::{LoginReqRdma, LoginReqRepr, SrpIu};

fuzz_target!(|input: &[u8]| {
    let Some((&mode, rest)) = input.split_first() else {
        return;
    };
    let (imm, iu) = if mode & 1 == 0 || rest.len() < 2 {
        (None, rest)
    } else {
        (Some(u16::from_be_bytes([rest[0], rest[1]])), &rest[2..])
    };

    if let Ok(parsed) = SrpIu::parse(iu, imm) {
        let len = parsed.buffer_len().expect("a parsed IU has a length");
        let mut out = vec![0u8; len];
        assert_eq!(parsed.emit(&mut out), Ok(len));
        assert_eq!(SrpIu::parse(&out, imm), Ok(parsed));
    }

    if let Ok(login) = LoginReqRepr::parse_rdma(&LoginReqRdma::new_unchecked(iu)) {
        let mut out = [0u8; 56];
        login.emit_rdma(&mut LoginReqRdma::new_unchecked(&mut out[..])).unwrap();
        assert_eq!(LoginReqRepr::parse_rdma(&LoginReqRdma::new_unchecked(&out[..])), Ok(login));
    }
});
