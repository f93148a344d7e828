"""The wire's bodies, by service area (frozen attrs classes); :mod:`supervisor.wire.protocol` is
their face and their converter."""
