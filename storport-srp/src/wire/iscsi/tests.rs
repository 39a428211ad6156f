//! iSCSI and iSER property tests (emit -> parse round trips for every PDU
//! and the iSER wrapper, total parsing of arbitrary and mutated bytes),
//! golden bytes for a login exchange and a SCSI Response with sense, and
//! the error-variant census.

use proptest::prelude::*;

use super::*;
use crate::wire::iser::{
    HelloReplyRepr, HelloRepr, IserCtrlRepr, IserHeader, IserMessage, RdmaBuf,
};
use crate::wire::test_util::{Mutation, fuzz_seeds, mutation};
use crate::wire::{Lun, Residual};

fn sn() -> impl Strategy<Value = SerialNumber> {
    any::<u32>().prop_map(SerialNumber)
}

fn lun() -> impl Strategy<Value = Lun> {
    any::<[u8; 8]>().prop_map(Lun)
}

fn residual() -> impl Strategy<Value = Residual> {
    prop_oneof![
        Just(Residual::None),
        any::<u32>().prop_map(Residual::Overflow),
        any::<u32>().prop_map(Residual::Underflow),
    ]
}

fn stage() -> impl Strategy<Value = LoginStage> {
    prop_oneof![
        Just(LoginStage::SecurityNegotiation),
        Just(LoginStage::OperationalNegotiation),
        Just(LoginStage::FullFeature),
    ]
}

/// Stage fields with T and C never both set.
fn stages() -> impl Strategy<Value = (LoginStage, Option<LoginStage>, bool)> {
    (stage(), proptest::option::of(stage()), any::<bool>())
        .prop_map(|(cur, next, more)| (cur, next, more && next.is_none()))
}

fn final_continue() -> impl Strategy<Value = (bool, bool)> {
    prop_oneof![
        Just((false, false)),
        Just((true, false)),
        Just((false, true))
    ]
}

