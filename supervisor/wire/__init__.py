"""What both sides of the supervisor agree on: the msgpack protocol (its messages, frames and
error codes), the protobufs of the gRPC edge, where the socket lives, SSH key syntax.

Imports nothing of ``supervisor.serve``, ``supervisor.client`` or ``supervisor.main``
(tests/unit/test_edge_face.py), so both sides import it freely."""
