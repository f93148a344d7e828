"""One VM: QEMU's command line, its process and QMP, the one way a VM comes up, disks.

A Machine runs QEMU through the spawner it is given (a cell's); guest RAM files are the
cells' (actors/cells/guestmem.py)."""
