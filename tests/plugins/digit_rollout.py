"""A custom --rollout-function-path used by the tests: it answers without any engine.

Half of each group answers the digit-shift prompt correctly, the other half repeats the prompt's
digits; the configured reward scores them. The seeds' signature and data-source calls are used
exactly as a user's function would use them.
"""

from vime.rollout.types import RolloutFnTrainOutput

_TOKENIZER = None


def generate_rollout(args, rollout_id, data_source, evaluation=False):
    global _TOKENIZER
    if _TOKENIZER is None:
        from vime.data.tokenizer import load_tokenizer  # AutoTokenizer's imports cost ~3.5 CPU-s a process

        _TOKENIZER = load_tokenizer(args.hf_checkpoint)
    groups = data_source.get_samples(2)
    for group in groups:
        for sample in group:
            digits = sample.prompt.rstrip("=")
            answer = sample.label if sample.index % 2 == 0 else digits
            ids = _TOKENIZER(answer, add_special_tokens=False)["input_ids"] + [_TOKENIZER.eos_token_id]
            sample.tokens = sample.tokens + ids
            sample.response_length = len(ids)
            sample.status = sample.Status.COMPLETED
    if rollout_id == 0 and len(groups) == 2:
        data_source.add_samples([groups.pop()])  # hand one group back: it must be regenerated, not lost
    return RolloutFnTrainOutput(samples=groups, metrics={"custom": 1.0})
