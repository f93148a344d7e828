"""Protocol buffers of the gRPC edge: the seed's sandbox.v1 (verbatim) and our sandvisor.v1, with generated code."""
