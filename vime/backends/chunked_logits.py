"""Token log-probs, entropy and head log-probs without the whole [tokens x vocab] logits (--log-probs-chunk-size).

The unchunked forward (``TorchBackend.forward``) asks the model for its logits, so a micro-batch holds
``tokens x vocab`` float32 values at least twice (logits and their log-softmax), and autograd keeps them
for the backward pass: with a 150k vocabulary and 8k tokens, ~5 GB each. Here the model's transformer
body gives the final hidden states, and the LM head, the temperature and the log-softmax run on ``chunk_size``
positions at a time, keeping only the per-token results. The backward pass recomputes each chunk's
logits from the hidden states and the head's weight (an ``autograd.Function`` with the analytic gradient
of the log-softmax), so no chunk's logits outlive its own step: the graph saves the hidden states, the
weight (a parameter, saved by reference) and the token ids, nothing vocabulary-sized.

Results and gradients equal the unchunked path's within float32 rounding (tests/unit/test_chunked_logits.py);
with tied embeddings the head's weight is the embedding's, and its gradient adds to the embedding's.

A vocabulary-parallel head (:class:`VocabParallelHead`: the Megatron backend's output layer, whose weight holds
one tensor-parallel rank's rows of a padded vocabulary) gathers each chunk's logits over its ranks and drops the
padding rows; in the backward pass each rank keeps its own rows' gradient. The hidden states' gradient is then
this rank's share of the sum, which the caller sums over the ranks (vime.backends.megatron_forward's
``MegatronLM._head_input``).
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class VocabParallelHead:
    """A head whose weight is rows ``[rank x n, (rank + 1) x n)`` of a vocabulary padded to ``size x n`` rows; the
    logits are those of the first ``vocab_size`` rows. ``size`` 1: one rank holds every row (padding still cut)."""

    vocab_size: int
    rank: int = 0
    size: int = 1
    group: object | None = None  # the tensor-parallel process group (size > 1)

    def logits(self, local: torch.Tensor) -> torch.Tensor:
        """[n, rows of this rank] -> [n, vocab_size]: every rank's rows, in order, the padding cut."""
        if self.size > 1:
            import torch.distributed as dist

            parts = [torch.empty_like(local) for _ in range(self.size)]
            dist.all_gather(parts, local.contiguous(), group=self.group)
            local = torch.cat(parts, dim=-1)
        return local[..., : self.vocab_size]

    def local_gradient(self, grad: torch.Tensor, rows: int) -> torch.Tensor:
        """[n, vocab_size] -> [n, rows]: the gradient of this rank's rows (zero on padding rows)."""
        start = self.rank * rows
        held = max(0, min(start + rows, self.vocab_size) - start)
        if held == rows:
            return grad[:, start : start + rows]
        local = grad.new_zeros((grad.shape[0], rows))
        local[:, :held] = grad[:, start : start + held]
        return local


@dataclasses.dataclass
class TokenLogProbs:
    log_probs: torch.Tensor  # [..., ] of the target tokens
    entropy: torch.Tensor | None = None  # [..., ]
    head_log_probs: torch.Tensor | None = None  # [..., k] at the given head ids


