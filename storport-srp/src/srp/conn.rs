//! One connection of one channel: everything a login creates, and its
//! orderly end.
//!
//! A [`Conn`] is an *epoch* of a channel. Every connect builds a new one —
//! a new PD, CQ, RC QP, IU buffers, fast-registration pool and CM
//! connection — and every teardown ends it. Nothing is reused across
//! epochs, so:
//!
//! * a completion, a CM event or a response that belongs to a dead
//!   connection reaches that connection's handler and can do nothing to
//!   the new one (it carries no credit into it, finds none of its slots);
//! * an MR left registered by a request the QP flush fenced is unreachable
//!   for good: its PD has no other QP, and the pool is destroyed with the
//!   connection. A (hostile) target reconnecting can never use an rkey it
//!   was handed before.
//!
//! # The end of a connection
//! ```text
//!   retire(cause) ──► CM disconnect (DREQ; QP → ERR) ──► CM terminal event
//!                                                            │
//!   the CM ended it (REJ, DREQ, timeout) ────────────────────┤
//!                                                            ▼
//!                        QP destroy (flush: every WR completes, then the
//!                        drain markers) ──► on_flushed: every request of
//!                        this epoch still open is fenced and completed
//!                                    ──► on_destroyed ──► release (passive):
//!                                        CQ, pool, IU MRs, PD
//! ```
//! The CM never touches the QP after its terminal event, so the QP is
//! destroyed only then. `on_flushed` is the fence: the QP is in ERR, no
//! RDMA of the target can reach any buffer of this epoch any more.
//!
//! # IRQL
//! [`Conn::build`] and [`Conn::release`] run on the passive worker; every
//! handler here runs at `DISPATCH_LEVEL`.

use alloc::sync::{Arc, Weak};
use core::sync::atomic::{AtomicU64, Ordering};

use hca_lowlevel::device::{AccessFlags, AsyncEvent, QpType};
use kverbs::cm::qp::init_attrs;
use kverbs::cm::{CmEvent, CmHandler, CmId, CmPort, CmQp};
use kverbs::cq::{Cq, CqConfig, CqHandler, WorkCompletions};
use kverbs::error::VerbsError;
use kverbs::irql::{Dispatch, LeDispatch, Passive};
use kverbs::mr::{FrPool, Mr};
use kverbs::pd::Pd;
use kverbs::platform::{DpcTarget, Platform};
use kverbs::qp::{Qp, QpConfig, QpHandler};
use kverbs::sync::{SetOnce, SpinLock};
use kverbs::wr::{Completion, Payload, SendWr, Sge, Signal};

use super::engine::Engine;
use super::login::{LoginFailure, Negotiated};
use super::recovery::Cause;
use crate::wire::srp::LoginReqRepr;

/// What a work request is, as its completion tells the channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WrCtx {
    /// A receive buffer.
    Recv(u16),
    /// A command's SEND.
    Send {
        /// Command slot.
        slot: u16,
        /// Its generation.
        generation: u16,
    },
    /// The last LOCAL_INV of a command's MRs.
    Inv {
        /// Command slot.
        slot: u16,
        /// Its generation.
        generation: u16,
    },
    /// A task management function's SEND.
    TmfSend {
        /// TMF slot.
        slot: u16,
        /// Its generation.
        generation: u16,
    },
    /// A response to a target request (`SRP_CRED_RSP`, `SRP_AER_RSP`).
    RspSend(u8),
}

/// Byte layout of a connection's IU buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct IuLayout {
    /// Bytes per command IU (a multiple of 64).
    pub cmd_stride: u32,
    /// Command slots.
    pub cmd_count: u32,
    /// Offset of the TMF IUs.
    pub tmf_base: u64,
    /// TMF IUs.
    pub tmf_count: u32,
    /// Offset of the response IUs.
    pub rsp_base: u64,
    /// Response IUs.
    pub rsp_count: u32,
    /// Bytes per receive buffer (a multiple of 64).
    pub rx_stride: u32,
    /// Receive buffers.
    pub rx_count: u32,
    /// Bytes of the transmit buffer.
    pub tx_len: u64,
}

