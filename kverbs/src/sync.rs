//! Locks with guards that carry the IRQL, and the loom facade.
//!
//! [`SpinLock<T, P>`] owns its data (the RfL `Lock<T, B>` shape). Acquiring
//! it raises to `DISPATCH_LEVEL`; the guard restores the saved level when it
//! drops and hands out a [`Dispatch`] token for the time it is held, so code
//! under the lock can call anything that needs `&Dispatch` and nothing that
//! needs `&Passive`. Three acquisition flavours mirror NT:
//!
//! * [`SpinLock::lock`] — `KeAcquireSpinLock` (from <= `DISPATCH_LEVEL`);
//! * [`SpinLock::lock_at_dpc_level`] — `KeAcquireSpinLockAtDpcLevel`
//!   (requires `&Dispatch`, does not touch the IRQL);
//! * [`SpinLock::with_queued`] / [`SpinLock::with_queued_at_dpc_level`] —
//!   `KeAcquireInStackQueuedSpinLock(AtDpcLevel)`: the `KLOCK_QUEUE_HANDLE`
//!   must not move while held, so these take a closure and keep the handle in
//!   their own stack frame.
//!
//! [`PassiveMutex<T, P>`] is the blocking lock (`FAST_MUTEX`); it requires
//! `&Passive`.
//!
//! The [`atomic`] module is the loom facade (tokio style): `core` atomics
//! normally, loom's under `cfg(loom)`, so the lock-free state machines in
//! [`crate::drain`], [`crate::rundown`] and [`crate::worker`] can be model
//! checked unchanged.

// UNSAFETY: the locks hand out `&mut T` from an `UnsafeCell` and pair raw
// acquire/release calls; each block states the lock invariant it relies on.
#![expect(unsafe_code, reason = "lock guards over UnsafeCell")]

use core::cell::UnsafeCell;
use core::marker::PhantomData;
use core::ops::{Deref, DerefMut};

use crate::irql::{Dispatch, Irql, LeDispatch, Passive};
use crate::platform::{Platform, RawMutex, RawSpinLock};

/// Atomics: `core::sync::atomic` normally, `loom` under `cfg(loom)`.
pub mod atomic {
    #[cfg(loom)]
    pub use loom::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};

    #[cfg(not(loom))]
    pub use core::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
}

/// Data protected by a platform spin lock (`KSPIN_LOCK`).
///
/// # Invariants
///
/// `data` is accessed only while `raw` is held by the accessing thread.
pub struct SpinLock<T, P: Platform> {
    raw: P::SpinLock,
    data: UnsafeCell<T>,
}

// SAFETY: `SpinLock` serialises all access to `data`, so sharing it between
// threads is sound when `T` may be sent between threads.
unsafe impl<T: Send, P: Platform> Sync for SpinLock<T, P> {}
// SAFETY: moving the lock moves the data; `P::SpinLock` is `Send`.
unsafe impl<T: Send, P: Platform> Send for SpinLock<T, P> {}

impl<T, P: Platform> SpinLock<T, P> {
    /// An unlocked lock around `data`.
    pub fn new(data: T) -> Self {
        SpinLock {
            raw: P::SpinLock::new(),
            data: UnsafeCell::new(data),
        }
    }

