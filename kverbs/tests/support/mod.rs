//! Shared by the kverbs integration tests: the verifier's global allocator
//! (so every allocation at DISPATCH_LEVEL in any test is a violation) and a
//! few helpers.

#![allow(dead_code, reason = "each test binary uses a different subset")]

use kverbs::platform::host::{HostPlatform, VerifierAllocator};

#[global_allocator]
static ALLOCATOR: VerifierAllocator = VerifierAllocator;

/// A threaded host platform with the default configuration.
pub fn threaded() -> HostPlatform {
    HostPlatform::new()
}

/// A manual-mode host platform: nothing runs until the test says so.
pub fn manual() -> HostPlatform {
    HostPlatform::manual()
}

/// A count from the environment (for the big sweeps), or `default`.
pub fn env_count(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}
