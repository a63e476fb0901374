"""Start-up checks of the RL algorithm flags: every error names the flag to change.

``check_algorithm_flags`` needs only the algorithm section (it runs from
``AlgorithmConfig.validate``). ``check_algorithm_with_run`` also reads the rollout and model
settings (sampling parameters, vocabulary size); it belongs with the cross-section checks of
``vime.config.validate``.
"""

from __future__ import annotations

import json
import math
import os
from typing import TYPE_CHECKING

from vime.config.base import ConfigError, require

if TYPE_CHECKING:
    from vime.config import TrainSettings
    from vime.config.algorithm import AlgorithmConfig

# Estimators that fold the --kl-coef penalty into the rewards.
KL_SHAPED_ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")


def check_algorithm_flags(algo: AlgorithmConfig) -> None:
    from vime.config.algorithm import ADVANTAGE_ESTIMATORS

    estimator = algo.advantage_estimator
    require(
        estimator in ADVANTAGE_ESTIMATORS,
        "--advantage-estimator",
        f"unknown estimator {estimator!r}; choose one of {', '.join(ADVANTAGE_ESTIMATORS)}",
    )
    require(0 <= algo.gamma <= 1, "--gamma", "must be in [0, 1]")
    require(0 <= algo.lambd <= 1, "--lambd", "must be in [0, 1]")

    # Clipping.
    require(algo.eps_clip > 0, "--eps-clip", "must be > 0")
    require(algo.eps_clip_high is None or algo.eps_clip_high > 0, "--eps-clip-high", "must be > 0")
    require(algo.eps_clip_c is None or algo.eps_clip_c > 1, "--eps-clip-c", "must be > 1 (dual-clip bound)")
    require(
        algo.eps_clip_c is None or algo.policy_loss == "ppo",
        "--eps-clip-c",
        f"dual clipping applies to the PPO objective only, not to {algo.policy_loss!r}",
    )
    require(
        algo.pg_loss_type is None or estimator not in ("gspo", "cispo"),
        "--pg-loss-type",
        f"--advantage-estimator {estimator} defines its own objective; drop --pg-loss-type",
    )

    # Advantages.
    require(
        estimator not in ("reinforce_plus_plus", "reinforce_plus_plus_baseline") or algo.normalize_advantages,
        "--normalize-advantages",
        f"--advantage-estimator {estimator} whitens its advantages over the batch; add --normalize-advantages",
    )
    require(
        not algo.disable_grpo_std_normalization or estimator in ("grpo", "gspo", "cispo"),
        "--disable-grpo-std-normalization",
        f"has no effect with --advantage-estimator {estimator}",
    )

    # KL to the reference model.
    require(math.isfinite(algo.kl_coef) and algo.kl_coef >= 0, "--kl-coef", "must be >= 0")
    require(math.isfinite(algo.kl_loss_coef) and algo.kl_loss_coef >= 0, "--kl-loss-coef", "must be >= 0")
    require(
        algo.kl_coef == 0 or estimator in KL_SHAPED_ESTIMATORS,
        "--kl-coef",
        f"--advantage-estimator {estimator} does not shape rewards with a KL penalty; use --use-kl-loss "
        "--kl-loss-coef instead",
    )
    require(algo.kl_loss_coef == 0 or algo.use_kl_loss, "--kl-loss-coef", "has no effect without --use-kl-loss")
    require(
        algo.kl_coef == 0 or algo.kl_loss_coef == 0,
        "--kl-coef",
        "set either --kl-coef (reward shaping) or --kl-loss-coef (loss term), not both",
    )
    require(math.isfinite(algo.entropy_coef), "--entropy-coef", "must be finite")

    # Off-policy corrections.
    require(algo.tis_clip > 0, "--tis-clip", "must be > 0")
    require(0 <= algo.tis_clip_low <= algo.tis_clip, "--tis-clip-low", "must be in [0, --tis-clip]")
    require(
        not (algo.use_tis and algo.use_rollout_logprobs),
        "--use-tis",
        "TIS weighs the trainer's old log-probs against the sampler's; with --use-rollout-logprobs they "
        "are the same and every weight is 1",
    )
    require(
        algo.custom_tis_function_path is None or algo.use_tis,
        "--custom-tis-function-path",
        "has no effect without --use-tis",
    )

    # Custom loss, advantages and pg-loss reducer (the reference framework's hooks).
    require(
        algo.loss_type != "custom_loss" or algo.custom_loss_function_path is not None,
        "--loss-type",
        "custom_loss needs --custom-loss-function-path (the loss function)",
    )
    require(
        algo.custom_loss_function_path is None or algo.loss_type == "custom_loss",
        "--custom-loss-function-path",
        f"has no effect without --loss-type custom_loss (got {algo.loss_type})",
    )
    require(
        not algo.use_unbiased_kl or algo.use_kl_loss,
        "--use-unbiased-kl",
        "weights the KL loss term: it has no effect without --use-kl-loss",
    )
    if algo.disable_compute_advantages_and_returns:
        require(
            algo.loss_type != "policy_loss",
            "--disable-compute-advantages-and-returns",
            "the policy loss needs advantages; use it with --loss-type custom_loss (or sft_loss)",
        )
        require(
            algo.custom_advantage_function_path is None,
            "--custom-advantage-function-path",
            "computes the advantages that --disable-compute-advantages-and-returns turns off",
        )
    if algo.loss_type == "sft_loss":
        for flag, on in (
            ("--custom-advantage-function-path", algo.custom_advantage_function_path is not None),
            ("--custom-pg-loss-reducer-function-path", algo.custom_pg_loss_reducer_function_path is not None),
            ("--disable-rewards-normalization", algo.disable_rewards_normalization),
        ):
            require(not on, flag, "does not apply to --loss-type sft_loss (it computes no advantages)")
    require(
        algo.custom_pg_loss_reducer_function_path is None or algo.loss_type != "custom_loss",
        "--custom-pg-loss-reducer-function-path",
        "reduces the built-in policy loss; a custom loss reduces its own (its sum_of_sample_mean argument)",
    )

    # Supervised fine-tuning ignores rewards, so the RL-only options cannot apply.
    if algo.loss_type == "sft_loss":
        for flag, on in (
            ("--use-tis", algo.use_tis),
            ("--use-kl-loss", algo.use_kl_loss),
            ("--kl-coef", algo.kl_coef != 0),
            ("--use-score-centering", algo.use_score_centering),
            ("--pg-loss-type", algo.pg_loss_type is not None),
            ("--entropy-coef", algo.entropy_coef != 0),
        ):
            require(not on, flag, "does not apply to --loss-type sft_loss")

    # Score centering.
    if algo.use_score_centering:
        from vime.rl.tis import builtin_tis_mode

        require(algo.score_centering_top_k >= 1, "--score-centering-top-k", "must be >= 1")
        require(
            algo.pg_loss_type != "ppo",
            "--pg-loss-type",
            "score centering centres the REINFORCE objective; use --pg-loss-type reinforce (or omit it)",
        )
        require(
            estimator not in ("gspo", "cispo"),
            "--advantage-estimator",
            f"score centering uses a REINFORCE objective and cannot combine with {estimator}; use grpo, "
            "reinforce_plus_plus or reinforce_plus_plus_baseline",
        )
        require(
            not algo.use_tis or builtin_tis_mode(algo.custom_tis_function_path) is not None,
            "--custom-tis-function-path",
            "score centering supports the built-in TIS and icepop_function only: a custom callback cannot "
            "weigh the head and tail scores",
        )

    # PPO's critic.
    require(math.isfinite(algo.value_clip) and algo.value_clip > 0, "--value-clip", "must be > 0")
    require(algo.num_critic_only_steps >= 0, "--num-critic-only-steps", "must be >= 0")
    require(
        algo.num_critic_only_steps == 0 or algo.uses_critic,
        "--num-critic-only-steps",
        f"only --advantage-estimator ppo has a critic (not {estimator})",
    )
    if algo.uses_critic:
        require(
            algo.loss_type == "policy_loss",
            "--loss-type",
            f"--advantage-estimator ppo trains a policy with a critic; {algo.loss_type} has neither",
        )
    if algo.megatron_config_path is not None:
        roles = algo.role_config()  # raises ConfigError naming the YAML field
        if "critic" in roles.roles and not algo.uses_critic:
            from vime.config.roles import FLAG

            raise ConfigError(
                FLAG,
                f"{roles.source}: {roles.roles['critic'].entry}.role: a critic entry needs "
                f"--advantage-estimator ppo (got {estimator})",
            )

    # On-policy distillation.
    require(math.isfinite(algo.opd_kl_coef) and algo.opd_kl_coef >= 0, "--opd-kl-coef", "must be >= 0")
    if not algo.use_opd:
        require(algo.opd_kl_coef == 1.0, "--opd-kl-coef", "has no effect without --use-opd")
        for flag, value in (
            ("--opd-teacher-url", algo.opd_teacher_url),
            ("--opd-teacher-model", algo.opd_teacher_model),
        ):
            require(value is None, flag, "has no effect without --use-opd")
    else:
        require(
            algo.computes_advantages,
            "--use-opd",
            "distillation shapes the RL advantages; it does not apply without them (--loss-type sft_loss, "
            "--disable-compute-advantages-and-returns)",
        )
        require(
            algo.opd_teacher_url is None or algo.opd_teacher_model is None,
            "--opd-teacher-url",
            "give the teacher by URL or by --opd-teacher-model, not both",
        )