    /// Raises to `DISPATCH_LEVEL` and acquires (`KeAcquireSpinLock`).
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL` (the token proves it); the guard runs at
    /// `DISPATCH_LEVEL` and restores the caller's level on drop.
    ///
    /// A caller whose token proves `DISPATCH_LEVEL` already runs at the
    /// lock's level: the acquisition is then the `AtDpcLevel` one, which
    /// neither raises nor lowers (on NT, `KeAcquireSpinLockAtDpcLevel`: no
    /// IRQL write; on the host, the verifier checks the level instead of
    /// recording a raise).
    #[inline]
    pub fn lock<'a, I: LeDispatch>(&'a self, _irql: &'a I) -> SpinLockGuard<'a, T, P> {
        let at_dpc = I::IRQL == Irql::DISPATCH;
        let saved = if at_dpc {
            self.raw.acquire_at_dpc_level();
            Irql::DISPATCH
        } else {
            self.raw.acquire()
        };
        SpinLockGuard {
            lock: self,
            saved,
            at_dpc,
            token: Dispatch::from_held_lock(),
        }
    }

    /// Acquires without raising (`KeAcquireSpinLockAtDpcLevel`).
    ///
    /// # IRQL
    ///
    /// `DISPATCH_LEVEL` only.
    pub fn lock_at_dpc_level<'a>(&'a self, _irql: &'a Dispatch<'_>) -> SpinLockDpcGuard<'a, T, P> {
        self.raw.acquire_at_dpc_level();
        SpinLockDpcGuard {
            lock: self,
            token: Dispatch::from_held_lock(),
        }
    }

    /// Runs `f` under an in-stack queued acquisition
    /// (`KeAcquireInStackQueuedSpinLock`): FIFO among waiters, the queue
    /// handle lives in this frame.
    ///
    /// # IRQL
    ///
    /// <= `DISPATCH_LEVEL`; `f` runs at `DISPATCH_LEVEL`.
    pub fn with_queued<I: LeDispatch, R>(
        &self,
        _irql: &I,
        f: impl for<'t> FnOnce(&mut T, &Dispatch<'t>) -> R,
    ) -> R {
        let mut handle = <P::SpinLock as RawSpinLock>::QueueHandle::default();
        let handle_ptr: *mut _ = &mut handle;
        // SAFETY: `handle` lives in this frame, is not moved (only this raw
        // pointer is used until the release below), and is released before
        // the frame ends.
        unsafe { self.raw.acquire_in_stack_queued(handle_ptr) };
        let token = Dispatch::from_held_lock();
        // SAFETY: the lock is held until the release below, so this is the
        // only access to `data` (lock invariant).
        let data = unsafe { &mut *self.data.get() };
        let result = f(data, &token);
        // SAFETY: the matching acquisition above used this handle, unmoved.
        unsafe { self.raw.release_in_stack_queued(handle_ptr) };
        result
    }

    /// Runs `f` under an in-stack queued acquisition without raising
    /// (`KeAcquireInStackQueuedSpinLockAtDpcLevel`).
    ///
    /// # IRQL
    ///
    /// `DISPATCH_LEVEL` only.
    pub fn with_queued_at_dpc_level<R>(
        &self,
        _irql: &Dispatch<'_>,
        f: impl for<'t> FnOnce(&mut T, &Dispatch<'t>) -> R,
    ) -> R {
        let mut handle = <P::SpinLock as RawSpinLock>::QueueHandle::default();
        let handle_ptr: *mut _ = &mut handle;
        // SAFETY: as in `with_queued`; the token proves DISPATCH_LEVEL.
        unsafe { self.raw.acquire_in_stack_queued_at_dpc_level(handle_ptr) };
        let token = Dispatch::from_held_lock();
        // SAFETY: the lock is held until the release below (lock invariant).
        let data = unsafe { &mut *self.data.get() };
        let result = f(data, &token);
        // SAFETY: the matching acquisition above used this handle, unmoved.
        unsafe { self.raw.release_in_stack_queued_from_dpc_level(handle_ptr) };
        result
    }

    /// Mutable access without locking: `&mut self` proves exclusivity.
    pub fn get_mut(&mut self) -> &mut T {
        self.data.get_mut()
    }
}

impl Dispatch<'_> {
    /// A token for the holder of a spin lock: holding one proves the level.
    fn from_held_lock() -> Self {
        // SAFETY: only called right after a spin-lock acquisition succeeded,
        // which leaves the processor at DISPATCH_LEVEL until the guard that
        // owns this token releases it.
        unsafe { Dispatch::assume_unchecked() }
    }
}

/// A held [`SpinLock`] (`KeAcquireSpinLock`); releases and restores the saved
/// IRQL on drop.
#[must_use = "the lock is released immediately when the guard is unused"]
pub struct SpinLockGuard<'a, T, P: Platform> {
    lock: &'a SpinLock<T, P>,
    saved: Irql,
    /// Taken with `acquire_at_dpc_level` (the caller was at
    /// `DISPATCH_LEVEL`): released without lowering.
    at_dpc: bool,
    token: Dispatch<'a>,
}

impl<'a, T, P: Platform> SpinLockGuard<'a, T, P> {
    /// The `DISPATCH_LEVEL` token valid while the lock is held.
    pub fn irql(&self) -> &Dispatch<'a> {
        &self.token
    }

    /// The data and the token at once, for calls that need both.
    pub fn split(&mut self) -> (&mut T, &Dispatch<'a>) {
        // SAFETY: the guard holds the lock (lock invariant); `&mut self`
        // makes this the only reference derived from the guard.
        let data = unsafe { &mut *self.lock.data.get() };
        (data, &self.token)
    }

    /// The level this guard restores on drop.
    pub fn saved_irql(&self) -> Irql {
        self.saved
    }
}

impl<T, P: Platform> Deref for SpinLockGuard<'_, T, P> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the guard holds the lock (lock invariant).
        unsafe { &*self.lock.data.get() }
    }
}

impl<T, P: Platform> DerefMut for SpinLockGuard<'_, T, P> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: the guard holds the lock (lock invariant).
        unsafe { &mut *self.lock.data.get() }
    }
}

impl<T, P: Platform> Drop for SpinLockGuard<'_, T, P> {
    #[inline]
    fn drop(&mut self) {
        if self.at_dpc {
            // SAFETY: this guard's acquisition was `acquire_at_dpc_level`.
            unsafe { self.lock.raw.release_from_dpc_level() };
        } else {
            // SAFETY: this guard's acquisition returned `saved`.
            unsafe { self.lock.raw.release(self.saved) };
        }
    }
}

/// A held [`SpinLock`] taken at `DISPATCH_LEVEL` (`AtDpcLevel`); releases
/// without lowering on drop.
#[must_use = "the lock is released immediately when the guard is unused"]
pub struct SpinLockDpcGuard<'a, T, P: Platform> {
    lock: &'a SpinLock<T, P>,
    token: Dispatch<'a>,
}

impl<'a, T, P: Platform> SpinLockDpcGuard<'a, T, P> {
    /// The `DISPATCH_LEVEL` token valid while the lock is held.
    pub fn irql(&self) -> &Dispatch<'a> {
        &self.token
    }
}

impl<T, P: Platform> Deref for SpinLockDpcGuard<'_, T, P> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the guard holds the lock (lock invariant).
        unsafe { &*self.lock.data.get() }
    }
}

impl<T, P: Platform> DerefMut for SpinLockDpcGuard<'_, T, P> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: the guard holds the lock (lock invariant).
        unsafe { &mut *self.lock.data.get() }
    }
}

impl<T, P: Platform> Drop for SpinLockDpcGuard<'_, T, P> {
    fn drop(&mut self) {
        // SAFETY: this guard holds the lock from `acquire_at_dpc_level`.
        unsafe { self.lock.raw.release_from_dpc_level() };
    }
}

/// Runs `f` at `DISPATCH_LEVEL`, handing it the token: inside a raise
/// (`KeRaiseIrql` / `KeLowerIrql`) when the caller's token is [`Passive`],
/// directly when it is [`Dispatch`] (the choice is made at compile time).
///
/// A caller that already proves `DISPATCH_LEVEL` — a DPC routine, a lock
/// holder, StorPort's `HwStartIo` — would only raise to the level it is at
/// and lower back: two IRQL writes (on the host, two verifier visits) per
/// call on the per-round drain path. It enters like an `AtDpcLevel` lock
/// acquisition instead, with the level checked by
/// [`Platform::enter_at_dispatch`] (the host verifier records an entry below
/// `DISPATCH_LEVEL`).
///
/// # IRQL
///
/// <= `DISPATCH_LEVEL`.
#[inline]
pub fn with_dispatch<P: Platform, I: LeDispatch, R>(
    _irql: &I,
    f: impl for<'t> FnOnce(&Dispatch<'t>) -> R,
) -> R {
    if I::IRQL == Irql::DISPATCH {
        P::enter_at_dispatch();
        // SAFETY: `LeDispatch` is sealed and only `Dispatch` proves this
        // level, so the caller holds a `Dispatch` token: the processor is at
        // `DISPATCH_LEVEL` for at least the borrow `_irql`, which outlives
        // `f` and the token handed to it.
        let token = unsafe { Dispatch::assume_unchecked() };
        return f(&token);
    }
    // SAFETY: restored below, after `f` returns; `f` cannot leave a raise
    // outstanding without the verifier noticing (LIFO is the caller's
    // contract inside `f`).
    let old = unsafe { P::raise_to_dispatch() };
    // SAFETY: the raise above put this processor at DISPATCH_LEVEL until the
    // lower below.
    let token = unsafe { Dispatch::assume_unchecked() };
    let result = f(&token);
    // SAFETY: `old` is what the matching raise returned.
    unsafe { P::lower_irql(old) };
    result
}

/// Data protected by a blocking mutex (`FAST_MUTEX`). Only `PASSIVE_LEVEL`
/// may take it.
///
/// # Invariants
///
/// `data` is accessed only while `raw` is held by the accessing thread.
pub struct PassiveMutex<T, P: Platform> {
    raw: P::Mutex,
    data: UnsafeCell<T>,
}

// SAFETY: `PassiveMutex` serialises all access to `data`.
unsafe impl<T: Send, P: Platform> Sync for PassiveMutex<T, P> {}
// SAFETY: moving the mutex moves the data; `P::Mutex` is `Send`.
unsafe impl<T: Send, P: Platform> Send for PassiveMutex<T, P> {}

impl<T, P: Platform> PassiveMutex<T, P> {
    /// An unlocked mutex around `data`.
    pub fn new(data: T) -> Self {
        PassiveMutex {
            raw: P::Mutex::new(),
            data: UnsafeCell::new(data),
        }
    }

    /// Acquires, blocking while another thread holds it.
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL` only: it blocks.
    pub fn lock<'a>(&'a self, irql: &'a Passive<'_>) -> PassiveMutexGuard<'a, T, P> {
        self.raw.lock(irql);
        PassiveMutexGuard {
            mutex: self,
            _not_send: PhantomData,
        }
    }
}

