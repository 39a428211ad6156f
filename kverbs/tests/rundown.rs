//! Object lifetime: the destroy callback runs once, after every reference is
//! released, never inline; no callback runs after it.

// The host backend does not exist under `--cfg loom`; the loom models live
// in the library (`src/loom_tests.rs`).
#![cfg(not(loom))]

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::time::Duration;

use kverbs::irql::Dispatch;
use kverbs::platform::host::HostPlatform;
use kverbs::platform::{DpcTarget, Platform, RawDpc};
use kverbs::rundown::{AlreadyRunningDown, Rundown};

#[test]
fn destroy_completes_in_a_dpc_after_the_last_reference() {
    let platform = support::manual();
    platform.run_passive(|p| {
        let fired = Arc::new(AtomicU32::new(0));
        let f = Arc::clone(&fired);
        let rundown = Rundown::new(
            &platform,
            move |_d| {
                f.fetch_add(1, Ordering::AcqRel);
            },
            p,
        )
        .unwrap();
        let scoped = rundown.acquire().unwrap();
        let owned = rundown.acquire_owned().unwrap();
        assert_eq!(rundown.references(), 2);
        rundown.destroy().unwrap();
        assert_eq!(rundown.destroy(), Err(AlreadyRunningDown));
        assert!(rundown.acquire().is_none(), "no entry after destroy");
        assert!(rundown.acquire_owned().is_none());
        drop(scoped);
        platform.run_until_idle(&mut |_| 0, 10);
        assert_eq!(fired.load(Ordering::Acquire), 0, "a reference is still out");
        drop(owned);
        // Never inline: the release only queued the DPC.
        assert_eq!(fired.load(Ordering::Acquire), 0);
        assert_eq!(platform.pending(), 1);
        platform.run_until_idle(&mut |_| 0, 10);
        assert_eq!(fired.load(Ordering::Acquire), 1);
    });
    platform.finish();
}

#[test]
fn destroy_with_no_references_still_reports_through_the_dpc() {
    let platform = support::manual();
    platform.run_passive(|p| {
        let fired = Arc::new(AtomicU32::new(0));
        let f = Arc::clone(&fired);
        let rundown = Rundown::new(
            &platform,
            move |_d| {
                f.fetch_add(1, Ordering::AcqRel);
            },
            p,
        )
        .unwrap();
        rundown.destroy().unwrap();
        assert_eq!(fired.load(Ordering::Acquire), 0);
        drop(rundown); // The object may go away before its destroy DPC runs.
        platform.run_until_idle(&mut |_| 0, 10);
        assert_eq!(fired.load(Ordering::Acquire), 1);
    });
    platform.finish();
}

/// An object whose "callbacks" are DPCs fired repeatedly from several
/// threads; each callback enters through the run-down and checks it never
/// runs after the destroy callback.
struct Object {
    rundown: Arc<Rundown<HostPlatform>>,
    destroyed: Arc<AtomicBool>,
    late_callbacks: AtomicUsize,
    callbacks: AtomicUsize,
}

impl Object {
    fn callback(&self, platform: &HostPlatform, _irql: &Dispatch<'_>) {
        let Some(_entry) = self.rundown.acquire() else {
            return;
        };
        if self.destroyed.load(Ordering::Acquire) {
            self.late_callbacks.fetch_add(1, Ordering::Relaxed);
        }
        self.callbacks.fetch_add(1, Ordering::Relaxed);
        // Stay inside a little, so destroy races a callback in progress.
        platform.stall(Duration::from_micros(20));
        if self.destroyed.load(Ordering::Acquire) {
            self.late_callbacks.fetch_add(1, Ordering::Relaxed);
        }
    }
}

#[test]
fn no_callback_runs_after_the_destroy_callback_under_racing_dpcs() {
    let rounds = support::env_count("KVERBS_RUNDOWN_ROUNDS", 30);
    for round in 0..rounds {
        let platform = HostPlatform::with_config(kverbs::platform::host::HostConfig {
            processors: 3,
            ..Default::default()
        });
        platform.run_passive(|p| {
            let destroyed = Arc::new(AtomicBool::new(false));
            let d2 = Arc::clone(&destroyed);
            let rundown = Rundown::new(
                &platform,
                move |_d| {
                    d2.store(true, Ordering::Release);
                },
                p,
            )
            .unwrap();
            let object = Arc::new(Object {
                rundown,
                destroyed,
                late_callbacks: AtomicUsize::new(0),
                callbacks: AtomicUsize::new(0),
            });
            let dpcs: Vec<_> = (0..3u32)
                .map(|cpu| {
                    let weak = Arc::downgrade(&object);
                    let pl = platform.clone();
                    platform
                        .new_dpc(
                            Box::new(move |d| {
                                if let Some(o) = weak.upgrade() {
                                    o.callback(&pl, d);
                                }
                            }),
                            DpcTarget::Processor(cpu),
                            p,
                        )
                        .unwrap()
                })
                .collect();
            let dpcs = Arc::new(dpcs);
            let stop = Arc::new(AtomicBool::new(false));
            let firing: Vec<_> = (0..2)
                .map(|_| {
                    let (dpcs, stop) = (Arc::clone(&dpcs), Arc::clone(&stop));
                    std::thread::spawn(move || {
                        while !stop.load(Ordering::Relaxed) {
                            for d in dpcs.iter() {
                                d.queue();
                            }
                            std::thread::yield_now();
                        }
                    })
                })
                .collect();
            // Destroy only once callbacks are really running, then at a
            // varying point in their stream.
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while object.callbacks.load(Ordering::Relaxed) < 8 {
                assert!(std::time::Instant::now() < deadline, "DPCs never ran");
                std::thread::yield_now();
            }
            std::thread::sleep(Duration::from_micros((round as u64 * 97) % 1500));
            object.rundown.destroy().unwrap();
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while !object.destroyed.load(Ordering::Acquire) {
                assert!(
                    std::time::Instant::now() < deadline,
                    "destroy never completed"
                );
                std::thread::sleep(Duration::from_micros(100));
            }
            // Keep firing a while after the destroy callback.
            std::thread::sleep(Duration::from_millis(2));
            stop.store(true, Ordering::Relaxed);
            for t in firing {
                t.join().unwrap();
            }
            assert_eq!(
                object.late_callbacks.load(Ordering::Relaxed),
                0,
                "round {round}"
            );
        });
        platform.finish();
    }
}
