"""The gRPC edge's Unix sockets: born with their mode, and the peer-credential relay.

Unix sockets are born with their mode: 0600 (root, or whoever runs the daemon) or 0660
with the configured group, bound in a fresh 0700 directory, where they get their mode
and group before they are renamed to their path (:func:`bind_unix`). grpcio does not
expose a peer's credentials (SO_PEERCRED), so an address with a
:class:`~supervisor.serve.grpc_addresses.PeerPolicy` is served through a relay: the public
socket is Trio's (:func:`listen_public`), each connection's credentials are checked when
it is accepted (as the msgpack socket does at hello), and its bytes are relayed to grpc's
own socket in that private directory, or, refused, to a second grpc server there that
answers every call PERMISSION_DENIED (:func:`serve_privately`)::

    client --unix--> public socket (Trio: SO_PEERCRED -> policy.check)
                        |-- served --> <private>/grpc.sock (the edge's server)
                        +-- refused -> <private>/refused.sock (PERMISSION_DENIED, policy.served())

The relay's connection to grpc.sock is bound to a fresh abstract name (random, one per
connection), which grpc reports as the call's peer (``unix-abstract:NAME``): the
edge's ``unix_peers`` maps it to the client's principal while the connection lasts
(:meth:`~supervisor.serve.grpc_addresses.PeerPolicy.principal`). Only the relay can reach
grpc.sock (its directory is 0700), so the name is the relay's word.
"""

from __future__ import annotations

import contextlib
import grp
import logging
import math
import os
import socket
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# isort: split
import supervisor.wire.grpc_env  # noqa: F401  grpc's fork support off before grpc is imported: first, always

# isort: split
import grpc
import grpc.aio
import trio

from actors.face import Principal
from supervisor.serve.grpc_addresses import PeerPolicy, UnixAddress

log = logging.getLogger("sandvisor.grpc")

REFUSED_LINGER = 10.0  # seconds a refused connection is kept, to be told PERMISSION_DENIED
RELAY_CHUNK = 1 << 16


# ---------------------------------------------------------------------------------------
# Unix sockets born with their mode
# ---------------------------------------------------------------------------------------
def private_dir(path: Path) -> Path:
    """A fresh 0700 directory beside ``path`` (the same file system: a rename into place works)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=".grpc-", dir=path.parent))


async def listen_public(addr: UnixAddress, private: Path) -> tuple[trio.SocketListener, int]:
    """The relay's public socket, bound with its mode and group in ``private`` and renamed
    into place; the listener and the socket's inode."""
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = private / "public.sock"
    old = os.umask(0o177)  # born 0600
    try:
        await sock.bind(str(tmp))
    finally:
        os.umask(old)
    if addr.group:
        os.chown(tmp, -1, grp.getgrnam(addr.group).gr_gid)
        os.chmod(tmp, 0o660)
    sock.listen(128)
    os.replace(tmp, addr.path)
    return trio.SocketListener(sock), addr.path.stat().st_ino


def bind_unix(server: grpc.aio.Server, addr: UnixAddress) -> int:
    """Bind ``addr`` with its final mode and group before anyone can reach it: grpc binds in a
    fresh 0700 directory beside the path, then the socket is renamed into place (a Unix
    socket is reached through its inode; the rename keeps it). Returns the inode."""
    path = addr.path
    private = private_dir(path)
    tmp = private / "s"
    try:
        if server.add_insecure_port(f"unix:{tmp}") == 0:
            raise OSError(f"cannot listen on {path}")
        if addr.group:
            os.chown(tmp, -1, grp.getgrnam(addr.group).gr_gid)
            os.chmod(tmp, 0o660)
        else:
            os.chmod(tmp, 0o600)
        os.replace(tmp, path)
        return path.stat().st_ino
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
        with contextlib.suppress(OSError):
            private.rmdir()


def unlink_if_ours(path: Path, ino: int) -> None:
    """Remove the socket unless another server has put its own there since."""
    try:
        if path.lstat().st_ino == ino:
            path.unlink()
    except FileNotFoundError:
        pass


