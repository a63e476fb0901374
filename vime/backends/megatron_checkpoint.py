"""Megatron checkpoints: the ``torch`` and ``torch_dist`` formats, read and written by vime.

A checkpoint root holds ``latest_checkpointed_iteration.txt`` (a step number, or ``release``) and one
folder per step, ``iter_XXXXXXX/`` (``release/``). Inside a step folder:

- ``torch``: ``mp_rank_XX/model_optim_rng.pt`` per tensor-parallel rank (``mp_rank_XX_YYY`` with
  pipeline stages), a ``torch.save`` of ``{model, optimizer, rng_state, iteration, args,
  checkpoint_version, vime}``. Loadable only with the parallelism it was written with.
- ``torch_dist``: megatron-core ``dist_checkpointing`` (``*.distcp``, ``.metadata``, ``common.pt``,
  ``metadata.json``): every tensor stored once with its global shape, loadable with any
  tensor-parallel size. The optimizer's moments are stored sharded like their parameters.

vime's own checkpoints (``vime.recovery.checkpoint``) put this state straight into their
``iter_XXXXXXX/`` folder beside ``vime_state.json``, so a vime ``--save`` directory is also a Megatron
checkpoint directory. Whatever ``--ckpt-format`` says, both formats load. With PPO the critic (a GPT
with a value head, ``megatron_critic``) is a second step folder, ``critic/``, inside the actor's.

``optimizer`` is a torch optimizer (vime trains with torch's AdamW; Megatron's own optimizer
hard-codes CUDA), so the optimizer part is not Megatron-LM's distributed-optimizer layout. With
``--use-distributed-optimizer`` the ranks gather their parts into one such optimizer for a save and take their
parts back after a load (``sharded_optimizer.ShardedOptimizer.whole_state``): the format is the same.
"""

from __future__ import annotations

import contextlib
import os

import torch

from vime.backends.megatron_convert import from_te_names, to_te_names
from vime.backends.random_state import restore_rng_state, rng_state
from vime.errors import UserError

LATEST = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0
FORMATS = ("torch", "torch_dist")


class MegatronCheckpointError(UserError, ValueError):
    pass


# ---------------------------------------------------------------------------------------------- layout
def iteration_folder(root: str, step: int | str) -> str:
    return os.path.join(root, "release" if step == "release" else f"iter_{int(step):07d}")


