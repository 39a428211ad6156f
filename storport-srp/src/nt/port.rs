//! [`NtStorPort`]: the core's [`StorPort`] services over `storport.sys`.
//!
//! | trait | StorPort |
//! |---|---|
//! | `complete_request` | `StorPortNotification(RequestComplete)` |
//! | `busy` / `ready` | `StorPortBusy` / `StorPortReady` |
//! | `device_busy` / `device_ready` | `StorPortDeviceBusy` / `StorPortDeviceReady` |
//! | `pause` / `resume` | `StorPortPause` / `StorPortResume` |
//! | `pause_device` / `resume_device` | `StorPortPauseDevice` / `StorPortResumeDevice` |
//! | `get_scatter_gather_list` / `put_…` | the HCA's `DMA_OPERATIONS` ([`super::dma`]) |
//! | `request_timer` / `cancel_timer` | `StorPortRequestTimer` (Windows 8+; `TimerValue` 0 cancels) |
//! | `issue_dpc` | `StorPortIssueDpc` (`StorPortNotification(IssueDpc)`) |
//! | `log` | `StorPortLogError` (`SP_INTERNAL_ADAPTER_ERROR`, the event's code and detail as the unique id) |
//! | `notify_bus_change` | `StorPortNotification(BusChangeDetected)` |
//!
//! StorPort's own inline wrappers (`StorPortIssueDpc`, `StorPortRequestTimer`,
//! ...) are written here as the calls they expand to.
//!
//! # Logging
//! `StorPortLogError` writes the system event log: `ErrorCode` is
//! `SP_INTERNAL_ADAPTER_ERROR`, `UniqueId` carries the [`LogKind`] in its
//! top byte and the low 24 bits of the event's detail ([`unique_id`]). No
//! ETW provider is registered; the event log is the trace stream.

use core::cell::UnsafeCell;
use core::ffi::c_void;
use core::mem::MaybeUninit;
use core::ptr::{NonNull, null_mut};
use core::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use core::time::Duration;

use kverbs::irql::{Dispatch, LeDispatch};
use kverbs::platform::nt::NtPlatform;

use super::dma::DmaPath;
use super::ffi::{
    _SCSI_NOTIFICATION_TYPE, ExtFunctionRequestTimer, IssueDpc, PHW_TIMER_EX, SCSI_REQUEST_BLOCK,
    SP_INTERNAL_ADAPTER_ERROR, STOR_DPC, STOR_STATUS_BUSY, STOR_STATUS_SUCCESS, StorPortBusy,
    StorPortDeviceBusy, StorPortDeviceReady, StorPortExtendedFunction, StorPortLogError,
    StorPortNotification, StorPortPause, StorPortPauseDevice, StorPortReady, StorPortResume,
    StorPortResumeDevice,
};
use super::srb::{ExtensionLayout, NtSrb};
use crate::storport::{Address, DpcId, LogEvent, LogKind, SgListRefused, StorPort, TimerId};

/// Most StorPort DPC objects a miniport may ask for (`DPC_COUNT`).
pub const MAX_DPCS: usize = 4;
/// Most StorPort timers a miniport may ask for (`TIMER_COUNT`).
pub const MAX_TIMERS: usize = 4;

/// The `STOR_DPC` objects, in the device extension (StorPort requires
/// non-paged storage that stays put; the extension is both).
pub struct DpcSlots {
    slots: [UnsafeCell<MaybeUninit<STOR_DPC>>; MAX_DPCS],
}

impl DpcSlots {
    /// Storage StorPort has not seen yet.
    #[must_use]
    pub const fn new() -> Self {
        DpcSlots {
            slots: [const { UnsafeCell::new(MaybeUninit::uninit()) }; MAX_DPCS],
        }
    }

    /// The `STOR_DPC` of DPC `index`.
    #[must_use]
    pub fn get(&self, index: usize) -> Option<*mut STOR_DPC> {
        self.slots.get(index).map(|s| s.get().cast())
    }
}

impl Default for DpcSlots {
    fn default() -> Self {
        Self::new()
    }
}

/// One StorPort timer: its handle (`StorPortInitializeTimer`) and whether
/// a request is pending.
pub struct TimerSlot {
    /// The opaque handle; null = not initialised.
    pub handle: AtomicPtr<c_void>,
    /// A `StorPortRequestTimer` is pending (cleared by the callback).
    pub armed: AtomicBool,
}

