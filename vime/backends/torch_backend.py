"""PyTorch training backend on a Hugging Face causal LM (CPU or a single device).

Sequences are right-padded into one [batch, tokens] tensor per micro-batch; losses are computed
on response tokens only (shifted by one: the logits at position t predict token t + 1).

With ``--advantage-estimator ppo`` the worker also trains a critic (:class:`ValueModel`: the policy's
transformer body with a one-output linear head) and the two take turns (:class:`ModelRole`): the
critic wakes to compute values and train, then sleeps while the actor trains.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import logging
import math
import os
import random
import time

import numpy as np
import torch

from vime.backends.activation_checkpointing import enable_full_recompute
from vime.backends.chunked_logits import chunked_forward
from vime.backends.data_parallel import DataParallel
from vime.backends.fsdp import Sharding, save_value_model
from vime.backends.lr_schedule import LRSchedule
from vime.backends.precision import MasterWeights, engine_dtype, master_weights
from vime.backends.micro_batches import BatchLayout, assign_to_ranks, dynamic_layout, fixed_layout, over_budget, regroup
from vime.config.base import ConfigError
from vime.config.framework import AlgorithmConfig
from vime.config.roles import FLAG as ROLES_FLAG
from vime.config.roles import RoleOverrides
from vime.rl.advantages import compute_advantages, ppo_advantages_and_returns, whiten_ragged
from vime.rl.kl import approx_kl
from vime.rl.losses import (
    cispo_loss, clipped_value_loss, gspo_loss, nll_loss, ppo_clip_loss, reduce_loss, reinforce_loss,
    sequence_log_ratio, token_entropy,
)
from vime.rl.offpolicy import onpolicy_loss_mask
from vime.rl.opd import opd_advantages
from vime.rl.score_centering import sampled_importance_weight, support_correction, topk_correction, weighting
from vime.rl.tis import load_tis_function
from vime.sample import Sample

logger = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True)
class TorchTrainerSpec:
    hf_checkpoint: str
    lr: float
    weight_decay: float
    adam_betas: tuple[float, float]
    adam_eps: float
    clip_grad: float
    micro_batch_size: int
    global_batch_size: int
    n_samples_per_prompt: int
    rollout_temperature: float
    algorithm: AlgorithmConfig
    seed: int
    threads: int | None = None
    cpu_affinity: list[int] | None = None   # CPU cores the trainer may use (None: any)
    # The command line's schedule (vime.backends.lr_schedule.lr_schedule_from_settings); None: constant --lr.
    lr_schedule: LRSchedule | None = None
    bf16: bool = False                       # --bf16: bf16 model, float32 master weights (docs/real-models.md)
    # The engines' --vllm-dtype (None or "auto": the checkpoint's torch_dtype): the dtype a --bf16 run publishes in.
    engine_dtype: str | None = None
    use_distributed_optimizer: bool = False  # --use-distributed-optimizer: FSDP2 over the ranks (torch backend)
    log_probs_chunk_size: int | None = None  # --log-probs-chunk-size: logits by chunks of N tokens (chunked_logits)
    recompute_granularity: str | None = None  # --recompute-granularity: 'full' checkpoints every decoder layer
    # Token budgets (vime.backends.micro_batches, docs/real-models.md): with use_dynamic_batch_size each step's
    # samples are packed into micro-batches of at most max_tokens_per_gpu tokens (not micro_batch_size samples).
    use_dynamic_batch_size: bool = False
    max_tokens_per_gpu: int | None = None
    log_probs_max_tokens_per_gpu: int | None = None  # the no-gradient forwards' budget (None: max_tokens_per_gpu)
    balance_data: bool = False  # --balance-data: data-parallel ranks get a step's micro-batches by token count


@dataclasses.dataclass
class PackedBatch:
    input_ids: torch.Tensor        # [B, T]
    attention_mask: torch.Tensor   # [B, T]
    targets: torch.Tensor          # [B, T-1] token predicted at each position
    response_mask: torch.Tensor    # [B, T-1] 1 where the target is a trained response token
    rollout_log_probs: torch.Tensor  # [B, T-1] sampler log-probs at the same places (0 elsewhere)
    starts: list[int] = dataclasses.field(default_factory=list)   # first response position of each row
    lengths: list[int] = dataclasses.field(default_factory=list)  # response length of each row
    # Score centering: the sampler's top-k heads, or its top-p supports right-padded to the widest.
    head_ids: torch.Tensor | None = None        # [B, T-1, k] sampler token ids
    head_log_probs: torch.Tensor | None = None  # [B, T-1, k] their sampler log-probs
    head_rows: torch.Tensor | None = None       # [B, T-1] True at trained tokens (where the correction applies)
    head_valid: torch.Tensor | None = None      # [B, T-1, k] top-p only: True on the support, False on padding
    teacher_log_probs: torch.Tensor | None = None  # [B, T-1] OPD teacher's log-probs of the targets

    def rows(self, values: torch.Tensor) -> list[torch.Tensor]:
        """The response part of each row of a [B, T-1] tensor (ragged, one tensor per sample)."""
        return [values[row, start:start + n] for row, (start, n) in enumerate(zip(self.starts, self.lengths))]

    def unrows(self, rows: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`rows`: place per-sample response values into the [B, T-1] layout (0 elsewhere)."""
        out = torch.zeros(self.targets.shape, dtype=rows[0].dtype if rows else torch.float32)
        for row, (start, values) in enumerate(zip(self.starts, rows)):
            out[row, start:start + values.numel()] = values
        return out


def pack(samples: list[Sample], pad_id: int, loss_masks: list[list[int]] | None = None,
         with_heads: bool = False, with_teacher: bool = False) -> PackedBatch:
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
        response_mask[row, start:start + sample.response_length] = torch.tensor(mask, dtype=torch.float32)
        if sample.rollout_log_probs is not None:
            rollout[row, start:start + sample.response_length] = torch.tensor(sample.rollout_log_probs)
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
        raise ValueError(f"--use-opd: sample {sample.index} of group {sample.group_index} has no teacher_log_probs; "
                         "the rollout side records them (e.g. --custom-rm-path vime.rollout.teacher.reward_func, "
                         "or vime.rollout.teacher.attach_teacher_log_probs in your reward function)")
    row = torch.as_tensor(np.asarray(values, dtype=np.float32)).reshape(-1)
    if row.numel() != sample.response_length:
        raise ValueError(f"sample {sample.index} of group {sample.group_index}: {row.numel()} teacher log-probs for "
                         f"{sample.response_length} response tokens")
    return row