/// Bytes of a TMF or response IU slot.
pub(crate) const SMALL_IU: u64 = 64;

/// Receive buffers a connection holds back after their IUs are read, to
/// repost them with the next one in a single receive batch (see
/// [`Conn::repost_recv`]). The layout has this many buffers beyond the
/// command, TMF and unsolicited ones, so the receives posted never drop
/// below what the target may send into (the low-water mark).
pub(crate) const RX_REPOST_HELD: u32 = 3;

/// Bit position of the held count in [`Conn::rx_held`] (three 16-bit
/// buffer indices below it).
const RX_HELD_COUNT_SHIFT: u32 = 48;

// The word holds three indices below the count; `Conn::repost_recv` posts
// them and the fourth buffer as one batch of four.
const _: () = assert!(RX_REPOST_HELD == 3);

impl IuLayout {
    /// The layout for `cmd_count` commands of `cmd_len` bytes, `tmf_count`
    /// TMFs, `rsp_count` responses, `rx_count` receives of `rx_len`.
    pub(crate) fn new(
        cmd_count: u32,
        cmd_len: u32,
        tmf_count: u32,
        rsp_count: u32,
        rx_count: u32,
        rx_len: u32,
    ) -> Self {
        let cmd_stride = cmd_len.div_ceil(64).saturating_mul(64);
        let tmf_base = u64::from(cmd_stride) * u64::from(cmd_count);
        let rsp_base = tmf_base + SMALL_IU * u64::from(tmf_count);
        IuLayout {
            cmd_stride,
            cmd_count,
            tmf_base,
            tmf_count,
            rsp_base,
            rsp_count,
            rx_stride: rx_len.div_ceil(64).saturating_mul(64),
            rx_count,
            tx_len: rsp_base + SMALL_IU * u64::from(rsp_count),
        }
    }

    /// Offset of command slot `slot`'s IU.
    pub(crate) fn cmd_offset(&self, slot: u16) -> u64 {
        u64::from(self.cmd_stride) * u64::from(slot)
    }

    /// Offset of TMF slot `slot`'s IU.
    pub(crate) fn tmf_offset(&self, slot: u16) -> u64 {
        self.tmf_base + SMALL_IU * u64::from(slot)
    }

    /// Offset of response IU `index`.
    pub(crate) fn rsp_offset(&self, index: u8) -> u64 {
        self.rsp_base + SMALL_IU * u64::from(index)
    }
}

/// Where a connection is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Login in progress.
    Connecting,
    /// Logged in; carries I/O.
    Live,
    /// Ending.
    Retiring,
}

/// A connection's life, under its lock.
#[derive(Debug)]
pub(crate) struct Life {
    pub phase: Phase,
    pub cm_id: Option<CmId>,
    /// The CM connect call returned (successfully or not).
    pub cm_issued: bool,
    pub cm_terminal: bool,
    pub disconnect_requested: bool,
    pub destroy_issued: bool,
    pub flushed: bool,
    pub cause: Cause,
    pub failure: Option<LoginFailure>,
    pub negotiated: Option<Negotiated>,
}

/// One connection epoch of a channel (see the [module docs](self)).
pub(crate) struct Conn<P: Platform> {
    pub target: u8,
    pub channel: u8,
    pub epoch: u32,
    pub login: LoginReqRepr,
    pub layout: IuLayout,
    pub pd: Pd<P>,
    pub cq: Cq<P, WrCtx>,
    pub qp: Qp<P, WrCtx>,
    pub cm_qp: Arc<dyn CmQp>,
    pub tx: Mr<P>,
    pub rx: Mr<P>,
    pub pool: FrPool<P>,
    /// The device's reserved lkey (local access by physical address): the
    /// gather entries of immediate data point at the request's own
    /// buffer with it, so the data is never copied into `tx`.
    pub reserved_lkey: u32,
    /// Receive buffers read and waiting to be reposted (up to
    /// [`RX_REPOST_HELD`]): their indices, 16 bits each from bit 0, and
    /// their count at [`RX_HELD_COUNT_SHIFT`]. One word, so holding a
    /// buffer back costs a compare-exchange, not a lock.
    rx_held: AtomicU64,
    pub life: SpinLock<Life, P>,
    pub handler: Arc<ConnHandler<P>>,
}