impl TimerSlot {
    /// An uninitialised slot.
    #[must_use]
    pub const fn new() -> Self {
        TimerSlot {
            handle: AtomicPtr::new(null_mut()),
            armed: AtomicBool::new(false),
        }
    }
}

impl Default for TimerSlot {
    fn default() -> Self {
        Self::new()
    }
}

/// `StorPortLogError`'s `UniqueId` for an event: the kind in the top byte,
/// the detail's low 24 bits below it.
#[must_use]
pub fn unique_id(event: &LogEvent) -> u32 {
    let kind: u32 = match event.kind {
        LogKind::StaleCompletion => 1,
        LogKind::TransportContract => 2,
        LogKind::CreditStarvation => 3,
        LogKind::TargetState => 4,
        LogKind::AdapterStopped => 5,
        LogKind::AdapterRestarted => 6,
        LogKind::TransportStartFailed => 7,
        LogKind::BusReset => 8,
        LogKind::TaskManagement => 9,
    };
    // CAST: the low 24 bits, by the mask.
    (kind << 24) | (event.detail & 0x00FF_FFFF) as u32
}

/// A timer's due time in StorPort's unit (microseconds), at least one (a
/// zero would cancel), saturating.
#[must_use]
pub fn timer_value_us(due: Duration) -> u64 {
    u64::try_from(due.as_micros()).unwrap_or(u64::MAX).max(1)
}

/// The services StorPort offers the core, for one adapter.
///
/// # Invariants
/// `extension` is the adapter's device extension, valid while the adapter
/// exists (this value lives inside it); `dpcs` and `timers` point into it,
/// with the first `dpc_count`/`timer_count` entries initialised by
/// `HwFindAdapter`.
pub struct NtStorPort {
    extension: NonNull<c_void>,
    platform: NtPlatform,
    dpcs: NonNull<DpcSlots>,
    dpc_count: u8,
    timers: NonNull<[TimerSlot; MAX_TIMERS]>,
    timer_count: u8,
    timer_callback: PHW_TIMER_EX,
    dma: Option<DmaPath>,
    layout: ExtensionLayout,
}

// SAFETY: StorPort's routines may be called from any processor; the
// pointers are to the adapter's non-paged extension, shared through
// atomics and StorPort's own synchronisation.
unsafe impl Send for NtStorPort {}
// SAFETY: as above.
unsafe impl Sync for NtStorPort {}

/// What [`NtStorPort::new`] needs.
pub struct PortParts {
    /// The device extension.
    pub extension: NonNull<c_void>,
    /// The kernel platform (work items against the adapter's FDO).
    pub platform: NtPlatform,
    /// The initialised `STOR_DPC`s.
    pub dpcs: NonNull<DpcSlots>,
    /// How many.
    pub dpc_count: u8,
    /// The initialised timers.
    pub timers: NonNull<[TimerSlot; MAX_TIMERS]>,
    /// How many.
    pub timer_count: u8,
    /// The shim's `HW_TIMER_EX` for this miniport.
    pub timer_callback: PHW_TIMER_EX,
    /// The HCA's DMA path, where there is one.
    pub dma: Option<DmaPath>,
    /// The request extension layout.
    pub layout: ExtensionLayout,
}

impl NtStorPort {
    /// The port of one adapter.
    ///
    /// # Safety
    /// The parts satisfy the type's invariants (the find-adapter
    /// trampoline builds them from the device extension it was given).
    #[must_use]
    pub unsafe fn new(parts: PortParts) -> Self {
        // INVARIANT: the caller's contract.
        NtStorPort {
            extension: parts.extension,
            platform: parts.platform,
            dpcs: parts.dpcs,
            dpc_count: parts.dpc_count,
            timers: parts.timers,
            timer_count: parts.timer_count,
            timer_callback: parts.timer_callback,
            dma: parts.dma,
            layout: parts.layout,
        }
    }

    /// The device extension.
    #[must_use]
    pub fn extension(&self) -> *mut c_void {
        self.extension.as_ptr()
    }

    /// The request extension layout.
    #[must_use]
    pub fn layout(&self) -> ExtensionLayout {
        self.layout
    }

    fn timer(&self, timer: TimerId) -> Option<&TimerSlot> {
        if timer.0 >= self.timer_count {
            return None;
        }
        // SAFETY: points into the live extension (invariant).
        unsafe { self.timers.as_ref() }.get(usize::from(timer.0))
    }

