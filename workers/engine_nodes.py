"""Which Ray nodes came and went since the last look: the decision half of elastic nodes.

:class:`NodeWatch` remembers the nodes a run has handled (given engines, or found already hosting one)
and those it has seen leave; :meth:`NodeWatch.scan` turns one ``ray.nodes()`` listing into the nodes
that left and the nodes that joined with the elastic resource. The engine manager acts on the answer
(drops the lost node's engines, starts engines on a new one); nothing here calls Ray.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable


@dataclasses.dataclass(frozen=True)
class JoinedNode:
    node_id: str
    host: str
    amount: float  # of the elastic resource
    engines: int  # how many engines of the run's size fit the resource (at least one; 0: a worker only)


@dataclasses.dataclass
class NodeWatch:
    resource: str  # --rollout-elastic-resource
    tensor_parallel_size: int
    node_engines: bool = True  # --rollout-elastic-node-engines (off: a joined node gets a rollout worker only)
    handled: set[str] = dataclasses.field(default_factory=set)
    lost: set[str] = dataclasses.field(default_factory=set)

    def scan(self, nodes: list[dict], hosting: Iterable[str | None]) -> tuple[list[str], list[JoinedNode]]:
        """(nodes that left, nodes that joined) in ``nodes`` (one ``ray.nodes()`` listing); ``hosting``
        are the node ids that already run an engine of this run (handled, never given more)."""
        alive = {n["NodeID"] for n in nodes if n.get("Alive")}
        left = sorted(self.handled - alive - self.lost)
        self.lost.update(left)
        hosting = set(hosting)
        joined = []
        for node in nodes:
            amount = (node.get("Resources") or {}).get(self.resource, 0)
            node_id = node["NodeID"]
            if not node.get("Alive") or amount <= 0 or node_id in self.handled:
                continue
            self.handled.add(node_id)
            if node_id in hosting:
                continue  # it already hosts an engine of this run (e.g. one started at launch)
            host = node.get("NodeManagerAddress") or "127.0.0.1"
            engines = max(1, int(amount) // self.tensor_parallel_size) if self.node_engines else 0
            joined.append(JoinedNode(node_id, host, amount, engines))
        return left, joined
