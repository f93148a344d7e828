"""sandvisor: actors."""
