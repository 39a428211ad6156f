//! A small raw test kit: post WQEs and poll CQEs directly on the rings, so
//! this crate's tests (and anyone probing the device model) can drive the
//! software HCA without kverbs. kverbs has the real fast path; this is the
//! simplest correct one, following the doorbell order of [`crate::barrier`].

use std::sync::{Arc, Mutex, PoisonError};

use crate::barrier;
use crate::cqe::{CqeOpcode, CqeRepr};
use crate::device::{
    AccessFlags, AddressVector, AsyncEvent, AsyncEventHandler, CqEventHandler, CqResources, Gid,
    HcaDevice, HcaError, MrKeys, MrRegistration, Mtu, Pdn, QpAttr, QpAttrMask, QpCaps, QpInit,
    QpResources, QpState, QpType,
};
use crate::dma::{DmaBuffer, DmaError, PhysAddr};
use crate::doorbell::{CqArm, CqDoorbellRecord, DoorbellRegister, QpDoorbellRecord};
use crate::ring::{CqRing, RecvRing, RingError, SendRing};
use crate::view::FormatError;
use crate::wqe::{CtrlFlags, DataSegRepr, SendOpcode, SendWqeBuilder};

use super::{Fabric, FrameSocket, HcaConfig, LinkConfig, PAGE_SIZE, SoftHca};

/// What the tests' buffers allow: local write, remote write and remote read.
pub const RW: AccessFlags = AccessFlags::LOCAL_WRITE
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_READ);

/// `n` bytes of a pattern that differs by `seed` and does not repeat within
/// 256 bytes, so a byte placed at the wrong offset shows.
#[must_use]
pub fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Records every event it receives.
#[derive(Default)]
pub struct EventLog {
    completions: Mutex<Vec<u32>>,
    asyncs: Mutex<Vec<AsyncEvent>>,
}

