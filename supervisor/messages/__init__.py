"""The wire's bodies, by service area (frozen attrs classes); :mod:`supervisor.protocol` is
their face and their converter."""
