//! StorPort as the miniport core sees it.
//!
//! Two traits face each other, in the shape of Rust-for-Linux's
//! `block::mq::Operations` (the driver implements a callback trait; the port
//! side owns the trampolines):
//!
//! * [`StorPort`]: the services the miniport calls — complete a request,
//!   adapter and device busy/ready, pause/resume, the scatter/gather list
//!   with its ExecutionRoutine, timers, DPCs, logging, bus change
//!   notification. Each method states its IRQL.
//! * [`HwMiniport`]: the callbacks StorPort makes — `HwFindAdapter`,
//!   `HwInitialize`, the passive-initialisation routine, `HwBuildIo`,
//!   `HwStartIo`, the ExecutionRoutine, `HwResetBus`, `HwAdapterControl`,
//!   the miniport's DPC and timer routines, `HwFreeAdapterResources`. Each
//!   method states the context StorPort calls it in.
//!
//! The request block itself is the [`Srb`] trait ([`srb`]).
//!
//! Implementations: [`host`] (feature `host`) is the StorPort model the tests
//! run the core under — it calls the miniport exactly the way StorPort does
//! and checks every rule below instead of trusting it. The NT shim
//! (`crate::nt`, feature `nt`) maps the same methods onto `storport.sys`.
//!
//! # Why a virtual miniport
//! The adapter registers as a StorPort *virtual* miniport (see
//! `crate::nt::miniport` for the full argument): it owns no hardware (the
//! HCA belongs to its own driver), data moves by RDMA so scatter/gather
//! lists come from the HCA's DMA adapter with the ExecutionRoutine at
//! `DISPATCH_LEVEL`, and StorPort calls a virtual miniport's `HwStartIo` at
//! any IRQL <= `DISPATCH_LEVEL` without its StartIo lock, so requests to
//! different channels proceed in parallel. The core is written to be correct
//! under every StartIo locking StorPort has (none, the full-duplex StartIo
//! lock, concurrent channels); the host model runs it under each.
//!
//! # IRQL levels
//! `kverbs::irql` proves `PASSIVE_LEVEL` and `DISPATCH_LEVEL`. StorPort also
//! calls a few routines at device IRQL (`HwInitialize`, the Stop and Restart
//! adapter controls, with the interrupt lock held); for those this module
//! adds [`Dirql`], a token that proves nothing usable at or below
//! `DISPATCH_LEVEL`: no spin lock, no work item, no request completion.
//! What a routine holding only `&Dirql` can do is queue a DPC
//! ([`StorPort::issue_dpc`]) and touch atomics — exactly the rule for
//! raised-IRQL code.

// UNSAFETY: declares the `unsafe` `Dirql::assume` constructor; no unsafe blocks.
#![deny(unsafe_code)]

pub mod srb;

#[cfg(feature = "host")]
pub mod host;

use core::fmt;
use core::marker::PhantomData;
use core::time::Duration;

use kverbs::irql::{Dispatch, LeDispatch, Passive};
use kverbs::platform::Platform;

pub use srb::{
    AbortTarget, Address, DataAccessError, DataDirection, PnpAction, QueueAction, SgElement, Srb,
    SrbFunction, SrbIdentity, SrbStatus,
};

/// Proof that the caller runs at device IRQL (above `DISPATCH_LEVEL`), as
/// StorPort calls `HwInitialize` and the Stop/Restart adapter controls.
///
/// It is deliberately *not* a [`LeDispatch`]: code holding only this token
/// cannot take a spin lock, queue a work item, complete a request or call
/// anything else that requires <= `DISPATCH_LEVEL`. It can queue a DPC.
///
/// # Invariants
/// While a `Dirql<'a>` exists, the current processor runs above
/// `DISPATCH_LEVEL` (on the host: the model's device-IRQL context).
pub struct Dirql<'a> {
    _marker: PhantomData<(&'a (), *mut ())>,
}

impl Dirql<'_> {
    /// Mints the token. Only port implementations (the NT trampolines, the
    /// host model) call this, exactly where StorPort's contract says the
    /// routine runs at device IRQL.
    ///
    /// # Safety
    /// The caller runs above `DISPATCH_LEVEL` for the token's lifetime.
    ///
    /// # IRQL
    /// Device IRQL.
    #[expect(
        unsafe_code,
        reason = "the token's constructor is the proof obligation"
    )]
    #[must_use]
    pub unsafe fn assume() -> Self {
        Dirql {
            _marker: PhantomData,
        }
    }
}

impl fmt::Debug for Dirql<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Dirql")
    }
}