    /// `StorPortRequestTimer(ext, handle, callback, context, value, 0)`.
    fn request_timer_raw(&self, handle: *mut c_void, index: u8, value_us: u64) -> u32 {
        // SAFETY: an initialised timer of this adapter; any IRQL. The
        // context is the timer's index, read back by the callback.
        unsafe {
            StorPortExtendedFunction(
                ExtFunctionRequestTimer,
                self.extension.as_ptr(),
                handle,
                self.timer_callback,
                usize::from(index) as *mut c_void,
                value_us,
                0_u64,
            )
        }
    }

    fn holds(&self, address: Address) -> (u8, u8, u8) {
        (address.path, address.target, address.lun)
    }
}

impl StorPort for NtStorPort {
    type Platform = NtPlatform;
    type Srb = NtSrb;

    fn platform(&self) -> &NtPlatform {
        &self.platform
    }

    fn complete_request(&self, srb: NtSrb, _irql: &impl LeDispatch) {
        // SAFETY: a request of this adapter not completed yet (the handle's
        // invariant), completed once: the handle is consumed here.
        unsafe {
            StorPortNotification(
                _SCSI_NOTIFICATION_TYPE::RequestComplete,
                self.extension.as_ptr(),
                srb.as_raw(),
            );
        }
    }

    fn busy(&self, requests_to_complete: u32, _irql: &impl LeDispatch) -> bool {
        // SAFETY: this adapter's extension; <= DISPATCH_LEVEL (token).
        unsafe { StorPortBusy(self.extension.as_ptr(), requests_to_complete) != 0 }
    }

    fn ready(&self, _irql: &impl LeDispatch) -> bool {
        // SAFETY: as `busy`.
        unsafe { StorPortReady(self.extension.as_ptr()) != 0 }
    }

    fn device_busy(
        &self,
        address: Address,
        requests_to_complete: u32,
        _irql: &impl LeDispatch,
    ) -> bool {
        let (p, t, l) = self.holds(address);
        // SAFETY: as `busy`.
        unsafe { StorPortDeviceBusy(self.extension.as_ptr(), p, t, l, requests_to_complete) != 0 }
    }

    fn device_ready(&self, address: Address, _irql: &impl LeDispatch) -> bool {
        let (p, t, l) = self.holds(address);
        // SAFETY: as `busy`.
        unsafe { StorPortDeviceReady(self.extension.as_ptr(), p, t, l) != 0 }
    }

    fn pause(&self, timeout_secs: u32, _irql: &impl LeDispatch) -> bool {
        // SAFETY: as `busy`.
        unsafe { StorPortPause(self.extension.as_ptr(), timeout_secs) != 0 }
    }

    fn resume(&self, _irql: &impl LeDispatch) -> bool {
        // SAFETY: as `busy`.
        unsafe { StorPortResume(self.extension.as_ptr()) != 0 }
    }

    fn pause_device(&self, address: Address, timeout_secs: u32, _irql: &impl LeDispatch) -> bool {
        let (p, t, l) = self.holds(address);
        // SAFETY: as `busy`.
        unsafe { StorPortPauseDevice(self.extension.as_ptr(), p, t, l, timeout_secs) != 0 }
    }

    fn resume_device(&self, address: Address, _irql: &impl LeDispatch) -> bool {
        let (p, t, l) = self.holds(address);
        // SAFETY: as `busy`.
        unsafe { StorPortResumeDevice(self.extension.as_ptr(), p, t, l) != 0 }
    }

    fn get_scatter_gather_list(
        &self,
        srb: NtSrb,
        irql: &Dispatch<'_>,
    ) -> Result<(), SgListRefused<NtSrb>> {
        match &self.dma {
            Some(dma) => dma.get(self.extension, self.layout, srb, irql),
            // No HCA, so no DMA adapter to map the buffer for: the request
            // cannot be carried now.
            None => Err(SgListRefused { srb }),
        }
    }

    fn put_scatter_gather_list(&self, srb: &mut NtSrb, irql: &Dispatch<'_>) {
        if let Some(dma) = &self.dma {
            dma.put(srb, irql);
        }
    }

