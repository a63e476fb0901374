"""Benchmark: the trainer's peak memory per parameter, and the largest model a training step fits.

    .venv/bin/python bench/memory/run.py                 # the measurement and the search (~30 min, 2 cores)
    .venv/bin/python bench/memory/run.py --no-search     # the measurement only (~7 min)
    .venv/bin/python bench/memory/run.py --configs a,d   # some configurations only (baseline always)
    .venv/bin/python bench/memory/run.py --search-only   # the largest model only (~30 min)
    .venv/bin/python bench/memory/run.py --smoke         # seconds: a tiny model, numbers meaningless
    python bench/memory/run.py --device cuda --no-search # on GPUs: the CUDA allocator's peaks (no search)

One training step (TorchBackend.train_rollout: GRPO, the old log-probs' forward, one optimizer step, in
which AdamW allocates its state) of a random Qwen2-shaped model (32k vocabulary; 4 samples x 256 tokens), in
fresh processes, one per trainer rank (gloo); with ``--steps N``, N steps and the last one's peak (from the
second step on AdamW's moments exist while the gradients are summed, as in a run's steady state). For:

  baseline  a plain HF float32 AdamW step (cross-entropy over the same batch), one process: the scale;
  (a)       today's default: float32, a full replica of parameters, gradients and AdamW state per rank;
  (b)       --bf16 --use-distributed-optimizer on 2 ranks (FSDP2: float32 shards, bf16 compute);
  (c)       (b) + --recompute-granularity full + --log-probs-chunk-size 256 (and the same on 4 ranks);
  (d)       (c) + --use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 (AdamW's
            moments stored in bf16: 12 / R bytes of optimizer state per parameter instead of 16 / R);

and the same model on the Megatron backend (megatron-core's GPTModel; on CPU under the tests' megatron-core shim,
tests/megatron_shim.py, as the Megatron unit tests run):

  (ma)      (a): float32, a full replica per rank (2 data-parallel ranks);
  (mc)      (c): --bf16 --use-distributed-optimizer (vime's ZeRO-1 over the 2 data-parallel ranks: float32 masters
            and AdamW state sharded; bf16 parameters and float32 gradients whole on each rank)
            --recompute-granularity full --log-probs-chunk-size 256;
  (mt)      (mc)'s flags on 2 tensor-parallel ranks with sequence parallelism instead (every weight matrix split
            in two, its state with it; nothing for ZeRO-1 to shard over one data-parallel rank).

Memory is the rank's resident set: its peak during the step (VmHWM after /proc/self/clear_refs reset it
once the trainer was built) minus its resident set before the model existed (with the model's code already
imported); "overall" also counts building the trainer (loading the checkpoint, sharding). The ranks run with
glibc's mmap threshold fixed (rank_environment), so that a freed tensor leaves the resident set. Printed per
rank in bytes per parameter, and the ratios (c) / (a) (goal <= 0.4) and (d) / (a) per rank, (mc) / (ma) and
(mt) / (ma) on the Megatron backend. Sharded over R
ranks, float32 masters, their gradients and AdamW's two moments hold 16 / R bytes per parameter on each rank: 8
on 2 ranks, the floor (c) approaches there; (d)'s is 6.

The search doubles a Qwen2 shape (layers, then hidden size) and runs (a), (c) and (d) on 2 ranks at each size until
a step does not fit: the two ranks' resident sets together must stay below the memory available when the
benchmark started, less a 1 GiB margin (a watchdog stops the ranks past it, so the machine never swaps or
meets its OOM killer). The doublings bracket the largest size; ``--refine-steps`` bisections of the layer count
at the last hidden size that fit narrow it (a doubling ladder alone can only answer 1x, 2x or 4x). Printed: the
largest size that fits for each, and the ratios to (a) (goal >= 3).

With ``--device cuda`` the ranks train on GPUs (one each, NCCL; a configuration runs on as many ranks as it
asks for, at most the GPUs there are, and says how many) and memory is the CUDA allocator's: its peak during
the step (``max_memory_allocated`` after a reset once the trainer was built), the same in bytes per parameter.
The host's resident set is not counted then, and the search does not run (it sizes models to this machine's
host memory).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

GIB = 1024**3
VOCAB = 32_000


@dataclasses.dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    vocab: int = VOCAB

    @property
    def intermediate(self) -> int:
        return int(self.hidden * 2.75) // 64 * 64

    @property
    def heads(self) -> int:
        return max(2, self.hidden // 64)

    def parameters(self) -> int:
        h, i = self.hidden, self.intermediate
        kv = h // 4 if self.heads >= 4 else h  # grouped-query attention, 4 query heads per kv head
        layer = h * h * 2 + h * kv * 2 + (h + 2 * kv) + 3 * h * i + 2 * h  # q,o + k,v; q,k,v biases; MLP; norms
        return 2 * self.vocab * h + self.layers * layer + h

    def label(self) -> str:
        return f"hidden {self.hidden} x {self.layers} layers ({self.parameters() / 1e6:.0f}M)"


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    ranks: int
    flags: dict  # TorchTrainerSpec fields
    megatron: dict | None = None  # the Megatron backend: Parallelism fields, and "recompute" (None: torch backend)


MEGATRON_C = {"bf16": True, "log_probs_chunk_size": 256}  # and recompute; ZeRO-1 where there are DP ranks


CONFIGS = {
    "a": Config("(a) float32 replica", 2, {}),
    "b": Config("(b) bf16 + FSDP2", 2, {"bf16": True, "use_distributed_optimizer": True}),
    "c": Config(
        "(c) (b) + recompute + chunked log-probs",
        2,
        {"bf16": True, "use_distributed_optimizer": True, "recompute_granularity": "full", "log_probs_chunk_size": 256},
    ),
    "d": Config(
        "(d) (c) + AdamW's moments in bf16",
        2,
        {
            "bf16": True,
            "use_distributed_optimizer": True,
            "recompute_granularity": "full",
            "log_probs_chunk_size": 256,
            "exp_avg_dtype": "bf16",
            "exp_avg_sq_dtype": "bf16",
        },
    ),
    "c4": Config(
        "(c) on 4 ranks",
        4,
        {"bf16": True, "use_distributed_optimizer": True, "recompute_granularity": "full", "log_probs_chunk_size": 256},
    ),
    "ma": Config("(ma) Megatron: float32 replica", 2, {}, megatron={}),
    "mc": Config(
        "(mc) Megatron: bf16 + ZeRO-1 + recompute + chunks",
        2,
        {**MEGATRON_C, "use_distributed_optimizer": True},
        megatron={"recompute": True},
    ),
    "mt": Config(
        "(mt) Megatron: (mc) on TP=2 + SP instead",
        2,
        MEGATRON_C,
        megatron={"recompute": True, "tensor": 2, "sequence_parallel": True},
    ),
}


# ---------------------------------------------------------------------- model folders
def model_folder(cache: str, shape: Shape) -> str:
    """A random Qwen2 of ``shape`` (written once, in bf16 to halve the disk; the trainer loads it in its dtype)."""
    folder = os.path.join(cache, f"qwen2-h{shape.hidden}-l{shape.layers}-v{shape.vocab}")
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from vime.tools.make_tiny_model import build_tokenizer

    config = Qwen2Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=max(1, shape.heads // 4) if shape.heads >= 4 else shape.heads,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    staging = folder + ".tmp"
    shutil.rmtree(staging, ignore_errors=True)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(staging, safe_serialization=True)
    del model
    build_tokenizer().save_pretrained(staging)
    os.replace(staging, folder)
    return folder


# ---------------------------------------------------------------------- one rank (a child process)
def resident_bytes(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def make_samples(count: int, tokens: int, vocab: int, seed: int):
    import random

    from vime.sample import Sample, Status

    rng = random.Random(seed)
    prompt = 16
    samples = []
    for index in range(count):
        ids = [rng.randrange(1, vocab) for _ in range(tokens)]
        samples.append(
            Sample(
                group_index=0,
                index=index,
                tokens=ids,
                response_length=tokens - prompt,
                reward=float(index % 2),
                status=Status.COMPLETED,
                weight_versions=[0] * (tokens - prompt),
                loss_mask=[1] * (tokens - prompt),
            )
        )
    return samples


class HostMemory:
    """The rank's resident set (/proc/self/status), its peak reset by /proc/self/clear_refs."""

    @staticmethod
    def now() -> int:
        return resident_bytes()

    @staticmethod
    def peak() -> int:
        return resident_bytes("VmHWM")

    @staticmethod
    def reset_peak() -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS: the peak from here on is what follows


