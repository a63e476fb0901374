"""Built-in rewards on real answer strings, the reward flags' start-up checks, per-sample rm_type,
--reward-key, --group-rm and --custom-reward-post-process-path (vime.rollout.rewards, vime.rollout.rm_hub)."""

import asyncio

import pytest

from tests.train_args import minimal_train_argv as base
from vime.config import ConfigError, parse_train_args
from vime.config.rewards import RULE_REWARDS
from vime.rollout.rewards import Reward, RewardError, RewardOptions
from vime.rollout.rm_hub.answers import last_boxed_answer
from vime.rollout.rm_hub.math_equivalence import math_answers_match
from vime.rollout.rm_hub.rules import RULES, score_with_rule
from vime.sample import Sample


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


def test_every_declared_reward_name_has_a_rule():
    assert set(RULES) == set(RULE_REWARDS)


# ---------------------------------------------------------------------- finding the answer
@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("so the answer is \\boxed{42}.", "42"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # nested braces
        ("\\boxed{\\sqrt{\\frac{a}{b}}} done", "\\sqrt{\\frac{a}{b}}"),
        ("first \\boxed{3}, on second thought \\boxed{4}", "4"),  # the last box is the answer
        ("\\fbox{7}", "7"),
        ("$\\boxed 5$", "5"),
        ("cut off inside \\boxed{\\frac{1}{", None),  # never closed: no answer
        ("no box at all: 42", None),
    ],
)
def test_last_boxed_answer(response, answer):
    assert last_boxed_answer(response) == answer


# ---------------------------------------------------------------------- math equivalence
@pytest.mark.parametrize(
    ("given", "truth", "same"),
    [
        ("\\frac{1}{2}", "0.5", True),
        ("\\dfrac{3}{4}", "0.75", True),
        ("\\frac12", "1/2", True),
        ("\\frac{2}{4}", "\\frac{1}{2}", False),  # an unreduced fraction is not the answer (reference rule)
        ("-\\frac{1}{2}", "\\frac{-1}{2}", True),
        ("10\\text{ cm}", "10", True),  # a unit written as text
        ("\\text{Tuesday}", "tuesday", True),
        ("5.", "5", True),  # a full stop ends the sentence, not the number
        ("x = 3", "3", True),
        ("1,000", "1000", True),
        ("3.0", "3", True),
        ("\\sqrt{9}", "3", False),  # an integer must be written as a number (reference rule)
        ("30^\\circ", "30", True),
        ("50\\%", "50", True),
        ("2\\sqrt{3}", "\\sqrt{12}", True),
        ("(x+1)^2", "x^2+2x+1", True),
        ("\\left( 1, 2 \\right)", "(1,2)", True),
        ("\\pi/2", "\\frac{\\pi}{2}", True),
        ("\\frac{\\pi}{3}", "\\frac{\\pi}{2}", False),
        ("10^{10^{10}}", "1", False),  # too expensive to compare symbolically: not equal, and fast
        ("", "3", False),
    ],
)
def test_math_answers_match(given, truth, same):
    assert math_answers_match(given, truth) is same


def test_math_rule_grades_the_last_boxed_answer_against_a_boxed_or_plain_label():
    assert score_with_rule("math", "We get $\\boxed{\\dfrac{1}{2}}$.", "\\frac12", {}) == 1.0
    assert score_with_rule("math", "We get $\\boxed{\\dfrac{1}{2}}$.", "The answer is \\boxed{0.5}", {}) == 1.0
    assert score_with_rule("math", "\\boxed{1} or rather \\boxed{2}", "1", {}) == 0.0
    assert score_with_rule("math", "The answer is 1/2.", "1/2", {}) == 0.0  # no box, no answer
    assert score_with_rule("math", "\\boxed{3}", "", {}) == 0.0


def test_deepscaler_needs_finished_thinking():
    label = "\\frac{3}{4}"
    assert score_with_rule("deepscaler", "<think>maybe \\boxed{1}</think> so \\boxed{0.75}", label, {}) == 1.0
    assert score_with_rule("deepscaler", "<think>\\boxed{3/4}</think> I am not sure.", label, {}) == 0.0
    assert score_with_rule("deepscaler", "no thinking \\boxed{3/4}", label, {}) == 0.0
    assert score_with_rule("deepscaler", "###Response \\boxed{3/4}", label, {}) == 1.0
    # boxed_: any box of the response counts, thinking or not.
    assert score_with_rule("boxed_deepscaler", "no thinking \\boxed{3/4}", label, {}) == 1.0


