"""--update-weight-mode auto's choice (vime.weights.mode_choice): measured costs decide, both modes get measured
first, and the mode not chosen is tried again every probe_interval publications."""

import pytest

from vime.weights.mode_choice import AutoModeChoice, PublishMode

FULL, DELTA = PublishMode.FULL, PublishMode.DELTA


def run(choice: AutoModeChoice, costs: dict[PublishMode, float], n: int) -> list[PublishMode]:
    """``n`` publications where each mode costs what ``costs`` says (the publisher writes what is asked)."""
    modes = []
    for _ in range(n):
        mode = choice.next_mode()
        choice.record(mode, costs[mode])
        modes.append(mode)
    return modes


def test_both_modes_are_measured_before_any_choice():
    choice = AutoModeChoice(probe_interval=5)
    assert choice.next_mode() is DELTA  # asked; a trainer's first publication is full anyway
    choice.record(FULL, 0.2)
    assert choice.next_mode() is DELTA  # still unmeasured
    choice.record(DELTA, 0.5)
    assert choice.next_mode() is FULL
    assert choice.describe() == "full 0.200s, delta 0.500s"


@pytest.mark.parametrize("cheaper", [FULL, DELTA])
def test_the_cheaper_mode_is_published_and_the_other_is_tried_every_probe_interval(cheaper):
    other = DELTA if cheaper is FULL else FULL
    choice = AutoModeChoice(probe_interval=4)
    choice.record(FULL, 0.12 if cheaper is DELTA else 0.1)
    choice.record(DELTA, 0.12 if cheaper is FULL else 0.1)
    modes = run(choice, {cheaper: 0.1, other: 0.12}, 12)
    assert modes == [cheaper, cheaper, cheaper, other] * 3


def test_a_much_slower_mode_is_tried_less_often_so_that_its_tries_cost_at_most_a_tenth():
    """Delta 9x slower than full (measured on a local disk): one try costs 8 syncs' worth, so it comes after 80
    full ones, not after every probe_interval (10) of them, which would make auto 1.8x slower than full."""
    choice = AutoModeChoice(probe_interval=10)
    choice.record(FULL, 0.1)
    choice.record(DELTA, 0.9)
    assert choice.probe_gap() == 80
    modes = run(choice, {FULL: 0.1, DELTA: 0.9}, 160)
    assert modes == ([FULL] * 79 + [DELTA]) * 2
    total = sum(0.1 if m is FULL else 0.9 for m in modes)
    assert total / (0.1 * len(modes)) <= 1 + 0.1  # within the budget of the faster mode alone


def test_a_mode_that_became_cheaper_takes_over_at_its_next_try():
    """Late in training a step changes fewer bits and deltas compress better: the probe sees it."""
    choice = AutoModeChoice(probe_interval=4)
    choice.record(FULL, 0.3)
    choice.record(DELTA, 0.33)
    assert run(choice, {FULL: 0.3, DELTA: 0.05}, 5) == [FULL, FULL, FULL, DELTA, DELTA]
    # Smoothed: one slow delta (a busy machine) does not flip the choice back at once.
    choice.record(DELTA, 0.5)
    assert choice.next_mode() is DELTA and choice.cost[DELTA] == pytest.approx(0.275)


def test_a_bad_probe_interval_is_refused():
    with pytest.raises(ValueError, match="probe_interval must be >= 1"):
        AutoModeChoice(probe_interval=0)


def test_auto_publishes_through_delta_mode_and_a_full_version_is_a_forced_one():
    """Delta mode keeps the published files to encode the next version against, whichever mode is chosen; an
    engine without the parent still forces a full version when a delta is cheaper."""
    choice = AutoModeChoice(probe_interval=10)
    choice.record(FULL, 0.1)
    choice.record(DELTA, 0.5)
    assert choice.publish_arguments(False) == ("delta", True)  # full is cheaper
    choice = AutoModeChoice(probe_interval=10)
    choice.record(FULL, 0.5)
    choice.record(DELTA, 0.1)
    assert choice.publish_arguments(False) == ("delta", False)
    assert choice.publish_arguments(True) == ("delta", True)
