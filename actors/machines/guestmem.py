"""Guest memory files are the cells' (actors/cells/guestmem.py: a cell's RAM file is its
identity's, in a private dir the cells own). Named here for the sandbox's life and the
registry, which take these two from the machines' side."""

from __future__ import annotations

from actors.cells.guestmem import own_memory, private_dir

__all__ = ["own_memory", "private_dir"]
