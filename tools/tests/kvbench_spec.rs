//! Access specification files: the good forms are read as written, and
//! every kind of mistake is refused with its line, field and reason.

use kverbs_tools::bench::spec::{
    AccessPart, AccessSpec, DEFAULT_SUITE, SpecFileError, SpecFormat, builtin_spec, builtin_specs,
    format_bytes, parse_bytes, parse_spec_file,
};

fn toml(text: &str) -> Result<Vec<AccessSpec>, SpecFileError> {
    parse_spec_file(text, SpecFormat::Toml)
}

fn json(text: &str) -> Result<Vec<AccessSpec>, SpecFileError> {
    parse_spec_file(text, SpecFormat::Json)
}

#[test]
fn a_single_part_spec_and_a_mix_are_read_as_written() {
    let specs = toml(
        r#"
[[spec]]
name = "8K OLTP"
size = "8K"
read = 67
random = 100

[[spec]]
name = "two sizes"
part = [
  { size = "4KiB", weight = 90, read = 100, random = 100, align = 512 },
  { size = 65536,  weight = 10, read = 0,   random = 0 },
]
"#,
    )
    .unwrap();
    assert_eq!(
        specs,
        vec![
            AccessSpec::single("8K OLTP", AccessPart::new(8192, 67, 100)),
            AccessSpec {
                name: "two sizes".into(),
                parts: vec![
                    AccessPart {
                        transfer_size: 4096,
                        weight: 90,
                        read_percent: 100,
                        random_percent: 100,
                        alignment: 512,
                    },
                    AccessPart::new(65536, 0, 0).weighted(10),
                ],
            },
        ]
    );
}

#[test]
fn json_reads_the_same_specs_as_toml() {
    let from_json = json(
        r#"{"spec": [
            {"name": "8K OLTP", "size": "8K", "read": 67, "random": 100},
            {"name": "two sizes", "part": [
                {"size": "4KiB", "weight": 90, "read": 100, "random": 100, "align": 512},
                {"size": 65536, "weight": 10, "read": 0, "random": 0}
            ]}
        ]}"#,
    )
    .unwrap();
    let from_toml = toml(
        r#"
[[spec]]
name = "8K OLTP"
size = "8K"
read = 67
random = 100
[[spec]]
name = "two sizes"
[[spec.part]]
size = "4KiB"
weight = 90
read = 100
random = 100
align = 512
[[spec.part]]
size = 65536
weight = 10
read = 0
random = 0
"#,
    )
    .unwrap();
    assert_eq!(from_json, from_toml);
}

/// Asserts that `text` is refused, at `line` (if given), naming `field`
/// (if given), with a message containing `says`.
#[track_caller]
fn refused(
    result: Result<Vec<AccessSpec>, SpecFileError>,
    line: Option<usize>,
    field: Option<&str>,
    says: &str,
) {
    let e = result.expect_err("the file must be refused");
    let shown = e.to_string();
    if let Some(line) = line {
        assert_eq!(e.line, Some(line), "line of: {shown}");
        assert!(shown.contains(&format!("line {line}")), "{shown}");
    }
    if let Some(field) = field {
        assert_eq!(e.field.as_deref(), Some(field), "field of: {shown}");
        assert!(shown.contains(field), "{shown}");
    }
    assert!(
        e.message.contains(says),
        "message of {shown:?} should contain {says:?}"
    );
}

#[test]
fn every_kind_of_bad_value_is_refused_with_line_and_field() {
    let spec = |body: &str| format!("[[spec]]\nname = \"x\"\n{body}\n");
    // Percentages.
    refused(
        toml(&spec("size = 4096\nread = 120\nrandom = 0")),
        Some(4),
        Some("spec[0].read"),
        "120 is over 100 percent",
    );
    refused(
        toml(&spec("size = 4096\nread = 50\nrandom = -1")),
        Some(5),
        Some("spec[0].random"),
        "below 0",
    );
    refused(
        toml(&spec("size = 4096\nread = \"most\"\nrandom = 0")),
        Some(4),
        Some("spec[0].read"),
        "percentage",
    );
    // Sizes.
    refused(
        toml(&spec("size = 1000\nread = 50\nrandom = 0")),
        Some(3),
        Some("spec[0].size"),
        "not a multiple of 512",
    );
    refused(
        toml(&spec("size = 0\nread = 50\nrandom = 0")),
        Some(3),
        Some("spec[0].size"),
        "0 bytes",
    );
    refused(
        toml(&spec("size = \"4Q\"\nread = 50\nrandom = 0")),
        Some(3),
        Some("spec[0].size"),
        "unknown unit",
    );
    refused(
        toml(&spec("size = \"1G\"\nread = 50\nrandom = 0")),
        Some(3),
        Some("spec[0].size"),
        "over the largest",
    );
    refused(
        toml(&spec("size = \"lots\"\nread = 50\nrandom = 0")),
        Some(3),
        Some("spec[0].size"),
        "not a size",
    );
    // Alignment.
    refused(
        toml(&spec("size = 4096\nread = 50\nrandom = 0\nalign = 100")),
        Some(6),
        Some("spec[0].align"),
        "alignment 100",
    );
    // Parts.
    refused(
        toml(
            "[[spec]]\nname = \"x\"\npart = [\n  { size = 4096, read = 50, random = 0 },\n  { size = 4096, read = 50, random = 0, weight = -3 },\n]\n",
        ),
        Some(5),
        Some("spec[0].part[1].weight"),
        "",
    );
}

