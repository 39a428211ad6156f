//! Text segment tests: a login exchange's keys in and out, round trips of
//! raw pairs and typed parameters, total parsing, and the error census.

use proptest::prelude::*;

use super::*;
use crate::wire::test_util::fuzz_seeds;

/// The operational-stage keys an iSER initiator offers LIO, and what LIO
/// answers (values as Linux `isert` + LIO negotiate them), byte for byte.
#[test]
fn login_exchange_keys_golden_bytes() {
    let mut buf = [0u8; 512];
    let mut w = TextWriter::new(&mut buf);
    let offer = [
        Param::InitiatorName("iqn.2024-01.invalid.kverbs:host"),
        Param::TargetName("iqn.2003-01.org.linux-iscsi.t1:sn.1"),
        Param::SessionType(SessionType::Normal),
        Param::HeaderDigest(ValueList::new("None").unwrap()),
        Param::DataDigest(ValueList::new("None").unwrap()),
        Param::RdmaExtensions(true),
        Param::InitiatorRecvDataSegmentLength(262_144),
        Param::TargetRecvDataSegmentLength(8192),
        Param::ImmediateData(true),
        Param::InitialR2T(false),
        Param::MaxBurstLength(262_144),
        Param::FirstBurstLength(65_536),
        Param::ErrorRecoveryLevel(0),
        Param::MaxConnections(1),
        Param::DefaultTime2Wait(2),
        Param::DefaultTime2Retain(0),
        Param::MaxOutstandingR2T(1),
        Param::MaxOutstandingUnexpectedPdus(0),
    ];
    for param in &offer {
        w.push_param(param).unwrap();
    }
    let len = w.finish();
    let expected: &[u8] = b"InitiatorName=iqn.2024-01.invalid.kverbs:host\0\
TargetName=iqn.2003-01.org.linux-iscsi.t1:sn.1\0\
SessionType=Normal\0\
HeaderDigest=None\0\
DataDigest=None\0\
RDMAExtensions=Yes\0\
InitiatorRecvDataSegmentLength=262144\0\
TargetRecvDataSegmentLength=8192\0\
ImmediateData=Yes\0\
InitialR2T=No\0\
MaxBurstLength=262144\0\
FirstBurstLength=65536\0\
ErrorRecoveryLevel=0\0\
MaxConnections=1\0\
DefaultTime2Wait=2\0\
DefaultTime2Retain=0\0\
MaxOutstandingR2T=1\0\
MaxOutstandingUnexpectedPDUs=0\0";
    assert_eq!(&buf[..len], expected);
    let parsed = TextData::parse(&buf[..len], &Limits::NEGOTIATION).unwrap();
    assert_eq!(parsed.len(), offer.len());
    let back: Vec<_> = parsed.entries().map(|e| e.unwrap()).collect();
    assert_eq!(
        back,
        offer.iter().map(|p| Entry::Param(*p)).collect::<Vec<_>>()
    );

    // LIO's answer: values, a NotUnderstood for the key it does not know,
    // and its own declarations.
    let answer: &[u8] = b"TargetAlias=LIO Target\0\
TargetPortalGroupTag=1\0\
HeaderDigest=None\0\
DataDigest=None\0\
RDMAExtensions=Yes\0\
InitiatorRecvDataSegmentLength=262144\0\
TargetRecvDataSegmentLength=8192\0\
ImmediateData=Yes\0\
InitialR2T=No\0\
MaxBurstLength=262144\0\
FirstBurstLength=65536\0\
ErrorRecoveryLevel=0\0\
MaxConnections=1\0\
DefaultTime2Wait=2\0\
DefaultTime2Retain=0\0\
MaxOutstandingR2T=1\0\
MaxOutstandingUnexpectedPDUs=NotUnderstood\0\
X-com.example.Feature=On\0";
    let parsed = TextData::parse(answer, &Limits::NEGOTIATION).unwrap();
    let entries: Vec<_> = parsed.entries().map(|e| e.unwrap()).collect();
    assert_eq!(entries[0], Entry::Param(Param::TargetAlias("LIO Target")));
    assert_eq!(entries[1], Entry::Param(Param::TargetPortalGroupTag(1)));
    assert_eq!(
        entries[16],
        Entry::Special(
            KnownKey::MaxOutstandingUnexpectedPdus,
            Special::NotUnderstood
        )
    );
    assert_eq!(
        entries[17],
        Entry::Unknown(Pair {
            key: "X-com.example.Feature",
            value: "On"
        })
    );
    assert_eq!(parsed.get("ImmediateData"), Some("Yes"));
    assert_eq!(parsed.get("Nope"), None);

    // The initiator answers the unknown key.
    let mut reply = [0u8; 64];
    let mut w = TextWriter::new(&mut reply);
    w.push_special("X-com.example.Feature", Special::NotUnderstood)
        .unwrap();
    assert_eq!(w.as_bytes(), b"X-com.example.Feature=NotUnderstood\0");
}

