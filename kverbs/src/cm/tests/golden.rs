//! Golden bytes of a REQ → REP → RTU exchange as the engines emit it,
//! checked byte by byte against the offsets of the reference
//! (`wire-formats.md` §3.7/§3.8, IBA tables 106-108): MAD offset = 24 +
//! message offset; bit fields MSB first. The checks index the raw bytes;
//! they do not use the wire views the engine emits with.

use super::*;

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().unwrap())
}

fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().unwrap())
}

fn mapped(ip: Ipv4Address) -> [u8; 16] {
    let [a, b, c, d] = ip.0;
    [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, a, b, c, d]
}

/// Runs one exchange and returns the REQ, REP and RTU as sent, with the
/// engines' local comm IDs.
fn exchange() -> (Vec<u8>, Vec<u8>, Vec<u8>, u32, u32) {
    let mut net = Net::new(0x601d);
    net.listen_b();
    let mut buf = [0u8; 92];
    let req = connect_request(&mut buf, b"SRP-LOGIN", 0x10_0100, 0x00_1234);
    let side = &mut net.sides[A];
    let a = side.cm.connect(net.now, &req, &mut side.rec).unwrap();
    assert_eq!(side.rec.sent[0].0, MadAddress::cm(Gid::from_ipv4(IP_B)));
    net.pump();
    let b = net.last_request_b();
    let accept = AcceptRequest {
        qp: LocalQp {
            qpn: qpn(0x20_0200),
            starting_psn: Some(psn(0x00_5678)),
        },
        params: ConnParams {
            initiator_depth: 2,
            ..ConnParams::SRP
        },
        private_data: b"SRP-LOGIN-RSP",
    };
    let side = &mut net.sides[B];
    side.cm.accept(net.now, b, &accept, &mut side.rec).unwrap();
    net.pump();
    let mads: Vec<(usize, &str, Vec<u8>)> = net
        .captured
        .iter()
        .map(|(s, m)| (*s, attr_name(m), m.clone()))
        .collect();
    let names: Vec<(usize, &str)> = mads.iter().map(|(s, n, _)| (*s, *n)).collect();
    assert_eq!(names, [(A, "REQ"), (B, "REP"), (A, "RTU")]);
    let comm_a = net.sides[A].cm.local_comm_id(a).unwrap();
    let comm_b = net.sides[B].cm.local_comm_id(b).unwrap();
    let mut it = mads.into_iter().map(|(_, _, m)| m);
    let (req, rep, rtu) = (it.next().unwrap(), it.next().unwrap(), it.next().unwrap());
    (req, rep, rtu, comm_a, comm_b)
}

fn check_mad_header(m: &[u8], attribute_id: u16, tid: u64) {
    assert_eq!(m.len(), 256);
    assert_eq!(m[0], 1, "base version");
    assert_eq!(m[1], 0x07, "CM class");
    assert_eq!(m[2], 2, "class version");
    assert_eq!(m[3], 0x03, "method Send");
    assert_eq!(&m[4..8], &[0, 0, 0, 0], "status, class specific");
    assert_eq!(be64(m, 8), tid, "transaction ID");
    assert_eq!(u16::from_be_bytes([m[16], m[17]]), attribute_id);
    assert_eq!(&m[18..24], &[0; 6], "reserved, attribute modifier");
}

