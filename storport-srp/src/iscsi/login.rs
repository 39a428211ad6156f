//! The initiator's login (RFC 7143 §6.3, with the RFC 7145 iSER keys) as a
//! sans-IO state machine.
//!
//! ```text
//!  build_request ──► [Login Request] ──► target
//!  handle_response ◄── [Login Response] ◄── target
//!     └─ Send: call build_request again │ Complete(Negotiated) │ Err(LoginError)
//! ```
//!
//! **One login PDU outstanding at a time**: Linux `isert` posts a single
//! receive buffer during login and reposts it only after answering, so
//! [`Login::build_request`] refuses to build while a request is
//! unanswered.
//!
//! Stages:
//!
//! 1. *Security* (CSG 0, T, NSG 1): `InitiatorName`, `SessionType=Normal`,
//!    `TargetName`, `AuthMethod` — `None` without credentials, `CHAP,None`
//!    with one-way CHAP, `CHAP` alone with mutual CHAP (a target that could
//!    choose `None` would then escape authentication). If the target picks
//!    CHAP: `CHAP_A=5`, then `CHAP_N`/`CHAP_R` (plus `CHAP_I`/`CHAP_C` for
//!    mutual CHAP, whose answer is checked). A target that answers
//!    `AuthMethod=CHAP` when no credentials are configured fails the login
//!    with [`LoginError::ChapRequired`].
//! 2. *Operational* (CSG 1, T, NSG 3): every key Linux LIO would otherwise
//!    propose itself, so one exchange suffices against LIO:
//!    `HeaderDigest=None`, `DataDigest=None`, `MaxConnections=1`,
//!    `InitialR2T`, `ImmediateData`, `MaxBurstLength`, `FirstBurstLength`,
//!    `DefaultTime2Wait`, `DefaultTime2Retain`, `MaxOutstandingR2T=1`,
//!    `DataPDUInOrder=Yes`, `DataSequenceInOrder=Yes`,
//!    `ErrorRecoveryLevel=0`, `RDMAExtensions=Yes`,
//!    `InitiatorRecvDataSegmentLength`, `TargetRecvDataSegmentLength`,
//!    `MaxOutstandingUnexpectedPDUs` (LIO answers `NotUnderstood`, which
//!    is tolerated). Keys the target proposes itself are answered in the
//!    next request (unknown keys `NotUnderstood`).
//!
//! Every answer is checked against the negotiation rule of its key
//! (numeric minimum or maximum, boolean AND or OR, list membership); an
//! answer the initiator cannot accept (`RDMAExtensions=No`, a digest other
//! than `None`, an error recovery level above 0) fails the login with a
//! specific [`LoginError`]. A Login Response with the C bit is reassembled
//! (the initiator asks for the rest with empty requests) before its keys
//! are read.

use core::fmt;

use heapless::{String, Vec};

use super::Millis;
use super::chap;
use super::description::{Isid, TargetDescription};
use crate::wire::iscsi::login::{VERSION, status_class};
use crate::wire::iscsi::{
    BhsRepr, IscsiPdu, LoginRequestRepr, LoginResponseRepr, LoginStage, Padding, SerialNumber,
    command_window,
};
use crate::wire::text::{self, KnownKey, Limits, Param, TextData, TextWriter};

/// Most Login Request/Response exchanges one login may take.
pub const MAX_EXCHANGES: u8 = 16;
/// Largest reassembled text a Login Response may carry (`isert`'s login
/// buffer, and RFC 7143's default MaxRecvDataSegmentLength).
pub const MAX_LOGIN_TEXT: usize = 8192;
/// Room for the answers to keys the target proposes.
const ANSWERS_LEN: usize = 1024;
/// Size of a login request the initiator builds: BHS and text.
pub const MAX_REQUEST_LEN: usize = crate::wire::iscsi::BHS_LEN + 2048;

/// A Login Response status detail (RFC 7143 §11.13.5), by class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LoginStatus {
    /// Class 1, detail 1: the target moved temporarily.
    MovedTemporarily,
    /// Class 1, detail 2: the target moved permanently.
    MovedPermanently,
    /// Class 2: the initiator erred (the detail as received: 0 misc, 1
    /// authentication failed, 2 not authorized, 3 target not found, 4
    /// target removed, 5 unsupported version, 6 too many connections, 7
    /// missing parameter, 8 cannot include in session, 9 session type not
    /// supported, 0x0a session does not exist, 0x0b invalid during login).
    InitiatorError(u8),
    /// Class 3: the target failed (0 target error, 1 service unavailable,
    /// 2 out of resources); worth retrying.
    TargetError(u8),
    /// A class RFC 7143 does not define, or class 1 with another detail.
    Unknown {
        /// StatusClass.
        class: u8,
        /// StatusDetail.
        detail: u8,
    },
}

impl LoginStatus {
    /// Class 2, detail 1: authentication failed.
    pub const AUTH_FAILED: u8 = 0x01;
    /// Class 2, detail 2: the initiator is not authorized.
    pub const FORBIDDEN: u8 = 0x02;
    /// Class 2, detail 3: no such target.
    pub const NOT_FOUND: u8 = 0x03;

    const fn decode(class: u8, detail: u8) -> Self {
        match (class, detail) {
            (status_class::REDIRECT, 1) => Self::MovedTemporarily,
            (status_class::REDIRECT, 2) => Self::MovedPermanently,
            (status_class::INITIATOR_ERROR, d) => Self::InitiatorError(d),
            (status_class::TARGET_ERROR, d) => Self::TargetError(d),
            (class, detail) => Self::Unknown { class, detail },
        }
    }
}

/// Why a negotiated key was not acceptable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NegotiationError {
    /// The target answered `Reject`.
    Rejected,
    /// The target answered `NotUnderstood` for a key it must know.
    NotUnderstood,
    /// The value is malformed for the key.
    Malformed,
    /// The value breaks the key's negotiation rule (above our minimum
    /// offer, `Yes` where our `No` rules by AND, an item we did not
    /// offer...).
    IllegalAnswer,
    /// A value this initiator cannot work with (`RDMAExtensions=No`, a
    /// digest, an error recovery level above 0, more than one
    /// connection).
    Unacceptable,
    /// No answer to a key that needs one by the time the target left the
    /// stage.
    NoAnswer,
    /// The target sent the key twice.
    Duplicate,
    /// `FirstBurstLength` above `MaxBurstLength` in the result.
    Inconsistent,
}