# ---------------------------------------------------------------------------------------
# the relay of a Unix address with a peer policy
# ---------------------------------------------------------------------------------------
async def serve_privately(
    server: grpc.aio.Server, policy: PeerPolicy, private: Path, options: Sequence[tuple[str, Any]]
) -> grpc.aio.Server:
    """``server`` on ``private``/grpc.sock (the relay's served connections) and, started, the
    refuser on ``private``/refused.sock (the refused ones); returns the refuser (stop it)."""
    if server.add_insecure_port(f"unix:{private / 'grpc.sock'}") == 0:
        raise OSError(f"cannot listen on {private / 'grpc.sock'}")
    refuser = grpc.aio.server(options=options, maximum_concurrent_rpcs=64)
    refuser.add_generic_rpc_handlers((Refuser(policy.served()),))
    if refuser.add_insecure_port(f"unix:{private / 'refused.sock'}") == 0:
        raise OSError(f"cannot listen on {private / 'refused.sock'}")
    try:
        await refuser.start()
    except BaseException:
        await refuser.stop(0)
        raise
    return refuser


async def relay_connections(
    listener: trio.SocketListener,
    addr: UnixAddress,
    private: Path,
    on_refused: Callable[[], None],
    peers: dict[str, Principal] | None = None,
) -> None:
    """Accept on the public socket; relay each connection (Trio), until cancelled.
    ``peers``: each served connection's principal, by the peer name grpc will report."""
    async with listener, trio.open_nursery() as nursery:
        while True:
            stream = await listener.accept()
            nursery.start_soon(_relay, stream, addr, private, on_refused, {} if peers is None else peers)


async def _open_upstream(path: Path, name: str) -> trio.SocketStream:
    """A connection to ``path`` from a socket bound to the abstract ``name``."""
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if name:
            await sock.bind("\0" + name)
        await sock.connect(str(path))
    except BaseException:
        sock.close()
        raise
    return trio.SocketStream(sock)


async def _relay(
    stream: trio.SocketStream,
    addr: UnixAddress,
    private: Path,
    on_refused: Callable[[], None],
    peers: dict[str, Principal],
) -> None:
    assert addr.policy is not None
    name = ""
    try:
        why = addr.policy.check(stream.socket)
        if why is None:
            name = f"sandvisor-grpc-{os.getpid()}-{os.urandom(12).hex()}"
            peers[name] = addr.policy.principal(stream.socket)
    except OSError as exc:
        why = f"peer credentials unavailable: {exc}"
    if why is not None:
        on_refused()
        log.warning("gRPC on %s: refused: %s", addr.path, why)
    try:
        async with stream:
            try:
                upstream = await _open_upstream(private / ("refused.sock" if why else "grpc.sock"), name)
            except OSError:
                return
            await _relay_open(stream, upstream, why)
    finally:
        peers.pop(name, None)


async def _relay_open(stream: trio.SocketStream, upstream: trio.SocketStream, why: str | None) -> None:
    async with upstream:
        with trio.move_on_after(REFUSED_LINGER if why else math.inf):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_pipe, stream, upstream, nursery.cancel_scope)
                nursery.start_soon(_pipe, upstream, stream, nursery.cancel_scope)


class Refuser(grpc.GenericRpcHandler):
    """Every method, for a peer the policy refused: PERMISSION_DENIED, saying who is served."""

    def __init__(self, served: str) -> None:
        self.served = served

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        served = self.served

        async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, served)

        return grpc.unary_unary_rpc_method_handler(refuse)


async def _pipe(src: trio.SocketStream, dst: trio.SocketStream, done: trio.CancelScope) -> None:
    """Bytes from ``src`` to ``dst`` until either end goes; then the relay ends."""
    try:
        while data := await src.receive_some(RELAY_CHUNK):
            await dst.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass
    finally:
        done.cancel()
