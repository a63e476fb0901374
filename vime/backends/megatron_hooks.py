"""The Megatron backend's user hooks (the reference framework's signatures), checked before any process starts.

- ``--custom-megatron-init-path``: ``init(args)`` once, after the model-parallel state is set up and
  before the model is built.
- ``--custom-megatron-before-log-prob-hook-path``: ``hook(args, model, store_prefix)`` before log-probs
  are computed; ``store_prefix`` is ``""`` for the actor's (old policy) log-probs and ``"ref_"`` for the
  reference model's; ``model`` is the list of model chunks (one GPTModel here).
- ``--custom-megatron-before-train-step-hook-path``: ``hook(args, rollout_id, step_id, model,
  optimizer, opt_param_scheduler)`` before each optimizer step's forward/backward passes.
"""

from __future__ import annotations

from typing import Any

from vime.runtime.plugins import Hook, check_call, load_object

MEGATRON_HOOKS: dict[str, Hook] = {
    "--custom-megatron-init-path": Hook("init(args)", 1),
    "--custom-megatron-before-log-prob-hook-path": Hook("hook(args, model, store_prefix)", 3),
    "--custom-megatron-before-train-step-hook-path": Hook(
        "hook(args, rollout_id, step_id, model, optimizer, opt_param_scheduler)", 6
    ),
}


def load_megatron_hook(flag: str, path: str) -> Any:
    """Load the function ``path`` names and check it accepts the call vime makes (PluginError otherwise)."""
    function = load_object(path, flag)
    check_call(function, flag, path, MEGATRON_HOOKS[flag])
    return function
