"""One VM: QEMU's command line, its process and QMP, the one way a VM comes up, disks and RAM."""
