"""A vllm-router that dies is started again at its address, with its engines registered again.

Every model vime serves has its own vllm-router (the trained model's, and each frozen model's of
``--vllm-config``). The rollout workers and custom code only know the router's URL, and the engines'
health checks go to the engines directly, so the router is the one process whose death stops all
generation while everything else is healthy. The driver polls a :class:`RouterSupervisor` with its
engine polls (between steps and while it waits for groups). When the router's process has exited,
it is started again on the same host and ports with the same flags, up to
``--rollout-router-restart-budget`` times per router, and the engines that serve are registered with
it again (a PD router lists its engines on its command line, so the same command line is enough).

Requests in flight when the router died failed with no answer: an engine fault, so their groups went
back to the queue without spending an attempt (workers/rollout_worker.py) and are resumed through
the new router. A router vime did not start (``--vllm-router-ip``) is not supervised: its owner
runs it.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable

from vime.engines.router import RouterClient, RouterError, RouterProcess
from vime.workers.engine_members import EnginesLost


class RouterState(enum.Enum):
    SERVING = "serving"
    GIVEN_UP = "given up"  # died with its restart budget spent: the run stops


class RouterLost(EnginesLost):
    """The router died and may not be restarted: no sample can be generated any more."""


class RouterSupervisor:
    """Watches one router vime started; :meth:`poll` restarts it when its process has exited.

    ``engine_urls`` gives the URLs to register with a restarted router (the model's serving regular
    engines; nothing for a PD router, whose command line lists its engines). ``say`` and ``record``
    are the run's progress output and ``metrics.jsonl``."""

    def __init__(
        self,
        router: RouterProcess,
        client: RouterClient,
        *,
        model: str,
        budget: int,
        engine_urls: Callable[[], list[str]],
        say: Callable[[str], None],
        record: Callable[[dict], None],
        start_timeout: float = 60.0,
    ):
        self.router = router
        self.client = client
        self.model = model
        self.budget = budget
        self.engine_urls = engine_urls
        self.say = say
        self.record = record
        self.start_timeout = start_timeout
        self.state = RouterState.SERVING
        self.restarts = 0

    def poll(self) -> None:
        """Restart the router if it exited (blocks while it starts, seconds); raises RouterLost when
        its budget is spent or it cannot be started again."""
        if self.router.process.alive():
            return
        status = self.router.process.returncode
        cause = f"the vllm-router of model {self.model!r} at {self.router.url} exited (status {status})"
        if self.restarts >= self.budget:
            self.state = RouterState.GIVEN_UP
            raise RouterLost(
                f"{cause}, and --rollout-router-restart-budget ({self.budget}) is spent; its log: "
                f"{self.router.log_path}"
            )
        self.restarts += 1
        started = time.monotonic()
        try:
            self.router.restart(timeout=self.start_timeout)
            registered = self._register_engines()
        except RouterError as error:
            self.state = RouterState.GIVEN_UP
            raise RouterLost(f"{cause}, and starting it again failed: {error}") from None
        seconds = time.monotonic() - started
        self.say(
            f"{cause}; started it again at the same address in {seconds:.1f}s (restart {self.restarts}/"
            f"{self.budget}), {registered} engine(s) registered again"
        )
        self.record(
            {
                "kind": "router_restart",
                "model": self.model,
                "url": self.router.url,
                "exit_status": status,
                "restart": self.restarts,
                "budget": self.budget,
                "engines_registered": registered,
                "seconds": round(seconds, 3),
            }
        )

    def _register_engines(self) -> int:
        urls = self.engine_urls()
        for url in urls:
            self.client.add_worker(url)
        return len(urls)
