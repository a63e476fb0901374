"""Read-only view of a queue's journal, for inspection and tests of a stopped (or live) run.

Opening a Coordinator would recover the queue (a new epoch, every lease fenced); this only reads
the journal's committed transactions and never writes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from straw import RecordSetRef
from straw.backend import FilesystemBackend
from straw.journal import Journal
from straw.protocol import decode

from vime.queue.tasks import AcceptedGroup


@dataclasses.dataclass
class JournalView:
    events: list[dict[str, Any]]

    @classmethod
    def read(cls, data_dir: str) -> JournalView:
        backend = FilesystemBackend(data_dir)
        with backend.open_committed("run.json") as stream:
            identity = decode(stream.read())
        journal = Journal(backend, identity, recover=True, read_only=True)
        try:
            return cls([event for transaction in journal.transactions for event in transaction])
        finally:
            journal.close()

    def of_type(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("type") == kind]

    def accepted(self) -> list[AcceptedGroup]:
        groups = {}
        for event in self.of_type("Completed"):
            receipt = event["receipt"]
            groups[receipt["position"]] = AcceptedGroup(
                receipt["position"], event["lease"]["task_id"], RecordSetRef.from_dict(receipt["result_ref"])
            )
        return [groups[p] for p in sorted(groups)]

    def consumer_cursor(self) -> int:
        states = self.of_type("ConsumerState")
        return states[-1]["response"]["processed_cursor"] if states else 0
