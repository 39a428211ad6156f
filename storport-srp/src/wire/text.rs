//! iSCSI login and text data segments: `key=value\0` pairs (RFC 7143 §6),
//! parsed and emitted without allocation.
//!
//! * [`TextData::parse`] validates a whole logical text data segment once:
//!   syntax, character sets, lengths, pair count and duplicate keys. After
//!   that, iteration ([`TextData::pairs`]) cannot fail.
//! * [`Entry::parse`] gives a pair its meaning: a typed [`Param`] for the
//!   keys an iSER initiator negotiates, a [`Special`] answer
//!   (`NotUnderstood`, `Irrelevant`, `Reject`), or an unknown key (to be
//!   answered `NotUnderstood`).
//! * [`TextWriter`] builds a segment into a caller buffer, checking each
//!   pair the way the parser would.
//!
//! Limits: key names at most 63 bytes, values at most 255 bytes unless the
//! key allows more (iSCSI names 223; CHAP challenge and response values,
//! "large binary" numbers of up to 1024 bytes, 2050 characters as hex).
//! Decimal numbers with leading zeros are rejected: RFC 7143 does not allow
//! them, and Linux LIO would read them as octal.

use core::fmt;

/// Longest key name (RFC 7143 §6.1: a standard-label of at most 63
/// characters).
pub const MAX_KEY_LEN: usize = 63;
/// Longest value unless the key says otherwise.
pub const MAX_VALUE_LEN: usize = 255;
/// Longest iSCSI name (RFC 7143 §4.2.7.1).
pub const MAX_NAME_LEN: usize = 223;
/// Longest large-binary value as text: `0x` and 2 hex digits for each of up
/// to 1024 bytes (a CHAP challenge's upper bound).
pub const MAX_LARGE_BINARY_LEN: usize = 2 + 2 * 1024;
/// Most distinct duplicate-checked keys one segment may carry.
pub const MAX_CHECKED_KEYS: usize = 128;

/// Why a text segment or value was rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Error {
    /// The segment does not end with the NUL that must follow every pair.
    MissingNul,
    /// A pair (possibly an empty one) has no `=`.
    MissingEquals,
    /// A pair starts with `=`.
    EmptyKey,
    /// A key is longer than 63 bytes.
    KeyTooLong,
    /// A key does not start with `A`..=`Z` or has a character outside
    /// letters, digits and `.-+@_#`.
    InvalidKey,
    /// A value is longer than its key allows.
    ValueTooLong,
    /// A value is not UTF-8, holds a control character, or a list item
    /// holds a character a list item may not.
    InvalidValue,
    /// A key appears twice.
    DuplicateKey,
    /// The segment is longer than the limit.
    TooLong,
    /// The segment has more pairs (or distinct keys) than the limit.
    TooManyPairs,
    /// A boolean is neither `Yes` nor `No`.
    BadBoolean,
    /// A number is empty, has a leading zero, a bad digit, or exceeds
    /// 64 bits.
    BadNumber,
    /// A number is outside its key's range.
    OutOfRange,
    /// A value that must not be empty is, or a list has an empty item.
    EmptyValue,
    /// An enumerated value (SessionType) is not one the key allows.
    UnknownValue,
    /// `TextWriter`: the buffer is full.
    BufferTooSmall,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::MissingNul => "text data does not end with NUL",
            Self::MissingEquals => "key=value pair without '='",
            Self::EmptyKey => "empty key",
            Self::KeyTooLong => "key longer than 63 bytes",
            Self::InvalidKey => "invalid character in key",
            Self::ValueTooLong => "value too long for its key",
            Self::InvalidValue => "invalid character in value",
            Self::DuplicateKey => "key sent twice",
            Self::TooLong => "text data too long",
            Self::TooManyPairs => "too many key=value pairs",
            Self::BadBoolean => "boolean is neither Yes nor No",
            Self::BadNumber => "malformed number",
            Self::OutOfRange => "number out of range",
            Self::EmptyValue => "empty value",
            Self::UnknownValue => "value not allowed for this key",
            Self::BufferTooSmall => "buffer too small for the text data",
        })
    }
}

/// Result of text parsing and emission.
pub type Result<T> = core::result::Result<T, Error>;

/// Which keys may appear more than once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Repeats {
    /// None: a negotiation (login or text) must not repeat a key.
    #[default]
    Reject,
    /// A SendTargets response lists targets: `TargetName`, `TargetAddress`
    /// and `TargetAlias` repeat, once per target or portal; no other key
    /// may.
    SendTargets,
}

