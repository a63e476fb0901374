"""An engine-free --rollout-function-path for the fault-injection tests.

Each call leases a few prompts and answers them after a short pause (so that kills land while
groups are in flight). Whether a sample answers right is a pure function of (prompt, sample index):
a regenerated group has the same content, which keeps the invariants checkable.
"""

import time
import zlib

from vime.rollout.types import RolloutFnTrainOutput

_TOKENIZER = None


def generate_rollout(args, rollout_id, data_source, evaluation=False):
    global _TOKENIZER
    if _TOKENIZER is None:
        from vime.data.tokenizer import load_tokenizer  # AutoTokenizer's imports cost ~3.5 CPU-s a process

        _TOKENIZER = load_tokenizer(args.hf_checkpoint)
    groups = data_source.get_samples(2)
    time.sleep(0.05)
    for group in groups:
        for sample in group:
            digits = sample.prompt.rstrip("=")
            right = zlib.crc32(f"{sample.prompt}/{sample.index}".encode()) % 2 == 0
            answer = sample.label if right else digits
            ids = _TOKENIZER(answer, add_special_tokens=False)["input_ids"] + [_TOKENIZER.eos_token_id]
            sample.tokens = sample.tokens + ids
            sample.response_length = len(ids)
            sample.status = sample.Status.COMPLETED
    return RolloutFnTrainOutput(samples=groups)
