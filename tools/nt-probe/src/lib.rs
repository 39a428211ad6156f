//! `kvprobe.sys`: kverbs' NT platform in a kernel image, under Wine.
//!
//! `DriverEntry` creates a device object (work items need one), builds an
//! `NtPlatform` on it, exercises each primitive the way kverbs uses it, and
//! records one REG_SZ per primitive under
//! `HKLM\...\Services\kvprobe\Probe`. It judges nothing: `kv-sys wine`
//! reads the values back and asserts.
//!
//! Not exercised, because Wine cannot run them: reading the IRQL (`cr8`
//! faults in user mode), per-processor DPC targeting (Wine's ntoskrnl has
//! no `KeGetProcessorNumberFromIndex`) and `stall` (Wine's HAL exports
//! `KeStallExecutionProcessor` as an unimplemented stub).

#![no_std]
#![allow(non_snake_case, reason = "kernel export names")]

extern crate alloc;

use alloc::boxed::Box;
use alloc::sync::Arc;
use core::alloc::{GlobalAlloc, Layout};
use core::fmt::Write as _;
use core::ptr::NonNull;
use core::sync::atomic::{AtomicU32, Ordering};
use core::time::Duration;

use kverbs::irql::{Dispatch, LeDispatch, Passive};
use kverbs::platform::nt::{NtEvent, NtPlatform, pool};
use kverbs::platform::{DpcTarget, EventKind, Platform, RawDpc, RawEvent, RawTimer, RawWorkItem};
use kverbs::sync::{PassiveMutex, SpinLock, with_dispatch};
use nt_sys::{DEVICE_OBJECT, DRIVER_OBJECT, NTSTATUS, PCUNICODE_STRING, STATUS_SUCCESS};

struct Allocator;

// SAFETY: kverbs' pool with the layout's size and alignment.
unsafe impl GlobalAlloc for Allocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        pool::alloc_aligned(&pool::KernelPool, layout, false)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: from `alloc` with this layout.
        unsafe { pool::dealloc_aligned(&pool::KernelPool, ptr, layout) };
    }
}

#[global_allocator]
static ALLOCATOR: Allocator = Allocator;

#[panic_handler]
fn panic(_: &core::panic::PanicInfo<'_>) -> ! {
    note("99-panic", format_args!("panicked"));
    loop {}
}

unsafe extern "system" {
    fn RtlCreateRegistryKey(RelativeTo: u32, Path: *const u16) -> NTSTATUS;
    fn RtlWriteRegistryValue(
        RelativeTo: u32,
        Path: *const u16,
        ValueName: *const u16,
        ValueType: u32,
        ValueData: *mut core::ffi::c_void,
        ValueLength: u32,
    ) -> NTSTATUS;
    fn IoCreateDevice(
        DriverObject: *mut DRIVER_OBJECT,
        DeviceExtensionSize: u32,
        DeviceName: *mut core::ffi::c_void,
        DeviceType: u32,
        DeviceCharacteristics: u32,
        Exclusive: u8,
        DeviceObject: *mut *mut DEVICE_OBJECT,
    ) -> NTSTATUS;
}

fn wide<const N: usize>(s: &str) -> [u16; N] {
    let mut w = [0u16; N];
    for (d, b) in w.iter_mut().zip(s.bytes().take(N - 1)) {
        *d = u16::from(b);
    }
    w
}

struct Line {
    buf: [u8; 200],
    len: usize,
}

impl core::fmt::Write for Line {
    fn write_str(&mut self, s: &str) -> core::fmt::Result {
        for b in s.bytes() {
            if let Some(slot) = self.buf.get_mut(self.len) {
                *slot = b;
                self.len += 1;
            }
        }
        Ok(())
    }
}

/// Records `Probe\<key> = <text>`.
fn note(key: &str, args: core::fmt::Arguments<'_>) {
    let mut line = Line {
        buf: [0; 200],
        len: 0,
    };
    let _ = line.write_fmt(args);
    let text = core::str::from_utf8(line.buf.get(..line.len).unwrap_or(&[])).unwrap_or("?");
    let path = wide::<32>("kvprobe\\Probe");
    let name = wide::<64>(key);
    let mut data = wide::<256>(text);
    let bytes = ((text.len().min(255) + 1) * 2) as u32;
    // SAFETY: NUL-terminated wide strings and a buffer of `bytes` bytes.
    unsafe {
        RtlCreateRegistryKey(1, path.as_ptr());
        RtlWriteRegistryValue(
            1,
            path.as_ptr(),
            name.as_ptr(),
            1,
            data.as_mut_ptr().cast(),
            bytes,
        );
    }
}

