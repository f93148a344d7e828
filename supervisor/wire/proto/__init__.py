"""Protocol buffers of the gRPC edge: the sandbox.v1 contract (verbatim) and our sandvisor.v1, with generated code."""
