"""The client: the SDK (``from supervisor.client import Sandbox, AsyncSandbox``), the CLI's
client commands (``cli_*.py``) and the fleet's client.

The SDK's public names are those of :mod:`supervisor.client.public`, loaded when one is
first asked for (PEP 562): the one-shot CLI commands live in this package, and must not
pay for the SDK's Trio driver and converter each time one of them starts
(tests/unit/test_frames.py).
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (mypy reads the name)
if TYPE_CHECKING:
    from supervisor.client.public import *  # noqa: F403
    from supervisor.client.public import __all__ as __all__


def __getattr__(name: str) -> object:
    """``__all__`` and the SDK's names, from :mod:`supervisor.client.public`."""
    import os

    here = os.path.dirname(__file__)
    submodule = os.path.exists(os.path.join(here, f"{name}.py")) or os.path.isdir(os.path.join(here, name))
    if submodule or (name.startswith("_") and name != "__all__"):  # `from supervisor.client import cli_common`,
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")  # import probes: not the SDK's
    import importlib

    public = importlib.import_module("supervisor.client.public")
    if name != "__all__" and name not in public.__all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(public, name)
