"""Benchmark: the durable queue against the Ray object store and plain torch.save + fsync files.

    .venv/bin/python bench/queue/run.py                 # micro benchmark + main-job comparison
    .venv/bin/python bench/queue/run.py --skip-main-job # micro benchmark only

1. Micro: groups of 8 realistic samples (2,048 response tokens with log-probs, versions and loss
   mask; optionally 128-wide score-centering top-k heads) go producer -> consumer through
   (a) vime's straw queue: StrawTransport.publish + exactly-once acceptance by the real Controller,
       then the trainer's read by reference, producer and consumer in separate processes;
   (b) Ray's object store: ray.put in a producer actor, ray.get by reference in the driver;
   (c) plain files: torch.save + fsync per group, torch.load.
   Printed: samples/s and MiB/s of each, and the ratios straw / object store, straw / files.
2. The cost of durability on the main job: the digit-shift demo config, shortened, once with
   --rollout-data-transport straw and once with object-store; samples trained per second over the
   steady-state steps, and the ratio (goal >= 0.95).
"""

from __future__ import annotations

import argparse
import json
import os
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
        sample = Sample(group_index=group_index, index=i, prompt_index=group_index, tokens=prompt + response,
                        response_length=tokens, loss_mask=[1] * tokens, reward=float(i % 2),
                        status=Status.COMPLETED, rollout_log_probs=torch.randn(tokens).tolist(),
                        weight_versions=[3] * (tokens // 2) + [4] * (tokens - tokens // 2),
                        metadata={"source_name": "bench"})
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
def _straw_producer(data_dir: str, prompts: str, groups: int, tokens: int, sc_heads: int, ready, out) -> None:
    """Runs in its own process, like a rollout worker: publish each group, have it accepted."""
    from vime.data.source import DataKeys
    from vime.queue.rollout_queue import StoreOptions
    from vime.queue.transport import StrawTransport
    from vime.workers.controller import Controller, ControllerSpec

    store = StoreOptions(data_dir, "bench", 256.0)
    controller = Controller(ControllerSpec(transport="straw", store=store, lease_seconds=600, prompt_data=prompts,
                                           keys=DataKeys("prompt", "label"), seed=0, shuffle=False, num_epoch=None,
                                           groups_per_rollout=groups, max_staleness=10))
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
        controller.complete(lease, sid, ref, len(samples), tokens * len(samples))
    out.put(time.perf_counter() - started)
    refs = controller.take_groups(0, groups, 0)
    out.put([g.ref for g in refs])
    controller.shutdown()


def bench_straw(root: str, groups: int, tokens: int, sc_heads: int) -> dict:
    import multiprocessing as mp

    from vime.queue.rollout_queue import StoreOptions
    from vime.queue.transport import StrawTransport

    data_dir = os.path.join(root, "straw")
    prompts = os.path.join(root, "prompts.jsonl")
    with open(prompts, "w") as f:
        for i in range(groups):
            f.write(json.dumps({"prompt": str(i), "label": ""}) + "\n")
    ctx = mp.get_context("spawn")
    ready, out = ctx.Event(), ctx.Queue()
    producer = ctx.Process(target=_straw_producer, args=(data_dir, prompts, groups, tokens, sc_heads, ready, out))
    producer.start()
    results = []
    while len(results) < 2:
        try:
            results.append(out.get(timeout=5))
        except Exception:
            if not producer.is_alive():
                raise SystemExit("the straw producer process failed (see above)") from None
    publish_seconds, refs = results
    producer.join(timeout=600)
    reader = StrawTransport(StoreOptions(data_dir, "bench"))
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


def micro(groups: int, tokens: int, sc_heads: int) -> None:
    import ray

    mib = group_bytes(make_group(0, tokens=tokens, sc_heads=sc_heads)) * groups / 2**20
    label = f"{groups} groups x 8 samples x {tokens} tokens" + (f" + {sc_heads}-wide SC heads" if sc_heads else "")
    print(f"\n== {label}: {mib:.1f} MiB of payload")
    root = tempfile.mkdtemp(prefix="vime-bench-queue-")
    try:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
        results = {"straw (vime queue)": bench_straw(root, groups, tokens, sc_heads),
                   "ray object store": bench_ray(groups, tokens, sc_heads),
                   "torch.save + fsync": bench_files(root, groups, tokens, sc_heads)}
    finally:
        ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    rates = {}
    for name, r in results.items():
        total = r["publish_s"] + r["consume_s"]
        rates[name] = groups * 8 / total
        print(f"  {name:22s} publish {r['publish_s']:6.2f}s  consume {r['consume_s']:6.2f}s  "
              f"-> {groups * 8 / total:8.1f} samples/s  {mib / total:7.1f} MiB/s end to end")
    straw = rates["straw (vime queue)"]
    print(f"  ratio straw / object store = {straw / rates['ray object store']:.2f}; "
          f"straw / torch.save+fsync = {straw / rates['torch.save + fsync']:.2f}")


# ---------------------------------------------------------------------------------------------- main job
def main_job(transport: str, out_dir: str, steps: int) -> float:
    """Samples trained per second over the steady-state steps (the first 5 are warm-up)."""
    sys.path.insert(0, os.path.join(REPO, "examples", "digit_shift"))
    from run_demo import demo_args

    from vime.tools.make_tiny_model import make_tiny_model

    model = make_tiny_model(os.path.join(out_dir, "model"))
    run_dir = os.path.join(out_dir, transport)
    args = demo_args(run_dir, model)
    for flag, value in (("--num-rollout", str(steps)), ("--rollout-data-transport", transport)):
        args[args.index(flag) + 1] = value
    for flag in ("--eval-prompt-data", "--save", "--save-interval", "--eval-interval"):
        i = args.index(flag)
        del args[i:i + (3 if flag == "--eval-prompt-data" else 2)]
    # One process per run: each run owns its Ray instance, engine and router from start to end.
    if subprocess.run([sys.executable, "-m", "vime.cli", "train", *args], cwd=REPO).returncode != 0:
        raise SystemExit(f"main job with {transport} failed")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if '"kind": "train"' in line]
    steady = records[5:]
    seconds = steady[-1]["time"] - records[4]["time"]
    return sum(r["samples"] for r in steady) / seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--sc-groups", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--main-job-steps", type=int, default=30)
    parser.add_argument("--skip-main-job", action="store_true")
    args = parser.parse_args()
    micro(args.groups, args.tokens, 0)
    micro(args.sc_groups, args.tokens, 128)
    if args.skip_main_job:
        return 0
    out = tempfile.mkdtemp(prefix="vime-bench-mainjob-")
    try:
        rates = {t: main_job(t, out, args.main_job_steps) for t in ("object-store", "straw")}
    finally:
        shutil.rmtree(out, ignore_errors=True)
    print("\n== main job (digit shift, 64 prompts x 8 samples per step, steady-state steps)")
    for transport, rate in rates.items():
        print(f"  {transport:13s} {rate:8.1f} samples trained / s")
    print(f"  ratio straw / object-store = {rates['straw'] / rates['object-store']:.3f} (goal >= 0.95)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
