"""Which weight versions make up the surviving model lineage (docs/queue-and-recovery.md, "The trainer
restarts in place").

Version numbers only ever increase within a run: when the trainer is restored in place from the
checkpoint of step S (published then as version ``lost_after``), the steps after it are lost, and the
restored weights are published under a new version, higher than every version published so far. The
versions in between (``lost_after`` < v < ``version``) belong to weights that no longer exist: a
group carrying one of their tokens is never trained (its prompt runs again). A version number
therefore names one set of weights for the whole run, and a staleness is measured in steps of the
surviving lineage (:meth:`Lineage.staleness`), so a restore's jump in numbering does not count.
"""

from __future__ import annotations

import msgspec


class Restore(msgspec.Struct, frozen=True):
    version: int  # the new version the restored weights were published under
    step: int  # the lineage step those weights are (the restored checkpoint's step; 0: initial weights)
    lost_after: int  # the version the restored weights were first published as; after it up to version: lost


class Lineage(msgspec.Struct, frozen=True):
    restores: tuple[Restore, ...] = ()

    def restored(self, *, step: int, restored_version: int, new_version: int) -> Lineage:
        if new_version <= max((r.version for r in self.restores), default=-1):
            raise ValueError(f"version {new_version} was used before: versions only increase")
        return Lineage((*self.restores, Restore(new_version, step, restored_version)))

    def lost(self, version: int) -> bool:
        """Whether ``version`` names weights of steps that a restore threw away."""
        return any(r.lost_after < version < r.version for r in self.restores)

    @property
    def newest_lost(self) -> int:
        """The highest lost version (-1: none): a group whose oldest token is newer carries none."""
        return max((r.version - 1 for r in self.restores if r.version - 1 > r.lost_after), default=-1)

    def step_of(self, version: int) -> int:
        """The lineage step the weights of a (not lost) ``version`` are: how many steps trained them."""
        for restore in reversed(self.restores):
            if version >= restore.version:
                return restore.step + version - restore.version
        return version  # before any restore in this run, one version per step (version 0: --hf-checkpoint)

    def staleness(self, policy_version: int, token_version: int) -> int:
        """Steps of the surviving lineage between the weights that generated a token and the policy."""
        return self.step_of(policy_version) - self.step_of(token_version)


def resumed(lineage: Lineage, *, step: int, restored_version: int, newest_given_out: int) -> tuple[Lineage, int]:
    """(lineage, version) for weights restored from the checkpoint of ``step`` (published then as
    ``restored_version``) by a run resumed with --load, when the run before gave out versions up to
    ``newest_given_out``. Anything newer than the checkpoint belongs to weights that died with that run:
    the restored weights get a version above all of them, and the ones in between are lost, exactly as
    for a trainer restored in place. Nothing newer: the checkpoint's version, the lineage unchanged."""
    if newest_given_out <= restored_version:
        return lineage, restored_version
    version = newest_given_out + 1
    return lineage.restored(step=step, restored_version=restored_version, new_version=version), version
