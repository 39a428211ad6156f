//! The software HCA: a device model that executes what is posted on its
//! rings, moves IBA transport packets (as RoCEv2 frames, ICRC included)
//! across an in-process fabric, and completes work with the right CQEs.
//! On a plain in-process link (no fault configuration, no capture, no
//! Ethernet link) the data packets of RC SENDs and WRITEs and the RDMA READ
//! responses go as headers and a reference to the sender's own memory,
//! pinned, never written out ([`FabricStats::frames_direct`]): the
//! receiver's placement is the one copy of each byte (see the `payload`
//! module for when the source is read and why that is within verbs
//! semantics). Anything that looks at frames gets them in full.
//!
//! * [`Fabric`]: the world — any number of [`SoftHca`]s addressed by
//!   IPv4-mapped GIDs, the links between them (with seeded fault injection),
//!   the clock, and the execution mode ([`ExecMode`]).
//! * [`SoftHca`]: implements [`HcaDevice`]; control commands lock the world
//!   (they "wait for firmware"), the data path is the rings it hands out.
//! * [`testkit`]: raw WQE posting and CQE polling for this crate's tests.
//! * [`link`]: the second kind of port link — RoCEv2 over raw Ethernet
//!   frames on a datagram socket (qemu `-netdev dgram`, or an in-process
//!   [`channel_pair`]), with ARP and optional pcap capture ([`pcap`]).
//!
//! Protection is stricter than lax hardware: PD, lkey/rkey (including a
//! rotated key byte), access rights and bounds are checked on every access;
//! the reserved lkey works only locally; freed memory is unreachable.
//!
//! In stepped mode nothing runs until the test says so
//! ([`Fabric::run_until_idle`], [`Fabric::step`], [`Fabric::advance`]) —
//! or, with [`Fabric::set_inline_doorbells`], inside the doorbell write
//! itself, so a completion event can arrive before the posting routine
//! returns. Timeouts use a virtual clock there, so they are deterministic.

mod engine_gate;
mod fault;
pub mod link;
mod mem;
mod payload;
pub mod pcap;
mod qp;
mod resources;
pub mod testkit;
mod world;

#[cfg(test)]
mod link_tests;
#[cfg(test)]
mod one_copy_tests;
#[cfg(test)]
mod tests;

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

use crate::device::{
    AccessFlags, AsyncEventHandler, CqEventHandler, CqResources, DeviceAttr, Gid, HcaDevice,
    HcaError, ModifyError, MrKeys, MrRegistration, Mtu, Pdn, PortAttr, PortState, QpAttr,
    QpAttrMask, QpCaps, QpInit, QpResources, QpType, check_modify,
};
use crate::dma::{DmaAllocator, DmaBuffer};
use crate::doorbell::{CqDoorbellRecord, DBR_LEN, QpDoorbellRecord};
use crate::ring::{CqRing, MAX_RECV_STRIDE, RecvRing, SendRing};
use crate::wire::{EthernetAddress, Ipv4Address};
use crate::wqe::{MAX_PAGE_SHIFT, MAX_REG_PAGES, MAX_SEND_SGE, MIN_PAGE_SHIFT, WQEBB_SIZE};

pub use fault::FaultConfig;
pub use link::{
    ChannelSocket, FrameSocket, LinkConfig, LinkStats, channel_pair, roce_udp_src_port,
    rxe_udp_src_port,
};
pub use mem::{PAGE_SIZE, PhysMemory, SimDmaAllocator};
pub use qp::{GRH_LEN, QpStats};
pub use resources::RESERVED_LKEY;
pub use world::{CapturedFrame, ExecMode, FabricStats, device_model_active};

use mem::DeviceMem;
use qp::{Qp, QpDoorbellShared, SqDoorbell};
use resources::{Cq, CqDoorbell, CqShared, FIRST_MKEY_INDEX, Mr};
use world::{Hca, Outbox, Shared};

/// Device limits of every software HCA.
pub const LIMITS: DeviceAttr = DeviceAttr {
    node_guid: 0,
    phys_port_cnt: 1,
    max_qp: 1 << 16,
    max_qp_wr: 1 << 15,
    max_send_sge: MAX_SEND_SGE as u32,
    max_recv_sge: 16,
    max_inline_data: 896,
    max_cq: 1 << 16,
    max_cqe: 1 << 22,
    max_pd: 1 << 16,
    max_mr: 1 << 20,
    max_mr_size: 1 << 40,
    max_fast_reg_page_list_len: MAX_REG_PAGES as u32,
    max_qp_rd_atom: 16,
    max_qp_init_rd_atom: 16,
    reserved_lkey: RESERVED_LKEY,
};

