//! Seeded random schedules: the miniport core over the fake transport,
//! under the StorPort model in manual mode, with the order of every DPC,
//! work item, completion, timeout, abort, reset, state change and credit
//! change chosen by a seeded generator. Each schedule ends by letting the
//! system settle, and then checks:
//!
//! * every request StorPort issued completed **exactly once** (the model's
//!   checks: no double, unknown or dropped completion, none left, completions
//!   at legal IRQLs, lists released, no reset leaving requests behind);
//! * no allocation and no blocking at `DISPATCH_LEVEL` anywhere (the kverbs
//!   verifier);
//! * the fake transport caught no contract breach by the core;
//! * data integrity: every block read back, and every block on the RAM disk
//!   at the end, holds a value some write to it could have left.
//!
//! `STORPORT_SCHEDULES` sets the number of schedules (default 1000);
//! `STORPORT_SCHEDULE_SEED` replays one seed.

mod support;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use kverbs::irql::Passive;
use storport_srp::miniport::transport::TargetState;
use storport_srp::storport::host::{
    ModelConfig, RequestSpec, RequestState, SgDelivery, SgShape, StartIoIrql, StartIoLocking,
};
use storport_srp::storport::{Address, SrbFunction, SrbStatus};

use support::fake::{Delivery, FakeConfig, Scripted};
use support::scsi::{self, BLOCK};
use support::{Model, adapter_config, env_count, lun, manual, start};

const LBAS: u32 = 48;

struct Shadow {
    /// (lun, block) → values a write may have left there (0 = never
    /// written).
    candidates: HashMap<(u8, u32), HashSet<u8>>,
}

impl Shadow {
    fn may_hold(&self, lun: u8, block: u32, value: u8) -> bool {
        value == 0
            || self
                .candidates
                .get(&(lun, block))
                .is_some_and(|s| s.contains(&value))
    }

    fn check_block(&self, seed: u64, what: &str, lun: u8, block: u32, bytes: &[u8]) {
        let first = bytes[0];
        assert!(
            bytes.iter().all(|&b| b == first),
            "seed {seed}: {what}: block {lun}/{block} is torn"
        );
        assert!(
            self.may_hold(lun, block, first),
            "seed {seed}: {what}: block {lun}/{block} holds {first}, which no write put there"
        );
    }
}

struct Io {
    id: u32,
    lun: u8,
    lba: u32,
    blocks: u32,
    read: bool,
}

