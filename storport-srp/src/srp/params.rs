//! Target attachment parameters, exactly as Linux `ib_srp`'s `add_target`
//! takes them, and the three recovery timeouts of the SRP transport.
//!
//! The driver reads one `AddTarget` string per attached target from the
//! registry (the INF writes them; `kv-sys` checks them with this same
//! parser, so the tool and the driver agree byte for byte). The string is
//! untrusted: [`parse_add_target`] is total, allocates nothing, and every
//! malformed input gets a specific [`ParamError`] naming the key.
//!
//! # The grammar
//! `key=value` items separated by `,`, keys as Linux spells them (see
//! [`Key`]). Stricter than Linux where Linux is lax, because a typo in a
//! registry value should not silently attach a different target:
//!
//! * an empty item (`a=1,,b=2`), an item without `=`, an unknown key, or a
//!   key given twice is an error (Linux skips empty items and lets the last
//!   duplicate win);
//! * hexadecimal values (`id_ext`, `ioc_guid`, `service_id`,
//!   `initiator_ext`, `pkey`, `io_class`) are 1 to 16 hex digits with an
//!   optional `0x`; `dgid` is exactly 32 hex digits; decimal values are
//!   plain digits (Linux's `match_int` would also take octal and `0x`);
//! * `allow_ext_sg` is `0` or `1`;
//! * `dest` is `a.b.c.d:port` (IPv6 `[..]:port` is recognised and refused
//!   with [`ParamError::Ipv6Unsupported`]: the connection manager speaks
//!   IPv4 RDMA/CM only); `src` is `a.b.c.d` with an optional `:port`;
//! * one of Linux's two mandatory sets must be complete —
//!   `id_ext,ioc_guid,dgid,pkey,service_id` (IB CM) or
//!   `id_ext,ioc_guid,dest` (RDMA/CM) — and the two forms do not mix;
//! * values that contradict each other are refused (`max_cmd_per_lun`
//!   above `queue_size`, `src` without `dest`), where Linux only warns.
//!
//! # Ranges (Linux's, with upper bounds where Linux has none)
//! `queue_size` 1..=4096, `max_cmd_per_lun` and `target_can_queue` >= 1,
//! `cmd_sg_entries` 1..=255, `sg_tablesize` 1..=2048 (`SG_MAX_SEGMENTS`),
//! `tl_retry_count` 2..=7, `ch_count` 1..=64, `max_sect` 1..=65536 (32
//! MiB), `max_it_iu_size` 0 (no limit) or 64..=0x10_0000, `pkey` 16 bits,
//! `io_class` 0xff00 (SRP r10) or 0x0100 (SRP r16a).
//!
//! # IRQL
//! Pure computation over the caller's bytes: any IRQL.

#![forbid(unsafe_code)]

use core::fmt;
use core::time::Duration;

/// One `add_target` key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Key {
    /// `id_ext`: the target port's identifier extension (hex).
    IdExt,
    /// `ioc_guid`: the I/O controller GUID (hex).
    IocGuid,
    /// `dgid`: the target port's GID, 32 hex digits (IB CM).
    Dgid,
    /// `pkey`: the partition key (hex, IB CM).
    Pkey,
    /// `service_id`: the CM service ID (hex, IB CM).
    ServiceId,
    /// `dest`: the target's IPv4 address and port (RDMA/CM).
    Dest,
    /// `src`: the initiator's IPv4 address (RDMA/CM).
    Src,
    /// `max_sect`: largest transfer in 512-byte sectors.
    MaxSect,
    /// `max_cmd_per_lun`: outstanding commands per LUN.
    MaxCmdPerLun,
    /// `queue_size`: outstanding commands per channel (`can_queue`).
    QueueSize,
    /// `ch_count`: RC channels to the target.
    ChCount,
    /// `cmd_sg_entries`: data buffer descriptors carried in an `SRP_CMD`.
    CmdSgEntries,
    /// `sg_tablesize`: scatter/gather elements per request.
    SgTablesize,
    /// `comp_vector`: the first completion vector.
    CompVector,
    /// `tl_retry_count`: RC transport retries (2..=7).
    TlRetryCount,
    /// `max_it_iu_size`: cap on the initiator-to-target IU length.
    MaxItIuSize,
    /// `initiator_ext`: the initiator port identifier extension (hex).
    InitiatorExt,
    /// `target_can_queue`: outstanding commands per target.
    TargetCanQueue,
    /// `allow_ext_sg`: whether indirect tables may exceed the IU (0/1).
    AllowExtSg,
    /// `io_class`: SRP revision of the port identifiers (hex).
    IoClass,
}

