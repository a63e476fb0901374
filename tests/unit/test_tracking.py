"""Experiment tracking (vime/tracking.py): flags refused naming the flag; records of synthetic runs, a resume
with --load and a trainer restored in place included, read back from wandb's offline run files (wandb's
own reader) and TensorBoard's event files (TensorBoard's EventAccumulator): one monotone step axis."""

from __future__ import annotations

import os

import pytest

from tests.tracking_readers import assert_one_monotone_axis, tensorboard_scalars, wandb_history
from tests.train_args import minimal_train_argv
from vime.config import ConfigError, parse_train_args
from vime.runtime.process import RUN_TOKEN_ENV, processes_with_tokens
from vime.tracking import STATE_FILE, RunTracker, StepRows, read_state, row_of

TOKEN = "tracking-unit-test"


def _settings(config_dir, tmp_path, *extra):
    return parse_train_args(minimal_train_argv(config_dir, "--run-dir", str(tmp_path / "run"), *extra))


# ------------------------------------------------------------------ flags
def test_use_wandb_needs_a_project_unless_disabled(config_dir, tmp_path):
    with pytest.raises(ConfigError, match="^--wandb-project: is required with --use-wandb"):
        _settings(config_dir, tmp_path, "--use-wandb", "--wandb-mode", "offline")
    s = _settings(config_dir, tmp_path, "--use-wandb", "--wandb-mode", "disabled")
    assert not s.tracking.wandb_enabled
    assert s.tracking.wandb_dir == str(tmp_path / "run")  # the default: --run-dir


def test_wandb_mode_and_run_id_are_checked(config_dir, tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit):
        _settings(config_dir, tmp_path, "--use-wandb", "--wandb-project", "p", "--wandb-mode", "cloud")
    assert "--wandb-mode: invalid choice: 'cloud'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="^--wandb-run-id: 'a/b'"):
        _settings(config_dir, tmp_path, "--use-wandb", "--wandb-project", "p", "--wandb-run-id", "a/b")
    monkeypatch.setenv("WANDB_MODE", "sometimes")
    with pytest.raises(ConfigError, match="^--wandb-mode: not given, and the environment's WANDB_MODE='sometimes'"):
        _settings(config_dir, tmp_path, "--use-wandb", "--wandb-project", "p")
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert _settings(config_dir, tmp_path, "--use-wandb", "--wandb-project", "p").tracking.resolved_wandb_mode == (
        "offline"
    )


