//! The StorPort model checks, not trusts: a rogue miniport commits each
//! sin in turn and the model (or the kverbs verifier under it) must catch
//! it; an honest one passes; the StorPort behaviours the core relies on
//! (busy/ready, pauses, BUSY requeues, timeouts and resets, timers, DPCs,
//! queue depth) do what StorPort does.

mod support;

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use kverbs::irql::{Dispatch, Irql, LeDispatch, Passive};
use kverbs::platform::host::{HostPlatform, ViolationKind};
use storport_srp::storport::host::{
    HostPort, HostSrb, ModelConfig, ModelViolation, RequestSpec, RequestState, StartIoLocking,
    StorPortModel,
};
use storport_srp::storport::{
    AdapterLimits, BuildIo, Dirql, DpcId, FindAdapterError, HwMiniport, Srb, SrbStatus, StorPort,
    SupportedControls, TimerId,
};

use support::{SECOND, lun, manual, threaded};

/// What the rogue does wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sin {
    /// Nothing: completes every request (through its SG list when it has
    /// data) with success.
    None,
    /// Keeps every request until the test or a reset completes it.
    Hold,
    CompleteTwice,
    CompleteUnknown,
    CompletePending,
    KeepSgList,
    DropRequest,
    AlwaysBusy,
    /// BUSY once per request, then success; records whether BuildIo saw
    /// its extension marker survive the requeue.
    BusyOnce,
    AllocateInStartIo,
    /// Holds requests and ignores bus resets.
    IgnoreReset,
    /// At Stop (device IRQL): completes what it holds, inline.
    CompleteInStop,
    /// At Stop: waits for a teardown it queued (sleeps).
    BlockInStop,
    /// At Stop: calls a passive-only transport teardown inline.
    TearDownInStop,
    /// At Stop: allocates.
    AllocateInStop,
    /// At Stop: calls a StorPort service with a forged dispatch token.
    ServiceInStop,
}

struct Rogue {
    port: HostPort,
    sin: Sin,
    held: Mutex<VecDeque<HostSrb>>,
    build_io: AtomicU32,
    start_io: AtomicU32,
    marker_survived: AtomicU32,
    busied: std::sync::atomic::AtomicU64,
    dpcs: AtomicU32,
    timers: AtomicU32,
}

const MARKER: u64 = 0x1234_5678;

impl Rogue {
    fn complete_success(&self, mut srb: HostSrb, irql: &impl LeDispatch) {
        srb.set_srb_status(SrbStatus::SUCCESS);
        self.port.complete_request(srb, irql);
    }

    /// Completes up to `n` held requests with `status` (the test calls it
    /// at DISPATCH_LEVEL).
    fn release(&self, n: usize, status: SrbStatus, irql: &Dispatch<'_>) -> usize {
        let mut done = 0;
        while done < n {
            let Some(mut srb) = self.held.lock().unwrap().pop_front() else {
                break;
            };
            srb.set_srb_status(status);
            self.port.complete_request(srb, irql);
            done += 1;
        }
        done
    }

    /// A transport entry point that may only run at PASSIVE_LEVEL, as a
    /// real engine's teardown checks itself.
    fn transport_teardown(&self) {
        let _ = self
            .checker()
            .require_irql("Transport::stop", Irql::PASSIVE);
    }

    fn checker(&self) -> storport_srp::storport::host::Checker {
        CHECKER.with(|c| c.get()).expect("test sets the checker")
    }
}

thread_local! {
    static CHECKER: std::cell::Cell<Option<storport_srp::storport::host::Checker>> =
        const { std::cell::Cell::new(None) };
}

impl HwMiniport<HostPort> for Rogue {
    type Context = Sin;
    const SRB_EXTENSION_WORDS: usize = 2;
    const DPC_COUNT: u8 = 1;
    const TIMER_COUNT: u8 = 1;

