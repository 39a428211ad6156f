//! Whole-packet tests: the golden RoCEv2 frame, round-trip properties for
//! every header, the IBA packet and the frame, and one test per error.
//!
//! Property tests run proptest's default case count; set `PROPTEST_CASES`
//! for a longer sweep (e.g. `PROPTEST_CASES=100000`).

use std::collections::HashSet;
use std::vec;
use std::vec::Vec;

use proptest::prelude::*;

use super::*;

/// Decode a hex string (test fixtures only).
fn hex(s: &str) -> Vec<u8> {
    assert!(s.len() % 2 == 0);
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// The hand-made RC SEND_ONLY frame of wire-formats.md §4: QP 0x11, PSN 256,
/// AckReq, pad 1, payload "hello, rxe!", ICRC 44e0985d (little-endian).
const GOLDEN_SEND_ONLY: &str = "525400123456020000000001080045000038000140004011b6b0c0000201c0000202c00012b7002400000410ffff000000118000010068656c6c6f2c20727865210044e0985d";

fn golden_repr() -> RoceV2FrameRepr<'static> {
    RoceV2FrameRepr {
        src_mac: EthernetAddress([0x02, 0, 0, 0, 0, 0x01]),
        dst_mac: EthernetAddress([0x52, 0x54, 0x00, 0x12, 0x34, 0x56]),
        src_ip: Ipv4Address::new(192, 0, 2, 1),
        dst_ip: Ipv4Address::new(192, 0, 2, 2),
        tos: 0,
        ttl: 64,
        ident: 1,
        dont_fragment: true,
        udp_src_port: 0xc000,
        packet: IbPacketRepr::new(
            BthRepr {
                opcode: Opcode::new(Transport::Rc, Operation::SendOnly).unwrap(),
                solicited: false,
                mig_req: false,
                pkey: 0xffff,
                fecn: false,
                becn: false,
                dest_qp: Qpn::new(0x11).unwrap(),
                ack_req: true,
                psn: Psn::new(256).unwrap(),
            },
            b"hello, rxe!",
        ),
    }
}

#[test]
fn golden_send_only_parses() {
    let frame = hex(GOLDEN_SEND_ONLY);
    assert_eq!(frame.len(), 70);
    let repr = RoceV2FrameRepr::parse(&frame).unwrap();
    assert_eq!(repr, golden_repr());
    assert_eq!(repr.packet.pad_count(), 1);
    assert_eq!(
        repr.src_gid().to_ipv4(),
        Some(Ipv4Address::new(192, 0, 2, 1))
    );
    assert_eq!(
        IncomingFrame::parse(&frame),
        Ok(IncomingFrame::RoceV2(golden_repr()))
    );
}

#[test]
fn emitted_in_process_parse_skips_only_the_icrc() {
    let frame = hex(GOLDEN_SEND_ONLY);
    assert_eq!(
        RoceV2FrameRepr::parse_emitted_in_process(&frame),
        Ok(golden_repr())
    );
    // The ICRC is what it trusts: a bad one is caught by `parse` only.
    let mut bad_icrc = frame.clone();
    bad_icrc[69] ^= 0x01;
    assert_eq!(RoceV2FrameRepr::parse(&bad_icrc), Err(Error::BadIcrc));
    assert_eq!(
        RoceV2FrameRepr::parse_emitted_in_process(&bad_icrc),
        Ok(golden_repr())
    );
    // Every other check still applies.
    let mut not_roce = frame.clone();
    not_roce[36] = 0x12; // UDP destination port 4791 -> 0x1234
    not_roce[37] = 0x34;
    assert_eq!(
        RoceV2FrameRepr::parse_emitted_in_process(&not_roce),
        Err(Error::NotRoceV2Port(0x1234))
    );
    let mut ip_checksum = frame.clone();
    ip_checksum[24] ^= 0x01;
    assert!(RoceV2FrameRepr::parse_emitted_in_process(&ip_checksum).is_err());
    // No room for the ICRC trailer.
    assert!(RoceV2FrameRepr::parse_emitted_in_process(&frame[..40]).is_err());
}

#[test]
fn golden_send_only_emits_byte_exact() {
    let repr = golden_repr();
    assert_eq!(repr.buffer_len(), 70);
    let mut buf = [0xa5u8; 80];
    assert_eq!(repr.emit(&mut buf), Ok(70));
    assert_eq!(&buf[..70], &hex(GOLDEN_SEND_ONLY)[..]);
    // The ICRC trailer is the CRC in little-endian order.
    assert_eq!(&buf[66..70], &[0x44, 0xe0, 0x98, 0x5d]);
    // Bytes past the frame are left alone.
    assert_eq!(buf[70], 0xa5);
}

