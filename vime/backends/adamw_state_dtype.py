"""AdamW whose two moments are stored in a lower precision (``--exp-avg-dtype``, ``--exp-avg-sq-dtype``).

Megatron-LM's precision-aware optimizer (``--use-precision-aware-optimizer``, Transformer Engine's FusedAdam)
may keep AdamW's first and second moments in bf16: 4 bytes per parameter instead of 8, the largest share of a
sharded trainer's memory after the float32 master weights. This is the same update for vime's torch backend,
on any device: each step reads a parameter's moments, computes in float32 exactly as ``torch.optim.AdamW``
does (decoupled weight decay, bias correction, no amsgrad), and rounds the new moments back to their storage
dtype. The parameters it steps (the float32 masters with ``--bf16``, the float32 shards under FSDP2) and their
gradients keep their own dtype. With both dtypes float32 it is torch's AdamW step for step.

What bf16 moments cost: each is rounded to 8 significant bits at every step, so a moment moves only when its
update is larger than that resolution. The second moment's square root and the first moment's direction are
what the update uses, and both tolerate it in practice (Transformer Engine offers it); the tests bound the
difference from float32 moments over a few steps. The update runs on slices of each tensor (CHUNK_ELEMENTS),
so its float32 working copies never hold a whole large tensor. docs/real-models.md, "Optimizer state in bf16".

The state keeps torch's AdamW names (``step``, ``exp_avg``, ``exp_avg_sq``), so checkpoints, FSDP2's DCP
resharding and offload treat it as AdamW's. A checkpoint of float32 moments loads into bf16 ones (rounded) and
the reverse (widened): torch's ``load_state_dict`` casts every state tensor to its parameter's dtype, which this
optimizer undoes for the moments.
"""

from __future__ import annotations

import math

import torch

# Megatron-LM's names for the storage dtypes vime implements (its fp16 and fp8 moments need per-tensor scaling).
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# The update runs on slices of this many elements, so its float32 working copies stay small: over a whole
# 32k x 4096 embedding they would be several hundred MB at the step's peak (elementwise, so slicing changes
# no result).
CHUNK_ELEMENTS = 1 << 20


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of an FSDP2 (DTensor) parameter, gradient or moment; the tensor itself otherwise. The
    update is elementwise and every one of them is sharded alike, so it runs on the local parts in place."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _update(param, grad, stored_exp_avg, stored_exp_avg_sq, step: float, group: dict) -> None:
    """torch's AdamW update of one parameter (or slice) with its stored moments, computed in float32."""
    lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    grad = grad if grad.dtype == param.dtype else grad.to(param.dtype)
    param.mul_(1 - lr * decay)
    # Float32 working copies of stored bf16 moments; float32 ones are updated in place.
    exp_avg = stored_exp_avg.to(param.dtype)
    exp_avg_sq = stored_exp_avg_sq.to(param.dtype)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = math.sqrt(1 - beta2**step)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
    if exp_avg is not stored_exp_avg:
        stored_exp_avg.copy_(exp_avg)
    if exp_avg_sq is not stored_exp_avg_sq:
        stored_exp_avg_sq.copy_(exp_avg_sq)


class AdamWWithStateDtype(torch.optim.Optimizer):
    """torch's AdamW update with ``exp_avg`` and ``exp_avg_sq`` stored as ``exp_avg_dtype`` / ``exp_avg_sq_dtype``."""

    def __init__(
        self,
        params,
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"AdamW: invalid lr={lr}, betas={betas}, eps={eps} or weight_decay={weight_decay}")
        self.moment_dtypes = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype}
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    def init_state(self, param: torch.Tensor) -> dict:
        """A parameter's zero state, in the storage dtypes (also what a checkpoint is loaded into)."""
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            for name, dtype in self.moment_dtypes.items():
                state[name] = torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.init_state(param)
                state["step"] += 1
                tensors = [_local(t) for t in (param, param.grad, state["exp_avg"], state["exp_avg_sq"])]
                if all(t.is_contiguous() for t in tensors):
                    flat = [t.view(-1) for t in tensors]
                    for start in range(0, flat[0].numel(), CHUNK_ELEMENTS):
                        _update(*(t[start : start + CHUNK_ELEMENTS] for t in flat), float(state["step"]), group)
                else:
                    _update(*tensors, float(state["step"]), group)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        # torch casts every loaded state tensor to its parameter's dtype: the moments go back to theirs.
        for state in self.state.values():
            for name, dtype in self.moment_dtypes.items():
                if name in state and state[name].dtype != dtype:
                    state[name] = state[name].to(dtype)
