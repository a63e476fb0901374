"""The directories a run writes, and the free space left on their volumes (docs/queue-and-recovery.md,
"Disk space").

At start-up (vime/preflight.py) each directory vime will write is tried with :func:`why_unwritable`: it
exists or can be created, a file can be written in it, its volume is not full. While the run goes on,
:class:`FreeSpaceWatch` samples the free space of the queue, checkpoint and weight directories once per
step (one stat and one statvfs each), puts it in the step's record, and says once per crossing when a volume
falls below ``--min-free-disk-gb``, with the bytes per step the run fills there and what would help.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import errno
import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vime.config import TrainSettings

GB = 1e9  # --min-free-disk-gb counts decimal gigabytes, as df -H and storage vendors do
PROBE_NAME = ".vime-write-probe-{pid}"
# A probe with some data: an empty file is created even on a volume whose data blocks are all taken.
PROBE_BYTES = 4096
# Less than this free and not even one queue journal transaction or weight file of a tiny model fits.
NEARLY_FULL_BYTES = 1 << 20
# A volume warned about must be this much above the threshold before a new fall warns again: free space that
# hovers at the threshold (online GC reclaiming a pack every few steps) would otherwise warn every step.
RECOVERY_MARGIN = 1.05


def nearest_existing(path: str) -> str:
    """``path`` itself, or its closest ancestor that exists: what a mkdir and a statvfs act on."""
    current = os.path.abspath(path)
    while not os.path.lexists(current):
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    return current


def why_unwritable(path: str) -> str | None:
    """Why vime could not write files in the directory ``path`` (creating it where it does not exist yet), or
    None. Tried, not derived from permission bits: a read-only mount, an ACL, root squash on a network file
    system or a full volume show only when written to (and root passes every permission check)."""
    path = os.path.abspath(path)
    existing = nearest_existing(path)
    creates = existing != path
    if not os.path.isdir(existing):
        return f"cannot be created: {existing} is not a directory" if creates else "is not a directory"
    try:
        _probe(existing, in_new_directory=creates)
    except OSError as error:
        cause = error.strerror or str(error)
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            return f"no space left on its volume ({cause})"
        return f"cannot be created in {existing} ({cause})" if creates else f"not writable ({cause})"
    try:
        free = free_bytes(existing)
    except OSError as error:
        return f"its free space cannot be read ({error.strerror or error})"
    if free < NEARLY_FULL_BYTES:
        return f"no space left on its volume ({free / 1024:.0f} KiB free)"
    return None


def _probe(directory: str, *, in_new_directory: bool) -> None:
    """Write (and remove) a probe file in ``directory``; ``in_new_directory``: inside a probe directory made
    there, as the run will make its own."""
    name = os.path.join(directory, PROBE_NAME.format(pid=os.getpid()))
    if not in_new_directory:
        _write_probe_file(name)
        return
    os.mkdir(name)
    try:
        _write_probe_file(os.path.join(name, "probe"))
    finally:
        os.rmdir(name)


def _write_probe_file(path: str) -> None:
    try:
        with open(path, "wb") as f:
            f.write(b"\0" * PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())  # a file system that allocates late says ENOSPC only here
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def free_bytes(path: str, statvfs: Callable[[str], Any] = os.statvfs) -> int:
    """Bytes an unprivileged writer can still write on the volume of ``path`` (or of its nearest ancestor)."""
    stats = statvfs(nearest_existing(path))
    return stats.f_bavail * stats.f_frsize


def readable_bytes(count: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(count) >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count:.0f} B"


@dataclasses.dataclass(frozen=True)
class WatchedDirectory:
    name: str  # in the record's keys: disk_free_gb/<name>
    flag: str
    path: str
    advice: tuple[str, ...] = ()  # what would save space there, said with a low-space warning


class Space(enum.Enum):
    ENOUGH = "enough"
    LOW = "low"  # warned about; said again only after it recovered


@dataclasses.dataclass
class _Volume:
    first_sample: int  # the watch's first sample of this volume: what bytes per step are measured from
    first_free: int
    space: Space = Space.ENOUGH

    def steps_since_first(self, sample: int) -> int:
        return sample - self.first_sample

    def bytes_per_step(self, sample: int, free: int) -> float | None:
        """What the volume lost per step since its first sample (other writers on it count too); None before
        a step was trained."""
        steps = self.steps_since_first(sample)
        return (self.first_free - free) / steps if steps else None


class FreeSpaceWatch:
    """The free space of the directories a run fills, sampled once per trained step (:meth:`sample`).

    Directories on one volume (one device) share its free space, its bytes per step and its warnings. Steps are
    counted as trained, not by their number: a step retrained after a trainer restart wrote its data again."""

    def __init__(
        self,
        directories: Iterable[WatchedDirectory],
        *,
        min_free_bytes: float,
        say: Callable[[str], None],
        statvfs: Callable[[str], Any] = os.statvfs,
        stat: Callable[[str], Any] = os.stat,
    ):
        self.directories = list(directories)
        self.min_free_bytes = min_free_bytes
        self._say, self._statvfs, self._stat = say, statvfs, stat
        self._volumes: dict[int, _Volume] = {}
        self._samples = 0  # taken so far: the first is the baseline, each later one follows a trained step
        self.sample()  # a volume already low is said now

    @classmethod
    def from_settings(cls, s: TrainSettings, *, say: Callable[[str], None]) -> FreeSpaceWatch:
        return cls(watched_directories(s), min_free_bytes=s.run.min_free_disk_gb * GB, say=say)

    def sample(self) -> dict[str, float]:
        """The step's record fields (``disk_free_gb/<name>``, ``disk_bytes_per_step/<name>``); says a volume's
        crossing of the threshold, down or back up."""
        sample, self._samples = self._samples, self._samples + 1
        record: dict[str, float] = {}
        on_volume: dict[int, list[WatchedDirectory]] = {}
        free_on: dict[int, int] = {}
        for directory in self.directories:
            where = nearest_existing(directory.path)
            try:
                device = self._stat(where).st_dev
                if device not in free_on:
                    free_on[device] = free_bytes(where, self._statvfs)
            except OSError:
                continue  # a volume that cannot be read this step (a network mount's hiccup) must not stop the run
            on_volume.setdefault(device, []).append(directory)
            volume = self._volumes.setdefault(device, _Volume(first_sample=sample, first_free=free_on[device]))
            record[f"disk_free_gb/{directory.name}"] = free_on[device] / GB
            rate = volume.bytes_per_step(sample, free_on[device])
            if rate is not None:
                record[f"disk_bytes_per_step/{directory.name}"] = rate
        for device, directories in on_volume.items():
            self._check(self._volumes[device], directories, free_on[device], sample)
        return record

    def _check(self, volume: _Volume, directories: list[WatchedDirectory], free: int, sample: int) -> None:
        if self.min_free_bytes <= 0:
            return
        where = " and ".join(f"{d.flag} {d.path}" for d in directories)
        if volume.space is Space.ENOUGH and free < self.min_free_bytes:
            volume.space = Space.LOW
            self._say(self._warning(volume, directories, where, free, sample))
        elif volume.space is Space.LOW and free >= self.min_free_bytes * RECOVERY_MARGIN:
            volume.space = Space.ENOUGH
            self._say(f"disk space recovered: {free / GB:.2f} GB free on the volume of {where}")

    def _warning(self, volume: _Volume, directories: list[WatchedDirectory], where: str, free: int, sample: int) -> str:
        rate, steps = volume.bytes_per_step(sample, free), volume.steps_since_first(sample)
        if rate is None:
            use = "what the run writes there per step is not measured yet"
        elif rate > 0:
            use = (
                f"the run fills {readable_bytes(rate)} per step there (measured over {steps} step(s): room for "
                f"about {free // rate:.0f} more)"
            )
        else:
            use = f"its free space has not shrunk over the {steps} step(s) measured"
        advice = [a for d in directories for a in d.advice]
        advice = [*dict.fromkeys(advice), "a bigger volume for these directories"]
        return (
            f"low disk space: {free / GB:.2f} GB free on the volume of {where}, below --min-free-disk-gb "
            f"{self.min_free_bytes / GB:g}; {use}. What would help: {'; '.join(advice)}"
        )


def watched_directories(s: TrainSettings) -> list[WatchedDirectory]:
    """The directories that grow with the run's steps, with what would slow their growth."""
    directories = []
    queue = s.queue
    if queue.rollout_data_transport == "straw":
        advice = (
            f"a smaller --rollout-queue-segment-mib (now {queue.rollout_queue_segment_mib:g}; online GC reclaims "
            "only sealed packs)"
            if queue.rollout_queue_online_gc
            else "--rollout-queue-online-gc (reclaims the trained groups while the run goes on)"
        )
        directories.append(WatchedDirectory("queue", "--rollout-data-dir", s.rollout_data_dir, (advice,)))
    save = s.checkpoint.save
    if save and "://" not in save:
        c = s.checkpoint
        interval = c.save_interval
        if c.save_retain_last is not None or c.save_retain_interval is not None:
            kept = f"--save-retain-last {c.save_retain_last or 1}" + (
                f" and every multiple of --save-retain-interval {c.save_retain_interval}"
                if c.save_retain_interval
                else ""
            )
            advice = f"a larger --save-interval (now {interval}) or keeping fewer checkpoints (now {kept})"
        elif interval:
            advice = f"a larger --save-interval (now {interval}) or --save-retain-last K (now every iter_*/ is kept)"
        else:
            advice = "--save-retain-last K (now every iter_*/ folder is kept)"
        directories.append(WatchedDirectory("checkpoint", "--save", save, (advice,)))
    if s.weights.update_weight_transport == "disk":
        keep = s.weights.keep_weight_versions
        advice = (f"a smaller --keep-weight-versions (now {keep})",) if keep > 1 else ()
        directories.append(WatchedDirectory("weights", "--update-weight-disk-dir", s.weight_dir, advice))
    return directories
