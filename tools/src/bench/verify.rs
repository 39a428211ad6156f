//! Data verification: a pattern that says where and when it was written.
//!
//! Every 512-byte sector written in verify mode carries its disk, its
//! sector number and a *generation* (a number the writer draws from a
//! counter for each write), followed by pseudo-random words derived from
//! all three. The verifier keeps the generation last written to each
//! sector; a read checks every sector it returned against it. So a read
//! catches corruption (a flipped bit), a misdirected or lost write (another
//! sector's, or an older generation's, data), and data that never came from
//! this benchmark — and the report says which.
//!
//! Sectors whose content is unknown (never written since the verifier was
//! created, or hit by a write that failed) are skipped, not guessed.

use std::fmt;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use serde::Serialize;

use super::spec::SECTOR;

const SECTOR_BYTES: usize = SECTOR as usize;
/// "kvbn": marks a sector as holding the benchmark's pattern.
const MAGIC: u32 = 0x6b76_626e;
/// Generation of a sector whose content is unknown.
pub const UNKNOWN: u32 = 0;
/// Generation of a sector hit by a write that failed (content unknown).
pub const INDETERMINATE: u32 = u32::MAX;
/// Mismatches kept for the report (all are counted).
pub const KEPT_MISMATCHES: usize = 16;

fn mix(mut x: u64) -> u64 {
    // splitmix64's finaliser.
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

fn word(target: u16, sector: u64, generation: u32, index: usize) -> u64 {
    mix(sector ^ (u64::from(generation) << 32) ^ (u64::from(target) << 48) ^ ((index as u64) << 56))
        ^ (index as u64)
}

/// Writes the pattern of `generation` for `buf.len() / 512` sectors of disk
/// `target`, the first being `first_sector`.
pub fn fill(buf: &mut [u8], target: u16, first_sector: u64, generation: u32) {
    for (i, sector) in buf.chunks_exact_mut(SECTOR_BYTES).enumerate() {
        let n = first_sector + i as u64;
        for (w, bytes) in sector.chunks_exact_mut(8).enumerate() {
            let value = match w {
                0 => n,
                1 => (u64::from(MAGIC) << 32) | u64::from(generation),
                2 => u64::from(target),
                _ => word(target, n, generation, w),
            };
            bytes.copy_from_slice(&value.to_le_bytes());
        }
    }
}

fn read_word(sector: &[u8], w: usize) -> u64 {
    let mut b = [0u8; 8];
    if let Some(src) = sector.get(w * 8..w * 8 + 8) {
        b.copy_from_slice(src);
    }
    u64::from_le_bytes(b)
}

/// What a mismatching sector held instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Found {
    /// The right header, wrong bytes from this offset on: corruption.
    Corrupted {
        /// First differing byte within the sector.
        byte: usize,
    },
    /// An intact pattern of another place or time: a lost, stale or
    /// misdirected write.
    OtherPattern {
        /// The disk it names.
        target: u16,
        /// The sector it names.
        sector: u64,
        /// The generation it names.
        generation: u32,
    },
    /// No pattern at all (zeros, garbage).
    NoPattern {
        /// The sector's first eight bytes.
        first_word: u64,
    },
}

/// One sector that did not hold what was last written to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Mismatch {
    /// The disk.
    pub target: u16,
    /// The sector (512-byte units from the start of the disk).
    pub sector: u64,
    /// The generation last written there.
    pub expected_generation: u32,
    /// What was there.
    pub found: Found,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "disk {} sector {} (byte offset {}): expected generation {}, ",
            self.target,
            self.sector,
            self.sector * u64::from(SECTOR),
            self.expected_generation
        )?;
        match self.found {
            Found::Corrupted { byte } => {
                write!(f, "found it corrupted from byte {byte} of the sector")
            }
            Found::OtherPattern {
                target,
                sector,
                generation,
            } => write!(
                f,
                "found the data of disk {target} sector {sector} generation {generation}{}",
                if target == self.target && sector == self.sector {
                    " (a stale or lost write)"
                } else {
                    " (a misdirected write or read)"
                }
            ),
            Found::NoPattern { first_word } => {
                write!(f, "found no pattern (first word {first_word:#018x})")
            }
        }
    }
}

