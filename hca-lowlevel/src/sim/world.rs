//! The simulated world: every HCA of a fabric, the packets in flight between
//! them, the clock, and the engine loop that runs it all.
//!
//! One mutex guards the world. The engine runs under it; events (completion
//! and asynchronous) are collected and delivered after it is released, so a
//! handler may ring a doorbell without deadlocking. A doorbell never blocks:
//! it sets a flag and either wakes the device thread or (inline doorbells,
//! in either mode) runs the engine on the calling thread if no one else is
//! running it. In thread mode with inline doorbells the device thread stays:
//! it runs the timers and the link input, and the doorbells that found the
//! world busy with something other than an engine run (an engine run picks
//! up the doorbells rung while it runs before it finishes, so those cost no
//! wake-up; see the `engine_gate` module).

use std::cell::{Cell, RefCell};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use crate::device::{AsyncEvent, AsyncEventHandler, GSI_QPN, Gid, Mtu, PortState};
use crate::wire::{
    EthernetAddress, ICRC_LEN, IbPacketRepr, Ipv4Address, RoceV2FrameRepr, Transport,
};

use super::engine_gate::EngineGate;
use super::fault::{FaultConfig, Faults};
use super::link::{Delivery, EthLink};
use super::mem::PhysMemory;
use super::payload::{Payload, Source, recycle_pinned};
use super::qp::{Ctx, Qp, recycle_payload};
use super::resources::{Cq, CqShared, Mr};

/// How the device model runs.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ExecMode {
    /// A device thread runs the engine whenever a doorbell rings or a timer
    /// is due (hardware-like concurrency; real time).
    Thread,
    /// The test runs the engine ([`super::Fabric::run_until_idle`],
    /// [`super::Fabric::advance`]) on a virtual clock; optionally inline in
    /// the doorbell write ([`super::Fabric::set_inline_doorbells`]).
    Stepped,
}

/// An event to deliver once the world lock is released.
pub(crate) enum Event {
    Completion(Arc<CqShared>),
    Async(Arc<dyn AsyncEventHandler>, AsyncEvent),
}

/// A slice of a payload held by reference: the payload of a frame sent by
/// reference ([`Outbox::send_shared`]).
pub(crate) struct SharedPayload {
    pub src: Source,
    pub range: core::ops::Range<usize>,
}

impl SharedPayload {
    /// The payload as the receiver sees it (an empty one if the range is
    /// out of bounds, which the senders rule out).
    fn payload(&self) -> Payload<'_> {
        let r = self.range.clone();
        match &self.src {
            Source::Bytes(b) => Payload::Bytes(b.get(r).unwrap_or(&[])),
            Source::Pinned(p) if r.start <= r.end && r.end <= p.len() => Payload::Pinned {
                src: p,
                start: r.start,
                len: r.end - r.start,
            },
            Source::Pinned(_) => Payload::Bytes(&[]),
        }
    }

    /// False once the source may no longer be read for the wire (see
    /// [`super::payload`]): the frame is then lost.
    fn valid(&self) -> bool {
        match &self.src {
            Source::Bytes(_) => true,
            Source::Pinned(p) => p.valid(),
        }
    }

    /// Gives the payload's buffers back to their pools, if this was their
    /// last holder.
    fn recycle(self) {
        match self.src {
            Source::Bytes(b) => recycle_payload(b),
            Source::Pinned(p) => recycle_pinned(p),
        }
    }
}

/// A frame not yet written out: its headers, and its payload by reference
/// (the sender's gathered data, or the sender's own memory, pinned). On a
/// plain in-process link (no fault configuration, no capture, no Ethernet
/// link: where the ICRC is already trusted) it is delivered as it is, so
/// the receiver places the payload straight from where it is: no frame
/// copy and no ICRC, and for pinned memory no gather either (one copy per
/// byte). Everywhere else it is written out first ([`Frame::into_bytes`]),
/// byte for byte the frame [`Outbox::send`] would have built.
pub(crate) struct DirectFrame {
    /// The frame's headers; its packet's payload is empty (it is
    /// `payload`).
    headers: RoceV2FrameRepr<'static>,
    /// The payload; `None` only in a pooled box (see [`recycle_direct`]),
    /// so a spare box holds no one's memory and costs no placeholder.
    payload: Option<SharedPayload>,
}

impl DirectFrame {
    /// The frame's headers (with an empty payload) and its payload.
    #[cfg(test)]
    fn parts(&self) -> (RoceV2FrameRepr<'static>, Payload<'_>) {
        let payload = self
            .payload
            .as_ref()
            .map_or(Payload::Bytes(&[]), SharedPayload::payload);
        (self.headers, payload)
    }

    /// The payload, if it may still be read for the wire (see
    /// [`SharedPayload::valid`]).
    fn valid_payload(&self) -> Option<&SharedPayload> {
        self.payload.as_ref().filter(|p| p.valid())
    }

    /// The frame written out (`None` if the emitter rejects it, or pinned
    /// memory cannot be read).
    fn emit(&self) -> Option<Vec<u8>> {
        let bytes;
        let data = match self.payload.as_ref()?.payload() {
            Payload::Bytes(b) => b,
            p => {
                bytes = p.to_vec().ok()?;
                bytes.as_slice()
            }
        };
        let mut frame: RoceV2FrameRepr<'_> = self.headers;
        frame.packet.payload = data;
        emit_frame(&frame)
    }
}

/// Most spare [`DirectFrame`] boxes a thread keeps: room for every frame
/// of a queue depth of 256 on the wire at once (several per I/O; at most
/// ~1 MiB a thread). With 256 the pool overflowed at that depth and each
/// I/O allocated ~3 boxes again (`tools/perf/run.sh`, allocations).
const DIRECT_POOL_MAX: usize = 4096;

thread_local! {
    #[expect(
        clippy::vec_box,
        reason = "the boxes are the point: frames move as pointers, and the pool keeps their allocations"
    )]
    /// Boxes of delivered direct frames, their payloads already released
    /// (see [`recycle_direct`]): a frame's headers are a few hundred bytes,
    /// and held inline they were copied nine times on the way from the
    /// sender's outbox through the wire to the receiver (about a tenth of
    /// a 128 KiB READ's CPU time); boxed, a move is a pointer, and a
    /// pooled box costs no allocation.
    static DIRECT_POOL: RefCell<Vec<Box<DirectFrame>>> = const { RefCell::new(Vec::new()) };
}

/// The direct frame of `pkt`'s headers framed along `route`, with `payload`
/// (`None` if a GID is not IPv4-mapped), in a spare box of this thread's
/// when it has one. A pooled box is rewritten in place
/// ([`fill_roce_frame`]): built whole and then moved into the box, the
/// ~200-byte frame was copied twice more per packet (about a fifth of
/// [`Outbox::send_shared`]).
fn direct_frame(
    route: Route,
    pkt: &IbPacketRepr<'_>,
    payload: SharedPayload,
) -> Option<Box<DirectFrame>> {
    let ips = route.ipv4()?;
    let Some(mut b) = DIRECT_POOL.with(|p| p.borrow_mut().pop()) else {
        let headers = roce_frame(route, pkt, &[])?;
        return Some(Box::new(DirectFrame {
            headers,
            payload: Some(payload),
        }));
    };
    fill_roce_frame(&mut b.headers, route, ips, pkt, &[]);
    b.payload = Some(payload);
    Some(b)
}

/// Releases a direct frame's payload (its pinned memory, its buffer back to
/// its pool if this was the last holder) and keeps the box for reuse.
fn recycle_direct(mut d: Box<DirectFrame>) {
    if let Some(payload) = d.payload.take() {
        payload.recycle();
    }
    DIRECT_POOL.with(|p| {
        let mut p = p.borrow_mut();
        if p.len() < DIRECT_POOL_MAX {
            p.push(d);
        }
    });
}

