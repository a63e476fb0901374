"""The first Ctrl-C is a promise (vime/runtime/interrupts.py, Redelivery): a KeyboardInterrupt swallowed on
its way (by a finalizer, or by third-party code catching BaseException) is delivered again until the run's
teardown has begun, and never once it has (a redelivery must not hurry the clean-up).

These tests send a real SIGINT to this process, handled by vime's own handler in the main thread."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from vime.runtime import interrupts as train


@pytest.fixture
def vime_handler() -> Iterator[None]:
    previous = signal.signal(signal.SIGINT, train._on_signal)
    for event in (train._INTERRUPTED, train._TEARING_DOWN, train._TEARDOWN_BEGAN, train._HURRIED, train._REDELIVERED):
        event.clear()
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        for event in (
            train._INTERRUPTED,
            train._TEARING_DOWN,
            train._TEARDOWN_BEGAN,
            train._HURRIED,
            train._REDELIVERED,
        ):
            event.clear()


def _swallow_one_ctrl_c() -> None:
    """What a finalizer or a library catching BaseException does to a KeyboardInterrupt."""
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(2)
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the SIGINT raised nothing")


def _idle(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.02)


def test_a_swallowed_ctrl_c_is_delivered_again(vime_handler):
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        with train.Redelivery(interval=0.2):
            _swallow_one_ctrl_c()
            _idle(5)  # the run goes on, unaware: the redelivery interrupts it
    assert time.monotonic() - started < 3


def test_no_redelivery_once_the_teardown_has_begun(vime_handler):
    with train.Redelivery(interval=0.2):
        _swallow_one_ctrl_c()
        train._TEARDOWN_BEGAN.set()  # the driver's teardown started: the interrupt was honoured
        train._TEARING_DOWN.set()
        _idle(1)  # raises nothing, and does not hurry the teardown
    assert not train._HURRIED.is_set()


def test_without_ctrl_c_nothing_is_delivered(vime_handler):
    with train.Redelivery(interval=0.1):
        _idle(0.5)
    assert not train._INTERRUPTED.is_set()
