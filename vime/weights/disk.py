"""Disk transport of weights: ``weight_v{N:06d}/`` folders that engines reload (DESIGN §4).

A version is written under a temporary name, its files are checksummed into ``manifest.json``,
everything is fsynced, and only then is the folder renamed into place: an engine (or a resumed
run) either sees a complete version or none.

A version is ``full`` (the HF safetensors an engine reloads) or a ``delta`` against version
``parent`` (``vime.weights.delta`` containers, one per file of the full version; docs/weights.md).
A delta's manifest also carries the sha256 of the full files it rebuilds (``full_files``) and of
the parent's full files (``parent_files``), so that whoever applies it can check that it starts
from the right bytes and ends bit for bit where the trainer was.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable

import msgspec

from vime.errors import MemberDied
from vime.runtime.durable import fsync_path
from vime.weights import delta as codec

MANIFEST = "manifest.json"
PATTERN = re.compile(r"^weight_v(\d{6})$")
SCHEMA = 2  # 2 added delta versions (full_files, parent_files, codec); 1 was full-only


class WeightManifest(msgspec.Struct, frozen=True):
    schema: int
    version: int
    mode: str  # full | delta
    parent: int | None  # the version a delta applies to
    files: dict[str, str]  # file name in this folder -> sha256
    created: float
    full_files: dict[str, str] = {}  # delta: file of the rebuilt full version -> sha256
    parent_files: dict[str, str] = {}  # delta: file of the parent's full version -> sha256
    codec: str | None = None  # delta: compression of the containers

    @property
    def full_checksums(self) -> dict[str, str]:
        """sha256 of every file of the full version this folder stands for."""
        return self.files if self.mode == "full" else self.full_files


class WeightError(MemberDied, RuntimeError):
    """A published weight version that an engine cannot take (a manifest or a checksum that does not match, a
    broken delta chain) or a weight group that did not finish in time: the engine fleet restarts the engine,
    which loads the version again."""


def version_dir(root: str, version: int) -> str:
    return os.path.join(root, f"weight_v{version:06d}")


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def checksums(folder: str) -> dict[str, str]:
    """{file name: sha256} of the files directly in ``folder`` (the manifest excluded)."""
    return {name: sha256_file(os.path.join(folder, name)) for name in sorted(os.listdir(folder)) if name != MANIFEST}


def folder_bytes(folder: str, names=None) -> int:
    names = os.listdir(folder) if names is None else names
    return sum(os.path.getsize(os.path.join(folder, name)) for name in names)


def link_files(source: str, target: str, names=None) -> None:
    """Hard-link (copy where linking fails) the files ``names`` (default: all) of ``source`` into
    ``target``. Published files are never modified in place, so a link is as good as a copy."""
    os.makedirs(target, exist_ok=True)
    for name in sorted(os.listdir(source)) if names is None else names:
        src, dst = os.path.join(source, name), os.path.join(target, name)
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)


def _fsync_tree(path: str) -> None:
    for name in os.listdir(path):
        fsync_path(os.path.join(path, name))
    fsync_path(path)


def _staging(root: str, version: int) -> str:
    os.makedirs(root, exist_ok=True)
    return os.path.join(root, f".weight_v{version:06d}.tmp-{uuid.uuid4().hex[:8]}")


def _same_publication(existing: WeightManifest, new: WeightManifest) -> bool:
    return (
        existing.mode == new.mode
        and existing.parent == new.parent
        and existing.full_checksums == new.full_checksums
        and existing.parent_files == new.parent_files
    )


def _commit(root: str, version: int, staging: str, manifest: WeightManifest) -> str:
    """Write the manifest, fsync, rename ``staging`` to ``weight_v{N}``.

    A folder already there (an earlier attempt of the same step, or a run resumed from an older
    checkpoint whose later versions are still on disk) is kept only when it is the same
    publication (same mode, parent and full-version checksums) and still verifies; otherwise it is
    replaced, so that a version number never names weights of another lineage.
    """
    final = version_dir(root, version)
    with open(os.path.join(staging, MANIFEST), "wb") as f:
        f.write(msgspec.json.encode(manifest))
    _fsync_tree(staging)
    trash = None
    if os.path.exists(final):
        try:
            if _same_publication(verify(final), manifest):
                return final  # the caller removes the staging folder
        except WeightError:
            pass  # damaged or unreadable: replace it
        trash = os.path.join(root, f".weight_v{version:06d}.tmp-replaced-{uuid.uuid4().hex[:8]}")
        os.rename(final, trash)
    os.rename(staging, final)
    _fsync_tree(root)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    return final


def publish_full(root: str, version: int, write: Callable[[str], None], *, files: dict[str, str] | None = None) -> str:
    """Write a full version with ``write(folder)``; returns the final folder.

    ``files`` are the checksums of what ``write`` produces when the caller knows them already.
    """
    staging = _staging(root, version)
    try:
        write(staging)
        files = checksums(staging) if files is None else dict(files)
        manifest = WeightManifest(
            schema=SCHEMA, version=version, mode="full", parent=None, files=files, created=time.time()
        )
        return _commit(root, version, staging, manifest)
    finally:
        if os.path.exists(staging):
            shutil.rmtree(staging, ignore_errors=True)


def publish_delta(
    root: str,
    version: int,
    *,
    parent: int,
    parent_dir: str,
    new_dir: str,
    parent_files: dict[str, str] | None = None,
    new_files: dict[str, str] | None = None,
    codec_name: str = "zlib",
    encoding: str = "xor",
    checksum: str | None = None,
) -> str:
    """Publish version ``version`` as a delta of the full folder ``new_dir`` against the full
    folder ``parent_dir`` (version ``parent``); returns the final folder. ``encoding`` and
    ``checksum``: ``--update-weight-delta-encoding`` / ``--update-weight-delta-checksum``
    (``vime.weights.delta.encode_file``)."""
    if parent >= version:
        raise WeightError(f"a delta must come after its parent: version {version}, parent {parent}")
    staging = _staging(root, version)
    try:
        codec.encode_folder(parent_dir, new_dir, staging, codec=codec_name, encoding=encoding, checksum=checksum)
        manifest = WeightManifest(
            schema=SCHEMA,
            version=version,
            mode="delta",
            parent=parent,
            files=checksums(staging),
            created=time.time(),
            full_files=dict(new_files) if new_files is not None else checksums(new_dir),
            parent_files=dict(parent_files) if parent_files is not None else checksums(parent_dir),
            codec=codec_name,
        )
        return _commit(root, version, staging, manifest)
    finally:
        if os.path.exists(staging):
            shutil.rmtree(staging, ignore_errors=True)


def read_manifest(folder: str) -> WeightManifest:
    try:
        with open(os.path.join(folder, MANIFEST), "rb") as f:
            manifest = msgspec.json.decode(f.read(), type=WeightManifest)
    except (OSError, msgspec.DecodeError) as error:
        raise WeightError(f"{folder}: unreadable manifest ({error})") from None
    if manifest.schema > SCHEMA:
        raise WeightError(f"{folder}: manifest schema {manifest.schema} is newer than this vime ({SCHEMA})")
    if manifest.mode not in ("full", "delta") or (manifest.mode == "delta") != (manifest.parent is not None):
        raise WeightError(f"{folder}: manifest has mode {manifest.mode!r} with parent {manifest.parent}")
    return manifest


def verify(folder: str) -> WeightManifest:
    """Check a published version against its manifest; raises WeightError naming the bad file."""
    manifest = read_manifest(folder)
    for name, expected in manifest.files.items():
        path = os.path.join(folder, name)
        if not os.path.exists(path) or sha256_file(path) != expected:
            raise WeightError(f"{folder}: {name} does not match its checksum in {MANIFEST}")
    return manifest


def apply_delta(
    parent_dir: str, delta_dir: str, out_dir: str, *, parent_files: dict[str, str] | None = None
) -> WeightManifest:
    """Rebuild the full version of the delta ``delta_dir`` from the full folder ``parent_dir``
    into ``out_dir`` (which must not exist), checking every checksum on the way.

    ``parent_files`` are the parent's checksums when the caller knows them (an engine knows those
    of the version it holds): they must equal the ones the delta was made against.
    """
    manifest = verify(delta_dir)  # a damaged delta is refused before anything is decoded
    if manifest.mode != "delta":
        raise WeightError(f"{delta_dir}: not a delta (mode {manifest.mode!r})")
    if parent_files is not None and parent_files != manifest.parent_files:
        raise WeightError(
            f"{delta_dir}: made against other weights of version {manifest.parent} than the "
            f"ones in {parent_dir} (parent checksums differ); refused"
        )
    staging = f"{out_dir}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        try:
            codec.decode_folder(parent_dir, delta_dir, staging, sorted(manifest.full_files))
        except codec.DeltaError as error:
            raise WeightError(f"{delta_dir}: {error}") from None
        for name, expected in manifest.full_files.items():
            if sha256_file(os.path.join(staging, name)) != expected:
                raise WeightError(
                    f"{delta_dir}: rebuilt {name} of version {manifest.version} does not match its "
                    f"checksum (parent {parent_dir} is not the bytes the delta was made against)"
                )
        os.rename(staging, out_dir)
    finally:
        if os.path.exists(staging):
            shutil.rmtree(staging, ignore_errors=True)
    return manifest


def chain(root: str, version: int) -> list[int]:
    """The versions needed to rebuild ``version`` from disk: the last full one first, then each
    delta in order. Raises WeightError when a link is missing."""
    versions = [version]
    while True:
        manifest = read_manifest(version_dir(root, versions[-1]))
        if manifest.version != versions[-1]:
            raise WeightError(f"{version_dir(root, versions[-1])}: manifest says version {manifest.version}")
        if manifest.mode == "full":
            return versions[::-1]
        if len(versions) > 100_000:
            raise WeightError(f"the delta chain of version {version} does not end")
        versions.append(manifest.parent)


def reconstruct(root: str, version: int, out_dir: str) -> WeightManifest:
    """Materialise the full files of ``version`` into ``out_dir`` from the published chain."""
    needed = chain(root, version)
    work = f"{out_dir}.tmp-{uuid.uuid4().hex[:8]}"
    current = os.path.join(work, f"v{needed[0]}")
    try:
        first = verify(version_dir(root, needed[0]))
        link_files(version_dir(root, needed[0]), current, sorted(first.files))
        manifest = first
        for step in needed[1:]:
            following = os.path.join(work, f"v{step}")
            manifest = apply_delta(current, version_dir(root, step), following, parent_files=manifest.full_checksums)
            shutil.rmtree(current)
            current = following
        os.rename(current, out_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return manifest


def published_versions(root: str) -> list[int]:
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for name in os.listdir(root) if (m := PATTERN.match(name)))


def needed_versions(root: str, keep: set[int]) -> set[int]:
    """``keep`` plus every version their delta chains go through (unreadable links end a chain)."""
    needed = set()
    for version in keep:
        while version is not None and version not in needed and os.path.isdir(version_dir(root, version)):
            needed.add(version)
            try:
                version = read_manifest(version_dir(root, version)).parent
            except WeightError:
                version = None
    return needed | set(keep)


def prune(root: str, keep: set[int]) -> list[int]:
    """Delete published versions not in ``keep`` nor in the delta chain of a kept version (and
    stale temporaries); returns what was removed."""
    needed = needed_versions(root, keep)
    removed = []
    for version in published_versions(root):
        if version not in needed:
            shutil.rmtree(version_dir(root, version), ignore_errors=True)
            removed.append(version)
    for name in os.listdir(root) if os.path.isdir(root) else []:
        if name.startswith(".weight_v") and ".tmp-" in name:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return removed
