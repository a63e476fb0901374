"""Run the EPD-judge example end to end on CPU and check from the run's files that EPD happened.

1. builds the tiny digit-shift actor (``vime.tools.make_tiny_model``) and the tiny BLIP-2 judge
   (``make_tiny_blip2.py``) into ``RUN_DIR/models``;
2. writes ``RUN_DIR/vllm_config.yaml`` from ``vllm_config.yaml`` with absolute paths, both judge groups
   sharing one encoder cache ``RUN_DIR/ec_cache`` (``overrides.ec_transfer_config``);
3. runs ``python -m vime.cli train`` (a few rollouts) with ``VLLM_LOGGING_LEVEL=DEBUG`` (vime has no
   per-group environment, so every engine logs at DEBUG), output in ``RUN_DIR/train.log``;
4. checks: exit status 0; the judge's encoder engine log has ``Save cache successful for mm_hash H``
   and the judge's language engine log has ``Success load encoder cache for hash H`` for a same H;
   the cache folder holds those embeddings; the scored samples carry the judge's answers.

Prints PASS/FAIL per check and exits 1 on any failure. Every process the run leaves behind (found
by a marker in its environment) is killed at the end.

    .venv/bin/python examples/epd_judge/run.py [--root /tmp/epd_judge_runs] [--num-rollout 3]
"""

from __future__ import annotations

import argparse
import datetime
import glob
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
DIGIT_SHIFT = os.path.join(REPO, "examples", "digit_shift")
MARKER = "EPD_JUDGE_RUN_DIR"  # in the environment of every process of the run: the cleanup finds them by it

SAVED = re.compile(r"Save cache successful for mm_hash (\w+)")
LOADED = re.compile(r"Success load encoder cache for hash (\w+)")
ROLE = re.compile(r"ec_role='(ec_\w+)'")  # vLLM's echo of --ec-transfer-config: ECTransferConfig(... ec_role='...')


