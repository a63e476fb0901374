"""An engine's own full copy of the version it serves, kept so that deltas can be applied to it.

``LocalWeights.receive(published_folder)`` turns one published version into a full folder that
belongs to the engine (``<weight dir>/.engine_<index>/weight_v{N:06d}/`` by default) and that
vLLM reloads from:

- a full version is hard-linked (copied across file systems): pruning the published folder later
  does not touch the engine's copy;
- a delta is applied to the copy held, after checking that its parent is the version held (an
  out-of-order delta is refused, naming both versions) and the bytes held (the parent checksums);
  the rebuilt files are checked against the trainer's checksums before anything is kept.

The copy of the previous version is removed once the new one is complete: vLLM reads the files
only while reloading.
"""

from __future__ import annotations

import os
import shutil

from vime.weights import disk
from vime.weights.disk import WeightError, WeightManifest


class LocalWeights:
    def __init__(self, root: str):
        self.root = root
        shutil.rmtree(root, ignore_errors=True)  # an earlier process's copy is not trusted
        self.version: int | None = None
        self.path: str | None = None
        self.files: dict[str, str] = {}

    def receive(self, published: str, version: int | None = None) -> tuple[str, WeightManifest]:
        """(full local folder, manifest) for the published version folder ``published``, which
        must hold ``version`` when given."""
        manifest = disk.read_manifest(published)
        if version is not None and manifest.version != version:
            raise WeightError(f"{published} holds version {manifest.version}, not the version {version} to load")
        target = disk.version_dir(self.root, manifest.version)
        if manifest.version == self.version:
            return self.path, manifest  # already held (a retried synchronisation)
        os.makedirs(self.root, exist_ok=True)
        shutil.rmtree(target, ignore_errors=True)  # a leftover of a failed attempt
        if manifest.mode == "delta":
            if manifest.parent != self.version:
                held = "no version" if self.version is None else f"version {self.version}"
                raise WeightError(
                    f"{published}: a delta from version {manifest.parent} to version "
                    f"{manifest.version}, but this engine holds {held}; refused (out of order: "
                    "the engine needs a full version first)"
                )
            disk.apply_delta(self.path, published, target, parent_files=self.files)
        else:
            staging = target + ".tmp"
            shutil.rmtree(staging, ignore_errors=True)
            disk.link_files(published, staging, sorted(manifest.files))
            os.rename(staging, target)
        previous = self.path
        self.version, self.path, self.files = manifest.version, target, dict(manifest.full_checksums)
        if previous is not None and previous != target:
            shutil.rmtree(previous, ignore_errors=True)
        return target, manifest

    def rebuild(self, published_root: str, version: int) -> str:
        """Hold ``version`` rebuilt from the published chain in ``published_root`` (its last full
        version and the deltas after it, every file checked): how an engine that joins a running
        job catches up when the current version is a delta against one it never held."""
        target = disk.version_dir(self.root, version)
        os.makedirs(self.root, exist_ok=True)
        shutil.rmtree(target, ignore_errors=True)
        manifest = disk.reconstruct(published_root, version, target)
        previous = self.path
        self.version, self.path, self.files = version, target, dict(manifest.full_checksums)
        if previous is not None and previous != target:
            shutil.rmtree(previous, ignore_errors=True)
        return target

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        self.version, self.path, self.files = None, None, {}
