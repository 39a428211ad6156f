# The Windows driver binary, built and checked on Linux (kv-sys): bindings
# and export allowlists up to date, kvsrp.sys linked, checksummed, checked
# (imports, sections, stack frames) and test-signed, then the stamped INF
# installed by Wine's SetupAPI and the driver smoke-run under Wine against
# the test-double storport.sys, with the real miniport core on kverbs' NT
# platform. About 3-5 minutes here (wineboot ~30 s).
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends \
    mingw-w64-x86-64-dev clang libclang-dev lld llvm wine64 osslsigncode openssl >/dev/null
# The NT code with its features on: host unit tests (pure parts, the core
# over the NoHca transport under the StorPort model), clippy, the kernel
# target build, and Miri over the unsafe request/pool/refcount code.
cargo test -p nt-sys --features kernel
cargo test -p kverbs --features nt --lib platform::nt
cargo test -p storport-srp --features nt
cargo clippy -p nt-sys --features kernel --all-targets -- -D warnings
cargo clippy -p kverbs --features nt --all-targets -- -D warnings
cargo clippy -p storport-srp --features nt --all-targets -- -D warnings
cargo build --target x86_64-pc-windows-msvc --no-default-features --features nt -p storport-srp
MIRIFLAGS=-Zmiri-strict-provenance cargo +nightly miri test -p kverbs --features nt --lib platform::nt::tests
cargo +nightly miri test -p storport-srp --features nt --lib -- nt::srb nt::dma nt::params
cargo run -p kverbs-tools --bin kv-sys -- ci
