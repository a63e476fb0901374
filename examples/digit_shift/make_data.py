"""Generate the digit-shift task: map each digit of a 3-digit string to (digit + 1) mod 10.

``"371="`` -> ``"482"``. All 1,000 strings ``000``..``999`` are shuffled with ``seed`` and split into
disjoint train and test sets, so held-out reward measures a learned rule, not memorisation.

CLI: ``python examples/digit_shift/make_data.py [OUT_DIR] [--seed 0] [--n-train 800] [--n-test 200]``
(``OUT_DIR`` defaults to this folder, where the seed-0 files are committed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
from collections.abc import Sequence

SOURCE_NAME = "digit_shift"
NUM_DIGITS = 3


def shift_digits(digits: str) -> str:
    """The task's rule: each digit d becomes (d + 1) mod 10."""
    return "".join(str((int(d) + 1) % 10) for d in digits)


def make_example(digits: str) -> dict:
    return {"prompt": f"{digits}=", "label": shift_digits(digits), "metadata": {"source_name": SOURCE_NAME}}


def make_dataset(out_dir: str, seed: int = 0, n_train: int = 800, n_test: int = 200) -> tuple[str, str]:
    """Write ``train.jsonl`` and ``test.jsonl`` into ``out_dir``; returns their paths."""
    universe = [f"{i:0{NUM_DIGITS}d}" for i in range(10**NUM_DIGITS)]
    if n_train < 0 or n_test < 0 or n_train + n_test > len(universe):
        raise ValueError(f"need 0 <= n_train + n_test <= {len(universe)}, got {n_train} + {n_test}")
    random.Random(seed).shuffle(universe)
    splits = {"train.jsonl": universe[:n_train], "test.jsonl": universe[n_train : n_train + n_test]}
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, items in splits.items():
        path = os.path.join(out_dir, name)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            for digits in items:
                f.write(json.dumps(make_example(digits)) + "\n")
        os.replace(tmp, path)  # never leave a half-written split behind
        paths.append(path)
    return paths[0], paths[1]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out_dir", nargs="?", default=os.path.dirname(os.path.abspath(__file__)))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-train", type=int, default=800)
    p.add_argument("--n-test", type=int, default=200)
    a = p.parse_args(argv)
    for path in make_dataset(a.out_dir, seed=a.seed, n_train=a.n_train, n_test=a.n_test):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
