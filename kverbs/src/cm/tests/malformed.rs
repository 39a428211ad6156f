//! Malformed and unmatched MADs of every kind: each gets its own drop
//! reason (counted, reported to the trace hook), the answer Linux gives
//! where there is one, and no effect on any connection. Then a seeded
//! mutation sweep: no input panics, every MAD is accounted for.

use super::*;

/// An established pair, and the REP/RTU/DREQ B would send, to mutate.
struct Fixture {
    net: Net,
    a: CmId,
    b: CmId,
    /// A REP that matches A's connection (a duplicate).
    rep: Vec<u8>,
    /// B's RTU-shaped message toward A is not a thing; A's RTU to B.
    rtu: Vec<u8>,
}

fn fixture() -> Fixture {
    let mut net = Net::new(0xbad);
    net.listen_b();
    let a = net.connect_a(b"");
    let b = net.last_request_b();
    net.accept_b(b, &[]);
    let find = |sender: usize, name: &str| {
        net.captured
            .iter()
            .find(|(s, m)| *s == sender && attr_name(m) == name)
            .map(|(_, m)| m.clone())
            .unwrap()
    };
    let rep = find(B, "REP");
    let rtu = find(A, "RTU");
    Fixture {
        net,
        a,
        b,
        rep,
        rtu,
    }
}

impl Fixture {
    /// Delivers `mad` to side `to` as if from `from`; returns the drops
    /// and what `to` sent in answer.
    fn deliver(
        &mut self,
        to: usize,
        from: MadAddress,
        mad: &[u8],
    ) -> (Vec<DropReason>, Vec<String>) {
        let side = &mut self.net.sides[to];
        side.rec.drops.clear();
        side.rec.sent.clear();
        side.cm.on_mad(self.net.now, &from, mad, &mut side.rec);
        let drops = side.rec.drops.iter().map(|d| d.reason).collect();
        let sent = side
            .rec
            .sent
            .iter()
            .map(|(_, m)| match CmMadRepr::parse(m).unwrap().message {
                CmMessage::Rej(r) => format!("REJ({})", r.reason.code()),
                _ => attr_name(m).to_string(),
            })
            .collect();
        side.rec.sent.clear();
        (drops, sent)
    }

    fn from(&self, s: usize) -> MadAddress {
        self.net.sides[s].addr
    }

    fn unchanged(&self) {
        assert_eq!(
            self.net.sides[A].cm.state(self.a),
            Some(CmState::Established)
        );
        assert_eq!(
            self.net.sides[B].cm.state(self.b),
            Some(CmState::Established)
        );
        assert_eq!(self.net.events(A, self.a).len(), 1);
        assert_eq!(self.net.events(B, self.b).len(), 1);
    }
}

fn set_be32(m: &mut [u8], at: usize, v: u32) {
    m[at..at + 4].copy_from_slice(&v.to_be_bytes());
}

