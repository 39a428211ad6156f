//! The login against scripted responses: the paths a well-behaved target
//! never takes. (The exchange with a LIO-like target is tested in
//! `tools/tests/iscsi_session.rs`.)

use super::*;
use std::vec::Vec as StdVec;

fn desc() -> TargetDescription {
    TargetDescription::parse(
        "node.name = iqn.2003-01.org.linux-iscsi.t1:sn.1\nnode.conn[0].address = 192.0.2.1\n\
         iface.initiatorname = iqn.2024-01.test.kverbs:init\nnode.session.isid = 800000000001\n",
    )
    .unwrap()
}

fn start() -> LoginStart {
    LoginStart {
        tsih: 0,
        cid: 0,
        itt: 0x77,
        cmd_sn: SerialNumber(5),
        mutual_challenge: None,
    }
}

struct Rsp {
    repr: LoginResponseRepr,
    text: StdVec<u8>,
}

fn rsp(stage: LoginStage, next: Option<LoginStage>, stat_sn: u32, text: &str) -> Rsp {
    Rsp {
        repr: LoginResponseRepr {
            current_stage: stage,
            next_stage: next,
            continues: false,
            version_max: 0,
            version_active: 0,
            isid: [0x80, 0, 0, 0, 0, 1],
            tsih: if next == Some(LoginStage::FullFeature) {
                3
            } else {
                0
            },
            itt: 0x77,
            stat_sn: SerialNumber(stat_sn),
            exp_cmd_sn: SerialNumber(5),
            max_cmd_sn: SerialNumber(20),
            status_class: 0,
            status_detail: 0,
        },
        text: text.as_bytes().to_vec(),
    }
}

impl Rsp {
    fn bytes(&self) -> StdVec<u8> {
        let pdu = IscsiPdu {
            header: BhsRepr::LoginResponse(self.repr),
            ahs: &[],
            data: &self.text,
        };
        let mut buf = vec![0u8; pdu.buffer_len(Padding::None)];
        pdu.emit(&mut buf, Padding::None).unwrap();
        buf
    }
}

const SEC_OK: &str = "AuthMethod=None\0TargetPortalGroupTag=1\0";
const OP_OK: &str = "HeaderDigest=None\0DataDigest=None\0MaxConnections=1\0InitialR2T=Yes\0\
    ImmediateData=Yes\0MaxBurstLength=262144\0FirstBurstLength=65536\0DefaultTime2Wait=2\0\
    DefaultTime2Retain=0\0MaxOutstandingR2T=1\0ErrorRecoveryLevel=0\0RDMAExtensions=Yes\0\
    InitiatorRecvDataSegmentLength=8192\0TargetRecvDataSegmentLength=8192\0";

fn text_of(buf: &[u8], len: usize) -> &str {
    core::str::from_utf8(&buf[48..len]).unwrap()
}

/// Drives the login through `script`; returns the last result.
fn run(login: &mut Login<'_>, script: &[Rsp]) -> Result<LoginStep, LoginError> {
    let mut buf = [0u8; 4096];
    let mut last = Ok(LoginStep::Send);
    for r in script {
        login.build_request(&mut buf)?;
        last = login.handle_response(&r.bytes());
        if !matches!(last, Ok(LoginStep::Send)) {
            return last;
        }
    }
    last
}

fn op_with(replace: &str, with: &str) -> std::string::String {
    OP_OK.replace(replace, with)
}

#[test]
fn a_plain_login_completes() {
    let d = desc();
    let mut login = Login::new(&d, start(), Millis(0));
    let sec = rsp(
        LoginStage::SecurityNegotiation,
        Some(LoginStage::OperationalNegotiation),
        100,
        SEC_OK,
    );
    let op = rsp(
        LoginStage::OperationalNegotiation,
        Some(LoginStage::FullFeature),
        101,
        OP_OK,
    );
    let Ok(LoginStep::Complete(n)) = run(&mut login, &[sec, op]) else {
        panic!("login did not complete");
    };
    assert_eq!(
        (n.tsih, n.exp_stat_sn, n.cmd_sn),
        (3, SerialNumber(102), SerialNumber(5))
    );
    assert_eq!(login.poll_at(), None);
    assert_eq!(login.handle_response(&[0; 48]), Err(LoginError::Unexpected));
}

