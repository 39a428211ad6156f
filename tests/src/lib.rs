//! Shared harness code for the cross-crate integration and fault tests.