#[test]
fn golden_with_ethernet_padding_parses() {
    let mut frame = hex(GOLDEN_SEND_ONLY);
    frame.extend_from_slice(&[0u8; 8]);
    assert_eq!(RoceV2FrameRepr::parse(&frame), Ok(golden_repr()));
}

#[test]
fn header_sizes() {
    assert_eq!(bth::HEADER_LEN, 12);
    assert_eq!(HeaderKind::Rdeth.byte_len(), 4);
    assert_eq!(HeaderKind::Deth.byte_len(), 8);
    assert_eq!(HeaderKind::Feth.byte_len(), 4);
    assert_eq!(HeaderKind::Reth.byte_len(), 16);
    assert_eq!(HeaderKind::AtomicEth.byte_len(), 28);
    assert_eq!(HeaderKind::Aeth.byte_len(), 4);
    assert_eq!(HeaderKind::AtomicAckEth.byte_len(), 8);
    assert_eq!(HeaderKind::ImmDt.byte_len(), 4);
    assert_eq!(HeaderKind::Ieth.byte_len(), 4);
    assert_eq!(ethernet::HEADER_LEN, 14);
    assert_eq!(ipv4::HEADER_LEN, 20);
    assert_eq!(udp::HEADER_LEN, 8);
    assert_eq!(arp::PACKET_LEN, 28);
    assert_eq!(ICRC_LEN, 4);
    assert_eq!(FRAMING_LEN, 14 + 20 + 8 + 4);
}

#[test]
fn arp_frame_round_trip() {
    let mac_a = EthernetAddress([0x52, 0x54, 0, 0x12, 0x34, 0x56]);
    let mac_b = EthernetAddress([0x02, 0, 0, 0, 0, 1]);
    let ip_a = Ipv4Address::new(192, 0, 2, 2);
    let ip_b = Ipv4Address::new(192, 0, 2, 1);
    let request = ArpRepr::request(mac_a, ip_a, ip_b);
    let mut buf = [0u8; 60];
    let len = emit_arp_frame(mac_a, EthernetAddress::BROADCAST, &request, &mut buf).unwrap();
    assert_eq!(len, 42);
    // Parse with the minimum-size padding still attached.
    let IncomingFrame::Arp { ethernet, arp } = IncomingFrame::parse(&buf).unwrap() else {
        panic!("not ARP");
    };
    assert_eq!(ethernet.src_addr, mac_a);
    assert_eq!(ethernet.dst_addr, EthernetAddress::BROADCAST);
    assert_eq!(arp, request);
    let reply = arp.reply_for(mac_b, ip_b).unwrap();
    assert_eq!(
        emit_arp_frame(mac_b, mac_a, &reply, &mut buf[..41]),
        Err(Error::BufferTooShort)
    );
}

// ---------------------------------------------------------------------------
// One test per error: every variant must be reachable through a parser or
// an emitter, and `all_errors_reached` checks the list is complete.

/// A packet of `opcode` with every header it needs, built by hand.
fn packet_for(opcode: Opcode, payload: &[u8]) -> IbPacketRepr<'_> {
    let mut p = IbPacketRepr::new(
        BthRepr {
            opcode,
            solicited: false,
            mig_req: false,
            pkey: 0xffff,
            fecn: false,
            becn: false,
            dest_qp: Qpn::new(0x12).unwrap(),
            ack_req: false,
            psn: Psn::new(7).unwrap(),
        },
        payload,
    );
    let h = opcode.headers();
    if h.contains(HeaderSet::RDETH) {
        p.rdeth = Some(RdethRepr {
            eecn: Eecn::new(3).unwrap(),
        });
    }
    if h.contains(HeaderSet::DETH) {
        p.deth = Some(DethRepr {
            qkey: GSI_QKEY,
            src_qp: Qpn::GSI,
        });
    }
    if h.contains(HeaderSet::FETH) {
        p.feth = Some(FethRepr {
            placement: FlushPlacement::PERSISTENCE,
            selectivity: FlushSelectivity::MemoryRange,
        });
    }
    if h.contains(HeaderSet::RETH) {
        p.reth = Some(RethRepr {
            va: 0x1000,
            rkey: 0x42,
            dma_len: 8,
        });
    }
    if h.contains(HeaderSet::ATOMIC_ETH) {
        p.atomic_eth = Some(AtomicEthRepr {
            va: 0x2000,
            rkey: 0x43,
            swap_add: 1,
            compare: 2,
        });
    }
    if h.contains(HeaderSet::AETH) {
        p.aeth = Some(AethRepr {
            syndrome: AethSyndrome::Ack(CreditCount::INVALID),
            msn: Msn::new(9).unwrap(),
        });
    }
    if h.contains(HeaderSet::ATOMIC_ACK_ETH) {
        p.atomic_ack_eth = Some(AtomicAckEthRepr { original: 5 });
    }
    if h.contains(HeaderSet::IMMDT) {
        p.immdt = Some(ImmDtRepr { data: 0xabcd });
    }
    if h.contains(HeaderSet::IETH) {
        p.ieth = Some(IethRepr { rkey: 0x44 });
    }
    p
}