impl Key {
    /// Every key, in the order Linux's `srp_opt_tokens` lists them.
    pub const ALL: [Key; 20] = [
        Key::IdExt,
        Key::IocGuid,
        Key::Dgid,
        Key::Pkey,
        Key::ServiceId,
        Key::MaxSect,
        Key::MaxCmdPerLun,
        Key::TargetCanQueue,
        Key::IoClass,
        Key::InitiatorExt,
        Key::CmdSgEntries,
        Key::AllowExtSg,
        Key::SgTablesize,
        Key::CompVector,
        Key::TlRetryCount,
        Key::QueueSize,
        Key::Src,
        Key::Dest,
        Key::MaxItIuSize,
        Key::ChCount,
    ];

    /// The key as written in an `add_target` string.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Key::IdExt => "id_ext",
            Key::IocGuid => "ioc_guid",
            Key::Dgid => "dgid",
            Key::Pkey => "pkey",
            Key::ServiceId => "service_id",
            Key::Dest => "dest",
            Key::Src => "src",
            Key::MaxSect => "max_sect",
            Key::MaxCmdPerLun => "max_cmd_per_lun",
            Key::QueueSize => "queue_size",
            Key::ChCount => "ch_count",
            Key::CmdSgEntries => "cmd_sg_entries",
            Key::SgTablesize => "sg_tablesize",
            Key::CompVector => "comp_vector",
            Key::TlRetryCount => "tl_retry_count",
            Key::MaxItIuSize => "max_it_iu_size",
            Key::InitiatorExt => "initiator_ext",
            Key::TargetCanQueue => "target_can_queue",
            Key::AllowExtSg => "allow_ext_sg",
            Key::IoClass => "io_class",
        }
    }

    /// The key named `name` (case-sensitive, as Linux).
    #[must_use]
    pub fn from_name(name: &[u8]) -> Option<Key> {
        Key::ALL
            .iter()
            .copied()
            .find(|k| k.name().as_bytes() == name)
    }

    const fn bit(self) -> u32 {
        1 << (self as u32)
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why an `add_target` string was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ParamError {
    /// The string is empty.
    Empty,
    /// An empty item (two commas in a row, or a comma at either end);
    /// `at` is its byte offset.
    EmptyItem {
        /// Byte offset in the string.
        at: usize,
    },
    /// An item without `=`; it spans `at..at + len`.
    NotKeyValue {
        /// Byte offset in the string.
        at: usize,
        /// Length of the item.
        len: usize,
    },
    /// A key `ib_srp` does not know; it spans `at..at + len`.
    UnknownKey {
        /// Byte offset in the string.
        at: usize,
        /// Length of the key.
        len: usize,
    },
    /// The key appears twice.
    DuplicateKey {
        /// The key.
        key: Key,
    },
    /// The value is not a number of the key's form (hex or decimal, too
    /// many digits, empty).
    BadNumber {
        /// The key.
        key: Key,
    },
    /// The value is a number outside the key's range.
    OutOfRange {
        /// The key.
        key: Key,
    },
    /// The value is not an address of the key's form.
    BadAddress {
        /// The key.
        key: Key,
    },
    /// An IPv6 address: recognised, not supported.
    Ipv6Unsupported {
        /// The key.
        key: Key,
    },
    /// A mandatory key is missing.
    Missing {
        /// The first missing key of the form the string uses.
        key: Key,
    },
    /// Two keys of different forms (IB CM and RDMA/CM), or a key that
    /// needs another one absent.
    Conflict {
        /// The key refused.
        key: Key,
        /// The key it conflicts with (or needs).
        with: Key,
    },
    /// Two values contradict each other.
    Inconsistent {
        /// The key refused.
        key: Key,
        /// The key it contradicts.
        with: Key,
    },
}

impl fmt::Display for ParamError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Empty => f.write_str("empty add_target string"),
            Self::EmptyItem { at } => write!(f, "empty item at offset {at}"),
            Self::NotKeyValue { at, .. } => write!(f, "item at offset {at} is not key=value"),
            Self::UnknownKey { at, .. } => write!(f, "unknown key at offset {at}"),
            Self::DuplicateKey { key } => write!(f, "{key} given twice"),
            Self::BadNumber { key } => write!(f, "{key}: not a valid number"),
            Self::OutOfRange { key } => write!(f, "{key}: value out of range"),
            Self::BadAddress { key } => write!(f, "{key}: not a valid address"),
            Self::Ipv6Unsupported { key } => write!(f, "{key}: IPv6 is not supported"),
            Self::Missing { key } => write!(f, "{key} is missing"),
            Self::Conflict { key, with } => write!(f, "{key} conflicts with {with}"),
            Self::Inconsistent { key, with } => write!(f, "{key} contradicts {with}"),
        }
    }
}

