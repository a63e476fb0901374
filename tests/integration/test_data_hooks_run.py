"""`vime train` (real Ray, router and straw queue, no engines) with a custom data source, a dynamic
sampling filter and an eval function on a Parquet held-out set; checked from the files on disk."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.conftest import REPO
from tests.e2e.test_main_job import EXAMPLE, assert_nothing_left, read_accepted_groups

pytestmark = pytest.mark.integration
HOOKS = os.path.join(REPO, "tests", "plugins", "hooks_run.py")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from vime.tools.make_tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("model")))


def vime_train(model_dir, run_dir, *extra):
    return [
        sys.executable,
        "-m",
        "vime.cli",
        "train",
        "--hf-checkpoint",
        model_dir,
        "--custom-rm-path",
        os.path.join(EXAMPLE, "reward.py") + ":reward",
        "--rollout-num-gpus",
        "0",
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "4",
        "--lr",
        "1e-3",
        "--run-dir",
        run_dir,
        *extra,
    ]


def run_hooks_job(tmp_path, model_dir, run_dir, logs: dict[str, object], *extra) -> subprocess.CompletedProcess:
    """`vime train` with the hooks module's data source, rollout function and rollout log hook, its custom config
    holding ``logs`` (where the hooks write what they saw); the test fails here if the run does."""
    custom_config = tmp_path / "custom.yaml"
    custom_config.write_text("".join(f"{key}: {path}\n" for key, path in logs.items()))
    result = subprocess.run(
        vime_train(
            model_dir,
            run_dir,
            "--custom-config-path",
            str(custom_config),
            "--custom-rollout-log-function-path",
            f"{HOOKS}:log_rollout",
            "--data-source-path",
            f"{HOOKS}:ParitySource",
            "--rollout-function-path",
            f"{HOOKS}:generate_rollout",
            *extra,
        ),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_data_source_filter_and_eval_function_in_one_run(tmp_path, model_dir):
    held_out = tmp_path / "held_out.parquet"
    pq.write_table(
        pa.Table.from_pylist(
            [
                {"prompt": f"{i}{i}{i}=", "label": "x", "metadata": {"source_name": "known" if i < 3 else "new"}}
                for i in range(4)
            ]
        ),
        held_out,
    )
    run_dir = str(tmp_path / "run")
    # The reference framework's sample and loss hooks (issue 19) in the same run: the custom config's keys reach
    # the rollout worker's hooks, which see every scored group; the trainer trains a custom loss and saves its data.
    all_samples_log = tmp_path / "all_samples.jsonl"
    rollout_log = tmp_path / "rollout_log.jsonl"
    result = run_hooks_job(
        tmp_path,
        model_dir,
        run_dir,
        {"all_samples_log": all_samples_log, "rollout_log": rollout_log},
        "--rollout-all-samples-process-path",
        f"{HOOKS}:record_all_samples",
        "--custom-eval-rollout-log-function-path",
        f"{HOOKS}:log_eval",
        "--loss-type",
        "custom_loss",
        "--custom-loss-function-path",
        "tests.plugins.objective_hooks.reinforce_loss",
        "--save-debug-train-data",
        str(tmp_path / "debug" / "train_{rollout_id}.pt"),
        "--num-rollout",
        "3",
        "--num-epoch",
        "2",
        "--dynamic-sampling-filter-path",
        "vime.rollout.filters.check_reward_nonzero_std",
        "--eval-function-path",
        f"{HOOKS}:evaluate",
        "--eval-prompt-data",
        "held_out",
        str(held_out),
        "--input-key",
        "prompt",
        "--label-key",
        "label",
        # Issue 19's prompt controls on a real run: every prompt has 4 tokens, so the filter keeps all 12 (its
        # rows still reach the controller); no evaluation before training; refills in multiples of 4.
        "--rollout-max-prompt-len",
        "4",
        "--skip-eval-before-train",
        "--over-sampling-batch-size",
        "4",
    )
    assert "--rollout-max-prompt-len 4: 0 of 12 prompts are longer" in result.stdout + result.stderr
    assert "--over-sampling-batch-size 4: " in result.stdout + result.stderr

    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    [data] = [r for r in records if r["kind"] == "data"]
    assert (data["prompts"], data["prompts_kept"], data["prompts_too_long"]) == (12, 12, 0)
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert all(abs(r["reward_mean"] - 0.5) < 1e-6 for r in train)  # only the "odd" groups were trained
    evals = [r for r in records if r["kind"] == "eval"]
    assert len(evals) == 1 and all(r["eval_reward"] == 0.75 for r in evals)  # 3 of 4 held-out rows "known"
    assert evals[0]["step"] == 3  # only after training (--skip-eval-before-train)

    # The logging hooks: the rollout's was called by the trainer with each step's samples, before training,
    # and its metric joined the step's record; it logged the rollout itself (it said so): vime's own rollout
    # metrics stay in metrics.jsonl but not in the trackers. The eval's saw the held-out set's data.
    calls = [json.loads(line) for line in open(rollout_log)]
    assert [c["rollout_id"] for c in calls] == [0, 1, 2], calls
    assert all(c["samples"] == 8 and c["sources"] == ["odd"] and c["hf_checkpoint"] for c in calls), calls
    assert all(c["rollout_time"] >= 0 for c in calls) and calls[1]["rollout_time"] > 0, calls
    from vime.tracking import row_of

    for record in train:
        assert record["user_metrics"] == {"custom/correct_fraction": 0.5}, record
        row = row_of(record)
        assert row["custom/correct_fraction"] == 0.5 and "train/reward_mean" not in row and "train/samples" in row
    [eval_log] = [r for r in records if r["kind"] == "eval_log"]
    assert eval_log["step"] == 3
    assert eval_log["user_metrics"] == {"custom/held_out/known_fraction": 0.75, "custom/held_out/rollout_id": 3}
    assert row_of(evals[0])["eval/held_out/reward"] == 0.75  # it returned False: vime's own eval metrics too

    assert all(math.isfinite(r["custom_pg_loss"]) for r in train)  # the custom loss's own metric
    seen = [json.loads(line) for line in open(all_samples_log)]
    assert {g["source"] for g in seen} == {"even", "odd"}  # the filtered "even" groups too
    for step in range(3):
        saved = torch.load(tmp_path / "debug" / f"train_{step}.pt", weights_only=False)
        assert saved["rollout_id"] == step and len(saved["advantages"]) == len(saved["tokens"]) == 8

    groups = read_accepted_groups(run_dir)
    assert len(groups) >= 6
    for group in groups:
        assert {s.source_name for s in group} == {"odd"} and group[0].prompt_index % 2 == 1
        assert len({s.reward for s in group}) > 1

    from vime.queue.journal_view import JournalView
    from vime.tools.queue_cli import task_stages

    view = JournalView.read(os.path.join(run_dir, "rollout_data"))
    stages = task_stages(view)
    tasks = {t["task_id"]: t["metadata"] for e in view.of_type("Submitted") for t in e["tasks"]}
    rejected = [tasks[t] for t, stage in stages.items() if stage == "rejected"]
    assert rejected and all(m["prompt_index"] % 2 == 0 for m in rejected)
    # A rejected prompt is neither retried nor regenerated within its epoch.
    keys = [(m["epoch"], m["prompt_index"]) for m in tasks.values()]
    assert len(keys) == len(set(keys))
    failures = [e for e in view.of_type("Failed") if e.get("response") == "failed"]
    assert all(str(e.get("failure", "")).startswith("rejected: zero_std_1.0") for e in failures)
    assert_nothing_left(run_dir)


def test_the_rollout_log_hook_sees_each_step_of_a_rollout_only_run(tmp_path, model_dir):
    """--debug-rollout-only trains nothing, yet --custom-rollout-log-function-path is called on each step's samples
    (by the trainer's rank 0, as in training) and its metric joins the step's rollout record."""
    run_dir, rollout_log = str(tmp_path / "run"), tmp_path / "rollout_log.jsonl"
    run_hooks_job(
        tmp_path, model_dir, run_dir, {"rollout_log": rollout_log}, "--debug-rollout-only", "--num-rollout", "2"
    )
    calls = [json.loads(line) for line in open(rollout_log)]
    assert [c["rollout_id"] for c in calls] == [0, 1] and all(c["samples"] == 8 for c in calls), calls
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    rollouts = [r for r in records if r["kind"] == "rollout"]
    assert [r["step"] for r in rollouts] == [1, 2] and not [r for r in records if r["kind"] == "train"]
    from vime.tracking import row_of

    for record, call in zip(rollouts, calls):
        assert set(record["user_metrics"]) == {"custom/correct_fraction"}, record
        assert call["rollout_time"] == pytest.approx(record["step_seconds"]), (call, record)
        row = row_of(record)  # it logged the data itself: vime's counts of it stay out of the trackers
        assert "custom/correct_fraction" in row and "rollout/samples" not in row and "rollout/queue_depth" in row
    assert_nothing_left(run_dir)


@pytest.mark.parametrize(
    "flag, path, reason",
    [
        ("--dynamic-sampling-filter-path", f"{HOOKS}:ParitySource", "do not accept vime's call filter(args, samples)"),
        ("--eval-function-path", "vime.rollout.nothing_here.evaluate", "module 'vime.rollout.nothing_here' not found"),
        ("--data-source-path", f"{HOOKS}:NoSuchSource", "has no attribute 'NoSuchSource'"),
        (
            "--rollout-all-samples-process-path",
            f"{HOOKS}:ParitySource",
            "do not accept vime's call process(args, all_samples, data_source)",
        ),
        ("--custom-advantage-function-path", "tests.plugins.no_such.f", "module 'tests.plugins.no_such' not found"),
        (
            "--custom-rollout-log-function-path",
            f"{HOOKS}:record_all_samples",
            "do not accept vime's call log(rollout_id, args, samples, rollout_extra_metrics, rollout_time)",
        ),
    ],
)
def test_bad_hook_paths_fail_before_anything_starts(tmp_path, model_dir, flag, path, reason):
    extra = ["--prompt-data", os.path.join(EXAMPLE, "train.jsonl"), "--input-key", "prompt", "--label-key", "label"]
    result = subprocess.run(
        vime_train(model_dir, str(tmp_path / "run"), *extra, flag, path),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"vime train: error: {flag} {path}: " in result.stderr and reason in result.stderr, result.stderr
    assert "starting Ray" not in result.stdout
