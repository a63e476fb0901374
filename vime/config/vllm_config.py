"""``--vllm-config``: the YAML that says which models vime serves, and with which engines -- its schema.

Three layers, each a pure function of its input (nothing here starts a process), one module each:

1. **schema** (this module) -- :func:`load_vllm_config` / :func:`parse_vllm_config` read the YAML into
   typed msgspec structs; every problem is a :class:`ConfigError` on ``--vllm-config`` whose message
   names the field path, e.g. ``vllm[1].server_groups[0].num_gpus must be > 0``;
2. **resolution** (:mod:`vime.config.vllm_deployment`) -- applies the cascade (group > model > global
   flags) and returns a ``Deployment``;
3. **launch plan** (:mod:`vime.config.vllm_launch`) -- turns a deployment into the vLLM arguments, roles
   and start order of every engine and the router of every model.

The runtime helpers ``get_model_url`` and ``prime_encoder`` that read what the driver publishes once the
engines run live in :mod:`vime.rollout.model_routes` (imported by users from ``vime.rollout.vllm_rollout``).
"""

from __future__ import annotations

import difflib
import json
import os
import re
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import msgspec

from vime.config.base import ConfigError

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


def fail(message: str) -> typing.NoReturn:
    raise ConfigError(FLAG, message)


def load_vllm_config(path: str | os.PathLike[str]) -> VllmConfigFile:
    """Read and check the YAML at ``path`` (schema and per-field rules; no flags needed)."""
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        fail(f"{os.fspath(path)!r} does not exist")
    except OSError as error:
        fail(f"cannot read {os.fspath(path)!r}: {error}")
    except yaml.YAMLError as error:
        fail(f"{os.fspath(path)!r} is not valid YAML: {error}")
    return parse_vllm_config(data)


def parse_vllm_config(data: Any) -> VllmConfigFile:
    """Check an already-loaded YAML document and return it typed."""
    if data is None:
        fail("vllm is required: the file holds no YAML document")
    if not isinstance(data, Mapping):
        fail(f"the file must hold a mapping with a top-level 'vllm' list, not a {type(data).__name__}")
    try:
        config = msgspec.convert(_with_aliases(data), VllmConfigFile)
    except msgspec.ValidationError as error:
        fail(_schema_message(str(error)))
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
                    fail(f"vllm[{i}] gives both server_groups and engine_groups (an alias of it); keep one")
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
        fail("vllm must list at least one model")
    seen: dict[str, int] = {}
    for i, model in enumerate(config.vllm):
        where = f"vllm[{i}]"
        if not _MODEL_NAME.fullmatch(model.name):
            fail(
                f"{where}.name {model.name!r} must start with a letter or digit and use only letters, "
                "digits, '.', '_' and '-'"
            )
        if model.name in seen:
            fail(f"{where}.name {model.name!r} is already used by vllm[{seen[model.name]}]; names must be unique")
        seen[model.name] = i
        if model.model_path is not None and not model.model_path.strip():
            fail(f"{where}.model_path must not be empty")
        if model.num_gpus_per_engine is not None and model.num_gpus_per_engine <= 0:
            fail(f"{where}.num_gpus_per_engine must be > 0")
        if not model.server_groups:
            fail(f"{where}.server_groups must list at least one group")
        for k, group in enumerate(model.server_groups):
            _check_group(f"{where}.server_groups[{k}]", group)
        _check_worker_mix(where, [group.worker_type for group in model.server_groups])


def _check_group(where: str, group: ServerGroupConfig) -> None:
    if group.num_gpus <= 0:
        fail(f"{where}.num_gpus must be > 0")
    if group.num_gpus_per_engine is not None and group.num_gpus_per_engine <= 0:
        fail(f"{where}.num_gpus_per_engine must be > 0")
    normalized: dict[str, str] = {}
    for key, value in group.overrides.items():
        field = field_name(key)
        if field in normalized:
            fail(f"{where}.overrides gives {field} twice ({normalized[field]!r} and {key!r})")
        normalized[field] = key
        if field in _DERIVED_OVERRIDES:
            fail(f"{where}.overrides.{key} is set by vime; {_DERIVED_OVERRIDES[field]}")
        if field == "model_path" and (not isinstance(value, str) or not value.strip()):
            fail(f"{where}.overrides.model_path must be a non-empty string")
        if field in ("ec_transfer_config", "kv_transfer_config"):
            transfer_mapping(value, FLAG, f"{where}.overrides.{key}")


def _check_worker_mix(where: str, types: Sequence[str]) -> None:
    """The PD rule: a model's language groups are all regular or all prefill/decode; encoder is
    an orthogonal axis that needs a consumer (prefill or regular)."""
    present = set(types)
    if "regular" in present and present & {"prefill", "decode"}:
        fail(
            f"{where}.server_groups mixes regular with prefill/decode groups; a model is either "
            "PD-disaggregated (prefill + decode) or not (regular). Use separate models instead"
        )
    if ("prefill" in present) != ("decode" in present):
        has, lacks = ("prefill", "decode") if "prefill" in present else ("decode", "prefill")
        fail(f"{where}.server_groups has {has} groups but no {lacks} group; PD disaggregation needs both")
    if "encoder" in present and not present & {"prefill", "regular"}:
        fail(f"{where}.server_groups has encoder groups but no prefill or regular group to consume the encoder cache")


def field_name(key: str) -> str:
    """Overrides accept EngineArgs field names or flag spellings: max_model_len, max-model-len."""
    return key.strip().lstrip("-").replace("-", "_")


def transfer_mapping(value: Any, flag: str, label: str) -> dict:
    """A kv/ec transfer config given as a mapping or as a JSON object string."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ConfigError(flag, f"{label} is not valid JSON: {error}") from None
    if not isinstance(value, Mapping):
        raise ConfigError(flag, f"{label} must be a mapping (or a JSON object string)")
    return dict(value)