fn one_schedule(seed: u64, seen: &mut Coverage) {
    eprintln!("schedule seed {seed} (replay: STORPORT_SCHEDULE_SEED={seed})");
    let mut rng = fastrand::Rng::with_seed(seed);
    let locking = [
        StartIoLocking::Virtual,
        StartIoLocking::FullDuplex,
        StartIoLocking::ConcurrentChannels,
    ][rng.usize(..3)];
    let config = ModelConfig {
        locking,
        sg_delivery: [
            SgDelivery::Inline,
            SgDelivery::Deferred,
            SgDelivery::Alternate,
        ][rng.usize(..3)],
        start_io_irql: [
            StartIoIrql::Passive,
            StartIoIrql::Dispatch,
            StartIoIrql::Alternate,
        ][rng.usize(..3)],
        max_requests: 400,
        memory_limit: 64 << 20,
        ..ModelConfig::default()
    };
    let fake = FakeConfig {
        delivery: Delivery::Dpc,
        out_of_order: rng.bool(),
        immediate_writes: rng.bool(),
        credits: if rng.bool() { rng.u32(1..4) } else { 64 },
        seed,
        luns: 2,
        blocks: u64::from(LBAS) + 8,
        // A third of the schedules also race returned credit against the
        // refusal's hold (without drawing from the schedule's generator).
        credit_races_refusal: seed % 3 == 0,
    };
    let platform = manual();
    platform.run_passive(|p| {
        let model = start(&platform, config, adapter_config(), fake, p);
        let mut shadow = Shadow {
            candidates: HashMap::new(),
        };
        let mut ios: Vec<Io> = Vec::new();
        let mut restore: Vec<(usize, u8)> = Vec::new();
        let mut stopped = false;
        let steps = rng.usize(40..120);
        for step in 0..steps {
            // Targets knocked over come back a few steps later.
            restore.retain(|&(at, target)| {
                if at == step {
                    model
                        .miniport()
                        .transport()
                        .set_target_state(target, TargetState::Live);
                    false
                } else {
                    true
                }
            });
            act(
                &model,
                &mut rng,
                &mut shadow,
                &mut ios,
                &mut restore,
                &mut stopped,
                step,
                p,
            );
        }
        // Let everything finish: targets live, credits back, the adapter
        // running, late answers released, time moving (commands the target
        // never answers time out and are reset).
        let fake = model.miniport().transport();
        for t in 0..2 {
            fake.set_target_state(t, TargetState::Live);
            fake.set_credits(t, 64);
        }
        if stopped {
            model.restart_adapter(p);
        }
        let mut rounds = 0;
        loop {
            fake.release_late(usize::MAX);
            model.settle_with(&mut |n| rng.usize(..n));
            let issued_open = (0..model.created()).any(|id| {
                matches!(
                    model.outcome(id).map(|o| o.state),
                    Some(RequestState::Queued | RequestState::InMiniport | RequestState::InSgBuild)
                )
            });
            if !issued_open && fake.outstanding() == 0 {
                break;
            }
            rounds += 1;
            assert!(rounds < 100, "seed {seed}: the schedule does not settle");
            model.advance(Duration::from_secs(5), p);
        }
        // Reads saw what writes could have left; so does the disk.
        for io in &ios {
            let o = model.outcome(io.id).unwrap();
            assert_eq!(o.completions, 1, "seed {seed}: request {}", io.id);
            if io.read && o.status == SrbStatus::SUCCESS {
                let data = model.data(io.id).unwrap();
                for b in 0..io.blocks {
                    let at = b as usize * BLOCK;
                    shadow.check_block(seed, "read", io.lun, io.lba + b, &data[at..at + BLOCK]);
                }
            }
        }
        for l in 0..2u8 {
            for block in 0..LBAS + 8 {
                let bytes = fake
                    .disk()
                    .peek(usize::from(l), block as usize * BLOCK, BLOCK);
                shadow.check_block(seed, "disk", l, block, &bytes);
            }
        }
        assert_eq!(fake.errors(), 0, "seed {seed}: the fake caught the core");
        let core = model.miniport().core().stats();
        let storport = model.stats();
        let transport = fake.stats();
        seen.add("TMF sent", core.tmfs_sent);
        seen.add("BUSY for lack of credit", core.busy_no_credit);
        seen.add("BUSY while not ready", core.busy_not_ready);
        seen.add("request timeouts", storport.timeouts);
        seen.add("bus resets", storport.bus_resets);
        seen.add("BUSY requeues", storport.busy_requeues);
        seen.add("transport aborts", transport.aborts);
        seen.add("transport LUN resets", transport.lun_resets);
        seen.add("transport stops", transport.stops);
        seen.add("immediate writes", transport.immediate);
        for id in 0..model.created() {
            let status = model.outcome(id).unwrap().status.base();
            seen.add(&format!("{status:?}"), 1);
        }
        model.finish();
    });
}