impl<P: Platform> core::fmt::Debug for Conn<P> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Conn")
            .field("target", &self.target)
            .field("channel", &self.channel)
            .field("epoch", &self.epoch)
            .field("qpn", &self.qp.qpn())
            .finish()
    }
}

/// A connection's IU buffers and MR pool.
type Buffers<P> = (Mr<P>, Mr<P>, FrPool<P>);

/// How to size a connection's objects.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ConnShape {
    pub layout: IuLayout,
    pub send_wqebbs: u32,
    pub pool_size: u32,
    pub max_pages_per_mr: u32,
    pub dpc_target: DpcTarget,
    pub port: u8,
}

impl<P: Platform> Conn<P> {
    /// Creates a connection's objects, the QP in INIT with its receives
    /// posted.
    ///
    /// # Errors
    /// What creating an object returned; everything created is freed.
    ///
    /// # IRQL
    /// `PASSIVE_LEVEL`.
    #[expect(clippy::too_many_arguments, reason = "the parts of a connection")]
    pub(crate) fn build(
        engine: &Arc<Engine<P>>,
        cm: &CmPort<P>,
        target: u8,
        channel: u8,
        epoch: u32,
        login: LoginReqRepr,
        shape: &ConnShape,
        irql: &Passive<'_>,
    ) -> Result<Arc<Self>, VerbsError> {
        let device = engine.device();
        let handler = Arc::new(ConnHandler {
            engine: Arc::downgrade(engine),
            link: SetOnce::new(),
        });
        let pd = device.alloc_pd(irql)?;
        let cleanup_pd = |pd: &Pd<P>| {
            let _ = pd.dealloc(irql);
        };
        let layout = shape.layout;
        // Every send WQEBB and receive slot (one more each for the drain
        // markers, rounded up to the device's powers of two) may hold a
        // completion.
        let pow2 = |n: u32| {
            n.saturating_add(1)
                .checked_next_power_of_two()
                .unwrap_or(u32::MAX)
        };
        let cq_entries = pow2(shape.send_wqebbs).saturating_add(pow2(layout.rx_count));
        let cq = match Cq::create(
            device,
            CqConfig {
                dpc_target: shape.dpc_target,
                ..CqConfig::new(cq_entries)
            },
            handler.clone(),
            irql,
        ) {
            Ok(cq) => cq,
            Err(e) => {
                cleanup_pd(&pd);
                return Err(e);
            }
        };
        let qp_handler = cm.qp_events(handler.clone(), irql);
        let qp = match Qp::create(
            &pd,
            &QpConfig {
                qp_type: QpType::Rc,
                send_cq: cq.clone(),
                recv_cq: cq.clone(),
                send_wqebbs: shape.send_wqebbs,
                recv_slots: layout.rx_count,
                max_recv_sge: 1,
                port: shape.port,
            },
            qp_handler,
            irql,
        ) {
            Ok(qp) => qp,
            Err(e) => {
                let _ = cq.destroy(irql);
                cleanup_pd(&pd);
                return Err(e);
            }
        };
        // From here on a failure destroys the QP asynchronously; the
        // half-built connection is handed to the normal release path.
        let built = (|| -> Result<Buffers<P>, VerbsError> {
            let (attr, mask) = init_attrs(
                shape.port,
                AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE,
            );
            qp.modify(&attr, mask, irql)?;
            let tx_len = usize::try_from(layout.tx_len).map_err(|_| VerbsError::InvalidArgument)?;
            let rx_len = usize::try_from(
                u64::from(layout.rx_stride).saturating_mul(u64::from(layout.rx_count)),
            )
            .map_err(|_| VerbsError::InvalidArgument)?;
            // The IU buffers are local only: the target never reaches
            // them; SENDs read them and receives write them.
            let tx = Mr::alloc(&pd, tx_len, AccessFlags::LOCAL_WRITE, irql)?;
            let rx = match Mr::alloc(&pd, rx_len, AccessFlags::LOCAL_WRITE, irql) {
                Ok(rx) => rx,
                Err(e) => {
                    let _ = tx.dereg(irql);
                    return Err(e);
                }
            };
            let pool =
                match FrPool::new(&pd, shape.pool_size as usize, shape.max_pages_per_mr, irql) {
                    Ok(pool) => pool,
                    Err(e) => {
                        let _ = tx.dereg(irql);
                        let _ = rx.dereg(irql);
                        return Err(e);
                    }
                };
            Ok((tx, rx, pool))
        })();
        let (tx, rx, pool) = match built {
            Ok(parts) => parts,
            Err(e) => {
                engine.release_partial(qp, cq, pd, irql);
                return Err(e);
            }
        };
        let cm_qp: Arc<dyn CmQp> = Arc::new(qp.clone());
        let conn = Arc::new(Conn {
            target,
            channel,
            epoch,
            login,
            layout,
            pd,
            cq,
            qp,
            cm_qp,
            tx,
            rx,
            pool,
            reserved_lkey: device.attr().reserved_lkey,
            rx_held: AtomicU64::new(0),
            life: SpinLock::new(Life {
                phase: Phase::Connecting,
                cm_id: None,
                cm_issued: false,
                cm_terminal: false,
                disconnect_requested: false,
                destroy_issued: false,
                flushed: false,
                cause: Cause::Transport,
                failure: None,
                negotiated: None,
            }),
            handler: handler.clone(),
        });
        // Kept in the engine's registry until its objects are released;
        // the handler reaches both through the link. A fresh handler's
        // cell: set here, once.
        let link = Arc::new(ConnLink {
            engine: Arc::clone(engine),
            conn: Arc::clone(&conn),
        });
        let _ = handler.link.set(Arc::downgrade(&link));
        engine.register_conn(link, irql);
        for index in 0..layout.rx_count {
            let Ok(index) = u16::try_from(index) else {
                break;
            };
            if !conn.post_recv(index, irql) {
                conn.retire(Cause::Transport, irql);
                conn.cm_ended(irql);
                return Err(VerbsError::QueueFull);
            }
        }
        Ok(conn)
    }

