//! Golden tests over iSER, captured at the target side
//! ([`IserTargetConfig::capture`](kverbs_tools::iser_target::IserTargetConfig)):
//! the login exchange over RDMA — the exact key=value text of each Login
//! Request, the BHS fields, and the target's answers applied by the
//! engine — and the command PDUs as sent: the iSER header (WSV/RSV, STags,
//! VAs), the BHS (ITT, CmdSN, ExpStatSN, EDTL, flags, CDB), immediate data,
//! unsolicited Data-Out offsets, and the RDMA operations the header led
//! the target to (write VA past the unsolicited data, no offset added;
//! remote invalidation of the command's STag).

use kverbs::irql::Passive;
use kverbs::platform::host::VerifierAllocator;
use kverbs_tests::iser::{INITIATOR_NAME, IserSetup, IserStack, IserStackConfig};
use kverbs_tests::{Workload, rw_cdb};
use kverbs_tools::iser_target::Captured;
use storport_srp::storport::SrbStatus;
use storport_srp::storport::host::SgShape;
use storport_srp::wire::iscsi::{
    BhsRepr, DataOutRepr, IscsiPdu, LoginRequestRepr, LoginResponseRepr, LoginStage,
    ScsiCommandRepr, SerialNumber, TaskAttr,
};
use storport_srp::wire::iser::{HEADER_LEN, IserCtrlRepr, IserHeader};

#[global_allocator]
static ALLOCATOR: VerifierAllocator = VerifierAllocator;

const TARGET_NAME: &str = "iqn.2003-01.org.kverbs:disk";

/// One captured PDU, parsed.
struct Pdu {
    sent_by_target: bool,
    iser: IserCtrlRepr,
    bhs: BhsRepr,
    data: Vec<u8>,
    invalidate: Option<u32>,
}

fn parse(bytes: &[u8], sent_by_target: bool, invalidate: Option<u32>) -> Pdu {
    let iser = IserCtrlRepr::parse(&IserHeader::new_checked(bytes).unwrap()).unwrap();
    let pdu = IscsiPdu::parse(&bytes[HEADER_LEN..]).unwrap();
    assert!(pdu.ahs.is_empty(), "no AHS for a 10-byte CDB");
    Pdu {
        sent_by_target,
        iser,
        bhs: pdu.header,
        data: pdu.data.to_vec(),
        invalidate,
    }
}

fn pdus(captured: &[Captured]) -> Vec<Pdu> {
    captured
        .iter()
        .filter_map(|c| match c {
            Captured::Received { pdu, .. } => Some(parse(pdu, false, None)),
            Captured::Sent {
                pdu, invalidate, ..
            } => Some(parse(pdu, true, *invalidate)),
            _ => None,
        })
        .collect()
}

fn text(data: &[u8]) -> String {
    String::from_utf8(data.to_vec())
        .unwrap()
        .replace('\0', "\n")
}

fn captured_stack(setup: IserSetup) -> IserStackConfig {
    let mut setup = setup;
    setup.config.capture = true;
    IserStackConfig {
        targets: vec![setup],
        ..IserStackConfig::default()
    }
}

fn login_request(p: &Pdu) -> LoginRequestRepr {
    assert!(!p.sent_by_target);
    match p.bhs {
        BhsRepr::LoginRequest(r) => r,
        ref other => panic!("not a login request: {other:?}"),
    }
}

fn login_response(p: &Pdu) -> LoginResponseRepr {
    assert!(p.sent_by_target);
    match p.bhs {
        BhsRepr::LoginResponse(r) => r,
        ref other => panic!("not a login response: {other:?}"),
    }
}

