//! The initiator's iSCSI state machines (`storport_srp::iscsi`) driven
//! against the LIO-like target (`kverbs_tools::iscsi_target`), no RDMA:
//! the harness moves PDUs and plays the RDMA READ/WRITE the target asks
//! for by copying to and from the commands' buffers.
//!
//! Golden tests pin the login exchange and command PDUs byte for byte;
//! the sweep runs thousands of commands with random window sizes, target
//! pings, task management, async logouts and dropped connections, and
//! checks that every command completes exactly once with its data intact
//! or a truthful outcome. `ISCSI_SWEEP_SEEDS` / `ISCSI_SWEEP_COMMANDS`
//! scale it.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

use kverbs::platform::host::HostPlatform;
use kverbs_tools::iscsi_target::{
    ChapSecret, ConnId, IscsiTarget, Misbehaviour, Output, TargetConfig,
};
use kverbs_tools::scsi_target::{BlockSize, LunConfig, ScsiTarget};
use storport_srp::iscsi::Millis;
use storport_srp::iscsi::description::TargetDescription;
use storport_srp::iscsi::login::{
    AuthOutcome, Disposition, Login, LoginError, LoginStart, LoginStatus, LoginStep, Negotiated,
    NegotiationError,
};
use storport_srp::iscsi::recovery::Recovery;
use storport_srp::iscsi::session::{
    CommandSpec, PreparedCommand, Session, SessionEvents, SessionFailure, SessionState,
};
use storport_srp::miniport::transport::{
    CommandOutcome, CommandResult, FailureKind, ImmediateData, PrepareError, Residual, Tag,
    TargetState, TmfResponse,
};
use storport_srp::storport::{DataAccessError, DataDirection};
use storport_srp::wire::Lun;
use storport_srp::wire::iscsi::{AsyncEvent, SerialNumber, TaskAttr};

const TARGET: &str = "iqn.2003-01.org.linux-iscsi.t1:sn.1";
const INITIATOR: &str = "iqn.2024-01.test.kverbs:init";

fn description(extra: &str) -> TargetDescription {
    let record = format!(
        "node.name = {TARGET}\nnode.conn[0].address = 192.0.2.10\n\
         iface.initiatorname = {INITIATOR}\nnode.session.isid = 800000000001\n{extra}"
    );
    TargetDescription::parse(&record).expect("valid description")
}

fn scsi_target() -> Arc<ScsiTarget> {
    Arc::new(ScsiTarget::single(7, LunConfig::new(BlockSize::B512, 8192)).expect("lun"))
}

fn start(cmd_sn: u32) -> LoginStart {
    LoginStart {
        tsih: 0,
        cid: 0,
        itt: 0x7000_0000 | cmd_sn,
        cmd_sn: SerialNumber(cmd_sn),
        mutual_challenge: Some((0x2a, [0x11; 16])),
    }
}

/// Runs a login through the target; returns the negotiated result and
/// the PDUs exchanged (requests and responses, in order).
fn login_exchange(
    desc: &TargetDescription,
    target: &mut IscsiTarget,
    conn: ConnId,
    cmd_sn: u32,
) -> (Result<Negotiated, LoginError>, Vec<Vec<u8>>) {
    let mut login = Login::new(desc, start(cmd_sn), Millis(0));
    let mut trace = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let len = match login.build_request(&mut buf) {
            Ok(len) => len,
            Err(e) => return (Err(e), trace),
        };
        // One login PDU outstanding at a time.
        assert_eq!(
            login.build_request(&mut buf),
            Err(LoginError::RequestOutstanding)
        );
        trace.push(buf[..len].to_vec());
        let outputs = target.receive(conn, &buf[..len]);
        let Some(rsp) = outputs.iter().find_map(|o| match o {
            Output::Send(c, pdu) if *c == conn => Some(pdu.clone()),
            _ => None,
        }) else {
            panic!("no login response: {outputs:?}");
        };
        trace.push(rsp.clone());
        match login.handle_response(&rsp) {
            Ok(LoginStep::Send) => {}
            Ok(LoginStep::Complete(neg)) => return (Ok(neg), trace),
            Err(e) => {
                if let LoginError::Status(LoginStatus::MovedTemporarily) = e {
                    assert_eq!(login.redirect_address(), "192.0.2.99:3260,1");
                }
                return (Err(e), trace);
            }
        }
    }
}

fn text_of(pdu: &[u8]) -> String {
    String::from_utf8(pdu[48..].to_vec()).expect("login text is UTF-8")
}

// ---------------------------------------------------------------------
// Golden tests

#[test]
fn golden_login_against_lio() {
    let desc = description("");
    let mut target = IscsiTarget::new(TargetConfig::lio(TARGET), scsi_target());
    let conn = target.accept();
    let (neg, trace) = login_exchange(&desc, &mut target, conn, 1);
    let neg = neg.expect("login succeeds");
    assert_eq!(trace.len(), 4, "one security and one operational exchange");

    // Security stage request: BHS byte for byte.
    let mut bhs = [0u8; 48];
    bhs[0] = 0x43; // I | Login
    bhs[1] = 0x81; // T, CSG 0, NSG 1
    let text0 = format!(
        "InitiatorName={INITIATOR}\0SessionType=Normal\0TargetName={TARGET}\0AuthMethod=None\0"
    );
    bhs[5..8].copy_from_slice(&(text0.len() as u32).to_be_bytes()[1..]);
    bhs[8..14].copy_from_slice(&[0x80, 0, 0, 0, 0, 1]);
    bhs[16..20].copy_from_slice(&0x7000_0001u32.to_be_bytes());
    bhs[24..28].copy_from_slice(&1u32.to_be_bytes());
    assert_eq!(&trace[0][..48], &bhs);
    assert_eq!(text_of(&trace[0]), text0);

    // LIO's answer: AuthMethod, then its own TargetAlias and TPGT.
    assert_eq!(trace[1][0], 0x23);
    assert_eq!(trace[1][1], 0x81);
    assert_eq!(
        text_of(&trace[1]),
        "AuthMethod=None\0TargetAlias=LIO Target\0TargetPortalGroupTag=1\0"
    );

    // Operational stage.
    assert_eq!(trace[2][1], 0x87); // T, CSG 1, NSG 3
    assert_eq!(&trace[2][28..32], &0x1001u32.to_be_bytes(), "ExpStatSN");
    assert_eq!(
        text_of(&trace[2]),
        "HeaderDigest=None\0DataDigest=None\0MaxConnections=1\0InitialR2T=No\0\
         ImmediateData=Yes\0MaxBurstLength=16776192\0FirstBurstLength=262144\0\
         DefaultTime2Wait=2\0DefaultTime2Retain=0\0MaxOutstandingR2T=1\0\
         DataPDUInOrder=Yes\0DataSequenceInOrder=Yes\0ErrorRecoveryLevel=0\0\
         RDMAExtensions=Yes\0InitiatorRecvDataSegmentLength=8192\0\
         TargetRecvDataSegmentLength=8192\0MaxOutstandingUnexpectedPDUs=0\0"
    );
    // LIO's answer, in its table order; the reply-optional booleans
    // (DataPDUInOrder, DataSequenceInOrder) left out; the unknown key last.
    assert_eq!(trace[3][1], 0x87);
    assert_eq!(u16::from_be_bytes([trace[3][14], trace[3][15]]), 1, "TSIH");
    assert_eq!(
        text_of(&trace[3]),
        "HeaderDigest=None\0DataDigest=None\0MaxConnections=1\0InitialR2T=Yes\0\
         ImmediateData=Yes\0MaxBurstLength=262144\0FirstBurstLength=65536\0\
         DefaultTime2Wait=2\0DefaultTime2Retain=0\0MaxOutstandingR2T=1\0\
         ErrorRecoveryLevel=0\0RDMAExtensions=Yes\0InitiatorRecvDataSegmentLength=8192\0\
         TargetRecvDataSegmentLength=8192\0MaxOutstandingUnexpectedPDUs=NotUnderstood\0"
    );

    assert_eq!(neg.tsih, 1);
    assert_eq!(neg.tpgt, Some(1));
    assert_eq!(neg.auth, AuthOutcome::None);
    assert!(neg.immediate_data);
    assert!(neg.initial_r2t, "LIO's InitialR2T=Yes wins (OR)");
    assert_eq!(neg.first_burst_length, 65536);
    assert_eq!(neg.max_burst_length, 262_144);
    assert_eq!(neg.max_send_data_segment, 8192);
    assert_eq!(neg.max_recv_data_segment, 8192);
    assert_eq!(neg.max_outstanding_unexpected_pdus, None);
    assert_eq!(neg.cmd_sn, SerialNumber(1));
    assert_eq!(neg.exp_cmd_sn, SerialNumber(1));
    assert_eq!(neg.max_cmd_sn, SerialNumber(64), "queue depth 64");
    assert_eq!(neg.exp_stat_sn, SerialNumber(0x1002));
    assert!(target.is_full_feature(conn));
}

#[test]
fn golden_chap_login() {
    let desc = description(
        "node.session.auth.authmethod = CHAP\nnode.session.auth.username = kvuser\n\
         node.session.auth.password = initiatorsecret1\n",
    );
    let mut config = TargetConfig::lio(TARGET);
    config.auth_required = true;
    config.chap = Some(ChapSecret {
        user: "kvuser".into(),
        secret: b"initiatorsecret1".to_vec(),
    });
    let mut target = IscsiTarget::new(config, scsi_target());
    let conn = target.accept();
    let (neg, trace) = login_exchange(&desc, &mut target, conn, 9);
    assert_eq!(neg.expect("CHAP login").auth, AuthOutcome::Chap);
    assert!(text_of(&trace[0]).ends_with("AuthMethod=CHAP,None\0"));
    assert!(text_of(&trace[1]).starts_with("AuthMethod=CHAP\0"));
    assert_eq!(trace[1][1] & 0x80, 0, "no transit before CHAP");
    assert_eq!(text_of(&trace[2]), "CHAP_A=5\0");
    let challenge = text_of(&trace[3]);
    assert!(
        challenge.starts_with("CHAP_A=5\0CHAP_I=1\0CHAP_C=0x"),
        "{challenge}"
    );
    // The response is MD5(id ‖ secret ‖ challenge).
    let c_hex = challenge
        .split('\0')
        .find_map(|p| p.strip_prefix("CHAP_C=0x"))
        .unwrap();
    let c: Vec<u8> = (0..c_hex.len() / 2)
        .map(|i| u8::from_str_radix(&c_hex[2 * i..2 * i + 2], 16).unwrap())
        .collect();
    let r = storport_srp::iscsi::chap::response(1, b"initiatorsecret1", &c);
    let r_hex: String = r.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(
        text_of(&trace[4]),
        format!("CHAP_N=kvuser\0CHAP_R=0x{r_hex}\0")
    );
    assert_eq!(trace[4][1], 0x81);
}

#[test]
fn mutual_chap_login() {
    let desc = description(
        "node.session.auth.authmethod = CHAP\nnode.session.auth.username = kvuser\n\
         node.session.auth.password = initiatorsecret1\n\
         node.session.auth.username_in = lio\nnode.session.auth.password_in = targetsecret22\n",
    );
    let mut config = TargetConfig::lio(TARGET);
    config.auth_required = true;
    config.chap = Some(ChapSecret {
        user: "kvuser".into(),
        secret: b"initiatorsecret1".to_vec(),
    });
    config.mutual_chap = Some(ChapSecret {
        user: "lio".into(),
        secret: b"targetsecret22".to_vec(),
    });
    let mut target = IscsiTarget::new(config.clone(), scsi_target());
    let conn = target.accept();
    let (neg, trace) = login_exchange(&desc, &mut target, conn, 1);
    assert_eq!(neg.expect("mutual CHAP").auth, AuthOutcome::MutualChap);
    assert!(
        text_of(&trace[0]).ends_with("AuthMethod=CHAP\0"),
        "CHAP only"
    );
    assert!(text_of(&trace[4]).contains("CHAP_I=42\0CHAP_C=0x1111"));

    // A target that proves itself with the wrong secret is refused.
    config.mutual_chap = Some(ChapSecret {
        user: "lio".into(),
        secret: b"wrongsecret999".to_vec(),
    });
    let mut target = IscsiTarget::new(config.clone(), scsi_target());
    let conn = target.accept();
    assert_eq!(
        login_exchange(&desc, &mut target, conn, 1).0.unwrap_err(),
        LoginError::ChapTargetAuthFailed
    );
    config.mutual_chap = Some(ChapSecret {
        user: "impostor".into(),
        secret: b"targetsecret22".to_vec(),
    });
    let mut target = IscsiTarget::new(config, scsi_target());
    let conn = target.accept();
    assert_eq!(
        login_exchange(&desc, &mut target, conn, 1).0.unwrap_err(),
        LoginError::ChapTargetName
    );
}

// ---------------------------------------------------------------------
// Login error paths

fn failing_login(desc: &TargetDescription, config: TargetConfig, m: Misbehaviour) -> LoginError {
    let mut target = IscsiTarget::new(config, scsi_target());
    target.misbehaviour = m;
    let conn = target.accept();
    login_exchange(desc, &mut target, conn, 1)
        .0
        .expect_err("login must fail")
}

#[test]
fn login_status_classes() {
    let desc = description("");
    let lio = || TargetConfig::lio(TARGET);
    let reject = |class, detail| Misbehaviour {
        reject_login: Some((class, detail)),
        redirect_address: Some("192.0.2.99:3260,1".into()),
        ..Misbehaviour::default()
    };
    let e = failing_login(&desc, lio(), reject(1, 1));
    assert_eq!(e, LoginError::Status(LoginStatus::MovedTemporarily));
    assert_eq!(e.disposition(), Disposition::Redirect);
    let e = failing_login(&desc, lio(), reject(1, 2));
    assert_eq!(e, LoginError::Status(LoginStatus::MovedPermanently));
    let e = failing_login(&desc, lio(), reject(2, 2));
    assert_eq!(
        e,
        LoginError::Status(LoginStatus::InitiatorError(LoginStatus::FORBIDDEN))
    );
    assert_eq!(e.disposition(), Disposition::Fatal);
    let e = failing_login(&desc, lio(), reject(3, 1));
    assert_eq!(e, LoginError::Status(LoginStatus::TargetError(1)));
    assert_eq!(e.disposition(), Disposition::Retry);

    // The target's own checks: wrong target name, ACL.
    let mut other = lio();
    other.target_name = "iqn.2003-01.org.linux-iscsi.t2:sn.2".into();
    assert_eq!(
        failing_login(&desc, other, Misbehaviour::default()),
        LoginError::Status(LoginStatus::InitiatorError(LoginStatus::NOT_FOUND))
    );
    let mut acl = lio();
    acl.allowed_initiators = Some(vec!["iqn.2024-01.test.kverbs:other".into()]);
    assert_eq!(
        failing_login(&desc, acl, Misbehaviour::default()),
        LoginError::Status(LoginStatus::InitiatorError(LoginStatus::FORBIDDEN))
    );
}

