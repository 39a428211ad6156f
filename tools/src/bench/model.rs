//! The StorPort-model backend: I/O enters the stack where Windows' disk
//! class driver hands it to StorPort.
//!
//! [`ModelBackend`] drives a [`StorPortModel`] (the host's StorPort) with an
//! installed miniport — the miniport core over the SRP engine, or over the
//! [loopback transport](super::loopback). Each outstanding I/O of a worker
//! owns one StorPort request per transfer size (a data buffer in simulated
//! physical memory, laid out in the chosen [`SgShape`]), reissued with a new
//! READ/WRITE CDB for every I/O ([`StorPortModel::reissue`]); completions
//! arrive through the model's completion hook, stamped when StorPort saw
//! them, and are routed to the worker that owns the request.
//!
//! Disks are found the way Windows finds them: READ CAPACITY(16) to every
//! LUN the adapter reports; the ones that answer are the benchmark's disks.
//! When the backend is finished, the adapter is freed and every violation
//! the model or the kverbs verifier recorded (a request completed twice or
//! never, an allocation or a wait at `DISPATCH_LEVEL`…) is reported.

use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use kverbs::irql::Passive;
use kverbs::platform::host::{HostConfig, HostPlatform};
use storport_srp::miniport::{Adapter, AdapterConfig, CoreContext, TMF_SLOTS};
use storport_srp::scsi::sense::{SenseKey, SenseRepr};
use storport_srp::scsi::{
    CdbRepr, ReadCapacity16Cdb, ReadCapacity16Data, ReadCapacity16Repr, ReadWriteCdb,
};
use storport_srp::storport::host::{
    HostPort, ModelConfig, RequestOutcome, RequestSpec, RequestState, SgShape, StorPortModel,
};
use storport_srp::storport::{AdapterLimits, Address, DataDirection, HwMiniport, SrbStatus};

use super::backend::{
    Backend, BackendError, Direction, IoCompletion, IoQueue, IoRequest, IoStatus, QueueConfig,
    TargetInfo,
};
use super::loopback::{LoopbackTransport, MAX_SG};
use crate::scsi_target::{BlockSize, LunConfig, ScsiTarget, TargetConfig};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// `wait` from now (a far-off instant for a wait too long to add).
fn deadline_after(wait: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(wait)
        .unwrap_or_else(|| now + Duration::from_secs(86_400))
}

/// Where one worker's completions go.
struct Mailbox {
    done: Mutex<Done>,
    ready: Condvar,
}

/// A mailbox's completions and whether its owner (one thread: the queue's
/// worker, or the caller of a one-shot command) sleeps on them.
struct Done {
    queue: VecDeque<(u32, Instant)>,
    /// The owner sleeps in [`Mailbox::wait_while`] and no completion has
    /// woken it yet.
    sleeping: bool,
}

impl Mailbox {
    fn new(capacity: usize) -> Self {
        Self {
            done: Mutex::new(Done {
                queue: VecDeque::with_capacity(capacity),
                sleeping: false,
            }),
            ready: Condvar::new(),
        }
    }

    /// Posts a completion. Wakes the owner only if it sleeps on the
    /// mailbox and no earlier completion has woken it: a condvar notify is
    /// a futex syscall even with no one waiting (one per I/O on the CQ DPC
    /// thread before, two thirds of the process's futex wakes in a 128 KiB
    /// read). The owner says it sleeps under the same lock before it
    /// waits, so no completion goes unnoticed.
    fn post(&self, request: u32, at: Instant) {
        let mut done = lock(&self.done);
        done.queue.push_back((request, at));
        let wake = std::mem::take(&mut done.sleeping);
        drop(done);
        if wake {
            self.ready.notify_one();
        }
    }

    /// Waits while `more` says the completions so far are not enough, until
    /// `deadline`; returns them (locked) either way.
    fn wait_while(
        &self,
        deadline: Instant,
        mut more: impl FnMut(&VecDeque<(u32, Instant)>) -> bool,
    ) -> MutexGuard<'_, Done> {
        let mut done = lock(&self.done);
        while more(&done.queue) {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            done.sleeping = true;
            done = self
                .ready
                .wait_timeout(done, deadline - now)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
            done.sleeping = false;
        }
        done
    }
}

