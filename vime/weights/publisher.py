"""The trainer's side of the disk transport: which versions are full, which are deltas (docs/weights.md).

With ``--update-weight-mode delta`` the trainer keeps the full files of the version it published
last in a scratch folder (``<weight dir>/.trainer/``): the next version is encoded against them.
A version is published full when

- it is this process's first publication (start, resume: the scratch folder of an earlier
  process is not trusted and is removed),
- the version before it was not published by this process (no parent to encode against),
- the caller asks (``force_full``: an engine does not hold the parent, e.g. a newly added one),
- or ``full_interval - 1`` deltas have been published since the last full version, which bounds
  the chain a reader may have to replay.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable

import msgspec

from vime.weights import disk


class Publication(msgspec.Struct, frozen=True):
    """What one publication wrote (returned to the driver, logged as metrics)."""

    version: int
    path: str
    mode: str  # full | delta
    parent: int | None
    published_bytes: int  # bytes written to the weight directory
    full_bytes: int  # bytes of the full version it stands for
    seconds: float


class _Held(msgspec.Struct):
    version: int
    path: str
    files: dict[str, str]


class WeightPublisher:
    def __init__(
        self,
        root: str,
        *,
        keep: int,
        scratch: str | None = None,
        encoding: str = "xor",
        checksum: str | None = None,
    ):
        self.root = root
        self.keep = keep
        self.encoding = encoding  # --update-weight-delta-encoding
        self.checksum = checksum  # --update-weight-delta-checksum (an algorithm usable here)
        self.scratch = scratch or os.path.join(root, ".trainer")
        shutil.rmtree(self.scratch, ignore_errors=True)  # an earlier process's: never trusted
        self.held: _Held | None = None
        self.deltas_since_full = 0

    def publish(
        self,
        version: int,
        write: Callable[[str], None],
        *,
        mode: str = "full",
        full_interval: int = 10,
        force_full: bool = False,
    ) -> Publication:
        """Publish ``version`` (``write(folder)`` writes its full files) and prune old versions."""
        if mode not in ("full", "delta"):
            raise ValueError(f"mode must be 'full' or 'delta', not {mode!r}")
        if full_interval < 1:
            raise ValueError(f"full_interval must be >= 1, got {full_interval}")
        started = time.perf_counter()
        if mode == "full":
            self._drop_held()
            path = disk.publish_full(self.root, version, write)
            size = disk.folder_bytes(path, list(disk.read_manifest(path).files))
            publication = Publication(
                version=version, path=path, mode="full", parent=None, published_bytes=size, full_bytes=size, seconds=0.0
            )
        else:
            publication = self._publish_with_parent(version, write, full_interval, force_full)
        disk.prune(self.root, set(range(version - self.keep, version + 1)))
        return msgspec.structs.replace(publication, seconds=time.perf_counter() - started)

    def _publish_with_parent(
        self, version: int, write: Callable[[str], None], full_interval: int, force_full: bool
    ) -> Publication:
        os.makedirs(self.scratch, exist_ok=True)
        new = os.path.join(self.scratch, f".full_v{version:06d}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            write(new)
            files = disk.checksums(new)
            full_bytes = disk.folder_bytes(new)
            held = self.held
            as_delta = (
                not force_full
                and held is not None
                and held.version == version - 1
                and self.deltas_since_full < full_interval - 1
            )
            if as_delta:
                path = disk.publish_delta(
                    self.root,
                    version,
                    parent=held.version,
                    parent_dir=held.path,
                    new_dir=new,
                    parent_files=held.files,
                    new_files=files,
                    encoding=self.encoding,
                    checksum=self.checksum,
                )
                self.deltas_since_full += 1
            else:
                path = disk.publish_full(self.root, version, lambda folder: disk.link_files(new, folder), files=files)
                self.deltas_since_full = 0
            manifest = disk.read_manifest(path)
            kept = os.path.join(self.scratch, f"full_v{version:06d}")
            self._drop_held()
            os.rename(new, kept)
            self.held = _Held(version=version, path=kept, files=files)
        finally:
            if os.path.exists(new):
                shutil.rmtree(new, ignore_errors=True)
        return Publication(
            version=version,
            path=path,
            mode=manifest.mode,
            parent=manifest.parent,
            published_bytes=disk.folder_bytes(path, list(manifest.files)),
            full_bytes=full_bytes,
            seconds=0.0,
        )

    def _drop_held(self) -> None:
        if self.held is not None:
            shutil.rmtree(self.held.path, ignore_errors=True)
            self.held = None

    def close(self) -> None:
        self.held = None
        shutil.rmtree(self.scratch, ignore_errors=True)
