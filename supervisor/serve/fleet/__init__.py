"""A fleet of supervisors placed by Ray's scheduler (docs/fleet.md)."""
