//! SRP property tests (emit -> parse round trips for every IU, total
//! parsing of arbitrary and mutated bytes) and the error-variant census.

use proptest::prelude::*;

use super::*;
use crate::wire::Lun;
use crate::wire::test_util::{Mutation, fuzz_seeds, mutation};

/// An IU with owned variable parts, so that proptest can generate it; the
/// repr borrows from it.
#[derive(Debug, Clone)]
enum OwnedIu {
    LoginReq(LoginReqRepr),
    LoginRsp(LoginRspRepr),
    LoginRej(LoginRejRepr),
    ILogout(ILogoutRepr),
    TLogout(TLogoutRepr),
    TskMgmt(TskMgmtRepr),
    Cmd(OwnedCmd),
    Rsp(OwnedRsp),
    CredReq(CredReqRepr),
    CredRsp(CredRspRepr),
    AerReq(OwnedAer),
    AerRsp(AerRspRepr),
}

#[derive(Debug, Clone)]
enum OwnedOut {
    None,
    Direct(DirectDesc),
    Indirect(u64, u32, Vec<DirectDesc>),
    /// Extra gap after the descriptors, and the data.
    Immediate(u16, Vec<u8>),
}

#[derive(Debug, Clone)]
enum OwnedIn {
    None,
    Direct(DirectDesc),
    Indirect(u64, u32, Vec<DirectDesc>),
}

#[derive(Debug, Clone)]
struct OwnedCmd {
    sol_not: SolNot,
    tag: u64,
    lun: Lun,
    task_attr: TaskAttr,
    cdb: Vec<u8>,
    data_out: OwnedOut,
    data_in: OwnedIn,
}

#[derive(Debug, Clone)]
struct OwnedRsp {
    solicited: bool,
    req_lim_delta: i32,
    tag: u64,
    status: u8,
    data_out_residual: Residual,
    data_in_residual: Residual,
    response_data: Option<Vec<u8>>,
    sense: Option<Vec<u8>>,
}

#[derive(Debug, Clone)]
struct OwnedAer {
    solicited: bool,
    req_lim_delta: i32,
    tag: u64,
    lun: Lun,
    sense: Vec<u8>,
}

impl OwnedCmd {
    /// The repr, and the immediate-data offset a parser must be given.
    fn repr(&self) -> (CmdRepr<'_>, Option<u16>) {
        fn indirect(va: u64, rkey: u32, descs: &[DirectDesc]) -> IndirectDesc<'_> {
            IndirectDesc::inline(va, rkey, descs).expect("generated within limits")
        }
        let data_in = match &self.data_in {
            OwnedIn::None => DataIn::None,
            OwnedIn::Direct(d) => DataIn::Direct(*d),
            OwnedIn::Indirect(va, rkey, descs) => DataIn::Indirect(indirect(*va, *rkey, descs)),
        };
        let mut repr = CmdRepr {
            sol_not: self.sol_not,
            tag: self.tag,
            lun: self.lun,
            task_attr: self.task_attr,
            cdb: &self.cdb,
            data_out: DataOut::None,
            data_in,
        };
        let mut imm = None;
        repr.data_out = match &self.data_out {
            OwnedOut::None => DataOut::None,
            OwnedOut::Direct(d) => DataOut::Direct(*d),
            OwnedOut::Indirect(va, rkey, descs) => DataOut::Indirect(indirect(*va, *rkey, descs)),
            OwnedOut::Immediate(gap, data) => {
                // Place the data right after the descriptors plus a gap.
                let probe = CmdRepr {
                    data_out: DataOut::ImmediateExternal {
                        offset: u16::MAX,
                        len: 0,
                    },
                    ..repr
                };
                let desc_end = cmd::LEN
                    + probe.cdb.len().saturating_sub(16).next_multiple_of(4)
                    + 4
                    + match probe.data_in {
                        DataIn::None => 0,
                        DataIn::Direct(_) => 16,
                        DataIn::Indirect(ind) => ind.buffer_len(),
                    };
                let offset = u16::try_from(desc_end).unwrap() + gap;
                imm = Some(offset);
                DataOut::Immediate { offset, data }
            }
        };
        (repr, imm)
    }
}

