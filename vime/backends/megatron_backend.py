"""Megatron-core training backend (``--train-backend megatron``).

The same interface (:class:`vime.backends.protocol.TrainerBackend`), training loop
(:class:`vime.backends.rollout_training.RolloutTraining`) and RL objective (:class:`vime.rl.objective.RLObjective`)
as the torch backend, on a megatron-core GPTModel built from the Megatron flags (``vime.backends.megatron_args``):

- batching: ``thd`` packing (sequences back to back, varlen attention) when Transformer Engine is
  usable on CUDA, otherwise right-padded micro-batches with an explicit causal mask, so no
  ``--seq-length`` is needed either way;
- data, tensor, expert, pipeline and context parallelism inside the process group its caller set up
  (``vime train`` starts one trainer rank per GPU, docs/parallelism.md); the gradient norm for clipping is
  reduced over the tensor-parallel and pipeline groups (each replicated parameter counted once), as are the
  norm gradients tensor parallelism leaves partial; pipeline stages pass hidden states and their gradients
  (``megatron_pipeline``); context-parallel ranks gather each other's keys and values (``megatron_context``);
- a torch AdamW optimizer on fp32 parameters (megatron-core's optimizer hard-codes CUDA); with ``--bf16`` the
  model computes in bf16 and AdamW steps float32 masters (vime/backends/precision.py, as the torch backend's
  replicated models), from which checkpoints are written and weights published in the engines' dtype; with
  ``--use-distributed-optimizer`` each data-parallel rank keeps the optimizer's state (and the masters) of its
  part of the parameters only (ZeRO-1, ``sharded_optimizer``), in checkpoints of the same format;
- initial weights from ``--ref-load`` (a Megatron checkpoint or an HF folder), else
  ``--hf-checkpoint``; the KL reference model from the same;
- checkpoints in ``--ckpt-format`` inside vime's ``iter_XXXXXXX/`` folders; engines receive
  HF-named safetensors (``megatron_convert``), expert by expert for MoE models;
- MoE models: the routers' load-balancing loss (``--moe-aux-loss-coeff``) averaged over each optimizer
  step, and R3 (``--use-rollout-routing-replay``): every forward over a sample routes its tokens to the
  experts the rollout engine recorded (``megatron_routing``);
- PPO (``--advantage-estimator ppo``): a second GPTModel with a value head (``megatron_critic``) trained
  by the shared objective (values, GAE, clipped value loss) and loop (turns), with the torch backend's role
  overrides, saved in
  ``critic/`` of each checkpoint.

Its spec is ``megatron_spec``; what it checks and chooses before building a model, ``megatron_setup``; the
parameters its gradient reductions treat apart and the global gradient norm, ``megatron_gradients``.

megatron-core 0.16 calls ``torch.cuda`` in its forward pass: on a machine without CUDA the backend
runs only where ``torch.cuda.current_device()`` has been redirected (the tests' ``megatron_shim``).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil

import torch

from vime.backends import megatron_critic
from vime.backends.chunked_logits import chunked_token_log_probs
from vime.backends.data_parallel import DataParallel
from vime.backends.megatron_gradients import global_norm, routed_expert_param_ids, tensor_parallel_partial_param_ids
from vime.backends.megatron_setup import (
    check_expert_parallelism,
    check_linear_attention,
    check_mla_parallelism,
    check_moe_tensor_parallelism,
    check_query_key_norms_over_heads,
    check_roles,
    context_split,
    packing_mode,
    pipeline_stage,
)
from vime.backends.megatron_spec import MegatronBackendSpec, initial_canonical_source
from vime.backends.precision import engine_dtype
from vime.backends.rollout_training import RolloutTraining, seed_everything, use_deterministic_algorithms
from vime.backends.sharded_optimizer import ShardGroup, StateAccess, make_sharded_role
from vime.backends.torch_backend import ModelRole, make_objective, make_role
from vime.backends.trainer_spec import TorchTrainerSpec
from vime.config.base import ConfigError
from vime.config.roles import RoleOverrides
from vime.rl.batch import Forward
from vime.rl.losses import token_entropy
from vime.sample import Sample


class MegatronBackend(RolloutTraining):
    """The model side of training on megatron-core (vime.backends.protocol.TrainerBackend); the loop and the
    objective are inherited."""

    def __init__(self, spec: TorchTrainerSpec, megatron: MegatronBackendSpec):
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        from vime.backends import megatron_model as mm
        from vime.backends.megatron_hooks import load_megatron_hook

        hf_logging.disable_progress_bar()
        self.spec, self.megatron = spec, megatron
        algo = spec.algorithm
        if spec.cpu_affinity:
            os.sched_setaffinity(0, spec.cpu_affinity)
        if spec.threads:
            torch.set_num_threads(spec.threads)
        if not mm.cuda_reachable():
            raise RuntimeError(
                "--train-backend megatron: megatron-core 0.16 needs CUDA for its forward pass and "
                "torch.cuda is not available here; use --train-backend torch on CPU"
            )
        seed_everything(spec.seed)
        if spec.deterministic_mode:
            use_deterministic_algorithms()
        if megatron.experimental:
            from megatron.core.config import set_experimental_flag

            set_experimental_flag(True)
        mm.init_parallel(megatron.parallel, seed=spec.seed)
        from megatron.core import parallel_state as ps

        # Ranks beyond tensor, pipeline and context parallelism hold replicas: data parallelism over Megatron's
        # group. Context-parallel ranks train the same micro-batches (each over its part of every sequence), so
        # their gradients add up with the replicas'.
        self.dp = DataParallel(ps.get_data_parallel_group())
        self.gradient_dp = DataParallel(ps.get_data_parallel_group(with_context_parallel=True))
        self.pipeline = pipeline_stage(megatron)
        self.context = context_split(megatron)
        self.expert_dp = None
        parallel = megatron.parallel
        if parallel.expert > 1 or parallel.expert_tensor_size != parallel.tensor:
            check_expert_parallelism(megatron)  # a dense model's expert sizes are moot, but for spreading experts
            if megatron.model.is_moe:
                # Each expert (or expert shard) lives on some ranks only: its gradient is summed over its copies.
                self.expert_dp = DataParallel(ps.get_expert_data_parallel_group())
        if megatron.moe.routing_replay and not megatron.model.is_moe:
            raise ValueError(
                f"--use-rollout-routing-replay needs a mixture-of-experts model ({megatron.model.family} "
                "has no experts)"
            )
        self.routing_replay = megatron.moe.routing_replay
        self._routes: dict[tuple[int, ...], torch.Tensor] = {}
        self.user_args = megatron.hook_args if megatron.hook_args is not None else argparse.Namespace()
        self.log_prob_hook = self._hook(
            "--custom-megatron-before-log-prob-hook-path", megatron.before_log_prob_hook_path, load_megatron_hook
        )
        self.train_step_hook = self._hook(
            "--custom-megatron-before-train-step-hook-path", megatron.before_train_step_hook_path, load_megatron_hook
        )
        init_hook = self._hook("--custom-megatron-init-path", megatron.init_hook_path, load_megatron_hook)
        if init_hook is not None:
            init_hook(self.user_args)

        check_linear_attention(megatron)
        check_query_key_norms_over_heads(megatron)
        # Context parallelism and gated delta nets run megatron-core's own layers over padded rows.
        self.packing = packing_mode(
            megatron.packing, mm.te_usable() and self.context is None and not megatron.model.is_hybrid
        )
        check_moe_tensor_parallelism(megatron)
        check_mla_parallelism(megatron)
        source = initial_canonical_source(spec, megatron)
        self.gpt = self._build_and_load(source)
        self.model = self._language_model(self.gpt, megatron.model.vocab_size)
        self.model.train()
        self.tokenizer = AutoTokenizer.from_pretrained(spec.hf_checkpoint)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        roles = algo.role_config()
        check_roles(roles)
        # The command line's AdamW and schedule, overridden by --megatron-config-path's actor entry.
        self.actor = self._make_role("actor", self.gpt, roles.role("actor"), roles.source)
        self.optimizer = self.actor.optimizer
        # PPO's critic shares this worker; it is trained, saved and checkpointed with the actor.
        self.critic: ModelRole | None = None
        self.critic_save: str | None = None
        self.critic_gpt, self.critic_model = None, None
        if algo.uses_critic:
            self.critic = self._build_critic(roles.role("critic"), roles.source, source)
        models = ((self.actor, self.gpt), (self.critic, self.critic_gpt))
        self.expert_param_ids = routed_expert_param_ids(models)  # reduced over their own groups (EP)
        self.tp_partial_param_ids = tensor_parallel_partial_param_ids(models)
        self.rollouts_trained = 0  # the rollout id the train-step hook receives; checkpointed
        self._log_prob_hook_due: set | None = None
        self.ref_gpt, self.ref_model = None, None
        if algo.needs_reference_model:
            self.ref_gpt = self._build_and_load(megatron.ref_load or spec.hf_checkpoint)
            self.ref_gpt.eval().requires_grad_(False)
            if spec.bf16:  # frozen: no masters needed (buffers keep their dtype, as the trained model's do)
                for p in self.ref_gpt.parameters():
                    p.data = p.data.to(torch.bfloat16)
            self.ref_model = self._language_model(self.ref_gpt, megatron.model.vocab_size)
        self.objective = make_objective(spec)
        # --bf16: weights reach the engines from the float32 masters, cast to the engines' dtype.
        self.export_dtype = engine_dtype(spec.engine_dtype, spec.hf_checkpoint) if spec.bf16 else None

    # ------------------------------------------------------------------ set-up
    def _language_model(self, gpt, vocab_size: int):
        from vime.backends.megatron_forward import MegatronLM

        m = self.megatron
        return MegatronLM(
            gpt,
            vocab_size,
            self.packing,
            m.parallel.sequence_parallel,
            model_args=m.model,
            pipeline=self.pipeline,
            context=self.context,
            pad_size_multiplier=m.pad_size_multiplier,
        )

    def _make_role(self, name: str, gpt, role: RoleOverrides, yaml: str | None) -> ModelRole:
        """The role's optimizer: replicated, or with --use-distributed-optimizer sharded over the ranks that
        sum its gradients (:meth:`_shard_groups`)."""
        if self.spec.use_distributed_optimizer:
            return make_sharded_role(name, gpt, self.spec, role, yaml, self._shard_groups(gpt))
        return make_role(name, gpt, self.spec, role, yaml)

    def _shard_groups(self, gpt) -> list[ShardGroup]:
        """The ranks each parameter's gradient is summed over (:meth:`sum_gradients`): data x context parallel
        ranks, and under expert parallelism, for the routed experts, their expert-data-parallel ranks (those
        holding the same experts), as megatron-core's distributed optimizer splits them."""
        if self.expert_dp is None:
            return [ShardGroup(list(gpt.parameters()), self.gradient_dp)]
        from vime.backends.megatron_weights import is_expert_param

        experts = [p for name, p in gpt.named_parameters() if is_expert_param(name)]
        routed = {id(p) for p in experts}
        dense = [p for p in gpt.parameters() if id(p) not in routed]
        return [ShardGroup(dense, self.gradient_dp), ShardGroup(experts, self.expert_dp)]

    @staticmethod
    def _hook(flag: str, path: str | None, loader):
        return loader(flag, path) if path else None

    def _build_critic(self, role: RoleOverrides, yaml: str | None, actor_source: str) -> ModelRole:
        """PPO's critic: the actor's architecture with a value head, its body from the critic role's ``load``
        or else from the actor's initial weights (as the torch backend's critic)."""

        m = self.megatron
        self.critic_gpt = megatron_critic.build_value_gpt(
            m.model,
            m.parallel,
            seed=self.spec.seed,
            vocab_divisible_by=m.vocab_divisible_by,
            use_te=self.packing == "thd",
            attention_dropout=m.attention_dropout,
            hidden_dropout=m.hidden_dropout,
            recompute=m.recompute,
            initialize=False,
            moe=m.moe,
            overrides=m.config_overrides,
            bf16=self.spec.bf16,
        )
        if role.load is not None:
            megatron_critic.load_initial(self.critic_gpt, role.load, m.model, field=role.field("load"), yaml=yaml)
        else:
            megatron_critic.load_initial(self.critic_gpt, actor_source, m.model)
        self.critic_gpt.train()
        # The head's single output is batched like logits; R3 routes are the actor's and are not replayed here.
        self.critic_model = self._language_model(self.critic_gpt, 1)
        self.critic_save = role.save
        return self._make_role("critic", self.critic_gpt, role, yaml)

    def _build_and_load(self, source: str):
        from vime.backends import megatron_checkpoint as mc, megatron_model as mm
        from vime.backends.megatron_convert import hf_to_mcore, read_hf_state_dict
        from vime.backends.megatron_weights import load_canonical

        m = self.megatron
        gpt = mm.build_gpt_model(
            m.model,
            m.parallel,
            vocab_divisible_by=m.vocab_divisible_by,
            use_te=self.packing == "thd",
            attention_dropout=m.attention_dropout,
            hidden_dropout=m.hidden_dropout,
            recompute=m.recompute,
            initialize=False,
            moe=m.moe,
            overrides=m.config_overrides,
            bf16=self.spec.bf16,
        )
        if mc.is_checkpoint_root(source):
            mc.load(mc.resolve_step_folder(source), gpt)
        else:
            load_canonical(gpt, hf_to_mcore(read_hf_state_dict(source), m.model), m.model)
        return gpt

    # ------------------------------------------------------------------ forward
    def forward(self, model, batch, *, entropy: str | None = None, heads: bool = False) -> Forward:
        """As the torch backend's, with the vocabulary-sized work on the model's device; the [B, T-1]
        results come back to the CPU (differentiably), where the shared objective runs."""
        if model is self.ref_model and self._log_prob_hook_due is not None:
            self._log_prob_hook_due = self._run_log_prob_hook(self._log_prob_hook_due, "ref_", self.ref_gpt)
        chunk_size = self.spec.log_probs_chunk_size
        output = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            routes=self._batch_routes(batch),
            final_hidden=bool(chunk_size),
        )

        def per_token(output) -> list[torch.Tensor]:
            targets = batch.targets.to((output.hidden if chunk_size else output.logits).device)
            head_ids = batch.head_ids.to(targets.device) if heads else None
            if chunk_size:  # the same results without the [tokens x vocabulary] logits (chunked_logits)
                chunked = chunked_token_log_probs(
                    output.hidden[:, :-1],
                    model.output_weight(),
                    None,
                    targets,
                    chunk_size=chunk_size,
                    temperature=self.spec.rollout_temperature,
                    entropy=entropy,
                    head_ids=head_ids,
                    vocab=model.vocabulary(),
                )
                return [chunked.log_probs] + [r for r in (chunked.entropy, chunked.head_log_probs) if r is not None]
            logits = output.logits[:, :-1]
            if self.spec.rollout_temperature > 0:
                logits = logits / self.spec.rollout_temperature
            log_softmax = torch.log_softmax(logits.float(), dim=-1)
            results = [log_softmax.gather(-1, targets.unsqueeze(-1)).squeeze(-1)]
            if entropy == "loss":
                results.append(token_entropy(log_softmax))
            elif entropy == "metric":
                with torch.no_grad():
                    results.append(token_entropy(log_softmax.detach()))
            if heads:
                results.append(log_softmax.gather(-1, head_ids))
            return results

        tokens = tuple(batch.targets.shape)
        shapes = [tokens] * (1 + (entropy is not None)) + ([tuple(batch.head_ids.shape)] if heads else [])
        results = [r.cpu() for r in self._stage_results(output, per_token, shapes)]
        out = Forward(results.pop(0))
        if entropy is not None:
            out.entropy = results.pop(0)
        if heads:
            out.head_log_probs = results.pop(0)
        return out

    def critic_values(self, batch) -> torch.Tensor:
        """The critic's value of each target's prefix, [B, T-1] on the CPU (differentiably), like the torch
        backend's."""
        output = self.critic_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        values = self._stage_results(output, lambda output: [output.logits[:, :-1, 0]], [tuple(batch.targets.shape)])
        return batch.on_targets(values[0].cpu())

    def _stage_results(self, output, compute, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
        """``compute(output)``; under pipeline parallelism the last stage's, on every stage
        (``megatron_pipeline``)."""
        if self.pipeline is None:
            return compute(output)
        return self.pipeline.results(output, compute, shapes)

    def _batch_routes(self, batch) -> list[torch.Tensor] | None:
        """R3: the recorded experts of each row of ``batch`` (None without --use-rollout-routing-replay).

        The shared batching code does not carry the samples' captures, so rows are matched to the rollout's
        samples by their tokens (samples with identical tokens are routed by one of their records)."""
        if not self.routing_replay:
            return None
        routes = []
        for row, n in enumerate(batch.attention_mask.sum(dim=1).tolist()):
            key = tuple(batch.input_ids[row, :n].tolist())
            if key not in self._routes:
                raise RuntimeError("--use-rollout-routing-replay: a batch row matches no sample of this rollout")
            routes.append(self._routes[key])
        return routes

    def _index_routes(self, samples: list[Sample]) -> None:
        from vime.backends.megatron_routing import sample_routes

        self._routes = {}
        if not self.routing_replay:
            return
        for sample in samples:
            if sample.rollout_routed_experts is None:
                raise ValueError(
                    f"--use-rollout-routing-replay: sample {sample.index} of group {sample.group_index} "
                    "has no rollout_routed_experts (the engines must run with vLLM's "
                    "--enable-return-routed-experts and the rollout must record them, see "
                    "vime.rollout.routing)"
                )
            try:
                self._routes[tuple(sample.tokens)] = sample_routes(
                    sample.rollout_routed_experts, len(sample.tokens), self.megatron.model
                )
            except ValueError as error:
                raise ValueError(
                    f"--use-rollout-routing-replay: sample {sample.index} of group {sample.group_index}: {error}"
                ) from None

    def _log_probs(self, batch) -> torch.Tensor:
        """The actor's (old policy) log-probs; the before-log-prob hook runs once per rollout first."""
        if self._log_prob_hook_due is not None:
            self._log_prob_hook_due = self._run_log_prob_hook(self._log_prob_hook_due, "", self.gpt)
        return super()._log_probs(batch)

    def _run_log_prob_hook(self, due: set, prefix: str, gpt) -> set | None:
        if prefix in due:
            self.log_prob_hook(self.user_args, [gpt], prefix)
            due = due - {prefix}
        return due or None

    # ------------------------------------------------------------------ one rollout
    def train_rollout(self, samples: list[Sample], policy_version: int | None = None) -> dict[str, float]:
        """:meth:`RolloutTraining.train_rollout` (same objective, same metrics), with the Megatron hooks
        (:meth:`before_step`) and the tensor- and expert-parallel gradient reductions (:meth:`sum_gradients`,
        :meth:`finish_gradients`)."""
        self._log_prob_hook_due = {"", "ref_"} if self.log_prob_hook is not None else None
        samples = self.objective.train_samples(samples)  # --custom-convert-samples-to-train-data-path
        self._check_lockstep(samples)
        self._index_routes(samples)
        try:
            return self.train_samples(samples, policy_version)
        finally:
            self._log_prob_hook_due = None
            self._routes = {}

    def _check_lockstep(self, samples: list[Sample]) -> None:
        """Expert-parallel ranks exchange tokens in every forward, so each must run as many micro-batches as
        the others, in every pass and every optimizer step: a rank left without one would wait forever. With
        token budgets the layout is made so (:meth:`micro_batch_multiple`); fixed micro-batches must fall so."""
        if self.expert_dp is None:
            return
        replicas, spec = self.dp.size, self.spec
        if getattr(spec, "use_dynamic_batch_size", False):
            step_sizes = [
                min(spec.global_batch_size, len(samples) - first)
                for first in range(0, len(samples), spec.global_batch_size)
            ]
            if min(step_sizes, default=0) < replicas:
                raise ConfigError(  # a user's error: restarting the trainer would meet it again
                    "--global-batch-size",
                    f"{len(samples)} samples make optimizer steps of {step_sizes} samples; under expert "
                    f"parallelism each must hold at least one sample per data-parallel rank ({replicas})",
                )
            return
        size = spec.micro_batch_size
        per_step = max(1, spec.global_batch_size // size)
        micro_batches = -(-len(samples) // size)
        if micro_batches % replicas or per_step % replicas or micro_batches % per_step:
            raise ConfigError(
                "--expert-model-parallel-size",
                f"{len(samples)} samples make {micro_batches} "
                f"micro-batch(es) of --micro-batch-size {size}, in optimizer steps of {per_step}; both "
                f"must be multiples of the {replicas} data-parallel ranks (and the rollout a whole "
                "number of steps)",
            )

    def micro_batch_multiple(self) -> int:
        """Under expert parallelism every data-parallel rank runs as many micro-batches as the others."""
        return self.dp.size if self.expert_dp is not None else 1

    def micro_batch_tokens(self, per_gpu: int) -> int:
        """Context-parallel ranks each hold 1/N of every sequence: a micro-batch holds N x the per-GPU budget."""
        return per_gpu * self.megatron.parallel.context

    def before_step(self, role, step_id: int, micro_batches: int) -> None:
        """The before-train-step hook (actor steps) and the MoE auxiliary loss's averaging."""
        if self.train_step_hook is not None and role is self.actor:
            self.train_step_hook(self.user_args, self.rollouts_trained, step_id, [self.gpt], role.optimizer, None)
        self._scale_moe_aux_loss(micro_batches)

    def after_backward(self, role) -> None:
        """The MoE routers' expert biases take their step (vime.backends.megatron_expert_bias)."""
        if self.megatron.model.moe_router_enable_expert_bias:
            from vime.backends.megatron_expert_bias import update_expert_bias

            update_expert_bias(role.module, self.megatron.moe.bias_update_rate)

    def _scale_moe_aux_loss(self, micro_batches: int) -> None:
        """The routers' load-balancing losses add their gradients in the backward pass (megatron-core's
        MoEAuxLossAutoScaler), once per micro-batch: average them over the optimizer step, as the policy
        loss is."""
        if self.megatron.model.is_moe and self.megatron.moe.aux_loss_coeff > 0:
            from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

            from vime.backends.megatron_model import device

            MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / micro_batches, device=device()))

    def sum_gradients(self, params: list[torch.Tensor]) -> None:
        """Replicas' and context-parallel ranks' gradients add up; under expert parallelism an expert's only over
        the ranks that hold it (the token exchange already brought every replica's tokens to it)."""
        if self.expert_dp is None:
            self.gradient_dp.sum_gradients(params)
            return
        experts = self.expert_param_ids
        self.gradient_dp.sum_gradients([p for p in params if id(p) not in experts])
        self.expert_dp.sum_gradients([p for p in params if id(p) in experts])

    def finish_gradients(self, params: list[torch.Tensor], clip_grad: float) -> torch.Tensor:
        """Reduce what tensor parallelism leaves partial, then clip by the global norm; returns the norm."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        max_norm = clip_grad if clip_grad > 0 else math.inf
        if self.pipeline is None and self.expert_dp is None and ps.get_tensor_model_parallel_world_size() == 1:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        if self.pipeline is not None:
            from vime.backends.megatron_pipeline import sum_tied_embedding_gradients

            sum_tied_embedding_gradients(params)
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if id(p) in self.tp_partial_param_ids and ps.get_tensor_model_parallel_world_size() > 1:
                dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
        norm = global_norm(params, self.expert_param_ids, self.pipeline)
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in params:
            p.grad.mul_(coefficient)
        return norm

    # ------------------------------------------------------------------ weights and checkpoints
    def _writes_files(self) -> bool:
        from vime.backends.megatron_checkpoint import is_first_rank

        return is_first_rank()

    def export_peer(self) -> None:
        """A rank that writes nothing still takes part in gathering the tensor- and expert-parallel shards, and
        with --use-distributed-optimizer the masters' ranges (``ShardedOptimizer.weights_as``)."""
        from megatron.core import parallel_state as ps

        from vime.backends.megatron_weights import gather_canonical

        split = (
            ps.get_tensor_model_parallel_world_size() > 1
            or ps.get_expert_tensor_and_model_parallel_world_size() > 1
            or self.pipeline is not None
        )
        if split or self.spec.use_distributed_optimizer:
            with self.actor.weights_as(self.export_dtype):
                if split:
                    gather_canonical(self.gpt, self.megatron.model, to_cpu=False)

    def hf_named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """HF-named full tensors on the model's device (every tensor-parallel rank calls it: it gathers)."""
        from vime.backends.megatron_convert import iter_mcore_to_hf
        from vime.backends.megatron_weights import gather_canonical

        with self.actor.weights_as(self.export_dtype):  # --bf16: the masters, in the engines' dtype
            canonical = gather_canonical(self.gpt, self.megatron.model, to_cpu=False)
        return list(iter_mcore_to_hf(canonical, self.megatron.model))

    def save_weights(self, path: str) -> None:
        """HF-named safetensors plus the HF config files: what an engine reloads (TP rank 0 writes)."""
        self._write_hf(path, mtp_layers=False)

    def _write_hf(self, path: str, *, mtp_layers: bool) -> None:
        """The model as HF safetensors, with what it does not hold carried unchanged (the vision tower; with
        ``mtp_layers`` the checkpoint's multi-token-prediction layers), and the HF config files."""
        from vime.backends.megatron_convert import mcore_to_hf, untrained_hf_tensors, write_hf_safetensors
        from vime.backends.megatron_weights import gather_canonical

        with self.actor.weights_as(self.export_dtype):  # --bf16: the masters, in the engines' dtype
            canonical = gather_canonical(self.gpt, self.megatron.model)
        if not self._writes_files():
            return
        model = self.megatron.model
        untrained = untrained_hf_tensors(self.spec.hf_checkpoint, model, mtp_layers=mtp_layers)
        write_hf_safetensors({**mcore_to_hf(canonical, model), **untrained}, path)
        for name in ("config.json", "generation_config.json"):
            source = os.path.join(self.spec.hf_checkpoint, name)
            if os.path.isfile(source):
                shutil.copyfile(source, os.path.join(path, name))

    def save_hf(self, path: str) -> None:
        """A whole HF checkpoint (hf_final): the model, what it does not hold, the config and the tokenizer."""
        self._write_hf(path, mtp_layers=True)
        if self._writes_files():
            self.tokenizer.save_pretrained(path)
        if self.critic is not None and self.critic_save:
            self._export_critic()  # the final critic too, where its role's `save` says

    def checkpoint_args(self) -> dict:
        p = self.megatron.parallel
        return {
            **self.megatron.model.to_dict(),
            "tensor_model_parallel_size": p.tensor,
            "pipeline_model_parallel_size": p.pipeline,
            "context_parallel_size": p.context,
            "make_vocab_size_divisible_by": self.megatron.vocab_divisible_by,
            "padded_vocab_size": self.megatron.model.padded_vocab_size(self.megatron.vocab_divisible_by, p.tensor),
        }

    def save_training_state(self, path: str) -> None:
        """The Megatron checkpoint (--ckpt-format) of model, optimizer and RNG, written straight into ``path``
        (vime's iter_XXXXXXX/ folder)."""
        from vime.backends import megatron_checkpoint as mc

        # --bf16: the float32 masters, which the optimizer's state belongs to; sharded: gathered whole.
        with self.actor.whole_state(StateAccess.READ) as optimizer:
            mc.save(
                path,
                self.gpt,
                optimizer,
                fmt=self.megatron.ckpt_format,
                iteration=self.rollouts_trained,
                args=self.checkpoint_args(),
                extra={"optimizer_steps": self.actor.optimizer_steps},
            )
        if self.critic is not None:
            self._save_critic(os.path.join(path, megatron_critic.CHECKPOINT_DIR))
            if self.critic_save:
                self._export_critic()

    def _critic_checkpoint(self) -> dict:
        return dict(
            fmt=self.megatron.ckpt_format,
            iteration=self.rollouts_trained,
            args=self.checkpoint_args(),
            optimizer_steps=self.critic.optimizer_steps,
        )

    def _save_critic(self, folder: str) -> None:
        with self.critic.whole_state(StateAccess.READ) as optimizer:
            megatron_critic.save(folder, self.critic_gpt, optimizer, **self._critic_checkpoint())

    def _export_critic(self) -> None:
        with self.critic.whole_state(StateAccess.READ) as optimizer:
            megatron_critic.export(self.critic_save, self.critic_gpt, optimizer, **self._critic_checkpoint())

    def load_training_state(self, path: str, *, optimizer: bool = True) -> None:
        from vime.backends import megatron_checkpoint as mc

        folder = mc.resolve_step_folder(path)
        # --bf16: into the float32 masters (the bf16 model is refreshed from them); sharded: each rank keeps its part.
        with self.actor.whole_state(StateAccess.WRITE) as actor_optimizer:
            common = mc.load(folder, self.gpt, actor_optimizer if optimizer else None, restore_rng=True)
        self.rollouts_trained = int(common.get("iteration") or 0)
        if optimizer:
            self.actor.restore_steps(self._saved_steps(common))
        if self.critic is not None:
            critic = os.path.join(folder, megatron_critic.CHECKPOINT_DIR)
            if not megatron_critic.is_critic_checkpoint(critic):
                raise ValueError(
                    f"{folder} holds no critic state (it was saved by a run without "
                    "--advantage-estimator ppo); a PPO run cannot resume from it"
                )
            with self.critic.whole_state(StateAccess.WRITE) as critic_optimizer:
                common = mc.load(critic, self.critic_gpt, critic_optimizer if optimizer else None)
            if optimizer:
                self.critic.restore_steps(self._saved_steps(common))

    @staticmethod
    def _saved_steps(common: dict) -> int | None:
        # Older checkpoints have only AdamW's step count ("optimizer_step"), which is the same number.
        vime = common.get("vime") or {}
        steps = vime.get("optimizer_steps", vime.get("optimizer_step"))
        return None if steps is None else int(steps)
