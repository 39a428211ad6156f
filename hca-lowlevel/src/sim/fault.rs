//! Seeded fault injection on the fabric's links.
//!
//! Every decision comes from one seeded generator owned by the world, and the
//! world processes frames in a deterministic order in stepped mode, so a run
//! is reproducible from its seed.

use std::collections::HashMap;

use super::world::FabricStats;

/// Faults applied to every frame crossing one link (`from → to`).
/// Probabilities are in `0.0..=1.0`.
#[derive(Copy, Clone, Debug, Default, PartialEq)]
pub struct FaultConfig {
    /// Probability a frame is lost.
    pub drop: f64,
    /// Probability a frame is delivered twice.
    pub duplicate: f64,
    /// Probability a frame is held back by `reorder_delay_ns` (so frames
    /// sent after it overtake it).
    pub reorder: f64,
    /// Probability one bit of the frame's IBA packet or ICRC is flipped
    /// (the receiver's ICRC check must catch it).
    pub corrupt: f64,
    /// Fixed one-way delay, ns.
    pub delay_ns: u64,
    /// Uniform extra delay `0..=jitter_ns`, ns.
    pub jitter_ns: u64,
    /// Extra delay of a reordered frame, ns.
    pub reorder_delay_ns: u64,
}

/// What became of one frame: zero (dropped), one or two (duplicated)
/// copies, each with its delay in ns.
pub(crate) type Fate = heapless::Vec<(u64, Vec<u8>), 2>;

/// The fault state of a fabric.
pub(crate) struct Faults {
    rng: fastrand::Rng,
    links: HashMap<(usize, usize), FaultConfig>,
}

/// Offset of the IBA packet in a RoCEv2/IPv4 frame.
const IBA_OFFSET: usize = 14 + 20 + 8;

impl Faults {
    pub fn new(seed: u64) -> Self {
        Self {
            rng: fastrand::Rng::with_seed(seed),
            links: HashMap::new(),
        }
    }

    pub fn set(&mut self, from: usize, to: usize, cfg: FaultConfig) {
        self.links.insert((from, to), cfg);
    }

    /// True if the link `from → to` has a fault configuration (even an
    /// all-zero one): its frames are then checked in full on delivery.
    pub fn configured(&self, from: usize, to: usize) -> bool {
        // No hashing at all on a fabric without fault configuration.
        !self.links.is_empty() && self.links.contains_key(&(from, to))
    }

    fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && self.rng.f64() < p
    }

    fn delay(&mut self, cfg: &FaultConfig) -> u64 {
        let mut d = cfg.delay_ns;
        if cfg.jitter_ns > 0 {
            d += self.rng.u64(0..=cfg.jitter_ns);
        }
        if self.chance(cfg.reorder) {
            d += cfg.reorder_delay_ns;
        }
        d
    }

    /// Decides the fate of one frame: zero, one or two `(delay, bytes)`
    /// (no heap allocation: this runs once per frame).
    pub fn apply(
        &mut self,
        from: usize,
        to: usize,
        mut frame: Vec<u8>,
        stats: &mut FabricStats,
    ) -> Fate {
        let mut fate = Fate::new();
        let cfg = if self.links.is_empty() {
            None
        } else {
            self.links.get(&(from, to)).copied()
        };
        let Some(cfg) = cfg else {
            let _ = fate.push((0, frame));
            return fate;
        };
        if self.chance(cfg.drop) {
            stats.dropped_by_fault += 1;
            return fate;
        }
        if self.chance(cfg.corrupt) && frame.len() > IBA_OFFSET {
            let i = self.rng.usize(IBA_OFFSET..frame.len());
            let bit = self.rng.u8(0..8);
            if let Some(b) = frame.get_mut(i) {
                *b ^= 1 << bit;
            }
            stats.corrupted += 1;
        }
        let first = self.delay(&cfg);
        if self.chance(cfg.duplicate) {
            stats.duplicated += 1;
            let second = self.delay(&cfg);
            let _ = fate.push((first, frame.clone()));
            let _ = fate.push((second, frame));
            return fate;
        }
        let _ = fate.push((first, frame));
        fate
    }
}