/// Checks one sector against the pattern of `generation`.
#[must_use]
pub fn check_sector(sector: &[u8], target: u16, n: u64, generation: u32) -> Option<Found> {
    let mut expected = [0u8; SECTOR_BYTES];
    fill(&mut expected, target, n, generation);
    let byte = sector
        .iter()
        .zip(expected.iter())
        .position(|(a, b)| a != b)?;
    let w0 = read_word(sector, 0);
    let w1 = read_word(sector, 1);
    let w2 = read_word(sector, 2);
    let header_ok = w1 >> 32 == u64::from(MAGIC) && w2 <= u64::from(u16::MAX);
    Some(if header_ok {
        let (t, s, g) = (w2 as u16, w0, w1 as u32);
        if (t, s, g) == (target, n, generation) {
            Found::Corrupted { byte }
        } else {
            // An intact pattern of another sector or generation?
            let mut other = [0u8; SECTOR_BYTES];
            fill(&mut other, t, s, g);
            if other[..] == sector[..SECTOR_BYTES.min(sector.len())] {
                Found::OtherPattern {
                    target: t,
                    sector: s,
                    generation: g,
                }
            } else {
                Found::Corrupted { byte }
            }
        }
    } else {
        Found::NoPattern { first_word: w0 }
    })
}

/// The verifier's knowledge of one disk: the generation last written to
/// each sector of its working set.
pub struct DiskMap {
    generations: Box<[AtomicU32]>,
}

/// What the verifier found, for the report.
#[derive(Debug, Clone, Default, Serialize)]
pub struct VerifySummary {
    /// Sectors read and compared.
    pub sectors_checked: u64,
    /// Sectors read whose content was unknown (skipped).
    pub sectors_skipped: u64,
    /// Sectors that did not match.
    pub mismatches: u64,
    /// The first [`KEPT_MISMATCHES`] of them.
    pub first_mismatches: Vec<Mismatch>,
}

/// The verifier shared by a run's workers.
pub struct Verifier {
    disks: Vec<DiskMap>,
    next_generation: AtomicU32,
    checked: AtomicU64,
    skipped: AtomicU64,
    mismatches: AtomicU64,
    kept: Mutex<Vec<Mismatch>>,
}

impl Verifier {
    /// A verifier for disks whose working sets are `bytes[i]` long (from
    /// their start); every sector starts [`UNKNOWN`].
    #[must_use]
    pub fn new(bytes: &[u64]) -> Self {
        Self {
            disks: bytes
                .iter()
                .map(|&b| DiskMap {
                    generations: (0..b / u64::from(SECTOR))
                        .map(|_| AtomicU32::new(UNKNOWN))
                        .collect(),
                })
                .collect(),
            next_generation: AtomicU32::new(1),
            checked: AtomicU64::new(0),
            skipped: AtomicU64::new(0),
            mismatches: AtomicU64::new(0),
            kept: Mutex::new(Vec::new()),
        }
    }

    /// A fresh generation for a write (never [`UNKNOWN`] or
    /// [`INDETERMINATE`]).
    pub fn next_generation(&self) -> u32 {
        loop {
            let g = self.next_generation.fetch_add(1, Ordering::Relaxed);
            if g != UNKNOWN && g != INDETERMINATE {
                return g;
            }
        }
    }

    fn sectors(&self, target: usize, offset: u64, len: usize) -> Option<&[AtomicU32]> {
        let first = usize::try_from(offset / u64::from(SECTOR)).ok()?;
        let count = len / SECTOR_BYTES;
        self.disks
            .get(target)?
            .generations
            .get(first..first.checked_add(count)?)
    }

    /// Records a write of `generation` that completed (`ok`) or failed.
    pub fn write_done(&self, target: usize, offset: u64, len: usize, generation: u32, ok: bool) {
        if let Some(sectors) = self.sectors(target, offset, len) {
            let g = if ok { generation } else { INDETERMINATE };
            for s in sectors {
                s.store(g, Ordering::Relaxed);
            }
        }
    }

    /// Checks the data of a read of disk `target` at `offset`; returns the
    /// number of mismatching sectors (also counted and kept for the
    /// report).
    pub fn check_read(&self, target: usize, offset: u64, data: &[u8]) -> u64 {
        let Some(sectors) = self.sectors(target, offset, data.len()) else {
            self.skipped
                .fetch_add((data.len() / SECTOR_BYTES) as u64, Ordering::Relaxed);
            return 0;
        };
        let first = offset / u64::from(SECTOR);
        let (mut checked, mut skipped, mut bad) = (0u64, 0u64, 0u64);
        let t = u16::try_from(target).unwrap_or(u16::MAX);
        for (i, (bytes, g)) in data.chunks_exact(SECTOR_BYTES).zip(sectors).enumerate() {
            let generation = g.load(Ordering::Relaxed);
            if generation == UNKNOWN || generation == INDETERMINATE {
                skipped += 1;
                continue;
            }
            checked += 1;
            let n = first + i as u64;
            if let Some(found) = check_sector(bytes, t, n, generation) {
                bad += 1;
                let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
                if kept.len() < KEPT_MISMATCHES {
                    kept.push(Mismatch {
                        target: t,
                        sector: n,
                        expected_generation: generation,
                        found,
                    });
                }
            }
        }
        self.checked.fetch_add(checked, Ordering::Relaxed);
        self.skipped.fetch_add(skipped, Ordering::Relaxed);
        self.mismatches.fetch_add(bad, Ordering::Relaxed);
        bad
    }

