# The API docs build without a broken or private intra-doc link.
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps
