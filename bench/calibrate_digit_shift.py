"""Calibrate a GRPO recipe for the digit-shift example with a plain PyTorch loop (no vLLM, no queue).

Each step: take B training prompts, sample n completions each at temperature 1.0 (at most
``max_new_tokens`` tokens, stopping at EOS id 0), score them with examples/digit_shift/reward.py,
compute GRPO advantages (r - group mean) / (group std + 1e-6), and take one AdamW step on

    loss = -mean_over_samples( mean_over_response_tokens( A * log pi(token) ) )

where the response tokens run up to and including the first EOS. Every ``--eval-every`` steps the
held-out score is the mean reward of greedy decoding on test.jsonl.

``--staleness K`` samples step k's batch with the weights of step k-K, to mimic the fully
asynchronous system, where rollouts come from weights one or more versions older than the trainer.

One thread (``torch.set_num_threads(1)``): in the real system the other core runs the vLLM engine.
Output: one JSON line per evaluation and a final summary line, to stdout and ``--log``.

    python bench/calibrate_digit_shift.py --lr 1e-3 --batch 64 --n 8 --steps 300 --log out.jsonl
    python bench/calibrate_digit_shift.py --smoke   # seconds: 2 steps of 2 prompts x 2 samples

``--smoke`` checks that the script still works: the same loop (staleness 1, so the lagging rollout
copy runs too) on the smallest sizes (a 64-wide one-layer model, 2 prompts x 2 samples, 2 steps, an evaluation
on 16 held-out prompts at every step); other flags given with it are overridden. Its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import importlib.util
import json
import os
import sys
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "digit_shift")
sys.path.insert(0, ROOT)  # so `vime.tools` resolves from a plain checkout

from vime.tools.make_tiny_model import make_tiny_model  # noqa: E402

EOS_ID = 0


def _load_reward():
    spec = importlib.util.spec_from_file_location("digit_shift_reward", os.path.join(EXAMPLE, "reward.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.reward


reward_fn = _load_reward()


@dataclasses.dataclass
class Sample:
    """The two fields the reward function reads."""

    response: str
    label: str


@dataclasses.dataclass
class Config:
    lr: float = 1e-3
    batch: int = 64  # prompts per step (defaults = the recommended recipe)
    n: int = 8  # samples per prompt
    steps: int = 300
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_grad_norm: float = 0.0  # <= 0: no clipping
    weight_decay: float = 0.01  # torch's AdamW default
    staleness: int = 0
    max_new_tokens: int = 4
    seed: int = 0
    eval_every: int = 25
    eval_prompts: int = 0  # held-out prompts evaluated (0: all of test.jsonl)


# --smoke: the smallest configuration that runs every part of the loop.
SMOKE = dict(
    batch=2,
    n=2,
    steps=2,
    eval_every=1,
    staleness=1,
    hidden_size=64,
    intermediate_size=128,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    eval_prompts=16,
)


def load_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@torch.no_grad()
def generate(model, prompts: torch.Tensor, max_new: int, greedy: bool, gen: torch.Generator | None):
    """Decode up to ``max_new`` tokens per row; returns (tokens [N, max_new], mask [N, max_new]).

    The mask covers the response up to and including the first EOS; later positions are padding.
    Sequences are at most 8 tokens, so recomputing the full prefix each step (no KV cache) is cheap.
    """
    seq = prompts
    n = prompts.shape[0]
    alive = torch.ones(n, dtype=torch.bool)
    out, mask = [], []
    for _ in range(max_new):
        logits = model(input_ids=seq, use_cache=False).logits[:, -1, :].float()
        if greedy:
            tok = logits.argmax(-1)
        else:
            tok = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen).squeeze(1)
        tok = torch.where(alive, tok, torch.full_like(tok, EOS_ID))
        out.append(tok)
        mask.append(alive.clone())
        alive &= tok != EOS_ID
        seq = torch.cat([seq, tok[:, None]], 1)
        if not alive.any():
            break
    return torch.stack(out, 1), torch.stack(mask, 1)


def decode(tokens: torch.Tensor, mask: torch.Tensor, id_to_char: dict[int, str]) -> list[str]:
    """Decoded response text, keeping the EOS text as a detokenizer without skip_special_tokens would."""
    return ["".join(id_to_char[t] for t, m in zip(row.tolist(), mrow.tolist()) if m) for row, mrow in zip(tokens, mask)]


def evaluate(model, prompts: torch.Tensor, labels: list[str], id_to_char: dict[int, str], max_new: int) -> float:
    model.eval()
    tokens, mask = generate(model, prompts, max_new, greedy=True, gen=None)
    texts = decode(tokens, mask, id_to_char)
    return sum(reward_fn(None, Sample(t, y)) for t, y in zip(texts, labels)) / len(labels)


def grpo_loss(model, prompts: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor):
    """-mean over samples of (mean over that sample's response tokens of A * log pi)."""
    seq = torch.cat([prompts, tokens], 1)
    logits = model(input_ids=seq[:, :-1], use_cache=False).logits.float()
    p = prompts.shape[1]
    logp = torch.log_softmax(logits[:, p - 1 :, :], -1).gather(-1, tokens[:, :, None]).squeeze(-1)
    m = mask.float()
    per_sample = (logp * m).sum(1) / m.sum(1).clamp_min(1.0)
    return -(adv * per_sample).mean()


def run(cfg: Config, log_path: str | None, tag: str = "") -> dict:
    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()
    torch.manual_seed(cfg.seed)
    with tempfile.TemporaryDirectory() as tmp:
        # Build through the real tool so that we calibrate exactly what it produces.
        path = make_tiny_model(
            tmp,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_layers,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            seed=cfg.seed,
        )
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    id_to_char = {i: s for s, i in tok.get_vocab().items()}

    def encode(rows):
        ids = tok([r["prompt"] for r in rows], add_special_tokens=False).input_ids
        assert len({len(x) for x in ids}) == 1, "prompts must share one length (no padding here)"
        return torch.tensor(ids), [r["label"] for r in rows]

    train_prompts, train_labels = encode(load_jsonl(os.path.join(EXAMPLE, "train.jsonl")))
    test_rows = load_jsonl(os.path.join(EXAMPLE, "test.jsonl"))
    test_prompts, test_labels = encode(test_rows[: cfg.eval_prompts] if cfg.eval_prompts > 0 else test_rows)

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    # Rollout weights lag the trainer by `staleness` versions (a second model copy = the "engine").
    rollout_model = copy.deepcopy(model) if cfg.staleness > 0 else model
    history: collections.deque = collections.deque(maxlen=cfg.staleness + 1)

    log = open(log_path, "a") if log_path else None
    curve: dict[int, float] = {}
    step_times: list[float] = []
    rollout_times: list[float] = []  # sampling + reward: what the vLLM engine side does in vime

    def emit(rec: dict):
        line = json.dumps(rec)
        print(line, flush=True)
        if log:
            log.write(line + "\n")
            log.flush()

    perm = torch.randperm(len(train_labels), generator=gen)
    cursor = 0
    for step in range(cfg.steps + 1):
        if step % cfg.eval_every == 0 or step == cfg.steps:
            curve[step] = evaluate(model, test_prompts, test_labels, id_to_char, cfg.max_new_tokens)
            emit(
                {
                    "tag": tag,
                    "step": step,
                    "eval": round(curve[step], 4),
                    "s_per_step": round(sum(step_times) / max(1, len(step_times)), 4),
                }
            )
        if step == cfg.steps:
            break
        t0 = time.perf_counter()
        if cfg.staleness > 0:
            history.append({k: v.detach().clone() for k, v in model.state_dict().items()})
            rollout_model.load_state_dict(history[0])  # the oldest kept version: k - staleness
        # Walk the training set in shuffled epochs.
        if cursor + cfg.batch > len(perm):
            perm, cursor = torch.randperm(len(train_labels), generator=gen), 0
        idx = perm[cursor : cursor + cfg.batch]
        cursor += cfg.batch
        prompts = train_prompts[idx].repeat_interleave(cfg.n, 0)
        labels = [train_labels[i] for i in idx.tolist() for _ in range(cfg.n)]
        rollout_model.eval()
        tokens, mask = generate(rollout_model, prompts, cfg.max_new_tokens, greedy=False, gen=gen)
        texts = decode(tokens, mask, id_to_char)
        rewards = torch.tensor([reward_fn(None, Sample(t, y)) for t, y in zip(texts, labels)]).view(cfg.batch, cfg.n)
        adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).view(-1)
        rollout_times.append(time.perf_counter() - t0)

        model.train()
        loss = grpo_loss(model, prompts, tokens, mask, adv)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        opt.step()
        step_times.append(time.perf_counter() - t0)

    summary = {
        "tag": tag,
        "cfg": dataclasses.asdict(cfg),
        "curve": {str(k): round(v, 4) for k, v in curve.items()},
        "s_per_step": round(sum(step_times) / len(step_times), 4),
        "s_rollout_per_step": round(sum(rollout_times) / len(rollout_times), 4),
        "first_step_ge_0.5": next((s for s, v in sorted(curve.items()) if v >= 0.5), None),
        "first_step_ge_0.6": next((s for s, v in sorted(curve.items()) if v >= 0.6), None),
        "summary": True,
    }
    emit(summary)
    if log:
        log.close()
    return summary


def parse_args(argv=None) -> tuple[Config, str | None, str]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for f in dataclasses.fields(Config):
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    p.add_argument("--log", default=None, help="append JSON lines here")
    p.add_argument("--tag", default="", help="a name for this configuration in the log")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="seconds-long check that the script works (smallest sizes; overrides the sizes given)",
    )
    a = vars(p.parse_args(argv))
    log, tag = a.pop("log"), a.pop("tag")
    if a.pop("smoke"):
        a.update(SMOKE)
        tag = tag or "smoke"
    return Config(**a), log, tag


if __name__ == "__main__":
    cfg, log, tag = parse_args()
    run(cfg, log, tag)
