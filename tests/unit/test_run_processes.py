"""RunProcesses' teardown, the object the driver owns for its processes (workers/run_processes.py): each group
stopped in reverse start order, the log closed before the sweep, the guard told whether everything stopped.
The groups are stand-ins that record their calls; real processes stopped by real teardowns are
tests/e2e/test_main_job.py's (Ctrl-C) and tests/faults/'s business."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from vime.runtime import interrupts, process
from vime.workers.run_processes import RunProcesses

TOKEN = "0" * 32


class Calls(list):
    def recorder(self, name: str):
        return lambda *args, **kwargs: self.append(name)


class Log:
    def __init__(self, calls: Calls):
        self.calls, self.said = calls, []

    def say(self, message: str) -> None:
        self.said.append(message)

    def write(self, record: dict) -> None:
        pass

    def close(self) -> None:
        self.calls.append("log closed")


class Guard:
    def __init__(self, calls: Calls):
        self.calls = calls

    def close(self, *, everything_stopped: bool) -> None:
        self.calls.append(f"guard closed (everything stopped: {everything_stopped})")


@pytest.fixture
def interrupt_state() -> Iterator[None]:
    """The teardown marks the interrupt state for the whole process: it is left as it was found."""
    events = (interrupts._TEARING_DOWN, interrupts._TEARDOWN_BEGAN, interrupts._HURRIED)
    for event in events:
        event.clear()
    yield
    for event in events:
        event.clear()


def processes_with(calls: Calls, monkeypatch, *, leftover: list[str]) -> RunProcesses:
    settings = SimpleNamespace(rollout=SimpleNamespace(rollout_request_timeout=1))
    processes = RunProcesses(
        settings,
        token=TOKEN,
        run_dir="/nonexistent",
        log=Log(calls),
        ray_namespace="vime-test",
        storage_declaration=None,
    )
    processes.run_guard = Guard(calls)

    def sweep(token, exclude_pids=()):
        calls.append(f"swept {token}")
        return list(leftover)

    monkeypatch.setattr(process, "sweep_run_processes", sweep)
    return processes


def test_the_teardown_stops_each_group_in_reverse_start_order_then_sweeps(monkeypatch, interrupt_state):
    calls = Calls()
    processes = processes_with(calls, monkeypatch, leftover=[])
    processes.rollout = SimpleNamespace(
        actors=["worker 0"],
        stop=calls.recorder("rollout workers stopped"),
        kill_unlaunched=calls.recorder("unlaunched"),
    )
    processes.trainer = SimpleNamespace(shutdown=calls.recorder("trainer shut down"))
    processes.serving = SimpleNamespace(
        end=calls.recorder("serving ended"),
        abort_requests=None,
        stop_steps=lambda: [("the engines", calls.recorder("engines")), ("the router", calls.recorder("router"))],
    )
    processes.teardown()
    assert calls == [
        "serving ended",  # an engine lost from now on is not restarted
        "rollout workers stopped",
        "unlaunched",
        "trainer shut down",
        "engines",
        "router",
        "log closed",  # before the sweep, which would kill wandb's service unflushed
        f"swept {TOKEN}",
        "guard closed (everything stopped: True)",
    ]
    assert processes.leftover == []


def test_a_teardown_before_anything_started_sweeps_and_says_what_it_could_not_stop(monkeypatch, interrupt_state):
    """A pre-flight check failed after the guard started: no group to stop, the sweep and the guard still run."""
    calls = Calls()
    processes = processes_with(calls, monkeypatch, leftover=["123 (python)"])
    processes.teardown()
    assert calls == ["log closed", f"swept {TOKEN}", "guard closed (everything stopped: False)"]
    assert processes.leftover == ["123 (python)"]
    assert processes.log.said == ["these processes of the run could not be stopped: 123 (python)"]