/// Request index → the mailbox of the queue that owns it.
struct Routes {
    by_request: Box<[Mutex<Option<Arc<Mailbox>>>]>,
}

impl Routes {
    fn deliver(&self, request: u32) {
        let at = Instant::now();
        let mailbox = self
            .by_request
            .get(request as usize)
            .and_then(|m| lock(m).clone());
        if let Some(mailbox) = mailbox {
            mailbox.post(request, at);
        }
    }

    fn set(&self, request: u32, mailbox: Option<Arc<Mailbox>>) {
        if let Some(m) = self.by_request.get(request as usize) {
            *lock(m) = mailbox;
        }
    }
}

/// How a model backend was built (what the report says it is).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelIdentity {
    /// IOmeter's "Target Type" (`SRP`, `LOOPBACK`).
    pub target_type: String,
    /// One line on the path the I/O takes.
    pub description: String,
}

struct Shared<M: HwMiniport<HostPort>> {
    model: StorPortModel<M>,
    routes: Routes,
    /// Completed requests waiting for a queue, by buffer size.
    pool: Mutex<HashMap<u32, Vec<u32>>>,
    sg_shape: SgShape,
    settle_timeout: Duration,
    /// What the queues found of I/O that never completed.
    lost: Mutex<Vec<String>>,
}

