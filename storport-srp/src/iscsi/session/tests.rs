use super::*;
use crate::iscsi::login::AuthOutcome;
use crate::storport::DataAccessError;
use crate::wire::iscsi::{
    AsyncMessageRepr, NopInRepr, RejectRepr, ScsiResponseRepr, TaskMgmtResponseRepr,
};
use kverbs::platform::host::HostPlatform;

fn negotiated() -> Negotiated {
    Negotiated {
        tsih: 1,
        tpgt: Some(1),
        auth: AuthOutcome::None,
        max_send_data_segment: 8192,
        max_recv_data_segment: 8192,
        immediate_data: true,
        initial_r2t: true,
        first_burst_length: 65536,
        max_burst_length: 262_144,
        default_time2wait: 2,
        default_time2retain: 0,
        max_outstanding_r2t: 1,
        max_outstanding_unexpected_pdus: None,
        cmd_sn: SerialNumber(0x10),
        exp_cmd_sn: SerialNumber(0x10),
        max_cmd_sn: SerialNumber(0x11),
        exp_stat_sn: SerialNumber(0x500),
    }
}

fn session(neg: &Negotiated) -> Session {
    let timeouts = Timeouts {
        noop_out_interval: 0,
        ..Timeouts::default()
    };
    HostPlatform::new()
        .run_passive(|p| Session::new(neg, &timeouts, 4, 0, Millis(0), p))
        .unwrap()
}

struct Data(Vec<u8>);

impl ImmediateData for Data {
    fn read(&self, offset: u32, out: &mut [u8]) -> Result<(), DataAccessError> {
        let start = offset as usize;
        out.copy_from_slice(
            self.0
                .get(start..start + out.len())
                .ok_or(DataAccessError::OutOfBounds)?,
        );
        Ok(())
    }
}

#[derive(Default)]
struct Events {
    done: Vec<(Tag, CommandOutcome, Residual, Vec<u8>)>,
    tmfs: Vec<(Tag, TmfResponse)>,
    opened: u32,
}

impl SessionEvents for Events {
    fn command_done(&mut self, tag: Tag, r: &CommandResult<'_>) {
        self.done
            .push((tag, r.outcome, r.residual, r.sense.to_vec()));
    }
    fn tmf_done(&mut self, tag: Tag, response: TmfResponse) {
        self.tmfs.push((tag, response));
    }
    fn window_open(&mut self) {
        self.opened += 1;
    }
}

fn lun0() -> Lun {
    Lun::from_index(0).unwrap()
}

/// A TEST UNIT READY with tag `tag`: a command with no data.
fn tur(tag: u32) -> CommandSpec<'static> {
    CommandSpec {
        tag: Tag(tag),
        lun: lun0(),
        cdb: &[0; 6],
        direction: DataDirection::None,
        transfer_length: 0,
        attr: TaskAttr::Simple,
        immediate_delivery: false,
    }
}

fn write10(tag: u32, len: u32) -> ([u8; 10], CommandSpec<'static>) {
    let cdb = [0x2A, 0, 0, 0, 0, 0x10, 0, 0, (len / 512) as u8, 0];
    let leaked: &'static [u8] = Box::leak(Box::new(cdb));
    (
        cdb,
        CommandSpec {
            tag: Tag(tag),
            lun: lun0(),
            cdb: leaked,
            direction: DataDirection::Out,
            transfer_length: len,
            attr: TaskAttr::Simple,
            immediate_delivery: false,
        },
    )
}

fn pdu(header: BhsRepr, data: &[u8]) -> std::vec::Vec<u8> {
    let p = IscsiPdu {
        header,
        ahs: &[],
        data,
    };
    let mut buf = vec![0u8; p.buffer_len(Padding::None)];
    p.emit(&mut buf, Padding::None).unwrap();
    buf
}

fn response(itt: u32, stat_sn: u32, status: u8, max: u32, sense: &[u8]) -> std::vec::Vec<u8> {
    let mut data = vec![
        0u8;
        SenseData {
            sense,
            response_data: &[]
        }
        .buffer_len()
    ];
    SenseData {
        sense,
        response_data: &[],
    }
    .emit(&mut data)
    .unwrap();
    pdu(
        BhsRepr::ScsiResponse(ScsiResponseRepr {
            response: 0,
            status,
            residual: WireResidual::Underflow(8),
            bidi_read_residual: WireResidual::None,
            itt,
            snack_tag: 0,
            stat_sn: SerialNumber(stat_sn),
            exp_cmd_sn: SerialNumber(0x11),
            max_cmd_sn: SerialNumber(max),
            exp_data_sn: 0,
        }),
        &data,
    )
}