#[test]
fn login_exchange_over_rdma() {
    IserStack::run(&captured_stack(IserSetup::standard()), |s, p| {
        let all = pdus(&s.target(0).captured());
        // Two round trips, one PDU at a time, then nothing before full
        // feature phase.
        assert!(all.len() >= 4);
        for pdu in &all[..4] {
            assert_eq!(pdu.iser, IserCtrlRepr::default(), "no STag in a login PDU");
            assert_eq!(pdu.invalidate, None);
        }
        let (req1, rsp1, req2, rsp2) = (&all[0], &all[1], &all[2], &all[3]);
        let r1 = login_request(req1);
        assert_eq!(r1.current_stage, LoginStage::SecurityNegotiation);
        assert_eq!(r1.next_stage, Some(LoginStage::OperationalNegotiation));
        assert!(!r1.continues);
        assert_eq!((r1.version_max, r1.version_min), (0, 0));
        assert_eq!(r1.isid[0] & 0xC0, 0x80, "ISID type: random");
        assert_eq!(r1.tsih, 0, "a new session");
        assert_eq!(r1.cid, 0);
        assert_eq!(r1.cmd_sn, SerialNumber(1));
        assert_eq!(r1.exp_stat_sn, SerialNumber(0));
        assert_eq!(
            text(&req1.data),
            format!(
                "InitiatorName={INITIATOR_NAME}\nSessionType=Normal\nTargetName={TARGET_NAME}\n\
                 AuthMethod=None\n"
            )
        );
        let a1 = login_response(rsp1);
        assert_eq!((a1.status_class, a1.status_detail), (0, 0));
        assert_eq!(a1.itt, r1.itt);

        let r2 = login_request(req2);
        assert_eq!(r2.current_stage, LoginStage::OperationalNegotiation);
        assert_eq!(r2.next_stage, Some(LoginStage::FullFeature));
        assert_eq!(r2.isid, r1.isid);
        assert_eq!(r2.tsih, 0);
        assert_eq!(r2.itt, r1.itt, "one task for the whole login");
        assert_eq!(
            r2.cmd_sn,
            SerialNumber(1),
            "login PDUs do not advance CmdSN"
        );
        assert_eq!(
            r2.exp_stat_sn,
            SerialNumber(a1.stat_sn.0.wrapping_add(1)),
            "acknowledges the first response"
        );
        // iSER (RFC 7145 §6.3): RDMAExtensions=Yes, the RDSL keys instead
        // of MaxRecvDataSegmentLength, no digests, ERL 0,
        // MaxOutstandingUnexpectedPDUs; FirstBurstLength capped to what
        // the engine copies into its send buffer.
        assert_eq!(
            text(&req2.data),
            "HeaderDigest=None\nDataDigest=None\nMaxConnections=1\nInitialR2T=No\n\
             ImmediateData=Yes\nMaxBurstLength=16776192\nFirstBurstLength=16384\n\
             DefaultTime2Wait=2\nDefaultTime2Retain=0\nMaxOutstandingR2T=1\n\
             DataPDUInOrder=Yes\nDataSequenceInOrder=Yes\nErrorRecoveryLevel=0\n\
             RDMAExtensions=Yes\nInitiatorRecvDataSegmentLength=8192\n\
             TargetRecvDataSegmentLength=8192\nMaxOutstandingUnexpectedPDUs=0\n"
        );
        let a2 = login_response(rsp2);
        assert_eq!((a2.status_class, a2.status_detail), (0, 0));
        assert_ne!(a2.tsih, 0);
        let answers = text(&rsp2.data);
        assert!(answers.contains("InitialR2T=Yes\n"), "{answers}");
        assert!(answers.contains("MaxBurstLength=262144\n"), "{answers}");
        assert!(
            answers.contains("MaxOutstandingUnexpectedPDUs=NotUnderstood\n"),
            "{answers}"
        );
        // The answers applied.
        let neg = s.transport().negotiated(0, p).unwrap();
        assert_eq!(neg.tsih, a2.tsih);
        assert!(neg.initial_r2t, "InitialR2T: Yes wins (OR)");
        assert!(neg.immediate_data);
        assert_eq!(neg.max_burst_length, 262_144, "the smaller burst");
        assert_eq!(neg.first_burst_length, 16_384);
        assert_eq!(neg.max_recv_data_segment, 8192);
        assert_eq!(neg.max_send_data_segment, 8192);
        assert_eq!(
            neg.max_outstanding_unexpected_pdus, None,
            "NotUnderstood tolerated"
        );
        assert_eq!(neg.exp_stat_sn, SerialNumber(a2.stat_sn.0.wrapping_add(1)));
        assert_eq!(neg.max_cmd_sn, a2.max_cmd_sn);
        // Nothing else was sent before the session was up.
        assert!(
            all.get(4)
                .is_none_or(|p| !matches!(p.bhs, BhsRepr::LoginRequest(_)))
        );
    });
}

/// The SCSI Command PDUs, Data-Out PDUs and RDMA operations of `itt`.
struct CommandTrace {
    iser: IserCtrlRepr,
    cmd: ScsiCommandRepr,
    immediate: Vec<u8>,
    data_outs: Vec<(DataOutRepr, Vec<u8>)>,
    reads: Vec<(u64, u32, u32)>,
    writes: Vec<(u64, u32, u32)>,
    response_invalidate: Option<u32>,
}