impl OwnedIu {
    fn repr(&self) -> (SrpIu<'_>, Option<u16>) {
        match self {
            Self::LoginReq(r) => (SrpIu::LoginReq(*r), None),
            Self::LoginRsp(r) => (SrpIu::LoginRsp(*r), None),
            Self::LoginRej(r) => (SrpIu::LoginRej(*r), None),
            Self::ILogout(r) => (SrpIu::ILogout(*r), None),
            Self::TLogout(r) => (SrpIu::TLogout(*r), None),
            Self::TskMgmt(r) => (SrpIu::TskMgmt(*r), None),
            Self::Cmd(c) => {
                let (repr, imm) = c.repr();
                (SrpIu::Cmd(repr), imm)
            }
            Self::Rsp(r) => (
                SrpIu::Rsp(RspRepr {
                    solicited: r.solicited,
                    req_lim_delta: r.req_lim_delta,
                    tag: r.tag,
                    status: r.status,
                    data_out_residual: r.data_out_residual,
                    data_in_residual: r.data_in_residual,
                    response_data: r.response_data.as_deref(),
                    sense: r.sense.as_deref(),
                }),
                None,
            ),
            Self::CredReq(r) => (SrpIu::CredReq(*r), None),
            Self::CredRsp(r) => (SrpIu::CredRsp(*r), None),
            Self::AerReq(a) => (
                SrpIu::AerReq(AerReqRepr {
                    solicited: a.solicited,
                    req_lim_delta: a.req_lim_delta,
                    tag: a.tag,
                    lun: a.lun,
                    sense: &a.sense,
                }),
                None,
            ),
            Self::AerRsp(r) => (SrpIu::AerRsp(*r), None),
        }
    }
}

fn lun() -> impl Strategy<Value = Lun> {
    any::<[u8; 8]>().prop_map(Lun)
}

fn port_id() -> impl Strategy<Value = PortId> {
    (any::<u64>(), any::<u64>()).prop_map(|(id_ext, guid)| PortId { id_ext, guid })
}

fn buf_formats() -> impl Strategy<Value = BufFormats> {
    any::<u16>().prop_map(BufFormats::from_bits_truncate)
}

fn direct() -> impl Strategy<Value = DirectDesc> {
    (any::<u64>(), any::<u32>(), 0u32..0x0100_0000).prop_map(|(va, rkey, len)| DirectDesc {
        va,
        rkey,
        len,
    })
}

fn descs() -> impl Strategy<Value = (u64, u32, Vec<DirectDesc>)> {
    (
        any::<u64>(),
        any::<u32>(),
        prop::collection::vec(direct(), 0..12),
    )
}

fn residual() -> impl Strategy<Value = Residual> {
    prop_oneof![
        Just(Residual::None),
        any::<u32>().prop_map(Residual::Overflow),
        any::<u32>().prop_map(Residual::Underflow),
    ]
}

fn login_req() -> impl Strategy<Value = LoginReqRepr> {
    (
        any::<u64>(),
        any::<u32>(),
        buf_formats(),
        prop_oneof![
            Just(MultiChannelAction::Single),
            Just(MultiChannelAction::Multi)
        ],
        any::<u8>().prop_map(LoginSolNot::from_bits_truncate),
        proptest::option::of(any::<u16>()),
        port_id(),
        port_id(),
    )
        .prop_map(|(tag, len, fmt, mc, sol, imm, i, t)| LoginReqRepr {
            tag,
            req_it_iu_len: len,
            req_buf_fmt: fmt,
            multichannel: mc,
            sol_not: sol,
            imm_data_offset: imm,
            initiator_port_id: i,
            target_port_id: t,
        })
}

fn cmd() -> impl Strategy<Value = OwnedCmd> {
    let data_out = prop_oneof![
        Just(OwnedOut::None),
        direct().prop_map(OwnedOut::Direct),
        descs().prop_map(|(va, k, d)| OwnedOut::Indirect(va, k, d)),
        (0u16..64, prop::collection::vec(any::<u8>(), 0..300))
            .prop_map(|(gap, data)| OwnedOut::Immediate(gap, data)),
    ];
    let data_in = prop_oneof![
        Just(OwnedIn::None),
        direct().prop_map(OwnedIn::Direct),
        descs().prop_map(|(va, k, d)| OwnedIn::Indirect(va, k, d)),
    ];
    (
        any::<u8>().prop_map(SolNot::from_bits_truncate),
        any::<u64>(),
        lun(),
        (0u8..8).prop_map(TaskAttr::from_code),
        // 16 bytes plus whole dwords, so the parsed CDB equals the emitted
        // one.
        (0usize..=63).prop_flat_map(|k| prop::collection::vec(any::<u8>(), 16 + 4 * k)),
        data_out,
        data_in,
    )
        .prop_map(
            |(sol_not, tag, lun, task_attr, cdb, data_out, data_in)| OwnedCmd {
                sol_not,
                tag,
                lun,
                task_attr,
                cdb,
                data_out,
                data_in,
            },
        )
}

