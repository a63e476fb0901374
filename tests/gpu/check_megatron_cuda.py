"""GPU check of the Megatron backend training on CUDA (megatron-core's real CUDA paths; no vLLM, no Ray). Not a
pytest file.

    python tests/gpu/check_megatron_cuda.py [--device cuda]

Needs one CUDA GPU and megatron-core (``pip install megatron-core==0.16.1``; wheels can be carried to a machine
without the package). On the tiny random models and samples of the unit tests, it trains MegatronBackend on the
GPU and checks, each against a run it can be compared with:

  1. float32 (TF32 off) takes the torch backend's first two steps on the CPU: loss, gradient norm and the
     trainer/rollout log-prob gap within 1e-4 relative (dense Qwen2; GLM-4, its norms after the attention and
     the MLP Transformer Engine's where it is installed; then Qwen3-MoE, GLM-4.5's sigmoid routing with an expert
     bias, DeepSeek-V3's multi-latent attention with YaRN RoPE: megatron-core's MLA on CUDA, with Transformer
     Engine's attention core where it is installed; and Qwen3-Next's gated delta nets, on flash-linear-attention's
     kernels where that package is installed, else megatron-core's torch delta rule);
  2. --bf16: bf16 model and float32 masters, gradient norms within 10% of float32's; the log-prob gap printed;
  3. --use-distributed-optimizer (vime's ZeRO-1, one rank here) takes the plain optimizer's steps;
  4. a torch_dist checkpoint written on the GPU resumes in a fresh trainer with the same next step;
  5. --use-dynamic-batch-size with a token budget takes the fixed micro-batches' steps;
  6. --log-probs-chunk-size takes the whole logits' steps (the output layer's logits a chunk at a time).

The unit tests run the same backend on CPU under a test-only shim (tests/megatron_shim.py), which this check does
not install on CUDA: what it adds is megatron-core's own CUDA code (its RNG tracker, its kernels, device
placement). ``--device cpu`` runs the same comparisons under the shim: a dry run of the script itself.

Exit status: 0 all checks passed, 1 a check failed, 77 not runnable here (no GPU, no megatron-core).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time

from gpu_common import EXACT_ARITHMETIC, compare_bf16_steps, compare_steps, exact_float32, missing_gpu_stack, skip


def specs(model_dir: str, **fields):
    from tests.unit.test_megatron_backend import megatron_spec, trainer_spec

    spec = trainer_spec(model_dir, use_kl_loss=True, kl_loss_coef=0.1)
    return dataclasses.replace(spec, device="cpu", **fields), megatron_spec(model_dir)


def steps(backend, rollouts) -> list[dict]:
    return [backend.train_rollout(samples, 0) for samples in rollouts]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run under the shim")
    options = parser.parse_args(argv)
    if options.device == "cuda" and (reason := missing_gpu_stack("megatron.core")):
        return skip(reason)
    import torch

    from tests import megatron_shim

    if options.device == "cpu":
        megatron_shim.install()
    from tests.unit.test_megatron_backend import make_samples
    from vime.backends.megatron_backend import MegatronBackend
    from vime.backends.torch_backend import TorchBackend

    exact_float32()
    started = time.monotonic()
    work = tempfile.mkdtemp(prefix="vime-megatron-cuda-check-")
    failures: list[str] = []
    try:
        dense = megatron_shim.tiny_qwen2_with_tokenizer(os.path.join(work, "dense"))
        moe = {
            name: megatron_shim.tiny_moe_hf_model(
                os.path.join(work, name), with_tokenizer=True, **megatron_shim.MOE_VARIANTS[name]
            )
            for name in ("qwen3_moe", "glm4_moe", "deepseek_v3", "qwen3_next")
        }
        glm4 = megatron_shim.tiny_hf_model(os.path.join(work, "glm4"), "glm4", with_tokenizer=True)
        rollouts = [make_samples(seed) for seed in (0, 1)]
        print(f"device {options.device}: {torch.cuda.get_device_name() if options.device == 'cuda' else 'CPU'}")

        print("1. float32 on the device vs the torch backend on the CPU", flush=True)
        plain = {}
        for name, model_dir in (("dense", dense), ("glm4", glm4), *moe.items()):
            reference = steps(TorchBackend(specs(model_dir, **EXACT_ARITHMETIC)[0]), rollouts)
            megatron = MegatronBackend(*specs(model_dir, **EXACT_ARITHMETIC))
            where = {p.device.type for p in megatron.gpt.parameters()}
            print(f"  {name}: Megatron parameters on {sorted(where)}", flush=True)
            plain[name] = steps(megatron, rollouts)
            compare_steps(f"float32 {name}", plain[name], reference, 1e-4, failures)

        print("2. --bf16", flush=True)
        bf16 = MegatronBackend(*specs(dense, bf16=True, **EXACT_ARITHMETIC))
        got = steps(bf16, rollouts)
        compare_bf16_steps(got, plain["dense"], failures)
        dtypes = {p.dtype for p in bf16.gpt.parameters()}
        if dtypes != {torch.bfloat16}:
            failures.append(f"bf16: the Megatron model's parameters are {dtypes}")

        print("3. --use-distributed-optimizer (one rank)", flush=True)
        zero = steps(MegatronBackend(*specs(dense, use_distributed_optimizer=True, **EXACT_ARITHMETIC)), rollouts)
        compare_steps("ZeRO-1 vs plain", zero, plain["dense"], 1e-5, failures)

        print("4. torch_dist checkpoint and resume", flush=True)
        first = MegatronBackend(*specs(dense))
        first.train_rollout(rollouts[0], 0)
        first.save_training_state(os.path.join(work, "checkpoint"))
        want = [first.train_rollout(rollouts[1], 0)]
        resumed = MegatronBackend(*specs(dense))
        resumed.load_training_state(os.path.join(work, "checkpoint"))
        compare_steps("resume", [resumed.train_rollout(rollouts[1], 0)], want, 1e-5, failures)

        print("5. token budgets vs fixed micro-batches", flush=True)
        budgets = MegatronBackend(*specs(dense, use_dynamic_batch_size=True, max_tokens_per_gpu=20, **EXACT_ARITHMETIC))
        compare_steps(
            "dynamic batch", steps(budgets, rollouts), plain["dense"], 1e-4, failures, keys=("loss", "grad_norm")
        )
        print("6. --log-probs-chunk-size vs the whole logits", flush=True)
        chunked = MegatronBackend(*specs(dense, log_probs_chunk_size=5, **EXACT_ARITHMETIC))
        compare_steps("chunked log-probs", steps(chunked, rollouts), plain["dense"], 1e-4, failures)
        if options.device == "cuda":
            print(f"peak GPU memory allocated: {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"checks took {time.monotonic() - started:.0f}s", flush=True)
    if failures:
        print("FAIL:\n  " + "\n  ".join(failures), flush=True)
        return 1
    print("PASS: the Megatron backend trains on the device as the torch backend does on the CPU", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
