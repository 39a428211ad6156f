#!/usr/bin/env bash
# Instructions per fast-path operation, counted by callgrind in kverbs'
# functions only: collection is toggled on inside the benchmark's three
# entry points (bench_send: begin_send + send + commit; bench_reg_send:
# begin_send + REG_MR (with the chained LOCAL_INV) + SEND + commit;
# bench_poll: CQ poll + delivery + re-arm), so the device model — which
# runs in Fabric::run_until_idle between them — is not counted. The
# doorbell write itself is counted (in stepped, non-inline mode it is an
# atomic flag store, the analogue of the MMIO write).
#
# Usage: kverbs/benches/callgrind.sh [N]   (needs valgrind)
set -euo pipefail
cd "$(dirname "$0")/../.."
N="${1:-2000}"
cargo bench -p kverbs --bench fastpath --no-run 2>/dev/null
BIN=$(ls -t target/release/deps/fastpath-* | grep -v '\.d$' | head -1)
OUT=$(mktemp -d)
run() { # $1 = entry point
    KVERBS_BENCH_N="$N" valgrind --tool=callgrind --callgrind-out-file="$OUT/$1.out" \
        --toggle-collect="fastpath::$1" "$BIN" >/dev/null 2>"$OUT/$1.log"
    grep -E '^(summary|totals):' "$OUT/$1.out" | head -1 | awk '{print $2}'
}
send=$(run bench_send)
reg=$(run bench_reg_send)
poll=$(run bench_poll)
# bench_poll runs twice per operation per phase (A's CQ and B's CQ), for
# 2N operations: per operation it is poll/(2N) per CQ.
echo "instructions per op (kverbs only, N=$N):"
echo "  post signalled 64-byte SEND     : $((send / N))"
echo "  post REG_MR+SEND (+LOCAL_INV)   : $((reg / N))"
echo "  poll+deliver+re-arm, per CQ, per completion batch : $((poll / (4 * N)))"
rm -rf "$OUT"
