//! Turning an access specification into I/Os: which part (by weight),
//! which direction, which offset.
//!
//! Offsets follow IOmeter: a random I/O goes to a uniformly chosen offset
//! that is a multiple of the part's alignment and leaves room for the whole
//! transfer inside the worker's region of the disk; a sequential I/O starts
//! where the previous I/O to that disk ended (rounded up to the alignment),
//! wrapping to the start of the region when it would run past its end.
//! Everything is drawn from a seeded generator, so a run's I/O sequence is
//! reproducible.

use fastrand::Rng;

use super::backend::Direction;
use super::spec::{AccessPart, AccessSpec};

/// Picks a spec's part by weight.
#[derive(Debug, Clone)]
pub struct MixPicker {
    /// Running sums of the weights.
    cumulative: Vec<u64>,
}

impl MixPicker {
    /// A picker for `spec`'s parts.
    #[must_use]
    pub fn new(spec: &AccessSpec) -> Self {
        let mut total = 0u64;
        let cumulative = spec
            .parts
            .iter()
            .map(|p| {
                total += u64::from(p.weight);
                total
            })
            .collect();
        Self { cumulative }
    }

    /// The index of the next part (weight 0 parts are never picked; a spec
    /// whose weights add up to 0 always gets part 0, but such a spec never
    /// passes [`AccessSpec::check`]).
    pub fn pick(&self, rng: &mut Rng) -> usize {
        let total = self.cumulative.last().copied().unwrap_or(0);
        if total == 0 {
            return 0;
        }
        let x = rng.u64(0..total);
        self.cumulative.partition_point(|&c| c <= x)
    }
}

/// Read or write, by the part's read percentage.
pub fn pick_direction(part: &AccessPart, rng: &mut Rng) -> Direction {
    if rng.u8(0..100) < part.read_percent {
        Direction::Read
    } else {
        Direction::Write
    }
}

/// Random or sequential, by the part's random percentage.
pub fn pick_random(part: &AccessPart, rng: &mut Rng) -> bool {
    rng.u8(0..100) < part.random_percent
}

/// The part of a disk one worker uses: `start..start + len` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    /// First byte.
    pub start: u64,
    /// Bytes.
    pub len: u64,
}

impl Region {
    /// One past the last byte.
    #[must_use]
    pub const fn end(&self) -> u64 {
        self.start + self.len
    }

    /// Splits `0..len` into `parts` regions, each starting on a multiple of
    /// `granule` (the last takes the rest). Regions may be empty when the
    /// disk is small.
    #[must_use]
    pub fn split(len: u64, parts: usize, granule: u64) -> Vec<Self> {
        let parts = parts.max(1) as u64;
        let granule = granule.max(1);
        let share = (len / parts) / granule * granule;
        (0..parts)
            .map(|i| {
                let start = i * share;
                let end = if i + 1 == parts { len } else { start + share };
                Self {
                    start,
                    len: end.saturating_sub(start),
                }
            })
            .collect()
    }
}

fn align_up(value: u64, alignment: u64) -> Option<u64> {
    let a = alignment.max(1);
    value.div_ceil(a).checked_mul(a)
}

/// Offsets for one worker on one disk.
#[derive(Debug, Clone)]
pub struct OffsetGenerator {
    region: Region,
    /// Where the previous I/O ended (sequential I/O continues here).
    last_end: u64,
}

impl OffsetGenerator {
    /// A generator over `region`; sequential I/O starts at its start.
    #[must_use]
    pub const fn new(region: Region) -> Self {
        Self {
            region,
            last_end: region.start,
        }
    }

    /// The region.
    #[must_use]
    pub const fn region(&self) -> Region {
        self.region
    }

    /// The lowest and highest aligned start that leave room for `size`
    /// bytes in the region.
    fn bounds(&self, size: u64, alignment: u64) -> Option<(u64, u64)> {
        let first = align_up(self.region.start, alignment)?;
        let last_start = self.region.end().checked_sub(size)?;
        (first <= last_start).then(|| {
            let a = alignment.max(1);
            (first, first + (last_start - first) / a * a)
        })
    }

    /// The offset of the next I/O of `part`, random or sequential; `None`
    /// if the region cannot hold one transfer. Moves the sequential cursor
    /// to the end of the returned I/O.
    pub fn next(&mut self, part: &AccessPart, random: bool, rng: &mut Rng) -> Option<u64> {
        let size = u64::from(part.transfer_size);
        let alignment = u64::from(part.alignment);
        let (first, last) = self.bounds(size, alignment)?;
        let offset = if random {
            let slots = (last - first) / alignment.max(1) + 1;
            first + rng.u64(0..slots) * alignment.max(1)
        } else {
            match align_up(self.last_end, alignment) {
                Some(next) if next >= first && next <= last => next,
                _ => first,
            }
        };
        self.last_end = offset + size;
        Some(offset)
    }
}

