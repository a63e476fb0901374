"""Convert checkpoints between Hugging Face and Megatron (Qwen2, Qwen3, Llama).

    vime tools convert-hf-to-megatron --hf-checkpoint HF --save OUT [--ckpt-format torch_dist|torch]
    vime tools convert-megatron-to-hf --load MEGATRON [--ckpt-step N] --save OUT --hf-config HF [--dtype auto]

HF -> Megatron writes ``OUT/iter_0000000/`` and ``OUT/latest_checkpointed_iteration.txt``: pass ``OUT`` as
``--ref-load`` of a Megatron-backend run (the actor starts from it, and it is the KL reference). The
model architecture comes from the HF ``config.json``. ``torch_dist`` (default) loads with any tensor
parallelism; ``torch`` is written for tensor parallelism 1.

Megatron -> HF reads either format (any tensor-parallel size for ``torch_dist``; ``torch`` shards of
several tensor-parallel ranks are merged), takes the architecture from ``--hf-config`` (an HF folder
with config.json), and writes HF-named safetensors plus that folder's config and tokenizer files.
A vime ``--save`` directory of a Megatron-backend run is a Megatron checkpoint directory.

Conversion runs on CPU; ``torch_dist`` goes through megatron-core (``pip install megatron-core``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Sequence

import torch

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _hf_args(folder: str):
    from transformers import AutoConfig

    from vime.backends.megatron_args import model_args_from_hf

    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise SystemExit(f"{folder}: not an HF model folder (no config.json)")
    config = AutoConfig.from_pretrained(folder)
    return config, model_args_from_hf(config)


def _build_tp1_model(args, divisible_by: int):
    from vime.backends import megatron_model as mm

    mm.init_parallel(mm.Parallelism())
    return mm.build_gpt_model(args, mm.Parallelism(), vocab_divisible_by=divisible_by, use_te=False, initialize=False)


def hf_to_megatron(hf_checkpoint: str, save: str, *, ckpt_format: str = "torch_dist", divisible_by: int = 128) -> str:
    """Write the Megatron checkpoint of ``hf_checkpoint`` under ``save``; returns the step folder."""
    from vime.backends import megatron_checkpoint as mc
    from vime.backends.megatron_convert import hf_to_mcore, pad_vocab, read_hf_state_dict

    _, args = _hf_args(hf_checkpoint)
    canonical = hf_to_mcore(read_hf_state_dict(hf_checkpoint), args)
    folder = mc.iteration_folder(save, 0)
    if os.path.exists(folder):
        shutil.rmtree(folder)
    os.makedirs(folder)
    meta = {
        **args.to_dict(),
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
        "make_vocab_size_divisible_by": divisible_by,
        "padded_vocab_size": args.padded_vocab_size(divisible_by, 1),
        "hf_checkpoint": hf_checkpoint,
    }
    if ckpt_format == "torch":
        os.makedirs(os.path.join(folder, "mp_rank_00"))
        state = {
            "model": pad_vocab({k: v.float() for k, v in canonical.items()}, meta["padded_vocab_size"]),
            "optimizer": None,
            "rng_state": None,
            "iteration": 0,
            "args": meta,
            "checkpoint_version": mc.CHECKPOINT_VERSION,
            "vime": {"has_optimizer": False},
        }
        torch.save(state, os.path.join(folder, "mp_rank_00", "model_optim_rng.pt"))
    elif ckpt_format == "torch_dist":
        from vime.backends.megatron_weights import load_canonical

        gpt = _build_tp1_model(args, divisible_by)
        load_canonical(gpt, canonical, args)
        mc.save(folder, gpt, None, fmt="torch_dist", iteration=0, args=meta)
    else:
        raise SystemExit(f"--ckpt-format {ckpt_format!r}: expected torch or torch_dist")
    mc.write_latest(save, 0)
    return folder


def megatron_to_hf(
    load: str, save: str, hf_config: str, *, ckpt_step: int | None = None, dtype: str = "auto", divisible_by: int = 128
) -> str:
    """Write the HF model of the Megatron checkpoint ``load`` (architecture from ``hf_config``) to ``save``."""
    from vime.backends import megatron_checkpoint as mc
    from vime.backends.megatron_convert import (
        mcore_to_hf,
        merge_tp_shards,
        untrained_hf_tensors,
        write_hf_safetensors,
    )

    config, args = _hf_args(hf_config)
    folder = mc.resolve_step_folder(load, ckpt_step)
    if mc.checkpoint_format(folder) == "torch":
        ranks = sorted(n for n in os.listdir(folder) if n.startswith("mp_rank_"))
        if any(len(n.split("_")) > 3 for n in ranks):
            raise SystemExit(f"{folder}: pipeline-parallel 'torch' checkpoints ({ranks}) are not supported")
        shards = [
            torch.load(os.path.join(folder, n, "model_optim_rng.pt"), map_location="cpu", weights_only=False)["model"]
            for n in ranks
        ]
        canonical = merge_tp_shards(shards, args)
    else:
        from vime.backends.megatron_weights import gather_canonical

        gpt = _build_tp1_model(args, divisible_by)
        mc.load(folder, gpt)
        canonical = gather_canonical(gpt, args)
    if dtype == "auto":
        name = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32")
        target = _DTYPES.get(name.replace("torch.", ""), torch.float32)
    else:
        target = _DTYPES[dtype]
    os.makedirs(save, exist_ok=True)
    hf = {k: v.to(target) for k, v in mcore_to_hf(canonical, args).items()}
    # What the Megatron model does not hold (a vision tower, MTP layers) comes unchanged from hf_config's own weights
    # where that folder has them: the output is then a whole checkpoint.
    write_hf_safetensors({**hf, **untrained_hf_tensors(hf_config, args, mtp_layers=True)}, save)
    for name in sorted(os.listdir(hf_config)):
        source = os.path.join(hf_config, name)
        if os.path.isfile(source) and not name.endswith(_WEIGHT_SUFFIXES):
            shutil.copyfile(source, os.path.join(save, name))  # config, generation config, tokenizer
    return save


def main_hf_to_megatron(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="vime tools convert-hf-to-megatron",
        description="Convert an HF Qwen2/Qwen3/Llama checkpoint to a Megatron checkpoint.",
    )
    p.add_argument("--hf-checkpoint", required=True, help="HF model folder (config.json + safetensors)")
    p.add_argument("--save", required=True, help="Megatron checkpoint directory to write (iter_0000000/)")
    p.add_argument("--ckpt-format", choices=("torch_dist", "torch"), default="torch_dist")
    p.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="pad the vocabulary to a multiple of this (as the training run's flag)",
    )
    a = p.parse_args(argv)
    folder = hf_to_megatron(
        a.hf_checkpoint, a.save, ckpt_format=a.ckpt_format, divisible_by=a.make_vocab_size_divisible_by
    )
    print(folder)
    return 0


def main_megatron_to_hf(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="vime tools convert-megatron-to-hf",
        description="Convert a Megatron checkpoint (torch or torch_dist) to an HF model.",
    )
    p.add_argument("--load", required=True, help="Megatron checkpoint directory (or one iter_XXXXXXX/ folder)")
    p.add_argument("--ckpt-step", type=int, default=None, help="step to convert (default: the latest)")
    p.add_argument("--save", required=True, help="HF model folder to write")
    p.add_argument(
        "--hf-config",
        required=True,
        help="HF folder whose config.json describes the model; its config and tokenizer files are copied",
    )
    p.add_argument(
        "--dtype",
        choices=("auto", *_DTYPES),
        default="auto",
        help="tensor dtype written (auto: the dtype of --hf-config's config.json)",
    )
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    a = p.parse_args(argv)
    print(
        megatron_to_hf(
            a.load,
            a.save,
            a.hf_config,
            ckpt_step=a.ckpt_step,
            dtype=a.dtype,
            divisible_by=a.make_vocab_size_divisible_by,
        )
    )
    return 0


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command == "hf-to-megatron":
        sys.exit(main_hf_to_megatron(sys.argv[2:]))
    if command == "megatron-to-hf":
        sys.exit(main_megatron_to_hf(sys.argv[2:]))
    print("usage: python -m vime.tools.convert_checkpoint hf-to-megatron|megatron-to-hf ...", file=sys.stderr)
    sys.exit(2)
