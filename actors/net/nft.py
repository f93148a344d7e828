"""nftables from the supervisor's process: libnftables (Debian's libnftables1, which
the ``nft`` tool is built on) through ctypes.

One call is one transaction, exactly as ``nft -f -``: all of it applies or none
does. In-process because the DNS proxy opens every allowed answer in the filter
*before* the guest sees the answer: measured, ~0.07 ms a call here against ~6 ms
for a fork+exec of ``nft`` (benchmarks/network_tap.py), a cost every allowed name
lookup would pay.

The context's netlink socket is made when the context is, in the namespace of the
thread that makes it: :class:`Nft` is created inside :meth:`NetNS.entered`, and is
used from the Trio thread after (calls are synchronous and short).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Sequence

from actors.net.netns import NetNS


class NftError(Exception):
    """nftables refused a transaction (nft's own error text)."""


def _lib() -> ctypes.CDLL:
    name = ctypes.util.find_library("nftables") or "libnftables.so.1"
    try:
        lib = ctypes.CDLL(name)
    except OSError as exc:
        raise NftError(f"libnftables is missing (install Debian's nftables): {exc}") from None
    lib.nft_ctx_new.restype = ctypes.c_void_p
    lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
    lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_get_output_buffer.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_get_output_buffer.restype = ctypes.c_char_p
    lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
    lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.nft_run_cmd_from_buffer.restype = ctypes.c_int
    return lib


class Nft:
    """A libnftables context bound to one network namespace."""

    def __init__(self, netns: NetNS | None = None) -> None:
        self._lib = _lib()
        with (netns or NetNS()).entered():
            ctx = self._lib.nft_ctx_new(0)
            if not ctx:
                raise NftError("nft_ctx_new failed")
            # the netlink socket is opened lazily on some versions: open it here, in the namespace
            self._ctx: int | None = ctx
            self._lib.nft_ctx_buffer_output(ctx)
            self._lib.nft_ctx_buffer_error(ctx)
            self._run_locked("list tables")

    def _run_locked(self, text: str) -> str:
        if self._ctx is None:
            raise NftError("the nftables context is closed")
        rc = self._lib.nft_run_cmd_from_buffer(self._ctx, text.encode())
        out = self._lib.nft_ctx_get_output_buffer(self._ctx) or b""
        err = self._lib.nft_ctx_get_error_buffer(self._ctx) or b""
        if rc != 0:
            raise NftError(err.decode(errors="replace").strip()[:2000] or f"nft failed ({rc})")
        return out.decode(errors="replace")

    def run(self, commands: str | Sequence[str]) -> str:
        """Apply ``commands`` (a script, or one command per item) as one transaction;
        returns nft's output (for ``list``)."""
        text = commands if isinstance(commands, str) else "\n".join(commands)
        return self._run_locked(text)

    def close(self) -> None:
        if self._ctx is not None:
            self._lib.nft_ctx_free(self._ctx)
            self._ctx = None

    def __enter__(self) -> Nft:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