/// How to build a fabric.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct FabricConfig {
    /// Device thread or stepped.
    pub mode: ExecMode,
    /// Seed of every random decision (fault injection).
    pub seed: u64,
    /// A doorbell runs the engine on the thread that rang it when no other
    /// thread is running it, so the work it posted (and whatever that
    /// causes on the other HCAs, up to their completion events) is done
    /// before the doorbell write returns, with no thread switch.
    ///
    /// In [`ExecMode::Thread`] the device thread stays: it runs the
    /// timers (retransmits, delayed frames), a link's input, and the
    /// doorbells that find the engine busy. Off, every doorbell wakes the
    /// device thread (one more thread hop each way). In
    /// [`ExecMode::Stepped`] this is the initial
    /// [`Fabric::set_inline_doorbells`] setting.
    pub inline_doorbells: bool,
}

impl Default for FabricConfig {
    fn default() -> Self {
        Self {
            mode: ExecMode::Stepped,
            seed: 0,
            inline_doorbells: false,
        }
    }
}

impl FabricConfig {
    /// A thread-mode fabric (a device thread, real time) with `seed`,
    /// doorbells waking the device thread.
    #[must_use]
    pub const fn threaded(seed: u64) -> Self {
        Self {
            mode: ExecMode::Thread,
            seed,
            inline_doorbells: false,
        }
    }
}

/// How to build one software HCA.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct HcaConfig {
    /// The port's IPv4 address (its GID is `::ffff:ip`).
    pub ip: [u8; 4],
    /// The port's active MTU.
    pub mtu: Mtu,
    /// Most bytes of DMA memory the host may allocate.
    pub mem_limit: usize,
}

impl HcaConfig {
    /// An HCA at `ip` with MTU 1024 (RoCE on 1500-byte Ethernet) and 256 MiB.
    #[must_use]
    pub const fn new(ip: [u8; 4]) -> Self {
        Self {
            ip,
            mtu: Mtu::Mtu1024,
            mem_limit: 256 << 20,
        }
    }
}

/// The world of software HCAs (see the module docs).
pub struct Fabric {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    link_threads: Mutex<Vec<JoinHandle<()>>>,
}

impl Fabric {
    /// Creates a fabric; in [`ExecMode::Thread`] it starts the device thread.
    #[must_use]
    pub fn new(config: FabricConfig) -> Self {
        let shared = Arc::new(Shared::new(
            config.mode,
            config.seed,
            config.inline_doorbells,
        ));
        let thread = match config.mode {
            ExecMode::Stepped => None,
            ExecMode::Thread => {
                let s = shared.clone();
                let h = std::thread::Builder::new()
                    .name("soft-hca".into())
                    .spawn(move || device_thread(&s))
                    .ok();
                if let Some(h) = &h {
                    let _ = shared.device_thread.set(h.thread().clone());
                }
                h
            }
        };
        Self {
            shared,
            thread,
            link_threads: Mutex::new(Vec::new()),
        }
    }

    /// A stepped fabric with seed 0.
    #[must_use]
    pub fn stepped() -> Self {
        Self::new(FabricConfig::default())
    }

    /// Adds an HCA (one port, active).
    #[must_use]
    pub fn add_hca(&self, config: HcaConfig) -> Arc<SoftHca> {
        self.insert_hca(config, None)
    }

