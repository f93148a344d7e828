"""grpc's fork support, off before grpc is first imported: import this module first.

grpcio's C core registers fork handlers by default; while other threads are in gRPC
they crash forked children before exec (measured: 4 of 40 setuid children of a process
serving gRPC died of SIGSEGV, as QEMU does when it is launched as its own user). The
supervisor forks QEMU, so they are off unless the environment says otherwise. The core
reads the variable once, when grpc is first imported: the supervisor's importers of
grpc (:mod:`supervisor.serve.grpc_bridge` and the modules it is made of, grpc_addresses,
grpc_auth, grpc_unix) import this module before it (and grpc_service, daemon and
``serve`` reach grpc through them). Not at ``import supervisor``:
importing the package (the SDK, the CLI) must not change a user's environment.
"""

import os
import sys

GRPC_FORK_ENV = "GRPC_ENABLE_FORK_SUPPORT"
GRPC_FORK_SAFE = "grpc" not in sys.modules or os.environ.get(GRPC_FORK_ENV, "").lower() in ("0", "false", "no")
if "grpc" not in sys.modules:
    os.environ.setdefault(GRPC_FORK_ENV, "0")