/// A frame handed to the fabric.
pub(crate) enum Frame {
    /// A RoCEv2 frame, ICRC included.
    Bytes(Vec<u8>),
    /// Headers and a payload by reference (see [`DirectFrame`]), boxed (see
    /// [`DIRECT_POOL`]).
    Direct(Box<DirectFrame>),
}

impl Frame {
    /// The frame's bytes: a direct frame is emitted now (`None` if the
    /// emitter rejects it, which [`Outbox::send_shared`] rules out before).
    fn into_bytes(self) -> Option<Vec<u8>> {
        match self {
            Frame::Bytes(b) => Some(b),
            Frame::Direct(d) => {
                let b = d.emit();
                recycle_direct(d);
                b
            }
        }
    }

    /// Gives the frame's buffer back to its pool.
    fn recycle(self) {
        match self {
            Frame::Bytes(b) => recycle_frame(b),
            // The payload's buffer goes back to its pool if this frame was
            // its last holder (the send operation completed first).
            Frame::Direct(d) => recycle_direct(d),
        }
    }
}

/// `frame` written out into a pooled buffer, or `None` (the buffer back in
/// the pool) if the emitter rejects it.
fn emit_frame(frame: &RoceV2FrameRepr<'_>) -> Option<Vec<u8>> {
    let mut buf = frame_buffer(frame);
    if frame.emit(&mut buf).is_ok() {
        Some(buf)
    } else {
        recycle_frame(buf);
        None
    }
}

/// What one engine step produces besides state changes.
#[derive(Default)]
pub(crate) struct Outbox {
    pub frames: Vec<(Gid, Frame)>,
    pub events: Vec<Event>,
    pub unroutable: u64,
}

fn mac_of(ip: Ipv4Address) -> EthernetAddress {
    let [a, b, c, d] = ip.0;
    EthernetAddress([0x02, 0x00, a, b, c, d])
}

/// Where a packet goes and how it is framed on the way: what every frame a
/// QP sends carries besides its packet. Built by [`Route::new`], which
/// converts both GIDs to IPv4 once (a sender builds its route once per burst
/// and frames every packet of it with the stored addresses); the fields are
/// private so the addresses cannot drift from the GIDs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Route {
    /// The receiver's GID (IPv4-mapped).
    dst: Gid,
    /// The sender's and the receiver's IPv4 addresses; `None` if either
    /// GID is not IPv4-mapped (the route's frames are unroutable).
    ipv4: Option<(Ipv4Address, Ipv4Address)>,
    /// IPv4 type of service (the traffic class).
    tos: u8,
    /// IPv4 time to live (the hop limit).
    ttl: u8,
    /// The UDP source port (the QP's flow label).
    udp_src_port: u16,
}

impl Route {
    /// The route from `src` to `dst` with these IPv4 and UDP fields.
    pub fn new(src: Gid, dst: Gid, tos: u8, ttl: u8, udp_src_port: u16) -> Route {
        let ipv4 = src.to_ipv4().zip(dst.to_ipv4());
        Route {
            dst,
            ipv4,
            tos,
            ttl,
            udp_src_port,
        }
    }

    /// The receiver's GID.
    pub fn dst(&self) -> Gid {
        self.dst
    }

    /// The sender's and the receiver's IPv4 addresses, or `None` if a GID
    /// is not IPv4-mapped.
    fn ipv4(&self) -> Option<(Ipv4Address, Ipv4Address)> {
        self.ipv4
    }
}

/// The RoCEv2 framing of `pkt`'s headers with `payload` (IPv4-mapped
/// GIDs), or `None` if a GID is not IPv4-mapped.
fn roce_frame<'a>(
    route: Route,
    pkt: &IbPacketRepr<'_>,
    payload: &'a [u8],
) -> Option<RoceV2FrameRepr<'a>> {
    let ips = route.ipv4()?;
    // Stand-ins only: `fill_roce_frame` writes every field.
    let mut frame = RoceV2FrameRepr {
        src_mac: EthernetAddress([0; 6]),
        dst_mac: EthernetAddress([0; 6]),
        src_ip: Ipv4Address([0; 4]),
        dst_ip: Ipv4Address([0; 4]),
        tos: 0,
        ttl: 0,
        ident: 0,
        dont_fragment: false,
        udp_src_port: 0,
        packet: IbPacketRepr::new(pkt.bth, payload),
    };
    fill_roce_frame(&mut frame, route, ips, pkt, payload);
    Some(frame)
}

/// Writes into `frame` the RoCEv2 framing of `pkt`'s headers along `route`
/// (`src` and `dst`: its IPv4 addresses, [`Route::ipv4`]), with `payload`
/// as its payload. The one place a frame's fields are set, for a new frame
/// ([`roce_frame`]) and for a pooled one rewritten in place
/// ([`direct_frame`]): the patterns below name every field (no `..`), so
/// a field added to the frame or the packet does not compile until it is
/// written here.
fn fill_roce_frame<'a>(
    frame: &mut RoceV2FrameRepr<'a>,
    route: Route,
    (src, dst): (Ipv4Address, Ipv4Address),
    pkt: &IbPacketRepr<'_>,
    payload: &'a [u8],
) {
    let RoceV2FrameRepr {
        src_mac,
        dst_mac,
        src_ip,
        dst_ip,
        tos,
        ttl,
        ident,
        dont_fragment,
        udp_src_port,
        packet,
    } = frame;
    *src_mac = mac_of(src);
    *dst_mac = mac_of(dst);
    *src_ip = src;
    *dst_ip = dst;
    *tos = route.tos;
    *ttl = route.ttl;
    *ident = 0;
    *dont_fragment = true;
    *udp_src_port = route.udp_src_port;
    let IbPacketRepr {
        bth,
        rdeth,
        deth,
        feth,
        reth,
        atomic_eth,
        aeth,
        atomic_ack_eth,
        immdt,
        ieth,
        payload: to_payload,
    } = packet;
    *bth = pkt.bth;
    *rdeth = pkt.rdeth;
    *deth = pkt.deth;
    *feth = pkt.feth;
    *reth = pkt.reth;
    *atomic_eth = pkt.atomic_eth;
    *aeth = pkt.aeth;
    *atomic_ack_eth = pkt.atomic_ack_eth;
    *immdt = pkt.immdt;
    *ieth = pkt.ieth;
    *to_payload = payload;
}

/// Payloads up to this size go by reference ([`Outbox::send_shared`]):
/// every MTU. (Bigger ones cannot occur; they would take the byte path,
/// whose emitter has the final word on the IPv4 length limit.)
const DIRECT_MAX_PAYLOAD: usize = 4096;

impl Outbox {
    /// Frames `pkt` as RoCEv2 (IPv4-mapped GIDs) and queues it.
    pub fn send(&mut self, route: Route, pkt: &IbPacketRepr<'_>) {
        let Some(frame) = roce_frame(route, pkt, pkt.payload) else {
            self.unroutable += 1;
            return;
        };
        match emit_frame(&frame) {
            Some(buf) => self.frames.push((route.dst(), Frame::Bytes(buf))),
            None => self.unroutable += 1,
        }
    }