#[test]
fn lists_and_names() {
    let digests = ValueList::new("CRC32C,None").unwrap();
    assert_eq!(digests.iter().collect::<Vec<_>>(), ["CRC32C", "None"]);
    assert_eq!(
        digests
            .iter()
            .filter_map(Digest::from_name)
            .collect::<Vec<_>>(),
        [Digest::Crc32c, Digest::None]
    );
    assert!(digests.contains("None"));
    let auth = ValueList::new("CHAP,None,X-vendor").unwrap();
    assert_eq!(
        auth.iter().map(AuthMethod::from_name).collect::<Vec<_>>(),
        [Some(AuthMethod::Chap), Some(AuthMethod::None), None]
    );
    for m in ["SRP", "KRB5", "SPKM1", "SPKM2"] {
        assert!(AuthMethod::from_name(m).is_some());
    }
    assert_eq!(ValueList::new(""), Err(Error::EmptyValue));
    assert_eq!(ValueList::new("None,"), Err(Error::EmptyValue));
    assert_eq!(ValueList::new("No ne"), Err(Error::InvalidValue));
    assert_eq!(ValueList::new(&"A".repeat(256)), Err(Error::ValueTooLong));
    let name = "iqn.".to_string() + &"x".repeat(219);
    assert_eq!(
        Param::parse(KnownKey::TargetName, &name),
        Ok(Param::TargetName(&name))
    );
    let long = name.clone() + "x";
    let data = format!("TargetName={long}\0");
    assert_eq!(
        TextData::parse(data.as_bytes(), &Limits::NEGOTIATION),
        Err(Error::ValueTooLong)
    );
    assert_eq!(
        Param::parse(KnownKey::TargetName, &long),
        Err(Error::ValueTooLong)
    );
    assert_eq!(
        Param::parse(KnownKey::InitiatorName, ""),
        Err(Error::EmptyValue)
    );
    assert_eq!(
        Param::parse(KnownKey::SessionType, "Discovery"),
        Ok(Param::SessionType(SessionType::Discovery))
    );
    assert_eq!(
        Param::parse(KnownKey::SessionType, "normal"),
        Err(Error::UnknownValue)
    );
}