    /// Adds an HCA whose port is attached to an Ethernet link over `socket`
    /// (see [`link`]) instead of the in-process fabric: everything it sends
    /// leaves through the socket, everything it receives comes from it.
    /// Its node GUID is the EUI-64 of the link's MAC (as rxe's), and its
    /// active MTU the smaller of `config.mtu` and what fits the link
    /// ([`LinkConfig::ib_mtu`]). In thread mode a reader thread serves the
    /// socket; in stepped mode each engine pass polls it.
    ///
    /// # Errors
    /// Creating the pcap file; [`std::io::ErrorKind::InvalidInput`] for a
    /// multicast MAC, a non-unicast IP or an IP MTU too small for RoCE.
    pub fn add_hca_on_link(
        &self,
        config: HcaConfig,
        link: LinkConfig,
        socket: Arc<dyn FrameSocket>,
    ) -> std::io::Result<Arc<SoftHca>> {
        let invalid = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidInput, what);
        if !link.mac.is_unicast() {
            return Err(invalid("link MAC must be unicast"));
        }
        if !Ipv4Address(config.ip).is_unicast() {
            return Err(invalid("port IPv4 address must be unicast"));
        }
        let Some(link_mtu) = link.ib_mtu() else {
            return Err(invalid("link IP MTU too small for RoCEv2"));
        };
        let inbox = match self.shared.mode {
            ExecMode::Thread => Some(Arc::new(link::Inbox::default())),
            ExecMode::Stepped => None,
        };
        let epoch_ns = match self.shared.mode {
            // Real time: wall-clock timestamps in the capture.
            ExecMode::Thread => SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(0))
                .saturating_sub(self.shared.now()),
            // Virtual time: the capture is as reproducible as the run.
            ExecMode::Stepped => 0,
        };
        let eth = link::EthLink::new(
            Ipv4Address(config.ip),
            &link,
            socket.clone(),
            inbox.clone(),
            epoch_ns,
        )?;
        let config = HcaConfig {
            mtu: if config.mtu.bytes() <= link_mtu.bytes() {
                config.mtu
            } else {
                link_mtu
            },
            ..config
        };
        let hca = self.insert_hca(config, Some(eth));
        if let Some(inbox) = inbox {
            let weak = Arc::downgrade(&self.shared);
            let spawned = std::thread::Builder::new()
                .name("soft-hca-link".into())
                .spawn(move || link::reader_thread(&socket, &inbox, &weak))?;
            self.link_threads
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(spawned);
        }
        Ok(hca)
    }

    fn insert_hca(&self, config: HcaConfig, link: Option<link::EthLink>) -> Arc<SoftHca> {
        let mut w = self.shared.lock();
        let idx = w.hcas.len();
        let gid = Gid::from_ipv4(Ipv4Address(config.ip));
        let mem = PhysMemory::new(config.mem_limit);
        let node_guid = match &link {
            Some(l) => eui64(l.mac()),
            None => 0x0200_00ff_fe00_0000 | u64::from(u32::from_be_bytes(config.ip)),
        };
        let on_fabric = link.is_none();
        w.hcas.push(Hca {
            gid,
            mem: mem.clone(),
            node_guid,
            mtu: config.mtu,
            port_state: PortState::Active,
            pds: Default::default(),
            next_pd: 1,
            cqs: Default::default(),
            next_cqn: 1,
            qps: Default::default(),
            next_qpn: 0x10,
            gsi_qpn: None,
            mrs: Default::default(),
            next_mkey_index: FIRST_MKEY_INDEX,
            async_handler: None,
            link,
        });
        // A port on an Ethernet link is reachable only through its link.
        if on_fabric {
            w.add_port(gid, idx);
        }
        self.shared.unlock(w);
        Arc::new(SoftHca {
            shared: self.shared.clone(),
            idx,
            mem,
            gid,
        })
    }

    /// Counters of an HCA's Ethernet link (`None` for a fabric port).
    #[must_use]
    pub fn link_stats(&self, hca: &SoftHca) -> Option<LinkStats> {
        let w = self.shared.lock();
        w.hcas.get(hca.idx)?.link.as_ref().map(link::EthLink::stats)
    }

    /// The neighbours an HCA's link has resolved (its ARP cache).
    #[must_use]
    pub fn link_neighbors(&self, hca: &SoftHca) -> Vec<(Ipv4Address, EthernetAddress)> {
        let w = self.shared.lock();
        w.hcas
            .get(hca.idx)
            .and_then(|h| h.link.as_ref())
            .map(link::EthLink::neighbors)
            .unwrap_or_default()
    }

    /// Runs the engine inside every doorbell write (as long as no other
    /// thread is running it), so completions can arrive before the posting
    /// call returns; see [`FabricConfig::inline_doorbells`].
    pub fn set_inline_doorbells(&self, on: bool) {
        self.shared.set_inline(on);
    }

    /// Runs the engine until nothing more happens at the current time.
    pub fn run_until_idle(&self) {
        self.shared.run_engine(true);
    }

    /// One engine pass: every QP's send side and timers, then the frames due.
    /// Returns whether anything happened.
    pub fn step(&self) -> bool {
        self.shared.step()
    }

    /// Stepped mode: moves the virtual clock forward by `d`, stopping at every
    /// scheduled frame delivery and timer on the way (in thread mode: runs
    /// the engine once).
    pub fn advance(&self, d: Duration) {
        let target = self
            .shared
            .now()
            .saturating_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
        for _ in 0..10_000_000 {
            self.shared.run_engine(true);
            if self.shared.mode == ExecMode::Thread {
                return;
            }
            let now = self.shared.now();
            let next = {
                let w = self.shared.lock();
                w.next_deadline()
            }
            .filter(|t| *t > now && *t <= target);
            match next {
                Some(t) => self.shared.set_virtual_now(t),
                None if now < target => self.shared.set_virtual_now(target),
                None => return,
            }
        }
    }

    /// Current time of the fabric clock.
    #[must_use]
    pub fn now(&self) -> Duration {
        Duration::from_nanos(self.shared.now())
    }

    /// Fabric counters.
    #[must_use]
    pub fn stats(&self) -> FabricStats {
        self.shared.lock().stats
    }

    /// Frames still on the wire (delayed).
    #[must_use]
    pub fn in_flight(&self) -> usize {
        self.shared.lock().in_flight()
    }

    /// Doorbell writes that named another object than their register's.
    #[must_use]
    pub fn bad_doorbells(&self) -> u64 {
        self.shared.bad_doorbells.load(Ordering::Relaxed)
    }

    /// Starts (or stops) recording every frame sent.
    pub fn set_capture(&self, on: bool) {
        let mut w = self.shared.lock();
        w.capture = if on { Some(Vec::new()) } else { None };
    }

    /// Takes the frames recorded so far.
    #[must_use]
    pub fn take_captured(&self) -> Vec<CapturedFrame> {
        let mut w = self.shared.lock();
        w.capture.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Delivers a RoCEv2 frame (ICRC included) to `to` now, as if it had
    /// just arrived (tests that replay captured frames one by one).
    #[cfg(test)]
    pub(crate) fn inject(&self, to: &SoftHca, frame: Vec<u8>) {
        let mut w = self.shared.lock();
        w.inject(to.idx, frame);
        self.shared.unlock(w);
    }

    /// Sets the faults of the link `from → to`.
    pub fn set_link_faults(&self, from: &SoftHca, to: &SoftHca, cfg: FaultConfig) {
        self.shared.lock().set_link_faults(from.idx, to.idx, cfg);
    }

    /// Takes a port's link down or up (async events to its HCA).
    pub fn set_port_state(&self, hca: &SoftHca, state: PortState) {
        let mut w = self.shared.lock();
        w.set_port_state(hca.idx, state);
        self.shared.unlock(w);
    }

    /// Forces a QP into the error state, as a fatal device error would
    /// (async event [`crate::device::AsyncEvent::QpFatal`], everything flushed).
    pub fn force_qp_error(&self, hca: &SoftHca, qpn: u32) {
        hca.force_error(qpn);
    }
}

