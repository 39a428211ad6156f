# loom models of kverbs' concurrency: the drain loop and its arm/poll race,
# the passive worker's queue against shutdown, and run-down
# (kverbs/src/loom_tests.rs); the miniport tracker's slot transitions
# (storport-srp/src/miniport/tracker.rs, `loom_tests`; without the host
# model, which loom configures out). The models run in under 10 s at three
# preemptions; most of this step is compiling the crates under --cfg loom.
RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=3 \
    timeout 900 cargo test -p kverbs --lib --release loom
RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=3 \
    timeout 900 cargo test -p storport-srp --no-default-features --features std \
    --lib --release loom
