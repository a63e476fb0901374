"""``vime queue export``: every sample of a run's accepted groups as rows (jsonl or parquet), and those rows read
back as samples (``vime replay`` and the tests compare them with what was generated).

A row carries the group's position and stage (trained, stale or accepted: the lineage rule of ``vime queue
inspect``), the token ids, reward, per-token weight versions, metadata, source name and, given a tokenizer, the
decoded prompt and response. The optional per-token captures are cells of their own (dtype, shape, flat data).
"""

from __future__ import annotations

import json
import os
from typing import Any

from vime.queue.journal_view import JournalView
from vime.queue.records import OPTIONAL_TENSORS
from vime.tools.queue_cli import lineage

EXPORT_TENSORS = OPTIONAL_TENSORS  # every optional per-token capture the queue stores is a column of its own
JSON_COLUMNS = ("label", "metadata")  # free-form: JSON text in parquet, plain values in jsonl


def _tensor_cell(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    import torch

    tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    return {
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "shape": list(tensor.shape),
        "data": tensor.flatten().tolist(),
    }


def export_rows(data_dir: str, save: str | None, run_id: str, tokenizer=None, report: dict | None = None):
    """Yield one dict per sample of every accepted group (read-only, like ``inspect``)."""
    from vime.queue.rollout_queue import StoreOptions
    from vime.queue.transport import StrawTransport

    view = JournalView.read(data_dir)
    cursor, step_cursors, skipped, _ = lineage(data_dir, save, view, run_id)
    report = {} if report is None else report
    report.update(groups=0, samples=0, unreadable=0, trained=0, stale=0, accepted=0)
    transport = StrawTransport(StoreOptions(data_dir, run_id))
    try:
        for group in view.accepted():
            try:
                samples = transport.read(group.ref)
            except Exception:  # noqa: BLE001 - reclaimed by GC or unreadable: counted, not fatal (as in inspect)
                report["unreadable"] += 1
                continue
            if group.position in skipped:
                stage, step = "stale", None
            elif group.position < cursor:
                stage = "trained"
                step = next((i + 1 for i, c in enumerate(step_cursors) if group.position < c), None)
            else:
                stage, step = "accepted", None
            report["groups"] += 1
            report[stage] += 1
            for sample in sorted(samples, key=lambda s: s.index):
                row = {
                    "position": group.position,
                    "task_id": group.task_id,
                    "stage": stage,
                    "step": step,
                    "group_index": sample.group_index,
                    "index": sample.index,
                    "prompt_index": sample.prompt_index,
                    "source_name": sample.source_name,
                    "source": sample.source,
                    "session_id": sample.session_id,
                    "status": sample.status.value,
                    "reward": sample.reward,
                    "label": sample.label,
                    "metadata": sample.metadata,
                    "tokens": list(sample.tokens),
                    "prompt_length": sample.prompt_length,
                    "response_length": sample.response_length,
                    "loss_mask": sample.loss_mask,
                    "rollout_log_probs": sample.rollout_log_probs,
                    "weight_versions": list(sample.weight_versions),
                    "response": sample.response,
                }
                if tokenizer is not None:
                    row["prompt_text"] = tokenizer.decode(sample.tokens[: sample.prompt_length])
                    row["response_text"] = tokenizer.decode(sample.response_tokens)
                for name in EXPORT_TENSORS:
                    row[name] = _tensor_cell(getattr(sample, name))
                report["samples"] += 1
                yield row
    finally:
        transport.close()


def _parquet_schema(with_text: bool):
    import pyarrow as pa

    tensor = pa.struct([("dtype", pa.string()), ("shape", pa.list_(pa.int64())), ("data", pa.list_(pa.float64()))])
    fields = [
        ("position", pa.int64()),
        ("task_id", pa.string()),
        ("stage", pa.string()),
        ("step", pa.int64()),
        ("group_index", pa.int64()),
        ("index", pa.int64()),
        ("prompt_index", pa.int64()),
        ("source_name", pa.string()),
        ("source", pa.string()),
        ("session_id", pa.string()),
        ("status", pa.string()),
        ("reward", pa.float64()),
        ("label", pa.string()),
        ("metadata", pa.string()),
        ("tokens", pa.list_(pa.int64())),
        ("prompt_length", pa.int64()),
        ("response_length", pa.int64()),
        ("loss_mask", pa.list_(pa.int64())),
        ("rollout_log_probs", pa.list_(pa.float64())),
        ("weight_versions", pa.list_(pa.int64())),
        ("response", pa.string()),
    ]
    if with_text:
        fields += [("prompt_text", pa.string()), ("response_text", pa.string())]
    return pa.schema(fields + [(name, tensor) for name in EXPORT_TENSORS])


def write_export(rows, out: str, fmt: str, *, with_text: bool) -> None:
    """Write rows as jsonl or parquet, under a temporary name renamed into place when complete."""
    tmp = f"{out}.tmp-{os.getpid()}"
    try:
        if fmt == "jsonl":
            with open(tmp, "w") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            schema = _parquet_schema(with_text)
            with pq.ParquetWriter(tmp, schema) as writer:
                batch: list[dict[str, Any]] = []
                for row in rows:
                    batch.append({**row, **{k: json.dumps(row[k]) for k in JSON_COLUMNS}})
                    if len(batch) >= 1024:
                        writer.write_table(pa.Table.from_pylist(batch, schema))
                        batch = []
                writer.write_table(pa.Table.from_pylist(batch, schema))
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read_export(path: str) -> list[dict[str, Any]]:
    """The rows of an export, in the form export_rows yields them (either format)."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
        for row in rows:
            for key in JSON_COLUMNS:
                row[key] = json.loads(row[key])
        return rows
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def sample_from_row(row: dict[str, Any]):
    """Rebuild the queue's Sample from an exported row (every stored field)."""
    import torch

    from vime.sample import Sample, Status

    sample = Sample(
        group_index=row["group_index"],
        index=row["index"],
        prompt_index=row["prompt_index"],
        label=row["label"],
        tokens=list(row["tokens"]),
        response=row["response"],
        response_length=row["response_length"],
        loss_mask=row["loss_mask"],
        reward=row["reward"],
        status=Status(row["status"]),
        rollout_log_probs=row["rollout_log_probs"],
        weight_versions=list(row["weight_versions"]),
        metadata=row["metadata"],
        source=row["source"],
        session_id=row["session_id"],
    )
    for name in EXPORT_TENSORS:
        cell = row.get(name)
        if cell is not None:
            dtype = getattr(torch, cell["dtype"])
            wide = torch.float64 if dtype.is_floating_point else torch.int64
            setattr(sample, name, torch.tensor(cell["data"], dtype=wide).to(dtype).reshape(cell["shape"]))
    return sample


def export(data_dir: str, save: str | None, run_id: str, out: str, fmt: str, hf_checkpoint: str | None) -> dict:
    tokenizer = None
    if hf_checkpoint:
        from vime.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(hf_checkpoint)
    report: dict[str, Any] = {}
    write_export(export_rows(data_dir, save, run_id, tokenizer, report), out, fmt, with_text=tokenizer is not None)
    return report
