"""The built-in data source: prompt records from .jsonl or .parquet, local or any fsspec URL.

Every record is validated when the dataset is opened, so that a malformed line fails the run at
start-up (naming the file and line) instead of crashing a rollout worker an hour later.
"""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any

import fsspec


class DataError(ValueError):
    """A problem with a data file; the message names the file and the line or row."""


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    index: int                                # row in the file, 0-based
    prompt: str | list[dict[str, Any]]
    label: Any
    metadata: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class DataKeys:
    input_key: str = "input"
    label_key: str | None = None
    metadata_key: str = "metadata"


def _read_rows(path: str) -> list[tuple[str, dict]]:
    """[(location, row)] where location is 'line N' or 'row N' for error messages."""
    bare = path.split("?")[0]
    if bare.endswith(".jsonl"):
        rows = []
        with fsspec.open(path, "rt", encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as error:
                    raise DataError(f"{path}, line {number}: malformed JSON ({error.msg} at column {error.colno})") \
                        from None
                if not isinstance(row, dict):
                    raise DataError(f"{path}, line {number}: expected a JSON object, got {type(row).__name__}")
                rows.append((f"line {number}", row))
        return rows
    if bare.endswith(".parquet"):
        import pyarrow.parquet as pq
        with fsspec.open(path, "rb") as f:
            table = pq.read_table(f)
        return [(f"row {i + 1}", row) for i, row in enumerate(table.to_pylist())]
    raise DataError(f"{path}: unsupported format; expected .jsonl or .parquet")


def _check_prompt(prompt: Any, where: str, key: str) -> None:
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
        return
    raise DataError(f"{where}: field {key!r} must be a string or a list of chat messages "
                    f"with 'role' and 'content', got {type(prompt).__name__}")


class PromptDataset:
    """All records of one prompt file, in file order."""

    def __init__(self, path: str, records: list[PromptRecord]):
        self.path = path
        self.records = records

    @classmethod
    def load(cls, path: str, keys: DataKeys) -> "PromptDataset":
        try:
            rows = _read_rows(path)
        except FileNotFoundError:
            raise DataError(f"{path}: no such file") from None
        records = []
        for index, (location, row) in enumerate(rows):
            where = f"{path}, {location}"
            if keys.input_key not in row:
                raise DataError(f"{where}: record has no field {keys.input_key!r} (--input-key); "
                                f"fields are {sorted(row)}")
            _check_prompt(row[keys.input_key], where, keys.input_key)
            if keys.label_key is not None and keys.label_key not in row:
                raise DataError(f"{where}: record has no field {keys.label_key!r} (--label-key)")
            metadata = row.get(keys.metadata_key) or {}
            if not isinstance(metadata, dict):
                raise DataError(f"{where}: field {keys.metadata_key!r} (--metadata-key) must be an object")
            label = row.get(keys.label_key) if keys.label_key is not None else None
            records.append(PromptRecord(index, row[keys.input_key], label, metadata))
        if not records:
            raise DataError(f"{path}: no records")
        return cls(path, records)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> PromptRecord:
        return self.records[index]

    def epoch_order(self, epoch: int, *, seed: int, shuffle: bool) -> list[int]:
        """Row order of one epoch; deterministic in (seed, epoch) so a resumed run sees the same order."""
        order = list(range(len(self.records)))
        if shuffle:
            random.Random(seed * 1_000_003 + epoch).shuffle(order)
        return order


@dataclasses.dataclass
class DatasetCursor:
    """Position in the endless stream of prompts: the next row of ``epoch`` to hand out."""

    epoch: int = 0
    offset: int = 0

    def take(self, dataset: PromptDataset, count: int, *, seed: int, shuffle: bool,
             num_epoch: int | None = None) -> list[tuple[int, int]]:
        """Advance by up to ``count`` prompts; returns [(epoch, row index)]. Stops after ``num_epoch``."""
        taken = []
        while len(taken) < count and (num_epoch is None or self.epoch < num_epoch):
            order = dataset.epoch_order(self.epoch, seed=seed, shuffle=shuffle)
            while len(taken) < count and self.offset < len(order):
                taken.append((self.epoch, order[self.offset]))
                self.offset += 1
            if self.offset >= len(order):
                self.epoch, self.offset = self.epoch + 1, 0
        return taken
