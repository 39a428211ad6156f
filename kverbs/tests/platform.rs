//! The host platform's primitives behave as their NT counterparts: DPCs run
//! at DISPATCH_LEVEL on their target processor, once per queueing; work
//! items at PASSIVE_LEVEL; timers fire once and can be cancelled; events
//! wake waiters; spin locks exclude.

// The host backend does not exist under `--cfg loom`; the loom models live
// in the library (`src/loom_tests.rs`).
#![cfg(not(loom))]

mod support;

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kverbs::irql::Irql;
use kverbs::platform::host::{ForeignDpcPlacement, HostConfig, HostEvent, HostMode, HostPlatform};
use kverbs::platform::{
    DpcTarget, EventKind, Platform, RawDpc, RawEvent, RawTimer, RawWorkItem, duration_to_ticks,
};
use kverbs::sync::SpinLock;

#[test]
fn a_dpc_runs_at_dispatch_on_its_target_processor() {
    let platform = support::threaded();
    platform.run_passive(|p| {
        let seen = Arc::new(Mutex::new(Vec::with_capacity(16)));
        let done = Arc::new(HostEvent::new(EventKind::Synchronization, false));
        let (s, dn) = (Arc::clone(&seen), Arc::clone(&done));
        let dpc = platform
            .new_dpc(
                Box::new(move |d| {
                    // The Vec has capacity: no allocation at DISPATCH_LEVEL.
                    s.lock().unwrap().push(HostPlatform::current_irql());
                    dn.set(d);
                }),
                DpcTarget::Processor(1),
                p,
            )
            .unwrap();
        for _ in 0..5 {
            assert!(dpc.queue());
            assert!(done.wait_timeout(Duration::from_secs(5), p));
        }
        assert_eq!(*seen.lock().unwrap(), vec![Irql::DISPATCH; 5]);
    });
    platform.finish();
}

/// A `DpcTarget::Current` DPC queued by a thread that is no DPC thread runs
/// once per successful queueing, at DISPATCH_LEVEL, under either placement
/// (the awake-thread one reads a racy sleeper hint: it may pick a thread
/// that is just falling asleep, and the DPC must still run).
#[test]
fn a_foreign_threads_current_dpc_runs_once_per_queueing_under_either_placement() {
    for placement in [
        ForeignDpcPlacement::RoundRobin,
        ForeignDpcPlacement::AwakeThread,
    ] {
        let platform = HostPlatform::with_config(HostConfig {
            processors: 2,
            mode: HostMode::Threaded,
            foreign_dpc_placement: placement,
            ..HostConfig::default()
        });
        let runs = Arc::new(AtomicUsize::new(0));
        let not_dispatch = Arc::new(AtomicUsize::new(0));
        let mut queued = 0;
        platform.run_passive(|p| {
            let done = Arc::new(HostEvent::new(EventKind::Synchronization, false));
            let (r, nd, dn) = (
                Arc::clone(&runs),
                Arc::clone(&not_dispatch),
                Arc::clone(&done),
            );
            let dpc = platform
                .new_dpc(
                    Box::new(move |d| {
                        if HostPlatform::current_irql() != Irql::DISPATCH {
                            nd.fetch_add(1, Ordering::Relaxed);
                        }
                        r.fetch_add(1, Ordering::Relaxed);
                        dn.set(d);
                    }),
                    DpcTarget::Current,
                    p,
                )
                .unwrap();
            // Waited for one at a time (each lands wherever the placement
            // says), then back to back (most find the DPC still queued).
            for _ in 0..100 {
                assert!(dpc.queue());
                queued += 1;
                assert!(done.wait_timeout(Duration::from_secs(5), p));
            }
            for _ in 0..1000 {
                if dpc.queue() {
                    queued += 1;
                }
            }
        });
        platform.finish();
        assert_eq!(runs.load(Ordering::Relaxed), queued, "{placement:?}");
        assert_eq!(not_dispatch.load(Ordering::Relaxed), 0, "{placement:?}");
    }
}

#[test]
fn a_dpc_is_queued_at_most_once_and_can_be_cancelled() {
    let platform = support::manual();
    platform.run_passive(|p| {
        let runs = Arc::new(AtomicU32::new(0));
        let r = Arc::clone(&runs);
        let dpc = platform
            .new_dpc(
                Box::new(move |_d| {
                    r.fetch_add(1, Ordering::Relaxed);
                }),
                DpcTarget::Current,
                p,
            )
            .unwrap();
        assert!(dpc.queue());
        assert!(!dpc.queue(), "already queued");
        assert!(dpc.cancel());
        assert!(!dpc.cancel());
        assert_eq!(platform.run_until_idle(&mut |_| 0, 10), 0);
        assert!(dpc.queue());
        assert_eq!(platform.run_until_idle(&mut |_| 0, 10), 1);
        assert_eq!(runs.load(Ordering::Relaxed), 1);
    });
    platform.finish();
}

/// A DPC queued while its processor's thread is going back to sleep still
/// runs: the queue wakes its thread only when it sleeps, so a push racing
/// the "queue empty, going to sleep" step must not be lost. Each round
/// queues the DPC again the moment the previous run signals, which is
/// exactly when the DPC thread finds its queue empty.
#[test]
fn a_dpc_queued_as_its_thread_goes_to_sleep_is_not_lost() {
    let rounds = support::env_count("KVERBS_DPC_HANDOFF_ROUNDS", 20_000);
    let platform = support::threaded();
    platform.run_passive(|p| {
        let runs = Arc::new(AtomicUsize::new(0));
        let done = Arc::new(HostEvent::new(EventKind::Synchronization, false));
        let (r, dn) = (Arc::clone(&runs), Arc::clone(&done));
        let dpc = platform
            .new_dpc(
                Box::new(move |d| {
                    r.fetch_add(1, Ordering::Relaxed);
                    dn.set(d);
                }),
                DpcTarget::Processor(0),
                p,
            )
            .unwrap();
        for round in 0..rounds {
            assert!(dpc.queue(), "round {round}: the DPC was still queued");
            assert!(
                done.wait_timeout(Duration::from_secs(10), p),
                "round {round}: the queued DPC never ran (lost wake-up)"
            );
        }
        assert_eq!(runs.load(Ordering::Relaxed), rounds);
    });
    platform.finish();
}

/// Two work items queued back to back run at the same time on the two
/// worker threads: the second push wakes the second sleeping worker even
/// though the first push already woke one. The first item waits for the
/// second, so it would hang if only one worker were woken.
#[test]
fn back_to_back_work_items_wake_both_workers() {
    let platform = support::threaded();
    platform.run_passive(|p| {
        for round in 0..200 {
            let second_ran = Arc::new(HostEvent::new(EventKind::Notification, false));
            let both = Arc::new(HostEvent::new(EventKind::Notification, false));
            let (s1, b1) = (Arc::clone(&second_ran), Arc::clone(&both));
            let first = platform
                .new_work_item(
                    Box::new(move |p| {
                        if s1.wait_timeout(Duration::from_secs(10), p) {
                            b1.set(p);
                        }
                    }),
                    p,
                )
                .unwrap();
            let s2 = Arc::clone(&second_ran);
            let second = platform
                .new_work_item(Box::new(move |p| s2.set(p)), p)
                .unwrap();
            // Let both workers go to sleep first.
            assert!(platform.quiesce(Duration::from_secs(10)));
            platform.run_at_dispatch(|d| {
                assert!(first.queue(d));
                assert!(second.queue(d));
            });
            assert!(
                both.wait_timeout(Duration::from_secs(20), p),
                "round {round}: the second work item did not run beside the first"
            );
            assert!(platform.quiesce(Duration::from_secs(10)));
        }
    });
    platform.finish();
}

#[test]
fn work_items_run_at_passive_on_worker_threads() {
    let platform = support::threaded();
    platform.run_passive(|p| {
        let done = Arc::new(HostEvent::new(EventKind::Notification, false));
        let level = Arc::new(Mutex::new(None));
        let (dn, lv) = (Arc::clone(&done), Arc::clone(&level));
        let item = platform
            .new_work_item(
                Box::new(move |p| {
                    *lv.lock().unwrap() = Some(HostPlatform::current_irql());
                    dn.set(p);
                }),
                p,
            )
            .unwrap();
        // Queued from DISPATCH_LEVEL, as the passive worker does.
        platform.run_at_dispatch(|d| assert!(item.queue(d)));
        assert!(done.wait_timeout(Duration::from_secs(5), p));
        assert_eq!(*level.lock().unwrap(), Some(Irql::PASSIVE));
    });
    platform.finish();
}

