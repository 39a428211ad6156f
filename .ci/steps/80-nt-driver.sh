# The Windows driver binary, built and checked on Linux (kv-sys): bindings
# and export allowlists up to date, kvsrp.sys linked, checksummed, checked
# (imports, sections, stack frames) and test-signed, then the stamped INF
# installed by Wine's SetupAPI and the driver smoke-run under Wine against
# the test-double storport.sys. About 1-2 minutes here (wineboot ~30 s).
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends \
    mingw-w64-x86-64-dev clang libclang-dev lld llvm wine64 osslsigncode openssl >/dev/null
# The shim's host unit tests with the `nt` feature on. (Its clippy run is
# not here yet: the nt module still trips multiple_unsafe_ops_per_block and
# a few style lints; see the nt-build report.)
cargo test -p storport-srp --features nt
cargo run -p kverbs-tools --bin kv-sys -- ci
