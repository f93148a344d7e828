"""A VM's spec (actors/machines/vm.py): VmSpec derives its MachineSpec once and reads old records."""

from __future__ import annotations

from pathlib import Path

import pytest

# a life record's spec as the supervisor before VmSpec held its MachineSpec wrote it
# (dumped by that code): a running QEMU it left (serve --keep-sandboxes) is adopted by
# the next supervisor from this
FLAT_SPEC = {
    "kernel": "/k",
    "initrd": "/i",
    "append": "console=ttyS0",
    "disk": "/d/disk.qcow2",
    "cpus": 2,
    "memory_mib": 512,
    "accel": "tcg",
    "user": {"name": "nobody", "uid": 65534, "gid": 65534, "groups": [65534]},
    "network": {
        "restrict": True,
        "net": "10.0.2.0/24",
        "address": "10.0.2.15",
        "gateway": "10.0.2.2",
        "dns": "10.0.2.3",
        "prefix": 24,
        "tap": False,
        "mac": "",
        "tap_name": "",
        "detached": False,
    },
    "ram": "/dev/shm/x",
    "ram_shared": False,
    "restore": "/s/vmstate",
    "chain": ["/s/disk.qcow2", "/base.img"],
    "boot_timeout": 30.0,
    "answer_timeout": 5.0,
    "name": "sb",
    "machine": "microvm",
    "sandbox": True,
    "extra_ports": [],
    "balloon": True,
    "preload": "/p.so",
    "tb_size_mib": 64,
    "volumes": [{"path": "/v.ext4", "read_only": True, "serial": "data"}],
}


def test_a_vm_spec_holds_its_machine_spec_and_reads_old_records() -> None:
    """VmSpec derives its MachineSpec's network devices, disk chain, RAM file and
    -incoming once; the record round-trips, and a record in the earlier flat form
    gives the machine that supervisor derived (the MachineSpec below is what its
    ``machine_spec()`` printed for FLAT_SPEC)."""
    from actors.machines.qemuproc import QemuUser
    from actors.machines.qemuspec import MachineSpec, Volume
    from actors.machines.vm import NetConfig, VmSpec, load_spec
    from actors.model import dump

    spec = VmSpec.of(
        kernel=Path("/k"),
        initrd=Path("/i"),
        append="console=ttyS0",
        disk=Path("/d/disk.qcow2"),
        chain=(Path("/s/disk.qcow2"), Path("/base.img")),
        cpus=2,
        memory_mib=512,
        user=QemuUser("nobody", 65534, 65534, (65534,)),
        network=NetConfig(restrict=True),
        ram=Path("/dev/shm/x"),
        ram_shared=False,
        restore=Path("/s/vmstate"),
        boot_timeout=30.0,
        answer_timeout=5.0,
        name="sb",
        balloon=True,
        preload=Path("/p.so"),
        volumes=(Volume(Path("/v.ext4"), read_only=True, serial="data"),),
    )
    assert spec.machine == MachineSpec(
        kernel=Path("/k"),
        initrd=Path("/i"),
        disk=Path("/d/disk.qcow2"),
        cpus=2,
        memory_mib=512,
        append="console=ttyS0",
        balloon=True,
        preload=Path("/p.so"),
        netdev=(
            "-netdev",
            "user,id=n0,net=10.0.2.0/24,host=10.0.2.2,dns=10.0.2.3,restrict=on",
            "-device",
            "{net},netdev=n0",
        ),
        user=QemuUser("nobody", 65534, 65534, (65534,)),
        disk_chain=(Path("/s/disk.qcow2"), Path("/base.img")),
        memory_file=Path("/dev/shm/x"),
        memory_shared=False,
        incoming=True,
        volumes=(Volume(Path("/v.ext4"), read_only=True, serial="data"),),
    )
    assert spec.mapped_restore
    assert load_spec(dump(spec)) == spec
    assert load_spec(FLAT_SPEC) == spec
    with pytest.raises(ValueError, match="-incoming"):
        VmSpec(spec.machine)  # a machine waiting for a state nobody loads
