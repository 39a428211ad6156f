//! The target's key negotiation, modelled on Linux LIO
//! (`iscsi_target_parameters.c`): one parameter table in LIO's order, the
//! same state bits (acceptor, proposer, reply optional, response sent or
//! got, reject), the same rules per key type, and the same output order:
//! answers and the target's own proposals in table order, then
//! `NotUnderstood` for unknown keys.

use std::fmt::Write as _;

/// A phase mask (LIO `PHASE_*`).
pub const PHASE_SECURITY: u8 = 0x01;
/// Operational stage.
pub const PHASE_OPERATIONAL: u8 = 0x02;
/// Declarative keys (both stages).
pub const PHASE_DECLARATIVE: u8 = 0x04;
const PHASE_FFP0: u8 = 0x08;

const SENDER_INITIATOR: u8 = 0x01;
const SENDER_TARGET: u8 = 0x02;
const SENDER_BOTH: u8 = 0x03;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    BoolAnd,
    BoolOr,
    /// A number in `lo..=hi`, negotiated by `rule`.
    Number {
        lo: u64,
        hi: u64,
        rule: NumberRule,
    },
    List,
    Str,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NumberRule {
    Min,
    Max,
    /// The proposer's value is taken as is.
    Take,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct State {
    acceptor: bool,
    negotiate: bool,
    proposer: bool,
    reject: bool,
    reply_optional: bool,
    response_got: bool,
    response_sent: bool,
}

/// One parameter of the table.
#[derive(Debug, Clone)]
pub struct Param {
    name: &'static str,
    /// The current value.
    pub value: String,
    phase: u8,
    sender: u8,
    kind: Kind,
    declarative: bool,
    state: State,
}

/// Why decoding a login text failed (LIO answers 0x0200, "initiator
/// error").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NegotiationFailed(pub String);

const LIST_ITEMS_AUTH: &[&str] = &["KRB5", "SPKM1", "SPKM2", "SRP", "CHAP", "None"];
const LIST_ITEMS_DIGEST: &[&str] = &["CRC32C", "None"];

/// The parameter table of one connection.
#[derive(Debug, Clone)]
pub struct ParamList {
    params: Vec<Param>,
    extra: Vec<(String, &'static str)>,
}

fn p(name: &'static str, value: &str, phase: u8, sender: u8, kind: Kind) -> Param {
    Param {
        name,
        value: value.to_owned(),
        phase,
        sender,
        kind,
        declarative: phase & PHASE_DECLARATIVE != 0,
        state: State::default(),
    }
}

const fn num(lo: u64, hi: u64, rule: NumberRule) -> Kind {
    Kind::Number { lo, hi, rule }
}

/// What the target is configured with (the values LIO keeps in its TPG
/// parameter list).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetValues {
    /// `AuthMethod` acceptor list.
    pub auth_method: String,
    /// `TargetAlias`.
    pub target_alias: Option<String>,
    /// `TargetPortalGroupTag`.
    pub tpgt: u16,
    /// `InitialR2T`.
    pub initial_r2t: bool,
    /// `ImmediateData`.
    pub immediate_data: bool,
    /// `MaxBurstLength`.
    pub max_burst_length: u32,
    /// `FirstBurstLength`.
    pub first_burst_length: u32,
    /// `DefaultTime2Wait`.
    pub default_time2wait: u16,
    /// `DefaultTime2Retain`.
    pub default_time2retain: u16,
    /// `ErrorRecoveryLevel`.
    pub error_recovery_level: u8,
    /// `RDMAExtensions` (LIO sets `Yes` on an iSER portal).
    pub rdma_extensions: bool,
    /// `InitiatorRecvDataSegmentLength` default.
    pub initiator_recv_data_segment_length: u32,
    /// `TargetRecvDataSegmentLength` default.
    pub target_recv_data_segment_length: u32,
}

impl Default for TargetValues {
    /// LIO's defaults on an iSER portal.
    fn default() -> Self {
        Self {
            auth_method: "CHAP,None".into(),
            target_alias: Some("LIO Target".into()),
            tpgt: 1,
            initial_r2t: true,
            immediate_data: true,
            max_burst_length: 262_144,
            first_burst_length: 65_536,
            default_time2wait: 2,
            default_time2retain: 20,
            error_recovery_level: 0,
            rdma_extensions: true,
            initiator_recv_data_segment_length: 262_144,
            target_recv_data_segment_length: 8192,
        }
    }
}

fn yes_no(b: bool) -> &'static str {
    if b { "Yes" } else { "No" }
}