    fn find_adapter(
        port: HostPort,
        sin: &Sin,
        _argument: Option<&[u8]>,
        _irql: &Passive<'_>,
    ) -> Result<(Self, AdapterLimits), FindAdapterError> {
        Ok((
            Rogue {
                port,
                sin: *sin,
                held: Mutex::new(VecDeque::with_capacity(256)),
                build_io: AtomicU32::new(0),
                start_io: AtomicU32::new(0),
                marker_survived: AtomicU32::new(0),
                busied: std::sync::atomic::AtomicU64::new(0),
                dpcs: AtomicU32::new(0),
                timers: AtomicU32::new(0),
            },
            AdapterLimits {
                buses: 1,
                targets_per_bus: 1,
                luns_per_target: 2,
                max_transfer_bytes: 1 << 20,
                physical_breaks: 64,
                max_io: 8,
                max_io_per_lun: 4,
            },
        ))
    }

    fn initialize(&self, _irql: &Dirql<'_>) -> bool {
        true
    }

    fn passive_initialize(&self, _irql: &Passive<'_>) -> bool {
        true
    }

    fn build_io<I: LeDispatch>(&self, srb: &mut HostSrb, _irql: &I) -> BuildIo {
        self.build_io.fetch_add(1, Ordering::Relaxed);
        if self.sin == Sin::BusyOnce {
            let ext = srb.extension();
            if ext[0].load(Ordering::Relaxed) == MARKER {
                self.marker_survived.fetch_add(1, Ordering::Relaxed);
            }
        }
        BuildIo::Proceed
    }

    fn start_io<I: LeDispatch>(&self, mut srb: HostSrb, irql: &I) {
        self.start_io.fetch_add(1, Ordering::Relaxed);
        match self.sin {
            Sin::Hold
            | Sin::IgnoreReset
            | Sin::CompleteInStop
            | Sin::BlockInStop
            | Sin::TearDownInStop
            | Sin::AllocateInStop
            | Sin::ServiceInStop => self.held.lock().unwrap().push_back(srb),
            Sin::CompleteTwice => {
                let twin = srb.duplicate_for_fault_injection();
                self.complete_success(srb, irql);
                self.port.complete_request(twin, irql);
            }
            Sin::CompleteUnknown => {
                if let Some(forged) = self.port.forged_srb(4000) {
                    self.port.complete_request(forged, irql);
                }
                self.complete_success(srb, irql);
            }
            Sin::CompletePending => self.port.complete_request(srb, irql),
            Sin::DropRequest => drop(srb),
            Sin::AlwaysBusy => {
                srb.set_srb_status(SrbStatus::BUSY);
                self.port.complete_request(srb, irql);
            }
            Sin::BusyOnce => {
                // The rogue remembers by request, not in the extension
                // (which StorPort does not keep across a requeue).
                let bit = 1u64 << (srb.request_index() % 64);
                let first = self.busied.fetch_or(bit, Ordering::Relaxed) & bit == 0;
                srb.extension()[0].store(MARKER, Ordering::Relaxed);
                if first {
                    srb.set_srb_status(SrbStatus::BUSY);
                    self.port.complete_request(srb, irql);
                } else {
                    self.complete_success(srb, irql);
                }
            }
            Sin::AllocateInStartIo => {
                let junk = std::hint::black_box(vec![0u8; 64]);
                drop(junk);
                self.complete_success(srb, irql);
            }
            Sin::None | Sin::KeepSgList => {
                if srb.data_transfer_length() == 0 {
                    self.complete_success(srb, irql);
                    return;
                }
                kverbs::sync::with_dispatch::<HostPlatform, _, _>(irql, |d| {
                    if let Err(refused) = self.port.get_scatter_gather_list(srb, d) {
                        let mut srb = refused.srb;
                        srb.set_srb_status(SrbStatus::BUSY);
                        self.port.complete_request(srb, d);
                    }
                });
            }
        }
    }

    fn execution_routine(&self, mut srb: HostSrb, irql: &Dispatch<'_>) {
        assert!(srb.scatter_gather().is_some_and(|sg| !sg.is_empty()));
        if self.sin != Sin::KeepSgList {
            self.port.put_scatter_gather_list(&mut srb, irql);
        }
        self.complete_success(srb, irql);
    }

    fn reset_bus(&self, _path: u8, irql: &Dispatch<'_>) -> bool {
        if self.sin != Sin::IgnoreReset {
            self.release(usize::MAX, SrbStatus::BUS_RESET, irql);
        }
        true
    }

