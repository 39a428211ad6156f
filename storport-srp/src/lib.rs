//! A StorPort SRP and iSER initiator miniport built on `kverbs`.
//!
//! The miniport core is written against a `StorPort` trait only, so that the
//! NT shim is a thin mapping and the whole initiator runs, and is tested, on a
//! Linux host against the software HCA and software targets.

#![cfg_attr(not(any(test, feature = "std")), no_std)]
#![deny(missing_docs)]
#![cfg_attr(
    not(test),
    deny(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::indexing_slicing
    )
)]

extern crate alloc;

mod drop_teardown;
pub mod gather;
pub mod iscsi;
pub mod iser;
pub mod miniport;
#[cfg(feature = "nt")]
pub mod nt;
pub mod scsi;
pub mod srp;
pub mod storport;
pub mod wire;
