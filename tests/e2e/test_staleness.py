"""--max-staleness with a real engine and an artificially slow trainer.

The trainer sleeps at every step (VIME_FAULT_DELAYS), so the rollout workers could run far ahead of
it; the admission bound must hold them back and the consumption check must refuse anything older
than K versions. Checked from what the run recorded: the per-step versions of every trained token.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.conftest import REPO
from tests.e2e.conftest import attached
from tests.e2e.test_main_job import assert_nothing_left, vime_args

pytestmark = pytest.mark.e2e


def test_slow_trainer_never_trains_a_group_older_than_k(tmp_path, tiny_model_dir, vllm_engine):
    run_dir = str(tmp_path / "run")
    max_staleness = 1
    with attached(vllm_engine) as engine_flags:  # the shared real engine serves this run
        args = vime_args(
            tiny_model_dir,
            run_dir,
            "--num-rollout",
            "4",
            "--max-staleness",
            str(max_staleness),
            "--flush-cache-interval",
            "0",
            "--partial-rollout",
            "--no-save-hf",
            *engine_flags,
        )
        args[args.index("--rollout-batch-size") + 1] = "4"
        env = dict(os.environ, VIME_FAULT_DELAYS="trainer.mid_step=3")
        result = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    train = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if '"kind": "train"' in line]
    assert [r["weight_version"] for r in train] == [1, 2, 3, 4]
    for record in train:
        policy = record["weight_version"] - 1  # the weights that trained this step
        versions = [int(v) for v in record["tokens_per_version"]]
        assert versions, record
        assert policy - min(versions) <= max_staleness, (policy, record["tokens_per_version"])
        assert max(versions) <= policy, (policy, record["tokens_per_version"])
        assert record["staleness_max"] <= max_staleness
        assert sum(record["tokens_per_version"].values()) > 0
    # The slow trainer let the workers run ahead as far as the bound allows: some step trained
    # tokens one version old (otherwise this test would not exercise the bound at all).
    assert any(r["staleness_max"] == max_staleness for r in train), [r["staleness_max"] for r in train]
    assert_nothing_left(run_dir)
