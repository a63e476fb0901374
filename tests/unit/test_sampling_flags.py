"""Rollout sampling and prompt controls (issue 19): --rollout-stop, --rollout-stop-token-ids,
--rollout-skip-special-tokens, --rollout-max-prompt-len, --rollout-max-context-len, --rollout-seed and
--over-sampling-batch-size: parsed, checked at start-up (errors name the flag), and acting: the request
vime builds for vLLM, the context cap, the prompt filter and its count, the controller's refill."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from tests.controller_spec import controller_spec as shared_controller_spec, write_prompts
from tests.train_args import minimal_train_argv as base
from vime import preflight
from vime.config import ConfigError, parse_train_args
from vime.data.source import DataError, PromptDataset, PromptRecord, PromptSubset, rows_within_prompt_len
from vime.rollout.generate import SamplingParams, generate, generate_turn, sampling_params_from_rollout
from vime.sample import Sample, Status
from vime.workers.controller import Controller, ControllerSpec

UNREACHABLE = "http://127.0.0.1:9"  # a request sent here fails: the tests below must send none


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


@pytest.fixture(scope="module")
def tokenizer():
    from vime.tools.make_tiny_model import build_tokenizer

    return build_tokenizer()  # one token per character


def test_defaults_leave_the_request_as_before(model_dir):
    r = parse_train_args(base(model_dir)).rollout
    assert (r.rollout_stop, r.rollout_stop_token_ids, r.rollout_skip_special_tokens) == (None, None, False)
    assert (r.rollout_max_prompt_len, r.rollout_max_context_len, r.rollout_seed, r.over_sampling_batch_size) == (
        None,
        None,
        None,
        None,
    )
    params = sampling_params_from_rollout(r)
    sample = Sample(group_index=3, index=1, tokens=[1, 2, 3])
    assert params.for_vllm(5, seed=params.request_seed(sample)) == {
        "max_tokens": 5,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "logprobs": 0,
    }


def test_flags_reach_the_vllm_request_and_custom_generate_functions(model_dir):
    s = parse_train_args(
        base(
            model_dir,
            *("--rollout-stop", "</answer>", "\n\n"),
            *("--rollout-stop-token-ids", "7", "9"),
            "--rollout-skip-special-tokens",
            *("--rollout-seed", "11"),
            *("--rollout-max-context-len", "64"),
            *("--rollout-temperature", "0.7"),
        )
    )
    params = sampling_params_from_rollout(s.rollout)
    sample = Sample(group_index=3, index=1, tokens=[1, 2, 3])
    request = params.for_vllm(params.remaining(sample), seed=params.request_seed(sample))
    assert request["stop"] == ["</answer>", "\n\n"]
    assert request["stop_token_ids"] == [7, 9]
    assert request["skip_special_tokens"] is True
    assert request["temperature"] == 0.7 and request["max_tokens"] == 61  # 64 - 3 prompt tokens < 1024
    assert isinstance(request["seed"], int) and 0 <= request["seed"] < 2**31
    # A custom generate function gets the reference's sampling_params keys, stop controls included.
    handed = params.as_dict()
    assert handed["stop"] == ["</answer>", "\n\n"] and handed["stop_token_ids"] == [7, 9]
    assert handed["skip_special_tokens"] is True and handed["max_new_tokens"] == 1024


def test_request_seeds_are_per_sample_and_reproducible():
    params = SamplingParams(max_new_tokens=4, seed=5)
    a, b = Sample(group_index=1, index=0, tokens=[1, 2]), Sample(group_index=1, index=1, tokens=[1, 2])
    assert params.request_seed(a) == params.request_seed(Sample(group_index=1, index=0, tokens=[1, 2]))
    assert params.request_seed(a) != params.request_seed(b)  # the group's samples draw differently
    assert params.request_seed(a) != params.request_seed(Sample(group_index=2, index=0, tokens=[1, 2]))
    assert params.request_seed(a) != params.request_seed(Sample(group_index=1, index=0, tokens=[1, 2, 3]))
    assert params.request_seed(a) != SamplingParams(max_new_tokens=4, seed=6).request_seed(a)
    assert SamplingParams(max_new_tokens=4).request_seed(a) is None


def test_context_length_caps_prompt_plus_response():
    params = SamplingParams(max_new_tokens=10, max_context_len=8)
    assert params.remaining(Sample(tokens=[1, 2, 3])) == 5  # the context, not the response limit
    partial = Sample(tokens=[1, 2, 3, 4, 5, 6])
    partial.response_length = 3
    assert params.remaining(partial) == 2
    assert SamplingParams(max_new_tokens=4, max_context_len=100).remaining(Sample(tokens=[1])) == 4
    # A sample at the limit ends TRUNCATED without a request (the URL is unreachable).
    full = Sample(tokens=list(range(8)))

    async def run():
        return await generate(None, UNREACHABLE, full, params, timeout=1.0)

    assert asyncio.run(run()).status == Status.TRUNCATED and full.response_length == 0


def test_generate_turn_stops_at_the_context_limit():
    args = argparse.Namespace(rollout_max_context_len=4, rollout_request_timeout=1.0, vllm_router_ip="127.0.0.1")
    args.vllm_router_port = 9
    sample = Sample(tokens=[1, 2, 3, 4])
    completion = asyncio.run(generate_turn(args, sample, {"max_new_tokens": 8}))
    assert completion.token_ids == [] and completion.finish_reason == "length"
    assert sample.status == Status.TRUNCATED


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--rollout-stop", ""], "--rollout-stop"),
        (["--rollout-stop-token-ids", "-1"], "--rollout-stop-token-ids"),
        (["--rollout-max-prompt-len", "0"], "--rollout-max-prompt-len"),
        (["--rollout-max-context-len", "1"], "--rollout-max-context-len"),
        (["--rollout-max-prompt-len", "64", "--rollout-max-context-len", "64"], "--rollout-max-prompt-len"),
        (["--rollout-seed", "-1"], "--rollout-seed"),
        (["--rollout-batch-size", "4", "--over-sampling-batch-size", "3"], "--over-sampling-batch-size"),
    ],
)
def test_bad_values_name_the_flag(model_dir, extra, flag):
    with pytest.raises(ConfigError, match=f"^{flag}: "):
        parse_train_args(base(model_dir, *extra))


def test_stop_token_ids_outside_the_vocabulary_name_the_flag(model_dir):
    s = parse_train_args(base(model_dir, "--rollout-stop-token-ids", "5", "99"))
    preflight.check_stop_token_ids(s, 100)
    with pytest.raises(ConfigError, match=r"^--rollout-stop-token-ids: \[99\] outside the vocabulary"):
        preflight.check_stop_token_ids(s, 99)


def test_a_checkpoint_without_tokenizer_files_is_refused_naming_the_flag(tmp_path):
    bare = tmp_path / "no_tokenizer"
    bare.mkdir()
    (bare / "config.json").write_text("{}")  # a model folder without its tokenizer
    with pytest.raises(ConfigError, match=r"^--hf-checkpoint: .*no_tokenizer has no tokenizer \(none of tokenizer"):
        preflight.check_tokenizer_files(str(bare))
    (bare / "vocab.txt").write_text("[PAD]\n")  # a WordPiece vocabulary is one
    preflight.check_tokenizer_files(str(bare))


def test_apply_chat_template_without_a_template_is_refused_before_anything_starts(tmp_path):
    folder = tmp_path / "no_template"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}')
    with pytest.raises(ConfigError, match=r"^--apply-chat-template: the tokenizer of --hf-checkpoint .* no chat"):
        preflight.check_chat_template(str(folder))
    (folder / "tokenizer_config.json").write_text('{"chat_template": "{{ messages[0][\'content\'] }}"}')
    preflight.check_chat_template(str(folder))  # in tokenizer_config.json, as older checkpoints keep it
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    preflight.check_chat_template(str(folder))  # its own file, as transformers 5 writes it


def test_bad_types_are_refused_by_the_parser(model_dir, capsys):
    with pytest.raises(SystemExit):
        parse_train_args(base(model_dir, "--rollout-stop-token-ids", "eos"))
    assert "--rollout-stop-token-ids" in capsys.readouterr().err


def dataset_of(prompts: list[str]) -> PromptDataset:
    return PromptDataset("p.jsonl", [PromptRecord(i, p, str(i), {}) for i, p in enumerate(prompts)])


def test_long_prompts_are_filtered_and_counted(model_dir, tokenizer):
    s = parse_train_args(base(model_dir, "--rollout-max-prompt-len", "4"))
    dataset = dataset_of(["1=", "12345=", "123=", "1234567=", "9="])
    said = []
    kept, rows, total = preflight.filter_long_prompts(s, dataset, tokenizer, said.append)
    assert rows == [0, 2, 4] and total == 5 and len(kept) == 3
    assert [kept[i].prompt for i in range(3)] == ["1=", "123=", "9="]
    assert [kept[i].index for i in range(3)] == [0, 1, 2]  # renumbered: the queue journals these rows
    assert said == ["--rollout-max-prompt-len 4: 2 of 5 prompts are longer and left out; 3 remain"]
    # Without the flag nothing is tokenized or filtered.
    assert preflight.filter_long_prompts(parse_train_args(base(model_dir)), dataset, tokenizer, said.append) == (
        dataset,
        None,
        None,
    )


def test_a_filter_that_leaves_nothing_names_the_flag(tokenizer):
    with pytest.raises(DataError, match="^--rollout-max-prompt-len 2: every one of the 2 prompts"):
        rows_within_prompt_len(dataset_of(["123=", "4567="]), tokenizer, 2, apply_chat_template=False)


def test_resumed_runs_keep_the_filter_and_the_seed(model_dir):
    options = preflight.run_options(
        parse_train_args(base(model_dir, "--rollout-max-prompt-len", "9", "--rollout-seed", "3"))
    )
    assert options["rollout_max_prompt_len"] == 9 and options["rollout_seed"] == 3


def controller_spec(tmp_path, **overrides) -> ControllerSpec:
    return shared_controller_spec(
        tmp_path, write_prompts(tmp_path, 40), **{"transport": "object-store", "groups_per_rollout": 4, **overrides}
    )


def fresh(controller: Controller) -> int:
    return sum(1 for task in controller.queue.pending() if task.stage == "fresh")


def test_over_sampling_batch_size_sets_the_refill_granularity(tmp_path):
    plain = Controller(controller_spec(tmp_path / "a"))
    assert fresh(plain) == 8  # two rollouts' worth
    chunked = Controller(controller_spec(tmp_path / "b", refill_multiple=6))
    assert fresh(chunked) == 12  # 8 wanted, rounded up to multiples of 6
    chunked.lease("w", 5)
    chunked._refill()
    assert fresh(chunked) == 13  # 7 left: 1 wanted, one more batch of 6


def test_refill_tops_up_by_half_a_rollout_and_skips_its_scan_while_enough_are_pending(tmp_path):
    # bench/scale: scanning every pending task and submitting one prompt at every lease made a lease cost
    # O(batch) journal work; the controller now scans only when fresh tasks may have dropped below 2 rollouts.
    controller = Controller(controller_spec(tmp_path, transport="straw"))  # 4 groups a rollout: 8 fresh pending
    scan = controller.queue.pending
    scans = []
    controller.queue.pending = lambda: scans.append(1) or scan()
    fresh_after = []
    for _ in range(4):
        controller.lease("w", 1)
        fresh_after.append(sum(1 for task in scan() if task.stage == "fresh"))
        assert controller.fresh_pending_floor <= fresh_after[-1]  # a lower bound, never more
    # 8 -> 7 (no scan) -> 7 counted, 2 added, 1 leased: 8 -> 7 (no scan) -> scan, +2, -1: 8
    assert fresh_after == [7, 8, 7, 8] and len(scans) == 2
    item = controller.lease("w", 1)[0]  # scan-free lease: 7 fresh
    controller.return_partial(item.assignment.lease, item.assignment.task, None)  # back: 8, the floor says 7
    assert controller.fresh_pending_floor == 7 and sum(1 for t in scan() if t.stage == "fresh") == 8
    controller.shutdown()


def test_the_controller_opens_the_filtered_rows(tmp_path):
    controller = Controller(controller_spec(tmp_path, prompt_rows=[1, 5, 7], num_epoch=1))
    assert len(controller.dataset) == 3
    leased = controller.lease("w", 10)
    assert [item.prompt.prompt for item in leased] == ["001=", "005=", "007="]
    assert isinstance(controller.dataset, PromptSubset)
