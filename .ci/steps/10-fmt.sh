cargo fmt --all -- --check
