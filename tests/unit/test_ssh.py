"""The SSH endpoint's pieces without a VM: key lines, usernames, the host key file, and
that its SFTP server replaces every method of asyncssh's that would touch host files."""

from __future__ import annotations

import inspect
import os
import subprocess
from pathlib import Path

import asyncssh
import pytest

from actors.model import SandboxConfig
from actors.modify import Modification, plan
from supervisor import mapping, protocol
from supervisor.ssh_gateway import SandboxSFTP, host_key, split_user
from supervisor.ssh_keys import parse_keys

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
    from supervisor.cli import main

    argv = ["ssh", "box", "--at", "127.0.0.1:2200", "--user", "nobody", "-i", "k", "--print", "--", "ls", "-l"]
    assert main(argv) == 0
    out = capsys.readouterr().out.strip()
    assert out == "ssh -p 2200 -o HostKeyAlias=sandvisor-127.0.0.1-2200 -i k box+nobody@127.0.0.1 -- 'ls -l'"
