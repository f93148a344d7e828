#!/usr/bin/busybox sh
# sandvisor guest runtime /init (busybox sh, runs from the initramfs).
# Mounts the kernel filesystems, loads the virtio modules the VM needs, mounts the
# user's root filesystem at /sysroot and execs guestd as PID 1. Every fork costs
# ~10 ms under TCG: shell builtins where possible, one modprobe and one mount -a
# per step instead of a process per module or mount. Applets busybox marks NOEXEC
# (mkdir, modprobe, ip, usleep) are called by name: busybox sh runs them in a forked
# child without exec'ing the 2 MB busybox binary again (checked with strace). mount
# is not one of them: the shell would exec it through /proc/self/exe, which is not
# there before /proc is mounted, so mount goes by path.
export PATH=/usr/bin
B=/usr/bin/busybox
$B mount -t proc proc /proc
read -r SV_T_INIT _ < /proc/uptime
read -r CMDLINE < /proc/cmdline
ROOT= FSTYPE=ext4 RO=rw VSOCK= DEBUG= NET=
for w in $CMDLINE; do
  case "$w" in
    sandvisor.root=*) ROOT=${w#*=} ;;
    sandvisor.rootfstype=*) FSTYPE=${w#*=} ;;
    sandvisor.ro) RO=ro ;;
    sandvisor.vsock=*) VSOCK=${w#*=} ;;
    sandvisor.debug) DEBUG=1 ;;
    sandvisor.net=*) NET=${w#*=} ;;
  esac
done
[ -n "$DEBUG" ] && set -x
$B mount -a -T /etc/fstab.early   # sysfs, devtmpfs
mkdir /dev/pts /dev/shm          # in devtmpfs, so they exist in /sysroot/dev as well
# the channel and the disk are (nearly) always there: one modprobe for both
modprobe -a virtio_mmio virtio_console virtio_blk
# other drivers only for devices that are there (virtio IDs: 1 net, 19 vsock, 26 fs)
IDS= MODS=
for d in /sys/bus/virtio/devices/*/device; do [ -e "$d" ] && read -r id < "$d" && IDS="$IDS $id"; done
case "$IDS" in *0x0001*) MODS="$MODS virtio_net" ;; esac
case "$IDS" in *0x0013*) MODS="$MODS vmw_vsock_virtio_transport" ;; esac
case "$IDS" in *0x001a*) MODS="$MODS virtiofs" ;; esac
[ "$VSOCK" = loopback ] && MODS="$MODS vsock_loopback"
[ -n "$MODS" ] && modprobe -a $MODS
read -r SV_T_MODULES _ < /proc/uptime

TAB=/etc/fstab.initramfs
if [ -n "$ROOT" ]; then
  i=0
  while [ ! -b "$ROOT" ] && [ $i -lt 3000 ]; do usleep 1000; i=$((i+1)); done
  if $B mount -t "$FSTYPE" -o "$RO,noatime" "$ROOT" /sysroot; then
    TAB=/etc/fstab.sysroot
    for d in proc sys dev tmp run; do
      [ -d "/sysroot/$d" ] || mkdir -p "/sysroot/$d"
    done
  else
    echo "sandvisor-init: cannot mount $ROOT ($FSTYPE); serving from the runtime image" > /dev/console
  fi
fi
$B mount -a -T $TAB
# networking: lo always; eth0 from sandvisor.net=ADDR/PREFIX,GATEWAY,DNS (user-mode NIC)
ip link set lo up
if [ -n "$NET" ]; then
  IFS=, read -r ADDR GW DNS <<EON
$NET
EON
  ip addr add "$ADDR" dev eth0 && ip link set eth0 up && ip route add default via "$GW"
  R=/sysroot; [ "$TAB" = /etc/fstab.sysroot ] || R=
  [ -n "$DNS" ] && [ -d "$R/etc" ] && echo "nameserver $DNS" > "$R/etc/resolv.conf"
fi
read -r SV_T_ROOTFS _ < /proc/uptime
export SV_T_INIT SV_T_MODULES SV_T_ROOTFS
PYFLAGS=
[ -n "$DEBUG" ] && PYFLAGS="-X importtime"
exec /usr/bin/python3.11 -S -E -B $PYFLAGS /sandvisor/boot.pyc
