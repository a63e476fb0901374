"""Ctrl-C and SIGTERM for `vime train`: one orderly stop, honoured every time.

- **While the run runs**, the first Ctrl-C (or SIGTERM) raises KeyboardInterrupt in the main thread and
  is remembered: the driver's loops also call :func:`raise_if_interrupted`, and :class:`Redelivery`
  interrupts the main thread again every :data:`REDELIVERY_S` seconds until the teardown has begun.
  Both are needed because a KeyboardInterrupt is lost when it lands in a finalizer (a Ray ObjectRef's
  ``__del__``: Python prints "Exception ignored" and goes on) or in third-party code that catches
  BaseException, and a long blocking call (an engine's start, an evaluation, a checkpoint) may keep
  the loop from coming round for minutes.
- **During the teardown** (:func:`teardown`) a KeyboardInterrupt would skip the rest of the clean-up,
  the final sweep included (the engines' EngineCore/Worker processes would outlive the run): the first
  Ctrl-C there raises :class:`StopNow` (skip the orderly steps left, sweep at once) and later ones are
  only noted. A redelivery never hurries a teardown.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

REDELIVERY_S = 2.0  # a Ctrl-C not honoured after this long is delivered again

_INTERRUPTED = threading.Event()  # a Ctrl-C or SIGTERM came
_TEARING_DOWN = threading.Event()  # the driver is stopping the run's processes
_HURRIED = threading.Event()  # the teardown was told to sweep at once (or is past its orderly steps)
_TEARDOWN_BEGAN = threading.Event()  # cleared only by install(): ends the redelivery
_REDELIVERED = threading.Event()  # the SIGINT being handled is Redelivery's, not the user's


class StopNow(BaseException):
    """A Ctrl-C during the teardown: skip the orderly steps left and sweep the run's processes at once."""


def install() -> None:
    """Handle SIGINT and SIGTERM with the orderly stop (whatever an import installed), from a clean state."""
    for event in (_INTERRUPTED, _TEARING_DOWN, _HURRIED, _TEARDOWN_BEGAN, _REDELIVERED):
        event.clear()
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)


def _on_signal(signum, frame) -> None:
    redelivered = _REDELIVERED.is_set()
    _REDELIVERED.clear()
    _INTERRUPTED.set()
    if redelivered and _TEARDOWN_BEGAN.is_set():
        return  # honoured meanwhile: a redelivery must not hurry the teardown
    if not _TEARING_DOWN.is_set():
        raise KeyboardInterrupt
    if not _HURRIED.is_set():
        _HURRIED.set()
        raise StopNow


def raise_if_interrupted() -> None:
    """Raise the KeyboardInterrupt a finalizer may have swallowed."""
    if _INTERRUPTED.is_set():
        raise KeyboardInterrupt


@contextlib.contextmanager
def teardown() -> Iterator[None]:
    """The driver's teardown: from now on a Ctrl-C hurries the clean-up instead of cutting it short."""
    _TEARING_DOWN.set()
    _TEARDOWN_BEGAN.set()  # the interrupt (if any) was honoured: no more redelivery
    try:
        yield
    finally:
        _TEARING_DOWN.clear()
        _HURRIED.clear()


def hurried() -> bool:
    """Whether a Ctrl-C during the teardown asked to skip its orderly steps."""
    return _HURRIED.is_set()


def hurry() -> None:
    """Past the orderly steps: from here on a Ctrl-C is only noted, nothing may cut the rest short."""
    _HURRIED.set()


class Redelivery:
    """Delivers a Ctrl-C again, every ``interval`` seconds, until the teardown has begun: the first Ctrl-C
    is a promise. While the run has been interrupted and is not tearing down yet, this thread interrupts
    the main thread again (``_thread.interrupt_main``: the same handler, run by the main thread)."""

    def __init__(self, interval: float = REDELIVERY_S):
        self.interval = interval
        self.over = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="vime-ctrl-c", daemon=True)

    def __enter__(self) -> Redelivery:
        self.thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.over.set()
        self.thread.join(timeout=5)

    def _watch(self) -> None:
        import _thread

        while not self.over.is_set():
            if not _INTERRUPTED.wait(timeout=0.5):
                continue
            if self.over.wait(timeout=self.interval) or _TEARDOWN_BEGAN.is_set():
                return  # the run is over, or its teardown has begun: the Ctrl-C was honoured
            _REDELIVERED.set()
            _thread.interrupt_main(signal.SIGINT)
