"""The engine manager's membership rules with real Ray actors and real weight folders, vLLM replaced
by a recorder (the real engines are in tests/e2e/test_elastic.py): engines join at the current
version, a failed engine is restarted at the current version within its budget and then dropped,
external engines are never restarted, `vime engines add/remove` requests, the run stops with a
reason once no engine is left, and with the nccl transport a restarted or new engine waits for the
next broadcast, for which the weight group is re-formed (NCCL itself needs GPUs: the broadcast is
recorded here; tests/gpu/check_nccl_weights.py runs the real one)."""

from __future__ import annotations

import os
import shutil
import sys

import pytest

from vime.config.elastic import ElasticConfig
from vime.engines.http import EngineError
from vime.weights import disk
from vime.workers.engine_manager import EngineManager
from vime.workers.engine_members import EnginesLost, EngineTemplate
from vime.workers.engine_registry import EngineRegistry
from vime.workers.engines import EngineActor

pytestmark = pytest.mark.integration


class Recorder:
    """What vLLM would be told; ``broken`` makes every call fail as a dead engine's would."""

    def __init__(self, url: str):
        self.url, self.label, self.loaded, self.broken = url, "default", [], False
        self.black_hole, self.probes = False, []

    def _call(self):
        if self.broken:
            raise EngineError(self.url, "connection refused")

    def health(self):
        return not self.broken

    def pause(self, mode="keep"):
        self._call()

    def resume(self):
        self._call()

    def reset_prefix_cache(self):
        self._call()

    def reload_weights(self, path):
        self._call()
        self.loaded.append(path)

    def update_weight_version(self, version):
        self._call()
        self.label = str(version)

    def probe(self, expect_version=None):
        """The generation probe: fails as the engine does (``broken``) or while ``black_hole`` (a server
        whose /health is fine but whose generate route fails)."""
        self._call()
        if self.black_hole:
            raise EngineError(self.url, "generation probe: POST /inference/v1/generate answered 403")
        self.probes.append(expect_version)

    def weight_version(self):
        self._call()
        return self.label

    def abort_requests(self):
        self._call()
        return 3


class RecordingEngine(EngineActor):
    """The real engine actor (joins, catch-up, local weight copies, restarts) without a process."""

    def _start_server(self):
        if os.path.exists(os.path.join(os.path.dirname(self.spec.log_path), "no-start")):
            raise EngineError(f"http://engine-{self.spec.index}", "process exited before becoming healthy")
        self.client = Recorder(f"http://engine-{self.spec.index}.r{self.restarts}:1")
        self.version = 0

    def join(self, weight_dir, version):
        if self.client is None and not self.owned:  # an external engine: no /server_info to read
            self.client, self.version = Recorder(self.spec.external_url), -1
        return super().join(weight_dir, version)

    @property
    def url(self):
        return self.client.url if self.client else self.spec.external_url

    def break_(self, broken=True):
        self.client.broken = broken

    def black_hole(self, on=True):
        self.client.black_hole = on

    def labels(self):
        return self.client.label, len(self.client.loaded)


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


class NcclRecordingEngine(RecordingEngine):
    """Records the NCCL group calls; a broadcast "received" is labelled like a real one."""

    def __init__(self, spec):
        super().__init__(spec)
        self.group_calls = []

    def nccl_join(self, address, port, rank_offset, world_size):
        self.group_calls.append(("join", rank_offset, world_size))

    def nccl_leave(self):
        self.group_calls.append(("leave",))

    def receive_nccl(self, metadata, version, flush):
        self.client._call()
        self.client.update_weight_version(version)
        self.version = version
        return {"load_seconds": 0.0, "pause_seconds": 0.0}

    def calls(self):
        return self.group_calls


class RecordingTrainer:
    def __init__(self):
        self.calls = []

    def nccl_endpoint(self):
        return "127.0.0.1", 1

    def nccl_open(self, address, port, world_size):
        self.calls.append(("open", world_size))
        return "metadata"

    def nccl_close(self):
        self.calls.append(("close",))

    def nccl_send(self):
        self.calls.append(("send",))
        return {"bytes": 1.0, "seconds": 0.0}

    def history(self):
        return self.calls


def publish(root: str, model: str, version: int) -> str:
    return disk.publish_full(root, version, lambda folder: shutil.copytree(model, folder))


def make_manager(tmp_path, model: str, budget: int, lines: list[str]) -> EngineManager:
    template = EngineTemplate(
        model=model,
        vllm_args={},
        tensor_parallel_size=1,
        run_token="t",
        log_dir=str(tmp_path),
        startup_timeout=30,
        http_timeout=5,
        weight_dir=str(tmp_path / "weights"),
    )
    config = ElasticConfig(
        rollout_health_check_first_wait=3600, rollout_engine_restart_budget=budget, rollout_elastic_resource=""
    )
    return EngineManager(
        template=template,
        config=config,
        router=None,
        say=lines.append,
        register_with_router=False,
        actor_class=RecordingEngine,
    )


