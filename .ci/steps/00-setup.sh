# Toolchains and packages a fresh machine lacks.
rustup component add rustfmt clippy
rustup target add x86_64-pc-windows-msvc
rustup toolchain install nightly --profile minimal --component miri,rust-src
cargo +nightly miri setup
