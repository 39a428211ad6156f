# kvbench, the main job, end to end over the full SRP stack (the default
# transport): the default suite with shortened times and data verification,
# writing CSV, JSON and SVG plots, which are then checked. A debug build (the
# test step built it already), so no release compile; about a minute on 2
# cores.
#
# kvbench exits 3 on a verify mismatch, 1/2 when it cannot run, 4 when I/Os
# failed or were lost or the stack broke a contract. Anything but 0 fails
# the step: on the loss-free in-process fabric every I/O must succeed
# exactly once.
out=target/ci-kvbench
rm -rf "$out" && mkdir -p "$out"
set +e
timeout 900 cargo run -q -p kverbs-tools --bin kvbench -- \
    --no-progress --ramp 300ms --run 2s --verify --max-size 64M \
    --csv "$out/results.csv" --json "$out/results.json" --plots "$out/plots" \
    > "$out/table.txt"
status=$?
set -e
cat "$out/table.txt"
case $status in
    0) ;;
    4) echo "kvbench reported failed or lost I/Os or stack violations (exit 4); see above"; exit 1 ;;
    *) echo "kvbench failed with exit status $status"; exit 1 ;;
esac
grep -q "all intact" "$out/table.txt"
test "$(wc -l < "$out/results.csv")" -ge 5
test "$(grep -c '^      "spec": ' "$out/results.json")" -eq 4
test "$(ls "$out/plots"/*.svg | wc -l)" -eq 8
