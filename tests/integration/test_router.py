"""The real vllm-router binary: start with no workers, register/unregister workers, route, stop.

The workers here are stand-in HTTP servers, not vLLM engines: this file tests the router (its
process, readiness and worker registry), and a real engine would only add ~25 s per start. This is
the only place where a stand-in engine is allowed; everything about engines runs real vLLM in
tests/e2e.
"""

from __future__ import annotations

import json
import socket
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
import pytest
import requests

from vime.engines.router import RouterClient, RouterError, RouterProcess, build_router_command
from vime.runtime.ports import PortInUseError, free_port
from vime.runtime.process import RUN_TOKEN_ENV, kill_processes_with_token

pytestmark = pytest.mark.integration

# Fast health checking and worker start-up polling, so that the tests take seconds.
ROUTER_ARGS = {
    "policy": "round_robin",
    "health-check-interval-secs": "1",
    "health-failure-threshold": "2",
    "worker-startup-timeout-secs": "3",
    "worker-startup-check-interval": "1",
    "log-level": "info",
}


class StandInWorker:
    """An HTTP server that answers /health and echoes /inference/v1/generate with its own name."""

    def __init__(self, name: str):
        self.name = name
        self.generate_calls = 0
        worker = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._reply(200, {"ok": True} if self.path == "/health" else {"path": self.path})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if self.path == "/inference/v1/generate":
                    worker.generate_calls += 1
                    self._reply(200, {"worker": worker.name, "token_ids": body.get("token_ids")})
                else:
                    self._reply(404, {"error": self.path})

            def _reply(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def token() -> Iterator[str]:
    t = f"test-router-{uuid.uuid4()}"
    yield t
    kill_processes_with_token(t)


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory, token: str) -> Iterator[RouterProcess]:
    log = tmp_path_factory.mktemp("router") / "router.log"
    proc = RouterProcess(free_port(), log_path=log, run_token=token, router_args=ROUTER_ARGS).start()
    try:
        proc.wait_ready(timeout=30)
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def workers() -> Iterator[list[StandInWorker]]:
    started = [StandInWorker("a"), StandInWorker("b")]
    yield started
    for w in started:
        w.close()


def _generate_via(router: RouterProcess, token_ids: list[int]) -> dict:
    response = requests.post(
        router.url + "/inference/v1/generate",
        json={"token_ids": token_ids, "sampling_params": {"max_tokens": 1}},
        timeout=10,
    )
    response.raise_for_status()
    return response.json()


def test_build_router_command_forwards_flags():
    argv = build_router_command("127.0.0.1", 1234, {"policy": "round_robin", "disable-retries": None})
    assert argv[0].endswith("vllm-router")
    assert argv[1:] == ["--host", "127.0.0.1", "--port", "1234", "--policy", "round_robin", "--disable-retries"]
    with pytest.raises(ValueError, match="--port"):
        build_router_command("127.0.0.1", 1, {"port": "2"})


def test_router_with_no_workers_is_live_but_not_ready(router: RouterProcess):
    client = RouterClient(router.url, timeout=10)
    assert client.workers() == []
    assert not client.ready()
    assert requests.get(router.url + "/readiness", timeout=5).status_code == 503


def test_second_router_on_same_port_names_the_port(router: RouterProcess, tmp_path: Path, token: str):
    second = RouterProcess(router.port, log_path=tmp_path / "second.log", run_token=token)
    with pytest.raises(PortInUseError, match=f"port {router.port}"):
        second.start()
    assert second.process.pid is None  # refused before anything started


def test_port_held_by_another_program_is_refused(tmp_path: Path, token: str):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with pytest.raises(PortInUseError, match=str(port)):
            RouterProcess(port, log_path=tmp_path / "r.log", run_token=token).start()