def test_dapo_reads_the_last_answer_line_and_pays_plus_or_minus_one():
    assert score_with_rule("dapo", "... so\nAnswer: 42", "42", {}) == {"score": 1.0, "acc": True, "pred": "42"}
    assert score_with_rule("dapo", "Answer: 41\nAnswer: $42$.", "42", {})["score"] == 1.0
    assert score_with_rule("dapo", "Answer: 1,000 dollars", "1000", {})["score"] == 1.0
    assert score_with_rule("dapo", "Answer: 41", "\\boxed{42}", {})["score"] == -1.0
    # Only the response's last 300 characters are read.
    assert score_with_rule("dapo", "Answer: 42\n" + "x" * 400, "42", {}) == {
        "score": -1.0,
        "acc": False,
        "pred": "[INVALID]",
    }
    assert score_with_rule("boxed_dapo", "I think \\boxed{42}", "42", {})["score"] == 1.0


def test_gpqa_letter_choices():
    choices = {"choices": ["1 eV", "2 eV", "3 eV", "4 eV"]}
    assert score_with_rule("gpqa", "<think>A? B?</think>The answer is (C).", "C", choices) == 1.0
    assert score_with_rule("gpqa", "The answer is (C).", 2, choices) == 1.0  # the label as an index
    assert score_with_rule("gpqa", "The answer is (C).", "3 eV", choices) == 1.0  # the label as the option's text
    assert score_with_rule("gpqa", "The answer is clearly B", "C", choices) == 0.0  # 'clearly' names no option
    assert score_with_rule("gpqa", "D is correct", "D", {}) == 1.0
    assert score_with_rule("gpqa", "It must be 3 eV", "C", choices) == 1.0  # no letter: the option's text
    assert score_with_rule("boxed_gpqa", "A looks right but \\boxed{B}", "B", {}) == 1.0
    assert score_with_rule("boxed_gpqa", "The answer is B", "B", {}) == 0.0  # no box: no answer


def test_text_rules_and_their_boxed_variants():
    assert score_with_rule("f1", "The Eiffel Tower!", "eiffel tower", {}) == 1.0
    assert score_with_rule("f1", "yes", "no", {}) == 0.0
    assert score_with_rule("exact_match", "  Paris ", "paris", {}) == 1.0
    assert score_with_rule("boxed_exact_match", "I say \\boxed{Paris}", "paris", {}) == 1.0
    assert score_with_rule("boxed_f1", "Paris, no box", "paris", {}) == 0.0


# ---------------------------------------------------------------------- start-up checks
@pytest.mark.parametrize(
    ("flags", "flag", "message"),
    [
        (["--rm-type", "bogus"], "--rm-type", "unknown reward 'bogus'"),
        (["--rm-type", "ifbench"], "--rm-type", "IFBench"),
        (["--rm-type", "boxed_remote_rm", "--rm-url", "http://127.0.0.1:1/"], "--rm-type", "boxed_ prefix"),
        (["--rm-type", "remote_rm"], "--rm-url", "is required"),
        (["--rm-url", "ftp://host/x"], "--rm-url", "http:// or https://"),
        (["--rm-timeout", "0"], "--rm-timeout", "must be > 0"),
        (["--rm-max-attempts", "0"], "--rm-max-attempts", "must be >= 1"),
        (["--reward-key", " "], "--reward-key", "must not be empty"),
    ],
)
def test_bad_reward_flags_are_refused_naming_the_flag(model_dir, flags, flag, message):
    with pytest.raises(ConfigError, match=f"^{flag}: .*{message}"):
        parse_train_args(base(model_dir, *flags))


def test_good_reward_flags_parse(model_dir):
    s = parse_train_args(
        base(model_dir, "--rm-type", "boxed_math", "--reward-key", "score", "--group-rm", "--rm-timeout", "5")
    )
    r = s.rollout
    assert (r.rm_type, r.reward_key, r.group_rm, r.rm_timeout) == ("boxed_math", "score", True, 5.0)
    s = parse_train_args(base(model_dir, "--rm-type", "remote_rm", "--rm-url", "http://127.0.0.1:8000/score"))
    assert RewardOptions.from_config(s.rollout).rm_url == "http://127.0.0.1:8000/score"


# ---------------------------------------------------------------------- scoring samples
def _sample(response, label, index=0, **metadata):
    return Sample(index=index, group_index=3, response=response, label=label, metadata=metadata)


def test_per_sample_rm_type_overrides_the_flag_and_symbolic_rules_run_in_the_reward_process():
    reward = Reward(RewardOptions(rm_type="exact_match"))
    samples = [
        _sample("\\boxed{\\frac{1}{2}}", "0.5", 0, rm_type="math"),  # graded by math in the reward process
        _sample("\\boxed{0.5}", "0.5", 1),  # exact_match: the text differs
        _sample("The answer is (B)", "B", 2, rm_type="gpqa"),
    ]
    asyncio.run(reward.score_group(None, samples))
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0]
    with pytest.raises(RewardError, match=r'metadata\["rm_type"\] of sample 0 of group 3: unknown reward'):
        asyncio.run(reward.score_group(None, [_sample("x", "x", rm_type="nope")]))