/// One of the miniport's StorPort DPC objects (`STOR_DPC`), numbered
/// `0..HwMiniport::DPC_COUNT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DpcId(pub u8);

/// One of the miniport's StorPort timers (`StorPortInitializeTimer`),
/// numbered `0..HwMiniport::TIMER_COUNT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TimerId(pub u8);

/// What the miniport logs (`StorPortLogError`'s unique id, and the trace
/// stream). Fixed codes with numbers, so logging never formats or allocates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LogKind {
    /// A transport completion named a tag that is not outstanding (late or
    /// duplicate); it was ignored. `detail` = the tag.
    StaleCompletion,
    /// The transport broke its contract (e.g. a completion for a command it
    /// refused to post); the request was handled safely. `detail` = tag.
    TransportContract,
    /// No transport credit: the request was answered `SRB_STATUS_BUSY` and
    /// the device held back. `detail` = outstanding requests on the LUN.
    CreditStarvation,
    /// A target changed connection state. `detail` = the new state code.
    TargetState,
    /// The adapter was stopped (teardown queued to the passive worker).
    AdapterStopped,
    /// The adapter was restarted (connect queued to the passive worker).
    AdapterRestarted,
    /// The transport could not be started. `detail` = transport error code.
    TransportStartFailed,
    /// A bus reset terminated outstanding requests. `detail` = how many.
    BusReset,
    /// A task management function was sent. `detail` = the tag.
    TaskManagement,
}

/// One log entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogEvent {
    /// What happened.
    pub kind: LogKind,
    /// Which device it concerns, if one.
    pub address: Option<Address>,
    /// A number that says more (see each [`LogKind`]).
    pub detail: u64,
}

/// `StorPortGetScatterGatherList` / `GetScatterGatherList` refused the
/// request (no map registers, no memory); the request is handed back and
/// the ExecutionRoutine will not run for it.
pub struct SgListRefused<R> {
    /// The request, unchanged.
    pub srb: R,
}

impl<R> fmt::Debug for SgListRefused<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SgListRefused")
    }
}