    /// As [`Self::send`], with `payload` as the packet's payload (whatever
    /// `pkt.payload` is), kept by reference: the frame is written out only
    /// if its link needs bytes (see [`DirectFrame`]). A packet the emitter
    /// would reject takes [`Self::send`], so it meets the same fate.
    pub fn send_shared(&mut self, route: Route, pkt: &IbPacketRepr<'_>, payload: SharedPayload) {
        let data = payload.payload();
        let len = data.len();
        // The headers checked with the payload's length: no copy of `pkt`
        // with a stand-in payload.
        if len > DIRECT_MAX_PAYLOAD || pkt.check_payload_len(len).is_err() {
            return self.send_materialized(route, pkt, data);
        }
        match direct_frame(route, pkt, payload) {
            Some(d) => self.frames.push((route.dst(), Frame::Direct(d))),
            None => self.unroutable += 1,
        }
    }

    /// [`Self::send`] of `pkt` with `data` as its payload, read now.
    fn send_materialized(&mut self, route: Route, pkt: &IbPacketRepr<'_>, data: Payload<'_>) {
        let bytes;
        let mut full = *pkt;
        full.payload = match data {
            Payload::Bytes(b) => b,
            p => match p.to_vec() {
                Ok(v) => {
                    bytes = v;
                    bytes.as_slice()
                }
                Err(_) => {
                    self.unroutable += 1;
                    return;
                }
            },
        };
        self.send(route, &full);
    }
}

/// Most spare frame buffers a thread keeps.
const FRAME_POOL_MAX: usize = 1024;

/// Frames of at most this many bytes (ACKs, SRP responses, READ requests)
/// take their buffers from a pool of their own.
const SMALL_FRAME: usize = 256;

thread_local! {
    /// Frame buffers of delivered frames, reused by the next frames this
    /// thread emits: a zeroed heap allocation per frame cost more than the
    /// rest of its framing (about 1,350 instructions of ~8,000 per 1 KiB
    /// packet, allocation and memset). Two pools, small frames and the
    /// rest: with one, a data frame that took an ACK's buffer zero-filled
    /// the ~4 KiB it grew by.
    static FRAME_POOL: RefCell<[Vec<Vec<u8>>; 2]> =
        const { RefCell::new([Vec::new(), Vec::new()]) };
}

/// The pool of a frame of `len` bytes (or a buffer of that capacity).
fn frame_class(len: usize) -> usize {
    usize::from(len > SMALL_FRAME)
}

/// A buffer of `frame.buffer_len()` bytes for `frame.emit`, taken from the
/// pool. Every byte the emitter does not write itself is zero, exactly as in
/// a fresh zeroed buffer: the headers (some leave reserved bits or bytes
/// alone) are cleared here, and the emitter writes the payload, the pad
/// bytes (zeroed) and the ICRC.
fn frame_buffer(frame: &RoceV2FrameRepr<'_>) -> Vec<u8> {
    let total = frame.buffer_len();
    let mut buf = FRAME_POOL
        .with(|p| {
            p.borrow_mut()
                .get_mut(frame_class(total))
                .and_then(Vec::pop)
        })
        .unwrap_or_default();
    if buf.len() > total {
        buf.truncate(total);
    } else {
        // Grows with zeros (only the part that is new).
        buf.resize(total, 0);
    }
    let pkt = &frame.packet;
    let written = pkt.payload.len() + usize::from(pkt.pad_count()) + ICRC_LEN;
    let headers = total.saturating_sub(written);
    if let Some(h) = buf.get_mut(..headers) {
        h.fill(0);
    }
    buf
}

/// Fills this thread's frame pool with buffers of `0xAA` bytes (tests: a
/// recycled buffer must emit the same frame as a zeroed one).
#[cfg(test)]
pub(crate) fn poison_frame_pool() {
    for len in [64, 100, 1100, 4200] {
        for _ in 0..16 {
            recycle_frame(vec![0xAA; len]);
        }
    }
}

/// Returns a delivered frame's buffer to this thread's pool.
pub(crate) fn recycle_frame(buf: Vec<u8>) {
    FRAME_POOL.with(|p| {
        let mut p = p.borrow_mut();
        if let Some(pool) = p.get_mut(frame_class(buf.capacity())) {
            if pool.len() < FRAME_POOL_MAX {
                pool.push(buf);
            }
        }
    });
}

/// Fabric-wide counters.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct FabricStats {
    /// Frames handed to the fabric.
    pub frames_sent: u64,
    /// Frames delivered to a port.
    pub frames_delivered: u64,
    /// Frames dropped by fault injection.
    pub dropped_by_fault: u64,
    /// Extra copies made by fault injection.
    pub duplicated: u64,
    /// Frames corrupted by fault injection.
    pub corrupted: u64,
    /// Frames that failed to parse (ICRC mismatch included) and were dropped.
    pub dropped_malformed: u64,
    /// Frames whose ICRC did not verify.
    pub dropped_bad_icrc: u64,
    /// Frames parsed without recomputing their ICRC: byte for byte what
    /// the emitter in this process wrote, on an in-process link with no
    /// fault configuration and no capture (the ICRC is computed once, at
    /// emit). Every other frame is verified in full.
    pub icrc_trusted: u64,
    /// Of those, frames delivered as headers and a reference to their
    /// payload (the sender's pinned memory, or its gathered bytes), never
    /// written out (so with no ICRC at all): for pinned memory the
    /// receiver's placement is the one copy of the payload.
    pub frames_direct: u64,
    /// Frames by reference dropped as lost because their source was
    /// revoked before placement: a send flushed (completed in error) with
    /// its packets still on the wire, or an RDMA READ response whose
    /// responder key changed (see the module `payload`).
    pub dropped_stale_source: u64,
    /// Frames to an unknown GID, a port that is down, or no such QP.
    pub dropped_unroutable: u64,
}

/// A frame captured on the fabric (see [`super::Fabric::set_capture`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CapturedFrame {
    /// Virtual (or real) time it was sent, in ns.
    pub at_ns: u64,
    /// The RoCEv2 frame as sent (before fault injection).
    pub bytes: Vec<u8>,
}

pub(crate) struct Hca {
    pub gid: Gid,
    pub mem: Arc<PhysMemory>,
    pub node_guid: u64,
    pub mtu: Mtu,
    pub port_state: PortState,
    pub pds: BTreeMap<u32, u32>,
    pub next_pd: u32,
    pub cqs: BTreeMap<u32, Cq>,
    pub next_cqn: u32,
    pub qps: BTreeMap<u32, Qp>,
    pub next_qpn: u32,
    pub gsi_qpn: Option<u32>,
    pub mrs: BTreeMap<u32, Mr>,
    pub next_mkey_index: u32,
    pub async_handler: Option<Arc<dyn AsyncEventHandler>>,
    /// The port's Ethernet link; `None` for a port on the in-process fabric.
    pub link: Option<EthLink>,
}

impl Hca {
    /// Runs one closure over a QP with the rest of the HCA as its context.
    pub fn with_qp<R>(
        &mut self,
        qpn: u32,
        now: u64,
        out: &mut Outbox,
        f: impl FnOnce(&mut Qp, &mut Ctx<'_>) -> R,
    ) -> Option<R> {
        let (qps, mut ctx) = self.split(now, out);
        let qp = qps.get_mut(&qpn)?;
        Some(f(qp, &mut ctx))
    }

    /// The HCA as its QPs and the context a QP runs with (the rest of it).
    fn split<'a>(
        &'a mut self,
        now: u64,
        out: &'a mut Outbox,
    ) -> (&'a mut BTreeMap<u32, Qp>, Ctx<'a>) {
        let Hca {
            gid,
            mem,
            cqs,
            qps,
            mrs,
            async_handler,
            ..
        } = self;
        let ctx = Ctx {
            mem,
            mrs,
            cqs,
            async_handler,
            out,
            now,
            local_gid: *gid,
        };
        (qps, ctx)
    }

