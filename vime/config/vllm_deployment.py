"""``--vllm-config`` resolution: the cascade from a parsed config (or none) to a :class:`Deployment`.

:func:`resolve` applies the cascade (group > model > global flags), infers ``update_weights``, checks the
GPU total, the PD rule and the engine division; :func:`default_deployment` builds the same object without
a YAML (one model, or the legacy ``--prefill-num-servers`` PD split), so the driver has one code path.
Pure functions: nothing here starts a process.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from typing import Any, Literal

from vime.config.base import ConfigError
from vime.config.vllm_config import (
    ModelConfig,
    ServerGroupConfig,
    VllmConfigFile,
    WorkerType,
    fail,
    field_name,
)

logger = logging.getLogger(__name__)

# The parallel sizes that, with tensor parallelism, make up the GPUs of one engine.
_ENGINE_PARALLEL_FLAGS = ("data-parallel-size", "pipeline-parallel-size", "prefill-context-parallel-size")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GlobalFlags:
    """The command-line values the cascade falls back to."""

    hf_checkpoint: str
    """``--hf-checkpoint``: the default model path, and the weights training updates."""
    rollout_num_gpus: int
    """``--rollout-num-gpus``: the server groups of all models must add up to it."""
    rollout_num_gpus_per_engine: int = 1
    """``--rollout-num-gpus-per-engine``: the last fallback of num_gpus_per_engine."""
    vllm_args: Mapping[str, str | None] = dataclasses.field(default_factory=dict)
    """The forwarded ``--vllm-*`` flags (prefix removed); group overrides apply on top."""
    gpus_per_node: int | None = None
    """GPUs of one rollout node; engines larger than that span several nodes. None: one node."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResolvedGroup:
    """A server group after the cascade: how many engines, of which size, with which vLLM flags."""

    path: str
    """Where it came from, for messages: ``vllm[0].server_groups[1]``."""
    index: int
    """Position in the model's server_groups."""
    worker_type: WorkerType
    num_gpus: int
    num_gpus_per_engine: int
    num_engines: int
    """0 for a placeholder group."""
    nodes_per_engine: int
    """1 unless an engine needs more GPUs than one node has."""
    tensor_parallel_size: int
    """num_gpus_per_engine / (data x pipeline x prefill-context parallel sizes); 0 for a placeholder."""
    overrides: dict[str, Any]
    """The group's overrides with EngineArgs field names (model_path removed)."""
    vllm_args: dict[str, str | None]
    """The ``--vllm-*`` flags with the overrides applied; the roles are added by the launch plan."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResolvedModel:
    name: str
    model_path: str
    update_weights: bool
    update_weights_inferred: bool
    """True when update_weights was not in the YAML and was inferred from the model path."""
    groups: tuple[ResolvedGroup, ...]

    @property
    def num_gpus(self) -> int:
        return sum(group.num_gpus for group in self.groups)

    @property
    def num_engines(self) -> int:
        return sum(group.num_engines for group in self.groups)

    @property
    def pd_disaggregation(self) -> bool:
        return any(group.worker_type in ("prefill", "decode") for group in self.groups)

    @property
    def has_encoder(self) -> bool:
        return any(group.worker_type == "encoder" for group in self.groups)

    def groups_of(self, worker_type: str) -> tuple[ResolvedGroup, ...]:
        return tuple(group for group in self.groups if group.worker_type == worker_type)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Deployment:
    """The resolved engine topology of a run: every model with its server groups."""

    models: tuple[ResolvedModel, ...]
    origin: Literal["vllm-config", "prefill-num-servers", "default"]
    warnings: tuple[str, ...] = ()

    @property
    def num_gpus(self) -> int:
        return sum(model.num_gpus for model in self.models)

    @property
    def num_engines(self) -> int:
        return sum(model.num_engines for model in self.models)

    def model(self, name: str) -> ResolvedModel:
        for model in self.models:
            if model.name == name:
                return model
        raise KeyError(f"no model named {name!r}; models: {', '.join(m.name for m in self.models)}")

    @property
    def weight_synced_models(self) -> tuple[ResolvedModel, ...]:
        """The models that receive every new weight version from training."""
        return tuple(model for model in self.models if model.update_weights)


def resolve(config: VllmConfigFile, flags: GlobalFlags) -> Deployment:
    """Apply the cascade to a checked ``--vllm-config`` and validate it against the flags."""
    notes: list[str] = []
    models = tuple(_resolve_model(f"vllm[{i}]", model, flags, notes) for i, model in enumerate(config.vllm))
    total = sum(model.num_gpus for model in models)
    if total != flags.rollout_num_gpus:
        parts = " + ".join(f"{model.name} {model.num_gpus}" for model in models)
        fail(
            f"the server groups use {total} GPUs in all ({parts}), but --rollout-num-gpus is "
            f"{flags.rollout_num_gpus}; the two must be equal (encoder and placeholder groups count too)"
        )
    for note in notes:
        logger.warning("--vllm-config: %s", note)
    return Deployment(models=models, origin="vllm-config", warnings=tuple(notes))


def _resolve_model(where: str, model: ModelConfig, flags: GlobalFlags, notes: list[str]) -> ResolvedModel:
    model_path = _model_path(where, model, flags.hf_checkpoint)
    if model.update_weights is None:
        update_weights = _same_checkpoint(model_path, flags.hf_checkpoint)
        if not update_weights:
            notes.append(
                f"{where} ({model.name}): update_weights is not set and its model path {model_path!r} is "
                f"not --hf-checkpoint {flags.hf_checkpoint!r}, so it is served frozen "
                "(update_weights: false); set update_weights to silence this"
            )
    else:
        update_weights = model.update_weights
    if update_weights and any(group.worker_type == "encoder" for group in model.server_groups):
        notes.append(
            f"{where} ({model.name}): weight updates into an encoder/language-only (EPD) split are "
            "not covered by tests yet; consider update_weights: false for this model"
        )
    if model.num_gpus_per_engine is not None:
        default_size = (model.num_gpus_per_engine, f"{where}.num_gpus_per_engine")
    else:
        default_size = (flags.rollout_num_gpus_per_engine, "--rollout-num-gpus-per-engine")
    groups = tuple(
        _resolve_group(f"{where}.server_groups[{k}]", k, group, default_size, flags)
        for k, group in enumerate(model.server_groups)
    )
    return ResolvedModel(
        name=model.name,
        model_path=model_path,
        update_weights=update_weights,
        update_weights_inferred=model.update_weights is None,
        groups=groups,
    )


def _model_path(where: str, model: ModelConfig, hf_checkpoint: str) -> str:
    """Group overrides.model_path > model model_path > --hf-checkpoint; one path per model."""
    if model.model_path is not None:
        default = (model.model_path, f"{where}.model_path")
    else:
        default = (hf_checkpoint, "--hf-checkpoint")
    chosen: tuple[str, str] | None = None
    for k, group in enumerate(model.server_groups):
        if group.worker_type == "placeholder":
            continue  # starts nothing, so serves no checkpoint
        override = next((v for key, v in group.overrides.items() if field_name(key) == "model_path"), None)
        path = (override, f"{where}.server_groups[{k}].overrides.model_path") if override else default
        if chosen is None:
            chosen = path
        elif not _same_checkpoint(path[0], chosen[0]):
            fail(
                f"{path[1]} {path[0]!r} differs from {chosen[1]} {chosen[0]!r}; all server groups of a model "
                "serve the same checkpoint (define another model for another checkpoint)"
            )
    return _absolute_if_local((chosen or default)[0])


def _resolve_group(
    where: str, index: int, group: ServerGroupConfig, default_size: tuple[int, str], flags: GlobalFlags
) -> ResolvedGroup:
    if group.num_gpus_per_engine is not None:
        per_engine, source = group.num_gpus_per_engine, f"{where}.num_gpus_per_engine"
    else:
        per_engine, source = default_size
    overrides = {field_name(key): value for key, value in group.overrides.items()}
    overrides.pop("model_path", None)
    vllm_args = apply_overrides(flags.vllm_args, overrides)
    common = dict(
        path=where,
        index=index,
        worker_type=group.worker_type,
        num_gpus=group.num_gpus,
        num_gpus_per_engine=per_engine,
        overrides=overrides,
        vllm_args=vllm_args,
    )
    if group.worker_type == "placeholder":
        return ResolvedGroup(num_engines=0, nodes_per_engine=1, tensor_parallel_size=0, **common)
    nodes_per_engine = 1
    node = flags.gpus_per_node
    if node and per_engine > node:
        # A multi-node engine is divided by the GPUs of one node: it must fill whole nodes.
        if per_engine % node:
            fail(
                f"{where}: an engine of {per_engine} GPUs ({source}) is larger than a node of {node} GPUs, "
                f"so it must span whole nodes (a multiple of {node})"
            )
        nodes_per_engine = per_engine // node
    if group.num_gpus % per_engine:
        fail(f"{where}.num_gpus {group.num_gpus} is not a multiple of num_gpus_per_engine {per_engine} (from {source})")
    return ResolvedGroup(
        num_engines=group.num_gpus // per_engine,
        nodes_per_engine=nodes_per_engine,
        tensor_parallel_size=_tensor_parallel_size(where, per_engine, vllm_args),
        **common,
    )


def _tensor_parallel_size(where: str, per_engine: int, vllm_args: Mapping[str, str | None]) -> int:
    """An engine's GPUs are tensor x data x pipeline x prefill-context parallel."""
    sizes = []
    for flag in _ENGINE_PARALLEL_FLAGS:
        raw = vllm_args.get(flag)
        try:
            size = int(raw) if raw is not None else 1
        except ValueError:
            fail(f"{where}: {flag} {raw!r} is not an integer")
        if size < 1:
            fail(f"{where}: {flag} must be >= 1, got {size}")
        sizes.append(size)
    product = sizes[0] * sizes[1] * sizes[2]
    if per_engine % product:
        fail(
            f"{where}: an engine of {per_engine} GPUs cannot be split into data x pipeline x "
            f"prefill-context parallel = {' x '.join(map(str, sizes))}"
        )
    return per_engine // product


