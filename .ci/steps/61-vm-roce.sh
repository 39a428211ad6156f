# The software HCA's RoCEv2 link against the Linux kernel's rdma_rxe and
# ib_srpt in the target VM (tests/tests/vm_raw_roce.rs): ARP, CM REJ, an
# RDMA/CM SRP login, SCSI commands with RDMA WRITE and READ, loss and RNR
# recovery, DREQ/DREP, and a tshark decode of the link's pcap. Reuses the
# packages and the kernel/initramfs cache of step 60 and adds tshark (which
# the hca-lowlevel pcap test then requires too). One TCG boot plus the
# session: about 40 s of test (a 10-15 s boot, 30 s in all) plus the build, on
# the two shared cores it was written on.
export DEBIAN_FRONTEND=noninteractive
apt-get -o DPkg::Lock::Timeout=300 update -qq
apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends \
    qemu-system-x86 busybox-static kmod cpio iproute2 tshark >/dev/null

# The pcap output of the link, decoded by tshark (no skipping here).
KV_REQUIRE_TSHARK=1 cargo test -p hca-lowlevel --lib sim::link_tests

# Boots the VM for real (the test refuses to skip when CI is set).
CI=true timeout 900 cargo test -p kverbs-tests --features vm-tests --test vm_raw_roce -- --nocapture
