"""--update-weight-mode delta across processes: the driver's WeightSync with Ray actors, and a whole
`vime train` run (no vLLM: engines here record what they would reload)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from vime.workers.engines import EngineActor

pytestmark = pytest.mark.integration

EXAMPLE = os.path.join(REPO, "examples", "digit_shift")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from vime.tools.make_tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("model")))


def checksums(folder: str) -> dict[str, str]:
    return {
        name: hashlib.sha256(open(os.path.join(folder, name), "rb").read()).hexdigest()
        for name in sorted(os.listdir(folder))
        if name != "manifest.json"
    }


class FakeTrainer:
    """The trainer worker's weight side: an HF model, AdamW steps, a WeightPublisher."""

    def __init__(self, model_dir: str, weight_dir: str):
        import torch
        from transformers import AutoModelForCausalLM

        from vime.weights.publisher import WeightPublisher

        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.publisher = WeightPublisher(weight_dir, keep=1)
        self.scratch = weight_dir + "-expected"

    def step(self) -> dict[str, str]:
        """One optimizer step; returns the checksums of the full files it now publishes."""
        import shutil

        import torch

        ids = torch.randint(0, 12, (4, 12))
        self.optimizer.zero_grad()
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.optimizer.step()
        shutil.rmtree(self.scratch, ignore_errors=True)
        self.model.save_pretrained(self.scratch)
        return checksums(self.scratch)

    def publish_weights(self, version: int, *, mode: str, full_interval: int, force_full: bool):
        return self.publisher.publish(
            version, self.model.save_pretrained, mode=mode, full_interval=full_interval, force_full=force_full
        )


class RecordingClient:
    """Stands in for vLLM: records the checksums of each folder it is told to reload."""

    def __init__(self):
        self.loaded: list[dict[str, str]] = []

    def pause(self, mode):
        pass

    def resume(self):
        pass

    def reset_prefix_cache(self):
        pass

    def update_weight_version(self, version):
        pass

    def probe(self, expect_version=None):
        pass

    def reload_weights(self, path):
        self.loaded.append(checksums(path))


class RecordingEngine(EngineActor):
    """The real engine actor (local copy, delta application) with a recorder in place of vLLM."""

    def start(self, version: int = 0) -> str:
        self.client, self.version = RecordingClient(), version
        return f"http://engine-{self.spec.index}"

    def loaded(self) -> list[dict[str, str]]:
        return self.client.loaded


def recording_engine(ray, index: int, model_dir: str, tmp_path):
    """A RecordingEngine actor started at version 0: (its handle, its URL)."""
    from vime.workers.engines import EngineSpec

    spec = EngineSpec(
        index=index,
        model=model_dir,
        vllm_args={},
        tensor_parallel_size=1,
        run_token="t",
        log_path=str(tmp_path / f"engine-{index}.log"),
        startup_timeout=1,
        http_timeout=1,
    )
    actor = ray.remote(num_cpus=0)(RecordingEngine).remote(spec)
    return actor, ray.get(actor.start.remote(0))


@pytest.fixture(scope="module")
def ray_session():
    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import a test module
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        configure_logging=False,
        log_to_driver=False,
    )
    yield ray
    ray.shutdown()


def test_weight_sync_sends_deltas_and_a_full_version_to_a_new_engine(tmp_path, model_dir, ray_session):
    ray = ray_session
    from vime.config.weight_sync import WeightSyncConfig
    from vime.workers.engines import EngineGroup, WeightSync
    from vime.workers.trainer_group import TrainerGroup

    weight_dir = str(tmp_path / "weights")

    def engine(index: int):
        return recording_engine(ray, index, model_dir, tmp_path)

    trainer = ray.remote(num_cpus=0)(FakeTrainer).remote(model_dir, weight_dir)
    (a, url_a), (b, url_b) = engine(0), engine(1)
    group = EngineGroup([a, b], [url_a, url_b], workers=[1, 1])
    sync = WeightSync(
        TrainerGroup([trainer]), group, WeightSyncConfig(update_weight_mode="delta", update_weight_full_interval=3)
    )
    reports, expected = [], []
    for version in range(1, 5):
        expected.append(ray.get(trainer.step.remote()))
        reports.append(sync.sync(version, flush=False))
    assert [r["weight_publish_mode"] for r in reports] == ["full", "delta", "delta", "full"]
    assert all(r["weight_published_bytes"] < r["weight_full_bytes"] for r in reports[1:3])
    # The pause covers only the reload: the engine's copy (link, delta apply) and the probe are outside it.
    assert all(0 < r["weight_pause_seconds"] < r["weight_load_seconds"] for r in reports)
    assert all(0 < r["weight_pause_request_seconds"] < r["weight_pause_seconds"] for r in reports)
    for actor in (a, b):
        assert ray.get(actor.loaded.remote()) == expected  # bit for bit, every version

    # A new engine holds version 0: the next publication is full, although a delta was due.
    c, url_c = engine(2)
    group.actors.append(c)
    group.urls.append(url_c)
    group.workers.append(1)
    group.versions.append(0)
    expected.append(ray.get(trainer.step.remote()))
    assert sync.sync(5, flush=True)["weight_publish_mode"] == "full"
    expected.append(ray.get(trainer.step.remote()))
    assert sync.sync(6, flush=True)["weight_publish_mode"] == "delta"
    assert ray.get(c.loaded.remote()) == expected[-2:]
    assert ray.get(a.loaded.remote()) == expected

    # An engine that missed version 6 refuses version 7's delta, naming both versions.
    expected.append(ray.get(trainer.step.remote()))
    d, _ = engine(3)
    ray.get(d.update_weights.remote(os.path.join(weight_dir, "weight_v000005"), 5, False))
    publication = ray.get(trainer.publish_weights.remote(7, mode="delta", full_interval=3, force_full=False))
    assert publication.mode == "delta"
    with pytest.raises(Exception, match="a delta from version 6 to version 7, but this engine holds version 5"):
        ray.get(d.update_weights.remote(publication.path, 7, False))