def apply_overrides(base: Mapping[str, str | None], overrides: Mapping[str, Any]) -> dict[str, str | None]:
    """``--vllm-*`` flags (``{"max-model-len": "64", "enforce-eager": None}``) with EngineArgs
    overrides on top: true/false set or negate a switch (``no-<flag>``), null drops a flag inherited
    from the command line, mappings and lists become JSON, anything else its string."""
    args = dict(base)
    for key, value in overrides.items():
        flag = field_name(key).replace("_", "-")
        negated = flag[3:] if flag.startswith("no-") else "no-" + flag
        if value is None:
            args.pop(flag, None)
            args.pop(negated, None)
        elif isinstance(value, bool):
            args.pop(negated if value else flag, None)
            args[flag if value else negated] = None
        elif isinstance(value, (Mapping, list)):
            args[flag] = json.dumps(value)
        else:
            args[flag] = str(value)
    return args


def _absolute_if_local(path: str) -> str:
    """Existing local paths become absolute (engines run in other directories); hub ids stay."""
    if "://" in path or not os.path.exists(path):
        return path
    return os.path.abspath(path)


def _same_checkpoint(a: str, b: str) -> bool:
    if a == b:
        return True
    if "://" in a or "://" in b:
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)


def trained_model_name(deployment: Deployment) -> str:
    """The model `vime train` trains: the one whose engines receive every weight update and which
    the built-in rollout samples from (through the run's main router)."""
    synced = deployment.weight_synced_models
    if len(synced) != 1:
        names = ", ".join(model.name for model in synced) or "none"
        fail(
            f"exactly one model must receive weight updates (update_weights: true, or inferred from a model path "
            f"equal to --hf-checkpoint): the model being trained; found {len(synced)} ({names}). "
            "Set update_weights: false on the frozen ones"
        )
    return synced[0].name