fn op(code: u8) -> Opcode {
    Opcode::from_u8(code).unwrap()
}

fn emitted(p: &IbPacketRepr<'_>) -> Vec<u8> {
    let mut buf = vec![0u8; p.buffer_len()];
    assert_eq!(p.emit(&mut buf), Ok(buf.len()));
    buf
}

/// Every error the tests below produce, collected for `all_errors_reached`.
fn produced_errors() -> Vec<Error> {
    let mut errors = Vec::new();
    let mut push = |r: Error| errors.push(r);

    // --- IBA packet parse ---
    let ack = emitted(&packet_for(op(0x11), &[]));
    push(IbPacketRepr::parse(&ack[..11]).unwrap_err());
    // An ACK whose AETH is cut off.
    push(IbPacketRepr::parse(&ack[..12]).unwrap_err());
    let mut bad = ack.clone();
    bad[0] = 0x15;
    push(IbPacketRepr::parse(&bad).unwrap_err());
    bad = ack.clone();
    bad[1] |= 0x02;
    push(IbPacketRepr::parse(&bad).unwrap_err());
    bad = ack.clone();
    bad.extend_from_slice(&[0, 0, 0, 0]);
    push(IbPacketRepr::parse(&bad).unwrap_err());
    bad = ack.clone();
    bad[1] |= 0x20; // pad 2 on an ACK
    push(IbPacketRepr::parse(&bad).unwrap_err());
    bad = ack.clone();
    bad[12] = 0x45; // AETH syndrome type 0b10
    push(IbPacketRepr::parse(&bad).unwrap_err());

    let send = emitted(&packet_for(op(0x04), &[1, 2, 3, 4, 5]));
    push(IbPacketRepr::parse(&send[..send.len() - 1]).unwrap_err());
    let empty_send = emitted(&packet_for(op(0x04), &[]));
    bad = empty_send.clone();
    bad[1] |= 0x30; // pad 3 with no byte after the BTH
    push(IbPacketRepr::parse(&bad).unwrap_err());

    let aw = emitted(&packet_for(op(0x1d), &[0; 8]));
    let mut short_aw = aw.clone();
    short_aw.truncate(aw.len() - 4);
    push(IbPacketRepr::parse(&short_aw).unwrap_err());

    let flush = emitted(&packet_for(op(0x1c), &[]));
    bad = flush.clone();
    bad[15] = 0x20; // selectivity level 2
    push(IbPacketRepr::parse(&bad).unwrap_err());

    // --- IBA packet emit ---
    let mut missing = packet_for(op(0x0a), &[1, 2, 3, 4]);
    missing.reth = None;
    push(missing.emit(&mut [0u8; 64]).unwrap_err());
    let mut extra = packet_for(op(0x04), &[1, 2, 3, 4]);
    extra.ieth = Some(IethRepr { rkey: 1 });
    push(extra.emit(&mut [0u8; 64]).unwrap_err());
    push(packet_for(op(0x11), &[1]).emit(&mut [0u8; 64]).unwrap_err());
    push(packet_for(op(0x1d), &[1]).emit(&mut [0u8; 64]).unwrap_err());
    push(
        packet_for(op(0x04), &[1, 2, 3])
            .emit(&mut [0u8; 15])
            .unwrap_err(),
    );

    // --- RoCEv2 frame ---
    let golden = hex(GOLDEN_SEND_ONLY);
    let ip_fixed = |mut f: Vec<u8>| {
        Ipv4Packet::new_unchecked(&mut f[14..34]).fill_checksum();
        f
    };
    let mut f = golden.clone();
    f[12] = 0x86;
    f[13] = 0xdd;
    push(RoceV2FrameRepr::parse(&f).unwrap_err());
    f = golden.clone();
    f[14] = 0x65;
    push(RoceV2FrameRepr::parse(&ip_fixed(f)).unwrap_err());
    f = golden.clone();
    f[14] = 0x43;
    push(RoceV2FrameRepr::parse(&f).unwrap_err());
    f = golden.clone();
    f[14] = 0x46;
    push(RoceV2FrameRepr::parse(&ip_fixed(f)).unwrap_err());
    f = golden.clone();
    f[17] = 0x40; // total length 64 > 56
    push(RoceV2FrameRepr::parse(&ip_fixed(f)).unwrap_err());
    f = golden.clone();
    f[20] |= 0x20; // MF
    push(RoceV2FrameRepr::parse(&ip_fixed(f)).unwrap_err());
    f = golden.clone();
    f[24] ^= 0x01; // checksum
    push(RoceV2FrameRepr::parse(&f).unwrap_err());
    f = golden.clone();
    f[23] = 6; // TCP
    push(RoceV2FrameRepr::parse(&ip_fixed(f)).unwrap_err());
    f = golden.clone();
    f[39] = 0x20; // UDP length 32 != 36
    push(RoceV2FrameRepr::parse(&f).unwrap_err());
    f = golden.clone();
    f[40] = 0x12; // a non-zero, wrong UDP checksum
    push(RoceV2FrameRepr::parse(&f).unwrap_err());
    f = golden.clone();
    f[37] = 0xb8; // port 4792
    push(RoceV2FrameRepr::parse(&f).unwrap_err());
    f = golden.clone();
    f[50] = 0x01; // AckReq byte changed: ICRC now wrong
    push(RoceV2FrameRepr::parse(&f).unwrap_err());
    // IP and UDP lengths that leave no room for an ICRC.
    f = golden[..14 + 20 + 8 + 3].to_vec();
    f[17] = 31;
    f[39] = 11;
    push(RoceV2FrameRepr::parse(&ip_fixed(f)).unwrap_err());

    let mut big = golden_repr();
    let huge = vec![0u8; 65_536];
    big.packet.payload = &huge;
    push(big.emit(&mut vec![0u8; 70_000]).unwrap_err());

    // --- ARP ---
    let mut arp = [0u8; 42];
    let request = ArpRepr::request(
        EthernetAddress([2, 0, 0, 0, 0, 1]),
        Ipv4Address::new(10, 0, 0, 1),
        Ipv4Address::new(10, 0, 0, 2),
    );
    emit_arp_frame(
        EthernetAddress([2, 0, 0, 0, 0, 1]),
        EthernetAddress::BROADCAST,
        &request,
        &mut arp,
    )
    .unwrap();
    let mut a = arp;
    a[15] = 0x06; // hardware type 6
    push(IncomingFrame::parse(&a).unwrap_err());
    a = arp;
    a[21] = 9; // operation 9
    push(IncomingFrame::parse(&a).unwrap_err());

    errors
}

