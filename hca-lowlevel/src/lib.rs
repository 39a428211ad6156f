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
//!
//! # Map
//!
//! * [`wqe`], [`recv`], [`cqe`], [`doorbell`]: the queue formats, as views over
//!   byte buffers (big-endian fields, sizes and offsets pinned at compile time).
//! * [`dma`]: device-visible memory ([`dma::DmaBuffer`]) as atomic 64-bit words,
//!   so the driver and a device model may touch it concurrently without UB.
//! * [`ring`]: power-of-two rings over that memory — WQE copy-in with chunked
//!   64-bit stores, CQE ownership by owner-bit parity.
//! * [`barrier`]: the named memory barriers and the exact doorbell order.
//! * [`device`]: the device interface kverbs drives (control, data-path
//!   resources, events) and the IBA QP state-transition rules.
//! * [`view`]: the shared view boilerplate and [`view::FormatError`].
//! * [`sync`]: the atomics facade (core or loom).
//! * [`wire`]: the IBA transport headers and RoCEv2 framing.
//! * `sim` (feature `sim`): the software HCA, its fabric (seeded fault
//!   injection, device-thread and stepped execution), its RoCEv2 Ethernet
//!   link to the outside (`sim::link`: a datagram socket such as qemu's,
//!   ARP, pcap capture) and a raw test kit.
//!
//! # Tests
//!
//! Golden-byte tests for every format, every QP transition rule and every
//! protection check; the lossy-link RC property (`tests/lossy_rc.rs`,
//! `HCA_LOSSY_SEEDS`); loom models of ring ownership (`--cfg loom`); Miri
//! over the shared-memory code; `benches/sim_rate.rs` for rate and
//! bandwidth beside memcpy.

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

pub mod barrier;
pub mod cqe;
pub mod device;
pub mod dma;
pub mod doorbell;
pub mod recv;
pub mod ring;
pub mod sync;
pub mod wire;
pub mod wqe;

mod bytes;
pub mod view;

#[cfg(all(feature = "sim", not(loom)))]
pub mod sim;

#[cfg(all(test, loom))]
mod loom_tests;
