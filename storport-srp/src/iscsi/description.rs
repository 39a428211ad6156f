//! A target as an administrator describes it, with the names of `iscsiadm`'s
//! node records (`iscsiadm -m node -o show` prints `key = value` lines),
//! parsed strictly and without allocation: every value is checked, and
//! every error names the key it is about.
//!
//! | key | meaning | default |
//! |---|---|---|
//! | `node.name` | target IQN / EUI / NAA name | required |
//! | `node.conn[0].address` | portal IPv4 or IPv6 address | required |
//! | `node.conn[0].port` | portal TCP port (the iSER service ID is `0x0106 << 16 \| port`) | 3260 |
//! | `node.tpgt` | expected TargetPortalGroupTag (checked at login) | unchecked |
//! | `iface.initiatorname` | initiator IQN / EUI / NAA name | required |
//! | `node.session.isid` | ISID, 12 hex digits (not an `iscsiadm` key) | random format, hashed from the names |
//! | `node.session.auth.authmethod` | `None` or `CHAP` | `None` |
//! | `node.session.auth.username`, `.password` | CHAP the target checks | — |
//! | `node.session.auth.username_in`, `.password_in` | mutual CHAP (the initiator checks the target) | — |
//! | `node.session.iscsi.InitialR2T` | `Yes`/`No` | `No` |
//! | `node.session.iscsi.ImmediateData` | `Yes`/`No` | `Yes` |
//! | `node.session.iscsi.FirstBurstLength` | bytes, 512..2^24-1 | 262144 |
//! | `node.session.iscsi.MaxBurstLength` | bytes, 512..2^24-1 | 16776192 |
//! | `node.session.iscsi.DefaultTime2Wait` | seconds, 0..3600 | 2 |
//! | `node.session.iscsi.DefaultTime2Retain` | seconds, 0..3600 | 0 |
//! | `node.session.iscsi.MaxConnections` | only 1 (no MC/S) | 1 |
//! | `node.session.iscsi.ERL` | only 0 | 0 |
//! | `node.session.iscsi.MaxOutstandingUnexpectedPDUs` | 0 (no limit) or 2..2^32-1 | 0 |
//! | `node.conn[0].iscsi.MaxRecvDataSegmentLength` | offered as `InitiatorRecvDataSegmentLength` | 8192 |
//! | `node.conn[0].iscsi.MaxXmitDataSegmentLength` | offered as `TargetRecvDataSegmentLength` (`isert` receives 8192) | 8192 |
//! | `node.conn[0].iscsi.HeaderDigest`, `.DataDigest` | only `None` (iSER has no digests) | `None` |
//! | `node.conn[0].timeo.noop_out_interval` | seconds between keepalive pings, 0 = off | 5 |
//! | `node.conn[0].timeo.noop_out_timeout` | seconds a ping may go unanswered | 5 |
//! | `node.conn[0].timeo.login_timeout` | seconds a login may take | 15 |
//! | `node.conn[0].timeo.logout_timeout` | seconds a logout may take | 15 |
//! | `node.session.err_timeo.abort_timeout` | seconds an ABORT TASK may take | 15 |
//! | `node.session.err_timeo.lu_reset_timeout` | seconds a LUN RESET may take | 30 |
//! | `node.session.timeo.replacement_timeout` | fast-fail: seconds of failed reconnects before I/O fails fast (`off` allowed) | 120 |
//! | `node.session.timeo.reconnect_delay` | seconds between reconnect attempts (SRP's `reconnect_delay`) | 2 |
//! | `node.session.timeo.dev_loss_tmo` | seconds before the target is given up (`off` allowed) | 600 |
//! | `node.session.timeo.window_timeout` | seconds the command window may stay closed | 60 |
//! | `node.session.cmds_max` | outstanding commands (task table size) | 128 |
//! | `node.session.queue_depth` | outstanding commands per LUN | 32 |
//!
//! The recovery timers are validated as Linux's `srp_tmo_valid` validates
//! SRP's (fast-fail at most 600 s and below device loss), plus one rule
//! of this initiator: they may not both be `off`, so nothing waits for a
//! dead target forever.

use core::fmt;
use core::net::IpAddr;

use heapless::{String, Vec};
use kverbs::wire::{PortSpace, ServiceId};

use crate::wire::text::{MAX_NAME_LEN, MAX_VALUE_LEN};

/// The default iSCSI port.
pub const DEFAULT_PORT: u16 = 3260;
/// Shortest CHAP secret accepted (12 bytes, 96 bits, as the Microsoft
/// initiator requires).
pub const MIN_CHAP_SECRET_LEN: usize = 12;
/// Longest fast-fail time (Linux `SCSI_DEVICE_BLOCK_MAX_TIMEOUT`).
pub const MAX_FAST_FAIL_SECS: u32 = 600;
/// Largest task table.
pub const MAX_CMDS: u16 = 4096;

