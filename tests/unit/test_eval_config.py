"""Evaluation controls (issue 19): --eval-top-p, --eval-top-k, --eval-input-key, --eval-label-key,
--eval-max-context-len, --skip-eval-before-train, the reference's default of evaluating at the rollout's
sampling settings, and --eval-config (a YAML file of held-out sets with per-set overrides): how each
set's settings resolve, the errors that name the flag, and what a set's settings change in its requests
and samples."""

from __future__ import annotations

import json

import pytest

from tests.train_args import minimal_train_argv as base
from vime import preflight
from vime.config import ConfigError, parse_train_args
from vime.config.evaluation import resolve_eval_datasets
from vime.rollout.evaluate import EvalDataSource, HeldOutEvaluation, eval_sampling


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


@pytest.fixture(scope="module")
def tokenizer():
    from vime.tools.make_tiny_model import build_tokenizer

    return build_tokenizer()


def held_out(tmp_path, name="test.jsonl", prompt_key="prompt", label_key="label") -> str:
    path = tmp_path / name
    path.write_text(
        "".join(json.dumps({prompt_key: f"{i}=", label_key: str(i), "metadata": {"k": i}}) + "\n" for i in range(3))
    )
    return str(path)


def resolved(s):
    return resolve_eval_datasets(s.eval, s.rollout, s.data)


def test_evaluation_samples_as_the_rollout_unless_told(model_dir, tmp_path):
    """The reference's default: eval temperature, top-p and top-k fall back to the rollout's."""
    path = held_out(tmp_path)
    rollout = ["--rollout-temperature", "0.8", "--rollout-top-p", "0.9", "--rollout-top-k", "20"]
    s = parse_train_args(base(model_dir, "--eval-prompt-data", "t", path, *rollout))
    assert s.eval.eval_temperature is None and s.eval.eval_top_p is None and s.eval.eval_top_k is None
    [d] = resolved(s)
    assert (d.name, d.path, d.temperature, d.top_p, d.top_k) == ("t", path, 0.8, 0.9, 20)
    assert (d.max_response_len, d.max_context_len, d.n_samples_per_eval_prompt) == (1024, None, 1)
    s = parse_train_args(
        base(
            model_dir,
            *("--eval-prompt-data", "t", path, *rollout),
            *("--eval-temperature", "0", "--eval-top-p", "0.5", "--eval-top-k", "4"),
            *("--eval-max-response-len", "16", "--eval-max-context-len", "48"),
        )
    )
    [d] = resolved(s)
    assert (d.temperature, d.top_p, d.top_k, d.max_response_len, d.max_context_len) == (0.0, 0.5, 4, 16, 48)


def test_eval_keys_and_context_fall_back_to_the_rollout_flags(model_dir, tmp_path):
    path = held_out(tmp_path)
    data = ["--input-key", "prompt", "--label-key", "label", "--rollout-max-context-len", "100"]
    [d] = resolved(parse_train_args(base(model_dir, "--eval-prompt-data", "t", path, *data)))
    assert (d.input_key, d.label_key, d.max_context_len) == ("prompt", "label", 100)
    [d] = resolved(
        parse_train_args(
            base(model_dir, "--eval-prompt-data", "t", path, *data, "--eval-input-key", "q", "--eval-label-key", "a")
        )
    )
    assert (d.input_key, d.label_key) == ("q", "a")


def test_stop_controls_apply_to_evaluation(model_dir, tmp_path):
    s = parse_train_args(
        base(
            model_dir,
            *("--eval-prompt-data", "t", held_out(tmp_path)),
            *("--rollout-stop", "##", "--rollout-stop-token-ids", "3", "--rollout-skip-special-tokens"),
            *("--rollout-seed", "5", "--eval-max-context-len", "40"),
        )
    )
    [d] = resolved(s)
    params = HeldOutEvaluation(s, [(d, None)], None, None, None).sampling(d)
    request = params.for_vllm(8, seed=0)
    assert request["stop"] == ["##"] and request["stop_token_ids"] == [3] and request["skip_special_tokens"]
    assert params.max_context_len == 40 and params.seed == 5


EVAL_CONFIG = """
eval:
  defaults:
    temperature: 0.6
    top_p: 0.95
    n_samples_per_eval_prompt: 2
  datasets:
    - name: easy
      path: {easy}
      prompt_key: question
      label_key: answer
      rm_type: exact_match
      metadata_overrides: {{split: test}}
    - name: hard
      path: {hard}
      temperature: 0
      top_k: 5
      max_response_len: 7
      max_context_len: 30
      stop: "###"
      stop_token_ids: [4, 6]
      n_samples_per_eval_prompt: 1
"""


def write_config(tmp_path, text: str) -> str:
    path = tmp_path / "eval.yaml"
    path.write_text(text)
    return str(path)


