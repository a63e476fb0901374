"""How a group's payload travels from a rollout worker to the trainer.

``StrawTransport`` writes the group's records durably to the shared queue storage and hands back
a small ``RecordSetRef``; ``ObjectStoreTransport`` puts the samples in Ray's object store (fast,
not durable). Workers and the trainer each hold their own transport: a straw store handle must
not cross processes, and allows one write at a time (callers serialise writes).

A straw publication that fails once its pack was being made durable (an fsync answering EIO: a JuiceFS client
whose metadata server went away for a while) leaves its outcome unknown, and straw then refuses every other
publication of the handle with ``IndeterminateCommit`` until that one is published again under the same
submission id. The caller has given the failed group up by then (it went back to the queue), so the transport
resolves it itself, before the next publication, and releases it: nothing references it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from straw import Publication, RecordSetRef
from straw.errors import IndeterminateCommit

from vime.queue.records import decode_group, encode_group
from vime.queue.rollout_queue import StoreOptions
from vime.sample import Sample

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GroupToPublish:
    """One group's payload and the attempt it belongs to (``submission_id``: the group's own, queue/gc.py)."""

    samples: list[Sample]
    task_id: str
    attempt_id: str
    submission_id: str


class GroupTransport(Protocol):
    def publish(self, samples: list[Sample], *, task_id: str, attempt_id: str, submission_id: str) -> Any: ...
    def publish_groups(self, groups: Sequence[GroupToPublish]) -> list[Any]: ...
    def read(self, ref: Any) -> list[Sample]: ...
    def reading(self) -> contextlib.AbstractContextManager[Callable[[Any], list[Sample]]]: ...
    def discard(self, ref: Any) -> None: ...
    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class FailedPublication:
    """A publication straw raised on: what to publish again, alike, should straw ask for it."""

    submission_id: str
    groups: list[Publication]


def publication_id(groups: Sequence[GroupToPublish]) -> str:
    """The straw submission id of one publication of ``groups``: the first group's own. A dead writer's
    publications are looked up by the submission ids of the attempts it leased (queue/gc.py), and every
    publication starts with one of them; a group published alone keeps its id, as before batches."""
    return groups[0].submission_id


class StrawTransport:
    def __init__(self, options: StoreOptions, fault: Callable[[str], None] | None = None):
        self.store = options.open(fault)
        self.failed: FailedPublication | None = None  # the last publication that raised, until resolved

    def publish(self, samples: list[Sample], *, task_id: str, attempt_id: str, submission_id: str) -> RecordSetRef:
        return self.publish_groups([GroupToPublish(samples, task_id, attempt_id, submission_id)])[0]

    def publish_groups(self, groups: Sequence[GroupToPublish]) -> list[RecordSetRef]:
        """Several groups in one durable publication (one set of straw's fsyncs), one reference per group in
        their order. They succeed or fail together."""
        encoded = [
            Publication(
                tuple(encode_group(g.samples, g.submission_id, {"task_id": g.task_id, "attempt_id": g.attempt_id}))
            )
            for g in groups
        ]
        submission_id = publication_id(groups)
        unresolved = self.failed
        try:
            return self._publish(encoded, submission_id)
        except IndeterminateCommit:
            if unresolved is None or unresolved.submission_id == submission_id:
                self.failed = FailedPublication(submission_id, encoded)
                raise
        except Exception:
            self.failed = FailedPublication(submission_id, encoded)
            raise
        # straw refused this one for the earlier failure: resolve that first (which raises, the earlier one still
        # pending, while the volume fails), then publish this one.
        self._resolve(unresolved)
        try:
            return self._publish(encoded, submission_id)
        except Exception:
            self.failed = FailedPublication(submission_id, encoded)
            raise

    def _publish(self, groups: list[Publication], submission_id: str) -> list[RecordSetRef]:
        refs = list(self.store.publish_many(groups, submission_id=submission_id))
        self.failed = None  # a publication went through: nothing of this handle is pending any more
        return refs

    def _resolve(self, failed: FailedPublication) -> None:
        """Publish ``failed`` again under its submission id (straw completes or confirms it), then release it:
        its caller gave its groups up when it failed, so no queue entry will ever adopt them."""
        logger.warning("publishing %s again (straw could not confirm it) before the next one", failed.submission_id)
        self.store.release_publications(self._publish(failed.groups, failed.submission_id))

    def read(self, ref: RecordSetRef) -> list[Sample]:
        return decode_group(list(self.store.read(ref)))

    @contextlib.contextmanager
    def reading(self) -> Iterator[Callable[[RecordSetRef], list[Sample]]]:
        """A reader of several groups in one straw read session: the groups of a publication share a pack, whose
        index the session reads once instead of once a group (a trainer's step reads a few packs' groups). Every
        record is still checked as it is read. One thread at a time; the reader is for this block only."""
        with self.store.read_session() as session:
            yield lambda ref: decode_group(list(session.read(ref)))

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

    def publish_groups(self, groups: Sequence[GroupToPublish]) -> list[ObjectRefBox]:
        return [
            self.publish(g.samples, task_id=g.task_id, attempt_id=g.attempt_id, submission_id=g.submission_id)
            for g in groups
        ]

    def read(self, ref: ObjectRefBox) -> list[Sample]:
        import ray

        return ray.get(ref.ref, timeout=120)

    def reading(self) -> contextlib.AbstractContextManager[Callable[[ObjectRefBox], list[Sample]]]:
        return contextlib.nullcontext(self.read)

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