def _pack_heads(packed: PackedBatch, samples: list[Sample]) -> None:
    kinds = {_capture_kind(sample) for sample in samples}
    if None in kinds:
        missing = next(sample for sample in samples if _capture_kind(sample) is None)
        raise ValueError(f"score centering needs the sampler's top-k heads or top-p supports: sample {missing.index} "
                         f"of group {missing.group_index} has neither (rollout_topk_token_ids / rollout_topp_ids)")
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
            raise ValueError(f"sample {sample.index} of group {sample.group_index}: top-k heads of shape "
                             f"{tuple(ids.shape)} / {tuple(log_probs.shape)}, expected [{sample.response_length}, k]")
        heads.append((ids, log_probs))
    k = {ids.shape[1] for ids, _ in heads}
    if len(k) != 1:
        raise ValueError(f"samples of one batch carry top-k heads of different sizes {sorted(k)}")
    shape = (*packed.targets.shape, k.pop())
    packed.head_ids = torch.zeros(shape, dtype=torch.long)
    packed.head_log_probs = torch.zeros(shape)
    for row, ((ids, log_probs), start, n) in enumerate(zip(heads, packed.starts, packed.lengths)):
        packed.head_ids[row, start:start + n] = ids
        packed.head_log_probs[row, start:start + n] = log_probs
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
        if (offsets.numel() != sample.response_length + 1 or offsets[0] != 0 or (lengths < 0).any()
                or offsets[-1] != ids.numel() or ids.numel() != log_probs.numel()):
            raise ValueError(f"{where}: top-p support offsets must rise from 0 to the {ids.numel()} support ids in "
                             f"{sample.response_length + 1} steps, with one log-prob per id")
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
        raise ValueError(f"sample {sample.index} of group {sample.group_index}: response token "
                         f"{position - packed.starts[row]} is trained but lies outside its recorded top-p support")


@dataclasses.dataclass
class Forward:
    log_probs: torch.Tensor                    # [B, T-1] of the target tokens
    entropy: torch.Tensor | None = None        # [B, T-1]
    head_log_probs: torch.Tensor | None = None  # [B, T-1, k] at the sampler's head ids


def _replay_support(batch: PackedBatch, out: Forward) -> Forward:
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


# Metrics reduced over the rollout's micro-batches (and ranks) by their maximum; the others by their mean.
MAX_METRICS = frozenset({"train_rollout_logprob_abs_diff_max"})


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    return float((values.detach() * mask).sum() / mask.sum().clamp(min=1))


def _relayout(values: list[torch.Tensor | None], source: list[PackedBatch], target: list[PackedBatch],
              source_ids: list[list[int]], target_ids: list[list[int]]) -> list[torch.Tensor | None]:
    """Per-micro-batch [B, T-1] values moved from the ``source`` micro-batches to the ``target`` ones (which
    hold the same samples, grouped differently). Only the response positions carry over (0 elsewhere): the
    loss reads nothing else."""
    if all(v is None for v in values):
        return [None] * len(target)
    rows = [batch.rows(v) for batch, v in zip(source, values)]
    return [batch.unrows(r) for batch, r in zip(target, regroup(rows, source_ids, target_ids))]


# ---------------------------------------------------------------------- PPO's critic
VALUE_HEAD_FILE = "value_head.safetensors"
CRITIC_OPTIMIZER_FILE = "optimizer.pt"
LATEST_FILE = "latest_checkpointed_iteration.txt"  # the layout of --save, for a critic's own save folder


def _load_body(path: str) -> torch.nn.Module:
    """The transformer body (no LM head) of the HF model at ``path``."""
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # a causal-LM folder has an lm_head the body does not use: expected
    try:
        return AutoModel.from_pretrained(path, dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)


class ValueModel(torch.nn.Module):
    """PPO's critic: a transformer body and a linear head with one output per position.

    **Decision** (as the reference framework, which swaps the policy's output layer for a one-output
    linear layer): the body starts from the policy's checkpoint (or the critic's ``load``), the head is
    ``torch.nn.Linear(hidden_size, 1)`` with PyTorch's default initialisation, seeded by --seed. Values
    are not scaled by the sampling temperature.
    """

    def __init__(self, body: torch.nn.Module):
        super().__init__()
        self.body = body
        self.value_head = torch.nn.Linear(body.config.hidden_size, 1)

    @classmethod
    def from_pretrained(cls, path: str) -> "ValueModel":
        return cls(_load_body(path))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        # The head in its own dtype (bf16 with --bf16), the values in float32: [B, T], the value of the prefix up to t.
        return self.value_head(hidden.to(self.value_head.weight.dtype)).float().squeeze(-1)

    def save(self, path: str) -> None:
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        self.body.save_pretrained(os.path.join(path, "model"), safe_serialization=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in self.value_head.state_dict().items()},
                  os.path.join(path, VALUE_HEAD_FILE))

    def load_head(self, path: str) -> None:
        from safetensors.torch import load_file

        self.value_head.load_state_dict(load_file(os.path.join(path, VALUE_HEAD_FILE)))

    def load_weights(self, path: str) -> None:
        """Body and head from a folder written by :meth:`save`."""
        self.body.load_state_dict(_load_body(os.path.join(path, "model")).state_dict())
        self.load_head(path)


def is_critic_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, VALUE_HEAD_FILE))


def resolve_critic_load(path: str, field: str, source: str | None) -> tuple[str, bool]:
    """(folder, is a critic checkpoint) for the critic's ``load``: a save folder (its latest iteration),
    one critic checkpoint, or an HF model folder (the body; the head starts fresh)."""
    if os.path.isfile(os.path.join(path, LATEST_FILE)):
        with open(os.path.join(path, LATEST_FILE)) as f:
            path = os.path.join(path, f"iter_{int(f.read().strip()):07d}")
    if is_critic_checkpoint(path):
        return path, True
    if os.path.isfile(os.path.join(path, "config.json")):
        return path, False
    raise ConfigError(ROLES_FLAG, f"{source or '<yaml>'}: {field}: {path!r} is neither a critic checkpoint "
                                  f"(model/ and {VALUE_HEAD_FILE}) nor an HF model folder (config.json)")


