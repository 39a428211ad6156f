# kvbench, the main job, end to end on the embedded stack: the default
# suite with shortened times and data verification, writing CSV, JSON and
# SVG plots, which are then checked to exist and parse. A debug build (the
# test step built it already), so no release compile; about a minute on 2
# cores. Any I/O error, lost I/O, stack contract violation or verify
# mismatch makes kvbench exit non-zero and fails the step.
out=target/ci-kvbench
rm -rf "$out" && mkdir -p "$out"
timeout 600 cargo run -q -p kverbs-tools --bin kvbench -- \
    --transport loopback --no-progress --ramp 300ms --run 2s --verify --max-size 64M \
    --csv "$out/results.csv" --json "$out/results.json" --plots "$out/plots" \
    | tee "$out/table.txt"
grep -q "all intact" "$out/table.txt"
test "$(wc -l < "$out/results.csv")" -ge 5
test "$(grep -c '^      "spec": ' "$out/results.json")" -eq 4
test "$(ls "$out/plots"/*.svg | wc -l)" -eq 8