#[track_caller]
fn fails_with(op_text: &str, expected: LoginError) {
    let d = desc();
    let mut login = Login::new(&d, start(), Millis(0));
    let sec = rsp(
        LoginStage::SecurityNegotiation,
        Some(LoginStage::OperationalNegotiation),
        100,
        SEC_OK,
    );
    let op = rsp(
        LoginStage::OperationalNegotiation,
        Some(LoginStage::FullFeature),
        101,
        op_text,
    );
    assert_eq!(run(&mut login, &[sec, op]), Err(expected), "{op_text:?}");
}

#[test]
fn answers_breaking_the_rules() {
    let n = |key, error| LoginError::Negotiation { key, error };
    use NegotiationError as E;
    fails_with(
        &op_with("MaxBurstLength=262144", "MaxBurstLength=33554431"),
        n("MaxBurstLength", E::Malformed),
    );
    fails_with(
        &op_with("FirstBurstLength=65536", "FirstBurstLength=300000"),
        n("FirstBurstLength", E::IllegalAnswer),
    );
    fails_with(
        &op_with("MaxBurstLength=262144", "MaxBurstLength=4096"),
        n("FirstBurstLength", E::Inconsistent),
    );
    fails_with(
        &op_with("ErrorRecoveryLevel=0", "ErrorRecoveryLevel=1"),
        n("ErrorRecoveryLevel", E::IllegalAnswer),
    );
    fails_with(
        &op_with("MaxConnections=1", "MaxConnections=2"),
        n("MaxConnections", E::IllegalAnswer),
    );
    fails_with(
        &op_with("DefaultTime2Wait=2", "DefaultTime2Wait=1"),
        n("DefaultTime2Wait", E::IllegalAnswer),
    );
    fails_with(
        &op_with("RDMAExtensions=Yes", "RDMAExtensions=No"),
        n("RDMAExtensions", E::Unacceptable),
    );
    fails_with(
        &op_with("RDMAExtensions=Yes", "RDMAExtensions=NotUnderstood"),
        n("RDMAExtensions", E::Unacceptable),
    );
    fails_with(
        &op_with("DataDigest=None", "DataDigest=CRC32C"),
        n("DataDigest", E::Unacceptable),
    );
    fails_with(
        &op_with("MaxBurstLength=262144", "MaxBurstLength=Reject"),
        n("MaxBurstLength", E::Rejected),
    );
    fails_with(
        &op_with("DefaultTime2Retain=0", "DefaultTime2Retain=NotUnderstood"),
        n("DefaultTime2Retain", E::NotUnderstood),
    );
    fails_with(
        &op_with("RDMAExtensions=Yes\0", ""),
        n("RDMAExtensions", E::NoAnswer),
    );
    // DataPDUInOrder offered Yes: OR keeps Yes.
    fails_with(
        &format!("{OP_OK}DataPDUInOrder=No\0"),
        n("DataPDUInOrder", E::IllegalAnswer),
    );
    // Tolerated: NotUnderstood for MaxOutstandingUnexpectedPDUs, unknown
    // declarations, Irrelevant.
    let d = desc();
    let mut login = Login::new(&d, start(), Millis(0));
    let sec = rsp(
        LoginStage::SecurityNegotiation,
        Some(LoginStage::OperationalNegotiation),
        100,
        SEC_OK,
    );
    let op = rsp(
        LoginStage::OperationalNegotiation,
        Some(LoginStage::FullFeature),
        101,
        &format!(
            "{OP_OK}MaxOutstandingUnexpectedPDUs=NotUnderstood\0DataSequenceInOrder=Irrelevant\0"
        ),
    );
    let Ok(LoginStep::Complete(n)) = run(&mut login, &[sec, op]) else {
        panic!()
    };
    assert_eq!(n.max_outstanding_unexpected_pdus, None);
}

