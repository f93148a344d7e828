"""The Python SDK (``from supervisor.client import ...`` gathers its names): see
:mod:`supervisor.client` for the map of its modules."""
