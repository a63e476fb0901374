"""The reference framework's import path for the dynamic sampling filters; vime's live in vime.rollout.filters."""