fn bhs_repr() -> impl Strategy<Value = BhsRepr> {
    prop_oneof![
        (any::<bool>(), lun(), any::<u32>(), any::<u32>(), sn(), sn()).prop_map(
            |(immediate, lun, itt, ttt, cmd_sn, exp_stat_sn)| BhsRepr::NopOut(NopOutRepr {
                immediate,
                lun,
                itt,
                ttt,
                cmd_sn,
                exp_stat_sn
            })
        ),
        (
            any::<[bool; 4]>(),
            (0u8..8).prop_map(TaskAttr::from_code),
            lun(),
            any::<u32>(),
            any::<u32>(),
            sn(),
            sn(),
            any::<[u8; 16]>()
        )
            .prop_map(|(b, attr, lun, itt, edtl, cmd_sn, exp_stat_sn, cdb)| {
                BhsRepr::ScsiCommand(ScsiCommandRepr {
                    immediate: b[0],
                    is_final: b[1],
                    read: b[2],
                    write: b[3],
                    attr,
                    lun,
                    itt,
                    expected_data_len: edtl,
                    cmd_sn,
                    exp_stat_sn,
                    cdb,
                })
            }),
        (
            any::<bool>(),
            0u8..0x80,
            lun(),
            any::<u32>(),
            any::<u32>(),
            sn(),
            sn(),
            sn(),
            any::<u32>()
        )
            .prop_map(
                |(immediate, f, lun, itt, rtt, cmd_sn, exp_stat_sn, ref_sn, eds)| {
                    BhsRepr::TaskMgmtRequest(TaskMgmtRequestRepr {
                        immediate,
                        function: TaskMgmtFunction::from_code(f),
                        lun,
                        itt,
                        rtt,
                        cmd_sn,
                        exp_stat_sn,
                        ref_cmd_sn: ref_sn,
                        exp_data_sn: eds,
                    })
                }
            ),
        (
            stages(),
            any::<u8>(),
            any::<u8>(),
            any::<[u8; 6]>(),
            any::<u16>(),
            any::<u32>(),
            any::<u16>(),
            sn(),
            sn()
        )
            .prop_map(
                |((cur, next, more), vmax, vmin, isid, tsih, itt, cid, cmd_sn, esn)| {
                    BhsRepr::LoginRequest(LoginRequestRepr {
                        current_stage: cur,
                        next_stage: next,
                        continues: more,
                        version_max: vmax,
                        version_min: vmin,
                        isid,
                        tsih,
                        itt,
                        cid,
                        cmd_sn,
                        exp_stat_sn: esn,
                    })
                }
            ),
        (
            any::<bool>(),
            final_continue(),
            lun(),
            any::<u32>(),
            any::<u32>(),
            sn(),
            sn()
        )
            .prop_map(|(immediate, (f, c), lun, itt, ttt, cmd_sn, esn)| {
                BhsRepr::TextRequest(TextRequestRepr {
                    immediate,
                    is_final: f,
                    continues: c,
                    lun,
                    itt,
                    ttt,
                    cmd_sn,
                    exp_stat_sn: esn,
                })
            }),
        (
            any::<bool>(),
            lun(),
            any::<u32>(),
            any::<u32>(),
            sn(),
            sn(),
            any::<u32>()
        )
            .prop_map(
                |(f, lun, itt, ttt, esn, dsn, off)| BhsRepr::DataOut(DataOutRepr {
                    is_final: f,
                    lun,
                    itt,
                    ttt,
                    exp_stat_sn: esn,
                    data_sn: dsn,
                    buffer_offset: off
                })
            ),
        (
            any::<bool>(),
            0u8..0x80,
            any::<u32>(),
            any::<u16>(),
            sn(),
            sn()
        )
            .prop_map(
                |(immediate, r, itt, cid, cmd_sn, esn)| BhsRepr::LogoutRequest(LogoutRequestRepr {
                    immediate,
                    reason: LogoutReason::from_code(r),
                    itt,
                    cid,
                    cmd_sn,
                    exp_stat_sn: esn
                })
            ),
        (lun(), any::<u32>(), any::<u32>(), sn(), sn(), sn()).prop_map(
            |(lun, itt, ttt, stat_sn, exp_cmd_sn, max_cmd_sn)| BhsRepr::NopIn(NopInRepr {
                lun,
                itt,
                ttt,
                stat_sn,
                exp_cmd_sn,
                max_cmd_sn
            })
        ),
        (
            any::<u8>(),
            any::<u8>(),
            residual(),
            residual(),
            any::<u32>(),
            any::<u32>(),
            sn(),
            sn(),
            sn(),
            any::<u32>()
        )
            .prop_map(|(response, status, res, bidi, itt, snack, s, e, m, eds)| {
                BhsRepr::ScsiResponse(ScsiResponseRepr {
                    response,
                    status,
                    residual: res,
                    bidi_read_residual: bidi,
                    itt,
                    snack_tag: snack,
                    stat_sn: s,
                    exp_cmd_sn: e,
                    max_cmd_sn: m,
                    exp_data_sn: eds,
                })
            }),
        (any::<u8>(), any::<u32>(), sn(), sn(), sn()).prop_map(|(r, itt, s, e, m)| {
            BhsRepr::TaskMgmtResponse(TaskMgmtResponseRepr {
                response: TaskMgmtResponseCode::from_code(r),
                itt,
                stat_sn: s,
                exp_cmd_sn: e,
                max_cmd_sn: m,
            })
        }),
        (
            stages(),
            any::<u8>(),
            any::<u8>(),
            any::<[u8; 6]>(),
            any::<u16>(),
            any::<u32>(),
            sn(),
            sn(),
            sn(),
            any::<[u8; 2]>()
        )
            .prop_map(
                |((cur, next, more), vmax, vact, isid, tsih, itt, s, e, m, st)| {
                    BhsRepr::LoginResponse(LoginResponseRepr {
                        current_stage: cur,
                        next_stage: next,
                        continues: more,
                        version_max: vmax,
                        version_active: vact,
                        isid,
                        tsih,
                        itt,
                        stat_sn: s,
                        exp_cmd_sn: e,
                        max_cmd_sn: m,
                        status_class: st[0],
                        status_detail: st[1],
                    })
                }
            ),
        (
            final_continue(),
            lun(),
            any::<u32>(),
            any::<u32>(),
            sn(),
            sn(),
            sn()
        )
            .prop_map(|((f, c), lun, itt, ttt, s, e, m)| BhsRepr::TextResponse(
                TextResponseRepr {
                    is_final: f,
                    continues: c,
                    lun,
                    itt,
                    ttt,
                    stat_sn: s,
                    exp_cmd_sn: e,
                    max_cmd_sn: m
                }
            )),
        (
            any::<bool>(),
            any::<bool>(),
            proptest::option::of((any::<u8>(), sn(), residual())),
            lun(),
            any::<u32>(),
            any::<u32>(),
            sn(),
            sn(),
            sn(),
            any::<u32>()
        )
            .prop_map(|(f, a, status, lun, itt, ttt, e, m, dsn, off)| {
                let status = status.map(|(status, stat_sn, residual)| data::DataInStatus {
                    status,
                    stat_sn,
                    residual,
                });
                BhsRepr::DataIn(DataInRepr {
                    // The status forces F, so generate what parses back.
                    is_final: f || status.is_some(),
                    acknowledge: a,
                    status,
                    lun,
                    itt,
                    ttt,
                    exp_cmd_sn: e,
                    max_cmd_sn: m,
                    data_sn: dsn,
                    buffer_offset: off,
                })
            }),
        (
            any::<u8>(),
            any::<u32>(),
            sn(),
            sn(),
            sn(),
            any::<u16>(),
            any::<u16>()
        )
            .prop_map(|(r, itt, s, e, m, w, t)| BhsRepr::LogoutResponse(
                LogoutResponseRepr {
                    response: LogoutResponseCode::from_code(r),
                    itt,
                    stat_sn: s,
                    exp_cmd_sn: e,
                    max_cmd_sn: m,
                    time2wait: w,
                    time2retain: t
                }
            )),
        (
            lun(),
            any::<u32>(),
            any::<u32>(),
            sn(),
            sn(),
            sn(),
            sn(),
            any::<u32>(),
            any::<u32>()
        )
            .prop_map(
                |(lun, itt, ttt, s, e, m, r2t_sn, off, len)| BhsRepr::R2t(R2tRepr {
                    lun,
                    itt,
                    ttt,
                    stat_sn: s,
                    exp_cmd_sn: e,
                    max_cmd_sn: m,
                    r2t_sn,
                    buffer_offset: off,
                    desired_len: len,
                })
            ),
        (
            lun(),
            sn(),
            sn(),
            sn(),
            any::<u8>(),
            any::<u8>(),
            any::<[u16; 3]>()
        )
            .prop_map(|(lun, s, e, m, ev, vc, p)| BhsRepr::AsyncMessage(
                AsyncMessageRepr {
                    lun,
                    stat_sn: s,
                    exp_cmd_sn: e,
                    max_cmd_sn: m,
                    event: AsyncEvent::from_code(ev),
                    vendor_code: vc,
                    parameter1: p[0],
                    parameter2: p[1],
                    parameter3: p[2],
                }
            )),
        (any::<u8>(), sn(), sn(), sn(), sn()).prop_map(|(r, s, e, m, d)| BhsRepr::Reject(
            RejectRepr {
                reason: RejectReason::from_code(r),
                stat_sn: s,
                exp_cmd_sn: e,
                max_cmd_sn: m,
                data_sn: d
            }
        )),
    ]
}

