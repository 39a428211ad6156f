//! The SRP transport dropped without `stop()`.
//!
//! The miniport core always stops a transport before it drops it, so the
//! other tests never drop a live one. A library user may: dropping a
//! started `SrpTransport` queues the stop on the engine's passive worker
//! (see `SrpTransport` and `ConnRegistry` in
//! `storport-srp/src/srp/engine.rs`, and the shared `TornDownOnDrop` in
//! `storport-srp/src/drop_teardown.rs`), which disconnects every channel,
//! completes whatever was in flight, and then lets the engine go. These
//! tests build the transport directly (outside the StorPort model) on the
//! software HCA, with live channels to the software target and an event
//! sink that counts upcalls with atomics only (upcalls run at
//! `DISPATCH_LEVEL`, where the verifier's allocator fails any
//! allocation), drop the live handle, and check what a user would expect:
//! no panic, no hang, the engine gone within a bounded wait, no upcall
//! reaching a freed object, the target's channels gone and the
//! initiator's CM connections released before the target is stopped,
//! every command in flight at the drop completed exactly once (failed by
//! the transport, never GOOD), and the initiator's CM and device closing
//! and releasing as in `Stack::finish`.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use hca_lowlevel::sim::{Fabric, HcaConfig, SoftHca};
use kverbs::cm::CmPort;
use kverbs::device::Device;
use kverbs::irql::Passive;
use kverbs::platform::host::{HostPlatform, VerifierAllocator};
use kverbs_tests::srp_target::{Misbehaviour, Selector};
use kverbs_tests::teardown::{CountingEvents, DropAt, drop_without_stop, post_tur, with_fabric};
use kverbs_tests::{
    INITIATOR_IP, SrpTarget, StackConfig, TargetSetup, assert_initiator_kept_protocol,
    close_initiator, open_initiator, target_ip,
};
use kverbs_tools::bench::rdma::wait_until;
use storport_srp::miniport::transport::{Transport, TransportEvents, Upcalls};
use storport_srp::srp::params::parse_add_target;
use storport_srp::srp::{EngineProbe, SrpTransport};

#[global_allocator]
static ALLOCATOR: VerifierAllocator = VerifierAllocator;

/// The initiator's device and CM and one software target, as
/// `Stack::new` builds them, without the StorPort model.
struct Ends {
    device: Device<HostPlatform>,
    cm: CmPort<HostPlatform>,
    target: Option<SrpTarget>,
    _target_hca: Arc<SoftHca>,
    _initiator: Arc<SoftHca>,
}

fn build_ends(platform: &HostPlatform, fabric: &Fabric, p: &Passive<'_>) -> Ends {
    let initiator = fabric.add_hca(HcaConfig {
        mem_limit: 64 << 20,
        ..HcaConfig::new(INITIATOR_IP)
    });
    let (device, cm) =
        open_initiator(platform, &initiator, p).unwrap_or_else(|e| panic!("initiator: {e:?}"));
    let target_hca = fabric.add_hca(HcaConfig::new(target_ip(0)));
    let target = SrpTarget::start_on_hca(
        platform,
        target_hca.clone(),
        TargetSetup::standard().config,
        p,
    )
    .unwrap_or_else(|e| panic!("SRP target: {e:?}"));
    Ends {
        device,
        cm,
        target: Some(target),
        _target_hca: target_hca,
        _initiator: initiator,
    }
}

impl Ends {
    fn target(&self) -> &SrpTarget {
        self.target
            .as_ref()
            .unwrap_or_else(|| panic!("target stopped"))
    }

    /// Builds and starts a transport to the target with `channels`
    /// channels; waits for every channel to be live on both ends.
    fn start_transport(
        &self,
        events: &Arc<CountingEvents>,
        channels: u8,
        p: &Passive<'_>,
    ) -> SrpTransport<HostPlatform> {
        let target = self.target();
        let guid = target.service_guid();
        let [a, b, c, d] = target_ip(0);
        let port = target.rdma_cm_port().unwrap_or(5555);
        let add_target = format!(
            "id_ext={guid:016x},ioc_guid={guid:016x},dest={a}.{b}.{c}.{d}:{port},ch_count={channels}"
        );
        let params = parse_add_target(add_target.as_bytes())
            .unwrap_or_else(|e| panic!("add_target {add_target:?}: {e:?}"));
        let sink: Arc<dyn TransportEvents> = events.clone();
        let transport = SrpTransport::new(
            &self.device,
            &self.cm,
            StackConfig::default().srp,
            &[params],
            Upcalls::new(sink),
            p,
        )
        .unwrap_or_else(|e| panic!("SrpTransport::new: {e:?}"));
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
        let live = transport
            .target_stats(0, p)
            .map_or(0, |s| usize::from(s.live_channels));
        assert_eq!(live, usize::from(channels), "initiator channels live");
        assert!(
            wait_until(Duration::from_secs(10), || target.live_channels() >= live),
            "target channels not live: {}",
            target.live_channels()
        );
        transport
    }

