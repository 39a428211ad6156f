//! Tests of the `add_target` parser and the timeout rules: every error,
//! every range edge, the defaults, and a round trip of generated strings.

use core::time::Duration;

use proptest::prelude::*;

use super::*;

const IB: &str = "id_ext=200100e08b000000,ioc_guid=0002c90200402bd4,dgid=fe800000000000000002c90200402bd5,pkey=ffff,service_id=0002c90200402bd4";
const RDMA: &str = "id_ext=1,ioc_guid=2,dest=192.0.2.10:5555";

fn parse(s: &str) -> Result<TargetParams, ParamError> {
    parse_add_target(s.as_bytes())
}

fn with(extra: &str) -> Result<TargetParams, ParamError> {
    parse(&format!("{RDMA},{extra}"))
}

#[test]
fn ib_cm_form_and_defaults() {
    let p = parse(IB).unwrap();
    assert_eq!(p.id_ext, 0x2001_00e0_8b00_0000);
    assert_eq!(p.ioc_guid, 0x0002_c902_0040_2bd4);
    let Addressing::IbCm {
        dgid,
        pkey,
        service_id,
    } = p.addressing
    else {
        panic!("not IB CM")
    };
    assert_eq!(dgid[0], 0xfe);
    assert_eq!(dgid[15], 0xd5);
    assert_eq!(pkey, 0xffff);
    assert_eq!(service_id, 0x0002_c902_0040_2bd4);
    assert_eq!(p.queue_size, DEFAULT_QUEUE_SIZE);
    assert_eq!(p.max_cmd_per_lun, DEFAULT_QUEUE_SIZE);
    assert_eq!(p.cmd_sg_entries, 12);
    assert_eq!(p.sg_tablesize, 12);
    assert_eq!(p.tl_retry_count, 7);
    assert_eq!(p.max_sect, DEFAULT_MAX_SECT);
    assert_eq!(p.ch_count, None);
    assert_eq!(p.max_it_iu_size, None);
    assert_eq!(p.target_can_queue, None);
    assert!(!p.allow_ext_sg);
    assert_eq!(p.io_class, IoClass::Rev16a);
}

#[test]
fn rdma_cm_form() {
    let p = parse(RDMA).unwrap();
    assert_eq!(
        p.addressing,
        Addressing::RdmaCm {
            src: None,
            dest: [192, 0, 2, 10],
            port: 5555
        }
    );
    let p = with("src=10.0.0.1").unwrap();
    assert_eq!(
        p.addressing,
        Addressing::RdmaCm {
            src: Some([10, 0, 0, 1]),
            dest: [192, 0, 2, 10],
            port: 5555
        }
    );
    assert!(matches!(
        with("src=10.0.0.1:4000").unwrap().addressing,
        Addressing::RdmaCm {
            src: Some([10, 0, 0, 1]),
            ..
        }
    ));
    assert_eq!(
        p,
        TargetParams {
            addressing: p.addressing,
            ..TargetParams::rdma_cm(1, 2, [192, 0, 2, 10], 5555)
        }
    );
}

#[test]
fn every_key_is_accepted() {
    let p = with(
        "max_sect=256,max_cmd_per_lun=8,queue_size=32,ch_count=3,cmd_sg_entries=255,\
         sg_tablesize=2048,comp_vector=5,tl_retry_count=2,max_it_iu_size=64,\
         initiator_ext=0xAbC,target_can_queue=9,allow_ext_sg=1,io_class=ff00",
    )
    .unwrap();
    assert_eq!(p.max_sect, 256);
    assert_eq!(p.max_cmd_per_lun, 8);
    assert_eq!(p.queue_size, 32);
    assert_eq!(p.ch_count, Some(3));
    assert_eq!(p.cmd_sg_entries, 255);
    assert_eq!(p.sg_tablesize, 2048);
    assert_eq!(p.comp_vector, 5);
    assert_eq!(p.tl_retry_count, 2);
    assert_eq!(p.max_it_iu_size, Some(64));
    assert_eq!(p.initiator_ext, 0xabc);
    assert_eq!(p.target_can_queue, Some(9));
    assert!(p.allow_ext_sg);
    assert_eq!(p.io_class, IoClass::Rev10);
    assert_eq!(with("io_class=100").unwrap().io_class, IoClass::Rev16a);
    assert_eq!(with("max_it_iu_size=0").unwrap().max_it_iu_size, None);
}