    fn supported_controls(&self) -> SupportedControls {
        SupportedControls {
            stop: true,
            restart: true,
        }
    }

    fn stop_adapter(&self, _irql: &Dirql<'_>) -> bool {
        match self.sin {
            Sin::CompleteInStop => {
                // What WinOF did: finish everything right here.
                while let Some(mut srb) = self.held.lock().unwrap().pop_front() {
                    srb.set_srb_status(SrbStatus::NO_HBA);
                    // The rogue lies about its level, as C code can.
                    // SAFETY: not sound on purpose — the model runs this
                    // raised above DISPATCH_LEVEL; this is the careless
                    // token a port of C code would mint, for the model to
                    // catch.
                    let d = unsafe { Dispatch::assume::<HostPlatform>() };
                    self.port.complete_request(srb, &d);
                }
            }
            Sin::BlockInStop => std::thread::sleep(Duration::from_millis(80)),
            Sin::TearDownInStop => self.transport_teardown(),
            Sin::AllocateInStop => drop(std::hint::black_box(Box::new([0u8; 32]))),
            Sin::ServiceInStop => {
                // SAFETY: not sound on purpose, as above: a lie the model
                // must catch.
                let d = unsafe { Dispatch::assume::<HostPlatform>() };
                self.port.pause(5, &d);
            }
            _ => {}
        }
        true
    }

    fn restart_adapter(&self, _irql: &Dirql<'_>) -> bool {
        true
    }

    fn dpc(&self, _dpc: DpcId, irql: &Dispatch<'_>) {
        self.dpcs.fetch_add(1, Ordering::Relaxed);
        self.port
            .request_timer(TimerId(0), Duration::from_secs(2), irql);
    }

    fn timer(&self, _timer: TimerId, _irql: &Dispatch<'_>) {
        self.timers.fetch_add(1, Ordering::Relaxed);
    }

