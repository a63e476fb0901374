"""FSDP2 sharding of the torch backend (``--use-distributed-optimizer``; docs/real-models.md).

Each trained model (the policy, PPO's critic) and the frozen reference model are wrapped with
``torch.distributed.fsdp.fully_shard``: one FSDP group per transformer layer plus the root (embeddings,
final norm, heads). A rank then holds 1/N of every parameter, of its gradient and of AdamW's moments; a
layer's full parameters exist only while it runs (all-gathered in forward and again in backward), and the
gradients are reduce-scattered, so nothing is summed afterwards. ``clip_grad_norm_`` on the sharded
(DTensor) gradients reduces the norm over the ranks: the clipping norm is the global one.

The work is still shared out as :class:`~vime.backends.data_parallel.DataParallel` says (every rank holds
the whole rollout, micro-batches go round-robin). FSDP's collectives run inside every forward and backward,
so the ranks must run the same number of them in the same order: a rank with one micro-batch fewer than the
others in a pass runs a *lock-step* pass on a batch it has (a forward whose result is dropped; in an
optimizer step a backward of ``0 x output``, which adds exactly zero to the gradients).

With ``--bf16`` the parameters are gathered in bfloat16 for compute and gradients are reduced in float32
(``MixedPrecisionPolicy``): the sharded parameters FSDP keeps (the optimizer's masters) and AdamW's state
stay float32.

With one rank there is nothing to shard: the models are not wrapped (the torch backend's own precision
path applies), but checkpoints are still written in the sharded format, so a run can resume at another
rank count either way.

Checkpoints are written with ``torch.distributed.checkpoint`` (DCP): every rank writes its shards into
``<iter>/sharded/`` (the folder must be on a filesystem every trainer rank sees, as ``--save`` already
is) and DCP reshards on load, so a checkpoint of N ranks resumes on M. Rank 0 also writes
``<iter>/trainer_state.pt`` (RNG, rollout count, schedule positions).
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings

import torch

from vime.backends.data_parallel import DataParallel
from vime.backends.random_state import restore_rng_state, rng_state

SHARDED_DIR = "sharded"  # the DCP checkpoint (every rank's shards and rank 0's metadata)
TRAINER_STATE_FILE = "trainer_state.pt"


def _layer_class_names(module: torch.nn.Module) -> set[str]:
    """The transformer-layer classes HF declares for its models inside ``module`` (``_no_split_modules``:
    the blocks that must stay whole, which is what one FSDP group should hold)."""
    names: set[str] = set()
    for sub in module.modules():
        names.update(getattr(sub, "_no_split_modules", None) or ())
    return names


def separate_embedding_groups(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The input embeddings as an FSDP group of their own, unless the LM head shares their weight. With a
    large vocabulary they are a large share of the model (a 32k x 1024 table is 16% of a 200M model); in the
    root's group their gathered weights and unsharded gradients would add to the head's at the end of the
    backward pass. The head stays in the root's group: the chunked log-probs read its weight after the root's
    forward (vime.backends.chunked_logits.final_hidden_states)."""
    getter = getattr(module, "get_input_embeddings", None)
    embeddings = getter() if callable(getter) else None
    if embeddings is None or embeddings is module:
        return []
    head = module.get_output_embeddings() if callable(getattr(module, "get_output_embeddings", None)) else None
    if head is not None and getattr(head, "weight", None) is getattr(embeddings, "weight", None):
        return []  # tied: one tensor, which the head needs where the root has it gathered
    return [embeddings]


def is_sharded(module: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


class Sharding:
    """FSDP2 over the data-parallel ranks of ``dp`` (the default process group)."""

    def __init__(self, dp: DataParallel, *, bf16: bool):
        self.dp = dp
        self.bf16 = bf16
        self.active = dp.size > 1  # one rank: nothing to shard (see the module's docstring)

    # ------------------------------------------------------------------ wrapping
    def shard(self, module: torch.nn.Module) -> torch.nn.Module:
        """Wrap ``module`` in place (each transformer layer, then the root); returns it. Build the optimizer
        afterwards: fully_shard replaces the parameters with sharded ones."""
        if not self.active:
            return module
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        kwargs = {}
        if self.bf16:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        layer_names = _layer_class_names(module)
        layers = [sub for sub in module.modules() if type(sub).__name__ in layer_names and sub is not module]
        groups = [*layers, *separate_embedding_groups(module)]
        for group in groups:
            fully_shard(group, **kwargs)
        fully_shard(module, **kwargs)
        # A micro-batch's loss is already its share of the step's loss (reduce_loss divides by the step's
        # totals): the ranks' gradients add up, they are not averaged (FSDP's default divides by N). A plain
        # SUM reduction: FSDP would otherwise pre-multiply by 1/factor (PREMUL_SUM), which gloo lacks.
        for sub in [*groups, module]:
            sub.set_gradient_divide_factor(1.0)
            sub.set_force_sum_reduction_for_comms(True)
        return module

    # ------------------------------------------------------------------ lock step
    def passes_owed(self, indices) -> int:
        """How many lock-step passes this rank owes for a pass over ``indices`` shared out by ``dp.share``:
        the most any rank runs, less this rank's share."""
        if not self.active:
            return 0
        count = len(indices)
        return math.ceil(count / self.dp.size) - len(self.dp.share(indices))

    @staticmethod
    def _output_tensor(output) -> torch.Tensor:
        return output if torch.is_tensor(output) else output.logits

    def lockstep_forward(self, module: torch.nn.Module, inputs: dict) -> None:
        """A forward on ``inputs`` (the model's keyword arguments: a micro-batch as the backend feeds it) whose
        result is dropped (no-gradient passes: old log-probs, reference, values)."""
        with torch.no_grad():
            module(**inputs)

    def lockstep_backward(self, module: torch.nn.Module, inputs: dict) -> None:
        """A forward and a backward that add exactly zero to every gradient (an optimizer step's micro-batch)."""
        output = self._output_tensor(module(**inputs))
        (output.float().sum() * 0.0).backward()

    # ------------------------------------------------------------------ weights
    def full_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's state on rank 0 (CPU tensors; an empty dict on the other ranks). Every rank must
        call it: the parameters are all-gathered."""
        if not is_sharded(module):
            return module.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def save_pretrained(self, model, path: str, *, write: bool, dtype: torch.dtype | None = None) -> None:
        """``model`` as an HF folder (safetensors) at ``path``, gathered on every rank, written where ``write``,
        in ``dtype`` (None: as held, float32). The files are what the unsharded model's ``save_pretrained``
        writes (HF names the class without FSDP's prefix)."""
        state = self.full_state_dict(model)
        if not write:
            return
        # A tied parameter once, under its first name (the other is tied again on load), as unsharded HF writes.
        aliases = {name for name, _ in model.named_parameters(remove_duplicate=False)} - {
            name for name, _ in model.named_parameters()
        }
        state = {name: value for name, value in state.items() if name not in aliases}
        if dtype is not None:
            state = {name: value.to(dtype) if value.is_floating_point() else value for name, value in state.items()}
        model.save_pretrained(path, state_dict=state, safe_serialization=True)
        if dtype is not None:  # config.json names the parameters' dtype (float32 shards), not the files'
            model.config.dtype = dtype
            model.config.save_pretrained(path)

    def named_weights(self, model, dtype: torch.dtype | None = None) -> list[tuple[str, torch.Tensor]]:
        """(HF name, gathered tensor) per parameter, a tied one once under its first name, as
        ``named_parameters`` lists them: what the engines receive over NCCL. Every rank calls it (the others
        through :meth:`full_state_dict`); rank 0 gets the list, the others an empty one."""
        state = self.full_state_dict(model)
        if not state:
            return []
        return [
            (name, state[name].to(dtype) if dtype is not None else state[name]) for name, _ in model.named_parameters()
        ]

    # ------------------------------------------------------------------ checkpoints
    @contextlib.contextmanager
    def _one_process(self):
        """Around DCP's calls: with one rank DCP warns that it assumes one process, which is the intent."""
        with warnings.catch_warnings():
            if not self.active:
                warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            yield

    @staticmethod
    def _state_dicts(roles, *, optimizer: bool = True) -> dict:
        """{role: {"model": ..., "optimizer": ...}}; without ``optimizer``, the models' only (getting an optimizer's
        state dict initialises its state, which a fresh optimizer must not have)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        state = {}
        for role in roles:
            if optimizer:
                model, optimizer_state = get_state_dict(role.module, role.optimizer)
                state[role.name] = {"model": model, "optimizer": optimizer_state}
            else:
                state[role.name] = {"model": get_model_state_dict(role.module)}
        return state

    @staticmethod
    @contextlib.contextmanager
    def _masters_in_place(roles):
        """One unsharded rank with --bf16 steps float32 masters (vime/backends/precision.py): while the roles'
        modules hold them, the state dicts name the optimizer's parameters and a load lands in them."""
        with contextlib.ExitStack() as stack:
            for role in roles:
                stack.enter_context(role.weights_as())
            yield

    def save_checkpoint(self, path: str, roles, trainer_state: dict, *, write: bool) -> None:
        """Every rank writes its shards of the ``roles``' models and optimizers; rank 0 (``write``) also writes
        ``trainer_state`` (RNG and counters, added here)."""
        import torch.distributed.checkpoint as dcp

        os.makedirs(path, exist_ok=True)
        with self._one_process(), self._masters_in_place(roles):
            dcp.save(self._state_dicts(roles), checkpoint_id=os.path.join(path, SHARDED_DIR), no_dist=not self.active)
        if write:
            state = dict(
                trainer_state,
                rng=rng_state(),
            )
            torch.save(state, os.path.join(path, TRAINER_STATE_FILE))

    def load_checkpoint(self, path: str, roles, *, optimizer: bool = True) -> dict:
        """Load the ``roles``' models and optimizers (``optimizer=False``: the models only) from ``path``
        (written at any rank count), restore the RNG and return the trainer state rank 0 saved."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        sharded = os.path.join(path, SHARDED_DIR)
        if not os.path.isdir(sharded):
            raise ValueError(
                f"{path} holds no sharded checkpoint ({SHARDED_DIR}/): it was saved without "
                "--use-distributed-optimizer, which this run sets; resume it with the same setting"
            )
        with self._one_process(), self._masters_in_place(roles):
            state = self._state_dicts(roles, optimizer=optimizer)  # the layout to load into: this run's shards
            dcp.load(state, checkpoint_id=sharded, no_dist=not self.active)
            for role in roles:
                if not optimizer:
                    set_model_state_dict(role.module, state[role.name]["model"])
                    continue
                set_state_dict(
                    role.module,
                    role.optimizer,
                    model_state_dict=state[role.name]["model"],
                    optim_state_dict=state[role.name]["optimizer"],
                )
        saved = torch.load(os.path.join(path, TRAINER_STATE_FILE), weights_only=False)
        restore_rng_state(saved["rng"])
        return saved


def save_value_model(critic: torch.nn.Module, state: dict[str, torch.Tensor], path: str) -> None:
    """PPO's critic (a ``ValueModel``) from its gathered ``state`` in the layout ``ValueModel.save`` writes
    (``model/`` HF body, the head's safetensors), so a later run's critic ``load`` accepts it."""
    from safetensors.torch import save_file

    from vime.backends.value_model import VALUE_HEAD_FILE

    os.makedirs(path, exist_ok=True)
    body = {name.removeprefix("body."): value for name, value in state.items() if name.startswith("body.")}
    critic.body.save_pretrained(os.path.join(path, "model"), state_dict=body, safe_serialization=True)
    head = {
        name.removeprefix("value_head."): value.contiguous()
        for name, value in state.items()
        if name.startswith("value_head.")
    }
    save_file(head, os.path.join(path, VALUE_HEAD_FILE))