/// The services StorPort offers a miniport.
///
/// The value is what the miniport keeps of its port: on NT a device
/// extension pointer, in the host model a handle on the model. Methods take
/// `&self` and may be called concurrently from several processors.
pub trait StorPort: Send + Sync + 'static {
    /// The kernel primitives (locks, DPCs, work items) the miniport uses.
    type Platform: Platform;
    /// The owned request handle.
    type Srb: Srb;

    /// The platform the port runs on.
    fn platform(&self) -> &Self::Platform;

    /// Hands a finished request back (`StorPortNotification(RequestComplete)`).
    /// The request's `SrbStatus` must be set (not `SRB_STATUS_PENDING`) and
    /// its scatter/gather list released. `SRB_STATUS_BUSY` makes StorPort
    /// requeue it.
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL` (not from a device-IRQL routine).
    fn complete_request(&self, srb: Self::Srb, irql: &impl LeDispatch);

    /// Holds new requests to the adapter until `requests_to_complete`
    /// outstanding ones have completed (`StorPortBusy`); more than are
    /// outstanding means "until all outstanding have completed".
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    fn busy(&self, requests_to_complete: u32, irql: &impl LeDispatch) -> bool;

    /// Ends an adapter busy hold (`StorPortReady`).
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    fn ready(&self, irql: &impl LeDispatch) -> bool;

    /// Holds new requests to one LUN until `requests_to_complete` of its
    /// outstanding requests have completed (`StorPortDeviceBusy`).
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    fn device_busy(
        &self,
        address: Address,
        requests_to_complete: u32,
        irql: &impl LeDispatch,
    ) -> bool;

    /// Ends a device busy hold (`StorPortDeviceReady`).
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    fn device_ready(&self, address: Address, irql: &impl LeDispatch) -> bool;

    /// Holds all new requests for at most `timeout_secs` seconds
    /// (`StorPortPause`); StorPort resumes by itself when it expires.
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    fn pause(&self, timeout_secs: u32, irql: &impl LeDispatch) -> bool;

    /// Ends an adapter pause early (`StorPortResume`).
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    fn resume(&self, irql: &impl LeDispatch) -> bool;

    /// Holds new requests to one LUN for at most `timeout_secs` seconds
    /// (`StorPortPauseDevice`).
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    fn pause_device(&self, address: Address, timeout_secs: u32, irql: &impl LeDispatch) -> bool;

    /// Ends a device pause early (`StorPortResumeDevice`).
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    fn resume_device(&self, address: Address, irql: &impl LeDispatch) -> bool;

    /// Asks for the request's scatter/gather list (`GetScatterGatherList` on
    /// the HCA's DMA adapter). On success the request moves to the port and
    /// comes back in [`HwMiniport::execution_routine`] — possibly before this
    /// returns, possibly later from a DPC: the caller must assume neither.
    ///
    /// # Errors
    /// [`SgListRefused`] hands the request back; the ExecutionRoutine will
    /// not run for it.
    ///
    /// # IRQL
    /// `DISPATCH_LEVEL` exactly.
    fn get_scatter_gather_list(
        &self,
        srb: Self::Srb,
        irql: &Dispatch<'_>,
    ) -> Result<(), SgListRefused<Self::Srb>>;

    /// Releases the request's scatter/gather list (`PutScatterGatherList`);
    /// required before the request completes. No-op without a list.
    ///
    /// # IRQL
    /// `DISPATCH_LEVEL` exactly.
    fn put_scatter_gather_list(&self, srb: &mut Self::Srb, irql: &Dispatch<'_>);

    /// Arms one of the miniport's timers to call [`HwMiniport::timer`] once
    /// after `due` (`StorPortRequestTimer`); re-arming replaces the expiry.
    /// `false` if the timer does not exist.
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    fn request_timer(&self, timer: TimerId, due: Duration, irql: &impl LeDispatch) -> bool;

    /// Disarms a timer; `true` if it was armed.
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    fn cancel_timer(&self, timer: TimerId, irql: &impl LeDispatch) -> bool;

    /// Queues one of the miniport's DPCs to call [`HwMiniport::dpc`] at
    /// `DISPATCH_LEVEL` (`StorPortIssueDpc`); `false` if it was already
    /// queued (it runs once) or does not exist.
    ///
    /// # IRQL
    /// Any, including device IRQL: this is how a [`Dirql`] routine defers
    /// work.
    fn issue_dpc(&self, dpc: DpcId) -> bool;

    /// Records an event (`StorPortLogError` / the trace stream). Never
    /// blocks or allocates.
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    fn log(&self, event: LogEvent, irql: &impl LeDispatch);

    /// Tells StorPort the devices on bus `path` changed, so it re-enumerates
    /// (`StorPortNotification(BusChangeDetected)`).
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    fn notify_bus_change(&self, path: u8, irql: &impl LeDispatch) -> bool;
}

/// What `build_io` decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BuildIo {
    /// Hand the request on to `start_io`.
    Proceed,
    /// The request is finished (its status set); the port completes it.
    Complete,
}

/// Why `find_adapter` declined the adapter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FindAdapterError {
    /// Resources for the adapter could not be had (`SP_RETURN_ERROR`).
    Resources,
    /// The configuration is unusable (`SP_RETURN_BAD_CONFIG`).
    BadConfig,
}

/// The adapter limits a miniport reports from `find_adapter`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdapterLimits {
    /// SCSI buses (`NumberOfBuses`); the SRP/iSER initiator uses one.
    pub buses: u8,
    /// Target IDs per bus StorPort enumerates.
    pub targets_per_bus: u8,
    /// LUNs per target StorPort enumerates.
    pub luns_per_target: u8,
    /// Largest single transfer, bytes.
    pub max_transfer_bytes: u32,
    /// Largest scatter/gather list, elements minus one (StorPort's
    /// `NumberOfPhysicalBreaks`).
    pub physical_breaks: u32,
    /// Outstanding requests per adapter.
    pub max_io: u32,
    /// Outstanding requests per LUN.
    pub max_io_per_lun: u32,
}

/// The adapter controls a miniport supports
/// (`ScsiQuerySupportedControlTypes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SupportedControls {
    /// `ScsiStopAdapter`.
    pub stop: bool,
    /// `ScsiRestartAdapter`.
    pub restart: bool,
}