/// What is wrong with a value or with the description as a whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The key is not one this initiator knows.
    UnknownKey,
    /// The key appears twice.
    DuplicateKey,
    /// A line has no `=`.
    MissingEquals,
    /// A required key is absent.
    Missing,
    /// Not a decimal number (or one with a leading zero or a sign).
    BadNumber,
    /// A number outside the key's range.
    OutOfRange,
    /// Neither `Yes` nor `No`.
    BadBoolean,
    /// A value the key does not allow (e.g. `HeaderDigest=CRC32C`).
    Unsupported,
    /// Not an IPv4 or IPv6 address.
    BadAddress,
    /// An iSCSI name without a known prefix (`iqn.`, `eui.`, `naa.`).
    NameType,
    /// An `iqn.` name without a valid `yyyy-mm` date.
    NameDate,
    /// An `iqn.` name without a naming authority (reversed domain).
    NameAuthority,
    /// A character an iSCSI name may not hold (names are lower case
    /// ASCII letters, digits, `-`, `.`, `:`).
    NameCharacter,
    /// An `eui.` name without 16 hex digits, or a `naa.` name without 16
    /// or 32.
    NameHexDigits,
    /// A name longer than 223 bytes.
    NameTooLong,
    /// An ISID that is not 12 hex digits.
    IsidFormat,
    /// An ISID of the reserved type (top bits `11`), or with the A field
    /// set where the type reserves it.
    IsidType,
    /// A value longer than allowed, or empty where it may not be.
    BadLength,
    /// A value with a control character.
    BadCharacter,
    /// A CHAP secret shorter than 12 bytes.
    SecretTooShort,
    /// Keys that contradict each other (the error names one of them).
    Inconsistent,
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::UnknownKey => "unknown key",
            Self::DuplicateKey => "key given twice",
            Self::MissingEquals => "line without '='",
            Self::Missing => "required key missing",
            Self::BadNumber => "not a decimal number",
            Self::OutOfRange => "number out of range",
            Self::BadBoolean => "neither Yes nor No",
            Self::Unsupported => "value not supported",
            Self::BadAddress => "not an IP address",
            Self::NameType => "iSCSI name without iqn./eui./naa. prefix",
            Self::NameDate => "iqn. name without a yyyy-mm date",
            Self::NameAuthority => "iqn. name without a naming authority",
            Self::NameCharacter => "character not allowed in an iSCSI name",
            Self::NameHexDigits => "wrong number of hex digits in the name",
            Self::NameTooLong => "iSCSI name longer than 223 bytes",
            Self::IsidFormat => "ISID is not 12 hex digits",
            Self::IsidType => "ISID of a reserved type",
            Self::BadLength => "value empty or too long",
            Self::BadCharacter => "control character in value",
            Self::SecretTooShort => "CHAP secret shorter than 12 bytes",
            Self::Inconsistent => "contradicts another key",
        })
    }
}

/// A description error: the key it is about (as written, or the
/// canonical name for a missing or inconsistent key), the 1-based line for
/// [`TargetDescription::parse`], and what is wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DescriptionError<'a> {
    /// The key.
    pub key: &'a str,
    /// The line, when parsing a record.
    pub line: Option<usize>,
    /// What is wrong.
    pub kind: ErrorKind,
}

impl fmt::Display for DescriptionError<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(line) = self.line {
            write!(f, "line {line}: ")?;
        }
        write!(f, "{}: {}", self.key, self.kind)
    }
}

/// A validated iSCSI name (RFC 7143 §4.2.7): `iqn.yyyy-mm.reversed.domain[:…]`,
/// `eui.` and 16 hex digits, or `naa.` and 16 or 32 hex digits.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct IscsiName(String<MAX_NAME_LEN>);

impl IscsiName {
    /// Validates `text`.
    ///
    /// # Errors
    ///
    /// One of the `Name*` kinds.
    pub fn parse(text: &str) -> Result<Self, ErrorKind> {
        if text.len() > MAX_NAME_LEN {
            return Err(ErrorKind::NameTooLong);
        }
        if let Some(rest) = text.strip_prefix("iqn.") {
            check_iqn(rest)?;
        } else if let Some(hex) = text.strip_prefix("eui.") {
            check_hex(hex, &[16])?;
        } else if let Some(hex) = text.strip_prefix("naa.") {
            check_hex(hex, &[16, 32])?;
        } else {
            return Err(ErrorKind::NameType);
        }
        String::try_from(text)
            .map(Self)
            .map_err(|()| ErrorKind::NameTooLong)
    }

