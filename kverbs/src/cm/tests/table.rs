//! Every message in every state: an engine (X) against a scripted peer (P)
//! whose MADs are built by hand, so each one matches the connection
//! exactly (comm IDs, transaction IDs, QPN, source) and only the state
//! decides what happens.
//!
//! Each outcome is written as one line:
//! `sent=<MADs X sent> drop=<reason> state=<X's state or gone> ev=<events>
//! qp=<QP modifies asked>` for what happens at once, then `; then ...` for
//! what follows when the QP modifications X had pending (or asked for)
//! complete.

use super::*;

const P_COMM: u32 = 0x7000_0001;
const P_GUID: u64 = 0x0200_00ff_fe00_00ee;
const P_QPN: u32 = 0x777;
const P_PSN: u32 = 0xabc;
const P_REQ_TID: u64 = 0x5000;
const P_DREQ_TID: u64 = 0x6000;
const X_QPN: u32 = 0x100;

pub(crate) fn req_repr<'a>(
    local_comm_id: u32,
    local_qpn: u32,
    starting_psn: u32,
    primary_path: CmPathRepr,
    private_data: &'a [u8],
) -> CmReqRepr<'a> {
    CmReqRepr {
        local_comm_id,
        vendor_id: 0,
        service_id: service(),
        local_ca_guid: P_GUID,
        local_qkey: 0,
        local_qpn: qpn(local_qpn),
        responder_resources: 4,
        local_eecn: Eecn::from_low_bits(0),
        initiator_depth: 4,
        remote_eecn: Eecn::from_low_bits(0),
        remote_cm_response_timeout: IbTimeout::new(10).unwrap(),
        transport_service_type: TransportServiceType::Rc,
        end_to_end_flow_control: true,
        starting_psn: psn(starting_psn),
        local_cm_response_timeout: IbTimeout::new(10).unwrap(),
        retry_count: 7,
        pkey: 0xffff,
        path_mtu: PathMtu::Mtu1024,
        rdc_exists: false,
        rnr_retry_count: 7,
        max_cm_retries: 3,
        srq: false,
        extended_transport_type: 0,
        primary_path,
        alternate_path: None,
        sap_supported: false,
        private_data,
    }
}

/// An engine X with one connection, and what the scripted peer knows.
struct Script {
    x: CmEngine,
    rec: Rec,
    id: CmId,
    p_addr: MadAddress,
    now: u64,
}

impl Script {
    fn x_comm(&self) -> u32 {
        self.x.local_comm_id(self.id).unwrap_or(0)
    }

    fn inject(&mut self, mad: &[u8]) {
        let p = self.p_addr;
        self.x.on_mad(self.now, &p, mad, &mut self.rec);
    }

    fn complete_qp(&mut self) {
        for _ in 0..10 {
            let Some((id, _, _)) = self.rec.pending_qp.pop_front() else {
                return;
            };
            assert!(self.x.on_qp_modified(self.now, id, true, &mut self.rec));
        }
        panic!("QP modifies never stop");
    }

    fn clear(&mut self) {
        self.rec.sent.clear();
        self.rec.drops.clear();
        self.rec.events.clear();
        self.rec.lev.clear();
        self.rec.qp_log.clear();
    }

    /// The MADs X sent since the last clear, by attribute and (for REJ)
    /// reason.
    fn sent_names(&self) -> String {
        let names: Vec<String> = self
            .rec
            .sent
            .iter()
            .map(|(to, m)| {
                assert_eq!(to.gid, self.p_addr.gid, "X answers P");
                match CmMadRepr::parse(m).unwrap().message {
                    CmMessage::Rej(r) => format!("REJ({})", r.reason.code()),
                    _ => attr_name(m).to_string(),
                }
            })
            .collect();
        list(&names)
    }

    fn signature(&self) -> String {
        let drops: Vec<String> = self
            .rec
            .drops
            .iter()
            .map(|d| format!("{:?}", d.reason))
            .collect();
        let state = self
            .x
            .state(self.id)
            .map_or("gone".to_string(), |s| format!("{s:?}"));
        let mut evs: Vec<String> = self.rec.events.iter().map(|(_, e)| e.name()).collect();
        evs.extend(self.rec.lev.iter().map(|(_, e)| match e {
            LEv::Request { .. } => "L:Request".to_string(),
            LEv::Withdrawn(_, c) => format!("L:Withdrawn({c:?})"),
        }));
        let qp: Vec<String> = self
            .rec
            .qp_log
            .iter()
            .map(|(_, _, m)| match m {
                QpModify::ToRtr(_) => "Rtr".to_string(),
                QpModify::ToRts(_) => "Rts".to_string(),
                QpModify::ToRtrAndRts(..) => "RtrRts".to_string(),
                QpModify::ToError => "Error".to_string(),
            })
            .collect();
        format!(
            "sent={} drop={} state={state} ev={} qp={}",
            self.sent_names(),
            list(&drops),
            list(&evs),
            list(&qp)
        )
    }
}

fn list(items: &[String]) -> String {
    if items.is_empty() {
        "-".to_string()
    } else {
        items.join(",")
    }
}

fn mad(tid: u64, message: CmMessage<'_>) -> Vec<u8> {
    let mut buf = vec![0u8; MAD_LEN];
    CmMadRepr {
        transaction_id: tid,
        attribute_modifier: 0,
        message,
    }
    .emit(&mut buf)
    .unwrap();
    buf
}

fn p_path() -> CmPathRepr {
    // P is the active side's address when X is passive (A → B).
    endpoints().path(IbTimeout::new(9).unwrap())
}

