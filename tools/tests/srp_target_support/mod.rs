//! Shared by the SRP target tests: a fabric with a target HCA and an
//! initiator HCA, the target started on the first, and a *raw* SRP
//! initiator on the second — an RC QP, IU buffers and per-I/O memory
//! regions driven by hand through kverbs and `kverbs::cm`, with every IU
//! built with `storport_srp::wire::srp`. No SRP engine is involved: the
//! tests decide every byte the initiator sends.
//!
//! The verifier's allocator is installed; every test ends with
//! `HostPlatform::finish`, which fails it on any IRQL violation by the
//! target, the initiator or the libraries under them.

#![allow(dead_code, reason = "each test binary uses a different subset")]

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hca_lowlevel::device::{AccessFlags, AsyncEvent, QpType};
use hca_lowlevel::sim::{ExecMode, Fabric, FabricConfig, HcaConfig, SoftHca};
use hca_lowlevel::wire::{Gid, Ipv4Address, Qpn};
use kverbs::cm::qp::init_attrs;
use kverbs::cm::rdma_cm::{RdmaCmEndpoints, ack_timeout_for};
use kverbs::cm::{
    CmConfig, CmError, CmEvent, CmHandler, CmId, CmPort, CmPortConfig, CmQp, ConnParams,
    ConnectRequest, LocalQp, MadAddress,
};
use kverbs::cq::{Cq, CqConfig, CqHandler};
use kverbs::device::{Device, DeviceConfig};
use kverbs::hostdev::VerifiedHca;
use kverbs::irql::{Dispatch, Passive};
use kverbs::mr::Mr;
use kverbs::pd::Pd;
use kverbs::platform::host::{HostPlatform, VerifierAllocator};
use kverbs::qp::{Qp, QpConfig, QpHandler};
use kverbs::wire::{IbTimeout, PathMtu, PortSpace, RejectReason as CmReject, ServiceId};
use kverbs::wr::{Completion, Payload, SendWr, Signal, WcStatus};
use kverbs_tools::scsi_target::{BlockSize, LunConfig};
use kverbs_tools::srp_target::{CmTiming, SrpTarget, SrpTargetConfig};
use storport_srp::wire::Lun;
use storport_srp::wire::srp::{
    BufFormats, Cmd, CmdRepr, DataIn, DataOut, DirectDesc, IndirectDesc, LoginRej, LoginRejRepr,
    LoginReq, LoginReqRdma, LoginReqRepr, LoginRsp, LoginRspRepr, LoginSolNot, MultiChannelAction,
    Opcode, PortId, RejectReason, Rsp, RspRepr, SolNot, TaskAttr, TaskMgmtFunction, TmResponse,
    TskMgmt, TskMgmtRepr,
};

#[global_allocator]
static ALLOCATOR: VerifierAllocator = VerifierAllocator;

pub type Hp = HostPlatform;

pub const TARGET_IP: [u8; 4] = [10, 0, 0, 2];
pub const INIT_IP: [u8; 4] = [10, 0, 0, 1];
pub const INIT_GUID: u64 = 0x0200_00ff_fe0a_0001;
/// Bytes per initiator IU buffer (the largest IU it sends: a command with
/// immediate data, up to the target's 8276).
pub const IU_SIZE: usize = 8448;
/// IU buffers per direction.
pub const IU_SLOTS: u32 = 64;
const RECV_CTX: u64 = 1 << 32;
const SEND_CTX: u64 = 2 << 32;

/// The two execution modes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Device thread and threaded platform.
    Threaded,
    /// Stepped fabric and manual platform, run by the test thread.
    Stepped,
}

/// Short CM timing (the host platform's clock is real time).
pub fn cm_timing() -> CmTiming {
    CmTiming {
        packet_lifetime: IbTimeout::new(12).unwrap(),
        cm_response_timeout: IbTimeout::new(14).unwrap(),
        max_cm_retries: 3,
        timewait: IbTimeout::new(14).unwrap(),
    }
}

/// A target configuration for tests: two LUNs (512-byte and 4 KiB blocks),
/// short CM timing, everything else `ib_srpt`'s.
pub fn config() -> SrpTargetConfig {
    SrpTargetConfig {
        luns: vec![
            LunConfig::new(BlockSize::B512, 8192),
            LunConfig::new(BlockSize::B4096, 1024),
        ],
        cm_timing: Some(cm_timing()),
        staging_bytes: 8 << 20,
        ..SrpTargetConfig::default()
    }
}