/// Why a login failed (or was redirected).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LoginError {
    /// A non-success status; for a redirect, the `TargetAddress` the
    /// target named is [`Login::redirect_address`].
    Status(LoginStatus),
    /// A key's negotiation failed.
    Negotiation {
        /// The key.
        key: &'static str,
        /// Why.
        error: NegotiationError,
    },
    /// The target picked CHAP but no CHAP credentials are configured.
    ChapRequired,
    /// The target refused every authentication method offered.
    AuthMethodRejected,
    /// The target wants a CHAP algorithm other than MD5.
    ChapAlgorithmRefused,
    /// The target's CHAP challenge or identifier is malformed or missing.
    ChapBadChallenge,
    /// The target's CHAP challenge equals the initiator's (a reflection
    /// attack on mutual CHAP).
    ChapReflection,
    /// Mutual CHAP: the target's `CHAP_N` is not the configured
    /// `username_in`.
    ChapTargetName,
    /// Mutual CHAP: the target's `CHAP_R` is wrong or missing.
    ChapTargetAuthFailed,
    /// The target's `TargetPortalGroupTag` is not the configured one.
    TpgtMismatch {
        /// Configured.
        expected: u16,
        /// Received.
        received: u16,
    },
    /// The response is not a well-formed Login Response, or breaks the
    /// login rules (the detail names which).
    Protocol(ProtocolViolation),
    /// The login did not finish in `login_timeout`.
    Timeout,
    /// [`Login::build_request`] was called while a request is unanswered
    /// (or after the login ended): a caller bug, nothing was built.
    RequestOutstanding,
    /// [`Login::handle_response`] was called with no request outstanding.
    Unexpected,
    /// The caller's buffer cannot hold the request.
    BufferTooSmall,
}

/// A broken login rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ProtocolViolation {
    /// Not an iSCSI PDU, or not a Login Response.
    NotLoginResponse,
    /// The response's ITT is not the request's.
    IttMismatch,
    /// The response's ISID is not ours.
    IsidMismatch,
    /// VersionActive is not 0.
    Version,
    /// StatSN is not the expected one.
    StatSn,
    /// The response names another current stage than the request.
    Stage,
    /// T set though the initiator did not ask, or NSG beyond the
    /// initiator's.
    Transit,
    /// The text is malformed or longer than 8192 bytes.
    Text,
    /// The final response has TSIH 0.
    Tsih,
    /// ExpCmdSN/MaxCmdSN invalid, or ExpCmdSN is not the login CmdSN.
    CmdSn,
    /// The target transits while proposing keys that need an answer.
    OffersInFinalResponse,
    /// The target left the security stage before CHAP finished, or sent
    /// CHAP keys out of turn.
    AuthSequence,
    /// More than [`MAX_EXCHANGES`] exchanges.
    TooManyExchanges,
}

impl fmt::Display for LoginError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Status(status) => write!(f, "login status {status:?}"),
            Self::Negotiation { key, error } => write!(f, "negotiation of {key}: {error:?}"),
            Self::TpgtMismatch { expected, received } => {
                write!(f, "TargetPortalGroupTag {received}, expected {expected}")
            }
            Self::Protocol(v) => write!(f, "login protocol violation: {v:?}"),
            other => write!(f, "{other:?}"),
        }
    }
}

/// What the recovery machine should do after a failed login.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Disposition {
    /// Try again after the reconnect delay.
    Retry,
    /// Connect to the redirect address instead.
    Redirect,
    /// Do not retry: configuration or authorization is wrong.
    Fatal,
}

impl LoginError {
    /// What to do about it.
    #[must_use]
    pub const fn disposition(&self) -> Disposition {
        match self {
            Self::Status(status) => match status {
                LoginStatus::MovedTemporarily | LoginStatus::MovedPermanently => {
                    Disposition::Redirect
                }
                LoginStatus::InitiatorError(_) => Disposition::Fatal,
                LoginStatus::TargetError(_) | LoginStatus::Unknown { .. } => Disposition::Retry,
            },
            Self::Negotiation { .. }
            | Self::ChapRequired
            | Self::AuthMethodRejected
            | Self::ChapAlgorithmRefused
            | Self::ChapTargetName
            | Self::ChapTargetAuthFailed
            | Self::ChapReflection
            | Self::TpgtMismatch { .. } => Disposition::Fatal,
            Self::ChapBadChallenge
            | Self::Protocol(_)
            | Self::Timeout
            | Self::RequestOutstanding
            | Self::Unexpected
            | Self::BufferTooSmall => Disposition::Retry,
        }
    }
}

/// Per-attempt values the engine chooses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoginStart {
    /// TSIH: 0 for a new session or a reinstatement (ERL 0 never adds
    /// connections).
    pub tsih: u16,
    /// Connection id.
    pub cid: u16,
    /// The ITT all login requests of this attempt carry.
    pub itt: u32,
    /// The CmdSN all login requests carry; the first full-feature command
    /// uses it.
    pub cmd_sn: SerialNumber,
    /// For mutual CHAP: the identifier and a fresh random challenge.
    pub mutual_challenge: Option<(u8, [u8; 16])>,
}

/// How the initiator authenticated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AuthOutcome {
    /// `AuthMethod=None`.
    None,
    /// One-way CHAP.
    Chap,
    /// Mutual CHAP.
    MutualChap,
}

/// The result of a successful login: what the full feature phase uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Negotiated {
    /// The session handle the target assigned.
    pub tsih: u16,
    /// `TargetPortalGroupTag` (if the target declared it).
    pub tpgt: Option<u16>,
    /// How the initiator authenticated.
    pub auth: AuthOutcome,
    /// Largest data segment the initiator may send (the target's
    /// `TargetRecvDataSegmentLength`, capped by the initiator's offer).
    pub max_send_data_segment: u32,
    /// Largest data segment the target may send
    /// (`InitiatorRecvDataSegmentLength`).
    pub max_recv_data_segment: u32,
    /// `ImmediateData`.
    pub immediate_data: bool,
    /// `InitialR2T`.
    pub initial_r2t: bool,
    /// `FirstBurstLength`.
    pub first_burst_length: u32,
    /// `MaxBurstLength`.
    pub max_burst_length: u32,
    /// `DefaultTime2Wait`, seconds.
    pub default_time2wait: u16,
    /// `DefaultTime2Retain`, seconds.
    pub default_time2retain: u16,
    /// `MaxOutstandingR2T`.
    pub max_outstanding_r2t: u16,
    /// `MaxOutstandingUnexpectedPDUs`, `None` if the target did not
    /// understand the key.
    pub max_outstanding_unexpected_pdus: Option<u32>,
    /// The next CmdSN to assign (the login's).
    pub cmd_sn: SerialNumber,
    /// ExpCmdSN of the final response.
    pub exp_cmd_sn: SerialNumber,
    /// MaxCmdSN of the final response.
    pub max_cmd_sn: SerialNumber,
    /// The StatSN the initiator expects next.
    pub exp_stat_sn: SerialNumber,
}

