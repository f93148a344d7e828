"""Async SDK: run untrusted snippets in parallel sandboxes and collect the results.

One SandboxSpec describes them all; each sandbox adds its own settings on top.
Run with `sandvisor serve` running (SANDVISOR_SOCKET points at it if not default).
"""

import trio

from supervisor.client import AsyncSandbox, Lifetime, SandboxSpec

SNIPPETS = {
    "squares": "print([i * i for i in range(10)])",
    "fail": "raise SystemExit(3)",
    "env": "import os; print(os.environ['TASK'])",
}
AGENT = SandboxSpec(labels={"role": "agent"}, lifetime=Lifetime(ttl=300))


async def run_one(name: str, code: str, results: dict[str, tuple[int, str]]) -> None:
    async with await AsyncSandbox.create(f"agent-{name}", AGENT, env={"TASK": name}) as sb:
        r = await sb.run(["python3", "-c", code], timeout=60)
        results[name] = (r.exit_code, (r.stdout or r.stderr).decode().strip())


async def main() -> None:
    results: dict[str, tuple[int, str]] = {}
    async with trio.open_nursery() as n:
        for name, code in SNIPPETS.items():
            n.start_soon(run_one, name, code, results)
    for name in SNIPPETS:
        code, out = results[name]
        print(f"{name}: exit {code}: {out}")


trio.run(main)
