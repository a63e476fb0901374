"""The RL algorithm's flags: advantages, policy loss, KL and off-policy corrections (docs/algorithms.md).

Its cross-flag checks live in vime/rl/algorithm_checks.py, beside the objective that reads them.
"""

from __future__ import annotations

import dataclasses

from vime.config.base import option

ADVANTAGE_ESTIMATORS = ["grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"]


@dataclasses.dataclass(kw_only=True)
class AlgorithmConfig:
    """The RL objective: advantages, policy loss, KL and off-policy corrections (docs/algorithms.md)."""

    advantage_estimator: str = option(
        "grpo",
        "RL algorithm computing advantages: " + ", ".join(ADVANTAGE_ESTIMATORS) + ". 'ppo' trains a "
        "critic (value model) on the training worker beside the actor and uses GAE.",
    )
    loss_type: str = option(
        "policy_loss",
        "policy_loss: the RL objective; sft_loss: negative log-likelihood of the loss-masked "
        "response tokens (rewards are ignored); custom_loss: the function of --custom-loss-function-path.",
        choices=["policy_loss", "sft_loss", "custom_loss"],
    )
    loss_mask_type: str | None = option(
        None,
        "The reference's choice of the chat-template family whose markers locate an SFT conversation's "
        "assistant turns (qwen, qwen3, qwen3_5, distill_qwen, gemma4). vime locates them from the tokenizer's own chat "
        "template for any family (vime.data.prompt.sft_tokens: growing prefixes rendered), so every choice gives "
        "the same loss mask; a conversation the template cannot render prefix by prefix is refused naming it.",
        choices=["qwen", "qwen3", "qwen3_5", "distill_qwen", "gemma4"],
    )
    custom_loss_function_path: str | None = option(
        None,
        "With --loss-type custom_loss: the loss, called per micro-batch as loss_fn(args, batch, logits, "
        "sum_of_sample_mean) -> (loss, metrics) on both backends; vime keeps no logits, so logits is the training "
        "forward (its log_probs and entropy) and batch['cur_log_probs'] the current log-probs (docs/algorithms.md).",
    )
    custom_advantage_function_path: str | None = option(
        None,
        "Replace the built-in advantages and returns: custom_fn(args, rollout_data) -> None, which sets "
        "rollout_data['advantages'] and rollout_data['returns'] (one tensor per sample) in place; the critic's "
        "values are in rollout_data['values'], the per-token KL in rollout_data['kl'].",
    )
    custom_pg_loss_reducer_function_path: str | None = option(
        None,
        "A reducer for pg_loss only: get_reducer(total_lengths, response_lengths, loss_masks, "
        "calculate_per_token_loss) -> reducer(pg_loss) -> scalar; the other terms and metrics (pg_clipfrac, "
        "ppo_kl, entropy_loss, kl_loss) keep the default sum_of_sample_mean.",
    )
    disable_compute_advantages_and_returns: bool = option(
        False,
        "Compute no advantages and returns (for sft_loss, or a custom loss that needs none: its batch then "
        "has no 'advantages' or 'returns').",
    )
    disable_rewards_normalization: bool = option(
        False,
        "grpo, gspo, cispo and reinforce_plus_plus_baseline: take the rewards as they are, without "
        "subtracting the group mean (nor dividing by the group std).",
    )
    pg_loss_type: str | None = option(
        None,
        "Policy-gradient objective: 'ppo' (clipped ratio) or 'reinforce' (-A log p). Default: 'reinforce' "
        "with --use-score-centering, else 'ppo' (CISPO and GSPO bring their own objective).",
        choices=["ppo", "reinforce"],
    )
    normalize_advantages: bool = option(False, "Whiten advantages over the loss-masked tokens of the whole rollout.")
    disable_grpo_std_normalization: bool = option(
        False, "GRPO/GSPO/CISPO: subtract the group mean only, without dividing by the group std (Dr. GRPO)."
    )
    custom_reward_post_process_path: str | None = option(
        None,
        "Replace the group normalisation of the rewards: post_process(args, samples) -> (raw_rewards, rewards), "
        "called by the trainer on each step's samples (group by group, --n-samples-per-prompt each); its rewards "
        "are the advantages of grpo/gspo/cispo as they are (no group mean or std taken), the group baseline of "
        "reinforce_plus_plus_baseline, and the rewards of reinforce_plus_plus and ppo. args: the algorithm's "
        "flags, n_samples_per_prompt, rollout_temperature, hf_checkpoint.",
    )
    gamma: float = option(1.0, "Discount factor of REINFORCE++ returns and PPO's GAE.")
    lambd: float = option(1.0, "GAE lambda (PPO).")
    eps_clip: float = option(0.2, "Lower clip range of the importance ratio: ratios below 1 - eps are clipped.")
    eps_clip_high: float | None = option(
        None, "Upper clip range: ratios above 1 + eps_high are clipped (default: --eps-clip)."
    )
    eps_clip_c: float | None = option(
        None, "Dual-clip PPO: for negative advantages the loss is bounded by -c A (c > 1; arXiv:1912.09729)."
    )
    kl_coef: float = option(
        0.0,
        "KL penalty coefficient for reward shaping: -kl_coef x KL(policy || reference) is folded into the "
        "token rewards before advantages (reinforce_plus_plus, reinforce_plus_plus_baseline, ppo).",
    )
    use_kl_loss: bool = option(False, "Add a KL(policy || reference) term to the loss (GRPO style).")
    kl_loss_coef: float = option(0.0, "Weight of the KL loss term (needs --use-kl-loss).")
    use_unbiased_kl: bool = option(
        False,
        "Unbiased KL loss (DeepSeek-V3.2): weight each token's KL-loss estimate by the importance ratio "
        "pi_theta / pi_old (needs --use-kl-loss).",
    )
    kl_loss_type: str = option(
        "k1",
        "KL estimator of the KL loss and of the reward shaping: k1 (log-ratio), k2 (half squared "
        "log-ratio), k3 (exp(-x) - 1 + x), low_var_kl (k3 clamped to [-10, 10]).",
        choices=["k1", "k2", "k3", "low_var_kl"],
    )
    ref_load: str | None = option(
        None,
        "Where the actor starts when --load holds no checkpoint, and the frozen reference model of the KL "
        "terms: an HF model folder or a Megatron checkpoint directory (the torch trainer reads one converted to "
        "HF at start-up, in <run dir>/ref_load_hf/). The engines then get its weights as version 0 before "
        "anything is generated. Default: --hf-checkpoint.",
    )
    entropy_coef: float = option(0.0, "Entropy bonus: the loss is reduced by this times the mean token entropy.")
    calculate_per_token_loss: bool = option(
        False,
        "Loss over tokens: sum(sum(sample_i)) / sum(len(sample_i)) instead of the default per-sample "
        "mean(sum(sample_i) / len(sample_i)).",
    )
    use_rollout_logprobs: bool = option(
        False, "Use the sampler's log-probs as the old policy instead of recomputing them with the trainer."
    )
    use_tis: bool = option(
        False,
        "Truncated importance sampling: weight each token's loss by clip(pi_old_trainer / pi_sampler, "
        "--tis-clip-low, --tis-clip) to correct the training-inference mismatch.",
    )
    tis_clip: float = option(2.0, "Upper bound of the TIS weight.")
    tis_clip_low: float = option(0.0, "Lower bound of the TIS weight.")
    custom_tis_function_path: str | None = option(
        None,
        "Replace the TIS weighting: f(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, "
        "total_lengths, response_lengths) -> (pg_loss, loss_masks, metrics). Built-in: "
        "vime.rl.tis.icepop_function (keep ratios inside the bounds, zero the others).",
    )
    mask_offpolicy_in_partial_rollout: bool = option(
        False,
        "Train only on tokens generated by the policy version being trained: response tokens of older "
        "weight versions get loss mask 0.",
    )
    use_score_centering: bool = option(
        False,
        "Score centering (arXiv:2609.20807): subtract the sampler-expected score from the REINFORCE "
        "gradient, computed from the sampler's recorded top-k heads (--rollout-top-p 1) or complete top-p "
        "supports (top-p < 1; the trainer then normalises its log-probs on them). vime's engines get "
        "--logprobs-mode processed_logprobs and a --max-logprobs that covers the request.",
    )
    score_centering_top_k: int = option(
        128,
        "Sampler top-k token ids and log-probs kept per response token for score centering (rollout "
        "top-p 1 only; k + 1 are requested from vLLM); must be below the vocabulary size.",
    )
    value_clip: float = option(
        0.2, "PPO: clip range of the value loss: max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)."
    )
    num_critic_only_steps: int = option(
        0, "PPO: the first N rollouts train only the critic; the actor's weights stay as they are."
    )
    megatron_config_path: str | None = option(
        None,
        "YAML of per-role overrides of the training arguments (PPO actor / critic): "
        "megatron: [{name, role, overrides: {lr, load, save, ...}}]. A role absent from the file keeps the "
        "command line. Both backends honour lr, weight_decay, adam_beta1/2, adam_eps, clip_grad, min_lr, "
        "lr_warmup_iters and lr_decay_style for both roles, and load / save (the critic's checkpoints) for the "
        "critic; other keys are refused at start-up.",
    )
    use_opd: bool = option(
        False,
        "On-policy distillation on top of any estimator: each trained token's advantage is reduced by "
        "--opd-kl-coef x (log p_old - log p_teacher), with the teacher's log-probs recorded on the sample "
        "(teacher_log_probs, see vime.rollout.teacher).",
    )
    opd_kl_coef: float = option(1.0, "Weight of the on-policy distillation penalty (needs --use-opd).")
    opd_teacher_url: str | None = option(
        None,
        "OPD teacher: base URL of a vLLM engine or router serving the teacher (its /inference/v1/generate "
        "scores the sampled sequences). vime-specific.",
    )
    opd_teacher_model: str | None = option(
        None,
        "OPD teacher: the name of a --vllm-config model (e.g. a frozen one with update_weights: false) "
        "that serves the teacher. vime-specific.",
    )

    @property
    def policy_loss(self) -> str:
        """The objective actually optimised: 'ppo', 'reinforce', 'gspo', 'cispo', 'sft' or 'custom'."""
        if self.loss_type == "sft_loss":
            return "sft"
        if self.loss_type == "custom_loss":
            return "custom"
        if self.advantage_estimator in ("gspo", "cispo"):
            return self.advantage_estimator
        if self.pg_loss_type is not None:
            return self.pg_loss_type
        return "reinforce" if self.use_score_centering else "ppo"

    @property
    def needs_reference_model(self) -> bool:
        return self.loss_type != "sft_loss" and (self.use_kl_loss or self.kl_coef != 0)

    @property
    def computes_advantages(self) -> bool:
        """Whether the trainer computes advantages (and PPO's returns) before the loss."""
        return self.loss_type != "sft_loss" and not self.disable_compute_advantages_and_returns

    @property
    def uses_critic(self) -> bool:
        """PPO trains a critic (value model) beside the actor."""
        return self.advantage_estimator == "ppo"

    def role_config(self):
        """The parsed --megatron-config-path (vime.config.roles.RoleConfig; empty without the flag)."""
        from vime.config.roles import load_role_config

        return load_role_config(self.megatron_config_path)

    def validate(self) -> None:
        from vime.rl.algorithm_checks import check_algorithm_flags

        check_algorithm_flags(self)
