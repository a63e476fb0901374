"""GPU check of the main job with --train-backend megatron and the official (CUDA) vLLM. Not a pytest file.

    python tests/gpu/check_megatron_main_job.py [--num-rollout 40] [--packing auto|thd|padded] [--keep DIR]
    python tests/gpu/check_megatron_main_job.py --moe-r3 [--min-gain 0.1]
    python tests/gpu/check_megatron_main_job.py --trainer-ranks 2 --tensor-parallel 2   # 3+ GPUs
    python tests/gpu/check_megatron_main_job.py --trainer-ranks 2 --pipeline-parallel 2   # 3+ GPUs
    python tests/gpu/check_megatron_main_job.py --trainer-ranks 2 --context-parallel 2 --packing padded  # 3+ GPUs
    python tests/gpu/check_megatron_main_job.py --moe-r3 --trainer-ranks 2 --expert-parallel 2   # 3+ GPUs
    python tests/gpu/check_megatron_main_job.py --moe-r3 --trainer-ranks 2 --expert-tensor-parallel 2   # 3+ GPUs

Needs one CUDA GPU, the official vLLM and megatron-core (``pip install -e '.[gpu,dev]'``). It

1. builds vime's tiny Qwen2 (``vime tools make-tiny-model``);
2. runs the main job (the digit-shift demo of ``examples/digit_shift/run_demo.py``: fully-asynchronous
   GRPO over the straw queue, one vLLM engine) with ``--train-backend megatron`` and the flags of
   ``scripts/models/qwen2-tiny.sh``; the trainer and the engine share the GPU
   (``--vllm-gpu-memory-utilization 0.3``);
3. checks that the run succeeded, that the held-out reward rose by at least ``--min-gain`` between the
   first and the last evaluation (the torch backend goes 0.09 -> 0.59 in 40 rollouts on this task),
   that the engine served the weights the trainer published (on-policy log-prob difference), that the
   checkpoint holds the Megatron state beside vime's (``iter_XXXXXXX/`` with ``*.distcp`` and
   ``vime_state.json``), that ``hf_final/`` loads with transformers, and that
   ``vime tools convert-megatron-to-hf`` of the run's ``--save`` directory gives ``hf_final``'s tensors
   exactly (the last checkpoint is the final model).

``--moe-r3`` runs the same job on a tiny random Qwen3-MoE (4 experts, top-2) with
``--use-rollout-routing-replay``: the engine runs with ``--enable-return-routed-experts`` and vLLM's V2
model runner, every accepted sample must carry its routes ([len(tokens) - 1, layers, 2] expert ids
below 4), and the Megatron forward replays them (the on-policy log-prob check then also covers routing).

The actor starts from ``--hf-checkpoint`` (converted in memory), not from ``--ref-load``: vime's
algorithm checks still accept only an HF folder there, and only with a KL term.

``--trainer-ranks N`` trains on N Megatron ranks (``--actor-num-gpus-per-node N``, one GPU each, beside the
engine's GPU), with ``--tensor-parallel T`` as ``--tensor-model-parallel-size`` (the rest are data-parallel
replicas; docs/parallelism.md), ``--pipeline-parallel P`` as ``--pipeline-model-parallel-size`` (the tiny
Qwen2's two layers over P stages), ``--context-parallel C`` as ``--context-parallel-size`` (each sequence
split over C ranks; padded micro-batches), or ``--expert-parallel E`` as ``--expert-model-parallel-size`` (with
``--moe-r3``: the experts spread over E ranks). It needs N + 1 GPUs.

Ray normally hides the GPU from actors that reserve none; the run is started with
``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`` so that the trainer actor sees it.

Exit status: 0 all checks passed, 1 a check failed, 77 not runnable here (no GPU, no vLLM, no
megatron-core): the reason is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

from gpu_common import REPO, demo_args, missing_gpu_stack, run_vime_train, set_flag, skip


def preset_flags(name: str) -> list[str]:
    path = os.path.join(REPO, "scripts", "models", name)
    out = subprocess.run(
        ["bash", "-c", f'source "{path}" && printf "%s\\n" "${{MODEL_ARGS[@]}}"'],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return out.split()


MOE_FLAGS = [
    "--swiglu",
    "--num-layers",
    "2",
    "--hidden-size",
    "128",
    "--ffn-hidden-size",
    "256",
    "--num-attention-heads",
    "4",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--kv-channels",
    "32",
    "--qk-layernorm",
    "--use-rotary-position-embeddings",
    "--disable-bias-linear",
    "--normalization",
    "RMSNorm",
    "--norm-epsilon",
    "1e-6",
    "--untie-embeddings-and-output-weights",
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-ffn-hidden-size",
    "128",
    "--moe-layer-freq",
    "1",
]


def make_tiny_moe(folder: str) -> int:
    """A random Qwen3-MoE of the sizes of MOE_FLAGS with vime's character tokenizer; its vocabulary size."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from vime.tools.make_tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    config = AutoConfig.for_model(
        "qwen3_moe",
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        dtype="float32",
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return len(tokenizer)


