use super::*;

const BASE: &str = "node.name = iqn.2003-01.org.linux-iscsi.t1:sn.1\n\
                    node.conn[0].address = 192.0.2.10\n\
                    iface.initiatorname = iqn.2024-01.test.kverbs:init\n";

fn with(extra: &str) -> Result<TargetDescription, DescriptionError<'static>> {
    let record: &'static str = Box::leak(format!("{BASE}{extra}").into_boxed_str());
    TargetDescription::parse(record)
}

#[test]
fn defaults_and_a_full_record() {
    let d = with("").unwrap();
    assert_eq!(d.portal.port, 3260);
    assert_eq!(d.portal.service_id().0, 0x0000_0000_0106_0CBC);
    assert_eq!(d.params, OperationalParams::default());
    assert_eq!(d.timeouts, Timeouts::default());
    assert_eq!((d.cmds_max, d.queue_depth), (128, 32));
    assert_eq!(d.isid.format(), IsidFormat::Random);
    assert_eq!(d.isid.qualifier(), 1);
    assert_eq!(d.auth, Authentication::default());

    let d = with(
        "# a comment\n\n\
         node.conn[0].port = 3261\nnode.tpgt = 2\nnode.session.isid = 0x400001370001\n\
         node.session.auth.authmethod = CHAP\nnode.session.auth.username = user\n\
         node.session.auth.password = twelve-bytes\n\
         node.session.iscsi.InitialR2T = Yes\nnode.session.iscsi.ImmediateData = No\n\
         node.session.iscsi.FirstBurstLength = 65536\nnode.session.iscsi.MaxBurstLength = 262144\n\
         node.session.iscsi.DefaultTime2Wait = 3\nnode.session.iscsi.DefaultTime2Retain = 20\n\
         node.session.iscsi.MaxConnections = 1\nnode.session.iscsi.ERL = 0\n\
         node.session.iscsi.MaxOutstandingUnexpectedPDUs = 16\n\
         node.conn[0].iscsi.MaxRecvDataSegmentLength = 16384\n\
         node.conn[0].iscsi.MaxXmitDataSegmentLength = 4096\n\
         node.conn[0].iscsi.HeaderDigest = None\nnode.conn[0].iscsi.DataDigest = None\n\
         node.conn[0].timeo.noop_out_interval = 0\nnode.conn[0].timeo.noop_out_timeout = 10\n\
         node.conn[0].timeo.login_timeout = 30\nnode.conn[0].timeo.logout_timeout = 20\n\
         node.session.err_timeo.abort_timeout = 5\nnode.session.err_timeo.lu_reset_timeout = 6\n\
         node.session.timeo.replacement_timeout = off\nnode.session.timeo.reconnect_delay = 4\n\
         node.session.timeo.dev_loss_tmo = 100\nnode.session.timeo.window_timeout = 7\n\
         node.session.cmds_max = 256\nnode.session.queue_depth = 64\n\
         node.session.auth.username_in = <empty>\n",
    )
    .unwrap();
    assert_eq!(d.portal.port, 3261);
    assert_eq!(d.tpgt, Some(2));
    assert_eq!(d.isid.bytes(), [0x40, 0x00, 0x01, 0x37, 0x00, 0x01]);
    assert_eq!(d.isid.format(), IsidFormat::IanaEnterpriseNumber);
    let chap = d.auth.chap.as_ref().unwrap();
    assert_eq!(chap.username.as_str(), "user");
    assert_eq!(chap.secret.as_slice(), b"twelve-bytes");
    assert!(
        !format!("{chap:?}").contains("twelve"),
        "secret never printed"
    );
    assert_eq!(
        d.params,
        OperationalParams {
            initiator_recv_data_segment_length: 16384,
            target_recv_data_segment_length: 4096,
            max_burst_length: 262_144,
            first_burst_length: 65536,
            immediate_data: false,
            initial_r2t: true,
            default_time2wait: 3,
            default_time2retain: 20,
            max_outstanding_unexpected_pdus: 16,
        }
    );
    assert_eq!(d.timeouts.fast_io_fail, None);
    assert_eq!(d.timeouts.dev_loss, Some(100));
    assert_eq!((d.cmds_max, d.queue_depth), (256, 64));
}

#[track_caller]
fn fails(extra: &str, key: &str, kind: ErrorKind) {
    let e = with(extra).unwrap_err();
    assert_eq!((e.key, e.kind), (key, kind), "{extra:?}: {e}");
}

