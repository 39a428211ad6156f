//! The driver's configuration: the service's `Parameters` tunables, the
//! `DriverParameter` string StorPort passes to `HwFindAdapter`, and the
//! attached targets under `Parameters\Targets`.
//!
//! Everything here is untrusted input (an administrator's registry, an
//! INF), so the parsers are strict and total: a value of the wrong type, a
//! number out of range, an unknown or repeated key, a malformed target —
//! each is refused with a specific [`ParamError`] naming what was wrong,
//! and the adapter is then not found (`SP_RETURN_BAD_CONFIG`), rather than
//! run on a guess.
//!
//! * [`Tunables`]: the adapter-wide values, named as the Linux ib_srp
//!   module parameters (`QueueSize`, `ChannelCount`, `ReconnectDelay`,
//!   `FastIoFailTmo`, `DevLossTmo`), `REG_DWORD`s, each optional with
//!   ib_srp's default; `DriverParameter` may override any of them with
//!   `Name=value;Name=value` (decimal or `0x` hex).
//! * [`Attachment`]: one subkey of `Parameters\Targets` per target, in name
//!   order = StorPort target id order. SRP targets carry the ib_srp
//!   `add_target` string (`Protocol=srp`, `AddTarget`), iSER targets an IQN
//!   and a portal (`Protocol=iser`, `TargetName`, `Portal`).
//!
//! An `add_target` string is checked for shape here (printable ASCII,
//! bounded) and then by the SRP engine's own strict parser
//! ([`parse_add_target`]: its keys, their values and consistency, the
//! `srp_tmo_valid` rules), so a driver refuses at load time exactly what
//! the engine would refuse at attach time.
//!
//! [`registry`] reads the values with `ZwOpenKey`/`ZwQueryValueKey`/
//! `ZwEnumerateKey` (`PASSIVE_LEVEL`); the rest is pure and unit-tested.

use alloc::string::String;
use alloc::vec::Vec;
use core::fmt;

use super::srb::MAX_SG_ELEMENTS;
use crate::miniport::tracker::MAX_SLOTS;
use crate::miniport::{AdapterConfig, TMF_SLOTS};
use crate::srp::params::{ParamError as AddTargetError, parse_add_target};

/// Most targets one adapter attaches (StorPort target ids are a byte).
pub const MAX_TARGETS: usize = 128;
/// LUNs per target StorPort may address.
pub const LUNS_PER_TARGET: u8 = 8;
/// Longest `add_target` string accepted (Linux reads it from one page).
pub const MAX_ADD_TARGET_LEN: usize = 1024;
/// Longest iSCSI name (RFC 7143 §4.2.7.1).
pub const MAX_TARGET_NAME_LEN: usize = 223;
/// Longest portal (`host:port`, a DNS name of 253 plus a port).
pub const MAX_PORTAL_LEN: usize = 262;
/// Longest target subkey name.
pub const MAX_TARGET_KEY_LEN: usize = 64;
/// Longest `DriverParameter` string.
pub const MAX_DRIVER_PARAMETER_LEN: usize = 512;
/// Largest transfer the adapter reports.
pub const MAX_TRANSFER_BYTES: u32 = 1 << 20;

/// One adapter tunable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tunable {
    /// Outstanding commands per target (ib_srp `queue_size`).
    QueueSize,
    /// RDMA channels per target; 0 = one per CPU (ib_srp `ch_count`).
    ChannelCount,
    /// Seconds between reconnect attempts (ib_srp `reconnect_delay`).
    ReconnectDelay,
    /// Seconds before I/O fails fast (ib_srp `fast_io_fail_tmo`).
    FastIoFailTmo,
    /// Seconds before an unreachable target is removed (ib_srp `dev_loss_tmo`).
    DevLossTmo,
}

impl Tunable {
    /// Every tunable.
    pub const ALL: [Tunable; 5] = [
        Tunable::QueueSize,
        Tunable::ChannelCount,
        Tunable::ReconnectDelay,
        Tunable::FastIoFailTmo,
        Tunable::DevLossTmo,
    ];

    /// The registry value name.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Tunable::QueueSize => "QueueSize",
            Tunable::ChannelCount => "ChannelCount",
            Tunable::ReconnectDelay => "ReconnectDelay",
            Tunable::FastIoFailTmo => "FastIoFailTmo",
            Tunable::DevLossTmo => "DevLossTmo",
        }
    }

    /// ib_srp's default.
    #[must_use]
    pub const fn default_value(self) -> u32 {
        match self {
            Tunable::QueueSize => 64,
            Tunable::ChannelCount => 0,
            Tunable::ReconnectDelay => 10,
            Tunable::FastIoFailTmo => 15,
            Tunable::DevLossTmo => 600,
        }
    }

    /// The accepted range (inclusive).
    #[must_use]
    pub const fn range(self) -> (u32, u32) {
        match self {
            Tunable::QueueSize => (1, 4096),
            Tunable::ChannelCount => (0, 255),
            // Seconds, as ib_srp's `int`s; a day is far past any sane value.
            Tunable::ReconnectDelay => (1, 86_400),
            Tunable::FastIoFailTmo | Tunable::DevLossTmo => (0, 86_400),
        }
    }

    /// The tunable a name denotes (case-insensitive, as registry names).
    #[must_use]
    pub fn from_name(name: &str) -> Option<Tunable> {
        Tunable::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(name))
    }
}

