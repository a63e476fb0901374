"""``--megatron-config-path``: role overrides of the training arguments (PPO's actor and critic).

The YAML format is the reference framework's::

    megatron:
      - name: default          # optional label, not used
        role: critic           # required: actor | critic
        overrides:             # argparse attribute names (lr, not --lr); `args` is an old alias
          lr: 1e-5
          load: /ckpt/critic_init
          save: /ckpt/critic

The command line is the shared baseline; a role absent from the file keeps it unchanged. Placement
(``num_nodes``, ``num_gpus_per_node``) stays on the command line: those keys are ignored, as the
reference documents. Parallel topology must be the same for both roles, so topology keys are
refused here (keep them on the command line).

This module only parses and checks the file (every error names the YAML field). Which keys a
backend honours is the backend's business: :data:`TORCH_ROLE_KEYS` lists the torch backend's, and
``vime.rl.algorithm_checks.check_algorithm_with_run`` refuses the others when it trains.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from vime.config.base import ConfigError

FLAG = "--megatron-config-path"
ROLES = ("actor", "critic")
ENTRY_KEYS = ("name", "role", "overrides", "args")
# Keys the reference ignores (placement comes from the command line).
IGNORED_KEYS = ("num_nodes", "num_gpus_per_node")
# Actor and critic must share one parallel topology: keep these on the command line.
TOPOLOGY_KEYS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "sequence_parallel",
    "virtual_pipeline_model_parallel_size",
)
# Numeric keys checked (and converted: YAML 1.1 reads `1e-5` as a string) with their valid range.
FLOAT_KEYS = {
    "lr": (lambda v: v > 0, "must be > 0"),
    "min_lr": (lambda v: v >= 0, "must be >= 0"),
    "weight_decay": (lambda v: v >= 0, "must be >= 0"),
    "adam_beta1": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "adam_beta2": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "adam_eps": (lambda v: v > 0, "must be > 0"),
    "clip_grad": (lambda v: v >= 0, "must be >= 0 (0 disables clipping)"),
}
INT_KEYS = {"lr_warmup_iters": (lambda v: v >= 0, "must be >= 0")}
CHOICE_KEYS = {"lr_decay_style": ("constant", "linear", "cosine", "inverse-square-root", "WSD")}
PATH_KEYS = ("load", "save")
# What the torch backend honours per role: the optimizer settings and the schedule's shape for both
# (vime.backends.lr_schedule.LRSchedule.for_role), and for the critic the location of its checkpoints
# (the actor's are the run's --load / --save).
OPTIMIZER_KEYS = (
    "lr",
    "min_lr",
    "lr_warmup_iters",
    "lr_decay_style",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_eps",
    "clip_grad",
)
TORCH_ROLE_KEYS = {
    "actor": OPTIMIZER_KEYS,
    "critic": (*OPTIMIZER_KEYS, "load", "save"),
}


@dataclasses.dataclass(frozen=True)
class RoleOverrides:
    """One role's overrides: argparse attribute name -> value (checked), and where each came from."""

    role: str
    entry: str = ""  # "megatron[1]" (empty: not in the file)
    values: dict[str, Any] = dataclasses.field(default_factory=dict)
    fields: dict[str, str] = dataclasses.field(default_factory=dict)  # key -> "megatron[1].overrides.lr"
    ignored: tuple[str, ...] = ()  # placement keys dropped

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def field(self, key: str) -> str:
        """The YAML field that set ``key`` (for error messages)."""
        return self.fields.get(key, f"{self.role}.{key}")

    @property
    def lr(self) -> float | None:
        return self.values.get("lr")

    @property
    def load(self) -> str | None:
        return self.values.get("load")

    @property
    def save(self) -> str | None:
        return self.values.get("save")


@dataclasses.dataclass(frozen=True)
class RoleConfig:
    """The parsed file: overrides per role (a role absent from the file has none)."""

    source: str | None = None
    roles: dict[str, RoleOverrides] = dataclasses.field(default_factory=dict)

    def role(self, name: str) -> RoleOverrides:
        if name not in ROLES:
            raise ValueError(f"unknown role {name!r}; roles are {', '.join(ROLES)}")
        return self.roles.get(name) or RoleOverrides(name)


def _error(source: str, field: str, message: str) -> ConfigError:
    return ConfigError(FLAG, f"{source}: {field}: {message}")


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _check_value(source: str, field: str, key: str, value: Any) -> Any:
    if key in FLOAT_KEYS:
        number = _number(value)
        if number is None or not math.isfinite(number):
            raise _error(source, field, f"expected a number, got {value!r}")
        valid, rule = FLOAT_KEYS[key]
        if not valid(number):
            raise _error(source, field, f"{rule}, got {number:g}")
        return number
    if key in INT_KEYS:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _error(source, field, f"expected a whole number, got {value!r}")
        valid, rule = INT_KEYS[key]
        if not valid(value):
            raise _error(source, field, f"{rule}, got {value}")
        return value
    if key in CHOICE_KEYS:
        if value not in CHOICE_KEYS[key]:
            raise _error(source, field, f"expected one of {', '.join(CHOICE_KEYS[key])}, got {value!r}")
        return value
    if key in PATH_KEYS:
        if not isinstance(value, str) or not value:
            raise _error(source, field, f"expected a path, got {value!r}")
        return value
    return value