#[test]
fn every_error_names_its_key() {
    fails("node.bogus = 1\n", "node.bogus", ErrorKind::UnknownKey);
    fails(
        "node.conn[0].port = 1\nnode.conn[0].port = 2\n",
        "node.conn[0].port",
        ErrorKind::DuplicateKey,
    );
    fails(
        "node.conn[0].port = 03260\n",
        "node.conn[0].port",
        ErrorKind::BadNumber,
    );
    fails(
        "node.conn[0].port = 0\n",
        "node.conn[0].port",
        ErrorKind::OutOfRange,
    );
    fails(
        "node.conn[0].port = 65536\n",
        "node.conn[0].port",
        ErrorKind::OutOfRange,
    );
    fails(
        "node.session.iscsi.ImmediateData = yes\n",
        "node.session.iscsi.ImmediateData",
        ErrorKind::BadBoolean,
    );
    fails(
        "node.session.iscsi.FirstBurstLength = 511\n",
        "node.session.iscsi.FirstBurstLength",
        ErrorKind::OutOfRange,
    );
    fails(
        "node.session.iscsi.MaxConnections = 2\n",
        "node.session.iscsi.MaxConnections",
        ErrorKind::Unsupported,
    );
    fails(
        "node.session.iscsi.ERL = 1\n",
        "node.session.iscsi.ERL",
        ErrorKind::Unsupported,
    );
    fails(
        "node.session.iscsi.MaxOutstandingUnexpectedPDUs = 1\n",
        "node.session.iscsi.MaxOutstandingUnexpectedPDUs",
        ErrorKind::OutOfRange,
    );
    fails(
        "node.conn[0].iscsi.HeaderDigest = CRC32C\n",
        "node.conn[0].iscsi.HeaderDigest",
        ErrorKind::Unsupported,
    );
    fails(
        "node.session.auth.authmethod = KRB5\n",
        "node.session.auth.authmethod",
        ErrorKind::Unsupported,
    );
    fails(
        "node.session.auth.password = short\n",
        "node.session.auth.password",
        ErrorKind::SecretTooShort,
    );
    fails(
        "node.session.auth.username = a\u{7}b\n",
        "node.session.auth.username",
        ErrorKind::BadCharacter,
    );
    fails(
        "node.session.isid = 12345\n",
        "node.session.isid",
        ErrorKind::IsidFormat,
    );
    fails(
        "node.session.isid = c00000000001\n",
        "node.session.isid",
        ErrorKind::IsidType,
    );
    fails(
        "node.session.isid = 410000000001\n",
        "node.session.isid",
        ErrorKind::IsidType,
    );
    fails(
        "node.session.timeo.replacement_timeout = 601\n",
        "node.session.timeo.replacement_timeout",
        ErrorKind::OutOfRange,
    );
    fails(
        "node.conn[0].timeo.noop_out_timeout = 0\n",
        "node.conn[0].timeo.noop_out_timeout",
        ErrorKind::OutOfRange,
    );
    fails(
        "node.session.cmds_max = 1\n",
        "node.session.cmds_max",
        ErrorKind::OutOfRange,
    );
    // Whole-description rules.
    fails(
        "node.session.iscsi.FirstBurstLength = 8192\nnode.session.iscsi.MaxBurstLength = 4096\n",
        "node.session.iscsi.FirstBurstLength",
        ErrorKind::Inconsistent,
    );
    fails(
        "node.session.timeo.replacement_timeout = 100\nnode.session.timeo.dev_loss_tmo = 100\n",
        "node.session.timeo.replacement_timeout",
        ErrorKind::Inconsistent,
    );
    fails(
        "node.session.timeo.replacement_timeout = off\nnode.session.timeo.dev_loss_tmo = off\n",
        "node.session.timeo.dev_loss_tmo",
        ErrorKind::Inconsistent,
    );
    fails(
        "node.session.queue_depth = 200\n",
        "node.session.queue_depth",
        ErrorKind::Inconsistent,
    );
    fails(
        "node.session.auth.username = u\nnode.session.auth.password = twelve-bytes\n",
        "node.session.auth.authmethod",
        ErrorKind::Inconsistent,
    );
    fails(
        "node.session.auth.username = u\n",
        "node.session.auth.password",
        ErrorKind::Missing,
    );
    fails(
        "node.session.auth.authmethod = CHAP\n",
        "node.session.auth.username",
        ErrorKind::Missing,
    );
    fails(
        "node.session.auth.authmethod = CHAP\nnode.session.auth.username = u\n",
        "node.session.auth.password",
        ErrorKind::Missing,
    );
    fails(
        "node.session.auth.authmethod = CHAP\nnode.session.auth.username = u\n\
         node.session.auth.password = samesecret12\nnode.session.auth.username_in = t\n\
         node.session.auth.password_in = samesecret12\n",
        "node.session.auth.password_in",
        ErrorKind::Inconsistent,
    );
}

