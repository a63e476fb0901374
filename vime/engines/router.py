"""vllm-router as a managed child process, and a client for its worker registry.

Measured with vllm-router 0.1.17:
- With zero workers ``GET /readiness`` answers 503 ``{"status": "not_ready", "reason": "no healthy
  workers available"}``; ``GET /liveness`` answers 200 as soon as the router serves HTTP, so it is
  the start-up probe. ``/health`` answers 200 with zero workers but 503 once any worker is unhealthy.
- ``GET /list_workers`` -> ``{"urls": [...]}``; ``GET /workers`` adds per-worker health and load.
- ``POST /add_worker?url=U`` blocks until U answers ``/health``; it checks every
  ``--worker-startup-check-interval`` seconds (default 30!) up to ``--worker-startup-timeout-secs``,
  then answers 400 "Timeout ... waiting for worker". Adding a URL twice answers 400 "... already
  exists". ``POST /remove_worker?url=U`` answers 200 even for an unknown URL.
- It always serves Prometheus metrics on a second port (``--prometheus-port``, default 29000, cannot
  be disabled); two routers on one machine collide there unless each gets its own port.
- Only generation paths are routed by policy; any other path reaches ONE worker, so pauses and weight
  updates must go to each engine directly (see vime.engines.vllm_server.EngineClient).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

import requests

from vime.engines.http import EngineError, call, call_json
from vime.runtime.ports import PortInUseError, free_port, port_is_free
from vime.runtime.process import ManagedProcess

_LOG_TAIL_LINES = 30


class RouterError(EngineError):
    """A call to the router failed, or the router did not start; the message names the router."""

    role = "router"


def router_binary() -> str:
    """The vllm-router launcher of this interpreter's environment, else the one on PATH.

    The venv's bin/ is preferred because it is often not on PATH (``.venv/bin/python -m pytest``).
    """
    beside = Path(sys.executable).with_name("vllm-router")
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("vllm-router")
    if found is None:
        raise FileNotFoundError("vllm-router is not installed (pip install vllm-router)")
    return found


def build_router_command(host: str, port: int, router_args: Mapping[str, Any] | None = None) -> list[str]:
    """argv for vllm-router. ``router_args`` maps flag names without ``--`` to a value, to None for a
    bare switch, or to a list for a repeated flag: {"policy": "round_robin", "decode": [url1, url2]}
    gives ``--policy round_robin --decode url1 --decode url2``."""
    argv = [router_binary(), "--host", host, "--port", str(port)]
    for key, value in (router_args or {}).items():
        if key.startswith("-"):
            raise ValueError(f"router flag names are given without dashes, got {key!r}")
        if key in ("host", "port"):
            raise ValueError(f"router flag --{key} is set by vime and cannot be forwarded")
        if isinstance(value, (list, tuple)):
            for item in value:
                argv += [f"--{key}", str(item)]
            continue
        argv.append(f"--{key}")
        if value is not None:
            argv.append(str(value))
    return argv


class RouterProcess:
    """A vllm-router started by vime, with no workers; engines are registered with RouterClient."""

    def __init__(
        self,
        port: int,
        *,
        log_path: str | os.PathLike[str],
        run_token: str,
        host: str = "127.0.0.1",
        router_args: Mapping[str, str | None] | None = None,
    ):
        self.host = host
        self.port = port
        self.url = f"http://{host}:{port}"
        router_args = dict(router_args or {})
        # vllm-router always serves Prometheus metrics, on 29000 unless told otherwise (it cannot be
        # turned off): a second router on the machine would die with "Address already in use".
        router_args.setdefault("prometheus-port", str(free_port(host)))
        self.metrics_port = int(router_args["prometheus-port"])  # type: ignore[arg-type]
        self.process = ManagedProcess(
            build_router_command(host, port, router_args),
            log_path=log_path,
            run_token=run_token,
            name=f"vllm-router:{port}",
        )

    def __repr__(self) -> str:
        return f"RouterProcess({self.url}, pid={self.process.pid})"

    @property
    def log_path(self) -> Path:
        return self.process.log_path

    def start(self) -> RouterProcess:
        # Checked first: the router would otherwise exit with a bind error only visible in its log.
        if not port_is_free(self.host, self.port):
            raise PortInUseError(self.host, self.port, "vllm-router")
        self.process.start()
        return self

    def wait_ready(self, timeout: float = 30.0, poll_interval: float = 0.2) -> None:
        """Block until the router serves HTTP (``/liveness`` 200; ``/readiness`` would stay 503 while
        it has no workers). Fails fast if the process exits; on failure the process is stopped."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.process.alive():
                self._fail(f"process exited with status {self.process.returncode} before serving")
            try:
                if requests.get(self.url + "/liveness", timeout=2.0).status_code == 200:
                    return
            except requests.RequestException:
                pass  # not listening yet
            if time.monotonic() >= deadline:
                self._fail(f"not serving after {timeout:g}s")
            time.sleep(poll_interval)

    def _fail(self, reason: str) -> NoReturn:
        self.process.stop(timeout=5)
        raise RouterError(
            self.url, f"{reason}; log {self.log_path}, last lines:\n{self.process.log_tail(_LOG_TAIL_LINES)}"
        )

    def stop(self, timeout: float = 10.0) -> int | None:
        return self.process.stop(timeout)

    def restart(self, timeout: float = 60.0, port_wait: float = 15.0) -> None:
        """Start the router again at the same address, with the same flags (its metrics port too),
        after its process exited. Clients keep their URL. What the dead process left (its process
        group, if any) is stopped first; the port is waited for, as the dead listener's socket may
        linger a moment. The new router has no workers: the caller registers them again."""
        self.process.stop(timeout=5)
        deadline = time.monotonic() + port_wait
        while not port_is_free(self.host, self.port):
            if time.monotonic() >= deadline:
                raise PortInUseError(self.host, self.port, "vllm-router (restarting it at its address)")
            time.sleep(0.2)
        previous = self.process
        self.process = ManagedProcess(
            previous.argv, log_path=previous.log_path, run_token=previous.run_token, name=previous.name
        )
        self.process.start()
        self.wait_ready(timeout=timeout)

    def __enter__(self) -> RouterProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def start_router(
    *,
    log_path: str | os.PathLike[str],
    run_token: str,
    router_args: Mapping[str, str | None],
    port: int | None = None,
    host: str = "127.0.0.1",
    timeout: float = 60.0,
    say=lambda message: None,
) -> RouterProcess:
    """Start a vllm-router and wait until it serves. A port vime picks (``port`` None) is free when
    picked, but another process may bind it before the router does: then it tries fresh ones. A
    given port fails at once."""
    attempts = 1 if port else 3
    for attempt in range(1, attempts + 1):
        router = RouterProcess(
            port or free_port(host), host=host, router_args=router_args, log_path=log_path, run_token=run_token
        )
        say(f"starting vllm-router on {host}:{router.port}")
        try:
            router.start()
            router.wait_ready(timeout=timeout)
            return router
        except RouterError as error:
            if attempt == attempts or "Address already in use" not in str(error):
                raise
            say("a port of the router was taken meanwhile; trying other ports")
    raise AssertionError("unreachable")


