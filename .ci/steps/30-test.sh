# The README's test command, verbatim.
cargo test --workspace