#[test]
fn login_negotiation_failures() {
    let desc = description("");
    let lio = || TargetConfig::lio(TARGET);
    assert_eq!(
        failing_login(
            &desc,
            lio(),
            Misbehaviour {
                rdma_extensions_no: true,
                ..Misbehaviour::default()
            }
        ),
        LoginError::Negotiation {
            key: "RDMAExtensions",
            error: NegotiationError::Unacceptable
        }
    );
    assert_eq!(
        failing_login(
            &desc,
            lio(),
            Misbehaviour {
                digest: Some("CRC32C".into()),
                ..Misbehaviour::default()
            }
        ),
        LoginError::Negotiation {
            key: "HeaderDigest",
            error: NegotiationError::Unacceptable
        }
    );
    // The target demands CHAP; no credentials are configured.
    assert_eq!(
        failing_login(
            &desc,
            lio(),
            Misbehaviour {
                demand_chap: true,
                ..Misbehaviour::default()
            }
        ),
        LoginError::ChapRequired
    );
    assert_eq!(LoginError::ChapRequired.disposition(), Disposition::Fatal);
    // Authentication enforced, initiator offers only None: LIO's 0201.
    let mut enforced = lio();
    enforced.auth_required = true;
    assert_eq!(
        failing_login(&desc, enforced.clone(), Misbehaviour::default()),
        LoginError::Status(LoginStatus::InitiatorError(LoginStatus::AUTH_FAILED))
    );
    // Wrong CHAP secret: LIO's 0201 after CHAP_R.
    enforced.chap = Some(ChapSecret {
        user: "kvuser".into(),
        secret: b"anothersecret".to_vec(),
    });
    let chap_desc = description(
        "node.session.auth.authmethod = CHAP\nnode.session.auth.username = kvuser\n\
         node.session.auth.password = initiatorsecret1\n",
    );
    assert_eq!(
        failing_login(&chap_desc, enforced, Misbehaviour::default()),
        LoginError::Status(LoginStatus::InitiatorError(LoginStatus::AUTH_FAILED))
    );
    // The TPGT the administrator expects is checked.
    let tpgt = description("node.tpgt = 5\n");
    assert_eq!(
        failing_login(&tpgt, lio(), Misbehaviour::default()),
        LoginError::TpgtMismatch {
            expected: 5,
            received: 1
        }
    );
}

#[test]
fn target_proposals_are_answered() {
    // A target whose values differ gets answered in a second exchange
    // only if it proposes: LIO proposes nothing the initiator offered, so
    // check a target with a smaller burst and ImmediateData=No.
    let desc = description("node.session.iscsi.InitialR2T = Yes\n");
    let mut config = TargetConfig::lio(TARGET);
    config.values.immediate_data = false;
    config.values.max_burst_length = 4096;
    config.values.first_burst_length = 4096;
    let mut target = IscsiTarget::new(config, scsi_target());
    let conn = target.accept();
    let (neg, trace) = login_exchange(&desc, &mut target, conn, 1);
    let neg = neg.unwrap();
    assert!(!neg.immediate_data);
    assert!(neg.initial_r2t);
    assert_eq!(neg.max_burst_length, 4096);
    assert_eq!(neg.first_burst_length, 4096);
    // InitialR2T=Yes offered and kept: reply-optional for LIO.
    assert!(!text_of(&trace[3]).contains("InitialR2T"));
}

// ---------------------------------------------------------------------
// The full feature phase: a harness

#[derive(Default)]
struct Recorder {
    done: Vec<(Tag, CommandOutcome, Residual, Vec<u8>)>,
    tmfs: Vec<(Tag, TmfResponse)>,
    window_open: u32,
}

impl SessionEvents for Recorder {
    fn command_done(&mut self, tag: Tag, result: &CommandResult<'_>) {
        self.done
            .push((tag, result.outcome, result.residual, result.sense.to_vec()));
    }
    fn tmf_done(&mut self, tag: Tag, response: TmfResponse) {
        self.tmfs.push((tag, response));
    }
    fn window_open(&mut self) {
        self.window_open += 1;
    }
}

struct Buffer<'a>(&'a [u8]);

impl ImmediateData for Buffer<'_> {
    fn read(&self, offset: u32, out: &mut [u8]) -> Result<(), DataAccessError> {
        let start = offset as usize;
        let src = self
            .0
            .get(start..start + out.len())
            .ok_or(DataAccessError::OutOfBounds)?;
        out.copy_from_slice(src);
        Ok(())
    }
}

/// A command's buffers, as the RDMA half would register them.
struct Io {
    write: Vec<u8>,
    read: Vec<u8>,
    slot: usize,
    is_write: bool,
}

struct Harness {
    desc: TargetDescription,
    target: IscsiTarget,
    conn: ConnId,
    session: Session,
    now: Millis,
    ios: HashMap<u32, Io>,
    itt_of: HashMap<Tag, u32>,
    rec: Recorder,
    /// PDUs from the target not yet delivered (an RC QP keeps order).
    to_initiator: VecDeque<Vec<u8>>,
    next_cmd_sn: u32,
    platform: HostPlatform,
    /// What a sweep saw happen (outcomes, reconnects, refusals).
    stats: BTreeMap<&'static str, usize>,
}

impl Harness {
    fn new(target: IscsiTarget, desc: TargetDescription) -> Self {
        let platform = HostPlatform::new();
        let mut h = Self {
            desc,
            target,
            conn: ConnId(0),
            session: dummy_session(&platform),
            now: Millis(0),
            ios: HashMap::new(),
            itt_of: HashMap::new(),
            rec: Recorder::default(),
            to_initiator: VecDeque::new(),
            next_cmd_sn: 1,
            platform,
            stats: BTreeMap::new(),
        };
        h.login().expect("first login");
        h
    }

    fn login(&mut self) -> Result<(), LoginError> {
        self.conn = self.target.accept();
        let (neg, _) = login_exchange(&self.desc, &mut self.target, self.conn, self.next_cmd_sn);
        let neg = neg?;
        let timeouts = self.desc.timeouts;
        let cmds_max = self.desc.cmds_max;
        let now = self.now;
        self.session = self
            .platform
            .run_passive(|p| Session::new(&neg, &timeouts, cmds_max, 0, now, p))
            .expect("table");
        Ok(())
    }

