"""tools/cpu_account.py: orphaned descendants' CPU time reaches the total; the exit status is the command's."""

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "cpu_account.py"
# Burns about 0.8 s of CPU in a process started in its own session, after its parent has exited: without the
# wrapper's subreaper it is reparented to init and its time is lost to whoever waits for the command.
BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.8: pass\n"


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def account_for(shell_command: str, report: Path) -> subprocess.CompletedProcess:
    """The wrapper over ``bash -c shell_command``, sampling every 0.1 s, its report written to ``report``."""
    return subprocess.run(
        # --linger: on a loaded machine (the suite's other workers) 0.8 s of CPU can take many seconds of wall
        # time; the wrapper waits only until the orphans are gone.
        [sys.executable, str(TOOL), "--interval", "0.1", "--linger", "120", "--report", str(report), "--"]
        + ["bash", "-c", shell_command],
        capture_output=True,
        text=True,
        timeout=180,
        env={k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"},  # this test's own: not inherited
    )


def test_an_orphan_s_cpu_time_is_counted_and_the_command_s_status_returned(tmp_path):
    report = tmp_path / "report.txt"
    before = children_cpu()
    done = account_for(f"(setsid {sys.executable} -c '{BURN}' &); exit 3", report)
    counted = children_cpu() - before
    assert done.returncode == 3, done.stderr
    assert counted >= 0.7, f"only {counted:.2f} s counted: the orphan's 0.8 s did not reach the total"
    text = report.read_text()
    assert "python -c" in text and "still alive" not in text, text


def test_time_is_summed_by_the_test_file_that_started_the_process(tmp_path):
    """A process started while pytest's PYTEST_CURRENT_TEST names a test (here set by hand, as pytest sets it
    in its own environment) counts under that test's file, orphaned or not; the rest under one label."""
    report = tmp_path / "report.txt"
    test = "PYTEST_CURRENT_TEST='tests/e2e/test_made_up.py::test_one (call)'"
    done = account_for(f"({test} setsid {sys.executable} -c '{BURN}' &); {sys.executable} -c '{BURN}'", report)
    assert done.returncode == 0, done.stderr
    text = report.read_text()
    section = text[text.index("by the test file") :].splitlines()[1:]
    by_file = section[: next((i for i, line in enumerate(section) if not line.startswith(" ")), None)]
    seconds = {line.split("%", 1)[1].strip(): float(line.split()[0]) for line in by_file}
    assert seconds["tests/e2e/test_made_up.py"] >= 0.5, text  # the orphan's 0.8 s, sampled every 0.1 s
    assert seconds["(pytest itself, its in-process tests, and processes started outside a test)"] >= 0.5, text
    pairs = text[text.index("(test file, program) pairs") :].splitlines()[1:]
    made_up = [line.split() for line in pairs if line.endswith("  python -c  tests/e2e/test_made_up.py")]
    assert len(made_up) == 1 and float(made_up[0][0]) >= 0.5 and made_up[0][2:4] == ["1", "x"], text


def test_a_descendant_outliving_the_linger_is_listed_not_waited_for(tmp_path):
    report = tmp_path / "report.txt"
    # Its output goes to a file: the leaked sleep keeps whatever it inherited open.
    with (tmp_path / "stderr").open("w") as stderr:
        done = subprocess.run(
            [sys.executable, str(TOOL), "--linger", "0.3", "--report", str(report), "--", "bash", "-c", "(sleep 30 &)"],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            timeout=20,
        )
    text = report.read_text()
    leaked = [int(line.split()[1]) for line in text.splitlines() if line.strip().startswith("pid ")]
    for pid in leaked:
        os.kill(pid, signal.SIGKILL)
    assert done.returncode == 0
    assert "1 process(es) still alive" in text and "sleep" in text and len(leaked) == 1, text


def test_bad_input_names_the_flag():
    done = subprocess.run([sys.executable, str(TOOL), "--interval", "0"], capture_output=True, text=True, timeout=20)
    assert done.returncode == 2 and "--interval" in done.stderr
    done = subprocess.run([sys.executable, str(TOOL)], capture_output=True, text=True, timeout=20)
    assert done.returncode == 2 and "no command" in done.stderr


def signalled_wrapper_status(tmp_path, send, **popen_options) -> int:
    """Start the wrapper over ``sleep 60``, call ``send(wrapper)`` once sleep runs; the wrapper's exit status,
    after checking that it still wrote its report."""
    report = tmp_path / "report.txt"
    with (tmp_path / "stderr").open("w") as stderr:
        wrapper = subprocess.Popen(
            [sys.executable, str(TOOL), "--linger", "0", "--report", str(report), "--", "sleep", "60"],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            **popen_options,
        )
        wait_for_child(wrapper.pid, "sleep")
        send(wrapper)
        status = wrapper.wait(timeout=20)
    assert "cpu_account: wall" in report.read_text()
    return status


def test_a_sigterm_to_the_wrapper_reaches_the_command(tmp_path):
    status = signalled_wrapper_status(tmp_path, lambda wrapper: wrapper.send_signal(signal.SIGTERM))
    assert status == 128 + signal.SIGTERM  # the command's status, killed by SIGTERM


def test_ctrl_c_reaches_the_command_and_the_wrapper_still_reports(tmp_path):
    status = signalled_wrapper_status(
        tmp_path,
        lambda wrapper: os.killpg(wrapper.pid, signal.SIGINT),  # what Ctrl-C does: the whole group
        start_new_session=True,  # its own process group, as a terminal's foreground job
        # A terminal's job starts with SIGINT at its default; the suite may run with it ignored (a background
        # job), which exec would pass on to the wrapper and to sleep.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert status == 128 + signal.SIGINT  # sleep got it (not left ignoring it)


def wait_for_child(parent: int, program: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in Path("/proc").glob("[0-9]*"):
            try:
                stat = (entry / "stat").read_text()
                argv0 = (entry / "cmdline").read_bytes().split(b"\0")[0].decode()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == parent and Path(argv0).name == program:
                return
        time.sleep(0.05)
    raise AssertionError(f"{program} did not start under pid {parent} within {timeout} s")


def test_programs_are_named_past_the_interpreter_s_own_flags(tmp_path):
    """Python's own flags (-B, which PYTHONDONTWRITEBYTECODE adds to multiprocessing's children) come before
    -c, -m or the script; a fork server's ranks keep its command line and are counted under one name."""
    sys.path.insert(0, str(TOOL.parent))
    try:
        from cpu_account import program_name
    finally:
        sys.path.remove(str(TOOL.parent))
    script = tmp_path / "job.py"
    script.write_text("import time\ntime.sleep(60)\n")
    sleep = "import time; time.sleep(60)"
    commands = {
        "python -c": [sys.executable, "-B", "-c", sleep],
        "python job.py": [sys.executable, "-B", "-s", str(script)],
        "python -m timeit": [sys.executable, "-B", "-m", "timeit", "-n", "1", "import time; time.sleep(60)"],
        "python multiprocessing fork server": [
            sys.executable,
            "-B",
            "-c",
            f"from multiprocessing.forkserver import main; {sleep}",
        ],
    }
    processes = {name: subprocess.Popen(argv) for name, argv in commands.items()}
    try:
        time.sleep(0.5)  # until each has its command line (exec done)
        assert {name: program_name(p.pid) for name, p in processes.items()} == {name: name for name in commands}
    finally:
        for process in processes.values():
            process.kill()
            process.wait()
