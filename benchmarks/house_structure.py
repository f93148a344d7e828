"""Structural counts of a source tree, read with ast (nothing of the tree is imported).

For each tree given (BEFORE AFTER, or one), counted the same way:

* file import circles in actors/: strongly connected components of more than one
  module, every import counted (module level, ``TYPE_CHECKING`` blocks, inside
  functions), and how many of them span more than one folder;
* folder arrows inside actors/ that point up the written layering: DOMAIN_LAYERS read
  from one tree's tests/unit/test_layers.py (``--layers``, default the last tree's),
  applied to every tree; units a tree has that the list does not place are named;
* ``if TYPE_CHECKING:`` blocks and imports inside functions, in actors/;
* the 5 largest modules and classes (lines) in actors/ supervisor/ guestd/ images/
  (generated protobuf modules left out);
* modules outside actors/sandboxes/sandbox.py (and the store, where the writers are
  defined) that assign a sandbox record's fields or call the store's record writers:
  the rule of tests/unit/test_one_writer.py, copied here so both trees are read alike;
* modules under supervisor/ importing an actors module other than the face
  (actors.face), and supervisor/'s top-level module count;
* call sites of ``<...>settings.limits(...)`` (defaults filled into a sandbox's limits);
* the types a Create's ``memory_mib`` passes through from the wire to QEMU's argv: a
  hand-written list (:data:`MEMORY_PATH`), read from each tree's code path.

Usage: python benchmarks/house_structure.py BEFORE_TREE AFTER_TREE [--layers FILE]
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path
from typing import Any

PACKAGES = ("actors", "supervisor", "guestd", "images")
OWNER = "actors/sandboxes/sandbox.py"
STORE = "actors/store.py"
ROOT_DIR = "supervisor/main/"  # the composition root (tests/unit/test_edge_face.py lets it build the domain)
WRITERS = frozenset({"insert", "update", "update_life", "update_tuning", "update_ports", "update_config", "rekey"})

# A Create's memory_mib from the socket to QEMU's command line, read from each tree's
# code (the SDK's ``Resources`` (client/sdk/spec.py) comes before the wire in both):
#  1. the frame's msgpack map, decoded into the wire message ``ResourceLimits``
#     (before: supervisor/messages/sandboxes.py; after: supervisor/wire/messages/sandboxes.py)
#  2. ``Limits`` as asked, in SandboxConfig.limits: mapping.config()
#     (before: supervisor/mapping.py; after: supervisor/serve/mapping.py; actors/model.py)
#  3. ``Limits`` resolved with serve's defaults once at Create (Settings.limits, before:
#     Registry.create; after: Registry._resolve_limits) and kept as Record.limits
#  4. an int: Life.boot_memory_mib (actors/sandboxes/life.py; the ceiling with a balloon)
#  5. ``MachineSpec.memory_mib`` (actors/machines/qemuspec.py) inside VmSpec
#     (actors/machines/vm.py, VmSpec.boot/of), rendered as ``-m NM`` and the memory
#     backend's ``size=NM``
MEMORY_PATH: dict[str, tuple[str, ...]] = {
    "before": ("ResourceLimits", "Limits", "MachineSpec"),
    "after": ("ResourceLimits", "Limits", "MachineSpec"),
}


def py_files(root: Path, package: str) -> list[Path]:
    return sorted(p for p in (root / package).rglob("*.py") if not p.name.endswith(("_pb2.py", "_pb2_grpc.py")))


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


# -- imports inside actors/ -------------------------------------------------------------


def domain_modules(root: Path) -> dict[str, Path]:
    out = {}
    for f in py_files(root, "actors"):
        parts = f.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def module_imports(root: Path, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that ``path`` imports at any depth (tests/unit/test_layers.py's rule)."""
    parts = path.relative_to(root).with_suffix("").parts
    package = list(parts[:-1])
    out: set[str] = set()
    for node in ast.walk(parse(path)):
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
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "actors"


