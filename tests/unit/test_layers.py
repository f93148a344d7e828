"""The layers point one way: guestd <- images <- actors (the domain) <- supervisor (the edges).

Read from the source with ast (every import, also those inside functions): the guest
agent imports nothing of the host; the image builder nothing of the domain or the
edges; the domain nothing of the edges; the SDK (the client side of the wire) only
the wire-protocol module and its own helpers, never the domain. Inside the domain, its
folders point down one list (DOMAIN_LAYERS; docs/architecture.md "The domain's folders"),
and circles of imports stay inside one folder, each with its reason.
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SDK = (
    "supervisor/client/__init__.py",
    "supervisor/client/public.py",
    *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "supervisor/client/sdk").glob("*.py"))),
    *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "supervisor/client").glob("cli_*.py"))),  # the client commands
    "supervisor/wire/protocol.py",
    *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "supervisor/wire/messages").glob("*.py"))),  # its bodies
    "supervisor/wire/frames.py",
    "supervisor/wire/errors.py",
    "supervisor/wire/config.py",
    "supervisor/client/treecopy.py",
)
# the SDK's tree copies run guestd's stdlib-only tar codec (the same hostile-stream unpacker);
# its error codes and Patch are guestd's one definitions (codes.py, patch.py)
GUESTD_CODEC = (
    "guestd",
    "guestd.tree",
    "guestd.tarformat",
    "guestd.fsops",
    "guestd.proto",
    "guestd.codes",
    "guestd.patch",
)
GUESTD_NOT_SDK = tuple(
    f"guestd.{p.stem}" for p in sorted((ROOT / "guestd").glob("*.py")) if f"guestd.{p.stem}" not in GUESTD_CODEC
)
EDGES_ONLY = (
    "supervisor.serve.api",
    "supervisor.serve.api_store",
    "supervisor.serve.api_table",
    "supervisor.main.daemon_config",
    "supervisor.serve.server",
    "supervisor.main.daemon",
    "supervisor.serve.mapping",
    "supervisor.main.throwaway",
    "supervisor.main.cli",
)


def imports(path: Path, package: str = "") -> set[str]:
    """Every module ``path`` imports, absolute, at any depth of the file."""
    tree = ast.parse(path.read_text(), str(path))
    package = package or ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)  # `from pkg import mod`
    return out


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def top(mod: str) -> str:
    return mod.split(".", maxsplit=1)[0]


def wrong_arrows(files: list[Path], allowed: set[str], forbidden: tuple[str, ...] = (), package: str = "") -> list[str]:
    bad = []
    for f in files:
        for mod in sorted(imports(f, package)):
            t = top(mod)
            if any(mod == f or mod.startswith(f + ".") for f in forbidden) or (
                t not in allowed and t not in sys.stdlib_module_names
            ):
                bad.append(f"{f.name} imports {mod}")
    return bad


QEMU_QMP_ASYNCIO = (
    "qemu.qmp.QMPClient",
    "qemu.qmp.qmp_client",
    "qemu.qmp.protocol",
    "qemu.qmp.events",
    "qemu.qmp.legacy",
)
IMAGES_HOST = [f for f in sources("images") if f.name != "kernel_server.py"]
THIRD_PARTY = {"trio", "attrs", "cattrs", "msgpack", "rich", "_typeshed", "typing_extensions"}


@pytest.mark.parametrize(
    ("what", "files", "allowed", "forbidden"),
    [
        ("guestd: stdlib + msgpack", sources("guestd"), {"guestd", "msgpack"}, ()),
        # (kernel_server.py is a guest program: it imports the code-interpreter image's jupyter_client)
        ("images: not the domain, not the edges", IMAGES_HOST, {"images", *THIRD_PARTY}, ()),
        (
            "actors: not the edges",
            sources("actors"),
            # h11, cryptography: the secret proxy's HTTP/1.1, CAs and vault; publicsuffixlist:
            # secret host patterns over a public suffix refused (docs/secrets.md); qemu.qmp: its
            # parts without I/O only (actors/machines/qmp.py), never its asyncio client
            {"actors", "guestd", "images", "h11", "cryptography", "publicsuffixlist", "qemu", *THIRD_PARTY},
            QEMU_QMP_ASYNCIO,
        ),
        (
            "the SDK: the wire (and guestd's tar codec), never the domain",
            [ROOT / f for f in SDK],
            {"supervisor", "guestd", *THIRD_PARTY},
            (*EDGES_ONLY, *GUESTD_NOT_SDK),
        ),
    ],
)
def test_layers_point_one_way(what: str, files: list[Path], allowed: set[str], forbidden: tuple[str, ...]) -> None:
    assert files
    assert wrong_arrows(files, allowed, forbidden) == [], what


def test_the_checker_sees_wrong_arrows(tmp_path: Path) -> None:
    bad = tmp_path / "probe.py"
    bad.write_text(
        "import os\ndef f():\n    from supervisor.wire.protocol import ApiError\n"
        "    from ..supervisor.serve import server\n"
    )
    found = wrong_arrows([bad], {"actors"}, package="actors")
    assert "probe.py imports supervisor.wire.protocol" in found and "probe.py imports supervisor.serve.server" in found
    assert not any("os" in x.split()[-1] for x in found)


def test_no_benchmark_script_shadows_a_package() -> None:
    """A script's own directory comes first on sys.path: benchmarks/images.py once hid
    the images package from every benchmark."""
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert not {p.stem for p in (ROOT / "benchmarks").glob("*.py")} & packages


def test_one_list_of_error_codes() -> None:
    """The error codes of sandbox.v1 are listed once (guestd/codes.py, stdlib only: the SDK may import
    it, the domain too); the domain and the SDK have one error class per code, and
    guestd's own Error codes are these names but for two of the guest's own."""
    from actors import errors as domain
    from guestd import codes, proto
    from supervisor.wire import errors as sdk

    names = {c.value for c in codes.Code}
    assert domain.Code is codes.Code and sdk.CODES == codes.CODES == names
    assert set(domain.BY_CODE) == names
    assert {c: type(sdk.error_for(c, "m")).__name__ for c in names} == {
        c: domain.BY_CODE[codes.Code(c)].__name__ for c in names
    }
    assert all(getattr(sdk, c) == c for c in names)
    guest = {v for k, v in vars(proto).items() if k.startswith("E_") and isinstance(v, str)}
    assert guest - names == {"IS_A_DIRECTORY", "TOO_LARGE"}


def test_importing_the_sdk_changes_no_environment_and_serve_turns_grpc_fork_support_off() -> None:
    """`import supervisor` (and the SDK, the CLI) leave os.environ alone; the modules of
    `serve` set GRPC_ENABLE_FORK_SUPPORT=0 (unless set) before grpc is first imported."""
    import os
    import subprocess

    script = """import os, sys
before = dict(os.environ)
import supervisor, supervisor.client, supervisor.main.cli
assert dict(os.environ) == before and "grpc" not in sys.modules
import supervisor.main.daemon
assert "grpc" in sys.modules
print(os.environ.get("GRPC_ENABLE_FORK_SUPPORT"))
"""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert (p.returncode, p.stdout) == (0, "0\n"), p.stderr


def one_letter_aliases(path: Path, root: Path = ROOT) -> list[str]:
    """Imports of a module (or function: a lowercase name) under a one-letter name, such
    as ``from supervisor import protocol as W``: a letter says nothing, and the same letter
    came to mean different modules in different files. Classes (``PatchEntry as E``) pass."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                name = a.name.rsplit(".", 1)[-1]
                if a.asname and len(a.asname) == 1 and not name[:1].isupper():
                    out.append(f"{path.relative_to(root)}: {name} as {a.asname}")
    return out


def test_no_module_goes_by_one_letter() -> None:
    found = {x for p in ("actors", "supervisor", "guestd", "images") for f in sources(p) for x in one_letter_aliases(f)}
    assert found == set()


def test_the_alias_check_sees_one_letter_names(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os.path as p\nfrom guestd import proto as P\nfrom guestd.patch import PatchEntry as E\n"
        "from supervisor.wire import protocol\ndef f():\n    from actors import defaults as D\n"
    )
    assert sorted(one_letter_aliases(probe, tmp_path)) == [
        "probe.py: defaults as D",
        "probe.py: path as p",
        "probe.py: proto as P",
    ]


