#!/usr/bin/env bash
# The performance harness (issue #8), run by hand — not part of the tests or
# CI. In one run it measures and prints a markdown table (also written to
# docs/perf.md, or to $1) with the commands that produced it:
#
#  1. instructions per I/O of the initiator path alone (callgrind,
#     tests/benches/initiator_io.rs on the stepped stack; the miniport's
#     BuildIo/StartIo/ExecutionRoutine and the CQ DPCs, less the StorPort
#     model's services they call), 512 B and 4 KiB reads and writes at
#     queue depths 1, 32 and 256;
#  2. full-stack IOPS and bandwidth of the classic specs (kvbench, release)
#     beside a single-thread memcpy bandwidth (tests/benches/memcpy_bw.rs);
#  3. QD1 latency of a 4 KiB read (kvbench) beside a bare verbs SEND/RECV
#     ping-pong on the same software fabric (tests/benches/verbs_pingpong.rs);
#  4. allocations on the I/O path (a counting global allocator around the
#     steady-state loop of initiator_io);
#
# then the goals as ratios, each met or not met.
#
# Usage: tools/perf/run.sh [OUTPUT.md]
# Environment: PERF_ROUNDS (callgrind rounds per configuration, default 16),
# PERF_RUN (kvbench measured time per spec, default 3s), PERF_RAMP (1s),
# PERF_SEQ_REPEATS (runs of the 128 KiB read series, default 5),
# PERF_KEEP=1 keeps the callgrind profiles (their directory is printed).
# Needs valgrind (apt-get install valgrind), python3.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUTPUT="${1:-docs/perf.md}"
ROUNDS="${PERF_ROUNDS:-16}"
RUN="${PERF_RUN:-3s}"
RAMP="${PERF_RAMP:-1s}"
WORK=$(mktemp -d)
[ "${PERF_KEEP:-0}" = 1 ] || trap 'rm -rf "$WORK"' EXIT
log() { echo "[perf] $*" >&2; }
COMMANDS=()
cmd() { # records a command for the table, then runs it
    COMMANDS+=("$*")
    "$@"
}
kvbench() { # kvbench exit 4 (failed or lost I/Os, stack violations) is
    # reported in the table's errors column and warned about, not fatal:
    # the rest of the measurements still come out.
    local status=0
    cmd "$KVBENCH" "$@" || status=$?
    case $status in
        0) ;;
        4) log "WARNING: kvbench exit 4 (failed I/Os or violations; see the errors column)" ;;
        *) log "kvbench failed with exit status $status"; exit 1 ;;
    esac
}

log "building (release: kvbench and the perf benches)"
cargo build -q --release -p kverbs-tools --bin kvbench
cargo bench -q -p kverbs-tests --no-run --bench initiator_io --bench verbs_pingpong \
    --bench memcpy_bw 2>"$WORK/build.log" || { cat "$WORK/build.log"; exit 1; }
bench_bin() { # newest executable of bench $1
    ls -t target/release/deps/"$1"-* | grep -v '\.d$' | head -1
}
INITIATOR=$(bench_bin initiator_io)
PINGPONG=$(bench_bin verbs_pingpong)
MEMCPY=$(bench_bin memcpy_bw)
KVBENCH=target/release/kvbench

# ---------------------------------------------------------------------------
# 1. Instructions per I/O, initiator path only (callgrind, stepped stack).
# The main thread alone runs the initiator (the target has its own
# platform's threads); its profile of each configuration's measured rounds
# (zeroed on entry to measure_begin, dumped on entry to measure_end) is cut
# by report.py along the call graph: the inclusive cost of the calls into
# the miniport (StorPort's StartIo trampoline -> BuildIo/StartIo, and the
# ExecutionRoutine) and into the CQ DPCs, minus the calls from there into
# the StorPort model's services (GetScatterGatherList — whose inline
# ExecutionRoutine is added back —, PutScatterGatherList, RequestComplete).
# The software HCA runs outside those calls (Fabric::run_until_idle).
# (Callgrind's --toggle-collect is not used: a toggled generic function
# that the compiler inlines silently stops toggling.)
# ---------------------------------------------------------------------------
CONFIGS=read:512:1,read:512:32,read:512:256,read:4096:1,read:4096:32,read:4096:256,write:512:1,write:512:32,write:512:256,write:4096:1,write:4096:32,write:4096:256
log "callgrind: initiator path, $ROUNDS rounds per configuration (a few minutes)"
mkdir -p "$WORK/cg"
cmd valgrind --tool=callgrind --separate-threads=yes --compress-strings=no --compress-pos=no \
    --callgrind-out-file="$WORK/cg/cg.out" \
    --zero-before='initiator_io::measure_begin' --dump-before='initiator_io::measure_end' \
    "$INITIATOR" --rounds "$ROUNDS" --warmup 4 --configs "$CONFIGS" \
    >"$WORK/cg-stdout.txt" 2>"$WORK/cg-valgrind.log" ||
    { tail -30 "$WORK/cg-valgrind.log"; exit 1; }

