//! The iSCSI logic of a software target that behaves like Linux LIO with
//! `iser=1`, as a sans-IO state machine: PDUs in, PDUs and RDMA requests
//! out. The software iSER target (on the software HCA) will wrap it; the
//! initiator's state machines are tested against it directly.
//!
//! * Login as LIO's `iscsi_target_nego.c` runs it: the security stage
//!   (`AuthMethod` from `CHAP,None`, CHAP with MD5 when it picks CHAP and
//!   authentication is enforced, `AUTH_FAILED` when the initiator settles
//!   on `None` but authentication is enforced), the operational stage with
//!   LIO's parameter table ([`params`]): `RDMAExtensions` BOOL_AND and
//!   leading-only, `NotUnderstood` for unknown keys, markers rejected,
//!   `MaxRecvDataSegmentLength` not negotiated under iSER. TSIH assigned
//!   on the final response; a login with an ISID already in use (and TSIH
//!   0) reinstates: the old connection is closed.
//! * Full feature phase: StatSN per connection, ExpCmdSN/MaxCmdSN with a
//!   configurable queue depth (MaxCmdSN grows by one per completed
//!   command, as LIO's `iscsit_increment_maxcmdsn`), commands executed in
//!   CmdSN order (out-of-order arrivals within the window wait, commands
//!   outside it are dropped silently as RFC 7143 says), immediate data and
//!   unsolicited Data-Out collected, the rest of a write fetched by
//!   [`Output::RdmaRead`], read data sent by [`Output::RdmaWrite`] before
//!   the SCSI Response, dispatched to [`crate::scsi_target::ScsiTarget`];
//!   NOP-Out answered, ABORT TASK and LUN RESET, logout.
//! * Misbehaviour switches ([`Misbehaviour`]) and target-initiated events
//!   (pings, Async Messages, a dropped connection) for the tests.

pub mod params;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use storport_srp::iscsi::chap;
use storport_srp::wire::iscsi::login::status_class;
use storport_srp::wire::iscsi::{
    AHS_EXTENDED_CDB, AhsIter, AsyncEvent, AsyncMessageRepr, BhsRepr, IscsiPdu, LoginRequestRepr,
    LoginResponseRepr, LoginStage, LogoutResponseCode, LogoutResponseRepr, NopInRepr, Padding,
    RESERVED_TAG, RejectReason, RejectRepr, ScsiResponseRepr, SenseData, SerialNumber,
    TaskMgmtFunction, TaskMgmtResponseCode, TaskMgmtResponseRepr, TextResponseRepr,
};
use storport_srp::wire::text::{Limits, TextData};
use storport_srp::wire::{Lun, Residual};

use crate::scsi_target::{DataOut, Request, ScsiTarget};
use params::{PHASE_DECLARATIVE, PHASE_OPERATIONAL, PHASE_SECURITY, ParamList, TargetValues};

/// A connection of the target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(pub u32);

/// What the target asks its transport to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    /// Send this PDU (BHS, AHS, data segment, no padding) on `conn`.
    Send(ConnId, Vec<u8>),
    /// Write `data` into the initiator's read buffer of task `itt` at
    /// `offset` (under iSER: an RDMA WRITE to the read STag).
    RdmaWrite {
        /// The connection.
        conn: ConnId,
        /// The task.
        itt: u32,
        /// Offset in the task's buffer.
        offset: u32,
        /// The bytes.
        data: Vec<u8>,
    },
    /// Fetch `len` bytes of task `itt`'s write buffer from `offset` (an
    /// RDMA READ from the write STag); answer with
    /// [`IscsiTarget::rdma_read_done`].
    RdmaRead {
        /// The connection.
        conn: ConnId,
        /// The task.
        itt: u32,
        /// Offset in the task's buffer.
        offset: u32,
        /// Bytes to fetch.
        len: u32,
    },
    /// Close the connection (after the PDUs before it).
    Close(ConnId),
}

/// CHAP credentials a target checks (or proves itself with).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChapSecret {
    /// The CHAP name.
    pub user: String,
    /// The secret.
    pub secret: Vec<u8>,
}

/// The target's configuration.
#[derive(Debug, Clone)]
pub struct TargetConfig {
    /// The target's IQN.
    pub target_name: String,
    /// Initiators allowed to log in (`None`: any, LIO's demo mode).
    pub allowed_initiators: Option<Vec<String>>,
    /// Enforce authentication (LIO's `authentication` attribute).
    pub auth_required: bool,
    /// What the initiator must prove with CHAP.
    pub chap: Option<ChapSecret>,
    /// What the target proves with mutual CHAP.
    pub mutual_chap: Option<ChapSecret>,
    /// Commands the target admits at once (the CmdSN window).
    pub queue_depth: u32,
    /// The parameter values LIO keeps.
    pub values: TargetValues,
    /// An iSER portal (`RDMAExtensions=Yes`, iSER keys).
    pub iser: bool,
    /// The StatSN of a connection's first response.
    pub initial_stat_sn: u32,
}

impl TargetConfig {
    /// LIO on an iSER portal serving `target_name`, queue depth 64.
    #[must_use]
    pub fn lio(target_name: &str) -> Self {
        Self {
            target_name: target_name.to_owned(),
            allowed_initiators: None,
            auth_required: false,
            chap: None,
            mutual_chap: None,
            queue_depth: 64,
            values: TargetValues::default(),
            iser: true,
            initial_stat_sn: 0x1000,
        }
    }
}

/// Ways to misbehave, for the initiator's error paths.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Misbehaviour {
    /// Answer the first login request with this status class and detail
    /// (a redirect names `redirect_address` in `TargetAddress`).
    pub reject_login: Option<(u8, u8)>,
    /// `TargetAddress` of a redirect.
    pub redirect_address: Option<String>,
    /// Answer `AuthMethod=CHAP` whatever the initiator offered.
    pub demand_chap: bool,
    /// Answer `RDMAExtensions=No`.
    pub rdma_extensions_no: bool,
    /// Answer this digest instead of `None`.
    pub digest: Option<String>,
    /// Completions that do not open the window (MaxCmdSN withheld); the
    /// target owes them until [`IscsiTarget::open_window`].
    pub withhold_max_cmd_sn: u32,
    /// Hold SCSI Responses back (the commands stay in progress) until
    /// [`IscsiTarget::release_responses`].
    pub hold_responses: bool,
    /// Send this StatSN offset on the next response (a StatSN gap).
    pub skip_stat_sn: bool,
}

/// Counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Successful logins.
    pub logins: u64,
    /// Sessions reinstated (an old session ended by a new login).
    pub reinstatements: u64,
    /// SCSI commands executed.
    pub commands: u64,
    /// Commands aborted by a TMF.
    pub aborted: u64,
    /// Task management requests received.
    pub tmfs: u64,
    /// NOP-Outs answering the target's pings.
    pub ping_replies: u64,
    /// NOP-Outs from the initiator's keepalive.
    pub initiator_pings: u64,
    /// Logouts.
    pub logouts: u64,
    /// Commands dropped as outside the window.
    pub out_of_window: u64,
    /// Unsolicited Data-Out PDUs received.
    pub data_outs: u64,
    /// Bytes received as immediate data.
    pub immediate_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Task {
    lun: Lun,
    cdb: Vec<u8>,
    read: bool,
    write: bool,
    edtl: u32,
    cmd_sn: SerialNumber,
    immediate: bool,
    data: Vec<u8>,
    /// Unsolicited bytes still expected as Data-Out PDUs.
    unsolicited_end: u32,
    unsolicited_done: bool,
    rdma_pending: bool,
}

#[derive(Debug)]
enum Phase {
    Login(Box<LoginState>),
    FullFeature,
    Closed,
}

#[derive(Debug)]
struct LoginState {
    params: ParamList,
    itt: u32,
    isid: [u8; 6],
    tsih: u16,
    cid: u16,
    cmd_sn: SerialNumber,
    stage: LoginStage,
    first: bool,
    initiator_name: String,
    auth_complete: bool,
    chap_state: ChapState,
    text: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum ChapState {
    None,
    Challenged { id: u8, challenge: [u8; 16] },
}

#[derive(Debug)]
struct Connection {
    phase: Phase,
    stat_sn: SerialNumber,
    exp_cmd_sn: SerialNumber,
    max_cmd_sn: SerialNumber,
    owed_window: u32,
    session_key: Option<(String, [u8; 6])>,
    tasks: HashMap<u32, Task>,
    /// Commands that arrived ahead of ExpCmdSN, by CmdSN.
    queued: BTreeMap<u32, (u32, Task)>,
    /// Finished commands whose responses are held.
    held: Vec<u32>,
    ping_ttt: u32,
    outstanding_pings: Vec<u32>,
    max_recv: u32,
    max_send: u32,
    immediate_data: bool,
    initial_r2t: bool,
    first_burst: u32,
}

/// A target: connections, sessions, the SCSI device server behind them.
#[derive(Debug)]
pub struct IscsiTarget {
    config: TargetConfig,
    scsi: Arc<ScsiTarget>,
    conns: BTreeMap<ConnId, Connection>,
    sessions: HashMap<(String, [u8; 6]), (u16, ConnId)>,
    next_conn: u32,
    next_tsih: u16,
    chap_id: u8,
    challenge_seed: u64,
    /// Every mutual-CHAP challenge initiators sent, in order (tests check
    /// that no two repeat).
    mutual_challenges: Vec<Vec<u8>>,
    /// The misbehaviour switches (tests change them between calls).
    pub misbehaviour: Misbehaviour,
    counters: Counters,
}

fn emit(header: BhsRepr, data: &[u8]) -> Vec<u8> {
    let pdu = IscsiPdu {
        header,
        ahs: &[],
        data,
    };
    let mut buf = vec![0u8; pdu.buffer_len(Padding::None)];
    let len = pdu
        .emit(&mut buf, Padding::None)
        .expect("the buffer is sized for the PDU");
    buf.truncate(len);
    buf
}

fn text_pairs(data: &[u8]) -> Option<Vec<(String, String)>> {
    let text = TextData::parse(data, &Limits::NEGOTIATION).ok()?;
    Some(
        text.pairs()
            .map(|p| (p.key.to_owned(), p.value.to_owned()))
            .collect(),
    )
}

impl IscsiTarget {
    /// A target serving `scsi`.
    #[must_use]
    pub fn new(config: TargetConfig, scsi: Arc<ScsiTarget>) -> Self {
        Self {
            config,
            scsi,
            conns: BTreeMap::new(),
            sessions: HashMap::new(),
            next_conn: 1,
            next_tsih: 1,
            chap_id: 1,
            challenge_seed: 0x5DEE_CE66_D1CE_4E5B,
            mutual_challenges: Vec::new(),
            misbehaviour: Misbehaviour::default(),
            counters: Counters::default(),
        }
    }

    /// The mutual-CHAP challenges initiators sent, oldest first.
    #[must_use]
    pub fn mutual_challenges(&self) -> &[Vec<u8>] {
        &self.mutual_challenges
    }

    /// The counters.
    #[must_use]
    pub const fn counters(&self) -> Counters {
        self.counters
    }

    /// The SCSI device server.
    #[must_use]
    pub fn scsi(&self) -> &Arc<ScsiTarget> {
        &self.scsi
    }

    /// The configuration (tests change the queue depth between logins).
    pub fn config_mut(&mut self) -> &mut TargetConfig {
        &mut self.config
    }