class RouterClient:
    """The router's worker registry. Every call is bounded and every error names the router."""

    def __init__(self, url: str, timeout: float = 30.0, attempts: int = 3):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.attempts = attempts

    def __repr__(self) -> str:
        return f"RouterClient({self.url})"

    def add_worker(self, engine_url: str, timeout: float | None = None) -> None:
        """Register an engine; returns once the router has it (the router waits for its /health).

        ``timeout`` must exceed the router's --worker-startup-timeout-secs for engines that are not
        healthy yet; register engines after they are healthy to keep this call short. Registering an
        engine that is already registered is not an error: the wanted state holds either way (and a
        retried call whose first attempt got through would otherwise fail).
        """
        try:
            call(
                "POST",
                self.url,
                "/add_worker",
                params={"url": engine_url},
                timeout=timeout or self.timeout,
                attempts=self.attempts,
                error_type=RouterError,
            )
        except RouterError as exc:
            # vllm-router 0.1.17 answers 400 "Worker <url> already exists"; no status code tells it apart.
            if "already exists" not in exc.message:
                raise

    def remove_worker(self, engine_url: str, timeout: float | None = None) -> None:
        """Unregister an engine (also fine for an engine the router does not know)."""
        call(
            "POST",
            self.url,
            "/remove_worker",
            params={"url": engine_url},
            timeout=timeout or self.timeout,
            attempts=self.attempts,
            error_type=RouterError,
        )

    def workers(self) -> list[str]:
        """URLs of the registered engines, healthy or not."""
        body = call_json(
            "GET", self.url, "/list_workers", timeout=self.timeout, attempts=self.attempts, error_type=RouterError
        )
        if not isinstance(body, dict) or not isinstance(body.get("urls"), list):
            raise RouterError(self.url, f"GET /list_workers answered without a 'urls' list: {str(body)[:300]}")
        return [str(u) for u in body["urls"]]

    def ready(self) -> bool:
        """True when the router has at least one healthy worker (``/readiness`` 200)."""
        try:
            return requests.get(self.url + "/readiness", timeout=min(self.timeout, 5.0)).status_code == 200
        except requests.RequestException:
            return False