fn owned_iu() -> impl Strategy<Value = OwnedIu> {
    let bytes = |max| prop::collection::vec(any::<u8>(), 0..max);
    prop_oneof![
        login_req().prop_map(OwnedIu::LoginReq),
        (
            any::<i32>(),
            any::<u64>(),
            any::<u32>(),
            any::<u32>(),
            buf_formats(),
            prop_oneof![
                Just(MultiChannelResult::NoChannel),
                Just(MultiChannelResult::Terminated),
                Just(MultiChannelResult::Maintained)
            ],
            any::<bool>()
        )
            .prop_map(
                |(d, tag, it, ti, fmt, mc, imm)| OwnedIu::LoginRsp(LoginRspRepr {
                    req_lim_delta: d,
                    tag,
                    max_it_iu_len: it,
                    max_ti_iu_len: ti,
                    buf_fmt: fmt,
                    multichannel: mc,
                    immediate_supported: imm,
                })
            ),
        (any::<u32>(), any::<u64>(), buf_formats()).prop_map(|(reason, tag, fmt)| {
            OwnedIu::LoginRej(LoginRejRepr {
                reason: RejectReason::from_code(reason),
                tag,
                buf_fmt: fmt,
            })
        }),
        any::<u64>().prop_map(|tag| OwnedIu::ILogout(ILogoutRepr { tag })),
        (any::<bool>(), any::<u32>(), any::<u64>()).prop_map(|(solicited, reason, tag)| {
            OwnedIu::TLogout(TLogoutRepr {
                solicited,
                reason,
                tag,
            })
        }),
        (any::<u8>(), any::<u64>(), lun(), any::<u8>(), any::<u64>()).prop_map(
            |(sol, tag, lun, f, task_tag)| OwnedIu::TskMgmt(TskMgmtRepr {
                sol_not: SolNot::from_bits_truncate(sol),
                tag,
                lun,
                function: TaskMgmtFunction::from_code(f),
                task_tag,
            })
        ),
        cmd().prop_map(OwnedIu::Cmd),
        (
            any::<bool>(),
            any::<i32>(),
            any::<u64>(),
            any::<u8>(),
            residual(),
            residual(),
            proptest::option::of(bytes(40)),
            proptest::option::of(bytes(260)),
        )
            .prop_map(|(solicited, d, tag, status, out, inn, resp, sense)| {
                OwnedIu::Rsp(OwnedRsp {
                    solicited,
                    req_lim_delta: d,
                    tag,
                    status,
                    data_out_residual: out,
                    data_in_residual: inn,
                    response_data: resp,
                    sense,
                })
            }),
        (any::<bool>(), any::<i32>(), any::<u64>()).prop_map(|(solicited, d, tag)| {
            OwnedIu::CredReq(CredReqRepr {
                solicited,
                req_lim_delta: d,
                tag,
            })
        }),
        any::<u64>().prop_map(|tag| OwnedIu::CredRsp(CredRspRepr { tag })),
        (any::<bool>(), any::<i32>(), any::<u64>(), lun(), bytes(260)).prop_map(
            |(solicited, d, tag, lun, sense)| OwnedIu::AerReq(OwnedAer {
                solicited,
                req_lim_delta: d,
                tag,
                lun,
                sense,
            })
        ),
        any::<u64>().prop_map(|tag| OwnedIu::AerRsp(AerRspRepr { tag })),
    ]
}

/// Parses, and if that succeeds, checks that re-emitting and re-parsing
/// gives the same value (parse is a projection onto valid IUs).
fn parse_is_stable(bytes: &[u8], imm: Option<u16>) -> Result<()> {
    let parsed = SrpIu::parse(bytes, imm)?;
    let len = parsed.buffer_len().expect("a parsed IU is emittable");
    let mut again = vec![0u8; len];
    assert_eq!(parsed.emit(&mut again), Ok(len));
    assert_eq!(SrpIu::parse(&again, imm), Ok(parsed), "re-parse differs");
    Ok(())
}