    /// A new transport connection (the CM accepted it).
    pub fn accept(&mut self) -> ConnId {
        let id = ConnId(self.next_conn);
        self.next_conn += 1;
        let stat_sn = SerialNumber(self.config.initial_stat_sn);
        self.conns.insert(
            id,
            Connection {
                phase: Phase::Login(Box::new(LoginState {
                    params: ParamList::new(&self.config.values, self.config.iser),
                    itt: 0,
                    isid: [0; 6],
                    tsih: 0,
                    cid: 0,
                    cmd_sn: SerialNumber(0),
                    stage: LoginStage::SecurityNegotiation,
                    first: true,
                    initiator_name: String::new(),
                    auth_complete: false,
                    chap_state: ChapState::None,
                    text: Vec::new(),
                })),
                stat_sn,
                exp_cmd_sn: SerialNumber(0),
                max_cmd_sn: SerialNumber(0),
                owed_window: 0,
                session_key: None,
                tasks: HashMap::new(),
                queued: BTreeMap::new(),
                held: Vec::new(),
                ping_ttt: 0x100,
                outstanding_pings: Vec::new(),
                max_recv: 8192,
                max_send: 8192,
                immediate_data: true,
                initial_r2t: true,
                first_burst: 65536,
            },
        );
        id
    }

    /// Whether `conn` is in full feature phase.
    #[must_use]
    pub fn is_full_feature(&self, conn: ConnId) -> bool {
        matches!(
            self.conns.get(&conn).map(|c| &c.phase),
            Some(Phase::FullFeature)
        )
    }

    /// Tasks in progress on `conn` (received, not answered).
    #[must_use]
    pub fn tasks_in_progress(&self, conn: ConnId) -> usize {
        self.conns
            .get(&conn)
            .map_or(0, |c| c.tasks.len() + c.queued.len())
    }

    /// Pings the target sent that were not answered yet.
    #[must_use]
    pub fn outstanding_pings(&self, conn: ConnId) -> usize {
        self.conns
            .get(&conn)
            .map_or(0, |c| c.outstanding_pings.len())
    }

    /// The transport lost `conn` (or closed it): its tasks are gone.
    pub fn connection_lost(&mut self, conn: ConnId) {
        if let Some(c) = self.conns.remove(&conn) {
            if let Some(key) = c.session_key {
                if self.sessions.get(&key).map(|(_, id)| *id) == Some(conn) {
                    self.sessions.remove(&key);
                }
            }
        }
    }

    fn random_challenge(&mut self) -> [u8; 16] {
        let mut out = [0u8; 16];
        for chunk in out.chunks_mut(8) {
            // SplitMix64: deterministic, different every time.
            self.challenge_seed = self.challenge_seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.challenge_seed;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            chunk.copy_from_slice(&z.to_be_bytes());
        }
        out
    }

    /// Handles a PDU (BHS, AHS, data segment) received on `conn`.
    pub fn receive(&mut self, conn: ConnId, pdu: &[u8]) -> Vec<Output> {
        let mut out = Vec::new();
        let Some(c) = self.conns.get(&conn) else {
            return out;
        };
        match c.phase {
            Phase::Login(_) => self.login_pdu(conn, pdu, &mut out),
            Phase::FullFeature => self.ffp_pdu(conn, pdu, &mut out),
            Phase::Closed => {}
        }
        out
    }

    // ---- login ------------------------------------------------------

    #[allow(clippy::too_many_lines)]
    fn login_pdu(&mut self, conn: ConnId, pdu: &[u8], out: &mut Vec<Output>) {
        let Ok(parsed) = IscsiPdu::parse(pdu) else {
            out.push(Output::Close(conn));
            return;
        };
        let BhsRepr::LoginRequest(req) = parsed.header else {
            self.login_fail(conn, None, status_class::INITIATOR_ERROR, 0x00, out);
            return;
        };
        let misbehaviour = self.misbehaviour.clone();
        let config = self.config.clone();
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        let Phase::Login(login) = &mut c.phase else {
            return;
        };
        if login.first {
            login.itt = req.itt;
            login.isid = req.isid;
            login.tsih = req.tsih;
            login.cid = req.cid;
            login.cmd_sn = req.cmd_sn;
            login.stage = req.current_stage;
            c.exp_cmd_sn = req.cmd_sn;
            c.max_cmd_sn = SerialNumber(
                req.cmd_sn
                    .0
                    .wrapping_add(config.queue_depth.max(1))
                    .wrapping_sub(1),
            );
        } else if req.itt != login.itt || req.isid != login.isid || req.current_stage != login.stage
        {
            self.login_fail(conn, Some(&req), status_class::INITIATOR_ERROR, 0x00, out);
            return;
        }
        login.text.extend_from_slice(parsed.data);
        if req.continues {
            // Collect the rest; answer with an empty response.
            let rsp = self.login_response(conn, &req, None, false, &[]);
            out.push(Output::Send(conn, rsp));
            return;
        }
        let Some(Phase::Login(login)) = self.conns.get_mut(&conn).map(|c| &mut c.phase) else {
            return;
        };
        let text = std::mem::take(&mut login.text);
        let Some(pairs) = text_pairs(&text) else {
            self.login_fail(conn, Some(&req), status_class::INITIATOR_ERROR, 0x00, out);
            return;
        };
        if login.first {
            login.first = false;
            if let Some((class, detail)) = misbehaviour.reject_login {
                let data = misbehaviour
                    .redirect_address
                    .as_ref()
                    .map(|a| format!("TargetAddress={a}\0").into_bytes())
                    .unwrap_or_default();
                self.login_status(conn, &req, class, detail, &data, out);
                return;
            }
            let get = |k: &str| pairs.iter().find(|(key, _)| key == k).map(|(_, v)| v);
            let Some(initiator) = get("InitiatorName") else {
                self.login_fail(conn, Some(&req), status_class::INITIATOR_ERROR, 0x07, out);
                return;
            };
            let initiator = initiator.to_ascii_lowercase();
            match get("SessionType").map(String::as_str) {
                None => {
                    self.login_fail(conn, Some(&req), status_class::INITIATOR_ERROR, 0x07, out);
                    return;
                }
                Some("Normal") => {}
                Some(_) => {
                    self.login_fail(conn, Some(&req), status_class::INITIATOR_ERROR, 0x09, out);
                    return;
                }
            }
            if get("TargetName").map(String::as_str) != Some(config.target_name.as_str()) {
                self.login_fail(conn, Some(&req), status_class::INITIATOR_ERROR, 0x03, out);
                return;
            }
            if let Some(allowed) = &config.allowed_initiators {
                if !allowed.iter().any(|a| a.eq_ignore_ascii_case(&initiator)) {
                    self.login_fail(conn, Some(&req), status_class::INITIATOR_ERROR, 0x02, out);
                    return;
                }
            }
            let Some(Phase::Login(login)) = self.conns.get_mut(&conn).map(|c| &mut c.phase) else {
                return;
            };
            login.initiator_name = initiator;
            let mut tpgt = String::new();
            tpgt.push_str(&config.values.tpgt.to_string());
            login.params.set_value("TargetPortalGroupTag", &tpgt);
            if misbehaviour.rdma_extensions_no {
                login.params.set_value("RDMAExtensions", "No");
            }
        }
        match req.current_stage {
            LoginStage::SecurityNegotiation => self.csg_zero(conn, &req, &pairs, out),
            LoginStage::OperationalNegotiation => self.csg_one(conn, &req, &pairs, out),
            LoginStage::FullFeature => {
                self.login_fail(conn, Some(&req), status_class::INITIATOR_ERROR, 0x00, out);
            }
        }
    }

