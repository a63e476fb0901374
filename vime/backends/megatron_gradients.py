"""How the Megatron backend's gradients are reduced beyond data parallelism: which parameters the
expert-parallel groups and the tensor-parallel group reduce on their own, and the norm of the whole model's
gradient for clipping (every parameter counted once over the tensor, expert and pipeline ranks).
"""

from __future__ import annotations

import torch


def param_ids(models, keep) -> set[int]:
    """ids of the parameters of ``models`` ((role, GPTModel or None) pairs: the actor and the critic) for which
    ``keep(name, param)`` holds, and with --bf16 of the float32 tensors the gradient reductions receive in their
    place (``ModelRole.gradient_holders``: the masters, or the sharded optimizer's gradient stand-ins)."""
    ids = set()
    for role, gpt in models:
        if gpt is None:
            continue
        master_of = role.gradient_holders()
        for name, p in gpt.named_parameters():
            if keep(name, p):
                ids.add(id(p))
                if id(p) in master_of:
                    ids.add(id(master_of[id(p)]))
    return ids


def routed_expert_param_ids(models) -> set[int]:
    """ids of the routed experts' parameters."""
    from vime.backends.megatron_weights import is_expert_param

    return param_ids(models, lambda name, _: is_expert_param(name))


def tensor_parallel_partial_param_ids(models) -> set[int]:
    """ids of the replicated parameters whose gradient each tensor-parallel rank computes only in part, to be
    summed over the TP group: the norms sequence parallelism feeds a slice of the sequence, and the query and
    key norms (--qk-layernorm), shared by every head while each rank holds some of the heads."""
    return param_ids(
        models,
        lambda name, p: getattr(p, "sequence_parallel", False) or ".q_layernorm." in name or ".k_layernorm." in name,
    )


def global_norm(params: list[torch.Tensor], expert_param_ids: set[int], pipeline) -> torch.Tensor:
    """The norm of the whole model's gradient: every parameter counted once (not a tensor-parallel
    duplicate, nor the last stage's copy of a tied embedding), every expert-parallel rank's experts and
    every pipeline stage's layers (``pipeline``: this rank's stage, None without pipeline parallelism)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    experts = expert_param_ids
    dense = torch.zeros((), dtype=torch.float32, device=params[0].device)
    spread = torch.zeros((), dtype=torch.float32, device=params[0].device)
    for p in params:
        if id(p) in experts:  # this rank's experts, or its shards of them: counted by the expert groups
            spread += p.grad.float().pow(2).sum()
        elif param_is_not_tensor_parallel_duplicate(p) and not getattr(p, "shared", False):
            dense += p.grad.float().pow(2).sum()
    dist.all_reduce(dense, group=ps.get_model_parallel_group())  # tensor x pipeline ranks
    if ps.get_expert_tensor_and_model_parallel_world_size() > 1:
        dist.all_reduce(spread, group=ps.get_expert_tensor_and_model_parallel_group())
    if pipeline is not None:
        dist.all_reduce(spread, group=pipeline.group)
    return (dense + spread).sqrt()