/// Why the configuration was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ParamError {
    /// A tunable's registry value is not a `REG_DWORD`.
    WrongType(Tunable),
    /// A tunable's value is outside its range.
    OutOfRange(Tunable, u32),
    /// `DriverParameter` is not `Name=value;...` (the byte offset).
    Syntax(usize),
    /// `DriverParameter` names no tunable.
    UnknownKey(String),
    /// `DriverParameter` names a tunable twice.
    DuplicateKey(Tunable),
    /// `DriverParameter` gives a value that is not a number.
    BadNumber(Tunable),
    /// `DriverParameter` is longer than [`MAX_DRIVER_PARAMETER_LEN`] or
    /// not ASCII.
    BadDriverParameter,
    /// More attached targets than [`MAX_TARGETS`].
    TooManyTargets(usize),
    /// No target is attached.
    NoTargets,
    /// A target subkey's name is empty, too long or not printable ASCII.
    BadTargetName(String),
    /// A target's value is missing (target, value name).
    MissingValue(String, &'static str),
    /// A target's value is not a `REG_SZ` (target, value name).
    NotAString(String, &'static str),
    /// A target's string is empty, too long or not printable ASCII
    /// (target, value name).
    BadString(String, &'static str),
    /// A target's `Protocol` is neither `srp` nor `iser`.
    UnknownProtocol(String),
    /// The SRP engine's parser refuses a target's `AddTarget` string
    /// (target, why).
    BadAddTarget(String, AddTargetError),
}

impl fmt::Display for ParamError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::WrongType(t) => write!(f, "{} is not a REG_DWORD", t.name()),
            Self::OutOfRange(t, v) => {
                let (lo, hi) = t.range();
                write!(f, "{} = {v} is outside {lo}..={hi}", t.name())
            }
            Self::Syntax(at) => write!(f, "DriverParameter: syntax error at byte {at}"),
            Self::UnknownKey(k) => write!(f, "DriverParameter: unknown key {k:?}"),
            Self::DuplicateKey(t) => write!(f, "DriverParameter: {} given twice", t.name()),
            Self::BadNumber(t) => write!(f, "DriverParameter: {} is not a number", t.name()),
            Self::BadDriverParameter => f.write_str("DriverParameter is too long or not ASCII"),
            Self::TooManyTargets(n) => write!(f, "{n} targets attached, at most {MAX_TARGETS}"),
            Self::NoTargets => f.write_str("no target attached under Parameters\\Targets"),
            Self::BadTargetName(n) => write!(f, "target key {n:?} is not a valid name"),
            Self::MissingValue(t, v) => write!(f, "target {t}: {v} is missing"),
            Self::NotAString(t, v) => write!(f, "target {t}: {v} is not a REG_SZ"),
            Self::BadString(t, v) => write!(
                f,
                "target {t}: {v} is empty, too long or not printable ASCII"
            ),
            Self::UnknownProtocol(t) => write!(f, "target {t}: Protocol is neither srp nor iser"),
            Self::BadAddTarget(t, e) => write!(f, "target {t}: AddTarget: {e}"),
        }
    }
}

/// A registry value as read: its type and data, or absent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegValue {
    /// No such value.
    Absent,
    /// `REG_DWORD`.
    Dword(u32),
    /// `REG_SZ`, as UTF-16 code units without the terminating NUL.
    String(Vec<u16>),
    /// Any other type (its `REG_*` number).
    Other(u32),
}

/// The adapter-wide tunables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tunables {
    values: [u32; 5],
}

impl Default for Tunables {
    fn default() -> Self {
        Tunables {
            values: Tunable::ALL.map(Tunable::default_value),
        }
    }
}

impl Tunables {
    /// One tunable's value.
    #[must_use]
    pub fn get(&self, t: Tunable) -> u32 {
        self.values
            .get(Tunable::ALL.iter().position(|&x| x == t).unwrap_or(0))
            .copied()
            .unwrap_or_else(|| t.default_value())
    }

    fn set(&mut self, t: Tunable, value: u32) -> Result<(), ParamError> {
        let (lo, hi) = t.range();
        if !(lo..=hi).contains(&value) {
            return Err(ParamError::OutOfRange(t, value));
        }
        if let Some(slot) = Tunable::ALL
            .iter()
            .position(|&x| x == t)
            .and_then(|i| self.values.get_mut(i))
        {
            *slot = value;
        }
        Ok(())
    }