impl Repeats {
    fn allows(self, key: &[u8]) -> bool {
        match self {
            Self::Reject => false,
            Self::SendTargets => {
                matches!(key, b"TargetName" | b"TargetAddress" | b"TargetAlias")
            }
        }
    }
}

/// Bounds on a text segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Limits {
    /// Longest segment in bytes.
    pub max_len: usize,
    /// Most pairs.
    pub max_pairs: usize,
    /// Which keys may repeat.
    pub repeats: Repeats,
}

impl Limits {
    /// A login or text negotiation: 8192 bytes (the default
    /// MaxRecvDataSegmentLength, and Linux `isert`'s login buffer), 128
    /// pairs, no repeated key.
    pub const NEGOTIATION: Self = Self {
        max_len: 8192,
        max_pairs: 128,
        repeats: Repeats::Reject,
    };

    /// A SendTargets discovery response: 64 KiB, 4096 pairs, target keys
    /// may repeat.
    pub const SEND_TARGETS: Self = Self {
        max_len: 65536,
        max_pairs: 4096,
        repeats: Repeats::SendTargets,
    };
}

impl Default for Limits {
    fn default() -> Self {
        Self::NEGOTIATION
    }
}

/// One `key=value` pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Pair<'a> {
    /// The key name.
    pub key: &'a str,
    /// The value (may be empty, may contain `=`).
    pub value: &'a str,
}

/// Whether `byte` may appear in a key name after its first character.
const fn is_key_byte(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || matches!(byte, b'.' | b'-' | b'+' | b'@' | b'_' | b'#')
}

/// Checks a key name.
fn check_key(key: &[u8]) -> Result<()> {
    let (&first, rest) = key.split_first().ok_or(Error::EmptyKey)?;
    if key.len() > MAX_KEY_LEN {
        return Err(Error::KeyTooLong);
    }
    if !first.is_ascii_uppercase() || !rest.iter().all(|&b| is_key_byte(b)) {
        return Err(Error::InvalidKey);
    }
    Ok(())
}

/// The longest value `key` may carry.
fn max_value_len(key: &[u8]) -> usize {
    match key {
        b"CHAP_C" | b"CHAP_R" => MAX_LARGE_BINARY_LEN,
        b"TargetName" | b"InitiatorName" => MAX_NAME_LEN,
        _ => MAX_VALUE_LEN,
    }
}

/// Checks a value for `key` and returns it as text.
fn check_value<'a>(key: &[u8], value: &'a [u8]) -> Result<&'a str> {
    if value.len() > max_value_len(key) {
        return Err(Error::ValueTooLong);
    }
    let text = core::str::from_utf8(value).map_err(|_| Error::InvalidValue)?;
    if text.chars().any(char::is_control) {
        return Err(Error::InvalidValue);
    }
    Ok(text)
}

/// Splits one pair (without its NUL) at the first `=` and checks both
/// halves.
fn split_pair(raw: &[u8]) -> Result<(&[u8], &str)> {
    let eq = raw
        .iter()
        .position(|&b| b == b'=')
        .ok_or(Error::MissingEquals)?;
    let key = raw.get(..eq).unwrap_or(&[]);
    let value = raw.get(eq + 1..).unwrap_or(&[]);
    check_key(key)?;
    Ok((key, check_value(key, value)?))
}

/// Iterates NUL-terminated records; a trailing record without NUL is
/// yielded with `false`.
#[derive(Debug, Clone)]
struct Records<'a> {
    rest: &'a [u8],
}

impl<'a> Iterator for Records<'a> {
    type Item = (&'a [u8], bool);

    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.is_empty() {
            return None;
        }
        match self.rest.iter().position(|&b| b == 0) {
            Some(nul) => {
                let record = self.rest.get(..nul).unwrap_or(&[]);
                self.rest = self.rest.get(nul + 1..).unwrap_or(&[]);
                Some((record, true))
            }
            None => {
                let record = self.rest;
                self.rest = &[];
                Some((record, false))
            }
        }
    }
}

/// A validated text segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TextData<'a> {
    data: &'a [u8],
    pairs: usize,
}

