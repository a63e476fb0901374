"""Where the reference framework's filters import their return type from."""

from vime.rollout.filters import DynamicFilterOutput

__all__ = ["DynamicFilterOutput"]
