"""`vime train` starts its in-process Ray again when Ray's node timed out registering (Ray allows its raylet a
fixed 30 s, which a machine loaded by other jobs can exceed), and stops what the half-started node left.

Ray's timeout cannot be provoked on demand, so the first ``ray.init`` below raises Ray's own exception for
it (the message ray/_private/node.py raises) in place of the real call; the second attempt is the real Ray.
"""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest

from vime.config.framework import ClusterConfig
from vime.workers import cluster

RAY_TIMEOUT = (
    "The current node timed out during startup. This could happen because some of the raylet failed to startup "
    "or the GCS has become overloaded."
)


def test_a_ray_start_that_timed_out_is_retried_and_the_run_gets_its_cluster(monkeypatch):
    import ray

    real_init, calls, said = ray.init, [], []

    def init(*args, **kwargs):
        calls.append(kwargs)
        if len(calls) == 1:
            raise Exception(RAY_TIMEOUT)
        return real_init(*args, **kwargs)

    monkeypatch.setattr(ray, "init", init)
    try:
        address = cluster.start_ray(
            ClusterConfig(), token="test-ray-retry", namespace="test-ray-retry", debug_logs=False, say=said.append
        )
        assert ray.is_initialized() and address
        assert len(calls) == 2
        assert any("starting it again (2/3)" in line for line in said), said
    finally:
        ray.shutdown()


def test_other_ray_start_errors_are_not_retried(monkeypatch):
    import ray

    calls = []

    def init(*args, **kwargs):
        calls.append(kwargs)
        raise RuntimeError("something else")

    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(RuntimeError, match="something else"):
        cluster.start_ray(ClusterConfig(), token="t", namespace="n", debug_logs=False, say=lambda line: None)
    assert len(calls) == 1


def test_the_half_started_nodes_processes_are_stopped(tmp_path):
    package = str(tmp_path / "site-packages" / "ray")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", package])
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        cluster._stop_ray_children(package)
        assert child.wait(timeout=10) is not None
        assert bystander.poll() is None and psutil.pid_exists(bystander.pid)
    finally:
        for proc in (child, bystander):
            proc.kill()
            proc.wait()
