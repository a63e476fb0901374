"""`vime train --debug-train-only`, as the reference's SFT scripts run it: no engine is started and no weight
version is published; vime's SFT rollout fills the queue from the data's conversations and the torch trainer
trains, checkpoints and saves the final model. Then the run is resumed with --load and --no-load-optim (the
reference's NPU scripts): the checkpoint's weights and place in the data, a fresh optimizer. Real driver, Ray,
router, straw queue and trainer (two runs of ~20 s)."""

import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from tests.conftest import REPO
from tests.e2e.test_main_job import assert_nothing_left

pytestmark = pytest.mark.integration

# The same shape as tests/unit/test_data_formats_and_sources.py's: a rendered prefix is a prefix of the whole.
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
CHARS = "0123456789=<>/abcdefghijklmnopqrstuvwxyz"


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    from transformers import AutoTokenizer

    from vime.tools.make_tiny_model import make_tiny_model

    path = make_tiny_model(str(tmp_path_factory.mktemp("chat_model")), chars=CHARS)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    return path


def conversations(path: str, n: int) -> str:
    with open(path, "w") as f:
        for i in range(n):
            a, b = i % 10, (i * 7) % 10
            messages = [
                {"role": "user", "content": f"{a}{b}="},
                {"role": "assistant", "content": f"{(a + b) % 10}"},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def test_sft_with_debug_train_only_trains_without_engines_or_weight_publication(tmp_path, chat_model_dir):
    run_dir, save = str(tmp_path / "run"), str(tmp_path / "ckpt")
    # As the reference's SFT scripts: vime's SFT rollout, SFT's loss, no engine; a warm-up the resume can show.
    sft = (
        "--input-key messages --apply-chat-template --rollout-function-path vime.rollout.sft_rollout.generate_rollout "
        "--loss-type sft_loss --calculate-per-token-loss --disable-compute-advantages-and-returns --debug-train-only "
        "--rollout-batch-size 2 --n-samples-per-prompt 1 --num-rollout 3 --lr 1e-3 --lr-warmup-iters 4 "
        "--lr-decay-iters 10 --save-interval 3"
    ).split()
    chats = conversations(str(tmp_path / "chats.jsonl"), 12)
    args = [sys.executable, "-m", "vime.cli", "train", "--hf-checkpoint", chat_model_dir, "--prompt-data", chats]
    args += [*sft, "--save", save, "--run-dir", run_dir]
    result = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert "--rollout-num-gpus 0: no local engines" in out, out[-4000:]
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3], train
    assert all(r["weight_sync_publish_s"] == 0.0 for r in train), train
    assert not [r for r in records if r["kind"] == "weight_sync"]  # nothing was published ...
    weights = os.path.join(run_dir, "weights")
    assert not os.path.isdir(weights) or not os.listdir(weights), os.listdir(weights)  # ... nor written
    # The trainer trained: the checkpoint of step 3 and the final model hold weights other than the start's.
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == "3"
    start = load_file(os.path.join(chat_model_dir, "model.safetensors"))
    final = load_file(os.path.join(run_dir, "hf_final", "model.safetensors"))
    assert set(final) == set(start)
    assert any(not final[name].equal(start[name]) for name in start)
    assert_nothing_left(run_dir)

    # Resumed with --no-load-optim: steps 4 and 5 on the next prompts, the warm-up from its start again.
    resumed_dir = str(tmp_path / "resumed")
    resume = list(args)
    resume[resume.index("--num-rollout") + 1] = "5"
    resume[resume.index("--run-dir") + 1] = resumed_dir
    resume += ["--load", save, "--no-load-optim"]
    result = subprocess.run(resume, cwd=REPO, capture_output=True, text=True, timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert "--no-load-optim: the trainer loads the checkpoint's weights; its optimizer starts afresh" in out
    records = [json.loads(line) for line in open(os.path.join(resumed_dir, "metrics.jsonl"))]
    resumed_train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in resumed_train] == [4, 5], resumed_train
    lrs = [r["lr"] for r in train]
    assert lrs == pytest.approx([0.0, 2.5e-4, 5e-4])  # warming up over 4 optimizer steps, one per rollout
    assert [r["lr"] for r in resumed_train] == pytest.approx(lrs[:2])  # a full load would go on at 7.5e-4, 1e-3
    assert_nothing_left(resumed_dir)
