# The whole initiator over iSER against Linux's LIO isert on Soft-RoCE in the
# VM (one TCG boot; ~70 s of test): login, INQUIRY/READ CAPACITY, NOP
# keepalive, verified I/O, logout, a second session with InitialR2T=No.
# Step 62 installed the VM's packages already.
CI=true timeout 1200 cargo test -p kverbs-tests --features vm-tests --test vm_iser_interop -- --nocapture