def sccs(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, list[str]]] = [(start, sorted(graph.get(start, ())))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, todo = work[-1]
            if todo:
                w = todo.pop()
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, sorted(graph.get(w, ()))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(sorted(comp))
    return out


def read_layers(test_layers: Path) -> tuple[tuple[str, tuple[str, ...]], ...]:
    target: ast.expr
    value: ast.expr
    for node in parse(test_layers).body:
        if isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id == "DOMAIN_LAYERS":
            layers: tuple[tuple[str, tuple[str, ...]], ...] = ast.literal_eval(value)
            return layers
    raise SystemExit(f"no DOMAIN_LAYERS in {test_layers}")


def domain(root: Path, layers: tuple[tuple[str, tuple[str, ...]], ...]) -> dict[str, Any]:
    known = domain_modules(root)
    graph = {m: {t for t in module_imports(root, f, known) if t != m} for m, f in known.items()}
    circles = [c for c in sccs(graph) if len(c) > 1]
    rank = {u: i for i, u in enumerate(u for _, units in layers for u in units)}
    folder: dict[tuple[str, str], list[str]] = {}
    for a, targets in graph.items():
        for b in targets:
            if unit(a) != unit(b):
                folder.setdefault((unit(a), unit(b)), []).append(f"{a} -> {b}")
    units = {unit(m) for m in known}
    unplaced = sorted(units - set(rank))
    up = sorted((a, b) for a, b in folder if a in rank and b in rank and rank[b] >= rank[a])
    both_ways = sorted({tuple(sorted(p)) for p in folder if (p[1], p[0]) in folder})
    type_checking = function_imports = 0
    for f in known.values():
        tree = parse(f)
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
                type_checking += 1
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                function_imports += sum(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(node))
    return {
        "circles": circles,
        "circles_across_folders": [c for c in circles if len({unit(m) for m in c}) > 1],
        "folder_arrows": len(folder),
        "upward": up,
        "unplaced": unplaced,
        "unplaced_arrows": sorted(p for p in folder if p[0] in unplaced or p[1] in unplaced),
        "both_ways": both_ways,
        "type_checking": type_checking,
        "function_imports": function_imports,
    }


# -- sizes ------------------------------------------------------------------------------


def sizes(root: Path) -> dict[str, list[tuple[int, str]]]:
    modules: list[tuple[int, str]] = []
    classes: list[tuple[int, str]] = []
    for package in PACKAGES:
        for f in py_files(root, package):
            rel = str(f.relative_to(root))
            text = f.read_text()
            modules.append((len(text.splitlines()), rel))
            for node in ast.walk(ast.parse(text, rel)):
                if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                    classes.append((node.end_lineno - node.lineno + 1, f"{rel}:{node.name}"))
    return {
        "modules": sorted(modules, reverse=True)[:5],
        "classes": sorted(classes, reverse=True)[:5],
        "over_800": [m for m in sorted(modules, reverse=True) if m[0] > 800],
    }


# -- writers of the record (tests/unit/test_one_writer.py's rule) -----------------------


def _record_names(fn: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.arg) and node.annotation is not None and ast.unparse(node.annotation) == "Record":
            names.add(node.arg)
        elif (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and ast.unparse(node.annotation) == "Record"
        ):
            names.add(node.target.id)
    sources: set[str] = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign):
            text = ast.unparse(node.value)
            for t in node.targets:
                if not isinstance(t, ast.Name):
                    continue
                if isinstance(node.value, ast.Attribute) and node.value.attr == "record":
                    names.add(t.id)
                elif text.endswith("store.all()"):
                    sources.add(t.id)
    for node in ast.walk(fn):
        if isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)) and isinstance(node.target, ast.Name):
            it = node.iter
            if (isinstance(it, ast.Name) and it.id in sources) or ast.unparse(it).endswith("store.all()"):
                names.add(node.target.id)
    return names


def _is_record(expr: ast.AST, names: set[str]) -> bool:
    if isinstance(expr, ast.Attribute) and expr.attr == "record":
        return True
    return isinstance(expr, ast.Name) and expr.id in names


def record_writes(tree: ast.Module) -> list[int]:
    """Lines that assign a sandbox record's field or call a store writer with it."""
    defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    module = ast.Module(body=[n for n in tree.body if not isinstance(n, defs)], type_ignores=[])
    scopes: list[ast.AST] = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    found: set[int] = set()
    for scope in [*scopes, module]:
        names = _record_names(scope)
        body = scope.body if isinstance(scope, ast.Module) else [scope]
        for top in body:
            for node in ast.walk(top):
                targets: list[ast.expr] = []
                if isinstance(node, ast.Assign):
                    targets = list(node.targets)
                elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                    targets = [node.target]
                flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
                if isinstance(node, ast.stmt) and any(
                    isinstance(t, ast.Attribute) and _is_record(t.value, names) for t in flat
                ):
                    found.add(node.lineno)
                if not isinstance(node, ast.Call):
                    continue
                f = node.func
                setter = isinstance(f, ast.Name) and f.id in ("setattr", "delattr")
                if setter and node.args and _is_record(node.args[0], names):
                    found.add(node.lineno)
                if isinstance(f, ast.Attribute) and ast.unparse(f.value).endswith("store"):
                    arg = node.args[0] if node.args else None
                    mentions = arg is not None and (
                        _is_record(arg, names) or (isinstance(arg, ast.Attribute) and _is_record(arg.value, names))
                    )
                    if f.attr in WRITERS or (f.attr == "delete" and mentions):
                        found.add(node.lineno)
    return sorted(found)


def writers(root: Path) -> dict[str, int]:
    out = {}
    for f in py_files(root, "actors"):
        rel = str(f.relative_to(root))
        if rel in (OWNER, STORE):
            continue
        lines = record_writes(parse(f))
        if lines:
            out[rel] = len(lines)
    return out


# -- the edges --------------------------------------------------------------------------


