"""Quick start with the sync SDK: a sandbox, a command, a file, gone at the end.

Run with `sandvisor serve` running (SANDVISOR_SOCKET points at it if not default).
"""

from supervisor.client import Sandbox

with Sandbox.create("quickstart", labels={"example": "quickstart"}) as sb:
    info = sb.inspect()  # a SandboxInfo: attributes, not a dict
    print(f"{info.id} is {info.state} with {info.limits.memory_mib} MiB")
    r = sb.run("echo hello from $(hostname); uname -r")
    print(r.text(), end="")
    sb.fs.write("/tmp/data.txt", b"written by the host\n")
    print(sb.run(["cat", "/tmp/data.txt"]).text(), end="")
    print("exit code of false:", sb.run(["false"]).exit_code)
# leaving the block stopped and removed the sandbox
