"""Evaluation on held-out sets: the --eval-* flags."""

from __future__ import annotations

import dataclasses

from vime.config.base import option, require
from vime.config.framework import BUILTIN_ROLLOUT_PATHS


@dataclasses.dataclass(kw_only=True)
class EvalConfig:
    eval_prompt_data: list[str] | None = option(
        None,
        "Held-out sets as NAME PATH pairs, evaluated before training, every --eval-interval rollouts and at the end.",
        nargs="+",
    )
    eval_interval: int | None = option(None, "Evaluate every this many rollouts.")
    n_samples_per_eval_prompt: int = option(1, "Responses per held-out prompt.")
    eval_temperature: float = option(0.0, "Sampling temperature for evaluation (0 = greedy).")
    eval_max_response_len: int | None = option(
        None, "Maximum response tokens in evaluation (default: --rollout-max-response-len)."
    )
    eval_function_path: str | None = option(
        None,
        "Replace the built-in evaluation with generate_rollout(args, rollout_id, data_source, evaluation=True) "
        "-> RolloutFnEvalOutput(data={name: {'rewards': [...]}}), called once per --eval-prompt-data set; "
        "data_source.get_samples(n) hands out that set's prompts.",
    )

    def __post_init__(self) -> None:
        if self.eval_function_path in BUILTIN_ROLLOUT_PATHS:
            self.eval_function_path = None  # the built-in evaluation, by the reference's rollout name

    @property
    def datasets(self) -> list[tuple[str, str]]:
        items = self.eval_prompt_data or []
        return [(items[i], items[i + 1]) for i in range(0, len(items), 2)]

    def validate(self) -> None:
        require(
            not self.eval_prompt_data or len(self.eval_prompt_data) % 2 == 0,
            "--eval-prompt-data",
            "expects NAME PATH pairs",
        )
        require(self.eval_interval is None or self.eval_interval >= 1, "--eval-interval", "must be >= 1")
        require(self.n_samples_per_eval_prompt >= 1, "--n-samples-per-eval-prompt", "must be >= 1")
