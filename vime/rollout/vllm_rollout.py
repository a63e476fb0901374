"""The import path the ``--vllm-config`` guide uses for its runtime helpers; they live in
:mod:`vime.config.vllm_config` beside the resolution that fills ``args.vllm_model_routers``."""

from vime.rollout.model_routes import get_model_url, prime_encoder

__all__ = ["get_model_url", "prime_encoder"]