/// How the target is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Addressing {
    /// InfiniBand CM: the login rides in the REQ's 92 bytes.
    IbCm {
        /// The target port's GID.
        dgid: [u8; 16],
        /// The partition key.
        pkey: u16,
        /// The service ID the target listens on.
        service_id: u64,
    },
    /// RDMA/CM (RoCE): the login follows the 36-byte RDMA/CM header.
    RdmaCm {
        /// The initiator's IPv4 address (`None`: the port's own).
        src: Option<[u8; 4]>,
        /// The target's IPv4 address.
        dest: [u8; 4],
        /// The target's RDMA/CM port (`RDMA_PS_TCP << 16 | port`).
        port: u16,
    },
}

/// The SRP revision of the port identifiers (`io_class`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum IoClass {
    /// 0x0100, SRP r16a: identifiers are `id_ext || guid`.
    #[default]
    Rev16a,
    /// 0xff00, SRP r10: the two halves swapped.
    Rev10,
}

impl IoClass {
    /// The wire value.
    #[must_use]
    pub const fn code(self) -> u16 {
        match self {
            IoClass::Rev16a => 0x0100,
            IoClass::Rev10 => 0xff00,
        }
    }
}

/// Linux's `SRP_DEFAULT_QUEUE_SIZE`.
pub const DEFAULT_QUEUE_SIZE: u32 = 64;
/// Linux's default `cmd_sg_entries`.
pub const DEFAULT_CMD_SG_ENTRIES: u8 = 12;
/// Default `max_sect`: 1 MiB (Linux's template has 1024 sectors; the
/// miniport's default transfer is 1 MiB, which Windows class drivers use).
pub const DEFAULT_MAX_SECT: u32 = 2048;
/// Default `tl_retry_count`.
pub const DEFAULT_TL_RETRY_COUNT: u8 = 7;
/// Largest `sg_tablesize` (`SG_MAX_SEGMENTS`).
pub const MAX_SG_TABLESIZE: u32 = 2048;
/// Largest `queue_size`.
pub const MAX_QUEUE_SIZE: u32 = 4096;
/// Largest `ch_count`.
pub const MAX_CH_COUNT: u32 = 64;
/// Largest `max_sect` (32 MiB).
pub const MAX_MAX_SECT: u32 = 65536;
/// Smallest non-zero `max_it_iu_size` (an `SRP_LOGIN_REQ`'s length).
pub const MIN_IT_IU_SIZE: u32 = 64;
/// Largest `max_it_iu_size`.
pub const MAX_IT_IU_SIZE: u32 = 0x10_0000;

/// One attached target, as parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TargetParams {
    /// `id_ext`.
    pub id_ext: u64,
    /// `ioc_guid`.
    pub ioc_guid: u64,
    /// How the target is reached.
    pub addressing: Addressing,
    /// `max_sect` (512-byte sectors).
    pub max_sect: u32,
    /// `max_cmd_per_lun`.
    pub max_cmd_per_lun: u32,
    /// `queue_size`: commands per channel.
    pub queue_size: u32,
    /// `ch_count` (`None`: the engine's default).
    pub ch_count: Option<u32>,
    /// `cmd_sg_entries`.
    pub cmd_sg_entries: u8,
    /// `sg_tablesize`.
    pub sg_tablesize: u32,
    /// `comp_vector`.
    pub comp_vector: u32,
    /// `tl_retry_count`.
    pub tl_retry_count: u8,
    /// `max_it_iu_size` (`None`: no cap).
    pub max_it_iu_size: Option<u32>,
    /// `initiator_ext`.
    pub initiator_ext: u64,
    /// `target_can_queue` (`None`: unlimited).
    pub target_can_queue: Option<u32>,
    /// `allow_ext_sg`.
    pub allow_ext_sg: bool,
    /// `io_class`.
    pub io_class: IoClass,
}

