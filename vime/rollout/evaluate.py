"""Held-out evaluation through the router: generate for every prompt, score, average.

``--eval-function-path`` replaces the built-in loop with a user function called as
``generate_rollout(args, rollout_id, data_source, evaluation=True)``, once per held-out set;
``data_source.get_samples(n)`` hands out that set's prompts (each a group of
--n-samples-per-eval-prompt fresh samples) until it is exhausted.

Each set samples with its own resolved settings (vime.config.evaluation.EvalDataset: an --eval-config
entry, its defaults, the --eval-* flags, then the --rollout-* ones); its rm_type and metadata_overrides
are put in every sample's metadata.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time
from typing import Any

import aiohttp

from vime.config.evaluation import EvalDataset
from vime.data.prompt import render_prompt
from vime.data.source import PromptSource
from vime.rollout.generate import SamplingParams, generate
from vime.rollout.rewards import Reward
from vime.rollout.types import RolloutFnEvalOutput
from vime.runtime.log_hooks import UNTRACKED, USER_METRICS, EvalLogHook
from vime.sample import Sample, Status

EVAL_FLAG = "--eval-function-path"


class EvalDataSource:
    """The ``data_source`` an eval function receives: one held-out set, handed out once."""

    def __init__(
        self,
        name: str,
        dataset: PromptSource,
        *,
        tokenizer,
        n_samples: int,
        apply_chat_template: bool,
        config: EvalDataset | None = None,
        chat_template_kwargs: dict | None = None,
    ):
        self.chat_template_kwargs = chat_template_kwargs
        self.name, self.dataset, self.n_samples = name, dataset, n_samples
        self.tokenizer, self.apply_chat_template = tokenizer, apply_chat_template
        self.config = config  # the set's rm_type and metadata_overrides go into each sample's metadata
        self.offset = 0

    def __len__(self) -> int:
        return len(self.dataset)

    def group(self, record) -> list[Sample]:
        tokens = render_prompt(
            self.tokenizer,
            record.prompt,
            apply_chat_template=self.apply_chat_template,
            chat_template_kwargs=self.chat_template_kwargs,
        )
        return [
            Sample(
                group_index=record.index,
                index=i,
                prompt_index=record.index,
                prompt=record.prompt,
                label=record.label,
                tokens=list(tokens),
                metadata=self.config.inject_metadata(record.metadata) if self.config else dict(record.metadata),
                source=record.source,
                session_id=f"eval-{self.name}-{record.index}-{i}",
            )
            for i in range(self.n_samples)
        ]

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        """The next ``num_samples`` prompts of the set (fewer at its end, none after it)."""
        end = min(len(self.dataset), self.offset + num_samples)
        groups = [self.group(self.dataset[i]) for i in range(self.offset, end)]
        self.offset = end
        return groups

    def add_samples(self, samples: list[list[Sample]]) -> None:
        """Nothing to keep: an evaluation does not resume."""


def summarize(samples: list[Sample]) -> dict[str, float]:
    """Mean reward and response length, and the mean reward of each source (``reward/<source>``)."""
    result = {
        "reward": statistics.fmean(float(s.reward) for s in samples),
        "response_length": statistics.fmean(s.response_length for s in samples),
        "samples": float(len(samples)),
    }
    by_source: dict[str, list[float]] = {}
    for sample in samples:
        by_source.setdefault(sample.source_name, []).append(float(sample.reward))
    if len(by_source) > 1:
        result.update({f"reward/{name}": statistics.fmean(values) for name, values in sorted(by_source.items())})
    return result


@dataclasses.dataclass
class EvalResult:
    """One held-out set's evaluation: its ``metrics`` (reward, response_length, samples, ...) and its ``data``
    as the reference framework's eval logging receives it ({"rewards", "truncated", "samples"}; with
    --eval-function-path, what that function returned for the set)."""

    metrics: dict[str, float]
    data: dict[str, Any]


def samples_data(samples: list[Sample]) -> dict[str, Any]:
    """``{"rewards", "truncated", "samples"}`` of scored samples, one entry each."""
    return {
        "rewards": [float(s.reward) for s in samples],
        "truncated": [s.status == Status.TRUNCATED for s in samples],
        "samples": samples,
    }


def eval_output_data(output: Any, name: str) -> dict[str, Any]:
    """What an eval function returned for set ``name`` (checked already by :func:`interpret_eval_output`),
    as a data entry: its own dict for the set, or one built from a list of scored Samples."""
    if isinstance(output, RolloutFnEvalOutput):
        output = output.data
    if isinstance(output, list):
        return samples_data(output)
    entry = output.get(name, output)
    if isinstance(entry.get("samples"), list) and "rewards" not in entry:
        return {**samples_data(entry["samples"]), **entry}
    return entry


def interpret_eval_output(output: Any, name: str, path: str) -> dict[str, float]:
    """An eval function's answer as {"reward", "response_length", "samples", ...}.

    Accepted: ``RolloutFnEvalOutput(data={name: {"rewards": [...], "samples": [Sample, ...]}})``
    (the reference framework's form; "truncated" and "response_lengths" lists are optional), the
    same dict without the wrapper, or a list of scored Samples.
    """
    metrics = {}
    if isinstance(output, RolloutFnEvalOutput):
        metrics = {k: float(v) for k, v in (output.metrics or {}).items() if isinstance(v, (int, float))}
        output = output.data
    if isinstance(output, list) and all(isinstance(s, Sample) for s in output) and output:
        return {**summarize(output), **metrics}
    if isinstance(output, dict):
        entry = output.get(name, output)
        if (
            isinstance(entry, dict)
            and isinstance(entry.get("samples"), list)
            and entry["samples"]
            and all(isinstance(s, Sample) and s.reward is not None for s in entry["samples"])
        ):
            return {**summarize(entry["samples"]), **metrics}
        rewards = entry.get("rewards") if isinstance(entry, dict) else None
        if isinstance(rewards, list) and rewards:
            lengths = entry.get("response_lengths") or [0]
            return {
                "reward": statistics.fmean(float(r) for r in rewards),
                "response_length": statistics.fmean(float(n) for n in lengths),
                "samples": float(len(rewards)),
                **metrics,
            }
    raise TypeError(
        f"{EVAL_FLAG} {path}: for held-out set {name!r} it returned {type(output).__name__} "
        f"{str(output)[:200]!r}; expected RolloutFnEvalOutput(data={{{name!r}: {{'rewards': [...]}}}}) "
        "or a list of scored Samples"
    )


async def evaluate_dataset(
    dataset: PromptSource,
    *,
    tokenizer,
    router_url: str,
    reward: Reward,
    args,
    params: SamplingParams,
    n_samples: int,
    apply_chat_template: bool,
    timeout: float,
    concurrency: int = 64,
    name: str = "eval",
    rollout_id: int = 0,
    eval_function_path: str | None = None,
    config: EvalDataset | None = None,
    chat_template_kwargs: dict | None = None,
) -> EvalResult:
    source = EvalDataSource(
        name,
        dataset,
        tokenizer=tokenizer,
        n_samples=n_samples,
        apply_chat_template=apply_chat_template,
        config=config,
        chat_template_kwargs=chat_template_kwargs,
    )
    if eval_function_path:
        from vime.runtime.plugins import call_maybe_async, load_hook

        function = load_hook(EVAL_FLAG, eval_function_path)
        output = await call_maybe_async(function, args, rollout_id, source, evaluation=True)
        return EvalResult(interpret_eval_output(output, name, eval_function_path), eval_output_data(output, name))

    limit = asyncio.Semaphore(concurrency)

    async def one(session, sample: Sample) -> Sample:
        async with limit:
            await generate(session, router_url, sample, params, timeout=timeout)
        sample.response = tokenizer.decode(sample.response_tokens, skip_special_tokens=True)
        return sample

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        groups = source.get_samples(len(dataset))
        await asyncio.gather(*(one(session, sample) for group in groups for sample in group))
    # Scored by group, as in training (a --group-rm function sees a prompt's responses together).
    await asyncio.gather(*(reward.score_group(args, group) for group in groups))
    samples = [sample for group in groups for sample in group]
    return EvalResult(summarize(samples), samples_data(samples))


def eval_sampling(config: EvalDataset, *, skip_special_tokens: bool = False, seed: int | None = None) -> SamplingParams:
    """SamplingParams of one held-out set from its resolved settings."""
    return SamplingParams(
        max_new_tokens=config.max_response_len,
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k,
        stop=config.stop,
        stop_token_ids=config.stop_token_ids,
        skip_special_tokens=skip_special_tokens,
        max_context_len=config.max_context_len,
        seed=seed,
    )


class HeldOutEvaluation:
    """The run's held-out evaluation: every held-out set (--eval-prompt-data or --eval-config) generated
    through the router with its resolved sampling settings, each result written to ``metrics.jsonl`` (kind
    ``eval``) and said in the progress output; then --custom-eval-rollout-log-function-path, given every
    set's data, its numbers written as a record of kind ``eval_log``. ``eval_sets`` pairs each set's
    :class:`EvalDataset` with its loaded prompts; ``log`` is the run's :class:`vime.metrics.MetricsLog`."""

    def __init__(self, settings, eval_sets: list[tuple[EvalDataset, Any]], tokenizer, reward: Reward, log):
        self.s, self.eval_sets, self.tokenizer, self.reward, self.log = settings, eval_sets, tokenizer, reward, log
        log_path = settings.hooks.custom_eval_rollout_log_function_path if eval_sets else None
        self.log_hook = EvalLogHook(log_path, settings.args) if log_path else None

    def sampling(self, config: EvalDataset) -> SamplingParams:
        """The engine settings of one held-out set (stop strings and ids, context limit, seed included)."""
        r = self.s.rollout
        return eval_sampling(config, skip_special_tokens=r.rollout_skip_special_tokens, seed=r.rollout_seed)

    def run(self, router_url: str, *, version: int, step: int, label: str) -> dict[str, float]:
        """The reward of each set (by name) for the weights of ``version``, served behind ``router_url``."""
        s = self.s
        results, records, data = {}, [], {}
        for config, dataset in self.eval_sets:
            name = config.name
            started = time.monotonic()
            result = asyncio.run(
                evaluate_dataset(
                    dataset,
                    tokenizer=self.tokenizer,
                    router_url=router_url,
                    reward=self.reward,
                    args=s.args,
                    params=self.sampling(config),
                    n_samples=config.n_samples_per_eval_prompt,
                    apply_chat_template=s.data.apply_chat_template,
                    chat_template_kwargs=s.data.apply_chat_template_kwargs,
                    timeout=s.rollout.rollout_request_timeout,
                    name=name,
                    rollout_id=step,
                    eval_function_path=s.eval.eval_function_path,
                    config=config,
                )
            )
            metrics, data[name] = result.metrics, result.data
            results[name] = metrics["reward"]
            record = {
                "kind": "eval",
                "step": step,
                "weight_version": version,
                "dataset": name,
                "eval_reward": metrics["reward"],
                "eval_response_length": metrics["response_length"],
            }
            if self.log_hook:  # written once the hook said whether it logged the evaluation itself
                records.append(record)
            else:
                self.log.write(record)
            self.log.say(
                f"held-out reward on {name!r} {label} (weight version {version}): {metrics['reward']:.3f} "
                f"({int(metrics['samples'])} samples, {time.monotonic() - started:.1f}s)"
            )
        extra, logged_itself = self.log_hook(step, data) if self.log_hook else ({}, False)
        for record in records:
            if logged_itself:
                record[UNTRACKED] = ["eval_reward", "eval_response_length"]
            self.log.write(record)
        if self.log_hook:
            self.log.write({"kind": "eval_log", "step": step, USER_METRICS: extra})
        return results