    /// Posts receive buffer `index`; `false` if the QP refused it.
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    pub(crate) fn post_recv(&self, index: u16, irql: &impl LeDispatch) -> bool {
        self.post_recvs(&[index], irql)
    }

    /// Gives back receive buffer `index`, whose IU has been read: it is
    /// held until [`RX_REPOST_HELD`] others are, then all go out in one
    /// receive batch (one lock, one publish, one doorbell record for
    /// four receives). `false` if that post failed.
    ///
    /// Safe against the target because the layout counts the held
    /// buffers on top of every receive the target may fill (commands,
    /// TMFs, unsolicited requests): at most [`RX_REPOST_HELD`] are held,
    /// so never fewer than those are posted. Buffers still held when the
    /// connection ends were never posted, so no flush completion names
    /// them; they go with the connection's buffer.
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    pub(crate) fn repost_recv(&self, index: u16, irql: &impl LeDispatch) -> bool {
        let mut held = self.rx_held.load(Ordering::Relaxed);
        loop {
            let (next, full) = hold_recv(held, index);
            // One drain loop delivers a CQ's completions, so this is never
            // contended; the compare-exchange only keeps it exact if it were.
            match self.rx_held.compare_exchange_weak(
                held,
                next,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => match full {
                    Some(indices) => return self.post_recvs(&indices, irql),
                    None => return true,
                },
                Err(actual) => held = actual,
            }
        }
    }

