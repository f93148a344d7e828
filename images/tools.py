"""What the image store asks of a tool runner: the port images/ owns.

``ImageStore(tools=...)`` runs skopeo, umoci and mkfs.ext4 through a :class:`ToolRunner`.
The layers point one way (guestd <- images <- actors <- supervisor): images/ may not
import actors/, so it states here what it needs, and the domain's cells
(``actors.cells.toolcell.ToolCells``) implement it and import these types and constants
from here (one definition of each).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

import attrs

SHIFT_COUNT = 65536  # ids of the tools' user namespace: 0-65535, as rootless containers map
# what umoci needs to make an image's files as the image says (in the user namespace)
CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER, CAP_FSETID, CAP_SETFCAP = 0, 1, 2, 3, 4, 31
UNPACK_CAPS = (CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER, CAP_FSETID, CAP_SETFCAP)
READ_CAPS = (CAP_DAC_READ_SEARCH,)  # mkfs -d: read every file of the tree, whatever its mode


class ToolError(Exception):
    """A tool's cell could not be made or entered (the message names the step)."""


@attrs.frozen
class ToolResult:
    returncode: int
    stdout: bytes
    stderr: bytes
    oom_killed: bool = False


@attrs.frozen
class ToolBind:
    """A host path at the same path in the tool's cell: its arguments need no rewriting."""

    path: Path
    writable: bool = False


def bind(path: Path | str, *, writable: bool = False) -> ToolBind:
    return ToolBind(Path(path), writable)


class ToolIdentity(Protocol):
    """The host uid and gid one job's tools run as (no capabilities)."""

    @property
    def uid(self) -> int: ...

    @property
    def gid(self) -> int: ...


class ToolRunner(Protocol):
    """Runs host tools confined (``actors.cells.toolcell.ToolCells``)."""

    def identity(self, owner: str) -> AbstractContextManager[ToolIdentity]:
        """An id of one job's own (a pull's skopeo runs), released on exit."""
        ...

    def shifted(self, ns_id: int) -> int:
        """The host id of ``ns_id`` in the tools' user namespace (0: its root)."""
        ...

    async def run(
        self,
        argv: Sequence[str],
        *,
        identity: ToolIdentity | None,
        binds: Sequence[ToolBind] = (),
        host_network: bool = False,
        keep_caps: Sequence[int] = (),
        fsize: int | None = None,
    ) -> ToolResult:
        """``argv`` confined, to its exit. ``identity`` None: root of the tools' user
        namespace (with ``keep_caps`` there); ``fsize``: no file it writes grows past
        this; raises ToolError when it cannot be started."""
        ...
