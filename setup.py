"""The package build's one custom step: compile the C helpers (actors/helpers.py says
which, with what flags, and what it records) into ``actors/bin``. Everything else is
in pyproject.toml.

``pip install .`` and wheels: into the build dir, so the installed package (a
platform wheel) holds them; ``pip install -e .``: into the source tree (editable mode).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from setuptools import Command, setup
from setuptools.command.build import build
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parent


def _helpers() -> ModuleType:
    """actors/helpers.py by its path (the build environment has no trio for actors/)."""
    spec = importlib.util.spec_from_file_location("_sandvisor_helpers", ROOT / "actors" / "helpers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class build_helpers(Command):  # (setuptools names commands so)
    description = "compile sandvisor's C helpers (jail_exec.c, ram_discard.c) into actors/bin"
    user_options: list[tuple[str, str | None, str]] = []
    editable_mode = False

    def initialize_options(self) -> None:
        self.build_lib: str | None = None

    def finalize_options(self) -> None:
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def _out(self) -> Path:
        return ROOT / "actors" / "bin" if self.editable_mode else Path(str(self.build_lib)) / "actors" / "bin"

    def run(self) -> None:
        helpers = _helpers()
        helpers.build(self._out(), src_dir=ROOT / "actors", warn=lambda m: print(m, file=sys.stderr))

    def get_outputs(self) -> list[str]:
        names = [h.name for h in _helpers().HELPERS] + [_helpers().MANIFEST]
        return [str(self._out() / n) for n in names]

    def get_output_mapping(self) -> dict[str, str]:
        return {}

    def get_source_files(self) -> list[str]:
        return [f"actors/{h.source}" for h in _helpers().HELPERS]


class HelpersBuild(build):
    sub_commands = [*build.sub_commands, ("build_helpers", None)]


class BinaryDistribution(Distribution):
    """Wheels hold native binaries: tagged for the platform, not py3-none-any."""

    def has_ext_modules(self) -> bool:
        return True


setup(cmdclass={"build": HelpersBuild, "build_helpers": build_helpers}, distclass=BinaryDistribution)