#[test]
fn queue_size_sets_cmd_per_lun_and_sg_tablesize_follows_cmd_sg() {
    let p = with("queue_size=17").unwrap();
    assert_eq!(p.max_cmd_per_lun, 17);
    let p = with("cmd_sg_entries=40").unwrap();
    assert_eq!(p.sg_tablesize, 40);
}

#[test]
fn structural_errors() {
    assert_eq!(parse(""), Err(ParamError::Empty));
    assert_eq!(
        parse("id_ext=1,,ioc_guid=2"),
        Err(ParamError::EmptyItem { at: 9 })
    );
    assert_eq!(parse(",id_ext=1"), Err(ParamError::EmptyItem { at: 0 }));
    assert_eq!(
        parse(&format!("{RDMA},")),
        Err(ParamError::EmptyItem { at: RDMA.len() + 1 })
    );
    assert_eq!(
        parse("id_ext=1,ioc_guid"),
        Err(ParamError::NotKeyValue { at: 9, len: 8 })
    );
    assert_eq!(
        parse("id_ext=1,bogus=2"),
        Err(ParamError::UnknownKey { at: 9, len: 5 })
    );
    assert_eq!(
        parse("ID_EXT=1"),
        Err(ParamError::UnknownKey { at: 0, len: 6 })
    );
    assert_eq!(
        parse("id_ext=1,id_ext=1"),
        Err(ParamError::DuplicateKey { key: Key::IdExt })
    );
    assert_eq!(
        with("queue_size=4,queue_size=4"),
        Err(ParamError::DuplicateKey {
            key: Key::QueueSize
        })
    );
    assert_eq!(
        parse("id_ext=1,ioc_guid=2,dest=1.2.3.4:5\n"),
        Err(ParamError::BadAddress { key: Key::Dest })
    );
}

#[test]
fn hex_values() {
    for key in ["id_ext", "ioc_guid", "initiator_ext"] {
        let k = Key::from_name(key.as_bytes()).unwrap();
        let s = |v: &str| {
            let mut items = vec![("id_ext", "1"), ("ioc_guid", "2"), ("dest", "1.2.3.4:5")];
            match items.iter_mut().find(|(n, _)| *n == key) {
                Some(item) => item.1 = v,
                None => items.push((key, v)),
            }
            let text: Vec<String> = items.iter().map(|(n, v)| format!("{n}={v}")).collect();
            parse(&text.join(","))
        };
        assert_eq!(s(""), Err(ParamError::BadNumber { key: k }), "{key}");
        assert_eq!(s("0x"), Err(ParamError::BadNumber { key: k }), "{key}");
        assert_eq!(s("12g"), Err(ParamError::BadNumber { key: k }), "{key}");
        assert_eq!(s("-1"), Err(ParamError::BadNumber { key: k }), "{key}");
        assert_eq!(s(" 1"), Err(ParamError::BadNumber { key: k }), "{key}");
        assert_eq!(
            s("1ffffffffffffffff"),
            Err(ParamError::OutOfRange { key: k }),
            "{key}"
        );
        assert!(s("ffffffffffffffff").is_ok(), "{key}");
        assert!(s("0X00000000000000000001").is_ok(), "{key}: leading zeros");
    }
    let ib = |pkey: &str| parse(&IB.replace("pkey=ffff", &format!("pkey={pkey}")));
    assert_eq!(ib("10000"), Err(ParamError::OutOfRange { key: Key::Pkey }));
    assert_eq!(ib("xyz"), Err(ParamError::BadNumber { key: Key::Pkey }));
    assert!(matches!(
        ib("0x7fff").unwrap().addressing,
        Addressing::IbCm { pkey: 0x7fff, .. }
    ));
    let sid =
        |v: &str| parse(&IB.replace("service_id=0002c90200402bd4", &format!("service_id={v}")));
    assert_eq!(
        sid("q"),
        Err(ParamError::BadNumber {
            key: Key::ServiceId
        })
    );
    assert_eq!(
        with("io_class=ff01"),
        Err(ParamError::OutOfRange { key: Key::IoClass })
    );
    assert_eq!(
        with("io_class=zz"),
        Err(ParamError::BadNumber { key: Key::IoClass })
    );
}

