"""The torch backend's forward inputs: a micro-batch's sequences packed back to back, or right-padded rows.

A :class:`~vime.rl.batch.PackedBatch` holds its samples right-padded into ``[rows, longest]`` tensors, and that
stays the layout the RL objective reads (targets, masks, advantages, log-probs: ``[rows, longest - 1]``
scalars). What the model runs on need not be: :class:`PackedSequences` concatenates the rows' tokens into one
row of ``sum(lengths)`` tokens, each sequence with its own position ids (restarting at 0), and no attention
mask. Transformers then confines attention to each sequence: ``masking_utils`` reads the restarts of the
position ids and builds the block-diagonal causal mask (eager, sdpa, flex attention), and flash attention
runs its variable-length kernels on them. The model's activations and logits are ``sum(lengths)`` tokens
instead of ``rows x longest``; the per-token results are put back into the padded layout (0 at padding).

:class:`PaddedRows` is the same interface over the padded rows (with the attention mask), for models that
cannot be packed safely (:func:`packing_refusal`) and for micro-batches whose packed row would cost more than
their padded rows under a dense attention (:func:`packing_pays`). Both give the same log-probs, entropy, head
log-probs and values within float32 rounding (tests/unit/test_sequence_packing.py).
"""

from __future__ import annotations

import inspect
import logging
import sys

import torch

from vime.rl.batch import PackedBatch

logger = logging.getLogger(__name__)

# The attention implementations that honour packing by position ids in transformers 5: those whose mask
# masking_utils builds from a mask function that includes the packed-sequence blocks, and flash attention,
# which derives its varlen sequence bounds from the position ids. Any other (a kernel registered by name,
# paged attention) may attend across sequences: the backend pads for those.
PACKABLE_ATTENTION = frozenset(
    {"eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3", "flash_attention_4"}
)
# Of those, the ones whose kernels skip what the mask excludes (varlen flash attention, flex attention's block
# mask): a packed row costs its sequences' own attention. eager and sdpa attend densely under the block-diagonal
# mask, so a packed row of N tokens costs N x N attention pairs where B padded rows of T cost B x T x T.
BLOCK_SPARSE_ATTENTION = frozenset({"flex_attention", "flash_attention_2", "flash_attention_3", "flash_attention_4"})


def packing_refusal(model: torch.nn.Module) -> str | None:
    """Why ``model`` (an HF causal LM, or PPO's critic body) cannot take packed sequences; None if it can.

    Packing is only safe where transformers builds the mask from the position ids: a model class of
    transformers itself (not remote code) whose modeling module uses ``masking_utils.create_causal_mask``,
    whose forward takes ``position_ids``, with one of :data:`PACKABLE_ATTENTION`."""
    try:
        from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401
    except ImportError:
        return "this transformers does not detect packed sequences (transformers.masking_utils)"
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in PACKABLE_ATTENTION:
        return f"attention implementation {implementation!r} is not one that confines attention to packed sequences"
    # FSDP2 wraps a sharded module's class in one of its own (defined in torch): judge the class it wraps.
    kind = next(k for k in type(model).__mro__ if not k.__module__.startswith("torch."))
    modeling = sys.modules.get(kind.__module__)
    if not kind.__module__.startswith("transformers.models.") or not hasattr(modeling, "create_causal_mask"):
        return f"{kind.__name__} does not build its attention mask with transformers.masking_utils"
    if "position_ids" not in inspect.signature(model.forward).parameters:
        return f"{kind.__name__}.forward takes no position_ids"
    return _recurrent_mixing(model, config)


# Two short sequences the packing probe runs packed and the second alone (ids valid in any vocabulary).
PROBE_FIRST, PROBE_SECOND = [3, 1, 4], [1, 5, 9, 2]