    /// Mismatching sectors so far.
    pub fn mismatches(&self) -> u64 {
        self.mismatches.load(Ordering::Relaxed)
    }

    /// The counts and kept mismatches so far.
    pub fn summary(&self) -> VerifySummary {
        VerifySummary {
            sectors_checked: self.checked.load(Ordering::Relaxed),
            sectors_skipped: self.skipped.load(Ordering::Relaxed),
            mismatches: self.mismatches.load(Ordering::Relaxed),
            first_mismatches: self
                .kept
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_round_trips_and_differs_by_place_and_time() {
        let mut a = vec![0u8; 4096];
        fill(&mut a, 1, 100, 7);
        for (i, s) in a.chunks_exact(512).enumerate() {
            assert_eq!(check_sector(s, 1, 100 + i as u64, 7), None);
        }
        let mut b = vec![0u8; 512];
        fill(&mut b, 1, 100, 8);
        assert_ne!(a[..512], b[..], "generation changes the bytes");
        fill(&mut b, 2, 100, 7);
        assert_ne!(a[..512], b[..], "disk changes the bytes");
        fill(&mut b, 1, 101, 7);
        assert_ne!(a[..512], b[..], "sector changes the bytes");
        // Not only the header: the body differs too.
        fill(&mut b, 1, 100, 8);
        assert_ne!(a[24..512], b[24..]);
    }

    #[test]
    fn check_names_what_it_found() {
        let mut s = vec![0u8; 512];
        fill(&mut s, 0, 5, 3);
        // Stale: generation 2 expected 3.
        assert_eq!(
            check_sector(&s, 0, 5, 4),
            Some(Found::OtherPattern {
                target: 0,
                sector: 5,
                generation: 3
            })
        );
        // Misdirected: sector 6 expected.
        assert!(matches!(
            check_sector(&s, 0, 6, 3),
            Some(Found::OtherPattern { sector: 5, .. })
        ));
        // A flipped bit in the body.
        s[300] ^= 0x10;
        assert_eq!(
            check_sector(&s, 0, 5, 3),
            Some(Found::Corrupted { byte: 300 })
        );
        // Zeros.
        assert_eq!(
            check_sector(&[0u8; 512], 0, 5, 3),
            Some(Found::NoPattern { first_word: 0 })
        );
    }

    #[test]
    fn verifier_tracks_generations_and_skips_unknown() {
        let v = Verifier::new(&[64 * 512]);
        let g = v.next_generation();
        let mut data = vec![0u8; 8 * 512];
        fill(&mut data, 0, 8, g);
        // Never written: skipped.
        assert_eq!(v.check_read(0, 8 * 512, &data), 0);
        assert_eq!(v.summary().sectors_skipped, 8);
        v.write_done(0, 8 * 512, data.len(), g, true);
        assert_eq!(v.check_read(0, 8 * 512, &data), 0);
        assert_eq!(v.summary().sectors_checked, 8);
        // Newer write not seen by the read: every sector is stale.
        let g2 = v.next_generation();
        v.write_done(0, 8 * 512, data.len(), g2, true);
        assert_eq!(v.check_read(0, 8 * 512, &data), 8);
        let summary = v.summary();
        assert_eq!(summary.mismatches, 8);
        assert_eq!(summary.first_mismatches.len(), 8);
        assert_eq!(summary.first_mismatches[0].sector, 8);
        assert!(summary.first_mismatches[0].to_string().contains("stale"));
        // A failed write makes the content unknown again.
        v.write_done(0, 8 * 512, data.len(), v.next_generation(), false);
        assert_eq!(v.check_read(0, 8 * 512, &data), 0);
    }

    #[test]
    fn generations_skip_reserved_values() {
        let v = Verifier::new(&[]);
        v.next_generation
            .store(INDETERMINATE - 1, Ordering::Relaxed);
        let a = v.next_generation();
        let b = v.next_generation();
        assert_eq!(a, INDETERMINATE - 1);
        assert_ne!(b, INDETERMINATE);
        assert_ne!(b, UNKNOWN);
    }
}
