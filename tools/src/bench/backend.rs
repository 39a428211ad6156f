//! The seam between the benchmark engine and what it measures.
//!
//! A [`Backend`] is a storage stack with disks ([`TargetInfo`]: IOmeter's
//! "targets"). Each worker opens its own [`IoQueue`] on it and keeps up to
//! `depth` I/Os outstanding through it: [`IoQueue::submit`] starts one in a
//! numbered slot, [`IoQueue::reap`] collects completions with the moment
//! each completed, [`IoQueue::read_data`] hands a completed read's data to
//! the verifier. The engine never reuses a slot before its completion was
//! reaped, so a backend can keep per-slot buffers (as IOmeter keeps one data
//! buffer per outstanding I/O, and as the StorPort model keeps one request).

use std::fmt;
use std::time::{Duration, Instant};

use serde::Serialize;

/// Which way an I/O moves data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum Direction {
    /// From the disk (SCSI READ).
    Read,
    /// To the disk (SCSI WRITE).
    Write,
}

/// One disk a backend offers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TargetInfo {
    /// The name results show (`t0 lun0`).
    pub name: String,
    /// Logical block size, bytes.
    pub block_size: u32,
    /// Capacity, bytes.
    pub capacity: u64,
}

/// What a worker asks of its queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueConfig {
    /// Slots (outstanding I/Os), numbered `0..depth`.
    pub depth: usize,
    /// Every transfer size the worker will submit.
    pub transfer_sizes: Vec<u32>,
}

/// One I/O to start.
#[derive(Debug, Clone, Copy)]
pub struct IoRequest<'a> {
    /// The slot, below the queue's depth, not outstanding.
    pub slot: u32,
    /// Index into [`Backend::targets`].
    pub target: usize,
    /// Read or write.
    pub direction: Direction,
    /// Byte offset on the disk (a multiple of its block size).
    pub offset: u64,
    /// Bytes (a multiple of the block size, one of the queue's sizes).
    pub len: u32,
    /// For a write: the data to write (`len` bytes). `None` writes
    /// whatever the slot's buffer holds (no copy: the benchmark's normal
    /// mode).
    pub data: Option<&'a [u8]>,
}

/// How an I/O ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IoStatus {
    /// Done, all data moved.
    Good,
    /// Failed; the text says how (SRB and SCSI status, sense key).
    Failed(String),
}

/// One completed I/O.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IoCompletion {
    /// The slot it was submitted in.
    pub slot: u32,
    /// How it ended.
    pub status: IoStatus,
    /// When the stack reported it complete (StorPort's `RequestComplete`).
    pub completed_at: Instant,
}

/// A backend could not do what was asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendError(pub String);

impl fmt::Display for BackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BackendError {}

impl BackendError {
    /// An error with this message.
    pub fn new(message: impl Into<String>) -> Self {
        Self(message.into())
    }
}

/// A storage stack the benchmark drives.
pub trait Backend: Send + Sync {
    /// IOmeter's "Target Type" for its disks (`SRP`, `LOOPBACK`, `RAM`).
    fn target_type(&self) -> &str;

    /// One line on what the I/O goes through.
    fn describe(&self) -> String;

    /// The disks.
    fn targets(&self) -> &[TargetInfo];

    /// A queue for one worker.
    ///
    /// # Errors
    /// [`BackendError`] if the stack cannot serve the depth or sizes.
    fn open_queue(&self, config: &QueueConfig) -> Result<Box<dyn IoQueue>, BackendError>;
}

/// One worker's queue.
pub trait IoQueue: Send {
    /// Starts an I/O; its completion comes from [`Self::reap`].
    ///
    /// # Errors
    /// [`BackendError`]: nothing was started (a bad slot, size or range).
    fn submit(&mut self, io: &IoRequest<'_>) -> Result<(), BackendError>;

    /// Appends the completions that have arrived to `out`, waiting up to
    /// `wait` for the first one if none is there.
    ///
    /// # Errors
    /// [`BackendError`] if the stack broke (not for a failed I/O: that is
    /// an [`IoStatus::Failed`] completion).
    fn reap(&mut self, out: &mut Vec<IoCompletion>, wait: Duration) -> Result<(), BackendError>;

    /// Copies the data of the read completed in `slot` (reaped, not yet
    /// resubmitted) into `out` (`len` bytes of it).
    ///
    /// # Errors
    /// [`BackendError`] if the slot holds no completed read.
    fn read_data(&mut self, slot: u32, out: &mut [u8]) -> Result<(), BackendError>;
}