#[test]
fn each_malformed_kind_has_its_reason() {
    let mut f = fixture();
    let from_b = f.from(B);
    let rep = f.rep.clone();
    let mut cases: Vec<(&str, Vec<u8>, DropReason, Vec<&str>)> = Vec::new();
    cases.push(("short", rep[..255].to_vec(), DropReason::Truncated, vec![]));
    cases.push(("empty", vec![], DropReason::Truncated, vec![]));
    let mut m = rep.clone();
    m[0] = 2;
    cases.push(("base version", m, DropReason::BadBaseVersion, vec![]));
    let mut m = rep.clone();
    m[1] = 0x04;
    cases.push(("class", m, DropReason::NotCmClass, vec![]));
    let mut m = rep.clone();
    m[2] = 1;
    cases.push(("class version", m, DropReason::BadClassVersion, vec![]));
    let mut m = rep.clone();
    m[3] = 0x83;
    cases.push(("response method", m, DropReason::NotSend, vec![]));
    for attr in [0x0001u16, 0x0017, 0x0018, 0x0019, 0x001a, 0x7777] {
        let mut m = rep.clone();
        m[16..18].copy_from_slice(&attr.to_be_bytes());
        cases.push(("attribute", m, DropReason::UnsupportedAttribute, vec![]));
    }
    // REJ with a reject-info length beyond the ARI.
    let mut m = rep.clone();
    m[16..18].copy_from_slice(&attribute::REJ.to_be_bytes());
    m[24 + 9] = 73 << 1;
    cases.push(("ARI length", m, DropReason::MalformedField, vec![]));
    // MRA of the reserved message kind 3.
    let mut m = rep.clone();
    m[16..18].copy_from_slice(&attribute::MRA.to_be_bytes());
    m[24 + 8] = 0xc0;
    cases.push(("MRA kind", m, DropReason::MalformedField, vec![]));
    // A duplicate REP from the wrong port.
    cases.push(("peer", rep.clone(), DropReason::WrongPeer, vec![]));
    // A REP whose sender comm ID is not B's.
    let mut m = rep.clone();
    set_be32(&mut m, 24, 0x1234_5678);
    cases.push(("sender comm ID", m, DropReason::CommIdMismatch, vec![]));
    // A REP with another transaction ID.
    let mut m = rep.clone();
    m[15] ^= 1;
    cases.push(("TID", m, DropReason::TidMismatch, vec![]));
    // A REP for a connection A never had: REJ(invalid comm ID).
    let mut m = rep.clone();
    set_be32(&mut m, 28, 0x0bad_0bad);
    cases.push((
        "unknown REP",
        m,
        DropReason::UnknownConnection,
        vec!["REJ(6)"],
    ));
    // A DREQ naming a connection A never had: DREP, so the peer can stop.
    let mut m = vec![0u8; 256];
    CmMadRepr {
        transaction_id: 9,
        attribute_modifier: 0,
        message: CmMessage::Dreq(CmDreqRepr {
            local_comm_id: 1,
            remote_comm_id: 0x0bad_0bad,
            remote_qpn: qpn(0x100),
            private_data: &[],
        }),
    }
    .emit(&mut m)
    .unwrap();
    cases.push((
        "unknown DREQ",
        m.clone(),
        DropReason::UnknownConnection,
        vec!["DREP"],
    ));
    // A DREQ for A's connection naming another QP.
    let comm_a = f.net.sides[A].cm.local_comm_id(f.a).unwrap();
    let comm_b = f.net.sides[B].cm.local_comm_id(f.b).unwrap();
    CmMadRepr {
        transaction_id: 9,
        attribute_modifier: 0,
        message: CmMessage::Dreq(CmDreqRepr {
            local_comm_id: comm_b,
            remote_comm_id: comm_a,
            remote_qpn: qpn(0x101),
            private_data: &[],
        }),
    }
    .emit(&mut m)
    .unwrap();
    cases.push(("DREQ QPN", m, DropReason::QpnMismatch, vec![]));
    // An RTU to the active side: RTUs go to the passive side only.
    let mut m = vec![0u8; 256];
    CmMadRepr {
        transaction_id: be(&rep),
        attribute_modifier: 0,
        message: CmMessage::Rtu(CmRtuRepr {
            local_comm_id: comm_b,
            remote_comm_id: comm_a,
            private_data: &[],
        }),
    }
    .emit(&mut m)
    .unwrap();
    cases.push(("RTU to active", m, DropReason::UnexpectedInState, vec![]));
    // A's own RTU reflected back names B's comm ID: unknown at A.
    cases.push((
        "reflected RTU",
        f.rtu.clone(),
        DropReason::UnknownConnection,
        vec![],
    ));
    // An MRA of "other" (LAP): nothing this CM sent.
    let mut m = vec![0u8; 256];
    CmMadRepr {
        transaction_id: be(&rep),
        attribute_modifier: 0,
        message: CmMessage::Mra(CmMraRepr {
            local_comm_id: comm_b,
            remote_comm_id: comm_a,
            message_mraed: CmMessageKind::Other,
            service_timeout: IbTimeout::new(3).unwrap(),
            private_data: &[],
        }),
    }
    .emit(&mut m)
    .unwrap();
    cases.push(("MRA other", m, DropReason::UnexpectedInState, vec![]));

    let stranger = MadAddress::cm(Gid::from_ipv4(Ipv4Address::new(10, 9, 9, 9)));
    let mut expected_counts = [0u64; DropReason::COUNT];
    let mut traced = Vec::new();
    for (name, mad, reason, answer) in cases {
        let from = if name == "peer" { stranger } else { from_b };
        let (drops, sent) = f.deliver(A, from, &mad);
        traced.extend(f.net.sides[A].rec.drops.iter().copied());
        assert_eq!(drops, vec![reason], "{name}");
        assert_eq!(sent, answer, "{name}");
        expected_counts[reason.index()] += 1;
        f.unchanged();
    }
    assert_eq!(f.net.sides[A].cm.stats().dropped, expected_counts);
    // The trace hook saw the header fields, and the connection when the
    // MAD was matched to one.
    let drops = &traced;
    let tid = drops
        .iter()
        .find(|d| d.reason == DropReason::TidMismatch)
        .unwrap();
    assert_eq!(tid.attribute_id, attribute::REP);
    assert_eq!(tid.transaction_id, be(&rep) ^ 1);
    assert_eq!(tid.from, from_b);
    assert_eq!(tid.local_comm_id, Some(comm_a));
    let short = drops
        .iter()
        .find(|d| d.reason == DropReason::Truncated)
        .unwrap();
    assert_eq!(short.local_comm_id, None);
}

fn be(m: &[u8]) -> u64 {
    u64::from_be_bytes(m[8..16].try_into().unwrap())
}

#[test]
fn req_with_reserved_mtu_is_rejected_26() {
    let mut f = fixture();
    let mut pd = [0u8; 92];
    endpoints().req_private_data(&[], &mut pd).unwrap();
    let mut m = vec![0u8; 256];
    CmMadRepr {
        transaction_id: 77,
        attribute_modifier: 0,
        message: CmMessage::Req(table::req_repr(
            0x4444,
            0x999,
            1,
            endpoints().path(IbTimeout::new(9).unwrap()),
            &pd,
        )),
    }
    .emit(&mut m)
    .unwrap();
    m[24 + 50] = (m[24 + 50] & 0x0f) | (7 << 4);
    let from_a = f.from(A);
    let (drops, sent) = f.deliver(B, from_a, &m);
    assert_eq!(drops, vec![DropReason::MalformedField]);
    assert_eq!(sent, vec!["REJ(26)"]);
    f.unchanged();
}

