"""Per-token estimators of KL(policy || reference) from the log-probs of the sampled tokens.

With x = log pi(y) - log pi_ref(y) and y drawn from pi (http://joschu.net/blog/kl-approx.html):
k1 = x (unbiased, can be negative), k2 = x^2 / 2 (biased, low variance), k3 = exp(-x) - 1 + x
(unbiased and non-negative). ``low_var_kl`` is k3 clamped to [-10, 10] against overflow.
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")


def approx_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str) -> torch.Tensor:
    log_ratio = log_probs - ref_log_probs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return log_ratio**2 / 2
    if kind in ("k3", "low_var_kl"):
        kl = torch.expm1(-log_ratio) + log_ratio
        return kl.clamp(min=-10, max=10) if kind == "low_var_kl" else kl
    raise ValueError(f"unknown KL estimator {kind!r}; choose one of {', '.join(KL_ESTIMATORS)}")