TICKET_WORDS = re.compile(r"(?i)\bissue \d+|\bthe seed\b")


def ticket_words(path: Path, root: Path = ROOT) -> list[str]:
    """Comments and docstrings that name a ticket by its number, or the project's first
    brief, instead of saying what they mean (hibernation; the sandbox.v1 contract)."""
    src = path.read_text()
    docs = {
        (n.lineno, n.col_offset)
        for n in ast.walk(ast.parse(src, str(path)))
        if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
    }
    return [
        f"{path.relative_to(root)}:{t.start[0]}"
        for t in tokenize.generate_tokens(io.StringIO(src).readline)
        if (t.type == tokenize.COMMENT or (t.type == tokenize.STRING and t.start in docs))
        and TICKET_WORDS.search(t.string)
    ]


def test_comments_say_what_not_which_ticket() -> None:
    found = [
        x
        for p in ("actors", "supervisor", "guestd", "images", "benchmarks", "tests")
        for f in sources(p)
        if not f.name.endswith(("_pb2.py", "_pb2_grpc.py"))
        for x in ticket_words(f)
    ]
    assert found == []


def test_the_ticket_check_sees_comments_and_docstrings_only(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        '"""Pause (issue 25)."""\n'
        "x = 1  # as the seed says\n"
        'y = "issue 12 in a string is output, not a comment"\n'
        "def f():\n"
        '    """The seed\'s codes."""\n'
    )
    assert ticket_words(probe, tmp_path) == ["probe.py:1", "probe.py:2", "probe.py:5"]


# -- inside the domain: its folders, one way --------------------------------------------
#
# Each unit is a folder of actors/ or one of its top-level modules. The list runs from the
# bottom up: a unit imports only units listed before it (at any depth of its files:
# `TYPE_CHECKING` blocks and imports inside functions count). docs/architecture.md
# "The domain's folders" is this list, in words.
DOMAIN_LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("words", ("errors", "principals", "defaults", "_groups", "crash", "durable", "helpers")),
    ("secrets", ("secrets",)),  # the vault, CAs and the substitution proxy: they know no sandbox
    ("values", ("egress_policy", "model", "rules", "events", "store")),
    ("one VM", ("channel", "cells", "machines")),
    ("the host's network", ("net",)),
    (
        "settings and shared services",
        ("settings", "quotas", "volumes", "hostdirs", "hostcopy", "oci_images", "sandlog", "image_disks"),
    ),
    ("one sandbox", ("sandboxes",)),
    ("what outlives a life", ("snapshots",)),
    (
        "the registry and its services",
        (
            "modify_secrets",
            "modify",
            "create_checks",
            "listing",
            "recovery",
            "hibernation",
            "timers",
            "registry",
            "from_snapshot",
            "fork",
            "treediff",
            "forkpoint",
        ),
    ),
    ("the edges' face", ("face",)),  # what supervisor/ may use (tests/unit/test_edge_face.py)
    ("the package itself", ("actors",)),  # actors/__init__.py: nothing inside imports it
)
# Arrows allowed to point up the list, each with its reason: none today (the last ones went
# when the Sandbox actor became the only writer of its record). The test fails on any
# upward arrow not listed, and on an entry here that no longer exists.
KNOWN_DEBT: frozenset[tuple[str, str]] = frozenset()
# Circles of imports between files of one folder, each with its reason; none between folders.
CIRCLES_WITHIN_A_FOLDER: dict[frozenset[str], str] = {}


def domain_modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for f in sorted((root / "actors").rglob("*.py")):
        parts = f.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def module_imports(path: Path, known: dict[str, Path], root: Path = ROOT) -> set[str]:
    """The modules of ``known`` that ``path`` imports, at any depth of the file; ``from
    pkg import mod`` is the module, ``from mod import name`` the module."""
    parts = path.relative_to(root).with_suffix("").parts
    package = list(parts[:-1])
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = ".".join([*base, node.module] if node.module else base)
            for a in node.names:
                if f"{mod}.{a.name}" in known:
                    out.add(f"{mod}.{a.name}")
                elif mod in known:
                    out.add(mod)
    return out


