"""--eval-function-path through vime's evaluation entry point (an engine-free eval function on a
Parquet held-out set), the forms its answer may take, and the helpers multi-turn generate functions
use to build a sample turn by turn."""

from __future__ import annotations

import asyncio
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vime.data.source import DataKeys, PromptDataset, PromptRecord
from vime.rollout.evaluate import EvalDataSource, eval_output_data, evaluate_dataset, interpret_eval_output
from vime.rollout.generate import SamplingParams, append_observation, session_headers
from vime.rollout.types import RolloutFnEvalOutput
from vime.sample import Sample, Status

EVAL_FUNCTION = """
from vime.rollout.types import RolloutFnEvalOutput

CALLS = []

def generate_rollout(args, rollout_id, data_source, evaluation=False):
    CALLS.append((rollout_id, data_source.name, evaluation))
    groups = data_source.get_samples(1000)
    assert data_source.get_samples(1) == []            # one pass over the held-out set
    samples = [s for g in groups for s in g]
    for s in samples:                                  # "answers" without an engine: the label itself
        s.response = s.label if s.source_name == "easy" else ""
        s.reward = float(s.response == s.label)
    return RolloutFnEvalOutput(data={data_source.name: {"rewards": [s.reward for s in samples], "samples": samples}},
                               metrics={"calls": len(CALLS)})
"""


@pytest.fixture(scope="module")
def tokenizer():
    from vime.tools.make_tiny_model import build_tokenizer

    return build_tokenizer()


def test_eval_function_runs_on_a_parquet_set(tmp_path, tokenizer):
    rows = [
        {"prompt": f"{i}=", "label": str(i), "metadata": {"source_name": "easy" if i < 3 else "hard"}} for i in range(4)
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "test.parquet")
    dataset = PromptDataset.load(str(tmp_path / "test.parquet"), DataKeys("prompt", "label"))
    (tmp_path / "my_eval.py").write_text(EVAL_FUNCTION)

    async def no_reward(args, sample):
        raise AssertionError("the eval function scores its own samples")

    result = asyncio.run(
        evaluate_dataset(
            dataset,
            tokenizer=tokenizer,
            router_url="http://127.0.0.1:9",
            reward=no_reward,
            args=None,
            params=SamplingParams(max_new_tokens=2),
            n_samples=2,
            apply_chat_template=False,
            timeout=1.0,
            name="held_out",
            rollout_id=7,
            eval_function_path=f"{tmp_path}/my_eval.py:generate_rollout",
        )
    )
    metrics = result.metrics
    assert metrics["reward"] == 0.75 and metrics["samples"] == 8
    assert metrics["reward/easy"] == 1.0 and metrics["reward/hard"] == 0.0 and metrics["calls"] == 1.0
    # What --custom-eval-rollout-log-function-path is given for the set: the function's own entry.
    assert result.data["rewards"] == [1.0] * 6 + [0.0] * 2 and len(result.data["samples"]) == 8
    assert sys.modules["vime_plugin_my_eval"].CALLS == [(7, "held_out", True)]


def test_eval_data_source_hands_out_groups_once(tokenizer):
    dataset = PromptDataset("x", [PromptRecord(i, f"{i}=", str(i), {}) for i in range(3)])
    source = EvalDataSource("set", dataset, tokenizer=tokenizer, n_samples=2, apply_chat_template=False)
    first, rest = source.get_samples(2), source.get_samples(5)
    assert [len(g) for g in first + rest] == [2, 2, 2] and source.get_samples(1) == []
    assert first[0][1].session_id == "eval-set-0-1" and first[0][0].tokens == tokenizer("0=")["input_ids"]


def test_eval_answers_in_several_forms_and_a_bad_one():
    scored = [Sample(reward=1.0, response_length=2), Sample(reward=0.0, response_length=4)]
    assert interpret_eval_output(scored, "s", "f")["reward"] == 0.5
    assert interpret_eval_output({"s": {"rewards": [1, 0, 0, 1]}}, "s", "f")["samples"] == 4
    wrapped = RolloutFnEvalOutput(data={"s": {"rewards": [1.0], "response_lengths": [3]}}, metrics={"m": 2})
    assert interpret_eval_output(wrapped, "s", "f") == {"reward": 1.0, "response_length": 3.0, "samples": 1.0, "m": 2.0}
    # The data --custom-eval-rollout-log-function-path is given, from each form.
    scored[1].status = Status.TRUNCATED
    data = eval_output_data(scored, "s")
    assert data["rewards"] == [1.0, 0.0] and data["truncated"] == [False, True] and data["samples"] == scored
    assert eval_output_data({"s": {"rewards": [1, 0]}}, "s") == {"rewards": [1, 0]}
    assert eval_output_data(wrapped, "s") == {"rewards": [1.0], "response_lengths": [3]}
    built = eval_output_data({"s": {"samples": scored}}, "s")
    assert built["rewards"] == [1.0, 0.0] and built["samples"] == scored
    with pytest.raises(TypeError, match=r"--eval-function-path my\.py:f: for held-out set 's' it returned NoneType"):
        interpret_eval_output(None, "s", "my.py:f")


def test_turn_helpers_keep_every_per_token_list_aligned():
    sample = Sample(tokens=[5, 6], session_id="g1-0")
    append_observation(sample, [7])  # an observation before any generated token
    sample.append_response_tokens([8, 9], [-0.5, -0.25], [3, 3])
    append_observation(sample, [10, 11])
    assert sample.response_tokens == [7, 8, 9, 10, 11] and sample.response_length == 5
    assert sample.loss_mask == [0, 1, 1, 0, 0]
    assert sample.rollout_log_probs == [0.0, -0.5, -0.25, 0.0, 0.0]
    assert sample.weight_versions == [0, 3, 3, 3, 3]
    assert session_headers("g1-0") == {"x-session-id": "g1-0"} and session_headers(None) == {}
