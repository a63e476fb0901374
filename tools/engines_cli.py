"""``vime engines``: change which engines serve a running job, and look at them.

    vime engines list   --run RUN_DIR [--json]
    vime engines add    --run RUN_DIR HOST:PORT [--timeout S]
    vime engines remove --run RUN_DIR HOST:PORT|engine-N [--timeout S]

The command attaches to the run's Ray cluster (address and namespace from ``RUN_DIR/run.json``)
and talks to the run's engine registry (workers/engine_registry.py); the driver carries requests
out between its steps. ``add`` returns once the engine serves the current weight version and is
registered with the router; ``remove`` once the engine is unregistered and its requests in flight
returned to the queue. Every wait is bounded by ``--timeout``. Exit status: 0 done, 1 refused or
failed (the message says why), 2 usage.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time
from typing import Any

from vime.errors import UserError

DEFAULT_TIMEOUT = 600.0
POLL_SECONDS = 0.5


class EnginesCliError(UserError, RuntimeError):
    pass


def read_run_info(run_dir: str) -> dict[str, Any]:
    """What ``vime train`` wrote about a run that may be live: its pid, Ray address, namespace."""
    path = os.path.join(run_dir, "run.json")
    try:
        with open(path) as f:
            info = json.load(f)
    except FileNotFoundError:
        raise EnginesCliError(f"{path} does not exist: is {run_dir} the --run-dir of a vime train run?") from None
    except json.JSONDecodeError as error:
        raise EnginesCliError(f"{path} is not readable JSON: {error}") from None
    if not info.get("ray_address"):
        raise EnginesCliError(f"the run in {run_dir} has not started Ray yet (or predates `vime engines`)")
    pid = info.get("pid")
    if pid is not None and not _pid_alive(int(pid)):
        raise EnginesCliError(f"the run in {run_dir} is not running (its driver, pid {pid}, has exited)")
    return info


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def attach(run_dir: str) -> str:
    """Attach this process to a live run's Ray cluster (unless it is attached already); returns the
    run's Ray namespace, where its named actors live (also used by ``vime queue retry-failed``)."""
    info = read_run_info(run_dir)
    for key, value in (
        ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0"),
        ("RAY_USAGE_STATS_ENABLED", "0"),
        ("RAY_AUTH_MODE", "disabled"),
    ):
        os.environ.setdefault(key, value)
    import ray

    if not ray.is_initialized():
        with contextlib.redirect_stderr(io.StringIO()):  # Ray's connection banner is noise here
            ray.init(
                address=info["ray_address"],
                namespace=info["ray_namespace"],
                log_to_driver=False,
                configure_logging=False,
            )
    return info["ray_namespace"]


def connect(run_dir: str):
    """Attach to the run's Ray cluster and return its engine registry actor."""
    namespace = attach(run_dir)
    import ray

    from vime.workers.engine_registry import REGISTRY_NAME

    try:
        return ray.get_actor(REGISTRY_NAME, namespace=namespace)
    except ValueError:
        raise EnginesCliError(
            f"the run in {run_dir} has no engine registry yet (still starting its engines?); try again in a moment"
        ) from None


def wait_request(registry, request_id: str, timeout: float) -> dict[str, Any]:
    import ray

    deadline = time.monotonic() + timeout
    while True:
        try:
            request = ray.get(registry.request.remote(request_id), timeout=30)
        except ray.exceptions.RayActorError:
            raise EnginesCliError("the run ended before carrying out the request") from None
        if request["state"] in ("done", "failed"):
            return request
        if time.monotonic() >= deadline:
            state = "is still waiting for the driver" if request["state"] == "pending" else "is still in progress"
            raise EnginesCliError(
                f"no outcome after {timeout:g}s: the request {state} (see `vime engines list` and the run's log)"
            )
        time.sleep(POLL_SECONDS)


def format_table(snapshot: dict[str, Any]) -> str:
    columns = ("name", "url", "origin", "state", "weight_version", "health", "restarts", "node")
    rows = []
    for e in snapshot.get("engines", []):
        health = {True: "ok", False: f"failing ({e.get('failed_checks', 0)})", None: "-"}[e.get("healthy")]
        rows.append(
            (
                e["name"],
                e["url"] or "-",
                e["origin"] + ("" if e["owned"] else ", external"),
                e["state"],
                str(e["weight_version"]),
                health,
                str(e["restarts"]),
                (e.get("node_id") or "-")[:12],
            )
        )
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(columns)]
    lines = ["  ".join(h.upper().ljust(w) for h, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in rows]
    lines.append(f"current weight version: {snapshot.get('weight_version')}")
    errors = [f"{e['name']}: {e['last_error']}" for e in snapshot.get("engines", []) if e.get("last_error")]
    return "\n".join(lines + errors)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vime engines", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    listing = sub.add_parser("list", help="each engine of the run: state, weight version, health")
    listing.add_argument("--run", required=True, metavar="RUN_DIR", help="the run's --run-dir")
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    for name, text in (
        ("add", "attach a running vLLM server (HOST:PORT) to the job"),
        ("remove", "drain and unregister an engine (HOST:PORT or engine-N)"),
    ):
        command = sub.add_parser(name, help=text)
        command.add_argument("--run", required=True, metavar="RUN_DIR", help="the run's --run-dir")
        command.add_argument("engine", metavar="HOST:PORT" if name == "add" else "ENGINE")
        command.add_argument(
            "--timeout",
            type=float,
            default=DEFAULT_TIMEOUT,
            help="seconds to wait for the outcome (default: %(default)s)",
        )
    args = parser.parse_args(argv)
    try:
        import ray

        registry = connect(args.run)
        if args.command == "list":
            snapshot = ray.get(registry.engines.remote(), timeout=30)
            print(json.dumps(snapshot, indent=1) if args.json else format_table(snapshot))
            return 0
        if args.command == "add":
            from vime.engines.external import engine_url

            try:
                engine_url(args.engine)
            except ValueError as error:
                raise EnginesCliError(str(error)) from None
        request_id = ray.get(registry.submit.remote(args.command, args.engine), timeout=30)
        request = wait_request(registry, request_id, args.timeout)
        print(request["message"])
        return 0 if request["state"] == "done" else 1
    except EnginesCliError as error:
        print(f"vime engines {args.command}: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