    fn csg_zero(
        &mut self,
        conn: ConnId,
        req: &LoginRequestRepr,
        pairs: &[(String, String)],
        out: &mut Vec<Output>,
    ) {
        let demand_chap = self.misbehaviour.demand_chap;
        let auth_required = self.config.auth_required;
        let Some(Phase::Login(login)) = self.conns.get_mut(&conn).map(|c| &mut c.phase) else {
            return;
        };
        let decoded = login
            .params
            .decode(PHASE_SECURITY | PHASE_DECLARATIVE, pairs);
        match decoded {
            Err(_) => {
                self.login_fail(conn, Some(req), status_class::INITIATOR_ERROR, 0x00, out);
            }
            Ok(true) => self.chap(conn, req, pairs, out),
            Ok(false) => {
                if demand_chap && login.params.received("AuthMethod") {
                    login.params.set_value("AuthMethod", "CHAP");
                }
                let text = login.params.encode(PHASE_SECURITY | PHASE_DECLARATIVE);
                let method = login.params.value("AuthMethod").unwrap_or("").to_owned();
                let keys_done = login.params.unanswered().is_empty();
                let mut transit = None;
                if keys_done {
                    if auth_required || demand_chap {
                        if method == "None" {
                            self.login_fail(
                                conn,
                                Some(req),
                                status_class::INITIATOR_ERROR,
                                0x01,
                                out,
                            );
                            return;
                        }
                    } else if req.next_stage == Some(LoginStage::OperationalNegotiation) {
                        transit = Some(LoginStage::OperationalNegotiation);
                    }
                    if login.auth_complete
                        && req.next_stage == Some(LoginStage::OperationalNegotiation)
                    {
                        transit = Some(LoginStage::OperationalNegotiation);
                    }
                }
                if transit.is_some() {
                    login.stage = LoginStage::OperationalNegotiation;
                }
                let rsp = self.login_response(conn, req, transit, false, &text);
                out.push(Output::Send(conn, rsp));
            }
        }
    }

    fn chap(
        &mut self,
        conn: ConnId,
        req: &LoginRequestRepr,
        pairs: &[(String, String)],
        out: &mut Vec<Output>,
    ) {
        let get = |k: &str| {
            pairs
                .iter()
                .find(|(key, _)| key == k)
                .map(|(_, v)| v.as_str())
        };
        let Some(creds) = self.config.chap.clone() else {
            self.login_fail(conn, Some(req), status_class::INITIATOR_ERROR, 0x01, out);
            return;
        };
        let state = match self.conns.get(&conn).map(|c| &c.phase) {
            Some(Phase::Login(l)) => l.chap_state.clone(),
            _ => return,
        };
        match state {
            ChapState::None => {
                let algorithms = get("CHAP_A").unwrap_or("");
                if !algorithms.split(',').any(|a| a == "5") {
                    self.login_fail(conn, Some(req), status_class::INITIATOR_ERROR, 0x01, out);
                    return;
                }
                let id = self.chap_id;
                self.chap_id = self.chap_id.wrapping_add(1);
                let challenge = self.random_challenge();
                let mut hex = [0u8; 34];
                let c = chap::encode_hex(&challenge, &mut hex).unwrap_or("0x00");
                let text = format!("CHAP_A=5\0CHAP_I={id}\0CHAP_C={c}\0");
                if let Some(Phase::Login(l)) = self.conns.get_mut(&conn).map(|c| &mut c.phase) {
                    l.chap_state = ChapState::Challenged { id, challenge };
                }
                let rsp = self.login_response(conn, req, None, false, text.as_bytes());
                out.push(Output::Send(conn, rsp));
            }
            ChapState::Challenged { id, challenge } => {
                let mut buf = [0u8; chap::MAX_BINARY_LEN];
                let ok_name = get("CHAP_N") == Some(creds.user.as_str());
                let got = get("CHAP_R").and_then(|r| chap::decode_binary(r, &mut buf).ok());
                let expected = chap::response(id, &creds.secret, &challenge);
                let ok = ok_name && got.is_some_and(|g| chap::responses_equal(&expected, g));
                if !ok {
                    self.login_fail(conn, Some(req), status_class::INITIATOR_ERROR, 0x01, out);
                    return;
                }
                let mut text = String::new();
                if let (Some(mutual), Some(i), Some(c)) =
                    (&self.config.mutual_chap, get("CHAP_I"), get("CHAP_C"))
                {
                    let mut cbuf = [0u8; chap::MAX_BINARY_LEN];
                    let Some(their) = chap::decode_binary(c, &mut cbuf).ok() else {
                        self.login_fail(conn, Some(req), status_class::INITIATOR_ERROR, 0x01, out);
                        return;
                    };
                    self.mutual_challenges.push(their.to_vec());
                    if their == challenge.as_slice() {
                        self.login_fail(conn, Some(req), status_class::INITIATOR_ERROR, 0x01, out);
                        return;
                    }
                    let Ok(mid) = i.parse::<u8>() else {
                        self.login_fail(conn, Some(req), status_class::INITIATOR_ERROR, 0x01, out);
                        return;
                    };
                    let r = chap::response(mid, &mutual.secret, their);
                    let mut hex = [0u8; 34];
                    let r = chap::encode_hex(&r, &mut hex).unwrap_or("0x00");
                    text = format!("CHAP_N={}\0CHAP_R={r}\0", mutual.user);
                }
                let transit = (req.next_stage == Some(LoginStage::OperationalNegotiation))
                    .then_some(LoginStage::OperationalNegotiation);
                if let Some(Phase::Login(l)) = self.conns.get_mut(&conn).map(|c| &mut c.phase) {
                    l.auth_complete = true;
                    l.chap_state = ChapState::None;
                    if transit.is_some() {
                        l.stage = LoginStage::OperationalNegotiation;
                    }
                }
                let rsp = self.login_response(conn, req, transit, false, text.as_bytes());
                out.push(Output::Send(conn, rsp));
            }
        }
    }

