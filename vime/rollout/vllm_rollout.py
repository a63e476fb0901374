"""The reference framework's rollout module path. ``get_model_url`` and ``prime_encoder`` are the runtime helpers
the ``--vllm-config`` guide imports from here (they live in :mod:`vime.rollout.model_routes`);
``generate_rollout``, the reference's default ``--rollout-function-path``, selects vime's built-in rollout
(see vime.rollout.fully_async_rollout)."""

from vime.rollout.fully_async_rollout import generate_rollout_fully_async as generate_rollout
from vime.rollout.model_routes import get_model_url, prime_encoder

__all__ = ["generate_rollout", "get_model_url", "prime_encoder"]
