"""A Ray instance of the test's own on this machine (loopback, no dashboard, quiet), for the integration tests that
drive Ray actors directly rather than through `vime train`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def local_ray(*, namespace: str | None = None, runtime_env: dict | None = None, num_cpus: int = 1) -> Iterator[None]:
    """``ray.init`` of a new local instance for the block, shut down after it whatever happened."""
    import ray

    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        configure_logging=False,
        log_to_driver=False,
        namespace=namespace,
        runtime_env=runtime_env,
    )
    try:
        yield
    finally:
        ray.shutdown()
