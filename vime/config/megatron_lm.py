"""Megatron-LM's own flags, passed through when a Megatron-LM checkout is importable (its folder on PYTHONPATH).

vime declares the Megatron flags it uses itself (vime.config.megatron), so it needs only ``megatron.core``. As
the reference framework does, a Megatron-LM checkout on ``PYTHONPATH`` makes the rest of Megatron-LM's flags
available: a flag vime does not declare but Megatron-LM's parser (``megatron.training.arguments``) knows is
parsed with Megatron-LM's type and default, and passed through

- to megatron-core: a flag whose destination is a field of ``TransformerConfig`` sets that field of the models
  the Megatron backend builds (Megatron-LM's own rule for its config), except a field vime sets itself (the
  model's shape, parallelism, precision and fusions: refused at start-up, naming the flag);
- to user code: every passed-through flag is an attribute of the ``args`` namespace that hooks and custom
  functions receive.

Without a checkout, a flag vime does not declare is refused at start-up, naming it.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from vime.config.base import ConfigError

HINT = (
    "not a vime flag (vime train --help); Megatron-LM's own flags are accepted when a Megatron-LM checkout "
    "(with megatron.training.arguments.add_megatron_arguments) is on PYTHONPATH"
)


def megatron_lm_parser(flag: str) -> argparse.ArgumentParser | None:
    """Megatron-LM's argument parser (``add_megatron_arguments``, in checkouts of the megatron-core 0.16 era), or
    None without a checkout. A checkout that fails to import raises ConfigError naming ``flag`` (the first flag
    vime did not know) and the reason."""
    import importlib.util

    try:
        if importlib.util.find_spec("megatron.training") is None:
            return None
    except ModuleNotFoundError:  # no `megatron` package at all
        return None
    try:
        from megatron.training import arguments
    except ImportError as error:
        raise ConfigError(
            flag,
            f"not a vime flag, and the Megatron-LM checkout on PYTHONPATH, which may know it, does not import: {error}",
        ) from None
    if not hasattr(arguments, "add_megatron_arguments"):
        return None  # an older checkout: its flags are built inside parse_args(), which reads sys.argv itself
    return arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False, add_help=False))


@dataclasses.dataclass
class Passthrough:
    """Megatron-LM flags given on the command line."""

    values: dict[str, Any] = dataclasses.field(default_factory=dict)  # destination -> parsed value
    flags: dict[str, str] = dataclasses.field(default_factory=dict)  # destination -> the flag as given


def parse_passthrough(
    unknown: list[str], vime_args: argparse.Namespace, parser: argparse.ArgumentParser | None = None
) -> Passthrough:
    """The flags among ``unknown`` (what vime's parser left over) that Megatron-LM's parser knows. Anything else,
    or a flag whose destination is one of vime's own (``vime_args``), raises ConfigError naming the flag."""
    if not unknown:
        return Passthrough()
    parser = parser if parser is not None else megatron_lm_parser(_first_flag(unknown))
    if parser is None:
        raise ConfigError(_first_flag(unknown), HINT)
    namespace, rest = parser.parse_known_args(unknown)
    if rest:
        raise ConfigError(
            _first_flag(rest), "not a vime flag (vime train --help) nor one of the Megatron-LM checkout's on PYTHONPATH"
        )
    destinations = {option: action.dest for action in parser._actions for option in action.option_strings}
    out = Passthrough()
    for token in unknown:
        flag = token.split("=", 1)[0]
        if flag not in destinations:
            continue  # a value
        dest = destinations[flag]
        if hasattr(vime_args, dest):
            raise ConfigError(flag, f"Megatron-LM's flag sets {dest!r}, which a vime flag sets (vime train --help)")
        out.values[dest], out.flags[dest] = getattr(namespace, dest), flag
    return out


def _first_flag(tokens: list[str]) -> str:
    return next((token.split("=", 1)[0] for token in tokens if token.startswith("-")), tokens[0])


def transformer_overrides(passthrough: Passthrough) -> dict[str, Any]:
    """The passed-through flags that set ``TransformerConfig`` fields; one that sets a field vime decides itself
    raises ConfigError naming the flag."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from vime.backends.megatron_model import VIME_TRANSFORMER_FIELDS

    fields = {field.name for field in dataclasses.fields(TransformerConfig) if field.init}
    overrides = {name: value for name, value in passthrough.values.items() if name in fields}
    for name in overrides:
        if name in VIME_TRANSFORMER_FIELDS:
            raise ConfigError(
                passthrough.flags[name],
                f"sets TransformerConfig.{name}, which vime sets itself (from vime's own flags and the HF config)",
            )
    return overrides
