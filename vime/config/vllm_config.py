"""``--vllm-config``: the YAML that says which models vime serves, and with which engines.

Three layers, each a pure function of its input (nothing here starts a process):

1. **schema** -- :func:`load_vllm_config` / :func:`parse_vllm_config` read the YAML into typed
   msgspec structs; every problem is a :class:`ConfigError` on ``--vllm-config`` whose message
   names the field path, e.g. ``vllm[1].server_groups[0].num_gpus must be > 0``;
2. **resolution** -- :func:`resolve` applies the cascade (group > model > global flags), infers
   ``update_weights``, checks the GPU total, the PD rule and the engine division, and returns a
   :class:`Deployment`; :func:`default_deployment` builds the same object without a YAML (one
   model, or the legacy ``--prefill-num-servers`` PD split), so the driver has one code path;
3. **launch plan** -- :func:`build_launch_plan` turns a deployment into the vLLM arguments, roles
   and start order of every engine and the router of every model.

The runtime helpers :func:`get_model_url` and :func:`prime_encoder` read what the driver publishes
on ``args`` once the engines run (``args.vllm_model_routers``, ``args.vllm_model_encoder_endpoints``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import json
import logging
import os
import random
import re
import typing
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import msgspec

from vime.config.base import ConfigError

logger = logging.getLogger(__name__)

FLAG = "--vllm-config"

WorkerType = Literal["regular", "prefill", "decode", "encoder", "placeholder"]
WORKER_TYPES: tuple[str, ...] = typing.get_args(WorkerType)
RouterRole = Literal["regular", "prefill", "decode"]

# Model names key args.vllm_model_routers and appear in log file names.
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")

# vLLM flags vime derives; an override of them would contradict what vime allocated or binds.
_DERIVED_OVERRIDES = {
    "model": "use model_path",
    "host": "vime binds every engine itself",
    "port": "vime picks a free port for every engine",
    "tensor_parallel_size": "use num_gpus_per_engine (the tensor-parallel size is derived from it)",
}
# The parallel sizes that, with tensor parallelism, make up the GPUs of one engine.
_ENGINE_PARALLEL_FLAGS = ("data-parallel-size", "pipeline-parallel-size", "prefill-context-parallel-size")

# Upstream vLLM's reference encoder-cache connector (file-backed) and the KV connector that
# vllm-router's PD mode speaks by default.
DEFAULT_EC_CONNECTOR = "ECExampleConnector"
DEFAULT_KV_CONNECTOR = "NixlConnector"
# vllm-router's --kv-connector names for vLLM's KV connector classes.
_ROUTER_KV_CONNECTORS = {"NixlConnector": "nixl", "MooncakeConnector": "mooncake", "MoRIIOConnector": "moriio"}

DEFAULT_GENERATE_PATH = "/inference/v1/generate"


# ====================================================================================== schema
class ServerGroupConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """One server group: ``num_gpus`` GPUs split into engines of ``num_gpus_per_engine`` each."""

    worker_type: WorkerType
    num_gpus: int
    num_gpus_per_engine: int | None = None  # None: the model's, else --rollout-num-gpus-per-engine
    overrides: dict[str, Any] = msgspec.field(default_factory=dict)  # vLLM EngineArgs fields


class ModelConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """One served model; it gets its own router."""

    name: str
    server_groups: list[ServerGroupConfig]  # ``engine_groups`` is accepted as an alias
    model_path: str | None = None  # None: --hf-checkpoint
    update_weights: bool | None = None  # None: inferred from the model path
    num_gpus_per_engine: int | None = None


class VllmConfigFile(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """The whole ``--vllm-config`` document: a top-level ``vllm`` list of models."""

    vllm: list[ModelConfig]


def _fail(message: str) -> typing.NoReturn:
    raise ConfigError(FLAG, message)


def load_vllm_config(path: str | os.PathLike[str]) -> VllmConfigFile:
    """Read and check the YAML at ``path`` (schema and per-field rules; no flags needed)."""
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        _fail(f"{os.fspath(path)!r} does not exist")
    except OSError as error:
        _fail(f"cannot read {os.fspath(path)!r}: {error}")
    except yaml.YAMLError as error:
        _fail(f"{os.fspath(path)!r} is not valid YAML: {error}")
    return parse_vllm_config(data)


def parse_vllm_config(data: Any) -> VllmConfigFile:
    """Check an already-loaded YAML document and return it typed."""
    if data is None:
        _fail("vllm is required: the file holds no YAML document")
    if not isinstance(data, Mapping):
        _fail(f"the file must hold a mapping with a top-level 'vllm' list, not a {type(data).__name__}")
    try:
        config = msgspec.convert(_with_aliases(data), VllmConfigFile)
    except msgspec.ValidationError as error:
        _fail(_schema_message(str(error)))
    _check_fields(config)
    return config


def _with_aliases(data: Mapping) -> dict:
    """Rename the backward-compatible ``engine_groups`` to ``server_groups``."""
    data = dict(data)
    models = data.get("vllm")
    if isinstance(models, list):
        renamed = []
        for i, model in enumerate(models):
            if isinstance(model, Mapping) and "engine_groups" in model:
                if "server_groups" in model:
                    _fail(f"vllm[{i}] gives both server_groups and engine_groups (an alias of it); keep one")
                model = {("server_groups" if k == "engine_groups" else k): v for k, v in model.items()}
            renamed.append(model)
        data["vllm"] = renamed
    return data


_TYPE_WORDS = {
    "int": "an integer",
    "str": "a string",
    "bool": "true or false",
    "object": "a mapping",
    "array": "a list",
    "null": "empty (null)",
    "float": "a number with a fraction",
}
_AT = re.compile(r"^(?P<message>.*?)(?: - at (?P<key>`key` in )?`\$(?P<path>[^`]*)`)?$", re.S)


def _schema_message(raw: str) -> str:
    """msgspec's ``Expected `int`, got `str` - at `$.vllm[0].x``` as ``vllm[0].x must be ...``."""
    match = _AT.match(raw)
    message, path = match["message"], (match["path"] or "").lstrip(".")
    if match["key"]:
        return f"{path} keys must be strings ({message})"
    if found := re.fullmatch(r"Object missing required field `(.+)`", message):
        return f"{_join(path, found[1])} is required"
    if found := re.fullmatch(r"Object contains unknown field `(.+)`", message):
        known = _fields_at(path)
        close = difflib.get_close_matches(found[1], known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"{_join(path, found[1])} is not a known field{hint}; known: {', '.join(known)}"
    if message.startswith("Invalid enum value"):
        return f"{path} must be one of {', '.join(WORKER_TYPES)} (got {message.split('value ', 1)[1]})"
    if found := re.fullmatch(r"Expected `([^`]+)`, got `(\w+)`", message):
        if not path:
            return "the file must hold a mapping with a top-level 'vllm' list"
        # "bool | null" is an optional field: null means "not set", so name only the real type.
        expected = " or ".join(_TYPE_WORDS.get(word, word) for word in found[1].split(" | ") if word != "null")
        return f"{path} must be {expected}, got {_TYPE_WORDS.get(found[2], found[2])}"
    return f"{path or 'the file'}: {message}"


def _join(path: str, field: str) -> str:
    return f"{path}.{field}" if path else field


def _fields_at(path: str) -> list[str]:
    if re.search(r"server_groups\[\d+\]$", path):
        return list(ServerGroupConfig.__struct_fields__)
    if re.fullmatch(r"vllm\[\d+\]", path):
        return [*ModelConfig.__struct_fields__, "engine_groups"]
    return list(VllmConfigFile.__struct_fields__)


def _check_fields(config: VllmConfigFile) -> None:
    """The rules that need no command-line flag: values, names, overrides and the PD rule."""
    if not config.vllm:
        _fail("vllm must list at least one model")
    seen: dict[str, int] = {}
    for i, model in enumerate(config.vllm):
        where = f"vllm[{i}]"
        if not _MODEL_NAME.fullmatch(model.name):
            _fail(
                f"{where}.name {model.name!r} must start with a letter or digit and use only letters, "
                "digits, '.', '_' and '-'"
            )
        if model.name in seen:
            _fail(f"{where}.name {model.name!r} is already used by vllm[{seen[model.name]}]; names must be unique")
        seen[model.name] = i
        if model.model_path is not None and not model.model_path.strip():
            _fail(f"{where}.model_path must not be empty")
        if model.num_gpus_per_engine is not None and model.num_gpus_per_engine <= 0:
            _fail(f"{where}.num_gpus_per_engine must be > 0")
        if not model.server_groups:
            _fail(f"{where}.server_groups must list at least one group")
        for k, group in enumerate(model.server_groups):
            _check_group(f"{where}.server_groups[{k}]", group)
        _check_worker_mix(where, [group.worker_type for group in model.server_groups])


def _check_group(where: str, group: ServerGroupConfig) -> None:
    if group.num_gpus <= 0:
        _fail(f"{where}.num_gpus must be > 0")
    if group.num_gpus_per_engine is not None and group.num_gpus_per_engine <= 0:
        _fail(f"{where}.num_gpus_per_engine must be > 0")
    normalized: dict[str, str] = {}
    for key, value in group.overrides.items():
        field = _field_name(key)
        if field in normalized:
            _fail(f"{where}.overrides gives {field} twice ({normalized[field]!r} and {key!r})")
        normalized[field] = key
        if field in _DERIVED_OVERRIDES:
            _fail(f"{where}.overrides.{key} is set by vime; {_DERIVED_OVERRIDES[field]}")
        if field == "model_path" and (not isinstance(value, str) or not value.strip()):
            _fail(f"{where}.overrides.model_path must be a non-empty string")
        if field in ("ec_transfer_config", "kv_transfer_config"):
            _transfer_mapping(value, FLAG, f"{where}.overrides.{key}")


def _check_worker_mix(where: str, types: Sequence[str]) -> None:
    """The PD rule: a model's language groups are all regular or all prefill/decode; encoder is
    an orthogonal axis that needs a consumer (prefill or regular)."""
    present = set(types)
    if "regular" in present and present & {"prefill", "decode"}:
        _fail(
            f"{where}.server_groups mixes regular with prefill/decode groups; a model is either "
            "PD-disaggregated (prefill + decode) or not (regular). Use separate models instead"
        )
    if ("prefill" in present) != ("decode" in present):
        has, lacks = ("prefill", "decode") if "prefill" in present else ("decode", "prefill")
        _fail(f"{where}.server_groups has {has} groups but no {lacks} group; PD disaggregation needs both")
    if "encoder" in present and not present & {"prefill", "regular"}:
        _fail(f"{where}.server_groups has encoder groups but no prefill or regular group to consume the encoder cache")


def _field_name(key: str) -> str:
    """Overrides accept EngineArgs field names or flag spellings: max_model_len, max-model-len."""
    return key.strip().lstrip("-").replace("-", "_")


def _transfer_mapping(value: Any, flag: str, label: str) -> dict:
    """A kv/ec transfer config given as a mapping or as a JSON object string."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ConfigError(flag, f"{label} is not valid JSON: {error}") from None
    if not isinstance(value, Mapping):
        raise ConfigError(flag, f"{label} must be a mapping (or a JSON object string)")
    return dict(value)


# ================================================================================== resolution
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
        _fail(
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
        override = next((v for key, v in group.overrides.items() if _field_name(key) == "model_path"), None)
        path = (override, f"{where}.server_groups[{k}].overrides.model_path") if override else default
        if chosen is None:
            chosen = path
        elif not _same_checkpoint(path[0], chosen[0]):
            _fail(
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
    overrides = {_field_name(key): value for key, value in group.overrides.items()}
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
            _fail(
                f"{where}: an engine of {per_engine} GPUs ({source}) is larger than a node of {node} GPUs, "
                f"so it must span whole nodes (a multiple of {node})"
            )
        nodes_per_engine = per_engine // node
    if group.num_gpus % per_engine:
        _fail(
            f"{where}.num_gpus {group.num_gpus} is not a multiple of num_gpus_per_engine {per_engine} (from {source})"
        )
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
            _fail(f"{where}: {flag} {raw!r} is not an integer")
        if size < 1:
            _fail(f"{where}: {flag} must be >= 1, got {size}")
        sizes.append(size)
    product = sizes[0] * sizes[1] * sizes[2]
    if per_engine % product:
        _fail(
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
        flag = _field_name(key).replace("_", "-")
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
        _fail(
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
                _fail(
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


# ================================================================================= launch plan
@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineLaunch:
    """One vLLM engine to start: its command-line arguments and its role in the topology."""

    index: int
    """Position in the start order over the whole plan (encoders of every model come first)."""
    name: str
    """Unique and file-name safe, e.g. ``actor-g1-decode-0``: for logs and messages."""
    model_name: str
    group_index: int
    engine_index: int
    """Position within its group."""
    worker_type: WorkerType
    model_path: str
    """vLLM's ``--model`` (given separately, as build_vllm_command expects)."""
    num_gpus: int
    num_nodes: int
    tensor_parallel_size: int
    """vLLM's ``--tensor-parallel-size`` (given separately, as build_vllm_command expects)."""
    vllm_args: dict[str, str | None]
    """Every other vLLM flag, without ``--``: the ``vllm_args`` of build_vllm_command/EngineSpec."""
    update_weights: bool
    ec_role: str | None = None
    kv_role: str | None = None
    language_only: bool = False
    """A language engine of an EPD split: it takes image embeddings from the encoder cache."""
    encoder_urls: tuple[str, ...] = ()
    """The model's encoder engines; filled by ModelLaunch.with_encoder_urls once they run."""
    router_role: RouterRole | None = "regular"
    """How to register with the model's router; None: not registered (encoders)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RouterLaunch:
    model_name: str
    pd_disaggregation: bool
    router_args: dict[str, str | None]
    """vllm-router flags without ``--`` (as build_router_command expects)."""
    external_url: str | None = None
    """Use this router (``--vllm-router-ip``) instead of starting one."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelLaunch:
    name: str
    model_path: str
    update_weights: bool
    router: RouterLaunch
    encoders: tuple[EngineLaunch, ...]
    """Started first, and waited for: their URLs go to the language engines."""
    language_engines: tuple[EngineLaunch, ...]

    @property
    def engines(self) -> tuple[EngineLaunch, ...]:
        return self.encoders + self.language_engines

    def with_encoder_urls(self, urls: Sequence[str]) -> ModelLaunch:
        """The model with its encoders' URLs on every language-only engine: call once the
        encoders are healthy, before starting the language engines."""
        if len(urls) != len(self.encoders):
            raise ValueError(f"model {self.name}: {len(self.encoders)} encoder engine(s), got {len(urls)} URL(s)")
        engines = tuple(
            dataclasses.replace(engine, encoder_urls=tuple(urls)) if engine.language_only else engine
            for engine in self.language_engines
        )
        return dataclasses.replace(self, language_engines=engines)


GENERATED_EC_CACHE_PREFIX = "/dev/shm/vime-ec-"


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchPlan:
    """What to start for a deployment, in order: routers, then ``encoders`` (wait until healthy),
    then ``language_engines`` (each registered with its model's router by ``router_role``)."""

    models: tuple[ModelLaunch, ...]
    ec_storage_path: str | None
    """The encoder-cache directory of the default connector; None without encoders."""

    @property
    def owned_ec_cache(self) -> str | None:
        """The encoder-cache directory vime made up (in shared memory): the run removes it at its end."""
        path = self.ec_storage_path
        return path if path and path.startswith(GENERATED_EC_CACHE_PREFIX) else None

    @property
    def encoders(self) -> tuple[EngineLaunch, ...]:
        return tuple(engine for model in self.models for engine in model.encoders)

    @property
    def language_engines(self) -> tuple[EngineLaunch, ...]:
        return tuple(engine for model in self.models for engine in model.language_engines)

    @property
    def engines(self) -> tuple[EngineLaunch, ...]:
        return self.encoders + self.language_engines

    def model(self, name: str) -> ModelLaunch:
        for model in self.models:
            if model.name == name:
                return model
        raise KeyError(f"no model named {name!r}; models: {', '.join(m.name for m in self.models)}")

    def with_encoder_urls(self, urls_by_model: Mapping[str, Sequence[str]]) -> LaunchPlan:
        return dataclasses.replace(
            self,
            models=tuple(
                model.with_encoder_urls(urls_by_model.get(model.name, ())) if model.encoders else model
                for model in self.models
            ),
        )

    def encoder_endpoints(self, urls_by_model: Mapping[str, Sequence[str]]) -> dict[str, tuple[str, list[str]]]:
        """The value of ``args.vllm_model_encoder_endpoints``: {model: (served name, [encoder URL])}. The
        served name is what requests to the encoders must carry as ``model``: the model path (vLLM's
        default) unless the encoder group sets ``served_model_name`` (its first name)."""
        return {
            model.name: (_served_name(model.encoders[0]), list(urls_by_model.get(model.name, ())))
            for model in self.models
            if model.encoders
        }


def _served_name(engine: EngineLaunch) -> str:
    names = engine.vllm_args.get("served-model-name")
    return names.split()[0] if names else engine.model_path


def build_launch_plan(
    deployment: Deployment,
    *,
    router_args: Mapping[str, str | None] | None = None,
    external_router_url: str | None = None,
    ec_storage_path: str | None = None,
) -> LaunchPlan:
    """Every engine's vLLM arguments and role, and every model's router.

    Roles (EPD and PD are orthogonal): encoder -> ec_producer, prefix caching off, not routed;
    prefill -> kv_producer (+ ec_consumer, language_only with encoders); decode -> kv_consumer;
    regular -> ec_consumer, language_only with encoders. A ``kv_transfer_config`` or
    ``ec_transfer_config`` in the group's overrides (or the ``--vllm-*`` flag) replaces the
    generated one and is layered over the derived connector/role: its keys win, no deep merge.
    ``external_router_url`` serves a single-model deployment only.
    """
    if external_router_url and len(deployment.models) > 1:
        raise ConfigError(
            "--vllm-router-ip",
            f"one external router cannot serve {len(deployment.models)} models; "
            "each model needs its own router, which vime starts when --vllm-router-ip is not given",
        )
    if ec_storage_path is None and any(model.has_encoder for model in deployment.models):
        ec_storage_path = f"{GENERATED_EC_CACHE_PREFIX}{uuid.uuid4().hex}"
    drafts = {model.name: _engine_drafts(model, ec_storage_path) for model in deployment.models}
    # Number the engines in start order: the encoders of every model, then the language engines.
    next_index = {True: 0, False: sum(e.worker_type == "encoder" for d in drafts.values() for e in d)}
    models = []
    for model in deployment.models:
        engines = {True: [], False: []}  # is it an encoder?
        for engine in drafts[model.name]:
            is_encoder = engine.worker_type == "encoder"
            engines[is_encoder].append(dataclasses.replace(engine, index=next_index[is_encoder]))
            next_index[is_encoder] += 1
        models.append(
            ModelLaunch(
                name=model.name,
                model_path=model.model_path,
                update_weights=model.update_weights,
                router=_router_launch(model, engines[False], router_args or {}, external_router_url),
                encoders=tuple(engines[True]),
                language_engines=tuple(engines[False]),
            )
        )
    return LaunchPlan(models=tuple(models), ec_storage_path=ec_storage_path)


def _engine_drafts(model: ResolvedModel, ec_storage_path: str | None) -> list[EngineLaunch]:
    engines = []
    for group in model.groups:
        for e in range(group.num_engines):
            roles = _roles(group.worker_type, model.has_encoder)
            vllm_args = dict(group.vllm_args)
            if roles["ec_role"]:
                vllm_args["ec-transfer-config"] = _transfer_config(
                    group,
                    "ec",
                    {"ec_connector": DEFAULT_EC_CONNECTOR, "ec_role": roles["ec_role"]},
                    {"ec_connector_extra_config": {"shared_storage_path": ec_storage_path}},
                )
            if roles["kv_role"]:
                vllm_args["kv-transfer-config"] = _transfer_config(
                    group, "kv", {"kv_connector": DEFAULT_KV_CONNECTOR, "kv_role": roles["kv_role"]}, {}
                )
            if group.worker_type == "encoder":
                # No language model, so no KV cache for prefix caching to manage.
                vllm_args.pop("enable-prefix-caching", None)
                vllm_args["no-enable-prefix-caching"] = None
            engines.append(
                EngineLaunch(
                    index=-1,
                    name=f"{model.name}-g{group.index}-{group.worker_type}-{e}",
                    model_name=model.name,
                    group_index=group.index,
                    engine_index=e,
                    worker_type=group.worker_type,
                    model_path=model.model_path,
                    num_gpus=group.num_gpus_per_engine,
                    num_nodes=group.nodes_per_engine,
                    tensor_parallel_size=group.tensor_parallel_size,
                    vllm_args=vllm_args,
                    update_weights=model.update_weights,
                    **roles,
                )
            )
    return engines


def _roles(worker_type: str, has_encoder: bool) -> dict[str, Any]:
    """The guide's role table: EC roles only in a model with encoders, KV roles only under PD."""
    consumes_encoder = has_encoder and worker_type in ("prefill", "regular")
    return {
        "ec_role": "ec_producer" if worker_type == "encoder" else "ec_consumer" if consumes_encoder else None,
        "kv_role": {"prefill": "kv_producer", "decode": "kv_consumer"}.get(worker_type),
        "language_only": consumes_encoder,
        "router_role": None if worker_type == "encoder" else worker_type,
    }


def _transfer_config(group: ResolvedGroup, kind: str, derived: dict, generated_extra: dict) -> str:
    """The JSON of ``--{kind}-transfer-config``: generated, or the user's layered over the roles."""
    field, flag = f"{kind}_transfer_config", f"{kind}-transfer-config"
    if field in group.overrides:
        user = _transfer_mapping(group.overrides[field], FLAG, f"{group.path}.overrides.{field}")
    elif group.vllm_args.get(flag) is not None:
        user = _transfer_mapping(group.vllm_args[flag], f"--vllm-{flag}", "the value")
    else:
        return json.dumps({**derived, **generated_extra})
    return json.dumps({**derived, **user})


def _router_launch(
    model: ResolvedModel, engines: Iterable[EngineLaunch], base: Mapping[str, str | None], external_url: str | None
) -> RouterLaunch:
    router_args = dict(base)
    if model.pd_disaggregation:
        router_args["vllm-pd-disaggregation"] = None
        connectors = {json.loads(e.vllm_args["kv-transfer-config"]).get("kv_connector") for e in engines if e.kv_role}
        if len(connectors) > 1:
            _fail(
                f"model {model.name} uses several KV connectors ({', '.join(sorted(map(str, connectors)))}); "
                "its prefill and decode engines must share one"
            )
        router_name = _ROUTER_KV_CONNECTORS.get(next(iter(connectors), None))
        if router_name:
            router_args.setdefault("kv-connector", router_name)
    return RouterLaunch(
        model_name=model.name,
        pd_disaggregation=model.pd_disaggregation,
        router_args=router_args,
        external_url=external_url,
    )


# ============================================================================ runtime helpers
def get_model_url(args: Any, name: str, path: str = DEFAULT_GENERATE_PATH) -> str:
    """The URL of ``path`` on the router of model ``name``, from ``args.vllm_model_routers``
    ({name: (ip, port)}, filled by the driver once the engines run; a URL string also works)."""
    routers = getattr(args, "vllm_model_routers", None)
    if not routers:
        raise RuntimeError("args.vllm_model_routers is empty: the engines of this run have not started yet")
    if name not in routers:
        raise ValueError(f"no model named {name!r}; served models: {', '.join(map(str, routers))}")
    return _base_url(routers[name]) + ("/" + path.lstrip("/") if path else "")


def _base_url(address: Any) -> str:
    if isinstance(address, str):
        return address.rstrip("/") if "://" in address else "http://" + address.rstrip("/")
    ip, port = address
    host = f"[{ip}]" if ":" in str(ip) else ip
    return f"http://{host}:{port}"


# OpenAI chat content parts the vision/audio tower encodes (JSON-serializable ones only).
_MEDIA_PART_TYPES = frozenset({"image_url", "video_url", "audio_url", "input_audio"})


def media_parts(messages: Any) -> list[dict]:
    """The image/video/audio content parts of OpenAI-style chat messages."""
    parts = []
    for message in messages or ():
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list):
            parts += [
                dict(part) for part in content if isinstance(part, Mapping) and part.get("type") in _MEDIA_PART_TYPES
            ]
    return parts