# 4. Allocations (and the stepped stack's wall clock, for the record):
# natively, more rounds.
log "allocations: initiator_io natively"
cmd "$INITIATOR" --rounds 256 --warmup 16 --configs "$CONFIGS" >"$WORK/allocs.txt"

# ---------------------------------------------------------------------------
# 2 and 3. Full stack (kvbench, release) and the yardsticks, back to back.
# ---------------------------------------------------------------------------
cat >"$WORK/specs.toml" <<'EOF'
[[spec]]
name = "128K sequential read"
size = "128K"
read = 100
random = 0
EOF
log "memcpy bandwidth"
cmd "$MEMCPY" --chunk 131072 --secs 2 >"$WORK/memcpy.txt"
log "kvbench: classic specs (QD 16), 128K sequential read"
kvbench --no-progress --ramp "$RAMP" --run "$RUN" --max-size 256M --outstanding 16 \
    --spec 4k-random-read,4k-random-write,4k-random-70-30,64k-seq-read,64k-seq-write \
    --spec-file "$WORK/specs.toml" --json "$WORK/kvbench.json" >"$WORK/kvbench.txt"
log "memcpy bandwidth (again, after kvbench)"
"$MEMCPY" --chunk 131072 --secs 2 >>"$WORK/memcpy.txt"
# The 128 KiB read goal from a series, not one run: on a shared VM one
# run's bandwidth moves by +-25 %. Each repeat writes 64 KiB sequentially
# first (so the read reads written RAM-disk chunks, as in the suite above),
# then reads, then measures memcpy; the goal takes the median ratio. The
# same series pinned to one CPU is printed beside it for comparison (the
# stack's thread hand-offs cost less there; see the notes).
SEQ_REPEATS="${PERF_SEQ_REPEATS:-5}"
for i in $(seq 1 "$SEQ_REPEATS"); do
    log "128K read series: run $i of $SEQ_REPEATS"
    kvbench --no-progress --ramp "$RAMP" --run "$RUN" --max-size 256M --outstanding 16 \
        --spec 64k-seq-write --spec-file "$WORK/specs.toml" --json "$WORK/seq-$i.json" >/dev/null
    "$MEMCPY" --chunk 131072 --secs 2 >>"$WORK/memcpy-seq.txt"
done
if command -v taskset >/dev/null; then
    for i in 1 2 3; do
        log "128K read series pinned to CPU 0: run $i of 3"
        kvbench_pinned=(taskset -c 0 "$KVBENCH" --no-progress --ramp "$RAMP" --run "$RUN"
            --max-size 256M --outstanding 16 --spec 64k-seq-write
            --spec-file "$WORK/specs.toml" --json "$WORK/seq-pinned-$i.json")
        cmd "${kvbench_pinned[@]}" >/dev/null || log "pinned run $i failed (status $?)"
    done
fi
log "kvbench: 4K random read at QD1 (latency)"
kvbench --no-progress --ramp "$RAMP" --run "$RUN" --max-size 256M --outstanding 1 \
    --spec 4k-random-read --json "$WORK/qd1.json" >"$WORK/qd1.txt"
log "verbs ping-pong"
cmd "$PINGPONG" --iters 20000 >"$WORK/pingpong.txt"
cmd "$PINGPONG" --iters 20000 --spin >>"$WORK/pingpong.txt"

log "report"
{
    printf '%s\n' "${COMMANDS[@]}" >"$WORK/commands.txt"
    python3 tools/perf/report.py "$WORK" "$ROUNDS"
} >"$WORK/report.md"
mkdir -p "$(dirname "$OUTPUT")"
cp "$WORK/report.md" "$OUTPUT"
cat "$OUTPUT"
[ "${PERF_KEEP:-0}" = 1 ] && log "profiles kept in $WORK/cg"
exit 0