fn parse_num(text: &str) -> Option<u64> {
    if let Some(hex) = text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
        u64::from_str_radix(hex, 16).ok()
    } else {
        text.parse().ok()
    }
}

impl ParamList {
    /// LIO's table for an iSER (or TCP) normal-session connection.
    #[must_use]
    pub fn new(v: &TargetValues, iser: bool) -> Self {
        use NumberRule::{Max, Min, Take};
        let op = PHASE_OPERATIONAL;
        let decl = PHASE_DECLARATIVE;
        let mut params = vec![
            p(
                "AuthMethod",
                &v.auth_method,
                PHASE_SECURITY,
                SENDER_BOTH,
                Kind::List,
            ),
            p("HeaderDigest", "CRC32C,None", op, SENDER_BOTH, Kind::List),
            p("DataDigest", "CRC32C,None", op, SENDER_BOTH, Kind::List),
            p("MaxConnections", "1", op, SENDER_BOTH, num(1, 65535, Min)),
            p(
                "SendTargets",
                "All",
                PHASE_FFP0,
                SENDER_INITIATOR,
                Kind::Str,
            ),
            p("TargetName", "LIO.Target", decl, SENDER_BOTH, Kind::Str),
            p(
                "InitiatorName",
                "LIO.Initiator",
                decl,
                SENDER_INITIATOR,
                Kind::Str,
            ),
            p(
                "TargetAlias",
                v.target_alias.as_deref().unwrap_or(""),
                decl,
                SENDER_TARGET,
                Kind::Str,
            ),
            p(
                "InitiatorAlias",
                "LIO Initiator",
                decl,
                SENDER_INITIATOR,
                Kind::Str,
            ),
            p(
                "TargetAddress",
                "0.0.0.0:0000,0",
                decl,
                SENDER_TARGET,
                Kind::Str,
            ),
            p(
                "TargetPortalGroupTag",
                &v.tpgt.to_string(),
                decl,
                SENDER_TARGET,
                num(0, 65535, Take),
            ),
            p(
                "InitialR2T",
                yes_no(v.initial_r2t),
                op,
                SENDER_BOTH,
                Kind::BoolOr,
            ),
            p(
                "ImmediateData",
                yes_no(v.immediate_data),
                op,
                SENDER_BOTH,
                Kind::BoolAnd,
            ),
            p(
                "MaxXmitDataSegmentLength",
                "262144",
                op,
                SENDER_BOTH,
                num(512, 0xFF_FFFF, Take),
            ),
            p(
                "MaxRecvDataSegmentLength",
                "8192",
                op,
                SENDER_BOTH,
                num(512, 0xFF_FFFF, Take),
            ),
            p(
                "MaxBurstLength",
                &v.max_burst_length.to_string(),
                op,
                SENDER_BOTH,
                num(512, 0xFF_FFFF, Min),
            ),
            p(
                "FirstBurstLength",
                &v.first_burst_length.to_string(),
                op,
                SENDER_BOTH,
                num(512, 0xFF_FFFF, Min),
            ),
            p(
                "DefaultTime2Wait",
                &v.default_time2wait.to_string(),
                op,
                SENDER_BOTH,
                num(0, 3600, Max),
            ),
            p(
                "DefaultTime2Retain",
                &v.default_time2retain.to_string(),
                op,
                SENDER_BOTH,
                num(0, 3600, Min),
            ),
            p(
                "MaxOutstandingR2T",
                "1",
                op,
                SENDER_BOTH,
                num(1, 65535, Min),
            ),
            p("DataPDUInOrder", "Yes", op, SENDER_BOTH, Kind::BoolOr),
            p("DataSequenceInOrder", "Yes", op, SENDER_BOTH, Kind::BoolOr),
            p(
                "ErrorRecoveryLevel",
                &v.error_recovery_level.to_string(),
                op,
                SENDER_BOTH,
                num(0, 2, Min),
            ),
            p("SessionType", "Normal", decl, SENDER_INITIATOR, Kind::Str),
            p("IFMarker", "No", op, SENDER_BOTH, Kind::BoolAnd),
            p("OFMarker", "No", op, SENDER_BOTH, Kind::BoolAnd),
            p("IFMarkInt", "Reject", op, SENDER_BOTH, Kind::Str),
            p("OFMarkInt", "Reject", op, SENDER_BOTH, Kind::Str),
            p(
                "RDMAExtensions",
                yes_no(v.rdma_extensions),
                op,
                SENDER_BOTH,
                Kind::BoolAnd,
            ),
            p(
                "InitiatorRecvDataSegmentLength",
                &v.initiator_recv_data_segment_length.to_string(),
                op,
                SENDER_BOTH,
                num(512, 0xFF_FFFF, Take),
            ),
            p(
                "TargetRecvDataSegmentLength",
                &v.target_recv_data_segment_length.to_string(),
                op,
                SENDER_BOTH,
                num(512, 0xFF_FFFF, Take),
            ),
        ];
        for param in &mut params {
            let negotiate = match param.name {
                "AuthMethod"
                | "MaxConnections"
                | "TargetPortalGroupTag"
                | "InitialR2T"
                | "ImmediateData"
                | "MaxBurstLength"
                | "FirstBurstLength"
                | "DefaultTime2Wait"
                | "DefaultTime2Retain"
                | "MaxOutstandingR2T"
                | "DataPDUInOrder"
                | "DataSequenceInOrder"
                | "ErrorRecoveryLevel"
                | "SessionType" => true,
                "TargetAlias" => v.target_alias.is_some(),
                "HeaderDigest" | "DataDigest" | "MaxRecvDataSegmentLength" => !iser,
                "RDMAExtensions"
                | "InitiatorRecvDataSegmentLength"
                | "TargetRecvDataSegmentLength" => iser,
                _ => false,
            };
            param.state.negotiate = negotiate;
            if matches!(
                param.name,
                "IFMarker" | "OFMarker" | "IFMarkInt" | "OFMarkInt"
            ) {
                param.state.reject = true;
            }
        }
        Self {
            params,
            extra: Vec::new(),
        }
    }

