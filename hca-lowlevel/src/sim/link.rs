//! The Ethernet link of a software HCA port: RoCEv2 over a datagram socket
//! that carries one Ethernet frame per datagram, the way qemu's
//! `-netdev dgram` (and `-netdev socket,udp=`) delivers a guest NIC's
//! traffic.
//!
//! An HCA on such a link ([`super::Fabric::add_hca_on_link`]) is a RoCEv2
//! port on a small Ethernet segment, like an `rdma_rxe` device on a netdev:
//!
//! * **Transmit**: the engine's frames (Ethernet II, IPv4 with DF and the
//!   TTL from the path's hop limit, UDP 4791 with checksum 0 and rxe's
//!   source port — [`roce_udp_src_port`] of the path's flow label for a
//!   connected QP, [`rxe_udp_src_port`] of the QPN for a datagram QP — the
//!   IBA packet, the ICRC) get the port's
//!   MAC as source and the peer's MAC, resolved by **ARP**, as destination.
//!   The first frame to an unknown IPv4 address starts a resolution: a
//!   broadcast request now and again every `arp_retry_interval`, up to
//!   `arp_attempts` requests; frames to that address wait in a bounded queue
//!   and leave, in order, when the reply arrives, or are dropped (and
//!   counted) when the attempts run out. RC retransmission recovers from
//!   that like from any loss. Frames larger than the link's IP MTU are
//!   dropped as a DF-set datagram would be.
//! * **Receive**: ARP requests for the port's address are **answered**
//!   (and teach the sender's MAC, as Linux does); replies resolve pending
//!   entries. A frame is handed to the HCA only if it is addressed to the
//!   port's MAC and IPv4 address and to UDP port 4791; the HCA then checks
//!   IPv4, UDP, the ICRC and the transport headers. Everything else —
//!   other MACs, other IPs, other UDP ports, IPv6, malformed frames, bad
//!   ICRCs — is dropped and counted in [`LinkStats`], never panicked on.
//! * **Capture**: optionally every frame sent and received goes to a pcap
//!   file ([`LinkConfig::pcap`]) that `tshark -r` decodes as RoCE.
//!
//! The socket is abstract ([`FrameSocket`]): a `UnixDatagram` or
//! `UdpSocket` for qemu, or one end of an in-process [`channel_pair`] for
//! tests. In [`super::ExecMode::Thread`] a reader thread per link blocks on
//! the socket and wakes the device; in [`super::ExecMode::Stepped`] the
//! engine polls the socket on every pass, so a test that feeds frames in
//! and runs the fabric is deterministic, and ARP timeouts run on the
//! virtual clock.

use std::collections::{BTreeMap, VecDeque};
use std::fs::File;
use std::io::{self, BufWriter};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use crate::device::Mtu;
use crate::wire::{
    ArpOperation, ArpPacket, ArpRepr, EtherType, EthernetAddress, EthernetFrame, IpProtocol,
    Ipv4Address, Ipv4Packet, ROCEV2_UDP_PORT, UdpPacket, emit_arp_frame,
};

use super::pcap::PcapWriter;
use super::world::Shared;

/// Largest datagram a link reads (a frame is never longer).
pub const MAX_FRAME_LEN: usize = 65_536;
/// Shortest Ethernet frame without FCS; shorter frames we send are padded.
pub const MIN_FRAME_LEN: usize = 60;
/// Frames a thread-mode link buffers between engine passes before it
/// drops (and counts) new arrivals, like a full NIC receive ring.
const INBOX_LIMIT: usize = 4096;
/// Frames a stepped-mode link reads from its socket per engine pass.
const RX_BURST: usize = 256;
/// How long a reader thread blocks on its socket before it checks whether
/// the fabric is stopping.
const READER_WAIT: Duration = Duration::from_millis(50);
/// Offset of the MAC addresses, the only bytes a link rewrites (the ICRC
/// does not cover the Ethernet header).
const MACS: core::ops::Range<usize> = 0..12;
/// Length of the Ethernet II header.
const ETH_HEADER_LEN: usize = 14;

