"""`vime train` runs to completion with each advantage estimator that computes its own advantages (grpo, the
default, runs in tests/integration/test_custom_rollout.py; gspo and cispo change only the policy loss, which
tests/unit/test_rl_torch_backend.py checks), and with two data-parallel trainer ranks: real driver, Ray,
router, straw queue and torch trainer, no engines (--rollout-num-gpus 0 and the engine-free
tests/plugins/digit_rollout.py).

The runs are started at once and each is checked by its own test. They attach to one Ray cluster
(``--ray-address``, a documented way to run) instead of starting one each: on two shared cores that took
five concurrent runs from ~113 s to ~78 s under the same load (one run alone: ~18 s on an idle
machine). So they are also the test of attaching to a running cluster, with a relative --prompt-data path
that vime must make absolute for the cluster's workers. The in-process start is covered by
test_custom_rollout.py, and nothing an estimator does depends on how Ray was started.
"""

from __future__ import annotations

import json
import math
import os
import random
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO
from tests.e2e.test_main_job import EXAMPLE, assert_nothing_left

pytestmark = pytest.mark.integration
ROLLOUT = os.path.join(REPO, "tests", "plugins", "digit_rollout.py") + ":generate_rollout"
RUNS = {  # name: (estimator, extra flags)
    # REINFORCE++ whitens its returns over the batch, which start-up checks insist on.
    "reinforce_plus_plus": ("reinforce_plus_plus", ["--normalize-advantages"]),
    "reinforce_plus_plus_baseline": ("reinforce_plus_plus_baseline", ["--normalize-advantages"]),
    "ppo": ("ppo", []),
    # Two data-parallel trainer ranks (docs/parallelism.md), the critic's values shared between them, and
    # a checkpoint that rank 0 alone writes.
    "ppo_two_trainer_ranks": (
        "ppo",
        ["--actor-num-gpus-per-node", "2", "--micro-batch-size", "2", "--save-interval", "2"],
    ),
}
CRITIC_METRICS = {"value_loss", "critic_grad_norm", "value_clipfrac", "value_mean", "return_mean", "critic_only"}
TIMEOUT_S = 300


def start_ray_head(log_path, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, int]:
    """A Ray head of this module's own (``ray start --block``: SIGTERM stops it and its processes); ``env``:
    its environment (default: this process's), which its workers inherit."""
    port = quiet_port()
    with open(log_path, "w") as log:
        head = subprocess.Popen(
            [
                os.path.join(os.path.dirname(sys.executable), "ray"),
                "start",
                "--head",
                "--block",
                "--port",
                str(port),
                "--num-cpus",
                str(os.cpu_count() or 2),
                "--node-ip-address",
                "127.0.0.1",
                "--include-dashboard",
                "false",
                "--ray-client-server-port",
                str(quiet_port()),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    return head, port


def quiet_port() -> int:
    """A free port below the kernel's ephemeral range (32768-60999) and above Ray's worker ports (10002-19999).
    The head binds its ports seconds after they are chosen, on a loaded machine tens of seconds: a port from the
    ephemeral range (what binding port 0 returns) was once taken meanwhile by another process's connection, the
    head's client server failed to bind it and `ray start --block` stopped the whole head mid-run."""
    from vime.runtime.ports import port_is_free

    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32768)
        if port_is_free("127.0.0.1", port):
            return port
    raise RuntimeError("no free port in 20000-32767")


def stop_ray_head(head: subprocess.Popen) -> None:
    head.terminate()
    try:
        head.wait(timeout=60)
    except subprocess.TimeoutExpired:
        head.kill()
        head.wait()


def wait_listening(head: subprocess.Popen, port: int, log_path) -> None:
    deadline = time.monotonic() + 120
    while True:
        assert head.poll() is None, f"ray start failed: {log_path.read_text()[-2000:]}"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline, "the Ray head did not listen within 120 s"
            time.sleep(0.2)


def vime_train(ray_address: str, model_dir: str, run_dir: str, name: str) -> list[str]:
    estimator, extra = RUNS[name]
    # A relative path on purpose (the runs start in the repository): the cluster's workers run elsewhere, and
    # vime makes the paths absolute.
    prompts = os.path.relpath(os.path.join(EXAMPLE, "train.jsonl"), REPO)
    flags = [
        sys.executable,
        "-m",
        "vime.cli",
        "train",
        "--ray-address",
        ray_address,
        "--hf-checkpoint",
        model_dir,
        "--prompt-data",
        prompts,
        "--input-key",
        "prompt",
        "--label-key",
        "label",
        "--rollout-function-path",
        ROLLOUT,
        "--custom-rm-path",
        os.path.join(EXAMPLE, "reward.py") + ":reward",
        "--rollout-num-gpus",
        "0",
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "4",
        "--num-rollout",
        "2",
        "--lr",
        "1e-3",
        "--run-dir",
        run_dir,
        "--advantage-estimator",
        estimator,
        *extra,
    ]
    if "--save-interval" in extra:  # the run that checks its checkpoint saves beside its run dir
        flags += ["--save", os.path.join(run_dir, "ckpt")]
    return flags


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{run name: (completed process, run dir)}, the runs made concurrently on one Ray head."""
    from vime.tools.make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("estimators")
    started = time.monotonic()
    head, port = start_ray_head(root / "ray_start.log")
    try:
        model_dir = make_tiny_model(str(root / "model"))  # while the head starts
        wait_listening(head, port, root / "ray_start.log")
        procs = {
            name: subprocess.Popen(
                vime_train(f"127.0.0.1:{port}", model_dir, str(root / name), name),
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for name in RUNS
        }
        results = {}
        for name, proc in procs.items():
            try:
                stdout, stderr = proc.communicate(timeout=max(1.0, TIMEOUT_S - (time.monotonic() - started)))
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, stderr = proc.communicate()
                stderr += f"\n[test] killed after {TIMEOUT_S}s"
            results[name] = (subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), str(root / name))
        print(f"Ray head and {len(procs)} concurrent runs: {time.monotonic() - started:.1f}s")
        yield results
    finally:
        stop_ray_head(head)


@pytest.mark.parametrize("name", list(RUNS))
def test_main_job_runs_to_completion(runs, name):
    result, run_dir = runs[name]
    estimator = RUNS[name][0]
    assert result.returncode == 0, f"{estimator}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert "attaching to the Ray cluster at 127.0.0.1:" in result.stdout
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2], estimator
    for record in train:
        assert math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"]), (estimator, record)
        assert record["optimizer_steps"] >= 1, (estimator, record)  # the actor trained (no critic-only steps)
        if estimator == "ppo":
            missing = CRITIC_METRICS - set(record)
            assert not missing, f"ppo: no critic metrics {sorted(missing)}"
            assert math.isfinite(record["value_loss"]) and math.isfinite(record["critic_grad_norm"]), record
            assert record["critic_only"] == 0.0
        else:
            assert not CRITIC_METRICS & set(record), f"{estimator} logged critic metrics: it has no critic"
    assert_nothing_left(run_dir)
    if name == "ppo_two_trainer_ranks":
        assert "2 ranks" in result.stdout, result.stdout[-2000:]
        saved = os.path.join(run_dir, "ckpt", "iter_0000002")
        assert os.path.isfile(os.path.join(saved, "optimizer_and_rng.pt")), os.listdir(os.path.dirname(saved))
