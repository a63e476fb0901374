"""Running a megatron-core GPTModel behind the interface the shared training code calls.

:class:`MegatronLM` wraps the model in ``model(input_ids=..., attention_mask=...).logits``, batching either
packed (thd) or right-padded, with R3's forced routes, pipeline stages and context parallelism; or, for
--log-probs-chunk-size, in ``.hidden``: the final hidden states the output layer would read, whose logits
vime.backends.chunked_logits computes a chunk at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch

from vime.backends.megatron_args import ModelArgs
from vime.backends.megatron_model import device, tp_split


@dataclasses.dataclass
class CausalLMOutput:
    logits: torch.Tensor | None
    # A pipeline stage before the last: the hidden states it passes on. The last stage asked for
    # ``final_hidden``: the output layer's input [B, T, d], rows as the logits', every position on every rank.
    hidden: torch.Tensor | None = None


class _GradientSummed(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over ``group``. (megatron-core's
    copy_to_tensor_model_parallel_region all-reduces ``grad.contiguous()`` and returns ``grad``: a gradient that
    arrives non-contiguous, as the transposed hidden states' does, is returned unsummed.)"""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group):
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist

        grad = grad.clone(memory_format=torch.contiguous_format)  # autograd's own buffer is not ours to change
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _GradientScaled(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, scale: float):
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


@contextlib.contextmanager
def _output_layer_skipped(gpt):
    """megatron-core's GPTModel returns its decoder's output (the final norm applied, [S, B, d], the sequence
    split over the tensor-parallel ranks under sequence parallelism) where ``post_process`` is False, as a
    pipeline stage before the last does; set for one forward, the last stage's output layer does not run."""
    gpt.post_process = False
    try:
        yield
    finally:
        gpt.post_process = True


