"""The run's watchdog: when the driver dies without its teardown, every process of the run dies too.

The driver's teardown stops everything it started and sweeps by the run token
(``sweep_run_processes``), but a SIGKILL (the OOM killer, ``kill -9``, a lost terminal's group kill)
never reaches it. PR_SET_PDEATHSIG covers only the driver's direct children: vLLM's EngineCore and
Worker processes, Ray's workers and whatever they started are re-parented to PID 1 and keep their
memory. So ``vime train`` starts one small process of its own first, the reaper:

- it runs in its own session (``start_new_session``), so a kill of the driver's process group does
  not take it down, and it has no parent-death signal;
- it does not carry the run's token, so the sweep it runs cannot find it (and the sweep excludes
  its own pid anyway);
- it watches the driver twice: the driver holds the write end of a pipe that is the reaper's stdin
  (the kernel closes it when the driver dies, however it dies: EOF at once), and the driver's pid with
  its start time (a pid the system reused is not the driver; a zombie counts as dead). The pid check
  covers a write end that leaked into a forked copy of the driver, which would keep the pipe open;
- the driver writes ``clean`` to the pipe at the end of its teardown: the reaper then exits at once;
  on EOF or the driver's death without that word, it sweeps every process carrying the token until
  none has been found for a second, writes what it stopped to its log, and exits.

Run as ``python -m vime.runtime.reaper --token T --owner-pid P --owner-start S``.
"""

from __future__ import annotations

import argparse
import enum
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from vime.runtime.process import RUN_TOKEN_ENV, sweep_run_processes

CLEAN = b"clean\n"
POLL_SECONDS = 0.5  # how often the driver's pid is checked while the pipe stays quiet


class OwnerState(enum.Enum):
    RUNNING = "running"
    FINISHED_CLEANLY = "finished cleanly"  # it said so: its own teardown ran
    GONE = "gone"  # died (or closed the pipe) without saying so


def process_start_time(pid: int) -> float:
    """The process's start time as psutil reports it: with the pid, names one process for good."""
    return psutil.Process(pid).create_time()


def owner_alive(pid: int, start_time: float) -> bool:
    try:
        proc = psutil.Process(pid)
        # create_time is rounded differently by two readers at most by clock ticks.
        return abs(proc.create_time() - start_time) < 0.5 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def watch_owner(pipe_fd: int, pid: int, start_time: float, poll: float = POLL_SECONDS) -> OwnerState:
    """Block until the owner finishes cleanly (says ``clean``) or is gone."""
    received = b""
    while True:
        readable, _, _ = select.select([pipe_fd], [], [], poll)
        if readable:
            chunk = os.read(pipe_fd, 64)
            if not chunk:
                return OwnerState.FINISHED_CLEANLY if received.startswith(CLEAN) else OwnerState.GONE
            received += chunk
            if received.startswith(CLEAN):
                return OwnerState.FINISHED_CLEANLY
        if not owner_alive(pid, start_time):
            # A last look at the pipe: the owner may have said `clean` just before it exited.
            readable, _, _ = select.select([pipe_fd], [], [], 0)
            if readable:
                received += os.read(pipe_fd, 64)
            return OwnerState.FINISHED_CLEANLY if received.startswith(CLEAN) else OwnerState.GONE


def _say(message: str) -> None:
    print(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] reaper {os.getpid()}: {message}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vime.runtime.reaper")
    parser.add_argument("--token", required=True)
    parser.add_argument("--owner-pid", type=int, required=True)
    parser.add_argument("--owner-start", type=float, required=True)
    parser.add_argument("--sweep-timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    # Its own session has no terminal, but a signal sent to it by name (a user's kill) should not stop
    # the watch halfway: only SIGKILL does, and then nothing is left half-done.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    state = watch_owner(sys.stdin.fileno(), args.owner_pid, args.owner_start)
    if state is OwnerState.FINISHED_CLEANLY:
        return 0
    _say(
        f"the driver (pid {args.owner_pid}) is gone without its teardown: stopping the processes of run "
        f"token {args.token[:12]}"
    )
    started = time.monotonic()
    left = sweep_run_processes(args.token, timeout=args.sweep_timeout)
    seconds = time.monotonic() - started
    if left:
        _say(f"after {seconds:.1f}s these processes of the run are still alive: {'; '.join(left)}")
        return 1
    _say(f"no process of the run is left ({seconds:.1f}s)")
    return 0


class Reaper:
    """The driver's handle on its reaper process."""

    def __init__(self, popen: subprocess.Popen[bytes], token: str):
        self._popen = popen
        self.token = token

    @property
    def pid(self) -> int:
        return self._popen.pid

    @classmethod
    def start(cls, token: str, *, log_path: str | os.PathLike[str]) -> Reaper:
        """Start the reaper watching this process; call ``finished_cleanly`` at the end of the teardown."""
        if not token:
            raise ValueError("token must be a non-empty string")
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        # Without this run's token (an outer harness's token is kept: that harness may sweep us).
        env = {k: v for k, v in os.environ.items() if not (k == RUN_TOKEN_ENV and v == token)}
        me = os.getpid()
        with open(log_path, "ab", buffering=0) as log:
            popen = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "vime.runtime.reaper",
                    "--token",
                    token,
                    "--owner-pid",
                    str(me),
                    "--owner-start",
                    repr(process_start_time(me)),
                ],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # out of the driver's process group: a group kill leaves it
                close_fds=True,
            )
        return cls(popen, token)

    def finished_cleanly(self, timeout: float = 10.0) -> None:
        """Tell the reaper the teardown ran, and wait for it to exit (so that it is never left behind)."""
        stdin = self._popen.stdin
        if stdin is not None and not stdin.closed:
            try:
                stdin.write(CLEAN)
                stdin.flush()
                stdin.close()
            except BrokenPipeError:
                pass  # it is gone already
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self._popen.kill()
            self._popen.wait()


if __name__ == "__main__":
    sys.exit(main())
