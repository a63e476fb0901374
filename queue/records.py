"""Record codec: a group of samples <-> straw records (DESIGN §3).

Each sample becomes one header record (codec ``vime.sample.v1``: a msgspec struct with the scalar
fields, the metadata and the run-length weight versions) followed by its tensors as ``tensor.v1``
records (tokens, loss mask, sampler log-probs, and the optional R3 / score-centering captures).
straw checksums every record, so a corrupted payload fails loudly when it is read.

A capture whose rows do not match the tokens (R3 rows != len(tokens) - 1, score-centering rows !=
response_length) is refused here: it is never published, and the task retries from its last
durable prefix instead.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import torch
from straw import Record
from straw.errors import CorruptData
from straw.tensor import tensor_record

from vime.sample import Sample, Status

HEADER_CODEC = "vime.sample.v1"
CODECS = ("bytes.v1", "json.v1", "tensor.v1", HEADER_CODEC)

# Optional per-token captures and their stored dtype (None: keep the dtype given).
OPTIONAL_TENSORS = (
    "rollout_routed_experts",
    "rollout_topk_token_ids",
    "rollout_topk_log_probs",
    "rollout_topp_ids",
    "rollout_topp_offsets",
    "rollout_topp_log_probs",
)


class IncompleteCapture(ValueError):
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
    tensors: list[str]
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


def _as_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    return torch.as_tensor(np.asarray(value))


def check_capture(sample: Sample) -> None:
    """Raise IncompleteCapture when an optional capture does not match the sample's tokens."""
    if sample.rollout_routed_experts is not None:
        rows = len(sample.rollout_routed_experts)
        if rows != len(sample.tokens) - 1:
            raise IncompleteCapture(f"R3 capture has {rows} rows, expected len(tokens) - 1 = {len(sample.tokens) - 1}")
    for name in ("rollout_topk_token_ids", "rollout_topk_log_probs"):
        value = getattr(sample, name)
        if value is not None and len(value) != sample.response_length:
            raise IncompleteCapture(f"{name} has {len(value)} rows, expected response_length = "
                                    f"{sample.response_length}")
    if sample.rollout_topp_offsets is not None:
        rows = len(sample.rollout_topp_offsets) - 1
        if rows != sample.response_length:
            raise IncompleteCapture(f"top-p support covers {rows} tokens, expected {sample.response_length}")
    if len(sample.weight_versions) != sample.response_length:
        raise IncompleteCapture(f"{len(sample.weight_versions)} weight versions for "
                                f"{sample.response_length} response tokens")
    if sample.rollout_log_probs is not None and len(sample.rollout_log_probs) != sample.response_length:
        raise IncompleteCapture("rollout_log_probs must have one entry per response token")


def encode_sample(sample: Sample, record_prefix: str, owner: dict[str, str]) -> list[Record]:
    """Header + tensor records of one sample. ``owner`` (task_id, attempt_id) is stamped on each
    record: straw accepts a result only if every record belongs to the completing attempt."""
    check_capture(sample)
    tensors: dict[str, torch.Tensor] = {"tokens": torch.tensor(sample.tokens, dtype=torch.int32)}
    loss_mask = sample.loss_mask if sample.loss_mask is not None else [1] * sample.response_length
    tensors["loss_mask"] = torch.tensor(loss_mask, dtype=torch.uint8)
    if sample.rollout_log_probs is not None:
        tensors["rollout_log_probs"] = torch.tensor(sample.rollout_log_probs, dtype=torch.float32)
    for name in OPTIONAL_TENSORS:
        value = getattr(sample, name)
        if value is not None:
            tensors[name] = _as_tensor(value)
    header = SampleHeader(
        schema=1, group_index=sample.group_index, index=sample.index, prompt_index=sample.prompt_index,
        source_name=sample.source_name, response_length=sample.response_length,
        reward=None if sample.reward is None else float(sample.reward), status=sample.status.value,
        version_segments=run_length(sample.weight_versions), metadata=sample.metadata,
        session_id=sample.session_id, label=sample.label, response=sample.response,
        tensors=list(tensors), source=sample.source,
    )
    records = [Record(f"{record_prefix}:header", msgspec.msgpack.encode(header), HEADER_CODEC, dict(owner))]
    for name, value in tensors.items():
        record = tensor_record(value, f"{record_prefix}:{name}", kind=name)
        records.append(Record(record.record_id, record.payload, record.codec, {**record.metadata, **owner}))
    return records


def encode_group(samples: list[Sample], prefix: str, owner: dict[str, str]) -> list[Record]:
    records: list[Record] = []
    for sample in samples:
        records.extend(encode_sample(sample, f"{prefix}:s{sample.index}", owner))
    return records


def _tensor_from_record(record: Record) -> torch.Tensor:
    meta = record.metadata
    dtype = getattr(torch, meta["dtype"])
    if not record.payload:
        return torch.empty(meta["shape"], dtype=dtype)
    return torch.frombuffer(bytearray(record.payload), dtype=dtype).reshape(meta["shape"]).clone()


def decode_group(records: list[Record]) -> list[Sample]:
    """Inverse of encode_group. Raises CorruptData on anything that does not parse as written."""
    samples: list[Sample] = []
    position = 0
    while position < len(records):
        record = records[position]
        if record.codec != HEADER_CODEC:
            raise CorruptData(f"record {record.record_id}: expected a {HEADER_CODEC} header, got {record.codec}")
        try:
            header = msgspec.msgpack.decode(record.payload, type=SampleHeader)
        except msgspec.DecodeError as error:
            raise CorruptData(f"record {record.record_id}: unreadable sample header ({error})") from None
        if header.schema != 1:
            raise CorruptData(f"record {record.record_id}: unsupported sample schema {header.schema}")
        tensors = {}
        for offset, name in enumerate(header.tensors, start=1):
            if position + offset >= len(records) or records[position + offset].codec != "tensor.v1":
                raise CorruptData(f"record {record.record_id}: tensor {name!r} is missing")
            tensors[name] = _tensor_from_record(records[position + offset])
        position += 1 + len(header.tensors)
        sample = Sample(
            group_index=header.group_index, index=header.index, prompt_index=header.prompt_index,
            label=header.label, tokens=tensors["tokens"].tolist(), response=header.response,
            response_length=header.response_length, loss_mask=tensors["loss_mask"].tolist(),
            reward=header.reward, status=Status(header.status),
            rollout_log_probs=tensors["rollout_log_probs"].tolist() if "rollout_log_probs" in tensors else None,
            weight_versions=expand(header.version_segments), metadata=header.metadata, source=header.source,
            session_id=header.session_id,
        )
        for name in OPTIONAL_TENSORS:
            if name in tensors:
                setattr(sample, name, tensors[name])
        samples.append(sample)
    return samples
