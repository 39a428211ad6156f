//! IRQL in the types: zero-sized proof tokens.
//!
//! Windows runs kernel code at an interrupt request level (IRQL). At
//! `PASSIVE_LEVEL` a thread may block and touch pageable memory; at
//! `DISPATCH_LEVEL` (DPCs, spin-lock holders, StorPort `HwStartIo`) it must
//! not block, must not page-fault and — by this project's rule — must not
//! allocate. kverbs turns that contract into types:
//!
//! * [`Passive`] proves the caller runs at `PASSIVE_LEVEL`;
//! * [`Dispatch`] proves the caller runs at `DISPATCH_LEVEL`;
//! * [`LeDispatch`] (sealed) is implemented by both: "at most `DISPATCH_LEVEL`".
//!
//! Fast-path functions take `&impl LeDispatch`; blocking functions take
//! `&Passive`. The tokens are zero-sized, `!Send` and `!Sync` (the IRQL is a
//! property of the current processor and thread, so a token must not travel),
//! not `Clone`, and carry a lifetime so a trampoline can hand one out for
//! exactly the scope it vouches for.
//!
//! Tokens come only from
//! * trampolines: DPC routines, work items, the passive worker
//!   ([`crate::platform`] backends call [`Passive::assume`] /
//!   [`Dispatch::assume`] exactly where the OS contract guarantees the level);
//! * lock guards: a held spin lock proves `DISPATCH_LEVEL`
//!   ([`crate::sync::SpinLockGuard::irql`]);
//! * the `unsafe` constructors [`Passive::assume`] / [`Dispatch::assume`],
//!   which check the real IRQL through the platform in debug builds.
//!
//! A token is a static proof of the level *at the time it was minted*. A
//! `&Passive` held across a spin-lock acquisition still compiles; the host
//! verifier ([`crate::platform::host`]) catches that at run time, the way
//! Driver Verifier does on Windows.

// UNSAFETY: declares the `unsafe` token constructors; contains no unsafe blocks.
#![expect(unsafe_code, reason = "unsafe fn declarations only")]

use core::fmt;
use core::marker::PhantomData;

use crate::platform::Platform;

/// A processor interrupt request level (the NT `KIRQL`).
///
/// Only the software levels matter to kverbs; device levels are carried as
/// plain numbers above [`Irql::DISPATCH`].
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Irql(u8);

impl Irql {
    /// `PASSIVE_LEVEL` (0): threads; may block and allocate.
    pub const PASSIVE: Irql = Irql(0);
    /// `APC_LEVEL` (1): fast mutexes, page-fault I/O completion.
    pub const APC: Irql = Irql(1);
    /// `DISPATCH_LEVEL` (2): DPCs, spin-lock holders; no blocking.
    pub const DISPATCH: Irql = Irql(2);

    /// Wraps a raw `KIRQL` value.
    pub const fn from_raw(raw: u8) -> Self {
        Irql(raw)
    }

    /// The raw `KIRQL` value.
    pub const fn raw(self) -> u8 {
        self.0
    }

    /// Whether code at this level may block (wait, sleep, take a mutex).
    pub const fn may_block(self) -> bool {
        self.0 < Self::DISPATCH.0
    }
}

impl fmt::Debug for Irql {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            0 => f.write_str("PASSIVE_LEVEL"),
            1 => f.write_str("APC_LEVEL"),
            2 => f.write_str("DISPATCH_LEVEL"),
            n => write!(f, "DIRQL({n})"),
        }
    }
}

/// The marker that makes tokens `!Send`, `!Sync` and lifetime-bound.
type TokenMarker<'a> = PhantomData<(&'a (), *mut ())>;

/// Proof that the current thread runs at `PASSIVE_LEVEL` for `'a`.
///
/// Blocking functions (waits, firmware commands, object creation) require
/// `&Passive`. See the [module docs](self) for where tokens come from.
///
/// # Invariants
///
/// While a `Passive<'a>` exists, the thread that created it was entered at
/// `PASSIVE_LEVEL` by its trampoline and stays there for `'a` except inside
/// properly nested raise/lower pairs (spin-lock guards), which borrow the
/// token.
pub struct Passive<'a> {
    _marker: TokenMarker<'a>,
}

/// Proof that the current thread runs at `DISPATCH_LEVEL` for `'a`.
///
/// DPC routines, spin-lock guards and `*_at_dpc_level` lock variants hand out
/// or require `&Dispatch`.
///
/// # Invariants
///
/// While a `Dispatch<'a>` exists, the current processor is at
/// `DISPATCH_LEVEL`.
pub struct Dispatch<'a> {
    _marker: TokenMarker<'a>,
}

mod sealed {
    /// Keeps [`super::LeDispatch`] closed: only this module's tokens prove an
    /// IRQL.
    pub trait Sealed {}
    impl Sealed for super::Passive<'_> {}
    impl Sealed for super::Dispatch<'_> {}
}