impl<'a> TextData<'a> {
    /// Validates a whole segment (the concatenated data of a Login or Text
    /// exchange, C bits resolved). An empty segment has no pairs.
    ///
    /// # Errors
    ///
    /// [`Error::TooLong`], [`Error::MissingNul`], [`Error::MissingEquals`],
    /// [`Error::EmptyKey`], [`Error::KeyTooLong`], [`Error::InvalidKey`],
    /// [`Error::ValueTooLong`], [`Error::InvalidValue`],
    /// [`Error::TooManyPairs`], [`Error::DuplicateKey`].
    pub fn parse(data: &'a [u8], limits: &Limits) -> Result<Self> {
        if data.len() > limits.max_len {
            return Err(Error::TooLong);
        }
        // Keys already seen, as (offset, length) into `data`: bounded, on
        // the stack, and linear to check since keys are short.
        let mut seen = [(0u32, 0u8); MAX_CHECKED_KEYS];
        let mut seen_len = 0usize;
        let mut pairs = 0usize;
        let mut offset = 0usize;
        for (raw, terminated) in (Records { rest: data }) {
            if !terminated {
                return Err(Error::MissingNul);
            }
            let (key, _) = split_pair(raw)?;
            pairs += 1;
            if pairs > limits.max_pairs {
                return Err(Error::TooManyPairs);
            }
            if !limits.repeats.allows(key) {
                let duplicate = seen.iter().take(seen_len).any(|&(at, len)| {
                    let at = at as usize;
                    data.get(at..at + usize::from(len)) == Some(key)
                });
                if duplicate {
                    return Err(Error::DuplicateKey);
                }
                let slot = seen.get_mut(seen_len).ok_or(Error::TooManyPairs)?;
                // Offsets fit: `max_len` bounds them far below 2^32 in any
                // limit a caller can hold in memory; keys are at most 63.
                *slot = (
                    u32::try_from(offset).map_err(|_| Error::TooLong)?,
                    u8::try_from(key.len()).map_err(|_| Error::KeyTooLong)?,
                );
                seen_len += 1;
            }
            offset += raw.len() + 1;
        }
        Ok(Self { data, pairs })
    }

    /// Number of pairs.
    pub const fn len(&self) -> usize {
        self.pairs
    }

    /// Whether the segment has no pairs.
    pub const fn is_empty(&self) -> bool {
        self.pairs == 0
    }

    /// The raw bytes.
    pub const fn as_bytes(&self) -> &'a [u8] {
        self.data
    }

    /// Iterates the pairs in order.
    pub fn pairs(&self) -> Pairs<'a> {
        Pairs {
            records: Records { rest: self.data },
        }
    }

    /// The value of the first pair with key `key`.
    pub fn get(&self, key: &str) -> Option<&'a str> {
        self.pairs()
            .find(|pair| pair.key == key)
            .map(|pair| pair.value)
    }

    /// Iterates the pairs with their meaning (see [`Entry::parse`]).
    pub fn entries(&self) -> impl Iterator<Item = Result<Entry<'a>>> + 'a {
        self.pairs().map(Entry::parse)
    }
}

/// Iterator over the pairs of a validated [`TextData`].
#[derive(Debug, Clone)]
pub struct Pairs<'a> {
    records: Records<'a>,
}

impl<'a> Iterator for Pairs<'a> {
    type Item = Pair<'a>;

    fn next(&mut self) -> Option<Self::Item> {
        let (raw, _) = self.records.next()?;
        // The segment was validated, so the split succeeds; a failure would
        // yield an empty pair rather than panic.
        let eq = raw.iter().position(|&b| b == b'=').unwrap_or(raw.len());
        let key = core::str::from_utf8(raw.get(..eq).unwrap_or(&[])).unwrap_or("");
        let value = core::str::from_utf8(raw.get(eq + 1..).unwrap_or(&[])).unwrap_or("");
        Some(Pair { key, value })
    }
}

/// An answer that replaces a value for any key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Special {
    /// The key is not understood (the only answer to an unknown key).
    NotUnderstood,
    /// The key is irrelevant in this context.
    Irrelevant,
    /// The offer is rejected.
    Reject,
}

impl Special {
    /// The value text.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::NotUnderstood => "NotUnderstood",
            Self::Irrelevant => "Irrelevant",
            Self::Reject => "Reject",
        }
    }

    /// The special answer a value text is, if any.
    pub fn from_value(value: &str) -> Option<Self> {
        match value {
            "NotUnderstood" => Some(Self::NotUnderstood),
            "Irrelevant" => Some(Self::Irrelevant),
            "Reject" => Some(Self::Reject),
            _ => None,
        }
    }
}

