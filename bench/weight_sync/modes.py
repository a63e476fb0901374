"""Full vs delta weight publication, by measured cost, and what --update-weight-mode auto makes of it (issue 20).

    PYTHONPATH=. .venv/bin/python bench/weight_sync/modes.py [--params-m 4 32] [--changed 1.0 0.05] [--syncs 12]
                                                             [--no-juicefs] [--juicefs-limit-mbps 200]

For each volume (a local directory; the test suite's JuiceFS volume, tests/juicefs.py, where this machine can
mount one) x model size (millions of float32 parameters) x fraction of the elements one training step changes
(1.0: AdamW in float32 moves every weight; small fractions: bf16 weights with a small learning rate, where most
elements round back to what they were), it times one synchronisation the way a run does it, in each mode:

- the trainer's side: vime.weights.publisher.WeightPublisher, as the trainer worker runs it;
- one engine's side: vime.weights.local.LocalWeights.receive, the engine actor's own copy (a full version
  linked or copied, a delta applied) that vLLM then reloads from. On the JuiceFS volume the engine's copy is
  on the local disk, as ``--update-weight-local-checkpoint-dir`` puts it on a rollout host, and so is the
  trainer's copy of the parent of the next delta (``--update-weight-trainer-dir``).

vLLM's reload from the engine's copy costs the same in both modes and is not in it. ``full`` and ``delta`` are
the fixed modes (delta with --update-weight-full-interval 10: its full versions count too); ``auto`` is the
choice of vime.weights.mode_choice fed with these measured costs, as the driver feeds it. Printed per case:
seconds per sync of each mode after the first (full in every mode), delta / full (below 1: delta is faster,
the crossover), auto's mean after its first two syncs (one of each mode, measured) against the faster fixed
mode (goal: close to 1), and the modes auto wrote.

The tests' JuiceFS volume keeps its objects on the local disk; ``--juicefs-limit-mbps N`` mounts it with
JuiceFS's ``--upload-limit N --download-limit N`` (megabits per second), the bandwidth of a network object
store, where every byte a mode saves is time.

``--smoke`` (what `make test` runs, in seconds): a quarter-million parameters, 3 syncs, the local directory.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shutil
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

FULL_INTERVAL = 10  # --update-weight-full-interval's default
TENSOR_ELEMENTS = 1 << 20  # a model as tensors of 1M elements (4 MiB each)


class Model:
    """Float32 tensors of ``params`` elements in all; :meth:`step` changes a ``changed`` fraction of them."""

    def __init__(self, params: int, changed: float, seed: int = 0):
        import torch

        self.generator = torch.Generator().manual_seed(seed)
        sizes = [TENSOR_ELEMENTS] * (params // TENSOR_ELEMENTS) + (
            [params % TENSOR_ELEMENTS] if params % TENSOR_ELEMENTS else []
        )
        self.tensors = {
            f"layer{i}.weight": torch.randn(n, generator=self.generator) * 0.02 for i, n in enumerate(sizes)
        }
        self.changed = changed

    def step(self) -> None:
        import torch

        for tensor in self.tensors.values():
            update = torch.randn(tensor.shape, generator=self.generator) * 1e-4
            if self.changed < 1.0:
                update *= torch.rand(tensor.shape, generator=self.generator) < self.changed
            tensor.add_(update)

    def write(self, folder: str) -> None:
        from safetensors.torch import save_file

        os.makedirs(folder, exist_ok=True)
        save_file(self.tensors, os.path.join(folder, "model.safetensors"))


def run_mode(
    mode: str, model: Model, weight_root: str, engine_root: str, syncs: int, trainer_dir: str | None
) -> tuple[list[float], list[str]]:
    """``syncs`` synchronisations in ``mode`` (full, delta, auto): (seconds of each, mode written each).
    ``trainer_dir``: the trainer's scratch folder (--update-weight-trainer-dir; None: in the weight folder)."""
    from vime.weights.local import LocalWeights
    from vime.weights.mode_choice import AutoModeChoice, PublishMode
    from vime.weights.publisher import WeightPublisher

    shutil.rmtree(weight_root, ignore_errors=True)
    publisher = WeightPublisher(weight_root, keep=2, scratch=trainer_dir)
    engine = LocalWeights(engine_root)
    choice = AutoModeChoice(probe_interval=FULL_INTERVAL) if mode == "auto" else None
    seconds, written = [], []
    try:
        for version in range(1, syncs + 1):
            model.step()
            asked, force_full = choice.publish_arguments(False) if choice is not None else (mode, False)
            started = time.perf_counter()
            publication = publisher.publish(
                version, model.write, mode=asked, full_interval=FULL_INTERVAL, force_full=force_full
            )
            engine.receive(publication.path, version)
            took = time.perf_counter() - started
            if choice is not None:
                choice.record(PublishMode(publication.mode), took)
            seconds.append(took)
            written.append(publication.mode)
    finally:
        publisher.close()
        engine.close()
    return seconds, written