fn ok(b: bool) -> u8 {
    u8::from(b)
}

/// Something a routine sets, and an event that says it did.
struct Signal {
    hits: AtomicU32,
    event: NtEvent,
}

impl Signal {
    fn new() -> Arc<Self> {
        Arc::new(Signal {
            hits: AtomicU32::new(0),
            event: NtEvent::new(EventKind::Notification, false),
        })
    }

    fn hit(&self, irql: &impl LeDispatch) {
        self.hits.fetch_add(1, Ordering::SeqCst);
        self.event.set(irql);
    }
}

fn probe(platform: &NtPlatform, p: &Passive<'_>) {
    // Spin locks, all three acquisition forms, and raise/lower.
    let lock: SpinLock<u32, NtPlatform> = SpinLock::new(0);
    *lock.lock(p) += 1;
    lock.with_queued(p, |v, _| *v += 1);
    with_dispatch::<NtPlatform, _, _>(p, |d: &Dispatch<'_>| {
        *lock.lock_at_dpc_level(d) += 1;
        lock.with_queued_at_dpc_level(d, |v, _| *v += 1);
    });
    note(
        "01-spin-locks",
        format_args!("ok={}", ok(*lock.lock(p) == 4)),
    );

    // Events: a synchronisation event times out unset, wakes set, and
    // clears itself; a notification event stays set until cleared.
    let sync = NtEvent::new(EventKind::Synchronization, false);
    let timed_out = !sync.wait_timeout(Duration::from_millis(10), p);
    sync.set(p);
    let woke = sync.wait_timeout(Duration::from_millis(10), p);
    let auto_cleared = !sync.wait_timeout(Duration::from_millis(10), p);
    let notify = NtEvent::new(EventKind::Notification, true);
    let stays = notify.wait_timeout(Duration::ZERO, p) && notify.wait_timeout(Duration::ZERO, p);
    notify.clear(p);
    let cleared = !notify.wait_timeout(Duration::from_millis(10), p);
    note(
        "02-events",
        format_args!(
            "timeout={} set={} auto_clear={} notification={} clear={}",
            ok(timed_out),
            ok(woke),
            ok(auto_cleared),
            ok(stays),
            ok(cleared)
        ),
    );

    // The fast mutex (critical region + unsafe acquire), twice.
    let mutex: PassiveMutex<u32, NtPlatform> = PassiveMutex::new(0);
    *mutex.lock(p) += 1;
    *mutex.lock(p) += 1;
    note(
        "03-fast-mutex",
        format_args!("ok={}", ok(*mutex.lock(p) == 2)),
    );

    // Time: a monotonic counter, a frequency, a sleep it can measure.
    let hz = NtPlatform::ticks_per_second();
    let t0 = NtPlatform::now();
    platform.delay(Duration::from_millis(20), p);
    let elapsed_ms = NtPlatform::now().since(t0).saturating_mul(1000) / hz.max(1);
    note(
        "04-time",
        format_args!(
            "frequency={} delay_measured={}",
            ok(hz > 0),
            ok((15..2000).contains(&elapsed_ms))
        ),
    );

    // Work items: queued, run at PASSIVE on a worker thread, requeued from
    // a clean state, dropped while queued.
    let signal = Signal::new();
    let seen = signal.clone();
    let item = platform.new_work_item(Box::new(move |q: &Passive<'_>| seen.hit(q)), p);
    match item {
        Ok(item) => {
            let queued = item.queue(p);
            let ran = signal.event.wait_timeout(Duration::from_secs(5), p);
            signal.event.clear(p);
            let requeued = item.queue(p);
            drop(item);
            let ran_again = signal.event.wait_timeout(Duration::from_secs(5), p);
            note(
                "05-work-item",
                format_args!(
                    "queued={} ran={} requeued={} ran_after_drop={} runs={}",
                    ok(queued),
                    ok(ran),
                    ok(requeued),
                    ok(ran_again),
                    signal.hits.load(Ordering::SeqCst)
                ),
            );
        }
        Err(_) => note("05-work-item", format_args!("alloc failed")),
    }

    // A DPC on the current processor.
    let signal = Signal::new();
    let seen = signal.clone();
    match platform.new_dpc(
        Box::new(move |d: &Dispatch<'_>| seen.hit(d)),
        DpcTarget::Current,
        p,
    ) {
        Ok(dpc) => {
            let queued = dpc.queue();
            // Windows runs it within microseconds; Wine never does, and
            // this wait counts against the service's start timeout.
            let ran = signal.event.wait_timeout(Duration::from_millis(250), p);
            note(
                "06-dpc",
                format_args!("queued={} ran={}", ok(queued), ok(ran)),
            );
        }
        Err(_) => note("06-dpc", format_args!("alloc failed")),
    }

    // A one-shot timer: fires once after its due time; a cancelled one
    // reports it was armed and does not fire.
    let signal = Signal::new();
    let seen = signal.clone();
    match platform.new_timer(Box::new(move |d: &Dispatch<'_>| seen.hit(d)), p) {
        Ok(timer) => {
            let t0 = NtPlatform::now();
            let was_armed = timer.set(Duration::from_millis(50), p);
            let fired = signal.event.wait_timeout(Duration::from_secs(3), p);
            let after_ms = NtPlatform::now().since(t0).saturating_mul(1000) / hz.max(1);
            let rearmed = timer.set(Duration::from_secs(30), p);
            let cancelled = timer.cancel(p);
            let cancelled_again = timer.cancel(p);
            drop(timer);
            note(
                "07-timer",
                format_args!(
                    "was_armed={} fired={} not_early={} rearm_was_armed={} cancel={} cancel_again={} hits={}",
                    ok(was_armed),
                    ok(fired),
                    ok(after_ms >= 40),
                    ok(rearmed),
                    ok(cancelled),
                    ok(cancelled_again),
                    signal.hits.load(Ordering::SeqCst)
                ),
            );
        }
        Err(_) => note("07-timer", format_args!("alloc failed")),
    }

    // Non-paged pool, beyond the pool's own alignment.
    let layout = Layout::from_size_align(8192, 4096).unwrap_or(Layout::new::<u64>());
    match platform.alloc_nonpaged(layout, p) {
        Ok(block) => {
            let aligned = block.as_ptr() as usize % 4096 == 0;
            // SAFETY: from `alloc_nonpaged` with this layout, once.
            unsafe { platform.free_nonpaged(block, layout) };
            note("08-pool", format_args!("aligned={}", ok(aligned)));
        }
        Err(_) => note("08-pool", format_args!("alloc failed")),
    }

    note(
        "09-processors",
        format_args!("at_least_one={}", ok(platform.processor_count() >= 1)),
    );
    platform.flush_dpcs(p);
    note("10-flush-dpcs", format_args!("returned=1"));

    // The CSPRNG behind mutual-CHAP challenges: two draws, each filled and
    // different from the other (a 2^-256 chance of a false "same").
    let mut first = [0u8; 32];
    let mut second = [0u8; 32];
    let filled = platform.fill_random(&mut first, p).is_ok()
        && platform.fill_random(&mut second, p).is_ok();
    note(
        "11-random",
        format_args!(
            "filled={} nonzero={} differ={}",
            ok(filled),
            ok(first.iter().any(|&b| b != 0)),
            ok(first != second)
        ),
    );
}

/// The probe's entry point.
///
/// # Safety
/// Called once by the I/O manager at PASSIVE_LEVEL.
// SAFETY: the one symbol named `DriverEntry` in the image (/ENTRY).
#[unsafe(export_name = "DriverEntry")]
pub unsafe extern "system" fn driver_entry(
    driver: *mut DRIVER_OBJECT,
    _registry: PCUNICODE_STRING,
) -> NTSTATUS {
    // SAFETY: DriverEntry runs at PASSIVE_LEVEL.
    let p = unsafe { Passive::assume::<NtPlatform>() };
    pool::resolve_pool_routines(&p);
    let mut device: *mut DEVICE_OBJECT = core::ptr::null_mut();
    // SAFETY: the driver's object; an unnamed device for the work items.
    let status =
        unsafe { IoCreateDevice(driver, 0, core::ptr::null_mut(), 4, 0, 0, &raw mut device) };
    let Some(device) = NonNull::new(device).filter(|_| status == STATUS_SUCCESS) else {
        note("00-error", format_args!("IoCreateDevice {status:#x}"));
        return status;
    };
    // SAFETY: the device is never deleted (the probe stays loaded), so it
    // outlives every work item and timer.
    let platform = unsafe { NtPlatform::new(device) };
    probe(&platform, &p);
    STATUS_SUCCESS
}
