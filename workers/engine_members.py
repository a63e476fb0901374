"""One record per engine of a run, and what every engine vime starts has in common.

:class:`Member` is the manager's record of one engine (workers/engine_manager.py): where it runs, its
:class:`EngineState`, its version, its restarts, the call in progress and, when quarantined, its next
probe. :class:`EngineTemplate` and :class:`EngineVariant` build the :class:`~vime.workers.engines.EngineSpec`
of each engine vime starts. :class:`NodeEvent` is what the manager tells the driver about nodes;
:func:`role_refusal` says which prefill/decode/encoder engines may serve behind which router.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import time
from typing import Any

from vime.errors import MemberDied
from vime.workers.engines import EngineSpec

# A quarantined engine is probed after this many seconds, then after twice as long each time, up to the maximum.
QUARANTINE_FIRST_PROBE_SECONDS = 1.0
QUARANTINE_MAX_PROBE_SECONDS = 60.0
# A joining engine gets this long on top of --engine-startup-timeout: scheduling the actor, loading weights.
JOIN_SLACK_SECONDS = 120.0


class EngineState(str, enum.Enum):
    """Where one engine of the run stands (a str, so that `vime engines list --json` shows the name)."""

    STARTING = "starting"  # its process starts / it is checked, loads the current version, is probed
    SERVING = "serving"  # registered with the router, gets every weight update
    SYNCING = "syncing"  # nccl: started, waits for the next broadcast before it is registered
    RESTARTING = "restarting"  # vime's own, died or failed its probes: a new process is on its way
    QUARANTINED = "quarantined"  # external, failed its probes: out of the router, probed with back-off
    DRAINING = "draining"  # `vime engines remove`: unregistered, its requests are being aborted
    REMOVED = "removed"  # removed on request
    LOST = "lost"  # dropped for good (its node left, budget used up, a refused attach)

    def __str__(self) -> str:
        return self.value


class EnginesLost(MemberDied, RuntimeError):
    """Every engine of the run is gone and none is starting: generation cannot go on."""


@dataclasses.dataclass(frozen=True)
class EngineVariant:
    """What one engine of a server group changes from the template (``--vllm-config`` overrides)."""

    vllm_args: dict
    tensor_parallel_size: int
    worker_type: str = "regular"


@dataclasses.dataclass(kw_only=True)
class EngineTemplate:
    """What every engine vime starts has in common (the per-engine spec adds index, host, log)."""

    model: str
    vllm_args: dict
    tensor_parallel_size: int
    run_token: str
    log_dir: str
    startup_timeout: float
    http_timeout: float
    weight_dir: str
    weight_transport: str = "disk"
    weights_local_dir: str | None = None
    """--update-weight-local-checkpoint-dir: engine N keeps its own full copy in <dir>/<prefix>engine_N
    (default: <weight dir>/.engine_N)."""
    weight_buffer_bytes: int = 0  # --update-weight-buffer-size: the NCCL broadcast's buckets
    sleep_mode: bool = False  # --offload-rollout: engines sleep while the trainer trains
    name_prefix: str = ""
    """Prepended to engine names and log files: the model's name when a run serves several
    (``--vllm-config``), so that ``ref-engine-0.log`` and ``engine-0.log`` do not collide."""

    def spec(
        self,
        index: int,
        *,
        host: str = "127.0.0.1",
        external_url: str | None = None,
        startup_timeout: float | None = None,
        variant: EngineVariant | None = None,
    ) -> EngineSpec:
        vllm_args = variant.vllm_args if variant else self.vllm_args
        worker_type = variant.worker_type if variant else "regular"
        return EngineSpec(
            index=index,
            model=self.model,
            vllm_args=dict(vllm_args),
            worker_type=worker_type,
            keep_port=worker_type != "regular",
            tensor_parallel_size=variant.tensor_parallel_size if variant else self.tensor_parallel_size,
            run_token=self.run_token,
            log_path=os.path.join(self.log_dir, f"{self.name_prefix}engine-{index}.log"),
            startup_timeout=startup_timeout or self.startup_timeout,
            http_timeout=self.http_timeout,
            host=host,
            external_url=external_url,
            sleep_mode=self.sleep_mode,
            weights_local_dir=(
                os.path.join(self.weights_local_dir, f"{self.name_prefix}engine_{index}")
                if self.weights_local_dir
                else None
            ),
            weight_buffer_bytes=self.weight_buffer_bytes,
        )


@dataclasses.dataclass
class Member:
    index: int
    origin: str  # start | node | external (--rollout-external-engine-addrs) | added (vime engines add)
    actor: Any
    spec: EngineSpec
    node_id: str | None = None  # where its actor runs
    url: str | None = None
    gpus: int = 1
    worker_type: str = "regular"
    state: EngineState = EngineState.STARTING
    version: int = 0
    restarts: int = 0
    pending: Any = None  # ObjectRef of the join / restart / catch-up / drain in progress
    pending_what: str = ""
    pending_since: float = 0.0
    deadline: float = 0.0
    request: str | None = None  # the `vime engines` request waiting for this member
    since: float = dataclasses.field(default_factory=time.monotonic)
    last_error: str = ""
    prefix: str = ""  # EngineTemplate.name_prefix
    next_probe: float = 0.0  # quarantined: when the next probe is due
    probe_backoff: float = QUARANTINE_FIRST_PROBE_SECONDS

    @property
    def name(self) -> str:
        return f"{self.prefix}engine-{self.index}"

    @property
    def owned(self) -> bool:
        return self.spec.external_url is None

    def describe(self, health: dict) -> dict:
        """Its row of `vime engines list` (``health``: the health monitor's status of its URL)."""
        return {
            "name": self.name,
            "url": self.url or self.spec.external_url,
            "origin": self.origin,
            "owned": self.owned,
            "node_id": self.node_id,
            "state": self.state.value,
            "weight_version": self.version,
            "restarts": self.restarts,
            "gpus": self.gpus,
            "worker_type": self.worker_type,
            "healthy": health.get("healthy"),
            "failed_checks": health.get("failures", 0),
            "seconds_since_ok": health.get("seconds_since_ok"),
            "last_error": self.last_error,
        }


def role_refusal(m: Member, *, static_roles: bool, external_router: bool, router: Any) -> str | None:
    """Why an engine that is not a regular one cannot serve this run (None: it can). ``static_roles``:
    vime started this model's prefill/decode/encoder engines itself; ``external_router``: the PD router
    is the user's own (--vllm-router-ip), which must list the engine already."""
    if m.worker_type == "regular" or (static_roles and m.owned):
        return None
    if m.worker_type in ("prefill", "decode") and external_router:
        if m.url in router.workers():
            return None
        return (
            f"{m.url} is a {m.worker_type} engine but the router at {router.url} does not list it; "
            "register it with your PD router first"
        )
    return (
        f"{m.url} is a {m.worker_type} engine; vime attaches regular engines, and prefill/decode engines "
        "only behind your own PD router (--vllm-router-ip)"
    )


@dataclasses.dataclass(frozen=True)
class NodeEvent:
    kind: str  # ready: a new node's first engine serves (start its rollout worker) | lost
    node_id: str
    host: str | None = None
