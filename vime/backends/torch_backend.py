"""PyTorch training backend on a Hugging Face causal LM, on the rank's GPU where it has one, else on the CPU.

The backend owns the models (their precision, FSDP2 sharding, files); the RL objective is
:class:`vime.rl.objective.RLObjective` and the loop over a rollout
:class:`vime.backends.rollout_training.RolloutTraining`, which runs it through this backend's model ops
(:class:`vime.backends.protocol.TrainerBackend`). The objective reads each micro-batch right-padded
(:func:`vime.rl.batch.pack`); the model runs on its sequences packed back to back, without padding
(:mod:`vime.backends.sequence_packing`), unless the model cannot be packed safely.

With ``--advantage-estimator ppo`` the worker also trains a critic (``ValueModel`` in
:mod:`vime.backends.value_model`: the policy's transformer body with a one-output linear head) and the
two take turns (:class:`ModelRole`): the critic wakes to compute values and train, then sleeps while the
actor trains.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch

from vime.backends.activation_checkpointing import enable_full_recompute
from vime.backends.adamw_state_dtype import STATE_DTYPES, AdamWWithStateDtype
from vime.backends.chunked_logits import chunked_forward
from vime.backends.data_parallel import DataParallel
from vime.backends.fsdp import Sharding, save_value_model
from vime.backends.lr_schedule import LRSchedule
from vime.backends.precision import MasterWeights, engine_dtype, master_weights
from vime.backends.random_state import restore_rng_state, rng_state
from vime.backends.rollout_training import RolloutTraining, seed_everything, use_deterministic_algorithms
from vime.backends.sequence_packing import all_packable, forward_layout, packed_leak
from vime.backends.trainer_spec import TorchTrainerSpec
from vime.backends.value_model import (
    CRITIC_OPTIMIZER_FILE,
    LATEST_FILE,
    ValueModel,
    is_critic_checkpoint,
    resolve_critic_load,
)
from vime.config.roles import RoleOverrides

# The batch and the forward's result live with the objective (vime/rl/); imported here under their old
# names too, for callers that still take them from the torch backend.
from vime.rl.batch import Forward, PackedBatch, pack  # noqa: F401
from vime.rl.losses import token_entropy
from vime.rl.objective import MAX_METRICS, RLObjective  # noqa: F401


def initial_weights(spec: TorchTrainerSpec) -> str:
    """The HF folder the actor starts from (a checkpoint resumed loads over it): --ref-load when given, as the
    seeds say (the actor is initialised from --ref-load when --load holds no checkpoint), else --hf-checkpoint.
    A Megatron --ref-load reaches the torch trainer converted (vime.backends.ref_load_conversion)."""
    return spec.algorithm.ref_load or spec.hf_checkpoint


def training_device(requested: str | None) -> torch.device:
    """The device a rank trains on (``TorchTrainerSpec.device``); "cuda" is the rank's current CUDA device, the
    one TrainerWorker.join selected for it."""
    if requested is None:
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("the torch backend was asked to train on CUDA, but this process sees no CUDA GPU")
        return torch.device("cuda", torch.cuda.current_device())
    if requested != "cpu":
        raise ValueError(f"the torch backend trains on 'cpu' or 'cuda', not {requested!r}")
    return torch.device("cpu")


class ModelRole:
    """One trained model of the worker (the actor, or PPO's critic): module, optimizer, lifecycle.

    PPO's actor and critic share the training worker (the seeds: one placement group, train-side
    offload forced) and take turns: ``wake()`` before a role's work, ``sleep()`` after it.

    - On an accelerator, ``sleep`` moves the parameters and the optimizer's moment estimates to host
      memory and frees the cached device memory; ``wake`` moves them back (tests/gpu/check_torch_cuda.py).
    - On CPU there is nowhere to move them: ``sleep`` releases the gradients (``set_to_none``), which
      is what a sleeping role would otherwise hold beyond its weights and optimizer state.
    """

    def __init__(
        self,
        name: str,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        clip_grad: float,
        schedule: LRSchedule,
        masters: MasterWeights | None = None,
    ):
        self.name, self.module, self.optimizer, self.clip_grad = name, module, optimizer, clip_grad
        self.schedule = schedule
        self.masters = masters  # --bf16 unsharded: the float32 copies the optimizer steps (vime/backends/precision.py)
        self.lr_key = "lr" if name == "actor" else f"{name}_lr"  # its key in train_rollout's metrics
        self.device = next(module.parameters()).device
        self.awake = True
        self.optimizer_steps = 0  # the schedule's position: checkpointed with the optimizer
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
            self.masters.refresh()  # the bf16 module follows its float32 masters
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

    @contextlib.contextmanager
    def whole_state(self, access=None):
        """Context in which the module holds its float32 weights and the yielded optimizer their whole state:
        what a checkpoint saves or loads (``access``, a ``sharded_optimizer.StateAccess``, matters only to the
        sharded role, which gathers them)."""
        with self.weights_as():
            yield self.optimizer

    def gradient_holders(self) -> dict[int, torch.Tensor]:
        """id of each module parameter -> the tensor whose gradient the reductions receive in its place, where
        that is another tensor (--bf16: its float32 master)."""
        if self.masters is None:
            return {}
        return dict(zip(map(id, self.masters.model_params), self.masters.params))

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


def make_role(
    name: str, module: torch.nn.Module, spec: TorchTrainerSpec, role: RoleOverrides, source: str | None
) -> ModelRole:
    """A role with the command line's optimizer settings and schedule, overridden by the role's."""
    schedule = (spec.lr_schedule or LRSchedule(lr=spec.lr)).for_role(role, source)
    masters = master_weights(module, spec.bf16)  # --bf16: the module becomes bf16, AdamW steps float32 masters
    params = masters.params if masters is not None else module.parameters()
    return ModelRole(
        name,
        module,
        make_optimizer(params, spec, role),
        role.get("clip_grad", spec.clip_grad),
        schedule,
        masters=masters,
    )


def make_optimizer(params, spec: TorchTrainerSpec, role: RoleOverrides) -> torch.optim.Optimizer:
    """--optimizer over ``params`` with the command line's settings, overridden by the role's
    (--megatron-config-path). As Megatron-LM's: adam is Adam with decoupled weight decay (AdamW), sgd is SGD
    with momentum --sgd-momentum and weight decay as an L2 term."""
    lr, weight_decay = role.get("lr", spec.lr), role.get("weight_decay", spec.weight_decay)
    if spec.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=spec.sgd_momentum, weight_decay=weight_decay)
    if spec.optimizer != "adam":
        raise ValueError(f"--optimizer {spec.optimizer!r}: vime has adam and sgd")
    betas = (role.get("adam_beta1", spec.adam_betas[0]), role.get("adam_beta2", spec.adam_betas[1]))
    eps = role.get("adam_eps", spec.adam_eps)
    if (spec.exp_avg_dtype, spec.exp_avg_sq_dtype) != ("fp32", "fp32"):
        return AdamWWithStateDtype(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            exp_avg_dtype=STATE_DTYPES[spec.exp_avg_dtype],
            exp_avg_sq_dtype=STATE_DTYPES[spec.exp_avg_sq_dtype],
        )
    params = list(params)
    return torch.optim.AdamW(
        params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused_adamw_applies(params)
    )


def fused_adamw_applies(params: list[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW steps ``params``: one kernel over every tensor, on the CPU and on CUDA. It takes
    the default (for-each) implementation's steps within float32 rounding (2.4e-7 apart after five steps, measured)
    without the for-each's temporaries, a float32 copy of the moments (4 bytes per parameter at the step's peak),
    and was 4x faster on this machine's CPU (a 50M-parameter step, 0.07 s against 0.29 s)."""
    return bool(params) and all(t.device.type in ("cpu", "cuda") and t.dtype.is_floating_point for t in params)


