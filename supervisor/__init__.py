"""sandvisor: supervisor."""

import os as _os
import sys as _sys

# grpcio's C core registers fork handlers by default; while other threads are in gRPC they
# crash forked children before exec (measured: 4 of 40 setuid children of a process
# serving gRPC died of SIGSEGV, as QEMU does when it is launched as its own user). The
# supervisor forks QEMU, so they are off unless the environment says otherwise. The core
# reads this once, when grpc is first imported: here, before any module of ours can.
GRPC_FORK_ENV = "GRPC_ENABLE_FORK_SUPPORT"
GRPC_FORK_SAFE = "grpc" not in _sys.modules or _os.environ.get(GRPC_FORK_ENV, "").lower() in ("0", "false", "no")
if "grpc" not in _sys.modules:
    _os.environ.setdefault(GRPC_FORK_ENV, "0")