def bench_case(volume: str, local_root: str, params: int, changed: float, syncs: int, *, shared: bool) -> dict:
    """One volume x size x changed fraction, the three modes from the same starting weights. ``shared``: the
    volume stands for a network one; the trainer keeps its scratch copy on the local disk, as
    --update-weight-trainer-dir does (else in the weight folder, the default)."""
    results = {}
    for mode in ("full", "delta", "auto"):
        model = Model(params, changed)  # every mode sees the same steps
        work = tempfile.mkdtemp(prefix=f"modes-{mode}-", dir=volume)
        engine_root = tempfile.mkdtemp(prefix=f"engine-{mode}-", dir=local_root)
        try:
            trainer_dir = os.path.join(engine_root, "trainer") if shared else None
            seconds, written = run_mode(mode, model, os.path.join(work, "weights"), engine_root, syncs, trainer_dir)
        finally:
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(engine_root, ignore_errors=True)
        # The first sync is full in every mode (nothing to encode against), and auto's second is a delta (both
        # modes measured): the means leave out what is not steady state.
        results[mode] = (statistics.fmean(seconds[2 if mode == "auto" else 1 :]), written)
    return results


def report(label: str, results: dict) -> None:
    full, delta, auto = results["full"][0], results["delta"][0], results["auto"][0]
    written = "".join("F" if m == "full" else "d" for m in results["auto"][1])
    print(
        f"  {label}: full {full:.3f} s/sync, delta {delta:.3f} s/sync, delta / full = {delta / full:.2f}; "
        f"auto {auto:.3f} s/sync = {auto / min(full, delta):.2f}x the faster (wrote {written})",
        flush=True,
    )


def _juicefs_volume_or_none(limit_mbps: int | None):
    spec = importlib.util.spec_from_file_location("bench_queue_run", os.path.join(REPO, "bench", "queue", "run.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    limits = ("--upload-limit", str(limit_mbps), "--download-limit", str(limit_mbps)) if limit_mbps else ()
    return module.juicefs_volume_or_none(*limits)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params-m", type=float, nargs="+", default=[4.0, 32.0], help="model sizes, in millions")
    parser.add_argument("--changed", type=float, nargs="+", default=[1.0, 0.05], help="fractions a step changes")
    parser.add_argument("--syncs", type=int, default=12, help="synchronisations per mode (the first is left out)")
    parser.add_argument("--no-juicefs", action="store_true", help="the local directory only")
    parser.add_argument(
        "--juicefs-limit-mbps", type=int, default=None, help="the JuiceFS volume's upload and download limit"
    )
    parser.add_argument("--smoke", action="store_true", help="seconds: one tiny case on the local directory")
    args = parser.parse_args()
    if args.smoke:
        args.params_m, args.changed, args.syncs, args.no_juicefs = [0.25], [1.0], 3, True
    if args.syncs < 3:
        parser.error("--syncs must be >= 3 (the first sync, and auto's second, are left out of the means)")
    if args.juicefs_limit_mbps is not None and args.juicefs_limit_mbps < 1:
        parser.error("--juicefs-limit-mbps must be >= 1")
    root = tempfile.mkdtemp(prefix="vime-bench-modes-")
    try:
        with contextlib.ExitStack() as stack:
            volumes = {"local directory": os.path.join(root, "local")}
            os.makedirs(volumes["local directory"])
            if not args.no_juicefs:
                mount_point = stack.enter_context(_juicefs_volume_or_none(args.juicefs_limit_mbps))
                if mount_point is not None:
                    limit = f", {args.juicefs_limit_mbps} Mbit/s each way" if args.juicefs_limit_mbps else ""
                    volumes[f"JuiceFS volume{limit}"] = mount_point
            for name, volume in volumes.items():
                print(f"== {name}", flush=True)
                for params_m in args.params_m:
                    for changed in args.changed:
                        shared = volume != volumes["local directory"]
                        results = bench_case(volume, root, int(params_m * 1e6), changed, args.syncs, shared=shared)
                        report(f"{params_m:g}M params, {changed:.0%} changed per step", results)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.smoke:
        print("== bench/weight_sync/modes --smoke: full, delta and auto timed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