def unit(module: str) -> str:
    """A module's unit: its folder under actors/, or a top-level module's own name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "actors"


def file_arrows(root: Path = ROOT) -> set[tuple[str, str]]:
    known = domain_modules(root)
    return {(m, t) for m, f in known.items() for t in module_imports(f, known, root) if t != m}


def folder_arrows(arrows: set[tuple[str, str]]) -> dict[tuple[str, str], list[str]]:
    out: dict[tuple[str, str], list[str]] = {}
    for a, b in sorted(arrows):
        if unit(a) != unit(b):
            out.setdefault((unit(a), unit(b)), []).append(f"{a} -> {b}")
    return out


def upward(
    arrows: dict[tuple[str, str], list[str]], layers: tuple[tuple[str, tuple[str, ...]], ...]
) -> set[tuple[str, str]]:
    rank = {u: i for i, u in enumerate(u for _, units in layers for u in units)}
    return {(a, b) for a, b in arrows if rank[b] >= rank[a]}


def circles(arrows: set[tuple[str, str]]) -> list[frozenset[str]]:
    """The circles of imports: the sets of modules each of which reaches every other."""
    graph: dict[str, set[str]] = {}
    for a, b in arrows:
        graph.setdefault(a, set()).add(b)

    def reach(v: str) -> set[str]:
        seen: set[str] = set()
        todo = [v]
        while todo:
            for w in graph.get(todo.pop(), ()):
                if w not in seen:
                    seen.add(w)
                    todo.append(w)
        return seen

    reached = {v: reach(v) for v in graph}
    found = {frozenset(w for w in r if v in reached.get(w, ())) for v, r in reached.items() if v in r}
    return sorted(found, key=sorted)


def test_every_domain_folder_has_its_place_in_the_layers() -> None:
    placed = [u for _, units in DOMAIN_LAYERS for u in units]
    assert len(placed) == len(set(placed))
    assert {unit(m) for m in domain_modules()} == set(placed)


def test_the_domain_folders_point_down_their_list() -> None:
    arrows = folder_arrows(file_arrows())
    up = upward(arrows, DOMAIN_LAYERS)
    assert {a: arrows[a] for a in up - KNOWN_DEBT} == {}, "an arrow points up the list of DOMAIN_LAYERS"
    assert up >= KNOWN_DEBT, f"gone, strike them from KNOWN_DEBT: {sorted(KNOWN_DEBT - up)}"


def test_import_circles_stay_inside_one_folder_with_a_reason() -> None:
    """Arrows of KNOWN_DEBT aside, every circle of imports lies within one folder and is
    listed, with its reason, in CIRCLES_WITHIN_A_FOLDER."""
    arrows = {(a, b) for a, b in file_arrows() if (unit(a), unit(b)) not in KNOWN_DEBT}
    found = set(circles(arrows))
    assert all(len({unit(m) for m in c}) == 1 for c in found), found
    assert found == set(CIRCLES_WITHIN_A_FOLDER)


def test_the_folder_check_sees_type_checking_and_function_imports(tmp_path: Path) -> None:
    for name, text in {
        "actors/__init__.py": "",
        "actors/model.py": "",
        "actors/net/__init__.py": "",
        "actors/net/egress.py": "from actors.model import X\n",
        "actors/cells/__init__.py": "",
        "actors/cells/cell.py": "import typing\nif typing.TYPE_CHECKING:\n    from actors.net import egress\n",
        "actors/cells/jail.py": "def f():\n    from ..model import Y\n    from . import cell\n",
    }.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    arrows = file_arrows(tmp_path)
    assert arrows == {
        ("actors.net.egress", "actors.model"),
        ("actors.cells.cell", "actors.net.egress"),
        ("actors.cells.jail", "actors.model"),
        ("actors.cells.jail", "actors.cells.cell"),
    }
    layers = (("values", ("model",)), ("vm", ("cells",)), ("net", ("net",)))
    assert upward(folder_arrows(arrows), layers) == {("cells", "net")}
    assert circles(arrows) == []
    assert circles(arrows | {("actors.model", "actors.cells.jail")}) == [
        frozenset({"actors.model", "actors.cells.jail", "actors.cells.cell", "actors.net.egress"})
    ]