#[test]
fn target_proposals_are_answered_in_the_next_request() {
    let d = desc();
    let mut login = Login::new(&d, start(), Millis(0));
    let mut buf = [0u8; 4096];
    login.build_request(&mut buf).unwrap();
    let sec = rsp(
        LoginStage::SecurityNegotiation,
        Some(LoginStage::OperationalNegotiation),
        100,
        SEC_OK,
    );
    assert_eq!(login.handle_response(&sec.bytes()), Ok(LoginStep::Send));
    login.build_request(&mut buf).unwrap();
    // The target answers and proposes an unknown key and a vendor key,
    // without transiting.
    let op = rsp(
        LoginStage::OperationalNegotiation,
        None,
        101,
        &format!("{OP_OK}X-com.example.Thing=1\0"),
    );
    assert_eq!(login.handle_response(&op.bytes()), Ok(LoginStep::Send));
    let len = login.build_request(&mut buf).unwrap();
    assert_eq!(buf[1], 0x87, "T, CSG 1, NSG 3");
    assert_eq!(text_of(&buf, len), "X-com.example.Thing=NotUnderstood\0");
    let fin = rsp(
        LoginStage::OperationalNegotiation,
        Some(LoginStage::FullFeature),
        102,
        "",
    );
    assert!(matches!(
        login.handle_response(&fin.bytes()),
        Ok(LoginStep::Complete(_))
    ));
}

#[test]
fn continued_responses_are_reassembled() {
    let d = desc();
    let mut login = Login::new(&d, start(), Millis(0));
    let mut buf = [0u8; 4096];
    login.build_request(&mut buf).unwrap();
    let (a, b) = SEC_OK.split_at(7);
    let mut first = rsp(LoginStage::SecurityNegotiation, None, 100, a);
    first.repr.continues = true;
    assert_eq!(login.handle_response(&first.bytes()), Ok(LoginStep::Send));
    let len = login.build_request(&mut buf).unwrap();
    assert_eq!(len, 48, "an empty request for the rest");
    assert_eq!(buf[1], 0x00, "same stage, no transit");
    let second = rsp(
        LoginStage::SecurityNegotiation,
        Some(LoginStage::OperationalNegotiation),
        101,
        b,
    );
    assert_eq!(login.handle_response(&second.bytes()), Ok(LoginStep::Send));
    let len = login.build_request(&mut buf).unwrap();
    assert!(text_of(&buf, len).starts_with("HeaderDigest=None"));
}

#[test]
fn header_checks() {
    let d = desc();
    let v = |p| Err(LoginError::Protocol(p));
    type Case = (fn(&mut Rsp), Result<LoginStep, LoginError>);
    let cases: [Case; 6] = [
        (|r| r.repr.itt = 0x78, v(ProtocolViolation::IttMismatch)),
        (|r| r.repr.isid = [0; 6], v(ProtocolViolation::IsidMismatch)),
        (|r| r.repr.version_active = 1, v(ProtocolViolation::Version)),
        (
            |r| r.repr.current_stage = LoginStage::OperationalNegotiation,
            v(ProtocolViolation::Stage),
        ),
        (
            |r| r.repr.next_stage = Some(LoginStage::FullFeature),
            v(ProtocolViolation::Transit),
        ),
        (
            |r| r.text = b"AuthMethod".to_vec(),
            v(ProtocolViolation::Text),
        ),
    ];
    for (mutate, expected) in cases {
        let mut login = Login::new(&d, start(), Millis(0));
        let mut r = rsp(
            LoginStage::SecurityNegotiation,
            Some(LoginStage::OperationalNegotiation),
            100,
            SEC_OK,
        );
        mutate(&mut r);
        assert_eq!(run(&mut login, &[r]), expected);
    }
    // StatSN must follow.
    let mut login = Login::new(&d, start(), Millis(0));
    let sec = rsp(
        LoginStage::SecurityNegotiation,
        Some(LoginStage::OperationalNegotiation),
        100,
        SEC_OK,
    );
    let op = rsp(
        LoginStage::OperationalNegotiation,
        Some(LoginStage::FullFeature),
        105,
        OP_OK,
    );
    assert_eq!(run(&mut login, &[sec, op]), v(ProtocolViolation::StatSn));
    // TSIH 0 and a wrong ExpCmdSN in the final response.
    for mutate in [
        |r: &mut Rsp| r.repr.tsih = 0,
        |r: &mut Rsp| r.repr.exp_cmd_sn = SerialNumber(9),
    ] {
        let mut login = Login::new(&d, start(), Millis(0));
        let sec = rsp(
            LoginStage::SecurityNegotiation,
            Some(LoginStage::OperationalNegotiation),
            100,
            SEC_OK,
        );
        let mut op = rsp(
            LoginStage::OperationalNegotiation,
            Some(LoginStage::FullFeature),
            101,
            OP_OK,
        );
        mutate(&mut op);
        assert!(matches!(
            run(&mut login, &[sec, op]),
            Err(LoginError::Protocol(_))
        ));
    }
}