def make_objective(spec: TorchTrainerSpec) -> RLObjective:
    """The RL objective of a trainer spec (both backends train it)."""
    return RLObjective(
        spec.algorithm,
        n_samples_per_prompt=spec.n_samples_per_prompt,
        rollout_temperature=spec.rollout_temperature,
        hf_checkpoint=spec.hf_checkpoint,
        hooks=spec.hooks,
        custom_config=spec.custom_config,
    )


class TorchBackend(RolloutTraining):
    """The model side of training on an HF causal LM: forward passes, gradient reductions, weights and
    checkpoints (vime.backends.protocol.TrainerBackend); the loop and the objective are inherited."""

    sharding: Sharding | None

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
        seed_everything(spec.seed)
        if spec.deterministic_mode:
            use_deterministic_algorithms()
        # The trainer's ranks (TrainerWorker joins them before building the backend) are data-parallel.
        self.dp = DataParallel()
        # --use-distributed-optimizer: FSDP2 over those ranks (vime/backends/fsdp.py); None: replicas.
        self.sharding = Sharding(self.dp, bf16=spec.bf16) if spec.use_distributed_optimizer else None
        self.device = training_device(spec.device)
        self.model = AutoModelForCausalLM.from_pretrained(initial_weights(spec), dtype=torch.float32).to(self.device)
        self.model.train()
        # Whether packed sequences stay apart in this model class: measured on the whole model, before sharding.
        packing_leak = packed_leak(self.model)
        if spec.recompute_granularity == "full":
            enable_full_recompute(self.model)
        if self.sharding is not None:
            self.sharding.shard(self.model)  # before the optimizer: it takes the sharded parameters
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
                initial_weights(spec), dtype=torch.bfloat16 if spec.bf16 else torch.float32
            ).to(self.device)
            self.ref_model.eval().requires_grad_(False)
            if self.sharding is not None:
                self.sharding.shard(self.ref_model)
        self.objective = make_objective(spec)
        # Micro-batches run packed back to back (no padding) where every model can take them.
        self.packing = all_packable([self.model, self.ref_model, self.critic and self.critic.module.body], packing_leak)
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
            critic = ValueModel.from_pretrained(initial_weights(spec))  # the body of the actor's first weights
        critic.to(self.device).train()
        if spec.recompute_granularity == "full":
            enable_full_recompute(critic.body)
        if self.sharding is not None:
            self.sharding.shard(critic)
        self.critic_save = role.save
        return make_role("critic", critic, spec, role, source)

    # ------------------------------------------------------------------ model ops (vime.backends.protocol)
    def forward(self, model, batch: PackedBatch, *, entropy: str | None = None, heads: bool = False) -> Forward:
        """Log-probs of the targets under ``model`` at the sampling temperature, in ``batch``'s padded layout.

        ``entropy``: None, 'metric' (computed without a graph) or 'loss' (differentiable).
        ``heads``: also the log-probs at the sampler's top-k head ids (score centering).

        The model runs on the training device; the results come back to the CPU, where the objective reads them
        beside the batch's own tensors (a differentiable copy: the gradients flow back to the device).
        """
        return self._forward_on_device(model, batch.to(self.device), entropy=entropy, heads=heads).to(
            batch.targets.device
        )

    def _forward_on_device(self, model, batch: PackedBatch, *, entropy: str | None, heads: bool) -> Forward:
        layout = forward_layout(batch, self.packing, self.model.config)
        targets = layout.gather(batch.targets)
        head_ids = layout.gather(batch.head_ids) if heads else None
        if self.spec.log_probs_chunk_size:
            # Same results, without the micro-batch's whole [tokens x vocab] logits (vime.backends.chunked_logits).
            chunked = chunked_forward(
                model,
                layout.model_inputs(),
                targets,
                chunk_size=self.spec.log_probs_chunk_size,
                temperature=self.spec.rollout_temperature,
                entropy=entropy,
                head_ids=head_ids,
                predicting=layout.predicting,
            )
            return Forward(*map(layout.scatter, (chunked.log_probs, chunked.entropy, chunked.head_log_probs)))
        # Packed: the logits of the positions predicting a target only (each sequence's last predicts nothing).
        keep = {} if layout.predicting_positions is None else {"logits_to_keep": layout.predicting_positions}
        output = model(**layout.model_inputs(), use_cache=False, **keep)
        logits = output.logits[:, :-1] if not keep else output.logits[0]
        if self.spec.rollout_temperature > 0:
            logits = logits / self.spec.rollout_temperature
        log_softmax = torch.log_softmax(logits.float(), dim=-1)
        out = Forward(log_softmax.gather(-1, targets.unsqueeze(-1)).squeeze(-1))
        if entropy == "loss":
            out.entropy = token_entropy(log_softmax)
        elif entropy == "metric":
            with torch.no_grad():
                out.entropy = token_entropy(log_softmax.detach())
        if heads:
            out.head_log_probs = log_softmax.gather(-1, head_ids)
        return Forward(*map(layout.scatter, (out.log_probs, out.entropy, out.head_log_probs)))

    def critic_values(self, batch: PackedBatch) -> torch.Tensor:
        """The critic's value of each target's prefix, [B, T-1] (aligned with the log-probs), on the CPU."""
        on_device = batch.to(self.device)
        layout = forward_layout(on_device, self.packing, self.model.config)
        values = on_device.on_targets(layout.scatter(layout.predicting(self.critic.module(**layout.model_inputs()))))
        return values.to(batch.targets.device)

    def owed_forwards(self, module, packed: list[PackedBatch]) -> None:
        """FSDP: as many dropped forwards of ``module`` as this rank owes to keep the all-gathers in lock step."""
        if self.sharding is not None:
            for _ in range(self.sharding.passes_owed(range(len(packed)))):
                inputs = forward_layout(packed[0].to(self.device), self.packing, self.model.config).model_inputs()
                self.sharding.lockstep_forward(module, inputs)

    def owed_backwards(self, module, packed: list[PackedBatch], step: range) -> None:
        """FSDP: every rank runs as many backwards as the busiest one."""
        if self.sharding is not None:
            for _ in range(self.sharding.passes_owed(step)):
                inputs = forward_layout(packed[step[0]].to(self.device), self.packing, self.model.config).model_inputs()
                self.sharding.lockstep_backward(module, inputs)

    def sum_gradients(self, params: list[torch.Tensor]) -> None:
        """Add up the data-parallel replicas' gradients (FSDP has reduce-scattered them already)."""
        if self.sharding is None or not self.sharding.active:
            self.dp.sum_gradients(params)

    def finish_gradients(self, params: list[torch.Tensor], clip_grad: float) -> torch.Tensor:
        """Clip the step's summed gradients by their global norm; returns the norm."""
        return torch.nn.utils.clip_grad_norm_(params, clip_grad if clip_grad > 0 else math.inf)

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
        with self.actor.weights_as(self.export_dtype):  # --bf16: the masters, in the engines' dtype
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
            with self.actor.weights_as(self.export_dtype):  # --bf16: the masters, in the engines' dtype
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
        with self.actor.weights_as():  # --bf16: the float32 masters, so that a resume is exact
            self.model.save_pretrained(os.path.join(path, "model"), safe_serialization=True)
        torch.save(
            {
                "optimizer": self.optimizer.state_dict(),
                "rng": rng_state(),
                "rollouts_trained": self.rollouts_trained,
                # The schedules' positions (a role may step several times per rollout, or not at all).
                "optimizer_steps": {
                    role.name: role.optimizer_steps for role in (self.actor, self.critic) if role is not None
                },
            },
            os.path.join(path, "optimizer_and_rng.pt"),
        )
        if self.critic is not None:
            self._save_critic(os.path.join(path, "critic"))
            if self.critic_save:
                self._export_critic()

    def _save_critic(self, path: str, gathered: dict | None = None) -> None:
        if gathered is not None:  # FSDP: the critic's gathered weights (its optimizer is in the sharded checkpoint)
            save_value_model(self.critic.module, gathered, path)
            return
        with self.critic.weights_as():  # --bf16: the float32 masters
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
        return {
            "rollouts_trained": self.rollouts_trained,
            "optimizer_steps": {role.name: role.optimizer_steps for role in self._trained_roles()},
        }

    def load_training_state(self, path: str, *, optimizer: bool = True) -> None:
        from transformers import AutoModelForCausalLM

        if self.sharding is not None:
            saved = self.sharding.load_checkpoint(path, self._trained_roles(), optimizer=optimizer)
            self.rollouts_trained = int(saved["rollouts_trained"])
            for role in self._trained_roles() if optimizer else ():
                role.restore_steps(saved["optimizer_steps"].get(role.name))
            return
        saved = AutoModelForCausalLM.from_pretrained(os.path.join(path, "model"), dtype=torch.float32)
        with self.actor.weights_as():  # --bf16: into the float32 masters (the bf16 copy is refreshed from them)
            self.model.load_state_dict(saved.state_dict())
        state = torch.load(os.path.join(path, "optimizer_and_rng.pt"), weights_only=False)
        if optimizer:
            self.optimizer.load_state_dict(state["optimizer"])
        restore_rng_state(state["rng"])
        self.rollouts_trained = int(state.get("rollouts_trained", 0))
        steps = state.get("optimizer_steps", {})
        if optimizer:
            self.actor.restore_steps(steps.get("actor"))
        if self.critic is not None:
            critic = os.path.join(path, "critic")
            if not is_critic_checkpoint(critic):
                raise ValueError(
                    f"{path} holds no critic state (it was saved by a run without "
                    "--advantage-estimator ppo); a PPO run cannot resume from it"
                )
            with self.critic.weights_as():
                self.critic.module.load_weights(critic)
            if optimizer:
                self.critic.optimizer.load_state_dict(
                    torch.load(os.path.join(critic, CRITIC_OPTIMIZER_FILE), weights_only=False)
                )
                self.critic.restore_steps(steps.get("critic"))
