"""PPO's critic on megatron-core (``--advantage-estimator ppo`` with ``--train-backend megatron``).

The critic is a second GPTModel of the actor's architecture whose output layer is a value head
(:class:`ValueHead`, hidden -> 1) instead of the vocabulary projection, so that megatron-core's own
forward (embedding, decoder, final norm, "output layer") returns one value per position and the
actor's batching (``megatron_forward.MegatronLM``: padded or thd) serves it unchanged.

**Decision** (the torch backend's, ``value_model.ValueModel``): the body starts from the actor's
initial weights (or the critic role's ``load``); the head is ``torch.nn.Linear(hidden, 1)`` in
PyTorch's default initialisation, drawn from ``--seed``. The critic's checkpoints are Megatron
checkpoints of that GPT (head included, as ``output_layer.weight`` / ``output_layer.bias``) marked
``vime.role = "critic"``.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from vime.backends import megatron_checkpoint as mc
from vime.backends.megatron_args import ModelArgs
from vime.config.base import ConfigError
from vime.config.roles import FLAG as ROLES_FLAG

ROLE = "critic"  # common["vime"]["role"] of a critic checkpoint
CHECKPOINT_DIR = "critic"  # the critic's folder inside the run's iter_XXXXXXX/
HEAD_PREFIX = "output_layer."


class ValueHead(torch.nn.Linear):
    """GPTModel's output layer replaced by a one-output linear layer (replicated on every TP rank).

    It takes the output layer's call (``weight`` / ``runtime_gather_output`` are the vocabulary
    projection's and do not apply) and returns ``(values [s, b, 1], None)``.
    """

    def __init__(self, hidden_size: int, sequence_parallel: bool):
        super().__init__(hidden_size, 1)
        self.sequence_parallel = sequence_parallel
        for param in self.parameters():
            # Under sequence parallelism each rank sees a slice of the sequence, so its head gradient is
            # partial: the backend's gradient reduction all-reduces parameters marked like this.
            param.sequence_parallel = sequence_parallel

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        values = super().forward(hidden_states.float())
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            # The head is replicated, not split: the gathered values' gradient is only scattered back.
            values = gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False)
        return values, None


def build_value_gpt(args: ModelArgs, parallel, *, seed: int, **build_kwargs):
    """A GPTModel of ``args`` with a :class:`ValueHead` as its output layer (body uninitialised unless
    ``build_kwargs`` say otherwise; the caller loads it)."""
    from vime.backends import megatron_model as mm

    # Untied: with tied embeddings megatron-core would hand the embedding matrix to the output layer
    # and tie the two in its sharded state dict; the critic's head has nothing to share.
    gpt = mm.build_gpt_model(dataclasses.replace(args, tie_embeddings=False), parallel, **build_kwargs)
    if not gpt.post_process:
        return gpt  # a pipeline stage before the last: no output layer, no head
    with torch.random.fork_rng(devices=[]):
        # Its own stream: the same head on every TP rank, and the run's RNG (dropout, the actor) untouched.
        torch.manual_seed(seed)
        head = ValueHead(args.hidden_size, parallel.sequence_parallel)
    gpt.output_layer = head.to(mm.device())
    return gpt


# ---------------------------------------------------------------------------------------------- loading
def load_hf_body(gpt, folder: str, args: ModelArgs) -> None:
    """The body from an HF causal-LM folder, or from a torch-backend critic's ``model/`` (a bare
    transformer body, names without ``model.``); the head is left as it is."""
    from vime.backends.megatron_convert import hf_to_mcore, read_hf_state_dict
    from vime.backends.megatron_weights import load_canonical

    hf = read_hf_state_dict(folder)
    if "model.embed_tokens.weight" not in hf and "embed_tokens.weight" in hf:
        hf = {f"model.{k}": v for k, v in hf.items()}
    # No lm_head is needed (nor used) for the body: convert as a tied model.
    body = {
        k: v
        for k, v in hf_to_mcore(hf, dataclasses.replace(args, tie_embeddings=True)).items()
        if not k.startswith(HEAD_PREFIX)
    }
    # load_canonical wants every parameter: the head's own values stand in for the missing head (on the
    # last pipeline stage, which holds it).
    head = {HEAD_PREFIX + k: v.detach() for k, v in gpt.output_layer.state_dict().items()} if gpt.post_process else {}
    load_canonical(gpt, {**body, **head}, args)


def load_torch_critic_head(gpt, folder: str) -> None:
    from safetensors.torch import load_file

    from vime.backends.value_model import VALUE_HEAD_FILE

    if not gpt.post_process:
        return  # a pipeline stage before the last holds no head
    state = load_file(os.path.join(folder, VALUE_HEAD_FILE))
    with torch.no_grad():
        for name, param in gpt.output_layer.named_parameters():
            param.copy_(state[name].to(param.device, param.dtype))


def is_critic_checkpoint(folder: str) -> bool:
    return mc.checkpoint_format(folder) is not None and (mc.read_common(folder).get("vime") or {}).get("role") == ROLE


def load_initial(gpt, source: str, args: ModelArgs, *, field: str | None = None, yaml: str | None = None) -> None:
    """Start the critic from ``source``: a Megatron critic checkpoint (a critic's save folder, one of its
    step folders, or a PPO run's checkpoint: body and head), a Megatron actor checkpoint or an HF folder
    (the body; the head keeps its initialisation), or a torch-backend critic checkpoint (body and head).
    Weights only.

    ``field`` / ``yaml`` name the role's ``load`` for errors (None: ``source`` is the actor's source).
    """
    from vime.backends.value_model import LATEST_FILE, is_critic_checkpoint as is_torch_critic

    if mc.is_checkpoint_root(source):
        folder = mc.resolve_step_folder(source)
        if is_critic_checkpoint(os.path.join(folder, CHECKPOINT_DIR)):  # a PPO run's --save
            folder = os.path.join(folder, CHECKPOINT_DIR)
        # An actor's checkpoint has a vocabulary projection where the critic has its head: body only.
        mc.load(folder, gpt, skip=() if is_critic_checkpoint(folder) else (HEAD_PREFIX,))
        return
    if os.path.isfile(os.path.join(source, LATEST_FILE)):  # a torch-backend critic save folder
        with open(os.path.join(source, LATEST_FILE)) as f:
            source = os.path.join(source, f"iter_{int(f.read().strip()):07d}")
    if is_torch_critic(source):
        load_hf_body(gpt, os.path.join(source, "model"), args)
        load_torch_critic_head(gpt, source)
        return
    if os.path.isfile(os.path.join(source, "config.json")):
        load_hf_body(gpt, source, args)
        return
    if field is None:
        raise ValueError(f"{source!r}: neither a Megatron checkpoint nor an HF model folder")
    raise ConfigError(
        ROLES_FLAG,
        f"{yaml or '<yaml>'}: {field}: {source!r} is neither a Megatron checkpoint "
        "(critic or actor), a critic save folder nor an HF model folder (config.json)",
    )


# ---------------------------------------------------------------------------------------------- saving
def save(folder: str, gpt, optimizer, *, fmt: str, iteration: int, args: dict, optimizer_steps: int) -> None:
    mc.save(
        folder,
        gpt,
        optimizer,
        fmt=fmt,
        iteration=iteration,
        args={**args, "value_head": True},
        extra={"role": ROLE, "optimizer_steps": optimizer_steps},
    )


def export(root: str, gpt, optimizer, *, fmt: str, iteration: int, args: dict, optimizer_steps: int) -> str:
    """A copy of the critic in its role's ``save`` folder: ``iter_{iteration:07d}/`` (written under a
    temporary name, then renamed into place) and ``latest_checkpointed_iteration.txt``, a Megatron
    checkpoint root that a later run's critic ``load`` accepts. Every rank calls it."""
    import shutil

    final = mc.iteration_folder(root, iteration)
    # One name on every rank (they write into the same folder).
    staging = os.path.join(root, f".{os.path.basename(final)}.tmp")
    first = mc.is_first_rank()
    if first:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
    mc.barrier()
    save(staging, gpt, optimizer, fmt=fmt, iteration=iteration, args=args, optimizer_steps=optimizer_steps)
    if first:
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(staging, final)
        mc.write_latest(root, iteration)
    mc.barrier()
    return final