    /// Tunables from the `Parameters` values (`value(name)` reads one);
    /// absent values keep their defaults.
    ///
    /// # Errors
    /// A present value that is not a `REG_DWORD`, or out of range.
    pub fn from_registry(mut value: impl FnMut(&str) -> RegValue) -> Result<Self, ParamError> {
        let mut tunables = Tunables::default();
        for t in Tunable::ALL {
            match value(t.name()) {
                RegValue::Absent => {}
                RegValue::Dword(v) => tunables.set(t, v)?,
                RegValue::String(_) | RegValue::Other(_) => return Err(ParamError::WrongType(t)),
            }
        }
        Ok(tunables)
    }

    /// Applies `DriverParameter` (`Name=value;...`, an empty string or a
    /// trailing `;` allowed) over these values.
    ///
    /// # Errors
    /// Syntax, unknown or repeated keys, bad numbers, out-of-range values.
    pub fn apply_driver_parameter(&mut self, text: &[u8]) -> Result<(), ParamError> {
        if text.len() > MAX_DRIVER_PARAMETER_LEN || !text.is_ascii() {
            return Err(ParamError::BadDriverParameter);
        }
        let mut seen = [false; 5];
        let mut at = 0;
        for item in text.split(|&b| b == b';') {
            let start = at;
            at += item.len() + 1;
            if item.is_empty() {
                // Only a trailing `;` (or an empty string) may leave one.
                if start < text.len() {
                    return Err(ParamError::Syntax(start));
                }
                continue;
            }
            let Some(eq) = item.iter().position(|&b| b == b'=') else {
                return Err(ParamError::Syntax(start));
            };
            let (key, value) = (
                item.get(..eq).unwrap_or(&[]),
                item.get(eq + 1..).unwrap_or(&[]),
            );
            // ASCII was checked, so these are str.
            let key = core::str::from_utf8(key).map_err(|_| ParamError::Syntax(start))?;
            if key.is_empty() || !key.bytes().all(|b| b.is_ascii_alphanumeric()) {
                return Err(ParamError::Syntax(start));
            }
            let t = Tunable::from_name(key).ok_or_else(|| ParamError::UnknownKey(key.into()))?;
            let index = Tunable::ALL.iter().position(|&x| x == t).unwrap_or(0);
            if let Some(flag) = seen.get_mut(index) {
                if *flag {
                    return Err(ParamError::DuplicateKey(t));
                }
                *flag = true;
            }
            let number = parse_number(value).ok_or(ParamError::BadNumber(t))?;
            self.set(t, number)?;
        }
        Ok(())
    }
}

/// A decimal (no leading zero, no sign) or `0x`-hex `u32`.
fn parse_number(text: &[u8]) -> Option<u32> {
    let (digits, radix) = match text {
        [b'0', b'x' | b'X', rest @ ..] => (rest, 16),
        [b'0', _, ..] => return None,
        _ => (text, 10),
    };
    if digits.is_empty() || digits.len() > 10 {
        return None;
    }
    let mut value: u32 = 0;
    for &d in digits {
        let digit = char::from(d).to_digit(radix)?;
        value = value.checked_mul(radix)?.checked_add(digit)?;
    }
    Some(value)
}

/// How a target is reached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Protocol {
    /// SRP: the ib_srp `add_target` string.
    Srp {
        /// `id_ext=...,ioc_guid=...,...`, as written to Linux's `add_target`.
        add_target: String,
    },
    /// iSER: an iSCSI target and a portal.
    Iser {
        /// The target's IQN.
        target_name: String,
        /// `host:port`.
        portal: String,
    },
}

/// One attached target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attachment {
    /// The subkey's name.
    pub name: String,
    /// How to reach it.
    pub protocol: Protocol,
}

/// A printable-ASCII string of at most `max` characters.
fn printable(units: &[u16], max: usize) -> Option<String> {
    if units.is_empty() || units.len() > max {
        return None;
    }
    units
        .iter()
        .map(|&u| {
            u8::try_from(u)
                .ok()
                .filter(|b| (0x20..0x7F).contains(b))
                .map(char::from)
        })
        .collect()
}

