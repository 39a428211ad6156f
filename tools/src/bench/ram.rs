//! A plain RAM backend: disks that are byte arrays, I/O done by `memcpy`
//! at submit time.
//!
//! It measures the benchmark engine itself (its ceiling) and is what the
//! engine's tests run on: a fixed service time can be added to every I/O
//! (so latency figures are known in advance), bytes on a disk can be
//! corrupted behind the benchmark's back (so the verifier has something to
//! catch), and I/Os can be made to fail.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, Instant};

use super::backend::{
    Backend, BackendError, Direction, IoCompletion, IoQueue, IoRequest, IoStatus, QueueConfig,
    TargetInfo,
};

/// One RAM disk.
struct Disk {
    info: TargetInfo,
    bytes: RwLock<Vec<u8>>,
}

/// The RAM backend (see the module docs).
pub struct RamBackend {
    disks: Vec<Arc<Disk>>,
    targets: Vec<TargetInfo>,
    service_time: Duration,
    fail_every: Arc<AtomicU64>,
    submitted: Arc<AtomicU64>,
}

impl RamBackend {
    /// `disks` disks of `capacity` bytes each, with 512-byte blocks.
    #[must_use]
    pub fn new(disks: usize, capacity: u64) -> Self {
        let disks: Vec<Arc<Disk>> = (0..disks)
            .map(|i| {
                Arc::new(Disk {
                    info: TargetInfo {
                        name: format!("ram{i}"),
                        block_size: 512,
                        capacity,
                    },
                    bytes: RwLock::new(vec![0; usize::try_from(capacity).unwrap_or(0)]),
                })
            })
            .collect();
        let targets = disks.iter().map(|d| d.info.clone()).collect();
        Self {
            disks,
            targets,
            service_time: Duration::ZERO,
            fail_every: Arc::new(AtomicU64::new(0)),
            submitted: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Every I/O completes `service_time` after it was submitted (and no
    /// earlier).
    #[must_use]
    pub fn with_service_time(mut self, service_time: Duration) -> Self {
        self.service_time = service_time;
        self
    }

    /// Makes every `n`th I/O fail (0: none).
    pub fn fail_every(&self, n: u64) {
        self.fail_every.store(n, Ordering::Relaxed);
    }

    /// Flips the bits of `len` bytes of disk `target` at `offset`, behind
    /// the benchmark's back (a corrupted block for the verifier to catch).
    ///
    /// # Panics
    /// If the range is outside the disk (a test bug).
    pub fn corrupt(&self, target: usize, offset: u64, len: usize) {
        let mut bytes = self.disks[target]
            .bytes
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        let start = usize::try_from(offset).expect("offset fits");
        for b in &mut bytes[start..start + len] {
            *b = !*b;
        }
    }

    /// A copy of `len` bytes of disk `target` at `offset`.
    ///
    /// # Panics
    /// If the range is outside the disk (a test bug).
    #[must_use]
    pub fn peek(&self, target: usize, offset: u64, len: usize) -> Vec<u8> {
        let bytes = self.disks[target]
            .bytes
            .read()
            .unwrap_or_else(PoisonError::into_inner);
        let start = usize::try_from(offset).expect("offset fits");
        bytes[start..start + len].to_vec()
    }
}

impl Backend for RamBackend {
    fn target_type(&self) -> &str {
        "RAM"
    }

    fn describe(&self) -> String {
        format!(
            "RAM backend: {} in-process byte arrays, no initiator stack{}",
            self.disks.len(),
            if self.service_time.is_zero() {
                String::new()
            } else {
                format!(", {:?} service time", self.service_time)
            }
        )
    }

    fn targets(&self) -> &[TargetInfo] {
        &self.targets
    }

    fn open_queue(&self, config: &QueueConfig) -> Result<Box<dyn IoQueue>, BackendError> {
        let largest = config.transfer_sizes.iter().copied().max().unwrap_or(0) as usize;
        Ok(Box::new(RamQueue {
            disks: self.disks.clone(),
            buffers: (0..config.depth).map(|_| vec![0u8; largest]).collect(),
            lens: vec![None; config.depth],
            ready: VecDeque::with_capacity(config.depth),
            service_time: self.service_time,
            fail_every: self.fail_every.clone(),
            submitted: self.submitted.clone(),
        }))
    }
}

struct RamQueue {
    disks: Vec<Arc<Disk>>,
    buffers: Vec<Vec<u8>>,
    /// Per slot: the length of the read completed in it.
    lens: Vec<Option<usize>>,
    /// Completions in submission order, with the moment each is due.
    ready: VecDeque<(Instant, IoCompletion)>,
    service_time: Duration,
    fail_every: Arc<AtomicU64>,
    submitted: Arc<AtomicU64>,
}

impl IoQueue for RamQueue {
    fn submit(&mut self, io: &IoRequest<'_>) -> Result<(), BackendError> {
        let slot = io.slot as usize;
        let disk = self
            .disks
            .get(io.target)
            .ok_or_else(|| BackendError::new(format!("no target {}", io.target)))?;
        let buffer = self
            .buffers
            .get_mut(slot)
            .ok_or_else(|| BackendError::new(format!("no slot {slot}")))?;
        let len = io.len as usize;
        if len > buffer.len() {
            return Err(BackendError::new(format!(
                "{len} bytes is over the queue's largest size"
            )));
        }
        let start = usize::try_from(io.offset).map_err(|_| BackendError::new("offset"))?;
        let end = start
            .checked_add(len)
            .filter(|&e| e as u64 <= disk.info.capacity)
            .ok_or_else(|| {
                BackendError::new(format!("I/O beyond the end of {}", disk.info.name))
            })?;
        let n = self.submitted.fetch_add(1, Ordering::Relaxed) + 1;
        let every = self.fail_every.load(Ordering::Relaxed);
        let status = if every != 0 && n % every == 0 {
            IoStatus::Failed("injected failure".into())
        } else {
            match io.direction {
                Direction::Read => {
                    let bytes = disk.bytes.read().unwrap_or_else(PoisonError::into_inner);
                    buffer[..len].copy_from_slice(&bytes[start..end]);
                }
                Direction::Write => {
                    if let Some(data) = io.data {
                        buffer[..len].copy_from_slice(&data[..len]);
                    }
                    let mut bytes = disk.bytes.write().unwrap_or_else(PoisonError::into_inner);
                    bytes[start..end].copy_from_slice(&buffer[..len]);
                }
            }
            IoStatus::Good
        };
        self.lens[slot] = (io.direction == Direction::Read).then_some(len);
        let due = Instant::now() + self.service_time;
        self.ready.push_back((
            due,
            IoCompletion {
                slot: io.slot,
                status,
                completed_at: due,
            },
        ));
        Ok(())
    }

    fn reap(&mut self, out: &mut Vec<IoCompletion>, wait: Duration) -> Result<(), BackendError> {
        let Some(&(first_due, _)) = self.ready.front() else {
            return Ok(());
        };
        let now = Instant::now();
        if first_due > now {
            std::thread::sleep((first_due - now).min(wait));
        }
        let now = Instant::now();
        while let Some((due, _)) = self.ready.front() {
            if *due > now {
                break;
            }
            if let Some((_, c)) = self.ready.pop_front() {
                out.push(c);
            }
        }
        Ok(())
    }

    fn read_data(&mut self, slot: u32, out: &mut [u8]) -> Result<(), BackendError> {
        let slot = slot as usize;
        let len = self
            .lens
            .get(slot)
            .copied()
            .flatten()
            .ok_or_else(|| BackendError::new(format!("slot {slot} holds no completed read")))?;
        let n = out.len().min(len);
        out[..n].copy_from_slice(&self.buffers[slot][..n]);
        Ok(())
    }
}