#[test]
fn gid_values() {
    let g = |v: &str| {
        parse(&IB.replace(
            "dgid=fe800000000000000002c90200402bd5",
            &format!("dgid={v}"),
        ))
    };
    assert_eq!(g("fe80"), Err(ParamError::BadAddress { key: Key::Dgid }));
    assert_eq!(
        g("fe800000000000000002c90200402bd5ff"),
        Err(ParamError::BadAddress { key: Key::Dgid })
    );
    assert_eq!(
        g("fe800000000000000002c90200402bdx"),
        Err(ParamError::BadAddress { key: Key::Dgid })
    );
    assert!(g("FE800000000000000002C90200402BD5").is_ok());
}

#[test]
fn decimal_ranges() {
    let cases: &[(&str, u64, u64)] = &[
        ("max_sect", 1, u64::from(MAX_MAX_SECT)),
        ("queue_size", 1, u64::from(MAX_QUEUE_SIZE)),
        ("ch_count", 1, u64::from(MAX_CH_COUNT)),
        ("cmd_sg_entries", 1, 255),
        ("sg_tablesize", 1, u64::from(MAX_SG_TABLESIZE)),
        ("tl_retry_count", 2, 7),
        ("target_can_queue", 1, u64::from(u32::MAX)),
        ("comp_vector", 0, u64::from(u32::MAX)),
        ("max_it_iu_size", 64, u64::from(MAX_IT_IU_SIZE)),
    ];
    for &(name, min, max) in cases {
        let key = Key::from_name(name.as_bytes()).unwrap();
        let at = |v: u64| with(&format!("{name}={v}"));
        assert!(at(min).is_ok(), "{name}={min}");
        assert!(at(max).is_ok(), "{name}={max}");
        if min > 0 && name != "max_it_iu_size" {
            assert_eq!(at(min - 1), Err(ParamError::OutOfRange { key }), "{name}");
        }
        assert_eq!(at(max + 1), Err(ParamError::OutOfRange { key }), "{name}");
        for bad in ["", "-1", "0x10", "1e3", "+1", "12 "] {
            assert_eq!(
                with(&format!("{name}={bad}")),
                Err(ParamError::BadNumber { key }),
                "{name}={bad:?}"
            );
        }
        assert_eq!(
            with(&format!("{name}=99999999999999999999")),
            Err(ParamError::OutOfRange { key }),
            "{name}"
        );
    }
    // max_it_iu_size: 0 means "no cap"; 1..=63 cannot hold a login.
    assert_eq!(
        with("max_it_iu_size=63"),
        Err(ParamError::OutOfRange {
            key: Key::MaxItIuSize
        })
    );
    // max_cmd_per_lun has no upper bound of its own (queue_size bounds it).
    assert_eq!(
        with("max_cmd_per_lun=0"),
        Err(ParamError::OutOfRange {
            key: Key::MaxCmdPerLun
        })
    );
    assert_eq!(
        with("allow_ext_sg=2"),
        Err(ParamError::OutOfRange {
            key: Key::AllowExtSg
        })
    );
    assert_eq!(
        with("allow_ext_sg=yes"),
        Err(ParamError::BadNumber {
            key: Key::AllowExtSg
        })
    );
    assert_eq!(
        with("allow_ext_sg="),
        Err(ParamError::BadNumber {
            key: Key::AllowExtSg
        })
    );
}

#[test]
fn addresses() {
    let d = |v: &str| parse(&format!("id_ext=1,ioc_guid=2,dest={v}"));
    let bad = ParamError::BadAddress { key: Key::Dest };
    for v in [
        "1.2.3.4",
        "1.2.3.4:",
        "1.2.3.4:0",
        "1.2.3.4:65536",
        "1.2.3.4:123456",
        "1.2.3:5",
        "1.2.3.4.5:5",
        "1.2.3.256:5",
        "1.2.3.04:5",
        "1..3.4:5",
        "a.b.c.d:5",
        "1.2.3.4:5x",
        "",
    ] {
        assert_eq!(d(v), Err(bad), "{v:?}");
    }
    assert_eq!(
        d("[fe80::1]:5"),
        Err(ParamError::Ipv6Unsupported { key: Key::Dest })
    );
    assert!(d("0.0.0.0:1").is_ok());
    assert!(d("255.255.255.255:65535").is_ok());
    assert_eq!(
        with("src=1.2.3"),
        Err(ParamError::BadAddress { key: Key::Src })
    );
    assert_eq!(
        with("src=[::1]"),
        Err(ParamError::Ipv6Unsupported { key: Key::Src })
    );
}