impl TargetParams {
    /// A target reached over RDMA/CM at `dest:port`, everything else at
    /// Linux's defaults (for tests and tools building attachments).
    #[must_use]
    pub const fn rdma_cm(id_ext: u64, ioc_guid: u64, dest: [u8; 4], port: u16) -> Self {
        TargetParams {
            id_ext,
            ioc_guid,
            addressing: Addressing::RdmaCm {
                src: None,
                dest,
                port,
            },
            max_sect: DEFAULT_MAX_SECT,
            max_cmd_per_lun: DEFAULT_QUEUE_SIZE,
            queue_size: DEFAULT_QUEUE_SIZE,
            ch_count: None,
            cmd_sg_entries: DEFAULT_CMD_SG_ENTRIES,
            sg_tablesize: DEFAULT_CMD_SG_ENTRIES as u32,
            comp_vector: 0,
            tl_retry_count: DEFAULT_TL_RETRY_COUNT,
            max_it_iu_size: None,
            initiator_ext: 0,
            target_can_queue: None,
            allow_ext_sg: false,
            io_class: IoClass::Rev16a,
        }
    }

    /// Largest transfer in bytes.
    #[must_use]
    pub const fn max_transfer_bytes(&self) -> u32 {
        self.max_sect.saturating_mul(512)
    }
}

impl fmt::Display for TargetParams {
    /// The canonical `add_target` string: every key, in `Key::ALL` order,
    /// that differs from what [`parse_add_target`] would assume, so
    /// parsing the output gives back the same value.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "id_ext={:016x},ioc_guid={:016x}",
            self.id_ext, self.ioc_guid
        )?;
        match self.addressing {
            Addressing::IbCm {
                dgid,
                pkey,
                service_id,
            } => {
                f.write_str(",dgid=")?;
                for b in dgid {
                    write!(f, "{b:02x}")?;
                }
                write!(f, ",pkey={pkey:04x},service_id={service_id:016x}")?;
            }
            Addressing::RdmaCm { src, dest, port } => {
                let [a, b, c, d] = dest;
                write!(f, ",dest={a}.{b}.{c}.{d}:{port}")?;
                if let Some([a, b, c, d]) = src {
                    write!(f, ",src={a}.{b}.{c}.{d}")?;
                }
            }
        }
        write!(
            f,
            ",max_sect={},queue_size={},max_cmd_per_lun={},cmd_sg_entries={},sg_tablesize={}",
            self.max_sect,
            self.queue_size,
            self.max_cmd_per_lun,
            self.cmd_sg_entries,
            self.sg_tablesize
        )?;
        if let Some(n) = self.ch_count {
            write!(f, ",ch_count={n}")?;
        }
        write!(
            f,
            ",comp_vector={},tl_retry_count={}",
            self.comp_vector, self.tl_retry_count
        )?;
        if let Some(n) = self.max_it_iu_size {
            write!(f, ",max_it_iu_size={n}")?;
        }
        if self.initiator_ext != 0 {
            write!(f, ",initiator_ext={:016x}", self.initiator_ext)?;
        }
        if let Some(n) = self.target_can_queue {
            write!(f, ",target_can_queue={n}")?;
        }
        if self.allow_ext_sg {
            f.write_str(",allow_ext_sg=1")?;
        }
        if self.io_class != IoClass::Rev16a {
            write!(f, ",io_class={:x}", self.io_class.code())?;
        }
        Ok(())
    }
}

/// The values seen so far while parsing.
#[derive(Default)]
struct Seen {
    mask: u32,
    id_ext: u64,
    ioc_guid: u64,
    dgid: [u8; 16],
    pkey: u16,
    service_id: u64,
    dest: ([u8; 4], u16),
    src: [u8; 4],
    max_sect: u32,
    max_cmd_per_lun: u32,
    queue_size: u32,
    ch_count: u32,
    cmd_sg_entries: u8,
    sg_tablesize: u32,
    comp_vector: u32,
    tl_retry_count: u8,
    max_it_iu_size: u32,
    initiator_ext: u64,
    target_can_queue: u32,
    allow_ext_sg: bool,
    io_class: IoClass,
}

impl Seen {
    fn has(&self, key: Key) -> bool {
        self.mask & key.bit() != 0
    }
}

