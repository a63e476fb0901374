"""Engine-free hooks for tests/integration/test_data_hooks_run.py: a custom data source, a rollout
function, an eval function, exercised together through `vime train --rollout-num-gpus 0`.

ParitySource: 12 digit-shift prompts; even rows come from source "even", odd rows from "odd".
generate_rollout: every sample of an "even" group answers correctly (all rewards equal: the
nonzero-std dynamic filter must drop the group); in an "odd" group half answer correctly.
evaluate: answers the held-out prompts of source "known" correctly and the others with nothing.
"""

from vime.rollout.types import RolloutFnEvalOutput, RolloutFnTrainOutput
from vime.sample import Sample

_TOKENIZER = None


def shift(digits: str) -> str:
    return "".join(str((int(d) + 1) % 10) for d in digits)


class ParitySource:
    def __init__(self, args):
        self.rows = [f"{(i * 37) % 1000:03d}" for i in range(12)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        digits = self.rows[index]
        return Sample(prompt=f"{digits}=", label=shift(digits), source="even" if index % 2 == 0 else "odd")


def _tokenizer(args):
    global _TOKENIZER
    if _TOKENIZER is None:
        from vime.data.tokenizer import load_tokenizer  # AutoTokenizer's imports cost ~3.5 CPU-s a process

        _TOKENIZER = load_tokenizer(args.hf_checkpoint)
    return _TOKENIZER


def generate_rollout(args, rollout_id, data_source, evaluation=False):
    tokenizer = _tokenizer(args)
    groups = data_source.get_samples(2)
    for group in groups:
        for sample in group:
            right = sample.source == "even" or sample.index % 2 == 0
            answer = sample.label if right else sample.prompt.rstrip("=")
            ids = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            sample.tokens = sample.tokens + ids
            sample.response_length = len(ids)
            sample.status = Sample.Status.COMPLETED
    return RolloutFnTrainOutput(samples=groups)


def evaluate(args, rollout_id, data_source, evaluation=False):
    samples = [s for group in data_source.get_samples(len(data_source)) for s in group]
    for sample in samples:
        sample.response = sample.label if sample.source_name == "known" else ""
        sample.reward = float(sample.response == sample.label)
    return RolloutFnEvalOutput(data={data_source.name: {"rewards": [s.reward for s in samples], "samples": samples}})


def record_all_samples(args, all_samples, data_source):
    """--rollout-all-samples-process-path: one line per scored group (kept or filtered) to the file that
    --custom-config-path names (args.all_samples_log)."""
    import json

    with open(args.all_samples_log, "a") as f:
        for group in all_samples:
            f.write(json.dumps({"source": group[0].source_name, "rewards": [s.reward for s in group]}) + "\n")


def log_rollout(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
    """--custom-rollout-log-function-path: one line per call to args.rollout_log (--custom-config-path), a
    metric of its own, and True: it logged the rollout itself."""
    import json

    with open(args.rollout_log, "a") as f:
        record = {
            "rollout_id": rollout_id,
            "samples": len(samples),
            "sources": sorted({s.source_name for s in samples}),
            "rollout_time": rollout_time,
            "hf_checkpoint": bool(args.hf_checkpoint),  # the run's whole args, not only the trainer's
        }
        f.write(json.dumps(record) + "\n")
    rollout_extra_metrics["custom/correct_fraction"] = sum(s.reward == 1.0 for s in samples) / len(samples)
    return True


def log_eval(rollout_id, args, data, extra_metrics):
    """--custom-eval-rollout-log-function-path: a metric per held-out set from the data it is given; False:
    vime logs its own eval metrics as well."""
    for name, entry in data.items():
        assert len(entry["rewards"]) == len(entry["samples"]), entry
        extra_metrics[f"custom/{name}/known_fraction"] = sum(s.source_name == "known" for s in entry["samples"]) / len(
            entry["samples"]
        )
        extra_metrics[f"custom/{name}/rollout_id"] = rollout_id
    return False