/// What to do after a response was handled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoginStep {
    /// Build and send the next request ([`Login::build_request`]).
    Send,
    /// The session is in full feature phase.
    Complete(Negotiated),
}

/// Which request comes next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Next {
    SecurityOffer,
    ChapAlgorithm,
    ChapResponse,
    /// Answers (possibly none) with T, NSG 1.
    SecurityTransit,
    OperationalOffer,
    /// Answers (possibly none) with T, NSG 3.
    OperationalTransit,
    /// An empty request (same stage, no T) for the rest of a continued
    /// response.
    ContinueReceive,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AuthState {
    Offered,
    AlgorithmSent,
    ResponseSent,
    Done(AuthOutcome),
}

/// The keys of the operational offer, in the order they are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
enum OpKey {
    HeaderDigest,
    DataDigest,
    MaxConnections,
    InitialR2T,
    ImmediateData,
    MaxBurstLength,
    FirstBurstLength,
    DefaultTime2Wait,
    DefaultTime2Retain,
    MaxOutstandingR2T,
    DataPduInOrder,
    DataSequenceInOrder,
    ErrorRecoveryLevel,
    RdmaExtensions,
    InitiatorRecvDataSegmentLength,
    TargetRecvDataSegmentLength,
    MaxOutstandingUnexpectedPdus,
}

impl OpKey {
    const ALL: [OpKey; 17] = [
        OpKey::HeaderDigest,
        OpKey::DataDigest,
        OpKey::MaxConnections,
        OpKey::InitialR2T,
        OpKey::ImmediateData,
        OpKey::MaxBurstLength,
        OpKey::FirstBurstLength,
        OpKey::DefaultTime2Wait,
        OpKey::DefaultTime2Retain,
        OpKey::MaxOutstandingR2T,
        OpKey::DataPduInOrder,
        OpKey::DataSequenceInOrder,
        OpKey::ErrorRecoveryLevel,
        OpKey::RdmaExtensions,
        OpKey::InitiatorRecvDataSegmentLength,
        OpKey::TargetRecvDataSegmentLength,
        OpKey::MaxOutstandingUnexpectedPdus,
    ];

    const fn name(self) -> &'static str {
        match self {
            Self::HeaderDigest => "HeaderDigest",
            Self::DataDigest => "DataDigest",
            Self::MaxConnections => "MaxConnections",
            Self::InitialR2T => "InitialR2T",
            Self::ImmediateData => "ImmediateData",
            Self::MaxBurstLength => "MaxBurstLength",
            Self::FirstBurstLength => "FirstBurstLength",
            Self::DefaultTime2Wait => "DefaultTime2Wait",
            Self::DefaultTime2Retain => "DefaultTime2Retain",
            Self::MaxOutstandingR2T => "MaxOutstandingR2T",
            Self::DataPduInOrder => "DataPDUInOrder",
            Self::DataSequenceInOrder => "DataSequenceInOrder",
            Self::ErrorRecoveryLevel => "ErrorRecoveryLevel",
            Self::RdmaExtensions => "RDMAExtensions",
            Self::InitiatorRecvDataSegmentLength => "InitiatorRecvDataSegmentLength",
            Self::TargetRecvDataSegmentLength => "TargetRecvDataSegmentLength",
            Self::MaxOutstandingUnexpectedPdus => "MaxOutstandingUnexpectedPDUs",
        }
    }

    fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }

    const fn bit(self) -> u32 {
        1 << (self as u8)
    }

    /// Keys whose answer decides something and so must come back.
    const fn needs_answer(self, values: &Values) -> bool {
        match self {
            // Declarative, defaulted, or tolerated when absent.
            Self::HeaderDigest
            | Self::DataDigest
            | Self::InitiatorRecvDataSegmentLength
            | Self::TargetRecvDataSegmentLength
            | Self::MaxOutstandingUnexpectedPdus => false,
            // OR with our Yes, AND with our No: decided by the offer.
            Self::InitialR2T => !values.initial_r2t,
            Self::ImmediateData => values.immediate_data,
            Self::DataPduInOrder | Self::DataSequenceInOrder => false,
            _ => true,
        }
    }
}

/// Current values of the operational keys (offers, then results).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Values {
    initial_r2t: bool,
    immediate_data: bool,
    max_burst: u32,
    first_burst: u32,
    time2wait: u16,
    time2retain: u16,
    max_outstanding_r2t: u16,
    initiator_recv_dsl: u32,
    target_recv_dsl: u32,
    max_unexpected: Option<u32>,
}

/// The login state machine for one connection attempt.
pub struct Login<'d> {
    desc: &'d TargetDescription,
    start: LoginStart,
    isid: Isid,
    next: Next,
    /// The stage of the request in flight (or last sent).
    stage: LoginStage,
    /// The stage a continued response belongs to.
    auth: AuthState,
    outstanding: bool,
    finished: bool,
    exchanges: u8,
    exp_stat_sn: Option<SerialNumber>,
    deadline: Millis,
    rx: Vec<u8, MAX_LOGIN_TEXT>,
    answers: [u8; ANSWERS_LEN],
    answers_len: usize,
    /// Operational keys offered (bit per [`OpKey`]).
    offered: u32,
    /// Operational keys answered or settled.
    settled: u32,
    values: Values,
    tpgt: Option<u16>,
    chap_response: [u8; chap::RESPONSE_LEN],
    chap_id: u8,
    /// The last request asked to transit.
    asked_transit: Option<LoginStage>,
    redirect: String<{ text::MAX_VALUE_LEN }>,
}

impl fmt::Debug for Login<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Login")
            .field("next", &self.next)
            .field("stage", &self.stage)
            .field("auth", &self.auth)
            .field("outstanding", &self.outstanding)
            .field("exchanges", &self.exchanges)
            .finish_non_exhaustive()
    }
}

fn neg(key: &'static str, error: NegotiationError) -> LoginError {
    LoginError::Negotiation { key, error }
}

fn protocol(v: ProtocolViolation) -> LoginError {
    LoginError::Protocol(v)
}

/// A number in decimal or `0x` hex, as CHAP_I may travel.
fn parse_small_number(text: &str) -> Option<u64> {
    if let Some(hex) = text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
        u64::from_str_radix(hex, 16).ok()
    } else if text.bytes().all(|b| b.is_ascii_digit()) && !text.is_empty() {
        text.parse().ok()
    } else {
        None
    }
}