def causal_lm_parts(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(transformer body, LM head) of an HF causal LM (Qwen2, Llama and the other ``*ForCausalLM``
    classes whose forward is ``lm_head(model(...).last_hidden_state)``)."""
    head = model.get_output_embeddings()
    body = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, model.base_model_prefix)
    if not isinstance(head, torch.nn.Linear) or body is None or body is model:
        raise ValueError(
            f"--log-probs-chunk-size: cannot split {type(model).__name__} into a transformer body "
            "and a linear LM head; run without the flag"
        )
    return body, head


def chunked_forward(
    model: torch.nn.Module,
    model_inputs: dict,
    targets: torch.Tensor,
    *,
    chunk_size: int,
    temperature: float,
    entropy: str | None = None,
    head_ids: torch.Tensor | None = None,
    predicting=None,
) -> TokenLogProbs:
    """What ``TorchBackend._forward`` computes (the logits at t predict ``targets[:, t]``, t < T-1), by chunks.

    ``model_inputs``: the keyword arguments of the model's forward (input_ids, attention_mask, ...).
    ``entropy``: None, 'metric' (no gradient) or 'loss' (differentiable); ``head_ids`` [B, T-1, k]: also the
    log-probs at those ids (score centering). ``predicting``: the final hidden states [B, T, d] at the positions
    whose logits predict ``targets`` (packed sequences: vime.backends.sequence_packing); by default every
    position but the last, and ``targets`` and ``head_ids`` then have that shape."""
    body, head = causal_lm_parts(model)
    states = final_hidden_states(model, body, model_inputs)
    hidden = states[:, :-1] if predicting is None else predicting(states)
    return chunked_token_log_probs(
        hidden,
        head.weight,
        head.bias,
        targets,
        chunk_size=chunk_size,
        temperature=temperature,
        entropy=entropy,
        head_ids=head_ids,
    )


def final_hidden_states(model: torch.nn.Module, body: torch.nn.Module, model_inputs: dict) -> torch.Tensor:
    """The body's last hidden states [B, T, d] (what the LM head reads), from a forward of the whole model
    that computes the logits of no position (``logits_to_keep`` = no index).

    Why not call the body directly: the whole model's forward is what wrappers hook into (FSDP2 gathers the
    root's parameters, embeddings and LM head included, in the root's pre-forward and keeps them gathered
    for the backward pass), so the LM head's weight read afterwards is the whole one."""
    captured = []
    handle = body.register_forward_hook(lambda module, args, output: captured.append(output.last_hidden_state))
    try:
        # No KV cache: this is a training forward, and the cache would only hold every layer's keys and values.
        device = next(iter(model_inputs.values())).device
        model(**model_inputs, use_cache=False, logits_to_keep=torch.zeros(0, dtype=torch.long, device=device))
    finally:
        handle.remove()
    if len(captured) != 1:
        raise ValueError(
            f"--log-probs-chunk-size: the body of {type(model).__name__} ran {len(captured)} times "
            "in one forward; run without the flag"
        )
    return captured[0]


def chunked_token_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    chunk_size: int,
    temperature: float,
    entropy: str | None = None,
    head_ids: torch.Tensor | None = None,
    vocab: VocabParallelHead | None = None,
) -> TokenLogProbs:
    """Log-probs of ``targets`` under ``log_softmax((hidden @ weight.T + bias) / temperature)``, ``chunk_size``
    positions at a time (temperature <= 0: none, as the unchunked path). ``hidden`` [..., d], ``targets`` [...],
    ``head_ids`` [..., k]; results have the leading shape of ``targets``. ``vocab``: the weight is one rank's rows
    of a padded vocabulary (None: the whole vocabulary, unpadded)."""
    if chunk_size < 1:
        raise ValueError(f"--log-probs-chunk-size must be >= 1, got {chunk_size}")
    if entropy not in (None, "metric", "loss"):
        raise ValueError(f"entropy must be None, 'metric' or 'loss', not {entropy!r}")
    shape = targets.shape
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1)
    heads = (
        head_ids.reshape(flat_targets.numel(), -1)
        if head_ids is not None
        else torch.zeros((flat_targets.numel(), 0), dtype=torch.long, device=flat_targets.device)
    )
    if vocab is not None and bias is not None:
        raise ValueError("a vocabulary-parallel head has no bias")
    log_probs, token_entropy, head_log_probs = _ChunkedLogSoftmax.apply(
        flat_hidden, weight, bias, flat_targets, heads, chunk_size, float(temperature), entropy is not None, vocab
    )
    out = TokenLogProbs(log_probs.reshape(shape))
    if entropy is not None:
        # 'metric' is reported, never differentiated: detached, as the unchunked path computes it without a graph.
        out.entropy = (token_entropy if entropy == "loss" else token_entropy.detach()).reshape(shape)
    if head_ids is not None:
        out.head_log_probs = head_log_probs.reshape(head_ids.shape)
    return out