#[allow(clippy::too_many_arguments)]
fn act(
    model: &Model,
    rng: &mut fastrand::Rng,
    shadow: &mut Shadow,
    ios: &mut Vec<Io>,
    restore: &mut Vec<(usize, u8)>,
    stopped: &mut bool,
    step: usize,
    p: &Passive<'_>,
) {
    let fake = model.miniport().transport();
    let pick_lun = |rng: &mut fastrand::Rng| lun(rng.u8(..2), rng.u8(..2));
    let outstanding = |rng: &mut fastrand::Rng| -> Option<(u32, Address)> {
        let open: Vec<&Io> = ios
            .iter()
            .filter(|io| {
                matches!(
                    model.outcome(io.id).map(|o| o.state),
                    Some(RequestState::InMiniport | RequestState::InSgBuild)
                )
            })
            .collect();
        (!open.is_empty()).then(|| {
            let io = open[rng.usize(..open.len())];
            (io.id, lun(0, io.lun))
        })
    };
    match rng.u32(..100) {
        // I/O: reads and writes of 1..8 blocks, scattered every which way,
        // answered every which way.
        0..=44 => {
            let at = pick_lun(rng);
            let blocks = rng.u32(1..9);
            let lba = rng.u32(..LBAS);
            let shape = match rng.u8(..3) {
                0 => SgShape::Contiguous,
                1 => SgShape::Pages,
                _ => SgShape::Odd { seed: rng.u64(..) },
            };
            let delivery = match rng.u32(..20) {
                0..=3 => Delivery::Synchronous,
                4..=12 => Delivery::Dpc,
                13..=18 => Delivery::Late,
                _ => Delivery::Never,
            };
            fake.script(Scripted::delivered(delivery));
            let read = rng.bool();
            let timeout = rng.u32(5..30);
            let spec = if read {
                RequestSpec::scsi_in(
                    at,
                    &scsi::read16(u64::from(lba), blocks),
                    blocks * BLOCK as u32,
                )
            } else {
                let id = model.created();
                let fill = 1 + (id % 255) as u8;
                for b in 0..blocks {
                    shadow
                        .candidates
                        .entry((at.lun, lba + b))
                        .or_default()
                        .insert(fill);
                }
                RequestSpec::scsi_out(
                    at,
                    &scsi::write16(u64::from(lba), blocks),
                    vec![fill; blocks as usize * BLOCK],
                )
            };
            let id = model
                .submit(&spec.shaped(shape).timeout(timeout), p)
                .expect("room for the request");
            ios.push(Io {
                id,
                lun: at.lun,
                lba,
                blocks,
                read,
            });
        }
        // Let the system run a little, in a random order.
        45..=69 => {
            for _ in 0..rng.usize(1..6) {
                if !model.platform().run_one(&mut |n| rng.usize(..n)) {
                    break;
                }
            }
        }
        70..=76 => {
            fake.release_late(rng.usize(1..4));
        }
        77..=82 => model.advance(Duration::from_millis(rng.u64(100..3000)), p),
        83..=86 => {
            if let Some((victim, at)) = outstanding(rng) {
                model.submit(&RequestSpec::abort(at, victim), p).unwrap();
            }
        }
        87..=88 => {
            let f = if rng.bool() {
                SrbFunction::ResetLogicalUnit
            } else {
                SrbFunction::ResetDevice
            };
            model
                .submit(&RequestSpec::function(f, pick_lun(rng)), p)
                .unwrap();
        }
        89 => model.reset_bus(p),
        90..=93 => {
            let target = rng.u8(..2);
            let state = match rng.u8(..6) {
                0..=2 => TargetState::Blocked,
                3..=4 => TargetState::FailFast,
                _ => TargetState::Lost,
            };
            fake.set_target_state(target, state);
            restore.push((step + rng.usize(1..6), target));
        }
        94..=97 => fake.set_credits(rng.u8(..2), rng.u32(0..4)),
        _ => {
            if *stopped {
                model.restart_adapter(p);
            } else {
                model.stop_adapter(p);
            }
            *stopped = !*stopped;
        }
    }
}

/// What the schedules exercised, summed.
#[derive(Default)]
struct Coverage(std::collections::BTreeMap<String, u64>);

impl Coverage {
    fn add(&mut self, what: &str, n: u64) {
        *self.0.entry(what.to_string()).or_default() += n;
    }

    fn get(&self, what: &str) -> u64 {
        self.0.get(what).copied().unwrap_or(0)
    }
}

#[test]
fn seeded_schedules_complete_every_request_exactly_once() {
    let mut seen = Coverage::default();
    if let Ok(seed) = std::env::var("STORPORT_SCHEDULE_SEED") {
        one_schedule(seed.parse().expect("a u64 seed"), &mut seen);
        return;
    }
    let count = env_count("STORPORT_SCHEDULES", 1000) as u64;
    for seed in 0..count {
        one_schedule(seed, &mut seen);
    }
    eprintln!("{count} schedules exercised: {:#?}", seen.0);
    // The generator must keep reaching every path it is there to shake.
    if count >= 200 {
        for what in [
            "TMF sent",
            "BUSY for lack of credit",
            "BUSY while not ready",
            "request timeouts",
            "bus resets",
            "BUSY requeues",
            "transport aborts",
            "transport LUN resets",
            "transport stops",
            "immediate writes",
            "SRB_STATUS_SUCCESS",
            "SRB_STATUS_ABORTED",
            "SRB_STATUS_ABORT_FAILED",
            "SRB_STATUS_BUS_RESET",
            "SRB_STATUS_SELECTION_TIMEOUT",
            "SRB_STATUS_NO_DEVICE",
        ] {
            assert!(seen.get(what) > 0, "no schedule exercised {what}");
        }
    }
}
