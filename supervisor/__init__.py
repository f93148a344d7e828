"""sandvisor: supervisor."""
