"""The rules docs/architecture.md states, checked against the code: the state diagram
names every state, the events listed are the actions, the actor tree names classes and
methods that exist, actors are started with ``nursery.start``, the domain runs on Trio.

(The layers, the domain's folders and their circles: tests/unit/test_layers.py.)
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from actors.model import Action, State

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "architecture.md"


def section(title: str) -> str:
    text = PAGE.read_text()
    start = text.index(f"\n{title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def first_block(text: str) -> str:
    return text.split("```", 2)[1]


def sources() -> list[Path]:
    return sorted(p for d in ("actors", "supervisor") for p in (ROOT / d).rglob("*.py") if "proto" not in p.parts)


def test_the_state_diagram_names_every_state() -> None:
    words = set(re.findall(r"[a-z_]+", first_block(section("### State machine"))))
    assert {s.value for s in State} - words == set()


def test_the_events_listed_are_the_actions() -> None:
    text = " ".join(section("### State machine").split())
    listed = text.split("test_the_events_listed_are_the_actions`):", 1)[1].split(". Stop waits", 1)[0]
    names = [re.sub(r"\([^)]*\)", "", item).strip() for item in listed.split(",")]
    assert sorted(names) == sorted(a.value for a in Action)


def members() -> dict[str, set[str]]:
    """Each class of the domain and the edges (by name) with its methods and attributes."""
    out: dict[str, set[str]] = {}
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                names = out.setdefault(node.name, set())
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(item.name)
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        names.add(item.target.id)
    return out


def test_the_actor_tree_names_what_exists() -> None:
    tree = first_block(section("## Actors, handles and tasks"))
    named = set(re.findall(r"\b([A-Z][A-Za-z]+)\.([a-z_]+)\b", tree))
    assert len(named) > 15
    known = members()
    assert sorted(f"{c}.{m}" for c, m in named if m not in known.get(c, set())) == []
    for title in ("Hibernation", "E2BEndpoint", "SSHGateway", "FleetMember", "GrpcEdge", "Timers"):
        assert title in tree


def started_soon(path: Path) -> list[str]:
    """The ``x.run`` methods a file starts with ``start_soon`` (without waiting for them)."""
    return [
        ast.unparse(node.args[0])
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "start_soon"
        and node.args
        and isinstance(node.args[0], ast.Attribute)
        and node.args[0].attr == "run"
    ]


def test_actors_are_started_with_nursery_start() -> None:
    """An actor's ``run`` is started with ``await nursery.start(x.run)``, which returns once
    it is ready; the timers' tick is the one started without waiting (nothing waits on it)."""
    assert [x for p in sources() for x in started_soon(p)] == ["self.timers.run"]


def test_the_start_check_sees_start_soon(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "async def f(n, a):\n    n.start_soon(a.run)\n    await n.start(a.run)\n    n.start_soon(a.tick)\n"
    )
    assert started_soon(probe) == ["a.run"]


def test_the_domain_runs_on_trio_alone() -> None:
    """The domain's only event loop is Trio's: nothing in actors/ imports asyncio (the
    gRPC edge and the SSH gateway keep theirs in threads of their own)."""
    found = []
    for path in sorted((ROOT / "actors").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            mods = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            found += [f"{path.relative_to(ROOT)}: {m}" for m in mods if m.split(".")[0] == "asyncio"]
    assert found == []


def test_on_disk_paths_come_from_the_generated_uid() -> None:
    """A sandbox's directories and files (``SandboxFiles``) are named by its record's uid,
    never by the caller's id."""
    calls = [
        node
        for path in sources()
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "SandboxFiles"
    ]
    assert calls
    assert [ast.unparse(c.args[0]) for c in calls if not ast.unparse(c.args[0]).endswith(".uid")] == []


def test_qemu_runs_sandboxed_and_opens_no_file_of_ours_by_path(tmp_path: Path) -> None:
    """QEMU's command line: its seccomp sandbox with every deny, no defaults, no user
    config; the kernel, initrd, disk, its backing layers, volumes, the preload and RAM
    reach it as descriptors, so no path of the state directory is on it."""
    import os

    from actors.machines.qemuproc import QemuUser
    from actors.machines.qemuspec import Volume
    from actors.machines.vm import NetConfig, VmSpec

    state, sock_dir = tmp_path / "state", tmp_path / "sock"
    state.mkdir()
    for name in ("k", "i", "disk.qcow2", "base.img", "v.ext4", "p.so", "ram"):
        (state / name).write_bytes(b"\0" * 4096)
    machine = VmSpec.of(
        kernel=state / "k",
        initrd=state / "i",
        append="console=ttyS0",
        disk=state / "disk.qcow2",
        chain=(state / "base.img",),
        cpus=1,
        memory_mib=256,
        user=QemuUser("nobody", 65534, 65534, (65534,)),
        network=NetConfig(restrict=True),
        ram=state / "ram",
        name="sb",
        preload=state / "p.so",
        volumes=(Volume(state / "v.ext4", read_only=True, serial="data"),),
    ).machine
    fds = machine.open_files()
    fds["ram"] = os.open(state / "ram", os.O_RDWR)
    try:
        argv = machine.argv(sock_dir, fds)
        env = machine.environ(fds)
    finally:
        for fd in fds.values():
            os.close(fd)
    assert argv[argv.index("-sandbox") + 1] == "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
    assert {"-nodefaults", "-no-user-config"} <= set(argv)
    assert [a for a in [*argv, *env.values()] if str(state) in a] == []