def test_auto_mode_measures_both_modes_then_publishes_the_faster_and_every_version_arrives(
    tmp_path, model_dir, ray_session
):
    """--update-weight-mode auto through the driver's WeightSync and real engine actors: full, then a delta, then
    whichever synchronised faster by the costs the syncs before reported (the other tried again after 3 or
    more); each engine holds every version bit for bit, whichever way it came. The choice itself, with
    controlled costs: tests/unit/test_weight_mode_choice.py."""
    ray = ray_session
    from vime.config.weight_sync import WeightSyncConfig
    from vime.weights.mode_choice import AutoModeChoice, PublishMode
    from vime.workers.engines import EngineGroup, WeightSync
    from vime.workers.trainer_group import TrainerGroup

    engine, url = recording_engine(ray, 0, model_dir, tmp_path)
    trainer = ray.remote(num_cpus=0)(FakeTrainer).remote(model_dir, str(tmp_path / "weights"))
    config = WeightSyncConfig(update_weight_mode="auto", update_weight_full_interval=3)
    sync = WeightSync(TrainerGroup([trainer]), EngineGroup([engine], [url], workers=[1]), config)
    reports, expected = [], []
    for version in range(1, 7):
        expected.append(ray.get(trainer.step.remote()))
        reports.append(sync.sync(version, flush=False))
    modes = [r["weight_publish_mode"] for r in reports]
    assert modes[:2] == ["full", "delta"], modes
    # Each mode is what the choice asked for given the costs measured before it (the sync's publication plus
    # the engine's load, as reported), except where the publisher's own rules overrule it: a trainer's first
    # publication is full, and so is the one after update_weight_full_interval - 1 deltas in a row.
    replay = AutoModeChoice(probe_interval=3)
    deltas_in_a_row = 0
    for i, report in enumerate(reports):
        asked = replay.next_mode()
        chain_full = deltas_in_a_row >= config.update_weight_full_interval - 1
        expected_mode = PublishMode.FULL if i == 0 or chain_full else asked
        assert report["weight_publish_mode"] == expected_mode.value, (i, modes, reports)
        deltas_in_a_row = deltas_in_a_row + 1 if expected_mode is PublishMode.DELTA else 0
        replay.record(
            PublishMode(report["weight_publish_mode"]), report["weight_publish_seconds"] + report["weight_load_seconds"]
        )
        assert report["weight_auto_costs"] == replay.describe()
    assert ray.get(engine.loaded.remote()) == expected  # every version, bit for bit, whichever way it came


def test_vime_train_publishes_deltas_that_rebuild_the_final_model(tmp_path, model_dir):
    """The whole driver with --update-weight-mode delta (router only, a rollout plugin)."""
    from vime.weights import disk

    run_dir = str(tmp_path / "run")
    args = [
        sys.executable,
        "-m",
        "vime.cli",
        "train",
        "--hf-checkpoint",
        model_dir,
        "--prompt-data",
        os.path.join(EXAMPLE, "train.jsonl"),
        "--input-key",
        "prompt",
        "--label-key",
        "label",
        "--rollout-function-path",
        os.path.join(REPO, "tests", "plugins", "digit_rollout.py") + ":generate_rollout",
        "--custom-rm-path",
        os.path.join(EXAMPLE, "reward.py") + ":reward",
        "--rollout-num-gpus",
        "0",
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "4",
        "--num-rollout",
        "5",
        "--lr",
        "1e-3",
        "--run-dir",
        run_dir,
        "--rollout-data-transport",
        "object-store",
        "--update-weight-mode",
        "delta",
        "--update-weight-full-interval",
        "3",
        "--keep-weight-versions",
        "1",
    ]
    result = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    syncs = [r for r in records if r["kind"] == "weight_sync"]
    assert [(r["weight_version"], r["weight_publish_mode"]) for r in syncs] == [
        (1, "full"),
        (2, "delta"),
        (3, "delta"),
        (4, "full"),
        (5, "delta"),
    ]
    assert all(
        r["weight_published_bytes"] < r["weight_full_bytes"] for r in syncs if r["weight_publish_mode"] == "delta"
    )
    steps = [r for r in records if r["kind"] == "train"]
    assert [r["weight_sync_publish_s"] for r in steps] == [r["weight_publish_seconds"] for r in syncs]
    assert all(0 < r["weight_sync_publish_s"] <= r["weight_sync_seconds"] for r in steps)
    assert all(r["weight_sync_pause_s"] == 0.0 for r in steps)  # no engine here to pause
    weight_dir = os.path.join(run_dir, "weights")
    assert disk.published_versions(weight_dir) == [4, 5]  # 5 needs 4; 1-3 pruned
    disk.reconstruct(weight_dir, 5, str(tmp_path / "v5"))
    final = os.path.join(run_dir, "hf_final", "model.safetensors")
    assert open(os.path.join(tmp_path, "v5", "model.safetensors"), "rb").read() == open(final, "rb").read()
