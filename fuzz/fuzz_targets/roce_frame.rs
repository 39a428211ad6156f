//! Ethernet/IPv4/UDP/ARP/ICRC: parse arbitrary frames; whatever parses must
//! emit and parse back equal. The input is also "repaired" (IPv4 and UDP
//! lengths, checksum, port, ICRC made consistent) so that the fuzzer reaches
//! the IBA parser through the frame; a repaired frame may only be refused
//! by the IBA layer.

#![no_main]

use hca_lowlevel::wire::{
    EthernetFrame, IncomingFrame, Ipv4Packet, RoceV2FrameRepr, emit_arp_frame, icrc_ipv4,
    Error,
};
use libfuzzer_sys::fuzz_target;

const ETH: usize = 14;
const IP: usize = 20;
const UDP: usize = 8;
const ICRC: usize = 4;

fn round_trip(frame: &[u8]) -> Option<Error> {
    match IncomingFrame::parse(frame) {
        Ok(IncomingFrame::RoceV2(repr)) => {
            let mut out = vec![0u8; repr.buffer_len()];
            let n = repr.emit(&mut out).expect("a parsed frame emits");
            assert_eq!(n, out.len());
            assert_eq!(RoceV2FrameRepr::parse(&out), Ok(repr));
            None
        }
        Ok(IncomingFrame::Arp { ethernet, arp }) => {
            let mut out = [0u8; 42];
            emit_arp_frame(ethernet.src_addr, ethernet.dst_addr, &arp, &mut out)
                .expect("42 bytes suffice");
            assert_eq!(
                IncomingFrame::parse(&out),
                Ok(IncomingFrame::Arp { ethernet, arp })
            );
            None
        }
        Err(e) => Some(e),
    }
}

/// Make every length, checksum and the ICRC consistent, keeping the bytes
/// that carry meaning; `None` when the input cannot be a RoCEv2 frame.
fn repaired(data: &[u8]) -> Option<Vec<u8>> {
    if data.len() < ETH + IP + UDP + ICRC || data.len() - ETH > usize::from(u16::MAX) {
        return None;
    }
    let mut f = data.to_vec();
    let ip_len = u16::try_from(f.len() - ETH).ok()?;
    let udp_len = ip_len - IP as u16;
    f[12..14].copy_from_slice(&[0x08, 0x00]);
    f[ETH] = 0x45;
    f[ETH + 2..ETH + 4].copy_from_slice(&ip_len.to_be_bytes());
    f[ETH + 6] &= 0x40; // keep DF, clear MF and the offset
    f[ETH + 7] = 0;
    f[ETH + 9] = 17;
    let udp = ETH + IP;
    f[udp + 2..udp + 4].copy_from_slice(&4791u16.to_be_bytes());
    f[udp + 4..udp + 6].copy_from_slice(&udp_len.to_be_bytes());
    f[udp + 6..udp + 8].copy_from_slice(&[0, 0]);
    Ipv4Packet::new_unchecked(&mut f[ETH..ETH + IP]).fill_checksum();
    let end = f.len() - ICRC;
    let crc = icrc_ipv4(
        f[ETH..ETH + IP].try_into().ok()?,
        f[udp..udp + UDP].try_into().ok()?,
        &f[udp + UDP..end],
    );
    f[end..].copy_from_slice(&crc.to_le_bytes());
    Some(f)
}

fuzz_target!(|data: &[u8]| {
    let _ = EthernetFrame::new_unchecked(data).ethertype();
    round_trip(data);
    if let Some(frame) = repaired(data) {
        if let Some(error) = round_trip(&frame) {
            assert!(
                !matches!(
                    error,
                    Error::UnexpectedEtherType(_)
                        | Error::BadIpVersion(_)
                        | Error::BadIpv4HeaderLength(_)
                        | Error::Ipv4OptionsUnsupported
                        | Error::BadIpv4TotalLength
                        | Error::Ipv4Fragment
                        | Error::BadIpv4Checksum
                        | Error::UnexpectedIpProtocol(_)
                        | Error::BadUdpLength
                        | Error::BadUdpChecksum
                        | Error::NotRoceV2Port(_)
                        | Error::BadIcrc
                ),
                "a repaired frame failed below the IBA layer: {error:?}"
            );
        }
    }
});
