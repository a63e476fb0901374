"""``--router-*``: vllm-router flags, forwarded with the prefix removed.

Checked at start-up against the installed ``vllm-router --help`` so that a typo fails before any
process starts. vime owns the router's address and its worker list.
"""

from __future__ import annotations

import argparse
import functools
import re
import subprocess

from vime.config.base import ConfigError
from vime.engines.router import router_binary

DERIVED = {"host": "--vllm-router-ip", "port": "--vllm-router-port",
           "worker-urls": "(engines are registered by vime)"}
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


def add_help(parser: argparse.ArgumentParser) -> None:
    parser.add_argument_group(
        "vllm-router (--router-*)",
        "Any vllm-router flag with the prefix --router-, e.g. --router-policy consistent_hash, "
        "--router-balance-abs-threshold 0. vime's defaults: "
        + ", ".join(f"--router-{k} {v}" for k, v in DEFAULTS.items()) + ".")


@functools.lru_cache(maxsize=1)
def router_flags() -> frozenset[str]:
    try:
        binary = router_binary()
    except FileNotFoundError:
        return frozenset()
    out = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30)
    return frozenset(re.findall(r"(?<![\w-])--([a-z0-9][a-z0-9-]*)", out.stdout))


def resolve_router_args(forwarded: dict[str, str | None]) -> dict[str, str | None]:
    for key in forwarded:
        if key in DERIVED:
            raise ConfigError(f"--router-{key}", f"is set by vime; use {DERIVED[key]}")
    known = router_flags()
    if known:
        for key in forwarded:
            if key not in known:
                raise ConfigError(f"--router-{key}", f"vllm-router has no flag --{key}")
    return {**DEFAULTS, **forwarded}