    fn apply(&mut self, outputs: Vec<Output>) {
        let mut queue: VecDeque<Output> = outputs.into();
        while let Some(o) = queue.pop_front() {
            match o {
                Output::Send(c, pdu) if c == self.conn => self.to_initiator.push_back(pdu),
                Output::Send(..) | Output::Close(_) => {}
                Output::RdmaWrite {
                    conn,
                    itt,
                    offset,
                    data,
                } if conn == self.conn => {
                    let io = self.ios.get_mut(&itt).expect("RDMA WRITE for a live task");
                    let start = offset as usize;
                    io.read[start..start + data.len()].copy_from_slice(&data);
                }
                Output::RdmaRead {
                    conn,
                    itt,
                    offset,
                    len,
                } if conn == self.conn => {
                    let io = self.ios.get(&itt).expect("RDMA READ for a live task");
                    let data = io.write[offset as usize..(offset + len) as usize].to_vec();
                    let more = self.target.rdma_read_done(conn, itt, &data);
                    queue.extend(more);
                }
                _ => {}
            }
        }
    }

    /// Sends every queued control PDU to the target.
    fn flush_control(&mut self) {
        let mut buf = [0u8; 256];
        while let Some(len) = self.session.poll_transmit(self.now, &mut buf) {
            let out = self.target.receive(self.conn, &buf[..len]);
            self.apply(out);
        }
    }

    /// Delivers up to `n` PDUs to the initiator.
    fn deliver(&mut self, n: usize) -> Result<(), SessionFailure> {
        for _ in 0..n {
            let Some(pdu) = self.to_initiator.pop_front() else {
                break;
            };
            self.session.handle_pdu(self.now, &pdu, &mut self.rec)?;
            self.flush_control();
        }
        Ok(())
    }