/// The kind of value a key takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ValueKind {
    /// `Yes` or `No`.
    Boolean,
    /// A number in `min..=max`.
    Number {
        /// Smallest allowed value.
        min: u64,
        /// Largest allowed value.
        max: u64,
    },
    /// Zero, or a number in `min..=max`.
    NumberOrZero {
        /// Smallest allowed non-zero value.
        min: u64,
        /// Largest allowed value.
        max: u64,
    },
    /// A comma-separated list of names, in order of preference.
    List,
    /// An iSCSI name (at most 223 bytes).
    Name,
    /// Free text (at most 255 bytes).
    Text,
    /// `Discovery` or `Normal`.
    SessionType,
}

/// Largest value of the 24-bit data segment length keys.
const MAX_24: u64 = 0x00FF_FFFF;

macro_rules! known_keys {
    ($($(#[$m:meta])* $variant:ident = $name:literal, $kind:expr;)*) => {
        /// A key the initiator negotiates or must understand.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum KnownKey {
            $($(#[$m])* $variant,)*
        }

        impl KnownKey {
            /// Every known key.
            pub const ALL: &'static [Self] = &[$(Self::$variant,)*];

            /// The key name as it travels.
            pub const fn name(self) -> &'static str {
                match self {
                    $(Self::$variant => $name,)*
                }
            }

            /// The key for a name, `None` for keys not listed here.
            pub fn from_name(name: &str) -> Option<Self> {
                match name {
                    $($name => Some(Self::$variant),)*
                    _ => None,
                }
            }

            /// The kind of value the key takes.
            pub const fn kind(self) -> ValueKind {
                match self {
                    $(Self::$variant => $kind,)*
                }
            }
        }
    };
}

known_keys! {
    /// iSER (RFC 7145): use RDMA extensions; must be `Yes` on iSER.
    RdmaExtensions = "RDMAExtensions", ValueKind::Boolean;
    /// iSER: largest data segment the initiator receives.
    InitiatorRecvDataSegmentLength = "InitiatorRecvDataSegmentLength",
        ValueKind::Number { min: 512, max: MAX_24 };
    /// iSER: largest data segment the target receives.
    TargetRecvDataSegmentLength = "TargetRecvDataSegmentLength",
        ValueKind::Number { min: 512, max: MAX_24 };
    /// Largest solicited data sequence.
    MaxBurstLength = "MaxBurstLength", ValueKind::Number { min: 512, max: MAX_24 };
    /// Largest unsolicited data sequence.
    FirstBurstLength = "FirstBurstLength", ValueKind::Number { min: 512, max: MAX_24 };
    /// Immediate data allowed.
    ImmediateData = "ImmediateData", ValueKind::Boolean;
    /// An R2T is required before any write data beyond immediate data.
    InitialR2T = "InitialR2T", ValueKind::Boolean;
    /// Header digests offered (iSER: `None`).
    HeaderDigest = "HeaderDigest", ValueKind::List;
    /// Data digests offered (iSER: `None`).
    DataDigest = "DataDigest", ValueKind::List;
    /// iSER: unexpected PDUs the initiator may have outstanding (0: no
    /// limit declared); Linux LIO does not know this key.
    MaxOutstandingUnexpectedPdus = "MaxOutstandingUnexpectedPDUs",
        ValueKind::NumberOrZero { min: 2, max: u32::MAX as u64 };
    /// Largest data segment the sender receives (TCP; iSER uses the two
    /// keys above instead).
    MaxRecvDataSegmentLength = "MaxRecvDataSegmentLength",
        ValueKind::Number { min: 512, max: MAX_24 };
    /// Error recovery level.
    ErrorRecoveryLevel = "ErrorRecoveryLevel", ValueKind::Number { min: 0, max: 2 };
    /// Seconds to wait before reconnecting after a drop.
    DefaultTime2Wait = "DefaultTime2Wait", ValueKind::Number { min: 0, max: 3600 };
    /// Seconds the target keeps state after a drop.
    DefaultTime2Retain = "DefaultTime2Retain", ValueKind::Number { min: 0, max: 3600 };
    /// Connections per session.
    MaxConnections = "MaxConnections", ValueKind::Number { min: 1, max: 65535 };
    /// R2Ts outstanding per task.
    MaxOutstandingR2T = "MaxOutstandingR2T", ValueKind::Number { min: 1, max: 65535 };
    /// The target's iSCSI name.
    TargetName = "TargetName", ValueKind::Name;
    /// The initiator's iSCSI name.
    InitiatorName = "InitiatorName", ValueKind::Name;
    /// `Discovery` or `Normal`.
    SessionType = "SessionType", ValueKind::SessionType;
    /// Authentication methods offered.
    AuthMethod = "AuthMethod", ValueKind::List;
    /// The target portal group the connection reached.
    TargetPortalGroupTag = "TargetPortalGroupTag", ValueKind::Number { min: 0, max: 65535 };
    /// The target's human-readable alias.
    TargetAlias = "TargetAlias", ValueKind::Text;
}

/// The session type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SessionType {
    /// A discovery session (SendTargets).
    Discovery,
    /// A normal session.
    Normal,
}

impl SessionType {
    /// The value text.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Discovery => "Discovery",
            Self::Normal => "Normal",
        }
    }
}

