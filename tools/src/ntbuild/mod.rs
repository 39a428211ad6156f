//! `kv-sys`: builds, links, signs and checks the StorPort miniport `.sys` on
//! Linux, stamps its INF, and runs it under Wine against a test-double
//! `storport.sys`.

pub mod bindings;
