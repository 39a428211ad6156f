//! The target alone, driven by hand-built PDUs: what LIO does that the
//! initiator never provokes.

use super::*;
use crate::scsi_target::{BlockSize, LunConfig};
use storport_srp::wire::iscsi::{LoginRequestRepr, ScsiCommandRepr, TaskAttr};

const NAME: &str = "iqn.2003-01.org.linux-iscsi.t1:sn.1";

fn target() -> IscsiTarget {
    let scsi = Arc::new(ScsiTarget::single(1, LunConfig::new(BlockSize::B512, 64)).unwrap());
    IscsiTarget::new(TargetConfig::lio(NAME), scsi)
}

fn login_pdu(stage: LoginStage, next: LoginStage, isid_last: u8, text: &str) -> Vec<u8> {
    emit(
        BhsRepr::LoginRequest(LoginRequestRepr {
            current_stage: stage,
            next_stage: Some(next),
            continues: false,
            version_max: 0,
            version_min: 0,
            isid: [0x80, 0, 0, 0, 0, isid_last],
            tsih: 0,
            itt: 1,
            cid: 0,
            cmd_sn: SerialNumber(10),
            exp_stat_sn: SerialNumber(0),
        }),
        text.as_bytes(),
    )
}

fn sent(out: &[Output]) -> Vec<Vec<u8>> {
    out.iter()
        .filter_map(|o| match o {
            Output::Send(_, p) => Some(p.clone()),
            _ => None,
        })
        .collect()
}

/// Logs in with the operational stage only (LIO allows CSG 1 first).
fn login(t: &mut IscsiTarget, isid_last: u8) -> ConnId {
    let conn = t.accept();
    let text = format!(
        "InitiatorName=iqn.2024-01.test:i\0SessionType=Normal\0TargetName={NAME}\0\
         MaxOutstandingR2T=1\0ErrorRecoveryLevel=0\0RDMAExtensions=Yes\0\
         InitiatorRecvDataSegmentLength=8192\0TargetRecvDataSegmentLength=8192\0\
         MaxBurstLength=262144\0DefaultTime2Wait=2\0DefaultTime2Retain=0\0ImmediateData=Yes\0\
         IFMarker=No\0OFMarkInt=2048~8192\0"
    );
    let out = t.receive(
        conn,
        &login_pdu(
            LoginStage::OperationalNegotiation,
            LoginStage::FullFeature,
            isid_last,
            &text,
        ),
    );
    let rsp = &sent(&out)[0];
    assert_eq!(rsp[36], 0, "status class");
    let text = String::from_utf8(rsp[48..].to_vec()).unwrap();
    // Markers: IFMarker keeps LIO's No, OFMarkInt its Reject; the
    // security-stage declarations come first since the stage was skipped.
    assert!(
        text.starts_with("MaxConnections=1\0TargetAlias=LIO Target\0TargetPortalGroupTag=1\0"),
        "{text}"
    );
    assert!(text.contains("IFMarker=No\0"), "{text}");
    assert!(text.contains("OFMarkInt=Reject\0"), "{text}");
    assert!(t.is_full_feature(conn));
    conn
}

fn command(itt: u32, cmd_sn: u32) -> Vec<u8> {
    emit(
        BhsRepr::ScsiCommand(ScsiCommandRepr {
            immediate: false,
            is_final: true,
            read: false,
            write: false,
            attr: TaskAttr::Simple,
            lun: Lun::from_index(0).unwrap(),
            itt,
            expected_data_len: 0,
            cmd_sn: SerialNumber(cmd_sn),
            exp_stat_sn: SerialNumber(0),
            cdb: [0; 16],
        }),
        &[],
    )
}

#[test]
fn commands_run_in_cmdsn_order_and_out_of_window_ones_are_dropped() {
    let mut t = target();
    let conn = login(&mut t, 1);
    // CmdSN 11 before 10: it waits.
    assert!(sent(&t.receive(conn, &command(2, 11))).is_empty());
    assert_eq!(t.tasks_in_progress(conn), 1);
    let out = sent(&t.receive(conn, &command(1, 10)));
    let itts: Vec<u32> = out
        .iter()
        .map(|p| u32::from_be_bytes(p[16..20].try_into().unwrap()))
        .collect();
    assert_eq!(itts, [1, 2]);
    // Behind the window, and far ahead of it: silently ignored.
    assert!(sent(&t.receive(conn, &command(3, 9))).is_empty());
    assert!(sent(&t.receive(conn, &command(4, 5000))).is_empty());
    assert_eq!(t.counters().out_of_window, 2);
    // A reused ITT of a task still in progress is rejected.
    t.misbehaviour.hold_responses = true;
    assert!(sent(&t.receive(conn, &command(5, 12))).is_empty());
    let out = sent(&t.receive(conn, &command(5, 13)));
    assert_eq!(out[0][0], 0x3F, "Reject");
}

#[test]
fn a_second_login_with_the_same_isid_reinstates() {
    let mut t = target();
    let first = login(&mut t, 1);
    let other = login(&mut t, 2);
    assert_eq!(
        t.counters().reinstatements,
        0,
        "another ISID: another session"
    );
    let conn = t.accept();
    let text = format!(
        "InitiatorName=iqn.2024-01.test:i\0SessionType=Normal\0TargetName={NAME}\0\
         MaxOutstandingR2T=1\0ErrorRecoveryLevel=0\0RDMAExtensions=Yes\0\
         InitiatorRecvDataSegmentLength=8192\0TargetRecvDataSegmentLength=8192\0\
         MaxBurstLength=262144\0DefaultTime2Wait=2\0DefaultTime2Retain=0\0ImmediateData=Yes\0"
    );
    let out = t.receive(
        conn,
        &login_pdu(
            LoginStage::OperationalNegotiation,
            LoginStage::FullFeature,
            1,
            &text,
        ),
    );
    assert!(out.contains(&Output::Close(first)));
    assert!(!out.contains(&Output::Close(other)));
    assert_eq!(t.counters().reinstatements, 1);
    assert!(!t.is_full_feature(first));
}

#[test]
fn missing_keys_and_a_lio_proposal() {
    let mut t = target();
    let conn = t.accept();
    let out = sent(&t.receive(
        conn,
        &login_pdu(
            LoginStage::SecurityNegotiation,
            LoginStage::OperationalNegotiation,
            1,
            "SessionType=Normal\0",
        ),
    ));
    assert_eq!((out[0][36], out[0][37]), (2, 7), "missing InitiatorName");
    // Operational keys left out: LIO proposes them and waits for answers.
    let conn = t.accept();
    let text = format!("InitiatorName=iqn.2024-01.test:i\0SessionType=Normal\0TargetName={NAME}\0");
    let out = sent(&t.receive(
        conn,
        &login_pdu(
            LoginStage::OperationalNegotiation,
            LoginStage::FullFeature,
            1,
            &text,
        ),
    ));
    assert_eq!(out[0][1] & 0x80, 0, "no transit with proposals unanswered");
    let text = String::from_utf8(out[0][48..].to_vec()).unwrap();
    assert!(text.contains("MaxOutstandingR2T=1\0"), "{text}");
    assert!(text.contains("RDMAExtensions=Yes\0"), "{text}");
    assert!(
        !text.contains("MaxRecvDataSegmentLength"),
        "not negotiated under iSER"
    );
}
