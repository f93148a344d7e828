"""The SSH endpoint's pieces without a VM: key lines, usernames, the host key file, and
that its SFTP server replaces every method of asyncssh's that would touch host files."""

from __future__ import annotations

import asyncio
import inspect
import os
import subprocess
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import asyncssh
import pytest

from actors.model import SandboxConfig
from actors.modify import Modification, plan
from supervisor.client.sdk.sync import Sandbox
from supervisor.serve import mapping, ssh_gateway
from supervisor.serve.ssh_gateway import Budget, Refused, SandboxSFTP, Target, host_key, split_user
from supervisor.wire import protocol
from supervisor.wire.errors import NotFound
from supervisor.wire.ssh_keys import parse_keys

ED = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKqGvGvPRsXBzbK1bX1PG0S1Q8I1nQ2y7nq3VwWJ2kL4 me@host"


def _key(tmp_path: Path, name: str = "k") -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / name)], check=True)
    return (tmp_path / f"{name}.pub").read_text()


def test_parse_keys() -> None:
    assert parse_keys(f"# comment\n\n{ED}\n{ED} again\n") == (ED,)  # duplicates once, comments kept
    for bad in ("", "# only a comment", "ssh-ed25519", "ssh-dss AAAA", "ssh-ed25519 !!!", "ssh-rsa " + ED.split()[1]):
        with pytest.raises(ValueError):
            parse_keys(bad)
    with pytest.raises(ValueError, match="at most"):
        parse_keys("\n".join(f"{ED.rsplit(' ', 1)[0][:-4]}{i:04d} x" for i in range(40)))


def test_real_keys(tmp_path: Path) -> None:
    pub = _key(tmp_path)
    (key,) = parse_keys(pub)
    assert asyncssh.import_public_key(key).public_data == asyncssh.read_public_key(tmp_path / "k.pub").public_data


def test_create_and_modify_map_keys(tmp_path: Path) -> None:
    a, b = _key(tmp_path, "a").strip(), _key(tmp_path, "b").strip()
    cfg = mapping.config(protocol.CreateSandboxRequest(id="x", ssh_public_key=a))
    assert cfg.ssh_keys == (a,)
    with pytest.raises(Exception, match="no ssh public key"):
        mapping.config(protocol.CreateSandboxRequest(id="x", ssh_public_key=""))
    mod = mapping.modification(protocol.ModifyRequest(id="x", ssh_keys_add=[b]))
    after = plan(cfg, cfg.limits, mod, None, disk_mib=0).config
    assert after.ssh_keys == (a, b)
    after = plan(after, after.limits, Modification(ssh_keys_remove=(a,)), None, disk_mib=0).config
    assert after.ssh_keys == (b,)
    assert SandboxConfig(ssh_keys=(a,)).restored({}, 0).ssh_keys == ()  # a copy starts with none


def test_split_user() -> None:
    assert split_user("box") == ("box", "")
    assert split_user("box+nobody") == ("box", "nobody")
    assert split_user("a+b+") == ("a+b", "")


def test_host_key_made_once_private(tmp_path: Path) -> None:
    k1 = host_key(tmp_path)
    assert (tmp_path / "ssh_host_ed25519_key").stat().st_mode & 0o777 == 0o600
    assert host_key(tmp_path).public_data == k1.public_data
    os.chmod(tmp_path / "ssh_host_ed25519_key", 0o644)
    with pytest.raises(ValueError, match="0600"):
        host_key(tmp_path)


def test_sftp_touches_no_host_file() -> None:
    """Every request handler of asyncssh's SFTPServer is replaced (its defaults use the
    host's own files, as the endpoint's user)."""
    base = asyncssh.SFTPServer
    skip = {"channel", "connection", "env", "logger", "format_user", "format_group", "format_longname"}
    skip |= {"map_path", "reverse_map_path", "convert_attrs"}  # (not request handlers)
    handlers = [n for n, f in vars(base).items() if not n.startswith("_") and n not in skip and inspect.isfunction(f)]
    assert "open" in handlers and "scandir" in handlers
    missing = [n for n in handlers if vars(SandboxSFTP).get(n) is None]
    assert missing == []


def test_sandvisor_ssh_prints_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    from supervisor.main.cli import main

    argv = ["ssh", "box", "--at", "127.0.0.1:2200", "--user", "nobody", "-i", "k", "--print", "--", "ls", "-l"]
    assert main(argv) == 0
    out = capsys.readouterr().out.strip()
    assert out == "ssh -p 2200 -o HostKeyAlias=sandvisor-127.0.0.1-2200 -i k box+nobody@127.0.0.1 -- 'ls -l'"


class _Gateway:
    def __init__(self, budget: int) -> None:
        self.sessions = Budget(2)
        self.budget = Budget(budget)