fn trace(captured: &[Captured], index: usize) -> CommandTrace {
    let commands: Vec<(IserCtrlRepr, ScsiCommandRepr, Vec<u8>)> = captured
        .iter()
        .filter_map(|c| match c {
            Captured::Received { pdu, .. } => {
                let p = parse(pdu, false, None);
                match p.bhs {
                    BhsRepr::ScsiCommand(cmd) => Some((p.iser, cmd, p.data)),
                    _ => None,
                }
            }
            _ => None,
        })
        .collect();
    let (iser, cmd, immediate) = commands[index].clone();
    let itt = cmd.itt;
    let mut t = CommandTrace {
        iser,
        cmd,
        immediate,
        data_outs: Vec::new(),
        reads: Vec::new(),
        writes: Vec::new(),
        response_invalidate: None,
    };
    for c in captured {
        match c {
            Captured::Received { pdu, .. } => {
                let p = parse(pdu, false, None);
                if let BhsRepr::DataOut(d) = p.bhs {
                    if d.itt == itt {
                        t.data_outs.push((d, p.data));
                    }
                }
            }
            Captured::Sent {
                pdu, invalidate, ..
            } => {
                let p = parse(pdu, true, *invalidate);
                if let BhsRepr::ScsiResponse(r) = p.bhs {
                    if r.itt == itt {
                        t.response_invalidate = *invalidate;
                    }
                }
            }
            Captured::RdmaRead {
                itt: i,
                remote_addr,
                rkey,
                len,
                ..
            } if *i == itt => t.reads.push((*remote_addr, *rkey, *len)),
            Captured::RdmaWrite {
                itt: i,
                remote_addr,
                rkey,
                len,
                ..
            } if *i == itt => t.writes.push((*remote_addr, *rkey, *len)),
            _ => {}
        }
    }
    t
}

fn write_ok(s: &IserStack, lba: u64, data: &[u8], p: &Passive<'_>) {
    let o = s.write(0, 0, lba, data, SgShape::Pages, p);
    assert_eq!(o.status.base(), SrbStatus::SUCCESS, "{o:?}");
    assert_eq!(s.medium(0, 0, lba, data.len() as u64 / 512), data);
}

#[test]
fn command_pdus_as_sent() {
    IserStack::run(&captured_stack(IserSetup::standard()), |s, p| {
        let mut w = Workload::new(3);
        let big = w.bytes(65536);
        let small = w.bytes(4096);
        s.target(0).start_capture();
        write_ok(s, 8, &big, p);
        write_ok(s, 200, &small, p);
        let (o, back) = s.read(0, 0, 8, 16, SgShape::Contiguous, p);
        assert_eq!(o.status.base(), SrbStatus::SUCCESS);
        assert_eq!(back, big[..8192]);
        let (o, _) = s.read(0, 0, 8, 16, SgShape::Contiguous, p);
        assert_eq!(o.status.base(), SrbStatus::SUCCESS);
        let cap = s.target(0).captured();
        let neg = s.transport().negotiated(0, p).unwrap();
        let [w1, w2, r1, r2] = [0, 1, 2, 3].map(|i| trace(&cap, i));

        // CmdSN runs from the login's, ExpStatSN follows the responses.
        for (i, t) in [&w1, &w2, &r1, &r2].iter().enumerate() {
            assert_eq!(t.cmd.cmd_sn, SerialNumber(1 + i as u32));
            assert!(!t.cmd.immediate, "not immediate delivery");
            assert!(t.cmd.is_final, "no unsolicited Data-Out (InitialR2T=Yes)");
            assert_eq!(t.cmd.attr, TaskAttr::Simple);
            assert_eq!(t.cmd.lun.0, [0; 8]);
            assert!(t.data_outs.is_empty());
        }
        assert_eq!(w1.cmd.exp_stat_sn, neg.exp_stat_sn);
        for pair in [[&w1, &w2], [&w2, &r1], [&r1, &r2]] {
            assert_eq!(pair[1].cmd.exp_stat_sn.0, pair[0].cmd.exp_stat_sn.0 + 1);
        }
        let itts = [w1.cmd.itt, w2.cmd.itt, r1.cmd.itt, r2.cmd.itt];
        assert!(itts.iter().all(|i| *i != 0xFFFF_FFFF));
        for (i, a) in itts.iter().enumerate() {
            assert!(!itts[i + 1..].contains(a), "ITTs unique: {itts:x?}");
        }

        // A 64 KiB WRITE: immediate data up to the smaller of
        // FirstBurstLength and the target's RDSL; the rest fetched by RDMA
        // READ from the write STag at a VA past the immediate data.
        assert!((w1.cmd.write, w1.cmd.read) == (true, false));
        assert_eq!(w1.cmd.expected_data_len, 65536);
        let cdb = rw_cdb(false, 8, 128);
        assert_eq!(&w1.cmd.cdb[..cdb.len()], &cdb[..]);
        assert!(w1.cmd.cdb[cdb.len()..].iter().all(|b| *b == 0));
        assert_eq!(w1.immediate.len(), 8192);
        assert_eq!(w1.immediate, big[..8192]);
        let ws = w1.iser.write.expect("WSV");
        assert_eq!(w1.iser.read, None, "no RSV on a WRITE");
        assert_eq!(
            w1.reads,
            vec![(ws.va, ws.stag, 65536 - 8192)],
            "isert adds no offset"
        );
        assert!(w1.writes.is_empty());
        assert_eq!(w1.response_invalidate, Some(ws.stag));
        // A 4 KiB WRITE travels whole as immediate data: nothing to fetch,
        // so no STag is advertised (as `iser_prepare_write_cmd`).
        assert_eq!(w2.immediate, small);
        assert_eq!(w2.cmd.expected_data_len, 4096);
        assert_eq!(w2.iser, IserCtrlRepr::default(), "no WSV");
        assert!(w2.reads.is_empty());
        assert_eq!(w2.response_invalidate, None, "nothing to invalidate");
        // READs: RSV with the read STag at the buffer's VA; the target
        // writes there and invalidates that STag with its response. The
        // same slot's key is rotated.
        for r in [&r1, &r2] {
            assert!((r.cmd.write, r.cmd.read) == (false, true));
            assert_eq!(r.cmd.expected_data_len, 8192);
            assert_eq!(&r.cmd.cdb[..10], &rw_cdb(true, 8, 16)[..]);
            assert!(r.immediate.is_empty());
            let rs = r.iser.read.expect("RSV");
            assert_eq!(r.iser.write, None);
            assert_eq!(r.writes, vec![(rs.va, rs.stag, 8192)]);
            assert_eq!(r.response_invalidate, Some(rs.stag));
        }
        let (k1, k2) = (r1.iser.read.unwrap().stag, r2.iser.read.unwrap().stag);
        assert_ne!(k1, k2, "a fresh key per I/O");
        assert_ne!(ws.stag, k1);
    });
}