def settle(manager: EngineManager, version: int, timeout: float = 120.0):
    """Poll until every member has settled; the deadline fits new Ray actors on a loaded machine."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        manager.poll(version)
        if all(m.state in ("serving", "lost", "removed") for m in manager.members):
            return
        if time.monotonic() > deadline:
            raise AssertionError([(m.name, m.state) for m in manager.members])
        time.sleep(0.05)


def wait_for(manager: EngineManager, version: int, condition, timeout: float = 120.0):
    import time

    deadline = time.monotonic() + timeout
    while True:
        manager.poll(version)
        if condition():
            return
        if time.monotonic() > deadline:
            raise AssertionError([(m.name, m.state, m.last_error) for m in manager.members])
        time.sleep(0.05)


def test_failed_engines_restart_at_the_current_version_then_the_run_stops_with_a_reason(tmp_path, ray_session):
    ray = ray_session
    from vime.tools.make_tiny_model import make_tiny_model

    model = make_tiny_model(str(tmp_path / "model"))
    root = str(tmp_path / "weights")
    lines: list[str] = []
    manager = make_manager(tmp_path, model, budget=1, lines=lines)
    manager.start_owned(2)
    group = manager.group
    assert len(group) == 2 and group.versions == [0, 0]

    group.update_weights(publish(root, model, 1), 1, flush=True)
    settle(manager, 1)
    first, second = manager.members
    ray.get(first.actor.break_.remote())
    group.update_weights(publish(root, model, 2), 2, flush=True)  # engine-0 fails: out, restarted
    assert group.urls == [second.url] and first.state == "restarting"
    settle(manager, 2)
    assert first.state == "serving" and first.restarts == 1 and first.url.endswith(".r1:1")
    assert sorted(group.versions) == [2, 2]
    assert ray.get(first.actor.labels.remote())[0] == "2"  # restarted at the current version

    ray.get(first.actor.break_.remote())
    group.update_weights(publish(root, model, 3), 3, flush=True)
    settle(manager, 3)
    assert first.state == "lost" and "restart budget used up (1/1" in first.last_error
    assert group.urls == [second.url]

    (tmp_path / "no-start").write_text("")  # from now on a restart fails to start its process
    ray.get(second.actor.break_.remote())
    group.update_weights(publish(root, model, 4), 4, flush=True)
    with pytest.raises(EnginesLost, match="every rollout engine is gone") as lost:
        settle(manager, 4)
    assert second.state == "lost" and "restart failed" in second.last_error and second.restarts == 1
    assert "engine-0 (start)" in str(lost.value) and "engine-1 (start)" in str(lost.value)
    manager.stop()


def test_engines_added_and_removed_by_request_join_at_the_current_version(tmp_path, ray_session):
    ray = ray_session
    from vime.tools.make_tiny_model import make_tiny_model

    model = make_tiny_model(str(tmp_path / "model"))
    root = str(tmp_path / "weights")
    lines: list[str] = []
    manager = make_manager(tmp_path, model, budget=3, lines=lines)
    registry = manager.request_desk.registry = ray.remote(num_cpus=0)(EngineRegistry).remote()
    manager.start_owned(1)
    for version in (1, 2):
        manager.group.update_weights(publish(root, model, version), version, flush=True)
    add = ray.get(registry.submit.remote("add", "10.0.0.9:8000"))
    again = ray.get(registry.submit.remote("add", "10.0.0.9:8000"))
    manager.request_desk.taken_at = 0.0  # take the requests at the next poll
    settle(manager, 2)
    added = manager.members[1]
    assert (added.origin, added.owned, added.state, added.version) == ("added", False, "serving", 2)
    assert ray.get(registry.request.remote(add))["state"] == "done"
    assert "already engine-1" in ray.get(registry.request.remote(again))["message"]

    # An external engine that fails is quarantined, never restarted: out of the router and of weight
    # updates, probed with back-off; when a probe passes it loads the current version and serves again.
    ray.get(added.actor.break_.remote())
    manager.group.update_weights(publish(root, model, 3), 3, flush=True)
    assert added.state == "quarantined" and manager.group.urls == [manager.members[0].url]
    assert any("quarantined" in line for line in lines) and manager.serving_counts() == (1, 2)
    manager.members[1].next_probe = 0.0
    wait_for(manager, 3, lambda: added.pending is None and added.probe_backoff > 1.0)  # a probe failed: backs off
    assert added.state == "quarantined" and "probe failed" in added.last_error
    ray.get(added.actor.break_.remote(False))
    added.next_probe = 0.0
    wait_for(manager, 3, lambda: added.state == "serving")
    assert added.restarts == 0 and added.version == 3 and ray.get(added.actor.labels.remote())[0] == "3"
    assert manager.take_notes() == ["engine-1 quarantined: connection refused", "engine-1 back from quarantine"]
    # A black hole (/health fine, generation refused) fails the probe that ends every weight update.
    ray.get(added.actor.black_hole.remote())
    manager.group.update_weights(publish(root, model, 4), 4, flush=True)
    assert added.state == "quarantined" and "answered 403" in added.last_error
    quarantined = ray.get(registry.submit.remote("remove", "engine-1"))  # a quarantined one is removed
    manager.request_desk.taken_at = 0.0  # take the requests at the next poll
    settle(manager, 4)
    assert ray.get(registry.request.remote(quarantined))["state"] == "done" and added.state == "removed"

    only = ray.get(registry.submit.remote("remove", "engine-0"))
    manager.request_desk.taken_at = 0.0  # take the requests at the next poll
    settle(manager, 4)
    assert "only serving engine" in ray.get(registry.request.remote(only))["message"]

    add = ray.get(registry.submit.remote("add", "http://10.0.0.7:8000"))
    manager.request_desk.taken_at = 0.0  # take the requests at the next poll
    settle(manager, 4)
    remove = ray.get(registry.submit.remote("remove", "10.0.0.7:8000"))
    manager.request_desk.taken_at = 0.0  # take the requests at the next poll
    settle(manager, 4)
    done = ray.get(registry.request.remote(remove))
    assert (
        done["state"] == "done"
        and "3 request(s) in flight returned to the queue as continuations" in done["message"]
        and "keeps running" in done["message"]
    )
    assert [m.state for m in manager.members] == ["serving", "removed", "removed"]
    assert manager.group.urls == [manager.members[0].url]
    assert os.path.isdir(root)
    manager.stop()


def test_nccl_engines_that_restart_or_join_wait_for_the_next_broadcast_in_a_reformed_group(tmp_path, ray_session):
    ray = ray_session
    from vime.config.weight_sync import WeightSyncConfig
    from vime.tools.make_tiny_model import make_tiny_model
    from vime.workers.engines import WeightSync
    from vime.workers.trainer_group import TrainerGroup

    model = make_tiny_model(str(tmp_path / "model"))
    lines: list[str] = []
    manager = make_manager(tmp_path, model, budget=2, lines=lines)
    manager.template.weight_transport = "nccl"
    manager.actor_class = NcclRecordingEngine
    manager.start_owned(1)
    trainer = ray.remote(num_cpus=0)(RecordingTrainer).remote()
    sync = WeightSync(
        TrainerGroup([trainer]), manager.group, WeightSyncConfig(update_weight_transport="nccl"), timeout=60
    )
    sync.sync(1, flush=True)
    settle(manager, 1)
    first = manager.members[0]
    assert ray.get(trainer.history.remote()) == [("open", 2), ("send",)]
    assert ray.get(first.actor.calls.remote()) == [("join", 1, 2)]

    # engine-0 dies and restarts from --hf-checkpoint (no weights on disk with nccl); a new engine joins.
    ray.get(first.actor.break_.remote())
    manager.group.pause("keep")  # a failed call: out of the group, restarted
    manager.start_owned(1)
    second = manager.members[1]
    import time

    deadline = time.monotonic() + 120  # both start new Ray actors: seconds on a loaded machine
    while time.monotonic() < deadline:
        manager.poll(1)
        if (first.state, second.state) == ("syncing", "syncing"):
            break
        time.sleep(0.05)
    assert (first.state, second.state) == ("syncing", "syncing"), lines
    assert first.version == 0 and second.version == 0 and sorted(manager.group.versions) == [0, 0]

    sync.sync(2, flush=True)  # the group is re-formed with both, then both receive version 2
    settle(manager, 2)
    assert (first.state, second.state) == ("serving", "serving") and sorted(manager.group.versions) == [2, 2]
    assert ray.get(trainer.history.remote()) == [("open", 2), ("send",), ("close",), ("open", 3), ("send",)]
    joins = {ray.get(m.actor.calls.remote())[-1] for m in (first, second)}
    assert joins == {("join", 1, 3), ("join", 2, 3)}  # engine-0's new process joined the new group too
    assert ray.get(first.actor.labels.remote())[0] == "2"

    sync.sync(3, flush=True)  # the same engines: the group is kept
    history = ray.get(trainer.history.remote())
    assert history[-1] == ("send",) and [c for c in history if c[0] == "open"] == [("open", 2), ("open", 3)]
    assert any("receives weight version 2 with the next broadcast" in line for line in lines), lines
    manager.stop()