impl Drop for Fabric {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
        let links = std::mem::take(
            &mut *self
                .link_threads
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        for t in links {
            let _ = t.join();
        }
    }
}

/// The modified EUI-64 of a MAC (`addrconf_addr_eui48`): rxe's node GUID.
fn eui64(mac: EthernetAddress) -> u64 {
    let [a, b, c, d, e, f] = mac.0;
    u64::from_be_bytes([a ^ 0x02, b, c, 0xff, 0xfe, d, e, f])
}

fn device_thread(shared: &Shared) {
    shared.enter_device_thread();
    while !shared.stop.load(Ordering::SeqCst) {
        shared.run_engine(false);
        std::thread::park_timeout(shared.device_thread_wait());
    }
}

/// One software HCA (one port).
pub struct SoftHca {
    shared: Arc<Shared>,
    idx: usize,
    mem: Arc<PhysMemory>,
    gid: Gid,
}

impl SoftHca {
    /// The port's GID (`::ffff:ip`).
    #[must_use]
    pub fn gid(&self) -> Gid {
        self.gid
    }

    /// The MAC of the port's Ethernet link (`None` on the in-process fabric).
    #[must_use]
    pub fn mac(&self) -> Option<EthernetAddress> {
        let w = self.shared.lock();
        w.hcas.get(self.idx)?.link.as_ref().map(link::EthLink::mac)
    }

    /// The host's physical memory (tests inspect it directly).
    #[must_use]
    pub fn phys_memory(&self) -> &Arc<PhysMemory> {
        &self.mem
    }

    /// Counters of a QP.
    #[must_use]
    pub fn qp_stats(&self, qpn: u32) -> Option<QpStats> {
        let w = self.shared.lock();
        let h = w.hcas.get(self.idx)?;
        h.qps.get(&internal_qpn(h, qpn)).map(|q| q.stats)
    }

    /// The type of a QP.
    #[must_use]
    pub fn qp_type_of(&self, qpn: u32) -> Option<QpType> {
        let w = self.shared.lock();
        let h = w.hcas.get(self.idx)?;
        h.qps.get(&internal_qpn(h, qpn)).map(|q| q.qp_type)
    }

    /// CQEs this HCA has written, over all its CQs (each CQ's producer
    /// counter, summed). A benchmark on a stepped fabric waits on it to
    /// know that everything it expects has landed before the driver polls.
    #[must_use]
    pub fn cqes_written(&self) -> u64 {
        let w = self.shared.lock();
        w.hcas
            .get(self.idx)
            .map_or(0, |h| h.cqs.values().map(|c| u64::from(c.pi)).sum())
    }

    /// Entries of this HCA's largest CQ (0 without one). A benchmark that
    /// wants its driver's rings past their first lap — where a reused
    /// slot, not a fresh one, is the steady state — writes more CQEs than
    /// this before it measures.
    #[must_use]
    pub fn largest_cq_entries(&self) -> u32 {
        let w = self.shared.lock();
        w.hcas.get(self.idx).map_or(0, |h| {
            h.cqs.values().map(|c| c.ring.entries()).max().unwrap_or(0)
        })
    }

    /// True if the CQ is in the error state (overrun).
    #[must_use]
    pub fn cq_in_error(&self, cqn: u32) -> Option<bool> {
        let w = self.shared.lock();
        w.hcas.get(self.idx)?.cqs.get(&cqn).map(|c| c.error)
    }

    fn force_error(&self, qpn: u32) {
        let mut w = self.shared.lock();
        let now = w.now;
        let mut out = Outbox::default();
        if let Some(h) = w.hcas.get_mut(self.idx) {
            let _ = h.with_qp(qpn, now, &mut out, |qp, ctx| {
                if let Some(handler) = ctx.async_handler {
                    ctx.out.events.push(world::Event::Async(
                        handler.clone(),
                        crate::device::AsyncEvent::QpFatal { qpn },
                    ));
                }
                qp.enter_error(ctx, false);
            });
        }
        w.absorb(self.idx, &mut out);
        self.shared.unlock(w);
    }