    fn csg_one(
        &mut self,
        conn: ConnId,
        req: &LoginRequestRepr,
        pairs: &[(String, String)],
        out: &mut Vec<Output>,
    ) {
        let auth_required = self.config.auth_required;
        let Some(Phase::Login(login)) = self.conns.get_mut(&conn).map(|c| &mut c.phase) else {
            return;
        };
        if login
            .params
            .decode(PHASE_OPERATIONAL | PHASE_DECLARATIVE, pairs)
            .is_err()
        {
            self.login_fail(conn, Some(req), status_class::INITIATOR_ERROR, 0x00, out);
            return;
        }
        let mut text = login.params.encode(PHASE_OPERATIONAL | PHASE_DECLARATIVE);
        if let Some(d) = &self.misbehaviour.digest {
            // Answer a digest the initiator did not offer.
            let answered = String::from_utf8_lossy(&text)
                .replace("HeaderDigest=None\0", &format!("HeaderDigest={d}\0"))
                .replace("DataDigest=None\0", &format!("DataDigest={d}\0"));
            text = answered.into_bytes();
        }
        if auth_required && !login.auth_complete {
            self.login_fail(conn, Some(req), status_class::INITIATOR_ERROR, 0x01, out);
            return;
        }
        let done =
            login.params.unanswered().is_empty() && req.next_stage == Some(LoginStage::FullFeature);
        if !done {
            let rsp = self.login_response(conn, req, None, false, &text);
            out.push(Output::Send(conn, rsp));
            return;
        }
        // Session reinstatement: the same initiator and ISID with TSIH 0
        // ends the old session.
        let key = (login.initiator_name.clone(), login.isid);
        let tsih = self.next_tsih;
        self.next_tsih = self.next_tsih.wrapping_add(1).max(1);
        if let Some((_, old)) = self.sessions.insert(key.clone(), (tsih, conn)) {
            if old != conn {
                self.counters.reinstatements += 1;
                self.conns.remove(&old);
                out.push(Output::Close(old));
            }
        }
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        let Phase::Login(login) = &mut c.phase else {
            return;
        };
        login.tsih = tsih;
        let num =
            |p: &ParamList, k: &str, d: u32| p.value(k).and_then(|v| v.parse().ok()).unwrap_or(d);
        c.max_recv = num(&login.params, "TargetRecvDataSegmentLength", 8192);
        c.max_send = num(&login.params, "InitiatorRecvDataSegmentLength", 8192);
        c.immediate_data = login.params.value("ImmediateData") == Some("Yes");
        c.initial_r2t = login.params.value("InitialR2T") == Some("Yes");
        c.first_burst = num(&login.params, "FirstBurstLength", 65536);
        c.session_key = Some(key);
        let rsp = self.login_response(conn, req, Some(LoginStage::FullFeature), true, &text);
        out.push(Output::Send(conn, rsp));
        if let Some(c) = self.conns.get_mut(&conn) {
            c.phase = Phase::FullFeature;
        }
        self.counters.logins += 1;
    }

    fn login_response(
        &mut self,
        conn: ConnId,
        req: &LoginRequestRepr,
        transit: Option<LoginStage>,
        final_response: bool,
        text: &[u8],
    ) -> Vec<u8> {
        let Some(c) = self.conns.get_mut(&conn) else {
            return Vec::new();
        };
        let (tsih, itt, isid) = match &c.phase {
            Phase::Login(l) => (if final_response { l.tsih } else { 0 }, l.itt, l.isid),
            _ => (0, req.itt, req.isid),
        };
        let stat_sn = c.stat_sn;
        c.stat_sn = c.stat_sn.next();
        emit(
            BhsRepr::LoginResponse(LoginResponseRepr {
                current_stage: req.current_stage,
                next_stage: transit,
                continues: false,
                version_max: 0,
                version_active: 0,
                isid,
                tsih,
                itt,
                stat_sn,
                exp_cmd_sn: c.exp_cmd_sn,
                max_cmd_sn: c.max_cmd_sn,
                status_class: status_class::SUCCESS,
                status_detail: 0,
            }),
            text,
        )
    }

    fn login_status(
        &mut self,
        conn: ConnId,
        req: &LoginRequestRepr,
        class: u8,
        detail: u8,
        data: &[u8],
        out: &mut Vec<Output>,
    ) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        let stat_sn = c.stat_sn;
        let pdu = emit(
            BhsRepr::LoginResponse(LoginResponseRepr {
                current_stage: req.current_stage,
                next_stage: None,
                continues: false,
                version_max: 0,
                version_active: 0,
                isid: req.isid,
                tsih: 0,
                itt: req.itt,
                stat_sn,
                exp_cmd_sn: c.exp_cmd_sn,
                max_cmd_sn: c.max_cmd_sn,
                status_class: class,
                status_detail: detail,
            }),
            data,
        );
        c.phase = Phase::Closed;
        out.push(Output::Send(conn, pdu));
        out.push(Output::Close(conn));
    }

