"""The run's engine registry: a named Ray actor through which ``vime engines`` reaches a live run.

The driver creates it (name :data:`REGISTRY_NAME`, in the run's Ray namespace) and writes the Ray
address and namespace into ``RUN_DIR/run.json``. ``vime engines add/remove`` attaches to that Ray
cluster, *submits* a request and waits for its outcome; the driver *takes* pending requests
between its own steps (the engine manager's request desk, workers/engine_requests.py), carries them
out and *finishes* them. ``vime engines list`` reads the snapshot the driver publishes (engines,
versions, health). The registry holds no engine handle and makes no call itself: it cannot block the
run. What a request may ask is an :class:`EngineOp`.

On crash: it dies with the driver (its lifetime is the driver's); a request in flight then fails
on the command's side with "the run ended".
"""

from __future__ import annotations

import enum
import time
import uuid
from typing import Any

REGISTRY_NAME = "vime-engines"


class EngineOp(str, enum.Enum):
    """What a `vime engines` request asks for (a str: requests cross Ray as plain dicts)."""

    ADD = "add"
    REMOVE = "remove"


OPERATIONS = tuple(op.value for op in EngineOp)


class EngineRegistry:
    def __init__(self) -> None:
        self.requests: dict[str, dict[str, Any]] = {}
        self.snapshot: dict[str, Any] = {"engines": [], "weight_version": 0, "updated": None}

    # ------------------------------------------------------------------ the command's side
    def submit(self, op: str, target: str) -> str:
        if op not in OPERATIONS:
            raise ValueError(f"unknown engine operation {op!r}; expected one of {', '.join(OPERATIONS)}")
        request_id = f"{op}-{uuid.uuid4().hex[:8]}"
        self.requests[request_id] = {
            "id": request_id,
            "op": op,
            "target": target,
            "state": "pending",
            "message": "",
            "submitted": time.time(),
            "finished": None,
        }
        return request_id

    def request(self, request_id: str) -> dict[str, Any] | None:
        return dict(self.requests[request_id]) if request_id in self.requests else None

    def engines(self) -> dict[str, Any]:
        return self.snapshot

    # ------------------------------------------------------------------ the driver's side
    def take(self) -> list[dict[str, Any]]:
        """Pending requests, oldest first; each is marked running."""
        pending = sorted((r for r in self.requests.values() if r["state"] == "pending"), key=lambda r: r["submitted"])
        for request in pending:
            request["state"] = "running"
        return [dict(r) for r in pending]

    def finish(self, request_id: str, ok: bool, message: str, result: dict[str, Any] | None = None) -> None:
        request = self.requests.get(request_id)
        if request is not None:
            request.update(state="done" if ok else "failed", message=message, finished=time.time(), result=result or {})

    def publish(self, snapshot: dict[str, Any]) -> None:
        self.snapshot = dict(snapshot, updated=time.time())
