"""A rollout worker's finished groups, made durable several at a time (group commit).

straw makes each publication durable with a fixed set of fsyncs and journal writes, whatever its size: on a
JuiceFS volume that fixed part is most of a small group's cost (16 fsyncs through the JuiceFS client, about
15 ms, where a local directory takes 2 ms; docs/juicefs.md). Groups that finish while the worker's writer
thread is busy with a publication wait for it and then go out together, as one publication. A group that
finds the writer idle is published at once, alone: batching adds no wait of its own.

A publication of several groups succeeds or fails as a whole; each group then goes on alone (its own
acceptance by the controller, or its failure handling).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

from vime.queue.transport import GroupToPublish, GroupTransport

# At most this many groups in one publication: bounds the memory of a publication's encoding and the payload a
# failed one gives back to the queue.
MAX_GROUPS_PER_PUBLICATION = 16


class GroupPublisher:
    def __init__(
        self,
        transport: GroupTransport,
        writer: concurrent.futures.Executor,
        max_groups: int = MAX_GROUPS_PER_PUBLICATION,
    ):
        self.transport, self.writer, self.max_groups = transport, writer, max_groups
        self._waiting: list[tuple[GroupToPublish, asyncio.Future]] = []
        self._draining: asyncio.Task | None = None
        self.publications = 0  # straw publications made, each of one or more groups
        self.groups = 0

    async def publish(self, group: GroupToPublish) -> Any:
        """The group's reference once it is durable, with whatever groups were waiting beside it."""
        done = asyncio.get_running_loop().create_future()
        self._waiting.append((group, done))
        if self._draining is None:
            self._draining = asyncio.create_task(self._drain())
        return await done

    async def _drain(self) -> None:
        """Publish what waits, a publication at a time, until nothing does. Runs on the worker's event loop; the
        writes themselves on its writer thread (straw allows one write at a time per handle)."""
        loop = asyncio.get_running_loop()
        try:
            while self._waiting:
                batch, self._waiting = self._waiting[: self.max_groups], self._waiting[self.max_groups :]
                groups = [group for group, _ in batch]
                try:
                    refs = await loop.run_in_executor(self.writer, self.transport.publish_groups, groups)
                except Exception as error:  # noqa: BLE001 - each waiting group raises it, as its own would
                    for _, done in batch:
                        if not done.done():  # its caller may have been cancelled meanwhile
                            done.set_exception(error)
                    continue
                self.publications += 1
                self.groups += len(groups)
                for (_, done), ref in zip(batch, refs, strict=True):
                    if not done.done():
                        done.set_result(ref)
        finally:
            self._draining = None
