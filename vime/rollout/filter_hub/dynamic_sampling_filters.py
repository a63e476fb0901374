"""``--dynamic-sampling-filter-path vime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std``,
as the reference framework's scripts pass it: the same function as vime.rollout.filters'."""

from vime.rollout.filters import check_reward_nonzero_std

__all__ = ["check_reward_nonzero_std"]