    /// The name.
    #[must_use]
    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }
}

impl fmt::Display for IscsiName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

fn check_hex(hex: &str, lengths: &[usize]) -> Result<(), ErrorKind> {
    if !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(ErrorKind::NameCharacter);
    }
    if lengths.contains(&hex.len()) {
        Ok(())
    } else {
        Err(ErrorKind::NameHexDigits)
    }
}

fn check_iqn(rest: &str) -> Result<(), ErrorKind> {
    // yyyy-mm.
    let date = rest.get(..7).ok_or(ErrorKind::NameDate)?;
    let ok_date = date.bytes().enumerate().all(|(i, b)| {
        if i == 4 {
            b == b'-'
        } else {
            b.is_ascii_digit()
        }
    });
    let month = date.get(5..7).and_then(|m| m.parse::<u8>().ok());
    if !ok_date || !matches!(month, Some(1..=12)) {
        return Err(ErrorKind::NameDate);
    }
    let after = rest.get(7..).unwrap_or("");
    let authority_and_more = after.strip_prefix('.').ok_or(ErrorKind::NameAuthority)?;
    let (authority, unique) = match authority_and_more.split_once(':') {
        Some((a, u)) => (a, Some(u)),
        None => (authority_and_more, None),
    };
    if authority.is_empty() || authority.split('.').any(str::is_empty) {
        return Err(ErrorKind::NameAuthority);
    }
    let name_char = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-';
    if !authority.bytes().all(|b| name_char(b) || b == b'.') {
        return Err(ErrorKind::NameCharacter);
    }
    if let Some(unique) = unique {
        if unique.is_empty() {
            return Err(ErrorKind::NameAuthority);
        }
        if !unique
            .bytes()
            .all(|b| name_char(b) || b == b'.' || b == b':')
        {
            return Err(ErrorKind::NameCharacter);
        }
    }
    Ok(())
}

/// The format of an ISID (the T field, its top two bits; RFC 7143
/// §11.12.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IsidFormat {
    /// `00`: A and B hold a 22-bit OUI, C and D are qualifiers.
    Oui,
    /// `01`: B and C hold an IANA enterprise number, D is a qualifier.
    IanaEnterpriseNumber,
    /// `10`: B and C are random, D is a qualifier.
    Random,
}

/// The initiator part of the session identifier. Reinstating a session
/// needs the same ISID (and TSIH 0), so it is fixed per target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Isid([u8; 6]);

impl Isid {
    /// Validates six ISID bytes.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::IsidType`] for the reserved type or a set A field
    /// where the type reserves it.
    pub const fn from_bytes(bytes: [u8; 6]) -> Result<Self, ErrorKind> {
        match bytes[0] >> 6 {
            0 => Ok(Self(bytes)),
            1 | 2 if bytes[0] & 0x3F == 0 => Ok(Self(bytes)),
            _ => Err(ErrorKind::IsidType),
        }
    }

    /// Parses 12 hex digits, with or without `0x`.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::IsidFormat`], [`ErrorKind::IsidType`].
    pub fn parse(text: &str) -> Result<Self, ErrorKind> {
        let hex = text
            .strip_prefix("0x")
            .or_else(|| text.strip_prefix("0X"))
            .unwrap_or(text);
        if hex.len() != 12 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(ErrorKind::IsidFormat);
        }
        let mut bytes = [0u8; 6];
        for (i, byte) in bytes.iter_mut().enumerate() {
            let pair = hex.get(2 * i..2 * i + 2).ok_or(ErrorKind::IsidFormat)?;
            *byte = u8::from_str_radix(pair, 16).map_err(|_| ErrorKind::IsidFormat)?;
        }
        Self::from_bytes(bytes)
    }

    /// A random-format ISID whose B and C fields are a hash of the names
    /// and portal (stable across reconnects, distinct per target), with
    /// qualifier D = 1.
    #[must_use]
    pub fn derived(initiator: &IscsiName, target: &IscsiName, portal: &Portal) -> Self {
        // FNV-1a, 32 bits, of the three, folded to 24 bits.
        let mut hash: u32 = 0x811C_9DC5;
        let mut feed = |bytes: &[u8]| {
            for &b in bytes {
                hash ^= u32::from(b);
                hash = hash.wrapping_mul(0x0100_0193);
            }
        };
        feed(initiator.as_str().as_bytes());
        feed(&[0]);
        feed(target.as_str().as_bytes());
        feed(&[0]);
        match portal.address {
            IpAddr::V4(a) => feed(&a.octets()),
            IpAddr::V6(a) => feed(&a.octets()),
        }
        feed(&portal.port.to_be_bytes());
        let folded = (hash >> 24) ^ (hash & 0x00FF_FFFF);
        let [_, b0, b1, c] = folded.to_be_bytes();
        Self([0x80, b0, b1, c, 0, 1])
    }

    /// The six bytes as they travel.
    #[must_use]
    pub const fn bytes(&self) -> [u8; 6] {
        self.0
    }

    /// The format (type) field.
    #[must_use]
    pub const fn format(&self) -> IsidFormat {
        match self.0[0] >> 6 {
            0 => IsidFormat::Oui,
            1 => IsidFormat::IanaEnterpriseNumber,
            _ => IsidFormat::Random,
        }
    }

    /// The 16-bit qualifier (the D field) that tells this initiator's
    /// sessions apart.
    #[must_use]
    pub const fn qualifier(&self) -> u16 {
        u16::from_be_bytes([self.0[4], self.0[5]])
    }
}