    /// Drops the handle without `stop()` and checks the engine goes.
    fn drop_live(
        &self,
        transport: SrpTransport<HostPlatform>,
        events: &CountingEvents,
        p: &Passive<'_>,
    ) {
        self.drop_live_at(transport, events, DropAt::Passive, p);
    }

    /// As `drop_live`, with the handle dropped at `level`.
    fn drop_live_at(
        &self,
        transport: SrpTransport<HostPlatform>,
        events: &CountingEvents,
        level: DropAt,
        p: &Passive<'_>,
    ) {
        let probe: EngineProbe = transport.engine_probe();
        assert!(transport.open_connections(p) > 0, "nothing live to drop");
        drop_without_stop(transport, &probe, events, level, p);
    }

    /// As `Stack::finish`: the target stops cleanly and saw no protocol
    /// violation, the CM has no consumer left and releases, the device
    /// closes.
    fn finish(mut self, p: &Passive<'_>) {
        if let Some(target) = self.target.take() {
            assert_initiator_kept_protocol(&target, 0);
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
    with_fabric(StackConfig::default().host, |platform, fabric, p| {
        let ends = build_ends(platform, fabric, p);
        let transport = ends.start_transport(&events, 2, p);
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
        ends.drop_live(transport, &events, p);
        ends.finish(p);
    });
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

#[test]
fn transport_dropped_with_commands_in_flight() {
    let events = Arc::new(CountingEvents::new());
    let in_flight = 6u32;
    let mut after_drop = 0;
    with_fabric(StackConfig::default().host, |platform, fabric, p| {
        let ends = build_ends(platform, fabric, p);
        let transport = ends.start_transport(&events, 1, p);
        post_tur(&transport, 0, p);
        assert!(wait_until(Duration::from_secs(30), || events.done_count(0) == 1));
        // The target swallows every response from now on: the next
        // commands stay outstanding in the engine at the drop.
        let target = ends.target();
        target.set_misbehaviour(
            Misbehaviour::DropResponses {
                which: Selector::All,
            },
            p,
        );
        for tag in 1..=in_flight {
            post_tur(&transport, tag, p);
        }
        assert!(
            wait_until(Duration::from_secs(10), || {
                target.counters().responses_dropped >= u64::from(in_flight)
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
        ends.drop_live(transport, &events, p);
        after_drop = events.after_drop.load(Ordering::Acquire);
        ends.finish(p);
    });
    // The engine is gone (`drop_live`), and with it every upcall: the
    // counts are final. The teardown completed each command in flight
    // exactly once, and none of them as GOOD (the target never answered).
    assert_eq!(events.done_count(0), 1);
    let counts: Vec<u32> = (1..=in_flight as usize)
        .map(|t| events.done_count(t))
        .collect();
    assert!(
        counts.iter().all(|&n| n == 1),
        "completions per command in flight at the drop: {counts:?}"
    );
    assert_eq!(
        events.good.load(Ordering::Acquire),
        1,
        "only the command before the drop completed GOOD"
    );
    assert_eq!(
        events.failed.load(Ordering::Acquire),
        in_flight,
        "each command in flight failed by the transport"
    );
    assert_eq!(events.stray.load(Ordering::Acquire), 0);
    eprintln!("in flight at the drop: {in_flight}; upcalls after the drop: {after_drop}");
    assert_eq!(Arc::strong_count(&events), 1, "the engine's Upcalls freed");
}

/// A dropped handle disconnects its channels: the initiator's CM lets go
/// of every connection and the target sees its channels go, both before
/// the target is stopped (which would end them from its side).
fn dropped_transport_disconnects_its_channels(level: DropAt) {
    let events = Arc::new(CountingEvents::new());
    let mut report = None;
    with_fabric(StackConfig::default().host, |platform, fabric, p| {
        let ends = build_ends(platform, fabric, p);
        let transport = ends.start_transport(&events, 2, p);
        ends.drop_live_at(transport, &events, level, p);
        let target = ends.target();
        let gone = wait_until(Duration::from_secs(30), || {
            target.live_channels() == 0 && ends.cm.connections_in_use(p) == 0
        });
        if !gone {
            report = Some(format!(
                "target live channels {}, initiator CM connections in use {}, CM consumers {:?}",
                target.live_channels(),
                ends.cm.connections_in_use(p),
                ends.cm.pending_consumers(p)
            ));
        }
        // Tear down anyway (the target's stop disconnects), so the test
        // fails on the check above, not on a hang.
        ends.finish(p);
    });
    assert_eq!(
        report, None,
        "30 s after dropping a live transport at {level:?}"
    );
    assert_eq!(Arc::strong_count(&events), 1, "the engine's Upcalls freed");
}

#[test]
fn dropped_live_transport_disconnects_its_channels() {
    dropped_transport_disconnects_its_channels(DropAt::Passive);
}

#[test]
fn dropped_at_dispatch_level_disconnects_its_channels() {
    dropped_transport_disconnects_its_channels(DropAt::Dispatch);
}