impl Attachment {
    /// A target from its subkey name and values (`value(name)` reads one).
    ///
    /// # Errors
    /// A bad name, a missing or mistyped value, an unknown protocol, an
    /// `AddTarget` string the SRP engine refuses.
    pub fn parse(key: &[u16], mut value: impl FnMut(&str) -> RegValue) -> Result<Self, ParamError> {
        let name = printable(key, MAX_TARGET_KEY_LEN)
            .ok_or_else(|| ParamError::BadTargetName(String::from_utf16_lossy(key)))?;
        let mut string = |value_name: &'static str, max: usize| -> Result<String, ParamError> {
            match value(value_name) {
                RegValue::Absent => Err(ParamError::MissingValue(name.clone(), value_name)),
                RegValue::String(units) => printable(&units, max)
                    .ok_or_else(|| ParamError::BadString(name.clone(), value_name)),
                RegValue::Dword(_) | RegValue::Other(_) => {
                    Err(ParamError::NotAString(name.clone(), value_name))
                }
            }
        };
        let protocol = string("Protocol", 8)?;
        let protocol = if protocol.eq_ignore_ascii_case("srp") {
            let add_target = string("AddTarget", MAX_ADD_TARGET_LEN)?;
            if let Err(e) = parse_add_target(add_target.as_bytes()) {
                return Err(ParamError::BadAddTarget(name, e));
            }
            Protocol::Srp { add_target }
        } else if protocol.eq_ignore_ascii_case("iser") {
            Protocol::Iser {
                target_name: string("TargetName", MAX_TARGET_NAME_LEN)?,
                portal: string("Portal", MAX_PORTAL_LEN)?,
            }
        } else {
            return Err(ParamError::UnknownProtocol(name));
        };
        Ok(Attachment { name, protocol })
    }
}

/// Everything the driver was configured with, for one adapter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// The tunables, `DriverParameter` applied.
    pub tunables: Tunables,
    /// The attached targets, in StorPort target id order.
    pub targets: Vec<Attachment>,
}

impl Settings {
    /// Checks the target count and orders the targets by name
    /// (case-insensitive, as the registry orders subkeys), which is the
    /// StorPort target id order.
    ///
    /// # Errors
    /// No target, or more than [`MAX_TARGETS`].
    pub fn new(tunables: Tunables, mut targets: Vec<Attachment>) -> Result<Self, ParamError> {
        if targets.is_empty() {
            return Err(ParamError::NoTargets);
        }
        if targets.len() > MAX_TARGETS {
            return Err(ParamError::TooManyTargets(targets.len()));
        }
        // An insertion sort: at most MAX_TARGETS entries, and no scratch
        // buffer on the kernel stack (the library sorts keep kilobytes there).
        let key = |t: &Attachment| -> alloc::vec::Vec<u8> {
            t.name.bytes().map(|c| c.to_ascii_lowercase()).collect()
        };
        for i in 1..targets.len() {
            let mut j = i;
            while j > 0 {
                let out_of_order = match (targets.get(j - 1), targets.get(j)) {
                    (Some(a), Some(b)) => key(a) > key(b),
                    _ => false,
                };
                if !out_of_order {
                    break;
                }
                targets.swap(j - 1, j);
                j -= 1;
            }
        }
        Ok(Settings { tunables, targets })
    }

    /// The core's adapter shape: one bus, a target id per attachment,
    /// `QueueSize` commands per LUN and per target, as many per adapter as
    /// the targets together (bounded by the core's tag space).
    #[must_use]
    pub fn adapter_config(&self) -> AdapterConfig {
        // CAST: at most MAX_TARGETS (128), checked by `new`.
        let targets = self.targets.len().min(MAX_TARGETS) as u8;
        let queue = self.tunables.get(Tunable::QueueSize);
        let tag_space = u32::try_from(MAX_SLOTS).unwrap_or(u32::MAX) - TMF_SLOTS;
        AdapterConfig {
            targets,
            luns_per_target: LUNS_PER_TARGET,
            max_io: queue.saturating_mul(u32::from(targets)).min(tag_space),
            max_io_per_lun: queue,
            max_transfer_bytes: MAX_TRANSFER_BYTES,
            // CAST: MAX_SG_ELEMENTS is 257.
            physical_breaks: MAX_SG_ELEMENTS as u32 - 1,
        }
    }
}

/// Reading the service's registry key (`PASSIVE_LEVEL` only).
pub mod registry {
    use alloc::vec;
    use alloc::vec::Vec;
    use core::mem::{offset_of, size_of};
    use core::ptr::null_mut;

    use kverbs::irql::Passive;

    use super::{Attachment, ParamError, RegValue, Settings, Tunables};
    use crate::nt::ffi::{
        _KEY_INFORMATION_CLASS, _KEY_VALUE_INFORMATION_CLASS, HANDLE, KEY_BASIC_INFORMATION,
        KEY_READ, KEY_VALUE_PARTIAL_INFORMATION, OBJ_CASE_INSENSITIVE, OBJ_KERNEL_HANDLE,
        REG_DWORD, REG_SZ, STATUS_BUFFER_OVERFLOW, STATUS_BUFFER_TOO_SMALL, STATUS_NO_MORE_ENTRIES,
        STATUS_SUCCESS, UNICODE_STRING, ZwClose, ZwEnumerateKey, ZwOpenKey, ZwQueryValueKey,
        object_attributes,
    };

