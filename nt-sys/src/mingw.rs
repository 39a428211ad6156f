//! Source B: bindgen's output over mingw-w64's `ntddk.h` (committed;
//! regenerate and check with `kv-sys bindings [--check]`). Only the
//! routines and types listed in `tools/src/ntbuild/bindings.rs` and what
//! they reach.

#![allow(
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    dead_code,
    missing_docs,
    unsafe_code,
    clippy::all,
    clippy::pedantic,
    clippy::undocumented_unsafe_blocks,
    clippy::multiple_unsafe_ops_per_block,
    clippy::missing_safety_doc,
    clippy::indexing_slicing,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "generated code"
)]

include!("mingw_bindings.rs");
