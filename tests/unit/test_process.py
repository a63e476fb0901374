"""ManagedProcess, the token sweep and the port helpers, with real child processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest

from vime.runtime.ports import free_port, port_is_free
from vime.runtime.process import RUN_TOKEN_ENV, ManagedProcess, kill_processes_with_token, sweep_run_processes

PY = sys.executable

# A child that starts a grandchild in the same process group, prints both pids, then sleeps.
# The grandchild ignores SIGTERM, so only the SIGKILL escalation of stop() can end it.
TREE = textwrap.dedent("""
    import subprocess, sys, time
    grandchild = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    print("tree", grandchild.pid, flush=True)
    time.sleep(600)
""")


def _token() -> str:
    return f"test-{uuid.uuid4()}"


def _wait_for(predicate, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _grandchild_pid(proc: ManagedProcess) -> int:
    assert _wait_for(lambda: "tree" in proc.log_tail(), 10), proc.log_tail()
    return int(proc.log_tail().split("tree", 1)[1].split()[0])


@pytest.fixture
def token():
    t = _token()
    yield t
    kill_processes_with_token(t)  # a failing test must not leave its children behind


def test_stop_kills_whole_tree_including_sigterm_ignoring_grandchild(tmp_path: Path, token: str):
    proc = ManagedProcess([PY, "-c", TREE], log_path=tmp_path / "tree.log", run_token=token).start()
    grandchild = _grandchild_pid(proc)
    assert proc.alive() and not _gone(grandchild)
    # Started in its own session: signalling its group cannot reach the test runner.
    assert os.getpgid(proc.pid) == proc.pid != os.getpgid(0)

    started = time.monotonic()
    code = proc.stop(timeout=1.0)
    assert time.monotonic() - started < 10
    assert code == -signal.SIGTERM  # the child itself honoured SIGTERM
    assert not proc.alive()
    assert _wait_for(lambda: _gone(grandchild), 5), "grandchild survived stop()"
    assert proc.stop() == code  # idempotent


def test_stop_kills_descendant_that_left_the_process_group(tmp_path: Path, token: str):
    # A grandchild in a session of its own escapes killpg; stop() must still find it via psutil.
    code = textwrap.dedent("""
        import subprocess, sys, time
        g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        print("tree", g.pid, flush=True)
        time.sleep(600)
    """)
    proc = ManagedProcess([PY, "-c", code], log_path=tmp_path / "escape.log", run_token=token).start()
    grandchild = _grandchild_pid(proc)
    assert os.getpgid(grandchild) != proc.pid
    proc.stop(timeout=2.0)
    assert _wait_for(lambda: _gone(grandchild), 5), "escaped grandchild survived stop()"


def test_child_env_has_run_token_and_extra_env(tmp_path: Path, token: str):
    code = "import os; print(os.environ['VIME_RUN_TOKEN'], os.environ['EXTRA'], os.environ['SPT_NOENV'])"
    proc = ManagedProcess([PY, "-c", code], log_path=tmp_path / "env.log", run_token=token, env={"EXTRA": "x1"}).start()
    assert proc.wait(timeout=20) == 0
    assert proc.log_tail().strip() == f"{token} x1 1"


def test_log_tail_returns_last_lines_of_stdout_and_stderr(tmp_path: Path, token: str):
    code = "import sys\nfor i in range(100): print('line', i)\nprint('to stderr', file=sys.stderr)"
    proc = ManagedProcess([PY, "-c", code], log_path=tmp_path / "logs" / "out.log", run_token=token).start()
    assert proc.wait(timeout=20) == 0
    tail = proc.log_tail(n_lines=3).splitlines()
    assert tail == ["line 98", "line 99", "to stderr"]
    assert len(proc.log_tail().splitlines()) == 40
    assert not proc.alive() and proc.returncode == 0


def _start_parent(code: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [PY, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2]
    )


def test_child_dies_when_its_parent_is_sigkilled_and_sweep_finds_grandchild(tmp_path: Path, token: str):
    # A parent process starts a ManagedProcess tree and is then SIGKILLed: it gets no chance to clean
    # up. PR_SET_PDEATHSIG ends the direct child; the grandchild (like vLLM's EngineCore, measured)
    # is re-parented and lives on, and only the token sweep finds it.
    parent = _start_parent(f"""
        import sys, time
        from vime.runtime.process import ManagedProcess
        child = ManagedProcess([sys.executable, "-c", {TREE!r}], log_path={str(tmp_path / "orphan.log")!r},
                               run_token={token!r}).start()
        print(child.pid, flush=True)
        time.sleep(600)
    """)
    try:
        child_pid = int(parent.stdout.readline())
        assert _wait_for(lambda: "tree" in (tmp_path / "orphan.log").read_text(), 10)
        grandchild = int((tmp_path / "orphan.log").read_text().split("tree", 1)[1].split()[0])
        parent.kill()
        parent.wait(timeout=10)
        assert _wait_for(lambda: _gone(child_pid), 5), "child outlived its SIGKILLed parent"
        time.sleep(0.5)
        assert not _gone(grandchild)  # what PDEATHSIG cannot reach ...
        assert kill_processes_with_token(token) == [grandchild]  # ... the sweep does
        assert _wait_for(lambda: _gone(grandchild), 5)
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()


def test_children_are_stopped_when_the_parent_exits_on_an_exception(tmp_path: Path, token: str):
    # Normal interpreter exit (here: an unhandled exception) runs stop() for children still running,
    # which also ends the SIGTERM-ignoring grandchild that PDEATHSIG would not reach.
    parent = _start_parent(f"""
        import sys
        from vime.runtime.process import ManagedProcess
        child = ManagedProcess([sys.executable, "-c", {TREE!r}], log_path={str(tmp_path / "exc.log")!r},
                               run_token={token!r}).start()
        print(child.pid, flush=True)
        import time
        for _ in range(200):
            if "tree" in child.log_tail():
                break
            time.sleep(0.05)
        print(child.log_tail().split("tree", 1)[1].split()[0], flush=True)
        raise RuntimeError("driver crashed")
    """)
    try:
        child_pid = int(parent.stdout.readline())
        grandchild = int(parent.stdout.readline())
        assert parent.wait(timeout=30) == 1
        assert _gone(child_pid)
        assert _wait_for(lambda: _gone(grandchild), 5), "grandchild outlived the crashed driver"
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()


def test_kill_processes_with_token_kills_strays_and_only_them(tmp_path: Path):
    token, other = _token(), _token()
    sleeper = [PY, "-c", "import time; time.sleep(600)"]
    # Strays started outside ManagedProcess (as if their manager had died), one with another token.
    env = {**os.environ, RUN_TOKEN_ENV: token}
    stray = subprocess.Popen(sleeper, env=env)
    spared = subprocess.Popen(sleeper, env={**os.environ, RUN_TOKEN_ENV: other})
    excluded = subprocess.Popen(sleeper, env=env)
    try:
        assert _wait_for(lambda: _env_token(stray.pid) == token, 10)
        killed = kill_processes_with_token(token, exclude_pids=[excluded.pid])
        assert stray.pid in killed
        assert spared.pid not in killed and excluded.pid not in killed and os.getpid() not in killed
        assert stray.wait(timeout=5) == -signal.SIGKILL
        assert spared.poll() is None and excluded.poll() is None
    finally:
        for p in (stray, spared, excluded):
            p.kill()
            p.wait()


def test_sweep_finds_a_child_spawned_after_the_first_sweep(tmp_path: Path, token: str):
    """One sweep is not enough when a process of the run appears after it (vLLM's EngineCore forking its
    Worker while the sweep runs). Here a spawner outside the run starts a child carrying the run token
    0.4 s after the sweep began; the sweep goes on until it finds nothing for its settle time, so the late
    child is killed too."""
    pid_file = tmp_path / "late.pid"
    spawner = textwrap.dedent(f"""
        import os, subprocess, sys, time
        open("{pid_file}.ready", "w").close()
        time.sleep(0.4)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                 env={{**os.environ, "{RUN_TOKEN_ENV}": "{token}"}})
        open("{pid_file}", "w").write(str(child.pid))
        child.wait()
    """)
    early = subprocess.Popen([PY, "-c", "import time; time.sleep(600)"], env={**os.environ, RUN_TOKEN_ENV: token})
    assert _wait_for(lambda: _env_token(early.pid) == token, 10)
    outside = subprocess.Popen([PY, "-c", spawner])
    try:
        assert _wait_for(lambda: os.path.exists(f"{pid_file}.ready"), 30)
        assert sweep_run_processes(token, settle=3.0, timeout=30) == []
        assert pid_file.exists() and _wait_for(lambda: _gone(int(pid_file.read_text())), 5)
        assert early.wait(timeout=5) == -signal.SIGKILL
    finally:
        for p in (early, outside):
            p.kill()
            p.wait()


def test_run_token_survives_setproctitle_in_children(tmp_path: Path, token: str):
    # vLLM's EngineCore/Worker and vllm-router rename themselves with setproctitle, which would
    # otherwise overwrite /proc/PID/environ and hide them from the sweep.
    pytest.importorskip("setproctitle")
    code = (
        "import setproctitle, time; setproctitle.setproctitle('VLLM::EngineCore'); print('ok', flush=True); "
        "time.sleep(600)"
    )
    proc = ManagedProcess([PY, "-c", code], log_path=tmp_path / "title.log", run_token=token).start()
    try:
        assert _wait_for(lambda: "ok" in proc.log_tail(), 10)
        assert _env_token(proc.pid) == token
        assert kill_processes_with_token(token) == [proc.pid]
        assert _wait_for(lambda: not proc.alive(), 5)
    finally:
        proc.stop()


def test_start_rejects_bad_arguments(tmp_path: Path):
    with pytest.raises(ValueError):
        ManagedProcess([], log_path=tmp_path / "x.log", run_token="t")
    with pytest.raises(ValueError):
        ManagedProcess([PY], log_path=tmp_path / "x.log", run_token="")
    with pytest.raises(ValueError):
        kill_processes_with_token("")


def test_free_port_and_port_is_free():
    port = free_port()
    assert 0 < port < 65536
    assert port_is_free("127.0.0.1", port)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", port))
        listener.listen()
        assert not port_is_free("127.0.0.1", port)
    assert port_is_free("127.0.0.1", port)


def _env_token(pid: int) -> str | None:
    try:
        return psutil.Process(pid).environ().get(RUN_TOKEN_ENV)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