    fn request_timer(&self, timer: TimerId, due: Duration, _irql: &impl LeDispatch) -> bool {
        let Some(slot) = self.timer(timer) else {
            return false;
        };
        let handle = slot.handle.load(Ordering::Acquire);
        slot.armed.store(true, Ordering::Release);
        let value = timer_value_us(due);
        let mut status = self.request_timer_raw(handle, timer.0, value);
        if status == STOR_STATUS_BUSY {
            // An earlier request is pending: cancel it, then request anew
            // (re-arming replaces the expiry).
            self.request_timer_raw(handle, timer.0, 0);
            status = self.request_timer_raw(handle, timer.0, value);
        }
        if status != STOR_STATUS_SUCCESS {
            slot.armed.store(false, Ordering::Release);
            return false;
        }
        true
    }

    fn cancel_timer(&self, timer: TimerId, _irql: &impl LeDispatch) -> bool {
        let Some(slot) = self.timer(timer) else {
            return false;
        };
        let was = slot.armed.swap(false, Ordering::AcqRel);
        self.request_timer_raw(slot.handle.load(Ordering::Acquire), timer.0, 0);
        was
    }

    fn issue_dpc(&self, dpc: DpcId) -> bool {
        if dpc.0 >= self.dpc_count {
            return false;
        }
        // SAFETY: points into the live extension (invariant).
        let Some(stor_dpc) = (unsafe { self.dpcs.as_ref() }).get(usize::from(dpc.0)) else {
            return false;
        };
        let mut queued: u8 = 0;
        // SAFETY: the inline StorPortIssueDpc of storport.h: (IssueDpc,
        // extension, &STOR_DPC, SystemArgument1, SystemArgument2, &BOOLEAN);
        // an initialised DPC (invariant); any IRQL. The first system
        // argument carries the DPC's index to the routine.
        unsafe {
            StorPortNotification(
                IssueDpc,
                self.extension.as_ptr(),
                stor_dpc,
                usize::from(dpc.0) as *mut c_void,
                null_mut::<c_void>(),
                &raw mut queued,
            );
        }
        queued != 0
    }

    fn log(&self, event: LogEvent, _irql: &impl LeDispatch) {
        let (p, t, l) = event
            .address
            .map_or((0, 0, 0), |a| (a.path, a.target, a.lun));
        // SAFETY: this adapter's extension; no request; <= DISPATCH_LEVEL.
        unsafe {
            StorPortLogError(
                self.extension.as_ptr(),
                null_mut::<SCSI_REQUEST_BLOCK>(),
                p,
                t,
                l,
                SP_INTERNAL_ADAPTER_ERROR,
                unique_id(&event),
            );
        }
    }

    fn notify_bus_change(&self, path: u8, _irql: &impl LeDispatch) -> bool {
        // SAFETY: BusChangeDetected takes (extension, UCHAR PathId), the
        // byte promoted to an int in the variadic call; <= DISPATCH_LEVEL.
        unsafe {
            StorPortNotification(
                _SCSI_NOTIFICATION_TYPE::BusChangeDetected,
                self.extension.as_ptr(),
                u32::from(path),
            );
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_ids_carry_kind_and_detail() {
        let event = |kind, detail| LogEvent {
            kind,
            address: None,
            detail,
        };
        assert_eq!(unique_id(&event(LogKind::BusReset, 3)), 0x0800_0003);
        assert_eq!(
            unique_id(&event(LogKind::StaleCompletion, 0xFFFF_FFFF_FF12_3456)),
            0x0112_3456
        );
        let kinds = [
            LogKind::StaleCompletion,
            LogKind::TransportContract,
            LogKind::CreditStarvation,
            LogKind::TargetState,
            LogKind::AdapterStopped,
            LogKind::AdapterRestarted,
            LogKind::TransportStartFailed,
            LogKind::BusReset,
            LogKind::TaskManagement,
        ];
        let mut seen: Vec<u32> = kinds
            .iter()
            .map(|&k| unique_id(&event(k, 0)) >> 24)
            .collect();
        seen.dedup();
        assert_eq!(seen.len(), kinds.len(), "every kind has its own code");
    }

    #[test]
    fn timer_values_are_microseconds_and_never_cancel() {
        assert_eq!(timer_value_us(Duration::ZERO), 1);
        assert_eq!(timer_value_us(Duration::from_nanos(1)), 1);
        assert_eq!(timer_value_us(Duration::from_millis(250)), 250_000);
        assert_eq!(timer_value_us(Duration::MAX), u64::MAX);
    }

    #[test]
    fn dpc_slots_are_bounded() {
        let slots = DpcSlots::new();
        assert!(slots.get(MAX_DPCS - 1).is_some());
        assert!(slots.get(MAX_DPCS).is_none());
    }
}
