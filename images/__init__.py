"""sandvisor: images."""
