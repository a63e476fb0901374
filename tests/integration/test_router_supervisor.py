"""A vllm-router killed with SIGKILL is started again at its address, with its engines registered again
(workers/router_supervisor.py), until --rollout-router-restart-budget is spent.

The real vllm-router binary; its worker is test_router's stand-in HTTP server (the router only needs
an engine's /health to register it and forwards generate requests to it; a real engine would add
~25 s and is covered by the e2e tests)."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.integration.test_router import ROUTER_ARGS, StandInWorker, _generate_via
from vime.engines.router import RouterClient, RouterProcess
from vime.runtime.ports import free_port
from vime.runtime.process import kill_processes_with_token
from vime.workers.router_supervisor import RouterLost, RouterState, RouterSupervisor

pytestmark = pytest.mark.integration


@pytest.fixture
def token() -> Iterator[str]:
    t = f"test-router-supervisor-{uuid.uuid4()}"
    yield t
    kill_processes_with_token(t)


@pytest.fixture
def router(tmp_path: Path, token: str) -> Iterator[RouterProcess]:
    proc = RouterProcess(free_port(), log_path=tmp_path / "router.log", run_token=token, router_args=ROUTER_ARGS)
    proc.start().wait_ready(timeout=30)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def worker() -> Iterator[StandInWorker]:
    started = StandInWorker("a")
    yield started
    started.close()


def _supervisor(router: RouterProcess, worker: StandInWorker, budget: int, said: list, records: list):
    return RouterSupervisor(
        router,
        RouterClient(router.url, timeout=10),
        model="policy",
        budget=budget,
        engine_urls=lambda: [worker.url],
        say=said.append,
        record=records.append,
    )


def _kill(router: RouterProcess) -> int:
    pid = router.process.pid
    os.kill(pid, signal.SIGKILL)
    router.process.wait(timeout=10)
    return pid


def test_a_killed_router_serves_again_at_its_address_with_its_engines(router, worker):
    said, records = [], []
    supervisor = _supervisor(router, worker, budget=2, said=said, records=records)
    RouterClient(router.url).add_worker(worker.url)
    supervisor.poll()  # alive: nothing happens
    assert (said, records) == ([], [])

    url, old_pid = router.url, _kill(router)
    supervisor.poll()

    assert router.url == url and router.process.pid != old_pid and router.process.alive()
    assert requests.get(url + "/liveness", timeout=5).status_code == 200
    assert RouterClient(url).workers() == [worker.url]
    calls = worker.generate_calls
    assert _generate_via(router, [1, 2])["worker"] == "a" and worker.generate_calls == calls + 1
    assert supervisor.state is RouterState.SERVING
    [record] = records
    assert record["kind"] == "router_restart" and record["exit_status"] == -signal.SIGKILL
    assert (record["model"], record["restart"], record["engines_registered"]) == ("policy", 1, 1)
    assert "started it again at the same address" in said[0] and url in said[0]


def test_a_router_that_dies_past_its_budget_stops_the_run_naming_the_flag(router, worker):
    said, records = [], []
    supervisor = _supervisor(router, worker, budget=1, said=said, records=records)
    _kill(router)
    supervisor.poll()
    _kill(router)
    with pytest.raises(RouterLost) as lost:
        supervisor.poll()
    assert "--rollout-router-restart-budget (1) is spent" in str(lost.value)
    assert str(router.log_path) in str(lost.value)
    assert supervisor.state is RouterState.GIVEN_UP and len(records) == 1


def test_budget_zero_never_restarts(router, worker):
    supervisor = _supervisor(router, worker, budget=0, said=[], records=[])
    _kill(router)
    with pytest.raises(RouterLost, match="budget"):
        supervisor.poll()
    assert not router.process.alive()