/// A datagram socket carrying one Ethernet frame per datagram.
///
/// Implementations must be usable from two threads at once: in thread mode
/// a reader thread blocks in [`FrameSocket::recv`] while the device engine
/// calls [`FrameSocket::send`].
pub trait FrameSocket: Send + Sync {
    /// Sends one frame. A full peer queue may block briefly; a dead peer is
    /// an error (the link counts it; the frame is lost).
    ///
    /// # Errors
    /// The socket's.
    fn send(&self, frame: &[u8]) -> io::Result<()>;

    /// Receives one frame into `buf` (truncated to it), waiting at most
    /// `wait` for one to arrive; `Duration::ZERO` only polls. `Ok(None)`
    /// when none arrived in time.
    ///
    /// # Errors
    /// The socket's (other than "would block" and "timed out").
    fn recv(&self, buf: &mut [u8], wait: Duration) -> io::Result<Option<usize>>;
}

/// Receives on a std datagram socket with the `FrameSocket` wait rule.
macro_rules! datagram_socket_recv {
    ($sock:expr, $buf:expr, $wait:expr) => {{
        let sock = $sock;
        let r = if $wait.is_zero() {
            sock.set_nonblocking(true)?;
            let r = sock.recv($buf);
            sock.set_nonblocking(false)?;
            r
        } else {
            sock.set_read_timeout(Some($wait))?;
            sock.recv($buf)
        };
        match r {
            Ok(n) => Ok(Some(n)),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) =>
            {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }};
}

/// qemu `-netdev dgram,local.type=unix,...`: the socket must be connected
/// to qemu's end (as `kverbs_tools::vm::Vm::take_link` hands it out).
#[cfg(unix)]
impl FrameSocket for std::os::unix::net::UnixDatagram {
    fn send(&self, frame: &[u8]) -> io::Result<()> {
        std::os::unix::net::UnixDatagram::send(self, frame).map(|_| ())
    }

    fn recv(&self, buf: &mut [u8], wait: Duration) -> io::Result<Option<usize>> {
        datagram_socket_recv!(self, buf, wait)
    }
}

/// qemu `-netdev dgram` over inet or `-netdev socket,udp=`: the socket must
/// be connected to qemu's address.
impl FrameSocket for std::net::UdpSocket {
    fn send(&self, frame: &[u8]) -> io::Result<()> {
        std::net::UdpSocket::send(self, frame).map(|_| ())
    }

    fn recv(&self, buf: &mut [u8], wait: Duration) -> io::Result<Option<usize>> {
        datagram_socket_recv!(self, buf, wait)
    }
}

/// One end of an in-process datagram link (see [`channel_pair`]).
pub struct ChannelSocket {
    tx: mpsc::Sender<Vec<u8>>,
    rx: Mutex<mpsc::Receiver<Vec<u8>>>,
}

/// Two connected in-process frame sockets: what one sends, the other
/// receives, in order, without loss.
#[must_use]
pub fn channel_pair() -> (ChannelSocket, ChannelSocket) {
    let (a_tx, b_rx) = mpsc::channel();
    let (b_tx, a_rx) = mpsc::channel();
    (
        ChannelSocket {
            tx: a_tx,
            rx: Mutex::new(a_rx),
        },
        ChannelSocket {
            tx: b_tx,
            rx: Mutex::new(b_rx),
        },
    )
}

impl FrameSocket for ChannelSocket {
    fn send(&self, frame: &[u8]) -> io::Result<()> {
        self.tx
            .send(frame.to_vec())
            .map_err(|_| io::Error::from(io::ErrorKind::BrokenPipe))
    }

    fn recv(&self, buf: &mut [u8], wait: Duration) -> io::Result<Option<usize>> {
        let rx = self.rx.lock().unwrap_or_else(PoisonError::into_inner);
        let frame = if wait.is_zero() {
            match rx.try_recv() {
                Ok(f) => f,
                Err(mpsc::TryRecvError::Empty) => return Ok(None),
                Err(mpsc::TryRecvError::Disconnected) => {
                    return Err(io::ErrorKind::BrokenPipe.into());
                }
            }
        } else {
            match rx.recv_timeout(wait) {
                Ok(f) => f,
                Err(mpsc::RecvTimeoutError::Timeout) => return Ok(None),
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(io::ErrorKind::BrokenPipe.into());
                }
            }
        };
        let n = frame.len().min(buf.len());
        if let (Some(dst), Some(src)) = (buf.get_mut(..n), frame.get(..n)) {
            dst.copy_from_slice(src);
        }
        Ok(Some(n))
    }
}

