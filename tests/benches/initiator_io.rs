//! The initiator's cost per I/O (not a test): the full SRP stack on a
//! *stepped* fabric, driven by one thread, so that everything the
//! initiator does runs on this thread in a repeatable order.
//!
//! The StorPort model → miniport → SRP engine → kverbs → software HCA run
//! on a manual host platform (no DPC threads: this thread runs the queued
//! DPCs), the fabric is stepped by this thread too, and the software SRP
//! target runs on a platform of its own (threads), so no target code runs
//! on this thread. One round of a configuration issues `qd` requests,
//! dispatches them (BuildIo, StartIo, ExecutionRoutine: submission), moves
//! the fabric until the target has answered every one, then runs the
//! initiator's DPCs once (CQ drain: completion) — so every round sees the
//! same batches, and instruction counts repeat exactly. Before the first
//! configuration an unmeasured pass takes every ring of the channel round
//! at least once ([`Stepped::lap_rings`]), so each configuration measures
//! a driver in its steady state — reusing ring slots — whatever ran
//! before it (a fresh ring's first lap is 30 to 40 instructions per I/O
//! cheaper at QD 1: an empty slot never written is rejected on its
//! opcode alone).
//!
//! Usage (what `tools/perf/run.sh` does under callgrind):
//!
//! ```text
//! initiator_io [--rounds N] [--warmup N] [--configs read:4096:32,write:512:1,...]
//! ```
//!
//! Each configuration's measured rounds are bracketed by calls to
//! [`measure_begin`] and [`measure_end`] (never inlined), so callgrind's
//! `--zero-before=initiator_io::measure_begin
//! --dump-before=initiator_io::measure_end` writes one profile per
//! configuration holding only its steady state.
//!
//! Without callgrind it still measures the one thing it can alone:
//! allocations. The global allocator counts, per thread, allocations made
//! at `DISPATCH_LEVEL` (where the whole initiator fast path runs: StartIo,
//! the ExecutionRoutine and the CQ DPC) and all allocations, and the
//! program prints both for each configuration's measured rounds. The
//! initiator path must make none.

use std::alloc::{GlobalAlloc, Layout};
use std::cell::Cell;
use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hca_lowlevel::sim::{ExecMode, Fabric, FabricConfig, HcaConfig, SoftHca};
use kverbs::cm::{CmConfig, CmPort, CmPortConfig};
use kverbs::device::{Device, DeviceConfig};
use kverbs::hostdev::VerifiedHca;
use kverbs::irql::{Irql, Passive};
use kverbs::platform::Platform;
use kverbs::platform::host::{HostConfig, HostMode, HostPlatform, VerifierAllocator};
use kverbs_tests::{
    BlockSize, LunConfig, SrpTarget, SrpTargetConfig, cm_timing, rw_cdb, target_ip,
};
use storport_srp::miniport::transport::TargetState;
use storport_srp::miniport::{Adapter, AdapterConfig, CoreContext};
use storport_srp::srp::params::parse_add_target;
use storport_srp::srp::{SrpConfig, SrpTransport};
use storport_srp::storport::host::{
    HostPort, ModelConfig, RequestSpec, RequestState, SgDelivery, StartIoIrql, StartIoLocking,
    StorPortModel,
};
use storport_srp::storport::{Address, DataDirection, SrbStatus};

/// Counts allocations per thread (all, and at `DISPATCH_LEVEL`) and
/// forwards to the kverbs verifier's allocator.
struct CountingAllocator;

thread_local! {
    /// (all allocations, allocations at DISPATCH_LEVEL or above) by this
    /// thread. Const-initialised and without a destructor, so reading it
    /// never allocates.
    static ALLOCATIONS: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
}

fn note_allocation() {
    let raised = HostPlatform::current_irql() >= Irql::DISPATCH;
    let _ = ALLOCATIONS.try_with(|c| {
        let (all, at_dispatch) = c.get();
        c.set((all + 1, at_dispatch + u64::from(raised)));
    });
}

fn allocations() -> (u64, u64) {
    ALLOCATIONS.try_with(Cell::get).unwrap_or((0, 0))
}

