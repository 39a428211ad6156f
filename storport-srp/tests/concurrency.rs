//! Real concurrency: several threads call StartIo (through StorPort's
//! dispatch) while completions arrive on the DPC threads, and a chaos
//! thread resets the bus, aborts requests, starves credits and blocks
//! targets. Every request still completes exactly once, nothing allocates
//! or blocks at `DISPATCH_LEVEL`, and the data on the disk is data some
//! write put there.
//!
//! `STORPORT_STRESS_REQUESTS` sets the requests per submitter thread
//! (default 60).

mod support;

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use storport_srp::miniport::transport::TargetState;
use storport_srp::storport::SrbStatus;
use storport_srp::storport::host::{
    ModelConfig, RequestSpec, RequestState, SgDelivery, SgShape, StartIoLocking,
};

use support::fake::{Delivery, FakeConfig, Scripted};
use support::scsi::{self, BLOCK};
use support::{Model, adapter_config, env_count, lun, start, threaded};

const LBAS: u32 = 32;

fn open(model: &Model, id: u32) -> bool {
    matches!(
        model.outcome(id).map(|o| o.state),
        Some(RequestState::Queued | RequestState::InMiniport | RequestState::InSgBuild)
    )
}

#[test]
fn concurrent_io_with_resets_aborts_and_state_changes() {
    let per_thread = env_count("STORPORT_STRESS_REQUESTS", 60) as u32;
    for (round, locking) in [
        StartIoLocking::Virtual,
        StartIoLocking::ConcurrentChannels,
        StartIoLocking::FullDuplex,
    ]
    .into_iter()
    .enumerate()
    {
        let platform = threaded(2);
        let model = platform.run_passive(|p| {
            start(
                &platform,
                ModelConfig {
                    locking,
                    sg_delivery: SgDelivery::Alternate,
                    max_requests: 4096,
                    ..ModelConfig::default()
                },
                adapter_config(),
                FakeConfig {
                    out_of_order: true,
                    credits: 6,
                    blocks: u64::from(LBAS) + 8,
                    seed: round as u64 + 1,
                    ..FakeConfig::default()
                },
                p,
            )
        });
        let candidates: Mutex<HashMap<(u8, u32), HashSet<u8>>> = Mutex::new(HashMap::new());
        let submitting = AtomicBool::new(true);
        std::thread::scope(|scope| {
            let mut submitters = Vec::new();
            for t in 0..3u64 {
                let (model, platform, candidates) = (&model, &platform, &candidates);
                submitters.push(scope.spawn(move || {
                    let mut rng = fastrand::Rng::with_seed(t * 7 + round as u64);
                    platform.run_passive(|p| {
                        for _ in 0..per_thread {
                            let at = lun(rng.u8(..2), rng.u8(..2));
                            let blocks = rng.u32(1..5);
                            let lba = rng.u32(..LBAS);
                            let delivery = match rng.u8(..10) {
                                0..=1 => Delivery::Synchronous,
                                2..=7 => Delivery::Dpc,
                                8 => Delivery::Late,
                                _ => Delivery::Never,
                            };
                            model
                                .miniport()
                                .transport()
                                .script(Scripted::delivered(delivery));
                            let spec = if rng.bool() {
                                RequestSpec::scsi_in(
                                    at,
                                    &scsi::read16(u64::from(lba), blocks),
                                    blocks * BLOCK as u32,
                                )
                            } else {
                                let fill = rng.u8(1..);
                                let mut c = candidates.lock().unwrap();
                                for b in 0..blocks {
                                    c.entry((at.lun, lba + b)).or_default().insert(fill);
                                }
                                drop(c);
                                RequestSpec::scsi_out(
                                    at,
                                    &scsi::write16(u64::from(lba), blocks),
                                    vec![fill; blocks as usize * BLOCK],
                                )
                            };
                            let shape = if rng.bool() {
                                SgShape::Pages
                            } else {
                                SgShape::Odd { seed: rng.u64(..) }
                            };
                            model.submit(&spec.shaped(shape), p).unwrap();
                        }
                    });
                }));
            }
            let (model, platform, submitting) = (&model, &platform, &submitting);
            scope.spawn(move || {
                let mut rng = fastrand::Rng::with_seed(99 + round as u64);
                platform.run_passive(|p| {
                    let fake = model.miniport().transport();
                    while submitting.load(Ordering::Acquire) {
                        match rng.u8(..10) {
                            0 => model.reset_bus(p),
                            1..=2 => {
                                let n = model.created();
                                if n > 0 {
                                    let victim = rng.u32(..n);
                                    if open(model, victim) {
                                        let o = model.outcome(victim).unwrap();
                                        let _ = o;
                                        model
                                            .submit(&RequestSpec::abort(lun(0, 0), victim), p)
                                            .unwrap();
                                    }
                                }
                            }
                            3..=4 => {
                                fake.release_late(rng.usize(1..8));
                            }
                            5 => fake.set_credits(rng.u8(..2), rng.u32(0..6)),
                            6 => {
                                let t = rng.u8(..2);
                                fake.set_target_state(t, TargetState::Blocked);
                                std::thread::sleep(Duration::from_micros(300));
                                fake.set_target_state(t, TargetState::Live);
                            }
                            _ => std::thread::sleep(Duration::from_micros(200)),
                        }
                    }
                });
            });
            for s in submitters {
                s.join().unwrap();
            }
            submitting.store(false, Ordering::Release);
        });
        // Let everything finish: credits back, late answers released, and
        // a last reset for what the target would never answer.
        platform.run_passive(|p| {
            let fake = model.miniport().transport();
            for t in 0..2 {
                fake.set_target_state(t, TargetState::Live);
                fake.set_credits(t, 64);
            }
            for attempt in 0.. {
                fake.release_late(usize::MAX);
                model.settle();
                // Time moves: every request a reset covered must be done.
                model.advance(Duration::from_millis(100), p);
                if !(0..model.created()).any(|id| open(&model, id)) {
                    break;
                }
                assert!(attempt < 20, "{locking:?}: does not settle");
                model.reset_bus(p);
            }
        });
        let fake = model.miniport().transport();
        let mut statuses: HashMap<SrbStatus, u32> = HashMap::new();
        for id in 0..model.created() {
            let o = model.outcome(id).unwrap();
            assert_eq!(o.completions, 1, "{locking:?}: request {id}");
            *statuses.entry(o.status.base()).or_default() += 1;
        }
        eprintln!(
            "{locking:?}: {} requests, {statuses:?}, core {:?}, model {:?}",
            model.created(),
            model.miniport().core().stats(),
            model.stats()
        );
        assert!(statuses.get(&SrbStatus::SUCCESS).copied().unwrap_or(0) > 0);
        let c = candidates.lock().unwrap();
        for l in 0..2u8 {
            for block in 0..LBAS + 8 {
                let bytes = fake
                    .disk()
                    .peek(usize::from(l), block as usize * BLOCK, BLOCK);
                assert!(bytes.iter().all(|&b| b == bytes[0]), "torn block");
                assert!(
                    bytes[0] == 0 || c.get(&(l, block)).is_some_and(|s| s.contains(&bytes[0])),
                    "{locking:?}: block {l}/{block} holds data no write put there"
                );
            }
        }
        assert_eq!(fake.errors(), 0);
        model.finish();
    }
}
