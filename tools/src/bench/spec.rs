//! Access specifications: what kind of I/O a run issues.
//!
//! An [`AccessSpec`] is IOmeter's "access specification": a named, weighted
//! mix of [`AccessPart`]s, each a transfer size with a read percentage, a
//! random percentage and an alignment. Every I/O picks one part by weight,
//! then reads or writes by the part's read percentage, then goes to a random
//! offset or continues where the previous I/O to that disk ended by the
//! part's random percentage.
//!
//! Specs come from the built-in set ([`builtin_specs`]: the classic 4K
//! random, 64K sequential, 512B, 1M, OLTP, file and web server patterns) or
//! from a TOML or JSON file ([`parse_spec_file`]). A file is checked field by
//! field while it is read, so every mistake is reported with its line,
//! column and field path (`spec[1].part[0].read`), and a file with any
//! mistake is refused as a whole.
//!
//! ```toml
//! [[spec]]                 # a single-part spec: the part's fields inline
//! name = "8K OLTP"
//! size = "8K"              # bytes, or with K/KiB/M/MiB (powers of two)
//! read = 67                # percent
//! random = 100             # percent
//! align = "8K"             # optional; default: the transfer size
//!
//! [[spec]]                 # a weighted mix
//! name = "two sizes"
//! part = [
//!   { size = "4K",  weight = 90, read = 100, random = 100 },
//!   { size = "64K", weight = 10, read = 0,   random = 0 },
//! ]
//! ```

use std::fmt;
use std::path::Path;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize};

/// The unit of transfer sizes and alignments: every I/O is a whole number
/// of 512-byte sectors, as SCSI block commands address them.
pub const SECTOR: u32 = 512;

/// Largest transfer size a spec may ask for (the adapter's default maximum
/// transfer, 1 MiB, times 16: larger specs are refused by the backend).
pub const MAX_TRANSFER: u32 = 16 << 20;

/// One part of an access specification.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct AccessPart {
    /// Bytes per I/O (a multiple of [`SECTOR`]).
    pub transfer_size: u32,
    /// Relative weight among the spec's parts (IOmeter's "% of access
    /// specification"; the weights need not add up to 100).
    pub weight: u32,
    /// Percent of I/Os that read (the rest write).
    pub read_percent: u8,
    /// Percent of I/Os at a random offset (the rest continue sequentially).
    pub random_percent: u8,
    /// Offsets are multiples of this many bytes (a multiple of [`SECTOR`]).
    pub alignment: u32,
}

impl AccessPart {
    /// A part of weight 100 aligned on its transfer size.
    #[must_use]
    pub const fn new(transfer_size: u32, read_percent: u8, random_percent: u8) -> Self {
        Self {
            transfer_size,
            weight: 100,
            read_percent,
            random_percent,
            alignment: transfer_size,
        }
    }

    /// The same part with weight `weight`.
    #[must_use]
    pub const fn weighted(mut self, weight: u32) -> Self {
        self.weight = weight;
        self
    }

    /// Checks the invariants a file parse enforces (for specs built in code).
    ///
    /// # Errors
    /// A message naming the bad field.
    pub fn check(&self) -> Result<(), String> {
        check_transfer_size(u64::from(self.transfer_size))?;
        check_alignment(u64::from(self.alignment))?;
        if self.read_percent > 100 {
            return Err(format!("read = {} is over 100 percent", self.read_percent));
        }
        if self.random_percent > 100 {
            return Err(format!(
                "random = {} is over 100 percent",
                self.random_percent
            ));
        }
        Ok(())
    }
}

/// A named access specification: a weighted mix of parts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AccessSpec {
    /// The name results are reported under.
    pub name: String,
    /// The parts (at least one, with a non-zero total weight).
    pub parts: Vec<AccessPart>,
}

impl AccessSpec {
    /// A single-part spec.
    #[must_use]
    pub fn single(name: &str, part: AccessPart) -> Self {
        Self {
            name: name.to_owned(),
            parts: vec![part],
        }
    }

    /// The largest transfer size of any part.
    #[must_use]
    pub fn max_transfer(&self) -> u32 {
        self.parts
            .iter()
            .map(|p| p.transfer_size)
            .max()
            .unwrap_or(0)
    }

