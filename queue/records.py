"""Record codec: a group of samples <-> straw records (DESIGN §3).

A group is one header record (codec ``vime.sample.v1``, marked as the group's: for each sample a msgspec struct
with the scalar
fields, metadata, label, response text, run-length weight versions and, per tensor field, the
rows that belong to it) and straw ``tensor.v1`` records, one per field for the whole
group (tokens, loss mask, sampler log-probs, and the optional R3 / score-centering / OPD teacher
captures), the samples' rows one after another: a group is a handful of records (four for a plain group) instead
of a few per sample, which is what straw's per-record cost and its advice (batch small writes) call for; on a
JuiceFS volume each record is several FUSE writes, and the client's CPU per write is what a publication costs
there (docs/juicefs.md). One sample's rows can still be read alone. Groups written before the group header
(one header record per sample) are read as they were. straw checksums every record, so a corrupted
payload fails loudly when it is read.

A capture whose rows do not match the tokens (R3 rows != len(tokens) - 1, score-centering or teacher
log-prob rows != response_length) is refused here: it is never published, and the task retries from
its last durable prefix instead.
"""

from __future__ import annotations

import hashlib
import sys
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
from straw import Record
from straw.errors import CorruptData

if TYPE_CHECKING:
    import torch
# torch (and straw.tensor, which imports it) are imported only for a capture (R3, top-k, teacher log-probs): one
# given as a torch tensor to encode, or decoded for the trainer. The rollout workers encode every group they publish
# and read a continuation's prefix with numpy (tensor_record, _field_from_record), and the controller imports this
# module for its queue: torch's import would cost each such process ~1.7 CPU-seconds at its start (two cores, the
# CI machine; a CI run starts ~80 rollout workers).

from vime.errors import InternalError
from vime.sample import Sample, Status

# The codec of the header records. A group's header holds every sample's (its record's metadata says
# ``"header": "group"``); a record without that mark is one sample's, as groups were written until 2026-12-06. The
# codec set is part of a straw queue's identity (run.json): a queue opened with another set is refused
# (UnsafeRecovery), so a queue created by an earlier vime could not be resumed. The set stays as it was.
HEADER_CODEC = "vime.sample.v1"
GROUP_HEADER = {"header": "group"}
CODECS = ("bytes.v1", "json.v1", "tensor.v1", HEADER_CODEC)

# Optional per-token captures and their stored dtype (None: keep the dtype given).
OPTIONAL_TENSORS = (
    "rollout_routed_experts",
    "rollout_topk_token_ids",
    "rollout_topk_log_probs",
    "rollout_topp_ids",
    "rollout_topp_offsets",
    "rollout_topp_log_probs",
    "teacher_log_probs",
)


class IncompleteCapture(InternalError, ValueError):
    """A sample's optional capture does not cover its tokens; it must not be published."""


class SampleHeader(msgspec.Struct, frozen=True):
    schema: int
    group_index: int
    index: int
    prompt_index: int
    source_name: str
    response_length: int
    reward: float | None
    status: str
    version_segments: list[tuple[int, int, int]]  # (version, start, end) over response tokens
    metadata: dict[str, Any]
    session_id: str | None
    label: Any
    response: str
    rows: dict[str, tuple[int, int]]  # tensor field -> this sample's rows [start, end)
    source: str | None = None


def run_length(versions: list[int]) -> list[tuple[int, int, int]]:
    segments: list[tuple[int, int, int]] = []
    for position, version in enumerate(versions):
        if segments and segments[-1][0] == version:
            segments[-1] = (version, segments[-1][1], position + 1)
        else:
            segments.append((version, position, position + 1))
    return segments


def expand(segments: list[tuple[int, int, int]]) -> list[int]:
    versions: list[int] = []
    for version, start, end in segments:
        versions.extend([version] * (end - start))
    return versions


# straw's tensor.v1 format (straw/tensor.py, tensor_record): the little-endian bytes of the C-ordered array, and
# metadata naming its shape, dtype and kind with the SHA-256 of each CHUNK_BYTES of them. tests/unit/
# test_records.py checks that tensor_record writes what straw's own writes.
TENSOR_CODEC = "tensor.v1"
CHUNK_BYTES = 4 * 1024**2
TENSOR_DTYPES = ("uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64", "bool")