/// Parses an `add_target` string (see the [module docs](self)).
///
/// # Errors
/// The first problem found, as a [`ParamError`] naming the key.
///
/// # IRQL
/// Any: pure computation, no allocation.
pub fn parse_add_target(text: &[u8]) -> Result<TargetParams, ParamError> {
    if text.is_empty() {
        return Err(ParamError::Empty);
    }
    let mut seen = Seen::default();
    let mut at = 0usize;
    for item in text.split(|b| *b == b',') {
        if item.is_empty() {
            return Err(ParamError::EmptyItem { at });
        }
        let Some(eq) = item.iter().position(|b| *b == b'=') else {
            return Err(ParamError::NotKeyValue {
                at,
                len: item.len(),
            });
        };
        let (name, value) = (
            item.get(..eq).unwrap_or(&[]),
            item.get(eq + 1..).unwrap_or(&[]),
        );
        let Some(key) = Key::from_name(name) else {
            return Err(ParamError::UnknownKey { at, len: eq });
        };
        if seen.has(key) {
            return Err(ParamError::DuplicateKey { key });
        }
        seen.mask |= key.bit();
        apply(&mut seen, key, value)?;
        at = at.saturating_add(item.len()).saturating_add(1);
    }
    finish(&seen)
}

fn apply(seen: &mut Seen, key: Key, value: &[u8]) -> Result<(), ParamError> {
    match key {
        Key::IdExt => seen.id_ext = hex_u64(key, value)?,
        Key::IocGuid => seen.ioc_guid = hex_u64(key, value)?,
        Key::ServiceId => seen.service_id = hex_u64(key, value)?,
        Key::InitiatorExt => seen.initiator_ext = hex_u64(key, value)?,
        Key::Dgid => seen.dgid = gid(key, value)?,
        Key::Pkey => {
            seen.pkey =
                u16::try_from(hex_u64(key, value)?).map_err(|_| ParamError::OutOfRange { key })?;
        }
        Key::IoClass => {
            seen.io_class = match hex_u64(key, value)? {
                0xff00 => IoClass::Rev10,
                0x0100 => IoClass::Rev16a,
                _ => return Err(ParamError::OutOfRange { key }),
            };
        }
        Key::Dest => seen.dest = ipv4_port(key, value, true)?,
        Key::Src => seen.src = ipv4_port(key, value, false)?.0,
        Key::MaxSect => seen.max_sect = dec_in(key, value, 1, MAX_MAX_SECT)?,
        Key::MaxCmdPerLun => seen.max_cmd_per_lun = dec_in(key, value, 1, u32::MAX)?,
        Key::QueueSize => seen.queue_size = dec_in(key, value, 1, MAX_QUEUE_SIZE)?,
        Key::ChCount => seen.ch_count = dec_in(key, value, 1, MAX_CH_COUNT)?,
        Key::CmdSgEntries => {
            seen.cmd_sg_entries = u8::try_from(dec_in(key, value, 1, 255)?)
                .map_err(|_| ParamError::OutOfRange { key })?;
        }
        Key::SgTablesize => seen.sg_tablesize = dec_in(key, value, 1, MAX_SG_TABLESIZE)?,
        Key::CompVector => seen.comp_vector = dec_in(key, value, 0, u32::MAX)?,
        Key::TlRetryCount => {
            seen.tl_retry_count = u8::try_from(dec_in(key, value, 2, 7)?)
                .map_err(|_| ParamError::OutOfRange { key })?;
        }
        Key::MaxItIuSize => {
            let v = dec_in(key, value, 0, MAX_IT_IU_SIZE)?;
            if v != 0 && v < MIN_IT_IU_SIZE {
                return Err(ParamError::OutOfRange { key });
            }
            seen.max_it_iu_size = v;
        }
        Key::TargetCanQueue => seen.target_can_queue = dec_in(key, value, 1, u32::MAX)?,
        Key::AllowExtSg => {
            seen.allow_ext_sg = match value {
                b"0" => false,
                b"1" => true,
                _ if !value.is_empty() && value.iter().all(u8::is_ascii_digit) => {
                    return Err(ParamError::OutOfRange { key });
                }
                _ => return Err(ParamError::BadNumber { key }),
            };
        }
    }
    Ok(())
}

