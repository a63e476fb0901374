"""The trainer's batch: samples right-padded into [rows, tokens] tensors, and what a forward pass returns.

Every backend trains on :class:`PackedBatch` (the Megatron backend re-packs it for its own attention
layouts) and hands the RL objective (:mod:`vime.rl.objective`) a :class:`Forward`; neither knows the model.
Losses are computed on response tokens only, shifted by one: the logits at position t predict token t + 1.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from vime.sample import Sample


@dataclasses.dataclass
class PackedBatch:
    """One micro-batch, right-padded: [B, T] inputs, and [B, T-1] per-target values aligned with the logits."""

    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    targets: torch.Tensor  # [B, T-1] token predicted at each position
    response_mask: torch.Tensor  # [B, T-1] 1 where the target is a trained response token
    rollout_log_probs: torch.Tensor  # [B, T-1] sampler log-probs at the same places (0 elsewhere)
    starts: list[int] = dataclasses.field(default_factory=list)  # first response position of each row
    lengths: list[int] = dataclasses.field(default_factory=list)  # response length of each row
    # Score centering: the sampler's top-k heads, or its top-p supports right-padded to the widest.
    head_ids: torch.Tensor | None = None  # [B, T-1, k] sampler token ids
    head_log_probs: torch.Tensor | None = None  # [B, T-1, k] their sampler log-probs
    head_rows: torch.Tensor | None = None  # [B, T-1] True at trained tokens (where the correction applies)
    head_valid: torch.Tensor | None = None  # [B, T-1, k] top-p only: True on the support, False on padding
    teacher_log_probs: torch.Tensor | None = None  # [B, T-1] OPD teacher's log-probs of the targets

    def to(self, device: torch.device) -> PackedBatch:
        """This batch with its tensors on ``device`` (itself where they are there already: the CPU case)."""
        if self.input_ids.device == device:
            return self
        moved = {
            field.name: value.to(device)
            for field in dataclasses.fields(self)
            if isinstance(value := getattr(self, field.name), torch.Tensor)
        }
        return dataclasses.replace(self, **moved)

    def on_targets(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` [B, T-1] with 0 where a position predicts no token (padding, each row's last position).
        Nothing trained reads those; zeroing them makes a backend's values the same whether its model ran the
        rows padded or packed back to back (vime/backends/sequence_packing.py), and the same on every backend."""
        return values.masked_fill(self.attention_mask[:, 1:] == 0, 0)

    def rows(self, values: torch.Tensor) -> list[torch.Tensor]:
        """The response part of each row of a [B, T-1] tensor (ragged, one tensor per sample)."""
        return [values[row, start : start + n] for row, (start, n) in enumerate(zip(self.starts, self.lengths))]

    def unrows(self, rows: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`rows`: place per-sample response values into the [B, T-1] layout (0 elsewhere)."""
        out = torch.zeros(self.targets.shape, dtype=rows[0].dtype if rows else torch.float32)
        for row, (start, values) in enumerate(zip(self.starts, rows)):
            out[row, start : start + values.numel()] = values
        return out


def pack(
    samples: list[Sample],
    pad_id: int,
    loss_masks: list[list[int]] | None = None,
    with_heads: bool = False,
    with_teacher: bool = False,
) -> PackedBatch:
    """Right-pad ``samples`` into one batch. ``loss_masks`` overrides the samples' own masks;
    ``with_heads`` also packs the sampler's top-k heads or top-p supports (score centering),
    ``with_teacher`` the teacher's log-probs (on-policy distillation)."""
    length = max(len(s.tokens) for s in samples)
    batch = len(samples)
    input_ids = torch.full((batch, length), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, length), dtype=torch.long)
    response_mask = torch.zeros((batch, length - 1))
    rollout = torch.zeros((batch, length - 1))
    starts, lengths = [], []
    for row, sample in enumerate(samples):
        n = len(sample.tokens)
        input_ids[row, :n] = torch.tensor(sample.tokens)
        attention[row, :n] = 1
        start = sample.prompt_length - 1
        if loss_masks is not None:
            mask = loss_masks[row]
        else:
            mask = sample.loss_mask if sample.loss_mask is not None else [1] * sample.response_length
        response_mask[row, start : start + sample.response_length] = torch.tensor(mask, dtype=torch.float32)
        if sample.rollout_log_probs is not None:
            rollout[row, start : start + sample.response_length] = torch.tensor(sample.rollout_log_probs)
        starts.append(start)
        lengths.append(sample.response_length)
    packed = PackedBatch(input_ids, attention, input_ids[:, 1:], response_mask, rollout, starts, lengths)
    if with_heads:
        _pack_heads(packed, samples)
    if with_teacher:
        packed.teacher_log_probs = packed.unrows([_teacher_row(s) for s in samples])
    return packed


