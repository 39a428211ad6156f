# kvbench against the Linux kernel's targets in the VM, as a user runs it
# (tools/tests/vm_kvbench.rs): `kvbench --transport linux-vm-srp` (ib_srpt)
# and `--transport linux-vm-iser` (LIO over ib_isert), each a short verified
# 4K random 70/30 + 64K sequential read run writing JSON; both must exit 0
# (no error, no lost I/O, the target lets go of the session after logout),
# the JSON must show every sector intact, and no qemu may outlive kvbench.
# Two TCG boots: 62 s of test on the two shared cores it was written on.
# Reuses the packages and the kernel/initramfs cache of step 60.
export DEBIAN_FRONTEND=noninteractive
apt-get -o DPkg::Lock::Timeout=300 update -qq
apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends \
    qemu-system-x86 busybox-static kmod cpio iproute2 >/dev/null

# Boots the VM for real (the test refuses to skip when CI is set).
CI=true timeout 600 cargo test -p kverbs-tools --features vm-tests --test vm_kvbench -- --nocapture
