"""The edges meet the domain at one face, and the client does not lean on the server.

Read from the source with ast (every import: at the top, inside functions, under
``TYPE_CHECKING``):

* ``supervisor/`` imports of ``actors`` only :mod:`actors.face`, except the composition
  root, ``supervisor/main/``. The root is where the domain is built: the daemon makes
  the cells, host network, IP pool, quotas, vault, store and settings and hands them to
  the registry, and the ``sandvisor`` command reports why that failed (a cgroup, jail,
  QEMU or nft error). Those parts are the domain's interior; putting them on the face
  would give every edge the whole interior again, so the one module that assembles them
  may name them, and nothing else in ``supervisor/`` may.
* ``supervisor/`` shows its products: ``wire/`` (what both sides speak), ``client/``
  (the SDK and the CLI's client commands), ``serve/`` (what ``sandvisor serve`` serves)
  and ``main/`` (the composition root); nothing else sits at its top level.
* the wire imports neither side; the client imports nothing of the serve side or the
  root (an SDK user does not load the server); the serve side does not import the root.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

import actors.face

ROOT = Path(__file__).resolve().parents[2]
EDGES = ROOT / "supervisor"
PRODUCTS = ("wire", "client", "serve", "main")
COMPOSITION_ROOT = EDGES / "main"
FACE = "actors.face"


def imports(path: Path, root: Path = ROOT) -> set[str]:
    """Every module ``path`` imports, absolute, at any depth of the file (``from pkg
    import name`` counts as ``pkg`` and ``pkg.name``: the name may be a module)."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


def sources(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.py"))


def past_the_face(files: list[Path], root: Path = ROOT) -> list[str]:
    """Imports of ``actors`` modules other than the face (the bare package of a ``from
    actors import NAME`` is not one: NAME is checked as ``actors.NAME``)."""
    return [
        f"{f.relative_to(root)} imports {mod}"
        for f in files
        for mod in sorted(imports(f, root))
        if mod.startswith("actors.") and mod != FACE and not mod.startswith(FACE + ".")
    ]


def into(files: list[Path], forbidden: tuple[str, ...], root: Path = ROOT) -> list[str]:
    return [
        f"{f.relative_to(root)} imports {mod}"
        for f in files
        for mod in sorted(imports(f, root))
        if any(mod == p or mod.startswith(p + ".") for p in forbidden)
    ]


def test_the_edges_reach_the_domain_only_through_its_face() -> None:
    edges = [f for f in sources(EDGES) if COMPOSITION_ROOT not in f.parents]
    assert len(edges) > 50
    assert past_the_face(edges) == []


def test_the_face_names_only_what_it_has() -> None:
    missing = [n for n in actors.face.__all__ if not hasattr(actors.face, n)]
    assert missing == []
    assert len(set(actors.face.__all__)) == len(actors.face.__all__)


def test_supervisor_shows_its_products() -> None:
    top = sorted(p.name for p in EDGES.iterdir() if p.name != "__pycache__")
    assert top == sorted(["__init__.py", "py.typed", *PRODUCTS])
    for product in PRODUCTS:
        assert (EDGES / product / "__init__.py").is_file(), product


def test_every_package_is_in_the_wheel() -> None:
    """pyproject.toml lists the packages by hand: a folder missing there is missing from
    an installed sandvisor (not from an editable one, where every test would pass)."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for top in ("supervisor", "actors", "guestd", "images")
        for p in (ROOT / top).rglob("__init__.py")
    }
    assert sorted(found - listed) == []


@pytest.mark.parametrize(
    ("side", "forbidden"),
    [
        ("wire", ("supervisor.client", "supervisor.serve", "supervisor.main")),
        ("client", ("supervisor.serve", "supervisor.main")),
        ("serve", ("supervisor.main",)),
    ],
)
def test_each_side_imports_only_what_it_stands_on(side: str, forbidden: tuple[str, ...]) -> None:
    files = sources(EDGES / side)
    assert files
    assert into(files, forbidden) == []


def test_the_checks_see_imports_in_functions_and_under_type_checking(tmp_path: Path) -> None:
    probe_dir = tmp_path / "supervisor" / "serve"
    probe_dir.mkdir(parents=True)
    probe = probe_dir / "probe.py"
    probe.write_text(
        "from typing import TYPE_CHECKING\n"
        "from actors.face import Registry\n"
        "from actors import face\n"
        "if TYPE_CHECKING:\n"
        "    from actors.sandboxes.sandbox import Sandbox\n"
        "def f():\n"
        "    import actors.net.nft\n"
        "    from actors import defaults\n"
        "    from supervisor.main import daemon\n"
        "    from ..main import cli\n"
    )
    bad = past_the_face([probe], tmp_path)
    wrong = into([probe], ("supervisor.main",), tmp_path)
    for mod in ("actors.defaults", "actors.net.nft", "actors.sandboxes.sandbox"):
        assert f"supervisor/serve/probe.py imports {mod}" in bad
    assert not [b for b in bad if "actors.face" in b]
    assert "supervisor/serve/probe.py imports supervisor.main.daemon" in wrong
    assert "supervisor/serve/probe.py imports supervisor.main.cli" in wrong
