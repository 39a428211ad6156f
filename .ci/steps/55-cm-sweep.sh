# The connection manager's seeded sweeps, bigger than in the plain test
# run: the lossy-wire property (random loss, duplication, delay, consumers
# and QP failures; exactly one terminal event per connection, no leaked
# connection) over 5000 seeds, and 200k mutated MADs. A few seconds in a
# debug build.
KVERBS_CM_SEEDS=5000 KVERBS_CM_MUTATIONS=200000 \
    timeout 900 cargo test -p kverbs --lib cm::tests::
