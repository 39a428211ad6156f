//! A seeded property: many connections between two engines over a wire
//! that loses, duplicates, delays and reorders MADs, with consumers that
//! accept, reject, ignore and disconnect at random moments and QP
//! modifications that sometimes fail. Whatever happens:
//!
//! * every connection's callback sees at most one `Established`, then
//!   exactly one terminal event, and nothing after it;
//! * no terminal event comes while the CM has a QP modification pending;
//! * every request a listener saw is accepted, rejected or withdrawn;
//! * once everyone has disconnected and the timers have run out, both
//!   tables are empty (no leaked connection).
//!
//! `KVERBS_CM_SEEDS` sets the number of seeds (default 300, about a second).

use super::*;

/// MADs held back for later delivery (delays, duplicates): (sender, bytes).
type Held = std::rc::Rc<core::cell::RefCell<Vec<(usize, Vec<u8>)>>>;

struct Chaos {
    rng: fastrand::Rng,
    loss: f64,
    dup: f64,
    delay: f64,
}

/// What one seed saw, to check the sweep exercised every outcome.
#[derive(Default, Debug)]
struct Seen {
    events: BTreeMap<String, usize>,
    lost: usize,
    retransmissions: u64,
    drops: u64,
}

fn run_seed(seed: u64, seen: &mut Seen) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let chaos = Chaos {
        rng: fastrand::Rng::with_seed(seed ^ 0xa5a5),
        loss: [0.0, 0.05, 0.2][rng.usize(..3)],
        dup: [0.0, 0.05, 0.15][rng.usize(..3)],
        delay: [0.0, 0.1, 0.3][rng.usize(..3)],
    };
    let chaos = std::rc::Rc::new(core::cell::RefCell::new(chaos));
    let held: Held = Default::default();
    let mut net = Net::new(seed);
    {
        let chaos = chaos.clone();
        let held = held.clone();
        net.filter = Box::new(move |s, mad| {
            let mut c = chaos.borrow_mut();
            let roll = c.rng.f64();
            if roll < c.loss {
                return false;
            }
            if c.rng.f64() < c.dup {
                held.borrow_mut().push((s, mad.to_vec()));
            }
            if c.rng.f64() < c.delay {
                // Delivered later, after a timer step (a reordering too).
                held.borrow_mut().push((s, mad.to_vec()));
                return false;
            }
            true
        });
    }
    net.sides[A].auto_qp = false;
    net.sides[B].auto_qp = false;
    let listener = net.listen_b();
    let mut a_ids: Vec<CmId> = Vec::new();
    let mut b_accepted: Vec<CmId> = Vec::new();
    let mut b_seen = 0usize;
    let mut b_pending: Vec<CmId> = Vec::new();
    let mut next_qpn = 0x1000u32;
    let rounds = 60 + rng.usize(..60);

    let release_held = |net: &mut Net| {
        let mut items = core::mem::take(&mut *held.borrow_mut());
        chaos.borrow_mut().rng.shuffle(&mut items);
        for (s, mad) in items {
            let to = 1 - s;
            let from = net.sides[s].addr;
            net.wire.push_back((to, from, mad));
        }
    };
    let complete_some_qp = |net: &mut Net, rng: &mut fastrand::Rng, all: bool| {
        for s in 0..2 {
            let n = net.sides[s].rec.pending_qp.len();
            for _ in 0..n {
                if !all && rng.bool() {
                    continue;
                }
                let Some((id, _, _)) = net.sides[s].rec.pending_qp.pop_front() else {
                    break;
                };
                let ok = rng.u8(..20) != 0;
                let side = &mut net.sides[s];
                assert!(side.cm.on_qp_modified(net.now, id, ok, &mut side.rec));
            }
        }
    };

    for _ in 0..rounds {
        match rng.u8(..10) {
            0 | 1 => {
                let mut buf = [0u8; 92];
                next_qpn += 1;
                let req = connect_request(&mut buf, b"r", next_qpn, next_qpn);
                let side = &mut net.sides[A];
                if let Ok(id) = side.cm.connect(net.now, &req, &mut side.rec) {
                    a_ids.push(id);
                }
            }
            2 | 3 => {
                // B answers a pending request.
                if !b_pending.is_empty() {
                    let id = b_pending.swap_remove(rng.usize(..b_pending.len()));
                    let side = &mut net.sides[B];
                    let result = if rng.u8(..4) == 0 {
                        side.cm.reject(
                            net.now,
                            id,
                            RejectReason::ConsumerDefined,
                            b"no",
                            &mut side.rec,
                        )
                    } else {
                        next_qpn += 1;
                        let r = side.cm.accept(
                            net.now,
                            id,
                            &accept_request(b"yes", next_qpn, next_qpn),
                            &mut side.rec,
                        );
                        if r.is_ok() {
                            b_accepted.push(id);
                        }
                        r
                    };
                    // Withdrawn meanwhile is the only acceptable failure.
                    if let Err(e) = result {
                        assert!(
                            matches!(e, CmError::UnknownId | CmError::WrongState),
                            "{e:?}"
                        );
                    }
                }
            }
            4 => {
                if !a_ids.is_empty() {
                    let id = a_ids[rng.usize(..a_ids.len())];
                    let side = &mut net.sides[A];
                    let _ = side.cm.disconnect(net.now, id, &[], &mut side.rec);
                }
            }
            5 => {
                if !b_accepted.is_empty() {
                    let id = b_accepted[rng.usize(..b_accepted.len())];
                    let side = &mut net.sides[B];
                    let _ = side.cm.disconnect(net.now, id, &[], &mut side.rec);
                }
            }
            6 | 7 => complete_some_qp(&mut net, &mut rng, false),
            8 => release_held(&mut net),
            _ => {
                let limit = rng.u64(..20_000_000);
                net.step_time(limit);
            }
        }
        net.pump();
        // New requests at B.
        for (_, e) in &net.sides[B].rec.lev[b_seen..] {
            match e {
                LEv::Request { id, .. } => b_pending.push(*id),
                LEv::Withdrawn(id, _) => b_pending.retain(|p| p != id),
            }
        }
        b_seen = net.sides[B].rec.lev.len();
    }

    // Wind down: everyone disconnects, the wire keeps misbehaving, timers
    // run out.
    for _ in 0..200 {
        for id in a_ids.clone() {
            let side = &mut net.sides[A];
            let _ = side.cm.disconnect(net.now, id, &[], &mut side.rec);
        }
        for id in b_accepted.clone() {
            let side = &mut net.sides[B];
            let _ = side.cm.disconnect(net.now, id, &[], &mut side.rec);
        }
        for id in core::mem::take(&mut b_pending) {
            let side = &mut net.sides[B];
            let _ = side
                .cm
                .reject(net.now, id, RejectReason::NoResources, &[], &mut side.rec);
        }
        complete_some_qp(&mut net, &mut rng, true);
        release_held(&mut net);
        net.pump();
        for (_, e) in &net.sides[B].rec.lev[b_seen..] {
            if let LEv::Request { id, .. } = e {
                b_pending.push(*id);
            }
        }
        b_seen = net.sides[B].rec.lev.len();
        let quiet = net.sides.iter().all(|s| s.rec.pending_qp.is_empty())
            && held.borrow().is_empty()
            && net.wire.is_empty();
        if !net.step_time(FOREVER) && quiet {
            break;
        }
    }

    let ctx = format!("seed {seed}");
    for side in &net.sides {
        for (_, e) in &side.rec.events {
            let name = e.name();
            let kind = name.split('(').next().unwrap_or("").to_string();
            *seen.events.entry(kind).or_default() += 1;
        }
        seen.retransmissions += side.cm.stats().retransmissions;
        seen.drops += side.cm.stats().dropped_total();
    }
    seen.lost += net.lost();
    net.check_contract();
    for s in 0..2 {
        assert_eq!(
            net.sides[s].cm.connections_in_use(),
            0,
            "{ctx}: side {s} leaked"
        );
        assert!(net.sides[s].rec.pending_qp.is_empty(), "{ctx}");
        assert_eq!(net.sides[s].cm.stats().emit_failures, 0, "{ctx}");
    }
    // Exactly one terminal event per connection a consumer owned.
    for (s, ids) in [(A, &a_ids), (B, &b_accepted)] {
        for id in ids {
            let evs = net.events(s, *id);
            assert_eq!(
                evs.iter().filter(|e| e.is_terminal()).count(),
                1,
                "{ctx}: side {s} {id:?} {evs:?}"
            );
        }
    }
    // Every request was answered (accepted or rejected) or withdrawn.
    for (l, e) in &net.sides[B].rec.lev {
        assert_eq!(*l, listener);
        if let LEv::Request { id, .. } = e {
            let withdrawn = net.sides[B]
                .rec
                .lev
                .iter()
                .any(|(_, w)| matches!(w, LEv::Withdrawn(i, _) if i == id));
            let accepted = b_accepted.contains(id);
            assert!(
                withdrawn || accepted || net.sides[B].cm.state(*id).is_none(),
                "{ctx}: {id:?}"
            );
        }
    }
}

#[test]
fn lossy_wire_random_consumers_no_leak_exactly_once() {
    let seeds = std::env::var("KVERBS_CM_SEEDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300u64);
    let mut seen = Seen::default();
    for seed in 0..seeds {
        run_seed(seed, &mut seen);
    }
    std::println!("{seen:?}");
    // The sweep is only worth something if it reached every outcome.
    if seeds >= 16 {
        for kind in ["Established", "Rejected", "Unreachable", "Disconnected"] {
            assert!(
                seen.events.get(kind).copied().unwrap_or(0) > 0,
                "{kind}: {seen:?}"
            );
        }
        assert!(
            seen.lost > 0 && seen.retransmissions > 0 && seen.drops > 0,
            "{seen:?}"
        );
    }
}