#[test]
fn req_rep_rtu_bytes() {
    let (req, rep, rtu, comm_a, comm_b) = exchange();
    let tid = be64(&req, 8);
    check_mad_header(&req, 0x0010, tid);
    check_mad_header(&rep, 0x0013, tid);
    check_mad_header(&rtu, 0x0014, tid);

    // ---- REQ (body at MAD offset 24) ----
    let r = &req[24..];
    assert_eq!(be32(r, 0), comm_a, "local comm ID");
    assert_eq!(&r[4..8], &[0; 4], "reserved / vendor ID");
    assert_eq!(
        &r[8..16],
        &[0, 0, 0, 0, 0x01, 0x06, 0x15, 0xb3],
        "service ID: TCP port space, port 5555"
    );
    assert_eq!(be64(r, 16), GUID_A, "local CA GUID");
    assert_eq!(&r[24..28], &[0; 4]);
    assert_eq!(&r[28..32], &[0; 4], "Q_Key (RC: 0)");
    assert_eq!(&r[32..35], &[0x10, 0x01, 0x00], "local QPN");
    assert_eq!(r[35], 4, "responder resources");
    assert_eq!(&r[36..39], &[0; 3], "local EECN");
    assert_eq!(r[39], 4, "initiator depth");
    assert_eq!(&r[40..43], &[0; 3], "remote EECN");
    // remote CM response timeout 10 (5 bits) | RC (2 bits) | flow control
    assert_eq!(r[43], (10 << 3) | 1);
    assert_eq!(&r[44..47], &[0x00, 0x12, 0x34], "starting PSN");
    // local CM response timeout 10 | retry count 7
    assert_eq!(r[47], (10 << 3) | 7);
    assert_eq!(&r[48..50], &[0xff, 0xff], "P_Key");
    // path MTU 3 (1024) | RDC 0 | RNR retry 7
    assert_eq!(r[50], (3 << 4) | 7);
    // max CM retries 3 | SRQ 0 | extended transport 0
    assert_eq!(r[51], 3 << 4);
    // Primary path (RoCE: permissive LIDs, IPv4-mapped GIDs).
    assert_eq!(&r[52..56], &[0xff, 0xff, 0xff, 0xff], "LIDs");
    assert_eq!(&r[56..72], &mapped(IP_A), "local GID");
    assert_eq!(&r[72..88], &mapped(IP_B), "remote GID");
    assert_eq!(&r[88..92], &[0; 4], "flow label, packet rate");
    assert_eq!(r[92], 0, "traffic class");
    assert_eq!(r[93], 64, "hop limit");
    assert_eq!(r[94], 0, "SL, subnet local");
    assert_eq!(r[95], 9 << 3, "local ACK timeout 9 (packet lifetime 8 + 1)");
    assert_eq!(&r[96..140], &[0; 44], "no alternate path");
    // Private data: the RDMA/CM header, then the consumer's bytes.
    let pd = &r[140..232];
    assert_eq!(
        &pd[0..4],
        &[0x00, 0x40, 0x9c, 0x40],
        "version, IPv4, port 40000"
    );
    assert_eq!(&pd[4..16], &[0; 12]);
    assert_eq!(&pd[16..20], &[10, 0, 0, 1]);
    assert_eq!(&pd[20..32], &[0; 12]);
    assert_eq!(&pd[32..36], &[10, 0, 0, 2]);
    assert_eq!(&pd[36..45], b"SRP-LOGIN");
    assert!(pd[45..].iter().all(|b| *b == 0));

    // ---- REP ----
    let p = &rep[24..];
    assert_eq!(be32(p, 0), comm_b, "local comm ID");
    assert_eq!(be32(p, 4), comm_a, "remote comm ID");
    assert_eq!(&p[8..12], &[0; 4], "Q_Key");
    assert_eq!(&p[12..15], &[0x20, 0x02, 0x00], "local QPN");
    assert_eq!(p[15], 0, "vendor ID");
    assert_eq!(&p[16..19], &[0; 3], "local EECN");
    assert_eq!(&p[20..23], &[0x00, 0x56, 0x78], "starting PSN");
    assert_eq!(
        p[24], 4,
        "responder resources (A's initiator depth bounds it)"
    );
    assert_eq!(p[25], 2, "initiator depth (B asked for 2)");
    // target ACK delay 15 | failover 0 | flow control 1
    assert_eq!(p[26], (15 << 3) | 1);
    // RNR retry 7 | SRQ 0
    assert_eq!(p[27], 7 << 5);
    assert_eq!(be64(p, 28), GUID_B, "local CA GUID");
    assert_eq!(&p[36..49], b"SRP-LOGIN-RSP");
    assert!(p[49..232].iter().all(|b| *b == 0));

    // ---- RTU ----
    let u = &rtu[24..];
    assert_eq!(be32(u, 0), comm_a);
    assert_eq!(be32(u, 4), comm_b);
    assert!(u[8..232].iter().all(|b| *b == 0));
}