#[test]
fn requests_this_port_cannot_serve_are_rejected_with_the_reason() {
    let mut f = fixture();
    let from_a = f.from(A);
    let mut pd = [0u8; 92];
    endpoints().req_private_data(&[], &mut pd).unwrap();
    let path = endpoints().path(IbTimeout::new(9).unwrap());
    let base = table::req_repr(0x4444, 0x999, 1, path, &pd);
    let mut bad_cma = pd;
    bad_cma[0] = 1;
    let mut wrong_dst = pd;
    wrong_dst[35] = 9;
    let cases: Vec<(CmReqRepr<'_>, &str)> = vec![
        (
            CmReqRepr {
                transport_service_type: TransportServiceType::Uc,
                ..base
            },
            "REJ(9)",
        ),
        (
            CmReqRepr {
                path_mtu: PathMtu::Mtu2048,
                ..base
            },
            "REJ(26)",
        ),
        (
            CmReqRepr {
                primary_path: CmPathRepr {
                    remote_gid: Gid::from_ipv4(Ipv4Address::new(10, 0, 0, 7)),
                    ..path
                },
                ..base
            },
            "REJ(12)",
        ),
        (
            CmReqRepr {
                private_data: &bad_cma,
                ..base
            },
            "REJ(28)",
        ),
        (
            CmReqRepr {
                private_data: &wrong_dst,
                ..base
            },
            "REJ(28)",
        ),
        (
            CmReqRepr {
                service_id: ServiceId(0x1234),
                ..base
            },
            "REJ(8)",
        ),
    ];
    for (i, (req, answer)) in cases.into_iter().enumerate() {
        let mut m = vec![0u8; 256];
        let req = CmReqRepr {
            local_comm_id: 0x5000 + u32::try_from(i).unwrap(),
            local_qpn: qpn(0x900 + u32::try_from(i).unwrap()),
            ..req
        };
        CmMadRepr {
            transaction_id: 100 + u64::try_from(i).unwrap(),
            attribute_modifier: 0,
            message: CmMessage::Req(req),
        }
        .emit(&mut m)
        .unwrap();
        let (drops, sent) = f.deliver(B, from_a, &m);
        assert!(drops.is_empty(), "{answer}");
        assert_eq!(sent, vec![answer]);
        // The REJ names the REQ: its comm ID and transaction ID.
        f.unchanged();
    }
    assert_eq!(
        f.net.sides[B].rec.lev.len(),
        1,
        "no request reached the listener"
    );
    assert_eq!(f.net.sides[B].cm.connections_in_use(), 1);
}

#[test]
fn mutated_mads_never_panic_and_are_accounted_for() {
    let iterations = std::env::var("KVERBS_CM_MUTATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000usize);
    let mut rng = fastrand::Rng::with_seed(0xc0ffee);
    let mut f = fixture();
    let templates: Vec<Vec<u8>> = f.net.captured.iter().map(|(_, m)| m.clone()).collect();
    let mut received = 0;
    for _ in 0..iterations {
        let mut m = templates[rng.usize(..templates.len())].clone();
        match rng.u8(..4) {
            0 => {
                for _ in 0..rng.usize(1..8) {
                    let i = rng.usize(..m.len());
                    m[i] = rng.u8(..);
                }
            }
            1 => m.truncate(rng.usize(..m.len())),
            2 => {
                // Keep the header valid, scramble one field-sized chunk.
                let at = rng.usize(24..252);
                for b in &mut m[at..at + 4] {
                    *b = rng.u8(..);
                }
            }
            _ => {
                m = (0..rng.usize(..300)).map(|_| rng.u8(..)).collect();
            }
        }
        let to = rng.usize(..2);
        let from = f.from(1 - to);
        let side = &mut f.net.sides[to];
        side.cm.on_mad(f.net.now, &from, &m, &mut side.rec);
        received += 1;
        // Let the consequences play out (a mutation may legitimately end
        // the connection).
        f.net.pump();
    }
    let total: u64 = f.net.sides.iter().map(|s| s.cm.stats().received).sum();
    assert!(total >= received);
    for s in &f.net.sides {
        assert_eq!(s.cm.stats().dropped_total(), s.rec.drops.len() as u64);
        assert_eq!(s.cm.stats().emit_failures, 0);
    }
    f.net.check_contract();
    // Whatever happened, tearing down and waiting frees every slot.
    for (s, id) in [(A, f.a), (B, f.b)] {
        let side = &mut f.net.sides[s];
        let _ = side.cm.disconnect(f.net.now, id, &[], &mut side.rec);
    }
    f.net.pump();
    f.net.settle(FOREVER);
    for s in &f.net.sides {
        assert_eq!(s.cm.connections_in_use(), 0);
    }
    f.net.check_contract();
}