def check_routes(run_dir: str) -> list[str]:
    """Every accepted sample carries the experts its tokens were routed to."""
    import numpy as np

    from tests.e2e.test_main_job import read_accepted_groups

    samples = [s for group in read_accepted_groups(run_dir) for s in group]
    bad = []
    for s in samples:
        routes = None if s.rollout_routed_experts is None else np.asarray(s.rollout_routed_experts)
        if routes is None or routes.shape != (len(s.tokens) - 1, 2, 2) or routes.max() >= 4:
            bad.append(
                f"group {s.group_index} sample {s.index}: routes "
                f"{None if routes is None else routes.shape} for {len(s.tokens)} tokens"
            )
    print(f"routes recorded on {len(samples) - len(bad)} of {len(samples)} accepted samples")
    return bad[:5] if samples else ["no accepted sample"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-rollout", type=int, default=40)
    parser.add_argument("--min-gain", type=float, default=0.2, help="held-out reward rise required")
    parser.add_argument("--packing", choices=("auto", "thd", "padded"), default="auto")
    parser.add_argument(
        "--keep", help="run in this folder and keep it (default: a temporary folder, removed on success)"
    )
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--moe-r3", action="store_true", help="a tiny Qwen3-MoE with --use-rollout-routing-replay")
    parser.add_argument("--trainer-ranks", type=int, default=1, help="Megatron trainer ranks, one GPU each")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="--tensor-model-parallel-size of the ranks")
    parser.add_argument("--pipeline-parallel", type=int, default=1, help="--pipeline-model-parallel-size of the ranks")
    parser.add_argument("--context-parallel", type=int, default=1, help="--context-parallel-size of the ranks")
    parser.add_argument("--expert-parallel", type=int, default=1, help="--expert-model-parallel-size (with --moe-r3)")
    parser.add_argument(
        "--expert-tensor-parallel", type=int, default=None, help="--expert-tensor-parallel-size (with --moe-r3)"
    )
    options = parser.parse_args(argv)

    # Several ranks take a GPU each, beside the engine's.
    gpus = 1 if options.trainer_ranks == 1 else options.trainer_ranks + 1
    if reason := missing_gpu_stack("megatron.core", "vllm", gpus=gpus):
        return skip(reason)
    import torch

    work = options.keep or tempfile.mkdtemp(prefix="vime-megatron-check-")
    os.makedirs(work, exist_ok=True)
    model, converted, run_dir = (os.path.join(work, n) for n in ("tiny-qwen2", "converted-hf", "run"))
    shutil.rmtree(run_dir, ignore_errors=True)
    env = {**os.environ, "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1", "PYTHONPATH": REPO}
    vime = [sys.executable, "-m", "vime.cli"]
    if options.moe_r3:
        model_flags = MOE_FLAGS + ["--vocab-size", str(make_tiny_moe(model)), "--use-rollout-routing-replay"]
    else:
        subprocess.run(vime + ["tools", "make-tiny-model", model], check=True, cwd=REPO, env=env)
        model_flags = preset_flags("qwen2-tiny.sh")

    args = demo_args(run_dir, model)
    set_flag(args, "--num-rollout", str(options.num_rollout))
    set_flag(args, "--eval-interval", str(max(1, options.num_rollout // 2)))
    set_flag(args, "--eval-temperature", "0")  # calibrated on greedy held-out reward
    set_flag(args, "--save-interval", str(max(1, options.num_rollout // 2)))
    args += [
        "--train-backend",
        "megatron",
        *model_flags,
        "--ckpt-format",
        "torch_dist",
        "--megatron-packing",
        options.packing,
        "--vllm-gpu-memory-utilization",
        "0.3",
    ]
    if options.trainer_ranks > 1:
        # Two replicas share each step's micro-batches: the global batch must split evenly.
        args += [
            "--actor-num-gpus-per-node",
            str(options.trainer_ranks),
            "--tensor-model-parallel-size",
            str(options.tensor_parallel),
            "--micro-batch-size",
            "8",
            "--pipeline-model-parallel-size",
            str(options.pipeline_parallel),
            "--context-parallel-size",
            str(options.context_parallel),
            "--expert-model-parallel-size",
            str(options.expert_parallel),
        ]
        if options.expert_tensor_parallel is not None:
            args += ["--expert-tensor-parallel-size", str(options.expert_tensor_parallel)]
    failures = run_vime_train(args, env=env, timeout=options.timeout)
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    records = [json.loads(line) for line in open(metrics_path)] if os.path.exists(metrics_path) else []
    evals = [r for r in records if r.get("kind") == "eval"]
    train = [r for r in records if r.get("kind") == "train"]
    if len(evals) < 2:
        failures.append(f"{len(evals)} evaluation(s) recorded, expected at least 2")
    else:
        first, last = evals[0]["eval_reward"], evals[-1]["eval_reward"]
        print(f"held-out reward: {first:.3f} (step {evals[0]['step']}) -> {last:.3f} (step {evals[-1]['step']})")
        if last < first + options.min_gain:
            failures.append(f"held-out reward rose by {last - first:.3f} < {options.min_gain}")
    if len(train) != options.num_rollout:
        failures.append(f"{len(train)} training step(s) recorded, expected {options.num_rollout}")
    on_policy = [r["onpolicy_logprob_abs_diff"] for r in train if "onpolicy_logprob_abs_diff" in r]
    if on_policy:
        print(f"on-policy |log p_vllm - log p_megatron|: max {max(on_policy):.2e}")
        if max(on_policy) > 0.05:  # GPU kernels differ a little; a weight-naming bug gives O(1)
            failures.append(
                f"the engine's log-probs differ from the trainer's by {max(on_policy):.3f}: "
                "the published weights are not the trained ones"
            )
    else:
        failures.append("no step trained on samples generated entirely by the trained weights")
    if options.moe_r3 and os.path.isdir(os.path.join(run_dir, "rollout_data")):
        failures += check_routes(run_dir)
    save = os.path.join(run_dir, "checkpoints")
    latest = os.path.join(save, "latest_checkpointed_iteration.txt")
    if not os.path.exists(latest):
        failures.append(f"no {latest}")
    else:
        step = os.path.join(save, f"iter_{int(open(latest).read()):07d}")
        names = os.listdir(step) if os.path.isdir(step) else []
        if "vime_state.json" not in names or not any(n.endswith(".distcp") for n in names):
            failures.append(f"{step} lacks vime_state.json or the torch_dist shards: {sorted(names)[:10]}")
    try:
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(os.path.join(run_dir, "hf_final"))
    except Exception as error:  # noqa: BLE001 - the check reports any failure to load, whatever it is
        failures.append(f"hf_final does not load: {type(error).__name__}: {error}")
    if os.path.exists(latest):
        conversion = subprocess.run(
            vime
            + [
                "tools",
                "convert-megatron-to-hf",
                "--load",
                save,
                "--save",
                converted,
                "--hf-config",
                model,
                "--dtype",
                "float32",
            ],
            cwd=REPO,
            env=env,
        )
        if conversion.returncode != 0:
            failures.append("convert-megatron-to-hf of the run's checkpoint failed")
        else:
            from vime.backends.megatron_convert import read_hf_state_dict

            final, back = read_hf_state_dict(os.path.join(run_dir, "hf_final")), read_hf_state_dict(converted)
            differ = sorted(n for n in final if n not in back or not torch.equal(final[n], back[n].to(final[n].dtype)))
            if differ or final.keys() != back.keys():
                failures.append(f"the converted checkpoint differs from hf_final: {differ[:5]}")

    if failures:
        print("FAIL:\n  " + "\n  ".join(failures) + f"\nrun directory kept: {run_dir}", flush=True)
        return 1
    print(
        "PASS: the Megatron backend learns the digit-shift task with vLLM on one GPU"
        + (" (Qwen3-MoE, routes replayed)" if options.moe_r3 else ""),
        flush=True,
    )
    if not options.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
