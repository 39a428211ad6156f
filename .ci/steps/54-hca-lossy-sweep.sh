# The lossy-link RC property over thousands of seeds (cargo test runs 100):
# every message exactly once and in order, or the QP in error with every
# outstanding request flushed.
export HCA_LOSSY_SEEDS=3000
timeout 900 cargo test --release -p hca-lowlevel --test lossy_rc
