"""A `vime train` subprocess for the end-to-end tests, and how they find the processes of a run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

from tests.conftest import REPO
from vime.runtime.process import kill_processes_with_token


def run_token(run_dir: str) -> str:
    """The token every process of the run carries in its environment (VIME_RUN_TOKEN)."""
    with open(os.path.join(run_dir, "run.json")) as f:
        return json.load(f)["run_token"]


class Run:
    """A `vime train` subprocess whose output is collected by a thread (and shown on failure).

    The thread keeps reading while the test waits for something else: a test that stopped reading the
    pipe would, once the pipe's buffer is full, stall the driver on its next line of output."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, *, own_session: bool = True):
        self.proc = subprocess.Popen(
            args,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
            start_new_session=own_session,
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    def wait_for(self, predicate, timeout: float, what: str, start: int = 0) -> int:
        """Index of the first line from ``start`` on that satisfies ``predicate``."""
        deadline = time.monotonic() + timeout
        while True:
            for i in range(start, len(self.lines)):
                if predicate(self.lines[i]):
                    return i
            if self.proc.poll() is not None and not self.reader.is_alive():
                raise AssertionError(f"the run ended before {what}:\n" + self.output[-6000:])
            assert time.monotonic() < deadline, f"no {what} within {timeout:.0f}s:\n" + self.output[-6000:]
            time.sleep(0.2)

    def finish(self, timeout: float) -> int:
        self.proc.wait(timeout=timeout)
        self.reader.join(timeout=30)
        return self.proc.returncode

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def check(self, condition: bool, message: str) -> None:
        assert condition, message + "\n--- run output ---\n" + self.output[-6000:]

    def kill(self, run_dir: str) -> None:
        """A test that failed mid-run stops what the run left (a run that ended by itself is not swept: the
        test checks that it left nothing)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
            if os.path.exists(os.path.join(run_dir, "run.json")):
                kill_processes_with_token(run_token(run_dir))