def test_reward_key_picks_the_scalar_of_a_dict_reward(tmp_path):
    (tmp_path / "rm.py").write_text(
        "def rm(args, sample):\n    return {'score': 0.25, 'acc': True}\n"
        "async def group(args, samples):\n    group.calls += 1\n    return [s.index * 0.5 for s in samples]\n"
        "group.calls = 0\n"
        "def short(args, samples):\n    return [1.0]\n"
    )
    dapo = Reward(RewardOptions(rm_type="dapo"))  # dapo's dict: 'score' unless --reward-key says otherwise
    sample = _sample("Answer: 7", "7")
    assert asyncio.run(dapo.score(None, sample)) == 1.0
    acc = Reward(RewardOptions(rm_type="dapo", reward_key="acc"))
    assert asyncio.run(acc.score(None, _sample("Answer: 8", "7"))) == 0.0

    custom = Reward(RewardOptions(custom_rm_path=f"{tmp_path}/rm.py:rm", reward_key="score"))
    assert asyncio.run(custom.score(None, _sample("a", "b"))) == 0.25
    no_key = Reward(RewardOptions(custom_rm_path=f"{tmp_path}/rm.py:rm"))
    with pytest.raises(RewardError, match="returned a dict .* name the key that is the reward with --reward-key"):
        asyncio.run(no_key.score(None, _sample("a", "b")))
    wrong_key = Reward(RewardOptions(custom_rm_path=f"{tmp_path}/rm.py:rm", reward_key="nope"))
    with pytest.raises(RewardError, match="--reward-key 'nope': .* no such key"):
        asyncio.run(wrong_key.score(None, _sample("a", "b")))


def test_group_rm_calls_the_function_once_per_group(tmp_path):
    import sys

    (tmp_path / "grm.py").write_text(
        "async def group(args, samples):\n    group.calls += 1\n    return [s.index * 0.5 for s in samples]\n"
        "group.calls = 0\n"
        "def short(args, samples):\n    return [1.0]\n"
    )
    reward = Reward(RewardOptions(custom_rm_path=f"{tmp_path}/grm.py:group", group_rm=True))
    samples = [_sample("r", "l", i) for i in range(3)]
    asyncio.run(reward.score_group(None, samples))
    assert [s.reward for s in samples] == [0.0, 0.5, 1.0]
    assert sys.modules["vime_plugin_grm"].group.calls == 1
    short = Reward(RewardOptions(custom_rm_path=f"{tmp_path}/grm.py:short", group_rm=True))
    with pytest.raises(RewardError, match="returned 1 rewards for a group of 3 samples"):
        asyncio.run(short.score_group(None, [_sample("r", "l", i) for i in range(3)]))


def test_reference_hub_functions_return_the_raw_result():
    import argparse

    from vime.rollout.rm_hub import async_rm, batched_async_rm

    args = argparse.Namespace(rm_type="dapo", custom_rm_path="never.called", reward_key=None)
    assert asyncio.run(async_rm(args, _sample("Answer: 3", "3")))["score"] == 1.0
    rewards = asyncio.run(batched_async_rm(args, [_sample("Answer: 3", "3"), _sample("x", "3", rm_type="f1")]))
    assert rewards[0]["acc"] is True and rewards[1] == 0.0


# ---------------------------------------------------------------------- --custom-reward-post-process-path
def test_post_processed_rewards_replace_the_group_normalisation(tmp_path):
    import collections

    import torch

    from vime.config.algorithm import AlgorithmConfig
    from vime.rl.batch import pack
    from vime.rl.objective import RLObjective
    from vime.rl.user_hooks import RewardPostProcessError

    (tmp_path / "post.py").write_text(
        "def post(args, samples):\n"
        "    raw = [s.get_reward_value(args) for s in samples]\n"
        "    return raw, [r * args.n_samples_per_prompt for r in raw]\n"
        "def bad(args, samples):\n    return [0.0] * len(samples)\n"
    )
    samples = [
        Sample(index=i, group_index=0, tokens=[1, 2, 3, 4], response_length=2, reward=r)
        for i, r in enumerate([1.0, -0.5])
    ]
    packed = [pack(samples, pad_id=0)]
    old = [torch.zeros(packed[0].targets.shape)]

    def advantages(path):
        objective = RLObjective(
            AlgorithmConfig(custom_reward_post_process_path=path),
            n_samples_per_prompt=2,
            rollout_temperature=1.0,
            hf_checkpoint="unused",
        )
        out, _ = objective.advantages(samples, packed, old, [None], [None], collections.defaultdict(list))
        return [float(row[packed[0].response_mask[i].bool()][0]) for i, row in enumerate(out[0])]

    assert advantages(None) == pytest.approx([0.7071, -0.7071], abs=1e-3)  # GRPO: group mean and std
    assert advantages(f"{tmp_path}/post.py:post") == pytest.approx([2.0, -1.0])  # the hook's, as they are
    with pytest.raises(RewardPostProcessError, match="raw_rewards is a float; expected"):
        advantages(f"{tmp_path}/post.py:bad")