def default_deployment(
    flags: GlobalFlags, *, prefill_num_servers: int | None = None, name: str = "default"
) -> Deployment:
    """The topology without ``--vllm-config``: one model on ``--hf-checkpoint`` that receives
    weight updates, with one regular group of all rollout GPUs, or -- with the legacy
    ``--prefill-num-servers N`` -- N prefill engines and decode engines on the remaining GPUs.
    ``--rollout-num-gpus 0`` gives the model no group (its router starts, no engine)."""
    per_engine = flags.rollout_num_gpus_per_engine
    total = flags.rollout_num_gpus
    if prefill_num_servers is None:
        layout = [("regular", total)] if total > 0 else []
    else:
        prefill_gpus = prefill_num_servers * per_engine
        if prefill_gpus >= total:
            raise ConfigError(
                "--prefill-num-servers",
                f"{prefill_num_servers} prefill engine(s) x {per_engine} GPU(s) leave no GPU for "
                f"decode engines out of --rollout-num-gpus {total}",
            )
        layout = [("prefill", prefill_gpus), ("decode", total - prefill_gpus)]
    try:
        groups = tuple(
            _resolve_group(
                f"the {kind} engines",
                k,
                ServerGroupConfig(worker_type=kind, num_gpus=gpus),
                (per_engine, "--rollout-num-gpus-per-engine"),
                flags,
            )
            for k, (kind, gpus) in enumerate(layout)
        )
    except ConfigError as error:  # no YAML here: the engine size comes from this flag
        raise ConfigError("--rollout-num-gpus-per-engine", error.message) from None
    model = ResolvedModel(
        name=name,
        model_path=_absolute_if_local(flags.hf_checkpoint),
        update_weights=True,
        update_weights_inferred=True,
        groups=groups,
    )
    return Deployment(models=(model,), origin="default" if prefill_num_servers is None else "prefill-num-servers")