/// X active (at A), P passive (at B).
fn active() -> Script {
    let mut x = CmEngine::new(config(IP_A, GUID_A, 1));
    let mut rec = Rec::default();
    let mut buf = [0u8; 92];
    let req = connect_request(&mut buf, b"", X_QPN, 0x1111);
    let id = x.connect(0, &req, &mut rec).unwrap();
    Script {
        x,
        rec,
        id,
        p_addr: MadAddress::cm(Gid::from_ipv4(IP_B)),
        now: 10,
    }
}

/// X passive (at B), P active (at A), REQ delivered.
fn passive() -> Script {
    let mut x = CmEngine::new(config(IP_B, GUID_B, 2));
    let mut rec = Rec::default();
    x.listen(service(), ListenKind::IbCm).unwrap();
    let p_addr = MadAddress::cm(Gid::from_ipv4(IP_A));
    let req = mad(
        P_REQ_TID,
        CmMessage::Req(req_repr(P_COMM, P_QPN, P_PSN, p_path(), &[])),
    );
    x.on_mad(0, &p_addr, &req, &mut rec);
    let id = match rec.lev.first() {
        Some((_, LEv::Request { id, .. })) => *id,
        other => panic!("{other:?}"),
    };
    Script {
        x,
        rec,
        id,
        p_addr,
        now: 10,
    }
}

/// The TID X used for its REQ (active) or P's (passive).
fn req_tid(s: &Script, active: bool) -> u64 {
    if active {
        s.rec
            .sent
            .iter()
            .find_map(|(_, m)| match CmMadRepr::parse(m).unwrap() {
                CmMadRepr {
                    transaction_id,
                    message: CmMessage::Req(_),
                    ..
                } => Some(transaction_id),
                _ => None,
            })
            .unwrap()
    } else {
        P_REQ_TID
    }
}

/// The TID of X's last DREQ, if any.
fn dreq_tid(rec: &Rec) -> Option<u64> {
    rec.sent.iter().rev().find_map(|(_, m)| {
        let parsed = CmMadRepr::parse(m).unwrap();
        matches!(parsed.message, CmMessage::Dreq(_)).then_some(parsed.transaction_id)
    })
}

/// The messages P can send, each matching the connection.
const MESSAGES: [&str; 8] = [
    "REQ", "REP", "RTU", "MRA(REQ)", "MRA(REP)", "REJ", "DREQ", "DREP",
];

fn p_message(name: &str, x_comm: u32, req_tid: u64, dreq_tid: u64) -> Vec<u8> {
    match name {
        "REQ" => mad(
            P_REQ_TID,
            CmMessage::Req(req_repr(P_COMM, P_QPN, P_PSN, p_path(), &[])),
        ),
        "REP" => mad(
            req_tid,
            CmMessage::Rep(CmRepRepr {
                local_comm_id: P_COMM,
                remote_comm_id: x_comm,
                local_qkey: 0,
                local_qpn: qpn(P_QPN),
                vendor_id: 0,
                local_eecn: Eecn::from_low_bits(0),
                starting_psn: psn(P_PSN),
                responder_resources: 4,
                initiator_depth: 4,
                target_ack_delay: IbTimeout::new(15).unwrap(),
                failover_accepted: 0,
                end_to_end_flow_control: true,
                rnr_retry_count: 7,
                srq: false,
                local_ca_guid: P_GUID,
                private_data: b"rep",
            }),
        ),
        "RTU" => mad(
            req_tid,
            CmMessage::Rtu(CmRtuRepr {
                local_comm_id: P_COMM,
                remote_comm_id: x_comm,
                private_data: b"rtu",
            }),
        ),
        "MRA(REQ)" | "MRA(REP)" => mad(
            req_tid,
            CmMessage::Mra(CmMraRepr {
                local_comm_id: P_COMM,
                remote_comm_id: x_comm,
                message_mraed: if name == "MRA(REQ)" {
                    CmMessageKind::Req
                } else {
                    CmMessageKind::Rep
                },
                service_timeout: IbTimeout::new(16).unwrap(),
                private_data: &[],
            }),
        ),
        "REJ" => mad(
            req_tid,
            CmMessage::Rej(CmRejRepr {
                local_comm_id: P_COMM,
                remote_comm_id: x_comm,
                message_rejected: CmMessageKind::Other,
                reason: RejectReason::ConsumerDefined,
                ari: &[],
                private_data: b"rej",
            }),
        ),
        "DREQ" => mad(
            P_DREQ_TID,
            CmMessage::Dreq(CmDreqRepr {
                local_comm_id: P_COMM,
                remote_comm_id: x_comm,
                remote_qpn: qpn(if x_comm == 0 { 0 } else { X_QPN }),
                private_data: b"dreq",
            }),
        ),
        "DREP" => mad(
            dreq_tid,
            CmMessage::Drep(CmDrepRepr {
                local_comm_id: P_COMM,
                remote_comm_id: x_comm,
                private_data: &[],
            }),
        ),
        other => panic!("{other}"),
    }
}

