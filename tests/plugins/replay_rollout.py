"""An engine-free --rollout-function-path whose samples fill every stored field.

Used by the debug-replay and export tests: besides tokens and a reward, each sample carries
sampler log-probs, a loss mask with a masked token, metadata, and R3 / top-k captures (uint8,
int32 and float32 tensors), so that an archive or an export that drops or changes any of them
fails. Everything is a pure function of (prompt, sample index).
"""

import zlib

import torch

from vime.rollout.types import RolloutFnTrainOutput

_TOKENIZER = None
LAYERS, TOPK = 2, 3


def generate_rollout(args, rollout_id, data_source, evaluation=False):
    global _TOKENIZER
    if _TOKENIZER is None:
        from vime.data.tokenizer import load_tokenizer  # AutoTokenizer's imports cost ~3.5 CPU-s a process

        _TOKENIZER = load_tokenizer(args.hf_checkpoint)
    groups = data_source.get_samples(2)
    for group in groups:
        for sample in group:
            seed = zlib.crc32(f"{sample.prompt}/{sample.index}".encode())
            answer = sample.label if sample.index % 2 == 0 else sample.prompt.rstrip("=")  # every group learns
            ids = _TOKENIZER(answer, add_special_tokens=False)["input_ids"] + [_TOKENIZER.eos_token_id]
            generator = torch.Generator().manual_seed(seed)
            log_probs = (-torch.rand(len(ids), generator=generator)).tolist()  # float32 values as floats
            sample.tokens = sample.tokens + ids
            sample.response_length = len(ids)
            sample.rollout_log_probs = log_probs
            sample.loss_mask = [1] * (len(ids) - 1) + [0]  # weight versions: the worker's current one
            sample.status = sample.Status.COMPLETED
            sample.metadata = {**sample.metadata, "seed": seed, "tags": ["replay", sample.index]}
            sample.rollout_routed_experts = torch.randint(
                0, 8, (len(sample.tokens) - 1, LAYERS, TOPK), dtype=torch.uint8, generator=generator
            )
            sample.rollout_topk_token_ids = torch.randint(
                0, 11, (len(ids), TOPK), dtype=torch.int32, generator=generator
            )
            sample.rollout_topk_log_probs = -torch.rand((len(ids), TOPK), generator=generator)
    return RolloutFnTrainOutput(samples=groups)
