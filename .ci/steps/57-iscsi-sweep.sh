# The iSCSI session sweep: the initiator's login and full-feature state
# machines against the LIO-like target, 40 seeds x 2000 commands (random
# window sizes, pings, ABORT TASK, LUN RESET, async logouts, dropped
# connections and reinstatement; every command completed exactly once,
# data verified). The plain test run (step 30) does 6 x 600. Debug build,
# about 1-2 minutes on 2 cores.
ISCSI_SWEEP_SEEDS=40 ISCSI_SWEEP_COMMANDS=2000 \
    timeout 900 cargo test -p kverbs-tools --test iscsi_session sweep