    /// The current value of `name`.
    #[must_use]
    pub fn value(&self, name: &str) -> Option<&str> {
        self.params
            .iter()
            .find(|p| p.name == name)
            .map(|p| p.value.as_str())
    }

    /// Overrides a value (LIO's `iscsi_change_param_value`).
    pub fn set_value(&mut self, name: &str, value: &str) {
        if let Some(p) = self.params.iter_mut().find(|p| p.name == name) {
            p.value = value.to_owned();
        }
    }

    /// Whether the initiator offered (or answered) `name`.
    #[must_use]
    pub fn received(&self, name: &str) -> bool {
        self.params
            .iter()
            .any(|p| p.name == name && (p.state.acceptor || p.state.response_got))
    }

    /// Decodes the initiator's pairs for `phase`. Returns `Ok(true)` when
    /// an authentication key (`CHAP_*`) was met in the security phase (LIO
    /// hands the text to its CHAP code then).
    ///
    /// # Errors
    ///
    /// A value LIO refuses (the login fails with an initiator error).
    pub fn decode(
        &mut self,
        phase: u8,
        pairs: &[(String, String)],
    ) -> Result<bool, NegotiationFailed> {
        for (key, value) in pairs {
            if phase & PHASE_SECURITY != 0 && key.starts_with("CHAP_") {
                return Ok(true);
            }
            let found = self.params.iter().position(|p| {
                p.name == key
                    && p.sender & SENDER_INITIATOR != 0
                    && !p.state.acceptor
                    && p.phase & phase != 0
            });
            let Some(index) = found else {
                self.extra.push((key.clone(), "NotUnderstood"));
                continue;
            };
            let param = &mut self.params[index];
            check_value(param, value)?;
            if param.state.proposer {
                if param.state.response_got {
                    return Err(NegotiationFailed(format!("{key} answered twice")));
                }
                if param.kind == Kind::List
                    && (value.contains(',') || list_pick(&param.value, value).is_none())
                {
                    return Err(NegotiationFailed(format!("bad answer {key}={value}")));
                }
                param.value = value.clone();
                param.state.response_got = true;
            } else {
                accept(param, value)?;
                param.state.acceptor = true;
            }
        }
        Ok(false)
    }