#[test]
fn each_error_has_its_input() {
    let expected = [
        Error::Truncated,
        Error::Truncated,
        Error::UnknownOpcode(0x15),
        Error::BadTransportVersion(2),
        Error::UnexpectedPayload,
        Error::BadPadCount(2),
        Error::ReservedAethSyndrome(0x45),
        Error::UnalignedPacketLength,
        Error::BadPadCount(3),
        Error::BadPayloadLength,
        Error::BadFlushSelectivity(2),
        Error::MissingHeader(HeaderKind::Reth),
        Error::UnexpectedHeader(HeaderKind::Ieth),
        Error::UnexpectedPayload,
        Error::BadPayloadLength,
        Error::BufferTooShort,
        Error::UnexpectedEtherType(0x86dd),
        Error::BadIpVersion(6),
        Error::BadIpv4HeaderLength(3),
        Error::Ipv4OptionsUnsupported,
        Error::BadIpv4TotalLength,
        Error::Ipv4Fragment,
        Error::BadIpv4Checksum,
        Error::UnexpectedIpProtocol(6),
        Error::BadUdpLength,
        Error::BadUdpChecksum,
        Error::NotRoceV2Port(4792),
        Error::BadIcrc,
        Error::Truncated,
        Error::PayloadTooLong,
        Error::UnsupportedArp,
        Error::BadArpOperation(9),
    ];
    assert_eq!(produced_errors(), expected);
}

