"""Fault-injection harness: real `vime train` processes, real SIGKILLs, invariants read from disk.

Runs use the engine-free rollout function in tests/plugins/steady_rollout.py (--rollout-num-gpus 0),
so each start costs seconds: the subject here is the queue and recovery, and every other part
(Ray actors, the router process, straw, the trainer, checkpoints) is the real one.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import REPO
from vime.runtime.process import kill_processes_with_token

EXAMPLE = os.path.join(REPO, "examples", "digit_shift")
PLUGIN = os.path.join(REPO, "tests", "plugins", "steady_rollout.py") + ":generate_rollout"
NUM_PROMPTS = 24
# After a kill, every process of the job must be gone within this many seconds (the reaper sees the
# driver's death at once and sweeps for a second after the last kill; the rest is a loaded machine).
LEAK_BOUND_S = 20.0


@dataclasses.dataclass
class Job:
    root: str
    model: str
    queue_dir: str | None = None  # --rollout-data-dir; default: <save>/rollout_data
    storage_profile: str = "local"  # --rollout-storage-profile (juicefs: the queue on a real JuiceFS mount)

    @property
    def run_dir(self) -> str:
        return os.path.join(self.root, "run")

    @property
    def save(self) -> str:
        return os.path.join(self.root, "save")

    @property
    def data_dir(self) -> str:
        return self.queue_dir or os.path.join(self.save, "rollout_data")

    @property
    def prompts(self) -> str:
        return os.path.join(self.root, "prompts.jsonl")

    def args(self, *extra: str, epochs: int = 1) -> list[str]:
        return [
            sys.executable,
            "-m",
            "vime.cli",
            "train",
            "--hf-checkpoint",
            self.model,
            "--prompt-data",
            self.prompts,
            "--input-key",
            "prompt",
            "--label-key",
            "label",
            "--rollout-function-path",
            PLUGIN,
            "--custom-rm-path",
            os.path.join(EXAMPLE, "reward.py") + ":reward",
            "--rollout-num-gpus",
            "0",
            "--rollout-batch-size",
            "2",
            "--n-samples-per-prompt",
            "2",
            "--num-rollout",
            "1000",
            "--lr",
            "1e-3",
            "--rollout-shuffle",
            "--save",
            self.save,
            "--save-interval",
            "2",
            "--load",
            self.save,
            "--run-dir",
            self.run_dir,
            "--rollout-queue-segment-mib",
            "1",
            "--rollout-queue-lease-seconds",
            "20",
            "--num-epoch",
            str(epochs),
            *(["--rollout-data-dir", self.queue_dir] if self.queue_dir else []),
            *(["--rollout-storage-profile", self.storage_profile] if self.storage_profile != "local" else []),
            *extra,
        ]

    def start(
        self, *extra: str, faults: str = "", epochs: int = 1, env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        """Start the job; ``env``: more environment for it (VIME_FAULT_DELAYS, say)."""
        env = dict(os.environ, **(env or {}))
        if faults:
            env.update(VIME_FAULTS=faults, VIME_FAULT_STATE=self.root)
        log = open(os.path.join(self.root, f"job-{time.time_ns()}.log"), "w")
        # Its own session: the job's process group can be killed at once, as a lost machine would.
        return subprocess.Popen(
            self.args(*extra, epochs=epochs),
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def run(
        self, *extra: str, faults: str = "", timeout: float = 600, epochs: int = 1, env: dict[str, str] | None = None
    ) -> tuple[int, str]:
        proc = self.start(*extra, faults=faults, epochs=epochs, env=env)
        try:
            proc.wait(timeout=timeout)
        finally:
            self.kill(proc)  # a run that ended by itself is only checked: it must have left nothing
        return proc.returncode, self.last_log()

    def last_log(self) -> str:
        logs = sorted(f for f in os.listdir(self.root) if f.startswith("job-"))
        with open(os.path.join(self.root, logs[-1])) as f:
            return f.read()

    def kill(self, proc: subprocess.Popen, *, driver_only: bool = False) -> None:
        """SIGKILL the job if it still runs (its whole process group, as a lost terminal or a scheduler's
        job kill would; ``driver_only``: the driver process alone, as the OOM killer would), then assert
        that no process of the job is left a few seconds later. Stopping what left the group is the run's
        own job (its reaper, vime/runtime/reaper.py): the harness sweeps only after that assertion
        failed, so that a leak fails the test that caused it and not the tests after it."""
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                if driver_only:
                    proc.kill()
                else:
                    os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert_job_left_nothing(self.data_dir, self.run_dir, proc.pid)


def job_processes(data_dir: str, run_dir: str, driver_pid: int) -> tuple[str | None, list[psutil.Process]]:
    """(the run token of the job whose driver had ``driver_pid``, its processes still running).

    The token is the driver's incarnation record (written before it starts any process; it stays when
    the run dies without its teardown), else run.json (a clean teardown drops the record). A job's
    processes: those carrying its token, its reaper, and whatever is still in its process group."""
    from vime.runtime import incarnations
    from vime.runtime.process import processes_with_tokens

    record = next((r for r in incarnations.read(data_dir) if r.pid == driver_pid), None)
    token = record.token if record else None
    if token is None:
        with contextlib.suppress(FileNotFoundError, KeyError, json.JSONDecodeError):
            with open(os.path.join(run_dir, "run.json")) as f:
                info = json.load(f)
            token = info["run_token"] if info.get("pid") == driver_pid else None
    found = {p.pid: p for p in processes_with_tokens([token]).get(token, [])} if token else {}
    for proc in psutil.process_iter():
        # os.getpgid raises ProcessLookupError (not a psutil.Error) for a process that exited since the listing
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if proc.pid not in found and os.getpgid(proc.pid) == driver_pid and proc.status() != psutil.STATUS_ZOMBIE:
                found[proc.pid] = proc
    if record and record.reaper_pid:
        with contextlib.suppress(psutil.Error):
            reaper = psutil.Process(record.reaper_pid)
            if reaper.status() != psutil.STATUS_ZOMBIE and reaper.create_time() >= record.pid_start - 1:
                found[reaper.pid] = reaper
    return token, list(found.values())


def assert_job_left_nothing(data_dir: str, run_dir: str, driver_pid: int, within: float = LEAK_BOUND_S) -> None:
    deadline = time.monotonic() + within
    while True:
        token, left = job_processes(data_dir, run_dir, driver_pid)
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.25)
    if not left:
        return
    described = []
    for proc in left:
        with contextlib.suppress(psutil.Error):
            described.append(f"{proc.pid} ({' '.join(proc.cmdline()[:3])})")
        with contextlib.suppress(psutil.Error):
            proc.kill()  # clean up only now, so that later tests are not poisoned
    if token:
        kill_processes_with_token(token)
    raise AssertionError(
        f"{len(left)} process(es) of the job (driver pid {driver_pid}) outlived it by "
        f"{within:.0f}s: {'; '.join(described)}"
    )


@pytest.fixture(scope="session")
def fault_model(tmp_path_factory) -> str:
    from vime.tools.make_tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("fault_model")))


@pytest.fixture
def job(request, tmp_path, fault_model) -> Job:
    """A job in the test's folder; its queue on a local directory, or, for a test parametrized with
    ``@pytest.mark.parametrize("job", ["juicefs"], indirect=True)``, in a folder of the session's real JuiceFS
    mount (tests/juicefs.py), checked by `vime train` as a JuiceFS mount (--rollout-storage-profile juicefs)."""
    with open(os.path.join(EXAMPLE, "train.jsonl")) as f:
        lines = f.readlines()[:NUM_PROMPTS]
    (tmp_path / "prompts.jsonl").write_text("".join(lines))
    if getattr(request, "param", "local") == "juicefs":
        mount_point = request.getfixturevalue("juicefs_mount")
        queue_dir = os.path.join(mount_point, tmp_path.name, "rollout_data")
        return Job(str(tmp_path), fault_model, queue_dir=queue_dir, storage_profile="juicefs")
    return Job(str(tmp_path), fault_model)


def check_invariants(job: Job, *, complete: bool = True, epochs: int = 1, readable_before_cursor: bool = True) -> dict:
    """From the files on disk: the surviving lineage trained every accepted group exactly once,
    no accepted group is lost, and (when the run completed) every prompt exactly once; and the
    user's own audit of the same, the ledger of `vime queue inspect` (tools/ledger.py), closes."""
    from vime.queue.journal_view import JournalView
    from vime.queue.rollout_queue import StoreOptions
    from vime.queue.transport import StrawTransport
    from vime.recovery import checkpoint as ckpt
    from vime.tools import ledger, queue_cli

    _, state = ckpt.load_state(job.save)
    books = queue_cli.inspect(job.data_dir, job.save, "vime")["ledger"]
    assert books["closes"], "\n".join(ledger.format_ledger(books) + books["problems"])
    accepted = JournalView.read(job.data_dir).accepted()
    assert [g.position for g in accepted] == list(range(len(accepted))), "accepted positions have holes"
    cursors = state.step_cursors
    assert cursors == sorted(set(cursors)) and (not cursors or cursors[-1] == state.consumer_cursor)
    assert len(cursors) == state.step, "one cursor per step of the surviving lineage"
    trained = [g for g in accepted[: state.consumer_cursor] if g.position not in set(state.skipped)]
    transport = StrawTransport(StoreOptions(job.data_dir, "vime"))
    prompts = []
    if not readable_before_cursor:  # GC reclaimed trained groups: their prompts come from the lineage log
        transport.close()
        assert len(cursors) == state.step and state.consumer_cursor == len(accepted) if complete else True
        return {"state": state, "accepted": len(accepted), "prompts": []}
    for group in trained:
        samples = transport.read(group.ref)  # every trained group is still readable
        assert [s.index for s in samples] == [0, 1]
        assert len({s.prompt_index for s in samples}) == 1
        prompts.append(samples[0].prompt_index)
    transport.close()
    counts = collections.Counter(prompts)
    assert max(counts.values(), default=0) <= epochs, "a prompt was trained too often in the surviving lineage"
    if complete:
        assert sorted(counts) == list(range(NUM_PROMPTS)) and set(counts.values()) == {epochs}, (
            "every prompt of every epoch is trained exactly once"
        )
        assert state.consumer_cursor == len(accepted), "accepted groups were left untrained"
    return {"state": state, "accepted": len(accepted), "prompts": prompts}