pub struct Node {
    pub hca: Arc<SoftHca>,
    pub dev: Device<Hp>,
}

/// The fabric, the platform, the target and the initiator's side.
/// (The target is the first field: if a test panics, it is dropped — and
/// stopped — while the fabric still runs.)
pub struct Env {
    pub target: Mutex<Option<SrpTarget>>,
    pub mode: Mode,
    pub platform: Hp,
    pub fabric: Fabric,
    pub tnode: Node,
    pub inode: Node,
    pub ipd: Pd<Hp>,
    pub iport: CmPort<Hp>,
}

/// Runs `f` against a target started with `config` (threaded mode), then
/// tears everything down and runs the verifier.
pub fn run(config: SrpTargetConfig, f: impl FnOnce(&Env, &Passive<'_>)) {
    run_in(Mode::Threaded, config, HcaConfig::new(TARGET_IP), f);
}

/// [`run`] with a chosen mode and target HCA.
pub fn run_in(
    mode: Mode,
    config: SrpTargetConfig,
    target_hca: HcaConfig,
    f: impl FnOnce(&Env, &Passive<'_>),
) {
    let platform = match mode {
        Mode::Threaded => HostPlatform::new(),
        Mode::Stepped => HostPlatform::manual(),
    };
    let fabric = Fabric::new(FabricConfig {
        mode: match mode {
            Mode::Threaded => ExecMode::Thread,
            Mode::Stepped => ExecMode::Stepped,
        },
        seed: 7,
        ..FabricConfig::default()
    });
    let p2 = platform.clone();
    p2.run_passive(|p| {
        let node = |cfg: HcaConfig| {
            let hca = fabric.add_hca(cfg);
            let dev = Device::open(
                &platform,
                VerifiedHca::new(hca.clone()),
                DeviceConfig::default(),
                p,
            )
            .unwrap();
            Node { hca, dev }
        };
        let tnode = node(target_hca);
        let inode = node(HcaConfig::new(INIT_IP));
        let ipd = inode.dev.alloc_pd(p).unwrap();
        let mut cm = CmConfig::new(Gid::ZERO, 0);
        let t = cm_timing();
        cm.packet_lifetime = t.packet_lifetime;
        cm.cm_response_timeout = t.cm_response_timeout;
        cm.max_cm_retries = t.max_cm_retries;
        cm.timewait = t.timewait;
        let iport = CmPort::create(
            &inode.dev,
            1,
            CmPortConfig {
                cm,
                ..CmPortConfig::default()
            },
            p,
        )
        .unwrap();
        let env = Env {
            mode,
            platform: platform.clone(),
            fabric,
            tnode,
            target: Mutex::new(None),
            inode,
            ipd,
            iport,
        };
        let target = SrpTarget::start(&env.tnode.dev, config, p).unwrap();
        *env.target.lock().unwrap() = Some(target);
        f(&env, p);
        env.teardown(p);
    });
    platform.finish();
}

impl Env {
    /// Lets everything run a little (stepped: the fabric and the queued
    /// DPCs and work items; threaded: a short sleep).
    pub fn step(&self) {
        match self.mode {
            Mode::Stepped => {
                self.fabric.run_until_idle();
                self.platform.run_until_idle(&mut |_| 0, 100_000);
                self.fabric.advance(Duration::from_micros(100));
                std::thread::sleep(Duration::from_micros(50));
            }
            Mode::Threaded => std::thread::sleep(Duration::from_micros(200)),
        }
    }

    /// Steps until `cond` holds (panics after 20 s).
    pub fn wait(&self, what: &str, cond: impl Fn() -> bool) {
        let start = Instant::now();
        while !cond() {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "timed out waiting for {what}"
            );
            self.step();
        }
    }

    /// Steps for `d` (to show something does *not* happen).
    pub fn idle(&self, d: Duration) {
        let start = Instant::now();
        while start.elapsed() < d {
            self.step();
        }
    }

    pub fn with_target<R>(&self, f: impl FnOnce(&SrpTarget) -> R) -> R {
        f(self
            .target
            .lock()
            .unwrap()
            .as_ref()
            .expect("target stopped"))
    }

    /// Stops the target now (the test checks what stop did).
    pub fn stop_target(&self, p: &Passive<'_>) {
        let target = self.target.lock().unwrap().take();
        if let Some(t) = target {
            t.stop_with(p, &mut || self.step()).unwrap();
        }
    }

    /// An ib_srp-style login request for this target.
    pub fn login_req(&self) -> LoginReqRepr {
        let guid = self.with_target(|t| t.service_guid());
        LoginReqRepr {
            tag: 0x10c1,
            req_it_iu_len: 8260,
            req_buf_fmt: BufFormats::DIRECT | BufFormats::INDIRECT,
            multichannel: MultiChannelAction::Single,
            sol_not: LoginSolNot::empty(),
            imm_data_offset: Some(68),
            initiator_port_id: PortId {
                id_ext: 0,
                guid: INIT_GUID,
            },
            target_port_id: PortId { id_ext: guid, guid },
        }
    }

    pub fn endpoints(&self, src_port: u16) -> RdmaCmEndpoints {
        RdmaCmEndpoints {
            port_space: PortSpace::Tcp,
            src: Ipv4Address(INIT_IP),
            src_port,
            dst: Ipv4Address(TARGET_IP),
            dst_port: self.with_target(|t| t.rdma_cm_port().unwrap()),
        }
    }

    /// Logs in over RDMA/CM.
    pub fn login(&self, req: &LoginReqRepr, p: &Passive<'_>) -> Result<Conn<'_>, Refused> {
        Conn::open(self, req, Form::RdmaCm, ConnParams::SRP, p)
    }

    /// Logs in and expects success.
    pub fn connect(&self, p: &Passive<'_>) -> Conn<'_> {
        self.login(&self.login_req(), p).expect("login refused")
    }

    /// A memory region of `len` bytes with exactly `access` (plus local
    /// write when remote write is granted, as IBA requires).
    pub fn buffer(&self, len: usize, access: AccessFlags, p: &Passive<'_>) -> Mr<Hp> {
        let access = if access.contains(AccessFlags::REMOTE_WRITE) {
            access | AccessFlags::LOCAL_WRITE
        } else {
            access
        };
        Mr::alloc(&self.ipd, len, access, p).unwrap()
    }

    fn teardown(self, p: &Passive<'_>) {
        self.stop_target(p);
        self.iport.close(p);
        self.wait("initiator CM consumers", || {
            self.iport.pending_consumers(p) == (0, 0)
        });
        self.wait("initiator CM port released", || {
            match self.iport.release(p) {
                Ok(()) => true,
                Err(CmError::Busy) => false,
                Err(e) => panic!("release: {e:?}"),
            }
        });
        self.ipd.dealloc(p).unwrap();
        self.inode.dev.close(p);
        self.tnode.dev.close(p);
        // The fabric goes before the platform's final check.
        let Env { fabric, .. } = self;
        drop(fabric);
    }
}

/// Which CM the login goes over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Form {
    RdmaCm,
    IbCm,
}

/// Why a login did not produce a channel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refused {
    /// SRP_LOGIN_REJ in a CM REJ (reason 28).
    Rejected(RejectReason),
    /// Some other CM outcome.
    Cm(String),
}

/// A CM event: kind and (up to 64 bytes of) private data; recorded at
/// DISPATCH_LEVEL without allocating.
pub type CmRecord = (&'static str, [u8; 64], usize);

/// Everything the initiator's QP, CQ and CM callbacks saw.
pub struct Events {
    pub completions: Mutex<Vec<Completion<u64>>>,
    pub cm: Mutex<Vec<CmRecord>>,
    pub qp_destroyed: AtomicUsize,
    pub cq_destroyed: AtomicUsize,
    pub qp_events: Mutex<Vec<AsyncEvent>>,
}

impl Events {
    fn new() -> Arc<Self> {
        Arc::new(Events {
            completions: Mutex::new(Vec::with_capacity(8192)),
            cm: Mutex::new(Vec::with_capacity(16)),
            qp_destroyed: AtomicUsize::new(0),
            cq_destroyed: AtomicUsize::new(0),
            qp_events: Mutex::new(Vec::with_capacity(64)),
        })
    }

    pub fn cm_kinds(&self) -> Vec<&'static str> {
        self.cm.lock().unwrap().iter().map(|(k, _, _)| *k).collect()
    }

    /// The first event other than "established".
    pub fn terminal(&self) -> Option<&'static str> {
        self.cm_kinds().into_iter().find(|k| *k != "established")
    }

    pub fn cm_data(&self, kind: &str) -> Option<Vec<u8>> {
        self.cm
            .lock()
            .unwrap()
            .iter()
            .find(|(k, _, _)| *k == kind)
            .map(|(_, b, n)| b[..*n].to_vec())
    }
}