/// "The caller runs at IRQL <= `DISPATCH_LEVEL`": implemented by [`Passive`]
/// and [`Dispatch`] only (sealed). Fast-path functions take `&impl LeDispatch`.
pub trait LeDispatch: sealed::Sealed {
    /// The level the token proves.
    const IRQL: Irql;
}

impl LeDispatch for Passive<'_> {
    const IRQL: Irql = Irql::PASSIVE;
}

impl LeDispatch for Dispatch<'_> {
    const IRQL: Irql = Irql::DISPATCH;
}

impl<'a> Passive<'a> {
    /// Mints a passive token.
    ///
    /// In debug builds this checks [`Platform::current_irql`] and panics on a
    /// mismatch (the `paged_code!()`/lockdep analogue): a wrong assumption is a
    /// bug in the caller's trampoline, and finding it early is the point.
    ///
    /// # Safety
    ///
    /// The caller must be at `PASSIVE_LEVEL` and stay there for `'a`, except
    /// inside nested raise/lower pairs that borrow the token.
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL` only.
    pub unsafe fn assume<P: Platform>() -> Self {
        debug_assert_eq!(P::current_irql(), Irql::PASSIVE, "Passive::assume");
        Passive {
            _marker: PhantomData,
        }
    }
}

impl<'a> Dispatch<'a> {
    /// Mints a dispatch token.
    ///
    /// In debug builds this checks [`Platform::current_irql`] and panics on a
    /// mismatch.
    ///
    /// # Safety
    ///
    /// The current processor must be at `DISPATCH_LEVEL` and stay there for
    /// `'a`.
    ///
    /// # IRQL
    ///
    /// `DISPATCH_LEVEL` only.
    pub unsafe fn assume<P: Platform>() -> Self {
        debug_assert_eq!(P::current_irql(), Irql::DISPATCH, "Dispatch::assume");
        Dispatch {
            _marker: PhantomData,
        }
    }
}

impl Passive<'_> {
    /// Mints a passive token without the debug check, for trampolines whose
    /// OS contract already guarantees the level.
    ///
    /// # Safety
    ///
    /// As [`Passive::assume`].
    #[cfg_attr(
        not(any(feature = "host", feature = "nt", loom)),
        expect(dead_code, reason = "used by the platform backends")
    )]
    pub(crate) unsafe fn assume_unchecked() -> Self {
        Passive {
            _marker: PhantomData,
        }
    }
}

impl Dispatch<'_> {
    /// Mints a dispatch token without the debug check, for lock guards and
    /// trampolines whose contract already guarantees the level.
    ///
    /// # Safety
    ///
    /// As [`Dispatch::assume`].
    pub(crate) unsafe fn assume_unchecked() -> Self {
        Dispatch {
            _marker: PhantomData,
        }
    }
}

impl fmt::Debug for Passive<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Passive")
    }
}

impl fmt::Debug for Dispatch<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Dispatch")
    }
}

/// A token of either level, for callbacks that may be delivered at
/// `PASSIVE_LEVEL` (the worker) or `DISPATCH_LEVEL` (a DPC), chosen per
/// request.
#[derive(Debug)]
pub enum AnyIrql<'t, 'a> {
    /// Delivered at `PASSIVE_LEVEL`; the callback may block.
    Passive(&'t Passive<'a>),
    /// Delivered at `DISPATCH_LEVEL`; the callback must not block.
    Dispatch(&'t Dispatch<'a>),
}

impl AnyIrql<'_, '_> {
    /// The level the callback runs at.
    pub fn irql(&self) -> Irql {
        match self {
            AnyIrql::Passive(_) => Irql::PASSIVE,
            AnyIrql::Dispatch(_) => Irql::DISPATCH,
        }
    }

    /// The passive token, when the callback may block.
    pub fn passive(&self) -> Option<&Passive<'_>> {
        match self {
            AnyIrql::Passive(p) => Some(p),
            AnyIrql::Dispatch(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use static_assertions::{assert_not_impl_any, const_assert_eq};

    assert_not_impl_any!(Passive<'static>: Send, Sync, Clone, Copy);
    assert_not_impl_any!(Dispatch<'static>: Send, Sync, Clone, Copy);
    assert_not_impl_any!(&'static Passive<'static>: Send, Sync);
    assert_not_impl_any!(&'static Dispatch<'static>: Send, Sync);
    const_assert_eq!(core::mem::size_of::<Passive<'static>>(), 0);
    const_assert_eq!(core::mem::size_of::<Dispatch<'static>>(), 0);

    #[test]
    fn levels_order_and_blocking_rule() {
        assert!(Irql::PASSIVE < Irql::APC && Irql::APC < Irql::DISPATCH);
        assert!(Irql::PASSIVE.may_block());
        assert!(Irql::APC.may_block());
        assert!(!Irql::DISPATCH.may_block());
        assert!(!Irql::from_raw(5).may_block());
        assert_eq!(format!("{:?}", Irql::from_raw(7)), "DIRQL(7)");
        assert_eq!(<Passive<'_> as LeDispatch>::IRQL, Irql::PASSIVE);
        assert_eq!(<Dispatch<'_> as LeDispatch>::IRQL, Irql::DISPATCH);
    }
}
