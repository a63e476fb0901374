"""The reaper and the incarnation record, with real processes and real SIGKILLs (vime/runtime/reaper.py,
vime/runtime/incarnations.py).

A fake driver (a python process in its own session, as `vime train` is under the fault harness) starts
its reaper the way the driver does, then a tree of processes carrying its token that the parent-death
signal cannot reach: a ManagedProcess whose grandchild is re-parented when its parent dies, and a
process that left the driver's session. The tests kill the driver and look for survivors.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest

from tests.unit.test_process import _gone, _wait_for
from vime.runtime import incarnations
from vime.runtime.process import RUN_TOKEN_ENV, kill_processes_with_token, processes_with_tokens
from vime.runtime.reaper import OwnerState, owner_alive, process_start_time, watch_owner

PY = sys.executable
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# argv: token, log dir, "reaper" or "none", "clean" or "hold". Prints one JSON line of pids, then
# either says `clean` to its reaper (as the end of a teardown does) and sleeps, or just sleeps.
DRIVER = textwrap.dedent("""
    import json, os, subprocess, sys, time
    from vime.runtime.process import RUN_TOKEN_ENV, ManagedProcess
    from vime.runtime.reaper import Reaper
    token, logs, mode, end = sys.argv[1:5]
    reaper = Reaper.start(token, log_path=os.path.join(logs, "reaper.log")) if mode == "reaper" else None
    os.environ[RUN_TOKEN_ENV] = token   # as the driver does before it starts Ray
    # A ManagedProcess (parent-death signal) whose own child is out of reach of that signal, like
    # vLLM's API server and its EngineCore.
    tree = ManagedProcess([sys.executable, "-c",
        "import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);"
        "print(c.pid, flush=True); time.sleep(600)"], log_path=os.path.join(logs, "tree.log"), run_token=token).start()
    # A process that left the driver's session, so that a group kill misses it (like a daemon of Ray's).
    escaped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    deadline = time.monotonic() + 30
    while not open(os.path.join(logs, "tree.log")).read().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    grandchild = int(open(os.path.join(logs, "tree.log")).read().split()[0])
    if end == "clean":
        reaper.finished_cleanly()
    print(json.dumps({"reaper": reaper and reaper.pid, "tree": tree.pid, "grandchild": grandchild,
                      "escaped": escaped.pid}), flush=True)
    time.sleep(600)