    fn login_fail(
        &mut self,
        conn: ConnId,
        req: Option<&LoginRequestRepr>,
        class: u8,
        detail: u8,
        out: &mut Vec<Output>,
    ) {
        match req {
            Some(req) => self.login_status(conn, req, class, detail, &[], out),
            None => {
                if let Some(c) = self.conns.get_mut(&conn) {
                    c.phase = Phase::Closed;
                }
                out.push(Output::Close(conn));
            }
        }
    }

    // ---- full feature phase -----------------------------------------

    fn next_stat_sn(c: &mut Connection, skip: &mut bool) -> SerialNumber {
        if std::mem::take(skip) {
            c.stat_sn = c.stat_sn.next();
        }
        let s = c.stat_sn;
        c.stat_sn = c.stat_sn.next();
        s
    }

    #[allow(clippy::too_many_lines)]
    fn ffp_pdu(&mut self, conn: ConnId, pdu: &[u8], out: &mut Vec<Output>) {
        let Ok(parsed) = IscsiPdu::parse(pdu) else {
            self.reject(conn, RejectReason::ProtocolError, pdu, out);
            return;
        };
        match parsed.header {
            BhsRepr::ScsiCommand(cmd) => {
                let mut cdb = cmd.cdb.to_vec();
                for ahs in AhsIter::new(parsed.ahs).flatten() {
                    if ahs.ahs_type == AHS_EXTENDED_CDB {
                        cdb.extend_from_slice(ahs.specific.get(1..).unwrap_or(&[]));
                    }
                }
                let Some(c) = self.conns.get_mut(&conn) else {
                    return;
                };
                let imm = parsed.data.len() as u32;
                let limit_ok = imm == 0
                    || (c.immediate_data && cmd.write && imm <= c.first_burst && imm <= c.max_recv);
                if !limit_ok || c.tasks.contains_key(&cmd.itt) {
                    self.reject(conn, RejectReason::ProtocolError, pdu, out);
                    return;
                }
                self.counters.immediate_bytes += u64::from(imm);
                let unsolicited_end = if cmd.write && !c.initial_r2t && !cmd.is_final {
                    cmd.expected_data_len.min(c.first_burst)
                } else {
                    imm
                };
                let task = Task {
                    lun: cmd.lun,
                    cdb,
                    read: cmd.read,
                    write: cmd.write,
                    edtl: cmd.expected_data_len,
                    cmd_sn: cmd.cmd_sn,
                    immediate: cmd.immediate,
                    data: parsed.data.to_vec(),
                    unsolicited_end,
                    unsolicited_done: unsolicited_end == imm,
                    rdma_pending: false,
                };
                if cmd.immediate {
                    c.tasks.insert(cmd.itt, task);
                    self.advance(conn, cmd.itt, out);
                    return;
                }
                let in_window = cmd.cmd_sn >= c.exp_cmd_sn && cmd.cmd_sn <= c.max_cmd_sn;
                if !in_window {
                    self.counters.out_of_window += 1;
                    return;
                }
                c.queued.insert(cmd.cmd_sn.0, (cmd.itt, task));
                self.run_queue(conn, out);
            }
            BhsRepr::DataOut(d) => {
                self.counters.data_outs += 1;
                let Some(c) = self.conns.get_mut(&conn) else {
                    return;
                };
                let found = c.tasks.get_mut(&d.itt).or_else(|| {
                    c.queued
                        .values_mut()
                        .find(|(itt, _)| *itt == d.itt)
                        .map(|(_, t)| t)
                });
                let Some(task) = found else {
                    self.reject(conn, RejectReason::InvalidPduField, pdu, out);
                    return;
                };
                let end = d.buffer_offset as usize + parsed.data.len();
                if d.ttt != RESERVED_TAG
                    || d.buffer_offset as usize != task.data.len()
                    || end > task.unsolicited_end as usize
                {
                    self.reject(conn, RejectReason::ProtocolError, pdu, out);
                    return;
                }
                task.data.extend_from_slice(parsed.data);
                if d.is_final {
                    task.unsolicited_done = true;
                }
                if c.tasks.contains_key(&d.itt) {
                    self.advance(conn, d.itt, out);
                }
            }
            BhsRepr::NopOut(nop) => {
                let Some(c) = self.conns.get_mut(&conn) else {
                    return;
                };
                if nop.itt == RESERVED_TAG {
                    if let Some(pos) = c.outstanding_pings.iter().position(|&t| t == nop.ttt) {
                        c.outstanding_pings.remove(pos);
                        self.counters.ping_replies += 1;
                    }
                    return;
                }
                self.counters.initiator_pings += 1;
                if !nop.immediate && nop.cmd_sn == c.exp_cmd_sn {
                    c.exp_cmd_sn = c.exp_cmd_sn.next();
                    c.max_cmd_sn = c.max_cmd_sn.next();
                }
                let mut skip = std::mem::take(&mut self.misbehaviour.skip_stat_sn);
                let stat_sn = Self::next_stat_sn(c, &mut skip);
                let rsp = emit(
                    BhsRepr::NopIn(NopInRepr {
                        lun: nop.lun,
                        itt: nop.itt,
                        ttt: RESERVED_TAG,
                        stat_sn,
                        exp_cmd_sn: c.exp_cmd_sn,
                        max_cmd_sn: c.max_cmd_sn,
                    }),
                    &[],
                );
                out.push(Output::Send(conn, rsp));
            }
            BhsRepr::TaskMgmtRequest(tmf) => {
                self.counters.tmfs += 1;
                let Some(c) = self.conns.get_mut(&conn) else {
                    return;
                };
                let response = match tmf.function {
                    TaskMgmtFunction::AbortTask => {
                        if c.tasks.remove(&tmf.rtt).is_some() {
                            c.held.retain(|&i| i != tmf.rtt);
                            self.counters.aborted += 1;
                            TaskMgmtResponseCode::Complete
                        } else if let Some(sn) = c
                            .queued
                            .iter()
                            .find(|(_, (i, _))| *i == tmf.rtt)
                            .map(|(s, _)| *s)
                        {
                            c.queued.remove(&sn);
                            self.counters.aborted += 1;
                            TaskMgmtResponseCode::Complete
                        } else {
                            TaskMgmtResponseCode::NoSuchTask
                        }
                    }
                    TaskMgmtFunction::LogicalUnitReset => {
                        let before = c.tasks.len() + c.queued.len();
                        c.tasks.retain(|_, t| t.lun != tmf.lun);
                        let tasks = &c.tasks;
                        c.held.retain(|i| tasks.contains_key(i));
                        c.queued.retain(|_, (_, t)| t.lun != tmf.lun);
                        self.counters.aborted += (before - c.tasks.len() - c.queued.len()) as u64;
                        TaskMgmtResponseCode::Complete
                    }
                    _ => TaskMgmtResponseCode::NotSupported,
                };
                // Aborted commands that were in the window still took their
                // CmdSN; the queue may now run.
                let mut skip = std::mem::take(&mut self.misbehaviour.skip_stat_sn);
                let stat_sn = Self::next_stat_sn(c, &mut skip);
                let rsp = emit(
                    BhsRepr::TaskMgmtResponse(TaskMgmtResponseRepr {
                        response,
                        itt: tmf.itt,
                        stat_sn,
                        exp_cmd_sn: c.exp_cmd_sn,
                        max_cmd_sn: c.max_cmd_sn,
                    }),
                    &[],
                );
                out.push(Output::Send(conn, rsp));
            }
            BhsRepr::LogoutRequest(req) => {
                self.counters.logouts += 1;
                let Some(c) = self.conns.get_mut(&conn) else {
                    return;
                };
                let mut skip = std::mem::take(&mut self.misbehaviour.skip_stat_sn);
                let stat_sn = Self::next_stat_sn(c, &mut skip);
                let rsp = emit(
                    BhsRepr::LogoutResponse(LogoutResponseRepr {
                        response: LogoutResponseCode::Success,
                        itt: req.itt,
                        stat_sn,
                        exp_cmd_sn: c.exp_cmd_sn,
                        max_cmd_sn: c.max_cmd_sn,
                        time2wait: 2,
                        time2retain: 0,
                    }),
                    &[],
                );
                c.phase = Phase::Closed;
                c.tasks.clear();
                c.queued.clear();
                out.push(Output::Send(conn, rsp));
                out.push(Output::Close(conn));
                self.connection_lost(conn);
            }
            BhsRepr::TextRequest(req) => {
                let Some(c) = self.conns.get_mut(&conn) else {
                    return;
                };
                let answer: Vec<u8> = text_pairs(parsed.data)
                    .unwrap_or_default()
                    .iter()
                    .flat_map(|(k, _)| format!("{k}=NotUnderstood\0").into_bytes())
                    .collect();
                let mut skip = std::mem::take(&mut self.misbehaviour.skip_stat_sn);
                let stat_sn = Self::next_stat_sn(c, &mut skip);
                let rsp = emit(
                    BhsRepr::TextResponse(TextResponseRepr {
                        is_final: true,
                        continues: false,
                        lun: Lun::default(),
                        itt: req.itt,
                        ttt: RESERVED_TAG,
                        stat_sn,
                        exp_cmd_sn: c.exp_cmd_sn,
                        max_cmd_sn: c.max_cmd_sn,
                    }),
                    &answer,
                );
                out.push(Output::Send(conn, rsp));
            }
            _ => self.reject(conn, RejectReason::CommandNotSupported, pdu, out),
        }
    }

