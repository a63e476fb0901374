"""fsync helpers shared by everything that writes durably (checkpoints, weights, debug archives)."""

from __future__ import annotations

import os


def fsync_path(path: str) -> None:
    """fsync a file or a directory (a directory's fsync makes the renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
