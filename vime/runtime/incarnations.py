"""Which runs drove a queue, so that a new run stops what a dead one left behind.

The reaper (vime/runtime/reaper.py) stops a dead driver's processes, but it can be killed too (a
lost machine takes everything; ``kill -9`` of every vime process). So each ``vime train`` records
itself in ``<rollout_data_dir>/incarnations.jsonl`` (one msgspec record a line: its run token, the
driver's pid and start time, its host and reaper) before it starts any process, and at start-up, on
the same directory, a run looks for processes carrying the token of each recorded incarnation whose
driver is no longer alive on this host, stops them and says so. The queue directory is the place:
every run that resumes the same work (``--load``, or a new run on the same ``--rollout-data-dir``)
opens it, whatever its ``--run-dir``.

Records of dead drivers are dropped once nothing of theirs is left; records of other hosts are kept
(their processes cannot be seen from here). The file is read and rewritten under an exclusive flock,
so that two runs starting at once do not lose each other's record.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from collections.abc import Callable, Iterator

import msgspec

from vime.runtime.process import describe_process, processes_with_tokens, sweep_run_processes
from vime.runtime.reaper import Reaper, owner_alive, process_start_time

FILE_NAME = "incarnations.jsonl"


class Incarnation(msgspec.Struct, frozen=True):
    """One ``vime train`` process that used the queue."""

    token: str
    pid: int
    pid_start: float  # psutil create_time of the driver: with the pid, names one process
    host: str
    started: float  # wall-clock time of the record, for messages
    run_dir: str
    reaper_pid: int | None = None
    version: int = 1


def path_in(data_dir: str) -> str:
    return os.path.join(data_dir, FILE_NAME)


def read(data_dir: str) -> list[Incarnation]:
    """The records in the file (a line torn by a crash mid-write is skipped)."""
    try:
        with open(path_in(data_dir), "rb") as f:
            return _decode(f.read())
    except FileNotFoundError:
        return []


def _decode(data: bytes) -> list[Incarnation]:
    records = []
    for line in data.splitlines():
        with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
            records.append(msgspec.json.decode(line, type=Incarnation))
    return records


@contextlib.contextmanager
def _locked(data_dir: str) -> Iterator[tuple[int, list[Incarnation]]]:
    os.makedirs(data_dir, exist_ok=True)
    fd = os.open(path_in(data_dir), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        size = os.fstat(fd).st_size
        yield fd, _decode(os.pread(fd, size, 0) if size else b"")
    finally:
        os.close(fd)  # releases the lock


def _rewrite(fd: int, records: list[Incarnation]) -> None:
    data = b"".join(msgspec.json.encode(r) + b"\n" for r in records)
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def this_process(token: str, run_dir: str, reaper_pid: int | None) -> Incarnation:
    return Incarnation(
        token=token,
        pid=os.getpid(),
        pid_start=process_start_time(os.getpid()),
        host=socket.gethostname(),
        started=time.time(),
        run_dir=run_dir,
        reaper_pid=reaper_pid,
    )


def sweep_dead(data_dir: str, say: Callable[[str], None], *, keep_token: str | None = None) -> dict[str, list[str]]:
    """Stop every process left by a dead incarnation recorded in ``data_dir``; drop its record.

    ``keep_token``: this run's own token, never swept. Returns {token: ["pid (command)", ...]} of what
    was stopped; says one line per incarnation that left something, and one for anything that would
    not die (its record is then kept, so that the next start tries again)."""
    host = socket.gethostname()
    stopped: dict[str, list[str]] = {}
    with _locked(data_dir) as (fd, records):
        dead = [r for r in records if r.host == host and r.token != keep_token and not owner_alive(r.pid, r.pid_start)]
        # One scan of the process table tells which dead incarnations left anything.
        leftovers = processes_with_tokens([r.token for r in dead]) if dead else {}
        kept_dead = set()
        for record in dead:
            found = leftovers.get(record.token)
            if not found:
                continue
            described = [describe_process(p) for p in found]
            still = sweep_run_processes(record.token, timeout=30)
            stopped[record.token] = described
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.started))
            say(
                f"stopped {len(found)} process(es) left by an earlier run (token {record.token[:12]}, driver pid "
                f"{record.pid}, started {when}, run dir {record.run_dir}): {'; '.join(described)}"
            )
            if still:
                kept_dead.add(record.token)
                say(f"these processes of that earlier run could not be stopped: {'; '.join(still)}")
        gone = {r.token for r in dead} - kept_dead
        if gone:
            _rewrite(fd, [r for r in records if r.token not in gone])
    return stopped


def record(data_dir: str, incarnation: Incarnation) -> None:
    """Add this run's record (under the lock: a concurrent start's rewrite cannot drop it)."""
    with _locked(data_dir) as (fd, records):
        _rewrite(fd, [*(r for r in records if r.token != incarnation.token), incarnation])


def forget(data_dir: str, token: str) -> None:
    """Drop a record: its run's teardown stopped everything it started."""
    with contextlib.suppress(FileNotFoundError), _locked(data_dir) as (fd, records):
        if any(r.token == token for r in records):
            _rewrite(fd, [r for r in records if r.token != token])


class RunGuard:
    """What ``vime train`` does about processes that could outlive it, from start-up to teardown.

    ``start``: stop what dead incarnations on the queue left, start the reaper, record this incarnation
    (in that order: the record names the reaper, and the first sweep must not see this run).
    ``close``: after the teardown's own sweep, release the reaper and (when that sweep left nothing)
    the record."""

    def __init__(self, data_dir: str, reaper: Reaper):
        self.data_dir, self.reaper = data_dir, reaper

    @classmethod
    def start(cls, token: str, *, data_dir: str, run_dir: str, say: Callable[[str], None]) -> RunGuard:
        sweep_dead(data_dir, say, keep_token=token)
        reaper = Reaper.start(token, log_path=os.path.join(run_dir, "logs", "reaper.log"))
        try:
            record(data_dir, this_process(token, run_dir, reaper.pid))
        except BaseException:
            reaper.finished_cleanly()
            raise
        return cls(data_dir, reaper)

    def close(self, *, everything_stopped: bool) -> None:
        self.reaper.finished_cleanly()
        if everything_stopped:
            forget(self.data_dir, self.reaper.token)
