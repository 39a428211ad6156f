//! The IRQL rules the type system enforces, proven by programs that must not
//! compile: blocking with a Dispatch token, sending a token to another
//! thread, keeping a token beyond its scope or its guard, forging one, or
//! implementing the sealed trait.

// The host backend does not exist under `--cfg loom`; the loom models live
// in the library (`src/loom_tests.rs`).
#![cfg(not(loom))]

#[test]
fn irql_token_rules() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
}
