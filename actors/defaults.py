"""The supervisor's defaults, each defined once: the domain's settings, the jailer, the
daemon's configuration and ``sandvisor serve``'s flags all take them from here.

No imports: the command line reads it without loading the domain.
"""

BOOT_TIMEOUT = 60.0  # seconds a boot may take before it fails
GUEST_TIMEOUT = 30.0  # every guest request's deadline on the host's side (DEADLINE_EXCEEDED)
STOP_GRACE = 30.0  # a Stop (after its timeout) or a Kill waits this long more for the VM, then DEADLINE_EXCEEDED
POWEROFF_GRACE = 10.0  # guestd powers the guest off within this, else QMP quit (then SIGTERM, SIGKILL)
# the same for a sandbox whose PID 1 is its image's init: systemd stops its units first
# (a minimal Debian took 18 s under TCG on a 2-core host at load 12); within STOP_GRACE
# with the ladder's later steps (3 s each)
INIT_POWEROFF_GRACE = 20.0
# how long Modify (and a boot below its memory ceiling) waits for the balloon to reach its
# target (measured under TCG: 768 MiB taken in 2.8 s, given back in 0.4 s)
MODIFY_SETTLE_TIMEOUT = 60.0
TB_SIZE_MIB = 64  # TCG's translation cache per QEMU (QEMU's own default: 1 GiB)
JAIL_OVERHEAD_MIB = 192  # a jailed QEMU's memory limit is its guest RAM + this
JAIL_CPU_HEADROOM = 1.0  # a jailed QEMU's CPU ceiling is its vCPUs + this (its I/O runs beside them)
MAX_SANDBOXES = 64  # live sandboxes, warm pool members included
MAX_SANDBOX_DISK_MIB = 16 << 10  # one sandbox's overlay + read-write volumes, virtual sizes
MAX_IMAGE_BYTES = 8 << 30  # an OCI image's download and its unpacked tree, each
EXPOSE_ADDRESS = "127.0.0.1"  # where exposed ports listen on the host
JAIL_ID_FIRST = 1_900_000_000  # jailed QEMUs' uids/gids: above systemd-nspawn's 0x00080000-0x6FFFFFFF, below 0x7FFE0000
JAIL_ID_COUNT = 65536
IP_POOL = "10.88.0.0/16"  # tap networking's addresses (`sandvisor serve`; the daemon's own default: none)

# the fleet (docs/fleet.md): a member's capacity as Ray's scheduler sees it, how long a
# fleet Create waits for room, the raylet's object store (Ray's minimum: we move no
# objects through it), and how fast Ray's head declares a silent node dead
FLEET_SLOTS = 4
FLEET_MEMORY_MIB = 4096
FLEET_GUEST_MEMORY_MIB = 512  # a fleet Create's slot when it names no memory
FLEET_WAIT = 60.0
FLEET_OBJECT_STORE_MIB = 80
FLEET_HEALTH_PERIOD_MS = 1000
FLEET_HEALTH_MISSES = 5
# a member's Ray node runs as this unprivileged system user (made by serve when absent), on
# these pinned ports (nftables admits them from the fleet's peers only): the block from
# FLEET_RAY_PORT_BASE, see supervisor/serve/fleet/rayhost.py for what each one is
FLEET_RAY_USER = "sandvisor-ray"
FLEET_RAY_PORT_BASE = 17300
