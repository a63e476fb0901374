"""GPU check of --update-weight-transport nccl against the official (CUDA) vLLM. Not a pytest file.

    python tests/gpu/check_nccl_weights.py [--keep-logs DIR]

Needs two GPUs (NCCL refuses two ranks of one group on the same GPU): this process is the trainer
(rank 0, GPU 0) and one vLLM engine runs on GPU 1 with vime's worker extension (rank 1). It

1. starts vLLM on a tiny float32 Qwen2 model,
2. forms the NCCL group (``vime_join_weight_group`` on the engine, ``NcclWeightSender.open`` here),
3. changes the trainer's weights with an AdamW step and broadcasts them while the engine is
   paused (``swap_engine_weights``: pause, receive, flush, label version 1, resume),
4. checks bit for bit: the bytes each engine worker received (sha256 per tensor) equal the
   trainer's, and every parameter of vLLM's model equals the trainer's (vLLM's fused
   ``qkv_proj``/``gate_up_proj`` compared with the concatenation of the trainer's tensors),
5. checks that generation carries weight version "1", and compares its greedy tokens with HF
   transformers' on the trainer's weights (a difference is printed as a warning: the kernels differ).

Exit status: 0 all checks passed, 1 a check failed, 77 not runnable here (fewer than 2 GPUs, no
vLLM): the reason is printed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
import uuid

from gpu_common import missing_gpu_stack, skip


def in_thread(function):
    """Run ``function`` in a thread; returns join() -> its result (or raises its exception)."""
    box: dict = {}

    def run():
        try:
            box["result"] = function()
        except BaseException as error:  # noqa: BLE001 - handed to the caller of join
            box["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def join(timeout: float = 600):
        thread.join(timeout)
        if thread.is_alive():
            raise TimeoutError(f"{function} did not finish in {timeout}s")
        if "error" in box:
            raise box["error"]
        return box["result"]

    return join


def expected_vllm_params(trainer_params: dict, vllm_names: list[str]) -> dict:
    """The tensor each vLLM parameter should hold, from the trainer's (HF-named) tensors."""
    import torch

    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    expected = {}
    for name in vllm_names:
        for packed, parts in fused.items():
            if f".{packed}." in name:
                expected[name] = torch.cat([trainer_params[name.replace(packed, part)] for part in parts], dim=0)
                break
        else:
            if name in trainer_params:
                expected[name] = trainer_params[name]
    return expected


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep-logs", help="write the engine log here (default: a temporary folder)")
    parser.add_argument("--startup-timeout", type=float, default=600)
    options = parser.parse_args(argv)

    # NCCL refuses two ranks on one device: the trainer and the engine need a GPU each.
    if reason := missing_gpu_stack("vllm", gpus=2):
        return skip(reason)
    import torch
    from transformers import AutoModelForCausalLM

    from vime.engines.vllm_server import EngineClient, VllmServer, swap_engine_weights
    from vime.runtime.process import kill_processes_with_token
    from vime.tools.make_tiny_model import make_tiny_model
    from vime.weights import nccl

    work = tempfile.mkdtemp(prefix="vime-nccl-check-")
    model_dir = make_tiny_model(os.path.join(work, "model"))
    log_dir = options.keep_logs or work
    os.makedirs(log_dir, exist_ok=True)
    token = f"nccl-check-{uuid.uuid4()}"
    server = VllmServer(
        model_dir,
        log_path=os.path.join(log_dir, "vllm.log"),
        run_token=token,
        vllm_args={
            "max-model-len": "64",
            "enforce-eager": None,
            "dtype": "float32",
            "gpu-memory-utilization": "0.3",
            "worker-extension-cls": nccl.WORKER_EXTENSION,
        },
        env={"CUDA_VISIBLE_DEVICES": "1"},
    )
    failures: list[str] = []
    try:
        started = time.monotonic()
        server.start()
        server.wait_healthy(timeout=options.startup_timeout)
        print(f"engine healthy after {time.monotonic() - started:.0f}s ({server.url})", flush=True)
        client = EngineClient(server.url, timeout=300)
        client.update_weight_version(0)

        # The trainer: GPU 0, weights changed by one AdamW step.
        torch.cuda.set_device(0)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ids = torch.randint(0, 12, (4, 12), device="cuda")
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        named = list(model.named_parameters())

        address, port, world_size = "127.0.0.1", _free_port(), 2
        joined = in_thread(
            lambda: client.collective_rpc(
                "vime_join_weight_group",
                {"master_address": address, "master_port": port, "rank_offset": 1, "world_size": world_size},
            )
        )
        sender = nccl.NcclWeightSender(device=0)
        sender.open(address, port, world_size)
        joined()
        metadata = nccl.tensor_metadata(named)
        print(f"NCCL group formed; sending {len(metadata)} tensors", flush=True)

        received = in_thread(
            lambda: swap_engine_weights(
                client,
                1,
                True,
                lambda: client.collective_rpc(
                    "vime_receive_weights", {"metadata": nccl.encode_metadata(metadata), "checksums": True}
                ),
            )
        )
        report = sender.send(named, metadata)
        results = received()
        print(f"sent {int(report['bytes'])} bytes", flush=True)

        # 1. The bytes on the wire.
        sent = {name: nccl.tensor_sha256(tensor) for name, tensor in named}
        for worker, result in enumerate(results):
            if not isinstance(result, dict) or result.get("checksums") != sent:
                bad = (
                    [n for n in sent if (result or {}).get("checksums", {}).get(n) != sent[n]]
                    if isinstance(result, dict)
                    else ["(no result)"]
                )
                failures.append(f"worker {worker}: received bytes differ for {bad[:5]}")

        # 2. The bytes in vLLM's model.
        served = client.collective_rpc("vime_param_checksums")[0]
        trainer_params = {name: tensor.detach() for name, tensor in model.named_parameters()}
        expected = expected_vllm_params(trainer_params, list(served))
        missing = sorted(set(served) - set(expected))
        if missing:
            failures.append(f"vLLM parameters with no trainer counterpart: {missing[:5]}")
        wrong = [n for n, tensor in expected.items() if nccl.tensor_sha256(tensor) != served[n]]
        if wrong:
            failures.append(f"vLLM parameters that differ from the trainer's: {wrong[:5]}")
        print(f"{len(served)} vLLM parameters compared, {len(wrong)} differ", flush=True)

        # 3. Generation follows the new weights.
        prompt = [4, 8, 2, 11]
        choice = client.generate(prompt, {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True})
        hf = (
            model.eval()
            .generate(torch.tensor([prompt], device="cuda"), max_new_tokens=8, do_sample=False, min_new_tokens=8)[
                0, len(prompt) :
            ]
            .tolist()
        )
        if choice["token_ids"] != hf:  # kernels differ: informative, not a failure of the transport
            print(f"WARN: greedy tokens {choice['token_ids']} differ from HF's {hf}", flush=True)
        if choice.get("weight_versions") != [{"version": "1", "start": 0, "end": 8}]:
            failures.append(f"weight versions {choice.get('weight_versions')}")
        client.collective_rpc("vime_leave_weight_group")
        sender.close()
    except Exception as error:  # noqa: BLE001 - report, then fail
        failures.append(f"{type(error).__name__}: {error}")
    finally:
        server.stop()
        kill_processes_with_token(token)
    for failure in failures:
        print(f"FAIL: {failure}", flush=True)
    if failures:
        print(f"engine log: {os.path.join(log_dir, 'vllm.log')}", flush=True)
        return 1
    print("OK: weights arrived bit for bit over NCCL", flush=True)
    return 0


def _free_port() -> int:
    from vime.runtime.ports import free_port

    return free_port("127.0.0.1")


if __name__ == "__main__":
    sys.exit(main())
