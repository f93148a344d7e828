"""Host files a Create may name (actors/create_checks.py's check_host_file): regular files in the
allowed directories only, no symlinks on the way."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.errors import DomainError


def test_a_create_may_name_only_regular_files_in_allowed_dirs(tmp_path: Path) -> None:
    from actors.create_checks import check_host_file

    allowed = tmp_path / "images"
    allowed.mkdir()
    good = allowed / "root.ext4"
    good.write_bytes(b"x")
    (allowed / "link.ext4").symlink_to("/etc/shadow")
    (allowed / "dirlink").symlink_to(tmp_path)
    check_host_file("rootfs", str(good), (allowed,))
    cases = {
        "/etc/shadow": "FAILED_PRECONDITION",  # not in an allowed dir
        str(allowed / "link.ext4"): "FAILED_PRECONDITION",  # a symlink
        str(allowed / "dirlink" / "images" / "root.ext4"): "FAILED_PRECONDITION",  # a symlink on the way
        str(allowed / "missing.ext4"): "NOT_FOUND",
        str(allowed / ".." / "images" / "root.ext4"): "INVALID_ARGUMENT",
        "root.ext4": "INVALID_ARGUMENT",
    }
    for path, code in cases.items():
        with pytest.raises(DomainError) as e:
            check_host_file("rootfs", path, (allowed,))
        assert e.value.code == code, (path, e.value)
    with pytest.raises(DomainError, match="regular file"):
        check_host_file("rootfs", "/dev/null", (Path("/dev"),))  # a device
    with pytest.raises(DomainError, match="allowed: none"):
        check_host_file("kernel", str(good), ())