    /// The distinct transfer sizes, ascending.
    #[must_use]
    pub fn transfer_sizes(&self) -> Vec<u32> {
        let mut sizes: Vec<u32> = self.parts.iter().map(|p| p.transfer_size).collect();
        sizes.sort_unstable();
        sizes.dedup();
        sizes
    }

    /// True if some part reads.
    #[must_use]
    pub fn reads(&self) -> bool {
        self.parts
            .iter()
            .any(|p| p.weight > 0 && p.read_percent > 0)
    }

    /// True if some part writes.
    #[must_use]
    pub fn writes(&self) -> bool {
        self.parts
            .iter()
            .any(|p| p.weight > 0 && p.read_percent < 100)
    }

    /// Checks every part and the total weight.
    ///
    /// # Errors
    /// A message naming the part and field.
    pub fn check(&self) -> Result<(), String> {
        if self.name.trim().is_empty() {
            return Err("the name is empty".into());
        }
        if self.parts.is_empty() {
            return Err(format!("spec \"{}\" has no parts", self.name));
        }
        for (i, part) in self.parts.iter().enumerate() {
            part.check()
                .map_err(|e| format!("spec \"{}\" part[{i}]: {e}", self.name))?;
        }
        if self.parts.iter().map(|p| u64::from(p.weight)).sum::<u64>() == 0 {
            return Err(format!(
                "spec \"{}\": the weights of its parts add up to 0",
                self.name
            ));
        }
        Ok(())
    }
}

fn check_transfer_size(bytes: u64) -> Result<u32, String> {
    if bytes == 0 {
        return Err("a transfer size of 0 bytes".into());
    }
    if bytes % u64::from(SECTOR) != 0 {
        return Err(format!(
            "transfer size {bytes} is not a multiple of {SECTOR} bytes (one sector)"
        ));
    }
    if bytes > u64::from(MAX_TRANSFER) {
        return Err(format!(
            "transfer size {bytes} is over the largest, {MAX_TRANSFER} bytes"
        ));
    }
    u32::try_from(bytes).map_err(|_| format!("transfer size {bytes} is too large"))
}

fn check_alignment(bytes: u64) -> Result<u32, String> {
    if bytes == 0 || bytes % u64::from(SECTOR) != 0 {
        return Err(format!(
            "alignment {bytes} is not a non-zero multiple of {SECTOR} bytes (one sector)"
        ));
    }
    u32::try_from(bytes).map_err(|_| format!("alignment {bytes} is too large"))
}

/// Parses a byte count: a plain number, or a number with a binary suffix
/// (`K`, `KiB`, `KB`, `M`, `MiB`, `MB`, `G`, `GiB`, `GB`, case-insensitive;
/// all powers of two, as IOmeter's sizes are).
///
/// # Errors
/// A message saying what is wrong.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, suffix) = t.split_at(split);
    if digits.is_empty() {
        return Err(format!(
            "\"{text}\" is not a size (expected e.g. 4096, 4K, 1MiB)"
        ));
    }
    let value: u64 = digits
        .parse()
        .map_err(|_| format!("\"{text}\": the number is too large"))?;
    let shift = match suffix.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        other => {
            return Err(format!(
                "\"{text}\": unknown unit \"{other}\" (use K, KiB, M, MiB, G or GiB)"
            ));
        }
    };
    value
        .checked_mul(1u64 << shift)
        .ok_or_else(|| format!("\"{text}\" is too large"))
}

/// Formats a byte count the way spec names show it (512B, 4K, 64K, 1M).
#[must_use]
pub fn format_bytes(bytes: u64) -> String {
    if bytes >= 1 << 30 && bytes % (1 << 30) == 0 {
        format!("{}G", bytes >> 30)
    } else if bytes >= 1 << 20 && bytes % (1 << 20) == 0 {
        format!("{}M", bytes >> 20)
    } else if bytes >= 1 << 10 && bytes % (1 << 10) == 0 {
        format!("{}K", bytes >> 10)
    } else {
        format!("{bytes}B")
    }
}

/// A byte count in a spec file: an integer or a string with a unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ByteCount(u64);

