//! Shared by the verbs-object tests: the verifier's global allocator, a
//! fabric of software HCAs opened through kverbs, a collecting CQ handler,
//! QP bring-up, and waiting in either execution mode.

#![allow(dead_code, reason = "each test binary uses a different subset")]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hca_lowlevel::device::{
    AccessFlags, AddressVector, AsyncEvent, Gid, Mtu, QpAttr, QpAttrMask, QpState, QpType,
};
use hca_lowlevel::sim::{ExecMode, Fabric, FabricConfig, HcaConfig, SoftHca};
use kverbs::cq::{Cq, CqConfig, CqHandler};
use kverbs::device::{Device, DeviceConfig};
use kverbs::hostdev::VerifiedHca;
use kverbs::irql::{Dispatch, Passive};
use kverbs::pd::Pd;
use kverbs::platform::host::{HostPlatform, VerifierAllocator};
use kverbs::qp::{NoQpEvents, Qp, QpConfig, QpHandler};
use kverbs::wr::Completion;

#[global_allocator]
static ALLOCATOR: VerifierAllocator = VerifierAllocator;

pub type Hp = HostPlatform;

/// A count from the environment (for the big sweeps), or `default`.
pub fn env_count(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The two execution modes every object test runs in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Device thread + threaded host platform (real concurrency).
    Threaded,
    /// Stepped HCA (the test runs the engine) + manual host platform
    /// (the test runs the DPCs and work items).
    Stepped,
}

pub const MODES: [Mode; 2] = [Mode::Threaded, Mode::Stepped];

pub struct World {
    pub mode: Mode,
    pub platform: Hp,
    pub fabric: Fabric,
}

impl World {
    pub fn new(mode: Mode) -> Self {
        Self::with_seed(mode, 0)
    }

    pub fn with_seed(mode: Mode, seed: u64) -> Self {
        let platform = match mode {
            Mode::Threaded => HostPlatform::new(),
            Mode::Stepped => HostPlatform::manual(),
        };
        let fabric = Fabric::new(FabricConfig {
            mode: match mode {
                Mode::Threaded => ExecMode::Thread,
                Mode::Stepped => ExecMode::Stepped,
            },
            seed,
            ..FabricConfig::default()
        });
        World {
            mode,
            platform,
            fabric,
        }
    }

    /// Lets everything run once: the HCA engine, then the queued DPCs and
    /// work items (stepped), or a short pause (threaded).
    pub fn step(&self) {
        match self.mode {
            Mode::Stepped => {
                self.fabric.run_until_idle();
                self.platform.run_until_idle(&mut |_| 0, 100_000);
                // Let device timers (RNR, ACK timeout) run on the virtual
                // clock.
                self.fabric.advance(Duration::from_micros(100));
            }
            Mode::Threaded => std::thread::sleep(Duration::from_micros(200)),
        }
    }

    /// Steps until `cond` holds (panics after 30 s).
    pub fn wait(&self, what: &str, cond: impl Fn() -> bool) {
        let start = Instant::now();
        while !cond() {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "timed out waiting for {what}"
            );
            self.step();
        }
    }

    /// Opens an HCA at `ip` through kverbs.
    pub fn node(&self, ip: [u8; 4], p: &Passive<'_>) -> Node {
        let hca = self.fabric.add_hca(HcaConfig::new(ip));
        let dev = Device::open(
            &self.platform,
            VerifiedHca::new(hca.clone()),
            DeviceConfig::default(),
            p,
        )
        .unwrap();
        let pd = dev.alloc_pd(p).unwrap();
        Node { hca, dev, pd }
    }

    pub fn finish(self) {
        let World {
            platform, fabric, ..
        } = self;
        drop(fabric);
        platform.finish();
    }
}

pub struct Node {
    pub hca: Arc<SoftHca>,
    pub dev: Device<Hp>,
    pub pd: Pd<Hp>,
}

impl Node {
    pub fn gid(&self) -> Gid {
        self.hca.gid()
    }

    pub fn cq<C: Send + 'static>(
        &self,
        entries: u32,
        handler: Arc<dyn CqHandler<C>>,
        p: &Passive<'_>,
    ) -> Cq<Hp, C> {
        Cq::create(&self.dev, CqConfig::new(entries), handler, p).unwrap()
    }

    pub fn qp<C: Send + 'static>(
        &self,
        ty: QpType,
        cq: &Cq<Hp, C>,
        send: u32,
        recv: u32,
        p: &Passive<'_>,
    ) -> Qp<Hp, C> {
        self.qp_with(ty, cq, send, recv, Arc::new(NoQpEvents), p)
    }

    pub fn qp_with<C: Send + 'static>(
        &self,
        ty: QpType,
        cq: &Cq<Hp, C>,
        send: u32,
        recv: u32,
        handler: Arc<dyn QpHandler>,
        p: &Passive<'_>,
    ) -> Qp<Hp, C> {
        let cfg = QpConfig {
            qp_type: ty,
            send_cq: cq.clone(),
            recv_cq: cq.clone(),
            send_wqebbs: send,
            recv_slots: recv,
            max_recv_sge: 4,
            port: 1,
        };
        Qp::create(&self.pd, &cfg, handler, p).unwrap()
    }
}

