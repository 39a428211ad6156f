# Fuzz smoke run: every cargo-fuzz target in fuzz/ runs briefly from its
# seed corpus. Targets are discovered with `cargo fuzz list`, so a target
# added to fuzz/Cargo.toml runs here without editing this step.
# FUZZ_SECONDS / FUZZ_RUNS bound each target (defaults: 20 s, 2M runs).
command -v cargo-fuzz >/dev/null 2>&1 || cargo install cargo-fuzz --locked

cd fuzz
seconds="${FUZZ_SECONDS:-20}"
runs="${FUZZ_RUNS:-2000000}"
targets=$(cargo +nightly fuzz list)
if [ -z "$targets" ]; then
    echo "no fuzz targets found" >&2
    exit 1
fi

# Build all targets once, with debug assertions (overflow checks) on.
cargo +nightly fuzz build --debug-assertions

# New corpus entries go to a scratch directory (the first corpus argument),
# so the committed seeds are read but never modified.
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
for target in $targets; do
    echo "--- fuzz ${target}: ${seconds} s / ${runs} runs max"
    mkdir -p "$scratch/$target"
    seeds=()
    if [ -d "corpus/$target" ]; then
        seeds=("corpus/$target")
    fi
    cargo +nightly fuzz run --debug-assertions "$target" "$scratch/$target" "${seeds[@]}" -- \
        -max_total_time="$seconds" -runs="$runs" -rss_limit_mb=2048 -print_final_stats=1
done