/// A held [`PassiveMutex`].
#[must_use = "the mutex is released immediately when the guard is unused"]
pub struct PassiveMutexGuard<'a, T, P: Platform> {
    mutex: &'a PassiveMutex<T, P>,
    _not_send: PhantomData<*mut ()>,
}

impl<T, P: Platform> Deref for PassiveMutexGuard<'_, T, P> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the guard holds the mutex (invariant).
        unsafe { &*self.mutex.data.get() }
    }
}

impl<T, P: Platform> DerefMut for PassiveMutexGuard<'_, T, P> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: the guard holds the mutex (invariant).
        unsafe { &mut *self.mutex.data.get() }
    }
}

impl<T, P: Platform> Drop for PassiveMutexGuard<'_, T, P> {
    fn drop(&mut self) {
        // SAFETY: this guard holds the mutex from `lock` on this thread
        // (the guard is `!Send`).
        unsafe { self.mutex.raw.unlock() };
    }
}

/// A value set once, then read without a lock from any IRQL: for a
/// reference that can only be filled in after the object that reads it
/// was created (a completion handler and the connection that owns its
/// CQ), so the hot path reads it with one acquire load instead of a spin
/// lock round trip.
///
/// # Invariants
///
/// `value` is written only by the one [`SetOnce::set`] that moves `state`
/// from `EMPTY` to `WRITING`, and read only after `state` is `SET`
/// (acquire, pairing with the writer's release); once `SET` it never
/// changes until drop.
pub struct SetOnce<T> {
    state: atomic::AtomicU32,
    value: UnsafeCell<Option<T>>,
}