def tensor_record(value: np.ndarray, identity: str, *, kind: str) -> Record:
    """The ``tensor.v1`` record of ``value``, written with numpy (straw's own writer takes torch)."""
    if sys.byteorder != "little":
        raise InternalError("tensor.v1 records are little-endian; this host is not")
    value = np.ascontiguousarray(value)
    if value.dtype.name not in TENSOR_DTYPES:
        raise InternalError(f"{kind}: dtype {value.dtype.name} has no tensor.v1 encoding")
    payload = memoryview(value.reshape(-1).view(np.uint8)).cast("B") if value.size else memoryview(b"")
    metadata = {
        "shape": list(value.shape),
        "dtype": value.dtype.name,
        "kind": kind,
        "chunk_bytes": CHUNK_BYTES,
        "chunks": [
            hashlib.sha256(payload[i : i + CHUNK_BYTES]).hexdigest() for i in range(0, len(payload), CHUNK_BYTES)
        ],
    }
    return Record(identity, payload, TENSOR_CODEC, metadata)


def _is_torch_tensor(value: Any) -> bool:
    """Whether ``value`` is a torch tensor (a capture a user's generate function made), without importing torch
    (whoever made one imported it)."""
    torch_module = sys.modules.get("torch")
    return torch_module is not None and isinstance(value, torch_module.Tensor)


def _field_record(parts: list, identity: str, kind: str) -> Record:
    """One field's record: the samples' rows one after another (a torch capture goes through straw's writer:
    numpy has no bfloat16)."""
    try:
        if any(_is_torch_tensor(part) for part in parts):
            import torch
            from straw.tensor import tensor_record as straw_tensor_record

            value = torch.cat([torch.as_tensor(part).detach().cpu() for part in parts])
            return straw_tensor_record(value, identity, kind=kind)
        return tensor_record(np.concatenate(parts), identity, kind=kind)
    except (RuntimeError, ValueError) as error:  # e.g. R3 captures of different layer counts in one group
        raise IncompleteCapture(f"{kind}: the samples of a group disagree on its shape ({error})") from None


def check_capture(sample: Sample) -> None:
    """Raise IncompleteCapture when an optional capture does not match the sample's tokens."""
    if sample.rollout_routed_experts is not None:
        rows = len(sample.rollout_routed_experts)
        if rows != len(sample.tokens) - 1:
            raise IncompleteCapture(f"R3 capture has {rows} rows, expected len(tokens) - 1 = {len(sample.tokens) - 1}")
    for name in ("rollout_topk_token_ids", "rollout_topk_log_probs", "teacher_log_probs"):
        value = getattr(sample, name)
        if value is not None and len(value) != sample.response_length:
            raise IncompleteCapture(
                f"{name} has {len(value)} rows, expected response_length = {sample.response_length}"
            )
    if sample.rollout_topp_offsets is not None:
        rows = len(sample.rollout_topp_offsets) - 1
        if rows != sample.response_length:
            raise IncompleteCapture(f"top-p support covers {rows} tokens, expected {sample.response_length}")
    if len(sample.weight_versions) != sample.response_length:
        raise IncompleteCapture(
            f"{len(sample.weight_versions)} weight versions for {sample.response_length} response tokens"
        )
    if sample.rollout_log_probs is not None and len(sample.rollout_log_probs) != sample.response_length:
        raise IncompleteCapture("rollout_log_probs must have one entry per response token")


def _sample_tensors(sample: Sample) -> dict[str, Any]:
    """A sample's tensor fields: numpy arrays, and a capture given as a torch tensor as it is."""
    tensors: dict[str, Any] = {"tokens": np.asarray(sample.tokens, dtype=np.int32)}
    loss_mask = sample.loss_mask if sample.loss_mask is not None else [1] * sample.response_length
    tensors["loss_mask"] = np.asarray(loss_mask, dtype=np.uint8)
    if sample.rollout_log_probs is not None:
        tensors["rollout_log_probs"] = np.asarray(sample.rollout_log_probs, dtype=np.float32)
    for name in OPTIONAL_TENSORS:
        value = getattr(sample, name)
        if value is not None:
            tensors[name] = value if _is_torch_tensor(value) else np.asarray(value)
    return tensors


class GroupHeader(msgspec.Struct, frozen=True):
    schema: int
    samples: list[SampleHeader]


def encode_group(samples: list[Sample], prefix: str, owner: dict[str, str]) -> list[Record]:
    """The group's header record (every sample's header) then one tensor record per field. ``owner`` (task_id,
    attempt_id) is stamped on each record: straw accepts a result only if every record belongs to
    the completing attempt."""
    for sample in samples:
        check_capture(sample)
    per_sample = [_sample_tensors(sample) for sample in samples]
    fields = list(dict.fromkeys(name for tensors in per_sample for name in tensors))
    parts: dict[str, list] = {name: [] for name in fields}
    offsets = {name: 0 for name in fields}
    headers = []
    for sample, tensors in zip(samples, per_sample):
        rows = {}
        for name, value in tensors.items():
            rows[name] = (offsets[name], offsets[name] + len(value))
            offsets[name] += len(value)
            parts[name].append(value)
        header = SampleHeader(
            schema=2,
            group_index=sample.group_index,
            index=sample.index,
            prompt_index=sample.prompt_index,
            source_name=sample.source_name,
            response_length=sample.response_length,
            reward=None if sample.reward is None else float(sample.reward),
            status=sample.status.value,
            version_segments=run_length(sample.weight_versions),
            metadata=sample.metadata,
            session_id=sample.session_id,
            label=sample.label,
            response=sample.response,
            rows=rows,
            source=sample.source,
        )
        headers.append(header)
    group = GroupHeader(schema=1, samples=headers)
    records = [Record(f"{prefix}:h", msgspec.msgpack.encode(group), HEADER_CODEC, {**GROUP_HEADER, **owner})]
    for name in fields:
        record = _field_record(parts[name], f"{prefix}:{name}", name)
        records.append(Record(record.record_id, record.payload, record.codec, {**record.metadata, **owner}))
    return records