proptest! {
    #[test]
    fn every_iu_round_trips(iu in owned_iu(), slack in 0usize..8) {
        let (repr, imm) = iu.repr();
        let len = repr.buffer_len().unwrap();
        let mut buf = vec![0xA5u8; len + slack];
        prop_assert_eq!(repr.emit(&mut buf), Ok(len));
        prop_assert_eq!(SrpIu::parse(&buf[..len], imm), Ok(repr));
        prop_assert_eq!(repr.opcode().to_u8(), buf[0]);
        // One byte short is never accepted as the same IU.
        if len > 0 {
            prop_assert_ne!(SrpIu::parse(&buf[..len - 1], imm), Ok(repr));
        }
        // Too small a buffer is refused, and not written past its end.
        let mut small = vec![0u8; len - 1];
        prop_assert_eq!(repr.emit(&mut small), Err(Error::BufferTooSmall));
    }

    #[test]
    fn login_req_rdma_form_round_trips(repr in login_req()) {
        let mut buf = [0u8; 56];
        repr.emit_rdma(&mut LoginReqRdma::new_unchecked(&mut buf[..])).unwrap();
        prop_assert_eq!(LoginReqRepr::parse_rdma(&LoginReqRdma::new_unchecked(&buf[..])), Ok(repr));
        let mut ib = [0u8; 64];
        repr.emit(&mut LoginReq::new_unchecked(&mut ib[..])).unwrap();
        // Same fields, different places: only the opcode byte coincides
        // with nothing else.
        prop_assert_eq!(LoginReqRepr::parse(&LoginReq::new_unchecked(&ib[..])), Ok(repr));
    }

    #[test]
    fn parse_is_total_on_arbitrary_bytes(
        bytes in prop::collection::vec(any::<u8>(), 0..400),
        imm in proptest::option::of(any::<u16>()),
    ) {
        let _ = parse_is_stable(&bytes, imm);
        let _ = LoginReqRepr::parse_rdma(&LoginReqRdma::new_unchecked(&bytes[..]));
    }

    #[test]
    fn parse_is_total_on_mutated_ius(iu in owned_iu(), m in mutation()) {
        let (repr, imm) = iu.repr();
        let mut buf = vec![0u8; repr.buffer_len().unwrap()];
        repr.emit(&mut buf).unwrap();
        let mutated = Mutation::apply(&m, &buf);
        let _ = parse_is_stable(&mutated, imm);
    }

    /// The SRP engine parses an `SRP_RSP` directly, not through
    /// `SrpIu::parse`: both routes give the same answer for any bytes
    /// with the RSP type byte.
    #[test]
    fn rsp_parses_the_same_directly(iu in owned_iu(), m in mutation()) {
        let (repr, imm) = iu.repr();
        let mut buf = vec![0u8; repr.buffer_len().unwrap()];
        repr.emit(&mut buf).unwrap();
        let mut mutated = Mutation::apply(&m, &buf);
        if let Some(first) = mutated.first_mut() {
            *first = Opcode::Rsp.to_u8();
            let direct = Rsp::new_checked(&mutated[..]).and_then(|v| RspRepr::parse(&v));
            prop_assert_eq!(SrpIu::parse(&mutated, imm), direct.map(SrpIu::Rsp));
        }
    }
}

#[test]
fn unknown_opcode_and_empty_buffer() {
    assert_eq!(SrpIu::parse(&[], None), Err(Error::Truncated));
    assert_eq!(
        SrpIu::parse(&[0x55; 64], None),
        Err(Error::UnknownOpcode(0x55))
    );
    for byte in 0..=u8::MAX {
        assert_eq!(
            Opcode::from_u8(byte).map(Opcode::to_u8),
            Opcode::from_u8(byte).map(|_| byte)
        );
    }
}