class CudaMemory:
    """The CUDA allocator's bytes on this rank's GPU (tensors; not the CUDA context or the allocator's cache)."""

    @staticmethod
    def now() -> int:
        import torch

        return torch.cuda.memory_allocated()

    @staticmethod
    def peak() -> int:
        import torch

        return torch.cuda.max_memory_allocated()

    @staticmethod
    def reset_peak() -> None:
        import torch

        torch.cuda.reset_peak_memory_stats()


def rank_main(request: dict) -> dict:
    """Build the trainer on this rank, reset the peak, train one step; the memory measured."""
    import torch

    torch.set_num_threads(1)
    rank, world, device = request["rank"], request["world"], request["device"]
    memory = CudaMemory if device == "cuda" else HostMemory
    if device == "cuda":
        torch.cuda.set_device(rank)
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group(
            "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo",
            init_method=f"tcp://127.0.0.1:{request['port']}",
            rank=rank,
            world_size=world,
        )
    from vime.backends.torch_backend import TorchBackend, TorchTrainerSpec
    from vime.config.algorithm import AlgorithmConfig

    samples = make_samples(request["samples"], request["tokens"], request["vocab"], seed=0)
    load_model_code(with_megatron=request["megatron"] is not None)
    baseline = memory.now()
    algorithm = AlgorithmConfig()
    algorithm.validate()
    spec = TorchTrainerSpec(
        hf_checkpoint=request["model"],
        lr=1e-5,
        weight_decay=0.0,
        adam_betas=(0.9, 0.999),
        adam_eps=1e-8,
        clip_grad=1.0,
        micro_batch_size=request["micro_batch"],
        global_batch_size=request["samples"],
        n_samples_per_prompt=request["samples"],
        rollout_temperature=1.0,
        algorithm=algorithm,
        seed=0,
        threads=1,
        device=device,
        **request["flags"],
    )
    if request["baseline"]:
        parameters, step_peak, built = plain_hf_step(request["model"], samples, memory, device)
    else:
        if request["megatron"] is not None:
            backend, parameters = megatron_backend(spec, request["megatron"], device)
        else:
            backend = TorchBackend(spec)
            parameters = sum(p.numel() for p in backend.model.parameters())  # a sharded DTensor counts its whole
        built_peak, built = memory.peak(), memory.now()
        for step in range(request["steps"]):
            if step == request["steps"] - 1:  # the last step's peak (earlier ones count in the overall peak)
                built_peak = max(built_peak, memory.peak())
                memory.reset_peak()
            backend.train_rollout(samples, policy_version=step)
        step_peak = memory.peak()
        overall = max(built_peak, step_peak)
    if request["baseline"]:
        overall = step_peak
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()  # gloo torn down at exit without it may abort the process
    return {
        "rank": rank,
        "parameters": parameters,
        "baseline": baseline,
        "built": built,
        "step_peak": step_peak,
        "overall_peak": overall,
    }