#[test]
fn status_redirect_timeout_and_exchange_limit() {
    let d = desc();
    let mut login = Login::new(&d, start(), Millis(0));
    let mut r = rsp(
        LoginStage::SecurityNegotiation,
        None,
        0,
        "TargetAddress=192.0.2.9:3260,2\0",
    );
    r.repr.status_class = 1;
    r.repr.status_detail = 2;
    assert_eq!(
        run(&mut login, &[r]),
        Err(LoginError::Status(LoginStatus::MovedPermanently))
    );
    assert_eq!(login.redirect_address(), "192.0.2.9:3260,2");

    let mut login = Login::new(&d, start(), Millis(0));
    assert_eq!(login.poll_at(), Some(Millis(15_000)));
    assert_eq!(login.handle_timeout(Millis(14_999)), Ok(()));
    assert_eq!(
        login.handle_timeout(Millis(15_000)),
        Err(LoginError::Timeout)
    );
    assert_eq!(
        login.build_request(&mut [0u8; 512]),
        Err(LoginError::RequestOutstanding)
    );

    // A target that never transits: the exchange limit ends it.
    let mut login = Login::new(&d, start(), Millis(0));
    let mut script = vec![rsp(LoginStage::SecurityNegotiation, None, 100, SEC_OK)];
    for i in 1..20 {
        script.push(rsp(LoginStage::SecurityNegotiation, None, 100 + i, ""));
    }
    assert_eq!(
        run(&mut login, &script),
        Err(LoginError::Protocol(ProtocolViolation::TooManyExchanges))
    );
}

#[test]
fn auth_method_answers() {
    let d = desc();
    for (answer, expected) in [
        ("AuthMethod=CHAP\0", Err(LoginError::ChapRequired)),
        ("AuthMethod=Reject\0", Err(LoginError::AuthMethodRejected)),
        (
            "AuthMethod=SRP\0",
            Err(LoginError::Negotiation {
                key: "AuthMethod",
                error: NegotiationError::IllegalAnswer,
            }),
        ),
        (
            "TargetPortalGroupTag=1\0",
            Err(LoginError::Negotiation {
                key: "AuthMethod",
                error: NegotiationError::NoAnswer,
            }),
        ),
    ] {
        let mut login = Login::new(&d, start(), Millis(0));
        let r = rsp(LoginStage::SecurityNegotiation, None, 100, answer);
        assert_eq!(run(&mut login, &[r]), expected, "{answer:?}");
    }
}

