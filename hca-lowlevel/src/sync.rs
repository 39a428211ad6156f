//! The atomics facade (tokio style): the same ring and memory code builds
//! against `core` normally and against `loom` under `--cfg loom`, so the loom
//! models exercise exactly the code kverbs and the device model run.
//!
//! Everything in this crate that is shared between a driver and a device goes
//! through these types; nothing shared is ever a plain `&mut`.

/// Atomic types and fences (core's, or loom's under `cfg(loom)`).
pub mod atomic {
    #[cfg(loom)]
    pub use loom::sync::atomic::{AtomicU64, Ordering, fence};

    #[cfg(not(loom))]
    pub use core::sync::atomic::{AtomicU64, Ordering, fence};
}