/// A SCSI Command with 1 KiB of immediate data, byte for byte.
#[test]
fn golden_scsi_command_with_immediate_data() {
    let neg = negotiated();
    let mut s = session(&neg);
    let (_, spec) = write10(7, 1024);
    let data = Data((0..1024u32).map(|i| i as u8).collect());
    let mut buf = [0u8; 2048];
    let prepared = s
        .prepare_command(Millis(0), &spec, &data, &mut buf)
        .unwrap();
    assert_eq!(prepared.itt(), 0x0000_0000);
    assert_eq!(
        (prepared.immediate_len(), prepared.unsolicited_len()),
        (1024, 1024)
    );
    assert_eq!(prepared.pdu_len(), 48 + 1024);
    let posted = s.post_command(Millis(0), prepared, &mut buf).unwrap();
    assert_eq!(posted.cmd_sn, SerialNumber(0x10));
    let expected: [u8; 48] = [
        0x01, 0xA1, 0, 0, // SCSI Command; F | W | SIMPLE
        0, 0, 0x04, 0x00, // no AHS; 1024 bytes of data
        0, 0, 0, 0, 0, 0, 0, 0, // LUN 0
        0, 0, 0, 0, // ITT
        0, 0, 0x04, 0x00, // EDTL 1024
        0, 0, 0, 0x10, // CmdSN
        0, 0, 0x05, 0x00, // ExpStatSN
        0x2A, 0, 0, 0, 0, 0x10, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, // CDB
    ];
    assert_eq!(&buf[..48], &expected);
    assert_eq!(&buf[48..48 + 1024], data.0.as_slice());
    assert_eq!(s.cmd_sn(), SerialNumber(0x11));
}

/// The header-only build is the same PDU without its data: its
/// DataSegmentLength counts the immediate data the caller sends behind it,
/// and it writes nothing past the header (a buffer just that long will do).
#[test]
fn command_header_alone_matches_the_whole_pdu() {
    let neg = negotiated();
    let (_, spec) = write10(7, 1024);
    let data = Data((0..1024u32).map(|i| i as u8).collect());
    let mut whole = [0u8; 2048];
    let mut a = session(&neg);
    let full = a
        .prepare_command(Millis(0), &spec, &data, &mut whole)
        .unwrap();
    let mut b = session(&neg);
    let mut header = [0xEEu8; 48];
    let head = b
        .prepare_command_header(Millis(0), &spec, &mut header)
        .unwrap();
    assert_eq!(head.header_len(), 48);
    assert_eq!(full.header_len(), 48);
    assert_eq!(
        (head.pdu_len(), head.immediate_len(), head.unsolicited_len()),
        (full.pdu_len(), full.immediate_len(), full.unsolicited_len())
    );
    assert_eq!(header, whole[..48]);
    let a_posted = a.post_command(Millis(0), full, &mut whole).unwrap();
    let b_posted = b.post_command(Millis(0), head, &mut header).unwrap();
    assert_eq!(a_posted, b_posted);
    assert_eq!(header, whole[..48], "CmdSN and ExpStatSN stamped alike");
    // A buffer shorter than the header is refused.
    let mut short = [0u8; 47];
    let (_, again) = write10(8, 1024);
    assert!(
        b.prepare_command_header(Millis(0), &again, &mut short)
            .is_err()
    );
}