#[test]
fn mandatory_sets_and_conflicts() {
    assert_eq!(
        parse("pkey=ffff"),
        Err(ParamError::Missing { key: Key::IdExt })
    );
    assert_eq!(
        parse("max_sect=8"),
        Err(ParamError::Missing { key: Key::IdExt })
    );
    assert_eq!(
        parse("id_ext=1,ioc_guid=2"),
        Err(ParamError::Missing { key: Key::Dest })
    );
    assert_eq!(
        parse("id_ext=1,dest=1.2.3.4:5"),
        Err(ParamError::Missing { key: Key::IocGuid })
    );
    assert_eq!(
        parse("id_ext=1,ioc_guid=2,dgid=fe800000000000000002c90200402bd5"),
        Err(ParamError::Missing { key: Key::Pkey })
    );
    assert_eq!(
        parse("id_ext=1,ioc_guid=2,pkey=ffff,dgid=fe800000000000000002c90200402bd5"),
        Err(ParamError::Missing {
            key: Key::ServiceId
        })
    );
    assert_eq!(
        parse(&format!("{IB},dest=1.2.3.4:5")),
        Err(ParamError::Conflict {
            key: Key::Dgid,
            with: Key::Dest
        })
    );
    assert_eq!(
        with("service_id=1"),
        Err(ParamError::Conflict {
            key: Key::ServiceId,
            with: Key::Dest
        })
    );
    assert_eq!(
        parse(&format!("{IB},src=1.2.3.4")),
        Err(ParamError::Conflict {
            key: Key::Src,
            with: Key::Dest
        })
    );
    assert_eq!(
        with("queue_size=8,max_cmd_per_lun=9"),
        Err(ParamError::Inconsistent {
            key: Key::MaxCmdPerLun,
            with: Key::QueueSize
        })
    );
    assert_eq!(
        with("max_cmd_per_lun=65"),
        Err(ParamError::Inconsistent {
            key: Key::MaxCmdPerLun,
            with: Key::QueueSize
        })
    );
    assert!(with("max_cmd_per_lun=8,queue_size=8").is_ok());
}

#[test]
fn keys_round_trip_their_names() {
    for k in Key::ALL {
        assert_eq!(Key::from_name(k.name().as_bytes()), Some(k));
        assert_eq!(format!("{k}"), k.name());
    }
    let mut names: Vec<_> = Key::ALL.iter().map(|k| k.name()).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), Key::ALL.len());
}

#[test]
fn errors_display_the_key() {
    let e = with("queue_size=0").unwrap_err();
    assert!(e.to_string().contains("queue_size"));
    let e = parse("id_ext=1,ioc_guid=2").unwrap_err();
    assert!(e.to_string().contains("dest"));
}

// ---- timeouts ---------------------------------------------------------------

fn s(n: u64) -> Option<Duration> {
    Some(Duration::from_secs(n))
}

#[test]
fn timeout_rules() {
    assert!(Timeouts::default().validate().is_ok());
    assert_eq!(Timeouts::new(None, None, None), Err(TmoError::AllOff));
    assert_eq!(
        Timeouts::new(s(0), s(15), s(600)),
        Err(TmoError::ReconnectDelayZero)
    );
    assert_eq!(
        Timeouts::new(s(10), s(601), None),
        Err(TmoError::FastIoFailTooLong)
    );
    assert!(Timeouts::new(s(10), s(600), None).is_ok());
    assert_eq!(
        Timeouts::new(s(10), None, s(601)),
        Err(TmoError::DevLossTooLongWithoutFastIoFail)
    );
    assert!(Timeouts::new(s(10), None, s(600)).is_ok());
    assert!(Timeouts::new(s(10), s(15), s(100_000)).is_ok());
    assert_eq!(
        Timeouts::new(s(10), s(15), s(15)),
        Err(TmoError::FastIoFailNotBelowDevLoss)
    );
    assert_eq!(
        Timeouts::new(s(10), s(16), s(15)),
        Err(TmoError::FastIoFailNotBelowDevLoss)
    );
    assert_eq!(
        Timeouts::new(s(10), s(15), s(DEV_LOSS_MAX_SECS)),
        Err(TmoError::DevLossTooLong)
    );
    // One of the three on is enough.
    assert!(Timeouts::new(s(1), None, None).is_ok());
    assert!(Timeouts::new(None, s(1), None).is_ok());
    assert!(Timeouts::new(None, None, s(1)).is_ok());
    // Sub-second values (tests) follow the same rules.
    assert!(
        Timeouts::new(
            Some(Duration::from_millis(20)),
            Some(Duration::from_millis(300)),
            Some(Duration::from_millis(900))
        )
        .is_ok()
    );
}

