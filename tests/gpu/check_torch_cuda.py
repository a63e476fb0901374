"""GPU check of the torch backend training on CUDA (no vLLM, no Ray: the trainer alone). Not a pytest file.

    python tests/gpu/check_torch_cuda.py [--device cuda] [--bench]

Needs one CUDA GPU, torch and transformers; nothing of vime's GPU extras. On a tiny random Qwen2 and the
ragged GRPO samples of the unit tests, it trains TorchBackend on the GPU and checks, each against a run it
can be compared with exactly:

  1. float32 on CUDA (TF32 off) takes the CPU run's first two steps: loss, gradient norm and the trainer /
     rollout log-prob gap within 1e-4 relative;
  2. --use-dynamic-batch-size --max-tokens-per-gpu, --log-probs-chunk-size and --recompute-granularity full
     on CUDA take the plain CUDA run's steps (loss and gradient norm, same tolerance);
  3. --bf16 on CUDA: bf16 model and float32 masters on the GPU, its gradient norms within 10% of float32's;
     the log-prob gap is printed;
  4. a checkpoint saved on CUDA after the first step resumes in a fresh trainer with the same second step;
  5. the actor's sleep frees its GPU memory (parameters, gradients, AdamW state) and after wake the next
     step is the one without the sleep;
  6. GRPO with a KL term (the reference model on the GPU) and PPO (its critic on the GPU) train a step;
  7. --bf16 weights exported in the engines' float32 load with transformers and equal the masters.

``--bench`` then runs ``bench/memory/run.py --device cuda --no-search`` (peak bytes per parameter from the
CUDA allocator for the plain HF step, (a), (b) and (c) on the GPUs there are).

``--device cpu`` runs the same comparisons with the CPU standing in for the GPU: a dry run of the script itself
(what CI cannot run is then this script's own logic, not the backend's).

Exit status: 0 all checks passed, 1 a check failed, 77 not runnable here (no GPU): the reason is printed.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

from gpu_common import EXACT_ARITHMETIC, REPO, compare_bf16_steps, compare_steps, exact_float32, missing_gpu_stack, skip


def spec_for(model_dir: str, device: str, **fields):
    from tests.unit.test_rl_torch_backend import GROUP
    from vime.backends.torch_backend import TorchTrainerSpec
    from vime.config.algorithm import AlgorithmConfig

    algorithm = AlgorithmConfig(**fields.pop("algorithm", {}))
    algorithm.validate()
    return TorchTrainerSpec(
        hf_checkpoint=model_dir,
        lr=fields.pop("lr", 1e-3),
        weight_decay=0.0,
        adam_betas=(0.9, 0.999),
        adam_eps=1e-8,
        clip_grad=1.0,
        micro_batch_size=2,
        global_batch_size=2 * GROUP,
        n_samples_per_prompt=GROUP,
        rollout_temperature=1.0,
        algorithm=algorithm,
        seed=0,
        threads=1,
        device=device,
        **fields,
    )


def two_steps(model_dir: str, device: str, rollouts: list, **fields) -> list[dict]:
    from vime.backends.torch_backend import TorchBackend

    backend = TorchBackend(spec_for(model_dir, device, **fields))
    return [backend.train_rollout(samples, policy_version=0) for samples in rollouts]


def held_bytes(role) -> int:
    """Bytes of the role's parameters, gradients and optimizer state that live on an accelerator."""
    import torch

    tensors = list(role.module.parameters()) + [p.grad for p in role.module.parameters() if p.grad is not None]
    for state in role.optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    if role.masters is not None:
        tensors += list(role.masters.params)
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type != "cpu")


def check_sleep(model_dir: str, device: str, rollouts: list, failures: list[str]) -> None:
    import torch

    from vime.backends.torch_backend import TorchBackend

    want = two_steps(model_dir, device, rollouts)
    backend = TorchBackend(spec_for(model_dir, device))
    got = [backend.train_rollout(rollouts[0], policy_version=0)]
    if device == "cuda":
        torch.cuda.synchronize()
        before, held = torch.cuda.memory_allocated(), held_bytes(backend.actor)
        backend.actor.sleep()
        after = torch.cuda.memory_allocated()
        print(f"  sleep: {held} bytes of the actor on the GPU, allocated {before} -> {after}", flush=True)
        if before - after < 0.9 * held or held == 0:
            failures.append(f"sleep freed {before - after} bytes of the GPU, the actor held {held}")
        backend.actor.wake()
    got.append(backend.train_rollout(rollouts[1], policy_version=0))
    compare_steps("sleep, wake, next step vs no sleep", got, want, 1e-5, failures)


def check_resume(model_dir: str, device: str, rollouts: list, work: str, failures: list[str]) -> None:
    from vime.backends.torch_backend import TorchBackend

    for sharded in (False, True):
        fields = {"use_distributed_optimizer": True} if sharded else {}
        path = os.path.join(work, f"checkpoint-{'sharded' if sharded else 'plain'}")
        first = TorchBackend(spec_for(model_dir, device, **fields))
        first.train_rollout(rollouts[0], policy_version=0)
        first.save_training_state(path)
        want = [first.train_rollout(rollouts[1], policy_version=0)]
        resumed = TorchBackend(spec_for(model_dir, device, **fields))
        resumed.load_training_state(path)
        got = [resumed.train_rollout(rollouts[1], policy_version=0)]
        compare_steps(f"resume from a {'sharded ' if sharded else ''}checkpoint", got, want, 1e-5, failures)