    fn with_hca<R>(
        &self,
        f: impl FnOnce(&mut Hca, &mut Outbox, u64) -> Result<R, HcaError>,
    ) -> Result<R, HcaError> {
        let mut w = self.shared.lock();
        let now = w.now;
        let mut out = Outbox::default();
        let r = match w.hcas.get_mut(self.idx) {
            Some(h) => f(h, &mut out, now),
            None => Err(HcaError::InvalidPort(1)),
        };
        w.absorb(self.idx, &mut out);
        self.shared.unlock(w);
        r
    }

    fn alloc(&self, len: usize) -> Result<(DmaBuffer, DeviceMem), HcaError> {
        let region = self.mem.alloc_region(len)?;
        Ok((DmaBuffer::from_backing(region.clone()), DeviceMem(region)))
    }
}

fn check_port(port: u8) -> Result<(), HcaError> {
    if port == 1 {
        Ok(())
    } else {
        Err(HcaError::InvalidPort(port))
    }
}

fn pow2(n: u32, min: u32, max: u32) -> Result<u32, HcaError> {
    if n == 0 || n > max {
        return Err(HcaError::InvalidSize);
    }
    Ok(n.max(min).next_power_of_two())
}

impl HcaDevice for SoftHca {
    fn query_device(&self) -> DeviceAttr {
        let w = self.shared.lock();
        let guid = w.hcas.get(self.idx).map_or(0, |h| h.node_guid);
        DeviceAttr {
            node_guid: guid,
            ..LIMITS
        }
    }

    fn query_port(&self, port: u8) -> Result<PortAttr, HcaError> {
        check_port(port)?;
        let w = self.shared.lock();
        let h = w.hcas.get(self.idx).ok_or(HcaError::InvalidPort(port))?;
        Ok(PortAttr {
            state: h.port_state,
            max_mtu: Mtu::Mtu4096,
            active_mtu: h.mtu,
            gid_tbl_len: 1,
            pkey_tbl_len: 1,
        })
    }

    fn query_gid(&self, port: u8, index: u16) -> Result<Gid, HcaError> {
        check_port(port)?;
        if index != 0 {
            return Err(HcaError::InvalidGidIndex(index));
        }
        Ok(self.gid)
    }

    fn dma_allocator(&self) -> Arc<dyn DmaAllocator> {
        Arc::new(SimDmaAllocator(self.mem.clone()))
    }

    fn set_async_event_handler(&self, handler: Option<Arc<dyn AsyncEventHandler>>) {
        let _ = self.with_hca(|h, _, _| {
            h.async_handler = handler;
            Ok(())
        });
    }

    fn alloc_pd(&self) -> Result<Pdn, HcaError> {
        self.with_hca(|h, _, _| {
            if h.pds.len() >= LIMITS.max_pd as usize {
                return Err(HcaError::OutOfResources);
            }
            let pd = h.next_pd;
            h.next_pd += 1;
            h.pds.insert(pd, 0);
            Ok(Pdn(pd))
        })
    }

    fn dealloc_pd(&self, pd: Pdn) -> Result<(), HcaError> {
        self.with_hca(|h, _, _| match h.pds.get(&pd.0) {
            None => Err(HcaError::NoSuchPd(pd)),
            Some(0) => {
                h.pds.remove(&pd.0);
                Ok(())
            }
            Some(_) => Err(HcaError::InUse),
        })
    }

    fn create_cq(
        &self,
        entries: u32,
        handler: Arc<dyn CqEventHandler>,
    ) -> Result<CqResources, HcaError> {
        let n = pow2(entries, 2, LIMITS.max_cqe)?;
        let (ring_buf, ring_dev) = self.alloc(n as usize * 64)?;
        let (dbr_buf, dbr_dev) = self.alloc(DBR_LEN)?;
        let dev_ring = CqRing::new(ring_dev, n)?;
        dev_ring.init_invalid();
        let ring = CqRing::new(ring_buf, n)?;
        let doorbell_record = CqDoorbellRecord::new(dbr_buf)?;
        let dev_dbr = CqDoorbellRecord::new(dbr_dev)?;
        let weak = Arc::downgrade(&self.shared);
        self.with_hca(move |h, _, _| {
            if h.cqs.len() >= LIMITS.max_cq as usize {
                return Err(HcaError::OutOfResources);
            }
            let cqn = h.next_cqn;
            h.next_cqn += 1;
            let shared = Arc::new(CqShared {
                cqn,
                handler,
                alive: AtomicBool::new(true),
                pending_arm: AtomicU64::new(0),
                produced: AtomicU32::new(0),
            });
            let arm_doorbell = Arc::new(CqDoorbell {
                cq: shared.clone(),
                shared: weak,
            });
            h.cqs.insert(
                cqn,
                Cq {
                    shared,
                    ring: dev_ring,
                    dbr: dev_dbr,
                    pi: 0,
                    armed: None,
                    last_fired_sn: None,
                    error: false,
                    users: 0,
                },
            );
            Ok(CqResources {
                cqn,
                ring,
                doorbell_record,
                arm_doorbell,
            })
        })
    }