impl CqHandler<u64> for Events {
    fn on_completion(&self, c: Completion<u64>, _irql: &Dispatch<'_>) {
        let mut v = self.completions.lock().unwrap();
        assert!(v.len() < v.capacity(), "completion log full");
        v.push(c);
    }

    fn on_destroyed(&self, _irql: &Dispatch<'_>) {
        self.cq_destroyed.fetch_add(1, Ordering::AcqRel);
    }
}

impl QpHandler for Events {
    fn on_async_event(&self, e: AsyncEvent, _irql: &Dispatch<'_>) {
        let mut v = self.qp_events.lock().unwrap();
        if v.len() < v.capacity() {
            v.push(e);
        }
    }

    fn on_destroyed(&self, _irql: &Dispatch<'_>) {
        self.qp_destroyed.fetch_add(1, Ordering::AcqRel);
    }
}

impl CmHandler for Events {
    fn on_event(&self, _id: CmId, event: CmEvent<'_>, _irql: &Dispatch<'_>) {
        let (kind, data): (&'static str, &[u8]) = match event {
            CmEvent::Established { private_data } => ("established", private_data),
            CmEvent::Rejected {
                reason: CmReject::ConsumerDefined,
                private_data,
            } => ("rejected", private_data),
            CmEvent::Rejected { .. } => ("rejected-other", &[]),
            CmEvent::Unreachable { .. } => ("unreachable", &[]),
            CmEvent::Disconnected { cause, .. } => match cause {
                kverbs::cm::DisconnectCause::Remote => ("disconnected-remote", &[]),
                kverbs::cm::DisconnectCause::Local => ("disconnected-local", &[]),
                kverbs::cm::DisconnectCause::Stale => ("disconnected-stale", &[]),
            },
        };
        let mut buf = [0u8; 64];
        let n = data.len().min(64);
        buf[..n].copy_from_slice(&data[..n]);
        let mut cm = self.cm.lock().unwrap();
        assert!(cm.len() < cm.capacity(), "CM log full");
        cm.push((kind, buf, n));
    }
}