    /// Why reading failed (before any parsing).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum ReadError {
        /// A key could not be opened (the `NTSTATUS`).
        Open(i32),
        /// A value or subkey could not be read (the `NTSTATUS`).
        Query(i32),
        /// A name does not fit a `UNICODE_STRING`.
        NameTooLong,
    }

    /// Everything `find_adapter` needs, or why not.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub enum ConfigError {
        /// The registry could not be read.
        Read(ReadError),
        /// What it holds is refused.
        Param(ParamError),
    }

    /// An open registry key, closed on drop.
    struct Key(HANDLE);

    impl Drop for Key {
        fn drop(&mut self) {
            // SAFETY: a handle this module opened; PASSIVE_LEVEL (every
            // function here takes the token).
            unsafe { ZwClose(self.0) };
        }
    }

    /// A counted string over `units` (which must outlive its use).
    fn counted(units: &mut [u16]) -> Result<UNICODE_STRING, ReadError> {
        let bytes = u16::try_from(units.len() * 2).map_err(|_| ReadError::NameTooLong)?;
        Ok(UNICODE_STRING {
            Length: bytes,
            MaximumLength: bytes,
            Buffer: units.as_mut_ptr(),
        })
    }

    fn wide(s: &str) -> Vec<u16> {
        s.encode_utf16().collect()
    }

    impl Key {
        /// Opens `path` (absolute when `parent` is `None`, else relative).
        fn open(
            parent: Option<&Key>,
            path: &mut [u16],
            _irql: &Passive<'_>,
        ) -> Result<Key, ReadError> {
            let mut name = counted(path)?;
            let mut attributes =
                object_attributes(&raw mut name, OBJ_CASE_INSENSITIVE | OBJ_KERNEL_HANDLE);
            attributes.RootDirectory = parent.map_or(null_mut(), |p| p.0);
            let mut handle: HANDLE = null_mut();
            // SAFETY: PASSIVE_LEVEL (token); a valid counted name and
            // attributes that live across the call.
            let status = unsafe { ZwOpenKey(&raw mut handle, KEY_READ, &raw mut attributes) };
            if status != STATUS_SUCCESS {
                return Err(ReadError::Open(status));
            }
            Ok(Key(handle))
        }

        /// One value.
        fn value(&self, name: &str, irql: &Passive<'_>) -> Result<RegValue, ReadError> {
            let _ = irql;
            let mut units = wide(name);
            let mut counted_name = counted(&mut units)?;
            let mut buffer = vec![0u64; 16];
            loop {
                // CAST: the buffer is small (grown on demand, bounded below).
                let length = (buffer.len() * 8) as u32;
                let mut needed = 0u32;
                // SAFETY: PASSIVE_LEVEL; a buffer of `length` bytes, 8-aligned.
                let status = unsafe {
                    ZwQueryValueKey(
                        self.0,
                        &raw mut counted_name,
                        _KEY_VALUE_INFORMATION_CLASS::KeyValuePartialInformation,
                        buffer.as_mut_ptr().cast(),
                        length,
                        &raw mut needed,
                    )
                };
                if status == STATUS_BUFFER_OVERFLOW || status == STATUS_BUFFER_TOO_SMALL {
                    let words = (needed as usize).div_ceil(8);
                    if words <= buffer.len() || words > 4096 {
                        return Err(ReadError::Query(status));
                    }
                    buffer.resize(words, 0);
                    continue;
                }
                if status == crate::nt::ffi::STATUS_OBJECT_NAME_NOT_FOUND {
                    return Ok(RegValue::Absent);
                }
                if status != STATUS_SUCCESS {
                    return Err(ReadError::Query(status));
                }
                return Ok(decode(&buffer));
            }
        }

        /// The names of all subkeys.
        fn subkeys(&self, _irql: &Passive<'_>) -> Result<Vec<Vec<u16>>, ReadError> {
            let mut names = Vec::new();
            let mut buffer = vec![0u64; 64];
            for index in 0u32.. {
                // CAST: 512 bytes.
                let length = (buffer.len() * 8) as u32;
                let mut needed = 0u32;
                // SAFETY: PASSIVE_LEVEL; a buffer of `length` bytes, 8-aligned.
                let status = unsafe {
                    ZwEnumerateKey(
                        self.0,
                        index,
                        _KEY_INFORMATION_CLASS::KeyBasicInformation,
                        buffer.as_mut_ptr().cast(),
                        length,
                        &raw mut needed,
                    )
                };
                if status == STATUS_NO_MORE_ENTRIES {
                    break;
                }
                if status != STATUS_SUCCESS {
                    return Err(ReadError::Query(status));
                }
                let bytes = as_bytes(&buffer);
                let name_length =
                    read_u32(bytes, offset_of!(KEY_BASIC_INFORMATION, NameLength)) as usize;
                let start = offset_of!(KEY_BASIC_INFORMATION, Name);
                let name = bytes
                    .get(start..start.saturating_add(name_length))
                    .ok_or(ReadError::Query(status))?;
                names.push(utf16(name));
                if names.len() > super::MAX_TARGETS {
                    break;
                }
            }
            Ok(names)
        }
    }

    fn as_bytes(words: &[u64]) -> &[u8] {
        // SAFETY: any u64 slice is a valid byte slice of eight times its
        // length; the borrow keeps it alive.
        unsafe { core::slice::from_raw_parts(words.as_ptr().cast(), words.len() * 8) }
    }

    /// Little-endian UTF-16 code units.
    fn utf16(bytes: &[u8]) -> Vec<u16> {
        bytes
            .chunks_exact(2)
            .map(|c| <[u8; 2]>::try_from(c).map_or(0, u16::from_le_bytes))
            .collect()
    }

    fn read_u32(bytes: &[u8], at: usize) -> u32 {
        bytes
            .get(at..at + 4)
            .and_then(|b| b.try_into().ok())
            .map_or(0, u32::from_le_bytes)
    }

    /// A `KEY_VALUE_PARTIAL_INFORMATION` as a [`RegValue`].
    fn decode(buffer: &[u64]) -> RegValue {
        let bytes = as_bytes(buffer);
        let kind = read_u32(bytes, offset_of!(KEY_VALUE_PARTIAL_INFORMATION, Type));
        let length =
            read_u32(bytes, offset_of!(KEY_VALUE_PARTIAL_INFORMATION, DataLength)) as usize;
        let start = offset_of!(KEY_VALUE_PARTIAL_INFORMATION, Data);
        let Some(data) = bytes.get(start..start.saturating_add(length)) else {
            return RegValue::Other(kind);
        };
        match kind {
            REG_DWORD if data.len() == size_of::<u32>() => RegValue::Dword(read_u32(data, 0)),
            REG_SZ if data.len() % 2 == 0 => {
                let mut units = utf16(data);
                if units.last() == Some(&0) {
                    units.pop();
                }
                RegValue::String(units)
            }
            other => RegValue::Other(other),
        }
    }

    /// Reads `<service>\Parameters` and its `Targets` subkeys and parses
    /// them, with `driver_parameter` applied over the tunables.
    ///
    /// # Errors
    /// [`ConfigError`]: unreadable, or refused by the parsers.
    ///
    /// # IRQL
    /// `PASSIVE_LEVEL`.
    pub fn read(
        service: &[u16],
        driver_parameter: Option<&[u8]>,
        irql: &Passive<'_>,
    ) -> Result<Settings, ConfigError> {
        let mut path = service.to_vec();
        path.extend(wide("\\Parameters"));
        let parameters = Key::open(None, &mut path, irql).map_err(ConfigError::Read)?;
        let lookup = |key: &Key, name: &str| key.value(name, irql);
        let mut failure = None;
        let mut tunables = Tunables::from_registry(|name| {
            lookup(&parameters, name).unwrap_or_else(|e| {
                failure = Some(e);
                RegValue::Absent
            })
        })
        .map_err(ConfigError::Param)?;
        if let Some(e) = failure {
            return Err(ConfigError::Read(e));
        }
        if let Some(text) = driver_parameter {
            tunables
                .apply_driver_parameter(text)
                .map_err(ConfigError::Param)?;
        }
        let mut targets_name = wide("Targets");
        let targets_key = match Key::open(Some(&parameters), &mut targets_name, irql) {
            Ok(k) => Some(k),
            Err(ReadError::Open(s)) if s == crate::nt::ffi::STATUS_OBJECT_NAME_NOT_FOUND => None,
            Err(e) => return Err(ConfigError::Read(e)),
        };
        let mut targets = Vec::new();
        if let Some(targets_key) = targets_key {
            for mut name in targets_key.subkeys(irql).map_err(ConfigError::Read)? {
                let key =
                    Key::open(Some(&targets_key), &mut name, irql).map_err(ConfigError::Read)?;
                let mut failure = None;
                let attachment = Attachment::parse(&name, |value| {
                    lookup(&key, value).unwrap_or_else(|e| {
                        failure = Some(e);
                        RegValue::Absent
                    })
                });
                if let Some(e) = failure {
                    return Err(ConfigError::Read(e));
                }
                targets.push(attachment.map_err(ConfigError::Param)?);
            }
        }
        Settings::new(tunables, targets).map_err(ConfigError::Param)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::string::ToString;

    fn wide(s: &str) -> Vec<u16> {
        s.encode_utf16().collect()
    }

    fn dwords<'a>(values: &'a [(&'a str, u32)]) -> impl Fn(&str) -> RegValue + 'a {
        move |name| {
            values
                .iter()
                .find(|(n, _)| *n == name)
                .map_or(RegValue::Absent, |&(_, v)| RegValue::Dword(v))
        }
    }

    #[test]
    fn absent_values_take_ib_srp_defaults() {
        let t = Tunables::from_registry(|_| RegValue::Absent).unwrap();
        assert_eq!(t, Tunables::default());
        assert_eq!(t.get(Tunable::QueueSize), 64);
        assert_eq!(t.get(Tunable::DevLossTmo), 600);
    }

    #[test]
    fn registry_values_are_typed_and_ranged() {
        let t = Tunables::from_registry(dwords(&[("QueueSize", 32), ("ChannelCount", 4)])).unwrap();
        assert_eq!(
            (t.get(Tunable::QueueSize), t.get(Tunable::ChannelCount)),
            (32, 4)
        );
        assert_eq!(
            Tunables::from_registry(dwords(&[("QueueSize", 0)])),
            Err(ParamError::OutOfRange(Tunable::QueueSize, 0))
        );
        assert_eq!(
            Tunables::from_registry(dwords(&[("ReconnectDelay", 0)])),
            Err(ParamError::OutOfRange(Tunable::ReconnectDelay, 0))
        );
        assert_eq!(
            Tunables::from_registry(|n| if n == "DevLossTmo" {
                RegValue::String(wide("600"))
            } else {
                RegValue::Absent
            }),
            Err(ParamError::WrongType(Tunable::DevLossTmo))
        );
        assert_eq!(
            Tunables::from_registry(|n| if n == "QueueSize" {
                RegValue::Other(11)
            } else {
                RegValue::Absent
            }),
            Err(ParamError::WrongType(Tunable::QueueSize))
        );
    }

    #[test]
    fn driver_parameter_overrides_strictly() {
        let mut t = Tunables::default();
        t.apply_driver_parameter(b"").unwrap();
        t.apply_driver_parameter(b"QueueSize=32;channelcount=0x8;")
            .unwrap();
        assert_eq!(
            (t.get(Tunable::QueueSize), t.get(Tunable::ChannelCount)),
            (32, 8)
        );
        let cases: [(&[u8], ParamError); 11] = [
            (b"QueueSize", ParamError::Syntax(0)),
            (b"QueueSize=1;;ChannelCount=1", ParamError::Syntax(12)),
            (b";", ParamError::Syntax(0)),
            (b"=5", ParamError::Syntax(0)),
            (b"Queue Size=5", ParamError::Syntax(0)),
            (b"Bogus=1", ParamError::UnknownKey("Bogus".to_string())),
            (
                b"QueueSize=1;QUEUESIZE=2",
                ParamError::DuplicateKey(Tunable::QueueSize),
            ),
            (b"QueueSize=012", ParamError::BadNumber(Tunable::QueueSize)),
            (b"QueueSize=0x", ParamError::BadNumber(Tunable::QueueSize)),
            (
                b"QueueSize=99999999999",
                ParamError::BadNumber(Tunable::QueueSize),
            ),
            (
                b"QueueSize=5000",
                ParamError::OutOfRange(Tunable::QueueSize, 5000),
            ),
        ];
        for (text, expected) in cases {
            let mut t = Tunables::default();
            assert_eq!(
                t.apply_driver_parameter(text),
                Err(expected),
                "{:?}",
                core::str::from_utf8(text)
            );
        }
        let mut t = Tunables::default();
        assert_eq!(
            t.apply_driver_parameter("QueueSize=1é".as_bytes()),
            Err(ParamError::BadDriverParameter)
        );
        assert_eq!(
            t.apply_driver_parameter(&[b'a'; MAX_DRIVER_PARAMETER_LEN + 1]),
            Err(ParamError::BadDriverParameter)
        );
    }

    #[test]
    fn numbers_are_decimal_or_hex_and_bounded() {
        assert_eq!(parse_number(b"0"), Some(0));
        assert_eq!(parse_number(b"4294967295"), Some(u32::MAX));
        assert_eq!(parse_number(b"4294967296"), None);
        assert_eq!(parse_number(b"0xFFFFFFFF"), Some(u32::MAX));
        assert_eq!(parse_number(b"0x100000000"), None);
        assert_eq!(parse_number(b"-1"), None);
        assert_eq!(parse_number(b"+1"), None);
        assert_eq!(parse_number(b""), None);
        assert_eq!(parse_number(b"1 "), None);
    }

    fn strings<'a>(values: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> RegValue + 'a {
        move |name| {
            values
                .iter()
                .find(|(n, _)| *n == name)
                .map_or(RegValue::Absent, |&(_, v)| RegValue::String(wide(v)))
        }
    }

    const GOOD_ADD_TARGET: &str = "id_ext=1,ioc_guid=2,dest=192.0.2.7:5555";

    #[test]
    fn attachments_parse_both_protocols() {
        let srp = Attachment::parse(
            &wide("array1"),
            strings(&[("Protocol", "srp"), ("AddTarget", GOOD_ADD_TARGET)]),
        )
        .unwrap();
        assert_eq!(
            srp.protocol,
            Protocol::Srp {
                add_target: GOOD_ADD_TARGET.into()
            }
        );
        let iser = Attachment::parse(
            &wide("lio1"),
            strings(&[
                ("Protocol", "ISER"),
                ("TargetName", "iqn.2003-01.org.linux-iscsi:x"),
                ("Portal", "192.0.2.10:3260"),
            ]),
        )
        .unwrap();
        assert_eq!(iser.name, "lio1");
        assert!(matches!(iser.protocol, Protocol::Iser { .. }));
    }

    #[test]
    fn malformed_attachments_get_specific_errors() {
        let name = || "t".to_string();
        type Case<'a> = (Vec<u16>, Vec<(&'a str, &'a str)>, ParamError);
        let cases: [Case<'_>; 6] = [
            (wide(""), vec![], ParamError::BadTargetName(String::new())),
            (
                wide("t"),
                vec![],
                ParamError::MissingValue(name(), "Protocol"),
            ),
            (
                wide("t"),
                vec![("Protocol", "fc")],
                ParamError::UnknownProtocol(name()),
            ),
            (
                wide("t"),
                vec![("Protocol", "srp")],
                ParamError::MissingValue(name(), "AddTarget"),
            ),
            (
                wide("t"),
                vec![("Protocol", "srp"), ("AddTarget", "")],
                ParamError::BadString(name(), "AddTarget"),
            ),
            (
                wide("t"),
                vec![
                    ("Protocol", "iser"),
                    ("TargetName", "iqn.x"),
                    ("Portal", "a\tb"),
                ],
                ParamError::BadString(name(), "Portal"),
            ),
        ];
        for (key, values, expected) in cases {
            assert_eq!(Attachment::parse(&key, strings(&values)), Err(expected));
        }
        assert_eq!(
            Attachment::parse(&wide("t"), |_| RegValue::Dword(1)),
            Err(ParamError::NotAString(name(), "Protocol"))
        );
        let long = "x".repeat(MAX_ADD_TARGET_LEN + 1);
        assert_eq!(
            Attachment::parse(
                &wide("t"),
                strings(&[("Protocol", "srp"), ("AddTarget", &long)])
            ),
            Err(ParamError::BadString(name(), "AddTarget"))
        );
        // Well-formed as a string, refused by the SRP engine's parser
        // (no destination), with the parser's reason.
        let no_dest = "id_ext=1,ioc_guid=2";
        let Err(why) = crate::srp::params::parse_add_target(no_dest.as_bytes()) else {
            panic!("{no_dest} parsed");
        };
        assert_eq!(
            Attachment::parse(
                &wide("t"),
                strings(&[("Protocol", "srp"), ("AddTarget", no_dest)])
            ),
            Err(ParamError::BadAddTarget(name(), why))
        );
        assert_eq!(
            Attachment::parse(&[0xD800], |_| RegValue::Absent),
            Err(ParamError::BadTargetName("\u{FFFD}".into()))
        );
    }

    fn srp(name: &str) -> Attachment {
        Attachment {
            name: name.into(),
            protocol: Protocol::Srp {
                add_target: "id_ext=1".into(),
            },
        }
    }

    #[test]
    fn settings_order_targets_and_shape_the_adapter() {
        let mut tunables = Tunables::default();
        tunables.apply_driver_parameter(b"QueueSize=16").unwrap();
        let s = Settings::new(tunables, vec![srp("b"), srp("A"), srp("c")]).unwrap();
        let names: Vec<&str> = s.targets.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["A", "b", "c"]);
        let c = s.adapter_config();
        assert_eq!((c.targets, c.luns_per_target), (3, LUNS_PER_TARGET));
        assert_eq!((c.max_io, c.max_io_per_lun), (48, 16));
        assert_eq!(c.physical_breaks, MAX_SG_ELEMENTS as u32 - 1);
        assert_eq!(
            Settings::new(Tunables::default(), vec![]),
            Err(ParamError::NoTargets)
        );
        let many = (0..=MAX_TARGETS).map(|i| srp(&i.to_string())).collect();
        assert_eq!(
            Settings::new(Tunables::default(), many),
            Err(ParamError::TooManyTargets(MAX_TARGETS + 1))
        );
    }

    #[test]
    fn errors_read_as_sentences() {
        assert_eq!(
            ParamError::OutOfRange(Tunable::QueueSize, 0).to_string(),
            "QueueSize = 0 is outside 1..=4096"
        );
        assert_eq!(
            ParamError::MissingValue("lio1".into(), "Portal").to_string(),
            "target lio1: Portal is missing"
        );
    }
}
