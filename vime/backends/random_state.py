"""The random generators' states a trainer checkpoint keeps (both backends), so that a resumed run draws what the
uninterrupted one would have: Python's, NumPy's, torch's CPU generator and, where the process uses CUDA, its
current device's (a rank trains on one GPU)."""

from __future__ import annotations

import random

import numpy as np
import torch


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # a CPU trainer does not start CUDA for this
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict) -> None:
    """Inverse of :func:`rng_state`. A checkpoint of a CPU run leaves the CUDA generators as they are."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