""")


def _start_driver(tmp_path: Path, token: str, mode: str, end: str = "hold") -> tuple[subprocess.Popen, dict]:
    driver = subprocess.Popen(
        [PY, "-c", DRIVER, token, str(tmp_path), mode, end],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    line = driver.stdout.readline()
    assert line, "the fake driver printed nothing"
    return driver, json.loads(line)


@pytest.fixture
def token():
    t = f"test-reaper-{uuid.uuid4()}"
    yield t
    kill_processes_with_token(t)  # only when a test failed is anything left to clean


def _left(token: str) -> list[int]:
    return [p.pid for p in processes_with_tokens([token]).get(token, [])]


@pytest.mark.parametrize("kill", ["driver alone", "process group"])
def test_reaper_stops_every_process_of_a_killed_driver(tmp_path: Path, token: str, kill: str):
    driver, pids = _start_driver(tmp_path, token, "reaper")
    # tree, grandchild, escaped (the driver's /proc environ is the one it was started with: no token). Waited
    # for, not read once: a scan on a loaded machine missed one of the three just after they started (seen
    # once with two pytest workers), and the test is about what happens after the kill.
    expected = sorted(pids[name] for name in ("tree", "grandchild", "escaped"))
    assert _wait_for(lambda: sorted(_left(token)) == expected, 10), (_left(token), expected)
    reaper = psutil.Process(pids["reaper"])
    # Out of the driver's session (a group kill misses it) and without the run's token.
    assert os.getsid(reaper.pid) == reaper.pid != os.getsid(driver.pid)
    assert reaper.environ().get(RUN_TOKEN_ENV) != token
    killed = time.monotonic()
    if kill == "driver alone":  # what the OOM killer does
        driver.kill()
    else:
        os.killpg(driver.pid, signal.SIGKILL)
    driver.wait(10)
    # Nothing of the run is left a few seconds later, and this test swept nothing itself.
    assert _wait_for(lambda: not _left(token), 10), _left(token)
    seconds = time.monotonic() - killed
    assert seconds < 10, seconds
    # Gone, not only token-less: while the kernel tears a killed process down it reads an empty /proc
    # environ before it is a zombie, so the scan above can miss it for a moment (seen on a loaded machine).
    for name in ("tree", "grandchild", "escaped"):
        assert _wait_for(lambda: _gone(pids[name]), 10), name  # noqa: B023 - called at once, in this iteration
    assert _wait_for(lambda: _gone(reaper.pid), 10), "the reaper outlived its sweep"
    log = (tmp_path / "reaper.log").read_text()
    assert f"the driver (pid {driver.pid}) is gone without its teardown" in log
    assert "no process of the run is left" in log


def test_without_a_reaper_the_orphans_survive(tmp_path: Path, token: str):
    # The control: what the reaper is for. PDEATHSIG stops the driver's direct child, not its grandchild
    # or a process that left the session; a test of the reaper that did not see these would prove nothing.
    driver, pids = _start_driver(tmp_path, token, "none")
    driver.kill()
    driver.wait(10)
    assert _wait_for(lambda: _gone(pids["tree"]), 10), "the parent-death signal did not reach the direct child"
    time.sleep(3)
    assert not _gone(pids["grandchild"]) and not _gone(pids["escaped"])
    assert sorted(_left(token)) == sorted([pids["grandchild"], pids["escaped"]])


def test_a_clean_teardown_releases_the_reaper_without_a_sweep(tmp_path: Path, token: str):
    driver, pids = _start_driver(tmp_path, token, "reaper", end="clean")
    assert _gone(pids["reaper"]), "finished_cleanly waits for the reaper's exit"
    driver.kill()  # the driver dies after its teardown: the reaper is not there to sweep
    driver.wait(10)
    time.sleep(2)
    assert not _gone(pids["grandchild"]) and not _gone(pids["escaped"])
    assert not (tmp_path / "reaper.log").read_text().strip()


def test_watch_owner_tells_a_clean_end_from_a_death(tmp_path: Path):
    me = os.getpid()
    read_end, write_end = os.pipe()
    os.write(write_end, b"clean\n")
    os.close(write_end)
    assert watch_owner(read_end, me, process_start_time(me)) is OwnerState.FINISHED_CLEANLY
    os.close(read_end)
    read_end, write_end = os.pipe()
    os.close(write_end)  # EOF without the word: the owner died
    assert watch_owner(read_end, me, process_start_time(me)) is OwnerState.GONE
    os.close(read_end)
    # A pipe kept open (leaked into a fork) but the owner's pid gone: the pid watch sees it.
    read_end, write_end = os.pipe()
    sleeper = subprocess.Popen([PY, "-c", "import time; time.sleep(600)"])
    start = process_start_time(sleeper.pid)
    sleeper.kill()  # left a zombie (not waited for): a zombie is dead
    started = time.monotonic()
    assert watch_owner(read_end, sleeper.pid, start, poll=0.1) is OwnerState.GONE
    assert time.monotonic() - started < 5
    sleeper.wait()
    # The same pid with another start time is another process.
    assert owner_alive(me, process_start_time(me)) and not owner_alive(me, process_start_time(me) - 100)
    os.close(read_end)
    os.close(write_end)


def _detached_with_token(token: str) -> subprocess.Popen:
    return subprocess.Popen(
        [PY, "-c", "import time; time.sleep(600)"], env={**os.environ, RUN_TOKEN_ENV: token}, start_new_session=True
    )


def test_startup_sweeps_what_a_dead_incarnation_left_and_says_so(tmp_path: Path, token: str):
    data_dir = str(tmp_path / "rollout_data")
    # A dead incarnation (its driver is gone, and so is its reaper) that left two processes.
    dead_driver = subprocess.Popen([PY, "-c", "import time; time.sleep(600)"])
    dead = incarnations.Incarnation(
        token=token,
        pid=dead_driver.pid,
        pid_start=process_start_time(dead_driver.pid),
        host=os.uname().nodename,
        started=time.time(),
        run_dir=str(tmp_path / "run"),
    )
    incarnations.record(data_dir, dead)
    leftovers = [_detached_with_token(token), _detached_with_token(token)]
    dead_driver.kill()
    dead_driver.wait()
    # A live incarnation (a driver still running, on the same queue) whose processes must be kept.
    live_token = f"{token}-live"
    live_driver = subprocess.Popen([PY, "-c", "import time; time.sleep(600)"])
    live_child = _detached_with_token(live_token)
    try:
        incarnations.record(
            data_dir,
            incarnations.Incarnation(
                token=live_token,
                pid=live_driver.pid,
                pid_start=process_start_time(live_driver.pid),
                host=os.uname().nodename,
                started=time.time(),
                run_dir="elsewhere",
            ),
        )
        with open(incarnations.path_in(data_dir), "ab") as f:
            f.write(b'{"token": "torn')  # a line torn by a crash mid-write is skipped, not fatal
        assert _wait_for(lambda: len(_left(token)) == 2, 10)
        said: list[str] = []
        guard = incarnations.RunGuard.start(
            f"{token}-new", data_dir=data_dir, run_dir=str(tmp_path / "new"), say=said.append
        )
        try:
            assert all(p.poll() is not None for p in leftovers), "the start-up sweep left a dead run's process"
            assert len(said) == 1 and said[0].startswith(
                f"stopped 2 process(es) left by an earlier run (token {token[:12]}, driver pid {dead_driver.pid}"
            ), said
            assert live_child.poll() is None, "a live run's process was swept"
            tokens = [r.token for r in incarnations.read(data_dir)]
            assert tokens == [live_token, f"{token}-new"], tokens  # the dead one's record is dropped
            assert incarnations.read(data_dir)[-1].reaper_pid == guard.reaper.pid
        finally:
            guard.close(everything_stopped=True)
        assert [r.token for r in incarnations.read(data_dir)] == [live_token]
        # Nothing left by anyone: the next start says nothing.
        said.clear()
        incarnations.RunGuard.start(
            f"{token}-third", data_dir=data_dir, run_dir=str(tmp_path / "third"), say=said.append
        ).close(everything_stopped=True)
        assert said == []
    finally:
        for proc in (live_driver, live_child, *leftovers):
            proc.kill()
            proc.wait()
