"""Helpers the tests share: fakes, PKI, network and fleet labs, clients."""
