"""The slow-component injection used by the staleness tests, the holds that keep a test's run open, and
the tokens-per-version metric."""

from __future__ import annotations

import time

from vime.recovery.faults import fault_point, held
from vime.sample import Sample
from vime.workers.trainer_worker import tokens_per_version


def test_delay_sleeps_at_every_hit_of_its_point_only(monkeypatch):
    monkeypatch.setenv("VIME_FAULT_DELAYS", "trainer.mid_step=0.2, other.point=5")
    monkeypatch.delenv("VIME_FAULTS", raising=False)
    started = time.monotonic()
    fault_point("trainer.mid_step")
    fault_point("trainer.mid_step")
    slept = time.monotonic() - started
    assert 0.4 <= slept < 2.0
    started = time.monotonic()
    fault_point("rollout.after_publish")  # not delayed
    assert time.monotonic() - started < 0.1


def test_a_hold_lasts_from_its_position_until_the_release_file_exists_and_can_be_armed_again(monkeypatch, tmp_path):
    release = tmp_path / "release"
    monkeypatch.setenv("VIME_FAULT_HOLDS", "driver.before_step=3")
    monkeypatch.setenv("VIME_FAULT_RELEASE", str(release))
    assert [held("driver.before_step", step) for step in (1, 2, 3, 4)] == [False, False, True, True]
    assert not held("other.point", 5)
    release.touch()
    assert not held("driver.before_step", 4)
    release.unlink()  # a test holds the run again for a later event
    assert held("driver.before_step", 5)
    monkeypatch.delenv("VIME_FAULT_HOLDS")
    assert not held("driver.before_step", 5)


def test_tokens_per_version_counts_each_response_token_by_its_version():
    a = Sample(tokens=[1, 2, 3, 4, 5], response_length=3, weight_versions=[2, 2, 3])
    b = Sample(tokens=[1, 2, 3], response_length=2, weight_versions=[3, 4])
    empty = Sample(tokens=[1], response_length=0, weight_versions=[])
    assert tokens_per_version([a, b, empty]) == {"2": 2, "3": 2, "4": 1}
    assert list(tokens_per_version([b, a])) == ["2", "3", "4"]  # ordered by version
