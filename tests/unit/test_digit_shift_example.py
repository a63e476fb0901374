"""The digit-shift example task: data rule, split, determinism, committed files and reward values."""

from __future__ import annotations

import filecmp
import importlib.util
import json
import os
from types import SimpleNamespace

import pytest

EXAMPLE_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "digit_shift")


def _load(name: str):
    # examples/ is not a package: load the modules by path, the way a user's reward file is loaded.
    spec = importlib.util.spec_from_file_location(f"digit_shift_{name}", os.path.join(EXAMPLE_DIR, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


make_data = _load("make_data")
reward_mod = _load("reward")


def _read(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_rule():
    assert make_data.shift_digits("371") == "482"
    assert make_data.shift_digits("909") == "010"
    assert make_data.make_example("059") == {
        "prompt": "059=",
        "label": "160",
        "metadata": {"source_name": "digit_shift"},
    }


def test_dataset_rule_split_and_determinism(tmp_path):
    train, test = make_data.make_dataset(str(tmp_path / "a"), seed=0)
    rows_train, rows_test = _read(train), _read(test)
    assert len(rows_train) == 800 and len(rows_test) == 200
    for row in rows_train + rows_test:
        digits = row["prompt"][:-1]
        assert len(digits) == 3 and digits.isdigit() and row["prompt"].endswith("=")
        assert row["label"] == "".join(str((int(d) + 1) % 10) for d in digits)
        assert row["metadata"] == {"source_name": "digit_shift"}
    prompts_train = {r["prompt"] for r in rows_train}
    prompts_test = {r["prompt"] for r in rows_test}
    assert len(prompts_train) == 800 and len(prompts_test) == 200
    assert not prompts_train & prompts_test

    again = make_data.make_dataset(str(tmp_path / "b"), seed=0)
    assert filecmp.cmp(train, again[0], shallow=False) and filecmp.cmp(test, again[1], shallow=False)
    other = make_data.make_dataset(str(tmp_path / "c"), seed=1)
    assert _read(other[0]) != rows_train


def test_committed_files_are_seed_0(tmp_path):
    train, test = make_data.make_dataset(str(tmp_path), seed=0)
    assert filecmp.cmp(train, os.path.join(EXAMPLE_DIR, "train.jsonl"), shallow=False)
    assert filecmp.cmp(test, os.path.join(EXAMPLE_DIR, "test.jsonl"), shallow=False)


def test_sizes_and_cli(tmp_path):
    assert make_data.main([str(tmp_path), "--seed", "2", "--n-train", "10", "--n-test", "5"]) == 0
    assert len(_read(str(tmp_path / "train.jsonl"))) == 10
    assert len(_read(str(tmp_path / "test.jsonl"))) == 5
    with pytest.raises(ValueError):
        make_data.make_dataset(str(tmp_path), n_train=900, n_test=200)


@pytest.mark.parametrize(
    "response,expected",
    [
        ("482", 1.0),
        ("480", 2 / 3),
        ("082", 2 / 3),
        ("999", 0.0),
        ("", 0.0),
        ("482<|endoftext|>", 1.0),
        (" 482\n", 1.0),
        ("48", 2 / 3),
        ("4", 1 / 3),
        ("4829", 1.0),  # only the first 3 characters are compared
        ("2482", 0.0),  # ... position by position, so a shifted answer is wrong
        ("4<|endoftext|>82", 1 / 3),  # the response ends at the first EOS
        ("<|endoftext|>", 0.0),
        (None, 0.0),
    ],
)
def test_reward_values(response, expected):
    sample = SimpleNamespace(response=response, label="482")
    assert reward_mod.reward(None, sample) == pytest.approx(expected)
