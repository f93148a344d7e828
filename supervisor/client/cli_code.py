"""``sandvisor run-code NAME [--context C] [--language L] [-f FILE | CODE]``: a cell in a
Jupyter kernel of the sandbox (docs/code.md), its stdout and stderr printed as they
come, its results' text on stdout, its images (png, jpeg, svg, pdf) written to files
in ``--out-dir`` (default: the current directory; each path said on stderr), its
error's traceback on stderr (exit 1).

One server stream over the plain blocking socket (bodies as the wire's maps), as ``run``.
"""

from __future__ import annotations

import argparse
import base64
import os
import sys

from supervisor.client.cli_common import UsageError, connect, kv

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (~2 ms; mypy reads the name)
if TYPE_CHECKING:
    from typing import Any

IMAGES = (("png", "png"), ("jpeg", "jpg"), ("svg", "svg"), ("pdf", "pdf"))  # format, a file's suffix


def add_run_code_command(p: argparse.ArgumentParser) -> None:
    p.add_argument("name")
    p.add_argument("code", nargs="?", help="the cell (or -f FILE)")
    p.add_argument("-f", "--file", metavar="FILE", help="the cell from FILE (- : stdin)")
    p.add_argument("--context", metavar="C", default="", help="a context's id (default: the language's default)")
    p.add_argument("--language", metavar="L", default="", help="the default context of L (default python)")
    p.add_argument("--env", action="append", metavar="K=V", help="set in the kernel's os.environ first")
    p.add_argument("--timeout", type=float, default=0.0, metavar="S", help="interrupt the cell after S seconds")
    p.add_argument("--out-dir", default=".", metavar="DIR", help="where images are written (default .)")
    p.add_argument("--json", action="store_true", help="each message as a JSON line instead")


def _cell(a: argparse.Namespace) -> str:
    if a.file is not None and a.code is not None:
        raise UsageError("run-code: give CODE or -f FILE, not both")
    if a.file == "-":
        return sys.stdin.read()
    if a.file is not None:
        with open(a.file, encoding="utf-8") as f:
            return f.read()
    if a.code is None:
        raise UsageError("run-code needs CODE or -f FILE")
    return str(a.code)


def _write_images(result: dict[str, Any], out_dir: str, stem: str) -> list[str]:
    written = []
    for fmt, suffix in IMAGES:
        value = result.get(fmt)
        if not value:
            continue
        path = os.path.join(out_dir, f"{stem}.{suffix}")
        data = value.encode() if fmt == "svg" else base64.b64decode(value)
        with open(path, "wb") as f:
            f.write(data)
        written.append(path)
    return written


def run_code(a: argparse.Namespace) -> int:
    if a.context and a.language:
        raise UsageError("run-code: give --context or --language, not both")
    body = {
        "id": a.name,
        "code": _cell(a),
        "language": a.language,
        "context": a.context,
        "envs": kv(a.env),
        "timeout_seconds": a.timeout,
    }
    os.makedirs(a.out_dir, exist_ok=True)
    failed, count, n = False, 0, 0
    with connect(a) as c:
        for o in c.stream("RunCode", body):
            kind = o.get("kind")
            if a.json:
                import json

                print(json.dumps(o), flush=True)
                failed = failed or kind == "error"
                continue
            if kind == "stdout":
                sys.stdout.write(o.get("text", ""))
                sys.stdout.flush()
            elif kind == "stderr":
                sys.stderr.write(o.get("text", ""))
                sys.stderr.flush()
            elif kind == "execution_count":
                count = int(o.get("execution_count") or 0)
            elif kind == "result":
                r = o.get("result") or {}
                n += 1
                written = _write_images(r, a.out_dir, f"{a.name}-{count or 0}-{n}")
                for path in written:
                    print(f"image: {path}", file=sys.stderr, flush=True)
                if r.get("text") and (r.get("is_main_result") or not written):
                    print(r["text"], flush=True)
            elif kind == "error":
                e = o.get("error") or {}
                failed = True
                print(e.get("traceback") or f"{e.get('name', '')}: {e.get('value', '')}", file=sys.stderr, flush=True)
    return 1 if failed else 0
