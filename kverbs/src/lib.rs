//! Kernel RDMA verbs for Windows storage drivers.
//!
//! StorPort calls a miniport at DISPATCH_LEVEL, where nothing may block.
//! `kverbs` lets those contexts post work requests and poll completion queues
//! directly, and defers only the inherently blocking operations (QP modify,
//! memory registration, create/destroy) to its own passive-level worker, which
//! reports back through completion callbacks.
//!
//! # The foundations, and how the verbs objects use them
//!
//! * [`irql`]: `Passive`/`Dispatch` proof tokens. Fast-path entry points
//!   take `&impl LeDispatch`; blocking ones take `&Passive`.
//! * [`platform`]: the `Platform` trait (spin lock, DPC, work item, timer,
//!   event, fast mutex, non-paged pool, time), with the host backend
//!   ([`platform::host`]) that doubles as the IRQL verifier in tests.
//! * [`sync`]: `SpinLock<T, P>` whose guard hands out `&Dispatch`.
//! * [`rundown`]: every object owns an `Arc<Rundown<P>>`; every callback
//!   into it enters through `acquire()`; destroy is `Rundown::destroy`.
//! * [`worker`]: each object owns a `RequestQueue` for its blocking verbs
//!   (modify QP, register MR, create/destroy), submitted from any IRQL.
//! * [`drain`]: each CQ owns a `DpcDrainer` over a `CompletionSource`
//!   (poll/arm) and a `CompletionHandler`; the CQ event calls `notify`.

#![cfg_attr(not(any(test, feature = "std")), no_std)]
#![deny(missing_docs)]
#![deny(unsafe_code)]
#![cfg_attr(
    not(test),
    deny(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::indexing_slicing
    )
)]

extern crate alloc;

pub mod cm;
pub mod cq;
pub mod device;
pub mod drain;
pub mod error;
#[cfg(all(feature = "host", not(loom)))]
pub mod hostdev;
mod interrupt;
pub mod irql;
pub mod mr;
pub mod pd;
pub mod platform;
pub mod qp;
pub mod rundown;
pub mod slots;
pub mod slowpath;
pub mod sync;
pub mod wire;
mod words;
pub mod worker;
pub mod wr;

#[cfg(all(test, loom))]
mod loom_tests;
