"""How a group's payload travels from a rollout worker to the trainer.

``StrawTransport`` writes the group's records durably to the shared queue storage and hands back
a small ``RecordSetRef``; ``ObjectStoreTransport`` puts the samples in Ray's object store (fast,
not durable). Workers and the trainer each hold their own transport: a straw store handle must
not cross processes, and allows one write at a time (callers serialise writes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from straw import RecordSetRef

from vime.queue.records import decode_group, encode_group
from vime.queue.rollout_queue import StoreOptions
from vime.sample import Sample


class GroupTransport(Protocol):
    def publish(self, samples: list[Sample], *, task_id: str, attempt_id: str, submission_id: str) -> Any: ...
    def read(self, ref: Any) -> list[Sample]: ...
    def discard(self, ref: Any) -> None: ...
    def close(self) -> None: ...


class StrawTransport:
    def __init__(self, options: StoreOptions, fault: Callable[[str], None] | None = None):
        self.store = options.open(fault)

    def publish(self, samples: list[Sample], *, task_id: str, attempt_id: str, submission_id: str) -> RecordSetRef:
        owner = {"task_id": task_id, "attempt_id": attempt_id}
        return self.store.publish(encode_group(samples, submission_id, owner), submission_id=submission_id)

    def read(self, ref: RecordSetRef) -> list[Sample]:
        return decode_group(list(self.store.read(ref)))

    def discard(self, ref: RecordSetRef) -> None:
        """Give up a publication no queue entry adopted (its pack becomes reclaimable)."""
        self.store.release_publications([ref])

    @property
    def writer_id(self) -> str:
        return self.store.writer_id

    def close(self) -> None:
        self.store.close()


class ObjectRefBox:
    """Wraps an ObjectRef so that Ray passes it along by reference instead of resolving it."""

    def __init__(self, ref):
        self.ref = ref


class ObjectStoreTransport:
    def publish(self, samples: list[Sample], *, task_id: str, attempt_id: str, submission_id: str) -> ObjectRefBox:
        import ray

        return ObjectRefBox(ray.put(samples))

    def read(self, ref: ObjectRefBox) -> list[Sample]:
        import ray

        return ray.get(ref.ref, timeout=120)

    def discard(self, ref: ObjectRefBox) -> None:
        pass  # the object store frees it when the last reference goes

    def close(self) -> None:
        pass


def make_transport(kind: str, store: StoreOptions, fault: Callable[[str], None] | None = None) -> GroupTransport:
    """``fault``: straw's hook at each phase of its writes (fault tests; see StoreOptions.open)."""
    if kind == "straw":
        return StrawTransport(store, fault)
    if kind == "object-store":
        return ObjectStoreTransport()
    raise ValueError(f"unknown transport {kind!r}")
