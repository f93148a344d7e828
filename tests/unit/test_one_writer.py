"""One writer of a sandbox's record: the Sandbox actor (actors/sandboxes/sandbox.py).

Its life, hibernation, Modify, the pools and the registry ask it (methods whose
names say what changes); none of them assigns a field of a sandbox's record or
writes one to the store. Read from the source (ast): a module outside the owner
that assigns ``x.record.field``, ``rec.field`` (``rec`` a record) or calls one of
the store's sandbox-record writers fails here, with the lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ACTORS = ROOT / "actors"
OWNER = ACTORS / "sandboxes" / "sandbox.py"
STORE = ACTORS / "store.py"  # (where the writers are defined)
# the Store's writers of the sandboxes table
WRITERS = frozenset({"insert", "update", "update_life", "update_tuning", "update_ports", "update_config", "rekey"})


def _record_names(fn: ast.AST) -> set[str]:
    """Names bound in ``fn`` to a sandbox record: parameters annotated ``Record``,
    names assigned from ``<x>.record`` or ``<store>.all()``, and loop variables over
    those."""
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


def _scopes(tree: ast.Module) -> list[ast.AST]:
    """Each function (with its own names), and the module's statements outside them."""
    defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    top = ast.Module(body=[n for n in tree.body if not isinstance(n, defs)], type_ignores=[])
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))] + [top]


def record_writes(source: str) -> list[str]:
    """``line: code`` of each record field assignment or store write in ``source``."""
    tree = ast.parse(source)
    found: dict[int, str] = {}
    for scope in _scopes(tree):
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
                    found[node.lineno] = ast.unparse(node)
                if not isinstance(node, ast.Call):
                    continue
                f = node.func
                setter = isinstance(f, ast.Name) and f.id in ("setattr", "delattr")
                if setter and node.args and _is_record(node.args[0], names):
                    found[node.lineno] = ast.unparse(node)
                if isinstance(f, ast.Attribute) and ast.unparse(f.value).endswith("store"):
                    arg = node.args[0] if node.args else None
                    mentions = arg is not None and (
                        _is_record(arg, names) or (isinstance(arg, ast.Attribute) and _is_record(arg.value, names))
                    )
                    if f.attr in WRITERS or (f.attr == "delete" and mentions):
                        found[node.lineno] = ast.unparse(node)
    return [f"{line}: {code}" for line, code in sorted(found.items())]


def test_only_the_sandbox_writes_its_record() -> None:
    offenders = {}
    for path in sorted(ACTORS.rglob("*.py")):
        if path in (OWNER, STORE):
            continue
        lines = record_writes(path.read_text())
        if lines:
            offenders[str(path.relative_to(ROOT))] = lines
    assert not offenders, (
        "only actors/sandboxes/sandbox.py assigns a sandbox record's fields or stores it; "
        f"ask the Sandbox (a method that says what changes) instead: {offenders}"
    )


def test_the_owner_does_write_it() -> None:
    """The check sees the owner's own writes (it is not blind)."""
    assert len(record_writes(OWNER.read_text())) >= 10


def test_the_check_catches_each_shape() -> None:
    src = """
def a(sb):
    sb.record.state = 1
def b(sb):
    rec = sb.record
    rec.chain, rec.swap = [], ""
def c(rec: Record):
    rec.error += "x"
def d(self):
    for rec in self.store.all():
        rec.qemu_pid = 0
def e(sb, store):
    store.update_life(sb.record)
    sb.store.delete(sb.record.uid)
    setattr(sb.record, "life", None)
def fine(snap, leases, rec_of_snapshot):
    snap.owner = "x"          # a snapshot's record: not a sandbox's
    leases.store.delete(owner) # an IP lease
    x = sb.record.state        # a read
"""
    got = [line.split(":")[0] for line in record_writes(src)]
    assert got == ["3", "6", "8", "11", "13", "14", "15"], got