class _StubTarget(Target):
    """A Target whose calls run ``fn`` on a stub sandbox (no supervisor)."""

    def __init__(self, gateway: Any, sb: Any, uid: str = "u1", key: bytes = b"") -> None:
        super().__init__(gateway, "box", "alice", "", uid)
        self.key = key
        self.stub = sb

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        return fn(self.stub)


class _Fs:
    def __init__(self, size: int) -> None:
        self.size = size

    def stat(self, path: str) -> protocol.FsEntry:
        return protocol.FsEntry(name=path, path=path, kind="file", size=self.size, mode=0o644)


class _Sb:
    def __init__(self, size: int) -> None:
        self.fs = _Fs(size)


def _sftp(gateway: _Gateway, size: int = 0) -> SandboxSFTP:
    s = SandboxSFTP.__new__(SandboxSFTP)  # (no channel: the file methods only)
    s.t = _StubTarget(gateway, _Sb(size))
    s.slot, s.files = False, set()
    return s


def test_sftp_budget_is_gateway_wide(monkeypatch: pytest.MonkeyPatch) -> None:
    """Open files hold bytes of one budget over all channels: an open or a write past it
    is an SFTP failure, a close or the channel's end gives them back."""
    monkeypatch.setattr(ssh_gateway, "read_capped", lambda sb, p, cap: b"x" * min(sb.fs.size, cap))
    g = _Gateway(budget=1000)
    a, b = _sftp(g, size=600), _sftp(g, size=600)
    w = asyncssh.FXF_WRITE

    async def main() -> None:
        f = await a.open(b"/f", asyncssh.FXF_READ, asyncssh.SFTPAttrs())
        assert g.budget.used == 600 and a.read(f, 0, 10) == b"x" * 10
        with pytest.raises(asyncssh.SFTPFailure, match="full"):  # another channel: past the budget
            await b.open(b"/f", asyncssh.FXF_READ, asyncssh.SFTPAttrs())
        assert g.budget.used == 600
        h = await b.open(b"/new", w | asyncssh.FXF_CREAT | asyncssh.FXF_TRUNC, asyncssh.SFTPAttrs())
        assert b.write(h, 0, b"y" * 300) == 300 and g.budget.used == 900
        with pytest.raises(asyncssh.SFTPFailure, match="full"):  # a far offset zero-fills: refused
            b.write(h, 999, b"z")
        assert g.budget.used == 900 and len(h.data) == 300
        await a.close(f)
        assert g.budget.used == 300
        b.release()  # the channel's end
        assert g.budget.used == 0 and not b.files

    asyncio.run(main())


def test_sftp_read_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A file that grew after its stat is cut off at the cap, not read whole."""
    sent: list[int] = []

    def chunks(socket: Any, plan: Any) -> Any:
        plan.close()
        for _ in range(100):
            sent.append(1)
            yield protocol.FileChunk(data=b"a" * 100)

    monkeypatch.setattr(ssh_gateway, "drive_stream", chunks)
    sb = Sandbox("box", socket="/nonexistent")
    with pytest.raises(asyncssh.SFTPFailure, match="larger"):
        ssh_gateway.read_capped(sb, "/f", 250)
    assert len(sent) == 3
    assert ssh_gateway.read_capped(sb, "/f", 100_000) == b"a" * 10_000


def test_recheck_refuses_a_removed_key_or_a_new_sandbox(tmp_path: Path) -> None:
    """Each new channel asks again: the same sandbox (uid) as its owner sees it, the key
    that logged in still listed."""
    k1, k2 = _key(tmp_path, "a").strip(), _key(tmp_path, "b").strip()
    blob = asyncssh.import_public_key(k1).public_data

    class Sb:
        def __init__(self, info: Any) -> None:
            self.info = info

        def inspect(self) -> Any:
            if self.info is None:
                raise NotFound("NOT_FOUND", "no sandbox box")
            return self.info

    def check(info: Any, key: bytes = blob) -> None:
        asyncio.run(_StubTarget(_Gateway(0), Sb(info), uid="u1", key=key).recheck())

    def Info(uid: str, ssh_keys: list[str]) -> Any:  # (what recheck reads of an Inspect)
        return types.SimpleNamespace(id="box", uid=uid, ssh_keys=ssh_keys)

    check(Info(uid="u1", ssh_keys=[k2, k1]))
    for info, key in [
        (Info(uid="u1", ssh_keys=[k2]), blob),  # key removed
        (Info(uid="u2", ssh_keys=[k1]), blob),  # made again under the name
        (None, blob),  # gone, or not the owner's any more
        (Info(uid="u1", ssh_keys=[k1]), b""),  # no key recorded
    ]:
        with pytest.raises(Refused):
            check(info, key)
