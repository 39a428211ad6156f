# Miri over hca-lowlevel's shared-memory code: DMA words, rings (including
# producer/consumer threads), doorbell records, the formats, the simulated
# physical memory and the MR walk over it, and two end-to-end device-model runs.
export CARGO_TARGET_DIR=target/miri
timeout 900 cargo +nightly miri test -p hca-lowlevel --lib -- \
    dma:: ring:: doorbell:: cqe:: wqe:: recv:: sim::mem:: sim::resources:: \
    sim::tests::send_receive_with_completions sim::tests::inline_doorbell
