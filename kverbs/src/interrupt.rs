//! Entering kverbs from a context that holds no IRQL token: a device
//! callback, or a `Drop` (which may run at any IRQL <= `DISPATCH_LEVEL`).
//!
//! The [`hca_lowlevel::device`] event handlers (completion event,
//! asynchronous event) are called in the device's interrupt context — on
//! hardware from the ISR's DPC, at `DISPATCH_LEVEL` — and carry no IRQL
//! token. This module mints the token for that scope by raising to
//! `DISPATCH_LEVEL` (a no-op raise at `DISPATCH_LEVEL`, a real one on a
//! software device thread at `PASSIVE_LEVEL`) and lowering afterwards.

// UNSAFETY: one raise/lower pair around a closure, with the token minted
// for exactly that scope.
#![expect(unsafe_code, reason = "raise/lower pair for device callbacks")]

use crate::irql::Dispatch;
use crate::platform::Platform;

/// Runs `f` at `DISPATCH_LEVEL` with a token, from a device callback.
///
/// # IRQL
///
/// <= `DISPATCH_LEVEL` (the device callback contract).
pub(crate) fn enter_dispatch<P: Platform, R>(f: impl for<'t> FnOnce(&Dispatch<'t>) -> R) -> R {
    // SAFETY: lowered below, LIFO, after `f` returns.
    let old = unsafe { P::raise_to_dispatch() };
    // SAFETY: the raise above holds this processor at DISPATCH_LEVEL until
    // the lower below; the token does not escape `f`.
    let token = unsafe { Dispatch::assume_unchecked() };
    let result = f(&token);
    // SAFETY: `old` is what the matching raise returned.
    unsafe { P::lower_irql(old) };
    result
}
