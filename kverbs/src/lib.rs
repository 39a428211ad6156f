//! Kernel RDMA verbs for Windows storage drivers.
//!
//! StorPort calls a miniport at DISPATCH_LEVEL, where nothing may block.
//! `kverbs` lets those contexts post work requests and poll completion queues
//! directly, and defers only the inherently blocking operations (QP modify,
//! memory registration, create/destroy) to its own passive-level worker, which
//! reports back through completion callbacks.

#![cfg_attr(not(any(test, feature = "std")), no_std)]
#![deny(missing_docs)]
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

pub mod wire;