/// A PDU with owned AHS (whole words) and data segment.
fn owned_pdu() -> impl Strategy<Value = (BhsRepr, Vec<u8>, Vec<u8>)> {
    (
        bhs_repr(),
        (0usize..4).prop_flat_map(|words| prop::collection::vec(any::<u8>(), words * 4)),
        prop::collection::vec(any::<u8>(), 0..200),
    )
}

fn padding() -> impl Strategy<Value = Padding> {
    prop_oneof![Just(Padding::None), Just(Padding::ToWord)]
}

fn rdma_buf() -> impl Strategy<Value = RdmaBuf> {
    (any::<u32>(), any::<u64>()).prop_map(|(stag, va)| RdmaBuf { stag, va })
}

/// Parses, and if that succeeds, checks that re-emitting and re-parsing
/// gives the same value.
fn iser_parse_is_stable(bytes: &[u8]) -> Result<()> {
    let parsed = IserMessage::parse(bytes)?;
    let mut again = vec![0u8; parsed.buffer_len()];
    assert_eq!(parsed.emit(&mut again), Ok(again.len()));
    assert_eq!(IserMessage::parse(&again), Ok(parsed), "re-parse differs");
    Ok(())
}

proptest! {
    #[test]
    fn every_pdu_round_trips((header, ahs, data) in owned_pdu(), pad in padding()) {
        let pdu = IscsiPdu { header, ahs: &ahs, data: &data };
        let len = pdu.buffer_len(pad);
        let mut buf = vec![0xA5u8; len + 3];
        prop_assert_eq!(pdu.emit(&mut buf, pad), Ok(len));
        prop_assert_eq!(IscsiPdu::parse(&buf[..len]), Ok(pdu));
        // The BHS alone parses to the same header.
        prop_assert_eq!(BhsRepr::parse(&Bhs::new_unchecked(&buf[..BHS_LEN])), Ok(header));
        prop_assert_eq!(header.opcode().code(), buf[0] & 0x3f);
        // Padding, when there is any, is zero.
        prop_assert!(buf[BHS_LEN + ahs.len() + data.len()..len].iter().all(|&b| b == 0));
        prop_assert_eq!(pdu.emit(&mut buf[..len - 1], pad), Err(Error::BufferTooSmall));
    }

    #[test]
    fn every_iser_message_round_trips(
        (header, ahs, data) in owned_pdu(),
        write in proptest::option::of(rdma_buf()),
        read in proptest::option::of(rdma_buf()),
        hello in (0u8..16, 0u8..16, any::<u16>(), any::<bool>()),
        which in 0u8..3,
    ) {
        let msg = match which {
            0 => IserMessage::Control {
                header: IserCtrlRepr { write, read },
                pdu: IscsiPdu { header, ahs: &ahs, data: &data },
            },
            1 => IserMessage::Hello(HelloRepr { max_version: hello.0, min_version: hello.1, ird: hello.2 }),
            _ => IserMessage::HelloReply(HelloReplyRepr {
                max_version: hello.0,
                current_version: hello.1,
                ord: hello.2,
                rejected: hello.3,
            }),
        };
        let mut buf = vec![0u8; msg.buffer_len()];
        prop_assert_eq!(msg.emit(&mut buf), Ok(buf.len()));
        prop_assert_eq!(IserMessage::parse(&buf), Ok(msg));
    }

    #[test]
    fn parse_is_total_on_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
        let _ = iser_parse_is_stable(&bytes);
        let _ = IscsiPdu::parse(&bytes);
        for ahs in AhsIter::new(&bytes) {
            let _ = ahs;
        }
        let _ = SenseData::parse(&bytes);
    }

    #[test]
    fn parse_is_total_on_mutated_pdus((header, ahs, data) in owned_pdu(), m in mutation()) {
        let msg = IserMessage::Control {
            header: IserCtrlRepr::default(),
            pdu: IscsiPdu { header, ahs: &ahs, data: &data },
        };
        let mut buf = vec![0u8; msg.buffer_len()];
        msg.emit(&mut buf).unwrap();
        let mutated = Mutation::apply(&m, &buf);
        let _ = iser_parse_is_stable(&mutated);
    }
}

