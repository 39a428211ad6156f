//! The HCA as hardware.
//!
//! This crate describes what a verbs library drives: the mlx5-layout send and
//! receive queue formats, completion queue entries, doorbell records, the
//! blocking device control interface ("firmware commands"), the IBA transport
//! headers as they appear on the wire, and — behind the `sim` feature — a
//! software HCA that executes what is posted on its rings.
//!
//! Nothing here knows about SCSI, and nothing here decides IRQL policy: the
//! control interface is documented as blocking (PASSIVE_LEVEL only) and the
//! data-path interface as non-blocking; `kverbs` enforces both in its types.

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

pub mod wire;
