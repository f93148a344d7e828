"""Confinement: a cell per QEMU or tool (uid, namespaces, pivot_root, cgroups), and the
guest memory files a cell owns (its RAM file, sealed snapshot memory)."""