def parse_role_config(data: Any, source: str = "<yaml>") -> RoleConfig:
    """Check a loaded YAML document; raises ConfigError naming ``--megatron-config-path`` and the field."""
    if data is None:
        return RoleConfig(source)
    if not isinstance(data, dict):
        raise _error(source, "<top level>", f"expected a mapping with a 'megatron' list, got {type(data).__name__}")
    unknown = [k for k in data if k != "megatron"]
    if unknown:
        raise _error(source, str(unknown[0]), "unknown top-level key; expected only 'megatron'")
    entries = data.get("megatron") or []
    if not isinstance(entries, list):
        raise _error(source, "megatron", f"expected a list of role entries, got {type(entries).__name__}")
    roles: dict[str, RoleOverrides] = {}
    first_field: dict[str, str] = {}
    for i, entry in enumerate(entries):
        where = f"megatron[{i}]"
        if not isinstance(entry, dict):
            raise _error(source, where, f"expected a mapping (name, role, overrides), got {type(entry).__name__}")
        for key in entry:
            if key not in ENTRY_KEYS:
                raise _error(source, f"{where}.{key}", f"unknown key; an entry has {', '.join(ENTRY_KEYS)}")
        role = entry.get("role")
        if role is None:
            raise _error(source, f"{where}.role", "is required (actor or critic)")
        if role not in ROLES:
            raise _error(source, f"{where}.role", f"unknown role {role!r}; choose one of {', '.join(ROLES)}")
        if role in roles:
            raise _error(source, f"{where}.role", f"role {role!r} already appears at {first_field[role]}")
        if "overrides" in entry and "args" in entry:
            raise _error(source, f"{where}.args", "give 'overrides' or its old alias 'args', not both")
        section = "overrides" if "overrides" in entry else "args"
        overrides = entry.get(section) or {}
        if not isinstance(overrides, dict):
            raise _error(source, f"{where}.{section}", f"expected a mapping, got {type(overrides).__name__}")
        values, fields, ignored = {}, {}, []
        for key, value in overrides.items():
            field = f"{where}.{section}.{key}"
            if not isinstance(key, str) or not key.isidentifier():
                raise _error(
                    source,
                    field,
                    "keys are argparse attribute names (e.g. tensor_model_parallel_size, "
                    "not tensor-model-parallel-size)",
                )
            if key in IGNORED_KEYS:
                ignored.append(key)
                continue
            if key in TOPOLOGY_KEYS:
                raise _error(
                    source,
                    field,
                    "actor and critic must share one parallel topology: set it on the command line, not per role",
                )
            values[key] = _check_value(source, field, key, value)
            fields[key] = field
        if values.get("min_lr", 0.0) > values.get("lr", math.inf):
            raise _error(source, fields["min_lr"], f"{values['min_lr']:g} is above the role's lr {values['lr']:g}")
        roles[role] = RoleOverrides(role, where, values, fields, tuple(ignored))
        first_field[role] = where
    return RoleConfig(source, roles)


def load_role_config(path: str | None) -> RoleConfig:
    """Read and check ``--megatron-config-path`` (None: no overrides)."""
    if path is None:
        return RoleConfig()
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as error:
        raise ConfigError(FLAG, f"cannot read {path!r}: {error.strerror or error}") from None
    except yaml.YAMLError as error:
        raise ConfigError(FLAG, f"{path}: not valid YAML ({error})") from None
    return parse_role_config(data, path)


def check_supported_roles(config: RoleConfig, backend: str) -> None:
    """Refuse overrides the training backends would not honour (naming the YAML field). The torch and
    Megatron backends honour the same keys (the Megatron one builds its roles with the torch one's code)."""
    for name, role in config.roles.items():
        for key in role.values:
            if key in TORCH_ROLE_KEYS[name]:
                if key == "load" and "://" not in role.load and not os.path.isdir(role.load):
                    raise _error(
                        config.source or "<yaml>",
                        role.field(key),
                        f"{role.load!r} does not exist (the "
                        "critic starts from a critic save folder, a critic checkpoint or an HF model folder)",
                    )
                continue
            if name == "actor" and key in PATH_KEYS:
                message = (
                    f"with --train-backend {backend} the actor's checkpoints are the run's: use --load / "
                    "--save on the command line"
                )
            else:
                message = (
                    f"the {backend} backend does not support this override for the {name}; it honours "
                    f"{', '.join(TORCH_ROLE_KEYS[name])}"
                )
            raise _error(config.source or "<yaml>", role.field(key), message)