fn finish(seen: &Seen) -> Result<TargetParams, ParamError> {
    const IB: [Key; 3] = [Key::Dgid, Key::Pkey, Key::ServiceId];
    let rdma = seen.has(Key::Dest);
    if rdma {
        if let Some(k) = IB.iter().find(|k| seen.has(**k)) {
            return Err(ParamError::Conflict {
                key: *k,
                with: Key::Dest,
            });
        }
    } else if seen.has(Key::Src) {
        return Err(ParamError::Conflict {
            key: Key::Src,
            with: Key::Dest,
        });
    }
    let required: &[Key] = if rdma {
        &[Key::IdExt, Key::IocGuid, Key::Dest]
    } else if IB.iter().any(|k| seen.has(*k)) {
        &[
            Key::IdExt,
            Key::IocGuid,
            Key::Dgid,
            Key::Pkey,
            Key::ServiceId,
        ]
    } else {
        // Neither form started: name the key both forms share first.
        &[Key::IdExt, Key::IocGuid, Key::Dest]
    };
    if let Some(k) = required.iter().find(|k| !seen.has(**k)) {
        return Err(ParamError::Missing { key: *k });
    }
    let queue_size = if seen.has(Key::QueueSize) {
        seen.queue_size
    } else {
        DEFAULT_QUEUE_SIZE
    };
    // Linux: queue_size sets cmd_per_lun unless that was given.
    let max_cmd_per_lun = if seen.has(Key::MaxCmdPerLun) {
        if seen.max_cmd_per_lun > queue_size {
            return Err(ParamError::Inconsistent {
                key: Key::MaxCmdPerLun,
                with: Key::QueueSize,
            });
        }
        seen.max_cmd_per_lun
    } else {
        queue_size
    };
    let cmd_sg_entries = if seen.has(Key::CmdSgEntries) {
        seen.cmd_sg_entries
    } else {
        DEFAULT_CMD_SG_ENTRIES
    };
    let addressing = if rdma {
        Addressing::RdmaCm {
            src: seen.has(Key::Src).then_some(seen.src),
            dest: seen.dest.0,
            port: seen.dest.1,
        }
    } else {
        Addressing::IbCm {
            dgid: seen.dgid,
            pkey: seen.pkey,
            service_id: seen.service_id,
        }
    };
    Ok(TargetParams {
        id_ext: seen.id_ext,
        ioc_guid: seen.ioc_guid,
        addressing,
        max_sect: if seen.has(Key::MaxSect) {
            seen.max_sect
        } else {
            DEFAULT_MAX_SECT
        },
        max_cmd_per_lun,
        queue_size,
        ch_count: seen.has(Key::ChCount).then_some(seen.ch_count),
        cmd_sg_entries,
        // Linux: indirect_sg_entries defaults to cmd_sg_entries.
        sg_tablesize: if seen.has(Key::SgTablesize) {
            seen.sg_tablesize
        } else {
            u32::from(cmd_sg_entries)
        },
        comp_vector: seen.comp_vector,
        tl_retry_count: if seen.has(Key::TlRetryCount) {
            seen.tl_retry_count
        } else {
            DEFAULT_TL_RETRY_COUNT
        },
        max_it_iu_size: (seen.max_it_iu_size != 0).then_some(seen.max_it_iu_size),
        initiator_ext: seen.initiator_ext,
        target_can_queue: seen
            .has(Key::TargetCanQueue)
            .then_some(seen.target_can_queue),
        allow_ext_sg: seen.allow_ext_sg,
        io_class: seen.io_class,
    })
}

