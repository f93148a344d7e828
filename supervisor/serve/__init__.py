"""What ``sandvisor serve`` serves: the msgpack socket server and its method table, the gRPC
edge, the E2B endpoint, the MCP server, the SSH gateway, metrics and the fleet service.

It may use the client (the E2B endpoint, MCP and the SSH gateway speak to the socket
through the SDK); the client never imports it (tests/unit/test_edge_face.py)."""