def _teacher_row(sample: Sample) -> torch.Tensor:
    values = sample.teacher_log_probs
    if values is None:
        raise ValueError(
            f"--use-opd: sample {sample.index} of group {sample.group_index} has no teacher_log_probs; "
            "the rollout side records them (e.g. --custom-rm-path vime.rollout.teacher.reward_func, "
            "or vime.rollout.teacher.attach_teacher_log_probs in your reward function)"
        )
    row = torch.as_tensor(np.asarray(values, dtype=np.float32)).reshape(-1)
    if row.numel() != sample.response_length:
        raise ValueError(
            f"sample {sample.index} of group {sample.group_index}: {row.numel()} teacher log-probs for "
            f"{sample.response_length} response tokens"
        )
    return row


def _pack_heads(packed: PackedBatch, samples: list[Sample]) -> None:
    kinds = {_capture_kind(sample) for sample in samples}
    if None in kinds:
        missing = next(sample for sample in samples if _capture_kind(sample) is None)
        raise ValueError(
            f"score centering needs the sampler's top-k heads or top-p supports: sample {missing.index} "
            f"of group {missing.group_index} has neither (rollout_topk_token_ids / rollout_topp_ids)"
        )
    if kinds == {"support"}:
        _pack_supports(packed, samples)
    elif kinds == {"topk"}:
        _pack_topk(packed, samples)
    else:
        raise ValueError("samples of one batch carry both top-k heads and top-p supports")


def _capture_kind(sample: Sample) -> str | None:
    if sample.rollout_topp_offsets is not None:
        return "support"
    if sample.rollout_topk_token_ids is not None and sample.rollout_topk_log_probs is not None:
        return "topk"
    return None


def _pack_topk(packed: PackedBatch, samples: list[Sample]) -> None:
    heads = []
    for sample in samples:
        ids = torch.as_tensor(np.asarray(sample.rollout_topk_token_ids), dtype=torch.long)
        log_probs = torch.as_tensor(np.asarray(sample.rollout_topk_log_probs), dtype=torch.float32)
        if ids.dim() != 2 or ids.shape != log_probs.shape or ids.shape[0] != sample.response_length:
            raise ValueError(
                f"sample {sample.index} of group {sample.group_index}: top-k heads of shape "
                f"{tuple(ids.shape)} / {tuple(log_probs.shape)}, expected [{sample.response_length}, k]"
            )
        heads.append((ids, log_probs))
    k = {ids.shape[1] for ids, _ in heads}
    if len(k) != 1:
        raise ValueError(f"samples of one batch carry top-k heads of different sizes {sorted(k)}")
    shape = (*packed.targets.shape, k.pop())
    packed.head_ids = torch.zeros(shape, dtype=torch.long)
    packed.head_log_probs = torch.zeros(shape)
    for row, ((ids, log_probs), start, n) in enumerate(zip(heads, packed.starts, packed.lengths)):
        packed.head_ids[row, start : start + n] = ids
        packed.head_log_probs[row, start : start + n] = log_probs
    # Untrained tokens (tool output, off-policy masking) have no head worth centring: their rows may be empty.
    packed.head_rows = packed.response_mask > 0