fn hex_digit(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// 1..=16 hex digits, optional `0x`/`0X`.
fn hex_u64(key: Key, value: &[u8]) -> Result<u64, ParamError> {
    let digits = match value {
        [b'0', b'x' | b'X', rest @ ..] => rest,
        other => other,
    };
    if digits.is_empty() {
        return Err(ParamError::BadNumber { key });
    }
    let mut v = 0u64;
    let mut significant = 0usize;
    for b in digits {
        let d = hex_digit(*b).ok_or(ParamError::BadNumber { key })?;
        if significant > 0 || d != 0 {
            significant += 1;
        }
        if significant > 16 {
            return Err(ParamError::OutOfRange { key });
        }
        v = (v << 4) | u64::from(d);
    }
    Ok(v)
}

/// Exactly 32 hex digits.
fn gid(key: Key, value: &[u8]) -> Result<[u8; 16], ParamError> {
    if value.len() != 32 {
        return Err(ParamError::BadAddress { key });
    }
    let mut out = [0u8; 16];
    for (i, byte) in out.iter_mut().enumerate() {
        let hi = value.get(2 * i).copied().and_then(hex_digit);
        let lo = value.get(2 * i + 1).copied().and_then(hex_digit);
        match (hi, lo) {
            (Some(h), Some(l)) => *byte = (h << 4) | l,
            _ => return Err(ParamError::BadAddress { key }),
        }
    }
    Ok(out)
}

/// Plain decimal digits, in `min..=max`.
fn dec_in(key: Key, value: &[u8], min: u32, max: u32) -> Result<u32, ParamError> {
    if value.is_empty() || !value.iter().all(u8::is_ascii_digit) {
        return Err(ParamError::BadNumber { key });
    }
    let mut v = 0u64;
    for b in value {
        v = v * 10 + u64::from(b - b'0');
        if v > u64::from(u32::MAX) {
            return Err(ParamError::OutOfRange { key });
        }
    }
    let v = u32::try_from(v).map_err(|_| ParamError::OutOfRange { key })?;
    if v < min || v > max {
        return Err(ParamError::OutOfRange { key });
    }
    Ok(v)
}

/// `a.b.c.d` with `:port` (required when `need_port`, optional otherwise).
fn ipv4_port(key: Key, value: &[u8], need_port: bool) -> Result<([u8; 4], u16), ParamError> {
    if value.first() == Some(&b'[') {
        return Err(ParamError::Ipv6Unsupported { key });
    }
    let (addr, port) = match value.iter().position(|b| *b == b':') {
        Some(colon) => (
            value.get(..colon).unwrap_or(&[]),
            Some(value.get(colon + 1..).unwrap_or(&[])),
        ),
        None => (value, None),
    };
    let port = match port {
        Some(p) => {
            if p.is_empty() || p.len() > 5 || !p.iter().all(u8::is_ascii_digit) {
                return Err(ParamError::BadAddress { key });
            }
            let n = p.iter().fold(0u32, |acc, b| acc * 10 + u32::from(b - b'0'));
            u16::try_from(n)
                .ok()
                .filter(|n| *n != 0)
                .ok_or(ParamError::BadAddress { key })?
        }
        None if need_port => return Err(ParamError::BadAddress { key }),
        None => 0,
    };
    let mut out = [0u8; 4];
    let mut parts = 0usize;
    for part in addr.split(|b| *b == b'.') {
        let slot = out.get_mut(parts).ok_or(ParamError::BadAddress { key })?;
        if part.is_empty()
            || part.len() > 3
            || !part.iter().all(u8::is_ascii_digit)
            || (part.len() > 1 && part.first() == Some(&b'0'))
        {
            return Err(ParamError::BadAddress { key });
        }
        let n = part
            .iter()
            .fold(0u32, |acc, b| acc * 10 + u32::from(b - b'0'));
        *slot = u8::try_from(n).map_err(|_| ParamError::BadAddress { key })?;
        parts += 1;
    }
    if parts != 4 {
        return Err(ParamError::BadAddress { key });
    }
    Ok((out, port))
}

// ---------------------------------------------------------------------------
// Recovery timeouts
// ---------------------------------------------------------------------------

/// `SCSI_DEVICE_BLOCK_MAX_TIMEOUT`: the longest a device may stay blocked
/// without fast-fail.
pub const BLOCK_MAX_TIMEOUT: Duration = Duration::from_secs(600);

/// The SRP transport's three recovery timeouts (scsi_transport_srp's
/// `reconnect_delay`, `fast_io_fail_tmo`, `dev_loss_tmo`); `None` is "off".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Timeouts {
    /// Delay before a reconnect attempt (backed off after repeated
    /// failures).
    pub reconnect_delay: Option<Duration>,
    /// After a transport failure, how long I/O waits before it fails fast.
    pub fast_io_fail: Option<Duration>,
    /// After a transport failure, how long before the target is gone.
    pub dev_loss: Option<Duration>,
}

/// Why a set of timeouts was refused (`srp_tmo_valid`'s rules).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TmoError {
    /// All three are off: a failed target would never recover or fail.
    AllOff,
    /// `reconnect_delay` is zero (off is spelled "off").
    ReconnectDelayZero,
    /// `fast_io_fail_tmo` exceeds [`BLOCK_MAX_TIMEOUT`].
    FastIoFailTooLong,
    /// `fast_io_fail_tmo` is off and `dev_loss_tmo` exceeds
    /// [`BLOCK_MAX_TIMEOUT`]: I/O would stay blocked too long.
    DevLossTooLongWithoutFastIoFail,
    /// `fast_io_fail_tmo` is not below `dev_loss_tmo`.
    FastIoFailNotBelowDevLoss,
    /// `dev_loss_tmo` too large to represent (Linux: `LONG_MAX / HZ`).
    DevLossTooLong,
    /// A value that is neither a number of seconds nor "off"; names the
    /// tunable.
    BadValue(&'static str),
}

impl fmt::Display for TmoError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::AllOff => {
                f.write_str("reconnect_delay, fast_io_fail_tmo and dev_loss_tmo all off")
            }
            Self::ReconnectDelayZero => f.write_str("reconnect_delay is 0"),
            Self::FastIoFailTooLong => f.write_str("fast_io_fail_tmo above 600 s"),
            Self::DevLossTooLongWithoutFastIoFail => {
                f.write_str("dev_loss_tmo above 600 s with fast_io_fail_tmo off")
            }
            Self::FastIoFailNotBelowDevLoss => {
                f.write_str("fast_io_fail_tmo not below dev_loss_tmo")
            }
            Self::DevLossTooLong => f.write_str("dev_loss_tmo too large"),
            Self::BadValue(name) => write!(f, "{name}: not a number of seconds or \"off\""),
        }
    }
}

