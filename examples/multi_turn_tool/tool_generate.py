"""A multi-turn, tool-using generate function (``--custom-generate-function-path``).

Turn 1: the model writes an expression for the calculator. The tool's answer is appended to the
sample as an observation (loss mask 0: the policy did not choose those tokens). Turn 2: the model
writes the final answer. Both turns go to the router with the sample's session id (header
``x-session-id``), so with ``--router-policy consistent_hash`` they reach the same engine, which
still holds the conversation's prefix in its KV cache.

    prompt      turn 1 (trained)   observation (masked)   turn 2 (trained)
    "12+7="     "12+7"   ...       "=19="                 "19"  ...
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from calculator import calculator

from vime.rollout.generate import append_observation, generate_turn
from vime.sample import Sample

TOOL_CALL_TOKENS = 6
ANSWER_TOKENS = 4
_TOKENIZERS: dict = {}


def tokenizer_of(args):
    if args.hf_checkpoint not in _TOKENIZERS:
        # AutoTokenizer's tokenizer, without its imports once vime has recorded the checkpoint's class (3.5 CPU-s
        # less for each rollout worker's process): vime/data/tokenizer.py
        from vime.data.tokenizer import load_tokenizer

        _TOKENIZERS[args.hf_checkpoint] = load_tokenizer(args.hf_checkpoint)
    return _TOKENIZERS[args.hf_checkpoint]


def first_field(text: str) -> str:
    """The text up to the first '=' or end of sequence."""
    return text.split("<|endoftext|>", 1)[0].split("=", 1)[0]


async def generate(args, sample: Sample, sampling_params: dict) -> Sample:
    tokenizer = tokenizer_of(args)
    if sample.response_length:  # a continuation (--partial-rollout): this example starts over instead
        del sample.tokens[sample.prompt_length :]
        sample.response_length, sample.weight_versions, sample.rollout_log_probs, sample.loss_mask = 0, [], None, None
    # Turn 1: the tool call.
    call = await generate_turn(args, sample, sampling_params, max_new_tokens=TOOL_CALL_TOKENS)
    if sample.status is Sample.Status.ABORTED:
        return sample  # a weight update interrupted it: the group goes back to the queue
    expression = first_field(tokenizer.decode(call.token_ids))
    result = calculator(expression)
    append_observation(sample, tokenizer(f"={result}=", add_special_tokens=False)["input_ids"])
    # Turn 2: the answer, on the same session.
    answer = await generate_turn(args, sample, sampling_params, max_new_tokens=ANSWER_TOKENS)
    if sample.status is Sample.Status.ABORTED:
        return sample
    sample.response = tokenizer.decode(sample.response_tokens)
    sample.metadata = {
        **sample.metadata,
        "turns": 2,
        "tool_call": expression,
        "tool_result": result,
        "answer": first_field(tokenizer.decode(answer.token_ids)),
    }
    return sample