def test_add_route_remove_workers(router: RouterProcess, workers: list[StandInWorker]):
    client = RouterClient(router.url, timeout=15)
    a, b = workers
    client.add_worker(a.url)
    assert client.workers() == [a.url]
    assert client.ready()
    assert _generate_via(router, [1, 2, 3]) == {"worker": "a", "token_ids": [1, 2, 3]}

    client.add_worker(b.url)
    client.add_worker(b.url)  # already registered: not an error
    assert sorted(client.workers()) == sorted([a.url, b.url])
    seen = {_generate_via(router, [i])["worker"] for i in range(6)}
    assert seen == {"a", "b"}  # round robin reaches both

    client.remove_worker(a.url)
    assert client.workers() == [b.url]
    calls_a = a.generate_calls
    assert {_generate_via(router, [i])["worker"] for i in range(4)} == {"b"}
    assert a.generate_calls == calls_a

    client.remove_worker(b.url)
    client.remove_worker(b.url)  # unknown worker: not an error
    assert client.workers() == []
    assert not client.ready()


def test_add_unreachable_worker_fails_naming_router(router: RouterProcess):
    client = RouterClient(router.url, timeout=20)
    dead_url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RouterError) as info:
        client.add_worker(dead_url)
    message = str(info.value)
    assert message.startswith(f"router {router.url}: POST /add_worker")
    assert "HTTP 400" in message and dead_url in message
    assert dead_url not in client.workers()


def test_unreachable_router_error_names_router():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RouterError, match=f"router {url}: GET /list_workers could not connect after 2"):
        RouterClient(url, timeout=2, attempts=2).workers()


def test_router_that_exits_fails_fast_with_log_tail(tmp_path: Path, token: str):
    bad = RouterProcess(
        free_port(), log_path=tmp_path / "bad.log", run_token=token, router_args={"policy": "no-such-policy"}
    )
    bad.start()
    with pytest.raises(RouterError) as info:
        bad.wait_ready(timeout=60)
    message = str(info.value)
    assert "exited with status" in message
    assert "no-such-policy" in message  # the launcher's own complaint, from the log tail
    assert str(bad.log_path) in message
    assert not bad.process.alive()


def test_stop_leaves_no_process(tmp_path: Path):
    own_token = f"test-router-stop-{uuid.uuid4()}"
    proc = RouterProcess(
        free_port(), log_path=tmp_path / "stop.log", run_token=own_token, router_args=ROUTER_ARGS
    ).start()
    proc.wait_ready(timeout=30)
    pid = proc.process.pid
    assert psutil.Process(pid).environ()[RUN_TOKEN_ENV] == own_token
    proc.stop()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert kill_processes_with_token(own_token) == []  # nothing left for the sweep
    with pytest.raises(requests.ConnectionError):
        requests.get(proc.url + "/liveness", timeout=2)


def test_consistent_hash_keeps_each_session_on_one_worker(tmp_path: Path, token: str, workers: list[StandInWorker]):
    """The contract vime's session affinity relies on: with --policy consistent_hash the router
    picks the worker from the x-session-id header (vime.rollout.generate.SESSION_HEADER), not from
    the body, so every turn of a session (a longer body each time) reaches the same worker."""
    from vime.rollout.generate import SESSION_HEADER, session_headers

    args = {**ROUTER_ARGS, "policy": "consistent_hash"}
    with RouterProcess(free_port(), log_path=tmp_path / "ch.log", run_token=token, router_args=args).start() as proc:
        proc.wait_ready(timeout=30)
        client = RouterClient(proc.url, timeout=15)
        for worker in workers:
            client.add_worker(worker.url)
        placement: dict[str, set[str]] = {}
        for session in range(16):
            tokens: list[int] = []
            for turn in range(3):
                tokens += [session, turn]
                reply = requests.post(
                    proc.url + "/inference/v1/generate",
                    headers=session_headers(f"g{session}-0"),
                    json={"token_ids": tokens, "sampling_params": {"max_tokens": 1}},
                    timeout=10,
                )
                reply.raise_for_status()
                placement.setdefault(f"g{session}-0", set()).add(reply.json()["worker"])
        assert all(len(seen) == 1 for seen in placement.values()), placement
        assert {w for seen in placement.values() for w in seen} == {"a", "b"}  # sessions spread over both
        assert SESSION_HEADER == "x-session-id"
