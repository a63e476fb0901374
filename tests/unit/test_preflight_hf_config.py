"""Start-up reads --hf-checkpoint's config through transformers only where a check needs it (vime/preflight.py):
transformers' configuration classes import torch, ~3 CPU-seconds of every `vime train` start, which a run whose
checks all pass without it does not pay. Each case runs check_inputs in a fresh interpreter, as `vime train` does,
and reads what it imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from vime.config import ConfigError
from vime.preflight import check_config_file

EXAMPLE = os.path.join(REPO, "examples", "digit_shift")
CHECK = """
import json, sys
from vime.config import parse_train_args
from vime.errors import UserError
from vime.preflight import check_inputs
try:
    check_inputs(parse_train_args(sys.argv[1:]), lambda line: None)
    error = None
except UserError as e:
    error = str(e)
print(json.dumps({"error": error, "torch": "torch" in sys.modules, "transformers": "transformers" in sys.modules}))
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from vime.tools.make_tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("model")))


def check_inputs_in_a_fresh_process(model_dir: str, tmp_path, *extra: str) -> dict:
    argv = ["--hf-checkpoint", model_dir, "--prompt-data", os.path.join(EXAMPLE, "train.jsonl")]
    argv += ["--input-key", "prompt", "--label-key", "label", "--rm-type", "exact_match"]
    argv += ["--run-dir", str(tmp_path / "run"), "--rollout-num-gpus", "0", *extra]
    result = subprocess.run([sys.executable, "-c", CHECK, *argv], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_run_without_config_checks_starts_without_importing_torch(model_dir, tmp_path):
    seen = check_inputs_in_a_fresh_process(model_dir, tmp_path)
    assert seen == {"error": None, "torch": False, "transformers": False}


@pytest.mark.parametrize(
    ("extra", "refused"),
    [
        (["--rollout-stop-token-ids", "99999"], "--rollout-stop-token-ids: [99999] outside the vocabulary"),
        (["--num-layers", "7"], "--num-layers: 7"),
    ],
    ids=["stop-token-ids", "megatron-model-flag"],
)
def test_a_flag_checked_against_config_json_is_still_checked(model_dir, tmp_path, extra, refused):
    seen = check_inputs_in_a_fresh_process(model_dir, tmp_path, *extra)
    assert seen["transformers"] and seen["error"] and refused in seen["error"], seen


def test_a_missing_or_broken_config_json_is_refused_naming_the_flag(tmp_path):
    with pytest.raises(ConfigError, match=r"^--hf-checkpoint: .* has no config\.json"):
        check_config_file(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"^--hf-checkpoint: .*config\.json cannot be read as JSON"):
        check_config_file(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(ConfigError, match=r"^--hf-checkpoint: .*config\.json holds a list, not a JSON object"):
        check_config_file(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    check_config_file(str(tmp_path))


def test_the_megatron_backend_checks_model_name_against_config_json(model_dir, tmp_path):
    """--model-name is checked where config.json is read for the Megatron backend (a Ray address: this machine's
    lack of CUDA is not what is checked here)."""
    megatron = ["--train-backend", "megatron", "--ray-address", "10.0.0.1:6379"]
    seen = check_inputs_in_a_fresh_process(model_dir, tmp_path, *megatron, "--model-name", "glm4-9B")
    assert seen["error"] and seen["error"].startswith("--model-name: 'glm4-9B' picks the GLM-4 converter"), seen
    assert check_inputs_in_a_fresh_process(model_dir, tmp_path, *megatron, "--model-name", "qwen3-4B")["error"] is None
