#!/bin/busybox sh
# kv-vm guest init (PID 1 of the initramfs).
#
# Loads the modules in the order the host resolved (/etc/kvvm/modules), brings
# up eth0 and the Soft-RoCE device rxe0, builds the LIO backstores, the ib_srpt
# target and the iSCSI target with its iSER portal from /etc/kvvm/config.sh,
# prints KVVM-INFO lines and KVVM-READY on the console, then serves the host:
# the command agent on ttyS1 and a shell on the console (ttyS0).
#
# Every setup action runs through `step NAME CMD...`. A failing step prints
#   KVVM-FAIL step=NAME rc=N
#   <its output and the tail of the kernel log>
#   KVVM-FAIL-END
# and powers the VM off (or drops to a shell with KV_KEEP_ON_FAILURE=1), so the
# host reports exactly which configfs write was refused.

/bin/busybox mkdir -p /proc /sys /dev /run /tmp /sbin /usr/bin /usr/sbin
/bin/busybox --install -s
mount -t devtmpfs dev /dev
exec </dev/console >/dev/console 2>&1
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t tmpfs -o mode=0755 run /run
mkdir -p /run/kvvm
set -f
echo "kvvm: init started at $(cut -d' ' -f1 /proc/uptime) s"

fail() {
    echo "KVVM-FAIL step=$1 rc=$2"
    printf '%s\n' "$3"
    echo "--- kernel log (tail)"
    dmesg | tail -n 15
    echo "KVVM-FAIL-END"
    if [ "${KV_KEEP_ON_FAILURE:-0}" = 1 ]; then
        echo "kvvm: keeping the VM up for debugging (shell on the console)"
        while :; do setsid cttyhack sh; done
    fi
    sync
    poweroff -f
}

# step NAME CMD...: run CMD, and on failure report NAME with CMD's output.
step() {
    name=$1
    shift
    out=$("$@" 2>&1)
    rc=$?
    [ $rc -eq 0 ] && return 0
    fail "$name" "$rc" "$out"
}

# put FILE VALUE: one configfs/sysfs write; the shell reports a refused write.
put() {
    echo "$2" > "$1"
}

# wait_for NAME SECONDS CMD...: poll CMD every 0.1 s until it succeeds.
wait_for() {
    name=$1
    tries=$(($2 * 10))
    shift 2
    while ! "$@" >/dev/null 2>&1; do
        tries=$((tries - 1))
        if [ $tries -le 0 ]; then
            fail "$name" 124 "timed out waiting for: $*"
        fi
        sleep 0.1
    done
}

[ -r /etc/kvvm/config.sh ] || fail "read /etc/kvvm/config.sh" 1 "the configuration archive is missing"
. /etc/kvvm/config.sh

KREL=$(uname -r)
MODDIR=/lib/modules/$KREL
[ -d "$MODDIR" ] || fail "kernel release $KREL" 1 "no modules for this kernel in the initramfs"

# --- modules ---------------------------------------------------------------
while read -r mod path; do
    params=""
    case "$mod" in
        ib_srpt) params=$KV_SRPT_MODPARAMS ;;
        ib_isert) params=$KV_ISERT_MODPARAMS ;;
    esac
    # $params is split on purpose: one word per module parameter.
    step "load module $mod" insmod "$MODDIR/$path" $params
done < /etc/kvvm/modules
echo "kvvm: modules loaded at $(cut -d' ' -f1 /proc/uptime) s"

# --- network and Soft-RoCE ---------------------------------------------------
step "lo: link up" ip link set lo up
wait_for "eth0: device appears" 10 test -e /sys/class/net/eth0
step "eth0: link up" ip link set eth0 up
step "eth0: address $KV_VM_IP/$KV_PREFIX" ip addr add "$KV_VM_IP/$KV_PREFIX" dev eth0
if [ "$KV_STATIC_NEIGH" = 1 ]; then
    step "eth0: static neighbour $KV_HOST_IP" \
        ip neigh replace "$KV_HOST_IP" lladdr "$KV_HOST_MAC" dev eth0 nud permanent
fi
step "rxe0: rdma link add rxe0 type rxe netdev eth0" rdma link add rxe0 type rxe netdev eth0
rxe_active() {
    rdma link show rxe0/1 | grep -q 'state ACTIVE'
}
wait_for "rxe0: port 1 ACTIVE" 20 rxe_active
IB=/sys/class/infiniband/rxe0/ports/1
# The GID table has 1024 slots; the address GIDs sit at the front. Builtins
# only: a fork per slot is slow under TCG.
ipv4_gid_index() {
    gi=0
    while [ $gi -lt 16 ]; do
        g=""
        read -r g 2>/dev/null < "$IB/gids/$gi"
        if [ "$g" = "$KV_IPV4_GID" ]; then
            t=""
            read -r t 2>/dev/null < "$IB/gid_attrs/types/$gi"
            if [ "$t" = "RoCE v2" ]; then
                echo "$gi"
                return 0
            fi
        fi
        gi=$((gi + 1))
    done
    return 1
}
wait_for "rxe0: RoCE v2 GID for $KV_VM_IP" 20 ipv4_gid_index
GID_INDEX=$(ipv4_gid_index)
GID0=$(cat "$IB/gids/0")
NODE_GUID=$(cat /sys/class/infiniband/rxe0/node_guid)

