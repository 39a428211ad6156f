# The whole initiator over iSER against Linux's LIO isert on Soft-RoCE in the
# VM (one TCG boot; ~150 s of test on two loaded shared cores): login,
# INQUIRY/READ CAPACITY, NOP keepalive, verified I/O at depths 1-64, ABORT
# TASK and LUN RESET, the target dropping the session (reconnect,
# fail-fast), logout, a second session with InitialR2T=No.
# Step 62 installed the VM's packages already.
CI=true timeout 1200 cargo test -p kverbs-tests --features vm-tests --test vm_iser_interop -- --nocapture
