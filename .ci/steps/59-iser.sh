# iSER: the bigger sweeps of the full-stack iSER tests (more seeds and I/Os
# over a lossy and reordering fabric, a longer random data mix), then
# kvbench's default suite over the full iSER stack with data verification.
# Debug builds (the test step built them). About ten minutes on 2 cores
# under load. The data sweep is bounded by the harness: the StorPort model
# keeps every request's buffer in the initiator HCA's 512 MiB, so 600 (900
# I/Os of up to 1 MiB) fits and 2000 does not.
#
# Unlike step 58 (SRP), kvbench must exit 0 here: any failed or lost I/O
# or broken stack contract over iSER fails the step.
KV_ISER_FAULT_SEEDS=3 KV_ISER_FAULT_IOS=300 timeout 900 \
    cargo test -q -p kverbs-tests --test iser_faults -- \
    packet_loss reordering
KV_ISER_SWEEP=600 timeout 600 cargo test -q -p kverbs-tests --test iser_data
out=target/ci-kvbench-iser
rm -rf "$out" && mkdir -p "$out"
timeout 900 cargo run -q -p kverbs-tools --bin kvbench -- \
    --transport iser --sg-shape pages --no-progress --ramp 300ms --run 2s \
    --verify --max-size 64M --csv "$out/results.csv" > "$out/table.txt"
cat "$out/table.txt"
grep -q "all intact" "$out/table.txt"
test "$(wc -l < "$out/results.csv")" -ge 5
