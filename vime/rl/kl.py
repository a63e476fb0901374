"""Per-token estimators of KL(policy || reference) from the log-probs of the sampled tokens.

With x = log pi(y) - log pi_ref(y) and y drawn from pi (http://joschu.net/blog/kl-approx.html):
k1 = x (unbiased, can be negative), k2 = x^2 / 2 (biased, low variance), k3 = exp(-x) - 1 + x
(unbiased and non-negative). ``low_var_kl`` is k3 clamped to [-10, 10] against overflow.

``importance_ratio`` (--use-unbiased-kl, DeepSeek-V3.2): the estimate of each token is weighted by
pi_theta / pi_old, which makes the KL loss's gradient unbiased for tokens sampled from pi_old; the clamp
of ``low_var_kl`` applies to the weighted value.
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")


def approx_kl(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    kind: str,
    importance_ratio: torch.Tensor | None = None,
) -> torch.Tensor:
    log_ratio = log_probs - ref_log_probs
    if kind == "k1":
        kl = log_ratio
    elif kind == "k2":
        kl = log_ratio**2 / 2
    elif kind in ("k3", "low_var_kl"):
        kl = torch.expm1(-log_ratio) + log_ratio
    else:
        raise ValueError(f"unknown KL estimator {kind!r}; choose one of {', '.join(KL_ESTIMATORS)}")
    if importance_ratio is not None:
        kl = importance_ratio * kl
    return kl.clamp(min=-10, max=10) if kind == "low_var_kl" else kl