impl<'de> Deserialize<'de> for ByteCount {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = ByteCount;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a byte count: an integer, or a string such as \"4K\" or \"1MiB\"")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<ByteCount, E> {
                Ok(ByteCount(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<ByteCount, E> {
                u64::try_from(v)
                    .map(ByteCount)
                    .map_err(|_| E::custom(format!("a size cannot be negative ({v})")))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ByteCount, E> {
                parse_bytes(v).map(ByteCount).map_err(E::custom)
            }
        }
        deserializer.deserialize_any(V)
    }
}

/// A transfer size in a spec file (checked as it is read).
#[derive(Debug, Clone, Copy)]
struct TransferSize(u32);

impl<'de> Deserialize<'de> for TransferSize {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let ByteCount(bytes) = ByteCount::deserialize(deserializer)?;
        check_transfer_size(bytes)
            .map(TransferSize)
            .map_err(de::Error::custom)
    }
}

/// An alignment in a spec file (checked as it is read).
#[derive(Debug, Clone, Copy)]
struct Alignment(u32);

impl<'de> Deserialize<'de> for Alignment {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let ByteCount(bytes) = ByteCount::deserialize(deserializer)?;
        check_alignment(bytes)
            .map(Alignment)
            .map_err(de::Error::custom)
    }
}

/// A percentage in a spec file: an integer 0..=100.
#[derive(Debug, Clone, Copy)]
struct Percent(u8);

impl<'de> Deserialize<'de> for Percent {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Percent;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a whole percentage from 0 to 100")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Percent, E> {
                u8::try_from(v)
                    .ok()
                    .filter(|&p| p <= 100)
                    .map(Percent)
                    .ok_or_else(|| E::custom(format!("{v} is over 100 percent")))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Percent, E> {
                match u64::try_from(v) {
                    Ok(v) => self.visit_u64(v),
                    Err(_) => Err(E::custom(format!("{v} is below 0 percent"))),
                }
            }
        }
        deserializer.deserialize_any(V)
    }
}

/// One part as written in a file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPart {
    size: TransferSize,
    #[serde(default)]
    weight: Option<u32>,
    read: Percent,
    random: Percent,
    #[serde(default)]
    align: Option<Alignment>,
}

impl RawPart {
    fn into_part(self) -> AccessPart {
        AccessPart {
            transfer_size: self.size.0,
            weight: self.weight.unwrap_or(100),
            read_percent: self.read.0,
            random_percent: self.random.0,
            alignment: self.align.map_or(self.size.0, |a| a.0),
        }
    }
}

/// One spec as written in a file: either the fields of a single part, or a
/// list of parts.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSpec {
    name: String,
    #[serde(default)]
    size: Option<TransferSize>,
    #[serde(default)]
    read: Option<Percent>,
    #[serde(default)]
    random: Option<Percent>,
    #[serde(default)]
    align: Option<Alignment>,
    #[serde(default)]
    part: Option<Vec<RawPart>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    spec: Vec<RawSpec>,
}

/// The format of a spec file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecFormat {
    /// TOML (`[[spec]]` tables).
    Toml,
    /// JSON (`{"spec": [...]}`).
    Json,
}

impl SpecFormat {
    /// The format a file name implies (`.json` is JSON, anything else
    /// TOML).
    #[must_use]
    pub fn from_path(path: &Path) -> Self {
        match path.extension().and_then(|e| e.to_str()) {
            Some(e) if e.eq_ignore_ascii_case("json") => Self::Json,
            _ => Self::Toml,
        }
    }
}

/// A spec file that could not be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecFileError {
    /// 1-based line of the mistake, when known.
    pub line: Option<usize>,
    /// 1-based column, when known.
    pub column: Option<usize>,
    /// The field path (`spec[1].part[0].read`), when known.
    pub field: Option<String>,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for SpecFileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.line, self.column) {
            (Some(l), Some(c)) => write!(f, "line {l}, column {c}: ")?,
            (Some(l), None) => write!(f, "line {l}: ")?,
            _ => {}
        }
        if let Some(field) = &self.field {
            write!(f, "{field}: ")?;
        }
        f.write_str(&self.message)
    }
}

impl std::error::Error for SpecFileError {}

/// 1-based line and column of byte `offset` in `text`.
fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = text.get(..offset.min(text.len())).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let column = before.rfind('\n').map_or(before.chars().count(), |nl| {
        before.get(nl + 1..).map_or(0, |s| s.chars().count())
    }) + 1;
    (line, column)
}

fn path_field(path: &serde_path_to_error::Path) -> Option<String> {
    let s = path.to_string();
    (s != "." && !s.is_empty()).then_some(s)
}

