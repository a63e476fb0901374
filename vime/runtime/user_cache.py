"""vime's files in the user's cache directory ($XDG_CACHE_HOME/vime, else ~/.cache/vime): what installed tools
answer about themselves (their flags), kept per installed version so that a start need not ask them again."""

from __future__ import annotations

import contextlib
import os


def user_cache_path(name: str) -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vime", name)


def write_cached(path: str, text: str) -> None:
    """Write ``path`` whole or not at all (concurrent starts may write it at once); a cache that cannot be
    written (a read-only home) only costs the next start the same question."""
    with contextlib.suppress(OSError):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temporary = f"{path}.{os.getpid()}.tmp"
        with open(temporary, "w") as f:
            f.write(text)
        os.replace(temporary, path)
