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

import multiprocessing
from collections.abc import Callable

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