def load_module(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_models(run_dir: str) -> tuple[str, str]:
    from vime.tools.make_tiny_model import make_tiny_model

    actor = make_tiny_model(os.path.join(run_dir, "models", "tiny-model"))
    judge = load_module(os.path.join(HERE, "make_tiny_blip2.py"), "make_tiny_blip2").make_tiny_blip2(
        os.path.join(run_dir, "models", "tiny-blip2")
    )
    return actor, judge


def write_config(run_dir: str, judge_path: str) -> tuple[str, str]:
    """The example's YAML with the judge's absolute path and one encoder cache under ``run_dir``."""
    import yaml

    with open(os.path.join(HERE, "vllm_config.yaml")) as f:
        config = yaml.safe_load(f)
    cache = os.path.join(run_dir, "ec_cache")
    judge = next(model for model in config["vllm"] if model["name"] == "judge")
    judge["model_path"] = judge_path
    for group in judge["server_groups"]:
        # Only the storage path: vime layers it over the role it derives (ec_producer / ec_consumer).
        group.setdefault("overrides", {})["ec_transfer_config"] = {
            "ec_connector": "ECExampleConnector",
            "ec_connector_extra_config": {"shared_storage_path": cache},
        }
    path = os.path.join(run_dir, "vllm_config.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f, sort_keys=False)
    return path, cache


def train_argv(run_dir: str, actor: str, config: str, num_rollout: int, extra: list[str] = ()) -> list[str]:
    return [
        sys.executable,
        "-m",
        "vime.cli",
        "train",
        "--hf-checkpoint",
        actor,
        "--vllm-config",
        config,
        "--rollout-num-gpus",
        "3",
        "--prompt-data",
        os.path.join(DIGIT_SHIFT, "train.jsonl"),
        "--input-key",
        "prompt",
        "--label-key",
        "label",
        "--custom-rm-path",
        os.path.join(HERE, "reward.py") + ":reward",
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "4",
        "--num-rollout",
        str(num_rollout),
        "--max-staleness",
        "1",
        "--rollout-max-response-len",
        "4",
        "--lr",
        "1e-3",
        "--run-dir",
        os.path.join(run_dir, "run"),
        "--vllm-enforce-eager",
        "--vllm-max-model-len",
        "64",
        "--vllm-dtype",
        "float32",
        "--engine-startup-timeout",
        "300",
        *extra,
    ]


def kill_leftovers(run_dir: str) -> list[int]:
    """SIGKILL every process (but this one) whose environment has MARKER == run_dir."""
    import psutil

    killed = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if proc.environ().get(MARKER) == run_dir:
                proc.kill()
                killed.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return killed


def read_text(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def role_of(log_text: str) -> str | None:
    """The EC role an engine was started with, from vLLM's echo of its arguments."""
    match = ROLE.search(log_text)
    return match.group(1) if match else None


def judge_metadata(train_dir: str) -> tuple[int, int, list[str]]:
    """(samples with a judge answer, samples with a judge error, a few answers) from the run's queue."""
    from vime.queue.journal_view import JournalView
    from vime.queue.rollout_queue import StoreOptions
    from vime.queue.transport import StrawTransport

    data_dir = os.path.join(train_dir, "rollout_data")
    transport = StrawTransport(StoreOptions(data_dir, "vime"))
    samples = [s for group in JournalView.read(data_dir).accepted() for s in transport.read(group.ref)]
    answered = [
        {k[6:]: v for k, v in s.metadata.items() if k.startswith("judge_") and k != "judge_seconds"}
        for s in samples
        if "judge_answer" in (s.metadata or {})
    ]
    errors = [s.metadata["judge_error"] for s in samples if "judge_error" in (s.metadata or {})]
    return len(answered), len(errors), (answered[:2] + errors[:2])


def check(run_dir: str, returncode: int, cache: str) -> list[tuple[bool, str]]:
    results = [(returncode == 0, f"vime train exited {returncode}")]
    train_dir = os.path.join(run_dir, "run")
    logs = sorted(glob.glob(os.path.join(train_dir, "logs", "judge-engine-*.log")))
    by_role = {}
    for path in logs:
        text = read_text(path)
        by_role.setdefault(role_of(text), []).append((path, text))
    producers, consumers = by_role.get("ec_producer", []), by_role.get("ec_consumer", [])
    results.append(
        (
            bool(producers and consumers),
            f"judge engine logs: {len(producers)} encoder (ec_producer), {len(consumers)} language "
            f"(ec_consumer) among {[os.path.basename(p) for p in logs]}",
        )
    )
    saved = {h: (p, line) for p, t in producers for line in t.splitlines() for h in SAVED.findall(line)}
    loaded = {h: (p, line) for p, t in consumers for line in t.splitlines() for h in LOADED.findall(line)}
    results.append((bool(saved), f"encoder log: {len(saved)} mm_hash(es) with 'Save cache successful'"))
    results.append((bool(loaded), f"language log: {len(loaded)} hash(es) with 'Success load encoder cache'"))
    both = sorted(set(saved) & set(loaded))
    results.append((bool(both), f"{len(both)} hash(es) saved by the encoder and loaded by the language engine"))
    if both:
        h = both[0]
        for p, line in (saved[h], loaded[h]):
            print(f"  {os.path.relpath(p, run_dir)}: {line.strip()[:220]}")
    files = glob.glob(os.path.join(cache, "*", "encoder_cache.safetensors"))
    results.append((bool(files), f"encoder cache {cache}: {len(files)} embedding file(s)"))
    try:
        answered, errors, examples = judge_metadata(train_dir)
        results.append(
            (
                answered > 0 and errors == 0,
                f"samples: {answered} with a judge answer, {errors} with a judge error; e.g. {examples!r}",
            )
        )
    except Exception as error:  # noqa: BLE001 - the log checks above are the proof; this one is a bonus
        results.append((False, f"could not read the samples' metadata: {error!r}"))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="EPD judge example: run and check")
    parser.add_argument("--root", default="/tmp/epd_judge_runs", help="the run dir is a new folder in it")
    parser.add_argument("--num-rollout", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for vime train")
    options = parser.parse_args(argv)
    return run_and_check(options.root, num_rollout=options.num_rollout, timeout=options.timeout)


def run_and_check(root: str, *, num_rollout: int = 3, timeout: float = 900.0, extra: list[str] = ()) -> int:
    """Build, run (``extra``: more `vime train` flags, e.g. a GPU's memory share) and check; the exit status."""
    run_dir = os.path.abspath(os.path.join(root, datetime.datetime.now().strftime("run-%Y%m%d-%H%M%S")))
    os.makedirs(run_dir)
    print(f"run dir {run_dir}", flush=True)
    actor, judge = build_models(run_dir)
    config, cache = write_config(run_dir, judge)
    env = {
        **os.environ,
        MARKER: run_dir,
        "VLLM_LOGGING_LEVEL": "DEBUG",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    argv = train_argv(run_dir, actor, config, num_rollout, extra)
    with open(os.path.join(run_dir, "command.json"), "w") as f:
        json.dump(argv, f, indent=1)
    print("$ " + " ".join(argv), flush=True)
    started = time.monotonic()
    with open(os.path.join(run_dir, "train.log"), "w") as out:
        process = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            returncode = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            print(f"vime train still running after {timeout:.0f}s: interrupting it", flush=True)
            os.killpg(process.pid, signal.SIGINT)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            returncode = -1
        finally:
            wall = time.monotonic() - started
            leftovers = kill_leftovers(run_dir)
    print(
        f"vime train: exit {returncode} after {wall:.0f}s; log {os.path.join(run_dir, 'train.log')}"
        + (f"; killed {len(leftovers)} leftover process(es)" if leftovers else ""),
        flush=True,
    )
    results = check(run_dir, returncode, cache)
    for ok, what in results:
        print(f"{'PASS' if ok else 'FAIL'}  {what}")
    passed = all(ok for ok, _ in results)
    summary = {
        "passed": passed,
        "wall_seconds": round(wall, 1),
        "returncode": returncode,
        "checks": [{"ok": ok, "what": what} for ok, what in results],
    }
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"{'PASS' if passed else 'FAIL'}: EPD judge example ({wall:.0f}s of vime train; {run_dir})")
    if not passed:
        with open(os.path.join(run_dir, "train.log"), errors="replace") as f:
            print("--- last lines of train.log ---\n" + "".join(f.readlines()[-30:]))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