class ModelRole:
    """One trained model of the worker (the actor, or PPO's critic): module, optimizer, lifecycle.

    PPO's actor and critic share the training worker (the seeds: one placement group, train-side
    offload forced) and take turns: ``wake()`` before a role's work, ``sleep()`` after it.

    - On an accelerator, ``sleep`` moves the parameters and the optimizer's moment estimates to host
      memory and frees the cached device memory; ``wake`` moves them back. (Written for the device
      case but not exercised yet: this backend trains on CPU.)
    - On CPU there is nowhere to move them: ``sleep`` releases the gradients (``set_to_none``), which
      is what a sleeping role would otherwise hold beyond its weights and optimizer state.
    """

    def __init__(self, name: str, module: torch.nn.Module, optimizer: torch.optim.Optimizer, clip_grad: float,
                 schedule: LRSchedule, masters: MasterWeights | None = None):
        self.name, self.module, self.optimizer, self.clip_grad = name, module, optimizer, clip_grad
        self.schedule = schedule
        self.masters = masters   # --bf16 unsharded: the float32 copies the optimizer steps (vime/backends/precision.py)
        self.lr_key = "lr" if name == "actor" else f"{name}_lr"   # its key in train_rollout's metrics
        self.device = next(module.parameters()).device
        self.awake = True
        self.optimizer_steps = 0   # the schedule's position: checkpointed with the optimizer
        self._set_lr()

    def _set_lr(self) -> float:
        lr = self.schedule.lr_at(self.optimizer_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def step(self) -> float:
        """One optimizer step at the schedule's rate for it; returns that rate."""
        lr = self._set_lr()
        self.optimizer.step()
        if self.masters is not None:
            self.masters.refresh()   # the bf16 module follows its float32 masters
        self.optimizer_steps += 1
        self._set_lr()  # the next step's rate, as Megatron's scheduler leaves it: what hooks see before it
        return lr

    def restore_steps(self, saved: int | None) -> None:
        """After the optimizer's state was loaded: continue the schedule from ``saved`` steps. Checkpoints
        written before the count was saved fall back to AdamW's own step count."""
        if saved is None:
            steps = [float(s["step"]) for s in self.optimizer.state.values() if "step" in s]
            saved = int(max(steps, default=0.0))
        self.optimizer_steps = int(saved)
        self._set_lr()

    def parameters(self):
        """What the optimizer steps: the module's parameters, or with --bf16 their float32 masters (whose
        gradients are summed over the ranks and clipped)."""
        return iter(self.masters.params) if self.masters is not None else self.module.parameters()

    def weights_as(self, dtype: torch.dtype | None = None):
        """Context in which the module holds its float32 masters (cast to ``dtype``, float32 by default) for
        saving or loading; without masters the module as it is."""
        if self.masters is None:
            return contextlib.nullcontext(self.module)
        return self.masters.parameters_as(dtype or torch.float32)

    def sleep(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self.awake and self.device.type != "cpu":
            self._move(torch.device("cpu"))
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self.awake = False

    def wake(self) -> None:
        if not self.awake and self.device.type != "cpu":
            self._move(self.device)
        self.awake = True

    def _move(self, device: torch.device) -> None:
        self.module.to(device)  # in place: the optimizer keeps its parameter references
        if self.masters is not None:
            self.masters.to(device)
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:  # moments; Adam's scalar step stays put
                    state[key] = value.to(device)


def make_role(name: str, module: torch.nn.Module, spec: "TorchTrainerSpec", role: RoleOverrides,
              source: str | None) -> ModelRole:
    """A role with the command line's optimizer settings and schedule, overridden by the role's."""
    schedule = (spec.lr_schedule or LRSchedule(lr=spec.lr)).for_role(role, source)
    masters = master_weights(module, spec.bf16)   # --bf16: the module becomes bf16, AdamW steps float32 masters
    params = masters.params if masters is not None else module.parameters()
    return ModelRole(name, module, _optimizer(params, spec, role), role.get("clip_grad", spec.clip_grad), schedule,
                     masters=masters)


def _optimizer(params, spec: "TorchTrainerSpec", role: RoleOverrides) -> torch.optim.Optimizer:
    """AdamW over ``params`` with the command line's settings, overridden by the role's (--megatron-config-path)."""
    betas = (role.get("adam_beta1", spec.adam_betas[0]), role.get("adam_beta2", spec.adam_betas[1]))
    return torch.optim.AdamW(params, lr=role.get("lr", spec.lr), betas=betas,
                             eps=role.get("adam_eps", spec.adam_eps),
                             weight_decay=role.get("weight_decay", spec.weight_decay))


class TorchBackend:
    sharding: Sharding | None = None   # set in __init__ (a class default: MegatronBackend skips that __init__)

    def __init__(self, spec: TorchTrainerSpec):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a bar per weight publication would drown the progress lines
        self.spec = spec
        algo = spec.algorithm
        if spec.cpu_affinity:
            # Measured on 2 cores: a trainer sharing the engine's core slows both several-fold.
            os.sched_setaffinity(0, spec.cpu_affinity)
        if spec.threads:
            torch.set_num_threads(spec.threads)
        self._seed(spec.seed)
        # The trainer's ranks (TrainerWorker joins them before building the backend) are data-parallel.
        self.dp = DataParallel()
        # --use-distributed-optimizer: FSDP2 over those ranks (vime/backends/fsdp.py); None: replicas.
        self.sharding = Sharding(self.dp, bf16=spec.bf16) if spec.use_distributed_optimizer else None
        self.model = AutoModelForCausalLM.from_pretrained(spec.hf_checkpoint, dtype=torch.float32)
        self.model.train()
        if spec.recompute_granularity == "full":
            enable_full_recompute(self.model)
        if self.sharding is not None:
            self.sharding.shard(self.model)   # before the optimizer: it takes the sharded parameters
        self.tokenizer = AutoTokenizer.from_pretrained(spec.hf_checkpoint)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        roles = algo.role_config()
        actor = roles.role("actor")
        self.actor = make_role("actor", self.model, spec, actor, roles.source)
        self.optimizer = self.actor.optimizer
        # PPO's critic shares this worker; it is trained, saved and checkpointed with the actor.
        self.critic: ModelRole | None = None
        self.critic_save: str | None = None
        if algo.uses_critic:
            self.critic = self._build_critic(roles.role("critic"), roles.source)
        # Rollouts trained so far (checkpointed): --num-critic-only-steps counts them.
        self.rollouts_trained = 0
        # The reference model of the KL terms is frozen: it is never trained, saved or checkpointed.
        self.ref_model = None
        if algo.needs_reference_model:
            # With --bf16 the frozen reference is bf16 too: no masters needed, it never changes.
            self.ref_model = AutoModelForCausalLM.from_pretrained(
                algo.ref_load or spec.hf_checkpoint, dtype=torch.bfloat16 if spec.bf16 else torch.float32)
            self.ref_model.eval().requires_grad_(False)
            if self.sharding is not None:
                self.sharding.shard(self.ref_model)
        self.tis_function = load_tis_function(algo.custom_tis_function_path) if algo.use_tis else None
        # User TIS functions receive ``args`` like the reference framework's; here that is the algorithm's
        # flags plus the few others an importance weight may depend on.
        self.hook_args = argparse.Namespace(**dataclasses.asdict(algo), n_samples_per_prompt=spec.n_samples_per_prompt,
                                            rollout_temperature=spec.rollout_temperature,
                                            hf_checkpoint=spec.hf_checkpoint)
        self.sc_weighting = (weighting(algo.use_tis, algo.custom_tis_function_path, algo.tis_clip_low, algo.tis_clip)
                             if algo.use_score_centering else None)
        # --bf16: weights reach the engines from the float32 masters, cast to the engines' dtype.
        self.export_dtype = engine_dtype(spec.engine_dtype, spec.hf_checkpoint) if spec.bf16 else None

    def _build_critic(self, role: RoleOverrides, source: str | None) -> ModelRole:
        spec = self.spec
        if role.load is not None:
            folder, is_checkpoint = resolve_critic_load(role.load, role.field("load"), source)
            critic = ValueModel.from_pretrained(os.path.join(folder, "model") if is_checkpoint else folder)
            if is_checkpoint:
                critic.load_head(folder)  # weights only: the optimizer starts fresh with this run's settings
        else:
            critic = ValueModel.from_pretrained(spec.hf_checkpoint)
        critic.train()
        if spec.recompute_granularity == "full":
            enable_full_recompute(critic.body)
        if self.sharding is not None:
            self.sharding.shard(critic)
        self.critic_save = role.save
        return make_role("critic", critic, spec, role, source)

    @staticmethod
    def _seed(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)

    # ------------------------------------------------------------------ colocated memory (--offload-train)
    def offload(self) -> None:
        """Release the trainer's device memory while the engines generate: the actor's parameters and
        optimizer state move to host memory (on a CPU trainer only its gradients are freed), and so does
        the reference model."""
        self.actor.sleep()
        if self.ref_model is not None and self.actor.device.type != "cpu":
            self.ref_model.to("cpu")

    def reload(self) -> None:
        """Before training: back to the device :meth:`offload` moved from."""
        self.actor.wake()
        if self.ref_model is not None and self.actor.device.type != "cpu":
            self.ref_model.to(self.actor.device)

    # ------------------------------------------------------------------ forward
    def _forward(self, model, batch: PackedBatch, *, entropy: str | None = None,
                 heads: bool = False) -> Forward:
        """Log-probs of the targets under ``model`` at the sampling temperature.

        ``entropy``: None, 'metric' (computed without a graph) or 'loss' (differentiable).
        ``heads``: also the log-probs at the sampler's top-k head ids (score centering).
        """
        if self.spec.log_probs_chunk_size:
            # Same results, without the micro-batch's whole [tokens x vocab] logits (vime.backends.chunked_logits).
            inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
            chunked = chunked_forward(model, inputs, batch.targets, chunk_size=self.spec.log_probs_chunk_size,
                                      temperature=self.spec.rollout_temperature, entropy=entropy,
                                      head_ids=batch.head_ids if heads else None)
            return Forward(chunked.log_probs, chunked.entropy, chunked.head_log_probs)
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
        if self.spec.rollout_temperature > 0:
            logits = logits / self.spec.rollout_temperature
        log_softmax = torch.log_softmax(logits.float(), dim=-1)
        out = Forward(log_softmax.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1))
        if entropy == "loss":
            out.entropy = token_entropy(log_softmax)
        elif entropy == "metric":
            with torch.no_grad():
                out.entropy = token_entropy(log_softmax.detach())
        if heads:
            out.head_log_probs = log_softmax.gather(-1, batch.head_ids)
        return out

    def _log_probs(self, batch: PackedBatch) -> torch.Tensor:
        support = batch.head_valid is not None
        return _replay_support(batch, self._forward(self.model, batch, heads=support)).log_probs

    def _loss_masks(self, samples: list[Sample], policy_version: int | None) -> list[list[int]]:
        masks = [list(s.loss_mask) if s.loss_mask is not None else [1] * s.response_length for s in samples]
        if not self.spec.algorithm.mask_offpolicy_in_partial_rollout:
            return masks
        if policy_version is None:
            raise ValueError("--mask-offpolicy-in-partial-rollout needs the policy version being trained")
        return [onpolicy_loss_mask(mask, s.weight_versions, policy_version) for mask, s in zip(masks, samples)]

    # ------------------------------------------------------------------ micro-batches
    def _batch_layout(self, samples: list[Sample]) -> BatchLayout:
        """Which samples each micro-batch holds (vime.backends.micro_batches): --micro-batch-size samples, or
        with --use-dynamic-batch-size each step's samples packed by the token budgets."""
        spec = self.spec
        if not spec.use_dynamic_batch_size:
            return fixed_layout(len(samples), spec.micro_batch_size, spec.global_batch_size)
        lengths = [len(s.tokens) for s in samples]
        budget = self._micro_batch_tokens(spec.max_tokens_per_gpu)
        forward_budget = self._micro_batch_tokens(spec.log_probs_max_tokens_per_gpu or spec.max_tokens_per_gpu)
        longer = over_budget(lengths, budget)
        if longer:  # trained anyway (alone in its micro-batch): the budget is a packing target, not a cut
            logger.warning("%d sample(s) of this rollout are longer than --max-tokens-per-gpu %d (the longest: %d "
                           "tokens); each trains in a micro-batch of its own", len(longer), spec.max_tokens_per_gpu,
                           max(lengths[i] for i in longer))
        return dynamic_layout(lengths, spec.global_batch_size, budget, forward_budget)

    def _micro_batch_tokens(self, per_gpu: int) -> int:
        """A micro-batch's token budget from a per-GPU one (the Megatron backend: x its context-parallel ranks,
        which each hold a part of every sequence)."""
        return per_gpu

    def _training_batches(self, samples: list[Sample], loss_masks: list[list[int]], layout: BatchLayout,
                          forward: list[PackedBatch], per_forward: tuple) -> tuple[list[PackedBatch], list[list]]:
        """The training micro-batches of ``layout`` and, moved into them, the per-micro-batch [B, T-1] results of
        the no-gradient forwards (``per_forward``: lists over ``forward``, or lists of None)."""
        packed = [pack([samples[i] for i in ids], self.pad_id, [loss_masks[i] for i in ids],
                       with_heads=self.spec.algorithm.use_score_centering) for ids in layout.train]
        moved = [_relayout(values, forward, packed, layout.forward, layout.train) for values in per_forward]
        return packed, moved

    def _my_micro_batches(self, packed: list[PackedBatch], step: range) -> list[int]:
        """This data-parallel rank's micro-batches of one optimizer step: round-robin, or with --balance-data
        by token count (every rank computes the same assignment; one left without any still joins the sums)."""
        if not self.spec.balance_data or self.dp.size == 1:
            return self.dp.share(step)
        owners = assign_to_ranks([int(packed[i].attention_mask.sum()) for i in step], self.dp.size)
        return [i for i, owner in zip(step, owners) if owner == self.dp.rank]

    # ------------------------------------------------------------------ one rollout
    def train_rollout(self, samples: list[Sample], policy_version: int | None = None) -> dict[str, float]:
        """Advantages over the rollout, then one optimizer step per global batch.

        ``policy_version`` (the version of the weights being trained) lets the metrics compare the
        sampler's log-probs with the trainer's on the samples generated entirely by those weights:
        ``onpolicy_logprob_abs_diff`` is ~0 exactly when the engines serve what the trainer holds.
        It is also the version --mask-offpolicy-in-partial-rollout keeps.

        With PPO the critic computes the values, GAE the advantages and returns, the critic trains on
        the returns and then (after --num-critic-only-steps rollouts) the actor on the advantages.
        """
        started = time.perf_counter()
        algo = self.spec.algorithm
        if algo.use_tis or algo.use_rollout_logprobs or algo.use_score_centering:
            missing = next((s for s in samples if s.rollout_log_probs is None), None)
            if missing is not None:
                raise ValueError(f"sample {missing.index} of group {missing.group_index} has no rollout_log_probs, "
                                 "which --use-tis, --use-rollout-logprobs and --use-score-centering need")
        loss_masks = self._loss_masks(samples, policy_version)
        masked_offpolicy = sum(sum(s.loss_mask or [1] * s.response_length) - sum(m)
                               for s, m in zip(samples, loss_masks))
        layout = self._batch_layout(samples)
        micro_batches = [[samples[i] for i in ids] for ids in layout.train]
        # First the no-gradient forwards' micro-batches (rollout order: the advantages need it).
        packed = [pack([samples[i] for i in ids], self.pad_id, [loss_masks[i] for i in ids],
                       with_heads=algo.use_score_centering, with_teacher=algo.use_opd) for ids in layout.forward]
        metrics: dict[str, list[float]] = collections.defaultdict(list)
        # SFT needs none of these: no old policy, reference or advantages.
        old, ref, advantages = [None] * len(packed), [None] * len(packed), [None] * len(packed)
        values, returns = [None] * len(packed), [None] * len(packed)
        if algo.policy_loss != "sft":
            self.actor.wake()
            mine = [self.dp.owns(i) for i in range(len(packed))]
            with torch.no_grad():
                self.model.eval()
                if algo.use_rollout_logprobs:
                    old = [b.rollout_log_probs for b in packed]
                else:
                    old = self.dp.fill(self._in_lock_step(self.model, packed, [
                        self._log_probs(b) if m else None for b, m in zip(packed, mine)]))
                self.model.train()
                if self.ref_model is not None:
                    ref = self.dp.fill(self._in_lock_step(self.ref_model, packed, [
                        self._forward(self.ref_model, b).log_probs if m else None for b, m in zip(packed, mine)]))
            if self.critic is not None:
                self.actor.sleep()
                self.critic.wake()
                with torch.no_grad():
                    self.critic.module.eval()
                    values = self.dp.fill(self._in_lock_step(self.critic.module, packed, [
                        self._values(b) if m else None for b, m in zip(packed, mine)]))
                    self.critic.module.train()
            advantages, returns = self._advantages(samples, packed, old, ref, values, metrics)
        if layout.train != layout.forward:  # token budgets pack training apart from the forwards
            packed, (old, ref, values, advantages, returns) = self._training_batches(
                samples, loss_masks, layout, packed, (old, ref, values, advantages, returns))

        steps = layout.step_ranges()
        if self.critic is not None:
            self._optimizer_steps(
                self.critic, packed, steps, metrics, loss_key="value_loss", grad_key="critic_grad_norm",
                micro_loss=lambda i, totals, terms: self._value_loss(packed[i], values[i], returns[i], totals,
                                                                     metrics))
            self.critic.sleep()
        train_actor = self.critic is None or self.rollouts_trained >= algo.num_critic_only_steps
        self.actor.wake()
        if train_actor:
            on_policy = [torch.tensor([float(bool(s.weight_versions) and min(s.weight_versions) == policy_version
                                             == max(s.weight_versions)) for s in mb]).unsqueeze(1)
                         for mb in micro_batches]

            def actor_loss(i: int, totals: dict, step_terms: dict) -> torch.Tensor:
                loss, log_probs = self._micro_batch_loss(packed[i], old[i], ref[i], advantages[i], totals,
                                                         step_terms, metrics)
                self._logprob_metrics(packed[i], log_probs, on_policy[i], metrics)
                return loss

            self._optimizer_steps(self.actor, packed, steps, metrics, loss_key="loss", grad_key="grad_norm",
                                  micro_loss=actor_loss)
        self.rollouts_trained += 1
        metrics = self.dp.merge_metrics(metrics)
        elapsed = time.perf_counter() - started
        result = {k: float(np.max(v) if k in MAX_METRICS else np.mean(v)) for k, v in metrics.items() if v}
        result["train_tokens"] = float(sum(len(s.tokens) for s in samples))
        result["train_seconds"] = elapsed
        result["optimizer_steps"] = float(len(steps)) if train_actor else 0.0
        result["train_micro_batches"] = float(len(packed))
        result["train_max_micro_batch_tokens"] = float(max((sum(len(s.tokens) for s in mb) for mb in micro_batches),
                                                           default=0))
        if self.critic is not None:
            result["critic_only"] = float(not train_actor)
        if algo.mask_offpolicy_in_partial_rollout:
            result["offpolicy_masked_tokens"] = float(masked_offpolicy)
        return result

    def _optimizer_steps(self, role: ModelRole, packed: list[PackedBatch], step_ranges: list[range], metrics: dict,
                         *, loss_key: str, grad_key: str, micro_loss) -> None:
        """One optimizer step of ``role`` per range of micro-batches; ``micro_loss(i, totals, step_terms)``
        returns micro-batch i's share of the step loss (micro-batch losses add up to the step's). Data-parallel
        ranks each run their share of a step's micro-batches and add up their gradients."""
        for step_id, steps in enumerate(step_ranges):
            totals = {"num_samples": sum(packed[i].input_ids.shape[0] for i in steps),
                      "num_tokens": float(sum(packed[i].response_mask.sum() for i in steps))}
            self._before_step(role, step_id, len(steps))
            role.optimizer.zero_grad(set_to_none=True)
            # Loss terms are each micro-batch's share of the step's value: they add up over the step.
            step_terms: dict[str, float] = collections.defaultdict(float)
            for i in self._my_micro_batches(packed, steps):
                loss = micro_loss(i, totals, step_terms)
                loss.backward()
                step_terms[loss_key] += float(loss.detach())
            if self.sharding is not None:   # FSDP: every rank runs as many backwards as the busiest one
                for _ in range(self.sharding.passes_owed(steps)):
                    self.sharding.lockstep_backward(role.module, packed[steps[0]])
            step_terms = self.dp.sum_terms(step_terms)
            params = [p for p in role.parameters() if p.requires_grad]
            self._sum_gradients(params)
            grad_norm = self._finish_gradients(params, role.clip_grad)
            metrics[role.lr_key].append(role.step())
            for name, value in step_terms.items():
                metrics[name].append(value)
            metrics[grad_key].append(float(grad_norm))

    def _before_step(self, role: ModelRole, step_id: int, micro_batches: int) -> None:
        """Called before each optimizer step's micro-batches (the Megatron backend runs its hooks here)."""

    def _in_lock_step(self, module, packed: list[PackedBatch], values: list) -> list:
        """``values`` of a no-gradient pass over ``packed`` (this rank's computed, None elsewhere), after as
        many dropped forwards of ``module`` as this rank owes to keep FSDP's all-gathers in lock step."""
        if self.sharding is not None:
            for _ in range(self.sharding.passes_owed(range(len(packed)))):
                self.sharding.lockstep_forward(module, packed[0])
        return values

    def _sum_gradients(self, params: list[torch.Tensor]) -> None:
        """Add up the data-parallel replicas' gradients (FSDP has reduce-scattered them already)."""
        if self.sharding is None or not self.sharding.active:
            self.dp.sum_gradients(params)

    def _finish_gradients(self, params: list[torch.Tensor], clip_grad: float) -> torch.Tensor:
        """Clip the step's summed gradients by their global norm; returns the norm."""
        return torch.nn.utils.clip_grad_norm_(params, clip_grad if clip_grad > 0 else math.inf)

    def _values(self, batch: PackedBatch) -> torch.Tensor:
        """The critic's value of each target's prefix, [B, T-1] (aligned with the log-probs)."""
        return self.critic.module(batch.input_ids, batch.attention_mask)[:, :-1]

    def _value_loss(self, batch: PackedBatch, old_values: torch.Tensor, returns: torch.Tensor, totals: dict,
                    metrics: dict) -> torch.Tensor:
        """The micro-batch's share of the step's clipped value loss (reduced like the policy loss)."""
        algo = self.spec.algorithm
        mask = batch.response_mask
        per_token, clipped = clipped_value_loss(self._values(batch), old_values, returns, value_clip=algo.value_clip)
        metrics["value_clipfrac"].append(_masked_mean(clipped, mask))
        metrics["value_mean"].append(_masked_mean(old_values, mask))
        metrics["return_mean"].append(_masked_mean(returns, mask))
        return reduce_loss(per_token, mask, per_token_loss=algo.calculate_per_token_loss, **totals)

    def _advantages(self, samples: list[Sample], packed: list[PackedBatch], old: list[torch.Tensor],
                    ref: list[torch.Tensor | None], values: list[torch.Tensor | None],
                    metrics: dict) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Token advantages of the whole rollout (whitening and group baselines span micro-batches) and,
        with PPO, the critic's returns, both in each micro-batch's [B, T-1] layout."""
        algo = self.spec.algorithm
        if any(s.reward is None for s in samples):
            missing = next(s for s in samples if s.reward is None)
            raise ValueError(f"sample {missing.index} of group {missing.group_index} has no reward")
        masks = [row for b in packed for row in b.rows(b.response_mask)]
        kl = None
        if algo.kl_coef:
            # Reward shaping compares the policy that generated the batch (old log-probs) with the reference.
            kl = [row for b, o, r in zip(packed, old, ref) for row in b.rows(approx_kl(o, r, algo.kl_loss_type))]
        rewards = torch.tensor([float(s.reward) for s in samples])
        token_returns = None
        if algo.uses_critic:
            value_rows = [row for b, v in zip(packed, values) for row in b.rows(v)]
            token_advantages, token_returns = ppo_advantages_and_returns(
                rewards, value_rows, masks, kl=kl, kl_coef=algo.kl_coef, gamma=algo.gamma, lambd=algo.lambd)
        else:
            token_advantages = compute_advantages(
                algo.advantage_estimator, rewards, masks, group_size=self.spec.n_samples_per_prompt, kl=kl,
                kl_coef=algo.kl_coef, gamma=algo.gamma, lambd=algo.lambd,
                normalize_std=not algo.disable_grpo_std_normalization, normalize=False)
        if algo.use_opd:
            student = [row for b, o in zip(packed, old) for row in b.rows(o)]
            teacher = [row for b in packed for row in b.rows(b.teacher_log_probs)]
            token_advantages, reverse_kl = opd_advantages(token_advantages, student, teacher, masks,
                                                          kl_coef=algo.opd_kl_coef)
            flat_mask = torch.cat(masks) if masks else torch.zeros(0)
            metrics["opd_reverse_kl"].append(_masked_mean(torch.cat(reverse_kl) if reverse_kl else flat_mask,
                                                          flat_mask))
        if algo.normalize_advantages:
            token_advantages = whiten_ragged(token_advantages, masks)
        out, out_returns, first = [], [], 0
        for b in packed:
            out.append(b.unrows(token_advantages[first:first + len(b.starts)]))
            out_returns.append(None if token_returns is None else b.unrows(token_returns[first:first + len(b.starts)]))
            first += len(b.starts)
        return out, out_returns

    def _micro_batch_loss(self, batch: PackedBatch, old: torch.Tensor | None, ref: torch.Tensor | None,
                          advantages: torch.Tensor | None, totals: dict, step_terms: dict,
                          metrics: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch's share of the step loss (micro-batch losses add up to the step's), and its log-probs.

        Loss terms are added to ``step_terms`` (shares of the step's value), token averages to ``metrics``.
        """
        algo = self.spec.algorithm
        mask = batch.response_mask
        reduce = functools.partial(reduce_loss, per_token_loss=algo.calculate_per_token_loss, **totals)
        kind = algo.policy_loss
        out = self._forward(self.model, batch, entropy="loss" if algo.entropy_coef else "metric",
                            heads=algo.use_score_centering)
        out = _replay_support(batch, out)
        log_probs = out.log_probs
        if kind == "sft":
            loss = reduce(nll_loss(log_probs), mask)
            metrics["entropy"].append(_masked_mean(out.entropy, mask))
            return loss, log_probs

        if kind == "gspo":
            per_token, clipped = gspo_loss(log_probs, old, advantages, mask, eps_clip=algo.eps_clip,
                                           eps_clip_high=algo.eps_clip_high)
            ppo_kl = -sequence_log_ratio(log_probs.detach(), old, mask).expand_as(log_probs)
        else:
            if kind == "ppo":
                per_token, clipped = ppo_clip_loss(log_probs, old, advantages, eps_clip=algo.eps_clip,
                                                   eps_clip_high=algo.eps_clip_high, eps_clip_c=algo.eps_clip_c)
            elif kind == "cispo":
                per_token, clipped = cispo_loss(log_probs, old, advantages, eps_clip=algo.eps_clip,
                                                eps_clip_high=algo.eps_clip_high)
            else:
                per_token, clipped = reinforce_loss(log_probs, advantages), torch.zeros_like(log_probs)
            ppo_kl = old - log_probs.detach()
        if self.tis_function is not None:
            # REINFORCE has no old policy in its objective: its weight compares the current trainer (detached).
            trainer = log_probs.detach() if kind == "reinforce" else old
            per_token = self._apply_tis(batch, per_token, trainer, metrics)
        if algo.use_score_centering:
            per_token = per_token + advantages.detach() * self._score_centering(batch, out, log_probs, metrics)

        pg_loss = reduce(per_token, mask)
        entropy_loss = reduce(out.entropy, mask)
        loss = pg_loss - algo.entropy_coef * entropy_loss if algo.entropy_coef else pg_loss
        if ref is not None:
            kl = approx_kl(log_probs if algo.use_kl_loss else log_probs.detach(), ref, algo.kl_loss_type)
            if algo.use_kl_loss:
                kl_loss = reduce(kl, mask)
                step_terms["kl_loss"] += float(kl_loss.detach())
                if algo.kl_loss_coef:
                    loss = loss + algo.kl_loss_coef * kl_loss
            metrics["kl"].append(_masked_mean(kl, mask))
        step_terms["pg_loss"] += float(pg_loss.detach())
        metrics["entropy"].append(_masked_mean(out.entropy, mask))
        metrics["pg_clipfrac"].append(_masked_mean(clipped, mask))
        metrics["ppo_kl"].append(_masked_mean(ppo_kl, mask))
        return loss, log_probs

    def _apply_tis(self, batch: PackedBatch, per_token: torch.Tensor, trainer_log_probs: torch.Tensor,
                   metrics: dict) -> torch.Tensor:
        """Weight the per-token loss with the TIS function; tokens it rejects leave the numerator only."""
        masks = batch.rows(batch.response_mask)
        pg_loss, new_masks, tis_metrics = self.tis_function(
            self.hook_args, pg_loss=torch.cat(batch.rows(per_token)), train_log_probs=batch.rows(trainer_log_probs),
            rollout_log_probs=batch.rows(batch.rollout_log_probs), loss_masks=masks,
            total_lengths=[start + 1 + n for start, n in zip(batch.starts, batch.lengths)],
            response_lengths=list(batch.lengths))
        weighted = batch.unrows(list(pg_loss.split(batch.lengths)))
        if new_masks is not masks:
            weighted = weighted * batch.unrows([m.to(weighted.dtype) for m in new_masks])
        flat_mask = torch.cat(masks)
        for name, values in tis_metrics.items():
            metrics[name].append(_masked_mean(values, flat_mask))
        return weighted

    def _score_centering(self, batch: PackedBatch, out: Forward, log_probs: torch.Tensor,
                         metrics: dict) -> torch.Tensor:
        """Per-token centring correction ([B, T-1], differentiable) and its diagnostics."""
        rows = batch.head_rows
        if batch.head_valid is None:
            corr, sampler_mass, train_mass = topk_correction(out.head_log_probs[rows], batch.head_log_probs[rows],
                                                             **self.sc_weighting)
        else:
            valid = batch.head_valid[rows]
            offsets = torch.zeros(valid.shape[0] + 1, dtype=torch.long)
            torch.cumsum(valid.sum(-1), 0, out=offsets[1:])
            corr, sampler_mass, train_mass = support_correction(
                out.head_log_probs[rows][valid], batch.head_log_probs[rows][valid], offsets, **self.sc_weighting)
        correction = torch.zeros_like(log_probs).masked_scatter(rows, corr)
        mask = batch.response_mask
        for name, values in (("sc_correction", correction),
                             ("sc_sampler_head_mass", torch.zeros_like(mask).masked_scatter(rows, sampler_mass)),
                             ("sc_train_head_mass", torch.zeros_like(mask).masked_scatter(rows, train_mass)),
                             ("sc_importance_weight", sampled_importance_weight(
                                 log_probs, batch.rollout_log_probs, **self.sc_weighting))):
            metrics[name].append(_masked_mean(values, mask))
        return correction

    def _logprob_metrics(self, batch: PackedBatch, log_probs: torch.Tensor, on_policy: torch.Tensor,
                         metrics: dict) -> None:
        mask = batch.response_mask
        if batch.rollout_log_probs.abs().sum() > 0:
            diff = (batch.rollout_log_probs - log_probs.detach()).abs() * mask
            metrics["train_rollout_logprob_abs_diff"].append(float(diff.sum()) / float(mask.sum().clamp(min=1)))
            # The worst token (untrained positions are 0 in ``diff``): what bf16 costs shows here first.
            metrics["train_rollout_logprob_abs_diff_max"].append(float(diff.max()))
            on_mask = mask * on_policy
            if on_mask.sum() > 0:
                metrics["onpolicy_logprob_abs_diff"].append(float((diff * on_policy).sum() / on_mask.sum()))

    # ------------------------------------------------------------------ weights and checkpoints
    def _writes_files(self) -> bool:
        """Whether this rank writes weights and checkpoints (data-parallel replicas are identical: rank 0)."""
        return self.dp.rank == 0

    def export_peer(self) -> None:
        """What a rank that writes nothing takes part in while rank 0 exports the weights: nothing here
        (every data-parallel rank holds the whole model), the gather of the shards with FSDP."""
        if self.sharding is not None and self.sharding.active:
            self.sharding.full_state_dict(self.model)

    def _gathered(self) -> bool:
        """Whether the weights are FSDP shards, which every rank gathers for rank 0 to write."""
        return self.sharding is not None and self.sharding.active

    def save_hf(self, path: str) -> None:
        if self._gathered():
            self.sharding.save_pretrained(self.model, path, write=self._writes_files(), dtype=self.export_dtype)
            if self.critic is not None and self.critic_save:
                self._export_critic()
            if self._writes_files():
                self.tokenizer.save_pretrained(path)
            return
        if not self._writes_files():
            return
        with self.actor.weights_as(self.export_dtype):   # --bf16: the masters, in the engines' dtype
            self.model.save_pretrained(path, safe_serialization=True)
        self.tokenizer.save_pretrained(path)
        if self.critic is not None and self.critic_save:
            self._export_critic()  # the final critic too, where its role's `save` says

    def save_weights(self, path: str) -> None:
        """The inference weights only (what an engine reloads). With FSDP every rank calls it or
        :meth:`export_peer` at the same time (the gather); rank 0 writes."""
        if self._gathered():
            self.sharding.save_pretrained(self.model, path, write=self._writes_files(), dtype=self.export_dtype)
        elif self._writes_files():
            with self.actor.weights_as(self.export_dtype):   # --bf16: the masters, in the engines' dtype
                self.model.save_pretrained(path, safe_serialization=True)

    def hf_named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """What the engines load over NCCL, by HF name (a tied parameter once, under its first name); with
        --bf16 the float32 masters cast to the engines' dtype. With FSDP the gathered parameters: every rank
        calls it or :meth:`export_peer` at once, rank 0 gets them."""
        if self._gathered():
            return self.sharding.named_weights(self.model, self.export_dtype)
        if self.actor.masters is None:
            return list(self.model.named_parameters())
        return self.actor.masters.named_tensors(self.export_dtype)

    def save_training_state(self, path: str) -> None:
        """Actor (model, optimizer), RNG, the rollout count and, with PPO, the critic (``critic/``).
        With --use-distributed-optimizer: the sharded format of vime/backends/fsdp.py, every rank writing."""
        if self.sharding is not None:
            self.sharding.save_checkpoint(path, self._trained_roles(), self._counters(), write=self._writes_files())
            if self.critic is not None and self.critic_save:
                self._export_critic()
            return
        if not self._writes_files():
            return
        os.makedirs(path, exist_ok=True)
        with self.actor.weights_as():   # --bf16: the float32 masters, so that a resume is exact
            self.model.save_pretrained(os.path.join(path, "model"), safe_serialization=True)
        torch.save({"optimizer": self.optimizer.state_dict(),
                    "rng": {"python": random.getstate(), "numpy": np.random.get_state(),
                            "torch": torch.get_rng_state()},
                    "rollouts_trained": self.rollouts_trained,
                    # The schedules' positions (a role may step several times per rollout, or not at all).
                    "optimizer_steps": {role.name: role.optimizer_steps for role in (self.actor, self.critic)
                                        if role is not None}},
                   os.path.join(path, "optimizer_and_rng.pt"))
        if self.critic is not None:
            self._save_critic(os.path.join(path, "critic"))
            if self.critic_save:
                self._export_critic()

    def _save_critic(self, path: str, gathered: dict | None = None) -> None:
        if gathered is not None:  # FSDP: the critic's gathered weights (its optimizer is in the sharded checkpoint)
            save_value_model(self.critic.module, gathered, path)
            return
        with self.critic.weights_as():   # --bf16: the float32 masters
            self.critic.module.save(path)
        torch.save(self.critic.optimizer.state_dict(), os.path.join(path, CRITIC_OPTIMIZER_FILE))

    def _export_critic(self) -> None:
        """A copy of the critic in its role's ``save`` folder: ``iter_{rollouts:07d}/`` (written under a
        temporary name, then renamed) and ``latest_checkpointed_iteration.txt``; a later run's critic
        ``load`` accepts the folder."""
        import shutil
        import uuid

        gathered = self.sharding.full_state_dict(self.critic.module) if self._gathered() else None  # every rank
        if not self._writes_files():
            return
        root = self.critic_save
        os.makedirs(root, exist_ok=True)
        final = os.path.join(root, f"iter_{self.rollouts_trained:07d}")
        staging = os.path.join(root, f".iter_{self.rollouts_trained:07d}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            self._save_critic(staging, gathered)
            if os.path.exists(final):
                shutil.rmtree(final)
            os.rename(staging, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        latest = os.path.join(root, LATEST_FILE)
        with open(latest + ".tmp", "w") as f:
            f.write(str(self.rollouts_trained))
        os.replace(latest + ".tmp", latest)

    def _trained_roles(self) -> list[ModelRole]:
        return [role for role in (self.actor, self.critic) if role is not None]

    def _counters(self) -> dict:
        """The rollout count and the schedules' positions (a role may step several times per rollout, or not
        at all), as the sharded checkpoint keeps them."""
        return {"rollouts_trained": self.rollouts_trained,
                "optimizer_steps": {role.name: role.optimizer_steps for role in self._trained_roles()}}

    def load_training_state(self, path: str) -> None:
        from transformers import AutoModelForCausalLM

        if self.sharding is not None:
            saved = self.sharding.load_checkpoint(path, self._trained_roles())
            self.rollouts_trained = int(saved["rollouts_trained"])
            for role in self._trained_roles():
                role.restore_steps(saved["optimizer_steps"].get(role.name))
            return
        saved = AutoModelForCausalLM.from_pretrained(os.path.join(path, "model"), dtype=torch.float32)
        with self.actor.weights_as():   # --bf16: into the float32 masters (the bf16 copy is refreshed from them)
            self.model.load_state_dict(saved.state_dict())
        state = torch.load(os.path.join(path, "optimizer_and_rng.pt"), weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        torch.set_rng_state(state["rng"]["torch"])
        self.rollouts_trained = int(state.get("rollouts_trained", 0))
        steps = state.get("optimizer_steps", {})
        self.actor.restore_steps(steps.get("actor"))
        if self.critic is not None:
            critic = os.path.join(path, "critic")
            if not is_critic_checkpoint(critic):
                raise ValueError(f"{path} holds no critic state (it was saved by a run without "
                                 "--advantage-estimator ppo); a PPO run cannot resume from it")
            with self.critic.weights_as():
                self.critic.module.load_weights(critic)
            self.critic.optimizer.load_state_dict(
                torch.load(os.path.join(critic, CRITIC_OPTIMIZER_FILE), weights_only=False))
            self.critic.restore_steps(steps.get("critic"))
