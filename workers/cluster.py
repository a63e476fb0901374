"""The Ray cluster a run uses, and where its trainer ranks sit on it.

:func:`start_ray` starts a Ray instance of the run's own (or attaches to ``--ray-address``) with the
environment every process of the run inherits: the run token the teardown's and the reaper's sweeps look
for (vime/runtime/process.py, vime/runtime/reaper.py). :func:`trainer_cpus` and
:func:`trainer_gpus_per_rank` place the trainer beside the engines on one CPU-only node, or leave
placement to the cluster.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

from vime.config.framework import ClusterConfig
from vime.config.training import TrainConfig

# Ray's own message when its node's raylet did not register in time (ray/_private/node.py).
RAY_START_TIMEOUT = "timed out during startup"
RAY_START_ATTEMPTS = 3


def start_ray(
    cluster: ClusterConfig, *, token: str, namespace: str, debug_logs: bool, say: Callable[[str], None]
) -> str:
    """Start (or attach to) Ray for the run whose token is ``token``; returns the cluster's GCS address,
    which `vime engines --run RUN_DIR` attaches to (docs/elastic.md). ``debug_logs``: Ray's workers'
    output reaches the driver (--log-level debug)."""
    import ray

    os.environ["VIME_RUN_TOKEN"] = token  # every process started from now on inherits it
    # Ray's workers retitle themselves ("ray::TrainerWorker.train_rollout") with setproctitle's code,
    # which would otherwise overwrite the memory /proc/PID/environ reads, hiding the token from the sweeps.
    os.environ["SPT_NOENV"] = "1"
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if cluster.ray_address:
        say(f"attaching to the Ray cluster at {cluster.ray_address}")
        ray.init(address=cluster.ray_address, log_to_driver=debug_logs, namespace=namespace)
    else:
        say("starting Ray (in-process)")
        for attempt in range(1, RAY_START_ATTEMPTS + 1):
            try:
                # address="local": always a cluster of our own, never one someone else started here.
                ray.init(
                    address="local",
                    num_cpus=os.cpu_count() or 2,
                    include_dashboard=False,
                    _node_ip_address="127.0.0.1",
                    log_to_driver=debug_logs,
                    configure_logging=False,
                    namespace=namespace,
                )
                break
            except Exception as error:  # Ray raises a bare Exception for this one
                if attempt == RAY_START_ATTEMPTS or RAY_START_TIMEOUT not in str(error):
                    raise
                # Ray gives its raylet a fixed 30 s to register, which a machine loaded by other jobs can exceed.
                # The half-started node is not Ray's to stop (ray.init raised before it kept the node): its
                # processes are this driver's children started from Ray's package, stopped here before the retry.
                ray.shutdown()
                _stop_ray_children(os.path.dirname(ray.__file__))
                say(
                    "Ray's node did not register within Ray's 30 s (a loaded machine?); "
                    f"starting it again ({attempt + 1}/{RAY_START_ATTEMPTS})"
                )
    return ray.get_runtime_context().gcs_address


def _stop_ray_children(ray_package: str, timeout: float = 10.0) -> None:
    import psutil

    children = []
    for child in psutil.Process().children(recursive=True):
        try:
            if any(ray_package in part for part in child.cmdline()):
                children.append(child)
        except psutil.Error:
            continue  # gone already
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()
    psutil.wait_procs(children, timeout=timeout)


def trainer_cpus(cluster: ClusterConfig, train: TrainConfig) -> tuple[int, list[int] | None]:
    """(torch threads, cores) for the trainer on a CPU-only single node.

    vLLM's CPU engine binds its compute threads to the first cores (one per engine by default); the
    trainer gets the cores after them, one thread each. Attached to a Ray cluster, or with
    --train-threads, vime leaves placement alone.
    """
    if train.train_threads or cluster.ray_address:
        return train.train_threads or 1, None
    cores = sorted(os.sched_getaffinity(0))
    spare = cores[cluster.num_engines * cluster.rollout_num_gpus_per_engine :]
    if not spare:
        return 1, None
    # Ranks share the spare cores (each rank's threads compete with the others' otherwise).
    return max(1, len(spare) // cluster.num_trainers), spare


def trainer_gpus_per_rank(cluster: ClusterConfig) -> float:
    """One GPU per rank when several ranks train on GPUs (Ray then shows each its own); a single rank keeps
    today's placement (it uses the node's first GPU, beside the engines). Both backends: the torch backend
    trains on its rank's GPU too (vime.backends.torch_backend.training_device)."""
    import ray

    if cluster.num_trainers == 1:
        return 0
    return 1 if ray.cluster_resources().get("GPU", 0) > 0 else 0