/// The NOP-Out that answers a target ping, byte for byte.
#[test]
fn golden_nop_out_answer() {
    let mut s = session(&negotiated());
    let mut ev = Events::default();
    let ping = pdu(
        BhsRepr::NopIn(NopInRepr {
            lun: Lun::from_index(3).unwrap(),
            itt: RESERVED_TAG,
            ttt: 0xABCD_0001,
            stat_sn: SerialNumber(0x500),
            exp_cmd_sn: SerialNumber(0x10),
            max_cmd_sn: SerialNumber(0x11),
        }),
        &[],
    );
    s.handle_pdu(Millis(1), &ping, &mut ev).unwrap();
    assert_eq!(
        s.exp_stat_sn(),
        SerialNumber(0x500),
        "unsolicited: no StatSN"
    );
    let mut buf = [0u8; 64];
    let len = s.poll_transmit(Millis(1), &mut buf).unwrap();
    let expected: [u8; 48] = [
        0x40, 0x80, 0, 0, 0, 0, 0, 0, // I | NOP-Out, F
        0, 3, 0, 0, 0, 0, 0, 0, // LUN copied
        0xFF, 0xFF, 0xFF, 0xFF, // ITT reserved: no reply wanted
        0xAB, 0xCD, 0, 1, // TTT copied
        0, 0, 0, 0x10, // CmdSN (not advanced)
        0, 0, 0x05, 0x00, // ExpStatSN
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    ];
    assert_eq!(&buf[..len], &expected);
    assert_eq!(s.pings_answered(), 1);
    assert_eq!(s.poll_transmit(Millis(1), &mut buf), None);
    assert_eq!(s.pings_answered(), 1, "counted once");
}

/// ABORT TASK, byte for byte, and its completion order.
#[test]
fn golden_abort_task() {
    let mut s = session(&negotiated());
    let mut ev = Events::default();
    let (_, spec) = write10(9, 512);
    let mut buf = [0u8; 1024];
    let p = s
        .prepare_command(Millis(0), &spec, &Data(vec![0; 512]), &mut buf)
        .unwrap();
    let victim_itt = p.itt();
    s.post_command(Millis(0), p, &mut buf).unwrap();
    s.abort_task(Millis(0), Tag(50), Tag(9)).unwrap();
    let mut out = [0u8; 64];
    let len = s.poll_transmit(Millis(0), &mut out).unwrap();
    let tmf_itt = u32::from_be_bytes(out[16..20].try_into().unwrap());
    let mut expected = [0u8; 48];
    expected[0] = 0x42; // I | TMF
    expected[1] = 0x81; // F | ABORT TASK
    expected[16..20].copy_from_slice(&tmf_itt.to_be_bytes());
    expected[20..24].copy_from_slice(&victim_itt.to_be_bytes()); // RTT
    expected[24..28].copy_from_slice(&0x11u32.to_be_bytes()); // CmdSN
    expected[28..32].copy_from_slice(&0x500u32.to_be_bytes());
    expected[32..36].copy_from_slice(&0x10u32.to_be_bytes()); // RefCmdSN
    assert_eq!(&out[..len], &expected);
    let rsp = pdu(
        BhsRepr::TaskMgmtResponse(TaskMgmtResponseRepr {
            response: TaskMgmtResponseCode::Complete,
            itt: tmf_itt,
            stat_sn: SerialNumber(0x500),
            exp_cmd_sn: SerialNumber(0x11),
            max_cmd_sn: SerialNumber(0x11),
        }),
        &[],
    );
    s.handle_pdu(Millis(1), &rsp, &mut ev).unwrap();
    assert_eq!(
        ev.done,
        [(Tag(9), CommandOutcome::Aborted, Residual::None, vec![])]
    );
    assert_eq!(ev.tmfs, [(Tag(50), TmfResponse::Complete)]);
    // The victim's late response now names a freed ITT: a violation.
    let late = response(victim_itt, 0x501, 0, 0x11, &[]);
    assert_eq!(
        s.handle_pdu(Millis(2), &late, &mut ev),
        Err(SessionFailure::Protocol(Violation::UnknownItt(victim_itt)))
    );
}

