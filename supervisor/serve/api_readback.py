"""The read-back methods (sandvisor extensions): ``Config``, a sandbox's whole
configuration as the Create that makes an equal one (:mod:`supervisor.serve.config_readback`),
``SshEndpoint``, where ``serve --ssh`` serves it (docs/ssh.md), and detachable exec
sessions: a detachable Exec (``ExecRequest.detachable``) and ``Attach`` to one again."""

from __future__ import annotations

import base64
import hashlib
from contextlib import AbstractAsyncContextManager
from typing import Any

import trio

from actors.face import FailedPrecondition, HeldSession, InvalidArgument, NotFound, Registry, Sandbox, Unavailable
from supervisor.serve import access, config_readback
from supervisor.serve.api_table import CallIO, Table, feed
from supervisor.wire import protocol

TABLE = Table()
method = TABLE.method


@method("Config", protocol.ConfigRequest)
async def _config(reg: Registry, io: CallIO, req: protocol.ConfigRequest) -> protocol.SandboxConfigResponse:
    sb = access.sandbox(reg, io.principal, req.id)
    cfg = sb.config
    image = sb.record.image
    return protocol.SandboxConfigResponse(
        id=sb.id,
        config=config_readback.create_request(cfg, sb.limits, patch_data=req.patch_data),
        patches=config_readback.patch_info(cfg),
        image_digest=image.digest if image is not None else "",
    )


def fingerprint(key_line: str) -> str:
    """An OpenSSH public key line's fingerprint as ``ssh-keygen -l`` prints it (SHA256:...)."""
    blob = base64.b64decode(key_line.split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def endpoint(address: str, host_key: str, sandbox_id: str) -> protocol.SshEndpoint:
    """The endpoint of ``serve --ssh`` bound at ``address`` (HOST:PORT) for one sandbox:
    a wildcard bind is reached on loopback; an id holding a ``+`` is logged in as ``ID+``."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    kind, blob = host_key.split()[:2]
    pinned = host if port == "22" else f"[{host}]:{port}"
    return protocol.SshEndpoint(
        host=host,
        port=int(port),
        user=sandbox_id + "+" if "+" in sandbox_id else sandbox_id,
        host_key=host_key,
        fingerprint=fingerprint(host_key),
        known_hosts=f"{pinned} {kind} {blob}",
    )


@method("SshEndpoint", protocol.IdRequest)
async def _ssh_endpoint(reg: Registry, io: CallIO, req: protocol.IdRequest) -> protocol.SshEndpoint:
    sb = access.sandbox(reg, io.principal, req.id)
    address, host_key = reg.endpoints.get("ssh"), reg.endpoints.get("ssh_host_key")
    if not address or not host_key:
        raise Unavailable("this supervisor serves no SSH endpoint (serve --ssh HOST:PORT; docs/ssh.md)")
    return endpoint(address, host_key, sb.id)


# --- detachable exec sessions (actors/sandboxes/sessions.py) --------------------------------
async def held_exec(sb: Sandbox, req: protocol.ExecRequest, io: CallIO) -> None:
    """A detachable Exec: its process is the life's (a held session), this call its
    first client; ExecInput.detach leaves it running."""
    await sb.awake()  # a paused sandbox resumes first, as for any exec
    sb.require_alive()
    life = sb.life
    sessions = life.sessions if life is not None else None
    if sessions is None:
        raise FailedPrecondition(f"sandbox {sb.id} is {sb.state.value}, not ready or running")
    sid = sb.log.new_session()

    def open_exec() -> AbstractAsyncContextManager[Any]:
        return sb.exec_session(
            req.cmd,
            env=req.env,
            cwd=req.working_dir,
            user=req.user,
            tty=req.tty,
            rows=req.tty_size.height,
            cols=req.tty_size.width,
            timeout=float(req.timeout_seconds),
        )

    session = await sessions.open(sid, req.tty, open_exec, lambda src, data: sb.log.append(src, data, sid))
    await _attached(sb, session, io)


@method("Attach", protocol.AttachRequest, streams=True, inputs=protocol.ExecInput)
async def _attach(reg: Registry, io: CallIO, req: protocol.AttachRequest) -> None:
    sb = access.sandbox(reg, io.principal, req.id)
    life = sb.life
    if life is None or life.sessions is None:
        raise NotFound(f"no session {req.session_id} (it ended, or it was never detachable)")
    await _attached(sb, life.sessions.get(req.session_id), io)


async def _attached(sb: Sandbox, session: HeldSession, io: CallIO) -> None:
    """``io`` is ``session``'s client until the process ends (its exit is sent), the
    client detaches ("detached" is sent: it runs on) or goes away (it ends)."""
    send, receive = trio.open_memory_channel[tuple[str, bytes]](16)
    held = session.attach(send)  # (another client's session: refused here, before it is this call's)
    left = False  # the client detached
    try:
        for name, data in held:
            await io.send(protocol.RunOutput(stream=name, data=data))
        async with trio.open_nursery() as nursery:

            async def pump_input() -> None:
                nonlocal left
                while True:
                    msg: protocol.ExecInput | None = await io.receive()
                    h = session.handle
                    if msg is None:  # the client half-closed: end of stdin
                        if h is not None:
                            await h.close_stdin()
                        return
                    if msg.init is not None:
                        raise InvalidArgument("init is the first ExecInput's only")
                    if msg.detach:
                        left = True
                        session.detach()  # (closes the output channel: the loop below ends)
                        return
                    if h is None:
                        continue  # it ended: its exit is on its way
                    await feed(h, msg, tty=session.tty)
                    sb.touch()

            nursery.start_soon(pump_input)
            async with receive:
                async for name, data in receive:
                    await io.send(protocol.RunOutput(stream=name, data=data))
            nursery.cancel_scope.cancel()
        if left:
            await io.send(protocol.RunOutput(stream="detached", done=True, session_id=session.id))
            return
        await session.ended.wait()
        if session.exit_code is None:
            raise Unavailable(f"session {session.id} ended with its sandbox ({sb.state.value})")
        await io.send(
            protocol.RunOutput(stream="exit", exit_code=session.exit_code, done=True, oom_killed=session.oom_killed)
        )
    finally:
        if not left and session.ended.is_set():
            session.finish()  # ended, and its client saw it (or went away): nothing to keep
        elif not left:
            session.end()  # the client went away without detaching: as a plain exec's