/// Linux's `LONG_MAX / HZ` bound on `dev_loss_tmo` (for a 32-bit `long`
/// and `HZ` 1000, the strictest build).
const DEV_LOSS_MAX_SECS: u64 = (i32::MAX as u64) / 1000;

impl Default for Timeouts {
    /// `ib_srp`'s defaults: 10 s, 15 s, 600 s.
    fn default() -> Self {
        Timeouts {
            reconnect_delay: Some(Duration::from_secs(10)),
            fast_io_fail: Some(Duration::from_secs(15)),
            dev_loss: Some(Duration::from_secs(600)),
        }
    }
}

impl Timeouts {
    /// Checks the combination as `srp_tmo_valid` does.
    ///
    /// # Errors
    /// The first rule broken.
    ///
    /// # IRQL
    /// Any.
    pub fn new(
        reconnect_delay: Option<Duration>,
        fast_io_fail: Option<Duration>,
        dev_loss: Option<Duration>,
    ) -> Result<Self, TmoError> {
        let t = Timeouts {
            reconnect_delay,
            fast_io_fail,
            dev_loss,
        };
        t.validate()?;
        Ok(t)
    }

    /// `srp_tmo_valid`.
    ///
    /// # Errors
    /// The first rule broken.
    pub fn validate(&self) -> Result<(), TmoError> {
        if self.reconnect_delay.is_none() && self.fast_io_fail.is_none() && self.dev_loss.is_none()
        {
            return Err(TmoError::AllOff);
        }
        if self.reconnect_delay == Some(Duration::ZERO) {
            return Err(TmoError::ReconnectDelayZero);
        }
        if self.fast_io_fail.is_some_and(|f| f > BLOCK_MAX_TIMEOUT) {
            return Err(TmoError::FastIoFailTooLong);
        }
        if self.fast_io_fail.is_none() && self.dev_loss.is_some_and(|d| d > BLOCK_MAX_TIMEOUT) {
            return Err(TmoError::DevLossTooLongWithoutFastIoFail);
        }
        if self
            .dev_loss
            .is_some_and(|d| d.as_secs() >= DEV_LOSS_MAX_SECS)
        {
            return Err(TmoError::DevLossTooLong);
        }
        if let (Some(f), Some(d)) = (self.fast_io_fail, self.dev_loss) {
            if f >= d {
                return Err(TmoError::FastIoFailNotBelowDevLoss);
            }
        }
        Ok(())
    }

    /// Parses the three registry values (seconds, or `off`; a negative
    /// number is also "off", as Linux's `srp_parse_tmo`) and checks them.
    ///
    /// # Errors
    /// [`TmoError::BadValue`] naming the tunable, or a rule broken.
    ///
    /// # IRQL
    /// Any.
    pub fn parse(
        reconnect_delay: &[u8],
        fast_io_fail_tmo: &[u8],
        dev_loss_tmo: &[u8],
    ) -> Result<Self, TmoError> {
        Self::new(
            parse_tmo("reconnect_delay", reconnect_delay)?,
            parse_tmo("fast_io_fail_tmo", fast_io_fail_tmo)?,
            parse_tmo("dev_loss_tmo", dev_loss_tmo)?,
        )
    }
}

/// One timeout value: `off`, a negative number (off), or seconds.
fn parse_tmo(name: &'static str, value: &[u8]) -> Result<Option<Duration>, TmoError> {
    if value == b"off" {
        return Ok(None);
    }
    let (negative, digits) = match value {
        [b'-', rest @ ..] => (true, rest),
        other => (false, other),
    };
    if digits.is_empty() || digits.len() > 10 || !digits.iter().all(u8::is_ascii_digit) {
        return Err(TmoError::BadValue(name));
    }
    let secs = digits
        .iter()
        .fold(0u64, |acc, b| acc * 10 + u64::from(b - b'0'));
    if secs > u64::from(i32::MAX.unsigned_abs()) {
        return Err(TmoError::BadValue(name));
    }
    Ok(if negative && secs > 0 {
        None
    } else {
        Some(Duration::from_secs(secs))
    })
}

#[cfg(test)]
mod tests;