#[test]
fn numbers() {
    let p = |key, v| Param::parse(key, v);
    assert_eq!(
        p(KnownKey::MaxBurstLength, "512"),
        Ok(Param::MaxBurstLength(512))
    );
    assert_eq!(
        p(KnownKey::MaxBurstLength, "0x200"),
        Ok(Param::MaxBurstLength(512))
    );
    assert_eq!(
        p(KnownKey::MaxBurstLength, "0X00FFFFFF"),
        Ok(Param::MaxBurstLength(0xFF_FFFF))
    );
    assert_eq!(p(KnownKey::MaxBurstLength, "511"), Err(Error::OutOfRange));
    assert_eq!(
        p(KnownKey::MaxBurstLength, "16777216"),
        Err(Error::OutOfRange)
    );
    assert_eq!(
        p(KnownKey::MaxBurstLength, "0512"),
        Err(Error::BadNumber),
        "leading zero"
    );
    assert_eq!(p(KnownKey::MaxBurstLength, ""), Err(Error::BadNumber));
    assert_eq!(p(KnownKey::MaxBurstLength, "0x"), Err(Error::BadNumber));
    assert_eq!(p(KnownKey::MaxBurstLength, "+512"), Err(Error::BadNumber));
    assert_eq!(
        p(KnownKey::MaxBurstLength, "512~1024"),
        Err(Error::BadNumber)
    );
    assert_eq!(
        p(KnownKey::MaxBurstLength, "99999999999999999999"),
        Err(Error::BadNumber)
    );
    assert_eq!(
        p(KnownKey::ErrorRecoveryLevel, "0"),
        Ok(Param::ErrorRecoveryLevel(0))
    );
    assert_eq!(p(KnownKey::ErrorRecoveryLevel, "3"), Err(Error::OutOfRange));
    assert_eq!(
        p(KnownKey::DefaultTime2Wait, "3600"),
        Ok(Param::DefaultTime2Wait(3600))
    );
    assert_eq!(
        p(KnownKey::DefaultTime2Retain, "3601"),
        Err(Error::OutOfRange)
    );
    assert_eq!(p(KnownKey::MaxConnections, "0"), Err(Error::OutOfRange));
    assert_eq!(
        p(KnownKey::MaxOutstandingR2T, "65535"),
        Ok(Param::MaxOutstandingR2T(65535))
    );
    assert_eq!(
        p(KnownKey::TargetPortalGroupTag, "65536"),
        Err(Error::OutOfRange)
    );
    let moup = KnownKey::MaxOutstandingUnexpectedPdus;
    assert_eq!(p(moup, "0"), Ok(Param::MaxOutstandingUnexpectedPdus(0)));
    assert_eq!(p(moup, "1"), Err(Error::OutOfRange));
    assert_eq!(p(moup, "2"), Ok(Param::MaxOutstandingUnexpectedPdus(2)));
    assert_eq!(
        p(moup, "4294967295"),
        Ok(Param::MaxOutstandingUnexpectedPdus(u32::MAX))
    );
    assert_eq!(p(moup, "4294967296"), Err(Error::OutOfRange));
    assert_eq!(p(KnownKey::ImmediateData, "yes"), Err(Error::BadBoolean));
    assert_eq!(
        format_decimal(u64::MAX, &mut [0; 20]),
        "18446744073709551615"
    );
    assert_eq!(format_decimal(0, &mut [0; 20]), "0");
}

