"""Pipeline parallelism for the Megatron backend (``--pipeline-model-parallel-size``).

Each pipeline stage holds a contiguous slice of the decoder layers (the first also the embedding, the last
the final norm and the output layer). Every stage runs the backend's training loop unchanged (the same
micro-batches, the same loss code, the same metrics); what crosses the stages:

- **forward**: a stage after the first receives the previous stage's hidden states and a stage before the
  last sends its own on. The last stage turns the logits into the per-token results the loss code reads
  (log-probs, entropy, top-k log-probs, values) and broadcasts them over the pipeline group, so every
  stage computes the same loss, advantages and metrics.
- **backward**: on the last stage the loss's backward reaches the received hidden states, whose gradient
  is sent back to the previous stage; a stage before the last receives the gradient of the hidden states
  it sent (:class:`_StageBridge`) and continues the backward through its own layers.

**Decision**: the schedule is sequential, one micro-batch through every stage, forward then backward,
before the next. Stages do not overlap (a bubble of (PP - 1) / PP of the time): this spreads a model's
memory over the stages with the loss code shared by every backend; an interleaved (1F1B) schedule is
not wired. See docs/parallelism.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_HIDDEN_DIMS = 3  # hidden states are [sequence, batch, hidden] (thd: [tokens, 1, hidden])


class Pipeline:
    """This rank's place in its pipeline-parallel group and the transfers between stages."""

    def __init__(self):
        from megatron.core import parallel_state as ps

        self.size = ps.get_pipeline_model_parallel_world_size()
        self.rank = ps.get_pipeline_model_parallel_rank()
        self.group = ps.get_pipeline_model_parallel_group()
        self.first, self.last = self.rank == 0, self.rank == self.size - 1
        self.previous = None if self.first else ps.get_pipeline_model_parallel_prev_rank()
        self.next = None if self.last else ps.get_pipeline_model_parallel_next_rank()
        self.last_rank = ps.get_pipeline_model_parallel_last_rank()

    def receive_input(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The previous stage's hidden states. Under autograd their gradient goes back to that stage as soon
        as the backward has computed it."""
        shape = torch.empty(_HIDDEN_DIMS, dtype=torch.long, device=device)
        dist.recv(shape, src=self.previous)
        hidden = torch.empty(shape.tolist(), dtype=dtype, device=device)
        dist.recv(hidden, src=self.previous)
        if torch.is_grad_enabled():
            hidden.requires_grad_()
            hidden.register_hook(self._send_gradient_back)
        return hidden

    def _send_gradient_back(self, grad: torch.Tensor) -> None:
        dist.send(grad.contiguous(), dst=self.previous)

    def send_output(self, hidden: torch.Tensor) -> None:
        dist.send(torch.tensor(hidden.shape, dtype=torch.long, device=hidden.device), dst=self.next)
        dist.send(hidden.detach().contiguous(), dst=self.next)

    def receive_gradient(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        grad = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(grad, src=self.next)
        return grad

    def results(self, output, compute, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
        """The per-token results of a forward on every stage: ``compute(output)`` on the last stage (whose
        ``output.logits``, or ``.hidden`` for chunked log-probs, are set), broadcast to the others, where they
        carry this stage's backward.
        ``shapes`` are the results' shapes (float32), which every stage knows from the batch."""
        if self.last:
            tensors = compute(output)
            for tensor in tensors:
                dist.broadcast(tensor.detach().float().contiguous(), src=self.last_rank, group=self.group)
            return tensors
        return list(_StageBridge.apply(output.hidden, self, shapes))

    def receive_results(self, shapes: list[tuple[int, ...]], device: torch.device) -> list[torch.Tensor]:
        out = []
        for shape in shapes:
            tensor = torch.empty(shape, dtype=torch.float32, device=device)
            dist.broadcast(tensor, src=self.last_rank, group=self.group)
            out.append(tensor)
        return out


class _StageBridge(torch.autograd.Function):
    """A stage before the last: sends its hidden states on and returns the last stage's results; the
    backward returns the gradient the next stage sends back for those hidden states (the results' own
    gradients are the last stage's to apply, there)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, pipeline: Pipeline, shapes: list[tuple[int, ...]]):
        pipeline.send_output(hidden)
        ctx.pipeline, ctx.shape, ctx.dtype, ctx.device = pipeline, hidden.shape, hidden.dtype, hidden.device
        return tuple(pipeline.receive_results(shapes, hidden.device))

    @staticmethod
    def backward(ctx, *_result_grads):
        return ctx.pipeline.receive_gradient(ctx.shape, ctx.dtype, ctx.device), None, None


def sum_tied_embedding_gradients(params: list[torch.Tensor]) -> None:
    """With tied embeddings the first stage's input embedding and the last stage's output layer are one
    matrix held twice: their gradients add up over the embedding group so both copies take the same step."""
    from megatron.core import parallel_state as ps

    if not ps.is_rank_in_embedding_group():
        return
    for param in params:
        if getattr(param, "shared_embedding", False):
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad, group=ps.get_embedding_group())


def check_stage_layers(num_layers: int, parallel) -> None:
    """The layers must split as megatron-core splits them: the first and last stages' counts where given,
    the rest evenly over the other stages (a ValueError naming the flags otherwise)."""
    stages, first, last = parallel.pipeline, parallel.first_stage_layers, parallel.last_stage_layers
    if first is None and last is None:
        if num_layers % stages:
            raise ValueError(
                f"--pipeline-model-parallel-size {stages} must divide the model's {num_layers} layers "
                "(--num-layers), or --decoder-first-pipeline-num-layers / "
                "--decoder-last-pipeline-num-layers set the end stages' share"
            )
        return
    middle_stages = stages - (first is not None) - (last is not None)
    middle_layers = num_layers - (first or 0) - (last or 0)
    if middle_stages:
        fits = middle_layers % middle_stages == 0 and middle_layers >= middle_stages
    else:
        fits = middle_layers == 0
    if not fits:
        given = ", ".join(
            f"{flag} {value}"
            for flag, value in (
                ("--decoder-first-pipeline-num-layers", first),
                ("--decoder-last-pipeline-num-layers", last),
            )
            if value is not None
        )
        raise ValueError(
            f"{given}: the model's {num_layers} layers (--num-layers) leave {middle_layers} for the "
            f"other {middle_stages} of --pipeline-model-parallel-size {stages} stages, which must "
            "share them evenly, at least one each"
        )


def stage_layers(gpt) -> range:
    """The global (0-based) indices of the decoder layers this stage holds."""
    layers = gpt.decoder.layers
    first = layers[0].layer_number - 1 if len(layers) else 0
    return range(first, first + len(layers))
