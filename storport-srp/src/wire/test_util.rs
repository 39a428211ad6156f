//! Helpers shared by the wire property tests.
//!
//! Case counts follow proptest's `PROPTEST_CASES` environment variable
//! (default 256 per property), so CI stays fast and a longer sweep is one
//! variable away: `PROPTEST_CASES=20000 cargo test -p storport-srp wire`.

use proptest::prelude::*;

/// Edits applied to a valid message to make a nearly valid one.
#[derive(Debug, Clone)]
pub struct Mutation {
    /// `(position, xor mask)` pairs; positions wrap around the length.
    pub flips: Vec<(usize, u8)>,
    /// Bytes to cut from the end (saturating).
    pub cut: usize,
    /// Bytes to append.
    pub append: Vec<u8>,
}

impl Mutation {
    /// Applies the edits to a copy of `bytes`.
    pub fn apply(&self, bytes: &[u8]) -> Vec<u8> {
        let mut out = bytes.to_vec();
        if !out.is_empty() {
            let len = out.len();
            for &(at, mask) in &self.flips {
                out[at % len] ^= mask;
            }
        }
        out.truncate(out.len().saturating_sub(self.cut));
        out.extend_from_slice(&self.append);
        out
    }
}

/// Mostly small mutations: a few flipped bytes, sometimes a cut or a tail.
pub fn mutation() -> impl Strategy<Value = Mutation> {
    (
        prop::collection::vec((any::<usize>(), 1u8..=255), 0..4),
        prop_oneof![3 => Just(0usize), 1 => 0usize..64],
        prop_oneof![3 => Just(Vec::new()), 1 => prop::collection::vec(any::<u8>(), 0..32)],
    )
        .prop_map(|(flips, cut, append)| Mutation { flips, cut, append })
}

/// The committed seed inputs of a fuzz target (`fuzz/corpus/<target>`),
/// built by `fuzz/make_seeds.py` independently of the Rust emitters.
pub fn fuzz_seeds(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = format!("{}/../fuzz/corpus/{target}", env!("CARGO_MANIFEST_DIR"));
    let mut seeds: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{dir}: {e}"))
        .map(|entry| {
            let path = entry.unwrap().path();
            (path.display().to_string(), std::fs::read(&path).unwrap())
        })
        .collect();
    seeds.sort();
    assert!(!seeds.is_empty(), "no seeds in {dir}");
    seeds
}
