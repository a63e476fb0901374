"""Context parallelism for the Megatron backend (``--context-parallel-size``).

The ranks of a context-parallel group hold the same weights and train the same micro-batches; each runs the
model over a part of every sequence. As megatron-core lays it out (its rotary embeddings slice their
positions this way), the padded sequence is cut into 2 x CP chunks and rank r holds chunks r and
2 x CP - 1 - r, so that every rank gets an equal share of causal attention's work. What crosses the ranks:

- **attention**: every attention layer gathers the keys and values of the whole sequence
  (:class:`ContextParallelAttention`); in the backward, each rank's share of their gradient goes back to the
  rank that computed them.
- **results**: the last stage's outputs (logits or values) of every rank are gathered into whole sequences,
  so every rank computes the same loss, advantages and metrics; the backward keeps the gradient of this
  rank's own positions.
- **gradients**: each rank's weights received the gradient through its own positions; the backend sums them
  over the context-parallel ranks together with the data-parallel replicas.

**Decision**: keys and values are all-gathered (megatron-core's ``all_gather`` communication type), not passed
round a ring (``p2p``): one collective per layer, and attention runs as megatron-core's own
``DotProductAttention`` over the gathered keys, on any device. It needs padded micro-batches (not thd
packing, whose context-parallel attention is Transformer Engine's). See docs/parallelism.md.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist


class ContextSplit:
    """This rank's positions of a sequence and the transfers of its context-parallel group."""

    def __init__(self, group, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size

    @classmethod
    def from_megatron(cls) -> ContextSplit | None:
        """The context-parallel group megatron-core set up (None without context parallelism)."""
        from megatron.core import parallel_state as ps

        size = ps.get_context_parallel_world_size()
        if size == 1:
            return None
        return cls(ps.get_context_parallel_group(), ps.get_context_parallel_rank(), size)

    @property
    def multiple(self) -> int:
        """Sequences are padded to a multiple of this (2 x CP chunks)."""
        return 2 * self.size

    def positions(self, length: int, rank: int | None = None, device=None) -> torch.Tensor:
        """The positions ``rank`` (default: this one) holds of a sequence of ``length`` (a multiple of
        :attr:`multiple`): chunks ``rank`` and ``2 x CP - 1 - rank``."""
        rank = self.rank if rank is None else rank
        chunk = length // self.multiple
        if chunk * self.multiple != length:
            raise ValueError(f"a sequence of {length} positions does not split into {self.multiple} chunks")
        first, second = rank * chunk, (self.multiple - 1 - rank) * chunk
        return torch.cat(
            [torch.arange(first, first + chunk, device=device), torch.arange(second, second + chunk, device=device)]
        )

    def gathered_positions(self, length: int, device=None) -> torch.Tensor:
        """The positions of a gathered sequence, in the order :meth:`gather` puts them (rank by rank)."""
        return torch.cat([self.positions(length, rank, device) for rank in range(self.size)])

    def gather(self, tensor: torch.Tensor, dim: int, *, sum_gradients: bool) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along ``dim`` in rank order (under autograd). The backward
        returns this rank's slice of the gradient, summed over the ranks first when ``sum_gradients``
        (each rank's own computation used the whole gathered tensor), not when every rank computed the same
        function of it."""
        return _Gather.apply(tensor, dim, self, sum_gradients)

    def gather_sequence(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """The whole sequences, in position order, of the per-rank ``tensor`` (sequence along ``dim``), for a
        computation every rank repeats alike (the loss)."""
        gathered = self.gather(tensor, dim, sum_gradients=False)
        order = torch.argsort(self.gathered_positions(gathered.shape[dim], device=gathered.device))
        return gathered.index_select(dim, order)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, dim: int, split: ContextSplit, sum_gradients: bool):
        parts = [torch.empty_like(tensor) for _ in range(split.size)]
        dist.all_gather(parts, tensor.contiguous(), group=split.group)
        ctx.dim, ctx.split, ctx.sum_gradients, ctx.length = dim, split, sum_gradients, tensor.shape[dim]
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.sum_gradients:
            # gloo has no reduce-scatter: sum the whole gradient, keep this rank's slice.
            grad = grad.contiguous().clone()
            dist.all_reduce(grad, group=ctx.split.group)
        return grad.narrow(ctx.dim, ctx.split.rank * ctx.length, ctx.length), None, None, None


def _dot_product_attention():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return DotProductAttention


class ContextParallelAttention(_dot_product_attention()):
    """megatron-core's ``DotProductAttention`` over the keys and values of every context-parallel rank: this
    rank's queries [s / CP, b, heads, dim] attend to the gathered keys [s, b, groups, dim] under the mask the
    caller built for them (``MegatronLM``: causal by global position, padded keys masked)."""

    def __init__(self, config, *args, **kwargs):
        # DotProductAttention refuses a context-parallel config; this class is what makes it one.
        local = copy.copy(config)
        local.context_parallel_size = 1
        super().__init__(local, *args, **kwargs)
        self.context = ContextSplit.from_megatron()

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if packed_seq_params is not None:
            raise ValueError(
                "--context-parallel-size: packed (thd) sequences are not supported; use --megatron-packing padded"
            )
        key = self.context.gather(key, 0, sum_gradients=True)
        value = self.context.gather(value, 0, sum_gradients=True)
        return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)


def with_context_parallel_attention(spec):
    """A copy of a GPT layer spec (one layer's, or a decoder block's) whose attention is
    :class:`ContextParallelAttention`."""
    spec = copy.deepcopy(spec)
    layers = spec.layer_specs if hasattr(spec, "layer_specs") else [spec]
    for layer in layers:
        layer.submodules.self_attention.submodules.core_attention = ContextParallelAttention
    return spec
