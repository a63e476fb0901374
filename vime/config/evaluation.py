"""Evaluation on held-out sets: the --eval-* flags and the --eval-config file.

Each held-out set's settings resolve as the reference framework's do: the set's own entry in the
--eval-config file, then that file's ``eval.defaults``, then the --eval-* flags, then the rollout's
(--rollout-temperature, --rollout-top-p, ...) and data flags (--input-key, ...).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from vime.config.base import ConfigError, option, require
from vime.config.framework import BUILTIN_ROLLOUT_PATHS

EVAL_CONFIG_FLAG = "--eval-config"


@dataclasses.dataclass(kw_only=True)
class EvalConfig:
    eval_prompt_data: list[str] | None = option(
        None,
        "Held-out sets as NAME PATH pairs, evaluated before training (unless --skip-eval-before-train), every "
        "--eval-interval rollouts and at the end. --eval-config replaces it.",
        nargs="+",
    )
    n_samples_per_eval_prompt: int = option(1, "Responses per held-out prompt.")
    eval_config: str | None = option(
        None,
        "A YAML file of held-out sets with per-set overrides, used instead of --eval-prompt-data: "
        "eval: {defaults: {...}, datasets: [{name, path, ...}, ...]} (datasets may also be a mapping from name to "
        "entry). Fields: input_key (or prompt_key), label_key, metadata_key, n_samples_per_eval_prompt, "
        "temperature, top_p, top_k, max_response_len, max_context_len, stop, stop_token_ids, rm_type, "
        "metadata_overrides. A set's field wins over eval.defaults, which win over the --eval-* flags "
        "(docs/data-and-hooks.md).",
    )
    eval_interval: int | None = option(None, "Evaluate every this many rollouts.")
    skip_eval_before_train: bool = option(False, "Do not evaluate the held-out sets before the first training step.")
    eval_input_key: str | None = option(
        None, "Record field holding the prompt in held-out sets (default: --input-key)."
    )
    eval_label_key: str | None = option(None, "Record field holding the label in held-out sets (default: --label-key).")
    eval_temperature: float | None = option(
        None,
        "Sampling temperature for evaluation (0 = greedy). Default: --rollout-temperature, as in the reference "
        "(vime before issue 19 evaluated greedily by default; give --eval-temperature 0 for that).",
    )
    eval_top_p: float | None = option(None, "Top-p sampling in evaluation (default: --rollout-top-p).")
    eval_top_k: int | None = option(None, "Top-k sampling in evaluation, -1 disables (default: --rollout-top-k).")
    eval_max_response_len: int | None = option(
        None, "Maximum response tokens in evaluation (default: --rollout-max-response-len)."
    )
    eval_max_context_len: int | None = option(
        None,
        "Maximum prompt + response tokens in evaluation, as --rollout-max-context-len is in rollout "
        "(default: --rollout-max-context-len).",
    )
    eval_function_path: str | None = option(
        None,
        "Replace the built-in evaluation with generate_rollout(args, rollout_id, data_source, evaluation=True) "
        "-> RolloutFnEvalOutput(data={name: {'rewards': [...]}}), called once per --eval-prompt-data set; "
        "data_source.get_samples(n) hands out that set's prompts.",
    )

    def __post_init__(self) -> None:
        if self.eval_function_path in BUILTIN_ROLLOUT_PATHS:
            self.eval_function_path = None  # the built-in evaluation, by the reference's rollout name

    @property
    def datasets(self) -> list[tuple[str, str]]:
        items = self.eval_prompt_data or []
        return [(items[i], items[i + 1]) for i in range(0, len(items), 2)]

    def validate(self) -> None:
        require(
            not self.eval_prompt_data or len(self.eval_prompt_data) % 2 == 0,
            "--eval-prompt-data",
            "expects NAME PATH pairs",
        )
        require(self.eval_interval is None or self.eval_interval >= 1, "--eval-interval", "must be >= 1")
        require(self.n_samples_per_eval_prompt >= 1, "--n-samples-per-eval-prompt", "must be >= 1")
        require(self.eval_temperature is None or self.eval_temperature >= 0, "--eval-temperature", "must be >= 0")
        require(self.eval_top_p is None or 0 < self.eval_top_p <= 1, "--eval-top-p", "must be in (0, 1]")
        require(
            self.eval_top_k is None or self.eval_top_k == -1 or self.eval_top_k >= 1,
            "--eval-top-k",
            "must be -1 or >= 1",
        )
        require(
            self.eval_max_response_len is None or self.eval_max_response_len >= 1,
            "--eval-max-response-len",
            "must be >= 1",
        )
        require(
            self.eval_max_context_len is None or self.eval_max_context_len >= 2,
            "--eval-max-context-len",
            "must be >= 2 (a prompt token and a response token)",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalDataset:
    """One held-out set with every setting resolved (see the module's docstring for the order)."""

    name: str
    path: str
    input_key: str
    label_key: str | None
    metadata_key: str
    n_samples_per_eval_prompt: int
    temperature: float
    top_p: float
    top_k: int
    max_response_len: int
    max_context_len: int | None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    rm_type: str | None = None  # put in every sample's metadata['rm_type'] (the reward's per-sample override)
    metadata_overrides: dict[str, Any] = dataclasses.field(default_factory=dict)

    def inject_metadata(self, metadata: dict[str, Any]) -> dict[str, Any]:
        """A sample's metadata with this set's rm_type and metadata_overrides applied."""
        result = dict(metadata or {})
        if self.rm_type is not None:
            result["rm_type"] = self.rm_type
        result.update(self.metadata_overrides)
        return result


# Fields of an --eval-config entry (and of eval.defaults), with their types; prompt_key is the reference's
# other name of input_key.
_ENTRY_FIELDS: dict[str, tuple[type, ...]] = {
    "name": (str,),
    "path": (str,),
    "input_key": (str,),
    "prompt_key": (str,),
    "label_key": (str, type(None)),
    "metadata_key": (str,),
    "n_samples_per_eval_prompt": (int,),
    "temperature": (int, float),
    "top_p": (int, float),
    "top_k": (int,),
    "max_response_len": (int,),
    "max_context_len": (int, type(None)),
    "stop": (str, list),
    "stop_token_ids": (int, list),
    "rm_type": (str, type(None)),
    "metadata_overrides": (dict,),
}


def _entry_error(where: str, message: str) -> ConfigError:
    return ConfigError(EVAL_CONFIG_FLAG, f"{where}: {message}")


def _check_entry(entry: Any, where: str) -> dict[str, Any]:
    if not isinstance(entry, dict):
        raise _entry_error(where, f"expected a mapping, got {type(entry).__name__}")
    for key, value in entry.items():
        if key not in _ENTRY_FIELDS:
            raise _entry_error(where, f"unknown field {key!r}; fields are {', '.join(sorted(_ENTRY_FIELDS))}")
        kinds = _ENTRY_FIELDS[key]
        if isinstance(value, bool) or not isinstance(value, kinds):
            names = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
            raise _entry_error(where, f"{key} must be {names}, got {value!r}")
    if "input_key" in entry and "prompt_key" in entry:
        raise _entry_error(where, "give input_key or prompt_key (its other name), not both")
    entry = dict(entry)
    if "prompt_key" in entry:
        entry["input_key"] = entry.pop("prompt_key")
    for key, kind in (("stop", str), ("stop_token_ids", int)):
        if key in entry:
            values = entry[key] if isinstance(entry[key], list) else [entry[key]]
            if not all(isinstance(v, kind) and not isinstance(v, bool) for v in values):
                raise _entry_error(where, f"{key} must be a {kind.__name__} or a list of them, got {entry[key]!r}")
            entry[key] = tuple(values)
    return entry


def read_eval_config(path: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(defaults, dataset entries) of an --eval-config file, every field checked; raises ConfigError."""
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as error:
        raise ConfigError(EVAL_CONFIG_FLAG, f"{path}: {error.strerror or error}") from None
    except yaml.YAMLError as error:
        raise ConfigError(EVAL_CONFIG_FLAG, f"{path}: not valid YAML ({error})") from None
    if not isinstance(data, dict) or not isinstance(data.get("eval"), dict):
        raise ConfigError(EVAL_CONFIG_FLAG, f"{path}: expected a top-level 'eval' mapping with 'datasets'")
    section = data["eval"]
    unknown = sorted(set(section) - {"defaults", "datasets"})
    if unknown:
        raise _entry_error(f"{path}, eval", f"unknown key(s) {unknown}; expected 'defaults' and 'datasets'")
    defaults = _check_entry(section.get("defaults") or {}, f"{path}, eval.defaults")
    for key in ("name", "path"):
        if key in defaults:
            raise _entry_error(f"{path}, eval.defaults", f"{key!r} belongs to a dataset entry")
    raw = section.get("datasets")
    if isinstance(raw, dict):
        items = []
        for name, entry in raw.items():
            entry = dict(entry or {}) if isinstance(entry, dict) or entry is None else entry
            if isinstance(entry, dict):
                entry.setdefault("name", str(name))
            items.append(entry)
    elif isinstance(raw, list):
        items = raw
    else:
        raise _entry_error(f"{path}, eval.datasets", "expected a list of entries or a mapping from name to entry")
    if not items:
        raise _entry_error(f"{path}, eval.datasets", "no datasets")
    entries = []
    for number, item in enumerate(items):
        entry = _check_entry(item, f"{path}, eval.datasets[{number}]")
        for key in ("name", "path"):
            if not entry.get(key):
                raise _entry_error(f"{path}, eval.datasets[{number}]", f"every dataset needs a {key!r}")
        entries.append(entry)
    names = [entry["name"] for entry in entries]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise _entry_error(f"{path}, eval.datasets", f"duplicate name(s) {duplicates}")
    return defaults, entries


def _absolute(path: str) -> str:
    return path if "://" in path else os.path.abspath(path)


def resolve_eval_datasets(eval_config: EvalConfig, rollout, data) -> list[EvalDataset]:
    """Every held-out set of the run with its settings resolved: from --eval-config when given, else one per
    --eval-prompt-data pair. ``rollout`` and ``data`` are the run's RolloutConfig and DataConfig."""
    e = eval_config
    flags = {
        "input_key": e.eval_input_key or data.input_key,
        "label_key": e.eval_label_key if e.eval_label_key is not None else data.label_key,
        "metadata_key": data.metadata_key,
        "n_samples_per_eval_prompt": e.n_samples_per_eval_prompt,
        "temperature": e.eval_temperature if e.eval_temperature is not None else rollout.rollout_temperature,
        "top_p": e.eval_top_p if e.eval_top_p is not None else rollout.rollout_top_p,
        "top_k": e.eval_top_k if e.eval_top_k is not None else rollout.rollout_top_k,
        "max_response_len": e.eval_max_response_len or rollout.rollout_max_response_len,
        "max_context_len": e.eval_max_context_len or rollout.rollout_max_context_len,
        "stop": tuple(rollout.rollout_stop or ()),
        "stop_token_ids": tuple(rollout.rollout_stop_token_ids or ()),
        "rm_type": None,
        "metadata_overrides": {},
    }
    if e.eval_config:
        defaults, entries = read_eval_config(e.eval_config)
        where = {entry["name"]: f"{e.eval_config}, dataset {entry['name']!r}" for entry in entries}
    else:
        defaults, entries, where = {}, [{"name": name, "path": path} for name, path in e.datasets], {}
    datasets = []
    for entry in entries:
        values = {**flags, **defaults, **entry}
        values["path"] = _absolute(values["path"])
        values["metadata_overrides"] = dict(values["metadata_overrides"])
        dataset = EvalDataset(**values)
        _check_dataset(dataset, where.get(dataset.name))
        datasets.append(dataset)
    return datasets


def _check_dataset(d: EvalDataset, where: str | None) -> None:
    """Range checks of the values an --eval-config entry set (the flags' own were checked by validate())."""

    def check(condition: bool, key: str, message: str) -> None:
        if not condition and where is not None:
            raise _entry_error(where, f"{key} {message}")

    check(d.n_samples_per_eval_prompt >= 1, "n_samples_per_eval_prompt", "must be >= 1")
    check(d.temperature >= 0, "temperature", "must be >= 0")
    check(0 < d.top_p <= 1, "top_p", "must be in (0, 1]")
    check(d.top_k == -1 or d.top_k >= 1, "top_k", "must be -1 or >= 1")
    check(d.max_response_len >= 1, "max_response_len", "must be >= 1")
    check(d.max_context_len is None or d.max_context_len >= 2, "max_context_len", "must be >= 2")
    check(all(d.stop), "stop", "strings must not be empty")
    check(all(t >= 0 for t in d.stop_token_ids), "stop_token_ids", "must be >= 0")