#[test]
fn unknown_and_missing_fields_are_refused() {
    refused(
        toml("[[spec]]\nname = \"x\"\nsize = 4096\nreed = 50\nrandom = 0\n"),
        Some(4),
        Some("spec[0].reed"),
        "unknown field `reed`",
    );
    refused(
        toml("[[spec]]\nname = \"x\"\nsize = 4096\nrandom = 0\n"),
        None,
        Some("spec[0]"),
        "`read`",
    );
    refused(
        toml("[[spec]]\nsize = 4096\nread = 1\nrandom = 0\n"),
        None,
        None,
        "missing field `name`",
    );
    refused(
        toml("[[spec]]\nname = \"x\"\npart = [{ size = 4096, random = 0 }]\n"),
        None,
        None,
        "missing field `read`",
    );
    refused(
        toml("[[specs]]\nname = \"x\"\n"),
        Some(1),
        None,
        "unknown field `specs`",
    );
    refused(
        json(r#"{"spec": [{"name": "x", "sise": 1}]}"#),
        Some(1),
        Some("spec[0].sise"),
        "unknown field `sise`",
    );
}

#[test]
fn inconsistent_specs_are_refused() {
    refused(
        toml(
            "[[spec]]\nname = \"x\"\nsize = 4096\nread = 1\nrandom = 0\npart = [{ size = 512, read = 1, random = 0 }]\n",
        ),
        None,
        Some("spec[0]"),
        "both inline fields",
    );
    refused(
        toml("[[spec]]\nname = \"x\"\npart = []\n"),
        None,
        Some("spec[0].part"),
        "empty part list",
    );
    refused(
        toml("[[spec]]\nname = \"x\"\npart = [{ size = 512, read = 1, random = 0, weight = 0 }]\n"),
        None,
        Some("spec[0]"),
        "add up to 0",
    );
    refused(
        toml(
            "[[spec]]\nname = \"x\"\nsize = 512\nread = 1\nrandom = 0\n[[spec]]\nname = \" x \"\nsize = 512\nread = 1\nrandom = 0\n",
        ),
        None,
        Some("spec[1].name"),
        "already the name",
    );
    refused(
        toml("[[spec]]\nname = \"  \"\nsize = 512\nread = 1\nrandom = 0\n"),
        None,
        Some("spec[0].name"),
        "empty",
    );
    refused(
        toml("spec = []\n"),
        None,
        Some("spec"),
        "no access specification",
    );
}

#[test]
fn syntax_errors_carry_their_line_and_column() {
    refused(
        toml("[[spec]]\nname = \"x\"\nsize = 4096\nread = = 3\n"),
        Some(4),
        None,
        "",
    );
    let e = json("{\"spec\": [\n  {\"name\": \"x\",}\n]}").unwrap_err();
    assert_eq!(e.line, Some(2));
    assert!(e.column.is_some());
    let e = json("{\"spec\": []} trailing").unwrap_err();
    assert_eq!(e.line, Some(1));
    assert!(e.message.contains("trailing"), "{e}");
}

#[test]
fn the_format_follows_the_extension() {
    use std::path::Path;
    assert_eq!(SpecFormat::from_path(Path::new("a.json")), SpecFormat::Json);
    assert_eq!(SpecFormat::from_path(Path::new("a.JSON")), SpecFormat::Json);
    assert_eq!(SpecFormat::from_path(Path::new("a.toml")), SpecFormat::Toml);
    assert_eq!(SpecFormat::from_path(Path::new("specs")), SpecFormat::Toml);
}

#[test]
fn byte_counts_parse_and_print() {
    for (text, bytes) in [
        ("512", 512u64),
        ("4K", 4096),
        ("4k", 4096),
        ("4KiB", 4096),
        ("4 KB", 4096),
        ("64K", 65536),
        ("1M", 1 << 20),
        ("1MiB", 1 << 20),
        ("2G", 2 << 30),
        ("512B", 512),
    ] {
        assert_eq!(parse_bytes(text), Ok(bytes), "{text}");
    }
    for bad in [
        "",
        "K",
        "4X",
        "-1",
        "99999999999999999999",
        "18446744073709551615G",
    ] {
        assert!(parse_bytes(bad).is_err(), "{bad:?} must be refused");
    }
    assert_eq!(format_bytes(512), "512B");
    assert_eq!(format_bytes(4096), "4K");
    assert_eq!(format_bytes(1 << 20), "1M");
    assert_eq!(format_bytes(3 << 30), "3G");
    assert_eq!(format_bytes(1536), "1536B");
}

#[test]
fn the_built_in_specs_are_valid_and_the_default_suite_exists() {
    let all = builtin_specs();
    assert!(all.len() >= 9);
    let mut ids: Vec<&str> = all.iter().map(|b| b.id).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), all.len(), "ids are unique");
    for b in &all {
        b.spec.check().unwrap_or_else(|e| panic!("{}: {e}", b.id));
    }
    for id in DEFAULT_SUITE {
        assert!(builtin_spec(id).is_some(), "{id}");
    }
    // The classics are what their names say.
    let r = builtin_spec("4k-random-read").unwrap();
    assert_eq!(r.parts, vec![AccessPart::new(4096, 100, 100)]);
    let w = builtin_spec("64K-SEQ-WRITE").unwrap();
    assert_eq!(w.parts, vec![AccessPart::new(65536, 0, 0)]);
    let m = builtin_spec("4k-random-70-30").unwrap();
    assert_eq!(m.parts[0].read_percent, 70);
    assert!(builtin_spec("512b-seq-read").is_some());
    assert!(builtin_spec("1m-seq-read").is_some());
    assert!(builtin_spec("1m-seq-write").is_some());
    let fs = builtin_spec("file-server").unwrap();
    assert_eq!(fs.parts.iter().map(|p| p.weight).sum::<u32>(), 100);
    assert!(builtin_spec("no-such-spec").is_none());
}