def _check_ref_load(algo: AlgorithmConfig, *, megatron: bool) -> None:
    """--ref-load is where the actor starts when --load holds no checkpoint, and the KL reference (the seeds'
    workflow), with or without a KL term: an HF model folder or a Megatron checkpoint directory, on either
    backend (the torch backend reads a Megatron one converted at start-up: vime.backends.ref_load_conversion)."""
    if algo.ref_load is None or "://" in algo.ref_load:
        return
    if os.path.isfile(os.path.join(algo.ref_load, "config.json")):
        return
    from vime.backends.megatron_checkpoint import is_checkpoint_root

    require(
        is_checkpoint_root(algo.ref_load),
        "--ref-load",
        f"{algo.ref_load!r} is neither an HF model folder (config.json) nor a Megatron checkpoint",
    )
    if not megatron:
        from vime.config.training import megatron_core_installed

        require(
            megatron_core_installed(),
            "--ref-load",
            f"{algo.ref_load!r} is a Megatron checkpoint: the torch trainer reads it converted to HF at start-up, "
            "which needs megatron-core (pip install megatron-core==0.16.1); or give an HF model folder",
        )


def check_algorithm_with_run(settings: TrainSettings) -> None:
    """Checks that need the sampling flags or the model (run by ``vime.config.validate``)."""
    algo, rollout = settings.algorithm, settings.rollout
    _check_ref_load(algo, megatron=settings.train.train_backend == "megatron")
    if algo.megatron_config_path is not None:
        from vime.config.roles import check_supported_roles

        check_supported_roles(algo.role_config(), settings.train.train_backend)
    _check_opd_teacher(settings)
    if settings.hooks.custom_convert_samples_to_train_data_path is not None:
        require(
            algo.custom_reward_post_process_path is None,
            "--custom-reward-post-process-path",
            "has no effect with --custom-convert-samples-to-train-data-path, which replaces the whole conversion "
            "(its rewards are used as they are)",
        )
    if algo.use_score_centering:
        # The correction compares trainer and sampler distributions token by token: the sampler must draw
        # from the same (temperature-scaled, untruncated or top-p-replayed) distribution the trainer scores.
        require(
            rollout.rollout_temperature > 0,
            "--rollout-temperature",
            "score centering needs stochastic sampling (temperature > 0)",
        )
        require(
            rollout.rollout_top_k == -1,
            "--rollout-top-k",
            "score centering needs untruncated sampling: use --rollout-top-k -1",
        )
        vocab = _vocab_size(settings.train.hf_checkpoint)
        # The engines are asked for k + 1 log-probs (vLLM spends one on the sampled token), which vLLM
        # refuses beyond the vocabulary.
        require(
            vocab is None or rollout.rollout_top_p < 1 or algo.score_centering_top_k < vocab,
            "--score-centering-top-k",
            f"{algo.score_centering_top_k} must be below the vocabulary size ({vocab} tokens)",
        )