impl<'d> Login<'d> {
    /// A login for `desc`, started at `now` (the login timeout runs from
    /// here).
    #[must_use]
    pub fn new(desc: &'d TargetDescription, start: LoginStart, now: Millis) -> Self {
        let p = &desc.params;
        Self {
            desc,
            start,
            isid: desc.isid,
            next: Next::SecurityOffer,
            stage: LoginStage::SecurityNegotiation,
            auth: AuthState::Offered,
            outstanding: false,
            finished: false,
            exchanges: 0,
            exp_stat_sn: None,
            deadline: now.plus(Millis::from_secs(desc.timeouts.login)),
            rx: Vec::new(),
            answers: [0; ANSWERS_LEN],
            answers_len: 0,
            offered: 0,
            settled: 0,
            values: Values {
                initial_r2t: p.initial_r2t,
                immediate_data: p.immediate_data,
                max_burst: p.max_burst_length,
                first_burst: p.first_burst_length,
                time2wait: p.default_time2wait,
                time2retain: p.default_time2retain,
                max_outstanding_r2t: 1,
                initiator_recv_dsl: p.initiator_recv_data_segment_length,
                target_recv_dsl: p.target_recv_data_segment_length,
                max_unexpected: Some(p.max_outstanding_unexpected_pdus),
            },
            tpgt: None,
            chap_response: [0; chap::RESPONSE_LEN],
            chap_id: 0,
            asked_transit: None,
            redirect: String::new(),
        }
    }

    /// When [`Self::handle_timeout`] must be called (the login deadline),
    /// `None` once the login ended.
    #[must_use]
    pub const fn poll_at(&self) -> Option<Millis> {
        if self.finished {
            None
        } else {
            Some(self.deadline)
        }
    }

    /// Fails the login if its deadline passed.
    ///
    /// # Errors
    ///
    /// [`LoginError::Timeout`].
    pub fn handle_timeout(&mut self, now: Millis) -> Result<(), LoginError> {
        if !self.finished && now >= self.deadline {
            self.finished = true;
            return Err(LoginError::Timeout);
        }
        Ok(())
    }

    /// Whether a request is waiting for its response.
    #[must_use]
    pub const fn is_outstanding(&self) -> bool {
        self.outstanding
    }

