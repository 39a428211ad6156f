//! Tools around the initiator: the benchmark, software targets, the INF and
//! attachment tool, and the Linux target VM harness.

pub mod bench;
pub mod iscsi_target;
pub mod iser_target;
pub mod ntbuild;
pub mod scsi_target;
pub mod srp_target;
pub mod vm;
