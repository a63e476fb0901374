"""Health checks of the rollout engines: a daemon thread of the driver.

Every ``--rollout-health-check-interval`` seconds each watched engine's ``GET /health`` must answer
200 within ``--rollout-health-check-timeout`` and, for engines that rollouts reach, a real generate
request must succeed (vime.engines.probe: ``/health`` stays 200 on a server that answers every
generate with 403). Checks start ``--rollout-health-check-first-wait`` seconds after an engine is
watched; after a failed check the next one comes within a second, so that a black hole is found in
about ``interval + failures`` seconds. After ``--rollout-health-check-failures`` consecutive failed
checks the engine is declared dead: ``on_dead(url, reason)`` runs at once in this thread (the driver
unregisters it from the router there, so that no new request reaches it even while the driver is
busy training), and the URL is queued for the driver, which restarts, quarantines or drops the engine
at its next poll (workers/engine_manager.py; the policy is workers/engine_failures.py).

A weight update pauses the engines; a check that overlapped one (:meth:`HealthMonitor.updating`) is
not counted either way.

The thread only observes; it owns no engine and changes no membership. Checks run in parallel,
so one hung engine does not delay the others' verdicts.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator

import requests

from vime.engines.http import EngineError
from vime.engines.probe import probe_generation

logger = logging.getLogger("vime.health")


@dataclasses.dataclass
class _Target:
    next_check: float
    failures: int = 0
    checks: int = 0
    healthy: bool | None = None  # None until the first check
    last_error: str = ""
    last_ok: float | None = None
    dead: bool = False
    probe: bool = True  # also a generation probe (engines rollouts reach)


# After a failed check the next one comes this soon (at most): a broken engine is found in seconds.
RECHECK_SECONDS = 1.0


def check_health(url: str, timeout: float, *, probe: bool = False) -> str | None:
    """None when ``url``/health answers 200 within ``timeout`` seconds (and, with ``probe``, a real
    generate request passes), else why not."""
    try:
        response = requests.get(url.rstrip("/") + "/health", timeout=timeout)
    except requests.Timeout:
        return f"GET /health timed out after {timeout:g}s"
    except requests.RequestException as error:
        return f"GET /health failed: {type(error).__name__}"
    if response.status_code != 200:
        return f"GET /health answered HTTP {response.status_code}"
    if probe:
        try:
            probe_generation(url, timeout=timeout)
        except EngineError as error:
            return error.message
    return None


class HealthMonitor:
    def __init__(
        self, *, interval: float, timeout: float, failures: int, on_dead: Callable[[str, str], None] | None = None
    ):
        self.interval, self.timeout, self.failures = interval, timeout, failures
        self.on_dead = on_dead
        self._targets: dict[str, _Target] = {}
        self._dead: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._updates = 0  # weight updates in progress
        self._update_epoch = 0  # bumped at the start and end of each one
        self._thread: threading.Thread | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="health")

    # ------------------------------------------------------------------ the driver's side
    def watch(self, url: str, first_wait: float = 0.0, *, probe: bool = True) -> None:
        """Check ``url`` from ``first_wait`` seconds on; ``probe``: with a generation probe too."""
        with self._lock:
            self._targets[url] = _Target(next_check=time.monotonic() + first_wait, probe=probe)

    @contextlib.contextmanager
    def updating(self) -> Iterator[None]:
        """A weight update runs (the engines pause): checks that overlap it count neither way."""
        with self._lock:
            self._updates += 1
            self._update_epoch += 1
        try:
            yield
        finally:
            with self._lock:
                self._updates -= 1
                self._update_epoch += 1

    def unwatch(self, url: str) -> None:
        with self._lock:
            self._targets.pop(url, None)

    def take_dead(self) -> list[tuple[str, str]]:
        """(url, reason) of every engine declared dead since the last call."""
        with self._lock:
            dead, self._dead = self._dead, []
        return dead

    def status(self) -> dict[str, dict]:
        with self._lock:
            return {
                url: {
                    "healthy": t.healthy,
                    "failures": t.failures,
                    "checks": t.checks,
                    "last_error": t.last_error,
                    "seconds_since_ok": None if t.last_ok is None else round(time.monotonic() - t.last_ok, 1),
                }
                for url, t in self._targets.items()
            }

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="vime-health", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout + 5)
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ the thread
    def check_once(self) -> None:
        """Check every engine that is due (one round of the thread; also callable directly)."""
        now = time.monotonic()
        with self._lock:
            due = [(url, t.probe) for url, t in self._targets.items() if not t.dead and t.next_check <= now]
            epoch = None if self._updates else self._update_epoch
        futures = {url: self._pool.submit(check_health, url, self.timeout, probe=probe) for url, probe in due}
        for url, future in futures.items():
            try:
                error = future.result(timeout=self.timeout + 5)
            except Exception as exc:  # noqa: BLE001 - a check that cannot even run counts as failed
                error = f"health check failed: {exc}"
            verdict = None
            with self._lock:
                target = self._targets.get(url)
                if target is None:  # unwatched meanwhile
                    continue
                target.checks += 1
                target.next_check = time.monotonic() + self.interval
                if error is None:
                    target.healthy, target.failures, target.last_ok = True, 0, time.monotonic()
                    continue
                target.next_check = time.monotonic() + min(self.interval, RECHECK_SECONDS)  # a failure: look again soon
                if epoch is None or epoch != self._update_epoch or self._updates:
                    continue  # the check overlapped a weight update (a paused engine may time out): not counted
                target.healthy, target.last_error = False, error
                target.failures += 1
                if target.failures >= self.failures:
                    target.dead = True
                    verdict = f"{error} ({target.failures} consecutive failed check(s))"
                    self._dead.append((url, verdict))
            if verdict is not None:
                logger.warning("engine %s declared dead: %s", url, verdict)
                if self.on_dead is not None:
                    try:
                        self.on_dead(url, verdict)
                    except Exception as exc:  # noqa: BLE001 - the driver handles it at its next poll anyway
                        logger.warning("on_dead(%s) failed: %s", url, exc)

    def _loop(self) -> None:
        tick = min(0.5, self.interval)
        while not self._stop.wait(tick):
            try:
                self.check_once()
            except Exception:
                logger.exception("health check round failed")