def algorithm_engine_args(settings: TrainSettings) -> dict[str, str | None]:
    """The vLLM flags the training algorithm needs on every engine, checked against the ``--vllm-*`` flags
    given: score centering's log-probs and R3's routed experts. ``vime.config.validate`` adds them before
    the engine topology is resolved, so every engine vime starts (one model or --vllm-config groups)
    inherits them."""
    needed: dict[str, str | None] = {}
    given = settings.vllm.vllm_args
    if settings.algorithm.use_score_centering:
        needed.update(
            score_centering_engine_args(
                given,
                top_k=settings.algorithm.score_centering_top_k,
                top_p=settings.rollout.rollout_top_p,
                vocab=_vocab_size(settings.train.hf_checkpoint),
            )
        )
    if settings.megatron.use_rollout_routing_replay:
        from vime.rollout.routing import routing_replay_engine_args

        needed.update(routing_replay_engine_args(given))
    return needed


def score_centering_engine_args(vllm_args: dict, *, top_k: int, top_p: float, vocab: int | None) -> dict:
    """The vLLM engine flags score centering needs, checked against the ``--vllm-*`` flags given.

    ``logprobs_mode=processed_logprobs``: the log-probs after temperature and top-p, i.e. the
    distribution the sampler drew from (vLLM's default, raw_logprobs, ignores both). ``max_logprobs``:
    the rollout asks for k + 1 log-probs per token, or the whole vocabulary (-1) with top-p < 1.
    """
    mode = vllm_args.get("logprobs-mode")
    require(
        mode in (None, "processed_logprobs"),
        "--vllm-logprobs-mode",
        f"score centering needs the sampler's own log-probs (processed_logprobs), not {mode!r}; drop the flag "
        "or set it to processed_logprobs",
    )
    needed = -1 if top_p < 1 else top_k + 1
    given = vllm_args.get("max-logprobs")
    if given is not None:
        try:
            limit = int(given)
        except ValueError:
            raise ConfigError("--vllm-max-logprobs", f"must be an integer, got {given!r}") from None
        enough = (
            limit == -1 or (needed != -1 and limit >= needed) or (needed == -1 and vocab is not None and limit >= vocab)
        )
        what = (
            "the whole vocabulary (-1) with --rollout-top-p < 1"
            if needed == -1
            else f"--score-centering-top-k + 1 = {needed}"
        )
        require(
            enough,
            "--vllm-max-logprobs",
            f"{limit} is too small for score centering, which requests {what}; "
            "drop the flag (vime sets it) or raise it",
        )
        return {"logprobs-mode": "processed_logprobs"}
    return {"logprobs-mode": "processed_logprobs", "max-logprobs": str(needed)}


