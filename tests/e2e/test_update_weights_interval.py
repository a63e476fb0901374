"""--update-weights-interval N through ``vime train`` on the shared engine: the trainer's weights reach the engines
after every N-th step only, and always after a step that saves a checkpoint and after the last; in between the
engines keep serving the version they have, and the run trains on. Checked from what the run recorded: the
version each step's record names and the steps whose weights were synchronised."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.conftest import REPO
from tests.e2e.conftest import attached
from tests.e2e.test_main_job import assert_nothing_left, vime_args
from vime.config import ConfigError, parse_train_args

pytestmark = pytest.mark.e2e


def test_weights_are_published_every_third_step_and_on_save_and_last_steps(tmp_path, tiny_model_dir, vllm_engine):
    run_dir, save = str(tmp_path / "run"), str(tmp_path / "save")
    with attached(vllm_engine) as engine_flags:
        args = vime_args(
            tiny_model_dir,
            run_dir,
            "--num-rollout",
            "5",
            "--update-weights-interval",
            "3",
            "--save",
            save,
            "--save-interval",
            "4",
            "--max-staleness",
            "0",
            "--no-save-hf",
            *engine_flags,
        )
        result = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    train = [r for r in records if r["kind"] == "train"]
    # Steps 1 and 2 keep version 0; 3 publishes (the interval), 4 (it saves) and 5 (the last).
    assert [r["weight_version"] for r in train] == [0, 0, 1, 2, 3]
    assert [r["step"] for r in records if r["kind"] == "weight_sync"] == [3, 4, 5]
    assert [r["weight_sync_seconds"] == 0.0 for r in train] == [True, True, False, False, False]
    # --max-staleness 0 holds throughout: a held step trains what the version it serves generated.
    assert all(r["staleness_max"] == 0 for r in train), [r["staleness_max"] for r in train]
    with open(os.path.join(save, "iter_0000004", "vime_state.json")) as f:
        assert json.load(f)["weight_version"] == 2  # the checkpoint's weights are the version published with it
    assert_nothing_left(run_dir)


def test_a_zero_interval_is_refused_naming_the_flag(tmp_path, tiny_model_dir):
    argv = vime_args(tiny_model_dir, str(tmp_path / "run"), "--update-weights-interval", "0")
    with pytest.raises(ConfigError, match="^--update-weights-interval: must be >= 1"):
        parse_train_args(argv[argv.index("train") + 1 :])