def _pack_supports(packed: PackedBatch, samples: list[Sample]) -> None:
    supports = []
    for sample in samples:
        where = f"sample {sample.index} of group {sample.group_index}"
        ids = torch.as_tensor(np.asarray(sample.rollout_topp_ids), dtype=torch.long).reshape(-1)
        log_probs = torch.as_tensor(np.asarray(sample.rollout_topp_log_probs), dtype=torch.float32).reshape(-1)
        offsets = torch.as_tensor(np.asarray(sample.rollout_topp_offsets), dtype=torch.long).reshape(-1)
        lengths = offsets[1:] - offsets[:-1]
        if (
            offsets.numel() != sample.response_length + 1
            or offsets[0] != 0
            or (lengths < 0).any()
            or offsets[-1] != ids.numel()
            or ids.numel() != log_probs.numel()
        ):
            raise ValueError(
                f"{where}: top-p support offsets must rise from 0 to the {ids.numel()} support ids in "
                f"{sample.response_length + 1} steps, with one log-prob per id"
            )
        supports.append((ids, log_probs, offsets, lengths))
    width = max([1] + [int(lengths.max()) for *_, lengths in supports if lengths.numel()])
    shape = (*packed.targets.shape, width)
    packed.head_ids = torch.zeros(shape, dtype=torch.long)
    packed.head_log_probs = torch.zeros(shape)
    packed.head_valid = torch.zeros(shape, dtype=torch.bool)
    for row, ((ids, log_probs, offsets, lengths), start) in enumerate(zip(supports, packed.starts)):
        token = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        column = torch.arange(ids.numel()) - offsets[token]
        packed.head_ids[row, start + token, column] = ids
        packed.head_log_probs[row, start + token, column] = log_probs
        packed.head_valid[row, start + token, column] = True
    packed.head_rows = packed.response_mask > 0
    # Replay normalises the trainer on the recorded support, so a trained token must lie in its own.
    covered = ((packed.head_ids == packed.targets.unsqueeze(-1)) & packed.head_valid).any(-1)
    uncovered = packed.head_rows & ~covered
    if uncovered.any():
        row, position = (int(i) for i in uncovered.nonzero()[0])
        sample = samples[row]
        raise ValueError(
            f"sample {sample.index} of group {sample.group_index}: response token "
            f"{position - packed.starts[row]} is trained but lies outside its recorded top-p support"
        )


@dataclasses.dataclass
class Forward:
    """What a backend's forward pass over a :class:`PackedBatch` returns, at the sampling temperature."""

    log_probs: torch.Tensor  # [B, T-1] of the target tokens
    entropy: torch.Tensor | None = None  # [B, T-1]
    head_log_probs: torch.Tensor | None = None  # [B, T-1, k] at the sampler's head ids

    def to(self, device: torch.device) -> Forward:
        """The same results on ``device``; differentiable (the gradients flow back to where they were computed)."""
        return Forward(
            *(None if t is None else t.to(device) for t in (self.log_probs, self.entropy, self.head_log_probs))
        )


def replay_support(batch: PackedBatch, out: Forward) -> Forward:
    """Top-p replay: at every trained token, the trainer's log-probs (of the sampled token and of the
    support) normalised on the sampler's recorded support, as the sampler's are; unchanged without
    supports. The policy trained is then the truncated one the sampler drew from."""
    if batch.head_valid is None:
        return out
    rows = batch.head_rows
    # Rows without a correction keep one (finite) entry, so that no logsumexp is -inf: its gradient
    # would be NaN even where torch.where discards the value.
    first = torch.zeros_like(batch.head_valid)
    first[..., 0] = True
    keep = batch.head_valid | (first & ~rows.unsqueeze(-1))
    on_support = out.head_log_probs.masked_fill(~keep, float("-inf"))
    log_mass = torch.where(rows, torch.logsumexp(on_support, -1), torch.zeros((), dtype=on_support.dtype))
    return Forward(out.log_probs - log_mass, out.entropy, on_support - log_mass.unsqueeze(-1))


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    """The mean of ``values`` over the positions where ``mask`` is set (0 where none is), as a float."""
    return float((values.detach() * mask).sum() / mask.sum().clamp(min=1))