    /// LIO's integrity rules, then the response text for `phase`.
    #[must_use]
    pub fn encode(&mut self, phase: u8) -> Vec<u8> {
        self.integrity();
        let mut out = String::new();
        for param in &mut self.params {
            if param.sender & SENDER_TARGET == 0 || param.phase & phase == 0 {
                continue;
            }
            let s = &mut param.state;
            if s.acceptor && !s.response_sent && !s.reply_optional {
                let _ = write!(out, "{}={}\0", param.name, param.value);
                s.response_sent = true;
                continue;
            }
            if s.negotiate && !s.acceptor && !s.proposer {
                let _ = write!(out, "{}={}\0", param.name, param.value);
                s.proposer = true;
                proposer_optional(param);
            }
        }
        for (key, value) in self.extra.drain(..) {
            let _ = write!(out, "{key}={value}\0");
        }
        out.into_bytes()
    }

    fn integrity(&mut self) {
        let max_burst = self
            .value("MaxBurstLength")
            .and_then(parse_num)
            .unwrap_or(262_144);
        for param in &mut self.params {
            match param.name {
                "MaxConnections" if param.value != "1" => param.value = "1".into(),
                "FirstBurstLength" if parse_num(&param.value).unwrap_or(0) > max_burst => {
                    param.value = max_burst.to_string();
                }
                _ => {}
            }
        }
    }

    /// Keys the target proposed and still waits an answer for (LIO's
    /// `iscsi_check_negotiated_keys`): the stage cannot end.
    #[must_use]
    pub fn unanswered(&self) -> Vec<&'static str> {
        self.params
            .iter()
            .filter(|p| {
                p.state.negotiate
                    && p.state.proposer
                    && !p.state.response_got
                    && !p.state.reply_optional
                    && !p.declarative
            })
            .map(|p| p.name)
            .collect()
    }
}

fn check_value(param: &mut Param, value: &str) -> Result<(), NegotiationFailed> {
    let fail = |why: &str| Err(NegotiationFailed(format!("{}={value}: {why}", param.name)));
    match value {
        "Reject" => {
            if matches!(param.name, "IFMarkInt" | "OFMarkInt") {
                param.state.reject = true;
                return Ok(());
            }
            return fail("Reject");
        }
        "Irrelevant" => return Ok(()),
        "NotUnderstood" => return fail("NotUnderstood for a standard key"),
        _ => {}
    }
    if value.contains(',') && param.kind != Kind::List {
        return fail("list for a single-valued key");
    }
    for item in value.split(',') {
        if item.len() > 255 {
            return fail("too long");
        }
        match param.kind {
            Kind::BoolAnd | Kind::BoolOr => {
                if item != "Yes" && item != "No" {
                    return fail("not Yes/No");
                }
            }
            Kind::Number { lo, hi, .. } => {
                let n = parse_num(item).unwrap_or(0);
                if !(lo..=hi).contains(&n) {
                    return fail("out of range");
                }
            }
            Kind::List => {
                if param.state.proposer {
                    continue;
                }
                let allowed = if param.name == "AuthMethod" {
                    LIST_ITEMS_AUTH
                } else {
                    LIST_ITEMS_DIGEST
                };
                if !allowed.contains(&item) {
                    return fail("unknown list item");
                }
            }
            Kind::Str => {
                if param.name == "SessionType" && item != "Normal" && item != "Discovery" {
                    return fail("unknown session type");
                }
            }
        }
    }
    Ok(())
}

/// LIO's `iscsi_check_valuelist_for_support`: the first proposer item the
/// acceptor supports.
fn list_pick<'v>(acceptor: &str, proposer: &'v str) -> Option<&'v str> {
    proposer
        .split(',')
        .find(|item| acceptor.split(',').any(|a| a == *item))
}