#[test]
fn missing_keys_and_lines() {
    let e = TargetDescription::parse("node.conn[0].address = 10.0.0.1\n").unwrap_err();
    assert_eq!((e.key, e.kind), ("node.name", ErrorKind::Missing));
    let e = TargetDescription::parse("node.name = iqn.2003-01.org.x\n").unwrap_err();
    assert_eq!(
        (e.key, e.kind),
        ("node.conn[0].address", ErrorKind::Missing)
    );
    let e = TargetDescription::parse("node.name = iqn.2003-01.org.x\nnode.conn[0].address = ::1\n")
        .unwrap_err();
    assert_eq!((e.key, e.kind), ("iface.initiatorname", ErrorKind::Missing));
    let e = TargetDescription::parse("\n\nnode.name iqn\n").unwrap_err();
    assert_eq!((e.kind, e.line), (ErrorKind::MissingEquals, Some(3)));
    let e = TargetDescription::parse("node.conn[0].address = 10.0.0.999\n").unwrap_err();
    assert_eq!(
        (e.key, e.kind, e.line),
        ("node.conn[0].address", ErrorKind::BadAddress, Some(1))
    );
    assert_eq!(
        e.to_string(),
        "line 1: node.conn[0].address: not an IP address"
    );
}

#[test]
fn iscsi_names() {
    for ok in [
        "iqn.2003-01.org.linux-iscsi.t1:sn.1",
        "iqn.1991-05.com.microsoft:host",
        "iqn.2001-04.com.example",
        "iqn.2001-04.com.example:storage:diskarrays-sn-a8675309",
        "eui.02004567A425678D",
        "naa.52004567BA64678D",
        "naa.62004567BA64678D0123456789ABCDEF",
    ] {
        assert_eq!(IscsiName::parse(ok).unwrap().as_str(), ok);
    }
    let cases = [
        ("iqn2001-04.com.example", ErrorKind::NameType),
        ("iqn.01-04.com.example", ErrorKind::NameDate),
        ("iqn.2001-13.com.example", ErrorKind::NameDate),
        ("iqn.2001-00.com.example", ErrorKind::NameDate),
        ("iqn.2001-04", ErrorKind::NameAuthority),
        ("iqn.2001-04.", ErrorKind::NameAuthority),
        ("iqn.2001-04.com..example", ErrorKind::NameAuthority),
        ("iqn.2001-04.com.example:", ErrorKind::NameAuthority),
        ("iqn.2001-04.Com.Example", ErrorKind::NameCharacter),
        ("iqn.2001-04.com.example:disk one", ErrorKind::NameCharacter),
        ("eui.02004567A425678", ErrorKind::NameHexDigits),
        ("eui.02004567A425678G", ErrorKind::NameCharacter),
        ("naa.0123", ErrorKind::NameHexDigits),
        ("fc.12", ErrorKind::NameType),
    ];
    for (name, kind) in cases {
        assert_eq!(IscsiName::parse(name), Err(kind), "{name}");
    }
    let long = format!("iqn.2001-04.com.example:{}", "a".repeat(200));
    assert_eq!(IscsiName::parse(&long), Err(ErrorKind::NameTooLong));
}

#[test]
fn portals_and_isids() {
    let p = Portal::parse("192.0.2.1:3261").unwrap();
    assert_eq!(p.port, 3261);
    let p = Portal::parse("[fe80::1]:860").unwrap();
    assert_eq!((p.address.is_ipv6(), p.port), (true, 860));
    assert_eq!(Portal::parse("fe80::1").unwrap().port, 3260);
    assert_eq!(Portal::parse("192.0.2.1").unwrap().port, 3260);
    assert_eq!(Portal::parse("host:3260"), Err(ErrorKind::BadAddress));
    assert_eq!(Portal::parse("192.0.2.1:0"), Err(ErrorKind::OutOfRange));
    assert_eq!(Portal::parse("192.0.2.1:x"), Err(ErrorKind::BadNumber));

    assert_eq!(
        Isid::parse("00023d000001").unwrap().format(),
        IsidFormat::Oui
    );
    assert_eq!(Isid::parse("0x800000000005").unwrap().qualifier(), 5);
    // A derived ISID is stable and differs per target.
    let i = IscsiName::parse("iqn.2024-01.a.b:i").unwrap();
    let t1 = IscsiName::parse("iqn.2024-01.a.b:t1").unwrap();
    let t2 = IscsiName::parse("iqn.2024-01.a.b:t2").unwrap();
    let portal = Portal::parse("192.0.2.1").unwrap();
    let a = Isid::derived(&i, &t1, &portal);
    assert_eq!(a, Isid::derived(&i, &t1, &portal));
    assert_ne!(a, Isid::derived(&i, &t2, &portal));
    assert_eq!(Isid::from_bytes(a.bytes()), Ok(a));
}
