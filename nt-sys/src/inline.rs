//! What `wdm.h` implements as inline functions or macros, so that neither
//! bindgen nor `wdk-sys` declares it: the same few lines here, over the
//! facade's types, for both sources.

use crate::{
    _EVENT_TYPE, FAST_MUTEX, KEVENT, KIRQL, KSPIN_LOCK, KeInitializeEvent, LONG, OBJECT_ATTRIBUTES,
    PVOID, ULONG, UNICODE_STRING,
};
use core::mem::{offset_of, size_of};
use core::ptr::null_mut;

/// `KeGetCurrentIrql` as `wdm.h` defines it on x64: the IRQL is the task
/// priority register, `cr8`.
///
/// # Safety
/// Kernel mode only: reading `cr8` at CPL 3 (a user-mode test, Wine)
/// raises a general-protection fault.
///
/// # IRQL
/// Any.
#[cfg(target_arch = "x86_64")]
#[must_use]
pub unsafe fn KeGetCurrentIrql() -> KIRQL {
    let irql: u64;
    // SAFETY: the caller runs at CPL 0, where reading cr8 has no effect
    // other than returning the current IRQL.
    unsafe {
        core::arch::asm!("mov {}, cr8", out(reg) irql, options(nomem, nostack, preserves_flags));
    }
    // CAST: cr8 holds a 4-bit priority.
    (irql & 0xF) as KIRQL
}

/// `KeInitializeSpinLock`: an unlocked `KSPIN_LOCK` is zero.
///
/// # IRQL
/// Any.
#[must_use]
pub const fn spin_lock_initializer() -> KSPIN_LOCK {
    0
}

/// `FM_LOCK_BIT`: a fast mutex's `Count` when it is free.
const FM_LOCK_BIT: LONG = 1;

/// `ExInitializeFastMutex`: free, no owner, no contention, its event a
/// non-signalled synchronisation event.
///
/// # Safety
/// `mutex` is valid for writes and is not used by anyone else; it must not
/// move afterwards (its event's wait list points at itself).
///
/// # IRQL
/// <= `DISPATCH_LEVEL`.
pub unsafe fn ExInitializeFastMutex(mutex: *mut FAST_MUTEX) {
    let field = |offset: usize| mutex.wrapping_byte_add(offset);
    let count = field(offset_of!(FAST_MUTEX, Count)).cast::<LONG>();
    let owner = field(offset_of!(FAST_MUTEX, Owner)).cast::<PVOID>();
    let contention = field(offset_of!(FAST_MUTEX, Contention)).cast::<ULONG>();
    let event = field(offset_of!(FAST_MUTEX, Event)).cast::<KEVENT>();
    // SAFETY: a field of the caller's mutex, valid for writes and aligned.
    unsafe { count.write(FM_LOCK_BIT) };
    // SAFETY: as above.
    unsafe { owner.write(null_mut()) };
    // SAFETY: as above.
    unsafe { contention.write(0) };
    // SAFETY: the event lies inside the caller's mutex, which stays put.
    unsafe { KeInitializeEvent(event, _EVENT_TYPE::SynchronizationEvent, 0) };
}

/// `InitializeObjectAttributes(&oa, name, attributes, NULL, NULL)`.
///
/// # IRQL
/// Any.
#[must_use]
pub fn object_attributes(name: *mut UNICODE_STRING, attributes: ULONG) -> OBJECT_ATTRIBUTES {
    OBJECT_ATTRIBUTES {
        // CAST: 48 bytes.
        Length: size_of::<OBJECT_ATTRIBUTES>() as ULONG,
        RootDirectory: null_mut(),
        ObjectName: name,
        Attributes: attributes,
        SecurityDescriptor: null_mut(),
        SecurityQualityOfService: null_mut(),
    }
}
