"""Prompt data: the built-in source (.jsonl or .parquet, local or any fsspec URL) and custom
sources given with ``--data-source-path``.

Every record of a file is validated when the dataset is opened, so that a malformed line fails the
run at start-up (naming the file, the line and the key) instead of crashing a rollout worker an
hour later. A source is map-style: the durable queue journals row indices (epoch, row), never
prompt payloads, so row ``i`` must give the same prompt every time the source is opened.
"""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any

import fsspec

from vime.errors import UserError

DATA_SOURCE_FLAG = "--data-source-path"


class DataError(UserError, ValueError):
    """A problem with prompt data; the message names the file (or source) and the line or row."""


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    index: int  # row in the source, 0-based
    prompt: str | list[dict[str, Any]]
    label: Any
    metadata: dict[str, Any]
    source: str | None = None  # a custom source's ``sample.source`` (wins over metadata)


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
                    raise DataError(
                        f"{path}, line {number}: malformed JSON ({error.msg} at column {error.colno})"
                    ) from None
                if not isinstance(row, dict):
                    raise DataError(f"{path}, line {number}: expected a JSON object, got {type(row).__name__}")
                rows.append((f"line {number}", row))
        return rows
    if bare.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
        import pyarrow

        try:
            with fsspec.open(path, "rb") as f:
                table = pq.read_table(f)
        except pyarrow.ArrowInvalid as error:
            raise DataError(f"{path}: not a readable Parquet file ({error})") from None
        return [(f"row {i + 1}", row) for i, row in enumerate(table.to_pylist())]
    raise DataError(f"{path}: unsupported format; expected .jsonl or .parquet")


def check_prompt(prompt: Any, where: str, key: str) -> None:
    """A prompt is a string or a list of chat messages (role, content, optional step_loss_mask 0/1)."""
    if isinstance(prompt, str):
        return
    if not (isinstance(prompt, list) and prompt):
        raise DataError(
            f"{where}: field {key!r} must be a string or a list of chat messages "
            f"with 'role' and 'content', got {type(prompt).__name__}"
        )
    for number, message in enumerate(prompt):
        if not (isinstance(message, dict) and "role" in message and "content" in message):
            raise DataError(
                f"{where}: field {key!r}, message {number}: a chat message needs 'role' and "
                f"'content', got {message!r:.200}"
            )
        mask = message.get("step_loss_mask", 1)
        if mask is None:  # Parquet fills a struct field missing from some messages with null
            continue
        if isinstance(mask, bool) or mask not in (0, 1):
            raise DataError(f"{where}: field {key!r}, message {number}: step_loss_mask must be 0 or 1, got {mask!r}")


def _metadata(value: Any, where: str, key: str) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, str):  # Parquet files often keep metadata as a JSON string
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as error:
            raise DataError(f"{where}: field {key!r} (--metadata-key) is a string but not JSON ({error.msg})") from None
    if not isinstance(value, dict):
        raise DataError(f"{where}: field {key!r} (--metadata-key) must be an object, got {type(value).__name__}")
    return value


def record_from_row(row: dict, index: int, where: str, keys: DataKeys) -> PromptRecord:
    """Validate one raw record (a JSON object or Parquet row) against the configured keys."""
    if keys.input_key not in row:
        raise DataError(f"{where}: record has no field {keys.input_key!r} (--input-key); fields are {sorted(row)}")
    check_prompt(row[keys.input_key], where, keys.input_key)
    if keys.label_key is not None and keys.label_key not in row:
        raise DataError(f"{where}: record has no field {keys.label_key!r} (--label-key); fields are {sorted(row)}")
    metadata = _metadata(row.get(keys.metadata_key), where, keys.metadata_key)
    label = row.get(keys.label_key) if keys.label_key is not None else None
    return PromptRecord(index, row[keys.input_key], label, metadata)


class PromptSource:
    """A map-style prompt source: ``len(source)`` rows, ``source[i]`` a :class:`PromptRecord`."""

    name: str = "prompts"

    def __len__(self) -> int:
        raise NotImplementedError

    def __getitem__(self, index: int) -> PromptRecord:
        raise NotImplementedError

    @property
    def records(self) -> list[PromptRecord]:
        return [self[i] for i in range(len(self))]

    def epoch_order(self, epoch: int, *, seed: int, shuffle: bool) -> list[int]:
        """Row order of one epoch; deterministic in (seed, epoch) so a resumed run sees the same order."""
        order = list(range(len(self)))
        if shuffle:
            random.Random(seed * 1_000_003 + epoch).shuffle(order)
        return order


class PromptDataset(PromptSource):
    """All records of one prompt file, in file order."""

    def __init__(self, path: str, records: list[PromptRecord]):
        self.path = self.name = path
        self._records = records

    @classmethod
    def load(cls, path: str, keys: DataKeys) -> PromptDataset:
        try:
            rows = _read_rows(path)
        except FileNotFoundError:
            raise DataError(f"{path}: no such file") from None
        records = [
            record_from_row(row, index, f"{path}, {location}", keys) for index, (location, row) in enumerate(rows)
        ]
        if not records:
            raise DataError(f"{path}: no records")
        return cls(path, records)

    @property
    def records(self) -> list[PromptRecord]:
        return self._records

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index: int) -> PromptRecord:
        return self._records[index]


