"""The JuiceFS mount under --rollout-data-dir, read rather than declared (docs/juicefs.md).

straw trusts a JuiceFS directory only with a deployment declaration (``straw.backend.FilesystemBackend``,
profile ``juicefs``): a direct client mount, no write-back cache, no open-file cache, no readdir cache, the
client's version and a statement of the services' durability. Written by hand, such a declaration says what
the user believes, not what the node mounted. Here it is derived from the mount itself, at start-up:

- ``/proc/mounts``: the file-system type of the mount that holds the directory (``fuse.juicefs``: this
  node's own JuiceFS client, not an NFS or S3 gateway in front of one) and its options (not read-only);
- ``MOUNTPOINT/.config``: the JSON the client publishes of its running settings (JuiceFS >= 1.0).

A mount whose settings break straw's assumptions is refused, naming the ``juicefs mount`` option and the fix.
An explicit declaration (--rollout-storage-declaration) is still accepted, and must agree with the mount.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

from vime.errors import UserError

__all__ = [
    "JuiceFSMountRefused",
    "JuiceFSSettings",
    "MountEntry",
    "checked_declaration",
    "mount_containing",
    "parse_proc_mounts",
]

FS_TYPE = "fuse.juicefs"
# JuiceFS states its close-to-open consistency for its default kernel metadata caches (1 s); its docs advise
# against longer ones without qualifying them, and straw was qualified on the defaults.
MAX_KERNEL_CACHE_S = 1.0
NS = 1e9  # the durations of .config are Go time.Duration values: nanoseconds


class JuiceFSMountRefused(UserError, ValueError):
    """The mount under --rollout-data-dir does not give what the queue needs; one line per problem, each
    naming the ``juicefs mount`` option (or the flag) and the fix."""


@dataclasses.dataclass(frozen=True)
class MountEntry:
    """One line of /proc/mounts."""

    source: str
    mount_point: str
    fs_type: str
    options: tuple[str, ...]


def _unescape(field: str) -> str:
    # The kernel writes a space, tab, newline or backslash in a path as a 3-digit octal escape (\040 ...).
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_proc_mounts(text: str) -> list[MountEntry]:
    entries = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 4:
            source, point, fs_type, options = (_unescape(f) for f in fields[:4])
            entries.append(MountEntry(source, point, fs_type, tuple(options.split(","))))
    return entries


def mount_containing(path: str, entries: list[MountEntry]) -> MountEntry:
    """The mount that holds ``path`` (which need not exist yet): the longest mount point above its real path;
    of several mounts on one point, the last (it hides the others)."""
    real = os.path.realpath(path)
    best: MountEntry | None = None
    for entry in entries:
        point = entry.mount_point
        if (real == point or real.startswith(point.rstrip("/") + "/")) and (
            best is None or len(point) >= len(best.mount_point)
        ):
            best = entry
    assert best is not None, f"no mount holds {real}; /proc/mounts always has '/'"
    return best


@dataclasses.dataclass(frozen=True)
class JuiceFSSettings:
    """The settings of a running JuiceFS client that the queue depends on, from its ``.config``."""

    version: str
    volume: str
    storage: str  # the object storage's kind: s3, minio, file ...
    writeback: bool  # --writeback: fsync returns once a block is in the local cache, uploaded later
    upload_delay_s: float  # --upload-delay (with --writeback)
    kernel_writeback_cache: bool  # -o writeback_cache: the kernel buffers writes and owns the file size
    open_cache_s: float  # --open-cache: an open file's attributes and chunks are reused without a check
    readdir_cache: bool  # --readdir-cache: the kernel caches directory listings
    attr_cache_s: float  # --attr-cache
    entry_cache_s: float  # --entry-cache
    dir_entry_cache_s: float  # --dir-entry-cache
    negative_entry_cache_s: float  # --negative-entry-cache: "no such file" remembered
    read_only: bool  # --read-only
    locks: bool  # the client serves flock/fcntl locks (straw's catalog lock)

    @classmethod
    def from_config(cls, config: dict) -> JuiceFSSettings:
        meta, chunk, fmt = config.get("Meta", {}), config.get("Chunk", {}), config.get("Format", {})
        fuse = config.get("FuseOpts") or {}
        return cls(
            version=str(config.get("Version", "")),
            volume=str(fmt.get("Name", "")),
            storage=str(fmt.get("Storage", "")),
            writeback=bool(chunk.get("Writeback", False)),
            upload_delay_s=chunk.get("UploadDelay", 0) / NS,
            kernel_writeback_cache=bool(fuse.get("EnableWriteback", False))
            or "writeback_cache" in (fuse.get("Options") or []),
            open_cache_s=meta.get("OpenCache", 0) / NS,
            readdir_cache=bool(config.get("ReaddirCache", False)),
            attr_cache_s=config.get("AttrTimeout", 0) / NS,
            entry_cache_s=config.get("EntryTimeout", 0) / NS,
            dir_entry_cache_s=config.get("DirEntryTimeout", 0) / NS,
            negative_entry_cache_s=config.get("NegEntryTimeout", 0) / NS,
            read_only=bool(meta.get("ReadOnly", False)),
            locks=bool(fuse.get("EnableLocks", True)),
        )

    def problems(self) -> list[str]:
        """What breaks straw's durability or visibility assumptions: one line each, the option and the fix."""
        found = []
        if self.writeback:
            found.append(
                "write-back caching is on (--writeback): fsync returns before the data reaches object storage, "
                "so a group the queue accepted can be lost with this node, and other nodes read it only after "
                "the upload; remount without --writeback"
            )
        elif self.upload_delay_s > 0:
            found.append(f"--upload-delay {self.upload_delay_s:g}s delays uploads; remount without --upload-delay")
        if self.kernel_writeback_cache:
            found.append(
                "the kernel's write-back cache is on (-o writeback_cache): this node keeps file sizes of its own "
                "and misses appends by other nodes; remount without -o writeback_cache"
            )
        if self.open_cache_s > 0:
            found.append(
                f"the open-file cache is on (--open-cache {self.open_cache_s:g}s): a reopened file is not checked "
                "for another node's appends, which straw's close-to-open reads rely on; remount with --open-cache 0"
            )
        if self.readdir_cache:
            found.append(
                "the kernel's readdir cache is on (--readdir-cache): new packs and writers of other nodes stay "
                "unlisted; remount without --readdir-cache"
            )
        for option, seconds in (
            ("--attr-cache", self.attr_cache_s),
            ("--entry-cache", self.entry_cache_s),
            ("--dir-entry-cache", self.dir_entry_cache_s),
        ):
            if seconds > MAX_KERNEL_CACHE_S:
                found.append(
                    f"{option} {seconds:g}s is longer than the {MAX_KERNEL_CACHE_S:g}s JuiceFS states its "
                    f"close-to-open consistency for; remount with {option} {MAX_KERNEL_CACHE_S:g} (the default) "
                    "or less"
                )
        if self.negative_entry_cache_s > 0:
            found.append(
                f"--negative-entry-cache {self.negative_entry_cache_s:g}s remembers missing files, so a pack "
                "another node has just created reads as absent; remount with --negative-entry-cache 0 (the default)"
            )
        if self.read_only:
            found.append("the client is read-only (--read-only); the queue writes: remount without --read-only")
        if not self.locks:
            found.append("the client serves no file locks; straw's catalog needs them: remount with locks enabled")
        if not self.version:
            found.append("its .config names no client version; upgrade the JuiceFS client (>= 1.0)")
        return found