def packed_leak(model: torch.nn.Module) -> str | None:
    """Why ``model`` (whole, not sharded: a forward of its own) lets one packed sequence see the one before it,
    measured; None if it does not. A model class may use masking_utils yet build its masks without the position
    ids (transformers' gpt-oss does), which nothing in its signature shows: the probe runs two sequences packed (a
    7-token forward) and the second alone, whose outputs must agree. A leak moves them by a fraction of their
    scale (tiny random models: ~20%); the tolerance, 2%, is above bf16's rounding of the same sums. The reference
    model and the critic's body are built from the same modeling code and share the verdict."""
    device = next(model.parameters()).device
    ids = torch.tensor([PROBE_FIRST + PROBE_SECOND], device=device)
    positions = torch.tensor([list(range(len(PROBE_FIRST))) + list(range(len(PROBE_SECOND)))], device=device)
    training = model.training
    model.eval()  # (no dropout)
    try:
        with torch.no_grad():
            # (without a cache, as in training: transformers looks for packed sequences only then)
            packed = model(input_ids=ids, position_ids=positions, use_cache=False)[0][0, len(PROBE_FIRST) :].float()
            alone = model(input_ids=ids[:, len(PROBE_FIRST) :], use_cache=False)[0][0].float()
    finally:
        model.train(training)
    if (packed - alone).abs().max() > 0.02 * max(1.0, float(alone.abs().max())):
        name = type(model).__name__
        return f"{name} attends across packed sequences (its attention masks do not follow the position ids)"
    return None


# layer_types entries of layers that mix tokens by attention alone (what the packed mask confines)
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention"})


def _recurrent_mixing(model: torch.nn.Module, config) -> str | None:
    """Why ``model`` mixes tokens beyond its attention's reach, None if it does not. A recurrent layer (a gated
    delta net, a state-space block: config.json's ``layer_types`` names it) or a convolution along the sequence
    carries one packed sequence into the next, which no attention mask prevents."""
    layer_types = getattr(config.get_text_config(), "layer_types", None)  # (a multimodal model's: its LM's)
    others = sorted(set(layer_types or ()) - ATTENTION_LAYER_TYPES)
    if others:
        return (
            f"its {', '.join(others)} layers mix tokens beyond what the packed mask confines (a recurrent state, "
            "an indexer's own top-k), from one packed sequence into the next"
        )
    convolution = next((name for name, module in model.named_modules() if isinstance(module, torch.nn.Conv1d)), None)
    if convolution is not None:
        return f"its convolution {convolution} runs along the sequence, across packed sequences"
    return None


def all_packable(models: list[torch.nn.Module | None], leak: str | None = None) -> bool:
    """Whether every one of ``models`` (the policy, the reference, the critic's body; None: absent) takes packed
    sequences, ``leak`` being :func:`packed_leak`'s verdict on the policy. If one does not, the micro-batches of all
    run right-padded, and the log says why, once."""
    reasons = (packing_refusal(model) for model in filter(None, models))
    reason = next((r for r in reasons if r is not None), leak)
    if reason is not None:
        logger.warning("micro-batches run right-padded, not packed back to back: %s", reason)
        return False
    return True