async def prime_encoder(
    args: Any, messages: Any, model_name: str | None = None, *, session: Any = None, timeout: float = 120.0
) -> int:
    """Have an encoder engine embed every image of ``messages`` before the language engines run,
    so the embeddings are in the encoder cache when they look them up. Returns the number of
    media parts sent; 0 (a no-op) when there is none or the model has no encoder group.

    ``args.vllm_model_encoder_endpoints`` is {model: (served model name, [encoder URL])}. ``model_name``
    may be left out when exactly one model has encoders. Raises EngineError when an encoder fails.
    """
    endpoints = getattr(args, "vllm_model_encoder_endpoints", None) or {}
    if model_name is None:
        if len(endpoints) > 1:
            raise ValueError(f"several models have encoders ({', '.join(endpoints)}); pass model_name")
        model_name = next(iter(endpoints), None)
    entry = endpoints.get(model_name) if model_name is not None else None
    parts = media_parts(messages)
    if not entry or not entry[1] or not parts:
        return 0
    served_name, urls = entry

    import aiohttp  # imported here: the config package must stay light to import

    from vime.engines.http import EngineError

    async def encode(client: aiohttp.ClientSession, part: dict) -> None:
        url = random.choice(list(urls)).rstrip("/")
        body = {
            "model": served_name,
            "messages": [{"role": "user", "content": [part]}],
            "max_tokens": 1,
            "stream": False,
        }  # one token: enough to run the encoder path
        try:
            async with client.post(
                url + "/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout)
            ) as response:
                if response.status >= 400:
                    text = await response.text()
                    raise EngineError(url, f"encoder priming answered {response.status}: {text[:300]}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:
            raise EngineError(url, f"encoder priming failed: {error!r}") from error

    if session is not None:
        await asyncio.gather(*(encode(session, part) for part in parts))
    else:
        async with aiohttp.ClientSession() as own:
            await asyncio.gather(*(encode(own, part) for part in parts))
    return len(parts)