#[test]
fn unsolicited_data_out_offsets_follow_the_answers() {
    // The target answers InitialR2T=No and FirstBurstLength=12288:
    // immediate data is 8 KiB (the target's RDSL), one unsolicited
    // Data-Out PDU of 4 KiB follows up to the first burst, the rest is
    // fetched by RDMA READ from past it.
    let mut setup = IserSetup::standard();
    setup.config.iscsi.values.initial_r2t = false;
    setup.config.iscsi.values.first_burst_length = 12_288;
    setup.config.iscsi.values.max_burst_length = 131_072;
    IserStack::run(&captured_stack(setup), |s, p| {
        let neg = s.transport().negotiated(0, p).unwrap();
        assert!(!neg.initial_r2t);
        assert_eq!(neg.first_burst_length, 12_288);
        assert_eq!(neg.max_send_data_segment, 8192);
        assert_eq!(neg.max_burst_length, 131_072);
        let data = Workload::new(4).bytes(65536);
        s.target(0).start_capture();
        write_ok(s, 64, &data, p);
        let t = trace(&s.target(0).captured(), 0);
        assert!(!t.cmd.is_final, "unsolicited Data-Out PDUs follow");
        assert_eq!(t.immediate, data[..8192]);
        let offsets: Vec<(u32, usize)> = t
            .data_outs
            .iter()
            .map(|(d, payload)| (d.buffer_offset, payload.len()))
            .collect();
        assert_eq!(offsets, vec![(8192, 4096)]);
        for (i, (d, payload)) in t.data_outs.iter().enumerate() {
            assert_eq!(d.itt, t.cmd.itt);
            assert_eq!(d.ttt, 0xFFFF_FFFF, "unsolicited");
            assert_eq!(d.data_sn, SerialNumber(i as u32));
            assert!(d.is_final, "F on the last of the burst");
            assert_eq!(d.lun, t.cmd.lun);
            let off = d.buffer_offset as usize;
            assert_eq!(payload[..], data[off..off + payload.len()]);
        }
        let ws = t.iser.write.expect("WSV");
        assert_eq!(t.reads, vec![(ws.va, ws.stag, 65536 - 12_288)]);
        let st = s.stats(0, p);
        assert_eq!(st.data_out_pdus, 1, "{st:?}");
    });
}