    fn pass(&mut self, now: u64, out: &mut Outbox) -> bool {
        let mut progress = false;
        for cq in self.cqs.values_mut() {
            cq.process_arm(out);
        }
        // Every QP in turn, with the rest of the HCA as its context (no
        // list of QPNs collected per pass: that was an allocation per HCA
        // per engine pass).
        let (qps, mut ctx) = self.split(now, out);
        for qp in qps.values_mut() {
            progress |= qp.on_timer(&mut ctx);
            progress |= qp.run_send_side(&mut ctx);
            progress |= qp.emit_responses(&mut ctx);
        }
        progress
    }

    fn next_deadline(&self) -> Option<u64> {
        let qps = self.qps.values().filter_map(Qp::next_deadline).min();
        let link = self.link.as_ref().and_then(EthLink::next_deadline);
        match (qps, link) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

struct InFlight {
    at: u64,
    seq: u64,
    dst: usize,
    /// The frame is byte for byte what this process's emitter wrote (an
    /// in-process link with no fault injection configured and no capture):
    /// its ICRC was computed over these bytes at emit and is not recomputed
    /// at delivery. Every other frame is verified in full.
    unaltered: bool,
    frame: Frame,
}

// Frames are ordered by `(at, seq)` alone (`seq` is unique).
impl PartialEq for InFlight {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for InFlight {}
impl PartialOrd for InFlight {
    fn partial_cmp(&self, other: &Self) -> Option<core::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for InFlight {
    fn cmp(&self, other: &Self) -> core::cmp::Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

/// The frames in flight, delivered in `(at, seq)` order. Most frames are
/// sent with no delay (no fault injection), at a clock that only moves
/// forward: those go to a FIFO that is already in order (O(1) per frame);
/// the rest (delays, reordering, a clock set back) go to a heap. Delivery
/// takes the smaller head of the two, so the order is exactly the heap's.
#[derive(Default)]
struct Wire {
    fifo: VecDeque<InFlight>,
    heap: BinaryHeap<Reverse<InFlight>>,
}

impl Wire {
    fn push(&mut self, f: InFlight) {
        if self
            .fifo
            .back()
            .is_none_or(|b| (b.at, b.seq) < (f.at, f.seq))
        {
            self.fifo.push_back(f);
        } else {
            self.heap.push(Reverse(f));
        }
    }

    /// The next frame due at or before `now`, if any.
    fn pop_due(&mut self, now: u64) -> Option<InFlight> {
        let fifo = self.fifo.front().map(|f| (f.at, f.seq));
        let heap = self.heap.peek().map(|Reverse(f)| (f.at, f.seq));
        let from_fifo = match (fifo, heap) {
            (Some(a), Some(b)) => a < b,
            (Some(_), None) => true,
            (None, Some(_)) => false,
            (None, None) => return None,
        };
        if from_fifo {
            if self.fifo.front().is_some_and(|f| f.at <= now) {
                return self.fifo.pop_front();
            }
        } else if self.heap.peek().is_some_and(|Reverse(f)| f.at <= now) {
            return self.heap.pop().map(|Reverse(f)| f);
        }
        None
    }

    fn next_at(&self) -> Option<u64> {
        let a = self.fifo.front().map(|f| f.at);
        let b = self.heap.peek().map(|Reverse(f)| f.at);
        match (a, b) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn len(&self) -> usize {
        self.fifo.len() + self.heap.len()
    }
}

pub(crate) struct World {
    pub hcas: Vec<Hca>,
    /// The fabric's ports by GID: an ordered map, a few 16-byte compares
    /// per frame on a small fabric where a hashed one cost ~100
    /// instructions of SipHash per frame. Changed only by
    /// [`Self::add_port`].
    gids: BTreeMap<Gid, usize>,
    /// The last GID [`Self::port_of`] found, and its port: a message's
    /// packets all go to one port, and a hit is one 16-byte compare where
    /// the map's search cost ~35 instructions per frame. Cleared whenever
    /// `gids` changes.
    last_port: Option<(Gid, usize)>,
    wire: Wire,
    seq: u64,
    pub now: u64,
    pub events: Vec<Event>,
    pub stats: FabricStats,
    pub capture: Option<Vec<CapturedFrame>>,
    pub faults: Faults,
    /// See [`Self::recycle_outbox`].
    spare_outbox: Option<Outbox>,
}

impl World {
    pub fn new(seed: u64) -> Self {
        Self {
            hcas: Vec::new(),
            gids: BTreeMap::new(),
            last_port: None,
            wire: Wire::default(),
            seq: 0,
            now: 0,
            events: Vec::new(),
            stats: FabricStats::default(),
            capture: None,
            faults: Faults::new(seed),
            spare_outbox: None,
        }
    }

    /// Puts the port of HCA `idx` on the fabric at `gid` (a GID already
    /// there moves to it).
    pub fn add_port(&mut self, gid: Gid, idx: usize) {
        self.gids.insert(gid, idx);
        self.last_port = None;
    }

    /// The HCA whose fabric port has `gid`, if any.
    fn port_of(&mut self, gid: Gid) -> Option<usize> {
        if let Some((g, i)) = self.last_port {
            if g == gid {
                return Some(i);
            }
        }
        let i = *self.gids.get(&gid)?;
        self.last_port = Some((gid, i));
        Some(i)
    }

    /// An empty outbox, with the capacity of one used before (see
    /// [`Self::recycle_outbox`]).
    pub fn outbox(&mut self) -> Outbox {
        self.spare_outbox.take().unwrap_or_default()
    }

    /// Keeps an absorbed (empty) outbox for the next [`Self::outbox`]: two
    /// fresh vectors grown per HCA per engine pass and per delivered frame
    /// were a measurable share of a packet's cost.
    pub fn recycle_outbox(&mut self, out: Outbox) {
        if out.frames.is_empty() && out.events.is_empty() {
            self.spare_outbox = Some(out);
        }
    }

    /// Hands an outbox's frames to the fabric and its events to the world;
    /// the outbox is left empty.
    pub fn absorb(&mut self, src: usize, out: &mut Outbox) {
        // Most deliveries send nothing at once (a data packet's ACK, if
        // any, is queued and sent by the next pass): ~70 instructions per
        // packet of draining and appending nothing.
        if out.frames.is_empty() && out.events.is_empty() && out.unroutable == 0 {
            return;
        }
        self.stats.dropped_unroutable += core::mem::take(&mut out.unroutable);
        self.events.append(&mut out.events);
        for (dst_gid, mut frame) in out.frames.drain(..) {
            self.stats.frames_sent += 1;
            let on_link = self.hcas.get(src).is_some_and(|h| h.link.is_some());
            if self.capture.is_some() || on_link {
                // A capture and an Ethernet link see the real frame.
                match frame.into_bytes() {
                    Some(b) => frame = Frame::Bytes(b),
                    None => {
                        self.stats.dropped_unroutable += 1;
                        continue;
                    }
                }
            }
            if let (Some(c), Frame::Bytes(bytes)) = (&mut self.capture, &frame) {
                c.push(CapturedFrame {
                    at_ns: self.now,
                    bytes: bytes.clone(),
                });
            }
            if let Some(h) = self.hcas.get_mut(src) {
                if let Some(link) = h.link.as_mut() {
                    let Frame::Bytes(frame) = frame else {
                        continue;
                    };
                    match dst_gid.to_ipv4() {
                        Some(ip) if h.port_state == PortState::Active => {
                            link.transmit(self.now, ip, frame);
                        }
                        _ => self.stats.dropped_unroutable += 1,
                    }
                    continue;
                }
            }
            let Some(dst) = self.port_of(dst_gid) else {
                self.stats.dropped_unroutable += 1;
                continue;
            };
            let up = |w: &World, i: usize| {
                w.hcas
                    .get(i)
                    .is_some_and(|h| h.port_state == PortState::Active)
            };
            if !up(self, src) || !up(self, dst) {
                self.stats.dropped_unroutable += 1;
                continue;
            }
            // Only a link with no fault configuration at all and no capture
            // running carries the emitter's ICRC as verified: any injector
            // (even one that only delays) and any capture keep the full check.
            let unaltered = self.capture.is_none() && !self.faults.configured(src, dst);
            let frame = match frame {
                // Only such a link takes a frame by reference: every fault
                // injector works on (and every capture records) bytes.
                Frame::Direct(_) if unaltered => {
                    self.seq += 1;
                    self.wire.push(InFlight {
                        at: self.now,
                        seq: self.seq,
                        dst,
                        unaltered,
                        frame,
                    });
                    continue;
                }
                frame => match frame.into_bytes() {
                    Some(b) => b,
                    None => {
                        self.stats.dropped_unroutable += 1;
                        continue;
                    }
                },
            };
            for (delay, bytes) in self.faults.apply(src, dst, frame, &mut self.stats) {
                self.seq += 1;
                self.wire.push(InFlight {
                    at: self.now.saturating_add(delay),
                    seq: self.seq,
                    dst,
                    unaltered,
                    frame: Frame::Bytes(bytes),
                });
            }
        }
    }

    /// Parses a RoCEv2 frame (ICRC included, unless `unaltered`: see
    /// [`InFlight::unaltered`]) and hands it to the QP it names on HCA
    /// `dst`; says what became of it.
    fn deliver(&mut self, dst: usize, frame: &Frame, unaltered: bool) -> Delivery {
        let bytes = match frame {
            Frame::Bytes(b) => b,
            Frame::Direct(d) => {
                let Some(payload) = d.valid_payload() else {
                    // Its source was revoked (see `super::payload`): lost.
                    self.stats.dropped_stale_source += 1;
                    return Delivery::Unroutable;
                };
                // Never written out, so there is no ICRC to check.
                self.stats.icrc_trusted += 1;
                self.stats.frames_direct += 1;
                return self.deliver_parsed(dst, &d.headers, payload.payload());
            }
        };
        let frame = bytes.as_slice();
        let parsed = if unaltered {
            self.stats.icrc_trusted += 1;
            RoceV2FrameRepr::parse_emitted_in_process(frame)
        } else {
            RoceV2FrameRepr::parse(frame)
        };
        let parsed = match parsed {
            Ok(p) => p,
            Err(e) => {
                self.stats.dropped_malformed += 1;
                if e == crate::wire::Error::BadIcrc {
                    self.stats.dropped_bad_icrc += 1;
                    return Delivery::BadIcrc;
                }
                return Delivery::Malformed;
            }
        };
        self.deliver_parsed(dst, &parsed, Payload::Bytes(parsed.packet.payload))
    }

    /// Delivers `frame` to HCA `dst` at once (see [`super::Fabric::inject`]).
    #[cfg(test)]
    pub fn inject(&mut self, dst: usize, frame: Vec<u8>) {
        self.deliver(dst, &Frame::Bytes(frame), false);
    }

    /// Hands a parsed frame to the QP it names on HCA `dst`.
    fn deliver_parsed(
        &mut self,
        dst: usize,
        parsed: &RoceV2FrameRepr<'_>,
        payload: Payload<'_>,
    ) -> Delivery {
        let now = self.now;
        let Some(hca) = self.hcas.get_mut(dst) else {
            return Delivery::Unroutable;
        };
        if hca.port_state != PortState::Active || parsed.dst_gid() != hca.gid {
            self.stats.dropped_unroutable += 1;
            return Delivery::Unroutable;
        }
        let pkt = &parsed.packet;
        let mut qpn = pkt.bth.dest_qp.get();
        if qpn == GSI_QPN {
            match hca.gsi_qpn {
                Some(q) if pkt.bth.opcode.transport() == Transport::Ud => qpn = q,
                _ => {
                    self.stats.dropped_unroutable += 1;
                    return Delivery::Unroutable;
                }
            }
        }
        let mut out = self.outbox();
        let Some(hca) = self.hcas.get_mut(dst) else {
            return Delivery::Unroutable;
        };
        let (src, dstg) = (parsed.src_gid(), parsed.dst_gid());
        if hca
            .with_qp(qpn, now, &mut out, |qp, ctx| {
                qp.receive(ctx, src, dstg, pkt, payload)
            })
            .is_none()
        {
            self.stats.dropped_unroutable += 1;
            return Delivery::Unroutable;
        }
        self.stats.frames_delivered += 1;
        self.absorb(dst, &mut out);
        self.recycle_outbox(out);
        Delivery::Delivered
    }

    /// The link work of HCA `i`: ARP timers, then every frame that arrived
    /// (ARP answered inside the link, RoCEv2 delivered here), then the
    /// capture flushed. Returns whether anything happened.
    fn link_pass(&mut self, i: usize) -> bool {
        let now = self.now;
        let Some(link) = self.hcas.get_mut(i).and_then(|h| h.link.as_mut()) else {
            return false;
        };
        let mut progress = link.on_timer(now);
        let received = link.take_received();
        progress |= !received.is_empty();
        for frame in received {
            let roce = self
                .hcas
                .get_mut(i)
                .and_then(|h| h.link.as_mut())
                .is_some_and(|l| l.receive(now, &frame));
            if roce {
                let outcome = self.deliver(i, &Frame::Bytes(frame), false);
                if let Some(l) = self.hcas.get_mut(i).and_then(|h| h.link.as_mut()) {
                    l.delivered(outcome);
                }
            }
        }
        if let Some(l) = self.hcas.get_mut(i).and_then(|h| h.link.as_mut()) {
            l.flush_capture();
        }
        progress
    }

    /// One pass: run every QP's send side and timers, then deliver every
    /// frame due by now. Returns whether anything happened.
    pub fn pass(&mut self) -> bool {
        let mut progress = false;
        let now = self.now;
        for i in 0..self.hcas.len() {
            let mut out = self.outbox();
            let p = self.hcas.get_mut(i).is_some_and(|h| h.pass(now, &mut out));
            progress |= p || !out.frames.is_empty() || !out.events.is_empty();
            self.absorb(i, &mut out);
            self.recycle_outbox(out);
        }
        while let Some(f) = self.wire.pop_due(now) {
            self.deliver(f.dst, &f.frame, f.unaltered);
            f.frame.recycle();
            progress = true;
        }
        for i in 0..self.hcas.len() {
            progress |= self.link_pass(i);
        }
        progress
    }

    /// Passes until nothing more happens at the current time (bounded, so a
    /// livelock shows up as a stop, not a hang).
    pub fn run_until_idle(&mut self) {
        for _ in 0..1_000_000 {
            if !self.pass() {
                return;
            }
        }
    }

    /// The next time something is scheduled (a frame or a timer).
    pub fn next_deadline(&self) -> Option<u64> {
        let f = self.wire.next_at();
        let t = self.hcas.iter().filter_map(Hca::next_deadline).min();
        match (f, t) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Frames still on the wire.
    pub fn in_flight(&self) -> usize {
        self.wire.len()
    }

    /// Port up/down: drops the in-flight frames to or from it when going
    /// down and raises the async event.
    pub fn set_port_state(&mut self, hca: usize, state: PortState) {
        let Some(h) = self.hcas.get_mut(hca) else {
            return;
        };
        if h.port_state == state {
            return;
        }
        h.port_state = state;
        if let Some(handler) = &h.async_handler {
            let ev = match state {
                PortState::Active => AsyncEvent::PortActive { port: 1 },
                PortState::Down => AsyncEvent::PortDown { port: 1 },
            };
            self.events.push(Event::Async(handler.clone(), ev));
        }
    }

    /// Replaces the fault configuration of the link `from → to`.
    pub fn set_link_faults(&mut self, from: usize, to: usize, cfg: FaultConfig) {
        self.faults.set(from, to, cfg);
    }
}

enum Clock {
    Virtual(AtomicU64),
    Real(Instant),
}

thread_local! {
    /// Set while this thread delivers device events: a doorbell rung from a
    /// handler does not re-enter the engine (the running loop picks it up).
    static IN_DEVICE: Cell<bool> = const { Cell::new(false) };
    /// Set while this thread executes the device model itself (not the
    /// event handlers it calls).
    static IN_MODEL: Cell<bool> = const { Cell::new(false) };
    /// Set on a thread-mode fabric's device thread.
    static ON_DEVICE_THREAD: Cell<bool> = const { Cell::new(false) };
}

/// True while the calling thread is executing the software HCA's device
/// model (for example inline in a doorbell write, in stepped-inline mode).
/// A host verifier that counts allocations or blocking at DISPATCH_LEVEL
/// should attribute what happens then to the "hardware", not the driver:
/// the model allocates (packets, frames) where real hardware would not.
/// Event handlers the model calls run with this flag clear.
#[must_use]
pub fn device_model_active() -> bool {
    IN_MODEL.with(Cell::get)
}

fn in_model<R>(f: impl FnOnce() -> R) -> R {
    let was = IN_MODEL.with(|m| m.replace(true));
    let r = f();
    IN_MODEL.with(|m| m.set(was));
    r
}

/// State shared by the fabric, its HCAs and their doorbell registers.
pub(crate) struct Shared {
    world: Mutex<World>,
    /// Doorbells rung since the last engine pass took them, and the engine
    /// runs that will re-check for more (see the `engine_gate` module).
    gate: EngineGate,
    pub mode: ExecMode,
    inline: AtomicBool,
    clock: Clock,
    delivery: Mutex<()>,
    pub stop: AtomicBool,
    pub device_thread: std::sync::OnceLock<std::thread::Thread>,
    /// Thread mode: when the device thread will wake next (fabric clock,
    /// ns). Written and read under the world lock, so an engine run on a
    /// doorbell's thread that schedules something earlier (a retransmit
    /// timer, a delayed frame) knows to wake the device thread for it.
    device_wake_at: AtomicU64,
    pub bad_doorbells: AtomicU64,
}

impl Shared {
    pub fn new(mode: ExecMode, seed: u64, inline: bool) -> Self {
        Self {
            world: Mutex::new(World::new(seed)),
            gate: EngineGate::new(),
            mode,
            inline: AtomicBool::new(inline),
            clock: match mode {
                ExecMode::Thread => Clock::Real(Instant::now()),
                ExecMode::Stepped => Clock::Virtual(AtomicU64::new(0)),
            },
            delivery: Mutex::new(()),
            stop: AtomicBool::new(false),
            device_thread: std::sync::OnceLock::new(),
            device_wake_at: AtomicU64::new(0),
            bad_doorbells: AtomicU64::new(0),
        }
    }

    pub fn now(&self) -> u64 {
        match &self.clock {
            Clock::Virtual(t) => t.load(Ordering::Acquire),
            Clock::Real(start) => u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX),
        }
    }

    pub fn set_virtual_now(&self, ns: u64) {
        if let Clock::Virtual(t) = &self.clock {
            t.store(ns, Ordering::Release);
        }
    }

    pub fn set_inline(&self, on: bool) {
        self.inline.store(on, Ordering::SeqCst);
    }

    /// Locks the world (control commands: may block).
    pub fn lock(&self) -> MutexGuard<'_, World> {
        let mut w = self.world.lock().unwrap_or_else(PoisonError::into_inner);
        w.now = self.now();
        w
    }

    /// Releases the world after a control command: delivers the events it
    /// produced and lets the device catch up on doorbells it missed.
    pub fn unlock(&self, mut w: MutexGuard<'_, World>) {
        let events = std::mem::take(&mut w.events);
        drop(w);
        self.deliver(events);
        self.kick();
    }

    /// A doorbell was written: run or wake the device. Never blocks on the
    /// world lock.
    pub fn kick(&self) {
        self.gate.ring();
        let inline = self.inline.load(Ordering::SeqCst) && !IN_DEVICE.with(Cell::get);
        // Takes the free engine, or hands the doorbell over.
        if !(inline && self.run_engine(false)) {
            self.world_busy();
        }
    }

    /// A doorbell is pending and this thread will not run the engine for
    /// it (the world is busy, or it rang from an event handler). Thread
    /// mode: wakes the device thread unless an engine run is in progress
    /// that will re-check the doorbells before it finishes — the holder of
    /// the world may be a control command or a deadline query that lets go
    /// without running the engine (see the `engine_gate` module).
    fn world_busy(&self) {
        if self.mode == ExecMode::Thread && self.gate.busy_needs_wake() {
            self.wake_device();
        }
    }

    /// Thread mode: wakes the device thread (lock-free).
    pub fn wake_device(&self) {
        if let Some(t) = self.device_thread.get() {
            t.unpark();
        }
    }

    /// Runs the engine until idle if no other thread is running it; loops
    /// while doorbells keep arriving. With `wait`, blocks for the lock.
    /// Returns `false` if it did not get the world at all (without `wait`,
    /// another thread held it). A run that re-checks, finds a doorbell and
    /// then the world busy hands the doorbell over ([`Self::world_busy`]).
    pub fn run_engine(&self, wait: bool) -> bool {
        let mut ran = false;
        loop {
            let guard = if wait {
                Some(self.world.lock().unwrap_or_else(PoisonError::into_inner))
            } else {
                self.world.try_lock().ok()
            };
            let Some(mut w) = guard else {
                if ran {
                    self.world_busy();
                }
                return ran;
            };
            ran = true;
            let counted = self.gate.begin_run();
            self.gate.take_pending();
            w.now = self.now();
            in_model(|| w.run_until_idle());
            if self.mode == ExecMode::Thread && !self.on_device_thread() {
                // Run on a doorbell's thread: if it scheduled something
                // before the device thread's next wake, wake it now.
                let wake_at = self.device_wake_at.load(Ordering::Relaxed);
                if w.next_deadline().is_some_and(|t| t < wake_at) {
                    self.wake_device();
                }
            }
            let events = std::mem::take(&mut w.events);
            drop(w);
            self.deliver(events);
            drop(counted);
            if !self.gate.rang_since() {
                return ran;
            }
        }
    }

    fn on_device_thread(&self) -> bool {
        ON_DEVICE_THREAD.with(Cell::get)
    }

    /// Marks the calling thread as the fabric's device thread.
    pub fn enter_device_thread(&self) {
        ON_DEVICE_THREAD.with(|f| f.set(true));
    }

    /// The device thread's pause: until the next deadline (bounded), or
    /// until a doorbell or a link wakes it.
    pub fn device_thread_wait(&self) -> std::time::Duration {
        let w = self.lock();
        // The clock now, not the world's last engine run: the device
        // thread's own run may have found the world busy.
        let now = self.now();
        let wait = w
            .next_deadline()
            .map_or(2_000_000, |t| t.saturating_sub(now))
            .clamp(20_000, 2_000_000);
        self.device_wake_at
            .store(now.saturating_add(wait), Ordering::Relaxed);
        drop(w);
        std::time::Duration::from_nanos(wait)
    }

    /// One engine pass (stepped mode). Returns whether anything happened.
    pub fn step(&self) -> bool {
        let mut w = self.world.lock().unwrap_or_else(PoisonError::into_inner);
        w.now = self.now();
        let p = in_model(|| w.pass());
        let events = std::mem::take(&mut w.events);
        drop(w);
        self.deliver(events);
        p
    }

    fn deliver(&self, events: Vec<Event>) {
        if events.is_empty() {
            return;
        }
        let was = IN_DEVICE.with(|f| f.replace(true));
        let was_model = IN_MODEL.with(|m| m.replace(false));
        {
            let _g = self.delivery.lock().unwrap_or_else(PoisonError::into_inner);
            for e in events {
                match e {
                    Event::Completion(cq) => {
                        if cq.alive.load(Ordering::Acquire) {
                            cq.handler.completion_event(cq.cqn);
                        }
                    }
                    Event::Async(h, ev) => h.async_event(ev),
                }
            }
        }
        IN_DEVICE.with(|f| f.set(was));
        IN_MODEL.with(|m| m.set(was_model));
    }

    /// Waits until no event delivery is in progress (destroy_cq uses it so
    /// no event for a destroyed CQ runs after destroy returns).
    pub fn quiesce_delivery(&self) {
        if IN_DEVICE.with(Cell::get) {
            return;
        }
        drop(self.delivery.lock().unwrap_or_else(PoisonError::into_inner));
    }
}

#[cfg(test)]
mod tests {
    use super::super::payload::Pinned;
    use super::*;
    use crate::wire::{AethRepr, BthRepr, ImmDtRepr, Opcode, Operation, Psn, Qpn, RethRepr};

    fn gid(last: u8) -> Gid {
        Gid::from_ipv4(Ipv4Address([10, 0, 0, last]))
    }

    /// From `gid(1)` to `dst`, TTL 64, one UDP source port.
    fn route(dst: Gid, tos: u8) -> Route {
        Route::new(gid(1), dst, tos, 64, 0xc000)
    }

    fn bth(operation: Operation) -> BthRepr {
        BthRepr {
            opcode: Opcode::new(Transport::Rc, operation).unwrap(),
            solicited: true,
            mig_req: false,
            pkey: 0xffff,
            fecn: false,
            becn: false,
            dest_qp: Qpn::from_low_bits(0x12_3456),
            ack_req: true,
            psn: Psn::from_low_bits(0xff_fffe),
        }
    }

    /// The 4,200 bytes of `data` in two pieces of pinned memory (the first
    /// starting mid-word), and the buffers that hold them.
    fn pinned_copy(data: &[u8]) -> (Arc<Pinned>, Vec<crate::dma::DmaBuffer>) {
        let mem = super::super::mem::PhysMemory::new(1 << 20);
        let a = mem.alloc(3000).unwrap();
        let b = mem.alloc(2000).unwrap();
        a.write(5, &data[..2995]).unwrap();
        b.write(0, &data[2995..]).unwrap();
        let mut p = super::super::payload::pinned();
        let pm = Arc::get_mut(&mut p).unwrap();
        let (ra, oa) = mem.resolve(a.phys_addr().get() + 5, 2995).unwrap();
        let (rb, ob) = mem.resolve(b.phys_addr().get(), 1205).unwrap();
        pm.push(ra, oa, 2995);
        pm.push(rb, ob, 1205);
        (p, vec![a, b])
    }

    /// A port is found by its GID through the one-entry cache exactly as
    /// through the map: an unknown GID is not cached, and a GID that moves
    /// to another port is found at its new port.
    #[test]
    fn a_port_is_found_at_its_gid_after_it_moves() {
        let mut w = World::new(1);
        assert_eq!(w.port_of(gid(1)), None);
        w.add_port(gid(1), 0);
        w.add_port(gid(2), 1);
        assert_eq!(w.port_of(gid(1)), Some(0));
        assert_eq!(w.port_of(gid(1)), Some(0));
        assert_eq!(w.port_of(gid(2)), Some(1));
        assert_eq!(w.port_of(gid(3)), None);
        assert_eq!(w.port_of(gid(2)), Some(1));
        w.add_port(gid(2), 4);
        assert_eq!(w.port_of(gid(2)), Some(4), "the cached port moved");
        assert_eq!(w.port_of(gid(1)), Some(0));
    }

    /// A delivered direct frame lets go of its payload at once (the pinned
    /// memory is no longer held), and the next frame built in its pooled
    /// box carries its own headers and payload, not the old ones.
    #[test]
    fn a_recycled_direct_frame_releases_its_payload_and_reuses_its_box() {
        let data: Vec<u8> = (0..4200u32).map(|i| (i * 11 + 2) as u8).collect();
        let (pinned, _buffers) = pinned_copy(&data);
        let send = |r: Route, pkt: &IbPacketRepr<'_>, range: core::ops::Range<usize>| {
            let mut out = Outbox::default();
            let shared = SharedPayload {
                src: Source::Pinned(pinned.clone()),
                range,
            };
            out.send_shared(r, pkt, shared);
            let Some((_, Frame::Direct(d))) = out.frames.pop() else {
                panic!("a direct frame expected");
            };
            d
        };
        // The first frame sets every header field the second does not
        // carry or carries differently: the box is written in place, and
        // nothing of the old frame may survive in it.
        let mut first_pkt = IbPacketRepr::new(bth(Operation::RdmaWriteFirst), &[]);
        first_pkt.reth = Some(RethRepr {
            va: 0x1000,
            rkey: 0x77,
            dma_len: 8192,
        });
        let first_route = Route::new(gid(8), gid(9), 5, 3, 0xc0de);
        let first = send(first_route, &first_pkt, 0..4096);
        assert_eq!(Arc::strong_count(&pinned), 2);
        let first_at: *const DirectFrame = &*first;
        Frame::Direct(first).recycle();
        assert_eq!(Arc::strong_count(&pinned), 1, "the payload is released");
        let mut second_pkt = IbPacketRepr::new(bth(Operation::SendLastWithImmediate), &[]);
        second_pkt.immdt = Some(ImmDtRepr { data: 0x0bad_cafe });
        let second = send(route(gid(2), 0), &second_pkt, 100..200);
        assert_eq!(
            core::ptr::from_ref::<DirectFrame>(&second),
            first_at,
            "the box is reused"
        );
        let (headers, payload) = second.parts();
        let fresh = roce_frame(route(gid(2), 0), &second_pkt, &[]).unwrap();
        assert_eq!(headers, fresh, "the reused box holds the new frame only");
        assert_eq!(payload.to_vec().unwrap(), data[100..200]);
        drop(second);
        assert_eq!(Arc::strong_count(&pinned), 1);
    }

    /// A route frames its packets with the IPv4 addresses (and the MACs
    /// derived from them) of the GIDs it was built from, converted once by
    /// [`Route::new`]; a route with either GID not IPv4-mapped frames
    /// nothing, by bytes or by reference.
    #[test]
    fn a_route_frames_with_the_addresses_of_its_gids() {
        let pkt = IbPacketRepr::new(bth(Operation::SendOnly), &[1, 2, 3, 4]);
        for (src, dst) in [(gid(1), gid(2)), (gid(9), gid(8))] {
            let mut out = Outbox::default();
            out.send(Route::new(src, dst, 0, 64, 0xc000), &pkt);
            let Some((to, Frame::Bytes(b))) = out.frames.pop() else {
                panic!("one byte frame expected");
            };
            assert_eq!(to, dst);
            let parsed = RoceV2FrameRepr::parse(&b).unwrap();
            assert_eq!((parsed.src_gid(), parsed.dst_gid()), (src, dst));
            let (Some(s), Some(d)) = (src.to_ipv4(), dst.to_ipv4()) else {
                panic!("IPv4-mapped GIDs expected");
            };
            assert_eq!((parsed.src_mac, parsed.dst_mac), (mac_of(s), mac_of(d)));
        }
        let other = Gid([0xfe; 16]);
        for (src, dst) in [(other, gid(2)), (gid(1), other)] {
            let route = Route::new(src, dst, 0, 64, 0xc000);
            let mut out = Outbox::default();
            out.send(route, &pkt);
            let shared = SharedPayload {
                src: Source::Bytes(Arc::new(vec![5; 4])),
                range: 0..4,
            };
            out.send_shared(route, &IbPacketRepr::new(pkt.bth, &[]), shared);
            assert!(out.frames.is_empty());
            assert_eq!(out.unroutable, 2);
        }
    }

    /// A packet to a GID that is not IPv4-mapped is unroutable whether or
    /// not a pooled box is at hand, and the box it would have used stays in
    /// the pool for the next frame.
    #[test]
    fn an_unroutable_direct_frame_keeps_the_pooled_box() {
        let buf = Arc::new(vec![7u8; 64]);
        let pooled = || DIRECT_POOL.with(|p| p.borrow().len());
        let send = |out: &mut Outbox, to: Gid| {
            let shared = SharedPayload {
                src: Source::Bytes(buf.clone()),
                range: 0..64,
            };
            let pkt = IbPacketRepr::new(bth(Operation::SendOnly), &[]);
            out.send_shared(route(to, 0), &pkt, shared);
        };
        let mut out = Outbox::default();
        send(&mut out, gid(2));
        let Some((_, frame)) = out.frames.pop() else {
            panic!("a direct frame expected");
        };
        frame.recycle();
        let spare = pooled();
        assert!(spare >= 1);
        send(&mut out, Gid([0xfe; 16]));
        assert!(out.frames.is_empty());
        assert_eq!(out.unroutable, 1);
        assert_eq!(pooled(), spare, "the box went back to the pool");
        assert_eq!(Arc::strong_count(&buf), 1, "the payload is released");
    }

    /// A frame by reference to memory that is freed while the frame is on
    /// the wire reads the bytes the memory held when it was freed (the
    /// storage lives while the frame does; no one can write it any more);
    /// a revoked source, or a READ response whose key's generation moved,
    /// is no longer valid (the frame is then dropped as lost).
    #[test]
    fn a_frame_outlives_the_memory_it_references_safely() {
        let data: Vec<u8> = (0..4200u32).map(|i| (i * 5 + 1) as u8).collect();
        let (pinned, buffers) = pinned_copy(&data);
        let pkt = IbPacketRepr::new(bth(Operation::SendOnly), &[]);
        let mut out = Outbox::default();
        let shared = SharedPayload {
            src: Source::Pinned(pinned.clone()),
            range: 2900..3100,
        };
        out.send_shared(route(gid(2), 0), &pkt, shared);
        drop(buffers);
        let Some((_, Frame::Direct(d))) = out.frames.pop() else {
            panic!("a direct frame expected");
        };
        assert!(d.valid_payload().is_some());
        assert_eq!(d.parts().1.to_vec().unwrap(), data[2900..3100]);
        assert_eq!(
            RoceV2FrameRepr::parse(&d.emit().unwrap())
                .unwrap()
                .packet
                .payload,
            &data[2900..3100]
        );
        pinned.revoke();
        assert!(d.valid_payload().is_none());
        // A READ response's guard: valid until its key's generation moves.
        let generation = Arc::new(core::sync::atomic::AtomicU64::new(7));
        let mut guarded = super::super::payload::pinned();
        Arc::get_mut(&mut guarded).unwrap().guarded(&generation);
        let g = SharedPayload {
            src: Source::Pinned(guarded),
            range: 0..0,
        };
        assert!(g.valid());
        generation.fetch_add(1, core::sync::atomic::Ordering::Relaxed);
        assert!(!g.valid());
    }

    /// A frame sent by reference (gathered bytes or pinned memory) is,
    /// written out, byte for byte the frame `send` writes, and its bytes
    /// (ICRC verified) parse to the packet the receiver gets by reference;
    /// packets the emitter rejects take the byte path and are dropped as
    /// before.
    #[test]
    fn a_direct_frame_is_the_frame_the_emitter_writes() {
        let data: Vec<u8> = (0..4200u32).map(|i| (i * 7 + 3) as u8).collect();
        let buf = Arc::new(data.clone());
        let (pinned, _buffers) = pinned_copy(&data);
        let reth = RethRepr {
            va: 0x1234_5678_9abc,
            rkey: 0x55aa_0102,
            dma_len: 9001,
        };
        let mut first = IbPacketRepr::new(bth(Operation::RdmaWriteFirst), &[]);
        first.reth = Some(reth);
        let mut last_imm = IbPacketRepr::new(bth(Operation::RdmaWriteLastWithImmediate), &[]);
        last_imm.immdt = Some(ImmDtRepr { data: 0xdead_beef });
        let cases = [
            (first, 0..1024),
            (
                IbPacketRepr::new(bth(Operation::RdmaWriteMiddle), &[]),
                5..1029,
            ),
            (
                IbPacketRepr::new(bth(Operation::RdmaWriteMiddle), &[]),
                2990..3000,
            ),
            (last_imm, 3..4),
            (IbPacketRepr::new(bth(Operation::SendOnly), &[]), 0..0),
            (IbPacketRepr::new(bth(Operation::SendLast), &[]), 7..4103),
        ];
        for (pkt, range) in cases {
            for by_ref in [false, true] {
                let mut direct = Outbox::default();
                let src = if by_ref {
                    Source::Pinned(pinned.clone())
                } else {
                    Source::Bytes(buf.clone())
                };
                let shared = SharedPayload {
                    src,
                    range: range.clone(),
                };
                direct.send_shared(route(gid(2), 3), &pkt, shared);
                let mut full = pkt;
                full.payload = &buf[range.clone()];
                let mut bytes = Outbox::default();
                bytes.send(route(gid(2), 3), &full);
                let (Some((dg, Frame::Direct(d))), Some((bg, Frame::Bytes(b)))) =
                    (direct.frames.pop(), bytes.frames.pop())
                else {
                    panic!("one direct frame and one byte frame expected");
                };
                assert_eq!((dg, bg), (gid(2), gid(2)));
                let (headers, payload) = d.parts();
                let placed = payload.to_vec().unwrap();
                let mut repr = headers;
                repr.packet.payload = &placed;
                let parsed = RoceV2FrameRepr::parse(&b).unwrap();
                assert_eq!(parsed, repr, "{range:?} {by_ref}");
                assert_eq!(repr.packet, full);
                assert!(d.valid_payload().is_some());
                assert_eq!(Frame::Direct(d).into_bytes().unwrap(), b, "{range:?}");
            }
        }
        // An ACK with a payload is rejected by the emitter: no frame.
        let mut ack = IbPacketRepr::new(bth(Operation::Acknowledge), &[]);
        ack.aeth = Some(AethRepr {
            syndrome: crate::wire::AethSyndrome::Ack(crate::wire::CreditCount::INVALID),
            msn: crate::wire::Msn::from_low_bits(1),
        });
        let mut out = Outbox::default();
        let shared = SharedPayload {
            src: Source::Pinned(pinned.clone()),
            range: 0..8,
        };
        out.send_shared(route(gid(2), 0), &ack, shared);
        assert!(out.frames.is_empty());
        assert_eq!(out.unroutable, 1);
        // A GID that is not IPv4-mapped is unroutable either way.
        let shared = SharedPayload {
            src: Source::Bytes(buf),
            range: 0..8,
        };
        let pkt = IbPacketRepr::new(bth(Operation::SendOnly), &[]);
        out.send_shared(route(Gid([0xfe; 16]), 0), &pkt, shared);
        assert!(out.frames.is_empty());
        assert_eq!(out.unroutable, 2);
    }
}