def megatron_backend(spec, layout: dict, device: str):
    """The Megatron backend of ``spec``'s model with ``layout`` (Parallelism fields; ``recompute``: full, uniform,
    one layer), and the model's parameter count (each tensor-parallel weight counted whole)."""
    from transformers import AutoConfig

    from vime.backends.megatron_args import model_args_from_hf
    from vime.backends.megatron_backend import MegatronBackend
    from vime.backends.megatron_model import Parallelism
    from vime.backends.megatron_spec import MegatronBackendSpec

    if device == "cpu":
        from tests import megatron_shim

        megatron_shim.install()
    layout = dict(layout)
    recompute = layout.pop("recompute", False)
    megatron = MegatronBackendSpec(
        model=model_args_from_hf(AutoConfig.from_pretrained(spec.hf_checkpoint)),
        parallel=Parallelism(**layout),
        recompute=(
            {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
            if recompute
            else None
        ),
    )
    backend = MegatronBackend(spec, megatron)
    split = layout.get("tensor", 1)
    parameters = sum(
        p.numel() * (split if getattr(p, "tensor_model_parallel", False) else 1) for p in backend.gpt.parameters()
    )
    return backend, parameters


def load_model_code(*, with_megatron: bool = False) -> None:
    """Import what building the trainer imports (transformers' Qwen2 classes and tokenizer, FSDP2, DCP; megatron-core
    and the Megatron backend for its configurations) before the baseline is read: ~200 MB of code and module state,
    the same for every configuration and unrelated to the model's size, which would otherwise count as the step's
    memory."""
    import torch.distributed.checkpoint
    import torch.distributed.fsdp  # noqa: F401
    from transformers import AutoTokenizer, Qwen2ForCausalLM  # noqa: F401
    from transformers.models.qwen2 import modeling_qwen2, tokenization_qwen2  # noqa: F401

    if with_megatron:
        import megatron.core.models.gpt  # noqa: F401

        import vime.backends.megatron_backend  # noqa: F401


def plain_hf_step(model_dir: str, samples, memory, device: str) -> tuple[int, int, int]:
    """A plain HF float32 AdamW step on the batch (cross-entropy): the scale the others are read against."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.tensor([s.tokens for s in samples], device=device)
    built = memory.now()
    memory.reset_peak()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    return sum(p.numel() for p in model.parameters()), memory.peak(), built


# ---------------------------------------------------------------------- the parent: ranks and the watchdog
def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def rank_environment() -> dict[str, str]:
    """The ranks' environment: glibc's mmap threshold fixed at 128 KiB (``MALLOC_MMAP_THRESHOLD_``), so every
    tensor of 128 KiB or more is its own mapping, given back to the system when it is freed. By default glibc
    raises the threshold to the size of the largest block freed so far (up to 32 MiB), after which freed
    activations and gathered parameters stay in the heap, counted in the resident set though no tensor holds
    them; a rank's resident set then depends on the order of its frees more than on what it keeps. Every
    configuration, the plain HF baseline included, runs with the same setting."""
    return {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}


def run_ranks(
    model: str,
    config: Config | None,
    *,
    samples: int,
    tokens: int,
    micro_batch: int,
    vocab: int,
    budget: int,
    timeout: float,
    device: str = "cpu",
    steps: int = 1,
) -> dict:
    """One step on ``config.ranks`` fresh processes (``config`` None: the plain HF baseline, one process;
    on CUDA at most one rank per GPU). Returns {"fits": bool, "ranks": [...]} or the reason it did not fit."""
    import psutil

    from vime.runtime.ports import free_port

    ranks = rank_count(config, device)
    port = free_port()
    procs = []
    for rank in range(ranks):
        request = {
            "rank": rank,
            "world": ranks,
            "port": port,
            "model": model,
            "samples": samples,
            "tokens": tokens,
            "micro_batch": micro_batch,
            "vocab": vocab,
            "flags": config.flags if config else {},
            "megatron": config.megatron if config else None,
            "steps": steps,
            "baseline": config is None,
            "device": device,
        }
        argv = [sys.executable, os.path.abspath(__file__), "--rank-request", json.dumps(request)]
        procs.append(
            subprocess.Popen(
                argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=rank_environment()
            )
        )
    started, peak_total, reason = time.monotonic(), 0, None
    while any(p.poll() is None for p in procs):
        total = 0
        for p in procs:
            try:
                total += psutil.Process(p.pid).memory_info().rss
            except psutil.NoSuchProcess:
                pass
        peak_total = max(peak_total, total)
        if total > budget:
            reason = f"the ranks' resident sets reached {total / GIB:.1f} GiB (budget {budget / GIB:.1f} GiB)"
        elif time.monotonic() - started > timeout:
            reason = f"no result within {timeout:.0f}s"
        if reason:
            for p in procs:
                p.kill()
            break
        time.sleep(0.1)
    outputs = [p.communicate() for p in procs]
    if reason is None:
        failed = [(p.returncode, err) for p, (_, err) in zip(procs, outputs) if p.returncode != 0]
        if failed:
            code, err = failed[0]
            reason = f"a rank exited with {code}: {err.strip().splitlines()[-1] if err.strip() else ''}"
    if reason:
        return {"fits": False, "reason": reason, "peak_total": peak_total}
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    return {"fits": True, "ranks": results, "peak_total": peak_total}


def rank_count(config: Config | None, device: str) -> int:
    if config is None:
        return 1
    if device == "cuda":
        import torch

        return max(1, min(config.ranks, torch.cuda.device_count()))
    return config.ranks


def per_parameter(result: dict, key: str = "step_peak") -> float:
    """The worst rank's peak (minus its baseline) per parameter of the whole model."""
    return max((r[key] - r["baseline"]) / r["parameters"] for r in result["ranks"])


def measure(options, cache: str, budget: int) -> dict:
    shape = Shape(options.hidden, options.layers, options.vocab)
    model = model_folder(cache, shape)
    print(f"model: random Qwen2, {shape.label()}; batch {options.samples} x {options.tokens} tokens", flush=True)
    common = dict(
        samples=options.samples,
        tokens=options.tokens,
        micro_batch=options.micro_batch,
        vocab=options.vocab,
        budget=budget,
        timeout=options.timeout,
        device=options.device,
        steps=options.steps,
    )
    rows = {}
    chosen = [("baseline", None)] + [(key, config) for key, config in CONFIGS.items() if key in options.configs]
    for key, config in chosen:
        if options.device == "cuda" and config and rank_count(config, "cuda") < config.ranks and key == "c4":
            continue  # (c) on fewer GPUs than 4 repeats (c)
        result = run_ranks(model, config, **common)
        name = config.name if config else "baseline: plain HF float32 AdamW step"
        if config and rank_count(config, options.device) != config.ranks:
            name += f" [{rank_count(config, options.device)} rank(s)]"
        if not result["fits"]:
            print(f"  {name:45s} did not run: {result['reason']}", flush=True)
            rows[key] = None
            continue
        rows[key] = result
        print(
            f"  {name:45s} {per_parameter(result):6.2f} bytes/parameter per rank in the step "
            f"({per_parameter(result, 'built'):5.2f} held before it, "
            f"{per_parameter(result, 'overall_peak'):5.2f} with building the trainer), "
            f"{result['peak_total'] / GIB:.2f} GiB for all ranks",
            flush=True,
        )
    if rows.get("a") and rows.get("c"):
        ratio = per_parameter(rows["c"]) / per_parameter(rows["a"])
        print(
            f"ratio (c) / (a) per rank: {ratio:.2f} on {rank_count(CONFIGS['c'], options.device)} rank(s)"
            f" (goal <= 0.4 on 2)"
            + (f", {per_parameter(rows['c4']) / per_parameter(rows['a']):.2f} on 4 ranks" if rows.get("c4") else ""),
            flush=True,
        )
    if rows.get("a") and rows.get("d"):
        ratio = per_parameter(rows["d"]) / per_parameter(rows["a"])
        print(
            f"ratio (d) / (a) per rank: {ratio:.2f} on {rank_count(CONFIGS['d'], options.device)} rank(s)", flush=True
        )
    for key in ("mc", "mt"):
        if rows.get("ma") and rows.get(key):
            ratio = per_parameter(rows[key]) / per_parameter(rows["ma"])
            print(f"ratio ({key}) / (ma) per rank: {ratio:.2f} on 2 ranks (the Megatron backend)", flush=True)
    return rows


def ladder(start: Shape, steps: int) -> list[Shape]:
    """Each about twice the last: the layers doubled, then the hidden size doubled and the layers halved
    (a layer's parameters grow with the square of the hidden size)."""
    shapes = [start]
    for i in range(steps):
        last = shapes[-1]
        shapes.append(
            Shape(last.hidden, last.layers * 2, last.vocab)
            if i % 2 == 0 or last.layers < 2
            else Shape(last.hidden * 2, last.layers // 2, last.vocab)
        )
    return shapes


def search(options, cache: str, budget: int) -> None:
    shapes = ladder(Shape(options.hidden, options.layers, options.vocab), options.search_steps)
    common = dict(
        samples=options.samples,
        tokens=options.tokens,
        micro_batch=options.micro_batch,
        vocab=options.vocab,
        budget=budget,
        timeout=options.timeout,
        steps=options.steps,
    )
    largest = {}
    for key in [k for k in ("a", "c", "d") if k in options.configs]:
        fits = functools.partial(step_fits, CONFIGS[key], cache, common)
        too_large = None
        for shape in shapes:
            if not fits(shape):
                too_large = shape
                break
            largest[key] = shape
        if key in largest and too_large is not None:
            largest[key] = refine(largest[key], too_large, options.refine_steps, fits)
    if "a" in largest:
        for key in [k for k in ("c", "d") if k in largest]:
            ratio = largest[key].parameters() / largest["a"].parameters()
            print(
                f"largest step that fits in {budget / GIB:.1f} GiB with 2 ranks: (a) {largest['a'].label()}, "
                f"({key}) {largest[key].label()}: {ratio:.1f}x the parameters (goal >= 3)",
                flush=True,
            )


def step_fits(config: Config, cache: str, common: dict, shape: Shape) -> bool:
    result = run_ranks(model_folder(cache, shape), config, **common)
    verdict = "fits" if result["fits"] else f"does not fit: {result['reason']}"
    print(f"  {config.name:45s} {shape.label():40s} {verdict} (peak {result['peak_total'] / GIB:.1f} GiB)", flush=True)
    return result["fits"]


def refine(fitting: Shape, too_large: Shape, steps: int, fits) -> Shape:
    """Bisect the layer count at ``fitting``'s hidden size, between it and as many layers as ``too_large``'s
    parameters: a doubling ladder alone can only say 1x, 2x or 4x."""
    low, high = fitting.layers, fitting.layers
    while Shape(fitting.hidden, high, fitting.vocab).parameters() < too_large.parameters():
        high += 1
    for _ in range(steps):
        if high - low <= 1:
            break
        middle = (low + high) // 2
        if fits(Shape(fitting.hidden, middle, fitting.vocab)):
            low = middle
        else:
            high = middle
    return Shape(fitting.hidden, low, fitting.vocab)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="seconds, on a tiny model; the numbers mean nothing")
    parser.add_argument("--no-search", action="store_true", help="the per-parameter measurement only")
    parser.add_argument("--search-only", action="store_true", help="the search only (no per-parameter measurement)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument(
        "--steps",
        type=int,
        default=1,
        help="training steps per configuration, the peak read over the last (from the second step on AdamW's "
        "moments exist while the gradients are summed, as in a run)",
    )
    parser.add_argument("--search-steps", type=int, default=5, help="doublings the search tries at most")
    parser.add_argument(
        "--refine-steps", type=int, default=3, help="bisections of the layer count after the doublings (0: none)"
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one configuration may take")
    parser.add_argument("--cache", help="where the random models are kept (default: a temporary folder)")
    parser.add_argument(
        "--budget-gib",
        type=float,
        help="memory the ranks may use together (default: what is available at the start, less 1 GiB)",
    )
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="cuda: train on GPUs, measure the CUDA allocator"
    )
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"the configurations to run, comma-separated (default: all of {','.join(CONFIGS)}; the baseline always)",
    )
    parser.add_argument("--rank-request", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    options.configs = [key.strip() for key in options.configs.split(",") if key.strip()]
    unknown = [key for key in options.configs if key not in CONFIGS]
    if unknown:
        parser.error(f"--configs: unknown {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    if options.steps < 1:
        parser.error(f"--steps: must be >= 1, got {options.steps}")
    if options.rank_request:
        print(json.dumps(rank_main(json.loads(options.rank_request))), flush=True)
        os._exit(0)  # the result is out; gloo's threads have aborted interpreter teardown now and then
    if options.smoke:
        options.hidden, options.layers, options.vocab, options.tokens = 64, 2, 512, 32
        options.no_search, options.timeout = True, 300
    if options.search_only and options.no_search:
        parser.error("--search-only and --no-search leave nothing to run")
    if options.device == "cuda" and not options.no_search:
        parser.error("--device cuda measures only: add --no-search (the search sizes models to the host's memory)")
    cache = options.cache or tempfile.mkdtemp(prefix="vime-bench-memory-")
    budget = int(options.budget_gib * GIB) if options.budget_gib else available_bytes() - GIB
    print(f"memory available for the ranks: {budget / GIB:.1f} GiB", flush=True)
    try:
        rows = {} if options.search_only else measure(options, cache, budget)
        if any(row is None for row in rows.values()):
            return 1
        if not options.no_search:
            search(options, cache, budget)
    finally:
        if not options.cache:
            shutil.rmtree(cache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
