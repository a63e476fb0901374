"""Moving weights in and out of a megatron-core GPTModel (built by ``megatron_model``).

:func:`load_canonical` / :func:`gather_canonical` copy the canonical (full, TP=1) state dict of
``megatron_convert`` into a tensor-, expert- or pipeline-parallel model and back: each rank holds its shard
of every split tensor, its experts and its pipeline stage's layers, numbered globally in canonical names.
"""

from __future__ import annotations

import re

import torch

from vime.backends.megatron_args import ModelArgs
from vime.backends.megatron_convert import from_te_names
from vime.backends.megatron_model import device, tp_split

VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _ep():
    from megatron.core import parallel_state as ps

    return (
        ps.get_expert_model_parallel_rank(),
        ps.get_expert_model_parallel_world_size(),
        ps.get_expert_model_parallel_group(),
    )


def _etp():
    from megatron.core import parallel_state as ps

    return (
        ps.get_expert_tensor_parallel_rank(),
        ps.get_expert_tensor_parallel_world_size(),
        ps.get_expert_tensor_parallel_group(),
    )


def _tensor_split(canonical_name: str):
    """(rank, size, group) of the tensor parallelism that splits a tensor: a routed expert's is the
    expert tensor parallelism, every other tensor's the model's."""
    return _etp() if is_expert_param(canonical_name) else tp_split()


_LOCAL_EXPERT = re.compile(r"(\.mlp\.experts\.local_experts\.)(\d+)(\.)")


def is_expert_param(name: str) -> bool:
    """A routed expert's tensor (held by one expert-parallel rank; a shared expert is not one)."""
    return ".mlp.experts." in name


def _expert_name(name: str, index: int) -> str:
    return _LOCAL_EXPERT.sub(lambda m: f"{m.group(1)}{index}{m.group(3)}", name)


def _local_expert_index(name: str) -> int | None:
    match = _LOCAL_EXPERT.search(name)
    return None if match is None else int(match.group(2))


def _is_fc1(name: str) -> bool:
    """The fused [gate; up] projection of an MLP: dense, routed expert or shared expert."""
    return name.endswith(("linear_fc1.weight", "linear_fc1.bias"))


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def _is_tied_copy(param) -> bool:
    """The last pipeline stage's copy of a tied input embedding (megatron-core marks it ``shared``)."""
    return getattr(param, "shared", False)


def _model_tensors(model):
    """(name, tensor) of what the canonical state dict holds: every parameter, then the MoE routers' expert
    biases (buffers: the optimizer never steps them; vime.backends.megatron_expert_bias updates them)."""
    yield from model.named_parameters()
    yield from ((n, b) for n, b in model.named_buffers() if n.endswith(".router.expert_bias"))


def _canonical_names(model) -> dict[str, str]:
    """Model parameter name -> canonical (local-spec) name, layers and experts numbered globally: a
    pipeline stage's layer i is layer ``first layer of the stage + i``, and under expert parallelism rank
    r's local expert i is expert ``r * local experts + i``. A last stage's copy of a tied embedding is the
    embedding."""
    from vime.backends.megatron_pipeline import stage_layers

    names = [n for n, _ in _model_tensors(model)]
    canonical = dict(zip(names, from_te_names(dict.fromkeys(names)).keys()))
    offset = stage_layers(model).start
    if offset:
        canonical = {
            n: _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", c) for n, c in canonical.items()
        }
    for name, param in _model_tensors(model):
        if _is_tied_copy(param):
            canonical[name] = VOCAB_PARAMS[0]
    ep_rank, ep_size, _ = _ep()
    if ep_size == 1:
        return canonical
    local = _local_experts(canonical.values())
    return {
        n: _expert_name(c, ep_rank * local + i) if (i := _local_expert_index(c)) is not None else c
        for n, c in canonical.items()
    }


def local_expert_count(model) -> int:
    """Routed experts per MoE layer held by this rank (0 for a dense model)."""
    names = [n for n, _ in model.named_parameters()]
    return _local_experts(from_te_names(dict.fromkeys(names)).keys())


def _local_experts(canonical_names) -> int:
    """Experts per MoE layer on this rank."""
    return 1 + max((i for c in canonical_names if (i := _local_expert_index(c)) is not None), default=-1)


