cargo clippy --workspace --all-targets -- -D warnings