def edges(root: Path) -> dict[str, Any]:
    past_face: dict[str, set[str]] = {}
    for f in py_files(root, "supervisor"):
        for node in ast.walk(parse(f)):
            mods: list[str] = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                mods = [node.module] if node.module != "actors" else [f"actors.{a.name}" for a in node.names]
            for m in mods:
                if m.split(".")[0] == "actors" and m != "actors.face" and not m.startswith("actors.face."):
                    past_face.setdefault(str(f.relative_to(root)), set()).add(m)
    limits_calls = 0
    for package in PACKAGES:
        for f in py_files(root, package):
            for node in ast.walk(parse(f)):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "limits"
                    and ast.unparse(node.func.value).endswith("settings")
                ):
                    limits_calls += 1
    return {
        "past_face": {k: sorted(v) for k, v in sorted(past_face.items())},
        "top_level": len(list((root / "supervisor").glob("*.py"))),
        "limits_calls": limits_calls,
    }


# -- the report -------------------------------------------------------------------------


def measure(root: Path, layers: tuple[tuple[str, tuple[str, ...]], ...]) -> dict[str, Any]:
    return {"domain": domain(root, layers), "sizes": sizes(root), "writers": writers(root), "edges": edges(root)}


def _sizes(items: list[tuple[int, str]]) -> str:
    return "<br>".join(f"{n} {name}" for n, name in items)


def table(results: dict[str, dict[str, Any]]) -> str:
    sides = list(results)
    rows = [
        "## House structure (ast; DOMAIN_LAYERS of the last tree applied to each)",
        "",
        f"| measure | {' | '.join(sides)} |",
        f"|---|{'---|' * len(sides)}",
    ]

    def row(label: str, fn: Any) -> None:
        rows.append(f"| {label} | {' | '.join(str(fn(results[s])) for s in sides)} |")

    def circle_text(r: dict[str, Any]) -> str:
        cs = r["domain"]["circles"]
        return f"{len(cs)} (sizes {sorted((len(c) for c in cs), reverse=True)})" if cs else "0"

    row("file import circles in actors/ (SCCs > 1 file)", circle_text)
    row("... spanning more than one folder", lambda r: len(r["domain"]["circles_across_folders"]))
    row("modules in circles", lambda r: sum(len(c) for c in r["domain"]["circles"]))
    row("folder arrows in actors/ (unit pairs)", lambda r: r["domain"]["folder_arrows"])
    row(
        "... pointing up the written layering",
        lambda r: (
            f"{len(r['domain']['upward'])}"
            + (f": {', '.join(f'{a}->{b}' for a, b in r['domain']['upward'])}" if r["domain"]["upward"] else "")
        ),
    )
    row("... folder pairs importing each other both ways", lambda r: len(r["domain"]["both_ways"]))
    row("units the layering does not place", lambda r: ", ".join(r["domain"]["unplaced"]) or "none")
    row("`if TYPE_CHECKING:` blocks in actors/", lambda r: r["domain"]["type_checking"])
    row("imports inside functions in actors/", lambda r: r["domain"]["function_imports"])
    row("5 largest modules (lines)", lambda r: _sizes(r["sizes"]["modules"]))
    row("5 largest classes (lines)", lambda r: _sizes(r["sizes"]["classes"]))
    row("modules over 800 lines", lambda r: len(r["sizes"]["over_800"]))
    row(
        "modules besides sandbox.py writing a sandbox record (writes)",
        lambda r: (
            f"{len(r['writers'])} ({sum(r['writers'].values())})"
            + (
                ": " + ", ".join(f"{k.removeprefix('actors/')} {v}" for k, v in r["writers"].items())
                if r["writers"]
                else ""
            )
        ),
    )
    row(
        "supervisor/ modules importing actors past the face (of them, composition root main/)",
        lambda r: f"{len(r['edges']['past_face'])} ({sum(k.startswith(ROOT_DIR) for k in r['edges']['past_face'])})",
    )
    row("supervisor/ top-level modules", lambda r: r["edges"]["top_level"])
    row("`settings.limits(...)` call sites (defaults filled in)", lambda r: r["edges"]["limits_calls"])
    row(
        "types memory_mib passes, wire to QEMU argv",
        lambda r: f"{len(r['memory'])}: {' -> '.join(r['memory'])}" if r.get("memory") else "?",
    )
    rows.append("")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trees", nargs="+", type=Path, help="BEFORE_TREE AFTER_TREE (or one tree)")
    ap.add_argument("--layers", type=Path, default=None, help="the test_layers.py whose DOMAIN_LAYERS to apply")
    a = ap.parse_args()
    layers = read_layers(a.layers or a.trees[-1] / "tests" / "unit" / "test_layers.py")
    names = ["before", "after"] if len(a.trees) == 2 else [str(t) for t in a.trees]
    results = {}
    for name, tree in zip(names, a.trees, strict=True):
        results[name] = measure(tree.resolve(), layers)
        results[name]["memory"] = MEMORY_PATH.get(name, ())
    print(table(results))


if __name__ == "__main__":
    main()