const ONCE_EMPTY: u32 = 0;
const ONCE_WRITING: u32 = 1;
const ONCE_SET: u32 = 2;

// SAFETY: readers get `&T` from many threads (needs `T: Sync`) and the
// setter moves a `T` in from another thread (needs `T: Send`); the state
// machine (type invariants) keeps the write from overlapping any read.
unsafe impl<T: Send + Sync> Sync for SetOnce<T> {}

impl<T> SetOnce<T> {
    /// An empty cell.
    pub fn new() -> Self {
        SetOnce {
            state: atomic::AtomicU32::new(ONCE_EMPTY),
            value: UnsafeCell::new(None),
        }
    }

    /// Sets the value; `Err(value)` if it was set (or is being set)
    /// already.
    ///
    /// # IRQL
    ///
    /// Any (it neither blocks nor allocates).
    pub fn set(&self, value: T) -> Result<(), T> {
        if self
            .state
            .compare_exchange(
                ONCE_EMPTY,
                ONCE_WRITING,
                atomic::Ordering::Acquire,
                atomic::Ordering::Relaxed,
            )
            .is_err()
        {
            return Err(value);
        }
        // SAFETY: the exchange above made this call the only writer, and no
        // reader looks before the release store below (invariants).
        unsafe { *self.value.get() = Some(value) };
        self.state.store(ONCE_SET, atomic::Ordering::Release);
        Ok(())
    }

    /// The value, once set.
    ///
    /// # IRQL
    ///
    /// Any.
    #[inline]
    pub fn get(&self) -> Option<&T> {
        if self.state.load(atomic::Ordering::Acquire) != ONCE_SET {
            return None;
        }
        // SAFETY: `SET` was observed with acquire ordering, so the write
        // happened before and no write follows (invariants).
        unsafe { (*self.value.get()).as_ref() }
    }
}

impl<T> Default for SetOnce<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: core::fmt::Debug> core::fmt::Debug for SetOnce<T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_tuple("SetOnce").field(&self.get()).finish()
    }
}