/// A dense index per variant; the exhaustive match makes a new variant a
/// compile error here until a test produces it.
fn variant(e: Error) -> usize {
    match e {
        Error::Truncated => 0,
        Error::BufferTooShort => 1,
        Error::PayloadTooLong => 2,
        Error::UnknownOpcode(_) => 3,
        Error::BadTransportVersion(_) => 4,
        Error::UnalignedPacketLength => 5,
        Error::BadPadCount(_) => 6,
        Error::UnexpectedPayload => 7,
        Error::BadPayloadLength => 8,
        Error::MissingHeader(_) => 9,
        Error::UnexpectedHeader(_) => 10,
        Error::ReservedAethSyndrome(_) => 11,
        Error::BadFlushSelectivity(_) => 12,
        Error::UnexpectedEtherType(_) => 13,
        Error::BadIpVersion(_) => 14,
        Error::BadIpv4HeaderLength(_) => 15,
        Error::Ipv4OptionsUnsupported => 16,
        Error::BadIpv4TotalLength => 17,
        Error::Ipv4Fragment => 18,
        Error::BadIpv4Checksum => 19,
        Error::UnexpectedIpProtocol(_) => 20,
        Error::BadUdpLength => 21,
        Error::BadUdpChecksum => 22,
        Error::NotRoceV2Port(_) => 23,
        Error::UnsupportedArp => 24,
        Error::BadArpOperation(_) => 25,
        Error::BadIcrc => 26,
    }
}

#[test]
fn all_errors_reached() {
    let reached: HashSet<usize> = produced_errors().into_iter().map(variant).collect();
    assert_eq!(
        reached.len(),
        27,
        "every Error variant has a producing input"
    );
    for e in produced_errors() {
        assert!(!std::format!("{e}").is_empty());
    }
}

// ---------------------------------------------------------------------------
// Round-trip properties.

fn arb_qpn() -> impl Strategy<Value = Qpn> {
    (0u32..=0xff_ffff).prop_map(Qpn::from_low_bits)
}

fn arb_psn() -> impl Strategy<Value = Psn> {
    (0u32..=0xff_ffff).prop_map(Psn::from_low_bits)
}

fn arb_opcode() -> impl Strategy<Value = Opcode> {
    proptest::sample::select(Opcode::all().collect::<Vec<_>>())
}

fn arb_bth(opcode: Opcode) -> impl Strategy<Value = BthRepr> {
    (
        any::<(bool, bool, u16, bool, bool, bool)>(),
        arb_qpn(),
        arb_psn(),
    )
        .prop_map(
            move |((solicited, mig_req, pkey, fecn, becn, ack_req), dest_qp, psn)| BthRepr {
                opcode,
                solicited,
                mig_req,
                pkey,
                fecn,
                becn,
                dest_qp,
                ack_req,
                psn,
            },
        )
}

fn arb_aeth() -> impl Strategy<Value = AethRepr> {
    (0u8..3, 0u8..32, 0u32..=0xff_ffff).prop_map(|(kind, value, msn)| AethRepr {
        syndrome: match kind {
            0 => AethSyndrome::Ack(CreditCount::from_low_bits(value)),
            1 => AethSyndrome::RnrNak(RnrTimer::from_low_bits(value)),
            _ => AethSyndrome::Nak(NakCode::from_low_bits(value)),
        },
        msn: Msn::from_low_bits(msn),
    })
}

fn arb_feth() -> impl Strategy<Value = FethRepr> {
    (0u8..16, any::<bool>()).prop_map(|(placement, region)| FethRepr {
        placement: FlushPlacement::from_bits_retain(placement),
        selectivity: if region {
            FlushSelectivity::MemoryRegion
        } else {
            FlushSelectivity::MemoryRange
        },
    })
}

/// Headers for every extension kind; the packet strategy keeps the ones its
/// opcode needs.
#[derive(Debug, Clone)]
struct AllHeaders {
    rdeth: RdethRepr,
    deth: DethRepr,
    feth: FethRepr,
    reth: RethRepr,
    atomic_eth: AtomicEthRepr,
    aeth: AethRepr,
    atomic_ack_eth: AtomicAckEthRepr,
    immdt: ImmDtRepr,
    ieth: IethRepr,
}

fn arb_all_headers() -> impl Strategy<Value = AllHeaders> {
    (
        (0u32..=0xff_ffff, any::<u32>(), arb_qpn(), arb_feth()),
        any::<(u64, u32, u32)>(),
        any::<(u64, u32, u64, u64)>(),
        arb_aeth(),
        any::<(u64, u32, u32)>(),
    )
        .prop_map(
            |(
                (eecn, qkey, src_qp, feth),
                (va, rkey, dma_len),
                (ava, arkey, swap_add, compare),
                aeth,
                (original, imm, inv),
            )| AllHeaders {
                rdeth: RdethRepr {
                    eecn: Eecn::from_low_bits(eecn),
                },
                deth: DethRepr { qkey, src_qp },
                feth,
                reth: RethRepr { va, rkey, dma_len },
                atomic_eth: AtomicEthRepr {
                    va: ava,
                    rkey: arkey,
                    swap_add,
                    compare,
                },
                aeth,
                atomic_ack_eth: AtomicAckEthRepr { original },
                immdt: ImmDtRepr { data: imm },
                ieth: IethRepr { rkey: inv },
            },
        )
}