def read_latest(root: str) -> int | str | None:
    path = os.path.join(root, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    return "release" if text == "release" else int(text)


def resolve_step_folder(root: str, step: int | None = None) -> str:
    """The step folder of a checkpoint root (``step`` or the latest); a step folder itself is accepted."""
    if checkpoint_format(root) is not None:
        return root
    chosen = read_latest(root) if step is None else step
    if chosen is None:
        raise MegatronCheckpointError(f"{root}: no {LATEST} (not a Megatron checkpoint directory)")
    folder = iteration_folder(root, chosen)
    if checkpoint_format(folder) is None:
        raise MegatronCheckpointError(f"{folder}: no Megatron checkpoint there (neither mp_rank_*/ nor .distcp)")
    return folder


def is_checkpoint_root(path: str) -> bool:
    return os.path.isdir(path) and (read_latest(path) is not None or checkpoint_format(path) is not None)


def checkpoint_format(folder: str) -> str | None:
    """'torch_dist', 'torch' or None for a step folder."""
    if not os.path.isdir(folder):
        return None
    names = os.listdir(folder)
    if "metadata.json" in names and any(n.endswith(".distcp") for n in names):
        return "torch_dist"
    if any(n.startswith("mp_rank_") and os.path.isfile(os.path.join(folder, n, "model_optim_rng.pt")) for n in names):
        return "torch"
    return None


def write_latest(root: str, step: int | str) -> None:
    tmp = os.path.join(root, LATEST + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(step))
    os.replace(tmp, os.path.join(root, LATEST))


# ---------------------------------------------------------------------------------------------- CUDA on CPU
@contextlib.contextmanager
def checkpoint_io_on_cpu():
    """megatron-core's dist-checkpoint code calls ``torch.cuda.synchronize()`` and allocates a flag with
    ``device=torch.cuda.current_device()`` even for CPU tensors; without CUDA both are redirected to the
    CPU for the duration of one save or load (the conversion tools run on machines without GPUs)."""
    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.current_device, torch.cuda.synchronize
    torch.cuda.current_device, torch.cuda.synchronize = (lambda: "cpu"), (lambda device=None: None)
    try:
        yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize = saved


# ---------------------------------------------------------------------------------------------- optimizer
def ensure_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's (empty) per-parameter state so that a checkpoint can be loaded into it: AdamW's
    step and moments (in their storage dtypes: bf16 with --exp-avg-dtype bf16, which a load keeps), or SGD's
    momentum buffer (--optimizer sgd; none without momentum)."""
    from vime.backends.adamw_state_dtype import AdamWWithStateDtype

    for group in optimizer.param_groups:
        for param in group["params"]:
            if isinstance(optimizer, AdamWWithStateDtype):
                optimizer.init_state(param)
                continue
            state = optimizer.state[param]
            if state:
                continue
            if isinstance(optimizer, torch.optim.SGD):
                if group["momentum"]:
                    state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                continue
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def _optimizer_step(optimizer: torch.optim.Optimizer) -> float:
    steps = [float(s["step"]) for s in optimizer.state.values() if "step" in s]
    return max(steps, default=0.0)


def _has_state(optimizer: torch.optim.Optimizer | None) -> bool:
    return optimizer is not None and any(optimizer.state.values())


# ---------------------------------------------------------------------------------------------- ranks
def _ranks() -> tuple[int, int, int, int]:
    """(tensor rank, tensor size, pipeline rank, data rank); context-parallel ranks are replicas too."""
    from megatron.core import parallel_state as ps

    return (
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_data_parallel_rank(with_context_parallel=True),
    )


def _rank_folder(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    return f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def is_first_rank() -> bool:
    """The one rank that writes what every rank would write alike (global rank 0, or no group)."""
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


# ---------------------------------------------------------------------------------------------- save
def save(
    folder: str,
    model,
    optimizer: torch.optim.Optimizer | None,
    *,
    fmt: str,
    iteration: int,
    args: dict,
    extra: dict | None = None,
) -> None:
    """Write ``model`` (and ``optimizer`` when it has state) into the step folder ``folder``, which may
    already exist. Every rank calls it."""
    if fmt not in FORMATS:
        raise MegatronCheckpointError(f"--ckpt-format {fmt!r}: expected one of {FORMATS}")
    os.makedirs(folder, exist_ok=True)
    barrier()
    with_optimizer = _has_state(optimizer)
    common = {
        "iteration": iteration,
        "args": args,
        "checkpoint_version": CHECKPOINT_VERSION,
        "vime": {
            **(extra or {}),
            "has_optimizer": with_optimizer,
            "optimizer_step": _optimizer_step(optimizer) if with_optimizer else 0.0,
        },
    }
    if fmt == "torch":
        _save_torch(folder, model, optimizer if with_optimizer else None, common)
    else:
        _save_torch_dist(folder, model, optimizer if with_optimizer else None, common)
    barrier()


def _save_torch(folder: str, model, optimizer, common: dict) -> None:
    from megatron.core import parallel_state as ps

    tp_rank, _, pp_rank, dp_rank = _ranks()
    if dp_rank != 0:
        return
    sub = os.path.join(folder, _rank_folder(tp_rank, pp_rank, ps.get_pipeline_model_parallel_world_size()))
    os.makedirs(sub, exist_ok=True)
    state = {
        **common,
        "model": {k: v for k, v in from_te_names(model.state_dict()).items() if not k.endswith("_extra_state")},
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "rng_state": [rng_state()],
    }
    tmp = os.path.join(sub, "model_optim_rng.pt.tmp")
    torch.save(state, tmp)
    os.replace(tmp, os.path.join(sub, "model_optim_rng.pt"))


def _sharded_optimizer_state(model_sharded: dict, optimizer) -> dict:
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    state = optimizer.state_dict()
    id_map = get_param_id_to_sharded_param_map(model_sharded, [p for g in optimizer.param_groups for p in g["params"]])
    optim_state_to_sharding_state(state, id_map, exclude_keys=("step",))
    return state


def _save_torch_dist(folder: str, model, optimizer, common: dict) -> None:
    from megatron.core import dist_checkpointing

    sharded = {"model": model.sharded_state_dict()}
    if optimizer is not None:
        sharded["optimizer"] = _sharded_optimizer_state(sharded["model"], optimizer)
    sharded.update(common)
    sharded["rng_state"] = rng_state()
    with checkpoint_io_on_cpu():
        dist_checkpointing.save(sharded, folder)


# ---------------------------------------------------------------------------------------------- load
def load(
    folder: str,
    model,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    restore_rng: bool = False,
    skip: tuple[str, ...] = (),
) -> dict:
    """Load a step folder (either format) into ``model`` and, when the checkpoint has one and
    ``optimizer`` is given, the optimizer; returns the checkpoint's common part (iteration, args, vime).

    ``skip``: parameter-name prefixes neither loaded nor required (PPO's critic takes the body of an
    actor's checkpoint and keeps its own value head); the optimizer cannot be loaded then."""
    fmt = checkpoint_format(folder)
    if fmt is None:
        raise MegatronCheckpointError(f"{folder}: no Megatron checkpoint there (neither mp_rank_*/ nor .distcp)")
    assert not (skip and optimizer is not None), "a partial load cannot restore the optimizer"
    if fmt == "torch":
        return _load_torch(folder, model, optimizer, restore_rng, skip)
    return _load_torch_dist(folder, model, optimizer, restore_rng, skip)


def read_common(folder: str) -> dict:
    """The common part (iteration, args, checkpoint_version, vime) of a step folder, without its tensors."""
    fmt = checkpoint_format(folder)
    if fmt is None:
        raise MegatronCheckpointError(f"{folder}: no Megatron checkpoint there (neither mp_rank_*/ nor .distcp)")
    if fmt == "torch":
        rank = sorted(n for n in os.listdir(folder) if n.startswith("mp_rank_"))[0]
        # mmap: the tensors are not read, only the small entries picked below.
        state = torch.load(
            os.path.join(folder, rank, "model_optim_rng.pt"), map_location="cpu", mmap=True, weights_only=False
        )
    else:
        from megatron.core import dist_checkpointing

        with checkpoint_io_on_cpu():
            state = dist_checkpointing.load_common_state_dict(folder)
    return {k: state.get(k) for k in ("iteration", "args", "checkpoint_version", "vime")}


def _skipped(name: str, skip: tuple[str, ...]) -> bool:
    return bool(skip) and name.startswith(skip)


def _load_model_state(model, state: dict, skip: tuple[str, ...] = ()) -> None:
    """Load a (canonically named) local state dict into ``model``, whatever its layer spec."""
    from vime.backends.megatron_weights import VOCAB_PARAMS

    state = from_te_names(state)
    if getattr(model, "vime_uses_te", False):
        state = to_te_names(state, grouped_gemm=getattr(model, "vime_grouped_gemm", False))
    state = {n: v for n, v in state.items() if not _skipped(n, skip)}
    params = {n: p for n, p in model.named_parameters() if not _skipped(n, skip)}
    missing = [n for n in params if n not in state]
    unused = [n for n in state if n not in params and not n.endswith("_extra_state")]
    if missing or unused:
        raise MegatronCheckpointError(
            f"checkpoint does not fit the model: missing {missing[:6]}, unexpected {unused[:6]}"
        )
    with torch.no_grad():
        for name, param in params.items():
            value = state[name]
            if name in VOCAB_PARAMS and value.shape != param.shape and value.shape[1:] == param.shape[1:]:
                # Another --make-vocab-size-divisible-by: the rows past the vocabulary are padding.
                rows = min(value.shape[0], param.shape[0])
                value = torch.cat([value[:rows], value.new_zeros(param.shape[0] - rows, *param.shape[1:])])
            if value.shape != param.shape:
                raise MegatronCheckpointError(
                    f"{name}: checkpoint shape {tuple(value.shape)}, model "
                    f"{tuple(param.shape)} (a 'torch' checkpoint loads only with the "
                    "tensor parallelism it was saved with; use --ckpt-format torch_dist)"
                )
            param.copy_(value.to(param.device, param.dtype))


def _load_torch(folder: str, model, optimizer, restore_rng: bool, skip: tuple[str, ...] = ()) -> dict:
    from megatron.core import parallel_state as ps

    tp_rank, tp_size, pp_rank, _ = _ranks()
    ranks = sorted(n for n in os.listdir(folder) if n.startswith("mp_rank_"))
    path = os.path.join(
        folder, _rank_folder(tp_rank, pp_rank, ps.get_pipeline_model_parallel_world_size()), "model_optim_rng.pt"
    )
    if len(ranks) != tp_size * ps.get_pipeline_model_parallel_world_size() or not os.path.isfile(path):
        raise MegatronCheckpointError(
            f"{folder} is a 'torch' checkpoint of {len(ranks)} model-parallel rank(s) ({', '.join(ranks)}); this run "
            f"has tensor x pipeline parallelism {tp_size} x {ps.get_pipeline_model_parallel_world_size()}. The "
            "'torch' format loads only with the parallelism it was saved with: convert it, or save with "
            "--ckpt-format torch_dist"
        )
    state = torch.load(path, map_location="cpu", weights_only=False)
    _load_model_state(model, state["model"], skip)
    if optimizer is not None and state.get("optimizer") is not None:
        optimizer.load_state_dict(state["optimizer"])
    if restore_rng and state.get("rng_state"):
        restore_rng_state(state["rng_state"][0])
    return {k: state.get(k) for k in ("iteration", "args", "checkpoint_version", "vime")}


def _load_torch_dist(folder: str, model, optimizer, restore_rng: bool, skip: tuple[str, ...] = ()) -> dict:
    from megatron.core import dist_checkpointing

    with checkpoint_io_on_cpu():
        common = dist_checkpointing.load_common_state_dict(folder)
        vime = common.get("vime") or {}
        sharded = {"model": {k: v for k, v in model.sharded_state_dict().items() if not _skipped(k, skip)}}
        with_optimizer = optimizer is not None and vime.get("has_optimizer", False)
        if with_optimizer:
            ensure_optimizer_state(optimizer)
            sharded["optimizer"] = _sharded_optimizer_state(sharded["model"], optimizer)
        loaded = dist_checkpointing.load(sharded, folder)
    missing, unexpected = model.load_state_dict(loaded["model"], strict=False)
    missing = [n for n in missing if not n.endswith("_extra_state") and not _skipped(n, skip)]
    if missing or unexpected:
        raise MegatronCheckpointError(
            f"{folder} does not fit the model: missing {missing[:6]}, unexpected {unexpected[:6]}"
        )
    if with_optimizer:
        state = loaded["optimizer"]
        step = torch.tensor(float(vime.get("optimizer_step", 0.0)))
        for param_state in state["state"].values():
            if "exp_avg" in param_state:  # AdamW's step count (SGD's state has none)
                param_state["step"] = step.clone()
        optimizer.load_state_dict(state)
    if restore_rng and common.get("rng_state"):
        restore_rng_state(common["rng_state"])
    return {k: common.get(k) for k in ("iteration", "args", "checkpoint_version", "vime")}
