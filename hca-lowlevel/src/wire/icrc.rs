//! The RoCEv2 invariant CRC (IBA annex A17.3.3).
//!
//! CRC-32 (IEEE, reflected, as zlib's `crc32`) over:
//!
//! 1. eight bytes of `0xff` standing in for the (absent) LRH;
//! 2. the IPv4 header with TOS, TTL and header checksum set to all ones;
//! 3. the UDP header with the checksum set to all ones;
//! 4. the BTH with byte 4 (FECN, BECN, reserved) set to all ones;
//! 5. the rest of the IBA packet: extension headers, payload, pad.
//!
//! The Ethernet header and the ICRC itself are not covered. The result is
//! stored after the pad in **little-endian** byte order (rxe stores `~crc`
//! of its inverted-CRC arithmetic as a CPU-order `u32`; ConnectX agrees).

use super::bytes;

/// The length of the ICRC trailer.
pub const ICRC_LEN: usize = 4;

/// The field positions the ICRC masks.
mod masked {
    pub const IPV4_TOS: usize = 1;
    pub const IPV4_TTL: usize = 8;
    pub const IPV4_CHECKSUM: super::bytes::Field = 10..12;
    pub const UDP_CHECKSUM: super::bytes::Field = 6..8;
    pub const BTH_RESV8A: usize = 4;
    pub const BTH_LEN: usize = 12;
}

/// The ICRC of a RoCEv2 packet over IPv4, as a value to store little-endian.
///
/// `ib_packet` runs from the BTH through the pad bytes (the ICRC excluded).
/// The headers are copied before masking; nothing is modified.
pub fn icrc_ipv4(ip_header: &[u8; 20], udp_header: &[u8; 8], ib_packet: &[u8]) -> u32 {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&[0xff; 8]);

    let mut ip = *ip_header;
    bytes::write_u8(&mut ip, masked::IPV4_TOS, 0xff);
    bytes::write_u8(&mut ip, masked::IPV4_TTL, 0xff);
    bytes::write_be16(&mut ip, masked::IPV4_CHECKSUM, 0xffff);
    hasher.update(&ip);

    let mut udp = *udp_header;
    bytes::write_be16(&mut udp, masked::UDP_CHECKSUM, 0xffff);
    hasher.update(&udp);

    let bth_len = ib_packet.len().min(masked::BTH_LEN);
    let (bth, rest) = ib_packet
        .split_at_checked(bth_len)
        .unwrap_or((ib_packet, &[]));
    let mut bth_masked = [0u8; masked::BTH_LEN];
    bytes::write_bytes(&mut bth_masked, 0..bth_len, bth);
    bytes::write_u8(&mut bth_masked, masked::BTH_RESV8A, 0xff);
    hasher.update(bytes::slice(&bth_masked, 0..bth_len));
    hasher.update(rest);

    hasher.finalize()
}

#[cfg(test)]
mod tests {
    use super::*;

    // The golden SEND_ONLY frame, split by layer (wire-formats.md §4).
    const IP: [u8; 20] = [
        0x45, 0x00, 0x00, 0x38, 0x00, 0x01, 0x40, 0x00, 0x40, 0x11, 0xb6, 0xb0, 0xc0, 0x00, 0x02,
        0x01, 0xc0, 0x00, 0x02, 0x02,
    ];
    const UDP: [u8; 8] = [0xc0, 0x00, 0x12, 0xb7, 0x00, 0x24, 0x00, 0x00];
    const IB: [u8; 24] = [
        0x04, 0x10, 0xff, 0xff, 0x00, 0x00, 0x00, 0x11, 0x80, 0x00, 0x01, 0x00, b'h', b'e', b'l',
        b'l', b'o', b',', b' ', b'r', b'x', b'e', b'!', 0x00,
    ];

    #[test]
    fn golden_icrc_is_44e0985d_on_the_wire() {
        let crc = icrc_ipv4(&IP, &UDP, &IB);
        assert_eq!(crc.to_le_bytes(), [0x44, 0xe0, 0x98, 0x5d]);
    }

    #[test]
    fn masked_fields_do_not_matter() {
        let crc = icrc_ipv4(&IP, &UDP, &IB);
        let mut ip = IP;
        ip[1] = 0xb8; // DSCP/ECN changes in flight (ECN marking)
        ip[8] = 3; // TTL decrements in flight
        ip[10] = 0x12; // so does the checksum
        let mut udp = UDP;
        udp[6] = 0xab;
        let mut ib = IB;
        ib[4] = 0xc0; // FECN/BECN set by switches
        assert_eq!(icrc_ipv4(&ip, &udp, &ib), crc);
    }

    #[test]
    fn covered_fields_do() {
        let crc = icrc_ipv4(&IP, &UDP, &IB);
        let mut ib = IB;
        ib[23] = 1; // a pad byte is covered
        assert_ne!(icrc_ipv4(&IP, &UDP, &ib), crc);
        let mut ip = IP;
        ip[19] = 3;
        assert_ne!(icrc_ipv4(&ip, &UDP, &IB), crc);
        // Short packets are hashed as far as they go, without panicking.
        let _ = icrc_ipv4(&IP, &UDP, &IB[..3]);
        let _ = icrc_ipv4(&IP, &UDP, &[]);
    }
}