def _chunk_log_softmax(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
    vocab: VocabParallelHead | None,
) -> torch.Tensor:
    """One chunk's float32 log-softmax, in the unchunked path's order of operations (logits in the model's
    dtype, then the temperature, then float32), so that the two agree to the last bit where they can. A
    vocabulary-parallel head's logits are float32 before the temperature, as the Megatron backend's are."""
    logits = torch.nn.functional.linear(hidden, weight, bias)
    if vocab is not None:
        logits = vocab.logits(logits).float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits.float(), dim=-1)


class _ChunkedLogSoftmax(torch.autograd.Function):
    """Forward: per-chunk log-softmax, keeping target log-probs, entropy and head log-probs. Backward:
    recompute each chunk's log-softmax ``l`` (``p = exp(l)``) and apply, with ``z`` the tempered logits,

    - d l[t] / dz = onehot(t) - p                       (target and head log-probs)
    - d H / dz = -p * (l + H), H = -sum p l              (entropy)

    then chain through the temperature and the linear head to the hidden states, weight and bias (a
    vocabulary-parallel head: this rank's rows of ``dz``)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, heads, chunk_size, temperature, with_entropy, vocab):
        n = targets.numel()
        log_probs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        head_log_probs = torch.empty(heads.shape, dtype=torch.float32, device=hidden.device)
        with torch.no_grad():
            for start in range(0, n, chunk_size):
                end = min(start + chunk_size, n)
                log_softmax = _chunk_log_softmax(hidden[start:end], weight, bias, temperature, vocab)
                log_probs[start:end] = log_softmax.gather(-1, targets[start:end].unsqueeze(-1)).squeeze(-1)
                if with_entropy:
                    entropy[start:end] = -(log_softmax.exp() * log_softmax).sum(-1)
                if heads.shape[1]:
                    head_log_probs[start:end] = log_softmax.gather(-1, heads[start:end])
        ctx.save_for_backward(hidden, weight, bias, targets, heads)
        ctx.chunk_size, ctx.temperature, ctx.vocab = chunk_size, temperature, vocab
        ctx.set_materialize_grads(False)  # an output nobody differentiates (entropy as a metric) gets None
        return log_probs, entropy, head_log_probs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_log_probs, grad_entropy, grad_heads):
        hidden, weight, bias, targets, heads = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        # Summed over chunks in float32 (as one matmul over all tokens would), cast once at the end.
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias = (
            torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_bias and bias is not None else None
        )
        with_heads = grad_heads is not None and heads.shape[1] > 0
        n = targets.numel()
        for start in range(0, n, ctx.chunk_size):
            end = min(start + ctx.chunk_size, n)
            chunk = hidden[start:end]
            with torch.no_grad():
                log_softmax = _chunk_log_softmax(chunk, weight, bias, ctx.temperature, ctx.vocab)
                probs = log_softmax.exp()
                grad_z = torch.zeros_like(log_softmax)
                mass = torch.zeros(end - start, dtype=torch.float32, device=hidden.device)  # sum of the upstream
                if grad_log_probs is not None:
                    g = grad_log_probs[start:end].float()
                    grad_z.scatter_add_(-1, targets[start:end].unsqueeze(-1), g.unsqueeze(-1))
                    mass += g
                if with_heads:
                    g = grad_heads[start:end].float()
                    grad_z.scatter_add_(-1, heads[start:end], g)
                    mass += g.sum(-1)
                grad_z -= mass.unsqueeze(-1) * probs
                if grad_entropy is not None:
                    token_entropy = -(probs * log_softmax).sum(-1, keepdim=True)
                    grad_z -= grad_entropy[start:end].float().unsqueeze(-1) * probs * (log_softmax + token_entropy)
                if ctx.temperature > 0:
                    grad_z /= ctx.temperature
                if ctx.vocab is not None:
                    grad_z = ctx.vocab.local_gradient(grad_z, weight.shape[0])
                grad_logits = grad_z.to(hidden.dtype)
                if need_hidden:
                    grad_hidden[start:end] = grad_logits @ weight
                if need_weight:
                    grad_weight.addmm_(grad_logits.t().float(), chunk.float())
                if grad_bias is not None:
                    grad_bias += grad_z.sum(0)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None