class PackedSequences:
    """``batch``'s sequences back to back in one row, and the maps between that row and the padded layout.

    In the padded layout the value at (row, t) is read at position t of the row and predicts token t + 1;
    in the packed row it is read at ``offset(row) + t``. Each sequence's last position predicts nothing of
    its own (it would predict the next sequence's first token) and is dropped, as the padded layout's
    positions past a row's length are."""

    def __init__(self, batch: PackedBatch):
        lengths = batch.attention_mask.sum(dim=1)  # right-padded: the first `length` tokens of each row
        real = batch.attention_mask.bool()
        self.input_ids = batch.input_ids[real].unsqueeze(0)  # row-major: the rows' tokens in order
        ends = torch.cumsum(lengths, 0)
        total = int(ends[-1])
        positions = torch.arange(total, device=lengths.device)
        self.position_ids = (positions - torch.repeat_interleave(ends - lengths, lengths)).unsqueeze(0)
        # Positions predicting a target: all of a row's but its last (real[:, 1:] is the next token's presence).
        self.predicting_mask = real[:, 1:]  # [B, T-1], in the padded layout
        predicts = torch.ones(total, dtype=torch.bool, device=lengths.device)
        predicts[ends - 1] = False
        self.predicting_positions = predicts.nonzero().squeeze(1)  # [sum(lengths) - B], in the packed row
        self.tokens = self.input_ids.shape[1]

    def model_inputs(self) -> dict:
        # No attention mask: with one, transformers would not look for packed sequences.
        return {"input_ids": self.input_ids, "position_ids": self.position_ids}

    def predicting(self, states: torch.Tensor) -> torch.Tensor:
        """The model's ``[1, tokens, ...]`` outputs at the positions predicting a target, ``[targets, ...]``."""
        return states[0, self.predicting_positions]

    def gather(self, padded: torch.Tensor | None) -> torch.Tensor | None:
        """The ``[B, T-1, ...]`` per-target values at the packed row's targets, ``[targets, ...]``."""
        return None if padded is None else padded[self.predicting_mask]

    def scatter(self, values: torch.Tensor | None) -> torch.Tensor | None:
        """Inverse of :meth:`gather` (differentiable): ``[targets, ...]`` into ``[B, T-1, ...]``, 0 at padding."""
        if values is None:
            return None
        out = values.new_zeros((*self.predicting_mask.shape, *values.shape[1:]))
        out[self.predicting_mask] = values
        return out


class PaddedRows:
    """The same interface as :class:`PackedSequences` over the batch's right-padded rows, with their mask."""

    def __init__(self, batch: PackedBatch):
        self.batch = batch
        self.tokens = batch.input_ids.numel()

    def model_inputs(self) -> dict:
        return {"input_ids": self.batch.input_ids, "attention_mask": self.batch.attention_mask}

    @property
    def predicting_positions(self) -> None:
        return None  # every position but the last (logits_to_keep cannot say that for every row)

    @staticmethod
    def predicting(states: torch.Tensor) -> torch.Tensor:
        return states[:, :-1]

    @staticmethod
    def gather(padded: torch.Tensor | None) -> torch.Tensor | None:
        return padded

    @staticmethod
    def scatter(values: torch.Tensor | None) -> torch.Tensor | None:
        return values


def packing_pays(batch: PackedBatch, config) -> bool:
    """Whether ``batch``'s packed row costs no more than its padded rows, for a model of ``config``.

    With a block-sparse attention (:data:`BLOCK_SPARSE_ATTENTION`) it always does. With a dense one, a packed row
    saves the padding in every matmul but attends over all its N x N token pairs: in multiply-adds per layer, a
    token costs ~4h^2 (attention projections) + 3h*ffn (MLP) + h*vocab / layers (the LM head, counted as a
    layer's share), a pair ~2h (scores and weighted values). Eight samples of equal length pad nothing and would
    attend eight times more pairs packed: those stay padded; a micro-batch with one long sample packs."""
    if config._attn_implementation in BLOCK_SPARSE_ATTENTION:
        return True
    config = config.get_text_config()  # (a multimodal model's sizes are its language model's: Gemma 4's text_config)
    hidden = config.hidden_size
    mlp = getattr(config, "intermediate_size", None) or 4 * hidden
    layers = getattr(config, "num_hidden_layers", None) or 1
    per_token = 4 * hidden * hidden + 3 * hidden * mlp + hidden * config.vocab_size / layers
    per_pair = 2 * hidden
    lengths = batch.attention_mask.sum(dim=1).double()
    tokens, rows, longest = float(lengths.sum()), lengths.numel(), batch.attention_mask.shape[1]
    packed = tokens * per_token + tokens * tokens * per_pair
    padded = rows * longest * per_token + rows * longest * longest * per_pair
    return packed <= padded


def forward_layout(batch: PackedBatch, packing: bool, config) -> PackedSequences | PaddedRows:
    """How the torch backend feeds ``batch`` to a model of ``config``: its sequences packed back to back where
    the models allow it (``packing``, :func:`all_packable`) and it costs less (:func:`packing_pays`), else its
    padded rows. The choice is per micro-batch; the results are the same either way."""
    return PackedSequences(batch) if packing and packing_pays(batch, config) else PaddedRows(batch)
