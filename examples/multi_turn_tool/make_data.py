"""Write the held-out set of the multi-turn tool example: ``test.jsonl`` or ``test.parquet``.

    python examples/multi_turn_tool/make_data.py OUT_DIR [--format jsonl|parquet] [--count 32]

Training prompts come from the custom data source (data_source.py); this held-out set uses other
indices of the same generator, and metadata.source_name names each row's operation.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from calculator import problem

HELD_OUT_OFFSET = 100_000


def rows(count: int, seed: int = 0) -> list[dict]:
    out = []
    for i in range(count):
        prompt, label, operation = problem(HELD_OUT_OFFSET + i, seed)
        out.append({"prompt": prompt, "label": label, "metadata": {"source_name": operation}})
    return out


def write(out_dir: str, fmt: str = "jsonl", count: int = 32) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"test.{fmt}")
    data = rows(count)
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(data), path)
    else:
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in data)
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl")
    parser.add_argument("--count", type=int, default=32)
    options = parser.parse_args()
    print(write(options.out_dir, options.format, options.count))