    fn free_adapter_resources(&self, _irql: &Passive<'_>) {}
}

type RogueModel = StorPortModel<Rogue>;

fn rogue(platform: &HostPlatform, sin: Sin, config: ModelConfig, p: &Passive<'_>) -> RogueModel {
    let mut model = RogueModel::new(platform, config, p);
    CHECKER.with(|c| c.set(Some(model.checker())));
    model.start(&sin, p).expect("rogue starts");
    model
}

fn read(len: u32) -> RequestSpec {
    RequestSpec::scsi_in(lun(0, 0), &[0x28, 0, 0, 0, 0, 0, 0, 0, 1, 0], len)
}

fn tur() -> RequestSpec {
    RequestSpec::scsi(lun(0, 0), &[0; 6])
}

/// Runs `sin` over one request (and `extra` on it), settles, and returns
/// the model's findings.
fn findings(sin: Sin, spec: &RequestSpec) -> Vec<ModelViolation> {
    let platform = manual();
    let violations = platform.run_passive(|p| {
        let model = rogue(&platform, sin, ModelConfig::default(), p);
        model.submit(spec, p).unwrap();
        model.settle();
        model.check_all_completed();
        model.take_violations()
    });
    let _ = platform.take_violations();
    platform.finish();
    violations
}

#[test]
fn an_honest_miniport_passes_under_every_locking() {
    for locking in [
        StartIoLocking::Virtual,
        StartIoLocking::FullDuplex,
        StartIoLocking::ConcurrentChannels,
    ] {
        let platform = manual();
        platform.run_passive(|p| {
            let model = rogue(
                &platform,
                Sin::None,
                ModelConfig {
                    locking,
                    ..ModelConfig::default()
                },
                p,
            );
            for i in 0..20 {
                let spec = if i % 2 == 0 {
                    read(512 * (i + 1))
                } else {
                    tur()
                };
                model.submit(&spec, p).unwrap();
            }
            model.settle();
            for id in 0..20 {
                let o = model.outcome(id).unwrap();
                assert_eq!(
                    (o.state, o.status, o.completions),
                    (RequestState::Completed, SrbStatus::SUCCESS, 1)
                );
            }
            assert_eq!(model.stats().sg_built, 10);
            model.finish();
        });
    }
}

#[test]
fn release_frees_a_completed_requests_buffer_and_only_then() {
    let platform = manual();
    platform.run_passive(|p| {
        // Room for one 256 KiB buffer at a time (and little else).
        let config = ModelConfig {
            memory_limit: 384 << 10,
            ..ModelConfig::default()
        };
        let model = rogue(&platform, Sin::None, config, p);
        let first = model.submit(&read(256 << 10), p).unwrap();
        model.settle();
        // Held: a second buffer does not fit.
        assert!(matches!(
            model.submit(&read(256 << 10), p),
            Err(storport_srp::storport::host::ModelError::Memory(_))
        ));
        model.release(first).unwrap();
        for _ in 0..8 {
            let id = model.submit(&read(256 << 10), p).unwrap();
            model.settle();
            let o = model.outcome(id).unwrap();
            assert_eq!(
                (o.state, o.status),
                (RequestState::Completed, SrbStatus::SUCCESS)
            );
            model.release(id).unwrap();
            // Released: the outcome stays, the data is gone.
            assert_eq!(model.outcome(id).unwrap().completions, 1);
            assert!(model.data(id).is_err());
        }
        model.finish();
    });
    let platform = manual();
    platform.run_passive(|p| {
        let model = rogue(&platform, Sin::Hold, ModelConfig::default(), p);
        let id = model.submit(&tur(), p).unwrap();
        model.settle();
        // With the miniport: not released.
        assert!(model.release(id).is_err());
        let _ = model.take_violations();
    });
    let _ = platform.take_violations();
}

#[test]
fn a_double_completion_is_caught() {
    let v = findings(Sin::CompleteTwice, &tur());
    assert_eq!(v, [ModelViolation::DoubleCompletion { request: 0 }]);
}

#[test]
fn completing_an_unknown_request_is_caught() {
    let v = findings(Sin::CompleteUnknown, &tur());
    assert_eq!(v, [ModelViolation::UnknownRequest { request: 4000 }]);
}

#[test]
fn completing_with_pending_status_is_caught() {
    let v = findings(Sin::CompletePending, &tur());
    assert_eq!(v, [ModelViolation::CompletedPending { request: 0 }]);
}

#[test]
fn completing_with_the_sg_list_held_is_caught() {
    let v = findings(Sin::KeepSgList, &read(4096));
    assert_eq!(v, [ModelViolation::SgListNotReleased { request: 0 }]);
}

#[test]
fn a_dropped_request_is_caught() {
    let v = findings(Sin::DropRequest, &tur());
    assert_eq!(v, [ModelViolation::DroppedWithoutCompletion { request: 0 }]);
}

#[test]
fn a_request_never_completed_is_caught() {
    let v = findings(Sin::Hold, &tur());
    assert_eq!(v, [ModelViolation::NeverCompleted { request: 0 }]);
}

#[test]
fn allocating_in_start_io_at_dispatch_is_caught_by_the_verifier() {
    let platform = manual();
    platform.run_passive(|p| {
        let model = rogue(
            &platform,
            Sin::AllocateInStartIo,
            ModelConfig {
                start_io_irql: storport_srp::storport::host::StartIoIrql::Dispatch,
                ..ModelConfig::default()
            },
            p,
        );
        model.submit(&tur(), p).unwrap();
        model.settle();
        assert!(model.take_violations().is_empty());
    });
    let kinds: Vec<_> = platform
        .take_violations()
        .into_iter()
        .map(|v| v.kind)
        .collect();
    assert!(
        kinds
            .iter()
            .any(|k| matches!(k, ViolationKind::AllocatedAtDispatch { size: 64 })),
        "{kinds:?}"
    );
    platform.finish();
}

#[test]
fn busy_forever_is_caught() {
    let platform = manual();
    platform.run_passive(|p| {
        let model = rogue(
            &platform,
            Sin::AlwaysBusy,
            ModelConfig {
                busy_forever_budget: Duration::from_secs(30),
                ..ModelConfig::default()
            },
            p,
        );
        model.submit(&tur(), p).unwrap();
        for _ in 0..40 {
            model.settle_with(&mut |_| 0);
            model.advance(SECOND, p);
        }
        let v = model.take_violations();
        assert!(
            matches!(
                v.as_slice(),
                [ModelViolation::BusyForever { waiting: 1, .. }]
            ),
            "{v:?}"
        );
        let o = model.outcome(0).unwrap();
        assert!(o.busy_requeues > 30, "requeued on every restart");
        assert_eq!(o.completions, 0);
    });
    let _ = platform.take_violations();
    platform.finish();
}

#[test]
fn a_reset_that_leaves_requests_outstanding_is_caught() {
    let platform = manual();
    platform.run_passive(|p| {
        let model = rogue(&platform, Sin::IgnoreReset, ModelConfig::default(), p);
        model.submit(&tur().timeout(3), p).unwrap();
        model.settle();
        model.advance(3 * SECOND, p);
        assert_eq!(model.stats().timeouts, 1);
        assert_eq!(model.stats().bus_resets, 1);
        model.settle();
        model.advance(SECOND, p);
        let v = model.take_violations();
        assert_eq!(v, [ModelViolation::ResetLeftOutstanding { request: 0 }]);
        // Complete it now so the run ends cleanly.
        platform.run_at_dispatch(|d| model.miniport().release(1, SrbStatus::BUS_RESET, d));
        model.finish();
    });
}

#[test]
fn timeouts_reset_the_bus_and_an_honest_reset_completes_everything() {
    let platform = manual();
    platform.run_passive(|p| {
        let model = rogue(&platform, Sin::Hold, ModelConfig::default(), p);
        for _ in 0..3 {
            model.submit(&tur().timeout(5), p).unwrap();
        }
        model.settle();
        model.advance(4 * SECOND, p);
        assert_eq!(model.stats().bus_resets, 0);
        model.advance(SECOND, p);
        assert_eq!((model.stats().timeouts, model.stats().bus_resets), (3, 1));
        model.settle();
        for id in 0..3 {
            let o = model.outcome(id).unwrap();
            assert_eq!((o.status, o.completions), (SrbStatus::BUS_RESET, 1));
        }
        model.advance(SECOND, p);
        model.finish();
    });
}

/// Each way of misbehaving in `ScsiStopAdapter` (device IRQL, interrupt
/// lock held) is caught: by the model or by the kverbs verifier.
#[test]
fn misbehaviour_at_device_irql_is_caught() {
    type Caught = dyn Fn(&[ModelViolation], &[ViolationKind]) -> bool;
    let cases: [(Sin, &Caught); 5] = [
        (Sin::CompleteInStop, &|m, _| {
            m.iter().any(|v| {
                matches!(
                    v,
                    ModelViolation::CompletionAtBadIrql {
                        device_irql: true,
                        ..
                    }
                )
            })
        }),
        (Sin::BlockInStop, &|m, _| {
            m.iter().any(|v| {
                matches!(
                    v,
                    ModelViolation::DeviceIrqlOverBudget {
                        routine: "ScsiStopAdapter",
                        ..
                    }
                )
            })
        }),
        (Sin::TearDownInStop, &|m, _| {
            m.iter().any(|v| {
                matches!(
                    v,
                    ModelViolation::WrongIrql {
                        what: "Transport::stop",
                        device_irql: true,
                        ..
                    }
                )
            })
        }),
        (Sin::AllocateInStop, &|_, k| {
            k.iter()
                .any(|k| matches!(k, ViolationKind::AllocatedAtDispatch { .. }))
        }),
        (Sin::ServiceInStop, &|m, _| {
            m.iter().any(|v| {
                matches!(
                    v,
                    ModelViolation::WrongIrql {
                        what: "StorPortPause",
                        device_irql: true,
                        ..
                    }
                )
            })
        }),
    ];
    for (sin, caught) in cases {
        let platform = threaded(1);
        let model_violations = platform.run_passive(|p| {
            let model = rogue(
                &platform,
                sin,
                ModelConfig {
                    device_irql_budget: Duration::from_millis(20),
                    ..ModelConfig::default()
                },
                p,
            );
            model.submit(&tur(), p).unwrap();
            model.settle();
            assert!(model.stop_adapter(p));
            let v = model.take_violations();
            // Whatever is still held is completed properly now.
            platform.run_at_dispatch(|d| model.miniport().release(8, SrbStatus::BUS_RESET, d));
            v
        });
        let kinds: Vec<_> = platform
            .take_violations()
            .into_iter()
            .map(|v| v.kind)
            .collect();
        assert!(
            caught(&model_violations, &kinds),
            "{sin:?}: model {model_violations:?}, verifier {kinds:?}"
        );
        platform.finish();
    }
}

/// A device-busy hold keeps that LUN's requests in StorPort's queue while
/// other LUNs proceed; a real completion releases it; BUSY requeues do not.
#[test]
fn device_busy_holds_until_a_completion() {
    let platform = manual();
    platform.run_passive(|p| {
        let model = rogue(&platform, Sin::Hold, ModelConfig::default(), p);
        let port = &model.miniport().port;
        let a = model.submit(&tur(), p).unwrap();
        let b = model.submit(&tur(), p).unwrap();
        model.settle();
        assert_eq!(model.in_flight(), (0, 2));
        platform.run_at_dispatch(|d| assert!(port.device_busy(lun(0, 0), 1, d)));
        let c = model.submit(&tur(), p).unwrap();
        let other = model
            .submit(&RequestSpec::scsi(lun(0, 1), &[0; 6]), p)
            .unwrap();
        model.settle();
        assert_eq!(model.outcome(c).unwrap().state, RequestState::Queued);
        assert_eq!(
            model.outcome(other).unwrap().state,
            RequestState::InMiniport
        );
        // A BUSY requeue of a held request is not a completion.
        platform.run_at_dispatch(|d| model.miniport().release(1, SrbStatus::BUSY, d));
        model.settle();
        assert_eq!(model.outcome(c).unwrap().state, RequestState::Queued);
        assert_eq!(model.outcome(a).unwrap().busy_requeues, 1);
        // A real completion releases the hold: `c` (and `a` again) go.
        platform.run_at_dispatch(|d| model.miniport().release(1, SrbStatus::SUCCESS, d));
        model.settle();
        assert_eq!(model.outcome(b).unwrap().state, RequestState::Completed);
        assert_eq!(model.outcome(c).unwrap().state, RequestState::InMiniport);
        platform.run_at_dispatch(|d| model.miniport().release(8, SrbStatus::SUCCESS, d));
        model.settle();
        model.finish();
    });
}

/// Pauses hold requests for their timeout or until resumed; adapter busy
/// and ready; queue depth limits.
#[test]
fn pauses_busy_ready_and_queue_depth() {
    let platform = manual();
    platform.run_passive(|p| {
        let model = rogue(&platform, Sin::Hold, ModelConfig::default(), p);
        let port = &model.miniport().port;
        // Per-LUN depth 4, adapter depth 8.
        for _ in 0..6 {
            model.submit(&tur(), p).unwrap();
        }
        model.settle();
        assert_eq!(model.in_flight(), (2, 4));
        for _ in 0..6 {
            model
                .submit(&RequestSpec::scsi(lun(0, 1), &[0; 6]), p)
                .unwrap();
        }
        model.settle();
        assert_eq!(model.in_flight(), (4, 8));
        platform.run_at_dispatch(|d| model.miniport().release(8, SrbStatus::SUCCESS, d));
        model.settle();
        assert_eq!(model.in_flight(), (0, 4));
        platform.run_at_dispatch(|d| model.miniport().release(8, SrbStatus::SUCCESS, d));
        model.settle();
        assert_eq!(model.in_flight(), (0, 0));
        // Adapter pause: 2 s.
        platform.run_at_dispatch(|d| assert!(port.pause(2, d)));
        let x = model.submit(&tur(), p).unwrap();
        model.settle();
        assert_eq!(model.outcome(x).unwrap().state, RequestState::Queued);
        model.advance(SECOND, p);
        model.settle();
        assert_eq!(model.outcome(x).unwrap().state, RequestState::Queued);
        model.advance(SECOND, p);
        model.settle();
        assert_eq!(model.outcome(x).unwrap().state, RequestState::InMiniport);
        // Device pause ended early by resume.
        platform.run_at_dispatch(|d| assert!(port.pause_device(lun(0, 1), 60, d)));
        let y = model
            .submit(&RequestSpec::scsi(lun(0, 1), &[0; 6]), p)
            .unwrap();
        model.settle();
        assert_eq!(model.outcome(y).unwrap().state, RequestState::Queued);
        platform.run_at_dispatch(|d| assert!(port.resume_device(lun(0, 1), d)));
        model.settle();
        assert_eq!(model.outcome(y).unwrap().state, RequestState::InMiniport);
        // Adapter busy with one outstanding request, then ready.
        platform.run_at_dispatch(|d| {
            model.miniport().release(1, SrbStatus::SUCCESS, d);
            assert!(port.busy(5, d));
        });
        let z = model.submit(&tur(), p).unwrap();
        model.settle();
        assert_eq!(model.outcome(z).unwrap().state, RequestState::Queued);
        platform.run_at_dispatch(|d| assert!(port.ready(d)));
        model.settle();
        assert_eq!(model.outcome(z).unwrap().state, RequestState::InMiniport);
        platform.run_at_dispatch(|d| model.miniport().release(8, SrbStatus::SUCCESS, d));
        let stats = model.stats();
        assert_eq!(
            (
                stats.pause_calls,
                stats.resume_calls,
                stats.adapter_busy_calls
            ),
            (2, 1, 1)
        );
        model.finish();
    });
}

/// `SRB_STATUS_BUSY` requeues the request: BuildIo and StartIo run again
/// and the extension's contents are gone.
#[test]
fn busy_requeues_rerun_build_io_with_the_extension_lost() {
    let platform = manual();
    platform.run_passive(|p| {
        let model = rogue(&platform, Sin::BusyOnce, ModelConfig::default(), p);
        let id = model.submit(&tur(), p).unwrap();
        model.settle();
        assert_eq!(model.outcome(id).unwrap().state, RequestState::Queued);
        // Retried on StorPort's next tick, not at once.
        model.advance(Duration::from_millis(250), p);
        model.settle();
        let o = model.outcome(id).unwrap();
        assert_eq!(
            (o.status, o.busy_requeues, o.completions),
            (SrbStatus::SUCCESS, 1, 1)
        );
        let m = model.miniport();
        assert_eq!(m.build_io.load(Ordering::Relaxed), 2);
        assert_eq!(m.start_io.load(Ordering::Relaxed), 2);
        assert_eq!(m.marker_survived.load(Ordering::Relaxed), 0);
        model.finish();
    });
}

/// DPCs run the miniport's routine at DISPATCH_LEVEL; timers fire when
/// StorPort's clock passes them, once.
#[test]
fn dpcs_and_timers() {
    let platform = manual();
    platform.run_passive(|p| {
        let model = rogue(&platform, Sin::None, ModelConfig::default(), p);
        assert_eq!(
            model.supported_controls(p),
            SupportedControls {
                stop: true,
                restart: true
            }
        );
        let port = &model.miniport().port;
        assert!(port.issue_dpc(DpcId(0)));
        assert!(!port.issue_dpc(DpcId(0)), "already queued");
        assert!(!port.issue_dpc(DpcId(1)), "no such DPC");
        model.settle();
        assert_eq!(model.miniport().dpcs.load(Ordering::Relaxed), 1);
        // The DPC armed the timer for 2 s.
        model.advance(SECOND, p);
        model.settle();
        assert_eq!(model.miniport().timers.load(Ordering::Relaxed), 0);
        model.advance(SECOND, p);
        model.settle();
        assert_eq!(model.miniport().timers.load(Ordering::Relaxed), 1);
        model.advance(10 * SECOND, p);
        model.settle();
        assert_eq!(
            model.miniport().timers.load(Ordering::Relaxed),
            1,
            "one-shot"
        );
        platform.run_at_dispatch(|d| {
            assert!(port.request_timer(TimerId(0), Duration::from_secs(1), d));
            assert!(port.cancel_timer(TimerId(0), d));
            assert!(!port.request_timer(TimerId(3), Duration::from_secs(1), d));
        });
        model.advance(5 * SECOND, p);
        model.settle();
        assert_eq!(
            model.miniport().timers.load(Ordering::Relaxed),
            1,
            "cancelled"
        );
        model.finish();
    });
}
