# The whole initiator against the Linux kernel's ib_srpt (tests/tests/
# vm_srp_interop.rs): host StorPort model -> miniport core -> SRP engine ->
# kverbs -> software HCA on the VM's RoCEv2 link -> rdma_rxe -> ib_srpt/LIO.
# Login, INQUIRY/READ CAPACITY, every block of two LUNs written and read
# back, thousands of random data-verified I/Os (512 B..1 MiB, depths 1-64),
# ABORT TASK and LUN RESET, the target dropping the session (reconnect,
# fail-fast), logout, and a second login with two channels. One TCG boot;
# VM_SRP_IOS scales the random I/O (default 2400). About 3 min of test
# (175 s on the two loaded shared cores it was written on). Reuses the packages and
# the kernel/initramfs cache of step 60. On failure the link's pcap is kept
# in target/kv-vm/run/srp-interop/ (the test prints its path).
export DEBIAN_FRONTEND=noninteractive
apt-get -o DPkg::Lock::Timeout=300 update -qq
apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends \
    qemu-system-x86 busybox-static kmod cpio iproute2 >/dev/null

# Boots the VM for real (the test refuses to skip when CI is set).
CI=true timeout 1200 cargo test -p kverbs-tests --features vm-tests --test vm_srp_interop -- --nocapture