#[test]
fn responses_sense_residual_and_window() {
    let mut s = session(&negotiated());
    let mut ev = Events::default();
    let tur = tur(1);
    let mut b1 = [0u8; 64];
    let mut b2 = [0u8; 64];
    let p1 = s
        .prepare_command(Millis(0), &tur, &Data(vec![]), &mut b1)
        .unwrap();
    let p2 = s
        .prepare_command(
            Millis(0),
            &CommandSpec { tag: Tag(2), ..tur },
            &Data(vec![]),
            &mut b2,
        )
        .unwrap();
    assert_eq!(s.window_room(), 0, "window 0x10..=0x11 reserved");
    assert_eq!(
        s.prepare_command(
            Millis(5),
            &CommandSpec { tag: Tag(3), ..tur },
            &Data(vec![]),
            &mut [0u8; 64]
        ),
        Err(PrepareError::Busy)
    );
    // An immediate command passes a closed window.
    let imm = s
        .prepare_command(
            Millis(5),
            &CommandSpec {
                tag: Tag(4),
                immediate_delivery: true,
                ..tur
            },
            &Data(vec![]),
            &mut [0u8; 64],
        )
        .unwrap();
    s.discard_command(imm);
    let itt1 = p1.itt();
    s.post_command(Millis(0), p1, &mut b1).unwrap();
    s.post_command(Millis(0), p2, &mut b2).unwrap();
    assert_eq!(u32::from_be_bytes(b2[24..28].try_into().unwrap()), 0x11);
    // A response that does not open the window (MaxCmdSN stays).
    let sense = [
        0x70, 0, 0x06, 0, 0, 0, 0, 0x0A, 0, 0, 0, 0, 0x29, 0, 0, 0, 0, 0,
    ];
    s.handle_pdu(Millis(6), &response(itt1, 0x500, 2, 0x11, &sense), &mut ev)
        .unwrap();
    assert_eq!(
        ev.done[0],
        (
            Tag(1),
            CommandOutcome::Scsi(2),
            Residual::Underrun(8),
            sense.to_vec()
        )
    );
    assert_eq!(ev.opened, 0);
    // MaxCmdSN below ExpCmdSN - 1 is ignored; then a real opening.
    let nop = |max: u32, exp: u32| {
        pdu(
            BhsRepr::NopIn(NopInRepr {
                lun: lun0(),
                itt: RESERVED_TAG,
                ttt: RESERVED_TAG,
                stat_sn: SerialNumber(0x501),
                exp_cmd_sn: SerialNumber(exp),
                max_cmd_sn: SerialNumber(max),
            }),
            &[],
        )
    };
    s.handle_pdu(Millis(7), &nop(0x05, 0x12), &mut ev).unwrap();
    assert_eq!(s.window(), (SerialNumber(0x11), SerialNumber(0x11)));
    assert_eq!(ev.opened, 0);
    s.handle_pdu(Millis(7), &nop(0x13, 0x12), &mut ev).unwrap();
    assert_eq!(ev.opened, 1, "busy was reported, the window opened");
    assert_eq!(s.window_room(), 2);
    // StatSNs too far behind or ahead are breaches.
    let itt2 = s.itt_of(1);
    for received in [0x501u32.wrapping_sub(0x1_0000), 0x501 + 0x1_0000] {
        assert_eq!(
            s.handle_pdu(Millis(8), &response(itt2, received, 0, 0x13, &[]), &mut ev),
            Err(SessionFailure::Protocol(Violation::StatSn {
                expected: 0x501,
                received
            }))
        );
    }
}

