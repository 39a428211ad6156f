//! The iSER transport dropped without `stop()`.
//!
//! The miniport core always stops a transport before it drops it, so the
//! other tests never drop a live one. A library user may: dropping a
//! started `IserTransport` queues the stop on the engine's passive worker
//! (see `IserTransport` in `storport-srp/src/iser/engine.rs` and the
//! shared `TornDownOnDrop` in `storport-srp/src/drop_teardown.rs`), which
//! logs out, ends every connection, completes whatever was in flight, and
//! then lets the engine go. These tests build the transport directly
//! (outside the StorPort model) on the software HCA, with a live session
//! to the software iSER target and an event sink that counts upcalls with
//! atomics only (upcalls run at `DISPATCH_LEVEL`, where the verifier's
//! allocator fails any allocation), drop the live handle, and check what
//! a user would expect: no panic, no hang, the engine gone within a
//! bounded wait, no upcall reaching a freed object, the target's live and
//! open connections gone and the initiator's CM connections released
//! before the target is stopped, every command in flight at the drop
//! completed exactly once (failed by the transport, never GOOD), and the
//! initiator's CM and device closing and releasing as in
//! `IserStack::finish`.
//!
//! The handlers of the engine's connections hold it weakly (the handle is
//! its only strong owner), so nothing of a connection keeps a dropped
//! engine alive; what the drop must not do is free it with its
//! connections still up.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use hca_lowlevel::sim::{Fabric, HcaConfig, SoftHca};
use kverbs::cm::CmPort;
use kverbs::device::Device;
use kverbs::irql::Passive;
use kverbs::platform::host::{HostPlatform, VerifierAllocator};
use kverbs_tests::iser::{IserSetup, IserStackConfig};
use kverbs_tests::teardown::{CountingEvents, DropAt, drop_without_stop, post_tur, with_fabric};
use kverbs_tests::{INITIATOR_IP, close_initiator, open_initiator, target_ip};
use kverbs_tools::bench::rdma::wait_until;
use kverbs_tools::iser_target::IserTarget;
use storport_srp::iscsi::description::TargetDescription;
use storport_srp::iser::{EngineProbe, IserConfig, IserTransport};
use storport_srp::miniport::transport::{Transport, TransportEvents, Upcalls};

#[global_allocator]
static ALLOCATOR: VerifierAllocator = VerifierAllocator;

/// The initiator's device and CM and one software iSER target, as
/// `IserStack` builds them, without the StorPort model.
struct Ends {
    device: Device<HostPlatform>,
    cm: CmPort<HostPlatform>,
    target: Option<IserTarget>,
    /// The target's node record, parsed by the driver's own parser.
    desc: TargetDescription,
    _target_hca: Arc<SoftHca>,
    _initiator: Arc<SoftHca>,
}

fn build_ends(platform: &HostPlatform, fabric: &Fabric, p: &Passive<'_>) -> Ends {
    let initiator = fabric.add_hca(HcaConfig {
        mem_limit: 512 << 20,
        ..HcaConfig::new(INITIATOR_IP)
    });
    let (device, cm) =
        open_initiator(platform, &initiator, p).unwrap_or_else(|e| panic!("initiator: {e:?}"));
    let setup = IserSetup::standard();
    let target_hca = fabric.add_hca(HcaConfig::new(target_ip(0)));
    let target = IserTarget::start_on_hca(platform, target_hca.clone(), setup.config.clone(), p)
        .unwrap_or_else(|e| panic!("iSER target: {e}"));
    let record = setup.node_record(0, target.port());
    let desc =
        TargetDescription::parse(&record).unwrap_or_else(|e| panic!("node record {record:?}: {e}"));
    Ends {
        device,
        cm,
        target: Some(target),
        desc,
        _target_hca: target_hca,
        _initiator: initiator,
    }
}

impl Ends {
    fn target(&self) -> &IserTarget {
        self.target
            .as_ref()
            .unwrap_or_else(|| panic!("target stopped"))
    }