/// A digest name in a `HeaderDigest` / `DataDigest` list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Digest {
    /// No digest (the only choice on iSER).
    None,
    /// CRC32C.
    Crc32c,
}

impl Digest {
    /// The digest a list item names, `None` for names not defined here
    /// (which an acceptor skips).
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "None" => Some(Self::None),
            "CRC32C" => Some(Self::Crc32c),
            _ => None,
        }
    }
}

/// An authentication method name in an `AuthMethod` list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AuthMethod {
    /// No authentication.
    None,
    /// CHAP.
    Chap,
    /// SRP (Secure Remote Password, not SCSI RDMA Protocol).
    Srp,
    /// Kerberos V5.
    Krb5,
    /// SPKM-1.
    Spkm1,
    /// SPKM-2.
    Spkm2,
}

impl AuthMethod {
    /// The method a list item names, `None` for other names.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "None" => Some(Self::None),
            "CHAP" => Some(Self::Chap),
            "SRP" => Some(Self::Srp),
            "KRB5" => Some(Self::Krb5),
            "SPKM1" => Some(Self::Spkm1),
            "SPKM2" => Some(Self::Spkm2),
            _ => None,
        }
    }
}

/// A validated comma-separated list of values, in order of preference.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ValueList<'a>(&'a str);

impl<'a> ValueList<'a> {
    /// Validates a list: non-empty items of letters, digits and `.-+@_`.
    ///
    /// # Errors
    ///
    /// [`Error::EmptyValue`] for an empty list or item, [`Error::InvalidValue`]
    /// for another character, [`Error::ValueTooLong`] past 255 bytes.
    pub fn new(list: &'a str) -> Result<Self> {
        if list.len() > MAX_VALUE_LEN {
            return Err(Error::ValueTooLong);
        }
        for item in list.split(',') {
            if item.is_empty() {
                return Err(Error::EmptyValue);
            }
            let ok = item.bytes().all(|b| {
                b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'+' | b'@' | b'_')
            });
            if !ok {
                return Err(Error::InvalidValue);
            }
        }
        Ok(Self(list))
    }

    /// The list as sent.
    pub const fn as_str(&self) -> &'a str {
        self.0
    }

    /// The items, most preferred first.
    pub fn iter(&self) -> impl Iterator<Item = &'a str> + 'a {
        self.0.split(',')
    }

    /// Whether `item` is in the list.
    pub fn contains(&self, item: &str) -> bool {
        self.iter().any(|i| i == item)
    }
}

/// A typed value of a [`KnownKey`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Param<'a> {
    /// `RDMAExtensions`.
    RdmaExtensions(bool),
    /// `InitiatorRecvDataSegmentLength`.
    InitiatorRecvDataSegmentLength(u32),
    /// `TargetRecvDataSegmentLength`.
    TargetRecvDataSegmentLength(u32),
    /// `MaxBurstLength`.
    MaxBurstLength(u32),
    /// `FirstBurstLength`.
    FirstBurstLength(u32),
    /// `ImmediateData`.
    ImmediateData(bool),
    /// `InitialR2T`.
    InitialR2T(bool),
    /// `HeaderDigest` (see [`Digest::from_name`]).
    HeaderDigest(ValueList<'a>),
    /// `DataDigest` (see [`Digest::from_name`]).
    DataDigest(ValueList<'a>),
    /// `MaxOutstandingUnexpectedPDUs`.
    MaxOutstandingUnexpectedPdus(u32),
    /// `MaxRecvDataSegmentLength`.
    MaxRecvDataSegmentLength(u32),
    /// `ErrorRecoveryLevel`.
    ErrorRecoveryLevel(u8),
    /// `DefaultTime2Wait`.
    DefaultTime2Wait(u16),
    /// `DefaultTime2Retain`.
    DefaultTime2Retain(u16),
    /// `MaxConnections`.
    MaxConnections(u16),
    /// `MaxOutstandingR2T`.
    MaxOutstandingR2T(u16),
    /// `TargetName`.
    TargetName(&'a str),
    /// `InitiatorName`.
    InitiatorName(&'a str),
    /// `SessionType`.
    SessionType(SessionType),
    /// `AuthMethod` (see [`AuthMethod::from_name`]).
    AuthMethod(ValueList<'a>),
    /// `TargetPortalGroupTag`.
    TargetPortalGroupTag(u16),
    /// `TargetAlias`.
    TargetAlias(&'a str),
}

/// Parses a numeric value: decimal without leading zeros, or `0x` hex.
fn parse_number(text: &str) -> Result<u64> {
    let (digits, radix) = match text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
        Some(hex) => (hex, 16),
        None if text.len() > 1 && text.starts_with('0') => return Err(Error::BadNumber),
        None => (text, 10),
    };
    if digits.is_empty() {
        return Err(Error::BadNumber);
    }
    digits.chars().try_fold(0u64, |acc, c| {
        let digit = c.to_digit(radix).ok_or(Error::BadNumber)?;
        acc.checked_mul(u64::from(radix))
            .and_then(|v| v.checked_add(u64::from(digit)))
            .ok_or(Error::BadNumber)
    })
}

fn parse_bool(text: &str) -> Result<bool> {
    match text {
        "Yes" => Ok(true),
        "No" => Ok(false),
        _ => Err(Error::BadBoolean),
    }
}

impl<'a> Param<'a> {
    /// The key this value belongs to.
    pub const fn key(&self) -> KnownKey {
        match self {
            Self::RdmaExtensions(_) => KnownKey::RdmaExtensions,
            Self::InitiatorRecvDataSegmentLength(_) => KnownKey::InitiatorRecvDataSegmentLength,
            Self::TargetRecvDataSegmentLength(_) => KnownKey::TargetRecvDataSegmentLength,
            Self::MaxBurstLength(_) => KnownKey::MaxBurstLength,
            Self::FirstBurstLength(_) => KnownKey::FirstBurstLength,
            Self::ImmediateData(_) => KnownKey::ImmediateData,
            Self::InitialR2T(_) => KnownKey::InitialR2T,
            Self::HeaderDigest(_) => KnownKey::HeaderDigest,
            Self::DataDigest(_) => KnownKey::DataDigest,
            Self::MaxOutstandingUnexpectedPdus(_) => KnownKey::MaxOutstandingUnexpectedPdus,
            Self::MaxRecvDataSegmentLength(_) => KnownKey::MaxRecvDataSegmentLength,
            Self::ErrorRecoveryLevel(_) => KnownKey::ErrorRecoveryLevel,
            Self::DefaultTime2Wait(_) => KnownKey::DefaultTime2Wait,
            Self::DefaultTime2Retain(_) => KnownKey::DefaultTime2Retain,
            Self::MaxConnections(_) => KnownKey::MaxConnections,
            Self::MaxOutstandingR2T(_) => KnownKey::MaxOutstandingR2T,
            Self::TargetName(_) => KnownKey::TargetName,
            Self::InitiatorName(_) => KnownKey::InitiatorName,
            Self::SessionType(_) => KnownKey::SessionType,
            Self::AuthMethod(_) => KnownKey::AuthMethod,
            Self::TargetPortalGroupTag(_) => KnownKey::TargetPortalGroupTag,
            Self::TargetAlias(_) => KnownKey::TargetAlias,
        }
    }

    /// Parses `value` as a value of `key` (not a [`Special`] answer: see
    /// [`Entry::parse`]).
    ///
    /// # Errors
    ///
    /// [`Error::BadBoolean`], [`Error::BadNumber`], [`Error::OutOfRange`],
    /// [`Error::EmptyValue`], [`Error::InvalidValue`],
    /// [`Error::ValueTooLong`], [`Error::UnknownValue`].
    pub fn parse(key: KnownKey, value: &'a str) -> Result<Self> {
        let number = || -> Result<u64> {
            let n = parse_number(value)?;
            match key.kind() {
                ValueKind::Number { min, max } if (min..=max).contains(&n) => Ok(n),
                ValueKind::NumberOrZero { min, max } if n == 0 || (min..=max).contains(&n) => Ok(n),
                _ => Err(Error::OutOfRange),
            }
        };
        // Ranges keep every number within its field: these never saturate.
        let n32 = || number().map(|n| u32::try_from(n).unwrap_or(u32::MAX));
        let n16 = || number().map(|n| u16::try_from(n).unwrap_or(u16::MAX));
        let name = |max: usize| -> Result<&'a str> {
            if value.is_empty() {
                Err(Error::EmptyValue)
            } else if value.len() > max {
                Err(Error::ValueTooLong)
            } else if value.chars().any(char::is_control) {
                Err(Error::InvalidValue)
            } else {
                Ok(value)
            }
        };
        Ok(match key {
            KnownKey::RdmaExtensions => Self::RdmaExtensions(parse_bool(value)?),
            KnownKey::InitiatorRecvDataSegmentLength => {
                Self::InitiatorRecvDataSegmentLength(n32()?)
            }
            KnownKey::TargetRecvDataSegmentLength => Self::TargetRecvDataSegmentLength(n32()?),
            KnownKey::MaxBurstLength => Self::MaxBurstLength(n32()?),
            KnownKey::FirstBurstLength => Self::FirstBurstLength(n32()?),
            KnownKey::ImmediateData => Self::ImmediateData(parse_bool(value)?),
            KnownKey::InitialR2T => Self::InitialR2T(parse_bool(value)?),
            KnownKey::HeaderDigest => Self::HeaderDigest(ValueList::new(value)?),
            KnownKey::DataDigest => Self::DataDigest(ValueList::new(value)?),
            KnownKey::MaxOutstandingUnexpectedPdus => Self::MaxOutstandingUnexpectedPdus(n32()?),
            KnownKey::MaxRecvDataSegmentLength => Self::MaxRecvDataSegmentLength(n32()?),
            KnownKey::ErrorRecoveryLevel => {
                Self::ErrorRecoveryLevel(number().map(|n| u8::try_from(n).unwrap_or(u8::MAX))?)
            }
            KnownKey::DefaultTime2Wait => Self::DefaultTime2Wait(n16()?),
            KnownKey::DefaultTime2Retain => Self::DefaultTime2Retain(n16()?),
            KnownKey::MaxConnections => Self::MaxConnections(n16()?),
            KnownKey::MaxOutstandingR2T => Self::MaxOutstandingR2T(n16()?),
            KnownKey::TargetName => Self::TargetName(name(MAX_NAME_LEN)?),
            KnownKey::InitiatorName => Self::InitiatorName(name(MAX_NAME_LEN)?),
            KnownKey::SessionType => Self::SessionType(match value {
                "Discovery" => SessionType::Discovery,
                "Normal" => SessionType::Normal,
                _ => return Err(Error::UnknownValue),
            }),
            KnownKey::AuthMethod => Self::AuthMethod(ValueList::new(value)?),
            KnownKey::TargetPortalGroupTag => Self::TargetPortalGroupTag(n16()?),
            KnownKey::TargetAlias => Self::TargetAlias(name(MAX_VALUE_LEN)?),
        })
    }

    /// The value text: borrowed, or formatted into `scratch` for numbers.
    fn value_text<'s>(&self, scratch: &'s mut [u8; 20]) -> &'s str
    where
        'a: 's,
    {
        match *self {
            Self::RdmaExtensions(b) | Self::ImmediateData(b) | Self::InitialR2T(b) => {
                if b {
                    "Yes"
                } else {
                    "No"
                }
            }
            Self::InitiatorRecvDataSegmentLength(n)
            | Self::TargetRecvDataSegmentLength(n)
            | Self::MaxBurstLength(n)
            | Self::FirstBurstLength(n)
            | Self::MaxOutstandingUnexpectedPdus(n)
            | Self::MaxRecvDataSegmentLength(n) => format_decimal(u64::from(n), scratch),
            Self::ErrorRecoveryLevel(n) => format_decimal(u64::from(n), scratch),
            Self::DefaultTime2Wait(n)
            | Self::DefaultTime2Retain(n)
            | Self::MaxConnections(n)
            | Self::MaxOutstandingR2T(n)
            | Self::TargetPortalGroupTag(n) => format_decimal(u64::from(n), scratch),
            Self::HeaderDigest(list) | Self::DataDigest(list) | Self::AuthMethod(list) => {
                list.as_str()
            }
            Self::TargetName(s) | Self::InitiatorName(s) | Self::TargetAlias(s) => s,
            Self::SessionType(t) => t.as_str(),
        }
    }
}

/// Formats `n` in decimal at the end of `scratch` (20 digits hold any
/// `u64`).
fn format_decimal(mut n: u64, scratch: &mut [u8; 20]) -> &str {
    let mut at = scratch.len();
    while let Some(slot) = at.checked_sub(1).and_then(|i| scratch.get_mut(i)) {
        at -= 1;
        // A remainder modulo 10 is one digit.
        *slot = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    core::str::from_utf8(scratch.get(at..).unwrap_or(&[])).unwrap_or("")
}

/// What one pair means.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Entry<'a> {
    /// A known key with a valid value.
    Param(Param<'a>),
    /// A known key answered with a special value.
    Special(KnownKey, Special),
    /// A key not known here (its value unchecked beyond the segment rules);
    /// an initiator answers it `NotUnderstood`.
    Unknown(Pair<'a>),
}

impl<'a> Entry<'a> {
    /// Interprets a pair.
    ///
    /// # Errors
    ///
    /// The errors of [`Param::parse`] for a known key with a bad value.
    pub fn parse(pair: Pair<'a>) -> Result<Self> {
        let Some(key) = KnownKey::from_name(pair.key) else {
            return Ok(Self::Unknown(pair));
        };
        if let Some(special) = Special::from_value(pair.value) {
            return Ok(Self::Special(key, special));
        }
        Param::parse(key, pair.value).map(Self::Param)
    }
}

/// Builds a text segment into a caller buffer, pair by pair. A pair that
/// fails its checks or does not fit leaves the buffer as it was.
#[derive(Debug)]
pub struct TextWriter<'b> {
    buf: &'b mut [u8],
    len: usize,
    repeats: Repeats,
}

impl<'b> TextWriter<'b> {
    /// A writer for a negotiation (no repeated keys).
    pub fn new(buf: &'b mut [u8]) -> Self {
        Self {
            buf,
            len: 0,
            repeats: Repeats::Reject,
        }
    }

    /// A writer with an explicit repeat policy (a target's SendTargets
    /// response).
    pub fn with_repeats(buf: &'b mut [u8], repeats: Repeats) -> Self {
        Self {
            buf,
            len: 0,
            repeats,
        }
    }

    /// Appends `key=value\0`.
    ///
    /// # Errors
    ///
    /// The key and value errors of [`TextData::parse`],
    /// [`Error::DuplicateKey`], [`Error::BufferTooSmall`].
    pub fn push(&mut self, key: &str, value: &str) -> Result<()> {
        let key_bytes = key.as_bytes();
        check_key(key_bytes)?;
        check_value(key_bytes, value.as_bytes())?;
        if !self.repeats.allows(key_bytes) {
            let written = self.buf.get(..self.len).unwrap_or(&[]);
            let duplicate = (Records { rest: written })
                .any(|(raw, _)| raw.split(|&b| b == b'=').next() == Some(key_bytes));
            if duplicate {
                return Err(Error::DuplicateKey);
            }
        }
        let total = key.len() + 1 + value.len() + 1;
        let out =
            crate::wire::bytes::sub_mut(self.buf, self.len, total).ok_or(Error::BufferTooSmall)?;
        let (k, rest) = out.split_at_mut(key.len());
        k.copy_from_slice(key_bytes);
        let (eq, rest) = rest.split_at_mut(1);
        eq.fill(b'=');
        let (v, nul) = rest.split_at_mut(value.len());
        v.copy_from_slice(value.as_bytes());
        nul.fill(0);
        self.len += total;
        Ok(())
    }

    /// Appends a typed parameter.
    ///
    /// # Errors
    ///
    /// As [`Self::push`].
    pub fn push_param(&mut self, param: &Param<'_>) -> Result<()> {
        let mut scratch = [0u8; 20];
        let value = param.value_text(&mut scratch);
        self.push(param.key().name(), value)
    }

    /// Appends a special answer for `key`.
    ///
    /// # Errors
    ///
    /// As [`Self::push`].
    pub fn push_special(&mut self, key: &str, special: Special) -> Result<()> {
        self.push(key, special.as_str())
    }

    /// Bytes written so far.
    pub const fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing was written.
    pub const fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The segment written so far.
    pub fn as_bytes(&self) -> &[u8] {
        self.buf.get(..self.len).unwrap_or(&[])
    }

    /// Finishes and returns the segment's length.
    pub const fn finish(self) -> usize {
        self.len
    }
}

#[cfg(test)]
mod tests;