def _field_from_record(record: Record) -> np.ndarray | torch.Tensor:
    """One field's rows: a capture as a torch tensor (what the trainer computes with, in any dtype, bfloat16
    included), the tokens, loss masks and log-probs as numpy arrays (they become lists: no torch needed to
    read a group's prefix, as a rollout worker resuming a continuation does)."""
    meta = record.metadata
    if meta.get("kind") in OPTIONAL_TENSORS:
        import torch

        dtype = getattr(torch, meta["dtype"])
        if not record.payload:
            return torch.empty(meta["shape"], dtype=dtype)
        return torch.frombuffer(bytearray(record.payload), dtype=dtype).reshape(meta["shape"])
    if meta["dtype"] not in TENSOR_DTYPES:
        raise CorruptData(f"record {record.record_id}: unexpected dtype {meta['dtype']} for {meta.get('kind')}")
    return np.frombuffer(bytes(record.payload), dtype=np.dtype(meta["dtype"])).reshape(meta["shape"])


def _headers_of(record: Record) -> list[SampleHeader]:
    """The sample headers of a header record (a group's, or one sample's as groups were written before)."""
    try:
        if record.metadata.get("header") == GROUP_HEADER["header"]:
            group = msgspec.msgpack.decode(record.payload, type=GroupHeader)
            if group.schema != 1:
                raise CorruptData(f"record {record.record_id}: unsupported group schema {group.schema}")
            headers = group.samples
        else:
            headers = [msgspec.msgpack.decode(record.payload, type=SampleHeader)]
    except msgspec.DecodeError as error:
        raise CorruptData(f"record {record.record_id}: unreadable sample header ({error})") from None
    for header in headers:
        if header.schema != 2:
            raise CorruptData(f"record {record.record_id}: unsupported sample schema {header.schema}")
    return headers


def sample_headers(records) -> list[SampleHeader]:
    """The sample headers among ``records`` (a group's), without decoding its tensors; raises CorruptData."""
    return [h for r in records if r.codec == HEADER_CODEC for h in _headers_of(r)]


def decode_group(records: list[Record]) -> list[Sample]:
    """Inverse of encode_group. Raises CorruptData on anything that does not parse as written."""
    headers: list[tuple[str, SampleHeader]] = []
    fields: dict[str, np.ndarray | torch.Tensor] = {}
    for record in records:
        if record.codec == HEADER_CODEC:
            headers.extend((record.record_id, header) for header in _headers_of(record))
        elif record.codec == TENSOR_CODEC:
            fields[record.metadata.get("kind")] = _field_from_record(record)
        else:
            raise CorruptData(f"record {record.record_id}: unexpected codec {record.codec}")
    samples = []
    for record_id, header in headers:
        tensors = {}
        for name, (start, end) in header.rows.items():
            if name not in fields or end > len(fields[name]):
                raise CorruptData(f"record {record_id}: tensor {name!r} rows [{start}, {end}) are missing")
            rows = fields[name][start:end]
            tensors[name] = rows.clone() if name in OPTIONAL_TENSORS else rows  # a capture keeps only its rows
        if "tokens" not in tensors or "loss_mask" not in tensors:
            raise CorruptData(f"record {record_id}: tokens or loss mask missing")
        sample = Sample(
            group_index=header.group_index,
            index=header.index,
            prompt_index=header.prompt_index,
            label=header.label,
            tokens=tensors["tokens"].tolist(),
            response=header.response,
            response_length=header.response_length,
            loss_mask=tensors["loss_mask"].tolist(),
            reward=header.reward,
            status=Status(header.status),
            rollout_log_probs=tensors["rollout_log_probs"].tolist() if "rollout_log_probs" in tensors else None,
            weight_versions=expand(header.version_segments),
            metadata=header.metadata,
            source=header.source,
            session_id=header.session_id,
        )
        for name in OPTIONAL_TENSORS:
            if name in tensors:
                setattr(sample, name, tensors[name])
        samples.append(sample)
    return samples