static NEXT_SRC_PORT: AtomicUsize = AtomicUsize::new(40000);

/// An `SRP_RSP`, owned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RspOwned {
    pub tag: u64,
    pub status: u8,
    pub req_lim_delta: i32,
    pub solicited: bool,
    pub data_in_residual: storport_srp::wire::Residual,
    pub data_out_residual: storport_srp::wire::Residual,
    pub response_data: Option<Vec<u8>>,
    pub sense: Option<Vec<u8>>,
}

impl RspOwned {
    pub fn parse(iu: &[u8]) -> RspOwned {
        let r = RspRepr::parse(&Rsp::new_checked(iu).expect("short SRP_RSP")).expect("bad SRP_RSP");
        RspOwned {
            tag: r.tag,
            status: r.status,
            req_lim_delta: r.req_lim_delta,
            solicited: r.solicited,
            data_in_residual: r.data_in_residual,
            data_out_residual: r.data_out_residual,
            response_data: r.response_data.map(<[u8]>::to_vec),
            sense: r.sense.map(<[u8]>::to_vec),
        }
    }

    pub fn tm(&self) -> Option<TmResponse> {
        match self.response_data.as_deref() {
            Some(&[_, _, _, code]) => Some(TmResponse::from_code(code)),
            _ => None,
        }
    }
}