/// Builds X in `state` (active or passive side), with P's view of it.
fn build(state: &str) -> (Script, bool) {
    let active_states = [
        "A:ReqSent",
        "A:MraReqRcvd",
        "A:RepRcvd",
        "A:Established",
        "A:DreqSent",
        "A:TimeWait",
    ];
    let is_active = active_states.contains(&state);
    let mut s = if is_active { active() } else { passive() };
    let tid = req_tid(&s, is_active);
    let x_comm = s.x_comm();
    let send = |s: &mut Script, name: &str| {
        let dreq = dreq_tid(&s.rec).unwrap_or(0xdead);
        let m = p_message(name, x_comm, tid, dreq);
        s.inject(&m);
    };
    let accept = |s: &mut Script| {
        let accept = AcceptRequest {
            qp: LocalQp {
                qpn: qpn(X_QPN),
                starting_psn: Some(psn(0x2222)),
            },
            params: ConnParams::SRP,
            private_data: b"acc",
        };
        s.x.accept(s.now, s.id, &accept, &mut s.rec).unwrap();
    };
    let disconnect = |s: &mut Script| {
        s.x.disconnect(s.now, s.id, b"bye", &mut s.rec).unwrap();
        s.complete_qp();
    };
    match state {
        "A:ReqSent" => {}
        "A:MraReqRcvd" => send(&mut s, "MRA(REQ)"),
        "A:RepRcvd" => send(&mut s, "REP"),
        "A:Established" => {
            send(&mut s, "REP");
            s.complete_qp();
        }
        "A:DreqSent" | "A:TimeWait" => {
            send(&mut s, "REP");
            s.complete_qp();
            disconnect(&mut s);
            if state == "A:TimeWait" {
                send(&mut s, "DREP");
            }
        }
        "P:ReqRcvd" => {}
        "P:MraReqSent" => send(&mut s, "REQ"),
        "P:Accepting" => accept(&mut s),
        "P:RepSent" | "P:MraRepRcvd" | "P:RtuRcvd" | "P:Established" | "P:DreqSent"
        | "P:TimeWait" => {
            accept(&mut s);
            s.complete_qp();
            match state {
                "P:MraRepRcvd" => send(&mut s, "MRA(REP)"),
                "P:RtuRcvd" => send(&mut s, "RTU"),
                "P:Established" | "P:DreqSent" | "P:TimeWait" => {
                    send(&mut s, "RTU");
                    s.complete_qp();
                    if state != "P:Established" {
                        disconnect(&mut s);
                    }
                    if state == "P:TimeWait" {
                        send(&mut s, "DREP");
                    }
                }
                _ => {}
            }
        }
        "P:Closed" => {
            s.x.reject(
                s.now,
                s.id,
                RejectReason::ConsumerDefined,
                b"no",
                &mut s.rec,
            )
            .unwrap();
        }
        other => panic!("{other}"),
    }
    let want = state.split(':').nth(1).unwrap();
    assert_eq!(
        s.x.state(s.id).map(|st| format!("{st:?}")).as_deref(),
        Some(want),
        "setup of {state}"
    );
    assert!(
        s.rec.drops.is_empty(),
        "setup of {state}: {:?}",
        s.rec.drops
    );
    (s, is_active)
}

fn outcome(state: &str, message: &str) -> String {
    let (mut s, is_active) = build(state);
    let tid = req_tid(&s, is_active);
    let dreq = dreq_tid(&s.rec).unwrap_or(0xdead);
    let x_comm = s.x_comm();
    s.clear();
    let m = p_message(message, x_comm, tid, dreq);
    s.inject(&m);
    let now = s.signature();
    s.clear();
    s.complete_qp();
    let then = s.signature();
    s.rec.check_contract();
    format!("{now} ; then {then}")
}

