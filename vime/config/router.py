"""``--router-*``: vllm-router flags, forwarded with the prefix removed.

Checked at start-up against the installed ``vllm-router --help`` so that a typo (a flag, or a
policy name) fails before any process starts. vime owns the router's address and its worker list.

Policies (``--router-policy``): vime's default is ``round_robin`` (even load; vllm-router's own
default ``cache_aware`` sent every request of a small run to one engine). For multi-turn sessions
choose ``consistent_hash``: vime sends every request of a sample with ``x-session-id: <session_id>``
(vime.rollout.generate), the first key that policy hashes, so all turns of a session reach one engine.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import os
import re
import subprocess

from vime.config.base import ConfigError
from vime.engines.router import router_binary
from vime.runtime.user_cache import user_cache_path, write_cached

DERIVED = {"host": "--vllm-router-ip", "port": "--vllm-router-port", "worker-urls": "(engines are registered by vime)"}
# Defaults that suit RL traffic and tests; any of them can be overridden with --router-<flag>.
DEFAULTS = {
    "policy": "round_robin",
    "health-check-interval-secs": "5",
    "health-failure-threshold": "3",
    "worker-startup-timeout-secs": "300",
    "worker-startup-check-interval": "1",
    "request-timeout-secs": "600",
    "log-level": "warning",
}
POLICY_FLAGS = ("policy", "prefill-policy", "decode-policy")
# Policies that keep a session on one engine by the x-session-id header vime sends.
SESSION_AFFINITY_POLICIES = ("consistent_hash",)


def add_help(parser: argparse.ArgumentParser) -> None:
    parser.add_argument_group(
        "vllm-router (--router-*)",
        "Any vllm-router flag with the prefix --router-, e.g. --router-policy consistent_hash (session "
        "affinity: every request of a sample carries its session id as x-session-id), "
        "--router-balance-abs-threshold 0. vime's defaults: "
        + ", ".join(f"--router-{k} {v}" for k, v in DEFAULTS.items())
        + ".",
    )


@functools.lru_cache(maxsize=1)
def router_help() -> str:
    """The installed ``vllm-router --help``, kept in the user's cache directory per binary (its path, size and
    modification time): running it costs ~0.7 CPU-seconds at every start; reinstalling the router rewrites the
    binary and so asks again."""
    try:
        binary = router_binary()
    except FileNotFoundError:
        return ""
    stat = os.stat(binary)
    key = hashlib.sha256(f"{os.path.realpath(binary)}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = user_cache_path(f"router-help-{key}.txt")
    with contextlib.suppress(OSError):
        with open(cached) as f:
            return f.read()
    text = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30).stdout
    if "--" in text:  # a help text, not an empty or broken answer
        write_cached(cached, text)
    return text


def router_flags() -> frozenset[str]:
    return frozenset(re.findall(r"(?<![\w-])--([a-z0-9][a-z0-9-]*)", router_help()))


def flag_choices(flag: str) -> tuple[str, ...]:
    """The values ``vllm-router --help`` lists for ``--flag {a,b,...}`` (empty when unknown)."""
    match = re.search(rf"(?<![\w-])--{re.escape(flag)} \{{([^}}]+)\}}", router_help())
    return tuple(match[1].split(",")) if match else ()


def resolve_router_args(forwarded: dict[str, str | None]) -> dict[str, str | None]:
    for key in forwarded:
        if key in DERIVED:
            raise ConfigError(f"--router-{key}", f"is set by vime; use {DERIVED[key]}")
    known = router_flags()
    if known:
        for key in forwarded:
            if key not in known:
                raise ConfigError(f"--router-{key}", f"vllm-router has no flag --{key}")
    resolved = {**DEFAULTS, **forwarded}
    for key in POLICY_FLAGS:
        choices = flag_choices(key)
        if key in resolved and choices and resolved[key] not in choices:
            raise ConfigError(
                f"--router-{key}", f"unknown policy {resolved[key]!r}; vllm-router has {', '.join(choices)}"
            )
    return resolved