/// A raw initiator channel: an RC QP logged in to the target.
pub struct Conn<'e> {
    pub env: &'e Env,
    pub qp: Qp<Hp, u64>,
    pub cq: Cq<Hp, u64>,
    pub events: Arc<Events>,
    pub id: Option<CmId>,
    pub login: LoginRspRepr,
    recv_mr: Mr<Hp>,
    send_mr: Mr<Hp>,
    next_send: AtomicUsize,
    next_tag: AtomicU64,
    seen: AtomicUsize,
    inbox: Mutex<VecDeque<Vec<u8>>>,
    closed: std::sync::atomic::AtomicBool,
}

impl<'e> Conn<'e> {
    /// Creates a QP, logs in with `req` over `form`.
    pub fn open(
        env: &'e Env,
        req: &LoginReqRepr,
        form: Form,
        params: ConnParams,
        p: &Passive<'_>,
    ) -> Result<Conn<'e>, Refused> {
        let events = Events::new();
        let cq = Cq::create(&env.inode.dev, CqConfig::new(1024), events.clone(), p).unwrap();
        let handler = env.iport.qp_events(events.clone(), p);
        let qp = Qp::create(
            &env.ipd,
            &QpConfig {
                qp_type: QpType::Rc,
                send_cq: cq.clone(),
                recv_cq: cq.clone(),
                send_wqebbs: 256,
                recv_slots: IU_SLOTS,
                max_recv_sge: 1,
                port: 1,
            },
            handler,
            p,
        )
        .unwrap();
        let (attr, mask) = init_attrs(
            1,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        );
        qp.modify(&attr, mask, p).unwrap();
        let slots = IU_SLOTS as usize * IU_SIZE;
        let recv_mr = Mr::alloc(&env.ipd, slots, AccessFlags::LOCAL_WRITE, p).unwrap();
        let send_mr = Mr::alloc(&env.ipd, slots, AccessFlags::LOCAL_WRITE, p).unwrap();
        let mut conn = Conn {
            env,
            qp,
            cq,
            events,
            id: None,
            login: LoginRspRepr {
                req_lim_delta: 0,
                tag: 0,
                max_it_iu_len: 0,
                max_ti_iu_len: 0,
                buf_fmt: BufFormats::empty(),
                multichannel: storport_srp::wire::srp::MultiChannelResult::NoChannel,
                immediate_supported: false,
            },
            recv_mr,
            send_mr,
            next_send: AtomicUsize::new(0),
            next_tag: AtomicU64::new(1),
            seen: AtomicUsize::new(0),
            inbox: Mutex::new(VecDeque::new()),
            closed: std::sync::atomic::AtomicBool::new(false),
        };
        for slot in 0..IU_SLOTS {
            conn.post_recv(slot, p);
        }
        let cm_qp: Arc<dyn CmQp> = Arc::new(conn.qp.clone());
        let h: Arc<dyn CmHandler> = conn.events.clone();
        let src_port = NEXT_SRC_PORT.fetch_add(1, Ordering::Relaxed) as u16;
        let endpoints = env.endpoints(src_port);
        let id = match form {
            Form::RdmaCm => {
                let mut b = [0u8; 56];
                req.emit_rdma(&mut LoginReqRdma::new_unchecked(&mut b[..]))
                    .unwrap();
                env.iport
                    .connect_rdma_cm(&endpoints, &b, params, None, &cm_qp, &h, p)
            }
            Form::IbCm => {
                let mut b = [0u8; 64];
                req.emit(&mut LoginReq::new_unchecked(&mut b[..])).unwrap();
                let (sid, gid) = env.with_target(|t| (t.ib_cm_service_id().unwrap(), t.gid()));
                env.iport.connect(
                    &ConnectRequest {
                        service_id: ServiceId(sid),
                        peer: MadAddress::cm(gid),
                        path: endpoints.path(ack_timeout_for(cm_timing().packet_lifetime)),
                        path_mtu: PathMtu::Mtu1024,
                        qp: LocalQp {
                            qpn: Qpn::from_low_bits(conn.qp.qpn()),
                            starting_psn: None,
                        },
                        params,
                        private_data: &b,
                    },
                    &cm_qp,
                    &h,
                    p,
                )
            }
        }
        .unwrap();
        conn.id = Some(id);
        env.wait("the login answered", || !conn.events.cm_kinds().is_empty());
        let kinds = conn.events.cm_kinds();
        if kinds[0] == "established" {
            let data = conn.events.cm_data("established").unwrap();
            conn.login = LoginRspRepr::parse(&LoginRsp::new_checked(&data[..52]).unwrap())
                .expect("LOGIN_RSP");
            return Ok(conn);
        }
        let refused = if kinds[0] == "rejected" {
            let data = conn.events.cm_data("rejected").unwrap();
            let rej = LoginRejRepr::parse(&LoginRej::new_checked(&data[..32]).unwrap())
                .expect("LOGIN_REJ");
            assert_eq!(rej.tag, req.tag, "LOGIN_REJ echoes the tag");
            assert_eq!(rej.buf_fmt, BufFormats::DIRECT | BufFormats::INDIRECT);
            Refused::Rejected(rej.reason)
        } else {
            Refused::Cm(kinds[0].to_string())
        };
        conn.close(p);
        Err(refused)
    }

    fn post_recv(&self, slot: u32, p: &Passive<'_>) {
        let sge = self
            .recv_mr
            .sge(u64::from(slot) * IU_SIZE as u64, IU_SIZE as u32)
            .unwrap();
        let mut b = self.qp.begin_recv(p).unwrap();
        b.recv(&[sge], RECV_CTX | u64::from(slot)).unwrap();
        b.commit();
    }

    /// Sends one IU.
    pub fn send_iu(&self, iu: &[u8], p: &Passive<'_>) {
        let slot = self.next_send.fetch_add(1, Ordering::Relaxed) % IU_SLOTS as usize;
        self.send_mr.mem().write(slot * IU_SIZE, iu).unwrap();
        let sge = self
            .send_mr
            .sge((slot * IU_SIZE) as u64, iu.len() as u32)
            .unwrap();
        let mut b = self.qp.begin_send(p).unwrap();
        b.send(
            &SendWr::new(Payload::Sges(&[sge])),
            Signal::Signalled(SEND_CTX | slot as u64),
        )
        .unwrap();
        b.commit();
    }

    /// Moves received IUs into the inbox (reposting their slots).
    fn collect(&self, p: &Passive<'_>) {
        let fresh: Vec<(u64, u32, WcStatus)> = {
            let all = self.events.completions.lock().unwrap();
            let from = self.seen.swap(all.len(), Ordering::AcqRel);
            all[from..]
                .iter()
                .map(|c| (c.context.unwrap_or(0), c.byte_len, c.status))
                .collect()
        };
        for (ctx, len, status) in fresh {
            if ctx & RECV_CTX != 0 && status == WcStatus::Success {
                let slot = (ctx & 0xffff_ffff) as u32;
                let mut buf = vec![0u8; len as usize];
                self.recv_mr
                    .mem()
                    .read(slot as usize * IU_SIZE, &mut buf)
                    .unwrap();
                self.inbox.lock().unwrap().push_back(buf);
                self.post_recv(slot, p);
            }
        }
    }

    /// The next IU from the target, if one comes within `within`.
    pub fn try_next_iu(&self, p: &Passive<'_>, within: Duration) -> Option<Vec<u8>> {
        let start = Instant::now();
        loop {
            self.collect(p);
            if let Some(iu) = self.inbox.lock().unwrap().pop_front() {
                return Some(iu);
            }
            if start.elapsed() > within {
                return None;
            }
            self.env.step();
        }
    }

    /// The next IU from the target (panics after 10 s).
    pub fn next_iu(&self, p: &Passive<'_>) -> Vec<u8> {
        self.try_next_iu(p, Duration::from_secs(10))
            .expect("no IU from the target")
    }

    /// The next IU, which must be an `SRP_RSP`.
    pub fn next_rsp(&self, p: &Passive<'_>) -> RspOwned {
        let iu = self.next_iu(p);
        assert_eq!(
            iu[0],
            Opcode::Rsp.to_u8(),
            "expected SRP_RSP, got {:#04x}",
            iu[0]
        );
        RspOwned::parse(&iu)
    }

    pub fn new_tag(&self) -> u64 {
        self.next_tag.fetch_add(1, Ordering::Relaxed)
    }

    /// Sends an `SRP_CMD`; returns its tag.
    pub fn send_cmd(
        &self,
        lun: u16,
        cdb: &[u8],
        data_out: DataOut<'_>,
        data_in: DataIn<'_>,
        p: &Passive<'_>,
    ) -> u64 {
        let tag = self.new_tag();
        let repr = CmdRepr {
            sol_not: SolNot::empty(),
            tag,
            lun: Lun::from_index(lun).unwrap(),
            task_attr: TaskAttr::Simple,
            cdb,
            data_out,
            data_in,
        };
        let mut buf = vec![0u8; repr.buffer_len().unwrap()];
        repr.emit(&mut Cmd::new_unchecked(&mut buf[..])).unwrap();
        self.send_iu(&buf, p);
        tag
    }

    /// Sends an `SRP_TSK_MGMT`; returns its tag.
    pub fn send_tm(
        &self,
        function: TaskMgmtFunction,
        lun: u16,
        task_tag: u64,
        p: &Passive<'_>,
    ) -> u64 {
        let tag = self.new_tag();
        let repr = TskMgmtRepr {
            sol_not: SolNot::empty(),
            tag,
            lun: Lun::from_index(lun).unwrap(),
            function,
            task_tag,
        };
        let mut buf = vec![0u8; repr.buffer_len()];
        repr.emit(&mut TskMgmt::new_unchecked(&mut buf[..]))
            .unwrap();
        self.send_iu(&buf, p);
        tag
    }

    /// A command with a DATA-IN buffer of `len` bytes (remote write only);
    /// returns the response and the data.
    pub fn data_in(&self, lun: u16, cdb: &[u8], len: u32, p: &Passive<'_>) -> (RspOwned, Vec<u8>) {
        let mr = self
            .env
            .buffer(len.max(1) as usize, AccessFlags::REMOTE_WRITE, p);
        let desc = desc_of(&mr, 0, len);
        let tag = self.send_cmd(lun, cdb, DataOut::None, DataIn::Direct(desc), p);
        let rsp = self.next_rsp(p);
        assert_eq!(rsp.tag, tag);
        let mut data = vec![0u8; len as usize];
        mr.mem().read(0, &mut data).unwrap();
        mr.dereg(p).unwrap();
        (rsp, data)
    }

    /// A command with `data` as its DATA-OUT (one buffer, remote read only).
    pub fn data_out(&self, lun: u16, cdb: &[u8], data: &[u8], p: &Passive<'_>) -> RspOwned {
        let mr = self
            .env
            .buffer(data.len().max(1), AccessFlags::REMOTE_READ, p);
        mr.mem().write(0, data).unwrap();
        let desc = desc_of(&mr, 0, data.len() as u32);
        let tag = self.send_cmd(lun, cdb, DataOut::Direct(desc), DataIn::None, p);
        let rsp = self.next_rsp(p);
        assert_eq!(rsp.tag, tag);
        mr.dereg(p).unwrap();
        rsp
    }

    /// WRITE(10) of `data` at `lba`.
    pub fn write10(
        &self,
        lun: u16,
        lba: u32,
        block: u32,
        data: &[u8],
        p: &Passive<'_>,
    ) -> RspOwned {
        self.data_out(lun, &rw10(0x2a, lba, data.len() as u32 / block), data, p)
    }

    /// READ(10) of `blocks` blocks at `lba`.
    pub fn read10(
        &self,
        lun: u16,
        lba: u32,
        blocks: u32,
        block: u32,
        p: &Passive<'_>,
    ) -> (RspOwned, Vec<u8>) {
        self.data_in(lun, &rw10(0x28, lba, blocks), blocks * block, p)
    }

    /// Sends `SRP_I_LOGOUT`.
    pub fn i_logout(&self, p: &Passive<'_>) {
        let repr = storport_srp::wire::srp::ILogoutRepr {
            tag: self.new_tag(),
        };
        let mut buf = vec![0u8; repr.buffer_len()];
        repr.emit(&mut storport_srp::wire::srp::ILogout::new_unchecked(
            &mut buf[..],
        ))
        .unwrap();
        self.send_iu(&buf, p);
    }

    /// Waits for the connection's terminal CM event.
    pub fn wait_terminal(&self) -> &'static str {
        self.env
            .wait("the connection's end", || self.events.terminal().is_some());
        self.events.terminal().unwrap()
    }

    /// Disconnects (if still up), destroys the QP and CQ, frees the IU
    /// buffers.
    pub fn close(&self, p: &Passive<'_>) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        if self.events.terminal().is_none() {
            if let Some(id) = self.id {
                let _ = self.env.iport.disconnect(id, &[], p);
            }
            self.wait_terminal();
        }
        self.qp.destroy(p).unwrap();
        self.env.wait("initiator QP destroyed", || {
            self.events.qp_destroyed.load(Ordering::Acquire) == 1
        });
        self.cq.destroy(p).unwrap();
        self.env.wait("initiator CQ destroyed", || {
            self.events.cq_destroyed.load(Ordering::Acquire) == 1
        });
        self.recv_mr.dereg(p).unwrap();
        self.send_mr.dereg(p).unwrap();
    }
}