/// A CQ handler that records every completion (storage reserved up front:
/// pushing never allocates at DISPATCH_LEVEL).
pub struct Collect<C> {
    pub got: Mutex<Vec<Completion<C>>>,
    pub count: AtomicUsize,
    pub events: Mutex<Vec<AsyncEvent>>,
    pub destroyed: AtomicUsize,
}

impl<C> Collect<C> {
    pub fn new(capacity: usize) -> Arc<Self> {
        Arc::new(Collect {
            got: Mutex::new(Vec::with_capacity(capacity)),
            count: AtomicUsize::new(0),
            events: Mutex::new(Vec::with_capacity(64)),
            destroyed: AtomicUsize::new(0),
        })
    }

    /// Completions collected and not taken yet.
    pub fn len(&self) -> usize {
        self.got.lock().unwrap().len()
    }

    /// Completions collected since the start.
    pub fn total(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }

    pub fn take(&self) -> Vec<Completion<C>> {
        let mut v = self.got.lock().unwrap();
        let cap = v.capacity();
        std::mem::replace(&mut *v, Vec::with_capacity(cap))
    }
}

impl<C: Send> CqHandler<C> for Collect<C> {
    fn on_completion(&self, c: Completion<C>, _irql: &Dispatch<'_>) {
        let mut v = self.got.lock().unwrap();
        assert!(v.len() < v.capacity(), "collector full: would allocate");
        v.push(c);
        self.count.fetch_add(1, Ordering::Release);
    }

    fn on_async_event(&self, e: AsyncEvent, _irql: &Dispatch<'_>) {
        let mut v = self.events.lock().unwrap();
        if v.len() < v.capacity() {
            v.push(e);
        }
    }

    fn on_destroyed(&self, _irql: &Dispatch<'_>) {
        self.destroyed.fetch_add(1, Ordering::AcqRel);
    }
}

/// Default RC bring-up parameters.
pub const PSN: u32 = 0x00ab_cdef;
pub const QKEY: u32 = 0x1111_2222;

/// RESET → INIT → RTR → RTS through kverbs' synchronous modify.
pub fn bring_up<C: Send + 'static>(qp: &Qp<Hp, C>, peer: Option<(Gid, u32)>, p: &Passive<'_>) {
    use QpAttrMask as M;
    let ty = qp.qp_type();
    let mut a = QpAttr {
        state: QpState::Init,
        port: 1,
        pkey_index: 0,
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        qkey: QKEY,
        ..QpAttr::default()
    };
    let init = match ty {
        QpType::Rc => M::STATE | M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS,
        QpType::Ud => M::STATE | M::PKEY_INDEX | M::PORT | M::QKEY,
        QpType::Gsi => M::STATE | M::PKEY_INDEX | M::QKEY,
    };
    qp.modify(&a, init, p).unwrap();
    a.state = QpState::Rtr;
    if ty == QpType::Rc {
        let (dgid, dqpn) = peer.unwrap();
        a.av = AddressVector {
            dgid,
            hop_limit: 64,
            ..AddressVector::default()
        };
        a.path_mtu = Mtu::Mtu1024;
        a.dest_qpn = dqpn;
        a.rq_psn = PSN;
        a.max_dest_rd_atomic = 4;
        a.min_rnr_timer = 1;
        qp.modify(
            &a,
            M::STATE
                | M::AV
                | M::PATH_MTU
                | M::DEST_QPN
                | M::RQ_PSN
                | M::MAX_DEST_RD_ATOMIC
                | M::MIN_RNR_TIMER,
            p,
        )
        .unwrap();
        a.state = QpState::Rts;
        a.timeout = 14;
        a.retry_cnt = 7;
        a.rnr_retry = 7;
        a.sq_psn = PSN;
        a.max_rd_atomic = 4;
        qp.modify(
            &a,
            M::STATE | M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::SQ_PSN | M::MAX_QP_RD_ATOMIC,
            p,
        )
        .unwrap();
    } else {
        qp.modify(&a, M::STATE, p).unwrap();
        a.state = QpState::Rts;
        a.sq_psn = PSN;
        qp.modify(&a, M::STATE | M::SQ_PSN, p).unwrap();
    }
}