/// LIO numbers a SCSI Response on the thread that completed the command
/// and a NOP-In answer on its transmit thread, and posts each once built:
/// the two can cross on the wire. Both are taken, and ExpStatSN
/// acknowledges only what arrived.
#[test]
fn responses_out_of_stat_sn_order_are_accepted_and_acknowledged_in_order() {
    let neg = negotiated();
    let timeouts = Timeouts {
        noop_out_interval: 2,
        noop_out_timeout: 5,
        ..Timeouts::default()
    };
    let mut s = HostPlatform::new()
        .run_passive(|p| Session::new(&neg, &timeouts, 4, 0, Millis(0), p))
        .unwrap();
    let mut ev = Events::default();
    // Idle for the interval: the keepalive goes out.
    s.handle_timeout(Millis(2000)).unwrap();
    let mut out = [0u8; 64];
    assert!(s.poll_transmit(Millis(2000), &mut out).is_some());
    let (ping_itt, _) = s.ping.expect("a ping is outstanding");
    // Then a command.
    let tur = tur(1);
    let mut b = [0u8; 64];
    let p1 = s
        .prepare_command(Millis(2001), &tur, &Data(vec![]), &mut b)
        .unwrap();
    let itt1 = p1.itt();
    s.post_command(Millis(2001), p1, &mut b).unwrap();
    // The ping's answer (StatSN 0x501) overtakes the command's response
    // (StatSN 0x500).
    let answer = pdu(
        BhsRepr::NopIn(NopInRepr {
            lun: Lun::default(),
            itt: ping_itt,
            ttt: RESERVED_TAG,
            stat_sn: SerialNumber(0x501),
            exp_cmd_sn: SerialNumber(0x11),
            max_cmd_sn: SerialNumber(0x11),
        }),
        &[],
    );
    s.handle_pdu(Millis(2002), &answer, &mut ev).unwrap();
    assert!(s.ping.is_none(), "the ping is answered");
    assert_eq!(
        s.exp_stat_sn(),
        SerialNumber(0x500),
        "0x500 is still missing"
    );
    s.handle_pdu(Millis(2003), &response(itt1, 0x500, 0, 0x11, &[]), &mut ev)
        .unwrap();
    assert_eq!(ev.done.len(), 1);
    assert_eq!(ev.done[0].0, Tag(1));
    assert_eq!(ev.done[0].1, CommandOutcome::Scsi(0));
    assert_eq!(s.exp_stat_sn(), SerialNumber(0x502), "both acknowledged");
    // The next command carries the acknowledgement.
    let p2 = s
        .prepare_command(
            Millis(2004),
            &CommandSpec { tag: Tag(2), ..tur },
            &Data(vec![]),
            &mut b,
        )
        .unwrap();
    s.post_command(Millis(2004), p2, &mut b).unwrap();
    assert_eq!(u32::from_be_bytes(b[28..32].try_into().unwrap()), 0x502);
    // A session that keeps pinging stays up: no timer fires.
    s.handle_timeout(Millis(2005)).unwrap();
}

#[test]
fn unsolicited_rules() {
    let mut neg = negotiated();
    // ImmediateData=Yes, InitialR2T=Yes: immediate only, up to the segment.
    assert_eq!(unsolicited_split(&neg, 100_000), (8192, 8192));
    assert_eq!(unsolicited_split(&neg, 512), (512, 512));
    // InitialR2T=No: up to FirstBurstLength in all.
    neg.initial_r2t = false;
    assert_eq!(unsolicited_split(&neg, 100_000), (8192, 65536));
    neg.immediate_data = false;
    assert_eq!(unsolicited_split(&neg, 100_000), (0, 65536));
    assert_eq!(unsolicited_split(&neg, 3000), (0, 3000));
    neg.initial_r2t = true;
    assert_eq!(unsolicited_split(&neg, 100_000), (0, 0));
    neg.immediate_data = true;
    neg.first_burst_length = 4096;
    assert_eq!(unsolicited_split(&neg, 100_000), (4096, 4096));

    // Data-Out PDUs: 20000 bytes, no immediate, segments of 8192.
    let mut neg = negotiated();
    neg.initial_r2t = false;
    neg.immediate_data = false;
    neg.max_cmd_sn = SerialNumber(0x20);
    let mut s = session(&neg);
    let (_, spec) = write10(1, 20000);
    let data = Data((0..20000u32).map(|i| (i % 253) as u8).collect());
    let mut buf = [0u8; 64];
    let p = s
        .prepare_command(Millis(0), &spec, &data, &mut buf)
        .unwrap();
    assert_eq!(buf[1] & 0x80, 0, "F clear: Data-Out follows");
    let mut lens = Vec::new();
    for i in 0.. {
        let mut out = [0u8; 48 + 8192];
        match s.build_data_out(&p, lun0(), i, &data, &mut out).unwrap() {
            Some(n) => {
                let offset = u32::from_be_bytes(out[40..44].try_into().unwrap());
                assert_eq!(
                    u32::from_be_bytes(out[36..40].try_into().unwrap()),
                    i,
                    "DataSN"
                );
                assert_eq!(&out[20..24], &[0xFF; 4], "TTT reserved");
                assert_eq!(
                    &out[48..n],
                    &data.0[offset as usize..offset as usize + n - 48]
                );
                lens.push((n - 48, out[1] & 0x80 != 0));
            }
            None => break,
        }
    }
    assert_eq!(lens, [(8192, false), (8192, false), (3616, true)]);
    s.discard_command(p);
}

