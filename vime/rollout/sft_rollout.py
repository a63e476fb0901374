"""``--rollout-function-path vime.rollout.sft_rollout.generate_rollout``, as the reference framework's SFT
scripts pass it: vime's SFT rollout (vime.rollout.sft), the data's own conversations as samples."""

from vime.rollout.sft import generate_rollout

__all__ = ["generate_rollout"]