def load_canonical(model, canonical: dict[str, torch.Tensor], args: ModelArgs) -> None:
    """Copy a canonical state dict into ``model`` (this rank's tensor-parallel shard of every tensor;
    the vocabulary padded with zero rows). Every parameter must be found and every tensor used."""
    names = _canonical_names(model)
    missing = [c for c in names.values() if c not in canonical]
    unused = set(canonical) - set(names.values())
    if _ep()[1] > 1:  # the other expert-parallel ranks' experts
        unused = {c for c in unused if _local_expert_index(c) is None}
    unused = {c for c in unused if _held_by_this_stage(c, model)}
    unused = sorted(unused)
    if missing or unused:
        raise ValueError(f"state dict does not fit the model: missing {missing[:6]}, unused {unused[:6]}")
    with torch.no_grad():
        for name, param in _model_tensors(model):
            full = canonical[names[name]].to(torch.float32)
            rank, size, _ = _tensor_split(names[name])
            if names[name] in VOCAB_PARAMS:
                padded = param.shape[0] * (size if getattr(param, "tensor_model_parallel", False) else 1)
                full = torch.cat([full, full.new_zeros(padded - full.shape[0], *full.shape[1:])])
            if size > 1 and getattr(param, "tensor_model_parallel", False):
                dim = param.partition_dim
                if _is_fc1(names[name]) and args.swiglu:
                    gate, up = full.chunk(2, dim=0)
                    full = torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]])
                else:
                    full = full.chunk(size, dim=dim)[rank]
            if full.shape != param.shape:
                raise ValueError(
                    f"{names[name]}: shape {tuple(full.shape)} does not fit the model's {tuple(param.shape)}"
                )
            param.copy_(full.to(param.device))


def _held_by_this_stage(canonical_name: str, model) -> bool:
    """Whether a canonical tensor belongs to this pipeline stage's slice of the model."""
    layer = _LAYER.match(canonical_name)
    if layer is not None:
        from vime.backends.megatron_pipeline import stage_layers

        return int(layer.group(1)) in stage_layers(model)
    if canonical_name.startswith("embedding."):
        return model.pre_process
    return model.post_process  # the final norm and the output layer


def gather_canonical(model, args: ModelArgs, *, to_cpu: bool = True) -> dict[str, torch.Tensor]:
    """The canonical (full, unpadded) state dict of a tensor-, expert- or pipeline-parallel ``model``; every
    rank of those groups must call it (it gathers)."""
    import torch.distributed as dist

    names = _canonical_names(model)
    out = {}
    with torch.no_grad():
        for name, param in _model_tensors(model):
            if _is_tied_copy(param):
                continue  # the first stage holds the embedding
            tensor = param.detach()
            _, size, group = _tensor_split(names[name])
            if size > 1 and getattr(param, "tensor_model_parallel", False):
                parts = [torch.empty_like(tensor) for _ in range(size)]
                dist.all_gather(parts, tensor.contiguous(), group=group)
                if _is_fc1(names[name]) and args.swiglu:
                    halves = [p.chunk(2, dim=0) for p in parts]
                    tensor = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
                else:
                    tensor = torch.cat(parts, dim=param.partition_dim)
            if names[name] in VOCAB_PARAMS:
                tensor = tensor[: args.vocab_size]
            out[names[name]] = tensor.cpu() if to_cpu else tensor
    ep_rank, ep_size, ep_group = _ep()
    if ep_size > 1:
        out = _gather_experts(out, local_expert_count(model), ep_size, ep_group, to_cpu=to_cpu)
    return _gather_stages(out, to_cpu=to_cpu)


def _gather_stages(local: dict[str, torch.Tensor], *, to_cpu: bool) -> dict[str, torch.Tensor]:
    """Every pipeline stage's tensors, in layer order (every rank of the pipeline group calls it)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    size = ps.get_pipeline_model_parallel_world_size()
    if size == 1:
        return local
    stages = [None] * size
    dist.all_gather_object(
        stages, {name: tensor.cpu() for name, tensor in local.items()}, group=ps.get_pipeline_model_parallel_group()
    )
    here = device()
    return {name: tensor if to_cpu else tensor.to(here) for stage in stages for name, tensor in stage.items()}


def _gather_experts(
    local: dict[str, torch.Tensor], experts: int, ep_size: int, group, *, to_cpu: bool
) -> dict[str, torch.Tensor]:
    """Every expert-parallel rank's experts (``experts`` each, numbered globally in ``local``'s names), under
    their global names (every rank of the group calls it)."""
    import torch.distributed as dist

    out = {}
    for name, tensor in local.items():
        index = _local_expert_index(name)
        if index is None:
            out[name] = tensor
            continue
        parts = [torch.empty_like(tensor) for _ in range(ep_size)]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        local_index = index % experts
        for rank, part in enumerate(parts):
            out[_expert_name(name, rank * experts + local_index)] = part.cpu() if to_cpu else part
    return out
