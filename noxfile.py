"""Sessions: tests, lint, typecheck, bench, demo. Each installs what it needs itself
(host packages via images/host-packages.sh, Python packages into the session's venv).

Installing the package compiles the C helpers (setup.py, actors/helpers.py). Sessions
that install the host packages (gcc, libc6-dev) first require that build
(SANDVISOR_REQUIRE_HELPERS=1: a failed compile fails the install); unit and typecheck
run on any machine: without a compiler the build records why and skips the helpers,
the tests that need them skip, and serve would refuse to start."""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["lint", "typecheck", "unit", "tests"]
nox.options.reuse_existing_virtualenvs = True


def _host(session: nox.Session) -> None:
    """The host packages, before session.install: the package build compiles the C
    helpers with them (and must, from here on)."""
    session.run("bash", "images/host-packages.sh", external=True)
    session.env["SANDVISOR_REQUIRE_HELPERS"] = "1"


@nox.session
def tests(session: nox.Session) -> None:
    """The whole suite against real VMs (builds the default image on first use)."""
    _host(session)
    session.install("-e", ".[test]")
    session.run("sandvisor", "image", "build")
    session.run("pytest", *(session.posargs or ["-q"]))


@nox.session
def unit(session: nox.Session) -> None:
    """The fast layer: protocol cores, actor logic on fake VMs, the import graph (no QEMU).
    No host packages: the C helpers are built when a compiler is there, skipped if not."""
    session.install("-e", ".[test]")
    session.run("pytest", "-q", "-m", "not vm and not host", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    session.install("-e", ".[test,dev]")
    session.run("mypy")


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks: ratios against peers measured in the same run (results/ holds the output)."""
    _host(session)
    session.install("-e", ".[bench,fleet,test]")  # (fleet: Ray; test: cryptography for fleet.py's PKI)
    session.run("sandvisor", "image", "build")
    session.run("python", "benchmarks/guest.py", *session.posargs)
    session.run("python", "benchmarks/api.py")
    session.run("python", "benchmarks/grpc_api.py")
    session.run("python", "benchmarks/network.py")
    session.run("python", "benchmarks/network_tap.py")
    session.run("python", "benchmarks/snapshots.py")
    session.run("python", "benchmarks/snapshot_transfer.py")
    session.run("python", "benchmarks/default_restore.py")
    session.run("python", "benchmarks/trees.py")
    session.run("python", "benchmarks/coldstart.py")
    session.run("python", "benchmarks/oci_images.py")
    session.run("python", "benchmarks/control.py")
    session.run("python", "benchmarks/flood.py")
    session.run("python", "benchmarks/soak.py")
    session.run("python", "benchmarks/burst.py")
    session.run("python", "benchmarks/memory.py")
    session.run("python", "benchmarks/jail.py")
    session.run("python", "benchmarks/fleet.py")
    session.run("python", "benchmarks/files.py")
    session.run("python", "benchmarks/modify.py")
    session.run("python", "benchmarks/hibernate.py")
    session.run("python", "benchmarks/secret_proxy.py")
    session.run("python", "benchmarks/e2b_compat.py")
    session.run("python", "benchmarks/restore.py")  # (the old restore path interleaved: A/B)
    session.run("python", "benchmarks/exec.py")  # (chan.py, an A/B of runtimes, needs --variant)
    session.run("python", "benchmarks/cgroup_weight.py", "--out", "results")


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: build the default image, start the supervisor, show a sandbox working
    (and checkpointed, cloned, created from the boot template)."""
    _host(session)
    session.install("-e", ".")
    session.run("sandvisor", "image", "build")
    session.run("sandvisor", "demo")


@nox.session
def chaos(session: nox.Session) -> None:
    """The chaos harness: a seeded random run of operations and faults against a real
    serve, invariants checked after every step (``nox -s chaos -- --seed N --minutes M``)."""
    _host(session)
    session.install("-e", ".[test]")
    session.run("sandvisor", "image", "build")
    session.run("python", "benchmarks/chaos.py", *session.posargs)
