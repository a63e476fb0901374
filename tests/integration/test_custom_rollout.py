"""`vime train` with --rollout-function-path and no engines (--rollout-num-gpus 0: router only).

Runs the whole driver (Ray actors, router process, straw queue, torch trainer, weight
publication) with a user rollout function in place of vLLM generation, in about 20 seconds.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.e2e.test_main_job import EXAMPLE, assert_nothing_left, read_accepted_groups

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from vime.tools.make_tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("model")))


@pytest.mark.parametrize("transport", ["straw", "object-store"])
def test_custom_rollout_function_trains_through_the_queue(tmp_path, model_dir, transport):
    """With straw, the function holds its groups longer than --rollout-queue-lease-seconds (2 s): the worker's
    heartbeat (every 0.5 s) keeps their leases (before, none was ever accepted: each expired while the function
    ran)."""
    run_dir = str(tmp_path / "run")
    plugin, lease = (
        ("slow_rollout.py", ["--rollout-queue-lease-seconds", "2"])
        if transport == "straw"
        else ("digit_rollout.py", [])
    )
    args = [
        sys.executable,
        "-m",
        "vime.cli",
        "train",
        "--hf-checkpoint",
        model_dir,
        "--prompt-data",
        os.path.join(EXAMPLE, "train.jsonl"),
        "--input-key",
        "prompt",
        "--label-key",
        "label",
        "--rollout-function-path",
        os.path.join(REPO, "tests", "plugins", plugin) + ":generate_rollout",
        "--custom-rm-path",
        os.path.join(EXAMPLE, "reward.py") + ":reward",
        "--rollout-num-gpus",
        "0",
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "4",
        "--num-rollout",
        "3",
        "--lr",
        "1e-3",
        "--run-dir",
        run_dir,
        "--rollout-data-transport",
        transport,
        *lease,
    ]
    result = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    train = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [r["step"] for r in train if r["kind"] == "train"] == [1, 2, 3]
    # half of every group is right, half repeats the prompt (reward 0 on this task)
    assert all(abs(r["reward_mean"] - 0.5) < 1e-6 for r in train if r["kind"] == "train")
    assert_nothing_left(run_dir)
    if transport == "object-store":
        assert not os.path.exists(os.path.join(run_dir, "rollout_data", "control"))  # nothing went to straw
        return
    from vime.queue.journal_view import JournalView

    assert JournalView.read(os.path.join(run_dir, "rollout_data")).of_type("Expired") == []  # no lease lost
    groups = read_accepted_groups(run_dir)
    assert len(groups) >= 6
    prompts = [g[0].prompt_index for g in groups]
    assert len(prompts) == len(set(prompts))  # the handed-back group was regenerated, not duplicated
    for group in groups:
        assert [s.index for s in group] == [0, 1, 2, 3]
        assert all(s.weight_versions == [s.weight_versions[0]] * s.response_length for s in group)
    assert_nothing_left(run_dir)


def test_bad_rollout_function_path_is_named(tmp_path, model_dir):
    args = [
        sys.executable,
        "-m",
        "vime.cli",
        "train",
        "--hf-checkpoint",
        model_dir,
        "--prompt-data",
        os.path.join(EXAMPLE, "train.jsonl"),
        "--input-key",
        "prompt",
        "--label-key",
        "label",
        "--rollout-function-path",
        os.path.join(REPO, "tests", "plugins", "digit_rollout.py") + ":nope",
        "--rm-type",
        "exact_match",
        "--run-dir",
        str(tmp_path / "run"),
    ]
    result = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "--rollout-function-path" in result.stderr and "has no attribute 'nope'" in result.stderr