/// A LIO-style login exchange on the wire: the initiator's first Login
/// Request (operational stage, transit to full feature) and the target's
/// final Login Response, byte for byte from the BHS layout.
#[test]
fn login_exchange_golden_bytes() {
    let request = LoginRequestRepr {
        current_stage: LoginStage::OperationalNegotiation,
        next_stage: Some(LoginStage::FullFeature),
        continues: false,
        version_max: 0,
        version_min: 0,
        isid: [0x80, 0x12, 0x34, 0x56, 0x00, 0x01],
        tsih: 0,
        itt: 0,
        cid: 0,
        cmd_sn: SerialNumber(1),
        exp_stat_sn: SerialNumber(0),
    };
    let keys = b"InitiatorName=iqn.2024-01.invalid.kverbs:host\0SessionType=Normal\0";
    assert_eq!(keys.len(), 65);
    let pdu = IscsiPdu {
        header: BhsRepr::LoginRequest(request),
        ahs: &[],
        data: keys,
    };
    let mut buf = [0xEEu8; 48 + 68];
    assert_eq!(pdu.emit(&mut buf, Padding::ToWord), Ok(48 + 68));
    let mut expected = [0u8; 48];
    expected[0] = 0x43; // I | Login Request
    expected[1] = 0x87; // T | CSG 1 | NSG 3
    expected[7] = 65; // DataSegmentLength
    expected[8..14].copy_from_slice(&[0x80, 0x12, 0x34, 0x56, 0x00, 0x01]);
    expected[27] = 1; // CmdSN
    assert_eq!(buf[..48], expected);
    assert_eq!(&buf[48..113], keys);
    assert_eq!(buf[113..], [0, 0, 0], "padded to a word");
    assert_eq!(IscsiPdu::parse(&buf), Ok(pdu));
    // Without the padding (iSER) it parses too; one byte past it does not.
    assert_eq!(IscsiPdu::parse(&buf[..113]), Ok(pdu));
    let mut longer = buf.to_vec();
    longer.push(0);
    assert_eq!(IscsiPdu::parse(&longer), Err(Error::TrailingBytes));

    let response = LoginResponseRepr {
        current_stage: LoginStage::OperationalNegotiation,
        next_stage: Some(LoginStage::FullFeature),
        continues: false,
        version_max: 0,
        version_active: 0,
        isid: request.isid,
        tsih: 0x0107,
        itt: 0,
        stat_sn: SerialNumber(0x5a),
        exp_cmd_sn: SerialNumber(1),
        max_cmd_sn: SerialNumber(64),
        status_class: 0,
        status_detail: 0,
    };
    let mut rsp = [0u8; 48];
    BhsRepr::LoginResponse(response).emit(&mut rsp).unwrap();
    let mut expected = [0u8; 48];
    expected[0] = 0x23;
    expected[1] = 0x87;
    expected[8..14].copy_from_slice(&[0x80, 0x12, 0x34, 0x56, 0x00, 0x01]);
    expected[14..16].copy_from_slice(&[0x01, 0x07]);
    expected[27] = 0x5a;
    expected[31] = 1;
    expected[35] = 64;
    assert_eq!(rsp, expected);
    let parsed = LoginResponseRepr::parse(&LoginResponse::new_checked(&rsp[..]).unwrap()).unwrap();
    assert!(parsed.is_success());
    assert_eq!(
        command_window(parsed.exp_cmd_sn, parsed.max_cmd_sn),
        Some(64)
    );
}