/// The expected outcome of each message in each state. "Q" abbreviates a
/// quiet follow-up: `sent=- drop=- state=<same> ev=- qp=-`.
const TABLE: &[(&str, &str, &str)] = &[
    // ---- active side ----
    // Before the REP, X does not know P's comm ID: P's REQ is a new request
    // to a CA with no listener.
    (
        "A:ReqSent",
        "REQ",
        "sent=REJ(8) drop=- state=ReqSent ev=- qp=- ; Q",
    ),
    (
        "A:ReqSent",
        "REP",
        "sent=- drop=- state=RepRcvd ev=- qp=RtrRts ; then sent=RTU drop=- state=Established ev=Established qp=-",
    ),
    (
        "A:ReqSent",
        "RTU",
        "sent=- drop=UnexpectedInState state=ReqSent ev=- qp=- ; Q",
    ),
    (
        "A:ReqSent",
        "MRA(REQ)",
        "sent=- drop=- state=MraReqRcvd ev=- qp=- ; Q",
    ),
    (
        "A:ReqSent",
        "MRA(REP)",
        "sent=- drop=UnexpectedInState state=ReqSent ev=- qp=- ; Q",
    ),
    (
        "A:ReqSent",
        "REJ",
        "sent=- drop=- state=gone ev=Rejected(28) qp=- ; Q",
    ),
    (
        "A:ReqSent",
        "DREQ",
        "sent=- drop=UnexpectedInState state=ReqSent ev=- qp=- ; Q",
    ),
    (
        "A:ReqSent",
        "DREP",
        "sent=- drop=TidMismatch state=ReqSent ev=- qp=- ; Q",
    ),
    (
        "A:MraReqRcvd",
        "REQ",
        "sent=REJ(8) drop=- state=MraReqRcvd ev=- qp=- ; Q",
    ),
    (
        "A:MraReqRcvd",
        "REP",
        "sent=- drop=- state=RepRcvd ev=- qp=RtrRts ; then sent=RTU drop=- state=Established ev=Established qp=-",
    ),
    (
        "A:MraReqRcvd",
        "RTU",
        "sent=- drop=UnexpectedInState state=MraReqRcvd ev=- qp=- ; Q",
    ),
    (
        "A:MraReqRcvd",
        "MRA(REQ)",
        "sent=- drop=- state=MraReqRcvd ev=- qp=- ; Q",
    ),
    (
        "A:MraReqRcvd",
        "MRA(REP)",
        "sent=- drop=UnexpectedInState state=MraReqRcvd ev=- qp=- ; Q",
    ),
    (
        "A:MraReqRcvd",
        "REJ",
        "sent=- drop=- state=gone ev=Rejected(28) qp=- ; Q",
    ),
    (
        "A:MraReqRcvd",
        "DREQ",
        "sent=- drop=UnexpectedInState state=MraReqRcvd ev=- qp=- ; Q",
    ),
    (
        "A:MraReqRcvd",
        "DREP",
        "sent=- drop=TidMismatch state=MraReqRcvd ev=- qp=- ; Q",
    ),
    // The RTR/RTS modify is in flight (completed by the follow-up).
    (
        "A:RepRcvd",
        "REQ",
        "sent=- drop=Duplicate state=RepRcvd ev=- qp=- ; then sent=RTU drop=- state=Established ev=Established qp=-",
    ),
    (
        "A:RepRcvd",
        "REP",
        "sent=MRA drop=- state=RepRcvd ev=- qp=- ; then sent=RTU drop=- state=Established ev=Established qp=-",
    ),
    (
        "A:RepRcvd",
        "RTU",
        "sent=- drop=UnexpectedInState state=RepRcvd ev=- qp=- ; then sent=RTU drop=- state=Established ev=Established qp=-",
    ),
    (
        "A:RepRcvd",
        "MRA(REQ)",
        "sent=- drop=UnexpectedInState state=RepRcvd ev=- qp=- ; then sent=RTU drop=- state=Established ev=Established qp=-",
    ),
    (
        "A:RepRcvd",
        "MRA(REP)",
        "sent=- drop=UnexpectedInState state=RepRcvd ev=- qp=- ; then sent=RTU drop=- state=Established ev=Established qp=-",
    ),
    (
        "A:RepRcvd",
        "REJ",
        "sent=- drop=- state=TimeWait ev=- qp=- ; then sent=- drop=- state=TimeWait ev=Rejected(28) qp=Error",
    ),
    (
        "A:RepRcvd",
        "DREQ",
        "sent=- drop=UnexpectedInState state=RepRcvd ev=- qp=- ; then sent=RTU drop=- state=Established ev=Established qp=-",
    ),
    (
        "A:RepRcvd",
        "DREP",
        "sent=- drop=TidMismatch state=RepRcvd ev=- qp=- ; then sent=RTU drop=- state=Established ev=Established qp=-",
    ),
    (
        "A:Established",
        "REQ",
        "sent=- drop=Duplicate state=Established ev=- qp=- ; Q",
    ),
    (
        "A:Established",
        "REP",
        "sent=RTU drop=- state=Established ev=- qp=- ; Q",
    ),
    (
        "A:Established",
        "RTU",
        "sent=- drop=UnexpectedInState state=Established ev=- qp=- ; Q",
    ),
    (
        "A:Established",
        "MRA(REQ)",
        "sent=- drop=UnexpectedInState state=Established ev=- qp=- ; Q",
    ),
    (
        "A:Established",
        "MRA(REP)",
        "sent=- drop=UnexpectedInState state=Established ev=- qp=- ; Q",
    ),
    (
        "A:Established",
        "REJ",
        "sent=- drop=- state=TimeWait ev=- qp=Error ; then sent=- drop=- state=TimeWait ev=Disconnected(Remote) qp=-",
    ),
    (
        "A:Established",
        "DREQ",
        "sent=DREP drop=- state=TimeWait ev=- qp=Error ; then sent=- drop=- state=TimeWait ev=Disconnected(Remote) qp=-",
    ),
    (
        "A:Established",
        "DREP",
        "sent=- drop=TidMismatch state=Established ev=- qp=- ; Q",
    ),
    (
        "A:DreqSent",
        "REQ",
        "sent=- drop=Duplicate state=DreqSent ev=- qp=- ; Q",
    ),
    (
        "A:DreqSent",
        "REP",
        "sent=- drop=UnexpectedInState state=DreqSent ev=- qp=- ; Q",
    ),
    (
        "A:DreqSent",
        "RTU",
        "sent=- drop=UnexpectedInState state=DreqSent ev=- qp=- ; Q",
    ),
    (
        "A:DreqSent",
        "MRA(REQ)",
        "sent=- drop=UnexpectedInState state=DreqSent ev=- qp=- ; Q",
    ),
    (
        "A:DreqSent",
        "MRA(REP)",
        "sent=- drop=UnexpectedInState state=DreqSent ev=- qp=- ; Q",
    ),
    (
        "A:DreqSent",
        "REJ",
        "sent=- drop=- state=TimeWait ev=- qp=- ; Q",
    ),
    (
        "A:DreqSent",
        "DREQ",
        "sent=DREP drop=- state=TimeWait ev=- qp=- ; Q",
    ),
    (
        "A:DreqSent",
        "DREP",
        "sent=- drop=- state=TimeWait ev=- qp=- ; Q",
    ),
    (
        "A:TimeWait",
        "REQ",
        "sent=REJ(10) drop=- state=TimeWait ev=- qp=- ; Q",
    ),
    (
        "A:TimeWait",
        "REP",
        "sent=- drop=UnexpectedInState state=TimeWait ev=- qp=- ; Q",
    ),
    (
        "A:TimeWait",
        "RTU",
        "sent=- drop=UnexpectedInState state=TimeWait ev=- qp=- ; Q",
    ),
    (
        "A:TimeWait",
        "MRA(REQ)",
        "sent=- drop=UnexpectedInState state=TimeWait ev=- qp=- ; Q",
    ),
    (
        "A:TimeWait",
        "MRA(REP)",
        "sent=- drop=UnexpectedInState state=TimeWait ev=- qp=- ; Q",
    ),
    (
        "A:TimeWait",
        "REJ",
        "sent=- drop=UnexpectedInState state=TimeWait ev=- qp=- ; Q",
    ),
    (
        "A:TimeWait",
        "DREQ",
        "sent=DREP drop=- state=TimeWait ev=- qp=- ; Q",
    ),
    (
        "A:TimeWait",
        "DREP",
        "sent=- drop=Duplicate state=TimeWait ev=- qp=- ; Q",
    ),
    // ---- passive side ----
    (
        "P:ReqRcvd",
        "REQ",
        "sent=MRA drop=- state=MraReqSent ev=- qp=- ; Q",
    ),
    (
        "P:ReqRcvd",
        "REP",
        "sent=- drop=UnexpectedInState state=ReqRcvd ev=- qp=- ; Q",
    ),
    (
        "P:ReqRcvd",
        "RTU",
        "sent=- drop=UnexpectedInState state=ReqRcvd ev=- qp=- ; Q",
    ),
    (
        "P:ReqRcvd",
        "MRA(REQ)",
        "sent=- drop=UnexpectedInState state=ReqRcvd ev=- qp=- ; Q",
    ),
    (
        "P:ReqRcvd",
        "MRA(REP)",
        "sent=- drop=UnexpectedInState state=ReqRcvd ev=- qp=- ; Q",
    ),
    (
        "P:ReqRcvd",
        "REJ",
        "sent=- drop=- state=gone ev=L:Withdrawn(Rejected(ConsumerDefined)) qp=- ; Q",
    ),
    (
        "P:ReqRcvd",
        "DREQ",
        "sent=- drop=QpnMismatch state=ReqRcvd ev=- qp=- ; Q",
    ),
    (
        "P:ReqRcvd",
        "DREP",
        "sent=- drop=TidMismatch state=ReqRcvd ev=- qp=- ; Q",
    ),
    (
        "P:MraReqSent",
        "REQ",
        "sent=MRA drop=- state=MraReqSent ev=- qp=- ; Q",
    ),
    (
        "P:MraReqSent",
        "REP",
        "sent=- drop=UnexpectedInState state=MraReqSent ev=- qp=- ; Q",
    ),
    (
        "P:MraReqSent",
        "RTU",
        "sent=- drop=UnexpectedInState state=MraReqSent ev=- qp=- ; Q",
    ),
    (
        "P:MraReqSent",
        "MRA(REQ)",
        "sent=- drop=UnexpectedInState state=MraReqSent ev=- qp=- ; Q",
    ),
    (
        "P:MraReqSent",
        "MRA(REP)",
        "sent=- drop=UnexpectedInState state=MraReqSent ev=- qp=- ; Q",
    ),
    (
        "P:MraReqSent",
        "REJ",
        "sent=- drop=- state=gone ev=L:Withdrawn(Rejected(ConsumerDefined)) qp=- ; Q",
    ),
    (
        "P:MraReqSent",
        "DREQ",
        "sent=- drop=QpnMismatch state=MraReqSent ev=- qp=- ; Q",
    ),
    (
        "P:MraReqSent",
        "DREP",
        "sent=- drop=TidMismatch state=MraReqSent ev=- qp=- ; Q",
    ),
    // The RTR modify is in flight (completed by the follow-up: REP).
    (
        "P:Accepting",
        "REQ",
        "sent=MRA drop=- state=Accepting ev=- qp=- ; then sent=REP drop=- state=RepSent ev=- qp=-",
    ),
    (
        "P:Accepting",
        "REP",
        "sent=- drop=UnexpectedInState state=Accepting ev=- qp=- ; then sent=REP drop=- state=RepSent ev=- qp=-",
    ),
    (
        "P:Accepting",
        "RTU",
        "sent=- drop=UnexpectedInState state=Accepting ev=- qp=- ; then sent=REP drop=- state=RepSent ev=- qp=-",
    ),
    (
        "P:Accepting",
        "MRA(REQ)",
        "sent=- drop=UnexpectedInState state=Accepting ev=- qp=- ; then sent=REP drop=- state=RepSent ev=- qp=-",
    ),
    (
        "P:Accepting",
        "MRA(REP)",
        "sent=- drop=UnexpectedInState state=Accepting ev=- qp=- ; then sent=REP drop=- state=RepSent ev=- qp=-",
    ),
    (
        "P:Accepting",
        "REJ",
        "sent=- drop=- state=TimeWait ev=- qp=- ; then sent=- drop=- state=TimeWait ev=Rejected(28) qp=Error",
    ),
    (
        "P:Accepting",
        "DREQ",
        "sent=- drop=UnexpectedInState state=Accepting ev=- qp=- ; then sent=REP drop=- state=RepSent ev=- qp=-",
    ),
    (
        "P:Accepting",
        "DREP",
        "sent=- drop=TidMismatch state=Accepting ev=- qp=- ; then sent=REP drop=- state=RepSent ev=- qp=-",
    ),
    (
        "P:RepSent",
        "REQ",
        "sent=REP drop=- state=RepSent ev=- qp=- ; Q",
    ),
    (
        "P:RepSent",
        "REP",
        "sent=- drop=UnexpectedInState state=RepSent ev=- qp=- ; Q",
    ),
    (
        "P:RepSent",
        "RTU",
        "sent=- drop=- state=RtuRcvd ev=- qp=Rts ; then sent=- drop=- state=Established ev=Established qp=-",
    ),
    (
        "P:RepSent",
        "MRA(REQ)",
        "sent=- drop=UnexpectedInState state=RepSent ev=- qp=- ; Q",
    ),
    (
        "P:RepSent",
        "MRA(REP)",
        "sent=- drop=- state=MraRepRcvd ev=- qp=- ; Q",
    ),
    (
        "P:RepSent",
        "REJ",
        "sent=- drop=- state=TimeWait ev=- qp=Error ; then sent=- drop=- state=TimeWait ev=Rejected(28) qp=-",
    ),
    (
        "P:RepSent",
        "DREQ",
        "sent=DREP drop=- state=TimeWait ev=- qp=Error ; then sent=- drop=- state=TimeWait ev=Disconnected(Remote) qp=-",
    ),
    (
        "P:RepSent",
        "DREP",
        "sent=- drop=TidMismatch state=RepSent ev=- qp=- ; Q",
    ),
    (
        "P:MraRepRcvd",
        "REQ",
        "sent=REP drop=- state=MraRepRcvd ev=- qp=- ; Q",
    ),
    (
        "P:MraRepRcvd",
        "REP",
        "sent=- drop=UnexpectedInState state=MraRepRcvd ev=- qp=- ; Q",
    ),
    (
        "P:MraRepRcvd",
        "RTU",
        "sent=- drop=- state=RtuRcvd ev=- qp=Rts ; then sent=- drop=- state=Established ev=Established qp=-",
    ),
    (
        "P:MraRepRcvd",
        "MRA(REQ)",
        "sent=- drop=UnexpectedInState state=MraRepRcvd ev=- qp=- ; Q",
    ),
    (
        "P:MraRepRcvd",
        "MRA(REP)",
        "sent=- drop=- state=MraRepRcvd ev=- qp=- ; Q",
    ),
    (
        "P:MraRepRcvd",
        "REJ",
        "sent=- drop=- state=TimeWait ev=- qp=Error ; then sent=- drop=- state=TimeWait ev=Rejected(28) qp=-",
    ),
    (
        "P:MraRepRcvd",
        "DREQ",
        "sent=DREP drop=- state=TimeWait ev=- qp=Error ; then sent=- drop=- state=TimeWait ev=Disconnected(Remote) qp=-",
    ),
    (
        "P:MraRepRcvd",
        "DREP",
        "sent=- drop=TidMismatch state=MraRepRcvd ev=- qp=- ; Q",
    ),
    // The RTS modify is in flight (completed by the follow-up).
    (
        "P:RtuRcvd",
        "REQ",
        "sent=- drop=Duplicate state=RtuRcvd ev=- qp=- ; then sent=- drop=- state=Established ev=Established qp=-",
    ),
    (
        "P:RtuRcvd",
        "REP",
        "sent=- drop=UnexpectedInState state=RtuRcvd ev=- qp=- ; then sent=- drop=- state=Established ev=Established qp=-",
    ),
    (
        "P:RtuRcvd",
        "RTU",
        "sent=- drop=Duplicate state=RtuRcvd ev=- qp=- ; then sent=- drop=- state=Established ev=Established qp=-",
    ),
    (
        "P:RtuRcvd",
        "MRA(REQ)",
        "sent=- drop=UnexpectedInState state=RtuRcvd ev=- qp=- ; then sent=- drop=- state=Established ev=Established qp=-",
    ),
    (
        "P:RtuRcvd",
        "MRA(REP)",
        "sent=- drop=UnexpectedInState state=RtuRcvd ev=- qp=- ; then sent=- drop=- state=Established ev=Established qp=-",
    ),
    (
        "P:RtuRcvd",
        "REJ",
        "sent=- drop=- state=TimeWait ev=- qp=- ; then sent=- drop=- state=TimeWait ev=Rejected(28) qp=Error",
    ),
    (
        "P:RtuRcvd",
        "DREQ",
        "sent=DREP drop=- state=TimeWait ev=- qp=- ; then sent=- drop=- state=TimeWait ev=Disconnected(Remote) qp=Error",
    ),
    (
        "P:RtuRcvd",
        "DREP",
        "sent=- drop=TidMismatch state=RtuRcvd ev=- qp=- ; then sent=- drop=- state=Established ev=Established qp=-",
    ),
    (
        "P:Established",
        "REQ",
        "sent=- drop=Duplicate state=Established ev=- qp=- ; Q",
    ),
    (
        "P:Established",
        "REP",
        "sent=- drop=UnexpectedInState state=Established ev=- qp=- ; Q",
    ),
    (
        "P:Established",
        "RTU",
        "sent=- drop=Duplicate state=Established ev=- qp=- ; Q",
    ),
    (
        "P:Established",
        "MRA(REQ)",
        "sent=- drop=UnexpectedInState state=Established ev=- qp=- ; Q",
    ),
    (
        "P:Established",
        "MRA(REP)",
        "sent=- drop=UnexpectedInState state=Established ev=- qp=- ; Q",
    ),
    (
        "P:Established",
        "REJ",
        "sent=- drop=- state=TimeWait ev=- qp=Error ; then sent=- drop=- state=TimeWait ev=Disconnected(Remote) qp=-",
    ),
    (
        "P:Established",
        "DREQ",
        "sent=DREP drop=- state=TimeWait ev=- qp=Error ; then sent=- drop=- state=TimeWait ev=Disconnected(Remote) qp=-",
    ),
    (
        "P:Established",
        "DREP",
        "sent=- drop=TidMismatch state=Established ev=- qp=- ; Q",
    ),
    (
        "P:DreqSent",
        "REQ",
        "sent=- drop=Duplicate state=DreqSent ev=- qp=- ; Q",
    ),
    (
        "P:DreqSent",
        "REP",
        "sent=- drop=UnexpectedInState state=DreqSent ev=- qp=- ; Q",
    ),
    (
        "P:DreqSent",
        "RTU",
        "sent=- drop=UnexpectedInState state=DreqSent ev=- qp=- ; Q",
    ),
    (
        "P:DreqSent",
        "MRA(REQ)",
        "sent=- drop=UnexpectedInState state=DreqSent ev=- qp=- ; Q",
    ),
    (
        "P:DreqSent",
        "MRA(REP)",
        "sent=- drop=UnexpectedInState state=DreqSent ev=- qp=- ; Q",
    ),
    (
        "P:DreqSent",
        "REJ",
        "sent=- drop=- state=TimeWait ev=- qp=- ; Q",
    ),
    (
        "P:DreqSent",
        "DREQ",
        "sent=DREP drop=- state=TimeWait ev=- qp=- ; Q",
    ),
    (
        "P:DreqSent",
        "DREP",
        "sent=- drop=- state=TimeWait ev=- qp=- ; Q",
    ),
    (
        "P:TimeWait",
        "REQ",
        "sent=REJ(10) drop=- state=TimeWait ev=- qp=- ; Q",
    ),
    (
        "P:TimeWait",
        "REP",
        "sent=- drop=UnexpectedInState state=TimeWait ev=- qp=- ; Q",
    ),
    (
        "P:TimeWait",
        "RTU",
        "sent=- drop=UnexpectedInState state=TimeWait ev=- qp=- ; Q",
    ),
    (
        "P:TimeWait",
        "MRA(REQ)",
        "sent=- drop=UnexpectedInState state=TimeWait ev=- qp=- ; Q",
    ),
    (
        "P:TimeWait",
        "MRA(REP)",
        "sent=- drop=UnexpectedInState state=TimeWait ev=- qp=- ; Q",
    ),
    (
        "P:TimeWait",
        "REJ",
        "sent=- drop=UnexpectedInState state=TimeWait ev=- qp=- ; Q",
    ),
    (
        "P:TimeWait",
        "DREQ",
        "sent=DREP drop=- state=TimeWait ev=- qp=- ; Q",
    ),
    (
        "P:TimeWait",
        "DREP",
        "sent=- drop=Duplicate state=TimeWait ev=- qp=- ; Q",
    ),
    // Rejected by the consumer, lingering to repeat the REJ.
    (
        "P:Closed",
        "REQ",
        "sent=REJ(28) drop=- state=Closed ev=- qp=- ; Q",
    ),
    (
        "P:Closed",
        "REP",
        "sent=- drop=UnexpectedInState state=Closed ev=- qp=- ; Q",
    ),
    (
        "P:Closed",
        "RTU",
        "sent=- drop=UnexpectedInState state=Closed ev=- qp=- ; Q",
    ),
    (
        "P:Closed",
        "MRA(REQ)",
        "sent=- drop=UnexpectedInState state=Closed ev=- qp=- ; Q",
    ),
    (
        "P:Closed",
        "MRA(REP)",
        "sent=- drop=UnexpectedInState state=Closed ev=- qp=- ; Q",
    ),
    (
        "P:Closed",
        "REJ",
        "sent=- drop=UnexpectedInState state=Closed ev=- qp=- ; Q",
    ),
    (
        "P:Closed",
        "DREQ",
        "sent=- drop=QpnMismatch state=Closed ev=- qp=- ; Q",
    ),
    (
        "P:Closed",
        "DREP",
        "sent=- drop=TidMismatch state=Closed ev=- qp=- ; Q",
    ),
];

