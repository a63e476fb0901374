"""On-policy distillation (``--use-opd``): a teacher's per-token signal on top of any estimator.

The student samples; a frozen teacher scores the sampled tokens (``sample.teacher_log_probs``, collected
on the rollout side by :mod:`vime.rollout.teacher`). Each trained token's advantage is then reduced by
``kl_coef`` x the token's reverse-KL estimate log p_student(y_t) - log p_teacher(y_t), where the student's
log-prob is the old policy's (the one that generated the batch, as the trainer recomputes it). With a
zero task advantage the policy-gradient objective is exactly the sampled reverse KL's gradient
(Agarwal et al., arXiv:2306.13649; Thinking Machines, "On-Policy Distillation", 2025). The penalty is
applied before --normalize-advantages whitens the result.
"""

from __future__ import annotations

import torch


def opd_reverse_kl(
    student_log_probs: list[torch.Tensor], teacher_log_probs: list[torch.Tensor], loss_masks: list[torch.Tensor]
) -> list[torch.Tensor]:
    """log p_student - log p_teacher per response token (0 where the loss mask is 0)."""
    out = []
    for student, teacher, mask in zip(student_log_probs, teacher_log_probs, loss_masks, strict=True):
        if student.shape != teacher.shape or student.shape != mask.shape:
            raise ValueError(
                f"OPD shape mismatch: student {tuple(student.shape)}, teacher {tuple(teacher.shape)}, "
                f"loss mask {tuple(mask.shape)}"
            )
        out.append((student - teacher.to(student.dtype)) * mask.to(student.dtype))
    return out


def opd_advantages(
    advantages: list[torch.Tensor],
    student_log_probs: list[torch.Tensor],
    teacher_log_probs: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    *,
    kl_coef: float,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A_t - kl_coef x (log p_student - log p_teacher) on trained tokens. Returns (advantages, reverse KL)."""
    reverse_kl = opd_reverse_kl(student_log_probs, teacher_log_probs, loss_masks)
    if len(advantages) != len(reverse_kl):
        raise ValueError(f"OPD: {len(advantages)} advantage rows for {len(reverse_kl)} samples")
    for a, r in zip(advantages, reverse_kl):
        if a.shape != r.shape:
            raise ValueError(f"OPD shape mismatch: advantages {tuple(a.shape)}, reverse KL {tuple(r.shape)}")
    shaped = [a - kl_coef * r.to(a.dtype) for a, r in zip(advantages, reverse_kl)]
    return shaped, reverse_kl