#[cfg(all(test, feature = "host", not(loom)))]
mod tests {
    use super::*;
    use crate::platform::host::HostPlatform;

    type Lock<T> = SpinLock<T, HostPlatform>;

    // These run under Miri too (`cargo +nightly miri test -p kverbs --lib
    // sync::`): they exercise every unsafe block in this module.
    #[test]
    fn guards_give_exclusive_access_and_restore_the_level() {
        let platform = HostPlatform::manual();
        let lock = Lock::new(alloc::vec![1u32, 2, 3]);
        platform.run_passive(|p| {
            {
                let mut guard = lock.lock(p);
                guard.push(4);
                let (data, d) = guard.split();
                data.push(5);
                let inner = Lock::new(10u32);
                *inner.lock_at_dpc_level(d) += 1;
                assert_eq!(*inner.lock(d), 11);
                assert_eq!(HostPlatform::current_irql(), Irql::DISPATCH);
            }
            assert_eq!(HostPlatform::current_irql(), Irql::PASSIVE);
            let sum = lock.with_queued(p, |v, d| {
                let extra = Lock::new(100u32);
                v.iter().sum::<u32>() + extra.with_queued_at_dpc_level(d, |x, _| *x)
            });
            assert_eq!(sum, 115);
            let mutex: PassiveMutex<u32, HostPlatform> = PassiveMutex::new(0);
            *mutex.lock(p) += 2;
            assert_eq!(*mutex.lock(p), 2);
            with_dispatch::<HostPlatform, _, _>(p, |d| {
                assert_eq!(lock.lock(d).saved_irql(), Irql::DISPATCH);
            });
        });
        let mut lock = lock;
        assert_eq!(lock.get_mut().len(), 5);
        platform.finish();
    }

    #[test]
    fn with_dispatch_on_a_dispatch_token_runs_in_place() {
        let platform = HostPlatform::manual();
        let lock = Lock::new(0u32);
        platform.run_at_dispatch(|d| {
            with_dispatch::<HostPlatform, _, _>(d, |dd| {
                assert_eq!(HostPlatform::current_irql(), Irql::DISPATCH);
                *lock.lock(dd) += 1;
            });
            assert_eq!(HostPlatform::current_irql(), Irql::DISPATCH);
        });
        let mut lock = lock;
        assert_eq!(*lock.get_mut(), 1);
        platform.finish();
    }

    #[test]
    fn with_dispatch_on_a_false_dispatch_token_is_a_violation() {
        let platform = HostPlatform::manual();
        platform.run_passive(|_p| {
            // SAFETY: deliberately false (the thread is at PASSIVE_LEVEL):
            // the verifier must notice when `with_dispatch` trusts it.
            let forged = unsafe { Dispatch::assume_unchecked() };
            with_dispatch::<HostPlatform, _, _>(&forged, |_| ());
        });
        let violations = platform.take_violations();
        assert_eq!(violations.len(), 1, "{violations:?}");
        assert_eq!(
            violations[0].kind,
            crate::platform::host::ViolationKind::WrongIrqlForLock { at: Irql::PASSIVE }
        );
        platform.finish();
    }

    #[test]
    fn set_once_takes_the_first_value_only_and_drops_it() {
        let value = alloc::sync::Arc::new(7u32);
        let cell: SetOnce<alloc::sync::Arc<u32>> = SetOnce::new();
        assert!(cell.get().is_none());
        assert!(cell.set(alloc::sync::Arc::clone(&value)).is_ok());
        let refused = cell.set(alloc::sync::Arc::new(8));
        assert_eq!(refused.map_err(|v| *v), Err(8));
        assert_eq!(cell.get().map(|v| **v), Some(7));
        assert_eq!(alloc::sync::Arc::strong_count(&value), 2);
        drop(cell);
        assert_eq!(alloc::sync::Arc::strong_count(&value), 1);
    }

    #[test]
    fn set_once_publishes_to_other_threads() {
        let cell = std::sync::Arc::new(SetOnce::<alloc::vec::Vec<u32>>::new());
        let reader = {
            let cell = std::sync::Arc::clone(&cell);
            std::thread::spawn(move || {
                loop {
                    if let Some(v) = cell.get() {
                        return v.iter().sum::<u32>();
                    }
                    std::thread::yield_now();
                }
            })
        };
        assert!(cell.set(alloc::vec![1, 2, 3]).is_ok());
        assert_eq!(reader.join().ok(), Some(6));
    }
}
