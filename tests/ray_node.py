"""A Ray worker node on an address of its own, for tests that need a second "host" on this machine (tests/juicefs.py
starts it inside a mount namespace of its own):

    python tests/ray_node.py GCS_ADDRESS NODE_IP RESOURCES_JSON

What `ray start --address GCS_ADDRESS --node-ip-address NODE_IP --resources RESOURCES_JSON --block` does, but for
one thing: `ray start` replaces a loopback GCS address (127.0.0.1) by this machine's outward address, where a
test's head (bound to 127.0.0.1) does not listen, so a node on 127.0.0.2 could not join it. This starts the node
as ray.cluster_utils.Cluster.add_node does, with the address as given, and lives as long as the node: its
raylet and the node's other processes are this process's children.
"""

from __future__ import annotations

import json
import sys
import time


def main(gcs_address: str, node_ip: str, resources: str) -> None:
    from ray._private.node import Node
    from ray._private.parameter import RayParams

    params = RayParams(
        gcs_address=gcs_address,
        node_ip_address=node_ip,
        num_cpus=1,
        num_gpus=0,
        resources=json.loads(resources),
        object_store_memory=100 * 1024**2,
        include_log_monitor=False,
        node_manager_port=0,
        min_worker_port=0,
        max_worker_port=0,
    )
    params.dashboard_agent_listen_port = None
    Node(params, head=False, shutdown_at_exit=False, spawn_reaper=False)
    print(f"ray node on {node_ip} joined {gcs_address}", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main(*sys.argv[1:])