    fn resize_cq(&self, cqn: u32, entries: u32) -> Result<CqRing<DmaBuffer>, HcaError> {
        let n = pow2(entries, 2, LIMITS.max_cqe)?;
        let (ring_buf, ring_dev) = self.alloc(n as usize * 64)?;
        let dev_ring = CqRing::new(ring_dev, n)?;
        dev_ring.init_invalid();
        let ring = CqRing::new(ring_buf, n)?;
        self.with_hca(move |h, _, _| {
            let cq = h.cqs.get_mut(&cqn).ok_or(HcaError::NoSuchCq(cqn))?;
            cq.resize(dev_ring)?;
            Ok(ring)
        })
    }

    fn destroy_cq(&self, cqn: u32) -> Result<(), HcaError> {
        self.with_hca(|h, _, _| {
            let cq = h.cqs.get(&cqn).ok_or(HcaError::NoSuchCq(cqn))?;
            if cq.users > 0 {
                return Err(HcaError::InUse);
            }
            if let Some(cq) = h.cqs.remove(&cqn) {
                cq.shared.alive.store(false, Ordering::Release);
            }
            Ok(())
        })?;
        self.shared.quiesce_delivery();
        Ok(())
    }

    fn create_qp(&self, init: &QpInit) -> Result<QpResources, HcaError> {
        let sq_n = pow2(init.sq_wqebbs, 2, LIMITS.max_qp_wr)?;
        let rq_n = pow2(init.rq_entries.max(1), 1, LIMITS.max_qp_wr)?;
        if init.max_recv_sge == 0 || init.max_recv_sge > LIMITS.max_recv_sge {
            return Err(HcaError::InvalidSize);
        }
        let stride = (init.max_recv_sge as usize * 16)
            .next_power_of_two()
            .min(MAX_RECV_STRIDE);
        let (sq_buf, sq_dev) = self.alloc(sq_n as usize * WQEBB_SIZE)?;
        let (rq_buf, rq_dev) = self.alloc(rq_n as usize * stride)?;
        let (dbr_buf, dbr_dev) = self.alloc(DBR_LEN)?;
        let caps = QpCaps {
            sq_wqebbs: sq_n,
            rq_entries: rq_n,
            rq_stride: stride as u32,
            max_send_sge: LIMITS.max_send_sge,
            max_recv_sge: (stride / 16) as u32,
            max_inline_data: LIMITS.max_inline_data,
        };
        let sq = SendRing::new(sq_buf, sq_n)?;
        let rq = RecvRing::new(rq_buf, rq_n, stride)?;
        let doorbell_record = QpDoorbellRecord::new(dbr_buf)?;
        let dev_sq = SendRing::new(sq_dev, sq_n)?;
        let dev_rq = RecvRing::new(rq_dev, rq_n, stride)?;
        let dev_dbr = QpDoorbellRecord::new(dbr_dev)?;
        let init = *init;
        let weak = Arc::downgrade(&self.shared);
        self.with_hca(move |h, _, _| {
            if !h.pds.contains_key(&init.pd.0) {
                return Err(HcaError::NoSuchPd(init.pd));
            }
            for cqn in [init.send_cq, init.recv_cq] {
                if !h.cqs.contains_key(&cqn) {
                    return Err(HcaError::NoSuchCq(cqn));
                }
            }
            if h.qps.len() >= LIMITS.max_qp as usize {
                return Err(HcaError::OutOfResources);
            }
            let qpn = if init.qp_type == QpType::Gsi {
                check_port(init.port)?;
                if h.gsi_qpn.is_some() {
                    return Err(HcaError::InvalidOperation);
                }
                // The GSI QP is addressed as QP1 on the wire; internally it
                // gets its own number like any QP.
                let q = h.next_qpn;
                h.gsi_qpn = Some(q);
                q
            } else {
                h.next_qpn
            };
            h.next_qpn += 1;
            let doorbell = Arc::new(QpDoorbellShared {
                qpn: if init.qp_type == QpType::Gsi {
                    crate::device::GSI_QPN
                } else {
                    qpn
                },
                rang: AtomicBool::new(false),
                last_value: AtomicU64::new(0),
            });
            let wire_qpn = doorbell.qpn;
            let qp = Qp::new(
                wire_qpn,
                init.qp_type,
                init.pd.0,
                init.send_cq,
                init.recv_cq,
                init.sq_sig_all,
                dev_sq,
                dev_rq,
                dev_dbr,
                doorbell.clone(),
                1,
            );
            h.qps.insert(qpn, qp);
            if let Some(c) = h.pds.get_mut(&init.pd.0) {
                *c += 1;
            }
            for cqn in [init.send_cq, init.recv_cq] {
                if let Some(cq) = h.cqs.get_mut(&cqn) {
                    cq.users += 1;
                }
            }
            let sq_doorbell = Arc::new(SqDoorbell {
                qp: doorbell,
                shared: weak,
            });
            Ok(QpResources {
                qpn: wire_qpn,
                caps,
                sq,
                rq,
                doorbell_record,
                sq_doorbell,
            })
        })
    }