#[test]
fn chap_challenges_checked() {
    let d = TargetDescription::parse(
        "node.name = iqn.2003-01.org.linux-iscsi.t1:sn.1\nnode.conn[0].address = 192.0.2.1\n\
         iface.initiatorname = iqn.2024-01.test.kverbs:init\n\
         node.session.auth.authmethod = CHAP\nnode.session.auth.username = u\n\
         node.session.auth.password = secretsecret\n",
    )
    .unwrap();
    for (challenge, expected) in [
        (
            "CHAP_A=7\0CHAP_I=1\0CHAP_C=0x01\0",
            LoginError::ChapAlgorithmRefused,
        ),
        (
            "CHAP_A=5\0CHAP_I=256\0CHAP_C=0x01\0",
            LoginError::ChapBadChallenge,
        ),
        (
            "CHAP_A=5\0CHAP_I=1\0CHAP_C=zz\0",
            LoginError::ChapBadChallenge,
        ),
        ("CHAP_A=5\0CHAP_C=0x01\0", LoginError::ChapBadChallenge),
    ] {
        let mut login = Login::new(&d, start(), Millis(0));
        let mut r0 = rsp(
            LoginStage::SecurityNegotiation,
            None,
            100,
            "AuthMethod=CHAP\0",
        );
        r0.repr.isid = d.isid.bytes();
        let mut r1 = rsp(LoginStage::SecurityNegotiation, None, 101, challenge);
        r1.repr.isid = d.isid.bytes();
        assert_eq!(run(&mut login, &[r0, r1]), Err(expected), "{challenge:?}");
    }
    // A good challenge (hex id) gives MD5(id ‖ secret ‖ challenge).
    let mut login = Login::new(&d, start(), Millis(0));
    let mut buf = [0u8; 4096];
    for (i, text) in [
        "AuthMethod=CHAP\0",
        "CHAP_A=5\0CHAP_I=0x0a\0CHAP_C=0bAQID\0",
    ]
    .into_iter()
    .enumerate()
    {
        login.build_request(&mut buf).unwrap();
        let mut r = rsp(LoginStage::SecurityNegotiation, None, 100 + i as u32, text);
        r.repr.isid = d.isid.bytes();
        assert_eq!(login.handle_response(&r.bytes()), Ok(LoginStep::Send));
    }
    let len = login.build_request(&mut buf).unwrap();
    let expected = chap::response(10, b"secretsecret", &[1, 2, 3]);
    let mut hex = [0u8; 34];
    let hex = chap::encode_hex(&expected, &mut hex).unwrap();
    assert_eq!(text_of(&buf, len), format!("CHAP_N=u\0CHAP_R={hex}\0"));
}

mod total {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Any Login Response bytes get a defined outcome, never a panic.
        #[test]
        fn handle_response_is_total(
            mut bytes in prop::collection::vec(any::<u8>(), 48..300),
            text in prop::collection::vec(prop::sample::select(vec![
                "AuthMethod=None\0", "AuthMethod=CHAP\0", "CHAP_A=5\0", "CHAP_I=7\0",
                "CHAP_C=0x0102\0", "MaxBurstLength=512\0", "RDMAExtensions=Yes\0",
                "X=1\0", "TargetPortalGroupTag=1\0", "=\0", "a=b\0",
            ]), 0..8),
        ) {
            let d = desc();
            let mut login = Login::new(&d, start(), Millis(0));
            let mut buf = [0u8; 4096];
            login.build_request(&mut buf).unwrap();
            bytes[0] = 0x23;
            bytes.truncate(48);
            // Mostly a response to our request, so the checks go deep.
            if bytes[2] & 3 != 0 {
                bytes[8..14].copy_from_slice(&[0x80, 0, 0, 0, 0, 1]);
                bytes[16..20].copy_from_slice(&0x77u32.to_be_bytes());
                bytes[3] = 0;
                bytes[36] = 0;
                bytes[1] &= 0x87;
            }
            for t in &text {
                bytes.extend_from_slice(t.as_bytes());
            }
            let len = (bytes.len() - 48) as u32;
            bytes[4] = 0;
            bytes[5..8].copy_from_slice(&len.to_be_bytes()[1..]);
            if let Ok(LoginStep::Send) = login.handle_response(&bytes) {
                prop_assert!(login.build_request(&mut buf).is_ok());
            }
        }
    }
}