const STATES: [&str; 16] = [
    "A:ReqSent",
    "A:MraReqRcvd",
    "A:RepRcvd",
    "A:Established",
    "A:DreqSent",
    "A:TimeWait",
    "P:ReqRcvd",
    "P:MraReqSent",
    "P:Accepting",
    "P:RepSent",
    "P:MraRepRcvd",
    "P:RtuRcvd",
    "P:Established",
    "P:DreqSent",
    "P:TimeWait",
    "P:Closed",
];

/// Expands "; Q" into the quiet follow-up for the line's state.
fn expand(expected: &str) -> String {
    match expected.strip_suffix(" ; Q") {
        Some(now) => {
            let state = now
                .split(' ')
                .find_map(|f| f.strip_prefix("state="))
                .unwrap();
            format!("{now} ; then sent=- drop=- state={state} ev=- qp=-")
        }
        None => expected.to_string(),
    }
}

#[test]
fn every_message_in_every_state() {
    // The table covers the product exactly.
    assert_eq!(TABLE.len(), STATES.len() * MESSAGES.len());
    for state in STATES {
        for message in MESSAGES {
            assert_eq!(
                TABLE
                    .iter()
                    .filter(|(s, m, _)| *s == state && *m == message)
                    .count(),
                1,
                "{state} × {message}"
            );
        }
    }
    let mut failures = Vec::new();
    for (state, message, expected) in TABLE {
        let got = outcome(state, message);
        let want = expand(expected);
        if got != want {
            failures.push(format!(
                "{state} × {message}\n   want {want}\n   got  {got}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn every_state_times_out_defined() {
    // What each state does when its deadline passes (and that a state
    // without a timer has none).
    let cases: &[(&str, &str)] = &[
        ("A:ReqSent", "sent=REQ drop=- state=ReqSent ev=- qp=-"),
        ("A:MraReqRcvd", "sent=REQ drop=- state=ReqSent ev=- qp=-"),
        ("A:RepRcvd", "none"),
        ("A:Established", "none"),
        ("A:DreqSent", "sent=DREQ drop=- state=DreqSent ev=- qp=-"),
        ("A:TimeWait", "sent=- drop=- state=gone ev=- qp=-"),
        (
            "P:ReqRcvd",
            "sent=REJ(4) drop=- state=Closed ev=L:Withdrawn(TimedOut) qp=-",
        ),
        (
            "P:MraReqSent",
            "sent=REJ(4) drop=- state=Closed ev=L:Withdrawn(TimedOut) qp=-",
        ),
        ("P:Accepting", "none"),
        ("P:RepSent", "sent=REP drop=- state=RepSent ev=- qp=-"),
        ("P:MraRepRcvd", "sent=REP drop=- state=RepSent ev=- qp=-"),
        ("P:RtuRcvd", "none"),
        ("P:Established", "none"),
        ("P:DreqSent", "sent=DREQ drop=- state=DreqSent ev=- qp=-"),
        ("P:TimeWait", "sent=- drop=- state=gone ev=- qp=-"),
        ("P:Closed", "sent=- drop=- state=gone ev=- qp=-"),
    ];
    assert_eq!(cases.len(), STATES.len());
    for (state, expected) in cases {
        let (mut s, _) = build(state);
        s.clear();
        let got = match s.x.next_deadline() {
            None => "none".to_string(),
            Some(t) => {
                s.now = t;
                s.x.on_timeout(t, &mut s.rec);
                s.signature()
            }
        };
        assert_eq!(&got, expected, "{state}");
    }
}

#[test]
fn disconnect_in_every_state() {
    let cases: &[(&str, &str)] = &[
        (
            "A:ReqSent",
            "Ok sent=REJ(4) drop=- state=gone ev=Disconnected(Local) qp=-",
        ),
        (
            "A:MraReqRcvd",
            "Ok sent=REJ(4) drop=- state=gone ev=Disconnected(Local) qp=-",
        ),
        (
            "A:RepRcvd",
            "Ok sent=REJ(28) drop=- state=TimeWait ev=- qp=-",
        ),
        (
            "A:Established",
            "Ok sent=DREQ drop=- state=DreqSent ev=- qp=Error",
        ),
        ("A:DreqSent", "Err(UnknownId)"),
        ("A:TimeWait", "Err(UnknownId)"),
        ("P:ReqRcvd", "Err(WrongState)"),
        ("P:MraReqSent", "Err(WrongState)"),
        (
            "P:Accepting",
            "Ok sent=REJ(28) drop=- state=Closed ev=- qp=-",
        ),
        (
            "P:RepSent",
            "Ok sent=REJ(28) drop=- state=TimeWait ev=- qp=Error",
        ),
        (
            "P:MraRepRcvd",
            "Ok sent=REJ(28) drop=- state=TimeWait ev=- qp=Error",
        ),
        ("P:RtuRcvd", "Ok sent=DREQ drop=- state=DreqSent ev=- qp=-"),
        (
            "P:Established",
            "Ok sent=DREQ drop=- state=DreqSent ev=- qp=Error",
        ),
        ("P:DreqSent", "Err(UnknownId)"),
        ("P:TimeWait", "Err(UnknownId)"),
        ("P:Closed", "Err(UnknownId)"),
    ];
    assert_eq!(cases.len(), STATES.len());
    for (state, expected) in cases {
        let (mut s, _) = build(state);
        s.clear();
        let got = match s.x.disconnect(s.now, s.id, &[], &mut s.rec) {
            Ok(()) => format!("Ok {}", s.signature()),
            Err(e) => format!("Err({e:?})"),
        };
        assert_eq!(&got, expected, "{state}");
        // Whatever was pending, the terminal event follows the QP work.
        s.complete_qp();
        s.rec.check_contract();
        if got.starts_with("Ok") {
            let terminal: Vec<_> = s
                .rec
                .events
                .iter()
                .filter(|(_, e)| e.is_terminal())
                .collect();
            assert_eq!(terminal.len(), 1, "{state}: {:?}", s.rec.events);
        }
    }
}

#[test]
fn accept_and_reject_in_every_state() {
    // Only a request nobody has answered can be accepted or rejected; a
    // connection whose consumer is gone is unknown, any other is in the
    // wrong state.
    let unanswered = ["P:ReqRcvd", "P:MraReqSent"];
    let gone = [
        "A:DreqSent",
        "A:TimeWait",
        "P:DreqSent",
        "P:TimeWait",
        "P:Closed",
    ];
    for state in STATES {
        let want = if unanswered.contains(&state) {
            None
        } else if gone.contains(&state) {
            Some(CmError::UnknownId)
        } else {
            Some(CmError::WrongState)
        };
        let accept = AcceptRequest {
            qp: LocalQp {
                qpn: qpn(0x300),
                starting_psn: None,
            },
            params: ConnParams::SRP,
            private_data: &[],
        };
        let (mut s, _) = build(state);
        s.clear();
        let got = s.x.accept(s.now, s.id, &accept, &mut s.rec).err();
        assert_eq!(got, want, "accept in {state}");
        if want.is_some() {
            assert!(s.rec.sent.is_empty() && s.rec.qp_log.is_empty(), "{state}");
        } else {
            assert_eq!(s.x.state(s.id), Some(CmState::Accepting));
        }
        let (mut s, _) = build(state);
        s.clear();
        let got =
            s.x.reject(
                s.now,
                s.id,
                RejectReason::ConsumerDefined,
                b"no",
                &mut s.rec,
            )
            .err();
        assert_eq!(got, want, "reject in {state}");
        if want.is_none() {
            assert_eq!(s.sent_names(), "REJ(28)");
            assert_eq!(s.x.state(s.id), Some(CmState::Closed));
        }
    }
}