fn parse_raw(text: &str, format: SpecFormat) -> Result<RawFile, SpecFileError> {
    match format {
        SpecFormat::Toml => {
            let deserializer = toml::Deserializer::parse(text).map_err(|e| {
                let (line, column) = e.span().map(|s| line_col(text, s.start)).unzip();
                SpecFileError {
                    line,
                    column,
                    field: None,
                    message: e.message().to_owned(),
                }
            })?;
            serde_path_to_error::deserialize(deserializer).map_err(|e| {
                let field = path_field(e.path());
                let inner = e.into_inner();
                let (line, column) = inner.span().map(|s| line_col(text, s.start)).unzip();
                SpecFileError {
                    line,
                    column,
                    field,
                    message: inner.message().to_owned(),
                }
            })
        }
        SpecFormat::Json => {
            let mut deserializer = serde_json::Deserializer::from_str(text);
            let raw: RawFile =
                serde_path_to_error::deserialize(&mut deserializer).map_err(|e| {
                    let field = path_field(e.path());
                    let inner = e.into_inner();
                    json_error(&inner, field)
                })?;
            deserializer.end().map_err(|e| json_error(&e, None))?;
            Ok(raw)
        }
    }
}

fn json_error(e: &serde_json::Error, field: Option<String>) -> SpecFileError {
    let full = e.to_string();
    let suffix = format!(" at line {} column {}", e.line(), e.column());
    let message = full.strip_suffix(&suffix).unwrap_or(&full).to_owned();
    SpecFileError {
        line: (e.line() > 0).then_some(e.line()),
        column: (e.column() > 0).then_some(e.column()),
        field,
        message,
    }
}

/// Reads access specifications from the text of a TOML or JSON spec file
/// (see the [module docs](self) for the format).
///
/// # Errors
/// [`SpecFileError`] for the first mistake: syntax, an unknown or missing
/// field, a bad value (with line, column and field path), a spec that mixes
/// inline part fields with a `part` list, a spec without parts, parts whose
/// weights add up to 0, a duplicate name, or a file without specs.
pub fn parse_spec_file(text: &str, format: SpecFormat) -> Result<Vec<AccessSpec>, SpecFileError> {
    let raw = parse_raw(text, format)?;
    if raw.spec.is_empty() {
        return Err(SpecFileError {
            line: None,
            column: None,
            field: Some("spec".into()),
            message: "the file defines no access specification".into(),
        });
    }
    let mut specs: Vec<AccessSpec> = Vec::with_capacity(raw.spec.len());
    for (i, spec) in raw.spec.into_iter().enumerate() {
        let fail = |field: &str, message: String| SpecFileError {
            line: None,
            column: None,
            field: Some(format!("spec[{i}]{field}")),
            message,
        };
        let name = spec.name.trim().to_owned();
        if name.is_empty() {
            return Err(fail(".name", "the name is empty".into()));
        }
        if specs.iter().any(|s| s.name == name) {
            return Err(fail(
                ".name",
                format!("\"{name}\" is already the name of another spec"),
            ));
        }
        let inline = spec.size.is_some()
            || spec.read.is_some()
            || spec.random.is_some()
            || spec.align.is_some();
        let parts = match (spec.part, inline) {
            (Some(_), true) => {
                return Err(fail(
                    "",
                    format!(
                        "spec \"{name}\" has both inline fields (size/read/random/align) and a \
                         `part` list: use one or the other"
                    ),
                ));
            }
            (Some(parts), false) => {
                if parts.is_empty() {
                    return Err(fail(
                        ".part",
                        format!("spec \"{name}\" has an empty part list"),
                    ));
                }
                parts.into_iter().map(RawPart::into_part).collect()
            }
            (None, _) => {
                let missing = |field: &str| {
                    fail(
                        "",
                        format!(
                            "spec \"{name}\" has neither a `part` list nor the field `{field}` \
                             of a single-part spec"
                        ),
                    )
                };
                let size = spec.size.ok_or_else(|| missing("size"))?;
                let read = spec.read.ok_or_else(|| missing("read"))?;
                let random = spec.random.ok_or_else(|| missing("random"))?;
                vec![
                    RawPart {
                        size,
                        weight: None,
                        read,
                        random,
                        align: spec.align,
                    }
                    .into_part(),
                ]
            }
        };
        let spec = AccessSpec { name, parts };
        spec.check().map_err(|m| fail("", m))?;
        specs.push(spec);
    }
    Ok(specs)
}