/// Where the target listens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Portal {
    /// IP address.
    pub address: IpAddr,
    /// TCP port (the RDMA/CM port).
    pub port: u16,
}

impl Portal {
    /// The RDMA/CM service ID an iSER target on this portal listens on
    /// (TCP port space).
    #[must_use]
    pub const fn service_id(&self) -> ServiceId {
        ServiceId::rdma_cm(PortSpace::Tcp, self.port)
    }

    /// Parses `address:port` (`[v6]:port` for IPv6) or a bare address
    /// (port 3260), as the INF's `Portal` value holds it.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::BadAddress`], [`ErrorKind::BadNumber`],
    /// [`ErrorKind::OutOfRange`].
    pub fn parse(text: &str) -> Result<Self, ErrorKind> {
        if let Ok(address) = text.parse::<IpAddr>() {
            return Ok(Self {
                address,
                port: DEFAULT_PORT,
            });
        }
        let (host, port) = if let Some(rest) = text.strip_prefix('[') {
            let (host, port) = rest.split_once("]:").ok_or(ErrorKind::BadAddress)?;
            (host, port)
        } else {
            text.rsplit_once(':').ok_or(ErrorKind::BadAddress)?
        };
        let address = host.parse::<IpAddr>().map_err(|_| ErrorKind::BadAddress)?;
        let port = parse_port(port)?;
        Ok(Self { address, port })
    }
}

fn parse_port(text: &str) -> Result<u16, ErrorKind> {
    let n = parse_decimal(text)?;
    u16::try_from(n)
        .ok()
        .filter(|&p| p != 0)
        .ok_or(ErrorKind::OutOfRange)
}

/// CHAP credentials: the name sent as `CHAP_N` (or expected from the
/// target) and the shared secret.
#[derive(Clone, PartialEq, Eq, Default)]
pub struct ChapCredentials {
    /// The CHAP name.
    pub username: String<MAX_VALUE_LEN>,
    /// The secret.
    pub secret: Vec<u8, MAX_VALUE_LEN>,
}

impl fmt::Debug for ChapCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print the secret.
        f.debug_struct("ChapCredentials")
            .field("username", &self.username)
            .finish_non_exhaustive()
    }
}

/// How the initiator authenticates.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Authentication {
    /// One-way CHAP: the target checks the initiator.
    pub chap: Option<ChapCredentials>,
    /// Mutual CHAP: the initiator checks the target too.
    pub mutual: Option<ChapCredentials>,
}

/// The operational parameters the initiator offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct OperationalParams {
    /// `InitiatorRecvDataSegmentLength`: the largest data segment the
    /// initiator's receive buffers take.
    pub initiator_recv_data_segment_length: u32,
    /// `TargetRecvDataSegmentLength` offered: the largest data segment the
    /// initiator will send (the target may declare less).
    pub target_recv_data_segment_length: u32,
    /// `MaxBurstLength`.
    pub max_burst_length: u32,
    /// `FirstBurstLength`.
    pub first_burst_length: u32,
    /// `ImmediateData`.
    pub immediate_data: bool,
    /// `InitialR2T`.
    pub initial_r2t: bool,
    /// `DefaultTime2Wait`, seconds.
    pub default_time2wait: u16,
    /// `DefaultTime2Retain`, seconds.
    pub default_time2retain: u16,
    /// `MaxOutstandingUnexpectedPDUs` (0: no limit).
    pub max_outstanding_unexpected_pdus: u32,
}

impl Default for OperationalParams {
    fn default() -> Self {
        Self {
            initiator_recv_data_segment_length: 8192,
            target_recv_data_segment_length: 8192,
            max_burst_length: 16_776_192,
            first_burst_length: 262_144,
            immediate_data: true,
            initial_r2t: false,
            default_time2wait: 2,
            default_time2retain: 0,
            max_outstanding_unexpected_pdus: 0,
        }
    }
}

