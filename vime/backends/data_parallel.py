"""Data parallelism for the trainer backends (docs/parallelism.md).

Every rank holds the whole rollout. The no-gradient passes (old log-probs, reference, values) and each
optimizer step's micro-batches are shared out round-robin; the per-micro-batch results are exchanged so
that every rank computes the same advantages, and the gradients are summed before clipping. A micro-batch's
loss is already its share of the step's loss (``reduce_loss`` divides by the whole step's totals), so N
ranks take exactly the steps one rank would, up to the order of floating-point additions.

With one rank (no ``torch.distributed`` group) every method is a no-op and nothing is exchanged.
"""

from __future__ import annotations

import collections

import torch


class DataParallel:
    def __init__(self, group=None):
        """``group``: the data-parallel process group (Megatron's), or None for the default world
        when torch.distributed is initialised, else a single rank."""
        import torch.distributed as dist

        self.group = group
        if dist.is_available() and dist.is_initialized():
            self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        else:
            self.rank, self.size = 0, 1

    def owns(self, index: int) -> bool:
        return index % self.size == self.rank

    def share(self, indices) -> list[int]:
        """This rank's part of ``indices`` (consecutive micro-batches of one step go to different ranks)."""
        return [i for position, i in enumerate(indices) if position % self.size == self.rank]

    def _all_gather(self, value) -> list:
        import torch.distributed as dist

        gathered = [None] * self.size
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered

    def fill(self, values: list) -> list:
        """``values[i]`` is computed where :meth:`owns` (i), None elsewhere: every rank gets all of them."""
        if self.size == 1:
            return values
        mine = {i: value for i, value in enumerate(values) if self.owns(i)}
        for part in self._all_gather(mine):
            for i, value in part.items():
                values[i] = value
        return values

    def sum_terms(self, terms: dict[str, float]) -> dict[str, float]:
        """Loss terms accumulated over this rank's micro-batches, summed over the ranks."""
        if self.size == 1:
            return terms
        total: dict[str, float] = collections.defaultdict(float)
        for part in self._all_gather(dict(terms)):
            for name, value in part.items():
                total[name] += value
        return total

    def merge_metrics(self, metrics: dict[str, list]) -> dict[str, list]:
        """Per-micro-batch metric lists of every rank, joined (their means are the single rank's)."""
        if self.size == 1:
            return metrics
        merged: dict[str, list] = collections.defaultdict(list)
        for part in self._all_gather(dict(metrics)):
            for name, values in part.items():
                merged[name].extend(values)
        return merged

    def sum_gradients(self, params: list[torch.Tensor]) -> None:
        """Add up the gradients of the ranks (all-reduces over flat buffers of at most
        :data:`GRADIENT_BUCKET_ELEMENTS`). A parameter no rank gave a gradient keeps ``grad is None``, as it would
        with one rank (AdamW then leaves it alone)."""
        if self.size == 1 or not params:
            return
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        device = params[0].device
        present = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8, device=device)
        dist.all_reduce(present, op=dist.ReduceOp.MAX, group=self.group)
        live = [p for p, flag in zip(params, present.tolist()) if flag]
        for p in live:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if not live:
            return
        for bucket in gradient_buckets([p.grad for p in live], GRADIENT_BUCKET_ELEMENTS):
            if len(bucket) == 1 and bucket[0].is_contiguous():  # summed in place, no copy
                dist.all_reduce(bucket[0], group=self.group)
                continue
            flat = _flatten_dense_tensors(bucket)
            dist.all_reduce(flat, group=self.group)
            for grad, summed in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                grad.copy_(summed)


# Elements of one gradient all-reduce's flat buffer (64 MiB of float32): what summing the gradients holds beyond
# the gradients themselves. One flat buffer of every gradient doubled their memory for the time of the sum, as much
# as a replica's optimizer state once AdamW's moments exist (from the second step on).
GRADIENT_BUCKET_ELEMENTS = 1 << 24


def gradient_buckets(grads: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """``grads`` in order, cut into runs of one dtype and device of at most ``limit`` elements together (a
    gradient larger than ``limit`` is a run of its own)."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for grad in grads:
        last = buckets[-1][-1] if buckets else None
        if last is None or size + grad.numel() > limit or (grad.dtype, grad.device) != (last.dtype, last.device):
            buckets.append([])
            size = 0
        buckets[-1].append(grad)
        size += grad.numel()
    return buckets