    /// Posts receive buffers `indices` in one batch; `false` if the QP
    /// refused any (then none is posted).
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    fn post_recvs(&self, indices: &[u16], irql: &impl LeDispatch) -> bool {
        let stride = u64::from(self.layout.rx_stride);
        let Ok(mut batch) = self.qp.begin_recv(irql) else {
            return false;
        };
        for &index in indices {
            let Some(sge) = self
                .rx
                .sge(stride * u64::from(index), self.layout.rx_stride)
            else {
                return false;
            };
            if batch.recv(&[sge], WrCtx::Recv(index)).is_err() {
                return false;
            }
        }
        usize::try_from(batch.commit()).is_ok_and(|n| n == indices.len())
    }

    /// The SGE of `len` bytes at `offset` of the transmit buffer.
    pub(crate) fn tx_sge(&self, offset: u64, len: u32) -> Option<Sge> {
        self.tx.sge(offset, len)
    }

    /// Copies `iu` into the send buffer at `offset` and posts it as one
    /// signalled SEND carrying `ctx`: how the small control IUs (TMF,
    /// CRED/AER responses) go out. `false` if it could not be posted.
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    pub(crate) fn send_iu(
        &self,
        offset: u64,
        iu: &[u8],
        ctx: WrCtx,
        irql: &impl LeDispatch,
    ) -> bool {
        self.send_iu_at(offset, iu, ctx, irql).is_some()
    }

    /// [`Conn::send_iu`], returning the send-queue position the IU was
    /// posted at (see `SendBatch::position`): what a LUN reset compares
    /// its commands' positions with.
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    pub(crate) fn send_iu_at(
        &self,
        offset: u64,
        iu: &[u8],
        ctx: WrCtx,
        irql: &impl LeDispatch,
    ) -> Option<u32> {
        let len = u32::try_from(iu.len()).ok()?;
        self.tx
            .mem()
            .write(usize::try_from(offset).unwrap_or(usize::MAX), iu)
            .ok()?;
        let sge = self.tx_sge(offset, len)?;
        let mut batch = self.qp.begin_send(irql).ok()?;
        let at = batch.position();
        let sent = batch
            .send(&SendWr::new(Payload::Sges(&[sge])), Signal::Signalled(ctx))
            .is_ok()
            && batch.commit() == 1;
        sent.then_some(at)
    }

    /// The cause the connection ended with.
    pub(crate) fn cause(&self, irql: &impl LeDispatch) -> Cause {
        self.life.lock(irql).cause
    }

    /// The negotiated limits (after a successful login).
    pub(crate) fn negotiated(&self, irql: &impl LeDispatch) -> Option<Negotiated> {
        self.life.lock(irql).negotiated
    }

    /// Starts ending the connection (idempotent: the first cause wins).
    /// Returns `true` the first time.
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    pub(crate) fn retire(&self, cause: Cause, irql: &impl LeDispatch) -> bool {
        let disconnect = {
            let mut life = self.life.lock(irql);
            if life.phase == Phase::Retiring {
                return false;
            }
            life.phase = Phase::Retiring;
            life.cause = cause;
            if life.cm_terminal || life.disconnect_requested {
                None
            } else if let Some(id) = life.cm_id {
                life.disconnect_requested = true;
                Some(id)
            } else {
                // The connect call has not returned yet: it disconnects
                // when it does (see `cm_issued`).
                None
            }
        };
        if let Some(id) = disconnect {
            self.disconnect(id, irql);
        }
        // Nothing of the CM to wait for: end now.
        let ended = {
            let life = self.life.lock(irql);
            life.cm_terminal || (life.cm_issued && life.cm_id.is_none())
        };
        if ended {
            self.cm_ended(irql);
        }
        true
    }

    fn disconnect(&self, id: CmId, irql: &impl LeDispatch) {
        let Some(engine) = self.handler.engine.upgrade() else {
            return;
        };
        match engine.cm().disconnect(id, &[], irql) {
            // The terminal event follows.
            Ok(()) | Err(kverbs::cm::CmError::Closing) => {}
            // The connection is gone already (its terminal event came).
            Err(_) => {
                self.life.lock(irql).cm_terminal = true;
            }
        }
    }