    fn auth_list(&self) -> &'static str {
        match (&self.desc.auth.chap, &self.desc.auth.mutual) {
            (None, _) => "None",
            (Some(_), None) => "CHAP,None",
            (Some(_), Some(_)) => "CHAP",
        }
    }

    /// Builds the next Login Request into `buf` and returns its length.
    ///
    /// # Errors
    ///
    /// [`LoginError::RequestOutstanding`] while a request is unanswered or
    /// after the login ended, [`LoginError::BufferTooSmall`].
    ///
    /// # IRQL
    ///
    /// <= DISPATCH_LEVEL; never blocks, never allocates.
    pub fn build_request(&mut self, buf: &mut [u8]) -> Result<usize, LoginError> {
        if self.outstanding || self.finished {
            return Err(LoginError::RequestOutstanding);
        }
        let mut text_buf = [0u8; MAX_REQUEST_LEN - crate::wire::iscsi::BHS_LEN];
        let (stage, transit, text_len) = self.write_text(&mut text_buf)?;
        let header = LoginRequestRepr {
            current_stage: stage,
            next_stage: transit,
            continues: false,
            version_max: VERSION,
            version_min: VERSION,
            isid: self.isid.bytes(),
            tsih: self.start.tsih,
            itt: self.start.itt,
            cid: self.start.cid,
            cmd_sn: self.start.cmd_sn,
            exp_stat_sn: self.exp_stat_sn.unwrap_or_default(),
        };
        let pdu = IscsiPdu {
            header: BhsRepr::LoginRequest(header),
            ahs: &[],
            data: text_buf.get(..text_len).unwrap_or(&[]),
        };
        let len = pdu
            .emit(buf, Padding::None)
            .map_err(|_| LoginError::BufferTooSmall)?;
        self.stage = stage;
        if self.next != Next::ContinueReceive {
            // Fetching the rest of a continued response keeps the
            // transit the original request asked for.
            self.asked_transit = transit;
        }
        self.outstanding = true;
        self.answers_len = 0;
        Ok(len)
    }

    /// Writes the text of the next request; returns its stage, transit
    /// target and length.
    fn write_text(
        &mut self,
        out: &mut [u8],
    ) -> Result<(LoginStage, Option<LoginStage>, usize), LoginError> {
        use LoginStage::{FullFeature, OperationalNegotiation as Op, SecurityNegotiation as Sec};
        let too_small = |_| LoginError::BufferTooSmall;
        let answers_len = self.answers_len;
        let mut w = TextWriter::new(out);
        let (stage, transit) = match self.next {
            Next::SecurityOffer => {
                let d = self.desc;
                w.push("InitiatorName", d.initiator_name.as_str())
                    .map_err(too_small)?;
                w.push("SessionType", "Normal").map_err(too_small)?;
                w.push("TargetName", d.target_name.as_str())
                    .map_err(too_small)?;
                w.push("AuthMethod", self.auth_list()).map_err(too_small)?;
                (Sec, Some(Op))
            }
            Next::ChapAlgorithm => {
                w.push("CHAP_A", "5").map_err(too_small)?;
                (Sec, None)
            }
            Next::ChapResponse => {
                let creds = self
                    .desc
                    .auth
                    .chap
                    .as_ref()
                    .ok_or(LoginError::ChapRequired)?;
                w.push("CHAP_N", creds.username.as_str())
                    .map_err(too_small)?;
                let mut hex = [0u8; 2 + 2 * chap::RESPONSE_LEN];
                let r = chap::encode_hex(&self.chap_response, &mut hex)
                    .ok_or(LoginError::BufferTooSmall)?;
                w.push("CHAP_R", r).map_err(too_small)?;
                if let (Some(_), Some((id, challenge))) =
                    (&self.desc.auth.mutual, self.start.mutual_challenge)
                {
                    let mut id_text = [0u8; 3];
                    w.push("CHAP_I", decimal(u32::from(id), &mut id_text))
                        .map_err(too_small)?;
                    let mut c = [0u8; 2 + 32];
                    let c =
                        chap::encode_hex(&challenge, &mut c).ok_or(LoginError::BufferTooSmall)?;
                    w.push("CHAP_C", c).map_err(too_small)?;
                }
                (Sec, Some(Op))
            }
            Next::SecurityTransit => (Sec, Some(Op)),
            Next::OperationalOffer => {
                self.write_offer(&mut w)?;
                (Op, Some(FullFeature))
            }
            Next::OperationalTransit => (Op, Some(FullFeature)),
            Next::ContinueReceive => (self.stage, None),
        };
        let mut len = w.finish();
        if self.next != Next::ContinueReceive {
            // Answers to the target's proposals ride along.
            let answers = self.answers.get(..answers_len).unwrap_or(&[]);
            let dst = out
                .get_mut(len..len + answers.len())
                .ok_or(LoginError::BufferTooSmall)?;
            dst.copy_from_slice(answers);
            len += answers.len();
        }
        Ok((stage, transit, len))
    }

    fn write_offer(&mut self, w: &mut TextWriter<'_>) -> Result<(), LoginError> {
        let too_small = |_| LoginError::BufferTooSmall;
        let v = self.values;
        let yes_no = |b: bool| if b { "Yes" } else { "No" };
        for key in OpKey::ALL {
            let mut scratch = [0u8; 10];
            let value: &str = match key {
                OpKey::HeaderDigest | OpKey::DataDigest => "None",
                OpKey::MaxConnections | OpKey::MaxOutstandingR2T => "1",
                OpKey::InitialR2T => yes_no(v.initial_r2t),
                OpKey::ImmediateData => yes_no(v.immediate_data),
                OpKey::MaxBurstLength => decimal(v.max_burst, &mut scratch),
                OpKey::FirstBurstLength => decimal(v.first_burst, &mut scratch),
                OpKey::DefaultTime2Wait => decimal(u32::from(v.time2wait), &mut scratch),
                OpKey::DefaultTime2Retain => decimal(u32::from(v.time2retain), &mut scratch),
                OpKey::DataPduInOrder | OpKey::DataSequenceInOrder => "Yes",
                OpKey::ErrorRecoveryLevel => "0",
                OpKey::RdmaExtensions => "Yes",
                OpKey::InitiatorRecvDataSegmentLength => {
                    decimal(v.initiator_recv_dsl, &mut scratch)
                }
                OpKey::TargetRecvDataSegmentLength => decimal(v.target_recv_dsl, &mut scratch),
                OpKey::MaxOutstandingUnexpectedPdus => {
                    decimal(v.max_unexpected.unwrap_or(0), &mut scratch)
                }
            };
            // A key the target already proposed is answered, not offered.
            if self.settled & key.bit() != 0 {
                continue;
            }
            w.push(key.name(), value).map_err(too_small)?;
            self.offered |= key.bit();
        }
        Ok(())
    }

    /// Handles one Login Response (BHS and data segment, no iSER header).
    ///
    /// # Errors
    ///
    /// A [`LoginError`]; the login is over.
    ///
    /// # IRQL
    ///
    /// <= DISPATCH_LEVEL; never blocks, never allocates.
    pub fn handle_response(&mut self, pdu: &[u8]) -> Result<LoginStep, LoginError> {
        if !self.outstanding || self.finished {
            return Err(LoginError::Unexpected);
        }
        self.outstanding = false;
        let result = self.handle_inner(pdu);
        if !matches!(result, Ok(LoginStep::Send)) {
            self.finished = true;
        }
        result
    }

    fn handle_inner(&mut self, pdu: &[u8]) -> Result<LoginStep, LoginError> {
        use ProtocolViolation as V;
        let parsed = IscsiPdu::parse(pdu).map_err(|_| protocol(V::NotLoginResponse))?;
        let BhsRepr::LoginResponse(rsp) = parsed.header else {
            return Err(protocol(V::NotLoginResponse));
        };
        self.exchanges = self.exchanges.saturating_add(1);
        if self.exchanges > MAX_EXCHANGES {
            return Err(protocol(V::TooManyExchanges));
        }
        self.check_header(&rsp)?;
        if rsp.status_class != status_class::SUCCESS {
            return Err(self.status_error(&rsp, parsed.data));
        }
        self.rx
            .extend_from_slice(parsed.data)
            .map_err(|()| protocol(V::Text))?;
        if rsp.continues {
            self.next = Next::ContinueReceive;
            return Ok(LoginStep::Send);
        }
        let text = core::mem::take(&mut self.rx);
        let data = TextData::parse(&text, &Limits::NEGOTIATION).map_err(|_| protocol(V::Text))?;
        match rsp.current_stage {
            LoginStage::SecurityNegotiation => self.security_response(&rsp, &data),
            LoginStage::OperationalNegotiation => self.operational_response(&rsp, &data),
            LoginStage::FullFeature => Err(protocol(V::Stage)),
        }
    }

    fn check_header(&mut self, rsp: &LoginResponseRepr) -> Result<(), LoginError> {
        use ProtocolViolation as V;
        if rsp.itt != self.start.itt {
            return Err(protocol(V::IttMismatch));
        }
        if rsp.isid != self.isid.bytes() {
            return Err(protocol(V::IsidMismatch));
        }
        if rsp.status_class != status_class::SUCCESS {
            // Error responses carry no meaningful stage or sequence.
            return Ok(());
        }
        if rsp.version_active != VERSION {
            return Err(protocol(V::Version));
        }
        match self.exp_stat_sn {
            Some(expected) if rsp.stat_sn != expected => return Err(protocol(V::StatSn)),
            _ => self.exp_stat_sn = Some(rsp.stat_sn.next()),
        }
        if rsp.current_stage != self.stage {
            return Err(protocol(V::Stage));
        }
        if let Some(next) = rsp.next_stage {
            let allowed = match self.asked_transit {
                Some(asked) => next <= asked && next > rsp.current_stage,
                None => false,
            };
            if !allowed {
                return Err(protocol(V::Transit));
            }
        }
        Ok(())
    }

    fn status_error(&mut self, rsp: &LoginResponseRepr, data: &[u8]) -> LoginError {
        let status = LoginStatus::decode(rsp.status_class, rsp.status_detail);
        self.redirect.clear();
        if let Ok(text) = TextData::parse(data, &Limits::NEGOTIATION) {
            if let Some(addr) = text.get("TargetAddress") {
                // Validated text: at most 255 bytes, so it fits.
                let _ = self.redirect.push_str(addr);
            }
        }
        LoginError::Status(status)
    }

    /// The `TargetAddress` of the last redirect (empty if none was named).
    #[must_use]
    pub fn redirect_address(&self) -> &str {
        self.redirect.as_str()
    }

    /// Records an answer to a target proposal for the next request.
    fn answer(&mut self, key: &str, value: &str) -> Result<(), LoginError> {
        let mut w = TextWriter::new(self.answers.get_mut(self.answers_len..).unwrap_or(&mut []));
        w.push(key, value)
            .map_err(|_| protocol(ProtocolViolation::Text))?;
        self.answers_len += w.finish();
        Ok(())
    }

    fn security_response(
        &mut self,
        rsp: &LoginResponseRepr,
        data: &TextData<'_>,
    ) -> Result<LoginStep, LoginError> {
        use ProtocolViolation as V;
        let mut auth_answer: Option<&str> = None;
        let (mut chap_a, mut chap_i, mut chap_c, mut chap_n, mut chap_r) =
            (None, None, None, None, None);
        let mut offers = false;
        for pair in data.pairs() {
            match pair.key {
                "AuthMethod" => auth_answer = Some(pair.value),
                "CHAP_A" => chap_a = Some(pair.value),
                "CHAP_I" => chap_i = Some(pair.value),
                "CHAP_C" => chap_c = Some(pair.value),
                "CHAP_N" => chap_n = Some(pair.value),
                "CHAP_R" => chap_r = Some(pair.value),
                "TargetPortalGroupTag" => self.record_tpgt(pair.value)?,
                "TargetAlias" | "TargetAddress" => {}
                other => {
                    offers = true;
                    self.target_proposal(other, pair.value)?;
                }
            }
        }
        let transit = rsp.next_stage.is_some();
        match self.auth {
            AuthState::Offered => {
                let chosen = auth_answer.ok_or(neg("AuthMethod", NegotiationError::NoAnswer))?;
                match chosen {
                    "None" if self.auth_list().split(',').any(|m| m == "None") => {
                        self.auth = AuthState::Done(AuthOutcome::None);
                    }
                    "CHAP" => {
                        if self.desc.auth.chap.is_none() {
                            return Err(LoginError::ChapRequired);
                        }
                        if transit {
                            // LIO, not enforcing authentication, picks
                            // CHAP from "CHAP,None" and transits at
                            // once: it checks nothing. Acceptable unless
                            // the initiator must authenticate the target.
                            if self.desc.auth.mutual.is_some() {
                                return Err(protocol(V::AuthSequence));
                            }
                            self.auth = AuthState::Done(AuthOutcome::None);
                            if offers {
                                return Err(protocol(V::OffersInFinalResponse));
                            }
                            self.stage = LoginStage::OperationalNegotiation;
                            self.next = Next::OperationalOffer;
                            return Ok(LoginStep::Send);
                        }
                        self.auth = AuthState::AlgorithmSent;
                        self.next = Next::ChapAlgorithm;
                        return Ok(LoginStep::Send);
                    }
                    "Reject" => return Err(LoginError::AuthMethodRejected),
                    _ => return Err(neg("AuthMethod", NegotiationError::IllegalAnswer)),
                }
            }
            AuthState::AlgorithmSent => {
                self.chap_challenge(chap_a, chap_i, chap_c)?;
                if transit {
                    return Err(protocol(V::AuthSequence));
                }
                self.auth = AuthState::ResponseSent;
                self.next = Next::ChapResponse;
                return Ok(LoginStep::Send);
            }
            AuthState::ResponseSent => {
                let outcome = self.chap_verify_target(chap_n, chap_r)?;
                self.auth = AuthState::Done(outcome);
            }
            AuthState::Done(_) => {
                if auth_answer.is_some() || chap_r.is_some() || chap_c.is_some() {
                    return Err(protocol(V::AuthSequence));
                }
            }
        }
        if transit {
            if offers {
                return Err(protocol(V::OffersInFinalResponse));
            }
            self.stage = LoginStage::OperationalNegotiation;
            self.next = Next::OperationalOffer;
        } else {
            self.next = Next::SecurityTransit;
        }
        Ok(LoginStep::Send)
    }

    fn chap_challenge(
        &mut self,
        a: Option<&str>,
        i: Option<&str>,
        c: Option<&str>,
    ) -> Result<(), LoginError> {
        match a {
            Some("5") => {}
            Some(_) => return Err(LoginError::ChapAlgorithmRefused),
            None => return Err(LoginError::ChapBadChallenge),
        }
        let id = i
            .and_then(parse_small_number)
            .and_then(|n| u8::try_from(n).ok())
            .ok_or(LoginError::ChapBadChallenge)?;
        let mut challenge = [0u8; chap::MAX_BINARY_LEN];
        let challenge = chap::decode_binary(c.ok_or(LoginError::ChapBadChallenge)?, &mut challenge)
            .map_err(|_| LoginError::ChapBadChallenge)?;
        if let Some((_, ours)) = self.start.mutual_challenge {
            if self.desc.auth.mutual.is_some() && challenge == ours.as_slice() {
                return Err(LoginError::ChapReflection);
            }
        }
        let creds = self
            .desc
            .auth
            .chap
            .as_ref()
            .ok_or(LoginError::ChapRequired)?;
        self.chap_id = id;
        self.chap_response = chap::response(id, &creds.secret, challenge);
        Ok(())
    }

    fn chap_verify_target(
        &self,
        n: Option<&str>,
        r: Option<&str>,
    ) -> Result<AuthOutcome, LoginError> {
        let (Some(mutual), Some((id, challenge))) =
            (&self.desc.auth.mutual, self.start.mutual_challenge)
        else {
            if n.is_some() || r.is_some() {
                return Err(protocol(ProtocolViolation::AuthSequence));
            }
            return Ok(AuthOutcome::Chap);
        };
        if n != Some(mutual.username.as_str()) {
            return Err(if n.is_none() {
                LoginError::ChapTargetAuthFailed
            } else {
                LoginError::ChapTargetName
            });
        }
        let mut got = [0u8; chap::MAX_BINARY_LEN];
        let got = chap::decode_binary(r.ok_or(LoginError::ChapTargetAuthFailed)?, &mut got)
            .map_err(|_| LoginError::ChapTargetAuthFailed)?;
        let expected = chap::response(id, &mutual.secret, &challenge);
        if chap::responses_equal(&expected, got) {
            Ok(AuthOutcome::MutualChap)
        } else {
            Err(LoginError::ChapTargetAuthFailed)
        }
    }

    fn record_tpgt(&mut self, value: &str) -> Result<(), LoginError> {
        let Ok(Param::TargetPortalGroupTag(tag)) =
            Param::parse(KnownKey::TargetPortalGroupTag, value)
        else {
            return Err(neg("TargetPortalGroupTag", NegotiationError::Malformed));
        };
        if let Some(expected) = self.desc.tpgt {
            if expected != tag {
                return Err(LoginError::TpgtMismatch {
                    expected,
                    received: tag,
                });
            }
        }
        self.tpgt = Some(tag);
        Ok(())
    }

    fn operational_response(
        &mut self,
        rsp: &LoginResponseRepr,
        data: &TextData<'_>,
    ) -> Result<LoginStep, LoginError> {
        let mut offers = false;
        let mut seen: u32 = 0;
        for pair in data.pairs() {
            match pair.key {
                "TargetPortalGroupTag" => self.record_tpgt(pair.value)?,
                "TargetAlias" | "TargetAddress" => {}
                key => match OpKey::from_name(key) {
                    Some(op) if self.offered & op.bit() != 0 => {
                        if seen & op.bit() != 0 || self.settled & op.bit() != 0 {
                            return Err(neg(op.name(), NegotiationError::Duplicate));
                        }
                        seen |= op.bit();
                        self.settled |= op.bit();
                        self.check_answer(op, pair.value)?;
                    }
                    _ => {
                        offers = true;
                        self.target_proposal(key, pair.value)?;
                    }
                },
            }
        }
        if rsp.next_stage.is_none() {
            self.next = Next::OperationalTransit;
            return Ok(LoginStep::Send);
        }
        if offers {
            return Err(protocol(ProtocolViolation::OffersInFinalResponse));
        }
        self.complete(rsp)
    }

    /// Checks the target's answer to one of our offers and records the
    /// result.
    fn check_answer(&mut self, key: OpKey, value: &str) -> Result<(), LoginError> {
        use NegotiationError as E;
        let name = key.name();
        match value {
            "Reject" => {
                return Err(neg(
                    name,
                    if key == OpKey::RdmaExtensions {
                        E::Unacceptable
                    } else {
                        E::Rejected
                    },
                ));
            }
            "NotUnderstood" => {
                if key == OpKey::MaxOutstandingUnexpectedPdus {
                    self.values.max_unexpected = None;
                    return Ok(());
                }
                return Err(neg(
                    name,
                    if key == OpKey::RdmaExtensions {
                        E::Unacceptable
                    } else {
                        E::NotUnderstood
                    },
                ));
            }
            "Irrelevant" => {
                if key == OpKey::RdmaExtensions {
                    return Err(neg(name, E::Unacceptable));
                }
                return Ok(());
            }
            _ => {}
        }
        let v = &mut self.values;
        let boolean = || match value {
            "Yes" => Ok(true),
            "No" => Ok(false),
            _ => Err(neg(name, E::Malformed)),
        };
        let number = |known: KnownKey| -> Result<u64, LoginError> {
            match Param::parse(known, value).map_err(|_| neg(name, E::Malformed))? {
                Param::MaxBurstLength(n)
                | Param::FirstBurstLength(n)
                | Param::InitiatorRecvDataSegmentLength(n)
                | Param::TargetRecvDataSegmentLength(n)
                | Param::MaxOutstandingUnexpectedPdus(n) => Ok(u64::from(n)),
                Param::DefaultTime2Wait(n)
                | Param::DefaultTime2Retain(n)
                | Param::MaxConnections(n)
                | Param::MaxOutstandingR2T(n) => Ok(u64::from(n)),
                Param::ErrorRecoveryLevel(n) => Ok(u64::from(n)),
                _ => Err(neg(name, E::Malformed)),
            }
        };
        match key {
            OpKey::HeaderDigest | OpKey::DataDigest => {
                if value != "None" {
                    return Err(neg(name, E::Unacceptable));
                }
            }
            OpKey::RdmaExtensions => {
                if !boolean()? {
                    return Err(neg(name, E::Unacceptable));
                }
            }
            OpKey::MaxConnections => {
                if number(KnownKey::MaxConnections)? != 1 {
                    return Err(neg(name, E::IllegalAnswer));
                }
            }
            OpKey::ErrorRecoveryLevel => {
                if number(KnownKey::ErrorRecoveryLevel)? != 0 {
                    return Err(neg(name, E::IllegalAnswer));
                }
            }
            OpKey::MaxOutstandingR2T => {
                if number(KnownKey::MaxOutstandingR2T)? != 1 {
                    return Err(neg(name, E::IllegalAnswer));
                }
            }
            OpKey::InitialR2T => {
                let result = boolean()?;
                // OR: our Yes stays Yes.
                if v.initial_r2t && !result {
                    return Err(neg(name, E::IllegalAnswer));
                }
                v.initial_r2t = result;
            }
            OpKey::ImmediateData => {
                let result = boolean()?;
                // AND: our No stays No.
                if !v.immediate_data && result {
                    return Err(neg(name, E::IllegalAnswer));
                }
                v.immediate_data = result;
            }
            OpKey::DataPduInOrder | OpKey::DataSequenceInOrder => {
                if !boolean()? {
                    return Err(neg(name, E::IllegalAnswer));
                }
            }
            OpKey::MaxBurstLength => {
                v.max_burst = min_answer(number(KnownKey::MaxBurstLength)?, v.max_burst, name)?;
            }
            OpKey::FirstBurstLength => {
                v.first_burst =
                    min_answer(number(KnownKey::FirstBurstLength)?, v.first_burst, name)?;
            }
            OpKey::DefaultTime2Retain => {
                let n = number(KnownKey::DefaultTime2Retain)?;
                v.time2retain = min_answer(n, u32::from(v.time2retain), name)? as u16;
            }
            OpKey::DefaultTime2Wait => {
                let n = number(KnownKey::DefaultTime2Wait)?;
                if n < u64::from(v.time2wait) {
                    return Err(neg(name, E::IllegalAnswer));
                }
                // The key's range keeps it within u16.
                v.time2wait = n as u16;
            }
            OpKey::InitiatorRecvDataSegmentLength => {
                // Declarative: the target may echo it; ours stands.
                number(KnownKey::InitiatorRecvDataSegmentLength)?;
            }
            OpKey::TargetRecvDataSegmentLength => {
                let declared = number(KnownKey::TargetRecvDataSegmentLength)?;
                v.target_recv_dsl = v.target_recv_dsl.min(declared as u32);
            }
            OpKey::MaxOutstandingUnexpectedPdus => {
                let n = number(KnownKey::MaxOutstandingUnexpectedPdus)?;
                v.max_unexpected = Some(n as u32);
            }
        }
        Ok(())
    }

    /// The target proposes a key the initiator did not offer: answer it.
    fn target_proposal(&mut self, key: &str, value: &str) -> Result<(), LoginError> {
        use NegotiationError as E;
        let Some(op) = OpKey::from_name(key) else {
            return self.answer(key, "NotUnderstood");
        };
        if self.settled & op.bit() != 0 || self.offered & op.bit() != 0 {
            return Err(neg(op.name(), E::Duplicate));
        }
        self.settled |= op.bit();
        let name = op.name();
        let v = self.values;
        let yes_no = |b: bool| if b { "Yes" } else { "No" };
        let proposed_bool = match value {
            "Yes" => Some(true),
            "No" => Some(false),
            _ => None,
        };
        let proposed_num = || -> Result<u32, LoginError> {
            text::Param::parse(
                KnownKey::from_name(name).ok_or(neg(name, E::Malformed))?,
                value,
            )
            .ok()
            .and_then(|p| match p {
                Param::MaxBurstLength(n)
                | Param::FirstBurstLength(n)
                | Param::InitiatorRecvDataSegmentLength(n)
                | Param::TargetRecvDataSegmentLength(n)
                | Param::MaxOutstandingUnexpectedPdus(n) => Some(n),
                Param::DefaultTime2Wait(n)
                | Param::DefaultTime2Retain(n)
                | Param::MaxConnections(n)
                | Param::MaxOutstandingR2T(n) => Some(u32::from(n)),
                Param::ErrorRecoveryLevel(n) => Some(u32::from(n)),
                _ => None,
            })
            .ok_or(neg(name, E::Malformed))
        };
        let mut scratch = [0u8; 10];
        match op {
            OpKey::HeaderDigest | OpKey::DataDigest => {
                if !value.split(',').any(|d| d == "None") {
                    return Err(neg(name, E::Unacceptable));
                }
                self.answer(name, "None")
            }
            OpKey::RdmaExtensions => {
                if proposed_bool != Some(true) {
                    return Err(neg(name, E::Unacceptable));
                }
                self.answer(name, "Yes")
            }
            OpKey::InitialR2T => {
                let p = proposed_bool.ok_or(neg(name, E::Malformed))?;
                self.values.initial_r2t = v.initial_r2t || p;
                self.answer(name, yes_no(v.initial_r2t || p))
            }
            OpKey::ImmediateData => {
                let p = proposed_bool.ok_or(neg(name, E::Malformed))?;
                self.values.immediate_data = v.immediate_data && p;
                self.answer(name, yes_no(v.immediate_data && p))
            }
            OpKey::DataPduInOrder | OpKey::DataSequenceInOrder => {
                proposed_bool.ok_or(neg(name, E::Malformed))?;
                self.answer(name, "Yes")
            }
            OpKey::MaxConnections | OpKey::MaxOutstandingR2T | OpKey::ErrorRecoveryLevel => {
                let n = proposed_num()?;
                let ours = if op == OpKey::ErrorRecoveryLevel {
                    0
                } else {
                    1
                };
                if n < ours {
                    return Err(neg(name, E::Unacceptable));
                }
                self.answer(name, decimal(ours, &mut scratch))
            }
            OpKey::MaxBurstLength => {
                let n = proposed_num()?.min(v.max_burst);
                self.values.max_burst = n;
                self.answer(name, decimal(n, &mut scratch))
            }
            OpKey::FirstBurstLength => {
                let n = proposed_num()?.min(v.first_burst);
                self.values.first_burst = n;
                self.answer(name, decimal(n, &mut scratch))
            }
            OpKey::DefaultTime2Retain => {
                let n = proposed_num()?.min(u32::from(v.time2retain));
                self.values.time2retain = n as u16;
                self.answer(name, decimal(n, &mut scratch))
            }
            OpKey::DefaultTime2Wait => {
                let n = proposed_num()?.max(u32::from(v.time2wait));
                self.values.time2wait = n as u16;
                self.answer(name, decimal(n, &mut scratch))
            }
            OpKey::InitiatorRecvDataSegmentLength => {
                proposed_num()?;
                self.answer(name, decimal(v.initiator_recv_dsl, &mut scratch))
            }
            OpKey::TargetRecvDataSegmentLength => {
                // The target declares what it receives.
                let n = proposed_num()?;
                self.values.target_recv_dsl = v.target_recv_dsl.min(n);
                Ok(())
            }
            OpKey::MaxOutstandingUnexpectedPdus => {
                proposed_num()?;
                self.answer(name, decimal(v.max_unexpected.unwrap_or(0), &mut scratch))
            }
        }
    }

    fn complete(&mut self, rsp: &LoginResponseRepr) -> Result<LoginStep, LoginError> {
        use ProtocolViolation as V;
        if rsp.next_stage != Some(LoginStage::FullFeature) {
            // Transit to the operational stage from the operational stage
            // cannot happen (checked in the header); anything else is odd.
            return Err(protocol(V::Transit));
        }
        for key in OpKey::ALL {
            if key.needs_answer(&self.values) && self.settled & key.bit() == 0 {
                return Err(neg(key.name(), NegotiationError::NoAnswer));
            }
        }
        let v = self.values;
        if v.first_burst > v.max_burst {
            return Err(neg("FirstBurstLength", NegotiationError::Inconsistent));
        }
        if rsp.tsih == 0 || (self.start.tsih != 0 && rsp.tsih != self.start.tsih) {
            return Err(protocol(V::Tsih));
        }
        if command_window(rsp.exp_cmd_sn, rsp.max_cmd_sn).is_none()
            || rsp.exp_cmd_sn != self.start.cmd_sn
        {
            return Err(protocol(V::CmdSn));
        }
        let auth = match self.auth {
            AuthState::Done(outcome) => outcome,
            _ => return Err(protocol(V::AuthSequence)),
        };
        Ok(LoginStep::Complete(Negotiated {
            tsih: rsp.tsih,
            tpgt: self.tpgt,
            auth,
            max_send_data_segment: v.target_recv_dsl,
            max_recv_data_segment: v.initiator_recv_dsl,
            immediate_data: v.immediate_data,
            initial_r2t: v.initial_r2t,
            first_burst_length: v.first_burst,
            max_burst_length: v.max_burst,
            default_time2wait: v.time2wait,
            default_time2retain: v.time2retain,
            max_outstanding_r2t: v.max_outstanding_r2t,
            max_outstanding_unexpected_pdus: v.max_unexpected,
            cmd_sn: self.start.cmd_sn,
            exp_cmd_sn: rsp.exp_cmd_sn,
            max_cmd_sn: rsp.max_cmd_sn,
            exp_stat_sn: rsp.stat_sn.next(),
        }))
    }
}

fn min_answer(answer: u64, offered: u32, name: &'static str) -> Result<u32, LoginError> {
    if answer > u64::from(offered) {
        return Err(neg(name, NegotiationError::IllegalAnswer));
    }
    // Not above a u32.
    Ok(answer as u32)
}

/// Formats `n` in decimal into `scratch`.
pub(crate) fn decimal(mut n: u32, scratch: &mut [u8]) -> &str {
    let mut at = scratch.len();
    while let Some(i) = at.checked_sub(1) {
        let Some(slot) = scratch.get_mut(i) else {
            break;
        };
        // A remainder modulo 10 is one digit.
        *slot = b'0' + (n % 10) as u8;
        at = i;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    core::str::from_utf8(scratch.get(at..).unwrap_or(&[])).unwrap_or("")
}

#[cfg(test)]
mod tests;