/// How a port's Ethernet link behaves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinkConfig {
    /// The port's MAC (unicast). The node GUID is its EUI-64, as rxe makes it.
    pub mac: EthernetAddress,
    /// IP MTU of the link (the netdev MTU): frames with a longer IPv4
    /// datagram are dropped, as DF-set datagrams are. The port's active
    /// MTU becomes the largest IB MTU that fits (`iboe_get_mtu`): 1024 on
    /// 1500-byte Ethernet.
    pub ip_mtu: u16,
    /// Wait between ARP requests for an unanswered address.
    pub arp_retry_interval: Duration,
    /// ARP requests sent for one address before its waiting frames are
    /// dropped (the next frame to it starts over).
    pub arp_attempts: u32,
    /// Frames that may wait for one address to resolve; beyond it the
    /// oldest is dropped (Linux `unres_qlen`).
    pub arp_queue_len: usize,
    /// Write every frame sent and received to this pcap file (created, or
    /// truncated).
    pub pcap: Option<PathBuf>,
}

impl LinkConfig {
    /// A 1500-byte link with Linux's ARP timing (1 s, 3 requests).
    #[must_use]
    pub fn new(mac: EthernetAddress) -> Self {
        Self {
            mac,
            ip_mtu: 1500,
            arp_retry_interval: Duration::from_secs(1),
            arp_attempts: 3,
            arp_queue_len: 64,
            pcap: None,
        }
    }

    /// The largest IB path MTU whose RoCEv2 packets fit the IP MTU
    /// (Linux `iboe_get_mtu`: IP MTU minus 96 bytes of IPv6/UDP/BTH/
    /// extension-header/ICRC headroom, rounded down to an IB MTU).
    #[must_use]
    pub fn ib_mtu(&self) -> Option<Mtu> {
        let room = u32::from(self.ip_mtu).checked_sub(96)?;
        [
            Mtu::Mtu4096,
            Mtu::Mtu2048,
            Mtu::Mtu1024,
            Mtu::Mtu512,
            Mtu::Mtu256,
        ]
        .into_iter()
        .find(|m| m.bytes() <= room)
    }
}

/// Counters of one link. Every frame received ends up in exactly one `rx_*`
/// outcome; every frame the engine hands the link ends up sent, waiting for
/// ARP, or in one `tx_*` drop counter.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct LinkStats {
    /// Frames read from the socket.
    pub rx_frames: u64,
    /// RoCEv2 frames handed to the HCA that it accepted.
    pub rx_delivered: u64,
    /// ARP requests for our address, answered.
    pub rx_arp_requests: u64,
    /// ARP replies to us.
    pub rx_arp_replies: u64,
    /// Other ARP traffic (requests for other addresses, unsolicited).
    pub rx_arp_other: u64,
    /// Frames to another MAC (or an Ethernet multicast other than ARP).
    pub rx_foreign_mac: u64,
    /// IPv4 frames to another address.
    pub rx_foreign_ip: u64,
    /// Frames neither ARP nor IPv4 (IPv6 neighbour discovery, LLDP...).
    pub rx_non_ipv4: u64,
    /// IPv4 for us that is not UDP to port 4791.
    pub rx_not_roce: u64,
    /// RoCEv2 frames whose ICRC did not verify.
    pub rx_bad_icrc: u64,
    /// Frames that failed to parse (Ethernet, ARP, IPv4, UDP, IBA headers).
    pub rx_malformed: u64,
    /// RoCEv2 frames for no QP of ours (or while the port is down).
    pub rx_unroutable: u64,
    /// Frames dropped because the engine fell behind (thread mode).
    pub rx_overflow: u64,
    /// Socket receive errors.
    pub rx_errors: u64,
    /// Frames written to the socket (ARP included).
    pub tx_frames: u64,
    /// ARP requests sent.
    pub tx_arp_requests: u64,
    /// ARP replies sent.
    pub tx_arp_replies: u64,
    /// Frames that had to wait for an ARP reply.
    pub tx_waited_for_arp: u64,
    /// Frames dropped because their address never resolved.
    pub tx_unresolved: u64,
    /// Frames dropped from a full ARP wait queue.
    pub tx_queue_overflow: u64,
    /// Frames dropped for exceeding the IP MTU.
    pub tx_oversize: u64,
    /// Frames to an address a link cannot reach (ours, broadcast, not IPv4).
    pub tx_unroutable: u64,
    /// Socket send errors (the frame is lost).
    pub tx_errors: u64,
    /// Address resolutions that ran out of attempts.
    pub arp_failures: u64,
}