/// Timeouts, in seconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Timeouts {
    /// Seconds between keepalive NOP-Outs on an idle connection (0: off).
    pub noop_out_interval: u32,
    /// Seconds a NOP-Out may go unanswered before the session fails.
    pub noop_out_timeout: u32,
    /// Seconds a login may take.
    pub login: u32,
    /// Seconds a logout may take.
    pub logout: u32,
    /// Seconds an ABORT TASK may take.
    pub abort: u32,
    /// Seconds a LUN RESET may take.
    pub lu_reset: u32,
    /// Seconds the command window may stay closed.
    pub window: u32,
    /// Seconds between reconnect attempts.
    pub reconnect_delay: u32,
    /// Fast-fail after this many seconds of failed reconnects (`None`:
    /// off).
    pub fast_io_fail: Option<u32>,
    /// Give the target up after this many seconds (`None`: off).
    pub dev_loss: Option<u32>,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            noop_out_interval: 5,
            noop_out_timeout: 5,
            login: 15,
            logout: 15,
            abort: 15,
            lu_reset: 30,
            window: 60,
            reconnect_delay: 2,
            fast_io_fail: Some(120),
            dev_loss: Some(600),
        }
    }
}

/// A target, fully described.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetDescription {
    /// The target's name.
    pub target_name: IscsiName,
    /// The target's portal.
    pub portal: Portal,
    /// The expected TargetPortalGroupTag, if the administrator gave one.
    pub tpgt: Option<u16>,
    /// The initiator's name.
    pub initiator_name: IscsiName,
    /// The ISID.
    pub isid: Isid,
    /// Authentication.
    pub auth: Authentication,
    /// What to offer.
    pub params: OperationalParams,
    /// Timeouts.
    pub timeouts: Timeouts,
    /// Outstanding commands (task table size).
    pub cmds_max: u16,
    /// Outstanding commands per LUN.
    pub queue_depth: u16,
}

macro_rules! keys {
    ($($variant:ident = $name:literal,)*) => {
        /// A key of the description.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr(u8)]
        pub enum Key {
            $(
                #[doc = concat!("`", $name, "`.")]
                $variant,
            )*
        }

        impl Key {
            /// Every key.
            pub const ALL: &'static [Key] = &[$(Key::$variant,)*];

            /// The key as written.
            #[must_use]
            pub const fn name(self) -> &'static str {
                match self {
                    $(Key::$variant => $name,)*
                }
            }

            /// The key for `name`.
            #[must_use]
            pub fn from_name(name: &str) -> Option<Key> {
                match name {
                    $($name => Some(Key::$variant),)*
                    _ => None,
                }
            }
        }
    };
}

keys! {
    NodeName = "node.name",
    Address = "node.conn[0].address",
    Port = "node.conn[0].port",
    Tpgt = "node.tpgt",
    InitiatorName = "iface.initiatorname",
    Isid = "node.session.isid",
    AuthMethod = "node.session.auth.authmethod",
    Username = "node.session.auth.username",
    Password = "node.session.auth.password",
    UsernameIn = "node.session.auth.username_in",
    PasswordIn = "node.session.auth.password_in",
    InitialR2T = "node.session.iscsi.InitialR2T",
    ImmediateData = "node.session.iscsi.ImmediateData",
    FirstBurstLength = "node.session.iscsi.FirstBurstLength",
    MaxBurstLength = "node.session.iscsi.MaxBurstLength",
    DefaultTime2Wait = "node.session.iscsi.DefaultTime2Wait",
    DefaultTime2Retain = "node.session.iscsi.DefaultTime2Retain",
    MaxConnections = "node.session.iscsi.MaxConnections",
    Erl = "node.session.iscsi.ERL",
    MaxOutstandingUnexpectedPdus = "node.session.iscsi.MaxOutstandingUnexpectedPDUs",
    MaxRecvDataSegmentLength = "node.conn[0].iscsi.MaxRecvDataSegmentLength",
    MaxXmitDataSegmentLength = "node.conn[0].iscsi.MaxXmitDataSegmentLength",
    HeaderDigest = "node.conn[0].iscsi.HeaderDigest",
    DataDigest = "node.conn[0].iscsi.DataDigest",
    NoopOutInterval = "node.conn[0].timeo.noop_out_interval",
    NoopOutTimeout = "node.conn[0].timeo.noop_out_timeout",
    LoginTimeout = "node.conn[0].timeo.login_timeout",
    LogoutTimeout = "node.conn[0].timeo.logout_timeout",
    AbortTimeout = "node.session.err_timeo.abort_timeout",
    LuResetTimeout = "node.session.err_timeo.lu_reset_timeout",
    ReplacementTimeout = "node.session.timeo.replacement_timeout",
    ReconnectDelay = "node.session.timeo.reconnect_delay",
    DevLossTmo = "node.session.timeo.dev_loss_tmo",
    WindowTimeout = "node.session.timeo.window_timeout",
    CmdsMax = "node.session.cmds_max",
    QueueDepth = "node.session.queue_depth",
}

