"""A small tmpfs of the test's own, for directories that must be read-only or nearly full: the tests run as
root, whom no permission bit stops, and a volume shared with other runs has no free space a test can predict."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator

import pytest


@contextlib.contextmanager
def mounted_tmpfs(path: str, *, size: str = "8m", read_only: bool = False) -> Iterator[str]:
    """Mount a tmpfs of ``size`` at ``path`` (created) for the block; skips the test where mounting is not
    allowed (not root, no CAP_SYS_ADMIN in the container)."""
    os.makedirs(path, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", path], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip() or mounted.returncode}")
    try:
        yield path
    finally:
        # Lazily: a process of a failed run that still holds a file there must not make the clean-up fail.
        subprocess.run(["umount", "-l", path], capture_output=True)
