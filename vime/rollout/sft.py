"""An SFT rollout function: the data's own conversations become training samples, nothing is generated.

    vime train --rollout-function-path vime.rollout.sft.generate_rollout --loss-type sft_loss \
        --apply-chat-template --n-samples-per-prompt 1 --prompt-data chats.jsonl --input-key messages ...

Each record's ``--input-key`` is a list of chat messages; assistant turns are trained unless a message
says ``"step_loss_mask": 0`` (see :func:`vime.data.prompt.sft_tokens`).
"""

from __future__ import annotations

from vime.data.prompt import sft_tokens
from vime.rollout.types import RolloutFnTrainOutput
from vime.sample import Status

_TOKENIZERS: dict[str, object] = {}


def _tokenizer(path: str):
    if path not in _TOKENIZERS:
        from vime.data.tokenizer import load_tokenizer

        _TOKENIZERS[path] = load_tokenizer(path)
    return _TOKENIZERS[path]


def generate_rollout(args, rollout_id, data_source, evaluation=False) -> RolloutFnTrainOutput:
    tokenizer = _tokenizer(args.hf_checkpoint)
    groups = data_source.get_samples(args.rollout_batch_size)
    for group in groups:
        for sample in group:
            tokens, response_length, loss_mask = sft_tokens(
                tokenizer, sample.prompt, getattr(args, "apply_chat_template_kwargs", None)
            )
            sample.tokens, sample.response_length, sample.loss_mask = tokens, response_length, loss_mask
            sample.response = tokenizer.decode(tokens[len(tokens) - response_length :])
            sample.reward, sample.status = 0.0, Status.COMPLETED
    return RolloutFnTrainOutput(samples=groups)