/// An owned packet description: BTH, headers and payload bytes.
#[derive(Debug, Clone)]
struct PacketCase {
    bth: BthRepr,
    headers: AllHeaders,
    payload: Vec<u8>,
}

impl PacketCase {
    fn repr(&self) -> IbPacketRepr<'_> {
        let h = self.bth.opcode.headers();
        let pick = |flag: HeaderSet| h.contains(flag);
        IbPacketRepr {
            bth: self.bth,
            rdeth: pick(HeaderSet::RDETH).then_some(self.headers.rdeth),
            deth: pick(HeaderSet::DETH).then_some(self.headers.deth),
            feth: pick(HeaderSet::FETH).then_some(self.headers.feth),
            reth: pick(HeaderSet::RETH).then_some(self.headers.reth),
            atomic_eth: pick(HeaderSet::ATOMIC_ETH).then_some(self.headers.atomic_eth),
            aeth: pick(HeaderSet::AETH).then_some(self.headers.aeth),
            atomic_ack_eth: pick(HeaderSet::ATOMIC_ACK_ETH).then_some(self.headers.atomic_ack_eth),
            immdt: pick(HeaderSet::IMMDT).then_some(self.headers.immdt),
            ieth: pick(HeaderSet::IETH).then_some(self.headers.ieth),
            payload: &self.payload,
        }
    }
}

fn arb_packet() -> impl Strategy<Value = PacketCase> {
    arb_opcode().prop_flat_map(|opcode| {
        let payload = match (opcode.has_payload(), opcode.fixed_payload_len()) {
            (false, _) => proptest::collection::vec(any::<u8>(), 0..=0).boxed(),
            (true, Some(n)) => proptest::collection::vec(any::<u8>(), n..=n).boxed(),
            (true, None) => proptest::collection::vec(any::<u8>(), 0..80).boxed(),
        };
        (arb_bth(opcode), arb_all_headers(), payload).prop_map(|(bth, headers, payload)| {
            PacketCase {
                bth,
                headers,
                payload,
            }
        })
    })
}

/// The header error of [`IbPacketRepr::check`] as its specification
/// reads: the first kind in wire order that the opcode wants and the
/// representation lacks, or has and the opcode does not want.
fn reference_header_error(wanted: HeaderSet, present: HeaderSet) -> Option<Error> {
    for kind in HeaderKind::WIRE_ORDER {
        match (wanted.contains(kind.flag()), present.contains(kind.flag())) {
            (true, false) => return Some(Error::MissingHeader(kind)),
            (false, true) => return Some(Error::UnexpectedHeader(kind)),
            _ => {}
        }
    }
    None
}

proptest! {
    /// `check` compares whole header sets and names the first difference
    /// only on a mismatch; for every opcode and every set of present
    /// headers it gives the error the per-kind walk gives, and `emit`
    /// (which writes the present headers in wire order) agrees with it.
    #[test]
    fn check_names_the_first_header_mismatch(case in arb_packet(), toggle in 0u16..0x200) {
        let mut repr = case.repr();
        let h = &case.headers;
        let flip = |flag: HeaderSet| toggle & flag.bits() != 0;
        if flip(HeaderSet::RDETH) { repr.rdeth = repr.rdeth.xor(Some(h.rdeth)); }
        if flip(HeaderSet::DETH) { repr.deth = repr.deth.xor(Some(h.deth)); }
        if flip(HeaderSet::FETH) { repr.feth = repr.feth.xor(Some(h.feth)); }
        if flip(HeaderSet::RETH) { repr.reth = repr.reth.xor(Some(h.reth)); }
        if flip(HeaderSet::ATOMIC_ETH) { repr.atomic_eth = repr.atomic_eth.xor(Some(h.atomic_eth)); }
        if flip(HeaderSet::AETH) { repr.aeth = repr.aeth.xor(Some(h.aeth)); }
        if flip(HeaderSet::ATOMIC_ACK_ETH) {
            repr.atomic_ack_eth = repr.atomic_ack_eth.xor(Some(h.atomic_ack_eth));
        }
        if flip(HeaderSet::IMMDT) { repr.immdt = repr.immdt.xor(Some(h.immdt)); }
        if flip(HeaderSet::IETH) { repr.ieth = repr.ieth.xor(Some(h.ieth)); }
        let wanted = repr.bth.opcode.headers();
        prop_assert_eq!(repr.present_headers().bits(), wanted.bits() ^ toggle);
        let expected = reference_header_error(wanted, repr.present_headers());
        prop_assert_eq!(repr.check().err(), expected);
        let mut buf = vec![0u8; repr.buffer_len()];
        match expected {
            Some(err) => prop_assert_eq!(repr.emit(&mut buf), Err(err)),
            None => {
                prop_assert_eq!(repr.emit(&mut buf), Ok(buf.len()));
                prop_assert_eq!(IbPacketRepr::parse(&buf), Ok(repr));
            }
        }
    }
}