def check_bf16(model_dir: str, device: str, rollouts: list, float32: list[dict], work: str, failures: list[str]):
    import torch
    from transformers import AutoModelForCausalLM

    from vime.backends.torch_backend import TorchBackend

    backend = TorchBackend(spec_for(model_dir, device, bf16=True, engine_dtype="float32", **EXACT_ARITHMETIC))
    got = [backend.train_rollout(samples, policy_version=0) for samples in rollouts]
    dtypes = {(p.dtype, p.device.type) for p in backend.model.parameters()}
    masters = {(p.dtype, p.device.type) for p in backend.actor.masters.params}
    print(f"  bf16: model {sorted(map(str, dtypes))}, masters {sorted(map(str, masters))}", flush=True)
    if dtypes != {(torch.bfloat16, device)} or masters != {(torch.float32, device)}:
        failures.append(f"bf16: model {dtypes}, masters {masters}; expected bf16 and float32 on {device}")
    compare_bf16_steps(got, float32, failures)
    exported = os.path.join(work, "exported")
    backend.save_weights(exported)
    loaded = AutoModelForCausalLM.from_pretrained(exported)
    masters_by_name = dict(zip(backend.actor.masters.names, backend.actor.masters.params))
    worst = max(
        float((masters_by_name[name].detach().cpu() - tensor).abs().max())
        for name, tensor in loaded.state_dict().items()
        if name in masters_by_name
    )
    kinds = {t.dtype for t in loaded.state_dict().values()}
    print(f"  bf16 export: dtypes {kinds}, largest difference from the masters {worst:.1e}", flush=True)
    if kinds != {torch.float32} or worst > 0:
        failures.append(f"bf16 export: dtypes {kinds}, differs from the masters by {worst}")


def check_algorithms(model_dir: str, device: str, rollouts: list, failures: list[str]) -> None:
    runs = {
        "GRPO + KL (reference model)": {"use_kl_loss": True, "kl_loss_coef": 0.1},
        "PPO (critic)": {"advantage_estimator": "ppo"},
    }
    for name, algorithm in runs.items():
        metrics = two_steps(model_dir, device, rollouts[:1], algorithm=algorithm)[0]
        finite = all(math.isfinite(float(v)) for v in metrics.values() if isinstance(v, (int, float)))
        print(f"  {name}: loss {metrics['loss']:.5f}", flush=True)
        if not finite:
            failures.append(f"{name}: a metric is not finite: {metrics}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run of the script")
    parser.add_argument("--bench", action="store_true", help="then bench/memory/run.py --device cuda --no-search")
    parser.add_argument("--bench-args", default="", help="more arguments for bench/memory/run.py")
    options = parser.parse_args(argv)
    if options.device == "cuda" and (reason := missing_gpu_stack()):
        return skip(reason)
    import torch
    from transformers import AutoModelForCausalLM

    from tests.unit.test_rl_torch_backend import make_samples
    from vime.tools.make_tiny_model import make_tiny_model

    exact_float32()
    started = time.monotonic()
    work = tempfile.mkdtemp(prefix="vime-torch-cuda-check-")
    failures: list[str] = []
    try:
        model_dir = make_tiny_model(
            os.path.join(work, "model"), hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128
        )
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        rollouts = [make_samples(model, seed=seed) for seed in (0, 1)]
        device = options.device
        print(f"device {device}: {torch.cuda.get_device_name() if device == 'cuda' else 'the CPU'}", flush=True)

        print("1. float32 on the device vs the CPU", flush=True)
        cpu = two_steps(model_dir, "cpu", rollouts, **EXACT_ARITHMETIC)
        plain = two_steps(model_dir, device, rollouts, **EXACT_ARITHMETIC)
        compare_steps("float32", plain, cpu, 1e-4, failures)

        print("2. token budgets, chunked log-probs, recompute vs plain", flush=True)
        budgets = two_steps(
            model_dir,
            device,
            rollouts,
            use_dynamic_batch_size=True,
            max_tokens_per_gpu=24,
            log_probs_chunk_size=5,
            recompute_granularity="full",
            **EXACT_ARITHMETIC,
        )
        # The log-prob gap is a mean of the micro-batches' means: other micro-batches, another mean.
        compare_steps("dynamic batch + chunked + recompute", budgets, plain, 1e-4, failures, keys=("loss", "grad_norm"))

        print("3. bf16 and its export", flush=True)
        check_bf16(model_dir, device, rollouts, plain, work, failures)
        print("4. checkpoint and resume", flush=True)
        check_resume(model_dir, device, rollouts, work, failures)
        print("5. sleep and wake", flush=True)
        check_sleep(model_dir, device, rollouts, failures)
        print("6. reference model and critic", flush=True)
        check_algorithms(model_dir, device, rollouts, failures)
        if device == "cuda":
            print(f"peak GPU memory allocated: {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"checks took {time.monotonic() - started:.0f}s", flush=True)

    if options.bench:
        command = [sys.executable, "bench/memory/run.py", "--device", options.device, "--no-search"]
        command += options.bench_args.split()
        print("$ " + " ".join(command), flush=True)
        path = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))  # and wheels carried there
        result = subprocess.run(command, cwd=REPO, env={**os.environ, "PYTHONPATH": path})
        if result.returncode != 0:
            failures.append(f"bench/memory/run.py exited with {result.returncode}")
    if failures:
        print("FAIL:\n  " + "\n  ".join(failures), flush=True)
        return 1
    print("PASS: the torch backend trains on the device as on the CPU", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
