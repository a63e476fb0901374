"""TrainerRestarter.recover: the restart loop, what it says and records, and the error once the budget is
spent. The trainer is a stand-in that only counts its restarts: starting real trainer ranks is what
tests/faults/test_trainer_restart.py does end to end (SIGKILLed ranks, real checkpoints); this checks the
loop's bookkeeping, which those runs cannot provoke on demand (a rank dying again while restored)."""

from __future__ import annotations

import os

import pytest

from vime.errors import UserError
from vime.workers.trainer_group import TrainerDied
from vime.workers.trainer_restart import RestartCause, TrainerLost, TrainerRestarter, TrainerStepFailed


class CountingTrainer:
    def __init__(self):
        self.restarts = 0

    def restart(self) -> None:
        self.restarts += 1


class Log:
    def __init__(self):
        self.said, self.records = [], []

    def say(self, message: str) -> None:
        self.said.append(message)

    def write(self, record: dict) -> None:
        self.records.append(record)


def test_a_dead_trainer_is_restored_and_a_death_while_restoring_costs_one_more_restart():
    trainer, log = CountingTrainer(), Log()
    restarter = TrainerRestarter(trainer, budget=3, save_dir=None, resumed=None)
    served = []

    def serve(restored):
        served.append(restored)
        if len(served) == 1:
            raise TrainerDied("rank 0 died again")
        return 7

    restored = restarter.recover(TrainerDied("rank 1 died"), 4, saved_step=None, serve=serve, log=log)
    assert (restored.step, restored.folder, trainer.restarts, restarter.used) == (0, None, 2, 2)
    [record] = log.records
    assert record["kind"] == "trainer_restart" and record["cause"] == RestartCause.DIED.value
    assert record["weight_version"] == 7 and record["lost_versions"] == [1, 6] and record["restarts"] == 2
    assert "rank 0 died again" in record["error"]  # the death it recovered from last
    assert sum("restarting it in place" in line for line in log.said) == 2
    assert "serving as weight version 7" in log.said[-1]


def test_a_spent_budget_stops_the_run_naming_the_flag_and_where_to_resume():
    restarter = TrainerRestarter(CountingTrainer(), budget=1, save_dir="/ckpt", resumed=None)
    log = Log()

    def serve(restored):
        raise TrainerDied("died while loading")

    with pytest.raises(TrainerLost) as lost:
        restarter.recover(TrainerDied("rank 0 died"), 5, saved_step=None, serve=serve, log=log)
    message = str(lost.value)
    assert isinstance(lost.value, UserError)
    assert "died during step 5" in message and "--load /ckpt" in message
    assert "--trainer-restart-budget 1 is spent" in message and "died while loading" in message
    assert log.records == []


def test_with_no_budget_an_internal_step_failure_is_reported_as_itself():
    restarter = TrainerRestarter(CountingTrainer(), budget=0, save_dir=None, resumed=None)
    cause = ValueError("a broken invariant")
    failure = TrainerStepFailed("ValueError: a broken invariant")
    failure.__cause__ = cause
    with pytest.raises(ValueError, match="a broken invariant"):
        restarter.recover(failure, 2, saved_step=None, serve=lambda restored: 1, log=Log())


class LoadingTrainer(CountingTrainer):
    def __init__(self):
        super().__init__()
        self.loads = []

    def load_checkpoint(self, folder: str, *, optimizer: bool = True) -> None:
        self.loads.append((folder, optimizer))


def test_the_resumed_checkpoint_is_restored_as_the_run_loaded_it_and_its_own_ones_whole(tmp_path):
    """--no-load-optim: a trainer restored from the checkpoint the run resumed from (nothing saved since) loads it
    without the optimizer, as the run did; one this run saved (with its fresh optimizer's state) is loaded whole."""
    from vime.recovery import checkpoint as ckpt

    def state(step: int) -> ckpt.CheckpointState:
        return ckpt.CheckpointState(schema=1, step=step, weight_version=step, consumer_cursor=4 * step, run_options={})

    resumed = (str(tmp_path / "old" / "iter_0000003"), state(3))
    saved = ckpt.save_checkpoint(str(tmp_path / "save"), state(5), lambda staging: os.makedirs(staging))
    for resumed_optimizer in (False, True):
        trainer = LoadingTrainer()
        restarter = TrainerRestarter(
            trainer, budget=3, save_dir=str(tmp_path / "save"), resumed=resumed, resumed_optimizer=resumed_optimizer
        )
        assert restarter.restore(saved_step=None).step == 3
        assert restarter.restore(saved_step=5).step == 5
        assert trainer.loads == [(resumed[0], resumed_optimizer), (saved, True)]
