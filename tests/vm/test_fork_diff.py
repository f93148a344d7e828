"""What a branch changed, against a real `sandvisor serve` and real VMs (docs/fork.md): a
sandbox forked twice, files written, modified, removed and chmod-ed in one child; the
diff (SDK and CLI) reports exactly those, each guest asked only about its own tree."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from images.build import Image
from supervisor.client import Sandbox
from supervisor.main.throwaway import supervisor_process, workdir
from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2 as sv
from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2_grpc as sv_grpc


@pytest.fixture(scope="module")
def family(image: Image) -> Iterator[dict[str, Any]]:
    with (
        workdir("sv-fdiff-", private_state=False) as work,
        supervisor_process(work, "--grpc", f"unix://{work.root / 'g.sock'}") as (env, _),
    ):
        sock = str(work.socket)
        parent = Sandbox.create("dp", socket=sock, detached=True)
        parent.run(["sh", "-c", "mkdir -p /srv/w/sub && echo keep > /srv/w/keep && echo old > /srv/w/edit"])
        parent.run(["sh", "-c", "echo bye > /srv/w/gone && echo m > /srv/w/sub/mode && sync"])
        a, b = parent.fork(2, name_prefix="dk-")
        a.run(["sh", "-c", "echo new > /srv/w/sub/added && echo neu > /srv/w/edit && rm /srv/w/gone"])
        a.run(["sh", "-c", "chmod 600 /srv/w/sub/mode && sync"])
        yield {"env": env, "parent": parent, "a": a, "b": b, "grpc": f"unix:{work.root / 'g.sock'}"}


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor.main.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_the_diff_reports_exactly_what_one_child_changed(family: dict[str, Any]) -> None:
    b, a = family["b"], family["a"]
    changes = {c.path: c for c in b.diff(a, "/srv/w")}
    assert {p: c.change for p, c in changes.items()} == {
        "sub/added": "added",
        "gone": "removed",
        "edit": "modified",
        "sub/mode": "modified",
    }
    edit, mode = changes["edit"], changes["sub/mode"]
    assert (edit.size_a, edit.size_b) == (4, 4) and edit.hash_a != edit.hash_b and edit.kind_b == "file"
    assert (mode.mode_a, mode.mode_b) == (0o644, 0o600) and mode.hash_a == mode.hash_b
    assert changes["sub/added"].hash_b and not changes["sub/added"].kind_a
    # the parent and the untouched sibling: nothing
    assert family["parent"].diff(b, "/srv/w") == []


def test_the_cli_diffs_two_sandboxes_and_shows_both_sides_of_a_file(family: dict[str, Any]) -> None:
    env = family["env"]
    r = cli(env, "diff", "dk-2", "dk-1", "--path", "/srv/w")
    assert r.returncode == 1, r
    got = sorted(line.split()[0] + " " + line.split()[1] for line in r.stdout.splitlines())
    assert got == ["A sub/added", "D gone", "M edit", "M sub/mode"], r.stdout
    js = json.loads(cli(env, "diff", "dk-2", "dk-1", "--path", "/srv/w", "--json").stdout)
    assert len(js["changes"]) == 4 and js["entries_a"] > 0
    c = cli(env, "diff", "dk-2", "dk-1", "--content", "/srv/w/edit")
    assert c.returncode == 0 and "-old" in c.stdout and "+neu" in c.stdout, c
    same = cli(env, "diff", "dp", "dk-2", "--path", "/srv/w")
    assert same.returncode == 0 and same.stdout == ""
    alone = cli(env, "diff", "dk-1")
    assert alone.returncode == 2 and "--fork-point" in alone.stdout  # (one of OTHER, --fork-point, --snapshot)


def test_a_diff_of_a_missing_directory_is_a_typed_error(family: dict[str, Any]) -> None:
    from supervisor.client import NotFound

    with pytest.raises(NotFound):
        family["a"].diff(family["b"], "/srv/nowhere")


def test_metrics_carry_memory_per_branch(family: dict[str, Any]) -> None:
    """A child's QEMU maps the family's memory file: most of what it holds is shared."""
    m = family["b"].metrics()
    assert m.memory_shared_bytes > 16 << 20 and m.memory_own_bytes > 0, m
    assert m.memory_shared_bytes + m.memory_own_bytes <= m.host_rss_bytes + (4 << 20)


def test_sandvisor_v1_diff_answers_the_same(family: dict[str, Any]) -> None:
    """The real gRPC client: sandvisor.v1's Diff, and the metrics' memory per branch."""
    with grpc.insecure_channel(family["grpc"]) as ch:
        stub = sv_grpc.SandvisorServiceStub(ch)
        r = stub.Diff(sv.DiffRequest(id="dk-2", other="dk-1", path="/srv/w"), timeout=120)
        assert sorted((c.path, c.change) for c in r.changes) == [
            ("edit", "modified"),
            ("gone", "removed"),
            ("sub/added", "added"),
            ("sub/mode", "modified"),
        ]
        assert r.entries_a == r.entries_b == 6  # (".", sub, keep, edit, sub/mode and one more each)
        assert stub.Metrics(sv.MetricsRequest(id="dk-1"), timeout=60).memory_shared_bytes > 16 << 20
        with pytest.raises(grpc.RpcError) as err:
            stub.Diff(sv.DiffRequest(id="dk-2", other="nobody", path="/srv/w"), timeout=60)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