/// A SCSI Response with CHECK CONDITION and fixed-format sense (UNIT
/// ATTENTION, POWER ON OCCURRED), carried under iSER.
#[test]
fn scsi_response_with_sense_golden_bytes() {
    let sense = [
        0x70, 0, 0x06, 0, 0, 0, 0, 10, 0, 0, 0, 0, 0x29, 0x00, 0, 0, 0, 0,
    ];
    let mut segment = [0u8; 20];
    assert_eq!(
        SenseData {
            sense: &sense,
            response_data: &[]
        }
        .emit(&mut segment),
        Ok(20)
    );
    assert_eq!(segment[..2], [0, 18]);
    let header = ScsiResponseRepr {
        response: scsi::response::COMPLETED,
        status: 0x02,
        residual: Residual::Underflow(4096),
        bidi_read_residual: Residual::None,
        itt: 0x12,
        snack_tag: 0,
        stat_sn: SerialNumber(0x31),
        exp_cmd_sn: SerialNumber(0x21),
        max_cmd_sn: SerialNumber(0x60),
        exp_data_sn: 0,
    };
    let msg = IserMessage::Control {
        header: IserCtrlRepr::default(),
        pdu: IscsiPdu {
            header: BhsRepr::ScsiResponse(header),
            ahs: &[],
            data: &segment,
        },
    };
    let mut buf = [0u8; 28 + 48 + 20];
    assert_eq!(msg.emit(&mut buf), Ok(96));
    assert_eq!(buf[..4], [0x10, 0, 0, 0]);
    let bhs = &buf[28..76];
    assert_eq!(bhs[..8], [0x21, 0x82, 0x00, 0x02, 0, 0, 0, 20]);
    assert_eq!(bhs[16..20], [0, 0, 0, 0x12]);
    assert_eq!(bhs[24..36], [0, 0, 0, 0x31, 0, 0, 0, 0x21, 0, 0, 0, 0x60]);
    assert_eq!(bhs[44..48], [0, 0, 0x10, 0]);
    let IserMessage::Control { pdu, .. } = IserMessage::parse(&buf).unwrap() else {
        panic!("not a control PDU");
    };
    assert_eq!(pdu.header, BhsRepr::ScsiResponse(header));
    assert_eq!(SenseData::parse(pdu.data).unwrap().sense, &sense);
}