#[test]
fn malformed_segments() {
    fn parse(b: &[u8]) -> Result<TextData<'_>> {
        TextData::parse(b, &Limits::NEGOTIATION)
    }
    assert_eq!(
        parse(b""),
        Ok(TextData {
            data: b"",
            pairs: 0
        })
    );
    assert_eq!(parse(b"A=1"), Err(Error::MissingNul));
    assert_eq!(parse(b"A1\0"), Err(Error::MissingEquals));
    assert_eq!(parse(b"A=1\0\0"), Err(Error::MissingEquals), "empty pair");
    assert_eq!(parse(b"=1\0"), Err(Error::EmptyKey));
    assert_eq!(parse(b"a=1\0"), Err(Error::InvalidKey), "lower-case start");
    assert_eq!(parse(b"A b=1\0"), Err(Error::InvalidKey));
    let long_key = format!("{}=1\0", "K".repeat(64));
    assert_eq!(parse(long_key.as_bytes()), Err(Error::KeyTooLong));
    let ok_key = format!("{}=1\0", "K".repeat(63));
    assert!(parse(ok_key.as_bytes()).is_ok());
    let long_value = format!("A={}\0", "v".repeat(256));
    assert_eq!(parse(long_value.as_bytes()), Err(Error::ValueTooLong));
    let chap = format!("CHAP_C=0x{}\0", "ab".repeat(1024));
    assert!(
        parse(chap.as_bytes()).is_ok(),
        "CHAP challenges may be long"
    );
    assert_eq!(parse(b"A=\xff\0"), Err(Error::InvalidValue));
    assert_eq!(parse(b"A=x\x01y\0"), Err(Error::InvalidValue));
    assert_eq!(parse(b"A=1\0B=2\0A=3\0"), Err(Error::DuplicateKey));
    assert_eq!(
        parse(b"A=x=y\0").map(|t| t.pairs().next()),
        Ok(Some(Pair {
            key: "A",
            value: "x=y"
        })),
        "a value runs to the NUL, '=' included"
    );
    assert_eq!(parse(b"A=\0").map(|t| t.get("A")), Ok(Some("")));
    let too_long = vec![b'A'; 8193];
    assert_eq!(parse(&too_long), Err(Error::TooLong));
    let tight = Limits {
        max_len: 100,
        max_pairs: 2,
        repeats: Repeats::Reject,
    };
    assert_eq!(
        TextData::parse(b"A=1\0B=2\0C=3\0", &tight),
        Err(Error::TooManyPairs)
    );
}

#[test]
fn send_targets_repeats() {
    let listing =
        b"TargetName=iqn.a\0TargetAddress=10.0.0.1:3260,1\0TargetAddress=10.0.0.2:3260,1\0\
TargetName=iqn.b\0TargetAddress=10.0.0.1:3260,1\0";
    assert_eq!(
        TextData::parse(listing, &Limits::NEGOTIATION),
        Err(Error::DuplicateKey)
    );
    let parsed = TextData::parse(listing, &Limits::SEND_TARGETS).unwrap();
    assert_eq!(parsed.len(), 5);
    assert_eq!(parsed.pairs().filter(|p| p.key == "TargetName").count(), 2);
    // Other keys still may not repeat.
    assert_eq!(
        TextData::parse(b"TargetName=a\0X=1\0X=2\0", &Limits::SEND_TARGETS),
        Err(Error::DuplicateKey)
    );
    let mut buf = [0u8; 128];
    let mut w = TextWriter::with_repeats(&mut buf, Repeats::SendTargets);
    w.push("TargetName", "iqn.a").unwrap();
    w.push("TargetName", "iqn.b").unwrap();
    assert_eq!(w.push("SendTargets", "All"), Ok(()));
    assert_eq!(w.push("SendTargets", "All"), Err(Error::DuplicateKey));
}

#[test]
fn distinct_key_limit() {
    let mut data = String::new();
    for i in 0..=MAX_CHECKED_KEYS {
        data.push_str(&format!("K{i}=1\0"));
    }
    let limits = Limits {
        max_len: 65536,
        max_pairs: 4096,
        repeats: Repeats::Reject,
    };
    assert_eq!(
        TextData::parse(data.as_bytes(), &limits),
        Err(Error::TooManyPairs)
    );
}

#[test]
fn writer_checks_and_is_atomic() {
    let mut buf = [0u8; 16];
    let mut w = TextWriter::new(&mut buf);
    assert!(w.is_empty());
    w.push("A", "1").unwrap();
    assert_eq!(w.push("A", "2"), Err(Error::DuplicateKey));
    assert_eq!(w.push("a", "2"), Err(Error::InvalidKey));
    assert_eq!(w.push("B", "\u{7}"), Err(Error::InvalidValue));
    assert_eq!(w.push("B", "0123456789ab"), Err(Error::BufferTooSmall));
    assert_eq!(w.len(), 4);
    w.push("B", "012345678").unwrap();
    assert_eq!(w.finish(), 16);
    assert_eq!(&buf, b"A=1\0B=012345678\0");
}

fn key() -> impl Strategy<Value = String> {
    "[A-Z][A-Za-z0-9.+@_#-]{0,62}"
}