/// True if `a_start..a_start + a_len` and `b_start..b_start + b_len`
/// share a byte.
#[must_use]
pub const fn overlaps(a_start: u64, a_len: u64, b_start: u64, b_len: u64) -> bool {
    a_start < b_start + b_len && b_start < a_start + a_len
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(size: u32, align: u32) -> AccessPart {
        AccessPart {
            alignment: align,
            ..AccessPart::new(size, 100, 100)
        }
    }

    #[test]
    fn mix_weights_are_followed() {
        let spec = AccessSpec {
            name: "mix".into(),
            parts: vec![
                part(4096, 4096).weighted(70),
                part(8192, 8192).weighted(0),
                part(65536, 65536).weighted(20),
                part(512, 512).weighted(10),
            ],
        };
        let picker = MixPicker::new(&spec);
        let mut rng = Rng::with_seed(7);
        let mut counts = [0u32; 4];
        let n = 100_000;
        for _ in 0..n {
            counts[picker.pick(&mut rng)] += 1;
        }
        assert_eq!(counts[1], 0, "a zero-weight part is never picked");
        for (i, want) in [(0usize, 0.70), (2, 0.20), (3, 0.10)] {
            let got = f64::from(counts[i]) / f64::from(n);
            assert!((got - want).abs() < 0.01, "part {i}: {got} vs {want}");
        }
    }

    #[test]
    fn mix_of_one_part_always_picks_it() {
        let spec = AccessSpec::single("one", part(4096, 4096));
        let picker = MixPicker::new(&spec);
        let mut rng = Rng::with_seed(1);
        assert!((0..1000).all(|_| picker.pick(&mut rng) == 0));
    }

    #[test]
    fn direction_and_randomness_follow_percentages() {
        let mut rng = Rng::with_seed(3);
        let p = AccessPart::new(4096, 70, 25);
        let n = 100_000;
        let reads = (0..n)
            .filter(|_| pick_direction(&p, &mut rng) == Direction::Read)
            .count();
        let randoms = (0..n).filter(|_| pick_random(&p, &mut rng)).count();
        assert!((reads as f64 / f64::from(n) - 0.70).abs() < 0.01);
        assert!((randoms as f64 / f64::from(n) - 0.25).abs() < 0.01);
        let all_reads = AccessPart::new(4096, 100, 100);
        let all_writes = AccessPart::new(4096, 0, 0);
        assert!((0..1000).all(|_| pick_direction(&all_reads, &mut rng) == Direction::Read));
        assert!((0..1000).all(|_| pick_direction(&all_writes, &mut rng) == Direction::Write));
        assert!((0..1000).all(|_| !pick_random(&all_writes, &mut rng)));
    }

    #[test]
    fn random_offsets_are_aligned_inside_the_region_and_cover_it() {
        let region = Region {
            start: 3 * 512,
            len: 1 << 20,
        };
        let mut generator = OffsetGenerator::new(region);
        let mut rng = Rng::with_seed(11);
        for (size, align) in [
            (4096, 4096),
            (4096, 512),
            (65536, 65536),
            (512, 512),
            (6144, 2048),
        ] {
            let p = part(size, align);
            let mut lowest = u64::MAX;
            let mut highest = 0;
            for _ in 0..20_000 {
                let off = generator.next(&p, true, &mut rng).unwrap();
                assert_eq!(off % u64::from(align), 0, "aligned on {align}");
                assert!(off >= region.start);
                assert!(
                    off + u64::from(size) <= region.end(),
                    "whole transfer inside"
                );
                lowest = lowest.min(off);
                highest = highest.max(off);
            }
            // Uniform over the slots: both ends are reached.
            let first = align_up(region.start, u64::from(align)).unwrap();
            let last = (region.end() - u64::from(size)) / u64::from(align) * u64::from(align);
            assert_eq!(lowest, first, "{size}/{align}: lowest slot reached");
            assert_eq!(highest, last, "{size}/{align}: highest slot reached");
        }
    }

    #[test]
    fn sequential_offsets_continue_and_wrap() {
        let region = Region {
            start: 8192,
            len: 5 * 4096,
        };
        let mut generator = OffsetGenerator::new(region);
        let mut rng = Rng::with_seed(1);
        let p = part(4096, 4096);
        let offs: Vec<u64> = (0..7)
            .map(|_| generator.next(&p, false, &mut rng).unwrap())
            .collect();
        assert_eq!(
            offs,
            [8192, 12288, 16384, 20480, 24576, 8192, 12288],
            "continues, wraps to the start"
        );
        // A different size continues from the previous end, aligned up.
        let big = part(8192, 8192);
        assert_eq!(generator.next(&big, false, &mut rng), Some(16384));
        // A random I/O moves the cursor too (IOmeter: the next sequential
        // I/O follows the previous I/O, whatever it was).
        let off = generator.next(&p, true, &mut rng).unwrap();
        assert_eq!(
            generator.next(&p, false, &mut rng),
            Some(if off + 4096 + 4096 <= region.end() {
                off + 4096
            } else {
                region.start
            })
        );
    }

    #[test]
    fn region_too_small_for_a_transfer_gives_none() {
        let mut generator = OffsetGenerator::new(Region {
            start: 0,
            len: 4096,
        });
        let mut rng = Rng::with_seed(1);
        assert_eq!(generator.next(&part(8192, 8192), true, &mut rng), None);
        assert_eq!(generator.next(&part(8192, 8192), false, &mut rng), None);
        assert_eq!(generator.next(&part(4096, 4096), true, &mut rng), Some(0));
        // Alignment pushes the only slot out.
        let mut generator = OffsetGenerator::new(Region {
            start: 512,
            len: 4096,
        });
        assert_eq!(generator.next(&part(4096, 4096), false, &mut rng), None);
    }

    #[test]
    fn split_gives_disjoint_granular_regions() {
        let regions = Region::split(10 << 20, 3, 1 << 20);
        assert_eq!(regions.len(), 3);
        assert_eq!(
            regions[0],
            Region {
                start: 0,
                len: 3 << 20
            }
        );
        assert_eq!(
            regions[1],
            Region {
                start: 3 << 20,
                len: 3 << 20
            }
        );
        assert_eq!(
            regions[2],
            Region {
                start: 6 << 20,
                len: 4 << 20
            }
        );
        let whole = Region::split(12345, 1, 512);
        assert_eq!(
            whole,
            [Region {
                start: 0,
                len: 12345
            }]
        );
    }

    #[test]
    fn overlap_is_exact() {
        assert!(overlaps(0, 10, 9, 1));
        assert!(!overlaps(0, 10, 10, 1));
        assert!(!overlaps(10, 5, 0, 10));
        assert!(overlaps(10, 5, 0, 11));
    }

    mod properties {
        use super::*;
        use fastrand::Rng;
        use proptest::prelude::{ProptestConfig, any, prop_assert, prop_assert_eq, proptest};

        fn cases() -> u32 {
            std::env::var("KVBENCH_PROPTEST_CASES")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(256)
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(cases()))]

            /// Whatever the region, size and alignment: every offset is
            /// aligned, the whole transfer lies in the region, and a
            /// region that has room for one aligned transfer always yields
            /// one.
            #[test]
            fn offsets_stay_aligned_and_inside(
                start_sectors in 0u64..4096,
                len_sectors in 0u64..8192,
                size_sectors in 1u32..256,
                align_sectors in 1u32..256,
                random_percent in 0u8..=100,
                seed in any::<u64>(),
            ) {
                let region = Region { start: start_sectors * 512, len: len_sectors * 512 };
                let p = AccessPart {
                    transfer_size: size_sectors * 512,
                    weight: 1,
                    read_percent: 50,
                    random_percent,
                    alignment: align_sectors * 512,
                };
                let (size, align) = (u64::from(p.transfer_size), u64::from(p.alignment));
                let first = region.start.div_ceil(align) * align;
                let room = first + size <= region.end();
                let mut generator = OffsetGenerator::new(region);
                let mut rng = Rng::with_seed(seed);
                for _ in 0..64 {
                    let random = pick_random(&p, &mut rng);
                    match generator.next(&p, random, &mut rng) {
                        Some(off) => {
                            prop_assert!(room);
                            prop_assert_eq!(off % align, 0);
                            prop_assert!(off >= region.start);
                            prop_assert!(off + size <= region.end());
                        }
                        None => prop_assert!(!room),
                    }
                }
            }

            /// The split covers the disk exactly, in order, without overlap,
            /// every region starting on the granule.
            #[test]
            fn split_partitions(len in 0u64..(1 << 40), parts in 1usize..64, granule_pages in 1u64..1024) {
                let granule = granule_pages * 4096;
                let regions = Region::split(len, parts, granule);
                prop_assert_eq!(regions.len(), parts);
                let mut at = 0;
                for r in &regions {
                    prop_assert_eq!(r.start, at);
                    prop_assert_eq!(r.start % granule, 0);
                    at = r.end();
                }
                prop_assert_eq!(at, len);
            }
        }
    }
}