    fn deliver_all(&mut self) -> Result<(), SessionFailure> {
        while !self.to_initiator.is_empty() {
            self.deliver(usize::MAX)?;
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn submit(
        &mut self,
        tag: Tag,
        cdb: &[u8],
        dir: DataDirection,
        write: Vec<u8>,
        read_len: usize,
        slot: usize,
    ) -> Result<u32, PrepareError> {
        let len = if dir == DataDirection::Out {
            write.len()
        } else {
            read_len
        } as u32;
        let spec = CommandSpec {
            tag,
            lun: Lun::from_index(0).unwrap(),
            cdb,
            direction: dir,
            transfer_length: len,
            attr: TaskAttr::Simple,
            immediate_delivery: false,
        };
        let mut buf = vec![0u8; 48 + 8192 + 300];
        let prepared = self
            .session
            .prepare_command(self.now, &spec, &Buffer(&write), &mut buf)?;
        let mut data_outs = Vec::new();
        for k in 0.. {
            let mut b = vec![0u8; 48 + 8192];
            match self
                .session
                .build_data_out(&prepared, spec.lun, k, &Buffer(&write), &mut b)
            {
                Ok(Some(n)) => {
                    b.truncate(n);
                    data_outs.push(b);
                }
                Ok(None) => break,
                Err(e) => panic!("Data-Out {k}: {e:?}"),
            }
        }
        let itt = prepared.itt();
        let pdu_len = prepared.pdu_len();
        self.ios.insert(
            itt,
            Io {
                write,
                read: vec![0u8; read_len],
                slot,
                is_write: dir == DataDirection::Out,
            },
        );
        self.itt_of.insert(tag, itt);
        let posted = self
            .session
            .post_command(self.now, prepared, &mut buf)
            .expect("post");
        assert_eq!(posted.itt, itt);
        let out = self.target.receive(self.conn, &buf[..pdu_len]);
        self.apply(out);
        for d in data_outs {
            let out = self.target.receive(self.conn, &d);
            self.apply(out);
        }
        Ok(itt)
    }
}

fn dummy_session(platform: &HostPlatform) -> Session {
    let neg = Negotiated {
        tsih: 1,
        tpgt: None,
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
        cmd_sn: SerialNumber(1),
        exp_cmd_sn: SerialNumber(1),
        max_cmd_sn: SerialNumber(1),
        exp_stat_sn: SerialNumber(1),
    };
    platform
        .run_passive(|p| Session::new(&neg, &Default::default(), 2, 0, Millis(0), p))
        .unwrap()
}

fn rw10(write: bool, lba: u32, blocks: u16) -> [u8; 10] {
    let mut cdb = [0u8; 10];
    cdb[0] = if write { 0x2A } else { 0x28 };
    cdb[2..6].copy_from_slice(&lba.to_be_bytes());
    cdb[7..9].copy_from_slice(&blocks.to_be_bytes());
    cdb
}

fn rw16(write: bool, lba: u64, blocks: u32) -> [u8; 16] {
    let mut cdb = [0u8; 16];
    cdb[0] = if write { 0x8A } else { 0x88 };
    cdb[2..10].copy_from_slice(&lba.to_be_bytes());
    cdb[10..14].copy_from_slice(&blocks.to_be_bytes());
    cdb
}

#[test]
fn write_then_read_back_with_immediate_data() {
    let mut h = Harness::new(
        IscsiTarget::new(TargetConfig::lio(TARGET), scsi_target()),
        description(""),
    );
    // 4 KiB write: all of it immediate (FirstBurst 64 KiB, segment 8 KiB).
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
    h.submit(
        Tag(1),
        &rw10(true, 16, 8),
        DataDirection::Out,
        data.clone(),
        0,
        0,
    )
    .unwrap();
    // 64 KiB write: 8 KiB immediate, the rest by RDMA READ (InitialR2T).
    let big: Vec<u8> = (0..65536u32).map(|i| (i % 251) as u8).collect();
    h.submit(
        Tag(2),
        &rw10(true, 100, 128),
        DataDirection::Out,
        big.clone(),
        0,
        1,
    )
    .unwrap();
    h.deliver_all().unwrap();
    assert_eq!(h.target.counters().immediate_bytes, 4096 + 8192);
    h.submit(
        Tag(3),
        &rw10(false, 16, 8),
        DataDirection::In,
        vec![],
        4096,
        0,
    )
    .unwrap();
    h.submit(
        Tag(4),
        &rw16(false, 100, 128),
        DataDirection::In,
        vec![],
        65536,
        1,
    )
    .unwrap();
    let read3 = h.itt_of[&Tag(3)];
    let read4 = h.itt_of[&Tag(4)];
    h.deliver_all().unwrap();
    assert_eq!(h.ios[&read3].read, data);
    assert_eq!(h.ios[&read4].read, big);
    let outcomes: Vec<_> = h.rec.done.iter().map(|d| (d.0, d.1)).collect();
    assert_eq!(
        outcomes,
        [1, 2, 3, 4].map(|t| (Tag(t), CommandOutcome::Scsi(0)))
    );
    assert_eq!(h.session.commands_outstanding(), 0);
}

#[test]
fn check_condition_sense_and_residual() {
    let mut h = Harness::new(
        IscsiTarget::new(TargetConfig::lio(TARGET), scsi_target()),
        description(""),
    );
    // READ beyond the end: CHECK CONDITION, ILLEGAL REQUEST, LBA out of
    // range; sense arrives with its 2-byte length stripped.
    h.submit(
        Tag(5),
        &rw10(false, 9000, 1),
        DataDirection::In,
        vec![],
        512,
        0,
    )
    .unwrap();
    // INQUIRY with a 255-byte buffer: an underflow residual.
    let inquiry = [0x12, 0, 0, 0, 255, 0];
    h.submit(Tag(6), &inquiry, DataDirection::In, vec![], 255, 1)
        .unwrap();
    h.deliver_all().unwrap();
    let (_, outcome, _, sense) = &h.rec.done[0];
    assert_eq!(*outcome, CommandOutcome::Scsi(2));
    assert_eq!(sense[0] & 0x7F, 0x70, "fixed format");
    assert_eq!(sense[2] & 0x0F, 0x05, "ILLEGAL REQUEST");
    assert_eq!(sense[12], 0x21, "LBA out of range");
    let (_, outcome, residual, _) = &h.rec.done[1];
    assert_eq!(*outcome, CommandOutcome::Scsi(0));
    assert!(matches!(residual, Residual::Underrun(n) if *n > 0));
}

#[test]
fn extended_cdb_travels_in_an_ahs() {
    let mut h = Harness::new(
        IscsiTarget::new(TargetConfig::lio(TARGET), scsi_target()),
        description(""),
    );
    // A 32-byte CDB (variable length opcode 0x7F): the target sees all of
    // it and answers INVALID COMMAND OPERATION CODE — the PDU parsed.
    let mut cdb = [0u8; 32];
    cdb[0] = 0x7F;
    cdb[7] = 24;
    h.submit(Tag(9), &cdb, DataDirection::None, vec![], 0, 0)
        .unwrap();
    h.deliver_all().unwrap();
    assert_eq!(h.rec.done[0].1, CommandOutcome::Scsi(2));
    assert_eq!(h.rec.done[0].3[12], 0x20, "invalid command operation code");
}

#[test]
fn closed_window_is_busy_then_opens() {
    let mut config = TargetConfig::lio(TARGET);
    config.queue_depth = 2;
    let mut h = Harness::new(IscsiTarget::new(config, scsi_target()), description(""));
    h.target.misbehaviour.withhold_max_cmd_sn = 2;
    let inq = [0x00, 0, 0, 0, 0, 0]; // TEST UNIT READY
    h.submit(Tag(1), &inq, DataDirection::None, vec![], 0, 0)
        .unwrap();
    h.submit(Tag(2), &inq, DataDirection::None, vec![], 0, 1)
        .unwrap();
    assert_eq!(
        h.submit(Tag(3), &inq, DataDirection::None, vec![], 0, 2),
        Err(PrepareError::Busy),
        "window of two is full"
    );
    h.deliver_all().unwrap();
    assert_eq!(h.rec.done.len(), 2);
    // The responses withheld MaxCmdSN: still closed, still busy.
    assert_eq!(
        h.submit(Tag(3), &inq, DataDirection::None, vec![], 0, 2),
        Err(PrepareError::Busy)
    );
    assert_eq!(h.rec.window_open, 0);
    // The target opens it with a NOP-In: the session says so once.
    let out = h.target.open_window(h.conn);
    h.apply(out);
    h.deliver_all().unwrap();
    assert_eq!(h.rec.window_open, 1);
    h.submit(Tag(3), &inq, DataDirection::None, vec![], 0, 2)
        .unwrap();
    h.deliver_all().unwrap();
    assert_eq!(h.rec.done.len(), 3);
}

#[test]
fn window_closed_too_long_fails_the_session() {
    let mut config = TargetConfig::lio(TARGET);
    config.queue_depth = 1;
    let mut h = Harness::new(
        IscsiTarget::new(config, scsi_target()),
        description(
            "node.session.timeo.window_timeout = 10\nnode.conn[0].timeo.noop_out_interval = 0\n",
        ),
    );
    h.target.misbehaviour.withhold_max_cmd_sn = 1;
    let tur = [0u8; 6];
    h.submit(Tag(1), &tur, DataDirection::None, vec![], 0, 0)
        .unwrap();
    h.deliver_all().unwrap();
    h.now = Millis(1000);
    assert_eq!(
        h.submit(Tag(2), &tur, DataDirection::None, vec![], 0, 0),
        Err(PrepareError::Busy)
    );
    assert_eq!(h.session.poll_at(), Some(Millis(11_000)));
    assert_eq!(h.session.handle_timeout(Millis(10_999)), Ok(()));
    assert_eq!(
        h.session.handle_timeout(Millis(11_000)),
        Err(SessionFailure::WindowStalled)
    );
}

#[test]
fn target_pings_are_answered_and_keepalive_runs() {
    let mut h = Harness::new(
        IscsiTarget::new(TargetConfig::lio(TARGET), scsi_target()),
        description(
            "node.conn[0].timeo.noop_out_interval = 5\nnode.conn[0].timeo.noop_out_timeout = 3\n",
        ),
    );
    for _ in 0..3 {
        let out = h.target.send_ping(h.conn);
        h.apply(out);
    }
    assert_eq!(h.target.outstanding_pings(h.conn), 3);
    h.deliver_all().unwrap();
    assert_eq!(h.target.outstanding_pings(h.conn), 0);
    assert_eq!(h.target.counters().ping_replies, 3);
    // Idle for the interval: the initiator pings, the target answers.
    assert_eq!(h.session.poll_at(), Some(Millis(5000)));
    h.now = Millis(5000);
    h.session.handle_timeout(h.now).unwrap();
    h.flush_control();
    assert_eq!(h.target.counters().initiator_pings, 1);
    h.deliver_all().unwrap();
    // Next ping at 10 s; this one goes unanswered.
    h.now = Millis(10_000);
    h.session.handle_timeout(h.now).unwrap();
    let mut buf = [0u8; 64];
    assert!(
        h.session.poll_transmit(h.now, &mut buf).is_some(),
        "ping queued"
    );
    assert_eq!(h.session.poll_at(), Some(Millis(13_000)));
    assert_eq!(
        h.session.handle_timeout(Millis(13_000)),
        Err(SessionFailure::PingTimeout)
    );
}

#[test]
fn abort_task_and_lun_reset() {
    let mut h = Harness::new(
        IscsiTarget::new(TargetConfig::lio(TARGET), scsi_target()),
        description(""),
    );
    h.target.misbehaviour.hold_responses = true;
    let tur = [0u8; 6];
    for t in 1..=4 {
        h.submit(Tag(t), &tur, DataDirection::None, vec![], 0, t as usize)
            .unwrap();
    }
    assert_eq!(h.target.tasks_in_progress(h.conn), 4);
    // ABORT TASK for tag 2: the victim completes Aborted, then the TMF.
    h.session.abort_task(h.now, Tag(100), Tag(2)).unwrap();
    assert_eq!(
        h.session.abort_task(h.now, Tag(101), Tag(77)),
        Err(storport_srp::miniport::transport::TmfRefused::UnknownTask)
    );
    h.flush_control();
    h.deliver_all().unwrap();
    assert_eq!(
        h.rec.done,
        [(Tag(2), CommandOutcome::Aborted, Residual::None, vec![])]
    );
    assert_eq!(h.rec.tmfs, [(Tag(100), TmfResponse::Complete)]);
    // LUN RESET: the three others complete Reset, then the TMF.
    h.session
        .reset_lun(h.now, Tag(102), Lun::from_index(0).unwrap())
        .unwrap();
    h.flush_control();
    h.deliver_all().unwrap();
    let reset: Vec<_> = h.rec.done[1..].iter().map(|d| (d.0, d.1)).collect();
    assert_eq!(reset.len(), 3);
    assert!(reset.iter().all(|(_, o)| *o == CommandOutcome::Reset));
    assert_eq!(h.rec.tmfs[1], (Tag(102), TmfResponse::Complete));
    assert_eq!(h.target.counters().aborted, 4);
    assert_eq!(h.session.commands_outstanding(), 0);
    // Nothing held is left at the target either.
    assert!(h.target.release_responses(h.conn).is_empty());
}

#[test]
fn async_logout_request_then_reinstatement() {
    let mut h = Harness::new(
        IscsiTarget::new(TargetConfig::lio(TARGET), scsi_target()),
        description(""),
    );
    h.target.misbehaviour.hold_responses = true;
    let tur = [0u8; 6];
    h.submit(Tag(1), &tur, DataDirection::None, vec![], 0, 0)
        .unwrap();
    let out = h
        .target
        .send_async(h.conn, AsyncEvent::RequestLogout, 0, 10);
    h.apply(out);
    h.deliver_all().unwrap();
    assert_eq!(h.session.state(), SessionState::LogoutRequested);
    assert_eq!(
        h.submit(Tag(2), &tur, DataDirection::None, vec![], 0, 0),
        Err(PrepareError::Blocked)
    );
    // The outstanding command finishes; the logout goes out by itself.
    let out = h.target.release_responses(h.conn);
    h.apply(out);
    h.deliver_all().unwrap();
    assert_eq!(h.target.counters().logouts, 1);
    assert_eq!(h.session.state(), SessionState::LoggedOut { time2wait: 2 });
    assert_eq!(h.rec.done.len(), 1);
    // Reinstatement: same ISID, TSIH 0; the session goes on.
    h.next_cmd_sn = 500;
    h.target.misbehaviour.hold_responses = false;
    h.login().unwrap();
    h.submit(Tag(2), &tur, DataDirection::None, vec![], 0, 0)
        .unwrap();
    h.deliver_all().unwrap();
    assert_eq!(h.rec.done.len(), 2);
    assert_eq!(h.target.counters().logins, 2);
}

#[test]
fn logout_deadline_when_commands_hang() {
    let mut h = Harness::new(
        IscsiTarget::new(TargetConfig::lio(TARGET), scsi_target()),
        description("node.conn[0].timeo.noop_out_interval = 0\n"),
    );
    h.target.misbehaviour.hold_responses = true;
    h.submit(Tag(1), &[0u8; 6], DataDirection::None, vec![], 0, 0)
        .unwrap();
    let out = h.target.send_async(h.conn, AsyncEvent::RequestLogout, 0, 8);
    h.apply(out);
    h.deliver_all().unwrap();
    // Half of Parameter3 later, the logout goes out anyway.
    assert_eq!(h.session.poll_at(), Some(Millis(4000)));
    h.session.handle_timeout(Millis(4000)).unwrap();
    assert_eq!(h.session.state(), SessionState::LoggingOut);
    h.flush_control();
    h.deliver_all().unwrap();
    assert!(matches!(h.session.state(), SessionState::LoggedOut { .. }));
    // The command the target dropped with the session is failed by the
    // engine's teardown, exactly once.
    h.session.terminate_all(
        CommandOutcome::Failed(FailureKind::ConnectionReset),
        FailureKind::ConnectionReset,
        &mut h.rec,
    );
    assert_eq!(
        h.rec.done,
        [(
            Tag(1),
            CommandOutcome::Failed(FailureKind::ConnectionReset),
            Residual::None,
            vec![]
        )]
    );
}

#[test]
fn target_drop_and_statsn_gap_fail_the_session() {
    let mut h = Harness::new(
        IscsiTarget::new(TargetConfig::lio(TARGET), scsi_target()),
        description(""),
    );
    let out = h
        .target
        .send_async(h.conn, AsyncEvent::DroppingConnection, 3, 0);
    h.apply(out);
    assert_eq!(
        h.deliver_all(),
        Err(SessionFailure::TargetDropping { time2wait: 3 })
    );
    let mut h = Harness::new(
        IscsiTarget::new(TargetConfig::lio(TARGET), scsi_target()),
        description(""),
    );
    // A skipped StatSN is first taken for a response still on its way
    // (targets build responses on several threads): the command
    // completes, ExpStatSN stays at the missing one. Once more statuses
    // arrived after the hole than the session can have outstanding, the
    // hole is a lost status and the session fails.
    let missing = h.session.exp_stat_sn();
    h.target.misbehaviour.skip_stat_sn = true;
    let mut failure = None;
    for tag in 1..=1000u32 {
        h.submit(Tag(tag), &[0u8; 6], DataDirection::None, vec![], 0, 0)
            .unwrap();
        match h.deliver_all() {
            Ok(()) => assert_eq!(h.session.exp_stat_sn(), missing, "tag {tag}"),
            Err(f) => {
                failure = Some((tag, f));
                break;
            }
        }
    }
    let (tag, failure) = failure.expect("the hole is never detected");
    assert!(
        matches!(
            failure,
            SessionFailure::Protocol(storport_srp::iscsi::session::Violation::StatSn { .. })
        ),
        "{failure:?}"
    );
    // The ring holds twice the task table, rounded up to a power of two.
    assert!(tag >= 64, "a reordering window, not a strict order: {tag}");
    assert_eq!(
        h.rec.done.len() as u32,
        tag - 1,
        "every earlier command completed"
    );
}

/// A target that builds responses on several threads (LIO: SCSI
/// Responses on the completing thread, NOP-In and TMF answers on its
/// transmit thread) can put them on the wire out of StatSN order. Every
/// permutation of a batch is taken, and ExpStatSN ends past all of them.
#[test]
fn responses_delivered_out_of_stat_sn_order_all_complete() {
    for seed in 0..32u64 {
        let mut h = Harness::new(
            IscsiTarget::new(TargetConfig::lio(TARGET), scsi_target()),
            description(""),
        );
        let first = h.session.exp_stat_sn();
        for tag in 1..=16u32 {
            h.submit(Tag(tag), &[0u8; 6], DataDirection::None, vec![], 0, 0)
                .unwrap();
        }
        assert_eq!(h.to_initiator.len(), 16, "one response per command");
        let mut order: Vec<Vec<u8>> = h.to_initiator.drain(..).collect();
        fastrand::Rng::with_seed(seed).shuffle(&mut order);
        h.to_initiator.extend(order);
        h.deliver_all()
            .unwrap_or_else(|f| panic!("seed {seed}: {f:?}"));
        assert_eq!(h.rec.done.len(), 16, "seed {seed}");
        assert_eq!(
            h.session.exp_stat_sn(),
            first.add(16).unwrap(),
            "seed {seed}: every status acknowledged"
        );
    }
}

#[test]
fn renegotiation_request_is_answered_with_a_text_request() {
    let mut h = Harness::new(
        IscsiTarget::new(TargetConfig::lio(TARGET), scsi_target()),
        description(""),
    );
    let out = h
        .target
        .send_async(h.conn, AsyncEvent::ParameterNegotiation, 0, 0);
    h.apply(out);
    h.deliver_all().unwrap();
    assert_eq!(h.session.state(), SessionState::Running);
    h.submit(Tag(1), &[0u8; 6], DataDirection::None, vec![], 0, 0)
        .unwrap();
    h.deliver_all().unwrap();
    assert_eq!(h.rec.done.len(), 1);
}

#[test]
fn unsolicited_data_out_when_initial_r2t_is_no() {
    let mut config = TargetConfig::lio(TARGET);
    config.values.initial_r2t = false;
    config.values.immediate_data = false;
    let mut h = Harness::new(IscsiTarget::new(config, scsi_target()), description(""));
    assert!(!h.session.negotiated().initial_r2t);
    // 40 KiB: no immediate data, 5 Data-Out PDUs of 8 KiB, the rest
    // (FirstBurst 64 KiB covers all of it) none by RDMA.
    let data: Vec<u8> = (0..40960u32).map(|i| (i ^ (i >> 8)) as u8).collect();
    h.submit(
        Tag(1),
        &rw10(true, 0, 80),
        DataDirection::Out,
        data.clone(),
        0,
        0,
    )
    .unwrap();
    h.deliver_all().unwrap();
    assert_eq!(h.target.counters().data_outs, 5);
    h.submit(
        Tag(2),
        &rw10(false, 0, 80),
        DataDirection::In,
        vec![],
        40960,
        0,
    )
    .unwrap();
    let itt = h.itt_of[&Tag(2)];
    h.deliver_all().unwrap();
    assert_eq!(h.ios[&itt].read, data);
}

// ---------------------------------------------------------------------
// The sweep

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

const SLOTS: usize = 64;
const SLOT_BLOCKS: u32 = 64;

/// One seeded run: random window sizes (one per login), random sizes and
/// directions, random delivery pacing, target pings, ABORT TASK, LUN
/// RESET, async logouts and dropped connections with reinstatement.
fn sweep(seed: u64, commands: usize) -> BTreeMap<&'static str, usize> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut config = TargetConfig::lio(TARGET);
    config.queue_depth = rng.u32(1..=48);
    let desc =
        description("node.conn[0].timeo.noop_out_interval = 0\nnode.session.cmds_max = 32\n");
    let mut h = Harness::new(IscsiTarget::new(config, scsi_target()), desc);
    // What each slot of the disk holds, when known.
    let mut shadow: Vec<Option<Vec<u8>>> = vec![Some(vec![0; (SLOT_BLOCKS * 512) as usize]); SLOTS];
    let mut busy_slots: HashMap<usize, Tag> = HashMap::new();
    let mut issued: BTreeMap<u32, (usize, bool)> = BTreeMap::new();
    let mut completions: HashMap<u32, usize> = HashMap::new();
    let mut next_tag = 1u32;
    let mut tmf_tag = 1_000_000u32;
    let mut processed = 0usize;
    let mut blocked_tag: Option<Tag> = None;

    let settle = move |h: &mut Harness,
                       shadow: &mut Vec<Option<Vec<u8>>>,
                       busy_slots: &mut HashMap<usize, Tag>,
                       completions: &mut HashMap<u32, usize>,
                       processed: &mut usize| {
        for (tag, outcome, _, _) in h.rec.done.drain(..).collect::<Vec<_>>() {
            *completions.entry(tag.0).or_default() += 1;
            let kind = match outcome {
                CommandOutcome::Scsi(0) => "good",
                CommandOutcome::Scsi(_) => "scsi-error",
                CommandOutcome::Aborted => "aborted",
                CommandOutcome::Reset => "reset",
                CommandOutcome::Failed(_) => "failed",
            };
            *h.stats.entry(kind).or_default() += 1;
            let itt = h
                .itt_of
                .remove(&tag)
                .expect("completion for a submitted tag");
            let io = h.ios.remove(&itt).expect("io");
            busy_slots.remove(&io.slot);
            let region = &mut shadow[io.slot];
            match (io.is_write, outcome) {
                (true, CommandOutcome::Scsi(0)) => {
                    if let Some(full) = region {
                        full[..io.write.len()].copy_from_slice(&io.write);
                    }
                }
                (true, _) => *region = None, // may or may not have landed
                (false, CommandOutcome::Scsi(0)) => {
                    if let Some(expected) = region {
                        assert_eq!(
                            &io.read[..],
                            &expected[..io.read.len()],
                            "seed {seed}: data"
                        );
                    }
                }
                (false, _) => {}
            }
            *processed += 1;
        }
    };

    while (next_tag as usize) <= commands || !busy_slots.is_empty() {
        let roll = rng.u32(0..100);
        if (next_tag as usize) <= commands && roll < 55 {
            let free: Vec<usize> = (0..SLOTS).filter(|s| !busy_slots.contains_key(s)).collect();
            if free.is_empty() {
                continue;
            }
            let slot = free[rng.usize(..free.len())];
            let blocks = rng.u32(1..=SLOT_BLOCKS);
            let lba = slot as u32 * SLOT_BLOCKS;
            let write = rng.bool();
            let tag = Tag(next_tag);
            let result = if write {
                let data: Vec<u8> = (0..blocks * 512).map(|_| rng.u8(..)).collect();
                h.submit(
                    tag,
                    &rw10(true, lba, blocks as u16),
                    DataDirection::Out,
                    data,
                    0,
                    slot,
                )
            } else {
                h.submit(
                    tag,
                    &rw10(false, lba, blocks as u16),
                    DataDirection::In,
                    vec![],
                    (blocks * 512) as usize,
                    slot,
                )
            };
            match result {
                Ok(_) => {
                    busy_slots.insert(slot, tag);
                    issued.insert(tag.0, (slot, write));
                    next_tag += 1;
                    blocked_tag = None;
                }
                Err(e @ (PrepareError::Busy | PrepareError::Blocked)) => {
                    *h.stats
                        .entry(if e == PrepareError::Busy {
                            "busy"
                        } else {
                            "blocked"
                        })
                        .or_default() += 1;
                    blocked_tag = Some(tag);
                    // Let responses flow; the window reopens.
                    if h.deliver(rng.usize(1..4)).is_err() {
                        reconnect(
                            &mut h,
                            &mut shadow,
                            &mut busy_slots,
                            &mut completions,
                            &mut processed,
                            &settle,
                        );
                    }
                }
                Err(e) => panic!("seed {seed}: prepare failed {e:?}"),
            }
        } else if roll < 85 {
            if let Err(_failure) = h.deliver(rng.usize(1..6)) {
                settle(
                    &mut h,
                    &mut shadow,
                    &mut busy_slots,
                    &mut completions,
                    &mut processed,
                );
                reconnect(
                    &mut h,
                    &mut shadow,
                    &mut busy_slots,
                    &mut completions,
                    &mut processed,
                    &settle,
                );
            }
        } else if roll < 89 {
            let out = h.target.send_ping(h.conn);
            h.apply(out);
        } else if roll < 92 && !busy_slots.is_empty() {
            let victims: Vec<Tag> = busy_slots.values().copied().collect();
            let victim = victims[rng.usize(..victims.len())];
            tmf_tag += 1;
            let _ = h.session.abort_task(h.now, Tag(tmf_tag), victim);
            h.flush_control();
        } else if roll < 93 {
            tmf_tag += 1;
            let _ = h
                .session
                .reset_lun(h.now, Tag(tmf_tag), Lun::from_index(0).unwrap());
            h.flush_control();
        } else if roll < 95 {
            h.target.misbehaviour.withhold_max_cmd_sn = rng.u32(0..4);
            let out = h.target.open_window(h.conn);
            h.apply(out);
        } else if roll < 97 {
            let out = h
                .target
                .send_async(h.conn, AsyncEvent::RequestLogout, 0, 20);
            h.apply(out);
        } else if roll < 99 {
            let hold = !h.target.misbehaviour.hold_responses;
            h.target.misbehaviour.hold_responses = hold;
            if !hold {
                let out = h.target.release_responses(h.conn);
                h.apply(out);
            }
        } else {
            let out = h.target.drop_connection(h.conn);
            h.apply(out);
            h.to_initiator.clear();
            settle(
                &mut h,
                &mut shadow,
                &mut busy_slots,
                &mut completions,
                &mut processed,
            );
            reconnect(
                &mut h,
                &mut shadow,
                &mut busy_slots,
                &mut completions,
                &mut processed,
                &settle,
            );
        }
        settle(
            &mut h,
            &mut shadow,
            &mut busy_slots,
            &mut completions,
            &mut processed,
        );
        if matches!(h.session.state(), SessionState::LoggedOut { .. }) {
            reconnect(
                &mut h,
                &mut shadow,
                &mut busy_slots,
                &mut completions,
                &mut processed,
                &settle,
            );
        }
        // Nothing in flight and the session waiting for nothing: drain.
        if (next_tag as usize) > commands && h.to_initiator.is_empty() && !busy_slots.is_empty() {
            h.target.misbehaviour.hold_responses = false;
            let out = h.target.release_responses(h.conn);
            h.apply(out);
            if h.session.state() == SessionState::Running {
                let out = h.target.open_window(h.conn);
                h.apply(out);
            }
            if h.to_initiator.is_empty() {
                // Commands the target dropped silently (e.g. aborted by a
                // LUN reset after being sent): the engine's bus reset.
                let out = h.target.drop_connection(h.conn);
                h.apply(out);
                reconnect(
                    &mut h,
                    &mut shadow,
                    &mut busy_slots,
                    &mut completions,
                    &mut processed,
                    &settle,
                );
            }
        }
        let _ = blocked_tag;
    }
    assert_eq!(issued.len(), commands, "seed {seed}");
    for tag in issued.keys() {
        assert_eq!(
            completions.get(tag),
            Some(&1),
            "seed {seed}: tag {tag} completed exactly once"
        );
    }
    assert_eq!(processed, commands);
    assert_eq!(h.session.commands_outstanding(), 0);
    *h.stats.entry("target-tmfs").or_default() += h.target.counters().tmfs as usize;
    *h.stats.entry("ping-replies").or_default() += h.target.counters().ping_replies as usize;
    *h.stats.entry("logouts").or_default() += h.target.counters().logouts as usize;
    h.stats
}

type Settle = dyn Fn(
    &mut Harness,
    &mut Vec<Option<Vec<u8>>>,
    &mut HashMap<usize, Tag>,
    &mut HashMap<u32, usize>,
    &mut usize,
);

/// The engine's recovery: drop the connection, fence, fail what is
/// outstanding (retryable), log in again with the same ISID.
fn reconnect(
    h: &mut Harness,
    shadow: &mut Vec<Option<Vec<u8>>>,
    busy: &mut HashMap<usize, Tag>,
    completions: &mut HashMap<u32, usize>,
    processed: &mut usize,
    settle: &Settle,
) {
    *h.stats.entry("reconnects").or_default() += 1;
    let old = h.conn;
    h.target.connection_lost(old);
    h.to_initiator.clear();
    h.session.terminate_all(
        CommandOutcome::Failed(FailureKind::ConnectionReset),
        FailureKind::ConnectionReset,
        &mut h.rec,
    );
    settle(h, shadow, busy, completions, processed);
    h.next_cmd_sn = h.next_cmd_sn.wrapping_add(1000);
    h.target.misbehaviour.withhold_max_cmd_sn = 0;
    let mut recovery = Recovery::new(&h.desc.timeouts, h.now);
    let step = recovery.handle_timeout(h.now);
    assert!(step.connect);
    h.login().expect("reinstatement login");
    assert_eq!(recovery.connected().state_changed, Some(TargetState::Live));
}

#[test]
fn sweep_every_command_completes_exactly_once() {
    let seeds = env_usize("ISCSI_SWEEP_SEEDS", 6);
    let commands = env_usize("ISCSI_SWEEP_COMMANDS", 600);
    let mut total: BTreeMap<&'static str, usize> = BTreeMap::new();
    for seed in 0..seeds as u64 {
        for (k, v) in sweep(0xC0FFEE + seed, commands) {
            *total.entry(k).or_default() += v;
        }
    }
    eprintln!("sweep: {total:?}");
    // The sweep means something only if each path was taken.
    for path in [
        "good",
        "aborted",
        "failed",
        "busy",
        "blocked",
        "reconnects",
        "target-tmfs",
        "ping-replies",
        "logouts",
    ] {
        assert!(
            total.get(path).copied().unwrap_or(0) > 0,
            "sweep never saw {path}: {total:?}"
        );
    }
}

#[test]
fn prepared_but_discarded_commands_leave_no_cmdsn_hole() {
    let mut h = Harness::new(
        IscsiTarget::new(TargetConfig::lio(TARGET), scsi_target()),
        description(""),
    );
    let spec = CommandSpec {
        tag: Tag(1),
        lun: Lun::from_index(0).unwrap(),
        cdb: &[0u8; 6],
        direction: DataDirection::None,
        transfer_length: 0,
        attr: TaskAttr::Simple,
        immediate_delivery: false,
    };
    let mut buf = [0u8; 64];
    let a: PreparedCommand = h
        .session
        .prepare_command(h.now, &spec, &Buffer(&[]), &mut buf)
        .unwrap();
    let room = h.session.window_room();
    h.session.discard_command(a);
    assert_eq!(h.session.window_room(), room + 1);
    // The next command still carries the login's CmdSN and runs.
    h.submit(Tag(2), &[0u8; 6], DataDirection::None, vec![], 0, 0)
        .unwrap();
    h.deliver_all().unwrap();
    assert_eq!(h.rec.done.len(), 1);
    assert_eq!(h.target.counters().out_of_window, 0);
}

#[test]
fn target_returns_the_sense_it_is_told_to() {
    use kverbs_tools::scsi_target::FaultRule;
    use storport_srp::scsi::{AdditionalSense, SenseKey};
    let mut h = Harness::new(
        IscsiTarget::new(TargetConfig::lio(TARGET), scsi_target()),
        description(""),
    );
    h.target.scsi().faults().push(FaultRule::sense(
        SenseKey::MediumError,
        AdditionalSense::UNRECOVERED_READ_ERROR,
    ));
    h.submit(
        Tag(1),
        &rw10(false, 0, 1),
        DataDirection::In,
        vec![],
        512,
        0,
    )
    .unwrap();
    h.deliver_all().unwrap();
    let (_, outcome, _, sense) = &h.rec.done[0];
    assert_eq!(*outcome, CommandOutcome::Scsi(2));
    assert_eq!(sense[2] & 0x0F, 0x03, "MEDIUM ERROR");
    assert_eq!((sense[12], sense[13]), (0x11, 0x00));
}
