# loom models of the hca-lowlevel ring ownership (owner bit, producer and
# consumer indices, doorbell-record publication). The models run the same
# ring code as kverbs and the device model, through the crate's sync facade.
# Separate target dir: --cfg loom would otherwise invalidate the main build.
export RUSTFLAGS="--cfg loom"
export LOOM_MAX_PREEMPTIONS=3
export CARGO_TARGET_DIR=target/loom
timeout 900 cargo test -p hca-lowlevel --lib --release loom_