/// Parses a decimal number without sign or leading zero.
fn parse_decimal(text: &str) -> Result<u64, ErrorKind> {
    if text.is_empty()
        || (text.len() > 1 && text.starts_with('0'))
        || !text.bytes().all(|b| b.is_ascii_digit())
    {
        return Err(ErrorKind::BadNumber);
    }
    text.parse::<u64>().map_err(|_| ErrorKind::OutOfRange)
}

fn parse_range(text: &str, min: u64, max: u64) -> Result<u64, ErrorKind> {
    let n = parse_decimal(text)?;
    if (min..=max).contains(&n) {
        Ok(n)
    } else {
        Err(ErrorKind::OutOfRange)
    }
}

fn parse_u32(text: &str, min: u32, max: u32) -> Result<u32, ErrorKind> {
    // The range keeps the value within u32.
    parse_range(text, u64::from(min), u64::from(max)).map(|n| n as u32)
}

fn parse_u16(text: &str, min: u16, max: u16) -> Result<u16, ErrorKind> {
    parse_range(text, u64::from(min), u64::from(max)).map(|n| n as u16)
}

fn parse_bool(text: &str) -> Result<bool, ErrorKind> {
    match text {
        "Yes" => Ok(true),
        "No" => Ok(false),
        _ => Err(ErrorKind::BadBoolean),
    }
}

/// `off` or seconds in `min..=max`.
fn parse_optional_secs(text: &str, min: u32, max: u32) -> Result<Option<u32>, ErrorKind> {
    if text == "off" {
        Ok(None)
    } else {
        parse_u32(text, min, max).map(Some)
    }
}

fn parse_text<const N: usize>(text: &str) -> Result<String<N>, ErrorKind> {
    if text.is_empty() {
        return Err(ErrorKind::BadLength);
    }
    if text.chars().any(char::is_control) {
        return Err(ErrorKind::BadCharacter);
    }
    String::try_from(text).map_err(|()| ErrorKind::BadLength)
}

fn parse_secret(text: &str) -> Result<Vec<u8, MAX_VALUE_LEN>, ErrorKind> {
    let s: String<MAX_VALUE_LEN> = parse_text(text)?;
    if s.len() < MIN_CHAP_SECRET_LEN {
        return Err(ErrorKind::SecretTooShort);
    }
    Vec::from_slice(s.as_bytes()).map_err(|()| ErrorKind::BadLength)
}

/// Builds a description key by key (from a record, or from registry
/// values in the driver), then checks it as a whole.
#[derive(Debug, Clone, Default)]
pub struct DescriptionBuilder {
    seen: u64,
    target_name: Option<IscsiName>,
    address: Option<IpAddr>,
    port: Option<u16>,
    tpgt: Option<u16>,
    initiator_name: Option<IscsiName>,
    isid: Option<Isid>,
    chap_method: bool,
    username: Option<String<MAX_VALUE_LEN>>,
    password: Option<Vec<u8, MAX_VALUE_LEN>>,
    username_in: Option<String<MAX_VALUE_LEN>>,
    password_in: Option<Vec<u8, MAX_VALUE_LEN>>,
    params: Option<OperationalParams>,
    timeouts: Option<Timeouts>,
    cmds_max: Option<u16>,
    queue_depth: Option<u16>,
}