    /// The CM connect call returned with `id` (or failed).
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    pub(crate) fn connect_issued(&self, id: Option<CmId>, irql: &impl LeDispatch) {
        let (disconnect, ended) = {
            let mut life = self.life.lock(irql);
            life.cm_issued = true;
            if life.cm_id.is_none() {
                life.cm_id = id;
            }
            let retiring = life.phase == Phase::Retiring;
            let disconnect = match life.cm_id {
                Some(id) if retiring && !life.cm_terminal && !life.disconnect_requested => {
                    life.disconnect_requested = true;
                    Some(id)
                }
                _ => None,
            };
            (disconnect, id.is_none() || (retiring && life.cm_terminal))
        };
        if let Some(id) = disconnect {
            self.disconnect(id, irql);
        }
        if ended {
            self.cm_ended(irql);
        }
    }

    /// The CM will not touch the QP again: destroy it (once).
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    pub(crate) fn cm_ended(&self, irql: &impl LeDispatch) {
        let destroy = {
            let mut life = self.life.lock(irql);
            life.cm_terminal = true;
            if life.phase != Phase::Retiring {
                life.phase = Phase::Retiring;
            }
            !core::mem::replace(&mut life.destroy_issued, true)
        };
        if destroy {
            // Flush, then destroy; on_flushed and on_destroyed follow.
            let _ = self.qp.destroy(irql);
        }
    }
}

/// Holds receive buffer `index` in `held` (a [`Conn::rx_held`] word): the
/// new word, and the four buffers to post together once
/// [`RX_REPOST_HELD`] were held already (the word is then empty).
fn hold_recv(held: u64, index: u16) -> (u64, Option<[u16; 4]>) {
    let count = held >> RX_HELD_COUNT_SHIFT;
    if count < u64::from(RX_REPOST_HELD) {
        let slot = u64::from(index) << (16 * count);
        return ((held | slot) + (1 << RX_HELD_COUNT_SHIFT), None);
    }
    let at = |i: u64| u16::try_from((held >> (16 * i)) & 0xffff).unwrap_or(u16::MAX);
    (0, Some([at(0), at(1), at(2), index]))
}

/// A registered connection and its engine, both held strongly: what the
/// connection's handler reaches them through, with one weak reference to
/// upgrade per event (per polled batch, a per-round cost a QD 1 read pays
/// for every I/O) instead of one for each.
///
/// # Ownership
/// Only the engine's connection registry keeps a link (a handler's upgrade
/// holds one for the length of one event). The registry belongs to the
/// transport handle and the engine refers to it weakly (see
/// `engine::ConnRegistry`), so the link's engine reference closes no cycle
/// that outlives the handle. The kverbs objects that call the handler (the
/// CQ, the QP, the CM) hold the handler, and the handler holds the link
/// only weakly: they keep neither the connection nor the engine alive.
/// Once the connection is released (or forgotten) its link is gone, and no
/// late event of its objects reaches the engine.
pub(crate) struct ConnLink<P: Platform> {
    pub engine: Arc<Engine<P>>,
    pub conn: Arc<Conn<P>>,
}

/// The handler of one connection's CQ, QP and CM events.
pub(crate) struct ConnHandler<P: Platform> {
    /// The engine, for what a connection asks of it outside an event.
    engine: Weak<Engine<P>>,
    /// Set once the connection exists (its CQ and QP, which call this
    /// handler, are created first); read without a lock on every polled
    /// batch. Dead once the connection has left the engine's registry.
    link: SetOnce<Weak<ConnLink<P>>>,
}

impl<P: Platform> ConnHandler<P> {
    /// The connection and its engine, while the connection is registered.
    /// Every caller runs at `DISPATCH_LEVEL` (a CQ's DPC, a QP or CM
    /// event). Inlined: it runs once per polled batch, so its call is a
    /// per-round cost that a QD 1 read pays for every I/O.
    #[inline]
    fn get(&self, _irql: &Dispatch<'_>) -> Option<Arc<ConnLink<P>>> {
        self.link.get()?.upgrade()
    }
}

