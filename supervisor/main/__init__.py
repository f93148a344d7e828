"""The composition root: the ``sandvisor`` command (cli.py), and ``serve``'s daemon that builds
the domain (actors/) from its configuration and starts the serve side on it; the throwaway
supervisor of the demo, tests and benchmarks."""
