"""--dynamic-sampling-filter-path: the filter's verdicts, and what a rejected group becomes in the
queue (the real straw queue and its in-memory twin): a terminal 'rejected' task, never accepted or
trained, its prompt not handed out again, its admission slot given to a fresh prompt."""

from __future__ import annotations

import pytest

from tests.controller_spec import controller_spec, write_prompts
from vime.rollout.filters import DynamicFilterOutput, FilterError, check_reward_nonzero_std, interpret
from vime.sample import Sample
from vime.workers.controller import Controller


def group(*rewards):
    return [Sample(index=i, reward=r) for i, r in enumerate(rewards)]


def test_nonzero_std_filter_keeps_only_groups_with_a_signal():
    assert check_reward_nonzero_std(None, group(0.0, 1.0, 0.0)) == DynamicFilterOutput(True, None)
    assert check_reward_nonzero_std(None, group(1.0, 1.0)) == DynamicFilterOutput(False, "zero_std_1.0")
    assert check_reward_nonzero_std(None, group(0.25, 0.25, 0.25)).reason == "zero_std_0.2"
    assert not check_reward_nonzero_std(None, group(0.5)).keep


def test_filter_answers_are_interpreted_or_refused():
    import torch

    assert interpret(True, "f") == DynamicFilterOutput(True)
    assert interpret(False, "f") == DynamicFilterOutput(False, "filtered")
    assert interpret(torch.tensor(False), "f").keep is False
    assert interpret(DynamicFilterOutput(False), "f").reason == "filtered"

    class Reference:  # the reference framework's own output type has the same fields
        keep, reason = False, "too_easy"

    assert interpret(Reference(), "f") == DynamicFilterOutput(False, "too_easy")
    with pytest.raises(FilterError, match=r"--dynamic-sampling-filter-path my\.py:f: returned 'yes' \(str\)"):
        interpret("yes", "my.py:f")
    with pytest.raises(FilterError, match="returned None"):
        interpret(None, "my.py:f")


@pytest.fixture
def prompts(tmp_path):
    return write_prompts(tmp_path, 6)


def controller(tmp_path, prompts, transport):
    return Controller(
        controller_spec(tmp_path, prompts, transport=transport, num_epoch=1, groups_per_rollout=1, max_staleness=0)
    )


@pytest.mark.parametrize("transport", ["straw", "object-store"])
def test_a_rejected_group_is_terminal_and_frees_its_slot(tmp_path, prompts, transport):
    c = controller(tmp_path, prompts, transport)
    first = c.lease("w", 10)
    assert len(first) == 1  # admission: one group outstanding at staleness 0
    lease = first[0].assignment.lease
    assert c.reject(lease, "zero_std_0.0")
    assert c.reject(lease, "zero_std_0.0") in (True, False)  # a replayed call changes nothing
    stats = c.stats()
    assert stats.rejected == 1 and stats.accepted == 0 and stats.leased == 0
    second = c.lease("w", 10)  # the slot went to the next prompt
    assert [i.prompt.index for i in second] == [1]
    assert not c.heartbeat([lease])[0]  # the rejected lease is dead
    assert c.reject(lease, "another reason") is False  # already rejected: nothing changes
    # Every other prompt is handed out once; the rejected one never again.
    c.reject(second[0].assignment.lease, "zero_std_1.0")
    seen = [first[0].prompt.index, second[0].prompt.index]
    while items := c.lease("w", 10):
        seen += [i.prompt.index for i in items]
        for item in items:
            c.reject(item.assignment.lease, "zero_std_0.0")
    assert seen == list(range(6))
    assert c.stats().end_of_data and c.stats().rejected == 6
    assert c.take_groups(0, 1, 0, 0, allow_partial=True).groups == []  # nothing to train
    c.shutdown()
    if transport == "straw":
        from vime.queue.journal_view import JournalView
        from vime.tools.queue_cli import task_stages

        stages = task_stages(JournalView.read(str(tmp_path / "queue")))
        assert sorted(stages.values()) == ["rejected"] * 6


def test_a_stale_lease_cannot_reject(tmp_path, prompts):
    c = controller(tmp_path, prompts, "straw")
    c.spec.max_staleness = 10
    item = c.lease("w", 1)[0]
    c.return_partial(item.assignment.lease, item.assignment.task, None)  # the lease moved on
    assert c.reject(item.assignment.lease, "late") is False
    assert item.prompt.index in [i.prompt.index for i in c.lease("w", 10)]  # the prompt is still to do
    assert c.stats().rejected == 0
    c.shutdown()
