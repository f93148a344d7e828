"""``ray start`` without the Ray Client server and with private dirs:
``python -m supervisor.serve.fleet.raystart start ...``.

* ``ray start --head`` starts Ray Client's server (port 10001: a door that runs any code
  its callers send) whenever grpc is importable, and refuses a port that would turn it
  off (``--ray-client-server-port`` must be 1024-65535). Told that Ray Client's
  dependencies are missing, it starts none.
* ``ray start`` makes its temp dir, session, sockets and logs dirs mode 0777 ("so others
  can use it"); here they keep the mode the umask (077) gives them: 0700.

The rest of ``ray start`` is Ray's own. (Ray's version is pinned: ``ray==`` in
pyproject.toml.) Run as the member's Ray user (supervisor/serve/fleet/raynode.py).
"""

from __future__ import annotations

import sys
from typing import Any


def main() -> None:
    import importlib
    import os

    os.umask(0o077)
    utils: Any = importlib.import_module("ray._common.utils")
    utils.try_make_directory_shared = lambda path: None
    scripts: Any = importlib.import_module("ray.scripts.scripts")
    scripts.get_ray_client_dependency_error = lambda: ImportError("Ray Client is off in a sandvisor fleet")
    sys.argv = ["ray", *sys.argv[1:]]
    scripts.main()


if __name__ == "__main__":
    main()