    fn modify_qp(&self, qpn: u32, attr: &QpAttr, mask: QpAttrMask) -> Result<(), HcaError> {
        let attr = *attr;
        self.with_hca(move |h, out, now| {
            let key = internal_qpn(h, qpn);
            let qp = h.qps.get(&key).ok_or(HcaError::NoSuchQp(qpn))?;
            let new = check_modify(qp.qp_type, qp.state, &attr, mask)?;
            let bad = |bit| Err(HcaError::Modify(ModifyError::InvalidValue(bit)));
            if mask.contains(QpAttrMask::PORT) && attr.port != 1 {
                return Err(HcaError::InvalidPort(attr.port));
            }
            if mask.contains(QpAttrMask::PKEY_INDEX) && attr.pkey_index != 0 {
                return bad(QpAttrMask::PKEY_INDEX);
            }
            if mask.contains(QpAttrMask::MAX_QP_RD_ATOMIC)
                && attr.max_rd_atomic > LIMITS.max_qp_init_rd_atom
            {
                return Err(HcaError::ExceedsLimit);
            }
            if mask.contains(QpAttrMask::MAX_DEST_RD_ATOMIC)
                && attr.max_dest_rd_atomic > LIMITS.max_qp_rd_atom
            {
                return Err(HcaError::ExceedsLimit);
            }
            if mask.contains(QpAttrMask::AV)
                && (attr.av.sgid_index != 0 || attr.av.dgid.to_ipv4().is_none())
            {
                return bad(QpAttrMask::AV);
            }
            if mask.contains(QpAttrMask::ACCESS_FLAGS)
                && attr.access.contains(AccessFlags::REMOTE_ATOMIC)
            {
                return bad(QpAttrMask::ACCESS_FLAGS);
            }
            h.with_qp(key, now, out, |qp, ctx| {
                apply_attrs(&mut qp.attr, &attr, mask);
                qp.enter_state(new, ctx);
            });
            Ok(())
        })
    }

    fn query_qp(&self, qpn: u32) -> Result<QpAttr, HcaError> {
        self.with_hca(|h, _, _| {
            let key = internal_qpn(h, qpn);
            let qp = h.qps.get(&key).ok_or(HcaError::NoSuchQp(qpn))?;
            Ok(QpAttr {
                state: qp.state,
                cur_state: qp.state,
                ..qp.attr
            })
        })
    }

    fn destroy_qp(&self, qpn: u32) -> Result<(), HcaError> {
        self.with_hca(|h, _, _| {
            let key = internal_qpn(h, qpn);
            let qp = h.qps.remove(&key).ok_or(HcaError::NoSuchQp(qpn))?;
            if h.gsi_qpn == Some(key) {
                h.gsi_qpn = None;
            }
            if let Some(c) = h.pds.get_mut(&qp.pd) {
                *c = c.saturating_sub(1);
            }
            for cqn in [qp.send_cq, qp.recv_cq] {
                if let Some(cq) = h.cqs.get_mut(&cqn) {
                    cq.users = cq.users.saturating_sub(1);
                }
            }
            Ok(())
        })
    }

    fn reg_mr(&self, reg: &MrRegistration<'_>) -> Result<MrKeys, HcaError> {
        if !reg.access.is_valid_for_mr() || reg.access.contains(AccessFlags::REMOTE_ATOMIC) {
            return Err(HcaError::InvalidAccess);
        }
        if !(MIN_PAGE_SHIFT..=MAX_PAGE_SHIFT).contains(&reg.page_shift)
            || reg.pages.is_empty()
            || reg.length == 0
        {
            return Err(HcaError::InvalidRange);
        }
        let mask = (1u64 << reg.page_shift) - 1;
        let span = (reg.pages.len() as u64) << reg.page_shift;
        if (reg.iova & mask)
            .checked_add(reg.length)
            .is_none_or(|e| e > span)
            || reg.length > LIMITS.max_mr_size
        {
            return Err(HcaError::InvalidRange);
        }
        if reg
            .pages
            .iter()
            .any(|p| p.get() & mask != 0 || !self.mem.is_mapped(p.get(), 1))
        {
            return Err(HcaError::InvalidRange);
        }
        let pages: Vec<u64> = reg.pages.iter().map(|p| p.get()).collect();
        let (pd, iova, length, page_shift, access) =
            (reg.pd, reg.iova, reg.length, reg.page_shift, reg.access);
        self.with_hca(move |h, _, _| {
            let refs = h.pds.get_mut(&pd.0).ok_or(HcaError::NoSuchPd(pd))?;
            if h.mrs.len() >= LIMITS.max_mr as usize {
                return Err(HcaError::OutOfResources);
            }
            *refs += 1;
            let index = h.next_mkey_index;
            h.next_mkey_index += 1;
            let mr = Mr {
                index,
                key: 0,
                pd: pd.0,
                fast_reg: None,
                valid: true,
                iova,
                length,
                page_shift,
                pages,
                access,
                generation: Arc::default(),
            };
            let key = mr.mkey();
            h.mrs.insert(index, mr);
            Ok(MrKeys {
                lkey: key,
                rkey: key,
            })
        })
    }

