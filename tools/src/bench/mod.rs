//! kvbench: an IOmeter-style benchmark of the initiator stack.
//!
//! IOmeter's concepts, one module each:
//!
//! * **access specifications** ([`spec`]): transfer size, % read,
//!   % random, alignment, weighted mixes; the classic built-ins and spec
//!   files (TOML or JSON);
//! * **workers, disks, outstanding I/Os, ramp-up and run time**
//!   ([`engine::RunConfig`]), run spec after spec by [`engine::run_suite`];
//! * **results** ([`stats`]): IOPS, MB/s and MiB/s, average, maximum and
//!   percentile latencies (`hdrhistogram`), errors, CPU time per I/O,
//!   IOPS over time — written as a table, IOmeter-column CSV and JSON
//!   ([`report`]) and drawn as SVG ([`plot`]);
//! * **verification** ([`verify`]): a pattern that encodes disk, sector and
//!   write generation, checked on every read.
//!
//! What the I/O goes through is a [`backend::Backend`]: the StorPort model
//! driving the miniport core over a transport ([`model`]) — the SRP engine
//! over the software HCAs to the software SRP target ([`srp`], the full
//! stack), the iSER engine to the software iSER target ([`iser`], the full
//! stack over iSER), either engine over the software HCA's RoCEv2 link to
//! the Linux kernel's `ib_srpt` or LIO iSER in the qemu VM ([`linux_vm`]),
//! or the in-process loopback transport ([`loopback`]: the model and the
//! core alone) — or the plain RAM backend ([`ram`], the engine's ceiling).
//! The RDMA stacks share their HCA, CM, adapter start and teardown
//! ([`rdma`]).

pub mod backend;
pub mod engine;
pub mod iser;
pub mod linux_vm;
pub mod loopback;
pub mod model;
pub mod plot;
pub mod ram;
pub mod rdma;
pub mod report;
pub mod spec;
pub mod srp;
pub mod stats;
pub mod verify;
pub mod workload;

pub use backend::{Backend, Direction, IoQueue, TargetInfo};
pub use engine::{
    BenchError, CancelToken, Observer, Phase, RunConfig, Silent, SuiteResult, run_suite,
};
pub use spec::{AccessPart, AccessSpec};
