# loom models of kverbs' concurrency: the drain loop and its arm/poll race,
# the passive worker's queue against shutdown, and run-down
# (kverbs/src/loom_tests.rs). The models run in under 10 s at three
# preemptions; most of this step is compiling the crate under --cfg loom.
RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=3 \
    timeout 900 cargo test -p kverbs --lib --release loom