proptest! {
    /// `check_payload_len(n)` is `check` of the same packet with an
    /// `n`-byte payload, whatever payload the representation holds (a
    /// by-reference sender checks its headers with an empty one): the
    /// length rules (none on an opcode without payload, a fixed one on
    /// ATOMIC WRITE) and the header rules alike.
    #[test]
    fn check_payload_len_is_check_with_that_payload(
        case in arb_packet(),
        len in prop_oneof![0usize..=16, Just(8usize), 17usize..5000],
        drop_reth in any::<bool>(),
    ) {
        let zeros = vec![0u8; len];
        let mut held = case.repr();
        if drop_reth {
            held.reth = None;
        }
        let mut full = held;
        full.payload = &zeros;
        prop_assert_eq!(held.check_payload_len(len), full.check());
        let mut empty = held;
        empty.payload = &[];
        prop_assert_eq!(empty.check_payload_len(len), full.check());
    }
}

/// Emit a header through its view, parse it back, and compare.
macro_rules! header_round_trip {
    ($repr:expr, $view:ident, $ty:ident) => {{
        let repr = $repr;
        let mut buf = vec![0u8; repr.buffer_len()];
        repr.emit(&mut $view::new_unchecked(&mut buf[..]));
        let parsed = $ty::parse(&$view::new_checked(&buf[..]).unwrap()).unwrap();
        prop_assert_eq!(parsed, repr);
    }};
}