// SAFETY: every method forwards to `VerifierAllocator` with the caller's
// arguments unchanged; the counting touches only a const-initialised
// thread-local without a destructor, and never allocates.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note_allocation();
        // SAFETY: the caller's `GlobalAlloc::alloc` contract, forwarded.
        unsafe { VerifierAllocator.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note_allocation();
        // SAFETY: the caller's `GlobalAlloc::alloc_zeroed` contract, forwarded.
        unsafe { VerifierAllocator.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's `GlobalAlloc::dealloc` contract, forwarded.
        unsafe { VerifierAllocator.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note_allocation();
        // SAFETY: the caller's `GlobalAlloc::realloc` contract, forwarded.
        unsafe { VerifierAllocator.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

type Hp = HostPlatform;
type SrpAdapter = Adapter<HostPort, SrpTransport<Hp>>;

/// One configuration: direction, transfer size, queue depth.
#[derive(Debug, Clone, Copy)]
struct Config {
    read: bool,
    bytes: u32,
    qd: u32,
}

impl Config {
    fn parse(s: &str) -> Option<Config> {
        let mut it = s.split(':');
        let read = match it.next()? {
            "read" => true,
            "write" => false,
            _ => return None,
        };
        let bytes = it.next()?.parse().ok()?;
        let qd = it.next()?.parse().ok()?;
        (bytes % 512 == 0 && bytes > 0 && qd > 0).then_some(Config { read, bytes, qd })
    }

    fn name(&self) -> String {
        format!(
            "{}:{}:{}",
            if self.read { "read" } else { "write" },
            self.bytes,
            self.qd
        )
    }
}

/// Callgrind zeroes its counters on entry (`--zero-before`).
#[inline(never)]
fn measure_begin(config: &Config) {
    // Distinct bodies: identical ones could be folded into one symbol.
    black_box(("begin", config.qd));
}

/// Callgrind dumps its counters on entry (`--dump-before`).
#[inline(never)]
fn measure_end(config: &Config) {
    black_box(("end", config.bytes, config.read));
}

struct Args {
    rounds: u32,
    warmup: u32,
    configs: Vec<Config>,
}

fn args() -> Args {
    let mut a = Args {
        rounds: 64,
        warmup: 8,
        configs: Vec::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--rounds" => a.rounds = it.next().and_then(|v| v.parse().ok()).unwrap_or(a.rounds),
            "--warmup" => a.warmup = it.next().and_then(|v| v.parse().ok()).unwrap_or(a.warmup),
            "--configs" => {
                for c in it.next().unwrap_or_default().split(',') {
                    match Config::parse(c) {
                        Some(c) => a.configs.push(c),
                        None => panic!("bad configuration {c:?} (want read|write:BYTES:QD)"),
                    }
                }
            }
            // `cargo bench` passes --bench.
            "--bench" => {}
            other => panic!("unknown argument {other:?}"),
        }
    }
    if a.configs.is_empty() {
        for read in [true, false] {
            for bytes in [512, 4096] {
                for qd in [1, 32, 256] {
                    a.configs.push(Config { read, bytes, qd });
                }
            }
        }
    }
    a
}

/// The stepped stack.
struct Stepped {
    platform: Hp,
    fabric: Fabric,
    initiator: Arc<SoftHca>,
    target: SrpTarget,
    model: StorPortModel<SrpAdapter>,
    // Kept alive for the model's transport.
    _device: Device<Hp>,
    _cm: CmPort<Hp>,
}

/// LUN 0: 512-byte blocks, 64 MiB.
const LUN_BLOCKS: u64 = 131_072;
/// Commands per channel: room for the deepest queue plus slack.
const QUEUE_SIZE: u32 = 512;

impl Stepped {
    /// Runs the fabric and the initiator's queued routines once.
    fn pump(&self) {
        self.fabric.run_until_idle();
        self.platform.run_until_idle(&mut |_| 0, 100_000);
    }

    fn pump_until(&self, what: &str, timeout: Duration, cond: impl Fn() -> bool) {
        let start = Instant::now();
        while !cond() {
            assert!(start.elapsed() < timeout, "timed out waiting for {what}");
            self.pump();
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    fn build(platform: &Hp, target_platform: &Hp, p: &Passive<'_>) -> Stepped {
        let fabric = Fabric::new(FabricConfig {
            mode: ExecMode::Stepped,
            seed: 1,
            ..FabricConfig::default()
        });
        let initiator = fabric.add_hca(HcaConfig {
            mem_limit: 512 << 20,
            ..HcaConfig::new(kverbs_tests::INITIATOR_IP)
        });
        let device = Device::open(
            platform,
            VerifiedHca::new(initiator.clone()),
            DeviceConfig::default(),
            p,
        )
        .expect("initiator device");
        let t = cm_timing();
        let cm = CmPort::create(
            &device,
            1,
            CmPortConfig {
                cm: CmConfig {
                    packet_lifetime: t.packet_lifetime,
                    cm_response_timeout: t.cm_response_timeout,
                    max_cm_retries: t.max_cm_retries,
                    timewait: t.timewait,
                    connections: 64,
                    listeners: 4,
                    ..CmConfig::new(hca_lowlevel::wire::Gid::ZERO, 0)
                },
                recv_buffers: 128,
                send_buffers: 128,
                trace: None,
            },
            p,
        )
        .expect("initiator CM");
        let hca = fabric.add_hca(HcaConfig::new(target_ip(0)));
        let config = SrpTargetConfig {
            luns: vec![LunConfig::new(BlockSize::B512, LUN_BLOCKS)],
            cm_timing: Some(t),
            staging_bytes: 64 << 20,
            rq_size: QUEUE_SIZE + 16,
            ..SrpTargetConfig::default()
        };
        // The target's own platform: its threads, never this one.
        let target = SrpTarget::start_on_hca(target_platform, hca, config, p).expect("SRP target");
        let guid = target.service_guid();
        let port = target.rdma_cm_port().expect("RDMA/CM port");
        let [a, b, c, d] = target_ip(0);
        let add_target = format!(
            "id_ext={guid:016x},ioc_guid={guid:016x},dest={a}.{b}.{c}.{d}:{port},queue_size={QUEUE_SIZE}"
        );
        let params = vec![parse_add_target(add_target.as_bytes()).expect("add_target")];
        let srp_config = SrpConfig::default();
        let shape = SrpTransport::<Hp>::adapter_shape(&params, &srp_config);
        let adapter = AdapterConfig {
            targets: 1,
            luns_per_target: 1,
            max_io: shape.max_io.clamp(1, 4096),
            max_io_per_lun: shape.max_io_per_lun.clamp(1, 4096),
            max_transfer_bytes: shape.max_transfer_bytes,
            physical_breaks: shape.physical_breaks,
        };
        let mut model = StorPortModel::with_memory(
            platform,
            ModelConfig {
                // StartIo and the ExecutionRoutine at DISPATCH_LEVEL, the
                // ExecutionRoutine inline: one fixed path.
                locking: StartIoLocking::Virtual,
                start_io_irql: StartIoIrql::Dispatch,
                sg_delivery: SgDelivery::Inline,
                max_requests: 16_384,
                memory_limit: 256 << 20,
                ..ModelConfig::default()
            },
            initiator.phys_memory().clone(),
            p,
        );
        let (dev2, cm2) = (device.clone(), cm.clone());
        let context = CoreContext {
            config: adapter,
            make_transport: Box::new(move |upcalls, p: &Passive<'_>| {
                SrpTransport::new(&dev2, &cm2, srp_config, &params, upcalls, p)
                    .map_err(|_| kverbs::platform::AllocError)
            }),
        };
        model.start(&context, p).expect("adapter start");
        let stack = Stepped {
            platform: platform.clone(),
            fabric,
            initiator,
            target,
            model,
            _device: device,
            _cm: cm,
        };
        stack.pump_until("login", Duration::from_secs(60), || {
            stack.model.miniport().core().target_state_of(0) == TargetState::Live
                && stack.target.live_channels() >= 1
        });
        stack
    }

    /// Issues every request and dispatches them (BuildIo, StartIo,
    /// ExecutionRoutine for each: the submission path).
    fn submit(&self, requests: &[Request], p: &Passive<'_>) {
        for r in requests {
            self.model
                .reissue(r.id, r.address, &r.cdb, r.direction, None)
                .expect("reissue");
        }
        self.model.pump(p);
    }

    fn all_done(&self, requests: &[Request]) -> bool {
        requests.iter().all(|r| {
            self.model
                .outcome(r.id)
                .is_some_and(|o| o.state == RequestState::Completed)
        })
    }

    fn check(&self, requests: &[Request]) {
        for r in requests {
            let o = self.model.outcome(r.id).expect("outcome");
            assert!(
                o.state == RequestState::Completed && o.status.base() == SrbStatus::SUCCESS,
                "request {} ended {:?}",
                r.id,
                o
            );
        }
    }

    /// A warm-up round: submit, then run the fabric and the initiator's
    /// routines together until every request completes and all is quiet.
    fn loose_round(&self, requests: &[Request], p: &Passive<'_>) {
        self.submit(requests, p);
        self.pump_until("a warm-up round", Duration::from_secs(60), || {
            self.all_done(requests)
        });
        self.settle();
        self.check(requests);
    }

    /// Learns how many CQEs the initiator's HCA writes in a round before
    /// the driver polls: submit, then move the fabric until the count has
    /// not changed for 50 ms; then finish the round.
    fn probe_round(&self, requests: &[Request], p: &Passive<'_>) -> u64 {
        let base = self.initiator.cqes_written();
        self.submit(requests, p);
        let mut last = (base, Instant::now());
        loop {
            self.fabric.run_until_idle();
            let now = self.initiator.cqes_written();
            if now != last.0 {
                last = (now, Instant::now());
            } else if now > base && last.1.elapsed() > Duration::from_millis(50) {
                break;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        self.pump_until("the probe round", Duration::from_secs(60), || {
            self.all_done(requests)
        });
        self.settle();
        self.check(requests);
        last.0 - base
    }

    /// Runs the fabric and the initiator's routines until neither has
    /// anything left to do (the target threads may still post: a short
    /// grace lets them).
    fn settle(&self) {
        let mut quiet = 0;
        while quiet < 3 {
            let before = self.initiator.cqes_written();
            self.pump();
            std::thread::sleep(Duration::from_millis(1));
            self.fabric.run_until_idle();
            if self.initiator.cqes_written() == before && self.platform.pending() == 0 {
                quiet += 1;
            } else {
                quiet = 0;
            }
        }
    }

    /// Creates `config.qd` requests on consecutive LBAs from `first_lba`
    /// (advanced past them), each completed once so `reissue` takes it.
    fn requests(&self, config: &Config, first_lba: &mut u64, p: &Passive<'_>) -> Vec<Request> {
        let address = Address::new(0, 0, 0);
        let blocks = config.bytes / 512;
        let requests: Vec<Request> = (0..config.qd)
            .map(|i| {
                let lba = (*first_lba + u64::from(i) * u64::from(blocks)) % (LUN_BLOCKS - 64);
                let cdb = rw_cdb(config.read, lba, blocks);
                let spec = if config.read {
                    RequestSpec::scsi_in(address, &cdb, config.bytes)
                } else {
                    RequestSpec::scsi_out(address, &cdb, vec![0x5A; config.bytes as usize])
                };
                let id = self.model.create(&spec, p).expect("create");
                // Complete it once so `reissue` takes it.
                self.model.issue(id).expect("issue");
                Request {
                    id,
                    address,
                    cdb,
                    direction: if config.read {
                        DataDirection::In
                    } else {
                        DataDirection::Out
                    },
                }
            })
            .collect();
        *first_lba += u64::from(config.qd) * u64::from(blocks);
        // The first pass, from `issue`.
        self.model.pump(p);
        self.pump_until("the first pass", Duration::from_secs(60), || {
            self.all_done(&requests)
        });
        self.settle();
        requests
    }

    /// Runs unmeasured 4 KiB reads at QD 256 until the initiator's HCA has
    /// written twice as many CQEs as its largest CQ holds, so every ring
    /// of the channel (the CQ, and the send and receive queues it is sized
    /// to cover: a read takes a receive, three or more send WQEBBs and
    /// writes two CQEs) has been round at least once before anything is
    /// measured. A long-running driver reuses ring slots; a fresh ring's
    /// first lap writes into empty ones, which costs a few instructions
    /// less per WQE and per poll (30 to 40 per I/O at QD 1), so without
    /// this a configuration's count depended on how many I/Os the
    /// configurations before it had done.
    fn lap_rings(&self, first_lba: &mut u64, p: &Passive<'_>) {
        let config = Config {
            read: true,
            bytes: 4096,
            qd: 256,
        };
        let requests = self.requests(&config, first_lba, p);
        let want = 2 * u64::from(self.initiator.largest_cq_entries());
        let base = self.initiator.cqes_written();
        while self.initiator.cqes_written() - base < want {
            self.loose_round(&requests, p);
        }
    }

    /// One measured round: submit, move the fabric (the target answers on
    /// its own threads) until the initiator's HCA has written the `cqes`
    /// completions the probe saw, then run the initiator's DPCs — one drain
    /// sees every response of the round — and pump until every request
    /// has completed (what the completion path posts, a LOCAL_INV, needs
    /// the initiator's HCA only), then settle. Returns false if more CQEs
    /// than expected had landed before the drain (a different batch: the
    /// round's count is not the steady state's).
    fn round(&self, requests: &[Request], cqes: u64, p: &Passive<'_>) -> bool {
        let base = self.initiator.cqes_written();
        self.submit(requests, p);
        let start = Instant::now();
        let seen = loop {
            self.fabric.run_until_idle();
            let seen = self.initiator.cqes_written() - base;
            if seen >= cqes {
                break seen;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "the target did not answer"
            );
            std::thread::yield_now();
        };
        // Completion: the CQ DPC, and what the completion path posted.
        self.platform.run_until_idle(&mut |_| 0, 100_000);
        self.pump_until("a round", Duration::from_secs(60), || {
            self.all_done(requests)
        });
        self.settle();
        self.check(requests);
        seen == cqes
    }
}

struct Request {
    id: u32,
    address: Address,
    cdb: Vec<u8>,
    direction: DataDirection,
}

fn main() {
    let args = args();
    let platform = HostPlatform::with_config(HostConfig {
        mode: HostMode::Manual,
        processors: 1,
        worker_threads: 1,
        dpc_budget: Duration::from_secs(2),
        ..HostConfig::default()
    });
    let target_platform = HostPlatform::with_config(HostConfig {
        mode: HostMode::Threaded,
        processors: 1,
        worker_threads: 1,
        dpc_budget: Duration::from_secs(2),
        ..HostConfig::default()
    });
    let tp = target_platform.clone();
    platform.run_passive(|p| {
        let stack = Stepped::build(&platform, &tp, p);
        let mut first_lba = 0u64;
        stack.lap_rings(&mut first_lba, p);
        println!("config rounds ios allocs_at_dispatch allocs_this_thread inexact_rounds");
        for config in &args.configs {
            let requests = stack.requests(config, &mut first_lba, p);
            for _ in 0..args.warmup {
                stack.loose_round(&requests, p);
            }
            let cqes = stack.probe_round(&requests, p);
            let before = allocations();
            let mut inexact = 0;
            measure_begin(config);
            for _ in 0..args.rounds {
                if !stack.round(&requests, cqes, p) {
                    inexact += 1;
                }
            }
            measure_end(config);
            let after = allocations();
            stack.settle();
            if inexact > 0 {
                eprintln!(
                    "{}: {inexact} of {} rounds saw more completions than the probe before the drain",
                    config.name(),
                    args.rounds
                );
            }
            let ios = u64::from(args.rounds) * u64::from(config.qd);
            println!(
                "{} {} {} {} {} {inexact}",
                config.name(),
                args.rounds,
                ios,
                after.1 - before.1,
                after.0 - before.0,
            );
        }
        let violations = stack.platform.take_violations();
        assert!(violations.is_empty(), "verifier: {violations:?}");
        let model_violations = stack.model.take_violations();
        assert!(model_violations.is_empty(), "model: {model_violations:?}");
        let c = stack.target.counters();
        assert_eq!(
            (c.credit_violations, c.malformed_ius, c.bad_descriptors),
            (0, 0, 0),
            "the target saw the initiator break SRP"
        );
        // A benchmark, not a test of teardown (the full-stack tests do
        // that): leave without taking the stack down.
        std::process::exit(0);
    })
}