/// Reads a spec file from disk (format from its extension).
///
/// # Errors
/// The I/O error or [`SpecFileError`], as text naming the file.
pub fn load_spec_file(path: &Path) -> Result<Vec<AccessSpec>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read spec file {}: {e}", path.display()))?;
    parse_spec_file(&text, SpecFormat::from_path(path))
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// A built-in spec: the name users select it by, and the spec.
#[derive(Debug, Clone)]
pub struct BuiltinSpec {
    /// Short id for the command line (`4k-random-read`).
    pub id: &'static str,
    /// What it models.
    pub description: &'static str,
    /// The spec.
    pub spec: AccessSpec,
}

const K: u32 = 1024;
const M: u32 = 1024 * 1024;

/// The classic specs, in the order `--list-specs` shows them.
#[must_use]
pub fn builtin_specs() -> Vec<BuiltinSpec> {
    let single = |id, description, name: &str, size, read, random| BuiltinSpec {
        id,
        description,
        spec: AccessSpec::single(name, AccessPart::new(size, read, random)),
    };
    let mix = |id, description, name: &str, read, random, sizes: &[(u32, u32)]| BuiltinSpec {
        id,
        description,
        spec: AccessSpec {
            name: name.to_owned(),
            parts: sizes
                .iter()
                .map(|&(size, weight)| AccessPart::new(size, read, random).weighted(weight))
                .collect(),
        },
    };
    vec![
        single(
            "4k-random-read",
            "small random reads: the IOPS figure",
            "4K random read",
            4 * K,
            100,
            100,
        ),
        single(
            "4k-random-write",
            "small random writes",
            "4K random write",
            4 * K,
            0,
            100,
        ),
        single(
            "4k-random-70-30",
            "small random I/O, 70% reads",
            "4K random 70/30",
            4 * K,
            70,
            100,
        ),
        single(
            "8k-oltp",
            "database-like: 8K random, 67% reads",
            "8K random 67/33 (OLTP)",
            8 * K,
            67,
            100,
        ),
        single(
            "512b-seq-read",
            "the smallest sequential reads: per-I/O overhead",
            "512B sequential read",
            512,
            100,
            0,
        ),
        single(
            "64k-seq-read",
            "medium sequential reads",
            "64K sequential read",
            64 * K,
            100,
            0,
        ),
        single(
            "64k-seq-write",
            "medium sequential writes",
            "64K sequential write",
            64 * K,
            0,
            0,
        ),
        single(
            "1m-seq-read",
            "large sequential reads: the bandwidth figure",
            "1M sequential read",
            M,
            100,
            0,
        ),
        single(
            "1m-seq-write",
            "large sequential writes",
            "1M sequential write",
            M,
            0,
            0,
        ),
        mix(
            "file-server",
            "IOmeter's file server pattern: 512B-64K mix, 80% reads, random",
            "File server",
            80,
            100,
            &[
                (512, 10),
                (K, 5),
                (2 * K, 5),
                (4 * K, 60),
                (8 * K, 2),
                (16 * K, 4),
                (32 * K, 4),
                (64 * K, 10),
            ],
        ),
        mix(
            "web-server",
            "IOmeter's web server pattern: 512B-512K mix, all reads, random",
            "Web server",
            100,
            100,
            &[
                (512, 22),
                (K, 15),
                (2 * K, 8),
                (4 * K, 23),
                (8 * K, 15),
                (16 * K, 2),
                (32 * K, 6),
                (64 * K, 7),
                (128 * K, 1),
                (512 * K, 1),
            ],
        ),
    ]
}

/// The ids of the default suite (a few classic specs, short enough for
/// the one-command run).
pub const DEFAULT_SUITE: &[&str] = &[
    "4k-random-read",
    "4k-random-70-30",
    "64k-seq-read",
    "64k-seq-write",
];

/// Looks up a built-in spec by id (case-insensitive).
#[must_use]
pub fn builtin_spec(id: &str) -> Option<AccessSpec> {
    builtin_specs()
        .into_iter()
        .find(|b| b.id.eq_ignore_ascii_case(id))
        .map(|b| b.spec)
}