impl<P: Platform> CqHandler<WrCtx> for ConnHandler<P> {
    fn on_completion(&self, completion: Completion<WrCtx>, irql: &Dispatch<'_>) {
        if let Some(link) = self.get(irql) {
            link.engine.on_completion(&link.conn, completion, irql);
        }
    }

    /// The engine and the connection are looked up once per polled batch,
    /// not once per completion.
    fn on_completions(&self, completions: &mut WorkCompletions<'_, WrCtx>, irql: &Dispatch<'_>) {
        match self.get(irql) {
            Some(link) => {
                let (engine, conn) = (&link.engine, &link.conn);
                for completion in completions {
                    engine.on_completion(conn, completion, irql);
                }
            }
            // The connection is gone: its completions have no one to
            // reach (as `on_completion` drops them).
            None => completions.for_each(drop),
        }
    }
}

impl<P: Platform> QpHandler for ConnHandler<P> {
    fn on_async_event(&self, event: AsyncEvent, irql: &Dispatch<'_>) {
        let kind = match event {
            AsyncEvent::QpFatal { .. } => 1,
            AsyncEvent::QpRequestError { .. } => 2,
            AsyncEvent::QpAccessError { .. } => 3,
            _ => return,
        };
        if let Some(link) = self.get(irql) {
            link.engine.conn_failed(
                &link.conn,
                Cause::Transport,
                super::engine::Why::QpEvent(kind),
                irql,
            );
        }
    }

    fn on_flushed(&self, _result: Result<(), VerbsError>, irql: &Dispatch<'_>) {
        if let Some(link) = self.get(irql) {
            link.conn.life.lock(irql).flushed = true;
            link.engine.on_flushed(&link.conn, irql);
        }
    }

    fn on_destroyed(&self, irql: &Dispatch<'_>) {
        if let Some(link) = self.get(irql) {
            link.engine.on_qp_destroyed(&link.conn, irql);
        }
    }
}

impl<P: Platform> CmHandler for ConnHandler<P> {
    fn on_event(&self, id: CmId, event: CmEvent<'_>, irql: &Dispatch<'_>) {
        let Some(link) = self.get(irql) else {
            return;
        };
        {
            let mut life = link.conn.life.lock(irql);
            if life.cm_id.is_none() {
                life.cm_id = Some(id);
            }
        }
        link.engine.on_cm_event(&link.conn, event, irql);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every buffer given back comes out exactly once, in order, four at
    /// a time, and never more than three are held.
    #[test]
    fn held_receives_go_out_in_fours() {
        let mut held = 0u64;
        let mut posted = alloc::vec::Vec::new();
        for index in [7u16, 0, u16::MAX, 300, 5, 6, 1, 2, 9] {
            let (next, full) = hold_recv(held, index);
            held = next;
            if let Some(batch) = full {
                posted.extend_from_slice(&batch);
                assert_eq!(held, 0);
            }
            assert!(held >> RX_HELD_COUNT_SHIFT <= u64::from(RX_REPOST_HELD));
        }
        assert_eq!(posted, [7, 0, u16::MAX, 300, 5, 6, 1, 2]);
        assert_eq!(held, 9 | (1 << RX_HELD_COUNT_SHIFT));
    }

    #[test]
    fn layout() {
        let l = IuLayout::new(4, 100, 2, 3, 5, 300);
        assert_eq!(l.cmd_stride, 128);
        assert_eq!(l.cmd_offset(3), 384);
        assert_eq!(l.tmf_base, 512);
        assert_eq!(l.tmf_offset(1), 576);
        assert_eq!(l.rsp_base, 640);
        assert_eq!(l.rsp_offset(2), 768);
        assert_eq!(l.tx_len, 832);
        assert_eq!(l.rx_stride, 320);
    }
}