#[test]
fn a_timer_fires_its_dpc_once_and_cancel_disarms_it() {
    let platform = support::threaded();
    platform.run_passive(|p| {
        let fired = Arc::new(AtomicUsize::new(0));
        let f = Arc::clone(&fired);
        let timer = platform
            .new_timer(
                Box::new(move |_d| {
                    assert_eq!(HostPlatform::current_irql(), Irql::DISPATCH);
                    f.fetch_add(1, Ordering::Relaxed);
                }),
                p,
            )
            .unwrap();
        let start = HostPlatform::now();
        assert!(!timer.set(Duration::from_millis(10), p));
        while fired.load(Ordering::Relaxed) == 0 {
            assert!(
                HostPlatform::now().since(start) < 5_000_000_000,
                "timer never fired"
            );
            platform.delay(Duration::from_millis(1), p);
        }
        let elapsed = HostPlatform::now().since(start);
        assert!(
            elapsed
                >= duration_to_ticks(Duration::from_millis(10), HostPlatform::ticks_per_second())
        );
        platform.delay(Duration::from_millis(30), p);
        assert_eq!(fired.load(Ordering::Relaxed), 1, "one-shot");
        // Armed then cancelled: never fires (long due times, so a loaded host
        // cannot let them expire before the cancel).
        assert!(!timer.set(Duration::from_secs(10), p));
        assert!(
            timer.set(Duration::from_secs(10), p),
            "re-set reports it was armed"
        );
        assert!(timer.cancel(p));
        assert!(!timer.cancel(p));
        platform.delay(Duration::from_millis(50), p);
        assert_eq!(fired.load(Ordering::Relaxed), 1);
    });
    platform.finish();
}

#[test]
fn spin_locks_exclude_across_dpc_threads() {
    let platform = support::threaded();
    platform.run_passive(|p| {
        let counter: Arc<SpinLock<u64, HostPlatform>> = Arc::new(SpinLock::new(0));
        let remaining = Arc::new(AtomicUsize::new(4));
        let done = Arc::new(HostEvent::new(EventKind::Notification, false));
        let dpcs: Vec<_> = (0..4u32)
            .map(|i| {
                let (c, r, dn) = (
                    Arc::clone(&counter),
                    Arc::clone(&remaining),
                    Arc::clone(&done),
                );
                platform
                    .new_dpc(
                        Box::new(move |d| {
                            for _ in 0..20_000 {
                                if i % 2 == 0 {
                                    *c.lock_at_dpc_level(d) += 1;
                                } else {
                                    c.with_queued_at_dpc_level(d, |v, _| *v += 1);
                                }
                            }
                            if r.fetch_sub(1, Ordering::AcqRel) == 1 {
                                dn.set(d);
                            }
                        }),
                        DpcTarget::Processor(i),
                        p,
                    )
                    .unwrap()
            })
            .collect();
        for d in &dpcs {
            d.queue();
        }
        assert!(done.wait_timeout(Duration::from_secs(30), p));
        assert_eq!(*counter.lock(p), 80_000);
    });
    platform.finish();
}

#[test]
fn passive_and_dispatch_scopes_report_their_level_and_role() {
    let platform = support::threaded();
    platform.run_passive(|p| {
        assert_eq!(HostPlatform::current_irql(), Irql::PASSIVE);
        platform.run_at_dispatch(|_d| assert_eq!(HostPlatform::current_irql(), Irql::DISPATCH));
        assert_eq!(HostPlatform::current_irql(), Irql::PASSIVE);
        let v = platform.take_violations();
        assert!(v.is_empty());
        let role = platform.run_as_dpc(p, |_d| {
            // Provoke nothing; just prove DPCs run on DPC threads.
            HostPlatform::current_irql()
        });
        assert_eq!(role, Irql::DISPATCH);
    });
    platform.finish();
}