/// Every error variant, each reached through the public API. The match in
/// `census` is exhaustive, so a new variant does not compile until it is
/// added here too.
#[test]
fn every_error_variant_is_reachable() {
    fn census(e: Error) -> usize {
        match e {
            Error::Truncated => 0,
            Error::WrongOpcode(_) => 1,
            Error::UnknownOpcode(_) => 2,
            Error::ReservedDescFormat(_) => 3,
            Error::ImmediateDataIn => 4,
            Error::DescriptorOutOfBounds => 5,
            Error::IndirectTableMisaligned => 6,
            Error::IndirectCountMismatch => 7,
            Error::ExternalIndirectTable => 8,
            Error::IndirectLengthMismatch => 9,
            Error::ImmediateNotNegotiated => 10,
            Error::ImmediateOffsetOverlap => 11,
            Error::ImmediateDataOutOfBounds => 12,
            Error::ResponseDataOutOfBounds => 13,
            Error::SenseDataOutOfBounds => 14,
            Error::LengthWithoutFlag => 15,
            Error::ConflictingResidualFlags => 16,
            Error::ReservedMultiChannel(_) => 17,
            Error::BufferTooSmall => 18,
            Error::CdbTooLong => 19,
            Error::TooManyDescriptors => 20,
            Error::LengthOverflow => 21,
        }
    }
    const VARIANTS: usize = 22;

    let cmd = |fmt: u8, out_cnt: u8, in_cnt: u8, tail: &[u8]| {
        let mut iu = vec![0u8; 48];
        iu[0] = 0x02;
        iu[5] = fmt;
        iu[6] = out_cnt;
        iu[7] = in_cnt;
        iu.extend_from_slice(tail);
        iu
    };
    let indirect = |table_len: u32, total: u32, descs: &[u32]| {
        let mut d = vec![0u8; 12];
        d.extend_from_slice(&table_len.to_be_bytes());
        d.extend_from_slice(&total.to_be_bytes());
        for len in descs {
            d.extend_from_slice(&[0; 12]);
            d.extend_from_slice(&len.to_be_bytes());
        }
        d
    };
    let mut rsp = vec![0u8; 36];
    rsp[0] = 0xC1;
    let rsp_with = |edit: &dyn Fn(&mut Vec<u8>)| {
        let mut r = rsp.clone();
        edit(&mut r);
        r
    };

    let parse = |bytes: &[u8], imm| SrpIu::parse(bytes, imm).unwrap_err();
    let big = [DirectDesc {
        va: 0,
        rkey: 0,
        len: u32::MAX,
    }; 2];
    let many = [DirectDesc::default(); 256];
    let long_cdb = [0u8; 300];
    let base = CmdRepr {
        sol_not: SolNot::empty(),
        tag: 0,
        lun: Lun::default(),
        task_attr: TaskAttr::Simple,
        cdb: &[0; 16],
        data_out: DataOut::None,
        data_in: DataIn::None,
    };
    let mut small = [0u8; 4];
    let mut login_req = [0u8; 64];
    login_req[26] = 2;

    let errors = [
        parse(&[0x02; 47], None),
        LoginRspRepr::parse(&LoginRsp::new_unchecked(&[0u8; 52][..])).unwrap_err(),
        parse(&[0x99], None),
        parse(&cmd(0x50, 0, 0, &[]), None),
        parse(&cmd(0x03, 0, 0, &[]), None),
        parse(&cmd(0x01, 0, 0, &[0; 15]), None),
        parse(&cmd(0x02, 0, 1, &indirect(17, 0, &[0])), None),
        parse(&cmd(0x02, 0, 2, &indirect(16, 0, &[0, 0])), None),
        parse(&cmd(0x02, 0, 1, &indirect(32, 0, &[0])), None),
        parse(&cmd(0x02, 0, 1, &indirect(16, 1, &[0])), None),
        parse(&cmd(0x30, 0, 0, &[0; 4]), None),
        parse(&cmd(0x30, 0, 0, &[0; 4]), Some(48)),
        parse(&cmd(0x30, 0, 0, &[0, 0, 0, 1]), Some(52)),
        parse(
            &rsp_with(&|r| {
                r[18] = 0x01;
                r[35] = 1
            }),
            None,
        ),
        parse(
            &rsp_with(&|r| {
                r[18] = 0x02;
                r[31] = 1
            }),
            None,
        ),
        parse(&rsp_with(&|r| r[31] = 1), None),
        parse(&rsp_with(&|r| r[18] = 0x0C), None),
        parse(&login_req, None),
        SrpIu::ILogout(ILogoutRepr { tag: 0 })
            .emit(&mut small)
            .unwrap_err(),
        CmdRepr {
            cdb: &long_cdb,
            ..base
        }
        .buffer_len()
        .unwrap_err(),
        IndirectDesc::inline(0, 0, &many).unwrap_err(),
        IndirectDesc::inline(0, 0, &big).unwrap_err(),
    ];
    let mut seen = [false; VARIANTS];
    for (i, e) in errors.iter().enumerate() {
        assert_eq!(census(*e), i, "error #{i} is {e:?}");
        seen[census(*e)] = true;
        assert!(!format!("{e}").is_empty());
    }
    assert!(seen.iter().all(|&s| s));
}

/// Every committed `srp_iu` seed is a valid IU (the fuzzer starts deep in
/// the parser, and the Python-built bytes agree with the Rust parser).
#[test]
fn fuzz_seeds_are_valid_ius() {
    for (name, input) in fuzz_seeds("srp_iu") {
        let (imm, iu) = match input.split_first() {
            Some((0, rest)) => (None, rest),
            Some((_, rest)) => (Some(u16::from_be_bytes([rest[0], rest[1]])), &rest[2..]),
            None => panic!("{name}: empty"),
        };
        if name.contains("login_req_rdma") {
            LoginReqRepr::parse_rdma(&LoginReqRdma::new_checked(iu).unwrap())
                .unwrap_or_else(|e| panic!("{name}: {e}"));
        } else {
            parse_is_stable(iu, imm).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
    }
}
