"""--ref-load for the torch trainer: a Megatron checkpoint read as the HF folder it converts to.

The seeds give ``--ref-load`` as a Megatron checkpoint (the actor starts from it when ``--load`` holds none, and
it is the KL reference). The Megatron backend reads one as it is; the torch backend loads HF folders, so at
start-up the driver converts the checkpoint's latest step with ``vime tools convert-megatron-to-hf`` (a process
of its own: megatron-core sets up its parallel state in the process that reads a torch_dist checkpoint) into
``<run dir>/ref_load_hf/``, with ``--hf-checkpoint``'s config and tokenizer, and the trainer reads that. A
later run (a resume) whose checkpoint step and --hf-checkpoint are the same reuses the folder: its
``vime_converted_from.json`` names what it was made of. The folder is written under a temporary name and
renamed, so a conversion cut short is never taken for a whole one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable

from vime.config.base import ConfigError

FOLDER = "ref_load_hf"
SOURCE_FILE = "vime_converted_from.json"
TIMEOUT_S = 6 * 3600  # a large checkpoint on a slow disk; the conversion prints nothing meanwhile


def needs_conversion(ref_load: str | None) -> bool:
    """Whether ``ref_load`` is a local Megatron checkpoint rather than an HF folder (or nothing)."""
    return bool(ref_load) and "://" not in ref_load and not os.path.isfile(os.path.join(ref_load, "config.json"))


def hf_folder(ref_load: str, hf_checkpoint: str, run_dir: str, say: Callable[[str], None]) -> str:
    """The HF folder of the Megatron checkpoint ``ref_load`` (its latest step), converted once under ``run_dir``."""
    from vime.backends.megatron_checkpoint import MegatronCheckpointError, resolve_step_folder

    try:
        step_folder = resolve_step_folder(ref_load, None)
    except MegatronCheckpointError as error:
        raise ConfigError("--ref-load", str(error)) from None
    source = {
        "ref_load": os.path.realpath(ref_load),
        "step": os.path.basename(os.path.realpath(step_folder)),
        "hf_checkpoint": os.path.realpath(hf_checkpoint),
    }
    target = os.path.join(run_dir, FOLDER)
    if _made_of(target) == source:
        say(f"--ref-load {ref_load}: the torch trainer reads its HF conversion in {target}")
        return target
    say(f"--ref-load {ref_load} is a Megatron checkpoint: converting {source['step']} to HF for the torch trainer")
    staging = f"{target}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(run_dir, exist_ok=True)
    command = [sys.executable, "-m", "vime.cli", "tools", "convert-megatron-to-hf"]
    command += ["--load", ref_load, "--save", staging, "--hf-config", hf_checkpoint]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        shutil.rmtree(staging, ignore_errors=True)
        raise ConfigError("--ref-load", f"converting {ref_load} to HF took more than {TIMEOUT_S}s") from None
    if result.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        lines = (result.stderr or result.stdout).strip().splitlines()
        raise ConfigError(
            "--ref-load",
            f"{ref_load} could not be converted to HF with --hf-checkpoint {hf_checkpoint}'s config: "
            + (lines[-1] if lines else f"exit status {result.returncode}"),
        )
    with open(os.path.join(staging, SOURCE_FILE), "w") as f:
        json.dump(source, f)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(staging, target)
    say(f"--ref-load {ref_load}: converted to {target}")
    return target


def _made_of(folder: str) -> dict | None:
    try:
        with open(os.path.join(folder, SOURCE_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