class MegatronLM(torch.nn.Module):
    """``model(input_ids=[B, T], attention_mask=[B, T]).logits`` -> [B, T, vocab] over right-padded rows.

    ``packing='thd'`` concatenates the rows' real tokens into one varlen sequence (Transformer Engine
    attention, no padding computed); ``'padded'`` runs the padded batch with an explicit causal mask.
    Logits of padded positions are zero in thd mode (never used: the loss masks them). Logits of the
    padded vocabulary rows are dropped.

    ``routes`` (MoE, R3): per row, the recorded experts [positions, MoE layers, topk] of its first
    positions (``megatron_routing.sample_routes``); the forward routes those positions to them.
    Without ``routes`` the routers choose freely.

    Under pipeline parallelism (``pipeline``) a stage after the first takes its input from the previous
    stage, and a stage before the last returns its hidden states (``CausalLMOutput.hidden``) instead of logits.

    Under context parallelism (``context``, a ``megatron_context.ContextSplit``) the model runs over this
    rank's positions of each padded row, and the last stage gathers every rank's logits into whole rows.

    ``final_hidden=True`` returns, on the last stage, the output layer's input instead of its logits
    (``CausalLMOutput.hidden``), to be read with :meth:`output_weight` and :meth:`vocabulary`.
    """

    def __init__(
        self,
        gpt,
        vocab_size: int,
        packing: str = "padded",
        sequence_parallel: bool = False,
        model_args: ModelArgs | None = None,
        pipeline=None,
        context=None,
        pad_size_multiplier: int = 1,
    ):
        super().__init__()
        self.gpt = gpt
        self.vocab_size = vocab_size
        self.packing = packing
        self.sequence_parallel = sequence_parallel
        self.model_args = model_args
        self.pipeline = pipeline
        self.context = context  # padded rows only: ContextParallelAttention refuses packed sequences
        self.pad_size_multiplier = pad_size_multiplier  # --data-pad-size-multiplier (x the TP size)
        self._stage_moe_layers = self._moe_layers_of_stage()

    def _moe_layers_of_stage(self) -> list[int] | None:
        """Positions, among the model's MoE layers, of those this pipeline stage holds (None: all)."""
        if self.pipeline is None or self.model_args is None or not self.model_args.is_moe:
            return None
        from vime.backends.megatron_pipeline import stage_layers

        held = stage_layers(self.gpt)
        return [i for i, layer in enumerate(self.model_args.moe_layers) if layer in held]

    @property
    def _last_stage(self) -> bool:
        return self.pipeline is None or self.pipeline.last

    def output_weight(self) -> torch.Tensor:
        """The output layer's weight on this rank, [its vocabulary rows, d] (the input embedding's, tied), for the
        logits of ``final_hidden``'s whole rows. Under context parallelism every rank of the group computes those
        logits for every position, so each one's gradient for the weight is the whole gradient, and the ranks'
        gradient sum (data x context parallel) would count it once per rank: it is scaled by 1 / CP here. (The
        unchunked output layer runs on each rank's own positions, whose gradients add up to the whole.)"""
        if self.gpt.share_embeddings_and_output_weights:
            weight = self.gpt.shared_embedding_or_output_weight()
        else:
            weight = self.gpt.output_layer.weight
        if self.context is not None and self.context.size > 1:
            weight = _GradientScaled.apply(weight, 1.0 / self.context.size)
        return weight

    def vocabulary(self):
        """How :meth:`output_weight`'s rows split the padded vocabulary over the tensor-parallel ranks."""
        from vime.backends.chunked_logits import VocabParallelHead

        rank, size, group = tp_split()
        return VocabParallelHead(self.vocab_size, rank=rank, size=size, group=group if size > 1 else None)

    def _head_input(self, decoder_output: torch.Tensor) -> torch.Tensor:
        """The decoder's output [S, B, d] as the output layer reads it, as [B, S, d]: gathered over the tensor-
        parallel ranks under sequence parallelism (megatron-core's gather, whose backward reduce-scatters), and
        with its gradient summed over them without (each rank's logits are its own vocabulary rows, so each
        rank's gradient for the hidden states is its share)."""
        rank, size, group = tp_split()
        if size > 1:
            if self.sequence_parallel:
                from megatron.core import tensor_parallel

                decoder_output = tensor_parallel.gather_from_sequence_parallel_region(decoder_output)
            else:
                decoder_output = _GradientSummed.apply(decoder_output, group)
        return decoder_output.transpose(0, 1)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        routes: list[torch.Tensor] | None = None,
        final_hidden: bool = False,
    ) -> CausalLMOutput:
        dev = device()
        input_ids = input_ids.to(dev)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        attention_mask = attention_mask.to(dev)
        if routes is not None:
            if self.model_args is None or not self.model_args.is_moe:
                raise ValueError("routes given for a model without MoE layers")
            if len(routes) != input_ids.shape[0]:
                raise ValueError(f"routes for {len(routes)} rows, the batch has {input_ids.shape[0]}")
        self._routes = routes
        if self.pipeline is not None and not self.pipeline.first:
            self.gpt.set_input_tensor(self.pipeline.receive_input(self.gpt.config.pipeline_dtype, dev))
        batch, length = input_ids.shape
        self._final_hidden = final_hidden and self._last_stage
        with _output_layer_skipped(self.gpt) if self._final_hidden else contextlib.nullcontext():
            if self.packing == "thd":
                output = self._forward_thd(input_ids, attention_mask)
            else:
                input_ids, attention_mask = self._lockstep_padded(input_ids, attention_mask)
                output = self._forward_padded(input_ids, attention_mask)
        if self.packing != "thd" and self._last_stage:
            output = output[:batch, :length]
        if not self._last_stage or self._final_hidden:
            return CausalLMOutput(logits=None, hidden=output)
        return CausalLMOutput(output[..., : self.vocab_size].float())

    def _stage_output(self, output: torch.Tensor) -> torch.Tensor:
        """The GPTModel's output as the rest of the forward handles it: a stage before the last's as it is;
        the last stage's as [B, S, ...] (logits, or the output layer's input for ``final_hidden``)."""
        if not self._last_stage:
            return output
        return self._head_input(output) if self._final_hidden else output

    def _lockstep(self):
        """The group whose ranks exchange tokens inside every MoE layer (expert and expert tensor
        parallelism), or None. Its ranks must run each forward on the same number of tokens: megatron-core's
        all-gather dispatcher gathers equal slices."""
        if self.model_args is None or not self.model_args.is_moe:
            return None
        from megatron.core import parallel_state as ps

        if ps.get_expert_tensor_and_model_parallel_world_size() == 1:
            return None
        return ps.get_expert_tensor_and_model_parallel_group()

    def _agree(self, values: list[int]) -> list[int]:
        """The element-wise maximum of ``values`` over the lockstep group."""
        import torch.distributed as dist

        shape = torch.tensor(values, dtype=torch.long, device=device())
        dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=self._lockstep())
        return shape.tolist()

    def _lockstep_padded(self, input_ids, attention_mask):
        """Under expert parallelism, pad the batch to the group's largest [rows, length]. Padding rows keep
        their first position unmasked so that attention stays finite; their outputs are cut off."""
        batch, length = input_ids.shape
        self._real_rows = batch
        if self._lockstep() is None:
            return input_ids, attention_mask
        rows, columns = self._agree([batch, length])
        if (rows, columns) == (batch, length):
            return input_ids, attention_mask
        input_ids = torch.nn.functional.pad(input_ids, (0, columns - length, 0, rows - batch))
        attention_mask = torch.nn.functional.pad(attention_mask, (0, columns - length, 0, rows - batch))
        attention_mask[batch:, 0] = 1
        if self._routes is not None:
            empty = self._routes[0].new_zeros((0, *self._routes[0].shape[1:]))
            self._routes = list(self._routes) + [empty] * (rows - batch)
        return input_ids, attention_mask

    def _padding(self, padding: torch.Tensor) -> dict:
        """MoE routers leave padded tokens (True) out of their load-balancing statistics."""
        return {"padding_mask": padding} if self.model_args is not None and self.model_args.is_moe else {}

    def _force(self, layout_fn) -> None:
        """Set (or clear) the routers' forced experts for the forward about to run; a dense model has none."""
        if self.model_args is None or not self.model_args.is_moe:
            return
        from vime.backends import megatron_routing as mr

        if self._routes is None:
            mr.force_routes(self.gpt, None)
            return
        rank, size, _ = tp_split()
        layers = mr.per_layer(
            layout_fn(), tp_rank=rank, tp_size=size, sequence_parallel=self.sequence_parallel, device=device()
        )
        if self._stage_moe_layers is not None:
            layers = [layers[i] for i in self._stage_moe_layers]
        mr.force_routes(self.gpt, layers)

    def _tp_multiple(self) -> int:
        return tp_split()[1] if self.sequence_parallel else 1

    def _pad_multiple(self, needed: int) -> int:
        """What the sequence dimension is padded to a multiple of: ``needed`` (sequence and context parallelism
        split it evenly over their ranks) and --data-pad-size-multiplier x the tensor-parallel size."""
        if self.pad_size_multiplier == 1:
            return needed
        return math.lcm(needed, self.pad_size_multiplier * tp_split()[1])

    def _forward_padded(self, input_ids, attention_mask):
        batch, length = input_ids.shape
        multiple = self._pad_multiple(self._tp_multiple() * (1 if self.context is None else self.context.multiple))
        padded = -(-length // multiple) * multiple
        if padded != length:  # SP and CP split the sequence evenly over their ranks; --data-pad-size-multiplier
            input_ids = torch.nn.functional.pad(input_ids, (0, padded - length))
            attention_mask = torch.nn.functional.pad(attention_mask, (0, padded - length))
        positions = torch.arange(padded, device=input_ids.device).unsqueeze(0).expand(batch, padded)
        # True = masked: later keys (causal) and padded keys.
        causal = torch.ones(padded, padded, dtype=torch.bool, device=input_ids.device).triu(1)
        mask = causal[None, None] | (attention_mask == 0)[:, None, None, :]
        from vime.backends.megatron_routing import padded_layout

        padding = attention_mask == 0
        padding[self._real_rows :] = True  # lockstep padding rows stay out of the routers' statistics
        held = slice(None)  # the positions this rank holds (on the CPU, as the routes are)
        if self.context is not None:  # this rank's positions (queries) against every rank's (keys)
            held = self.context.positions(padded)
            here = held.to(input_ids.device)
            keys = self.context.gathered_positions(padded, device=input_ids.device)
            mask = mask[:, :, here][..., keys]
            input_ids, positions, padding = input_ids[:, here], positions[:, here], padding[:, here]
        self._force(lambda: padded_layout(self._routes, padded, self.model_args)[:, held])
        output = self._stage_output(self.gpt(input_ids, positions, mask, **self._padding(padding)))
        if not self._last_stage:
            return output
        if self.context is not None:
            output = self.context.gather_sequence(output, dim=1)
        return output[:, :length]

    def _forward_thd(self, input_ids, attention_mask):
        from megatron.core.packed_seq_params import PackedSeqParams

        batch, length = input_ids.shape
        lengths = attention_mask.sum(dim=1).tolist()
        tokens = torch.cat([input_ids[row, :n] for row, n in enumerate(lengths)])
        positions = torch.cat([torch.arange(n, device=input_ids.device) for n in lengths])
        total = tokens.numel()
        multiple = self._pad_multiple(self._tp_multiple())
        extra = -(-total // multiple) * multiple - total
        if self._lockstep() is not None:  # as many tokens as the expert-parallel group's largest batch
            extra = self._agree([total + extra])[0] - total
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        if extra:  # padding joins the last sequence: causal attention keeps it out of the real tokens
            tokens = torch.nn.functional.pad(tokens, (0, extra))
            positions = torch.cat([positions, torch.arange(lengths[-1], lengths[-1] + extra, device=input_ids.device)])
            bounds[-1] += extra
        cu = torch.tensor(bounds, dtype=torch.int32, device=input_ids.device)
        longest = max(lengths) + extra
        params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
        )
        from vime.backends.megatron_routing import packed_layout

        self._force(lambda: packed_layout(self._routes, lengths, total + extra, self.model_args))
        padding = torch.arange(total + extra, device=input_ids.device) >= total
        output = self.gpt(
            tokens.unsqueeze(0),
            positions.unsqueeze(0),
            None,
            packed_seq_params=params,
            **self._padding(padding.unsqueeze(0)),
        )
        output = self._stage_output(output)
        if not self._last_stage:
            return output
        packed = output[0]
        rows = [
            torch.nn.functional.pad(packed[start : start + n], (0, 0, 0, length - n))
            for start, n in zip(bounds[:-1], lengths)
        ]
        return torch.stack(rows)