fn value() -> impl Strategy<Value = String> {
    // Printable ASCII and some non-ASCII UTF-8, no control characters.
    "[ -~\u{a0}-\u{17f}]{0,40}"
}

fn param() -> impl Strategy<Value = (KnownKey, String)> {
    prop::sample::select(KnownKey::ALL).prop_flat_map(|key| {
        let value: BoxedStrategy<String> = match key.kind() {
            ValueKind::Boolean => prop_oneof![Just("Yes".into()), Just("No".into())].boxed(),
            ValueKind::Number { min, max } => (min..=max).prop_map(|n| n.to_string()).boxed(),
            ValueKind::NumberOrZero { min, max } => prop_oneof![
                Just("0".to_string()),
                (min..=max).prop_map(|n| n.to_string())
            ]
            .boxed(),
            ValueKind::List => "[A-Za-z0-9]{1,8}(,[A-Za-z0-9]{1,8}){0,4}".boxed(),
            ValueKind::Name => "[a-z0-9.:-]{1,223}".boxed(),
            ValueKind::Text => "[ -~]{1,255}".boxed(),
            ValueKind::SessionType => {
                prop_oneof![Just("Discovery".into()), Just("Normal".into())].boxed()
            }
        };
        (Just(key), value)
    })
}

proptest! {
    #[test]
    fn raw_pairs_round_trip(
        pairs in prop::collection::btree_map(key(), value(), 0..12),
    ) {
        let mut buf = vec![0u8; 8192];
        let mut w = TextWriter::new(&mut buf);
        for (k, v) in &pairs {
            w.push(k, v).unwrap();
        }
        let len = w.finish();
        let parsed = TextData::parse(&buf[..len], &Limits::NEGOTIATION).unwrap();
        let back: Vec<_> = parsed.pairs().map(|p| (p.key.to_string(), p.value.to_string())).collect();
        let expected: Vec<_> = pairs.into_iter().collect();
        prop_assert_eq!(back, expected);
    }

    #[test]
    fn typed_params_round_trip(params in prop::collection::vec(param(), 1..10)) {
        let mut buf = vec![0u8; 8192];
        let mut w = TextWriter::new(&mut buf);
        let mut sent = Vec::new();
        for (key, value) in &params {
            let param = Param::parse(*key, value).unwrap();
            prop_assert_eq!(param.key(), *key);
            match w.push_param(&param) {
                Ok(()) => sent.push(param),
                Err(Error::DuplicateKey) => {}
                Err(e) => prop_assert!(false, "push failed: {e:?}"),
            }
        }
        let len = w.finish();
        let parsed = TextData::parse(&buf[..len], &Limits::NEGOTIATION).unwrap();
        let back: Vec<_> = parsed.entries().map(|e| e.unwrap()).collect();
        prop_assert_eq!(back, sent.into_iter().map(Entry::Param).collect::<Vec<_>>());
    }

    #[test]
    fn parse_is_total(bytes in prop::collection::vec(any::<u8>(), 0..600)) {
        if let Ok(text) = TextData::parse(&bytes, &Limits::NEGOTIATION) {
            prop_assert_eq!(text.pairs().count(), text.len());
            for entry in text.entries() {
                let _ = entry;
            }
        }
        let _ = TextData::parse(&bytes, &Limits::SEND_TARGETS);
    }

    #[test]
    fn parse_is_total_on_near_valid_text(
        pairs in prop::collection::btree_map(key(), value(), 1..8),
        flips in prop::collection::vec((any::<usize>(), prop::sample::select(vec![0u8, b'=', b'a', 0xff, 0x01])), 1..4),
    ) {
        let mut bytes = Vec::new();
        for (k, v) in &pairs {
            bytes.extend_from_slice(k.as_bytes());
            bytes.push(b'=');
            bytes.extend_from_slice(v.as_bytes());
            bytes.push(0);
        }
        let len = bytes.len();
        for (at, b) in flips {
            bytes[at % len] = b;
        }
        if let Ok(text) = TextData::parse(&bytes, &Limits::NEGOTIATION) {
            for entry in text.entries() {
                let _ = entry;
            }
        }
    }
}