/// How a stack is taken down at [`ModelBackend::finish`]: given the model
/// and what the backend kept, it stops the stack (freeing the adapter) and
/// returns every broken promise it found. Without one, `finish` just frees
/// the adapter.
pub type Teardown<M> = Box<
    dyn FnOnce(&mut StorPortModel<M>, &mut (dyn Any + Send + Sync), &Passive<'_>) -> Vec<String>
        + Send
        + Sync,
>;

/// A backend over the StorPort model (see the module docs).
pub struct ModelBackend<M: HwMiniport<HostPort>> {
    shared: Arc<Shared<M>>,
    platform: HostPlatform,
    targets: Vec<TargetInfo>,
    addresses: Vec<Address>,
    identity: ModelIdentity,
    /// Whatever must live as long as the stack (fabric, target).
    keep: Box<dyn Any + Send + Sync>,
    teardown: Option<Teardown<M>>,
}

/// Requests the model's table holds (each backend request is created once
/// and reused).
const MAX_REQUESTS: usize = 16_384;
/// How long the backend waits for its own setup I/O (discovery, first use
/// of a request) before calling the stack broken.
const SETUP_TIMEOUT: Duration = Duration::from_secs(30);
/// Times discovery asks a LUN again after a unit attention.
const UNIT_ATTENTION_RETRIES: usize = 4;
/// Times a setup READ that ended `SRB_STATUS_BUS_RESET` is retried.
const SETUP_RETRIES: usize = 3;

impl<M: HwMiniport<HostPort>> ModelBackend<M> {
    /// Wraps a started model (adapter found and initialised, targets
    /// connecting or connected) whose adapter reported `limits`; discovers
    /// the disks. `keep` is held until the backend is finished or dropped;
    /// `teardown` takes the stack down at [`Self::finish`].
    ///
    /// # Errors
    /// [`BackendError`] if no disk answers READ CAPACITY(16).
    pub fn new(
        model: StorPortModel<M>,
        limits: AdapterLimits,
        identity: ModelIdentity,
        sg_shape: SgShape,
        keep: Box<dyn Any + Send + Sync>,
        teardown: Option<Teardown<M>>,
    ) -> Result<Self, BackendError> {
        let platform = model.platform().clone();
        let routes = Routes {
            by_request: (0..MAX_REQUESTS).map(|_| Mutex::new(None)).collect(),
        };
        let shared = Arc::new(Shared {
            model,
            routes,
            pool: Mutex::new(HashMap::new()),
            sg_shape,
            settle_timeout: SETUP_TIMEOUT,
            lost: Mutex::new(Vec::new()),
        });
        let weak = Arc::downgrade(&shared);
        shared.model.on_complete(Box::new(move |request| {
            if let Some(shared) = weak.upgrade() {
                shared.routes.deliver(request);
            }
        }));
        let mut backend = Self {
            shared,
            platform,
            targets: Vec::new(),
            addresses: Vec::new(),
            identity,
            keep,
            teardown,
        };
        backend.discover(limits)?;
        Ok(backend)
    }

    /// Runs one command to completion on a fresh request; its outcome and
    /// data.
    fn one_shot(&self, spec: &RequestSpec) -> Result<(RequestOutcome, Vec<u8>), BackendError> {
        let model = &self.shared.model;
        let mailbox = Arc::new(Mailbox::new(4));
        let id = self
            .platform
            .run_passive(|p| model.create(spec, p))
            .map_err(|e| BackendError::new(format!("cannot create a request: {e:?}")))?;
        self.shared.routes.set(id, Some(mailbox.clone()));
        model
            .issue(id)
            .map_err(|e| BackendError::new(format!("cannot issue a request: {e:?}")))?;
        self.platform.run_passive(|p| model.pump(p));
        let deadline = Instant::now() + self.shared.settle_timeout;
        let done = mailbox.wait_while(deadline, VecDeque::is_empty);
        if done.queue.is_empty() {
            return Err(BackendError::new(
                "a setup command did not complete (the stack is stuck)",
            ));
        }
        drop(done);
        self.shared.routes.set(id, None);
        let outcome = model
            .outcome(id)
            .ok_or_else(|| BackendError::new("a setup request vanished"))?;
        let data = model.data(id).unwrap_or_default();
        Ok((outcome, data))
    }

    fn discover(&mut self, limits: AdapterLimits) -> Result<(), BackendError> {
        for target in 0..limits.targets_per_bus {
            for lun in 0..limits.luns_per_target {
                let address = Address::new(0, target, lun);
                let cdb = CdbRepr::ReadCapacity16(ReadCapacity16Cdb {
                    lba: 0,
                    alloc_len: 32,
                    pmi: false,
                });
                let bytes = cdb
                    .to_cdb16()
                    .map_err(|e| BackendError::new(format!("READ CAPACITY(16): {e}")))?;
                let spec = RequestSpec::scsi_in(address, &bytes[..cdb.buffer_len()], 32);
                // A real target reports a unit attention (power on, reset,
                // LUNs changed) to a new session's first command on each
                // LUN; the class driver asks again, and so does this.
                let mut answer = self.one_shot(&spec)?;
                for _ in 0..UNIT_ATTENTION_RETRIES {
                    if !is_unit_attention(&answer.0) {
                        break;
                    }
                    answer = self.one_shot(&spec)?;
                }
                let (outcome, data) = answer;
                if outcome.status.base() != SrbStatus::SUCCESS {
                    continue;
                }
                let Ok(view) = ReadCapacity16Data::new_checked(&data[..]) else {
                    continue;
                };
                let Ok(capacity) = ReadCapacity16Repr::parse(&view) else {
                    continue;
                };
                self.targets.push(TargetInfo {
                    name: format!("t{target} lun{lun}"),
                    block_size: capacity.block_len,
                    capacity: (capacity.last_lba + 1) * u64::from(capacity.block_len),
                });
                self.addresses.push(address);
            }
        }
        if self.targets.is_empty() {
            return Err(BackendError::new(
                "no disk answered READ CAPACITY(16) on any target and LUN",
            ));
        }
        Ok(())
    }

    /// What `keep` holds, if it is a `T` (the tests reach the targets this
    /// way).
    #[must_use]
    pub fn kept<T: Any>(&self) -> Option<&T> {
        self.keep.downcast_ref::<T>()
    }

    /// Frees the adapter, stops the platform, and returns every violation
    /// the StorPort model and the kverbs verifier recorded (empty when the
    /// stack behaved).
    #[must_use]
    pub fn finish(self) -> Vec<String> {
        let Self {
            shared,
            platform,
            mut keep,
            teardown,
            ..
        } = self;
        let mut found = Vec::new();
        // A completion being routed right now holds the shared state for a
        // moment (the hook upgrades its weak reference): wait for it.
        let deadline = Instant::now() + SETUP_TIMEOUT;
        let mut shared = shared;
        let unwrapped = loop {
            match Arc::try_unwrap(shared) {
                Ok(s) => break Some(s),
                Err(again) if Instant::now() < deadline => {
                    shared = again;
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(_) => break None,
            }
        };
        match unwrapped {
            Some(mut shared) => {
                if !platform.quiesce(SETUP_TIMEOUT) {
                    found.push("queued DPCs or work items did not finish".to_owned());
                }
                found.extend(lock(&shared.lost).drain(..));
                platform.run_passive(|p| match teardown {
                    Some(teardown) => found.extend(teardown(&mut shared.model, keep.as_mut(), p)),
                    None => shared.model.free_adapter(p),
                });
                platform.quiesce(SETUP_TIMEOUT);
                shared.model.check_all_completed();
                found.extend(
                    shared
                        .model
                        .take_violations()
                        .iter()
                        .map(|v| format!("StorPort model: {v}")),
                );
            }
            None => found.push("a queue outlived its backend".to_owned()),
        }
        platform.stop();
        found.extend(
            platform
                .take_violations()
                .iter()
                .map(|v| format!("kverbs verifier: {v}")),
        );
        found
    }
}

/// Whether a command ended CHECK CONDITION with UNIT ATTENTION sense.
fn is_unit_attention(outcome: &RequestOutcome) -> bool {
    outcome.scsi_status == CHECK_CONDITION
        && SenseRepr::parse(&outcome.sense).is_ok_and(|s| s.key == SenseKey::UnitAttention)
}

/// SCSI status CHECK CONDITION.
const CHECK_CONDITION: u8 = 0x02;

fn rw_cdb(direction: Direction, lba: u64, blocks: u32) -> Result<([u8; 16], usize), BackendError> {
    let rw = ReadWriteCdb::new(lba, blocks);
    let cdb = match direction {
        Direction::Read => CdbRepr::Read(rw),
        Direction::Write => CdbRepr::Write(rw),
    };
    let bytes = cdb
        .to_cdb16()
        .map_err(|e| BackendError::new(format!("CDB for LBA {lba}: {e}")))?;
    Ok((bytes, cdb.buffer_len()))
}

impl<M: HwMiniport<HostPort>> Backend for ModelBackend<M> {
    fn target_type(&self) -> &str {
        &self.identity.target_type
    }

    fn describe(&self) -> String {
        self.identity.description.clone()
    }

    fn targets(&self) -> &[TargetInfo] {
        &self.targets
    }

    fn open_queue(&self, config: &QueueConfig) -> Result<Box<dyn IoQueue>, BackendError> {
        let mailbox = Arc::new(Mailbox::new(
            config.depth * config.transfer_sizes.len().max(1) + 8,
        ));
        let model = &self.shared.model;
        let mut requests: Vec<Vec<u32>> = Vec::with_capacity(config.depth);
        let mut fresh: Vec<u32> = Vec::new();
        for _ in 0..config.depth {
            let mut per_size = Vec::with_capacity(config.transfer_sizes.len());
            for &size in &config.transfer_sizes {
                let pooled = lock(&self.shared.pool).get_mut(&size).and_then(Vec::pop);
                let id = match pooled {
                    Some(id) => id,
                    None => {
                        // A new request: first run as a READ of the start of
                        // the first disk, so it is "completed" and can be
                        // reissued like every other.
                        let (cdb, n) =
                            rw_cdb(Direction::Read, 0, size / self.targets[0].block_size.max(1))?;
                        let spec = RequestSpec::scsi_in(self.addresses[0], &cdb[..n], size)
                            .shaped(self.shared.sg_shape)
                            .timeout(0);
                        let id = self
                            .platform
                            .run_passive(|p| model.create(&spec, p))
                            .map_err(|e| {
                                BackendError::new(format!(
                                    "cannot create a {size}-byte request: {e:?}"
                                ))
                            })?;
                        fresh.push(id);
                        id
                    }
                };
                self.shared.routes.set(id, Some(mailbox.clone()));
                per_size.push(id);
            }
            requests.push(per_size);
        }
        let mut queue = ModelQueue {
            shared: self.shared.clone(),
            platform: self.platform.clone(),
            mailbox,
            sizes: config.transfer_sizes.clone(),
            requests,
            owner: HashMap::new(),
            slot_request: vec![None; config.depth],
            block_sizes: self.targets.iter().map(|t| t.block_size).collect(),
            addresses: self.addresses.clone(),
        };
        for (slot, per_size) in queue.requests.iter().enumerate() {
            for &id in per_size {
                queue
                    .owner
                    .insert(id, u32::try_from(slot).unwrap_or(u32::MAX));
            }
        }
        if !fresh.is_empty() {
            for &id in &fresh {
                model
                    .issue(id)
                    .map_err(|e| BackendError::new(format!("cannot issue a request: {e:?}")))?;
            }
            self.platform.run_passive(|p| model.pump(p));
            queue.wait_for(fresh.len())?;
            // A first READ that ends SRB_STATUS_BUS_RESET is retried, as the
            // class driver retries it; anything else ends the setup.
            let mut failed: Vec<u32> = Vec::new();
            for attempt in 0..=SETUP_RETRIES {
                failed.clear();
                for &id in &fresh {
                    let status = model.outcome(id).map(|o| o.status.base());
                    if status != Some(SrbStatus::SUCCESS) {
                        if status != Some(SrbStatus::BUS_RESET) || attempt == SETUP_RETRIES {
                            return Err(BackendError::new(format!(
                                "the stack refused a first READ into a new buffer laid out as \
                                 {:?} ({status:?}); a layout of many odd segments can need more \
                                 memory registrations than one command may carry",
                                self.shared.sg_shape
                            )));
                        }
                        failed.push(id);
                    }
                }
                if failed.is_empty() {
                    break;
                }
                for &id in &failed {
                    let (cdb, n) = rw_cdb(
                        Direction::Read,
                        0,
                        queue.size_of(id) / self.targets[0].block_size.max(1),
                    )?;
                    model
                        .reissue(id, self.addresses[0], &cdb[..n], DataDirection::In, None)
                        .map_err(|e| BackendError::new(format!("cannot reissue: {e:?}")))?;
                }
                self.platform.run_passive(|p| model.pump(p));
                queue.wait_for(failed.len())?;
            }
        }
        Ok(Box::new(queue))
    }
}

struct ModelQueue<M: HwMiniport<HostPort>> {
    shared: Arc<Shared<M>>,
    platform: HostPlatform,
    mailbox: Arc<Mailbox>,
    sizes: Vec<u32>,
    /// Per slot, per size: the request.
    requests: Vec<Vec<u32>>,
    /// Request → slot.
    owner: HashMap<u32, u32>,
    /// Per slot: the request of its last I/O.
    slot_request: Vec<Option<u32>>,
    block_sizes: Vec<u32>,
    addresses: Vec<Address>,
}

impl<M: HwMiniport<HostPort>> ModelQueue<M> {
    /// The buffer size of request `id`.
    fn size_of(&self, id: u32) -> u32 {
        self.requests
            .iter()
            .find_map(|per_size| {
                per_size
                    .iter()
                    .position(|&r| r == id)
                    .and_then(|i| self.sizes.get(i).copied())
            })
            .unwrap_or(0)
    }

    /// Waits for `n` completions of the queue's own setup I/O.
    fn wait_for(&self, n: usize) -> Result<(), BackendError> {
        let deadline = Instant::now() + self.shared.settle_timeout;
        let mut done = self.mailbox.wait_while(deadline, |q| q.len() < n);
        if done.queue.len() < n {
            return Err(BackendError::new(
                "setup I/O did not complete (the stack is stuck)",
            ));
        }
        done.queue.clear();
        Ok(())
    }
}

impl<M: HwMiniport<HostPort>> Drop for ModelQueue<M> {
    fn drop(&mut self) {
        // Completed requests go back to the pool for the next queue; one
        // still outstanding (the worker gave up on it) is left to the
        // model, routed nowhere.
        let model = &self.shared.model;
        let mut pool = lock(&self.shared.pool);
        for per_size in &self.requests {
            for (&size, &id) in self.sizes.iter().zip(per_size) {
                self.shared.routes.set(id, None);
                if model
                    .outcome(id)
                    .is_some_and(|o| o.state == RequestState::Completed)
                {
                    pool.entry(size).or_default().push(id);
                }
            }
        }
    }
}

impl<M: HwMiniport<HostPort>> IoQueue for ModelQueue<M> {
    fn submit(&mut self, io: &IoRequest<'_>) -> Result<(), BackendError> {
        let slot = io.slot as usize;
        let size_index = self
            .sizes
            .iter()
            .position(|&s| s == io.len)
            .ok_or_else(|| {
                BackendError::new(format!("{} bytes is not one of the queue's sizes", io.len))
            })?;
        let id = *self
            .requests
            .get(slot)
            .and_then(|r| r.get(size_index))
            .ok_or_else(|| BackendError::new(format!("no slot {slot}")))?;
        let block = u64::from(
            *self
                .block_sizes
                .get(io.target)
                .ok_or_else(|| BackendError::new("no such disk"))?,
        );
        let address = self.addresses[io.target];
        let (cdb, n) = rw_cdb(
            io.direction,
            io.offset / block.max(1),
            u32::try_from(u64::from(io.len) / block.max(1)).unwrap_or(u32::MAX),
        )?;
        let direction = match io.direction {
            Direction::Read => DataDirection::In,
            Direction::Write => DataDirection::Out,
        };
        self.shared
            .model
            .reissue(id, address, &cdb[..n], direction, io.data)
            .map_err(|e| BackendError::new(format!("cannot reissue request {id}: {e:?}")))?;
        self.slot_request[slot] = Some(id);
        let model = &self.shared.model;
        self.platform.run_passive(|p| model.pump(p));
        Ok(())
    }

    fn reap(&mut self, out: &mut Vec<IoCompletion>, wait: Duration) -> Result<(), BackendError> {
        let drained: Vec<(u32, Instant)> = {
            let mut done = self
                .mailbox
                .wait_while(deadline_after(wait), VecDeque::is_empty);
            done.queue.drain(..).collect()
        };
        for (id, at) in drained {
            let Some(&slot) = self.owner.get(&id) else {
                continue;
            };
            let outcome = self
                .shared
                .model
                .outcome(id)
                .ok_or_else(|| BackendError::new(format!("request {id} vanished")))?;
            let status = if outcome.status.base() == SrbStatus::SUCCESS && outcome.scsi_status == 0
            {
                IoStatus::Good
            } else {
                IoStatus::Failed(format!(
                    "SRB status {:#04x}, SCSI status {:#04x}{}",
                    outcome.status.raw(),
                    outcome.scsi_status,
                    match outcome.sense.get(2..3) {
                        Some([key]) => format!(", sense key {:#x}", key & 0x0F),
                        _ => String::new(),
                    }
                ))
            };
            out.push(IoCompletion {
                slot,
                status,
                completed_at: at,
            });
        }
        Ok(())
    }

    fn read_data(&mut self, slot: u32, out: &mut [u8]) -> Result<(), BackendError> {
        let id = self
            .slot_request
            .get(slot as usize)
            .copied()
            .flatten()
            .ok_or_else(|| BackendError::new(format!("slot {slot} has no request")))?;
        let data = self
            .shared
            .model
            .data(id)
            .map_err(|e| BackendError::new(format!("request {id}'s data: {e:?}")))?;
        let n = out.len().min(data.len());
        out[..n].copy_from_slice(&data[..n]);
        Ok(())
    }
}

/// The shape of the loopback stack.
#[derive(Debug, Clone)]
pub struct LoopbackOptions {
    /// SRP-like targets (StorPort target ids).
    pub targets: u8,
    /// LUNs per target.
    pub luns: u8,
    /// Bytes per LUN (sparse RAM disks: only written chunks use memory).
    pub lun_bytes: u64,
    /// Logical block size of every LUN.
    pub block_size: BlockSize,
    /// How request buffers are laid out in physical memory.
    pub sg_shape: SgShape,
    /// Simulated processors (DPC threads).
    pub processors: u32,
    /// The adapter's queue depth (StorPort `MaxNumberOfIO`).
    pub max_io: u32,
}

impl Default for LoopbackOptions {
    fn default() -> Self {
        Self {
            targets: 1,
            luns: 1,
            lun_bytes: 256 << 20,
            block_size: BlockSize::B512,
            sg_shape: SgShape::Contiguous,
            processors: 2,
            max_io: 1024,
        }
    }
}

/// The adapter over the loopback transport.
pub type LoopbackMiniport = Adapter<HostPort, LoopbackTransport>;

/// Builds the loopback stack: the StorPort model → the miniport core →
/// the loopback transport → RAM-disk SCSI targets, all in this process.
///
/// # Errors
/// [`BackendError`] if a LUN configuration is invalid or the adapter does
/// not start.
pub fn loopback_backend(
    options: &LoopbackOptions,
) -> Result<ModelBackend<LoopbackMiniport>, BackendError> {
    let mut targets = Vec::new();
    for t in 0..options.targets {
        let mut target = ScsiTarget::new(TargetConfig::new(u64::from(t) + 1));
        for lun in 0..options.luns {
            target
                .add_lun(
                    u16::from(lun),
                    LunConfig::with_capacity_bytes(options.block_size, options.lun_bytes),
                )
                .map_err(|e| BackendError::new(format!("LUN configuration: {e:?}")))?;
        }
        targets.push(Arc::new(target));
    }
    let platform = HostPlatform::with_config(HostConfig {
        processors: options.processors.max(1),
        ..HostConfig::default()
    });
    let adapter = AdapterConfig {
        targets: options.targets,
        luns_per_target: options.luns,
        max_io: options.max_io,
        max_io_per_lun: options.max_io,
        max_transfer_bytes: 1 << 20,
        physical_breaks: u32::try_from(MAX_SG - 1).unwrap_or(255).min(256),
    };
    let slots = (adapter.max_io + TMF_SLOTS) as usize;
    let model_config = ModelConfig {
        max_requests: MAX_REQUESTS,
        memory_limit: 2 << 30,
        ..ModelConfig::default()
    };
    let result = platform.run_passive(|p| {
        let mut model = StorPortModel::<LoopbackMiniport>::new(&platform, model_config, p);
        let memory = model.memory();
        let host = platform.clone();
        let luns_for_transport = targets.clone();
        let context = CoreContext {
            config: adapter,
            make_transport: Box::new(move |upcalls, p| {
                LoopbackTransport::new(
                    upcalls,
                    memory.clone(),
                    &host,
                    luns_for_transport.clone(),
                    slots,
                    p,
                )
            }),
        };
        model
            .start(&context, p)
            .map(|limits| (model, limits))
            .map_err(|e| BackendError::new(format!("the adapter did not start: {e:?}")))
    });
    let (model, limits) = result?;
    platform.quiesce(SETUP_TIMEOUT);
    ModelBackend::new(
        model,
        limits,
        ModelIdentity {
            target_type: "LOOPBACK".into(),
            description: format!(
                "loopback: StorPort model -> miniport core -> loopback transport (no RDMA) -> {} RAM-disk target(s)",
                options.targets
            ),
        },
        options.sg_shape,
        Box::new(targets),
        None,
    )
}