#[test]
fn timeout_parsing() {
    let t = Timeouts::parse(b"10", b"15", b"600").unwrap();
    assert_eq!(t, Timeouts::default());
    let t = Timeouts::parse(b"off", b"-1", b"60").unwrap();
    assert_eq!(t, Timeouts::new(None, None, s(60)).unwrap());
    assert_eq!(
        Timeouts::parse(b"ten", b"15", b"600"),
        Err(TmoError::BadValue("reconnect_delay"))
    );
    assert_eq!(
        Timeouts::parse(b"10", b"", b"600"),
        Err(TmoError::BadValue("fast_io_fail_tmo"))
    );
    assert_eq!(
        Timeouts::parse(b"10", b"15", b"99999999999"),
        Err(TmoError::BadValue("dev_loss_tmo"))
    );
    assert_eq!(
        Timeouts::parse(b"-0", b"15", b"600"),
        Err(TmoError::ReconnectDelayZero)
    );
    assert_eq!(
        Timeouts::parse(b"off", b"off", b"off"),
        Err(TmoError::AllOff)
    );
    assert!(
        TmoError::BadValue("dev_loss_tmo")
            .to_string()
            .contains("dev_loss_tmo")
    );
}

// ---- properties -------------------------------------------------------------

fn arb_params() -> impl Strategy<Value = TargetParams> {
    let addressing = prop_oneof![
        (any::<[u8; 16]>(), any::<u16>(), any::<u64>()).prop_map(|(dgid, pkey, service_id)| {
            Addressing::IbCm {
                dgid,
                pkey,
                service_id,
            }
        }),
        (
            proptest::option::of(any::<[u8; 4]>()),
            any::<[u8; 4]>(),
            1..=u16::MAX
        )
            .prop_map(|(src, dest, port)| Addressing::RdmaCm { src, dest, port }),
    ];
    (
        (any::<u64>(), any::<u64>(), addressing),
        (
            1..=MAX_MAX_SECT,
            1..=MAX_QUEUE_SIZE,
            proptest::option::of(1..=MAX_CH_COUNT),
            1..=255u8,
            1..=MAX_SG_TABLESIZE,
        ),
        (
            any::<u32>(),
            2..=7u8,
            proptest::option::of(MIN_IT_IU_SIZE..=MAX_IT_IU_SIZE),
            any::<u64>(),
            proptest::option::of(1..=u32::MAX),
            any::<bool>(),
            any::<bool>(),
        ),
        any::<u32>(),
    )
        .prop_map(
            |(
                (id_ext, ioc_guid, addressing),
                (max_sect, queue_size, ch_count, cmd_sg_entries, sg_tablesize),
                (
                    comp_vector,
                    tl_retry_count,
                    max_it_iu_size,
                    initiator_ext,
                    target_can_queue,
                    allow_ext_sg,
                    rev10,
                ),
                lun_pick,
            )| TargetParams {
                id_ext,
                ioc_guid,
                addressing,
                max_sect,
                max_cmd_per_lun: 1 + lun_pick % queue_size,
                queue_size,
                ch_count,
                cmd_sg_entries,
                sg_tablesize,
                comp_vector,
                tl_retry_count,
                max_it_iu_size,
                initiator_ext,
                target_can_queue,
                allow_ext_sg,
                io_class: if rev10 {
                    IoClass::Rev10
                } else {
                    IoClass::Rev16a
                },
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("SRP_PARAM_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(512)
    ))]

    /// The canonical string parses back to the same value.
    #[test]
    fn display_round_trips(p in arb_params()) {
        let text = p.to_string();
        prop_assert_eq!(parse(&text), Ok(p), "{}", text);
    }

    /// Any bytes: a value or an error, never a panic; positions stay in
    /// the string.
    #[test]
    fn total_on_any_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        match parse_add_target(&bytes) {
            Ok(_) => {}
            Err(ParamError::EmptyItem { at }) => prop_assert!(at <= bytes.len()),
            Err(ParamError::NotKeyValue { at, len } | ParamError::UnknownKey { at, len }) => {
                prop_assert!(at + len <= bytes.len());
            }
            Err(_) => {}
        }
    }

    /// Mutating one byte of a valid string gives a value or an error.
    #[test]
    fn total_on_mutations(p in arb_params(), at in any::<usize>(), byte in any::<u8>()) {
        let mut text = p.to_string().into_bytes();
        let i = at % text.len();
        text[i] = byte;
        let _ = parse_add_target(&text);
    }
}
