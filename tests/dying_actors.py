"""Ray actors that die, for tests of what the driver says then (tests/integration/test_actor_died_for_good.py).
A module of their own, importable from the repository's root, so that Ray's workers load the classes by name."""

from __future__ import annotations

import os


class Ends:
    """Ends its own process when asked, as the controller does after a failed write of the queue."""

    def end(self) -> None:
        os._exit(75)


class CannotStart:
    """Its constructor fails, as a controller's whose queue volume still fails after its wait."""

    def __init__(self) -> None:
        raise OSError(5, "Input/output error")

    def call(self) -> None:
        pass