    fn reject(&mut self, conn: ConnId, reason: RejectReason, pdu: &[u8], out: &mut Vec<Output>) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        let mut skip = std::mem::take(&mut self.misbehaviour.skip_stat_sn);
        let stat_sn = Self::next_stat_sn(c, &mut skip);
        let header = pdu.get(..48).unwrap_or(pdu);
        let rsp = emit(
            BhsRepr::Reject(RejectRepr {
                reason,
                stat_sn,
                exp_cmd_sn: c.exp_cmd_sn,
                max_cmd_sn: c.max_cmd_sn,
                data_sn: SerialNumber(0),
            }),
            header,
        );
        out.push(Output::Send(conn, rsp));
    }

    /// Moves in-order commands from the queue to execution.
    fn run_queue(&mut self, conn: ConnId, out: &mut Vec<Output>) {
        loop {
            let Some(c) = self.conns.get_mut(&conn) else {
                return;
            };
            let Some((itt, task)) = c.queued.remove(&c.exp_cmd_sn.0) else {
                return;
            };
            c.exp_cmd_sn = c.exp_cmd_sn.next();
            c.tasks.insert(itt, task);
            self.advance(conn, itt, out);
        }
    }

    /// Moves a task on: fetch the rest of its write data, or execute it.
    fn advance(&mut self, conn: ConnId, itt: u32, out: &mut Vec<Output>) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        let Some(task) = c.tasks.get_mut(&itt) else {
            return;
        };
        if task.rdma_pending || !task.unsolicited_done {
            return;
        }
        if task.write && (task.data.len() as u32) < task.edtl {
            task.rdma_pending = true;
            out.push(Output::RdmaRead {
                conn,
                itt,
                offset: task.data.len() as u32,
                len: task.edtl - task.data.len() as u32,
            });
            return;
        }
        self.execute(conn, itt, out);
    }

    /// The RDMA READ of task `itt` brought `data`.
    pub fn rdma_read_done(&mut self, conn: ConnId, itt: u32, data: &[u8]) -> Vec<Output> {
        let mut out = Vec::new();
        let Some(task) = self
            .conns
            .get_mut(&conn)
            .and_then(|c| c.tasks.get_mut(&itt))
        else {
            return out;
        };
        task.data.extend_from_slice(data);
        task.rdma_pending = false;
        self.execute(conn, itt, &mut out);
        out
    }

    fn execute(&mut self, conn: ConnId, itt: u32, out: &mut Vec<Output>) {
        let hold = self.misbehaviour.hold_responses;
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        if hold {
            c.held.push(itt);
            return;
        }
        self.respond(conn, itt, out);
    }

    fn respond(&mut self, conn: ConnId, itt: u32, out: &mut Vec<Output>) {
        let scsi = Arc::clone(&self.scsi);
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        let Some(task) = c.tasks.remove(&itt) else {
            return;
        };
        self.counters.commands += 1;
        let request = Request {
            lun: task.lun,
            cdb: &task.cdb,
            data_out: task.write.then_some(DataOut::Bytes(task.data.as_slice())),
            data_in_capacity: if task.read { task.edtl } else { 0 },
        };
        let mut offset = 0u32;
        let response = scsi.execute(&request, &mut |piece| {
            out.push(Output::RdmaWrite {
                conn,
                itt,
                offset,
                data: piece.to_vec(),
            });
            offset += piece.len() as u32;
        });
        let residual = if task.read {
            response.data_in_residual
        } else if task.write {
            response.data_out_residual
        } else {
            Residual::None
        };
        let sense_bytes = response.sense_bytes();
        let sense = sense_bytes.as_deref().unwrap_or(&[]);
        let mut data = vec![
            0u8;
            SenseData {
                sense,
                response_data: &[]
            }
            .buffer_len()
        ];
        let _ = SenseData {
            sense,
            response_data: &[],
        }
        .emit(&mut data);
        if !task.immediate {
            if self.misbehaviour.withhold_max_cmd_sn > 0 {
                self.misbehaviour.withhold_max_cmd_sn -= 1;
                c.owed_window += 1;
            } else {
                c.max_cmd_sn = c.max_cmd_sn.next();
            }
        }
        let mut skip = std::mem::take(&mut self.misbehaviour.skip_stat_sn);
        let stat_sn = Self::next_stat_sn(c, &mut skip);
        let rsp = emit(
            BhsRepr::ScsiResponse(ScsiResponseRepr {
                response: 0,
                status: response.status.0,
                residual,
                bidi_read_residual: Residual::None,
                itt,
                snack_tag: 0,
                stat_sn,
                exp_cmd_sn: c.exp_cmd_sn,
                max_cmd_sn: c.max_cmd_sn,
                exp_data_sn: 0,
            }),
            &data,
        );
        out.push(Output::Send(conn, rsp));
    }

    /// Sends the held SCSI Responses (see [`Misbehaviour::hold_responses`]).
    pub fn release_responses(&mut self, conn: ConnId) -> Vec<Output> {
        let mut out = Vec::new();
        let held = self
            .conns
            .get_mut(&conn)
            .map(|c| std::mem::take(&mut c.held))
            .unwrap_or_default();
        for itt in held {
            self.respond(conn, itt, &mut out);
        }
        out
    }

    fn unsolicited(
        &mut self,
        conn: ConnId,
        build: impl FnOnce(&mut Connection) -> BhsRepr,
    ) -> Vec<Output> {
        let Some(c) = self.conns.get_mut(&conn) else {
            return Vec::new();
        };
        if !matches!(c.phase, Phase::FullFeature) {
            return Vec::new();
        }
        let header = build(c);
        vec![Output::Send(conn, emit(header, &[]))]
    }

    /// Opens the window by what withheld completions owe, announced with
    /// an unsolicited NOP-In.
    pub fn open_window(&mut self, conn: ConnId) -> Vec<Output> {
        self.unsolicited(conn, |c| {
            c.max_cmd_sn = SerialNumber(c.max_cmd_sn.0.wrapping_add(c.owed_window));
            c.owed_window = 0;
            BhsRepr::NopIn(NopInRepr {
                lun: Lun::default(),
                itt: RESERVED_TAG,
                ttt: RESERVED_TAG,
                stat_sn: c.stat_sn,
                exp_cmd_sn: c.exp_cmd_sn,
                max_cmd_sn: c.max_cmd_sn,
            })
        })
    }

    /// Pings the initiator (NOP-In with a TTT it must echo).
    pub fn send_ping(&mut self, conn: ConnId) -> Vec<Output> {
        self.unsolicited(conn, |c| {
            c.ping_ttt = c.ping_ttt.wrapping_add(1);
            c.outstanding_pings.push(c.ping_ttt);
            BhsRepr::NopIn(NopInRepr {
                lun: Lun::default(),
                itt: RESERVED_TAG,
                ttt: c.ping_ttt,
                stat_sn: c.stat_sn,
                exp_cmd_sn: c.exp_cmd_sn,
                max_cmd_sn: c.max_cmd_sn,
            })
        })
    }

    /// Sends an Asynchronous Message.
    pub fn send_async(
        &mut self,
        conn: ConnId,
        event: AsyncEvent,
        parameter2: u16,
        parameter3: u16,
    ) -> Vec<Output> {
        self.unsolicited(conn, |c| {
            let stat_sn = c.stat_sn;
            c.stat_sn = c.stat_sn.next();
            BhsRepr::AsyncMessage(AsyncMessageRepr {
                lun: Lun::default(),
                stat_sn,
                exp_cmd_sn: c.exp_cmd_sn,
                max_cmd_sn: c.max_cmd_sn,
                event,
                vendor_code: 0,
                parameter1: 0,
                parameter2,
                parameter3,
            })
        })
    }

    /// Drops the connection (the transport breaks; no PDU).
    pub fn drop_connection(&mut self, conn: ConnId) -> Vec<Output> {
        self.connection_lost(conn);
        vec![Output::Close(conn)]
    }
}

#[cfg(test)]
mod tests;