def read_settings(entry: MountEntry) -> JuiceFSSettings:
    path = os.path.join(entry.mount_point, ".config")
    try:
        with open(path) as f:
            return JuiceFSSettings.from_config(json.load(f))
    except FileNotFoundError:
        raise JuiceFSMountRefused(
            f"--rollout-storage-profile juicefs: {path} is missing, so the JuiceFS client's settings cannot be "
            "checked; remount without --hide-internal (JuiceFS >= 1.0 publishes it)"
        ) from None
    except (OSError, json.JSONDecodeError) as error:
        raise JuiceFSMountRefused(f"--rollout-storage-profile juicefs: cannot read {path}: {error}") from None


def derived_declaration(entry: MountEntry, settings: JuiceFSSettings) -> dict:
    """straw's declaration, as the mount shows it (plus the caches read, for the record)."""
    return {
        "direct_mount": entry.fs_type == FS_TYPE,
        "writeback": settings.writeback,
        "open_cache": settings.open_cache_s,
        "readdir_cache": settings.readdir_cache,
        "client_version": settings.version,
        "durability_description": (
            f"read by vime from the mount at start-up: JuiceFS volume {settings.volume} at {entry.mount_point} "
            f"({entry.source}), object storage {settings.storage!r}; the durability of the metadata engine and "
            "the object storage themselves is the operator's to qualify"
        ),
        "attr_cache_s": settings.attr_cache_s,
        "entry_cache_s": settings.entry_cache_s,
        "dir_entry_cache_s": settings.dir_entry_cache_s,
    }


def checked_declaration(data_dir: str, declared: dict | None = None, *, proc_mounts: str = "/proc/mounts") -> dict:
    """The declaration straw gets for a JuiceFS queue in ``data_dir``: derived from the mount, after checking
    that the mount gives the guarantees and agrees with ``declared`` (--rollout-storage-declaration, whose
    ``durability_description`` is kept: a statement about services no mount shows). Raises
    JuiceFSMountRefused naming each problem."""
    with open(proc_mounts) as f:
        entry = mount_containing(data_dir, parse_proc_mounts(f.read()))
    where = f"--rollout-data-dir {data_dir}"
    if entry.fs_type != FS_TYPE:
        raise JuiceFSMountRefused(
            f"--rollout-storage-profile juicefs: {where} is on a {entry.fs_type} file system (mounted at "
            f"{entry.mount_point}), not a JuiceFS client's mount ({FS_TYPE}); mount the volume on this node with "
            "`juicefs mount`, or run on one machine with --rollout-storage-profile local"
        )
    problems = []
    if "ro" in entry.options:
        problems.append(f"{entry.mount_point} is mounted read-only (/proc/mounts: ro); the queue writes")
    settings = read_settings(entry)
    problems += settings.problems()
    derived = derived_declaration(entry, settings)
    for key, value in (declared or {}).items():
        if key != "durability_description" and key in derived and derived[key] != value:
            problems.append(
                f"--rollout-storage-declaration says {key}={value!r}, the mount has {derived[key]!r}; "
                f"correct the declaration, or leave it out (vime reads the mount)"
            )
    if problems:
        lines = "\n  ".join(problems)
        raise JuiceFSMountRefused(
            f"--rollout-storage-profile juicefs: the JuiceFS mount at {entry.mount_point} ({where}) does not "
            f"give what the queue needs:\n  {lines}"
        )
    if declared and declared.get("durability_description"):
        derived["durability_description"] = declared["durability_description"]
    return derived