/// The callbacks StorPort makes into a miniport. `S` is the port the
/// miniport was found on; the port value is handed to `find_adapter`.
///
/// The adapter value is shared by concurrent callbacks (a virtual
/// miniport's StartIo runs on many processors at once with no StorPort
/// lock), so methods take `&self`.
pub trait HwMiniport<S: StorPort>: Sized + Send + Sync + 'static {
    /// What the driver passes through `StorPortInitialize`'s `HwContext` to
    /// `find_adapter` (configuration, the transport to drive).
    type Context: Send + Sync + 'static;

    /// `SrbExtensionSize`, in 64-bit words.
    const SRB_EXTENSION_WORDS: usize = 1;
    /// How many StorPort DPC objects the miniport uses ([`DpcId`]s).
    const DPC_COUNT: u8 = 0;
    /// How many StorPort timers the miniport uses ([`TimerId`]s).
    const TIMER_COUNT: u8 = 0;

    /// Creates the adapter and states its limits. `argument` is StorPort's
    /// `ArgumentString` (the `DriverParameter` registry value): untrusted.
    ///
    /// # Errors
    /// [`FindAdapterError`] declines the adapter.
    ///
    /// # IRQL
    /// `PASSIVE_LEVEL`, no StorPort lock held (nc-storport-hw_find_adapter).
    fn find_adapter(
        port: S,
        context: &Self::Context,
        argument: Option<&[u8]>,
        irql: &Passive<'_>,
    ) -> Result<(Self, AdapterLimits), FindAdapterError>;

    /// Brings the adapter up; real work belongs in
    /// [`Self::passive_initialize`].
    ///
    /// # IRQL
    /// Device IRQL (nc-storport-hw_initialize): no blocking, no allocation,
    /// no spin lock.
    fn initialize(&self, irql: &Dirql<'_>) -> bool;

    /// Initialisation that needs `PASSIVE_LEVEL`.
    ///
    /// # IRQL
    /// `PASSIVE_LEVEL`, no spin lock held.
    fn passive_initialize(&self, irql: &Passive<'_>) -> bool;

    /// Unsynchronised preparation of a request. `SRB_STATUS_BUSY` requeues
    /// run it again, with the extension's contents lost.
    ///
    /// # IRQL
    /// `DISPATCH_LEVEL` for a physical miniport (no spin lock held, several
    /// processors at once). A virtual miniport's StartIo trampoline runs it
    /// in the StartIo context, at any IRQL <= `DISPATCH_LEVEL`.
    fn build_io<I: LeDispatch>(&self, srb: &mut S::Srb, irql: &I) -> BuildIo;

    /// Starts a request; the miniport owns it until it completes it.
    ///
    /// # IRQL
    /// Virtual miniport: any IRQL <= `DISPATCH_LEVEL`, no StorPort lock.
    /// Physical full duplex: `DISPATCH_LEVEL` under the StartIo spin lock.
    /// Concurrent channels: `DISPATCH_LEVEL`, several callers at once.
    fn start_io<I: LeDispatch>(&self, srb: S::Srb, irql: &I);

    /// The request is back with its scatter/gather list
    /// ([`StorPort::get_scatter_gather_list`]).
    ///
    /// # IRQL
    /// `DISPATCH_LEVEL`, no StorPort lock held.
    fn execution_routine(&self, srb: S::Srb, irql: &Dispatch<'_>);

    /// Resets bus `path`: every request on it the miniport holds must be
    /// completed (`SRB_STATUS_BUS_RESET`).
    ///
    /// # IRQL
    /// `DISPATCH_LEVEL`, under the StartIo lock where there is one
    /// (nc-storport-hw_reset_bus); StorPort has paused the device queues.
    fn reset_bus(&self, path: u8, irql: &Dispatch<'_>) -> bool;

    /// Which adapter controls are supported.
    ///
    /// # IRQL
    /// `PASSIVE_LEVEL` (`ScsiQuerySupportedControlTypes`).
    fn supported_controls(&self) -> SupportedControls;

    /// `ScsiStopAdapter`: quiesce. Must not block or tear down inline.
    ///
    /// # IRQL
    /// Device IRQL with the interrupt lock held (prior-art §4.5).
    fn stop_adapter(&self, irql: &Dirql<'_>) -> bool;

    /// `ScsiRestartAdapter`: resume after a stop. Must not block.
    ///
    /// # IRQL
    /// As [`Self::stop_adapter`].
    fn restart_adapter(&self, irql: &Dirql<'_>) -> bool;

    /// One of the miniport's DPCs ([`StorPort::issue_dpc`]).
    ///
    /// # IRQL
    /// `DISPATCH_LEVEL`.
    fn dpc(&self, dpc: DpcId, irql: &Dispatch<'_>);

    /// One of the miniport's timers expired ([`StorPort::request_timer`]).
    ///
    /// # IRQL
    /// `DISPATCH_LEVEL`.
    fn timer(&self, timer: TimerId, irql: &Dispatch<'_>);

    /// The adapter is going away: release everything. No other callback
    /// runs concurrently or afterwards.
    ///
    /// # IRQL
    /// `PASSIVE_LEVEL`.
    fn free_adapter_resources(&self, irql: &Passive<'_>);
}
