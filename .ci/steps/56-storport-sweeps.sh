# The StorPort model's big sweeps over the miniport core: 10 000 seeded
# random schedules (exactly once, verifier, data integrity) and a larger
# concurrent stress run under every StartIo locking. The plain test run
# (step 30) does 1 000 schedules; this adds coverage, in debug builds so
# no release compile is needed. About 1-2 minutes on 2 cores.
STORPORT_SCHEDULES=10000 STORPORT_STRESS_REQUESTS=300 \
    timeout 1200 cargo test -p storport-srp --test schedules --test concurrency