#[test]
fn ahs_iteration() {
    // Extended CDB AHS: length 17 (16 spill bytes + reserved), type 1,
    // padded to 20 bytes; then a bidirectional read length AHS.
    let mut ahs = vec![0u8, 17, AHS_EXTENDED_CDB];
    ahs.extend_from_slice(&[0xCD; 17]);
    ahs.extend_from_slice(&[0, 5, AHS_BIDI_READ_LENGTH, 0, 0, 0, 0x10, 0]);
    assert_eq!(ahs.len(), 28);
    let entries: Vec<_> = AhsIter::new(&ahs).collect();
    assert_eq!(entries.len(), 2);
    assert_eq!(
        entries[0],
        Ok(Ahs {
            ahs_type: 1,
            specific: &[0xCD; 17]
        })
    );
    assert_eq!(
        entries[1],
        Ok(Ahs {
            ahs_type: 2,
            specific: &[0, 0, 0, 0x10, 0]
        })
    );
    // An entry claiming more than is there.
    assert_eq!(
        AhsIter::new(&[0, 9, 1, 0]).collect::<Vec<_>>(),
        [Err(Error::AhsOutOfBounds)]
    );
    assert_eq!(
        AhsIter::new(&[0, 0]).collect::<Vec<_>>(),
        [Err(Error::AhsOutOfBounds)]
    );
}

#[test]
fn data_segment_length_helpers() {
    let mut bhs = [0u8; 48];
    assert_eq!(set_data_segment_len(&mut bhs, 0x12_3456), Ok(()));
    assert_eq!(data_segment_len(&bhs), 0x12_3456);
    assert_eq!(
        set_data_segment_len(&mut bhs, 1 << 24),
        Err(Error::DataSegmentTooLong)
    );
    assert_eq!(
        set_data_segment_len(&mut bhs[..47], 1),
        Err(Error::Truncated)
    );
    let mut view = ScsiCommand::new_unchecked(&mut bhs[..]);
    assert_eq!(
        view.set_data_segment_len(1 << 24),
        Err(Error::DataSegmentTooLong)
    );
    assert_eq!(view.set_data_segment_len(512), Ok(()));
    assert_eq!(view.data_segment_len(), 512);
    assert_eq!(pad4(0), 0);
    assert_eq!(pad4(1), 4);
    assert_eq!(pad4(66), 68);
    assert_eq!(
        Bhs::new_unchecked(&bhs[..]).pdu_len(Padding::ToWord),
        48 + 512
    );
}

#[test]
fn opcodes() {
    for code in 0..64u8 {
        if let Some(op) = Opcode::from_code(code) {
            assert_eq!(op.code(), code);
        }
    }
    // The immediate bit and bit 7 do not change the opcode.
    assert_eq!(Opcode::from_code(0xC1), Some(Opcode::ScsiCommand));
    assert_eq!(Opcode::from_code(0x1c), None);
}