def test_eval_config_overrides_apply_per_dataset(model_dir, tmp_path, tokenizer):
    easy = held_out(tmp_path, "easy.jsonl", "question", "answer")
    hard = held_out(tmp_path, "hard.jsonl")
    config = write_config(tmp_path, EVAL_CONFIG.format(easy=easy, hard=hard))
    s = parse_train_args(
        base(
            model_dir,
            *("--eval-config", config, "--input-key", "prompt", "--label-key", "label"),
            *("--eval-temperature", "1.0", "--eval-top-k", "9", "--rollout-max-response-len", "12"),
        )
    )
    easy_set, hard_set = resolved(s)
    # A set's field wins over eval.defaults, which win over the --eval-* flags, then the rollout's.
    assert (easy_set.name, easy_set.input_key, easy_set.label_key) == ("easy", "question", "answer")
    assert (easy_set.temperature, easy_set.top_p, easy_set.top_k) == (0.6, 0.95, 9)
    assert (easy_set.n_samples_per_eval_prompt, easy_set.max_response_len, easy_set.stop) == (2, 12, ())
    assert (hard_set.input_key, hard_set.label_key) == ("prompt", "label")
    assert (hard_set.temperature, hard_set.top_p, hard_set.top_k) == (0, 0.95, 5)
    assert (hard_set.max_response_len, hard_set.max_context_len) == (7, 30)
    assert (hard_set.stop, hard_set.stop_token_ids, hard_set.n_samples_per_eval_prompt) == (("###",), (4, 6), 1)
    request = eval_sampling(hard_set).for_vllm(7)
    assert request["temperature"] == 0 and request["top_k"] == 5 and request["stop"] == ["###"]
    assert request["stop_token_ids"] == [4, 6]

    # Each set is read with its own keys; its rm_type and metadata_overrides reach every sample.
    sets = preflight.load_eval_sets(s, print)
    (easy_config, easy_prompts), (_, hard_prompts) = sets
    assert easy_prompts[1].prompt == "1=" and easy_prompts[1].label == "1" and hard_prompts[2].label == "2"
    source = EvalDataSource(
        "easy", easy_prompts, tokenizer=tokenizer, n_samples=2, apply_chat_template=False, config=easy_config
    )
    [group] = source.get_samples(1)
    assert [sample.metadata for sample in group] == [{"k": 0, "rm_type": "exact_match", "split": "test"}] * 2


def test_eval_config_datasets_may_be_a_mapping_and_win_over_eval_prompt_data(model_dir, tmp_path):
    easy = held_out(tmp_path, "easy.jsonl")
    config = write_config(tmp_path, f"eval:\n  datasets:\n    only:\n      path: {easy}\n      top_p: 0.5\n")
    s = parse_train_args(
        base(model_dir, "--eval-config", config, "--eval-prompt-data", "other", easy, "--input-key", "prompt")
    )
    said = []
    [(d, prompts)] = preflight.load_eval_sets(s, said.append)
    assert (d.name, d.top_p, len(prompts)) == ("only", 0.5, 3)
    assert said == [f"--eval-config {config} gives the held-out sets; --eval-prompt-data is ignored"]


@pytest.mark.parametrize(
    "text, message",
    [
        ("eval: [1, 2]", "expected a top-level 'eval' mapping"),
        ("datasets: []", "expected a top-level 'eval' mapping"),
        ("eval:\n  datasets: []", "no datasets"),
        ("eval:\n  datasets:\n    - name: a", "every dataset needs a 'path'"),
        ("eval:\n  datasets:\n    - path: a.jsonl", "every dataset needs a 'name'"),
        ("eval:\n  datasets:\n    - {name: a, path: a.jsonl, temprature: 1}", "unknown field 'temprature'"),
        ("eval:\n  datasets:\n    - {name: a, path: a.jsonl, top_k: many}", "top_k must be int"),
        ("eval:\n  datasets:\n    - {name: a, path: a.jsonl, top_p: 1.5}", "top_p must be in"),
        ("eval:\n  datasets:\n    - {name: a, path: a.jsonl, temperature: -1}", "temperature must be >= 0"),
        ("eval:\n  datasets:\n    - {name: a, path: a.jsonl, stop_token_ids: [x]}", "stop_token_ids must be"),
        ("eval:\n  datasets:\n    - {name: a, path: a.jsonl}\n    - {name: a, path: b.jsonl}", "duplicate name"),
        ("eval:\n  defaults: {path: x}\n  datasets:\n    - {name: a, path: a.jsonl}", "'path' belongs to"),
        ("eval:\n  extra: 1\n  datasets:\n    - {name: a, path: a.jsonl}", "unknown key"),
        ("eval: {datasets: [", "not valid YAML"),
    ],
)
def test_bad_eval_config_names_the_flag(model_dir, tmp_path, text, message):
    config = write_config(tmp_path, text)
    with pytest.raises(ConfigError, match=f"^--eval-config: .*{message}"):
        parse_train_args(base(model_dir, "--eval-config", config))


def test_a_missing_eval_config_names_the_flag(model_dir, tmp_path):
    with pytest.raises(ConfigError, match="^--eval-config: .*missing.yaml"):
        parse_train_args(base(model_dir, "--eval-config", str(tmp_path / "missing.yaml")))


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--eval-top-p", "0"], "--eval-top-p"),
        (["--eval-top-p", "1.2"], "--eval-top-p"),
        (["--eval-top-k", "0"], "--eval-top-k"),
        (["--eval-temperature", "-0.1"], "--eval-temperature"),
        (["--eval-max-context-len", "1"], "--eval-max-context-len"),
        (["--eval-max-response-len", "0"], "--eval-max-response-len"),
    ],
)
def test_bad_eval_flags_name_the_flag(model_dir, extra, flag):
    with pytest.raises(ConfigError, match=f"^{flag}: "):
        parse_train_args(base(model_dir, *extra))


def test_skip_eval_before_train_parses(model_dir):
    assert parse_train_args(base(model_dir, "--skip-eval-before-train")).eval.skip_eval_before_train
    assert not parse_train_args(base(model_dir)).eval.skip_eval_before_train