def test_tensorboard_folder_follows_the_reference_framework(config_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    s = _settings(config_dir, tmp_path, "--use-tensorboard")
    assert s.tracking.tensorboard_dir(s.run_dir) == str(tmp_path / "run" / "tensorboard")
    s = _settings(config_dir, tmp_path, "--use-tensorboard", "--tb-project-name", "proj", "--tb-experiment-name", "e1")
    assert s.tracking.tensorboard_dir(s.run_dir) == str(tmp_path / "tensorboard_log" / "proj" / "e1")
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    assert s.tracking.tensorboard_dir(s.run_dir) == str(tmp_path / "tb")


# ------------------------------------------------------------------ rows and the step axis
def test_rows_of_records_name_their_kind_and_count_events():
    assert row_of({"kind": "train", "step": 3, "time": 1.5, "loss": 0.25, "disk_free_gb": {"queue": 9}, "x": "s"}) == {
        "train/loss": 0.25,
        "train/disk_free_gb/queue": 9.0,
    }
    assert row_of({"kind": "eval", "step": 2, "dataset": "held", "eval_reward": 0.5, "weight_version": 2}) == {
        "eval/held/reward": 0.5,
        "eval/held/weight_version": 2.0,
    }
    assert row_of({"kind": "engine", "event": "lost", "engine": "e0", "weight_version": 4}) == {
        "engine/weight_version": 4.0,
        "events/engine/lost": 1.0,
    }


class _Recorded:
    """The callbacks StepRows is given, recorded (the real sinks are exercised below)."""

    def __init__(self):
        self.rows, self.reserved = [], []

    def emit(self, row, step):
        self.rows.append((step, dict(row)))

    def reserve(self, step):
        self.reserved.append(step)


def test_one_row_per_step_reserved_before_it_is_written_and_never_backwards():
    out = _Recorded()
    rows = StepRows(-1, out.emit, out.reserve)
    rows.add({"kind": "engine", "event": "serving"})  # before any step: joins step 0
    rows.add({"kind": "eval", "step": 0, "dataset": "d", "eval_reward": 0.1})
    rows.end_step(0)
    rows.add({"kind": "weight_sync", "step": 1, "seconds": 0.2})  # published before step 1's train record
    rows.add({"kind": "train", "step": 1, "loss": 1.0})
    rows.add({"kind": "engine", "event": "lost"})
    rows.add({"kind": "engine", "event": "lost"})
    rows.end_step(1)
    rows.add({"kind": "train", "step": 1, "loss": 9.0})  # step 1 again (a retrained step): not written
    rows.add({"kind": "eval", "step": 1, "dataset": "d", "eval_reward": 0.7})  # new names at step 1: written
    rows.add({"kind": "rollout_worker", "worker": 0, "groups_accepted": 5})  # stopping workers: step 1 too
    rows.add({"kind": "train", "step": 0, "loss": 5.0})  # backwards: not written
    assert out.rows == [
        (0, {"events/engine/serving": 1.0, "eval/d/reward": 0.1}),
        (1, {"weight_sync/seconds": 0.2, "train/loss": 1.0, "events/engine/lost": 2.0}),
        (1, {"eval/d/reward": 0.7}),
        (1, {"rollout_worker/worker": 0.0, "rollout_worker/groups_accepted": 5.0, "events/rollout_worker": 1.0}),
    ]
    assert out.reserved == [0, 1]
    assert rows.not_relogged == {0, 1}


def test_a_resumed_process_writes_nothing_at_or_below_the_reserved_step():
    out = _Recorded()
    rows = StepRows(5, out.emit, out.reserve)  # tracking.json of the run resumed said 5
    rows.annotate({"recovery/resumed_from_step": 3.0})
    for step in (3, 4, 5, 6):  # the checkpoint's evaluation, two retrained steps, a new one
        rows.add({"kind": "train", "step": step, "loss": float(step)})
        rows.end_step(step)
    assert out.rows == [(6, {"recovery/resumed_from_step": 3.0, "train/loss": 6.0})]
    assert out.reserved == [6] and rows.not_relogged == {3, 4, 5}


# ------------------------------------------------------------------ real trackers, read back
def _tracked(tmp_path, *extra, tensorboard=True):
    model = tmp_path / "model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text('{"vocab_size": 12}')
    save = str(tmp_path / "save")
    return parse_train_args(
        minimal_train_argv(
            str(model),
            "--run-dir",
            str(tmp_path / "run"),
            "--save",
            save,
            "--load",
            save,
            "--use-wandb",
            "--wandb-mode",
            "offline",
            "--wandb-project",
            "vime-test",
            "--wandb-group",
            "digits",
            "--wandb-key",
            "not-a-real-key",
            *(["--use-tensorboard"] if tensorboard else []),
            *extra,
        )
    )


def _train_steps(tracker, steps, loss_base):
    for step in steps:
        tracker.write({"kind": "weight_sync", "step": step, "seconds": 0.1})
        tracker.write({"kind": "train", "step": step, "loss": loss_base + step, "reward_mean": step / 10})
        tracker.end_step(step)


def test_a_resumed_run_continues_the_same_wandb_run_and_tensorboard_axis(tmp_path):
    """Run 1 logs steps 0..5 (checkpoint at 3) and dies after step 5's row; run 2 resumes from step 3 with
    --load, retrains 4 and 5 (different values: the lineage that survived) and goes on to 7, where its trainer
    dies in step 8 and is restored in place to step 6. Both trackers show steps 0..9 once each, in order."""
    settings = _tracked(tmp_path)
    said = []
    first = RunTracker.start(settings, run_token=TOKEN, resumed_from=None, say=said.append)
    first.write({"kind": "eval", "step": 0, "dataset": "held", "eval_reward": 0.0})
    first.end_step(0)
    _train_steps(first, range(1, 6), loss_base=10.0)
    first.close()  # (a hard kill is the end-to-end test's, tests/e2e/test_kill_resume.py)
    state = read_state(str(tmp_path / "save"))
    assert (
        state.reserved_step == 5 and state.wandb_group.startswith("digits_") and state.wandb_name == state.wandb_group
    )

    second = RunTracker.start(_tracked(tmp_path), run_token=TOKEN, resumed_from=3, say=said.append)
    assert "steps up to 5 are already there" in said[-1]
    second.write({"kind": "engine", "event": "serving", "weight_version": 3})
    second.write({"kind": "eval", "step": 3, "dataset": "held", "eval_reward": 0.9})  # before training: step 3 again
    second.end_step(3)
    _train_steps(second, range(4, 8), loss_base=20.0)  # 4 and 5 retrained
    second.write({"kind": "trainer_restart", "step": 8, "restored_step": 6, "seconds": 1.5})
    _train_steps(second, range(7, 10), loss_base=30.0)  # 7 retrained after the restore in place
    second.write({"kind": "eval", "step": 9, "dataset": "held", "eval_reward": 0.8})  # after training
    second.close()

    history = wandb_history(str(tmp_path / "run"))
    assert {run_id for run_id, _, _ in history} == {state.wandb_run_id}  # one wandb run, continued
    assert_one_monotone_axis([step for _, step, _ in history], "wandb")
    loss = {step: values["train/loss"] for _, step, values in history if "train/loss" in values}
    assert loss == {1: 11.0, 2: 12.0, 3: 13.0, 4: 14.0, 5: 15.0, 6: 26.0, 7: 27.0, 8: 38.0, 9: 39.0}
    by_step = {step: values for _, step, values in history}
    assert by_step[6]["recovery/resumed_from_step"] == 3 and by_step[6]["recovery/steps_not_relogged"] == 2
    assert by_step[6]["events/engine/serving"] == 1
    assert by_step[8]["trainer_restart/restored_step"] == 6 and by_step[8]["events/trainer_restart"] == 1
    assert by_step[9]["eval/held/reward"] == 0.8 and by_step[0]["eval/held/reward"] == 0.0

    scalars = tensorboard_scalars(str(tmp_path / "run" / "tensorboard"))
    for tag, points in scalars.items():
        assert_one_monotone_axis([step for step, _ in points], f"TensorBoard {tag}")
    assert dict(scalars["train/loss"]) == loss
    assert dict(scalars["eval/held/reward"]) == {0: 0.0, 9: pytest.approx(0.8)}
    assert len(os.listdir(tmp_path / "run" / "tensorboard")) == 2  # one event file per process, one folder


def test_the_api_key_stays_out_of_the_run_files_and_disabled_mode_starts_nothing(tmp_path):
    tracker = RunTracker.start(_tracked(tmp_path), run_token=TOKEN, resumed_from=None, say=lambda _: None)
    _train_steps(tracker, [1], loss_base=0.0)
    tracker.close()
    for folder, _, files in os.walk(tmp_path / "run" / "wandb"):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                assert b"not-a-real-key" not in f.read(), name
    said = []
    s = _tracked(tmp_path / "other", "--wandb-mode", "disabled", tensorboard=False)
    assert RunTracker.start(s, run_token=TOKEN, resumed_from=None, say=said.append) is None
    assert said == ["--wandb-mode disabled: nothing is sent to wandb"]
    assert not os.path.exists(tmp_path / "other" / "save" / STATE_FILE)


def test_wandb_logs_through_a_service_of_its_own_that_carries_the_run_token(tmp_path, monkeypatch):
    """A `vime train` started by a process that used wandb inherits WANDB_SERVICE, naming that process's service
    (one that may outlive a killed run and still hold its run id: "run ID ... is in use" on resume). Here it
    names a service that is gone: attaching to it would fail the start. The run's own service carries the run
    token (the reaper's sweep finds it) and stops when the tracker closes."""
    monkeypatch.setenv("WANDB_SERVICE", f"3-{os.getpid()}-unix-{tmp_path / 'gone.sock'}")
    token = f"{TOKEN}-{os.getpid()}"
    tracker = RunTracker.start(_tracked(tmp_path, tensorboard=False), run_token=token, resumed_from=None, say=print)
    try:
        service = processes_with_tokens([token]).get(token, [])
        assert [p.name() for p in service] == ["wandb-core"], service
        assert os.environ.get(RUN_TOKEN_ENV) != token  # only the service's environment carries it
        _train_steps(tracker, [1], loss_base=0.0)
    finally:
        tracker.close()
    assert not service[0].is_running() or service[0].status() == "zombie"
    assert [step for _, step, _ in wandb_history(str(tmp_path / "run"))] == [1]
