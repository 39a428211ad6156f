//! Shared by the storport-srp integration tests: the kverbs verifier's
//! global allocator (so any allocation at `DISPATCH_LEVEL`, in the model, the
//! core or the fake transport, is a violation), the fake transport, and
//! helpers to build an adapter under the StorPort model.

#![allow(dead_code, reason = "each test binary uses a different subset")]

pub mod fake;
pub mod scsi;

use std::time::Duration;

use kverbs::irql::Passive;
use kverbs::platform::host::{HostConfig, HostPlatform, VerifierAllocator};
use storport_srp::miniport::{Adapter, AdapterConfig, CoreContext, TMF_SLOTS};
use storport_srp::storport::Address;
use storport_srp::storport::host::{
    HostPort, ModelConfig, RequestOutcome, RequestSpec, StorPortModel,
};

use fake::{FakeConfig, FakeTransport};

#[global_allocator]
static ALLOCATOR: VerifierAllocator = VerifierAllocator;

/// The adapter under test.
pub type Miniport = Adapter<HostPort, FakeTransport>;
/// The model driving it.
pub type Model = StorPortModel<Miniport>;

/// A manual-mode platform: nothing runs until the test says so.
pub fn manual() -> HostPlatform {
    HostPlatform::manual()
}

/// A threaded platform with `processors` DPC threads.
pub fn threaded(processors: u32) -> HostPlatform {
    HostPlatform::with_config(HostConfig {
        processors,
        ..HostConfig::default()
    })
}

/// A count from the environment (for the big sweeps), or `default`.
pub fn env_count(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// LUN `lun` of target `target` on bus 0.
pub fn lun(target: u8, lun: u8) -> Address {
    Address::new(0, target, lun)
}

/// The adapter shape most tests use.
pub fn adapter_config() -> AdapterConfig {
    AdapterConfig {
        targets: 2,
        luns_per_target: 2,
        max_io: 64,
        max_io_per_lun: 32,
        max_transfer_bytes: 1 << 20,
        physical_breaks: 256,
    }
}

/// Builds a model, finds and initialises the adapter over a fake
/// transport, and runs until the targets are logged in.
pub fn start(
    platform: &HostPlatform,
    model_config: ModelConfig,
    adapter: AdapterConfig,
    fake: FakeConfig,
    p: &Passive<'_>,
) -> Model {
    let mut model = Model::new(platform, model_config, p);
    let memory = model.memory();
    let checker = model.checker();
    let slots = (adapter.max_io + TMF_SLOTS) as usize;
    let targets = adapter.targets;
    let host = platform.clone();
    let context = CoreContext {
        config: adapter,
        make_transport: Box::new(move |upcalls, p| {
            Ok(FakeTransport::new(
                upcalls,
                memory.clone(),
                checker,
                &host,
                fake.clone(),
                targets,
                slots,
                p,
            ))
        }),
    };
    model.start(&context, p).expect("the adapter starts");
    model.settle();
    model
}

/// Submits `spec`, settles, and returns how it ended.
pub fn run(model: &Model, spec: &RequestSpec, p: &Passive<'_>) -> (u32, RequestOutcome) {
    let id = model.submit(spec, p).expect("request created");
    model.settle();
    (id, model.outcome(id).expect("known request"))
}

/// One second of StorPort time.
pub const SECOND: Duration = Duration::from_secs(1);