impl Drop for Conn<'_> {
    fn drop(&mut self) {
        if !self.closed.load(Ordering::Acquire) && !std::thread::panicking() {
            panic!("a Conn must be closed before it is dropped");
        }
    }
}

/// The descriptor of `len` bytes at `off` of `mr`.
pub fn desc_of(mr: &Mr<Hp>, off: u64, len: u32) -> DirectDesc {
    DirectDesc {
        va: mr.iova() + off,
        rkey: mr.rkey().expect("remote access"),
        len,
    }
}

/// An indirect descriptor over `descs` (carried whole in the IU).
pub fn indirect(descs: &[DirectDesc]) -> IndirectDesc<'_> {
    IndirectDesc::inline(0, 0, descs).unwrap()
}

/// READ(10) / WRITE(10).
pub fn rw10(op: u8, lba: u32, blocks: u32) -> [u8; 10] {
    let l = lba.to_be_bytes();
    let n = (blocks as u16).to_be_bytes();
    [op, 0, l[0], l[1], l[2], l[3], 0, n[0], n[1], 0]
}

/// INQUIRY (standard data).
pub fn inquiry(alloc: u8) -> [u8; 6] {
    [0x12, 0, 0, 0, alloc, 0]
}

/// READ CAPACITY(10).
pub fn read_capacity10() -> [u8; 10] {
    [0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0]
}

