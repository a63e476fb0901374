"""``--bf16`` for replicated (unsharded) models, the torch backend's and the Megatron backend's: bf16 model,
float32 master weights.

The module's parameters are cast to bfloat16, so forward and backward run in bf16 (its buffers, e.g. the
rotary frequencies, keep their dtype, as HF's own bf16 loading leaves them). A float32 copy of every
parameter (the *masters*) is what the optimizer steps, so AdamW's moments are float32 too:

1. each backward accumulates into the bf16 ``.grad``; a post-accumulate hook adds it (upcast) to the
   master's float32 ``.grad`` and drops the bf16 one, so several micro-batches add up in float32;
2. the backend sums the masters' gradients over the data-parallel ranks and clips them there (the global
   norm in float32): :meth:`ModelRole.parameters <vime.backends.torch_backend.ModelRole.parameters>` are
   the masters;
3. AdamW steps the masters, then :meth:`MasterWeights.refresh` rounds them into the bf16 parameters.

An update smaller than bf16's resolution (8 bits of mantissa) is kept by the masters and reaches the bf16
copy once the updates add up to a representable step; without masters it would be rounded away every step.

Weights leave the trainer from the masters (:meth:`MasterWeights.parameters_as`): the float32 values for
checkpoints (a resume is exact), cast to the engines' dtype for publication (:func:`engine_dtype`).

FSDP2 (``--use-distributed-optimizer`` on several ranks, vime/backends/fsdp.py) keeps float32 shards and
gathers bf16 itself (``MixedPrecisionPolicy``): :func:`master_weights` builds nothing for a sharded module. The
Megatron backend's sharded optimizer (vime/backends/sharded_optimizer.py) keeps masters of its own ranks' range
only, and does not use :class:`MasterWeights`.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator

import torch

# vLLM's --dtype values (vllm serve --help) -> torch dtypes; "auto" is the checkpoint's own.
_VLLM_DTYPES = {
    "half": torch.float16,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float": torch.float32,
    "float32": torch.float32,
}


def engine_dtype(vllm_dtype: str | None, hf_checkpoint: str) -> torch.dtype:
    """The dtype the engines hold the weights in: ``--vllm-dtype``, or with ``auto`` (vLLM's default) the
    checkpoint's ``torch_dtype`` (float32 when it names none). vLLM casts what it loads to its own dtype,
    so publishing in that dtype loses nothing the engine would keep and writes no more bytes than it needs."""
    if vllm_dtype not in (None, "auto"):
        if vllm_dtype not in _VLLM_DTYPES:
            raise ValueError(f"--vllm-dtype {vllm_dtype!r}: expected auto or one of {sorted(_VLLM_DTYPES)}")
        return _VLLM_DTYPES[vllm_dtype]
    config = os.path.join(hf_checkpoint, "config.json")
    name = None
    if os.path.isfile(config):
        with open(config) as f:
            data = json.load(f)
        name = data.get("dtype") or data.get("torch_dtype")  # transformers 5 writes "dtype", 4 "torch_dtype"
    dtype = getattr(torch, str(name), None) if name else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def _is_sharded(module: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2 shards nothing
        return False
    return isinstance(module, FSDPModule)


def master_weights(module: torch.nn.Module, bf16: bool) -> MasterWeights | None:
    """With ``bf16``, make ``module`` bf16 and return its float32 masters; None without ``bf16`` or when
    FSDP2 shards ``module`` (its mixed-precision policy does this job there)."""
    if not bf16 or _is_sharded(module):
        return None
    return MasterWeights(module)


def copy_parameter_attributes(source: torch.Tensor, target: torch.Tensor) -> None:
    """The public attributes a framework keeps on a parameter, onto another tensor (private ones, such as
    torch's hooks, stay where they are)."""
    target.__dict__.update({key: value for key, value in vars(source).items() if not key.startswith("_")})


def parameter_places(module: torch.nn.Module, params: list[torch.Tensor]) -> list[tuple[torch.nn.Module, str, int]]:
    """Every place one of ``params`` sits in ``module`` (a tied parameter sits in two submodules), as
    (submodule, attribute, index in ``params``): where :func:`installed` puts other tensors in their stead."""
    index = {id(p): i for i, p in enumerate(params)}
    return [
        (sub, leaf, index[id(p)])
        for sub in module.modules()
        for leaf, p in sub._parameters.items()
        if p is not None and id(p) in index
    ]


@contextlib.contextmanager
def installed(places, tensors: list[torch.Tensor], originals: list[torch.Tensor]) -> Iterator[None]:
    """``tensors[i]`` in the places of ``originals[i]`` (:func:`parameter_places`) for the time of the block."""
    for sub, leaf, i in places:
        sub._parameters[leaf] = tensors[i]
    try:
        yield
    finally:
        for sub, leaf, i in places:
            sub._parameters[leaf] = originals[i]


def accumulate_grad_into(target: torch.Tensor):
    """A post-accumulate-grad hook for a bf16 parameter: its gradient is added, in float32, to ``target``'s
    (micro-batches of one step add up there, not in bf16) and freed, so no bf16 gradient outlives its backward."""

    def move(param: torch.Tensor) -> None:
        if target.grad is None:
            target.grad = param.grad.to(torch.float32)
        else:
            target.grad.add_(param.grad)
        param.grad = None

    return move


class MasterWeights:
    """Float32 master copies of ``module``'s parameters; the module itself becomes bf16."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype = torch.bfloat16):
        self.module = module
        self.dtype = dtype
        # named_parameters() lists a tied parameter once, under its first name (what save_pretrained keeps).
        named = list(module.named_parameters())
        self.names = [name for name, _ in named]
        self.model_params = [p for _, p in named]
        # Parameters too, so that they can stand in the module's place (parameters_as).
        self.params = [
            torch.nn.Parameter(p.detach().to(torch.float32, copy=True), requires_grad=p.requires_grad)
            for p in self.model_params
        ]
        # The attributes a framework keeps on its parameters (megatron-core's tensor_model_parallel,
        # partition_dim, sequence_parallel, shared, ...) describe the masters too: the gradient reductions and
        # the norm read them from what the optimizer steps. Private ones (torch's hooks) stay where they are.
        for p, master in zip(self.model_params, self.params):
            copy_parameter_attributes(p, master)
        self._places = parameter_places(module, self.model_params)
        for p in self.model_params:
            p.data = p.data.to(dtype)
        for p, master in zip(self.model_params, self.params):
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(accumulate_grad_into(master))

    @torch.no_grad()
    def refresh(self) -> None:
        """Round the masters into the bf16 parameters (after each optimizer step, after a load)."""
        for p, master in zip(self.model_params, self.params):
            p.data.copy_(master)

    @contextlib.contextmanager
    def parameters_as(self, dtype: torch.dtype = torch.float32) -> Iterator[torch.nn.Module]:
        """The module temporarily holds the masters in its parameters' places: in float32 the master
        parameters themselves (a state loaded into the module lands in the masters, and
        ``torch.distributed.checkpoint``'s ``get_state_dict(module, optimizer)`` finds the optimizer's
        parameters under their names), in another dtype cast copies. HF's ``save_pretrained`` then writes that
        dtype and names it in config.json. On exit the module holds its bf16 parameters again, refreshed from
        the masters."""
        tensors = self.params if dtype == torch.float32 else [self._cast(master, dtype) for master in self.params]
        try:
            with installed(self._places, tensors, self.model_params):
                yield self.module
        finally:
            self.refresh()

    @staticmethod
    def _cast(master: torch.nn.Parameter, dtype: torch.dtype) -> torch.nn.Parameter:
        cast = torch.nn.Parameter(master.detach().to(dtype), requires_grad=False)
        copy_parameter_attributes(master, cast)  # e.g. megatron-core's gather of tensor-parallel shards reads them
        return cast

    def named_tensors(self, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
        """(name, master cast to ``dtype``) per parameter, a tied one once: what the engines receive."""
        return [(name, master.detach().to(dtype)) for name, master in zip(self.names, self.params)]

    def to(self, device: torch.device) -> None:
        """Move the masters (and their gradients) in place: the optimizer keeps its references."""
        for master in self.params:
            master.data = master.data.to(device)
            if master.grad is not None:
                master.grad = master.grad.to(device)