    /// Builds and starts a transport to the target; waits for its session
    /// to be live on both ends.
    fn start_transport(
        &self,
        events: &Arc<CountingEvents>,
        p: &Passive<'_>,
    ) -> IserTransport<HostPlatform> {
        let sink: Arc<dyn TransportEvents> = events.clone();
        let transport = IserTransport::new(
            &self.device,
            &self.cm,
            IserConfig::default(),
            std::slice::from_ref(&self.desc),
            Upcalls::new(sink),
            p,
        )
        .unwrap_or_else(|e| panic!("IserTransport::new: {e:?}"));
        transport
            .start(p)
            .unwrap_or_else(|e| panic!("start: {e:?}"));
        assert!(
            wait_until(Duration::from_secs(20), || {
                events.live.load(Ordering::Acquire) >= 1
            }),
            "target not live: {:?}",
            transport.target_stats(0, p)
        );
        let target = self.target();
        assert!(
            wait_until(Duration::from_secs(10), || target.live_connections() >= 1),
            "the target's connection not live: {}",
            target.live_connections()
        );
        transport
    }

    /// Drops the handle at `level` without `stop()` and checks the engine
    /// goes.
    fn drop_live(
        &self,
        transport: IserTransport<HostPlatform>,
        events: &CountingEvents,
        level: DropAt,
        p: &Passive<'_>,
    ) {
        let probe: EngineProbe = transport.engine_probe();
        assert!(transport.open_connections(p) > 0, "nothing live to drop");
        drop_without_stop(transport, &probe, events, level, p);
    }

    /// Waits (bounded) for the connection to be gone on both ends, before
    /// the target is stopped (which would end it from its side); `None`
    /// if it went, else what was left.
    fn connections_left(&self, p: &Passive<'_>) -> Option<String> {
        let target = self.target();
        let gone = wait_until(Duration::from_secs(30), || {
            target.live_connections() == 0
                && target.open_connections() == 0
                && self.cm.connections_in_use(p) == 0
        });
        (!gone).then(|| {
            format!(
                "target live connections {}, open {}, initiator CM connections in use {}, \
                 CM consumers {:?}",
                target.live_connections(),
                target.open_connections(),
                self.cm.connections_in_use(p),
                self.cm.pending_consumers(p)
            )
        })
    }

    /// As `IserStack::finish`: the target saw nothing malformed and stops
    /// cleanly, the CM has no consumer left and releases, the device
    /// closes.
    fn finish(mut self, p: &Passive<'_>) {
        if let Some(target) = self.target.take() {
            let c = target.counters();
            assert_eq!(
                (c.malformed, c.login_pdus_early),
                (0, 0),
                "malformed PDUs, login PDUs beyond the one buffer"
            );
            if let Err(e) = target.stop(p) {
                panic!("target stop: {e}");
            }
        }
        close_initiator(&self.cm, &self.device, p);
    }
}

#[test]
fn live_transport_dropped_without_stop_lets_go_of_everything() {
    let events = Arc::new(CountingEvents::new());
    let mut left = None;
    with_fabric(IserStackConfig::default().host, |platform, fabric, p| {
        let ends = build_ends(platform, fabric, p);
        let transport = ends.start_transport(&events, p);
        // A few commands through prepare/post, each completed once.
        for tag in 0..8 {
            post_tur(&transport, tag, p);
        }
        assert!(
            wait_until(Duration::from_secs(30), || {
                (0..8).all(|t| events.done_count(t) >= 1)
            }),
            "TEST UNIT READY not completed: {:?}",
            (0..8).map(|t| events.done_count(t)).collect::<Vec<_>>()
        );
        assert_eq!(events.good.load(Ordering::Acquire), 8, "all GOOD");
        ends.drop_live(transport, &events, DropAt::Passive, p);
        left = ends.connections_left(p);
        ends.finish(p);
    });
    assert_eq!(left, None, "30 s after dropping a live transport");
    // Every command completed exactly once, before or after the drop, and
    // nothing else was completed.
    for tag in 0..8 {
        assert_eq!(events.done_count(tag), 1, "tag {tag}");
    }
    assert_eq!(events.stray.load(Ordering::Acquire), 0);
    assert_eq!(events.tmf.load(Ordering::Acquire), 0);
    // The sink outlives the engine (the test holds it): whatever upcalls
    // came after the drop reached a live object. Only ours is left.
    assert_eq!(Arc::strong_count(&events), 1, "the engine's Upcalls freed");
}

