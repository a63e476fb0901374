"""The RL algorithm flags: defaults, the objective they select, and every refused combination naming its flag."""

import json

import pytest

from tests.train_args import minimal_train_argv as base
from vime.config import ConfigError, parse_train_args
from vime.rl.algorithm_checks import check_algorithm_with_run


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 12}))
    return str(tmp_path)


SCORE_CENTERING = [
    "--use-score-centering",
    "--score-centering-top-k",
    "4",
    "--advantage-estimator",
    "grpo",
    "--disable-grpo-std-normalization",
    "--calculate-per-token-loss",
    "--rollout-temperature",
    "1.0",
    "--rollout-top-p",
    "1.0",
    "--rollout-top-k",
    "-1",
    "--entropy-coef",
    "0",
    "--kl-coef",
    "0",
]


@pytest.mark.parametrize(
    "extra, objective",
    [
        ([], "ppo"),
        (["--advantage-estimator", "gspo"], "gspo"),
        (["--advantage-estimator", "cispo", "--eps-clip", "1.0", "--eps-clip-high", "4.0"], "cispo"),
        (
            [
                "--advantage-estimator",
                "reinforce_plus_plus",
                "--normalize-advantages",
                "--kl-coef",
                "0.01",
                "--gamma",
                "0.99",
            ],
            "ppo",
        ),
        (["--advantage-estimator", "reinforce_plus_plus_baseline", "--normalize-advantages"], "ppo"),
        (["--pg-loss-type", "reinforce"], "reinforce"),
        (SCORE_CENTERING, "reinforce"),  # the seeds' example launch
        (SCORE_CENTERING + ["--pg-loss-type", "reinforce", "--use-tis"], "reinforce"),
        (["--loss-type", "sft_loss"], "sft"),
        (["--use-kl-loss", "--kl-loss-coef", "0.001", "--kl-loss-type", "low_var_kl", "--entropy-coef", "0.01"], "ppo"),
        (
            [
                "--use-tis",
                "--tis-clip",
                "3",
                "--tis-clip-low",
                "0.5",
                "--custom-tis-function-path",
                "vime.backends.megatron_utils.loss.icepop_function",
            ],
            "ppo",
        ),
        (["--eps-clip-c", "3"], "ppo"),
        (["--mask-offpolicy-in-partial-rollout", "--partial-rollout"], "ppo"),
        (
            [
                "--advantage-estimator",
                "ppo",
                "--kl-coef",
                "0.01",
                "--gamma",
                "0.99",
                "--lambd",
                "0.95",
                "--value-clip",
                "0.5",
                "--num-critic-only-steps",
                "2",
            ],
            "ppo",
        ),
        (["--use-opd", "--opd-kl-coef", "0.5", "--opd-teacher-url", "http://127.0.0.1:9"], "ppo"),
    ],
)
def test_valid_combinations_and_the_objective_they_select(model_dir, extra, objective):
    settings = parse_train_args(base(model_dir, *extra))
    assert settings.algorithm.policy_loss == objective
    check_algorithm_with_run(settings)