def _check_opd_teacher(settings: TrainSettings) -> None:
    """--use-opd needs someone to score the samples: the rollout worker asks the teacher flag's engine,
    or a user hook attaches ``sample.teacher_log_probs`` itself (checked per sample by the trainer)."""
    algo, rollout = settings.algorithm, settings.rollout
    if not algo.use_opd or algo.opd_teacher_url is not None or algo.opd_teacher_model is not None:
        return
    # vime's own distillation reward only forwards to the teacher: it is no teacher itself.
    rm = rollout.custom_rm_path
    user_reward = rm is not None and rm.replace(":", ".") != "vime.rollout.teacher.reward_func"
    hooks = (user_reward, rollout.custom_generate_function_path is not None, rollout.rollout_function_path is not None)
    require(
        any(hooks),
        "--use-opd",
        "needs a teacher to score the samples: give --opd-teacher-url or --opd-teacher-model (or attach "
        "sample.teacher_log_probs in a --custom-rm-path, --custom-generate-function-path or "
        "--rollout-function-path hook)",
    )


def _vocab_size(model_dir: str | None) -> int | None:
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
    except (OSError, TypeError, ValueError):
        return None
    # (a multimodal checkpoint's language model: Qwen3.5's text_config, Qwen3-Omni's thinker_config.text_config)
    text = config.get("text_config") or config.get("thinker_config", {}).get("text_config") or {}
    size = config.get("vocab_size") or text.get("vocab_size")
    return int(size) if size else None
