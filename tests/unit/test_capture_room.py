"""Room for a capture (a checkpoint, a pause) on the state dir's filesystem: asked for
before anything stops, and a capture that fails for want of it told apart from other
failures (RESOURCE_EXHAUSTED, not INTERNAL)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from actors import quotas
from actors.errors import ResourceExhausted
from actors.machines.qemuproc import MachineError
from actors.quotas import CAPTURE_MARGIN_MIB, Admission, Quotas, short_of_space


def test_a_capture_needs_its_guests_ram_beyond_what_the_supervisor_keeps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    admission = Admission(Quotas(min_free_mib=256), tmp_path, None)
    need = 512 + CAPTURE_MARGIN_MIB + 256
    monkeypatch.setattr(quotas, "free_mib", lambda path: need)
    admission.check_capture("a checkpoint of a", 512)  # just enough
    monkeypatch.setattr(quotas, "free_mib", lambda path: need - 1)
    with pytest.raises(ResourceExhausted, match=f"a checkpoint of a needs up to {need} MiB"):
        admission.check_capture("a checkpoint of a", 512)


def test_a_failure_for_want_of_space_is_told_by_its_error_or_by_the_filesystem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(quotas, "free_mib", lambda path: 1 << 20)  # room enough
    assert short_of_space(OSError(errno.ENOSPC, "No space left on device"), tmp_path)
    assert short_of_space(OSError(errno.EDQUOT, "Disk quota exceeded"), tmp_path)
    assert short_of_space(MachineError("migration failed: Unable to write to file: No space left on device"), tmp_path)
    assert not short_of_space(MachineError("migration failed: "), tmp_path)
    assert not short_of_space(OSError(errno.EIO, "Input/output error"), tmp_path)
    # QEMU 7.2 ends a migration whose last flush failed with no reason: the filesystem tells
    monkeypatch.setattr(quotas, "free_mib", lambda path: CAPTURE_MARGIN_MIB - 1)
    assert short_of_space(MachineError("migration failed: "), tmp_path)