class CustomPromptSource(PromptSource):
    """A user class given with ``--data-source-path``, constructed as ``DataSource(args)``.

    It must be map-style: ``__len__()`` (rows per epoch) and ``__getitem__(i)`` returning a record
    dict (read with --input-key/--label-key/--metadata-key), a :class:`~vime.sample.Sample` (its
    ``prompt``, ``label``, ``metadata`` and ``source``) or a :class:`PromptRecord`. Rows are
    converted and checked when they are handed out; row 0 is checked when the source is opened.
    """

    def __init__(self, path: str, instance: Any, keys: DataKeys):
        self.path, self.instance, self.keys = path, instance, keys
        self.name = f"{DATA_SOURCE_FLAG} {path}"
        for method in ("__len__", "__getitem__"):
            if not hasattr(instance, method):
                extra = (
                    (
                        " (vime's data sources are map-style: the queue journals row indices, so a resumed run "
                        "sees the same prompts; see docs/data-and-hooks.md)"
                    )
                    if hasattr(instance, "get_samples")
                    else ""
                )
                raise DataError(f"{self.name}: {type(instance).__name__} has no {method}(){extra}")
        try:
            self._length = int(len(instance))
        except Exception as error:
            raise DataError(f"{self.name}: len() failed: {type(error).__name__}: {error}") from error
        if self._length < 1:
            raise DataError(f"{self.name}: the source is empty (len() == {self._length})")
        self[0]  # a wrong row type fails at start-up

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> PromptRecord:
        from vime.sample import Sample

        where = f"{self.name}, row {index}"
        try:
            item = self.instance[index]
        except Exception as error:
            raise DataError(f"{where}: {type(error).__name__}: {error}") from error
        if isinstance(item, PromptRecord):
            check_prompt(item.prompt, where, "prompt")
            return dataclasses.replace(item, index=index)
        if isinstance(item, Sample):
            check_prompt(item.prompt, where, "prompt")
            return PromptRecord(
                index, item.prompt, item.label, _metadata(item.metadata, where, "metadata"), item.source
            )
        if isinstance(item, dict):
            return record_from_row(item, index, where, self.keys)
        raise DataError(f"{where}: expected a dict record, a Sample or a PromptRecord, got {type(item).__name__}")


MAX_PROMPT_LEN_FLAG = "--rollout-max-prompt-len"


class PromptSubset(PromptSource):
    """The rows of ``source`` listed in ``rows``, renumbered 0, 1, ... (the prompts --rollout-max-prompt-len
    keeps). The queue journals the subset's row numbers, so ``rows`` must be the same whenever the run's
    prompts are opened: it is computed once at start-up and handed to the controller."""

    def __init__(self, source: PromptSource, rows: list[int]):
        if not rows:
            raise DataError(f"{source.name}: no prompts left")
        self.source, self.rows = source, list(rows)
        self.name = source.name

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> PromptRecord:
        return dataclasses.replace(self.source[self.rows[index]], index=index)


def rows_within_prompt_len(
    source: PromptSource,
    tokenizer,
    max_prompt_len: int,
    *,
    apply_chat_template: bool,
    chat_template_kwargs: dict | None = None,
) -> list[int]:
    """Rows of ``source`` whose prompt, rendered as the rollout renders it, has at most ``max_prompt_len``
    tokens (--rollout-max-prompt-len). Raises DataError, naming the flag, when none has."""
    from vime.data.prompt import render_prompt

    rows = [
        row
        for row in range(len(source))
        if len(
            render_prompt(
                tokenizer,
                source[row].prompt,
                apply_chat_template=apply_chat_template,
                chat_template_kwargs=chat_template_kwargs,
            )
        )
        <= max_prompt_len
    ]
    if not rows:
        raise DataError(
            f"{MAX_PROMPT_LEN_FLAG} {max_prompt_len}: every one of the {len(source)} prompts of {source.name} "
            "is longer; nothing is left to train on"
        )
    return rows


def open_prompt_source(
    prompt_data: str | None, keys: DataKeys, *, data_source_path: str | None = None, args: Any = None
) -> PromptSource:
    """The run's prompts: ``--data-source-path`` when given, else the file ``--prompt-data``."""
    if data_source_path:
        from vime.runtime.plugins import PluginError, load_hook

        cls = load_hook(DATA_SOURCE_FLAG, data_source_path)
        try:
            instance = cls(args)
        except Exception as error:
            raise PluginError(
                f"{DATA_SOURCE_FLAG} {data_source_path}: constructing it with args failed: "
                f"{type(error).__name__}: {error}"
            ) from error
        return CustomPromptSource(data_source_path, instance, keys)
    if not prompt_data:
        raise DataError("--prompt-data: no prompt file given (or give --data-source-path)")
    return PromptDataset.load(prompt_data, keys)


@dataclasses.dataclass
class DatasetCursor:
    """Position in the endless stream of prompts: the next row of ``epoch`` to hand out."""

    epoch: int = 0
    offset: int = 0

    def take(
        self, dataset: PromptSource, count: int, *, seed: int, shuffle: bool, num_epoch: int | None = None
    ) -> list[tuple[int, int]]:
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
