"""What every sandbox of one supervisor shares: the image, the accelerator, defaults, paths."""

from __future__ import annotations

import ssl
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import attrs

from actors import defaults
from actors.cells.cell import Cells
from actors.machines.qemuproc import QemuUser
from actors.machines.vm import Attach, Guest, VmSpec, booted_guest
from actors.model import Egress, Limits, PortSpec
from actors.net import bindaddr
from actors.net.hostnet import HostNetwork
from actors.secrets.vault import Vault
from images.build import Image
from images.oci import ImageStore

Launcher = Callable[[VmSpec, Attach], AbstractAsyncContextManager[Guest]]


@attrs.frozen
class Settings:
    image: Image
    sandboxes_dir: Path  # <state>/sandboxes/<uid>/{disk.qcow2, log}
    run_root: Path  # short paths for sockets: <run_root>/<uid[:18]>
    accel: str = "tcg"
    boot_timeout: float = defaults.BOOT_TIMEOUT
    guest_timeout: float = defaults.GUEST_TIMEOUT  # every guest request's deadline, on the host's side
    default_memory_mib: int = 256
    default_vcpus: int = 1
    qemu_user: QemuUser | None = None  # set when the supervisor is root
    expose_address: str = defaults.EXPOSE_ADDRESS  # where exposed ports listen on the host
    # guest RAM as shared files here (tmpfs), so checkpoints are "mapped"; None: anonymous
    memory_dir: Path | None = None
    # how a life brings its VM up: booted_guest (QEMU); unit tests pass a fake VM
    launch: Launcher = booted_guest
    images: ImageStore | None = None  # OCI images (Create{image}); None: refused
    cells: Cells | None = None  # the jailer (root supervisors): every QEMU in its own cell
    # directories a Create's own kernel and rootfs may come from (serve --allow-path; none by default)
    allowed_paths: tuple[Path, ...] = ()
    # the most disk one sandbox may make the host store: its overlay's virtual size plus
    # its read-write volumes' sizes (serve --max-sandbox-disk; 0: no cap; actors/quotas.py)
    max_sandbox_disk_mib: int = defaults.MAX_SANDBOX_DISK_MIB
    # fresh boots get a virtio-balloon with free page reporting (MachineSpec.balloon): on
    # where every RAM a balloon can meet is safe to discard in (anonymous, the machine's
    # own RAM file, or a sealed memfd with the discard shim: a jailed supervisor)
    balloon: bool = False
    tb_size_mib: int | None = defaults.TB_SIZE_MIB  # TCG's translation cache per QEMU (MachineSpec.tb_size_mib)
    # tap networking, the IP pool, egress filter and DNS proxy (root supervisors: serve
    # --ip-pool); also the uplinks of jailed user-mode sandboxes with outbound access
    hostnet: HostNetwork | None = None
    # secrets: their values and CAs (None: Creates with secrets are refused),
    # and the proxy's TLS context to real servers (system store + serve --upstream-ca)
    vault: Vault | None = None
    upstream_tls: ssl.SSLContext | None = None
    # host addresses besides loopback and expose_address that a sandbox's exposed ports
    # may listen on (serve --port-address; actors/net/bindaddr.py), and the operator's
    # named network profiles (serve --network-profiles; actors/net/profiles.py)
    port_addresses: tuple[str, ...] = ()
    network_profiles: Mapping[str, Egress] = attrs.field(factory=dict)
    # the guest's writable file systems frozen (FIFREEZE) while a pause or checkpoint
    # captures the disk, so the captured disk is clean (serve --no-fs-freeze: off)
    freeze_fs: bool = True
    # rootfs files (resolved paths) whose fresh boots get a boot template after this
    # command ran in the guest to completion (serve --e2b: the code-interpreter image's
    # kernel server, started and warm; actors/snapshots/pools.py)
    template_warmups: Mapping[str, tuple[str, ...]] = attrs.field(factory=dict)

    def check_bind_address(self, address: str) -> None:
        bindaddr.check(address, self.expose_address, self.port_addresses)

    def bind_address(self, pm: PortSpec) -> str:
        """Where ``pm``'s host port listens: its own address (Create fills in the
        sandbox's), or the supervisor's default."""
        return pm.host_address or self.expose_address

    def limits(self, requested: Limits) -> Limits:
        """The effective limits of a new sandbox: the caller's, or the supervisor's
        defaults. Resolved once, when the sandbox is made, and kept in its record
        (``Record.limits``): a later change of the defaults leaves it as it was made.
        Memory above the value needs the balloon to be given back (Create refuses it without)."""
        return requested.filled(self.default_vcpus, self.default_memory_mib)

    def image_parts(self) -> tuple[str, ...]:
        img = self.image
        return (str(img.kernel), str(img.initrd), str(img.rootfs))