#[test]
fn malformed_and_oversized_pdus_and_unexpected_opcodes() {
    let mut s = session(&negotiated());
    let mut ev = Events::default();
    assert_eq!(
        s.handle_pdu(Millis(0), &[0x21; 20], &mut ev),
        Err(SessionFailure::Protocol(Violation::Malformed))
    );
    let big = vec![0u8; 9000];
    let rej = pdu(
        BhsRepr::Reject(RejectRepr {
            reason: RejectReason::ProtocolError,
            stat_sn: SerialNumber(0x500),
            exp_cmd_sn: SerialNumber(0x10),
            max_cmd_sn: SerialNumber(0x11),
            data_sn: SerialNumber(0),
        }),
        &big,
    );
    assert_eq!(
        s.handle_pdu(Millis(0), &rej, &mut ev),
        Err(SessionFailure::Protocol(Violation::DataSegmentTooLong))
    );
    // A Reject of nothing we know, "protocol error": the session fails.
    let rej = pdu(
        BhsRepr::Reject(RejectRepr {
            reason: RejectReason::ProtocolError,
            stat_sn: SerialNumber(0x500),
            exp_cmd_sn: SerialNumber(0x10),
            max_cmd_sn: SerialNumber(0x11),
            data_sn: SerialNumber(0),
        }),
        &[0u8; 48],
    );
    assert_eq!(
        s.handle_pdu(Millis(0), &rej, &mut ev),
        Err(SessionFailure::Protocol(Violation::Rejected(4)))
    );
    // An R2T has no place under iSER.
    let mut r2t = [0u8; 48];
    r2t[0] = 0x31;
    let mut s = session(&negotiated());
    assert_eq!(
        s.handle_pdu(Millis(0), &r2t, &mut ev),
        Err(SessionFailure::Protocol(Violation::UnexpectedOpcode(0x31)))
    );
}

#[test]
fn rejected_command_completes_with_a_retryable_failure() {
    let mut s = session(&negotiated());
    let mut ev = Events::default();
    let (_, spec) = write10(3, 512);
    let mut buf = [0u8; 1024];
    let p = s
        .prepare_command(Millis(0), &spec, &Data(vec![1; 512]), &mut buf)
        .unwrap();
    s.post_command(Millis(0), p, &mut buf).unwrap();
    let rej = pdu(
        BhsRepr::Reject(RejectRepr {
            reason: RejectReason::WaitingForLogout,
            stat_sn: SerialNumber(0x500),
            exp_cmd_sn: SerialNumber(0x11),
            max_cmd_sn: SerialNumber(0x11),
            data_sn: SerialNumber(0),
        }),
        &buf[..48],
    );
    s.handle_pdu(Millis(1), &rej, &mut ev).unwrap();
    assert_eq!(
        ev.done,
        [(
            Tag(3),
            CommandOutcome::Failed(FailureKind::ConnectionReset),
            Residual::None,
            vec![]
        )]
    );
    assert_eq!(s.commands_outstanding(), 0);
}

#[test]
fn async_drop_and_tmf_timeout_and_terminate_all() {
    let mut s = session(&negotiated());
    let mut ev = Events::default();
    let drop = pdu(
        BhsRepr::AsyncMessage(AsyncMessageRepr {
            lun: lun0(),
            stat_sn: SerialNumber(0x500),
            exp_cmd_sn: SerialNumber(0x10),
            max_cmd_sn: SerialNumber(0x11),
            event: AsyncEvent::DroppingAllConnections,
            vendor_code: 0,
            parameter1: 0,
            parameter2: 7,
            parameter3: 0,
        }),
        &[],
    );
    assert_eq!(
        s.handle_pdu(Millis(0), &drop, &mut ev),
        Err(SessionFailure::TargetDropping { time2wait: 7 })
    );

    let mut s = session(&negotiated());
    let (_, spec) = write10(1, 512);
    let mut buf = [0u8; 1024];
    let p = s
        .prepare_command(Millis(0), &spec, &Data(vec![0; 512]), &mut buf)
        .unwrap();
    s.post_command(Millis(0), p, &mut buf).unwrap();
    s.reset_lun(Millis(0), Tag(9), lun0()).unwrap();
    assert_eq!(s.poll_at(), Some(Millis(30_000)), "lu_reset_timeout");
    assert_eq!(
        s.handle_timeout(Millis(30_000)),
        Err(SessionFailure::TmfTimeout)
    );
    s.terminate_all(
        CommandOutcome::Failed(FailureKind::ConnectionReset),
        FailureKind::Timeout,
        &mut ev,
    );
    assert_eq!(ev.done.len(), 1);
    assert_eq!(
        ev.tmfs,
        [(Tag(9), TmfResponse::Transport(FailureKind::Timeout))]
    );
    assert_eq!(s.commands_outstanding(), 0);
    let mut out = [0u8; 64];
    assert_eq!(
        s.poll_transmit(Millis(0), &mut out),
        None,
        "queued TMF dropped"
    );
}