/// Commands the target never answers are in flight at the drop; the
/// teardown completes each exactly once, failed, and the connection ends
/// on both sides before the target is stopped.
fn dropped_with_commands_in_flight(level: DropAt) {
    let events = Arc::new(CountingEvents::new());
    let in_flight = 6u32;
    let mut after_drop = 0;
    let mut left = None;
    with_fabric(IserStackConfig::default().host, |platform, fabric, p| {
        let ends = build_ends(platform, fabric, p);
        let transport = ends.start_transport(&events, p);
        post_tur(&transport, 0, p);
        assert!(wait_until(Duration::from_secs(30), || events.done_count(0) == 1));
        // The target holds every response from now on: the next commands
        // stay outstanding in the engine at the drop.
        let target = ends.target();
        target.with_logic(|l| l.misbehaviour.hold_responses = true);
        let before = target.counters().scsi_commands;
        for tag in 1..=in_flight {
            post_tur(&transport, tag, p);
        }
        assert!(
            wait_until(Duration::from_secs(10), || {
                target.counters().scsi_commands >= before + u64::from(in_flight)
            }),
            "the target did not receive the commands: {:?}",
            target.counters()
        );
        assert_eq!(
            (1..=in_flight as usize)
                .map(|t| events.done_count(t))
                .sum::<u32>(),
            0,
            "a command completed before the drop"
        );
        ends.drop_live(transport, &events, level, p);
        after_drop = events.after_drop.load(Ordering::Acquire);
        left = ends.connections_left(p);
        // Tear down anyway (the target's stop disconnects), so the test
        // fails on the checks below, not on a hang.
        ends.finish(p);
    });
    // The engine is gone (`drop_live`), and with it every upcall: the
    // counts are final. The connection ended on both sides, and the
    // teardown completed each command in flight exactly once, none of
    // them as GOOD (the target never answered). One comparison, so a
    // failure shows every part.
    let counts: Vec<u32> = (1..=in_flight as usize)
        .map(|t| events.done_count(t))
        .collect();
    assert_eq!(
        (
            left,
            events.done_count(0),
            counts,
            events.good.load(Ordering::Acquire),
            events.failed.load(Ordering::Acquire),
        ),
        (None, 1, vec![1; in_flight as usize], 1, in_flight),
        "30 s after dropping a live transport at {level:?}: (connections left, \
         completions of the command before the drop, per command in flight, \
         GOOD completions, failed by the transport)"
    );
    assert_eq!(events.stray.load(Ordering::Acquire), 0);
    eprintln!("in flight at the drop: {in_flight}; upcalls after the drop: {after_drop}");
    assert_eq!(Arc::strong_count(&events), 1, "the engine's Upcalls freed");
}

#[test]
fn transport_dropped_with_commands_in_flight() {
    dropped_with_commands_in_flight(DropAt::Passive);
}

#[test]
fn dropped_at_dispatch_level_with_commands_in_flight() {
    dropped_with_commands_in_flight(DropAt::Dispatch);
}

/// A handle dropped never started, or stopped, has nothing connected:
/// it frees the engine at once, as before (no teardown is queued).
#[test]
fn stopped_or_never_started_transport_drops_at_once() {
    let events = Arc::new(CountingEvents::new());
    with_fabric(IserStackConfig::default().host, |platform, fabric, p| {
        let ends = build_ends(platform, fabric, p);
        let sink: Arc<dyn TransportEvents> = events.clone();
        let idle = IserTransport::new(
            &ends.device,
            &ends.cm,
            IserConfig::default(),
            std::slice::from_ref(&ends.desc),
            Upcalls::new(sink),
            p,
        )
        .unwrap_or_else(|e| panic!("IserTransport::new: {e:?}"));
        let probe = idle.engine_probe();
        drop(idle);
        assert!(
            !probe.is_alive(),
            "a never-started engine outlived its handle"
        );
        let transport = ends.start_transport(&events, p);
        transport.stop(p);
        assert_eq!(transport.open_connections(p), 0, "connections after stop");
        let probe = transport.engine_probe();
        drop(transport);
        assert!(!probe.is_alive(), "a stopped engine outlived its handle");
        ends.finish(p);
    });
    assert_eq!(Arc::strong_count(&events), 1, "the engine's Upcalls freed");
}