/// A recognizable pattern.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ ((i >> 8) as u8))
        .collect()
}

/// A target-initiated request, as the initiator saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TargetRequest {
    Cred {
        tag: u64,
        delta: i32,
    },
    Aer {
        tag: u64,
        delta: i32,
        lun: Lun,
        sense: Vec<u8>,
    },
    Logout {
        tag: u64,
        reason: u32,
    },
}

impl Conn<'_> {
    /// Parses a target request and, for CRED_REQ and AER_REQ, answers it
    /// (CRED_RSP / AER_RSP with its tag).
    pub fn answer(&self, iu: &[u8], p: &Passive<'_>) -> TargetRequest {
        use storport_srp::wire::srp::{
            AerReq, AerReqRepr, AerRsp, AerRspRepr, CredReq, CredReqRepr, CredRsp, CredRspRepr,
            TLogout, TLogoutRepr,
        };
        match Opcode::from_u8(iu[0]) {
            Some(Opcode::CredReq) => {
                let r = CredReqRepr::parse(&CredReq::new_checked(iu).unwrap()).unwrap();
                let mut b = [0u8; 16];
                CredRspRepr { tag: r.tag }
                    .emit(&mut CredRsp::new_unchecked(&mut b[..]))
                    .unwrap();
                self.send_iu(&b, p);
                TargetRequest::Cred {
                    tag: r.tag,
                    delta: r.req_lim_delta,
                }
            }
            Some(Opcode::AerReq) => {
                let r = AerReqRepr::parse(&AerReq::new_checked(iu).unwrap()).unwrap();
                let mut b = [0u8; 16];
                AerRspRepr { tag: r.tag }
                    .emit(&mut AerRsp::new_unchecked(&mut b[..]))
                    .unwrap();
                self.send_iu(&b, p);
                TargetRequest::Aer {
                    tag: r.tag,
                    delta: r.req_lim_delta,
                    lun: r.lun,
                    sense: r.sense.to_vec(),
                }
            }
            Some(Opcode::TLogout) => {
                let r = TLogoutRepr::parse(&TLogout::new_checked(iu).unwrap()).unwrap();
                TargetRequest::Logout {
                    tag: r.tag,
                    reason: r.reason,
                }
            }
            other => panic!("not a target request: {other:?}"),
        }
    }
}
