"""Confinement: a cell per QEMU or tool (uid, namespaces, pivot_root, cgroups)."""
