# The Linux target VM (ib_srpt and LIO isert over Soft-RoCE in qemu, TCG):
# host packages, the cached kernel and initramfs, the VM integration tests,
# and a round trip through the kv-vm CLI. About 1 min 45 s on the two shared
# cores it was written on ,
# nearly all of it four TCG boots of 10-30 s each.
export DEBIAN_FRONTEND=noninteractive
apt-get -o DPkg::Lock::Timeout=300 update -qq
apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends \
    qemu-system-x86 busybox-static kmod cpio iproute2 >/dev/null

cargo build -p kverbs-tools --bin kv-vm
kv_vm=target/debug/kv-vm
timeout 600 "$kv_vm" prepare --no-install

# Boots the VM for real (the tests refuse to skip when CI is set).
CI=true timeout 900 cargo test -p kverbs-tools --features vm-tests --test vm_target -- --nocapture

# The CLI: up, status, exec, down; no qemu may survive.
instance=ci-cli
trap '"$kv_vm" -i "$instance" down >/dev/null 2>&1 || true' EXIT
timeout 300 "$kv_vm" -i "$instance" up --no-install --ready-timeout 240
"$kv_vm" -i "$instance" status
"$kv_vm" -i "$instance" exec -- rdma link show rxe0/1 | grep -q 'state ACTIVE'
enabled=$("$kv_vm" -i "$instance" exec -- 'cat /sys/kernel/config/target/srpt/*/tpgt_1/enable')
test "$enabled" = 1
pid=$(cat "target/kv-vm/run/$instance/qemu.pid")
"$kv_vm" -i "$instance" down
if "$kv_vm" -i "$instance" status; then
    echo "kv-vm status still reports $instance running after down" >&2
    exit 1
fi
# A zombie waiting for init to reap it is gone; anything else is not.
state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null || true)
if [ -n "$state" ] && [ "$state" != Z ]; then
    echo "qemu $pid survived kv-vm down" >&2
    exit 1
fi
