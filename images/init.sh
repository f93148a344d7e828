#!/usr/bin/busybox sh
# sandvisor guest runtime /init (busybox sh, runs from the initramfs).
# Mounts the kernel filesystems, loads the virtio modules the VM needs, mounts the
# user's root filesystem at /sysroot and execs guestd as PID 1. Only shell builtins
# in the hot path where possible: every fork costs under TCG.
export PATH=/usr/bin
B=/usr/bin/busybox
$B mount -t proc proc /proc
read -r SV_T_INIT _ < /proc/uptime
$B mount -t sysfs sys /sys
$B mount -t devtmpfs dev /dev
read -r CMDLINE < /proc/cmdline
ROOT= FSTYPE=ext4 RO=rw VSOCK= DEBUG=
for w in $CMDLINE; do
  case "$w" in
    sandvisor.root=*) ROOT=${w#*=} ;;
    sandvisor.rootfstype=*) FSTYPE=${w#*=} ;;
    sandvisor.ro) RO=ro ;;
    sandvisor.vsock=*) VSOCK=${w#*=} ;;
    sandvisor.debug) DEBUG=1 ;;
  esac
done
[ -n "$DEBUG" ] && set -x
M=/lib/modules
for m in virtio_ring virtio virtio_mmio virtio_console; do $B insmod $M/$m.ko; done
# device-specific drivers only for devices that are there (IDs: 1 net, 2 block, 19 vsock)
IDS=
for d in /sys/bus/virtio/devices/*/device; do [ -e "$d" ] && read -r id < "$d" && IDS="$IDS $id"; done
case "$IDS" in *0x0002*) $B insmod $M/virtio_blk.ko ;; esac
case "$IDS" in *0x0001*) for m in failover net_failover virtio_net; do $B insmod $M/$m.ko; done ;; esac
case "$IDS" in *0x0013*) for m in vsock vmw_vsock_virtio_transport_common vmw_vsock_virtio_transport; do $B insmod $M/$m.ko; done ;; esac
if [ "$VSOCK" = loopback ]; then for m in vsock vmw_vsock_virtio_transport_common vsock_loopback; do $B insmod $M/$m.ko 2>/dev/null; done; fi
read -r SV_T_MODULES _ < /proc/uptime

mountall() {  # $1: the root that user processes will see
  $B mkdir -p "$1/proc" "$1/sys" "$1/dev" "$1/tmp" "$1/run" 2>/dev/null
  if [ "$1" != "" ]; then
    $B mount -t proc proc "$1/proc"
    $B mount -t sysfs sys "$1/sys"
    $B mount -t devtmpfs dev "$1/dev"
  fi
  $B mkdir -p "$1/dev/pts" "$1/dev/shm"
  $B mount -t devpts -o gid=5,mode=620,ptmxmode=0666 devpts "$1/dev/pts"
  $B mount -t tmpfs -o mode=1777,nosuid,nodev tmp "$1/tmp"
  $B mount -t tmpfs -o mode=1777,nosuid,nodev shm "$1/dev/shm"
  $B mount -t tmpfs -o mode=755,nosuid,nodev run "$1/run"
}

if [ -n "$ROOT" ]; then
  i=0
  while [ ! -b "$ROOT" ] && [ $i -lt 3000 ]; do $B usleep 1000; i=$((i+1)); done
  if $B mount -t "$FSTYPE" -o "$RO,noatime" "$ROOT" /sysroot; then
    mountall /sysroot
  else
    echo "sandvisor-init: cannot mount $ROOT ($FSTYPE); serving from the runtime image" > /dev/console
    mountall ""
  fi
else
  mountall ""
fi
read -r SV_T_ROOTFS _ < /proc/uptime
export SV_T_INIT SV_T_MODULES SV_T_ROOTFS
exec /usr/bin/python3.11 -S -E -B /sandvisor/boot.py