/// Every error variant, each reached through the public API; the match is
/// exhaustive so a new variant must be added here.
#[test]
fn every_error_variant_is_reachable() {
    fn census(e: Error) -> usize {
        match e {
            Error::MissingNul => 0,
            Error::MissingEquals => 1,
            Error::EmptyKey => 2,
            Error::KeyTooLong => 3,
            Error::InvalidKey => 4,
            Error::ValueTooLong => 5,
            Error::InvalidValue => 6,
            Error::DuplicateKey => 7,
            Error::TooLong => 8,
            Error::TooManyPairs => 9,
            Error::BadBoolean => 10,
            Error::BadNumber => 11,
            Error::OutOfRange => 12,
            Error::EmptyValue => 13,
            Error::UnknownValue => 14,
            Error::BufferTooSmall => 15,
        }
    }
    const VARIANTS: usize = 16;
    let parse = |b: &[u8]| TextData::parse(b, &Limits::NEGOTIATION).unwrap_err();
    let entry =
        |k: &'static str, v: &'static str| Entry::parse(Pair { key: k, value: v }).unwrap_err();
    let long_key = format!("{}=1\0", "K".repeat(64));
    let long_value = format!("A={}\0", "v".repeat(256));
    let tight = Limits {
        max_len: 8,
        max_pairs: 1,
        repeats: Repeats::Reject,
    };
    let mut small = [0u8; 3];
    let errors = [
        parse(b"A=1"),
        parse(b"A\0"),
        parse(b"=A\0"),
        parse(long_key.as_bytes()),
        parse(b"1=A\0"),
        parse(long_value.as_bytes()),
        parse(b"A=\x7f\0"),
        parse(b"A=1\0A=1\0"),
        TextData::parse(b"A=1\0B=2\0C", &tight).unwrap_err(),
        TextData::parse(b"A=1\0B=2\0", &tight).unwrap_err(),
        entry("ImmediateData", "True"),
        entry("MaxBurstLength", "1e6"),
        entry("FirstBurstLength", "100"),
        entry("AuthMethod", "CHAP,,None"),
        entry("SessionType", "Other"),
        TextWriter::new(&mut small).push("A", "1").unwrap_err(),
    ];
    let mut seen = [false; VARIANTS];
    for (i, e) in errors.iter().enumerate() {
        assert_eq!(census(*e), i, "error #{i} is {e:?}");
        seen[census(*e)] = true;
        assert!(!format!("{e}").is_empty());
    }
    assert!(seen.iter().all(|&s| s));
}

#[test]
fn known_key_names_round_trip() {
    for &key in KnownKey::ALL {
        assert_eq!(KnownKey::from_name(key.name()), Some(key));
    }
    assert_eq!(KnownKey::ALL.len(), 22);
    assert_eq!(KnownKey::from_name("rdmaextensions"), None);
    for s in [Special::NotUnderstood, Special::Irrelevant, Special::Reject] {
        assert_eq!(Special::from_value(s.as_str()), Some(s));
    }
}

/// Every committed `iscsi_text` seed is a valid segment under the limits
/// its first byte selects, and each pair has a meaning.
#[test]
fn fuzz_seeds_are_valid_text() {
    for (name, input) in fuzz_seeds("iscsi_text") {
        let (&mode, data) = input.split_first().unwrap();
        let limits = if mode & 1 == 0 {
            Limits::NEGOTIATION
        } else {
            Limits::SEND_TARGETS
        };
        let text = TextData::parse(data, &limits).unwrap_or_else(|e| panic!("{name}: {e}"));
        for entry in text.entries() {
            entry.unwrap_or_else(|e| panic!("{name}: {e}"));
        }
    }
}