impl EventLog {
    /// A new, empty log.
    #[must_use]
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }
    /// Completion events so far (CQ numbers).
    #[must_use]
    pub fn completions(&self) -> Vec<u32> {
        self.completions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
    /// Asynchronous events so far.
    #[must_use]
    pub fn asyncs(&self) -> Vec<AsyncEvent> {
        self.asyncs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl CqEventHandler for EventLog {
    fn completion_event(&self, cqn: u32) {
        self.completions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(cqn);
    }
}

impl AsyncEventHandler for EventLog {
    fn async_event(&self, event: AsyncEvent) {
        self.asyncs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(event);
    }
}

/// A CQ polled directly.
pub struct RawCq {
    /// CQ number.
    pub cqn: u32,
    ring: CqRing<DmaBuffer>,
    next_ring: Option<CqRing<DmaBuffer>>,
    dbr: CqDoorbellRecord<DmaBuffer>,
    arm_doorbell: Arc<dyn DoorbellRegister>,
    ci: u32,
    arm_sn: u8,
}

impl RawCq {
    /// Wraps the resources of a new CQ.
    #[must_use]
    pub fn new(res: CqResources) -> Self {
        Self {
            cqn: res.cqn,
            ring: res.ring,
            next_ring: None,
            dbr: res.doorbell_record,
            arm_doorbell: res.arm_doorbell,
            ci: 0,
            arm_sn: 0,
        }
    }

    /// Hands over the ring `resize_cq` returned; polling switches to it at
    /// the resize CQE.
    pub fn set_resized_ring(&mut self, ring: CqRing<DmaBuffer>) {
        self.next_ring = Some(ring);
    }

    /// Polls one CQE (ownership, `from_device`, then the contents); publishes
    /// the consumer index.
    pub fn poll(&mut self) -> Option<CqeRepr> {
        loop {
            let cqe = self.ring.poll(self.ci)?;
            let repr = CqeRepr::parse(&cqe).ok()?;
            self.ci = self.ci.wrapping_add(1);
            self.dbr.set_ci(self.ci);
            if repr.opcode == CqeOpcode::ResizeCq {
                if let Some(r) = self.next_ring.take() {
                    self.ring = r;
                }
                continue;
            }
            return Some(repr);
        }
    }

    /// Polls until empty.
    pub fn drain(&mut self) -> Vec<CqeRepr> {
        std::iter::from_fn(|| self.poll()).collect()
    }

    /// Requests one completion event (record, then register).
    pub fn arm(&mut self, solicited_only: bool) {
        let arm = CqArm {
            sn: self.arm_sn,
            solicited_only,
            ci: self.ci,
        };
        self.dbr.set_arm(arm);
        barrier::mmio_wc_start();
        self.arm_doorbell.write64(arm.doorbell_value(self.cqn));
        barrier::mmio_flush_writes();
    }

    /// Acknowledges an event (the next arm gets a new sequence number).
    pub fn ack_event(&mut self) {
        self.arm_sn = (self.arm_sn + 1) & 3;
    }

    /// Consumer counter.
    #[must_use]
    pub fn consumer_index(&self) -> u32 {
        self.ci
    }
}

/// Why a raw post failed.
#[derive(Debug, PartialEq, Eq)]
pub enum PostError {
    /// The WQE is malformed.
    Format(FormatError),
    /// The ring refused it.
    Ring(RingError),
    /// No room in the queue.
    Full,
}

impl From<FormatError> for PostError {
    fn from(e: FormatError) -> Self {
        Self::Format(e)
    }
}

impl From<RingError> for PostError {
    fn from(e: RingError) -> Self {
        Self::Ring(e)
    }
}

/// A QP posted to directly.
pub struct RawQp {
    /// QP number.
    pub qpn: u32,
    /// Sizes.
    pub caps: QpCaps,
    sq: SendRing<DmaBuffer>,
    rq: RecvRing<DmaBuffer>,
    dbr: QpDoorbellRecord<DmaBuffer>,
    sq_doorbell: Arc<dyn DoorbellRegister>,
    sq_pi: u32,
    rq_pi: u32,
    last_ctrl: u64,
}

impl RawQp {
    /// Wraps the resources of a new QP.
    #[must_use]
    pub fn new(res: QpResources) -> Self {
        Self {
            qpn: res.qpn,
            caps: res.caps,
            sq: res.sq,
            rq: res.rq,
            dbr: res.doorbell_record,
            sq_doorbell: res.sq_doorbell,
            sq_pi: 0,
            rq_pi: 0,
            last_ctrl: 0,
        }
    }

    /// A builder for the next WQE (its index and the QPN filled in).
    #[must_use]
    pub fn builder(&self, opcode: SendOpcode, flags: CtrlFlags, imm: u32) -> SendWqeBuilder {
        SendWqeBuilder::new(opcode, self.sq_pi as u16, self.qpn, flags, imm)
    }

    /// Writes a built WQE into the ring without ringing the doorbell;
    /// returns its WQE counter.
    ///
    /// # Errors
    /// [`PostError`].
    pub fn write_send(&mut self, b: &mut SendWqeBuilder) -> Result<u16, PostError> {
        let bbs = b.wqebbs();
        let counter = self.sq_pi as u16;
        let bytes = b.finish()?;
        self.sq.write_wqe(self.sq_pi, bytes)?;
        self.last_ctrl = b.ctrl().doorbell_value();
        self.sq_pi = self.sq_pi.wrapping_add(bbs);
        Ok(counter)
    }

    /// Publishes everything written so far with one doorbell, in the order
    /// of [`crate::barrier`].
    pub fn ring_sq(&self) {
        barrier::to_device();
        self.dbr.set_sq_head(self.sq_pi as u16);
        barrier::mmio_wc_start();
        self.sq_doorbell.write64(self.last_ctrl);
        barrier::mmio_flush_writes();
    }

    /// Writes one WQE and rings the doorbell; returns its WQE counter.
    ///
    /// # Errors
    /// [`PostError`].
    pub fn post_send(&mut self, b: &mut SendWqeBuilder) -> Result<u16, PostError> {
        let c = self.write_send(b)?;
        self.ring_sq();
        Ok(c)
    }

    /// Posts a receive WQE; returns its counter.
    ///
    /// # Errors
    /// [`PostError`].
    pub fn post_recv(&mut self, sges: &[DataSegRepr]) -> Result<u32, PostError> {
        self.rq.write_wqe(self.rq_pi, sges)?;
        let c = self.rq_pi;
        self.rq_pi = self.rq_pi.wrapping_add(1);
        barrier::to_device();
        self.dbr.set_rq_head(self.rq_pi as u16);
        Ok(c)
    }

    /// Receive WQEs posted so far (the receive producer counter).
    #[must_use]
    pub fn rq_posted(&self) -> u32 {
        self.rq_pi
    }

    /// Restarts the counters at 0 (after a modify to RESET).
    pub fn reset_counters(&mut self) {
        self.sq_pi = 0;
        self.rq_pi = 0;
    }

    /// Writes a raw doorbell-record value (for tests of driver bugs).
    pub fn set_sq_head_raw(&self, head: u16) {
        self.dbr.set_sq_head(head);
    }

    /// The doorbell register (for tests of driver bugs).
    #[must_use]
    pub fn sq_doorbell(&self) -> &Arc<dyn DoorbellRegister> {
        &self.sq_doorbell
    }

    /// The send ring (for tests that write raw bytes).
    #[must_use]
    pub fn send_ring(&self) -> &SendRing<DmaBuffer> {
        &self.sq
    }

    /// Gives up the ring memory (for tests of freed memory).
    pub fn into_parts(
        self,
    ) -> (
        SendRing<DmaBuffer>,
        RecvRing<DmaBuffer>,
        QpDoorbellRecord<DmaBuffer>,
    ) {
        (self.sq, self.rq, self.dbr)
    }
}

/// A DMA buffer with its MR.
pub struct Buffer {
    /// The memory.
    pub mem: DmaBuffer,
    /// The keys (lkey == rkey).
    pub keys: MrKeys,
    /// The I/O virtual address the MR maps byte 0 at.
    pub iova: u64,
}

impl Buffer {
    /// A data segment over `off..off+len` of the buffer.
    #[must_use]
    pub fn sge(&self, off: u64, len: u32) -> DataSegRepr {
        DataSegRepr {
            byte_count: len,
            lkey: self.keys.lkey,
            addr: self.iova + off,
        }
    }
    /// Reads `len` bytes at `off`.
    #[must_use]
    pub fn bytes(&self, off: usize, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        let _ = self.mem.read(off, &mut v);
        v
    }
}

/// Physical pages of a buffer (it is contiguous in the simulator).
#[must_use]
pub fn pages_of(buf: &DmaBuffer) -> Vec<PhysAddr> {
    let n = (buf.len() as u64).div_ceil(PAGE_SIZE);
    (0..n)
        .map(|i| PhysAddr(buf.phys_addr().get() + i * PAGE_SIZE))
        .collect()
}

/// One HCA with a PD, a CQ (shared by send and receive) and one QP.
pub struct Node {
    /// The device.
    pub hca: Arc<SoftHca>,
    /// Protection domain.
    pub pd: Pdn,
    /// The CQ.
    pub cq: RawCq,
    /// The QP.
    pub qp: RawQp,
    /// Completion and async events.
    pub events: Arc<EventLog>,
}

impl Node {
    /// Builds a node at `ip` with a QP of type `ty` (RESET state).
    ///
    /// # Errors
    /// [`HcaError`] from the control commands.
    pub fn new(fabric: &Fabric, ip: [u8; 4], ty: QpType) -> Result<Self, HcaError> {
        Self::with_config(fabric, HcaConfig::new(ip), ty, 64, 64)
    }

    /// As [`Self::new`] with explicit sizes.
    ///
    /// # Errors
    /// [`HcaError`] from the control commands.
    pub fn with_config(
        fabric: &Fabric,
        cfg: HcaConfig,
        ty: QpType,
        sq_wqebbs: u32,
        cq_entries: u32,
    ) -> Result<Self, HcaError> {
        Self::on_hca(fabric.add_hca(cfg), ty, sq_wqebbs, cq_entries)
    }

    /// Builds a node whose port is on an Ethernet link over `socket` (see
    /// [`Fabric::add_hca_on_link`]), with a QP of type `ty` (RESET state).
    ///
    /// # Errors
    /// [`HcaError::InvalidOperation`] if the link cannot be set up (its
    /// configuration or pcap file); else those of the control commands.
    pub fn on_link(
        fabric: &Fabric,
        cfg: HcaConfig,
        link: LinkConfig,
        socket: Arc<dyn FrameSocket>,
        ty: QpType,
    ) -> Result<Self, HcaError> {
        let hca = fabric
            .add_hca_on_link(cfg, link, socket)
            .map_err(|_| HcaError::InvalidOperation)?;
        Self::on_hca(hca, ty, 64, 64)
    }

    /// Creates the PD, CQ and QP of a node on an existing HCA.
    ///
    /// # Errors
    /// [`HcaError`] from the control commands.
    pub fn on_hca(
        hca: Arc<SoftHca>,
        ty: QpType,
        sq_wqebbs: u32,
        cq_entries: u32,
    ) -> Result<Self, HcaError> {
        let events = EventLog::new();
        hca.set_async_event_handler(Some(events.clone()));
        let pd = hca.alloc_pd()?;
        let cq = RawCq::new(hca.create_cq(cq_entries, events.clone())?);
        let init = QpInit {
            qp_type: ty,
            pd,
            send_cq: cq.cqn,
            recv_cq: cq.cqn,
            sq_wqebbs,
            rq_entries: 64,
            max_recv_sge: 4,
            sq_sig_all: false,
            port: 1,
        };
        let qp = RawQp::new(hca.create_qp(&init)?);
        Ok(Self {
            hca,
            pd,
            cq,
            qp,
            events,
        })
    }

    /// Allocates and registers a buffer of `len` bytes (iova = its physical
    /// address + `0x1000_0000_0000`, so virtual and physical never coincide).
    ///
    /// # Errors
    /// [`HcaError`].
    pub fn buffer(&self, len: usize, access: AccessFlags) -> Result<Buffer, HcaError> {
        let mem = self.hca.dma_allocator().alloc(len).map_err(HcaError::Dma)?;
        let iova = mem.phys_addr().get() + 0x1000_0000_0000;
        let pages = pages_of(&mem);
        let keys = self.hca.reg_mr(&MrRegistration {
            pd: self.pd,
            iova,
            length: len as u64,
            page_shift: 12,
            pages: &pages,
            access,
        })?;
        Ok(Buffer { mem, keys, iova })
    }

    /// Brings the QP to RTS: RC towards `peer` (GID, QPN); datagram QPs
    /// with Q_Key `qkey`.
    ///
    /// # Errors
    /// [`HcaError`].
    pub fn bring_up(&self, peer: Option<(Gid, u32)>, opts: RcOptions) -> Result<(), HcaError> {
        let qpn = self.qp.qpn;
        let ty = self.hca.qp_type_of(qpn).ok_or(HcaError::NoSuchQp(qpn))?;
        bring_up_qp(&*self.hca, qpn, ty, peer, opts)
    }
}

/// RC connection parameters for [`Node::bring_up`].
#[derive(Copy, Clone, Debug)]
pub struct RcOptions {
    /// Path MTU.
    pub mtu: Mtu,
    /// ACK timeout exponent.
    pub timeout: u8,
    /// Transport retries.
    pub retry_cnt: u8,
    /// RNR retries (7 = infinite).
    pub rnr_retry: u8,
    /// RNR timer code the responder advertises.
    pub min_rnr_timer: u8,
    /// Initiator depth.
    pub max_rd_atomic: u8,
    /// Responder resources.
    pub max_dest_rd_atomic: u8,
    /// Remote access the responder allows.
    pub access: AccessFlags,
    /// Send PSN (the peer's receive PSN must match: both use it).
    pub psn: u32,
    /// Q_Key for UD QPs.
    pub qkey: u32,
}

impl Default for RcOptions {
    fn default() -> Self {
        Self {
            mtu: Mtu::Mtu1024,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 1,
            max_rd_atomic: 4,
            max_dest_rd_atomic: 4,
            access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
            psn: 0x00ab_cdef,
            qkey: 0x1111_2222,
        }
    }
}

/// Drives a QP RESET → INIT → RTR → RTS with the IBA attribute sets.
///
/// # Errors
/// [`HcaError`].
pub fn bring_up_qp(
    hca: &dyn HcaDevice,
    qpn: u32,
    ty: QpType,
    peer: Option<(Gid, u32)>,
    o: RcOptions,
) -> Result<(), HcaError> {
    use QpAttrMask as M;
    let mut a = QpAttr {
        port: 1,
        pkey_index: 0,
        access: o.access,
        qkey: o.qkey,
        ..QpAttr::default()
    };
    a.state = QpState::Init;
    let init_mask = match ty {
        QpType::Rc => M::STATE | M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS,
        QpType::Ud => M::STATE | M::PKEY_INDEX | M::PORT | M::QKEY,
        QpType::Gsi => M::STATE | M::PKEY_INDEX | M::QKEY,
    };
    hca.modify_qp(qpn, &a, init_mask)?;
    a.state = QpState::Rtr;
    if ty == QpType::Rc {
        let (dgid, dqpn) = peer.unwrap_or((Gid::default(), 1));
        a.av = AddressVector {
            dgid,
            hop_limit: 64,
            ..AddressVector::default()
        };
        a.path_mtu = o.mtu;
        a.dest_qpn = dqpn;
        a.rq_psn = o.psn;
        a.max_dest_rd_atomic = o.max_dest_rd_atomic;
        a.min_rnr_timer = o.min_rnr_timer;
        hca.modify_qp(
            qpn,
            &a,
            M::STATE
                | M::AV
                | M::PATH_MTU
                | M::DEST_QPN
                | M::RQ_PSN
                | M::MAX_DEST_RD_ATOMIC
                | M::MIN_RNR_TIMER,
        )?;
        a.state = QpState::Rts;
        a.timeout = o.timeout;
        a.retry_cnt = o.retry_cnt;
        a.rnr_retry = o.rnr_retry;
        a.sq_psn = o.psn;
        a.max_rd_atomic = o.max_rd_atomic;
        hca.modify_qp(
            qpn,
            &a,
            M::STATE | M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::SQ_PSN | M::MAX_QP_RD_ATOMIC,
        )
    } else {
        hca.modify_qp(qpn, &a, M::STATE)?;
        a.state = QpState::Rts;
        a.sq_psn = o.psn;
        hca.modify_qp(qpn, &a, M::STATE | M::SQ_PSN)
    }
}

/// Two nodes with connected RC QPs, in stepped mode.
///
/// # Errors
/// [`HcaError`].
pub fn rc_pair(fabric: &Fabric, opts: RcOptions) -> Result<(Node, Node), HcaError> {
    let a = Node::new(fabric, [10, 0, 0, 1], QpType::Rc)?;
    let b = Node::new(fabric, [10, 0, 0, 2], QpType::Rc)?;
    a.bring_up(Some((b.hca.gid(), b.qp.qpn)), opts)?;
    b.bring_up(Some((a.hca.gid(), a.qp.qpn)), opts)?;
    Ok((a, b))
}

/// Convenience: a SEND-type builder with one data segment.
#[must_use]
pub fn send_wqe(
    qp: &RawQp,
    opcode: SendOpcode,
    flags: CtrlFlags,
    imm: u32,
    sge: DataSegRepr,
) -> SendWqeBuilder {
    let mut b = qp.builder(opcode, flags, imm);
    let _ = b.data(sge);
    b
}

/// Convenience: an RDMA WRITE/READ builder.
#[must_use]
pub fn rdma_wqe(
    qp: &RawQp,
    opcode: SendOpcode,
    flags: CtrlFlags,
    imm: u32,
    raddr: u64,
    rkey: u32,
    sge: DataSegRepr,
) -> SendWqeBuilder {
    let mut b = qp.builder(opcode, flags, imm);
    let _ = b.raddr(raddr, rkey);
    if sge.byte_count > 0 {
        let _ = b.data(sge);
    }
    b
}

/// Maps DMA errors for tests.
#[must_use]
pub fn dma_err(e: DmaError) -> HcaError {
    HcaError::Dma(e)
}