    fn dereg_mr(&self, lkey: u32) -> Result<(), HcaError> {
        self.with_hca(|h, _, _| {
            let mr = h.mrs.get(&(lkey >> 8)).ok_or(HcaError::NoSuchMr(lkey))?;
            if u32::from(mr.key) != lkey & 0xff {
                return Err(HcaError::NoSuchMr(lkey));
            }
            if mr.fast_reg.is_some() {
                return Err(HcaError::InvalidOperation);
            }
            let pd = mr.pd;
            h.mrs.remove(&(lkey >> 8));
            if let Some(c) = h.pds.get_mut(&pd) {
                *c = c.saturating_sub(1);
            }
            Ok(())
        })
    }

    fn alloc_mkey(&self, pd: Pdn, max_pages: u32) -> Result<u32, HcaError> {
        if max_pages == 0 || max_pages as usize > MAX_REG_PAGES {
            return Err(HcaError::InvalidSize);
        }
        self.with_hca(|h, _, _| {
            let refs = h.pds.get_mut(&pd.0).ok_or(HcaError::NoSuchPd(pd))?;
            if h.mrs.len() >= LIMITS.max_mr as usize {
                return Err(HcaError::OutOfResources);
            }
            *refs += 1;
            let index = h.next_mkey_index;
            h.next_mkey_index += 1;
            let mr = Mr {
                index,
                key: 0,
                pd: pd.0,
                fast_reg: Some(max_pages),
                valid: false,
                iova: 0,
                length: 0,
                page_shift: MIN_PAGE_SHIFT,
                pages: Vec::new(),
                access: AccessFlags::empty(),
                generation: Arc::default(),
            };
            let key = mr.mkey();
            h.mrs.insert(index, mr);
            Ok(key)
        })
    }

    fn free_mkey(&self, mkey: u32) -> Result<(), HcaError> {
        self.with_hca(|h, _, _| {
            let mr = h.mrs.get(&(mkey >> 8)).ok_or(HcaError::NoSuchMr(mkey))?;
            if mr.fast_reg.is_none() {
                return Err(HcaError::InvalidOperation);
            }
            let pd = mr.pd;
            h.mrs.remove(&(mkey >> 8));
            if let Some(c) = h.pds.get_mut(&pd) {
                *c = c.saturating_sub(1);
            }
            Ok(())
        })
    }
}

/// The GSI QP is QP1 to the outside and has an internal key.
fn internal_qpn(h: &Hca, qpn: u32) -> u32 {
    if qpn == crate::device::GSI_QPN {
        h.gsi_qpn.unwrap_or(0)
    } else {
        qpn
    }
}

fn apply_attrs(a: &mut QpAttr, n: &QpAttr, m: QpAttrMask) {
    use QpAttrMask as M;
    if m.contains(M::EN_SQD_ASYNC_NOTIFY) {
        a.en_sqd_async_notify = n.en_sqd_async_notify;
    }
    if m.contains(M::ACCESS_FLAGS) {
        a.access = n.access;
    }
    if m.contains(M::PKEY_INDEX) {
        a.pkey_index = n.pkey_index;
    }
    if m.contains(M::PORT) {
        a.port = n.port;
    }
    if m.contains(M::QKEY) {
        a.qkey = n.qkey;
    }
    if m.contains(M::AV) {
        a.av = n.av;
    }
    if m.contains(M::PATH_MTU) {
        a.path_mtu = n.path_mtu;
    }
    if m.contains(M::TIMEOUT) {
        a.timeout = n.timeout;
    }
    if m.contains(M::RETRY_CNT) {
        a.retry_cnt = n.retry_cnt;
    }
    if m.contains(M::RNR_RETRY) {
        a.rnr_retry = n.rnr_retry;
    }
    if m.contains(M::RQ_PSN) {
        a.rq_psn = n.rq_psn;
    }
    if m.contains(M::MAX_QP_RD_ATOMIC) {
        a.max_rd_atomic = n.max_rd_atomic;
    }
    if m.contains(M::MIN_RNR_TIMER) {
        a.min_rnr_timer = n.min_rnr_timer;
    }
    if m.contains(M::SQ_PSN) {
        a.sq_psn = n.sq_psn;
    }
    if m.contains(M::MAX_DEST_RD_ATOMIC) {
        a.max_dest_rd_atomic = n.max_dest_rd_atomic;
    }
    if m.contains(M::DEST_QPN) {
        a.dest_qpn = n.dest_qpn;
    }
}
