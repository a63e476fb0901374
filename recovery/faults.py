"""Fault injection: SIGKILL a real process at a named point (or fail a call there), for the fault-injection tests.

Enabled only through the environment (inherited by every process of a run, Ray actors included):

    VIME_FAULTS="rollout.after_publish@3,controller.mid_commit"   # fire at the 3rd / 1st hit
    VIME_FAULT_STATE=/some/dir                                    # one-shot markers live here

    VIME_FAULT_DELAYS="trainer.mid_step=3"                        # sleep 3 s at every hit
    VIME_FAULT_DELAYS_OFF=/some/file                              # ... until this file exists

    VIME_FAULT_HOLDS="driver.before_step=2"                       # hold from the 2nd position on
    VIME_FAULT_RELEASE=/some/file                                 # ... until this file exists

    VIME_FAULT_ERRORS="straw.before_file_sync@3"                  # raise EIO at the 3rd hit instead

A point fires once per run: it leaves ``<VIME_FAULT_STATE>/<name>.fired`` (``.failed`` for an error) behind,
so a restarted process does not kill itself (or fail) again. ``scope`` says what dies: the calling process, or its whole
process group (the "whole job" when the driver leads the group, as the tests arrange).
Delays make one component artificially slow (a slow trainer, a slow producer) without killing it; a test
that needs the slowness only for a while creates the VIME_FAULT_DELAYS_OFF file when it is over.
A hold keeps a run open until the event a test waits for has happened (a node's worker generating, say),
instead of hoping that the run lasts long enough: the component asks :func:`held` at a position (the
driver: before each training step) and waits, still doing its other duties, while the answer is True;
the test creates the VIME_FAULT_RELEASE file once the event has happened, and may delete it again to hold
the run at the next position for a later event (a hold stops training, and so generation once the
staleness bound is reached: events that need generation happen between holds).
A process can also hold itself at a point of its own (:func:`hold_point`, where the position counts its
hits; e.g. a rollout worker in the middle of writing its third pack, :class:`StrawWriteFaults`): it writes
``<VIME_FAULT_STATE>/<name>.held`` (its pid) when it starts to wait, so that a test can kill it right there.
An error stands for a call the file system could not complete (``OSError`` EIO, what a JuiceFS client answers
when its metadata server went away meanwhile): at a straw point (:class:`StrawWriteFaults`) straw raises it as
its own ``StorageUnavailable`` and handles the write as it would a real one.
Without VIME_FAULTS / VIME_FAULT_DELAYS / VIME_FAULT_HOLDS / VIME_FAULT_ERRORS every call is a dictionary lookup
and nothing else.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections import Counter

_hits: Counter[str] = Counter()
_error_hits: Counter[str] = Counter()


def _spec(variable: str, separator: str, value_type: type, default: str) -> dict:
    """``name<separator>value,...`` from the environment variable (a value left out is ``default``)."""
    spec = {}
    for item in filter(None, (part.strip() for part in os.environ.get(variable, "").split(","))):
        name, _, value = item.partition(separator)
        spec[name] = value_type(value or default)
    return spec


def _armed() -> dict[str, int]:
    return _spec("VIME_FAULTS", "@", int, "1")


def _delays() -> dict[str, float]:
    return _spec("VIME_FAULT_DELAYS", "=", float, "0")


def _holds() -> dict[str, int]:
    return _spec("VIME_FAULT_HOLDS", "=", int, "1")


def _errors() -> dict[str, int]:
    return _spec("VIME_FAULT_ERRORS", "@", int, "1")


def held(name: str, position: int) -> bool:
    """Whether a test holds ``name`` at ``position`` (VIME_FAULT_HOLDS: from that position on), until the
    VIME_FAULT_RELEASE file exists."""
    start = _holds().get(name)
    if start is None or position < start:
        return False
    return not os.path.exists(os.environ.get("VIME_FAULT_RELEASE", ""))


def hold_point(name: str, position: int, *, poll_seconds: float = 0.05) -> None:
    """Wait here while a test holds ``name`` at ``position`` (:func:`held`), saying so in
    ``<VIME_FAULT_STATE>/<name>.held`` (this process's pid) once the wait begins."""
    if not held(name, position):
        return
    state = os.environ.get("VIME_FAULT_STATE")
    if state:
        with open(os.path.join(state, f"{name}.held"), "w") as f:
            f.write(str(os.getpid()))
    while held(name, position):
        time.sleep(poll_seconds)


class StrawWriteFaults:
    """straw's fault hook for one store handle (StoreOptions.open's ``fault``): each phase of its writes
    (``before_publication_open``, ``after_payload_chunk``, ``before_footer``, ``before_file_sync``, ...) is the
    point ``straw.<phase>``, where the phase's hold position is the number of the handle's publication it is
    in. E.g. VIME_FAULT_HOLDS="straw.after_payload_chunk=3" holds the third publication's write with part of
    its payload in the pack, before its footer and before any fsync: a pack that is not completely written.
    A rollout worker's handle has these points; the controller's (its queue's journal and its own
    publications) has them under ``controller.straw.<phase>`` (:data:`CONTROLLER_STRAW`)."""

    def __init__(self, prefix: str = "straw") -> None:
        self.prefix = prefix
        self.publications = 0

    def __call__(self, phase: str) -> None:
        if phase == "before_publication_open":
            self.publications += 1
        name = f"{self.prefix}.{phase}"
        hold_point(name, self.publications)
        fault_point(name)

    @classmethod
    def if_enabled(cls, prefix: str = "straw") -> StrawWriteFaults | None:
        """A hook when a test set a point under ``prefix`` (straw calls it at every phase otherwise for nothing)."""
        points = (name for spec in (_armed(), _delays(), _holds(), _errors()) for name in spec)
        return cls(prefix) if any(name.startswith(f"{prefix}.") for name in points) else None


# The controller's straw points' prefix (a rollout worker's are "straw.").
CONTROLLER_STRAW = "controller.straw"


def fault_point(name: str, *, scope: str = "process") -> None:
    """Sleep here if ``name`` has a delay; raise EIO if an error is set for this hit, SIGKILL if it is armed and
    this is its n-th hit (each once per run)."""
    delay = _delays().get(name)
    if delay and not os.path.exists(os.environ.get("VIME_FAULT_DELAYS_OFF", "")):
        time.sleep(delay)
    failing = _errors()
    if name in failing:
        _error_hits[name] += 1
        if _error_hits[name] == failing[name] and _first_in_the_run(name, "failed"):
            raise OSError(errno.EIO, f"Input/output error (VIME_FAULT_ERRORS at {name})")
    armed = _armed()
    if name not in armed:
        return
    _hits[name] += 1
    if _hits[name] < armed[name] or not _first_in_the_run(name, "fired"):
        return
    if scope == "group":
        os.killpg(os.getpgid(0), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _first_in_the_run(name: str, outcome: str) -> bool:
    """Whether no process of the run did ``outcome`` at ``name`` yet; says it did now (``<name>.<outcome>`` in
    VIME_FAULT_STATE, with this process's pid). Without VIME_FAULT_STATE: always (once per process then)."""
    state = os.environ.get("VIME_FAULT_STATE")
    if not state:
        return True
    marker = os.path.join(state, f"{name}.{outcome}")
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.write(fd, str(os.getpid()).encode())
    os.fsync(fd)
    os.close(fd)
    return True