impl DescriptionBuilder {
    /// An empty builder.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets one key. `<empty>` (how `iscsiadm` prints an unset value)
    /// leaves the key unset.
    ///
    /// # Errors
    ///
    /// The key is unknown or given twice, or the value is invalid.
    pub fn set<'a>(&mut self, key: &'a str, value: &str) -> Result<(), DescriptionError<'a>> {
        let err = |kind| DescriptionError {
            key,
            line: None,
            kind,
        };
        let k = Key::from_name(key).ok_or(err(ErrorKind::UnknownKey))?;
        let bit = 1u64 << (k as u8);
        if self.seen & bit != 0 {
            return Err(err(ErrorKind::DuplicateKey));
        }
        self.seen |= bit;
        if value == "<empty>" {
            return Ok(());
        }
        self.apply(k, value).map_err(err)
    }

    fn apply(&mut self, key: Key, v: &str) -> Result<(), ErrorKind> {
        let mut params = self.params.unwrap_or_default();
        let mut timeouts = self.timeouts.unwrap_or_default();
        match key {
            Key::NodeName => self.target_name = Some(IscsiName::parse(v)?),
            Key::Address => {
                self.address = Some(v.parse::<IpAddr>().map_err(|_| ErrorKind::BadAddress)?);
            }
            Key::Port => self.port = Some(parse_port(v)?),
            Key::Tpgt => self.tpgt = Some(parse_u16(v, 0, u16::MAX)?),
            Key::InitiatorName => self.initiator_name = Some(IscsiName::parse(v)?),
            Key::Isid => self.isid = Some(Isid::parse(v)?),
            Key::AuthMethod => {
                self.chap_method = match v {
                    "None" => false,
                    "CHAP" => true,
                    _ => return Err(ErrorKind::Unsupported),
                };
            }
            Key::Username => self.username = Some(parse_text(v)?),
            Key::Password => self.password = Some(parse_secret(v)?),
            Key::UsernameIn => self.username_in = Some(parse_text(v)?),
            Key::PasswordIn => self.password_in = Some(parse_secret(v)?),
            Key::InitialR2T => params.initial_r2t = parse_bool(v)?,
            Key::ImmediateData => params.immediate_data = parse_bool(v)?,
            Key::FirstBurstLength => params.first_burst_length = parse_u32(v, 512, 0xFF_FFFF)?,
            Key::MaxBurstLength => params.max_burst_length = parse_u32(v, 512, 0xFF_FFFF)?,
            Key::DefaultTime2Wait => params.default_time2wait = parse_u16(v, 0, 3600)?,
            Key::DefaultTime2Retain => params.default_time2retain = parse_u16(v, 0, 3600)?,
            Key::MaxConnections => {
                if parse_u16(v, 1, u16::MAX)? != 1 {
                    return Err(ErrorKind::Unsupported);
                }
            }
            Key::Erl => {
                if parse_u16(v, 0, 2)? != 0 {
                    return Err(ErrorKind::Unsupported);
                }
            }
            Key::MaxOutstandingUnexpectedPdus => {
                let n = parse_u32(v, 0, u32::MAX)?;
                if n == 1 {
                    return Err(ErrorKind::OutOfRange);
                }
                params.max_outstanding_unexpected_pdus = n;
            }
            Key::MaxRecvDataSegmentLength => {
                params.initiator_recv_data_segment_length = parse_u32(v, 512, 0xFF_FFFF)?;
            }
            Key::MaxXmitDataSegmentLength => {
                params.target_recv_data_segment_length = parse_u32(v, 512, 0xFF_FFFF)?;
            }
            Key::HeaderDigest | Key::DataDigest => {
                if v != "None" {
                    return Err(ErrorKind::Unsupported);
                }
            }
            Key::NoopOutInterval => timeouts.noop_out_interval = parse_u32(v, 0, 3600)?,
            Key::NoopOutTimeout => timeouts.noop_out_timeout = parse_u32(v, 1, 3600)?,
            Key::LoginTimeout => timeouts.login = parse_u32(v, 1, 3600)?,
            Key::LogoutTimeout => timeouts.logout = parse_u32(v, 1, 3600)?,
            Key::AbortTimeout => timeouts.abort = parse_u32(v, 1, 3600)?,
            Key::LuResetTimeout => timeouts.lu_reset = parse_u32(v, 1, 3600)?,
            Key::WindowTimeout => timeouts.window = parse_u32(v, 1, 3600)?,
            Key::ReconnectDelay => timeouts.reconnect_delay = parse_u32(v, 1, 3600)?,
            Key::ReplacementTimeout => {
                timeouts.fast_io_fail = parse_optional_secs(v, 0, MAX_FAST_FAIL_SECS)?;
            }
            Key::DevLossTmo => timeouts.dev_loss = parse_optional_secs(v, 1, 86_400)?,
            Key::CmdsMax => self.cmds_max = Some(parse_u16(v, 2, MAX_CMDS)?),
            Key::QueueDepth => self.queue_depth = Some(parse_u16(v, 1, MAX_CMDS)?),
        }
        self.params = Some(params);
        self.timeouts = Some(timeouts);
        Ok(())
    }

    /// Checks the description as a whole.
    ///
    /// # Errors
    ///
    /// A required key is missing, or keys contradict each other.
    pub fn finish(self) -> Result<TargetDescription, DescriptionError<'static>> {
        let err = |key: Key, kind| DescriptionError {
            key: key.name(),
            line: None,
            kind,
        };
        let target_name = self
            .target_name
            .ok_or(err(Key::NodeName, ErrorKind::Missing))?;
        let address = self.address.ok_or(err(Key::Address, ErrorKind::Missing))?;
        let initiator_name = self
            .initiator_name
            .ok_or(err(Key::InitiatorName, ErrorKind::Missing))?;
        let portal = Portal {
            address,
            port: self.port.unwrap_or(DEFAULT_PORT),
        };
        let params = self.params.unwrap_or_default();
        let timeouts = self.timeouts.unwrap_or_default();
        if params.first_burst_length > params.max_burst_length {
            return Err(err(Key::FirstBurstLength, ErrorKind::Inconsistent));
        }
        if let (Some(ff), Some(dl)) = (timeouts.fast_io_fail, timeouts.dev_loss) {
            if ff >= dl {
                return Err(err(Key::ReplacementTimeout, ErrorKind::Inconsistent));
            }
        }
        if timeouts.fast_io_fail.is_none() && timeouts.dev_loss.is_none() {
            return Err(err(Key::DevLossTmo, ErrorKind::Inconsistent));
        }
        let cmds_max = self.cmds_max.unwrap_or(128);
        let queue_depth = self.queue_depth.unwrap_or(32.min(cmds_max));
        if queue_depth > cmds_max {
            return Err(err(Key::QueueDepth, ErrorKind::Inconsistent));
        }
        let auth = Self::auth(
            self.chap_method,
            self.username,
            self.password,
            self.username_in,
            self.password_in,
        )?;
        let isid = self
            .isid
            .unwrap_or_else(|| Isid::derived(&initiator_name, &target_name, &portal));
        Ok(TargetDescription {
            target_name,
            portal,
            tpgt: self.tpgt,
            initiator_name,
            isid,
            auth,
            params,
            timeouts,
            cmds_max,
            queue_depth,
        })
    }

    fn auth(
        chap: bool,
        username: Option<String<MAX_VALUE_LEN>>,
        password: Option<Vec<u8, MAX_VALUE_LEN>>,
        username_in: Option<String<MAX_VALUE_LEN>>,
        password_in: Option<Vec<u8, MAX_VALUE_LEN>>,
    ) -> Result<Authentication, DescriptionError<'static>> {
        let err = |key: Key, kind| DescriptionError {
            key: key.name(),
            line: None,
            kind,
        };
        let pair = |user: Option<String<MAX_VALUE_LEN>>,
                    secret: Option<Vec<u8, MAX_VALUE_LEN>>,
                    user_key: Key,
                    secret_key: Key|
         -> Result<Option<ChapCredentials>, DescriptionError<'static>> {
            match (user, secret) {
                (Some(username), Some(secret)) => Ok(Some(ChapCredentials { username, secret })),
                (None, None) => Ok(None),
                (Some(_), None) => Err(err(secret_key, ErrorKind::Missing)),
                (None, Some(_)) => Err(err(user_key, ErrorKind::Missing)),
            }
        };
        let one_way = pair(username, password, Key::Username, Key::Password)?;
        let mutual = pair(username_in, password_in, Key::UsernameIn, Key::PasswordIn)?;
        match (chap, &one_way, &mutual) {
            (false, None, None) => Ok(Authentication::default()),
            (false, _, _) => Err(err(Key::AuthMethod, ErrorKind::Inconsistent)),
            (true, None, _) => Err(err(Key::Username, ErrorKind::Missing)),
            (true, Some(i), Some(t)) if i.secret == t.secret => {
                // RFC 7143 §12.1.3: one secret must not serve both ways.
                Err(err(Key::PasswordIn, ErrorKind::Inconsistent))
            }
            (true, Some(_), _) => Ok(Authentication {
                chap: one_way,
                mutual,
            }),
        }
    }
}

impl TargetDescription {
    /// Parses an `iscsiadm`-style record: one `key = value` per line,
    /// blank lines and `#` comments ignored.
    ///
    /// # Errors
    ///
    /// The first invalid line, or a problem of the whole.
    pub fn parse<'a>(record: &'a str) -> Result<Self, DescriptionError<'a>> {
        let mut builder = DescriptionBuilder::new();
        for (index, raw) in record.lines().enumerate() {
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let with_line = |e: DescriptionError<'a>| DescriptionError {
                line: Some(index + 1),
                ..e
            };
            let (key, value) = line.split_once('=').ok_or(with_line(DescriptionError {
                key: line,
                line: None,
                kind: ErrorKind::MissingEquals,
            }))?;
            builder.set(key.trim(), value.trim()).map_err(with_line)?;
        }
        builder.finish()
    }
}

#[cfg(test)]
mod tests;