#[test]
fn itt_generations_and_table_capacity() {
    let mut neg = negotiated();
    neg.max_cmd_sn = SerialNumber(0x100);
    let mut s = session(&neg);
    let tur = tur(1);
    let mut prepared = Vec::new();
    for t in 0..4 {
        prepared.push(
            s.prepare_command(
                Millis(0),
                &CommandSpec { tag: Tag(t), ..tur },
                &Data(vec![]),
                &mut [0u8; 64],
            )
            .unwrap(),
        );
    }
    assert_eq!(
        s.prepare_command(
            Millis(0),
            &CommandSpec { tag: Tag(9), ..tur },
            &Data(vec![]),
            &mut [0u8; 64]
        ),
        Err(PrepareError::Busy),
        "cmds_max 4"
    );
    let first = prepared.remove(0);
    let old_itt = first.itt();
    s.discard_command(first);
    let again = s
        .prepare_command(
            Millis(0),
            &CommandSpec { tag: Tag(9), ..tur },
            &Data(vec![]),
            &mut [0u8; 64],
        )
        .unwrap();
    assert_eq!(again.itt() & 0xFFFF, old_itt & 0xFFFF, "slot reused");
    assert_ne!(again.itt(), old_itt, "new generation");
    assert!(s.lookup(old_itt).is_none());
    // Post refuses a buffer that is not the prepared PDU.
    assert_eq!(
        s.post_command(Millis(0), again, &mut [0u8; 48]),
        Err(PostError::BadBuffer)
    );
    for p in prepared {
        s.discard_command(p);
    }
    assert_eq!(s.commands_outstanding(), 0);
    // Unsupported shapes.
    assert_eq!(
        s.prepare_command(
            Millis(0),
            &CommandSpec { cdb: &[], ..tur },
            &Data(vec![]),
            &mut [0u8; 64]
        ),
        Err(PrepareError::Failed(FailureKind::Unsupported))
    );
    assert_eq!(
        s.prepare_command(
            Millis(0),
            &CommandSpec {
                direction: DataDirection::Unspecified,
                ..tur
            },
            &Data(vec![]),
            &mut [0u8; 64]
        ),
        Err(PrepareError::Failed(FailureKind::Unsupported))
    );
}

mod total {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Any bytes from the wire get a defined outcome, never a panic,
        /// and never complete a command twice.
        #[test]
        fn handle_pdu_is_total(
            opcode in prop::sample::select(vec![0x20u8, 0x21, 0x22, 0x26, 0x24, 0x32, 0x3f, 0x25, 0x31, 0x23, 0x01]),
            mut bytes in prop::collection::vec(any::<u8>(), 48..200),
        ) {
            let mut s = session(&negotiated());
            let mut ev = Events::default();
            let (_, spec) = write10(1, 512);
            let mut buf = [0u8; 1024];
            let p = s.prepare_command(Millis(0), &spec, &Data(vec![0; 512]), &mut buf).unwrap();
            s.post_command(Millis(0), p, &mut buf).unwrap();
            bytes[0] = opcode;
            // A consistent length field half of the time.
            if bytes[1] & 1 == 0 {
                let len = (bytes.len() - 48) as u32;
                bytes[4] = 0;
                bytes[5..8].copy_from_slice(&len.to_be_bytes()[1..]);
            }
            let _ = s.handle_pdu(Millis(1), &bytes, &mut ev);
            let _ = s.handle_pdu(Millis(2), &bytes, &mut ev);
            prop_assert!(ev.done.len() <= 1);
            let mut out = [0u8; 64];
            while s.poll_transmit(Millis(3), &mut out).is_some() {}
        }
    }
}
