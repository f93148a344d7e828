"""The workload shape's plumbing (no VM): the initial workload an image's ENTRYPOINT and
CMD make with a Create's own, the SDK's settings through both wires into the domain's
configuration and its rules, the CLI's flags, copy patches read on the host (and what
they refuse), guestd's side of the shape, and the supervisor's per-sandbox log filter.
The guest's behaviour is tests/vm/test_workload_shape.py's."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import attrs
import msgpack
import pytest

from actors import hostcopy, sandlog
from actors.errors import InvalidArgument, NotFound, PermissionDenied
from actors.model import ImageUse, SandboxConfig
from actors.rules import check_config
from actors.sandboxes.workload import initial_argv
from guestd import proto, shape
from guestd.common import ExecFailed
from guestd.patch import Patch
from supervisor.client.cli_sandboxes import shape_settings
from supervisor.client.sdk.spec import SandboxSpec
from supervisor.main.cli import build_parser
from supervisor.serve import mapping
from supervisor.serve.grpc_convert import message_to_dict
from supervisor.serve.grpc_service import _sandvisor_create
from supervisor.wire import protocol
from supervisor.wire.proto.sandvisor.v1 import sandvisor_pb2

IMG = ImageUse(
    ref="x",
    digest="d",
    template_key="k",
    rootfs="/r",
    argv=("/bin/echo", "ep", "image-cmd"),
    entrypoint=("/bin/echo", "ep"),
)


@pytest.mark.parametrize(
    ("cmd", "entrypoint", "cleared", "argv"),
    [
        ((), None, False, ("/bin/echo", "ep", "image-cmd")),  # the image's
        (("a",), None, False, ("/bin/echo", "ep", "a")),  # cmd replaces CMD
        ((), None, True, ("/bin/echo", "ep")),  # CMD cleared
        ((), ("/bin/true",), False, ("/bin/true",)),  # own ENTRYPOINT: CMD dropped with it
        (("x",), ("/bin/echo",), False, ("/bin/echo", "x")),
        (("/bin/sh",), (), False, ("/bin/sh",)),  # ENTRYPOINT cleared
        ((), (), True, ()),  # nothing runs
    ],
)
def test_initial_workload_of_an_image(
    cmd: tuple[str, ...], entrypoint: tuple[str, ...] | None, cleared: bool, argv: tuple[str, ...]
) -> None:
    assert initial_argv(IMG, cmd, entrypoint, cleared) == argv


def test_initial_workload_without_an_image() -> None:
    assert initial_argv(None, ("a",), ("/bin/echo",), False) == ("/bin/echo", "a")
    assert initial_argv(None, (), None, True) == ()


def _config(spec: SandboxSpec) -> SandboxConfig:
    """The SDK's spec over the msgpack wire into the domain's configuration."""
    req = spec.request("s")
    raw = msgpack.unpackb(msgpack.packb(protocol.unstructure_body(req)), raw=False)
    back = protocol.structure_body(raw, protocol.CreateSandboxRequest)
    assert back == req
    return mapping.config(back)


def test_sdk_settings_reach_the_configuration() -> None:
    spec = SandboxSpec().with_(
        entrypoint=["/bin/app", "--serve"],
        shell="/bin/bash",
        security_profile="restricted",
        log_level="warn",
        quiet_logs=True,
        thp="never",
    )
    c = _config(spec)
    assert (c.entrypoint, c.cmd_cleared, c.shell) == (("/bin/app", "--serve"), False, "/bin/bash")
    assert (c.security_profile, c.log_level, c.quiet_logs, c.thp) == ("restricted", "warn", True, "never")
    check_config(c)
    # not given / given empty: the image's ENTRYPOINT and CMD, or none
    assert _config(SandboxSpec()).entrypoint is None and not _config(SandboxSpec()).cmd_cleared
    cleared = _config(SandboxSpec().with_(cmd=[], entrypoint=[]))
    assert (cleared.entrypoint, cleared.cmd_cleared, cleared.workload.cmd) == ((), True, ())
    # a later cmd undoes the clearing; "default" is the default profile
    again = SandboxSpec().with_(cmd=[]).with_(cmd=["a"], security_profile="default")
    assert (_config(again).cmd_cleared, _config(again).security_profile) == (False, "")
    with pytest.raises(TypeError):
        SandboxSpec().with_(entrypoint="/bin/app")


def test_grpc_create_says_empty_entrypoint_apart_from_none() -> None:
    def config(msg: sandvisor_pb2.CreateRequest) -> SandboxConfig:
        d = _sandvisor_create(message_to_dict(msg))  # (what the gRPC edge does)
        return mapping.config(protocol.structure_body(d, protocol.CreateSandboxRequest))

    none = config(sandvisor_pb2.CreateRequest(thp="madvise", shell="/bin/zsh", cmd_cleared=True))
    assert (none.entrypoint, none.thp, none.shell, none.cmd_cleared) == (None, "madvise", "/bin/zsh", True)
    assert config(sandvisor_pb2.CreateRequest(entrypoint_cleared=True)).entrypoint == ()
    own = config(sandvisor_pb2.CreateRequest(entrypoint=["/x", "y"], security_profile="restricted", log_level="off"))
    assert (own.entrypoint, own.security_profile, own.log_level) == (("/x", "y"), "restricted", "off")


@pytest.mark.parametrize(
    "change",
    [
        {"security_profile": "lax"},
        {"log_level": "loud"},
        {"thp": "sometimes"},
        {"entrypoint": ("",)},
        {"shell": "/bin/\0sh"},
        {"cmd_cleared": True, "workload": attrs.evolve(SandboxConfig().workload, cmd=("a",))},
        {"patches": (Patch.copy_file("relative", "/x"),)},
        {"patches": (Patch.copy_file("/a/../b", "/x"),)},
        {"patches": (Patch("file", "/x", source="/a"),)},  # a source is for the copy ops
        {"patches": (Patch("copy_dir", "/x"),)},  # which need one
    ],
)
def test_bad_shape_is_invalid_argument(change: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument):
        check_config(attrs.evolve(SandboxConfig(), **change))


def _cli(*argv: str) -> dict[str, object]:
    args = build_parser("create").parse_args(["create", "n", *argv])
    args.cmd = []
    return dict(shape_settings(args))


def test_cli_flags(tmp_path: Path) -> None:
    assert _cli() == {}  # no command: the image's, not a cleared one
    assert _cli("--no-cmd", "--entrypoint", "") == {"cmd": [], "entrypoint": []}
    got = _cli(
        "--entrypoint",
        "/bin/app 'two words'",
        "--shell",
        "/bin/bash",
        "--security-profile",
        "restricted",
        "--log-level",
        "error",
        "--quiet-logs",
        "--thp",
        "never",
        "--copy-file",
        f"{tmp_path}/f:/etc/f",
        "--copy-dir",
        f"{tmp_path}/d:/srv/d",
    )
    assert got == {
        "entrypoint": ["/bin/app", "two words"],
        "shell": "/bin/bash",
        "security_profile": "restricted",
        "log_level": "error",
        "quiet_logs": True,
        "thp": "never",
        "patches": [Patch.copy_file(f"{tmp_path}/f", "/etc/f"), Patch.copy_dir(f"{tmp_path}/d", "/srv/d")],
    }


# --- copy patches ---------------------------------------------------------------------------
@pytest.fixture
def allowed(tmp_path: Path) -> Path:
    root = tmp_path / "allowed"
    (root / "tree" / "sub").mkdir(parents=True)
    (root / "tree" / "top.txt").write_text("top")
    (root / "tree" / "sub" / "x.sh").write_text("#!/bin/sh\n")
    (root / "tree" / "sub" / "x.sh").chmod(0o4755)  # a set-id bit does not travel
    (root / "tree" / "rel").symlink_to("top.txt")
    (root / "tree" / "abs").symlink_to("/etc/shadow")  # copied as a link: never read
    (root / "file").write_bytes(b"\x00data")
    (root / "file").chmod(0o604)
    return root


def test_copy_patches_expand_to_files_directories_and_links(allowed: Path) -> None:
    keep = Patch.mkdir("/opt")
    got = hostcopy.expand(
        [
            keep,
            Patch.copy_file(str(allowed / "file"), "/etc/f", replace=True),
            Patch.copy_dir(str(allowed / "tree"), "/srv/t"),
        ],
        (allowed,),
    )
    assert got == (
        keep,
        Patch("file", "/etc/f", b"\x00data", mode=0o604, replace=True),
        Patch("mkdir", "/srv/t", mode=(allowed / "tree").stat().st_mode & 0o777),
        Patch("symlink", "/srv/t/abs", target="/etc/shadow"),
        Patch("symlink", "/srv/t/rel", target="top.txt"),
        Patch("mkdir", "/srv/t/sub", mode=(allowed / "tree" / "sub").stat().st_mode & 0o777),
        Patch("file", "/srv/t/sub/x.sh", b"#!/bin/sh\n", mode=0o755),
        Patch("file", "/srv/t/top.txt", b"top", mode=(allowed / "tree" / "top.txt").stat().st_mode & 0o777),
    )
    # a mode given wins over the host file's
    assert hostcopy.expand([Patch.copy_file(str(allowed / "file"), "/f", mode=0o600)], (allowed,))[0].mode == 0o600


def test_copy_patches_refuse(allowed: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("no")
    (allowed / "escape").symlink_to(outside)  # a directory link out of the allowed one
    os.mkfifo(allowed / "fifo")
    (allowed / "big").write_bytes(b"x" * (hostcopy.MAX_COPY_FILE + 1))

    def expand(p: Patch) -> None:
        hostcopy.expand([p], (allowed,))

    with pytest.raises(PermissionDenied):
        expand(Patch.copy_file(str(outside / "secret"), "/x"))
    with pytest.raises(PermissionDenied):
        expand(Patch.copy_dir(str(allowed), "/x"))  # the allowed directory itself: not a path in it
    with pytest.raises(InvalidArgument, match="symlink"):
        expand(Patch.copy_file(str(allowed / "escape" / "secret"), "/x"))
    with pytest.raises(InvalidArgument, match="symlink"):
        expand(Patch.copy_dir(str(allowed / "escape"), "/x"))
    with pytest.raises(InvalidArgument):
        expand(Patch.copy_file(str(allowed / "tree" / "rel"), "/x"))  # the link itself is no file
    with pytest.raises(InvalidArgument, match="regular"):
        expand(Patch.copy_file(str(allowed / "fifo"), "/x"))
    with pytest.raises(InvalidArgument, match="at most"):
        expand(Patch.copy_file(str(allowed / "big"), "/x"))
    with pytest.raises(NotFound):
        expand(Patch.copy_file(str(allowed / "nothing"), "/x"))
    # only what every local user may read: the supervisor reads as root for its caller
    (allowed / "private").write_text("mine")
    (allowed / "private").chmod(0o600)
    with pytest.raises(PermissionDenied, match="readable by others"):
        expand(Patch.copy_file(str(allowed / "private"), "/x"))
    (allowed / "closed" / "in").mkdir(parents=True)
    (allowed / "closed" / "in" / "f").write_text("f")
    (allowed / "closed").chmod(0o700)
    with pytest.raises(PermissionDenied, match="readable by others"):
        expand(Patch.copy_file(str(allowed / "closed" / "in" / "f"), "/x"))
    with pytest.raises(PermissionDenied, match="readable by others"):
        expand(Patch.copy_dir(str(allowed / "closed"), "/x"))
    with pytest.raises(InvalidArgument, match=r"not a directory|symlink"):
        expand(Patch.copy_dir(str(allowed / "file"), "/x"))
    (allowed / "big").unlink()
    (allowed / "tree2").mkdir()
    os.mkfifo(allowed / "tree2" / "p")
    with pytest.raises(InvalidArgument, match="regular"):
        expand(Patch.copy_dir(str(allowed / "tree2"), "/x"))


def test_copy_patches_are_bounded(allowed: Path) -> None:
    many = allowed / "many"
    many.mkdir()
    for i in range(6):
        (many / f"f{i}").write_bytes(b"y" * (hostcopy.MAX_COPY_FILE - 10))
    with pytest.raises(InvalidArgument, match="MiB"):
        hostcopy.expand([Patch.copy_dir(str(many), "/x")], (allowed,))
    wide = allowed / "wide"
    wide.mkdir()
    for i in range(1001):
        (wide / f"e{i}").touch()
    with pytest.raises(InvalidArgument, match="entries"):
        hostcopy.expand([Patch.copy_dir(str(wide), "/x")], (allowed,))


# --- guestd's side ----------------------------------------------------------------------------
class _Agent:
    root_fd = -1
    path_extra = ""
    restricted = False


def test_guestd_shape_checks_before_it_applies() -> None:
    agent = _Agent()
    for bad in ({"thp": "sometimes"}, {"log_level": "loud"}, {"path_extra": "rel:ative"}):
        with pytest.raises(ExecFailed) as exc:
            shape.configure(agent, proto.Configure(rid=1, **{"path_extra": "/s", **bad}))  # type: ignore[arg-type]
        assert exc.value.code == proto.E_INVALID
        assert agent.path_extra == ""  # nothing applied
    shape.configure(agent, proto.Configure(rid=1, path_extra="/.sandvisor/scripts"))  # type: ignore[arg-type]
    assert agent.path_extra == "/.sandvisor/scripts" and not agent.restricted
    msg = proto.decode(proto.encode(proto.Configure(rid=2, restricted=True, thp="never", log_level="off"))[4:])
    assert msg == proto.Configure(rid=2, restricted=True, thp="never", log_level="off")


def test_guestd_path_and_nnp_wrapper() -> None:
    env = {"PATH": "/usr/bin:/bin"}
    shape.with_path(env, "/s")
    shape.with_path(env, "/s")
    assert env == {"PATH": "/usr/bin:/bin:/s"}
    empty: dict[str, str] = {}
    shape.with_path(empty, "/s")
    assert empty == {"PATH": "/s"}
    path, argv = shape.nnp_argv(7, "/usr/bin/id", ["id", "-u"])
    assert path == "/proc/self/fd/7/usr/bin/busybox"
    assert argv == ["busybox", "setpriv", "--nnp", "--", "/usr/bin/id", "-u"]


# --- the supervisor's lines about a sandbox --------------------------------------------------
def test_log_lines_at_the_sandboxes_level() -> None:
    configs = {
        "quiet": SandboxConfig(quiet_logs=True),
        "errors": SandboxConfig(log_level="error"),
        "plain": SandboxConfig(),
    }
    f = sandlog.SandboxLogFilter(configs.get)

    def passes(level: int, msg: str, *args: object, **extra: object) -> bool:
        record = logging.LogRecord("sandvisor.sandbox", level, __file__, 1, msg, args, None)
        record.__dict__.update(extra)
        return f.filter(record)

    assert not passes(logging.ERROR, "sandbox %s failed: %s", "quiet", "x")
    assert not passes(logging.WARNING, "sandbox %s: %s", "errors", "x")
    assert passes(logging.ERROR, "sandbox %s: %s", "errors", "x")
    assert passes(logging.INFO, "sandbox %s: %s", "plain", "x")
    assert passes(logging.WARNING, "sandbox %s", "unknown")
    assert passes(logging.WARNING, "no sandbox named")
    assert not passes(logging.WARNING, "a line %d", 3, sandbox="quiet")  # or named by extra
