"""Child processes that cannot outlive vime: own process group, parent-death signal, run token.

Three layers of clean-up, from the normal path to the last resort:

1. ``ManagedProcess.stop()``: SIGTERM to the child's process group, then SIGKILL to the group and to
   every descendant psutil can still find (vLLM's EngineCore/Worker children, a shell's grandchild).
   It also runs at interpreter exit (atexit) for every child still running, so an unhandled
   exception in the driver does not leave engines behind.
2. ``PR_SET_PDEATHSIG``: if the vime process that started the child dies (even by SIGKILL), the
   kernel SIGKILLs the child. Grandchildren do not inherit this, so they can survive as orphans.
3. ``kill_processes_with_token()``: every child gets ``VIME_RUN_TOKEN`` in its environment, which its
   own children inherit; a sweep at the end of a run kills whatever still carries the run's token.

Measured with vLLM: when the API server dies by SIGKILL (e.g. through PDEATHSIG), its EngineCore and
Worker processes keep running (seen for 30 s+, re-parented to PID 1), so layer 3 is needed. They
rename themselves with setproctitle, which by default overwrites /proc/PID/environ and would hide
the token; every child therefore gets ``SPT_NOENV=1``, which makes setproctitle leave it intact.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ctypes.util
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import psutil

RUN_TOKEN_ENV = "VIME_RUN_TOKEN"

_PR_SET_PDEATHSIG = 1
# Loaded once here: calling CDLL in the forked child (preexec_fn) could deadlock on the loader's
# locks if another thread held them at fork time.
_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


# Started children not stopped yet, for the interpreter-exit clean-up; held strongly so that a child
# whose ManagedProcess the program dropped is still stopped.
_LIVE: set[ManagedProcess] = set()


@atexit.register
def _stop_live_children() -> None:
    for proc in list(_LIVE):
        # A forked copy of the driver (which inherits this set) must not stop the driver's children.
        if proc.owner_pid == os.getpid():
            proc.stop(timeout=5)


def _die_with_parent(parent_pid: int) -> None:
    """preexec_fn: ask the kernel to SIGKILL this child when its parent exits.

    Only async-signal-safe work happens here (two syscalls), as required between fork and exec.
    The getppid check closes the race where the parent died before prctl took effect.
    """
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)


class ManagedProcess:
    """One command run as a child in its own session, logging to a file.

    ``env`` is added on top of the current environment; ``VIME_RUN_TOKEN`` is always set to
    ``run_token``. Caveat of PDEATHSIG: Linux sends it when the *thread* that forked the child exits,
    so start long-lived children from a thread that lives as long as they should (the main thread).
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        log_path: str | os.PathLike[str],
        run_token: str,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        name: str | None = None,
    ):
        if not argv:
            raise ValueError("argv must not be empty")
        if not run_token:
            raise ValueError("run_token must be a non-empty string")
        self.argv = [str(a) for a in argv]
        self.log_path = Path(log_path)
        self.run_token = run_token
        self.extra_env = dict(env or {})
        self.cwd = cwd
        self.name = name or Path(self.argv[0]).name
        self._popen: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self.owner_pid: int | None = None  # the process that started the child

    def __repr__(self) -> str:
        return f"ManagedProcess({self.name!r}, pid={self.pid}, log={str(self.log_path)!r})"

    @property
    def pid(self) -> int | None:
        return self._popen.pid if self._popen is not None else None

    @property
    def returncode(self) -> int | None:
        """Exit status once the child has exited (negative: killed by that signal), else None."""
        return self._popen.poll() if self._popen is not None else None

    def start(self) -> ManagedProcess:
        with self._lock:
            if self._popen is not None:
                raise RuntimeError(f"{self.name} already started (pid {self._popen.pid})")
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            env = {
                **os.environ,
                **self.extra_env,
                RUN_TOKEN_ENV: self.run_token,
                # setproctitle (vLLM's EngineCore/Worker, vllm-router) otherwise overwrites the memory
                # /proc/PID/environ reads, hiding the run token from kill_processes_with_token.
                "SPT_NOENV": "1",
            }
            parent_pid = self.owner_pid = os.getpid()
            # The child keeps its own copy of the log descriptor; ours is closed right after spawning.
            with open(self.log_path, "ab", buffering=0) as log:
                self._popen = subprocess.Popen(
                    self.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=self.cwd,
                    start_new_session=True,  # own process group: stop() signals the whole tree at once
                    preexec_fn=lambda: _die_with_parent(parent_pid),
                    close_fds=True,
                )
            _LIVE.add(self)
        return self

    def alive(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the child to exit; raises subprocess.TimeoutExpired after ``timeout``."""
        if self._popen is None:
            raise RuntimeError(f"{self.name} was never started")
        return self._popen.wait(timeout)

    def log_tail(self, n_lines: int = 40) -> str:
        return read_log_tail(self.log_path, n_lines)

    def stop(self, timeout: float = 10.0) -> int | None:
        """Terminate the child and everything it started; returns its exit status.

        SIGTERM goes to the process group so that well-behaved trees shut down cleanly; whatever is
        still running after ``timeout`` seconds gets SIGKILL. Descendants are collected *before*
        signalling because once the leader dies they are re-parented and cannot be found from it.
        Safe to call more than once, and on a child that has already exited.
        """
        with self._lock:
            popen = self._popen
            if popen is None:
                return None
            descendants = _descendants(popen.pid)
            pgid = popen.pid  # start_new_session: the child leads a group with its own pid
            _signal_group(pgid, signal.SIGTERM)
            for proc in descendants:
                _signal_process(proc, signal.SIGTERM)
            try:
                popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
            still_running = _wait_gone(descendants, timeout=max(0.0, min(timeout, 2.0)))
            # Anything left, including children spawned during shutdown, is killed outright.
            descendants = still_running + _descendants(popen.pid)
            _signal_group(pgid, signal.SIGKILL)
            for proc in descendants:
                _signal_process(proc, signal.SIGKILL)
            if popen.poll() is None:
                popen.kill()
            code = popen.wait()
            _wait_gone(descendants, timeout=5)
            _LIVE.discard(self)
            return code


@contextlib.contextmanager
def environment_carries_run_token(token: str) -> Iterator[None]:
    """While inside: processes that a library starts from this process's own environment (wandb's service,
    wandb-core) carry the run token, so that the teardown's sweep and the reaper stop them like the run's
    other processes. The driver's environment carries its own token only from Ray's start on
    (workers/cluster.start_ray), and such a library does not go through ManagedProcess: without this a
    process it starts before then escapes both, and one in a session of its own (wandb-core) outlives even
    a kill of the driver's process group.

    It changes os.environ for the whole process: use it only around the start of such a library, at
    start-up, before the threads that start the run's other processes."""
    saved = {name: os.environ.get(name) for name in (RUN_TOKEN_ENV, "SPT_NOENV")}
    os.environ[RUN_TOKEN_ENV], os.environ["SPT_NOENV"] = token, "1"
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def read_log_tail(path: str | os.PathLike[str], n_lines: int = 40, max_bytes: int = 256 * 1024) -> str:
    """The last ``n_lines`` lines of a log file (reads at most ``max_bytes`` from its end)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except FileNotFoundError:
        return ""
    lines = data.decode("utf-8", errors="replace").splitlines()
    return "\n".join(lines[-n_lines:])


def kill_processes_with_token(token: str, exclude_pids: Iterable[int] = ()) -> list[int]:
    """SIGKILL every process whose environment carries ``VIME_RUN_TOKEN == token``.

    The last-resort sweep at the end of a run: it finds orphans that neither stop() nor PDEATHSIG
    reached. The calling process is always excluded. Processes whose environment cannot be read
    (other users' processes) are skipped. Returns the pids that were signalled.
    """
    if not token:
        raise ValueError("token must be a non-empty string")
    victims: list[psutil.Process] = []
    for proc in _with_token(token, {os.getpid(), *exclude_pids}):
        try:
            proc.kill()
            victims.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue  # gone already, or not ours to kill
    _wait_gone(victims, timeout=5)
    return [p.pid for p in victims]


def sweep_run_processes(
    token: str, exclude_pids: Iterable[int] = (), *, settle: float = 1.0, timeout: float = 30.0
) -> list[str]:
    """Kill every process carrying the run token until sweeps find none for ``settle`` seconds.

    One sweep is not enough: a process killed while it was spawning a child (vLLM's EngineCore starting
    its Worker) leaves that child to appear after the sweep. When the sweeps never found a process to kill
    (an orderly teardown stopped everything), two empty sweeps in a row are enough: a process of the run
    only ever comes from another one, and none was alive to start it. Returns "pid (command)" for each
    process of the run still alive after ``timeout`` seconds (empty: none is left), so that a caller says
    that every process was stopped only when it is true."""
    excluded = {os.getpid(), *exclude_pids}
    deadline = time.monotonic() + timeout
    quiet_since: float | None = None
    killed_any = False
    while True:
        killed = kill_processes_with_token(token, exclude_pids=excluded)
        killed_any = killed_any or bool(killed)
        now = time.monotonic()
        if killed:
            quiet_since = None
        elif quiet_since is None:
            quiet_since = now
        elif not killed_any or now - quiet_since >= settle:
            return []
        if now >= deadline:
            return [_describe(p) for p in _with_token(token, excluded) if _running(p)]
        time.sleep(0.2)


def processes_with_tokens(tokens: Iterable[str], exclude_pids: Iterable[int] = ()) -> dict[str, list[psutil.Process]]:
    """The running processes carrying each of ``tokens``, found in one scan of the process table.

    For the start-up check of earlier incarnations (vime/runtime/incarnations.py): one scan finds whether
    any of them left something, where a sweep per token would cost a settle time each. Zombies are left
    out (they hold no memory; their parent or init reaps them)."""
    wanted = set(tokens)
    found: dict[str, list[psutil.Process]] = {}
    excluded = {os.getpid(), *exclude_pids}
    for proc in psutil.process_iter():
        try:
            if proc.pid in excluded:
                continue
            token = proc.environ().get(RUN_TOKEN_ENV)
            if token in wanted and _running(proc):
                found.setdefault(token, []).append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def describe_process(proc: psutil.Process) -> str:
    """The process as "pid (command)", for messages that say what was stopped."""
    return _describe(proc)


def _with_token(token: str, excluded: set[int]) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid not in excluded and proc.environ().get(RUN_TOKEN_ENV) == token:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid} ({' '.join(proc.cmdline()[:3]) or proc.name()})"
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return str(proc.pid)


def _wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until the processes have exited (zombies count as exited); returns those still running.

    Polls instead of psutil.wait_procs, which reaps our own children and would leave their Popen
    objects reporting a wrong exit status.
    """
    deadline = time.monotonic() + timeout
    while True:
        running = [p for p in procs if _running(p)]
        if not running or time.monotonic() >= deadline:
            return running
        time.sleep(0.05)


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass  # the whole group has exited


def _signal_process(proc: psutil.Process, sig: signal.Signals) -> None:
    try:
        proc.send_signal(sig)
    except psutil.NoSuchProcess:
        pass