/// What the HCA made of a RoCEv2 frame a link handed it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Delivery {
    /// A QP took it.
    Delivered,
    /// The ICRC did not verify.
    BadIcrc,
    /// It did not parse.
    Malformed,
    /// No QP, or the port is down.
    Unroutable,
}

/// Frames a reader thread has read and the engine not yet processed.
#[derive(Default)]
pub(crate) struct Inbox {
    frames: Mutex<VecDeque<Vec<u8>>>,
    overflow: AtomicU64,
    errors: AtomicU64,
}

impl Inbox {
    fn push(&self, frame: Vec<u8>) {
        let mut q = self.frames.lock().unwrap_or_else(PoisonError::into_inner);
        if q.len() >= INBOX_LIMIT {
            self.overflow.fetch_add(1, Ordering::Relaxed);
        } else {
            q.push_back(frame);
        }
    }

    fn take(&self) -> VecDeque<Vec<u8>> {
        std::mem::take(&mut *self.frames.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

/// The body of a thread-mode link's reader thread.
pub(crate) fn reader_thread(socket: &Arc<dyn FrameSocket>, inbox: &Inbox, shared: &Weak<Shared>) {
    let mut buf = vec![0u8; MAX_FRAME_LEN];
    loop {
        match shared.upgrade() {
            Some(s) if !s.stop.load(Ordering::SeqCst) => {}
            _ => return,
        }
        match socket.recv(&mut buf, READER_WAIT) {
            Ok(Some(n)) => {
                inbox.push(buf.get(..n).unwrap_or(&[]).to_vec());
                if let Some(s) = shared.upgrade() {
                    s.kick();
                }
            }
            Ok(None) => {}
            Err(_) => {
                inbox.errors.fetch_add(1, Ordering::Relaxed);
                // A broken socket fails at once: do not spin on it.
                std::thread::sleep(READER_WAIT);
            }
        }
    }
}

enum Neighbor {
    Reachable(EthernetAddress),
    Incomplete {
        waiting: VecDeque<Vec<u8>>,
        requests_sent: u32,
        next_request_at: u64,
    },
}

/// The link state of one port (lives in the world, under its lock).
pub(crate) struct EthLink {
    socket: Arc<dyn FrameSocket>,
    inbox: Option<Arc<Inbox>>,
    mac: EthernetAddress,
    ip: Ipv4Address,
    ip_mtu: usize,
    arp_retry_ns: u64,
    arp_attempts: u32,
    arp_queue_len: usize,
    neighbors: BTreeMap<Ipv4Address, Neighbor>,
    stats: LinkStats,
    pcap: Option<PcapWriter<BufWriter<File>>>,
    pcap_dirty: bool,
    pcap_epoch_ns: u64,
    rx_buf: Vec<u8>,
}

fn duration_ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl EthLink {
    /// A link for the port at `ip`. `inbox` is `Some` in thread mode (a
    /// reader thread fills it); pcap timestamps are `pcap_epoch_ns` plus
    /// the fabric clock.
    pub fn new(
        ip: Ipv4Address,
        cfg: &LinkConfig,
        socket: Arc<dyn FrameSocket>,
        inbox: Option<Arc<Inbox>>,
        pcap_epoch_ns: u64,
    ) -> io::Result<Self> {
        let pcap = match &cfg.pcap {
            Some(path) => Some(PcapWriter::new(BufWriter::new(File::create(path)?))?),
            None => None,
        };
        Ok(Self {
            socket,
            inbox,
            mac: cfg.mac,
            ip,
            ip_mtu: usize::from(cfg.ip_mtu),
            arp_retry_ns: duration_ns(cfg.arp_retry_interval).max(1),
            arp_attempts: cfg.arp_attempts.max(1),
            arp_queue_len: cfg.arp_queue_len.max(1),
            neighbors: BTreeMap::new(),
            stats: LinkStats::default(),
            pcap,
            pcap_dirty: false,
            pcap_epoch_ns,
            rx_buf: Vec::new(),
        })
    }

    /// The port's MAC.
    pub fn mac(&self) -> EthernetAddress {
        self.mac
    }

    /// Counters (the reader thread's included).
    pub fn stats(&self) -> LinkStats {
        let mut s = self.stats;
        if let Some(inbox) = &self.inbox {
            s.rx_overflow += inbox.overflow.load(Ordering::Relaxed);
            s.rx_errors += inbox.errors.load(Ordering::Relaxed);
        }
        s
    }

    /// The resolved neighbours.
    pub fn neighbors(&self) -> Vec<(Ipv4Address, EthernetAddress)> {
        self.neighbors
            .iter()
            .filter_map(|(ip, n)| match n {
                Neighbor::Reachable(mac) => Some((*ip, *mac)),
                Neighbor::Incomplete { .. } => None,
            })
            .collect()
    }

    fn capture(&mut self, now: u64, frame: &[u8]) {
        if let Some(w) = &mut self.pcap {
            if w.write_frame(self.pcap_epoch_ns.saturating_add(now), frame)
                .is_err()
            {
                // A capture that cannot be written stops; the link goes on.
                self.pcap = None;
            }
            self.pcap_dirty = true;
        }
    }

    /// Writes buffered capture records out (once per engine pass).
    pub fn flush_capture(&mut self) {
        if self.pcap_dirty {
            self.pcap_dirty = false;
            if let Some(w) = &mut self.pcap {
                if w.flush().is_err() {
                    self.pcap = None;
                }
            }
        }
    }

    fn put_on_wire(&mut self, now: u64, frame: &[u8]) {
        self.capture(now, frame);
        match self.socket.send(frame) {
            Ok(()) => self.stats.tx_frames += 1,
            Err(_) => self.stats.tx_errors += 1,
        }
    }

    fn send_to(&mut self, now: u64, mac: EthernetAddress, mut frame: Vec<u8>) {
        if let Some(hdr) = frame.get_mut(MACS) {
            let (dst, src) = hdr.split_at_mut(6);
            dst.copy_from_slice(&mac.0);
            src.copy_from_slice(&self.mac.0);
        }
        if frame.len() < MIN_FRAME_LEN {
            frame.resize(MIN_FRAME_LEN, 0);
        }
        self.put_on_wire(now, &frame);
    }

    fn send_arp(&mut self, now: u64, dst: EthernetAddress, arp: &ArpRepr) {
        let mut frame = vec![0u8; MIN_FRAME_LEN];
        if emit_arp_frame(self.mac, dst, arp, &mut frame).is_ok() {
            match arp.operation {
                ArpOperation::Request => self.stats.tx_arp_requests += 1,
                ArpOperation::Reply => self.stats.tx_arp_replies += 1,
            }
            self.put_on_wire(now, &frame);
        }
    }

    fn request(&mut self, now: u64, target: Ipv4Address) {
        let arp = ArpRepr::request(self.mac, self.ip, target);
        self.send_arp(now, EthernetAddress::BROADCAST, &arp);
    }

    /// Sends an engine frame (built with placeholder MACs) to `dst`,
    /// resolving its MAC first if need be.
    pub fn transmit(&mut self, now: u64, dst: Ipv4Address, frame: Vec<u8>) {
        if dst == self.ip || !dst.is_unicast() {
            self.stats.tx_unroutable += 1;
            return;
        }
        if frame.len().saturating_sub(ETH_HEADER_LEN) > self.ip_mtu {
            self.stats.tx_oversize += 1;
            return;
        }
        match self.neighbors.get_mut(&dst) {
            Some(Neighbor::Reachable(mac)) => {
                let mac = *mac;
                self.send_to(now, mac, frame);
            }
            Some(Neighbor::Incomplete { waiting, .. }) => {
                if waiting.len() >= self.arp_queue_len {
                    waiting.pop_front();
                    self.stats.tx_queue_overflow += 1;
                }
                waiting.push_back(frame);
                self.stats.tx_waited_for_arp += 1;
            }
            None => {
                self.neighbors.insert(
                    dst,
                    Neighbor::Incomplete {
                        waiting: VecDeque::from([frame]),
                        requests_sent: 1,
                        next_request_at: now.saturating_add(self.arp_retry_ns),
                    },
                );
                self.stats.tx_waited_for_arp += 1;
                self.request(now, dst);
            }
        }
    }

    /// Records that `ip` is at `mac`, sending whatever waited for it.
    /// With `create` false only an entry that exists is updated (RFC 826
    /// merge rule for ARP traffic that does not concern us).
    fn learn(&mut self, now: u64, ip: Ipv4Address, mac: EthernetAddress, create: bool) {
        if !ip.is_unicast() || ip == self.ip || !mac.is_unicast() || mac == self.mac {
            return;
        }
        let old = match self.neighbors.get(&ip) {
            None if !create => return,
            _ => self.neighbors.insert(ip, Neighbor::Reachable(mac)),
        };
        if let Some(Neighbor::Incomplete { waiting, .. }) = old {
            for frame in waiting {
                self.send_to(now, mac, frame);
            }
        }
    }

    /// Retries or gives up resolutions that are due. Returns progress.
    pub fn on_timer(&mut self, now: u64) -> bool {
        let due: Vec<Ipv4Address> = self
            .neighbors
            .iter()
            .filter_map(|(ip, n)| match n {
                Neighbor::Incomplete {
                    next_request_at, ..
                } if *next_request_at <= now => Some(*ip),
                _ => None,
            })
            .collect();
        for ip in &due {
            let give_up = match self.neighbors.get_mut(ip) {
                Some(Neighbor::Incomplete {
                    requests_sent,
                    next_request_at,
                    ..
                }) => {
                    if *requests_sent >= self.arp_attempts {
                        true
                    } else {
                        *requests_sent += 1;
                        *next_request_at = now.saturating_add(self.arp_retry_ns);
                        false
                    }
                }
                _ => continue,
            };
            if give_up {
                if let Some(Neighbor::Incomplete { waiting, .. }) = self.neighbors.remove(ip) {
                    self.stats.tx_unresolved += waiting.len() as u64;
                }
                self.stats.arp_failures += 1;
            } else {
                self.request(now, *ip);
            }
        }
        !due.is_empty()
    }

    /// When the next resolution retry is due.
    pub fn next_deadline(&self) -> Option<u64> {
        self.neighbors
            .values()
            .filter_map(|n| match n {
                Neighbor::Incomplete {
                    next_request_at, ..
                } => Some(*next_request_at),
                Neighbor::Reachable(_) => None,
            })
            .min()
    }

    /// Frames that arrived since the last call: the reader thread's inbox,
    /// or (stepped mode) a bounded poll of the socket.
    pub fn take_received(&mut self) -> VecDeque<Vec<u8>> {
        if let Some(inbox) = &self.inbox {
            return inbox.take();
        }
        if self.rx_buf.len() < MAX_FRAME_LEN {
            self.rx_buf.resize(MAX_FRAME_LEN, 0);
        }
        let mut out = VecDeque::new();
        for _ in 0..RX_BURST {
            match self.socket.recv(&mut self.rx_buf, Duration::ZERO) {
                Ok(Some(n)) => out.push_back(self.rx_buf.get(..n).unwrap_or(&[]).to_vec()),
                Ok(None) => break,
                Err(_) => {
                    self.stats.rx_errors += 1;
                    break;
                }
            }
        }
        out
    }

    /// Takes in one received frame: answers or learns from ARP, drops what
    /// is not for this port. Returns true for a RoCEv2 frame the HCA must
    /// check and deliver (then report with [`Self::delivered`]).
    pub fn receive(&mut self, now: u64, frame: &[u8]) -> bool {
        self.stats.rx_frames += 1;
        self.capture(now, frame);
        let Ok(eth) = EthernetFrame::new_checked(frame) else {
            self.stats.rx_malformed += 1;
            return false;
        };
        let dst = eth.destination();
        let ethertype = eth.ethertype();
        let for_us = dst == self.mac || (dst.is_broadcast() && ethertype == EtherType::ARP);
        if !for_us {
            self.stats.rx_foreign_mac += 1;
            return false;
        }
        match ethertype {
            EtherType::ARP => {
                self.receive_arp(now, eth.source(), eth.payload());
                false
            }
            EtherType::IPV4 => self.accept_ipv4(eth.payload()),
            _ => {
                self.stats.rx_non_ipv4 += 1;
                false
            }
        }
    }

    fn receive_arp(&mut self, now: u64, eth_src: EthernetAddress, payload: &[u8]) {
        let arp = match ArpPacket::new_checked(payload).and_then(|p| ArpRepr::parse(&p)) {
            Ok(a) => a,
            Err(_) => {
                self.stats.rx_malformed += 1;
                return;
            }
        };
        let sender = (arp.source_protocol_addr, arp.source_hardware_addr);
        if arp.target_protocol_addr != self.ip {
            self.stats.rx_arp_other += 1;
            self.learn(now, sender.0, sender.1, false);
            return;
        }
        match arp.operation {
            ArpOperation::Request => {
                self.stats.rx_arp_requests += 1;
                self.learn(now, sender.0, sender.1, true);
                if let Some(reply) = arp.reply_for(self.mac, self.ip) {
                    let dst = if eth_src.is_unicast() {
                        eth_src
                    } else {
                        arp.source_hardware_addr
                    };
                    self.send_arp(now, dst, &reply);
                }
            }
            ArpOperation::Reply => {
                // Like Linux with arp_accept=0: a reply resolves (or
                // refreshes) an entry we have, it does not create one.
                self.stats.rx_arp_replies += 1;
                self.learn(now, sender.0, sender.1, false);
            }
        }
    }

    /// Cheap header checks before the HCA's full parse: our address, UDP,
    /// port 4791. The HCA verifies lengths, checksums and the ICRC.
    fn accept_ipv4(&mut self, payload: &[u8]) -> bool {
        let Ok(ip) = Ipv4Packet::new_checked(payload) else {
            self.stats.rx_malformed += 1;
            return false;
        };
        if ip.dst_addr() != self.ip {
            self.stats.rx_foreign_ip += 1;
            return false;
        }
        if ip.protocol() != IpProtocol::UDP {
            self.stats.rx_not_roce += 1;
            return false;
        }
        let udp_at = ip.header_len();
        let Ok(udp) = UdpPacket::new_checked(payload.get(udp_at..).unwrap_or(&[])) else {
            self.stats.rx_malformed += 1;
            return false;
        };
        if udp.dst_port() != ROCEV2_UDP_PORT {
            self.stats.rx_not_roce += 1;
            return false;
        }
        true
    }

    /// What the HCA made of a frame [`Self::receive`] accepted.
    pub fn delivered(&mut self, outcome: Delivery) {
        let c = match outcome {
            Delivery::Delivered => &mut self.stats.rx_delivered,
            Delivery::BadIcrc => &mut self.stats.rx_bad_icrc,
            Delivery::Malformed => &mut self.stats.rx_malformed,
            Delivery::Unroutable => &mut self.stats.rx_unroutable,
        };
        *c += 1;
    }
}

/// The UDP source port rxe gives a datagram QP's packets (QP1 included):
/// `0xC000` plus 14 bits of the kernel's multiplicative `hash_32` of the
/// QPN (`rxe_qp_init_req`), so that one QP is one flow for ECMP and
/// receive-side scaling. Connected QPs use [`roce_udp_src_port`] instead.
#[must_use]
pub fn rxe_udp_src_port(qpn: u32) -> u16 {
    const GOLDEN_RATIO_32: u32 = 0x61c8_8647;
    let hash = qpn.wrapping_mul(GOLDEN_RATIO_32) >> (32 - 14);
    // CAST: 14 bits.
    0xc000 | (hash & 0x3fff) as u16
}

/// The UDP source port of a connected QP's packets, as Linux (and rxe,
/// once the QP has its path) computes it: from the path's flow label, or if
/// that is 0 from the two QPNs (`rdma_calc_flow_label`), folded into the
/// dynamic port range (`rdma_flow_label_to_udp_sport`).
#[must_use]
pub fn roce_udp_src_port(flow_label: u32, local_qpn: u32, remote_qpn: u32) -> u16 {
    let flow_label = match flow_label & 0xf_ffff {
        0 => {
            let mut v = u64::from(local_qpn) * u64::from(remote_qpn);
            v ^= v >> 20;
            v ^= v >> 40;
            // CAST: masked to 20 bits.
            (v & 0xf_ffff) as u32
        }
        fl => fl,
    };
    let low = (flow_label & 0x3fff) ^ ((flow_label & 0xf_c000) >> 14);
    // CAST: 14 bits.
    0xc000 | low as u16
}
