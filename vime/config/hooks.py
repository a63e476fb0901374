"""User hooks around the data the trainer trains on, and the custom functions' own settings.

The objective-level hooks (--custom-loss-function-path, --custom-advantage-function-path,
--custom-pg-loss-reducer-function-path) are flags of the RL algorithm (vime/config/algorithm.py); these
are the reference framework's hooks on the samples themselves and its YAML of custom-function arguments.
"""

from __future__ import annotations

import dataclasses
import os
import string

from vime.config.base import ConfigError, option, require

CUSTOM_CONFIG_FLAG = "--custom-config-path"
DEBUG_TRAIN_FIELDS = ("rollout_id", "rank")


@dataclasses.dataclass(kw_only=True)
class HooksConfig:
    """Hooks on the rollout's samples and on the trainer's data (docs/data-and-hooks.md)."""

    custom_config_path: str | None = option(
        None,
        "Path to the YAML config for custom function arguments: each top-level key becomes an attribute of "
        "the args that hooks receive (a key that names a flag overrides that flag, with a note at start-up).",
    )
    custom_convert_samples_to_train_data_path: str | None = option(
        None,
        "Replace the conversion of a rollout's samples to training data: convert_samples_to_train_data(args, "
        "samples) -> dict, called by the trainer on each step's samples (group by group); the dict's lists, one "
        "entry per sample: tokens, response_lengths, rewards (used as they are, no group normalisation), "
        "loss_masks, and optionally rollout_log_probs.",
    )
    rollout_all_samples_process_path: str | None = option(
        None,
        "Path to the rollout all samples process function that can process all samples including filtered "
        "ones: process(args, all_samples, data_source), called by the rollout worker once per scored group "
        "(all_samples: [group]) whether --dynamic-sampling-filter-path kept it or not.",
    )
    custom_rollout_log_function_path: str | None = option(
        None,
        "Path to a function called with each step's rollout: log(rollout_id, args, samples, "
        "rollout_extra_metrics, rollout_time), by the trainer's rank 0 before it trains on them (rollout_id: the "
        "step minus one; rollout_time: seconds since the previous step's rollout was taken). The numbers it puts "
        "in the rollout_extra_metrics dict are logged with the step under the names it gives; returning True "
        "means it logged the rollout itself: vime's own rollout metrics (reward, lengths, staleness) then stay "
        "out of the trackers (metrics.jsonl and the progress line keep them). With --debug-rollout-only it is "
        "called on each step's samples too, which are not trained.",
    )
    custom_eval_rollout_log_function_path: str | None = option(
        None,
        "Path to a function called after each evaluation: log(rollout_id, args, data, extra_metrics), by the "
        "driver; data maps each held-out set's name to {'rewards', 'truncated', 'samples'} (what "
        "--eval-function-path returned for it, when given). The numbers it puts in the extra_metrics dict are "
        "logged at the evaluation's step; returning True keeps vime's own eval metrics out of the trackers.",
    )
    save_debug_train_data: str | None = option(
        None,
        "Save one train-side debug file per training step (torch.save of a dict of per-sample lists: tokens, "
        "loss masks, rewards, log-probs, advantages, returns, values), written by the trainer's rank 0. The "
        "path may contain {rollout_id} and the writer's {rank}.",
    )

    def validate(self) -> None:
        if self.save_debug_train_data is not None:
            check_debug_train_template(self.save_debug_train_data)
        if self.custom_config_path is not None:
            require(
                "://" in self.custom_config_path or os.path.isfile(self.custom_config_path),
                CUSTOM_CONFIG_FLAG,
                f"no such file {self.custom_config_path!r}",
            )


def check_debug_train_template(template: str) -> None:
    """Only {rollout_id} and {rank} may appear in --save-debug-train-data."""
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as error:
        raise ConfigError("--save-debug-train-data", f"{template!r}: {error}") from None
    unknown = [name for name in fields if name not in DEBUG_TRAIN_FIELDS]
    require(
        not unknown,
        "--save-debug-train-data",
        f"{template!r}: unknown placeholder(s) {', '.join('{' + n + '}' for n in unknown)}; "
        "use {rollout_id} and {rank}",
    )


def load_custom_config(path: str | None) -> dict:
    """The top-level mapping of --custom-config-path's YAML ({} without the flag); errors name the flag."""
    if not path:
        return {}
    import yaml

    try:
        import fsspec

        with fsspec.open(path, "r") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(CUSTOM_CONFIG_FLAG, f"no such file {path!r}") from None
    except yaml.YAMLError as error:
        raise ConfigError(CUSTOM_CONFIG_FLAG, f"{path}: not valid YAML: {error}") from None
    if data is None:
        return {}
    if not isinstance(data, dict) or not all(isinstance(key, str) and key.isidentifier() for key in data):
        raise ConfigError(
            CUSTOM_CONFIG_FLAG, f"{path}: expected a mapping of argument names to values, got {type(data).__name__}"
        )
    return data
