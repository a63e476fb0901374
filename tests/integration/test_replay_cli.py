"""Debug replay and queue export through the real commands.

A real `vime train` (Ray actors, router process, straw queue, torch trainer; engine-free rollout
function whose samples fill every stored field) records each trained batch; a replay of those
archives starts nothing but the trainer and reproduces the recorded losses and gradient norms bit
for bit; a second run refuses to overwrite them; `vime queue export` writes the queue as jsonl and
parquet, which read back to the very samples in the queue.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.e2e.test_main_job import EXAMPLE, assert_nothing_left
from tests.unit.test_debug_replay import assert_same_sample

pytestmark = pytest.mark.integration

PLUGIN = os.path.join(REPO, "tests", "plugins", "replay_rollout.py") + ":generate_rollout"
STEPS = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from vime.tools.make_tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("model")))


def train(model_dir: str, run_dir: str, *extra: str) -> subprocess.CompletedProcess:
    # Two optimizer steps of one micro-batch each per rollout: the second sees moved weights, so
    # losses are not trivially zero and gradient accumulation is part of what must match.
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
        PLUGIN,
        "--custom-rm-path",
        os.path.join(EXAMPLE, "reward.py") + ":reward",
        "--rollout-num-gpus",
        "0",
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "2",
        "--global-batch-size",
        "2",
        "--micro-batch-size",
        "1",
        "--num-rollout",
        str(STEPS),
        "--lr",
        "1e-3",
        "--no-save-hf",
        "--run-dir",
        run_dir,
        *extra,
    ]
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300)


def train_records(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == "train"]


def queue_samples(data_dir: str) -> dict[int, list]:
    """Queue position -> the accepted group's samples, read from disk."""
    from vime.queue.journal_view import JournalView
    from vime.queue.rollout_queue import StoreOptions
    from vime.queue.transport import StrawTransport

    transport = StrawTransport(StoreOptions(data_dir, "vime"))
    try:
        return {
            g.position: sorted(transport.read(g.ref), key=lambda s: s.index)
            for g in JournalView.read(data_dir).accepted()
        }
    finally:
        transport.close()


def test_record_replay_refuse_and_export(tmp_path, model_dir):
    from vime.recovery.debug_archive import existing_archives, read_archive
    from vime.tools.queue_export import read_export, sample_from_row

    template = str(tmp_path / "debug" / "{rollout_id}.vdr")
    recorded_dir = str(tmp_path / "recorded")
    result = train(model_dir, recorded_dir, "--save-debug-rollout-data", template)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert_nothing_left(recorded_dir)
    recorded = train_records(recorded_dir)
    assert [r["step"] for r in recorded] == [1, 2, 3]

    # ---- every archive holds exactly the step's groups from the queue, and the step's metrics
    archives = existing_archives(template)
    assert list(archives) == [0, 1, 2]
    in_queue = queue_samples(os.path.join(recorded_dir, "rollout_data"))
    step_of = {}  # queue position -> the step that trained it
    for rollout_id, path in archives.items():
        archive = read_archive(path)
        assert archive.rollout_id == rollout_id and archive.policy_version == recorded[rollout_id]["weight_version"] - 1
        for key in ("loss", "grad_norm", "reward_mean", "pg_clipfrac"):
            assert archive.metrics[key] == recorded[rollout_id][key], key
        assert "--save-debug-rollout-data" in archive.argv
        for group, samples in zip(archive.groups, archive.grouped()):
            step_of[group.position] = rollout_id + 1
            assert len(samples) == 2
            for original, restored in zip(in_queue[group.position], samples):
                assert restored.rollout_routed_experts is not None and restored.rollout_log_probs is not None
                assert_same_sample(original, restored)
    assert list(step_of) == sorted(step_of) and len(step_of) == 2 * STEPS  # the queue's order, each group once

    # ---- replay: nothing but the trainer, the same numbers bit for bit
    before = {path: open(path, "rb").read() for path in archives.values()}
    replay_dir = str(tmp_path / "replay")
    result = train(model_dir, replay_dir, "--load-debug-rollout-data", template)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for absent in ("starting Ray", "vllm-router", "rollout worker(s) generating", "warning"):
        assert absent not in result.stdout, absent
    assert not os.path.exists(os.path.join(replay_dir, "rollout_data"))
    replayed = train_records(replay_dir)
    assert [r["step"] for r in replayed] == [1, 2, 3]
    assert any(r["loss"] != 0 for r in recorded)
    for old, new in zip(recorded, replayed):
        assert (new["loss"], new["grad_norm"]) == (old["loss"], old["grad_norm"])  # floats via JSON repr: exact
        assert new["weight_version"] == old["weight_version"] and new["replay_matches"] is True
    assert json.load(open(os.path.join(replay_dir, "replay.json")))["all_match"] is True

    # ---- another run may not overwrite the archives (it trains other groups first: shuffled prompts)
    other_dir = str(tmp_path / "other")
    result = train(model_dir, other_dir, "--rollout-shuffle", "--save-debug-rollout-data", template)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stderr.startswith("vime train: error: --save-debug-rollout-data: ")
    assert archives[0] in result.stderr and "immutable" in result.stderr
    assert {path: open(path, "rb").read() for path in archives.values()} == before
    assert_nothing_left(other_dir)

    # ---- export: jsonl (with decoded text) and parquet both read back to the queue's samples
    data_dir = os.path.join(recorded_dir, "rollout_data")
    outputs = {"jsonl": str(tmp_path / "queue.jsonl"), "parquet": str(tmp_path / "queue.parquet")}
    for fmt, out in outputs.items():
        extra = ["--hf-checkpoint", model_dir] if fmt == "jsonl" else []
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "vime.cli",
                "queue",
                "export",
                "--rollout-data-dir",
                data_dir,
                "--format",
                fmt,
                *extra,
                out,
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"exported {2 * len(in_queue)} sample(s) of {len(in_queue)} accepted group(s)" in result.stdout
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    exported = {fmt: read_export(out) for fmt, out in outputs.items()}
    for fmt, rows in exported.items():
        assert [(r["position"], r["index"]) for r in rows] == [(p, i) for p in sorted(in_queue) for i in (0, 1)]
        for row in rows:
            original = in_queue[row["position"]][row["index"]]
            assert_same_sample(original, sample_from_row(row))
            assert row["source_name"] == "digit_shift" and row["task_id"]
            stage = (
                "trained" if row["position"] in step_of else "stale" if row["position"] < max(step_of) else "accepted"
            )  # stale: passed over, regenerated
            assert (row["stage"], row["step"]) == (stage, step_of.get(row["position"]))
            if fmt == "jsonl":
                assert row["prompt_text"] == tokenizer.decode(original.tokens[: original.prompt_length])
                assert row["response_text"] == tokenizer.decode(original.response_tokens)
            else:
                assert "prompt_text" not in row  # token ids only without --hf-checkpoint