fn accept(param: &mut Param, value: &str) -> Result<(), NegotiationFailed> {
    if param.state.reject {
        return Ok(());
    }
    match param.kind {
        Kind::BoolAnd => {
            let proposer = value == "Yes";
            let acceptor = param.value == "Yes";
            if !(acceptor && proposer) {
                param.value = "No".into();
                if !proposer {
                    param.state.reply_optional = true;
                }
            }
        }
        Kind::BoolOr => {
            let proposer = value == "Yes";
            let acceptor = param.value == "Yes";
            if acceptor || proposer {
                param.value = "Yes".into();
                if proposer {
                    param.state.reply_optional = true;
                }
            }
        }
        Kind::Number { rule, .. } => {
            let acceptor = parse_num(&param.value).unwrap_or(0);
            let proposer = parse_num(value).unwrap_or(0);
            let chosen = match rule {
                NumberRule::Min => acceptor.min(proposer),
                NumberRule::Max => acceptor.max(proposer),
                NumberRule::Take => proposer,
            };
            param.value = if chosen == proposer {
                value.to_owned()
            } else {
                chosen.to_string()
            };
            if param.declarative {
                param.state.reply_optional = true;
            }
        }
        Kind::List => {
            let Some(chosen) = list_pick(&param.value, value) else {
                return Err(NegotiationFailed(format!(
                    "{}: no common value in {value}",
                    param.name
                )));
            };
            param.value = chosen.to_owned();
        }
        Kind::Str => {
            if param.declarative {
                param.value = value.to_owned();
                param.state.reply_optional = true;
            }
        }
    }
    Ok(())
}

/// LIO's `iscsi_check_proposer_for_optional_reply` with the login keys
/// workaround on (LIO's default).
fn proposer_optional(param: &mut Param) {
    let optional = match param.kind {
        Kind::BoolAnd => param.value == "No",
        Kind::BoolOr => param.value == "Yes",
        Kind::Number { .. } => matches!(
            param.name,
            "MaxRecvDataSegmentLength" | "FirstBurstLength" | "MaxConnections"
        ),
        _ => param.declarative,
    } || param.declarative;
    if optional {
        param.state.reply_optional = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn rules_per_type() {
        let mut l = ParamList::new(&TargetValues::default(), true);
        let phase = PHASE_OPERATIONAL | PHASE_DECLARATIVE;
        l.decode(
            phase,
            &pairs(&[
                ("MaxBurstLength", "1048576"),
                ("FirstBurstLength", "4096"),
                ("DefaultTime2Wait", "0"),
                ("DefaultTime2Retain", "60"),
                ("InitialR2T", "No"),
                ("ImmediateData", "No"),
                ("HeaderDigest", "CRC32C,None"),
                ("X-vendor.key", "1"),
            ]),
        )
        .unwrap();
        assert_eq!(l.value("MaxBurstLength"), Some("262144"), "min");
        assert_eq!(l.value("FirstBurstLength"), Some("4096"));
        assert_eq!(l.value("DefaultTime2Wait"), Some("2"), "max");
        assert_eq!(l.value("DefaultTime2Retain"), Some("20"), "min");
        assert_eq!(l.value("InitialR2T"), Some("Yes"), "OR");
        assert_eq!(l.value("ImmediateData"), Some("No"), "AND");
        assert_eq!(l.value("HeaderDigest"), Some("CRC32C"), "first common");
        let text = String::from_utf8(l.encode(phase)).unwrap();
        // ImmediateData=No is reply-optional (AND with the proposer's No).
        assert!(!text.contains("ImmediateData"), "{text}");
        assert!(text.contains("InitialR2T=Yes\0"), "{text}");
        assert!(text.ends_with("X-vendor.key=NotUnderstood\0"), "{text}");
        // The target proposes what the initiator did not offer.
        assert!(text.contains("MaxOutstandingR2T=1\0"), "{text}");
        assert_eq!(
            l.unanswered(),
            [
                "MaxOutstandingR2T",
                "ErrorRecoveryLevel",
                "RDMAExtensions",
                "InitiatorRecvDataSegmentLength",
                "TargetRecvDataSegmentLength"
            ]
        );
        assert!(l.decode(phase, &pairs(&[("MaxConnections", "0")])).is_err());
        assert!(l.decode(phase, &pairs(&[("DataDigest", "MD5")])).is_err());
        assert!(
            l.decode(phase, &pairs(&[("DataPDUInOrder", "Maybe")]))
                .is_err()
        );
    }
}