proptest! {
    #[test]
    fn every_header_round_trips(
        opcode in arb_opcode(),
        h in arb_all_headers(),
        bth_bits in any::<(bool, bool, u16, bool, bool, bool, u32, u32)>(),
    ) {
        let (solicited, mig_req, pkey, fecn, becn, ack_req, qp, psn) = bth_bits;
        let bth = BthRepr {
            opcode,
            solicited,
            mig_req,
            pkey,
            fecn,
            becn,
            dest_qp: Qpn::from_low_bits(qp),
            ack_req,
            psn: Psn::from_low_bits(psn),
        };
        header_round_trip!(bth, Bth, BthRepr);
        header_round_trip!(h.rdeth, Rdeth, RdethRepr);
        header_round_trip!(h.deth, Deth, DethRepr);
        header_round_trip!(h.feth, Feth, FethRepr);
        header_round_trip!(h.reth, Reth, RethRepr);
        header_round_trip!(h.atomic_eth, AtomicEth, AtomicEthRepr);
        header_round_trip!(h.aeth, Aeth, AethRepr);
        header_round_trip!(h.atomic_ack_eth, AtomicAckEth, AtomicAckEthRepr);
        header_round_trip!(h.immdt, ImmDt, ImmDtRepr);
        header_round_trip!(h.ieth, Ieth, IethRepr);
    }

    #[test]
    fn link_headers_round_trip(
        macs in any::<([u8; 6], [u8; 6], u16)>(),
        ip in any::<([u8; 4], [u8; 4], u8, u8, u8, u16, bool, u16)>(),
        ports in any::<(u16, u16, u16)>(),
        arp in any::<(bool, [u8; 6], [u8; 4], [u8; 6], [u8; 4])>(),
    ) {
        let eth = EthernetRepr {
            src_addr: EthernetAddress(macs.0),
            dst_addr: EthernetAddress(macs.1),
            ethertype: EtherType(macs.2),
        };
        header_round_trip!(eth, EthernetFrame, EthernetRepr);

        let (src, dst, proto, tos, ttl, ident, df, len) = ip;
        let ip = Ipv4Repr {
            src_addr: Ipv4Address(src),
            dst_addr: Ipv4Address(dst),
            protocol: IpProtocol(proto),
            payload_len: usize::from(len % 2000),
            tos,
            ttl,
            ident,
            dont_fragment: df,
        };
        let mut buf = vec![0u8; 20 + ip.payload_len];
        ip.emit(&mut Ipv4Packet::new_unchecked(&mut buf[..])).unwrap();
        prop_assert_eq!(Ipv4Repr::parse(&Ipv4Packet::new_checked(&buf[..]).unwrap()), Ok(ip));

        let udp = UdpRepr {
            src_port: ports.0,
            dst_port: ports.1,
            payload_len: usize::from(ports.2 % 2000),
        };
        let mut buf = vec![0u8; 8 + udp.payload_len];
        udp.emit(&mut UdpPacket::new_unchecked(&mut buf[..])).unwrap();
        let parsed = UdpRepr::parse(
            &UdpPacket::new_checked(&buf[..]).unwrap(),
            Ipv4Address(src),
            Ipv4Address(dst),
        );
        prop_assert_eq!(parsed, Ok(udp));
        // With a computed checksum it still verifies.
        UdpPacket::new_unchecked(&mut buf[..]).fill_checksum(Ipv4Address(src), Ipv4Address(dst));
        let parsed = UdpRepr::parse(
            &UdpPacket::new_checked(&buf[..]).unwrap(),
            Ipv4Address(src),
            Ipv4Address(dst),
        );
        prop_assert_eq!(parsed, Ok(udp));

        let arp = ArpRepr {
            operation: if arp.0 { ArpOperation::Request } else { ArpOperation::Reply },
            source_hardware_addr: EthernetAddress(arp.1),
            source_protocol_addr: Ipv4Address(arp.2),
            target_hardware_addr: EthernetAddress(arp.3),
            target_protocol_addr: Ipv4Address(arp.4),
        };
        header_round_trip!(arp, ArpPacket, ArpRepr);
    }

    #[test]
    fn ib_packet_round_trips(case in arb_packet()) {
        let repr = case.repr();
        let bytes = emitted(&repr);
        prop_assert_eq!(bytes.len() % 4, 0);
        prop_assert_eq!(bytes.len(), repr.header_len() + repr.payload.len() + usize::from(repr.pad_count()));
        prop_assert_eq!(Bth::new_unchecked(&bytes[..]).pad_count(), repr.pad_count());
        prop_assert_eq!(IbPacketRepr::parse(&bytes), Ok(repr));
    }

    #[test]
    fn roce_frame_round_trips(
        case in arb_packet(),
        macs in any::<([u8; 6], [u8; 6])>(),
        ips in any::<([u8; 4], [u8; 4])>(),
        ip_bits in any::<(u8, u8, u16, bool, u16)>(),
    ) {
        let frame = RoceV2FrameRepr {
            src_mac: EthernetAddress(macs.0),
            dst_mac: EthernetAddress(macs.1),
            src_ip: Ipv4Address(ips.0),
            dst_ip: Ipv4Address(ips.1),
            tos: ip_bits.0,
            ttl: ip_bits.1,
            ident: ip_bits.2,
            dont_fragment: ip_bits.3,
            udp_src_port: ip_bits.4,
            packet: case.repr(),
        };
        let mut buf = vec![0u8; frame.buffer_len()];
        prop_assert_eq!(frame.emit(&mut buf), Ok(buf.len()));
        prop_assert_eq!(RoceV2FrameRepr::parse(&buf), Ok(frame));
        // Any single flipped bit in the ICRC-covered, unmasked part of the
        // IBA packet is caught by the ICRC (or by a check before it).
        let ib_start = 14 + 20 + 8;
        let at = ib_start + (usize::from(ip_bits.2) % (buf.len() - ib_start));
        if at != ib_start + 4 {
            buf[at] ^= 1 << (ip_bits.0 % 8);
            prop_assert!(RoceV2FrameRepr::parse(&buf).is_err());
        }
    }

    #[test]
    fn arbitrary_bytes_parse_totally(bytes in proptest::collection::vec(any::<u8>(), 0..160)) {
        // Never panics; what parses re-emits to something that parses equal.
        if let Ok(repr) = IbPacketRepr::parse(&bytes) {
            let again = emitted(&repr);
            prop_assert_eq!(IbPacketRepr::parse(&again), Ok(repr));
        }
        if let Ok(frame) = RoceV2FrameRepr::parse(&bytes) {
            let mut again = vec![0u8; frame.buffer_len()];
            frame.emit(&mut again).unwrap();
            prop_assert_eq!(RoceV2FrameRepr::parse(&again), Ok(frame));
        }
        let _ = IncomingFrame::parse(&bytes);
    }

    #[test]
    fn psn_serial_order_is_consistent(a in 0u32..=0xff_ffff, n in 1u32..0x80_0000) {
        let a = Psn::from_low_bits(a);
        let b = a.wrapping_add(n);
        prop_assert!(b.is_after(a) && a.is_before(b));
        prop_assert_eq!(b.distance_from(a), n);
        prop_assert_eq!(b.diff(a), i32::try_from(n).unwrap());
        prop_assert_eq!(b.wrapping_sub(n), a);
    }
}
