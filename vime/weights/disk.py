"""Disk transport of weights: ``weight_v{N:06d}/`` folders that engines reload (DESIGN §4).

A version is written under a temporary name, its files are checksummed into ``manifest.json``,
everything is fsynced, and only then is the folder renamed into place: an engine (or a resumed
run) either sees a complete version or none.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import time
import uuid
from typing import Callable

import msgspec

MANIFEST = "manifest.json"
PATTERN = re.compile(r"^weight_v(\d{6})$")


class WeightManifest(msgspec.Struct, frozen=True):
    schema: int
    version: int
    mode: str                      # full | delta
    parent: int | None             # the version a delta applies to
    files: dict[str, str]          # file name -> sha256
    created: float


class WeightError(RuntimeError):
    pass


def version_dir(root: str, version: int) -> str:
    return os.path.join(root, f"weight_v{version:06d}")


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_tree(path: str) -> None:
    for name in os.listdir(path):
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_full(root: str, version: int, write: Callable[[str], None]) -> str:
    """Write a full version with ``write(folder)``; returns the final folder."""
    final = version_dir(root, version)
    if os.path.exists(final):
        verify(final)  # already published by an earlier attempt of the same step
        return final
    os.makedirs(root, exist_ok=True)
    staging = os.path.join(root, f".weight_v{version:06d}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        write(staging)
        files = {name: _sha256(os.path.join(staging, name)) for name in sorted(os.listdir(staging))}
        manifest = WeightManifest(schema=1, version=version, mode="full", parent=None, files=files,
                                  created=time.time())
        with open(os.path.join(staging, MANIFEST), "wb") as f:
            f.write(msgspec.json.encode(manifest))
        _fsync_tree(staging)
        os.rename(staging, final)
        _fsync_tree(root)
    finally:
        if os.path.exists(staging):
            shutil.rmtree(staging, ignore_errors=True)
    return final


def verify(folder: str) -> WeightManifest:
    """Check a published version against its manifest; raises WeightError naming the bad file."""
    try:
        with open(os.path.join(folder, MANIFEST), "rb") as f:
            manifest = msgspec.json.decode(f.read(), type=WeightManifest)
    except (OSError, msgspec.DecodeError) as error:
        raise WeightError(f"{folder}: unreadable manifest ({error})") from None
    for name, expected in manifest.files.items():
        path = os.path.join(folder, name)
        if not os.path.exists(path) or _sha256(path) != expected:
            raise WeightError(f"{folder}: {name} does not match its checksum in {MANIFEST}")
    return manifest


def published_versions(root: str) -> list[int]:
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for name in os.listdir(root) if (m := PATTERN.match(name)))


def prune(root: str, keep: set[int]) -> list[int]:
    """Delete published versions not in ``keep`` (and stale temporaries); returns what was removed."""
    removed = []
    for version in published_versions(root):
        if version not in keep:
            shutil.rmtree(version_dir(root, version), ignore_errors=True)
            removed.append(version)
    for name in os.listdir(root) if os.path.isdir(root) else []:
        if name.startswith(".weight_v") and ".tmp-" in name:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return removed