def test_ref_load_must_be_a_model_folder_and_defaults_to_none(model_dir, tmp_path):
    assert parse_train_args(base(model_dir, "--use-kl-loss")).algorithm.ref_load is None
    settings = parse_train_args(base(model_dir, "--use-kl-loss", "--ref-load", model_dir))
    assert settings.algorithm.needs_reference_model and settings.algorithm.ref_load == model_dir
    with pytest.raises(ConfigError, match="^--ref-load: .*is neither an HF model folder .* nor a Megatron checkpoint"):
        parse_train_args(base(model_dir, "--use-kl-loss", "--ref-load", str(tmp_path / "nowhere")))
    # Without a KL term it is still where the actor starts (the seeds), on either backend.
    assert parse_train_args(base(model_dir, "--ref-load", model_dir)).algorithm.ref_load == model_dir
    # A Megatron checkpoint directory (latest_checkpointed_iteration.txt): the torch trainer reads it converted.
    megatron = tmp_path / "megatron_ckpt"
    megatron.mkdir()
    (megatron / "latest_checkpointed_iteration.txt").write_text("0")
    assert parse_train_args(base(model_dir, "--ref-load", str(megatron))).algorithm.ref_load == str(megatron)


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--advantage-estimator", "magic"], "--advantage-estimator"),
        (["--gamma", "1.5"], "--gamma"),
        (["--lambd", "-0.1"], "--lambd"),
        (["--eps-clip", "0"], "--eps-clip"),
        (["--eps-clip-high", "-1"], "--eps-clip-high"),
        (["--eps-clip-c", "0.5"], "--eps-clip-c"),
        (["--eps-clip-c", "3", "--pg-loss-type", "reinforce"], "--eps-clip-c"),
        (["--advantage-estimator", "gspo", "--pg-loss-type", "ppo"], "--pg-loss-type"),
        (["--advantage-estimator", "cispo", "--pg-loss-type", "reinforce"], "--pg-loss-type"),
        (["--advantage-estimator", "reinforce_plus_plus"], "--normalize-advantages"),
        (["--advantage-estimator", "reinforce_plus_plus_baseline"], "--normalize-advantages"),
        (
            [
                "--advantage-estimator",
                "reinforce_plus_plus",
                "--normalize-advantages",
                "--disable-grpo-std-normalization",
            ],
            "--disable-grpo-std-normalization",
        ),
        (["--kl-coef", "-0.1"], "--kl-coef"),
        (["--kl-coef", "0.1"], "--kl-coef"),  # GRPO does not shape rewards
        (["--use-kl-loss", "--kl-loss-coef", "-1"], "--kl-loss-coef"),
        (["--kl-loss-coef", "0.1"], "--kl-loss-coef"),  # without --use-kl-loss
        (
            [
                "--advantage-estimator",
                "reinforce_plus_plus",
                "--normalize-advantages",
                "--kl-coef",
                "0.1",
                "--use-kl-loss",
                "--kl-loss-coef",
                "0.1",
            ],
            "--kl-coef",
        ),  # both KL penalties
        (["--ref-load", "somewhere"], "--ref-load"),  # neither an HF folder nor a Megatron checkpoint
        (["--tis-clip", "0"], "--tis-clip"),
        (["--tis-clip-low", "3"], "--tis-clip-low"),
        (["--use-tis", "--use-rollout-logprobs"], "--use-tis"),
        (["--custom-tis-function-path", "a.b"], "--custom-tis-function-path"),  # without --use-tis
        (["--loss-type", "sft_loss", "--use-tis"], "--use-tis"),
        (["--loss-type", "sft_loss", "--use-kl-loss"], "--use-kl-loss"),
        (["--loss-type", "sft_loss", "--use-score-centering"], "--use-score-centering"),
        (["--loss-type", "sft_loss", "--entropy-coef", "0.1"], "--entropy-coef"),
        (["--use-score-centering", "--pg-loss-type", "ppo"], "--pg-loss-type"),
        (["--use-score-centering", "--advantage-estimator", "gspo"], "--advantage-estimator"),
        (["--use-score-centering", "--advantage-estimator", "cispo"], "--advantage-estimator"),
        (["--use-score-centering", "--score-centering-top-k", "0"], "--score-centering-top-k"),
        (
            ["--use-score-centering", "--use-tis", "--custom-tis-function-path", "my.module.weigh"],
            "--custom-tis-function-path",
        ),
    ],
)
def test_refused_combinations_name_the_flag(model_dir, extra, flag):
    with pytest.raises(ConfigError) as error:
        parse_train_args(base(model_dir, *extra))
    assert str(error.value).startswith(flag + ":"), str(error.value)


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--rollout-top-k", "20"], "--rollout-top-k"),
        (["--rollout-temperature", "0"], "--rollout-temperature"),
        (["--score-centering-top-k", "13"], "--score-centering-top-k"),  # the model has 12 tokens
    ],
)
def test_score_centering_sampling_requirements_name_the_flag(model_dir, extra, flag):
    with pytest.raises(ConfigError) as error:  # vime.config.validate runs check_algorithm_with_run
        parse_train_args(base(model_dir, "--use-score-centering", "--score-centering-top-k", "4", *extra))
    assert str(error.value).startswith(flag + ":"), str(error.value)


def test_top_p_replay_ignores_the_top_k_size(model_dir):
    settings = parse_train_args(
        base(model_dir, "--use-score-centering", "--score-centering-top-k", "500", "--rollout-top-p", "0.9")
    )
    check_algorithm_with_run(settings)