# --- LIO backstores ----------------------------------------------------------
C=/sys/kernel/config/target
step "mount configfs" mount -t configfs configfs /sys/kernel/config
step "configfs: target core present" test -d "$C/core"
i=0
BACKSTORES=""
for spec in $KV_LUNS; do
    kind=${spec%%:*}
    rest=${spec#*:}
    bytes=${rest%%:*}
    bs=${rest#*:}
    case "$kind" in
        rd_mcp)
            dev=$C/core/rd_mcp_$i/ram$i
            control="rd_pages=$((bytes / 4096))"
            ;;
        fileio)
            dev=$C/core/fileio_$i/file$i
            control="fd_dev_name=/run/kvvm/lun$i.img,fd_dev_size=$bytes"
            ;;
        *) fail "lun $i: backstore" 1 "unknown backstore kind $kind" ;;
    esac
    step "lun $i: create $kind backstore ${dev#"$C"/}" mkdir -p "$dev"
    step "lun $i: ${dev#"$C"/}/control $control" put "$dev/control" "$control"
    step "lun $i: enable ${dev#"$C"/}" put "$dev/enable" 1
    step "lun $i: unit serial kvvm-lun$i" put "$dev/wwn/vpd_unit_serial" "kvvm-lun$i"
    step "lun $i: block_size $bs" put "$dev/attrib/block_size" "$bs"
    BACKSTORES="$BACKSTORES $dev"
    i=$((i + 1))
done

# export_luns TPG: link every backstore as lun_N of the TPG.
export_luns() {
    n=0
    for dev in $BACKSTORES; do
        step "${1#"$C"/}: create lun_$n" mkdir -p "$1/lun/lun_$n"
        step "${1#"$C"/}: lun_$n -> ${dev#"$C"/}" ln -s "$dev" "$1/lun/lun_$n/${dev##*/}"
        n=$((n + 1))
    done
}

# map_acl TPG NAME: create the node ACL NAME with every LUN mapped.
map_acl() {
    step "${1#"$C"/}: create ACL $2" mkdir -p "$1/acls/$2"
    n=0
    for dev in $BACKSTORES; do
        step "${1#"$C"/}: ACL $2 map lun_$n" mkdir -p "$1/acls/$2/lun_$n"
        step "${1#"$C"/}: ACL $2 lun_$n -> lun/lun_$n" ln -s "$1/lun/lun_$n" "$1/acls/$2/lun_$n/lun_$n"
        n=$((n + 1))
    done
}

# put_list DIR "name=value ...": one write per pair.
put_list() {
    for kv in $2; do
        step "${1#"$C"/}/${kv%%=*} = ${kv#*=}" put "$1/${kv%%=*}" "${kv#*=}"
    done
}

# --- SRP target (ib_srpt) ----------------------------------------------------
SRPT_WWN=""
if [ "$KV_SRPT" = 1 ]; then
    if [ "$KV_SRPT_WWN_FORM" = gid ]; then
        SRPT_WWN=0x$(echo "$GID0" | tr -d ':')
    else
        SRPT_WWN=$(echo "$GID0" | cut -d: -f5-8)
    fi
    step "srpt: register fabric (mkdir $C/srpt)" mkdir -p "$C/srpt"
    step "srpt: rdma_cm_port $KV_SRPT_PORT" put "$C/srpt/discovery_auth/rdma_cm_port" "$KV_SRPT_PORT"
    W=$C/srpt/$SRPT_WWN/tpgt_1
    step "srpt: create target port $SRPT_WWN" mkdir -p "$W"
    export_luns "$W"
    for acl in $KV_SRPT_ACLS; do
        map_acl "$W" "$acl"
    done
    put_list "$W/attrib" "$KV_SRPT_ATTRIBS"
    step "srpt: enable $SRPT_WWN/tpgt_1" put "$W/enable" 1
fi

# --- iSCSI target with the iSER portal ----------------------------------------
if [ "$KV_ISER" = 1 ]; then
    I=$C/iscsi/$KV_ISER_IQN/tpgt_1
    step "iscsi: create target $KV_ISER_IQN" mkdir -p "$I"
    export_luns "$I"
    step "iscsi: portal $KV_ISER_PORTAL" mkdir -p "$I/np/$KV_ISER_PORTAL"
    step "iscsi: enable iSER on portal $KV_ISER_PORTAL" put "$I/np/$KV_ISER_PORTAL/iser" 1
    step "iscsi: authentication 0" put "$I/attrib/authentication" 0
    if [ "$KV_ISER_DEMO" = 1 ]; then
        step "iscsi: demo mode generate_node_acls 1" put "$I/attrib/generate_node_acls" 1
        step "iscsi: demo mode cache_dynamic_acls 1" put "$I/attrib/cache_dynamic_acls" 1
        step "iscsi: demo mode demo_mode_write_protect 0" put "$I/attrib/demo_mode_write_protect" 0
    fi
    for acl in $KV_ISER_ACLS; do
        map_acl "$I" "$acl"
    done
    put_list "$I/attrib" "$KV_ISER_ATTRIBS"
    put_list "$I/param" "$KV_ISER_PARAMS"
    step "iscsi: enable tpgt_1" put "$I/enable" 1
fi

# --- the host's control channel ------------------------------------------------
[ -e /dev/ttyS1 ] || fail "control channel /dev/ttyS1" 1 "the second serial port is missing"
setsid /bin/kvvm-agent </dev/ttyS1 >/dev/ttyS1 2>&1 &

echo "KVVM-INFO kernel=$KREL"
echo "KVVM-INFO node_guid=$NODE_GUID"
echo "KVVM-INFO gid0=$GID0"
echo "KVVM-INFO ipv4_gid_index=$GID_INDEX"
echo "KVVM-INFO srpt_wwn=$SRPT_WWN"
echo "KVVM-INFO srp_max_req_size=$(cat /sys/module/ib_srpt/parameters/srp_max_req_size)"
echo "KVVM-READY uptime=$(cut -d' ' -f1 /proc/uptime)"
dmesg -n "$KV_LOGLEVEL"

set +f
while :; do
    setsid cttyhack sh
    sleep 1
done
