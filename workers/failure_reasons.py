"""Why an engine call failed, in words: the root cause of a Ray-wrapped error, shortened for the
progress line, and whether the actor behind a failed call still lives; and, for the run's last word, which
actor died for good and why (:func:`died_for_good`)."""

from __future__ import annotations

import re

from vime.engines.http import EngineError


def actor_alive(actor) -> bool:
    """Whether a Ray actor still lives (a dead one answers nothing, ever)."""
    import ray

    try:
        ray.get(actor.__ray_ready__.remote(), timeout=10)
        return True
    except Exception:  # noqa: BLE001 - dead, or unreachable: treated alike
        return False


# Words that say nothing on the progress line (the full reason is in the [vime] line and metrics.jsonl).
_NOT_ON_THE_LINE = ("failed its health checks: ", "a call failed: ", "generation probe: ", "POST /inference/v1/")


def progress_reason(reason: str, limit: int = 110) -> str:
    """A reason shortened to fit the progress line: 'generate answered 403; the server refuses ...'."""
    reason = re.sub(r"\bengine https?://\S+: ", "", " ".join(reason.split()))  # the engine is named already
    for words in _NOT_ON_THE_LINE:
        reason = reason.replace(words, "")
    return reason if len(reason) <= limit else reason[: limit - 3] + "..."


def error_reason(error: BaseException) -> str:
    """The original error of a Ray-wrapped one, in one line."""
    cause = error
    while isinstance(getattr(cause, "cause", None), BaseException) and cause.cause is not cause:
        cause = cause.cause
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[-1] if text else ''}" if not isinstance(cause, EngineError) else str(cause)


def died_for_good(error: BaseException) -> str | None:
    """For a Ray actor that died and was not restarted again (its restarts spent, or none allowed): which one and
    why, in one line (``"Controller (vime-controller): its worker process has died"``); None for any other error,
    and for an actor whose start failed (that error is its own)."""
    import ray

    if not isinstance(error, ray.exceptions.ActorDiedError) or error.actor_init_failed:
        return None
    text = str(error)
    found = re.search(r"^\s*class_name: (\S+)", text, re.M)
    name = re.search(r"^\s*name: (\S+)", text, re.M)
    why = re.search(r"The actor is dead because (.+?)\.", text)
    who = (found.group(1) if found else "an actor") + (f" ({name.group(1)})" if name else "")
    return f"{who}: {why.group(1) if why else text.strip().splitlines()[0]}"
