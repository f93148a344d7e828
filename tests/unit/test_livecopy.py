"""A fork's live copy, what needs no VM: which guests take it, and the helper's machine
(the parent's devices, a RAM file given by descriptor, a placeholder disk, a network
backend whose saved state matches the parent's). The copy itself runs against real
QEMUs in tests/vm/test_fork.py and tests/vm/test_crashpoints.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import attrs

from actors.machines.qemuspec import MachineSpec, Volume
from actors.machines.vm import NetConfig, netdev_args
from actors.model import NetMode, Network, SandboxConfig
from actors.sandboxes.livecopy import helper_spec, stop_first, supports, worth_it
from actors.settings import Settings

TAP_ARGS = ("-netdev", "tap,id=n0,fd={fd:tap}", "-device", "{net},netdev=n0,mac=52:54:00:12:34:56")


def parent(**kw: Any) -> MachineSpec:
    base: dict[str, Any] = dict(
        kernel=Path("/snap/kernel"),
        initrd=Path("/snap/initrd"),
        append="console=ttyS0",
        disk=Path("/s/disk.qcow2"),
        disk_chain=(Path("/snap/disk.qcow2"),),
        memory_mib=512,
        memory_file=Path("/snap/memory"),
        memory_shared=False,
        balloon=True,
        preload=Path("/discard.so"),
        netdev=netdev_args(NetConfig(restrict=False)),
    )
    return MachineSpec(**{**base, **kw})


def settings(cells: bool) -> Settings:
    return cast(Settings, SimpleNamespace(cells=object() if cells else None))


def test_a_jailed_supervisor_copies_live_what_it_can_give_a_helper() -> None:
    assert supports(parent(), settings(cells=True))
    assert not supports(parent(), settings(cells=False))  # the helper needs a cell of its own
    assert not supports(parent(volumes=(Volume(Path("/v.img"), read_only=True),)), settings(cells=True))
    assert not supports(parent(fs_tags=("host0",)), settings(cells=True))


def test_the_helper_is_the_parents_machine_paused_for_an_incoming_stream() -> None:
    p = parent()
    h = helper_spec(p, SandboxConfig(network=Network(mode=NetMode.USER)), Path("/run/lf-x/disk.qcow2"))
    assert (h.kernel, h.initrd, h.append, h.cpus, h.memory_mib, h.balloon) == (
        p.kernel,
        p.initrd,
        p.append,
        p.cpus,
        p.memory_mib,
        p.balloon,
    )
    assert h.incoming and h.extra_args == ("-S",)  # it never runs the guest
    # RAM: a shared file given by descriptor (the fork's memfd), no discard shim
    assert (h.memory_file, h.memory_shared, h.preload) == (None, True, None)
    assert (h.disk, h.disk_chain) == (Path("/run/lf-x/disk.qcow2"), ())  # not the parent's files
    # slirp's saved state matches: user mode, cut off (no host forward of the parent's)
    assert h.netdev == netdev_args(NetConfig(restrict=True))


def test_a_tap_guests_helper_keeps_its_device_on_a_tap_of_its_own() -> None:
    p = parent(netdev=TAP_ARGS)
    h = helper_spec(p, SandboxConfig(network=Network(mode=NetMode.TAP)), Path("/d.qcow2"))
    assert h.netdev == TAP_ARGS  # (the vnet header's offloads are in the device's state)
    h = helper_spec(parent(netdev=()), SandboxConfig(), Path("/d.qcow2"))
    assert h.netdev == ()


def test_under_tcg_the_guest_is_stopped_for_the_copy_and_only_private_ram_takes_it() -> None:
    restored, booted = parent(), parent(memory_shared=True, memory_file=Path("/run/ram"))
    assert stop_first(restored) and stop_first(booted)  # TCG: QEMU 7.2 loses a write now and then
    assert worth_it(restored)  # (its ordinary checkpoint streams its RAM; its children each read it all)
    assert not worth_it(booted)  # (its ordinary checkpoint copies memory to memory)
    on_kvm = parent(accel="kvm")
    assert not stop_first(on_kvm) and worth_it(on_kvm) and worth_it(attrs.evolve(booted, accel="kvm"))
