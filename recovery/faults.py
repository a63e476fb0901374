"""Fault injection: SIGKILL a real process at a named point, for the fault-injection tests.

Enabled only through the environment (inherited by every process of a run, Ray actors included):

    VIME_FAULTS="rollout.after_publish@3,controller.mid_commit"   # fire at the 3rd / 1st hit
    VIME_FAULT_STATE=/some/dir                                    # one-shot markers live here

    VIME_FAULT_DELAYS="trainer.mid_step=3"                        # sleep 3 s at every hit
    VIME_FAULT_DELAYS_OFF=/some/file                              # ... until this file exists

A point fires once per run: it leaves ``<VIME_FAULT_STATE>/<name>.fired`` behind, so a restarted
process does not kill itself again. ``scope`` says what dies: the calling process, or its whole
process group (the "whole job" when the driver leads the group, as the tests arrange).
Delays make one component artificially slow (a slow trainer, a slow producer) without killing it; a test
that needs the slowness only for a while creates the VIME_FAULT_DELAYS_OFF file when it is over.
Without VIME_FAULTS / VIME_FAULT_DELAYS every call is a dictionary lookup and nothing else.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter

_hits: Counter[str] = Counter()


def _armed() -> dict[str, int]:
    spec = os.environ.get("VIME_FAULTS", "")
    armed = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, nth = item.partition("@")
        armed[name] = int(nth or 1)
    return armed


def _delays() -> dict[str, float]:
    spec = os.environ.get("VIME_FAULT_DELAYS", "")
    delays = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, seconds = item.partition("=")
        delays[name] = float(seconds)
    return delays


def fault_point(name: str, *, scope: str = "process") -> None:
    """Sleep here if ``name`` has a delay; SIGKILL if it is armed and this is its n-th hit (once per run)."""
    delay = _delays().get(name)
    if delay and not os.path.exists(os.environ.get("VIME_FAULT_DELAYS_OFF", "")):
        time.sleep(delay)
    armed = _armed()
    if name not in armed:
        return
    _hits[name] += 1
    if _hits[name] < armed[name]:
        return
    state = os.environ.get("VIME_FAULT_STATE")
    if state:
        marker = os.path.join(state, f"{name}.fired")
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.write(fd, str(os.getpid()).encode())
        os.fsync(fd)
        os.close(fd)
    if scope == "group":
        os.killpg(os.getpgid(0), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
