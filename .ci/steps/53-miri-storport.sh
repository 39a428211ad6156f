# Miri over storport-srp's drop teardown (drop_teardown.rs): the handle's
# kept engine taken out of its ManuallyDrop once, in Drop, and the IRQL
# raise around the hand-over, with a fake teardown on the manual-mode host
# platform. (The tracker's UnsafeCell hand-off is covered by its loom
# models in 51-loom-kverbs.sh; under Miri it takes over ten minutes.)
# The host verifier leaks one small log per platform instance on purpose,
# hence -Zmiri-ignore-leaks.
export CARGO_TARGET_DIR=target/miri
MIRIFLAGS="-Zmiri-ignore-leaks" \
    timeout 900 cargo +nightly miri test -p storport-srp --lib -- drop_teardown::
