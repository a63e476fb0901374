"""Reading values of an HF model's config (``transformers.PretrainedConfig``) for vime's checks of model flags.

In the config layer, below the backends (docs/decisions.md, "Layers and lint"): the flag declarations and the
backends' architecture resolution (vime.backends.megatron_args) both read configs with it. Nothing here imports
torch or transformers.
"""

from __future__ import annotations


def config_value(config, name: str):
    """config.json's ``name`` (None where absent). In a heterogeneous config (Gemma 4's, layers of two head sizes) a
    per-layer attribute reads as its global value, the one every layer without its own takes."""
    try:
        return getattr(config, name, None)
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError
        return vars(config).get(name)