def check_overrides_against_vllm(deployment: Deployment, vllm_flags: Mapping[str, bool]) -> None:
    """Refuse group overrides the installed vLLM has no flag for, naming the field path.

    ``vllm_flags`` is ``{"--flag": takes_value}`` of the installed vLLM server (empty: skip the
    check). The guide's examples use some SGLang spellings; the message names vLLM's equivalent.
    """
    if not vllm_flags:
        return
    for model in deployment.models:
        for group in model.groups:
            for field in group.overrides:
                flag = "--" + field.replace("_", "-")
                if flag in vllm_flags:
                    continue
                hint = _SGLANG_NAMES.get(field)
                fail(
                    f"{group.path}.overrides.{field}: vLLM has no flag {flag}"
                    + (f" ({field} is SGLang's name; {hint})" if hint else "")
                )


# SGLang server arguments that users of the reference guide may carry over, and vLLM's equivalent.
_SGLANG_NAMES = {
    "mem_fraction_static": "vLLM's is gpu_memory_utilization",
    "context_length": "vLLM's is max_model_len",
    "chunked_prefill_size": "vLLM's is max_num_batched_tokens",
    "max_running_requests": "vLLM's is max_num_seqs",
    "enable_torch_compile": "vLLM compiles by default; enforce_eager: true turns it off",
    "disable_radix_cache": "vLLM's is enable_prefix_caching: false",
    "tp_size": "use num_gpus_per_engine",
    "dp_size": "vLLM's is data_parallel_size",
}
