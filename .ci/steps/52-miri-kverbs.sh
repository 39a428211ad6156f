# Miri over kverbs' unsafe lock code: the SpinLock/PassiveMutex guards
# (UnsafeCell access, in-stack queue handles) on the host backend, plus the
# run-down counter, the IRQL tokens, the work-request slot ring and the CQ's
# lock-free table of attached QPs, its cached ring words, the drain
# loop's batch of MaybeUninit slots. The host verifier leaks one small
# log per platform instance on purpose, hence -Zmiri-ignore-leaks.
MIRIFLAGS="-Zmiri-ignore-leaks" \
    timeout 900 cargo +nightly miri test -p kverbs --lib -- sync:: rundown:: irql:: slots:: cq::attached:: cq::shared_dyn:: words:: drain::batch::
