"""Sync SDK: a small tree search from one prepared state, with fork (docs/fork.md).

A sandbox is prepared once: a module with a bug and the tests it fails. Each candidate
fix is tried in a fork of it (the children start from that state, and what one writes
the others never see); the best-scoring child is forked again for a second round of
fixes; the best leaf wins. The family is printed before one remove (with its
descendants) cleans everything up. Run with `sandvisor serve` running
(SANDVISOR_SOCKET points at it if not default).
"""

from supervisor.client import Sandbox

BUGGY = "def median(xs):\n    xs = sorted(xs)\n    return xs[len(xs) // 2]\n"
TESTS = """
import median
cases = [([3, 1, 2], 2), ([4, 1, 3, 2], 2.5), ([5], 5), ([1, 1, 2, 2], 1.5)]
ok = 0
for xs, want in cases:
    try:
        ok += median.median(xs) == want
    except Exception:
        pass
try:
    median.median([])
except ValueError:
    ok += 1
except Exception:
    pass
print(ok, "of", len(cases) + 1)
"""
# first round: whole bodies; second round: refinements of the best
ROUND_1 = {
    "lower": "    return xs[len(xs) // 2 - 1]\n",
    "mean-of-two": "    n = len(xs)\n    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2\n",
    "mean": "    return sum(xs) / len(xs)\n",
}
ROUND_2 = {
    "empty-check": "    if not xs:\n        raise ValueError('empty')\n",
    "no-check": "",
}


def score(sb: Sandbox) -> int:
    r = sb.run(["sh", "-c", "cd /work && python3 tests.py"], timeout=60)
    return int(r.stdout.split()[0]) if r.exit_code == 0 and r.stdout else 0


def with_fix(guard: str, body: str) -> bytes:
    return ("def median(xs):\n    xs = sorted(xs)\n" + guard + body).encode()


def main() -> None:
    base = Sandbox.create("search-base", labels={"example": "fork-search"}, detached=True)
    try:
        base.fs.mkdir("/work", parents=True)
        base.fs.write("/work/median.py", BUGGY.encode())
        base.fs.write("/work/tests.py", TESTS.encode())
        print("base:", score(base), "points")

        kids = base.fork(len(ROUND_1), names=[f"search-{n}" for n in ROUND_1])
        points = {}
        for (name, body), kid in zip(ROUND_1.items(), kids, strict=True):
            kid.fs.write("/work/median.py", with_fix("", body))
            points[name] = score(kid)
            print(f"  {kid.id}: {points[name]} points")
        best_name = max(points, key=lambda n: points[n])
        best = kids[list(ROUND_1).index(best_name)]

        grandkids = best.fork(len(ROUND_2), names=[f"{best.id}-{n}" for n in ROUND_2])
        leaves = {}
        for guard, kid in zip(ROUND_2.values(), grandkids, strict=True):
            kid.fs.write("/work/median.py", with_fix(guard, ROUND_1[best_name]))
            leaves[kid.id] = score(kid)
            print(f"    {kid.id}: {leaves[kid.id]} points")
        winner = max(leaves, key=lambda n: leaves[n])
        print("best:", winner, leaves[winner], "points")
        print(Sandbox(winner).fs.read("/work/median.py").decode())
        family = Sandbox.list(labels={"example": "fork-search"}, limit=100).sandboxes
        by_uid = {s.uid: s.id for s in family}
        for s in sorted(family, key=lambda s: s.created_at):
            print(f"{s.id:32} {s.state:8} forked from {by_uid.get(s.parent_uid, '-')}")
    finally:
        base.remove(force=True, with_descendants=True)


if __name__ == "__main__":
    main()