/// Every error variant, each reached through the public API; the match is
/// exhaustive so a new variant must be added here.
#[test]
fn every_error_variant_is_reachable() {
    fn census(e: Error) -> usize {
        match e {
            Error::Truncated => 0,
            Error::UnknownOpcode(_) => 1,
            Error::UnsupportedOpcode(_) => 2,
            Error::WrongOpcode(_) => 3,
            Error::ReservedStage => 4,
            Error::TransitAndContinue => 5,
            Error::FinalAndContinue => 6,
            Error::ConflictingResidualFlags => 7,
            Error::StatusWithoutFinal => 8,
            Error::AhsOutOfBounds => 9,
            Error::DataSegmentOutOfBounds => 10,
            Error::TrailingBytes => 11,
            Error::SenseOutOfBounds => 12,
            Error::DataSegmentTooLong => 13,
            Error::BadAhsLength => 14,
            Error::BufferTooSmall => 15,
            Error::UnknownIserOpcode(_) => 16,
        }
    }
    const VARIANTS: usize = 17;

    let bhs = |b0: u8, b1: u8, edit: &dyn Fn(&mut [u8])| {
        let mut b = vec![0u8; 48];
        b[0] = b0;
        b[1] = b1;
        edit(&mut b);
        b
    };
    let none = |_: &mut [u8]| {};
    let parse = |b: &[u8]| IscsiPdu::parse(b).unwrap_err();
    let nop = BhsRepr::NopIn(NopInRepr {
        lun: Lun::default(),
        itt: 0,
        ttt: 0,
        stat_sn: SerialNumber(0),
        exp_cmd_sn: SerialNumber(0),
        max_cmd_sn: SerialNumber(0),
    });
    let huge = vec![0u8; 1 << 24];
    let mut out = [0u8; 100];
    let mut trailing = bhs(0x20, 0x80, &none);
    trailing.extend_from_slice(&[0; 4]);

    let errors = [
        parse(&[0u8; 47]),
        parse(&bhs(0x1c, 0, &none)),
        parse(&bhs(0x10, 0, &none)),
        ScsiCommandRepr::parse(&ScsiCommand::new_unchecked(&bhs(0x21, 0, &none)[..])).unwrap_err(),
        parse(&bhs(0x43, 0x08, &none)),
        parse(&bhs(0x43, 0xC7, &none)),
        parse(&bhs(0x04, 0xC0, &none)),
        parse(&bhs(0x21, 0x86, &none)),
        parse(&bhs(0x25, 0x01, &none)),
        parse(&bhs(0x20, 0x80, &|b| b[4] = 1)),
        parse(&bhs(0x20, 0x80, &|b| b[7] = 1)),
        parse(&trailing),
        SenseData::parse(&[0, 9, 1]).unwrap_err(),
        IscsiPdu {
            header: nop,
            ahs: &[],
            data: &huge,
        }
        .emit(&mut out, Padding::None)
        .unwrap_err(),
        IscsiPdu {
            header: nop,
            ahs: &[0; 3],
            data: &[],
        }
        .emit(&mut out, Padding::None)
        .unwrap_err(),
        IscsiPdu {
            header: nop,
            ahs: &[],
            data: &[0; 60],
        }
        .emit(&mut out, Padding::None)
        .unwrap_err(),
        IserCtrlRepr::parse(&IserHeader::new_unchecked(&[0x50u8; 28][..])).unwrap_err(),
    ];
    let mut seen = [false; VARIANTS];
    for (i, e) in errors.iter().enumerate() {
        assert_eq!(census(*e), i, "error #{i} is {e:?}");
        seen[census(*e)] = true;
        assert!(!format!("{e}").is_empty());
    }
    assert!(seen.iter().all(|&s| s));
}

/// Every committed `iscsi_pdu` seed is a valid iSER message.
#[test]
fn fuzz_seeds_are_valid_messages() {
    for (name, input) in fuzz_seeds("iscsi_pdu") {
        iser_parse_is_stable(&input).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}
