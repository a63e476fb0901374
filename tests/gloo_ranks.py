"""Start a test's gloo ranks (torch.distributed over CPU processes) without each one importing torch again.

``torch.multiprocessing.spawn`` starts every rank as a new interpreter, which imports torch, transformers and
megatron-core before it runs a line of the test: about 6 of a rank's 7 CPU-seconds on the tests' tiny models,
for some thirty ranks in the suite. :func:`run_ranks` forks them instead from multiprocessing's fork server:
one process per pytest worker that imports those packages once (``set_forkserver_preload``) and then only
forks. It runs no Python thread and no torch operation, so no lock is held when a rank is forked (the one other
thread in it, OpenBLAS's idle pool thread started by numpy's import, has OpenBLAS's own fork handlers). A rank
then imports only what its test module adds. Otherwise the ranks are what spawn gives: new processes, the
function and its arguments pickled to them, an exception in any rank raised here
(``torch.multiprocessing.ProcessRaisedException``).

One difference from spawn: a rank's environment is the fork server's, taken when this pytest worker started its
first rank, not ``os.environ`` at the call. Tests pass what a rank needs as arguments.
"""

from __future__ import annotations

import datetime
import multiprocessing
from collections.abc import Callable

import torch.distributed as dist
import torch.multiprocessing

# What every rank of the suite imports. A module missing here is skipped by the fork server (ImportError), and
# the rank imports it itself, as it would under spawn.
PRELOAD = [
    "torch",
    "torch.distributed",
    "transformers",
    "transformers.models.qwen2.modeling_qwen2",
    "megatron.core",
    "vime.backends.torch_backend",
    "vime.backends.megatron_backend",
]


def run_ranks(function: Callable, args: tuple, nprocs: int) -> None:
    """Run ``function(rank, *args)`` in ``nprocs`` processes and wait for all of them."""
    multiprocessing.set_forkserver_preload(PRELOAD)  # read once, when the fork server starts
    torch.multiprocessing.start_processes(function, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def join_group(
    rank: int,
    port: int,
    world_size: int = 2,
    *,
    megatron_shim: bool = False,
    timeout: datetime.timedelta | None = None,
) -> None:
    """In a rank :func:`run_ranks` started: one torch thread, the Megatron test shim where the rank builds a
    Megatron model on the CPU (``megatron_shim``), and the gloo group on 127.0.0.1:``port``. ``timeout``: how long
    a rank may wait in a collective (gloo's default is half an hour; a test that could leave a rank out sets
    minutes, so that it fails instead of hanging)."""
    torch.set_num_threads(1)
    if megatron_shim:
        from tests import megatron_shim as shim

        shim.install()
    options = {"timeout": timeout} if timeout is not None else {}
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, **options)


def leave_group() -> None:
    """The end of a rank's work: wait for the other ranks (each wrote its results), then leave the gloo group."""
    dist.barrier()
    dist.destroy_process_group()
